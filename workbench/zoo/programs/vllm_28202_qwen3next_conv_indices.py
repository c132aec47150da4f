"""Padded activations meet real-count state indices in the eager piece of a PIECEWISE graph.

Upstream: https://github.com/vllm-project/vllm/pull/28202 (partially fixes vllm-project/vllm#27571).
Symptom: Qwen3-Next serving crashes in decode with an ``AssertionError`` in ``causal_conv1d_update``
under CUDA graphs (vLLM main, Nov 2025).
Mechanism: decode batches are padded to a captured size, so the mixer's input has the padded number
of rows. Its conv-state indices were sliced to the real number of decodes. The kernel asserts
``(batch,) == conv_state_indices.shape`` and fails on every padded step.
Doctor: padded-shape-mismatch (a shape contract between padded activations and real-count metadata,
inside code run eagerly: code run at a graph's padded size combines tensors sized for the padded rows
with tensors sized for the real rows). Site: ``conv_update`` (the assertion).
Fix (upstream): pass the activations of the real decodes only (slice them to ``num_decodes``).
"""
from __future__ import annotations

import torch

from ..kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/28202"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "conv_update"
SYMPTOM = "AssertionError in causal_conv1d_update on padded decode steps"
DIM, SIZES, REAL = 6, (2, 4), 3


def conv_update(x, conv_state, indices):
    """``causal_conv1d_update``'s contract: one state index per row of ``x``."""
    assert (x.shape[0],) == tuple(indices.shape), f"batch {x.shape[0]} != indices {tuple(indices.shape)}"
    conv_state[indices] = conv_state[indices] * 0.5 + x
    return conv_state[indices].clone()


class Mixer:
    def __init__(self, device):
        gen = generator(28202)
        self.w_in = randn(DIM, DIM, gen=gen, device=device, scale=0.4)
        self.tokens = randn(REAL, DIM, gen=gen, device=device)
        self.indices = torch.tensor([3, 0, 2], device=device)

    def project(self, h):
        return h @ self.w_in


def run(variant: str, device: str = "cpu"):
    model = Mixer(device)

    def eager():
        state = torch.zeros(5, DIM, device=device)
        return [conv_update(model.project(model.tokens), state, model.indices)]

    def served():
        state = torch.zeros(5, DIM, device=device)
        h_buf = torch.zeros(max(SIZES), DIM, device=device)
        graphs = {s: capture(lambda s=s: model.project(h_buf[:s]), device=device, name=f"size {s}",
                             static={"hidden_states": h_buf}, owner="piecewise runner") for s in reversed(SIZES)}
        size = next(s for s in SIZES if s >= REAL)
        h_buf[:REAL].copy_(model.tokens)
        g, out = graphs[size]
        mixed = replay(g, out, real=REAL, size=size, padded={"hidden_states": h_buf})
        num_decodes = REAL
        x = mixed[:num_decodes] if variant == "fix" else mixed
        return [conv_update(x, state, model.indices[:num_decodes])]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
