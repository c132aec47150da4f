"""``torch.cuda.make_graphed_callables`` warms up on a throwaway stream and captures on another: on ROCm the capture stream's first GEMM creates its hipBLASLt handle inside the capture.

Upstream: https://github.com/pytorch/pytorch/pull/187745 ("[ROCm] reuse one stream for warmup and captures in
make_graphed_callables", dnikolaev-amd, approved by jeffdaily, merged 2026-06-22 as d9d756c9; fixes issue
https://github.com/pytorch/pytorch/issues/179961; cherry-picked to release/2.12 as ROCm/pytorch#3354).
Symptom: on ROCm with PyTorch 2.12+, ``torch.cuda.make_graphed_callables`` dies while capturing the forward graph
with ``HIP error: 'operation not permitted when stream is capturing' (900)``, or hangs (TransformerEngine's
``test_make_graphed_callables[...-transformer]`` "hung with pytorch 2.12+"); eager training of the same module runs.
Mechanism: since #179053, ``getCurrentCUDABlasLtHandle`` (``aten/src/ATen/cuda/CublasHandlePool.cpp``) caches
hipBLASLt handles per (device, stream), because one handle cannot be shared safely across streams; a stream's handle
is created lazily, by ``hipblasLtCreate`` with its capture-unsafe internal allocation/setup, the first time a GEMM
runs on that stream. ``torch/cuda/graphs.py::make_graphed_callables`` ran its warmup iterations (forward plus
``torch.autograd.grad``, every GEMM of the callable) under ``with torch.cuda.stream(torch.cuda.Stream())``, a
throwaway side stream, so only that stream's handle was made. It then captured with
``torch.cuda.graph(fwd_graph, pool=mempool, capture_error_mode=...)`` and no ``stream=``, so ``graph.__init__``
made the capture run on ``graph.default_capture_stream``, a different stream that no warmup ever touched. The first
GEMM of the captured forward asks for that stream's handle, ``hipblasLtCreate`` allocates while the stream is
capturing (global mode), and HIP refuses it: the capture, and with it ``make_graphed_callables``, fails. Eager steps
never capture, so creating a handle on first use there is harmless.
Doctor: sync-in-capture, at make_graphed_callables: a capture-unsafe device call (the lazy handle's ``hipMalloc``)
is attempted while the forward graph's stream is capturing. The bug lives in ``make_graphed_callables``, the
function the fix changed: it chose one stream for the warmup and let ``torch.cuda.graph`` pick another for the
captures, so the warmup's lazy initialisation was done for the wrong stream key.
Fix (upstream): ``make_graphed_callables`` makes one ``stream = torch.cuda.Stream()``, runs the warmup under
``with torch.cuda.stream(stream):`` and passes ``stream=stream`` to every forward and backward
``torch.cuda.graph(...)``, so the handle the warmup created is the one the captures find ("hipBLASLt handles are
per-(device, stream) on ROCm and lazily created. Need to use the same stream for warmup and capture").
Modelled: streams are names and the current stream a module global (``torch.cuda.Stream`` / ``torch.cuda.stream``);
``graph`` keeps only the stream choice of ``torch.cuda.graph`` (its ``default_capture_stream``) around the kit's
capture. The handle cache is a dict keyed by (device, stream); creating a handle allocates a small setup buffer
and is refused while capturing (HIP's error 900; the GEMMs themselves do not use it). The callable is a 2-layer MLP
(``nn.Module``) whose linears are an autograd Function calling ``at::cuda::blas::gemm`` for the forward, dgrad and
wgrad GEMMs. ``make_graphed_callables`` keeps upstream's structure for one callable (input surface = sample args +
parameters, warmup with ``autograd.grad``, fwd capture, bwd capture, ``Graphed`` autograd Function); the tuple of
callables, pytree outputs, autocast and hook checks are left out. Training: 3 steps of forward, ``backward(dy)``,
SGD, ``zero_grad(set_to_none=True)``.
"""
from __future__ import annotations

import contextlib
import itertools

import torch

from workbench.engine import CaptureError, events, graph_pool_handle, synchronize
from workbench.engine.source import user_frame
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/pytorch/pull/187745"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "make_graphed_callables"
SYMPTOM = ("make_graphed_callables fails at the forward capture on ROCm: HIP error 900, hipblasLtCreate "
           "allocates on the capture stream that the warmup (on another stream) never touched")

TOKENS, HIDDEN, FFN, STEPS, LR = 4, 6, 8, 3, 0.1
HANDLE_SETUP_ELEMS = 16


# --- torch.cuda streams ---------------------------------------------------------------------------------

_stream_ids = itertools.count(1)
_current_stream = "default stream"


class Stream:
    """``torch.cuda.Stream()``: a new stream, distinct from every other."""

    def __init__(self):
        self.name = f"stream {next(_stream_ids)}"

    def __repr__(self):
        return self.name


@contextlib.contextmanager
def stream(s):
    """``torch.cuda.stream(s)``: work in the block (and the BLAS handle it picks) runs on ``s``."""
    global _current_stream
    prev, _current_stream = _current_stream, s
    try:
        yield
    finally:
        _current_stream = prev


def current_stream():
    return _current_stream


# --- aten/src/ATen/cuda/CublasHandlePool.cpp (ROCm, torch >= 2.12: one hipBLASLt handle per (device, stream)) --

_blaslt_handles: dict = {}


def getCurrentCUDABlasLtHandle(device: str):
    key = (device, repr(current_stream()))
    if key not in _blaslt_handles:                      # lazily: hipblasLtCreate on this stream's first GEMM
        if torch.cuda.is_current_stream_capturing():    # its internal hipMalloc is capture-unsafe
            raise CaptureError(
                "HIP error: 'operation not permitted when stream is capturing' (900): hipblasLtCreate allocates "
                f"for the new hipBLASLt handle of {current_stream()!r}\n  at {user_frame()}",
                op="hipMalloc", source=user_frame())
        _blaslt_handles[key] = torch.zeros(HANDLE_SETUP_ELEMS, device=device)
    return _blaslt_handles[key]


def gemm(a, b):
    """``at::cuda::blas::gemm`` -> hipBLASLt on the current stream's handle."""
    getCurrentCUDABlasLtHandle(a.device.type)
    return a @ b


# --- the callable: a 2-layer MLP whose linears are hipBLASLt GEMMs --------------------------------------

class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return gemm(x, weight.t())                      # fprop

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        return gemm(grad_output, weight), gemm(grad_output.t(), x)    # dgrad, wgrad


class MLP(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        gen = generator(187745)
        self.fc1 = torch.nn.Parameter(randn(FFN, HIDDEN, gen=gen, device=device, scale=0.5))
        self.fc2 = torch.nn.Parameter(randn(HIDDEN, FFN, gen=gen, device=device, scale=0.5))

    def forward(self, x):
        return _LinearFunction.apply(torch.tanh(_LinearFunction.apply(x, self.fc1)), self.fc2)


# --- torch/cuda/graphs.py ---------------------------------------------------------------------------------

class graph:
    """``torch.cuda.graph``: only its choice of capture stream, around the capture itself."""

    default_capture_stream = None

    def __init__(self, cuda_graph_name, pool=None, stream=None, capture_error_mode="global"):
        # Lazy-init of default_capture_stream: a side stream of torch.cuda.graph's own
        if stream is None and self.__class__.default_capture_stream is None:
            self.__class__.default_capture_stream = Stream()
        self.capture_stream = stream if stream is not None else self.__class__.default_capture_stream
        self.name, self.pool, self.capture_error_mode = cuda_graph_name, pool, capture_error_mode

    def capture(self, fn, *, device, static, owner):
        with stream(self.capture_stream):               # self.stream_ctx.__enter__(); capture_begin(...)
            return capture(fn, device=device, pool=self.pool, warmups=0, name=self.name, static=static,
                           owner=owner, capture_error_mode=self.capture_error_mode)


def make_graphed_callables(module, sample_args, *, device, variant, num_warmup_iters=3,
                           capture_error_mode="global"):
    """One ``nn.Module`` callable: warmup, fwd capture, bwd capture, and the ``Graphed`` autograd Function."""
    len_user_args = len(sample_args)
    module_params = tuple(module.parameters())
    static_input_surface = tuple(sample_args) + module_params
    mempool = graph_pool_handle(device)

    # Warmup
    # Hopefully prevents cudnn benchmarking and other lazy-initialization cuda work
    # from ending up in any captures.
    synchronize(device)
    # bug: ``with torch.cuda.stream(torch.cuda.Stream()):`` here, and no ``stream=`` to the captures below
    # fix: hipBLASLt handles are per-(device, stream) on ROCm and lazily created.
    #      Need to use the same stream for warmup and capture to avoid capture errors.
    warmup_stream = Stream()
    capture_stream = warmup_stream if variant == "fix" else None
    with stream(warmup_stream):
        for _ in range(num_warmup_iters):
            with events.warmup():
                outputs = (module(*sample_args),)
                outputs_grad = tuple(o for o in outputs if o.requires_grad)
                torch.autograd.grad(outputs=outputs_grad,
                                    inputs=tuple(i for i in static_input_surface if i.requires_grad),
                                    grad_outputs=tuple(torch.empty_like(o) for o in outputs_grad),
                                    only_inputs=True)
        del outputs, outputs_grad
    synchronize(device)

    # Capture forward graph
    fwd_graph, static_outputs = graph("fwd", pool=mempool, stream=capture_stream,
                                      capture_error_mode=capture_error_mode).capture(
        lambda: (module(*sample_args),), device=device,
        static={f"sample_args[{i}]": a for i, a in enumerate(sample_args)},
        owner="torch.cuda.make_graphed_callables (fwd graph)")

    # Capture backward graph
    static_grad_outputs = tuple(torch.empty_like(o) for o in static_outputs)
    bwd_graph, grad_inputs = graph("bwd", pool=mempool, stream=capture_stream,
                                   capture_error_mode=capture_error_mode).capture(
        lambda: torch.autograd.grad(outputs=static_outputs,
                                    inputs=tuple(i for i in static_input_surface if i.requires_grad),
                                    grad_outputs=static_grad_outputs, only_inputs=True),
        device=device, static={f"static_grad_outputs[{i}]": g for i, g in enumerate(static_grad_outputs)},
        owner="torch.cuda.make_graphed_callables (bwd graph)")
    grad_iter = iter(grad_inputs)
    static_grad_inputs = tuple(next(grad_iter) if a.requires_grad else None for a in static_input_surface)

    class Graphed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            # At this stage, only the user args may (potentially) be new tensors.
            for i in range(len_user_args):
                if static_input_surface[i].data_ptr() != inputs[i].data_ptr():
                    static_input_surface[i].copy_(inputs[i])
            return tuple(o.detach() for o in replay(fwd_graph, static_outputs))

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, *grads):
            for g, grad in zip(static_grad_outputs, grads):
                if g.data_ptr() != grad.data_ptr():
                    g.copy_(grad)
            live = tuple(b for b in static_grad_inputs if b is not None)
            replay(bwd_graph, live)
            return tuple(b.detach() if b is not None else b for b in static_grad_inputs)

    def functionalized(*user_args):
        return Graphed.apply(*(tuple(user_args) + module_params))[0]

    module.forward = functionalized
    return module


# --- the training loop --------------------------------------------------------------------------------------

def run(variant: str, device: str = "cpu"):
    gen = generator(179961)
    data = [(randn(TOKENS, HIDDEN, gen=gen, device=device), randn(TOKENS, HIDDEN, gen=gen, device=device))
            for _ in range(STEPS)]

    def train(graphed: bool):
        _blaslt_handles.clear()
        model = MLP(device)
        if graphed:
            sample_x = torch.zeros(TOKENS, HIDDEN, device=device).requires_grad_(True)
            model = make_graphed_callables(model, (sample_x,), device=device, variant=variant)
        outs = []
        for x, dy in data:
            x = x.clone().requires_grad_(True)
            y = model(x)
            y.backward(dy)
            outs += [y.detach().clone(), x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
            with torch.no_grad():                                   # torch.optim.SGD.step()
                for p in model.parameters():
                    p.sub_(LR * p.grad)
            for p in model.parameters():                            # optimizer.zero_grad(set_to_none=True)
                p.grad = None
            outs += [p.detach().clone() for p in model.parameters()]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: train(True), lambda: train(False))
