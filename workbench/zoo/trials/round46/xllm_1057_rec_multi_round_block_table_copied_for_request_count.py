"""Rec multi-round beams: the graph's persistent block table is refreshed through a slice of the request count only.

Upstream: https://github.com/xLLM-AI/xllm/pull/1057 ("bugfix: fix rec multi-round piecewise prefill graph
failure.", commit b8fc4a8e8, merged March 2026).
Symptom: as reported, the CUDA-graph path fails for rec (generative recommendation) multi-round requests, whose
rounds after the first run ``beam_width`` sequences per request ("graph failure"; the PR gives no trace).
Mechanism (from the diff): before each replay ``CudaGraphPersistentParam::update`` copies the step's inputs into
the executor's persistent graph tensors. For the block table it takes
``persistent_block_tables_.slice(0, 0, actual_batch_size).slice(1, 0, block_tables.size(1))`` and
``copy_(params.block_tables)``, with ``actual_batch_size = params.num_sequences``. In rec multi-round mode
``num_sequences`` still counts the logical requests while ``params.block_tables`` has already been expanded to
``batch_size * beam_width`` rows (one per beam). The step's block table does not fit the slice it is copied into:
``copy_`` cannot broadcast ``[batch * beam, blocks]`` into ``[batch, blocks]`` and the graph step fails; eager
steps hand ``params.block_tables`` to the attention directly and run. (The lengths of the two-stage rec decode are
copied by their ``numel``, so only the block table is short.)
Doctor: undersized-buffer, at ``update`` (the beam-expanded block table does not fit the request-count slice of the
persistent block table that the graph reads).
Fix (upstream): ``actual_block_table_batch = is_rec_multi_round_mode() ? params.block_tables.size(0) :
actual_batch_size`` is the slice's end. The same PR also stops ``XAttentionImpl::prefill_forward`` from running
``update_prefill_plan_info`` inside a graph-enabled forward (it CHECKs a plan supplied from outside instead); that
part is not modelled here.
"""
from __future__ import annotations

import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/xLLM-AI/xllm/pull/1057"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "update"
SYMPTOM = "rec multi-round graph step fails: beam-expanded block table copied into a request-count slice"

VOCAB, DIM = 16, 4
BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS = 2, 16, 3
MAX_CTX = BLOCK_SIZE * MAX_BLOCKS
BEAM_WIDTH = 2
MAX_SEQS = 4                        # the captured graph's rows (sequences = requests * beams)


def is_rec_multi_round_mode():
    return True                     # FLAGS: rec multi-round (beam) serving


class ModelInputParams:
    def __init__(self, num_sequences, block_tables, kv_seq_lens):
        self.num_sequences = num_sequences          # logical requests
        self.block_tables = block_tables            # [num_sequences * beam_width, blocks] in multi-round
        self.kv_seq_lens = kv_seq_lens


class Model:
    def __init__(self, device):
        gen = generator(1057)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.wo = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.k_cache = randn(NUM_BLOCKS * BLOCK_SIZE, DIM, gen=gen, device=device)
        self.v_cache = randn(NUM_BLOCKS * BLOCK_SIZE, DIM, gen=gen, device=device)
        self.ctx_pos = torch.arange(MAX_CTX, device=device)

    def forward(self, tokens, block_table, kv_seq_lens):
        """One decode token per beam sequence; each attends over its own pages up to its KV length."""
        pos = self.ctx_pos
        slots = block_table[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        q = self.emb[tokens] @ self.wq
        k, v = self.k_cache[slots], self.v_cache[slots]
        scores = (k @ q[:, :, None]).squeeze(-1) / math.sqrt(DIM)
        scores = scores.masked_fill(pos[None, :] >= kv_seq_lens[:, None], -1e9)
        return (torch.softmax(scores, -1)[:, :, None] * v).sum(1) @ self.wo


class CudaGraphPersistentParam:
    def __init__(self, device, variant):
        self.variant = variant
        self.persistent_tokens_ = torch.zeros(MAX_SEQS, dtype=torch.long, device=device)
        self.persistent_block_tables_ = torch.zeros(MAX_SEQS, MAX_BLOCKS, dtype=torch.long, device=device)
        self.kv_seq_lens_ = torch.ones(MAX_SEQS, dtype=torch.long, device=device)

    def update(self, tokens, params):
        """Copy the step's inputs into the persistent graph tensors (before a capture or a replay)."""
        actual_num_tokens = tokens.size(0)
        actual_batch_size = params.num_sequences
        self.persistent_tokens_[:actual_num_tokens].copy_(tokens)
        self.persistent_tokens_[actual_num_tokens:].fill_(0)
        # two-stage rec decode: the lengths are copied by their numel
        kv_numel = params.kv_seq_lens.numel()
        self.kv_seq_lens_[:kv_numel].copy_(params.kv_seq_lens)
        self.kv_seq_lens_[kv_numel:].fill_(1)
        # Copy block table data
        if self.variant == "fix":
            actual_block_table_batch = (params.block_tables.size(0) if is_rec_multi_round_mode()
                                        else actual_batch_size)
        else:
            actual_block_table_batch = actual_batch_size
        actual_block_table_len = params.block_tables.size(1)
        slice_persistent_block_tables = self.persistent_block_tables_[:actual_block_table_batch,
                                                                      :actual_block_table_len]
        slice_persistent_block_tables.copy_(params.block_tables)


class CudaGraphExecutorImpl:
    def __init__(self, model, device, variant):
        self.model, self.device = model, device
        self.persistent_param = CudaGraphPersistentParam(device, variant)
        p = self.persistent_param
        self.graph, self.out = capture(
            lambda: model.forward(p.persistent_tokens_, p.persistent_block_tables_, p.kv_seq_lens_),
            device=device, owner="CudaGraphExecutorImpl (rec multi-round decode)", name=f"bs={MAX_SEQS}",
            static={"persistent_tokens_": p.persistent_tokens_,
                    "persistent_block_tables_": p.persistent_block_tables_, "kv_seq_lens_": p.kv_seq_lens_},
            state={"k_cache": model.k_cache, "v_cache": model.v_cache})

    def run(self, tokens, params):
        self.persistent_param.update(tokens, params)
        n = tokens.size(0)
        return replay(self.graph, self.out, real=n, size=MAX_SEQS)[:n].clone()


def t(xs, device):
    return torch.tensor(xs, dtype=torch.long, device=device)


# Rounds of two rec requests, two beams each: (beam tokens, per-beam block ids, per-beam KV lengths).
ROUNDS = [
    ([3, 5, 7, 9], [[1, 2, 0], [1, 3, 0], [4, 5, 0], [4, 6, 0]], [3, 4, 3, 4]),
    ([2, 8, 11, 6], [[1, 3, 7], [1, 2, 8], [4, 6, 9], [4, 6, 10]], [5, 5, 5, 6]),
]


def run(variant: str, device: str = "cpu"):
    model = Model(device)

    def params_of(block_ids, kv_lens):
        return ModelInputParams(len(block_ids) // BEAM_WIDTH, t(block_ids, device), t(kv_lens, device))

    def eager():
        return [model.forward(t(tok, device), t(b, device), t(kv, device)).clone() for tok, b, kv in ROUNDS]

    def served():
        executor = CudaGraphExecutorImpl(model, device, variant)
        return [executor.run(t(tok, device), params_of(b, kv)) for tok, b, kv in ROUNDS]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
