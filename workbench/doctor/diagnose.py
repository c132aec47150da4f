"""``diagnose``: exercise a workload under ``watch()``, then probe its padded rows by re-running it.

Whether real rows depend on padded rows cannot be seen from one run: the padded rows hold whatever
they hold. It can be tested by running the same deterministic workload twice more with every
announced padded row (and padded column) filled two different ways; any difference in real-row
outputs, or in state the graphs write, is evidence -- and so is a run that fails only with the
padded rows as the runner left them, or that completes only with the padded rows the runner *writes*
filled too. Re-running the whole workload (rather than re-playing one
graph) also catches padded rows that act on the host, before the replay, as metadata does.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..engine import GraphRunner
from .intake import Doctor
from .probes.padding import Plan
from .report import Finding, Report
from .rules import uncomputed
from .rules.padding import compare_runs, crashed_only_as_left, neutralised, written_by_runner
from . import composite, raised
from .session import watching


_CURED = 4          # static inputs tried one at a time once filling them all made a failing run complete


class _Misuse(TypeError):
    """A wrong argument to ``diagnose`` found while running it: raised to the caller, never
    reported as the workload's failure."""


def diagnose(target: Callable[[], Any], make_batch: Callable[[int, int], Mapping[str, torch.Tensor]] | None = None,
             *, rows: Sequence[int] | None = None, guard: bool = True, padding_probe: bool = True,
             differential: int = 1) -> Report:
    """Run a workload under ``watch()`` and return the report, stale-padding probes included.

    ``target`` is either a *workload* -- a function of no arguments that builds everything it needs,
    captures and serves, deterministically -- or, with ``make_batch``, a factory of a ``GraphRunner``:
    the runner is captured (warmup, one graph per size) and then serves ``make_batch(n, step)`` for
    each ``n`` of ``rows`` (default: every size and one row short of it, largest first).
    ``guard`` stops a replay that would read released memory (see ``watch``); ``differential``
    compares every Nth replay that announces an eager step with an eager run (0: off). An
    exception in the workload ends that run: the report's headline says the workload failed, and
    what was observed until then counts. A factory or ``make_batch`` that returns the wrong type
    is a ``TypeError`` raised here.
    """
    if not callable(target):
        raise TypeError(f"diagnose() needs a workload or a runner factory (a callable), got {type(target).__name__}")
    workload = target if make_batch is None else exercise(target, make_batch, rows)
    report, doctor = _run(workload, _planned(Doctor(guard=guard, differential=differential), None))
    if not padding_probe:
        if not report.of("stale-padding"):
            report.not_checked["stale-padding"] = "diagnose(padding_probe=False)"
    elif report.captures == 0 or report.failure is not None:
        pass
    elif doctor.padded_steps == 0 and report.of("stale-padding"):
        pass                                            # found by the index contract: summary left it checked
    elif doctor.padded_steps == 0:
        short = sum(real < size for real, size, *_ in doctor.plan.steps)
        if short and (finding := _cured(workload, guard, doctor.plan.steps, _failed(report)[0]) if _failed(report)
                      else _steered(workload, guard, doctor.plan.steps) if _unexplained_padded(report, doctor)
                      else None):
            _add_tested(report, finding, ahead=True)
            report.not_checked.pop("stale-padding", None)
            return report
        report.not_checked["stale-padding"] = (
            f"{short} step(s) served fewer real rows than their graph's size, but the runner announced none of "
            "their padded rows as left as they were (serve(..., padded=...)): the two-way fill had nothing to fill"
            if short else "no padded rows were served: every batch filled its graph")
    else:
        runs = [_run(workload, _planned(Doctor(guard=guard, pattern=p), doctor.plan.steps)) for p in (0, 1)]
        failed = next((r[0].failure for r in runs if r[0].failure is not None), None)
        if failed is not None:          # a run the doctor stopped watching has an incomplete trace
            report.failure = failed
            report.not_checked["stale-padding"] = f"the doctor stopped early in a padded-row run ({failed})"
            return report
        if report.replays and not any(r[1].trace for r in runs):
            # Both ended before their first replay, before any padded row was filled: whatever stopped them
            # (state a program keeps across runs, such as a capture helper's last graph) is not the padding.
            why = "; ".join(f"pattern {p}: {(_failed(r[0]) or ['no replay'])[0]}" for p, r in enumerate(runs))
            report.not_checked["stale-padding"] = f"both padded-row runs ended before their first replay ({why})"
            return report
        finding = compare_runs(*(r[1].trace for r in runs), *(_failed(r[0]) for r in runs))
        written = None                  # a finding at the line that writes the padded rows (_cured, _steered)
        if finding is not None and _held_neutral(report, doctor):
            report.note(f"stale-padding at {finding.location} is latent: {finding.evidence}; but as the runner "
                        "left them, the padded rows held values under which this run's results equal its run "
                        "without graphs' (a value it set once, before any step)")
            finding = None
        elif finding is None and _failed(report) and not any(_failed(r[0]) for r in runs):
            finding = crashed_only_as_left(_failed(report)[0], runs[0][1].trace[-1] if runs[0][1].trace else None, 2)
        elif finding is None and _failed(report) and all(_failed(r[0]) for r in runs):
            finding = written = _cured(workload, guard, doctor.plan.steps, _failed(report)[0])
        elif finding is None and not _failed(report) and _unexplained_padded(report, doctor):
            finding = _neutralised(doctor, runs) or (written := _steered(workload, guard, doctor.plan.steps))
        if finding is not None:
            _add_tested(report, finding, ahead=finding is written)
        report.not_checked.pop("stale-padding", None)
        report.note(f"stale-padding: {doctor.padded_steps} padded step(s); the workload was run twice "
                    "more with padded rows filled two ways")
    return report


def _filled(workload: Callable[[], Any], guard: bool, steps: list, inputs, pattern: int = 0) -> tuple[Report, Doctor]:
    """A padded-row run that fills the padded rows of the static inputs ``inputs`` ("all", or a set
    of names) too, those the runner writes before a replay included."""
    doctor = _planned(Doctor(guard=guard, pattern=pattern), steps)
    doctor.plan.inputs = inputs
    return _run(workload, doctor)


def _cured(workload: Callable[[], Any], guard: bool, steps: list, error: str) -> Finding | None:
    """The run failed, and so did both runs with the padded rows the runner left filled: run again
    with the padded rows of every static input filled with 0, those the runner writes before a
    replay too. Where that run completes, one input at a time (at most ``_CURED``) says whose
    padded rows, as the runner writes them, make the step fail: ``stale-padding`` where the values
    written there are made."""
    report, doctor = _filled(workload, guard, steps, "all")
    if _failed(report) or report.failure is not None:
        return None
    for name, written in list(doctor.plan.written.items())[:_CURED]:
        alone, _ = _filled(workload, guard, steps, frozenset((name,)))
        if not _failed(alone) and alone.failure is None:
            return written_by_runner(name, *written, error=error)
    return None


def _steered(workload: Callable[[], Any], guard: bool, steps: list) -> Finding | None:
    """A padded replay differed from the run without graphs, nothing explained it, and the two
    fills of the padded rows the runner left gave real rows the same results: the padded rows the
    runner *writes* (a pad value it chooses) may be what differs from a run without padding. Two
    runs fill them too, with 0 and with 1; where real rows differ, one input at a time (at most
    ``_CURED``) says whose padded rows reach them: ``stale-padding`` where those values are made."""
    def differ(inputs) -> tuple[Finding | None, Doctor]:
        runs = [_filled(workload, guard, steps, inputs, p) for p in (0, 1)]
        if any(r.failure is not None for r, _ in runs):
            return None, runs[0][1]
        return compare_runs(*(d.trace for _, d in runs), *(_failed(r) for r, _ in runs)), runs[0][1]
    found, doctor = differ("all")
    if found is None:
        return None
    for name, written in list(doctor.plan.written.items())[:_CURED]:
        if (alone := differ(frozenset((name,)))[0]) is not None:
            return written_by_runner(name, *written, differs=alone)
    return None


def _neutralised(doctor: Doctor, runs: list) -> Finding | None:
    """A padded replay differed from the run without graphs, the two fills of the padded rows the
    runner left agree, and with either fill the workload's results equal its run without graphs:
    only the values the runner left there (an earlier step's data) make real rows differ, which
    any neutral value cures (a reduction over the padded batch, an amax, that small values do not
    move). The finding is at the graph's first reader of the padded buffers."""
    if not runs or not all(d.plan.agrees for _, d in runs) or doctor.reference.verdict in (None, ()):
        return None
    graph, text = next((g, t) for g, t, padded in doctor.reference.unexplained if padded)
    record = next((r for r in runs[0][1].trace if r["graph"] == graph and r["real"] < (r["size"] or 0)), None)
    return neutralised(record, text.split(": ")[0], doctor.reference.verdict)


def _held_neutral(report: Report, doctor: Doctor) -> bool:
    """Whether the run as the runner left its padded rows gave the results of the workload's run
    without graphs (``events.results``) and raised nothing: the two fills show that real rows would
    depend on other padded values, but the values the runner keeps there (a sentinel it set once,
    before the steps, that no step overwrote) are neutral. A latent hazard, a note: a runner that
    left an earlier step's data there would not have given the reference's results."""
    return doctor.reference is not None and doctor.reference.verdict == () and not _failed(report)


def _unexplained_padded(report: Report, doctor: Doctor) -> bool:
    """Whether a padded replay differs from the workload's run without graphs and no finding explains it."""
    return doctor.reference is not None and any(padded and text in report.unexplained
                                                for _, text, padded in doctor.reference.unexplained)


def _failed(report: Report) -> list[str]:
    """What a run raised: the workload's error, else op failures it caught (a serving loop that drops
    the batch, a harness that compares outcomes)."""
    return report.errors or report.caught


def _add_tested(report: Report, finding: Finding, ahead: bool = False) -> None:
    """Add a finding of the padded-row runs. A watched finding at the same op is dropped (the runs'
    evidence includes it); those that follow from it become its notes (``_explained_by_padding``).
    ``ahead``: the runs filled the padded rows the runner *writes* and saw the outcome change, so
    the finding names the line that chooses what padded rows hold. It goes before the watched
    run's findings of its kind, which name where some op read those rows: the runs tested which
    write decides the step, and that write is what a fix changes. Other findings of the runs
    (the first op whose results the two fills part) come after the watched run's."""
    report.findings = [f for f in report.findings if (f.kind, f.source) != (finding.kind, finding.source)]
    first = next((i for i, f in enumerate(report.findings) if f.kind == finding.kind), None) if ahead else None
    report.findings.insert(len(report.findings) if first is None else first, finding)
    _explained_by_padding(report, finding)


def _explained_by_padding(report: Report, padding) -> None:
    """A real row's static input that a step left unwritten (``stale-input``) because padded rows
    steered what the runner wrote (a metadata builder that skipped the refresh) is the padding's
    consequence: the finding at the same read becomes a note of the padding finding. So is the
    unpadded step's view of the same padded rows (``probes/unpadded.py``), which localises less, and
    a difference from the reference run (``probes/reference.py``) of the padding finding's graph,
    found or not, which the padded rows explain."""
    for f in [f for f in report.findings if f is not padding and (
            (f.kind == "stale-input" and f.source == padding.source) or
            (f.kind == "stale-padding" and "output" in f.numbers and "unpadded" in f.numbers) or
            "reference_call" in f.numbers)]:
        report.findings.remove(f)
        report.note(f"{f.kind} at {f.location} follows from the stale padded rows: {f.evidence}")
    for text in [u for u in report.unexplained if u.startswith("replay ") and f" of {padding.graph} (" in u]:
        report.unexplained.remove(text)
        report.note(f"a difference from the run without graphs follows from the stale padded rows: {text}")


def exercise(make_runner: Callable[[], GraphRunner], make_batch: Callable[[int, int], Mapping[str, torch.Tensor]],
             rows: Sequence[int] | None = None) -> Callable[[], None]:
    """A workload for ``diagnose``: a fresh runner, captured, then one batch per entry of ``rows``."""
    if not callable(make_runner) or not callable(make_batch):
        raise TypeError("exercise() needs make_runner() -> GraphRunner and make_batch(n, step) -> dict of tensors")

    def workload() -> None:
        runner = make_runner()
        if not isinstance(runner, GraphRunner):
            raise _Misuse(f"make_runner must return a GraphRunner, got {type(runner).__name__}: return the "
                          "runner itself (not yet captured)")
        runner.capture()
        sizes = runner.capture_sizes
        default = [runner.max_size, *sorted({n for s in sizes for n in (s, s - 1) if n > 0}, reverse=True)]
        with torch.no_grad():
            for step, n in enumerate(default if rows is None else rows):
                batch = make_batch(n, step)
                if not isinstance(batch, Mapping) or not all(isinstance(v, torch.Tensor) for v in batch.values()):
                    raise _Misuse(f"make_batch({n}, {step}) must return a dict of tensors (input name -> tensor), "
                                  f"got {type(batch).__name__}")
                runner(**batch)
    return workload


def _planned(doctor: Doctor, ahead: list | None) -> Doctor:
    """A doctor that records the steps it sees served (the first run), or is given them (a
    padded-row run, which fills the next step's padded rows after each step)."""
    doctor.plan = Plan(ahead)
    return doctor


def _run(workload: Callable[[], Any], doctor: Doctor) -> tuple[Report, Doctor]:
    try:
        with watching(doctor), composite.watching(doctor):
            raised.start(doctor)
            uncomputed.returned(doctor, workload())     # what a workload returns is its result
    except _Misuse:
        raise
    except Exception:  # noqa: BLE001, S110 - watching() lists what the workload raised in the report
        pass
    finally:
        raised.stop()                   # errors are watched as raised only while the workload runs
    return doctor.report, doctor
