"""Code a capture passed over: lines of the functions it ran that name a buffer, and that it never ran.

A capture records the kernels Python launched while it was open. A branch Python did not take
leaves nothing in the graph, and every replay repeats that choice: ``if need_min_p: ...`` decided on
the dummy batch, an argument the capture was not given (``adapter_data=None``). When the data a
runner copies into a static input reaches no graph, the code that would have read it is the
evidence: a statement, in a function that ran inside the capture, that reads the buffer by name (an
attribute, a variable, a string key) and did not run. Which lines ran is known only under
``diagnose``, whose error tracer records every line a capture runs (``raised.py``); a statement
that launches no kernel ran all the same, so the lines of captured ops' stacks would not do.

The same lines tell where a run that launches work the capture did not left the capture's path
(``parted``): the frame whose branch went another way, often above the one the work runs in.
"""
from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap

from ..engine.source import location

_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
_WORD = re.compile(r"[A-Za-z_]\w*")


def parted(stack, lines: set) -> str | None:
    """Where work one run did and the capture did not began: ``stack`` holds the (function, line) of
    each of the user's frames of that work, outermost first, and ``lines`` the (function, line) the
    capture ran. The first frame at a line the capture never ran is the one whose branch went
    another way -- or, when the capture never ran that function at all, its caller, which called
    another function than it did at capture. (The innermost frame is where the work runs; the
    decision is often frames above, in a setter or a dispatcher.) None when no line was traced or
    every line ran."""
    if not lines:
        return None
    codes = {code for code, _ in lines}
    caller = None
    for code, line in stack:
        if (code, line) not in lines:
            return location(*(caller if code not in codes and caller is not None else (code, line)))
        caller = (code, line)
    return None


def reader(info, name: str) -> str | None:
    """``file:line in function: code`` of a statement that reads ``name`` (its last identifier) in a
    function that ran inside ``info``'s capture (not the runner's code that opened it) and that did
    not run: the first such statement by file and line, or None (also when no line was traced)."""
    words = _WORD.findall(name)
    if not words:
        return None
    found = [(code.co_filename, first, code) for code in {code for code, _ in info.lines_run}
             for first, last in _mentions(code).get(words[-1], ())
             if not any((code, line) in info.lines_run for line in range(first, last + 1))]
    if not found:
        return None
    _, first, code = min(found, key=lambda f: f[:2])
    return location(code, first)


@functools.cache
def _mentions(code) -> dict[str, tuple[tuple[int, int], ...]]:
    """identifier -> the statements of ``code``'s own body (not the functions defined in it) that read
    it (an attribute, a variable, a string subscript), each as its first and last line."""
    try:
        lines, start = inspect.getsourcelines(code)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError):
        return {}
    if not tree.body or not isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)):
        return {}
    out: dict[str, set[tuple[int, int]]] = {}
    todo = [(node, node) for node in tree.body[0].body if not isinstance(node, _SCOPES)]
    while todo:
        node, statement = todo.pop()
        if isinstance(node, ast.stmt):
            statement = node
        word = _read_name(node)
        if word is not None:
            out.setdefault(word, set()).add((start + statement.lineno - 1, start + statement.end_lineno - 1))
        todo += [(child, statement) for child in ast.iter_child_nodes(node) if not isinstance(child, _SCOPES)]
    return {word: tuple(sorted(spans)) for word, spans in out.items()}


def _read_name(node) -> str | None:
    if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
        return node.attr
    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
        return node.id
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and isinstance(node.slice, ast.Constant) \
            and isinstance(node.slice.value, str):
        return node.slice.value
    return None
