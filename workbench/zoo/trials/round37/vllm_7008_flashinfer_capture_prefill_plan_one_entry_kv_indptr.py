"""At CUDA-graph capture the FlashInfer prefill wrapper is planned with a one-entry ``paged_kv_indptr``.

Upstream: https://github.com/vllm-project/vllm/pull/7008 ("[Kernel] Fix input for flashinfer prefill wrapper."),
fixing https://github.com/flashinfer-ai/flashinfer/issues/362.
Symptom: with the FlashInfer backend and CUDA graphs (V0 engine, July 2024), start-up failed while capturing
graphs with ``RuntimeError: Out of workspace memory in AlignedAllocator`` although plenty of GPU memory was free.
Mechanism (as the FlashInfer maintainer diagnosed it in the issue): when vLLM builds the dummy attention metadata
for graph capture, ``FlashInferMetadata.begin_forward`` hands the prefill wrapper's ``begin_forward`` (its plan)
``paged_kv_indptr = torch.tensor([0])``: one entry, while ``qo_indptr`` (``query_start_loc``) has
``batch_size + 1``. The planner walks ``batch_size`` requests and reads ``paged_kv_indptr[i + 1]`` past the one
entry it was given, i.e. whatever memory follows it; the KV lengths it derives are garbage, and so is the
workspace it asks for, which exceeds the workspace buffer. Eager steps build real metadata and never hit this.
Here the indptr handed to the plan is a one-entry view of the backend's persistent indptr buffer, whose
following entries no step has written (they hold ``UNINITIALIZED``, a stand-in for what fresh device memory
holds), so the plan's read past the one entry sees garbage, deterministically.
Doctor: undersized-buffer, at ``begin_forward`` (the capture-time plan is given a one-entry ``paged_kv_indptr``
for a batch of ``batch_size`` requests).
Fix (upstream): pass inputs sized for the batch, ``paged_kv_indptr`` of ``batch_size + 1`` zeros (and
``query_start_loc``), for the capture-time prefill plan.
(Only the PR description, the linked issue and one review-thread hunk of ``begin_forward`` were read, not the
full diff; the planner and its workspace check are modelled after FlashInfer's ``AlignedAllocator``.)
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/7008"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "begin_forward"
SYMPTOM = "graph capture fails: 'Out of workspace memory in AlignedAllocator' from the prefill plan"

DIM, BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS = 4, 2, 16, 4
BATCH = 4                                  # the one decode capture size
WORKSPACE_TOKENS = NUM_BLOCKS * BLOCK_SIZE * 4
UNINITIALIZED = 1 << 20                    # what never-written device memory holds, for this emulation


class BatchPrefillWithPagedKVCacheWrapper:
    """The plan sizes its workspace from the per-request KV lengths in ``paged_kv_indptr``."""

    def __init__(self, workspace_tokens):
        self.workspace_tokens = workspace_tokens

    def begin_forward(self, qo_indptr, paged_kv_indptr):
        batch_size = qo_indptr.numel() - 1
        # The kernel reads the indptr through its pointer: batch_size + 1 entries from where it starts.
        storage = paged_kv_indptr.untyped_storage()
        flat = torch.empty(0, dtype=paged_kv_indptr.dtype, device=paged_kv_indptr.device).set_(storage)
        start = paged_kv_indptr.storage_offset()
        indptr = flat[start:start + batch_size + 1].tolist()
        needed = sum(max(indptr[i + 1] - indptr[i], 0) for i in range(batch_size)) * BLOCK_SIZE
        if needed > self.workspace_tokens:
            raise RuntimeError("Out of workspace memory in AlignedAllocator")
        self.planned = (batch_size, needed)


def decode_attention(query, kv_cache, block_table, seq_lens, ctx_pos):
    slots = block_table[:, ctx_pos // BLOCK_SIZE] * BLOCK_SIZE + ctx_pos % BLOCK_SIZE
    k = kv_cache[slots]
    scores = (k @ query[:, :, None]).squeeze(-1).masked_fill(ctx_pos[None, :] >= seq_lens[:, None], -1e9)
    return (torch.softmax(scores, -1)[:, :, None] * k).sum(1)


class FlashInferBackend:
    def __init__(self, device, variant):
        self.device, self.variant = device, variant
        # persistent indptr buffer of the backend: entries no step wrote hold garbage
        self.paged_kv_indptr_buf = torch.full((2 * BATCH + 1,), UNINITIALIZED, dtype=torch.long, device=device)
        self.prefill_wrapper = BatchPrefillWithPagedKVCacheWrapper(WORKSPACE_TOKENS)

    def set_prefill_indptr(self, kv_blocks_per_req):
        indptr = torch.tensor([0] + torch.tensor(kv_blocks_per_req).cumsum(0).tolist(), dtype=torch.long)
        self.paged_kv_indptr_buf[:indptr.numel()].copy_(indptr.to(self.device))

    def begin_forward(self, batch_size, capturing):
        """``FlashInferMetadata.begin_forward``: plan the prefill wrapper for this metadata."""
        query_start_loc = torch.arange(batch_size + 1, dtype=torch.long, device=self.device)
        if capturing:
            if self.variant == "fix":
                paged_kv_indptr = torch.zeros(batch_size + 1, dtype=torch.long, device=self.device)
            else:
                paged_kv_indptr = self.paged_kv_indptr_buf[:1]      # torch.tensor([0]): one entry
        else:
            paged_kv_indptr = self.paged_kv_indptr_buf[:batch_size + 1]
        self.prefill_wrapper.begin_forward(query_start_loc, paged_kv_indptr)


class ModelRunner:
    def __init__(self, device, variant, graphed):
        gen = generator(7008)
        self.device, self.graphed = device, graphed
        self.wq = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.emb = randn(16, DIM, gen=gen, device=device)
        self.kv_cache = randn(NUM_BLOCKS * BLOCK_SIZE, DIM, gen=gen, device=device)
        self.ctx_pos = torch.arange(MAX_BLOCKS * BLOCK_SIZE, device=device)
        self.backend = FlashInferBackend(device, variant)
        self.input_ids = torch.zeros(BATCH, dtype=torch.long, device=device)
        self.block_table = torch.zeros(BATCH, MAX_BLOCKS, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(BATCH, dtype=torch.long, device=device)
        self.graph = None

    def forward(self):
        q = self.emb[self.input_ids] @ self.wq
        return decode_attention(q, self.kv_cache, self.block_table, self.seq_lens, self.ctx_pos)

    def prefill(self, kv_blocks_per_req):
        """A prefill step (one request here): its plan gets the real indptr, written into the buffer."""
        self.backend.set_prefill_indptr(kv_blocks_per_req)
        self.backend.begin_forward(len(kv_blocks_per_req), capturing=False)

    def capture_model(self):
        self.backend.begin_forward(BATCH, capturing=True)            # dummy metadata for capture
        self.graph, self.out = capture(self.forward, device=self.device, owner="CUDAGraphRunner",
                                       static={"input_ids": self.input_ids, "block_table": self.block_table,
                                               "seq_lens": self.seq_lens},
                                       state={"kv_cache": self.kv_cache})

    def decode(self, ids, tables, lens):
        t = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        self.input_ids.copy_(t(ids))
        self.block_table.copy_(t(tables))
        self.seq_lens.copy_(t(lens))
        if not self.graphed:
            return self.forward().clone()
        return replay(self.graph, self.out).clone()


def run(variant: str, device: str = "cpu"):
    def serve(graphed: bool):
        runner = ModelRunner(device, variant, graphed)
        runner.prefill([3])                  # one prompt of three blocks: indptr entries 0 and 1 written
        if graphed:
            runner.capture_model()
        tables = [[1, 2, 0, 0], [3, 4, 5, 0], [6, 0, 0, 0], [7, 8, 9, 10]]
        outs = [runner.decode([1, 2, 3, 4], tables, [3, 6, 2, 8]),
                runner.decode([5, 6, 7, 8], tables, [4, 5, 1, 7])]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
