"""A host staging buffer handed back right after its copy was captured; a prefill takes the block.

Upstream: https://github.com/microsoft/onnxruntime/pull/32121 ("Keep CudaAsyncBuffer's staging buffer
alive across a graph replay").
Symptom: decode replays are fine until one differently-shaped inference (a prefill) runs in between;
then ``Concat`` reads the prefill's bytes as its input-pointer array (onnxruntime CUDA EP, Aug 2026).
Mechanism: ``CudaAsyncBuffer::CopyToGpu`` writes a kernel's argument array into a pinned host buffer,
enqueues the host-to-device copy and hands the host buffer back at once. Under capture the copy is a
graph node that keeps the host address, so every replay copies whatever that block holds then. The next
inference of another shape allocates a staging buffer of the same size and gets that block.
Doctor: dangling-reference, at ``gather_rows`` (the captured copy from the released staging buffer).
Fix (upstream): while a stream is capturing, retain the staging buffer for the provider's lifetime.
"""
from __future__ import annotations

import torch

from ...engine import host as engine_host, reuse_freed_blocks
from ..kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/microsoft/onnxruntime/pull/32121"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "gather_rows"
LATENT = ("torch 2.11's host allocator keeps pinned blocks allocated inside a capture for the graph (H100 record: probe host_made_in_capture), so the freed staging buffer is never handed on and the replay reads its capture-time values, as eager does")
SYMPTOM = "after a prefill, decode replays gather with the prefill's argument array: wrong outputs"
DIM = 5


class Provider:
    def __init__(self, device: str, retain_while_capturing: bool) -> None:
        self.device = device
        self.retain = retain_while_capturing
        self.retained: list[torch.Tensor] = []

    def staging(self, values: list[int]) -> torch.Tensor:
        host = engine_host(torch.tensor(values, dtype=torch.int64), self.device)      # pinned host memory
        if self.retain:
            self.retained.append(host)
        return host


def gather_rows(provider, x, order, args_dev):
    """Concat-like kernel: its argument array (row order) goes host -> device, then it gathers."""
    args_dev.copy_(provider.staging(order), non_blocking=True)
    return x.index_select(0, args_dev)


def run(variant: str, device: str = "cpu"):
    gen = generator(32121)
    x = randn(4, DIM, gen=gen, device=device)
    order = [3, 1, 2, 0]

    def eager():
        prov = Provider(device, retain_while_capturing=False)
        args = torch.zeros(4, dtype=torch.int64, device=device)
        return [gather_rows(prov, x, order, args).clone(), gather_rows(prov, x, order, args).clone()]

    def served():
        prov = Provider(device, retain_while_capturing=(variant == "fix"))
        args_dev = torch.zeros(4, dtype=torch.int64, device=device)
        g, out = capture(lambda: gather_rows(prov, x, order, args_dev), device=device, name="decode",
                         on_freed="reuse", static={"x": x}, owner="CUDA execution provider")
        first = replay(g, out).clone()
        with reuse_freed_blocks():                                         # a prefill of another shape
            prefill_args = prov.staging([0, 0, 1, 1])
        second = replay(g, out).clone()
        del prefill_args
        return [first, second]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
