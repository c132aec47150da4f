"""LoRAX ``--compile``: the ``GraphCache`` keeps the KV-cache list it was built with during memory profiling, ``init_kv_cache`` then allocates the real cache, and every decode graph is traced against the old (warmup) cache.

Upstream: https://github.com/predibase/lorax/pull/627 ("Fix CUDA graph compilation", predibase/lorax, merged
2024-10-02). Read: the PR description ("CUDA graph compilation has been broken since we added FlashInfer and prefix
caching support. This fixes the issues and adds some flexibility"), the PR's diff of
``server/lorax_server/models/flash_causal_lm.py`` and ``server/lorax_server/utils/graph.py``, and both files at
the parent commit (``FlashCausalLM.init_kv_cache``/``warmup``/``forward``, ``GraphCache.__init__``/``warmup``/
``forward``, ``GraphWrapper.trace``/``forward``, ``get_max_graph_state``, ``pad_and_fill``). The PR bundles several
fixes (graph-owned prefix-length buffers, a warm-up forward before each capture, LoRA segment padding, memory
sizing); this program models the one hunk in ``FlashCausalLM.warmup``. No issue text or test was read.
Symptom: with ``--compile`` (CUDA graphs for decode) generations are wrong after the prefill token: the decode steps
attend over KV entries that the engine's warmup left behind, not over the request's prompt. Eager mode is fine.
Mechanism: ``FlashCausalLM.warmup`` first calls ``init_kv_cache(batch.num_blocks, ...)`` and runs the warmup batch
through ``generate_token``; it then builds ``GraphCache(self.model, self.device, self.kv_cache, ...)`` to estimate
graph memory, sizes the real cache, and calls ``init_kv_cache(num_blocks, ...)`` again, which rebinds
``self.kv_cache`` to a *new* list of tensors. ``self.model_graph_wrapper.warmup()`` then traces every decode graph
with ``GraphWrapper.trace(self.model, ..., self.kv_cache, ...)`` -- the ``GraphCache``'s own attribute, still the
warmup list (kept alive by that reference). At serving time ``GraphCache.forward`` receives the engine's current
``kv_cache`` but ``GraphWrapper.forward`` only refreshes the graph's static inputs and replays: the captured
kernels write and read the warmup cache, while prefill (eager) wrote the prompt's KV into the new one.
Doctor: warmup-divergence, at warmup. The graph's tensor reference (the KV cache) was decided when the graph cache
was built during warmup; the eager step now uses a different cache, and replays keep the old one.
Fix (upstream): ``self.model_graph_wrapper.kv_cache = self.kv_cache`` before ``self.model_graph_wrapper.warmup()``,
so the graphs are traced against the cache the engine serves with.
Modelled: ``FlashCausalLM`` (``init_kv_cache``, ``warmup``, ``generate_token``), ``GraphCache`` (``warmup``,
``forward``), ``GraphWrapper`` (``trace``, ``forward``), ``get_max_graph_state``, ``pad_and_fill``,
``get_cached_batch_size`` and a one-layer paged-attention model (block size 4, slot -1 skipped as the
``reshape_and_cache`` kernel does). Stand-ins: no LoRA adapters (max rank 0), no FlashInfer, no memory profiling (the
graph cache is built but its estimate is not traced); block 0 is never handed out. Sizes: hidden 8, vocab 16,
``CACHED_BATCH_SIZES = [1, 2, 4]``, warmup cache 8 blocks, serving cache 12 blocks.
Workload: warmup batch (2 requests, blocks 1-4) is prefilled and decoded eagerly into the warmup cache; the real cache
is allocated and graphs traced. Requests A, B, C (blocks 1-6) are prefilled eagerly into the real cache and decode
3 steps through the size-4 graph (3 real rows, 1 padded). With the bug the decode graph attends over the warmup
batch's KV in blocks 1-4 and unwritten zeros in blocks 5-6; logits differ from eager from the first decode step.
"""
from __future__ import annotations

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/predibase/lorax/pull/627"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "warmup"
SYMPTOM = ("LoRAX --compile: decode CUDA graphs are traced against the KV cache allocated for warmup profiling; "
           "the real cache is allocated afterwards, so graph decode steps attend over stale warmup KV and generate "
           "wrong tokens while eager mode is correct")

HIDDEN, VOCAB, BLOCK_SIZE = 8, 16, 4
MAX_BATCH_SIZE, MAX_BLOCKS_PER_SEQ = 4, 2
CACHED_BATCH_SIZES = [1, 2, 4]
SLOT_PAD_VALUE = -1

_variant = "bug"


def get_cached_batch_size(batch_size: int) -> int:
    return next(b for b in CACHED_BATCH_SIZES if b >= batch_size)


def pad_and_fill(dest, src, pad_value):
    dest[: src.shape[0]].copy_(src)
    dest[src.shape[0]:].fill_(pad_value)


class GraphState:
    def __init__(self, device):
        z = lambda *s: torch.zeros(*s, dtype=torch.int64, device=device)  # noqa: E731
        self.input_ids, self.position_ids = z(MAX_BATCH_SIZE), z(MAX_BATCH_SIZE)
        self.block_tables = z(MAX_BATCH_SIZE, MAX_BLOCKS_PER_SEQ)
        self.slots = torch.full((MAX_BATCH_SIZE,), SLOT_PAD_VALUE, dtype=torch.int64, device=device)
        self.input_lengths = torch.ones(MAX_BATCH_SIZE, dtype=torch.int64, device=device)


def get_max_graph_state(device):
    return GraphState(device)


class FlashModel:
    """Embedding, one paged-attention layer, lm head (``model.forward`` of a flash causal LM)."""

    def __init__(self, device):
        gen = generator(627)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).double()  # noqa: E731
        self.embed = r(VOCAB, HIDDEN, scale=1.0)
        self.wq, self.wk, self.wv, self.wo = (r(HIDDEN, HIDDEN) for _ in range(4))
        self.lm_head = r(HIDDEN, VOCAB, scale=0.8)

    def forward(self, input_ids, position_ids, cu_seqlen_prefill, kv_cache, block_tables, slots, input_lengths):
        x = self.embed[input_ids] + 0.1 * position_ids[:, None].double()
        q, k, v = x @ self.wq, x @ self.wk, x @ self.wv
        k_cache, v_cache = kv_cache[0]
        kf, vf = k_cache.view(-1, HIDDEN), v_cache.view(-1, HIDDEN)
        keep = (slots >= 0)[:, None]                       # reshape_and_cache skips slot -1
        safe = slots.clamp(min=0)
        kf[safe] = torch.where(keep, k, kf[safe])
        vf[safe] = torch.where(keep, v, vf[safe])
        if cu_seqlen_prefill is not None:                  # prefill: causal attention inside each prompt
            seq = torch.bucketize(torch.arange(x.shape[0], device=x.device), cu_seqlen_prefill[1:], right=True)
            mask = (seq[:, None] == seq[None, :]) & (torch.arange(x.shape[0], device=x.device)[None, :]
                                                    <= torch.arange(x.shape[0], device=x.device)[:, None])
            scores = (q @ k.T) * HIDDEN ** -0.5
            out = torch.softmax(scores.masked_fill(~mask, -1e9), -1) @ v
        else:                                              # decode: paged attention over the cache
            j = torch.arange(MAX_BLOCKS_PER_SEQ * BLOCK_SIZE, device=x.device)
            idx = block_tables[:, j // BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE
            scores = (kf[idx] * q[:, None]).sum(-1) * HIDDEN ** -0.5
            scores = scores.masked_fill(j[None, :] >= input_lengths[:, None], -1e9)
            out = (torch.softmax(scores, -1)[..., None] * vf[idx]).sum(1)
        return (x + out @ self.wo) @ self.lm_head


class GraphWrapper:
    def __init__(self, graph, memory_pool, input_state, output_states, bs):
        self.graph, self.memory_pool, self.input_state = graph, memory_pool, input_state
        self.output_states, self.bs = output_states, bs

    @staticmethod
    def trace(model, device, kv_cache, batch_size, memory_pool):
        max_input_state = get_max_graph_state(device)
        s = max_input_state
        view = (s.input_ids[:batch_size], s.position_ids[:batch_size], s.block_tables[:batch_size],
                s.slots[:batch_size], s.input_lengths[:batch_size])
        g, output_states = capture(
            lambda: model.forward(view[0], view[1], None, kv_cache, view[2], view[3], view[4]),
            device=device, pool=memory_pool, warmups=0, name=f"decode [{batch_size}]",
            static={"input_ids": s.input_ids, "position_ids": s.position_ids, "block_tables": s.block_tables,
                    "slots": s.slots, "input_lengths": s.input_lengths},
            state={"kv_cache[0].k": kv_cache[0][0], "kv_cache[0].v": kv_cache[0][1]}, owner="GraphCache")
        return GraphWrapper(g, memory_pool, view, output_states, batch_size)

    def forward(self, input_ids, position_ids, cu_seqlen_prefill, kv_cache, block_tables, slots, input_lengths):
        ids, pos, bt, sl, lens = self.input_state
        pad_and_fill(ids, input_ids, 0)
        pad_and_fill(pos, position_ids, 0)
        pad_and_fill(sl, slots, SLOT_PAD_VALUE)
        pad_and_fill(lens, input_lengths, 0)
        bt.zero_()
        bt[: block_tables.shape[0], : block_tables.shape[1]] = block_tables
        out = replay(self.graph, self.output_states, real=input_ids.shape[0], size=self.bs)
        return out[: input_ids.shape[0]]


class GraphCache:
    def __init__(self, model, device, kv_cache):
        self.model, self.device, self.kv_cache = model, device, kv_cache
        self.memory_pool = graph_pool_handle(device)
        self.cache = {}

    def warmup(self):
        for batch_size in reversed(CACHED_BATCH_SIZES):
            self.cache[batch_size] = GraphWrapper.trace(self.model, self.device, self.kv_cache, batch_size,
                                                        self.memory_pool)

    def forward(self, **kwargs):
        graph = self.cache[get_cached_batch_size(kwargs["input_ids"].shape[0])]
        return graph.forward(**kwargs)                     # kwargs["kv_cache"] is not what the graph reads


class FlashCausalLM:
    def __init__(self, device, compile):
        self.device, self.compile = device, compile
        self.model = FlashModel(device)
        self.model_graph_wrapper = None
        self.kv_cache = []

    def init_kv_cache(self, num_blocks):
        self.kv_cache = []
        self.kv_cache = [tuple(torch.zeros(num_blocks, BLOCK_SIZE, HIDDEN, dtype=torch.float64, device=self.device)
                               for _ in range(2))]

    def warmup(self, batch, max_new_tokens):
        """Profile with the warmup batch, build the graph cache, allocate the real cache, trace (the hazard site)."""
        self.init_kv_cache(batch.num_blocks)
        for _ in range(max_new_tokens):
            self.generate_token(batch)
        if self.compile:
            self.model_graph_wrapper = GraphCache(self.model, self.device, self.kv_cache)
        num_blocks = batch.num_blocks + 4                  # stand-in for the free-memory computation
        del batch
        self.init_kv_cache(num_blocks)
        if self.model_graph_wrapper is not None:
            if _variant == "fix":                          # upstream fix
                self.model_graph_wrapper.kv_cache = self.kv_cache
            self.model_graph_wrapper.warmup()

    def generate_token(self, batch):
        dev = self.device
        if batch.prefill:
            ids = torch.cat([torch.tensor(t) for t in batch.tokens]).to(dev)
            pos = torch.cat([torch.arange(len(t)) for t in batch.tokens]).to(dev)
            slots = torch.cat([torch.tensor([b[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(len(t))])
                               for t, b in zip(batch.tokens, batch.blocks)]).to(dev)
            cu = torch.tensor([0] + [sum(len(t) for t in batch.tokens[: i + 1]) for i in range(len(batch.tokens))],
                              device=dev)
            logits = self.model.forward(ids, pos, cu, self.kv_cache, None, slots, None)
            last = (cu[1:] - 1)
            logits = logits[last]
            batch.prefill = False
        else:
            n = [len(t) for t in batch.tokens]
            kwargs = dict(input_ids=torch.tensor([t[-1] for t in batch.tokens], device=dev),
                          position_ids=torch.tensor([x - 1 for x in n], device=dev), cu_seqlen_prefill=None,
                          kv_cache=self.kv_cache, block_tables=torch.tensor(batch.blocks, device=dev),
                          slots=torch.tensor([b[(x - 1) // BLOCK_SIZE] * BLOCK_SIZE + (x - 1) % BLOCK_SIZE
                                              for b, x in zip(batch.blocks, n)], device=dev),
                          input_lengths=torch.tensor(n, device=dev))
            if self.model_graph_wrapper is not None:
                logits = self.model_graph_wrapper.forward(**kwargs)
            else:
                logits = self.model.forward(**kwargs)
        for t, row in zip(batch.tokens, logits.argmax(-1).tolist()):
            t.append(row)
        return logits.clone()


class Batch:
    def __init__(self, prompts, blocks):
        self.tokens = [list(p) for p in prompts]
        self.blocks = blocks
        self.num_blocks = 1 + max(b for bl in blocks for b in bl) + 3   # block 0 reserved
        self.prefill = True


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant

    def serve(compile: bool):
        engine = FlashCausalLM(device, compile)
        engine.warmup(Batch([[9, 4, 7, 1], [2, 13, 6]], [[1, 2], [3, 4]]), max_new_tokens=3)
        batch = Batch([[3, 5, 7], [11, 2], [8, 8, 1, 14]], [[1, 2], [3, 4], [5, 6]])
        return [engine.generate_token(batch) for _ in range(4)]      # prefill + 3 decode steps

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
