"""TinyJit builds its graph on a call whose input is its own output: that output slot is patched with later inputs.

Upstream: https://github.com/tinygrad/tinygrad/pull/14287 ("jit graph handle input==output aliasing", commit
fbed36fa15; the failing test came first in #14278, commit 4de107b764). Diff read (``tinygrad/engine/jit.py``,
``runtime/graph/cuda.py``, ``hcq.py``, ``metal.py``, ``test/test_jit_footguns.py``, ``apps/llm.py``).
Symptom: "wrong result in llm": a decode loop that feeds the JIT's returned tensor back in as the next input
and later starts a new session with a fresh input tensor gets the previous session's value back (the footgun
test: ``(x + 1) * 2`` over three steps from 100 gives 1406 instead of 814, "uses 350 instead of 100");
``Transformer.generate`` in ``apps/llm.py`` carried a ``self.forward_jit.reset()`` workaround for it.
Mechanism: ``TinyJit`` runs the function on call 1, records its kernels (``ExecItem``\\ s) on call 2 with
``input_replace`` = the (kernel j, buffer slot i) pairs that held an input then, and builds the CUDA graph on
call 3 (``CapturedJit.__call__``, ``_first_run``). Before building, the call patches this call's inputs into
the jit cache, then ``GraphRunner.__init__`` recomputes ``input_replace`` with ``get_input_replace``, by
identity: ``if a in input_buffers``. When call 3's input *is* the tensor the JIT returned (its output buffer
``ret``), the second kernel's **output** slot holds an input buffer too, so it is registered as a replaceable
input slot of the graph: on every replay its kernel-node parameter is pointed at the caller's input
(``CUDAGraph`` updates the kernel params of every ``input_replace`` slot). While the input stays ``ret`` nothing
shows; the first call with a fresh tensor makes the second kernel write the result into the caller's input
and leaves ``ret`` (what the JIT returns) holding the previous session's value; the session then continues
from that stale value. Here a patched kernel parameter is a graph-held buffer per input (``input_params``):
the caller's data is copied in before a replay and, for slots a kernel writes, copied back after it (the
write went to the caller's memory), so the replay writes the static input buffer ``input_params[0]``.
Doctor: persistent-mutation, at ``E_mul_two`` (the captured kernel whose output slot is patched with the
caller's input writes that input buffer, not the JIT's output ``ret``).
Fix (upstream): ``CapturedJit`` builds ``orig_valid_positions`` (per ``ExecItem``, the slots that were inputs in
the capture-time ``input_replace``) and ``get_input_replace`` skips every other slot, so an output slot that
aliases an input at graph-build time stays bound to the JIT's own buffer; the ``reset()`` workaround in
``apps/llm.py`` was removed.
(Two kernels, since a single-kernel JIT is not graphed; vectors of four; ``eager()`` is ``JIT=2``: the same
``CapturedJit`` and capture-time ``input_replace``, without a graph.)
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/tinygrad/tinygrad/pull/14287"
FAMILY = "persistent-buffer mutation"
KIND = "persistent-mutation"
SITE = "E_mul_two"
SYMPTOM = "a new session's first JIT call returns the previous session's output (LLM decode restarts from it)"

N = 4


def E_add_one(out, x):
    """kernel 1 of ``step``: ``y = (x + 1).realize()``."""
    out.copy_(x + 1)


def E_mul_two(out, y):
    """kernel 2 of ``step``: ``z = (y * 2).realize()``; writes slot 0 (its output)."""
    out.copy_(y * 2)


class Buffer:
    """Device memory, compared by identity (``a in input_buffers``), as tinygrad's ``Buffer``."""

    def __init__(self, data: torch.Tensor):
        self._buf = data


class CompiledRunner:
    def __init__(self, fxn, outs=(0,)):
        self.fxn, self.outs = fxn, outs       # ``p.outs``: the buffer slots the kernel writes

    def __call__(self, bufs):
        self.fxn(*[b._buf for b in bufs])


class ExecItem:
    def __init__(self, prg, bufs):
        self.prg, self.bufs = prg, bufs

    def run(self, var_vals=None, jit=False):
        if isinstance(self.prg, CompiledRunner):
            self.prg(self.bufs)
        else:                                   # a GraphRunner: the graph of the batch
            self.prg(self.bufs, var_vals)


capturing: list = []


class Tensor:
    def __init__(self, buf: Buffer):
        self.buf = buf

    def numpy(self):
        return self.buf._buf.clone()


def realize(prg, out: Tensor, *ins: Tensor) -> Tensor:
    ei = ExecItem(prg, [out.buf, *[t.buf for t in ins]])
    if capturing:
        capturing[0]._jit_cache.append(ei)
    ei.run()
    return out


def step(x: Tensor) -> Tensor:
    y = realize(CompiledRunner(E_add_one), Tensor(Buffer(torch.empty_like(x.buf._buf))), x)    # kernel 1
    return realize(CompiledRunner(E_mul_two), Tensor(Buffer(torch.empty_like(x.buf._buf))), y)  # kernel 2


def get_input_replace(jit_cache, input_buffers, orig_valid_positions=None):
    input_replace: dict[tuple[int, int], int] = {}
    for j, ji in enumerate(jit_cache):
        for i, a in enumerate(ji.bufs):
            if any(a is b for b in input_buffers):
                # filter out positions that weren't valid inputs in the original capture (prevents aliasing bugs)
                if orig_valid_positions is not None and i not in orig_valid_positions.get(id(ji), set()):
                    continue
                input_replace[(j, i)] = next(k for k, b in enumerate(input_buffers) if a is b)
    return input_replace


class GraphRunner:
    def __init__(self, jit_cache, input_buffers, var_vals, orig_valid_positions=None):
        self.jit_cache = jit_cache
        self.input_replace = get_input_replace(jit_cache, input_buffers, orig_valid_positions)


class CUDAGraph(GraphRunner):
    """``tinygrad/runtime/graph/cuda.py``: one CUDA graph of the batch's kernels; the kernel parameters of
    the ``input_replace`` slots are repointed at the caller's buffers before each launch."""

    def __init__(self, jit_cache, input_buffers, var_vals, orig_valid_positions=None):
        super().__init__(jit_cache, input_buffers, var_vals, orig_valid_positions)
        self.input_params = {idx: torch.empty_like(input_buffers[idx]._buf)
                             for idx in sorted(set(self.input_replace.values()))}
        self.bound = [[self.input_params[self.input_replace[(j, i)]] if (j, i) in self.input_replace else b._buf
                       for i, b in enumerate(ji.bufs)] for j, ji in enumerate(jit_cache)]
        self.written_inputs = sorted({idx for (j, i), idx in self.input_replace.items() if i in jit_cache[j].prg.outs})
        self.outputs = tuple(self.bound[j][i] for j, ji in enumerate(jit_cache) for i in ji.prg.outs
                             if (j, i) not in self.input_replace)
        self.graph, _ = capture(self._launch, device=str(input_buffers[0]._buf.device), warmups=0,
                                name="TinyJit graph", owner="tinygrad CUDAGraph (GraphRunner)",
                                static={f"input_buffers[{idx}]": p for idx, p in self.input_params.items()})

    def _launch(self):
        for ji, bufs in zip(self.jit_cache, self.bound):
            ji.prg.fxn(*bufs)
        return self.outputs

    def __call__(self, rawbufs, var_vals):
        for idx, p in self.input_params.items():       # cuGraphExecKernelNodeSetParams: point at the input
            p.copy_(rawbufs[idx]._buf)
        replay(self.graph, self.outputs)
        for idx in self.written_inputs:                 # a kernel wrote through that pointer: the caller's memory
            rawbufs[idx]._buf.copy_(self.input_params[idx])


def apply_graph_to_jit(jit_cache, input_buffers, var_vals, orig_valid_positions=None):
    graph_runner = CUDAGraph(jit_cache, input_buffers, var_vals, orig_valid_positions)
    # clear jit inputs to allow their memory to be freed/reused
    for (j, i) in graph_runner.input_replace.keys():
        graph_runner.jit_cache[j].bufs[i] = None
    return [ExecItem(graph_runner, input_buffers)]


class CapturedJit:
    def __init__(self, ret, jit_cache, input_replace, variant, JIT):
        self.ret, self.jit_cache, self.input_replace = ret, jit_cache, input_replace
        self.variant, self.JIT = variant, JIT
        self._jit_cache, self._input_replace = self.jit_cache, self.input_replace
        self._first_run = True

    def _clear_inputs(self):
        for (j, i) in self._input_replace.keys():
            self._jit_cache[j].bufs[i] = None

    def __call__(self, input_buffers, var_vals):
        for (j, i), input_idx in self._input_replace.items():
            self._jit_cache[j].bufs[i] = input_buffers[input_idx]
        # Condense the items into a graph executor.
        if self._first_run:
            if self.JIT < 2:
                if self.variant == "fix":
                    orig_valid_positions: dict[int, set[int]] = {}
                    for (j, i) in self.input_replace:
                        orig_valid_positions.setdefault(id(self.jit_cache[j]), set()).add(i)
                    self._jit_cache = apply_graph_to_jit(self.jit_cache, input_buffers, var_vals, orig_valid_positions)
                    valid_positions = {id(ji): set(range(len(ji.bufs))) if isinstance(ji.prg, GraphRunner)
                                       else orig_valid_positions.get(id(ji), set()) for ji in self._jit_cache}
                    self._input_replace = get_input_replace(self._jit_cache, input_buffers, valid_positions)
                else:
                    self._jit_cache = apply_graph_to_jit(self.jit_cache, input_buffers, var_vals)
                    self._input_replace = get_input_replace(self._jit_cache, input_buffers)
            self._first_run = False
        for ei in self._jit_cache:
            ei.run(var_vals, jit=True)
        self._clear_inputs()
        return self.ret


class TinyJit:
    def __init__(self, fxn, variant, JIT):
        self.fxn, self.variant, self.JIT = fxn, variant, JIT
        self.cnt, self.captured = 0, None

    def __call__(self, x: Tensor) -> Tensor:
        input_buffers = [x.buf]
        if self.cnt == 0:                          # jit ignore
            ret = self.fxn(x)
        elif self.cnt == 1:                        # jit capture
            self._jit_cache = []
            capturing.append(self)
            try:
                ret = self.fxn(x)
            finally:
                capturing.clear()
            jit_cache = self._jit_cache
            del self._jit_cache
            input_replace = get_input_replace(jit_cache, input_buffers)
            self.captured = CapturedJit(ret, jit_cache, input_replace, self.variant, self.JIT)
            self.captured._clear_inputs()
        else:                                      # jit exec
            ret = self.captured(input_buffers, {})
        self.cnt += 1
        return ret


def run(variant: str, device: str = "cpu"):
    gen = generator(14287)
    a, b, fresh = (randn(N, gen=gen, device=device) for _ in range(3))

    def serve(JIT: int):
        jit = TinyJit(step, variant, JIT)
        outs = []
        jit(Tensor(Buffer(a.clone())))                       # call 1: runs the function
        x = jit(Tensor(Buffer(b.clone())))                   # call 2: records the kernels
        for _ in range(3):                                   # session 1: the output is fed back as the input
            x = jit(x)                                       # (call 3 builds the graph with input is ret)
            outs.append(x.numpy())
        y0 = Tensor(Buffer(fresh.clone()))                   # session 2: a new prompt's tensor
        y = y0
        for _ in range(3):
            y = jit(y)
            outs.append(y.numpy())
        outs.append(y0.numpy())                              # the caller's input tensor after the session
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(JIT=1), lambda: serve(JIT=2))
