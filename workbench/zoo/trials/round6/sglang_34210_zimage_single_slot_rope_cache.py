"""Z-Image's single-slot rope caches evict the tensors an earlier-captured bucket's graph still reads.

Upstream: https://github.com/sgl-project/sglang/pull/34210 ("[diffusion] Z-Image single-GPU BCG: fix the
replay crash and make output bit-exact vs eager (#34183)"); issue
https://github.com/sgl-project/sglang/issues/34183.
Symptom: breakable CUDA graph (BCG) on the Z-Image family on one GPU: every warmup capture succeeds, then
the first replay fails with an asynchronous ``CUDA illegal memory access`` (or hangs with
``--dit-cpu-offload=false``); TP=2 masks it (sglang diffusion runtime, main, Aug 2026).
Mechanism: Z-Image's forward keeps single-slot, shape-keyed caches (``(cache_key, value)``) for the
image and caption rope tables and the joint ``freqs_cis``, keyed on the ``data_ptr()`` of each
signature's static position-id buffers. The warmup of a bucket fills the slots and its capture reads
the cached tensors, so the graph bakes in their addresses; the warmup of the next text bucket replaces
every slot (image side included) and frees the old tensors. Replaying the earlier bucket's graph reads
freed memory.
Doctor: dangling-reference, at ``_apply_rotary_emb`` (the captured rope reads the evicted cos/sin).
Fix (upstream, fix 1 of the PR): pin every cache value consumed under BCG capture for the graph's
lifetime, so replacing a slot no longer frees what a captured graph reads.
"""
from __future__ import annotations

import math

import torch

from workbench.engine import CUDAGraphMode, GraphManager
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/sgl-project/sglang/pull/34210"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "_apply_rotary_emb"
SYMPTOM = "illegal memory access at the first replay: an earlier bucket's graph reads evicted rope tensors"
IN_CH, CAP_DIM, DIM, HEADS = 4, 6, 8, 2
HEAD_DIM = DIM // HEADS
N_IMG, CAP_BUCKETS = 4, (2, 4)          # image tokens; caption-length buckets (one BCG signature each)
SIGMAS = (1.0, 0.6, 0.3, 0.0)


class RopeEmbedder:
    def __init__(self, theta=256.0, axes_dims=(2, 2), axes_lens=(16, 16)):
        self.theta, self.axes_dims, self.axes_lens = theta, axes_dims, axes_lens
        self.cos_cached = self.sin_cached = None

    @staticmethod
    def precompute_freqs(dim, end, theta):
        cos_list, sin_list = [], []
        for d, e in zip(dim, end):
            freqs = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
            freqs = torch.outer(torch.arange(e, dtype=torch.float64), freqs).float()
            cos_list.append(torch.cos(freqs))
            sin_list.append(torch.sin(freqs))
        return cos_list, sin_list

    def __call__(self, ids):
        if self.cos_cached is None:
            self.cos_cached, self.sin_cached = self.precompute_freqs(self.axes_dims, self.axes_lens, self.theta)
            self.cos_cached = [c.to(ids.device) for c in self.cos_cached]
            self.sin_cached = [s.to(ids.device) for s in self.sin_cached]
        cos_out = [self.cos_cached[i][ids[:, i]] for i in range(len(self.axes_dims))]
        sin_out = [self.sin_cached[i][ids[:, i]] for i in range(len(self.axes_dims))]
        return torch.cat(cos_out, dim=-1), torch.cat(sin_out, dim=-1)


def _apply_rotary_emb(x, cos, sin):
    """Interleaved (non-neox) rotary embedding of x [tokens, heads, head_dim]."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def attention(q, k, v):
    """The attention kernel: BCG breaks the graph here and runs it eagerly at every replay."""
    scores = torch.einsum("nhd,mhd->hnm", q, k) / math.sqrt(HEAD_DIM)
    return torch.einsum("hnm,mhd->nhd", torch.softmax(scores, dim=-1), v)


class ZImageTransformerBlock:
    def __init__(self, gen, device, modulation):
        self.wq, self.wk, self.wv, self.wo = (randn(DIM, DIM, gen=gen, device=device, scale=0.4) for _ in range(4))
        self.w1 = randn(DIM, 2 * DIM, gen=gen, device=device, scale=0.3)
        self.w2 = randn(2 * DIM, DIM, gen=gen, device=device, scale=0.3)
        self.ada = randn(DIM, DIM, gen=gen, device=device, scale=0.2) if modulation else None

    def forward(self, x, freqs_cis, adaln_input, attn):
        h = x * (1.0 + adaln_input @ self.ada) if self.ada is not None else x
        q, k, v = ((h @ w).view(-1, HEADS, HEAD_DIM) for w in (self.wq, self.wk, self.wv))
        cos, sin = freqs_cis
        q = _apply_rotary_emb(q, cos, sin)
        k = _apply_rotary_emb(k, cos, sin)
        x = x + attn(q, k, v).flatten(1) @ self.wo
        return x + torch.nn.functional.silu(x @ self.w1) @ self.w2


class ZImageTransformer2DModel:
    def __init__(self, device, pin_capture_cache_values: bool):
        gen = generator(34210)
        self.x_embedder = randn(IN_CH, DIM, gen=gen, device=device, scale=0.5)
        self.cap_embedder = randn(CAP_DIM, DIM, gen=gen, device=device, scale=0.5)
        self.t_embedder = randn(4, DIM, gen=gen, device=device, scale=0.5)
        self.noise_refiner = ZImageTransformerBlock(gen, device, modulation=True)
        self.context_refiner = ZImageTransformerBlock(gen, device, modulation=False)
        self.layer = ZImageTransformerBlock(gen, device, modulation=True)
        self.final = randn(DIM, IN_CH, gen=gen, device=device, scale=0.5)
        self.rope_embedder = RopeEmbedder()
        # single-slot shape-keyed caches: (cache_key, value)
        self._cached_x_rope_cache = self._cached_cap_rope_cache = self._cached_batched_freqs_cis = None
        self.pin_capture_cache_values = pin_capture_cache_values
        self._bcg_pinned_cache_values = []

    def _cached(self, slot: str, key, compute):
        cached = getattr(self, slot)
        if cached is not None and cached[0] == key:
            value = cached[1]
        else:
            value = compute()
            setattr(self, slot, (key, value))           # replaces (and frees) the previous signature's value
        if self.pin_capture_cache_values and torch.cuda.is_current_stream_capturing():
            self._bcg_pinned_cache_values.append(value)  # lives as long as the captured graphs
        return value

    def forward(self, x, cap_feats, t, x_pos_ids, cap_pos_ids, attn):
        half = torch.arange(2, dtype=torch.float32, device=t.device)
        t_freq = t[:, None] * torch.exp(-math.log(10000.0) * half / 2)[None]
        adaln_input = torch.cat([torch.cos(t_freq), torch.sin(t_freq)], dim=-1) @ self.t_embedder
        x = x @ self.x_embedder
        cap = cap_feats * torch.rsqrt(cap_feats.pow(2).mean(-1, keepdim=True) + 1e-6) @ self.cap_embedder

        x_key = (tuple(x_pos_ids.shape), x_pos_ids.data_ptr())
        cap_key = (tuple(cap_pos_ids.shape), cap_pos_ids.data_ptr())
        x_freqs = self._cached("_cached_x_rope_cache", x_key, lambda: self.rope_embedder(x_pos_ids))
        cap_freqs = self._cached("_cached_cap_rope_cache", cap_key, lambda: self.rope_embedder(cap_pos_ids))
        x = self.noise_refiner.forward(x, x_freqs, adaln_input, attn)
        cap = self.context_refiner.forward(cap, cap_freqs, None, attn)

        unified = torch.cat([x, cap], dim=0)
        freqs_cis = self._cached("_cached_batched_freqs_cis", (x_key, cap_key),
                                 lambda: (torch.cat([x_freqs[0], cap_freqs[0]]), torch.cat([x_freqs[1], cap_freqs[1]])))
        unified = self.layer.forward(unified, freqs_cis, adaln_input, attn)
        return unified @ self.final                     # the runner keeps the image tokens


def position_ids(cap_len: int, device):
    cap = torch.tensor([[i + 1, 0] for i in range(cap_len)], device=device)
    img = torch.tensor([[cap_len + 1, j] for j in range(N_IMG)], device=device)
    return img, cap


class DiffusionBreakableCudaGraphRunner:
    """One BCG per input signature (caption bucket), static input buffers per signature, warmup then
    capture, all signatures in one pool; attention stays eager between the captured segments."""

    def __init__(self, model, device):
        self.model, self.device = model, device
        self.signature_buffers = {}
        self.manager = GraphManager(self._forward, [N_IMG + c for c in CAP_BUCKETS], device=device,
                                    mode=CUDAGraphMode.PIECEWISE, num_warmups=1,
                                    static_buffers=self._buffers_for, name="diffusion BCG")
        self.attn = self.manager.eager(attention)

    def _buffers_for(self, size: int):
        cap_len = size - N_IMG
        img_ids, cap_ids = position_ids(cap_len, self.device)
        self.signature_buffers[size] = {
            "x": torch.zeros(N_IMG, IN_CH, device=self.device),
            "cap_feats": torch.zeros(cap_len, CAP_DIM, device=self.device),
            "t": torch.zeros(1, device=self.device),
            "x_pos_ids": img_ids, "cap_pos_ids": cap_ids}
        return self.signature_buffers[size]

    def _forward(self, size: int):
        b = self.signature_buffers[size]
        return self.model.forward(b["x"], b["cap_feats"], b["t"], b["x_pos_ids"], b["cap_pos_ids"], self.attn)

    def __call__(self, x, cap_feats, t, x_pos_ids, cap_pos_ids):
        size = N_IMG + cap_feats.shape[0]
        b = self.signature_buffers[size]
        for name, live in (("x", x), ("cap_feats", cap_feats), ("t", t), ("x_pos_ids", x_pos_ids),
                           ("cap_pos_ids", cap_pos_ids)):
            b[name].copy_(live)
        return self.manager.replay(size, real=size)[:N_IMG].clone()


def run(variant: str, device: str = "cpu"):
    gen = generator(34183)
    requests = [(randn(N_IMG, IN_CH, gen=gen, device=device), randn(c, CAP_DIM, gen=gen, device=device))
                for c in (4, 2)]                         # the first request lands on the first-captured bucket

    def denoise(transformer):
        outs = []
        for latents, cap_feats in requests:
            x = latents.clone()
            for s, s_next in zip(SIGMAS[:-1], SIGMAS[1:]):
                img_ids, cap_ids = position_ids(cap_feats.shape[0], device)
                v = transformer(x, cap_feats, torch.tensor([s], device=device), img_ids, cap_ids)
                x = x + (s_next - s) * v                  # flow-matching Euler step (eager)
            outs.append(x)
        return outs

    def eager():
        model = ZImageTransformer2DModel(device, pin_capture_cache_values=False)
        return denoise(lambda *a: model.forward(*a, attention)[:N_IMG])

    def served():
        model = ZImageTransformer2DModel(device, pin_capture_cache_values=(variant == "fix"))
        runner = DiffusionBreakableCudaGraphRunner(model, device)
        runner.manager.capture()                        # warmup resolutions: every caption bucket
        return denoise(runner)

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
