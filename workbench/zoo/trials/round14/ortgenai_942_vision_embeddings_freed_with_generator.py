"""The reused decoder graph reads the embeddings tensor of a generator that has been destroyed.

Upstream: https://github.com/microsoft/onnxruntime-genai/pull/942 ("Fix vision model graph capture not creating
static buffers for embedding").
Symptom: a multi-modal (Phi-3-vision style) model with graph capture enabled answers the first request
correctly, and requests served by later generators with garbage tokens; without graph capture every
request is fine (onnxruntime-genai 0.4/0.5, October 2024).
Mechanism: the pipeline is EmbeddingModel -> TextModel. ``Embeddings`` in ``Mode::Output`` (the embedding
model's state) created the ``inputs_embeds`` tensor with the device allocator when the sequence length switches
to 1, and ``ReuseEmbeddingsBuffer`` pointed the text model's input at it. The ``EmbeddingState`` was built with no
captured-graph info, so this tensor was per-generator memory, not one of the captured graph's static buffers.
The text model's decode graph is captured on the first generator and kept in the model's
``CapturedGraphPool`` for the generators after it; it reads ``inputs_embeds`` by address. When the first
generator is destroyed its embeddings tensor is freed, the next allocations of the next request reuse the
block, and every replay of the next generator reads whatever landed there instead of the embeddings its own
embedding model wrote.
Doctor: dangling-reference, at ``UpdateSequenceLength`` (the graph's input is a per-generator tensor, released
with its generator).
Fix (upstream): create the embeddings tensor in the text model's state (``Mode::Input``) on the captured graph's
static buffer ``sb_embeddings_`` and point the embedding model's output at it.
"""
from __future__ import annotations

import torch

from workbench.engine import reuse_freed_blocks
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/microsoft/onnxruntime-genai/pull/942"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "UpdateSequenceLength"
SYMPTOM = "requests after the first generator decode from freed embeddings memory: garbage logits"
VOCAB, HIDDEN = 10, 4


class MultiModalVisionModel:
    def __init__(self, device):
        gen = generator(942)
        self.device = device
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.w = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.7)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.7)
        self.captured_graph_pool = CapturedGraphPool()

    def embedding_session(self, input_ids, inputs_embeds):
        inputs_embeds.copy_(self.embed_tokens[input_ids])          # the embedding model's output binding

    def text_session(self, inputs_embeds):
        return torch.tanh(inputs_embeds @ self.w) @ self.lm_head


class CapturedGraphInfo:
    def __init__(self):
        self.graph = None
        self.logits = None
        self.sb_embeddings = None              # the static buffer the text model's graph input should live in
        self.binding: dict = {}                # the OrtValues bound for the run that is captured


class CapturedGraphPool:
    def __init__(self):
        self.free: list[CapturedGraphInfo] = []

    def ReserveCapturedGraph(self):
        return self.free.pop() if self.free else CapturedGraphInfo()

    def ReleaseCapturedGraph(self, info):
        info.binding.clear()                   # the generator's OrtValues are gone with it
        self.free.append(info)


class Embeddings:
    """``inputs_embeds`` of one state: ``Output`` in the embedding model, ``Input`` in the text model."""

    def __init__(self, model, mode, info, owns_tensor):
        self.model, self.mode, self.info, self.owns_tensor = model, mode, info, owns_tensor
        self.embeddings = None

    def UpdateSequenceLength(self, use_static_buffer):
        if not self.owns_tensor:
            return
        if use_static_buffer and self.info is not None:
            if self.info.sb_embeddings is None:
                self.info.sb_embeddings = torch.zeros(1, 1, HIDDEN, device=self.model.device)
            self.embeddings = self.info.sb_embeddings                      # CreateTensorOnStaticBuffer
        else:
            self.embeddings = torch.zeros(1, 1, HIDDEN, device=self.model.device)   # allocator_device_

    def ReuseEmbeddingsBuffer(self, other):
        self.embeddings = other.embeddings


class MultiModalPipelineState:
    def __init__(self, model, variant):
        self.model, self.variant = model, variant
        self.info = model.captured_graph_pool.ReserveCapturedGraph()
        fix = variant == "fix"
        # before the fix the embedding model (built with no captured-graph info) creates the tensor
        self.embedding_out = Embeddings(model, "Output", None if not fix else self.info, owns_tensor=not fix)
        self.decoder_in = Embeddings(model, "Input", self.info, owns_tensor=fix)

    def Run(self, token, graphed):
        input_ids = torch.tensor([[token]], device=self.model.device)
        if self.embedding_out.embeddings is None and self.decoder_in.embeddings is None:
            owner, other = ((self.decoder_in, self.embedding_out) if self.variant == "fix"
                            else (self.embedding_out, self.decoder_in))
            owner.UpdateSequenceLength(use_static_buffer=graphed)
            other.ReuseEmbeddingsBuffer(owner)
        self.model.embedding_session(input_ids, self.embedding_out.embeddings)
        if not graphed:
            return self.model.text_session(self.decoder_in.embeddings)
        info = self.info
        info.binding["inputs_embeds"] = self.decoder_in.embeddings
        if info.graph is None:                 # the first decode run of the first generator is captured
            binding = info.binding
            info.graph, info.logits = capture(lambda: self.model.text_session(binding["inputs_embeds"]),
                                              device=self.model.device, on_freed="reuse", name="text model decode",
                                              static={"inputs_embeds": self.decoder_in.embeddings},
                                              owner="onnxruntime-genai CapturedGraphInfo")
        return replay(info.graph, info.logits).clone()

    def destroy(self):
        self.model.captured_graph_pool.ReleaseCapturedGraph(self.info)
        self.embedding_out = self.decoder_in = None


def run(variant: str, device: str = "cpu"):
    model = MultiModalVisionModel(device)
    requests = [([3, 5], [1, 7, 2]), ([6, 9], [4, 8, 0])]             # (prompt, tokens fed at decode steps)

    def serve(graphed: bool):
        outs = []
        for i, (prompt, decode_tokens) in enumerate(requests):
            with reuse_freed_blocks():
                # the request's first allocations (its prompt ids: 16 bytes, like the freed embeddings)
                prompt_ids = torch.tensor(prompt, device=device).clone()
                state = MultiModalPipelineState(model, variant)
                for t in decode_tokens:
                    outs.append(state.Run(t, graphed))
                state.destroy()                                          # the generator is destroyed
                del state, prompt_ids
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
