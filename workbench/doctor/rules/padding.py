"""stale-padding: real rows depend on what padded rows (or padded columns) hold.

Decided by ``diagnose`` from three runs of one deterministic workload: as the runner left the
padded rows, and twice with them filled two different ways (``probes/padding.py``). The runs
differ only in what padded rows hold, so any difference in what real rows get is the finding. Where
all three fail, or all three agree while the run differs from its run without graphs at a padded
replay, runs with the padded rows the runner itself writes filled too say whether those values
decide the step (``written_by_runner``)."""
from __future__ import annotations

import torch

from .. import explain_padding
from ..report import Finding


def compare_runs(a: list[dict], b: list[dict], errors_a: list[str], errors_b: list[str]) -> Finding | None:
    """The first replay whose real-row outputs differ between the two padded-row patterns (or
    where the runs take different graphs, or end differently), as a ``stale-padding`` finding;
    ``None`` when the runs agree. State the graphs write is compared too, as supporting evidence:
    padded rows may legitimately write rows of a cache that no real request reads."""
    state_since = None
    for k, (ra, rb) in enumerate(zip(a, b)):
        if ra["graph"] != rb["graph"]:
            return _finding(ra, f"replay {k + 1} ran {ra['graph']} under one pattern and {rb['graph']} under "
                                "the other", {"replay": k + 1}, None)
        states = [label for label in ra["state"] if ra["state"][label] != rb["state"].get(label)]
        if states and state_since is None:
            state_since = (k + 1, states[0])
        oa, ob = ra["outputs"], rb["outputs"]
        if oa is not None and ob is not None and not torch.equal(oa.nan_to_num(), ob.nan_to_num()):
            differing = [label for label in ra["inputs"] if ra["inputs"][label] != rb["inputs"].get(label)]
            diff = float((oa - ob).abs().nan_to_num(float("inf")).max())
            evidence = (f"replay {k + 1} ({ra['graph']}, {ra['real']} real rows of {ra['size']}): real-row outputs "
                        f"differ by max |diff| = {diff:.3g}")
            if state_since is not None:
                evidence += f"; state {state_since[1]} differs since replay {state_since[0]}"
            return _finding(ra, evidence, {"replay": k + 1, "max_abs_diff": diff},
                            differing[0] if differing else None)
        read = next(((x, y) for x, y in zip(ra.get("reads", ()), rb.get("reads", ())) if x != y), None)
        if read is not None:
            (op, source, _, (writer, written_at)), _ = read
            evidence = (f"after replay {k + 1} ({ra['graph']}, {ra['real']} real rows of {ra['size']}), eager code "
                        f"computes other values ({op} at {source}) from memory the step writes with {writer}: "
                        "what the padded rows made it write reached a reader")
            return Finding("stale-padding", ra["graph"], writer, "-", written_at, evidence,
                           explain_padding.stale_padding(None), {"replay": k + 1})
    if len(a) != len(b) or errors_a != errors_b:
        shorter = a if len(a) <= len(b) else b
        what = "; ".join(f"pattern {i}: {e[0] if e else 'no error'}, {n} replays"
                         for i, (e, n) in enumerate(((errors_a, len(a)), (errors_b, len(b)))))
        return _finding(shorter[-1] if shorter else None, f"the two runs ended differently ({what})",
                        {"replays": [len(a), len(b)]}, None)
    return None


def crashed_only_as_left(error: str, record: dict | None, patterns: int) -> Finding:
    """The run with padded rows as the runner left them failed; the runs with padded rows filled
    with small valid values did not: what padded rows held made the difference."""
    return _finding(record, f"the run with padded rows as the runner left them failed ({error}); the {patterns} "
                            "runs with padded rows filled with small values completed", {"crashed": error}, None)


def neutralised(record: dict | None, replay: str, result: tuple) -> Finding:
    """The padded rows as the runner left them made a replay differ from the run without graphs
    (``replay``, and the workload's result ``result``: (index, max |diff|)); filled with 0 or with 1,
    the workload's results equalled that run's."""
    i, diff = result
    return _finding(record, f"{replay} differs from the run without graphs, and so does the workload's result {i} "
                            f"(max |diff| = {diff:.3g}); with the padded rows the runner left filled with 0, and "
                            "with 1, its results equal the run without graphs': what the runner left in the padded "
                            "rows reaches real rows", {"max_abs_diff": diff}, None, explain_padding.padding_left())


def written_by_runner(name: str, graph: str, op: str, source: str, made: str, *, error: str | None = None,
                      differs: Finding | None = None) -> Finding:
    """What the runner itself writes into the padded rows of static input ``name`` (at ``source``,
    values made at ``made``) decides the step: with 0 there the failing workload completed
    (``error``), or two runs with 0 and with 1 there gave real rows different results (``differs``,
    asked for when the run differed from its run without graphs and the padded rows the runner
    left could not explain it). The finding is where those values are made: where the runner
    chooses what padded rows hold."""
    where = source if made == source else f"{source} (values made at {made})"
    if error is not None:
        evidence = (f"the run failed ({error}), and so did both runs with the padded rows the runner left filled; "
                    f"with the padded rows of {name}, which the runner writes before its replay at {where}, filled "
                    "with 0 too, the workload completed: what the runner writes into padded rows makes the step fail")
    else:
        evidence = (f"the run differs from its run without graphs at a padded replay, and both runs with the padded "
                    f"rows the runner left filled agree; with the padded rows of {name}, which the runner writes "
                    f"before its replay at {where}, filled with 0 in one run and 1 in another, "
                    f"{differs.evidence.split('; ')[0]}: what the runner writes into padded rows reaches real rows")
    return Finding("stale-padding", graph, op, name, made, evidence,
                   explain_padding.padding_written(name, error is not None),
                   {"crashed": error} if error is not None else dict(differs.numbers))


def _finding(record: dict | None, evidence: str, numbers: dict, first: str | None, why: str | None = None) -> Finding:
    graph = record["graph"] if record else "-"
    if record and first:
        op, source = record["readers"].get(first, ("-", "-"))
        evidence += f"; first graph input whose real rows differ: {first}"
        tensor = first
    elif record and record.get("padded_reader"):
        op, source, tensor = record["padded_reader"]
        evidence += f"; {op} is the first op of the graph that reads the padded buffer {tensor}"
    elif record and record["readers"]:
        (tensor, (op, source)) = next(iter(record["readers"].items()))
    else:
        op, source, tensor = "-", "-", "-"
    return Finding("stale-padding", graph, op, tensor, source, evidence, why or explain_padding.stale_padding(first),
                   numbers)
