"""Evicting one CFM DiT graph from the LRU cache frees the cuBLAS workspace its surviving peers still use.

Upstream: https://github.com/vllm-project/vllm-omni/pull/6587 ("[Bugfix][MiniCPM-o] Retire CFM DiT CUDA graphs a
generation at a time"), fixing https://github.com/vllm-project/vllm-omni/issues/6457 ("MiniCPM-o-4.5 CFM DiT CUDA
graph crashes with illegal memory access under streaming TTS").
Symptom: streaming TTS (seed-tts-eval, many reference voices, so more than 32 CFM shapes) crashed with an illegal
memory access. The crash went away with the CFM graph disabled, and with ``max_graphs=9999`` (no eviction; it ran
out of memory instead). A dedicated or per-graph pool still crashed. Under ``CUDA_LAUNCH_BLOCKING=1`` the fault
was in ``graph.replay()`` of a graph that was still in the cache. The default deployment (one voice, about 6
shapes) never evicted, so it never failed.
Mechanism: ``CFMGraphWrapper`` (vllm_omni/model_executor/models/minicpmo_4_5/cuda_graph_wrapper.py) keeps one
graph per estimator input shape behind ``functools.lru_cache(maxsize=max_graphs)`` on ``_capture_graph(key)``.
``_capture`` warms up on a fresh side stream, then captures on torch's process-wide default capture stream.
cuBLAS creates one workspace per (handle, stream) lazily, on first use. For the capture stream, first use is
inside the first capture, so the workspace is allocated from that graph's private memory pool, and every later
capture on that stream records the same workspace address in its GEMMs. When a new shape overflows the cache,
lru_cache drops the least recently used entry and its ``CUDAGraph`` is destroyed (reset), which releases its
pool. If that entry was the first graph, the one that owns the workspace, the surviving graphs still point at
the freed workspace, and their next ``replay()`` faults. Eager execution and runs that never evict keep the
workspace alive.
Doctor: dangling-reference, at ``_capture_graph`` (its per-entry eviction destroys the graph whose pool owns the
workspace, and the surviving graphs' GEMMs then read and write memory that was released).
Fix (upstream): the lru_cache is replaced by a dict ``_cache``. On a miss with ``len(_cache) >= max_graphs``,
``replay`` calls ``_flush()``: ``torch.accelerator.synchronize``, ``reset()`` on every cached graph, then
``_cache.clear()``. The whole generation is retired together, so no live graph is left pointing at the freed
workspace. The next capture allocates a fresh workspace. (A first version of the PR also cleared the cuBLAS
workspace; review dropped that as unnecessary.)
Modelled: a three-GEMM DiT estimator (in_proj, one attention block over an attention cache, final_layer). Each
GEMM is split-K, with its partials written to the stream's workspace. ``CublasHandlePool`` is PyTorch's
per-(handle, stream) workspace map, reduced to one handle. A workspace allocated during a capture is owned by
that graph's pool, and ``release_pool`` (run by the graph's reset, as the caching allocator's ``releasePool``)
frees it, as the PR reports. Each capture gets its own pool (the per-graph pool the maintainer tried).
``max_graphs=3``, 3 Euler steps per chunk, chunk widths 16/32/48/64/32 frames. The caches are returned rather
than written into caller buffers.
"""
from __future__ import annotations

import contextlib

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, release_to_driver, own_segment_elems, replay

UPSTREAM = "https://github.com/vllm-project/vllm-omni/pull/6587"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "_capture_graph"
SYMPTOM = "streaming TTS: after a CFM graph is evicted, a surviving graph's replay hits an illegal memory access"

D, ATT, N_STEPS, MAX_GRAPHS = 8, 4, 3, 3
CHUNKS = (16, 32, 48, 64, 32)              # mel frames per streamed chunk: the 64 overflows the cache
DEFAULT_CAPTURE_STREAM = "default_capture_stream"
_stream = ["default"]


@contextlib.contextmanager
def on_stream(name: str):
    prev, _stream[0] = _stream[0], name
    try:
        yield
    finally:
        _stream[0] = prev


class CublasHandlePool:
    """PyTorch's per-(handle, stream) cuBLAS workspace map (CublasHandlePool.cpp), one handle."""

    def __init__(self, device):
        self.device = device
        self.workspaces: dict[str, torch.Tensor] = {}
        self.capturing: dict[str, object] = {}       # stream -> mempool id of the capture under way on it
        self.owner: dict[str, object] = {}           # stream -> mempool id its workspace was allocated from

    def workspace(self) -> torch.Tensor:
        stream = _stream[0]
        if stream not in self.workspaces:            # lazily, at first use on this stream
            elems = max(own_segment_elems(self.device), 2 * max(CHUNKS) * D)
            self.workspaces[stream] = torch.zeros(elems, device=self.device)
            if stream in self.capturing:
                self.owner[stream] = self.capturing[stream]
        return self.workspaces[stream]

    def release_pool(self, mempool_id) -> None:
        """CUDACachingAllocator::releasePool: memory the graph's capture allocated goes with its pool."""
        for stream, owner in list(self.owner.items()):
            if owner is mempool_id:
                del self.owner[stream], self.workspaces[stream]


HANDLES: CublasHandlePool | None = None


def cublas_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Split-K GEMM: the two K-halves' partial products go through the stream's workspace."""
    ws, k = HANDLES.workspace(), a.shape[1] // 2
    parts = ws[: 2 * a.shape[0] * b.shape[1]].view(2, a.shape[0], b.shape[1])
    torch.matmul(a[:, :k], b[:k], out=parts[0])
    torch.matmul(a[:, k:], b[k:], out=parts[1])
    return parts.sum(0)


class CFMEstimator:
    """blocks_forward_chunk: in_proj -> DiT block (attention over [cache | chunk]) -> final_layer."""

    def __init__(self, device):
        gen = generator(6587)
        self.w_in, self.w_qk, self.w_out = (randn(D, D, gen=gen, device=device, scale=0.4) for _ in range(3))
        self.w_cnn = randn(D, gen=gen, device=device, scale=0.3)

    def blocks_forward_chunk(self, x, time_emb, cnn_cache, att_cache):
        h = cublas_gemm(x, self.w_in) + time_emb + cnn_cache * self.w_cnn
        kv = torch.cat([att_cache, h], 0)
        p = torch.softmax(cublas_gemm(h, self.w_qk) @ kv.T / D ** 0.5, -1)
        h = h + p @ kv
        return cublas_gemm(torch.tanh(h), self.w_out), h[-1:].clone(), h[-ATT:].clone()


def _signature(t):
    return tuple(t.shape), str(t.dtype), str(t.device)


class CFMGraphWrapper:
    """Per-shape CUDA graph capture/replay for the CFM DiT estimator; the Euler loop replays it per step."""

    def __init__(self, estimator, device, variant, *, max_graphs=MAX_GRAPHS):
        self.graph_fn, self.device, self.variant, self.max_graphs = estimator.blocks_forward_chunk, device, variant, max_graphs
        self._lru: dict[tuple, tuple] = {}           # bug: functools.lru_cache(maxsize=max_graphs) on _capture_graph
        self._cache: dict[tuple, tuple] = {}         # fix: one generation of graphs
        self._warmup_streams = 0

    def _capture(self, key, inputs):
        static_inputs = tuple(t.clone() for t in inputs)
        self._warmup_streams += 1
        with on_stream(f"warmup_stream {self._warmup_streams}"), events.warmup():   # torch.cuda.Stream()
            for _ in range(3):
                self.graph_fn(*static_inputs)
        mempool_id = HANDLES.capturing[DEFAULT_CAPTURE_STREAM] = object()     # a private pool per capture
        with on_stream(DEFAULT_CAPTURE_STREAM):
            g, static_output = capture(lambda: self.graph_fn(*static_inputs), device=self.device, warmups=0,
                                       name=f"CFM estimator {key[1][0][0]} frames", owner="CFMGraphWrapper",
                                       static=dict(zip(("estimator_input", "time_emb", "cnn_cache", "att_cache"),
                                                       static_inputs)))
        del HANDLES.capturing[DEFAULT_CAPTURE_STREAM]
        return static_inputs, static_output, g, mempool_id

    def _destroy(self, entry) -> None:
        """~CUDAGraph(): reset() releases the graph's private pool."""
        entry[2].reset()
        HANDLES.release_pool(entry[3])

    def _capture_graph(self, key, inputs):
        """The bug: ``lru_cache(maxsize=max_graphs)`` evicts one entry at a time."""
        if key in self._lru:
            self._lru[key] = self._lru.pop(key)       # most recently used
            return self._lru[key]
        if len(self._lru) >= self.max_graphs:
            evicted = self._lru.pop(next(iter(self._lru)))
            self._destroy(evicted)                    # its pool held the capture stream's workspace
            release_to_driver(self.device)
        self._lru[key] = self._capture(key, inputs)
        return self._lru[key]

    def _flush(self) -> None:
        """The fix: retire every captured graph at once."""
        if not self._cache:
            return
        for entry in self._cache.values():
            self._destroy(entry)
        self._cache.clear()
        release_to_driver(self.device)

    def replay(self, estimator_input, time_emb, cnn_cache, att_cache):
        inputs = (estimator_input, time_emb, cnn_cache, att_cache)
        key = ("estimator_step",) + tuple(_signature(v) for v in inputs)
        if self.variant == "bug":
            entry = self._capture_graph(key, inputs)
        else:
            entry = self._cache.get(key)
            if entry is None:
                if len(self._cache) >= self.max_graphs:
                    self._flush()
                entry = self._cache[key] = self._capture(key, inputs)
        static_inputs, static_output, g, _ = entry
        for static, current in zip(static_inputs, inputs):
            static.copy_(current)
        return tuple(o.clone() for o in replay(g, static_output))


def solve_euler(estimate, x, cnn_cache, att_cache, time_embs):
    """CausalConditionalCFM.solve_euler: N_STEPS Euler steps; the caches of the last step carry on."""
    dt = 1.0 / N_STEPS
    for step in range(N_STEPS):
        v, cnn_out, att_out = estimate(x, time_embs[step], cnn_cache, att_cache)
        x = x + dt * v
    return x, cnn_out, att_out


def run(variant: str, device: str = "cpu"):
    global HANDLES
    estimator = CFMEstimator(device)
    gen = generator(65870)
    noise = [randn(n, D, gen=gen, device=device) for n in CHUNKS]
    time_embs = randn(N_STEPS, 1, D, gen=gen, device=device, scale=0.5)
    cnn0, att0 = randn(1, D, gen=gen, device=device), randn(ATT, D, gen=gen, device=device)

    def serve(graphed: bool):
        global HANDLES
        HANDLES = CublasHandlePool(device)
        wrapper = CFMGraphWrapper(estimator, device, variant)
        estimate = wrapper.replay if graphed else estimator.blocks_forward_chunk
        cnn_cache, att_cache, mels = cnn0, att0, []
        for x in noise:                                # one streamed TTS chunk each
            mel, cnn_cache, att_cache = solve_euler(estimate, x, cnn_cache, att_cache, time_embs)
            mels.append(mel)
        return mels

    out = compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
    HANDLES = None
    return out
