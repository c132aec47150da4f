"""Model Runner V2 captures its CUDA graphs with no LoRA active: replays of LoRA batches drop the adapters.

Upstream: https://github.com/vllm-project/vllm/pull/35536 ("[Model Runner V2][Bugfix] Fix MRV2 LoRA
warmup"); the same defect is described by the (open) https://github.com/vllm-project/vllm/pull/41732
("[MRV2] enable lora for cuda graph", the ``FIXME(woosuk): Fix warmup for LoRA in Model Runner V2``).
Symptom: with ``VLLM_USE_V2_MODEL_RUNNER=1``, ``--enable-lora`` and CUDA graphs on, the LoRA kernels were
left out of warmup and capture ("the SGMV kernels [are] omitted ... leading to potential performance
degradation or runtime errors when actual LoRA requests arrived", #41732); the PR's test plan is the
multi-LoRA tests under MRV2 (vLLM main, February 2026). Here: LoRA requests get base-model outputs.
Mechanism: the Punica LoRA ops skip themselves on the host: ``_lora_shrink`` / ``_lora_expand`` start
with ``if no_lora_flag_cpu.item(): return``, where ``LoRAKernelMeta.prepare_tensors`` sets the CPU flag
when every entry of ``token_lora_mapping`` is -1. MRV2's ``CudaGraphManager.capture`` ran its dummy
batches without selecting dummy LoRAs, so every graph was captured while the flag said "no LoRA": the
early return ran once, at capture, and no shrink/expand kernel was recorded. Graphs were keyed by token
count only (no LoRA case), so a real batch with active adapters replays such a graph: the runner refreshes
``token_lora_mapping`` and the flag, but the graph holds no kernel that reads them, and the LoRA delta
is missing from every row. An eager step reads the flag again and applies the adapters.
Doctor: warmup-divergence, at ``_lora_shrink`` (the capture took the no-LoRA early return that an eager
LoRA step does not take).
Fix (upstream): ``create_lora_capture_hook`` runs ``maybe_select_dummy_loras(..., num_active_loras=n)``
before each capture, graphs are captured for each case of ``get_lora_capture_cases`` (``[0,
max_loras + 1]`` without ``cudagraph_specialize_lora``) under ``make_graph_key(num_tokens,
num_active_loras)``, and ``execute_model`` dispatches with ``get_num_active_loras_for_dispatch``: LoRA
batches replay a graph whose capture recorded the LoRA kernels.
Read: the PR's review thread (the hook and the dispatch line) and ``vllm/v1/worker/gpu/lora_utils.py``
after the fix; the pre-fix capture path is reconstructed from them and from the FIXME / #41732's text.
"""
from __future__ import annotations

import bisect
import contextlib

import torch

from workbench.engine import host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/35536"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "_lora_shrink"
SYMPTOM = "MRV2 + LoRA + CUDA graphs: LoRA requests get base-model outputs (adapter ignored)"

VOCAB, DIM, RANK, MAX_LORAS = 16, 4, 2, 2
CAPTURE_SIZES = [2, 4]
MAX_NUM_TOKENS = max(CAPTURE_SIZES)
NO_LORA_ID = 0                               # LoraState: a request without adapter


class LoRAKernelMeta:
    """Persistent Punica metadata: the per-token slot mapping on the device and the host no-LoRA flag."""

    def __init__(self, device):
        self.token_lora_mapping = torch.full((MAX_NUM_TOKENS,), -1, dtype=torch.long, device=device)
        self.no_lora_flag_cpu = host(torch.zeros(1, dtype=torch.bool), device)

    def prepare_tensors(self, token_lora_mapping: list[int]) -> None:
        n = len(token_lora_mapping)
        mapping = torch.tensor(token_lora_mapping, dtype=torch.long)
        self.token_lora_mapping[:n].copy_(mapping.to(self.token_lora_mapping.device))
        self.token_lora_mapping[n:].fill_(-1)
        self.no_lora_flag_cpu[0] = bool((mapping == -1).all())


def _lora_shrink(inputs, lora_a_weights, output_tensor, token_lora_mapping, no_lora_flag_cpu, scaling):
    """``output[t] = scaling * A[slot(t)] @ x[t]`` for tokens with an adapter (slot -1: none)."""
    if no_lora_flag_cpu.item():
        # None of the inputs require LoRA.
        return
    m = inputs.shape[0]
    slots = token_lora_mapping[:m]
    a = lora_a_weights[slots.clamp(min=0)]                       # [m, RANK, DIM]
    shrunk = (a @ inputs[:, :, None]).squeeze(-1) * scaling
    output_tensor.copy_(torch.where((slots >= 0)[:, None], shrunk, torch.zeros_like(shrunk)))


def _lora_expand(inputs, lora_b_weights, output_tensor, token_lora_mapping, no_lora_flag_cpu):
    """``output[t] += B[slot(t)] @ shrunk[t]`` for tokens with an adapter."""
    if no_lora_flag_cpu.item():
        return
    m = inputs.shape[0]
    slots = token_lora_mapping[:m]
    b = lora_b_weights[slots.clamp(min=0)]                       # [m, DIM, RANK]
    expanded = (b @ inputs[:, :, None]).squeeze(-1)
    output_tensor.add_(torch.where((slots >= 0)[:, None], expanded, torch.zeros_like(expanded)))


class PunicaWrapperGPU:
    def __init__(self, device):
        self.token_mapping_meta = LoRAKernelMeta(device)

    def add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale):
        meta = self.token_mapping_meta
        buffer = torch.zeros(x.shape[0], RANK, device=x.device)
        _lora_shrink(x, lora_a_stacked, buffer, meta.token_lora_mapping, meta.no_lora_flag_cpu, scale)
        _lora_expand(buffer, lora_b_stacked, y, meta.token_lora_mapping, meta.no_lora_flag_cpu)


class ColumnParallelLinearWithLoRA:
    """A base projection plus ``max_loras`` adapter slots (``lora_a_stacked`` / ``lora_b_stacked``)."""

    def __init__(self, weight, punica_wrapper, device):
        self.weight = weight
        self.punica_wrapper = punica_wrapper
        self.lora_a_stacked = torch.zeros(MAX_LORAS, RANK, DIM, device=device)
        self.lora_b_stacked = torch.zeros(MAX_LORAS, DIM, RANK, device=device)

    def set_lora(self, index, lora_a, lora_b):
        self.lora_a_stacked[index].copy_(lora_a)
        self.lora_b_stacked[index].copy_(lora_b)

    def forward(self, x):
        y = x @ self.weight.t()
        self.punica_wrapper.add_lora_linear(y, x, self.lora_a_stacked, self.lora_b_stacked, 1.0)
        return y


class Model:
    def __init__(self, device):
        gen = generator(35536)
        self.embed_tokens = randn(VOCAB, DIM, gen=gen, device=device)
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)
        self.punica_wrapper = PunicaWrapperGPU(device)
        self.qkv_proj = ColumnParallelLinearWithLoRA(randn(DIM, DIM, gen=gen, device=device, scale=0.5),
                                                     self.punica_wrapper, device)
        # Two adapters a client may name (lora_int_id 1 and 2).
        self.adapters = {i: (randn(RANK, DIM, gen=gen, device=device), randn(DIM, RANK, gen=gen, device=device))
                         for i in (1, 2)}

    def forward(self, input_ids):
        h = self.embed_tokens[input_ids]
        return torch.tanh(self.qkv_proj.forward(h)) @ self.lm_head


def get_lora_capture_cases(max_loras: int) -> list[int]:
    """Without ``cudagraph_specialize_lora``: the no-LoRA case and the all-slots case."""
    return [0, max_loras + 1]


def resolve_effective_num_active_loras(num_active_loras: int, cases: list[int]) -> int:
    if num_active_loras <= 0:
        return num_active_loras
    with_lora = [c for c in cases if c > 0]
    idx = bisect.bisect_left(with_lora, num_active_loras)
    return with_lora[min(idx, len(with_lora) - 1)]


def make_graph_key(num_tokens: int, num_active_loras: int = 0) -> tuple[int, int]:
    return (num_tokens, num_active_loras)


class GPUModelRunner:
    def __init__(self, model, device, variant, graphed):
        self.model, self.device, self.variant, self.graphed = model, device, variant, graphed
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.slot_of = {}                        # lora_int_id -> adapter slot of the stacked weights
        self.graphs = {}

    # --- LoRA state (LoRAModelRunnerMixin) ---
    def set_active_loras(self, token_lora_ids: list[int]) -> None:
        for lora_id in sorted(set(token_lora_ids) - {NO_LORA_ID}):
            if lora_id not in self.slot_of:      # activate the adapter in a free slot
                slot = len(self.slot_of)
                self.model.qkv_proj.set_lora(slot, *self.model.adapters[lora_id])
                self.slot_of[lora_id] = slot
        mapping = [self.slot_of[i] if i != NO_LORA_ID else -1 for i in token_lora_ids]
        self.model.punica_wrapper.token_mapping_meta.prepare_tensors(mapping)

    @contextlib.contextmanager
    def maybe_select_dummy_loras(self, num_tokens: int, num_active_loras: int):
        """Dummy batch for capture: ``num_active_loras`` > 0 gives every token an adapter slot."""
        if num_active_loras > 0:
            mapping = [i % MAX_LORAS for i in range(num_tokens)]
        else:
            mapping = [-1] * num_tokens
        self.model.punica_wrapper.token_mapping_meta.prepare_tensors(mapping)
        yield

    def create_lora_capture_hook(self):
        def hook(num_active_loras: int, num_tokens: int) -> None:
            with self.maybe_select_dummy_loras(num_tokens, num_active_loras):
                pass
        return hook

    # --- CUDA graphs (CudaGraphManager) ---
    def capture_model(self):
        meta = self.model.punica_wrapper.token_mapping_meta
        if self.variant == "fix":
            lora_cases, capture_hook = get_lora_capture_cases(MAX_LORAS), self.create_lora_capture_hook()
        else:
            lora_cases, capture_hook = [0], None  # FIXME(woosuk): Fix warmup for LoRA in MRV2
        for num_tokens in CAPTURE_SIZES:
            for num_active_loras in lora_cases:
                self.input_ids[:num_tokens].zero_()              # dummy batch
                if capture_hook is not None:
                    capture_hook(num_active_loras, num_tokens)
                else:
                    self.set_active_loras([NO_LORA_ID] * num_tokens)   # dummy requests have no adapter
                fn = lambda n=num_tokens: self.model.forward(self.input_ids[:n])  # noqa: E731
                self.graphs[make_graph_key(num_tokens, num_active_loras)] = capture(
                    fn, device=self.device, name=f"FULL {num_tokens} tokens, {num_active_loras} loras",
                    static={"input_ids": self.input_ids, "token_lora_mapping": meta.token_lora_mapping},
                    state={"lora_a_stacked": self.model.qkv_proj.lora_a_stacked,
                           "lora_b_stacked": self.model.qkv_proj.lora_b_stacked},
                    owner="CudaGraphManager (MRV2 FULL graphs)")

    def execute_model(self, tokens: list[int], lora_ids: list[int]):
        n = len(tokens)
        self.input_ids[:n].copy_(torch.tensor(tokens, dtype=torch.long).to(self.device))
        self.set_active_loras(lora_ids)
        if not self.graphed:
            return self.model.forward(self.input_ids[:n]).clone()
        size = next(s for s in CAPTURE_SIZES if s >= n)
        if self.variant == "fix":
            num_active = len(set(lora_ids) - {NO_LORA_ID})   # get_num_active_loras_for_dispatch
            key = make_graph_key(size, resolve_effective_num_active_loras(
                num_active, get_lora_capture_cases(MAX_LORAS)))
        else:
            key = make_graph_key(size)
        g, out = self.graphs[key]
        return replay(g, out, real=n, size=size, padded={"input_ids": self.input_ids})[:n].clone()


def run(variant: str, device: str = "cpu"):
    model = Model(device)

    def serve(graphed: bool):
        runner = GPUModelRunner(model, device, variant, graphed)
        if graphed:
            runner.capture_model()
        outs = []
        outs.append(runner.execute_model([3, 7, 1], [NO_LORA_ID, 1, 2]))      # two adapters + base
        outs.append(runner.execute_model([5, 9], [NO_LORA_ID, NO_LORA_ID]))   # base only
        outs.append(runner.execute_model([2, 2, 8, 4], [2, 2, NO_LORA_ID, 1]))
        outs.append(runner.execute_model([11, 6], [1, NO_LORA_ID]))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
