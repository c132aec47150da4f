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
still bound to what that graph's capture left, holding a tensor of those rows (itself, or one level
in: a metadata object's field, a tuple's item), that a line run inside that capture assigned
(``GraphInfo.lines_run``: a ``STORE_ATTR`` of that name), and that the failing code has in hand (a
local of a frame on its stack, or the attribute the failing line reads from the object its method
was called on) is the cause: ``host-work-frozen`` at that assignment. Without all four the failure
stays ``shapes``' (a mismatch of a step's rows with another graph's).
"""
from __future__ import annotations

import dis
import functools

import torch

from ...engine.source import location, user_frames
from .. import explain
from ..probes.captured_state import frame_locals, same
from ..report import Finding
from ..tensors import first_line


def finding(func, size: int, real: int, other, error: BaseException) -> Finding | None:
    """The assignment inside ``other``'s capture (a graph of ``real`` rows) that bound the tensor a
    failed op of a ``size``-row step read, as a finding; None when nothing fits (module docstring)."""
    for ref, name, weak in (other.left or {}).values():
        obj = ref()
        value = getattr(obj, "__dict__", {}).get(name) if obj is not None else None
        if value is None or not same(value, weak) or (store := _store_run(other, name)) is None:
            continue
        for path, t in _tensors_of(value):
            if not (t.dim() and t.shape[0] == real and _in_hand(name, value, t)):
                continue
            holder = f"{type(obj).__name__}.{name}{path}"
            return Finding(
                "host-work-frozen", other.name, str(func), f"{holder}: {tuple(t.shape)}", location(*store),
                f"after the captures, {func} failed on a tensor of {size} rows against one of {real}: "
                f"{first_line(error)}; `{holder}` still holds the {real}-row tensor the assignment bound while "
                f"{other.name} was captured", explain.bound_in_capture(holder, other.name, real, size),
                {"size": size, "real": real})
    return None


def _tensors_of(value) -> list:
    """``(path, tensor)``: the value itself, or one level into it (a tuple's items, the attributes of
    an object such as the metadata a captured forward keeps)."""
    if isinstance(value, torch.Tensor):
        return [("", value)]
    if isinstance(value, (tuple, list)):
        return [(f"[{i}]", v) for i, v in enumerate(value) if isinstance(v, torch.Tensor)]
    attrs = getattr(value, "__dict__", None)
    if not isinstance(attrs, dict) or isinstance(value, (type, torch.nn.Module)):
        return []
    return [(f".{k}", v) for k, v in attrs.items() if isinstance(v, torch.Tensor)]


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
    return _names(code, ("STORE_ATTR",))


@functools.lru_cache(maxsize=4096)
def _loads(code) -> dict:
    """Line -> attribute names the function's bytecode reads on it."""
    return _names(code, ("LOAD_ATTR", "LOAD_METHOD"))


def _names(code, opnames: tuple) -> dict:
    out: dict = {}
    for ins in dis.get_instructions(code):
        if ins.opname in opnames and ins.positions is not None and ins.positions.lineno is not None:
            out.setdefault(ins.positions.lineno, set()).add(ins.argval)
    return out


def _in_hand(name: str, value, t: torch.Tensor) -> bool:
    """Whether the failing code holds the attribute's ``value`` or its tensor ``t``: bound to a local
    of one of the user's frames on the stack, or read as attribute ``name`` on the failing line of the
    innermost of them, from the object it is a method of. An object further out that merely holds it
    (the model in the serving loop's frame) is not enough, nor another attribute of the same object."""
    frames = user_frames()
    try:
        if not frames:
            return False
        inner = frames[0]
        code = inner.f_code
        own = frame_locals(inner).get(code.co_varnames[0]) if code.co_argcount else None
        attrs = getattr(own, "__dict__", None)
        if (isinstance(attrs, dict) and not isinstance(own, type) and attrs.get(name) is value
                and name in _loads(code).get(inner.f_lineno, ())):
            return True
        return any(local is value or local is t for frame in frames for local in frame_locals(frame).values())
    finally:
        del frames
