"""A graph trace at ``max_s=MAX_CONTEXT_LENGTH`` rebuilds the RoPE cos/sin table inside the capture: never computed.

Upstream: https://github.com/predibase/lorax/pull/351 ("fix: Only update cache during warmup"), which fixes the
CUDA-graph regression introduced one day earlier by https://github.com/predibase/lorax/pull/350 ("Fix dynamic RoPE").
Symptom: the PR says only "Fixes regression with CUDA graphs introduced in #350": with ``--compile`` (LoRAX CUDA
graphs, March 2024) a model whose RoPE cache is shorter than ``MAX_CONTEXT_LENGTH`` (8192) serves garbage: every
forward, eager prefill and replayed decode alike, reads a cos/sin table that no kernel ever wrote.
Mechanism: #350 made ``PositionRotaryEmbedding.get_cos_sin`` call ``_update_cos_sin_cache(dtype, device, max_s)``
on every forward, so that dynamic-NTK models grow their table during warmup. ``_update_cos_sin_cache`` decides on
the host (``seqlen > self._seq_len_cached``) and then rebinds ``self.inv_freq`` / ``self._cos_cached`` /
``self._sin_cached`` to freshly computed tensors. ``GraphWrapper.trace`` captures ``model.forward`` with
``max_s=MAX_CONTEXT_LENGTH`` and no eager run first, so the first trace (``GraphCache.get_estimated_cache_memory``)
takes that branch *inside* the capture: the new tables are allocated in the estimation graphs' pool and their
kernels are only recorded, never run, and those graphs are then discarded without a replay. From then on the
module's ``_cos_cached`` holds memory nothing wrote (poison here, whatever the pool held on CUDA); the graphs traced
next and every eager prefill ``index_select`` from it. The same workload without graphs never traces, never takes
the branch, and keeps the warmed-up table.
Doctor: warmup-divergence, at ``_update_cos_sin_cache`` (its lazy re-build, decided and bound during the trace,
is what every later step reuses, while an eager step keeps the warmup table).
Fix (upstream): a global warmup flag (``lorax_server/utils/state.py``: ``warmup_mode()`` around the warmup
``generate_token`` loop) and ``if is_warmup(): self._update_cos_sin_cache(...)`` in ``get_cos_sin``: the table
grows only while warming up to ``max_total_tokens``, never during a trace or a served step.
Simplified here: one attention head, no LoRA adapters, paged attention for prefill rows too (upstream runs
flash-attention varlen there), teacher-forced next tokens, and no memory measurement in the estimation trace.
"""
from __future__ import annotations

import contextlib
import math

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/predibase/lorax/pull/351"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "_update_cos_sin_cache"
SYMPTOM = "every forward after the graph traces reads a RoPE cos/sin table that was only recorded, never computed"

VOCAB, DIM = 16, 4
MAX_POSITION_EMBEDDINGS = 8         # config.max_position_embeddings (rope_scaling: dynamic, factor 2)
ROPE_SCALING_FACTOR = 2.0
MAX_TOTAL_TOKENS = 12               # the launcher's --max-total-tokens: warmup generates up to it
MAX_CONTEXT_LENGTH = 16             # graph.py: traces run with max_s=MAX_CONTEXT_LENGTH
MAX_BATCH_SIZE = 4
CACHED_BATCH_SIZES = [1, 2, 4]
BLOCK_SIZE = 2
MAX_BLOCKS = MAX_CONTEXT_LENGTH // BLOCK_SIZE
NUM_BLOCKS = 16                     # block 0 is never handed out: padded rows' slots point at it
SLOT_PAD_VALUE = -1

# lorax_server/utils/state.py (added by the fix)
WARMUP = False


def set_warmup(value: bool):
    global WARMUP
    WARMUP = value


def is_warmup() -> bool:
    return WARMUP


@contextlib.contextmanager
def warmup_mode():
    try:
        set_warmup(True)
        yield
    finally:
        set_warmup(False)


def _create_inv_freq(dim, base, device):
    return 1.0 / (base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))


class PositionRotaryEmbedding:
    def __init__(self, inv_freq, scaling_factor, max_position_embeddings, device, dtype, variant):
        self.inv_freq = inv_freq
        self._seq_len_cached = 0
        self._cos_cached = None
        self._sin_cached = None
        self.scaling_factor = scaling_factor
        self.variant = variant
        self._update_cos_sin_cache(dtype, device, max_position_embeddings)

    def _update_cos_sin_cache(self, dtype, device, seqlen):
        # Reset the tables if the sequence length has changed,
        # or if we're on a new device (possibly due to tracing for instance)
        if (seqlen > self._seq_len_cached or self._cos_cached.device != device
                or self._cos_cached.dtype != dtype):
            self._seq_len_cached = seqlen
            t = torch.arange(seqlen, device=device, dtype=self.inv_freq.dtype)
            freqs = torch.outer(t, self.inv_freq.to(device=t.device))
            self._cos_cached = torch.cos(freqs).to(dtype)
            self._sin_cached = torch.sin(freqs).to(dtype)

    def get_cos_sin(self, position_ids, max_s, dtype):
        """Return cos and sin for the asked position ids"""
        # When using dynamic position embeddings, the max sequence length might exceed
        # the max position embeddings of the base model, so we need to update our
        # cache during warmup.
        # This should never result in a change after warmup, otherwise we break
        # cuda graphs.
        if self.variant == "bug" or is_warmup():
            self._update_cos_sin_cache(dtype, position_ids.device, max_s)
        cos = torch.index_select(self._cos_cached, 0, position_ids)
        sin = torch.index_select(self._sin_cached, 0, position_ids)
        return cos, sin

    def forward(self, x, cos, sin):
        """``rotary_emb.apply_rotary`` (GPT-NeoX halves), out of place."""
        rotary_dim = cos.shape[-1]
        x1, x2 = x[..., :rotary_dim], x[..., rotary_dim:2 * rotary_dim]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class DynamicPositionRotaryEmbedding(PositionRotaryEmbedding):
    def __init__(self, dim, max_position_embeddings, base, device, dtype, scaling_factor, variant):
        inv_freq = _create_inv_freq(dim, base, device)
        self.dim = dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        super().__init__(inv_freq, scaling_factor, max_position_embeddings, device, dtype, variant)

    def _update_cos_sin_cache(self, dtype, device, seqlen):
        # Reset the tables if the sequence length has changed,
        # or if we're on a new device (possibly due to tracing for instance)
        if (seqlen > self._seq_len_cached or self._cos_cached.device != device
                or self._cos_cached.dtype != dtype):
            if seqlen > self.max_position_embeddings:
                newbase = self.base * ((self.scaling_factor * seqlen / self.max_position_embeddings)
                                       - (self.scaling_factor - 1)) ** (self.dim / (self.dim - 2))
                self.inv_freq = _create_inv_freq(self.dim, newbase, self.inv_freq.device)
            self._seq_len_cached = seqlen
            t = torch.arange(seqlen, device=device, dtype=self.inv_freq.dtype)
            freqs = torch.outer(t, self.inv_freq.to(device=t.device))
            self._cos_cached = torch.cos(freqs).to(dtype)
            self._sin_cached = torch.sin(freqs).to(dtype)


class FlashLlamaForCausalLM:
    """One layer, one head: embedding, RoPE on q/k, paged KV cache, attention, LM head."""

    def __init__(self, device, variant):
        gen = generator(351)
        self.embed_tokens = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq = randn(DIM, DIM, gen=gen, device=device, scale=0.8)
        self.wk = randn(DIM, DIM, gen=gen, device=device, scale=0.8)
        self.wv = randn(DIM, DIM, gen=gen, device=device, scale=0.8)
        self.wo = randn(DIM, DIM, gen=gen, device=device, scale=0.8)
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device)
        self.ctx_pos = torch.arange(MAX_BLOCKS * BLOCK_SIZE, device=device)
        self.rotary_emb = DynamicPositionRotaryEmbedding(
            dim=DIM, max_position_embeddings=MAX_POSITION_EMBEDDINGS, base=10000.0, device=device,
            dtype=torch.float32, scaling_factor=ROPE_SCALING_FACTOR, variant=variant)

    def forward(self, input_ids, position_ids, kv_cache, block_tables, slots, input_lengths, max_s):
        h = self.embed_tokens[input_ids]
        cos, sin = self.rotary_emb.get_cos_sin(position_ids, max_s, h.dtype)
        q = self.rotary_emb.forward(h @ self.wq, cos, sin)
        k = self.rotary_emb.forward(h @ self.wk, cos, sin)
        v = h @ self.wv
        key_cache, value_cache = kv_cache
        valid = (slots >= 0)[:, None]                 # SLOT_PAD_VALUE rows keep what slot 0 holds
        idx = slots.clamp(min=0)
        key_cache[idx] = torch.where(valid, k, key_cache[idx])
        value_cache[idx] = torch.where(valid, v, value_cache[idx])
        pos = self.ctx_pos
        ctx = block_tables[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        scores = (key_cache[ctx] @ q[:, :, None]).squeeze(-1) / math.sqrt(DIM)
        scores = scores.masked_fill(pos[None, :] >= input_lengths[:, None], -1e9)
        attn = (torch.softmax(scores, -1)[:, :, None] * value_cache[ctx]).sum(1)
        return (h + attn @ self.wo) @ self.lm_head


class CacheManager:
    def __init__(self, num_blocks, device):
        self.kv_cache = (torch.zeros(num_blocks * BLOCK_SIZE, DIM, device=device),
                         torch.zeros(num_blocks * BLOCK_SIZE, DIM, device=device))
        self.free_blocks = list(range(num_blocks - 1, 0, -1))   # block 0 stays the padding block

    def allocate(self):
        return self.free_blocks.pop()


class GraphState:
    """``get_max_graph_state`` (an ``lru_cache(maxsize=1)``): one set of static inputs, sliced per trace."""

    def __init__(self, device):
        self.input_ids = torch.zeros(MAX_BATCH_SIZE, dtype=torch.long, device=device)
        self.position_ids = torch.zeros(MAX_BATCH_SIZE, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(MAX_BATCH_SIZE, MAX_BLOCKS, dtype=torch.long, device=device)
        self.slots = torch.full((MAX_BATCH_SIZE,), SLOT_PAD_VALUE, dtype=torch.long, device=device)
        self.input_lengths = torch.ones(MAX_BATCH_SIZE, dtype=torch.long, device=device)

    def buffers(self):
        return {"input_ids": self.input_ids, "position_ids": self.position_ids,
                "block_tables": self.block_tables, "slots": self.slots, "input_lengths": self.input_lengths}


def pad_and_fill(dest, src, pad_value):
    dest[:src.shape[0]] = src
    dest[src.shape[0]:].fill_(pad_value)


class GraphWrapper:
    def __init__(self, graph, memory_pool, input_state, batch_size, output_states):
        self.graph, self.memory_pool, self.input_state = graph, memory_pool, input_state
        self.batch_size, self.output_states = batch_size, output_states

    @staticmethod
    def trace(model, device, max_input_state, batch_size, memory_pool, cache_manager):
        s = max_input_state
        graph, output_states = capture(
            lambda: model.forward(input_ids=s.input_ids[:batch_size], position_ids=s.position_ids[:batch_size],
                                  kv_cache=cache_manager.kv_cache, block_tables=s.block_tables[:batch_size],
                                  slots=s.slots[:batch_size], input_lengths=s.input_lengths[:batch_size],
                                  max_s=MAX_CONTEXT_LENGTH),
            device=device, pool=memory_pool, warmups=0, name=f"batch size {batch_size}",
            owner="lorax GraphCache", static=s.buffers(),
            state={"key_cache": cache_manager.kv_cache[0], "value_cache": cache_manager.kv_cache[1]})
        return GraphWrapper(graph, memory_pool, s, batch_size, output_states)

    def forward(self, input_ids, position_ids, block_tables, slots, input_lengths):
        s = self.input_state
        pad_and_fill(s.input_ids, input_ids, 0)
        pad_and_fill(s.position_ids, position_ids, 0)
        pad_and_fill(s.slots, slots, SLOT_PAD_VALUE)
        pad_and_fill(s.input_lengths, input_lengths, 0)
        s.block_tables.zero_()
        s.block_tables[:block_tables.shape[0], :block_tables.shape[1]] = block_tables
        out = replay(self.graph, self.output_states, real=input_ids.shape[0], size=self.batch_size)
        return out[:input_ids.shape[0]]


class GraphCache:
    def __init__(self, model, device):
        self.model, self.device = model, device
        self.memory_pool = graph_pool_handle(device)
        self.max_input_state = GraphState(device)
        self.cache = {}

    def can_use_graph(self, batch_size, max_s):
        return batch_size <= MAX_BATCH_SIZE and max_s <= MAX_CONTEXT_LENGTH

    def get_estimated_cache_memory(self, cache_manager):
        # Store off graphs into temporary cache to discard after estimation
        tmp_cache = {}
        batch_size = CACHED_BATCH_SIZES[-1]
        pool = graph_pool_handle(self.device)
        tmp_cache[batch_size] = GraphWrapper.trace(self.model, self.device, self.max_input_state, batch_size,
                                                   pool, cache_manager)
        del tmp_cache                 # (the free-memory deltas upstream measures here are left out)

    def warmup(self, cache_manager):
        for batch_size in reversed(CACHED_BATCH_SIZES):
            self.cache[batch_size] = GraphWrapper.trace(self.model, self.device, self.max_input_state,
                                                        batch_size, self.memory_pool, cache_manager)

    def forward(self, **kwargs):
        n = kwargs["input_ids"].shape[0]
        batch_size = next(b for b in CACHED_BATCH_SIZES if b >= n)
        return self.cache[batch_size].forward(**kwargs)


class Request:
    def __init__(self, prompt, script):
        self.tokens, self.script, self.blocks = list(prompt), list(script), []


class FlashCausalLM:
    def __init__(self, device, variant, compile):
        self.device, self.variant, self.compile = device, variant, compile
        self.model = FlashLlamaForCausalLM(device, variant)
        self.cache_manager = None
        self.model_graph_wrapper = None

    def _tensor(self, xs):
        return torch.tensor(xs, dtype=torch.long, device=self.device)

    def _slot(self, req, pos):
        while len(req.blocks) <= pos // BLOCK_SIZE:
            req.blocks.append(self.cache_manager.allocate())
        return req.blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE

    def generate_token(self, reqs, prefill):
        """One step: every prompt token of ``reqs`` (prefill) or their last token (decode); returns the
        logits of each request's last row and appends its scripted next token."""
        rows = []                                    # (request, token, position)
        for r in reqs:
            if prefill:
                rows += [(r, t, p) for p, t in enumerate(r.tokens)]
            else:
                rows.append((r, r.tokens[-1], len(r.tokens) - 1))
        slots = [self._slot(r, p) for r, _, p in rows]
        tables = [r.blocks + [0] * (MAX_BLOCKS - len(r.blocks)) for r, _, _ in rows]
        inputs = dict(input_ids=self._tensor([t for _, t, _ in rows]),
                      position_ids=self._tensor([p for _, _, p in rows]),
                      block_tables=self._tensor(tables), slots=self._tensor(slots),
                      input_lengths=self._tensor([p + 1 for _, _, p in rows]))
        max_s = max(len(r.tokens) for r in reqs)
        if (self.model_graph_wrapper is not None and not prefill
                and self.model_graph_wrapper.can_use_graph(len(rows), max_s)):
            logits = self.model_graph_wrapper.forward(**inputs)
        else:
            logits = self.model.forward(kv_cache=self.cache_manager.kv_cache, max_s=max_s, **inputs)
        last = [i for i, (r, _, _) in enumerate(rows) if i + 1 == len(rows) or rows[i + 1][0] is not r]
        out = logits[self._tensor(last)].clone()
        for r in reqs:
            r.tokens.append(r.script.pop(0))
        return out

    def warmup(self):
        self.cache_manager = CacheManager(NUM_BLOCKS, self.device)
        batch = [Request([1, 2, 3, 4], [5] * (MAX_TOTAL_TOKENS - 4))]
        with warmup_mode() if self.variant == "fix" else contextlib.nullcontext():
            self.generate_token(batch, prefill=True)
            for _ in range(MAX_TOTAL_TOKENS - 5):                 # generate to max_total_tokens
                self.generate_token(batch, prefill=False)
        if self.compile:
            self.model_graph_wrapper = GraphCache(self.model, self.device)
            self.model_graph_wrapper.get_estimated_cache_memory(self.cache_manager)
        self.cache_manager = CacheManager(NUM_BLOCKS, self.device)   # set_cache_manager(num_blocks)
        if self.model_graph_wrapper is not None:
            # Warmup the graph cache. Needs to be done after setting cache manager as
            # tracing will use the static kv cache tensors
            self.model_graph_wrapper.warmup(self.cache_manager)


def run(variant: str, device: str = "cpu"):
    def serve(compile: bool):
        lm = FlashCausalLM(device, variant, compile)
        lm.warmup()
        a = Request([3, 5, 7], [9, 2, 6, 4, 1])
        b = Request([1, 8], [10, 12, 14, 0, 6])
        c = Request([11, 13, 15], [2, 3, 9])
        outs = [lm.generate_token([a, b], prefill=True)]
        outs += [lm.generate_token([a, b], prefill=False) for _ in range(2)]
        outs.append(lm.generate_token([c], prefill=True))
        outs += [lm.generate_token([a, b, c], prefill=False) for _ in range(2)]   # 3 rows -> size-4 graph
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
