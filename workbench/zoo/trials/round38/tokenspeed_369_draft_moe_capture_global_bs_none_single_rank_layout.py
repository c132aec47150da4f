"""The draft first-step MoE all-gather is captured with a single-rank layout because ``ctx.global_bs`` is unset at capture.

Upstream: https://github.com/lightseekorg/tokenspeed/pull/369 ("fix(cudagraph): set ctx.global_bs at capture for
draft MoE all-gather", commit 4b87a507).
Symptom: with DP attention + MoE + MTP under CUDA graphs, the draft model's first-step logits are NaN and the
MTP accept_rate collapses to 0 (commit comment and regression-test docstring; DP=4, moe-ep=4).
Mechanism: ``CudaGraphWrapper._capture_one`` builds a dummy ``ForwardContext`` and, for ``dp_size > 1``, sets
``ctx.global_num_tokens = [bs * max_tokens_per_req] * world_size`` but leaves ``ctx.global_bs = None``. Under
``draft_first_step_reduce`` the MoE collectives are sized by ``CommManager.moe_tp_ep_group_scattered_num_tokens``
from ``ctx.global_bs``; with ``None`` it takes the fallback branch, a *single-rank* layout (only the local
rank's slot holds ``ctx.bs`` tokens, e.g. ``[0, bs, 0, 0]`` on rank 1). That host-side list fixes the gather's
segment sizes and the reduce-scatter's row offset, so the captured TritonRSAG collective keeps them. At replay
``ctx.global_bs`` is the live per-rank list, the peers lay the symmetric memory out in the multi-rank layout
(``[bs, bs, bs, bs]``), and an eager step would gather all ranks' tokens and read its own rows at offset
``bs * rank``; the replay gathers only local tokens and reads the peers' partial sums at offset 0, i.e. another
rank's tokens (upstream: uninitialised symmetric memory, NaN). Here the peers are simulated on the host: before
every step they write their tokens and their experts' partial outputs into the symmetric buffers, in the live
layout.
Doctor: warmup-divergence, at moe_tp_ep_group_scattered_num_tokens (the layout branch decided at capture from
``global_bs is None``, reused by every replay while eager decides the multi-rank layout).
Fix (upstream): ``_capture_one`` also sets ``ctx.global_bs = [bs] * self.world_size`` next to
``ctx.global_num_tokens``, so the captured layout equals the replayed one.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/lightseekorg/tokenspeed/pull/369"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "moe_tp_ep_group_scattered_num_tokens"
SYMPTOM = "draft first-step logits under DP+MoE+MTP CUDA graphs are wrong (NaN upstream), MTP accept rate 0"

WORLD, RANK, BS, DIM, VOCAB, STEPS = 4, 1, 2, 4, 16, 3   # DP=4 attention, moe ep=4 (one expert per rank)


class Mapping:
    """DP=4, dense-tp=4, moe-tp=1, ep=4, as in the upstream regression test; only the MoE group matters here."""

    def __init__(self, rank):
        self.rank, self.world_size = rank, WORLD
        self.moe_tp_ep_size, self.moe_dp_rank, self.moe_tp_ep_rank = WORLD, 0, rank


class ForwardContext:
    def __init__(self, bs, input_num_tokens, draft_first_step_reduce, global_num_tokens=None, global_bs=None):
        self.bs, self.input_num_tokens = bs, input_num_tokens
        self.draft_first_step_reduce = draft_first_step_reduce
        self.global_num_tokens, self.global_bs = global_num_tokens, global_bs


class SymmetricMemory:
    """The TritonRSAG symmetric workspace: every rank's gathered tokens and every rank's partial MoE output,
    each at the row offsets of the layout the writer used."""

    def __init__(self, device):
        self.tokens = torch.zeros(WORLD * BS, DIM, device=device)
        self.partials = torch.zeros(WORLD, WORLD * BS, DIM, device=device)


class DraftModel:
    """The MTP draft layer's first step: embedding, one MoE block (expert ``r`` lives on rank ``r``), lm head."""

    def __init__(self, device):
        gen = generator(369)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.router = randn(DIM, WORLD, gen=gen, device=device)
        self.experts = randn(WORLD, DIM, DIM, gen=gen, device=device, scale=0.6)
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device)

    def expert_partial(self, x, rank):
        """Rank ``rank``'s share of the MoE output for the gathered rows ``x`` (its gate times its expert)."""
        gate = torch.softmax(x @ self.router, dim=-1)[:, rank:rank + 1]
        return gate * (x @ self.experts[rank])


def token_all_gather(hidden, peer_tokens, scattered_num_tokens, rank):
    """Gathered rows in layout order: the local segment from ``hidden``, the others from symmetric memory."""
    segments, offset = [], 0
    for r, n in enumerate(scattered_num_tokens):
        segments.append(hidden if r == rank else peer_tokens[offset:offset + n])
        offset += n
    return torch.cat(segments)


def token_reduce_scatter(partial, peer_partials, scattered_num_tokens, rank):
    """This rank's rows of the sum over ranks: its own partial plus every peer's, read at its layout offset."""
    offset, n = sum(scattered_num_tokens[:rank]), scattered_num_tokens[rank]
    peers = [r for r in range(WORLD) if r != rank]
    # (one peer at a time: an index list inside a capture is a pageable host-to-device copy on CUDA)
    return partial[offset:offset + n] + torch.stack([peer_partials[r, offset:offset + n] for r in peers]).sum(0)


class CommManager:
    def __init__(self, mapping, symm):
        self.mapping, self.symm = mapping, symm

    def moe_tp_ep_group_scattered_num_tokens(self, ctx):
        tp_ep_size = self.mapping.moe_tp_ep_size
        # Under draft first-step reduce, the midlayer pruned activations to bs rows before pre_moe_comm.
        global_counts = ctx.global_bs if ctx.draft_first_step_reduce else ctx.global_num_tokens
        if global_counts is not None:
            start = self.mapping.moe_dp_rank * tp_ep_size
            return list(global_counts[start:start + tp_ep_size])
        num_tokens = ctx.bs if ctx.draft_first_step_reduce else ctx.input_num_tokens
        result = [0] * tp_ep_size                        # single-rank fallback: only the local rank has tokens
        result[self.mapping.moe_tp_ep_rank] = num_tokens
        return result

    def pre_moe_comm(self, hidden_states, ctx):
        return token_all_gather(hidden_states, self.symm.tokens,
                                self.moe_tp_ep_group_scattered_num_tokens(ctx), self.mapping.rank)

    def post_moe_comm(self, hidden_states, ctx):
        return token_reduce_scatter(hidden_states, self.symm.partials,
                                    self.moe_tp_ep_group_scattered_num_tokens(ctx), self.mapping.rank)


def forward_step(model, comm, input_ids, ctx):
    """The draft first step on this rank: gather all ranks' rows, apply the local expert, reduce-scatter."""
    h = model.embed[input_ids]
    gathered = comm.pre_moe_comm(h, ctx)
    h = comm.post_moe_comm(model.expert_partial(gathered, comm.mapping.rank), ctx)
    return h @ model.lm_head


class CudaGraphWrapper:
    def __init__(self, model, comm, device, variant, enforce_eager):
        self.model, self.comm, self.variant, self.disable = model, comm, variant, enforce_eager
        self.dp_size, self.world_size, self.max_tokens_per_req = WORLD, WORLD, 1
        self.input_ids_buf = torch.zeros(BS, dtype=torch.long, device=device)
        self.graphs, self.output_buffers = {}, {}
        if not self.disable:
            self.graphs[BS], self.output_buffers[BS] = self._capture_one(BS, device)

    def _capture_one(self, bs, device):
        ctx = ForwardContext(bs=bs, input_num_tokens=bs * self.max_tokens_per_req, draft_first_step_reduce=True)
        # For DP mode, global_num_tokens must be set so that the MoE all-gather comm layers know token counts
        # for all DP ranks. During capture, use uniform dummy counts across ranks.
        if self.dp_size > 1:
            ctx.global_num_tokens = [bs * self.max_tokens_per_req] * self.world_size
            if self.variant == "fix":
                ctx.global_bs = [bs] * self.world_size
        return capture(lambda: forward_step(self.model, self.comm, self.input_ids_buf[:bs], ctx),
                       device=device, warmups=2, owner="CudaGraphWrapper (draft decode graph)",
                       static={"input_ids_buf": self.input_ids_buf, "symm.tokens": self.comm.symm.tokens,
                               "symm.partials": self.comm.symm.partials})

    def __call__(self, bs, ctx, input_ids):
        self.input_ids_buf[:bs].copy_(input_ids)
        if self.disable:
            return forward_step(self.model, self.comm, self.input_ids_buf[:bs], ctx).clone()
        return replay(self.graphs[bs], self.output_buffers[bs]).clone()


def peer_ranks_publish(model, symm, ids_by_rank, global_bs):
    """What the other DP ranks write into symmetric memory for this step, in the live multi-rank layout:
    their tokens, and their expert's partial output for every gathered row."""
    gathered = model.embed[torch.cat(ids_by_rank)]
    offsets = [sum(global_bs[:r]) for r in range(WORLD)]
    for r in range(WORLD):
        if r != RANK:
            symm.tokens[offsets[r]:offsets[r] + global_bs[r]].copy_(gathered[offsets[r]:offsets[r] + global_bs[r]])
            symm.partials[r].copy_(model.expert_partial(gathered, r))


def run(variant: str, device: str = "cpu"):
    model = DraftModel(device)
    gen = generator(3690)
    steps = [[torch.randint(0, VOCAB, (BS,), generator=gen).to(device) for _ in range(WORLD)] for _ in range(STEPS)]

    def serve(graphed: bool):
        symm = SymmetricMemory(device)
        comm = CommManager(Mapping(RANK), symm)
        runner = CudaGraphWrapper(model, comm, device, variant, enforce_eager=not graphed)
        outs = []
        for ids_by_rank in steps:
            global_bs = [BS] * WORLD                     # live per-rank batch sizes (the padded DP bucket)
            ctx = ForwardContext(bs=BS, input_num_tokens=BS, draft_first_step_reduce=True,
                                 global_num_tokens=list(global_bs), global_bs=global_bs)
            peer_ranks_publish(model, symm, ids_by_rank, global_bs)
            outs.append(runner(BS, ctx, ids_by_rank[RANK]))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
