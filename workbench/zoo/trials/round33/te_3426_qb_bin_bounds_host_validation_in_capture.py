"""A full-iteration graph cannot be captured: the QB router re-validates its in-place-updated bin bounds on the host.

Upstream: https://github.com/NVIDIA/TransformerEngine/pull/3426 ("[PyTorch] Fix mutable QB bounds in CUDA graphs",
merged Sep 2026), fixing the Quantile Balancing router added in TransformerEngine#3395.
Symptom: with Megatron-Core's full-iteration CUDA graph and Quantile Balancing (Kimi-K3 router), the graph cannot
be captured: the router's host-side bounds validation runs inside the capture and fails ("QB bin_bounds must be
validated by an eager router call before CUDA graph capture"; a host read of device memory during capture).
Mechanism: ``qb_bin_bounds`` is a persistent ``[lower, upper]`` device tensor. In one iteration the router
(``FusedTopkScoreFunctionQB.forward``) reads it near the start, and QB finalization
(``finalize_model_grads._update_router_qb_*``) rewrites the same storage in place near the end (next
iteration's histogram range ``[min(b_next) - 1, max(b_next) + 1]``), bumping its PyTorch version.
``_validate_qb_bin_bounds`` validates "once per PyTorch tensor version": when ``bin_bounds._version`` differs from
the version it cached, it reads the bounds to the host (``bin_bounds.detach().cpu().tolist()``) to check
``isfinite(lower) and isfinite(upper) and lower < upper``, then passes ``bin_bounds_validated=True`` so the
``*_unchecked`` kernels run. The warmup iteration's finalization bumps the version, so the first router call
inside the capture needs that host read again, which a capturing stream cannot do. (Upstream guards the read
with ``torch.cuda.is_current_stream_capturing()`` and raises its own RuntimeError; here the read is attempted,
as it is in the function's logic, and the capture refuses it.) Even a capture that got past it would replay
the unchecked kernels on bounds that the graph itself rewrites every replay and nobody re-validates.
Doctor: sync-in-capture, at ``_validate_qb_bin_bounds`` (the host read of the device bounds inside the capture).
Fix (upstream): bounds are validated in the kernels (``load_qb_bin_params`` checks ``isfinite(lower) &&
isfinite(upper) && lower < upper`` on the device); during capture the Python wrapper skips the host validation
and uses the checked kernels, so the mutable bounds are re-checked at every replay with no host work.
Read: the pre-fix ``router.py``/``router.cpp`` (TE#3395, commit 2f77de03e) and, of #3426, its (truncated)
description and the review thread on the device-side check in ``fused_topk_with_score_function.cu``; not the
whole diff.
"""
from __future__ import annotations

import math

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TransformerEngine/pull/3426"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "_validate_qb_bin_bounds"
SYMPTOM = "full-iteration graph capture fails: QB bounds updated in place need host validation inside the capture"

TOKENS, EXPERTS, TOPK, NUM_BINS, HIDDEN, ITERS = 8, 4, 2, 16, 3, 5
_QB_BOUNDS_VALIDATED_VERSION_ATTR = "_nvte_qb_bounds_validated_version"
VARIANT = {"name": "bug"}


def _validate_qb_bin_bounds(bin_bounds: torch.Tensor) -> bool:
    """Validate device-resident QB bounds once per PyTorch tensor version."""
    version = bin_bounds._version
    if getattr(bin_bounds, _QB_BOUNDS_VALIDATED_VERSION_ATTR, None) == version:
        return True
    if VARIANT["name"] == "fix" and torch.cuda.is_current_stream_capturing():
        # Mutable bounds in CUDA graphs: the checked kernel validates them on the device at every replay.
        return False
    lower, upper = bin_bounds.detach().cpu().tolist()
    if not (math.isfinite(lower) and math.isfinite(upper) and lower < upper):
        raise ValueError(f"QB bin_bounds values must be finite with lower < upper, got [{lower}, {upper}]")
    setattr(bin_bounds, _QB_BOUNDS_VALIDATED_VERSION_ATTR, version)
    return True


def fused_topk_with_score_function_qb_fwd(logits, topk, expert_bias, histogram, bin_bounds, bin_bounds_validated):
    """Sigmoid scores, Top-(k+1) on ``score + bias``: routes = Top-k, cutoff ``alpha`` = the (k+1)-th value;
    the histogram counts ``alpha - score`` per expert in ``NUM_BINS`` uniform bins over ``bin_bounds``."""
    scores = torch.sigmoid(logits)
    biased = scores + expert_bias
    top = torch.topk(biased, topk + 1, dim=-1)
    cutoff = top.values[:, topk:topk + 1]                      # [tokens, 1]
    routing_map = torch.zeros_like(scores).scatter_(1, top.indices[:, :topk], 1.0)
    probs = scores * routing_map
    probs = probs / probs.sum(-1, keepdim=True)
    intermediate = cutoff - scores                             # the bias each expert would need
    lower, upper = bin_bounds[0], bin_bounds[1]
    width = (upper - lower) / NUM_BINS
    bins = torch.floor((intermediate - lower) / width).clamp_(0, NUM_BINS - 1).long().t()   # [experts, tokens]
    ones = torch.ones_like(bins, dtype=histogram.dtype)
    if not bin_bounds_validated:
        # the checked kernels (``load_qb_bin_params``): bounds checked on the device (upstream traps if invalid)
        valid = torch.isfinite(lower) & torch.isfinite(upper) & (lower < upper)
        ones = ones * valid.to(histogram.dtype)
    histogram.scatter_add_(1, bins, ones)
    return probs, routing_map


def fused_topk_with_score_function(logits, topk, expert_bias, qb_histogram, qb_bin_bounds):
    """``FusedTopkScoreFunctionQB.forward``."""
    bin_bounds_validated = _validate_qb_bin_bounds(qb_bin_bounds)
    return fused_topk_with_score_function_qb_fwd(logits, topk, expert_bias, qb_histogram, qb_bin_bounds,
                                                 bin_bounds_validated)


class QBRouter:
    def __init__(self, device):
        gen = generator(3426)
        self.weight = randn(HIDDEN, EXPERTS, gen=gen, device=device)
        self.expert_bias = torch.zeros(EXPERTS, device=device)
        self.qb_histogram = torch.zeros(EXPERTS, NUM_BINS, dtype=torch.int32, device=device)
        self.qb_bin_bounds = torch.tensor([-1.0, 1.0], device=device)

    def forward(self, hidden):
        return fused_topk_with_score_function(hidden @ self.weight, TOPK, self.expert_bias, self.qb_histogram,
                                              self.qb_bin_bounds)


def _update_router_qb(router):
    """QB finalization at the global-batch boundary: per-expert quantile of the required bias from the
    histogram (``b_next[j] = quantile(r[:, j], k / E)``), centred; next range ``[min - 1, max + 1]``; all on
    the device, written in place into the router's persistent tensors."""
    hist = router.qb_histogram.float()
    lower, upper = router.qb_bin_bounds[0], router.qb_bin_bounds[1]
    width = (upper - lower) / NUM_BINS
    target = hist.sum(-1, keepdim=True) * (TOPK / EXPERTS)
    bin_idx = (hist.cumsum(-1) < target).sum(-1).clamp(max=NUM_BINS - 1).float()
    b_next = lower + (bin_idx + 0.5) * width
    b_next = b_next - b_next.mean()
    router.expert_bias.copy_(b_next)
    router.qb_bin_bounds.copy_(torch.stack([b_next.min() - 1.0, b_next.max() + 1.0]))
    router.qb_histogram.zero_()


def train_iteration(router, static_hidden):
    """One full iteration as Megatron graphs it: router forward (the MoE layer's combine stands in for the
    rest of the model) and the QB finalization."""
    probs, routing_map = router.forward(static_hidden)
    out = probs @ router.weight.t()
    _update_router_qb(router)
    return out, probs


def run(variant: str, device: str = "cpu"):
    VARIANT["name"] = variant
    gen = generator(33426)
    batches = [randn(TOKENS, HIDDEN, gen=gen, device=device) for _ in range(ITERS)]

    def finals(router):
        return [router.expert_bias.clone(), router.qb_bin_bounds.clone()]

    def eager():
        router = QBRouter(device)
        outs = []
        for h in batches:
            out, probs = train_iteration(router, h)
            outs += [out.clone(), probs.clone()]
        return outs + finals(router)

    def served():
        router = QBRouter(device)
        static_hidden = batches[0].clone()
        fn = lambda: train_iteration(router, static_hidden)  # noqa: E731
        with events.warmup(real=True):                         # the eager warmup iteration validates the bounds
            out, probs = fn()
            outs = [out.clone(), probs.clone()]
        g, (out, probs) = capture(fn, device=device, warmups=0, static={"static_hidden": static_hidden},
                                  state={"expert_bias": router.expert_bias, "qb_histogram": router.qb_histogram,
                                         "qb_bin_bounds": router.qb_bin_bounds},
                                  owner="MCore full-iteration CUDA graph")
        for h in batches[1:]:
            static_hidden.copy_(h)
            o, p = replay(g, (out, probs))
            outs += [o.clone(), p.clone()]
        return outs + finals(router)

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
