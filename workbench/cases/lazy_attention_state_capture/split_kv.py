"""Split-KV decode attention with a lazily planned schedule, and a small GPT-2-style LM that uses it.

Upstream (vLLM 0.20.2 / 0.22.0, ``vllm/third_party/flashmla/flash_mla_interface.py``): FlashMLA's
decode kernel takes a ``FlashMLASchedMeta``. ``get_mla_metadata()`` returns it *empty*; the first
``flash_mla_with_kvcache`` call that sees ``tile_scheduler_metadata is None`` runs a planner kernel
that partitions every request's KV range into splits from the *current* sequence lengths, stores
the plan in the object, and every later call with the same object skips planning and reuses it.
The docstring allows reuse "only when ... the values of cache_seqlens ... remain the same".

This module reproduces that contract at a size a CPU can run:

* ``plan_splits``: the planner. Pure tensor ops on the lengths' device, no host sync, so a graph
  capture *can* record it (it only does when it runs inside the capture).
* ``SplitKVSchedule``: the lazily filled metadata object (``FlashMLASchedMeta``).
* ``split_kv_attention``: flash-decoding: each split computes a partial softmax (its max, sum
  and normalised output), a combine step merges the splits by log-sum-exp. If the schedule is
  empty it plans first (``if schedule.split_bounds is None``): the lazy branch.
* ``SplitKVLM``: a GPT-2 architecture (so ``transformers.GPT2LMHeadModel`` is the eager
  reference, see ``to_transformers``). Training and prefill use ordinary causal attention over the
  whole sequence; decode runs one token per request through ``split_kv_attention`` over a KV cache.
  ``decode_step`` takes the attention as a callable so a capture manager can run it inside one
  graph (FULL) or eagerly between graphs of the other layers (PIECEWISE).

The bug of vLLM #42444 is not in this file: the model is correct as long as each step gets a fresh
(empty) schedule. The capture manager in ``upstream.py`` beside this file decides that.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


# ----------------------------------------------------------------------------------------- planner
def plan_splits(seq_lens: torch.Tensor, *, block_size: int, max_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Partition each request's KV range ``[0, seq_len)`` into at most ``max_splits`` splits.

    The range is cut into tiles of ``block_size`` positions; the tiles are spread as evenly as
    possible over ``num_splits = clamp(#tiles, 1, max_splits)`` splits. Returns
    ``split_bounds[b, s]`` (``max_splits + 1`` boundaries per request: split ``s`` covers positions
    ``[bounds[s], bounds[s+1])``; unused splits are empty) and ``num_splits[b]``, both int64.

    Only fixed-shape tensor ops: no ``.item()``, no data-dependent shapes. That is what lets a CUDA
    graph record the planner, and what makes a recorded planner re-plan on every replay.
    """
    lens = seq_lens.to(torch.int64)
    tiles = torch.div(lens + (block_size - 1), block_size, rounding_mode="floor")
    num_splits = tiles.clamp(1, max_splits)
    split_index = torch.arange(max_splits + 1, device=lens.device)
    tile_bounds = torch.minimum(torch.div(tiles[:, None] * split_index, num_splits[:, None],
                                          rounding_mode="floor"), tiles[:, None])
    split_bounds = torch.minimum(tile_bounds * block_size, lens[:, None])
    return split_bounds, num_splits


@dataclasses.dataclass
class SplitKVSchedule:
    """The scheduling metadata of one decode step (FlashMLA's ``FlashMLASchedMeta``).

    Created empty; filled by the first ``split_kv_attention`` call that uses it. Reusing a filled
    schedule is only correct while the sequence lengths stay the ones it was planned for.
    """

    config: tuple[int, int, int] | None = None      # (batch, block_size, max_splits), set on first use
    split_bounds: torch.Tensor | None = None        # (batch, max_splits + 1) int64
    num_splits: torch.Tensor | None = None          # (batch,) int64

    @property
    def have_initialized(self) -> bool:
        return self.config is not None


def empty_schedule() -> SplitKVSchedule:
    """An empty schedule, planned on first use (``get_mla_metadata()`` upstream)."""
    return SplitKVSchedule()


# --------------------------------------------------------------------------------------- attention
def split_kv_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                       schedule: SplitKVSchedule, *, block_size: int, max_splits: int) -> torch.Tensor:
    """Decode attention of one query per request over its cached keys, split-KV style.

    ``q``: (batch, heads, head_dim); ``k_cache``/``v_cache``: (batch, capacity, heads, head_dim);
    ``seq_lens``: (batch,) valid cache positions per request. The positions read are exactly those
    the schedule's splits cover: a stale schedule reads the wrong ones. A request whose splits are
    all empty gets a zero output.
    """
    batch = q.shape[0]
    config = (batch, block_size, max_splits)
    if not schedule.have_initialized:
        schedule.config = config
    elif schedule.config != config:
        raise ValueError(f"schedule was planned for (batch, block_size, max_splits)={schedule.config}, "
                         f"reused with {config}: create a fresh one with empty_schedule()")
    if schedule.split_bounds is None:
        # The lazy branch (FlashMLA: ``tile_scheduler_metadata is None`` -> run the planner kernel).
        schedule.split_bounds, schedule.num_splits = plan_splits(seq_lens, block_size=block_size,
                                                                 max_splits=max_splits)
    partial_out, partial_lse = _split_partials(q, k_cache, v_cache, schedule.split_bounds)
    return _combine_splits(partial_out, partial_lse, schedule.num_splits)


def _split_partials(q, k_cache, v_cache, split_bounds):
    """Phase 1 of flash-decoding: per split, the normalised output and the log-sum-exp of scores."""
    capacity = k_cache.shape[1]
    scores = torch.einsum("bhd,bthd->bht", q, k_cache) * (1.0 / math.sqrt(q.shape[-1]))
    pos = torch.arange(capacity, device=q.device)
    in_split = (pos >= split_bounds[:, :-1, None]) & (pos < split_bounds[:, 1:, None])   # (b, s, t)
    split_scores = torch.where(in_split[:, :, None, :], scores[:, None], float("-inf"))  # (b, s, h, t)
    row_max = split_scores.amax(dim=-1)
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
    weights = torch.exp(split_scores - row_max[..., None])
    total = weights.sum(dim=-1)                                                           # (b, s, h)
    out = torch.einsum("bsht,bthd->bshd", weights, v_cache) / total.clamp_min(1e-30)[..., None]
    lse = torch.where(total > 0, row_max + torch.log(total.clamp_min(1e-30)), float("-inf"))
    return out, lse


def _combine_splits(partial_out, partial_lse, num_splits):
    """Phase 2: merge the first ``num_splits`` splits of each request by log-sum-exp weights."""
    split_index = torch.arange(partial_lse.shape[1], device=partial_lse.device)
    used = (split_index[None, :] < num_splits[:, None])[..., None]                      # (b, s, 1)
    lse = torch.where(used, partial_lse, float("-inf"))
    lse_max = lse.amax(dim=1, keepdim=True)
    lse_max = torch.where(torch.isfinite(lse_max), lse_max, 0.0)
    scale = torch.exp(lse - lse_max)                                                      # (b, s, h)
    norm = scale.sum(dim=1).clamp_min(1e-30)                                              # (b, h)
    return torch.einsum("bsh,bshd->bhd", scale, partial_out) / norm[..., None]


def reference_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        seq_lens: torch.Tensor) -> torch.Tensor:
    """Plain softmax attention of one query per request over cache positions ``[0, seq_len)``."""
    scores = torch.einsum("bhd,bthd->bht", q, k_cache) / math.sqrt(q.shape[-1])
    valid = torch.arange(k_cache.shape[1], device=q.device)[None, :] < seq_lens[:, None]
    probs = torch.softmax(scores.masked_fill(~valid[:, None, :], float("-inf")), dim=-1)
    return torch.einsum("bht,bthd->bhd", probs, v_cache)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Full-sequence causal attention, (batch, time, heads, head_dim) in and out (training, prefill)."""
    t = q.shape[1]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


# -------------------------------------------------------------------------------------------- model
@dataclasses.dataclass(frozen=True)
class LMConfig:
    vocab_size: int
    max_len: int = 16          # positions (and KV-cache capacity per request)
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int = 256
    block_size: int = 4        # KV positions per planner tile
    max_splits: int = 4        # splits per request, at most

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        for name in ("vocab_size", "max_len", "d_model", "n_heads", "n_layers", "d_ff", "block_size", "max_splits"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class Block(nn.Module):
    """A GPT-2 block (pre-LayerNorm), split at the attention so decode can run it in pieces."""

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.ln_1 = nn.LayerNorm(cfg.d_model, eps=1e-5)
        self.c_attn = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln_2 = nn.LayerNorm(cfg.d_model, eps=1e-5)
        self.c_fc = nn.Linear(cfg.d_model, cfg.d_ff)
        self.mlp_proj = nn.Linear(cfg.d_ff, cfg.d_model)

    def qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(..., d_model) -> q, k, v each (..., heads, head_dim)."""
        x = self.c_attn(self.ln_1(h))
        x = x.unflatten(-1, (3, self.cfg.n_heads, self.cfg.head_dim))
        return x.select(-3, 0), x.select(-3, 1), x.select(-3, 2)

    def finish(self, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual after attention (``attn``: (..., heads, head_dim)), then the MLP."""
        h = h + self.c_proj(attn.flatten(-2))
        return h + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(h)), approximate="tanh"))


Attention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class SplitKVLM(nn.Module):
    """GPT-2 decoder LM (learned positions, tied embeddings) with a split-KV decode path."""

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.max_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=1e-5)
        for p in self.parameters():            # GPT-2 initialisation
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)
            else:
                nn.init.zeros_(p)
        for block in self.blocks:
            nn.init.ones_(block.ln_1.weight)
            nn.init.ones_(block.ln_2.weight)
        nn.init.ones_(self.ln_f.weight)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.ln_f(h) @ self.wte.weight.T

    # -- full sequence: training and prefill
    def forward(self, tokens: torch.Tensor, kv_sink: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None
                ) -> torch.Tensor:
        """Logits (batch, time, vocab) with causal attention; ``kv_sink(layer, k, v)`` sees each
        layer's keys and values (batch, time, heads, head_dim), e.g. to fill a KV cache."""
        if tokens.shape[1] > self.cfg.max_len:
            raise ValueError(f"sequence of {tokens.shape[1]} tokens exceeds max_len={self.cfg.max_len}")
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.wte(tokens) + self.wpe(positions)
        for i, block in enumerate(self.blocks):
            q, k, v = block.qkv(h)
            if kv_sink is not None:
                kv_sink(i, k, v)
            h = block.finish(h, causal_attention(q, k, v))
        return self.head(h)

    # -- one token per request: decode
    def new_kv_cache(self, rows: int, device: str | torch.device = "cpu") -> torch.Tensor:
        """Zeroed cache (2, layers, rows, max_len, heads, head_dim): row ``r`` serves batch row ``r``."""
        c = self.cfg
        return torch.zeros(2, c.n_layers, rows, c.max_len, c.n_heads, c.head_dim, device=device)

    def decode_step(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attention) -> torch.Tensor:
        """Logits (batch, vocab) for one new token per request. ``attention(layer, q, k, v)`` stores
        k, v and attends; everything else in this function is what PIECEWISE mode captures."""
        h = self.wte(input_ids) + self.wpe(positions)
        q, k, v = self.blocks[0].qkv(h)
        for i, block in enumerate(self.blocks):
            h = block.finish(h, attention(i, q, k, v))
            if i + 1 < len(self.blocks):
                q, k, v = self.blocks[i + 1].qkv(h)
        return self.head(h)

    def cached_attention(self, kv_cache: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
                         schedule: SplitKVSchedule) -> Attention:
        """The decode attention op: write this token's k, v at ``positions``, then split-KV attention
        over ``[0, seq_lens)`` with ``schedule`` (shared by all layers of the step, as DeepSeek-V4
        shares one schedule per layer type: the first layer plans, the others reuse)."""
        def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            rows = torch.arange(q.shape[0], device=q.device)
            kv_cache[0, layer].index_put_((rows, positions), k)
            kv_cache[1, layer].index_put_((rows, positions), v)
            return split_kv_attention(q, kv_cache[0, layer, :q.shape[0]], kv_cache[1, layer, :q.shape[0]],
                                      seq_lens, schedule, block_size=self.cfg.block_size,
                                      max_splits=self.cfg.max_splits)
        return attention

    def prefill(self, tokens: torch.Tensor, lengths: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """Run right-padded prompts (batch, time); store k, v of positions ``< lengths`` in cache rows
        ``[0, batch)``; return the logits at each prompt's last token (batch, vocab)."""
        batch, t = tokens.shape
        valid = (torch.arange(t, device=tokens.device)[None, :] < lengths[:, None])[..., None, None]

        def store(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            for slot, new in ((0, k), (1, v)):
                dst = kv_cache[slot, layer, :batch, :t]
                dst.copy_(torch.where(valid, new, dst))

        logits = self.forward(tokens, kv_sink=store)
        return logits[torch.arange(batch, device=tokens.device), lengths - 1]


def to_transformers(model: SplitKVLM):
    """The same weights in ``transformers.GPT2LMHeadModel`` (eager attention, no dropout)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    c = model.cfg
    hf = GPT2LMHeadModel(GPT2Config(
        vocab_size=c.vocab_size, n_positions=c.max_len, n_embd=c.d_model, n_layer=c.n_layers,
        n_head=c.n_heads, n_inner=c.d_ff, activation_function="gelu_new", layer_norm_epsilon=1e-5,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None,
        tie_word_embeddings=True, attn_implementation="eager"))
    sd = {"transformer.wte.weight": model.wte.weight, "transformer.wpe.weight": model.wpe.weight,
          "transformer.ln_f.weight": model.ln_f.weight, "transformer.ln_f.bias": model.ln_f.bias}
    for i, b in enumerate(model.blocks):
        p = f"transformer.h.{i}."
        sd |= {p + "ln_1.weight": b.ln_1.weight, p + "ln_1.bias": b.ln_1.bias,
               p + "ln_2.weight": b.ln_2.weight, p + "ln_2.bias": b.ln_2.bias,
               # GPT-2's Conv1D stores (in, out): the transpose of nn.Linear's weight.
               p + "attn.c_attn.weight": b.c_attn.weight.T, p + "attn.c_attn.bias": b.c_attn.bias,
               p + "attn.c_proj.weight": b.c_proj.weight.T, p + "attn.c_proj.bias": b.c_proj.bias,
               p + "mlp.c_fc.weight": b.c_fc.weight.T, p + "mlp.c_fc.bias": b.c_fc.bias,
               p + "mlp.c_proj.weight": b.mlp_proj.weight.T, p + "mlp.c_proj.bias": b.mlp_proj.bias}
    missing, unexpected = hf.load_state_dict({k: v.detach().clone() for k, v in sd.items()}, strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]      # tied to wte
    if missing or unexpected:
        raise RuntimeError(f"weight mapping incomplete: missing={missing} unexpected={unexpected}")
    hf.tie_weights()
    return hf.eval()
