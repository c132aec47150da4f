"""Which threads an open capture forbids to wait for the device: CUDA's stream-capture modes.

``torch.cuda.graph(capture_error_mode=...)`` picks the ``cudaStreamCaptureMode`` of a capture.
In ``"global"`` mode (torch's default) *every* thread is forbidden to wait for the device while the
capture is open: another thread's ``.tolist()``, ``.item()`` or ``torch.cuda.synchronize()`` fails
there ("operation not permitted when stream is capturing"), and the capture itself fails at its
end ("operation failed due to a previous error during capture"). In ``"thread_local"`` and
``"relaxed"`` mode other threads may read values; a device-wide ``synchronize`` still breaks the
capture, since it waits for the capturing stream too. Engine probe ``other_thread`` holds these
answers against an H200's.

A server that captures lazily while another thread serves (a vocoder captured on its first use
beside a decode loop that reads sampled tokens with ``.tolist()``) fails only with graphs, and only
when the two meet. Per-thread guards (a dispatch mode is per thread) never see the other thread's
read, so while a capture is open the Tensor methods that read values are wrapped for every thread.
"""
from __future__ import annotations

import contextlib
import functools
import threading

import torch

from .errors import CaptureError, GraphError
from .host import HostTensor
from .host_sync import HOST_SYNC_METHODS
from .source import user_frame

MODES = ("global", "thread_local", "relaxed")


class _Open:
    """A capture open on one thread, and the first wait another thread made during it."""

    __slots__ = ("name", "mode", "cpu", "broken")

    def __init__(self, name: str, mode: str, cpu: bool) -> None:
        self.name, self.mode, self.cpu = name, mode, cpu
        self.broken: tuple[str, str] | None = None      # (what, where) the first refused wait


_open: dict[int, _Open] = {}          # thread ident -> the capture open there
_lock = threading.Lock()
_saved: dict[str, object] = {}        # the Tensor methods wrapped while a capture is open (None: inherited)


def check(mode: str) -> None:
    if mode not in MODES:
        raise GraphError(f"capture_error_mode must be one of {MODES}, got {mode!r}")


@contextlib.contextmanager
def opened(name: str, mode: str, cpu: bool):
    """While the block runs, a capture in ``mode`` is open on this thread; on leaving it, a wait
    another thread made meanwhile fails the capture, as CUDA fails it at capture end."""
    ident, entry = threading.get_ident(), _Open(name, mode, cpu)
    with _lock:
        if not _open:
            _wrap_value_reads()
        _open[ident] = entry
    try:
        yield entry
    finally:
        with _lock:
            _open.pop(ident, None)
            if not _open:
                _unwrap_value_reads()


class WaitedElsewhereError(CaptureError):
    """A capture CUDA invalidated because another thread waited for the device while it was open."""

    def __init__(self, message: str, *, op: str, source: str, waited_at: str, mode: str) -> None:
        super().__init__(message, op=op, source=source)
        self.waited_at, self.mode = waited_at, mode


def broken_error(entry: _Open) -> WaitedElsewhereError:
    what, where = entry.broken
    return WaitedElsewhereError(
        f"operation failed due to a previous error during capture: {what} at {where}, on another thread, "
        f"waited for the device while {entry.name} was being captured in {entry.mode!r} mode, and CUDA "
        f"invalidated the capture.\n  at {user_frame()}\n" + (
            "Capture with capture_error_mode=\"thread_local\" (other threads may then read values), or capture "
            "before other threads start serving." if entry.mode == "global" else
            "A device-wide wait is refused in every capture mode: make that thread's work asynchronous on its own "
            "stream, or capture before other threads start serving."),
        op=what, source=user_frame(), waited_at=where, mode=entry.mode)


def refuse_elsewhere(what: str, value_read: bool, device_tensor=None) -> None:
    """A wait for the device on this thread (``what``): refused where a capture open on another
    thread forbids it (a value read: in global mode; a device-wide synchronize: in any mode).
    On CUDA the call then goes on and CUDA refuses it; the CPU engine raises CUDA's error."""
    me = threading.get_ident()
    for ident, entry in list(_open.items()):
        if ident == me or (value_read and entry.mode != "global"):
            continue
        if device_tensor is not None and not (type(device_tensor) is not HostTensor if entry.cpu
                                              else device_tensor.is_cuda):
            continue                                    # host memory: no wait for the device
        where = user_frame()
        if entry.broken is None:
            entry.broken = (what, where)
        if entry.cpu:
            raise CaptureError(
                f"{what} waits for the device while {entry.name} is being captured on another thread in "
                f"{entry.mode!r} mode: operation not permitted when stream is capturing "
                f"(cudaErrorStreamCaptureUnsupported); the capture fails at its end.\n  at {where}",
                op=what, source=where)
        return


def _wrap_value_reads() -> None:
    for name in HOST_SYNC_METHODS:
        _saved[name] = vars(torch.Tensor).get(name)
        setattr(torch.Tensor, name, _refusing(getattr(torch.Tensor, name), name))


def _unwrap_value_reads() -> None:
    for name, original in _saved.items():
        if original is None:
            delattr(torch.Tensor, name)
        else:
            setattr(torch.Tensor, name, original)
    _saved.clear()


def _refusing(original, name: str):
    @functools.wraps(original)
    def read(self, *args, **kwargs):
        if len(_open) > (threading.get_ident() in _open):       # a capture open on another thread
            refuse_elsewhere(f"Tensor.{name}()", True, self)
        return original(self, *args, **kwargs)
    return read
