"""Where in *user* code an operation came from: the first stack frame outside torch, the engine and
the doctor."""
from __future__ import annotations

import contextlib
import dis
import linecache
import os
import sys

import torch

SKIP_DIRS = (  # torch, the engine, the doctor, the zoo's minimal runner: never the user's code
    os.path.dirname(torch.__file__),
    os.path.dirname(os.path.abspath(__file__)),
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "doctor"),
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "zoo", "kit.py"),
    os.path.dirname(contextlib.__file__) + os.sep + "contextlib",
)


# Handlers of other dispatch modes (an op logger, say) stand between the user's line and the op.
_HANDLERS = ("__torch_dispatch__", "__torch_function__")


def user_frame() -> str:
    """``file:line in function: code`` of the innermost frame that is not torch, engine or doctor
    code, nor a dispatch mode's handler. (Called for every op the doctor records: which code
    objects are the user's, and each line's text, are looked up once.)"""
    frame = user_code_frame()
    return location(frame) if frame is not None else "<unknown>"


def user_code_frame():
    """The innermost user frame itself (None outside user code), for a caller that keeps only its
    function (held briefly)."""
    frame = sys._getframe(1)
    while frame is not None and not mine_code(frame.f_code):
        frame = frame.f_back
    return frame


_CALLER = object()


def user_frames(start=_CALLER) -> list:
    """The user's frames on the stack, innermost first, from ``start`` (the caller's frame by
    default; None: no frame) outwards (frame objects: hold them only briefly)."""
    frames, frame = [], sys._getframe(1) if start is _CALLER else start
    while frame is not None:
        if mine_code(frame.f_code):
            frames.append(frame)
        frame = frame.f_back
    return frames


def frames_within(opened) -> list | None:
    """The user's frames running inside the frame ``opened``, innermost first (None when ``opened``
    is not on the stack): what a block called, not the code around it."""
    frames, frame = [], sys._getframe(1)
    while frame is not None and frame is not opened:
        if mine_code(frame.f_code):
            frames.append(frame)
        frame = frame.f_back
    return frames if frame is opened else None


def codes_within(opened) -> frozenset:
    """The code objects of the user's frames running inside the frame ``opened`` (the user's frame
    that entered a capture or a warmup): what that block called, not the runner around it."""
    return frozenset(f.f_code for f in frames_within(opened) or ())


def location(frame, lineno: int | None = None) -> str:
    """``file:line in function: code`` of a frame, at the line it is running (or at ``lineno``; a
    code object with a ``lineno`` names that line of its function). Where no line is known (a code
    object alone; a frame whose instruction has none, which Python 3.12 gives as None), the line
    that defines the function."""
    code = getattr(frame, "f_code", frame)
    lineno = lineno or getattr(frame, "f_lineno", None) or code.co_firstlineno
    key = (code, lineno)
    text = _LINES.get(key)
    if text is None:
        line = linecache.getline(code.co_filename, lineno).strip()
        text = _LINES[key] = f"{short_path(code.co_filename)}:{lineno} in {function_name(code)}: {line}"
    return text


_RAISES = {dis.opmap[name] for name in ("RAISE_VARARGS", "RERAISE")}


def raises_at(code, at: int) -> bool:
    """Whether instruction ``at`` of ``code`` (a frame's ``f_lasti``, a traceback entry's
    ``tb_lasti``) is a ``raise`` statement of the code's own, not a call that raised."""
    return 0 <= at < len(code.co_code) and code.co_code[at] in _RAISES


# What a function that only passes one call on is made of: loads of what it was given or holds, the
# call, and its return (3.11 to 3.13 spell the call differently).
_PASSING = frozenset(dis.opmap[name] for name in (
    "RESUME", "NOP", "CACHE", "COPY_FREE_VARS", "MAKE_CELL", "PUSH_NULL", "LOAD_FAST", "LOAD_DEREF", "LOAD_GLOBAL",
    "LOAD_ATTR", "LOAD_METHOD", "LOAD_CONST", "LOAD_CLOSURE", "KW_NAMES", "PRECALL", "POP_TOP", "RETURN_VALUE",
    "RETURN_CONST", "LOAD_FAST_CHECK", "LOAD_FAST_LOAD_FAST") if name in dis.opmap)
_CALLS = frozenset(dis.opmap[name] for name in ("CALL", "CALL_KW", "CALL_FUNCTION_EX") if name in dis.opmap)
_FORWARDS: dict = {}    # code object -> whether it forwards


def forwards(code) -> bool:
    """Whether a function does nothing but make one call, with what it was given or holds, and
    return its result (``def wait(self): synchronize(self.device)``): a wrapper, a binding's
    stand-in, which decides nothing. No branch, no arithmetic, no store: what it does was asked
    for by its caller, whose line is the one to change."""
    found = _FORWARDS.get(code)
    if found is None:
        ops = [i.opcode for i in dis.get_instructions(code)]
        found = _FORWARDS[code] = sum(op in _CALLS for op in ops) == 1 and all(
            op in _PASSING or op in _CALLS for op in ops)
    return found


def function_of(where: str) -> str:
    """The function of a ``file:line in function`` location, with or without the code after it."""
    return where.split(" in ", 1)[-1].split(":", 1)[0]


_INLINED = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")


def function_name(code) -> str:
    """The function a code object runs; for a comprehension or a generator expression, the function
    it is written in: Python 3.12 runs comprehensions inline (PEP 709), 3.11 in a frame of their own,
    and a site must not depend on the interpreter; nor can anyone look up ``<genexpr>``."""
    if code.co_name not in _INLINED:
        return code.co_name
    parts = getattr(code, "co_qualname", code.co_name).split(".")
    while parts and (parts[-1] in _INLINED or parts[-1] == "<locals>"):
        parts.pop()
    return parts[-1] if parts else "<module>"


def mine(frame) -> bool:
    """Whether a frame runs the user's code (not torch, engine or doctor code)."""
    return mine_code(frame.f_code)


def mine_code(code) -> bool:
    """Whether a code object is the user's (``mine`` of a frame that would run it)."""
    mine = _USER.get(code)
    if mine is None:
        mine = _USER[code] = (not code.co_filename.startswith(SKIP_DIRS)
                              and not code.co_filename.startswith("<frozen") and code.co_name not in _HANDLERS
                              and not _generated(code))
    return mine


def _generated(code) -> bool:
    """Code made at run time with no source to show (a dataclass's ``__eq__``, a namedtuple's
    methods: ``exec`` of a string): its line says nothing, its caller's does. Code made at run time
    that registers its source (a notebook cell, ``torch.fx``'s) is the user's."""
    name = code.co_filename
    return name.startswith("<") and not linecache.getline(name, code.co_firstlineno)


_USER: dict = {}      # code object -> whether it is the user's
_LINES: dict = {}     # (code object, line) -> the formatted location
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def short_path(filename: str) -> str:
    """Path relative to the package root's parent when inside it, else as given."""
    return os.path.relpath(filename, _ROOT) if filename.startswith(_ROOT) else filename
