"""Resetting ``is_first_microbatch`` after warmup bakes the "overwrite main_grad" wgrad GEMM into a shared graph.

Upstream: https://github.com/NVIDIA/TransformerEngine/pull/2715 ("[PyTorch] Remove `is_first_microbatch`
setting after cudagraph warmup").
Symptom: BF16 training with Megatron-Core's TE CUDA graphs, fused wgrad accumulation and no pipeline
parallelism (one graph per layer, shared by every micro-batch) accumulates only the last micro-batch's
weight gradient: ``main_grad`` is overwritten by each replay instead of summed (TE 2.12, early 2026).
Mechanism: MCore's TE wrappers keep ``self.is_first_microbatch`` (True, then False after their first call)
and pass it to TE, whose backward picks the wgrad GEMM from it:
``accumulate_wgrad_into_param_main_grad = fuse_wgrad_accumulation and not is_first_microbatch`` (``D = A*B``
for the first micro-batch, ``D = A*B + D`` afterwards). ``_make_graphed_callables`` set every module's
``is_first_microbatch`` back to True after the warmup, so the capture took the first-micro-batch branch and
the graph recorded a GEMM that overwrites ``main_grad``. Replays re-run that recorded choice for every
micro-batch; eagerly, micro-batches 2..n would accumulate. (In FP8 the flag is forced to False by
``skip_fp8_weight_update`` during capture, which is why only BF16 was hit.)
Doctor: warmup-divergence, at ``_make_graphed_callables`` (the post-warmup reset that makes the capture
decide the overwrite branch that all replays reuse).
Fix (upstream): drop the reset, so the capture runs with ``is_first_microbatch=False`` and records the
accumulating GEMM, right for every micro-batch once the grad buffer is zeroed at the start of the step.
"""
from __future__ import annotations

import types

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TransformerEngine/pull/2715"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "_make_graphed_callables"
SYMPTOM = "main_grad holds only the last micro-batch's wgrad: the graph overwrites instead of accumulating"
HIDDEN, FFN, TOKENS, MICROBATCHES, ITERATIONS = 4, 3, 5, 3, 2


class _Linear:
    """TE's ``_Linear`` autograd function, forward and backward written out."""

    @staticmethod
    def forward(ctx, weight, inp, is_first_microbatch, fuse_wgrad_accumulation):
        ctx.saved = (weight, inp)
        ctx.is_first_microbatch = is_first_microbatch
        ctx.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        return inp @ weight.t()

    @staticmethod
    def backward(ctx, grad_output):
        weight, inp = ctx.saved
        # Check whether to output wgrad GEMM directly into main grad
        if ctx.is_first_microbatch is not None:
            accumulate_wgrad_into_param_main_grad = ctx.fuse_wgrad_accumulation and not ctx.is_first_microbatch
        else:
            accumulate_wgrad_into_param_main_grad = ctx.fuse_wgrad_accumulation
        dgrad = grad_output @ weight
        wgrad = grad_output.t() @ inp                        # general_gemm(..., out=main_grad, accumulate=...)
        if accumulate_wgrad_into_param_main_grad:
            weight.main_grad.add_(wgrad)
        else:
            weight.main_grad.copy_(wgrad)
        return dgrad


class TELinear:
    """Megatron-Core's ``TELinear`` wrapper: ``is_first_microbatch`` is module state it flips itself."""

    def __init__(self, device):
        gen = generator(2715)
        self.weight = randn(FFN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.weight.main_grad = torch.zeros_like(self.weight)   # the DDP grad buffer, fused wgrad target
        self.fuse_wgrad_accumulation = True
        self.is_first_microbatch = True

    def modules(self):
        return [self]

    def forward_backward(self, inp, grad_output):
        """One micro-batch through the layer, forward then backward (what the fwd/bwd graphs replay)."""
        ctx = types.SimpleNamespace()
        _is_first_microbatch = self.is_first_microbatch
        out = _Linear.forward(ctx, self.weight, inp, _is_first_microbatch, self.fuse_wgrad_accumulation)
        self.is_first_microbatch = False
        dgrad = _Linear.backward(ctx, grad_output)
        return out, dgrad


def _make_graphed_callables(func, module, sample_args, *, device, variant, num_warmup_iters=2):
    with events.warmup():
        for _ in range(num_warmup_iters):
            func(*sample_args)
    if variant == "bug":
        # The following code is added specifically for MCore's special requirements,
        # aimed at preventing warmup from altering the control flow.
        for m in module.modules():
            if hasattr(m, "is_first_microbatch"):
                m.is_first_microbatch = True
    inp, grad_output = sample_args
    return capture(lambda: func(*sample_args), device=device, warmups=0,
                   static={"inp": inp, "grad_output": grad_output},
                   state={"main_grad": module.weight.main_grad}, owner="TE graphed layer (fwd+bwd)")


def run(variant: str, device: str = "cpu"):
    gen = generator(12)
    data = [[(randn(TOKENS, HIDDEN, gen=gen, device=device), randn(TOKENS, FFN, gen=gen, device=device))
             for _ in range(MICROBATCHES)] for _ in range(ITERATIONS)]

    def eager():
        layer = TELinear(device)
        outs = []
        for batch in data:
            layer.weight.main_grad.zero_()                  # zero_grad_buffer() at the start of the step
            layer.is_first_microbatch = True                # set_is_first_microbatch() at the start of the step
            for inp, dy in batch:
                out, dgrad = layer.forward_backward(inp, dy)
                outs += [out.clone(), dgrad.clone()]
            outs.append(layer.weight.main_grad.clone())
        return outs

    def served():
        layer = TELinear(device)
        inp_buf, dy_buf = data[0][0][0].clone(), data[0][0][1].clone()
        g, static_outputs = _make_graphed_callables(layer.forward_backward, layer, (inp_buf, dy_buf),
                                                    device=device, variant=variant)
        outs = []
        for batch in data:
            layer.weight.main_grad.zero_()
            for inp, dy in batch:                           # one graph per layer, shared by every micro-batch
                inp_buf.copy_(inp)
                dy_buf.copy_(dy)
                out, dgrad = replay(g, static_outputs)
                outs += [out.clone(), dgrad.clone()]
            outs.append(layer.weight.main_grad.clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
