"""Decode graphs sized by the prefill warmup batch: longer sequences do not fit the captured block table.

Upstream: https://github.com/huggingface/text-generation-inference/pull/2716 ("Hotfixing auto length
(warmup max_s was wrong).", commit a5593ba8).
Symptom: with the automatic token limits (no ``--max-total-tokens``: the limit is derived from the KV
blocks left after warmup), decode steps served by a CUDA graph fail once a batch's block table is wider than
the warmup prompt's; the graphs were captured for ``max_s`` tokens of the warmup prefill, not for
``max_total_tokens`` (text-generation-inference main, Nov 2024). The PR has no description beyond its
title; the program models the consequence of its diff, on the paged block-table copy of ``forward`` (with
flashinfer the ragged block table overflows its buffer the same way).
Mechanism: ``warmup`` took ``max_bt = batch.max_blocks`` and ``max_s = max_bt * BLOCK_SIZE`` from the
router's warmup batch, whose requests carry ``max_new_tokens = 1`` when no total limit is set, and later
passed them to ``cuda_graph_warmup(bs, max_s, max_bt)``: every graph's static ``block_tables`` buffer has
``max_bt`` columns and its attention covers ``max_s`` positions. ``max_total_tokens`` is computed after
that prefill, from the free KV blocks, and is much larger. The router allocates each request's blocks for
prompt + ``max_new_tokens``, so a decode batch's block table soon has more columns than the captured buffer,
and ``forward``'s copy into it fails.
Doctor: undersized-buffer, at ``forward`` (the copy of the batch's block table into the graph's buffer).
Fix (upstream): capture with ``cuda_graph_warmup(bs, max_total_tokens, max_total_tokens)``.
"""
from __future__ import annotations

import math

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/huggingface/text-generation-inference/pull/2716"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "forward"
SYMPTOM = "RuntimeError copying a decode batch's block table into the graph's narrower buffer"
VOCAB, DIM, BLOCK, NUM_BLOCKS = 12, 4, 2, 16
MAX_PREFILL_TOKENS = 4                  # the router's warmup batch: one prompt of this many tokens
MAX_TOTAL_TOKENS = 10                   # derived after the warmup prefill (auto length)
CUDA_GRAPHS = [1, 2]


class FlashLlamaForCausalLM:
    def __init__(self, device):
        gen = generator(2716)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos = randn(MAX_TOTAL_TOKENS, DIM, gen=gen, device=device, scale=0.5)
        self.wq, self.wk, self.wv = (randn(DIM, DIM, gen=gen, device=device, scale=0.5) for _ in range(3))
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)

    def kv(self, input_ids, position_ids):
        h = self.emb[input_ids] + self.pos[position_ids]
        return h, h @ self.wk, h @ self.wv

    def forward(self, input_ids, position_ids, kv_cache, block_tables, slots, input_lengths, max_s):
        """Decode: store this token's key/value, then paged attention over ``max_s`` positions."""
        k_cache, v_cache = kv_cache
        h, k, v = self.kv(input_ids, position_ids)
        k_cache.view(-1, DIM)[slots] = k
        v_cache.view(-1, DIM)[slots] = v
        pos = torch.arange(max_s, device=h.device)
        kv_slots = block_tables[:, pos // BLOCK] * BLOCK + pos % BLOCK
        kc, vc = k_cache.view(-1, DIM)[kv_slots], v_cache.view(-1, DIM)[kv_slots]
        scores = ((h @ self.wq)[:, None, :] * kc).sum(-1) / DIM ** 0.5
        scores = scores.masked_fill(pos[None, :] >= input_lengths[:, None], float("-inf"))
        return (torch.softmax(scores, -1)[..., None] * vc).sum(1) @ self.lm_head


def blocks_for(prompt_len, max_new_tokens):
    """The router allocates prompt + max_new_tokens - 1 tokens up front."""
    return math.ceil((prompt_len + max_new_tokens - 1) / BLOCK)


def requests():
    """(prompt, max_new_tokens, blocks): blocks handed out from the top of the free list."""
    return [([3, 7, 5], 4, [15, 14, 13]), ([9, 2], 4, [12, 11, 10])]


class FlashCausalLM:
    def __init__(self, device, variant):
        self.device, self.variant = device, variant
        self.model = FlashLlamaForCausalLM(device)
        self.kv_cache = None
        self.cuda_graphs = {}

    def init_kv_cache(self, num_blocks):
        self.kv_cache = (torch.zeros(num_blocks, BLOCK, DIM, device=self.device),
                         torch.zeros(num_blocks, BLOCK, DIM, device=self.device))

    def warmup(self, warmup_max_blocks):
        """The router's warmup batch has been prefilled (max_new_tokens = 1, no total limit yet)."""
        max_bt = warmup_max_blocks                                   # batch.max_blocks
        max_s = max_bt * BLOCK
        max_total_tokens = MAX_TOTAL_TOKENS                          # num_blocks * BLOCK_SIZE, computed now
        self.init_kv_cache(NUM_BLOCKS)
        pool = graph_pool_handle(self.device)
        for bs in sorted(CUDA_GRAPHS, reverse=True):
            if self.variant == "bug":
                self.cuda_graph_warmup(bs, max_s, max_bt, pool)
            else:
                self.cuda_graph_warmup(bs, max_total_tokens, max_total_tokens, pool)
        return max_total_tokens

    def cuda_graph_warmup(self, bs, max_s, max_bt, pool):
        v = {"input_ids": torch.zeros(bs, dtype=torch.int64, device=self.device),
             "position_ids": torch.zeros(bs, dtype=torch.int64, device=self.device),
             "slots": torch.arange(bs, dtype=torch.int64, device=self.device),
             "input_lengths": torch.ones(bs, dtype=torch.int32, device=self.device) * max_s,
             "block_tables": torch.arange(max_bt, device=self.device).repeat(bs).reshape(bs, max_bt)}
        g, logits = capture(lambda: self.model.forward(v["input_ids"], v["position_ids"], self.kv_cache,
                                                       v["block_tables"], v["slots"], v["input_lengths"], max_s),
                            device=self.device, pool=pool, name=f"bs {bs}", static=v,
                            state={"k_cache": self.kv_cache[0], "v_cache": self.kv_cache[1]},
                            owner="FlashCausalLM cuda graphs")
        self.cuda_graphs[bs] = dict(v, graph=g, logits=logits)

    def prefill(self, prompt, blocks):
        pos = torch.arange(len(prompt), device=self.device)
        slots = torch.tensor(blocks, device=self.device)[pos // BLOCK] * BLOCK + pos % BLOCK
        _, k, v = self.model.kv(torch.tensor(prompt, device=self.device), pos)
        self.kv_cache[0].view(-1, DIM)[slots] = k
        self.kv_cache[1].view(-1, DIM)[slots] = v

    def forward(self, input_ids, position_ids, block_tables, slots, input_lengths, max_s):
        bs = input_ids.shape[0]
        sorted_padded_bs = sorted(k for k in self.cuda_graphs if k >= bs)
        cuda_graph = self.cuda_graphs[sorted_padded_bs[0]] if sorted_padded_bs else None
        if cuda_graph is None:
            return self.model.forward(input_ids, position_ids, self.kv_cache, block_tables, slots,
                                      input_lengths, max_s)
        cuda_graph["input_ids"][: input_ids.shape[0]] = input_ids
        cuda_graph["position_ids"][: position_ids.shape[0]] = position_ids
        cuda_graph["block_tables"][: block_tables.shape[0], : block_tables.shape[1]] = block_tables
        cuda_graph["slots"].fill_(0)
        cuda_graph["slots"][: slots.shape[0]] = slots
        cuda_graph["input_lengths"].zero_()
        cuda_graph["input_lengths"][: input_lengths.shape[0]] = input_lengths
        size = cuda_graph["input_ids"].shape[0]
        out = replay(cuda_graph["graph"], cuda_graph["logits"], real=bs, size=size,
                     padded={"input_ids": cuda_graph["input_ids"], "position_ids": cuda_graph["position_ids"],
                             "block_tables": cuda_graph["block_tables"]},
                     padded_columns={"block_tables": (cuda_graph["block_tables"], block_tables.shape[1])})
        return out[:bs]


def batches(device):
    """Three decode steps of both requests: block_tables_tensor is as wide as the widest allocation."""
    width = max(len(b) for _, _, b in requests())
    out = []
    for step in range(3):
        ids, positions, tables, slots, lengths = [], [], [], [], []
        for i, (prompt, _, blocks) in enumerate(requests()):
            p = len(prompt) + step
            ids.append((prompt[-1] + 3 * step + i) % VOCAB)
            positions.append(p)
            tables.append(blocks + [0] * (width - len(blocks)))
            slots.append(blocks[p // BLOCK] * BLOCK + p % BLOCK)
            lengths.append(p + 1)
        out.append(tuple(torch.tensor(v, device=device) for v in (ids, positions, tables, slots))
                   + (torch.tensor(lengths, dtype=torch.int32, device=device), max(lengths)))
    return out


def run(variant: str, device: str = "cpu"):
    warmup_max_blocks = blocks_for(MAX_PREFILL_TOKENS, 1)
    for prompt, max_new, blocks in requests():
        assert len(blocks) == blocks_for(len(prompt), max_new)

    def serve(graphed: bool):
        lm = FlashCausalLM(device, variant)
        if graphed:
            lm.warmup(warmup_max_blocks)
        else:
            lm.init_kv_cache(NUM_BLOCKS)
        for prompt, _, blocks in requests():
            lm.prefill(prompt, blocks)
        logits = []
        for input_ids, position_ids, block_tables, slots, input_lengths, max_s in batches(device):
            if graphed:
                out = lm.forward(input_ids, position_ids, block_tables, slots, input_lengths, max_s)
            else:
                out = lm.model.forward(input_ids, position_ids, lm.kv_cache, block_tables, slots,
                                       input_lengths, max_s)
            logits.append(out.clone())
        return logits

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
