"""MRV2 Eagle: the captured draft loop was given no ``draft_logits_out``, so replays never write the draft logits.

Upstream: https://github.com/vllm-project/vllm/pull/37639 ("[Model Runner V2] Fix draft logits not populated
during cudagraph replay").
Symptom: with Model Runner V2, Eagle/Eagle3/MTP speculative decoding, probabilistic rejection sampling
(temperature > 0) and CUDA graphs on, acceptance rates drop and sampled tokens follow a wrong distribution;
eager is fine. No error is raised (vLLM main, March 2026).
Mechanism: ``EagleSpeculator.propose`` received ``draft_logits_out`` (a buffer of ``RequestState``) and
passed it to ``generate_draft``, which writes the draft logits of speculative steps 1+ into it when it is
not None. The ``EagleCudaGraphManager`` captured ``generate_draft`` without that argument: at capture the
Python check ``draft_logits_out is not None`` was False, so the graph contains no write of draft logits. Every
replay samples draft tokens but leaves the logits buffer holding what an earlier eager step put there; the
probabilistic rejection sampler then computes ``min(1, p_target / p_draft)`` and the recovered
distribution from stale draft probabilities.
Doctor: warmup-divergence, at ``capture`` (the capture decided ``draft_logits_out is None`` and replays keep
that branch, while an eager step writes the logits).
Fix (upstream): move ``draft_logits`` from ``RequestState`` into ``EagleSpeculator`` (like
``draft_tokens``), so ``generate_draft`` always writes the speculator-owned buffer and the captured graph
contains the write.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/37639"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "capture"
SYMPTOM = "rejection sampling uses stale draft logits for speculative steps 1+ (low acceptance, wrong distribution)"
VOCAB, HIDDEN, NUM_SPEC, MAX_NUM_REQS = 6, 4, 3, 2


class DraftModel:
    def __init__(self, device):
        gen = generator(37639)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.w_h = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device)

    def forward(self, input_ids, hidden_states):
        return torch.tanh(self.embed[input_ids] + hidden_states @ self.w_h)

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head


class RequestState:
    def __init__(self, device):
        # before the fix: the draft logits live here and reach the speculator as ``draft_logits_out``
        self.draft_logits = torch.zeros(MAX_NUM_REQS, NUM_SPEC, VOCAB, device=device)


def gumbel_sample(logits, gumbel):
    return torch.argmax(logits + gumbel, dim=-1)


class EagleSpeculator:
    def __init__(self, model, device, variant):
        self.model = model
        self.variant = variant
        self.input_ids = torch.zeros(MAX_NUM_REQS, dtype=torch.long, device=device)
        self.hidden_states = torch.zeros(MAX_NUM_REQS, HIDDEN, device=device)
        self.gumbel = torch.zeros(NUM_SPEC, MAX_NUM_REQS, VOCAB, device=device)
        self.draft_tokens = torch.zeros(MAX_NUM_REQS, NUM_SPEC, dtype=torch.long, device=device)
        if variant == "fix":                                   # the fix: the speculator owns the buffer
            self.draft_logits = torch.zeros(MAX_NUM_REQS, NUM_SPEC, VOCAB, device=device)
        self.cudagraph_manager = None

    def generate_draft(self, num_reqs, draft_logits_out=None):
        """Speculative steps 1..NUM_SPEC-1 (the part run under the draft FULL graph)."""
        if self.variant == "fix":
            draft_logits_out = self.draft_logits
        input_ids = self.input_ids[:num_reqs]
        hidden = self.hidden_states[:num_reqs]
        for step in range(1, NUM_SPEC):
            hidden = self.model.forward(input_ids, hidden)
            logits = self.model.compute_logits(hidden)
            if draft_logits_out is not None:                    # decided once, at capture
                draft_logits_out[:num_reqs, step].copy_(logits)
            tokens = gumbel_sample(logits, self.gumbel[step, :num_reqs])
            self.draft_tokens[:num_reqs, step].copy_(tokens)
            input_ids = tokens
        return self.draft_tokens

    def capture(self, num_reqs, device):
        """``EagleCudaGraphManager.capture``: the draft loop is captured with no ``draft_logits_out``."""
        g, out = capture(lambda: self.generate_draft(num_reqs), device=device,
                         static={"input_ids": self.input_ids, "hidden_states": self.hidden_states,
                                 "gumbel": self.gumbel}, owner="EagleCudaGraphManager")
        self.cudagraph_manager = (g, out)

    def propose(self, num_reqs, last_ids, last_hidden, gumbel, draft_logits_out, use_cudagraph):
        self.gumbel[:, :num_reqs].copy_(gumbel)
        # step 0 (the draft prefill, run outside the decode graph) writes the step-0 logits itself
        hidden = self.model.forward(last_ids, last_hidden)
        logits = self.model.compute_logits(hidden)
        out = draft_logits_out if self.variant == "bug" else self.draft_logits
        out[:num_reqs, 0].copy_(logits)
        tokens = gumbel_sample(logits, self.gumbel[0, :num_reqs])
        self.draft_tokens[:num_reqs, 0].copy_(tokens)
        self.input_ids[:num_reqs].copy_(tokens)
        self.hidden_states[:num_reqs].copy_(hidden)
        if use_cudagraph:
            g, static_out = self.cudagraph_manager
            replay(g, static_out)
        else:
            self.generate_draft(num_reqs, draft_logits_out)
        return self.draft_tokens[:num_reqs]

    def get_draft_logits(self, req_states, num_reqs):
        return (req_states.draft_logits if self.variant == "bug" else self.draft_logits)[:num_reqs]


def probabilistic_rejection_sample(target_logits, draft_logits, draft_tokens):
    """Per-position acceptance probability min(1, p/q) of each draft token, and the recovered
    distribution max(0, p - q) (normalised) the sampler draws a rejected position from."""
    p = torch.softmax(target_logits, -1)
    q = torch.softmax(draft_logits, -1)
    p_tok = p.gather(-1, draft_tokens[..., None]).squeeze(-1)
    q_tok = q.gather(-1, draft_tokens[..., None]).squeeze(-1)
    accept_prob = torch.clamp(p_tok / q_tok, max=1.0)
    residual = torch.clamp(p - q, min=0.0)
    recovered = residual / residual.sum(-1, keepdim=True).clamp(min=1e-6)
    return accept_prob, recovered


def run(variant: str, device: str = "cpu"):
    model = DraftModel(device)
    gen = generator(1)
    w_target = randn(HIDDEN, VOCAB, gen=gen, device=device)
    steps = [(torch.randint(0, VOCAB, (MAX_NUM_REQS,), generator=gen).to(device),
              randn(MAX_NUM_REQS, HIDDEN, gen=gen, device=device),
              -torch.log(-torch.log(torch.rand(NUM_SPEC, MAX_NUM_REQS, VOCAB, generator=gen) * 0.98 + 0.01))
              .to(device)) for _ in range(3)]

    def serve(graphed: bool):
        spec = EagleSpeculator(model, device, variant)
        req_states = RequestState(device)
        num_reqs = MAX_NUM_REQS
        if graphed:
            spec.capture(num_reqs, device)
        outs = []
        for last_ids, last_hidden, gumbel in steps:
            draft_tokens = spec.propose(num_reqs, last_ids, last_hidden, gumbel, req_states.draft_logits, graphed)
            draft_tokens = draft_tokens.clone()
            # target verification of the drafted positions (a stand-in for the target forward)
            target_logits = torch.tanh(model.embed[draft_tokens]) @ w_target
            accept_prob, recovered = probabilistic_rejection_sample(
                target_logits, spec.get_draft_logits(req_states, num_reqs), draft_tokens)
            outs += [draft_tokens.float(), accept_prob, recovered]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
