"""The draft-extend graph copies a hot-vocab draft head's logits into the full-vocab shared logits buffer.

Upstream: https://github.com/sgl-project/sglang/pull/29943 ("Fix shared logits buffer for reduced-vocab draft
models"), fixing a regression of https://github.com/sgl-project/sglang/pull/29779 ("Share one logits output
buffer across prefill/decode/draft cuda-graph runners").
Symptom: EAGLE / FR-Spec with ``--speculative-token-map`` failed at CUDA graph capture with
``RuntimeError: The size of tensor a (128256) must match the size of tensor b (32768) at non-singleton dimension
1`` (CI ``test_spec_eagle_topk.py::TestEagleLlama3TokenMap``); standalone speculation hit the same copy with a
``[1, 128256]`` shared buffer and ``[8, 128256]`` logits (July 2026).
Mechanism: #29779 lets every CUDA-graph runner write its next-token logits into one shared output buffer of the
model runner, sized ``(max_decode_logits_rows(), vocab_size)`` for the *target* decode graph; the draft-extend
runner hands the captured forward ``next_token_logits_buffer = shared[:bs]``. With a token map the draft
``lm_head`` is sliced to the hot vocabulary, but the draft's ``LogitsProcessor`` still carries the full target
``vocab_size``. ``LogitsProcessor._copy_logits_to_buffer`` then does
``logits_buffer.copy_(logits[:, : self.vocab_size])``: the ``[bs, hot_vocab]`` logits do not fit the
``[bs, vocab]`` static buffer, and the warmup run inside the capture raises. Eager forwards carry no buffer and
return ``logits.float()``.
Doctor: undersized-buffer, at ``_copy_logits_to_buffer`` (it writes data into a static graph buffer whose
shape the data does not fit).
Fix (upstream): ``_copy_logits_to_buffer`` reuses the shared buffer only when ``tuple(logits_buffer.shape) ==
tuple(logits.shape)`` and otherwise returns a float copy of the logits with their own shape; logits are sliced
only when wider than ``vocab_size``. (Read from the PR description and the stored before/after versions of
``_copy_logits_to_buffer`` in ``logits_processor.py``.)
(Tiny model: vocab 16, hot vocab 8, draft-extend graph for batch size 2 with 2 tokens per request, top-k 2.)
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/29943"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "_copy_logits_to_buffer"
SYMPTOM = "draft-extend graph capture raises: hot-vocab logits copied into the full-vocab shared logits buffer"

VOCAB, HOT_VOCAB, HIDDEN, TOPK = 16, 8, 4, 2
CAPTURE_BS = [2]
NUM_TOKENS_PER_BS = 2                  # draft-extend: the accepted tokens of each request


class LogitsMetadata:
    def __init__(self, next_token_logits_buffer=None):
        self.next_token_logits_buffer = next_token_logits_buffer


class LogitsProcessor:
    def __init__(self, vocab_size, variant):
        self.vocab_size = vocab_size    # the draft runner carries the target's full vocab size
        self.variant = variant

    def forward(self, hidden_states, lm_head, logits_metadata):
        logits = hidden_states @ lm_head.T
        return self._copy_logits_to_buffer(logits, logits_metadata)

    def _copy_logits_to_buffer(self, logits, logits_metadata):
        logits_buffer = logits_metadata.next_token_logits_buffer
        if self.variant == "bug":
            if logits_buffer is not None:
                assert logits_buffer.dtype == torch.float
                logits_buffer.copy_(logits[:, : self.vocab_size])
                logits = logits_buffer
            else:
                logits = logits[:, : self.vocab_size].float()
            return logits
        if logits.shape[-1] > self.vocab_size:
            logits = logits[:, : self.vocab_size]
        # The shared logits buffer is keyed by vocab width and rows; skip it when this batch has a
        # different logits shape than the graph buffer.
        if logits_buffer is not None and tuple(logits_buffer.shape) == tuple(logits.shape):
            assert logits_buffer.dtype == torch.float
            logits_buffer.copy_(logits)
            logits = logits_buffer
        else:
            logits = logits.float()
        return logits


class DraftModel:
    """EAGLE draft layer with an FR-Spec head: ``lm_head`` holds only the hot-vocab rows."""

    def __init__(self, device, variant):
        gen = generator(29943)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.fc = randn(2 * HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6)
        full_head = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.hot_token_id = torch.tensor([0, 2, 3, 5, 7, 11, 13, 14], device=device)
        self.lm_head = full_head[self.hot_token_id]                       # [HOT_VOCAB, HIDDEN]
        self.logits_processor = LogitsProcessor(VOCAB, variant)

    def forward(self, input_ids, hidden_states, logits_metadata):
        h = torch.tanh(torch.cat([self.embed[input_ids], hidden_states], -1) @ self.fc)
        last = h.view(-1, NUM_TOKENS_PER_BS, HIDDEN)[:, -1]               # the last accepted token per request
        return self.logits_processor.forward(last, self.lm_head, logits_metadata), h


def draft_extend_forward(model, input_ids, hidden_states, logits_metadata):
    """What the draft-extend runner captures: the draft forward, softmax and top-k over the draft logits."""
    logits, h = model.forward(input_ids, hidden_states, logits_metadata)
    probs = torch.softmax(logits, dim=-1)
    topk_p, topk_index = probs.topk(TOPK, dim=-1)
    return topk_p, topk_index, h.view(-1, NUM_TOKENS_PER_BS, HIDDEN)[:, -1]


class ModelRunner:
    def __init__(self, device):
        # #29779: one next-token logits buffer shared by the prefill/decode/draft graph runners, sized
        # from the target decode graph (one row per request, full vocab).
        self.shared_logits_buffer = torch.zeros(self.max_decode_logits_rows(), VOCAB, device=device)

    def max_decode_logits_rows(self):
        return max(CAPTURE_BS) * 1


class EAGLEDraftExtendCudaGraphRunner:
    def __init__(self, model, model_runner, device):
        self.model = model
        max_bs = max(CAPTURE_BS)
        self.input_ids = torch.zeros(max_bs * NUM_TOKENS_PER_BS, dtype=torch.long, device=device)
        self.hidden_states = torch.zeros(max_bs * NUM_TOKENS_PER_BS, HIDDEN, device=device)
        self.graphs, self.outputs = {}, {}
        for bs in sorted(CAPTURE_BS, reverse=True):
            n = bs * NUM_TOKENS_PER_BS
            meta = LogitsMetadata(model_runner.shared_logits_buffer[:bs])
            self.graphs[bs], self.outputs[bs] = capture(
                lambda n=n, meta=meta: draft_extend_forward(
                    self.model, self.input_ids[:n], self.hidden_states[:n], meta),
                device=device, owner="EAGLEDraftExtendCudaGraphRunner", name=f"draft extend bs {bs}",
                static={"input_ids": self.input_ids, "hidden_states": self.hidden_states})

    def replay(self, input_ids, hidden_states, bs):
        n = bs * NUM_TOKENS_PER_BS
        self.input_ids[:n].copy_(input_ids)
        self.hidden_states[:n].copy_(hidden_states)
        return replay(self.graphs[bs], self.outputs[bs])


def run(variant: str, device: str = "cpu"):
    model = DraftModel(device, variant)
    gen = generator(7)
    steps = [(torch.randint(0, VOCAB, (2 * NUM_TOKENS_PER_BS,), generator=gen).to(device),
              randn(2 * NUM_TOKENS_PER_BS, HIDDEN, gen=gen, device=device)) for _ in range(3)]

    def worker_outputs(topk_p, topk_index, hidden):
        # EAGLEWorker: map hot-vocab ids back to the target vocabulary.
        return [topk_p.clone(), model.hot_token_id[topk_index].clone(), hidden.clone()]

    def served():
        runner = EAGLEDraftExtendCudaGraphRunner(model, ModelRunner(device), device)
        outs = []
        for ids, hs in steps:
            outs += worker_outputs(*runner.replay(ids, hs, bs=2))
        return outs

    def eager():
        outs = []
        for ids, hs in steps:
            outs += worker_outputs(*draft_extend_forward(model, ids, hs, LogitsMetadata(None)))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
