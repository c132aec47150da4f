"""Padded requests reuse a real request's state index, so its state is updated twice.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/9873 ("Fix mamba_cache_manager when enabling
cuda_graph_padding": "When there exists padded requests, the state indices should not be repeated").
Symptom: Mamba/hybrid models with ``cuda_graph_padding`` enabled produce wrong outputs for the request
whose state slot the padding dummy shares (TensorRT-LLM, Dec 2025).
Mechanism: the CUDA-graph padding dummy request was given the state index of a real request. The
captured state update runs over every row of the padded batch. The real request's state receives the
dummy row's update as well as its own.
Doctor: stale-padding, at ``ssm_update`` (the state update through the padded rows' indices).
Fix (upstream): reorder the state indices when padding so no index repeats; padding rows get slots of
their own.
"""
from __future__ import annotations

import torch

from ..kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/9873"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "ssm_update"
SYMPTOM = "the request sharing its slot with the padding dummy gets a second state update"
DIM, SLOTS, SIZE = 4, 5, 4        # slot 4: the padding slot of the fix


def ssm_update(states, indices, x):
    states.index_add_(0, indices, x)                 # the state update, by slot
    return states[indices] * 1.0


def run(variant: str, device: str = "cpu"):
    gen = generator(9873)
    xs = [randn(3, DIM, gen=gen, device=device) for _ in range(2)]
    idx = torch.tensor([0, 1, 2], device=device)

    def serve(graphed: bool):
        states = torch.zeros(SLOTS, DIM, device=device)
        bufs = {"x": torch.zeros(SIZE, DIM, device=device),
                "state_indices": torch.full((SIZE,), SLOTS - 1, device=device)}
        if graphed:
            g, out = capture(lambda: ssm_update(states, bufs["state_indices"], bufs["x"]), device=device,
                             static=bufs, owner="MambaCacheManager")
        outs = []
        for x in xs:
            n = x.shape[0]
            if not graphed:
                outs.append(ssm_update(states, idx, x))
                continue
            bufs["x"][:n].copy_(x)
            bufs["x"][n:].copy_(x[:1])               # the dummy request replicates a real one
            bufs["state_indices"][:n].copy_(idx)
            bufs["state_indices"][n:].fill_(idx[0] if variant == "bug" else SLOTS - 1)
            outs.append(replay(g, out, real=n, size=SIZE, padded={})[:n].clone())   # every padded row was written
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
