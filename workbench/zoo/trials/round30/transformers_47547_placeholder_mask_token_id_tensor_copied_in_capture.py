"""A multimodal model finds its image placeholders by embedding a ``torch.tensor(image_token_id, device=...)``: a host copy inside the capture.

Upstream: https://github.com/huggingface/transformers/pull/47547 ("Fix CUDA Graph breaking host to device
copy from scalar tensor allocation").
Symptom: capturing the forward of several multimodal models in a CUDA graph crashed ("a host->device copy
that graph capture forbids", July 2026); the same forward runs eagerly without error.
Mechanism: when the model is called with ``inputs_embeds`` and no ``input_ids`` (as a serving engine calls
it: embeddings in, ids already consumed), ``get_placeholder_mask`` recovers the image-token positions by
comparing every row of ``inputs_embeds`` with the embedding of the image token, and it builds that token
as ``self.get_input_embeddings()(torch.tensor(self.config.image_token_id, dtype=torch.long,
device=inputs_embeds.device))``. ``torch.tensor`` of a Python int with a CUDA ``device`` copies the number
from pageable host memory to the device; issued inside a capture, the capturing stream refuses the copy
(``cudaErrorStreamCaptureUnsupported``), so the graph is never built. Eager runs the same copy and is fine.
Doctor: sync-in-capture, at ``get_placeholder_mask`` (the pageable host-to-device copy of
``image_token_id`` made inside the capture).
Fix (upstream): ``torch.full((), self.config.image_token_id, dtype=torch.long,
device=inputs_embeds.device)``: a fill kernel on the device, which the graph records, so nothing crosses
from the host; the PR also added the mlinter rule TRF021 that flags the ``torch.tensor`` form.
(Read: the PR description, which quotes the replaced and the replacing line, and the fixed
``get_placeholder_mask`` plus the TRF021 rule text in the current tree; not the per-model file list. Which
models' captured forward reaches ``get_placeholder_mask`` with ``input_ids=None`` is not stated there: this
program models one decode step of a Llava-style model that always merges image features through the
placeholder mask, with a ``torch.where`` merge, so that nothing else in it needs the host.)
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/huggingface/transformers/pull/47547"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "get_placeholder_mask"
SYMPTOM = "capturing a multimodal forward fails: torch.tensor(image_token_id, device=...) copies host data in capture"

VOCAB, DIM, TOKENS, STEPS = 12, 4, 6, 4


class LlavaConfig:
    image_token_id = 11
    vocab_size = VOCAB


class LlavaModel:
    """The text side of a Llava-style model: token embeddings, the image merge, one projection."""

    def __init__(self, device, variant):
        gen = generator(47547)
        self.config = LlavaConfig()
        self.variant = variant
        self.embed_tokens = randn(VOCAB, DIM, gen=gen, device=device)
        self.w = randn(DIM, DIM, gen=gen, device=device, scale=0.6)

    def get_input_embeddings(self):
        return lambda ids: torch.nn.functional.embedding(ids, self.embed_tokens)

    def get_placeholder_mask(self, input_ids, inputs_embeds):
        """Which rows are image placeholders, from ``input_ids`` or, without them, from ``inputs_embeds``."""
        if input_ids is None:
            if self.variant == "bug":
                image_token = torch.tensor(self.config.image_token_id, dtype=torch.long, device=inputs_embeds.device)
            else:
                image_token = torch.full((), self.config.image_token_id, dtype=torch.long,
                                         device=inputs_embeds.device)
            special_image_mask = inputs_embeds == self.get_input_embeddings()(image_token)
            special_image_mask = special_image_mask.all(-1)
        else:
            special_image_mask = input_ids == self.config.image_token_id
        return special_image_mask

    def forward(self, inputs_embeds, image_features, input_ids=None):
        special_image_mask = self.get_placeholder_mask(input_ids, inputs_embeds)
        inputs_embeds = torch.where(special_image_mask[:, None], image_features, inputs_embeds)
        return torch.tanh(inputs_embeds @ self.w)


def run(variant: str, device: str = "cpu"):
    gen = generator(4754)
    steps = []
    for i in range(STEPS):
        ids = torch.randint(0, VOCAB - 1, (TOKENS,), generator=gen)
        ids[i % TOKENS] = LlavaConfig.image_token_id          # one image placeholder per step, moving
        ids[(i + 3) % TOKENS] = LlavaConfig.image_token_id
        steps.append((ids.to(device), randn(TOKENS, DIM, gen=gen, device=device)))

    def served():
        model = LlavaModel(device, variant)
        embed = model.get_input_embeddings()
        inputs_embeds = torch.zeros(TOKENS, DIM, device=device)
        image_features = torch.zeros(TOKENS, DIM, device=device)
        graph, out = capture(lambda: model.forward(inputs_embeds, image_features), device=device,
                             name=f"{TOKENS} tokens", owner="multimodal model runner (inputs_embeds path)",
                             static={"inputs_embeds": inputs_embeds, "image_features": image_features})
        outs = []
        for ids, feats in steps:
            inputs_embeds.copy_(embed(ids))                  # the engine embeds the ids outside the graph
            image_features.copy_(feats)
            outs.append(replay(graph, out).clone())
        return outs

    def eager():
        model = LlavaModel(device, variant)
        embed = model.get_input_embeddings()
        return [model.forward(embed(ids), feats).clone() for ids, feats in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
