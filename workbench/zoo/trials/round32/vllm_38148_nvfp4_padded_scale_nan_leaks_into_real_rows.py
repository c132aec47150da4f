"""NaN block scales of a FULL decode graph's padded rows leak into the real rows' NVFP4 GEMM output.

Upstream: https://github.com/vllm-project/vllm/pull/38148 (band-aid fix "zeroing out the scale padding" for
TRT-LLM ``mm_fp4``), tracked in https://github.com/vllm-project/vllm/issues/40047 ("NaNs in CUDA Graph
padding regions corrupt activations in some per-token kernels"), item (1); FlashInfer issue #2861.
Only the PR/issue descriptions were read, not the diff: the mechanism below follows the tracking issue
and the closely related #37564/#38436 descriptions.
Symptom: intermittent NaN outputs with DeepSeek-R1 NVFP4 on GB200 under FULL CUDA graphs with padding.
Mechanism: a padded decode batch runs the graph captured for ``N`` rows; padded requests have
``seq_lens=0``, so the MLA decode output for those rows is NaN (empty softmax) or stale. The next linear
layer quantizes activations with ``scaled_fp4_quant`` (one block scale per row) and calls ``mm_fp4``,
whose 8x4 scale-factor layout makes rows of one tile share scale reads; a NaN scale of a padded row in
the tile turns the real rows' output NaN. Eager runs only the real rows and never sees those scales.
Doctor: stale-padding, at ``mm_fp4`` (real rows' output depends on the padded rows' scales).
Fix (upstream): zero the block scales of the padded rows before ``mm_fp4``.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/38148"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "mm_fp4"
SYMPTOM = "intermittent NaN logits for real requests under padded FULL decode graphs (NVFP4)"

DIM, SIZE, TILE, CTX = 4, 8, 8, 3          # one 8-row scale tile covers the whole captured batch


def mla_decode(q, kv, seq_lens):
    """Rows with ``seq_lens == 0`` (padded requests) attend over nothing: softmax of all -inf is NaN."""
    pos = torch.arange(CTX, device=q.device)
    scores = (kv @ q[:, :, None]).squeeze(-1).masked_fill(pos[None, :] >= seq_lens[:, None], float("-inf"))
    return (torch.softmax(scores, -1)[:, :, None] * kv).sum(1)


def scaled_fp4_quant(x):
    """Per-row block scale (amax / 6) and the scaled values (the rounding to FP4 is left out)."""
    scale = x.abs().amax(-1) / 6.0
    return x / scale[:, None].clamp(min=1e-6), scale


def mm_fp4(xq, scale, w):
    """8x4 scale layout: each row of a tile is dequantized with the tile's scales (a tile-wide max here),
    so one NaN scale in the tile poisons every row of it."""
    rows = xq.shape[0]
    tile_scale = scale.view(rows // TILE, TILE).amax(-1, keepdim=True).expand(-1, TILE).reshape(rows)
    ratio = torch.where(tile_scale > 0, scale / tile_scale.clamp(min=1e-6), torch.zeros_like(scale))
    return (xq * (ratio * tile_scale)[:, None]) @ w


class Model:
    def __init__(self, device, variant):
        gen = generator(38148)
        self.variant = variant
        self.wq = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.wo = randn(DIM, DIM, gen=gen, device=device, scale=0.7)

    def forward(self, h, kv, seq_lens, num_actual_tokens):
        attn = mla_decode(h @ self.wq, kv, seq_lens)
        rows = attn.shape[0]
        pad = (TILE - rows % TILE) % TILE                     # eager batches are padded to a tile too (zeros)
        attn = torch.cat([attn, attn.new_zeros(pad, DIM)])
        xq, scale = scaled_fp4_quant(attn)
        if self.variant == "fix":
            # zero the scale padding so padded rows cannot contaminate the tile
            mask = torch.arange(scale.shape[0], device=scale.device) < num_actual_tokens
            scale = torch.where(mask, scale, torch.zeros_like(scale))
            xq = torch.where(mask[:, None], xq, torch.zeros_like(xq))
        return mm_fp4(xq, scale, self.wo)[:rows]


class GPUModelRunner:
    def __init__(self, model, device, graphed):
        self.model, self.device, self.graphed = model, device, graphed
        self.hidden = torch.zeros(SIZE, DIM, device=device)
        self.kv = torch.zeros(SIZE, CTX, DIM, device=device)
        self.seq_lens = torch.zeros(SIZE, dtype=torch.long, device=device)
        self.num_actual = torch.zeros((), dtype=torch.long, device=device)
        if graphed:
            self.graph, self.out = capture(
                lambda: model.forward(self.hidden, self.kv, self.seq_lens, self.num_actual),
                device=device, owner="GPUModelRunner (FULL decode graph)",
                static={"hidden": self.hidden, "kv": self.kv, "seq_lens": self.seq_lens,
                        "num_actual": self.num_actual})

    def execute_model(self, hidden, kv, seq_lens):
        n = hidden.shape[0]
        self.hidden[:n].copy_(hidden)
        self.kv[:n].copy_(kv)
        self.seq_lens[:n].copy_(seq_lens)
        self.seq_lens[n:].fill_(0)                        # padded requests: seq_lens = 0
        self.num_actual.fill_(n)
        if not self.graphed:
            return self.model.forward(self.hidden[:n], self.kv[:n], self.seq_lens[:n], n).clone()
        padded = {"hidden": self.hidden, "kv": self.kv}      # left as earlier steps wrote them
        return replay(self.graph, self.out, real=n, size=SIZE, padded=padded)[:n].clone()


def run(variant: str, device: str = "cpu"):
    model = Model(device, variant)
    gen = generator(1)
    steps = []
    for n in (8, 5, 3):
        steps.append((randn(n, DIM, gen=gen, device=device),
                      randn(n, CTX, DIM, gen=gen, device=device),
                      torch.randint(1, CTX + 1, (n,), generator=gen).to(device)))

    def serve(graphed: bool):
        runner = GPUModelRunner(model, device, graphed)
        return [runner.execute_model(*s) for s in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
