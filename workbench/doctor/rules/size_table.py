"""undersized-buffer: a step asks a table of capture sizes for a size past the largest graph.

A runner keeps host tables of the sizes it captured: a list mapping each batch size to its
padded graph size (entries 0 to the largest), the sorted capture sizes it bisects, the graphs
by size. A batch larger than every graph must take the eager path; code that asks such a table
for it anyway (a check against the wrong bound, a request count where a token count was meant)
runs past the table's end, ``IndexError`` or ``KeyError``, and the step dies.

The error is explained where it is raised, while the frame's locals are there, and reported only
once it proves a failure (``failures.explained``): it left the workload's code, or reached a
harness, never when the workload caught it (``try: graph = graphs[n] except KeyError:`` run eagerly, the
standard fallback). The site is the code that asked: where the index came in as the raising
function's argument (a ``pad_for_cudagraph(n)`` helper), its caller's call.
"""
from __future__ import annotations

import ast

from ...engine.source import location, mine
from .. import explain
from ..report import Finding
from . import checks

UNKNOWN = object()


def explained(doctor, error: BaseException, frame) -> None:
    """Keep an explanation of a lookup error raised in ``frame``, reported if it becomes a failure."""
    if not isinstance(error, (IndexError, KeyError)) or not doctor.graphs:
        return
    sizes = {n for info in doctor.graphs.values() if info.ref() is not None
             for n in (*info.rows, *([info.size] if info.size else []))}
    node = subscript(frame) if sizes else None
    if node is None:
        return
    table = plain_value(node.value, frame)
    index = error.args[0] if isinstance(error, KeyError) and error.args else plain_value(node.slice, frame)
    largest = max(sizes)
    if table is UNKNOWN or not _past_sizes(table, index, largest):
        return
    asked, source = frame, location(frame)
    if isinstance(node.slice, ast.Name) and node.slice.id in _arguments(frame.f_code) \
            and frame.f_back is not None and mine(frame.f_back):
        asked, source = frame.f_back, location(frame.f_back)
    what = ast.unparse(node)
    evidence = (f"{what} asked a table of capture sizes ({_describe(table)}) for {index!r}, past the largest "
                f"size a graph was captured for ({largest}): {type(error).__name__}")
    finding = Finding("undersized-buffer", ", ".join(i.name for i in doctor.graphs.values() if i.ref() is not None),
                      "subscript", what, source, evidence, explain.size_table(what, largest),
                      {"index": index if isinstance(index, int) else None, "largest": largest})
    doctor.explanation = (id(error), finding, ("undersized-buffer", "size table", asked.f_code, source))


def _past_sizes(table, index, largest: int) -> bool:
    """Whether ``table[index]`` ran past a table of capture sizes: a dict keyed by them, a list with
    an entry per size up to the largest, or the sorted sizes themselves (``sizes[bisect(sizes, n)]``)."""
    number = isinstance(index, int) and not isinstance(index, bool)
    if isinstance(table, dict):
        return number and largest in table and index > largest
    if not isinstance(table, (list, tuple)) or number and index < len(table):
        return False
    by_size = number and len(table) in (largest, largest + 1) and index > largest
    holds_sizes = largest in table and all(isinstance(v, int) for v in table)      # (the index may be any call)
    return by_size or holds_sizes


def subscript(frame) -> ast.Subscript | None:
    """The subscript expression the frame's failing instruction evaluates, from its source columns."""
    node = checks.expression(frame)
    return node if isinstance(node, ast.Subscript) else None


def plain_value(node, frame):
    """A name, a constant, an attribute path of the frame's locals or an entry of a plain dict, list or
    tuple they hold (a table of tables, one per engine), read without running code (an object's
    ``__dict__``, never a property or a ``__getitem__``); ``UNKNOWN`` for anything else."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return frame.f_locals.get(node.id, frame.f_globals.get(node.id, UNKNOWN))
    if isinstance(node, ast.Attribute):
        owner = plain_value(node.value, frame)
        attrs = getattr(owner, "__dict__", None) if owner is not UNKNOWN else None
        return attrs.get(node.attr, UNKNOWN) if isinstance(attrs, dict) else UNKNOWN
    if isinstance(node, ast.Subscript):
        owner, key = plain_value(node.value, frame), plain_value(node.slice, frame)
        if type(owner) is dict:
            try:
                return owner.get(key, UNKNOWN)
            except TypeError:                   # (an unhashable key)
                return UNKNOWN
        if type(owner) in (list, tuple) and type(key) is int and -len(owner) <= key < len(owner):
            return owner[key]
    return UNKNOWN


def _arguments(code) -> tuple:
    return code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]


def _describe(table) -> str:
    if isinstance(table, dict):
        return f"a dict keyed by {sorted(k for k in table if isinstance(k, int))}"
    return f"a {type(table).__name__} of {len(table)}"
