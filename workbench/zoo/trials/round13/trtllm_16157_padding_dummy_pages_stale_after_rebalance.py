"""The CUDA-graph padding dummy stays ACTIVE through a KV pool rebalance: its stale page index lands in a live request's page.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/16157 ("[TRTLLM-12714][fix] Suspend CUDA-graph padding
dummies before pool rebalance adjust()").
Symptom: with ``KVCacheManagerV2`` pool rebalancing and CUDA graph padding, the first live ``adjust()`` fails
its all-caches-suspended precondition and takes the executor event loop down with every in-flight request
(TensorRT-LLM main, July 2026). The PR explains what that precondition protects: a cache left ACTIVE across
``adjust()`` keeps addressing page slots that now belong to other sequences.
Mechanism: ``CUDAGraphRunner`` retains one padding dummy request per captured draft length; its cache stays
ACTIVE across iterations, but the dummy never appears in ``PyExecutor.active_requests``. The rebalance hook
suspends only the active requests (suspension drops their page locks and tears down their base-page-index
buffers), runs ``adjust()``, which migrates held pages to compact the pool (``_gather_persistent_pages`` ->
``shrink_pool_group`` -> ``_batchedMigrate(defrag=True)``), and resumes them (resuming re-takes the locks and
rewrites the indices from the pages' new homes). Nothing refreshes the dummy's page index: it still names the
slot its page had before the migration, which after compaction is a live request's page. Every padded decode
replay writes the dummy row's K/V through that stale index (``reshape_and_cache`` for the padded row) into the
live request's first tokens, and the live row's attention reads them.
Doctor: stale-padding, at ``rebalance_kv_pools`` (the padded dummy row's page index is left from before the
migration, and the real rows read what it writes).
Fix (upstream): suspend the padding dummies alongside the active requests before ``adjust()`` and resume them
after, so their page indices are rebuilt like every other cache's.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/16157"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "rebalance_kv_pools"
SYMPTOM = "after a pool rebalance the padded dummy row writes K/V into a live request's page (upstream: adjust() precondition kills the executor)"
VOCAB, DIM, TOKENS_PER_PAGE, NUM_PAGES, MAX_PAGES, BATCH, STEPS = 12, 4, 2, 8, 3, 3, 3
CUDA_GRAPH_DUMMY_REQUEST_ID = (1 << 64) - 1


class Page:
    def __init__(self, slot):
        self.slot = slot                                 # where the page lives in the pool (moves on defrag)


class KVCache:
    """One request's cache in ``KVCacheManagerV2``: its pages and the base-page-index buffer the kernels use."""

    def __init__(self, pages):
        self.pages = pages
        self.status = "ACTIVE"
        self.base_page_indices = [p.slot for p in pages]     # written when the page locks are taken

    def suspend(self):
        self.status = "SUSPENDED"
        self.base_page_indices = None                        # torn down with the page locks

    def resume(self):
        self.status = "ACTIVE"
        self.base_page_indices = [p.slot for p in self.pages]


class KVCacheManagerV2:
    def __init__(self, device):
        self.kv_pool = torch.zeros(NUM_PAGES * TOKENS_PER_PAGE, 2, DIM, device=device)
        self.caches = {}

    def add(self, request_id, slots):
        self.caches[request_id] = KVCache([Page(s) for s in slots])
        return self.caches[request_id]

    def adjust(self):
        """Rebalance: compact every held page into the lowest slots (the shrink path migrates held pages).
        Caches should all be suspended; their page objects move with the data. (Upstream checks that
        precondition here and raises, which is the failure users saw; the check is left out so that the
        hazard it guards against, an ACTIVE cache's stale indices, is what the program shows.)"""
        held = sorted((p for c in self.caches.values() for p in c.pages), key=lambda p: p.slot)
        pool = self.kv_pool.view(NUM_PAGES, TOKENS_PER_PAGE, 2, DIM)
        for new_slot, page in enumerate(held):
            if page.slot != new_slot:
                pool[new_slot].copy_(pool[page.slot])
                page.slot = new_slot


class LlmRequest:
    def __init__(self, request_id, prompt, *, is_cuda_graph_dummy=False):
        self.py_request_id = request_id
        self.tokens = list(prompt)
        self.is_cuda_graph_dummy = is_cuda_graph_dummy


class Model:
    def __init__(self, device):
        gen = generator(16157)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.wk = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
        self.wv = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device)

    def forward(self, kv_pool, input_ids, slot_mapping, kv_slots, kv_mask):
        """One decode token per row: ``reshape_and_cache`` writes the row's K/V at its slot, then the row
        attends over the slots of its pages (``kv_slots``, masked by ``kv_mask``)."""
        h = self.embed[input_ids]
        kv_pool[slot_mapping, 0] = h @ self.wk
        kv_pool[slot_mapping, 1] = h @ self.wv
        k, v = kv_pool[kv_slots, 0], kv_pool[kv_slots, 1]             # [rows, slots, DIM]
        scores = (k @ h.unsqueeze(-1)).squeeze(-1).masked_fill(~kv_mask, float("-inf"))
        out = (torch.softmax(scores, -1).unsqueeze(-1) * v).sum(1)
        return (h + out) @ self.lm_head


class PyExecutor:
    def __init__(self, device, variant, graphed):
        self.device, self.variant, self.graphed = device, variant, graphed
        self.model = Model(device)
        self.kv_cache_manager = KVCacheManagerV2(device)
        self.active_requests = []
        self.padding_dummies = []                        # CUDAGraphRunner's retained dummies (one per draft len)
        self.input_ids = torch.zeros(BATCH, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(BATCH, dtype=torch.long, device=device)
        self.kv_slots = torch.zeros(BATCH, MAX_PAGES * TOKENS_PER_PAGE, dtype=torch.long, device=device)
        self.kv_mask = torch.zeros(BATCH, MAX_PAGES * TOKENS_PER_PAGE, dtype=torch.bool, device=device)
        self.graph = None

    def rebalance_kv_pools(self):
        """The rebalance hook: suspend caches, ``adjust()`` the pools, resume."""
        to_suspend = [self.kv_cache_manager.caches[r.py_request_id] for r in self.active_requests]
        if self.variant == "fix":
            # (fix) the CUDA-graph padding dummies are ACTIVE too, though not in active_requests
            to_suspend += [self.kv_cache_manager.caches[r.py_request_id] for r in self.padding_dummies]
        for cache in to_suspend:
            cache.suspend()
        self.kv_cache_manager.adjust()
        for cache in to_suspend:
            cache.resume()

    def _prepare_inputs(self, batch):
        for row, req in enumerate(batch):
            cache = self.kv_cache_manager.caches[req.py_request_id]
            pos = len(req.tokens) - 1
            idx = cache.base_page_indices
            self.input_ids[row] = req.tokens[-1]
            self.slot_mapping[row] = idx[pos // TOKENS_PER_PAGE] * TOKENS_PER_PAGE + pos % TOKENS_PER_PAGE
            slots = [idx[t // TOKENS_PER_PAGE] * TOKENS_PER_PAGE + t % TOKENS_PER_PAGE for t in range(pos + 1)]
            self.kv_slots[row].zero_()
            self.kv_slots[row, :len(slots)] = torch.tensor(slots, device=self.device)
            self.kv_mask[row] = torch.arange(self.kv_slots.shape[1], device=self.device) < len(slots)

    def forward_step(self):
        n = len(self.active_requests)
        if not self.graphed:
            self._prepare_inputs(self.active_requests)
            return self.model.forward(self.kv_cache_manager.kv_pool, self.input_ids[:n], self.slot_mapping[:n],
                                      self.kv_slots[:n], self.kv_mask[:n])
        batch = self.active_requests + self.padding_dummies * (BATCH - n)      # CUDA graph padding
        self._prepare_inputs(batch)
        if self.graph is None:
            self.graph = capture(lambda: self.model.forward(self.kv_cache_manager.kv_pool, self.input_ids,
                                                            self.slot_mapping, self.kv_slots, self.kv_mask),
                                 device=self.device,
                                 static={"input_ids": self.input_ids, "slot_mapping": self.slot_mapping,
                                         "kv_slots": self.kv_slots, "kv_mask": self.kv_mask},
                                 state={"kv_pool": self.kv_cache_manager.kv_pool},
                                 owner="CUDAGraphRunner (decode graph)")
        g, out = self.graph
        return replay(g, out, real=n, size=BATCH, padded={"slot_mapping": self.slot_mapping,
                                                           "kv_slots": self.kv_slots})[:n]


def run(variant: str, device: str = "cpu"):
    prompts = {1: [3, 7, 2], 2: [5, 1]}

    def serve(graphed: bool):
        ex = PyExecutor(device, variant, graphed)
        mgr = ex.kv_cache_manager
        # Pages: request 1 holds slots 3, 4, 6 and request 2 slots 5, 7; slots 0 and 2 are free.
        for rid, slots in ((1, [3, 4, 6]), (2, [5, 7])):
            req = LlmRequest(rid, prompts[rid])
            cache = mgr.add(rid, slots)
            ids = torch.tensor(req.tokens[:-1], device=device)          # the prefill's K/V, already cached
            for t, tok in enumerate(ids.tolist()):
                s = cache.base_page_indices[t // TOKENS_PER_PAGE] * TOKENS_PER_PAGE + t % TOKENS_PER_PAGE
                h = ex.model.embed[tok]
                mgr.kv_pool[s, 0] = h @ ex.model.wk
                mgr.kv_pool[s, 1] = h @ ex.model.wv
            ex.active_requests.append(req)
        if graphed:                                      # preallocated padding dummy: one page, slot 1
            dummy = LlmRequest(CUDA_GRAPH_DUMMY_REQUEST_ID, [0], is_cuda_graph_dummy=True)
            mgr.add(CUDA_GRAPH_DUMMY_REQUEST_ID, [1])
            ex.padding_dummies.append(dummy)
        outs = []
        for step in range(STEPS):
            if step == 1:
                ex.rebalance_kv_pools()                  # the pool group shrinks: held pages compacted
            logits = ex.forward_step()
            outs.append(logits.clone())
            for req, tok in zip(ex.active_requests, torch.argmax(logits, -1).tolist()):
                req.tokens.append(tok)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
