"""The captured block-table buffer is one column short for the first decode after a full prompt.

Upstream: https://github.com/GeeeekExplorer/nano-vllm/pull/258
Symptom: a prompt of exactly ``max_model_len`` tokens fails on its first decode step with
``RuntimeError`` ("Target sizes: [1, 16]. Tensor sizes: [17]"), NVIDIA Thor, nano-vllm main (Aug 2026).
Mechanism: the static block-table buffer is ``max_model_len / block_size`` columns wide. The first
decode token after a full prompt starts a new block, so the sequence owns one block more. Copying its
block table into the static buffer fails.
Doctor: undersized-buffer, at ``prepare_decode`` (the copy into the block-table static buffer).
Fix (upstream): capture one extra block-table column, and fall back to eager for any batch whose
tables exceed the captured buffers.
"""
from __future__ import annotations

import torch

from ..kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/GeeeekExplorer/nano-vllm/pull/258"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "prepare_decode"
SYMPTOM = "RuntimeError copying a block table one column wider than the captured buffer"
DIM, BLOCK, MAX_LEN = 4, 4, 16


def attend(cache, block_table, context_len):
    """Mean of the cached rows of the first ``context_len`` positions (a stand-in for attention)."""
    offsets = torch.arange(BLOCK, device=cache.device)
    slots = (block_table[:, :, None] * BLOCK + offsets).reshape(block_table.shape[0], -1)
    valid = (torch.arange(slots.shape[1], device=cache.device)[None] < context_len[:, None]).to(cache.dtype)
    return (cache[slots] * valid[..., None]).sum(1) / context_len[:, None].to(cache.dtype)


def prepare_decode(tables, lens, table_buf, len_buf):
    table_buf[:tables.shape[0]].zero_()
    table_buf[:tables.shape[0], :tables.shape[1]].copy_(tables)
    len_buf[:lens.shape[0]].copy_(lens)


def run(variant: str, device: str = "cpu"):
    gen = generator(258)
    cache = randn(8 * BLOCK, DIM, gen=gen, device=device)
    width = MAX_LEN // BLOCK + (1 if variant == "fix" else 0)
    tables = torch.tensor([[5, 1, 6, 2, 7]], device=device)     # 17 tokens: a full prompt plus one
    lens = torch.tensor([MAX_LEN + 1], device=device)

    def eager():
        return [attend(cache, tables, lens)]

    def served():
        table_buf = torch.zeros(1, width, dtype=torch.long, device=device)
        len_buf = torch.ones(1, dtype=torch.long, device=device)
        g, out = capture(lambda: attend(cache, table_buf, len_buf), device=device,
                         static={"block_tables": table_buf, "context_lens": len_buf}, owner="ModelRunner")
        if variant == "fix" and tables.shape[1] > width:     # the fix's eager fallback (not taken here)
            return [attend(cache, tables, lens)]
        prepare_decode(tables, lens, table_buf, len_buf)
        return [replay(g, out).clone()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
