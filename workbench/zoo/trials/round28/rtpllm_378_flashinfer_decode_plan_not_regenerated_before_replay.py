"""A FlashInfer decode graph replays the split-KV plan that was generated for the capture's dummy lengths.

Upstream: https://github.com/alibaba/rtp-llm/pull/378 ("fix: plan before replay"), commit f256125a.
Symptom: with ``enable_cuda_graph`` and the FlashInfer decode backend, replayed decode steps attend over
the wrong KV ranges (wrong tokens); the PR says that before a replay of a graph containing FlashInfer,
FlashInfer's ``plan`` must run to regenerate ``kv_chunk_size_ptr`` / ``kv_tile_indices``, which live in
FlashInfer's int workspace, as SGLang does in ``init_forward_metadata_replay_cuda_graph``.
Mechanism (from the diff): ``FlashInferAttnParams::prepare`` builds the params, fills the page table
(``fillFlashInfer`` + ``refreshFlashInferBuf``) and calls ``genPlan``, which runs
``BatchDecodeWithPagedKVCachePlan``: on the host, from ``page_indptr_h``/``kvlen_h``, it chooses the
KV chunk size and the (request, kv tile) work list and copies them into ``int_workspace_d``, which the
decode kernel reads. ``CudaGraphRunner`` calls ``prepare`` once, at capture, with dummy decode
inputs (length 1). Before each replay ``CudaGraphRunner::prepareInputs`` calls
``FlashInferAttnParams::fillParams``, which rewrites the page table and ``kvlen`` buffers but, before
the fix, did not call ``genPlan``: ``int_workspace_d`` keeps the capture-time plan (chunk size and
tiles sized for length 1). Each replay then covers only positions
``[tile * chunk, (tile + 1) * chunk)`` of the capture plan. The tokens a request has beyond that
are dropped from its softmax, while eager runs ``prepare`` -> ``genPlan`` every step. The bug's
``prepare`` also passed ``enable_cuda_graph = false`` to the plan.
Doctor: stale-input, at ``fillParams`` (the pre-replay refresh that rewrites the page table but leaves
the static ``int_workspace_d`` plan as the capture left it).
Fix (upstream): ``fillParams`` ends with ``genPlan(batch_size, 1, ..., !is_prefill && enable_cuda_graph)``
(the params now keep ``attn_configs``, ``is_prefill``, ``enable_cuda_graph`` for it), and ``prepare``
passes ``!is_prefill && enable_cuda_graph`` instead of ``false``, so each replay reads a plan that
matches its lengths and the fixed CUDA-graph grid.
"""
from __future__ import annotations

import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/alibaba/rtp-llm/pull/378"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "fillParams"
SYMPTOM = "replayed FlashInfer decode attends only over the KV tiles planned for the capture's dummy lengths"

VOCAB, DIM = 16, 4
TOKENS_PER_BLOCK, MAX_BLOCKS, NUM_BLOCKS = 2, 4, 12
MAX_KV = TOKENS_PER_BLOCK * MAX_BLOCKS
BATCH = 2                                   # the one captured decode batch size
MAX_WORK = 2 * BATCH                        # FlashInfer's fixed CUDA-graph grid (padded_batch_size)
RESERVED_BLOCK = 0                          # block 0 is reserved (dummy capture inputs write there)


class Model:
    def __init__(self, device):
        gen = generator(378)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.wk = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.wo = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.pos = torch.arange(MAX_KV, device=device)


class FlashInferAttnParams:
    """Host and device page-table buffers, and the int workspace the plan is written into:
    ``[request_indices | kv_tile_indices | block_valid_mask | kv_chunk_size]``."""

    def __init__(self, device, variant, enable_cuda_graph):
        self.variant, self.enable_cuda_graph, self.is_prefill = variant, enable_cuda_graph, False
        self.page_indice_h = torch.zeros(BATCH, MAX_BLOCKS, dtype=torch.long)
        self.kvlen_h = torch.zeros(BATCH, dtype=torch.long)
        self.page_indice_d = torch.zeros(BATCH, MAX_BLOCKS, dtype=torch.long, device=device)
        self.kvlen_d = torch.zeros(BATCH, dtype=torch.long, device=device)
        self.int_workspace_h = torch.zeros(3 * MAX_WORK + 1, dtype=torch.long)
        self.int_workspace_d = torch.zeros(3 * MAX_WORK + 1, dtype=torch.long, device=device)

    def fillFlashInfer(self, sequence_lengths, kv_cache_block_id_host, batch_size):
        for i in range(batch_size):
            blocks = kv_cache_block_id_host[i] + [RESERVED_BLOCK] * (MAX_BLOCKS - len(kv_cache_block_id_host[i]))
            self.page_indice_h[i] = torch.tensor(blocks)
            self.kvlen_h[i] = sequence_lengths[i]

    def refreshFlashInferBuf(self):
        self.page_indice_d.copy_(self.page_indice_h)
        self.kvlen_d.copy_(self.kvlen_h)

    def genPlan(self, batch_size, enable_cuda_graph):
        """``BatchDecodeWithPagedKVCachePlan``: host scheduling of the split-KV work, copied into the
        int workspace. Without CUDA graph: one tile per request. With it: the smallest chunk whose
        tiles fit the fixed grid of ``MAX_WORK`` blocks, the rest of the grid masked off."""
        kv_lens = [int(x) for x in self.kvlen_h[:batch_size]]
        if enable_cuda_graph:
            chunk = next(c for c in range(TOKENS_PER_BLOCK, MAX_KV + 1, TOKENS_PER_BLOCK)
                         if sum(math.ceil(n / c) for n in kv_lens) <= MAX_WORK)
        else:
            chunk = math.ceil(max(kv_lens) / TOKENS_PER_BLOCK) * TOKENS_PER_BLOCK
        work = [(r, t) for r, n in enumerate(kv_lens) for t in range(math.ceil(n / chunk))]
        assert len(work) <= MAX_WORK
        ws = [0] * (3 * MAX_WORK + 1)
        for w, (r, t) in enumerate(work):
            ws[w], ws[MAX_WORK + w], ws[2 * MAX_WORK + w] = r, t, 1
        ws[3 * MAX_WORK] = chunk
        self.int_workspace_h.copy_(torch.tensor(ws))
        self.int_workspace_d.copy_(self.int_workspace_h)        # cudaMemcpyAsync H2D

    def fillParams(self, sequence_lengths, kv_cache_block_id_host, batch_size):
        """Called by ``CudaGraphRunner::prepareInputs`` before every replay."""
        self.fillFlashInfer(sequence_lengths, kv_cache_block_id_host, batch_size)
        self.refreshFlashInferBuf()
        if self.variant == "fix":
            self.genPlan(batch_size, not self.is_prefill and self.enable_cuda_graph)

    @classmethod
    def prepare(cls, device, variant, enable_cuda_graph, sequence_lengths, kv_cache_block_id_host, batch_size):
        params = cls(device, variant, enable_cuda_graph)
        params.fillFlashInfer(sequence_lengths, kv_cache_block_id_host, batch_size)
        params.refreshFlashInferBuf()
        flag = (not params.is_prefill and enable_cuda_graph) if variant == "fix" else False
        params.genPlan(batch_size, flag)
        return params


def BatchDecodeWithPagedKVCacheRun(model, q, k_cache, params):
    """Each (request, kv tile) block of the grid covers ``[tile * chunk, min((tile + 1) * chunk, kv_len))``
    of its request (read from the int workspace); partial results are merged per request, which equals
    one softmax over the union of the covered positions (values = keys)."""
    ws = params.int_workspace_d
    req, tile = ws[:MAX_WORK], ws[MAX_WORK:2 * MAX_WORK]
    valid, chunk = ws[2 * MAX_WORK:3 * MAX_WORK], ws[3 * MAX_WORK]
    lo = tile * chunk
    hi = torch.minimum(lo + chunk, params.kvlen_d[req])
    pos = model.pos
    covered_w = (pos[None, :] >= lo[:, None]) & (pos[None, :] < hi[:, None]) & (valid[:, None] > 0)
    covered = torch.zeros(BATCH, MAX_KV, device=q.device).index_add_(0, req, covered_w.to(q.dtype)) > 0
    slots = params.page_indice_d[:, pos // TOKENS_PER_BLOCK] * TOKENS_PER_BLOCK + pos % TOKENS_PER_BLOCK
    k = k_cache[slots]                                               # [BATCH, MAX_KV, DIM]
    scores = (k @ q[:, :, None]).squeeze(-1).masked_fill(~covered, -1e9)
    return (torch.softmax(scores, -1)[:, :, None] * k).sum(1)


def forward(model, k_cache, input_ids, slot_mapping, params):
    h = model.emb[input_ids]
    k_cache[slot_mapping] = h @ model.wk                             # append this step's key
    return BatchDecodeWithPagedKVCacheRun(model, h @ model.wq, k_cache, params) @ model.wo


class CudaGraphRunner:
    def __init__(self, model, device, variant, enable_cuda_graph, k_cache):
        self.model, self.device, self.variant = model, device, variant
        self.enable_cuda_graph, self.k_cache = enable_cuda_graph, k_cache
        self.input_ids = torch.zeros(BATCH, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(BATCH, dtype=torch.long, device=device)
        if enable_cuda_graph:
            # captureOneBatchSize: dummy decode inputs (length 1, reserved block), prepare, capture
            self.params = FlashInferAttnParams.prepare(device, variant, True, [1] * BATCH,
                                                       [[RESERVED_BLOCK]] * BATCH, BATCH)
            p = self.params
            self.graph, self.out = capture(
                lambda: forward(model, self.k_cache, self.input_ids, self.slot_mapping, p),
                device=device, owner="CudaGraphRunner (FlashInfer decode graph)",
                static={"input_ids": self.input_ids, "slot_mapping": self.slot_mapping,
                        "page_indice_d": p.page_indice_d, "kvlen_d": p.kvlen_d,
                        "int_workspace_d": p.int_workspace_d},
                state={"k_cache": self.k_cache})

    def prepareInputs(self, token_ids, sequence_lengths, block_ids):
        t = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        self.input_ids.copy_(t(token_ids))
        self.slot_mapping.copy_(t([b[(n - 1) // TOKENS_PER_BLOCK] * TOKENS_PER_BLOCK + (n - 1) % TOKENS_PER_BLOCK
                                   for n, b in zip(sequence_lengths, block_ids)]))

    def forward(self, token_ids, sequence_lengths, block_ids):
        self.prepareInputs(token_ids, sequence_lengths, block_ids)
        if not self.enable_cuda_graph:
            params = FlashInferAttnParams.prepare(self.device, self.variant, False, sequence_lengths,
                                                  block_ids, BATCH)
            return forward(self.model, self.k_cache, self.input_ids, self.slot_mapping, params).clone()
        self.params.fillParams(sequence_lengths, block_ids, BATCH)
        return replay(self.graph, self.out).clone()


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    gen = generator(3780)
    prefix = randn(NUM_BLOCKS * TOKENS_PER_BLOCK, DIM, gen=gen, device=device)   # the prompts' keys

    def serve(graphed: bool):
        runner = CudaGraphRunner(model, device, variant, graphed, prefix.clone())
        blocks = [[1, 2, 3, 4], [5, 6, 7, 8]]
        lens = [3, 2]                                    # prompt lengths already in the cache
        outs = []
        for toks in [(4, 9), (11, 2), (7, 13), (5, 8)]:
            lens = [n + 1 for n in lens]
            outs.append(runner.forward(list(toks), lens, blocks))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
