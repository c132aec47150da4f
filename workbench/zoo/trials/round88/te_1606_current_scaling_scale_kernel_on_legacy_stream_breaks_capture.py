"""Transformer Engine Float8CurrentScaling under ``make_graphed_callables``: the per-tensor scale kernel is launched on the legacy default stream, so capturing the graphed module fails.

Upstream: https://github.com/NVIDIA/TransformerEngine/pull/1606 ("[PyTorch] Add tests for current scaling; misc related
fixes", NVIDIA/TransformerEngine, merged 2025-03-27 as commit 3bcd7f6fb; the relevant commit in the PR is "Fix CG capture
with CS recipe"). Read: the whole diff: in ``transformer_engine/common/recipe/current_scaling.cu``
``nvte_compute_scale_from_amax(output, config, stream)`` launched ``compute_scale_from_amax_kernel<<<1, 1>>>(...)`` and
now launches ``<<<1, 1, 0, stream>>>``; ``tests/pytorch/test_cuda_graphs.py`` adds ``recipe.Float8CurrentScaling()`` to
the recipes the graph tests capture; ``ops/op.py`` stops reallocating amax history for non-delayed recipes (not modelled).
Also read, at the parent commit: ``quantize`` in ``pytorch/csrc/extensions/cast.cpp`` (``nvte_compute_amax`` on
``getCurrentCUDAStream()``, optional amax all-reduce, ``nvte_compute_scale_from_amax(..., getCurrentCUDAStream())``,
then ``nvte_quantize_noop`` on the current stream) and ``compute_scale_from_amax`` in ``recipe_common.cuh``. Not read:
the PR's description and any issue (none linked), the failing test's log.
Symptom: ``te.make_graphed_callables`` of a module under the Float8CurrentScaling recipe fails while capturing (the
CUDA runtime refuses work on the legacy default stream while another stream captures: "operation not permitted when
stream is capturing"). The same module runs eagerly without error.
Mechanism: current scaling quantizes each tensor with a scale computed from its own amax, on the device: compute amax,
compute scale, cast. ``nvte_compute_scale_from_amax`` takes the caller's ``stream`` but launched its one-thread kernel
without it, on the legacy default stream. Eagerly that only serialises with the other streams (the legacy stream
waits for every blocking stream), so the numbers are right. ``torch.cuda.graph`` captures on a side stream in global
mode; a launch on the legacy stream would make it wait for the capturing stream, which a capture refuses.
Doctor: sync-in-capture, at nvte_compute_scale_from_amax. The launch joins the legacy default stream to every other
stream, a wait on the capturing stream's work that the capture cannot record.
Fix (upstream): launch ``compute_scale_from_amax_kernel`` on ``stream`` (the current stream, the capturing one during
capture), so it is recorded like the amax and cast kernels around it.
Modelled: ``Float8CurrentScalingQuantizer`` (amax, scale, scale_inv, ``force_pow_2_scales``, ``amax_epsilon``),
``quantize`` with ``nvte_compute_amax`` / ``nvte_compute_scale_from_amax`` / ``nvte_quantize_noop``, a ``Linear`` that
quantizes its input and weight with current scaling, and ``make_graphed_callables`` (3 warmup iterations, capture,
static input copy-in, replay). FP8 E4M3 is a stand-in rounding to 3 mantissa bits clamped to 448. TE captures a forward
and a backward graph; the capture that fails is the forward's, so only the forward graph is modelled. The launch on
the legacy default stream is a real ``torch.cuda.default_stream()`` launch on CUDA; on the CPU emulation, which has one
stream, the legacy stream's implicit join with the other streams is a device synchronize (``engine.synchronize``),
refused inside a capture as CUDA refuses the launch. Sizes: batch 4, in 16, out 8, float64.
Workload: a current-scaling ``Linear`` is graphed with ``make_graphed_callables`` and then called on 3 fresh inputs.
The bug's capture raises; the fix replays, recomputing each input's amax and scale on the device, and equals eager.
"""
from __future__ import annotations

import torch

from workbench.engine import synchronize
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TransformerEngine/pull/1606"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "nvte_compute_scale_from_amax"
SYMPTOM = ("te.make_graphed_callables under the Float8CurrentScaling recipe: compute_scale_from_amax_kernel is "
           "launched on the legacy default stream instead of the caller's stream, and the forward capture fails "
           "(operation not permitted when stream is capturing)")

BATCH, IN_FEATURES, OUT_FEATURES = 4, 16, 8
E4M3_MAX = 448.0
NUM_WARMUP_ITERS = 3

_variant = "bug"


# --- CUDA stream stand-ins ------------------------------------------------------------------------------------------

def getCurrentCUDAStream(device):          # noqa: N802 - at::cuda::getCurrentCUDAStream()
    return ("current", device)


def _launch(kernel, device, stream=None):
    """A kernel launch: ``<<<grid, block, 0, stream>>>`` runs on ``stream``; ``<<<grid, block>>>`` (no stream)
    runs on the legacy default stream, which implicitly waits for every blocking stream."""
    if stream is not None:
        return kernel()
    if torch.device(device).type == "cuda":
        with torch.cuda.stream(torch.cuda.default_stream(device)):
            return kernel()
    synchronize(device)                    # the legacy stream's join with the other streams' work
    return kernel()


# --- transformer_engine/common/recipe -------------------------------------------------------------------------------

def compute_scale_from_amax(amax, max_fp8, force_pow_2_scales, epsilon):
    amax = torch.clamp(amax, min=epsilon)
    scale = torch.where((amax == 0) | torch.isinf(amax), torch.ones_like(amax), max_fp8 / amax)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, torch.finfo(torch.float32).max), scale)
    if force_pow_2_scales:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def nvte_compute_amax(inp, out, stream):
    _launch(lambda: out.amax.copy_(inp.abs().amax().reshape(1)), out.device, stream)


def nvte_compute_scale_from_amax(out, config, stream):
    """Update ``out.scale`` from ``out.amax`` with a one-thread kernel (the hazard site)."""
    def kernel():
        out.scale.copy_(compute_scale_from_amax(out.amax, E4M3_MAX, config["force_pow_2_scales"],
                                                config["amax_epsilon"]))
    if _variant == "fix":
        _launch(kernel, out.device, stream)            # compute_scale_from_amax_kernel<<<1, 1, 0, stream>>>
    else:
        _launch(kernel, out.device)                    # compute_scale_from_amax_kernel<<<1, 1>>>


def _round_to_e4m3(x):
    """Stand-in for the FP8 E4M3 cast: 3 mantissa bits, saturated at 448."""
    m, e = torch.frexp(x)
    return torch.ldexp(torch.round(m * 16) / 16, e).clamp(-E4M3_MAX, E4M3_MAX)


def nvte_quantize_noop(inp, out, stream):
    def kernel():
        out.data.copy_(_round_to_e4m3(inp * out.scale))
        out.scale_inv.copy_(1.0 / out.scale)
    _launch(kernel, out.device, stream)


# --- transformer_engine/pytorch -------------------------------------------------------------------------------------

class Float8CurrentScalingQuantizer:
    def __init__(self, shape, device):
        self.device = device
        self.amax = torch.zeros(1, dtype=torch.float64, device=device)
        self.scale = torch.ones(1, dtype=torch.float64, device=device)
        self.scale_inv = torch.ones(1, dtype=torch.float64, device=device)
        self.data = torch.zeros(shape, dtype=torch.float64, device=device)       # the FP8 payload (stand-in)
        self.force_pow_2_scales = False
        self.amax_epsilon = 0.0
        self.with_amax_reduction = False


def quantize(inp, quantizer):
    """csrc/extensions/cast.cpp ``quantize`` for a Float8CurrentScalingQuantizer."""
    stream = getCurrentCUDAStream(quantizer.device)
    nvte_compute_amax(inp, quantizer, stream)
    config = {"force_pow_2_scales": quantizer.force_pow_2_scales, "amax_epsilon": quantizer.amax_epsilon}
    nvte_compute_scale_from_amax(quantizer, config, stream)
    nvte_quantize_noop(inp, quantizer, stream)
    return quantizer


class Linear:
    """A TE Linear in an fp8_autocast(recipe=Float8CurrentScaling()) region (forward)."""

    def __init__(self, device):
        gen = generator(1606)
        self.weight = randn(OUT_FEATURES, IN_FEATURES, gen=gen, device=device, scale=0.3).double()
        self.bias = randn(OUT_FEATURES, gen=gen, device=device, scale=0.1).double()
        self.input_quantizer = Float8CurrentScalingQuantizer((BATCH, IN_FEATURES), device)
        self.weight_quantizer = Float8CurrentScalingQuantizer((OUT_FEATURES, IN_FEATURES), device)

    def forward(self, inp):
        x = quantize(inp, self.input_quantizer)
        w = quantize(self.weight, self.weight_quantizer)
        return (x.data * x.scale_inv) @ (w.data * w.scale_inv).t() + self.bias

    def quantizer_state(self):
        return {f"{n}.{a}": getattr(q, a) for n, q in (("input", self.input_quantizer),
                                                          ("weight", self.weight_quantizer))
                for a in ("amax", "scale", "scale_inv", "data")}


def make_graphed_callables(module, sample_args, device, num_warmup_iters=NUM_WARMUP_ITERS):
    """transformer_engine.pytorch.graph.make_graphed_callables (forward graph): warm up, capture, then replay with
    the caller's input copied into the static input."""
    static_input = sample_args[0].clone()
    fwd_graph, static_output = capture(lambda: module.forward(static_input), device=device,
                                       warmups=num_warmup_iters, name="Linear fwd", owner="make_graphed_callables",
                                       static={"static_input": static_input}, state=module.quantizer_state())

    def graphed(inp):
        static_input.copy_(inp)
        return replay(fwd_graph, static_output)
    return graphed


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(16060)
    sample = randn(BATCH, IN_FEATURES, gen=gen, device=device).double()
    inputs = [randn(BATCH, IN_FEATURES, gen=gen, device=device, scale=s).double() for s in (1.0, 3.0, 0.2)]

    def served():
        module = Linear(device)
        graphed = make_graphed_callables(module, (sample,), device)
        return [graphed(x).clone() for x in inputs]

    def eager():
        module = Linear(device)
        for _ in range(NUM_WARMUP_ITERS + 1):      # the graphed run's warmups and capture-time forward
            module.forward(sample)
        return [module.forward(x) for x in inputs]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
