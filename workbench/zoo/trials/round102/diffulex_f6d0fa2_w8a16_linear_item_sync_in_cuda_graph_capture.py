"""Diffulex: every quantized Linear's forward asks ``bool(self._weight_is_quantized.item())``, a device-to-host sync that makes the decode CUDA-graph capture fail.

Upstream: https://github.com/SJTU-DENG-Lab/Diffulex/commit/f6d0fa296e48eae387b63f16b1528061c5e7a877
("refactor: remove CUDA Graph blockers and simplify linear quantization strategies", SJTU-DENG-Lab/Diffulex, the
diffusion-LLM inference engine; commit on main of 2026-01-25, no PR; the blockers came in with 9ba300d of 2025-12-31,
"implement load-time quantization and memory-saving for W8A16 Linear layers"). Read: the commit message ("Remove all
.item() calls in LinearBase hot paths (GPU->CPU sync breaks graph capture); add Python-side meta cache
(_offline_quant_*_py, _gptq_is_shuffled_py, etc.); use in-place fill_() + Python mirrors for state updates"), its diff
of ``diffulex/layer/linear.py``, the pre-fix ``linear.py`` (``LinearBase.__init__`` buffers, ``has_quantized_weight``,
``has_offline_quantized_weight``, ``set_quantized_weight``, ``_maybe_promote_weight_to_quantized_at_runtime``,
``_maybe_quantize_loaded_weight_param``, ``_forward_base``, ``ReplicatedLinear``), the pre-fix
``strategies/linear_marlin_int8_w8a16.py`` (``quantize``, ``linear_forward`` and its fallback) and the pre-fix
``strategy/block_diffusion/engine/model_runner.py`` (``BDModelRunner.run_model`` and ``capture_cudagraph``).
Symptom: with a W8A16 (int8 weight) strategy configured, ``BDModelRunner.capture_cudagraph`` dies at start-up inside
``torch.cuda.graph`` ("operation not permitted when stream is capturing"): decode cannot be served by CUDA graphs at
all; eager mode (``enforce_eager``) works.
Mechanism: the int8 weights, their scales and the flag ``_weight_is_quantized`` are registered buffers, so they live on
the GPU. ``_forward_base`` runs for every Linear of every forward and asks ``has_offline_quantized_weight()`` (an
``.item()`` of ``_offline_quant_format`` when it is set) and ``has_quantized_weight()``, which is
``bool(self._weight_is_quantized.item())``: a device-to-host copy and a stream sync. Eagerly that is a stall per
layer; inside the capture of the first decode graph (one warm-up, then ``torch.cuda.graph``) CUDA refuses it.
Doctor: sync-in-capture, at has_quantized_weight (its ``.item()`` is the first host read of device data inside the
captured forward; the commit replaced exactly this read by a Python mirror).
Fix (upstream): Python mirrors of the metadata (``_weight_is_quantized_py``, ``_offline_quant_format_py``, ...), set
where the weights are set (``set_quantized_weight``, ``set_offline_quantized_weight``) next to an in-place ``fill_`` of
the device flag; the hot-path predicates read the mirrors, so the captured forward holds only kernels.
Modelled: ``LinearBase`` (the buffers above, the two predicates, ``set_quantized_weight`` with its 1xN scale view,
load-time quantization in ``_maybe_quantize_loaded_weight_param``, the runtime promotion check, ``_forward_base`` for
the online-quantized and bf16 paths), ``ReplicatedLinear``, the W8A16 strategy (per-output-channel symmetric int8,
``y = (x @ q^T) * scales_1xn + bias``, the kernel's fallback), ``BDModelRunner.capture_cudagraph`` / ``run_model`` as
read (graph_vars zeroed and refilled, buckets ``num_seqs * diffusion_block_size``, one warm-up, shared pool, logits
computed eagerly after replay). Stand-ins: the model (embedding plus positions, one block of attention within each
diffusion block of the same sequence, a gated MLP; every projection a quantized ``ReplicatedLinear``; lm_head kept in
float), the block-diffusion metadata reduced to ``cu_seqlens_q``, no KV cache, float64 instead of bf16.
Workload: 8 max sequences, diffusion block 4, graphs for 1, 2, 4 and 8 sequences; four decode steps of 3, 1, 6 and 2
sequences (padded to 4, 1, 8, 2); eager reference runs the same steps. Bug: the first capture (8 sequences, 32
tokens) raises CaptureError at ``.item()`` in ``has_quantized_weight``; fix: all 48 logits rows equal eager (0).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/SJTU-DENG-Lab/Diffulex/commit/f6d0fa296e48eae387b63f16b1528061c5e7a877"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "has_quantized_weight"
SYMPTOM = ("W8A16-quantized Diffulex model: decode CUDA-graph capture fails on bool(_weight_is_quantized.item()) "
           "in every Linear's forward (a device-to-host sync while the stream captures)")

VOCAB, HIDDEN, INTER, NUM_HEADS = 32, 16, 32, 2
DIFFUSION_BLOCK_SIZE, MAX_NUM_SEQS, MAX_MODEL_LEN = 4, 8, 64
DTYPE = torch.float64

_variant = "bug"


# --- diffulex/utils/quantization/strategies/linear_marlin_int8_w8a16.py (reduced) -------------------------------------

class LinearInt8W8A16Strategy:
    name = "linear_int8_w8a16"
    linear_weight_format = "int8"
    linear_act_format = "bf16"

    def quantize(self, tensor: torch.Tensor):
        """Reference per-output-channel symmetric int8 quantization: [N, K] int8 and [N] scales."""
        abs_max = torch.abs(tensor).max(dim=-1, keepdim=True)[0]
        scales = abs_max.clamp(min=1e-8) / 127.0
        q = torch.round(tensor / scales).clamp(-128, 127).to(torch.int8)
        return q, scales.squeeze(-1)

    def quantize_weight_for_kernel(self, weight: torch.Tensor, *, device=None):
        return self.quantize(weight)

    def linear_forward(self, x, weight, bias, *, quant_kind, quant_scales=None, out_features=None):
        _ = quant_kind
        # the AllSpark kernel's fallback: int8 GEMM, then the per-channel scales (1xN), then the bias
        y = (x @ weight.to(x.dtype).t())[:, :out_features] * quant_scales[:, :out_features]
        return y if bias is None else y + bias


_LINEAR_STRATEGY = {"attn": LinearInt8W8A16Strategy(), "mlp": LinearInt8W8A16Strategy()}


def get_linear_strategy(quant_kind: str):
    return _LINEAR_STRATEGY.get(quant_kind)


# --- diffulex/layer/linear.py (reduced) -------------------------------------------------------------------------------

class LinearBase(nn.Module):

    def __init__(self, input_size: int, output_size: int, tp_dim=None, quant_kind: str = "other"):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self._forward_out_features: int = int(output_size)
        self.tp_dim = tp_dim
        self.quant_kind = quant_kind
        self.register_buffer("quant_weight_int8", torch.empty(0, dtype=torch.int8), persistent=False)
        self.register_buffer("quant_scales", torch.empty(0, dtype=DTYPE), persistent=False)
        self.register_buffer("quant_scales_1xn", torch.empty(0, dtype=DTYPE), persistent=False)
        self.register_buffer("_weight_is_quantized", torch.tensor(False, dtype=torch.bool), persistent=False)
        self.register_buffer("_offline_quant_format", torch.empty(0, dtype=torch.int8), persistent=False)
        # ---- Python-side meta cache (CUDA Graph friendly) ----
        self._weight_is_quantized_py: bool = False
        self._offline_quant_format_py: int = 0      # 0=none, 1=gptq, 2=awq

    def has_quantized_weight(self) -> bool:
        if _variant == "bug":
            return (bool(self._weight_is_quantized.item()) and self.quant_weight_int8.numel() > 0
                    and self.quant_scales.numel() > 0)
        return self._weight_is_quantized_py and self.quant_weight_int8.numel() > 0 and self.quant_scales.numel() > 0

    def has_offline_quantized_weight(self) -> bool:
        """Check if offline quantized weights (GPTQ/AWQ) are present (none are loaded here)."""
        if _variant == "bug":
            format_val = int(self._offline_quant_format.item()) if self._offline_quant_format.numel() > 0 else 0
        else:
            format_val = self._offline_quant_format_py
        return format_val in (1, 2)

    def set_quantized_weight(self, quant_weight_int8: torch.Tensor, quant_scales: torch.Tensor) -> None:
        self.quant_weight_int8 = quant_weight_int8.contiguous()
        self.quant_scales = quant_scales.contiguous()
        # 1xN view for fused kernels expecting 2D scales.
        self.quant_scales_1xn = quant_scales if quant_scales.dim() == 2 else quant_scales.view(1, -1)
        self._weight_is_quantized.fill_(True)
        self._weight_is_quantized_py = True

    def _maybe_promote_weight_to_quantized_at_runtime(self, x, strategy) -> None:
        """Runtime safety net: quantize on first forward if load-time quantization was skipped."""
        if strategy is None:
            return
        if self.has_offline_quantized_weight() or self.has_quantized_weight():
            return
        w = getattr(self, "weight", None)
        if w is None:
            return
        qweight, scales = strategy.quantize_weight_for_kernel(w.data, device=w.data.device)
        self.set_quantized_weight(qweight, scales)
        self._parameters.pop("weight", None)
        setattr(self, "weight", None)

    def _maybe_quantize_loaded_weight_param(self, param: nn.Parameter) -> None:
        """Quantize the loaded bf16 weight at load time and drop the bf16 Parameter."""
        strategy = get_linear_strategy(self.quant_kind)
        if strategy is None or strategy.linear_weight_format not in ("int8", "int4", "fp8_e4m3", "fp8_e5m2"):
            return
        qweight, scales = strategy.quantize_weight_for_kernel(param.data, device=param.data.device)
        self.set_quantized_weight(qweight, scales)
        self._parameters.pop("weight", None)
        setattr(self, "weight", None)

    def _get_linear_strategy(self):
        return get_linear_strategy(self.quant_kind)

    def _forward_base(self, x: torch.Tensor, bias) -> torch.Tensor:
        """Unified forward dispatcher for bf16 / online quant (offline GPTQ/AWQ not loaded here)."""
        strategy = self._get_linear_strategy()
        self._maybe_promote_weight_to_quantized_at_runtime(x, strategy)
        if self.has_offline_quantized_weight():
            raise NotImplementedError("offline GPTQ/AWQ weights are not modelled")
        if self.has_quantized_weight():
            return strategy.linear_forward(x, self.quant_weight_int8, bias, quant_kind=self.quant_kind,
                                           quant_scales=self.quant_scales_1xn, out_features=self._forward_out_features)
        return F.linear(x, self.weight, bias)


class ReplicatedLinear(LinearBase):

    def __init__(self, input_size: int, output_size: int, bias: bool = False, quant_kind: str = "other"):
        LinearBase.__init__(self, input_size, output_size, None, quant_kind)
        self.weight = nn.Parameter(torch.empty(self.output_size, self.input_size, dtype=DTYPE), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = nn.Parameter(torch.empty(self.output_size, dtype=DTYPE), requires_grad=False) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor):
        param.data.copy_(loaded_weight)
        self._maybe_quantize_loaded_weight_param(param)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward_base(x, self.bias)


# --- a small block-diffusion LM (stand-in) -----------------------------------------------------------------------------

class BlockDiffusionLM(nn.Module):
    def __init__(self, device: str):
        super().__init__()
        gen = generator(20260125)
        r = lambda *s, scale=0.4: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.embed_tokens, self.embed_positions = r(VOCAB, HIDDEN, scale=1.0), r(MAX_MODEL_LEN, HIDDEN)
        self.qkv_proj = ReplicatedLinear(HIDDEN, 3 * HIDDEN, bias=True, quant_kind="attn")
        self.o_proj = ReplicatedLinear(HIDDEN, HIDDEN, quant_kind="attn")
        self.gate_up_proj = ReplicatedLinear(HIDDEN, 2 * INTER, quant_kind="mlp")
        self.down_proj = ReplicatedLinear(INTER, HIDDEN, quant_kind="mlp")
        self.lm_head = r(VOCAB, HIDDEN)
        self.to(device)
        for lin in (self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj):     # load-time quantization
            lin.weight.weight_loader(lin.weight, r(lin.output_size, lin.input_size))
            if lin.bias is not None:
                lin.bias.data.copy_(r(lin.output_size, scale=0.1))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens[input_ids] + self.embed_positions[positions]
        # attention inside each diffusion block (the decode unit of a sequence: DIFFUSION_BLOCK_SIZE tokens)
        q, k, v = self.qkv_proj(h).view(-1, DIFFUSION_BLOCK_SIZE, 3, NUM_HEADS, HIDDEN // NUM_HEADS).unbind(2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / (HIDDEN // NUM_HEADS) ** 0.5
        attn = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(-1, HIDDEN)
        h = h + self.o_proj(attn)
        gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
        return h + self.down_proj(F.silu(gate) * up)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states @ self.lm_head.t()


# --- diffulex/strategy/block_diffusion/engine/model_runner.py (reduced) -------------------------------------------------

class BDModelRunner:
    def __init__(self, model: BlockDiffusionLM, device: str, enforce_eager: bool):
        self.model, self.device, self.enforce_eager = model, device, enforce_eager
        self.diffusion_block_size = DIFFUSION_BLOCK_SIZE
        if not enforce_eager:
            self.capture_cudagraph()

    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, is_prefill: bool = False):
        if is_prefill or self.enforce_eager or input_ids.size(0) > MAX_NUM_SEQS * self.diffusion_block_size:
            return self.model.compute_logits(self.model(input_ids, positions))
        num_tokens = input_ids.size(0)
        bucket = next(x for x in self.graph_bs if x >= num_tokens)
        graph, outputs = self.graphs[bucket]
        graph_vars = self.graph_vars
        for key, value in graph_vars.items():
            if key != "outputs":
                value.zero_()
        graph_vars["input_ids"][:num_tokens] = input_ids
        graph_vars["positions"][:num_tokens] = positions
        hidden = replay(graph, outputs, real=num_tokens, size=bucket)
        return self.model.compute_logits(hidden[:num_tokens])

    def capture_cudagraph(self):
        max_num_seqs = MAX_NUM_SEQS
        max_num_tokens = max_num_seqs * self.diffusion_block_size
        input_ids = torch.zeros(max_num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.zeros(max_num_tokens, dtype=torch.int64, device=self.device)
        outputs = torch.zeros(max_num_tokens, HIDDEN, dtype=DTYPE, device=self.device)
        self.graph_bs = [num_seqs * self.diffusion_block_size for num_seqs in [1, 2, 4, 8]]
        self.graphs = {}
        self.graph_pool = graph_pool_handle(self.device)
        self.graph_vars = dict(input_ids=input_ids, positions=positions, outputs=outputs)
        static = {"input_ids": input_ids, "positions": positions}
        for num_tokens in reversed(self.graph_bs):
            def step(n=num_tokens):
                outputs[:n] = self.model(input_ids[:n], positions[:n])
                return outputs[:n]
            self.graphs[num_tokens] = capture(step, device=self.device, pool=self.graph_pool, warmups=1,
                                              name=f"decode {num_tokens} tokens", owner="BDModelRunner",
                                              static=static)


def decode_batch(num_seqs: int, gen: torch.Generator, device: str):
    """One decode step: each sequence denoises its current diffusion block (DIFFUSION_BLOCK_SIZE masked tokens)."""
    input_ids = torch.randint(0, VOCAB, (num_seqs * DIFFUSION_BLOCK_SIZE,), generator=gen)
    starts = torch.randint(0, MAX_MODEL_LEN // DIFFUSION_BLOCK_SIZE - 1, (num_seqs,), generator=gen)
    positions = (starts[:, None] * DIFFUSION_BLOCK_SIZE + torch.arange(DIFFUSION_BLOCK_SIZE)).reshape(-1)
    return input_ids.to(device), positions.to(device)


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(73943)
    steps = [decode_batch(n, gen, device) for n in (3, 1, 6, 2)]

    def serve(enforce_eager: bool):
        runner = BDModelRunner(BlockDiffusionLM(device), device, enforce_eager=enforce_eager)
        return [runner.run_model(ids, pos).clone() for ids, pos in steps]

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(False), lambda: serve(True))
