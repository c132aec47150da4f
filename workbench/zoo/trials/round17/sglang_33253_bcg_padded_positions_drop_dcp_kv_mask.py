"""Breakable-graph prefill hands attention padded positions with real-length cache locations: DCP writes go unmasked.

Upstream: https://github.com/sgl-project/sglang/pull/33253 ("Fix padded positions in breakable CUDA Graph
attention").
Symptom: decode context parallelism (TP16/DCP4, Qwen3.5-397B FP8) with the Breakable CUDA Graph prefill
silently corrupts the KV cache: GSM8K accuracy drops, eager prefill is clean (sglang main, August 2026).
The PR's own regression test saw "five padded positions for three real cache locations".
Mechanism: Breakable CUDA Graph pads the prefill's token buffers to a captured bucket and runs attention
eagerly in a graph break. The break's wrapper (``unified_attention_with_output``) narrows Q/K/V and
``forward_batch.out_cache_loc`` to the real token count but leaves ``forward_batch.positions`` at the padded
bucket length. DCP's EVEN owner rule reads the positions: ``dcp_kv_mask = positions % dcp_size ==
dcp_rank``, guarded by ``positions.numel() == loc.numel()``. With 5 positions against 3 locations the guard
rejects the mask, and a ``None`` mask makes ``set_kv_buffer`` write unmasked: every DCP rank stores every
real token into its compact row ``loc // dcp_size``, so two neighbouring tokens collide in one row and the
row keeps whichever was written last. Attention (now and at every later decode step) reads the wrong K/V.
Doctor: padded-shape-mismatch, at ``unified_attention_with_output`` (code run at the bucket size combines
the bucket-length ``positions`` with the real-length ``out_cache_loc``).
Fix (upstream): narrow ``forward_batch.positions`` to the real token count together with
``out_cache_loc`` for the attention call, and restore both on the shared ``ForwardBatch`` afterwards.
(Modelled: the DCP ranks run in one process, each with its own compact KV pool; reading the union of the
ranks' rows stands for the ranks' partial attentions merged by LSE.)
"""
from __future__ import annotations

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/33253"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "unified_attention_with_output"
SYMPTOM = "DCP KV writes go unmasked under breakable-graph prefill: neighbouring tokens overwrite each other"
VOCAB, HIDDEN, DCP_SIZE, POOL_SIZE, CONTEXT_LEN = 16, 4, 2, 32, 8
PREFILL_BUCKETS = [4, 8]


class ForwardBatch:
    def __init__(self, input_ids, positions, out_cache_loc, req_to_token_row, num_token_non_padded):
        self.input_ids, self.positions, self.out_cache_loc = input_ids, positions, out_cache_loc
        self.req_to_token_row = req_to_token_row          # the request's slots, by position
        self.num_token_non_padded = num_token_non_padded


class DCPTokenToKVPool:
    """Each DCP rank keeps the tokens it owns in a compact pool: global slot ``loc`` -> row ``loc // dcp_size``."""

    def __init__(self, device):
        self.k_buffer = [torch.zeros(POOL_SIZE // DCP_SIZE, HIDDEN, device=device) for _ in range(DCP_SIZE)]
        self.v_buffer = [torch.zeros(POOL_SIZE // DCP_SIZE, HIDDEN, device=device) for _ in range(DCP_SIZE)]

    def set_kv_buffer(self, dcp_rank, loc, cache_k, cache_v, dcp_kv_mask=None):
        if dcp_kv_mask is not None:
            loc, cache_k, cache_v = loc[dcp_kv_mask], cache_k[dcp_kv_mask], cache_v[dcp_kv_mask]
        self.k_buffer[dcp_rank][loc // DCP_SIZE] = cache_k      # unmasked: colliding rows keep the last write
        self.v_buffer[dcp_rank][loc // DCP_SIZE] = cache_v

    def get_kv(self, loc):
        """The union of the ranks' rows: slot ``loc`` lives on rank ``loc % dcp_size``."""
        k = torch.stack(self.k_buffer, dim=1).flatten(0, 1)
        v = torch.stack(self.v_buffer, dim=1).flatten(0, 1)
        return k[loc], v[loc]


def get_dcp_kv_mask(forward_batch, loc, dcp_rank):
    """EVEN owner rule: the token at position ``p`` belongs to rank ``p % dcp_size``."""
    positions = forward_batch.positions
    if positions is None or positions.numel() != loc.numel():
        return None
    return positions % DCP_SIZE == dcp_rank


class RadixAttention:
    """Extend attention with DCP: every rank stores the tokens it owns, then attends over the context."""

    def __init__(self, token_to_kv_pool):
        self.token_to_kv_pool = token_to_kv_pool

    def forward(self, q, k, v, forward_batch):
        loc = forward_batch.out_cache_loc
        for dcp_rank in range(DCP_SIZE):
            mask = get_dcp_kv_mask(forward_batch, loc, dcp_rank)
            self.token_to_kv_pool.set_kv_buffer(dcp_rank, loc, k, v, dcp_kv_mask=mask)
        q_pos = forward_batch.positions[: q.size(0)]
        keys, values = self.token_to_kv_pool.get_kv(forward_batch.req_to_token_row)    # [CONTEXT_LEN, H]
        scores = (q @ keys.T) / HIDDEN ** 0.5
        k_pos = torch.arange(CONTEXT_LEN, device=q.device)
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
        return torch.softmax(scores, -1) @ values


class Model:
    def __init__(self, device):
        gen = generator(33253)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.pos_embed = randn(CONTEXT_LEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.wq, self.wk, self.wv, self.wo = (randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.7)
                                              for _ in range(4))
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.5)

    def qkv_proj(self, input_ids, positions):
        h = self.embed[input_ids] + self.pos_embed[positions]
        return h, h @ self.wq, h @ self.wk, h @ self.wv

    def o_proj(self, h, attn_out):
        return (h + attn_out @ self.wo) @ self.lm_head

    def forward(self, forward_batch, attn):
        h, q, k, v = self.qkv_proj(forward_batch.input_ids, forward_batch.positions)
        return self.o_proj(h, attn.forward(q, k, v, forward_batch))


def unified_attention_with_output(query, key, value, output, forward_batch, attn, variant):
    """The graph break: attention runs eagerly on the bridge buffers, narrowed to the real tokens."""
    num_tokens = forward_batch.num_token_non_padded
    original_out_cache_loc = forward_batch.out_cache_loc
    original_positions = forward_batch.positions
    forward_batch.out_cache_loc = original_out_cache_loc[:num_tokens]
    if variant == "fix":
        forward_batch.positions = original_positions[:num_tokens]
    try:
        ret = attn.forward(query[:num_tokens], key[:num_tokens], value[:num_tokens], forward_batch)
        output[:num_tokens].copy_(ret)
    finally:
        forward_batch.out_cache_loc = original_out_cache_loc
        forward_batch.positions = original_positions


class BreakableCudaGraphRunner:
    """Prefill as graph pieces around an eager attention break, one set per token bucket."""

    def __init__(self, model, attn, variant, device):
        self.model, self.attn, self.variant, self.device = model, attn, variant, device
        max_tokens = PREFILL_BUCKETS[-1]
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.out_cache_loc = torch.zeros(max_tokens, dtype=torch.long, device=device)
        # bridge buffers: q/k/v and the attention output live outside the graphs, at fixed addresses
        self.q, self.k, self.v, self.h, self.attn_out = (torch.zeros(max_tokens, HIDDEN, device=device)
                                                         for _ in range(5))
        self.pool = graph_pool_handle(device)
        self.pieces = {bs: self.capture_one_bucket(bs) for bs in PREFILL_BUCKETS}

    def capture_one_bucket(self, bs):
        def piece0():
            h, q, k, v = self.model.qkv_proj(self.input_ids[:bs], self.positions[:bs])
            for dst, src in ((self.h, h), (self.q, q), (self.k, k), (self.v, v)):
                dst[:bs].copy_(src)
            return self.q[:bs], self.k[:bs], self.v[:bs]

        def piece1():
            return self.model.o_proj(self.h[:bs], self.attn_out[:bs])

        static = {"input_ids": self.input_ids, "positions": self.positions, "attn_out": self.attn_out}
        g0, out0 = capture(piece0, device=self.device, pool=self.pool, name=f"bcg prefill {bs} piece 0",
                           static=static, owner="BreakableCudaGraphRunner")
        g1, out1 = capture(piece1, device=self.device, pool=self.pool, name=f"bcg prefill {bs} piece 1",
                           static=static, owner="BreakableCudaGraphRunner")
        return g0, out0, g1, out1

    def replay(self, forward_batch):
        raw_num_tokens = forward_batch.input_ids.numel()
        bs = next(b for b in PREFILL_BUCKETS if b >= raw_num_tokens)
        self.input_ids.zero_()
        self.positions.zero_()
        self.out_cache_loc.zero_()                            # padded tokens: the reserved slot 0
        self.input_ids[:raw_num_tokens].copy_(forward_batch.input_ids)
        self.positions[:raw_num_tokens].copy_(forward_batch.positions)
        self.out_cache_loc[:raw_num_tokens].copy_(forward_batch.out_cache_loc)
        padded = ForwardBatch(self.input_ids[:bs], self.positions[:bs], self.out_cache_loc[:bs],
                              forward_batch.req_to_token_row, raw_num_tokens)
        g0, out0, g1, out1 = self.pieces[bs]
        replay(g0, out0, real=raw_num_tokens, size=bs)
        unified_attention_with_output(self.q[:bs], self.k[:bs], self.v[:bs], self.attn_out[:bs], padded,
                                      self.attn, self.variant)
        logits = replay(g1, out1, real=raw_num_tokens, size=bs)
        return logits[:raw_num_tokens]


def run(variant: str, device: str = "cpu"):
    # one request; its slots are interleaved so that slot parity == position parity (EVEN DCP layout)
    req_to_token_row = torch.arange(8, 8 + CONTEXT_LEN, device=device)
    prompt = [3, 9, 5]
    decode_tokens = [7, 1]

    def serve(graphed: bool):
        model = Model(device)
        pool = DCPTokenToKVPool(device)
        attn = RadixAttention(pool)
        runner = BreakableCudaGraphRunner(model, attn, variant, device) if graphed else None
        outs = []
        positions = torch.arange(len(prompt), device=device)
        batch = ForwardBatch(torch.tensor(prompt, device=device), positions, req_to_token_row[positions],
                             req_to_token_row, len(prompt))
        logits = runner.replay(batch) if graphed else model.forward(batch, attn)
        outs.append(logits.clone())
        for i, tok in enumerate(decode_tokens):                # decode runs eagerly in both servers
            pos = torch.tensor([len(prompt) + i], device=device)
            batch = ForwardBatch(torch.tensor([tok], device=device), pos, req_to_token_row[pos],
                                 req_to_token_row, 1)
            outs.append(model.forward(batch, attn).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
