"""libcu++ resolves a default memory pool lazily and applies its retention policy with a pool-attribute read and write; when a process first touches the pool inside an open stream capture, the driver refuses the read (error 900) and the capture fails.

Upstream: https://github.com/NVIDIA/cccl/pull/11360 ("[libcu++] Make resolving a default memory pool legal under stream
capture", caugonnet, merged; review dated 2026-09-11). The policy step came from #6718 ("[libcu++] Automatically bump
up the release threshold of default mempools", merged 2025-11-20), and #10618 moved it after both lookup paths. The
bug surfaced through cudax STF's locality-domain data places (#11202), which resolve the default pool on their
allocation path.
Symptom: the first graph capture of a step that allocates from ``cuda::device_default_memory_pool(dev)`` throws
``cuda_error``: "operation not permitted when stream is capturing(900): Failed to get attribute for a memory pool".
The capture is invalidated and EndCapture fails. The same step runs correctly eagerly. It also captures correctly in
any process that used the pool once before capturing. No wrong numbers are produced, only a failed capture.
Mechanism: ``device_default_memory_pool()`` (and the managed and pinned-host accessors) cache their pool in a
function-local ``static``. They fill it on first use by calling ``cuda::__get_default_memory_pool``
(``libcudacxx/include/cuda/__memory_pool/memory_pool_base.h``). That function looks the pool up with
``__driver::__getDefaultMemPool``, which is legal under capture. Then, if
``memory_pool_attributes::release_threshold(__pool) == 0``, it calls ``release_threshold.set(__pool, SIZE_MAX)``.
These two calls are ``cuMemPoolGetAttribute`` and ``cuMemPoolSetAttribute``, which CUDA classes as "potentially
unsafe" during capture. A thread in global mode (the default) or thread-local mode that has an ongoing capture not
begun in relaxed mode is refused them with ``CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`` (900). The refusal invalidates
the capture. So if the process's first touch of the pool falls between BeginCapture and EndCapture, the attribute
read throws out of the accessor. The static stays empty and the capture is lost.
Doctor: sync-in-capture, at __get_default_memory_pool. A host-side driver call that an open capture forbids (a
memory-pool attribute read, refused with the same cudaErrorStreamCaptureUnsupported as a synchronisation) is
attempted on the capturing thread in global mode. The bug lives in ``__get_default_memory_pool``. That is where the
fix changed code: its policy step made that call with no regard for capture.
Fix (upstream): a new RAII ``__relaxed_capture_scope`` (``cuda/__stream/relaxed_capture_scope.h``). It calls
``cuThreadExchangeStreamCaptureMode`` to put the calling thread in relaxed mode, and restores the previous mode in
its destructor (``__threadExchangeStreamCaptureModeNoThrow``). ``__get_default_memory_pool`` opens this scope around
the release-threshold read and set, so the calls run immediately: they are not recorded and the capture stays valid.
A new test begins a capture in each of the global, thread-local and relaxed modes. It resolves the pool, allocates
and frees on the capturing stream, and requires a successful EndCapture with a non-empty graph. It then checks that
an unsafe pool query is again refused afterwards, which shows the thread's mode was restored. The pre-fix
``__get_default_memory_pool``, the post-fix ``relaxed_capture_scope.h`` and the new test were read in the code index.
Modelled: the driver is a small Python stand-in for the calls involved. ``__getDefaultMemPool`` returns a per-process
pool whose release threshold starts at 0. ``cuMemPoolGet/SetAttribute`` apply CUDA's unsafe-call rule: refused unless
the thread's mode is relaxed, or the thread's capture was begun in relaxed mode. Capture is detected through
``torch.cuda.is_current_stream_capturing()``. ``cuThreadExchangeStreamCaptureMode`` swaps a per-thread mode, which
defaults to global. Each refusal raises ``cuda_error`` in the same way on the CPU and on a GPU. Pools are resolved
through ``device_default_memory_pool`` only. Its static is kept per process: the eager run and the graph run are two
fresh processes. The user program is a stream-ordered row-softmax step. It takes its scratch (row max and row sum)
from the default device pool with ``allocate``/``deallocate`` on the stream, which inside the capture are graph memory
nodes. The step is captured on its first run with no warm-up, as the upstream test captures before any pool use
(CUDA graphs need no warm-up; an eager run first would resolve the pool and hide the bug). The step is then replayed
for the remaining inputs. Other threads (the rule for another thread's global capture), the managed and host pools,
device-support checks and alignment handling are left out.
"""
from __future__ import annotations

import contextlib
import threading

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/cccl/pull/11360"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "__get_default_memory_pool"
SYMPTOM = ("cuda_error 900 'operation not permitted when stream is capturing: Failed to get attribute for a memory "
           "pool' from device_default_memory_pool() on the process's first use of the pool inside a stream capture; "
           "the capture is invalidated")

ROWS, COLS, STEPS = 4, 8, 4
SIZE_MAX = (1 << 64) - 1
CU_STREAM_CAPTURE_MODE_GLOBAL, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL, CU_STREAM_CAPTURE_MODE_RELAXED = (
    "global", "thread_local", "relaxed")
CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900
CU_MEMPOOL_ATTR_RELEASE_THRESHOLD = "CU_MEMPOOL_ATTR_RELEASE_THRESHOLD"
CU_MEM_LOCATION_TYPE_DEVICE, CU_MEM_ALLOCATION_TYPE_PINNED = "CU_MEM_LOCATION_TYPE_DEVICE", "CU_MEM_ALLOCATION_TYPE_PINNED"
VARIANT = {"v": "bug"}


class cuda_error(RuntimeError):
    """``cuda::cuda_error``: a CUDA status and the wrapper's message."""

    def __init__(self, status: int, message: str):
        super().__init__(f"operation not permitted when stream is capturing({status}): {message}")
        self.status = status


# --- the driver, as far as these calls go (cuda::__driver, libcudacxx/include/cuda/__driver/driver_api.h) ------

class CUmemoryPool:
    def __init__(self, device):
        self.device = device
        self.attributes = {CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: 0}      # the driver's default: release at every sync


class _Driver:
    """One process's driver state: the default pools and each thread's capture mode. The per-thread mode defaults to
    global. A thread's capture sequence remembers the mode it was begun in (cuStreamBeginCapture)."""

    def __init__(self):
        self.default_pools: dict = {}
        self._thread = threading.local()

    # -- stream capture --
    def thread_mode(self) -> str:
        return getattr(self._thread, "mode", CU_STREAM_CAPTURE_MODE_GLOBAL)

    def threadExchangeStreamCaptureMode(self, mode: str) -> str:          # __threadExchangeStreamCaptureMode
        previous = self.thread_mode()
        self._thread.mode = mode
        return previous

    def threadExchangeStreamCaptureModeNoThrow(self, mode: str) -> str:
        return self.threadExchangeStreamCaptureMode(mode)

    @contextlib.contextmanager
    def capture_sequence(self, mode: str):
        """cuStreamBeginCapture(stream, mode) ... cuStreamEndCapture on this thread."""
        self._thread.sequence = mode
        try:
            yield
        finally:
            self._thread.sequence = None

    def _refuses_unsafe_call(self) -> bool:
        """CUDA's rule for a "potentially unsafe" API call on this thread. In relaxed thread mode, never refused.
        In thread-local and global mode, refused while this thread has an ongoing capture not begun in relaxed mode.
        (Global mode also refuses during another thread's global capture; only one thread here.)"""
        if self.thread_mode() == CU_STREAM_CAPTURE_MODE_RELAXED:
            return False
        sequence = getattr(self._thread, "sequence", None)
        return (torch.cuda.is_current_stream_capturing() and sequence is not None
                and sequence != CU_STREAM_CAPTURE_MODE_RELAXED)

    # -- memory pools --
    def getDefaultMemPool(self, location, allocation_type) -> CUmemoryPool:      # legal under capture
        key = (location, allocation_type)
        if key not in self.default_pools:
            self.default_pools[key] = CUmemoryPool(location[1])
        return self.default_pools[key]

    def mempoolGetAttribute(self, pool: CUmemoryPool, attr: str) -> int:       # cuMemPoolGetAttribute: unsafe
        if self._refuses_unsafe_call():
            raise cuda_error(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "Failed to get attribute for a memory pool")
        return pool.attributes[attr]

    def mempoolSetAttribute(self, pool: CUmemoryPool, attr: str, value: int) -> None:   # cuMemPoolSetAttribute
        if self._refuses_unsafe_call():
            raise cuda_error(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "Failed to set attribute for a memory pool")
        pool.attributes[attr] = value


_driver = _Driver()


# --- libcudacxx/include/cuda/__stream/relaxed_capture_scope.h (added by the fix) ----------------------------------

@contextlib.contextmanager
def __relaxed_capture_scope():
    """RAII scope putting the calling thread in relaxed stream-capture mode, and restoring its mode on exit."""
    previous = _driver.threadExchangeStreamCaptureMode(CU_STREAM_CAPTURE_MODE_RELAXED)
    try:
        yield
    finally:
        _driver.threadExchangeStreamCaptureModeNoThrow(previous)


# --- libcudacxx/include/cuda/__memory_pool/memory_pool_base.h ------------------------------------------------------

class release_threshold_t:
    """``memory_pool_attributes::release_threshold``: ``(pool)`` reads it, ``.set(pool, value)`` writes it."""

    def __call__(self, pool: CUmemoryPool) -> int:
        return _driver.mempoolGetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD)

    def set(self, pool: CUmemoryPool, value: int) -> None:
        _driver.mempoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, value)


class memory_pool_attributes:
    release_threshold = release_threshold_t()


def __get_default_memory_pool(location, allocation_type) -> CUmemoryPool:
    pool = _driver.getDefaultMemPool(location, allocation_type)
    if VARIANT["v"] == "fix":
        # #11360: the retention policy runs in relaxed mode, so the attribute calls are not refused under capture
        with __relaxed_capture_scope():
            if memory_pool_attributes.release_threshold(pool) == 0:
                memory_pool_attributes.release_threshold.set(pool, SIZE_MAX)
    else:
        # bug (#6718/#10618): cuMemPoolGetAttribute/SetAttribute issued in whatever capture mode the thread is in
        if memory_pool_attributes.release_threshold(pool) == 0:
            memory_pool_attributes.release_threshold.set(pool, SIZE_MAX)
    return pool


class device_memory_pool_ref:
    """A non-owning reference to a device memory pool: stream-ordered ``allocate``/``deallocate``
    (cuMemAllocFromPoolAsync/cuMemFreeAsync, which a capture records as memory nodes)."""

    def __init__(self, pool: CUmemoryPool):
        self.pool = pool

    def get(self) -> CUmemoryPool:
        return self.pool

    def allocate(self, stream, shape) -> torch.Tensor:
        return torch.empty(shape, device=stream.device)

    def deallocate(self, stream, buffer: torch.Tensor) -> None:
        del buffer


_statics: dict = {}        # the function-local statics of the accessors, once per process


def device_default_memory_pool(device) -> device_memory_pool_ref:
    """``cuda::device_default_memory_pool(dev)``: resolved on first use, then cached in a static."""
    key = ("device_default_memory_pool", str(device))
    if key not in _statics:
        location = (CU_MEM_LOCATION_TYPE_DEVICE, str(device))
        _statics[key] = device_memory_pool_ref(__get_default_memory_pool(location, CU_MEM_ALLOCATION_TYPE_PINNED))
    return _statics[key]


def _new_process() -> None:
    """A fresh process: no resolved pools, default pools with their driver defaults, threads in global mode."""
    global _driver
    _statics.clear()
    _driver = _Driver()


# --- the user program: a stream-ordered step whose scratch comes from the default device pool ----------------------

class stream:
    def __init__(self, device):
        self.device = torch.device(device)


def softmax_rows(strm: stream, x: torch.Tensor) -> torch.Tensor:
    """Row softmax with its scratch (row max, row sum) allocated on the stream from the default device pool."""
    pool = device_default_memory_pool(strm.device)
    scratch = pool.allocate(strm, (2, x.shape[0], 1))
    torch.amax(x, dim=1, keepdim=True, out=scratch[0])
    e = torch.exp(x - scratch[0])
    torch.sum(e, dim=1, keepdim=True, out=scratch[1])
    out = e / scratch[1]
    pool.deallocate(strm, scratch)
    return out


class GraphedStep:
    """Captures the step on its first run (cuStreamBeginCapture in global mode, the default) and replays it."""

    def __init__(self, device):
        self.strm = stream(device)
        self.device = str(device)
        self.static_x = torch.zeros(ROWS, COLS, device=device)
        self.graph = self.static_out = None

    def _capture(self) -> None:
        mode = CU_STREAM_CAPTURE_MODE_GLOBAL
        with _driver.capture_sequence(mode):
            self.graph, self.static_out = capture(
                lambda: softmax_rows(self.strm, self.static_x), device=self.device, warmups=0,
                name="softmax_rows", static={"static_x": self.static_x}, owner="GraphedStep",
                capture_error_mode=mode)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.static_x.copy_(x)
        if self.graph is None:
            self._capture()
        return replay(self.graph, self.static_out).clone()


def run(variant: str, device: str = "cpu"):
    VARIANT["v"] = variant
    gen = generator(11360)
    inputs = [randn(ROWS, COLS, gen=gen, device=device, scale=2.0) for _ in range(STEPS)]

    def eager():
        _new_process()
        strm = stream(device)
        return [softmax_rows(strm, x) for x in inputs]

    def served():
        _new_process()
        step = GraphedStep(device)
        return [step(x) for x in inputs]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
