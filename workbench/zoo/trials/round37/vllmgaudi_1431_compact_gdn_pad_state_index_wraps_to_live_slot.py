"""Padded decode rows of a compact-GDN bucket write their conv state into a live request's slot.

Upstream: https://github.com/vllm-project/vllm-gaudi/pull/1431 ("Fix conv_state corruption in compact GDN
batched decode"), commit 36cf6ad0.
Symptom: with compact GDN state (Qwen3.5-style hybrid models on Gaudi), a decode batch padded to its bucket
(e.g. 5 real sequences in a bucket of 8) corrupts another request's ``conv_state``; that request then
produces garbage q/k/v projections and nonsensical output (vllm-gaudi, 2026).
Mechanism: ``HPUModelRunner.prepare_mamba_state_idxs`` pads the state indices of the bucket's padded rows
with ``_MAMBA_PAD_BLOCK_ID = num_blocks``. For a compact GDN group the ``conv_states`` tensor has only
``compact_total = gdn_max_reqs * num_gdn_groups + 2`` slots, and ``causal_conv1d_update`` maps indices with
``torch.remainder(index, num_conv_slots)`` (meant to send ``-1`` to the spare last slot). ``num_blocks`` modulo
``compact_total`` is a real request's slot (6947 % 26 = 5 upstream), so each padded row, whose token is
whatever an earlier step left in the bucket's input buffer, reads that request's state and writes its own
new state there (``conv_states[safe_cache_idx, -state_len:, :] = new_state``).
Doctor: stale-padding, at ``causal_conv1d_update`` (the state write of the padded rows lands in a live
request's slot, so that request's next step depends on what the padded rows held).
Fix (upstream): pad compact GDN groups with ``-1`` (``remainder(-1, N) = N - 1``, the spare slot); other
groups keep ``_MAMBA_PAD_BLOCK_ID``.
Model notes: one compact GDN group holding only the short causal conv of a GDN layer (the recurrent state
is left out); prefills run eagerly, decodes replay the bucket's graph (the HPU graph of that bucket).
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-gaudi/pull/1431"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "causal_conv1d_update"
SYMPTOM = "a request's conv_state is overwritten by a padded decode row; its next tokens are garbage"

VOCAB, DIM, WIDTH = 12, 4, 3
STATE_LEN = WIDTH - 1
NUM_BLOCKS = 13                         # KV blocks of the attention groups: _MAMBA_PAD_BLOCK_ID
GDN_MAX_REQS, NUM_GDN_GROUPS = 3, 1
COMPACT_TOTAL = GDN_MAX_REQS * NUM_GDN_GROUPS + 2      # 5 slots: 1..3 for requests, 0 and 4 spare
DECODE_BUCKET = 4


def causal_conv1d_update(x, conv_states, weight, bias, cache_indices):
    """Decode step of the depthwise causal conv: one token per row, state read and written per row."""
    num_conv_slots = conv_states.shape[0]
    safe_cache_idx = torch.remainder(cache_indices, num_conv_slots)
    init_state = conv_states[safe_cache_idx, -STATE_LEN:, :]                # [bs, state_len, dim]
    seq_input = torch.cat([init_state, x[:, None, :]], dim=1)              # [bs, width, dim]
    out = (seq_input * weight.T[None]).sum(1) + bias
    conv_states[safe_cache_idx, -STATE_LEN:, :] = seq_input[:, -STATE_LEN:, :]
    return torch.nn.functional.silu(out)


def causal_conv1d_fn(x, conv_states, weight, bias, slot):
    """Prefill of one request (no initial state): every position's output, final state cached."""
    seq_input = torch.cat([torch.zeros(STATE_LEN, DIM, device=x.device), x], dim=0)
    windows = seq_input.unfold(0, WIDTH, 1)                                 # [len, dim, width]
    out = (windows * weight[None]).sum(-1) + bias
    conv_states[slot, -STATE_LEN:, :] = seq_input[-STATE_LEN:, :]
    return torch.nn.functional.silu(out)


class GDNModel:
    def __init__(self, device):
        gen = generator(1431)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.conv_weight = randn(DIM, WIDTH, gen=gen, device=device, scale=0.7)
        self.conv_bias = randn(DIM, gen=gen, device=device, scale=0.1)
        self.out_proj = randn(DIM, VOCAB, gen=gen, device=device, scale=0.7)

    def decode(self, input_ids, conv_states, cache_indices):
        h = causal_conv1d_update(self.embed[input_ids], conv_states, self.conv_weight, self.conv_bias,
                                 cache_indices)
        return h @ self.out_proj

    def prefill(self, input_ids, conv_states, slot):
        h = causal_conv1d_fn(self.embed[input_ids], conv_states, self.conv_weight, self.conv_bias, slot)
        return h[-1:] @ self.out_proj


class HPUModelRunner:
    def __init__(self, device, variant, graphed):
        self.device, self.variant, self.graphed = device, variant, graphed
        self.model = GDNModel(device)
        self._MAMBA_PAD_BLOCK_ID = NUM_BLOCKS
        self._compact_gdn_group_ids = {0}
        self._compact_gdn_group_offset = {0: 0}
        self._num_gdn_groups = NUM_GDN_GROUPS
        self._gdn_req_to_base_slot: dict[str, int] = {}
        self.conv_states = torch.zeros(COMPACT_TOTAL, STATE_LEN, DIM, device=device)
        self.input_ids = torch.zeros(DECODE_BUCKET, dtype=torch.long, device=device)
        self.cache_indices = torch.zeros(DECODE_BUCKET, dtype=torch.long, device=device)
        if graphed:
            self.graph, self.logits = capture(
                lambda: self.model.decode(self.input_ids, self.conv_states, self.cache_indices),
                device=device, name=f"decode bucket {DECODE_BUCKET}", owner="HPUModelRunner (decode bucket graph)",
                static={"input_ids": self.input_ids, "cache_indices": self.cache_indices},
                state={"conv_states": self.conv_states})
            self.conv_states.zero_()                  # the warmup's state is no request's

    def add_request(self, req_id):
        self._gdn_req_to_base_slot[req_id] = len(self._gdn_req_to_base_slot)

    def prepare_mamba_state_idxs(self, req_ids, target_bs):
        num_indices = len(req_ids)
        g_offset = self._compact_gdn_group_offset[0]
        state_indices_cpu = torch.zeros(num_indices, dtype=torch.int32)
        for i, req_id in enumerate(req_ids):
            state_indices_cpu[i] = self._gdn_req_to_base_slot[req_id] * self._num_gdn_groups + g_offset + 1
        if num_indices < target_bs:
            pad_val = -1 if (self.variant == "fix" and 0 in self._compact_gdn_group_ids) else self._MAMBA_PAD_BLOCK_ID
            padding = torch.full((target_bs - num_indices,), pad_val, dtype=torch.int32)
            state_indices_cpu = torch.cat([state_indices_cpu, padding])
        return state_indices_cpu

    def execute_prefill(self, req_id, prompt):
        slot = self.prepare_mamba_state_idxs([req_id], 1)[0].item()
        ids = torch.tensor(prompt, dtype=torch.long, device=self.device)
        return self.model.prefill(ids, self.conv_states, slot).clone()

    def execute_decode(self, tokens):
        """``tokens``: {req_id: last token}; the batch is padded to the decode bucket when graphed."""
        req_ids, n = list(tokens), len(tokens)
        target_bs = DECODE_BUCKET if self.graphed else n
        self.input_ids[:n].copy_(torch.tensor([tokens[r] for r in req_ids], dtype=torch.long, device=self.device))
        self.cache_indices[:target_bs].copy_(self.prepare_mamba_state_idxs(req_ids, target_bs).to(self.device))
        if not self.graphed:
            return self.model.decode(self.input_ids[:n], self.conv_states, self.cache_indices[:n]).clone()
        logits = replay(self.graph, self.logits, real=n, size=DECODE_BUCKET, padded={"input_ids": self.input_ids})
        return logits[:n].clone()


def run(variant: str, device: str = "cpu"):
    def serve(graphed: bool):
        runner = HPUModelRunner(device, variant, graphed)
        outs = []
        with torch.no_grad():
            for req in ("A", "B", "C"):
                runner.add_request(req)
            outs.append(runner.execute_prefill("A", [3, 1, 4]))
            outs.append(runner.execute_prefill("B", [1, 5, 9, 2]))
            outs.append(runner.execute_decode({"A": 6, "B": 5}))
            # C arrives: one step runs its prefill, then the decode batch of A and B (padded to the bucket)
            outs.append(runner.execute_prefill("C", [2, 6, 5]))
            outs.append(runner.execute_decode({"A": 8, "B": 11}))
            outs.append(runner.execute_decode({"A": 4, "B": 10, "C": 0}))
            outs.append(runner.execute_decode({"A": 7, "B": 2, "C": 3}))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
