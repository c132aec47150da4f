"""SDPA turns a boolean mask into an additive one with a CPU scalar: a captured decode step copies it from host memory.

Upstream: https://github.com/pytorch/pytorch/pull/130712 ("Fix the cudagraph capture of SDPA"), fixing the
capture failure introduced by https://github.com/pytorch/pytorch/pull/130281 ("[SDPA] Replace
``masked_fill_`` with ``aten::where``").
Symptom: capturing a decode step that calls ``F.scaled_dot_product_attention`` with a boolean
``attn_mask`` (Meta's Llama-2 multimodal generator, ``test_multimodal_decode_gen2``, July 2024 nightly)
failed: "The scalar tensor by default is on CPU, which failed the cuda graph capture"; eager decoding
was fine.
Mechanism: ``convert_boolean_attn_mask`` (``aten/src/ATen/native/transformers/attention.cpp``) builds
the additive mask as ``at::where(attn_mask->logical_not(), -inf, at::scalar_tensor(0.0,
at::TensorOptions().dtype(dtype)))``. The ``0.0`` scalar tensor has no device, so it is a pageable CPU
tensor; ``where_self_out`` ("allow CPU scalars on non-cpu device") moves a 0-dim operand that is not on
the output's device with ``other_.to(device)``: a copy of host data from pageable memory to the device,
issued inside the capture, which a capturing stream refuses (eager does the same copy and is fine).
Doctor: sync-in-capture, at ``convert_boolean_attn_mask`` (the pageable host-to-device copy of the
``0.0`` scalar made for ``where``).
Fix (upstream): create the scalar on the mask's device,
``at::scalar_tensor(0.0, at::TensorOptions().dtype(dtype).device(attn_mask->device()))``: a fill kernel
on the device, which the graph records; nothing crosses from the host.
(Read: the ``convert_boolean_attn_mask`` diff of #130281, the current ``attention.cpp`` with the fix and
``where_self_out`` in ``TensorCompare.cpp``; for #130712 itself only its description. The pageable scalar
plus ``where``'s ``.to(device)`` is written here as one ``torch.tensor(0.0, device=...)``: the same
single-number copy from pageable host memory, which the CPU engine refuses inside a capture as CUDA does.)
"""
from __future__ import annotations

import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/pytorch/pull/130712"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "convert_boolean_attn_mask"
SYMPTOM = "capturing a decode step whose SDPA gets a boolean attn_mask fails (CPU scalar copied to the device)"
BATCH, HEADS, HEAD_DIM, IMAGE_TOKENS, STEPS = 2, 2, 4, 5, 4
DIM = HEADS * HEAD_DIM


def convert_boolean_attn_mask(attn_mask, dtype, variant):
    """ATen ``convert_boolean_attn_mask``: a boolean mask becomes an additive ``-inf``/``0`` mask."""
    if attn_mask is None:
        return None
    if attn_mask.dtype == torch.bool:
        if variant == "bug":
            # at::scalar_tensor(0.0, at::TensorOptions().dtype(dtype)) is a CPU tensor; where_self_out
            # moves it to the mask's device (other_.to(device)): one number copied from pageable memory.
            zero = torch.tensor(0.0, dtype=dtype, device=attn_mask.device)
        else:
            zero = torch.scalar_tensor(0.0, dtype=dtype, device=attn_mask.device)
        return torch.where(attn_mask.logical_not(), -math.inf, zero)
    # Otherwise, attn_mask represents an additive attention tensor
    return attn_mask


def scaled_dot_product_attention(query, key, value, attn_mask, variant):
    """``_scaled_dot_product_attention_math``: the path a boolean mask takes."""
    attn_mask = convert_boolean_attn_mask(attn_mask, query.dtype, variant)
    scale = 1.0 / math.sqrt(query.shape[-1])
    attn = (query * scale) @ key.transpose(-2, -1)
    if attn_mask is not None:
        attn = attn + attn_mask
    attn = torch.softmax(attn, dim=-1)
    return attn @ value


class CrossAttention:
    """The text decoder's cross-attention to the image tokens (one new text token per request)."""

    def __init__(self, device, variant):
        gen = generator(130712)
        self.wq = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
        self.wk = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
        self.wv = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
        self.wo = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
        self.variant = variant

    def forward(self, hidden, image_features, image_mask):
        b = hidden.shape[0]
        q = (hidden @ self.wq).view(b, 1, HEADS, HEAD_DIM).transpose(1, 2)
        k = (image_features @ self.wk).view(b, IMAGE_TOKENS, HEADS, HEAD_DIM).transpose(1, 2)
        v = (image_features @ self.wv).view(b, IMAGE_TOKENS, HEADS, HEAD_DIM).transpose(1, 2)
        attn_mask = image_mask[:, None, None, :]          # [b, 1, 1, image tokens]: True = attend
        out = scaled_dot_product_attention(q, k, v, attn_mask, self.variant)
        return hidden + out.transpose(1, 2).reshape(b, DIM) @ self.wo


def run(variant: str, device: str = "cpu"):
    gen = generator(130281)
    steps = []
    for i in range(STEPS):
        mask = torch.ones(BATCH, IMAGE_TOKENS, dtype=torch.bool)
        mask[0, IMAGE_TOKENS - 1 - i % 2:] = False       # request 0's image has fewer tiles
        steps.append((randn(BATCH, DIM, gen=gen, device=device),
                      randn(BATCH, IMAGE_TOKENS, DIM, gen=gen, device=device), mask.to(device)))

    def served():
        layer = CrossAttention(device, variant)
        hidden = torch.zeros(BATCH, DIM, device=device)
        image_features = torch.zeros(BATCH, IMAGE_TOKENS, DIM, device=device)
        image_mask = torch.ones(BATCH, IMAGE_TOKENS, dtype=torch.bool, device=device)
        graph, out = capture(lambda: layer.forward(hidden, image_features, image_mask), device=device,
                             name="decode step", owner="multimodal decode graph",
                             static={"hidden": hidden, "image_features": image_features,
                                     "image_mask": image_mask})
        outs = []
        for h, feats, mask in steps:
            hidden.copy_(h)
            image_features.copy_(feats)
            image_mask.copy_(mask)
            outs.append(replay(graph, out).clone())
        return outs

    def eager():
        layer = CrossAttention(device, variant)
        return [layer.forward(h, feats, mask).clone() for h, feats, mask in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
