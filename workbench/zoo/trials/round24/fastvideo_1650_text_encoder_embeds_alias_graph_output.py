"""A CUDA-graph-compiled text encoder: ``encode_text`` keeps graph outputs that the negative prompt's replay overwrites.

Upstream: https://github.com/hao-ai-lab/FastVideo/pull/1650 ("[bugfix]: copy text encoder outputs out of
CUDAGraph static buffers", commit 1b2b2a01).
Symptom: with the text encoder compiled under ``torch.compile(mode="reduce-overhead")`` or
``"max-autotune"`` (both CUDA graphs), generation crashed at denoising time with "accessing tensor output
of CUDAGraphs that has been overwritten by a subsequent run", first seen on the LTX-2 Gemma encoder's
trailing ``rms_norm`` output (July 2026).
Mechanism: ``TextEncodingStage.forward`` encodes the prompt, then (CFG) the negative prompt, with the same
encoder; both are padded to ``max_sequence_length``, so both calls replay the same graph. ``encode_text``
retained the encoder's outputs with ``prompt_embeds.to(device=target_device)`` (and ``.to(dtype=...)``,
and for LTX-2 ``outputs.hidden_states[0].to(...)`` as the audio embeds): no-ops that return the same
tensor when device and dtype already match, so ``batch.prompt_embeds`` holds the graph's static output
buffers. The negative prompt's replay rewrites those buffers, and the denoiser, which reads both embeds
at every step, gets the negative embeddings twice: classifier-free guidance collapses. PyTorch's
cudagraph trees detect the read and raise (the reported error); a CUDA graph without that check returns
the wrong numbers, which is what this program shows.
Doctor: overwritten-output, at ``encode_text`` (it keeps graph-owned outputs past the next replay of the
same graph, through aliasing ``.to()`` calls).
Fix (upstream): ``prompt_embeds.to(device=target_device, dtype=dtype, copy=True)`` (and the same for the
LTX-2 audio embeds): a copy out of graph-owned storage at the one point where encoder outputs escape.
Read: the diff and its regression test. ``CompiledTextEncoder`` stands for ``torch.compile(...,
mode="reduce-overhead")`` (warm up, capture, replay the static outputs); the encoder, connector and
denoiser are tiny stand-ins for LTX-2's.
"""
from __future__ import annotations

import dataclasses
import types

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/hao-ai-lab/FastVideo/pull/1650"
FAMILY = "persistent-buffer mutation"
KIND = "overwritten-output"
SITE = "encode_text"
SYMPTOM = "CFG collapses: the prompt's embeds are overwritten by the negative prompt's encoder replay"

VOCAB, DIM, MAX_SEQUENCE_LENGTH, PAD_ID = 12, 4, 6, 0
STEPS, GUIDANCE_SCALE = 3, 5.0


class FakeTokenizer:
    """Pads to ``max_length`` (``padding="max_length"``): every prompt has the same shape."""

    def __call__(self, texts, max_length=MAX_SEQUENCE_LENGTH):
        ids = [[1 + (ord(c) % (VOCAB - 1)) for c in t][:max_length] for t in texts]
        mask = [[1] * len(i) + [0] * (max_length - len(i)) for i in ids]
        ids = [i + [PAD_ID] * (max_length - len(i)) for i in ids]
        return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}


class GemmaTextEncoder:
    """Embedding, one layer, and the LTX-2 connector whose final ``rms_norm`` is the encoder output."""

    def __init__(self, device):
        gen = generator(1650)
        self.embed_tokens = randn(VOCAB, DIM, gen=gen, device=device)
        self.w = randn(DIM, DIM, gen=gen, device=device, scale=0.8)
        self.connector = randn(DIM, DIM, gen=gen, device=device, scale=0.8)

    def forward(self, input_ids, attention_mask):
        h0 = self.embed_tokens[input_ids]
        h1 = torch.tanh(h0 @ self.w) * attention_mask[..., None]
        x = h1 @ self.connector
        last_hidden_state = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)     # rms_norm
        return last_hidden_state, h0


class CompiledTextEncoder:
    """``torch.compile(text_encoder, mode="reduce-overhead")``: inputs copied into static buffers,
    the forward warmed up and captured at the first call, the graph's static outputs returned by
    every call."""

    def __init__(self, encoder, device):
        self.encoder, self.device = encoder, device
        self.static_input_ids = torch.zeros(1, MAX_SEQUENCE_LENGTH, dtype=torch.long, device=device)
        self.static_attention_mask = torch.zeros(1, MAX_SEQUENCE_LENGTH, dtype=torch.long, device=device)
        self.graph = None

    def __call__(self, input_ids, attention_mask, output_hidden_states=False):
        self.static_input_ids.copy_(input_ids)
        self.static_attention_mask.copy_(attention_mask)
        if self.graph is None:
            self.graph, self.static_outputs = capture(
                lambda: self.encoder.forward(self.static_input_ids, self.static_attention_mask),
                device=self.device, warmups=1, owner="torch.compile(text_encoder, mode='reduce-overhead')",
                static={"input_ids": self.static_input_ids, "attention_mask": self.static_attention_mask})
        last_hidden_state, h0 = replay(self.graph, self.static_outputs)
        return types.SimpleNamespace(last_hidden_state=last_hidden_state,
                                     hidden_states=(h0,) if output_hidden_states else None)


class EagerTextEncoder:
    def __init__(self, encoder):
        self.encoder = encoder

    def __call__(self, input_ids, attention_mask, output_hidden_states=False):
        last_hidden_state, h0 = self.encoder.forward(input_ids, attention_mask)
        return types.SimpleNamespace(last_hidden_state=last_hidden_state,
                                     hidden_states=(h0,) if output_hidden_states else None)


def ltx2_postprocess_text(outputs):
    return outputs.last_hidden_state


@dataclasses.dataclass
class ForwardBatch:
    prompt: str
    negative_prompt: str
    latents: torch.Tensor
    do_classifier_free_guidance: bool = True
    prompt_embeds: list = dataclasses.field(default_factory=list)
    negative_prompt_embeds: list = dataclasses.field(default_factory=list)
    extra: dict = dataclasses.field(default_factory=dict)


class TextEncodingStage:
    def __init__(self, text_encoders, tokenizers, variant, device):
        self.text_encoders, self.tokenizers, self.variant, self.device = text_encoders, tokenizers, variant, device
        self.is_ltx2 = True                       # pipeline_config.dit_config.prefix == "ltx2"
        self._last_audio_embeds = None

    def forward(self, batch: ForwardBatch) -> ForwardBatch:
        prompt_embeds_list = self.encode_text(batch.prompt)
        if self._last_audio_embeds is not None:
            batch.extra["ltx2_audio_prompt_embeds"] = self._last_audio_embeds
        batch.prompt_embeds.extend(prompt_embeds_list)
        if batch.do_classifier_free_guidance:     # the same encoder, the same graph, for the negative
            neg_embeds_list = self.encode_text(batch.negative_prompt)
            if self._last_audio_embeds is not None:
                batch.extra["ltx2_audio_negative_embeds"] = self._last_audio_embeds
            batch.negative_prompt_embeds.extend(neg_embeds_list)
        return batch

    def encode_text(self, text, device=None, dtype=None):
        target_device = device if device is not None else self.device
        embeds_list, audio_embeds_list = [], []
        for tokenizer, text_encoder in zip(self.tokenizers, self.text_encoders):
            text_inputs = tokenizer([text])
            input_ids = text_inputs["input_ids"].to(target_device)
            attention_mask = text_inputs["attention_mask"].to(target_device)
            outputs = text_encoder(input_ids=input_ids, attention_mask=attention_mask,
                                   output_hidden_states=self.is_ltx2)
            prompt_embeds = ltx2_postprocess_text(outputs)
            if self.variant == "fix":
                if self.is_ltx2 and getattr(outputs, "hidden_states", None):
                    audio_embed = outputs.hidden_states[0].to(device=target_device, dtype=dtype, copy=True)
                    audio_embeds_list.append(audio_embed)
                prompt_embeds = prompt_embeds.to(device=target_device, dtype=dtype, copy=True)
            else:
                if self.is_ltx2 and getattr(outputs, "hidden_states", None):
                    audio_embed = outputs.hidden_states[0].to(device=target_device)   # same device: no copy
                    if dtype is not None:
                        audio_embed = audio_embed.to(dtype=dtype)
                    audio_embeds_list.append(audio_embed)
                prompt_embeds = prompt_embeds.to(device=target_device)
                if dtype is not None:
                    prompt_embeds = prompt_embeds.to(dtype=dtype)
            embeds_list.append(prompt_embeds)
        self._last_audio_embeds = audio_embeds_list if self.is_ltx2 else None
        return embeds_list


class LTX2Transformer:
    """A stand-in denoiser conditioned on the pooled text and audio embeds."""

    def __init__(self, device):
        gen = generator(2)
        self.w_lat = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
        self.w_txt = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
        self.w_aud = randn(DIM, DIM, gen=gen, device=device, scale=0.5)

    def __call__(self, latents, t, encoder_hidden_states, audio_hidden_states):
        cond = encoder_hidden_states.mean(1) @ self.w_txt + audio_hidden_states.mean(1) @ self.w_aud
        return torch.tanh(latents @ self.w_lat + cond) * (1.0 + 0.1 * t)


class DenoisingStage:
    def __init__(self, transformer):
        self.transformer = transformer

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        latents = batch.latents
        prompt_embeds, audio = batch.prompt_embeds[0], batch.extra["ltx2_audio_prompt_embeds"][0]
        neg_embeds, neg_audio = batch.negative_prompt_embeds[0], batch.extra["ltx2_audio_negative_embeds"][0]
        for t in range(STEPS):
            noise_pred_text = self.transformer(latents, t, prompt_embeds, audio)
            noise_pred_uncond = self.transformer(latents, t, neg_embeds, neg_audio)
            noise_pred = noise_pred_uncond + GUIDANCE_SCALE * (noise_pred_text - noise_pred_uncond)
            latents = latents - 0.1 * noise_pred
        return latents


def run(variant: str, device: str = "cpu"):
    gen = torch.Generator().manual_seed(5)
    requests = [("a cat on a skateboard", "blurry, low quality"), ("sunset over the sea", "bad anatomy")]
    latents0 = [torch.randn(1, DIM, generator=gen) for _ in requests]

    def generate(compiled: bool):
        encoder = GemmaTextEncoder(device)
        text_encoder = CompiledTextEncoder(encoder, device) if compiled else EagerTextEncoder(encoder)
        text_stage = TextEncodingStage([text_encoder], [FakeTokenizer()], variant, device)
        denoise = DenoisingStage(LTX2Transformer(device))
        videos = []
        for (prompt, negative), lat in zip(requests, latents0):
            batch = text_stage.forward(ForwardBatch(prompt, negative, lat.to(device)))
            videos.append(denoise.forward(batch).clone())
        return videos

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: generate(True), lambda: generate(False))
