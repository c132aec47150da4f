"""Classifier-free guidance: the second branch's replay overwrites the first branch's output.

Upstream: https://github.com/sgl-project/sglang/pull/27436 (breakable CUDA graphs for diffusion DiTs:
the replay path clones outputs "so the caller can hold the result across the next replay / the other
CFG branch (which shares this static output buffer when shapes match)").
Symptom: (what the clone prevents, as the PR's review thread explains it; no user report was read)
guided denoising would compute ``uncond + s * (cond - uncond)`` from two equal tensors, so guidance
vanishes (sglang diffusion runtime, June 2026).
Mechanism: the conditional and the unconditional passes have the same shapes, so both replay the same
graph and share its static output. The caller keeps the conditional output and replays for the
unconditional one. Both names now point at the unconditional result.
Doctor: overwritten-output, at ``guidance`` (the read of the conditional output after the second replay).
Fix (upstream): return a clone of the static output from each replay.
"""
from __future__ import annotations

import torch

from ..kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/27436"
FAMILY = "persistent-buffer mutation"
KIND = "overwritten-output"
SITE = "guidance"
SYMPTOM = "guidance term is zero: both CFG branches read the same static output"
DIM, SCALE = 8, 4.0


class DiT:
    def __init__(self, device):
        gen = generator(27436)
        self.w = randn(DIM, DIM, gen=gen, device=device, scale=0.4)
        self.latent = randn(3, DIM, gen=gen, device=device)
        self.cond = randn(1, DIM, gen=gen, device=device)

    def forward(self, latent, text):
        return torch.tanh((latent + text) @ self.w)


def guidance(cond, uncond):
    return uncond + SCALE * (cond - uncond)


def run(variant: str, device: str = "cpu"):
    model = DiT(device)
    null = torch.zeros_like(model.cond)

    def eager():
        return [guidance(model.forward(model.latent, model.cond), model.forward(model.latent, null))]

    def served():
        lat_buf, text_buf = model.latent.clone(), model.cond.clone()
        g, out = capture(lambda: model.forward(lat_buf, text_buf), device=device,
                         static={"latent": lat_buf, "text": text_buf}, owner="BCG runner")
        branches = []
        for text in (model.cond, null):
            text_buf.copy_(text)
            o = replay(g, out)
            branches.append(o.clone() if variant == "fix" else o)
        return [guidance(*branches)]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
