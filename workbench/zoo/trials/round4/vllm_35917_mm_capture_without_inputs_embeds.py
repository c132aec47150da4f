"""The decoder graphs of a vision-language model were captured without ``inputs_embeds``: replays embed the
image placeholder tokens instead of the image features.

Upstream: https://github.com/vllm-project/vllm/pull/35917 ("[Model Runner V2] Fix inputs_embeds=None bug for MM
models"): "VLMs see blank images when CUDA graph is enabled (while the model works fine with eager mode). The
bug is actually caused by incorrect compilation; We didn't provide `inputs_embeds` for the initial run."
Symptom: with Model Runner V2 and CUDA graphs, multimodal models answer as if every image were blank (vLLM
main, March 2026); ``--enforce-eager`` is correct.
Mechanism: for multimodal models the runner merges the encoder's image features into the persistent
``inputs_embeds`` buffer before every forward, and the model reads ``inputs_embeds`` whenever it is given. The
capture path (``CudaGraphManager.capture_graph``) built ``model_inputs`` from ``input_ids`` and ``positions``
only, so warmup and capture took the model's ``inputs_embeds is None`` branch and recorded the embedding lookup
of ``input_ids``. Every replay embeds the image placeholder ids and never reads the buffer the runner filled.
Doctor: warmup-divergence, at ``capture_graph`` (the capture's ``model_inputs`` decide the branch that every
replay reuses, while an eager step takes the ``inputs_embeds`` branch).
Fix (upstream): give the capture the same inputs a real step has: the model state's dummy inputs add
``inputs_embeds`` (a slice of the persistent buffer) to ``model_inputs``, so the graph reads that buffer.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/35917"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "capture_graph"
SYMPTOM = "the model sees image placeholder embeddings instead of the image (blank images) under CUDA graphs"
VOCAB, HIDDEN, MAX_POS = 12, 4, 32
IMAGE_TOKEN_ID = 11                         # the placeholder id the processor puts at image positions
MAX_NUM_TOKENS = 8
CAPTURE_SIZES = (4, 8)


class VisionLanguageModel:
    def __init__(self, device):
        gen = generator(35917)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.pos = randn(MAX_POS, HIDDEN, gen=gen, device=device, scale=0.3)
        self.w = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.7)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device)

    def embed_input_ids(self, input_ids, multimodal_embeddings=None, is_multimodal=None):
        embeds = self.embed_tokens[input_ids]
        if multimodal_embeddings is not None:
            embeds = embeds.masked_scatter(is_multimodal[:, None], multimodal_embeddings)
        return embeds

    def forward(self, input_ids, positions, inputs_embeds=None):
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        h = torch.tanh((inputs_embeds + self.pos[positions]) @ self.w)
        return h @ self.lm_head


class ModelRunner:
    """MRV2's runner for a multimodal model: persistent input buffers, FULL graphs per token count."""

    def __init__(self, device, dummy_inputs_embeds: bool):
        self.model = VisionLanguageModel(device)
        self.dummy_inputs_embeds = dummy_inputs_embeds
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.positions = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.inputs_embeds = torch.zeros(MAX_NUM_TOKENS, HIDDEN, device=device)     # the model state's buffer
        self.graphs = {}

    def prepare_dummy_inputs(self, num_reqs, num_tokens):
        return {"inputs_embeds": self.inputs_embeds[:num_tokens]} if self.dummy_inputs_embeds else {}

    def capture_graph(self, num_tokens, device):
        model_inputs = {
            "input_ids": self.input_ids[:num_tokens],
            "positions": self.positions[:num_tokens],
            **self.prepare_dummy_inputs(1, num_tokens),
        }
        self.graphs[num_tokens] = capture(
            lambda: self.model.forward(**model_inputs), device=device, name=f"size {num_tokens}",
            static={"input_ids": self.input_ids, "positions": self.positions, "inputs_embeds": self.inputs_embeds},
            owner="CudaGraphManager")

    def execute_model(self, input_ids, positions, mm_embeds, is_mm_embed, graphed: bool):
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        # the encoder's outputs are merged into the persistent inputs_embeds buffer
        self.inputs_embeds[:n] = self.model.embed_input_ids(self.input_ids[:n], mm_embeds, is_mm_embed)
        size = next((s for s in CAPTURE_SIZES if s >= n), None)
        if not graphed or size is None:
            return self.model.forward(self.input_ids[:n], self.positions[:n], self.inputs_embeds[:n])
        g, out = self.graphs[size]
        padded = {"input_ids": self.input_ids, "positions": self.positions, "inputs_embeds": self.inputs_embeds}
        return replay(g, out, real=n, size=size, padded=padded)[:n]


def schedule(device):
    """Step 1: a prompt with a 3-patch image (prefill). Steps 2-3: decode; then a second image prompt."""
    gen = generator(3)
    image1, image2 = randn(3, HIDDEN, gen=gen, device=device), randn(2, HIDDEN, gen=gen, device=device)
    steps = [([1, IMAGE_TOKEN_ID, IMAGE_TOKEN_ID, IMAGE_TOKEN_ID, 5, 7], list(range(6)), image1),
             ([4], [6], None), ([9], [7], None),
             ([2, IMAGE_TOKEN_ID, IMAGE_TOKEN_ID], [0, 1, 2], image2)]
    out = []
    for ids, pos, image in steps:
        ids = torch.tensor(ids, device=device)
        out.append((ids, torch.tensor(pos, device=device), image, ids == IMAGE_TOKEN_ID))
    return out


def run(variant: str, device: str = "cpu"):
    steps = schedule(device)

    def serve(graphed: bool):
        runner = ModelRunner(device, dummy_inputs_embeds=(variant == "fix"))
        if graphed:
            for size in sorted(CAPTURE_SIZES, reverse=True):
                runner.capture_graph(size, device)
        return [runner.execute_model(ids, pos, image, is_mm, graphed).clone() for ids, pos, image, is_mm in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
