"""The FlashInfer graphs' ragged block table is sized from dummy ``input_lengths = ones``: too small for a live decode step.

Upstream: https://github.com/predibase/lorax/pull/633 ("Fix FlashInfer when not using prefix caching", merged as
d513ee80; the graph part is branch commit 88b05a13 "Fix flashinfer with CUDA graphs").
Symptom: with FlashInfer attention and CUDA graphs (``--compile``), the first graphed decode step crashes in
``GraphWrapper.forward`` on the block-table copy (a size mismatch), as soon as the batch's sequences hold more
tokens in total than the graph's batch size; eager decode works.
Mechanism: ``GraphWrapper.trace`` builds its static state from ``get_max_graph_state(device, adapter_layers,
max_total_tokens)``, whose dummy ``input_lengths = torch.ones((MAX_BATCH_SIZE,))``. Under ``FLASH_INFER`` (page
size 1) the captured block table is ``block_tables_to_ragged(block_tables=..., input_lengths=input_lengths.tolist(),
prefix_lens=...)``, which allocates ``torch.empty(sum(input_lengths) + sum(prefix_lens))``: ``batch_size`` entries.
That tensor is ``input_state.block_tables`` and the ``paged_kv_indices_buffer`` of the graph's
``BatchDecodeWithPagedKVCacheWrapper`` (``create_decode_state_cuda_graphs``); the captured attention gathers K/V
through it. At replay ``forward`` rebuilds the ragged table from the live lengths (one entry per cached token of
every sequence) and assigns ``self.input_state.block_tables[: block_tables.shape[0]] = block_tables``: the slice
clips to ``batch_size`` entries and the assignment fails.
Doctor: undersized-buffer, at get_max_graph_state (its dummy lengths of 1 size the static ragged block table for
one KV entry per sequence; live decode steps carry their whole context).
Fix (upstream): ``get_max_graph_state`` uses ``input_lengths = torch.full((MAX_BATCH_SIZE,), max_total_tokens)``,
so the ragged buffer holds ``batch_size * max_total_tokens`` entries (plus, not modelled: an info log when
``can_use_graph`` refuses a batch, and rank 96 dropped from ``CACHED_MAX_RANKS``).
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/predibase/lorax/pull/633"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "get_max_graph_state"
SYMPTOM = "graphed FlashInfer decode crashes copying the live ragged block table into a batch_size-entry buffer"

VOCAB, DIM = 8, 4
BLOCK_SIZE = 1                      # FlashInfer: page size 1, one block table entry per token
MAX_BATCH_SIZE = 4
MAX_TOTAL_TOKENS = 8
NUM_SLOTS = MAX_BATCH_SIZE * MAX_TOTAL_TOKENS
SLOT_PAD_VALUE = -1                 # the cache write skips these slots
PROMPT_LENS = [3, 5, 2, 4]
DECODE_STEPS = 3
_decode_state = None                # flashinfer_attention.decode_state (a ContextVar upstream)


@dataclasses.dataclass
class GraphState:
    input_ids: torch.Tensor
    block_tables: torch.Tensor
    slots: torch.Tensor
    input_lengths: torch.Tensor
    prefix_lens: list
    state: object = None


def get_max_graph_state(device, max_total_tokens: int, variant: str) -> GraphState:
    max_num_blocks = (max_total_tokens + BLOCK_SIZE - 1) // BLOCK_SIZE
    block_tables = torch.zeros((MAX_BATCH_SIZE, max_num_blocks), dtype=torch.int32, device=device)
    input_ids = torch.zeros((MAX_BATCH_SIZE,), dtype=torch.int64, device=device)
    slots = torch.full((MAX_BATCH_SIZE,), SLOT_PAD_VALUE, dtype=torch.int64, device=device)
    if variant == "fix":
        input_lengths = torch.full((MAX_BATCH_SIZE,), max_total_tokens, dtype=torch.int32, device=device)
    else:
        input_lengths = torch.ones((MAX_BATCH_SIZE,), dtype=torch.int32, device=device)
    return GraphState(input_ids, block_tables, slots, input_lengths, [0] * MAX_BATCH_SIZE)


def block_tables_to_ragged(*, block_tables, input_lengths, prefix_lens):
    """Convert block table to ragged format compatible with FlashInfer."""
    total_len = sum(input_lengths) + sum(prefix_lens)
    block_tables_ragged = torch.empty(total_len, dtype=torch.int32, device=block_tables.device)
    offset = 0
    for i, (input_length, prefix_len) in enumerate(zip(input_lengths, prefix_lens)):
        seq_len = prefix_len + input_length
        block_tables_ragged[offset: offset + seq_len] = block_tables[i][:seq_len]
        offset += seq_len
    return block_tables_ragged


class BatchDecodeWithPagedKVCacheWrapper:
    def __init__(self, use_cuda_graph=False, paged_kv_indices_buffer=None, paged_kv_indptr_buffer=None):
        self.use_cuda_graph = use_cuda_graph
        self._paged_kv_indices_buf, self._paged_kv_indptr_buf = paged_kv_indices_buffer, paged_kv_indptr_buffer

    def begin_forward(self, indptr, indices):
        if self.use_cuda_graph:
            if len(indices) > len(self._paged_kv_indices_buf):
                raise ValueError("The size of indices should be less than or equal to the allocated buffer")
            self._paged_kv_indptr_buf.copy_(indptr)
            self._paged_kv_indices_buf[: len(indices)].copy_(indices)
        else:
            self._paged_kv_indptr_buf, self._paged_kv_indices_buf = indptr, indices


@contextlib.contextmanager
def use_decode_state(*, state, input_lengths, block_tables):
    global _decode_state
    indptr = torch.zeros(input_lengths.shape[0] + 1, device=input_lengths.device, dtype=torch.int32)
    torch.add(input_lengths, BLOCK_SIZE - 1, out=indptr[1:])
    indptr[1:].div_(BLOCK_SIZE, rounding_mode="floor")
    indptr[1:].cumsum_(-1)
    state.begin_forward(indptr=indptr, indices=block_tables)
    _decode_state = state
    try:
        yield
    finally:
        _decode_state = None


def reshape_and_cache(k, v, k_cache, v_cache, slots):
    """Write each row's K/V at its slot; a padded slot (< 0) writes nothing."""
    keep, at = (slots < 0)[:, None], slots.clamp(min=0)
    k_cache.index_copy_(0, at, torch.where(keep, k_cache[at], k))
    v_cache.index_copy_(0, at, torch.where(keep, v_cache[at], v))


class FlashLlamaForCausalLM:
    def __init__(self, device):
        gen = generator(633)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq, self.wk, self.wv = (randn(DIM, DIM, gen=gen, device=device) for _ in range(3))
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device)
        self.kv_cache = (randn(NUM_SLOTS, DIM, gen=gen, device=device), randn(NUM_SLOTS, DIM, gen=gen, device=device))

    def forward(self, input_ids, slots):
        x = self.emb[input_ids]
        q, k, v = x @ self.wq, x @ self.wk, x @ self.wv
        k_cache, v_cache = self.kv_cache
        reshape_and_cache(k, v, k_cache, v_cache, slots)
        state = _decode_state                               # paged_attention: state.forward(q, kv_cache)
        indices, indptr = state._paged_kv_indices_buf.long(), state._paged_kv_indptr_buf
        j = torch.arange(indices.shape[0], device=x.device)[None, :]
        mine = (j >= indptr[:-1, None]) & (j < indptr[1:, None])
        scores = (q @ k_cache[indices].T).masked_fill(~mine, float("-inf"))
        return (x + torch.softmax(scores, -1) @ v_cache[indices]) @ self.lm_head


class GraphWrapper:
    def __init__(self, graph, input_state, output_states):
        self.graph, self.input_state, self.output_states = graph, input_state, output_states

    @staticmethod
    def trace(model, device, batch_size, max_total_tokens, variant):
        max_input_state = get_max_graph_state(device, max_total_tokens, variant)
        input_lengths = max_input_state.input_lengths[:batch_size]
        prefix_lengths = max_input_state.prefix_lens[:batch_size]
        block_tables = block_tables_to_ragged(block_tables=max_input_state.block_tables[:batch_size],
                                              input_lengths=input_lengths.tolist(), prefix_lens=prefix_lengths)
        block_tables_ptr = torch.zeros(batch_size + 1, dtype=torch.int32, device=device)
        state = BatchDecodeWithPagedKVCacheWrapper(True, paged_kv_indices_buffer=block_tables,
                                                   paged_kv_indptr_buffer=block_tables_ptr)
        input_state = GraphState(max_input_state.input_ids[:batch_size], block_tables,
                                 max_input_state.slots[:batch_size], input_lengths, prefix_lengths, state)
        with use_decode_state(state=state, input_lengths=input_state.input_lengths, block_tables=block_tables):
            graph, output_states = capture(
                lambda: model.forward(input_state.input_ids, input_state.slots), device=device, warmups=1,
                name=f"bs {batch_size}", owner="lorax GraphWrapper",
                static={"input_ids": input_state.input_ids, "slots": input_state.slots,
                        "block_tables": block_tables, "block_tables_ptr": block_tables_ptr},
                state={"k_cache": model.kv_cache[0], "v_cache": model.kv_cache[1]})
        return GraphWrapper(graph, input_state, output_states)

    def forward(self, input_ids, slots, block_tables, input_lengths, prefix_lens):
        self.input_state.input_ids.copy_(input_ids)                  # pad_and_fill (a full batch here)
        self.input_state.slots.copy_(slots)
        self.input_state.input_lengths.copy_(input_lengths)
        block_tables = block_tables_to_ragged(block_tables=block_tables, input_lengths=input_lengths.tolist(),
                                              prefix_lens=prefix_lens)
        self.input_state.block_tables[: block_tables.shape[0]] = block_tables
        with use_decode_state(state=self.input_state.state, input_lengths=self.input_state.input_lengths,
                              block_tables=self.input_state.block_tables):
            return replay(self.graph, self.output_states)


def decode_batches(device):
    """Each step: every request appends one token at slot ``r * MAX_TOTAL_TOKENS + length``."""
    block_tables = torch.arange(NUM_SLOTS, dtype=torch.int32).view(MAX_BATCH_SIZE, MAX_TOTAL_TOKENS).to(device)
    for step in range(DECODE_STEPS):
        lengths = [n + step for n in PROMPT_LENS]
        input_ids = torch.tensor([(3 * r + step) % VOCAB for r in range(MAX_BATCH_SIZE)])
        slots = torch.tensor([r * MAX_TOTAL_TOKENS + n for r, n in enumerate(lengths)])
        input_lengths = torch.tensor([n + 1 for n in lengths], dtype=torch.int32)
        yield input_ids.to(device), slots.to(device), block_tables, input_lengths.to(device)


def run(variant: str, device: str = "cpu"):
    def served():
        model = FlashLlamaForCausalLM(device)
        wrapper = GraphWrapper.trace(model, device, MAX_BATCH_SIZE, MAX_TOTAL_TOKENS, variant)
        return [wrapper.forward(ids, slots, bt, lens, [0] * MAX_BATCH_SIZE).clone()
                for ids, slots, bt, lens in decode_batches(device)]

    def eager():
        model, outs = FlashLlamaForCausalLM(device), []
        for ids, slots, bt, lens in decode_batches(device):
            ragged = block_tables_to_ragged(block_tables=bt, input_lengths=lens.tolist(), prefix_lens=[0] * len(lens))
            state = BatchDecodeWithPagedKVCacheWrapper()
            with use_decode_state(state=state, input_lengths=lens, block_tables=ragged):
                outs.append(model.forward(ids, slots))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
