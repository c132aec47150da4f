"""AITER's opus split-K workspace was cached per CPU thread: under two-batch overlap the second thread's first split-K GEMM comes inside its graph capture and trips the grow guard.

Upstream: https://github.com/ROCm/aiter/pull/3516 ("opus_gemm splitk: per-stream workspace ownership for TBO",
demonsan, merged 2026-06-04 as a143edd5d446). The same commit adds ``aiter.opus_gemm_workspace_init()`` and a
"Splitk workspace and TBO" section to ``csrc/opus_gemm/README.md``. No user issue is linked.
Symptom: on ROCm, when vLLM/SGLang-style two-batch overlap (TBO) is on, HIP graph capture aborts the process as
soon as a tuned GEMM shape routes to the opus a16w16 split-K kernels (kids 200..299): ``AITER_CHECK`` fails with
"splitk workspace grow inside HIP graph capture is not supported (hipMalloc / hipFree are stream-capture-illegal).
Warm the cache once eagerly with the largest workspace before capturing." Eager mode and single-thread capture are
fine.
Mechanism: the split-K main kernel writes per-split fp32 partials into a scratch buffer, and
``splitk_reduce_kernel`` folds them into Y. The buffer is reached through a host-coherent
``opus_splitk_ws_handle`` slot, which the captured graph bakes. Before the fix, each generated split-K launcher
(``csrc/opus_gemm/gen_instances.py``, the body of ``{k.name}``; for kid 200 that is
``opus_gemm_flatmm_splitk_256x64x64x64_2x1_16x16x32_0x0x0_wgpcu2``) held its slot in a
``static thread_local opus_splitk_ws_handle* ws_handle_``. That slot is created lazily (``hipHostMalloc``) with
``ptr == nullptr`` on a thread's first call. When ``ptr == nullptr || ws_bytes > bytes``, the launcher grows the
buffer (``hipMalloc``, and ``hipDeviceSynchronize`` + ``hipFree`` of the old one), but only after checking
``hipStreamIsCapturing`` and failing the ``AITER_CHECK`` inside a capture. So a launcher warmed on one CPU thread
is cold on every other thread. Under TBO, two CPU threads drive the two micro-batch streams. The eager warmup ran
on the runner's thread, with each micro-batch's stream current, and grew that thread's slot. Micro-batch 1's graph
is then captured by the second thread, whose slot is fresh: its first split-K GEMM is inside the capture, the grow
guard trips, and the process aborts. Eagerly, each thread's first call simply allocates, so nothing goes wrong.
Doctor: sync-in-capture, at opus_gemm_flatmm_splitk_256x64x64x64_2x1_16x16x32_0x0x0_wgpcu2. The capture reaches
the launcher's lazy workspace creation and grow: a ``hipHostMalloc``, a ``hipMalloc`` and, on a later grow, a
``hipDeviceSynchronize`` + ``hipFree``. A capturing stream forbids all of them, so AITER refuses and the capture
dies. Eager never meets it. The bug lives in that launcher, whose workspace cache was keyed by CPU thread instead
of by the stream being captured, and that is where the fix changed code.
Fix (upstream): the launcher asks ``opus_splitk_ws_get(stream, /*allow_create=*/!capturing)`` (``opus_gemm.cu``).
That is a process-global, mutex-protected registry keyed by ``hipStream_t``: a missing entry is lazily created
eagerly, and a lookup during capture only looks up. The warmup on micro-batch 1's stream therefore created and grew
the slot that the second thread's capture finds. Each stream's graph bakes its own slot, so concurrent replays
write disjoint scratch. ``aiter.opus_gemm_workspace_init()`` lets a framework register a stream eagerly; it is not
needed here, because the warmup already ran on both streams.
Modelled: a decoder MLP (embedding -> up GEMM -> SiLU -> down GEMM -> residual), float32 instead of bf16. Both
GEMMs go through ``gemm_a16w16_opus``, whose tuned CSV routes them to kid 200 with splitK 2 (64x64 tiles, K split
in two halves). The 4 MiB grow alignment is kept (a float32 tensor). The TBO runner is schematic, following the
commit message and the README's "Framework usage". It has two micro-batch streams. The runner's thread drives
micro-batch 0, and a persistent worker thread drives micro-batch 1; they take turns through ``threading.Event``
hand-offs, so the order is fixed. The eager warmup of both micro-batches runs on the runner's thread, then micro-
batch 0's graph is captured there and micro-batch 1's on the worker, one after the other (capture sizes 4 and 2
tokens, largest first). An ``AITER_CHECK`` failure on the worker is re-raised on the runner's thread, which is
where the abort is seen. On CUDA the streams are real; the captured block forks the micro-batch stream into the
capture and joins it back, which is what ``torch.cuda.graph(..., stream=s)`` does. The CPU engine has no streams,
so there a stream is a Python identity and torch's per-thread current stream is a thread-local stack. Left out:
the other kernel families, the K-tail clamp, bias, the README's other failure mode (one slot shared by two
concurrently replaying streams), and comm kernels.
"""
from __future__ import annotations

import contextlib
import itertools
import threading

import torch

from workbench.engine import events, synchronize
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/ROCm/aiter/pull/3516"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "opus_gemm_flatmm_splitk_256x64x64x64_2x1_16x16x32_0x0x0_wgpcu2"
SYMPTOM = ("HIP graph capture aborts under two-batch overlap: [AITER] splitk workspace grow inside HIP graph "
           "capture is not supported (the second TBO thread's thread_local split-K workspace slot was never warmed)")

VOCAB, HIDDEN, INTER = 48, 16, 32
CAPTURE_SIZES = [2, 4]                  # total tokens; two micro-batches of half each
NUM_UBATCHES = 2
SERVE_STEPS = (4, 2, 4, 2)
KID, SPLIT_K = 200, 2                   # the tuned winner for every GEMM shape of this model
B_M, B_N = 64, 64                       # kid 200's tile
K_GROW_ALIGN = 4 * 1024 * 1024          # bytes
FLOAT_BYTES = 4
VARIANT = {"v": "bug"}
_ON_CUDA = [False]


# --- torch.cuda streams: real on CUDA; on the CPU engine only their identity (per thread) is modelled ----------

class _CPUStream:
    _ids = itertools.count()

    def __init__(self, name: str):
        self.name = f"{name} #{next(self._ids)}"

    def wait_stream(self, other) -> None:       # the CPU engine runs every op in program order
        pass

    def __repr__(self) -> str:
        return f"<stream {self.name}>"


_CPU_DEFAULT_STREAM = _CPUStream("default stream")
_cpu_current = threading.local()                # torch's current stream is per CPU thread


def _cpu_stack() -> list:
    if not hasattr(_cpu_current, "stack"):
        _cpu_current.stack = [_CPU_DEFAULT_STREAM]
    return _cpu_current.stack


def torch_cuda_current_stream():
    return torch.cuda.current_stream() if _ON_CUDA[0] else _cpu_stack()[-1]


def torch_cuda_Stream(device, name: str):
    return torch.cuda.Stream(device=device) if _ON_CUDA[0] else _CPUStream(name)


@contextlib.contextmanager
def torch_cuda_stream(stream):
    if _ON_CUDA[0]:
        with torch.cuda.stream(stream):
            yield
        return
    _cpu_stack().append(stream)
    try:
        yield
    finally:
        _cpu_stack().pop()


@contextlib.contextmanager
def captured_on(stream):
    """The captured block runs on ``stream``, as ``torch.cuda.graph(g, stream=stream)`` makes it. On CUDA the
    engine's capture stream is forked into ``stream`` and joined back. On the CPU, ``stream`` becomes current."""
    if not _ON_CUDA[0]:
        with torch_cuda_stream(stream):
            yield
        return
    capture_stream = torch.cuda.current_stream()
    stream.wait_stream(capture_stream)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        capture_stream.wait_stream(stream)          # joined back even when the block raised


# --- aiter: the opus split-K workspace (csrc/opus_gemm/gen_instances.py launcher, opus_gemm.cu) ----------------

class opus_splitk_ws_handle:
    """The host-coherent slot: the main and the reduce kernel dereference ``ptr`` at launch (graphs bake the slot)."""

    def __init__(self):
        self.ptr: torch.Tensor | None = None
        self.bytes = 0


def getCurrentHIPStream():
    return torch_cuda_current_stream()


def hipStreamIsCapturing(stream) -> bool:
    return torch.cuda.is_current_stream_capturing()      # ``stream`` is the calling thread's current stream


def _hip_stream_t(stream):
    return stream.cuda_stream if _ON_CUDA[0] else stream


class _SplitkWsRegistry:
    """#3516: the process-global registry, ``std::unordered_map<hipStream_t, opus_splitk_ws_handle*>``."""

    def __init__(self):
        self.mu = threading.Lock()
        self.map: dict = {}


_registry = [_SplitkWsRegistry()]
# before #3516: ``static thread_local opus_splitk_ws_handle* ws_handle_`` in the generated launcher
_launcher_thread_local = [threading.local()]


def opus_splitk_ws_get(s, allow_create: bool) -> opus_splitk_ws_handle:
    R = _registry[0]
    with R.mu:
        key = _hip_stream_t(s)
        if key in R.map:
            return R.map[key]
        if not allow_create:
            raise RuntimeError(
                "[AITER] splitk workspace not initialized for the current CUDA stream. Call "
                "aiter.opus_gemm_workspace_init() inside `with torch.cuda.stream(s):` (and warm with the largest "
                "expected gemm) before HIP graph capture.")
        h = opus_splitk_ws_handle()                # hipHostMalloc(hipHostMallocCoherent)
        R.map[key] = h
        return h


def opus_gemm_flatmm_splitk_256x64x64x64_2x1_16x16x32_0x0x0_wgpcu2(XQ, WQ, Y, bias, splitK, device):
    """The generated a16w16 flatmm split-K launcher of kid 200 (``{k.name}`` in gen_instances.py)."""
    batch, M, K = XQ.shape
    N = WQ.shape[1]
    split_k = 1 if splitK <= 1 else splitK
    num_tiles_m, num_tiles_n = -(-M // B_M), -(-N // B_N)
    padded_M, padded_N = num_tiles_m * B_M, num_tiles_n * B_N

    stream = getCurrentHIPStream()
    if VARIANT["v"] == "fix":
        capturing = hipStreamIsCapturing(stream)
        ws_handle_ = opus_splitk_ws_get(stream, allow_create=not capturing)
    else:
        tls = _launcher_thread_local[0]
        if not hasattr(tls, "ws_handle_"):        # static thread_local ... = []() { hipHostMalloc(&h, ...); ... }();
            tls.ws_handle_ = opus_splitk_ws_handle()
        ws_handle_ = tls.ws_handle_
    ws_bytes = split_k * batch * padded_M * padded_N * FLOAT_BYTES
    if ws_handle_.ptr is None or ws_bytes > ws_handle_.bytes:
        capturing = hipStreamIsCapturing(stream)
        if capturing:                              # AITER_CHECK(capture_status == hipStreamCaptureStatusNone, ...)
            raise RuntimeError(
                "[AITER] splitk workspace grow inside HIP graph capture is not supported (hipMalloc / hipFree are "
                "stream-capture-illegal). Warm the cache once eagerly with the largest workspace before capturing.")
        grow_bytes = -(-ws_bytes // K_GROW_ALIGN) * K_GROW_ALIGN
        new_ptr = torch.empty(grow_bytes // FLOAT_BYTES, dtype=torch.float32, device=device)     # hipMalloc
        if ws_handle_.ptr is not None:
            synchronize(device)                    # hipDeviceSynchronize(); hipFree(old)
        ws_handle_.ptr, ws_handle_.bytes = new_ptr, grow_bytes

    ws = ws_handle_.ptr[: ws_bytes // FLOAT_BYTES].view(batch, split_k, padded_M, padded_N)
    chunk = K // split_k
    for s in range(split_k):                       # main kernel: K-slice s of every tile -> workspace split s
        ks = slice(s * chunk, (s + 1) * chunk)
        torch.matmul(XQ[:, :, ks], WQ[:, :, ks].transpose(1, 2), out=ws[:, s, :M, :N])
    Y.copy_(ws[:, :, :M, :N].sum(1))               # splitk_reduce_kernel
    return Y


def opus_gemm_a16w16_tune(XQ, WQ, Y, bias, kernelId, splitK):
    assert kernelId == KID
    return opus_gemm_flatmm_splitk_256x64x64x64_2x1_16x16x32_0x0x0_wgpcu2(XQ, WQ, Y, bias, splitK, XQ.device)


def lookup_tuned(M, N, K):
    """``_opus_common.lookup_tuned``: the opus-private tuned CSV (every shape here: kid 200, splitK 2)."""
    return {"solidx": KID, "splitK": SPLIT_K}


def gemm_a16w16_opus(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """aiter/ops/opus/gemm_op_a16w16.py: A [M, K], B [N, K] -> [M, N]."""
    XQ, WQ = A.unsqueeze(0), B.unsqueeze(0)
    M, K, N = A.shape[0], A.shape[1], B.shape[0]
    Y = torch.empty(1, M, N, dtype=A.dtype, device=A.device)
    cfg = lookup_tuned(M, N, K)
    opus_gemm_a16w16_tune(XQ, WQ, Y, None, cfg["solidx"], int(cfg["splitK"]))
    return Y.squeeze(0)


# --- the model ----------------------------------------------------------------------------------------------------

class DecoderMLP:
    def __init__(self, device):
        gen = generator(3516)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.up_proj = randn(INTER, HIDDEN, gen=gen, device=device, scale=HIDDEN ** -0.5)
        self.down_proj = randn(HIDDEN, INTER, gen=gen, device=device, scale=INTER ** -0.5)

    def __call__(self, input_ids):
        hidden = self.embed_tokens[input_ids]
        h = torch.nn.functional.silu(gemm_a16w16_opus(hidden, self.up_proj))
        return hidden + gemm_a16w16_opus(h, self.down_proj)


# --- the TBO runner (schematic): two CPU threads drive two micro-batch streams ------------------------------------

class MicroBatchThread:
    """The CPU thread that drives micro-batch 1. It runs one job per hand-off: the runner sets ``cpu_wait_event``
    and waits on ``cpu_signal_event``, so the two threads never run at the same time."""

    def __init__(self, name: str):
        self.cpu_wait_event = threading.Event()
        self.cpu_signal_event = threading.Event()
        self._job = None
        self._result = self._error = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            self.cpu_wait_event.wait()
            self.cpu_wait_event.clear()
            job = self._job
            if job is None:
                self.cpu_signal_event.set()
                return
            try:
                self._result = job()
            except BaseException as e:  # noqa: BLE001 - an AITER_CHECK failure aborts the process: handed back
                self._error = e
            self.cpu_signal_event.set()

    def run(self, job):
        self._job, self._result, self._error = job, None, None
        self.cpu_signal_event.clear()
        self.cpu_wait_event.set()
        self.cpu_signal_event.wait()
        if self._error is not None:
            raise self._error
        return self._result

    def shutdown(self) -> None:
        self._job = None
        self.cpu_signal_event.clear()
        self.cpu_wait_event.set()
        self.cpu_signal_event.wait()
        self._thread.join()


class TboCudaGraphRunner:
    def __init__(self, model, device, cuda_graph: bool):
        self.model, self.device, self.cuda_graph = model, device, cuda_graph
        self.streams = [torch_cuda_Stream(device, f"micro-batch {i} stream") for i in range(NUM_UBATCHES)]
        self.worker = MicroBatchThread("tbo micro-batch 1")
        half = max(CAPTURE_SIZES) // NUM_UBATCHES
        self.input_ids = [torch.zeros(half, dtype=torch.long, device=device) for _ in range(NUM_UBATCHES)]
        self.graphs: dict = {}
        self.outputs: dict = {}

    def _on_thread(self, i, job):
        """Micro-batch ``i``'s work on the thread that drives its stream (0: this thread, 1: the worker)."""
        return job() if i == 0 else self.worker.run(job)

    # capture -----------------------------------------------------------------------------------------------------
    def _warmup(self, bs: int) -> None:
        """The eager warmup of both micro-batches, on the runner's thread, each on its own stream."""
        half = bs // NUM_UBATCHES
        with events.warmup():
            for i in range(NUM_UBATCHES):
                with torch_cuda_stream(self.streams[i]):
                    self.model(self.input_ids[i][:half])
        synchronize(self.device)

    def _capture_ubatch(self, i: int, bs: int):
        half = bs // NUM_UBATCHES
        stream = self.streams[i]
        ids = self.input_ids[i][:half]

        def forward():
            with captured_on(stream):
                return self.model(ids)

        return capture(forward, device=self.device, warmups=0, name=f"tbo bs={bs} micro-batch {i}",
                       static={f"input_ids[{i}]": ids}, owner="TboCudaGraphRunner")

    def capture(self) -> None:
        for bs in sorted(CAPTURE_SIZES, reverse=True):
            self._warmup(bs)
            for i in range(NUM_UBATCHES):
                graph, out = self._on_thread(i, lambda i=i: self._capture_ubatch(i, bs))
                self.graphs[(bs, i)], self.outputs[(bs, i)] = graph, out

    # serving -----------------------------------------------------------------------------------------------------
    def execute(self, input_ids: torch.Tensor) -> torch.Tensor:
        bs = input_ids.shape[0]
        half = bs // NUM_UBATCHES
        origin = torch_cuda_current_stream()
        for i in range(NUM_UBATCHES):
            self.input_ids[i][:half].copy_(input_ids[i * half:(i + 1) * half])

        def ubatch(i):
            with torch_cuda_stream(self.streams[i]):
                self.streams[i].wait_stream(origin)
                if self.cuda_graph:
                    return replay(self.graphs[(bs, i)], self.outputs[(bs, i)]).clone()
                return self.model(self.input_ids[i][:half])

        outs = [self._on_thread(i, lambda i=i: ubatch(i)) for i in range(NUM_UBATCHES)]
        for s in self.streams:
            origin.wait_stream(s)
        return torch.cat(outs, dim=0)


def serve_steps(device):
    gen = generator(35160)
    return [torch.randint(0, VOCAB, (n,), generator=gen).to(device) for n in SERVE_STEPS]


def run(variant: str, device: str = "cpu"):
    VARIANT["v"] = variant
    _ON_CUDA[0] = torch.device(device).type == "cuda"
    model = DecoderMLP(device)
    steps = serve_steps(device)

    def serve(cuda_graph: bool):
        _registry[0] = _SplitkWsRegistry()                # a fresh process: no stream registered,
        _launcher_thread_local[0] = threading.local()     # no thread's slot created
        runner = TboCudaGraphRunner(model, device, cuda_graph)
        try:
            if cuda_graph:
                runner.capture()
            return [runner.execute(ids) for ids in steps]
        finally:
            runner.worker.shutdown()

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
