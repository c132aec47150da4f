"""Destroying one graph frees a stream-keyed workspace another live graph still uses.

Upstream: https://github.com/pytorch/pytorch/issues/193402 (introduced, per the report, by #175276).
Symptom: ``cudaErrorIllegalAddress`` in the training graph's backward replay after an eval graph
captured on the same stream was destroyed (PyTorch nightly, Aug 2026).
Mechanism: cuBLAS workspaces are cached per stream, and a graph's GEMMs embed the workspace address.
Destroying a graph clears the workspaces of the stream it was captured on, whichever graphs still use
them. The surviving graph then replays against a released workspace.
Doctor: dangling-reference, at ``destroy`` (clearing the stream's workspaces lets go of the one ``gemm`` reads).
Fix (what the report's analysis implies; the issue was open when read): tie a workspace's lifetime to
the graphs that captured it (each graph holds a reference), instead of clearing by stream.
"""
from __future__ import annotations

import torch

from ...engine import graph, new_graph
from ..kit import compare, generator, randn, release_to_driver, own_segment_elems

UPSTREAM = "https://github.com/pytorch/pytorch/issues/193402"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "destroy"
SYMPTOM = "illegal address in a live graph's replay after another graph on its stream was destroyed"
DIM = 6
_workspaces: dict[str, torch.Tensor] = {}      # the library's per-stream workspace cache


def workspace(stream: str, device: str) -> torch.Tensor:
    if stream not in _workspaces:
        _workspaces[stream] = torch.ones(own_segment_elems(device), device=device)
    return _workspaces[stream]


def gemm(a, b, stream: str):
    ws = workspace(stream, a.device.type)
    return (a @ b) * ws[:1]                        # the kernel reads its workspace


class Graph:
    """A graph wrapper; destroying it clears its stream's workspaces (the bug) or drops its own
    reference to them (the fix)."""

    def __init__(self, device, stream, per_graph: bool):
        self.g, self.stream, self.per_graph = new_graph(device), stream, per_graph
        self.held: list[torch.Tensor] = []

    def capture(self, fn):
        with graph(self.g, name=self.stream):
            out = fn()
        if self.per_graph:
            self.held.append(_workspaces[self.stream])
        return out

    def destroy(self):
        self.g.reset()
        self.held.clear()
        if not self.per_graph:
            _workspaces.pop(self.stream, None)     # clearCublasWorkspacesForStream(S)


def run(variant: str, device: str = "cpu"):
    gen = generator(193402)
    a, b, c = (randn(4, DIM, gen=gen, device=device), randn(DIM, DIM, gen=gen, device=device),
               randn(4, DIM, gen=gen, device=device))

    def eager():
        _workspaces.clear()
        return [gemm(a, b, "eager")]

    def served():
        _workspaces.clear()
        per_graph = variant == "fix"
        a_buf = a.clone()
        gemm(a_buf, b, "S")                                         # warmup
        train = Graph(device, "S", per_graph)
        out = train.capture(lambda: gemm(a_buf, b, "S"))
        evaluation = Graph(device, "S", per_graph)
        evaluation.capture(lambda: gemm(c, b, "S"))
        evaluation.destroy()
        if per_graph:
            _workspaces.pop("S", None)             # the cache may let go: the training graph holds its own
        release_to_driver(device)
        train.g.replay()
        return [out.clone()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
