"""With MTP validation flattened to one sequence per token, the ACL graph's persistent per-sequence buffers are still sized for max_seqs_per_batch: a full validate batch does not fit.

Upstream: https://github.com/xLLM-AI/xllm/pull/1030 ("bugfix: adjust acl graph sequence capacity for
speculative modes.", commit bd7372d3b, merged March 2026).
Symptom: none stated in the PR; with speculative decoding (``num_speculative_tokens`` > 0) and ACL graphs, a
validate step of a large batch has more graph "sequences" than the persistent sequence buffers hold, so the
copy into them fails (or, where it fits, the captured views are cut short).
Mechanism: without ``FLAGS_enable_atb_spec_kernel``, ``SpeculativeWorkerImpl`` builds the validate input as one
decode row per validation token (``row.append_q_len_one``/``append_kv_len``/``append_block_table``), and sets
``input_params.num_sequences = num_sequences * (num_speculative_tokens + 1)``. ``AclGraphExecutorImpl::run``
serves it from the bucket of ``n_tokens``. ``GraphPersistentParam``'s constructor sizes ``q_seq_lens_``,
``kv_seq_lens_`` and ``persistent_block_tables_`` by ``options.max_seqs_per_batch()`` (and ``update()`` sizes
the lazy ``q_cu_seq_lens_`` the same way). ``update()`` then copies the step's per-row metadata into
``q_seq_lens_.slice(0, 0, actual_batch_size)`` with ``actual_batch_size = params.num_sequences``, up to
``max_seqs_per_batch * num_decoding_tokens`` rows: ``slice`` clamps its end to the buffer, and the copy of more
rows than the buffer holds fails (the capture views ``kv_seq_lens(padded_num_tokens)`` are cut short the same way).
Doctor: undersized-buffer, at update (``GraphPersistentParam::update`` copying the validate rows' sequence
lengths into buffers sized for ``max_seqs_per_batch``).
Fix (upstream): ``get_decode_graph_capacity(options)`` returns ``max_seqs_per_batch * num_decoding_tokens``
(just ``max_seqs_per_batch`` with ``FLAGS_enable_atb_spec_kernel``, whose rows are whole sequences), used to
size the persistent sequence buffers in the constructor and the lazy ``q_cu_seq_lens_`` in ``update()``.
(Read: the diff of bd7372d3b, and at its parent ``GraphPersistentParam``, ``AclGraphExecutorImpl::run``,
``get_bucket_num_tokens`` and ``SpeculativeWorkerImpl``'s validate-input builder.) The NPU ACL graph is
modelled as a CUDA graph, the C++ in Python; the model is one paged-attention layer at tiny sizes, and the
batches fill their buckets exactly (no padded rows).
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/xLLM-AI/xllm/pull/1030"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "update"
SYMPTOM = "an MTP validate batch of max_seqs_per_batch sequences does not fit the ACL graph's sequence buffers"

VOCAB, HIDDEN, BLOCK_SIZE, NUM_BLOCKS = 16, 4, 2, 24
MAX_SEQ_LEN = 8                                      # args.max_position_embeddings()
MAX_BLOCK_TABLE_LEN = (MAX_SEQ_LEN + BLOCK_SIZE - 1) // BLOCK_SIZE + 1
FLAGS_max_tokens_per_batch = 16
FLAGS_enable_atb_spec_kernel = False


@dataclasses.dataclass
class Options:
    max_seqs_per_batch: int = 4
    num_decoding_tokens: int = 2                     # num_speculative_tokens + 1 (MTP, one draft token)


@dataclasses.dataclass
class ModelInputParams:
    num_sequences: int
    q_seq_lens: torch.Tensor
    kv_seq_lens: torch.Tensor
    new_cache_slots: torch.Tensor
    block_tables: torch.Tensor


def get_decode_graph_capacity(options: Options) -> int:
    assert options.num_decoding_tokens > 0, "num_decoding_tokens must be > 0 for graph capacity"
    if FLAGS_enable_atb_spec_kernel:
        return options.max_seqs_per_batch
    return options.max_seqs_per_batch * options.num_decoding_tokens


class GraphPersistentParam:
    def __init__(self, options: Options, device, variant):
        max_tokens_per_batch = FLAGS_max_tokens_per_batch
        # num_sequences
        if variant == "bug":
            max_seqs_per_batch = options.max_seqs_per_batch
        else:
            max_seqs_per_batch = get_decode_graph_capacity(options)
        i32 = dict(dtype=torch.int32, device=device)
        self.persistent_tokens_ = torch.zeros(max_tokens_per_batch, **i32)
        self.persistent_positions_ = torch.zeros(max_tokens_per_batch, **i32)
        self.persistent_new_cache_slots_ = torch.zeros(max_tokens_per_batch, **i32)
        # Sequence length tensors with max_seqs_per_batch
        self.q_seq_lens_ = torch.zeros(max_seqs_per_batch, **i32)
        self.kv_seq_lens_ = torch.zeros(max_seqs_per_batch, **i32)
        self.persistent_block_tables_ = torch.zeros(max_seqs_per_batch, MAX_BLOCK_TABLE_LEN, **i32)

    def update(self, tokens, positions, params: ModelInputParams, padded_num_tokens: int,
               return_capture_params: bool):
        actual_num_tokens = tokens.shape[0]
        actual_batch_size = params.num_sequences
        # Copy data from input parameters to persistent graph tensors (slice() clamps its end)
        self.persistent_tokens_[:actual_num_tokens].copy_(tokens, non_blocking=True)
        self.persistent_positions_[:actual_num_tokens].copy_(positions, non_blocking=True)
        self.q_seq_lens_[:actual_batch_size].copy_(params.q_seq_lens, non_blocking=True)
        self.kv_seq_lens_[:actual_batch_size].copy_(params.kv_seq_lens, non_blocking=True)
        self.persistent_new_cache_slots_[:actual_num_tokens].copy_(params.new_cache_slots, non_blocking=True)
        actual_block_table_len = params.block_tables.shape[1]
        self.persistent_block_tables_[:actual_batch_size, :actual_block_table_len].copy_(
            params.block_tables, non_blocking=True)
        if not return_capture_params:
            return None
        return (self.persistent_tokens_[:padded_num_tokens], self.persistent_positions_[:padded_num_tokens],
                ModelInputParams(num_sequences=padded_num_tokens,
                                 q_seq_lens=self.q_seq_lens_[:padded_num_tokens],
                                 kv_seq_lens=self.kv_seq_lens_[:padded_num_tokens],
                                 new_cache_slots=self.persistent_new_cache_slots_[:padded_num_tokens],
                                 block_tables=self.persistent_block_tables_[:padded_num_tokens]))


class CausalLM:
    """Embedding -> one paged-attention decode layer (q_len 1 per row) -> projection."""

    def __init__(self, device):
        gen = generator(1030)
        self.emb = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.pos_emb = randn(MAX_SEQ_LEN, HIDDEN, gen=gen, device=device, scale=0.3)
        self.wq = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.7)
        self.wk = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.7)
        self.wv = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.7)
        self.wo = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.7)
        self.ctx = torch.arange(MAX_SEQ_LEN, device=device)

    def forward(self, tokens, positions, kv_cache, params: ModelInputParams):
        h = self.emb[tokens.long()] + self.pos_emb[positions.long()]
        k_cache, v_cache = kv_cache
        slots = params.new_cache_slots.long()
        k_cache[slots] = h @ self.wk                               # reshape_and_cache
        v_cache[slots] = h @ self.wv
        block_tables = params.block_tables.long()
        ctx_slots = block_tables[:, self.ctx // BLOCK_SIZE] * BLOCK_SIZE + self.ctx % BLOCK_SIZE
        k, v = k_cache[ctx_slots], v_cache[ctx_slots]              # [rows, ctx, HIDDEN]
        scores = (k @ (h @ self.wq)[:, :, None]).squeeze(-1)
        scores = scores.masked_fill(self.ctx[None, :] >= params.kv_seq_lens[:, None].long(), -1e9)
        attn = (torch.softmax(scores, -1)[:, :, None] * v).sum(1)
        return (h + attn) @ self.wo


def get_bucket_num_tokens(num_tokens: int) -> int:
    for b in (1, 2, 4, 8):
        if num_tokens <= b:
            return b
    return (num_tokens + 15) // 16 * 16


class AclGraphExecutorImpl:
    def __init__(self, model, options, kv_cache, device, variant):
        self.model, self.kv_cache, self.device = model, kv_cache, device
        self.persistent_param_ = GraphPersistentParam(options, device, variant)
        self.graphs_ = {}

    def run(self, tokens, positions, params: ModelInputParams):
        n_tokens = tokens.shape[0]
        bucket_num_tokens = get_bucket_num_tokens(n_tokens)
        pp = self.persistent_param_
        if bucket_num_tokens in self.graphs_:
            g, out = self.graphs_[bucket_num_tokens]
            pp.update(tokens, positions, params, bucket_num_tokens, return_capture_params=False)
            return replay(g, out)[:n_tokens]
        # lazy capture for this bucket: update persistent params, capture with their views
        cap_tokens, cap_positions, cap_params = pp.update(tokens, positions, params, bucket_num_tokens,
                                                          return_capture_params=True)
        g, out = capture(lambda: self.model.forward(cap_tokens, cap_positions, self.kv_cache, cap_params),
                         device=self.device, warmups=0, name=f"bucket {bucket_num_tokens}",
                         owner="AclGraphExecutorImpl (decode)",
                         static={"tokens": pp.persistent_tokens_, "positions": pp.persistent_positions_,
                                 "new_cache_slots": pp.persistent_new_cache_slots_,
                                 "q_seq_lens": pp.q_seq_lens_, "kv_seq_lens": pp.kv_seq_lens_,
                                 "block_tables": pp.persistent_block_tables_},
                         state={"k_cache": self.kv_cache[0], "v_cache": self.kv_cache[1]})
        self.graphs_[bucket_num_tokens] = (g, out)
        return replay(g, out)[:n_tokens]


def build_validate_input(seqs, draft_tokens, options, device):
    """``SpeculativeWorkerImpl``'s validate input without the ATB spec kernel: one decode row (q_len 1) per
    validation token, each with its own kv length and a copy of its sequence's block table."""
    tokens, positions, kv_lens, slots, tables = [], [], [], [], []
    for (token, kv_len, blocks), draft in zip(seqs, draft_tokens):
        for val_idx in range(options.num_decoding_tokens):
            pos = kv_len - 1 + val_idx
            tokens.append(token if val_idx == 0 else draft)
            positions.append(pos)
            kv_lens.append(kv_len + val_idx)
            slots.append(blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            tables.append(blocks)
    i32 = dict(dtype=torch.int32)
    rows = len(tokens)
    params = ModelInputParams(num_sequences=rows,
                              q_seq_lens=torch.ones(rows, **i32).to(device),
                              kv_seq_lens=torch.tensor(kv_lens, **i32).to(device),
                              new_cache_slots=torch.tensor(slots, **i32).to(device),
                              block_tables=torch.tensor(tables, **i32).to(device))
    return torch.tensor(tokens, **i32).to(device), torch.tensor(positions, **i32).to(device), params


def run(variant: str, device: str = "cpu"):
    options = Options()
    # (last token, kv_len incl. it, blocks); block 0 is never handed out
    blocks = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]]
    schedule = [  # validate steps: 2 sequences (4 rows, bucket 4), then a full batch of 4 (8 rows, bucket 8)
        ([(3, 2, blocks[0]), (7, 3, blocks[1])], [5, 9]),
        ([(5, 3, blocks[0]), (9, 4, blocks[1])], [11, 2]),
        ([(11, 4, blocks[0]), (2, 5, blocks[1]), (4, 2, blocks[2]), (6, 3, blocks[3])], [1, 8, 12, 14]),
        ([(1, 5, blocks[0]), (8, 6, blocks[1]), (12, 3, blocks[2]), (14, 4, blocks[3])], [3, 10, 13, 15]),
    ]
    gen = generator(7)
    prefill_k = randn(NUM_BLOCKS * BLOCK_SIZE, HIDDEN, gen=gen, device=device)
    prefill_v = randn(NUM_BLOCKS * BLOCK_SIZE, HIDDEN, gen=gen, device=device)
    model = CausalLM(device)

    def serve(graphed: bool):
        kv_cache = (prefill_k.clone(), prefill_v.clone())
        executor = AclGraphExecutorImpl(model, options, kv_cache, device, variant) if graphed else None
        outs = []
        for seqs, drafts in schedule:
            tokens, positions, params = build_validate_input(seqs, drafts, options, device)
            if graphed:
                outs.append(executor.run(tokens, positions, params).clone())
            else:
                outs.append(model.forward(tokens, positions, kv_cache, params).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
