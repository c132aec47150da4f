"""Decode CUDA-graph padding rows carry undefined (NaN) K/V and store it into the reserved KV slot 0, which every real row's attention tile loads as page-table padding: ``0 * NaN`` poisons the real outputs.

Upstream: https://github.com/sgl-project/sglang/pull/32477 ("[Kernel] Skip KV writes to reserved padding slots",
sgl-project/sglang, merged 2026-07-27). Read: the PR description (motivation: "CUDA-graph padding rows can contain
undefined K/V values while still targeting the reserved padding slot at index 0. In sliding-window attention,
page-table padding also points at that reserved page. A partially valid tile may load the page before masking
invalid lanes, allowing a NaN value to contaminate the result through ``0 * NaN``"; changes: a
``reserved_skip_index`` argument to the JIT KV-cache store kernel, default 0), a later stored version of
``python/sglang/kernels/ops/kvcache/kvcache.py`` (``store_cache(..., reserved_skip_index: int = 0)``: "writes
targeting this index are skipped"), the follow-ups #35351 (mxfp8 pool: "padding lanes carry undefined activations
(upstream model kernels legitimately leave rows past the real token count uninitialized)"; "a NaN V defeats
probability masking") and issue #36207 (MLA writers), and sglang's ``_mask_topk_ids_padded_region`` (``topk_ids[
indices >= num_token_non_padded, :] = -1``). Not read: the CUDA kernel diff (``kvcache.cuh``) and its tests.
Symptom: with CUDA graphs on, a decode batch padded to a larger captured size produces NaN attention outputs / logits
for the *real* requests (garbage text); eager, or a batch that exactly fits a captured size, is fine.
Mechanism: ``CudaGraphRunner.replay_prepare`` pads ``raw_bs`` to the captured ``bs``: padded rows get
``seq_lens = seq_len_fill_value``, ``out_cache_loc = 0`` (the reserved padding slot) and req-pool index 0, and
``num_token_non_padded = raw_bs``. In the model, ``select_experts`` masks the padded rows' ``topk_ids`` to -1, so the
fused-MoE kernels never write those rows of their ``torch.empty`` intermediate: the padded rows' hidden states are
undefined. Their K/V are then stored by ``MHATokenToKVPool.set_kv_buffer`` -> ``store_cache`` at ``out_cache_loc`` = 0,
poisoning the reserved slot. Every real request's decode attention loads a full tile of page-table entries; entries
past its length (and outside its sliding window) are padding, i.e. slot 0. The masked lanes get probability 0, but
``0 * NaN = NaN`` in the P.V accumulation, so the real rows' outputs become NaN.
Doctor: stale-padding, at store_cache. Real rows' outputs depend on what the graph's padded rows hold: the padded
rows' undefined K/V reach the real rows through the reserved slot they are stored into.
Fix (upstream): ``store_cache`` skips K/V writes whose index is ``reserved_skip_index`` (slot 0 by default), so the
reserved page keeps its zeros and masked lanes contribute ``0 * 0``.
Modelled: ``CudaGraphRunner`` (capture in reverse bs order into one shared pool, ``replay_prepare`` padding as
upstream, ``num_token_non_padded``), ``ForwardBatch``, ``ReqToTokenPool.req_to_token`` (row 0 reserved, zero),
``MHATokenToKVPool`` (slot 0 reserved, the allocator hands out slots from 1), ``store_cache`` (the kernel as an index
write; the fix's skip as a ``where``), a one-layer MoE decoder: embedding + position embedding (RoPE stand-in), a
fused MoE (router, ``select_experts`` with ``_mask_topk_ids_padded_region``, ``fused_experts`` writing only rows
whose expert id is valid into a ``torch.empty`` intermediate, then ``moe_sum``), and one sliding-window decode
attention layer that loads a whole tile of ``req_to_token`` entries and masks invalid lanes after the load. On the
CPU the unwritten intermediate rows hold the capture's poison (NaN); on CUDA they hold whatever the graph pool's
bytes are, so a NaN there is not guaranteed. Prefill is an eager stand-in that writes the prompts' K/V.
Sizes: hidden 8, vocab 16, 4 experts top-2, tile 10 positions, sliding window 4, capture sizes [1, 2, 4], float64.
Workload: requests A, B, C (prompt lengths 3, 4, 2) decode 3 steps together (raw_bs 3 padded to the bs-4 graph: one
padded row, whose NaN K/V go to slot 0, so all three real rows' logits turn NaN), then C finishes and A, B decode
2 more steps (bs 2, no padding, but slot 0 keeps the NaN). Greedy next tokens feed the following step.
"""
from __future__ import annotations

import bisect
import dataclasses

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/32477"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "store_cache"
SYMPTOM = ("decode with CUDA graphs, 3 requests padded to the bs-4 graph: the padded row's MoE output is left "
           "undefined (NaN), its K/V are stored into reserved slot 0, and every real row's attention tile loads "
           "slot 0 as page-table padding: 0 * NaN makes the real logits NaN")

HIDDEN, VOCAB, NUM_EXPERTS, TOPK, FFN = 8, 16, 4, 2, 8
TILE = 10                     # positions one attention tile loads per request (max context)
SLIDING_WINDOW = 4
MAX_REQS = 4
KV_SIZE = 1 + MAX_REQS * TILE       # slot 0: the reserved CUDA-graph padding slot
CUDA_GRAPH_BS = [1, 2, 4]
SEQ_LEN_FILL_VALUE = 1
DT = torch.float64

_variant = "bug"


def store_cache(k, v, k_cache, v_cache, indices, *, reserved_skip_index: int = -1):
    """The JIT KV-cache store kernel: row ``i`` of k/v goes to ``k_cache[indices[i]]`` (the hazard site)."""
    if reserved_skip_index >= 0:            # upstream fix: writes targeting the reserved slot are skipped
        skip = (indices == reserved_skip_index).unsqueeze(-1)
        k = torch.where(skip, k_cache[indices], k)
        v = torch.where(skip, v_cache[indices], v)
    k_cache[indices] = k
    v_cache[indices] = v


class MHATokenToKVPool:
    def __init__(self, device):
        self.k_buffer = torch.zeros(KV_SIZE, HIDDEN, dtype=DT, device=device)
        self.v_buffer = torch.zeros(KV_SIZE, HIDDEN, dtype=DT, device=device)
        self.free_slot = 1                   # slot 0 is never handed to a request

    def alloc(self, n):
        out = torch.arange(self.free_slot, self.free_slot + n)
        self.free_slot += n
        return out

    def set_kv_buffer(self, loc, cache_k, cache_v):
        store_cache(cache_k, cache_v, self.k_buffer, self.v_buffer, loc,
                    reserved_skip_index=0 if _variant == "fix" else -1)


@dataclasses.dataclass
class ForwardBatch:
    batch_size: int
    input_ids: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    positions: torch.Tensor
    num_token_non_padded: torch.Tensor | None = None


def _mask_topk_ids_padded_region(topk_ids, num_token_non_padded):
    if num_token_non_padded is None:
        return
    indices = torch.arange(0, topk_ids.shape[0], device=topk_ids.device)
    topk_ids[indices >= num_token_non_padded, :] = -1


class FusedMoE:
    def __init__(self, r):
        self.gate = r(HIDDEN, NUM_EXPERTS)
        self.w1 = r(NUM_EXPERTS, HIDDEN, FFN)
        self.w2 = r(NUM_EXPERTS, FFN, HIDDEN)

    def select_experts(self, x, num_token_non_padded):
        scores = torch.softmax(x @ self.gate, dim=-1)
        topk_weights, topk_ids = torch.topk(scores, TOPK, dim=-1)
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        _mask_topk_ids_padded_region(topk_ids, num_token_non_padded)
        return topk_weights, topk_ids

    def fused_experts(self, x, topk_weights, topk_ids):
        """Rows whose expert id is -1 (padded tokens) are never written by the expert kernels."""
        intermediate_cache3 = torch.empty(x.shape[0], TOPK, HIDDEN, dtype=x.dtype, device=x.device)
        for j in range(TOPK):
            e = topk_ids[:, j]
            idx = e.clamp(min=0)
            h = torch.nn.functional.silu(torch.bmm(x.unsqueeze(1), self.w1[idx])).squeeze(1)
            out = torch.bmm(h.unsqueeze(1), self.w2[idx]).squeeze(1) * topk_weights[:, j:j + 1]
            intermediate_cache3[:, j] = torch.where((e >= 0).unsqueeze(-1), out, intermediate_cache3[:, j])
        return intermediate_cache3.sum(dim=1)            # moe_sum

    def forward(self, x, num_token_non_padded):
        topk_weights, topk_ids = self.select_experts(x, num_token_non_padded)
        return self.fused_experts(x, topk_weights, topk_ids)


class Model:
    """Embedding, a fused-MoE block, one sliding-window attention layer, the lm head."""

    def __init__(self, device, req_to_token, kv_pool):
        gen = generator(32477)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).to(DT)  # noqa: E731
        self.embed, self.pos_embed = r(VOCAB, HIDDEN, scale=1.0), r(TILE, HIDDEN, scale=0.3)
        self.moe = FusedMoE(r)
        self.wq, self.wk, self.wv, self.wo = (r(HIDDEN, HIDDEN) for _ in range(4))
        self.lm_head = r(HIDDEN, VOCAB, scale=0.8)
        self.req_to_token, self.kv_pool = req_to_token, kv_pool

    def qkv(self, input_ids, positions, num_token_non_padded=None):
        x = self.embed[input_ids] + self.pos_embed[positions]
        x = x + self.moe.forward(x, num_token_non_padded)
        return x, x @ self.wq, x @ self.wk, x @ self.wv

    def forward_decode_attention(self, q, k, v, fb: ForwardBatch):
        self.kv_pool.set_kv_buffer(fb.out_cache_loc, k, v)
        j = torch.arange(TILE, device=q.device)
        slots = self.req_to_token[fb.req_pool_indices]               # the tile's page-table entries
        keys, vals = self.kv_pool.k_buffer[slots], self.kv_pool.v_buffer[slots]
        scores = (keys * q.unsqueeze(1)).sum(-1) * HIDDEN ** -0.5
        seq = fb.seq_lens.unsqueeze(1)
        valid = (j.unsqueeze(0) < seq) & (j.unsqueeze(0) >= seq - SLIDING_WINDOW)
        p = torch.softmax(scores.masked_fill(~valid, float("-inf")), dim=-1)
        return (p.unsqueeze(-1) * vals).sum(1)                     # masked lanes: 0 * V[slot 0]

    def forward(self, fb: ForwardBatch):
        x, q, k, v = self.qkv(fb.input_ids, fb.positions, fb.num_token_non_padded)
        h = x + self.forward_decode_attention(q, k, v, fb) @ self.wo
        return h @ self.lm_head


class CudaGraphRunner:
    def __init__(self, model: Model, device):
        self.model, self.device = model, device
        self.capture_bs, self.max_bs = CUDA_GRAPH_BS, max(CUDA_GRAPH_BS)
        self.seq_len_fill_value = SEQ_LEN_FILL_VALUE
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(self.max_bs, **i64)
        self.req_pool_indices = torch.zeros(self.max_bs, **i64)
        self.seq_lens = torch.full((self.max_bs,), self.seq_len_fill_value, **i64)
        self.out_cache_loc = torch.zeros(self.max_bs, **i64)
        self.positions = torch.zeros(self.max_bs, **i64)
        self.num_token_non_padded = torch.zeros((), **i64)
        self.graphs, self.output_buffers = {}, {}
        self.pool = graph_pool_handle(device)                 # global_graph_memory_pool
        self.capture()

    def _batch(self, bs):
        return ForwardBatch(bs, self.input_ids[:bs], self.req_pool_indices[:bs], self.seq_lens[:bs],
                            self.out_cache_loc[:bs], self.positions[:bs], self.num_token_non_padded)

    def capture(self):
        for bs in reversed(self.capture_bs):    # reverse order: better memory sharing across graphs
            self.capture_one_batch_size(bs)

    def capture_one_batch_size(self, bs):
        self.num_token_non_padded.fill_(bs)
        fb = self._batch(bs)
        g, out = capture(lambda: self.model.forward(fb), device=self.device, pool=self.pool, warmups=2,
                         name=f"decode bs={bs}", owner="CudaGraphRunner",
                         static={"input_ids": self.input_ids, "req_pool_indices": self.req_pool_indices,
                                 "seq_lens": self.seq_lens, "out_cache_loc": self.out_cache_loc,
                                 "positions": self.positions, "num_token_non_padded": self.num_token_non_padded,
                                 "req_to_token": self.model.req_to_token},
                         state={"k_buffer": self.model.kv_pool.k_buffer, "v_buffer": self.model.kv_pool.v_buffer})
        self.graphs[bs], self.output_buffers[bs] = g, out

    def replay_prepare(self, fb: ForwardBatch):
        raw_bs = fb.batch_size
        bs = self.capture_bs[bisect.bisect_left(self.capture_bs, raw_bs)]
        if bs != raw_bs:
            self.seq_lens.fill_(self.seq_len_fill_value)
            self.out_cache_loc.zero_()
            self.req_pool_indices.zero_()
            self.positions.zero_()
        self.input_ids[:raw_bs].copy_(fb.input_ids)
        self.req_pool_indices[:raw_bs].copy_(fb.req_pool_indices)
        self.seq_lens[:raw_bs].copy_(fb.seq_lens)
        self.out_cache_loc[:raw_bs].copy_(fb.out_cache_loc)
        self.positions[:raw_bs].copy_(fb.positions)
        self.num_token_non_padded.fill_(raw_bs)
        return raw_bs, bs

    def replay(self, fb: ForwardBatch):
        raw_bs, bs = self.replay_prepare(fb)
        logits = replay(self.graphs[bs], self.output_buffers[bs], real=raw_bs, size=bs,
                        padded={"input_ids": self.input_ids})
        return logits[:raw_bs]


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    prompts = {"A": [3, 7, 1], "B": [5, 2, 9, 4], "C": [11, 6]}
    schedule = ["ABC", "ABC", "ABC", "AB", "AB"]

    def serve(use_cuda_graph: bool):
        req_to_token = torch.zeros(MAX_REQS + 1, TILE, dtype=torch.int64, device=device)  # row 0 reserved
        kv_pool = MHATokenToKVPool(device)
        model = Model(device, req_to_token, kv_pool)
        runner = CudaGraphRunner(model, device) if use_cuda_graph else None
        req_idx = {rid: i + 1 for i, rid in enumerate(prompts)}
        seq_lens, last = {}, {}
        for rid, toks in prompts.items():                   # eager prefill stand-in: the prompt's K/V
            n = len(toks)
            slots = kv_pool.alloc(n).to(device)
            req_to_token[req_idx[rid], :n] = slots
            _, _, k, v = model.qkv(torch.tensor(toks, device=device), torch.arange(n, device=device))
            store_cache(k, v, kv_pool.k_buffer, kv_pool.v_buffer, slots)
            seq_lens[rid], last[rid] = n, toks[-1]
        outs = []
        for names in schedule:
            loc = kv_pool.alloc(len(names)).to(device)
            for i, rid in enumerate(names):
                req_to_token[req_idx[rid], seq_lens[rid]] = loc[i]
                seq_lens[rid] += 1
            fb = ForwardBatch(len(names), torch.tensor([last[r] for r in names], device=device),
                              torch.tensor([req_idx[r] for r in names], device=device),
                              torch.tensor([seq_lens[r] for r in names], device=device), loc,
                              torch.tensor([seq_lens[r] - 1 for r in names], device=device))
            logits = runner.replay(fb) if runner is not None else model.forward(fb)
            logits = logits.clone()
            for rid, tok in zip(names, logits.argmax(-1).tolist()):
                last[rid] = tok
            outs.append(logits)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
