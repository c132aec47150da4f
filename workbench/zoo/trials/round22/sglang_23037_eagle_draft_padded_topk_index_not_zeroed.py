"""EAGLE draft graph padded for DP attention keeps stale padded topk_index slots; the draft step gathers them as token ids.

Upstream: https://github.com/sgl-project/sglang/pull/23037 ("[Bug Fix] Resolve EAGLE cuda graph IMA under PD + DP
+ MTP with GLM-5.1").
Symptom: long-running PD disaggregation + DP attention + MTP (GLM-5.1) decode crashed with
``vectorized_gather_kernel: index out of bounds`` (a CUDA illegal memory access) inside the EAGLE draft graph
replay (sglang main, April 2026).
Mechanism: ``EAGLEDraftCudaGraphRunner.replay`` pads the batch to a captured size (under DP attention to the
largest batch of any DP rank), resets ``seq_lens``/``out_cache_loc``/``positions``/``req_pool_indices`` when
``bs != raw_bs``, and copies the draft inputs ``topk_p``, ``topk_index`` and ``hidden_states`` into their static
buffers for ``[:raw_bs]`` only. The padded slots ``[raw_bs:bs]`` of those three keep whatever the (long-lived,
shared) buffers held -- the report shows ``topk_index = -4886055425978319163`` -- and the captured
``draft_forward`` runs every slot: ``select_top_k_tokens`` turns ``topk_index`` into the step's ``input_ids``
and the draft model's embedding gathers them, so one stale padded slot faults the whole replay.
Doctor: stale-padding, at ``replay`` (the draft inputs' padded slots are left as they were, and the captured
embedding gather over them takes every request's draft step down).
Fix (upstream): in the padding branch of ``replay`` also ``topk_p.zero_()``, ``topk_index.zero_()`` and
``hidden_states.zero_()``, so padded slots draft from token 0 with zero state. (The PR's other change, cloning
the draft-extend outputs before they go into ``spec_info``, was withdrawn in review.)
(Evidence: the PR description, review-thread hunks of ``replay``, and the runner's current code with those
zero-fills. Toy: topk 1, two draft steps, one capture size 4, two DP ranks. The stale slot is written once,
after capture, with the value the report quotes: the PR does not say which earlier writer left it.)
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/23037"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "replay"
SYMPTOM = "draft graph gathers a stale padded topk_index as a token id: index out of bounds (IMA upstream)"

VOCAB, HIDDEN, MAX_POS = 10, 4, 16
TOPK, SPECULATIVE_NUM_STEPS = 1, 2
CAPTURE_BS = [4]
STALE_TOPK_INDEX = -4886055425978319163     # the value the report found in a padded slot


class DraftModel:
    """MTP/EAGLE draft head: embed the drafted token, fuse with the carried hidden state, predict the next one."""

    def __init__(self, device):
        gen = generator(23037)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.pos_embed = randn(MAX_POS, HIDDEN, gen=gen, device=device, scale=0.5)
        self.fc = randn(2 * HIDDEN, HIDDEN, gen=gen, device=device, scale=0.7)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device)

    def forward(self, input_ids, positions, hidden_states):
        x = torch.cat([self.embed[input_ids], hidden_states], dim=-1) @ self.fc + self.pos_embed[positions]
        h = torch.tanh(x)
        return h @ self.lm_head, h


@dataclasses.dataclass
class EagleDraftInput:
    topk_p: torch.Tensor
    topk_index: torch.Tensor
    hidden_states: torch.Tensor


@dataclasses.dataclass
class ForwardBatch:
    batch_size: int
    positions: torch.Tensor
    spec_info: EagleDraftInput
    global_num_tokens_cpu: list


def select_top_k_tokens(i, topk_p, topk_index, hidden_states, scores):
    """topk == 1: the drafted token of each request is its next input id; scores multiply along the chain."""
    input_ids = topk_index.flatten()
    scores = topk_p if i == 0 else scores * topk_p
    return input_ids, hidden_states, scores


def draft_forward(model, positions, spec_info):
    """``EAGLEWorker.draft_forward``: the multi-step draft loop the runner captures."""
    topk_p, topk_index, hidden_states = spec_info.topk_p, spec_info.topk_index, spec_info.hidden_states
    score_list, token_list, scores = [], [], None
    for i in range(SPECULATIVE_NUM_STEPS):
        input_ids, hidden_states, scores = select_top_k_tokens(i, topk_p, topk_index, hidden_states, scores)
        score_list.append(scores)
        token_list.append(input_ids)
        if i == SPECULATIVE_NUM_STEPS - 1:
            break
        logits, hidden_states = model.forward(input_ids, positions + i + 1, hidden_states)
        topk_p, topk_index = torch.softmax(logits, dim=-1).topk(TOPK, dim=-1)
    return torch.cat(score_list, dim=1), torch.stack(token_list, dim=1)


class EAGLEDraftCudaGraphRunner:
    def __init__(self, model, device, variant):
        self.model, self.device, self.variant = model, device, variant
        self.max_bs = max(CAPTURE_BS)
        self.positions = torch.zeros(self.max_bs, dtype=torch.long, device=device)
        self.topk_p = torch.zeros(self.max_bs, TOPK, device=device)
        self.topk_index = torch.zeros(self.max_bs, TOPK, dtype=torch.long, device=device)
        self.hidden_states = torch.zeros(self.max_bs, HIDDEN, device=device)
        self.graphs = {}
        for bs in CAPTURE_BS:
            spec_info = EagleDraftInput(self.topk_p[:bs], self.topk_index[:bs], self.hidden_states[:bs])
            self.graphs[bs] = capture(lambda bs=bs, spec_info=spec_info: draft_forward(model, self.positions[:bs],
                                                                                       spec_info),
                                      device=device, name=f"draft decode bs {bs}", owner="EAGLEDraftCudaGraphRunner",
                                      static={"positions": self.positions, "topk_p": self.topk_p,
                                              "topk_index": self.topk_index, "hidden_states": self.hidden_states})

    def replay(self, forward_batch: ForwardBatch):
        raw_bs = forward_batch.batch_size
        # DP attention (require_mlp_tp_gather): pad to the largest batch of any DP rank.
        max_batch_size = max(forward_batch.global_num_tokens_cpu)
        bs = next(b for b in CAPTURE_BS if b >= max_batch_size)
        if bs != raw_bs:
            self.positions.zero_()
            if self.variant == "fix":
                self.topk_p.zero_()
                self.topk_index.zero_()
                self.hidden_states.zero_()
        spec_info = forward_batch.spec_info
        self.positions[:raw_bs].copy_(forward_batch.positions)
        self.topk_p[:raw_bs].copy_(spec_info.topk_p)
        self.topk_index[:raw_bs].copy_(spec_info.topk_index)
        self.hidden_states[:raw_bs].copy_(spec_info.hidden_states)
        left = {}
        if self.variant == "bug":
            left = {"topk_p": self.topk_p, "topk_index": self.topk_index, "hidden_states": self.hidden_states}
        g, out = self.graphs[bs]
        scores, tokens = replay(g, out, real=raw_bs, size=bs, padded=left)
        return scores[:raw_bs].clone(), tokens[:raw_bs].clone()


def run(variant: str, device: str = "cpu"):
    model = DraftModel(device)
    gen = generator(7)

    def batch(raw_bs, other_rank_bs):
        spec_info = EagleDraftInput(
            topk_p=torch.rand(raw_bs, TOPK, generator=gen).to(device),
            topk_index=torch.randint(0, VOCAB, (raw_bs, TOPK), generator=gen).to(device),
            hidden_states=randn(raw_bs, HIDDEN, gen=gen, device=device))
        positions = torch.randint(0, MAX_POS - SPECULATIVE_NUM_STEPS, (raw_bs,), generator=gen).to(device)
        return ForwardBatch(raw_bs, positions, spec_info, [raw_bs, other_rank_bs])

    # This rank's decode batches; the other DP rank runs 4 then 3 requests, so both steps pad to 4.
    batches = [batch(3, 4), batch(2, 3)]

    def eager():
        return [t for fb in batches for t in draft_forward(model, fb.positions, fb.spec_info)]

    def served():
        runner = EAGLEDraftCudaGraphRunner(model, device, variant)
        # Long-running serving: by now the buffer's padded tail holds bytes that are no token id.
        runner.topk_index[runner.max_bs - 1] = STALE_TOPK_INDEX
        return [t for fb in batches for t in runner.replay(fb)]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
