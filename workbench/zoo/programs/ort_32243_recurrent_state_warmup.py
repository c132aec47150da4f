"""Recurrent state advanced by the runs made before capture.

Upstream: https://github.com/microsoft/onnxruntime/issues/32243 (workaround:
https://github.com/microsoft/onnxruntime-genai/pull/2452).
Symptom: with CUDA graphs on, a LinearAttention model whose recurrent state is bound as both input and
output gives wrong generations from the first token (onnxruntime CUDA EP, 2026).
Mechanism: the runner makes two ordinary runs before it captures, to meet its minimum-runs rule. The
step updates the state buffer in place, so those runs advance the state twice before the first real
token. Every replay then starts from a state that is two steps ahead of eager's.
Doctor: persistent-mutation, at ``step`` (the in-place update of the state, run by the warmups; the
runner announces the state as persistent state: the graph updating it on every replay is intended).
Fix (upstream workaround): copy the state before the runs that precede capture and put it back after.
"""
from __future__ import annotations

import torch

from ..kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/microsoft/onnxruntime/issues/32243"
FAMILY = "persistent-buffer mutation"
KIND = "persistent-mutation"
SITE = "step"
SYMPTOM = "wrong tokens from the first step: the state was advanced by the runs made before capture"
WARMUPS, STEPS, DIM = 2, 3, 8


class LinearAttention:
    def __init__(self, device: str) -> None:
        gen = generator(32243)
        self.w = randn(DIM, DIM, gen=gen, device=device, scale=0.3)
        self.inputs = [randn(2, DIM, gen=gen, device=device) for _ in range(STEPS)]

    def step(self, x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        state.mul_(0.9).add_(x @ self.w)          # the recurrent state is input and output
        return torch.tanh(state)


def run(variant: str, device: str = "cpu"):
    model = LinearAttention(device)

    def eager():
        state = torch.zeros(2, DIM, device=device)
        return [model.step(x, state).clone() for x in model.inputs]

    def served():
        state = torch.zeros(2, DIM, device=device)
        x_buf = model.inputs[0].clone()             # the first request's input, bound before capture
        saved = state.clone() if variant == "fix" else None
        g, out = capture(lambda: model.step(x_buf, state), device=device, warmups=WARMUPS,
                         static={"x": x_buf}, state={"state": state}, owner="LinearAttention session")
        if saved is not None:
            state.copy_(saved)
        outs = []
        for x in model.inputs:
            x_buf.copy_(x)
            outs.append(replay(g, out).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
