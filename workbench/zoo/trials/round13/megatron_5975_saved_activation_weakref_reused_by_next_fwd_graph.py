"""Local CUDA graphs weak-ref a layer's saved activation after its forward capture: the next layer's forward graph reuses the block.

Upstream: https://github.com/NVIDIA/Megatron-LM/pull/5975 ("Fix CUDA graph correctness issues due to memory
bugs").
Symptom: training with Megatron-Core's local CUDA graph implementation (``--cuda-graph-impl local``, per-layer
forward and backward graphs sharing one mempool) silently diverges from the same run without graphs: wrong
weight gradients, a loss curve that drifts away from the eager one, and no error (Megatron-Core main, July
2026).
Mechanism: ``_CudagraphGlobalRecord`` captures every layer's forward graph, in execution order, then the
backward graphs in reverse, all into one pool. To keep graph memory small, after a forward capture the
runner turns the graph's buffers into weak references (``make_weak_ref``: a tensor that aliases the memory
without owning it), so the caching allocator may hand that memory to later captures. Activations the
layer's backward needs (what autograd saved for backward) were weak-referenced too: the memory is no longer
allocator-owned, and the next captures into the pool place their own buffers in it (the next layer's
forward intermediates; for the last layer, its own backward graph's temporaries). Every replay of those
graphs overwrites the saved activation before the layer's backward graph reads it through the weak alias,
so the backward computes gradients from someone else's activations.
Doctor: overwritten-output, at ``create_fwd_graph`` (the saved activation is a buffer of a forward graph that
a later replay in the shared pool overwrites before the backward graph reads it).
Fix (upstream): a save-for-backward observer marks the buffers autograd keeps for backward
(``CudagraphBufferMetadata.is_saved_for_backward``), and ``make_weakref(preserve_saved_for_backward=True)``
keeps those strongly referenced (allocator-owned) until the backward graph has been captured.
"""
from __future__ import annotations

import ctypes

import numpy as np
import torch

from workbench.engine import graph, graph_pool_handle, new_graph
from workbench.zoo.kit import compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/Megatron-LM/pull/5975"
FAMILY = "dangling references"
KIND = "overwritten-output"
SITE = "create_fwd_graph"
SYMPTOM = "backward graphs read saved activations through weak refs whose memory later graphs reuse: wrong weight grads"
TOKENS, HIDDEN, ITERS = 4, 3, 3


def make_weak_ref(t: torch.Tensor) -> torch.Tensor:
    """TE's ``make_weak_ref``: a tensor over the same memory that does not own it (the allocator may reuse
    the memory as soon as the owning tensor is gone). A raw-pointer alias, as TE builds it."""
    buf = (ctypes.c_float * t.numel()).from_address(t.data_ptr())
    return torch.from_numpy(np.frombuffer(buf, dtype=np.float32).reshape(t.shape))


class TransformerLayer:
    """An MLP block with a hand-written autograd function: forward returns the output and the tensors
    saved for backward; backward turns the output grad into the input and weight grads."""

    def __init__(self, seed, device):
        gen = generator(seed)
        self.fc1 = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.7)
        self.fc2 = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.7)

    def forward(self, x):
        act = torch.tanh(x @ self.fc1)                # saved for backward
        return act @ self.fc2, (x, act)

    def backward(self, grad_out, saved):
        x, act = saved
        grad_act = grad_out @ self.fc2.t()
        grad_pre = grad_act * (1 - act * act)
        return grad_pre @ self.fc1.t(), x.t() @ grad_pre, act.t() @ grad_out


class _CudaGraphRunner:
    def __init__(self, layer, device, pool, variant):
        self.layer, self.device, self.pool, self.variant = layer, device, pool, variant

    def create_fwd_graph(self, static_input):
        self.static_input = static_input
        self.fwd_graph = new_graph(self.device)
        with graph(self.fwd_graph, pool=self.pool, name="fwd"):
            out, saved = self.layer.forward(static_input)
        self.static_output = out
        x, act = saved
        if self.variant == "fix":
            # (fix) is_saved_for_backward: keep the buffer allocator-owned until the backward capture
            self.saved = (x, act)
            self.saved_weak = (x, make_weak_ref(act))
        else:
            # weak-ref everything the forward graph produced to let later captures reuse the memory
            self.saved = None
            self.saved_weak = (x, make_weak_ref(act))
        del out, saved, act
        return self.static_output

    def create_bwd_graph(self):
        self.static_grad_output = torch.zeros(TOKENS, HIDDEN, device=self.device)
        self.bwd_graph = new_graph(self.device)
        with graph(self.bwd_graph, pool=self.pool, name="bwd"):
            grads = self.layer.backward(self.static_grad_output, self.saved_weak)
        self.static_grads = grads
        self.saved = None                              # backward captured: the strong refs may go now


def loss_grad(out, target):
    return (out - target) / out.numel()


def run(variant: str, device: str = "cpu"):
    gen = generator(5975)
    batches = [(randn(TOKENS, HIDDEN, gen=gen, device=device), randn(TOKENS, HIDDEN, gen=gen, device=device))
               for _ in range(ITERS)]

    def eager():
        layers = [TransformerLayer(1, device), TransformerLayer(2, device)]
        outs = []
        for x, target in batches:
            h1, s1 = layers[0].forward(x)
            h2, s2 = layers[1].forward(h1)
            g2 = layers[1].backward(loss_grad(h2, target), s2)
            g1 = layers[0].backward(g2[0], s1)
            outs += [h2, g2[1], g2[2], g1[1], g1[2]]
        return outs

    def served():
        layers = [TransformerLayer(1, device), TransformerLayer(2, device)]
        pool = graph_pool_handle(device)
        runners = [_CudaGraphRunner(layer, device, pool, variant) for layer in layers]
        static_input = torch.zeros(TOKENS, HIDDEN, device=device)
        # _CudagraphGlobalRecord.create_cudagraphs: forward graphs in order, then backward graphs reversed
        h1 = runners[0].create_fwd_graph(static_input)
        runners[1].create_fwd_graph(h1)
        runners[1].create_bwd_graph()
        runners[0].create_bwd_graph()
        outs = []
        for x, target in batches:
            static_input.copy_(x)
            replay(runners[0].fwd_graph, runners[0].static_output)
            h2 = replay(runners[1].fwd_graph, runners[1].static_output).clone()
            runners[1].static_grad_output.copy_(loss_grad(h2, target))
            g2 = replay(runners[1].bwd_graph, runners[1].static_grads)
            runners[0].static_grad_output.copy_(g2[0])
            g2 = [g.clone() for g in g2]
            g1 = replay(runners[0].bwd_graph, runners[0].static_grads)
            outs += [h2, g2[1], g2[2], g1[1].clone(), g1[2].clone()]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
