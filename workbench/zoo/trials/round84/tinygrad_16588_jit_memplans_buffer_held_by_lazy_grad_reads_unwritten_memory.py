"""TinyJit capture: the memory planner suballocates a BUFFER that the lazy ``.grad`` made during capture still reads, so the replayed graph writes the arena and ``.grad`` reads memory nothing wrote.

Upstream: https://github.com/tinygrad/tinygrad/pull/16588 ("jit: don't memplan buffers reachable from live tensors",
tinygrad/tinygrad, merged 2026-06-12 as 76c10cd; fixes issue #16571). Read: the commit message, the full diff
(``tinygrad/engine/jit.py``: the ``held_bufs`` line in ``TinyJit.__call__``; ``test/unit/test_jit.py``:
``test_jit_lazy_grad_after_replay``), and ``jit.py`` at that commit (``TinyJit.__call__``, ``jit_lower``,
``CapturedJit.__call__``). The issue text was read only as quoted in its search result; ``memory_plan_rewrite``
(tinygrad/schedule/memory.py) was not read.
Symptom: a ``@TinyJit`` training step that calls ``backward()`` twice on a per-example loss, with a fresh BUFFER made
by ``.contiguous()`` on a permuted input: the first (eager) call gives the right ``conv.weight.grad``; from the
capture call on, ``.grad`` read after the call is exactly 0.0. Only with the memory planner enabled.
Mechanism: ``TinyJit.__call__`` runs the function eagerly at ``cnt == 0``. At ``cnt == 1`` it runs it again while
``capturing``: every ``realize`` only appends its kernels to ``self._linears``. ``loss.mean().realize()`` schedules the
``.contiguous()`` BUFFER of the permuted input, the loss and the mean, and every live lazy graph is rewritten to read
that BUFFER, the lazy ``conv.weight.grad`` that ``backward()`` built included. ``__call__`` then computes
``held_bufs = set(buffers) | {buffers of get_parameters(ret)}`` (buffers already allocated, and the return value's)
and calls ``jit_lower(big_linear, held_bufs, ...)``, whose ``memory_plan_rewrite`` suballocates every other BUFFER the
linear writes into a shared arena. That rewrites only the captured kernels. The lazy ``.grad`` still names the
original BUFFER, which no kernel writes. ``graph_split_rewrite`` batches the kernels into a graph (CUDA graph on
NVIDIA), and ``CapturedJit.__call__`` replays it. Realizing ``.grad`` after the call allocates that BUFFER fresh
and computes the gradient from zeros. Later calls only replay, so ``.grad`` keeps that value.
Doctor: warmup-divergence, at __call__. The capture call decides where the captured kernels write (the planner's
arena slice) and every replay reuses that decision, while the eager read after the call (the lazy ``.grad``) still
uses the buffer reference the eager path writes.
Fix (upstream): ``held_bufs`` also takes every BUFFER reachable from a live Tensor (``all_tensors``, toposort), so
the planner leaves buffers that outside lazy graphs read alone. Buffers truly internal to the JIT are still planned.
Modelled: tinygrad's lazy Tensor, BUFFER, ``buffers``/``all_tensors``, ``capturing``, ``run_linear``,
``memory_plan_rewrite`` (arena suballocation of unheld written BUFFERs), ``jit_lower`` and ``CapturedJit``, reduced
to what this path needs: one ``ExecItem`` per realized tensor, no fusion or pruning. The graph is one captured graph
over the planned linear (JIT=1, one batch). ``backward()`` is a stand-in that builds the gradient lazily from the
same sources autograd would use. The model is upstream's test reduced to a 1x1 convolution (4 input channels, 3
output channels, no bias) on a 2x3x3 NHWC input, float64.
Workload: upstream's test: four calls of the JIT step on the same ``x``, ``y``, reading ``conv.weight.grad`` after each
call. Call 0 is eager. Call 1 captures and replays; ``.grad`` is realized from the never-written BUFFER and is all
zeros (eager: a [3, 4] gradient with entries up to 2.33 in magnitude). Calls 2 and 3 replay and read the same zeros.
"""
from __future__ import annotations

import weakref

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/tinygrad/tinygrad/pull/16588"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "__call__"
SYMPTOM = ("@TinyJit step with backward() on a per-example loss: after the capture call the lazy conv.weight.grad "
           "reads the .contiguous() BUFFER that the memory planner moved into the JIT arena; replays write the arena, "
           "the BUFFER is allocated fresh on realize, and the gradients read back are exactly 0.0")

B, H, W, C_IN, C_OUT = 2, 3, 3, 4, 3
_variant = "bug"

# --- tinygrad.uop.ops.buffers, tinygrad.tensor.all_tensors, tinygrad.engine.realize.capturing ------------------------
buffers: dict = {}                       # BUFFER -> its allocation (realized buffers)
all_tensors: set = set()                 # weakrefs to every live Tensor
capturing: list = []


class BUFFER:
    def __init__(self, shape, device):
        self.shape, self.device = shape, device

    def ensure_allocated(self):
        if self not in buffers:
            buffers[self] = torch.zeros(self.shape, dtype=torch.float64, device=self.device)
        return buffers[self]


class ExecItem:
    """One kernel: computes ``fn(*ins)`` into ``bufs[0]`` (the rest are its inputs)."""

    def __init__(self, fn, bufs):
        self.fn, self.bufs = fn, bufs

    def run(self):
        out, *ins = [b.ensure_allocated() for b in self.bufs]
        out.copy_(self.fn(*ins))


def run_linear(linear):
    for ei in linear:
        ei.run()


class Tensor:
    """Lazy tensor: backed by a BUFFER once realized, else ``fn`` over ``srcs``."""

    def __init__(self, buf=None, fn=None, srcs=(), shape=None, device="cpu"):
        self.buf, self.fn, self.srcs = buf, fn, tuple(srcs)
        self.shape = buf.shape if buf is not None else shape
        self.device = buf.device if buf is not None else device
        all_tensors.add(weakref.ref(self, all_tensors.discard))
        self.grad = None

    @staticmethod
    def from_data(data):
        b = BUFFER(tuple(data.shape), data.device)
        b.ensure_allocated().copy_(data)
        return Tensor(buf=b)

    def lazy(self, fn, shape, *others):
        return Tensor(fn=fn, srcs=(self, *others), shape=shape, device=self.device)

    def realize(self):
        if self.buf is None:
            for s in self.srcs:
                s.realize()
            self.buf = BUFFER(self.shape, self.device)
            ei = ExecItem(self.fn, [self.buf, *(s.buf for s in self.srcs)])
            if capturing:
                capturing[0].add_linear([ei])          # scheduled, not run
            else:
                ei.run()
        return self

    def numpy(self):
        return self.realize().buf.ensure_allocated().clone()

    def toposort_buffers(self):
        seen, out, stack = set(), [], [self]
        while stack:
            t = stack.pop()
            if id(t) in seen:
                continue
            seen.add(id(t))
            if t.buf is not None:
                out.append(t.buf)
            stack.extend(t.srcs)
        return out


# --- tinygrad.schedule.memory.memory_plan_rewrite, tinygrad.engine.jit ----------------------------------------------------

def memory_plan_rewrite(linear, held_bufs):
    """Suballocate every BUFFER the linear writes that is not held into one arena (the captured kernels' copies)."""
    planned = [ei.bufs[0] for ei in linear if ei.bufs[0] not in held_bufs]
    sizes = [int(torch.Size(b.shape).numel()) for b in planned]
    arena = torch.zeros(max(sum(sizes), 1), dtype=torch.float64, device=linear[0].bufs[0].device)
    remap, off = {}, 0
    for b, n in zip(planned, sizes):
        slot = BUFFER(b.shape, b.device)
        buffers[slot] = arena[off:off + n].view(b.shape)
        remap[b], off = slot, off + n
    return [ExecItem(ei.fn, [remap.get(b, b) for b in ei.bufs]) for ei in linear], arena


def jit_lower(linear, held_bufs):
    linear, arena = memory_plan_rewrite(linear, held_bufs)
    for ei in linear:                                    # compile_linear: runners get their buffers allocated
        for b in ei.bufs:
            b.ensure_allocated()
    return linear, arena


class CapturedJit:
    def __init__(self, ret, linear, arena, device, inputs):
        self.ret, self.linear, self.arena = ret, linear, arena
        out = ret.buf.ensure_allocated()
        # graph_split_rewrite + GraphRunner: one graph over the planned linear (JIT=1)
        self.graph, self.out = capture(lambda: (run_linear(self.linear), out)[1], device=device, warmups=0,
                                       name="TinyJit graph", owner="TinyJit (CapturedJit)", static=inputs)

    def __call__(self):
        replay(self.graph, self.out)
        return self.ret


class TinyJit:
    def __init__(self, fxn, device, use_jit=True):
        self.fxn, self.device, self.use_jit = fxn, device, use_jit
        self.captured, self.cnt = None, 0

    def add_linear(self, linear):
        self._linears.append(linear)

    def __call__(self, *args):
        if not self.use_jit or self.cnt == 0:
            ret = self.fxn(*args).realize()
        elif self.cnt == 1:
            self._linears = []
            capturing.append(self)
            try:
                ret = self.fxn(*args).realize()
            finally:
                capturing.clear()
            big_linear = [ei for lin in self._linears for ei in lin]
            del self._linears
            if _variant == "fix":     # hold all buffers reachable from live Tensors (e.g. lazy .grad made in capture)
                held_bufs = set(buffers) | {u for tref in list(all_tensors) if (t := tref()) is not None
                                            for u in t.toposort_buffers()}
            else:
                held_bufs = set(buffers) | {ret.buf}               # get_parameters(ret)
            inputs = {f"arg{i}": a.buf.ensure_allocated() for i, a in enumerate(args) if isinstance(a, Tensor)}
            linear, arena = jit_lower(big_linear, held_bufs)
            self.captured = CapturedJit(ret, linear, arena, self.device, inputs)
            ret = self.captured()
        else:
            ret = self.captured()
        self.cnt += 1
        return ret


# --- the model and step (upstream's test, reduced) ------------------------------------------------------------------------

class Conv1x1:
    def __init__(self, device):
        self.weight = Tensor.from_data(randn(C_OUT, C_IN, gen=generator(16588), device=device).double())


def backward(loss_srcs, scale, conv):
    """``(loss * scale).sum().backward()``: d/dW of sum_b scale * loss_b, built lazily from the same sources."""
    xp, y = loss_srcs

    def grad_fn(xp, y, w):
        pre = torch.einsum("bchw,oc->bohw", xp, w)
        dout = y.view(B, C_OUT, H, W) * (pre > 0) * scale
        return torch.einsum("bohw,bchw->oc", dout, xp)

    conv.weight.grad = xp.lazy(grad_fn, (C_OUT, C_IN), y, conv.weight)


def step(conv, x, y):
    xp = x.lazy(lambda x: x.permute(0, 3, 1, 2).contiguous(), (B, C_IN, H, W))          # a fresh BUFFER
    out = xp.lazy(lambda xp, w: torch.relu(torch.einsum("bchw,oc->bohw", xp, w)).flatten(1), (B, C_OUT * H * W),
                  conv.weight)
    loss = out.lazy(lambda o, y: (o * y).sum(1), (B,), y)                                # per-example loss
    backward((xp, y), 1.0, conv)
    conv.weight.grad = None
    backward((xp, y), 0.5, conv)
    return loss.lazy(lambda l: l.mean().reshape(1), (1,))


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant

    def serve(use_jit: bool):
        buffers.clear()
        gen = generator(16571)
        conv = Conv1x1(device)
        x = Tensor.from_data(randn(B, H, W, C_IN, gen=gen, device=device).double())
        y = Tensor.from_data(randn(B, C_OUT * H * W, gen=gen, device=device).double())
        jit_step = TinyJit(step, device, use_jit)
        outs = []
        for _ in range(4):
            ret = jit_step(conv, x, y)
            outs += [ret.numpy(), conv.weight.grad.numpy()]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
