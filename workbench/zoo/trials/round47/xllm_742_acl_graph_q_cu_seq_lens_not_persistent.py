"""The ACL decode graph keeps the capture step's own ``q_cu_seq_lens`` tensor, released after that step.

Upstream: https://github.com/xLLM-AI/xllm/pull/742 ("bugfix: fix acl_graph_executor not handling
q_cu_seq_lens parameter for deepseekv3.2."), commit 11e45038.
Symptom: the PR states no symptom beyond its title: DeepSeek-V3.2 decode under ACL graphs did not handle
``q_cu_seq_lens``. By mechanism, every replay's lightning indexer reads a freed per-step tensor (whatever
the caching allocator put there next), so replayed decode steps give wrong results; eager is right.
Mechanism: ``AclGraphExecutorImpl::run`` captures lazily, on the first decode step of a bucket.
``AclGraph::capture`` calls ``GraphPersistentParam::update`` (copies tokens, positions, ``q_seq_lens``,
``kv_seq_lens``, ``new_cache_slots``, ``block_tables`` into persistent buffers), then builds
``graph_params = params`` and replaces those fields by the persistent buffers, but not
``q_cu_seq_lens``: it stays the capture call's per-step tensor (``ModelInputParams::to(device)`` makes a
fresh one every step), which the DeepSeek-V3.2 decoder layer hands to the lightning-indexer op. ``update``
never copies ``q_cu_seq_lens`` either. After the capture step returns, its ``params`` are released; each
``AclGraph::replay`` then reads that address, which the allocator has handed to a later step's tensor
(here the next step's ``kv_seq_lens``), so the indexer assigns query tokens to the wrong sequences.
Doctor: dangling-reference, at ``capture`` (``AclGraph::capture``: the captured params keep the capture
call's ``q_cu_seq_lens``, which nothing keeps alive after that step).
Fix (upstream): ``GraphPersistentParam::update`` lazily allocates a persistent ``q_cu_seq_lens_``
(``max_seqs_per_batch + 1``) and copies ``params.q_cu_seq_lens`` into ``[:batch]`` on every call; with
``return_capture_params=true`` it returns the capture ``ModelInputParams`` with every field on a
persistent buffer, including ``q_cu_seq_lens = q_cu_seq_lens_[:actual_batch_size]``; capture and replay
both call it. (Diff read: ``acl_graph_executor_impl.cpp/.h``; the cuda/mlu executors only changed
signatures.)
(One-layer toy: indexer top-k over a per-token index cache, then sparse attention over the selected keys;
every decode step fills its bucket, so no padding is involved.)
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.engine import events, graph, host, new_graph, reuse_freed_blocks
from workbench.zoo.kit import compare, generator, randn, replay

UPSTREAM = "https://github.com/xLLM-AI/xllm/pull/742"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "capture"
SYMPTOM = "DeepSeek-V3.2 ACL-graph decode: the indexer reads a freed q_cu_seq_lens, tokens mapped to wrong sequences"

VOCAB, DIM, BLOCK_SIZE, MAX_BLOCKS, TOPK = 16, 4, 2, 4, 3
MAX_SEQS_PER_BATCH = 4
NUM_SLOTS = (1 + MAX_SEQS_PER_BATCH * MAX_BLOCKS) * BLOCK_SIZE        # block 0 is the null block
PROMPTS = ([3, 9], [5, 1, 12], [7], [2, 8, 4, 11])
BLOCKS = ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16])


@dataclasses.dataclass
class ModelInputParams:
    num_sequences: int
    is_decode: bool
    kv_seq_lens: torch.Tensor
    q_seq_lens: torch.Tensor
    q_cu_seq_lens: torch.Tensor          # inclusive cumulative q lengths, one per sequence
    new_cache_slots: torch.Tensor
    block_tables: torch.Tensor

    def to(self, device) -> "ModelInputParams":
        """A fresh device copy of the host batch per step, field by field (``safe_to``)."""
        return ModelInputParams(self.num_sequences, self.is_decode,
                                *(t.to(device, non_blocking=True) for t in (
                                    self.kv_seq_lens, self.q_seq_lens, self.q_cu_seq_lens,
                                    self.new_cache_slots, self.block_tables)))


def build_params(seqs, positions_per_seq, is_decode, device):
    """Host-side batch builder (``params_utils``): ``q_cu_seq_lens`` is ``partial_sum(q_seq_lens)``."""
    q_lens = [len(p) for p in positions_per_seq]
    cu = [sum(q_lens[:i + 1]) for i in range(len(q_lens))]

    def t(xs):
        return host(torch.tensor(xs, dtype=torch.int32), device)

    slots = [BLOCKS[s][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
             for s, ps in zip(seqs, positions_per_seq) for p in ps]
    return ModelInputParams(
        num_sequences=len(seqs), is_decode=is_decode,
        kv_seq_lens=t([ps[-1] + 1 for ps in positions_per_seq]), q_seq_lens=t(q_lens), q_cu_seq_lens=t(cu),
        new_cache_slots=t(slots), block_tables=t([BLOCKS[s] for s in seqs]))


def lightning_indexer(index_q, index_cache, positions, params: ModelInputParams):
    """DSA indexer: each query token finds its sequence from ``q_cu_seq_lens`` (actual_seq_lengths_query),
    scores that sequence's cached index keys (up to ``kv_seq_lens``, causal) and keeps the top-k slots."""
    t = torch.arange(index_q.shape[0], device=index_q.device)
    seq = (params.q_cu_seq_lens[None, :] <= t[:, None]).sum(1).clamp(max=params.block_tables.shape[0] - 1)
    ctx = torch.arange(MAX_BLOCKS * BLOCK_SIZE, device=index_q.device)
    slots = params.block_tables.long()[seq][:, ctx // BLOCK_SIZE] * BLOCK_SIZE + ctx % BLOCK_SIZE
    valid = (ctx[None, :] < params.kv_seq_lens.long()[seq][:, None]) & (ctx[None, :] <= positions[:, None])
    scores = (index_cache[slots] @ index_q[:, :, None]).squeeze(-1).masked_fill(~valid, -1e9)
    top = scores.topk(TOPK, dim=-1).indices
    return slots.gather(1, top), valid.gather(1, top)


class DeepseekV32Model:
    def __init__(self, device):
        gen = generator(742)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos_embed = randn(MAX_BLOCKS * BLOCK_SIZE, DIM, gen=gen, device=device, scale=0.5)
        self.wq, self.wk, self.wiq, self.wik, self.wo = (
            randn(DIM, DIM, gen=gen, device=device, scale=0.7) for _ in range(5))

    def forward(self, tokens, positions, kv_cache, params: ModelInputParams):
        k_cache, index_cache = kv_cache
        h = self.embed[tokens] + self.pos_embed[positions]
        slots = params.new_cache_slots.long()
        k_cache[slots] = h @ self.wk
        index_cache[slots] = h @ self.wik
        sel, sel_valid = lightning_indexer(h @ self.wiq, index_cache, positions, params)
        keys = k_cache[sel]                                                   # [T, TOPK, DIM]
        scores = (keys @ (h @ self.wq)[:, :, None]).squeeze(-1).masked_fill(~sel_valid, -1e9)
        return (torch.softmax(scores, -1)[:, :, None] * keys).sum(1) @ self.wo


class GraphPersistentParam:
    def __init__(self, device, variant):
        self.device, self.variant = device, variant
        n = MAX_SEQS_PER_BATCH
        self.persistent_tokens_ = torch.zeros(n, dtype=torch.long, device=device)
        self.persistent_positions_ = torch.zeros(n, dtype=torch.long, device=device)
        self.q_seq_lens_ = torch.zeros(n, dtype=torch.int32, device=device)
        self.kv_seq_lens_ = torch.zeros(n, dtype=torch.int32, device=device)
        self.persistent_new_cache_slots_ = torch.zeros(n, dtype=torch.int32, device=device)
        self.persistent_block_tables_ = torch.zeros(n, MAX_BLOCKS, dtype=torch.int32, device=device)
        self.q_cu_seq_lens_ = torch.zeros(0, dtype=torch.int32, device=device)   # for deepseekv3.2

    def buffers(self):
        out = {"persistent_tokens_": self.persistent_tokens_, "persistent_positions_": self.persistent_positions_,
               "q_seq_lens_": self.q_seq_lens_, "kv_seq_lens_": self.kv_seq_lens_,
               "persistent_new_cache_slots_": self.persistent_new_cache_slots_,
               "persistent_block_tables_": self.persistent_block_tables_}
        if self.q_cu_seq_lens_.numel():
            out["q_cu_seq_lens_"] = self.q_cu_seq_lens_
        return out

    def update(self, tokens, positions, params: ModelInputParams, padded_num_tokens: int,
               return_capture_params: bool = False):
        n, b = tokens.shape[0], params.num_sequences
        self.persistent_tokens_[:n].copy_(tokens)
        self.persistent_positions_[:n].copy_(positions)
        self.q_seq_lens_[:b].copy_(params.q_seq_lens)
        self.kv_seq_lens_[:b].copy_(params.kv_seq_lens)
        self.persistent_new_cache_slots_[:n].copy_(params.new_cache_slots)
        self.persistent_block_tables_[:b].copy_(params.block_tables)
        if self.variant == "fix":
            if self.q_cu_seq_lens_.numel() == 0:           # lazy initialization
                self.q_cu_seq_lens_ = torch.zeros(MAX_SEQS_PER_BATCH + 1, dtype=torch.int32, device=self.device)
            self.q_cu_seq_lens_[:b].copy_(params.q_cu_seq_lens)
        if not return_capture_params:
            return None
        # ModelInputParams with every field on a persistent buffer
        return dataclasses.replace(
            params, num_sequences=padded_num_tokens, is_decode=True,
            kv_seq_lens=self.kv_seq_lens_[:padded_num_tokens], q_seq_lens=self.q_seq_lens_[:padded_num_tokens],
            new_cache_slots=self.persistent_new_cache_slots_[:padded_num_tokens],
            block_tables=self.persistent_block_tables_[:padded_num_tokens],
            q_cu_seq_lens=self.q_cu_seq_lens_[:b])


class AclGraph:
    def __init__(self, persistent_param: GraphPersistentParam, device, variant):
        self.persistent_param_, self.device, self.variant = persistent_param, device, variant
        self.graph_ = new_graph(device, on_freed="reuse")
        self.num_tokens_ = 0
        self.hidden_states_ = None

    def capture(self, model, tokens, positions, params, kv_cache, bucket_num_tokens):
        self.num_tokens_ = bucket_num_tokens
        p = self.persistent_param_
        if self.variant == "bug":
            p.update(tokens, positions, params, self.num_tokens_)
            # Create ModelInputParams using persistent buffers
            graph_params = dataclasses.replace(
                params, num_sequences=self.num_tokens_, is_decode=True,
                kv_seq_lens=p.kv_seq_lens_[:self.num_tokens_], q_seq_lens=p.q_seq_lens_[:self.num_tokens_],
                new_cache_slots=p.persistent_new_cache_slots_[:self.num_tokens_],
                block_tables=p.persistent_block_tables_[:self.num_tokens_])   # q_cu_seq_lens: params'
        else:
            graph_params = p.update(tokens, positions, params, self.num_tokens_, return_capture_params=True)
        events.static_buffers("GraphPersistentParam", p.buffers())
        events.persistent_state("AclGraphExecutorImpl (kv cache)", {"k_cache": kv_cache[0],
                                                                   "index_cache": kv_cache[1]})
        with graph(self.graph_, name=f"decode bucket {bucket_num_tokens}"):
            self.hidden_states_ = model.forward(p.persistent_tokens_[:self.num_tokens_],
                                                p.persistent_positions_[:self.num_tokens_], kv_cache, graph_params)
        # test replay to produce this step's output (capture itself launches nothing)
        return replay(self.graph_, self.hidden_states_)

    def replay(self, tokens, positions, params):
        self.persistent_param_.update(tokens, positions, params, self.num_tokens_)
        return replay(self.graph_, self.hidden_states_)


class AclGraphExecutorImpl:
    def __init__(self, model, kv_cache, device, variant, enable_graph):
        self.model_, self.kv_cache, self.device, self.variant = model, kv_cache, device, variant
        self.enable_graph = enable_graph
        self.persistent_param_ = GraphPersistentParam(device, variant)
        self.graphs_ = {}

    def run(self, tokens, positions, params: ModelInputParams):
        if not (self.enable_graph and params.is_decode):
            return self.model_.forward(tokens, positions, self.kv_cache, params)
        bucket_num_tokens = tokens.shape[0]               # every step here fills its bucket
        if bucket_num_tokens in self.graphs_:
            return self.graphs_[bucket_num_tokens].replay(tokens, positions, params)
        g = AclGraph(self.persistent_param_, self.device, self.variant)   # lazy capture
        out = g.capture(self.model_, tokens, positions, params, self.kv_cache, bucket_num_tokens)
        self.graphs_[bucket_num_tokens] = g
        return out


def worker_step(executor, device, token_ids, positions_per_seq, is_decode):
    """One step of the worker: build the batch, move it to the device, run; the step's params die here."""
    seqs = list(range(len(positions_per_seq)))
    params = build_params(seqs, positions_per_seq, is_decode, device).to(device)
    tokens = host(torch.tensor(token_ids), device).to(device, non_blocking=True)
    positions = host(torch.tensor([p for ps in positions_per_seq for p in ps]), device).to(device, non_blocking=True)
    return executor.run(tokens, positions, params).clone()


def run(variant: str, device: str = "cpu"):
    model = DeepseekV32Model(device)
    decode_tokens = ([4, 13, 6, 1], [10, 2, 15, 7], [0, 9, 3, 14])

    def serve(graphed: bool):
        kv_cache = (torch.zeros(NUM_SLOTS, DIM, device=device), torch.zeros(NUM_SLOTS, DIM, device=device))
        executor = AclGraphExecutorImpl(model, kv_cache, device, variant, graphed)
        outs = [worker_step(executor, device, [t for p in PROMPTS for t in p],
                            [list(range(len(p))) for p in PROMPTS], is_decode=False)]
        lens = [len(p) for p in PROMPTS]
        for step, ids in enumerate(decode_tokens):
            outs.append(worker_step(executor, device, ids, [[n + step] for n in lens], is_decode=True))
        return outs

    def served():
        with reuse_freed_blocks():             # the caching allocator hands a released block on
            return serve(True)

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, lambda: serve(False))
