"""Launch-trace comparison: the ops an eager run of a step launches against the ops its graph
replays (the capture's trace). Python is frozen at capture: a plan made once, a branch taken
another way, a feature switched on since, a scalar baked into an op, another tensor read in its
place -- each shows as the first position where the two traces part."""
from __future__ import annotations

import dataclasses
import sys

from ..tensors import TensorArg


@dataclasses.dataclass
class Divergence:
    """Where two launch traces part: ``how`` is ``skipped`` (the eager step launches ops the graph
    never recorded, then both go on alike: ``eager_op`` is the first of them, ``after`` the eager
    op that lines up with ``graph_op`` again), ``extra`` (the graph replays ops the eager step no
    longer launches), ``ops`` (another op or line, no realignment in sight), ``arguments`` (the
    same op with other Python-decided arguments), ``reference`` (the same op reading another
    pre-existing tensor) or ``length`` (one trace goes on after the other ends)."""

    how: str
    index: int
    graph_op: object
    eager_op: object
    graph_keys: frozenset = frozenset()
    eager_keys: frozenset = frozenset()
    after: object = None
    inserted: int = 0           # ``skipped``/``extra``: how many ops one trace has that the other has not
    loop: str | None = None     # the line of the frame whose loop ran another number of times (``repeats``)
    origin: str | None = None   # ``arguments``: the line of the outermost frame holding the value (``eager_trace``)
    passed: str | None = None   # ... else of the frame that passed it down without holding it

    @property
    def eager_runs_more(self) -> bool:
        """The eager step launches ops the graph never recorded (``skipped``, or it goes on after the
        graph's trace ends), rather than the graph replaying ops the eager step no longer launches."""
        return self.how == "skipped" or (self.how == "length" and self.graph_op is None)

    @property
    def first_extra(self):
        """The first op one trace has beyond the other (``skipped``, ``extra``, ``length``)."""
        return self.eager_op if self.eager_runs_more else self.graph_op

    def tensor_argument(self) -> bool:
        """An ``arguments`` divergence in the geometry of a tensor argument (a view's offset or shape)."""
        return any(isinstance(g, TensorArg) and g != e for g, e in zip(self.graph_op.sig, self.eager_op.sig))

    def text(self) -> str:
        g, e = self.graph_op, self.eager_op
        at = f"launch {self.index + 1}"
        if self.how == "length":
            if g is not None:
                return f"{at}: the graph replays {g.name} at {g.source}, which the eager step no longer launches"
            return f"{at}: the eager step launches {e.name} at {e.source}, which the graph never recorded"
        if self.how == "skipped":
            return (f"{at}: the eager step launches {e.name} at {e.source}, which the graph never recorded (the graph "
                    f"goes on with {g.name} at {g.source})")
        if self.how == "extra":
            return (f"{at}: the graph replays {g.name} at {g.source}, which the eager step no longer launches (it "
                    f"goes on with {e.name} at {e.source})")
        if self.how == "ops":
            return (f"{at}: the graph replays {g.name} at {g.source} where the eager step launches {e.name} at "
                    f"{e.source}")
        if self.how == "arguments":
            return f"{at}: {g.name} at {g.source} runs with {_argument_difference(g.sig, e.sig)}"
        return f"{at}: {g.name} at {g.source} reads another tensor in the graph than in the eager step"


_LOOKAHEAD = 64     # ops searched ahead for the point where two parted traces line up again


def compare(graph_ops: list, eager_ops: list) -> Divergence | None:
    for i, (g, e) in enumerate(zip(graph_ops, eager_ops)):
        if g.name != e.name or g.source != e.source:
            return _parted(graph_ops, eager_ops, i)
        if g.sig != e.sig:
            return Divergence("arguments", i, g, e)
        only_graph, only_eager = g.ext - e.ext, e.ext - g.ext
        if only_graph and only_eager:
            return Divergence("reference", i, g, e, only_graph, only_eager)
    if len(graph_ops) != len(eager_ops):
        i = min(len(graph_ops), len(eager_ops))
        return Divergence("length", i, graph_ops[i] if i < len(graph_ops) else None,
                          eager_ops[i] if i < len(eager_ops) else None, inserted=abs(len(graph_ops) - len(eager_ops)))
    return None


def _parted(graph_ops: list, eager_ops: list, i: int) -> Divergence:
    """Which trace inserted ops at ``i``: the nearer realignment wins (work the graph skipped, or
    work it replays that Python no longer does)."""
    g, e = graph_ops[i], eager_ops[i]
    skip = _ahead(eager_ops, i, (g.name, g.source))
    extra = _ahead(graph_ops, i, (e.name, e.source))
    if skip is not None and (extra is None or skip <= extra):
        return Divergence("skipped", i, g, e, after=eager_ops[i + skip], inserted=skip)
    if extra is not None:
        return Divergence("extra", i, g, e, inserted=extra)
    return Divergence("ops", i, g, e)


def repeats(d: Divergence | None, graph_ops: list, eager_ops: list) -> tuple | None:
    """Where the ops one trace has beyond the other all come from lines the other ran too -- the
    same code run another number of times (a loop whose count Python decided at capture; at the end
    of the step, one trace simply goes on) -- the positions in the eager trace of the last two runs
    of the first such op, whose stacks tell which frame loops; ``()`` when the eager step ran it
    once. ``None``: not a repeat."""
    if d is None or d.how not in ("skipped", "extra", "length"):
        return None
    inserted, other = (eager_ops, graph_ops) if d.eager_runs_more else (graph_ops, eager_ops)
    ran = {(op.name, op.source) for op in other}
    if not all((op.name, op.source) in ran for op in inserted[d.index:d.index + d.inserted]):
        return None
    first = inserted[d.index]
    seen = [k for k, op in enumerate(eager_ops[:d.index + 1] if d.how == "skipped" else eager_ops)
            if (op.name, op.source) == (first.name, first.source)]
    return tuple(seen[-2:]) if len(seen) >= 2 else ()


def _ahead(ops: list, i: int, key: tuple) -> int | None:
    for k in range(1, min(_LOOKAHEAD, len(ops) - i)):
        if (ops[i + k].name, ops[i + k].source) == key:
            return k
    return None


def _argument_difference(graph_sig: tuple, eager_sig: tuple) -> str:
    """The arguments that differ, each as the graph keeps it and as the eager step passes it now."""
    if len(graph_sig) != len(eager_sig):
        return f"{len(graph_sig)} arguments in the graph and {len(eager_sig)} in the eager step"
    parts = [f"argument {i + 1} {_short(g)} in the graph and {_short(e)} in the eager step"
             for i, (g, e) in enumerate(zip(graph_sig, eager_sig)) if g != e]
    return "; ".join(parts[:3]) + ("; ..." if len(parts) > 3 else "")


def _short(value) -> str:
    text = str(value)
    return text if len(text) <= 60 else text[:60] + "..."


def graph_ops(info, pending) -> list:
    """The step's launch trace as its graphs recorded it: all pieces of a PIECEWISE step, in order."""
    return [op for piece in pending.span for op in piece.ops] if pending.span else info.ops


def traces(info, pending, run) -> tuple[list, list]:
    """The graph's and the eager step's traces to compare. A PIECEWISE step's eager regions run in
    both but are no graph's ops: the eager trace keeps the lines the graphs recorded, so that a
    scalar or a tensor frozen in a piece still shows (work a piece skipped does not)."""
    ops = graph_ops(info, pending)
    if not pending.span:
        return ops, run.ops
    lines = {op.source for op in ops}
    return ops, [op for op in run.ops if op.source in lines]


def trace_number(d: Divergence | None, run_eager) -> None:
    """Where a number the traces part on came from (``d.origin``, else where it was handed down,
    ``d.passed``): the eager step run once more, traced back from that launch (``eager_trace``).
    ``run_eager(**how)`` runs it traced; nothing is run for a divergence of another kind."""
    if d is None or d.how != "arguments" or d.tensor_argument():
        return
    numbers = tuple(e for g, e in zip(d.graph_op.sig, d.eager_op.sig) if g != e)
    again, _, _ = run_eager(origin_of=(d.index, numbers, sys._getframe()))
    d.origin, d.passed = again.origin, again.passed
