"""Encoder graph budget counts the global image only; local patches do not fit.

Upstream: https://github.com/vllm-project/vllm/pull/46034 (follows #42224, which added the Step3-VL
encoder CUDA graph).
Symptom: with ``cudagraph_mm_encoder`` on, Step3-VL raises ``RuntimeError`` for larger images (vLLM
main, June 2026); small images work.
Mechanism: a large image is split into a global view plus local patches, each encoded to tokens. The
graph manager picked the token budget (and so the static buffer) from the global view's tokens only.
Copying the image's global plus patch tokens into that buffer fails on the shape.
Doctor: undersized-buffer, at ``encode_graphed`` (the copy into the static pixel buffer).
Fix (upstream): count the local patches too (a second, patch path of graphs); an input that fits no
budget runs eagerly.
"""
from __future__ import annotations

import torch

from ..kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/46034"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "encode_graphed"
SYMPTOM = "RuntimeError for images large enough to get local patches"
DIM, GLOBAL_TOKENS, PATCH_TOKENS = 8, 4, 2
BUDGETS = (4, 8, 16)


def tokens_of(image_side: int) -> tuple[int, int]:
    """(global tokens, local-patch tokens): images over 2 units get one patch per extra unit."""
    return GLOBAL_TOKENS, PATCH_TOKENS * max(0, image_side - 2)


class Encoder:
    def __init__(self, device):
        gen = generator(46034)
        self.w = randn(DIM, DIM, gen=gen, device=device, scale=0.3)
        self.images = [randn(sum(tokens_of(side)), DIM, gen=gen, device=device) for side in (2, 5)]

    def forward(self, pixels):
        return torch.relu(pixels @ self.w)


def budget_for(side: int, variant: str) -> int | None:
    glob, local = tokens_of(side)
    need = glob if variant == "bug" else glob + local       # the bug counts the global view only
    return next((b for b in BUDGETS if b >= need), None)


def encode_graphed(model, graphs, buffers, image, side, variant):
    budget = budget_for(side, variant)
    if budget is None:
        return model.forward(image)
    n = image.shape[0]
    buffers[budget][:n].copy_(image)
    buffers[budget][n:].zero_()
    g, out = graphs[budget]
    return replay(g, out)[:n].clone()


def run(variant: str, device: str = "cpu"):
    model = Encoder(device)
    sides = (2, 5)

    def eager():
        return [model.forward(img) for img in model.images]

    def served():
        buffers = {b: torch.zeros(b, DIM, device=device) for b in BUDGETS}
        graphs = {}
        for b in reversed(BUDGETS):
            graphs[b] = capture(lambda b=b: model.forward(buffers[b]), device=device, name=f"budget {b}",
                                static={"pixel_values": buffers[b]}, owner=f"encoder budget {b}")
        return [encode_graphed(model, graphs, buffers, img, side, variant) for img, side in zip(model.images, sides)]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
