"""``diagnose``: exercise a workload under ``watch()``, then probe its padded rows by re-running it.

Whether real rows depend on padded rows cannot be seen from one run: the padded rows hold whatever
they hold. It can be tested by running the same deterministic workload twice more with every
announced padded row filled two different ways; any difference in real-row outputs, or in state the
graphs write, is evidence. Re-running the whole workload (rather than re-playing one graph) also
catches padded rows that act on the host, before the replay, as metadata does.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..engine import GraphRunner
from . import explain
from .findings import Finding, Report
from .watch import Doctor, _first_line, watching


def diagnose(target: Callable[[], Any], make_batch: Callable[[int, int], Mapping[str, torch.Tensor]] | None = None,
             *, rows: Sequence[int] | None = None, guard: bool = True, padding_probe: bool = True) -> Report:
    """Run a workload under ``watch()`` and return the report, stale-padding probes included.

    ``target`` is either a *workload* -- a function of no arguments that builds everything it needs,
    captures and serves, deterministically -- or, with ``make_batch``, a factory of a ``GraphRunner``:
    the runner is captured (warmup, one graph per size) and then serves ``make_batch(n, step)`` for
    each ``n`` of ``rows`` (default: every size and one row short of it, largest first).
    ``guard`` stops a replay that would read released memory (see ``watch``). An exception in the
    workload ends that run; it is listed in the report, and what was observed until then counts.
    """
    workload = target if make_batch is None else exercise(target, make_batch, rows)
    report, doctor = _run(workload, guard=guard)
    if not padding_probe:
        report.not_checked["stale-padding"] = "diagnose(padding_probe=False)"
    elif report.captures == 0 or report.failure is not None:
        pass
    elif doctor.padded_steps == 0:
        report.not_checked["stale-padding"] = ("no padded rows were served: every batch filled its graph, "
                                               "or the runner announced none")
    else:
        runs = [_run(workload, guard=guard, pattern=p) for p in (0, 1)]
        failed = next((r[0].failure for r in runs if r[0].failure is not None), None)
        if failed is not None:          # a run the doctor stopped watching has an incomplete trace
            report.failure = failed
            report.not_checked["stale-padding"] = f"the doctor stopped early in a padded-row run ({failed})"
            return report
        finding = compare_runs(*(r[1].trace for r in runs), *(r[0].errors for r in runs))
        if finding is not None:
            report.findings.append(finding)
        del report.not_checked["stale-padding"]
        report.notes.append(f"stale-padding: {doctor.padded_steps} padded step(s); the workload was run twice "
                            "more with padded rows filled two ways")
    return report


def exercise(make_runner: Callable[[], GraphRunner], make_batch: Callable[[int, int], Mapping[str, torch.Tensor]],
             rows: Sequence[int] | None = None) -> Callable[[], None]:
    """A workload for ``diagnose``: a fresh runner, captured, then one batch per entry of ``rows``."""
    def workload() -> None:
        runner = make_runner()
        if not isinstance(runner, GraphRunner):
            raise TypeError(f"make_runner must return a GraphRunner, got {type(runner).__name__}")
        runner.capture()
        sizes = runner.capture_sizes
        default = [runner.max_size, *sorted({n for s in sizes for n in (s, s - 1) if n > 0}, reverse=True)]
        with torch.no_grad():
            for step, n in enumerate(default if rows is None else rows):
                runner(**make_batch(n, step))
    return workload


def _run(workload: Callable[[], Any], *, guard: bool, pattern: int | None = None) -> tuple[Report, Doctor]:
    with watching(Doctor(guard=guard, pattern=pattern)) as doctor:
        try:
            workload()
        except Exception as e:  # noqa: BLE001 - what the workload raised is part of the evidence
            doctor.report.errors.append(f"{type(e).__name__}: {_first_line(e)}")
    return doctor.report, doctor


def compare_runs(a: list[dict], b: list[dict], errors_a: list[str], errors_b: list[str]) -> Finding | None:
    """The first replay whose real-row outputs differ between the two padded-row patterns (or
    where the runs take different graphs, or end differently), as a ``stale-padding`` finding;
    ``None`` when the runs agree. State the graphs write is compared too, as supporting evidence:
    padded rows may legitimately write rows of a cache that no real request reads."""
    state_since = None
    for k, (ra, rb) in enumerate(zip(a, b)):
        if ra["graph"] != rb["graph"]:
            return _finding(ra, k, f"replay {k + 1} ran {ra['graph']} under one pattern and {rb['graph']} under "
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
            return _finding(ra, k, evidence, {"replay": k + 1, "max_abs_diff": diff},
                            differing[0] if differing else None)
    if len(a) != len(b) or errors_a != errors_b:
        shorter = a if len(a) <= len(b) else b
        what = "; ".join(f"pattern {i}: {e[0] if e else 'no error'}, {n} replays"
                         for i, (e, n) in enumerate(((errors_a, len(a)), (errors_b, len(b)))))
        return _finding(shorter[-1] if shorter else None, len(shorter), f"the two runs ended differently ({what})",
                        {"replays": [len(a), len(b)]}, None)
    return None


def _finding(record: dict | None, k: int, evidence: str, numbers: dict, first: str | None) -> Finding:
    graph = record["graph"] if record else "-"
    op, source = record["readers"].get(first, ("-", "-")) if record and first else ("-", "-")
    if record and first is None and record["readers"]:
        op, source = next(iter(record["readers"].values()))
    if first:
        evidence += f"; first graph input whose real rows differ: {first}"
    return Finding("stale-padding", graph, op, first or "-", source, evidence, explain.stale_padding(first), numbers)
