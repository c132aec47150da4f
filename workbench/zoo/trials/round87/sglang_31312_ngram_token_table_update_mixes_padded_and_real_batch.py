"""LongCat n-gram embedding under a padded decode CUDA graph: the post-sampling token-table update slices its static buffers to the real batch but feeds them the graph's padded tensors.

Upstream: https://github.com/sgl-project/sglang/pull/31312 ("Fix LongCat n-gram token-table crashes on padded
batches", sgl-project/sglang, merged 2026-07-15). Read: the PR description (both bugs, the error text, the fix: "Slice
`seq_lens` / `next_token_ids` / `req_pool_indices` / `out_*` to `batch_size` so only real requests update the table
(padded rows must not pollute it)"), and two stored versions of ``update_ngram_token_table_after_sampling``: the
pre-fix one (``ngram_embedding_info.out_column_starts[:batch_size] = seq_lens``, then ``update_token_table`` with the
full ``next_token_ids`` / ``req_pool_indices`` and the full ``out_column_starts`` / ``out_req_lens``) and the fixed one
(every argument sliced ``[:batch_size]``, with the comment "seq_lens / next_token_ids / req_pool_indices may be padded
to the cuda-graph batch size while batch_size is the real request count"). The PR's second bug (``NgramEmbedding.forward``
reading ``column_starts`` out of bounds in mixed/overlap batches) is not about graph padding and is not modelled. I
did not read how exactly the runner hands its padded tensors to the sampler; the PR description says they arrive
padded to the graph batch size, and that is what the stand-in below does.
Symptom: LongCat-2.0 with CUDA graphs: as soon as a decode batch is not a captured size (3 running requests replayed on
the bs=4 graph) the step dies with ``RuntimeError: The expanded size of the tensor (3) must match the existing size (4)``
from the token-table update. Batches of an exact captured size and ``--disable-cuda-graph`` run fine.
Mechanism: the n-gram embedding (``NgramEmbedding.forward``, inside the captured decode graph) hashes each request's
previous token, read from the persistent ``ne_token_table`` row ``req_pool_indices[i]``, with its current token. After
sampling, ``update_ngram_token_table_after_sampling`` appends the sampled token at column ``seq_lens[i]`` of that row
through ``update_token_table``, staging the columns and lengths in the static ``out_column_starts`` / ``out_req_lens``
buffers (sized ``max_bs``). With graph padding, ``seq_lens``, ``next_token_ids`` and ``req_pool_indices`` are the graph
bucket's ``bs`` rows (padded rows: ``seq_len`` fill 1, ``req_pool_index`` 0) while ``batch_size`` is ``raw_bs``, so
``out_column_starts[:batch_size] = seq_lens`` assigns ``bs`` values into ``raw_bs`` slots and raises. (Had it not raised,
the padded rows would have been written into the table too: the "pollute" the fix also rules out.)
Doctor: padded-shape-mismatch, at update_ngram_token_table_after_sampling. Code run on a padded graph step combines the
graph's padded tensors (``bs`` rows) with buffers sliced to the real request count (``raw_bs`` rows).
Fix (upstream): slice ``seq_lens``, ``next_token_ids``, ``req_pool_indices`` and both ``out_*`` buffers to
``batch_size`` before the update, so only real requests write the table and the shapes agree.
Modelled: a decode ``CudaGraphRunner`` (static ``input_ids``, ``positions``, ``req_pool_indices``, ``seq_lens``; capture
sizes 1, 2, 4; padded rows get ``seq_len`` 1 and ``req_pool_index`` 0, the reserved slot); the n-gram embedding model
(token + hashed-bigram embedding from the token table, a tanh MLP, an LM head); ``NgramEmbeddingInfo`` with the token
table and the static ``out_*`` buffers; ``update_token_table`` (per-request scatter of ``req_lens`` tokens at
``column_starts``) as a tensor stand-in for the JIT kernel; greedy sampling over all rows the forward returned. Stand-in:
how the padded tensors reach the sampler (the runner's replay view carries the graph bucket's tensors and the real
``batch_size``).
Workload: requests A-D (prompts pre-filled into the token table) decode 2 steps together (bs=4, exact, no padding);
D finishes; A-C decode 2 more steps, replayed on the bs=4 graph (1 padded row). Eager serves all 4 steps; with graphs
the first padded step raises in the table update.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/31312"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "update_ngram_token_table_after_sampling"
SYMPTOM = ("LongCat n-gram decode with CUDA graphs: 3 requests replayed on the bs=4 graph; the post-sampling token-table "
           "update assigns the 4 padded seq_lens into out_column_starts[:3] and raises 'The expanded size of the tensor "
           "(3) must match the existing size (4)'")

VOCAB, HIDDEN, NGRAM_VOCAB = 16, 8, 13
MAX_REQS, MAX_LEN = 4, 16             # token-table rows 1..MAX_REQS; row 0 is the reserved (padding) slot
CAPTURE_BS = [1, 2, 4]

_variant = "bug"


# --- n-gram embedding bookkeeping (stand-ins for sglang's manager and JIT kernel) ---------------------------------------

@dataclass
class NgramEmbeddingInfo:
    token_table: torch.Tensor           # [1 + MAX_REQS, MAX_LEN] token history per req_pool slot
    out_column_starts: torch.Tensor     # [MAX_REQS] static staging buffers of the post-sampling update
    out_req_lens: torch.Tensor
    skip_token_table_update: torch.Tensor | None = None


def update_token_table(*, ne_token_table, tokens, row_indices, column_starts, req_lens, ignore_tokens=None):
    """Write ``req_lens[i]`` tokens of request ``i`` at ``column_starts[i]`` of row ``row_indices[i]``."""
    offsets = torch.cumsum(req_lens, 0) - req_lens
    for i in range(row_indices.shape[0]):
        n = int(req_lens[i])
        start, off = int(column_starts[i]), int(offsets[i])
        ne_token_table[int(row_indices[i]), start:start + n] = tokens[off:off + n].to(ne_token_table.dtype)


def update_ngram_token_table_after_sampling(*, ngram_embedding_info, next_token_ids, req_pool_indices, seq_lens,
                                            batch_size):
    """Update the ngram token table with sampled tokens (the hazard site)."""
    info = ngram_embedding_info
    if info.skip_token_table_update is not None:           # chunked-prefill pseudo samples (not exercised here)
        indices = (~info.skip_token_table_update).nonzero(as_tuple=True)[0]
        update_token_table(ne_token_table=info.token_table, tokens=next_token_ids[indices].to(torch.int32),
                           row_indices=req_pool_indices[indices], column_starts=seq_lens[indices].to(torch.int32),
                           req_lens=torch.ones(indices.numel(), dtype=torch.int32, device=next_token_ids.device))
        return True
    if _variant == "fix":
        # seq_lens / next_token_ids / req_pool_indices may be padded to the cuda-graph batch size while batch_size is
        # the real request count: slice to batch_size so padded rows don't pollute the table (and shapes match).
        info.out_column_starts[:batch_size] = seq_lens[:batch_size]
        info.out_req_lens[:batch_size] = 1
        update_token_table(ne_token_table=info.token_table, tokens=next_token_ids[:batch_size].to(torch.int32),
                           row_indices=req_pool_indices[:batch_size],
                           column_starts=info.out_column_starts[:batch_size],
                           req_lens=info.out_req_lens[:batch_size])
        return True
    info.out_column_starts[:batch_size] = seq_lens
    info.out_req_lens[:batch_size] = 1
    update_token_table(ne_token_table=info.token_table, tokens=next_token_ids.to(torch.int32),
                       row_indices=req_pool_indices, column_starts=info.out_column_starts,
                       req_lens=info.out_req_lens)
    return True


# --- the model --------------------------------------------------------------------------------------------------------

@dataclass
class ForwardBatch:
    batch_size: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    ngram_embedding_info: NgramEmbeddingInfo


class LongcatNgramModel:
    def __init__(self, device):
        gen = generator(31312)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale)  # noqa: E731
        self.embed = r(VOCAB, HIDDEN, scale=1.0)
        self.ngram_embed = r(NGRAM_VOCAB, HIDDEN, scale=1.0)
        self.w1, self.w2 = r(HIDDEN, HIDDEN, scale=0.7), r(HIDDEN, HIDDEN, scale=0.7)
        self.lm_head = r(HIDDEN, VOCAB, scale=0.8)

    def ngram_embedding(self, input_ids, positions, req_pool_indices, token_table):
        """NgramEmbedding.forward: hash (previous token, current token) into the n-gram table."""
        prev_col = (positions - 1).clamp(min=0)
        prev = token_table[req_pool_indices, prev_col]
        ids = (prev * VOCAB + input_ids) % NGRAM_VOCAB
        return self.ngram_embed[ids]

    def forward(self, fb: ForwardBatch):
        info = fb.ngram_embedding_info
        h = self.embed[fb.input_ids] + self.ngram_embedding(fb.input_ids, fb.positions, fb.req_pool_indices,
                                                            info.token_table)
        h = h + torch.tanh(h @ self.w1) @ self.w2
        return h @ self.lm_head


class CudaGraphRunner:
    def __init__(self, model, info, device):
        self.model, self.info, self.device = model, info, device
        self.capture_bs, self.max_bs = CAPTURE_BS, max(CAPTURE_BS)
        self.seq_len_fill_value = 1
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.req_pool_indices = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.seq_lens = torch.full((self.max_bs,), self.seq_len_fill_value, dtype=torch.int64, device=device)
        self.graphs, self.output_buffers = {}, {}
        for bs in reversed(self.capture_bs):
            self.graphs[bs], self.output_buffers[bs] = self.capture_one_batch_size(bs)

    def _view(self, bs, raw_bs):
        return ForwardBatch(raw_bs, self.input_ids[:bs], self.positions[:bs], self.req_pool_indices[:bs],
                            self.seq_lens[:bs], self.info)

    def capture_one_batch_size(self, bs):
        fb = self._view(bs, bs)
        return capture(lambda: self.model.forward(fb), device=self.device, name=f"decode bs={bs}",
                       owner="CudaGraphRunner",
                       static={"input_ids": self.input_ids, "positions": self.positions,
                               "req_pool_indices": self.req_pool_indices, "seq_lens": self.seq_lens},
                       state={"ne_token_table": self.info.token_table})

    def can_run(self, fb):
        return fb.batch_size <= self.max_bs

    def replay(self, fb: ForwardBatch):
        raw_bs = fb.batch_size
        bs = next(b for b in self.capture_bs if b >= raw_bs)
        if bs != raw_bs:
            self.seq_lens.fill_(self.seq_len_fill_value)
            self.req_pool_indices.zero_()               # padded rows resolve to the reserved slot 0
        self.input_ids[:raw_bs].copy_(fb.input_ids)
        self.positions[:raw_bs].copy_(fb.positions)
        self.req_pool_indices[:raw_bs].copy_(fb.req_pool_indices)
        self.seq_lens[:raw_bs].copy_(fb.seq_lens)
        logits = replay(self.graphs[bs], self.output_buffers[bs], real=raw_bs, size=bs,
                        padded={"input_ids": self.input_ids, "positions": self.positions})
        return logits, self._view(bs, raw_bs)            # the graph bucket's tensors, batch_size = raw_bs


class ModelRunner:
    def __init__(self, device, use_cuda_graph):
        self.device = device
        self.model = LongcatNgramModel(device)
        self.info = NgramEmbeddingInfo(
            token_table=torch.zeros(1 + MAX_REQS, MAX_LEN, dtype=torch.int64, device=device),
            out_column_starts=torch.zeros(MAX_REQS, dtype=torch.int32, device=device),
            out_req_lens=torch.zeros(MAX_REQS, dtype=torch.int32, device=device))
        self.graph_runner = CudaGraphRunner(self.model, self.info, device) if use_cuda_graph else None

    def forward_decode_and_sample(self, fb: ForwardBatch):
        if self.graph_runner is not None and self.graph_runner.can_run(fb):
            logits, fb = self.graph_runner.replay(fb)
        else:
            logits = self.model.forward(fb)
        logits = logits.clone()
        next_token_ids = logits.argmax(-1)
        update_ngram_token_table_after_sampling(ngram_embedding_info=fb.ngram_embedding_info,
                                                next_token_ids=next_token_ids,
                                                req_pool_indices=fb.req_pool_indices, seq_lens=fb.seq_lens,
                                                batch_size=fb.batch_size)
        return logits[:fb.batch_size], next_token_ids[:fb.batch_size]


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    prompts = {"A": [3, 7, 1], "B": [9, 2], "C": [4, 4, 11, 5], "D": [6, 12, 8]}
    schedule = ["ABCD", "ABCD", "ABC", "ABC"]

    def serve(use_cuda_graph: bool):
        mr = ModelRunner(device, use_cuda_graph)
        slot = {rid: 1 + i for i, rid in enumerate("ABCD")}
        seq_len = {}
        for rid, toks in prompts.items():                 # prefill stand-in: the prompt enters the token table
            mr.info.token_table[slot[rid], :len(toks)] = torch.tensor(toks, device=device)
            seq_len[rid] = len(toks)
        outs = []
        for names in schedule:
            rows = [slot[r] for r in names]
            lens = [seq_len[r] for r in names]
            t = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
            table = mr.info.token_table
            last = [int(table[row, n - 1]) for row, n in zip(rows, lens)]
            fb = ForwardBatch(len(names), t(last), t([n - 1 for n in lens]), t(rows), t(lens), mr.info)
            logits, _ = mr.forward_decode_and_sample(fb)
            outs.append(logits)
            for r in names:
                seq_len[r] += 1
        outs.append(mr.info.token_table[1:].clone().double())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
