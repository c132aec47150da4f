"""A split-K semaphore allocated inside a capture lands on a block an earlier graph still writes.

Upstream: https://github.com/ROCm/aiter/pull/5393 ("Keep split-K preshuffle buffers out of the CUDA
graph pool"; the same defect, within one capture, in #5430).
Symptom: with CUDA graphs, a later-captured GEMM graph silently returns wrong output tiles (aiter
FlyDSL split-K GEMM under vLLM, Sept 2026); eager mode is correct.
Mechanism: the split-K workspace and semaphore are cached per ``(device, stream)``. Every size is
captured on one capture stream, so the first capturing GEMM misses and allocates them inside the
capture, from the shared graph pool. The semaphore lands on a block that a transient of an *earlier*
graph's capture had freed, and that graph's replay still writes its transient there. The zeroing
(``torch.zeros``) is recorded in the graph that missed only; later graphs hit the cache and do not
zero. After the earlier graph replays, a later graph's arrival count never reaches ``SPLIT``, the
reduction never fires, and the output keeps whatever it held.
Doctor: dangling-reference (graph memory freed at capture, handed to a buffer the library keeps),
at ``split_buffers`` (the lookup that allocates inside the capture).
Fix (upstream): keep the buffers out of the graph pool; here they are keyed on the device alone, so
the warmup allocates them eagerly and every capture finds them.
"""
from __future__ import annotations

import torch

from ...engine import graph_pool_handle
from ..kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/ROCm/aiter/pull/5393"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "split_buffers"
SYMPTOM = "a later-captured GEMM graph skips its split-K reduction: silently wrong output tiles"
SPLIT, MAX_SPLIT_ROWS, K, N = 2, 2, 8, 128
SIZES = (8, 2, 1)                     # captured largest first, on one capture stream, into one pool
DIM = 4                               # the wide layer's transient: 8 x 4 float32, the semaphore's bytes


def split_buffers(cache: dict, device: str, per_stream: bool):
    """The split-K workspace and per-tile arrival semaphore, cached like ``lru_cache`` on
    ``(device, stream)`` (the bug) or on the device (the fix)."""
    key = (device, torch.cuda.is_current_stream_capturing()) if per_stream else device
    if key not in cache:
        cache[key] = (torch.empty(SPLIT, MAX_SPLIT_ROWS, N, device=device),
                      torch.zeros(SPLIT * N // 8, dtype=torch.int32, device=device))
    return cache[key]


def split_k_gemm(x, w, bufs):
    """Each split writes its partial product and arrives on its row's semaphore; the reduction
    fires where all ``SPLIT`` arrived and resets the count (as the kernel's epilogue does)."""
    ws, sema = bufs
    rows, step = x.shape[0], K // SPLIT
    for s in range(SPLIT):
        torch.matmul(x[:, s * step:(s + 1) * step], w[s * step:(s + 1) * step], out=ws[s, :rows])
    count = sema[:rows]
    count.add_(SPLIT)
    done = count == SPLIT
    out = torch.empty(rows, N, device=x.device)              # written by the reduction only
    out.copy_(torch.where(done[:, None], ws[:, :rows].sum(0), out))
    count.masked_fill_(done, 0)
    return out


class Model:
    def __init__(self, device: str, per_stream: bool):
        gen = generator(5393)
        self.device, self.per_stream, self.cache = device, per_stream, {}
        self.w = randn(K, N, gen=gen, device=device, scale=0.3)
        self.v = randn(K, DIM, gen=gen, device=device)

    def forward(self, x):
        if x.shape[0] > MAX_SPLIT_ROWS:                       # large M: no split-K, one transient
            h = (x @ self.v) + 3.0
            return h.sum(1, keepdim=True) * x[:, :1]
        return split_k_gemm(x, self.w, split_buffers(self.cache, self.device, self.per_stream))


def run(variant: str, device: str = "cpu"):
    gen = generator(1)
    steps = [randn(n, K, gen=gen, device=device) for n in (2, 1, 8, 1, 2)]

    def eager():
        model = Model(device, per_stream=True)
        return [model.forward(x).clone() for x in steps]

    def served():
        model = Model(device, per_stream=(variant == "bug"))
        pool = graph_pool_handle(device)
        graphs = {}
        for n in SIZES:
            buf = torch.zeros(n, K, device=device)
            g, out = capture(lambda b=buf: model.forward(b), device=device, pool=pool, name=f"size {n}",
                             static={"input_ids": buf}, owner="vLLM CUDA graph wrapper")
            graphs[n] = (g, out, buf)
        outs = []
        for x in steps:
            g, out, buf = graphs[x.shape[0]]
            buf.copy_(x)
            outs.append(replay(g, out).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
