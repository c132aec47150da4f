"""A hipGraph-captured ``mul_f32`` keeps the addresses of its kernargs, stack locals that later frames overwrite: replays multiply the wrong buffers.

Upstream: https://github.com/warpfront/hipfire/pull/591 ("fix(gemma4): retain mul kernargs during graph capture",
merged 2026-08-15).
Symptom: Gemma4 decode with hipGraph on produced divergent / garbage tokens (graphs had been forced off for Gemma4);
``HIPFIRE_GEMMA4_GRAPH=0`` (eager decode) is coherent. No error is raised.
Mechanism: hipfire captures the decode forward with ``hipStreamBeginCapture`` while ``gpu.capture_mode`` is true.
Helpers launch through ``launch_maybe_blob``: in capture mode it builds a ``KernargBlob`` of the argument values,
pushes it into ``capture_blobs`` (kept until ``graph_destroy``) and launches with ``launch_kernel_blob`` from that
retained buffer. ``Gpu::mul_f32`` (used in place, ``gate *= up``, in every Gemma4 FFN) bypassed it: it built
``params: Vec<*mut c_void>`` of pointers to its stack locals ``a_ptr``, ``b_ptr``, ``c_ptr``, ``n_val`` and called
``hip.launch_kernel`` directly. Eagerly the runtime copies the values at the call; under capture the kernel node keeps
the addresses. When ``mul_f32`` returns its frame is released, and the next helpers called at the same depth
(``gemv_f32``, ``add_f32``) put their own locals in the same slots. The captured node reads those slots when the
graph is launched: every replay multiplies whatever the last frame left there (other buffers' pointers, another
length) and leaves ``gate`` unmultiplied.
Doctor: dangling-reference, at ``mul_f32`` (the captured argument copy reads stack memory that its frame released on
return and later frames reused).
Fix (upstream): ``mul_f32`` launches through ``launch_maybe_blob``, so under capture its kernargs are a blob owned by
``capture_blobs`` for the graph's lifetime (the PR also re-enables the Gemma4 graph default and makes the hipGraph
POC exercise the production ``mul_f32`` over two replays; not modelled).
"""
from __future__ import annotations

import torch

from workbench.engine import host as engine_host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/warpfront/hipfire/pull/591"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "mul_f32"
SYMPTOM = "Gemma4 decode with hipGraph on emits garbage tokens; HIPFIRE_GEMMA4_GRAPH=0 is coherent"

N_EMBD, N_FF, N_VOCAB, N_LAYER, BLOCK, HEAP_SLACK = 16, 32, 24, 2, 256, 512


class GpuTensor:
    def __init__(self, ptr, n):
        self.ptr, self.n = ptr, n                      # buf.as_ptr(): an offset into device memory


class RustStack:
    """The host thread's stack: a helper's locals live in a frame at the current depth until it returns."""

    def __init__(self, device):
        self.mem = engine_host(torch.zeros(16, dtype=torch.int64), device)
        self.sp = 0

    def push(self, *locals_):
        frame = self.mem[self.sp:self.sp + len(locals_)]
        frame.numpy()[:] = locals_                     # plain host stores, as `let mut a_ptr = ...` does
        self.sp += len(locals_)
        return frame                                   # &mut a_ptr, &mut b_ptr, ...: addresses into the stack

    def pop(self, frame):
        self.sp -= frame.numel()                       # the frame is released; the next call reuses its slots


def _kernel(gpu, name, args, threads, shape):
    """The device code: reads its pointer and length arguments from the kernarg segment ``args``."""
    heap, i = gpu.heap, torch.arange(threads, device=gpu.heap.device)
    if name == "gemv_f32":                             # y[rows] = W[rows, cols] @ x[cols]
        rows, cols = shape
        w = heap[args[0] + torch.arange(rows * cols, device=heap.device)].view(rows, cols)
        heap[args[2] + i[:rows]] = w @ heap[args[1] + i[:cols]]
        return
    live = i < args[-1]                                # if (idx < n)
    if name == "gelu_tanh_f32":                        # in place
        x = heap[args[0] + i]
        heap[args[0] + i] = torch.where(live, torch.nn.functional.gelu(x, approximate="tanh"), x)
    else:                                              # mul_f32 / add_f32: c = a (*|+) b
        a, b, c = heap[args[0] + i], heap[args[1] + i], heap[args[2] + i]
        heap[args[2] + i] = torch.where(live, a * b if name == "mul_f32" else a + b, c)


class HipRuntime:
    def launch_kernel(self, gpu, func, grid, shape, params):
        args = torch.empty(params.numel(), dtype=torch.int64, device=gpu.heap.device)   # the kernarg segment
        if gpu.capture_mode:
            args.copy_(params, non_blocking=True)      # the node keeps the kernelParams addresses
        else:
            args.copy_(params)                         # an eager launch copies the values now
        _kernel(gpu, func, args, grid * BLOCK, shape)

    def launch_kernel_blob(self, gpu, func, grid, shape, blob):
        args = torch.empty(blob.numel(), dtype=torch.int64, device=gpu.heap.device)
        args.copy_(blob, non_blocking=True)            # from the retained blob
        _kernel(gpu, func, args, grid * BLOCK, shape)


class Gpu:
    def __init__(self, device, variant):
        self.variant, self.hip, self.stack = variant, HipRuntime(), RustStack(device)
        self.heap = torch.zeros(8192, device=device)   # device memory
        self.top, self.capture_mode, self.capture_blobs = 0, False, []

    def alloc(self, n, data=None):
        t = GpuTensor(self.top, n)
        self.top += n
        assert self.top + HEAP_SLACK <= self.heap.numel()
        if data is not None:
            self.heap[t.ptr:t.ptr + n].copy_(data.reshape(-1))
        return t

    def launch_maybe_blob(self, func, grid, shape, params, blob_builder):
        if self.capture_mode:
            blob = engine_host(torch.tensor(blob_builder(), dtype=torch.int64), self.heap.device.type)
            self.capture_blobs.append(blob)            # lives until graph_destroy()
            self.hip.launch_kernel_blob(self, func, grid, shape, blob)
        else:
            self.hip.launch_kernel(self, func, grid, shape, params)

    def _elementwise(self, func, *ptrs, n):
        params = self.stack.push(*ptrs, n)             # let mut a_ptr = a.buf.as_ptr(); ... let mut n_val = n;
        self.launch_maybe_blob(func, -(-n // BLOCK), None, params, lambda: [*ptrs, n])
        self.stack.pop(params)

    def gemv_f32(self, w, x, y):
        params = self.stack.push(w.ptr, x.ptr, y.ptr)
        self.launch_maybe_blob("gemv_f32", 1, (y.n, x.n), params, lambda: [w.ptr, x.ptr, y.ptr])
        self.stack.pop(params)

    def gelu_tanh_f32(self, x):
        self._elementwise("gelu_tanh_f32", x.ptr, n=x.n)

    def add_f32(self, a, b, c):
        self._elementwise("add_f32", a.ptr, b.ptr, c.ptr, n=a.n)

    def mul_f32(self, a, b, c):
        """c = a * b (element-wise); Gemma4 calls it in place, c = a."""
        if self.variant == "fix":                      # the graph-aware retained-blob path
            self._elementwise("mul_f32", a.ptr, b.ptr, c.ptr, n=a.n)
            return
        params = self.stack.push(a.ptr, b.ptr, c.ptr, a.n)   # Vec of &mut stack locals
        grid = -(-a.n // BLOCK)
        self.hip.launch_kernel(self, "mul_f32", grid, None, params)   # hipModuleLaunchKernel(.., kernelParams)
        self.stack.pop(params)

    def graph_destroy(self):
        self.capture_blobs.clear()


class Gemma4:
    def __init__(self, gpu, device):
        gen = generator(591)
        w = lambda *s: gpu.alloc(s[0] * s[1], randn(*s, gen=gen, device=device, scale=s[1] ** -0.5))  # noqa: E731
        self.embd = randn(N_VOCAB, N_EMBD, gen=gen, device=device)
        self.layers = [(w(N_FF, N_EMBD), w(N_FF, N_EMBD), w(N_EMBD, N_FF)) for _ in range(N_LAYER)]
        self.output = w(N_VOCAB, N_EMBD)
        self.x = [gpu.alloc(N_EMBD) for _ in range(N_LAYER + 1)]     # x[0]: the token's embedding (graph input)
        self.gate, self.up, self.down = gpu.alloc(N_FF), gpu.alloc(N_FF), gpu.alloc(N_EMBD)
        self.logits = gpu.alloc(N_VOCAB)

    def forward_decode(self, gpu):
        for (w_gate, w_up, w_down), x, x_next in zip(self.layers, self.x, self.x[1:]):
            gpu.gemv_f32(w_gate, x, self.gate)
            gpu.gemv_f32(w_up, x, self.up)
            gpu.gelu_tanh_f32(self.gate)
            gpu.mul_f32(self.gate, self.up, self.gate)  # in place
            gpu.gemv_f32(w_down, self.gate, self.down)
            gpu.add_f32(x, self.down, x_next)
        gpu.gemv_f32(self.output, self.x[-1], self.logits)
        return gpu.heap[self.logits.ptr:self.logits.ptr + N_VOCAB]


def run(variant: str, device: str = "cpu"):
    def decode(graph_on: bool, n_tokens: int = 5):
        gpu = Gpu(device, variant)
        model = Gemma4(gpu, device)
        inp = gpu.heap[model.x[0].ptr:model.x[0].ptr + N_EMBD]
        if graph_on:                                   # capture the decode forward once
            gpu.capture_mode = True
            g, logits = capture(lambda: model.forward_decode(gpu), device=device, warmups=0, name="gemma4 decode",
                                owner="hipfire gemma4 hipGraph", static={"x0": inp})
            gpu.capture_mode = False
        outs, token = [], 1
        for _ in range(n_tokens):
            inp.copy_(model.embd[token])               # the token's embedding into the graph's input
            out = replay(g, logits) if graph_on else model.forward_decode(gpu)
            outs.append(out.clone())
            token = int(out.argmax())
        gpu.graph_destroy()
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: decode(True), lambda: decode(False))
