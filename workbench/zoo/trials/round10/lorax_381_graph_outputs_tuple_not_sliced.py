"""The graph wrapper slices the tuple of outputs instead of each output: padded logits reach the sampler.

Upstream: https://github.com/predibase/lorax/pull/381 ("Fix CUDA graph compile with speculative decoding",
commit 1d6a745d).
Symptom: LoRAX with ``--compile`` (CUDA graphs), after the adapter refactor that added speculative decoding
(Medusa) heads (#359): decode steps served by a graph fail or return garbage: a one-request batch fails to
unpack the model output, and a batch that is padded to a larger graph (three requests on the graph of
four) gets one next token per *graph* row, not per request; eager serving is fine (LoRAX, April 2024).
Mechanism: since #359 every model's ``forward`` returns ``(logits, speculative_logits)``, so the graph's
static outputs, captured at the graph's padded batch size, are a tuple. ``GraphWrapper.forward`` still
treated them as one tensor and returned ``self.output_states[: input_ids.shape[0]]``: that slices the
*tuple*, not the rows. For three requests on the size-4 graph it hands back the whole tuple, logits of all
four graph rows (the padded row included); ``generate_token`` feeds them to the next-token chooser with the
batch's three requests, whose repetition penalty and argmax run at four rows.
Doctor: padded-shape-mismatch, at ``forward`` (``GraphWrapper.forward``: outputs of the graph's padded
size are combined, in the sampler, with tensors sized for the real requests).
Fix (upstream): annotate ``output_states`` as ``Tuple[Tensor, Optional[Tensor]]`` and slice each element:
``tuple(state[:bs] if state is not None else None for state in self.output_states)``. (The same PR also
grew the static block table and the warmup's ``max_total_tokens`` by the speculative tokens; not modelled.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/predibase/lorax/pull/381"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "forward"
SYMPTOM = "three requests on the size-4 graph get four next tokens: the sampler runs on the padded logits"
VOCAB, DIM, BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS, SPECULATIVE_TOKENS = 8, 4, 2, 10, 3, 2
CACHED_BATCH_SIZES = [1, 2, 4]
SLOT_PAD_VALUE = -1


def get_cached_batch_size(batch_size: int) -> int:
    return next(b for b in CACHED_BATCH_SIZES if b >= batch_size)


def pad_and_fill(dest: torch.Tensor, src: torch.Tensor, pad_value: int):
    dest[: src.shape[0]] = src
    dest[src.shape[0]:].fill_(pad_value)


@dataclass
class GraphState:
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    block_tables: torch.Tensor
    slots: torch.Tensor
    input_lengths: torch.Tensor


def get_max_graph_state(device) -> GraphState:
    max_batch_size = CACHED_BATCH_SIZES[-1]
    return GraphState(
        input_ids=torch.zeros(max_batch_size, dtype=torch.int64, device=device),
        position_ids=torch.zeros(max_batch_size, dtype=torch.int64, device=device),
        block_tables=torch.zeros(max_batch_size, MAX_BLOCKS, dtype=torch.int64, device=device),
        slots=torch.full((max_batch_size,), SLOT_PAD_VALUE, dtype=torch.int64, device=device),
        input_lengths=torch.ones(max_batch_size, dtype=torch.int64, device=device),
    )


class FlashLlamaForCausalLM:
    """One layer over a paged KV cache, then ``SpeculativeHead``: the LM head and the Medusa heads."""

    def __init__(self, device):
        gen = generator(381)
        self.embed_tokens = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq, self.wk, self.wv = (randn(DIM, DIM, gen=gen, device=device, scale=0.5) for _ in range(3))
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)
        self.medusa = randn(SPECULATIVE_TOKENS, DIM, VOCAB, gen=gen, device=device, scale=0.5)

    def forward(self, input_ids, position_ids, kv_cache, block_tables, slots, input_lengths, max_s):
        h = self.embed_tokens[input_ids]
        key_cache, value_cache = kv_cache
        scratch = key_cache.shape[0] - 1                     # padded slots (-1) write a scratch row
        idx = torch.where(slots < 0, torch.full_like(slots, scratch), slots)
        key_cache[idx] = h @ self.wk
        value_cache[idx] = h @ self.wv
        pos = torch.arange(MAX_BLOCKS * BLOCK_SIZE, device=h.device)
        cache_slots = block_tables[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        scores = (key_cache[cache_slots] @ (h @ self.wq)[:, :, None]).squeeze(-1) / math.sqrt(DIM)
        scores = scores.masked_fill(pos[None, :] >= input_lengths[:, None], -1e4)
        hidden = h + (torch.softmax(scores, -1)[:, :, None] * value_cache[cache_slots]).sum(1)
        logits = hidden @ self.lm_head
        speculative_logits = torch.einsum("bd,kdv->bkv", hidden, self.medusa)
        return logits, speculative_logits


class GraphWrapper:
    def __init__(self, graph, input_state: GraphState,
                 output_states: Tuple[torch.Tensor, Optional[torch.Tensor]], variant: str):
        self.graph, self.input_state, self.output_states, self.variant = graph, input_state, output_states, variant

    @staticmethod
    def trace(model, device, kv_cache, max_input_state: GraphState, batch_size: int, pool, variant: str):
        input_state = GraphState(*(t[:batch_size] for t in (
            max_input_state.input_ids, max_input_state.position_ids, max_input_state.block_tables,
            max_input_state.slots, max_input_state.input_lengths)))
        graph, output_states = capture(
            lambda: model.forward(input_state.input_ids, input_state.position_ids, kv_cache,
                                  input_state.block_tables, input_state.slots, input_state.input_lengths,
                                  MAX_BLOCKS * BLOCK_SIZE),
            device=device, pool=pool, warmups=0, name=f"decode bs={batch_size}",
            static={"input_ids": input_state.input_ids, "position_ids": input_state.position_ids,
                    "block_tables": input_state.block_tables, "slots": input_state.slots,
                    "input_lengths": input_state.input_lengths},
            state={"key_cache": kv_cache[0], "value_cache": kv_cache[1]}, owner="lorax GraphWrapper")
        return GraphWrapper(graph, input_state, output_states, variant)

    def forward(self, input_ids, position_ids, kv_cache, block_tables, slots, input_lengths, max_s):
        pad_and_fill(self.input_state.input_ids, input_ids, 0)
        pad_and_fill(self.input_state.position_ids, position_ids, 0)
        pad_and_fill(self.input_state.slots, slots, SLOT_PAD_VALUE)
        pad_and_fill(self.input_state.input_lengths, input_lengths, 0)

        self.input_state.block_tables.zero_()
        self.input_state.block_tables[: block_tables.shape[0], : block_tables.shape[1]] = block_tables

        replay(self.graph, self.output_states, real=input_ids.shape[0])

        if self.variant == "bug":
            return self.output_states[: input_ids.shape[0]]
        return tuple(state[: input_ids.shape[0]] if state is not None else None for state in self.output_states)


class GraphCache:
    def __init__(self, model, device, kv_cache, variant):
        self.model, self.device, self.kv_cache, self.variant = model, device, kv_cache, variant
        self.max_input_state = get_max_graph_state(device)
        self.memory_pool = graph_pool_handle(device)
        self.cache = {}

    def forward(self, **kwargs):
        batch_size = get_cached_batch_size(kwargs["input_ids"].shape[0])
        if batch_size not in self.cache:
            self.cache[batch_size] = GraphWrapper.trace(self.model, self.device, self.kv_cache,
                                                        self.max_input_state, batch_size, self.memory_pool,
                                                        self.variant)
        return self.cache[batch_size].forward(**kwargs)


def next_token_chooser(all_input_ids: torch.Tensor, scores: torch.Tensor, speculative_scores, penalty=1.5):
    """``HeterogeneousNextTokenChooser`` (greedy, with repetition penalty): the next token of each row."""
    score = torch.gather(scores, 1, all_input_ids)
    score = torch.where(score < 0, score * penalty, score / penalty)
    scores = scores.scatter(1, all_input_ids, score)
    next_ids = scores.argmax(-1)
    accepted = speculative_scores.argmax(-1) if speculative_scores is not None else None
    return next_ids, accepted


def run(variant: str, device: str = "cpu"):
    model = FlashLlamaForCausalLM(device)
    gen = generator(359)
    k0 = randn(NUM_BLOCKS * BLOCK_SIZE + 1, DIM, gen=gen, device=device)
    v0 = randn(NUM_BLOCKS * BLOCK_SIZE + 1, DIM, gen=gen, device=device)
    block_tables = torch.tensor([[1, 2, 0], [3, 4, 0], [5, 6, 0]], device=device)
    prompt_lengths = [3, 2, 3]
    first_ids = [[4, 1, 6], [2, 5, 0], [7, 3, 0]]                 # the prompts (all_input_ids rows)

    def generate(forward):
        outs = []
        ids = torch.tensor([5, 2, 6], device=device)
        all_input_ids = torch.tensor(first_ids, device=device)
        lengths = list(prompt_lengths)
        for n in (3, 3, 2):                                       # the third request finished after two steps
            positions = [lengths[b] for b in range(n)]
            slots = [int(block_tables[b, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
                     for b, p in enumerate(positions)]
            out, speculative_logits = forward(
                input_ids=ids[:n], position_ids=torch.tensor(positions, device=device),
                block_tables=block_tables[:n], slots=torch.tensor(slots, device=device),
                input_lengths=torch.tensor([p + 1 for p in positions], device=device),
                max_s=max(positions) + 1)
            next_ids, accepted = next_token_chooser(all_input_ids[:n], out, speculative_logits)
            outs += [next_ids.clone(), accepted.clone()]
            ids = next_ids[:n].clone()
            lengths = [x + 1 for x in lengths]
        return outs

    def eager():
        kv_cache = (k0.clone(), v0.clone())
        return generate(lambda **kw: model.forward(kv_cache=kv_cache, **kw))

    def served():
        kv_cache = (k0.clone(), v0.clone())
        cache = GraphCache(model, device, kv_cache, variant)
        return generate(lambda **kw: cache.forward(kv_cache=kv_cache, **kw))

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
