"""Mamba pool hands slot 0 to a real request, and the decode graph's dummy/padded rows write their state there.

Upstream: https://github.com/sgl-project/sglang/pull/17404 ("[BUGFIX] Skip Mamba Cache Slot 0 to Avoid
Using Dummy Cache").
Symptom: hybrid Mamba/GDN models (Qwen3-Next, Nemotron-H) served with CUDA graphs give wrong, drifting
continuations for the request that happens to own mamba slot 0 (and cached prefixes built from it); with
``--disable-cuda-graph`` the outputs are right. Hidden until then because the server warm-up request
("The capital city of France is") usually took slot 0 (sglang main, January 2026).
Mechanism: the decode CUDA graph is captured on a dummy batch whose ``req_pool_indices`` are 0, and a
replayed batch is padded to the captured size with rows whose ``req_pool_indices`` are 0 too. Request
slot 0 is never given out, so ``req_index_to_mamba_index_mapping[0]`` stays 0: every dummy and padded row
reads and writes the recurrent state of mamba slot 0 (the pool has ``size + 1`` rows for that purpose).
But ``MambaPool`` built its free list as ``torch.arange(size)``, so slot 0 was also handed to a real
request: when that request decodes in a padded batch, the padded row's state update lands on top of the
real row's in slot 0, and the request's next step starts from the dummy token's state.
Eager decode runs only real rows, so nothing else touches the slot.
Doctor: stale-padding, at ``selective_state_update`` (the padded rows' mamba index aliases a real
request's state slot, and the padded rows' update is what the real row reads next step).
Fix (upstream): start the free list at 1 (``torch.arange(1, size + 1)``), keeping slot 0 as the dummy
slot that padded tokens write to.
"""
from __future__ import annotations

import bisect

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/17404"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "selective_state_update"
SYMPTOM = "the request owning mamba slot 0 decodes from the padded dummy row's recurrent state"
VOCAB, DIM, MAMBA_SIZE, REQ_POOL_SIZE = 10, 4, 3, 4
CAPTURE_BS = [2]


class MambaPool:
    """Per-slot recurrent state; row 0 is the dummy slot the padded tokens write to."""

    def __init__(self, size: int, device, variant: str):
        self.size = size
        self.device = device
        self.variant = variant
        self.temporal = torch.zeros(size + 1, DIM, device=device)
        self.clear()

    def clear(self):
        if self.variant == "bug":
            self.free_slots = torch.arange(self.size, dtype=torch.int32)
        else:
            # The padded slot 0 is used for writing dummy outputs from padded tokens.
            self.free_slots = torch.arange(1, self.size + 1, dtype=torch.int32)

    def alloc(self, need_size: int):
        if need_size > len(self.free_slots):
            return None
        select_index = self.free_slots[:need_size]
        self.free_slots = self.free_slots[need_size:]
        return select_index.tolist()

    def free(self, free_index):
        self.free_slots = torch.cat((self.free_slots, torch.tensor(free_index, dtype=torch.int32)))


class HybridReqToTokenPool:
    """Request slots (0 is reserved for dummy rows) and their mamba slots."""

    def __init__(self, size: int, mamba_size: int, device, variant: str):
        self.free_slots = list(range(1, size))
        self.mamba_pool = MambaPool(mamba_size, device, variant)
        self.req_index_to_mamba_index_mapping = torch.zeros(size, dtype=torch.long, device=device)

    def alloc(self):
        req_pool_idx = self.free_slots.pop(0)
        mid = self.mamba_pool.alloc(1)[0]
        self.req_index_to_mamba_index_mapping[req_pool_idx] = mid
        return req_pool_idx, mid

    def free(self, req_pool_idx: int, mamba_idx: int):
        self.free_slots.append(req_pool_idx)
        self.mamba_pool.free([mamba_idx])


class Model:
    def __init__(self, device):
        gen = generator(17404)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.dA = torch.full((DIM,), 0.5, device=device)
        self.out_proj = randn(DIM, DIM, gen=gen, device=device, scale=0.5)


def selective_state_update(ssm_states, x, dA, state_batch_indices):
    """Mamba decode step: every row updates the state of its slot in place (one program per row)."""
    out = []
    for i in range(x.shape[0]):
        idx = state_batch_indices[i:i + 1]
        new = ssm_states.index_select(0, idx) * dA + x[i:i + 1]
        ssm_states.index_copy_(0, idx, new)
        out.append(new)
    return torch.cat(out)


def forward_decode(model, pool: HybridReqToTokenPool, input_ids, req_pool_indices):
    mamba_indices = pool.req_index_to_mamba_index_mapping[req_pool_indices]
    h = selective_state_update(pool.mamba_pool.temporal, model.emb[input_ids], model.dA, mamba_indices)
    return h @ model.out_proj


def prefill(model, pool: HybridReqToTokenPool, mamba_idx: int, prompt):
    """Eager extend: the prompt's final recurrent state into the request's slot."""
    state = torch.zeros(DIM, device=pool.mamba_pool.temporal.device)
    for tok in prompt:
        state = state * model.dA + model.emb[tok]
    pool.mamba_pool.temporal[mamba_idx] = state


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    prompts = {"A": [3, 1, 4], "B": [2, 7]}
    # decode schedule: both requests, then B finishes and A decodes alone (padded 1 -> 2)
    schedule = [(["A", "B"], [5, 6]), (["A"], [8]), (["A"], [2]), (["A"], [9])]

    def serve(graphed: bool):
        pool = HybridReqToTokenPool(REQ_POOL_SIZE, MAMBA_SIZE, device, variant)
        max_bs = max(CAPTURE_BS)
        input_ids = torch.zeros(max_bs, dtype=torch.long, device=device)
        req_pool_indices = torch.zeros(max_bs, dtype=torch.long, device=device)
        graphs = {}
        if graphed:
            for bs in CAPTURE_BS:
                # capture on the dummy batch: req_pool_indices 0 -> mamba slot 0
                graphs[bs] = capture(
                    lambda bs=bs: forward_decode(model, pool, input_ids[:bs], req_pool_indices[:bs]),
                    device=device, static={"input_ids": input_ids, "req_pool_indices": req_pool_indices},
                    state={"mamba_cache": pool.mamba_pool.temporal,
                           "req_index_to_mamba_index_mapping": pool.req_index_to_mamba_index_mapping},
                    owner="CudaGraphRunner (decode)")
        slots = {}
        for rid, prompt in prompts.items():
            req_pool_idx, mamba_idx = pool.alloc()
            slots[rid] = (req_pool_idx, mamba_idx)
            prefill(model, pool, mamba_idx, prompt)
        outs = []
        for step, (rids, tokens) in enumerate(schedule):
            raw_bs = len(rids)
            ids = torch.tensor(tokens, device=device)
            reqs = torch.tensor([slots[r][0] for r in rids], device=device)
            if not graphed:
                outs.append(forward_decode(model, pool, ids, reqs).clone())
            else:
                bs = CAPTURE_BS[bisect.bisect_left(CAPTURE_BS, raw_bs)]
                if bs != raw_bs:
                    input_ids.zero_()
                    req_pool_indices.zero_()           # padded rows: request slot 0
                input_ids[:raw_bs].copy_(ids)
                req_pool_indices[:raw_bs].copy_(reqs)
                g, out = graphs[bs]
                outs.append(replay(g, out, real=raw_bs, size=bs,
                                   padded={"req_pool_indices": req_pool_indices})[:raw_bs].clone())
            if step == 0:                              # B finished
                pool.free(*slots.pop("B"))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
