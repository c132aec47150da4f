"""Sliding-window ``Seqlen.clamp`` rebinds the graph's ``input_lengths``: replays read the freed warmup tensor.

Upstream: https://github.com/predibase/lorax/pull/666 ("Fix sliding window + compile bug", commit e03f989).
Symptom: LoRAX with ``--compile`` (CUDA graphs) on sliding-window models (Mistral, Qwen2, Mixtral) decoded
wrong tokens; without ``--compile`` they were fine (LoRAX, Nov 2024). PR: "The `clamp` method on `Seqlen`
created a new tensor which CUDA graphs don't like. So, modified it to clamp in place."
Mechanism: in decode, ``FlashMistralForCausalLM.forward`` clamps the context lengths to the window with
``seqlen = seqlen.clamp(max=self.max_past)``, and ``Seqlen.clamp`` did
``self.input_lengths = torch.clamp(self.input_lengths, max=max)``: it rebinds the attribute of the very
``Seqlen`` object the graph wrapper owns. ``GraphWrapper.trace`` runs one warmup forward and then the
captured forward on its static ``input_state``: the warmup swaps the static ``input_lengths`` for a fresh
tensor W, the capture clamps W into a graph-pool tensor P and rebinds the attribute to P, which drops the
last reference to W. The graph now reads W, memory its owner released (the caching allocator hands it to
the next allocation), and ``GraphWrapper.forward`` copies each step's lengths into P, which the replayed
clamp overwrites: paged attention runs with garbage context lengths.
Doctor: dangling-reference, at ``clamp`` (the captured clamp reads the warmup's output, released when the
capture rebinds ``input_lengths``).
Fix (upstream): clamp in place, ``self.input_lengths.data.clamp_(max=max)``: the attribute keeps pointing at
the static buffer that ``forward`` refills, and the captured clamp reads and writes that buffer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/predibase/lorax/pull/666"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "clamp"
SYMPTOM = "wrong tokens for sliding-window models with --compile: the graph clamps a freed warmup tensor"

VOCAB, DIM, BLOCK_SIZE, NUM_BLOCKS = 8, 4, 2, 8
SLIDING_WINDOW = 4                                   # config.sliding_window (max_past)
SLIDING_WINDOW_BLOCKS = SLIDING_WINDOW // BLOCK_SIZE
MAX_TOTAL_TOKENS = 8
SLOT_PAD_VALUE = -1
BATCH = 2


class Seqlen:
    def __init__(self, input_lengths, cache_lengths, variant: str):
        self.input_lengths = input_lengths
        self.cache_lengths = cache_lengths
        self.variant = variant

    def clamp(self, max):
        if self.variant == "bug":
            self.input_lengths = torch.clamp(self.input_lengths, max=max)
        else:
            self.input_lengths.data.clamp_(max=max)
        return self


def reshape_and_cache(key, value, key_cache, value_cache, slots):
    """Write this step's K/V at ``slots``; slot -1 (padding) is skipped (it lands in the scratch row)."""
    scratch = key_cache.shape[0] - 1
    idx = torch.where(slots < 0, torch.full_like(slots, scratch), slots)
    key_cache[idx] = key
    value_cache[idx] = value


def paged_attention(query, key_cache, value_cache, block_tables, input_lengths, max_s):
    """Decode attention over the first ``input_lengths[b]`` cache positions of each sequence's blocks."""
    pos = torch.arange(block_tables.shape[1] * BLOCK_SIZE, device=query.device)
    slots = block_tables[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    k, v = key_cache[slots], value_cache[slots]                        # [B, P, D]
    scores = (k @ query[:, :, None]).squeeze(-1) / math.sqrt(DIM)
    scores = scores.masked_fill(pos[None, :] >= input_lengths[:, None], float("-inf"))
    return (torch.softmax(scores, -1)[:, :, None] * v).sum(1)


class FlashMistralForCausalLM:
    def __init__(self, device):
        gen = generator(666)
        self.embed_tokens = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq, self.wk, self.wv = (randn(DIM, DIM, gen=gen, device=device, scale=0.5) for _ in range(3))
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)
        self.max_past = SLIDING_WINDOW

    def forward(self, input_ids, position_ids, kv_cache, block_tables, slots, seqlen, max_s):
        if self.max_past is not None:
            # Clamp in decode mode as paged attention requires clamped values whereas the flash attention
            # kernel requires the true values
            max_s = min(self.max_past, max_s)
            seqlen = seqlen.clamp(max=self.max_past)
        h = self.embed_tokens[input_ids]
        key_cache, value_cache = kv_cache
        reshape_and_cache(h @ self.wk, h @ self.wv, key_cache, value_cache, slots)
        attn = paged_attention(h @ self.wq, key_cache, value_cache, block_tables, seqlen.input_lengths, max_s)
        return (h + attn) @ self.lm_head


@dataclass
class GraphState:
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    block_tables: torch.Tensor
    slots: torch.Tensor
    seqlen: Seqlen


def get_max_graph_state(device, max_total_tokens, sliding_window_blocks, variant) -> GraphState:
    max_num_blocks = max((max_total_tokens + BLOCK_SIZE - 1) // BLOCK_SIZE, sliding_window_blocks)
    return GraphState(
        input_ids=torch.zeros(BATCH, dtype=torch.int64, device=device),
        position_ids=torch.zeros(BATCH, dtype=torch.int32, device=device),
        block_tables=torch.zeros(BATCH, max_num_blocks, dtype=torch.int64, device=device),
        slots=torch.full((BATCH,), SLOT_PAD_VALUE, dtype=torch.int64, device=device),
        seqlen=Seqlen(torch.full((BATCH,), max_total_tokens, dtype=torch.int32, device=device),
                      torch.zeros(BATCH, dtype=torch.int32, device=device), variant),
    )


def pad_and_fill(dest, src, pad_value):
    dest[:src.shape[0]] = src
    dest[src.shape[0]:].fill_(pad_value)


class GraphWrapper:
    def __init__(self, graph, input_state, output_states):
        self.graph, self.input_state, self.output_states = graph, input_state, output_states

    @staticmethod
    def trace(model, device, kv_cache, max_total_tokens, sliding_window_blocks, variant) -> "GraphWrapper":
        input_state = get_max_graph_state(device, max_total_tokens, sliding_window_blocks, variant)

        def forward():
            return model.forward(input_ids=input_state.input_ids, position_ids=input_state.position_ids,
                                 kv_cache=kv_cache, block_tables=input_state.block_tables,
                                 slots=input_state.slots, seqlen=input_state.seqlen, max_s=max_total_tokens)

        # warmup, then capture (GraphWrapper.trace)
        graph, output_states = capture(
            forward, device=device, warmups=1, name="decode bs=2",
            static={"input_ids": input_state.input_ids, "position_ids": input_state.position_ids,
                    "block_tables": input_state.block_tables, "slots": input_state.slots,
                    "input_lengths": input_state.seqlen.input_lengths},
            state={"key_cache": kv_cache[0], "value_cache": kv_cache[1]}, owner="lorax GraphWrapper")
        return GraphWrapper(graph, input_state, output_states)

    def forward(self, input_ids, position_ids, kv_cache, block_tables, slots, seqlen, max_s):
        pad_and_fill(self.input_state.input_ids, input_ids, 0)
        pad_and_fill(self.input_state.position_ids, position_ids, 0)
        pad_and_fill(self.input_state.slots, slots, SLOT_PAD_VALUE)
        pad_and_fill(self.input_state.seqlen.input_lengths, seqlen.input_lengths, 0)
        pad_and_fill(self.input_state.seqlen.cache_lengths, seqlen.cache_lengths, 0)
        self.input_state.block_tables.zero_()
        self.input_state.block_tables[:block_tables.shape[0], :block_tables.shape[1]] = block_tables
        return replay(self.graph, self.output_states)[:input_ids.shape[0]]


def run(variant: str, device: str = "cpu"):
    model = FlashMistralForCausalLM(device)
    gen = generator(6660)
    # Two requests already past prefill: their last SLIDING_WINDOW tokens are in a rolling window of blocks
    # (block 0 is the padding block, holding nothing meaningful).
    k0 = randn(NUM_BLOCKS * BLOCK_SIZE + 1, DIM, gen=gen, device=device)
    v0 = randn(NUM_BLOCKS * BLOCK_SIZE + 1, DIM, gen=gen, device=device)
    k0[:BLOCK_SIZE] = 50.0
    block_tables = torch.tensor([[1, 2], [3, 4]], dtype=torch.int64, device=device)
    start_lengths = [3, 6]
    tokens = [[2, 5], [7, 1], [4, 4]]

    def steps(step_fn):
        outs = []
        for i, ids in enumerate(tokens):
            lengths = [n + i for n in start_lengths]                   # positions of this step's tokens
            window = [p % SLIDING_WINDOW for p in lengths]
            slots = [int(block_tables[b, w // BLOCK_SIZE]) * BLOCK_SIZE + w % BLOCK_SIZE
                     for b, w in enumerate(window)]
            seqlen = Seqlen(torch.tensor([p + 1 for p in lengths], dtype=torch.int32, device=device),
                            torch.zeros(BATCH, dtype=torch.int32, device=device), variant)
            outs.append(step_fn(input_ids=torch.tensor(ids, device=device),
                                position_ids=torch.tensor(lengths, dtype=torch.int32, device=device),
                                block_tables=block_tables, slots=torch.tensor(slots, device=device),
                                seqlen=seqlen, max_s=max(lengths) + 1).clone())
        return outs

    def eager():
        kv_cache = (k0.clone(), v0.clone())
        return steps(lambda **kw: model.forward(kv_cache=kv_cache, **kw))

    def served():
        kv_cache = (k0.clone(), v0.clone())
        wrapper = GraphWrapper.trace(model, device, kv_cache, MAX_TOTAL_TOKENS, SLIDING_WINDOW_BLOCKS, variant)
        return steps(lambda **kw: wrapper.forward(kv_cache=kv_cache, **kw))

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
