"""imp decode graph: the pool's block-table upload is skipped for a new request with the same block count.

Upstream: https://github.com/kekzl/imp/commit/21408608e3d626e21fb07232bcdd29b58a9b9b30 ("fix: engine warmup, stale
block table, async graph penalty bypass, repeat_last_n"; a commit on ``main``, no PR). Diff read
(``src/runtime/batch.cpp``/``batch.h``; the decode path in ``src/runtime/engine.cpp`` and
``CudaGraphRunner::execute`` in ``src/runtime/cuda_graph.cu`` read at the parent commit).
Symptom: "cross-request stale KV cache reads when block counts match": with CUDA graphs, a request decoded
after another single-sequence request with the same number of KV blocks attends over (and appends to) the
previous request's KV pages, and produces wrong tokens.
Mechanism: ``GPUBatchPool`` is "pre-allocated device memory for stable CUDA Graph pointers"; the engine uploads
each decode step's ``Batch`` into it (``decode_batch_pool_.upload_into_pool(batch, dec_stream)``) and the decode
``CudaGraphRunner`` (one eager warmup step, then capture + immediate replay, then replays) reads token ids,
positions, context lengths and ``d_block_tables_`` from it. ``upload_into_pool`` copied token ids, positions and
context lengths every step but skipped the ``cudaMemcpyAsync`` of ``block_tables`` when ``n_sequences == 1`` and
the block count equalled ``last_upload_n_blocks_`` ("Block table only changes when a new KV block is
allocated"). That holds within a request, but a new request whose blocks are other physical pages with the
same count also skips it: the graph's paged KV write and paged attention go through the previous request's
block ids, still in the static ``d_block_tables_``. The decode graph is not re-captured between the requests
(batch size 1 and the pool-padded ``max_blocks_per_seq`` are unchanged).
Doctor: stale-input, at ``upload_into_pool`` (it skips refreshing the static block table, so the replay reads
the block ids an earlier request's step left there).
Fix (upstream): the skip key also holds ``last_upload_first_block_`` (``block_tables[0]``), reset in
``allocate()``/``free_pool()`` and by a new ``reset_upload_cache()``; a new request's first block differs, which
forces the upload. (The same commit also keeps penalised requests off the async graph loop and adds an
engine warmup; neither is modelled here.)
Caveat: imp allocates the pool whether or not graphs are on, so its non-graph decode read the same pool;
``eager()`` here is imp's pool-less path (``GPUBatch::upload``: every step uploads its own batch).
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/kekzl/imp/commit/21408608e3d626e21fb07232bcdd29b58a9b9b30"
FAMILY = "stale padded metadata"
KIND = "stale-input"
SITE = "upload_into_pool"
SYMPTOM = "a second request with the same KV block count decodes over the first request's KV pages"

VOCAB, DIM, BLOCK, NUM_BLOCKS, MAX_BLOCKS_PER_SEQ, MAX_BATCH = 16, 4, 4, 8, 2, 1


class Model:
    def __init__(self, device):
        gen = generator(2140860)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.wk = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device)
        self.ctx_pos = torch.arange(MAX_BLOCKS_PER_SEQ * BLOCK, device=device)


@dataclasses.dataclass
class Batch:
    token_ids: list
    positions: list
    block_tables: list
    context_lens: list
    n_sequences: int
    max_blocks_per_seq: int


class BatchBuilder:
    def __init__(self):
        self.seqs = []

    def add_decode_sequence(self, token, position, block_table, n_blocks, context_len):
        self.seqs.append((token, position, list(block_table[:n_blocks]), context_len))

    def build(self) -> Batch:
        max_blocks = max(len(bt) for _, _, bt, _ in self.seqs)
        tables = [b for _, _, bt, _ in self.seqs for b in bt + [0] * (max_blocks - len(bt))]
        return Batch([s[0] for s in self.seqs], [s[1] for s in self.seqs], tables, [s[3] for s in self.seqs],
                     len(self.seqs), max_blocks)


def _t(xs, device):
    return torch.tensor(xs, dtype=torch.long, device=device)


@dataclasses.dataclass
class GPUBatch:
    d_token_ids: torch.Tensor = None
    d_positions: torch.Tensor = None
    d_block_tables: torch.Tensor = None
    d_context_lens: torch.Tensor = None
    n_sequences: int = 0
    max_blocks_per_seq: int = 0

    def upload(self, batch: Batch, device):
        """The pool-less path: fresh device buffers, every field uploaded."""
        self.d_token_ids, self.d_positions = _t(batch.token_ids, device), _t(batch.positions, device)
        self.d_block_tables = _t(batch.block_tables, device).view(batch.n_sequences, batch.max_blocks_per_seq)
        self.d_context_lens = _t(batch.context_lens, device)
        self.n_sequences, self.max_blocks_per_seq = batch.n_sequences, batch.max_blocks_per_seq
        return self


class GPUBatchPool:
    """Pre-allocated device memory for stable CUDA Graph pointers."""

    def __init__(self, variant, device):
        self.variant, self.device = variant, device

    def allocate(self, max_batch_size, max_blocks_per_seq):
        self.max_blocks_per_seq_ = max_blocks_per_seq
        self.last_upload_n_blocks_ = -1
        self.last_upload_first_block_ = -1
        self.d_token_ids_ = torch.zeros(max_batch_size, dtype=torch.long, device=self.device)
        self.d_positions_ = torch.zeros(max_batch_size, dtype=torch.long, device=self.device)
        self.d_block_tables_ = torch.zeros(max_batch_size, max_blocks_per_seq, dtype=torch.long, device=self.device)
        self.d_context_lens_ = torch.zeros(max_batch_size, dtype=torch.long, device=self.device)
        self.d_sample_result_ = torch.zeros(1, dtype=torch.long, device=self.device)

    def upload_into_pool(self, batch: Batch) -> GPUBatch:
        n = batch.n_sequences
        self.d_token_ids_[:n].copy_(_t(batch.token_ids, self.device))
        self.d_positions_[:n].copy_(_t(batch.positions, self.device))
        self.d_context_lens_[:n].copy_(_t(batch.context_lens, self.device))
        n_blocks = len(batch.block_tables) // n
        first_block = batch.block_tables[0]
        if self.variant == "bug":
            skip = n == 1 and n_blocks == self.last_upload_n_blocks_
        else:
            skip = n == 1 and n_blocks == self.last_upload_n_blocks_ and first_block == self.last_upload_first_block_
        if skip:
            pass                        # Skip -- block_table content is identical to last upload
        else:
            self.d_block_tables_[:n].copy_(_t(batch.block_tables, self.device).view(n, batch.max_blocks_per_seq))
            self.last_upload_n_blocks_ = n_blocks if n == 1 else -1
            self.last_upload_first_block_ = first_block if n == 1 else -1
        return GPUBatch(self.d_token_ids_[:n], self.d_positions_[:n], self.d_block_tables_[:n],
                        self.d_context_lens_[:n], n, batch.max_blocks_per_seq)


def forward_logits(model, kv_cache, token_ids, positions, block_tables, context_lens):
    """Decode forward: write this token's key into its paged slot, attend over the context (values = keys)."""
    h = model.emb[token_ids]
    slot = block_tables.gather(1, (positions // BLOCK)[:, None])[:, 0] * BLOCK + positions % BLOCK
    kv_cache.index_copy_(0, slot, h @ model.wk)
    pos = model.ctx_pos
    k = kv_cache[block_tables[:, pos // BLOCK] * BLOCK + pos % BLOCK]              # [seqs, ctx, DIM]
    scores = (k @ (h @ model.wq)[:, :, None]).squeeze(-1)
    scores = scores.masked_fill(pos[None, :] >= context_lens[:, None], -1e9)
    return ((torch.softmax(scores, -1)[:, :, None] * k).sum(1) + h) @ model.lm_head


def sample_greedy_device(logits, d_sample_result):
    d_sample_result.copy_(logits[0].argmax()[None])


class CudaGraphRunner:
    """``execute``: warmup steps run eagerly; the first post-warmup step captures and replays at once (a
    capture records without executing); later steps replay."""

    def __init__(self, device, static, state):
        self.device, self.static, self.state = device, static, state
        self.step_count_, self.warmup_steps_, self.graph_ = 0, 1, None

    def set_decode_fn(self, fn):
        self.decode_fn_ = fn

    def execute(self):
        if self.step_count_ < self.warmup_steps_:
            self.step_count_ += 1
            return self.decode_fn_()
        if self.graph_ is None:
            self.graph_, self.outputs_ = capture(self.decode_fn_, device=self.device, warmups=0, name="decode bs 1",
                                                 owner="imp CudaGraphRunner (decode)",
                                                 static=self.static, state=self.state)
        self.step_count_ += 1
        return replay(self.graph_, self.outputs_)


class KVCacheManager:
    def __init__(self):
        self.free, self.tables = list(range(NUM_BLOCKS)), {}

    def ensure(self, req_id, ctx_len):
        table = self.tables.setdefault(req_id, [])
        while len(table) * BLOCK < ctx_len:
            table.append(self.free.pop(0))
        return table

    def free_sequence(self, req_id):
        self.free.extend(self.tables.pop(req_id))


class Engine:
    def __init__(self, model, device, variant, use_cuda_graphs):
        self.model, self.device, self.use_cuda_graphs = model, device, use_cuda_graphs
        self.kv_cache = torch.zeros(NUM_BLOCKS * BLOCK, DIM, device=device)
        self.kv_manager_ = KVCacheManager()
        self.decode_batch_pool_ = None
        if use_cuda_graphs:
            self.decode_batch_pool_ = GPUBatchPool(variant, device)
            self.decode_batch_pool_.allocate(MAX_BATCH, MAX_BLOCKS_PER_SEQ)
            p = self.decode_batch_pool_
            self.decode_graph_runner_ = CudaGraphRunner(
                device, static={"d_token_ids_": p.d_token_ids_, "d_positions_": p.d_positions_,
                                "d_block_tables_": p.d_block_tables_, "d_context_lens_": p.d_context_lens_},
                state={"kv_cache": self.kv_cache})

    def prefill(self, req_id, prompt):
        """Prefill (eager in both runs): write every prompt key; the last position's logits give the token."""
        table = self.kv_manager_.ensure(req_id, len(prompt))
        logits = None
        for pos, tok in enumerate(prompt):
            logits = forward_logits(self.model, self.kv_cache, _t([tok], self.device), _t([pos], self.device),
                                    _t([table], self.device), _t([pos + 1], self.device))
        return logits.clone(), int(logits[0].argmax())

    def decode_step(self, req_id, last_token, ctx_len):
        table = self.kv_manager_.ensure(req_id, ctx_len)
        builder = BatchBuilder()
        builder.add_decode_sequence(last_token, ctx_len - 1, table, len(table), ctx_len)
        batch = builder.build()
        if self.decode_batch_pool_ is not None:
            pool_max = self.decode_batch_pool_.max_blocks_per_seq_
            if batch.max_blocks_per_seq < pool_max:      # pad the block-table stride to the pool's
                batch.block_tables = batch.block_tables + [0] * (pool_max - batch.max_blocks_per_seq)
                batch.max_blocks_per_seq = pool_max
            gpu_batch = self.decode_batch_pool_.upload_into_pool(batch)
        else:
            gpu_batch = GPUBatch().upload(batch, self.device)
        m, kv = self.model, self.kv_cache
        if self.use_cuda_graphs:
            sample = self.decode_batch_pool_.d_sample_result_

            def decode_fn():
                logits = forward_logits(m, kv, gpu_batch.d_token_ids, gpu_batch.d_positions,
                                        gpu_batch.d_block_tables, gpu_batch.d_context_lens)
                sample_greedy_device(logits, sample)
                return logits, sample

            self.decode_graph_runner_.set_decode_fn(decode_fn)
            logits, token = self.decode_graph_runner_.execute()
        else:
            logits = forward_logits(m, kv, gpu_batch.d_token_ids, gpu_batch.d_positions, gpu_batch.d_block_tables,
                                    gpu_batch.d_context_lens)
            token = logits[0].argmax()[None]
        return logits.clone(), int(token[0])

    def generate(self, req_id, prompt, max_tokens):
        logits, tok = self.prefill(req_id, prompt)
        outs = [logits]
        ctx = len(prompt)
        for _ in range(max_tokens):
            ctx += 1
            logits, tok = self.decode_step(req_id, tok, ctx)
            outs.append(logits)
        self.kv_manager_.free_sequence(req_id)
        return outs


def run(variant: str, device: str = "cpu"):
    model = Model(device)

    def serve(use_cuda_graphs: bool):
        engine = Engine(model, device, variant, use_cuda_graphs)
        outs = engine.generate(1, [3, 9, 4, 1, 7], max_tokens=3)      # blocks [0, 1]
        outs += engine.generate(2, [5, 2, 8, 6, 11, 13], max_tokens=2)  # blocks [2, 3]: same count, other pages
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
