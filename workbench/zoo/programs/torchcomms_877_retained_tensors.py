"""Host pointer tensors of a captured collective die with its work object; replays read garbage.

Upstream: https://github.com/meta-pytorch/torchcomms/pull/877 ("Fix tensor lifetime bug in CUDA graph
mode for alltoallv_dynamic").
Symptom: replaying a graph that captured ``alltoallv_dynamic_dispatch`` fails with CTRAN buffer
registration errors on garbage pointers (``buf=0x4``), torchcomms NCCLX backend (Feb 2026).
Mechanism: the dispatch builds a CPU tensor of pointers (here: of row offsets) that its kernel reads,
and output tensors, but nothing retained them past the call. Under capture the operation is recorded
with their addresses while the work object, their last owner, is destroyed. Every replay reads
whatever memory those tensors were handed on to.
Doctor: dangling-reference, at ``dispatch`` (the captured copy from the released host tensor).
Fix (upstream): the work object retains those tensors, and in graph-capture mode they move to the
graph's state so they live as long as the graph.
"""
from __future__ import annotations

import torch

from ...engine import host as engine_host, reuse_freed_blocks
from ..kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/meta-pytorch/torchcomms/pull/877"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "dispatch"
LATENT = ("torch 2.11's host allocator keeps pinned blocks allocated inside a capture for the graph (H100 record: probe host_made_in_capture), so the freed staging buffer is never handed on and the replay reads its capture-time values, as eager does")
SYMPTOM = "replay reads a freed host pointer tensor (garbage pointers, registration errors)"
ROWS, DIM = 4, 3


class Work:
    """The collective's work object; under graph capture the fix hands its tensors to the graph."""

    graph_state: list[torch.Tensor] = []

    def __init__(self, retain: bool):
        self.retain, self.tensors = retain, []

    def keep(self, *tensors):
        if self.retain:
            self.tensors += tensors
            Work.graph_state += tensors


def dispatch(x, order, retain, offsets_dev):
    work = Work(retain)
    host = engine_host(torch.tensor(order, dtype=torch.int64), x.device)   # CPU pointer tensor, pinned
    offsets_dev.copy_(host, non_blocking=True)
    out = x.index_select(0, offsets_dev)
    work.keep(host, out)
    return out


def run(variant: str, device: str = "cpu"):
    gen = generator(877)
    xs = [randn(ROWS, DIM, gen=gen, device=device) for _ in range(2)]
    order = [2, 0, 3, 1]

    def eager():
        offsets = torch.zeros(ROWS, dtype=torch.int64, device=device)
        return [dispatch(x, order, False, offsets).clone() for x in xs]

    def served():
        Work.graph_state = []
        offsets = torch.zeros(ROWS, dtype=torch.int64, device=device)
        x_buf = xs[0].clone()
        g, out = capture(lambda: dispatch(x_buf, order, variant == "fix", offsets), device=device,
                         on_freed="reuse", static={"x": x_buf}, owner="torchcomms graph")
        outs = []
        for x in xs:
            with reuse_freed_blocks():
                dispatch(x, [0, 0, 0, 0], False, torch.zeros(ROWS, dtype=torch.int64, device=device))  # eager traffic
            x_buf.copy_(x)
            outs.append(replay(g, out).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
