"""Padded rows of a decode CUDA-graph bucket get block-table entry -1: the paged attention kernel reads out of bounds.

Upstream: https://github.com/NVIDIA/Megatron-LM/pull/5950 ("Fix inference overflow into dummy blocks",
commit 3fd8f33076; its regression test ``test_cuda_graph_padding_uses_dummy_block``: "One real request in a
four-request graph bucket: the padded block-table rows must hold the dummy block index, not the old -1
sentinel (OOB reads)").
Symptom: Megatron-Core dynamic inference with decode CUDA graphs: a step whose request count is below its
graph bucket (e.g. 3 live requests replayed by the 4-request graph) makes the flash-attention kernel read
KV memory at block -1: out-of-bounds reads / illegal memory access (Megatron-LM main, July 2026).
Mechanism: ``initialize_attention_state`` pads the MHA metadata of rows ``[real_bs, padded_bs)``: query and
KV lengths 0, and block-table entries ``-1`` as a "no block" sentinel. The paged flash-attention kernel that
the graph replays has no such sentinel: its page lookup does not skip zero-length rows (the fix's test: "not
the old -1 sentinel (OOB reads)"), so a padded row dereferences ``block_table[row, 0] = -1``. Every replay of
a graph with padded rows reads KV block -1, outside the cache.
Doctor: stale-padding, at ``flash_decode_and_prefill`` (the paged KV read through the padded rows' block ids).
Fix (upstream): pad the block table with ``kv_block_allocator.dummy_block_idx`` (the block reserved for
padding, which padded tokens already write to) instead of -1.
"""
from __future__ import annotations

import torch

from workbench.engine import CUDAGraphMode, GraphManager, events
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/NVIDIA/Megatron-LM/pull/5950"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "flash_decode_and_prefill"
SYMPTOM = "a padded decode step reads KV block -1 (out-of-bounds read / illegal memory access upstream)"
VOCAB, DIM, BLOCK = 16, 4, 2              # BLOCK: block_size_tokens
MAX_KV_BLOCKS = 3                         # block-table width: max_sequence_length / block_size_tokens
TOTAL_BLOCKS = 13                         # 12 grantable blocks + the dummy block
MAX_REQUESTS = 4
CUDA_GRAPH_REQUEST_COUNTS = [1, 2, 4]     # decode-only graph buckets


class Model:
    def __init__(self, device):
        gen = generator(5950)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos = randn(MAX_KV_BLOCKS * BLOCK, DIM, gen=gen, device=device, scale=0.5)
        self.wq, self.wk, self.wv = (randn(DIM, DIM, gen=gen, device=device, scale=0.5) for _ in range(3))
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)


class KVBlockAllocator:
    def __init__(self):
        self.total_count = TOTAL_BLOCKS
        self.dummy_block_idx = self.total_count - 1      # reserved for padding
        self.free = list(range(self.total_count - 1))

    def allocate(self) -> int:
        return self.free.pop(0)


class DynamicInferenceContext:
    """The KV cache, the block allocator and the graphed MHA metadata / token bookkeeping buffers."""

    def __init__(self, device, variant):
        self.variant = variant
        self.kv_block_allocator = KVBlockAllocator()
        self.k_cache = torch.zeros(TOTAL_BLOCKS, BLOCK, DIM, device=device)
        self.v_cache = torch.zeros(TOTAL_BLOCKS, BLOCK, DIM, device=device)
        i64 = dict(dtype=torch.long, device=device)
        self.bufs = {"input_ids": torch.zeros(MAX_REQUESTS, **i64),
                     "position_ids": torch.zeros(MAX_REQUESTS, **i64),
                     "token_to_block_idx": torch.zeros(MAX_REQUESTS, **i64),
                     "token_to_local_position_within_kv_block": torch.zeros(MAX_REQUESTS, **i64),
                     "kv_seq_lengths": torch.zeros(MAX_REQUESTS, **i64),
                     "block_table": torch.full((MAX_REQUESTS, MAX_KV_BLOCKS), -1, **i64)}
        self.requests = {}                                # request id -> [tokens so far, block ids]

    def add_request(self, rid, prompt):
        blocks = [self.kv_block_allocator.allocate() for _ in range((len(prompt) + BLOCK - 1) // BLOCK)]
        self.requests[rid] = [list(prompt), blocks]
        return blocks

    def add_dummy_requests_for_cudagraph_capture(self, n):
        """Minimal state for warmup and capture: n decode requests of one token in the dummy block."""
        b, dummy = self.bufs, self.kv_block_allocator.dummy_block_idx
        b["input_ids"][:n] = 0
        b["position_ids"][:n] = 0
        b["token_to_block_idx"][:n] = dummy
        b["token_to_local_position_within_kv_block"][:n] = 0
        b["kv_seq_lengths"][:n] = 1
        b["block_table"][:n] = -1
        b["block_table"][:n, 0] = dummy

    def initialize_attention_state(self, active, new_tokens, padded_bs):
        """One decode step: each active request appends ``new_tokens[i]`` at its next position."""
        b, dummy = self.bufs, self.kv_block_allocator.dummy_block_idx
        real_bs = len(active)
        for i, (rid, tok) in enumerate(zip(active, new_tokens)):
            tokens, blocks = self.requests[rid]
            p = len(tokens)
            if p // BLOCK >= len(blocks):
                blocks.append(self.kv_block_allocator.allocate())
            tokens.append(tok)
            b["input_ids"][i] = tok
            b["position_ids"][i] = p
            b["token_to_block_idx"][i] = blocks[p // BLOCK]
            b["token_to_local_position_within_kv_block"][i] = p % BLOCK
            b["kv_seq_lengths"][i] = p + 1
            b["block_table"][i] = -1                      # unallocated entries of request_to_kv_block_ids
            b["block_table"][i, :len(blocks)] = torch.tensor(blocks, device=b["block_table"].device)
        # padded tokens: dummy block, position 0
        b["input_ids"][real_bs:padded_bs] = 0
        b["position_ids"][real_bs:padded_bs] = 0
        b["token_to_block_idx"][real_bs:padded_bs] = dummy
        b["token_to_local_position_within_kv_block"][real_bs:padded_bs] = 0
        # KV sequence lengths: [0:real_bs] real, [real_bs:padded_bs] zero pad
        b["kv_seq_lengths"][real_bs:padded_bs] = 0
        if real_bs < padded_bs:
            if self.variant == "bug":
                b["block_table"][real_bs:padded_bs] = -1  # "-1 sentinel"
            else:
                b["block_table"][real_bs:padded_bs] = dummy


def flash_decode_and_prefill(q, k_cache, v_cache, seqlens_k, block_table):
    """Decode attention over the paged KV cache (``flash_attn_with_kvcache(..., block_table=...)``). The
    kernel resolves the page of at least one KV tile per row before it consults the row's length, so a
    row of length 0 still loads ``block_table[row, 0]``; tiles past a row's length are not loaded."""
    bs = q.shape[0]
    tile = torch.arange(MAX_KV_BLOCKS, device=q.device)
    n_block_max = torch.clamp((seqlens_k + BLOCK - 1) // BLOCK, min=1)
    loaded = tile[None, :] < n_block_max[:, None]
    pages = torch.where(loaded, block_table, torch.zeros_like(block_table))
    keys = k_cache.index_select(0, pages.reshape(-1)).reshape(bs, MAX_KV_BLOCKS * BLOCK, DIM)
    values = v_cache.index_select(0, pages.reshape(-1)).reshape(bs, MAX_KV_BLOCKS * BLOCK, DIM)
    valid = torch.arange(MAX_KV_BLOCKS * BLOCK, device=q.device)[None, :] < seqlens_k[:, None]
    scores = (q[:, None, :] * keys).sum(-1) / DIM ** 0.5
    m = scores.masked_fill(~valid, float("-inf")).amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(scores - m) * valid
    denom = e.sum(-1, keepdim=True)
    return (e[..., None] * values).sum(1) / torch.where(denom > 0, denom, torch.ones_like(denom))


def forward(model, ctx, size):
    """The decode forward of ``size`` rows, on the context's metadata buffers."""
    b = ctx.bufs
    h = model.emb[b["input_ids"][:size]] + model.pos[b["position_ids"][:size]]
    q, k, v = h @ model.wq, h @ model.wk, h @ model.wv
    blk, off = b["token_to_block_idx"][:size], b["token_to_local_position_within_kv_block"][:size]
    ctx.k_cache[blk, off] = k                              # triton KV append
    ctx.v_cache[blk, off] = v
    out = flash_decode_and_prefill(q, ctx.k_cache, ctx.v_cache, b["kv_seq_lengths"][:size], b["block_table"][:size])
    return out @ model.lm_head


def prefill(model, ctx, rid, prompt):
    blocks = ctx.add_request(rid, prompt)
    dev = ctx.k_cache.device
    pos = torch.arange(len(prompt), device=dev)
    h = model.emb[torch.tensor(prompt, device=dev)] + model.pos[pos]
    blk = torch.tensor(blocks, device=dev)[pos // BLOCK]
    ctx.k_cache[blk, pos % BLOCK] = h @ model.wk
    ctx.v_cache[blk, pos % BLOCK] = h @ model.wv


def workload():
    """Four requests; request 3 finishes after step 1, request 2 after step 2, request 1 after step 3."""
    prompts = {0: [3, 7], 1: [5, 1, 9], 2: [2], 3: [8, 4, 6]}
    steps = [([0, 1, 2, 3], [11, 4, 13, 2]), ([0, 1, 2], [6, 9, 1]), ([0, 1], [14, 3]), ([0], [10])]
    return prompts, steps


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    prompts, steps = workload()

    def eager():
        ctx, outs = DynamicInferenceContext(device, variant), []
        for rid, prompt in prompts.items():
            prefill(model, ctx, rid, prompt)
        for active, toks in steps:
            ctx.initialize_attention_state(active, toks, padded_bs=len(active))   # no graph: no padding
            outs.append(forward(model, ctx, len(active)))
        return outs

    def served():
        ctx = DynamicInferenceContext(device, variant)
        events.persistent_state("DynamicInferenceContext", {"k_cache": ctx.k_cache, "v_cache": ctx.v_cache})
        ctx.add_dummy_requests_for_cudagraph_capture(MAX_REQUESTS)
        graphs = GraphManager(lambda size: forward(model, ctx, size), CUDA_GRAPH_REQUEST_COUNTS, device=device,
                              mode=CUDAGraphMode.FULL, static_buffers=ctx.bufs, name="decode CUDA graphs")
        graphs.capture()
        for rid, prompt in prompts.items():                 # then the requests arrive
            prefill(model, ctx, rid, prompt)
        outs = []
        for active, toks in steps:
            n = len(active)
            padded_bs = graphs.dispatch(n)
            ctx.initialize_attention_state(active, toks, padded_bs)
            outs.append(graphs.replay(padded_bs, real=n, padded={}).clone())   # every padded row was written
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
