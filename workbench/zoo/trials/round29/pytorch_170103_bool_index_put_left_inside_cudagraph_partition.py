"""Inductor leaves an ``index_put_`` with boolean indices inside a cudagraph partition: its capture needs a host sync.

Upstream: https://github.com/pytorch/pytorch/pull/170103 ("[inductor] Fix cudagraph skip for index_put_ with
boolean indices, graph partitioning logic"; fixes #169951, cherry-picked to the 2.10 release as #170884).
Symptom: ``torch.compile(mode="reduce-overhead")`` of a function doing ``y[mask] = value`` (an ``index_put_`` with a
boolean index and a device value) cannot be served with CUDA graphs: recording the partition fails with a host
synchronisation inside stream capture ("operation not permitted when stream is capturing"), or, where the
lowering flagged it, the whole graph silently runs without CUDA graphs, although the kernels around the put
could be captured.
Mechanism: an ``index_put_`` whose indices are a bool mask and whose value is not one host scalar cannot go
through ``masked_fill_``: ATen turns the mask into indices with ``nonzero``, which copies the element count
to the host and synchronises. Inductor lowers it to an ``aten.index_put_`` fallback kernel. With graph
partitioning, ``Scheduler.should_partition`` asks ``is_cudagraph_unsafe_op`` whether a node must run outside
the CUDA graphs, and that check did not look at the index dtypes of ``index_put_``: the fallback stayed in
``partition_0`` together with the pointwise kernels, so the cudagraph tree recorded it and the capture hit
the ``nonzero`` host sync (and the ``disable_cudagraphs_reason`` path that did notice it disabled CUDA graphs
for the whole graph instead of partitioning).
Read: the PR descriptions of #170103/#170262 and the cherry-pick #170884 (the diff itself only in part):
the mechanism above follows them.
Doctor: sync-in-capture, at ``partition_0`` (the captured partition runs the boolean-mask ``index_put_``).
Fix (upstream): ``is_cudagraph_unsafe_op`` detects input-dependent cudagraph-unsafe ops such as ``index_put_``
with boolean indices, so ``should_partition`` puts the fallback in its own non-cudagraph partition that runs
eagerly between two recorded partitions; the partitioning path no longer disables the whole graph for it.
"""
from __future__ import annotations

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/pytorch/pull/170103"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "partition_0"
SYMPTOM = "recording the reduce-overhead graph fails on the host sync of a boolean-mask index_put_"
ROWS, COLS, STEPS = 4, 6, 4
aten = torch.ops.aten


# ---- the code Inductor generates for ``def f(x, thresh): y = x * 2; y[y > thresh] = y.mean(); return y + 1``
def triton_poi_fused_gt_mul_0(x, thresh):
    buf0 = x * 2.0
    return buf0, buf0 > thresh


def triton_per_fused_mean_1(buf0):
    return buf0.mean()


def triton_poi_fused_add_2(buf0):
    return buf0 + 1.0


def index_put_fallback(buf0, mask, buf1):
    aten.index_put_(buf0, [mask], buf1)            # boolean indices, device value: nonzero -> host sync


# Scheduler nodes in order: (name, kind, boolean indices?)
NODES = (("triton_poi_fused_gt_mul_0", "kernel", False), ("triton_per_fused_mean_1", "kernel", False),
         ("index_put_fallback", "fallback", True), ("triton_poi_fused_add_2", "kernel", False))


def is_cudagraph_unsafe_op(node, variant: str) -> bool:
    name, kind, bool_indices = node
    if variant == "bug":
        return False                               # only ops tagged cudagraph_unsafe; index dtypes not inspected
    return kind == "fallback" and bool_indices     # input-dependent unsafety: index_put_ with boolean indices


def should_partition(node, variant: str) -> bool:
    return is_cudagraph_unsafe_op(node, variant)


def graph_partition(variant: str) -> list[tuple[bool, list[str]]]:
    """``Scheduler.graph_partition``: consecutive cudagraph-safe nodes share a partition."""
    partitions: list[tuple[bool, list[str]]] = []
    for node in NODES:
        cudagraphable = not should_partition(node, variant)
        if partitions and partitions[-1][0] == cudagraphable and cudagraphable:
            partitions[-1][1].append(node[0])
        else:
            partitions.append((cudagraphable, [node[0]]))
    return partitions


def call(x, thresh):
    """The eager form of the compiled graph."""
    buf0, mask = triton_poi_fused_gt_mul_0(x, thresh)
    buf1 = triton_per_fused_mean_1(buf0)
    index_put_fallback(buf0, mask, buf1)
    return triton_poi_fused_add_2(buf0)


class PartitionedCompiledGraph:
    """The wrapper code with graph partitions, each cudagraphable one served by the cudagraph tree
    (warm up, record, replay; inputs from eager are copied into static buffers, partitions share one pool)."""

    def __init__(self, variant: str, device: str):
        self.device = device
        self.partitions = graph_partition(variant)
        self.pool = graph_pool_handle(device)
        self.static_x = torch.zeros(ROWS, COLS, device=device)
        self.static_thresh = torch.zeros((), device=device)
        self.recorded: dict[int, tuple] = {}

    def partition_0(self):
        buf0, mask = triton_poi_fused_gt_mul_0(self.static_x, self.static_thresh)
        buf1 = triton_per_fused_mean_1(buf0)
        if len(self.partitions) == 1:              # bug: one partition holds every node, the fallback included
            index_put_fallback(buf0, mask, buf1)
            return (triton_poi_fused_add_2(buf0),)
        return buf0, mask, buf1

    def partition_1(self, buf0):
        return (triton_poi_fused_add_2(buf0),)

    def _run_partition(self, index, fn, static):
        if index not in self.recorded:
            self.recorded[index] = capture(fn, device=self.device, pool=self.pool, warmups=1,
                                           name=f"partition_{index}", static=static,
                                           owner="CUDAGraphTreeManager")
        g, outputs = self.recorded[index]
        return replay(g, outputs)

    def __call__(self, x, thresh):
        self.static_x.copy_(x)
        self.static_thresh.copy_(thresh)
        static = {"arg0_1": self.static_x, "arg1_1": self.static_thresh}
        outs = self._run_partition(0, self.partition_0, static)
        if len(self.partitions) == 1:
            return outs[0]
        buf0, mask, buf1 = outs
        index_put_fallback(buf0, mask, buf1)       # non-cudagraph partition: runs eagerly between the graphs
        return self._run_partition(1, lambda: self.partition_1(buf0), {"buf0": buf0})[0]


def run(variant: str, device: str = "cpu"):
    gen = generator(170103)
    steps = [(randn(ROWS, COLS, gen=gen, device=device), randn(1, gen=gen, device=device, scale=0.5).reshape(()))
             for _ in range(STEPS)]

    def eager():
        return [call(x.clone(), t).clone() for x, t in steps]

    def served():
        compiled = PartitionedCompiledGraph(variant, device)
        return [compiled(x, t).clone() for x, t in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
