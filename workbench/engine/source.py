"""Where in *user* code an operation came from: the first stack frame outside torch, the engine and
the doctor."""
from __future__ import annotations

import contextlib
import linecache
import os
import sys

import torch

_SKIP_DIRS = (
    os.path.dirname(torch.__file__),
    os.path.dirname(os.path.abspath(__file__)),
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "doctor"),
    os.path.dirname(contextlib.__file__) + os.sep + "contextlib",
)


# Handlers of other dispatch modes (an op logger, say) stand between the user's line and the op.
_HANDLERS = ("__torch_dispatch__", "__torch_function__")


def user_frame() -> str:
    """``file:line in function: code`` of the innermost frame that is not torch, engine or doctor
    code, nor a dispatch mode's handler."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if (not filename.startswith(_SKIP_DIRS) and not filename.startswith("<frozen")
                and frame.f_code.co_name not in _HANDLERS):
            code = linecache.getline(filename, frame.f_lineno).strip()
            return f"{_short(filename)}:{frame.f_lineno} in {frame.f_code.co_name}: {code}"
        frame = frame.f_back
    return "<unknown>"


def _short(filename: str) -> str:
    """Path relative to the package root's parent when inside it, else as given."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.path.relpath(filename, root) if filename.startswith(root) else filename
