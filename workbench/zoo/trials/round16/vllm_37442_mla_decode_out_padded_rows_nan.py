"""MLA decode leaves padded rows of its output unwritten; a per-tensor FP8 scale over the batch takes their NaN.

Upstream: https://github.com/vllm-project/vllm/pull/37442 ("[Bugfix] Zero-init MLA attention output buffers
to prevent NaN from CUDA graph padding").
Symptom: DeepSeek-R1 NVFP4 on GB200 (SM100) with CUDA-graph decode intermittently answered with NaN
outputs for real requests (e.g. a batch padded to 1024 with one real request); eager was clean (vLLM main,
March 2026). Seen with both CUTLASS MLA and FlashInfer TRT-LLM MLA decode.
Mechanism: a FULL decode graph runs at its capture size; padded request slots have ``seq_lens = 0`` and the
MLA decode kernels write nothing for them. ``_sm100_forward_decode`` allocates its output with
``new_empty`` inside the captured region, so that memory is graph-pool memory which replays never
initialise: the padded rows keep whatever was there (uninitialised memory, NaN here). The attention
output then goes through a per-tensor FP8 quantisation whose scale is the ``amax`` over the *whole*
padded batch, so one NaN in a padded row makes the scale NaN and every real row NaN.
Doctor: stale-padding, at ``_sm100_forward_decode`` (padded rows of its output are never written; real
rows depend on them through the batch-wide amax).
Fix (upstream): pre-allocate the decode output (and LSE) buffers with ``torch.zeros`` once per layer and
reuse them by slicing, so rows the kernel skips hold zeros.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/37442"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "_sm100_forward_decode"
SYMPTOM = "NaN outputs for real requests in padded CUDA-graph decode batches (DeepSeek-R1 NVFP4, GB200)"
HEADS, D_LATENT, HIDDEN, BLOCK, NUM_BLOCKS, MAX_BLOCKS, SIZE = 2, 4, 6, 4, 8, 2, 4
FP8_MAX = 448.0


def scaled_fp8_quant(x):
    """Dynamic per-tensor FP8 (e4m3) quantisation: one scale from the amax over every row."""
    scale = x.abs().amax() / FP8_MAX
    q = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.to(x.dtype), scale


class CutlassMLAImpl:
    def __init__(self, device, variant):
        gen = generator(37442)
        self.W_UV = randn(HEADS * D_LATENT, HIDDEN, gen=gen, device=device, scale=0.5)
        self.o_proj = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.variant = variant
        if variant == "fix":                          # the fix: zero-initialised, reused by slicing
            self._decode_out = torch.zeros(SIZE, HEADS, D_LATENT, device=device)

    def _sm100_forward_decode(self, q_latent, kv_c_cache, seq_lens, block_table):
        B = q_latent.shape[0]
        if self.variant == "fix":
            out = self._decode_out[:B]
        else:
            out = q_latent.new_empty((B, HEADS, D_LATENT))
        # sm100_cutlass_mla_decode: latent attention over each request's paged KV; no write for seq_lens == 0
        pos = torch.arange(MAX_BLOCKS * BLOCK, device=q_latent.device)
        slots = block_table[:, pos // BLOCK] * BLOCK + pos % BLOCK
        kv = kv_c_cache[slots]                                        # [B, T, D]
        scores = torch.einsum("bhd,btd->bht", q_latent, kv)
        scores = scores.masked_fill((pos[None, :] >= seq_lens[:, None])[:, None, :], float("-inf"))
        computed = torch.einsum("bht,btd->bhd", torch.softmax(scores, -1), kv)
        out.copy_(torch.where((seq_lens > 0)[:, None, None], computed, out))
        return out

    def forward(self, q_latent, kv_c_cache, seq_lens, block_table):
        attn_out = self._sm100_forward_decode(q_latent, kv_c_cache, seq_lens, block_table)
        x = attn_out.flatten(1) @ self.W_UV                         # _v_up_proj
        x_q, scale = scaled_fp8_quant(x)                            # o_proj input quant (per tensor)
        return (x_q * scale) @ self.o_proj


def run(variant: str, device: str = "cpu"):
    gen = generator(2)
    kv_c_cache = randn(NUM_BLOCKS * BLOCK, D_LATENT, gen=gen, device=device)
    # Decode steps: (requests' latent queries, seq_lens, block ids); the batch grows, as it does
    # while requests join, so the padded slots of the size-4 graph are never real rows.
    steps = [(randn(2, HEADS, D_LATENT, gen=gen, device=device), [5, 3], [[1, 2], [3, 0]]),
             (randn(3, HEADS, D_LATENT, gen=gen, device=device), [6, 4, 2], [[1, 2], [3, 0], [4, 0]])]

    def eager():
        impl = CutlassMLAImpl(device, variant)
        outs = []
        for q, lens, blocks in steps:
            outs.append(impl.forward(q, kv_c_cache, torch.tensor(lens, device=device),
                                     torch.tensor(blocks, device=device)))
        return outs

    def served():
        impl = CutlassMLAImpl(device, variant)
        q_buf = torch.zeros(SIZE, HEADS, D_LATENT, device=device)
        seq_lens = torch.ones(SIZE, dtype=torch.long, device=device)      # capture dummy: one token each
        block_table = torch.zeros(SIZE, MAX_BLOCKS, dtype=torch.long, device=device)
        # cudagraph_num_of_warmups defaults to 0: the capture is the only run at the dummy batch.
        g, out = capture(lambda: impl.forward(q_buf, kv_c_cache, seq_lens, block_table), device=device, warmups=0,
                         static={"q": q_buf, "seq_lens": seq_lens, "block_table": block_table},
                         state={"kv_c_cache": kv_c_cache}, owner="GPUModelRunner (FULL decode graph)")
        outs = []
        for q, lens, blocks in steps:
            n = q.shape[0]
            q_buf[:n].copy_(q)
            seq_lens[:n].copy_(torch.tensor(lens, device=device))
            seq_lens[n:].zero_()                                          # padded requests: seq_lens = 0
            block_table[:n].copy_(torch.tensor(blocks, device=device))
            block_table[n:].zero_()
            outs.append(replay(g, out, real=n, size=SIZE, padded={"q": q_buf})[:n].clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
