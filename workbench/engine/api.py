"""One API over two backends: ``torch.cuda.CUDAGraph`` on a GPU, ``CPUGraph`` on the CPU.

Code written against these functions runs unchanged on a laptop and on an H100, which is what lets
one notebook show the same failure on both.
"""
from __future__ import annotations

import contextlib
import gc

import torch

from . import capture_mode, events, queries
from .cpu_graph import CPUGraph, Pool
from .errors import CaptureError, GraphError
from .host_sync import host_sync_error, stream_waits_refused
from .source import user_frame


def resolve_device(device: str | torch.device) -> torch.device:
    """``"cpu"`` or ``"cuda"``; a clear error when CUDA is asked for and absent."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise GraphError(f"device must be 'cpu' or 'cuda', got {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise GraphError(f"device={str(device)!r} was requested but this torch ({torch.__version__}) "
                         "sees no CUDA device. Use device='cpu' for the emulated graphs.")
    if dev.type not in ("cpu", "cuda"):
        raise GraphError(f"device must be 'cpu' or 'cuda', got {str(device)!r}")
    return dev


class CUDAGraph(torch.cuda.CUDAGraph):
    """``torch.cuda.CUDAGraph`` plus the misuse checks the CPU backend has (replay before capture)."""

    def __init__(self) -> None:
        super().__init__()
        self.captured = False
        self.replays = 0

    def capture_end(self) -> None:
        super().capture_end()
        self.captured = True

    def replay(self) -> None:
        if not self.captured:
            what = ("inside the graph's own capture block: the capture is still open, so there is "
                    "nothing complete to replay yet. Replay after the `with graph(g):` block ends"
                    if torch.cuda.is_current_stream_capturing() else
                    "before capture (or after reset): capture the graph first with `with graph(g): ...`")
            raise GraphError(f"replay() called {what}.")
        events.replay_begin(self)
        try:
            events.launching(self)
            super().replay()
            self.replays += 1
        finally:
            events.replay_end(self)

    def reset(self) -> None:
        super().reset()
        self.captured = False
        self.replays = 0
        events.graph_reset(self)


def new_graph(device: str | torch.device = "cpu", *, on_freed: str = "raise"):
    """A fresh graph for ``device``. ``on_freed`` picks the CPU outcome of reading freed memory
    (``"raise"``: ``IllegalMemoryAccess``; ``"reuse"``: stale/reused values); on CUDA the real
    allocator decides, so it is ignored there."""
    dev = resolve_device(device)
    return CUDAGraph() if dev.type == "cuda" else CPUGraph(on_freed=on_freed)


def graph_pool_handle(device: str | torch.device = "cpu"):
    """A pool that several graphs can share (``torch.cuda.graph_pool_handle`` on CUDA)."""
    dev = resolve_device(device)
    pool = torch.cuda.graph_pool_handle() if dev.type == "cuda" else Pool()
    events.pool_made(pool)
    return pool


@contextlib.contextmanager
def graph(g, pool=None, *, name: str | None = None, capture_error_mode: str = "global"):
    """Capture the block into ``g``: ``torch.cuda.graph`` on CUDA, ``CPUGraph`` capture on the CPU.
    ``name`` (e.g. ``"size 8"``) labels the graph in the doctor's reports. ``capture_error_mode``
    is CUDA's: which other threads the capture forbids to wait for the device (``capture_mode``)."""
    capture_mode.check(capture_error_mode)
    label = name or "a graph"
    if isinstance(g, CPUGraph):
        try:
            g.capture_begin(pool)
        except GraphError as e:
            events.capture_refused(g, pool, name, e)
            raise
        events.capture_begin(g, name)
        events.pool_used(g, pool)
        try:
            with capture_mode.opened(label, capture_error_mode, cpu=True) as open_capture:
                yield g
            if open_capture.broken is not None:
                raise capture_mode.broken_error(open_capture)
        except BaseException as e:
            events.capture_abort(g, e)
            g.capture_abort()
            raise
        g.capture_end()
        events.capture_end(g)       # once the capture has closed, as on CUDA (below)
    elif isinstance(g, torch.cuda.CUDAGraph):
        if torch.cuda.is_current_stream_capturing():
            raise CaptureError("A graph capture is already open; captures do not nest.",
                               op="a capture begun inside a capture")
        if getattr(g, "captured", False):
            raise GraphError("This graph already holds a capture. Call g.reset() first.")
        # No garbage collection may run inside the capture: one there can finalise a dropped
        # runner's graphs or pool, and releasing CUDA resources during a global-mode capture
        # invalidates it ("operation failed due to a previous error during capture", reported at
        # the next kernel). torch collects on entering only under ``force_cudagraph_gc``, so dead
        # cycles holding graphs are common; the collector is off before the capture begins (a
        # collection triggered by the few objects made between the two was the window) and back
        # on once it has closed, when what it collects is released outside any capture.
        # capture_end is announced once the capture has closed: an observer's own tensor work there
        # (a copy of what the graph read) must run now, not be recorded into the graph.
        collecting = gc.isenabled()
        begun = False
        open_capture = None
        try:
            gc.disable()
            with capture_mode.opened(label, capture_error_mode, cpu=False) as open_capture, \
                    torch.cuda.graph(g, pool=pool, capture_error_mode=capture_error_mode), \
                    stream_waits_refused(lambda wait: capture_mode.refuse_elsewhere(wait, value_read=False)):
                begun = True
                events.capture_begin(g, name)
                events.pool_used(g, pool)
                yield g
            events.capture_end(g)
        except BaseException as e:
            error = e
            if open_capture is not None and open_capture.broken is not None and "previous error" in str(e):
                error = capture_mode.broken_error(open_capture)      # (CUDA's words name no line: the engine's do)
            if begun:
                events.capture_abort(g, error)
            else:                       # entering the capture failed: the allocator refused the pool
                events.capture_refused(g, pool, name, error)
            if error is e:
                raise
            raise error from e
        finally:
            if collecting:
                gc.enable()
    else:
        raise TypeError(f"graph() needs a graph from new_graph(), got {type(g).__name__}")


def synchronize(device: str | torch.device) -> None:
    """Wait for queued GPU work (on the CPU everything already ran). Inside a capture it is refused
    on both backends, as CUDA refuses it (``host_sync.stream_waits_refused``)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    elif queries.current_graph() is not None:
        raise host_sync_error("synchronize()", user_frame())
    else:
        capture_mode.refuse_elsewhere("synchronize()", value_read=False)
