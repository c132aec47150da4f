"""A graph cached by argument metadata keeps reading the nn.Parameter of its first call.

Upstream: https://github.com/Lightning-AI/lightning-thunder/pull/656 ("CUDAGraphs as executor/transform/fusion
pass"; its description lists this fix: "``CUDAGraphExecutor`` - does not properly update static buffers when the
same graph is invoked on inputs with meta-data that allows to fetch cached graphs, but with different storage
data").
Symptom: with ``thunder.jit(..., use_cudagraphs=True)``, a jitted function called with a different
``nn.Parameter`` object of the same dtype, shape and stride (a module whose parameters were replaced, as a
checkpoint load with ``assign=True`` or a weight sync does) silently keeps computing with the first call's
parameter; without CUDA graphs the outputs follow the new weights (lightning-thunder main, June 2024; the PR
names the backward's saved tensors, static in the same way, as the main concern).
Mechanism: ``make_cuda_graph`` is an ``lru_cache`` keyed on an ``ArgsDescriptor`` that holds only dtypes, sizes,
strides and non-tensor values. Arguments that are ``nn.Parameter`` (or, for the backward, the first
``num_constant_args`` saved tensors) are marked static: the graph is captured on the caller's tensor itself,
and ``CUDAGraphExecutor.__call__`` copies only the non-static arguments into the static inputs before
``replay()``. A later call whose Parameter is another tensor of the same metadata hits the cached graph, which
still reads the first call's Parameter (kept alive by the cache): no error, wrong values.
Doctor: stale-input, at ``__call__`` (the refresh of the static inputs skips the static-marked arguments).
Fix (upstream): the new ``CUDAGraphCallable.__call__`` copies every tensor argument whose identity differs
from the graph's static input (``if id(static_input) != id(arg) ...: static_input.copy_(arg)``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/Lightning-AI/lightning-thunder/pull/656"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "__call__"
SYMPTOM = "after the module's parameters are replaced, the cached graph still computes with the first weights"
DIM, BATCH = 4, 3


@dataclass(frozen=True)
class ArgsDescriptor:
    dtypes: tuple
    sizes: tuple
    strides: tuple
    non_tensor_arg: tuple
    args: list = field(hash=False, repr=False, compare=False)


def to_args_descriptor(*args):
    def extract(a):
        if isinstance(a, torch.Tensor) or isinstance(a, torch.nn.Parameter):
            return a.dtype, a.size(), a.stride(), None
        else:
            return type(a), None, None, a

    dtypes, sizes, strides, non_tensor_arg = zip(*map(extract, args))
    return ArgsDescriptor(dtypes, sizes, strides, non_tensor_arg, args)


def static_input(x):
    if isinstance(x, torch.Tensor) or isinstance(x, torch.nn.Parameter):
        return torch.empty_like(x)
    return x


@lru_cache
def make_cuda_graph(flat_fn, args_descr: ArgsDescriptor, static_args_mask: tuple, device: str):
    """Warm up three times, then capture ``flat_fn`` on the static inputs (static-marked args as they are)."""
    args = args_descr.args
    static_inputs = tuple(static_input(a) if not m else a for a, m in zip(args, static_args_mask))
    for s, a, m in zip(static_inputs, args, static_args_mask):
        if not m and isinstance(s, torch.Tensor):
            s.copy_(a)
    cuda_graph, static_outputs = capture(
        lambda: flat_fn(*static_inputs), device=device, warmups=3, name="thunder computation",
        static={f"arg{i}": s for i, (s, m) in enumerate(zip(static_inputs, static_args_mask)) if not m},
        owner="thunder CUDAGraphExecutor")
    return cuda_graph, static_inputs, static_outputs


class CUDAGraphExecutor:
    def __init__(self, fn, device: str, variant: str, num_constant_args: int | None = None):
        self.fn, self.device, self.variant = fn, device, variant
        self.num_constant_args = num_constant_args

    def __call__(self, *flat_args):
        args_descr = to_args_descriptor(*flat_args)
        if self.num_constant_args is not None:
            static_args_mask = (True,) * self.num_constant_args + (False,) * (len(flat_args) - self.num_constant_args)
        else:
            static_args_mask = tuple(isinstance(a, torch.nn.Parameter) for a in flat_args)
        cuda_graph, static_inputs, static_outputs = make_cuda_graph(self.fn, args_descr, static_args_mask,
                                                                    self.device)
        # Update static inputs
        for static_in, new_arg, mask in zip(static_inputs, flat_args, static_args_mask):
            if self.variant == "bug":
                if not mask and isinstance(new_arg, torch.Tensor):
                    static_in.copy_(new_arg)
            elif id(static_in) != id(new_arg) and isinstance(static_in, torch.Tensor) \
                    and isinstance(new_arg, torch.Tensor):        # the fix (CUDAGraphCallable.__call__)
                static_in.copy_(new_arg)
        return replay(cuda_graph, static_outputs).clone()


def computation(x, w, b):
    """The jitted function: one linear layer with a GELU."""
    return torch.nn.functional.gelu(x @ w + b)


def run(variant: str, device: str = "cpu"):
    gen = generator(656)
    # three weight versions: a module whose parameters are replaced by new ``nn.Parameter`` objects between
    # rounds (a checkpoint loaded with ``load_state_dict(assign=True)``, an RL weight sync)
    versions = [(randn(DIM, DIM, gen=gen, device=device, scale=0.7), randn(DIM, gen=gen, device=device, scale=0.2))
                for _ in range(3)]
    xs = [randn(BATCH, DIM, gen=gen, device=device) for _ in range(3)]

    def rounds(fn):
        outs = []
        module = torch.nn.Module()
        with torch.no_grad():
            for (w, b), x in zip(versions, xs):
                module.weight = torch.nn.Parameter(w.clone())      # the old Parameter is no longer used
                module.bias = torch.nn.Parameter(b.clone())
                outs.append(fn(x, module.weight, module.bias))
        return outs

    def served():
        make_cuda_graph.cache_clear()

        def flat_fn(x, w, b):                              # one compiled callable per jitted function
            return computation(x, w, b)

        return rounds(CUDAGraphExecutor(flat_fn, device, variant))

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, lambda: rounds(computation))
