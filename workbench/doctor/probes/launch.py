"""Launch-trace comparison: the ops an eager run of a step launches against the ops its graph
replays (the capture's trace). Python is frozen at capture: a plan made once, a branch taken
another way, a feature switched on since, a scalar baked into an op, another tensor read in its
place -- each shows as the first position where the two traces part."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Divergence:
    """Where two launch traces part: ``how`` is ``ops`` (another op or line), ``arguments``
    (the same op with other Python-decided arguments), ``reference`` (the same op reading
    another pre-existing tensor) or ``length`` (one trace goes on after the other ends)."""

    how: str
    index: int
    graph_op: object
    eager_op: object
    graph_keys: frozenset = frozenset()
    eager_keys: frozenset = frozenset()

    def text(self) -> str:
        g, e = self.graph_op, self.eager_op
        at = f"launch {self.index + 1}"
        if self.how == "length":
            if g is not None:
                return f"{at}: the graph replays {g.name} at {g.source}, which the eager step no longer launches"
            return f"{at}: the eager step launches {e.name} at {e.source}, which the graph never recorded"
        if self.how == "ops":
            return (f"{at}: the graph replays {g.name} at {g.source} where the eager step launches {e.name} at "
                    f"{e.source}")
        if self.how == "arguments":
            return (f"{at}: {g.name} at {g.source} runs with arguments {_short(g.sig)} in the graph and "
                    f"{_short(e.sig)} in the eager step")
        return f"{at}: {g.name} at {g.source} reads another tensor in the graph than in the eager step"


def compare(graph_ops: list, eager_ops: list) -> Divergence | None:
    for i, (g, e) in enumerate(zip(graph_ops, eager_ops)):
        if g.name != e.name or g.source != e.source:
            return Divergence("ops", i, g, e)
        if g.sig != e.sig:
            return Divergence("arguments", i, g, e)
        only_graph, only_eager = g.ext - e.ext, e.ext - g.ext
        if only_graph and only_eager:
            return Divergence("reference", i, g, e, only_graph, only_eager)
    if len(graph_ops) != len(eager_ops):
        i = min(len(graph_ops), len(eager_ops))
        return Divergence("length", i, graph_ops[i] if i < len(graph_ops) else None,
                          eager_ops[i] if i < len(eager_ops) else None)
    return None


def _short(sig: tuple) -> str:
    text = ", ".join(str(a) for a in sig if a != "T")
    return f"({text[:80]}{'...' if len(text) > 80 else ''})"
