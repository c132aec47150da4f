"""A per-step allocation's address baked into a graph replayed on later steps.

Upstream: https://github.com/kekzl/imp/issues/1648 (fixed by kekzl/imp#1709).
Symptom: with graphs on, decoding with the NVFP4 KV residual path produces illegal memory accesses
(imp, Qwen3-8B, Aug 2026); with graphs off, the same load is clean.
Mechanism: the scheduler allocated the residual-metadata buffer afresh on every step
(``cudaMallocAsync``) and freed the previous one. The captured graph keeps the address of the buffer
of the step it was captured on. Later replays read a buffer that has been freed.
Doctor: dangling-reference, at ``prepare`` (the fresh buffer per step lets the captured one go; ``decode`` reads it).
Fix (upstream): one persistent metadata buffer sized for the maximum batch, refreshed in place each step.
"""
from __future__ import annotations

import torch

from ..kit import capture, compare, generator, randn, release_to_driver, own_segment_elems, replay

UPSTREAM = "https://github.com/kekzl/imp/issues/1648"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "prepare"
SYMPTOM = "illegal memory access: replay reads a per-step metadata buffer freed on the next step"
DIM, ROWS = 6, 3


def decode(x, meta):
    return x * meta[:ROWS, None]                   # per-row residual scales from the metadata buffer


class Scheduler:
    def __init__(self, device, persistent: bool):
        self.device = device
        self.persistent = persistent
        self.meta = torch.zeros(own_segment_elems(device), device=device)

    def prepare(self, scales: torch.Tensor) -> torch.Tensor:
        if not self.persistent:
            self.meta = torch.zeros(own_segment_elems(self.device), device=self.device)   # a new buffer per step
        self.meta[:ROWS].copy_(scales)
        return self.meta


def run(variant: str, device: str = "cpu"):
    gen = generator(1648)
    steps = [(randn(ROWS, DIM, gen=gen, device=device), randn(ROWS, gen=gen, device=device)) for _ in range(3)]

    def eager():
        return [decode(x, s) for x, s in steps]

    def served():
        sched = Scheduler(device, persistent=(variant == "fix"))
        x_buf = steps[0][0].clone()
        sched.prepare(steps[0][1])
        g, out = capture(lambda: decode(x_buf, sched.meta), device=device, name="decode",
                         static={"x": x_buf}, owner="engine scheduler")
        outs = []
        for x, s in steps:
            sched.prepare(s)
            release_to_driver(device)
            x_buf.copy_(x)
            outs.append(replay(g, out).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
