"""The router's token counts also count the graph warmup's dummy tokens: the expert bias drifts.

Upstream: https://github.com/NVIDIA/Megatron-LM/pull/4433 ("Important bugfixes in local CG
implementation that were leading to loss curve gaps for latent MoE models", commit 481efd020e); the
PR: "The expert bias, which is persistent across forward passes, was being accumulated on graph
warmup, corrupting its value."
Symptom: MoE training with aux-loss-free load balancing (``moe_router_enable_expert_bias``) and
Megatron-Core's local CUDA graphs drifts from eager: loss-curve gaps (Megatron-LM main, April 2026).
Mechanism: the router adds each forward pass's routing map to the persistent buffer
``local_tokens_per_expert``; at the end of the iteration ``finalize_model_grads`` turns the counts into
an expert-bias update and zeroes them. ``create_cudagraphs()`` runs after the first iteration has been
finalized, and ``create_fwd_graph`` warms each layer up with dummy (zero) hidden states before capturing
it. Those warmup passes route every dummy token to the experts the bias currently favours and add them
to the counts. The next iteration's bias update sees the dummy tokens too: the favoured experts look
overloaded and the bias moves the wrong way, so routing, outputs and later biases differ from eager.
Doctor: persistent-mutation, at ``routing`` (the in-place count update, run by the warmups).
Fix (upstream): back up every buffer of the module before the warmup and copy the backups back after
the capture (as was already done for ``main_grad``).
"""
from __future__ import annotations

import torch

from ..kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/Megatron-LM/pull/4433"
FAMILY = "persistent-buffer mutation"
KIND = "persistent-mutation"
SITE = "routing"
SYMPTOM = "expert bias updated from counts that include the warmup's dummy tokens: routing drifts"
TOKENS, DIM, EXPERTS, TOPK, MICROBATCHES, ITERATIONS, WARMUPS = 6, 4, 4, 1, 2, 3, 2
BIAS_RATE = 0.5


class MoELayer:
    def __init__(self, device):
        gen = generator(4433)
        self.router_weight = randn(DIM, EXPERTS, gen=gen, device=device, scale=0.1)
        self.experts = randn(EXPERTS, DIM, DIM, gen=gen, device=device, scale=0.5)
        self.local_tokens_per_expert = torch.zeros(EXPERTS, device=device)     # router buffers
        self.expert_bias = torch.zeros(EXPERTS, device=device)

    def buffers(self):
        return [self.local_tokens_per_expert, self.expert_bias]

    def routing(self, logits):
        scores = torch.sigmoid(logits)
        _, top = torch.topk(scores + self.expert_bias, TOPK, dim=-1)
        routing_map = torch.zeros_like(scores).scatter(1, top, 1.0)
        # Prevent extra local tokens accumulation on evaluation or activation recomputation
        if torch.is_grad_enabled():
            with torch.no_grad():
                self.local_tokens_per_expert += routing_map.sum(dim=0)
        return scores * routing_map

    def forward(self, hidden_states):
        probs = self.routing(hidden_states @ self.router_weight)
        expert_out = torch.einsum("td,edf->tef", hidden_states, self.experts)
        return (probs[..., None] * expert_out).sum(1)


def update_router_expert_bias(layer: MoELayer):
    """``finalize_model_grads`` -> ``_update_router_expert_bias`` (one rank: no all-reduce)."""
    tokens_per_expert = layer.local_tokens_per_expert
    average_tokens = tokens_per_expert.sum(dim=-1, keepdim=True) / tokens_per_expert.shape[-1]
    offset = average_tokens - tokens_per_expert
    updated_expert_bias = layer.expert_bias + torch.sign(offset) * BIAS_RATE
    tokens_per_expert.zero_()
    layer.expert_bias.copy_(updated_expert_bias)


def run(variant: str, device: str = "cpu"):
    gen = generator(1)
    data = [[randn(TOKENS, DIM, gen=gen, device=device) for _ in range(MICROBATCHES)] for _ in range(ITERATIONS)]

    def eager():
        layer, outs = MoELayer(device), []
        for batch in data:
            outs += [layer.forward(x) for x in batch]
            update_router_expert_bias(layer)
        return outs + [layer.expert_bias.clone()]

    def served():
        layer, outs = MoELayer(device), []
        # iteration 1 runs eagerly (the manager records which layers to graph), then is finalized
        outs += [layer.forward(x) for x in data[0]]
        update_router_expert_bias(layer)
        # create_cudagraphs(): warm up on dummy hidden states, then capture
        hidden_buf = torch.zeros(TOKENS, DIM, device=device)
        backup = [buf.clone() for buf in layer.buffers()] if variant == "fix" else None
        g, out = capture(lambda: layer.forward(hidden_buf), device=device, warmups=WARMUPS,
                         static={"hidden_states": hidden_buf},
                         state={"local_tokens_per_expert": layer.local_tokens_per_expert},
                         owner="Megatron CudaGraphManager")
        if backup is not None:
            for saved, buf in zip(backup, layer.buffers()):
                buf.copy_(saved)
        for batch in data[1:]:
            for x in batch:
                hidden_buf.copy_(x)
                outs.append(replay(g, out).clone())
            update_router_expert_bias(layer)
        return outs + [layer.expert_bias.clone()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
