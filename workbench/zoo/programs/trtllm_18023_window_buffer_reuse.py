"""A registered buffer released at the end of capture, handed to the next requester, rewritten by replays.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/18023 ("Do not hand out NCCL window buffers
during CUDA graph capture"; see also #17048).
Symptom: multi-GPU runs with CUDA graphs silently produce wrong output, on a 4-rank model decode
collapses into one repeated token; nothing crashes or is logged, and only some runs fail (TensorRT-LLM,
Aug 2026).
Mechanism: a collective captured into a graph writes its NCCL window buffer on every replay, for as
long as the graph lives. The tensor wrapping that buffer dies at the end of the capture, and
``releaseBuffer()`` puts the buffer back on the allocator's free list. The next requester is handed
the same memory, and every later replay overwrites what it wrote.
Doctor: dangling-reference (the graph writes memory its owner has given back, here to a buffer pool
the doctor cannot see into), site ``all_reduce``.
Fix (upstream): do not hand out window buffers while a graph is capturing
(``torch.cuda.is_current_stream_capturing()``); the collective then writes a plain tensor the graph owns.
"""
from __future__ import annotations

import contextlib

import torch

from ..kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/18023"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "all_reduce"
SYMPTOM = "replays overwrite a window buffer the allocator has handed to another request: wrong tokens"
ROWS, DIM, TP = 2, 4, 2


class WindowAllocator:
    """NCCL window buffers: registered once, handed out from a free list, released when done."""

    def __init__(self, device, refuse_while_capturing: bool):
        self.free = [torch.zeros(ROWS, DIM, device=device)]
        self.refuse = refuse_while_capturing

    @contextlib.contextmanager
    def window(self, like: torch.Tensor):
        if not self.free or (self.refuse and torch.cuda.is_current_stream_capturing()):
            yield torch.empty_like(like)            # the unregistered fallback
            return
        buf = self.free.pop()
        try:
            yield buf
        finally:
            self.free.append(buf)                   # releaseBuffer(): the wrapper died


def all_reduce(alloc, x):
    """Sum over ``TP`` identical ranks, written into a window buffer."""
    with alloc.window(x) as out:
        torch.mul(x, TP, out=out)
        return out * 1.0                            # the layer consumes it before the wrapper dies


class Layer:
    def __init__(self, device):
        gen = generator(18023)
        self.w = randn(DIM, DIM, gen=gen, device=device, scale=0.5)

    def forward(self, alloc, x):
        return all_reduce(alloc, x @ self.w)


def run(variant: str, device: str = "cpu"):
    gen = generator(1)
    layer = Layer(device)
    xs = [randn(ROWS, DIM, gen=gen, device=device) for _ in range(2)]
    prefill = randn(ROWS, DIM, gen=gen, device=device)

    def step(alloc, forward, x):
        with alloc.window(prefill) as kept:         # another request's all-reduce output, held a while
            kept.copy_(prefill * TP)
            out = forward(x)
            return [out.clone(), kept.clone()]

    def eager():
        alloc = WindowAllocator(device, refuse_while_capturing=False)
        return [t for x in xs for t in step(alloc, lambda x: layer.forward(alloc, x), x)]

    def served():
        alloc = WindowAllocator(device, refuse_while_capturing=(variant == "fix"))
        x_buf = xs[0].clone()
        g, out = capture(lambda: layer.forward(alloc, x_buf), device=device, static={"hidden_states": x_buf},
                         owner="CUDAGraphRunner")

        def forward(x):
            x_buf.copy_(x)
            return replay(g, out)
        return [t for x in xs for t in step(alloc, forward, x)]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
