"""A cudagraph partition loses its input's size symbol: the graph recorded for 4 rows is asked to serve 6.

Upstream: https://github.com/pytorch/pytorch/pull/174729 ("[inductor] Fix missed symbol propagation in
cudagraphs partition"; Meta diff D92879629, landed: HEAD has the ``update``). Read: the PR description, the
buggy ``Scheduler.get_graph_partition_symbol_inputs`` (ROCm/pytorch fork snapshot) and the fixed one
(pytorch/pytorch HEAD); not the diff page itself.
Symptom: as reported, "cudagraph cache miskeying when a partition takes dynamically-shaped inputs from
non-cudagraphable ops" with ``torch._inductor.config.graph_partition = True`` and
``mode="reduce-overhead"`` (PyTorch nightly, February 2026; the PR gives no reproducer): a call whose
dynamic size differs from the recorded one is served by the CUDA graph recorded for the earlier size.
Mechanism: with graph partitioning, a data-dependent op (here a boolean-mask row selection, an "unbacked
binding op") runs in a non-cudagraphable partition and hands a ``(u0, D)`` buffer to the next,
cudagraphable partition. Each partition function receives, besides its tensors, the int values of the
symbols in ``GraphPartitionSignature.symbol_inputs``, and ``cudagraphify_impl`` keys its recordings on those
ints (``int_key``/``get_ints``: one CUDA graph tree per tuple of int inputs). ``get_graph_partition_symbol_inputs``
collected the symbols of the partition's nodes, then wrote
``candidate_symbols.union(*(get_input_node_symbols(node) ...))``: ``OrderedSet.union`` returns a new set, so
the symbols of the input buffers' shapes were dropped. When no node of the partition names ``u0`` itself
(here an extern ``mm`` of ``buf0.T @ buf0``, whose output is ``(D, D)``), ``u0`` is not an argument of the
partition, the cache key has no ints, and the first recording (made for ``u0 = 4``) is replayed for every
later call; a call with six selected rows copies its ``(6, D)`` buffer into the recording's ``(4, D)``
placeholder, which does not fit (torch's size-mismatch ``RuntimeError`` in this model).
Doctor: undersized-buffer, at ``_copy_inputs_and_remove_from_src`` (six rows copied into the four-row static
input of the graph recorded for ``u0 = 4``).
Fix (upstream): ``candidate_symbols.update(...)``: the input nodes' layout symbols join ``symbol_inputs``,
``u0`` becomes an int argument of the partition, and each row count records its own CUDA graph.
"""
from __future__ import annotations

import operator

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/pytorch/pull/174729"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "_copy_inputs_and_remove_from_src"
SYMPTOM = "a partition's dynamic row count is missing from the cudagraph key: a 4-row recording is fed 6 rows"
ROWS, DIM = 8, 4
THRESHOLDS = (0.1, -0.7, -0.45, 0.5, -0.1, 0.2)   # per call: selects 4, 4, 6, 4, 6, 5 of the 8 rows


# ----------------------------------------------------------------------------- scheduler (compile time)
class Node:
    """A scheduler node of the cudagraphable partition: its own free symbols (ranges, output layout)."""

    def __init__(self, name, free_symbol_uses):
        self.name, self.free_symbol_uses = name, set(free_symbol_uses)


class InputNode:
    """A partition input produced by another partition: its layout (size) symbols."""

    def __init__(self, name, layout_symbols):
        self.name, self.layout_symbols = name, set(layout_symbols)


def get_graph_partition_symbol_inputs(partition, input_nodes, variant):
    """Symbols that must be passed to the partition function (``Scheduler.get_graph_partition_symbol_inputs``)."""
    candidate_symbols = set().union(*(node.free_symbol_uses for node in partition))
    if variant == "fix":
        candidate_symbols.update(*(node.layout_symbols for node in input_nodes.values()))
    else:
        candidate_symbols.union(*(node.layout_symbols for node in input_nodes.values()))   # result dropped
    return sorted(candidate_symbols)


# ------------------------------------------------------------------------------- generated wrapper code
def partition_0(x):
    """Non-cudagraphable partition: the boolean-mask selection defines the unbacked size u0."""
    keep = x.sum(dim=1) > THRESHOLDS[partition_0.call]
    partition_0.call += 1
    buf0 = x[keep]                                   # (u0, DIM)
    return buf0, buf0.shape[0]


def partition_1(args):
    """Cudagraphable partition: extern mm of buf0.T @ buf0 (output (DIM, DIM)), then a projection."""
    buf0, w = args[0], args[1]
    gram = buf0.t() @ buf0
    return (torch.tanh(gram @ w),)


# ------------------------------------------------------------------------------------ cudagraph trees
class CUDAGraphNode:
    def __init__(self, model, inputs, device):
        self.model = model
        self.static_input_idxs = (1,)                # the weight: a static (parameter) input
        self.non_static_input_idx = [i for i, t in enumerate(inputs)
                                     if isinstance(t, torch.Tensor) and i not in self.static_input_idxs]
        self.reconstructed_inputs = [t.clone() if i in self.non_static_input_idx else t
                                     for i, t in enumerate(inputs)]
        self.graph, self.outputs = capture(lambda: model(self.reconstructed_inputs)[0], device=device,
                                           owner="CUDAGraphTreeManager (partition_1)",
                                           static={"buf0": self.reconstructed_inputs[0]})

    def _copy_inputs_and_remove_from_src(self, dsts, srcs):
        for idx in self.non_static_input_idx:
            dsts[idx].copy_(srcs[idx])               # torch._foreach_copy_(dst_tensors, src_tensors)
            srcs[idx] = None

    def run(self, new_inputs):
        self._copy_inputs_and_remove_from_src(self.reconstructed_inputs, new_inputs)
        return (replay(self.graph, self.outputs),)


def cudagraphify_impl(model, inputs, device):
    fn_cache: dict = {}
    # Detect int inputs: we need to index on these
    int_key = [i for i, v in enumerate(inputs) if isinstance(v, int)]
    get_ints = operator.itemgetter(*int_key) if int_key else (lambda _: None)

    def deferred_cudagraphify(inputs):
        key = get_ints(inputs)
        node = fn_cache.get(key)
        if node is not None:
            return node.run(list(inputs))
        node = fn_cache[key] = CUDAGraphNode(model, inputs, device)     # record for this key
        return node.run(list(inputs))

    return deferred_cudagraphify


class Runner:
    """``Runner.call`` of the compiled graph: partition_0 eagerly, partition_1 through cudagraphify."""

    def __init__(self, weight, device, variant, graphed):
        self.weight, self.device, self.graphed = weight, device, graphed
        partition = [Node("extern_kernels.mm", set()), Node("triton_poi_tanh_mm", set())]
        self.symbol_inputs = get_graph_partition_symbol_inputs(partition, {"buf0": InputNode("buf0", {"u0"})},
                                                               variant)
        self.partition_1 = None

    def call(self, x):
        buf0, u0 = partition_0(x)
        symbols = {"u0": u0}
        args = [buf0, self.weight] + [symbols[s] for s in self.symbol_inputs]
        if not self.graphed:
            return partition_1(args)[0]
        if self.partition_1 is None:
            self.partition_1 = cudagraphify_impl(partition_1, args, self.device)
        return self.partition_1(args)[0]


def run(variant: str, device: str = "cpu"):
    gen = generator(174729)
    weight = randn(DIM, DIM, gen=gen, device=device, scale=0.3)
    xs = [randn(ROWS, DIM, gen=gen, device=device) for _ in THRESHOLDS]

    def workload(graphed: bool):
        partition_0.call = 0
        runner = Runner(weight, device, variant, graphed)
        return [runner.call(x).clone() for x in xs]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: workload(True), lambda: workload(False))
