"""host-work-frozen: eager code reads a tensor that an attribute assignment bound inside a capture.

Code inside a captured region may keep what it was called with for later: ``self._positions =
positions`` in a layer's forward, read by an eager op between the captured pieces. The assignment
is Python: it runs when the capture runs, and never at a replay. After the captures the attribute
holds the view the *last* capture that ran the line handed in -- that graph's rows -- while each
replay of any other size feeds its kernels fresh inputs. Eager code that reads the attribute gets
that capture's tensor: of another size (a step fails on the shapes), or of the right size with
values that stop at that capture's rows.

What shows it is a failed eager op whose smaller operand has the rows another graph was captured
for (``shapes.failed_op``). The attributes each capture left are kept (``captured_state``): one
still bound to what that graph's capture left, holding a tensor of those rows, that a line run
inside that capture assigned (``GraphInfo.lines_run``: a ``STORE_ATTR`` of that name), and that the
failing code has in hand (a local of a frame on its stack, or an attribute of the object the failing
method was called on) is the cause: ``host-work-frozen`` at that assignment. Without all four the
failure stays ``shapes``' (a mismatch of a step's rows with another graph's).
"""
from __future__ import annotations

import dis
import functools

import torch

from ...engine.source import location, user_frames
from .. import explain
from ..probes.captured_state import _locals, _same
from ..report import Finding
from ..tensors import first_line


def finding(doctor, func, size: int, real: int, other, error: BaseException) -> Finding | None:
    """The assignment inside ``other``'s capture (a graph of ``real`` rows) that bound the tensor a
    failed op of a ``size``-row step read, as a finding; None when nothing fits (module docstring)."""
    for ref, name, weak in (other.left or {}).values():
        obj = ref()
        value = getattr(obj, "__dict__", {}).get(name) if obj is not None else None
        if not (isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == real and _same(value, weak)):
            continue
        store = _store_run(other, name)
        if store is None or not _in_hand(value):
            continue
        holder = f"{type(obj).__name__}.{name}"
        return Finding(
            "host-work-frozen", other.name, str(func), f"{holder}: {tuple(value.shape)}", location(*store),
            f"after the captures, {func} failed on a tensor of {size} rows against one of {real}: {first_line(error)}; "
            f"`{holder}` still holds the {real}-row tensor the assignment bound while {other.name} was captured",
            explain.bound_in_capture(holder, other.name, real, size), {"size": size, "real": real})
    return None


def _store_run(info, name: str) -> tuple | None:
    """``(code, line)`` of an assignment to attribute ``name`` that ran inside ``info``'s capture (the
    first in file and line order: ``lines_run`` is a set)."""
    for code, line in sorted(info.lines_run, key=lambda run: (run[0].co_filename, run[1])):
        if name in _stores(code).get(line, ()):
            return code, line
    return None


@functools.lru_cache(maxsize=4096)
def _stores(code) -> dict:
    """Line -> attribute names the function's bytecode assigns on it (``STORE_ATTR``)."""
    out: dict = {}
    for ins in dis.get_instructions(code):
        if ins.opname == "STORE_ATTR" and ins.positions is not None and ins.positions.lineno is not None:
            out.setdefault(ins.positions.lineno, set()).add(ins.argval)
    return out


def _in_hand(value: torch.Tensor) -> bool:
    """Whether the failing code holds ``value``: bound to a local of one of the user's frames on the
    stack, or read from the object the innermost of them is a method of (its first argument). An
    object further out that merely holds it (the model in the serving loop's frame) is not enough."""
    frames = user_frames()
    try:
        if not frames:
            return False
        inner = frames[0]
        code = inner.f_code
        own = _locals(inner).get(code.co_varnames[0]) if code.co_argcount else None
        attrs = getattr(own, "__dict__", None)
        if isinstance(attrs, dict) and not isinstance(own, type) and any(v is value for v in attrs.values()):
            return True
        return any(local is value for frame in frames for local in _locals(frame).values())
    finally:
        del frames
