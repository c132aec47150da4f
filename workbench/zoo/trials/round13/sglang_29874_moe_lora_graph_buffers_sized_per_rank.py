"""MoE-LoRA CUDA-graph routing buffers are sized for one DP rank's batch, but the MoE runs on the DP-gathered tokens.

Upstream: https://github.com/sgl-project/sglang/pull/29874 ("[LoRA] DSA indexer targets + MoE-LoRA cuda-graph
and RL adapter-reload fixes"; ported to main as https://github.com/sgl-project/sglang/pull/31525).
Symptom: serving a MoE model with expert LoRA adapters under ``--enable-dp-attention`` with CUDA graphs
crashes while capturing the decode graphs (an illegal memory access, or ``assert x.shape[-1] == K`` in the
LoRA shrink kernel); with ``--disable-cuda-graph``, or without DP attention, it serves (GLM-5.1 /
DeepSeek-V3.2 RL rollouts, sglang-miles, July 2026).
Mechanism: for CUDA graphs the LoRA backend preallocates the per-token MoE routing buffers once
(``init_cuda_graph_moe_buffers``: ``token_lora_mapping`` and friends) and ``prepare_lora_batch`` fills
them in place before capture and before every replay, so the captured MoE-LoRA kernels read fixed
addresses. The buffers were sized from the decode graph's ``max_bs`` (this rank's requests). Under DP
attention, though, attention runs per rank and the MoE layers run on the DP-*gathered* tokens, up to
``max_bs * attention_dp_size`` of them: the gathered routing metadata does not fit, and the kernel's
adapter table is shorter than its token dimension. Eager batches build the mapping at the gathered
length every step.
Doctor: undersized-buffer, at ``init_cuda_graph_moe_buffers`` (the static buffer is sized for the
per-rank batch, not for the gathered tokens written into it).
Fix (upstream): size the CUDA-graph MoE buffers for ``max_bs * attention_dp_size`` tokens (with
``get_gathered_moe_num_tokens`` for the live upper bound), and fall back to the eager LoRA preparation
when a gathered batch still exceeds them.
"""
from __future__ import annotations

import bisect

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/29874"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "init_cuda_graph_moe_buffers"
SYMPTOM = "MoE-LoRA + DP attention: the decode CUDA-graph capture crashes (LoRA routing buffers too small)"
VOCAB, DIM, RANK, NUM_EXPERTS, NUM_LORAS = 10, 4, 2, 2, 3
ATTENTION_DP_SIZE = 2
CAPTURE_BS = [1, 2]


class Model:
    def __init__(self, device):
        gen = generator(29874)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.gate = randn(DIM, NUM_EXPERTS, gen=gen, device=device)
        self.experts = randn(NUM_EXPERTS, DIM, DIM, gen=gen, device=device, scale=0.5)
        # LoRA slot 0 is "no adapter"
        self.lora_a = torch.cat([torch.zeros(1, DIM, RANK),
                                 torch.randn(NUM_LORAS - 1, DIM, RANK, generator=gen) * 0.5]).to(device)
        self.lora_b = torch.cat([torch.zeros(1, RANK, DIM),
                                 torch.randn(NUM_LORAS - 1, RANK, DIM, generator=gen) * 0.5]).to(device)
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)


class LoRABackend:
    """The triton LoRA backend's CUDA-graph state for MoE layers."""

    def __init__(self, variant: str, device):
        self.variant = variant
        self.device = device
        self.cuda_graph_moe_buffers = None

    def init_cuda_graph_moe_buffers(self, max_bs: int, device):
        if self.variant == "bug":
            max_num_tokens = max_bs
        else:
            max_num_tokens = max_bs * ATTENTION_DP_SIZE     # MoE runs on the DP-gathered tokens
        self.cuda_graph_moe_buffers = {
            "token_lora_mapping": torch.zeros(max_num_tokens, dtype=torch.long, device=device),
        }

    def prepare_lora_batch(self, gathered_lora_ids, use_cuda_graph: bool):
        """Per-token adapter slots of the gathered MoE tokens; in place under CUDA graphs."""
        num_tokens = len(gathered_lora_ids)
        if not use_cuda_graph:
            return torch.tensor(gathered_lora_ids, device=self.device)
        token_lora_mapping = self.cuda_graph_moe_buffers["token_lora_mapping"]
        token_lora_mapping[:num_tokens] = torch.tensor(gathered_lora_ids, device=token_lora_mapping.device)
        return token_lora_mapping[:num_tokens]


def fused_moe_lora(model, hidden_states, token_lora_mapping):
    """Top-1 MoE with per-token expert LoRA (shrink + expand)."""
    topk_ids = (hidden_states @ model.gate).argmax(-1)
    out = torch.einsum("td,tde->te", hidden_states, model.experts[topk_ids])
    shrink = torch.einsum("td,tdr->tr", hidden_states, model.lora_a[token_lora_mapping])
    return out + torch.einsum("tr,tre->te", shrink, model.lora_b[token_lora_mapping])


def forward_decode(model, input_ids, peer_hidden_states, token_lora_mapping):
    """Attention-DP decode: per-rank part, all-gather to the MoE, scatter back this rank's rows."""
    bs = input_ids.shape[0]
    hidden_states = model.emb[input_ids]
    gathered = torch.cat([hidden_states, peer_hidden_states])        # dp_gather (rank 0 first)
    moe_out = fused_moe_lora(model, gathered, token_lora_mapping)
    return (hidden_states + moe_out[:bs]) @ model.lm_head              # dp_scatter


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    # decode steps: (this rank's tokens, adapters), (peer rank's tokens, adapters); both padded to one bs
    steps = [([3, 5], [1, 2], [7, 2], [2, 0]),
             ([4], [1], [6], [2]),
             ([8, 1], [2, 1], [9, 3], [1, 1])]

    def serve(graphed: bool):
        backend = LoRABackend(variant, device)
        max_bs = max(CAPTURE_BS)
        input_ids = torch.zeros(max_bs, dtype=torch.long, device=device)
        peer_hidden_states = torch.zeros(max_bs, DIM, device=device)  # the all-gather's receive side
        graphs = {}
        if graphed:
            backend.init_cuda_graph_moe_buffers(max_bs, device)
            for bs in CAPTURE_BS:
                # capture batch: dummy requests without adapters on every DP rank
                mapping = backend.prepare_lora_batch([0] * (bs * ATTENTION_DP_SIZE), use_cuda_graph=True)
                graphs[bs] = capture(
                    lambda bs=bs, mapping=mapping: forward_decode(model, input_ids[:bs], peer_hidden_states[:bs],
                                                                  mapping),
                    device=device, static={"input_ids": input_ids, "peer_hidden_states": peer_hidden_states,
                                           **backend.cuda_graph_moe_buffers},
                    owner="CudaGraphRunner (decode, DP attention)")
        outs = []
        for ids, loras, peer_ids, peer_loras in steps:
            raw_bs = len(ids)
            bs = CAPTURE_BS[bisect.bisect_left(CAPTURE_BS, raw_bs)]
            pad = bs - raw_bs
            ids_t = torch.tensor(ids + [0] * pad, device=device)
            peer_h = model.emb[torch.tensor(peer_ids + [0] * (bs - len(peer_ids)), device=device)]
            gathered_lora_ids = loras + [0] * pad + peer_loras + [0] * (bs - len(peer_loras))
            if not graphed:
                mapping = backend.prepare_lora_batch(gathered_lora_ids, use_cuda_graph=False)
                outs.append(forward_decode(model, ids_t, peer_h, mapping)[:raw_bs])
                continue
            backend.prepare_lora_batch(gathered_lora_ids, use_cuda_graph=True)
            input_ids[:bs].copy_(ids_t)
            peer_hidden_states[:bs].copy_(peer_h)
            g, out = graphs[bs]
            outs.append(replay(g, out, real=raw_bs, size=bs)[:raw_bs].clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
