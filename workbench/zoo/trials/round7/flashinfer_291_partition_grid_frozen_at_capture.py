"""The split-KV decode kernel's grid is the capture-time plan's chunk count; later plans need more chunks.

Upstream: https://github.com/flashinfer-ai/flashinfer/pull/291 ("bugfix: Fix the behavior of decode cuda
graph wrapper", commit e252c944).
Symptom: ``CUDAGraphBatchDecodeWithPagedKVCacheWrapper`` replays give wrong attention outputs once the
sequences are longer (or shorter) than those of the plan the graph was captured with; the old test only
replayed with the capture-time lengths, the fix's test replays with 1, 2, 3 pages per sequence and then
2048-token sequences (FlashInfer 0.0.x, June 2024).
Mechanism: ``begin_forward`` (run outside the graph before every step) partitions each sequence's pages
into chunks and writes the chunk metadata (``new_indptr``, ``batch_idx_map``, ``chunk_indptr``) into the
workspace, and records the chunk count ``batch_size_after_partition`` on the host. The split-KV kernel is
launched with one block per chunk, ``nblks(paged_kv.batch_size, num_kv_heads)`` with
``paged_kv.batch_size`` taken from that host count, so the captured launch keeps the capture-time plan's
count. A later plan with more chunks writes their metadata, the merge kernel reads every chunk up to
``chunk_indptr[batch]``, but the replayed launch computes only the first chunks: the merge combines the
others' partial states from whatever the workspace holds.
Doctor: host-work-frozen, at ``BatchDecodeWithPagedKVCacheDispatched`` (the launch sized by the host chunk
count).
Fix (upstream): in CUDA-graph mode always launch a fixed grid, the upper bound ``max_grid_size`` on the
chunk count; the plan pads ``new_indptr`` with its last value and writes a ``block_valid_mask``, and
blocks past the plan's chunks return early.
"""
from __future__ import annotations

import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/flashinfer-ai/flashinfer/pull/291"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "BatchDecodeWithPagedKVCacheDispatched"
SYMPTOM = "replays compute only the capture plan's chunks; the merge reads the other chunks' stale partial states"
PAGE, DIM, BATCH, NUM_PAGES = 2, 4, 2, 12
MAX_GRID = 6                       # max_grid_size / num_kv_heads: chunks that fit on the device at once
MAX_TOKENS = NUM_PAGES * PAGE      # widest chunk a plan can make


def partition_min_pages_per_chunk(max_grid_size, num_pages):
    """PartitionPagedKVCacheBinarySearchMinNumPagePerBatch: the fewest pages per chunk (binary search)
    such that the chunks fit the grid."""
    low, high = 1, max(num_pages)
    while low < high:
        mid = (low + high) // 2
        if sum(math.ceil(n / mid) for n in num_pages) > max_grid_size:
            low = mid + 1
        else:
            high = mid
    return low, sum(math.ceil(max(n, 1) / low) for n in num_pages)


class BatchDecodeHandler:
    """The C++ handler: the plan's auxiliary arrays live in the (pinned) workspace the kernels read."""

    def __init__(self, device, fixed_grid: bool):
        self.fixed_grid = fixed_grid
        z = lambda n, **kw: torch.zeros(n, dtype=torch.long, device=device, **kw)   # noqa: E731
        self.new_indptr = z(MAX_GRID + 1)
        self.new_last_page_len = z(MAX_GRID)
        self.batch_idx_map = z(MAX_GRID)
        self.chunk_indptr = z(BATCH + 1)
        self.block_valid_mask = torch.zeros(MAX_GRID, dtype=torch.bool, device=device)
        # split-KV partial states (tmp_v / tmp_s): one row per chunk
        self.tmp_v = torch.zeros(MAX_GRID, DIM, device=device)
        self.tmp_s = torch.zeros(MAX_GRID, device=device)
        self.batch_size_after_partition = 0
        self.fixed_grid_size = None

    def begin_forward(self, indptr, last_page_len):
        """BeginForwardDispatched: partition on the host, copy the arrays into the workspace."""
        num_pages = [indptr[i + 1] - indptr[i] for i in range(BATCH)]
        max_pages, new_batch_size = partition_min_pages_per_chunk(MAX_GRID, num_pages)
        new_indptr, new_last, idx_map, chunk_indptr = [0], [], [], [0]
        for b in range(BATCH):
            n_chunks = math.ceil(num_pages[b] / max_pages)
            chunk_indptr.append(chunk_indptr[-1] + n_chunks)
            for j in range(n_chunks):
                last = j == n_chunks - 1
                new_indptr.append(min(indptr[b] + (j + 1) * max_pages, indptr[b + 1]))
                new_last.append(last_page_len[b] if last else PAGE)
                idx_map.append(b)
        n = len(new_last)
        if self.fixed_grid:                      # the fix: pad to the fixed grid, mask the padding blocks
            new_indptr += [new_indptr[-1]] * (MAX_GRID - n)
            self.block_valid_mask.copy_(torch.arange(MAX_GRID) < n)
            self.fixed_grid_size = MAX_GRID
        self.new_indptr[:len(new_indptr)].copy_(torch.tensor(new_indptr))
        self.new_last_page_len[:n].copy_(torch.tensor(new_last))
        self.batch_idx_map[:n].copy_(torch.tensor(idx_map))
        self.chunk_indptr.copy_(torch.tensor(chunk_indptr))
        self.batch_size_after_partition = new_batch_size


def BatchDecodeWithPagedKVCacheDispatched(q, kv_data, kv_indices, handler, o):
    """Launch the split-KV kernel (one block per chunk), then VariableLengthMergeStates."""
    grid = handler.fixed_grid_size or handler.batch_size_after_partition   # paged_kv.batch_size
    start, end = handler.new_indptr[:grid], handler.new_indptr[1:grid + 1]
    pos = torch.arange(MAX_TOKENS, device=q.device)
    page_off, in_page = pos // PAGE, pos % PAGE
    n_pages = (end - start)[:, None]
    page = kv_indices[(start[:, None] + page_off).clamp(max=kv_indices.shape[0] - 1)]
    valid = (page_off < n_pages) & ((page_off < n_pages - 1) | (in_page < handler.new_last_page_len[:grid, None]))
    k, v = kv_data[page, 0, in_page], kv_data[page, 1, in_page]                 # [grid, tokens, DIM]
    qc = q[handler.batch_idx_map[:grid]]
    s = ((k * qc[:, None, :]).sum(-1) / DIM ** 0.5).masked_fill(~valid, float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = (torch.softmax(s, -1)[..., None] * v).sum(1)
    if handler.fixed_grid_size:                                                  # early return of padding blocks
        keep = handler.block_valid_mask[:grid]
        out = torch.where(keep[:, None], out, handler.tmp_v[:grid])
        lse = torch.where(keep, lse, handler.tmp_s[:grid])
    handler.tmp_v[:grid] = out
    handler.tmp_s[:grid] = lse
    # VariableLengthMergeStates: request b merges chunks [chunk_indptr[b], chunk_indptr[b + 1])
    c = torch.arange(MAX_GRID, device=q.device)
    mine = (c[None, :] >= handler.chunk_indptr[:-1, None]) & (c[None, :] < handler.chunk_indptr[1:, None])
    s_all = handler.tmp_s[None, :].expand(BATCH, MAX_GRID).masked_fill(~mine, float("-inf"))
    w = torch.softmax(s_all, -1)
    o.copy_(w @ handler.tmp_v)
    return o


class CUDAGraphBatchDecodeWithPagedKVCacheWrapper:
    """User-reserved indptr / indices / last_page_len buffers, fixed for the wrapper's lifetime."""

    def __init__(self, device, variant):
        self.indptr_buf = torch.zeros(BATCH + 1, dtype=torch.long, device=device)
        self.indices_buf = torch.zeros(NUM_PAGES, dtype=torch.long, device=device)
        self.last_page_len_buf = torch.zeros(BATCH, dtype=torch.long, device=device)
        self.handler = BatchDecodeHandler(device, fixed_grid=(variant == "fix"))
        self.o = torch.zeros(BATCH, DIM, device=device)

    def begin_forward(self, indptr, indices, last_page_len):
        self.indptr_buf.copy_(torch.tensor(indptr))
        self.indices_buf[:len(indices)].copy_(torch.tensor(indices))
        self.last_page_len_buf.copy_(torch.tensor(last_page_len))
        self.handler.begin_forward(indptr, last_page_len)

    def forward(self, q, kv_data):
        return BatchDecodeWithPagedKVCacheDispatched(q, kv_data, self.indices_buf, self.handler, self.o)


def plan(pages_per_seq):
    """indptr / indices / last_page_len for sequences of the given page counts (full last pages)."""
    indptr = [0]
    for n in pages_per_seq:
        indptr.append(indptr[-1] + n)
    return indptr, list(range(indptr[-1])), [PAGE] * BATCH


def run(variant: str, device: str = "cpu"):
    gen = generator(291)
    kv_data = randn(NUM_PAGES, 2, PAGE, DIM, gen=gen, device=device)
    capture_plan = plan([2, 1])                        # the runner's capture batch: 3 chunks
    steps = [(plan(p), randn(BATCH, DIM, gen=gen, device=device))
             for p in ([3, 2], [4, 3], [5, 4])]        # 5, 4 (2 pages a chunk) and 5 chunks

    def eager():
        wrapper = CUDAGraphBatchDecodeWithPagedKVCacheWrapper(device, variant)
        outs = []
        for p, q in steps:
            wrapper.begin_forward(*p)
            outs.append(wrapper.forward(q, kv_data).clone())
        return outs

    def served():
        wrapper = CUDAGraphBatchDecodeWithPagedKVCacheWrapper(device, variant)
        h = wrapper.handler
        q_buf = torch.zeros(BATCH, DIM, device=device)
        wrapper.begin_forward(*capture_plan)
        g, out = capture(lambda: wrapper.forward(q_buf, kv_data), device=device, warmups=3,
                         static={"q": q_buf, "paged_kv_indptr": wrapper.indptr_buf,
                                 "paged_kv_indices": wrapper.indices_buf,
                                 "paged_kv_last_page_len": wrapper.last_page_len_buf,
                                 "new_indptr": h.new_indptr, "new_last_page_len": h.new_last_page_len,
                                 "batch_idx_map": h.batch_idx_map, "chunk_indptr": h.chunk_indptr,
                                 "block_valid_mask": h.block_valid_mask},
                         state={"kv_data": kv_data}, owner="CUDAGraphBatchDecodeWithPagedKVCacheWrapper")
        outs = []
        for p, q in steps:
            wrapper.begin_forward(*p)                  # begin_forward is never captured
            q_buf.copy_(q)
            outs.append(replay(g, out).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
