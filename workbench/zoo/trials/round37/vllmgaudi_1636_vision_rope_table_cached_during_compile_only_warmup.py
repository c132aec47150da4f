"""The vision tower's lazily built 2D-RoPE table is cached during a warmup that runs no kernels.

Upstream: https://github.com/vllm-project/vllm-gaudi/pull/1636 ("Fix Kimi-K2.5/K2.6 multimodal warmup
corruption and dummy-input crash"), commit c0eda121 (part 1 of the PR; part 2, a dummy-input count
mismatch, is not modelled).
Symptom: with HPU graph warmup on, every Kimi-K2.5/K2.6 image request decodes into repeated token 0
("!"); it works only with ``VLLM_SKIP_WARMUP=true`` (vllm-gaudi, July 2026).
Mechanism: ``Rope2DPosEmbRepeated.get_freqs_cis`` materialises its ``freqs_cis`` table on first call
(``_precompute_freqs_cis``) and caches it behind ``if not hasattr(self, "freqs_cis"): register_buffer``.
``HPUModelRunner.warmup_model`` runs ``warmup_multimodal_graphs`` inside ``PT_COMPILE_ONLY_MODE``, where
Synapse records and compiles the recipes without executing a kernel (here: a graph capture, which also
records without executing). That first call is therefore the warmup's: the table it registers is memory
no kernel ever filled, and the ``hasattr`` guard keeps it for good. Every real image forward, which runs
the vision tower eagerly, skips ``_precompute_freqs_cis`` and rotates q/k with that garbage.
Doctor: warmup-divergence, at ``get_freqs_cis`` (a lazy init decided during the recording warmup and
reused by every later forward, where an eager run computes it at its first real forward).
Fix (upstream): in compile-only mode ``get_freqs_cis`` still builds the table for recipe compilation but
does not cache it (``if not bridge_config.get_pt_compile_only_mode(): register_buffer``); the first
genuinely executed forward computes and caches the real values.
Model notes: one vision attention layer with the real-arithmetic (cos, sin) 2D RoPE of the HPU patch;
``bridge_config.get_pt_compile_only_mode()`` is a flag the runner sets around the recording warmup.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn

UPSTREAM = "https://github.com/vllm-project/vllm-gaudi/pull/1636"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "get_freqs_cis"
SYMPTOM = "image requests decode into repeated token 0 ('!') after HPU graph warmup"

PATCH, HIDDEN, NUM_HEADS, HEAD_DIM = 6, 8, 1, 8
MAX_HEIGHT, MAX_WIDTH, THETA = 4, 4, 100.0
OUT = 5                                    # merged embedding size handed to the language model


class _BridgeConfig:
    """``habana_frameworks.torch.internal.bridge_config``: the ``PT_COMPILE_ONLY_MODE`` switch."""

    def __init__(self):
        self.pt_compile_only_mode = False

    def get_pt_compile_only_mode(self) -> bool:
        return self.pt_compile_only_mode


bridge_config = _BridgeConfig()


def apply_rope(xq, xk, freqs_cis):
    """Real (cos, sin) rotation of the HPU patch (no complex dtype on HPU)."""
    freqs_cis = freqs_cis.unsqueeze(-3)
    cos, sin = freqs_cis[..., 0], freqs_cis[..., 1]
    xq_ = xq.view(*xq.shape[:-1], -1, 2)
    xk_ = xk.view(*xk.shape[:-1], -1, 2)
    xq_r, xq_i = xq_[..., 0], xq_[..., 1]
    xk_r, xk_i = xk_[..., 0], xk_[..., 1]
    xq_out = torch.stack([xq_r * cos - xq_i * sin, xq_r * sin + xq_i * cos], dim=-1).flatten(-2)
    xk_out = torch.stack([xk_r * cos - xk_i * sin, xk_r * sin + xk_i * cos], dim=-1).flatten(-2)
    return xq_out, xk_out


class Rope2DPosEmbRepeated(torch.nn.Module):
    def __init__(self, dim, max_height, max_width, theta_base, variant):
        super().__init__()
        self.dim, self.max_height, self.max_width, self.theta_base = dim, max_height, max_width, theta_base
        self.variant = variant

    def _precompute_freqs_cis(self, device):
        n = self.max_height * self.max_width
        flat_pos = torch.arange(0, n, device=device).float()
        x_pos = flat_pos % self.max_width
        y_pos = flat_pos // self.max_width
        dim_range = torch.arange(0, self.dim, 4, device=device)[: self.dim // 4].float()
        freqs = 1.0 / (self.theta_base ** (dim_range / self.dim))
        x_freqs = torch.outer(x_pos, freqs)
        y_freqs = torch.outer(y_pos, freqs)
        cos = torch.stack([torch.cos(x_freqs), torch.cos(y_freqs)], dim=-1).reshape(n, -1)
        sin = torch.stack([torch.sin(x_freqs), torch.sin(y_freqs)], dim=-1).reshape(n, -1)
        return torch.stack([cos, sin], dim=-1).reshape(self.max_height, self.max_width, self.dim // 2, 2)

    def get_freqs_cis(self, grid_thws, device):
        if self.variant == "bug":
            if not hasattr(self, "freqs_cis"):
                self.register_buffer("freqs_cis", self._precompute_freqs_cis(device), persistent=False)
            freqs_cis_buf = self.freqs_cis
        else:
            if hasattr(self, "freqs_cis"):
                freqs_cis_buf = self.freqs_cis
            else:
                freqs_cis_buf = self._precompute_freqs_cis(device)
                if not bridge_config.get_pt_compile_only_mode():
                    self.register_buffer("freqs_cis", freqs_cis_buf, persistent=False)
        assert all(1 <= h <= self.max_height and 1 <= w <= self.max_width for t, h, w in grid_thws)
        return torch.cat([freqs_cis_buf[:h, :w].reshape(-1, self.dim // 2, 2).repeat(t, 1, 1)
                          for t, h, w in grid_thws], dim=0)


class MoonVitEncoder:
    """Patch embedding, one self-attention block with 2D RoPE (attention within each image), merger."""

    def __init__(self, device, variant):
        gen = generator(1636)
        self.device = device
        self.patch_size = 1
        self.patch_embed = randn(PATCH, HIDDEN, gen=gen, device=device, scale=0.5)
        self.wq, self.wk, self.wv = (randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5) for _ in range(3))
        self.merger = randn(HIDDEN, OUT, gen=gen, device=device, scale=0.5)
        self.rope_2d = Rope2DPosEmbRepeated(HEAD_DIM, MAX_HEIGHT, MAX_WIDTH, THETA, variant)

    def forward(self, pixel_values, grid_thws):
        x = pixel_values @ self.patch_embed
        n = x.shape[0]
        freqs_cis = self.rope_2d.get_freqs_cis(grid_thws, self.device)
        q = (x @ self.wq).view(n, NUM_HEADS, HEAD_DIM)
        k = (x @ self.wk).view(n, NUM_HEADS, HEAD_DIM)
        v = (x @ self.wv).view(n, NUM_HEADS, HEAD_DIM)
        q, k = apply_rope(q, k, freqs_cis)
        segment = torch.cat([torch.full((t * h * w,), i, device=self.device) for i, (t, h, w) in enumerate(grid_thws)])
        same = segment[:, None] == segment[None, :]
        scores = torch.einsum("qhd,khd->hqk", q, k) * HEAD_DIM ** -0.5
        probs = torch.softmax(scores.masked_fill(~same[None], float("-inf")), -1)
        attn = torch.einsum("hqk,khd->qhd", probs, v).reshape(n, HIDDEN)
        return (x + attn) @ self.merger


class HPUModelRunner:
    def __init__(self, device, variant, skip_warmup):
        self.device, self.skip_warmup = device, skip_warmup
        self.vision_tower = MoonVitEncoder(device, variant)
        self.multimodal_buckets = [[(1, 2, 2)], [(1, 3, 4)]]     # dummy image grids warmed up
        self.graphed_buckets = {}                                # bucket -> recorded recipe

    def warmup_multimodal_graphs(self, buckets):
        for grid in buckets:
            num_patches = sum(t * h * w for t, h, w in grid)
            dummy = {"pixel_values": torch.zeros(num_patches, PATCH, device=self.device)}
            # PT_COMPILE_ONLY_MODE: the recipe is recorded and compiled; no kernel runs.
            recipe, _ = capture(lambda g=grid, d=dummy: self.vision_tower.forward(d["pixel_values"], g),
                                device=self.device, warmups=0, name=f"vision {grid}", static=dummy,
                                owner="HPUModelRunner.warmup_multimodal_graphs (compile-only)")
            self.graphed_buckets[tuple(grid)] = recipe

    def warmup_model(self):
        if self.skip_warmup:                                     # VLLM_SKIP_WARMUP=true
            return
        bridge_config.pt_compile_only_mode = True
        try:
            self.warmup_multimodal_graphs(self.multimodal_buckets)
        finally:
            bridge_config.pt_compile_only_mode = False

    def execute_mm_encoder(self, pixel_values, grid_thws):
        """The vision tower runs eagerly (not hpu-graph wrapped, ``compile_mm_encoder`` off)."""
        return self.vision_tower.forward(pixel_values, grid_thws).clone()


def run(variant: str, device: str = "cpu"):
    gen = generator(16360)
    requests = [[(1, 2, 2)], [(1, 3, 4), (1, 2, 3)], [(2, 2, 2)]]
    inputs = [(randn(sum(t * h * w for t, h, w in g), PATCH, gen=gen, device=device), g) for g in requests]

    def serve(skip_warmup: bool):
        runner = HPUModelRunner(device, variant, skip_warmup)
        with torch.no_grad():
            runner.warmup_model()
            return [runner.execute_mm_encoder(pv, g) for pv, g in inputs]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(False), lambda: serve(True))
