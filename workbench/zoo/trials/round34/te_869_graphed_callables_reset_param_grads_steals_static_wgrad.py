"""TE ``make_graphed_callables`` drops the parameters' ``.grad`` after capture, so autograd adopts the static wgrad buffer.

Upstream: https://github.com/NVIDIA/TransformerEngine/pull/869 ("[PyTorch] Add CUDA graph tests with FP8 weight
caching", commit 868c7d30, labelled bug).
Symptom: with ``te.make_graphed_callables`` and several gradient-accumulation microbatches per optimizer step,
training with graphs diverges from eager: "subtle correctness issues because ``te.make_graphed_callables`` resets
grad buffers after capturing graphs, so the gradient buffer filled in the backward pass is different from the
gradient buffer used by the optimizer" (not seen in Megatron-LM/NeMo, which manage ``main_grad`` themselves;
TE 1.6/1.7, May 2024).
Mechanism: the backward graph of ``_make_graphed_callables`` writes the weight gradient into its static output
``static_grad_inputs`` (graph-pool memory, rewritten by every replay of that graph), and ``Graphed.backward``
hands ``b.detach()`` of it to autograd. After capture, ``make_graphed_callables`` ran ``# Reset FP8 gradients``:
``for p in module.parameters(): p.grad = None``, discarding the gradient buffers the user had created.
With ``p.grad`` None, ``AccumulateGrad`` does not copy the incoming gradient: it steals it, so ``p.grad`` becomes
the graph's static wgrad buffer itself. From then on the next backward replay overwrites ``p.grad`` (the first
microbatch's gradient is lost) before ``AccumulateGrad`` adds the same buffer to itself: the step applies twice
the last microbatch's gradient instead of the sum over microbatches.
Doctor: overwritten-output, at ``make_graphed_callables`` (its ``p.grad = None`` makes the handed-out static
wgrad the parameter's gradient, which the next backward replay overwrites while it is still read).
Fix (upstream): delete the reset, so the gradient buffers that exist at capture time survive and
``AccumulateGrad`` adds each replay's static wgrad into them (the tests now create ``param.grad`` before
``make_graphed_callables`` and use ``optimizer.zero_grad(set_to_none=False)``).
(Read: the diff of #869 (graph.py and tests/pytorch/test_cuda_graphs.py) and ``graph.py`` at its parent. A TE
``Linear`` without bias, one callable, FP8 off; ``AccumulateGrad``'s steal-when-None rule written out.)
"""
from __future__ import annotations

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TransformerEngine/pull/869"
FAMILY = "dangling references"
KIND = "overwritten-output"
SITE = "make_graphed_callables"
SYMPTOM = "with grad accumulation, each step applies twice the last microbatch's wgrad instead of the sum"

IN_F, OUT_F, TOKENS, STEPS, MICROBATCHES, LR = 4, 3, 5, 3, 2, 0.1


class Linear:
    """``te.Linear(bias=False)``: forward ``x @ W^T``; its backward returns a fresh wgrad tensor."""

    def __init__(self, weight):
        self.weight = weight
        self.grad = None                     # ``weight.grad``

    def parameters(self):
        return [self]

    def forward(self, x):
        return x @ self.weight.t()

    def backward(self, x, grad_output):
        return grad_output.t() @ x           # wgrad GEMM


def accumulate_grad(param, new_grad):
    """``AccumulateGrad``: with no ``.grad`` yet it steals the incoming gradient (no copy, its only
    reference is autograd's); otherwise it adds in place into the existing buffer."""
    if param.grad is None:
        param.grad = new_grad
    else:
        param.grad.add_(new_grad)


def _make_graphed_callables(module, sample_x, device, num_warmup_iters=3):
    mempool = graph_pool_handle(device)
    static_x = sample_x.clone()
    fwd_graph, static_output = capture(lambda: module.forward(static_x), device=device, pool=mempool,
                                       warmups=num_warmup_iters, static={"static_x": static_x},
                                       owner="te.make_graphed_callables (fwd graph)")
    static_grad_output = torch.empty_like(static_output)
    bwd_graph, static_grad_input = capture(lambda: module.backward(static_x, static_grad_output), device=device,
                                           pool=mempool, warmups=num_warmup_iters,
                                           static={"static_x": static_x, "static_grad_output": static_grad_output},
                                           owner="te.make_graphed_callables (bwd graph)")

    class Graphed:
        """``torch.autograd.Function`` for graph replay: forward copies the user args in, backward the grads."""

        @staticmethod
        def forward(x):
            if static_x.data_ptr() != x.data_ptr():
                static_x.copy_(x)
            return replay(fwd_graph, static_output).detach()

        @staticmethod
        def backward(grad):
            if static_grad_output.data_ptr() != grad.data_ptr():
                static_grad_output.copy_(grad)
            b = replay(bwd_graph, static_grad_input)
            return b.detach()                # the static wgrad, as is

    return Graphed


def make_graphed_callables(module, sample_x, device, variant):
    graphed = _make_graphed_callables(module, sample_x, device)
    if variant == "bug":
        # Reset FP8 gradients.
        for p in module.parameters():
            p.grad = None
    # (fix: the reset is gone; the gradient buffers the user created before capture stay)
    return graphed


def run(variant: str, device: str = "cpu"):
    gen = generator(869)
    w0 = randn(OUT_F, IN_F, gen=gen, device=device)
    data = [[(randn(TOKENS, IN_F, gen=gen, device=device), randn(TOKENS, OUT_F, gen=gen, device=device))
             for _ in range(MICROBATCHES)] for _ in range(STEPS)]
    sample_x = randn(TOKENS, IN_F, gen=gen, device=device)

    def train(graphed):
        module = Linear(w0.clone())
        # Initialize gradient buffers (as the fixed test does, before graphing).
        for p in module.parameters():
            p.grad = torch.zeros_like(p.weight)
        if graphed:
            fn = make_graphed_callables(module, sample_x, device, variant)
            forward, backward = fn.forward, fn.backward
        else:
            saved = {}

            def forward(x):
                saved["x"] = x
                return module.forward(x)

            def backward(grad_output):
                return module.backward(saved["x"], grad_output)
        outs = []
        for step in data:
            for p in module.parameters():            # optimizer.zero_grad(set_to_none=False)
                if p.grad is not None:
                    p.grad.zero_()
            for x, grad_output in step:              # grad accumulation steps
                outs.append(forward(x).clone())
                accumulate_grad(module, backward(grad_output))   # output.backward(grad_output)
            module.weight.sub_(LR * module.grad)     # torch.optim.SGD.step()
            outs.append(module.weight.clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: train(True), lambda: train(False))
