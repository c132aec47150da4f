"""The warmup plans FlashMLA's tile schedule on metadata the capture reuses; replays keep the dummy batch's plan.

Upstream: https://github.com/vllm-project/vllm/pull/42444 ("[Model Runner V2][Bug Fix][DSV4] Ensure lazy attention
state initializations happen during cudagraph capture"); follow-up for the speculator prefill:
https://github.com/vllm-project/vllm/pull/44253.
Symptom: DeepSeek-V4-Flash with FULL CUDA graphs in Model Runner V2 produced corrupted output (gibberish or
repetition loops); eager was correct (May 2026).
Mechanism: ``CudaGraphManager.capture_graph`` builds the dummy batch's attention metadata once
(``model_state.prepare_attn``), runs the eager warmup forward with it, then captures the forward
(``_capture_full_graph``) with the SAME metadata. FlashMLA's decode op initialises lazily: when the
``FlashMLASchedMeta`` it is handed has ``tile_scheduler_metadata is None`` it allocates the plan and launches
``run_get_decoding_sched_meta_kernel``, which partitions the KV blocks of every request from the current lengths;
when the field is set it reuses the plan. The warmup (eager, not recorded) plans from the dummy lengths
(``seq_lens = num_tokens``); the capture then finds the plan set and records only the attention kernel. Replays never
re-plan: every decode step runs the tile schedule of the dummy lengths, so requests longer than that lose their newest
KV blocks. An eager step builds fresh metadata and plans from its real lengths. Miniature: one decode layer, paged
KV (block 2, block 0 the null block), a plan of ``ceil(seq_len / BLOCK)`` blocks per request; the manager keeps
each graph's capture metadata referenced, so the plan tensor the graph reads stays alive.
Doctor: warmup-divergence, at capture_graph (the warmup made the lazy plan on the metadata the capture reuses, so the
planning kernel is not in the graph and replays keep the dummy batch's schedule).
Fix (upstream): build separate attention metadata for the warmup pass and the capture pass, so the capture starts
from an uninitialised ``FlashMLASchedMeta`` and the planning kernel is recorded and re-run on every replay (#44253
does the same for ``PrefillEagleCudaGraphManager``).
"""
from __future__ import annotations

import torch

from workbench.engine import events, graph, graph_pool_handle, new_graph
from workbench.zoo.kit import compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/42444"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "capture_graph"
SYMPTOM = "FULL-graph decode runs the warmup's tile schedule: KV blocks past the dummy length are skipped (gibberish)"

VOCAB, DIM = 12, 4
BLOCK, MAX_BLOCKS, NUM_BLOCKS = 2, 4, 9        # block 0: the null block dummy batches write into
NUM_REQS = 2


class FlashMLASchedMeta:
    """The lazily planned scheduler state handed to the decode op (one per layer per metadata build)."""

    def __init__(self):
        self.tile_scheduler_metadata = None
        self.num_splits = None
        self.have_initialized = False


def run_get_decoding_sched_meta_kernel(seq_lens):
    """The planning kernel: KV blocks scheduled per request, and the split offsets."""
    num_blocks = (seq_lens + BLOCK - 1) // BLOCK
    return num_blocks, torch.cumsum(num_blocks, 0)


def flash_mla_with_kvcache(q, kv_cache, block_table, seq_lens, sched_meta):
    """Dense decode: plan lazily (only when the metadata has none), then attend over the scheduled blocks."""
    if sched_meta.tile_scheduler_metadata is None:
        sched_meta.tile_scheduler_metadata, sched_meta.num_splits = run_get_decoding_sched_meta_kernel(seq_lens)
        sched_meta.have_initialized = True
    kv = kv_cache[block_table].reshape(q.shape[0], MAX_BLOCKS * BLOCK, DIM)
    cols = torch.arange(MAX_BLOCKS * BLOCK, device=q.device)
    scheduled = cols[None, :] < sched_meta.tile_scheduler_metadata[:, None] * BLOCK
    visible = scheduled & (cols[None, :] < seq_lens[:, None])
    scores = torch.einsum("rd,rtd->rt", q, kv).masked_fill(~visible, -1e9)
    return torch.einsum("rt,rtd->rd", torch.softmax(scores, -1), kv)


class DeepseekV4Model:
    def __init__(self, device):
        gen = generator(42444)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq, self.wkv, self.wo = (randn(DIM, DIM, gen=gen, device=device, scale=0.8) for _ in range(3))
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device)

    def __call__(self, input_ids, attn_metadata, kv_cache):
        x = self.emb[input_ids]
        kv_cache.view(-1, DIM).index_copy_(0, attn_metadata["slot_mapping"], x @ self.wkv)
        attn = flash_mla_with_kvcache(x @ self.wq, kv_cache, attn_metadata["block_table"],
                                      attn_metadata["seq_lens"], attn_metadata["sched_meta"])
        return (x + attn @ self.wo) @ self.lm_head


class InputBuffers:
    def __init__(self, device):
        self.input_ids = torch.zeros(NUM_REQS, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(NUM_REQS, dtype=torch.long, device=device)
        self.block_table = torch.zeros(NUM_REQS, MAX_BLOCKS, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(NUM_REQS, dtype=torch.long, device=device)


class DefaultModelState:
    def prepare_attn(self, input_buffers, num_reqs):
        """Attention metadata over the persistent buffers, with a fresh (unplanned) FlashMLASchedMeta."""
        return {"seq_lens": input_buffers.seq_lens[:num_reqs], "block_table": input_buffers.block_table[:num_reqs],
                "slot_mapping": input_buffers.slot_mapping[:num_reqs], "sched_meta": FlashMLASchedMeta()}


class CudaGraphManager:
    def __init__(self, device, variant):
        self.device, self.variant = device, variant
        self.pool = graph_pool_handle(device)
        self.full_graphs, self.hidden_states = {}, {}
        self.attn_metadata = {}                     # what each graph was captured with stays referenced

    def capture_graph(self, num_reqs, model, model_state, input_buffers, kv_cache):
        num_tokens = num_reqs
        # dummy batch: HACK(woosuk) seq_lens = num_tokens; block tables and slots point at the null block
        input_buffers.input_ids[:num_reqs] = 0
        input_buffers.seq_lens[:num_reqs] = num_tokens
        input_buffers.block_table[:num_reqs] = 0
        input_buffers.slot_mapping[:num_reqs] = torch.arange(num_reqs, device=self.device) % BLOCK
        attn_metadata = model_state.prepare_attn(input_buffers, num_reqs)
        events.static_buffers("InputBuffers", vars(input_buffers))
        events.persistent_state("kv cache", {"kv_cache": kv_cache})
        with events.warmup():                       # Warm up (eager): FlashMLA plans lazily here
            model(input_buffers.input_ids[:num_reqs], attn_metadata, kv_cache)
        if self.variant == "fix":
            # separate metadata for the capture pass: its FlashMLASchedMeta is unplanned, so the planning
            # kernel runs inside the capture and is recorded into the graph
            attn_metadata = model_state.prepare_attn(input_buffers, num_reqs)
        self._capture_full_graph(num_reqs, model, input_buffers, attn_metadata, kv_cache)

    def _capture_full_graph(self, num_reqs, model, input_buffers, attn_metadata, kv_cache):
        g = new_graph(self.device)
        with graph(g, self.pool, name=f"decode FULL num_reqs={num_reqs}"):
            self.hidden_states[num_reqs] = model(input_buffers.input_ids[:num_reqs], attn_metadata, kv_cache)
        self.full_graphs[num_reqs], self.attn_metadata[num_reqs] = g, attn_metadata

    def run_fullgraph(self, num_reqs):
        return replay(self.full_graphs[num_reqs], self.hidden_states[num_reqs])


PROMPTS = ([3, 7, 1, 9], [5, 2, 8])
BLOCK_TABLE = [[1, 2, 3, 4], [5, 6, 7, 8]]
DECODE_STEPS = 4


def run(variant: str, device: str = "cpu"):
    model = DeepseekV4Model(device)
    block_table = torch.tensor(BLOCK_TABLE, device=device)

    def slot(req, pos):
        return BLOCK_TABLE[req][pos // BLOCK] * BLOCK + pos % BLOCK

    def prefill(kv_cache):
        """Eager prefill of the prompts (their K/V only; the last prompt token feeds the first decode)."""
        for r, p in enumerate(PROMPTS):
            ids = torch.tensor(p[:-1], device=device)
            slots = torch.tensor([slot(r, i) for i in range(len(p) - 1)], device=device)
            kv_cache.view(-1, DIM).index_copy_(0, slots, model.emb[ids] @ model.wkv)

    def serve(graphed: bool):
        kv_cache = torch.zeros(NUM_BLOCKS, BLOCK, DIM, device=device)
        state, bufs = DefaultModelState(), InputBuffers(device)
        manager = CudaGraphManager(device, variant)
        if graphed:
            manager.capture_graph(NUM_REQS, model, state, bufs, kv_cache)
        prefill(kv_cache)
        tokens, lens, outs = [p[-1] for p in PROMPTS], [len(p) for p in PROMPTS], []
        for _ in range(DECODE_STEPS):
            bufs.input_ids.copy_(torch.tensor(tokens, device=device))
            bufs.seq_lens.copy_(torch.tensor(lens, device=device))
            bufs.block_table.copy_(block_table)
            bufs.slot_mapping.copy_(torch.tensor([slot(r, n - 1) for r, n in enumerate(lens)], device=device))
            if graphed:
                logits = manager.run_fullgraph(NUM_REQS).clone()
            else:                                   # eager: fresh metadata, planned from this step's lengths
                logits = model(bufs.input_ids, state.prepare_attn(bufs, NUM_REQS), kv_cache)
            outs.append(logits)
            tokens, lens = logits.argmax(-1).tolist(), [n + 1 for n in lens]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
