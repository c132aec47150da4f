"""FlashInfer's batch-prefill planner sizes a CUDA-graph prefill's grid and tile arrays from an upper bound on the query tiles that forgets the GQA group size, so a step whose rows pack into more tiles than that bound never runs its last tiles and returns a previous step's partial results for them.

Upstream: https://github.com/flashinfer-ai/flashinfer/pull/652 ("bugfix: Fix the computation of `total_num_tiles_q`",
flashinfer-ai/flashinfer, merged 2024-12-12 as 4c1577713). Read: the commit message ("The previous upper bound forgot to
multiply with `gqa_group_size`") and its diff of ``include/flashinfer/attention/scheduler.cuh``:
``PrefillSplitQOKVIndptr`` computes, when ``enable_cuda_graph``, ``total_num_tiles_q = ceil_div(total_num_rows,
cta_tile_q) + batch_size - 1`` (fixed: ``ceil_div(total_num_rows * gqa_group_size, cta_tile_q) + batch_size - 1``) and
``padded_batch_size = max(max_batch_size_if_split, total_num_tiles_q)``; the fix also adds ``FLASHINFER_CHECK(new_batch_size
<= padded_batch_size)``. Also read, at the parent commit: the rest of ``PrefillSplitQOKVIndptr`` (packed qo lengths
``qo_len * gqa_group_size``, ``DetermineCtaTileQ``, one (request, q tile, kv tile) entry per CTA),
``PrefillBinarySearchKVChunkSize`` (split-kv always on under CUDA graphs), ``PrefillPlan`` (``max_batch_size_if_split =
2 * num_sm / num_kv_heads``; the int workspace regions ``request_indices``/``qo_tile_indices``/``kv_tile_indices`` of
``padded_batch_size`` entries, 16-byte aligned, filled by ``std::copy`` of all ``new_batch_size`` entries;
``block_valid_mask[i] = i < new_batch_size`` for ``i < padded_batch_size``; tmp_v/tmp_s and ``merge_indptr`` for the
split-kv merge) and the Python ``BatchPrefillWithRaggedKVCacheWrapper`` (cuda-graph mode: fixed batch size from
``qo_indptr_buf``, ``_max_total_num_rows`` fixed by the first plan, ``plan`` copying the indptrs into the user buffers,
``run`` launching ``ragged_run`` with the plan info). The kernel launch (grid = ``padded_batch_size`` CTAs, early return
on ``block_valid_mask``) and the merge are reconstructed from the plan layout; the serving runner is a stand-in. (The
bound was introduced by PR 639, which fixed grid sizes that varied between capture and replay; this program models the
later, separate defect in that bound: the missing GQA factor.)
Symptom: prefill under CUDA graphs with a GQA model returns wrong attention outputs for some requests when the token
budget is split unevenly (one long request, short ones): the tiles past ``padded_batch_size`` are never executed, and
their rows are merged from whatever an earlier step left in the split-kv scratch. Eager prefill (no CUDA-graph mode) plans
exactly ``new_batch_size`` CTAs and is correct.
Mechanism: in cuda-graph mode the planner must pick a grid size once (the captured launch keeps it), so it bounds the
number of query tiles from the fixed token budget: ``ceil(total_num_rows / cta_tile_q) + batch_size - 1``. Query rows are
packed per KV head (``qo_len * gqa_group_size`` rows per request), so the real tile count can be larger. The replan writes
the extra tiles past the arrays' ``padded_batch_size`` entries (into alignment padding), the captured kernel launches only
``padded_batch_size`` CTAs, and the merge gathers the missing rows' partial outputs from a stale scratch area.
Doctor: undersized-buffer, at PrefillSplitQOKVIndptr. The step's work (its tile list) does not fit the grid and the
per-CTA metadata arrays sized at capture from a bound that is too small, so part of the step is never served.
Fix (upstream): multiply the rows by ``gqa_group_size`` in the bound (and check ``new_batch_size <= padded_batch_size``).
Modelled: ``PrefillSplitQOKVIndptr``, ``PrefillBinarySearchKVChunkSize``, ``DetermineCtaTileQ`` (Ampere branch),
``PrefillPlan`` (the int workspace as one flat int32 buffer with 16-byte aligned regions and the same copy order, so an
overflow spills as upstream's does), ``BatchPrefillWithRaggedKVCacheWrapper`` (plan/run, cuda-graph and eager modes,
causal), the ragged prefill kernel (one CTA per tile: ``cta_tile_q`` packed rows of one request against all its KV; rows
written to the persistent float workspace ``tmp_v`` under split-kv, straight to the output otherwise) and the merge (a
gather: every row has one KV chunk here, ``kv_chunk_size`` 128 covers every request). Stand-ins: a device with 1 SM
(``max_batch_size_if_split`` = 2, so the bound decides the grid at these toy sizes; on an H100 it decides once a prefill
graph holds a few thousand tokens), a one-layer model (hidden 8, 4 query heads sharing 1 KV head, head dim 4, float64),
and a ``PrefillCudaGraphRunner`` capturing one prefill graph for a fixed budget of 40 tokens in 2 requests.
Workload: four prefill steps of 40 tokens split (20, 20), (39, 1), (10, 30), (33, 7). Packed per KV head, with
``cta_tile_q`` 128, they need 2, 3, 2 and 3 tiles; the bug's grid has 2 CTAs, so in steps 1 and 3 the second request's
tile never runs and its rows (row 39, then rows 33-39) return rows of the previous step (errors 4.85 and 7.94); steps
0 and 2 match. The fix plans 3 CTAs and equals eager (exactly).
"""
from __future__ import annotations

import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/flashinfer-ai/flashinfer/pull/652"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "PrefillSplitQOKVIndptr"
SYMPTOM = ("batch prefill in CUDA-graph mode with GQA: the planned grid and tile arrays come from a query-tile bound that "
           "forgets the GQA group size, so uneven token splits need more tiles than were captured and the missing tiles' "
           "rows come back as an earlier step's partial outputs")

HIDDEN, VOCAB = 8, 16
NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 1, 4
NUM_SM = 1                            # stand-in device: max_grid_size = 2 * num_sm
TOKEN_BUDGET, BATCH_SIZE = 40, 2      # the prefill graph's fixed rows and requests
INT_WORKSPACE_ELEMS = 256
TMP_ROWS = 512

_variant = "bug"


def ceil_div(a, b):
    return (a + b - 1) // b


# --- include/flashinfer/attention/scheduler.cuh -------------------------------------------------------------------------

def DetermineCtaTileQ(avg_packed_qo_len, head_dim):
    if avg_packed_qo_len > 64 and head_dim < 256:
        return 128
    return 64 if avg_packed_qo_len > 16 else 16         # Ampere or newer


def PrefillBinarySearchKVChunkSize(enable_cuda_graph, max_batch_size_if_split, packed_qo_len_arr, kv_len_arr,
                                   qo_chunk_size, min_kv_chunk_size=1):
    max_kv_len = max([1] + list(kv_len_arr))
    low, high = min_kv_chunk_size, max_kv_len
    while low < high:
        mid = (low + high) // 2
        new_batch_size = sum(ceil_div(q, qo_chunk_size) * ceil_div(k, mid) for q, k in zip(packed_qo_len_arr, kv_len_arr))
        if new_batch_size > max_batch_size_if_split:
            low = mid + 1
        else:
            high = mid
    return enable_cuda_graph or low < max_kv_len, low


def PrefillSplitQOKVIndptr(qo_indptr_h, kv_indptr_h, total_num_rows, batch_size, num_qo_heads, num_kv_heads, head_dim,
                           page_size, max_batch_size_if_split, enable_cuda_graph):
    gqa_group_size = num_qo_heads // num_kv_heads
    packed_qo_len_arr = [(qo_indptr_h[i + 1] - qo_indptr_h[i]) * gqa_group_size for i in range(batch_size)]
    kv_len_arr = [kv_indptr_h[i + 1] - kv_indptr_h[i] for i in range(batch_size)]
    min_kv_chunk_size = max(128 // page_size, 1)
    if enable_cuda_graph:
        # The dummy data the CUDA graph is created from fixes the maximum number of tokens.
        max_seq_len = total_num_rows - batch_size + 1
        cta_tile_q = DetermineCtaTileQ(max_seq_len * gqa_group_size, head_dim)
        # An upper bound for the number of q tiles, derived from the total number of rows and the batch size.
        if _variant == "fix":
            total_num_tiles_q = ceil_div(total_num_rows * gqa_group_size, cta_tile_q) + batch_size - 1
        else:
            total_num_tiles_q = ceil_div(total_num_rows, cta_tile_q) + batch_size - 1
    else:
        cta_tile_q = DetermineCtaTileQ(sum(packed_qo_len_arr) // batch_size, head_dim)
        total_num_tiles_q = sum(ceil_div(p, cta_tile_q) for p in packed_qo_len_arr)
    split_kv, kv_chunk_size = PrefillBinarySearchKVChunkSize(enable_cuda_graph, max_batch_size_if_split,
                                                             packed_qo_len_arr, kv_len_arr, cta_tile_q,
                                                             min_kv_chunk_size)
    request_indices, qo_tile_indices, kv_tile_indices, merge_indptr, o_indptr = [], [], [], [0], [0]
    new_batch_size = 0
    for request_idx in range(batch_size):
        packed_qo_len, kv_len = packed_qo_len_arr[request_idx], max(kv_len_arr[request_idx], 1)
        num_tiles_q, num_tiles_kv = ceil_div(packed_qo_len, cta_tile_q), ceil_div(kv_len, kv_chunk_size)
        for q_tile_idx in range(num_tiles_q):
            for kv_tile_idx in range(num_tiles_kv):
                new_batch_size += 1
                request_indices.append(request_idx)
                qo_tile_indices.append(q_tile_idx)
                kv_tile_indices.append(kv_tile_idx)
        qo_len = packed_qo_len // gqa_group_size
        for _ in range(qo_len):
            merge_indptr.append(merge_indptr[-1] + num_tiles_kv)
        o_indptr.append(o_indptr[-1] + qo_len * num_tiles_kv)
    padded_batch_size = max(max_batch_size_if_split, total_num_tiles_q) if enable_cuda_graph else new_batch_size
    if _variant == "fix":
        assert new_batch_size <= padded_batch_size, "new batch size should not exceed padded batch size"
    return (split_kv, new_batch_size, padded_batch_size, cta_tile_q, kv_chunk_size * page_size, request_indices,
            qo_tile_indices, kv_tile_indices, merge_indptr, o_indptr)


class AlignedAllocator:
    """Offsets in int32 elements of 16-byte aligned regions."""

    def __init__(self):
        self.offset = 0

    def aligned_alloc_offset(self, num_elems):
        off = self.offset
        self.offset += ceil_div(num_elems, 4) * 4
        return off


def PrefillPlan(int_buffer, qo_indptr_h, kv_indptr_h, total_num_rows, batch_size, num_qo_heads, num_kv_heads,
                head_dim, page_size, enable_cuda_graph):
    max_grid_size = 2 * NUM_SM                                   # num_blocks_per_sm * num_sm
    max_batch_size_if_split = max_grid_size // num_kv_heads
    (split_kv, new_batch_size, padded_batch_size, cta_tile_q, kv_chunk_size, request_indices, qo_tile_indices,
     kv_tile_indices, merge_indptr, o_indptr) = PrefillSplitQOKVIndptr(
        qo_indptr_h, kv_indptr_h, total_num_rows, batch_size, num_qo_heads, num_kv_heads, head_dim, page_size,
        max_batch_size_if_split, enable_cuda_graph)
    alloc = AlignedAllocator()
    info = {"cta_tile_q": cta_tile_q, "total_num_rows": total_num_rows, "padded_batch_size": padded_batch_size,
            "split_kv": split_kv, "enable_cuda_graph": enable_cuda_graph,
            "request_indices_offset": alloc.aligned_alloc_offset(padded_batch_size),
            "qo_tile_indices_offset": alloc.aligned_alloc_offset(padded_batch_size),
            "kv_tile_indices_offset": alloc.aligned_alloc_offset(padded_batch_size),
            "o_indptr_offset": alloc.aligned_alloc_offset(batch_size + 1),
            "kv_chunk_size_ptr_offset": alloc.aligned_alloc_offset(1)}
    host = [0] * INT_WORKSPACE_ELEMS                                # page_locked_int_buffer

    def copy(values, offset):                                       # std::copy: every entry, past the region's end
        host[offset:offset + len(values)] = values

    copy(request_indices, info["request_indices_offset"])
    copy(qo_tile_indices, info["qo_tile_indices_offset"])
    copy(kv_tile_indices, info["kv_tile_indices_offset"])
    copy(o_indptr, info["o_indptr_offset"])
    host[info["kv_chunk_size_ptr_offset"]] = kv_chunk_size
    if split_kv:
        info["merge_indptr_offset"] = alloc.aligned_alloc_offset(total_num_rows + 1)
        info["block_valid_mask_offset"] = alloc.aligned_alloc_offset(padded_batch_size)
        copy(merge_indptr, info["merge_indptr_offset"])
        copy([int(i < new_batch_size) for i in range(padded_batch_size)], info["block_valid_mask_offset"])
    int_buffer[:alloc.offset].copy_(torch.tensor(host[:alloc.offset], dtype=torch.int32))
    return info


# --- the ragged prefill kernel and merge (reconstructed from the plan layout) -----------------------------------------

def BatchPrefillWithRaggedKVCacheKernel(q, k, v, qo_indptr, kv_indptr, int_ws, tmp_v, o, plan_info, causal, sm_scale):
    """``padded_batch_size`` CTAs; CTA ``i`` serves ``cta_tile_q`` packed rows (token, head in group) of request
    ``request_indices[i]`` against all of its keys."""
    g = NUM_QO_HEADS // NUM_KV_HEADS
    grid, cta = plan_info["padded_batch_size"], plan_info["cta_tile_q"]
    dev = q.device
    ctas = torch.arange(grid, device=dev)
    req = int_ws[plan_info["request_indices_offset"] + ctas].long()
    qt = int_ws[plan_info["qo_tile_indices_offset"] + ctas].long()
    o_indptr = int_ws[plan_info["o_indptr_offset"]:plan_info["o_indptr_offset"] + BATCH_SIZE + 1].long()
    valid = (int_ws[plan_info["block_valid_mask_offset"] + ctas] != 0 if plan_info["split_kv"]
             else torch.ones(grid, dtype=torch.bool, device=dev))
    packed = qt[:, None] * cta + torch.arange(cta, device=dev)[None, :]          # [grid, cta]
    tok, head = packed // g, packed % g                                            # one KV head
    qo_start, qo_len = qo_indptr[req].long(), (qo_indptr[req + 1] - qo_indptr[req]).long()
    kv_start, kv_len = kv_indptr[req].long(), (kv_indptr[req + 1] - kv_indptr[req]).long()
    row_valid = valid[:, None] & (tok < qo_len[:, None])
    q_rows = q[(qo_start[:, None] + tok).clamp(max=q.shape[0] - 1), head]         # [grid, cta, D]
    j = torch.arange(TOKEN_BUDGET, device=dev)
    kv_idx = (kv_start[:, None] + j[None, :]).clamp(max=k.shape[0] - 1)           # [grid, L]
    keys, vals = k[kv_idx, 0], v[kv_idx, 0]                                        # [grid, L, D]
    scores = torch.einsum("gcd,gld->gcl", q_rows, keys) * sm_scale
    visible = j[None, None, :] < kv_len[:, None, None]
    if causal:
        visible = visible & (j[None, None, :] <= (tok + kv_len[:, None] - qo_len[:, None])[:, :, None])
    scores = torch.where(visible, scores, torch.full_like(scores, -1e9))
    out = torch.einsum("gcl,gld->gcd", torch.softmax(scores, -1), vals)
    if plan_info["split_kv"]:                                                      # partial results to tmp_v
        pos = o_indptr[req][:, None] + tok                                         # one kv tile per request here
        dst = torch.where(row_valid, pos, torch.full_like(pos, TMP_ROWS))          # scratch row for masked lanes
        tmp_v[dst, head] = out
    else:
        dst = torch.where(row_valid, qo_start[:, None] + tok, torch.full_like(tok, o.shape[0]))
        o_pad = torch.cat([o, o[:1]], 0)
        o_pad[dst, head] = out
        o.copy_(o_pad[:-1])


def VariableLengthMergeStates(tmp_v, int_ws, plan_info, o):
    """Rows with one KV chunk: the merge is a gather of their partial output."""
    n = plan_info["total_num_rows"]
    merge_indptr = int_ws[plan_info["merge_indptr_offset"]:plan_info["merge_indptr_offset"] + n].long()
    o.copy_(tmp_v[merge_indptr])


# --- flashinfer/prefill.py ---------------------------------------------------------------------------------------------

class BatchPrefillWithRaggedKVCacheWrapper:
    def __init__(self, float_workspace_buffer, use_cuda_graph=False, qo_indptr_buf=None, kv_indptr_buf=None):
        self._float_workspace_buffer = float_workspace_buffer                     # tmp_v lives here
        self.device = float_workspace_buffer.device
        self._int_workspace_buffer = torch.zeros(INT_WORKSPACE_ELEMS, dtype=torch.int32, device=self.device)
        self._use_cuda_graph = use_cuda_graph
        if use_cuda_graph:
            self._fixed_batch_size = len(qo_indptr_buf) - 1
        self._qo_indptr_buf, self._kv_indptr_buf = qo_indptr_buf, kv_indptr_buf
        self._max_total_num_rows = None

    @property
    def is_cuda_graph_enabled(self):
        return self._use_cuda_graph

    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim, causal=False):
        batch_size = len(qo_indptr) - 1
        total_num_rows = qo_indptr[-1]
        if self.is_cuda_graph_enabled:
            if self._max_total_num_rows is None:
                self._max_total_num_rows = total_num_rows
            elif total_num_rows > self._max_total_num_rows:
                raise ValueError("The total number of rows in qo_indptr in cuda graph mode cannot exceed the "
                                 "number of rows set during initialization.")
            if batch_size != self._fixed_batch_size:
                raise ValueError("The batch size should be fixed during the lifecycle of the wrapper in cuda graph "
                                 "mode.")
            self._qo_indptr_buf.copy_(torch.tensor(qo_indptr, dtype=torch.int32))
            self._kv_indptr_buf.copy_(torch.tensor(kv_indptr, dtype=torch.int32))
        else:
            self._qo_indptr_buf = torch.tensor(qo_indptr, dtype=torch.int32).to(self.device)
            self._kv_indptr_buf = torch.tensor(kv_indptr, dtype=torch.int32).to(self.device)
        self._plan_info = PrefillPlan(self._int_workspace_buffer, qo_indptr, kv_indptr,
                                      self._max_total_num_rows or total_num_rows, batch_size, num_qo_heads,
                                      num_kv_heads, head_dim, 1, self.is_cuda_graph_enabled)
        self._causal = causal

    def run(self, q, k, v):
        o = torch.empty_like(q)
        sm_scale = 1.0 / math.sqrt(q.size(-1))
        BatchPrefillWithRaggedKVCacheKernel(q, k, v, self._qo_indptr_buf, self._kv_indptr_buf,
                                            self._int_workspace_buffer, self._float_workspace_buffer, o,
                                            self._plan_info, self._causal, sm_scale)
        if self._plan_info["split_kv"]:
            VariableLengthMergeStates(self._float_workspace_buffer, self._int_workspace_buffer, self._plan_info, o)
        return o


# --- the serving side (stand-in) ---------------------------------------------------------------------------------------

class TinyGQAModel:
    def __init__(self, device):
        gen = generator(652)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device).double()
        self.wq = randn(HIDDEN, NUM_QO_HEADS * HEAD_DIM, gen=gen, device=device, scale=0.5).double()
        self.wk = randn(HIDDEN, NUM_KV_HEADS * HEAD_DIM, gen=gen, device=device, scale=0.5).double()
        self.wv = randn(HIDDEN, NUM_KV_HEADS * HEAD_DIM, gen=gen, device=device, scale=0.5).double()
        self.wo = randn(NUM_QO_HEADS * HEAD_DIM, HIDDEN, gen=gen, device=device, scale=0.5).double()

    def forward(self, input_ids, wrapper):
        x = self.embed[input_ids]
        n = input_ids.shape[0]
        q = (x @ self.wq).view(n, NUM_QO_HEADS, HEAD_DIM)
        k = (x @ self.wk).view(n, NUM_KV_HEADS, HEAD_DIM)
        v = (x @ self.wv).view(n, NUM_KV_HEADS, HEAD_DIM)
        return x + wrapper.run(q, k, v).reshape(n, -1) @ self.wo


def _float_workspace(device):
    return torch.zeros(TMP_ROWS + 1, NUM_QO_HEADS, HEAD_DIM, dtype=torch.float64, device=device)


class PrefillCudaGraphRunner:
    """One prefill graph for a fixed token budget and batch size (cuda-graph mode of the wrapper)."""

    def __init__(self, model, device):
        self.model, self.device = model, device
        self.input_ids = torch.zeros(TOKEN_BUDGET, dtype=torch.int64, device=device)
        self.qo_indptr_buf = torch.zeros(BATCH_SIZE + 1, dtype=torch.int32, device=device)
        self.kv_indptr_buf = torch.zeros(BATCH_SIZE + 1, dtype=torch.int32, device=device)
        self.wrapper = BatchPrefillWithRaggedKVCacheWrapper(_float_workspace(device), use_cuda_graph=True,
                                                            qo_indptr_buf=self.qo_indptr_buf,
                                                            kv_indptr_buf=self.kv_indptr_buf)
        dummy = self._indptr([TOKEN_BUDGET - BATCH_SIZE + 1] + [1] * (BATCH_SIZE - 1))
        self.wrapper.plan(dummy, dummy, NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, causal=True)
        self.graph, self.out = capture(lambda: self.model.forward(self.input_ids, self.wrapper), device=device,
                                       name=f"prefill [{TOKEN_BUDGET} tokens, {BATCH_SIZE} requests]",
                                       owner="PrefillCudaGraphRunner",
                                       static={"input_ids": self.input_ids, "qo_indptr_buf": self.qo_indptr_buf,
                                               "kv_indptr_buf": self.kv_indptr_buf,
                                               "int_workspace_buffer": self.wrapper._int_workspace_buffer})

    @staticmethod
    def _indptr(lens):
        out = [0]
        for n in lens:
            out.append(out[-1] + n)
        return out

    def forward(self, prompts):
        indptr = self._indptr([len(p) for p in prompts])
        self.input_ids.copy_(torch.tensor([t for p in prompts for t in p], dtype=torch.int64))
        self.wrapper.plan(indptr, indptr, NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, causal=True)
        return replay(self.graph, self.out)


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    splits = [(20, 20), (39, 1), (10, 30), (33, 7)]
    gen = generator(6520)
    batches = [[torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in split] for split in splits]

    def served():
        runner = PrefillCudaGraphRunner(TinyGQAModel(device), device)
        return [runner.forward(prompts).clone() for prompts in batches]

    def eager():
        model = TinyGQAModel(device)
        wrapper = BatchPrefillWithRaggedKVCacheWrapper(_float_workspace(device))
        outs = []
        for prompts in batches:
            indptr = PrefillCudaGraphRunner._indptr([len(p) for p in prompts])
            wrapper.plan(indptr, indptr, NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, causal=True)
            ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int64).to(device)
            outs.append(model.forward(ids, wrapper))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
