"""``self.weight.data *= self.mask`` under cudagraph trees: the functionalized ``set_`` frees the storage the graph reads.

Upstream: https://github.com/pytorch/pytorch/pull/183645 ("Disable cudagraphs for input storage mutation",
merged as db9252f7208; fixes pytorch/pytorch#183313, "Inductor max-autotune fails with cudagraph pool tracking
error when Conv2d weight is mutated via .data in forward"; the older report is #126187, "cudagraph error with
set_ on inputs").
Symptom: a ``Conv2d`` subclass that prunes its weight in ``forward`` with ``self.weight.data *= self.mask``
runs under ``torch.compile(mode="max-autotune")`` (cudagraph trees) only until the first replays, which stop
with ``RuntimeError: Detected 6 tensor(s) in the cudagraph pool not tracked as outputs``; the same model
with ``max-autotune-no-cudagraphs``, or the default mode, runs and prunes correctly (PyTorch 2.12 nightly,
May 2026).
Mechanism: functionalization turns the hidden ``.data`` mutation of the parameter into a new buffer
(``mul = primals_1 * primals_2``) plus a *storage rebind* of the graph input (``aten.set_(primals_1,
mul)``). The rebind is metadata, host work: under the cudagraph it runs once, at recording, and leaves the
parameter pointing into the cudagraph pool (memory the tree does not track as an output). The recorded
``mul`` keeps reading the parameter's *previous* storage by address, but the parameter was that storage's
only owner, and the rebind released it. Every replay then reads freed memory (the pool-tracking check of
cudagraph trees aborts before that; without it, the replay reads whatever the allocator put there, and the
pruning mask of step t is applied to a stale weight instead of the already-pruned one).
Doctor: dangling-reference, at ``functionalized_forward`` (the graph's ``mul`` reads the weight storage that
its own ``set_`` released).
Fix (upstream): detect graph-input storage rebinding (``aten.set_`` on an input) in the cudagraph checks and
skip CUDA graph wrapping for that graph ("skipping cudagraphs due to mutated input storage"); the compiled
code then runs without graphs, rebinding the weight to a fresh buffer each call, as eager mutates it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/pytorch/pull/183645"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "functionalized_forward"
SYMPTOM = "graphed pruning conv replays read the weight storage its own set_ released (pool-tracking error upstream)"
C_IN, C_OUT, K, HW, STEPS = 2, 3, 3, 5, 4


class PrunedConv2d(torch.nn.Conv2d):
    """The issue's module: gradual magnitude pruning applied to the parameter in ``forward``."""

    def __init__(self, device):
        super().__init__(C_IN, C_OUT, K, padding=1, bias=False, device=device)
        gen = generator(183313)
        with torch.no_grad():
            self.weight.copy_(randn(C_OUT, C_IN, K, K, gen=gen, device=device))
        self.register_buffer("mask", torch.ones(C_OUT, C_IN, K, K, device=device))

    def forward(self, x):
        """Eager: ``.data`` hides the in-place multiply from autograd; the parameter keeps its storage."""
        self.weight.data *= self.mask
        return F.conv2d(x, self.weight, padding=1)


def functionalized_forward(mod, x):
    """What AOTAutograd/Inductor compile ``forward`` to: the hidden mutation becomes a new buffer and a
    storage rebind of the input (``aten.set_(primals_1, mul)``), a metadata update done on the host."""
    mul = mod.weight * mod.mask                 # kernel: reads primals_1's storage by address
    mod.weight.data = mul                       # set_: the parameter now points at the new buffer
    return F.conv2d(x, mul, padding=1)


def has_input_storage_mutation(graph_fn) -> bool:
    """The graph-input mutation analysis: ``functionalized_forward`` rebinds an input's storage."""
    return graph_fn is functionalized_forward


def cudagraphify(graph_fn, mod, static_x, device, variant):
    """Cudagraph trees' wrapping of one compiled graph: warm up on the first call, record on the second,
    replay afterwards. Returns the per-call runner."""
    if variant == "fix" and has_input_storage_mutation(graph_fn):
        # (fix) skipping cudagraphs due to mutated input storage (aten.set_ on a graph input)
        return lambda x: graph_fn(mod, x)
    state = {}

    def run(x):
        static_x.copy_(x)
        if "graph" not in state:
            g, out = capture(lambda: graph_fn(mod, static_x), device=device, static={"x": static_x},
                             state={"mask": mod.mask}, owner="cudagraph trees (compiled PrunedConv2d)")
            state["graph"], state["out"] = g, out
        return replay(state["graph"], state["out"])

    return run


def prune_schedule(step):
    """Host side pruning schedule: the mask buffer is updated in place between steps (same address)."""
    m = torch.ones(C_OUT, C_IN, K, K)
    m.view(-1)[step::5] = 0.0
    return m


def run(variant: str, device: str = "cpu"):
    gen = generator(1)
    xs = [randn(1, C_IN, HW, HW, gen=gen, device=device) for _ in range(STEPS)]

    def eager():
        mod = PrunedConv2d(device)
        outs = []
        with torch.no_grad():
            for step, x in enumerate(xs):
                mod.mask.copy_(prune_schedule(step))
                outs.append(mod(x).clone())
        return outs + [mod.weight.detach().clone()]

    def served():
        mod = PrunedConv2d(device)
        static_x = torch.zeros(1, C_IN, HW, HW, device=device)
        compiled = cudagraphify(functionalized_forward, mod, static_x, device, variant)
        outs = []
        with torch.no_grad():
            for step, x in enumerate(xs):
                mod.mask.copy_(prune_schedule(step))
                outs.append(compiled(x).clone())
        return outs + [mod.weight.detach().clone()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
