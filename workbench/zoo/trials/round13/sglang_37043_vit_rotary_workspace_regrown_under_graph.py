"""ViT CUDA graphs read a shared rotary workspace that a larger image later regrows: the smaller graphs keep the old block.

Upstream: https://github.com/sgl-project/sglang/pull/37043 ("[vlm] fix: preserve per-request vit graph metadata
for qwen-vl"); reported as https://github.com/sgl-project/sglang/issues/29216 ("Qwen3-VL / Qwen3-VL-MoE ViT
CUDA graph ``sin_cos_ws`` use-after-free").
Symptom: with ``SGLANG_VIT_ENABLE_CUDA_GRAPH=1``, Qwen3-VL answers a fixed small-image canary request
correctly until a larger image has been served; after that the identical canary returns garbage (485/500
replies corrupted on Qwen3-VL-8B, 0/500 with the ViT graph off; sglang main, June-August 2026).
Mechanism: ``ViTCudaGraphRunner`` keys one graph per patch count ``S`` and feeds the rotary embeddings
through one shared workspace, ``self.sin_cos_ws``. ``create_graph`` calls ``_ensure_sin_cos_ws`` and
captures the blocks on views ``sin_cos_ws[i][:S]``; the graph keeps their address. A later, larger image
makes ``_ensure_sin_cos_ws`` allocate a bigger pair and drop the old one. Replaying a smaller graph then
copies the new image's cos/sin into the *new* workspace, while its kernels still read the old, freed
block: the vision tower applies stale (or reused) rotary tables.
Doctor: dangling-reference, at ``_ensure_sin_cos_ws`` (it releases the workspace whose address every
earlier graph captured).
Fix (upstream): keep each captured graph bound to the rotary workspace views it captured (held per
graph key), and copy a replay's cos/sin into those views, even after the shared workspace has grown.
"""
from __future__ import annotations

import math
from typing import Dict, Hashable, Optional, Tuple

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/37043"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "_ensure_sin_cos_ws"
SYMPTOM = "small-image canary answers garbage after a larger image regrew the ViT rotary workspace"
HIDDEN, HEAD_DIM, OUT_DIM = 4, 4, 3


class VisionBlock:
    def __init__(self, gen, device):
        self.wq, self.wk, self.wv = (randn(HIDDEN, HEAD_DIM, gen=gen, device=device, scale=0.5) for _ in range(3))
        self.proj = randn(HEAD_DIM, HIDDEN, gen=gen, device=device, scale=0.5)

    def forward(self, x, cu_seqlens, rotary_pos_emb_cos, rotary_pos_emb_sin):
        h = x[:, 0]
        q, k, v = h @ self.wq, h @ self.wk, h @ self.wv
        q = apply_rotary(q, rotary_pos_emb_cos, rotary_pos_emb_sin)
        k = apply_rotary(k, rotary_pos_emb_cos, rotary_pos_emb_sin)
        t = torch.arange(h.shape[0], device=h.device)
        seg = torch.searchsorted(cu_seqlens, t, right=True)
        scores = (q @ k.t() / math.sqrt(HEAD_DIM)).masked_fill(seg[:, None] != seg[None, :], float("-inf"))
        return x + (torch.softmax(scores, -1) @ v @ self.proj)[:, None]


def apply_rotary(x, cos, sin):
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat((-x2, x1), -1) * sin


class VisionTransformer:
    def __init__(self, device):
        gen = generator(37043)
        self.blocks = [VisionBlock(gen, device) for _ in range(2)]
        self.merger = randn(HIDDEN, OUT_DIM, gen=gen, device=device, scale=0.5)
        self.device = device
        self.dtype = torch.float32
        self.max_context_len = None

    def rot_pos_emb(self, grid_hw):
        """2-D rotary tables of an image of ``grid_hw`` patches: [S, HEAD_DIM] cos and sin."""
        h, w = grid_hw
        hpos = torch.arange(h).repeat_interleave(w).float()
        wpos = torch.arange(w).repeat(h).float()
        freqs = torch.stack((hpos * 0.7, wpos * 1.3), -1).repeat(1, HEAD_DIM // 2)
        return freqs.cos().to(self.device), freqs.sin().to(self.device)

    def forward_eager(self, x, cu_seqlens, cos, sin):
        y = x
        for blk in self.blocks:
            y = blk.forward(y, cu_seqlens, cos, sin)
        return y[:, 0] @ self.merger


class ViTCudaGraphRunner:
    """Captures the blocks + merger of the vision tower per graph key (the patch count)."""

    def __init__(self, vit: VisionTransformer, variant: str) -> None:
        self.vit = vit
        self.variant = variant
        self.block_input: Dict[Hashable, torch.Tensor] = {}
        self.block_graphs: Dict[Hashable, object] = {}
        self.block_output: Dict[Hashable, torch.Tensor] = {}
        self.cu_full_len: Dict[Hashable, torch.Tensor] = {}
        # rotary position buffers shared across graphs
        self.sin_cos_ws: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        self.max_context_len = getattr(vit, "max_context_len", None)
        # the fix: the workspace views each graph captured, by graph key
        self.graph_sin_cos_ws: Dict[Hashable, Tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def device(self):
        return self.vit.device

    @property
    def dtype(self):
        return self.vit.dtype

    def _ensure_sin_cos_ws(self, seq_len: int, head_dim: int):
        if self.sin_cos_ws is None:
            max_shape = self.max_context_len or seq_len
            max_shape = max(max_shape, seq_len)
            cos_ws = torch.empty(max_shape, head_dim, dtype=self.dtype, device=self.device)
            sin_ws = torch.empty(max_shape, head_dim, dtype=self.dtype, device=self.device)
            self.sin_cos_ws = (cos_ws, sin_ws)
        else:
            if self.sin_cos_ws[0].size(0) < seq_len:
                max_shape = max(self.sin_cos_ws[0].size(0) * 2, seq_len)
                cos_ws = torch.empty(max_shape, head_dim, dtype=self.dtype, device=self.device)
                sin_ws = torch.empty(max_shape, head_dim, dtype=self.dtype, device=self.device)
                self.sin_cos_ws = (cos_ws, sin_ws)

    def _rotary_ws(self, graph_key: int):
        if self.variant == "fix" and graph_key in self.graph_sin_cos_ws:
            return self.graph_sin_cos_ws[graph_key]
        return self.sin_cos_ws[0][:graph_key, :], self.sin_cos_ws[1][:graph_key, :]

    def _create_graph(self, graph_key: int):
        vit = self.vit

        def blocks_and_merger():
            rotary_pos_emb_cos, rotary_pos_emb_sin = self._rotary_ws(graph_key)
            y = self.block_input[graph_key]
            for blk in vit.blocks:
                y = blk.forward(y, self.cu_full_len[graph_key], rotary_pos_emb_cos, rotary_pos_emb_sin)
            return y[:, 0] @ vit.merger

        self.block_graphs[graph_key], self.block_output[graph_key] = capture(
            blocks_and_merger, device=self.device, name=f"vit S={graph_key}",
            static={"block_input": self.block_input[graph_key], "cu_seqlens": self.cu_full_len[graph_key]},
            owner="ViTCudaGraphRunner")

    def create_graph(self, x_3d, cu_seqlens, rotary_pos_emb_cos, rotary_pos_emb_sin) -> int:
        graph_key = x_3d.shape[0]
        if graph_key in self.block_graphs:
            return graph_key
        self.block_input[graph_key] = torch.empty_like(x_3d).contiguous()
        self.cu_full_len[graph_key] = cu_seqlens
        self.block_input[graph_key].copy_(x_3d)
        # make sure rotary workspace
        head_dim = rotary_pos_emb_cos.shape[1]
        self._ensure_sin_cos_ws(graph_key, head_dim)
        used_cos_ws = self.sin_cos_ws[0][:graph_key, :]
        used_sin_ws = self.sin_cos_ws[1][:graph_key, :]
        used_cos_ws.copy_(rotary_pos_emb_cos)
        used_sin_ws.copy_(rotary_pos_emb_sin)
        if self.variant == "fix":
            self.graph_sin_cos_ws[graph_key] = (used_cos_ws, used_sin_ws)
        self._create_graph(graph_key)
        return graph_key

    def replay(self, graph_key, x_3d, rotary_pos_emb_cos, rotary_pos_emb_sin):
        # update rotary workspace content
        head_dim = rotary_pos_emb_cos.shape[1]
        self._ensure_sin_cos_ws(graph_key, head_dim)
        used_cos_ws, used_sin_ws = self._rotary_ws(graph_key)
        used_cos_ws.copy_(rotary_pos_emb_cos)
        used_sin_ws.copy_(rotary_pos_emb_sin)
        # copy input
        self.block_input[graph_key].copy_(x_3d)
        return replay(self.block_graphs[graph_key], self.block_output[graph_key])

    def run(self, x, cu_seqlens, rotary_pos_emb_cos, rotary_pos_emb_sin):
        x_3d = x.unsqueeze(1)                                  # [S, 1, H]
        graph_key = self.create_graph(x_3d, cu_seqlens, rotary_pos_emb_cos, rotary_pos_emb_sin)
        return self.replay(graph_key, x_3d, rotary_pos_emb_cos, rotary_pos_emb_sin)


def run(variant: str, device: str = "cpu"):
    vit = VisionTransformer(device)
    gen = torch.Generator().manual_seed(3)
    # (grid_h, grid_w): canary 2x3, larger image 4x4, then another 6-patch image 3x2 and the canary again
    images = [(2, 3), (4, 4), (3, 2), (2, 3)]
    pixels = [torch.randn(h * w, HIDDEN, generator=gen).to(device) for h, w in images]

    def serve(graphed: bool):
        runner = ViTCudaGraphRunner(vit, variant) if graphed else None
        outs = []
        for grid, x in zip(images, pixels):
            cos, sin = vit.rot_pos_emb(grid)
            cu_seqlens = torch.tensor([0, x.shape[0]], device=device)
            if graphed:
                outs.append(runner.run(x, cu_seqlens, cos, sin).clone())
            else:
                outs.append(vit.forward_eager(x.unsqueeze(1), cu_seqlens, cos, sin))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
