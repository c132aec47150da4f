"""The program's own check, read from its source: the comparison that failed and the numbers it compared.

An ``assert len(data) <= buf.numel()`` or an ``if a.shape[0] != b.shape[0]: raise ...`` states a
contract the rules read (``undersized.failed_fit_check``, ``shapes.failed_size_check``). Its
message may state the numbers or not: a bare ``assert`` has none, unless pytest rewrote it (then
it reads ``assert 6 >= 8``), and a diagnosis must not depend on that. So the condition is found in
the source -- the ``assert`` at the failing line, the ``if`` whose body raised, or the comparison a
caller handed to a check helper that raised on it -- and its two
operands are evaluated in the frame where they are plain reads: names, attributes, subscripts by a
constant or a name, ``len(x)``, ``x.numel()``, ``x.size(d)`` (``d`` a constant or a local, as in a loop over
dimensions), ``x.dim()``, and sums or products of those.
No other call runs.
"""
from __future__ import annotations

import ast
import functools
import linecache
import operator

_ORDER = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)
_EQUAL = (ast.Eq, ast.NotEq)
_METHODS = frozenset({"numel", "size", "dim"})
_ARITHMETIC = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}
# Errors of a misused value (``'NoneType' object has no attribute 'events'``, a call with wrong
# arguments): a failure wherever they come from, never a check (a guard, a protocol's end).
MISUSE = (AttributeError, TypeError, NameError)


def expression(frame) -> ast.expr | None:
    """The expression the frame's running instruction evaluates (a failing subscript, the call it
    waits on), parsed from its source columns; None where they span lines or do not parse alone."""
    try:
        positions = list(frame.f_code.co_positions())[frame.f_lasti // 2]
    except (AttributeError, IndexError):
        return None
    line, end, start, stop = positions
    if line is None or line != end or start is None or stop is None:
        return None
    text = linecache.getline(frame.f_code.co_filename, line)[start:stop]
    try:
        return ast.parse(text, mode="eval").body
    except SyntaxError:
        return None


def condition(frame) -> tuple[str, list[int]] | None:
    """``("equal" | "order", [left, right])`` of the check that failed in ``frame``; None where the
    failing line is no single comparison of two numbers."""
    test = test_at(frame)
    if not isinstance(test, ast.Compare) or len(test.ops) != 1:
        return None
    kind = "equal" if isinstance(test.ops[0], _EQUAL) else "order" if isinstance(test.ops[0], _ORDER) else None
    values = [_value(node, frame) for node in (test.left, test.comparators[0])]
    if kind is None or not all(isinstance(v, int) for v in values):
        return None
    return kind, values


UNREAD = object()          # an operand that is no plain read (``read``)


def measured(frame) -> list[tuple[str, object]]:
    """``(source text, value)`` of what the failed check's comparison measures: ``x`` of each
    ``len(x)``, ``x.numel()``, ``x.size(d)``, ``x.dim()`` or ``x.shape[d]`` in its operands, where ``x``
    is a plain read (a buffer kept on an object, ``self.buf.size(0)``, is no local of the frame)."""
    test = test_at(frame)
    if not isinstance(test, ast.Compare):
        return []
    found = []
    for node in ast.walk(test):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _METHODS:
            inner = node.func.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "len" and node.args:
            inner = node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "shape":
            inner = node.value.value
        else:
            continue
        if (value := read(inner, frame)) is not UNREAD:
            found.append((ast.unparse(inner), value))
    return found


def test_at(frame) -> ast.expr | None:
    """The test of the check that failed in ``frame``: the ``assert`` at its line, the ``if`` whose
    body raised, or the comparison it passed to a check helper (``helper_caller``)."""
    found = _checks(frame.f_code.co_filename)
    return found.get(frame.f_lineno) or found.get(-frame.f_lineno)


def helper_caller(frame):
    """The frame whose comparison failed, where ``frame`` is a check helper's that raised on a flag
    it was given (``def _check(ok, what): if not ok: raise ...``, a ``TORCH_CHECK`` in Python): its
    caller, whose line passes that comparison (the only one among the calls on that line). None
    where ``frame`` is no such helper."""
    test = test_at(frame)
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        test = test.operand
    code = frame.f_code
    if not isinstance(test, ast.Name) or test.id not in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]:
        return None
    caller = frame.f_back
    if caller is None or -caller.f_lineno not in _checks(caller.f_code.co_filename):
        return None
    return caller


def read(node: ast.expr, frame):
    """An operand's value where it is a plain read, of any type; ``UNREAD`` otherwise."""
    try:
        return _read(node, frame)
    except Exception:  # noqa: BLE001 - an operand that cannot be read plainly says nothing
        return UNREAD


@functools.lru_cache(maxsize=128)
def _checks(filename: str) -> dict[int, ast.expr]:
    """Line -> the test of the ``assert`` on it, or of the ``if`` whose body raises on it."""
    try:
        tree = ast.parse("".join(linecache.getlines(filename)))
    except (SyntaxError, ValueError):
        return {}
    found: dict[int, ast.expr] = {}
    passed: dict[int, list] = {}         # line -> comparisons passed as call arguments (keyed by -line)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            for arg in (*node.args, *(k.value for k in node.keywords)):
                if isinstance(arg, ast.Compare):
                    passed.setdefault(node.lineno, []).append(arg)
        if isinstance(node, ast.Assert):
            for line in range(node.lineno, (node.end_lineno or node.lineno) + 1):
                found.setdefault(line, _compared(node.test))
        elif isinstance(node, ast.If):
            for raised in (n for n in node.body if isinstance(n, ast.Raise)):
                for line in range(raised.lineno, (raised.end_lineno or raised.lineno) + 1):
                    found.setdefault(line, _compared(node.test))
    found.update({-line: compares[0] for line, compares in passed.items() if len(compares) == 1})
    return found


def _compared(test: ast.expr) -> ast.expr:
    """A check's test with a negation of one comparison taken off (``if not n <= cap: raise``,
    ``assert not a > b``): the comparison is what was checked, whichever way it must hold."""
    negated = isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) and isinstance(test.operand, ast.Compare)
    return test.operand if negated else test


def _value(node: ast.expr, frame):
    """The operand's value where it is a plain read (see the module docstring) of a count, else None."""
    value = read(node, frame)
    return int(value) if isinstance(value, int) or type(value).__name__ == "SymInt" else None


def _read(node: ast.expr, frame):
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        scope = frame.f_locals if node.id in frame.f_locals else frame.f_globals
        return scope[node.id]
    if isinstance(node, ast.Attribute):
        return getattr(_read(node.value, frame), node.attr)
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return _read(node.value, frame)[node.slice.value]
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Name):     # ``captured_with[size]``
        return _read(node.value, frame)[_read(node.slice, frame)]
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.UnaryOp) \
            and isinstance(node.slice.op, ast.USub) and isinstance(node.slice.operand, ast.Constant):
        return _read(node.value, frame)[-node.slice.operand.value]         # ``lengths[-1]``
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
        return _ARITHMETIC[type(node.op)](_read(node.left, frame), _read(node.right, frame))
    if isinstance(node, ast.Call) and not node.keywords and all(isinstance(a, (ast.Constant, ast.Name))
                                                                for a in node.args):
        args = [_read(a, frame) for a in node.args]
        if isinstance(node.func, ast.Attribute) and node.func.attr in _METHODS and all(type(a) is int for a in args):
            return getattr(_read(node.func.value, frame), node.func.attr)(*args)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "len" \
            and len(node.args) == 1 and not node.keywords:
        return len(_read(node.args[0], frame))
    raise ValueError("not a plain read")
