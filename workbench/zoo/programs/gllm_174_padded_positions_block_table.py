"""Padded rows keep stale positions and block-table rows; the slots computed from them are live.

Upstream: https://github.com/gty111/gLLM/pull/174 ("Cuda graph padding"): pad ``positions`` with 0,
``slot_mapping`` with a dummy slot on a reserved page, ``seq_lens`` with 1 and ``block_table`` rows
with the dummy page. The same fix in nano-vllm-v1 #3 (not read here: not in the stored corpus).
Symptom: once decode batches are padded to captured sizes, requests read keys written by rows that
are not real (gLLM, April 2026).
Mechanism: the graph computes each row's cache slot from its position and its block-table row. Rows
padded up to the graph's size keep the position and block-table row of an earlier batch. Their key
lands in a page that now belongs to another request.
Doctor: stale-padding, at ``decode_step`` (the slot computed from the padded rows' metadata).
Fix (upstream): give padded rows position 0 and block-table rows pointing at a reserved dummy page.
"""
from __future__ import annotations

import torch

from ..kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/gty111/gLLM/pull/174"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "decode_step"
SYMPTOM = "a request reads a key that a padded row wrote into its page"
DIM, BLOCK, PAGES, SIZE, WIDTH = 4, 2, 6, 2, 2      # page PAGES - 1 is the reserved dummy page


class Model:
    def __init__(self, device):
        gen = generator(174)
        self.emb = randn(12, DIM, gen=gen, device=device)
        self.wk = randn(DIM, DIM, gen=gen, device=device, scale=0.5)


def decode_step(model, cache, tokens, positions, block_table):
    page = block_table.gather(1, (positions // BLOCK)[:, None]).squeeze(1)
    slots = page * BLOCK + positions % BLOCK
    cache[slots] = model.emb[tokens] @ model.wk
    seen = (block_table[:, :, None] * BLOCK + torch.arange(BLOCK, device=cache.device)).reshape(tokens.shape[0], -1)
    valid = (torch.arange(seen.shape[1], device=cache.device)[None] <= positions[:, None]).float()
    return (cache[seen] * valid[..., None]).sum(1) / valid.sum(1, keepdim=True)


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    t = lambda v: torch.tensor(v, device=device)   # noqa: E731
    # Step 1: A (page 0,1) and B (pages 2,3) at position 2. B finishes; its pages go to C, which
    # prefills positions 0..2. Step 2: A alone. Step 3: A and C.
    steps = [(t([1, 2]), t([2, 2]), t([[0, 1], [2, 3]])), (t([3]), t([3]), t([[0, 1]])),
             (t([4, 5]), t([3, 3]), t([[0, 1], [2, 3]]))]

    def serve(graphed: bool):
        cache = torch.zeros(PAGES * BLOCK, DIM, device=device)
        bufs = {"tokens": torch.zeros(SIZE, dtype=torch.long, device=device),
                "positions": torch.zeros(SIZE, dtype=torch.long, device=device),
                "block_table": torch.full((SIZE, WIDTH), PAGES - 1, device=device)}
        if graphed:
            g, out = capture(lambda: decode_step(model, cache, bufs["tokens"], bufs["positions"], bufs["block_table"]),
                             device=device, static=bufs, owner="gLLM InputData")
        outs = []
        for i, (tokens, positions, table) in enumerate(steps):
            if i == 1:
                cache[4:7] = model.emb[t([9, 10, 11])] @ model.wk      # C's prefill into B's old pages
            n = tokens.shape[0]
            if not graphed:
                outs.append(decode_step(model, cache, tokens, positions, table))
                continue
            bufs["tokens"][:n].copy_(tokens)
            bufs["positions"][:n].copy_(positions)
            bufs["block_table"][:n].copy_(table)
            stale = dict(bufs)                          # buffers whose padded rows this step leaves as they were
            if variant == "fix":
                bufs["positions"][n:].zero_()
                bufs["block_table"][n:].fill_(PAGES - 1)
                stale = {"tokens": bufs["tokens"]}
            outs.append(replay(g, out, real=n, size=SIZE, padded=stale)[:n].clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
