"""FlashInfer decode capture with pipeline parallelism: virtual engine 1 gets buffers cut to the smallest batch.

Upstream: https://github.com/vllm-project/vllm/pull/6708 ("[Bugfix] fix flashinfer cudagraph capture for PP",
commit 5e8ca973e, merged July 2024).
Symptom: with ``--pipeline-parallel-size`` > 1 and the FlashInfer backend, CUDA graph capture failed at server
start: "the flashinfer wrapper asserts that the batch_size in ``begin_forward()`` matches the buffer size it
was initialized with" (PR description).
Mechanism: ``GPUModelRunnerBase.capture_model`` allocates the FlashInfer metadata buffers (``indptr_buffer``,
``last_page_len_buffer``) once for the largest batch and loops ``for virtual_engine in
range(pipeline_parallel_size): for batch_size in reversed(batch_size_capture_list)``. For each graph it did
``indptr_buffer = indptr_buffer[:batch_size + 1]`` and ``last_page_len_buffer =
last_page_len_buffer[:batch_size]``, rebinding the loop's own variables to ever smaller slices. Within one
virtual engine the sizes descend, so each slice still fits; virtual engine 1 starts again at the largest
batch size with buffers already cut to the smallest size (``[:batch_size + 1]`` of a shorter tensor silently
stays short). The ``CUDAGraphBatchDecodeWithPagedKVCacheWrapper`` built on them fixes its batch size from the
buffer (``_fixed_batch_size``), so ``attn_metadata.begin_forward()`` for the largest batch -- which copies the
batch's ``indptr``/``last_page_len`` into those static buffers -- raises ``ValueError``: the batch does not fit
the graph's static metadata buffers.
Doctor: undersized-buffer, at ``begin_forward`` (the batch's paged-KV metadata meets a static buffer sized for
the smallest batch; the shrinking itself is done by ``capture_model``'s rebinding).
Fix (upstream): slice into loop-local ``_indptr_buffer`` / ``_last_page_len_buffer`` and give those to the
wrapper and to the graph runner (``flashinfer_indptr_buffer`` / ``flashinfer_last_page_len_buffer``), leaving
the full buffers intact for the next virtual engine.
The wrapper's checks are modelled on FlashInfer's CUDA-graph decode wrapper as read in later FlashInfer
sources (``_fixed_batch_size = len(paged_kv_last_page_len_buffer)``; ``begin_forward``/``plan`` raises
"The batch size should be fixed in cudagraph mode ..."), not on the exact 0.0.9 release vLLM used then.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/6708"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "begin_forward"
SYMPTOM = "CUDA graph capture with PP > 1 and FlashInfer fails: ValueError batch size mismatches the wrapper's buffers"

VOCAB, DIM, BLOCK_SIZE, NUM_GPU_BLOCKS = 16, 4, 2, 6
_BATCH_SIZES_TO_CAPTURE = [1, 2, 4]
PIPELINE_PARALLEL_SIZE = 2                 # virtual engines on this rank
_NUM_WARMUP_ITERS = 2
_PAD_SLOT_ID = -1
FLASHINFER_WORKSPACE_BUFFER_SIZE = 64


def paged_decode_attention(q, kv_cache, indptr, indices, last_page_len):
    """FlashInfer batch decode: request ``b`` attends over pages ``indices[indptr[b]:indptr[b + 1]]``, all
    full but the last, which holds ``last_page_len[b]`` tokens (keys = values)."""
    batch = q.shape[0]
    j = torch.arange(NUM_GPU_BLOCKS, device=q.device)
    t = torch.arange(BLOCK_SIZE, device=q.device)
    start, num_pages = indptr[:batch].long(), (indptr[1:batch + 1] - indptr[:batch]).long()
    page_idx = (start[:, None] + j[None, :]).clamp(max=indices.shape[0] - 1)
    pages = indices[page_idx].long().clamp(0, NUM_GPU_BLOCKS - 1)
    valid = (j[None, :, None] < num_pages[:, None, None]) & (
        (j[None, :, None] < num_pages[:, None, None] - 1) | (t[None, None, :] < last_page_len.long()[:, None, None]))
    k = kv_cache[pages]                                            # [batch, pages, BLOCK_SIZE, DIM]
    scores = (k * q[:, None, None, :]).sum(-1).masked_fill(~valid, -1e9).reshape(batch, -1)
    weights = torch.softmax(scores, -1).reshape(batch, NUM_GPU_BLOCKS, BLOCK_SIZE, 1)
    return (weights * k).sum((1, 2))


class CUDAGraphBatchDecodeWithPagedKVCacheWrapper:
    """FlashInfer's decode wrapper in CUDA-graph mode: the kernel reads fixed buffers, filled by ``begin_forward``."""

    def __init__(self, workspace_buffer, indptr_buffer, indices_buffer, last_page_len_buffer, kv_layout="NHD"):
        self._workspace_buffer = workspace_buffer
        self._fixed_batch_size = len(last_page_len_buffer)
        if len(indptr_buffer) != self._fixed_batch_size + 1:
            raise ValueError("The size of paged_kv_indptr_buffer should be batch_size + 1")
        self._paged_kv_indptr_buf = indptr_buffer
        self._paged_kv_indices_buf = indices_buffer
        self._paged_kv_last_page_len_buf = last_page_len_buffer

    def end_forward(self):
        pass

    def begin_forward(self, indptr, indices, last_page_len):
        batch_size = len(last_page_len)
        if batch_size != self._fixed_batch_size:
            raise ValueError(
                f"The batch size should be fixed in cudagraph mode, the runtime batch size {batch_size} "
                f" mismatches the batch size set during initialization {self._fixed_batch_size}")
        if len(indices) > len(self._paged_kv_indices_buf):
            raise ValueError("The size of indices should be less than or equal to the allocated buffer")
        self._paged_kv_indptr_buf.copy_(indptr)
        self._paged_kv_indices_buf[:len(indices)].copy_(indices)
        self._paged_kv_last_page_len_buf.copy_(last_page_len)

    def forward(self, q, kv_cache):
        return paged_decode_attention(q, kv_cache, self._paged_kv_indptr_buf, self._paged_kv_indices_buf,
                                      self._paged_kv_last_page_len_buf)


class BatchDecodeWithPagedKVCacheWrapper:
    """The eager decode wrapper: ``begin_forward`` keeps this batch's own (device) tensors."""

    def __init__(self, workspace_buffer, kv_layout="NHD"):
        self._workspace_buffer = workspace_buffer

    def end_forward(self):
        pass

    def begin_forward(self, indptr, indices, last_page_len):
        self._indptr, self._indices, self._last_page_len = indptr, indices, last_page_len

    def forward(self, q, kv_cache):
        return paged_decode_attention(q, kv_cache, self._indptr, self._indices, self._last_page_len)


class FlashInferMetadata:
    def __init__(self, *, slot_mapping, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, device,
                 use_cuda_graph, decode_wrapper=None):
        self.slot_mapping = slot_mapping
        self.paged_kv_indptr, self.paged_kv_indices = paged_kv_indptr, paged_kv_indices
        self.paged_kv_last_page_len = paged_kv_last_page_len
        self.device, self.use_cuda_graph, self.decode_wrapper = device, use_cuda_graph, decode_wrapper

    def begin_forward(self):
        """Decode-only: hand the batch's paged-KV layout to the decode wrapper."""
        if not self.use_cuda_graph:
            self.paged_kv_indices = self.paged_kv_indices.to(self.device)
            self.paged_kv_indptr = self.paged_kv_indptr.to(self.device)
            self.paged_kv_last_page_len = self.paged_kv_last_page_len.to(self.device)
        assert self.decode_wrapper is not None
        self.decode_wrapper.end_forward()
        self.decode_wrapper.begin_forward(self.paged_kv_indptr, self.paged_kv_indices, self.paged_kv_last_page_len)


def reshape_and_cache_flash(key, kv_cache, slot_mapping):
    """Write each token's key at its slot; ``_PAD_SLOT_ID`` entries are skipped."""
    flat = kv_cache.view(-1, DIM)
    valid = slot_mapping >= 0
    slots = slot_mapping.clamp(min=0)
    flat[slots] = torch.where(valid[:, None], key, flat[slots])


class Model:
    """One pipeline stage: embedding, one decode attention layer, output projection."""

    def __init__(self, device):
        gen = generator(6708)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.wk = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.wo = randn(DIM, DIM, gen=gen, device=device, scale=0.7)

    def forward(self, input_ids, kv_cache, attn_metadata):
        h = self.emb[input_ids]
        reshape_and_cache_flash(h @ self.wk, kv_cache, attn_metadata.slot_mapping)
        return attn_metadata.decode_wrapper.forward(h @ self.wq, kv_cache) @ self.wo


class CUDAGraphRunner:
    def __init__(self, model):
        self.model = model
        self.flashinfer_indptr_buffer = self.flashinfer_indices_buffer = None
        self.flashinfer_last_page_len_buffer = self.flashinfer_decode_wrapper = None

    def capture(self, input_ids, kv_cache, attn_metadata, device):
        self.input_buffers = {"input_ids": input_ids, "slot_mapping": attn_metadata.slot_mapping}
        self._graph, self.output = capture(
            lambda: self.model.forward(input_ids, kv_cache, attn_metadata),
            device=device, warmups=_NUM_WARMUP_ITERS, name=f"decode batch {input_ids.shape[0]}",
            owner="CUDAGraphRunner (FlashInfer decode)",
            static={"input_ids": input_ids, "slot_mapping": attn_metadata.slot_mapping,
                    "paged_kv_indptr": self.flashinfer_indptr_buffer,
                    "paged_kv_indices": self.flashinfer_indices_buffer,
                    "paged_kv_last_page_len": self.flashinfer_last_page_len_buffer},
            state={"kv_cache": kv_cache})

    def forward(self, input_ids, slot_mapping):
        self.input_buffers["input_ids"].copy_(input_ids)
        self.input_buffers["slot_mapping"].copy_(slot_mapping)
        return replay(self._graph, self.output)


class GPUModelRunnerBase:
    def __init__(self, model, device, variant, graphed):
        self.model, self.device, self.variant, self.graphed = model, device, variant, graphed
        gen = generator(67080)
        # one KV cache per virtual engine, holding the prompts' keys (prefill already done)
        self.kv_caches = [randn(NUM_GPU_BLOCKS, BLOCK_SIZE, DIM, gen=gen, device=device)
                          for _ in range(PIPELINE_PARALLEL_SIZE)]
        self.graph_runners = [{} for _ in range(PIPELINE_PARALLEL_SIZE)]
        self.flashinfer_decode_wrapper = BatchDecodeWithPagedKVCacheWrapper(
            torch.empty(FLASHINFER_WORKSPACE_BUFFER_SIZE, dtype=torch.uint8, device=device))
        if graphed:
            self.capture_model()

    def capture_model(self):
        device = self.device
        max_batch_size = max(_BATCH_SIZES_TO_CAPTURE)
        input_tokens = torch.zeros(max_batch_size, dtype=torch.long, device=device)
        slot_mapping = torch.full((max_batch_size,), _PAD_SLOT_ID, dtype=torch.long, device=device)
        batch_size_capture_list = list(_BATCH_SIZES_TO_CAPTURE)

        # For flashinfer, different batch sizes will share the same workspace buffer.
        decode_workspace_buffer = torch.empty(FLASHINFER_WORKSPACE_BUFFER_SIZE, dtype=torch.uint8, device=device)
        indices_buffer = torch.empty(max_batch_size * NUM_GPU_BLOCKS, dtype=torch.int32, device=device)
        indptr_buffer = torch.empty(max_batch_size + 1, dtype=torch.int32, device=device)
        last_page_len_buffer = torch.empty(max_batch_size, dtype=torch.int32, device=device)

        for virtual_engine in range(PIPELINE_PARALLEL_SIZE):
            for batch_size in reversed(batch_size_capture_list):
                if self.variant == "bug":
                    indptr_buffer = indptr_buffer[:batch_size + 1]
                    last_page_len_buffer = last_page_len_buffer[:batch_size]
                    _indptr_buffer, _last_page_len_buffer = indptr_buffer, last_page_len_buffer
                else:
                    _indptr_buffer = indptr_buffer[:batch_size + 1]
                    _last_page_len_buffer = last_page_len_buffer[:batch_size]
                decode_wrapper = CUDAGraphBatchDecodeWithPagedKVCacheWrapper(
                    decode_workspace_buffer, _indptr_buffer, indices_buffer, _last_page_len_buffer, "NHD")
                attn_metadata = FlashInferMetadata(
                    slot_mapping=slot_mapping[:batch_size],
                    paged_kv_indptr=torch.arange(0, batch_size + 1, dtype=torch.int32),
                    paged_kv_indices=torch.arange(0, batch_size, dtype=torch.int32),
                    paged_kv_last_page_len=torch.full((batch_size,), BLOCK_SIZE, dtype=torch.int32),
                    device=device, use_cuda_graph=True, decode_wrapper=decode_wrapper)
                attn_metadata.begin_forward()

                graph_runner = CUDAGraphRunner(self.model)
                graph_runner.flashinfer_indptr_buffer = _indptr_buffer
                graph_runner.flashinfer_indices_buffer = indices_buffer
                graph_runner.flashinfer_last_page_len_buffer = _last_page_len_buffer
                graph_runner.flashinfer_decode_workspace_buffer = decode_workspace_buffer
                graph_runner.flashinfer_decode_wrapper = decode_wrapper
                graph_runner.capture(input_tokens[:batch_size], self.kv_caches[virtual_engine], attn_metadata, device)
                self.graph_runners[virtual_engine][batch_size] = graph_runner

    def execute_model(self, virtual_engine, requests):
        """``requests``: (token id, position, the request's page ids), one decode token each."""
        batch_size = len(requests)
        indptr, indices, last_page_len, slots = [0], [], [], []
        for _, pos, pages in requests:
            num_pages = pos // BLOCK_SIZE + 1
            indices += pages[:num_pages]
            indptr.append(indptr[-1] + num_pages)
            last_page_len.append(pos % BLOCK_SIZE + 1)
            slots.append(pages[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        input_tokens = torch.tensor([tok for tok, _, _ in requests], dtype=torch.long).to(self.device)
        slot_mapping = torch.tensor(slots, dtype=torch.long).to(self.device)
        use_cuda_graph = self.graphed and batch_size in self.graph_runners[virtual_engine]
        attn_metadata = FlashInferMetadata(
            slot_mapping=slot_mapping, paged_kv_indptr=torch.tensor(indptr, dtype=torch.int32),
            paged_kv_indices=torch.tensor(indices, dtype=torch.int32),
            paged_kv_last_page_len=torch.tensor(last_page_len, dtype=torch.int32),
            device=self.device, use_cuda_graph=use_cuda_graph)
        if use_cuda_graph:
            graph_runner = self.graph_runners[virtual_engine][batch_size]
            attn_metadata.decode_wrapper = graph_runner.flashinfer_decode_wrapper
            attn_metadata.begin_forward()
            return graph_runner.forward(input_tokens, slot_mapping).clone()
        attn_metadata.decode_wrapper = self.flashinfer_decode_wrapper
        attn_metadata.begin_forward()
        return self.model.forward(input_tokens, self.kv_caches[virtual_engine], attn_metadata).clone()


def run(variant: str, device: str = "cpu"):
    model = Model(device)

    def serve(graphed: bool):
        runner = GPUModelRunnerBase(model, device, variant, graphed)
        outs = []
        # virtual engine 0 and 1 interleave their micro-batches; each has its own requests and KV cache
        outs.append(runner.execute_model(0, [(3, 2, [0, 1]), (5, 1, [2]), (7, 3, [3, 4]), (9, 0, [5])]))
        outs.append(runner.execute_model(1, [(2, 1, [4]), (8, 2, [0, 3]), (11, 0, [1]), (6, 3, [2, 5])]))
        outs.append(runner.execute_model(0, [(12, 3, [0, 1]), (4, 2, [2, 3])]))
        outs.append(runner.execute_model(1, [(1, 2, [4, 1]), (13, 4, [0, 3, 5])]))
        outs.append(runner.execute_model(1, [(10, 3, [4, 1])]))
        outs.append(runner.execute_model(0, [(14, 4, [0, 1, 5])]))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
