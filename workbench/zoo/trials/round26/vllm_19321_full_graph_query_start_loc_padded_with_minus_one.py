"""FULL-graph padded requests get ``query_start_loc = -1``: FA3's varlen tile schedule then skips real query rows.

Upstream: https://github.com/vllm-project/vllm/pull/19321 ("[full_graph] Fix query_start_loc padding", merged
June 2025), a follow-up to the FULL-graph support of https://github.com/vllm-project/vllm/pull/16072.
Symptom: with ``compilation_config.full_cuda_graph`` on FlashAttention 3 (vLLM V1), batches replayed through a
FULL graph captured for more requests than the batch has get wrong attention outputs; the same batches run
eagerly are right. (The PR states the cause, not a user report: FlashAttention requires a non-decreasing
``query_start_loc``.)
Mechanism: ``GPUModelRunner._prepare_inputs`` copies the step's ``query_start_loc[:num_reqs + 1]`` into the
persistent buffer and, since #16072, fills the rest with ``-1`` (``self.query_start_loc[num_reqs + 1:].fill_(-1)``;
``seq_lens[num_reqs:]`` with 0, ``slot_mapping`` tail with -1). A FULL graph captured by ``_dummy_run`` for N tokens
(N one-token requests) bakes ``query_start_loc[:N + 1]`` / ``seq_lens[:N]`` / ``block_table[:N]`` into
``flash_attn_varlen_func``, so a batch of ``num_reqs < N`` requests hands the kernel ``cu_seqlens_q = [0, ..., T,
-1, ..., -1]``: the first padded request has a negative length. FA3's varlen scheduler turns each request's length
into a count of M-blocks and walks their prefix sum; the negative count shrinks the total, the schedule ends early
and the last real query rows are never computed. Eager steps pass ``query_start_loc[:num_reqs + 1]`` only.
Doctor: stale-padding, at ``flash_attn_varlen_func`` (the real rows it computes depend on what the padded
``query_start_loc`` entries hold).
Fix (upstream): pad ``query_start_loc`` to be non-decreasing: ``self.query_start_loc[num_reqs + 1:].fill_(
self.query_start_loc_cpu[num_reqs].item())`` (comment: "as kernels like FlashAttention requires that"); padded
requests then have length 0.
Read: the pre-fix fill (``fill_(-1)``) in #16072's diff and its review thread, and the post-fix
``_prepare_inputs`` of the V1 runner (mid-2025) with the fill and its comment; the diff of #19321 is inferred from
the two. How FA3 reacts to a decreasing ``cu_seqlens_q`` is not described upstream: the M-block count by truncating
division and the prefix-sum tile walk modelled in ``flash_attn_varlen_func`` are our reading of its varlen
scheduler (here BLOCK_M = 2 rows, one head, keys = values). The output buffer is zeroed (``torch.empty``
upstream) so that the skipped rows are deterministic.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/19321"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "flash_attn_varlen_func"
SYMPTOM = "FULL-graph replays of batches with fewer requests than captured skip real query rows (-1 padded cu_seqlens_q)"

VOCAB, DIM = 16, 4
BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS = 2, 8, 3
MAX_MODEL_LEN = BLOCK_SIZE * MAX_BLOCKS
CAPTURE_SIZES = [2, 4]                         # FULL graphs; _dummy_run uses one token per request
MAX_NUM_TOKENS = MAX_NUM_REQS = CAPTURE_SIZES[-1]
BLOCK_M = 2                                    # FA3 kBlockM (query rows per tile)
MAX_TILES = MAX_NUM_TOKENS // BLOCK_M + MAX_NUM_REQS
PAD_SLOT_ID, NULL_BLOCK = -1, 0


class Model:
    def __init__(self, device):
        gen = generator(19321)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos_emb = randn(MAX_MODEL_LEN, DIM, gen=gen, device=device, scale=0.3)
        self.wq = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.wk = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.wo = randn(DIM, DIM, gen=gen, device=device, scale=0.7)


def reshape_and_cache_flash(key, kv_cache, slot_mapping):
    """Write each token's key at its slot; ``PAD_SLOT_ID`` entries are skipped."""
    valid = slot_mapping >= 0
    slots = slot_mapping.clamp(min=0)
    kv_cache[slots] = torch.where(valid[:, None], key, kv_cache[slots])


def flash_attn_varlen_func(q, kv_cache, cu_seqlens_q, seqused_k, block_table):
    """Varlen causal attention over the paged cache (values = keys), scheduled like FA3: each request gets
    ``(seqlen_q + BLOCK_M - 1) / BLOCK_M`` M-blocks (C division, truncating toward zero), the tiles walk the prefix
    sum of those counts, and a tile past the total does nothing."""
    num_rows, device = q.shape[0], q.device
    num_batch = cu_seqlens_q.shape[0] - 1
    seqlen_q = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    num_m_blocks = torch.div(seqlen_q + BLOCK_M - 1, BLOCK_M, rounding_mode="trunc")
    cum_blocks = torch.cumsum(num_m_blocks, 0)
    tile = torch.arange(MAX_TILES, device=device)
    bidb = (cum_blocks[None, :] <= tile[:, None]).sum(1).clamp(max=num_batch - 1)
    m_block = tile - (cum_blocks[bidb] - num_m_blocks[bidb])
    start, end = cu_seqlens_q[bidb], cu_seqlens_q[bidb + 1]
    rows = start[:, None] + m_block[:, None] * BLOCK_M + torch.arange(BLOCK_M, device=device)[None, :]
    valid = ((tile < cum_blocks[-1])[:, None] & (rows >= start[:, None]) & (rows < end[:, None])
             & (rows >= 0) & (rows < num_rows))
    safe_rows = torch.where(valid, rows, torch.full_like(rows, num_rows))    # a scratch row for idle lanes
    q_tiles = torch.cat([q, q.new_zeros(1, DIM)])[safe_rows]                  # [tiles, BLOCK_M, DIM]
    ctx = torch.arange(MAX_MODEL_LEN, device=device)
    slots = block_table[bidb][:, ctx // BLOCK_SIZE] * BLOCK_SIZE + ctx % BLOCK_SIZE
    k = kv_cache[slots]                                                       # [tiles, ctx, DIM]
    seq_k = seqused_k[bidb]
    q_pos = seq_k[:, None] - (end - start)[:, None] + (rows - start[:, None])
    keep = (ctx[None, None, :] <= q_pos[:, :, None]) & (ctx[None, None, :] < seq_k[:, None, None])
    scores = torch.einsum("tbd,tcd->tbc", q_tiles, k).masked_fill(~keep, -1e9)
    o = torch.einsum("tbc,tcd->tbd", torch.softmax(scores, -1), k)
    out = q.new_zeros(num_rows + 1, DIM)                                      # torch.empty upstream
    out.index_put_((safe_rows.reshape(-1),), o.reshape(-1, DIM))
    return out[:num_rows]


def forward(model, kv_cache, input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_table):
    h = model.emb[input_ids] + model.pos_emb[positions]
    reshape_and_cache_flash(h @ model.wk, kv_cache, slot_mapping)
    attn = flash_attn_varlen_func(h @ model.wq, kv_cache, query_start_loc, seq_lens, block_table)
    return h + attn @ model.wo


class GPUModelRunner:
    def __init__(self, model, device, variant, graphed):
        self.model, self.device, self.variant, self.graphed = model, device, variant, graphed
        self.kv_cache = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, DIM, device=device)
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, **long)
        self.positions = torch.zeros(MAX_NUM_TOKENS, **long)
        self.slot_mapping = torch.full((MAX_NUM_TOKENS,), PAD_SLOT_ID, **long)
        self.query_start_loc = torch.zeros(MAX_NUM_REQS + 1, **long)
        self.query_start_loc_cpu = torch.zeros(MAX_NUM_REQS + 1, dtype=torch.long)
        self.seq_lens = torch.zeros(MAX_NUM_REQS, **long)
        self.block_table = torch.zeros(MAX_NUM_REQS, MAX_BLOCKS, **long)
        self.graphs = {}
        if graphed:
            self.capture_model()

    def _metadata(self, num_tokens, num_reqs):
        return (self.input_ids[:num_tokens], self.positions[:num_tokens], self.slot_mapping[:num_tokens],
                self.query_start_loc[:num_reqs + 1], self.seq_lens[:num_reqs], self.block_table[:num_reqs])

    def capture_model(self):
        for size in reversed(CAPTURE_SIZES):
            num_reqs = min(size, MAX_NUM_REQS)               # _dummy_run: one token per request
            self.query_start_loc[:num_reqs + 1].copy_(torch.arange(num_reqs + 1))
            self.seq_lens[:num_reqs].fill_(MAX_MODEL_LEN)    # max_model_len at capture (#19106)
            meta = self._metadata(size, num_reqs)
            self.graphs[size] = capture(
                lambda meta=meta: forward(self.model, self.kv_cache, *meta), device=self.device,
                name=f"FULL size {size}", owner="GPUModelRunner (FULL graphs)",
                static={"input_ids": self.input_ids, "positions": self.positions,
                        "slot_mapping": self.slot_mapping, "query_start_loc": self.query_start_loc,
                        "seq_lens": self.seq_lens, "block_table": self.block_table},
                state={"kv_cache": self.kv_cache})

    def _prepare_inputs(self, scheduled):
        """``scheduled``: per request, (block ids, its new token ids, position of the first)."""
        t = lambda xs: torch.tensor(xs, dtype=torch.long).to(self.device)  # noqa: E731
        ids, pos, slots, cu, seq_lens, blocks = [], [], [], [0], [], []
        for block_ids, tokens, start in scheduled:
            for i, tok in enumerate(tokens):
                p = start + i
                ids.append(tok)
                pos.append(p)
                slots.append(block_ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
            cu.append(cu[-1] + len(tokens))
            seq_lens.append(start + len(tokens))
            blocks.append(block_ids + [NULL_BLOCK] * (MAX_BLOCKS - len(block_ids)))
        num_tokens, num_reqs = len(ids), len(scheduled)
        self.input_ids[:num_tokens].copy_(t(ids))
        self.positions[:num_tokens].copy_(t(pos))
        self.slot_mapping[:num_tokens].copy_(t(slots))
        self.block_table[:num_reqs].copy_(t(blocks))
        self.query_start_loc_cpu[:num_reqs + 1] = torch.tensor(cu)
        self.query_start_loc[:num_reqs + 1].copy_(self.query_start_loc_cpu[:num_reqs + 1].to(self.device))
        self.seq_lens[:num_reqs].copy_(t(seq_lens))
        # Fill unused with -1. Needed for reshape_and_cache
        self.slot_mapping[num_tokens:].fill_(PAD_SLOT_ID)
        self.seq_lens[num_reqs:].fill_(0)
        if self.variant == "fix":
            # Note: pad query_start_loc to be non-decreasing, as kernels
            # like FlashAttention requires that
            self.query_start_loc[num_reqs + 1:].fill_(self.query_start_loc_cpu[num_reqs].item())
        else:
            self.query_start_loc[num_reqs + 1:].fill_(-1)
        return num_tokens, num_reqs

    def execute_model(self, scheduled):
        num_tokens, num_reqs = self._prepare_inputs(scheduled)
        if not self.graphed:
            return forward(self.model, self.kv_cache, *self._metadata(num_tokens, num_reqs)).clone()
        size = next(s for s in CAPTURE_SIZES if s >= num_tokens)
        g, out = self.graphs[size]
        padded = {"input_ids": self.input_ids, "positions": self.positions}   # left as they were
        return replay(g, out, real=num_tokens, size=size, padded=padded)[:num_tokens].clone()


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    gen = generator(1932)
    tok = lambda n: torch.randint(0, VOCAB, (n,), generator=gen).tolist()  # noqa: E731
    A, B, C = [1, 2, 3], [4, 5], [6]                                        # block ids per request
    steps = [
        [(A, tok(3), 0), (B, tok(1), 0)],               # mixed prefill: 4 tokens, 2 of the 4 captured requests
        [(A, tok(1), 3), (B, tok(1), 1)],               # decode of 2: the size-2 graph, no padded request
        [(A, tok(1), 4), (B, tok(1), 2), (C, tok(1), 0)],   # 3 tokens / 3 requests in the size-4 graph
        [(A, tok(1), 5), (B, tok(1), 3), (C, tok(1), 1)],
    ]

    def serve(graphed: bool):
        runner = GPUModelRunner(model, device, variant, graphed)
        return [runner.execute_model(s) for s in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
