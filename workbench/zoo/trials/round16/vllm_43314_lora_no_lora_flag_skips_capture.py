"""The capture's all ``-1`` dummy LoRA mapping sets ``no_lora_flag_cpu``: the LoRA kernels never enter the graph.

Upstream: https://github.com/vllm-project/vllm/pull/43314 ("[CI] Fix test_lora_with_spec_decode on V2 model
runner").
Symptom: with the V2 model runner and FULL CUDA graphs, LoRA requests are served as if no adapter were
loaded: ``tests/v1/e2e/spec_decode/test_lora_with_spec_decode.py::test_batch_inference_correctness``
dropped from 100/100 to 76/100 matches once #43139 landed (vLLM main, May 2026); eager mode is correct.
Mechanism: the V2 runner's dummy run (warmup and capture) activates ``LoRAMapping(0, 0)``, which
resolves to all ``-1`` token indices; ``LoRAKernelMeta.prepare_tensors`` therefore sets the host flag
``no_lora_flag_cpu = True``. The Python wrappers ``lora_shrink``/``lora_expand`` test that flag with
``.item()`` and return before launching anything, so the capture records no LoRA kernel at all.
Replays re-run only the recorded kernels: when a real batch later maps its tokens to an adapter slot
(and ``prepare_tensors`` clears the flag), no Python runs, and the LoRA delta is silently skipped.
Doctor: warmup-divergence, at ``lora_shrink`` (the branch on the host flag was decided at capture;
replays keep it while an eager step now takes the other side).
Fix (upstream): ``PunicaWrapperBase.prepare_for_cudagraph_capture()`` sets ``no_lora_flag_cpu = False``
and ``num_active_loras_cpu = 1`` before capture while leaving ``active_lora_ids`` all ``-1``: the kernels
are recorded, each program exits on ``lora_id == -1`` at capture, and at replay reads the slot ids the
real step wrote.
"""
from __future__ import annotations

import torch

from workbench.engine import host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/43314"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "lora_shrink"
SYMPTOM = "FULL-graph LoRA requests get base-model outputs: the capture recorded no LoRA kernels"
HIDDEN, OUT, RANK, MAX_LORAS, MAX_TOKENS = 6, 5, 2, 2, 4


class LoRAKernelMeta:
    """Persistent metadata the punica kernels read (device buffers) plus the host-side launch flags."""

    def __init__(self, device):
        self.token_lora_mapping = torch.full((MAX_TOKENS,), -1, dtype=torch.long, device=device)
        self.active_lora_ids = torch.full((MAX_LORAS + 1,), -1, dtype=torch.long, device=device)
        self.no_lora_flag_cpu = host(torch.zeros(1, dtype=torch.bool), device)
        self.num_active_loras_cpu = host(torch.zeros(1, dtype=torch.int32), device)

    def prepare_tensors(self, token_lora_mapping: list[int]):
        n = len(token_lora_mapping)
        dev = self.token_lora_mapping.device
        self.token_lora_mapping[:n].copy_(torch.tensor(token_lora_mapping, device=dev))
        self.token_lora_mapping[n:].fill_(-1)
        no_lora = all(i == -1 for i in token_lora_mapping)
        self.no_lora_flag_cpu[0] = no_lora
        ids = sorted({i for i in token_lora_mapping if i != -1})
        self.active_lora_ids.fill_(-1)
        if ids:
            self.active_lora_ids[:len(ids)].copy_(torch.tensor(ids, device=dev))
        self.num_active_loras_cpu[0] = len(ids)

    def meta_args(self, num_tokens: int):
        return (self.token_lora_mapping[:num_tokens], self.active_lora_ids, self.no_lora_flag_cpu,
                self.num_active_loras_cpu)


def lora_shrink(inputs, lora_a_weights, output_tensor, token_lora_mapping, lora_ids, no_lora_flag_cpu,
                num_active_loras_cpu, scaling):
    """y = (x @ A[lora].T) * scale per token; the Python wrapper around the Triton kernel."""
    if no_lora_flag_cpu.item():
        return
    output_tensor.zero_()
    for i in range(int(num_active_loras_cpu.item())):          # grid dim: one program per active LoRA
        lora_id = lora_ids[i]
        mask = ((token_lora_mapping == lora_id) & (lora_id >= 0)).to(inputs.dtype)[:, None]
        lora_a = lora_a_weights.index_select(0, lora_id.clamp(min=0).view(1))[0]
        output_tensor.add_(mask * (inputs @ lora_a.t()) * scaling)


def lora_expand(inputs, lora_b_weights, output_tensor, token_lora_mapping, lora_ids, no_lora_flag_cpu,
                num_active_loras_cpu):
    """y += buffer @ B[lora].T per token (add_inputs=True)."""
    if no_lora_flag_cpu.item():
        return
    for i in range(int(num_active_loras_cpu.item())):
        lora_id = lora_ids[i]
        mask = ((token_lora_mapping == lora_id) & (lora_id >= 0)).to(inputs.dtype)[:, None]
        lora_b = lora_b_weights.index_select(0, lora_id.clamp(min=0).view(1))[0]
        output_tensor.add_(mask * (inputs @ lora_b.t()))


class PunicaWrapperGPU:
    def __init__(self, device):
        self.token_mapping_meta = LoRAKernelMeta(device)

    def prepare_for_cudagraph_capture(self):
        """The fix: launch the kernels at capture; each program exits on lora_id == -1."""
        self.token_mapping_meta.no_lora_flag_cpu[0] = False
        self.token_mapping_meta.num_active_loras_cpu[0] = 1

    def add_lora_linear(self, y, x, lora_a, lora_b, scale):
        buffer = torch.empty((x.size(0), RANK), dtype=torch.float32, device=x.device)
        lora_shrink(x, lora_a, buffer, *self.token_mapping_meta.meta_args(x.size(0)), scale)
        lora_expand(buffer, lora_b, y, *self.token_mapping_meta.meta_args(x.size(0)))


class ColumnParallelLinearWithLoRA:
    def __init__(self, device, punica_wrapper):
        gen = generator(43314)
        self.weight = randn(OUT, HIDDEN, gen=gen, device=device, scale=0.5)
        self.lora_a_stacked = randn(MAX_LORAS, RANK, HIDDEN, gen=gen, device=device)
        self.lora_b_stacked = randn(MAX_LORAS, OUT, RANK, gen=gen, device=device)
        self.punica_wrapper = punica_wrapper

    def forward(self, x):
        output = x @ self.weight.t()
        self.punica_wrapper.add_lora_linear(output, x, self.lora_a_stacked, self.lora_b_stacked, 0.5)
        return output


def run(variant: str, device: str = "cpu"):
    gen = generator(1)
    batches = [(randn(3, HIDDEN, gen=gen, device=device), [0, -1, 0]),     # one adapter (slot 0) + a base request
               (randn(4, HIDDEN, gen=gen, device=device), [1, 1, -1, 1])]  # another adapter (slot 1)

    def serve(graphed: bool):
        punica = PunicaWrapperGPU(device)
        layer = ColumnParallelLinearWithLoRA(device, punica)
        meta = punica.token_mapping_meta
        x_buf = torch.zeros(MAX_TOKENS, HIDDEN, device=device)
        outs = []
        if graphed:
            # V2 runner dummy run: LoRAMapping(0, 0) -> every token index is -1 (no adapter).
            meta.prepare_tensors([-1] * MAX_TOKENS)
            if variant == "fix":
                punica.prepare_for_cudagraph_capture()
            g, out = capture(lambda: layer.forward(x_buf), device=device,
                             static={"input_ids": x_buf, "token_lora_mapping": meta.token_lora_mapping,
                                     "active_lora_ids": meta.active_lora_ids},
                             owner="GPUModelRunner V2 (FULL decode graph)")
        for x, mapping in batches:
            n = x.shape[0]
            padded = mapping + [-1] * (MAX_TOKENS - n)
            meta.prepare_tensors(padded if graphed else mapping)
            if not graphed:
                outs.append(layer.forward(x).clone())
                continue
            x_buf[:n].copy_(x)
            x_buf[n:].zero_()
            outs.append(replay(g, out, real=n, size=MAX_TOKENS, padded={})[:n].clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
