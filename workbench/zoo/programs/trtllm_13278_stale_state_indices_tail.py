"""The tail of a persistent state-index buffer points at parked requests; padded rows update them.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/13278 ("Fix Mamba cache correctness under MTP +
CUDA-graph padding": "update_mamba_states scatters into the caller-supplied state_indices instead of
self.state_indices, removing the stale-tail read that corrupted parked live requests").
Symptom: hybrid Mamba models under MTP speculative decoding with CUDA-graph padding give corrupted
outputs for requests that resume after being parked (TensorRT-LLM, April 2026).
Mechanism: the state update scattered into the manager's persistent ``state_indices`` buffer over the
graph's padded size. Rows past the current batch still held the indices of requests from an earlier
batch that are now parked, not finished. The padded rows' updates land in those requests' SSM states.
Doctor: stale-padding, at ``update_states`` (the scatter through the padded rows' indices).
Fix (upstream): every padding position points at a reserved sentinel slot, never at a live request.
"""
from __future__ import annotations

import torch

from ..kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/13278"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "update_states"
SYMPTOM = "a parked request resumes from an SSM state that padded rows updated"
DIM, SLOTS, SIZE = 4, 6, 4        # slot SLOTS - 1: the padding sentinel of the fix


def update_states(states, indices, x, decay):
    states[indices] = states[indices] * decay + x
    return torch.tanh(states[indices])


def run(variant: str, device: str = "cpu"):
    gen = generator(13278)
    xs = [randn(4, DIM, gen=gen, device=device), randn(2, DIM, gen=gen, device=device),
          randn(4, DIM, gen=gen, device=device)]
    # Step 1: requests in slots 0-3. Requests 2 and 3 are parked for step 2, then resume.
    ids = [torch.tensor(v, device=device) for v in ([0, 1, 2, 3], [0, 1], [0, 1, 2, 3])]

    def serve(graphed: bool):
        states = torch.zeros(SLOTS, DIM, device=device)
        bufs = {"x": torch.zeros(SIZE, DIM, device=device),
                "state_indices": torch.full((SIZE,), SLOTS - 1, device=device)}
        if graphed:
            g, out = capture(lambda: update_states(states, bufs["state_indices"], bufs["x"], 0.8), device=device,
                             static=bufs, owner="MambaCacheManager")
        outs = []
        for x, idx in zip(xs, ids):
            n = x.shape[0]
            if not graphed:
                outs.append(update_states(states, idx, x, 0.8))
                continue
            bufs["x"][:n].copy_(x)
            bufs["state_indices"][:n].copy_(idx)
            stale = dict(bufs)                          # buffers whose padded rows this step leaves as they were
            if variant == "fix":
                bufs["state_indices"][n:].fill_(SLOTS - 1)
                stale = {"x": bufs["x"]}
            outs.append(replay(g, out, real=n, size=SIZE, padded=stale)[:n].clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
