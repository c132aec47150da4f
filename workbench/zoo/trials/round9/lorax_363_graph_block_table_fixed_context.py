"""The graphs' static block table is sized for a hard-coded 8192-token context; requests allocate more blocks.

Upstream: https://github.com/predibase/lorax/pull/363 ("Fix CUDA compile when using long sequence lengths",
commit 6cfc0f3, fixes issue #361).
Symptom: LoRAX with ``--compile`` (CUDA graphs) failed in decode for models served with a context longer
than 8192 tokens (long prompts plus ``max_new_tokens``), while eager serving worked (LoRAX, March 2024). PR:
"we had a fixed max sequence length of 8192, this led to a mismatch between the block table size assumed by
the CUDA graph manager and the model itself, which could be larger".
Mechanism: ``get_max_graph_state`` allocates the graphs' static ``block_tables`` with
``(MAX_CONTEXT_LENGTH + BLOCK_SIZE - 1) // BLOCK_SIZE`` columns, ``MAX_CONTEXT_LENGTH = 8192`` a constant,
and the graphs are traced with ``max_s=MAX_CONTEXT_LENGTH``. The batch, though, allocates every request's
blocks for its whole budget at prefill (``ceil((input_length + max_new_tokens) / BLOCK_SIZE)``), bounded by
the model's ``max_total_tokens``. ``GraphCache.can_use_graph`` only checks the *current* ``max_s`` against
8192, so a decode step of a request whose budget exceeds 8192 tokens is routed to a graph, and
``GraphWrapper.forward`` copies a block table wider than the static one into it.
Doctor: undersized-buffer, at ``get_max_graph_state`` (the static block table is sized by a constant
context, smaller than the block tables the batches carry).
Fix (upstream): thread ``max_total_tokens`` (and the sliding-window block count) into ``GraphCache`` and
``get_max_graph_state``: the static block table gets ``ceil((max_total_tokens - 1) / BLOCK_SIZE)`` columns,
``can_use_graph`` checks ``max_s <= self.max_total_tokens`` and the graphs are traced with that ``max_s``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/predibase/lorax/pull/363"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "get_max_graph_state"
SYMPTOM = "decode under --compile fails for requests whose block budget exceeds the graphs' 8192-token table"

VOCAB, DIM, BLOCK_SIZE, NUM_BLOCKS = 8, 4, 2, 12
MAX_CONTEXT_LENGTH = 8                 # 8192 upstream: the graphs' hard-coded context
MAX_TOTAL_TOKENS = 12                  # the model's --max-total-tokens (larger than 8192 upstream)
MAX_BATCH_SIZE = 2
SLOT_PAD_VALUE = -1


@dataclass
class GraphState:
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    block_tables: torch.Tensor
    slots: torch.Tensor
    input_lengths: torch.Tensor


def get_max_graph_state(device, max_total_tokens: int, variant: str) -> GraphState:
    if variant == "bug":
        max_num_blocks = (MAX_CONTEXT_LENGTH + BLOCK_SIZE - 1) // BLOCK_SIZE
    else:
        max_num_blocks = math.ceil((max_total_tokens - 1) / BLOCK_SIZE)
    return GraphState(
        input_ids=torch.zeros(MAX_BATCH_SIZE, dtype=torch.int64, device=device),
        position_ids=torch.zeros(MAX_BATCH_SIZE, dtype=torch.int32, device=device),
        block_tables=torch.zeros(MAX_BATCH_SIZE, max_num_blocks, dtype=torch.int64, device=device),
        slots=torch.full((MAX_BATCH_SIZE,), SLOT_PAD_VALUE, dtype=torch.int64, device=device),
        input_lengths=torch.ones(MAX_BATCH_SIZE, dtype=torch.int32, device=device),
    )


def pad_and_fill(dest, src, pad_value):
    dest[:src.shape[0]] = src
    dest[src.shape[0]:].fill_(pad_value)


def reshape_and_cache(key, value, key_cache, value_cache, slots):
    scratch = key_cache.shape[0] - 1                 # slot -1 (padding) is skipped: it lands in a scratch row
    idx = torch.where(slots < 0, torch.full_like(slots, scratch), slots)
    key_cache[idx] = key
    value_cache[idx] = value


def paged_attention(query, key_cache, value_cache, block_tables, input_lengths, max_s):
    pos = torch.arange(block_tables.shape[1] * BLOCK_SIZE, device=query.device)
    slots = block_tables[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    k, v = key_cache[slots], value_cache[slots]
    scores = (k @ query[:, :, None]).squeeze(-1) / math.sqrt(DIM)
    scores = scores.masked_fill(pos[None, :] >= input_lengths[:, None], float("-inf"))
    return (torch.softmax(scores, -1)[:, :, None] * v).sum(1)


class FlashLlamaForCausalLM:
    def __init__(self, device):
        gen = generator(363)
        self.embed_tokens = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq, self.wk, self.wv = (randn(DIM, DIM, gen=gen, device=device, scale=0.5) for _ in range(3))
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)

    def forward(self, input_ids, position_ids, kv_cache, block_tables, slots, input_lengths, max_s):
        h = self.embed_tokens[input_ids]
        key_cache, value_cache = kv_cache
        reshape_and_cache(h @ self.wk, h @ self.wv, key_cache, value_cache, slots)
        attn = paged_attention(h @ self.wq, key_cache, value_cache, block_tables, input_lengths, max_s)
        return (h + attn) @ self.lm_head


class GraphWrapper:
    def __init__(self, graph, input_state, output_states):
        self.graph, self.input_state, self.output_states = graph, input_state, output_states

    @staticmethod
    def trace(model, device, kv_cache, batch_size, max_total_tokens, variant) -> "GraphWrapper":
        max_input_state = get_max_graph_state(device, max_total_tokens, variant)
        input_state = GraphState(*(t[:batch_size] for t in (
            max_input_state.input_ids, max_input_state.position_ids, max_input_state.block_tables,
            max_input_state.slots, max_input_state.input_lengths)))
        max_s = MAX_CONTEXT_LENGTH if variant == "bug" else max_total_tokens
        graph, output_states = capture(
            lambda: model.forward(input_state.input_ids, input_state.position_ids, kv_cache,
                                  input_state.block_tables, input_state.slots, input_state.input_lengths, max_s),
            device=device, warmups=0, name=f"decode bs={batch_size}",
            static={"input_ids": input_state.input_ids, "position_ids": input_state.position_ids,
                    "block_tables": input_state.block_tables, "slots": input_state.slots,
                    "input_lengths": input_state.input_lengths},
            state={"key_cache": kv_cache[0], "value_cache": kv_cache[1]}, owner="lorax GraphWrapper")
        return GraphWrapper(graph, input_state, output_states)

    def forward(self, input_ids, position_ids, kv_cache, block_tables, slots, input_lengths, max_s):
        pad_and_fill(self.input_state.input_ids, input_ids, 0)
        pad_and_fill(self.input_state.position_ids, position_ids, 0)
        pad_and_fill(self.input_state.slots, slots, SLOT_PAD_VALUE)
        pad_and_fill(self.input_state.input_lengths, input_lengths, 0)
        self.input_state.block_tables.zero_()
        self.input_state.block_tables[:block_tables.shape[0], :block_tables.shape[1]] = block_tables
        return replay(self.graph, self.output_states)[:input_ids.shape[0]]


class GraphCache:
    def __init__(self, model, device, kv_cache, max_total_tokens, variant):
        self.model, self.device, self.kv_cache = model, device, kv_cache
        self.max_total_tokens, self.variant = max_total_tokens, variant
        self.cache = {}

    def can_use_graph(self, batch_size: int, max_s: int) -> bool:
        limit = MAX_CONTEXT_LENGTH if self.variant == "bug" else self.max_total_tokens
        return batch_size <= MAX_BATCH_SIZE and max_s <= limit

    def forward(self, **kw):
        batch_size = kw["input_ids"].shape[0]
        if batch_size not in self.cache:
            self.cache[batch_size] = GraphWrapper.trace(self.model, self.device, self.kv_cache, batch_size,
                                                        self.max_total_tokens, self.variant)
        return self.cache[batch_size].forward(kv_cache=self.kv_cache, **kw)


def run(variant: str, device: str = "cpu"):
    model = FlashLlamaForCausalLM(device)
    gen = generator(361)
    k0 = randn(NUM_BLOCKS * BLOCK_SIZE + 1, DIM, gen=gen, device=device)
    v0 = randn(NUM_BLOCKS * BLOCK_SIZE + 1, DIM, gen=gen, device=device)
    # FlashCausalLMBatch.from_pb: blocks for the whole budget, input_length + max_new_tokens.
    input_lengths, max_new_tokens = [4, 3], [7, 3]
    needed_blocks = [math.ceil((n + m) / BLOCK_SIZE) for n, m in zip(input_lengths, max_new_tokens)]
    block_tables = torch.zeros(2, max(needed_blocks), dtype=torch.int64, device=device)
    nxt = 1
    for b, n in enumerate(needed_blocks):
        block_tables[b, :n] = torch.arange(nxt, nxt + n)
        nxt += n
    tokens = [[3, 1], [6, 2], [5, 7]]

    def steps(forward, cache=None):
        outs = []
        for i, ids in enumerate(tokens):
            positions = [n + i for n in input_lengths]                  # prefilled prompt, now decoding
            slots = [int(block_tables[b, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
                     for b, p in enumerate(positions)]
            max_s = max(positions) + 1                                  # batch.max_seqlen
            kw = dict(input_ids=torch.tensor(ids, device=device),
                      position_ids=torch.tensor(positions, dtype=torch.int32, device=device),
                      block_tables=block_tables, slots=torch.tensor(slots, device=device),
                      input_lengths=torch.tensor([p + 1 for p in positions], dtype=torch.int32, device=device),
                      max_s=max_s)
            use_graph = cache is not None and cache.can_use_graph(len(ids), max_s)
            outs.append((cache.forward(**kw) if use_graph else forward(**kw)).clone())
        return outs

    def eager():
        kv_cache = (k0.clone(), v0.clone())
        return steps(lambda **kw: model.forward(kv_cache=kv_cache, **kw))

    def served():
        kv_cache = (k0.clone(), v0.clone())
        cache = GraphCache(model, device, kv_cache, MAX_TOTAL_TOKENS, variant)
        return steps(lambda **kw: model.forward(kv_cache=kv_cache, **kw), cache)

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
