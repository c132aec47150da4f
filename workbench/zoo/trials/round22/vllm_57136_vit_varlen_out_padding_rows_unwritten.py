"""Encoder CUDA graphs: ViT varlen attention leaves padded output rows unwritten; their pool NaNs reach real tokens.

Upstream: https://github.com/vllm-project/vllm/issues/57136 ("[Bug]: NaN vision embeddings with multi-budget
encoder CUDA graphs sharing a pool"); fixed in https://github.com/vllm-project/vllm/pull/56922 ("[MM][V2]
Enable encoder-only ViT CUDA graph capture"), which zero-initialises the attention output in
``flash_attn_maxseqlen_wrapper``.
Symptom: Qwen2.5-VL with encoder CUDA graphs (``cudagraph_mm_encoder=True``, nine token budgets captured into
one pool): a 1280x720 image (1196 visual tokens, replayed in the 2048-token graph) gave NaN embeddings and wrong
answers; a 64-token image was fine; ordinary eager, and eager on the same padded buffers, were finite. Seen
with the FA3 and FA4 vision backends, not with FlashInfer or Triton (H20, BF16, September 2026).
Mechanism: the encoder graph of a budget packs the step's images into ``pixel_values[:budget]``; the replay
buffers are padded past the real tokens and ``cu_seqlens`` repeats its last offset, so the padded rows belong
to no sequence. ``flash_attn_maxseqlen_wrapper`` calls ``flash_attn_varlen_func`` without ``out``: the kernel
allocates its output inside the graph (a block of the shared graph pool) and writes only the rows of real
sequences; the padded rows keep whatever the pool held (here the capture's NaN poison; on the GPU another
budget's data). After the projection and the residual the padded hidden rows are NaN, and so are the next
block's keys and values there. FA3 loads K/V by whole ``kBlockN``-row TMA tiles: the last tile of the last
image runs past its end into the padded rows, whose scores are masked to -inf, but ``P @ V`` still multiplies
their NaN values by 0: NaN lands in that image's real tokens.
Doctor: stale-padding, at ``flash_attn_varlen_func`` (the last image's K/V tiles read the padded rows that the
previous block's attention left as the pool held them).
Fix (upstream): ``flash_attn_maxseqlen_wrapper`` passes ``out=torch.zeros_like(q)`` on CUDA: the padded rows
are zero every replay, and a masked zero adds nothing.
(The diff hunk of the fix and the issue were read; the path from the unwritten rows into valid tokens is not
spelled out upstream ("can propagate through later encoder blocks into valid tokens"): it is modelled here by
FA3's tile-granular K/V loads. Tiny ViT: two blocks of full attention per image, a token-wise merger, budgets
8 and 16.)
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/issues/57136"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "flash_attn_varlen_func"
SYMPTOM = "NaN vision embeddings when an image is replayed through a larger encoder CUDA graph budget"

PATCH_DIM, DIM, HEADS, HEAD_DIM, OUT_DIM, DEPTH = 5, 8, 2, 3, 5, 2
ATTN_DIM = HEADS * HEAD_DIM
KBLOCK_N = 4                       # FA3's key tile (rows per TMA load), scaled down
BUDGETS = [8, 16]                  # encoder_cudagraph_token_budgets
MAX_ITEMS = 2                      # images per replay
MAX_POS = 16


def cdiv(a, b):
    return -(-a // b)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                           softmax_scale: float, out=None):
    """FA3 varlen forward, non-causal. Each query row attends over its sequence's keys, loaded by whole
    ``KBLOCK_N``-row tiles: a tile that runs past the sequence's end still reads the next rows of the packed
    tensor (zero-filled only past the tensor's end) and masks their scores. Rows of no sequence (padding) are
    neither computed nor written: without ``out`` they keep what the freshly allocated output held."""
    total = q.shape[0]
    if out is None:
        out = torch.empty_like(q)
    t = torch.arange(total, device=q.device)
    num_seqs = cu_seqlens_q.shape[0] - 1
    seq = (torch.searchsorted(cu_seqlens_q, t, right=True) - 1).clamp(0, num_seqs - 1)
    start, length = cu_seqlens_k[seq], cu_seqlens_k[seq + 1] - cu_seqlens_k[seq]
    offs = torch.arange(cdiv(max_seqlen_k, KBLOCK_N) * KBLOCK_N, device=q.device)
    kpos = start[:, None] + offs[None, :]
    loaded = (offs[None, :] < ((length + KBLOCK_N - 1) // KBLOCK_N * KBLOCK_N)[:, None]) & (kpos < total)
    kidx = kpos.clamp(max=total - 1)
    k_tiles = k[kidx].masked_fill(~loaded[..., None, None], 0.0)       # [tokens, tile rows, heads, head_dim]
    v_tiles = v[kidx].masked_fill(~loaded[..., None, None], 0.0)
    scores = torch.einsum("thd,tjhd->thj", q, k_tiles) * softmax_scale
    scores = scores.masked_fill(~(offs[None, :] < length[:, None])[:, None, :], float("-inf"))
    o = torch.einsum("thj,tjhd->thd", torch.softmax(scores, -1), v_tiles)
    in_seq = t < cu_seqlens_q[num_seqs]
    out.copy_(torch.where(in_seq[:, None, None], o, out))
    return out


def flash_attn_maxseqlen_wrapper(q, k, v, cu_seqlens, max_seqlen: int, variant: str):
    kwargs = {}
    if variant == "fix":
        # Varlen attention leaves padding unwritten. Graph-pool NaNs in those
        # rows can propagate through later encoder blocks into valid tokens.
        kwargs["out"] = torch.zeros_like(q)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                  max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
                                  softmax_scale=1.0 / math.sqrt(HEAD_DIM), **kwargs)


class Qwen2_5_VisionBlock:
    def __init__(self, gen, device, variant):
        self.variant = variant
        self.qkv = randn(DIM, 3 * ATTN_DIM, gen=gen, device=device, scale=0.5)
        self.proj = randn(ATTN_DIM, DIM, gen=gen, device=device, scale=0.5)
        self.fc1 = randn(DIM, 2 * DIM, gen=gen, device=device, scale=0.5)
        self.fc2 = randn(2 * DIM, DIM, gen=gen, device=device, scale=0.5)

    def forward(self, x, cu_seqlens, max_seqlen):
        n = x.shape[0]
        qkv = (F.layer_norm(x, (DIM,)) @ self.qkv).view(n, 3, HEADS, HEAD_DIM)
        q, k, v = qkv.unbind(1)
        attn = flash_attn_maxseqlen_wrapper(q, k, v, cu_seqlens, max_seqlen, self.variant)
        x = x + attn.reshape(n, ATTN_DIM) @ self.proj
        return x + F.gelu(F.layer_norm(x, (DIM,)) @ self.fc1) @ self.fc2


class Qwen2_5_VisionTransformer:
    def __init__(self, device, variant):
        gen = generator(57136)
        self.patch_embed = randn(PATCH_DIM, DIM, gen=gen, device=device, scale=0.6)
        self.pos_embed = randn(MAX_POS, DIM, gen=gen, device=device, scale=0.3)
        self.blocks = [Qwen2_5_VisionBlock(gen, device, variant) for _ in range(DEPTH)]
        self.merger = randn(DIM, OUT_DIM, gen=gen, device=device, scale=0.5)

    def forward(self, pixel_values, pos_ids, cu_seqlens, max_seqlen: int):
        x = pixel_values @ self.patch_embed + self.pos_embed[pos_ids]
        for blk in self.blocks:
            x = blk.forward(x, cu_seqlens, max_seqlen)
        return F.layer_norm(x, (DIM,)) @ self.merger

    # The forward an encoder graph captures: everything host-side (packing, cu_seqlens, the max sequence
    # length, here the budget) was prepared into fixed buffers beforehand.
    encoder_cudagraph_forward = forward


class EncoderCudaGraphManager:
    """One graph per token budget, all captured into one pool (largest first); a step packs its images
    into the smallest budget that holds them."""

    def __init__(self, model, device):
        self.model, self.device = model, device
        top = max(BUDGETS)
        self.input_buffers = {"pixel_values": torch.zeros(top, PATCH_DIM, device=device),
                              "pos_ids": torch.zeros(top, dtype=torch.long, device=device),
                              "cu_seqlens": torch.zeros(MAX_ITEMS + 1, dtype=torch.long, device=device)}
        self.graph_pool = graph_pool_handle(device)
        self.graphs = {}

    def capture(self):
        buf = self.input_buffers
        for budget in sorted(BUDGETS, reverse=True):
            buf["cu_seqlens"].copy_(torch.tensor([0] + [budget] * MAX_ITEMS, device=self.device))   # dummy item
            self.graphs[budget] = capture(
                lambda budget=budget: self.model.encoder_cudagraph_forward(
                    buf["pixel_values"][:budget], buf["pos_ids"][:budget], buf["cu_seqlens"], max_seqlen=budget),
                device=self.device, pool=self.graph_pool, name=f"encoder budget {budget}",
                owner="EncoderCudaGraphManager", static=dict(buf))

    def prepare_encoder_cudagraph_replay_buffers(self, items):
        n = sum(len(p) for p in items)
        buf = self.input_buffers
        buf["pixel_values"][:n].copy_(torch.cat(items).to(self.device))
        buf["pos_ids"][:n].copy_(torch.cat([torch.arange(len(p)) for p in items]).to(self.device))
        offsets = [0]
        for p in items:
            offsets.append(offsets[-1] + len(p))
        # Pad the tail by repeating the final offset: empty sequences.
        offsets += [offsets[-1]] * (MAX_ITEMS + 1 - len(offsets))
        buf["cu_seqlens"].copy_(torch.tensor(offsets, device=self.device))
        return n

    def execute(self, items):
        n = self.prepare_encoder_cudagraph_replay_buffers(items)
        budget = next(b for b in sorted(BUDGETS) if b >= n)
        g, out = self.graphs[budget]
        buf = self.input_buffers
        return replay(g, out, real=n, size=budget,
                      padded={"pixel_values": buf["pixel_values"], "pos_ids": buf["pos_ids"]})[:n].clone()


def run(variant: str, device: str = "cpu"):
    gen = generator(1196)
    steps = [[6], [6, 6], [8], [4, 6], [6]]                  # visual tokens of each step's images
    images = [[torch.randn(n, PATCH_DIM, generator=gen) for n in step] for step in steps]

    def eager():
        model = Qwen2_5_VisionTransformer(device, variant)
        outs = []
        for items in images:
            lens = [len(p) for p in items]
            cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], device=device)
            pos = torch.cat([torch.arange(n) for n in lens]).to(device)
            outs.append(model.forward(torch.cat(items).to(device), pos, cu, max_seqlen=max(lens)))
        return outs

    def served():
        manager = EncoderCudaGraphManager(Qwen2_5_VisionTransformer(device, variant), device)
        manager.capture()
        return [manager.execute(items) for items in images]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
