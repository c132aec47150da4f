"""A FULL-graph draft sampler's padded request rows write draft logits through stale ``idx_mapping`` entries.

Upstream: https://github.com/vllm-project/vllm/pull/47066 ("[Model Runner V2][Spec Decode] Fix stale values in
idx_mapping from CG num reqs padding").
Symptom: Model Runner V2 with MTP/EAGLE speculative decoding, ``draft_sample_method="probabilistic"`` and FULL
CUDA graphs (e.g. DeepSeek-V4-Flash, TP4) returns incorrect or gibberish text; eager drafting, or greedy draft
sampling, is clean (vLLM main, June 2026).
Mechanism: under FULL graphs the speculator's ``num_reqs`` is padded up to the next capture size, and
``sample_draft`` runs inside the graph over the padded rows. ``gumbel_sample`` stores each row's draft logits
into the persistent ``draft_logits`` cache at ``draft_logits[idx_mapping[row], draft_step]`` (the rejection
sampler later reads them back per request state). ``_copy_request_inputs`` refreshed only
``idx_mapping[:num_reqs]``: the padded rows kept request-state indices from an earlier, larger batch. A padded
row therefore overwrote the draft logits of a live request that is not in this step (a request not scheduled
this step, whose drafts are still to be verified) with the logits of a padding token. When that request is
verified, the rejection sampler divides by a corrupted draft distribution.
Doctor: stale-padding, at ``_copy_request_inputs`` (real requests' draft logits depend on the request-state
ids that padded rows of ``idx_mapping`` still hold).
Fix (upstream): ``_copy_request_inputs`` fills ``idx_mapping[num_reqs:]`` with -1, and the Gumbel kernel
treats ``req_state_idx < 0`` as an invalid request whose logits it does not store (``is_valid_req``).
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/47066"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "_copy_request_inputs"
SYMPTOM = "a request skipped for one step is verified against draft logits a padded row overwrote (gibberish)"
VOCAB, DIM, MAX_NUM_REQS, NUM_SPEC = 6, 4, 4, 1
CAPTURE_SIZE = 4                                  # cudagraph_capture_sizes for the speculator: [4]


class DraftModel:
    def __init__(self, device):
        gen = generator(47066)
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device)
        self.bias = randn(VOCAB, gen=gen, device=device, scale=0.5)

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head + self.bias


def gumbel_sample(logits, expanded_idx_mapping, temperature, logits_cache, logits_cache_col: int):
    """``_gumbel_sample_kernel`` (noise left out): one program per row stores the row's logits into the draft
    logits cache at its request state, then takes the argmax of the tempered logits. A row whose
    ``req_state_idx`` is negative is an invalid request: nothing is stored for it (``is_valid_req``)."""
    max_num_reqs = logits_cache.shape[0]
    req_state_idx = expanded_idx_mapping.long()
    is_valid_req = req_state_idx >= 0
    rows = (req_state_idx[:, None] == torch.arange(max_num_reqs, device=logits.device)[None, :])
    rows = rows & is_valid_req[:, None]                               # [num_tokens, max_num_reqs]
    stored = rows.any(0)
    new = rows.t().to(logits.dtype) @ logits                          # each row's store, by request state
    logits_cache[:, logits_cache_col] = torch.where(stored[:, None], new, logits_cache[:, logits_cache_col])
    temp = torch.where(is_valid_req, temperature[req_state_idx.clamp(min=0)], torch.ones_like(logits[:, 0]))
    return (logits / temp[:, None]).argmax(dim=-1)


class Speculator:
    """MRV2 ``SpecDecodeBaseProposer`` with probabilistic draft sampling: its persistent inputs and cache."""

    def __init__(self, model, device, variant):
        self.model = model
        self.variant = variant
        self.idx_mapping = torch.zeros(MAX_NUM_REQS, dtype=torch.int32, device=device)
        self.temperature = torch.zeros(MAX_NUM_REQS, device=device)
        self.hidden_states = torch.zeros(MAX_NUM_REQS, DIM, device=device)
        # [max_num_reqs, num_speculative_steps, vocab_size]: read back by the probabilistic rejection sampler
        self.draft_logits = torch.zeros(MAX_NUM_REQS, NUM_SPEC, VOCAB, device=device)

    def _copy_request_inputs(self, num_reqs, idx_mapping, temperature):
        # Copy temperature and idx mapping to the pre-allocated buffers.
        self.temperature.copy_(temperature)
        self.idx_mapping[:num_reqs].copy_(idx_mapping)
        if self.variant == "fix":
            # idx_mapping for CG padded requests points to -1, which is ignored
            # during sampling to prevent writing stale values to draft logits.
            self.idx_mapping[num_reqs:].fill_(-1)

    def sample_draft(self, hidden_states, idx_mapping, temperature, draft_step: int):
        logits = self.model.compute_logits(hidden_states)
        return gumbel_sample(logits, idx_mapping, temperature, self.draft_logits, draft_step)


def run(variant: str, device: str = "cpu"):
    model = DraftModel(device)
    gen = torch.Generator().manual_seed(3)
    # Request states A..D (req_state_idx 0..3) and the target model's last hidden state per request and step.
    temperature = torch.tensor([0.7, 1.0, 0.8, 1.2])
    target_hidden = [torch.randn(MAX_NUM_REQS, DIM, generator=gen) for _ in range(3)]
    # Step 1 schedules [B, C, D, A]; step 2 does not schedule A (token budget); step 3 schedules all four.
    schedule = [[1, 2, 3, 0], [1, 2, 3], [0, 1, 2, 3]]

    def serve(graphed: bool):
        spec = Speculator(model, device, variant)
        if graphed:
            spec.idx_mapping.copy_(torch.arange(MAX_NUM_REQS))
            g, out = capture(lambda: spec.sample_draft(spec.hidden_states, spec.idx_mapping, spec.temperature, 0),
                             device=device, static={"idx_mapping": spec.idx_mapping, "temperature": spec.temperature,
                             "hidden_states": spec.hidden_states}, state={"draft_logits": spec.draft_logits},
                             owner="SpecDecodeBaseProposer (FULL draft graph)")
            spec.draft_logits.zero_()                     # the warmup/capture dummy run's logits are discarded
        outs = []
        for step, reqs in enumerate(schedule):
            num_reqs = len(reqs)
            idx = torch.tensor(reqs)
            # Rejection sampling of last step's drafts: the draft distribution each request was proposed from.
            outs.append(torch.softmax(spec.draft_logits[idx.to(device), 0] /
                                      temperature.to(device)[idx.to(device)][:, None], dim=-1).clone())
            spec._copy_request_inputs(num_reqs, idx.to(device, torch.int32), temperature.to(device))
            spec.hidden_states[:num_reqs].copy_(target_hidden[step][idx].to(device))
            spec.hidden_states[num_reqs:].zero_()         # hidden states of the padded (dummy) tokens
            if graphed:
                draft = replay(g, out, real=num_reqs, size=CAPTURE_SIZE,
                               padded={"idx_mapping": spec.idx_mapping})[:num_reqs]
            else:
                draft = spec.sample_draft(spec.hidden_states[:num_reqs], spec.idx_mapping[:num_reqs],
                                          spec.temperature, 0)
            outs.append(draft.clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
