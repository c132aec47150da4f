"""The EAGLE draft-extend graph sizes its logits buffer from the full vocab while FR-Spec's draft head is hot-vocab only.

Upstream: https://github.com/sgl-project/sglang/pull/28856 ("[Spec] Enable FR-Spec in EAGLE draft-extend CUDA graph
by sizing logits buffer from the draft head").
Symptom: EAGLE speculative decoding with FR-Spec (``--speculative-token-map``): capturing the draft-extend CUDA graph
crashed (a shape mismatch copying the draft logits into the graph's logits buffer), so the draft-extend step could
not run as a graph (FlashInfer had a guard that skipped the graph when a token map was set and ran it eagerly);
eager draft-extend was fine (sglang main, June 2026).
Mechanism: ``EAGLEDraftExtendCudaGraphRunner.__init__`` allocates the static ``next_token_logits_buffer`` that the
captured draft forward writes its logits into, one row per request and ``vocab`` columns, where ``vocab`` is read
from the draft model's ``hf_config`` (``hot_vocab_size`` when present, else ``vocab_size``). FR-Spec injects the
reduced draft vocabulary through a late ``json_model_override_args``, so the draft ``hf_config`` has no
``hot_vocab_size`` and the buffer gets the full target vocabulary, while the draft ``lm_head`` was already cut to the
``len(hot_token_id)`` hot rows. The draft forward run by the capture (its warmup) copies ``[bs, hot_vocab]`` logits
into the ``[bs, vocab]`` static buffer: the data does not fit the buffer and the capture raises. Eager draft-extend
passes no buffer and keeps the logits it computed.
Doctor: undersized-buffer, at ``_copy_logits_to_buffer`` (it writes the draft logits into a static graph buffer whose
width they do not fit; the width was fixed when the runner sized the buffer from ``hf_config``).
Fix (upstream): size ``next_token_logits_buffer`` from the worker's reduced head (``len(hot_token_id)``) instead of
the draft ``hf_config``, and drop the FlashInfer ``speculative_token_map is None`` guard so FR-Spec runs the
draft-extend graph.
(Read from the PR description only; the diff itself was not available to me. Tiny model: vocab 16, hot vocab 6,
draft-extend graph for batch size 4 with 2 tokens per request, top-k 2; steps of 3 and 4 requests.)
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/28856"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "_copy_logits_to_buffer"
SYMPTOM = "draft-extend graph capture raises: hot-vocab draft logits copied into a full-vocab logits buffer"

VOCAB, HIDDEN, TOPK = 16, 4, 2
HOT_TOKEN_ID = [1, 3, 4, 8, 10, 15]          # FR-Spec token map: the draft head's vocabulary
CAPTURE_BS = [4]
NUM_TOKENS_PER_BS = 2                         # draft-extend: the accepted tokens of each request


class HFConfig:
    """The draft ``hf_config``: the FR-Spec override arrives late, so ``hot_vocab_size`` is absent."""

    def __init__(self):
        self.vocab_size = VOCAB


class LogitsMetadata:
    def __init__(self, next_token_logits_buffer=None):
        self.next_token_logits_buffer = next_token_logits_buffer


class LogitsProcessor:
    def forward(self, hidden_states, lm_head, logits_metadata):
        logits = hidden_states @ lm_head.T                 # [rows, hot_vocab] with the reduced head
        return self._copy_logits_to_buffer(logits, logits_metadata)

    def _copy_logits_to_buffer(self, logits, logits_metadata):
        logits_buffer = logits_metadata.next_token_logits_buffer
        if logits_buffer is None:                          # eager: the logits keep their own shape
            return logits.float()
        logits_buffer.copy_(logits)                        # the graph's static logits buffer
        return logits_buffer


class DraftModel:
    """EAGLE draft layer whose ``lm_head`` holds only the hot-vocab rows (FR-Spec)."""

    def __init__(self, device):
        gen = generator(28856)
        self.config = HFConfig()
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.fc = randn(2 * HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6)
        full_head = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.hot_token_id = torch.tensor(HOT_TOKEN_ID, device=device)
        self.lm_head = full_head[self.hot_token_id]        # [HOT_VOCAB, HIDDEN]
        self.logits_processor = LogitsProcessor()

    def forward(self, input_ids, hidden_states, logits_metadata):
        h = torch.tanh(torch.cat([self.embed[input_ids], hidden_states], -1) @ self.fc)
        last = h.view(-1, NUM_TOKENS_PER_BS, HIDDEN)[:, -1]   # the last accepted token of each request
        return self.logits_processor.forward(last, self.lm_head, logits_metadata), last


def draft_extend_forward(model, input_ids, hidden_states, logits_metadata):
    """What the draft-extend runner captures: the draft forward, softmax and top-k over the draft logits."""
    logits, last = model.forward(input_ids, hidden_states, logits_metadata)
    topk_p, topk_index = torch.softmax(logits, dim=-1).topk(TOPK, dim=-1)
    return topk_p, topk_index, last


class EAGLEDraftExtendCudaGraphRunner:
    def __init__(self, model, hot_token_id, device, variant):
        self.model = model
        self.max_bs = max(CAPTURE_BS)
        max_num_token = self.max_bs * NUM_TOKENS_PER_BS
        self.input_ids = torch.zeros(max_num_token, dtype=torch.long, device=device)
        self.hidden_states = torch.zeros(max_num_token, HIDDEN, device=device)
        if variant == "bug":
            cfg = model.config
            vocab = getattr(cfg, "hot_vocab_size", None) or cfg.vocab_size
        else:
            vocab = len(hot_token_id)                      # size from the draft head the graph runs
        self.next_token_logits_buffer = torch.zeros(self.max_bs, vocab, device=device)
        self.graphs, self.outputs = {}, {}
        for bs in sorted(CAPTURE_BS, reverse=True):
            n = bs * NUM_TOKENS_PER_BS
            meta = LogitsMetadata(self.next_token_logits_buffer[:bs])
            self.graphs[bs], self.outputs[bs] = capture(
                lambda n=n, meta=meta: draft_extend_forward(
                    self.model, self.input_ids[:n], self.hidden_states[:n], meta),
                device=device, owner="EAGLEDraftExtendCudaGraphRunner", name=f"draft extend bs {bs}",
                static={"input_ids": self.input_ids, "hidden_states": self.hidden_states})

    def replay(self, input_ids, hidden_states):
        raw_bs = input_ids.shape[0] // NUM_TOKENS_PER_BS
        bs = min(b for b in CAPTURE_BS if b >= raw_bs)
        raw_n, n = raw_bs * NUM_TOKENS_PER_BS, bs * NUM_TOKENS_PER_BS
        if raw_n < n:                                      # padded requests: neutral inputs
            self.input_ids[raw_n:n].zero_()
            self.hidden_states[raw_n:n].zero_()
        self.input_ids[:raw_n].copy_(input_ids)
        self.hidden_states[:raw_n].copy_(hidden_states)
        topk_p, topk_index, last = replay(self.graphs[bs], self.outputs[bs], real=raw_bs, size=bs)
        return topk_p[:raw_bs], topk_index[:raw_bs], last[:raw_bs]


def run(variant: str, device: str = "cpu"):
    model = DraftModel(device)
    gen = generator(5)
    steps = []
    for raw_bs in (4, 3, 4, 3):
        n = raw_bs * NUM_TOKENS_PER_BS
        steps.append((torch.randint(0, VOCAB, (n,), generator=gen).to(device),
                      randn(n, HIDDEN, gen=gen, device=device)))

    def worker_outputs(topk_p, topk_index, last):
        # EAGLEWorker: map the draft's hot-vocab ids back to target token ids.
        return [topk_p.clone(), model.hot_token_id[topk_index].clone(), last.clone()]

    def served():
        runner = EAGLEDraftExtendCudaGraphRunner(model, model.hot_token_id, device, variant)
        outs = []
        for ids, hs in steps:
            outs += worker_outputs(*runner.replay(ids, hs))
        return outs

    def eager():
        outs = []
        for ids, hs in steps:
            outs += worker_outputs(*draft_extend_forward(model, ids, hs, LogitsMetadata(None)))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
