"""Autocast's weight-cast cache keys on a cudagraph-trees output whose TensorImpl persists across replays: later steps reuse step 1's cast.

Upstream: https://github.com/pytorch/pytorch/pull/99368 ("Make autocast cache and buffer stealing aware of
cudagraph static output tensors", eellison, April 2023; landed: ``at::caching::is_cached_tensor`` /
``adjusted_use_count`` are in ``aten/src/ATen/CachedTensorUtils.h`` today).
Symptom: with ``torch.compile(mode="reduce-overhead")`` (CUDAGraph trees) the fast path hands out the same
persisted static output tensors on every replay; inside one ``torch.autocast(cache_enabled=True)`` region a
low-precision cast of such an output is served from the autocast cache, so every later iteration computes
with the first iteration's values (the header's own words: "For these tensors caching dtype conversions is
invalid").
Mechanism: ``autocast_mode.cpp``'s ``cached_cast`` caches the lower-precision copy of an fp32 leaf that
requires grad, keyed by its ``TensorImpl*`` (``cached_casts``), and the cache is only cleared when the
outermost autocast region exits. CUDAGraph trees' ``CUDAGraphNode.run`` returns its
``cached_tensor_outputs``: the same tensor objects, whose storage the replay rewrites in place. Eager
produces a fresh tensor each step, so its casts miss; the graph's output hits step 1's entry, and the
downstream low-precision matmul reads a cast the step never refreshed.
Doctor: stale-input, at ``cached_cast`` (it serves the cast an earlier step left instead of re-casting the
output the replay just rewrote).
Fix (upstream): cudagraph trees registers its persisted outputs with ``at::caching::add_cached_tensor``;
``cached_cast`` adds ``!at::caching::is_cached_tensor(arg)`` to its ``can_try_cache`` condition (and the
autograd buffer-stealing check uses ``adjusted_use_count``, the use count less the tree's own reference).
(Read: the PR's review threads and the landed ``CachedTensorUtils`` / ``input_buffer.cpp`` code; the
autocast hunk is modelled from the header comment and review reply "We're disabling the caching of dtype".
The graphed function is a tiny weight generator whose output the training code marks ``requires_grad_``.)
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/pytorch/pull/99368"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "cached_cast"
SYMPTOM = "under one autocast region every step after the first matmuls with step 1's cast of the graph output"

DIM, ROWS, STEPS = 4, 3, 4
LOWER = torch.bfloat16


# --- at::caching (CachedTensorUtils) ------------------------------------------------------------
_cached_tensorimpls: dict[int, torch.Tensor] = {}


def add_cached_tensor(t: torch.Tensor) -> None:
    _cached_tensorimpls[id(t)] = t


def is_cached_tensor(t: torch.Tensor) -> bool:
    return _cached_tensorimpls.get(id(t)) is t


# --- autocast_mode.cpp ----------------------------------------------------------------------------
class Autocast:
    """``torch.autocast(cache_enabled=True)``: ``cached_casts`` lives until the outermost region exits."""

    def __init__(self, variant):
        self.variant = variant
        self.cached_casts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.cached_casts.clear()                 # clear_cache() at the outermost exit

    def cached_cast(self, arg: torch.Tensor) -> torch.Tensor:
        can_try_cache = (arg.dtype == torch.float32 and arg.requires_grad and arg.is_leaf
                         and not arg._is_view())
        if self.variant == "fix":
            can_try_cache = can_try_cache and not is_cached_tensor(arg)
        if can_try_cache:
            hit = self.cached_casts.get(id(arg))
            if hit is not None and hit[0] is arg:
                return hit[1]
            casted = arg.detach().to(LOWER)
            self.cached_casts[id(arg)] = (arg, casted)  # keeps the key alive, as the weakref entry does
            return casted
        return arg.detach().to(LOWER)

    def linear(self, x, w):
        return (self.cached_cast(x) @ self.cached_cast(w)).float()


# --- the compiled region and its CUDAGraph tree node ------------------------------------------------
class WeightGenerator:
    def __init__(self, device):
        gen = generator(99368)
        self.a = randn(DIM, DIM * DIM, gen=gen, device=device, scale=0.5)

    def __call__(self, z):
        return torch.tanh(z @ self.a).reshape(DIM, DIM)


class CUDAGraphNode:
    """Records the generator once; ``run`` copies the input in, replays, and returns the persisted
    ``cached_tensor_outputs`` (the same tensor object every time)."""

    def __init__(self, fn, device, variant):
        self.static_z = torch.zeros(1, DIM, device=device)
        with torch.no_grad():
            self.graph, out = capture(lambda: fn(self.static_z), device=device,
                                      owner="CUDAGraphNode", static={"z": self.static_z})
        self.static_out = out
        self.cached_tensor_outputs = out.detach()       # the persisted output handed to the user
        if variant == "fix":
            add_cached_tensor(self.cached_tensor_outputs)

    def run(self, z):
        self.static_z.copy_(z)
        with torch.no_grad():
            replay(self.graph, self.static_out)
        return self.cached_tensor_outputs


def run(variant: str, device: str = "cpu"):
    _cached_tensorimpls.clear()
    gen = generator(1)
    zs = [randn(1, DIM, gen=gen, device=device) for _ in range(STEPS)]
    xs = [randn(ROWS, DIM, gen=gen, device=device) for _ in range(STEPS)]
    weight_gen = WeightGenerator(device)

    def train(graphed: bool):
        node = CUDAGraphNode(weight_gen, device, variant) if graphed else None
        outs = []
        with Autocast(variant) as autocast:
            for z, x in zip(zs, xs):
                if graphed:
                    w = node.run(z)
                else:
                    with torch.no_grad():
                        w = weight_gen(z)
                w.requires_grad_(True)                 # the training code differentiates w.r.t. w
                outs.append(autocast.linear(x, w).detach().clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: train(True), lambda: train(False))
