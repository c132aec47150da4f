"""What the engine and the runners announce, so that an observer (the graph doctor) can watch.

A CUDA graph's hazards live between the calls: a capture that recorded less than the warmup ran,
a replay that reads memory whose owner let go, padded rows nobody refreshed. The engine calls the
functions below at those moments; with no observer subscribed each call returns at once, so the
engine pays one truthiness test per event.

Announcements come from two places:

* the engine itself: ``capture_begin``/``capture_end``/``capture_abort`` (``graph()``) and
  ``replay_begin``/``replay_end`` (both graph classes);
* the runners, which alone know what a tensor *means*: ``static_buffers`` (persistent inputs, by
  name), ``warmup`` (the eager runs before a capture), ``serve`` (this replay serves ``real`` rows
  of ``size``; these arrays' rows ``[real, size)`` are padded rows) and ``handed_out`` (views of
  graph outputs given to the caller, valid until the graph's next replay).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

_observers: list[Any] = []


def subscribe(observer: Any) -> None:
    _observers.append(observer)


def unsubscribe(observer: Any) -> None:
    _observers.remove(observer)


def _emit(event: str, *args: Any, **kwargs: Any) -> None:
    """Call ``event`` on every observer that handles it (an observer listens to what it needs)."""
    for observer in _observers:
        handler = getattr(observer, event, None)
        if handler is not None:
            handler(*args, **kwargs)


def capture_begin(graph: Any, name: str | None) -> None:
    if _observers:
        _emit("capture_begin", graph, name)


def capture_end(graph: Any) -> None:
    if _observers:
        _emit("capture_end", graph)


def capture_abort(graph: Any, error: BaseException) -> None:
    if _observers:
        _emit("capture_abort", graph, error)


def replay_begin(graph: Any) -> None:
    if _observers:
        _emit("replay_begin", graph)


def replay_end(graph: Any) -> None:
    if _observers:
        _emit("replay_end", graph)


def static_buffers(owner: str, buffers: Mapping[str, Any]) -> None:
    """Persistent input buffers that graphs read through views (names are for reports)."""
    if _observers:
        _emit("static_buffers", owner, dict(buffers))


@contextlib.contextmanager
def warmup() -> Iterator[None]:
    """The eager run(s) a runner makes before capturing the next graph."""
    if not _observers:
        yield
        return
    _emit("warmup_begin")
    try:
        yield
    finally:
        _emit("warmup_end")


def serve(graph: Any, real: int, size: int, *, padded: Mapping[str, Any] | None = None,
          outputs: Any = None, eager: Any = None) -> None:
    """The next replay of ``graph`` serves ``real`` of its ``size`` rows. ``padded`` maps names to
    tensors or NumPy arrays whose rows ``[real, size)`` are this step's padded rows; an observer may
    overwrite them (probes). ``outputs`` are the graph's static outputs (rows ``[0, real)`` are real).
    ``eager``, when given, re-runs this step without graphs and returns its outputs."""
    if _observers:
        _emit("serve", graph, real, size, dict(padded or {}), outputs, eager=eager)


def handed_out(graph: Any, tensors: Any) -> None:
    """Views of ``graph``'s static outputs returned to the caller: stale after its next replay."""
    if _observers:
        _emit("handed_out", graph, tensors)
