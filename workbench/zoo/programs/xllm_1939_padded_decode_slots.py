"""Padded decode rows keep the cache slots of an earlier batch and write into them.

Upstream: https://github.com/xLLM-AI/xllm/pull/1939 ("fix padded decode cuda graph metadata").
Symptom: with ``max_seqs_per_batch=100`` the decode graph runs 112 rows; replay accessed metadata out
of bounds (CUDA illegal memory access, or a later NCCL failure under TP2), xLLM native C++ decode
graphs (July 2026).
Mechanism: the decode metadata described only the real sequences, so the rows padded up to the graph's
size kept whatever an earlier, larger batch left in the static buffers. Those rows still run the
cache-write kernel with their stale slot mapping. A slot that was freed and handed to a new request is
overwritten with a departed request's key.
Doctor: stale-padding, at ``decode_step`` (the cache write that reads the padded rows' slot mapping).
Fix (upstream): describe padded rows explicitly: empty KV ranges, and cache slot ``-1`` so the write
skips them (here ``-1`` is a scratch row at the end of the cache).
"""
from __future__ import annotations

import torch

from ..kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/xLLM-AI/xllm/pull/1939"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "decode_step"
SYMPTOM = "a new request reads a key overwritten by a padded row (IMA or wrong tokens upstream)"
DIM, SLOTS, SIZE, CTX = 4, 9, 2, 3     # cache row SLOTS - 1 is the scratch row that slot -1 addresses


class Model:
    def __init__(self, device):
        gen = generator(1939)
        self.emb = randn(10, DIM, gen=gen, device=device)
        self.wk = randn(DIM, DIM, gen=gen, device=device, scale=0.5)


def decode_step(model, cache, tokens, slots, ctx_slots):
    k = model.emb[tokens] @ model.wk
    cache[slots] = k                                    # reshape_and_cache
    return cache[ctx_slots].mean(1)


def prefill(model, cache, token, slot):
    cache[slot] = model.emb[token] @ model.wk


def schedule():
    """Step 1: A and C decode; C finishes and its slot 4 goes to E (prefill). Step 2: A alone.
    Step 3: A and E."""
    return [([1, 2], [3, 4], [[0, 3, 3], [4, 4, 4]]), ([5], [6], [[0, 3, 6]]),
            ([7, 8], [7, 5], [[3, 6, 7], [4, 5, 5]])]


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    steps = [tuple(torch.tensor(v, device=device) for v in s) for s in schedule()]

    def serve(graphed: bool):
        cache = torch.zeros(SLOTS, DIM, device=device)
        for slot, tok in ((0, 0), (3, 1), (4, 2)):
            prefill(model, cache, tok, slot)
        bufs = {"tokens": torch.zeros(SIZE, dtype=torch.long, device=device),
                "slots": torch.full((SIZE,), -1, device=device),
                "ctx_slots": torch.zeros(SIZE, CTX, dtype=torch.long, device=device)}
        if graphed:
            g, out = capture(lambda: decode_step(model, cache, bufs["tokens"], bufs["slots"], bufs["ctx_slots"]),
                             device=device, static=bufs, owner="decode graph executor")
        outs = []
        for i, (tokens, slots, ctx) in enumerate(steps):
            if i == 1:
                prefill(model, cache, 9, 4)            # C finished; E got slot 4
                prefill(model, cache, 9, 5)
            n = tokens.shape[0]
            if not graphed:
                outs.append(decode_step(model, cache, tokens, slots, ctx))
                continue
            bufs["tokens"][:n].copy_(tokens)
            bufs["slots"][:n].copy_(slots)
            bufs["ctx_slots"][:n].copy_(ctx)
            stale = dict(bufs)                          # buffers whose padded rows this step leaves as they were
            if variant == "fix":
                bufs["slots"][n:].fill_(-1)
                bufs["ctx_slots"][n:].fill_(SLOTS - 1)
                stale = {"tokens": bufs["tokens"]}
            outs.append(replay(g, out, real=n, size=SIZE, padded=stale)[:n].clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
