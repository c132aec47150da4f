"""vLLM V1 FULL CUDA graph on FlashAttention 3 with AOT scheduling: ``FlashAttentionMetadataBuilder.build`` computes the
FA3 scheduler metadata (per-request dynamic split counts) for every step with the step's own ``num_splits`` bound, while
the kernel captured in the FULL graph keeps the ``num_splits`` (and the split accumulator it sized) that its launch code
chose from the capture batch; a step whose bound is larger makes the replayed kernel write past its split accumulator.

Upstream: https://github.com/vllm-project/vllm/pull/20057 ("[BugFix] Fix full-cuda-graph illegal memory access in
FA3", vllm-project/vllm, by LucasWilkinson, opened 2025-06-25, merged 2025-06-25 as commit 0f9e7354f). Read: the PR
description (a sporadic illegal memory access found by WoosukKwon with ``full_cuda_graph``; tested with lm_eval on
Qwen2.5-VL-72B), the merged diff (``git show 0f9e7354f`` in a vLLM mirror, local-inference-lab/vllm), and at its
parent: ``vllm/v1/attention/backends/flash_attn.py`` (``FlashAttentionMetadataBuilder.__init__`` / ``build`` with its
``schedule`` helper, ``FlashAttentionImpl.forward``), ``vllm/v1/worker/gpu_model_runner.py`` (``_prepare_inputs``,
``execute_model``, ``_dummy_run`` with ``capture_attn_cudagraph``, ``capture_model``), ``vllm/v1/attention/backends/
utils.py`` (``build_for_cudagraph_capture``) and ``vllm/compilation/cuda_piecewise_backend.py`` (``__call__``);
and FA3 at the vllm-flash-attn commit vLLM pinned then (5f3644181c, vllm-project/flash-attention): ``hopper/
flash_api.cpp`` (``mha_fwd``: ``get_num_splits``, ``out_accum`` of ``num_splits`` rows, ``scheduler_metadata`` used as
``tile_count_semaphore`` and ``num_splits_dynamic_ptr``; ``mha_fwd_get_scheduler_metadata``), ``hopper/heuristics.h``
(``num_splits_heuristic``), ``hopper/flash_prepare_scheduler.cu`` (``prepare_varlen_num_blocks_kernel``),
``hopper/tile_scheduler.hpp`` / ``block.h`` (split index and per-split n-block range from ``num_splits_dynamic``) and
``flash_fwd_combine_kernel.h``. Follow-up read: #20301 (July 2025) re-enables AOT scheduling in FULL graphs by passing
one ``max_num_splits`` to both sides.
Symptom: with ``compilation_config.full_cuda_graph`` on FA3, serving sporadically dies with an illegal memory access;
eager serving (or piecewise graphs) is fine.
Mechanism: FA3's ``mha_fwd`` picks ``params.num_splits`` on the host with ``get_num_splits`` (from ``max_seqlen_q``,
``max_seqlen_k``, heads, SM count), allocates ``out_accum`` / ``softmax_lse_accum`` with that many split rows and launches
the split kernel and the combine. Under a FULL graph that host code ran once, in ``_dummy_run`` at capture (``max_query_len
= num_tokens``, ``seq_lens = max_model_len``), so the replayed kernel keeps the capture's ``num_splits`` and its
``out_accum``. With AOT scheduling, ``build`` calls ``get_scheduler_metadata`` every step (eagerly, outside the graph)
with the step's ``max_query_len`` / ``max_seq_len``; it runs the same heuristic on those values and the prepare kernel
writes per-request split counts up to that bound into the persistent ``self.scheduler_metadata`` the graph reads. The
replayed kernel takes each request's split count from there: a decode step (``max_query_len`` 1, so fewer M-blocks than
the capture's ``max_query_len`` 2) with a 5th KV block gets a bound of 5 where the graph holds 4 split rows, and split 4
is written past ``out_accum``. Eager runs compute both sides from the same step values.
Doctor: warmup-divergence, at build. The FULL graph reuses the split plan (``num_splits``, ``out_accum``) its capture
decided, while ``build`` decides the scheduler metadata's split counts anew each step from the step's shapes.
Fix (upstream): ``FlashAttentionMetadataBuilder.__init__`` sets ``self.aot_schedule = False`` when
``use_full_cuda_graph`` (comment: the scheduler and kernel must use the same ``num_splits``, heuristically decided by the
kernel launching code), and ``build`` no longer copies scheduler metadata into the persistent buffer; the kernel then
runs its own prepare step inside the graph, bounded by the captured ``num_splits``.
Modelled: ``FlashAttentionMetadataBuilder`` (``__init__``, ``build`` with ``schedule``, ``build_for_cudagraph_capture``),
``FlashAttentionImpl.forward`` with ``reshape_and_cache_flash``, ``GPUModelRunner`` (persistent ``input_ids``,
``positions``, ``query_start_loc``, ``seq_lens``, block table and slot mapping; ``_prepare_inputs``, ``execute_model``
with ``pad_for_cudagraph``, ``_dummy_run``, ``capture_model``), ``CUDAPiecewiseBackend`` as the FULL-graph wrapper
(one piece; its separate warmup calls folded into the capture call), and FA3's host side (``get_num_splits``,
``num_splits_heuristic``, ``get_scheduler_metadata``, ``flash_attn_varlen_func``) with its kernels as torch ops
(``prepare_varlen_num_blocks``, the split forward writing per-split partials into ``out_accum``, the combine).
Stand-ins: 8 SMs, kBlockM = kBlockN = 4, page size 4, 4 query heads over 1 KV head (packed GQA), head size 4, one
attention layer with learned positions, greedy sampling; float64. An out-of-range split index is an indexing error
(an illegal memory access on the GPU).
Workload: FULL graphs for 1, 2, 4 tokens; max_model_len 32. Requests A (prompt 15) and B (prompt 3) prefill eagerly
(18 tokens), then decode together in the size-2 graph (captured with ``num_splits`` 4). Decode step 1 (A at 16 tokens,
4 KV blocks) gets a bound of 1; step 2 (A at 17 tokens, 5 blocks) gets 5 and gives A 5 splits.
Measured: the bug raises at decode step 2 (RuntimeError "index 4 is out of bounds for dimension 2 with size 4");
before it, the prefill (eager) and decode step 1 (replayed with 1 split per request) match eager within 9.1e-15. The
fix replays all four decode steps, its in-graph prepare bounded by the captured 4 splits (A gets 4 where eager uses
5), and equals eager (max error 1.8e-14: float64 rounding of differently split softmax sums).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/20057"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "build"
SYMPTOM = ("FULL CUDA graph with FA3 AOT scheduling: a step whose scheduler metadata allows more KV splits than the "
           "captured kernel's num_splits makes the replay write past its split accumulator (illegal memory access)")

VOCAB, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 16, 4, 1, 4
HIDDEN = NUM_HEADS * HEAD_SIZE
BLOCK_SIZE, NUM_BLOCKS, MAX_MODEL_LEN = 4, 16, 32
MAX_NUM_BLOCKS_PER_REQ = MAX_MODEL_LEN // BLOCK_SIZE
MAX_NUM_REQS, MAX_NUM_BATCHED_TOKENS = 4, 32
CUDAGRAPH_CAPTURE_SIZES = [1, 2, 4]
CUDAGRAPH_NUM_OF_WARMUPS = 1
NUM_SM, KBLOCK_M, KBLOCK_N = 8, 4, 4            # FA3 (hopper) stand-ins: SM count and tile sizes
PAD_SLOT_ID = -1
DTYPE = torch.float64

_variant = "bug"


def cdiv(a, b):
    return (a + b - 1) // b


# --- vllm_flash_attn: hopper/heuristics.h, hopper/flash_api.cpp, flash_prepare_scheduler.cu (reduced) -----------------

def num_splits_heuristic(total_mblocks, num_SMs, num_n_blocks, num_m_blocks, size_one_kv_head, is_causal_or_local,
                         max_splits):
    if total_mblocks >= 0.8 * num_SMs:
        size_l2 = 50 * 1024 * 1024
        if size_one_kv_head > size_l2 and num_m_blocks >= num_SMs * 2 and not is_causal_or_local:
            return min((size_one_kv_head + size_l2 - 1) // size_l2, max_splits)
        return 1
    if num_n_blocks <= 4:
        return 1
    max_splits = min(max_splits, num_SMs, num_n_blocks)
    efficiency = []
    for num_splits in range(1, max_splits + 1):
        n_waves = float(total_mblocks * num_splits) / num_SMs
        efficiency.append(n_waves / math.ceil(n_waves))
    max_efficiency = max(efficiency)
    for num_splits in range(1, max_splits + 1):
        if efficiency[num_splits - 1] >= 0.85 * max_efficiency:
            return num_splits
    return 1


@dataclasses.dataclass
class Flash_fwd_params:
    b: int
    seqlen_q: int
    seqlen_k: int
    h: int
    h_k: int
    d: int
    is_causal: bool
    num_sm: int = NUM_SM
    use_dynamic_split: bool = True
    num_splits: int = 1
    pack_gqa: bool = False


def get_num_splits(params: Flash_fwd_params) -> int:
    seqlen_q_packgqa = params.seqlen_q * (params.h // params.h_k)
    num_n_blocks = cdiv(params.seqlen_k, KBLOCK_N)
    num_m_blocks = cdiv(seqlen_q_packgqa, KBLOCK_M)
    size_one_kv_head = params.seqlen_k * (params.d + params.d) * 2
    # If varlen, we use dynamic split, so this heuristic just needs to get an upper bound on num_splits.
    total_mblocks = (1 if params.use_dynamic_split else params.b) * params.h_k * num_m_blocks
    return num_splits_heuristic(total_mblocks, params.num_sm, num_n_blocks, num_m_blocks, size_one_kv_head,
                                params.is_causal, 128)


def prepare_varlen_num_blocks(params: Flash_fwd_params, cu_seqlens_q, seqused_k, tile_count_semaphore):
    """prepare_varlen_num_blocks_kernel: per-request split counts, bounded by ``params.num_splits``."""
    qhead_per_khead = params.h // params.h_k if params.pack_gqa else 1
    num_head = params.h_k if params.pack_gqa else params.h
    seqlen_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long() * qhead_per_khead
    num_m_blocks = torch.div(seqlen_q + KBLOCK_M - 1, KBLOCK_M, rounding_mode="floor")
    num_n_blocks = torch.div(seqused_k.long() + KBLOCK_N - 1, KBLOCK_N, rounding_mode="floor")
    total_blocks = (num_m_blocks * num_n_blocks).sum()
    blocks_per_sm = torch.ceil(total_blocks.float() * 1.1 * num_head / params.num_sm).long()
    num_splits_dynamic = torch.div(num_n_blocks + blocks_per_sm - 1, blocks_per_sm, rounding_mode="floor")
    num_splits_dynamic = num_splits_dynamic.clamp(max=params.num_splits).clamp(min=1)
    tile_count_semaphore[:1].zero_()
    tile_count_semaphore[1:1 + params.b].copy_(num_splits_dynamic.to(torch.int32))


def get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, cache_seqlens, num_heads_q, num_heads_kv, headdim,
                           page_size, cu_seqlens_q, causal):
    """mha_fwd_get_scheduler_metadata: ``num_splits`` from the given maxima, then the prepare kernel."""
    params = Flash_fwd_params(b=batch_size, seqlen_q=max_seqlen_q, seqlen_k=max_seqlen_k, h=num_heads_q,
                              h_k=num_heads_kv, d=headdim, is_causal=causal)
    params.num_splits = get_num_splits(params)
    params.pack_gqa = params.num_splits > 1           # Always enable PackGQA for Split
    tile_count_semaphore = torch.empty(1 + batch_size, dtype=torch.int32, device=cache_seqlens.device)
    prepare_varlen_num_blocks(params, cu_seqlens_q, cache_seqlens, tile_count_semaphore)
    return tile_count_semaphore


def run_mha_fwd(params, q, key_cache, value_cache, out, cu_seqlens_q, seqused_k, block_table, softmax_scale,
                num_splits_dynamic, out_accum, softmax_lse_accum):
    """The varlen paged forward (causal): each request's KV blocks are cut into its dynamic number of splits; every
    split writes its partial output and LSE at its split index of ``out_accum`` / ``softmax_lse_accum``."""
    total_q, device = q.shape[0], q.device
    tok = torch.arange(total_q, dtype=cu_seqlens_q.dtype, device=device)
    bidb = torch.searchsorted(cu_seqlens_q[1:], tok, right=True).clamp(max=params.b - 1)
    valid_q = tok < cu_seqlens_q[params.b]
    seqlen_k = seqused_k[bidb].long()
    q_pos = seqlen_k - (cu_seqlens_q[bidb + 1] - tok).long()
    kv = torch.arange(block_table.shape[1] * BLOCK_SIZE, device=device)
    blocks = block_table[bidb][:, kv // BLOCK_SIZE].long()
    k = key_cache[blocks, kv % BLOCK_SIZE][:, :, 0]                                # [total_q, L, d] (one KV head)
    v = value_cache[blocks, kv % BLOCK_SIZE][:, :, 0]
    keep = (kv[None, :] <= q_pos[:, None]) & (kv[None, :] < seqlen_k[:, None]) & valid_q[:, None]
    scores = torch.einsum("thd,tld->thl", q, k) * softmax_scale
    scores = scores.masked_fill(~keep[:, None, :], float("-inf"))
    if params.num_splits == 1:
        attn = torch.where(keep[:, None, :], torch.softmax(scores, -1), torch.zeros_like(scores))
        out.copy_(torch.where(valid_q[:, None, None], torch.einsum("thl,tld->thd", attn, v), out))
        return
    num_splits = num_splits_dynamic[bidb].long()
    num_n_blocks = torch.div(seqlen_k + KBLOCK_N - 1, KBLOCK_N, rounding_mode="floor")
    num_n_blocks_per_split = torch.div(num_n_blocks + num_splits - 1, num_splits, rounding_mode="floor").clamp(min=1)
    split_idx = torch.where(keep, (kv // KBLOCK_N)[None, :] // num_n_blocks_per_split[:, None], 0)
    idx = split_idx[:, None, :].expand_as(scores)                                  # [total_q, h, L]
    m = torch.full((total_q, params.h, out_accum.shape[0]), float("-inf"), dtype=q.dtype, device=device)
    m.scatter_reduce_(2, idx, scores, "amax")
    p = torch.where(keep[:, None, :], torch.exp(scores - m.gather(2, idx)), torch.zeros_like(scores))
    row_sum = torch.zeros_like(m).scatter_add_(2, idx, p)
    o_acc = out_accum.permute(2, 1, 0, 3)                                          # [total_q, h, splits, d]
    o_acc.zero_()
    o_acc.scatter_add_(2, idx[..., None].expand(*idx.shape, q.shape[-1]), p[..., None] * v[:, None, :, :])
    o_acc.div_(row_sum.clamp(min=1e-300)[..., None])
    softmax_lse_accum.permute(2, 1, 0).copy_(m + torch.log(row_sum))


def run_mha_fwd_combine(out, out_accum, softmax_lse_accum, num_splits_dynamic, cu_seqlens_q, b):
    total_q = out.shape[0]
    tok = torch.arange(total_q, dtype=cu_seqlens_q.dtype, device=out.device)
    bidb = torch.searchsorted(cu_seqlens_q[1:], tok, right=True).clamp(max=b - 1)
    valid_q = tok < cu_seqlens_q[b]
    lse = softmax_lse_accum.permute(2, 1, 0)                                       # [total_q, h, splits]
    used = torch.arange(lse.shape[-1], device=out.device)[None, :] < num_splits_dynamic[bidb].long()[:, None]
    lse = lse.masked_fill(~used[:, None, :], float("-inf"))
    weights = torch.softmax(lse, -1)
    combined = torch.einsum("ths,thsd->thd", weights, out_accum.permute(2, 1, 0, 3))
    out.copy_(torch.where(valid_q[:, None, None], combined, out))


def flash_attn_varlen_func(q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, softmax_scale, causal,
                           block_table, scheduler_metadata=None):
    """mha_fwd (varlen, paged KV): host-side split plan, then the kernels."""
    params = Flash_fwd_params(b=cu_seqlens_q.shape[0] - 1, seqlen_q=max_seqlen_q, seqlen_k=max_seqlen_k,
                              h=q.shape[1], h_k=k.shape[2], d=q.shape[2], is_causal=causal)
    params.num_splits = get_num_splits(params)
    params.pack_gqa = params.num_splits > 1
    if scheduler_metadata is not None:
        assert scheduler_metadata.shape[0] == 1 + params.b and scheduler_metadata.dtype == torch.int32
        tile_count_semaphore = scheduler_metadata
    else:
        tile_count_semaphore = torch.empty(1 + params.b, dtype=torch.int32, device=q.device)
        prepare_varlen_num_blocks(params, cu_seqlens_q, seqused_k, tile_count_semaphore)
    num_splits_dynamic = tile_count_semaphore[1:]
    total_q = q.shape[0]
    out_accum = softmax_lse_accum = None
    if params.num_splits > 1:
        out_accum = torch.empty(params.num_splits, params.h, total_q, params.d, dtype=q.dtype, device=q.device)
        softmax_lse_accum = torch.empty(params.num_splits, params.h, total_q, dtype=q.dtype, device=q.device)
    run_mha_fwd(params, q, k, v, out, cu_seqlens_q, seqused_k, block_table, softmax_scale, num_splits_dynamic,
                out_accum, softmax_lse_accum)
    if params.num_splits > 1:
        run_mha_fwd_combine(out, out_accum, softmax_lse_accum, num_splits_dynamic, cu_seqlens_q, params.b)
    return out


# --- vllm/forward_context.py, vllm/v1/attention/backends/flash_attn.py (June 2025, reduced) ---------------------------

_forward_context = None


class set_forward_context:
    def __init__(self, attn_metadata, num_tokens):
        self.attn_metadata, self.num_tokens = attn_metadata, num_tokens

    def __enter__(self):
        global _forward_context
        self.prev, _forward_context = _forward_context, self
        return self

    def __exit__(self, *exc):
        global _forward_context
        _forward_context = self.prev


@dataclasses.dataclass
class CommonAttentionMetadata:
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int


@dataclasses.dataclass
class FlashAttentionMetadata:
    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor
    max_seq_len: int
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    scheduler_metadata: torch.Tensor | None = None


class FlashAttentionMetadataBuilder:
    def __init__(self, runner: "GPUModelRunner", block_table: "BlockTable", full_cuda_graph: bool):
        self.runner = runner
        self.num_heads_q, self.num_heads_kv, self.headdim = NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE
        self.block_size = BLOCK_SIZE
        self.block_table = block_table

        self.aot_schedule = True                                  # get_flash_attn_version() == 3
        self.use_full_cuda_graph = full_cuda_graph
        if _variant == "bug":
            if self.use_full_cuda_graph and not self.aot_schedule:
                raise ValueError("Full CUDA graph mode requires AOT scheduling, "
                                 "which requires FlashAttention 3.")
            self.scheduler_metadata = torch.zeros(self.runner.max_num_reqs + 1, dtype=torch.int32,
                                                  device=self.runner.device)
        elif self.use_full_cuda_graph:
            # NOTE(lucas): AOT scheduling not supported in full cuda graph mode
            #  yet. This is because the scheduler and kernel need to always use
            #  the same num_splits (which acts as an upper bound with the
            #  dynamic split scheduler) which is currently heuristically decided
            #  by the kernel launching code.
            self.aot_schedule = False

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata) -> FlashAttentionMetadata:
        num_reqs = common_attn_metadata.num_reqs
        num_actual_tokens = common_attn_metadata.num_actual_tokens
        max_query_len = common_attn_metadata.max_query_len

        max_seq_len = int(self.runner.seq_lens_np[:num_reqs].max())
        query_start_loc = common_attn_metadata.query_start_loc
        seq_lens = common_attn_metadata.seq_lens
        block_table = self.block_table
        block_table_tensor = block_table.get_device_tensor()[:num_reqs]

        block_table.slot_mapping[:num_actual_tokens].copy_(
            block_table.slot_mapping_cpu[:num_actual_tokens].to(self.runner.device))
        # Fill unused with -1. Needed for reshape_and_cache in full cuda graph mode.
        block_table.slot_mapping[num_actual_tokens:].fill_(PAD_SLOT_ID)
        slot_mapping = block_table.slot_mapping[:num_actual_tokens]

        def schedule(batch_size, cu_query_lens, max_query_len, seqlens, max_seq_len, causal):
            if self.aot_schedule:
                return get_scheduler_metadata(
                    batch_size=batch_size, max_seqlen_q=max_query_len, max_seqlen_k=max_seq_len,
                    cache_seqlens=seqlens, num_heads_q=self.num_heads_q, num_heads_kv=self.num_heads_kv,
                    headdim=self.headdim, page_size=self.block_size, cu_seqlens_q=cu_query_lens, causal=causal)
            return None

        scheduler_metadata = schedule(batch_size=num_reqs, cu_query_lens=query_start_loc, max_query_len=max_query_len,
                                      seqlens=seq_lens, max_seq_len=max_seq_len, causal=True)

        if _variant == "bug" and self.use_full_cuda_graph:
            assert scheduler_metadata is not None
            n = scheduler_metadata.shape[0]
            self.scheduler_metadata[:n].copy_(scheduler_metadata, non_blocking=True)
            # NOTE(woosuk): We should zero out the rest of the scheduler
            # metadata to guarantee the correctness. Otherwise, some thread
            # blocks may use the invalid scheduler metadata and overwrite the
            # output buffer.
            self.scheduler_metadata[n:] = 0
            scheduler_metadata = self.scheduler_metadata[:n]

        return FlashAttentionMetadata(num_actual_tokens=num_actual_tokens, max_query_len=max_query_len,
                                      query_start_loc=query_start_loc, max_seq_len=max_seq_len, seq_lens=seq_lens,
                                      block_table=block_table_tensor, slot_mapping=slot_mapping,
                                      scheduler_metadata=scheduler_metadata)

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> FlashAttentionMetadata:
        return self.build(common_prefix_len=0, common_attn_metadata=common_attn_metadata)


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping):
    """Write each token's K/V at its slot; ``PAD_SLOT_ID`` entries are skipped."""
    kc, vc = key_cache.view(-1, NUM_KV_HEADS, HEAD_SIZE), value_cache.view(-1, NUM_KV_HEADS, HEAD_SIZE)
    valid = (slot_mapping >= 0)[:, None, None]
    slots = slot_mapping.clamp(min=0).long()
    kc[slots] = torch.where(valid, key, kc[slots])
    vc[slots] = torch.where(valid, value, vc[slots])


class FlashAttentionImpl:
    def __init__(self):
        self.scale = float(HEAD_SIZE) ** -0.5

    def forward(self, query, key, value, kv_cache, attn_metadata: FlashAttentionMetadata, output):
        num_actual_tokens = attn_metadata.num_actual_tokens
        key_cache, value_cache = kv_cache.unbind(0)
        reshape_and_cache_flash(key, value, key_cache, value_cache, attn_metadata.slot_mapping)
        flash_attn_varlen_func(
            q=query[:num_actual_tokens], k=key_cache, v=value_cache, out=output[:num_actual_tokens],
            cu_seqlens_q=attn_metadata.query_start_loc, max_seqlen_q=attn_metadata.max_query_len,
            seqused_k=attn_metadata.seq_lens, max_seqlen_k=attn_metadata.max_seq_len, softmax_scale=self.scale,
            causal=True, block_table=attn_metadata.block_table, scheduler_metadata=attn_metadata.scheduler_metadata)
        return output


class Model:
    """Embedding + one attention layer (4 query heads over 1 KV head) + lm_head."""

    def __init__(self, device):
        gen = generator(20057)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.embed, self.pos = r(VOCAB, HIDDEN, scale=1.0), r(MAX_MODEL_LEN, HIDDEN)
        self.wq, self.wk = r(HIDDEN, NUM_HEADS * HEAD_SIZE), r(HIDDEN, NUM_KV_HEADS * HEAD_SIZE)
        self.wv, self.wo = r(HIDDEN, NUM_KV_HEADS * HEAD_SIZE), r(NUM_HEADS * HEAD_SIZE, HIDDEN)
        self.lm_head = r(HIDDEN, VOCAB, scale=1.0)
        self.attn = FlashAttentionImpl()
        self.kv_cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, dtype=DTYPE, device=device)

    def forward(self, input_ids, positions):
        attn_metadata = _forward_context.attn_metadata
        h = self.embed[input_ids] + self.pos[positions]
        n = h.shape[0]
        q = (h @ self.wq).view(n, NUM_HEADS, HEAD_SIZE)
        k = (h @ self.wk).view(n, NUM_KV_HEADS, HEAD_SIZE)
        v = (h @ self.wv).view(n, NUM_KV_HEADS, HEAD_SIZE)
        output = torch.zeros_like(q)                                 # torch.empty upstream
        self.attn.forward(q, k, v, self.kv_cache, attn_metadata, output)
        return h + output.view(n, -1) @ self.wo

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head


# --- vllm/compilation/cuda_piecewise_backend.py (full_cuda_graph: the whole model is one piece) -------------------------

@dataclasses.dataclass
class ConcreteSizeEntry:
    runtime_shape: int
    use_cudagraph: bool
    cudagraph: object = None
    output: object = None


class CUDAPiecewiseBackend:
    def __init__(self, runnable, device, capture_sizes, static, state):
        self.runnable, self.device, self.static, self.state = runnable, device, static, state
        self.concrete_size_entries = {s: ConcreteSizeEntry(s, True) for s in capture_sizes}

    def __call__(self, input_ids, positions):
        runtime_shape = input_ids.shape[0]
        if runtime_shape not in self.concrete_size_entries:
            return self.runnable(input_ids, positions)
        entry = self.concrete_size_entries[runtime_shape]
        if entry.cudagraph is None:
            entry.cudagraph, entry.output = capture(
                lambda: self.runnable(input_ids, positions), device=self.device, warmups=CUDAGRAPH_NUM_OF_WARMUPS,
                static=self.static, state=self.state, owner="CUDAPiecewiseBackend (full_cuda_graph)",
                name=f"FULL graph num_tokens={runtime_shape}")
            return entry.output
        real = _forward_context.attn_metadata.num_actual_tokens
        return replay(entry.cudagraph, entry.output, real=real, size=runtime_shape)


# --- vllm/v1/worker/block_table.py, gpu_model_runner.py (June 2025, reduced) -------------------------------------------

class BlockTable:
    def __init__(self, device):
        self.block_table = torch.zeros(MAX_NUM_REQS, MAX_NUM_BLOCKS_PER_REQ, dtype=torch.int32, device=device)
        self.block_table_cpu = torch.zeros(MAX_NUM_REQS, MAX_NUM_BLOCKS_PER_REQ, dtype=torch.int32)
        self.slot_mapping = torch.zeros(MAX_NUM_BATCHED_TOKENS, dtype=torch.int64, device=device)
        self.slot_mapping_cpu = torch.zeros(MAX_NUM_BATCHED_TOKENS, dtype=torch.int64)

    def commit(self, num_reqs):
        self.block_table[:num_reqs].copy_(self.block_table_cpu[:num_reqs].to(self.block_table.device))

    def get_device_tensor(self):
        return self.block_table


@dataclasses.dataclass
class CachedRequestState:
    req_id: str
    token_ids: list
    block_ids: list
    num_computed_tokens: int = 0


class GPUModelRunner:
    def __init__(self, device, model, use_cuda_graph):
        self.device, self.model_impl = device, model
        self.max_num_reqs, self.max_model_len = MAX_NUM_REQS, MAX_MODEL_LEN
        self.use_cuda_graph = use_cuda_graph
        self.full_cuda_graph = use_cuda_graph                      # compilation_config.full_cuda_graph
        self.cudagraph_batch_sizes = CUDAGRAPH_CAPTURE_SIZES
        i32, i64 = dict(dtype=torch.int32), dict(dtype=torch.int64)
        self.input_ids = torch.zeros(MAX_NUM_BATCHED_TOKENS, **i64, device=device)
        self.positions = torch.zeros(MAX_NUM_BATCHED_TOKENS, **i64, device=device)
        self.query_start_loc = torch.zeros(MAX_NUM_REQS + 1, **i32, device=device)
        self.query_start_loc_cpu = torch.zeros(MAX_NUM_REQS + 1, **i32)
        self.query_start_loc_np = self.query_start_loc_cpu.numpy()
        self.seq_lens = torch.zeros(MAX_NUM_REQS, **i32, device=device)
        self.seq_lens_cpu = torch.zeros(MAX_NUM_REQS, **i32)
        self.seq_lens_np = self.seq_lens_cpu.numpy()
        self.block_table = BlockTable(device)
        self.attn_metadata_builder = FlashAttentionMetadataBuilder(self, self.block_table, self.full_cuda_graph)
        self.requests: list[CachedRequestState] = []
        static = {"input_ids": self.input_ids, "positions": self.positions, "query_start_loc": self.query_start_loc,
                  "seq_lens": self.seq_lens, "block_table": self.block_table.block_table,
                  "slot_mapping": self.block_table.slot_mapping}
        if getattr(self.attn_metadata_builder, "scheduler_metadata", None) is not None:
            static["scheduler_metadata"] = self.attn_metadata_builder.scheduler_metadata
        self.model = (CUDAPiecewiseBackend(model.forward, device, self.cudagraph_batch_sizes, static,
                                           {"kv_cache": model.kv_cache})
                      if use_cuda_graph else model.forward)

    def pad_for_cudagraph(self, num_tokens):
        return next(s for s in self.cudagraph_batch_sizes if s >= num_tokens)

    def _prepare_inputs(self, num_scheduled_tokens_per_req):
        num_reqs = len(self.requests)
        for i, req in enumerate(self.requests):
            self.block_table.block_table_cpu[i, :len(req.block_ids)] = torch.tensor(req.block_ids, dtype=torch.int32)
        self.block_table.commit(num_reqs)
        ids, pos, slots = [], [], []
        for req, n in zip(self.requests, num_scheduled_tokens_per_req):
            for p in range(req.num_computed_tokens, req.num_computed_tokens + n):
                ids.append(req.token_ids[p])
                pos.append(p)
                slots.append(req.block_ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
        total = len(ids)
        self.block_table.slot_mapping_cpu[:total] = torch.tensor(slots)
        self.query_start_loc_np[0] = 0
        self.query_start_loc_np[1:num_reqs + 1] = np.cumsum(num_scheduled_tokens_per_req)
        self.seq_lens_np[:num_reqs] = [r.num_computed_tokens + n
                                       for r, n in zip(self.requests, num_scheduled_tokens_per_req)]
        self.input_ids[:total].copy_(torch.tensor(ids).to(self.device))
        self.positions[:total].copy_(torch.tensor(pos).to(self.device))
        self.query_start_loc[:num_reqs + 1].copy_(self.query_start_loc_cpu[:num_reqs + 1].to(self.device))
        self.seq_lens[:num_reqs].copy_(self.seq_lens_cpu[:num_reqs].to(self.device))
        self.seq_lens[num_reqs:].fill_(0)
        self.query_start_loc[num_reqs + 1:].fill_(int(self.query_start_loc_cpu[num_reqs]))
        common_attn_metadata = CommonAttentionMetadata(
            query_start_loc=self.query_start_loc[:num_reqs + 1], seq_lens=self.seq_lens[:num_reqs],
            num_reqs=num_reqs, num_actual_tokens=total, max_query_len=max(num_scheduled_tokens_per_req))
        attn_metadata = self.attn_metadata_builder.build(common_prefix_len=0,
                                                         common_attn_metadata=common_attn_metadata)
        logits_indices = self.query_start_loc[1:num_reqs + 1].long() - 1
        return attn_metadata, logits_indices

    def execute_model(self, num_scheduled_tokens_per_req):
        attn_metadata, logits_indices = self._prepare_inputs(num_scheduled_tokens_per_req)
        num_scheduled_tokens = sum(num_scheduled_tokens_per_req)
        if self.use_cuda_graph and num_scheduled_tokens <= self.cudagraph_batch_sizes[-1]:
            num_input_tokens = self.pad_for_cudagraph(num_scheduled_tokens)
        else:
            num_input_tokens = num_scheduled_tokens
        with set_forward_context(attn_metadata, num_tokens=num_input_tokens):
            hidden_states = self.model(self.input_ids[:num_input_tokens], self.positions[:num_input_tokens])
        logits = self.model_impl.compute_logits(hidden_states[logits_indices])
        for req, n in zip(self.requests, num_scheduled_tokens_per_req):
            req.num_computed_tokens += n
        return logits.clone()

    def _dummy_run(self, num_tokens, capture_attn_cudagraph=False):
        num_reqs = min(num_tokens, self.max_num_reqs)
        num_scheduled_tokens_list = [num_tokens // num_reqs] * num_reqs
        num_scheduled_tokens_list[-1] += num_tokens % num_reqs
        attn_metadata = None
        if capture_attn_cudagraph:
            self.query_start_loc_np[:num_reqs + 1] = np.concatenate([[0], np.cumsum(num_scheduled_tokens_list)])
            self.query_start_loc[:num_reqs + 1].copy_(self.query_start_loc_cpu[:num_reqs + 1].to(self.device))
            query_start_loc = self.query_start_loc[:num_reqs + 1]
            # Make sure max_model_len is used at the graph capture time.
            self.seq_lens_np[:num_reqs] = self.max_model_len
            self.seq_lens_np[num_reqs:] = 0
            self.seq_lens[:num_reqs].copy_(self.seq_lens_cpu[:num_reqs].to(self.device))
            seq_lens = self.seq_lens[:num_reqs]
            common_attn_metadata = CommonAttentionMetadata(
                query_start_loc=query_start_loc, seq_lens=seq_lens, num_reqs=num_reqs, num_actual_tokens=num_tokens,
                max_query_len=num_tokens)
            attn_metadata = self.attn_metadata_builder.build_for_cudagraph_capture(common_attn_metadata)
        with set_forward_context(attn_metadata, num_tokens=num_tokens):
            return self.model(self.input_ids[:num_tokens], self.positions[:num_tokens])

    def capture_model(self):
        if not self.use_cuda_graph:
            return
        full_cg = self.full_cuda_graph
        for num_tokens in reversed(self.cudagraph_batch_sizes):
            self._dummy_run(num_tokens, capture_attn_cudagraph=full_cg)


# --- a reduced engine loop: greedy sampling --------------------------------------------------------------------------

def _serve(device, use_cuda_graph):
    model = Model(device)
    runner = GPUModelRunner(device, model, use_cuda_graph)
    runner.capture_model()
    gen = generator(57)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (15, 3)]
    runner.requests = [CachedRequestState("A", prompts[0], [1, 2, 3, 4, 5, 6]),
                       CachedRequestState("B", prompts[1], [7, 8])]
    outs = []
    scheduled = [len(p) for p in prompts]                       # step 0: both prompts (18 tokens, no graph)
    for _ in range(5):
        logits = runner.execute_model(scheduled)
        outs.append(logits)
        for req, tok in zip(runner.requests, torch.argmax(logits, -1).tolist()):
            req.token_ids.append(tok)
        scheduled = [1] * len(runner.requests)                  # decode: 2 tokens, the size-2 FULL graph
    return outs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: _serve(device, True), lambda: _serve(device, False))
