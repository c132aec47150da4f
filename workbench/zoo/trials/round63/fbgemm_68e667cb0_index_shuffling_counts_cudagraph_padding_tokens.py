"""MoE ``index_shuffling`` counts the CUDA graph's padding tokens as real tokens and routes them among the real ones.

Upstream: https://github.com/pytorch/FBGEMM/commit/68e667cb03ef07a75cb8ddaaebbf9461bd1d7f26
("`torch.ops.fbgemm.index_shuffling` ignore padded tokens from CUDAGraph. (#940)", D71421100; no issue).
Symptom: padded CUDA-graph decode gets expert counts that include the padding tokens (the commit's
example: 4 real + 4 padded tokens give counts ``[4, 4]`` instead of ``[2, 2]``, and the shuffled order
``[T0, T2, P0, P2, T1, T3, P1, P3]``), so more experts are activated (DP2EP) and the per-expert token
ranges handed downstream mix padding among the real tokens.
Mechanism: decode is captured at a padded size T; each step copies its n real tokens into the static
hidden-state buffer, and rows ``[n, T)`` keep what an earlier, larger step left there. The router
computes ``scores = sigmoid(tokens @ router_DE)`` for all T rows and calls
``torch.ops.fbgemm.index_shuffling(scores)``. Its ``index_shuffling_kernel`` bounds everything by
``params.num_tokens`` = ``scores.size(0)``, the padded size frozen into the graph: it loads the scores of
``token_index < num_tokens``, ``atomic_add``s ``counts[expert_index]`` for every token, and scatters every
token into ``shuffled_expert_indices`` / ``shuffled_token_indices``. The padding rows' leftover scores
therefore pick experts, are counted in ``token_counts`` and are sorted in between the real tokens; a
Python int for the real count cannot help, since it would be frozen too.
Doctor: stale-padding, at ``index_shuffling`` (the real tokens' expert counts and shuffled positions depend
on the expert that the padded rows' stale scores select).
Fix (upstream): ``index_shuffling(Tensor scores, Tensor? num_valid_tokens=None)``; the kernel reads
``num_valid_tokens = params.num_valid_tokens ? *params.num_valid_tokens : num_total_tokens`` from device
memory at replay time, loads scores / counts / scatters only ``token_index < num_valid_tokens`` and writes
padding tokens after the real ones with in-bounds sentinels (``shuffled_expert_indices[t] = NumExperts - 1``,
``shuffled_token_indices[t] = t``); the barrier still waits for ``num_total_tokens``. The caller passes a
device ``num_valid_tokens`` that it refreshes before each replay.
(One-layer toy of the later public caller, ``MetaShufflingMoE._route`` + ``_routed_expert`` in
``gen_ai/moe/layers.py``, with ep_size 1, top-1, float32.)
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/FBGEMM/commit/68e667cb03ef07a75cb8ddaaebbf9461bd1d7f26"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "index_shuffling"
SYMPTOM = "expert token counts include the CUDA-graph padding tokens, which sit among the real tokens"
DIM, EXPERTS, T_PAD = 4, 3, 6
STEPS = (6, 3, 5, 2)          # real decode tokens per step; the graph always runs T_PAD rows


def index_shuffling(scores, num_valid_tokens=None):
    """``torch.ops.fbgemm.index_shuffling`` (top-1): returns ``counts[E + 1]`` (the last slot is the
    processed-token barrier), ``shuffled_expert_indices[T]`` and ``shuffled_token_indices[T]``."""
    num_total_tokens, num_experts = scores.shape
    token_index = torch.arange(num_total_tokens, device=scores.device)
    if num_valid_tokens is None:      # before the fix there was only params.num_tokens: every row is a token
        valid = torch.ones(num_total_tokens, dtype=torch.bool, device=scores.device)
    else:                              # *params.num_valid_tokens, read from device memory at replay
        valid = token_index < num_valid_tokens
    # smem.scores[i] = token_index < num_valid_tokens ? scores[...] : 0
    loaded = torch.where(valid[:, None], scores, torch.zeros_like(scores))
    expert_indices = loaded.argmax(dim=1)
    # atomic_add_relaxed(&params.counts[expert_index], 1) for token_index < num_valid_tokens
    experts = torch.arange(num_experts, device=scores.device)
    one_hot = ((expert_indices[:, None] == experts) & valid[:, None]).long()
    processed = torch.full((1,), num_total_tokens, dtype=one_hot.dtype, device=scores.device)
    counts = torch.cat([one_hot.sum(dim=0), processed])
    # scatter: valid tokens grouped by expert (in token order here); padding tokens after them, in place
    key = torch.where(valid, expert_indices, torch.full_like(expert_indices, num_experts))
    _, shuffled_token_indices = torch.sort(key, stable=True)
    shuffled_expert_indices = torch.where(valid[shuffled_token_indices], expert_indices[shuffled_token_indices],
                                          torch.full_like(expert_indices, num_experts - 1))
    return counts, shuffled_expert_indices, shuffled_token_indices


def gather_scale_dense_tokens(tokens, token_indices, expert_indices, scores):
    return tokens[token_indices] * scores[token_indices, expert_indices][:, None]


class MetaShufflingMoE:
    def __init__(self, device):
        gen = generator(940)
        self.router_DE = randn(DIM, EXPERTS, gen=gen, device=device)
        self.w_shared = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
        self.w_experts = randn(EXPERTS, DIM, DIM, gen=gen, device=device, scale=0.5)

    def _route(self, tokens, num_valid_tokens=None):
        scores = torch.sigmoid(tokens @ self.router_DE)
        token_counts, expert_indices, token_indices = index_shuffling(scores, num_valid_tokens)
        token_counts = token_counts[:EXPERTS]
        routed_tokens = gather_scale_dense_tokens(tokens, token_indices, expert_indices, scores)
        return routed_tokens, token_counts, token_indices, expert_indices

    def _routed_expert(self, x, token_counts, shared_output, token_indices):
        """``grouped_gemm`` over the ``token_counts`` ranges, scatter-added into the shared output."""
        offsets = torch.cumsum(token_counts, dim=0)
        row = torch.arange(x.shape[0], device=x.device)
        group = torch.searchsorted(offsets, row, right=True).clamp(max=EXPERTS - 1)
        in_group = (row < offsets[-1])[:, None]          # rows past sum(token_counts) are not computed
        y = torch.bmm(x[:, None, :], self.w_experts[group]).squeeze(1) * in_group
        return shared_output.index_add(0, token_indices, y)

    def forward(self, tokens, num_valid_tokens=None):
        shared_output = tokens @ self.w_shared
        routed, token_counts, token_indices, expert_indices = self._route(tokens, num_valid_tokens)
        out = self._routed_expert(routed, token_counts, shared_output, token_indices)
        return out, token_counts, token_indices, expert_indices


def run(variant: str, device: str = "cpu"):
    moe = MetaShufflingMoE(device)
    gen = generator(68)
    data = [randn(n, DIM, gen=gen, device=device) for n in STEPS]

    def results(n, out, token_counts, token_indices, expert_indices):
        """What the step hands on: its real tokens' outputs, the expert counts (activated experts,
        EP split sizes) and the shuffled order of its real tokens."""
        return [out[:n].clone(), token_counts.clone(), token_indices[:n].clone(), expert_indices[:n].clone()]

    def eager():
        outs = []
        for x in data:
            outs += results(x.shape[0], *moe.forward(x))
        return outs

    def served():
        hidden = torch.zeros(T_PAD, DIM, device=device)
        num_valid_tokens = torch.full((1,), T_PAD, dtype=torch.long, device=device)
        static = {"tokens": hidden}
        if variant == "fix":
            static["num_valid_tokens"] = num_valid_tokens
        g, out = capture(lambda: moe.forward(hidden, num_valid_tokens if variant == "fix" else None),
                         device=device, static=static, owner="MoE decode CUDA graph")
        outs = []
        for x in data:
            n = x.shape[0]
            hidden[:n].copy_(x)                         # rows [n, T_PAD) keep an earlier step's tokens
            num_valid_tokens.fill_(n)
            views = replay(g, out, real=n, size=T_PAD, padded={"tokens": hidden})
            outs += results(n, *views)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
