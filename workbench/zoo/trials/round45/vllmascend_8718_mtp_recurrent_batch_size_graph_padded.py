"""The MTP drafter's recurrent loop writes its real-row draft tokens into a slice of the graph-padded batch size.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/8718 ("[BugFix] MTP recurrent batch size after
lmhead TP logits truncation", commit de188051a2).
Symptom: with MTP speculative decoding, lmhead tensor parallelism and ACL graphs, real requests fail in
the drafter with ``RuntimeError: The expanded size of the tensor (1024) must match the existing size (32)
at non-singleton dimension 0`` at ``self.input_ids[:batch_size] = input_ids``.
Mechanism: ``AscendSpecDecodeBaseProposer._run_merged_draft`` receives ``batch_size`` = the graph-padded
drafter batch (the dispatcher's padded size; the attention metadata's request count was padded for the
graph), while ``token_indices_to_sample`` covers the real requests only. Under lmhead TP,
``compute_logits`` runs on indices padded to ``max_num_reqs_across_dp`` and the logits are then truncated
back to ``num_indices``, so ``draft_token_ids`` has the real row count. The recurrent loop then copies those
real rows into ``self.input_ids[:batch_size]`` (and ``positions``/``hidden_states``), a slice of the padded
size: the shapes differ and the copy raises. (Without lmhead TP the logits keep the padded rows and the
shapes agree.) In this model the drafter's model forward is the captured graph (one graph for the padded
size, replayed at each draft step) and the loop runs in Python around it; upstream the same Python also
runs inside the merged FULL-graph wrapper's capture. The diff was read (the 8-line hunk and the function
around it); where exactly the padded ``batch_size`` comes from upstream is taken from the PR text.
Doctor: padded-shape-mismatch, at ``_run_merged_draft`` (the graph-padded batch slice given the real rows).
Fix (upstream): ``if lmhead_tp_enable() and self.method == "mtp": batch_size = draft_token_ids.shape[0]``
before the recurrent loop, so the loop writes and samples the real rows; the graph still runs padded.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/8718"
FAMILY = "stale padded metadata"
KIND = "padded-shape-mismatch"
SITE = "_run_merged_draft"
SYMPTOM = "RuntimeError: expanded size of the tensor (padded batch) must match the existing size (real rows)"

VOCAB, HIDDEN, MAX_POS = 16, 4, 32
NUM_SPECULATIVE_TOKENS = 3
MAX_NUM_SEQS = 4                      # uniform decode: one drafter token per request
UNIFORM_DECODE_QUERY_LEN = 1
CUDAGRAPH_CAPTURE_SIZES = (4,)        # the drafter's one graph size
MAX_NUM_TOKENS = 8


def lmhead_tp_enable() -> bool:
    return True                       # lmhead_tensor_parallel_size > 1 in the failing deployment


class MtpDraftModel:
    """One MTP layer (row-wise) and its shared lm head."""

    def __init__(self, device):
        gen = generator(8718)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.pos_embed = randn(MAX_POS, HIDDEN, gen=gen, device=device, scale=0.3)
        self.w_h = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.8)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device)

    def __call__(self, input_ids, positions, hidden_states):
        return torch.tanh(self.embed[input_ids] + self.pos_embed[positions] + hidden_states @ self.w_h)

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head


class AscendSpecDecodeBaseProposer:
    def __init__(self, model, device, variant, use_cuda_graph):
        self.model, self.device, self.variant = model, device, variant
        self.method = "mtp"
        self.use_cuda_graph = use_cuda_graph
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.positions = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.hidden_states = torch.zeros(MAX_NUM_TOKENS, HIDDEN, device=device)
        self.token_indices_to_sample = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.arange = torch.arange(MAX_NUM_TOKENS, device=device)
        self.graphs = {}
        if use_cuda_graph:
            for size in CUDAGRAPH_CAPTURE_SIZES:
                self.graphs[size] = capture(
                    lambda size=size: self.model(self.input_ids[:size], self.positions[:size],
                                                 self.hidden_states[:size]),
                    device=device, owner="AscendSpecDecodeBaseProposer (drafter graph)", name=f"size {size}",
                    static={"input_ids": self.input_ids, "positions": self.positions,
                            "hidden_states": self.hidden_states})

    def _dispatch(self, num_tokens):
        """The cudagraph dispatcher: the smallest captured size that holds the batch."""
        if not self.use_cuda_graph:
            return num_tokens
        return min(s for s in CUDAGRAPH_CAPTURE_SIZES if s >= num_tokens)

    def _model_forward(self, num_input_tokens, num_real):
        if num_input_tokens in self.graphs:
            g, out = self.graphs[num_input_tokens]
            return replay(g, out, real=num_real, size=num_input_tokens,
                          padded={"input_ids": self.input_ids, "positions": self.positions,
                                  "hidden_states": self.hidden_states})
        return self.model(self.input_ids[:num_input_tokens], self.positions[:num_input_tokens],
                          self.hidden_states[:num_input_tokens])

    def _sample(self, last_hidden_states, token_indices_to_sample):
        num_indices = token_indices_to_sample.shape[0]
        if lmhead_tp_enable():
            max_num_reqs_across_dp = MAX_NUM_SEQS * UNIFORM_DECODE_QUERY_LEN
            token_indices_to_sample = F.pad(token_indices_to_sample, (0, max_num_reqs_across_dp - num_indices))
        sample_hidden_states = last_hidden_states[token_indices_to_sample]
        logits = self.model.compute_logits(sample_hidden_states)
        if lmhead_tp_enable() and num_indices < logits.shape[0]:
            logits = logits[:num_indices]
            token_indices_to_sample = token_indices_to_sample[:num_indices]
        return logits.argmax(dim=-1), token_indices_to_sample

    def propose(self, next_token_ids, target_positions, target_hidden_states):
        """``set_inputs_first_pass`` then ``_run_merged_draft`` for ``n`` decode requests."""
        n = next_token_ids.shape[0]
        self.input_ids[:n].copy_(next_token_ids)
        self.positions[:n].copy_(target_positions)
        self.hidden_states[:n].copy_(target_hidden_states)
        self.token_indices_to_sample[:n].copy_(self.arange[:n])
        num_input_tokens = self._dispatch(n)
        # The drafter's attention metadata was padded to the graph's request count: batch_size follows it.
        batch_size = num_input_tokens // UNIFORM_DECODE_QUERY_LEN
        return self._run_merged_draft(num_input_tokens, batch_size, self.token_indices_to_sample[:n])

    def _run_merged_draft(self, num_input_tokens, batch_size, token_indices_to_sample):
        n_real = token_indices_to_sample.shape[0]
        last_hidden_states = self._model_forward(num_input_tokens, n_real)
        hidden_states = last_hidden_states
        draft_token_ids, token_indices_to_sample = self._sample(last_hidden_states, token_indices_to_sample)

        if self.variant == "fix" and lmhead_tp_enable() and self.method == "mtp":
            batch_size = draft_token_ids.shape[0]

        # Generate the remaining draft tokens.
        draft_token_ids_tensor = torch.zeros((NUM_SPECULATIVE_TOKENS, *draft_token_ids.shape),
                                             dtype=draft_token_ids.dtype, device=self.device)
        draft_token_ids_tensor[0] = draft_token_ids
        positions = self.positions[token_indices_to_sample]
        hidden_states = hidden_states[token_indices_to_sample]
        token_indices_to_sample = self.arange[:batch_size]
        input_batch_size = num_input_tokens      # mtp: the loop's model runs at the padded size

        for draft_step in range(NUM_SPECULATIVE_TOKENS - 1):
            input_ids = draft_token_ids_tensor[draft_step]
            positions = positions + 1
            clamped_positions = torch.where(positions >= MAX_POS, 0, positions)
            # copy inputs to buffer for cudagraph
            self.input_ids[:batch_size] = input_ids
            self.positions[:batch_size] = clamped_positions
            self.hidden_states[:batch_size] = hidden_states
            last_hidden_states = self._model_forward(input_batch_size, n_real)
            hidden_states = last_hidden_states
            draft_token_ids, token_indices_to_sample = self._sample(last_hidden_states, token_indices_to_sample)
            draft_token_ids_tensor[draft_step + 1] = draft_token_ids
            hidden_states = hidden_states[token_indices_to_sample]
        return draft_token_ids_tensor.transpose(0, 1).clone()       # [requests, num_speculative_tokens]


def run(variant: str, device: str = "cpu"):
    model = MtpDraftModel(device)
    gen = generator(1)
    steps = []
    for n, start in [(3, 5), (2, 9), (4, 12)]:
        ids = torch.randint(0, VOCAB, (n,), generator=gen).to(device)
        pos = torch.arange(start, start + n).to(device)
        hid = randn(n, HIDDEN, gen=gen, device=device)
        steps.append((ids, pos, hid))

    def serve(graphed: bool):
        proposer = AscendSpecDecodeBaseProposer(model, device, variant, graphed)
        return [proposer.propose(*step) for step in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
