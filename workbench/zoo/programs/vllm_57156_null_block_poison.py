"""Dummy capture batches write NaN into the null KV block that padded reads gather.

Upstream: https://github.com/vllm-project/vllm/issues/57156 ("DeepSeek-V4.1 produces NaN with CUDA
graphs on SM120/121 — dummy capture batches poison the null KV block").
Symptom: with CUDA graphs (FULL, PIECEWISE or FULL_DECODE_ONLY), completions are empty or garbled;
every attention output row is NaN from layer 0 on; ``--enforce-eager`` is correct (vLLM main, Sept
2026, GB10).
Mechanism: the dummy batches run for warmup and capture write their K/V into block 0, the null block.
Their all-zero activations quantise with a zero scale, so block 0 fills with NaN. The decode kernel
gathers slot 0 for invalid positions and relies on a zero weight to mask them out, and ``0 * NaN`` is NaN.
Doctor: persistent-mutation (the warmup writes the KV cache's null block, which later steps read),
site: ``write_kv``.
Fix (the one the mechanism calls for; the issue was open when read): keep dummy-batch writes out of
the null block (they go to a scratch slot), so block 0 keeps the zeros masked reads rely on.
"""
from __future__ import annotations

import torch

from ..kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/issues/57156"
FAMILY = "warmup/capture vs replay state"
KIND = "persistent-mutation"
SITE = "write_kv"
SYMPTOM = "NaN attention outputs under graphs: the null block holds NaN from dummy batches"
DIM, SLOTS, CTX = 4, 8, 4      # slot 0: null block; slot SLOTS - 1: scratch slot of the fix


def write_kv(cache, scales, k, slots):
    scale = k.abs().amax(-1, keepdim=True)
    cache[slots] = k / scale                         # a zero row quantises to 0 / 0 = NaN
    scales[slots] = scale


def decode(q, k, cache, scales, slots, ctx_slots, ctx_valid):
    write_kv(cache, scales, k, slots)
    kv = cache[ctx_slots] * scales[ctx_slots]        # invalid positions gather slot 0 ...
    w = torch.softmax((kv @ q[:, :, None]).squeeze(-1), -1) * ctx_valid   # ... and are weighted 0
    return (w[..., None] * kv).sum(1)


def run(variant: str, device: str = "cpu"):
    gen = generator(57156)
    q, k = randn(2, DIM, gen=gen, device=device), randn(2, DIM, gen=gen, device=device)
    slots = torch.tensor([1, 2], device=device)
    ctx_slots = torch.tensor([[1, 0, 0, 0], [2, 1, 0, 0]], device=device)
    ctx_valid = torch.tensor([[1.0, 0, 0, 0], [1, 1, 0, 0]], device=device)

    def fresh():
        return torch.zeros(SLOTS, DIM, device=device), torch.zeros(SLOTS, 1, device=device)

    def eager():
        cache, scales = fresh()
        return [decode(q, k, cache, scales, slots, ctx_slots, ctx_valid)]

    def served():
        cache, scales = fresh()
        dummy = SLOTS - 1 if variant == "fix" else 0
        bufs = {"q": torch.zeros(2, DIM, device=device), "k": torch.zeros(2, DIM, device=device),
                "slots": torch.full((2,), dummy, device=device),
                "ctx_slots": torch.zeros(2, CTX, dtype=torch.long, device=device),
                "ctx_valid": torch.zeros(2, CTX, device=device)}
        g, out = capture(lambda: decode(bufs["q"], bufs["k"], cache, scales, bufs["slots"], bufs["ctx_slots"],
                                        bufs["ctx_valid"]), device=device, static=bufs, owner="GPUModelRunner")
        for name, value in (("q", q), ("k", k), ("slots", slots), ("ctx_slots", ctx_slots), ("ctx_valid", ctx_valid)):
            bufs[name].copy_(value)
        return [replay(g, out).clone()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
