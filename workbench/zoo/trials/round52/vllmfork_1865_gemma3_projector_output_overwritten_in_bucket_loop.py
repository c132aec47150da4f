"""Gemma3 vision on HPU graphs: each bucket's multi_modal_projector output is overwritten by the next same-size replay.

Upstream: https://github.com/HabanaAI/vllm-fork/pull/1865 ("Fixes HPU graph run for Gemma3 vision inputs",
commit 36eb2cf9c; the same change went to another branch as #1719).
Symptom: wrong Gemma3 multimodal answers with several images per batch ("Accuracy bug fix by clone output data
of the multimodal-projector. Validated with Muirbench datasets."): the embeddings of earlier image chunks are
replaced by a later chunk's. No crash.
Mechanism: ``HpuModelAdapter.__init__`` (lazy mode, ``is_mm_optimized``) wraps ``self.model.multi_modal_projector``
with ``htorch.hpu.wrap_in_hpu_graph(...)``: the first call at an input shape captures a graph, later calls at that
shape replay it and return its static output tensor. ``Gemma3ForConditionalGeneration._process_image_input``
splits the images with ``greedy_plan(pixel_values.shape[0], self.vision_buckets.multimodal_buckets)`` and loops
``image_embeds_multibatches += [self.multi_modal_projector(image_features[start_idx:end_idx, ...])]``, then
``torch.cat(image_embeds_multibatches)``. Two chunks of the same bucket replay the same graph into the same output
storage: the list holds two aliases of one buffer, and the cat repeats the last chunk's embeddings.
Doctor: overwritten-output, at ``_process_image_input`` (it keeps the graph's returned output in a list across
the next replay of the same graph and reads it after).
Fix (upstream): the loop selects each chunk with ``torch.index_select`` (not slicing, for the HPU graph hash),
runs the vision tower per chunk, and stores ``image_embeds.clone()`` of the projector output.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/HabanaAI/vllm-fork/pull/1865"
FAMILY = "persistent-buffer mutation"
KIND = "overwritten-output"
SITE = "_process_image_input"
SYMPTOM = "Gemma3 with several image chunks of one bucket: earlier chunks' image embeddings replaced by the last's"

PIXELS, VISION_HIDDEN, TEXT_HIDDEN, TOKENS_PER_IMAGE = 12, 8, 6, 2
MULTIMODAL_BUCKETS = [1, 2, 4]


def greedy_plan(batch_size, available_batch_sizes):
    """Largest bucket that still fits, repeatedly."""
    plan, remaining = [], batch_size
    for size in sorted(available_batch_sizes, reverse=True):
        while remaining >= size:
            plan.append(size)
            remaining -= size
    return plan


class HPUGraphWrapper:
    """``htorch.hpu.wrap_in_hpu_graph``: one cached graph per input shape, returning its static output."""

    def __init__(self, module, device):
        self.module, self.device, self.graphs = module, device, {}

    def __call__(self, x):
        key = tuple(x.shape)
        if key not in self.graphs:
            static_in = torch.zeros_like(x)
            static_in.copy_(x)
            g, out = capture(lambda: self.module(static_in), device=self.device, warmups=0,
                             owner="wrap_in_hpu_graph(multi_modal_projector)", name=f"projector {key[0]}",
                             static={"image_features": static_in})
            self.graphs[key] = (g, out, static_in)
            return replay(g, out)       # a capture runs no kernels: the first call replays what it recorded
        g, out, static_in = self.graphs[key]
        static_in.copy_(x)
        return replay(g, out)


class Gemma3MultiModalProjector:
    def __init__(self, device):
        gen = generator(1865)
        self.mm_input_projection_weight = randn(VISION_HIDDEN, TEXT_HIDDEN, gen=gen, device=device, scale=0.5)
        self.mm_soft_emb_norm_weight = randn(VISION_HIDDEN, gen=gen, device=device, scale=0.1)

    def __call__(self, vision_outputs):
        normed = vision_outputs * torch.rsqrt(vision_outputs.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (normed * (1.0 + self.mm_soft_emb_norm_weight)) @ self.mm_input_projection_weight


class SiglipVisionModel:
    def __init__(self, device):
        gen = generator(18650)
        self.patch_embed = randn(PIXELS, TOKENS_PER_IMAGE * VISION_HIDDEN, gen=gen, device=device, scale=0.4)

    def __call__(self, pixel_values):
        return torch.tanh(pixel_values @ self.patch_embed).view(-1, TOKENS_PER_IMAGE, VISION_HIDDEN)


class Gemma3ForConditionalGeneration:
    def __init__(self, device, variant, is_hpu):
        self.variant, self.is_hpu = variant, is_hpu
        self.vision_tower = SiglipVisionModel(device)
        self.multi_modal_projector = Gemma3MultiModalProjector(device)
        self.multimodal_buckets = MULTIMODAL_BUCKETS

    def _image_pixels_to_features(self, vision_tower, pixel_values):
        return vision_tower(pixel_values)

    def _process_image_input(self, pixel_values, num_patches):
        if self.is_hpu:
            batch_breakdown = greedy_plan(pixel_values.shape[0], self.multimodal_buckets)
            start_idx, image_embeds_multibatches = 0, []
            if self.variant == "bug":
                image_features = self._image_pixels_to_features(self.vision_tower, pixel_values)
            for i in batch_breakdown:
                end_idx = start_idx + i
                if self.variant == "bug":
                    batch_sliced_image_features = image_features[start_idx:end_idx, ...]
                    image_embeds_multibatches += [self.multi_modal_projector(batch_sliced_image_features)]
                else:
                    indices = torch.arange(start_idx, end_idx, device=pixel_values.device)
                    batch_sliced_pixel_values = torch.index_select(pixel_values, dim=0, index=indices)
                    image_features = self._image_pixels_to_features(self.vision_tower, batch_sliced_pixel_values)
                    image_embeds = self.multi_modal_projector(image_features)
                    image_embeds_multibatches += [image_embeds.clone()]
                start_idx = end_idx
            image_embeds = torch.cat(image_embeds_multibatches, dim=0)
        else:
            image_features = self._image_pixels_to_features(self.vision_tower, pixel_values)
            image_embeds = self.multi_modal_projector(image_features)
        return [e.flatten(0, 1) for e in image_embeds.split(num_patches.tolist())]


class HpuModelAdapter:
    def __init__(self, model, device, is_mm_optimized):
        self.model = model
        if is_mm_optimized:
            self.model.multi_modal_projector = HPUGraphWrapper(self.model.multi_modal_projector, device)


def run(variant: str, device: str = "cpu"):
    gen = generator(18651)
    # three prompts: 8 images (two chunks of bucket 4), 5 images (4 + 1), 6 images (4 + 2)
    requests = []
    for n_images, patches in [(8, [3, 5]), (5, [2, 3]), (6, [6])]:
        requests.append((torch.randn(n_images, PIXELS, generator=gen), torch.tensor(patches)))

    def serve(graphed: bool):
        model = Gemma3ForConditionalGeneration(device, variant, is_hpu=graphed)
        HpuModelAdapter(model, device, is_mm_optimized=graphed)
        outs = []
        for pixel_values, num_patches in requests:
            outs += [e.clone() for e in model._process_image_input(pixel_values.to(device), num_patches)]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
