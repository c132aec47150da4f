"""MLU graph MTP validation: the persistent cumulative seq-lens buffers are sized without the graph's padding rows.

Upstream: https://github.com/xLLM-AI/xllm/pull/1977 ("bugfix: fix mtp graph sequence length capacity and mtp
broadcast.", commit 91a4ed9c4).
Symptom: with MTP speculative decoding and MLU graphs, a full validation batch (``max_seqs_per_batch`` requests,
``num_speculative_tokens + 1`` rows each) fails in the graph executor: the cumulative ``q_seq_lens`` /
``kv_seq_lens`` of the padded bucket do not fit their persistent buffers (the regression test
``MtpSeqLensCapacityIncludesGraphPadding``: 8 requests x 3 rows = 24 rows, padded to the 32-token bucket, need
33 cumulative entries; the buffers held 25). Smaller batches, whose bucket still fits, work.
Mechanism: ``GraphPersistentParam``'s constructor sized ``q_seq_lens_`` and ``kv_seq_lens_`` with
``get_seq_lens_capacity(options) = max_seqs_per_batch * (num_speculative_tokens + 1) + 1``: one entry per real
validation row plus the terminal offset. The MLU graph runs a *bucket* of rows (``get_bucket_num_tokens``: 1, 2,
4, 8, 16, ...), and ``update_input_buffer`` extends the host cumulative vectors by one entry per padding row
(``back() + num_decoding_tokens_``) before copying them into the persistent buffers. For the largest batch the
bucket exceeds the real row count, so ``rows_in_bucket + 1`` entries are copied into a buffer of
``real_rows + 1``: the slice ``q_seq_lens_.slice(0, 0, n)`` is silently clamped to the buffer and the copy fails.
(The token-row buffers were already sized by ``get_graph_token_capacity``, the bucket of the largest batch.)
Doctor: undersized-buffer, at ``update_input_buffer`` (the padded bucket's cumulative seq lens copied into
persistent buffers sized for the real rows only).
Fix (upstream): size the cumulative seq-lens buffers from the graph token capacity,
``max_seq_lens = graph_tokens_capacity + 1`` ("cumulative offsets for graph token rows, including the terminal
offset"), and drop ``get_seq_lens_capacity``. (The same PR also broadcasts speculative tokens across TP ranks
without ``enable_schedule_overlap``; that part is not modelled.)
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/xLLM-AI/xllm/pull/1977"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "update_input_buffer"
SYMPTOM = "a full MTP validation batch padded to its graph bucket overflows the persistent cumulative seq-lens buffers"

VOCAB, DIM, BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS = 16, 4, 4, 8, 3
MAX_SEQS_PER_BATCH, NUM_SPECULATIVE_TOKENS = 2, 2
NUM_DECODING_TOKENS = NUM_SPECULATIVE_TOKENS + 1
MAX_TOKENS_PER_BATCH = 8
RESERVED_BLOCK = 0                       # block 0 is never handed to a request: padded rows write there


def get_bucket_num_tokens(num_tokens: int) -> int:
    """bucket will be [1, 2, 4, 8, 16, 32, 48, 64, ...]"""
    for bucket in (1, 2, 4, 8):
        if num_tokens <= bucket:
            return bucket
    return (num_tokens + 15) // 16 * 16


def get_graph_token_capacity() -> int:
    """Rows of the largest graph: the bucket of ``max_seqs_per_batch * num_decoding_tokens``."""
    return get_bucket_num_tokens(MAX_SEQS_PER_BATCH * NUM_DECODING_TOKENS)


def get_seq_lens_capacity() -> int:
    """The pre-fix capacity: one cumulative entry per real validation row, plus the terminal offset."""
    return MAX_SEQS_PER_BATCH * max(1, NUM_SPECULATIVE_TOKENS + 1) + 1


@dataclasses.dataclass
class ModelInputParams:
    """What the worker hands the executor for one step: MTP validation expands each request's
    ``num_decoding_tokens`` rows into sequences of one query token each."""
    q_seq_lens: list[int]                # host cumulative offsets, one entry per sequence + 1
    kv_seq_lens: list[int]
    new_cache_slots: torch.Tensor
    block_tables: torch.Tensor


class Model:
    def __init__(self, device):
        gen = generator(1977)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos_emb = randn(MAX_BLOCKS * BLOCK_SIZE, DIM, gen=gen, device=device, scale=0.3)
        self.wq = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.wk = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.wv = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.wo = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.ctx_pos = torch.arange(MAX_BLOCKS * BLOCK_SIZE, device=device)


def reshape_paged_cache(key, value, k_cache, v_cache, new_cache_slots):
    k_cache[new_cache_slots] = key
    v_cache[new_cache_slots] = value


def batch_decode_attention(model, query, k_cache, v_cache, block_tables, kv_cu_seq_lens):
    """Varlen paged attention, one query row per sequence: sequence ``i`` reads its first
    ``kv_cu_seq_lens[i + 1] - kv_cu_seq_lens[i]`` cached tokens through its block-table row."""
    kv_lens = kv_cu_seq_lens[1:] - kv_cu_seq_lens[:-1]
    pos = model.ctx_pos
    slots = block_tables[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    k, v = k_cache[slots], v_cache[slots]                              # [rows, ctx, DIM]
    scores = (k @ query[:, :, None]).squeeze(-1)
    scores = scores.masked_fill(pos[None, :] >= kv_lens[:, None], -1e9)
    return (torch.softmax(scores, -1)[:, :, None] * v).sum(1)


def forward(model, tokens, positions, k_cache, v_cache, new_cache_slots, block_tables, kv_cu_seq_lens):
    h = model.emb[tokens] + model.pos_emb[positions]
    reshape_paged_cache(h @ model.wk, h @ model.wv, k_cache, v_cache, new_cache_slots)
    return batch_decode_attention(model, h @ model.wq, k_cache, v_cache, block_tables, kv_cu_seq_lens) @ model.wo


class GraphPersistentParam:
    def __init__(self, device, variant):
        graph_tokens_capacity = get_graph_token_capacity()
        if variant == "fix":
            # Sequence lengths are cumulative offsets for graph token rows, including the terminal offset.
            max_seq_lens = graph_tokens_capacity + 1
        else:
            max_seq_lens = get_seq_lens_capacity()
        i32 = dict(dtype=torch.long, device=device)
        self.output_ = torch.zeros(MAX_TOKENS_PER_BATCH, DIM, device=device)
        self.tokens_ = torch.zeros(MAX_TOKENS_PER_BATCH, **i32)
        self.positions_ = torch.zeros(MAX_TOKENS_PER_BATCH, **i32)
        self.new_cache_slots_ = torch.zeros(MAX_TOKENS_PER_BATCH, **i32)
        self.block_table_ = torch.zeros(graph_tokens_capacity, MAX_BLOCKS, **i32)
        self.q_seq_lens_ = torch.zeros(max_seq_lens, **i32)
        self.kv_seq_lens_ = torch.zeros(max_seq_lens, **i32)
        self.device = device

    def update_input_buffer(self, tokens, positions, params: ModelInputParams, padding_needed: int):
        actual_tokens = tokens.shape[0]
        padded_tokens = actual_tokens + padding_needed
        self.positions_[:actual_tokens].copy_(positions)
        self.tokens_[:actual_tokens].copy_(tokens)
        self.new_cache_slots_[:actual_tokens].copy_(params.new_cache_slots)
        if padding_needed > 0:
            self.positions_[actual_tokens:padded_tokens].zero_()
            self.tokens_[actual_tokens:padded_tokens].zero_()
            self.new_cache_slots_[actual_tokens:padded_tokens].zero_()   # the reserved block's slot 0
        # Generate padded sequence lengths by extending the last valid value
        q_seq_lens_vec, kv_seq_lens_vec = list(params.q_seq_lens), list(params.kv_seq_lens)
        for _ in range(padding_needed):
            q_seq_lens_vec.append(q_seq_lens_vec[-1] + NUM_DECODING_TOKENS)
            kv_seq_lens_vec.append(kv_seq_lens_vec[-1] + NUM_DECODING_TOKENS)
        q_seq_lens = torch.tensor(q_seq_lens_vec, dtype=torch.long).to(self.device)
        kv_seq_lens = torch.tensor(kv_seq_lens_vec, dtype=torch.long).to(self.device)
        self.q_seq_lens_[:q_seq_lens.shape[0]].copy_(q_seq_lens)      # clamped to the buffer's length
        self.kv_seq_lens_[:kv_seq_lens.shape[0]].copy_(kv_seq_lens)
        rows = params.block_tables.shape[0]
        self.block_table_[:rows].copy_(params.block_tables)
        self.block_table_[rows:rows + padding_needed].zero_()


class MluGraphExecutorImpl:
    def __init__(self, model, device, variant, graphed):
        self.model, self.device, self.graphed = model, device, graphed
        self.k_cache = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, DIM, device=device)
        self.v_cache = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, DIM, device=device)
        self.param = GraphPersistentParam(device, variant)
        self.graphs = {}                                   # graph_tokens -> (graph, output)

    def run_eager(self, tokens, positions, params):
        kv_cu = torch.tensor(params.kv_seq_lens, dtype=torch.long).to(self.device)
        return forward(self.model, tokens, positions, self.k_cache, self.v_cache, params.new_cache_slots,
                       params.block_tables, kv_cu).clone()

    def run(self, tokens, positions, params, is_decode):
        if not (self.graphed and is_decode):
            return self.run_eager(tokens, positions, params)
        actual_tokens = tokens.shape[0]
        graph_tokens = get_bucket_num_tokens(actual_tokens)
        padding_needed = graph_tokens - actual_tokens
        p = self.param
        p.update_input_buffer(tokens, positions, params, padding_needed)
        if graph_tokens not in self.graphs:
            n = graph_tokens
            fn = lambda: forward(self.model, p.tokens_[:n], p.positions_[:n], self.k_cache,  # noqa: E731
                                 self.v_cache, p.new_cache_slots_[:n], p.block_table_[:n],
                                 p.kv_seq_lens_[:n + 1])
            self.graphs[n] = capture(
                fn, device=self.device, warmups=0, owner="MluGraphExecutorImpl (MTP validation graph)",
                static={"tokens_": p.tokens_, "positions_": p.positions_, "new_cache_slots_": p.new_cache_slots_,
                        "block_table_": p.block_table_, "kv_seq_lens_": p.kv_seq_lens_},
                state={"k_cache": self.k_cache, "v_cache": self.v_cache})
        g, out = self.graphs[graph_tokens]
        return replay(g, out, real=actual_tokens, size=graph_tokens)[:actual_tokens].clone()


class Request:
    def __init__(self, blocks, prompt):
        self.blocks, self.tokens = blocks, list(prompt)

    def slot(self, pos):
        return self.blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE


def build_step(device, rows):
    """``rows``: (request, token, position) per expanded row; each row is its own one-token sequence."""
    t = lambda xs: torch.tensor(xs, dtype=torch.long).to(device)  # noqa: E731
    q_cu, kv_cu = [0], [0]
    for _, _, pos in rows:
        q_cu.append(q_cu[-1] + 1)
        kv_cu.append(kv_cu[-1] + pos + 1)
    tables = [r.blocks + [RESERVED_BLOCK] * (MAX_BLOCKS - len(r.blocks)) for r, _, _ in rows]
    params = ModelInputParams(q_cu, kv_cu, t([r.slot(pos) for r, _, pos in rows]), t(tables))
    return t([tok for _, tok, _ in rows]), t([pos for _, _, pos in rows]), params


def run(variant: str, device: str = "cpu"):
    model = Model(device)

    def serve(graphed: bool):
        ex = MluGraphExecutorImpl(model, device, variant, graphed)
        A, B = Request([1, 2, 3], [3, 5, 7]), Request([4, 5, 6], [2, 9])
        outs = []

        def prefill(req):
            rows = [(req, tok, i) for i, tok in enumerate(req.tokens)]
            outs.append(ex.run(*build_step(device, rows), is_decode=False))

        def validate(reqs, drafts):
            """MTP validation: the bonus token and ``NUM_SPECULATIVE_TOKENS`` drafts of each request, one row
            each (all accepted, to keep the toy short)."""
            rows = []
            for req, draft in zip(reqs, drafts):
                rows += [(req, tok, len(req.tokens) + j) for j, tok in enumerate(draft)]
            outs.append(ex.run(*build_step(device, rows), is_decode=True))
            for req, draft in zip(reqs, drafts):
                req.tokens += draft

        prefill(A)
        validate([A], [[11, 4, 6]])                    # 3 rows -> the 4-row bucket: fits either way
        prefill(B)
        validate([A, B], [[1, 8, 13], [2, 10, 12]])    # 6 rows -> the 8-row bucket: 9 cumulative entries
        validate([A, B], [[0, 15, 3], [9, 7, 14]])
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
