"""A CUDA-graph MLA decode plan sizes its split-KV work list from a ``gdy`` the estimator never set.

Upstream: https://github.com/flashinfer-ai/flashinfer/pull/803 ("bugfix: mla decode failed under cuda graph
mode, and update test case"), commit 8b91e95f6.
Symptom: ``BatchDecodeMlaWithPagedKVCacheWrapper(use_cuda_graph=True)`` produced a failed / wrong MLA decode
under CUDA graphs; the same wrapper without CUDA-graph mode was correct (the test was switched to capture
``wrapper.run`` in a graph and replay it).
Mechanism: ``BatchDecodeWithPagedKVCacheWorkEstimationDispatchedMLA`` takes ``uint32_t& gdy`` as an out
parameter but declares ``const uint32_t gdy = ceil_div(num_qo_heads, qo_heads_per_block)`` inside its
dispatch block, shadowing it: the split-KV search uses the right local value, while the caller's ``gdy``
(declared uninitialised in ``DecodePlan``) keeps whatever it held. Only the CUDA-graph branch of
``DecodePlan`` reads it: ``padded_batch_size = split_kv ? max_grid_size / gdy : batch_size`` fixes the
number of (request, KV-chunk) work items the captured kernel's grid and its ``request_indices`` /
``kv_tile_indices`` / ``block_valid_mask`` buffers cover. With a stale ``gdy`` larger than the real one,
the plan's ``new_batch_size`` work items do not fit the ``padded_batch_size`` the graph was captured
for, so the replayed kernel drops the trailing KV chunks and the merged attention is wrong. Eager mode
uses ``padded_batch_size = new_batch_size`` and never reads the caller's ``gdy``. (The value an
uninitialised C++ local holds is undefined; this program gives it a fixed stale value. In C++ the extra
work items spill past their workspace regions; here they are simply not covered by the graph's grid.)
Doctor: undersized-buffer, at ``DecodePlan`` (it writes ``new_batch_size`` work items into work buffers
and a captured grid sized ``padded_batch_size`` from the stale ``gdy``).
Fix (upstream): assign the out parameter (``gdy = ceil_div(...)``) instead of declaring a shadowing local.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/flashinfer-ai/flashinfer/pull/803"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "DecodePlan"
SYMPTOM = "MLA decode under CUDA graphs drops trailing KV chunks (wrong attention output)"

NUM_QO_HEADS, QO_HEADS_PER_BLOCK = 4, 2       # the real gdy = ceil_div(4, 2) = 2
HEAD_DIM_CKV, PAGE_SIZE, NUM_PAGES = 4, 2, 16
MAX_GRID_SIZE = 16                            # num_blocks_per_sm * num_sm
MAX_CHUNK_PAGES = 8                           # widest KV chunk a work item may cover
BATCH = 2
_STALE_GDY = 8                                # what the caller's uninitialised ``gdy`` happens to hold


def ceil_div(a, b):
    return (a + b - 1) // b


class PlanScratch:
    """``DecodePlan``'s locals: ``uint32_t max_grid_size, kv_chunk_size_in_pages, new_batch_size, gdy;``"""

    def __init__(self):
        self.gdy = _STALE_GDY
        self.max_grid_size = self.kv_chunk_size_in_pages = self.new_batch_size = 0
        self.split_kv = False


def PartitionPagedKVCacheBinarySearchMinNumPagePerBatch(max_grid_size, gdy, num_pages):
    for chunk in range(1, max(num_pages) + 1):
        new_batch_size = sum(ceil_div(p, chunk) for p in num_pages)
        if new_batch_size * gdy <= max_grid_size:
            return chunk, new_batch_size
    return max(num_pages), len(num_pages)


def BatchDecodeWithPagedKVCacheWorkEstimationDispatchedMLA(out: PlanScratch, variant, kv_indptr_h,
                                                           enable_cuda_graph):
    gdy = ceil_div(NUM_QO_HEADS, QO_HEADS_PER_BLOCK)
    if variant == "fix":
        out.gdy = gdy                          # gdy = ceil_div(num_qo_heads, qo_heads_per_block);
    # bug: ``const uint32_t gdy = ...`` is a new local; ``out.gdy`` keeps its uninitialised value
    out.max_grid_size = MAX_GRID_SIZE
    num_pages = [kv_indptr_h[i + 1] - kv_indptr_h[i] for i in range(len(kv_indptr_h) - 1)]
    out.kv_chunk_size_in_pages, out.new_batch_size = PartitionPagedKVCacheBinarySearchMinNumPagePerBatch(
        MAX_GRID_SIZE, gdy, num_pages)
    # when using CUDAGraph, we always use partition-kv kernel
    out.split_kv = enable_cuda_graph or out.new_batch_size != len(num_pages)


def DecodePlan(wrapper, kv_indptr_h, kv_indices_h, kv_len_h):
    """Host planning; returns the padded batch size and writes the work list into the wrapper's buffers."""
    s = PlanScratch()
    BatchDecodeWithPagedKVCacheWorkEstimationDispatchedMLA(s, wrapper.variant, kv_indptr_h, wrapper.use_cuda_graph)
    if wrapper.use_cuda_graph:
        padded_batch_size = s.max_grid_size // s.gdy if s.split_kv else len(kv_len_h)
    else:
        padded_batch_size = s.new_batch_size
    request_indices, chunk_pages, chunk_len = [], [], []
    for r in range(len(kv_len_h)):
        pages = kv_indices_h[kv_indptr_h[r]:kv_indptr_h[r + 1]]
        for c in range(0, len(pages), s.kv_chunk_size_in_pages):
            chunk = pages[c:c + s.kv_chunk_size_in_pages]
            request_indices.append(r)
            chunk_pages.append(chunk + [0] * (MAX_CHUNK_PAGES - len(chunk)))
            chunk_len.append(min(len(chunk) * PAGE_SIZE, kv_len_h[r] - c * PAGE_SIZE))
    wrapper.ensure_buffers(padded_batch_size)
    n = min(len(request_indices), padded_batch_size)   # the graph's grid covers padded_batch_size items
    t = lambda xs: torch.tensor(xs, dtype=torch.long)   # noqa: E731
    wrapper.request_indices.zero_()
    wrapper.chunk_pages.zero_()
    wrapper.chunk_len.zero_()
    wrapper.block_valid_mask.zero_()
    wrapper.request_indices[:n].copy_(t(request_indices[:n]).to(wrapper.device))
    wrapper.chunk_pages[:n].copy_(t(chunk_pages[:n]).to(wrapper.device))
    wrapper.chunk_len[:n].copy_(t(chunk_len[:n]).to(wrapper.device))
    wrapper.block_valid_mask[:n].fill_(True)
    return padded_batch_size


class BatchDecodeMlaWithPagedKVCacheWrapper:
    def __init__(self, device, variant, use_cuda_graph):
        self.device, self.variant, self.use_cuda_graph = device, variant, use_cuda_graph
        self.padded_batch_size = None
        self.q = torch.zeros(BATCH, NUM_QO_HEADS, HEAD_DIM_CKV, device=device)
        self.out = None

    def ensure_buffers(self, padded_batch_size):
        """CUDA-graph mode: the work buffers are fixed by the first plan (the captured grid)."""
        if self.use_cuda_graph and self.padded_batch_size is not None:
            return
        self.padded_batch_size = padded_batch_size
        P, d = padded_batch_size, self.device
        self.request_indices = torch.zeros(P, dtype=torch.long, device=d)
        self.chunk_pages = torch.zeros(P, MAX_CHUNK_PAGES, dtype=torch.long, device=d)
        self.chunk_len = torch.zeros(P, dtype=torch.long, device=d)
        self.block_valid_mask = torch.zeros(P, dtype=torch.bool, device=d)

    def plan(self, kv_indptr_h, kv_indices_h, kv_len_h):
        DecodePlan(self, kv_indptr_h, kv_indices_h, kv_len_h)

    def run(self, ckv_cache):
        """Split-KV decode: one partial attention per work item, merged per request."""
        slots = (self.chunk_pages[:, :, None] * PAGE_SIZE
                 + torch.arange(PAGE_SIZE, device=self.device)).flatten(1)            # [P, T]
        tok_valid = torch.arange(slots.shape[1], device=self.device)[None, :] < self.chunk_len[:, None]
        k = ckv_cache[slots]                                                          # [P, T, D]
        q = self.q[self.request_indices]                                              # [P, H, D]
        scores = torch.einsum("phd,ptd->pht", q, k) * HEAD_DIM_CKV ** -0.5
        e = torch.exp(scores) * (tok_valid & self.block_valid_mask[:, None])[:, None, :]
        num = torch.einsum("pht,ptd->phd", e, k)
        den = e.sum(-1)
        out_num = torch.zeros(BATCH, NUM_QO_HEADS, HEAD_DIM_CKV, device=self.device).index_add_(
            0, self.request_indices, num)
        out_den = torch.zeros(BATCH, NUM_QO_HEADS, device=self.device).index_add_(0, self.request_indices, den)
        return out_num / out_den[:, :, None].clamp(min=1e-20)


def run(variant: str, device: str = "cpu"):
    gen = generator(803)
    keys = randn(32, HEAD_DIM_CKV, gen=gen, device=device)
    queries = randn(8, BATCH, NUM_QO_HEADS, HEAD_DIM_CKV, gen=gen, device=device)
    pages = [[3, 5, 7, 9, 11, 13, 15], [2, 4, 6, 10]]                 # each request's KV pages

    def serve(graphed: bool):
        ckv_cache = torch.zeros(NUM_PAGES * PAGE_SIZE, HEAD_DIM_CKV, device=device)
        wrapper = BatchDecodeMlaWithPagedKVCacheWrapper(device, variant, use_cuda_graph=graphed)
        kv_len = [9, 4]
        g = out = None
        outs = []
        for step in range(4):
            kv_len = [n + 1 for n in kv_len]
            for r in range(BATCH):                                # append_paged_mla_kv_cache (eager)
                pos = kv_len[r] - 1
                slot = pages[r][pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
                ckv_cache[slot].copy_(keys[(7 * step + 3 * r + pos) % 32])
            used = [pages[r][:ceil_div(kv_len[r], PAGE_SIZE)] for r in range(BATCH)]
            indptr = [0, len(used[0]), len(used[0]) + len(used[1])]
            wrapper.plan(indptr, used[0] + used[1], kv_len)
            wrapper.q.copy_(queries[step])
            if not graphed:
                outs.append(wrapper.run(ckv_cache).clone())
                continue
            if g is None:
                g, out = capture(lambda: wrapper.run(ckv_cache), device=device,
                                 owner="BatchDecodeMlaWithPagedKVCacheWrapper (use_cuda_graph=True)",
                                 static={"q": wrapper.q, "request_indices": wrapper.request_indices,
                                         "chunk_pages": wrapper.chunk_pages, "chunk_len": wrapper.chunk_len,
                                         "block_valid_mask": wrapper.block_valid_mask},
                                 state={"ckv_cache": ckv_cache})
            outs.append(replay(g, out).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
