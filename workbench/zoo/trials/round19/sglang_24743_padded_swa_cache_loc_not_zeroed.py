"""Padded decode rows keep last replay's SWA cache locations: the captured ``set_kv_buffer`` overwrites live SWA KV.

Upstream: https://github.com/sgl-project/sglang/pull/24743 ("fix(cuda_graph): zero out_cache_loc_swa on pad and
use int32 (hybrid-SWA accuracy fix)").
Symptom: after #23552 pre-computed the SWA cache locations for the decode CUDA graph, hybrid-SWA models
(Gemma, MiMo-V2, DeepSeek V4, ...) lost accuracy with decode CUDA graphs on (a measurable benchmark regression
on MiMo-V2.5 Pro); ``--disable-cuda-graph`` was unaffected (sglang main, May 2026).
Mechanism: ``DecodeInputBuffers`` gained an ``out_cache_loc_swa`` buffer that ``populate_from_forward_batch``
refills for the real tokens ``[:raw_num_token]`` each replay, and the captured graph runs the SWA layers'
``set_kv_buffer`` over the whole ``out_cache_loc_swa[:num_tokens]``. When the batch is padded
(``bs != raw_bs``) the runner resets ``seq_lens`` and zeroes ``out_cache_loc`` (so padded tokens write the
full pool's sentinel slot 0) but left ``out_cache_loc_swa`` alone: its padded rows still hold the real SWA
slots of the requests that filled them on an earlier replay. The padded tokens' junk keys are written into
those slots; a request that still reads them (here a prefix-cache hit on a finished request's tokens) then
attends over corrupted sliding-window KV. The old per-layer translation path did not have this problem
because it derived the SWA location from the zeroed ``out_cache_loc``.
Doctor: stale-padding, at ``populate_from_forward_batch`` (the padded rows' SWA cache locations are left from
an earlier replay, and the captured KV write through them reaches real requests' KV).
Fix (upstream): in the padding branch of ``populate_from_forward_batch`` also ``out_cache_loc_swa.zero_()``, so
padded tokens map to the SWA sentinel slot, as the piecewise runner already did (plus an int64 -> int32
dtype fix for the buffer, not modelled here).
(Tiny model: one full-attention layer and one sliding-window layer, window 2, page size 1, identity
full->SWA slot mapping; prefill KV is written directly as a prefill would leave it.)
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/24743"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "populate_from_forward_batch"
SYMPTOM = "padded decode tokens overwrite live sliding-window KV slots; prefix-cache hits then decode wrong"
VOCAB, DIM, WINDOW, NUM_SLOTS, MAX_REQS, MAX_CTX, MAX_BS = 10, 4, 2, 16, 4, 6, 2
SEQ_LEN_FILL_VALUE = 1


class HybridSWAModel:
    """Layer 0: full attention over ``k_full``; layer 1: sliding-window attention over ``k_swa``."""

    def __init__(self, device):
        gen = generator(24749)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos_embed = randn(MAX_CTX, DIM, gen=gen, device=device, scale=0.5)
        self.wq0, self.wk0, self.wq1, self.wk1 = (randn(DIM, DIM, gen=gen, device=device, scale=0.7)
                                                  for _ in range(4))
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)


class TokenToKVPool:
    """Full pool + SWA pool (``SWAKVPool``); slot 0 of each is the padding sentinel."""

    def __init__(self, device):
        self.k_full = torch.zeros(NUM_SLOTS, DIM, device=device)
        self.k_swa = torch.zeros(NUM_SLOTS, DIM, device=device)
        self.full_to_swa_index_mapping = torch.arange(NUM_SLOTS, device=device)
        self.req_to_token = torch.zeros(MAX_REQS, MAX_CTX, dtype=torch.long, device=device)

    def translate_loc_from_full_to_swa(self, loc):
        return self.full_to_swa_index_mapping[loc]


def attention(q, k_cache, idx, mask):
    k = k_cache[idx]                                            # [bs, ctx, dim]
    scores = (k @ q[:, :, None]).squeeze(-1).masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, -1)[:, :, None] * k).sum(1)


def forward_decode(model, pool, input_ids, positions, req_pool_indices, seq_lens, out_cache_loc,
                   out_cache_loc_swa):
    x = model.embed[input_ids] + model.pos_embed[positions]
    idx = pool.req_to_token[req_pool_indices]
    pos = torch.arange(MAX_CTX, device=x.device)
    mask = pos[None, :] < seq_lens[:, None]
    pool.k_full[out_cache_loc] = x @ model.wk0                  # layer 0 set_kv_buffer (full pool)
    h = x + attention(x @ model.wq0, pool.k_full, idx, mask)
    pool.k_swa[out_cache_loc_swa] = h @ model.wk1               # layer 1 set_kv_buffer fast path (SWA pool)
    window = mask & (pos[None, :] >= seq_lens[:, None] - WINDOW)
    h = h + attention(h @ model.wq1, pool.k_swa, pool.translate_loc_from_full_to_swa(idx), window)
    return h @ model.lm_head


@dataclasses.dataclass
class ForwardBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    out_cache_loc_swa: torch.Tensor


@dataclasses.dataclass
class DecodeInputBuffers:
    input_ids: torch.Tensor
    positions: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    out_cache_loc_swa: torch.Tensor

    @classmethod
    def create(cls, device):
        z = lambda: torch.zeros(MAX_BS, dtype=torch.long, device=device)  # noqa: E731
        return cls(z(), z(), z(), torch.full((MAX_BS,), SEQ_LEN_FILL_VALUE, dtype=torch.long, device=device),
                   z(), z())

    def populate_from_forward_batch(self, forward_batch: ForwardBatch, raw_bs: int, bs: int, variant: str):
        if bs != raw_bs:
            self.seq_lens.fill_(SEQ_LEN_FILL_VALUE)
            self.out_cache_loc.zero_()
            if variant == "fix":
                # Padded SWA indices left over from a previous replay would point into real SWA slots.
                self.out_cache_loc_swa.zero_()
        self.input_ids[:raw_bs].copy_(forward_batch.input_ids)
        self.positions[:raw_bs].copy_(forward_batch.positions)
        self.req_pool_indices[:raw_bs].copy_(forward_batch.req_pool_indices)
        self.seq_lens[:raw_bs].copy_(forward_batch.seq_lens)
        self.out_cache_loc[:raw_bs].copy_(forward_batch.out_cache_loc)
        self.out_cache_loc_swa[:raw_bs].copy_(forward_batch.out_cache_loc_swa)


def run(variant: str, device: str = "cpu"):
    model = HybridSWAModel(device)
    gen = generator(1)
    prefill_k = randn(NUM_SLOTS, 2, DIM, gen=gen, device=device)

    def setup(pool):
        # Prefill left A (req 0) at slots 1, 2 and B (req 1) at slots 3, 4.
        for req, slots in ((0, [1, 2]), (1, [3, 4])):
            pool.req_to_token[req, :2] = torch.tensor(slots, device=device)
            for s in slots:
                pool.k_full[s], pool.k_swa[s] = prefill_k[s, 0], prefill_k[s, 1]

    # (req, token id, position, new full slot) per decode step; B finishes after step 1 and its KV stays in
    # the radix tree; C (req 2) is a prefix-cache hit on B's three tokens.
    steps = [[(0, 5, 2, 5), (1, 7, 2, 6)], [(0, 2, 3, 7)], [(2, 3, 3, 8), (0, 9, 4, 9)]]

    def batch_of(pool, step):
        if any(r == 2 for r, *_ in step):
            pool.req_to_token[2, :3] = pool.req_to_token[1, :3]
        for req, _, p, slot in step:
            pool.req_to_token[req, p] = slot
        t = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
        loc = t([s for *_, s in step])
        return ForwardBatch(t([i for _, i, _, _ in step]), t([p for _, _, p, _ in step]),
                            t([r for r, *_ in step]), t([p + 1 for _, _, p, _ in step]), loc,
                            pool.translate_loc_from_full_to_swa(loc))

    def eager():
        pool = TokenToKVPool(device)
        setup(pool)
        outs = []
        for step in steps:
            fb = batch_of(pool, step)
            outs.append(forward_decode(model, pool, fb.input_ids, fb.positions, fb.req_pool_indices, fb.seq_lens,
                                       fb.out_cache_loc, fb.out_cache_loc_swa))
        return outs

    def served():
        pool = TokenToKVPool(device)
        buffers = DecodeInputBuffers.create(device)
        g, out = capture(lambda: forward_decode(model, pool, buffers.input_ids, buffers.positions,
                                                buffers.req_pool_indices, buffers.seq_lens, buffers.out_cache_loc,
                                                buffers.out_cache_loc_swa),
                         device=device, name=f"decode bs {MAX_BS}", owner="CudaGraphRunner",
                         static=dataclasses.asdict(buffers),
                         state={"k_full": pool.k_full, "k_swa": pool.k_swa, "req_to_token": pool.req_to_token})
        pool.k_full.zero_()                                     # capture-time writes hit the sentinel slot only
        pool.k_swa.zero_()
        setup(pool)
        outs = []
        for step in steps:
            fb = batch_of(pool, step)
            raw_bs = len(step)
            buffers.populate_from_forward_batch(fb, raw_bs, MAX_BS, variant)
            left = {"input_ids": buffers.input_ids, "positions": buffers.positions,
                    "req_pool_indices": buffers.req_pool_indices}
            if variant == "bug":
                left["out_cache_loc_swa"] = buffers.out_cache_loc_swa
            outs.append(replay(g, out, real=raw_bs, size=MAX_BS, padded=left)[:raw_bs].clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
