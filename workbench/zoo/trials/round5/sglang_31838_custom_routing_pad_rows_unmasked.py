"""Padded rows of a DP-attention decode graph keep their expert ids and crowd out real tokens.

Upstream: https://github.com/sgl-project/sglang/pull/31838 ("Fix pad-row top-k masking with
custom_routing_function under DP attention").
Symptom: a MoE model that routes through a ``custom_routing_function`` (Llama-4 style: top-k on the
logits, sigmoid weights), served with DP attention + EP and decode CUDA graphs, gives NaN or garbage MoE
output; debugged to skewed per-expert dispatch counts that overflow per-expert buffers in the fused EP MoE
kernel (sglang main, July 2026).
Mechanism: each DP rank replays the graph of the padded batch size, so rows ``[raw_bs, bs)`` are routed
from whatever the static ``input_ids`` hold there (zeros, or an earlier batch's tokens), and identical
padded rows pick the same expert. ``select_experts`` masks padded rows (``topk_ids = -1`` past
``num_token_non_padded``) on its standard routing branches only: the ``custom_routing_function`` branch
asserted ``num_token_non_padded is None``, so such models pass no count and their padded rows keep real
expert ids through the EP dispatch. Tokens reach an expert's fixed-capacity receive buffer in
source-rank order, so one rank's padded rows take the slots that another rank's real tokens needed.
Doctor: stale-padding, at ``select_experts`` (the padded rows' expert ids left unmasked on the custom
routing branch).
Fix (upstream): drop the assertion and pass ``num_token_non_padded`` on the custom routing branch too, so
``_post_process_topk_ids`` masks the padded rows (``-1``: dispatched nowhere) after the custom routing.
"""
from __future__ import annotations

import torch

from workbench.engine import CUDAGraphMode, GraphManager
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/sgl-project/sglang/pull/31838"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "select_experts"
SYMPTOM = "another DP rank's padded rows fill an expert's buffer: real tokens lose their expert output"
VOCAB, DIM, NUM_EXPERTS, TOP_K = 8, 4, 4, 1
DP_SIZE, CAPTURE_BS = 2, (2, 4)
EXPERT_CAPACITY = 3                  # receive slots per expert in the fused EP MoE kernel


def custom_routing_function(hidden_states, gating_output, topk, renormalize):
    """``Llama4MoE.custom_routing_function``: top-k on the raw logits, sigmoid of the chosen ones."""
    router_scores, router_indices = torch.topk(gating_output, topk, dim=-1)
    return torch.sigmoid(router_scores.float()), router_indices.to(torch.int32)


def _mask_topk_ids_padded_region(topk_ids, num_token_non_padded=None):
    if num_token_non_padded is None:
        return
    indices = torch.arange(0, topk_ids.shape[0], device=topk_ids.device)
    topk_ids.masked_fill_((indices >= num_token_non_padded)[:, None], -1)    # the CUDA kernel mask_topk_ids


def select_experts(hidden_states, router_logits, top_k, *, variant, custom_routing_function=None,
                   num_token_non_padded=None, renormalize=False):
    if custom_routing_function is None:
        topk_weights, topk_ids = torch.topk(torch.softmax(router_logits, -1), top_k, dim=-1)
        topk_ids = topk_ids.to(torch.int32)
    else:
        if variant == "bug":
            assert num_token_non_padded is None, "num_token_non_padded is not yet supported in custom_routing_function"
        topk_weights, topk_ids = custom_routing_function(hidden_states=hidden_states, gating_output=router_logits,
                                                         topk=top_k, renormalize=renormalize)
    _mask_topk_ids_padded_region(topk_ids, num_token_non_padded)           # _post_process_topk_ids
    return topk_weights, topk_ids


def fused_ep_moe(hidden_states, topk_weights, topk_ids, w_experts):
    """EP dispatch + grouped experts + combine. Tokens reach an expert in source-rank order (rank 0's
    rows, then rank 1's); an expert's receive buffer holds ``EXPERT_CAPACITY`` tokens and the tokens
    past it get nothing back. ``-1`` ids are dispatched nowhere."""
    x = hidden_states.transpose(0, 1).reshape(-1, DIM)                      # [ranks * rows, dim], rank-major
    ids = topk_ids.transpose(0, 1).reshape(-1, TOP_K)
    weights = topk_weights.transpose(0, 1).reshape(-1, TOP_K)
    experts = torch.arange(NUM_EXPERTS, device=x.device)
    routed = (ids[..., None] == experts).to(x.dtype).sum(1)                 # [tokens, experts]
    slot = torch.cumsum(routed, 0) - routed                                 # arrival order at each expert
    received = routed * (slot < EXPERT_CAPACITY).to(x.dtype)
    expert_out = torch.einsum("td,edf->tef", x, w_experts)
    gate = (weights[..., None] * (ids[..., None] == experts).to(x.dtype)).sum(1)
    out = (received[..., None] * gate[..., None] * expert_out).sum(1)
    return out.reshape(DP_SIZE, -1, DIM).transpose(0, 1)                     # back to [rows, ranks, dim]


class Llama4MoEModel:
    """Embedding + one MoE layer with a custom routing function, run on each DP rank's rows."""

    def __init__(self, variant, device):
        gen = generator(31838)
        self.variant = variant
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.router = randn(DIM, NUM_EXPERTS, gen=gen, device=device)
        self.experts = randn(NUM_EXPERTS, DIM, DIM, gen=gen, device=device, scale=0.5)

    def forward(self, input_ids, num_token_non_padded=None):
        """``input_ids``: ``[rows, DP ranks]``; each rank routes its own rows (MoE input SCATTERED)."""
        hidden = self.embed[input_ids]
        router_logits = hidden @ self.router
        weights, ids = [], []
        for rank in range(DP_SIZE):
            w, i = select_experts(hidden[:, rank], router_logits[:, rank], TOP_K, variant=self.variant,
                                  custom_routing_function=custom_routing_function,
                                  num_token_non_padded=num_token_non_padded)
            weights.append(w)
            ids.append(i)
        moe_out = fused_ep_moe(hidden, torch.stack(weights, 1), torch.stack(ids, 1), self.experts)
        return hidden + moe_out


def schedule(device):
    """Decode steps: each DP rank's token ids (equal batch sizes: 4, 3, 1, 3)."""
    steps = [[[1, 6], [2, 3], [4, 5], [3, 2]], [[0, 3], [3, 5], [6, 2]], [[5, 2]], [[3, 3], [6, 1], [2, 5]]]
    return [torch.tensor(s, device=device) for s in steps]


def run(variant: str, device: str = "cpu"):
    model = Llama4MoEModel(variant, device)
    steps = schedule(device)

    def eager():
        return [model.forward(ids) for ids in steps]

    def served():
        max_bs = max(CAPTURE_BS)
        # the runner's static inputs (DecodeInputBuffers): token rows of every DP rank
        bufs = {"input_ids": torch.zeros(max_bs, DP_SIZE, dtype=torch.long, device=device),
                "num_token_non_padded": torch.tensor(max_bs, dtype=torch.int32, device=device)}

        def forward(bs):
            # a custom-routing model could not hand its count to select_experts (the assertion)
            count = bufs["num_token_non_padded"] if variant == "fix" else None
            return model.forward(bufs["input_ids"][:bs], count)

        manager = GraphManager(forward, CAPTURE_BS, device=device, mode=CUDAGraphMode.FULL,
                               static_buffers=bufs, name="CudaGraphRunner")
        manager.capture()
        outs = []
        for ids in steps:
            raw_bs = ids.shape[0]
            bs = manager.dispatch(raw_bs)
            bufs["input_ids"][:raw_bs].copy_(ids)                           # replay_prepare: rows [:raw_bs]
            bufs["num_token_non_padded"].fill_(raw_bs)
            outs.append(manager.replay(bs, raw_bs, padded={"input_ids": bufs["input_ids"]}).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
