"""A prefill plan sized from the current batch: the captured kernel keeps the capture's grid and layout.

Upstream: https://github.com/flashinfer-ai/flashinfer/pull/639 ("feat: fix the maximal grid dimension in
prefill planning with CUDA graphs"), completed by https://github.com/flashinfer-ai/flashinfer/pull/641
("bugfix: Fix the batch size & kv indptr calculation"), which plans from the first plan's row count.
Report: flashinfer#411 (comment of 2024-12-04): "illegal memory access or correctness problems when using
BatchPrefillWithPagedKVCacheWrapper in CUDA graph mode, especially with large batch sizes ... the grid
dim3 differs between the capturing phase and the replay phase ... total_num_tiles_q seems to be causing
variability".
Symptom: prefill attention served by a CUDA graph (fixed batch size, varying ``qo_indptr``) returns wrong
rows or faults on some batches; the same batch run eagerly is right (flashinfer 0.1.6, Nov 2024).
Mechanism: ``plan`` derives the query tile size and the number of work items (``padded_batch_size``,
the kernel's grid) from the current ``qo_indptr``, and lays the work-item arrays out in the int workspace
at offsets that depend on that number. The kernel launch recorded by the capture keeps the capture's
grid, tile size and offsets. A later batch whose lengths need more work items gets a larger grid and
shifted arrays: the graph runs too few items and reads them at the old offsets.
Doctor: undersized-buffer, at ``PrefillPlan`` (the plan asks the graph for more work items, at other
offsets, than it captured).
Fix (upstream): under CUDA graphs the tile size comes from a maximal sequence length and the grid from
the upper bound ``ceil(total_num_rows / cta_tile_q) + batch_size``; #641 takes ``total_num_rows`` from the
first (capture) plan and derives the maximal length from it, so every later plan has the capture's grid
and layout; split-KV is always on under graphs, and its block-valid mask switches off the spare items.
"""
from __future__ import annotations

import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/flashinfer-ai/flashinfer/pull/639"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "PrefillPlan"
SYMPTOM = "wrong prefill rows (or an illegal access) when a batch needs more work items than the capture's"
HIDDEN = 4
BATCH_SIZE, MAX_ROWS = 4, 128         # the graph's fixed batch size and its row capacity
NUM_SM, NUM_BLOCKS_PER_SM = 2, 2      # max_grid_size = 4 (132 SMs on an H100)
NUM_QO_HEADS = NUM_KV_HEADS = 1
INT_WORKSPACE = 64                    # int32 elements of the int workspace buffer


def DetermineCtaTileQ(avg_packed_qo_len, head_dim):
    if avg_packed_qo_len > 64 and head_dim < 256:
        return 128
    return 64 if avg_packed_qo_len > 16 else 16          # Ampere or newer


def PrefillBinarySearchKVChunkSize(enable_cuda_graph, max_batch_size_if_split, packed_qo_len_arr,
                                   kv_len_arr, qo_chunk_size, min_kv_chunk_size, fixed):
    low, high = min_kv_chunk_size, max(max(kv_len_arr), 1)
    max_kv_len = high

    def count(chunk):
        return sum(math.ceil(q / qo_chunk_size) * math.ceil(max(k, 1) / chunk)
                   for q, k in zip(packed_qo_len_arr, kv_len_arr))

    while low < high:
        mid = (low + high) // 2
        if count(mid) > max_batch_size_if_split:
            low = mid + 1
        else:
            high = mid
    split_kv = (enable_cuda_graph or low < max_kv_len) if fixed else low < max_kv_len
    return split_kv, low, count(low)


def PrefillSplitQOKVIndptr(qo_indptr_h, kv_indptr_h, total_num_rows, batch_size, head_dim,
                           max_batch_size_if_split, enable_cuda_graph, fixed):
    gqa_group_size = NUM_QO_HEADS // NUM_KV_HEADS
    packed_qo_len_arr = [(qo_indptr_h[i + 1] - qo_indptr_h[i]) * gqa_group_size for i in range(batch_size)]
    kv_len_arr = [kv_indptr_h[i + 1] - kv_indptr_h[i] for i in range(batch_size)]
    if fixed and enable_cuda_graph:
        # the dummy data of the capture fixes the maximal number of tokens
        max_seq_len = total_num_rows - batch_size + 1
        cta_tile_q = DetermineCtaTileQ(max_seq_len * gqa_group_size, head_dim)
        total_num_tiles_q = math.ceil(total_num_rows / cta_tile_q) + batch_size
    else:
        cta_tile_q = DetermineCtaTileQ(sum(packed_qo_len_arr) // batch_size, head_dim)
        total_num_tiles_q = sum(math.ceil(n / cta_tile_q) for n in packed_qo_len_arr)
    split_kv, kv_chunk_size, new_batch_size = PrefillBinarySearchKVChunkSize(
        enable_cuda_graph, max_batch_size_if_split, packed_qo_len_arr, kv_len_arr, cta_tile_q,
        max(128 // 1, 1), fixed)                       # page_size 1 (ragged KV)
    if enable_cuda_graph and not fixed:
        split_kv = total_num_tiles_q < max_batch_size_if_split
    request_indices, qo_tile_indices, kv_tile_indices = [], [], []
    for request_idx in range(batch_size):
        num_tiles_q = math.ceil(packed_qo_len_arr[request_idx] / cta_tile_q)
        num_tiles_kv = math.ceil(max(kv_len_arr[request_idx], 1) / kv_chunk_size)
        for q_tile_idx in range(num_tiles_q):
            for kv_tile_idx in range(num_tiles_kv):
                request_indices.append(request_idx)
                qo_tile_indices.append(q_tile_idx)
                kv_tile_indices.append(kv_tile_idx)
    return (split_kv, total_num_tiles_q, new_batch_size, cta_tile_q, kv_chunk_size,
            request_indices, qo_tile_indices, kv_tile_indices)


class AlignedAllocator:
    """Offsets (in int32 elements) of the arrays a plan lays out in the int workspace."""

    def __init__(self):
        self.cur = 0                                   # bytes

    def aligned_alloc_offset(self, size, alignment):
        start = -(-self.cur // alignment) * alignment
        self.cur = start + size
        return start // 4

    def num_allocated_elems(self):
        return -(-self.cur // 4)


def PrefillPlan(int_buffer, page_locked_int_buffer, qo_indptr_h, kv_indptr_h, total_num_rows, batch_size,
                head_dim, enable_cuda_graph, fixed):
    max_grid_size = NUM_BLOCKS_PER_SM * NUM_SM
    max_batch_size_if_split = max_grid_size // NUM_KV_HEADS
    (split_kv, total_num_tiles_q, new_batch_size, cta_tile_q, kv_chunk_size, request_indices,
     qo_tile_indices, kv_tile_indices) = PrefillSplitQOKVIndptr(
        qo_indptr_h, kv_indptr_h, total_num_rows, batch_size, head_dim, max_batch_size_if_split,
        enable_cuda_graph, fixed)
    padded_batch_size = (max(max_batch_size_if_split, total_num_tiles_q) if enable_cuda_graph
                         else new_batch_size)
    plan_info = {"cta_tile_q": cta_tile_q, "padded_batch_size": padded_batch_size, "split_kv": split_kv}
    alloc = AlignedAllocator()
    plan_info["request_indices_offset"] = alloc.aligned_alloc_offset(4 * padded_batch_size, 16)
    plan_info["qo_tile_indices_offset"] = alloc.aligned_alloc_offset(4 * padded_batch_size, 16)
    plan_info["kv_tile_indices_offset"] = alloc.aligned_alloc_offset(4 * padded_batch_size, 16)
    o_indptr_offset = alloc.aligned_alloc_offset(4 * (batch_size + 1), 16)
    plan_info["kv_chunk_size_ptr_offset"] = alloc.aligned_alloc_offset(4, 1)
    h = page_locked_int_buffer
    for key, vec in (("request_indices_offset", request_indices), ("qo_tile_indices_offset", qo_tile_indices),
                     ("kv_tile_indices_offset", kv_tile_indices)):
        h[plan_info[key]:plan_info[key] + len(vec)] = torch.tensor(vec, dtype=torch.int32)
    h[o_indptr_offset:o_indptr_offset + batch_size + 1] = torch.tensor(qo_indptr_h, dtype=torch.int32)
    h[plan_info["kv_chunk_size_ptr_offset"]] = kv_chunk_size
    if split_kv:
        plan_info["block_valid_mask_offset"] = alloc.aligned_alloc_offset(4 * padded_batch_size, 16)
        off = plan_info["block_valid_mask_offset"]
        h[off:off + padded_batch_size] = (torch.arange(padded_batch_size) < new_batch_size).to(torch.int32)
    n = alloc.num_allocated_elems()
    int_buffer[:n].copy_(h[:n])                        # cudaMemcpyAsync of the planned bytes
    return plan_info


def BatchPrefillWithRaggedKVCacheKernel(q, k, v, qo_indptr, kv_indptr, int_workspace, plan_info):
    """One work item per (request, query tile, kv tile); grid = ``padded_batch_size``. Causal."""
    tile, grid = plan_info["cta_tile_q"], plan_info["padded_batch_size"]
    items = torch.arange(grid, device=q.device)
    r = int_workspace[plan_info["request_indices_offset"] + items].long()
    qo_tile = int_workspace[plan_info["qo_tile_indices_offset"] + items].long()
    kv_tile = int_workspace[plan_info["kv_tile_indices_offset"] + items].long()
    kv_chunk = int_workspace[plan_info["kv_chunk_size_ptr_offset"]].long()
    if plan_info["split_kv"]:
        item_ok = int_workspace[plan_info["block_valid_mask_offset"] + items] > 0
    else:
        item_ok = torch.ones(grid, dtype=torch.bool, device=q.device)
    rows_total = q.shape[0]
    qo_start, qo_end = qo_indptr[r], qo_indptr[r + 1]
    kv_start, kv_end = kv_indptr[r], kv_indptr[r + 1]
    rows = qo_start[:, None] + qo_tile[:, None] * tile + torch.arange(tile, device=q.device)      # [grid, tile]
    row_ok = (rows < qo_end[:, None]) & item_ok[:, None]
    kpos = kv_tile[:, None] * kv_chunk + torch.arange(rows_total, device=q.device)                  # [grid, kv]
    keys = kv_start[:, None] + kpos
    key_ok = (kpos < (kv_tile[:, None] + 1) * kv_chunk) & (keys < kv_end[:, None])
    causal = kpos[:, None, :] <= (rows - qo_start[:, None])[:, :, None]
    mask = row_ok[:, :, None] & key_ok[:, None, :] & causal
    qr = q[rows.clamp(0, rows_total - 1)]
    kr, vr = k[keys.clamp(0, rows_total - 1)], v[keys.clamp(0, rows_total - 1)]
    s = torch.einsum("gtd,gkd->gtk", qr, kr) / HIDDEN ** 0.5
    s = s.masked_fill(~mask, float("-inf"))
    w = torch.exp(s - s.amax(-1, keepdim=True).clamp(min=-1e30)) * mask
    o_tile = torch.einsum("gtk,gkd->gtd", w / w.sum(-1, keepdim=True).clamp(min=1e-30), vr)
    o = torch.empty(rows_total + 1, HIDDEN, device=q.device)          # empty_like(q); last row: scratch
    dest = torch.where(row_ok, rows, rows_total)
    o.index_put_((dest.reshape(-1),), o_tile.reshape(-1, HIDDEN))
    return o[:rows_total]


class BatchPrefillWithRaggedKVCacheWrapper:
    def __init__(self, device, use_cuda_graph=False, qo_indptr_buf=None, kv_indptr_buf=None, fixed=False):
        self.device, self.fixed = device, fixed
        self._use_cuda_graph = use_cuda_graph
        self._int_workspace_buffer = torch.zeros(INT_WORKSPACE, dtype=torch.int32, device=device)
        self._pin_memory_int_workspace_buffer = torch.zeros(INT_WORKSPACE, dtype=torch.int32)
        self._qo_indptr_buf, self._kv_indptr_buf = qo_indptr_buf, kv_indptr_buf
        self._fixed_batch_size = len(qo_indptr_buf) - 1 if use_cuda_graph else None
        self._max_total_num_rows = None

    def plan(self, qo_indptr, kv_indptr, head_dim=HIDDEN):
        batch_size = len(qo_indptr) - 1
        qo_indptr_host, kv_indptr_host = qo_indptr.tolist(), kv_indptr.tolist()
        total_num_rows = qo_indptr_host[-1]
        if self._use_cuda_graph:
            if self._max_total_num_rows is None:
                self._max_total_num_rows = total_num_rows
            elif total_num_rows > self._max_total_num_rows:
                raise ValueError(f"The total number of rows in qo_indptr {total_num_rows} in cuda graph mode "
                                 f"cannot exceed the number of rows set during initialization "
                                 f"{self._max_total_num_rows}.")
            if batch_size != self._fixed_batch_size:
                raise ValueError("The batch size should be fixed in cudagraph mode")
            self._qo_indptr_buf.copy_(qo_indptr)
            self._kv_indptr_buf.copy_(kv_indptr)
        else:
            self._qo_indptr_buf, self._kv_indptr_buf = qo_indptr.to(self.device), kv_indptr.to(self.device)
        if self.fixed and self._use_cuda_graph:
            total_num_rows = self._max_total_num_rows
        self._plan_info = PrefillPlan(self._int_workspace_buffer, self._pin_memory_int_workspace_buffer,
                                      qo_indptr_host, kv_indptr_host, total_num_rows, batch_size, head_dim,
                                      self._use_cuda_graph, self.fixed)

    def run(self, q, k, v):
        return BatchPrefillWithRaggedKVCacheKernel(q, k, v, self._qo_indptr_buf, self._kv_indptr_buf,
                                                   self._int_workspace_buffer, self._plan_info)


class Layer:
    def __init__(self, device):
        gen = generator(639)
        self.wq, self.wk, self.wv, self.wo = (randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
                                              for _ in range(4))

    def forward(self, x, wrapper):
        return x + wrapper.run(x @ self.wq, x @ self.wk, x @ self.wv) @ self.wo


def batches():
    """Query lengths of the batches (4 requests each, at most MAX_ROWS rows): the second needs five
    64-row tiles where the capture's dummy batch needed four."""
    return [[10, 20, 30, 40], [72, 24, 16, 16]]


def run(variant: str, device: str = "cpu"):
    fixed = variant == "fix"
    layer = Layer(device)
    gen = generator(6390)
    xs = [randn(sum(lens), HIDDEN, gen=gen, device=device) for lens in batches()]

    def indptr(lens):
        return torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=device)

    def eager():
        outs = []
        for lens, x in zip(batches(), xs):
            wrapper = BatchPrefillWithRaggedKVCacheWrapper(device, fixed=fixed)
            wrapper.plan(indptr(lens), indptr(lens))
            outs.append(layer.forward(x, wrapper))
        return outs

    def served():
        qo_indptr_buf = torch.zeros(BATCH_SIZE + 1, dtype=torch.int32, device=device)
        kv_indptr_buf = torch.zeros(BATCH_SIZE + 1, dtype=torch.int32, device=device)
        wrapper = BatchPrefillWithRaggedKVCacheWrapper(device, use_cuda_graph=True, qo_indptr_buf=qo_indptr_buf,
                                                       kv_indptr_buf=kv_indptr_buf, fixed=fixed)
        x_buf = torch.zeros(MAX_ROWS, HIDDEN, device=device)
        dummy = [MAX_ROWS // BATCH_SIZE] * BATCH_SIZE          # the capture's dummy batch fills the rows
        wrapper.plan(indptr(dummy), indptr(dummy))
        g, out = capture(lambda: layer.forward(x_buf, wrapper), device=device, name=f"prefill bs={BATCH_SIZE}",
                         static={"hidden_states": x_buf, "qo_indptr": qo_indptr_buf, "kv_indptr": kv_indptr_buf,
                                 "int_workspace": wrapper._int_workspace_buffer},
                         owner="prefill cuda graph runner")
        outs = []
        for lens, x in zip(batches(), xs):
            n = x.shape[0]
            x_buf[:n].copy_(x)
            wrapper.plan(indptr(lens), indptr(lens))
            outs.append(replay(g, out, real=n, size=MAX_ROWS, padded={"hidden_states": x_buf})[:n].clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
