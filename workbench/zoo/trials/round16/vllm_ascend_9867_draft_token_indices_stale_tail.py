"""The MTP drafter's graph gathers padded requests' hidden states at stale ``token_indices_to_sample`` entries.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/9867 ("[BugFix][Ascend950][spec decode] Fix draft
model index out of range error caused by `token_indices_to_sample`").
Symptom: MTP / EAGLE speculative decoding with the drafter in ACL graph mode fails with an index-out-of-range
error in the draft model on Ascend 950 (A5) after some requests finished; the eager drafter is fine
(vllm-ascend main on vLLM v0.20.2, June 2026).
Mechanism: ``AscendSpecDecodeBaseProposer`` keeps one persistent ``self.token_indices_to_sample`` buffer (sized
``max_num_batched_tokens``). The drafter graphs are captured by ``dummy_run`` with
``self.token_indices_to_sample[:batch_size * extra_slots_per_request]``, i.e. for the padded batch size, and
``_run_merged_draft`` gathers ``last_hidden_states[token_indices_to_sample]`` inside the graph. ``_propose``
copies only this step's indices, ``self.token_indices_to_sample[:len].copy_(token_indices_to_sample)``: the
rows of the padded requests keep what an earlier step wrote there, e.g. the last-token index of a long prefill
that ran the drafter eagerly. When a smaller batch is padded up to a captured size, the replayed gather reads
those stale indices, which point past the graph's ``num_input_tokens`` rows: index out of range (on GPUs an
out-of-bounds gather; A5's checks report it). The eager drafter slices the buffer to the real length.
Doctor: stale-padding, at ``_propose`` (the padded requests' sample indices are whatever an earlier step left).
Fix (upstream): ``_propose`` also clears the tail, ``self.token_indices_to_sample[token_indices_to_sample_len:]
.fill_(0)``, so padded requests sample token 0 of the padded batch. (The PR's second change, unpadding the
block table for an eager drafter, is not modelled.)
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/9867"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "_propose"
SYMPTOM = "draft model index out of range: padded requests gather hidden states at a stale prefill token index"
VOCAB, HIDDEN, MAX_NUM_BATCHED_TOKENS, MAX_POS = 11, 4, 24, 32
NUM_SPECULATIVE_TOKENS = 1                    # MTP, one draft token per step
EXTRA_SLOTS_PER_REQUEST = 1
UNIFORM_DECODE_QUERY_LEN = 1 + NUM_SPECULATIVE_TOKENS
CUDAGRAPH_BATCH_SIZES = [2]                    # drafter graphs, in requests


class MtpDraftModel:
    def __init__(self, device):
        gen = generator(9867)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.pos_emb = randn(MAX_POS, HIDDEN, gen=gen, device=device, scale=0.3)
        self.eh_proj = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device)

    def __call__(self, input_ids, positions, hidden_states):
        return torch.tanh(self.embed_tokens[input_ids] + self.pos_emb[positions] + hidden_states @ self.eh_proj)

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head


class AscendSpecDecodeBaseProposer:
    def __init__(self, model, device, variant, use_cuda_graph: bool):
        self.model, self.device, self.variant, self.use_cuda_graph = model, device, variant, use_cuda_graph
        self.input_ids = torch.zeros(MAX_NUM_BATCHED_TOKENS, dtype=torch.long, device=device)
        self.positions = torch.zeros(MAX_NUM_BATCHED_TOKENS, dtype=torch.long, device=device)
        self.hidden_states = torch.zeros(MAX_NUM_BATCHED_TOKENS, HIDDEN, device=device)
        self.token_indices_to_sample = torch.zeros(MAX_NUM_BATCHED_TOKENS, dtype=torch.long, device=device)
        self.graphs = {}

    def _run_merged_draft(self, num_input_tokens, batch_size, token_indices_to_sample):
        last_hidden_states = self.model(self.input_ids[:num_input_tokens], self.positions[:num_input_tokens],
                                        self.hidden_states[:num_input_tokens])
        sample_hidden_states = last_hidden_states[token_indices_to_sample]
        logits = self.model.compute_logits(sample_hidden_states)
        draft_token_ids = logits.argmax(dim=-1)
        # Early exit if there is only one draft token to be generated.
        return draft_token_ids.view(-1, NUM_SPECULATIVE_TOKENS)

    def dummy_run(self, num_tokens: int):
        """Graph capture for one drafter batch size (the padded shapes ``_propose`` replays)."""
        batch_size = max(num_tokens // (NUM_SPECULATIVE_TOKENS + 1), 1)
        g, out = capture(lambda: self._run_merged_draft(
            num_input_tokens=num_tokens, batch_size=batch_size,
            token_indices_to_sample=self.token_indices_to_sample[: batch_size * EXTRA_SLOTS_PER_REQUEST]),
            device=self.device, name=f"draft batch {batch_size}",
            static={"input_ids": self.input_ids, "positions": self.positions, "hidden_states": self.hidden_states,
                    "token_indices_to_sample": self.token_indices_to_sample},
            owner="AscendSpecDecodeBaseProposer (ACL graph)")
        self.graphs[batch_size] = (g, out)

    def _propose(self, target_token_ids, target_positions, target_hidden_states, token_indices_to_sample,
                 num_reqs: int):
        num_tokens = target_token_ids.shape[0]
        batch_size = next((b for b in CUDAGRAPH_BATCH_SIZES if b >= num_reqs), None)
        graphed = self.use_cuda_graph and batch_size is not None and num_tokens == num_reqs * UNIFORM_DECODE_QUERY_LEN
        num_input_tokens = batch_size * UNIFORM_DECODE_QUERY_LEN if graphed else num_tokens
        self.input_ids[:num_tokens].copy_(target_token_ids)
        self.positions[:num_tokens].copy_(target_positions)
        self.hidden_states[:num_tokens].copy_(target_hidden_states)
        self.input_ids[num_tokens:num_input_tokens].zero_()        # graph padding tokens
        self.positions[num_tokens:num_input_tokens].zero_()
        self.hidden_states[num_tokens:num_input_tokens].zero_()

        token_indices_to_sample_len = token_indices_to_sample.shape[0]
        self.token_indices_to_sample[:token_indices_to_sample_len].copy_(token_indices_to_sample)
        if self.variant == "fix":
            self.token_indices_to_sample[token_indices_to_sample_len:].fill_(0)

        if graphed:
            g, out = self.graphs[batch_size]
            padded = {} if self.variant == "fix" else {"token_indices_to_sample": self.token_indices_to_sample}
            return replay(g, out, real=num_reqs, size=batch_size, padded=padded)[:num_reqs].clone()
        return self._run_merged_draft(num_input_tokens, num_reqs,
                                      self.token_indices_to_sample[:token_indices_to_sample_len]).clone()


def target_hidden(model, token_ids, positions):
    """The target model's last hidden states for these tokens (what MTP conditions on)."""
    return torch.sin(model.embed_tokens[token_ids] * 1.7 + model.pos_emb[positions])


def run(variant: str, device: str = "cpu"):
    model = MtpDraftModel(device)

    def serve(graphed: bool):
        proposer = AscendSpecDecodeBaseProposer(model, device, variant, use_cuda_graph=graphed)
        if graphed:
            for bs in CUDAGRAPH_BATCH_SIZES:
                proposer.dummy_run(bs * UNIFORM_DECODE_QUERY_LEN)
        outs = []

        def step(requests):
            """``requests``: (tokens this step, first position) per request; samples at each last token."""
            ids, pos, last = [], [], []
            for tokens, start in requests:
                ids.extend(tokens)
                pos.extend(range(start, start + len(tokens)))
                last.append(len(ids) - 1)
            ids = torch.tensor(ids, device=device)
            pos = torch.tensor(pos, device=device)
            hs = target_hidden(model, ids, pos)
            outs.append(proposer._propose(torch.roll(ids, -1), pos, hs, torch.tensor(last, device=device),
                                          num_reqs=len(requests)))

        # Prefill of two prompts (5 and 9 tokens): the drafter runs eagerly and samples at tokens 4 and 13.
        step([([1, 4, 2, 7, 3], 0), ([5, 9, 9, 2, 6, 1, 8, 3, 4], 0)])
        # The second request stops at its first token; the first decodes alone: 1 request padded to 2.
        step([([6, 2], 5)])
        step([([3, 7], 7)])
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
