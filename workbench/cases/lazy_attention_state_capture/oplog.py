"""Which kernels a capture recorded, each with the line of the model it came from.

The case's evidence is a kernel that is *missing* from a graph (the planner), so it needs the list
of kernels every capture recorded. ``torch.cuda.CUDAGraph`` exposes no op list, so a dispatch mode
lists them; on the CPU the list equals what ``CPUGraph.ops`` records that is not a view (a test
checks that). Ops run while no capture is open (warmups, the eager attention between PIECEWISE
pieces) are not a graph's and are not listed.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ...engine import events
from ...engine.opinfo import written_tensors
from . import split_kv


class LoggedOp(NamedTuple):
    name: str          # the aten op, as ``RecordedOp.name``
    function: str      # the ``split_kv`` function that ran it ("-": none)
    line: int          # its line in split_kv.py (0: none)


class OpLog(TorchDispatchMode):
    """The kernels recorded by the captures while it listens (``with OpLog(size): ...``), by capture
    size (``size()`` names the size being captured). A kernel is an op that writes one of its
    arguments or returns new memory.

    Which arguments an op writes is decided where the engine and the graph doctor decide it
    (``workbench.engine.opinfo.written_tensors``).
    """

    def __init__(self, size: Callable[[], int | None]) -> None:
        super().__init__()
        self.size = size
        self.ops: dict[int, list[LoggedOp]] = {}

    def __enter__(self) -> OpLog:
        events.subscribe(self)
        return self

    def __exit__(self, *exc) -> None:
        events.unsubscribe(self)

    # The engine's announcements: the dispatch mode is on exactly while a capture is open.
    def capture_begin(self, graph, name) -> None:
        super().__enter__()

    def capture_end(self, graph) -> None:
        super().__exit__(None, None, None)

    def capture_abort(self, graph, error) -> None:
        super().__exit__(type(error), error, error.__traceback__)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        writes = bool(written_tensors(func, args, kwargs))
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if writes or any(t.untyped_storage()._cdata not in inputs for t in outputs):
            self.ops.setdefault(self.size(), []).append(LoggedOp(str(func), *_model_frame()))
        return out


def _model_frame() -> tuple[str, int]:
    """The innermost ``split_kv`` frame on the stack: (function, line)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename == split_kv.__file__:
            return frame.f_code.co_name, frame.f_lineno
        frame = frame.f_back
    return "-", 0
