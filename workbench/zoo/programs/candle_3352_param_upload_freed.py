"""Kernel parameters uploaded from temporaries that die after capture.

Upstream: https://github.com/huggingface/candle/pull/3352 ("Introduce capture pool for cuda graph
replay").
Symptom: replaying a captured candle graph crashes (segfaults, illegal memory access), candle CUDA
backend with cudarc graphs (Jan 2026).
Mechanism: before each kernel the backend builds small host vectors of parameters (dims, strides)
and uploads them with a host-to-device copy. Under capture that copy is a graph node that keeps the
host address, but the host vector is dropped when the launch returns. Every replay copies parameters
from freed host memory, which the next launch of another shape reuses.
Doctor: dangling-reference, at ``launch_row_mean`` (the captured copy from the released host vector).
Fix (upstream): a capture pool on the device owns every parameter vector uploaded while a stream is
capturing, for as long as the graphs live.
"""
from __future__ import annotations

import torch

from ...engine import host as engine_host, reuse_freed_blocks
from ..kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/huggingface/candle/pull/3352"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "launch_row_mean"
LATENT = ("torch 2.11's host allocator keeps pinned blocks allocated inside a capture for the graph (H100 record: probe host_made_in_capture), so the freed staging buffer is never handed on and the replay reads its capture-time values, as eager does")
SYMPTOM = "replay reads kernel parameters from freed memory (crash / illegal memory access)"
COLS = 8


class Device:
    """The backend's device: uploads parameters per launch; the fix keeps them while capturing."""

    def __init__(self, name: str, keep_while_capturing: bool) -> None:
        self.name = name
        self.keep = keep_while_capturing
        self.capture_pool: list[torch.Tensor] = []

    def upload_params(self, values: list[int]) -> torch.Tensor:
        host = engine_host(torch.tensor(values, dtype=torch.float32), self.name)      # pinned host memory
        params = torch.empty(len(values), device=self.name)
        params.copy_(host, non_blocking=True)
        if self.keep:
            self.capture_pool.append(host)
        return params


def launch_row_mean(dev: Device, x: torch.Tensor) -> torch.Tensor:
    params = dev.upload_params([x.shape[0], x.shape[1]])       # dims uploaded for this launch only
    return x.sum(1) / params[1]


def run(variant: str, device: str = "cpu"):
    gen = generator(3352)
    data = [randn(3, COLS, gen=gen, device=device) for _ in range(2)]

    def eager():
        dev = Device(device, keep_while_capturing=False)
        return [launch_row_mean(dev, x) for x in data]

    def served():
        dev = Device(device, keep_while_capturing=(variant == "fix"))
        x_buf = data[0].clone()
        g, out = capture(lambda: launch_row_mean(dev, x_buf), device=device, name="decode", on_freed="reuse",
                         static={"x": x_buf}, owner="candle model")
        outs = []
        for x in data:
            with reuse_freed_blocks():
                launch_row_mean(dev, x[:, :2])                  # another shape's launch, eagerly
            x_buf.copy_(x)
            outs.append(replay(g, out).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
