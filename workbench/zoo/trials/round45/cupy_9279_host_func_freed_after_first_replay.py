"""A host function captured with ``launch_host_func`` loses its only reference at the graph's first launch.

Upstream: https://github.com/cupy/cupy/pull/9279 ("Allow host function call during CUDA graph capture",
commit 45ff5a62e, merged as 7dc9dc429), fixing https://github.com/cupy/cupy/issues/9274
("`launch_host_func` doesn't work with CUDA Graph").
Symptom: "The host function can be captured by CUDA graph, but when replaying CUDA graph, only the first
replay can call the host function, while more replays cannot" (CuPy 13.3.0).
Mechanism: ``_BaseStream.launch_host_func(callback, arg)`` wraps the callback in a closure ``f`` and calls
``runtime.launchHostFunc(self.ptr, f, 0)``, which ``Py_INCREF``s ``f`` and enqueues ``_HostFnFunc`` with
``f`` as a raw ``void*``; ``_HostFnFunc`` calls ``f`` and ``Py_DECREF``s it. Eagerly the host function runs
once, so the reference is balanced. Under stream capture the host node runs at every launch of the
graph: the first launch drops the last reference, ``f`` (and the ``callback``/``arg`` it holds) is freed,
and later launches call through a dangling pointer. In this model the callback's ``arg`` is the pinned
staging buffer that a captured device-to-host copy fills before the host node (the caller hands it to the
callback, as eager CuPy allows, since the runtime keeps ``f`` alive until it has run); once ``f`` is freed,
the graph's copy node writes, and the host node reads, released host memory. The model represents the raw
``void*`` as a weak reference and ``Py_INCREF``/``Py_DECREF`` as a strong reference held and dropped by
``runtime``; the host node itself is run by ``Graph.launch`` after the captured kernels (the engine records
no host nodes). The diff was read (stream.pyx, graph.pyx, runtime.pyx).
Doctor: dangling-reference, at ``_HostFnFunc`` (it releases the host function and its argument at the
first launch, while the graph keeps their address).
Fix (upstream): while ``is_capturing()``, ``launch_host_func`` passes ``(callback, arg)`` to
``runtime._launchHostFuncUnmanaged`` (no DECREF) and keeps the tuple in ``self._graph_host_funcargs``;
``end_capture`` hands the list to ``Graph.from_stream(g, host_funcargs)``, and the ``Graph`` keeps it alive.
"""
from __future__ import annotations

import weakref

import torch

from workbench.engine import events, graph, host, new_graph, synchronize
from workbench.zoo.kit import compare, generator, randn, replay

UPSTREAM = "https://github.com/cupy/cupy/pull/9279"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "_HostFnFunc"
SYMPTOM = "only the first graph launch runs the host function; later launches use a freed callback/argument"

B, N, STEPS = 2, 4, 3


class _VoidPtr:
    """``<void*>obj``: an address, which keeps nothing alive."""

    def __init__(self, obj):
        self._ref = weakref.ref(obj)

    def deref(self):
        return self._ref()


class runtime:  # noqa: N801 - cupy_backends.cuda.api.runtime
    _py_refs: list = []        # the references Py_INCREF took (CPython's refcount, made visible)

    @staticmethod
    def _HostFnFunc(func_arg: _VoidPtr):  # noqa: N802
        obj = func_arg.deref()
        if obj is None:        # CUDA calls the freed object: undefined; the callback does not run
            return
        obj(0)
        runtime._py_refs.remove(obj)                  # cpython.Py_DECREF(obj)

    @staticmethod
    def _HostFnFuncUnmanaged(func_arg: _VoidPtr):  # noqa: N802
        obj = func_arg.deref()
        if obj is None:
            return
        obj.callback(obj.arg)

    @staticmethod
    def launchHostFunc(stream, callback, arg):  # noqa: N802
        runtime._py_refs.append(callback)             # cpython.Py_INCREF(callback)
        stream._enqueue_host(runtime._HostFnFunc, _VoidPtr(callback))

    @staticmethod
    def _launchHostFuncUnmanaged(stream, func_arg):  # noqa: N802
        # The caller is responsible for managing the lifetime of func_arg.
        stream._enqueue_host(runtime._HostFnFuncUnmanaged, _VoidPtr(func_arg))


class _FuncArg:
    """``(callback, arg)``: a tuple upstream; a small object here, so that its address can be modelled."""

    __slots__ = ("callback", "arg", "__weakref__")

    def __init__(self, callback, arg):
        self.callback, self.arg = callback, arg


class Graph:
    def __init__(self, g, outputs, host_nodes, host_funcargs):
        self.g, self.outputs, self.host_nodes = g, outputs, host_nodes
        # Reference to the host functions and arguments captured by cudaLaunchHostFunc (the fix).
        self.host_funcargs = host_funcargs

    @staticmethod
    def from_stream(g, outputs, host_nodes, host_funcargs):
        return Graph(g, outputs, host_nodes, host_funcargs)

    def launch(self):
        out = replay(self.g, self.outputs)            # the captured kernels and memcpy nodes
        synchronize(self.outputs.device)              # the host node runs once the stream reaches it
        for fn, ptr in self.host_nodes:               # then the host node, at every launch
            fn(ptr)
        return out


class Stream:
    def __init__(self, device, variant):
        self.device, self.variant = device, variant
        self._graph_host_funcargs: list | None = None
        self._capture = None

    def is_capturing(self):
        return self._capture is not None

    def _enqueue_host(self, fn, ptr):
        if self.is_capturing():
            self._host_nodes.append((fn, ptr))        # a host node of the graph
        else:
            synchronize(self.device)                  # eager: runs once, when the stream reaches it
            fn(ptr)

    def launch_host_func(self, callback, arg):
        if self.variant == "fix" and self.is_capturing():
            func_arg = _FuncArg(callback, arg)
            runtime._launchHostFuncUnmanaged(self, func_arg)
            # Keep reference to the host callback function and arguments; ownership goes to the Graph.
            self._graph_host_funcargs.append(func_arg)
        else:
            def f(dummy):
                callback(arg)
            runtime.launchHostFunc(self, f, 0)

    def begin_capture(self):
        g = new_graph(self.device)
        ctx = graph(g, name="stream capture")
        ctx.__enter__()
        self._capture, self._host_nodes = (g, ctx), []
        self._graph_host_funcargs = []

    def end_capture(self, outputs):
        g, ctx = self._capture
        ctx.__exit__(None, None, None)
        host_funcargs, self._graph_host_funcargs = self._graph_host_funcargs, None
        host_nodes, self._capture, self._host_nodes = self._host_nodes, None, []
        return Graph.from_stream(g, outputs, host_nodes, host_funcargs)


class Monitor:
    """The host side: each host-function call logs the result the stream staged for it."""

    def __init__(self, device):
        self.received = host(torch.zeros(STEPS, B, N), device)
        self.calls = 0

    def on_result(self, staging):
        self.received[self.calls].copy_(staging)
        self.calls += 1


def device_func(x, w, y):
    torch.matmul(x, w, out=y)


def run(variant: str, device: str = "cpu"):
    gen = generator(9279)
    w = randn(N, N, gen=gen, device=device)
    inputs = [randn(B, N, gen=gen, device=device) for _ in range(STEPS)]

    def step_body(stream, monitor, x, y, staging):
        device_func(x, w, y)
        staging.copy_(y, non_blocking=True)
        stream.launch_host_func(monitor.on_result, staging)

    def served():
        monitor, stream = Monitor(device), Stream(device, variant)
        x, y = torch.zeros(B, N, device=device), torch.zeros(B, N, device=device)
        events.static_buffers("user program (graph inputs)", {"x": x})
        staging = host(torch.zeros(B, N), device)        # pinned, handed to the callback below
        stream.begin_capture()
        step_body(stream, monitor, x, y, staging)
        g = stream.end_capture(y)
        del staging                                   # the callback owns it now
        outs = []
        for xi in inputs:
            x.copy_(xi)
            outs.append(g.launch().clone())
        return [*outs, monitor.received.clone()]

    def eager():
        monitor, stream = Monitor(device), Stream(device, variant)
        x, y = torch.zeros(B, N, device=device), torch.zeros(B, N, device=device)
        outs = []
        for xi in inputs:
            x.copy_(xi)
            staging = host(torch.zeros(B, N), device)
            step_body(stream, monitor, x, y, staging)
            del staging
            outs.append(y.clone())
        return [*outs, monitor.received.clone()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
