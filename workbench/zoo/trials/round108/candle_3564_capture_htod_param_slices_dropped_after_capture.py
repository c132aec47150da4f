"""candle's CUDA backend under mistral.rs decode graphs: every strided kernel uploads its dims/strides with
``clone_htod`` from a temporary host vector; captured, that upload is a memcpy node that keeps the host vector's
address, and the vector is gone as soon as the op returns, so every replay copies from released host memory.

Upstream: https://github.com/huggingface/candle/pull/3564 ("Add htod cache for cuda graphs", huggingface/candle, by
Eric Buehler (EricLBuehler), merged 2026-05-24 as commit cabbc30191b352814d8bb94e821e82faa883c7b5).
Read: the commit's diff of ``candle-core/src/cuda_backend/device.rs`` (``CUDA_GRAPH_HTOD_CACHE`` /
``CUDA_GRAPH_HTOD_CACHE_DEPTH`` thread-locals, ``CudaGraphHtodCacheGuard``, ``enable_cuda_graph_htod_cache``,
``memcpy_htod`` / ``clone_htod`` routed to ``memcpy_htod_capture_cached`` / ``clone_htod_capture_cached`` while the
guard is held, ``cached_htod_slice`` (4096-byte limit, key ``(DeviceId, TypeId, bytes)``, "CUDA graph capture missing
cached host data" on a miss while capturing), ``cuda_graph_capture_active``); at the parent commit,
``candle-core/src/cuda_backend/mod.rs``: ``SlicePtrOrNull::params_from_layout`` (``clone_htod(&[l.dims(),
l.stride()].concat())`` for a non-contiguous layout), the unary ``Map1`` and binary ``Map2`` launchers
(``dims_and_strides`` uploaded only when an operand is strided, passed to the kernel, dropped on return). In
mistral.rs (EricLBuehler/mistral.rs at 9e922623f): ``NormalPipeline::capture_cuda_decode_graph_step`` ("Runs the
padded step eagerly as the live forward, then captures the same step into a graph", the guard taken before both) and
``capture_cuda_decode_graph`` (``begin_capture(CU_STREAM_CAPTURE_MODE_RELAXED)``, the forward on the graph's
``input_ids``, ``end_capture``, the warm-up logits returned for the capture step). The earlier, unmerged attempt at
the same lifetime problem (candle#3352, "Introduce capture pool for cuda graph replay") describes the failure.
Symptom: decode with CUDA graphs on replays kernels whose dims/strides come from host vectors freed right after
capture: crashes or segfaults on replay, or garbage once the host memory is reused; eager decoding is fine.
Mechanism: a strided candle op builds ``[dims, strides].concat()`` on the host and ``clone_htod``s it into a fresh
device slice. Eagerly the copy runs at once. Captured, the copy becomes a graph node that re-reads the host
address at every replay, but the ``Vec`` is dropped when the op returns (and the device slice with it), so the
replayed kernels read dims and strides from host memory that no longer belongs to them.
Doctor: dangling-reference, at clone_htod. The captured host-to-device upload of the kernel parameters reads a host
buffer that ``clone_htod``'s caller releases as soon as the op returns; the fix makes ``clone_htod`` hand out
device slices that a cache keeps alive instead.
Fix (upstream): while mistral.rs holds ``enable_cuda_graph_htod_cache()`` (the eager warm-up and the capture),
``clone_htod`` of up to 4096 bytes returns a device slice cached by content; the warm-up fills the cache, the
capture only looks slices up (no host upload is captured), and the cache keeps them alive for every replay.
Modelled: ``CudaDevice.clone_htod`` / ``clone_htod_capture_cached`` / ``cached_htod_slice`` /
``enable_cuda_graph_htod_cache`` / ``cuda_graph_capture_active`` as read, ``params_from_layout`` and the unary /
binary launchers (a flat storage plus a ``Layout``; the strided kernels unravel each element's index with the
uploaded dims and strides, on the device), and mistral.rs's decode graph step (eager warm-up as the live step,
relaxed-mode capture on a static ``input_ids``, replay of later steps of the same batch bucket). Stand-ins: the Rust
heap is a pinned host arena with first-fit reuse (``HostHeap``: the ``Vec<usize>`` is a block of it, freed when
``clone_htod`` returns, and the next ``Vec`` takes the same block, as malloc does); cudarc's upload is a ``copy_``
from that block, complete on return eagerly (blocking) and a memcpy node by address when captured
(non-blocking); a two-layer MLP-like decoder with a transposed SiLU and a broadcast bias (the strided ops), no
attention or KV cache; float64 activations.
Workload: batch buckets 2 and 3. Steps [3, 5] (bucket 2: warm-up + capture), [7, 1] and [2, 9] (replays), [4, 6, 2]
(bucket 3: warm-up + capture), [8, 0, 11] (replay). Bug: the warm-up steps equal eager, every replay is wrong (max
errors 1.40, 4.81 and 2.72 on the three replays; 4.81 overall): all captured uploads re-read the same freed host
block, which holds what the capture's last upload wrote there (the broadcast multiply's six dims/strides), so the
transposed SiLU reads its input with the multiply's dims and strides. Fix: the warm-up fills the cache, the capture
records no upload, and the five steps' logits equal eager (max error 0).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math

import torch

from workbench.engine import events, graph_pool_handle, host, is_capturing
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/huggingface/candle/pull/3564"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "clone_htod"
SYMPTOM = ("decode CUDA graphs replay strided kernels whose dims/strides upload reads a host vector freed right "
           "after capture: crashes on replay, or garbage once that host memory is reused")

VOCAB, HIDDEN, N_LAYERS = 16, 6, 2
DTYPE = torch.float64
CUDA_GRAPH_HTOD_CACHE_MAX_BYTES = 4096

_variant = "bug"


# --- candle-core/src/cuda_backend/device.rs ---------------------------------------------------------------------------

class HostHeap:
    """Stand-in for the Rust heap that ``[dims, strides].concat()`` allocates from: first fit, so a freed block
    goes to the next allocation, as malloc's does. Pinned, so that a captured copy may read it by address."""

    def __init__(self, device: str, size: int = 256):
        self.mem = host(torch.zeros(size, dtype=torch.int64), device)
        self.live: dict[int, int] = {}                                          # start -> length

    def malloc(self, values: list[int]) -> torch.Tensor:
        start = 0
        for s, n in sorted(self.live.items()):
            if start + len(values) <= s:
                break
            start = max(start, s + n)
        self.live[start] = len(values)
        block = self.mem[start:start + len(values)]
        block[:] = torch.tensor(values, dtype=torch.int64)                       # host work: not recorded
        return block

    def free(self, block: torch.Tensor) -> None:
        del self.live[block.storage_offset()]


HOST_HEAP: HostHeap = None                # set by run()
CUDA_GRAPH_HTOD_CACHE: dict = {}          # thread_local! in candle
CUDA_GRAPH_HTOD_CACHE_DEPTH = [0]


def cuda_graph_htod_cache_enabled() -> bool:
    return CUDA_GRAPH_HTOD_CACHE_DEPTH[0] > 0


class CudaDevice:
    def __init__(self, device_id: int, device: str):
        self.id, self.device = device_id, device

    @contextlib.contextmanager
    def enable_cuda_graph_htod_cache(self):
        """``CudaGraphHtodCacheGuard``: the cache is on while the guard lives."""
        CUDA_GRAPH_HTOD_CACHE_DEPTH[0] += 1
        try:
            yield
        finally:
            CUDA_GRAPH_HTOD_CACHE_DEPTH[0] = max(CUDA_GRAPH_HTOD_CACHE_DEPTH[0] - 1, 0)

    def _stream_clone_htod(self, src: list[int]) -> torch.Tensor:
        """cudarc ``stream.clone_htod``: a device slice and an upload from the caller's host slice. Eagerly the
        upload is done when it returns; captured, it is a memcpy node that keeps the host address."""
        host_vec = HOST_HEAP.malloc(src)                                       # the temporary Vec<usize>
        dst = torch.empty(len(src), dtype=torch.int64, device=self.device)
        dst.copy_(host_vec, non_blocking=self.cuda_graph_capture_active())
        HOST_HEAP.free(host_vec)                                                # the Vec is dropped here
        return dst

    def clone_htod(self, src: list[int]) -> torch.Tensor:
        if _variant == "fix" and cuda_graph_htod_cache_enabled() and len(src) > 0:
            return self.clone_htod_capture_cached(src)
        return self._stream_clone_htod(src)

    def clone_htod_capture_cached(self, src: list[int]) -> torch.Tensor:
        cached = self.cached_htod_slice(src)
        if cached is not None:
            return cached
        return self._stream_clone_htod(src)

    def cached_htod_slice(self, src: list[int]):
        byte_len = 8 * len(src)
        if byte_len > CUDA_GRAPH_HTOD_CACHE_MAX_BYTES:
            if self.cuda_graph_capture_active():
                raise RuntimeError("CUDA graph capture cannot upload uncached host data")
            return None
        key = (self.id, torch.int64, tuple(src))
        if key in CUDA_GRAPH_HTOD_CACHE:
            return CUDA_GRAPH_HTOD_CACHE[key]
        if self.cuda_graph_capture_active():
            raise RuntimeError("CUDA graph capture missing cached host data")
        cached = self._stream_clone_htod(src)
        CUDA_GRAPH_HTOD_CACHE[key] = cached
        return cached

    def cuda_graph_capture_active(self) -> bool:
        return is_capturing()


# --- candle-core/src/layout.rs, cuda_backend/mod.rs (reduced) ---------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Layout:
    shape: tuple
    stride: tuple
    start_offset: int = 0

    @staticmethod
    def contiguous(shape):
        stride, acc = [], 1
        for d in reversed(shape):
            stride.append(acc)
            acc *= d
        return Layout(tuple(shape), tuple(reversed(stride)))

    def dims(self):
        return list(self.shape)

    def elem_count(self):
        return math.prod(self.shape)

    def is_contiguous(self):
        return self == Layout(self.shape, Layout.contiguous(self.shape).stride, self.start_offset)

    def t(self):
        return Layout(self.shape[::-1], self.stride[::-1], self.start_offset)

    def broadcast_as(self, shape):
        pad = len(shape) - len(self.shape)
        stride = [0] * pad + [0 if s == 1 and d != 1 else st
                              for s, st, d in zip(self.shape, self.stride, shape[pad:])]
        return Layout(tuple(shape), tuple(stride), self.start_offset)


class Tensor:
    """A candle tensor: a flat device storage plus a layout."""

    def __init__(self, storage: torch.Tensor, layout: Layout, dev: CudaDevice):
        self.storage, self.layout, self.dev = storage, layout, dev

    @staticmethod
    def from_torch(t: torch.Tensor, dev: CudaDevice):
        return Tensor(t.reshape(-1), Layout.contiguous(tuple(t.shape)), dev)

    def t(self):
        return Tensor(self.storage, self.layout.t(), self.dev)

    def broadcast_as(self, shape):
        return Tensor(self.storage, self.layout.broadcast_as(shape), self.dev)

    def to_torch(self):
        assert self.layout.is_contiguous()
        n = self.layout.elem_count()
        return self.storage[self.layout.start_offset:self.layout.start_offset + n].view(self.layout.shape)


def params_from_layout(dev: CudaDevice, l: Layout):
    """``SlicePtrOrNull::params_from_layout``: dims and strides on the device, or null when contiguous."""
    return None if l.is_contiguous() else dev.clone_htod(l.dims() + list(l.stride))


def _strided_offsets(el_count, num_dims, info, stride_sets, device):
    """The kernels' ``get_strided_index``: unravel each element's index with the device-side dims/strides."""
    i = torch.arange(el_count, device=device)
    offsets = [torch.zeros_like(i) for _ in range(stride_sets)]
    for d in reversed(range(num_dims)):
        dim = info[d]
        idx = i % dim
        i = torch.div(i, dim, rounding_mode="floor")
        for k in range(stride_sets):
            offsets[k] = offsets[k] + idx * info[num_dims * (k + 1) + d]
    return offsets


UNARY = {"usilu": torch.nn.functional.silu}
BINARY = {"badd": torch.add, "bmul": torch.mul}


def unary_map(kernel: str, x: Tensor) -> Tensor:
    """``impl Map1 for U``: the unary kernel, given dims/strides when ``x`` is strided."""
    dev, layout = x.dev, x.layout
    el_count = layout.elem_count()
    ds = params_from_layout(dev, layout)
    src = x.storage[layout.start_offset:]
    if ds is None:
        out = UNARY[kernel](src[:el_count])
    else:
        (off,) = _strided_offsets(el_count, len(layout.shape), ds, 1, dev.device)
        out = UNARY[kernel](src[off])
    return Tensor(out, Layout.contiguous(layout.shape), dev)                    # ds dropped here


def binary_map(kernel: str, lhs: Tensor, rhs: Tensor) -> Tensor:
    """``impl Map2 for U``: ``dims_and_strides`` uploaded only when an operand is strided."""
    dev, lhs_l, rhs_l = lhs.dev, lhs.layout, rhs.layout
    dims = lhs_l.dims()
    elem_count = lhs_l.elem_count()
    if lhs_l.is_contiguous() and rhs_l.is_contiguous():
        dims_and_strides = None
    else:
        dims_and_strides = dev.clone_htod(dims + list(lhs_l.stride) + list(rhs_l.stride))
    a, b = lhs.storage[lhs_l.start_offset:], rhs.storage[rhs_l.start_offset:]
    if dims_and_strides is None:
        out = BINARY[kernel](a[:elem_count], b[:elem_count])
    else:
        lo, ro = _strided_offsets(elem_count, len(dims), dims_and_strides, 2, dev.device)
        out = BINARY[kernel](a[lo], b[ro])
    return Tensor(out, Layout.contiguous(tuple(dims)), dev)                     # dims_and_strides dropped here


def matmul(lhs: Tensor, rhs: Tensor) -> Tensor:
    out = lhs.to_torch() @ rhs.to_torch()                                        # cuBLAS gemm on contiguous operands
    return Tensor.from_torch(out, lhs.dev)


# --- the model (stand-in for a mistral.rs decoder) --------------------------------------------------------------------

class Model:
    def __init__(self, dev: CudaDevice):
        gen = generator(3564)
        r = lambda *s, scale=0.5: Tensor.from_torch(                              # noqa: E731
            randn(*s, gen=gen, device=dev.device, scale=scale).to(DTYPE), dev)
        self.dev = dev
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=dev.device).to(DTYPE)
        self.layers = [(r(HIDDEN, HIDDEN), r(HIDDEN, HIDDEN), r(1, HIDDEN)) for _ in range(N_LAYERS)]
        self.lm_head = r(HIDDEN, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        b = input_ids.shape[0]
        h = Tensor.from_torch(self.embed_tokens.index_select(0, input_ids), self.dev)
        for w_in, w_out, bias in self.layers:
            a = matmul(h, w_in)                                                   # (b, HIDDEN)
            g = unary_map("usilu", a.t())                                         # strided: (HIDDEN, b) view
            gated = binary_map("bmul", g.t(), bias.broadcast_as((b, HIDDEN)))    # strided lhs, broadcast rhs
            h = binary_map("badd", h, matmul(gated, w_out))
        return matmul(h, self.lm_head).to_torch()


# --- mistral.rs: pipeline/normal.rs, pipeline/cuda_graph.rs (reduced) -------------------------------------------------

class NormalPipeline:
    def __init__(self, device: str, use_cuda_graph: bool):
        self.device = device
        self.cuda_device = CudaDevice(0, device)
        self.model = Model(self.cuda_device)
        self.use_cuda_graph = use_cuda_graph
        self.graphs: dict[int, tuple] = {}
        self.pool = graph_pool_handle(device) if use_cuda_graph else None

    def _htod_cache_guard(self):
        return self.cuda_device.enable_cuda_graph_htod_cache() if _variant == "fix" else contextlib.nullcontext()

    def capture_cuda_decode_graph_step(self, key: int, ids: torch.Tensor) -> torch.Tensor:
        """Runs the padded step eagerly as the live forward, then captures the same step into a graph."""
        input_ids = ids.clone()                                                  # the graph's input Var
        with self._htod_cache_guard():
            with events.warmup():
                warmup_logits = self.model.forward(input_ids)
            g, logits = capture(lambda: self.model.forward(input_ids), device=self.device, pool=self.pool,
                                warmups=0, static={"input_ids": input_ids}, owner="NormalPipeline",
                                capture_error_mode="relaxed", name=f"decode bucket {key}")
        self.graphs[key] = (g, logits, input_ids)
        return warmup_logits.clone()

    def step(self, token_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor(token_ids, dtype=torch.int64).to(self.device)
        if not self.use_cuda_graph:
            return self.model.forward(ids).clone()
        key = len(token_ids)
        if key not in self.graphs:
            return self.capture_cuda_decode_graph_step(key, ids)
        g, logits, input_ids = self.graphs[key]
        input_ids.copy_(ids)                                                     # host staging -> graph input
        return replay(g, logits).clone()


def run(variant: str, device: str = "cpu"):
    global _variant, HOST_HEAP
    _variant = variant
    HOST_HEAP = HostHeap(device)
    CUDA_GRAPH_HTOD_CACHE.clear()
    CUDA_GRAPH_HTOD_CACHE_DEPTH[0] = 0
    steps = [[3, 5], [7, 1], [2, 9], [4, 6, 2], [8, 0, 11]]

    def serve(use_cuda_graph):
        pipeline = NormalPipeline(device, use_cuda_graph)
        return [pipeline.step(s) for s in steps]

    with torch.no_grad():
        try:
            return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
        finally:
            CUDA_GRAPH_HTOD_CACHE.clear()
