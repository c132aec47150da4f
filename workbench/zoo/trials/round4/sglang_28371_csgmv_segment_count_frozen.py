"""The chunked-SGMV LoRA kernels keep the capture's segment count: later adapters' deltas are dropped.

Upstream: https://github.com/sgl-project/sglang/pull/28371 ("[LoRA] Fix chunked SGMV (csgmv) CUDA graph
segment replay", commit 093908d4).
Symptom: with the default ``--lora-backend csgmv`` and decode CUDA graphs, a decode batch whose requests
use several distinct adapters gets wrong or garbled LoRA output; single-adapter batches and eager runs
are fine (sglang main, June 2026).
Mechanism: ``ChunkedSgmvLoRABackend.prepare_lora_batch`` sorts the batch's tokens into per-adapter
segments, writes their metadata into static buffers, and keeps the segment count as a Python int that
``chunked_sgmv_lora_shrink_forward`` (and the expand) pass to the Triton kernel as a scalar, next to a
grid sized from ``batch_info.bs``. Both were baked into the graph at capture, where every token carried
the dummy adapter (``lora_ids=[None] * bs``): one segment. On replay the kernel's ``pid_s >= num_segs``
exit skips every segment after the first, so each adapter sorted after the first in a batch contributes
no LoRA delta.
Doctor: host-work-frozen, at ``chunked_sgmv_lora_shrink_forward`` (the Python segment count given to
the kernel at capture).
Fix (upstream): under CUDA graph the grid and ``num_segs`` are the capture-invariant size of the static
buffer (``weight_indices.shape[0]``), and ``prepare_lora_batch`` neutralises the unused tail every step
(``weight_indices[num_segments:] = 0``, ``seg_indptr[num_segments + 1:] = total_tokens``), so the extra
segments are zero-length no-ops.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/28371"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "chunked_sgmv_lora_shrink_forward"
SYMPTOM = "multi-adapter decode batches lose the LoRA delta of every adapter after the first segment"
DIM, RANK, NUM_SLOTS, BS, SEGMENT_SIZE = 4, 2, 3, 4, 16
# adapter buffer slot 0: no adapter (rank 0, what capture's lora_ids=[None] * bs resolves to)


class LoRABatchInfo:
    def __init__(self, bs, num_segments, max_len, use_cuda_graph, seg_indptr, weight_indices, lora_ranks,
                 scalings, permutation):
        self.bs, self.num_segments, self.max_len, self.use_cuda_graph = bs, num_segments, max_len, use_cuda_graph
        self.seg_indptr, self.weight_indices, self.permutation = seg_indptr, weight_indices, permutation
        self.lora_ranks, self.scalings = lora_ranks, scalings


def _chunked_lora_shrink_kernel(pid_s, x, weights, output, seg_indptr, weight_indices, lora_ranks,
                                permutation, num_segs, BLOCK_M):
    if pid_s >= num_segs:
        return
    w_index = weight_indices[pid_s : pid_s + 1]                    # tl.load(weight_indices + pid_s)
    rank = lora_ranks.index_select(0, w_index)
    seg_start, seg_end = seg_indptr[pid_s], seg_indptr[pid_s + 1]
    s_logical = torch.arange(BLOCK_M, device=x.device) + seg_start
    row_mask = (s_logical < seg_end).to(x.dtype)[:, None]
    s_physical = permutation[s_logical.clamp(max=permutation.shape[0] - 1)]
    n_mask = (torch.arange(weights.shape[1], device=x.device) < rank).to(x.dtype)   # cur_n = rank
    partial = (x[s_physical] * row_mask) @ weights.index_select(0, w_index)[0].T * n_mask
    output.index_add_(0, s_physical, partial * row_mask)


def chunked_sgmv_lora_shrink_forward(x, weights, batch_info: LoRABatchInfo, variant: str):
    BLOCK_M = batch_info.max_len
    if variant == "fix" and batch_info.use_cuda_graph:
        num_segments = batch_info.weight_indices.shape[0]          # capture-invariant
        grid = num_segments
    else:
        num_segments = batch_info.num_segments
        grid = batch_info.bs if batch_info.use_cuda_graph else num_segments
    output = torch.zeros(x.shape[0], weights.shape[1], device=x.device, dtype=x.dtype)
    for pid_s in range(grid):
        _chunked_lora_shrink_kernel(pid_s, x, weights, output, batch_info.seg_indptr, batch_info.weight_indices,
                                    batch_info.lora_ranks, batch_info.permutation, num_segments, BLOCK_M)
    return output


def _chunked_lora_expand_kernel(pid_s, x, weights, output, seg_indptr, weight_indices, lora_ranks, scalings,
                                permutation, num_segs, BLOCK_M):
    if pid_s >= num_segs:
        return
    w_index = weight_indices[pid_s : pid_s + 1]
    rank = lora_ranks.index_select(0, w_index)
    scaling = scalings.index_select(0, w_index)
    seg_start, seg_end = seg_indptr[pid_s], seg_indptr[pid_s + 1]
    s_logical = torch.arange(BLOCK_M, device=x.device) + seg_start
    row_mask = (s_logical < seg_end).to(x.dtype)[:, None]
    s_physical = permutation[s_logical.clamp(max=permutation.shape[0] - 1)]
    k_mask = (torch.arange(x.shape[1], device=x.device) < rank).to(x.dtype)
    partial = (x[s_physical] * row_mask * k_mask) @ weights.index_select(0, w_index)[0].T * scaling
    output.index_add_(0, s_physical, partial * row_mask)


def chunked_sgmv_lora_expand_forward(x, lora_weight_b, batch_info: LoRABatchInfo, base_output, variant: str):
    BLOCK_M = batch_info.max_len
    if variant == "fix" and batch_info.use_cuda_graph:
        num_segments = batch_info.weight_indices.shape[0]
        grid = num_segments
    else:
        num_segments = batch_info.num_segments
        grid = batch_info.bs if batch_info.use_cuda_graph else num_segments
    for pid_s in range(grid):
        _chunked_lora_expand_kernel(pid_s, x, lora_weight_b, base_output, batch_info.seg_indptr,
                                    batch_info.weight_indices, batch_info.lora_ranks, batch_info.scalings,
                                    batch_info.permutation, num_segments, BLOCK_M)
    return base_output


class ChunkedSgmvLoRABackend:
    def __init__(self, variant, device):
        self.variant, self.device = variant, device
        self.segment_size = SEGMENT_SIZE
        self.batch_info = None

    def init_cuda_graph_batch_info(self, max_bs_in_cuda_graph: int):
        d = self.device
        self.cuda_graph_batch_info = LoRABatchInfo(
            bs=max_bs_in_cuda_graph, num_segments=None, max_len=self.segment_size, use_cuda_graph=True,
            seg_indptr=torch.zeros(max_bs_in_cuda_graph + 1, dtype=torch.int64, device=d),
            weight_indices=torch.zeros(max_bs_in_cuda_graph, dtype=torch.int64, device=d),
            lora_ranks=torch.zeros(NUM_SLOTS, dtype=torch.int64, device=d),
            scalings=torch.zeros(NUM_SLOTS, device=d),
            permutation=torch.zeros(max_bs_in_cuda_graph, dtype=torch.int64, device=d))

    def prepare_lora_batch(self, weight_indices: list[int], lora_ranks, scalings, use_cuda_graph: bool):
        seq_weight_indices = torch.tensor(weight_indices)
        permutation = torch.argsort(seq_weight_indices, stable=True)          # decode: one token per request
        unique, counts = torch.unique_consecutive(seq_weight_indices[permutation], return_counts=True)
        seg_w, seg_lens = [], []
        for w, n in zip(unique.tolist(), counts.tolist()):
            k = -(-n // self.segment_size)
            seg_w += [w] * k
            seg_lens += [self.segment_size] * (k - 1) + [n - (k - 1) * self.segment_size]
        num_segments = len(seg_w)
        seg_indptr = torch.zeros(num_segments + 1, dtype=torch.int64)
        seg_indptr[1:] = torch.cumsum(torch.tensor(seg_lens), 0)
        if use_cuda_graph:
            batch_info = self.cuda_graph_batch_info
            batch_info.bs = len(weight_indices)
            batch_info.num_segments = num_segments
        else:
            d = self.device
            batch_info = LoRABatchInfo(
                bs=len(weight_indices), num_segments=num_segments, max_len=1, use_cuda_graph=False,
                seg_indptr=torch.empty(num_segments + 1, dtype=torch.int64, device=d),
                weight_indices=torch.empty(num_segments, dtype=torch.int64, device=d),
                lora_ranks=torch.empty(NUM_SLOTS, dtype=torch.int64, device=d),
                scalings=torch.empty(NUM_SLOTS, device=d),
                permutation=torch.empty(len(permutation), dtype=torch.int64, device=d))
            batch_info.max_len = max(seg_lens)
        batch_info.lora_ranks[:NUM_SLOTS].copy_(torch.tensor(lora_ranks))
        batch_info.scalings[:NUM_SLOTS].copy_(torch.tensor(scalings))
        batch_info.weight_indices[:num_segments].copy_(torch.tensor(seg_w))
        batch_info.seg_indptr[: num_segments + 1].copy_(seg_indptr)
        batch_info.permutation[: len(permutation)].copy_(permutation)
        if use_cuda_graph and self.variant == "fix":
            batch_info.weight_indices[num_segments:].zero_()                     # padded segments:
            batch_info.seg_indptr[num_segments + 1:].fill_(len(weight_indices))  # zero-length no-ops
        self.batch_info = batch_info


class Model:
    """One decode projection with a LoRA adapter per request (``run_lora_a_sgemm``/``run_lora_b_sgemm``)."""

    def __init__(self, device):
        gen = generator(28371)
        self.base = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
        self.lora_a = randn(NUM_SLOTS, RANK, DIM, gen=gen, device=device)     # A_buffer, slot 0 unused
        self.lora_b = randn(NUM_SLOTS, DIM, RANK, gen=gen, device=device)
        self.lora_a[0].zero_()
        self.lora_b[0].zero_()

    def forward(self, x, backend: ChunkedSgmvLoRABackend):
        base_output = x @ self.base.T
        lora_a_output = chunked_sgmv_lora_shrink_forward(x, self.lora_a, backend.batch_info, backend.variant)
        out = chunked_sgmv_lora_expand_forward(lora_a_output, self.lora_b, backend.batch_info, base_output,
                                               backend.variant)
        return torch.tanh(out)


LORA_RANKS, SCALINGS = [0, RANK, RANK], [0.0, 0.5, 0.8]


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    gen = generator(1)
    # per decode step: the adapter slot of each request. Step 1: one adapter (one segment, as at
    # capture); step 2: two adapters; step 3: no-adapter request first, then two adapters.
    steps = [([1, 1, 1, 1], randn(BS, DIM, gen=gen, device=device)),
             ([1, 2, 1, 2], randn(BS, DIM, gen=gen, device=device)),
             ([2, 0, 1, 1], randn(BS, DIM, gen=gen, device=device))]

    def eager():
        backend = ChunkedSgmvLoRABackend(variant, device)
        outs = []
        for adapters, x in steps:
            backend.prepare_lora_batch(adapters, LORA_RANKS, SCALINGS, use_cuda_graph=False)
            outs.append(model.forward(x, backend))
        return outs

    def served():
        backend = ChunkedSgmvLoRABackend(variant, device)
        backend.init_cuda_graph_batch_info(BS)
        x_buf = torch.zeros(BS, DIM, device=device)
        # capture_one_batch_size: dummy lora_ids = [None] * bs, prepared before the warmups
        backend.prepare_lora_batch([0] * BS, LORA_RANKS, SCALINGS, use_cuda_graph=True)
        bi = backend.cuda_graph_batch_info
        g, out = capture(lambda: model.forward(x_buf, backend), device=device, warmups=2,
                         static={"hidden_states": x_buf, "seg_indptr": bi.seg_indptr,
                                 "weight_indices": bi.weight_indices, "permutation": bi.permutation,
                                 "lora_ranks": bi.lora_ranks, "scalings": bi.scalings},
                         owner="CudaGraphRunner")
        outs = []
        for adapters, x in steps:
            backend.prepare_lora_batch(adapters, LORA_RANKS, SCALINGS, use_cuda_graph=True)
            x_buf.copy_(x)
            outs.append(replay(g, out).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
