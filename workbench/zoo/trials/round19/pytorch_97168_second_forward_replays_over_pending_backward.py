"""A second forward before the first one's backward replays the same cudagraph-tree node over its saved activations.

Upstream: https://github.com/pytorch/pytorch/pull/97168 ("Dont increment generation if forward of backward
exists, and warning on deallocation of live tensors").
Symptom: with ``torch.compile(mode="reduce-overhead")`` (CUDA graph trees, PyTorch nightly of March 2023),
a training step that runs the compiled forward twice before calling backward (two microbatches summed
into one loss, a siamese / contrastive pair) gets wrong gradients for the first call: no error, the
gradients of both calls are computed from the second call's activations.
Mechanism: ``CUDAGraphTreeManager`` starts a new *generation* whenever the compiled function is invoked
again (``can_start_new_generation``); a new generation goes back to the root of the tree and replays the
node recorded for that function. The outputs of the first call, including the activations autograd saved
for its pending backward, live in that node's static output memory, so the second call's replay writes
its own activations over them. The backward of the first call then reads the second call's values.
Doctor: overwritten-output, at ``can_start_new_generation`` (it lets a replay of the same node start while
the outputs of the first forward are still held for its backward).
Fix (upstream): the manager counts forwards whose backward has not run yet
(``running_forwards_with_pending_backwards``) and does not start a new generation while any is pending;
the second call then continues the current path and records/replays a *child* node with its own memory.
"""
from __future__ import annotations

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/pytorch/pull/97168"
FAMILY = "persistent-buffer mutation"
KIND = "overwritten-output"
SITE = "can_start_new_generation"
SYMPTOM = "the first microbatch's gradients are computed from the second microbatch's saved activations"
DIM, BATCH, STEPS = 4, 3, 3


def forward(x, weight, bias):
    """The compiled forward: returns the activation saved for backward and the per-row loss."""
    h = torch.tanh(x @ weight + bias)
    return h, h.sum(dim=1)


def backward(x, h, grad_out, weight):
    """The backward of ``forward`` (eager here), reading the saved activation ``h``."""
    dpre = grad_out[:, None] * (1 - h * h)
    return x.t() @ dpre, dpre.sum(0)


class CUDAGraphNode:
    """One recording of the forward: its static input, its static outputs (the activation and loss)."""

    def __init__(self, wrapped_function, inputs, device, pool, parent):
        self.parent = parent
        self.children: dict[str, CUDAGraphNode] = {}
        self.static_input = inputs[0].clone()
        self.params = inputs[1:]
        self.graph, self.outputs = capture(lambda: wrapped_function(self.static_input, *self.params),
                                           device=device, pool=pool, name=f"node {id(self) % 997}",
                                           static={"x": self.static_input}, owner="CUDAGraphTreeManager")

    def run(self, new_inputs):
        self.static_input.copy_(new_inputs[0])
        return replay(self.graph, self.outputs)


class CUDAGraphTreeManager:
    def __init__(self, device, variant):
        self.device, self.variant = device, variant
        self.roots: dict[str, CUDAGraphNode] = {}
        self.current_node: CUDAGraphNode | None = None
        self.running_forwards_with_pending_backwards = 0
        self.cuda_graphs_thread_pool = graph_pool_handle(device)

    def can_start_new_generation(self) -> bool:
        if self.current_node is None:
            return False
        if self.variant == "fix" and self.running_forwards_with_pending_backwards:
            return False                    # the fix: a forward still waits for its backward
        return True

    def run(self, function_id, wrapped_function, new_inputs):
        if self.can_start_new_generation():
            self.current_node = None        # dealloc_current_path_weakrefs: back to the root
        children = self.roots if self.current_node is None else self.current_node.children
        node = children.get(function_id)
        if node is None:                    # record_function: a new node on the current path
            node = children[function_id] = CUDAGraphNode(wrapped_function, new_inputs, self.device,
                                                         self.cuda_graphs_thread_pool, self.current_node)
            outputs = replay(node.graph, node.outputs)
        else:
            outputs = node.run(new_inputs)
        self.current_node = node
        self.running_forwards_with_pending_backwards += 1
        return outputs

    def backward_invoked(self):
        self.running_forwards_with_pending_backwards -= 1


def run(variant: str, device: str = "cpu"):
    gen = generator(97168)
    weight = randn(DIM, DIM, gen=gen, device=device, scale=0.6)
    bias = randn(DIM, gen=gen, device=device, scale=0.2)
    batches = [(randn(BATCH, DIM, gen=gen, device=device), randn(BATCH, DIM, gen=gen, device=device))
               for _ in range(STEPS)]
    grad_out = torch.ones(BATCH, device=device)

    def train(compiled_forward, on_backward=lambda: None):
        grads = []
        for x1, x2 in batches:
            # loss = model(x1).sum() + model(x2).sum(); loss.backward()
            h1, _ = compiled_forward(x1)
            h2, _ = compiled_forward(x2)
            g2 = backward(x2, h2, grad_out, weight)      # autograd runs the later forward's backward first
            on_backward()
            g1 = backward(x1, h1, grad_out, weight)
            on_backward()
            grads += [g1[0] + g2[0], g1[1] + g2[1]]
        return grads

    def served():
        manager = CUDAGraphTreeManager(device, variant)
        return train(lambda x: manager.run("forward", forward, (x, weight, bias)), manager.backward_invoked)

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served,
                   lambda: train(lambda x: forward(x, weight, bias)))
