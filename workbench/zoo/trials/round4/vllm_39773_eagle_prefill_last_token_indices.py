"""The speculator's prefill graph gathers hidden states through padded last-token indices left by an earlier batch.

Upstream: https://github.com/vllm-project/vllm/pull/39773 ("[Model Runner V2] Disable piecewise cudagraph mode
fallback for eagle draft decodes"), its first fix: "`last_token_indices` was not being padded before prefill,
allowing stale values to remain in the buffer from previous runs and cause OOB errors during a gather op".
Symptom: EAGLE speculative decoding on Model Runner V2 with FULL CUDA graphs for the drafter crashes with an
out-of-bounds gather (device-side assert / illegal memory access) once decode batches are padded (vLLM main,
April 2026).
Mechanism: ``prepare_eagle_inputs`` writes only ``last_token_indices[:num_reqs]`` of the speculator's
persistent buffer, while the FULL graph of the drafter's prefill gathers
``last_hidden_states[last_token_indices[:num_reqs_padded]]`` at the padded request count. The padded entries
keep what an earlier, larger batch left there (here the last token of a long prompt run eagerly). That index
lies past the graph's padded token count, so the captured gather reads out of bounds.
Doctor: stale-padding, at ``prefill`` (the captured gather ``last_hidden_states[last_token_indices]`` that
reads the padded entries ``prepare_eagle_inputs`` left as they were).
Fix (upstream): pad the buffer when preparing the inputs: ``last_token_indices[num_reqs:max_num_reqs] = 0``
(and ``query_start_loc`` / ``seq_lens`` likewise), so padded requests gather token 0.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/39773"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "prefill"
SYMPTOM = "out-of-bounds gather in the drafter's prefill graph (IndexError here, device assert upstream)"
VOCAB, HIDDEN, MAX_POS = 11, 4, 16
NUM_SPEC = 1                                  # num_speculative_tokens: decode rows have 1 + 1 tokens
MAX_NUM_REQS, MAX_NUM_TOKENS = 4, 24
CAPTURE_NUM_REQS = (2, 4)                     # uniform-decode graphs: num_reqs_padded -> (1 + K) tokens each


class EagleModel:
    def __init__(self, device):
        gen = generator(39773)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.pos = randn(MAX_POS, HIDDEN, gen=gen, device=device, scale=0.3)
        self.fc = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device)

    def __call__(self, input_ids, positions, hidden_states):
        return torch.tanh(self.embed[input_ids] + self.pos[positions] + hidden_states @ self.fc)


class EagleSpeculator:
    """The MRV2 speculator's persistent buffers and its prefill (the first draft token)."""

    def __init__(self, device, pad_last_token_indices: bool):
        self.model = EagleModel(device)
        self.pad = pad_last_token_indices
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.positions = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.hidden_states = torch.zeros(MAX_NUM_TOKENS, HIDDEN, device=device)
        self.last_token_indices = torch.zeros(MAX_NUM_REQS, dtype=torch.long, device=device)
        self.draft_tokens = torch.zeros(MAX_NUM_REQS, NUM_SPEC, dtype=torch.long, device=device)
        self.draft_hidden = torch.zeros(MAX_NUM_REQS, HIDDEN, device=device)

    def prepare_eagle_inputs(self, batch):
        """Shift the target's input ids by one, put the next token at each request's last kept position,
        and record that position in ``last_token_indices``."""
        num_reqs, start = len(batch["reqs"]), 0
        for i, (ids, positions, num_rejected, next_token) in enumerate(batch["reqs"]):
            query_len = len(ids) - num_rejected
            n = len(ids)
            self.input_ids[start:start + n - 1] = torch.tensor(ids[1:])
            last = start + query_len - 1
            self.input_ids[last] = next_token
            self.positions[start:start + n] = torch.tensor(positions)
            self.last_token_indices[i] = last
            start += n
        self.hidden_states[:start].copy_(batch["target_hidden"])
        if self.pad:
            self.last_token_indices[num_reqs:MAX_NUM_REQS] = 0
        return num_reqs, start

    def prefill(self, num_reqs, num_tokens):
        last_token_indices = self.last_token_indices[:num_reqs]
        last_hidden_states = self.model(self.input_ids[:num_tokens], self.positions[:num_tokens],
                                        self.hidden_states[:num_tokens])
        sample_hidden_states = last_hidden_states[last_token_indices]
        logits = sample_hidden_states @ self.model.lm_head
        self.draft_tokens[:num_reqs, 0] = logits.argmax(dim=-1)
        self.draft_hidden[:num_reqs] = sample_hidden_states
        return self.draft_tokens[:num_reqs], self.draft_hidden[:num_reqs]


def schedule(device):
    """Step 1: four new prompts (3, 4, 5, 6 tokens: a mixed batch, run eagerly). Steps 2-3: uniform decode
    steps with one draft token per request; request 3 finished after step 1, request 2 after step 2."""
    gen = generator(7)
    prompts = [[1, 4, 2], [3, 3, 7, 9], [5, 8, 1, 0, 2], [6, 2, 9, 4, 4, 7]]
    steps = [[(p, list(range(len(p))), 0, (i + 5) % VOCAB) for i, p in enumerate(prompts)],
             [([2, 6], [3, 4], 0, 8), ([1, 5], [4, 5], 1, 3), ([7, 3], [5, 6], 0, 10)],
             [([8, 1], [5, 6], 1, 2), ([3, 9], [5, 6], 0, 4)]]
    return [{"reqs": reqs, "target_hidden": randn(sum(len(r[0]) for r in reqs), HIDDEN, gen=gen, device=device)}
            for reqs in steps]


def run(variant: str, device: str = "cpu"):
    steps = schedule(device)

    def eager():
        spec, outs = EagleSpeculator(device, pad_last_token_indices=(variant == "fix")), []
        for batch in steps:
            num_reqs, num_tokens = spec.prepare_eagle_inputs(batch)
            outs += [t.clone() for t in spec.prefill(num_reqs, num_tokens)]
        return outs

    def served():
        spec = EagleSpeculator(device, pad_last_token_indices=(variant == "fix"))
        static = {"input_ids": spec.input_ids, "positions": spec.positions, "hidden_states": spec.hidden_states,
                  "last_token_indices": spec.last_token_indices}
        graphs = {}
        for num_reqs_padded in sorted(CAPTURE_NUM_REQS, reverse=True):     # dummy inputs, then capture
            num_tokens = num_reqs_padded * (1 + NUM_SPEC)
            spec.last_token_indices[:num_reqs_padded] = torch.arange(num_reqs_padded) * (1 + NUM_SPEC)
            graphs[num_reqs_padded] = capture(
                lambda r=num_reqs_padded, t=num_tokens: spec.prefill(r, t), device=device, static=static,
                owner="PrefillEagleCudaGraphManager", name=f"draft prefill {num_reqs_padded} reqs")
        outs = []
        for batch in steps:
            num_reqs, num_tokens = spec.prepare_eagle_inputs(batch)
            uniform = all(len(r[0]) == 1 + NUM_SPEC for r in batch["reqs"])
            num_reqs_padded = next((s for s in sorted(CAPTURE_NUM_REQS) if s >= num_reqs), None)
            if not uniform or num_reqs_padded is None:
                outs += [t.clone() for t in spec.prefill(num_reqs, num_tokens)]       # eager
                continue
            g, out = graphs[num_reqs_padded]
            stale = {} if variant == "fix" else {"last_token_indices": spec.last_token_indices}
            drafts, hidden = replay(g, out, real=num_reqs, size=num_reqs_padded, padded=stale)
            outs += [drafts[:num_reqs].clone(), hidden[:num_reqs].clone()]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
