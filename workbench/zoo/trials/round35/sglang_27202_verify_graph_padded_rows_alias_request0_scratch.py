"""Graph-mode target verify: padded rows write their GDN intermediate states into request 0's scratch slot.

Upstream: https://github.com/sgl-project/sglang/pull/27202 ("[NPU][Bugfix] fix MTP accuracy regression on Qwen3
hybrid models"). The graphs are the NPU (Ascend) graph runner's, which has the capture/replay semantics of
CUDA graphs; modelled with the workbench's CUDA-graph API.
Symptom: Qwen3.6-35B-A3 with MTP and ``--mamba-scheduler-strategy extra_buffer`` on Ascend scored below the
baseline on C-Eval (~87.5% -> 89.75% with the fix; with thinking on ~86% -> 90.71%), and thinking mode
produced repeated / looping reasoning ("garbage output or token repetition").
Mechanism: in graph-mode target verify the batch of ``raw_bs`` requests is padded to the captured ``bs``;
each request verifies ``draft_token_num`` tokens. The GDN verify kernel
(``fused_recurrent_gated_delta_rule_update``) writes every token row's intermediate SSM state into the
scratch buffer ``intermediate_state_cache`` at ``ssm_state_indices[row]``, and after verify
``move_intermediate_cache`` restores each request's state from the scratch slot of its last accepted token.
``AscendHybridLinearAttnBackend.init_forward_metadata_replay_cuda_graph`` built ``ssm_state_indices`` over only
``(bs - num_padding) * draft_token_num`` entries and zero-filled the padded tail, so every padded row's write
aliases real request 0's scratch slot 0. Whenever request 0 accepts only its first token, the restore reads
back what a padded row wrote there (computed from the stale tokens the padded rows of ``input_ids`` still
hold, from the padding dummy's state), and request 0 continues from a corrupted state. Eager runs the real
rows only, each with its own scratch slot.
Only the PR description was read, not the diff. The PR fixes two more bugs (post-verify mamba state tracking,
EAGLE top-k selection); only the index aliasing is modelled. The kernel's writes are made in row order so
that the padded rows' writes land last (on the device the colliding writes race); the model is one GDN-like
layer (a scalar-gated linear recurrence) and a fixed acceptance pattern.
Doctor: stale-padding, at ``fused_recurrent_gated_delta_rule_update`` (padded rows' intermediate-state writes
land in request 0's scratch slot, which ``move_intermediate_cache`` then restores).
Fix (upstream): build ``ssm_state_indices`` over the full graph bucket, ``bs * draft_token_num`` entries, so
each padded row has its own scratch slot (the buffer is sized ``bs * draft_token_num`` in
``init_cuda_graph_state``).
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/27202"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "fused_recurrent_gated_delta_rule_update"
SYMPTOM = "MTP verify under graph mode corrupts request 0's restored SSM state (accuracy drop, repetition)"

VOCAB, DIM, GATE = 16, 4, 0.8
DRAFT_TOKEN_NUM = 2                     # tokens verified per request (1 + draft tokens)
CAPTURE_BS = (2, 4)
MAX_BS = max(CAPTURE_BS)
NUM_SLOTS = 6                           # MambaPool; slot 0 is the padding dummy's
PAD_SLOT = 0


class Model:
    def __init__(self, device):
        gen = generator(27202)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq = randn(DIM, DIM, gen=gen, device=device, scale=0.6)
        self.wk = randn(DIM, DIM, gen=gen, device=device, scale=0.6)
        self.wv = randn(DIM, DIM, gen=gen, device=device, scale=0.6)
        self.wo = randn(DIM, DIM, gen=gen, device=device, scale=0.6)


def fused_recurrent_gated_delta_rule_update(q, k, v, ssm_states, cache_indices, intermediate_state_cache,
                                            ssm_state_indices):
    """Verify kernel: per request row r, S = ssm_states[cache_indices[r]], then for each of its tokens j:
    S = g * S + k_j v_j^T, o_j = q_j S, and S is written to ``intermediate_state_cache[ssm_state_indices[
    r * T + j]]``. The recurrent state itself is not updated (the restore does that after acceptance)."""
    bs, t = q.shape[0], q.shape[1]
    state = ssm_states[cache_indices]                                    # [bs, D, D]
    outs = []
    for j in range(t):
        state = GATE * state + k[:, j, :, None] * v[:, j, None, :]
        outs.append((q[:, j, None, :] @ state).squeeze(1))
        for r in range(bs):                                              # row order: padded rows last
            row = r * t + j
            intermediate_state_cache.index_copy_(0, ssm_state_indices[row:row + 1], state[r:r + 1])
    return torch.stack(outs, 1)                                          # [bs, T, D]


def verify_forward(model, input_ids, ssm_states, cache_indices, intermediate_state_cache, ssm_state_indices):
    h = model.emb[input_ids]                                             # [bs, T, D]
    o = fused_recurrent_gated_delta_rule_update(h @ model.wq, h @ model.wk, h @ model.wv, ssm_states,
                                                cache_indices, intermediate_state_cache, ssm_state_indices)
    return (h + o @ model.wo).reshape(-1, DIM)


class AscendHybridLinearAttnBackend:
    def __init__(self, device, variant):
        self.device, self.variant = device, variant
        self.ssm_states = torch.zeros(NUM_SLOTS, DIM, DIM, device=device)
        # init_cuda_graph_state: the verify scratch, one slot per token row of the largest bucket.
        self.intermediate_state_cache = torch.zeros(MAX_BS * DRAFT_TOKEN_NUM, DIM, DIM, device=device)
        self.ssm_state_indices = torch.zeros(MAX_BS * DRAFT_TOKEN_NUM, dtype=torch.long, device=device)

    def init_forward_metadata_replay_cuda_graph(self, bs, num_padding):
        rows = bs * DRAFT_TOKEN_NUM
        if self.variant == "fix":
            # Every row of the graph bucket, padded ones included, gets its own scratch slot.
            self.ssm_state_indices[:rows].copy_(torch.arange(rows, device=self.device))
        else:
            real = (bs - num_padding) * DRAFT_TOKEN_NUM
            self.ssm_state_indices[:real].copy_(torch.arange(real, device=self.device))
            self.ssm_state_indices[real:rows].zero_()                   # padded tail zero-filled

    def move_intermediate_cache(self, cache_indices, accept_lengths, ssm_state_indices):
        """After verify: each request's state becomes the intermediate state of its last accepted token."""
        rows = torch.arange(len(accept_lengths), device=self.device) * DRAFT_TOKEN_NUM + accept_lengths - 1
        self.ssm_states[cache_indices] = self.intermediate_state_cache[ssm_state_indices[rows]]


class GraphRunner:
    """Target-verify graphs per padded batch size; static inputs written before every replay."""

    def __init__(self, model, backend, device):
        self.model, self.backend, self.device = model, backend, device
        self.input_ids = torch.zeros(MAX_BS, DRAFT_TOKEN_NUM, dtype=torch.long, device=device)
        self.cache_indices = torch.full((MAX_BS,), PAD_SLOT, dtype=torch.long, device=device)
        self.graphs = {}
        b = backend
        for bs in CAPTURE_BS:
            self.graphs[bs] = capture(
                lambda bs=bs: verify_forward(model, self.input_ids[:bs], b.ssm_states, self.cache_indices[:bs],
                                             b.intermediate_state_cache,
                                             b.ssm_state_indices[:bs * DRAFT_TOKEN_NUM]),
                device=device, name=f"target verify, bs {bs}", owner="GraphRunner (target verify)",
                static={"input_ids": self.input_ids, "cache_indices": self.cache_indices,
                        "ssm_state_indices": b.ssm_state_indices},
                state={"ssm_states": b.ssm_states, "intermediate_state_cache": b.intermediate_state_cache})

    def replay(self, token_ids, slots):
        raw_bs = len(slots)
        bs = next(s for s in CAPTURE_BS if s >= raw_bs)
        t = lambda xs: torch.tensor(xs, dtype=torch.long).to(self.device)
        self.input_ids[:raw_bs].copy_(t(token_ids))       # padded rows keep what earlier steps wrote
        self.cache_indices[:raw_bs].copy_(t(slots))
        self.cache_indices[raw_bs:bs].fill_(PAD_SLOT)
        self.backend.init_forward_metadata_replay_cuda_graph(bs, bs - raw_bs)
        g, out = self.graphs[bs]
        out = replay(g, out, real=raw_bs * DRAFT_TOKEN_NUM, size=bs * DRAFT_TOKEN_NUM,
                     padded={"input_ids": self.input_ids.view(-1)})
        return out[:raw_bs * DRAFT_TOKEN_NUM].clone()


def run(variant: str, device: str = "cpu"):
    # Verify steps: (token ids per request, state slot per request, accepted tokens per request).
    steps = [
        ([[3, 5], [7, 2], [9, 4], [6, 13]], [1, 2, 3, 4], [2, 1, 2, 2]),
        ([[1, 8], [12, 3], [10, 15]], [1, 2, 3], [1, 2, 1]),      # 3 requests -> bs 4, one padded row
        ([[14, 6], [2, 11], [5, 9]], [1, 2, 3], [2, 2, 1]),
        ([[4, 7], [8, 1]], [1, 3], [2, 2]),
    ]

    def t(xs):
        return torch.tensor(xs, dtype=torch.long).to(device)

    def serve(graphed: bool):
        model = Model(device)
        backend = AscendHybridLinearAttnBackend(device, variant)
        runner = GraphRunner(model, backend, device) if graphed else None
        outs = []
        for token_ids, slots, accepted in steps:
            if graphed:
                outs.append(runner.replay(token_ids, slots))
            else:                                   # eager verify of the real requests only
                rows = len(slots) * DRAFT_TOKEN_NUM
                backend.ssm_state_indices[:rows].copy_(torch.arange(rows, device=device))
                outs.append(verify_forward(model, t(token_ids), backend.ssm_states, t(slots),
                                           backend.intermediate_state_cache,
                                           backend.ssm_state_indices[:rows]).clone())
            backend.move_intermediate_cache(t(slots), t(accepted), backend.ssm_state_indices)
        outs.append(backend.ssm_states[1:].clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
