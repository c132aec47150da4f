"""Thunder's CUDA-graph executor warms its graph up on static input buffers it never filled.

Upstream: https://github.com/Lightning-AI/lightning-thunder/pull/855 ("CUDAGraphs: fix issues with
buffer initializations").
Symptom: ``thunder.jit(f, use_cudagraphs=True)`` on a function with a value-dependent kernel
(the regression test: ``torch.multinomial(x, num_samples=3, replacement=True)``) fails on its first
call, inside the graph's warmup, with a device-side error on an invalid distribution; GPT tests passed
because none of their kernels branch on input values (thunder main, July 2024).
Mechanism: ``build_cuda_graph`` makes one static buffer per non-static input with
``torch.empty_like(x)`` and runs the three warmup calls and the capture on those buffers; the
caller copies the real arguments in only afterwards, before the replay. ``empty_like`` returns a block
from the caching allocator holding whatever its last owner left there. The warmup's kernels read that
leftover data as their inputs, and a value-dependent kernel rejects it (or, for an index, faults).
Doctor: stale-input, at ``get_static_buffer`` (the static buffer handed to warmup and capture unwritten).
Fix (upstream): ``torch.empty_like(x).copy_(x)``: the static buffers hold the real arguments before the
warmup runs.
"""
from __future__ import annotations


import torch

from workbench.zoo.kit import capture, compare, replay

UPSTREAM = "https://github.com/Lightning-AI/lightning-thunder/pull/855"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "get_static_buffer"
SYMPTOM = "the first call fails inside the graph warmup: multinomial rejects the leftover data"
WARMUPS = 3


class CachingAllocator:
    """The device allocator's cache: a freed block goes to the next request of its size, unwiped."""

    def __init__(self):
        self.free_blocks = []

    def release(self, t: torch.Tensor) -> None:
        self.free_blocks.append(t)

    def empty_like(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.free_blocks):
            if block.numel() == x.numel() and block.dtype == x.dtype:
                return self.free_blocks.pop(i).view_as(x)       # contents: the last owner's data
        return torch.empty_like(x)


def f(x):
    return torch.multinomial(x, num_samples=3, replacement=True)


def build_cuda_graph(fn, args, static_args_mask, allocator, fixed: bool):
    def get_static_buffer(x):
        if isinstance(x, torch.Tensor):
            buf = allocator.empty_like(x)
            return buf.copy_(x) if fixed else buf
        return x

    static_inputs = tuple(get_static_buffer(a) if not m else a for a, m in zip(args, static_args_mask))
    g, static_outputs = capture(lambda: fn(*static_inputs), device=static_inputs[0].device.type,
                                warmups=WARMUPS, static={f"arg{i}": a for i, a in enumerate(static_inputs)},
                                owner="thunder CUDAGraphCallable")
    return g, static_inputs, static_outputs


class CUDAGraphCallable:
    def __init__(self, fn, allocator, fixed: bool):
        self.fn, self.allocator, self.fixed = fn, allocator, fixed
        self.cache = {}

    def __call__(self, *args):
        static_inputs_mask = tuple(isinstance(a, torch.nn.Parameter) for a in args)
        key = tuple((a.dtype, a.shape, a.stride()) for a in args)             # to_arg_descriptor
        if key not in self.cache:
            self.cache[key] = build_cuda_graph(self.fn, args, static_inputs_mask, self.allocator, self.fixed)
        g, static_inputs, static_outputs = self.cache[key]
        for static_input, arg in zip(static_inputs, args):
            if static_input is not arg:
                static_input.copy_(arg)
        return replay(g, static_outputs)


def run(variant: str, device: str = "cpu"):
    weights = torch.tensor([0.0, 10.0, 0.0, 0.0], device=device)     # one category: a deterministic draw

    def eager():
        return [f(weights), f(weights)]

    def served():
        allocator = CachingAllocator()
        # an earlier region's activation of the same size goes back to the cache when it dies
        allocator.release(torch.tensor([0.5, -1.25, 2.0, -0.75], device=device))
        jf = CUDAGraphCallable(f, allocator, fixed=(variant == "fix"))
        return [jf(weights).clone(), jf(weights).clone()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
