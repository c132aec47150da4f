"""TinyJit fed its own output back: the replay's first kernel overwrites it before a later kernel reads it.

Upstream: https://github.com/tinygrad/tinygrad/pull/14210 ("jit copy aliased output if it's read later", commit
67d9712ef6). Diff read (``tinygrad/engine/jit.py`` ``CapturedJit``, ``test/test_jit_footguns.py``).
Symptom: the footgun ``multiple_outputs_same_intermediate`` (a SILENT MISMATCH): a jitted
``f(buf, frame)`` with ``new_buf = buf[1:].cat(frame)`` returning ``new_buf.contiguous(), new_buf[:1].contiguous()``,
called in a loop with ``buf = new_buf``, returns a wrong ``first`` value: "fails on 3rd iteration!" (the first
call replayed from the jit cache); users had to ``clone()`` the intermediate.
Mechanism: the two outputs are two kernels in ``CapturedJit.jit_cache``: kernel 0 writes ``new_buf`` (reads
``buf`` and ``frame``), kernel 1 writes ``first`` and reads ``buf[1:2]`` (``buf`` again, a later reader). From the
third call on, the caller's ``buf`` *is* ``ret[0]``, the output buffer kernel 0 writes.
``CapturedJit.__call__`` patches the caller's buffers into the ``input_replace`` slots as they are and replays
the kernels in order: kernel 0 overwrites ``ret[0]`` (= this call's ``buf``) with the shifted window, then
kernel 1 reads ``buf[1:2]`` from the overwritten memory and returns the next element instead of this call's.
(Not #14287's mechanism: no output slot is repointed at a caller's buffer; the aliasing is the caller passing
the JIT's own output, and the hazard is the order of a writer and a later reader inside one replay.)
Doctor: overwritten-output, at ``__call__`` (``CapturedJit.__call__`` binds the previous replay's output
``ret[0]`` as an input that kernel 1 reads after kernel 0 of the same replay overwrote it).
Fix (upstream): ``__post_init__`` precomputes ``_output_to_writer`` (output buffer -> index of the kernel that
writes it) and ``_input_to_max_reader`` (input index -> the last kernel that reads it); ``__call__`` copies any
input buffer that the jit cache writes and that a later kernel reads into a fresh ``Buffer`` before patching.
(Emulation: a graph kernel parameter pointed at a caller's buffer is a graph-held copy-in buffer, except when the
caller's buffer is one the graph itself writes, where the parameter is that memory; eager is plain tinygrad,
no ``TinyJit``: every call realizes fresh buffers.)
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, replay

UPSTREAM = "https://github.com/tinygrad/tinygrad/pull/14210"
FAMILY = "persistent-buffer mutation"
KIND = "overwritten-output"
SITE = "__call__"
SYMPTOM = "the jitted feedback loop's second output reads the buffer its first kernel just overwrote (wrong value)"


def E_cat(out, buf, frame):
    """kernel 0: ``new_buf = buf[1:].cat(frame, dim=0).contiguous()`` (reads ahead, writes behind)."""
    out.copy_(torch.cat([buf[1:], frame], dim=0))


def E_first(out, buf):
    """kernel 1: ``new_buf[:1].contiguous()`` = ``buf[1:2]``: a second read of ``buf``."""
    out.copy_(buf[1:2])


class Buffer:
    """Device memory, compared (and hashed) by identity, as tinygrad's ``Buffer``."""

    def __init__(self, data: torch.Tensor):
        self._buf = data

    def copyin(self, other: "Buffer") -> "Buffer":
        self._buf.copy_(other._buf)
        return self


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
        else:                                   # the GraphRunner of the batch
            self.prg(self.bufs, var_vals)


def get_out_buffers_for_ei(ei):
    return [ei.bufs[i] for i in ei.prg.outs]


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


def f(buf: Tensor, frame: Tensor):
    new_buf = realize(CompiledRunner(E_cat), Tensor(Buffer(torch.empty_like(buf.buf._buf))), buf, frame)
    first = realize(CompiledRunner(E_first), Tensor(Buffer(torch.empty_like(buf.buf._buf[:1]))), buf)
    return new_buf, first


def get_input_replace(jit_cache, input_buffers):
    input_replace: dict[tuple[int, int], int] = {}
    for j, ji in enumerate(jit_cache):
        for i, a in enumerate(ji.bufs):
            if any(a is b for b in input_buffers):
                input_replace[(j, i)] = next(k for k, b in enumerate(input_buffers) if a is b)
    return input_replace


class CUDAGraph:
    """``tinygrad/runtime/graph/cuda.py``: one CUDA graph of the batch's kernels whose ``input_replace`` slots
    are kernel parameters pointed at the caller's buffers before each launch."""

    def __init__(self, jit_cache, input_buffers, input_replace):
        self.jit_cache, self.input_replace = jit_cache, input_replace
        written = {id(b._buf) for ji in jit_cache for b in get_out_buffers_for_ei(ji) if b is not None}
        # A parameter pointed at memory the graph itself writes is that memory; any other input is copied in.
        self.aliased = {idx: input_buffers[idx] for idx in set(input_replace.values())
                        if id(input_buffers[idx]._buf) in written}
        self.input_params = {idx: torch.empty_like(input_buffers[idx]._buf)
                             for idx in sorted(set(input_replace.values())) if idx not in self.aliased}
        self.bound = [[(self.aliased[idx]._buf if idx in self.aliased else self.input_params[idx])
                       if (idx := input_replace.get((j, i))) is not None else b._buf
                       for i, b in enumerate(ji.bufs)] for j, ji in enumerate(jit_cache)]
        self.outputs = tuple(self.bound[j][i] for j, ji in enumerate(jit_cache) for i in ji.prg.outs)
        self.graph, _ = capture(self._launch, device=str(input_buffers[0]._buf.device), warmups=0,
                                name="TinyJit graph", owner="tinygrad CUDAGraph (GraphRunner)",
                                static={f"input_buffers[{idx}]": p for idx, p in self.input_params.items()})

    def _launch(self):
        for ji, bufs in zip(self.jit_cache, self.bound):
            ji.prg.fxn(*bufs)
        return self.outputs

    def __call__(self, rawbufs, var_vals):
        for idx, b in self.aliased.items():
            if rawbufs[idx] is not b:
                raise NotImplementedError("emulation: repointing a graph-written parameter at another buffer")
        for idx, p in self.input_params.items():       # cuGraphExecKernelNodeSetParams: point at the input
            p.copy_(rawbufs[idx]._buf)
        replay(self.graph, self.outputs)


class CapturedJit:
    def __init__(self, ret, jit_cache, input_replace, variant):
        self.ret, self.jit_cache, self.input_replace, self.variant = ret, jit_cache, input_replace, variant
        self._jit_cache, self._input_replace = self.jit_cache, self.input_replace
        self._first_run = True
        if variant == "fix":
            # precompute read-after-write hazard detection
            self._output_to_writer = {b: j for j, ei in enumerate(self.jit_cache) for b in get_out_buffers_for_ei(ei)}
            self._input_to_max_reader: dict[int, int] = {}
            for (j, _), idx in self.input_replace.items():
                self._input_to_max_reader[idx] = max(self._input_to_max_reader.get(idx, -1), j)
        self._clear_inputs()

    def _clear_inputs(self):
        for (j, i) in self._input_replace.keys():
            self._jit_cache[j].bufs[i] = None

    def __call__(self, input_buffers, var_vals):
        if self.variant == "fix":
            # copy aliased inputs to prevent read-after-write hazard
            for i, ib in enumerate(input_buffers):
                if (writer := self._output_to_writer.get(ib)) is not None and self._input_to_max_reader.get(i, -1) > writer:
                    input_buffers[i] = Buffer(torch.empty_like(ib._buf)).copyin(ib)
        for (j, i), input_idx in self._input_replace.items():
            self._jit_cache[j].bufs[i] = input_buffers[input_idx]
        # Condense the items into a graph executor.
        if self._first_run:
            graph_runner = CUDAGraph(self.jit_cache, input_buffers, self._input_replace)
            self._jit_cache = [ExecItem(graph_runner, input_buffers)]
            self._input_replace = {(0, i): i for i in range(len(input_buffers))}
            self._first_run = False
        for ei in self._jit_cache:
            ei.run(var_vals, jit=True)
        self._clear_inputs()
        return self.ret


class TinyJit:
    def __init__(self, fxn, variant):
        self.fxn, self.variant = fxn, variant
        self.cnt, self.captured = 0, None

    def __call__(self, buf: Tensor, frame: Tensor):
        input_buffers = [buf.buf, frame.buf]
        if self.cnt == 0:                          # jit ignore
            ret = self.fxn(buf, frame)
        elif self.cnt == 1:                        # jit capture
            self._jit_cache = []
            capturing.append(self)
            try:
                ret = self.fxn(buf, frame)
            finally:
                capturing.clear()
            jit_cache = self._jit_cache
            del self._jit_cache
            self.captured = CapturedJit(ret, jit_cache, get_input_replace(jit_cache, input_buffers), self.variant)
        else:                                      # jit exec
            ret = self.captured(input_buffers, {})
        self.cnt += 1
        return ret


def run(variant: str, device: str = "cpu"):
    def serve(jitted: bool):
        fn = TinyJit(f, variant) if jitted else f
        buf = Tensor(Buffer(torch.tensor([[0.0], [1.0], [2.0]]).to(device)))
        outs = []
        for i in range(4):
            frame = Tensor(Buffer(torch.tensor([[10.0 + i]]).to(device)))
            new_buf, first = fn(buf, frame)
            outs += [new_buf.numpy(), first.numpy()]
            buf = new_buf
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
