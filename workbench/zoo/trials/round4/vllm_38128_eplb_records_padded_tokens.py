"""Padded rows of a captured decode batch are routed and counted in the EPLB expert-load statistics.

Upstream: https://github.com/vllm-project/vllm/pull/38128 ("[EPLB] Mask padding in EPLB load recording").
Symptom: with expert-parallel load balancing (``--enable-eplb``) and CUDA graphs (or DP padding), the
per-expert token counts EPLB rebalances on include the padding tokens of every padded step, so the
rebalancer places redundant experts for a load that does not exist (vLLM main, March 2026).
Mechanism: a batch of ``n`` tokens is served by the graph captured for the next capture size, so rows
``[n, size)`` run through the model with whatever an earlier step left in the persistent ``input_ids``
buffer. The router maps every row to a physical expert in ``eplb_map_to_physical_and_record`` and
``scatter_add_``s a one for each into the persistent ``expert_load_view``, padded rows included; the
count is inside the graph, so nothing outside it can subtract them. The load window, and the
rearrangement computed from it, differ from what the same requests produce eagerly.
Doctor: stale-padding, at ``eplb_map_to_physical_and_record`` (the load ``scatter_add_`` that counts the
padded rows).
Fix (upstream): ``EplbModelState.num_unpadded_tokens_tensor``, a device scalar the runner fills with the
real token count before every forward; the recording counts only rows below it, while the mapping still
covers every row so the downstream kernels keep their shapes.
"""
from __future__ import annotations

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/38128"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "eplb_map_to_physical_and_record"
SYMPTOM = "EPLB load statistics count the padding tokens of CUDA-graph-padded steps; rebalancing follows them"

VOCAB, DIM = 12, 4
NUM_LOGICAL, NUM_REDUNDANT = 3, 1
NUM_PHYSICAL = NUM_LOGICAL + NUM_REDUNDANT
CAPTURE_SIZES = (2, 4)
WINDOW, STEP_INTERVAL = 3, 3


def eplb_map_to_physical_and_record(topk_ids, expert_load_view, logical_to_physical_map, logical_replica_count,
                                    num_unpadded_tokens=None):
    """Map logical expert ids to physical ones (a replica per token) and record the expert load."""
    tokens = torch.arange(topk_ids.shape[0], device=topk_ids.device)[:, None].expand_as(topk_ids)
    replica = tokens % logical_replica_count[topk_ids]                # pseudo-random upstream
    physical_ids = logical_to_physical_map[topk_ids, replica]
    ones = torch.ones_like(physical_ids, dtype=expert_load_view.dtype)
    if num_unpadded_tokens is not None:                                # the fix: padded rows count zero
        ones = ones * (tokens < num_unpadded_tokens).to(expert_load_view.dtype)
    expert_load_view.scatter_add_(0, physical_ids.flatten(), ones.flatten())
    return physical_ids


class EplbModelState:
    def __init__(self, device, mask_padding: bool):
        self.expert_load_pass = torch.zeros(NUM_PHYSICAL, dtype=torch.int64, device=device)
        self.expert_load_window = torch.zeros(WINDOW, NUM_PHYSICAL, dtype=torch.int64, device=device)
        # physical slots 0..2 hold logical experts 0..2; slot 3 is the redundant replica (of expert 0)
        self.physical_to_logical_map = torch.tensor([0, 1, 2, 0], device=device)
        self.logical_to_physical_map = torch.tensor([[0, 3], [1, -1], [2, -1]], device=device)
        self.logical_replica_count = torch.tensor([2, 1, 1], device=device)
        self.num_unpadded_tokens_tensor = (torch.zeros((), dtype=torch.int64, device=device)
                                           if mask_padding else None)
        self.step = 0

    def rearrange(self):
        """Give the redundant physical slot to the logical expert with the most tokens in the window."""
        load = self.expert_load_window.sum(0)
        logical_load = torch.zeros(NUM_LOGICAL, dtype=torch.int64, device=load.device)
        logical_load.index_add_(0, self.physical_to_logical_map, load)
        hottest = int(logical_load.argmax())
        self.physical_to_logical_map[3] = hottest
        self.logical_to_physical_map.copy_(torch.tensor([[0, -1], [1, -1], [2, -1]]))
        self.logical_to_physical_map[hottest, 1] = 3
        self.logical_replica_count.fill_(1)
        self.logical_replica_count[hottest] = 2

    def eplb_step(self, is_dummy: bool = False):
        """EplbState.step: after each forward, move the pass into the window (dummy steps record nothing)."""
        if not is_dummy:
            self.expert_load_window[self.step % WINDOW].copy_(self.expert_load_pass)
            self.step += 1
            if self.step % STEP_INTERVAL == 0:
                self.rearrange()
        self.expert_load_pass.zero_()


class MoEModel:
    def __init__(self, device, eplb: EplbModelState):
        gen = generator(38128)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.router = randn(DIM, NUM_LOGICAL, gen=gen, device=device)
        self.logical_experts = randn(NUM_LOGICAL, DIM, DIM, gen=gen, device=device, scale=0.5)
        self.eplb = eplb

    def forward(self, input_ids):
        h = self.emb[input_ids]
        weights, topk_ids = torch.topk(torch.softmax(h @ self.router, -1), 1, dim=-1)
        e = self.eplb
        physical_ids = eplb_map_to_physical_and_record(topk_ids, e.expert_load_pass, e.logical_to_physical_map,
                                                       e.logical_replica_count, e.num_unpadded_tokens_tensor)
        w = self.logical_experts[e.physical_to_logical_map[physical_ids[:, 0]]]   # replicas share weights
        return h + weights * torch.einsum("td,tdf->tf", h, w)


def schedule():
    """Token ids of each decode step (one token per running request)."""
    return [[3, 7, 1, 9], [4, 0, 6], [8], [2, 11, 5], [10, 3]]


def run(variant: str, device: str = "cpu"):
    mask_padding = variant == "fix"
    steps = [torch.tensor(s, device=device) for s in schedule()]

    def result(eplb, outs):
        return outs + [eplb.expert_load_window.clone(), eplb.logical_to_physical_map.clone()]

    def eager():                                                          # --enforce-eager: no padding
        eplb = EplbModelState(device, mask_padding)
        model = MoEModel(device, eplb)
        outs = []
        for ids in steps:
            if eplb.num_unpadded_tokens_tensor is not None:
                eplb.num_unpadded_tokens_tensor.fill_(ids.shape[0])
            outs.append(model.forward(ids))
            eplb.eplb_step()
        return result(eplb, outs)

    def served():
        eplb = EplbModelState(device, mask_padding)
        model = MoEModel(device, eplb)
        input_ids = torch.zeros(max(CAPTURE_SIZES), dtype=torch.int64, device=device)
        static = {"input_ids": input_ids}
        if eplb.num_unpadded_tokens_tensor is not None:
            static["num_unpadded_tokens"] = eplb.num_unpadded_tokens_tensor
        state = {"expert_load_pass": eplb.expert_load_pass, "logical_to_physical_map": eplb.logical_to_physical_map,
                 "logical_replica_count": eplb.logical_replica_count,
                 "physical_to_logical_map": eplb.physical_to_logical_map}
        pool, graphs = graph_pool_handle(device), {}
        for size in sorted(CAPTURE_SIZES, reverse=True):                  # capture_model(): largest first
            graphs[size] = capture(lambda size=size: model.forward(input_ids[:size]), device=device, pool=pool,
                                   name=f"FULL size {size}", static=static, state=state, owner="GPUModelRunner")
            static = state = None                                         # announced once
        eplb.eplb_step(is_dummy=True)                                     # dummy runs record no load
        outs = []
        for ids in steps:
            n = ids.shape[0]
            size = next(s for s in sorted(CAPTURE_SIZES) if s >= n)       # CudagraphDispatcher: pad up
            input_ids[:n].copy_(ids)                                      # rows [n, size) keep an earlier step's ids
            if eplb.num_unpadded_tokens_tensor is not None:
                eplb.num_unpadded_tokens_tensor.fill_(n)
            g, out = graphs[size]
            outs.append(replay(g, out, real=n, size=size, padded={"input_ids": input_ids[:size]})[:n].clone())
            eplb.eplb_step()
        return result(eplb, outs)

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
