"""An empty DP rank's DeepSeek-V3.2 capture feeds the indexer an undefined ``q_cu_seq_lens`` (padded ``q_seq_lens``).

Upstream: https://github.com/xLLM-AI/xllm/pull/1739 ("bugfix: fix Deepseek V32 layer aclgraph+dp empty batch
capture."), commit 99c7bfe5.
Symptom: with data parallelism and ACL graphs, a DP rank that has no decode request in a step (it still runs
the graph so that the collectives match) fails to capture the DeepSeek-V3.2 decode graph ("empty batch
capture"; the PR gives no error text). Eager serving of the same empty step runs.
Mechanism: ``AclGraphExecutorImpl::run`` keys graphs by the bucket of the DP-global token count and captures
lazily, so an empty rank can be the one that captures a bucket. Its batch has ``num_sequences == 0``, one
dummy token and no ``q_seq_lens`` / ``q_cu_seq_lens`` (``ModelInputParams::to`` only creates device tensors
for non-empty host vectors: both stay undefined). ``GraphPersistentParam::update(..., return_capture_params)``
(``is_empty_dp_decode_rank``) returns capture params whose ``q_seq_lens`` is the persistent ``q_seq_lens_``
padded to the bucket, ``actual_num_sequences = 0`` and ``enable_graph = true``; ``q_cu_seq_lens`` is replaced by
the persistent ``q_cu_seq_lens_`` only when the step's own is defined, so it stays undefined.
``NpuDeepseekV32DecoderLayerImpl::build_node_variant_pack`` then picks in-tensor 31 (the lightning indexer's
``actual_seq_lengths_query``) with ``if (q_seq_lens.numel() != 0) q_cu_seq_lens else int_tensor_placeholder_``:
eager's empty batch has no ``q_seq_lens`` and takes the placeholder, but the padded graph batch never has an
empty ``q_seq_lens``, so the capture hands the indexer the undefined (zero-sized) ``q_cu_seq_lens`` and the
indexer's setup rejects it. The emptiness test reads a padded tensor where the real count was needed.
Doctor: undersized-buffer, at ``build_node_variant_pack`` (the capture feeds the indexer a zero-sized
``q_cu_seq_lens`` because the choice is made from the bucket-sized ``q_seq_lens``).
Fix (upstream): ``build_node_variant_pack`` decides emptiness per mode from the real counts
(``empty_eager_batch = !enable_graph && meta.num_sequences == 0``, ``empty_graph_batch = enable_graph &&
meta.actual_num_sequences == 0``) and passes ``q_cu_seq_lens`` only when the batch is not empty and it is
defined and non-empty; otherwise ``int_tensor_placeholder_`` (``ones({1})``).
(Toy: one DSA layer, single-token decode. The indexer maps tokens to sequences by ``actual_seq_lengths_query``
when it has one entry per row, by its decode default (one query per row) for the 1-element placeholder, and
fails setup on a zero-sized one. The empty rank's dummy token uses the padding KV metadata: block 0, slot 0.)
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.engine import events, graph, new_graph
from workbench.zoo.kit import compare, generator, randn, replay

UPSTREAM = "https://github.com/xLLM-AI/xllm/pull/1739"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "build_node_variant_pack"
SYMPTOM = "ACL graph + DP: an empty rank's DeepSeek-V3.2 decode capture fails (indexer gets an empty q_cu_seq_lens)"

VOCAB, DIM, BLOCK_SIZE, MAX_BLOCKS, TOPK, MAX_SEQS_PER_BATCH = 16, 4, 2, 4, 2, 4
NUM_SLOTS = (1 + 3 * MAX_BLOCKS) * BLOCK_SIZE            # block 0 is the null block, slot 0 the padding slot
BLOCKS = {"A": [1, 2, 3, 4], "B": [5, 6, 7, 8], "C": [9, 10, 11, 12]}
INITIAL_LENS = {"A": 3, "B": 2, "C": 4}


@dataclasses.dataclass
class ModelInputParams:
    num_sequences: int
    dp_global_token_nums: list
    kv_seq_lens: torch.Tensor
    q_seq_lens: torch.Tensor | None               # undefined for an empty DP rank
    q_cu_seq_lens: torch.Tensor | None            # undefined for an empty DP rank
    new_cache_slots: torch.Tensor
    block_tables: torch.Tensor
    actual_num_sequences: int = 0
    enable_graph: bool = False


def numel(t):
    return 0 if t is None else t.numel()          # libtorch: an undefined tensor has numel() == 0


def at_tensor_to_tensor(t, device):      # AtTensor2Tensor: an undefined at::Tensor -> an atb::Tensor with no data
    return torch.zeros(0, dtype=torch.int32, device=device) if t is None else t


def lightning_indexer(index_q, index_cache, positions, block_tables, kv_seq_lens, actual_seq_lengths_query):
    batch = block_tables.shape[0]
    if actual_seq_lengths_query.numel() == 0:
        raise RuntimeError("lightning_indexer setup failed: in-tensor actual_seq_lengths_query has no data")
    t = torch.arange(index_q.shape[0], device=index_q.device)
    # one entry per row: cumulative query lengths (TND); the 1-element placeholder: decode, one query per row
    seq = ((actual_seq_lengths_query[None, :] <= t[:, None]).sum(1).clamp(max=batch - 1)
           if actual_seq_lengths_query.numel() == batch else t)
    ctx = torch.arange(MAX_BLOCKS * BLOCK_SIZE, device=index_q.device)
    slots = block_tables.long()[seq][:, ctx // BLOCK_SIZE] * BLOCK_SIZE + ctx % BLOCK_SIZE
    valid = (ctx[None, :] < kv_seq_lens.long()[seq][:, None]) & (ctx[None, :] <= positions[:, None])
    scores = (index_cache[slots] @ index_q[:, :, None]).squeeze(-1).masked_fill(~valid, -1e9)
    top = scores.topk(TOPK, dim=-1).indices
    return slots.gather(1, top), valid.gather(1, top)


class NpuDeepseekV32DecoderLayerImpl:
    def __init__(self, device, variant):
        gen = generator(1739)
        self.device, self.variant = device, variant
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos_embed = randn(MAX_BLOCKS * BLOCK_SIZE, DIM, gen=gen, device=device, scale=0.5)
        self.wq, self.wk, self.wiq, self.wik, self.wo = (
            randn(DIM, DIM, gen=gen, device=device, scale=0.7) for _ in range(5))
        self.int_tensor_placeholder_ = torch.ones(1, dtype=torch.int32, device=device)

    def build_node_variant_pack(self, params: ModelInputParams):
        """In-tensor 31 of the ATB node: the indexer's ``actual_seq_lengths_query``."""
        if self.variant == "bug":
            if numel(params.q_seq_lens) != 0:
                return at_tensor_to_tensor(params.q_cu_seq_lens, self.device)
            return self.int_tensor_placeholder_
        empty_eager_batch = not params.enable_graph and params.num_sequences == 0
        empty_graph_batch = params.enable_graph and params.actual_num_sequences == 0
        empty_batch = empty_eager_batch or empty_graph_batch
        use_q_cu_seq_lens = not empty_batch and params.q_cu_seq_lens is not None and numel(params.q_cu_seq_lens) != 0
        return params.q_cu_seq_lens if use_q_cu_seq_lens else self.int_tensor_placeholder_

    def forward(self, tokens, positions, kv_cache, params: ModelInputParams):
        k_cache, index_cache = kv_cache
        h = self.embed[tokens] + self.pos_embed[positions]
        slots = params.new_cache_slots.long()
        k_cache[slots] = h @ self.wk
        index_cache[slots] = h @ self.wik
        sel, sel_valid = lightning_indexer(h @ self.wiq, index_cache, positions, params.block_tables,
                                           params.kv_seq_lens, self.build_node_variant_pack(params))
        keys = k_cache[sel]
        scores = (keys @ (h @ self.wq)[:, :, None]).squeeze(-1).masked_fill(~sel_valid, -1e9)
        return (torch.softmax(scores, -1)[:, :, None] * keys).sum(1) @ self.wo


class GraphPersistentParam:
    def __init__(self, device):
        n = MAX_SEQS_PER_BATCH
        self.persistent_tokens_ = torch.zeros(n, dtype=torch.long, device=device)
        self.persistent_positions_ = torch.zeros(n, dtype=torch.long, device=device)
        self.q_seq_lens_ = torch.ones(n, dtype=torch.int32, device=device)
        self.kv_seq_lens_ = torch.ones(n, dtype=torch.int32, device=device)
        self.persistent_new_cache_slots_ = torch.zeros(n, dtype=torch.int32, device=device)
        self.persistent_block_tables_ = torch.zeros(n, MAX_BLOCKS, dtype=torch.int32, device=device)
        self.q_cu_seq_lens_default_ = torch.zeros(n + 1, dtype=torch.int32, device=device)
        self.q_cu_seq_lens_ = torch.zeros(n + 1, dtype=torch.int32, device=device)

    def update(self, tokens, positions, params: ModelInputParams, padded: int, return_capture_params=False):
        n = tokens.shape[0]
        is_empty_dp_decode_rank = (params.num_sequences == 0 and n > 0 and len(params.dp_global_token_nums) > 1
                                   and params.q_seq_lens is None)
        rows = 0 if is_empty_dp_decode_rank else n
        self.persistent_tokens_[:n].copy_(tokens)
        self.persistent_tokens_[n:padded].zero_()
        self.persistent_positions_[:n].copy_(positions)
        self.persistent_positions_[n:padded].zero_()
        self.persistent_new_cache_slots_[:n].copy_(params.new_cache_slots)
        self.persistent_new_cache_slots_[n:padded].zero_()          # the reserved padding slot
        if rows > 0:
            self.q_seq_lens_[:rows].copy_(params.q_seq_lens[:rows])
            self.kv_seq_lens_[:rows].copy_(params.kv_seq_lens[:rows])
            self.persistent_block_tables_[:rows].copy_(params.block_tables[:rows])
        self.q_seq_lens_[rows:padded].fill_(1)
        self.kv_seq_lens_[rows:padded].fill_(1)
        self.persistent_block_tables_[rows:padded].zero_()
        self.q_cu_seq_lens_.copy_(self.q_cu_seq_lens_default_)
        if numel(params.q_cu_seq_lens) > 0:
            self.q_cu_seq_lens_[:rows].copy_(params.q_cu_seq_lens[:rows])
            self.q_cu_seq_lens_[rows:padded].copy_(torch.arange(n + 1, n + 1 + padded - rows, dtype=torch.int32,
                                                                      device=tokens.device))
        if not return_capture_params:
            return None
        return dataclasses.replace(
            params, num_sequences=padded, enable_graph=True, actual_num_sequences=0 if is_empty_dp_decode_rank else n,
            kv_seq_lens=self.kv_seq_lens_[:padded], q_seq_lens=self.q_seq_lens_[:padded],
            new_cache_slots=self.persistent_new_cache_slots_[:padded],
            block_tables=self.persistent_block_tables_[:padded],
            q_cu_seq_lens=self.q_cu_seq_lens_[:padded] if params.q_cu_seq_lens is not None else params.q_cu_seq_lens)


class AclGraph:
    def __init__(self, persistent_param: GraphPersistentParam, device):
        self.persistent_param_ = persistent_param
        self.graph_ = new_graph(device)
        self.num_tokens_, self.hidden_states_ = 0, None

    def capture(self, model, tokens, positions, params, kv_cache, bucket_num_tokens):
        self.num_tokens_ = bucket_num_tokens
        p = self.persistent_param_
        graph_params = p.update(tokens, positions, params, bucket_num_tokens, return_capture_params=True)
        events.static_buffers("GraphPersistentParam", {k: v for k, v in vars(p).items() if "default" not in k})
        events.persistent_state("AclGraphExecutorImpl (kv cache)", {"k_cache": kv_cache[0], "index_cache": kv_cache[1]})
        with graph(self.graph_, name=f"decode bucket {bucket_num_tokens}"):
            self.hidden_states_ = model.forward(p.persistent_tokens_[:bucket_num_tokens],
                                                p.persistent_positions_[:bucket_num_tokens], kv_cache, graph_params)
        return replay(self.graph_, self.hidden_states_, real=params.num_sequences, size=bucket_num_tokens)

    def replay(self, tokens, positions, params):
        self.persistent_param_.update(tokens, positions, params, self.num_tokens_)
        return replay(self.graph_, self.hidden_states_, real=params.num_sequences, size=self.num_tokens_)


class AclGraphExecutorImpl:
    def __init__(self, model, kv_cache, device, enable_graph):
        self.model_, self.kv_cache, self.device, self.enable_graph = model, kv_cache, device, enable_graph
        self.persistent_param_ = GraphPersistentParam(device)
        self.graphs_ = {}

    @staticmethod
    def get_bucket_num_tokens(num_tokens):
        return 1 if num_tokens <= 1 else 2 if num_tokens <= 2 else 4

    def run(self, tokens, positions, params: ModelInputParams):
        if not self.enable_graph:
            return self.model_.forward(tokens, positions, self.kv_cache, params)
        bucket = self.get_bucket_num_tokens(max(params.dp_global_token_nums))   # DP-global bucket
        if bucket in self.graphs_:
            return self.graphs_[bucket].replay(tokens, positions, params)
        g = AclGraph(self.persistent_param_, self.device)                       # lazy capture
        out = g.capture(self.model_, tokens, positions, params, self.kv_cache, bucket)
        self.graphs_[bucket] = g
        return out


def worker_step(executor, device, seqs, token_ids, lens, dp_global_token_nums):
    """One decode step of DP rank 1: its own sequences (none: one dummy token, no q lengths)."""
    def t(xs):
        return torch.tensor(xs, dtype=torch.int32, device=device)
    if not seqs:
        params = ModelInputParams(0, dp_global_token_nums, t([1]), None, None, t([0]), t([[0] * MAX_BLOCKS]))
        tokens, positions = (torch.zeros(1, dtype=torch.long, device=device) for _ in range(2))
    else:
        pos = [lens[s] for s in seqs]
        slots = [BLOCKS[s][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for s, p in zip(seqs, pos)]
        params = ModelInputParams(len(seqs), dp_global_token_nums, t([p + 1 for p in pos]), t([1] * len(seqs)),
                                  t(list(range(1, len(seqs) + 1))), t(slots), t([BLOCKS[s] for s in seqs]))
        tokens, positions = torch.tensor(token_ids, device=device), torch.tensor(pos, device=device)
        lens.update({s: lens[s] + 1 for s in seqs})
    out = executor.run(tokens, positions, params)
    return out[:params.num_sequences].clone()


# (this rank's sequences, their tokens, dp_global_token_nums over 2 DP ranks)
STEPS = (
    (["A", "B", "C"], [4, 13, 6], [3, 3]),          # bucket 4: captured on a real batch
    ([], [], [2, 0]),                               # bucket 2: this rank is empty, it captures bucket 2
    (["A", "C"], [10, 2], [1, 2]),                  # bucket 2: replay
    (["A", "B", "C"], [0, 9, 3], [3, 4]),           # bucket 4: replay
)


def run(variant: str, device: str = "cpu"):
    model = NpuDeepseekV32DecoderLayerImpl(device, variant)
    gen = generator(17390)
    k0, i0 = randn(NUM_SLOTS, DIM, gen=gen, device=device), randn(NUM_SLOTS, DIM, gen=gen, device=device)

    def serve(graphed: bool):
        kv_cache = (k0.clone(), i0.clone())
        executor = AclGraphExecutorImpl(model, kv_cache, device, graphed)
        lens = dict(INITIAL_LENS)
        return [worker_step(executor, device, seqs, ids, lens, dp) for seqs, ids, dp in STEPS]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
