"""Megatron weak-refs a forward graph's input surface: the cloned static inputs, which no graph pool owns, are freed.

Upstream: https://github.com/NVIDIA/Megatron-LM/pull/3970 ("Cudagraphs: Remove fwd_graph_input_surface
weakref").
Symptom: training with Megatron-Core's local CUDA graphs (``cuda_graph_impl=local``) segfaults or hits an
illegal memory access in a layer's forward replay, typically once the caching allocator is under pressure
or its cache is emptied (Megatron-LM main, March 2026).
Mechanism: ``_CudaGraphRunner.create_fwd_graph`` clones the sample args into static input tensors
(``clone_inputs=True``) *before* capture, so they live in the ordinary caching allocator, not in the graph's
memory pool, and stores them as ``fwd_graph_input_surface``. After the graphs are created the runner
"weakrefs everything" with TE's ``make_weak_ref``: a tensor rebuilt from the raw ``data_ptr()`` that owns
nothing. That is safe for graph-pool memory (the pool keeps its blocks), but for the cloned inputs the
original tensor was the only owner; once that reference goes (upstream expected ``tensor_strong_refs`` to
keep it, which did not hold), the allocator frees the block. Every later forward replay first copies the
new microbatch into the weak surface (a write to freed memory) and then runs kernels that read that
address: a segfault / illegal memory access, or silently someone else's data once the block is reused.
Doctor: dangling-reference, at ``create_fwd_graph`` (the weak reference that leaves the graph's input
surface without an owner).
Fix (upstream): keep ``fwd_graph_input_surface`` as strong references (no ``make_weak_ref`` for tensors the
graph pool does not own), so the static inputs live as long as the graph.
"""
from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from workbench.engine import events, graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, own_segment_elems, randn, release_to_driver, replay

UPSTREAM = "https://github.com/NVIDIA/Megatron-LM/pull/3970"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "create_fwd_graph"
SYMPTOM = "forward replay reads a freed static input (segfault / illegal memory access)"
TOKENS, HIDDEN, NUM_MICROBATCHES = 4, 3, 3


class TransformerLayer(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        gen = generator(3970)
        self.weight = torch.nn.Parameter(randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.7),
                                         requires_grad=False)
        self.bias = torch.nn.Parameter(randn(HIDDEN, gen=gen, device=device, scale=0.1), requires_grad=False)

    def forward(self, hidden_states):
        return torch.tanh(hidden_states @ self.weight + self.bias)


class _WeakRefTensor:
    """TE's ``make_weak_ref``: the tensor's address without ownership. On CUDA a raw pointer through
    ``__cuda_array_interface__``; on the CPU a weak reference to the storage (nothing to write to once
    the owner is gone: the write lands in freed memory, which the emulation cannot show)."""

    def __init__(self, t: torch.Tensor):
        self._meta = (t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)
        if t.is_cuda:
            self.__cuda_array_interface__ = {"data": (t.data_ptr(), False), "shape": tuple(t.shape),
                                             "typestr": "<f4", "version": 2}
        else:
            self._ref = StorageWeakRef(t.untyped_storage())

    def tensor(self):
        offset, shape, stride, dtype, device = self._meta
        if device.type == "cuda":
            return torch.as_tensor(self, device=device).view(dtype)
        if self._ref.expired():
            return None
        storage = torch.UntypedStorage._new_with_weak_ptr(self._ref.cdata)
        return torch.empty(0, dtype=dtype, device=device).set_(storage, offset, shape, stride)


def make_weak_ref(x):
    return tuple(_WeakRefTensor(t) for t in x) if isinstance(x, tuple) else _WeakRefTensor(x)


def _strong(x):
    return x.tensor() if isinstance(x, _WeakRefTensor) else x


def clone_ten(ten: torch.Tensor) -> torch.Tensor:
    """``create_fwd_graph(clone_inputs=True)``: a static copy of a sample arg, made before capture (in the
    caching allocator, not the graph pool). On CUDA it gets a segment of its own, so that once freed
    ``empty_cache`` really unmaps it."""
    block = torch.empty(max(own_segment_elems(str(ten.device)), ten.numel()), device=ten.device, dtype=ten.dtype)
    return block[:ten.numel()].view_as(ten).copy_(ten)


class _CudaGraphRunner:
    def __init__(self, base_module, mempool, device, fixed: bool):
        self.base_module, self.mempool, self.device, self.fixed = base_module, mempool, device, fixed
        self.fwd_graph = None
        self.fwd_graph_input_args = None

    def create_fwd_graph(self, args, clone_inputs=True):
        if clone_inputs:
            args = tuple(clone_ten(a) for a in args)
        self.fwd_graph_input_args = args
        self.fwd_graph_input_surface = tuple(args)
        self.fwd_graph, out = capture(lambda: self.base_module(*map(_strong, self.fwd_graph_input_surface)), device=self.device,
                                      pool=self.mempool, warmups=1, name="fwd layer 0",
                                      static={"hidden_states": args[0]}, owner="_CudaGraphRunner")
        self.fwd_graph_output_surface = out
        # now weakref everything (the graph pool keeps what it allocated; the inputs were expected to be
        # kept alive by tensor_strong_refs)
        if not self.fixed:
            self.fwd_graph_input_surface = make_weak_ref(self.fwd_graph_input_surface)
        self.fwd_graph_input_args = None


class _CudagraphReplayNode:
    @staticmethod
    def forward(runner, *inputs):
        # Copy new data into fwd graph input buffer
        for user_input, cudagraph_input in zip(inputs, runner.fwd_graph_input_surface):
            cudagraph_input = _strong(cudagraph_input)
            if cudagraph_input is not None and user_input.data_ptr() != cudagraph_input.data_ptr():
                cudagraph_input.copy_(user_input)
        return replay(runner.fwd_graph, runner.fwd_graph_output_surface)


def run(variant: str, device: str = "cpu"):
    gen = generator(39700)
    microbatches = [randn(TOKENS, HIDDEN, gen=gen, device=device) for _ in range(NUM_MICROBATCHES)]

    def eager():
        layer = TransformerLayer(device)
        return [layer(x) for x in microbatches]

    def served():
        layer = TransformerLayer(device)
        runner = _CudaGraphRunner(layer, graph_pool_handle(device), device, fixed=(variant == "fix"))
        sample = torch.zeros(TOKENS, HIDDEN, device=device)
        runner.create_fwd_graph((sample,))
        del sample
        release_to_driver(device)              # allocator pressure / emptied cache
        events.persistent_state("_CudaGraphRunner", {"weight": layer.weight, "bias": layer.bias})
        return [_CudagraphReplayNode.forward(runner, x).clone() for x in microbatches]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
