"""A FULL decode graph's padded GDN rows map to real state slot 0 and overwrite that request's recurrent state.

Upstream: https://github.com/ROCm/ATOM/pull/1436 ("[fix](qwen3.5): fix qwen3.5 full decode graph error").
Symptom: accuracy degradation of Qwen3.5 (Gated DeltaNet hybrid) served through ATOM's vLLM plugin with FULL
CUDA graph decode; padded rows of a FULL graph batch "pollute GDN recurrent state" (ROCm ATOM, July 2026).
Mechanism: with FULL cudagraphs vLLM pads a decode batch of ``n`` requests to the captured size ``N`` with
zero-length requests. ``GDNAttentionMetadataBuilder.build`` then counts the padded rows as decodes
(``num_decodes = N``) and fills ``non_spec_state_indices_tensor[:N]`` from the block table, whose padded rows
hold 0, so every padded row maps to the *real* state slot 0 (the plugin's docstring: "FULL-cudagraph padded decode
rows can still map to real state slot 0"). The captured decode kernel (``fused_recurrent_gated_delta_rule``)
runs all ``N`` rows: each padded row reads slot 0, applies its decay and the delta update of whatever token the
padded row of ``input_ids`` still holds, and writes the result back to slot 0, after the real request that owns
slot 0 wrote its own update. That request's next outputs are computed from a corrupted state that depends on
the padded rows' stale tokens.
Doctor: stale-padding, at ``fused_recurrent_gated_delta_rule`` (the state write through the padded rows' slot-0
indices, whose value comes from the padded rows' stale input tokens).
Fix (upstream): ``AtomGDNAttentionMetadataBuilder._compact_full_graph_decode_metadata`` counts only rows with a
non-zero query length as decodes, copies their state indices, fills the padded tail of the state-index buffer
with ``PAD_SLOT_ID`` (-1; the kernel skips those rows) and repeats the terminal query offset.
(Read from the merged diff, ATOM commit 2255001d; the query-offset compaction is modelled only as bookkeeping.)
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/ROCm/ATOM/pull/1436"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "fused_recurrent_gated_delta_rule"
SYMPTOM = "padded FULL-graph decode rows overwrite real state slot 0 (GDN recurrent state corrupted)"

VOCAB, DIM, NUM_SLOTS, SIZE = 12, 3, 4, 4        # SIZE: the one FULL decode capture size
PAD_SLOT_ID = -1


class Model:
    def __init__(self, device):
        gen = generator(1436)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.wk = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.wv = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.wg = randn(DIM, 1, gen=gen, device=device)


def fused_recurrent_gated_delta_rule(q, k, v, g, ssm_state, ssm_state_indices):
    """One token per row: ``S <- exp(g) * S + k v^T``, ``o = q S``; rows with a negative index are skipped.
    Every row reads its slot before any row writes (one kernel), then rows write back in order."""
    valid = ssm_state_indices >= 0
    slots = ssm_state_indices.clamp(min=0)
    new = torch.exp(g)[:, :, None] * ssm_state[slots] + k[:, :, None] * v[:, None, :]
    out = (q[:, None, :] @ new).squeeze(1) * valid[:, None]
    for i in range(q.shape[0]):
        slot = slots[i:i + 1]
        ssm_state[slot] = torch.where(valid[i], new[i:i + 1], ssm_state[slot])
    return out


def forward(model, ssm_state, input_ids, state_indices):
    h = model.emb[input_ids]
    return fused_recurrent_gated_delta_rule(h @ model.wq, h @ model.wk, h @ model.wv, -torch.nn.functional.softplus(
        h @ model.wg), ssm_state, state_indices)


class GDNAttentionMetadataBuilder:
    def __init__(self, device, variant):
        self.variant = variant
        self.non_spec_state_indices_tensor = torch.full((SIZE,), PAD_SLOT_ID, dtype=torch.long, device=device)

    def build(self, block_table, num_reqs_padded, query_lens):
        """``block_table[:, 0]`` is each request's state slot; ``query_lens`` (host) is 0 for padded rows."""
        state_indices = self.non_spec_state_indices_tensor
        if self.variant == "bug":
            num_decodes = num_reqs_padded                     # padded zero-length rows counted as decodes
            state_indices[:num_decodes].copy_(block_table[:num_decodes, 0])
            state_indices[num_decodes:].fill_(PAD_SLOT_ID)
            return num_decodes
        # The fix (ATOM's _compact_full_graph_decode_metadata): only real decode rows keep their slot.
        real_num_decodes = sum(1 for n in query_lens if n > 0)
        state_indices[:real_num_decodes].copy_(block_table[:real_num_decodes, 0])
        state_indices[real_num_decodes:].fill_(PAD_SLOT_ID)
        return real_num_decodes


class GPUModelRunner:
    def __init__(self, model, device, variant, graphed):
        self.model, self.device, self.graphed = model, device, graphed
        self.ssm_state = torch.zeros(NUM_SLOTS, DIM, DIM, device=device)
        self.input_ids = torch.zeros(SIZE, dtype=torch.long, device=device)
        self.block_table = torch.zeros(SIZE, 1, dtype=torch.long, device=device)
        self.builder = GDNAttentionMetadataBuilder(device, variant)
        if graphed:
            self.graph, self.out = capture(
                lambda: forward(model, self.ssm_state, self.input_ids, self.builder.non_spec_state_indices_tensor),
                device=device, owner="GPUModelRunner (FULL decode graph)",
                static={"input_ids": self.input_ids, "block_table": self.block_table,
                        "non_spec_state_indices_tensor": self.builder.non_spec_state_indices_tensor},
                state={"ssm_state": self.ssm_state})
            self.ssm_state.zero_()                     # the capture's dummy run touched the states

    def execute_model(self, reqs):
        """``reqs``: (token id, state slot), one decode token per request."""
        n = len(reqs)
        t = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        self.input_ids[:n].copy_(t([tok for tok, _ in reqs]))     # padded rows of input_ids left as they were
        self.block_table[:n, 0].copy_(t([slot for _, slot in reqs]))
        self.block_table[n:].fill_(0)                             # padded requests: zero block-table rows
        if not self.graphed:
            self.builder.non_spec_state_indices_tensor[:n].copy_(self.block_table[:n, 0])
            return forward(self.model, self.ssm_state, self.input_ids[:n],
                           self.builder.non_spec_state_indices_tensor[:n]).clone()
        self.builder.build(self.block_table, SIZE, [1] * n + [0] * (SIZE - n))
        return replay(self.graph, self.out, real=n, size=SIZE, padded={"input_ids": self.input_ids})[:n].clone()


def run(variant: str, device: str = "cpu"):
    model = Model(device)

    def serve(graphed: bool):
        runner = GPUModelRunner(model, device, variant, graphed)
        outs = []
        # Four requests A..D in state slots 0..3 decode together, then C and D finish.
        outs.append(runner.execute_model([(1, 0), (2, 1), (3, 2), (4, 3)]))
        outs.append(runner.execute_model([(5, 0), (6, 1), (7, 2), (8, 3)]))
        # A (slot 0) and B (slot 1) go on, padded to the size-4 graph.
        outs.append(runner.execute_model([(9, 0), (10, 1)]))
        outs.append(runner.execute_model([(11, 0), (2, 1)]))
        outs.append(runner.execute_model([(3, 0), (4, 1)]))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
