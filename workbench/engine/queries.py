"""Which thread is capturing: the engine's own answer, and torch's, as libraries ask it.

Libraries choose a capture-safe path by asking torch whether the current stream is capturing
(``transformers``' ``is_tracing`` calls ``torch.cuda.is_current_stream_capturing()`` and then skips
its data-dependent mask checks). During a ``CPUGraph`` capture the emulation must give CUDA's
answer, or correct library code takes a path that a real capture never sees and fails on the CPU.

The answer is per thread, as CUDA's is per stream: another thread running eagerly meanwhile is not
capturing. Which of the user's functions asked while a capture was open is kept (``asked``): code
that skips work because it is being captured decided there, which a diagnosis names. Torch's
functions read the module-level name ``_cuda_isCurrentStreamCapturing``, so that name (in
``torch.cuda.graphs`` and ``torch._C``) is wrapped once; every alias of
``torch.cuda.is_current_stream_capturing`` a library imported earlier answers through it. Outside
a ``CPUGraph`` capture the wrapper calls torch's own function, so nothing changes on a CUDA
build; on a CPU-only torch, whose function raises, it answers False, as CUDA does outside a capture
(code that asks eagerly, such as an allocator refusing buffers while capturing, then runs on the
CPU backend as it does on a GPU; ``transformers`` already read the raise as False).
"""
from __future__ import annotations

import os
import sys
import threading

import torch
import torch.cuda.graphs as _cuda_graphs

from .source import mine_code

_state = threading.local()


def current_graph():
    """The ``CPUGraph`` whose capture is open on this thread, or None."""
    return getattr(_state, "graph", None)


def is_capturing() -> bool:
    """True while a capture is open on this thread: a ``CPUGraph``'s or, on CUDA, one on the current
    stream (torch's answer). Code that asks the engine (a launcher that skips its host-side work
    while capturing) then takes the path a real capture takes on either backend; answering only for
    the emulation sent such code, on a GPU, into the host work that CUDA refuses in a capture."""
    if getattr(_state, "graph", None) is not None:
        return _noted(True)
    return _noted(torch.cuda.is_initialized() and bool(_cuda_graphs._cuda_isCurrentStreamCapturing()))


def asked(clear: bool = False) -> frozenset:
    """The code objects of the user's functions that asked, on this thread, whether a capture is open
    while one was (this engine's ``is_capturing`` or torch's query, directly or through a library),
    since the last ``asked(clear=True)``."""
    found = frozenset(getattr(_state, "asked", ()))
    if clear:
        _state.asked = set()
    return found


def _noted(answer: bool) -> bool:
    """Keep the asking function (``asked``) of a True answer: the first frame out of torch's (and of a
    wrapper's), if it is the user's; a question the engine or the doctor asks for itself is none."""
    if answer:
        frame = sys._getframe(1)
        while frame is not None and (frame.f_code.co_filename.startswith(_TORCH) or frame.f_code in _ASKERS):
            frame = frame.f_back
        if frame is not None and mine_code(frame.f_code):
            if getattr(_state, "asked", None) is None:
                _state.asked = set()
            _state.asked.add(frame.f_code)
    return answer


def set_capturing(graph) -> None:
    """Called by ``CPUGraph`` when its capture opens (``graph``) and closes (``None``)."""
    _state.graph = graph


def _wrap(torch_answer):
    if getattr(torch_answer, "_workbench_wrapped", False):
        return torch_answer

    def is_current_stream_capturing() -> bool:
        if getattr(_state, "graph", None) is not None:
            return _noted(True)
        if not torch.backends.cuda.is_built():
            return False
        return _noted(bool(torch_answer()))

    is_current_stream_capturing._workbench_wrapped = True
    return is_current_stream_capturing


_TORCH = os.path.dirname(torch.__file__)
_ASKERS = (is_capturing.__code__, _wrap(lambda: False).__code__)     # the queries themselves


def install() -> None:
    """Make torch's capture query see ``CPUGraph`` captures (idempotent)."""
    wrapped = _wrap(_cuda_graphs._cuda_isCurrentStreamCapturing)
    _cuda_graphs._cuda_isCurrentStreamCapturing = wrapped
    torch._C._cuda_isCurrentStreamCapturing = wrapped
