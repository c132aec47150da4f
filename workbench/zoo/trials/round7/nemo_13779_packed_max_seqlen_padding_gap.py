"""Packed batches padded for CUDA graphs: the constant ``max_seqlen`` is shorter than the padding sequence.

Upstream: https://github.com/NVIDIA/NeMo/pull/13779 ("fix: improve sequence length handling to fix nan in
loss when turning on cudagraph", commit 2d984b3c05).
Symptom: SFT on packed sequences with Megatron/TE CUDA graphs (``pad_cu_seqlens=True``) gives NaN losses
(and then NaN gradients) on some micro-batches; the same run without CUDA graphs is finite (NeMo 2.x,
June 2025).
Mechanism: for CUDA graphs every micro-batch must have the same shapes and launch arguments, so
``GPTSFTPackedDataset.collate_fn`` pads each pack to ``max_length``, appends the padding tail to
``cu_seqlens`` as one more sequence, pads ``cu_seqlens`` to a fixed count, and replaces the per-batch
``max_seqlen`` by one global value, the dataset's longest *real* sequence, which the graphs bake in as the
attention kernel's launch argument. A pack much shorter than ``max_length`` has a padding sequence longer
than that value: the varlen attention grid covers ``max_seqlen`` query rows per sequence, so the padding
sequence's later rows are never written and keep whatever the output buffer held (NaN here). The loss masks
padding tokens by multiplying with ``loss_mask``, and ``NaN * 0`` is NaN.
Doctor: undersized-buffer, at ``collate_fn`` (the constant ``max_seqlen`` smaller than a sequence of the
padded batch).
Fix (upstream): record ``min_packed_seqlen`` in the packing metadata and use
``max(dataset_max_seqlen, max_length - min_packed_seqlen)``, still one constant for every batch.
"""
from __future__ import annotations

import math

import torch

from workbench.engine import CUDAGraphMode, GraphManager
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/NVIDIA/NeMo/pull/13779"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "collate_fn"
SYMPTOM = "NaN loss on packs whose padding sequence is longer than the graphs' constant max_seqlen"
VOCAB, DIM, MAX_LENGTH = 8, 4, 12
PACKS = [[4, 4, 3], [3, 2], [4, 3, 4]]          # sequence lengths per pack (the packing strategy's bins)


def pack_metadata():
    """``create_packing_strategy``'s metadata (``min_packed_seqlen`` is what the fix adds)."""
    packed = [sum(p) for p in PACKS]
    return [{"dataset_max_seqlen": max(max(p) for p in PACKS), "max_samples_per_bin": max(len(p) for p in PACKS),
             "pack_size": MAX_LENGTH, "min_packed_seqlen": min(packed)}]


class GPTSFTPackedDataset:
    def __init__(self, packs, pad_cu_seqlens: bool, variant: str):
        self.packs = packs
        self.pad_cu_seqlens = pad_cu_seqlens
        self.pack_metadata = pack_metadata()
        self.variant = variant

    def collate_fn(self, item):
        input_ids, labels, seqlens = item
        max_length = MAX_LENGTH                                   # pad_to_max_length
        position_ids, cu_seqlens = [], [0]
        for length in seqlens:
            position_ids.extend(range(length))
            cu_seqlens.append(cu_seqlens[-1] + length)
        if cu_seqlens[-1] != max_length:                          # the padding tail is one more sequence
            cu_seqlens.append(max_length)
        if self.pad_cu_seqlens:
            # pad cu_seqlens to a constant shape with zero length sequences
            max_samples_per_bin = max(p["max_samples_per_bin"] for p in self.pack_metadata)
            pad_num = max_samples_per_bin - len(cu_seqlens) + 2
            cu_seqlens.extend([max_length] * pad_num)
        pad = max_length - len(input_ids)
        tokens = input_ids + [0] * pad                            # eos_id
        loss_mask = [1] * len(input_ids) + [0] * pad
        if self.pad_cu_seqlens:
            # If padding, use the global max seqlen, so that 'pad_cu_seqlens' is the same across all
            # batches (Megatron's CUDA graphs use the same graphs over all batches).
            dataset_max_seqlen = max(p["dataset_max_seqlen"] for p in self.pack_metadata)
            if self.variant == "bug":
                max_seqlen = dataset_max_seqlen
            else:
                min_pack_seq_len = min(p["min_packed_seqlen"] for p in self.pack_metadata)
                padding_gap = max_length - min_pack_seq_len
                max_seqlen = max(dataset_max_seqlen, padding_gap)
        else:
            max_seqlen = max(b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]))
        return {"tokens": torch.tensor(tokens), "labels": torch.tensor(labels + [0] * pad),
                "loss_mask": torch.tensor(loss_mask, dtype=torch.float32),
                "position_ids": torch.tensor(position_ids + [0] * pad),
                "cu_seqlens": torch.tensor(cu_seqlens), "max_seqlen": max_seqlen}


class GPTModel:
    def __init__(self, device):
        gen = generator(13779)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos = randn(MAX_LENGTH, DIM, gen=gen, device=device, scale=0.5)
        self.wq, self.wk, self.wv = (randn(DIM, DIM, gen=gen, device=device, scale=0.5) for _ in range(3))
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)


def flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen: int):
    """Causal varlen attention over the sequences of ``cu_seqlens``. The grid covers ``max_seqlen`` query
    rows per sequence; rows past it are never written and keep what the output buffer held."""
    t = torch.arange(q.shape[0], device=q.device)
    seq = torch.searchsorted(cu_seqlens, t, right=True) - 1
    pos = t - cu_seqlens[seq]
    allowed = (seq[:, None] == seq[None, :]) & (t[None, :] <= t[:, None])
    scores = (q @ k.t() / math.sqrt(q.shape[-1])).masked_fill(~allowed, float("-inf"))
    computed = torch.softmax(scores, -1) @ v
    out = torch.empty_like(q)
    return torch.where((pos < max_seqlen)[:, None], computed, out)


def forward_step(model, tokens, labels, position_ids, cu_seqlens, max_seqlen: int):
    """One packed micro-batch through attention and the LM head: the per-token losses (the graphed part)."""
    h = model.emb[tokens] + model.pos[position_ids]
    core_attn_out = flash_attn_varlen_func(h @ model.wq, h @ model.wk, h @ model.wv, cu_seqlens, max_seqlen)
    logits = (h + core_attn_out) @ model.lm_head
    return torch.nn.functional.cross_entropy(logits, labels, reduction="none")


def loss_func(loss_mask, output_tensor):
    """The schedule's loss function (eager, after the graphs): padding tokens are masked by a multiply."""
    losses = output_tensor.float()
    return torch.sum(losses.view(-1) * loss_mask) / loss_mask.sum()


def run(variant: str, device: str = "cpu"):
    model = GPTModel(device)
    gen = torch.Generator().manual_seed(2)
    items = []
    for seqlens in PACKS:
        n = sum(seqlens)
        items.append((torch.randint(1, VOCAB, (n,), generator=gen).tolist(),
                      torch.randint(0, VOCAB, (n,), generator=gen).tolist(), seqlens))

    def eager():
        ds = GPTSFTPackedDataset(PACKS, pad_cu_seqlens=False, variant=variant)
        outs = []
        for item in items:
            b = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in ds.collate_fn(item).items()}
            losses = forward_step(model, b["tokens"], b["labels"], b["position_ids"], b["cu_seqlens"],
                                  b["max_seqlen"])
            outs.append(loss_func(b["loss_mask"], losses))
        return outs

    def served():
        ds = GPTSFTPackedDataset(PACKS, pad_cu_seqlens=True, variant=variant)
        batches = [ds.collate_fn(item) for item in items]
        first = batches[0]
        bufs = {k: first[k].clone().to(device) for k in ("tokens", "labels", "position_ids", "cu_seqlens")}
        max_seqlen = first["max_seqlen"]                       # a launch argument: baked into the graphs

        def forward(size):
            return forward_step(model, bufs["tokens"][:size], bufs["labels"][:size], bufs["position_ids"][:size],
                                bufs["cu_seqlens"], max_seqlen)

        manager = GraphManager(forward, [MAX_LENGTH], device=device, mode=CUDAGraphMode.FULL, num_warmups=1,
                               static_buffers=bufs, name="TE graphed layers (packed SFT)")
        manager.capture()
        outs = []
        for b in batches:
            for k in bufs:
                bufs[k].copy_(b[k])
            losses = manager.replay(MAX_LENGTH, MAX_LENGTH)
            outs.append(loss_func(b["loss_mask"].to(device), losses))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
