"""LTX-2 in TRT-LLM's visual_gen: an audio pass replays the graph and attention metadata prepared for a video pass.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/14374 ("[https://nvbugs/6115271][fix] Fix LTX-2 Attention
Metadata issue").
Symptom: LTX-2 audio+video generation with CUDA graphs in ``tensorrt_llm._torch.visual_gen`` hits illegal memory
accesses or produces corrupted output; without graphs it is fine (TensorRT-LLM main, May 2026).
Mechanism: the visual_gen transformer caches a CUDA graph and its prepared attention metadata per
"compile shape" key, assuming one key means one metadata layout. LTX-2 runs its transformer for video and
for audio tokens, whose attention layouts differ (video attends within frames, audio over the whole
sequence) while the broad shape can be the same. The key did not tell them apart: the first pass (video)
prepared its metadata (``cu_seqlens``, ``max_seqlen``) and captured the graph; the audio pass hit the cache,
skipped preparation and replayed that graph with the video layout's offsets. Eager runs build the metadata
of every call afresh, so only graphed runs were wrong (on the GPU the stale offsets and workspace
assumptions also go out of bounds).
Doctor: warmup-divergence, at ``_cache_key`` (the capture-time layout replayed for a call whose eager
metadata differs).
Fix (upstream): tighten the reuse rule: cached metadata (and its graph) is reused only for the same
video/audio modality and request shape, so the audio pass prepares and captures its own.
"""
from __future__ import annotations

import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/14374"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "_cache_key"
SYMPTOM = "the audio pass attends with the video pass's segment layout (corrupted audio / IMA upstream)"
SEQ, DIM, FRAMES = 8, 4, 2            # video: 2 frames x 4 tokens; audio: one 8-token sequence


class AttentionMetadata:
    """Persistent varlen metadata a captured graph reads by address."""

    def __init__(self, device):
        self.cu_seqlens = torch.zeros(FRAMES + 2, dtype=torch.long, device=device)
        self.seq_ids = torch.zeros(SEQ, dtype=torch.long, device=device)
        self.prepared_for = None

    def prepare(self, modality):
        lens = [SEQ // FRAMES] * FRAMES if modality == "video" else [SEQ]
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.long)
        self.cu_seqlens.fill_(SEQ)
        self.cu_seqlens[:cu.numel()].copy_(cu)
        self.seq_ids.copy_(torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)))
        self.prepared_for = modality


def varlen_attention(q, k, v, metadata):
    same = metadata.seq_ids[:, None] == metadata.seq_ids[None, :]
    scores = (q @ k.t() / math.sqrt(q.shape[-1])).masked_fill(~same, float("-inf"))
    return torch.softmax(scores, -1) @ v


class LTX2Transformer:
    def __init__(self, device):
        gen = generator(14374)
        self.wq, self.wk, self.wv = (randn(DIM, DIM, gen=gen, device=device, scale=0.6) for _ in range(3))

    def forward(self, hidden_states, metadata):
        attn = varlen_attention(hidden_states @ self.wq, hidden_states @ self.wk, hidden_states @ self.wv, metadata)
        return hidden_states + attn


class CUDAGraphTransformerRunner:
    """The visual_gen runner: one graph and one prepared metadata per cache key."""

    def __init__(self, model, device, fixed: bool):
        self.model, self.device, self.fixed = model, device, fixed
        self.entries = {}

    def _cache_key(self, hidden_states, modality):
        key = tuple(hidden_states.shape)                 # the broad compile shape
        if self.fixed:
            key = (modality,) + key                      # same modality and request shape only
        return key

    def __call__(self, hidden_states, modality):
        key = self._cache_key(hidden_states, modality)
        if key not in self.entries:
            metadata = AttentionMetadata(self.device)
            metadata.prepare(modality)
            static = hidden_states.clone()
            g, out = capture(lambda: self.model.forward(static, metadata), device=self.device,
                             name=f"transformer {key}", static={"hidden_states": static},
                             state={"cu_seqlens": metadata.cu_seqlens, "seq_ids": metadata.seq_ids},
                             owner="visual_gen CUDA graph runner")
            self.entries[key] = (g, out, static, metadata)
        g, out, static, metadata = self.entries[key]
        static.copy_(hidden_states)
        return replay(g, out).clone()


def run(variant: str, device: str = "cpu"):
    gen = generator(6115271)
    steps = [(randn(SEQ, DIM, gen=gen, device=device), randn(SEQ, DIM, gen=gen, device=device)) for _ in range(2)]

    def eager():
        model = LTX2Transformer(device)
        outs = []
        for video, audio in steps:                       # each denoising step: a video and an audio pass
            for x, modality in ((video, "video"), (audio, "audio")):
                metadata = AttentionMetadata(device)
                metadata.prepare(modality)
                outs.append(model.forward(x, metadata))
        return outs

    def served():
        runner = CUDAGraphTransformerRunner(LTX2Transformer(device), device, fixed=(variant == "fix"))
        return [runner(x, modality) for video, audio in steps for x, modality in ((video, "video"), (audio, "audio"))]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
