"""vLLM V1 on ROCm, an MXFP4 MoE model (gpt-oss) whose experts run AITER's triton MoE (``AiterW4A8ExpertsMonolithic``):
``aiter_triton_kernel_w4a8_moe_forward`` hands the router logits of the whole graph batch to AITER's ``routing``.
A decode batch is padded to a captured size, and the padded tokens' rows come out of the layers as garbage
(inf/-inf/NaN). AITER 0.1.19's ``streaming_topk`` loads the expert columns past ``n_expts_tot`` (up to its
128-column block) as -inf and breaks ties towards the larger column, so a row of -inf or negative-NaN logits elects
those padding columns: expert ids that do not exist. The routing sort then indexes its per-expert offsets with them
and the GPU faults ("Memory access fault by GPU"), killing the batch's real requests too. Eager (no padding) never
routes a garbage row. The vLLM hotfix masks the padded rows' router logits to 0 before routing
(``patch_gating_output``, padding found as ``slot_mapping < 0``); the graph then serves what eager serves.

Upstream: https://github.com/vllm-project/vllm/pull/50859 ("[ROCm][AITER] Hotfix for `memory access fault` errors in
AITER triton MOE routing", vllm-project/vllm, by Felix Marty (fxmarty-amd), co-author Andreas Karatzas; description
dated 2026-08-03, merged 2026-08-04 as 385d4c084ef0c52fe0f7baf7dd2dc4bf86fbe548). Companion fix in AITER:
ROCm/aiter#4530 (merged 2026-08-14 as f88f5bab40). Read, in a fork mirror carrying vLLM's history (jsboige/vllm):
the whole diff of 385d4c084 (``vllm/model_executor/layers/fused_moe/experts/aiter_mxfp4_w4a8_moe.py``: new
``_get_padding_mask`` and ``patch_gating_output``, called first in ``aiter_triton_kernel_w4a8_moe_forward`` and
``aiter_triton_kernel_w4a16_moe_forward``; ``tests/models/quantization/test_gpt_oss.py``: new
``test_aiter_mxfp4_moe_ignores_padded_rows``, 7 real tokens in an 8-row batch whose padded row holds +-inf/NaN
hidden states and -inf/+inf/NaN/-NaN logits, asserting finite real outputs). At 385d4c084: that file whole
(``triton_kernel_fused_mxfp4_w4a8_experts``, ``AiterW4A8ExpertsMonolithic``), ``models/gpt_oss.py`` (``MLPBlock``:
router by ``rocm_unquantized_gemm`` on ROCm, then ``self.experts``), ``v1/worker/gpu_model_runner.py``
(``_get_slot_mappings``: ``slot_mapping[num_tokens_unpadded:num_tokens_padded].fill_(-1)``;
``_build_attention_metadata``: padded requests' block-table rows set to ``NULL_BLOCK_ID``; ``_prepare_inputs``:
``query_start_loc`` padded non-decreasing, ``optimistic_seq_lens_cpu[num_reqs:] = 0``; ``_dummy_run``'s seq_lens).
In a mirror of ROCm/aiter: the diff of f88f5bab40 (``streaming_topk`` gains ``x = tl.where(mask_n, x, 0)`` with the
comment "-inf ties with a real -inf and sorts above a negative NaN, and ties are broken by the packed column index,
which is largest for the padded columns. Such a row then selects offs_x_n >= n_expts_tot"; test
``test_topk_in_range``); at its parent: ``_triton_kernels/moe/moe_routing/topk.py`` (``fpval_to_key``,
``key_to_fpval``, ``streaming_topk``, ``_topk``), ``moe/moe_routing/topk.py`` (``topk``: ``BLOCK_N = 128``),
``moe/moe_routing/routing.py`` (``routing``, ``sort_tokens``, ``sort_tokens_fused``, ``_compute_expt_data_internal``,
``ExptData``, ``RoutingData``). Also the descriptions of both PRs as stored in the search corpus (vLLM: the failing
CI test on MI355, the fault text, regression since the AITER bump 0.1.16.post5 -> 0.1.19; AITER: "vLLM pads the token
count to the captured graph size when running with HIP graphs: a batch of 7 real tokens is executed as 8. We verified
in vLLM that padding tokens may contain inf, -inf or NaN values ... Disabling HIP Graph in vLLM bypasses the issue").
Not read: the Triton bodies of ``_combined_routing(_fused)`` (how a bad expert id turns into the fault), ``Bitmatrix``,
``moe_gemm_a8w4`` and ``downcast_to_static_fp8``; the ROCm attention backend gpt-oss uses and where exactly the
padded rows turn non-finite (upstream does not say: "rows ... hold whatever the router produced for uninitialised
hidden states", aiter's test comment); the PR reviews; aiter#4198, the change that exposed the bug.
Symptom: ``tests/models/quantization/test_gpt_oss.py::test_gpt_oss_attention_quantization[amd/gpt-oss-20b-MoE-Quant-
W-MXFP4-A-FP8-KV-FP8-...]`` on MI355 after the AITER bump: "Memory access fault by GPU node-2 (Agent handle: ...) on
address 0x7de557bcb000. Reason: Unknown." ... "Fatal Python error: Aborted". With HIP graphs disabled it passes.
Mechanism: the V1 runner pads a uniform decode batch of n requests to the captured size N: tokens n..N-1 get slot
-1, padded requests seq_len 0 and the null block; ``input_ids``/``positions`` past n keep earlier steps' values. The
captured forward runs all N rows. Here the decode attention handles row r as request r (uniform batch); a padded
request has no key, so its row is acc / l = 0 / 0: NaN, which o_proj, the residual, RMSNorm and the router GEMM carry
into that row's router logits. ``streaming_topk`` packs ``(fpval_to_key(bits) << 16) | column``; the columns
12..15 past the 12 experts hold -inf; a negative NaN's key is below -inf's, so the padded row's top-4 are columns
12..15. ``sort_tokens_fused`` places each gate at ``token_offs_raw[expert] + rank``: expert 13 indexes past the 13
offsets (upstream: a read past the buffer, then writes through garbage offsets: the fault). In eager the batch has
only real rows; with the fix the padded rows' logits are 0 and elect the real experts 8..11.
Doctor: stale-padding, at aiter_triton_kernel_w4a8_moe_forward. Whether the real requests are served at all depends
on what the padded rows hold (their router logits, garbage every replay): the routing of the whole padded batch is
decided from them. This is the function the fix changes (it masks the padded rows of ``gating_output`` first).
Fix (upstream): ``patch_gating_output(gating_output, global_num_experts)`` before ``routing``: unless there are 128
experts (no padding columns at ``BLOCK_N = 128``), ``gating_output.masked_fill(is_padding[:, None], 0.0)`` with
``is_padding`` from the forward context (model runner v2) or ``slot_mapping < 0`` (v1). (AITER#4530 later zeroes the
packed keys of the padding columns instead.)
Modelled: ``ForwardContext`` / ``set_forward_context`` / ``get_forward_context``; AITER's ``fpval_to_key``,
``key_to_fpval``, ``streaming_topk`` (pre-#4530), ``topk``, ``ExptData``, ``RoutingData``, ``sort_tokens_fused``,
``routing``, ``downcast_to_static_fp8``, ``moe_gemm_a8w4``; vLLM's ``_get_padding_mask``, ``patch_gating_output``,
``aiter_triton_kernel_w4a8_moe_forward`` (bug / fix as in the diff), ``triton_kernel_fused_mxfp4_w4a8_experts``,
``AiterW4A8ExpertsMonolithic``, ``FusedMoE``, gpt-oss ``MLPBlock`` / ``TransformerBlock`` / ``GptOssForCausalLM``;
``GPUModelRunner`` (``capture_model`` with a dummy run, ``execute_model`` with the V1 padding of slots, seq_lens and
block table).
Stand-ins: where the padded rows turn non-finite upstream is not established; here the decode attention computes
padded requests and divides 0 by 0 (no attention sinks; gpt-oss has them). That NaN is negative on x86 (0xffc00000)
and stays negative through the layers, like the -inf/-NaN rows upstream's tests write. On an NVIDIA GPU 0/0 gives a
positive NaN, whose key is the largest: the padded rows elect real experts and the bug variant serves right there
(latent), it was expected; recorded on one H100 (2026-12-07) the bug variant instead ends its CUDA context with a
device-side assert (an index out of bounds), so it misbehaves there too. 12 experts in 16-column blocks (upstream
32 in 128), top-4; keys from float32 bits (upstream bf16); the
bitmatrix as a 0/1 matrix; ``sort_tokens_fused`` as offsets + rank (kernel not read); ``moe_gemm_a8w4`` as a gathered
float64 einsum of fp8 activations (torch float8_e4m3fn, static scales) and mxfp4 weights (e2m1 values times e8m0
block scales); gpt-oss's SwiGLU (alpha 1.702, limit 7); projections as broadcast products so that a row's result does
not depend on the batch's row count; FULL_DECODE_ONLY (prefill eager), capture sizes [4, 8], greedy sampling, two
layers of width 16, RoPE without YaRN, one GPU.
Workload: eight requests (prompts of 3-6 tokens) prefilled together, then decoded until each reaches its length:
six decode steps of 8, 7, 6, 5, 3 and 1 requests (graph sizes 8, 8, 8, 8, 4, 4). Outputs: each step's logits and
tokens. Eager = the same runner with ``enforce_eager``.
Measured: bug: misbehaves (raised IndexError: index 13 is out of bounds for dimension 0 with size 13): the replay of
the second decode step (7 requests in the 8-row graph); row 7's router logits are all 0xffc00000 and
``streaming_topk`` elects 12, 13, 14, 15. Fix: equals eager (max |graph - eager| = 0) over all six replays. About
2 s per variant on the CPU.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn.functional as F

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/50859"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "aiter_triton_kernel_w4a8_moe_forward"
SYMPTOM = ("gpt-oss MXFP4/FP8 on ROCm with AITER's triton MoE and HIP graphs: 'Memory access fault by GPU' in the "
           "MoE routing once a decode batch is padded to a captured size; the padded rows' NaN/-inf router logits "
           "make streaming_topk elect expert ids that do not exist")

VOCAB, HIDDEN, NUM_HEADS, HEAD_DIM, NUM_LAYERS = 32, 16, 2, 8, 2
NUM_EXPERTS, TOPK, INTERMEDIATE = 12, 4, 8          # gpt-oss-20b: 32 experts, top-4
MXFP4_BLOCK = 8                                      # upstream 32 elements per e8m0 scale
BLOCK_N = 16                                         # streaming_topk's column block (upstream 128)
BLOCK_SIZE, MAX_MODEL_LEN, MAX_NUM_SEQS = 4, 16, 8
MAX_BLOCKS = MAX_MODEL_LEN // BLOCK_SIZE
NUM_BLOCKS = 1 + MAX_NUM_SEQS * MAX_BLOCKS           # block 0 is the null block (NULL_BLOCK_ID)
NULL_BLOCK_ID = 0
PAD_SLOT = NUM_BLOCKS * BLOCK_SIZE                   # stand-in: where a slot of -1 lands (the kernel skips it)
CUDAGRAPH_CAPTURE_SIZES = [4, 8]
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0
FP8_MAX = 448.0
DTYPE = torch.float64

_variant = {"v": "bug"}


def cdiv(a, b):
    return -(-a // b)


# --- vllm/forward_context.py -----------------------------------------------------------------------------------------

@dataclasses.dataclass
class ForwardContext:
    attn_metadata: object
    slot_mapping: dict | list | None          # model runner v1: {layer_name: slot_mapping}
    is_padding: torch.Tensor | None = None    # model runner v2 only


_forward_context: list[ForwardContext] = []


@contextlib.contextmanager
def set_forward_context(attn_metadata, slot_mapping=None, is_padding=None):
    _forward_context.append(ForwardContext(attn_metadata, slot_mapping, is_padding))
    try:
        yield
    finally:
        _forward_context.pop()


def get_forward_context() -> ForwardContext:
    return _forward_context[-1]


# --- aiter/ops/triton/moe/moe_routing (the Triton kernels as torch ops) -----------------------------------------------

_TM, _FM = 0x80000000, 0xFFFFFFFF


def fpval_to_key(x):
    """Float bits (uint32 held in int64) -> a key that orders like the float: negatives flipped whole."""
    return x ^ torch.where((x & _TM) != 0, _FM, _TM)


def key_to_fpval(x):
    return x ^ torch.where((x & _TM) == 0, _FM, _TM)


def streaming_topk(X, n_expts_tot: int, N_EXPTS_PAD: int, N_EXPTS_ACT: int):
    """_topk's streaming_topk (score_mode softmax): columns past ``n_expts_tot`` are loaded as -inf, every value is
    packed as (fpval_to_key(bits) << 16) | column and the row's top-k packed keys win, so equal values go to the
    larger column index. Stand-in: float32 bits for upstream's bf16."""
    n_rows = X.shape[0]
    offs_x_n = torch.arange(N_EXPTS_PAD, device=X.device)
    mask_n = offs_x_n[None, :] < n_expts_tot
    x = F.pad(X.to(torch.float32), (0, N_EXPTS_PAD - n_expts_tot))
    x = torch.where(mask_n, x, torch.full((), float("-inf"), dtype=torch.float32, device=X.device))
    key = fpval_to_key(x.view(torch.int32).to(torch.int64) & _FM)
    acc = torch.topk((key << 16) | offs_x_n[None, :], N_EXPTS_ACT, dim=1).values
    acc = torch.gather(acc, 1, torch.argsort(acc & 0xFFFF, dim=1))      # ascending expert id
    y_indices = acc & 0xFFFF
    bits = key_to_fpval(acc >> 16)
    y_values = (bits - (bits >= 2 ** 31).to(torch.int64) * 2 ** 32).to(torch.int32).view(torch.float32)
    return y_values.reshape(n_rows, N_EXPTS_ACT), y_indices.reshape(n_rows, N_EXPTS_ACT)


@dataclasses.dataclass
class Bitmatrix:
    data: torch.Tensor                       # [n_rows, n_cols_pad]: one bit per (row, selected column)

    def sum(self):
        return self.data.sum(0)


def topk(x, k: int, apply_softmax: bool):
    n_rows, n_cols = x.shape
    N_EXPTS_PAD = cdiv(n_cols, BLOCK_N) * BLOCK_N
    y_vals, y_indx = streaming_topk(x, n_cols, N_EXPTS_PAD, k)
    if apply_softmax:
        y_vals = torch.softmax(y_vals.to(DTYPE), dim=1)
    cols = torch.arange(N_EXPTS_PAD, device=x.device)
    bits = (y_indx[:, :, None] == cols).sum(1)             # "pack into bitmatrix": the bit of every selected column
    return y_vals, y_indx, Bitmatrix(bits)


@dataclasses.dataclass
class ExptData:
    hist: torch.Tensor
    token_offs_raw: torch.Tensor


@dataclasses.dataclass
class RoutingData:
    gate_scal: torch.Tensor
    expt_hist: torch.Tensor
    n_expts_tot: int
    n_expts_act: int
    expt_data: ExptData


def sort_tokens_fused(expt_scal, expt_indx, n_expts_tot: int, bitmatrix: Bitmatrix):
    """_combined_routing_fused: gates (token-major) sorted by expert. Each gate's slot is
    token_offs_raw[expert] + (earlier gates of that expert); an expert id >= n_expts_tot indexes past
    token_offs_raw (upstream: a read of memory past the offsets, the memory access fault)."""
    n_tokens, n_expts_act = expt_scal.shape
    n_gates = n_tokens * n_expts_act
    hist = bitmatrix.sum()[:n_expts_tot]
    token_offs_raw = F.pad(torch.cumsum(hist, 0), (1, 0))
    e = expt_indx.reshape(-1)
    onehot = (e[:, None] == torch.arange(bitmatrix.data.shape[1], device=e.device)).to(torch.int64)
    rank = torch.gather(torch.cumsum(onehot, 0) - 1, 1, e[:, None])[:, 0]
    gate_indx = token_offs_raw[e] + rank                       # gate -> expert-sorted slot (scatter index)
    topk_indx = torch.zeros(n_gates, dtype=torch.int64, device=e.device)
    topk_indx[gate_indx] = torch.arange(n_gates, device=e.device)     # sorted slot -> gate (gather index)
    gate_scal = torch.zeros(n_gates, dtype=expt_scal.dtype, device=e.device)
    gate_scal[gate_indx] = expt_scal.reshape(-1)
    return hist, topk_indx, gate_indx, gate_scal, token_offs_raw


def routing(logits, n_expts_act: int, sm_first: bool = False):
    num_tokens, n_expts_tot = logits.shape
    if sm_first:
        logits = torch.softmax(logits, dim=-1)
    expt_scal, expt_indx, bitmatrix = topk(logits, n_expts_act, apply_softmax=not sm_first)
    hist, topk_indx, gate_indx, gate_scal, token_offs_raw = sort_tokens_fused(expt_scal, expt_indx, n_expts_tot,
                                                                              bitmatrix)
    return (RoutingData(gate_scal, hist, n_expts_tot, n_expts_act, ExptData(hist, token_offs_raw)),
            topk_indx, gate_indx)


# --- aiter triton quant / moe_gemm_a8w4 (stand-ins) -------------------------------------------------------------------

def downcast_to_static_fp8(x, scale):
    """x / scale rounded to float8_e4m3fn (saturating at 448); the payload is kept in float64."""
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(DTYPE)


def moe_gemm_a8w4(x, w, w_scale, x_scale, out_scale, bias, routing_data: RoutingData, gather_indx=None,
                  scatter_indx=None, gammas=None, apply_swiglu=False):
    """Grouped GEMM over the expert-sorted gates: fp8 activations (payload * x_scale) times mxfp4 weights
    (payload * per-block e8m0 scale). First stage gathers token rows, second scatters and sums the top-k."""
    n_gates = routing_data.gate_scal.shape[0]
    slots = torch.arange(n_gates, device=x.device)
    expt = torch.searchsorted(routing_data.expt_data.token_offs_raw[1:], slots, right=True)
    rows = x[gather_indx // routing_data.n_expts_act] if gather_indx is not None else x
    w_deq = w * w_scale.repeat_interleave(MXFP4_BLOCK, dim=1)
    y = torch.einsum("gk,gkn->gn", rows * x_scale, w_deq[expt]) + bias[expt]
    if apply_swiglu:
        gate, lin = y[..., ::2].clamp(max=SWIGLU_LIMIT), y[..., 1::2].clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
        y = gate * torch.sigmoid(SWIGLU_ALPHA * gate) * (lin + 1)
    if out_scale is not None:
        y = downcast_to_static_fp8(y, out_scale)
    if scatter_indx is not None:
        y = (y * gammas[:, None])[scatter_indx].view(-1, routing_data.n_expts_act, y.shape[-1]).sum(1)
    return y


# --- vllm/model_executor/layers/fused_moe/experts/aiter_mxfp4_w4a8_moe.py ---------------------------------------------

def _get_padding_mask():
    """Boolean mask, True for padding tokens: ``slot_mapping < 0`` comes from
    ``slot_mapping[num_tokens_unpadded:num_tokens_padded].fill_(-1)`` in gpu_model_runner.py."""
    forward_context = get_forward_context()
    if forward_context.is_padding is not None:          # model runner v2
        return forward_context.is_padding
    slot_mapping = forward_context.slot_mapping         # model runner v1
    slot_mapping_dict = slot_mapping[0] if isinstance(slot_mapping, list) else slot_mapping
    slot_mapping_sample = None
    if isinstance(slot_mapping_dict, dict):
        slot_mapping_sample = next(iter(slot_mapping_dict.values()), None)
    return slot_mapping_sample < 0 if isinstance(slot_mapping_sample, torch.Tensor) else None


def patch_gating_output(gating_output, global_num_experts: int):
    if global_num_experts != 128:
        is_padding = _get_padding_mask()
        if is_padding is not None:
            assert is_padding.shape[0] == gating_output.shape[0]
            gating_output = gating_output.masked_fill(is_padding[:, None], 0.0)
    return gating_output


def aiter_triton_kernel_w4a8_moe_forward(hidden_states, w1, w2, gating_output, topk: int, renormalize: bool,
                                         quant_config, global_num_experts: int = -1):
    if _variant["v"] == "fix":
        # See context in #50859. (TODO upstream: remove once ROCm/aiter#4530 is in the pinned AITER.)
        gating_output = patch_gating_output(gating_output, global_num_experts)
    routing_data, gather_idx, scatter_idx = routing(gating_output, topk, sm_first=not renormalize)
    return triton_kernel_fused_mxfp4_w4a8_experts(hidden_states, w1, w2, routing_data, gather_idx, scatter_idx,
                                                  quant_config)


def triton_kernel_fused_mxfp4_w4a8_experts(hidden_states, w1, w2, routing_data, gather_indx, scatter_indx,
                                           quant_config):
    gammas = routing_data.gate_scal
    hidden_states = downcast_to_static_fp8(hidden_states, quant_config["w1_lhs_scale"])
    intermediate_cache1 = moe_gemm_a8w4(hidden_states, w1, quant_config["w1_scale"], quant_config["w1_lhs_scale"],
                                        quant_config["w2_lhs_scale"], quant_config["w1_bias"], routing_data,
                                        gather_indx=gather_indx, apply_swiglu=True)
    return moe_gemm_a8w4(intermediate_cache1, w2, quant_config["w2_scale"], quant_config["w2_lhs_scale"], None,
                         quant_config["w2_bias"], routing_data, scatter_indx=scatter_indx, gammas=gammas)


class AiterW4A8ExpertsMonolithic:
    def __init__(self, quant_config):
        self.quant_config = quant_config

    def apply(self, layer, x, router_logits):
        return aiter_triton_kernel_w4a8_moe_forward(x, layer.w13_weight, layer.w2_weight, router_logits, TOPK,
                                                    renormalize=True, quant_config=self.quant_config,
                                                    global_num_experts=NUM_EXPERTS)


class FusedMoE:
    """Checkpoint stand-in: mxfp4 payloads on the e2m1 grid with per-block power-of-two scales, fp8 input scales."""

    E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])

    def __init__(self, gen, device):
        def mxfp4(e, k, n):
            vals = self.E2M1[torch.randint(0, 8, (e, k, n), generator=gen)]
            signs = torch.randint(0, 2, (e, k, n), generator=gen) * 2 - 1
            scale = 2.0 ** torch.randint(-4, -1, (e, k // MXFP4_BLOCK, n), generator=gen)
            return (vals * signs).to(DTYPE).to(device), scale.to(DTYPE).to(device)
        self.w13_weight, w13_scale = mxfp4(NUM_EXPERTS, HIDDEN, 2 * INTERMEDIATE)
        self.w2_weight, w2_scale = mxfp4(NUM_EXPERTS, INTERMEDIATE, HIDDEN)
        self.quant_method = AiterW4A8ExpertsMonolithic({
            "w1_scale": w13_scale, "w2_scale": w2_scale, "w1_lhs_scale": 1 / 64, "w2_lhs_scale": 1 / 32,
            "w1_bias": randn(NUM_EXPERTS, 2 * INTERMEDIATE, gen=gen, device=device, scale=0.2).to(DTYPE),
            "w2_bias": randn(NUM_EXPERTS, HIDDEN, gen=gen, device=device, scale=0.2).to(DTYPE)})

    def forward(self, hidden_states, router_logits):
        return self.quant_method.apply(self, hidden_states, router_logits)


# --- attention: paged KV, prefill causal, decode one token per request (padded requests: seq_len 0) ------------------

@dataclasses.dataclass
class AttentionMetadata:
    num_prefills: int
    prefill_seq_lens: list | None
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor | None
    block_table: torch.Tensor | None


def write_to_paged_cache(key, value, key_cache, value_cache, slot_mapping):
    """reshape_and_cache: a slot of -1 is skipped by the kernel (here: written to a spare row)."""
    idx = torch.where(slot_mapping >= 0, slot_mapping, torch.full_like(slot_mapping, PAD_SLOT))
    key_cache.index_copy_(0, idx, key)
    value_cache.index_copy_(0, idx, value)


def decode_attention_fwd(q, key_cache, value_cache, block_table, seq_lens, scale):
    """Decode kernel of a uniform batch: row r is request r's token; it walks its ``seq_lens[r]`` keys with an
    online softmax and writes acc / l. A padded request (seq_len 0) has l = 0 and acc = 0: its row is 0 / 0."""
    j = torch.arange(MAX_MODEL_LEN, device=q.device)
    slots = block_table[:, j // BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE
    s = torch.einsum("bhd,blhd->bhl", q, key_cache[slots]) * scale
    valid = (j[None, :] < seq_lens[:, None])[:, None, :]
    m = s.masked_fill(~valid, float("-inf")).amax(-1, keepdim=True)
    p = torch.where(valid, torch.exp(s - m), torch.zeros((), dtype=s.dtype, device=s.device))
    return torch.einsum("bhl,blhd->bhd", p, value_cache[slots]) / p.sum(-1)[..., None]


def linear(x, w):
    """x @ w as a broadcast product summed over K: each row's result does not depend on how many rows the batch
    has (a BLAS GEMM picks its kernel by M, so a padded batch would round real rows differently)."""
    return (x[..., :, None] * w).sum(-2)


def rms_norm(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x, positions):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=DTYPE, device=x.device) / HEAD_DIM))
    f = positions.to(DTYPE)[:, None] * inv_freq[None, :]
    cos, sin = f.cos()[:, None, :], f.sin()[:, None, :]
    x1, x2 = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


# --- vllm/model_executor/models/gpt_oss.py (reduced) ------------------------------------------------------------------

class OAIAttention:
    def __init__(self, gen, device, layer_name):
        self.layer_name = layer_name
        self.qkv = randn(HIDDEN, 3 * NUM_HEADS * HEAD_DIM, gen=gen, device=device, scale=0.3).to(DTYPE)
        self.o_proj = randn(NUM_HEADS * HEAD_DIM, HIDDEN, gen=gen, device=device, scale=0.3).to(DTYPE)

    def forward(self, x, positions, kv_cache):
        md = get_forward_context().attn_metadata
        n = x.shape[0]
        q, k, v = linear(x, self.qkv).view(n, 3, NUM_HEADS, HEAD_DIM).unbind(1)
        q, k = rope(q, positions), rope(k, positions)
        write_to_paged_cache(k, v, kv_cache[0], kv_cache[1], md.slot_mapping)
        if md.num_prefills:
            outs, start = [], 0
            for length in md.prefill_seq_lens:
                qs, ks, vs = q[start:start + length], k[start:start + length], v[start:start + length]
                sc = torch.einsum("qhd,khd->hqk", qs, ks) * HEAD_DIM ** -0.5
                causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
                outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(sc.masked_fill(~causal, float("-inf")), -1),
                                         vs))
                start += length
            out = torch.cat(outs)
        else:
            out = decode_attention_fwd(q, kv_cache[0], kv_cache[1], md.block_table, md.seq_lens, HEAD_DIM ** -0.5)
        return linear(out.reshape(n, NUM_HEADS * HEAD_DIM), self.o_proj)


class MLPBlock:
    def __init__(self, gen, device):
        self.router_weight = randn(HIDDEN, NUM_EXPERTS, gen=gen, device=device, scale=0.6).to(DTYPE)
        self.router_bias = randn(NUM_EXPERTS, gen=gen, device=device, scale=0.2).to(DTYPE)
        self.experts = FusedMoE(gen, device)

    def forward(self, x):
        g = linear(x, self.router_weight) + self.router_bias   # rocm_unquantized_gemm(self, x, router.weight, bias)
        return self.experts.forward(hidden_states=x, router_logits=g)


class TransformerBlock:
    def __init__(self, gen, device, i):
        self.attn = OAIAttention(gen, device, f"model.layers.{i}.attn")
        self.mlp = MLPBlock(gen, device)
        self.input_layernorm = (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(DTYPE).to(device)
        self.post_attention_layernorm = (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(DTYPE).to(device)

    def forward(self, h, positions, kv_cache):
        h = h + self.attn.forward(rms_norm(h, self.input_layernorm), positions, kv_cache)
        return h + self.mlp.forward(rms_norm(h, self.post_attention_layernorm))


class GptOssForCausalLM:
    def __init__(self, device):
        gen = generator(50859)
        self.embedding = randn(VOCAB, HIDDEN, gen=gen, device=device).to(DTYPE)
        self.layers = [TransformerBlock(gen, device, i) for i in range(NUM_LAYERS)]
        self.norm = torch.ones(HIDDEN, dtype=DTYPE, device=device)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.5).to(DTYPE)
        self.kv_caches = [torch.zeros(2, PAD_SLOT + 1, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
                          for _ in range(NUM_LAYERS)]

    def __call__(self, input_ids, positions):
        h = self.embedding[input_ids]
        for layer, kv in zip(self.layers, self.kv_caches):
            h = layer.forward(h, positions, kv)
        return rms_norm(h, self.norm)

    def compute_logits(self, hidden_states):
        return linear(hidden_states, self.lm_head)


# --- vllm/v1/worker/gpu_model_runner.py (reduced: FULL_DECODE_ONLY, uniform decode) ----------------------------------

class GPUModelRunner:
    def __init__(self, device, enforce_eager: bool):
        self.device, self.enforce_eager = device, enforce_eager
        self.model = GptOssForCausalLM(device)
        z = lambda *s: torch.zeros(*s, dtype=torch.long, device=device)
        self.input_ids, self.positions, self.slot_mapping = z(MAX_NUM_SEQS), z(MAX_NUM_SEQS), z(MAX_NUM_SEQS)
        self.seq_lens, self.block_table = z(MAX_NUM_SEQS), z(MAX_NUM_SEQS, MAX_BLOCKS)
        self.cudagraphs: dict = {}
        self.layer_names = [layer.attn.layer_name for layer in self.model.layers]

    def _forward(self, n):
        md = AttentionMetadata(0, None, self.slot_mapping[:n], self.seq_lens[:n], self.block_table[:n])
        with set_forward_context(md, {name: self.slot_mapping[:n] for name in self.layer_names}):
            return self.model(self.input_ids[:n], self.positions[:n])

    def capture_model(self):
        pool = graph_pool_handle(self.device)
        static = {"input_ids": self.input_ids, "positions": self.positions, "slot_mapping": self.slot_mapping,
                  "seq_lens": self.seq_lens, "block_table": self.block_table}
        state = {f"kv_caches[{i}]": kv for i, kv in enumerate(self.model.kv_caches)}
        for size in sorted(CUDAGRAPH_CAPTURE_SIZES, reverse=True):
            # _dummy_run: dummy requests of one token, seq_len 1 on the null block, slots -1
            self.slot_mapping.fill_(-1)
            self.seq_lens.fill_(1)
            self.block_table.fill_(NULL_BLOCK_ID)
            self.cudagraphs[size] = capture(lambda n=size: self._forward(n), device=self.device, pool=pool,
                                            name=f"decode FULL {size}", static=static, state=state,
                                            owner="GPUModelRunner")

    def execute_model(self, reqs, prefill: bool):
        n = len(reqs)
        if prefill:                                      # mixed/prefill batches run eagerly (FULL_DECODE_ONLY)
            ids = torch.tensor([t for r in reqs for t in r["tokens"]]).to(self.device)
            pos = torch.tensor([p for r in reqs for p in range(len(r["tokens"]))]).to(self.device)
            slots = torch.tensor([r["blocks"][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                                  for r in reqs for p in range(len(r["tokens"]))]).to(self.device)
            lens = [len(r["tokens"]) for r in reqs]
            md = AttentionMetadata(n, lens, slots, None, None)
            with set_forward_context(md, {name: slots for name in self.layer_names}):
                hidden = self.model(ids, pos)
            last = torch.tensor(lens).cumsum(0).to(self.device) - 1
            return self.model.compute_logits(hidden[last])
        size = n if self.enforce_eager else next(s for s in CUDAGRAPH_CAPTURE_SIZES if s >= n)
        t = lambda x: torch.tensor(x).to(self.device)
        p = [len(r["tokens"]) - 1 for r in reqs]
        self.input_ids[:n] = t([r["tokens"][-1] for r in reqs])
        self.positions[:n] = t(p)
        self.slot_mapping[:n] = t([r["blocks"][q // BLOCK_SIZE] * BLOCK_SIZE + q % BLOCK_SIZE
                                   for r, q in zip(reqs, p)])
        self.slot_mapping[n:size].fill_(-1)               # _get_slot_mappings: padded tokens write nowhere
        self.seq_lens[:n] = t([q + 1 for q in p])
        self.seq_lens[n:].fill_(0)                        # padded requests: seq_len 0
        self.block_table[:n] = t([r["blocks"] for r in reqs])
        self.block_table[n:size].fill_(NULL_BLOCK_ID)     # padded requests: the null block
        if self.enforce_eager:
            hidden = self._forward(n)
        else:
            g, out = self.cudagraphs[size]
            # input_ids / positions past n keep what earlier steps left (nothing rewrites them)
            hidden = replay(g, out, real=n, size=size,
                            padded={"input_ids": self.input_ids, "positions": self.positions})
        return self.model.compute_logits(hidden[:n])


# --- the engine: eight requests prefilled together, then decode until each reaches its length -----------------------

def _serve(device, enforce_eager, prompts, max_tokens):
    runner = GPUModelRunner(device, enforce_eager)
    if not enforce_eager:
        runner.capture_model()
    reqs = [{"tokens": list(pr), "blocks": list(range(1 + i * MAX_BLOCKS, 1 + (i + 1) * MAX_BLOCKS)), "max": m}
            for i, (pr, m) in enumerate(zip(prompts, max_tokens))]
    outs, prefill = [], True
    while True:
        running = [r for r in reqs if len(r["tokens"]) < r["max"]]
        if not running:
            return outs
        logits = runner.execute_model(running, prefill)
        sampled = logits.argmax(-1)
        outs += [logits, sampled.to(DTYPE)]
        for r, tok in zip(running, sampled.tolist()):
            r["tokens"].append(tok)
        prefill = False


def run(variant: str, device: str = "cpu"):
    _variant["v"] = variant
    gen = generator(7)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (3, 5, 4, 6, 3, 5, 4, 3)]
    max_tokens = [len(pr) + m for pr, m in zip(prompts, (5, 6, 4, 7, 3, 6, 2, 5))]
    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: _serve(device, False, prompts, max_tokens),
                       lambda: _serve(device, True, prompts, max_tokens))
