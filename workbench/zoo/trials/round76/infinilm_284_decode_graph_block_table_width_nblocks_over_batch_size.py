"""InfiniLM's paged decode graph for batch size b captured a block table only ``nblocks / b`` columns wide: one long request in the batch breaks the graph step.

Upstream: https://github.com/InfiniTensor/InfiniLM/pull/284 ("Issue/282: fix bad shape while --enable-graph && OOM
Exit mechanism", merged 2026-04-07; the graph part is commit ef68739a "fix bad shape while --enable-graph and exit at
unexpected oom", 2026-03-30), for issue InfiniTensor/InfiniLM#282.
Symptom: serving with ``--enable-graph`` (paged KV cache), a decode step whose batch of b requests holds one long
request fails with "Invalid slice on tensor." / a bad shape as soon as that request's block count exceeds
``num_blocks / b``; the same batch runs fine without graphs.
Mechanism: ``PagedCompiler::compile()`` (csrc/engine/compiler/paged_compiler.cpp) allocated one
``block_tables_holder_`` of ``nblocks`` int32 (the KV pool's block count) shared by every decode batch size, and for
each ``b`` in ``decode_batch_sizes_`` recorded the decode forward on ``block_tables_holder_->as_strided({b,
nblocks / b}, {nblocks / b, 1})``: the captured block table gets narrower as the batch grows, and its width is
frozen into the graph. At request time ``PagedCompiler::get_compiled()`` copies the live inputs into the recorded
ones with ``graph_input.block_tables->narrow({{1, 0, block_per_req}})->copy_from(input.block_tables)``, where
``block_per_req`` is the live table's width, the scheduler's ``max(len(req.block_table))`` over the batch (shorter
rows padded with -1). Blocks are shared by all requests, so one request can hold far more than ``nblocks / b``
blocks while the batch still fits the pool; then the narrow asks for more columns than the captured table has and
InfiniCore's ``TensorImpl::narrow`` throws. The eager ``model_->forward`` takes the live ``[b, block_per_req]``
table as it is and has no such limit. (Second, smaller part: the columns past the live width kept the block ids a
previous replay -- of any batch size's graph, the holder being shared -- had put there.)
Doctor: undersized-buffer, at ``compile`` (it sizes each decode graph's captured block table to ``nblocks / b``
columns, and replays are then asked to serve more block columns than were captured).
Fix (upstream): the holder becomes ``nblocks * max_batch_size`` and every graph captures the full width
(``const size_t block_per_req = nblocks;``); ``get_compiled()`` returns ``{nullptr, nullptr}`` (eager fallback) when
the live width exceeds the compiled width, and resets the whole graph table to -1 (``set_minus_one``) before copying
the live table into its first ``block_per_req`` columns, matching the scheduler's padding.
Modelled: one decoder layer (embedding + position embedding, one attention head, LM head) over a paged KV cache of 8
blocks of 2 tokens; ``decode_batch_sizes_`` = 1..4 (upstream 1..31, then steps up to 512). The recorded forward is a
graph captured after ``Graph::instantiate``'s 5 eager warm-ups on the placeholder inputs; attention metadata is passed
with the input instead of through the thread-local forward context; ``input_offsets`` / ``cu_seqlens`` (trivial for
decode), sampling, tensor parallelism and the barrier are left out, and the step's logits are compared. The paged
attention kernel dereferences a request's block ids only for positions below its total sequence length, as the
real kernel does, so -1 padding is never dereferenced. The KV cache is filled with the prompts' K/V after
``compile()`` (the warm-ups write into slot 0), the same in both modes.
"""
from __future__ import annotations

import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/InfiniTensor/InfiniLM/pull/284"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "compile"
SYMPTOM = ("--enable-graph paged decode: a batch of b requests with one request holding more than num_blocks / b "
           "KV blocks fails with a bad shape ('Invalid slice on tensor.') in get_compiled; eager is fine")

VOCAB, HIDDEN, MAX_POS = 16, 8, 16
NUM_BLOCKS, BLOCK_SIZE = 8, 2            # PagedKVCacheConfig: num_blocks(), block size
DECODE_BATCH_SIZES = [1, 2, 3, 4]
I32, I64 = torch.int32, torch.int64


# --- csrc/models/*: a one-layer decoder over the paged KV cache ------------------------------------------------

class Input:
    """InfinilmModel::Input (decode subset)."""

    def __init__(self, input_ids, position_ids, total_sequence_lengths, block_tables, slot_mapping):
        self.input_ids, self.position_ids = input_ids, position_ids
        self.total_sequence_lengths, self.block_tables, self.slot_mapping = (total_sequence_lengths, block_tables,
                                                                             slot_mapping)


def paged_attention(q, k_cache, v_cache, block_tables, total_sequence_lengths):
    """Decode attention: request i attends over its tokens [0, total_sequence_lengths[i]) found through its row of
    the block table; block ids of positions past the sequence (padding) are never dereferenced."""
    width = block_tables.shape[1]
    t = torch.arange(width * BLOCK_SIZE, device=q.device)
    valid = t[None, :] < total_sequence_lengths[:, None].to(I64)                       # [b, T]
    blk = torch.where(valid, block_tables[:, t // BLOCK_SIZE].to(I64), torch.zeros_like(valid, dtype=I64))
    slots = blk * BLOCK_SIZE + t % BLOCK_SIZE
    k, v = k_cache[slots], v_cache[slots]                                              # [b, T, H]
    scores = torch.einsum("bh,bth->bt", q, k) / math.sqrt(HIDDEN)
    p = torch.softmax(scores.masked_fill(~valid, -1e9), -1)
    return torch.einsum("bt,bth->bh", p, v)


class InfinilmModel:
    def __init__(self, device):
        gen = generator(284)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.pos_embed = randn(MAX_POS, HIDDEN, gen=gen, device=device, scale=0.5)
        self.wq, self.wk, self.wv, self.wo = (randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
                                              for _ in range(4))
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.5)
        # the paged KV cache: [num_blocks * block_size, hidden] per K / V
        self.k_cache = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, HIDDEN, device=device)
        self.v_cache = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, HIDDEN, device=device)

    def forward(self, input):
        h = self.embed[input.input_ids[0].to(I64)] + self.pos_embed[input.position_ids.to(I64)]
        q, k, v = h @ self.wq, h @ self.wk, h @ self.wv
        self.k_cache.index_copy_(0, input.slot_mapping, k)                               # the new token's K/V
        self.v_cache.index_copy_(0, input.slot_mapping, v)
        attn = paged_attention(q, self.k_cache, self.v_cache, input.block_tables, input.total_sequence_lengths)
        h = h + torch.tanh(attn @ self.wo)
        return (h @ self.lm_head)[None]                                                  # logits [1, b, vocab]


# --- csrc/engine/compiler/paged_compiler.cpp -----------------------------------------------------------------

def set_zeros(tensor):
    tensor.zero_()


def set_minus_one(tensor):
    # For int32 tensors, 0xFF bytes correspond to -1 in two's complement.
    tensor.fill_(-1)


class CompiledResult:
    def __init__(self, input, compiled):
        self.input, self.compiled = input, compiled


class PagedCompiler:
    def __init__(self, model, device, variant):
        self.model_, self.device, self.variant = model, device, variant
        self.decode_batch_sizes_ = list(DECODE_BATCH_SIZES)
        self.compiled_map_decode_ = {}
        self.block_tables_holder_ = None

    def compile(self):
        nblocks = NUM_BLOCKS
        max_batch_size = max(self.decode_batch_sizes_)
        self.compiled_map_decode_.clear()
        if self.variant == "bug":
            self.block_tables_holder_ = torch.empty(nblocks, dtype=I32, device=self.device)   # ONE holder, nblocks
        else:
            self.block_tables_holder_ = torch.empty(nblocks * max_batch_size, dtype=I32, device=self.device)
        set_zeros(self.block_tables_holder_)
        for b in self.decode_batch_sizes_:
            input_ids = torch.zeros(1, b, dtype=I64, device=self.device)
            position_ids = torch.zeros(b, dtype=I64, device=self.device)
            total_sequence_lengths = torch.ones(b, dtype=I32, device=self.device)
            if self.variant == "bug":
                block_per_req = nblocks // b          # the captured table narrows as the batch grows
            else:
                block_per_req = nblocks
            block_tables = self.block_tables_holder_.as_strided((b, block_per_req), (block_per_req, 1))
            slot_mapping = torch.zeros(b, dtype=I64, device=self.device)
            input = Input(input_ids, position_ids, total_sequence_lengths, block_tables, slot_mapping)

            # startGraphRecording(); model_->forward(input); stopGraphRecording() -> Graph::instantiate():
            # 5 warm-up runs of the recorded ops, then the device capture
            graph, logits = capture(
                lambda input=input: self.model_.forward(input), device=self.device, warmups=5,
                name=f"paged decode b={b}", owner="PagedCompiler",
                static={"input_ids": input_ids, "position_ids": position_ids,
                        "total_sequence_lengths": total_sequence_lengths, "block_tables": block_tables,
                        "slot_mapping": slot_mapping},
                state={"k_cache": self.model_.k_cache, "v_cache": self.model_.v_cache})
            self.compiled_map_decode_[b] = CompiledResult(input, (graph, logits))

    def get_compiled(self, input):
        """Copy the live inputs into the recorded ones; (None, None, _) sends the step to eager."""
        batch_size = input.block_tables.shape[0]
        block_per_req = input.block_tables.shape[1]
        if batch_size != input.input_ids.shape[1]:                   # only decode-only batches
            return None, None, None
        result = self.compiled_map_decode_.get(batch_size)
        if result is None:
            return None, None, None
        graph_input = result.input
        graph_input.input_ids.copy_(input.input_ids)
        graph_input.position_ids.copy_(input.position_ids)
        graph_input.total_sequence_lengths.copy_(input.total_sequence_lengths)
        padded_columns = None
        if self.variant == "fix":
            compiled_block_per_req = graph_input.block_tables.shape[1]
            if block_per_req > compiled_block_per_req:
                # Runtime width exceeds compiled graph slot; fall back to eager path.
                return None, None, None
            # Initialize full padding to -1, then overwrite the narrowed logical region.
            set_minus_one(graph_input.block_tables)
        elif block_per_req < graph_input.block_tables.shape[1]:
            # the columns past the live width keep whatever an earlier replay left there
            padded_columns = {"block_tables": (graph_input.block_tables, block_per_req)}
        # TensorImpl::narrow throws "Invalid slice on tensor." when block_per_req exceeds the captured width
        graph_input.block_tables.narrow(1, 0, block_per_req).copy_(input.block_tables)
        graph_input.slot_mapping.copy_(input.slot_mapping)
        graph, logits = result.compiled
        return graph, logits, padded_columns


# --- csrc/engine/rank_worker.cpp (Command::RUN) and python/infinilm/llm/scheduler.py --------------------------

class RankWorker:
    def __init__(self, device, variant, enable_graph):
        self.device = device
        self.model_ = InfinilmModel(device)
        self.compiler_ = PagedCompiler(self.model_, device, variant) if enable_graph else None
        if self.compiler_ is not None:
            self.compiler_.compile()

    def run(self, input):
        logits = None
        if self.compiler_ is not None:
            graph, output, padded_columns = self.compiler_.get_compiled(input)
            if graph is not None and output is not None:
                logits = replay(graph, output, padded_columns=padded_columns)
        if logits is None:                                             # fall back to eager mode
            logits = self.model_.forward(input)
        return logits.clone()


def build_model_inputs(batch, block_tables_of, device):
    """Scheduler, decode phase: last token per request, its slot, block tables padded with -1 to the longest."""
    tokens, positions, seq_lens, slots, tables = [], [], [], [], []
    for rid, seq_len, token in batch:
        table = block_tables_of[rid][:-(-seq_len // BLOCK_SIZE)]       # the blocks allocated so far
        pos = seq_len - 1
        tokens.append(token)
        positions.append(pos)
        seq_lens.append(seq_len)
        slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        tables.append(table)
    width = max(len(t) for t in tables)
    tables = [t + [-1] * (width - len(t)) for t in tables]
    return Input(torch.tensor([tokens], dtype=I64, device=device), torch.tensor(positions, dtype=I64, device=device),
                 torch.tensor(seq_lens, dtype=I32, device=device), torch.tensor(tables, dtype=I32, device=device),
                 torch.tensor(slots, dtype=I64, device=device))


# --- the workload --------------------------------------------------------------------------------------------------

# Each request's KV blocks (8 in the pool; R0 is the long one).
BLOCK_TABLES = {0: [0, 1, 2], 1: [3, 6], 2: [4], 3: [5]}
# Decode steps: (request, total sequence length incl. the new token, the new token).
STEPS = [
    [(1, 2, 3), (2, 1, 7), (3, 2, 11)],                 # b=3, width 1 (graph width 8 // 3 = 2)
    [(0, 5, 2), (1, 3, 5), (2, 2, 9), (3, 1, 4)],       # b=4, width 3 > 8 // 4 = 2: the long request R0
    [(0, 6, 13), (1, 4, 1)],                            # b=2, width 3 (graph width 4)
]


def run(variant: str, device: str = "cpu"):
    gen = generator(2820)
    prompt_k = randn(NUM_BLOCKS * BLOCK_SIZE, HIDDEN, gen=gen, device=device)
    prompt_v = randn(NUM_BLOCKS * BLOCK_SIZE, HIDDEN, gen=gen, device=device)

    def serve(enable_graph: bool):
        worker = RankWorker(device, variant, enable_graph)
        worker.model_.k_cache.copy_(prompt_k)           # the prompts' prefill (after compile's warm-ups)
        worker.model_.v_cache.copy_(prompt_v)
        return [worker.run(build_model_inputs(batch, BLOCK_TABLES, device)) for batch in STEPS]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
