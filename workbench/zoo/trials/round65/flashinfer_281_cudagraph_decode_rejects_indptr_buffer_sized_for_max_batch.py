"""CUDA-graph decode rejects persistent indptr/last_page_len buffers sized for the maximum batch.

Upstream: https://github.com/flashinfer-ai/flashinfer/pull/281 ("bugfix: fix cudagraph-compatible prefill/decode
apis", commit 1092e7e9a, June 2024): "The ``indptr`` array length should be a upper-bound of ``batch_size + 1``
in cuda graph mode."
Symptom: decode (and prefill) in CUDA-graph mode with the persistent buffers allocated for the maximum batch,
as the wrapper's docstring asks (``[max_batch_size + 1]``), fails on the first forward with a RuntimeError from
the kernel wrapper's shape check (``CHECK_EQ(paged_kv_indptr.size(0), batch_size + 1)`` failed); only buffers
exactly one batch long worked, i.e. a fresh buffer set (new addresses) per captured batch size.
Mechanism: ``CUDAGraphBatchDecodeWithPagedKVCacheWrapper(workspace, indptr_buffer, indices_buffer,
last_page_len_buffer)`` keeps user-owned persistent device buffers and passes ``max_batch_size =
len(paged_kv_last_page_len_buffer)`` to the C++ ``BatchDecodeWithPagedKVCachePyTorchWrapper``. Before each
warmup/capture/replay, ``begin_forward`` (host, never captured) copies the step's ``indptr``/``indices``/
``last_page_len`` into a prefix of those buffers; ``forward`` (the captured call) hands the whole buffers to
``Forward``, which takes ``batch_size = q.size(0)`` (this graph's batch) and asserted
``paged_kv_indptr.size(0) == batch_size + 1`` and ``paged_kv_last_page_len.size(0) == batch_size`` -- the
non-graph contract, where the tensors are the step's own. In graph mode the buffers are sized for the largest
batch every graph shares, so any graph captured for a smaller batch (here 4 and 2 against buffers for 8) fails
the check at its first (warmup) forward; the eager wrapper, holding exact-size tensors, passes.
Doctor: padded-shape-mismatch, at ``Forward`` (the kernel wrapper run at a graph's batch combines q sized for
that batch with persistent metadata buffers sized for the maximum batch, and its equality check rejects them).
Fix (upstream): every ``CHECK_EQ(x.size(0), batch_size(+1))`` on ``paged_kv_indptr``/``paged_kv_last_page_len``
(and ``qo_indptr``/``kv_indptr``/``qk_indptr`` in the prefill wrappers) becomes ``CHECK_GE``; the test allocates
``batch_size + 11`` / ``total_num_pages + 10`` / ``batch_size + 10`` ("allocate more space than needed").
(One decode layer, NHD paged KV cache; each batch size gets its own graph and cudagraph wrapper, all sharing one
set of persistent buffers sized for ``MAX_BATCH_SIZE``; no padded rows.)
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/flashinfer-ai/flashinfer/pull/281"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "Forward"
SYMPTOM = "cudagraph decode with indptr buffers sized for max batch raises CHECK_EQ(indptr.size(0), batch_size + 1)"

VOCAB, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE, MAX_PAGES_PER_SEQ = 16, 2, 4, 2, 4
NUM_SEQS = 4
NUM_PAGES = NUM_SEQS * MAX_PAGES_PER_SEQ
MAX_BATCH_SIZE = 8                       # the persistent buffers' capacity (the largest batch to capture)
PROMPT_LENS = (3, 1, 4, 2)
STEPS = ((0, 1, 2, 3), (0, 1, 2, 3), (0, 2), (0, 1, 2, 3), (1, 3))   # sequences decoded at each step


def _check(ok: bool, what: str, a: int, b: int) -> None:
    """FlashInfer's ``CHECK_EQ``/``CHECK_GE`` (``TORCH_CHECK`` with both values)."""
    if not ok:
        raise RuntimeError(f"Check failed: {what} ({a} vs {b})")


class BatchDecodeWithPagedKVCachePyTorchWrapper:
    """The C++ ``_kernels`` wrapper (python/csrc/batch_decode.cu) with its handler."""

    def __init__(self, kv_layout, workspace_size_in_bytes, max_batch_size, enable_cuda_graph, variant):
        self.kv_layout_, self.max_batch_size_ = kv_layout, max_batch_size
        self.enable_cuda_graph_, self.variant = enable_cuda_graph, variant

    def begin_forward(self, workspace_buffer, indptr, last_page_len, batch_size, num_qo_heads, page_size):
        """Handler plan (host): in cudagraph mode the batch may not exceed the buffers' ``max_batch_size``."""
        if self.enable_cuda_graph_ and batch_size > self.max_batch_size_:
            raise RuntimeError(f"batch_size {batch_size} exceeds max_batch_size {self.max_batch_size_}")

    def Forward(self, q, paged_kv_data, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len):  # noqa: N802
        batch_size = q.size(0)
        if self.variant == "bug":
            _check(paged_kv_indptr.size(0) == batch_size + 1, "paged_kv_indptr.size(0) == batch_size + 1",
                   paged_kv_indptr.size(0), batch_size + 1)
            _check(paged_kv_last_page_len.size(0) == batch_size, "paged_kv_last_page_len.size(0) == batch_size",
                   paged_kv_last_page_len.size(0), batch_size)
        else:   # the fix: the buffers are an upper bound in cuda graph mode
            _check(paged_kv_indptr.size(0) >= batch_size + 1, "paged_kv_indptr.size(0) >= batch_size + 1",
                   paged_kv_indptr.size(0), batch_size + 1)
            _check(paged_kv_last_page_len.size(0) >= batch_size, "paged_kv_last_page_len.size(0) >= batch_size",
                   paged_kv_last_page_len.size(0), batch_size)
        return batch_decode_kernel(q, paged_kv_data, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)


def batch_decode_kernel(q, paged_kv_data, indptr, indices, last_page_len):
    """Request ``b`` attends over pages ``indices[indptr[b]:indptr[b + 1]]`` (full but the last, which holds
    ``last_page_len[b]`` tokens); ``paged_kv_data`` is NHD: ``[pages, 2, PAGE_SIZE, heads, HEAD_DIM]``."""
    batch = q.shape[0]
    j = torch.arange(MAX_PAGES_PER_SEQ, device=q.device)
    t = torch.arange(PAGE_SIZE, device=q.device)
    start, num_pages = indptr[:batch].long(), (indptr[1:batch + 1] - indptr[:batch]).long()
    pages = indices[(start[:, None] + j[None, :]).clamp(max=indices.shape[0] - 1)].long().clamp(0, NUM_PAGES - 1)
    valid = (j[None, :, None] < num_pages[:, None, None]) & (
        (j[None, :, None] < num_pages[:, None, None] - 1) | (t[None, None, :] < last_page_len[:batch].long()[:, None, None]))
    kv = paged_kv_data[pages]                                  # [batch, pages, 2, PAGE_SIZE, heads, dim]
    k, v = kv[:, :, 0], kv[:, :, 1]
    scores = (k * q[:, None, None]).sum(-1) / HEAD_DIM ** 0.5     # [batch, pages, PAGE_SIZE, heads]
    scores = scores.masked_fill(~valid[..., None], -1e9).reshape(batch, -1, NUM_KV_HEADS)
    w = torch.softmax(scores, 1).reshape(batch, MAX_PAGES_PER_SEQ, PAGE_SIZE, NUM_KV_HEADS, 1)
    return (w * v).sum((1, 2))                                   # [batch, heads, dim]


class BatchDecodeWithPagedKVCacheWrapper:
    """python/flashinfer/decode.py: in cudagraph mode ``begin_forward`` fills a prefix of the user's buffers."""

    def __init__(self, workspace_buffer, kv_layout="NHD", enable_cuda_graph=False, paged_kv_indptr_buffer=None,
                 paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None, *, variant="bug"):
        self._workspace_buffer = workspace_buffer
        # NOTE(Zihao): max_batch_size will only be used in cudagraph mode
        max_batch_size = len(paged_kv_last_page_len_buffer) if enable_cuda_graph else 0
        self._wrapper = BatchDecodeWithPagedKVCachePyTorchWrapper(
            kv_layout, workspace_buffer.numel() * workspace_buffer.element_size(), max_batch_size,
            enable_cuda_graph, variant)
        self.is_cuda_graph_enabled = enable_cuda_graph
        self._paged_kv_indptr_buf = paged_kv_indptr_buffer
        self._paged_kv_indices_buf = paged_kv_indices_buffer
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buffer

    def begin_forward(self, indptr, indices, last_page_len, num_qo_heads, page_size):
        if self.is_cuda_graph_enabled:
            self._paged_kv_indptr_buf[: len(indptr)] = indptr
            self._paged_kv_indices_buf[: len(indices)] = indices
            self._paged_kv_last_page_len_buf[: len(last_page_len)] = last_page_len
        else:
            self._paged_kv_indptr_buf = indptr
            self._paged_kv_indices_buf = indices
            self._paged_kv_last_page_len_buf = last_page_len
        self._wrapper.begin_forward(self._workspace_buffer, indptr, last_page_len, len(indptr) - 1,
                                    num_qo_heads, page_size)

    def forward(self, q, paged_kv_data):
        return self._wrapper.Forward(q, paged_kv_data, self._paged_kv_indptr_buf, self._paged_kv_indices_buf,
                                     self._paged_kv_last_page_len_buf)


class CUDAGraphBatchDecodeWithPagedKVCacheWrapper(BatchDecodeWithPagedKVCacheWrapper):
    def __init__(self, workspace_buffer, indptr_buffer, indices_buffer, last_page_len_buffer, kv_layout="NHD",
                 *, variant="bug"):
        super().__init__(workspace_buffer, kv_layout, True, indptr_buffer, indices_buffer, last_page_len_buffer,
                         variant=variant)


class DecodeModel:
    """Embedding, append this token's k/v to its page slot, paged decode attention, output projection."""

    def __init__(self, device):
        gen = generator(281)
        self.emb = randn(VOCAB, NUM_KV_HEADS * HEAD_DIM, gen=gen, device=device)
        self.wq, self.wk, self.wv, self.wo = (randn(NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, gen=gen,
                                                    device=device, scale=0.5) for _ in range(4))

    def forward(self, input_ids, slot_mapping, paged_kv_data, wrapper):
        h = self.emb[input_ids]
        page, off = slot_mapping // PAGE_SIZE, slot_mapping % PAGE_SIZE
        paged_kv_data[page, 0, off] = (h @ self.wk).view(-1, NUM_KV_HEADS, HEAD_DIM)
        paged_kv_data[page, 1, off] = (h @ self.wv).view(-1, NUM_KV_HEADS, HEAD_DIM)
        q = (h @ self.wq).view(-1, NUM_KV_HEADS, HEAD_DIM)
        return wrapper.forward(q, paged_kv_data).reshape(len(input_ids), -1) @ self.wo


def paged_layout(seqs, kv_lens):
    """Host metadata of one decode step: each sequence owns pages ``[s * MAX_PAGES_PER_SEQ, ...)``."""
    indptr, indices, last, slots = [0], [], [], []
    for s in seqs:
        n = (kv_lens[s] + PAGE_SIZE - 1) // PAGE_SIZE
        indices += [s * MAX_PAGES_PER_SEQ + p for p in range(n)]
        indptr.append(len(indices))
        last.append((kv_lens[s] - 1) % PAGE_SIZE + 1)
        pos = kv_lens[s] - 1
        slots.append((s * MAX_PAGES_PER_SEQ + pos // PAGE_SIZE) * PAGE_SIZE + pos % PAGE_SIZE)
    as_int = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    return as_int(indptr), as_int(indices), as_int(last), torch.tensor(slots)


def run(variant: str, device: str = "cpu"):
    model = DecodeModel(device)
    gen = generator(2810)
    prompt_kv = randn(NUM_PAGES, 2, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, gen=gen, device=device)
    tokens = torch.randint(0, VOCAB, (len(STEPS), NUM_SEQS), generator=gen)
    workspace = torch.empty(64, dtype=torch.uint8, device=device)

    def serve(graphed: bool):
        paged_kv_data = prompt_kv.clone()
        kv_lens = list(PROMPT_LENS)
        # persistent buffers, allocated once for the largest batch and shared by every captured graph
        indptr_buffer = torch.zeros(MAX_BATCH_SIZE + 1, dtype=torch.int32, device=device)
        indices_buffer = torch.zeros(NUM_PAGES, dtype=torch.int32, device=device)
        last_page_len_buffer = torch.zeros(MAX_BATCH_SIZE, dtype=torch.int32, device=device)
        input_ids_buffer = torch.zeros(MAX_BATCH_SIZE, dtype=torch.long, device=device)
        slot_mapping_buffer = torch.zeros(MAX_BATCH_SIZE, dtype=torch.long, device=device)
        eager_wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", variant=variant)
        graphs, outs = {}, []
        for step, seqs in enumerate(STEPS):
            for s in seqs:
                kv_lens[s] += 1
            indptr, indices, last, slots = paged_layout(seqs, kv_lens)
            ids = tokens[step, list(seqs)]
            bs = len(seqs)
            if not graphed:
                eager_wrapper.begin_forward(indptr.to(device), indices.to(device), last.to(device),
                                            NUM_KV_HEADS, PAGE_SIZE)
                outs.append(model.forward(ids.to(device), slots.to(device), paged_kv_data, eager_wrapper))
                continue
            if bs not in graphs:
                wrapper = CUDAGraphBatchDecodeWithPagedKVCacheWrapper(
                    workspace, indptr_buffer, indices_buffer, last_page_len_buffer, "NHD", variant=variant)
                wrapper.begin_forward(indptr.to(device), indices.to(device), last.to(device), NUM_KV_HEADS, PAGE_SIZE)
                ids_buf, slot_buf = input_ids_buffer[:bs], slot_mapping_buffer[:bs]
                ids_buf.copy_(ids.to(device))
                slot_buf.copy_(slots.to(device))
                graphs[bs] = (wrapper, capture(
                    lambda w=wrapper, i=ids_buf, sl=slot_buf: model.forward(i, sl, paged_kv_data, w),
                    device=device, name=f"decode batch {bs}", owner="CUDAGraphBatchDecodeWithPagedKVCacheWrapper",
                    static={"input_ids": input_ids_buffer, "slot_mapping": slot_mapping_buffer,
                            "paged_kv_indptr_buffer": indptr_buffer, "paged_kv_indices_buffer": indices_buffer,
                            "paged_kv_last_page_len_buffer": last_page_len_buffer},
                    state={"paged_kv_data": paged_kv_data}))
                # the warmup already appended this step's k/v; capturing does not run it again
            wrapper, (g, out) = graphs[bs]
            wrapper.begin_forward(indptr.to(device), indices.to(device), last.to(device), NUM_KV_HEADS, PAGE_SIZE)
            input_ids_buffer[:bs].copy_(ids.to(device))
            slot_mapping_buffer[:bs].copy_(slots.to(device))
            outs.append(replay(g, out).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
