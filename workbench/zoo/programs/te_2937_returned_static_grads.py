"""Gradients returned straight from a graph's static output buffer.

Upstream: https://github.com/NVIDIA/TransformerEngine/pull/2937 (related: pytorch/pytorch#181723).
Symptom: with TransformerEngine's graphed callables, retained parameter gradients are corrupted and
gradient accumulation over micro-batches is wrong (TransformerEngine main, April 2026).
Mechanism: ``Graphed.backward`` handed the parameter-gradient slots of the graph's static outputs to
autograd without copying. A later replay (the next micro-batch) writes the same slots. Whoever kept the
first gradient now holds the second one, so the accumulated sum counts the last micro-batch twice.
Doctor: overwritten-output, at ``accumulate`` (the read of the first gradient after the second replay).
Fix (upstream): clone the returned gradients before handing them back.
"""
from __future__ import annotations

from ..kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TransformerEngine/pull/2937"
FAMILY = "persistent-buffer mutation"
KIND = "overwritten-output"
SITE = "accumulate"
SYMPTOM = "accumulated gradient counts the last micro-batch twice"
DIM = 6


def weight_grad(x, dy):
    return x.t() @ dy                               # dW of a linear layer


def accumulate(grads):
    total = grads[0]
    for g in grads[1:]:
        total = total + g
    return total


def run(variant: str, device: str = "cpu"):
    gen = generator(2937)
    batches = [(randn(4, DIM, gen=gen, device=device), randn(4, DIM, gen=gen, device=device)) for _ in range(2)]

    def eager():
        return [accumulate([weight_grad(x, dy) for x, dy in batches])]

    def served():
        x_buf, dy_buf = batches[0][0].clone(), batches[0][1].clone()
        g, out = capture(lambda: weight_grad(x_buf, dy_buf), device=device,
                         static={"x": x_buf, "dy": dy_buf}, owner="graphed backward")
        grads = []
        for x, dy in batches:
            x_buf.copy_(x)
            dy_buf.copy_(dy)
            grad = replay(g, out)
            grads.append(grad.clone() if variant == "fix" else grad)
        return [accumulate(grads)]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
