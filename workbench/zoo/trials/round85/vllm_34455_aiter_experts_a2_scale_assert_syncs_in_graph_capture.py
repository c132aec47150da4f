"""AITER fused-MoE experts under CUDA graph capture: ``AiterExperts.apply`` asserts ``a2_scale == self.quant_config.a2_scale`` on a device tensor, a host read the capturing stream refuses.

Upstream: https://github.com/vllm-project/vllm/pull/34455 ("[Bugfix] Remove assert causing
hipErrorStreamCaptureUnsupported", vllm-project/vllm, merged 2026-02, listed in the v0.16 release notes). Read: the PR
description (error text, reproduction command, and that the asserts came in with #31102 "[MoE Refactor][7/N] AITER MK",
whose test plan ran ``--enforce-eager``), a stored pre-fix ``vllm/model_executor/layers/fused_moe/rocm_aiter_fused_moe.py``
whose ``AiterExperts.apply`` begins with ``assert a1q_scale is None`` / ``assert a2_scale ==
self.quant_config.a2_scale`` / ``assert expert_tokens_meta is None`` and ends with ``assert result.shape ==
output.shape``, and later stored versions in which ``apply`` has no asserts (only the TODO about the static a_scales
remains). The PR's diff itself was not read; the fix is modelled as the removal of those asserts.
Symptom: ``VLLM_ROCM_USE_AITER=1 VLLM_ROCM_USE_AITER_MHA=0 vllm serve amd/Mixtral-8x7B-Instruct-v0.1-FP8-KV --dtype
float16 -tp 8`` dies during CUDA graph capture with ``RuntimeError: Worker failed with error 'HIP error: operation not
permitted when stream is capturing'``; with ``--enforce-eager`` the model serves.
Mechanism: the FP8 (static per-tensor) Mixtral MoE layer runs through ``FusedMoEModularKernel.forward``:
``MoEPrepareAndFinalizeNoEP.prepare`` leaves the input unquantized (AITER quantizes inside its fused kernel), then
``AiterExperts.apply`` is called with ``a2_scale=self.fused_experts.a2_scale``, i.e. the quant config's static
activation-scale tensor. Its ``assert a2_scale == self.quant_config.a2_scale`` compares two device tensors and hands
the result to Python's ``assert``, which calls ``bool()``: a device-to-host read. Eagerly that is only a sync and
passes; inside the captured region (the MoE op is not a graph splitting op, so it is captured) the read is an
operation the capturing stream forbids, and capture aborts at the first capture size.
Doctor: sync-in-capture, at apply. The assert's ``bool()`` of a device comparison needs the device's value on the
host while the stream is capturing.
Fix (upstream): drop the asserts from ``AiterExperts.apply`` (the static a_scales stay read from the quant config).
Modelled: ``FusedMoEModularKernel.forward`` with ``MoEPrepareAndFinalizeNoEP`` (prepare defers quantization, finalize
copies), ``AiterExperts`` (``a2_scale`` from its quant config, ``workspace_shapes``, ``apply``),
``rocm_aiter_fused_experts`` and a torch stand-in for ``rocm_aiter_ops.fused_moe`` (static per-tensor FP8: activations
quantized with a1/a2 scales, FP8 weights with per-expert scales, SiLU-and-mul, top-k weighted combine over a dense
expert loop), ``FusedMoE`` routing (softmax top-2, renormalized), and a V1-style runner that warms up and captures
the forward for each capture size (largest first) over its persistent ``input_ids`` buffer and pads each step to a
captured size. Stand-ins: FP8 is emulated by rounding to a 1/16 grid of the scale and clamping at 448; there is no
attention (the MoE block is the captured piece). Sizes: hidden 8, intermediate 8, 4 experts, top-2, vocab 16
(float64), capture sizes [2, 4].
Workload: capture graphs for 4 and 2 tokens, then serve three decode steps of 2, 3 (padded to 4) and 4 tokens. The
bug's first capture (4 tokens) raises at the assert; eager serves all three steps. The fix captures both sizes and
every step equals eager.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/34455"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "apply"
SYMPTOM = ("Mixtral FP8 with VLLM_ROCM_USE_AITER=1: CUDA graph capture fails with 'operation not permitted when stream "
           "is capturing' because AiterExperts.apply asserts a2_scale == quant_config.a2_scale, a bool() of a device "
           "tensor inside the captured MoE forward; --enforce-eager works")

HIDDEN, INTERMEDIATE, NUM_EXPERTS, TOP_K, VOCAB = 8, 8, 4, 2, 16
CUDAGRAPH_CAPTURE_SIZES = [2, 4]
MAX_NUM_TOKENS = max(CUDAGRAPH_CAPTURE_SIZES)
FP8_MAX = 448.0

_variant = "bug"


def _fp8_static_quant_dequant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Stand-in for a static per-tensor FP8 cast and its dequantization (grid of scale / 16)."""
    return (torch.round(x / scale * 16) / 16).clamp(-FP8_MAX, FP8_MAX) * scale


# --- vllm/model_executor/layers/fused_moe/config.py ----------------------------------------------------------

@dataclasses.dataclass
class FusedMoEQuantConfig:
    w1_scale: torch.Tensor      # [E] per-expert per-tensor weight scales
    w2_scale: torch.Tensor
    a1_scale: torch.Tensor      # [1] static activation scales
    a2_scale: torch.Tensor
    use_fp8_w8a8: bool = True


# --- vllm/_aiter_ops.py: rocm_aiter_ops.fused_moe (stand-in for the AITER CK/asm kernel) ----------------------

def aiter_fused_moe(hidden_states, w1, w2, topk_weights, topk_ids, w1_scale, w2_scale, a1_scale, a2_scale):
    x = _fp8_static_quant_dequant(hidden_states, a1_scale)
    w1_deq = w1 * w1_scale.view(-1, 1, 1)
    w2_deq = w2 * w2_scale.view(-1, 1, 1)
    gate_up = torch.einsum("td,efd->tef", x, w1_deq)                      # [T, E, 2I]
    gate, up = gate_up.chunk(2, dim=-1)
    act = _fp8_static_quant_dequant(F.silu(gate) * up, a2_scale)
    y = torch.einsum("tei,edi->ted", act, w2_deq)                        # [T, E, D]
    weights = torch.zeros(hidden_states.shape[0], w1.shape[0], dtype=y.dtype, device=y.device)
    weights = weights.scatter_add(1, topk_ids, topk_weights)
    return (y * weights.unsqueeze(-1)).sum(1)


# --- vllm/model_executor/layers/fused_moe/rocm_aiter_fused_moe.py ---------------------------------------------

def rocm_aiter_fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, activation="silu",
                             apply_router_weight_on_input=False, expert_map=None, quant_config=None):
    assert activation == "silu" and expert_map is None and not apply_router_weight_on_input
    # Currently only per tensor quantization method is enabled.
    return aiter_fused_moe(hidden_states, w1, w2, topk_weights, topk_ids,
                           w1_scale=quant_config.w1_scale, w2_scale=quant_config.w2_scale,
                           a1_scale=quant_config.a1_scale, a2_scale=quant_config.a2_scale)


class TopKWeightAndReduceNoOP:
    def apply(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input):
        output.copy_(fused_expert_output)


class AiterExperts:
    def __init__(self, quant_config: FusedMoEQuantConfig):
        self.quant_config = quant_config

    @property
    def a2_scale(self):
        return self.quant_config.a2_scale

    @property
    def expects_unquantized_inputs(self) -> bool:
        return True          # AITER quantizes the input inside its fused kernel

    def finalize_weight_and_reduce_impl(self):
        return TopKWeightAndReduceNoOP()

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta):
        # Workspaces are managed internally by AITER.
        return (0,), (0,), (M, K)

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        # TODO(rob): rocm_aiter_fused_experts uses self.quant_config's
        # a_scales for static quantization. Update this to fit better
        # with the interface once all quant integrations are complete.
        if _variant == "bug":       # added by #31102, removed by #34455
            assert a1q_scale is None
            assert a2_scale == self.quant_config.a2_scale         # bool() of a device tensor: a host read
            assert expert_tokens_meta is None
        result = rocm_aiter_fused_experts(
            hidden_states=hidden_states, w1=w1, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids,
            activation=activation, apply_router_weight_on_input=apply_router_weight_on_input,
            expert_map=expert_map, quant_config=self.quant_config)
        if _variant == "bug":
            assert result.shape == output.shape
        output.copy_(result)


# --- vllm/model_executor/layers/fused_moe/modular_kernel.py ---------------------------------------------------

class MoEPrepareAndFinalizeNoEP:
    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
                quant_config, defer_input_quant=False):
        if defer_input_quant:
            return a1, None, None, None, None
        raise NotImplementedError("only the deferred-quantization path is modelled")

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
                 weight_and_reduce_impl):
        weight_and_reduce_impl.apply(output, fused_expert_output, topk_weights, topk_ids,
                                     apply_router_weight_on_input)


class FusedMoEModularKernel:
    def __init__(self, prepare_finalize, fused_experts):
        self.prepare_finalize, self.fused_experts = prepare_finalize, fused_experts

    def forward(self, hidden_states, w1, w2, topk_weights, topk_ids, activation="silu", global_num_experts=-1,
                expert_map=None, apply_router_weight_on_input=False):
        output = torch.empty_like(hidden_states)
        a1q, a1q_scale, expert_tokens_meta, _, _ = self.prepare_finalize.prepare(
            hidden_states, topk_weights, topk_ids, global_num_experts, expert_map, apply_router_weight_on_input,
            self.fused_experts.quant_config, defer_input_quant=self.fused_experts.expects_unquantized_inputs)
        M, K = a1q.shape
        ws13, ws2, out_shape = self.fused_experts.workspace_shapes(M, w2.shape[-1], K, topk_ids.shape[1],
                                                                   global_num_experts, w1.shape[0], None)
        workspace13 = torch.empty(ws13, dtype=a1q.dtype, device=a1q.device)
        workspace2 = torch.empty(ws2, dtype=a1q.dtype, device=a1q.device)
        fused_out = torch.empty(out_shape, dtype=a1q.dtype, device=a1q.device)
        self.fused_experts.apply(fused_out, a1q, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                                 expert_map, a1q_scale, self.fused_experts.a2_scale, workspace13, workspace2,
                                 expert_tokens_meta, apply_router_weight_on_input)
        self.prepare_finalize.finalize(output, fused_out, topk_weights, topk_ids, apply_router_weight_on_input,
                                       self.fused_experts.finalize_weight_and_reduce_impl())
        return output


# --- vllm/model_executor/layers/fused_moe/layer.py + the Mixtral block ----------------------------------------

class FusedMoE:
    def __init__(self, gen, device):
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).double()  # noqa: E731
        self.gate = r(HIDDEN, NUM_EXPERTS)
        w1 = r(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN)
        w2 = r(NUM_EXPERTS, HIDDEN, INTERMEDIATE)
        w1_scale = w1.abs().amax(dim=(1, 2)) / FP8_MAX * 64
        w2_scale = w2.abs().amax(dim=(1, 2)) / FP8_MAX * 64
        self.w13_weight = _fp8_static_quant_dequant(w1 / w1_scale.view(-1, 1, 1), torch.ones((), device=device,
                                                                                                dtype=w1.dtype))
        self.w2_weight = _fp8_static_quant_dequant(w2 / w2_scale.view(-1, 1, 1), torch.ones((), device=device,
                                                                                               dtype=w2.dtype))
        quant_config = FusedMoEQuantConfig(
            w1_scale=w1_scale, w2_scale=w2_scale,
            a1_scale=torch.full((1,), 0.05, device=device, dtype=torch.float64),
            a2_scale=torch.full((1,), 0.02, device=device, dtype=torch.float64))
        self.quant_method = FusedMoEModularKernel(MoEPrepareAndFinalizeNoEP(), AiterExperts(quant_config))

    def select_experts(self, hidden_states):
        router_logits = hidden_states @ self.gate
        topk_weights, topk_ids = torch.softmax(router_logits, -1).topk(TOP_K, dim=-1)
        return topk_weights / topk_weights.sum(-1, keepdim=True), topk_ids

    def __call__(self, hidden_states):
        topk_weights, topk_ids = self.select_experts(hidden_states)
        return self.quant_method.forward(hidden_states, self.w13_weight, self.w2_weight, topk_weights, topk_ids,
                                         activation="silu", global_num_experts=NUM_EXPERTS)


class MixtralForCausalLM:
    def __init__(self, device):
        gen = generator(34455)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device).double()
        self.block_sparse_moe = FusedMoE(gen, device)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.8).double()

    def forward(self, input_ids):
        h = self.embed_tokens[input_ids]
        h = h + self.block_sparse_moe(h)
        return h @ self.lm_head


# --- vllm/v1/worker/gpu_model_runner.py (graph capture and padding) -------------------------------------------

class GPUModelRunner:
    def __init__(self, device, use_cuda_graph):
        self.device = device
        self.model = MixtralForCausalLM(device)
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple] = {}
        if use_cuda_graph:
            self.capture_model()

    def capture_model(self):
        for num_tokens in sorted(CUDAGRAPH_CAPTURE_SIZES, reverse=True):      # largest first
            g, out = capture(lambda n=num_tokens: self.model.forward(self.input_ids[:n]), device=self.device,
                             warmups=1, name=f"{num_tokens} tokens", owner="CUDAGraphWrapper",
                             static={"input_ids": self.input_ids})
            self.graphs[num_tokens] = (g, out)

    def execute_model(self, token_ids):
        num_tokens = token_ids.shape[0]
        self.input_ids[:num_tokens].copy_(token_ids)
        if self.graphs:
            padded = next(s for s in sorted(CUDAGRAPH_CAPTURE_SIZES) if s >= num_tokens)
            g, out = self.graphs[padded]
            logits = replay(g, out, real=num_tokens, size=padded, padded={"input_ids": self.input_ids[:padded]})
        else:
            logits = self.model.forward(self.input_ids[:num_tokens])
        return logits[:num_tokens].clone()


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(2026)
    steps = [torch.randint(0, VOCAB, (n,), generator=gen).to(device) for n in (2, 3, 4)]

    def serve(use_cuda_graph):
        runner = GPUModelRunner(device, use_cuda_graph)
        return [runner.execute_model(ids) for ids in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
