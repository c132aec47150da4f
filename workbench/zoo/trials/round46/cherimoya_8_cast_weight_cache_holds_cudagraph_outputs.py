"""A dict caches the bf16 weight casts that the compiled, CUDA-graphed forward returns; the next run overwrites them.

Upstream: https://github.com/jmschrei/cherimoya/pull/8 ("FIX cudagraph cache-overwrite error; restore inference
perf via eval-time weight cache"), merged as 528248e (fix commit e8c6d48, follow-up b9354bf).
Symptom: under the default ``torch.compile(self._forward_impl, mode='max-autotune')``, which turns on CUDA graph
trees, inference raised "RuntimeError: Error: accessing tensor output of CUDAGraphs that has been overwritten by a
subsequent run". The troubleshooting page names the trigger: "Loading multiple Cherimoya instances in one process
and calling them in sequence (e.g. running all five folds of a comprehensive model on the same loci). The shared
compiled forward sees a cache miss on the second instance and tries to reuse a buffer the first instance is still
holding."
Mechanism: ``CheriBlock._cast_weights`` (on the no-grad inference path of ``CheriBlock.forward``) kept a plain
dict, ``self._w_cache[dt] = (key, w1, w2)``, with ``key = (id(w1_p), w1_p._version, id(w2_p), w2_p._version)``,
``w1 = linear1.weight.to(dt)`` and ``w2 = (linear2.weight * residual_scale).to(dt)``. The cast ran inside the
compiled forward, so ``w1`` and ``w2`` were outputs of the CUDA graph: they lived in the graph's output memory,
and the dict write was a dynamo side effect applied with those outputs. The next run of that graph, for the next
instance, wrote its own casts into the same memory. The cache key of the first instance (its parameters'
identity and version) had not changed, so its next forward took the cache-hit path and fed the overwritten
tensors into the megakernel: the second instance's MLP weights. CUDA graph trees detect this and raise; with
plain graph semantics, as modelled here, the numbers are silently wrong.
Doctor: overwritten-output, at ``_cast_weights`` (it keeps graph outputs in ``_w_cache`` past the next replay and
returns them on a cache hit).
Fix (upstream): e8c6d48 drops the cache: ``_cast_weights`` recomputes both casts on every call, so the tensors it
returns are produced inside the current forward. (b9354bf later caches the casts at ``.eval()`` time, outside
the compiled region, as non-persistent buffers; that follow-up is not modelled.)
Read: the diffs of e8c6d48 and b9354bf, ``cheri.py`` (``CheriBlock``) and ``cherimoya.py`` (``_forward_fn =
torch.compile(self._forward_impl, mode=...)``) before the fix, and ``docs/troubleshooting.rst``.
Model of the compiled forward: dynamo caches compiled code per code object and keys it on guards (here, whether
each block's cache entry hits), so the instances share it. The graph trees record every graph from the same
pool checkpoint once the previous generation's outputs are dead, so the miss graph's outputs land at the same
addresses for every instance. Here this is one graph per guard state: its inputs are copied into static
placeholders, cached casts that are outputs of an earlier graph are read by address, and the dict writes are
applied after the replay with the graph's outputs. The Triton megakernel is a small torch stand-in: dilated
depthwise conv, channel norm, bf16 MLP with a tanh GELU, residual.
"""
from __future__ import annotations

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/jmschrei/cherimoya/pull/8"
FAMILY = "persistent-buffer mutation"
KIND = "overwritten-output"
SITE = "_cast_weights"
SYMPTOM = "a second model instance's forward overwrites the first one's cached bf16 weight casts (graph outputs)"

N_FILTERS, EXPANSION, N_LAYERS, IN_CH, N_OUTPUTS = 8, 2, 2, 4, 3
BATCH, LENGTH = 2, 12
CONV_NORM_EPS = 1e-5


def _fwd_inf_forward(X, conv_w, dilation, w1, w2):
    """The inference megakernel: dilated depthwise conv + channel norm, then the bf16 MLP and the residual."""
    length = X.shape[1]
    xp = torch.nn.functional.pad(X, (0, 0, dilation, dilation))
    y = (conv_w[0] * xp[:, :length] + conv_w[1] * xp[:, dilation:dilation + length]
         + conv_w[2] * xp[:, 2 * dilation:2 * dilation + length])
    y = (y - y.mean(-1, keepdim=True)) / torch.sqrt(y.var(-1, unbiased=False, keepdim=True) + CONV_NORM_EPS)
    h = torch.nn.functional.gelu((y.to(w1.dtype) @ w1.t()).float(), approximate="tanh")
    return X + (h.to(w2.dtype) @ w2.t()).float()          # residual_scale is folded into w2


class Linear:
    def __init__(self, in_features, out_features, gen, device):
        self.weight = randn(out_features, in_features, gen=gen, device=device, scale=0.3)


class CheriBlock:
    def __init__(self, n_filters, dilation, gen, device, variant, expansion=EXPANSION, residual_scale=0.15):
        self.n_filters, self.dilation, self.variant = n_filters, dilation, variant
        self.residual_scale = residual_scale
        hidden = expansion * n_filters
        self.conv_weight = randn(3, n_filters, gen=gen, device=device, scale=0.5)
        self.linear1 = Linear(n_filters, hidden, gen, device)
        self.linear2 = Linear(hidden, n_filters, gen, device)
        # Inference-path weight cache. Plain dict (not a buffer, not in state_dict). Keyed by target dot
        # dtype; the value is a tuple (cache_key, w1_cast, w2_cast_with_scale).
        self._w_cache = {}

    def tensors(self):
        return [self.conv_weight, self.linear1.weight, self.linear2.weight]

    def _cache_key(self):
        w1_p, w2_p = self.linear1.weight, self.linear2.weight
        return (id(w1_p), w1_p._version, id(w2_p), w2_p._version)

    def _cast_weights(self, X):
        dt = torch.bfloat16 if X.dtype == torch.float32 else X.dtype
        if self.variant == "fix":
            # Recomputed on every call (no caching): produced inside the current forward.
            w1 = self.linear1.weight.to(dt)
            w2 = (self.linear2.weight * self.residual_scale).to(dt)
            return w1, w2
        w1_p, w2_p = self.linear1.weight, self.linear2.weight
        key = self._cache_key()
        entry = self._w_cache.get(dt)
        if entry is not None and entry[0] == key:
            return entry[1], entry[2]
        w1 = w1_p.to(dt)
        w2 = (w2_p * self.residual_scale).to(dt)
        self._w_cache[dt] = (key, w1, w2)
        return w1, w2

    def forward(self, X):
        w1, w2 = self._cast_weights(X)
        return _fwd_inf_forward(X, self.conv_weight, self.dilation, w1, w2)


class Cherimoya:
    def __init__(self, seed, device, variant, compile=True):
        gen = generator(seed)
        self.device, self.variant = device, variant
        self.iconv_weight = randn(IN_CH, N_FILTERS, gen=gen, device=device, scale=0.5)
        self.blocks = [CheriBlock(N_FILTERS, 2 ** i, gen, device, variant) for i in range(N_LAYERS)]
        self.linear_weight = randn(N_FILTERS, N_OUTPUTS, gen=gen, device=device, scale=0.5)
        self._forward_fn = torch_compile(self._forward_impl) if compile else self._forward_impl

    def tensors(self):
        return [self.iconv_weight, *(t for b in self.blocks for t in b.tensors()), self.linear_weight]

    def _forward_impl(self, X):
        X = X @ self.iconv_weight
        for block in self.blocks:
            X = block.forward(X)
        return X.mean(1) @ self.linear_weight

    def forward(self, X):
        return self._forward_fn(X)


# ---------------------------------------------------------------- torch.compile(mode='max-autotune'), modelled
_DYNAMO_CACHE: dict = {}      # per code object (Cherimoya._forward_impl): shared by every instance


def torch_compile(bound_forward):
    model = bound_forward.__self__
    return lambda X: _compiled_call(model, X)


def _guards(model, X):
    """What dynamo guards on here: the input's shape and, per block, whether ``_w_cache`` holds a matching entry."""
    dt = torch.bfloat16
    hits = []
    for block in model.blocks:
        entry = block._w_cache.get(dt)
        hits.append(entry is not None and entry[0] == block._cache_key())
    return tuple(X.shape), tuple(hits)


class _CudagraphedEntry:
    """One compiled graph, run under CUDA graphs: static placeholders for its inputs, a graph over the traced
    forward, and the dict writes of ``_cast_weights`` (dynamo side effects) applied after each run."""

    def __init__(self, model, X, hits, pool):
        self.hits = hits
        self.trace = Cherimoya(0, model.device, model.variant, compile=False)   # the traced program
        self.static_inputs = [t.clone() for t in model.tensors()]
        for holder_t, static in zip(self._slots(self.trace), self.static_inputs):
            setattr(holder_t[0], holder_t[1], static)
        self.static_X = X.clone()
        # Cache entries that hit are read by address (outputs of an earlier graph of the tree).
        hit_entries = {i: model.blocks[i]._w_cache[torch.bfloat16][1:] for i, h in enumerate(hits) if h}

        def traced():
            for i, block in enumerate(self.trace.blocks):
                block._w_cache = ({torch.bfloat16: (block._cache_key(), *hit_entries[i])} if i in hit_entries
                                  else {})
            y = self.trace._forward_impl(self.static_X)
            casts = [t for i, b in enumerate(self.trace.blocks) if i not in hit_entries and b._w_cache
                     for t in b._w_cache[torch.bfloat16][1:]]
            return (y, *casts)

        static = {"X": self.static_X}
        static.update({f"param{i}": t for i, t in enumerate(self.static_inputs)})
        self.graph, self.outputs = capture(traced, device=model.device, pool=pool, warmups=1,
                                           owner="torch.compile(Cherimoya._forward_impl) cudagraph", static=static)

    @staticmethod
    def _slots(model):
        slots = [(model, "iconv_weight")]
        for b in model.blocks:
            slots += [(b, "conv_weight"), (b.linear1, "weight"), (b.linear2, "weight")]
        return slots + [(model, "linear_weight")]

    def __call__(self, model, X):
        for static, t in zip(self.static_inputs, model.tensors()):
            static.copy_(t)
        self.static_X.copy_(X)
        y, *casts = replay(self.graph, self.outputs)
        # side effects: self._w_cache[dt] = (key, w1, w2), with the graph's outputs
        it = iter(casts)
        for block, hit in zip(model.blocks, self.hits):
            if not hit and model.variant == "bug":
                block._w_cache[torch.bfloat16] = (block._cache_key(), next(it), next(it))
        return y


def _compiled_call(model, X):
    guards = _guards(model, X)
    entry = _DYNAMO_CACHE.get(guards)
    if entry is None:
        entry = _DYNAMO_CACHE[guards] = _CudagraphedEntry(model, X, guards[1], _DYNAMO_CACHE["pool"])
    return entry(model, X)


def run(variant: str, device: str = "cpu"):
    gen = generator(80)
    loci = [randn(BATCH, LENGTH, IN_CH, gen=gen, device=device) for _ in range(3)]

    def serve(compiled: bool):
        _DYNAMO_CACHE.clear()
        _DYNAMO_CACHE["pool"] = graph_pool_handle(device)      # the tree's one pool per device
        folds = [Cherimoya(seed, device, variant, compile=compiled) for seed in (1, 2)]
        outs = []
        with torch.no_grad():
            for X in loci:                       # every fold of a comprehensive model on the same loci
                for model in folds:
                    outs.append(model.forward(X).clone())
        _DYNAMO_CACHE.clear()
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
