"""The Stable Diffusion UNet copies its CPU timestep-embedding table to the GPU on every forward: CUDA-graph capture fails.

Upstream: https://github.com/NVIDIA/NeMo/pull/9319 ("[SD] Fix SD CUDA Graph Failure", commit 445b9b19ad,
merged June 2024; commit message "[SD] Avoid redundant host & device sync breaks cuda graph.").
Symptom: Stable Diffusion training with CUDA graphs (``capture_cudagraph_iters >= 0``) failed at graph
capture; eager training was fine.
Mechanism: ``UNetModel.__init__`` (nemo/collections/multimodal/modules/stable_diffusion/diffusionmodules/
openaimodel.py) builds ``self.time_embeddings = torch.Tensor(build_timestep_embedding(model_channels,
timesteps))``: a plain attribute, not a registered buffer, so moving the module to the GPU leaves it in
(pageable) host memory. ``UNetModel.forward`` then called ``timestep_embedding(timesteps, model_channels,
cached_embedding=self.time_embeddings.to(timesteps.device))`` on every call: a host-to-device copy of the
whole table followed by a stream synchronisation, issued on the capturing stream when the step is
captured, which CUDA refuses. Eager warmup iterations do the same copy, harmlessly.
Doctor: sync-in-capture, at forward (``UNetModel.forward``'s per-call ``self.time_embeddings.to(timesteps.device)``).
Fix (upstream): move the table once and keep it: ``if self.time_embeddings.device != timesteps.device:
self.time_embeddings = self.time_embeddings.to(timesteps.device)``, then pass ``self.time_embeddings``
as ``cached_embedding``. The first (eager, warmup) forward moves it; the captured forward finds it on the
device, indexes it there, and copies nothing.
(Read: the diff of 445b9b19ad and ``build_timestep_embedding`` / ``timestep_embedding`` in ``util.py`` at
that commit.) The UNet's down/middle/up blocks are cut to one time-conditioned residual block at tiny
sizes; the table is pageable host memory (``host(...).clone()``, a plain CPU tensor on CUDA). Only the
denoiser forward is captured (the training step's backward is left out).
"""
from __future__ import annotations

import math

import torch

from workbench.engine import host, is_host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/NeMo/pull/9319"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "forward"
SYMPTOM = "CUDA-graph capture of the SD UNet step fails: the CPU time-embedding table is copied H2D in capture"

MODEL_CHANNELS, TIMESTEPS, CHANNELS, BATCH, STEPS = 4, 16, 6, 3, 4


def build_timestep_embedding(dim, max_timesteps, max_period=10000):
    timesteps = torch.arange(0, max_timesteps, dtype=torch.float32)
    half = dim // 2
    idx = torch.arange(0, half, dtype=torch.float32)
    freqs = torch.exp(-math.log(max_period) / half * idx)
    args = timesteps[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def timestep_embedding(timesteps, dim, cached_embedding=None):
    # using cached embedding and lookup in the cache
    return cached_embedding[timesteps.to(dtype=torch.int), :]


def _on(t: torch.Tensor, device: torch.device) -> bool:
    """``t.device == device``: host memory is never the device's (on the CPU backend both say ``cpu``)."""
    return not is_host(t) and t.device == device


class UNetModel:
    def __init__(self, device, variant):
        gen = generator(9319)
        self.model_channels, self.variant = MODEL_CHANNELS, variant
        time_embed_dim = MODEL_CHANNELS * 4
        # self.time_embed = Sequential(linear(model_channels, time_embed_dim), SiLU, linear(...))
        self.te_w1 = randn(MODEL_CHANNELS, time_embed_dim, gen=gen, device=device, scale=0.7)
        self.te_w2 = randn(time_embed_dim, time_embed_dim, gen=gen, device=device, scale=0.4)
        self.in_w = randn(CHANNELS, time_embed_dim, gen=gen, device=device, scale=0.5)
        self.out_w = randn(time_embed_dim, CHANNELS, gen=gen, device=device, scale=0.5)
        # a plain attribute, not a buffer: module.cuda() leaves it in (pageable) host memory
        self.time_embeddings = host(build_timestep_embedding(MODEL_CHANNELS, TIMESTEPS), device).clone()

    def time_embed(self, t_emb):
        return torch.nn.functional.silu(t_emb @ self.te_w1) @ self.te_w2

    def forward(self, x, timesteps):
        if self.variant == "bug":
            t_emb = timestep_embedding(timesteps, self.model_channels,
                                       cached_embedding=self.time_embeddings.to(timesteps.device))
        else:
            if not _on(self.time_embeddings, timesteps.device):
                self.time_embeddings = self.time_embeddings.to(timesteps.device)
            t_emb = timestep_embedding(timesteps, self.model_channels, cached_embedding=self.time_embeddings)
        emb = self.time_embed(t_emb)
        h = x @ self.in_w
        h = h + torch.nn.functional.silu(h + emb)          # one time-conditioned residual block
        return x + h @ self.out_w


def run(variant: str, device: str = "cpu"):
    gen = generator(1)
    steps = []
    for i in range(STEPS):
        t = torch.randint(0, TIMESTEPS, (BATCH,), generator=gen)
        steps.append((randn(BATCH, CHANNELS, gen=gen, device=device), t.to(device)))

    def served():
        unet = UNetModel(device, variant)
        x = torch.zeros(BATCH, CHANNELS, device=device)
        timesteps = torch.zeros(BATCH, dtype=torch.long, device=device)
        x.copy_(steps[0][0])
        timesteps.copy_(steps[0][1])
        graph, out = capture(lambda: unet.forward(x, timesteps), device=device, warmups=1,
                             name="unet step", owner="SD training step graph",
                             static={"x_noisy": x, "timesteps": timesteps})
        outs = []
        for noisy, t in steps:
            x.copy_(noisy)
            timesteps.copy_(t)
            outs.append(replay(graph, out).clone())
        return outs

    def eager():
        unet = UNetModel(device, variant)
        return [unet.forward(noisy, t).clone() for noisy, t in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
