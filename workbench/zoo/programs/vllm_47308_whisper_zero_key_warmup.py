"""Encoder-decoder graphs captured with a zero-length encoder: cross-attention has no keys.

Upstream: https://github.com/vllm-project/vllm/pull/47308 ("[ModelRunner V2] Warmup cross-attn
properly in encoder-decoder case. E.g. for whisper. Existing warmup was resulting in zero-key
attention op.").
Symptom: Whisper on Model Runner V2 warmed up with a dummy batch without encoder tokens, so its
cross-attention ran with zero keys (vLLM main, July 2026). The PR gives only that line; the program
models its consequence for a graph captured from such a dummy batch.
Mechanism: the dummy batch used for warmup and capture carries no encoder output, so the cross-attention
key/value buffers are sized from an encoder length of 0. The captured cross-attention attends over an
empty set and contributes nothing. Real requests' encoder states never reach the decoder's graph.
Doctor: undersized-buffer, at ``build_cross_buffers`` (a zero-sized capture input).
Fix (upstream): warm up and capture with the maximum encoder length, so the cross-attention buffers
have room for every real encoder output.
"""
from __future__ import annotations

import torch

from ..kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/47308"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "build_cross_buffers"
SYMPTOM = "cross-attention contributes nothing: the decoder ignores the audio"
DIM, ENC_LEN = 8, 6


def cross_attend(q, k, v):
    if k.shape[0] == 0:
        return torch.zeros_like(q)                   # what an attention kernel gives for zero keys
    w = torch.softmax(q @ k.t() / DIM ** 0.5, dim=-1)
    return w @ v


class Decoder:
    def __init__(self, device):
        gen = generator(47308)
        self.wq = randn(DIM, DIM, gen=gen, device=device, scale=0.4)
        self.enc = randn(ENC_LEN, DIM, gen=gen, device=device)
        self.tokens = randn(2, DIM, gen=gen, device=device)

    def forward(self, x, k, v):
        return x + cross_attend(x @ self.wq, k, v)


def build_cross_buffers(encoder_len: int, device):
    return torch.zeros(encoder_len, DIM, device=device), torch.zeros(encoder_len, DIM, device=device)


def run(variant: str, device: str = "cpu"):
    model = Decoder(device)

    def eager():
        return [model.forward(model.tokens, model.enc, model.enc)]

    def served():
        dummy_len = 0 if variant == "bug" else ENC_LEN   # the dummy batch's encoder length
        k_buf, v_buf = build_cross_buffers(dummy_len, device)
        x_buf = torch.zeros(2, DIM, device=device)
        g, out = capture(lambda: model.forward(x_buf, k_buf, v_buf), device=device,
                         static={"input": x_buf, "cross_k": k_buf, "cross_v": v_buf}, owner="ModelRunner V2")
        x_buf.copy_(model.tokens)
        k_buf.copy_(model.enc[:k_buf.shape[0]])
        v_buf.copy_(model.enc[:v_buf.shape[0]])
        return [replay(g, out).clone()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
