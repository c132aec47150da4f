"""A reduction computed on the host while capturing is not part of the replay.

Upstream: https://github.com/NVIDIA/warp/issues/1663 ("CPU graph replay drops array-inner reductions").
Symptom: ``wp.utils.array_inner`` on host arrays runs during capture but not at replay: capture
succeeds, eager gives 5.0, replay gives the stale capture-time value (Warp CPU graphs, Newton's
Style3D PCG solver, July 2026).
Mechanism: the reduction runs as host code, not as a kernel the capture can record. It executes once,
while capturing, and its result enters the graph as a constant. Every replay reuses that capture-time
value whatever the arrays hold now.
Doctor: host-work-frozen (work done in Python or host code inside the captured region ran once at
capture; replay re-runs only the recorded kernels, so its result stays at its capture-time value).
Site: ``solver_step``.
Fix (the issue's request): compute the reduction with a recorded kernel on the device (or refuse to
capture it).
"""
from __future__ import annotations

import numpy as np
import torch

from ..kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/warp/issues/1663"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "solver_step"
SYMPTOM = "replay uses the dot product computed at capture, not the current one"
DIM = 6


def solver_step(x: torch.Tensor, r_host: np.ndarray, r_dev: torch.Tensor, variant: str) -> torch.Tensor:
    if variant == "bug":
        rr = float(np.inner(r_host, r_host))        # host reduction: runs now, not at replay
    else:
        rr = (r_dev * r_dev).sum()                  # a device reduction the capture records
    return x / rr


def run(variant: str, device: str = "cpu"):
    gen = generator(1663)
    xs = [randn(DIM, gen=gen, device=device) for _ in range(3)]
    rs = [torch.randn(DIM, generator=gen).numpy() for _ in range(3)]

    def eager():
        return [solver_step(x, r, torch.from_numpy(r).to(device), variant) for x, r in zip(xs, rs)]

    def served():
        x_buf, r_host = xs[0].clone(), rs[0].copy()
        r_dev = torch.from_numpy(r_host).to(device)
        g, out = capture(lambda: solver_step(x_buf, r_host, r_dev, variant), device=device,
                         static={"x": x_buf, "r": r_dev}, owner="PCG solver")
        outs = []
        for x, r in zip(xs, rs):
            x_buf.copy_(x)
            r_host[:] = r
            r_dev.copy_(torch.from_numpy(r))
            outs.append(replay(g, out).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
