"""flashinfer's cuDNN decode graph cache ignores the scale: a same-shape call runs the graph built with the old scale.

Upstream: https://github.com/flashinfer-ai/flashinfer/pull/4014 ("fix(cudnn): include attn scale in the
prefill/decode graph-cache keys", merged as commit 82784bb11).
Symptom: plausible, finite, wrong numbers: prefill in bf16 with ``scale = 1/sqrt(128)`` then ``3/sqrt(128)``
at identical shapes gave an error of 2.5572 against the correct reference and 0.0037 against the
stale-scale reference (an exact replay of the first call's graph). Same-shape calls with different scales are
routine (per-layer logit scaling, muP, two models served by one process).
Mechanism: ``cudnn_batch_decode_with_kv_cache`` -> ``_batch_decode_with_kv_cache`` asks
``_build_decode_graph`` for a built cuDNN SDPA graph; ``@cudnn.graph_cache(key_fn=_sdpa_decode_key_fn)``
memoises it process-wide. The build passes ``attn_scale=scale`` to ``g.sdpa``: a compile-time constant of the
built graph, while the tensors (q, k/v cache, ``actual_seq_lens_kv``, block tables, output) are bound per call
through ``graph.execute(var_map, ...)``. ``_sdpa_decode_key_fn`` returned only ``("decode", max_sequence_kv,
q.shape, k_cache.shape)``: the first call (layer 0, scale s0) builds and caches G(s0); the next call with the
same shapes (layer 1, scale s1) hits the cache and executes G(s0) on its own tensors, every decode step.
Here the built graph is a captured graph: the build captures the SDPA on the graph's own bound tensors
(the scale a Python float, baked in), and ``execute`` copies the call's ``var_map`` tensors into them and replays.
Doctor: warmup-divergence, at ``_sdpa_decode_key_fn`` (the build fixed the scale; the cache key cannot tell
a call with another scale from it, while an eager call uses its own scale).
Fix (upstream): ``scale`` added to both key tuples (``_sdpa_decode_key_fn`` and ``_sdpa_prefill_key_fn``); the
decode key also gets the presence flags ``actual_seq_lens_q/actual_seq_lens_kv/block_tables is not None``.
(Two decoder layers with per-layer attention multipliers, one paged KV cache each, same shapes; eager is
the same SDPA in torch with the call's scale.)
"""
from __future__ import annotations

import functools
import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/flashinfer-ai/flashinfer/pull/4014"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "_sdpa_decode_key_fn"
SYMPTOM = "a same-shape cuDNN decode call with another attention scale executes the graph built with the first scale"

BATCH, HEADS, HEAD_DIM, PAGE_SIZE, PAGES_PER_SEQ = 2, 2, 4, 2, 3
MAX_SEQUENCE_KV = PAGE_SIZE * PAGES_PER_SEQ
NUM_PAGES = 1 + BATCH * PAGES_PER_SEQ
PROMPT_LENS = (2, 1)
DECODE_STEPS = 3
# layer 0: 1/sqrt(d); layer 1: an attention multiplier (muP-style) on top of it
LAYER_SCALES = (1.0 / math.sqrt(HEAD_DIM), 3.0 / math.sqrt(HEAD_DIM))


def _sdpa_decode_key_fn(q, k_cache, v_cache, scale, *, max_sequence_kv, actual_seq_lens_kv=None,
                        block_tables=None, variant="bug"):
    key = ("decode", max_sequence_kv, tuple(q.shape), tuple(k_cache.shape))
    if variant == "fix":
        # attn_scale is baked into the built graph as a compile-time constant;
        # omitting it silently replays a stale-scale graph on same-shape calls.
        key += (scale, actual_seq_lens_kv is not None, block_tables is not None)
    return key


def graph_cache(key_fn):
    """``cudnn.graph_cache``: one built graph per key, for the whole process."""
    def deco(build):
        cache = {}

        @functools.wraps(build)
        def cached(*args, **kwargs):
            key = key_fn(*args, **kwargs)
            if key not in cache:
                cache[key] = build(*args, **kwargs)
            return cache[key]

        cached.cache = cache
        return cached
    return deco


def sdpa(q, k_cache, v_cache, attn_scale, max_sequence_kv, seq_len_kv, block_tables):
    """Paged decode SDPA with a padding mask: q [b, h, d], caches [pages, h, page_size, d]."""
    b = q.shape[0]
    k = k_cache[block_tables.long()].permute(0, 2, 1, 3, 4).reshape(b, HEADS, -1, HEAD_DIM)[:, :, :max_sequence_kv]
    v = v_cache[block_tables.long()].permute(0, 2, 1, 3, 4).reshape(b, HEADS, -1, HEAD_DIM)[:, :, :max_sequence_kv]
    scores = (k @ q[:, :, :, None]).squeeze(-1) * attn_scale
    pos = torch.arange(max_sequence_kv, device=q.device)
    scores = scores.masked_fill(pos[None, None, :] >= seq_len_kv.long()[:, None, None], float("-inf"))
    return (torch.softmax(scores, -1)[:, :, None, :] @ v).squeeze(2)


class BuiltGraph:
    """A built cuDNN SDPA graph: tensors bound per call (``var_map``), ``attn_scale`` fixed at build."""

    def __init__(self, tensors, out, graph):
        self.tensors, self.out, self.graph = tensors, out, graph

    def execute(self, var_map, out):
        for uid, t in var_map.items():
            self.tensors[uid].copy_(t)
        out.copy_(replay(self.graph, self.out))
        return out


def make_build_decode_graph(variant, device):
    key_fn = functools.partial(_sdpa_decode_key_fn, variant=variant)

    @graph_cache(key_fn=key_fn)
    def _build_decode_graph(q, k_cache, v_cache, scale, *, max_sequence_kv, actual_seq_lens_kv=None,
                            block_tables=None):
        # the graph's own tensors (``g.tensor_like``), shaped as this first call's
        tensors = {"q": q.clone(), "k": k_cache.clone(), "v": v_cache.clone(),
                   "seq_len_kv": actual_seq_lens_kv.clone(), "block_tables": block_tables.clone()}
        g, o = capture(lambda: sdpa(tensors["q"], tensors["k"], tensors["v"], scale, max_sequence_kv,
                                    tensors["seq_len_kv"], tensors["block_tables"]),
                       device=device, warmups=0, name=f"cudnn sdpa decode (attn_scale={scale:.3f})",
                       static=tensors, owner="cudnn decode graph")
        return BuiltGraph(tensors, o, g)

    return _build_decode_graph


def cudnn_batch_decode_with_kv_cache(build, q, k_cache, v_cache, scale, *, max_sequence_kv,
                                     actual_seq_lens_kv, block_tables, out):
    graph = build(q, k_cache, v_cache, scale, max_sequence_kv=max_sequence_kv,
                  actual_seq_lens_kv=actual_seq_lens_kv, block_tables=block_tables)
    var_map = {"q": q, "k": k_cache, "v": v_cache, "seq_len_kv": actual_seq_lens_kv, "block_tables": block_tables}
    return graph.execute(var_map, out)


class DecoderLayer:
    def __init__(self, scale, gen, device):
        self.scale = scale
        dim = HEADS * HEAD_DIM
        self.wq, self.wk, self.wv, self.wo = (randn(dim, dim, gen=gen, device=device, scale=0.6) for _ in range(4))
        self.k_cache = torch.zeros(NUM_PAGES, HEADS, PAGE_SIZE, HEAD_DIM, device=device)
        self.v_cache = torch.zeros(NUM_PAGES, HEADS, PAGE_SIZE, HEAD_DIM, device=device)

    def forward(self, h, positions, seq_lens, block_tables, attention):
        b = h.shape[0]
        page = block_tables.long()[torch.arange(b, device=h.device), positions // PAGE_SIZE]
        self.k_cache[page, :, positions % PAGE_SIZE] = (h @ self.wk).view(b, HEADS, HEAD_DIM)
        self.v_cache[page, :, positions % PAGE_SIZE] = (h @ self.wv).view(b, HEADS, HEAD_DIM)
        q = (h @ self.wq).view(b, HEADS, HEAD_DIM)
        out = torch.empty_like(q)
        o = attention(q, self.k_cache, self.v_cache, self.scale, max_sequence_kv=MAX_SEQUENCE_KV,
                      actual_seq_lens_kv=seq_lens, block_tables=block_tables, out=out)
        return h + o.reshape(b, -1) @ self.wo


def run(variant: str, device: str = "cpu"):
    gen = generator(4014)
    dim = HEADS * HEAD_DIM
    prompt_k = [randn(BATCH, MAX_SEQUENCE_KV, dim, gen=gen, device=device) for _ in LAYER_SCALES]
    inputs = [randn(BATCH, dim, gen=gen, device=device) for _ in range(DECODE_STEPS)]
    block_tables = torch.tensor([[1 + s * PAGES_PER_SEQ + p for p in range(PAGES_PER_SEQ)]
                                 for s in range(BATCH)], dtype=torch.int32).to(device)

    def serve(graphed: bool):
        wgen = generator(40140)
        layers = [DecoderLayer(s, wgen, device) for s in LAYER_SCALES]
        lens = torch.tensor(PROMPT_LENS)
        for layer, pk in zip(layers, prompt_k):            # the prompts' KV (prefill, outside this model)
            for s, n in enumerate(PROMPT_LENS):
                for p in range(n):
                    page = int(block_tables[s, p // PAGE_SIZE])
                    layer.k_cache[page, :, p % PAGE_SIZE] = (pk[s, p] @ layer.wk).view(HEADS, HEAD_DIM)
                    layer.v_cache[page, :, p % PAGE_SIZE] = (pk[s, p] @ layer.wv).view(HEADS, HEAD_DIM)
        if graphed:
            attention = functools.partial(cudnn_batch_decode_with_kv_cache, make_build_decode_graph(variant, device))
        else:
            def attention(q, k_cache, v_cache, scale, *, out, **kw):
                return out.copy_(sdpa(q, k_cache, v_cache, scale, kw["max_sequence_kv"],
                                      kw["actual_seq_lens_kv"], kw["block_tables"]))
        outs = []
        with torch.no_grad():
            for x in inputs:
                positions = lens.to(device)
                seq_lens = (lens + 1).to(torch.int32).to(device)
                h = x
                for layer in layers:
                    h = layer.forward(h, positions, seq_lens, block_tables, attention)
                outs.append(h.clone())
                lens = lens + 1
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
