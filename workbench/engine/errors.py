"""Errors raised by the graph engine.

Each one names what went wrong *and* what to do about it: the people reading these are debugging a
serving stack at 2 a.m., not reading our source.
"""
import weakref


class GraphError(RuntimeError):
    """Misuse of a graph or runner: replay before capture, nested capture, bad buffers."""


class CaptureError(GraphError):
    """An operation that cannot be captured, e.g. a host synchronisation (``.item()``, ``nonzero``),
    or a graph call CUDA refuses while a capture is open (a capture begun inside it, a replay).

    On CUDA these invalidate the stream capture (``cudaErrorStreamCaptureUnsupported``); the CPU
    emulation raises this error at the same point, naming the op and the user's source line.
    """

    def __init__(self, message: str, *, op: str | None = None, source: str | None = None, tensor=None) -> None:
        super().__init__(message)
        self.op = op
        self.source = source
        # the tensor whose values a host synchronisation asked for, if one (weakly: an error kept by
        # the caller must not keep it alive)
        self.tensor = weakref.ref(tensor) if tensor is not None else None


class IllegalMemoryAccess(RuntimeError):
    """A replay touched memory the graph does not own and whose owner has released it.

    The CPU counterpart of ``CUDA error: an illegal memory access was encountered``.
    """
