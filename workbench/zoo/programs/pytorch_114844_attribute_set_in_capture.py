"""A Python attribute assigned inside the captured forward is not re-assigned by replay.

Upstream: https://github.com/pytorch/pytorch/issues/114844 ("CUDA graph doesn't update tensor on replay").
Symptom: ``model.x`` keeps the value the user last put there instead of the first linear layer's output
of the replayed step (PyTorch, Nov 2023).
Mechanism: ``forward`` stores an intermediate with ``self.x = res``, a Python assignment. Capture runs
it once, binding ``self.x`` to the graph's internal tensor; replay runs kernels only. Once anything
rebinds ``model.x``, no replay will bind it back, so the model exposes a stale tensor.
Doctor: host-work-frozen (the attribute assignment ran once, at capture). Site: ``forward``.
Fix (the answer on the issue: state must live in static memory): keep ``x`` in a persistent buffer
that ``forward`` writes in place (``self.x.copy_(res)``), and never rebind it.
"""
from __future__ import annotations

import torch

from ..kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/pytorch/issues/114844"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "forward"
SYMPTOM = "model.x holds a stale tensor after replay"
D_IN, INNER = 2, 4


class Model:
    def __init__(self, device, variant):
        gen = generator(114844)
        self.w1 = randn(D_IN, INNER, gen=gen, device=device)
        self.w2 = randn(INNER, 2, gen=gen, device=device)
        self.in_place = variant == "fix"
        self.x = torch.zeros(2, INNER, device=device)

    def forward(self, inp):
        res = inp @ self.w1
        if self.in_place:
            self.x.copy_(res)
        else:
            self.x = res
        return res @ self.w2

    def reset_state(self):
        if self.in_place:
            self.x.fill_(100.0)
        else:
            self.x = torch.full_like(self.x, 100.0)   # the user keeps an intermediate of their own


def run(variant: str, device: str = "cpu"):
    gen = generator(1)
    inputs = [torch.ones(2, D_IN).to(device), randn(2, D_IN, gen=gen, device=device)]

    def eager():
        model, outs = Model(device, variant), []
        for inp in inputs:
            model.reset_state()
            outs += [model.forward(inp).clone(), model.x.clone()]
        return outs

    def served():
        model = Model(device, variant)
        static_in = inputs[0].clone()
        g, out = capture(lambda: model.forward(static_in), device=device, static={"input": static_in},
                         owner="Model")
        outs = []
        for inp in inputs:
            model.reset_state()
            static_in.copy_(inp)
            outs += [replay(g, out).clone(), model.x.clone()]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
