"""``paddle.put_along_axis`` tests for empty indices with ``indices.numel() == 0``: a host read of a device value.

Upstream: https://github.com/PaddlePaddle/Paddle/pull/78535 ("[BugFix] Fix gather_scatter_functor CUDA Graph
compatibility for put_along_axis/take_along_axis"; cherry-picked to release/3.3 as #78544). Read: the PR
description (both hunks described, the Python one quoted before/after) and a Paddle debugging-case note that
quotes the ``manipulation.py`` code before and after; not the diff file itself.
Symptom: calling ``paddle.put_along_axis(x, index, value, axis=1)`` inside a CUDA Graph capture region
(``paddle.device.cuda.graphs.CUDAGraph``) raises ``CUDA error(906): cudaErrorStreamCaptureImplicit`` ("operation
would make the legacy stream depend on a capturing blocking stream"); eager runs are fine (Paddle develop, March
2026, after #78238 added the empty-index early return).
Mechanism: #78238 made ``put_along_axis`` (and ``put_along_axis_``) return ``paddle.assign(arr)`` early when the
indices are empty, testing ``(paddle.in_dynamic_mode() and indices.numel() == 0) or (not
paddle.in_dynamic_mode() and 0 in indices.shape)``. In dygraph ``indices.numel()`` is a 0-D tensor on the GPU,
``== 0`` another one, and the ``or`` calls its ``__bool__``, which copies it to the host (``numpy()``, a D2H copy and
a stream sync). During a capture that synchronisation is refused, so the captured step (here a MoE gate that
scatters its top-k routing weights into a dense combine matrix) cannot be graphed at all.
Doctor: sync-in-capture, at ``put_along_axis`` (``bool(indices.numel() == 0)`` reads a device value on the host
during the capture).
Fix (upstream): test the host-side shape, ``if 0 in indices.shape:``, in both functions; the same PR also stops
``phi::Copy`` (which calls ``cudaMemGetInfo``) from staging the scatter kernels' shape/stride arrays during capture
(``RestoreHostMemIfCapturingCUDAGraph`` + ``GpuMemcpyAsync``). Only the Python hunk is modelled here; the scatter
kernel is ``torch.scatter``.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/PaddlePaddle/Paddle/pull/78535"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "put_along_axis"
SYMPTOM = "capturing a step that calls paddle.put_along_axis fails with CUDA error 906 (implicit D2H sync)"
TOKENS, DIM, NUM_EXPERTS, TOP_K, STEPS = 4, 4, 4, 2, 4


def in_dynamic_mode() -> bool:
    return True                                         # dygraph, as a CUDAGraph capture region runs


def numel(x: torch.Tensor) -> torch.Tensor:
    """``paddle.Tensor.numel()``: a 0-D int64 tensor on the tensor's place, written by the numel kernel."""
    return torch.full((), x.numel(), dtype=torch.int64, device=x.device)


def assign(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


def infer_broadcast_shape(arr, indices, axis):
    """Broadcast shape of ``indices`` against ``arr`` on every axis but ``axis`` (None: nothing to broadcast)."""
    shape = [max(a, i) if d != axis else i for d, (a, i) in enumerate(zip(arr.shape, indices.shape))]
    return None if shape == list(indices.shape) else shape


def put_along_axis(arr, indices, values, axis, reduce="assign", include_self=True, broadcast=True, *, variant):
    if len(arr.shape) != len(indices.shape):
        raise ValueError("`indices` and `arr` must have the same number of dimensions!")
    if variant == "bug":
        empty = (in_dynamic_mode() and numel(indices) == 0) or (not in_dynamic_mode() and 0 in indices.shape)
    else:
        empty = 0 in indices.shape
    if empty:
        return assign(arr)
    axis = axis + arr.dim() if axis < 0 else axis
    if broadcast:
        broadcast_shape = infer_broadcast_shape(arr, indices, axis)
        if broadcast_shape:
            indices = indices.expand(broadcast_shape)
        values = values.expand(indices.shape)
    return _C_ops_put_along_axis(arr, indices, values, axis, reduce, include_self)


def _C_ops_put_along_axis(arr, indices, values, axis, reduce, include_self):
    assert reduce == "assign" and include_self
    return arr.scatter(axis, indices, values)


class MoEGate:
    """A decode step's MoE layer: softmax gate, top-k routing, dense combine of the (tiny) experts."""

    def __init__(self, device, variant):
        gen = generator(78535)
        self.variant = variant
        self.gate_weight = randn(DIM, NUM_EXPERTS, gen=gen, device=device)
        self.experts = randn(NUM_EXPERTS, DIM, DIM, gen=gen, device=device, scale=0.6)

    def forward(self, hidden_states):
        scores = torch.softmax(hidden_states @ self.gate_weight, dim=-1)
        topk_weight, topk_idx = torch.topk(scores, TOP_K, dim=-1)
        topk_weight = topk_weight / topk_weight.sum(-1, keepdim=True)
        combine = put_along_axis(torch.zeros_like(scores), topk_idx, topk_weight, axis=1, variant=self.variant)
        expert_out = torch.einsum("td,edh->teh", hidden_states, self.experts)
        return torch.einsum("te,teh->th", combine, expert_out)


def run(variant: str, device: str = "cpu"):
    gate = MoEGate(device, variant)
    gen = generator(1)
    xs = [randn(TOKENS, DIM, gen=gen, device=device) for _ in range(STEPS)]

    def eager():
        return [gate.forward(x) for x in xs]

    def served():
        # paddle.device.cuda.graphs.CUDAGraph: warm up, capture_begin(), the step, capture_end(), replay()
        static_x = torch.zeros(TOKENS, DIM, device=device)
        g, out = capture(lambda: gate.forward(static_x), device=device, warmups=1, static={"hidden_states": static_x},
                         owner="CUDAGraph (decode step)", name=f"{TOKENS} tokens")
        outs = []
        for x in xs:
            static_x.copy_(x)
            outs.append(replay(g, out).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
