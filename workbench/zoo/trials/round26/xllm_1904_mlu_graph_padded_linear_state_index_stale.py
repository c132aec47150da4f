"""xLLM MLU decode graphs keep stale state ids in the padded rows: padding advances a live linear-attention state.

Upstream: https://github.com/xLLM-AI/xllm/pull/1904 ("bugfix: fix mlu graph linear state padding."), July 2026.
Symptom: Qwen3.5 / Qwen3-Next (gated-delta-net linear attention) served with MLU graphs: after a decode batch
shrinks and is padded to its graph size, a request whose state slot an earlier decode row used gets a corrupted
recurrent state and continues with wrong tokens; eager execution is correct (silent, batch-composition dependent).
(The PR has no description; this follows its code comment, "Padding decode rows can still execute stateful graph
kernels. Point them at the reserved padding slot so they cannot update a live request state.", and its test.)
Mechanism: ``GraphPersistentParam`` owns ``linear_state_indices_`` (one int per decode row, capacity
``max_seq_lens``, initialised to ``max_seq_lens`` as a "padding value ... not used in valid computations"). Each
step ``update_input_buffer`` copies the batch's ``linear_state_indices`` into ``[:actual_batch_size]`` and zeroes the
padded tails of ``tokens_``, ``positions_`` and ``new_cache_slots_``, but leaves ``linear_state_indices_`` past the
real rows as they were; ``params_.embedding.linear_state_indices`` is the ``[:padded_tokens]`` view the graph was
captured with. Padded decode rows still run the stateful kernels: ``Qwen3_5GatedDeltaNetImpl::forward`` reads and
writes ``ssm_cache`` (and ``conv_cache``) through ``state_indices`` in
``fused_recurrent_gated_delta_rule_packed_decode``. After a batch of four (slots 10/20/30/40 in the PR's test)
shrinks to three, the padded row still points at slot 40; once that slot belongs to another live request (here
request E, which took the finished request D's slot and is between its prefill chunks), every padded replay folds
a zero token into E's state.
Doctor: stale-padding, at ``fused_recurrent_gated_delta_rule_packed_decode`` (the decode kernel updates the recurrent
state through the padded row's stale slot index).
Fix (upstream): ``linear_state_indices_`` starts as ``kPaddingLinearStateId`` (0, a reserved slot the block manager
never hands out) and ``update_input_buffer`` fills ``[actual_batch_size, padded_tokens)`` with it every step, as the
ACL graph path already did, so padded rows only ever touch the reserved padding slot.
(Read: the PR diff and test ``LinearStatePaddingTailUsesPaddingId``, the pre-fix ``mlu_graph_executor_impl.cpp``
(``update_input_buffer``, ``MluGraph::capture``) and ``qwen3_5_gated_delta_net.cpp``. One gated-delta-net layer
without the conv1d cache, a single state head, and the prefill recurrence written token by token.)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/xLLM-AI/xllm/pull/1904"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "fused_recurrent_gated_delta_rule_packed_decode"
SYMPTOM = "padded MLU-graph decode rows advance another live request's linear-attention state"

VOCAB, HIDDEN, HEAD_K, HEAD_V = 16, 6, 3, 3
MAX_SEQ_LENS = 8                     # persistent buffer capacity (rows)
PADDING_NUM_TOKENS = 4               # the decode graph's batch size
kPaddingLinearStateId = 0            # reserved state slot (core/common/constants.h)
NUM_STATE_SLOTS = MAX_SEQ_LENS + 1   # slot 0 reserved; slot MAX_SEQ_LENS is the old padding value


def l2norm(x):
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-6)


def gdn_gating(a, b, A_log, dt_bias):
    """``fused_gdn_gating``: per-token decay g in (0, 1) and write strength beta."""
    g = torch.exp(-torch.exp(A_log) * F.softplus(a + dt_bias))
    return g, torch.sigmoid(b)


def fused_recurrent_gated_delta_rule_packed_decode(mixed_qkv, a, b, A_log, dt_bias, scale, ssm_cache,
                                                   state_indices):
    """One token per row: read each row's state by index, apply the gated delta rule, write it back."""
    q, k, v = mixed_qkv.split([HEAD_K, HEAD_K, HEAD_V], dim=-1)
    q, k = l2norm(q), l2norm(k)
    g, beta = gdn_gating(a, b, A_log, dt_bias)
    idx = state_indices.long()
    state = ssm_cache[idx] * g[:, :, None]                           # [rows, K, V]
    recalled = (state * k[:, :, None]).sum(1)                         # S^T k
    state = state + k[:, :, None] * (beta * (v - recalled))[:, None, :]
    ssm_cache[idx] = state
    out = (state * (q * scale)[:, :, None]).sum(1)
    return out, state


def chunk_gated_delta_rule(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state):
    """Prefill of one request (its tokens in order), from ``initial_state``; returns outputs and final state."""
    q, k, v = mixed_qkv.split([HEAD_K, HEAD_K, HEAD_V], dim=-1)
    q, k = l2norm(q), l2norm(k)
    g, beta = gdn_gating(a, b, A_log, dt_bias)
    state, outs = initial_state, []
    for t in range(mixed_qkv.shape[0]):
        state = state * g[t]
        recalled = (state * k[t][:, None]).sum(0)
        state = state + k[t][:, None] * (beta[t] * (v[t] - recalled))[None, :]
        outs.append((state * (q[t] * scale)[:, None]).sum(0))
    return torch.stack(outs), state


class Qwen3_5GatedDeltaNet:
    def __init__(self, device):
        gen = generator(1904)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.in_proj_qkv = randn(HIDDEN, 2 * HEAD_K + HEAD_V, gen=gen, device=device, scale=0.6)
        self.in_proj_a = randn(HIDDEN, 1, gen=gen, device=device, scale=0.6)
        self.in_proj_b = randn(HIDDEN, 1, gen=gen, device=device, scale=0.6)
        self.A_log = randn(1, gen=gen, device=device, scale=0.3)
        self.dt_bias = randn(1, gen=gen, device=device, scale=0.3)
        self.o_proj = randn(HEAD_V, HIDDEN, gen=gen, device=device, scale=0.6)
        self.scale = HEAD_K ** -0.5

    def forward_decode(self, tokens, ssm_cache, state_indices):
        h = self.embed_tokens[tokens]
        core, _ = fused_recurrent_gated_delta_rule_packed_decode(
            h @ self.in_proj_qkv, h @ self.in_proj_a, h @ self.in_proj_b, self.A_log, self.dt_bias, self.scale,
            ssm_cache, state_indices)
        return h + core @ self.o_proj

    def forward_prefill(self, tokens, ssm_cache, state_id, has_initial_state):
        h = self.embed_tokens[tokens]
        initial = ssm_cache[state_id] if has_initial_state else torch.zeros_like(ssm_cache[state_id])
        core, final = chunk_gated_delta_rule(h @ self.in_proj_qkv, h @ self.in_proj_a, h @ self.in_proj_b,
                                             self.A_log, self.dt_bias, self.scale, initial)
        ssm_cache[state_id] = final
        return h + core @ self.o_proj


class GraphPersistentParam:
    def __init__(self, device, variant):
        self.variant = variant
        self.tokens_ = torch.zeros(MAX_SEQ_LENS, dtype=torch.long, device=device)
        self.output_ = torch.zeros(MAX_SEQ_LENS, HIDDEN, device=device)
        padding_value = MAX_SEQ_LENS if variant == "bug" else kPaddingLinearStateId
        self.linear_state_indices_ = torch.full((MAX_SEQ_LENS,), padding_value, dtype=torch.int32, device=device)

    def update_input_buffer(self, tokens, linear_state_ids, padding_needed):
        actual = tokens.shape[0]
        padded_tokens = actual + padding_needed
        self.tokens_[:actual].copy_(tokens)
        if padding_needed > 0:
            self.tokens_[actual:padded_tokens].zero_()
        self.linear_state_indices_[:actual].copy_(
            torch.tensor(linear_state_ids, dtype=torch.int32).to(self.tokens_.device))
        if self.variant == "fix" and padded_tokens > actual:
            self.linear_state_indices_[actual:padded_tokens].fill_(kPaddingLinearStateId)


class MluGraphExecutorImpl:
    def __init__(self, model, ssm_cache, device, variant, graphed):
        self.model, self.ssm_cache, self.device, self.variant, self.graphed = model, ssm_cache, device, variant, graphed
        self.param = GraphPersistentParam(device, variant)
        self.graph = None
        if graphed:   # output_ is the one output buffer every MLU graph of the executor copies into
            events.shared_outputs("GraphPersistentParam", {"output_": self.param.output_})

    def _forward_graph(self):
        n = PADDING_NUM_TOKENS
        hidden = self.model.forward_decode(self.param.tokens_[:n], self.ssm_cache,
                                           self.param.linear_state_indices_[:n])
        self.param.output_[:n].copy_(hidden)
        return self.param.output_[:n]

    def run_decode(self, tokens, linear_state_ids):
        actual = tokens.shape[0]
        if not self.graphed:
            ids = torch.tensor(linear_state_ids, dtype=torch.int32).to(self.device)
            return self.model.forward_decode(tokens, self.ssm_cache, ids).clone()
        self.param.update_input_buffer(tokens, linear_state_ids, PADDING_NUM_TOKENS - actual)
        if self.graph is None:                             # MluGraph::capture on first use, then replay
            self.graph, self.out = capture(
                self._forward_graph, device=self.device, warmups=0, name=f"decode {PADDING_NUM_TOKENS}",
                owner="MluGraphExecutorImpl (GraphPersistentParam)",
                static={"tokens_": self.param.tokens_, "linear_state_indices_": self.param.linear_state_indices_},
                state={"ssm_cache": self.ssm_cache})
        padded = {"linear_state_indices_": self.param.linear_state_indices_} if self.variant == "bug" else {}
        return replay(self.graph, self.out, real=actual, size=PADDING_NUM_TOKENS, padded=padded)[:actual].clone()

    def run_prefill(self, tokens, state_id, has_initial_state):
        return self.model.forward_prefill(tokens, self.ssm_cache, state_id, has_initial_state).clone()


def run(variant: str, device: str = "cpu"):
    model = Qwen3_5GatedDeltaNet(device)
    t = lambda xs: torch.tensor(xs, dtype=torch.long).to(device)  # noqa: E731

    def serve(graphed: bool):
        ssm_cache = torch.zeros(NUM_STATE_SLOTS, HEAD_K, HEAD_V, device=device)
        executor = MluGraphExecutorImpl(model, ssm_cache, device, variant, graphed)
        A, B, C, D = 1, 2, 3, 4                             # linear state slots handed out by the block manager
        outs = [executor.run_prefill(t([3, 7]), A, False), executor.run_prefill(t([5, 1]), B, False),
                executor.run_prefill(t([9, 2]), C, False), executor.run_prefill(t([4, 4]), D, False)]
        outs.append(executor.run_decode(t([11, 12, 13, 14]), [A, B, C, D]))
        # D finishes; E reuses its slot and prefills its first chunk.
        E = D
        outs.append(executor.run_prefill(t([6, 8, 10]), E, False))
        # A decode-only step while E waits for its next chunk: 3 rows padded to the size-4 graph.
        outs.append(executor.run_decode(t([15, 1, 2]), [A, B, C]))
        outs.append(executor.run_prefill(t([12, 5]), E, True))
        outs.append(executor.run_decode(t([3, 6, 9, 7]), [A, B, C, E]))
        return outs + [ssm_cache[1:MAX_SEQ_LENS].clone()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
