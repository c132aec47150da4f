"""A DP dummy batch's zero-length rows read a finished request's block-table row and write its cached state.

Upstream: https://github.com/vllm-project/vllm/pull/37728 ("Fix Mamba state corruption from referencing
stale block table entries").
Symptom: a linear-attention (GDN) model under DP + FULL CUDA graphs + prefix caching answers some
requests with token id 0 / NaN; TP, or piecewise graphs, are clean (vLLM main, March 2026).
Mechanism: when one DP rank has finished its requests while others still decode, it runs
``dummy_run`` with ``num_reqs`` equal to the other ranks' decode count and ``seq_lens`` ``[1, 0, ...]``,
replaying the FULL decode graph. The persistent block table is not cleared when a request finishes, so
the zero-length dummy rows map to a finished request's mamba block, and the captured GDN state update
writes into it. With prefix caching that block is a cached prefix state: the next request that hits it
starts from a corrupted recurrent state.
Doctor: stale-padding, at ``fused_recurrent_gated_delta_rule`` (the state update through the dummy
rows' block ids).
Fix (upstream): clear a request's block-table row when it finishes, so rows that no live request owns
point at the null block (block 0) and the dummy rows' writes land there.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/37728"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "fused_recurrent_gated_delta_rule"
SYMPTOM = "a prefix-cache hit restores a recurrent state overwritten by a DP dummy row (token id 0 upstream)"
VOCAB, DIM, NUM_BLOCKS, MAX_REQS, MAX_BLOCKS, SIZE = 10, 4, 8, 2, 2, 2
NULL_BLOCK = 0


class Model:
    def __init__(self, device):
        gen = generator(37728)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.w_out = randn(DIM, DIM, gen=gen, device=device, scale=0.5)


def fused_recurrent_gated_delta_rule(ssm_states, state_indices, x, decay=0.5):
    """GDN decode: one token per row updates the recurrent state of its mamba block in place."""
    new = ssm_states[state_indices] * decay + x
    ssm_states[state_indices] = new
    return new


def gdn_decode(model, ssm_states, input_ids, block_table):
    state_indices = block_table[:, 0]                     # one mamba block per request
    h = fused_recurrent_gated_delta_rule(ssm_states, state_indices, model.emb[input_ids])
    return h @ model.w_out


class InputBatch:
    """The persistent per-row block table (the runner's ``BlockTable``), rows = request indices."""

    def __init__(self, device, clear_on_finish: bool):
        self.block_table = torch.full((MAX_REQS, MAX_BLOCKS), NULL_BLOCK, dtype=torch.long, device=device)
        self.clear_on_finish = clear_on_finish

    def add_request(self, row, blocks):
        self.block_table[row, :len(blocks)] = torch.tensor(blocks, device=self.block_table.device)

    def remove_request(self, row):
        if self.clear_on_finish:                          # the fix: no stale block ids for unowned rows
            self.block_table[row].fill_(NULL_BLOCK)


def run(variant: str, device: str = "cpu"):
    model = Model(device)

    def serve(graphed: bool):
        ssm_states = torch.zeros(NUM_BLOCKS, DIM, device=device)
        batch = InputBatch(device, clear_on_finish=(variant == "fix"))
        input_ids = torch.zeros(SIZE, dtype=torch.long, device=device)
        bt = batch.block_table
        if graphed:
            g, out = capture(lambda: gdn_decode(model, ssm_states, input_ids, bt[:SIZE]), device=device,
                             static={"input_ids": input_ids}, state={"ssm_states": ssm_states,
                             "block_table": bt}, owner="GPUModelRunner (FULL decode graph)")
            ssm_states.zero_()                            # profiling/capture state is discarded
        outs = []

        def step(ids, num_reqs):
            input_ids[:num_reqs].copy_(torch.tensor(ids, device=device))
            input_ids[num_reqs:].zero_()
            bt[num_reqs:SIZE].fill_(NULL_BLOCK)           # rows past num_reqs are masked to the null block
            if not graphed:
                return gdn_decode(model, ssm_states, input_ids[:num_reqs], bt[:num_reqs])[:num_reqs].clone()
            return replay(g, out, real=num_reqs, size=SIZE, padded={})[:num_reqs].clone()

        # Requests A (row 0, mamba block 3) and B (row 1, block 5) prefill, then decode together.
        batch.add_request(0, [3, 1])
        batch.add_request(1, [5, 2])
        ssm_states[3] = model.emb[1]
        ssm_states[5] = model.emb[2]
        outs.append(step([4, 6], 2))
        # Both finish on this rank; their last states stay in blocks 3 and 5 as cached prefixes.
        batch.remove_request(0)
        batch.remove_request(1)
        # Other DP ranks still decode two requests: dummy_run(2) with seq_lens [1, 0] (FULL graph only;
        # eager and piecewise dummy runs build no attention metadata, so GDN does nothing).
        if graphed:
            input_ids.zero_()
            replay(g, out, real=1, size=SIZE, padded={"block_table": bt})
        # Request C shares B's prefix: a prefix-cache hit copies block 5's state into its own block 6.
        batch.add_request(0, [6, 7])
        ssm_states[6] = ssm_states[5]
        outs.append(step([3], 1))
        outs.append(step([8], 1))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
