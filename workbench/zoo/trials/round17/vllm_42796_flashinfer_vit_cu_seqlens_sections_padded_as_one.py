"""Encoder CUDA graphs pad FlashInfer's packed ``[Q/K/O offsets][V offsets]`` cu_seqlens as one array.

Upstream: https://github.com/vllm-project/vllm/pull/42796 ("[MM][CG] Avoid over-padding Qwen2.5-VL encoder
cudagraph window metadata"), whose ``encoder_cudagraph.py`` change fixes how replay metadata is copied for
FlashInfer MM encoder attention, after https://github.com/vllm-project/vllm/pull/42787.
Symptom: a Qwen2.5-VL style ViT served with ``cudagraph_mm_encoder`` and the FlashInfer (cuDNN) encoder
attention gets wrong image embeddings whenever a batch of images falls into a smaller FlashInfer batch bucket
than the captured graph's ``max_batch_size`` (vLLM main, May 2026); eager encoder runs are fine.
Mechanism: for FlashInfer, ``MMEncoderAttention.maybe_recompute_cu_seqlens`` turns the token offsets of the
batch into one packed buffer: the Q/K/O element offsets and then the V element offsets (V is strided in the
fused qkv tensor), each section padded with ``add_padding_to_seqlens`` to a batch bucket. The encoder graph of
a token budget is captured with ``max_batch_size`` items, so its ``cu_seqlens`` buffer holds two sections of
``bucket(max_batch_size) + 1`` entries, and the captured kernel takes the V offsets from the second section.
At replay the manager copies the new metadata into the graph's buffers as every other ``cu*_seqlens``: the
packed array of a smaller batch (two sections of ``bucket(n) + 1``) at the front, the tail filled with its
last value. The V offsets land inside the Q/K/O section, and the V section holds the final offset: the
kernel reads wrong sequence boundaries and wrong V rows for the real images.
Doctor: padded-shape-mismatch, at ``_prepare_replay_buffers`` (metadata laid out for the real batch's bucket is
copied into a buffer laid out for the captured, padded batch).
Fix (upstream): for FlashInfer's packed ``cu*_seqlens``, copy and tail-pad the Q/K/O and the V sections
independently.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/42796"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "_prepare_replay_buffers"
SYMPTOM = "wrong ViT image embeddings under encoder CUDA graphs with FlashInfer attention for small image batches"
PATCH_DIM, HIDDEN = 3, 4
FLASHINFER_BATCH_BUCKETS = [2, 4]            # upstream [8, 16, 32, 64]; scaled with the tiny batch
TOKEN_BUDGET, MAX_BATCH_SIZE = 8, 4


def round_up(x, m):
    return (x + m - 1) // m * m


def add_padding_to_seqlens(seq: np.ndarray, batch_size: int, padding_value: int) -> np.ndarray:
    batch_size_padded = next((b for b in FLASHINFER_BATCH_BUCKETS if b >= batch_size),
                             round_up(batch_size, FLASHINFER_BATCH_BUCKETS[0]))
    if batch_size_padded == batch_size:
        return seq
    return np.concatenate([seq, np.full((batch_size_padded - batch_size,), padding_value, dtype=seq.dtype)])


def maybe_compute_seq_lens(cu_seqlens: np.ndarray, device) -> torch.Tensor:
    sequence_lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    sequence_lengths = add_padding_to_seqlens(sequence_lengths, len(sequence_lengths), 0)
    return torch.from_numpy(sequence_lengths).to(device)


def maybe_recompute_cu_seqlens(cu_seqlens: np.ndarray, hidden_size: int, tp_size: int, device) -> torch.Tensor:
    batch_size = len(cu_seqlens) - 1
    scale = hidden_size // tp_size
    cu_seqlens = cu_seqlens * scale
    cu_seqlens_qko = cu_seqlens
    cu_seqlens_v = cu_seqlens * 3
    cu_seqlens_qko = add_padding_to_seqlens(cu_seqlens_qko, batch_size, cu_seqlens_qko[-1])
    cu_seqlens_v = add_padding_to_seqlens(cu_seqlens_v, batch_size, cu_seqlens_v[-1])
    return torch.from_numpy(np.concatenate([cu_seqlens_qko, cu_seqlens_v])).to(device)


def vit_flashinfer_wrapper(q, k, v, cu_seqlens, sequence_lengths):
    """cuDNN batch prefill over ragged offsets: sequence ``i`` takes its Q/K/O rows from the first section of
    ``cu_seqlens`` (elements, stride ``HIDDEN``) and its V rows from the second (stride ``3 * HIDDEN``)."""
    batch_size = sequence_lengths.shape[0]
    cu_qko, cu_v = cu_seqlens[:batch_size + 1], cu_seqlens[batch_size + 1:]
    t = torch.arange(q.shape[0], device=q.device)
    scores = q @ k.t() / math.sqrt(HIDDEN)
    out = torch.zeros_like(q)
    for i in range(batch_size):
        start, end = cu_qko[i] // HIDDEN, cu_qko[i + 1] // HIDDEN
        v_start = cu_v[i] // (3 * HIDDEN)
        rows = (t >= start) & (t < end)
        s = scores.masked_fill(~(rows[:, None] & rows[None, :]), float("-inf"))
        v_rows = v[(t - start + v_start).clamp(0, q.shape[0] - 1)]
        out = torch.where(rows[:, None], torch.softmax(s, -1).nan_to_num() @ v_rows, out)
    return out


class Qwen2_5_VisionTransformer:
    def __init__(self, device):
        gen = generator(42796)
        self.patch_embed = randn(PATCH_DIM, HIDDEN, gen=gen, device=device)
        self.qkv = randn(HIDDEN, 3 * HIDDEN, gen=gen, device=device, scale=0.7)
        self.proj = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.7)

    def prepare_encoder_metadata(self, grid, device):
        cu = np.concatenate([[0], np.cumsum(grid)]).astype(np.int64)
        return {"cu_seqlens": maybe_recompute_cu_seqlens(cu, HIDDEN, 1, device),
                "sequence_lengths": maybe_compute_seq_lens(cu, device)}

    def encoder_cudagraph_forward(self, values):
        x = values["pixel_values"] @ self.patch_embed
        qkv = (x @ self.qkv).view(-1, 3, HIDDEN)                      # fused qkv: V rows have stride 3 * HIDDEN
        attn = vit_flashinfer_wrapper(qkv[:, 0], qkv[:, 1], qkv[:, 2], values["cu_seqlens"],
                                      values["sequence_lengths"])
        return (x + attn) @ self.proj


class EncoderCudaGraphManager:
    def __init__(self, model, device, variant):
        self.model, self.device, self.variant = model, device, variant

    def capture(self):
        dummy = [TOKEN_BUDGET // MAX_BATCH_SIZE] * MAX_BATCH_SIZE
        values = {"pixel_values": torch.zeros(TOKEN_BUDGET, PATCH_DIM, device=self.device),
                  **self.model.prepare_encoder_metadata(dummy, self.device)}
        self.input_buffers = values
        self.graph, self.output_buffer = capture(lambda: self.model.encoder_cudagraph_forward(values),
                                                 device=self.device, static=values,
                                                 owner="EncoderCudaGraphManager (budget 8)")

    @staticmethod
    def _copy_padded_buffer(dst, src, pad_value):
        dst[: src.shape[0]].copy_(src)
        dst[src.shape[0]:].fill_(pad_value)

    def _prepare_replay_buffers(self, replay_values):
        for key, src in replay_values.items():
            dst = self.input_buffers[key]
            if key == "pixel_values" or key == "sequence_lengths":
                self._copy_padded_buffer(dst, src, 0)
            elif self.variant == "bug":
                # cu*_seqlens: one cumulative-offset array, padded by repeating its final offset
                self._copy_padded_buffer(dst, src, src[-1])
            else:
                # FlashInfer's packed [Q/K/O offsets][V offsets]: each section on its own
                dst_half, src_half = dst.shape[0] // 2, src.shape[0] // 2
                self._copy_padded_buffer(dst[:dst_half], src[:src_half], src[src_half - 1])
                self._copy_padded_buffer(dst[dst_half:], src[src_half:], src[-1])

    def execute(self, pixel_values, grid):
        replay_values = {"pixel_values": pixel_values, **self.model.prepare_encoder_metadata(grid, self.device)}
        self._prepare_replay_buffers(replay_values)
        n = pixel_values.shape[0]
        return replay(self.graph, self.output_buffer, real=n, size=TOKEN_BUDGET)[:n]


def run(variant: str, device: str = "cpu"):
    model = Qwen2_5_VisionTransformer(device)
    gen = generator(7)
    batches = [[3, 2], [2, 2, 1], [1, 2, 2, 3]]                  # patches per image, each batch within the budget
    pixels = [randn(sum(g), PATCH_DIM, gen=gen, device=device) for g in batches]

    def eager():
        return [model.encoder_cudagraph_forward({"pixel_values": p, **model.prepare_encoder_metadata(g, device)})
                for p, g in zip(pixels, batches)]

    def served():
        manager = EncoderCudaGraphManager(model, device, variant)
        manager.capture()
        return [manager.execute(p, g).clone() for p, g in zip(pixels, batches)]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
