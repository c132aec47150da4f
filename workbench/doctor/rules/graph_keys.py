"""A served step asks for a graph by a key no capture made.

A runner keeps its graphs by a key: a batch descriptor (tokens, requests, a uniform-decode flag, a
LoRA flag), a ``(batch, blocks)`` bucket. The key a capture is filed under is computed by the capture
loop, the key a step asks for by the serving path, often by the same helper from other state. Where
the two disagree the step finds no graph: ``graphs[key]`` raises ``KeyError``, or a wrapper that
captures lazily tries to capture mid-serving and the workload's own guard refuses ("capturing
detected at an inappropriate time"). Either way the step dies, and which part of the key disagrees
says why:

* a size of the key (a number) past every captured one: the step is larger than any graph
  (``undersized-buffer``), at the serving frame that holds the key it asked with;
* a decision of the key (a flag, a mode, a string) that no capture took, on a key whose sizes a
  capture has: the capture decided otherwise than serving does (``warmup-divergence``), at the
  capture's frame that holds the key it was filed under (the outermost: the capture loop that
  computed it, not the wrapper that was handed it).

A size between the captured ones (a step not padded to a capture size) says nothing of either, and
is left alone. The keys captured are the lookup table's own keys, or, for a lazy capture, the values
the frames of every capture held under the same name (``capture_begin`` keeps the plain, hashable
locals of the frames that opened each capture; captures are few, so this costs nothing per step).
The error is explained where it is raised and reported once it proves a failure
(``failures.explained``), never where the workload catches it and runs eagerly.
"""
from __future__ import annotations

import ast
import dataclasses
import enum
import inspect

import torch

from ...engine.source import location, user_frames
from ..report import Finding
from . import guarded
from .size_table import UNKNOWN, plain_value, subscript

_SCALARS = (bool, int, float, str, type(None), enum.Enum, torch.dtype, torch.device)


def capture_begin(info) -> None:
    """Keep the key-like locals of the frames that open a capture, outermost first."""
    info.callers = [(f.f_code, _held(f, cut=True), location(f)) for f in reversed(user_frames())]


def _held(frame, cut: bool = False) -> dict:
    """A frame's key-like locals. Up to Python 3.12, reading a function's locals leaves a snapshot of
    them on its frame, which keeps every object they name alive until that frame next runs traced
    code: memory the workload lets go (an engine released, a buffer rebound) would outlive it, and a
    read of it would no longer be seen as dangling. With ``cut`` the snapshot is cut back to what is
    kept here (a tracer that reads it again refreshes it whole first); never inside a trace event of
    that frame, after which Python writes the snapshot back into its locals."""
    values = frame.f_locals
    kept = {k: v for k, v in values.items() if keylike(v)}
    if cut and type(values) is dict and values is not frame.f_globals and frame.f_code.co_flags & inspect.CO_OPTIMIZED:
        for name in values.keys() - kept.keys():
            del values[name]
    return kept


def raised(doctor, error: BaseException, frame) -> None:
    """Explain a served step's error as a graph key no capture made (module docstring)."""
    if doctor.phase != "eager" or not doctor.graphs or doctor.capturing is not None:
        return
    if isinstance(error, KeyError) and error.args:
        found = _table_miss(doctor, error.args[0], frame)
    elif guarded.SAYS_CAPTURE.search(str(error)):
        found = _lazy_capture(doctor, frame)
    else:
        return
    if found is None:
        return
    name, asked, captured = found
    nearest = min(captured, key=lambda k: len(_differ(asked, k)))
    fields = _differ(asked, nearest)
    if not fields:
        return
    graphs = ", ".join(i.name for i in doctor.graphs.values() if i.ref() is not None)
    sizes = [f for f in fields if _number(_field(asked, f))]
    if len(sizes) == len(fields) and all(_field(asked, f) > max((_field(k, f) for k in captured
                                                                 if _number(_field(k, f))), default=_field(asked, f))
                                         for f in sizes):
        site = _holder([(f.f_code, _held(f), location(f)) for f in reversed(user_frames(frame))], asked)
        kind, cause = "undersized-buffer", (
            f"The step asks for a graph keyed {asked!r}, larger in {', '.join(map(str, fields))} than any graph was "
            "captured for: no graph can serve it. A step larger than every graph must take the eager path; the "
            "check that sends it to the graphs must compare every size the key holds with the largest captured.")
    elif len(sizes) < len(fields):
        site = _holder([c for info in doctor.graphs.values() for c in info.callers], nearest)
        kind, cause = "warmup-divergence", (
            f"The graphs were captured under keys the capture computed ({nearest!r} the nearest), and a served step "
            f"computes {asked!r}: they part in {', '.join(map(str, fields))}, a decision the capture took from "
            "state only start-up has (no request yet, a default) or from another path. Capture under the key the "
            "serving path will ask for (compute it with the same inputs, force what serving forces), or key the "
            "graphs on what both agree on.")
    else:
        return
    if site is None:
        return
    evidence = (f"after the captures, {name} asked for a graph keyed {asked!r}; the graphs are keyed "
                f"{sorted(map(repr, captured))[:6]}: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
    finding = Finding(kind, graphs, "lookup", name, site, evidence, cause)
    doctor.explanation = (id(error), finding, (kind, "graph key", site))


def _table_miss(doctor, key, frame):
    """``graphs[key]`` failed on a table whose values hold the captured graphs: its keys."""
    node = subscript(frame)
    table = plain_value(node.value, frame) if node is not None else UNKNOWN
    if not isinstance(table, dict) or not table or not structured(key) or not keylike(key) \
            or not any(_holds_graph(doctor, v) for v in table.values()):
        return None
    captured = [k for k in table if type(k) is type(key) and _arity(k) == _arity(key)]
    return (f"`{ast.unparse(node)}`", key, captured) if captured else None


def _lazy_capture(doctor, frame):
    """A refusal to capture, raised under a frame of a function that opened a capture before: the
    local of that frame that differs from what it held at every capture is the key asked for."""
    held: dict = {}
    for info in doctor.graphs.values():
        for code, values, _ in info.callers:
            held.setdefault(code, []).append(values)
    for f in user_frames(frame):
        for name, value in _held(f).items():
            before = [v[name] for v in held.get(f.f_code, ()) if name in v]
            if before and len(before) == len(held[f.f_code]) and structured(value) \
                    and all(type(b) is type(value) and _arity(b) == _arity(value) and b != value for b in before):
                return f"`{name}` in {f.f_code.co_name}", value, before
    return None


def _holder(frames, key) -> str | None:
    """Where the outermost of ``frames`` ((code, locals, where), outermost first) held ``key``."""
    for _, values, where in frames:
        if any(keylike(v) and type(v) is type(key) and v == key for v in values.values()):
            return where
    return None


def _holds_graph(doctor, value) -> bool:
    """A table's entry is a graph, or holds one: a runner object's attribute, a ``(graph, outputs)`` pair."""
    inside = value if isinstance(value, (tuple, list)) else getattr(value, "__dict__", {}).values()
    return doctor.info(value) is not None or any(doctor.info(v) is not None for v in inside)


def keylike(value) -> bool:
    """A plain value a runner keys its graphs on: a scalar (a number, a string, None, an enum, a dtype,
    a device), or a hashable tuple (a shape, a named tuple) or dataclass of such values; never one
    that holds a tensor or another object."""
    if isinstance(value, _SCALARS):
        return True
    if not structured(value):
        return False
    try:                      # (the workload's own types: a hash or field that raises is no key)
        hash(value)
        return all(keylike(_field(value, f)) for f in _names(value))
    except Exception:  # noqa: BLE001
        return False


def structured(value) -> bool:
    """A tuple or a dataclass instance: a key with fields."""
    return isinstance(value, tuple) or dataclasses.is_dataclass(value) and not isinstance(value, type)


def _names(value) -> list:
    if dataclasses.is_dataclass(value):
        return [f.name for f in dataclasses.fields(value)]
    return list(getattr(value, "_fields", None) or (f"item {i}" for i in range(len(value))))


def _field(value, name: str):
    return value[int(name[5:])] if isinstance(value, tuple) and name.startswith("item ") else getattr(value, name)


def _arity(value) -> int:
    return len(_names(value)) if structured(value) else 1


def _differ(asked, captured) -> list:
    """The fields of two keys of one type and arity that hold other values."""
    return [f for f in _names(asked) if _field(asked, f) != _field(captured, f)]


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
