"""EAGLE draft-extend hands out pruned ``hidden_states`` as a view of the graph's output buffer; a later replay overwrites them.

Upstream: https://github.com/sgl-project/sglang/pull/35546 ("[EAGLE] Prune draft-extend logits to selected
rows"); the defect was raised in its review (Qiaolin-Yu) and fixed before merge in commit 4155e66851.
Symptom: (review) "previously, consumer of this will call ``hidden_states[select_index]``, which implicitly
created a new tensor space"; after pruning, the selected hidden states handed to the draft stay backed by the
captured graph's output buffer "so later replays can overwrite them" (sglang main, August 2026).
Mechanism: ``EAGLEDraftExtendCudaGraphRunner.execute`` replays the draft-extend graph and, after the PR, builds
``LogitsProcessorOutput(hidden_states=out.hidden_states[:raw_bs])``: the rows are already the selected ones,
so the worker no longer gathers them with ``hidden_states[select_index]`` (which used to copy) and stores the
slice itself in ``spec_info.hidden_states``. That slice aliases the graph's static output. When the same graph
is replayed for another batch (the next micro-batch / overlap batch) before the first batch's draft decode
consumes its ``spec_info``, the first batch drafts from the second batch's hidden states.
Doctor: overwritten-output, at ``execute`` (it hands out a view of the graph output that outlives the next
replay; the draft step of the first batch reads it after that replay).
Fix (upstream): ``hidden_states=out.hidden_states[:raw_bs].clone()``: the selected hidden states are cloned
before leaving the captured graph's output buffer.
(Read: the review thread's diff of ``execute`` and the author's reply naming the fix commit; the commit's own
diff was not opened. Tiny draft model; two batches served by one draft-extend graph of size 2.)
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/35546"
FAMILY = "dangling references"
KIND = "overwritten-output"
SITE = "execute"
SYMPTOM = "a batch's draft tokens are proposed from another batch's draft-extend hidden states"

VOCAB, DIM, NUM_TOKENS_PER_BS, MAX_BS = 12, 4, 2, 2


class DraftModel:
    def __init__(self, device):
        gen = generator(35546)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.w = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.7)

    def extend(self, input_ids, select_index):
        """Draft extend over every accepted token; returns the selected (last accepted) rows only."""
        h = torch.tanh(self.emb[input_ids] @ self.w)
        hidden = h[select_index]
        return hidden @ self.lm_head, hidden

    def decode(self, hidden_states):
        return torch.tanh(hidden_states @ self.w) @ self.lm_head


@dataclasses.dataclass
class LogitsProcessorOutput:
    next_token_logits: torch.Tensor
    hidden_states: torch.Tensor


@dataclasses.dataclass
class EagleDraftInput:
    hidden_states: torch.Tensor | None = None


class EAGLEDraftExtendCudaGraphRunner:
    def __init__(self, model, device, variant):
        self.model, self.variant = model, variant
        self.input_ids = torch.zeros(MAX_BS * NUM_TOKENS_PER_BS, dtype=torch.long, device=device)
        self.select_index = torch.zeros(MAX_BS, dtype=torch.long, device=device)
        self.graph, self.out = capture(
            lambda: model.extend(self.input_ids, self.select_index), device=device,
            owner="EAGLEDraftExtendCudaGraphRunner",
            static={"input_ids": self.input_ids, "select_index": self.select_index})

    def execute(self, input_ids, select_index):
        raw_bs = select_index.shape[0]
        self.input_ids.copy_(input_ids)
        self.select_index.copy_(select_index)
        logits, hidden = replay(self.graph, self.out)
        if self.variant == "fix":
            return LogitsProcessorOutput(logits[:raw_bs], hidden[:raw_bs].clone())
        return LogitsProcessorOutput(logits[:raw_bs], hidden[:raw_bs])


class EAGLEWorker:
    def __init__(self, model, device, variant, graphed):
        self.model, self.graphed = model, graphed
        self.runner = EAGLEDraftExtendCudaGraphRunner(model, device, variant) if graphed else None

    def forward_draft_extend(self, spec_info, input_ids, select_index):
        if self.graphed:
            out = self.runner.execute(input_ids, select_index)
        else:
            logits, hidden = self.model.extend(input_ids, select_index)
            out = LogitsProcessorOutput(logits, hidden)
        spec_info.hidden_states = out.hidden_states
        return out.next_token_logits.clone()

    def draft(self, spec_info):
        return self.model.decode(spec_info.hidden_states).clone()


def run(variant: str, device: str = "cpu"):
    model = DraftModel(device)

    def t(xs):
        return torch.tensor(xs, dtype=torch.long).to(device)

    def serve(graphed: bool):
        worker = EAGLEWorker(model, device, variant, graphed)
        outs = []
        for step in range(2):
            a, b = EagleDraftInput(), EagleDraftInput()
            # draft extend of both batches (one graph), then each batch's draft decode
            outs.append(worker.forward_draft_extend(a, t([1 + step, 3, 5, 7]), t([1, 2])))
            outs.append(worker.forward_draft_extend(b, t([2, 4 + step, 6, 8]), t([1, 3])))
            outs.append(worker.draft(a))
            outs.append(worker.draft(b))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
