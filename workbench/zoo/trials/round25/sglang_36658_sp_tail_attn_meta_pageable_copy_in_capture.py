"""An SP-sharded diffusion DiT builds its tail-pad varlen metadata from a Python list inside the graph capture.

Upstream: https://github.com/sgl-project/sglang/pull/36658 ("[multimodal_gen] fix: make tail_attn_meta CUDA-graph
capturable").
Symptom: a sequence-parallel (Ulysses) diffusion run whose text stream does not divide by the SP size (e.g.
``--ulysses-degree 3`` with Klein's fixed 512-token text) fails to capture its breakable CUDA graph:
``RuntimeError: Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor is
pinned``; the runner then drops that signature to eager (sglang main, August 2026; latent for the default
power-of-two SP sizes).
Mechanism: ``sp_shard_utils`` shards the joint-attention text stream evenly over the SP ranks with the padding at
the end of the last rank's chunk (``plan_shard`` / ``shard_like``), relocates each rank's pad rows behind its image
rows (``join_seqs``), so that after the Ulysses gather the pad is one block at the global tail. ``tail_attn_meta``
then describes each batch row as two varlen segments, ``[valid | pad]``, for USPAttention's varlen flash
attention: it built ``row = torch.tensor([valid, shard.num_pad], dtype=torch.int32, device=device)`` and cumsummed
its repeats into ``cu_seqlens_tail``. ``torch.tensor`` of a Python list on a CUDA device stages the list in
pageable host memory and copies it to the device. The DiT forwards (``flux_2.py``, ``qwen_image.py``, ``mova.py``)
call ``tail_attn_meta`` on every forward, inside the region the breakable CUDA graph captures; a capturing stream
refuses that copy, so the capture aborts. Eagerly the same copy is merely a synchronous upload.
Doctor: sync-in-capture, at ``tail_attn_meta`` (a pageable host-to-device copy of Python data inside the capture).
Fix (upstream): build ``cu_seqlens_tail`` from device-side ``arange`` arithmetic (the same values) instead of a
host-staged ``torch.tensor``; a regression test captures ``tail_attn_meta`` in a CUDA graph.
(Read: the #36658 description and the pre-fix ``sp_shard_utils.py``; not the #36658 diff itself, so the
arithmetic of the fixed ``tail_attn_meta`` is this program's. The SP group's ranks run in one process here: the
Ulysses all-to-all is a concatenation of the ranks' sequence chunks (all heads on every "rank"), and the varlen
flash attention is a segment-masked softmax. The breakable graph is reduced to one captured segment around the
whole DiT block, and the runner's fallback to eager on a failed capture is left out: the served run reports the
capture error that fallback swallows.)
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/36658"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "tail_attn_meta"
SYMPTOM = "breakable CUDA graph capture of an SP DiT forward aborts: pageable H2D copy of cu_seqlens_tail"

SP_SIZE = 3                     # --ulysses-degree 3
TXT_LEN, IMG_LEN = 4, 6         # text tokens (not a multiple of SP_SIZE) and image tokens (a multiple)
BATCH, DIM, HEADS = 2, 8, 2
HEAD_DIM = DIM // HEADS
NUM_INFERENCE_STEPS = 3


@dataclasses.dataclass(frozen=True)
class SpShard:
    """Facts of one tail-padded even shard, shared by tensors of that stream."""

    orig_len: int
    local_len: int
    num_pad: int
    sp_size: int
    sp_rank: int

    @property
    def local_pad(self) -> int:
        return self.num_pad if self.sp_rank == self.sp_size - 1 else 0


def plan_shard(seq_len: int, sp_size: int, sp_rank: int) -> SpShard:
    local_len = (seq_len + sp_size - 1) // sp_size
    return SpShard(seq_len, local_len, local_len * sp_size - seq_len, sp_size, sp_rank)


def shard_like(x, shard: SpShard, dim: int = 1):
    if shard.num_pad > 0:
        pads = [0, 0] * (x.dim() - 1 - dim) + [0, shard.num_pad]
        x = F.pad(x, pads)
    return x.narrow(dim, shard.sp_rank * shard.local_len, shard.local_len)


def join_seqs(prefix, body, local_pad: int, dim: int = 1):
    """``[prefix, body]`` with the prefix's pad rows moved behind the body (so the gathered pad is one tail block)."""
    if local_pad > 0:
        real = prefix.shape[dim] - local_pad
        return torch.cat([prefix.narrow(dim, 0, real), body, prefix.narrow(dim, real, local_pad)], dim=dim)
    return torch.cat([prefix, body], dim=dim)


def split_seqs(joint, prefix_len: int, local_pad: int, dim: int = 1):
    total = joint.shape[dim]
    if local_pad > 0:
        real = prefix_len - local_pad
        body_end = total - local_pad
        prefix = torch.cat([joint.narrow(dim, 0, real), joint.narrow(dim, body_end, local_pad)], dim=dim)
        return prefix, joint.narrow(dim, real, body_end - real)
    return joint.narrow(dim, 0, prefix_len), joint.narrow(dim, prefix_len, total - prefix_len)


def tail_attn_meta(shard: SpShard, batch_size: int, device, image_seq_len: int = 0, variant: str = "bug"):
    """Per-request attention meta for a tail-padded shard: ``cu_seqlens_tail`` splits each batch row into
    [valid | pad] varlen segments over the gathered layout."""
    if shard.sp_size <= 1 or shard.num_pad == 0:
        return None
    seq = shard.sp_size * (shard.local_len + image_seq_len)
    valid = seq - shard.num_pad
    if variant == "bug":
        row = torch.tensor([valid, shard.num_pad], dtype=torch.int32, device=device)
        seglens = row.repeat(batch_size)
        cu_seqlens = torch.zeros(2 * batch_size + 1, dtype=torch.int32, device=device)
        cu_seqlens[1:] = torch.cumsum(seglens, dim=0)
    else:
        # cu[2b] = b * seq, cu[2b + 1] = b * seq + valid: device arithmetic on an arange, no host data
        idx = torch.arange(2 * batch_size + 1, dtype=torch.int32, device=device)
        cu_seqlens = (idx // 2) * seq + (idx % 2) * valid
    return {"pad_start": valid, "pad_end": seq, "local_pad": shard.local_pad,
            "cu_seqlens_tail": cu_seqlens, "max_seqlen_tail": valid}


def flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen):
    """Varlen attention over packed [tokens, heads, head_dim]: a token attends only inside its segment."""
    tok = torch.arange(q.shape[0], device=q.device)
    seg = torch.bucketize(tok, cu_seqlens[1:].long(), right=True)
    same = seg[:, None] == seg[None, :]
    scores = torch.einsum("ihd,jhd->hij", q, k) / math.sqrt(q.shape[-1])
    probs = torch.softmax(scores.masked_fill(~same, float("-inf")), dim=-1)
    return torch.einsum("hij,jhd->ihd", probs, v)


class USPAttention:
    """Ulysses SP attention; the all-to-all is a concatenation of the ranks' chunks (one process)."""

    def __init__(self, gen, device):
        self.to_qkv = randn(DIM, 3 * DIM, gen=gen, device=device, scale=0.4)
        self.to_out = randn(DIM, DIM, gen=gen, device=device, scale=0.4)

    def forward(self, joint_locals, attn_meta):
        gathered = torch.cat(joint_locals, dim=1)                     # [B, seq, DIM]: pad block at the tail
        b, s, _ = gathered.shape
        q, k, v = (gathered @ self.to_qkv).view(b * s, 3, HEADS, HEAD_DIM).unbind(1)
        out = flash_attn_varlen_func(q, k, v, attn_meta["cu_seqlens_tail"], attn_meta["max_seqlen_tail"])
        out = out.reshape(b, s, DIM) @ self.to_out
        return list(out.chunk(len(joint_locals), dim=1))              # back to each rank's local layout


class QwenImageTransformer2DModel:
    """One dual-stream block of an MMDiT, with the text stream SP-sharded as in ``qwen_image.py``."""

    def __init__(self, device, variant):
        gen = generator(36658)
        self.device, self.variant = device, variant
        self.img_in = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
        self.txt_in = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
        self.time_proj = randn(DIM, gen=gen, device=device, scale=0.5)
        self.attn = USPAttention(gen, device)
        self.proj_out = randn(DIM, DIM, gen=gen, device=device, scale=0.5)

    def forward(self, hidden_states, encoder_hidden_states, timestep):
        img = hidden_states @ self.img_in + torch.sin(timestep[:, None, None] * self.time_proj)
        txt = encoder_hidden_states @ self.txt_in
        shards = [plan_shard(TXT_LEN, SP_SIZE, rank) for rank in range(SP_SIZE)]
        img_local_len = IMG_LEN // SP_SIZE
        attn_meta = [tail_attn_meta(shard, hidden_states.shape[0], self.device, img_local_len, self.variant)
                     for shard in shards]                             # each rank builds its own (same values)
        joint = [join_seqs(shard_like(txt, shard), img.narrow(1, shard.sp_rank * img_local_len, img_local_len),
                           shard.local_pad) for shard in shards]
        attn_out = self.attn.forward(joint, attn_meta[-1])
        img_out = torch.cat([split_seqs(out, shard.local_len, shard.local_pad)[1]
                             for out, shard in zip(attn_out, shards)], dim=1)      # gather_seq of the image
        return (img + img_out) @ self.proj_out


@dataclasses.dataclass
class _Entry:
    graph: object
    static: dict
    output: torch.Tensor


class BreakableCudaGraphRunner:
    """Captures the transformer once per input signature and replays it; the static leaves are refreshed
    in place before every replay, and the output is cloned."""

    def __init__(self, transformer, device):
        self.transformer, self.device = transformer, device
        self.entries: dict[tuple, _Entry] = {}

    def __call__(self, **kwargs):
        key = tuple((name, tuple(t.shape)) for name, t in sorted(kwargs.items()))
        if key not in self.entries:
            self.entries[key] = self._capture(kwargs)
        return self._replay(self.entries[key], kwargs)

    def _capture(self, kwargs):
        static = {name: t.clone() for name, t in kwargs.items()}
        graph, output = capture(lambda: self.transformer.forward(**static), device=self.device, warmups=1,
                                name="dit", owner="BreakableCudaGraphRunner", static=static)
        return _Entry(graph, static, output)

    def _replay(self, entry, kwargs):
        for name, buf in entry.static.items():
            buf.copy_(kwargs[name])
        return replay(entry.graph, entry.output).clone()


def run(variant: str, device: str = "cpu"):
    model = QwenImageTransformer2DModel(device, variant)
    gen = generator(1)
    prompt_embeds = randn(BATCH, TXT_LEN, DIM, gen=gen, device=device)
    init_latents = randn(BATCH, IMG_LEN, DIM, gen=gen, device=device)
    sigmas = [1.0, 0.66, 0.33, 0.0]

    def serve(graphed: bool):
        transformer = BreakableCudaGraphRunner(model, device) if graphed else model.forward
        latents = init_latents.clone()
        outs = []
        for i in range(NUM_INFERENCE_STEPS):
            timestep = torch.full((BATCH,), sigmas[i], device=device)
            noise_pred = transformer(hidden_states=latents, encoder_hidden_states=prompt_embeds,
                                     timestep=timestep)
            outs.append(noise_pred.clone())
            latents = latents + (sigmas[i + 1] - sigmas[i]) * noise_pred      # flow-matching Euler step
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
