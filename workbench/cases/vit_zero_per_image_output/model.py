"""A small Qwen3-VL vision encoder as vLLM runs it (``vllm/model_executor/models/qwen3_vl.py``).

* ``Qwen3_VisionPatchEmbed.forward``: ``x.view(L, -1, T, P, P)`` then a Conv3d with
  kernel = stride = ``(T, P, P)``. With ``L = 0`` the ``-1`` is ambiguous and the view raises
  ``cannot reshape tensor of 0 elements ...``: the crash every bug-variant capture of budget
  ``b < max_batch_size`` ends in.
* ``Qwen3_VisionTransformer``: ``prepare_encoder_metadata`` (interpolated position embeddings,
  2-D rotary cos/sin, ``cu_seqlens`` padded to ``max_batch_size`` sequences with its last value)
  and ``forward(x, encoder_metadata=...)``, which the graph manager captures with persistent
  metadata buffers. Output = merger tokens concatenated with the deepstack features.

The encoder has no variants: the bug and the fix live in the model's graph hooks and the graph
manager (``upstream``). Attention is dense and masked to each image by ``cu_seqlens`` (vLLM uses
flash-attention varlen kernels; this form has fixed shapes, so it captures on CUDA and on the CPU
emulation alike, and needs no ``max_seqlen``). The layer names match ``transformers``'
``Qwen3VLVisionModel``, so ``to_transformers`` loads the same weights there and the eager outputs
can be compared.
"""
from __future__ import annotations

import dataclasses
import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn

@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """Qwen3-VL vision tower shape: patch geometry as the checkpoint (16 px, 2 frames, merge 2),
    widths tiny so that CPU capture of every token budget takes seconds."""

    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    hidden_size: int = 32
    num_heads: int = 2
    depth: int = 2
    intermediate_size: int = 64
    out_hidden_size: int = 48
    num_position_embeddings: int = 256
    deepstack_visual_indexes: tuple[int, ...] = (0,)
    rope_theta: float = 10000.0

    @property
    def patch_dim(self) -> int:
        """Length of one flattened input patch (a row of ``pixel_values``)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def output_width(self) -> int:
        """Channels of one output token: the merger plus one block per deepstack layer."""
        return self.out_hidden_size * (1 + len(self.deepstack_visual_indexes))


def output_tokens(grid_thw: list[list[int]], merge: int) -> list[int]:
    """Tokens each image yields after the spatial merge: ``t * (h / m) * (w / m)``."""
    return [t * (h // merge) * (w // merge) for t, h, w in grid_thw]


class PatchEmbed(nn.Module):
    """``Qwen3_VisionPatchEmbed``: one Conv3d over each (T, P, P) patch."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.patch_size = cfg.patch_size
        self.temporal_patch_size = cfg.temporal_patch_size
        self.hidden_size = cfg.hidden_size
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=kernel, stride=kernel, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        L, _ = x.shape
        x = x.view(L, -1, self.temporal_patch_size, self.patch_size, self.patch_size)   # L == 0: crash
        return self.proj(x).view(L, self.hidden_size)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, same_image: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        L = x.shape[0]
        q, k, v = self.qkv(x).reshape(L, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))      # (1, heads, L, head_dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=same_image)
        return self.proj(out.squeeze(0).transpose(0, 1).reshape(L, -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, same_image: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), same_image, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Concatenates each merge x merge block of patches into one token (``patches / merge**2``)."""

    def __init__(self, cfg: VisionConfig, postshuffle_norm: bool) -> None:
        super().__init__()
        self.merged = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.merged if postshuffle_norm else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged, self.merged)
        self.linear_fc2 = nn.Linear(self.merged, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.merged) if self.postshuffle_norm else x).view(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionEncoder(nn.Module):
    """``Qwen3_VisionTransformer``: patches ``(L, patch_dim)`` -> tokens ``(L / merge**2, output_width)``."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        head_dim = cfg.hidden_size // cfg.num_heads
        if cfg.hidden_size % cfg.num_heads or head_dim % 4:
            raise ValueError(f"hidden_size {cfg.hidden_size} / num_heads {cfg.num_heads} must give a head "
                             "dimension divisible by 4 (2-D rotary over height and width)")
        side = math.isqrt(cfg.num_position_embeddings)
        if side * side != cfg.num_position_embeddings:
            raise ValueError(f"num_position_embeddings must be a square, got {cfg.num_position_embeddings}")
        self.config = cfg
        self.spatial_merge_size = cfg.spatial_merge_size
        self.num_grid_per_side = side
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        rotary_dim = head_dim // 2
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, postshuffle_norm=False)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(cfg, postshuffle_norm=True) for _ in cfg.deepstack_visual_indexes)

    @property
    def device(self) -> torch.device:
        return self.pos_embed.weight.device

    # ------------------------------------------------------------- metadata
    def _pos_embeds(self, t: int, h: int, w: int) -> torch.Tensor:
        """Bilinear resampling of the learned square position grid to ``h x w`` (align_corners),
        in merge-block order, repeated for ``t`` frames."""
        side, m, dev = self.num_grid_per_side, self.spatial_merge_size, self.device
        hs = torch.linspace(0, side - 1, h, device=dev)
        ws = torch.linspace(0, side - 1, w, device=dev)
        h0, w0 = hs.floor().long(), ws.floor().long()
        h1, w1 = (h0 + 1).clamp(max=side - 1), (w0 + 1).clamp(max=side - 1)
        dh, dw = (hs - h0)[:, None], (ws - w0)[None, :]
        corners = [(h0, w0, (1 - dh) * (1 - dw)), (h0, w1, (1 - dh) * dw),
                   (h1, w0, dh * (1 - dw)), (h1, w1, dh * dw)]
        emb = sum(self.pos_embed((hi[:, None] * side + wi[None, :]).flatten()) * wt.flatten()[:, None]
                  for hi, wi, wt in corners)
        emb = emb.view(h // m, m, w // m, m, self.config.hidden_size).permute(0, 2, 1, 3, 4)
        emb = emb.reshape(h * w, self.config.hidden_size)
        return emb.repeat(t, 1)

    def _rotary_positions(self, t: int, h: int, w: int) -> torch.Tensor:
        """(row, column) of every patch, in merge-block order: ``(t*h*w, 2)``."""
        m = self.spatial_merge_size
        rows = torch.arange(h)[:, None].expand(h, w)
        cols = torch.arange(w)[None, :].expand(h, w)
        pos = [p.reshape(h // m, m, w // m, m).permute(0, 2, 1, 3).flatten() for p in (rows, cols)]
        return torch.stack(pos, dim=-1).repeat(t, 1)

    def prepare_encoder_metadata(self, grid_thw: list[list[int]], *,
                                 max_batch_size: int | None = None) -> dict[str, torch.Tensor]:
        """Per-batch tensors the forward reads: eager computes them inline; the graph manager
        copies them into the persistent buffers its graphs were captured with.

        ``cu_seqlens`` holds one boundary per frame; with ``max_batch_size`` it is padded with its
        last value to ``max_batch_size`` sequences, so its length is the same at capture and at
        every replay (the extra sequences are empty).
        """
        dev = self.device
        pos_embeds = torch.cat([self._pos_embeds(t, h, w) for t, h, w in grid_thw])
        positions = torch.cat([self._rotary_positions(t, h, w) for t, h, w in grid_thw]).to(dev)
        freqs = positions[..., None].float() * self.inv_freq            # (L, 2, head_dim / 4)
        lengths = [h * w for t, h, w in grid_thw for _ in range(t)]
        if max_batch_size is not None and len(lengths) < max_batch_size:
            lengths += [0] * (max_batch_size - len(lengths))
        cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=dev)
        return {"pos_embeds": pos_embeds, "rotary_pos_emb_cos": freqs.cos().flatten(1),
                "rotary_pos_emb_sin": freqs.sin().flatten(1), "cu_seqlens": cu_seqlens}

    # -------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor, grid_thw: list[list[int]] | None = None, *,
                encoder_metadata: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        if encoder_metadata is None:
            if grid_thw is None:
                raise ValueError("give grid_thw (eager) or encoder_metadata (graph capture/replay)")
            encoder_metadata = self.prepare_encoder_metadata(grid_thw)
        hidden = self.patch_embed(x.to(self.pos_embed.weight.dtype))
        hidden = hidden + encoder_metadata["pos_embeds"]
        cos = torch.cat([encoder_metadata["rotary_pos_emb_cos"]] * 2, dim=-1).unsqueeze(-2)
        sin = torch.cat([encoder_metadata["rotary_pos_emb_sin"]] * 2, dim=-1).unsqueeze(-2)
        same_image = _same_sequence_mask(encoder_metadata["cu_seqlens"], hidden.shape[0])
        deepstack = []
        for i, block in enumerate(self.blocks):
            hidden = block(hidden, same_image, cos, sin)
            if i in self.config.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[self.config.deepstack_visual_indexes.index(i)]
                deepstack.append(merger(hidden))
        return torch.cat([self.merger(hidden), *deepstack], dim=1)


def _same_sequence_mask(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """``mask[i, j]``: patches i and j belong to the same image (frame). Patches past the last
    boundary (a graph's unused rows) form one extra block of their own, so real rows never see
    them. Fixed shapes, no host sync: capturable."""
    rows = torch.arange(length, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    seq = torch.searchsorted(cu_seqlens, rows, right=True)
    return seq[:, None] == seq[None, :]


def build_encoder(cfg: VisionConfig = VisionConfig(), *, seed: int = 0, device: str = "cpu") -> VisionEncoder:
    """A ``VisionEncoder`` with seeded weights (same on every device), in eval mode."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        visual = VisionEncoder(cfg)
        for name, p in visual.named_parameters():       # non-trivial norms so the comparison bites
            if "norm" in name:
                with torch.no_grad():
                    p.add_(0.1 * torch.randn_like(p))
    return visual.to(device).eval()


def to_transformers(visual: VisionEncoder):
    """``transformers``' ``Qwen3VLVisionModel`` with the same configuration and weights (CPU)."""
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    c = visual.config
    hf_cfg = Qwen3VLVisionConfig(
        depth=c.depth, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_heads=c.num_heads, in_channels=c.in_channels, patch_size=c.patch_size,
        spatial_merge_size=c.spatial_merge_size, temporal_patch_size=c.temporal_patch_size,
        out_hidden_size=c.out_hidden_size, num_position_embeddings=c.num_position_embeddings,
        deepstack_visual_indexes=list(c.deepstack_visual_indexes), hidden_act="gelu_pytorch_tanh",
        rope_parameters={"rope_type": "axial", "rope_theta": c.rope_theta})
    hf_cfg._attn_implementation = "sdpa"
    hf = Qwen3VLVisionModel(hf_cfg).eval()
    hf.load_state_dict({k: v.detach().cpu() for k, v in visual.state_dict().items()}, strict=True)
    return hf


def transformers_output(hf, pixel_values: torch.Tensor, grid_thw: list[list[int]]) -> torch.Tensor:
    """The same ``(tokens, output_width)`` layout vLLM's forward returns: merger + deepstack."""
    out = hf(pixel_values.cpu(), grid_thw=torch.tensor(grid_thw))
    return torch.cat([out.pooler_output, *out.deepstack_features], dim=1)
