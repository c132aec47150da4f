"""Apex fast MHA draws its dropout seed/offset on the host: a captured step would freeze one dropout mask.

Upstream: https://github.com/NVIDIA/apex/pull/1025 ("cuda rng changes for graph capture with apex MHA").
Symptom: graph-capturing a training step that uses ``apex.contrib.multihead_attn`` with attention
dropout (the MLPerf BERT setup of early 2021) fails: the capture is refused by PyTorch's CUDA generator
("Refactor this op to use CUDAGeneratorImpl::philox_cuda_state. Cannot call
CUDAGeneratorImpl::philox_engine_inputs"), so the fast MHA could not be graphed at all.
Mechanism: ``dispatch_additive_masked_softmax_dropout`` asked the generator for
``philox_engine_inputs(counter_offset)``: a host ``(seed, offset)`` pair, with the host offset advanced
by the call, passed to the kernel by value. Inside a capture that host work runs once: the recorded
kernel keeps the capture's offset, every replay would draw the same dropout mask, and the generator's
host offset would not advance per replay. PyTorch's graph-safe RNG (``philox_cuda_state``) refuses the
old call while a capture is open for that reason.
Doctor: host-work-frozen, at ``dispatch_additive_masked_softmax_dropout`` (the host philox seed/offset
taken for the captured dropout kernel).
Fix (upstream): the kernels take ``at::PhiloxCudaState`` from ``gen->philox_cuda_state(counter_offset)``
and ``at::cuda::philox::unpack`` it on the device, so under capture the offset is read from device
memory that each replay advances.
"""
from __future__ import annotations

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/apex/pull/1025"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "dispatch_additive_masked_softmax_dropout"
SYMPTOM = "capturing apex fast-MHA dropout is refused (host philox offset would freeze one mask)"
HEADS, SEQ, STEPS, P = 2, 4, 3, 0.5


class CUDAGeneratorImpl:
    """The CUDA philox generator: host seed/offset, and (graph-safe path) the offset in device memory."""

    def __init__(self, seed, device):
        self.seed = seed
        self.philox_offset_per_thread = 0                                  # host state
        self.offset_extragraph = torch.zeros((), dtype=torch.int64, device=device)

    def philox_engine_inputs(self, increment):
        if torch.cuda.is_current_stream_capturing():                      # at::cuda::assertNotCapturing
            raise RuntimeError("Refactor this op to use CUDAGeneratorImpl::philox_cuda_state. Cannot call "
                               "CUDAGeneratorImpl::philox_engine_inputs (operation not permitted when "
                               "stream is capturing)")
        offset = self.philox_offset_per_thread
        self.philox_offset_per_thread += increment
        return self.seed, offset

    def philox_cuda_state(self, increment):
        """Device-side offset: the (captured) kernel reads it and the offset advances on the device."""
        offset = self.offset_extragraph.clone()
        self.offset_extragraph.add_(increment)
        return self.seed, offset


def philox_uniform(seed, offset, shape, device):
    """Counter-based uniforms from (seed, offset); ``offset`` may be an int or a device tensor."""
    idx = torch.arange(shape[0] * shape[1] * shape[2], device=device, dtype=torch.float64)
    x = torch.sin((idx + 1.0) * 12.9898 + (offset + 1.0) * 78.233 + seed * 3.7) * 43758.5453
    return (x - torch.floor(x)).to(torch.float32).reshape(shape)


def dispatch_additive_masked_softmax_dropout(inputs, pad_mask, p, gen, graph_safe):
    counter_offset = inputs.numel()
    if graph_safe:                                         # after #1025
        seed, offset = gen.philox_cuda_state(counter_offset)
    else:                                                  # before: host pair passed by value
        seed, offset = gen.philox_engine_inputs(counter_offset)
    probs = torch.softmax(inputs + pad_mask, dim=-1)
    keep = philox_uniform(seed, offset, inputs.shape, inputs.device) >= p
    return probs * keep / (1.0 - p)


def run(variant: str, device: str = "cpu"):
    gen_data = generator(1025)
    scores = [randn(HEADS, SEQ, SEQ, gen=gen_data, device=device) for _ in range(STEPS)]
    pad_mask = torch.zeros(HEADS, SEQ, SEQ, device=device)
    pad_mask[:, :, -1] = -1e4
    graph_safe = variant == "fix"

    def eager():
        gen = CUDAGeneratorImpl(7, device)
        return [dispatch_additive_masked_softmax_dropout(s, pad_mask, P, gen, graph_safe) for s in scores]

    def served():
        gen = CUDAGeneratorImpl(7, device)
        static_scores = scores[0].clone()
        fn = lambda: dispatch_additive_masked_softmax_dropout(static_scores, pad_mask, P, gen, graph_safe)  # noqa: E731
        with torch.no_grad():
            # the warmup iteration is a real step (its mask is the first step's), then capture
            with events.warmup(real=True):
                outs = [fn().clone()]
            g, out = capture(fn, device=device, warmups=0, static={"attn_scores": static_scores},
                             state={"philox_offset": gen.offset_extragraph}, owner="fast MHA (graphed step)")
            for s in scores[1:]:
                static_scores.copy_(s)
                outs.append(replay(g, out).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
