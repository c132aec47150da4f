"""A device tensor read on the host (``.item()``) while capturing.

Upstream: https://github.com/vllm-project/vllm/pull/56277 (Pixtral / Mistral3 encoder CUDA graphs: "It
also keeps ``max_seqlen`` on CPU because attention backends call ``.item()`` on it during capture").
Symptom: capturing the vision encoder fails when ``max_seqlen`` lives on the GPU, since the backend's
``.item()`` is a host synchronisation inside a stream capture (vLLM main, Sept 2026).
Mechanism: the attention backend turns ``max_seqlen`` into a Python int with ``.item()``. On a device
tensor that is a device-to-host copy and a synchronisation, which a stream capture cannot contain. The
capture is invalidated and the engine fails at startup.
Doctor: sync-in-capture, at ``attention`` (the ``.item()`` call).
Fix (upstream): keep ``max_seqlen`` in host memory, where ``.item()`` reads it without touching the
device.
"""
from __future__ import annotations

import torch

from ...engine import host
from ..kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/56277"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "attention"
SYMPTOM = "capture fails: .item() on a device tensor inside the captured region"
TOKENS, DIM = 6, 4


def attention(x, max_seqlen):
    limit = int(max_seqlen.item())                  # the backend wants a Python int
    scores = (x @ x.t())[:, :limit] / DIM ** 0.5
    return torch.softmax(scores, -1) @ x[:limit]


def run(variant: str, device: str = "cpu"):
    gen = generator(56277)
    x = randn(TOKENS, DIM, gen=gen, device=device)
    max_seqlen = torch.tensor(TOKENS, device=device) if variant == "bug" else host(torch.tensor(TOKENS), device)

    def eager():
        return [attention(x, max_seqlen)]

    def served():
        x_buf = x.clone()
        g, out = capture(lambda: attention(x_buf, max_seqlen), device=device,
                         static={"pixel_tokens": x_buf}, owner="encoder CUDA graph manager")
        return [replay(g, out).clone()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
