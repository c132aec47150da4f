"""TinyJit ignores a Tensor passed inside a list: its graph keeps reading the capture call's tensor.

Upstream: https://github.com/tinygrad/tinygrad/pull/14043 ("jit includes tensor inputs in containers", commit
72a3f78d19). Diff read (``tinygrad/engine/jit.py``, ``test/test_jit.py``, ``test/test_jit_footguns.py``).
Symptom: silent wrong results: listed in ``test_jit_footguns.py`` under SILENT MISMATCHES as
``tensors_in_containers_ignored``: ``f(a, [b])`` with ``b = [i, i, i]`` returned ``[1,1,1]`` (warmup),
``[2,2,2]`` (capture), then ``[2,2,2]`` and ``[2,2,2]`` where ``[3,3,3]`` and ``[4,4,4]`` were expected
(``test_array_jit`` even asserted the mismatch once jitted: "should fail once jitted since jit can't handle
arrays").
Mechanism: ``TinyJit.__call__`` asks ``_prepare_jit_inputs(args, kwargs)`` for the call's input buffers; it
keeps only top-level positional/keyword arguments with ``t.__class__ is Tensor``. On the capture call (call
2) the kernels are recorded as ``ExecItem``\\ s whose ``bufs`` hold the buffers they ran on, and
``get_input_replace`` marks as replaceable only the slots holding an input buffer. The buffer of ``arr[0]``
is no input, so its slot keeps the capture call's buffer, like a weight. On call 3 ``CapturedJit`` builds the
CUDA graph (``apply_graph_to_jit`` -> ``CUDAGraph``) with that buffer baked into the kernel node's
arguments; each replay repoints only the ``input_replace`` slots (here: copies the caller's ``a`` into the
graph's input parameter), so every later call adds the capture call's ``b``, not its own.
Doctor: warmup-divergence, at ``_prepare_jit_inputs`` (the capture call decided which buffers are inputs and
froze ``arr[0]``'s buffer reference into the graph; eager reads the current call's ``arr[0]``).
Fix (upstream): ``_prepare_jit_inputs`` also scans one level of tuple/list/dict args and kwargs for Tensors
(``t.__class__ is Tensor``, deduplicated, not recursive so model weights are not grabbed) and appends them
to the input list, so their slots are in ``input_replace`` and patched on every call.
(Two kernels, since a one-kernel batch is not graphed ("only one kernel doesn't graph"); vectors of three;
the graph's kernel-argument patching is a graph-held parameter buffer per input that the caller's data is
copied into before each replay.)
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/tinygrad/tinygrad/pull/14043"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "_prepare_jit_inputs"
SYMPTOM = "every jitted call after capture adds the capture call's list-held tensor, not its own (silent)"

N = 3


class Buffer:
    """Device memory, compared by identity, as tinygrad's ``Buffer``."""

    def __init__(self, data: torch.Tensor):
        self._buf = data


class Tensor:
    def __init__(self, buf: Buffer):
        self.buf = buf

    def numpy(self):
        return self.buf._buf.clone()


def E_add(out, a, b):
    """kernel 1 of ``f``: ``(a + arr[0]).realize()``."""
    out.copy_(a + b)


def E_mul(out, h):
    """kernel 2 of ``f``: ``(h * 2).realize()``."""
    out.copy_(h * 2)


class CompiledRunner:
    def __init__(self, fxn):
        self.fxn = fxn


class ExecItem:
    def __init__(self, prg, bufs):
        self.prg, self.bufs = prg, bufs

    def run(self, var_vals=None, jit=False):
        if isinstance(self.prg, CompiledRunner):
            self.prg.fxn(*[b._buf for b in self.bufs])
        else:                                  # a GraphRunner: the graph of the batch
            self.prg(self.bufs, var_vals)


capturing: list = []


def realize(prg, *ins: Tensor) -> Tensor:
    out = Tensor(Buffer(torch.empty_like(ins[0].buf._buf)))
    ei = ExecItem(prg, [out.buf, *[t.buf for t in ins]])
    if capturing:
        capturing[0]._jit_cache.append(ei)
    ei.run()
    return out


def f(a: Tensor, arr: list) -> Tensor:
    h = realize(CompiledRunner(E_add), a, arr[0])
    return realize(CompiledRunner(E_mul), h)


def _prepare_jit_inputs(args, kwargs, variant):
    input_tensors = [(name, t) for name, t in list(enumerate(args)) + sorted(kwargs.items()) if t.__class__ is Tensor]
    names, tensors = [name for name, _ in input_tensors], [t for _, t in input_tensors]
    if variant == "fix":
        # extract tensors from containers (shallow, not recursive to avoid grabbing model weights)
        for x in args + tuple(kwargs.values()):
            it = x if isinstance(x, (tuple, list)) else x.values() if isinstance(x, dict) else []
            tensors += [t for t in it if t.__class__ is Tensor and not any(t is y for y in tensors)]
    input_buffers = [t.buf for t in tensors]
    return input_buffers, names


def get_input_replace(jit_cache, input_buffers):
    input_replace: dict[tuple[int, int], int] = {}
    for j, ji in enumerate(jit_cache):
        for i, a in enumerate(ji.bufs):
            if any(a is b for b in input_buffers):
                input_replace[(j, i)] = next(k for k, b in enumerate(input_buffers) if a is b)
    return input_replace


class CUDAGraph:
    """``tinygrad/runtime/graph/cuda.py``: one CUDA graph of the batch's kernels; the kernel arguments of the
    ``input_replace`` slots are repointed at the caller's buffers before each launch; every other slot keeps
    the buffer it held when the graph was built."""

    def __init__(self, jit_cache, input_buffers, var_vals):
        self.jit_cache = jit_cache
        self.input_replace = get_input_replace(jit_cache, input_buffers)
        self.input_params = {idx: torch.empty_like(input_buffers[idx]._buf)
                             for idx in sorted(set(self.input_replace.values()))}
        self.bound = [[self.input_params[self.input_replace[(j, i)]] if (j, i) in self.input_replace else b._buf
                       for i, b in enumerate(ji.bufs)] for j, ji in enumerate(jit_cache)]
        self.outputs = tuple(bufs[0] for bufs in self.bound)      # slot 0 of each kernel is its output
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


def apply_graph_to_jit(jit_cache, input_buffers, var_vals):
    graph_runner = CUDAGraph(jit_cache, input_buffers, var_vals)
    # clear jit inputs to allow their memory to be freed/reused
    for (j, i) in graph_runner.input_replace.keys():
        graph_runner.jit_cache[j].bufs[i] = None
    return [ExecItem(graph_runner, input_buffers)]


class CapturedJit:
    def __init__(self, ret, jit_cache, input_replace):
        self.ret, self.jit_cache, self.input_replace = ret, jit_cache, input_replace
        self._jit_cache, self._input_replace = jit_cache, input_replace
        self._first_run = True
        self._clear_inputs()

    def _clear_inputs(self):
        for (j, i) in self._input_replace.keys():
            self._jit_cache[j].bufs[i] = None

    def __call__(self, input_buffers, var_vals):
        for (j, i), input_idx in self._input_replace.items():
            self._jit_cache[j].bufs[i] = input_buffers[input_idx]
        if self._first_run:                        # Condense the items into a graph executor.
            self._jit_cache = apply_graph_to_jit(self.jit_cache, input_buffers, var_vals)
            self._input_replace = get_input_replace(self._jit_cache, input_buffers)
            self._first_run = False
        for ei in self._jit_cache:
            ei.run(var_vals, jit=True)
        self._clear_inputs()
        return self.ret


class TinyJit:
    def __init__(self, fxn, variant):
        self.fxn, self.variant = fxn, variant
        self.cnt, self.captured = 0, None

    def __call__(self, *args, **kwargs):
        input_buffers, names = _prepare_jit_inputs(args, kwargs, self.variant)
        if self.cnt == 0:                          # jit ignore
            ret = self.fxn(*args, **kwargs)
        elif self.cnt == 1:                        # jit capture
            self._jit_cache = []
            capturing.append(self)
            try:
                ret = self.fxn(*args, **kwargs)
            finally:
                capturing.clear()
            jit_cache = self._jit_cache
            del self._jit_cache
            input_replace = get_input_replace(jit_cache, input_buffers)
            self.captured = CapturedJit(ret, jit_cache, input_replace)
        else:                                      # jit exec
            ret = self.captured(input_buffers, {})
        self.cnt += 1
        return ret


def run(variant: str, device: str = "cpu"):
    gen = generator(14043)
    steps = [(randn(N, gen=gen, device=device), randn(N, gen=gen, device=device)) for _ in range(5)]

    def serve(jitted: bool):
        fn = TinyJit(f, variant) if jitted else f
        outs = []
        for a, b in steps:
            a_t, b_t = Tensor(Buffer(a.clone())), Tensor(Buffer(b.clone()))
            outs.append(fn(a_t, [b_t]).numpy())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
