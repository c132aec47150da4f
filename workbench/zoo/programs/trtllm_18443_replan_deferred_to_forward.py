"""Attention re-planning deferred to forward: the capture skips it, every replay uses an old plan.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/18443 ("Replan FlashInfer wrappers before CUDA
graph replay", nvbug 6566726).
Symptom: Gemma3 (global plus sliding-window attention) loses accuracy under CUDA graphs (TensorRT-LLM
PyTorch backend, Aug 2026); eager is fine.
Mechanism: ``prepare()`` refreshes the KV page metadata and marks the persistent wrappers as needing a
new plan; ``forward_impl()`` re-plans lazily when that flag is set. The warmup run planned and cleared
the flag, so the capture recorded no planning, and replay runs no Python at all. Each replay reuses the
plan of the warmup step.
Doctor: warmup-divergence, at ``plan`` (the planning the warmup ran and the capture skipped).
Fix (upstream): plan the persistent wrappers in ``prepare()``, before every replay, outside the graph.
"""
from __future__ import annotations

import torch

from ..kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/18443"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "plan"
SYMPTOM = "attention uses the schedule planned for an earlier step's KV lengths"
ROWS, CTX, DIM = 2, 8, 4


class Wrapper:
    """A FlashInfer-like wrapper: ``plan`` writes the schedule (here, each row's KV mask)."""

    def __init__(self, device, plan_in_prepare: bool):
        self.mask = torch.zeros(ROWS, CTX, device=device)       # the plan, in persistent memory
        self.kv_lens = torch.ones(ROWS, dtype=torch.long, device=device)
        self.needs_plan = True
        self.plan_in_prepare = plan_in_prepare

    def plan(self):
        self.mask.copy_((torch.arange(CTX, device=self.mask.device)[None] < self.kv_lens[:, None]).float())

    def prepare(self, kv_lens):
        self.kv_lens.copy_(kv_lens)
        if self.plan_in_prepare:
            self.plan()
        else:
            self.needs_plan = True


def forward_impl(wrapper, q, kv):
    if wrapper.needs_plan and not wrapper.plan_in_prepare:
        wrapper.plan()
        wrapper.needs_plan = False
    scores = (q @ kv.t()).masked_fill(wrapper.mask == 0, -1e9)
    return torch.softmax(scores, -1) @ kv


def run(variant: str, device: str = "cpu"):
    gen = generator(18443)
    kv = randn(CTX, DIM, gen=gen, device=device)
    steps = [(randn(ROWS, DIM, gen=gen, device=device), torch.tensor(lens, device=device))
             for lens in ([3, 5], [4, 6], [5, 7])]

    def eager():
        w, outs = Wrapper(device, plan_in_prepare=False), []
        for q, lens in steps:
            w.prepare(lens)
            outs.append(forward_impl(w, q, kv))
        return outs

    def served():
        w = Wrapper(device, plan_in_prepare=(variant == "fix"))
        q_buf = steps[0][0].clone()
        w.prepare(steps[0][1])
        g, out = capture(lambda: forward_impl(w, q_buf, kv), device=device,
                         static={"q": q_buf, "kv_lens": w.kv_lens}, owner="FlashInfer metadata")
        outs = []
        for q, lens in steps:
            w.prepare(lens)
            q_buf.copy_(q)
            outs.append(replay(g, out).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
