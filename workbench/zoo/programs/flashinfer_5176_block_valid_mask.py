"""Padded work items of a CUDA-graph plan read entries the planner never wrote.

Upstream: https://github.com/flashinfer-ai/flashinfer/pull/5176 (fixes flashinfer#4002; sglang#36785).
The issue's list names flashinfer #5177, which the stored corpus does not hold; #5176 is the fix read.
Symptom: with CUDA graphs on and split-KV off, FA2 prefill crashes with an illegal memory access when
the workspace still holds an earlier plan; a fresh workspace happens to give correct output (SGLang
deterministic inference, NVFP4 KV on Blackwell, Sept 2026).
Mechanism: under CUDA graphs the kernel launches a padded number of work items, more than the batch
needs. The planner writes entries only for real work, and the mask that switches the extra items off was
built only for split-KV plans. The extra items run with whatever an earlier plan left in the workspace.
Doctor: stale-padding, at ``attention_run`` (the work items past the planned count).
Fix (upstream): materialise the block-valid mask whenever CUDA graphs are on and apply it in every run
function.
"""
from __future__ import annotations

import torch

from ..kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/flashinfer-ai/flashinfer/pull/5176"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "attention_run"
SYMPTOM = "outputs gain the partial results of work items from an earlier plan (or an IMA)"
DIM, GRID, ROWS = 4, 6, 3


def plan(work_req, work_tile, valid, lens, use_mask: bool):
    """Host planner: one work item per (request, tile); writes only the real items."""
    items = [(r, t) for r, n in enumerate(lens) for t in range(n)]
    work_req[:len(items)] = torch.tensor([r for r, _ in items])
    work_tile[:len(items)] = torch.tensor([t for _, t in items])
    if use_mask:
        valid.zero_()
        valid[:len(items)] = 1.0


def attention_run(q, kv, work_req, work_tile, valid):
    partial = (q[work_req] * kv[work_tile]).sum(-1, keepdim=True) * kv[work_tile]
    out = torch.zeros(q.shape[0], DIM, device=q.device)
    return out.index_add(0, work_req, partial * valid[:, None])


def run(variant: str, device: str = "cpu"):
    gen = generator(5176)
    q, kv = randn(ROWS, DIM, gen=gen, device=device), randn(GRID, DIM, gen=gen, device=device)
    plans = ([2, 2, 2], [1, 2, 1])                  # the second step needs fewer work items

    def eager():
        outs = []
        for lens in plans:
            wr, wt, valid = torch.zeros(GRID, dtype=torch.long), torch.zeros(GRID, dtype=torch.long), torch.zeros(GRID)
            plan(wr, wt, valid, lens, use_mask=True)
            n = sum(lens)
            outs.append(attention_run(q, kv, wr[:n].to(device), wt[:n].to(device), valid[:n].to(device)))
        return outs

    def served():
        work_req, work_tile = (torch.zeros(GRID, dtype=torch.long, device=device) for _ in range(2))
        valid = torch.ones(GRID, device=device)     # without a mask every launched item counts
        g, out = capture(lambda: attention_run(q, kv, work_req, work_tile, valid), device=device,
                         static={"work_req": work_req, "work_tile": work_tile, "block_valid_mask": valid},
                         owner="FlashInfer workspace")
        outs = []
        for lens in plans:
            host = [t.cpu().clone() for t in (work_req, work_tile, valid)]   # the workspace as left
            plan(*host, lens, use_mask=(variant == "fix"))
            for dst, src in zip((work_req, work_tile, valid), host):
                dst.copy_(src)
            stale = {"work_req": work_req, "work_tile": work_tile}    # entries past the plan are left as they were
            outs.append(replay(g, out, real=sum(lens), size=GRID, padded=stale).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
