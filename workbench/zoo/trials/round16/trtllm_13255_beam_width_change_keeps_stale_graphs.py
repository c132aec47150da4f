"""A beam-width change reallocates the runtime buffers, but the cached CUDA graphs still point at the old ones.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/13255 ("[https://nvbugs/6052050][fix] Drop stale CUDA
graphs on beam-width change").
Symptom: multi-beam serving through the C++ inflight-batching executor with CUDA graphs enabled fails with "an
illegal memory access was encountered" after the operating beam width changed (nvbug 6052050; TensorRT-LLM main,
April 2026); with CUDA graphs off it runs.
Mechanism: ``TrtGptModelInflightBatching`` keeps one ``CudaGraphExecutorCache`` per runtime buffer, keyed by the
batch state (context/generation request counts, token count). Each cached graph was captured around the engine
execution and bakes in the addresses of that buffer set's input ids, position ids and output logits.
``changeBeamWidth()`` calls ``createBuffers()`` and ``createDecoder()``, which replace ``mBuffers`` (and the
decoder state) with freshly allocated tensors sized for the new operating beam width; the old ones are released.
The executor caches were not invalidated, so the next generation step whose batch state matches a cached entry
launches a graph that reads the released input buffers and writes logits the decoder no longer looks at.
Doctor: dangling-reference, at ``changeBeamWidth`` (the buffers a cached graph reads are released while the graph
stays in the cache).
Fix (upstream): ``changeBeamWidth()`` clears every ``mCudaGraphExecutorCaches`` entry before reallocating, so
the graphs are re-captured lazily, against the new buffers, on the next forward step.
(Modelled in Python after the C++ executor: the TRT engine is a small embedding + LM head, the beam search is a
per-beam argmax; batch states are keyed by request and token counts.)
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/13255"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "changeBeamWidth"
SYMPTOM = "illegal memory access: a cached generation graph replays against runtime buffers freed by changeBeamWidth"
VOCAB, HIDDEN, MAX_BATCH, MAX_BEAM, MAX_SEQ = 13, 4, 2, 2, 16


@dataclasses.dataclass(frozen=True)
class BatchState:
    """``RuntimeBuffers::getBatchState()``: the key of the CUDA graph executor cache."""

    numCtxRequests: int
    numGenRequests: int
    numTokens: int


class TllmRuntime:
    """The TRT engine: reads the bound input tensors, writes the bound logits tensor."""

    def __init__(self, device):
        gen = generator(13255)
        self.embedding = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.position_embedding = randn(MAX_SEQ, HIDDEN, gen=gen, device=device, scale=0.5)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device)

    def executeContext(self, buffers, numTokens: int):
        hidden = self.embedding[buffers.inputIds[:numTokens]] + self.position_embedding[buffers.positionIds[:numTokens]]
        buffers.logits[:numTokens].copy_(torch.tanh(hidden) @ self.lm_head)
        return buffers.logits[:numTokens]


class RuntimeBuffers:
    """Input/output tensors bound to the engine, sized for ``maxBatchSize * beamWidth`` generation tokens."""

    def __init__(self, maxBatchSize: int, beamWidth: int, device):
        numTokens = maxBatchSize * beamWidth
        self.inputIds = torch.zeros(numTokens, dtype=torch.long, device=device)
        self.positionIds = torch.zeros(numTokens, dtype=torch.long, device=device)
        self.logits = torch.zeros(numTokens, VOCAB, device=device)


class LlmRequest:
    def __init__(self, prompt, beamWidth):
        self.beamWidth = beamWidth
        self.tokens = [list(prompt) for _ in range(beamWidth)]       # one token list per beam


class TrtGptModelInflightBatching:
    def __init__(self, device, variant, cuda_graph_mode: bool):
        self.device, self.variant, self.mCudaGraphMode = device, variant, cuda_graph_mode
        self.mRuntime = TllmRuntime(device)
        self.mOperatingBeamWidth = MAX_BEAM
        self.mCudaGraphExecutorCaches = [dict()]                      # one cache per buffer id (bufferId 0)
        self.createBuffers()
        self.createDecoder()

    def createBuffers(self):
        self.mBuffers = [RuntimeBuffers(MAX_BATCH, self.mOperatingBeamWidth, self.device)]

    def createDecoder(self):
        self.mDecoderState = torch.zeros(MAX_BATCH, self.mOperatingBeamWidth, dtype=torch.long, device=self.device)

    def changeBeamWidth(self, beamWidth: int):
        assert beamWidth <= MAX_BEAM
        if self.variant == "fix":
            # The buffers below are reallocated: graphs captured against the old ones must go.
            for cache in self.mCudaGraphExecutorCaches:
                cache.clear()
        self.mOperatingBeamWidth = beamWidth
        self.createBuffers()
        self.createDecoder()

    def prepareBuffers(self, requests, bufferId=0):
        buffers = self.mBuffers[bufferId]
        ids, pos = [], []
        for request in requests:
            for beam in request.tokens:
                ids.append(beam[-1])
                pos.append(len(beam) - 1)
        n = len(ids)
        buffers.inputIds[:n].copy_(torch.tensor(ids, device=self.device))
        buffers.positionIds[:n].copy_(torch.tensor(pos, device=self.device))
        return BatchState(0, len(requests), n)

    def executeContext(self, batchState, bufferId=0):
        numTokens = batchState.numTokens
        if not self.mCudaGraphMode:
            return self.mRuntime.executeContext(self.mBuffers[bufferId], numTokens)
        cache = self.mCudaGraphExecutorCaches[bufferId]
        if batchState not in cache:
            # No graph for this batch state yet: capture one around the engine execution. The graph reads and
            # writes whatever buffers ``mBuffers`` holds now, by address.
            g, logits = capture(lambda: self.mRuntime.executeContext(self.mBuffers[bufferId], numTokens),
                                device=self.device, name=f"generation {batchState}",
                                static={"inputIds": self.mBuffers[bufferId].inputIds,
                                        "positionIds": self.mBuffers[bufferId].positionIds},
                                owner="TrtGptModelInflightBatching (CudaGraphExecutor)")
            cache[batchState] = (g, logits)
        g, logits = cache[batchState]
        replay(g, logits)
        return self.mBuffers[bufferId].logits[:numTokens]         # the decoder reads the current buffers

    def forwardAsync(self, requests):
        batchState = self.prepareBuffers(requests)
        logits = self.executeContext(batchState).clone()
        # Decoder: beam b of each request takes the (b+1)-th best token of its own row.
        row = 0
        for request in requests:
            for b, beam in enumerate(request.tokens):
                beam.append(int(torch.topk(logits[row], b + 1).indices[-1]))
                row += 1
        return logits


def run(variant: str, device: str = "cpu"):
    def serve(graphed: bool):
        model = TrtGptModelInflightBatching(device, variant, cuda_graph_mode=graphed)
        outs = []
        # Beam width 2 (the configured max): two requests decode; the graph for (0 ctx, 2 gen, 4 tokens) is cached.
        requests = [LlmRequest([3, 5], 2), LlmRequest([7], 2)]
        for _ in range(2):
            outs.append(model.forwardAsync(requests))
        # A request with beam width 1 arrives once the batch drained: the executor switches the operating width.
        model.changeBeamWidth(1)
        requests = [LlmRequest([2, 9, 4], 1), LlmRequest([6, 1], 1)]
        for _ in range(2):
            outs.append(model.forwardAsync(requests))
        # Back to beam width 2: the buffers are reallocated again and the first batch state comes back.
        model.changeBeamWidth(2)
        requests = [LlmRequest([8, 3], 2), LlmRequest([5, 5, 2], 2)]
        for _ in range(2):
            outs.append(model.forwardAsync(requests))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
