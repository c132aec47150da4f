"""DeepSeek-V4 under breakable prefill CUDA graphs: the compress-prefill planner's uniform-extend path loops over the padded graph bucket as if it were real tokens, so batch ids run past the batch and stage 1 reads req_pool_indices out of bounds.

Upstream: https://github.com/sgl-project/sglang/pull/27747 ("fix: DSV4 BCG compress-prefill plan OOB on underfilled
(tiny) prefill replay", YAMY1234, opened 2026-06-10, source commit f8b0a120b; cherry-picked to release/v0.5.13 as
https://github.com/sgl-project/sglang/pull/27864, merged 2026-06-11).
Symptom: DeepSeek-V4 with the breakable (piecewise) prefill CUDA graph (``--enforce-piecewise-cuda-graph``) crashes
the scheduler with ``CUDA error: an illegal memory access was encountered`` in the paged-compressor prefill plan
(``plan_compress_prefill``, c_plan.cuh) when a prefill much smaller than its captured bucket replays. The most
reliable trigger is the startup server warmup (``dp_size`` identical short prompts, batched into a uniform
``extend_len = 6`` prefill, replayed in the 2048-token bucket); any short uniform prefill hits the same path. Served
without the prefill graph the same requests run.
Mechanism: under the prefill graph the DSV4 backend builds the compress plan on the device:
``create_paged_compressor_data`` (compressor_v2.py) gets ``seq_lens_cpu=None`` and ``num_q_tokens`` = the token count
the step runs at, which for a graph replay is the captured bucket (the plan tensors need the bucket's rows), and
``CompressorPrefillPlan.generate`` -> ``plan_compress_prefill`` takes its GPU-input branch:
``plan_compress_prefill_kernel0`` then ``plan_compress_prefill_kernel_1``, both over ``num_q_tokens`` rows. In
kernel0, Stage A loads the ``batch_size`` requests' seq/prefix lengths into shared memory (``s_seq_len`` /
``s_prefix_len``, only threads ``tx < batch_size`` write); Stage B picks the "MTP-uniform" path whenever min(extend_len)
== max(extend_len) <= 32 (not specific to speculative decoding: the warmup takes it). That path loops
``for (k = tx; k < num_q; ...)`` and decomposes ``batch_id = k / E, j = k % E``, which assumes
``num_q == batch_size * E``. On an underfilled replay ``num_q`` is the bucket, so for every ``k >= batch_size * E``
``batch_id >= batch_size``: it reads shared rows no thread of this launch wrote (what an earlier launch left there),
and emits compress / write plans tagged with that batch id; ``plan_compress_prefill_kernel_1`` then does
``params.rid_ptr[batch_id]`` (``req_pool_indices`` has ``batch_size`` entries) and ``r2t_ptr + rid * stride_r2t``:
out of bounds, illegal memory access. Stage D already pads ``[counter, num_q)`` with ``PlanC/PlanW::invalid()``; only
the emitting loop's bound is wrong. Eagerly the backend passes the CPU lengths, the CPU branch plans with
``num_q_tokens = sum(extend_lens_cpu)`` (``RuntimeCheck(counter == num_q_tokens)``), and no batch id passes the batch.
Doctor: padded-shape-mismatch, at plan_compress_prefill_kernel0 (the planner runs at the graph's padded size: its
token loop is bounded by ``num_q_tokens``, the bucket, and combines that padded token range with per-request data
sized for the real batch, the shared rows filled for ``batch_size`` requests and ``req_pool_indices``; the fix changes
only this loop's bound).
Fix (upstream): in Path 1 of ``plan_compress_prefill_kernel0``, ``const uint32_t num_real_q = params.batch_size * E;
for (uint32_t k = tx; k < num_real_q; k += block_size)`` ("num_q is the padded buffer size (graph bucket), not the
work size: cap the loop at the real token count so batch_id = k / E stays < batch_size on an underfilled replay;
Stage D pads [counter, num_q) with invalid").
Modelled: one DeepSeek-V4 attention layer with the c4 compressor only (no c128, no indexer, no SWA window attention,
no MoE), HEAD_DIM 8; the compressor (``flash_compress4`` prefill) pools a window of 2 * ratio tokens with softmax(score
+ ape), the overlap's two projection halves folded into one; ``compress_norm_rope_store`` normalises and stores (no
rope); the attention reads the compressed cache only. The planner keeps c_plan.cuh's control flow: kernel0's 1024
threads are serialised (token ids in order, so the atomicAdd slots come out in the order the CPU branch writes them);
the block's shared memory is a per-device scratch that launches do not clear (it stands for uninitialised shared
memory: what the last launch left, zero at first). PlanC / PlanW are int64 rows (seq_len, ragged_id, buffer_len,
read_page_0, read_page_1) / (ragged_id | batch_id << 16, write_loc); invalid rows are -1. CPU-resident lengths are
Python lists. ``plan_compress_prefill_kernel_1`` is the PR-time one (compress plans translated only when
``buffer_len > 0``, write plans always). Device memory is bounds-checked per allocation as the GPU's MMU does: an
out-of-bounds load reads 0 and raises the device's sticky illegal-address flag, which the next host synchronisation
(the sampler's D2H copy) turns into ``RuntimeError: CUDA error: an illegal memory access was encountered``.
``full_to_swa`` is the identity; swa page 16, ring 8, token page 16; prefill buckets 8 and 16. The breakable capture
is spelled as the model's stage list (captured segments around the eager attention break, where ``eager_on_graph``
splits it); the logits tail is eager.
Workload: step 1 prefills A (first chunk, 6), B (5), C (3): non-uniform, 14 tokens in the 16 bucket; step 2 prefills
A's second chunk and a fresh D, 6 tokens each (uniform, 12 tokens in the 16 bucket: with the bug, token ids 12..15
give batch id 2, whose shared row still holds step 1's request C); step 3 B (4) and C (5).
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/27747"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "plan_compress_prefill_kernel0"
SYMPTOM = ("DSV4 + breakable prefill CUDA graph: a short uniform prefill replayed in a larger bucket makes the "
           "compress-prefill planner loop over the padded bucket, emit plans with batch ids past the batch, and "
           "index req_pool_indices out of bounds (illegal memory access)")

VOCAB, HIDDEN, HEAD_DIM = 32, 8, 8
COMPRESS_RATIO = 4                              # c4: overlapping windows of 2 * ratio tokens
SWA_PAGE_SIZE, RING_SIZE, PAGE_SIZE = 16, 8, 16
MAX_CONTEXT_LEN = 32
REQ_POOL_SIZE = 5                               # request slot 0: the capture's dummy request
NUM_FULL_SLOTS = (1 + 2 * (REQ_POOL_SIZE - 1)) * PAGE_SIZE   # page 0: dummy (capture) writes
CAPTURE_NUM_TOKENS = [8, 16]                    # breakable prefill buckets
kMaxPrefillBatchSize = 1024
kMaxMTPDraftTokens = 4
INVALID = -1

_kernel_variant = "bug"


class CudaContext:
    """A device: its sticky error state (a faulting kernel sets it, the next host synchronisation raises it) and the
    shared memory the planner's block gets (not cleared between launches)."""

    def __init__(self, device):
        self.illegal_address = torch.zeros((), dtype=torch.bool, device=device)
        self.s_seq_len = [0] * kMaxPrefillBatchSize
        self.s_prefix_len = [0] * kMaxPrefillBatchSize

    def synchronize(self):
        if bool(self.illegal_address):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")


_current_ctx: list[CudaContext] = []


def _global_load(mem, addr, mask, ctx):
    """Loads of ``mem`` (one allocation, flat) at element addresses ``addr`` where ``mask``: an address outside the
    allocation reads 0 and raises the sticky illegal-address flag."""
    legal = (addr >= 0) & (addr < mem.numel())
    ctx.illegal_address |= (mask & ~legal).any()
    return torch.where(mask & legal, mem[addr.clamp(0, mem.numel() - 1)], torch.zeros((), dtype=mem.dtype,
                                                                                         device=mem.device))


# --- python/sglang/jit_kernel/csrc/deepseek_v4/c_plan.cuh -------------------------------------------------------------

def pack_w(ragged_id, batch_id):
    return ragged_id | batch_id << 16


class Prefill0Params:
    def __init__(self, plan_c, plan_w, seq_lens_ptr, extend_lens_ptr, batch_size, num_q_tokens, compress_ratio,
                 swa_page_size, mtp_pad):
        self.plan_c, self.plan_w = plan_c, plan_w
        self.seq_lens_ptr, self.extend_lens_ptr = seq_lens_ptr, extend_lens_ptr
        self.batch_size, self.num_q_tokens = batch_size, num_q_tokens
        self.compress_ratio, self.swa_page_size, self.mtp_pad = compress_ratio, swa_page_size, mtp_pad


def plan_compress_prefill_kernel0(params, ctx):
    """One block of kMaxPrefillBatchSize threads, serialised; writes the plans into ``params.plan_c/plan_w``."""
    cr, sps = params.compress_ratio, params.swa_page_size
    is_overlap = cr == 4
    window_size = cr * (2 if is_overlap else 1)
    s_seq_len, s_prefix_len = ctx.s_seq_len, ctx.s_prefix_len       # __shared__
    plan_c, plan_w = [], []                                          # in atomicAdd order (counter_c, counter_w)

    # === Stage A: load per-batch fields, init shared scratch ===
    seq_lens, extend_lens = params.seq_lens_ptr.tolist(), params.extend_lens_ptr.tolist()
    for tx in range(params.batch_size):
        s_seq_len[tx] = int(seq_lens[tx])
        s_prefix_len[tx] = int(seq_lens[tx]) - int(extend_lens[tx])

    # === Stage B: min/max(extend_len) for MTP-uniform detection ===
    s_max_extend = max(int(e) for e in extend_lens)
    s_min_extend = min(int(e) for e in extend_lens)

    num_q = params.num_q_tokens
    # MTP-uniform: every batch shares the same small extend_len `E`, so we can decompose
    # a global token id `k` into (batch_id, j) = (k / E, k % E) and skip the per-batch loop.
    is_mtp_extend = s_min_extend == s_max_extend and 0 < s_max_extend <= 32

    def emit(position, j, ragged_id, batch_id, pl, sl):
        if (position + 1) % cr == 0:
            buffer_len = window_size - min(j + 1, window_size)
            plan_c.append([position + 1, ragged_id, buffer_len, -1, batch_id])
        last_c_pos = (sl // cr) * cr
        first_w_pos = min(last_c_pos - (cr if is_overlap else 0), sl - params.mtp_pad)
        do_write = position >= first_w_pos
        if not do_write and is_overlap:
            do_write = (position % sps) >= (sps - cr)
        if do_write:
            plan_w.append([pack_w(ragged_id, batch_id), position + 1])

    # === Stage C: emit valid plans, slot allocation via shared-mem atomicAdd ===
    if is_mtp_extend:
        # Path 1: token-driven. Each global token id maps to exactly one (batch_id, j).
        E = s_max_extend
        if _kernel_variant == "fix":
            # num_q is the *buffer* size (the static graph bucket), NOT the work size: bound the
            # work loop by the real token count; Stage D pads [counter, num_q) with invalid.
            num_real_q = params.batch_size * E
            bound = num_real_q
        else:
            bound = num_q
        for k in range(bound):                       # for (k = tx; k < bound; k += block_size)
            batch_id, j = k // E, k % E
            pl, sl = s_prefix_len[batch_id], s_seq_len[batch_id]
            emit(pl + j, j, k, batch_id, pl, sl)
    else:
        # Path 2: general prefill. Iterate batches in an outer loop; the block sweeps each batch's tokens.
        base_e = 0
        for batch_id in range(params.batch_size):
            pl, sl = s_prefix_len[batch_id], s_seq_len[batch_id]
            for j in range(sl - pl):
                emit(pl + j, j, base_e + j, batch_id, pl, sl)
            base_e += sl - pl

    # === Stage D: pad [counter_c, num_q) / [counter_w, num_q) with invalid ===
    dev = params.plan_c.device
    if plan_c:
        params.plan_c[:len(plan_c)] = torch.tensor(plan_c, dtype=torch.int64).to(dev)
    if plan_w:
        params.plan_w[:len(plan_w)] = torch.tensor(plan_w, dtype=torch.int64).to(dev)
    params.plan_c[len(plan_c):num_q] = INVALID
    params.plan_w[len(plan_w):num_q] = INVALID


def plan_compress_prefill_kernel_1(plan_c, plan_w, rid_ptr, r2t_ptr, f2s_ptr, stride_r2t, num_work, swa_page_size,
                                   ring_size, compress_ratio, ctx):
    """NOTE: stage 1. All ``num_work`` threads at once: translate batch ids and positions into state-ring slots."""
    plan_c, plan_w = plan_c[:num_work], plan_w[:num_work]
    r2t = r2t_ptr.view(-1)

    def compute_loc(swa_loc):
        return (swa_loc // swa_page_size) * ring_size + swa_loc % ring_size

    def swa_loc_of(rid, position, mask):
        raw_loc = _global_load(r2t, rid * stride_r2t + position, mask, ctx).to(torch.int64)   # mapping[position]
        return _global_load(f2s_ptr, raw_loc, mask, ctx)

    c_live = (plan_c[:, 1] != INVALID) & (plan_c[:, 2] > 0)          # !is_invalid() && buffer_len > 0
    batch_id = plan_c[:, 4]
    rid = _global_load(rid_ptr, batch_id, c_live, ctx)              # params.rid_ptr[batch_id]
    position_1 = plan_c[:, 0] - 1
    position_0 = (position_1 - compress_ratio).clamp(min=0)
    read_page_0 = compute_loc(swa_loc_of(rid, position_0, c_live)) // compress_ratio
    read_page_1 = compute_loc(swa_loc_of(rid, position_1, c_live)) // compress_ratio
    plan_c[:, 3] = torch.where(c_live, read_page_0, plan_c[:, 3])
    plan_c[:, 4] = torch.where(c_live, read_page_1, plan_c[:, 4])

    w_live = plan_w[:, 0] != INVALID
    ragged_id, batch_id = plan_w[:, 0] & 0xFFFF, plan_w[:, 0] >> 16    # unpack_w
    rid = _global_load(rid_ptr, batch_id, w_live, ctx)
    position = plan_w[:, 1] - 1
    write_loc = compute_loc(swa_loc_of(rid, position, w_live))
    plan_w[:, 0] = torch.where(w_live, ragged_id, plan_w[:, 0])
    plan_w[:, 1] = torch.where(w_live, write_loc, plan_w[:, 1])


def plan_compress_prefill(req_pool_indices, req_to_token, full_to_swa, seq_lens, extend_lens, num_q_tokens,
                          compress_ratio, swa_page_size, ring_size, use_cuda_graph):
    """Build c4/c128 prefill plan tensors. ``seq_lens``/``extend_lens``: device tensors (GPU-input branch) or
    CPU-resident lengths (Python lists)."""
    ctx = _current_ctx[-1]
    batch_size = len(seq_lens)
    is_overlap = compress_ratio == 4
    window_size = compress_ratio * (2 if is_overlap else 1)
    assert compress_ratio in (4, 128)
    assert batch_size <= num_q_tokens <= 0xFFFF                       # RuntimeCheck
    assert swa_page_size % ring_size == 0 and ring_size % compress_ratio == 0
    mtp_pad = min(ring_size - compress_ratio, kMaxMTPDraftTokens)
    device = req_pool_indices.device
    stride_r2t = req_to_token.stride(0)

    if isinstance(seq_lens, torch.Tensor):
        # GPU input path: kernel0 builds the (CPU-loop-equivalent) plan metadata directly on device,
        # padding to num_q_tokens with invalid; kernel_1 then finalizes the SWA-translated locations.
        assert batch_size <= kMaxPrefillBatchSize
        C = torch.empty(num_q_tokens, 5, dtype=torch.int64, device=device)    # ffi::empty
        W = torch.empty(num_q_tokens, 2, dtype=torch.int64, device=device)
        plan_compress_prefill_kernel0(Prefill0Params(C, W, seq_lens, extend_lens, batch_size, num_q_tokens,
                                                     compress_ratio, swa_page_size, mtp_pad), ctx)
        # kernel_1 sees the already-padded buffers, so num_c == num_w == num_padded == num_q_tokens.
        plan_compress_prefill_kernel_1(C, W, req_pool_indices, req_to_token, full_to_swa, stride_r2t, num_q_tokens,
                                       swa_page_size, ring_size, compress_ratio, ctx)
        return C, W

    # CPU input path.
    plan_c, plan_w = [], []
    counter = 0
    for i in range(batch_size):
        seq_len, extend_len = int(seq_lens[i]), int(extend_lens[i])
        prefix_len = seq_len - extend_len
        last_c_pos = seq_len // compress_ratio * compress_ratio
        first_w_pos = min(last_c_pos - (compress_ratio if is_overlap else 0), seq_len - mtp_pad)
        assert 0 < extend_len <= seq_len
        for j in range(extend_len):
            position, ragged_id = prefix_len + j, counter + j
            if (position + 1) % compress_ratio == 0:
                plan_c.append([position + 1, ragged_id, window_size - min(j + 1, window_size), -1, i])
            if position >= first_w_pos or (is_overlap and position % swa_page_size >= swa_page_size - compress_ratio):
                plan_w.append([pack_w(ragged_id, i), position + 1])
        counter += extend_len
    assert counter == num_q_tokens                                    # RuntimeCheck(counter == num_q_tokens)
    num_c_padded = num_q_tokens if use_cuda_graph else len(plan_c)
    num_w_padded = num_q_tokens if use_cuda_graph else len(plan_w)
    C = torch.full((num_c_padded, 5), INVALID, dtype=torch.int64, device=device)
    W = torch.full((num_w_padded, 2), INVALID, dtype=torch.int64, device=device)
    if plan_c:
        C[:len(plan_c)] = torch.tensor(plan_c, dtype=torch.int64).to(device)      # copy_to_device
    if plan_w:
        W[:len(plan_w)] = torch.tensor(plan_w, dtype=torch.int64).to(device)
    plan_compress_prefill_kernel_1(C, W, req_pool_indices, req_to_token, full_to_swa, stride_r2t,
                                   max(num_c_padded, num_w_padded), swa_page_size, ring_size, compress_ratio, ctx)
    return C, W


# --- python/sglang/jit_kernel/dsv4/compress.py (+ the c4 compress / fused_norm_rope kernels) --------------------------

class CompressorPrefillPlan:
    def __init__(self, compress_ratio, plan_c, plan_w):
        self.compress_ratio, self.plan_c, self.plan_w = compress_ratio, plan_c, plan_w

    @staticmethod
    def generate(compress_ratio, req_pool_indices, seq_lens, extend_lens, req_to_token, full_to_state, swa_page_size,
                 ring_size, num_q_tokens, use_cuda_graph=False):
        plan_c, plan_w = plan_compress_prefill(req_pool_indices, req_to_token, full_to_state, seq_lens, extend_lens,
                                               int(num_q_tokens), compress_ratio, swa_page_size, ring_size,
                                               use_cuda_graph)
        return CompressorPrefillPlan(compress_ratio, plan_c, plan_w)


def flash_compress4_prefill(kv_score_buffer, kv_score_input, out, ape, plan_c, plan_w):
    """Compress events: softmax(score + ape) pooling over the window of 2 * ratio positions ending at the event,
    the first ``buffer_len`` of them from the state ring (pages read_page_0 / read_page_1), the rest from this
    step's rows. Then the write plans save this step's rows into the ring."""
    cr = COMPRESS_RATIO
    window = 2 * cr
    i = torch.arange(window, device=plan_c.device)
    live = plan_c[:, 1] != INVALID
    pos = (plan_c[:, 0:1] - 1) - (window - 1) + i                                  # [n, window]
    from_buffer = i < plan_c[:, 2:3]
    page = torch.where(i < cr, plan_c[:, 3:4], plan_c[:, 4:5])
    slot = (page * cr + pos % cr).clamp(0, kv_score_buffer.shape[0] - 1)
    row = (plan_c[:, 1:2] - (window - 1) + i).clamp(0, kv_score_input.shape[0] - 1)
    x = torch.where(from_buffer[..., None], kv_score_buffer[slot], kv_score_input[row])
    kv, score = x[..., :HEAD_DIM], x[..., HEAD_DIM:] + ape
    valid = live[:, None] & (pos >= 0)
    score = score.masked_fill(~valid[..., None], float("-inf")).masked_fill(~live[:, None, None], 0.0)
    pooled = (torch.softmax(score, dim=1) * kv).sum(1)
    out.copy_(torch.where(live[:, None], pooled, torch.zeros_like(pooled)))
    w_live = plan_w[:, 0] != INVALID
    kv_score_buffer[plan_w[w_live, 1]] = kv_score_input[plan_w[w_live, 0]]


def compress_forward(kv_score_buffer, kv_score_input, ape, plan):
    out = kv_score_input.new_empty((plan.plan_c.shape[0], HEAD_DIM))    # prefill: plan rows
    flash_compress4_prefill(kv_score_buffer, kv_score_input, out, ape, plan.plan_c, plan.plan_w)
    return out


def compress_norm_rope_store(kv, plan, *, norm_weight, norm_eps, out_loc, kvcache):
    live = plan.plan_c[:, 1] != INVALID
    ragged_id = plan.plan_c[live, 1]
    y = kv[live]
    y = y * torch.rsqrt((y * y).mean(-1, keepdim=True) + norm_eps) * norm_weight
    kvcache[out_loc[ragged_id]] = y


# --- python/sglang/srt/mem_cache/deepseek_v4_memory_pool.py -----------------------------------------------------------

class DeepSeekV4TokenToKVPool:
    def __init__(self, device):
        self.swa_page_size = SWA_PAGE_SIZE
        self.full_to_swa_index_mapping = torch.arange(NUM_FULL_SLOTS, dtype=torch.int64, device=device)
        num_swa_pages = NUM_FULL_SLOTS // SWA_PAGE_SIZE
        # c4 compressor state: a ring of RING_SIZE (kv, score) slots per swa page
        self.kv_score_buffer = torch.zeros(num_swa_pages * RING_SIZE, 2 * HEAD_DIM, device=device)
        self.extra_key_buffer = torch.zeros(NUM_FULL_SLOTS // COMPRESS_RATIO, HEAD_DIM, device=device)   # c4 cache

    def get_ring_size(self, compress_ratio):
        return RING_SIZE


class ReqToTokenPool:
    def __init__(self, device):
        self.req_to_token = torch.zeros(REQ_POOL_SIZE, MAX_CONTEXT_LEN, dtype=torch.int32, device=device)
        self.free_slots = list(range(1, REQ_POOL_SIZE))

    def alloc(self):
        slot = self.free_slots.pop(0)
        first = (1 + 2 * (slot - 1)) * PAGE_SIZE                          # two token pages per request
        self.req_to_token[slot] = torch.arange(first, first + MAX_CONTEXT_LEN, dtype=torch.int32).to(
            self.req_to_token.device)
        return slot


# --- python/sglang/srt/layers/attention/dsv4/compressor_v2.py, deepseek_v4_backend.py --------------------------------

def create_paged_compressor_data(compress_ratio, *, token_to_kv_pool, req_to_token, req_pool_indices, seq_lens,
                                 extend_lens, seq_lens_cpu=None, extend_lens_cpu=None, use_prefill_cuda_graph=False,
                                 num_q_tokens=None):
    if seq_lens_cpu is not None:
        seq_lens_planner, extend_lens_planner = list(seq_lens_cpu), list(extend_lens_cpu)
        num_q_tokens = sum(extend_lens_cpu)
    else:
        assert num_q_tokens is not None
        seq_lens_planner, extend_lens_planner = seq_lens, extend_lens
    return CompressorPrefillPlan.generate(
        compress_ratio=compress_ratio, req_pool_indices=req_pool_indices, seq_lens=seq_lens_planner,
        extend_lens=extend_lens_planner, req_to_token=req_to_token,
        full_to_state=token_to_kv_pool.full_to_swa_index_mapping, swa_page_size=token_to_kv_pool.swa_page_size,
        ring_size=token_to_kv_pool.get_ring_size(compress_ratio), num_q_tokens=num_q_tokens,
        use_cuda_graph=use_prefill_cuda_graph)


class DSV4Metadata:
    def __init__(self, token_req_pool_indices, positions, c4_out_loc, c4_compress_metadata):
        self.token_req_pool_indices, self.positions = token_req_pool_indices, positions
        self.c4_out_loc, self.c4_compress_metadata = c4_out_loc, c4_compress_metadata


class DeepseekV4AttnBackend:
    def __init__(self, token_to_kv_pool, req_to_token_pool):
        self.token_to_kv_pool, self.req_to_token = token_to_kv_pool, req_to_token_pool.req_to_token
        self.forward_metadata = None

    def init_forward_metadata(self, forward_batch, use_prefill_cuda_graph=False, num_tokens=None):
        dev = forward_batch.seq_lens.device
        real = forward_batch.num_token_non_padded_cpu
        num_tokens = real if num_tokens is None else num_tokens
        token_rid, positions = [], []
        for rid, pre, ext in zip(forward_batch.req_pool_indices.tolist(), forward_batch.extend_prefix_lens_cpu,
                                 forward_batch.extend_seq_lens_cpu):
            token_rid += [rid] * ext
            positions += range(pre, pre + ext)
        positions = torch.tensor(positions, dtype=torch.int64).to(dev)
        c4_out_loc = torch.full((num_tokens,), -1, dtype=torch.int64, device=dev)
        c4_out_loc[:real] = torch.where((positions + 1) % COMPRESS_RATIO == 0,
                                        forward_batch.out_cache_loc[:real] // COMPRESS_RATIO, -1)
        common = dict(token_to_kv_pool=self.token_to_kv_pool, req_to_token=self.req_to_token,
                      req_pool_indices=forward_batch.req_pool_indices, seq_lens=forward_batch.seq_lens,
                      extend_lens=forward_batch.extend_seq_lens, use_prefill_cuda_graph=use_prefill_cuda_graph)
        if use_prefill_cuda_graph:        # compress_gpu_plan: device lengths, plan rows = the step's (bucket) tokens
            plan = create_paged_compressor_data(COMPRESS_RATIO, seq_lens_cpu=None, extend_lens_cpu=None,
                                                num_q_tokens=num_tokens, **common)
        else:
            plan = create_paged_compressor_data(COMPRESS_RATIO, seq_lens_cpu=forward_batch.seq_lens_cpu,
                                                extend_lens_cpu=forward_batch.extend_seq_lens_cpu, **common)
        self.forward_metadata = DSV4Metadata(torch.tensor(token_rid, dtype=torch.int64).to(dev), positions,
                                             c4_out_loc, plan)

    def forward_compressor(self, kv_score_input, compressor):
        """CompressorBackendMixin.forward_unified -> _forward_compress_all_in_one."""
        pool, plan = self.token_to_kv_pool, self.forward_metadata.c4_compress_metadata
        kv_compressed = compress_forward(pool.kv_score_buffer, kv_score_input, compressor.ape, plan)
        compress_norm_rope_store(kv_compressed, plan, norm_weight=compressor.norm_weight, norm_eps=1e-6,
                                 out_loc=self.forward_metadata.c4_out_loc, kvcache=pool.extra_key_buffer)

    def forward_extend(self, q):
        """Sparse attention of each token over its request's compressed (c4) entries up to its position."""
        md, cr = self.forward_metadata, COMPRESS_RATIO
        c = torch.arange(MAX_CONTEXT_LEN // cr, device=q.device)
        last_pos = c * cr + cr - 1
        slots = self.req_to_token[md.token_req_pool_indices[:, None], last_pos[None, :]].long() // cr
        valid = last_pos[None, :] <= md.positions[:, None]
        keys = self.token_to_kv_pool.extra_key_buffer[slots]                         # [T, C, D]
        scores = (keys * q[:, None, :]).sum(-1) / HEAD_DIM ** 0.5
        has_any = valid.any(1, keepdim=True)
        scores = scores.masked_fill(~valid, float("-inf")).masked_fill(~has_any, 0.0)
        probs = torch.softmax(scores, -1) * has_any
        return (probs[..., None] * keys).sum(1)


# --- python/sglang/srt/models/deepseek_v4.py -------------------------------------------------------------------------

class Compressor:
    def __init__(self, gen, device):
        self.ratio = COMPRESS_RATIO
        self.wkv_gate = randn(HIDDEN, 2 * HEAD_DIM, gen=gen, device=device, scale=0.6)
        self.ape = randn(2 * COMPRESS_RATIO, HEAD_DIM, gen=gen, device=device, scale=0.3)
        self.norm_weight = 1.0 + randn(HEAD_DIM, gen=gen, device=device, scale=0.1)

    def compute_kv_score(self, x):
        return x @ self.wkv_gate


class DeepseekV4ForCausalLM:
    def __init__(self, device, attn_backend_ref):
        gen = generator(27747)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.wq = randn(HIDDEN, HEAD_DIM, gen=gen, device=device, scale=0.6)
        self.compressor = Compressor(gen, device)
        self.wo = randn(HEAD_DIM, HIDDEN, gen=gen, device=device, scale=0.6)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.6)
        self.get_attn_backend = attn_backend_ref

    def stages(self):
        """The forward, split where ``eager_on_graph`` splits a breakable capture: ``("graph", fn, names)`` segments
        return tensors named ``names``; ``("eager", fn, ())`` is the attention break (compressor + sparse attention)."""
        def pre_attn(env):
            hidden = self.embed_tokens[env["input_ids"]]
            kv_score = self.compressor.compute_kv_score(hidden)
            q = hidden @ self.wq
            return hidden, kv_score, q, torch.zeros(hidden.shape[0], HEAD_DIM, device=hidden.device)

        def attn_core(env):           # bcg attention break: live metadata, real tokens
            backend, real = self.get_attn_backend(), env["forward_batch"].num_token_non_padded_cpu
            backend.forward_compressor(env["kv_score"], self.compressor)
            env["attn_out"][:real].copy_(backend.forward_extend(env["q"][:real]))

        def post_attn(env):
            return (env["hidden"] + env["attn_out"] @ self.wo,)

        return [("graph", pre_attn, ("hidden", "kv_score", "q", "attn_out")), ("eager", attn_core, ()),
                ("graph", post_attn, ("hidden_out",))]

    def compute_logits(self, hidden, forward_batch):
        """LogitsProcessor (eager prefill tail): the last token of each request."""
        ext = torch.tensor(forward_batch.extend_seq_lens_cpu)
        last_index = (ext.cumsum(0) - 1).to(hidden.device)
        return hidden[last_index] @ self.lm_head


# --- python/sglang/srt/model_executor (forward_batch_info.py, prefill_cuda_graph_runner.py, model_runner.py) ----------

class ForwardBatch:
    def __init__(self, input_ids, req_pool_indices, prefix_lens, extend_lens, out_cache_loc, device):
        t = lambda xs, dt=torch.int64: torch.tensor(xs, dtype=dt).to(device)   # noqa: E731
        self.input_ids, self.out_cache_loc = t(input_ids), t(out_cache_loc)
        self.req_pool_indices = t(req_pool_indices)
        self.extend_prefix_lens_cpu, self.extend_seq_lens_cpu = list(prefix_lens), list(extend_lens)
        self.seq_lens_cpu = [p + e for p, e in zip(prefix_lens, extend_lens)]
        self.seq_lens, self.extend_seq_lens = t(self.seq_lens_cpu), t(self.extend_seq_lens_cpu)
        self.num_token_non_padded_cpu = len(input_ids)


class PrefillCudaGraphRunner:
    """The breakable (piecewise) prefill graph runner: one graph set per token bucket."""

    def __init__(self, model_runner):
        self.model_runner, self.device = model_runner, model_runner.device
        self.capture_num_tokens = CAPTURE_NUM_TOKENS
        self.input_ids = torch.zeros(max(CAPTURE_NUM_TOKENS), dtype=torch.int64, device=self.device)
        self.graphs = {}
        self.capture()

    def can_run(self, forward_batch):
        return forward_batch.num_token_non_padded_cpu <= max(self.capture_num_tokens)

    def capture(self):
        for num_tokens in reversed(self.capture_num_tokens):
            # dummy batch: one request of num_tokens tokens on request slot 0, every token on the dummy slot 0
            forward_batch = ForwardBatch([0] * num_tokens, [0], [0], [num_tokens], [0] * num_tokens, self.device)
            self.model_runner.attn_backend.init_forward_metadata(forward_batch, use_prefill_cuda_graph=True,
                                                                 num_tokens=num_tokens)
            env = {"input_ids": self.input_ids[:num_tokens], "forward_batch": forward_batch}
            segments = []
            for k, (kind, fn, names) in enumerate(self.model_runner.model.stages()):
                if kind == "eager":
                    fn(env)
                    segments.append((kind, fn, names, None, None))
                    continue
                g, out = capture(lambda fn=fn, env=env: fn(env), device=self.device,
                                 name=f"prefill bcg {num_tokens} segment {k}",
                                 owner="PrefillCudaGraphRunner (breakable)",
                                 static={"input_ids": self.input_ids} if k == 0 else None)
                env.update(zip(names, out))
                segments.append((kind, fn, names, g, out))
            self.graphs[num_tokens] = (segments, env)

    def replay_prepare(self, forward_batch):
        num_tokens = forward_batch.num_token_non_padded_cpu
        static_num_tokens = next(s for s in self.capture_num_tokens if s >= num_tokens)
        self.input_ids[num_tokens:static_num_tokens].zero_()
        self.input_ids[:num_tokens].copy_(forward_batch.input_ids)
        pad = static_num_tokens - num_tokens                      # padded tokens write to the dummy slot 0
        forward_batch.out_cache_loc = torch.cat([forward_batch.out_cache_loc,
                                                 forward_batch.out_cache_loc.new_zeros(pad)])
        self.model_runner.attn_backend.init_forward_metadata(forward_batch, use_prefill_cuda_graph=True,
                                                             num_tokens=static_num_tokens)
        return static_num_tokens

    def replay(self, forward_batch):
        static_num_tokens = self.replay_prepare(forward_batch)
        segments, env = self.graphs[static_num_tokens]
        env["forward_batch"] = forward_batch
        for kind, fn, names, g, out in segments:
            if kind == "eager":
                fn(env)
            else:
                env.update(zip(names, replay(g, out, real=forward_batch.num_token_non_padded_cpu,
                                             size=static_num_tokens)))
        return self.model_runner.model.compute_logits(env["hidden_out"], forward_batch)


class ModelRunner:
    def __init__(self, device, prefill_cuda_graph):
        self.device = device
        self.ctx = CudaContext(device)
        self.req_to_token_pool = ReqToTokenPool(device)
        self.token_to_kv_pool = DeepSeekV4TokenToKVPool(device)
        self.attn_backend = DeepseekV4AttnBackend(self.token_to_kv_pool, self.req_to_token_pool)
        self.model = DeepseekV4ForCausalLM(device, lambda: self.attn_backend)
        self.prefill_cuda_graph_runner = None
        if prefill_cuda_graph:
            _current_ctx.append(self.ctx)
            try:
                self.prefill_cuda_graph_runner = PrefillCudaGraphRunner(self)
            finally:
                _current_ctx.pop()

    def forward(self, forward_batch):
        _current_ctx.append(self.ctx)
        try:
            runner = self.prefill_cuda_graph_runner
            if runner is not None and runner.can_run(forward_batch):
                return runner.replay(forward_batch)
            return self.forward_extend(forward_batch)
        finally:
            _current_ctx.pop()

    def forward_extend(self, forward_batch):
        self.attn_backend.init_forward_metadata(forward_batch)
        env = {"input_ids": forward_batch.input_ids, "forward_batch": forward_batch}
        for kind, fn, names in self.model.stages():
            if kind == "eager":
                fn(env)
            else:
                env.update(zip(names, fn(env)))
        return self.model.compute_logits(env["hidden_out"], forward_batch)


PROMPTS = {"A": [3, 17, 9, 25, 4, 11, 2, 30, 7, 7, 19, 1], "B": [5, 22, 16, 8, 13, 27, 6, 14, 21],
           "C": [12, 31, 18, 0, 23, 10, 29, 15], "D": [26, 1, 9, 4, 20, 28]}
# (request, tokens this step); step 2 is a uniform extend_len 6 prefill: 12 tokens in the 16-token bucket
SCHEDULE = [[("A", 6), ("B", 5), ("C", 3)], [("A", 6), ("D", 6)], [("B", 4), ("C", 5)]]


def run(variant: str, device: str = "cpu"):
    global _kernel_variant
    _kernel_variant = variant

    def serve(prefill_cuda_graph: bool):
        runner = ModelRunner(device, prefill_cuda_graph)
        slots, done, outs = {}, {r: 0 for r in PROMPTS}, []
        for step in SCHEDULE:
            ids, pool_idx, pre, ext, locs = [], [], [], [], []
            for r, n in step:
                if r not in slots:
                    slots[r] = runner.req_to_token_pool.alloc()
                ids += PROMPTS[r][done[r]:done[r] + n]
                pool_idx.append(slots[r])
                pre.append(done[r])
                ext.append(n)
                locs += runner.req_to_token_pool.req_to_token[slots[r], done[r]:done[r] + n].tolist()
                done[r] += n
            logits = runner.forward(ForwardBatch(ids, pool_idx, pre, ext, locs, device))
            runner.ctx.synchronize()                       # the sampler's D2H copy of the next token ids
            outs.append(logits.clone())
        pool = runner.token_to_kv_pool                      # page 0 (the capture's dummy writes) left out
        return outs + [pool.kv_score_buffer[RING_SIZE:].clone(),
                       pool.extra_key_buffer[PAGE_SIZE // COMPRESS_RATIO:].clone()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
