"""TinyJit(prune=True) ran a kernel fed by a copy once at capture and left it out of the graph: replays return its capture-time value.

Upstream: https://github.com/tinygrad/tinygrad/pull/8073 ("fix bug in jit prune with copy", commit e37bff6c19,
Dec 2024). Pruning came in https://github.com/tinygrad/tinygrad/pull/6569 (commit 28e565dc0d, "prune independent
kernels for openpilot"), so the bug was on master for about three months. Diff read: ``tinygrad/engine/jit.py``
and ``test/test_jit.py`` (``TestJitPrune``). Also read, at the parent commit: ``TinyJit.__call__``,
``CapturedJit.__call__``, ``apply_graph_to_jit`` and ``runtime/graph/cuda.py``, plus the users of ``prune=True``
(``examples/openpilot/compile3.py``, ``extra/resnet18``).
Symptom: a pruned JIT silently returns stale outputs on replay. The new test ``test_prune_w_copy_correct``
(``(weights*2).contiguous() + x.to(Device.DEFAULT)``, with ``x`` on CLANG) checks three fresh inputs against
``weights*2 + a``. Before the fix every replay returned the capture-time sum.
Mechanism: ``TinyJit`` runs the function eagerly on call 1 and records its ``ExecItem``\\ s on call 2. With
``prune=True`` it then walks ``jit_cache`` from ``depends = set(input_buffers)``. A kernel that reads a buffer in
``depends`` adds its outputs (``ei.prg.p.outs``), but only when it is a ``CompiledRunner``. Every
``CompiledRunner`` whose outputs are not in ``depends`` is classed "onetime": it is run once, there, and removed
from the cache that is replayed. ``BufferCopy``/``BufferXfer`` items are always kept, but they did not add their
destination ``ei.bufs[0]`` to ``depends``. So a kernel that reads an input only through an in-JIT copy looks
input-independent. It is run once at capture and pruned. On call 3 ``CapturedJit`` hands the pruned cache to
``apply_graph_to_jit``, which batches the remaining kernels into a ``CUDAGraph`` (``BufferCopy`` stays outside
it). Each replay refreshes the copy's destination, but nothing reads it any more. The output keeps the value
the pruned kernel computed from the capture call's input.
Here the workload is an openpilot-like policy, as in ``compile3.py``. ``img`` is a device input, read directly.
``desire`` comes from numpy (CLANG) and is copied in inside the JIT. A weight-only kernel (``E_w2``) is
rightly onetime. ``E_desire`` (``desire_dev @ w2``) is wrongly onetime, so the replayed graph holds only
``E_img`` and ``E_out``. ``eager()`` is ``JIT=0``: the function each call.
Doctor: warmup-divergence, at ``prune_independent_kernels``. The capture-time dependence walk decides which
kernels replay; it dropped ``E_desire``, which an eager call runs every time.
Fix (upstream): in the prune walk, ``if isinstance(ei.prg, (BufferCopy, BufferXfer)): depends.add(ei.bufs[0])``.
The copy's destination then counts as input-dependent, and the kernels that read it stay in the graph.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/tinygrad/tinygrad/pull/8073"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "prune_independent_kernels"
SYMPTOM = "a pruned TinyJit replays without the kernel fed by an in-JIT copy; its output stays at the capture call's value"

ROWS, IMG, DESIRE, HIDDEN, CALLS = 2, 4, 3, 4, 5
capturing: list = []                      # tinygrad.engine.realize.capturing: the TinyJit now recording


class CompiledRunner:
    """A compiled kernel: ``fxn(*bufs)`` writes ``bufs[o]`` for each ``o`` in ``outs`` (``prg.p.outs``)."""

    def __init__(self, name, fxn, outs=(0,)):
        self.name, self.fxn, self.outs = name, fxn, outs

    def __call__(self, bufs):
        self.fxn(*bufs)


class BufferCopy:
    """``BufferCopy``: ``bufs[0] <- bufs[1]`` across devices (here CLANG -> the JIT's device). No graph node."""

    name = "copy"

    def __call__(self, bufs):
        bufs[0].copy_(bufs[1])


class ExecItem:
    def __init__(self, prg, bufs):
        self.prg, self.bufs = prg, list(bufs)

    def run(self):
        self.prg(self.bufs)


def realize(ei: ExecItem):
    """``run_schedule``: run the item; while a TinyJit captures, it also records it (``capturing[0].add``)."""
    ei.run()
    if capturing:
        capturing[0].add(ei)


class Policy:
    """The jitted function: kernels as tinygrad schedules them for ``relu(img @ w_img) + desire.to(dev) @ (w_desire*2)``."""

    def __init__(self, device):
        gen = generator(8073)
        self.device = device
        self.w_img = randn(IMG, HIDDEN, gen=gen, device=device, scale=0.6)
        self.w_desire = randn(DESIRE, HIDDEN, gen=gen, device=device, scale=0.6)
        self.E_w2 = CompiledRunner("E_w2", lambda o, w: o.copy_(w * 2))
        self.copy = BufferCopy()
        self.E_img = CompiledRunner("E_img", lambda o, x, w: o.copy_(torch.relu(x @ w)))
        self.E_desire = CompiledRunner("E_desire", lambda o, d, w2: o.copy_(d @ w2))
        self.E_out = CompiledRunner("E_out", lambda o, h, d: o.copy_(h + d))

    def __call__(self, img, desire):
        empty = lambda *s: torch.empty(*s, device=self.device)  # noqa: E731 - a fresh Buffer per realize
        w2, desire_dev, h, d, out = (empty(DESIRE, HIDDEN), empty(ROWS, DESIRE), empty(ROWS, HIDDEN),
                                     empty(ROWS, HIDDEN), empty(ROWS, HIDDEN))
        realize(ExecItem(self.E_w2, [w2, self.w_desire]))           # (weights*2).contiguous(): no input
        realize(ExecItem(self.copy, [desire_dev, desire]))          # desire.to(Device.DEFAULT)
        realize(ExecItem(self.E_img, [h, img, self.w_img]))
        realize(ExecItem(self.E_desire, [d, desire_dev, w2]))
        realize(ExecItem(self.E_out, [out, h, d]))
        return out


def _has(bufs, b):
    return any(x is b for x in bufs)


def prune_independent_kernels(jit_cache, input_buffers, variant):
    """``TinyJit.__call__``'s ``if self.prune:`` block: keep what depends on the inputs, run the rest once now."""
    depends = list(input_buffers)
    for ei in jit_cache:
        if any(_has(depends, b) for b in ei.bufs):
            if isinstance(ei.prg, CompiledRunner):
                depends.extend(ei.bufs[out] for out in ei.prg.outs)
            if variant == "fix" and isinstance(ei.prg, BufferCopy):
                depends.append(ei.bufs[0])
    keep = [not isinstance(ei.prg, CompiledRunner) or any(_has(depends, ei.bufs[o]) for o in ei.prg.outs)
            for ei in jit_cache]
    pruned = [ei for ei, k in zip(jit_cache, keep) if k]
    onetime = [ei for ei, k in zip(jit_cache, keep) if not k]
    for ei in onetime:                    # "run the onetime kernels here"
        ei.run()
    return pruned


def get_input_replace(jit_cache, input_buffers):
    return {(j, i): next(k for k, b in enumerate(input_buffers) if b is a)
            for j, ei in enumerate(jit_cache) for i, a in enumerate(ei.bufs) if _has(input_buffers, a)}


class GraphRunner:
    """``CUDAGraph`` (runtime/graph/cuda.py) over a batch of kernels. Its kernel parameters that are JIT inputs
    are patched every call (``input_replace``); here such a parameter is a graph-held buffer the caller's
    data is copied into before the replay."""

    def __init__(self, batch, input_buffers, device):
        self.input_params = {}
        self.items = []
        for ei in batch:
            bufs = []
            for b in ei.bufs:
                idx = next((k for k, x in enumerate(input_buffers) if x is b), None)
                if idx is not None:
                    if idx not in self.input_params:
                        self.input_params[idx] = torch.empty_like(b).copy_(b)
                    b = self.input_params[idx]
                bufs.append(b)
            self.items.append(ExecItem(ei.prg, bufs))
        reads = {f"input_rawbuffers[{k}]": v for k, v in self.input_params.items()}
        reads.update({"desire_dev (BufferCopy destination)": b for ei in self.items if ei.prg.name == "E_desire"
                      for b in ei.bufs[1:2]})
        self.out = self.items[-1].bufs[0]
        self.graph, _ = capture(self._launch, device=device, static=reads, owner="TinyJit CUDAGraph",
                                name=f"JIT batch of {len(self.items)} kernels")

    def _launch(self):
        for ei in self.items:
            ei.run()
        return self.out

    def __call__(self, input_buffers):
        for idx, param in self.input_params.items():
            param.copy_(input_buffers[idx])
        replay(self.graph, self.out)


def apply_graph_to_jit(jit_cache, input_buffers, device):
    """Batch consecutive graphable kernels into one graph; a single kernel, or a ``BufferCopy``, runs as is."""
    out, batch = [], []

    def flush():
        if len(batch) > 1:
            runner = GraphRunner(list(batch), input_buffers, device)
            out.append(lambda bufs: runner(bufs))
        else:
            out.extend(lambda bufs, ei=ei: ei.run() for ei in batch)
        batch.clear()

    for ei in jit_cache:
        if isinstance(ei.prg, CompiledRunner):
            batch.append(ei)
        else:
            flush()
            out.append(lambda bufs, ei=ei: ei.run())
    flush()
    return out


class CapturedJit:
    def __init__(self, ret, jit_cache, input_replace, device):
        self.ret, self.jit_cache, self.input_replace, self.device = ret, jit_cache, input_replace, device
        self._graphed = None

    def __call__(self, input_buffers):
        for (j, i), idx in self.input_replace.items():     # assign inputs
            self.jit_cache[j].bufs[i] = input_buffers[idx]
        if self._graphed is None:                          # JIT < 2: condense the items into graphs
            self._graphed = apply_graph_to_jit(self.jit_cache, input_buffers, self.device)
        for item in self._graphed:
            item(input_buffers)
        return self.ret


class TinyJit:
    def __init__(self, fxn, variant, device, prune=False):
        self.fxn, self.variant, self.device, self.prune = fxn, variant, device, prune
        self.cnt, self.captured = 0, None

    def add(self, ei):
        self._jit_cache.append(ei)

    def __call__(self, img, desire):
        input_buffers = [img, desire]
        if self.cnt == 0:                                   # jit ignore
            ret = self.fxn(img, desire)
        elif self.cnt == 1:                                 # jit capture
            self._jit_cache = []
            capturing.append(self)
            try:
                ret = self.fxn(img, desire)
            finally:
                capturing.clear()
            jit_cache = self._jit_cache
            del self._jit_cache
            if self.prune:
                jit_cache = prune_independent_kernels(jit_cache, input_buffers, self.variant)
            self.captured = CapturedJit(ret, jit_cache, get_input_replace(jit_cache, input_buffers), self.device)
        else:                                               # jit exec
            ret = self.captured(input_buffers)
        self.cnt += 1
        return ret


def run(variant: str, device: str = "cpu"):
    gen = generator(6569)
    # img: a device input read directly; desire: numpy (CLANG) data the JIT copies in. Both change every call.
    calls = [(randn(ROWS, IMG, gen=gen, device=device), torch.randn(ROWS, DESIRE, generator=gen) * 2)
             for _ in range(CALLS)]

    def served():
        policy = Policy(device)
        jit = TinyJit(policy, variant, device, prune=True)
        return [jit(img, desire).clone() for img, desire in calls]

    def eager():
        policy = Policy(device)
        return [policy(img, desire).clone() for img, desire in calls]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
