"""What a watch ends with: the last checks, what could not be checked and why, and notes.

A report that lists no finding must say what it did not look at (a kind no runner gave evidence
for, differential replay without an eager step, storages too large to keep), or an empty list
would pass for a clean bill of health it did not earn."""
from __future__ import annotations

import gc

from .report import KINDS, Report
from .rules import dangling, mutation, unread, warmup


def finish(doctor) -> Report:
    report = doctor.report
    if doctor.failure is None:
        try:
            _final_checks(doctor)
        except Exception as e:  # noqa: BLE001 - the doctor's own error, reported in the Report
            doctor.fail(e, "_final_checks")
    report.caught = [] if report.errors else list(doctor.failed_ops.values())
    report.not_checked = {k: why for k, why in _not_checked(doctor).items() if k not in report.kinds}
    if doctor.every and doctor.served and doctor.no_eager == doctor.served:
        report.skipped["differential replay"] = "no eager step announced (serve(..., eager=...))"
    elif not doctor.every and report.captures:
        report.skipped["differential replay"] = "off (watch(differential=N) or diagnose() turns it on)"
    if doctor.compared:
        report.note(f"differential replay: {doctor.compared} replay(s) compared with an eager run "
                    "of the same step")
    if doctor.startup.skipped:
        report.note(f"{doctor.startup.skipped} storage(s) the warmups wrote were too large to keep: what "
                    "dummy batches left there was not checked")
    if doctor.unknown_replays:
        report.note(f"{doctor.unknown_replays} replays of graphs captured before watch() were not checked")
    report.findings.sort(key=lambda f: KINDS.index(f.kind))
    return report


def _final_checks(doctor) -> None:
    """Liveness once more (memory released after the last replay), and graphs that write a
    static buffer but were never replayed, so never probed. Where memory a graph reads has gone,
    garbage is collected first (about 0.1 s with torch loaded, so only then): a graph left in a
    reference cycle whose tensors went already is no longer anyone's graph. The doctor first lets
    go of the way to the Python state each graph's eager step reaches (``reach``): a closure's
    cell it kept would otherwise keep the runner, and its graphs, alive after the program let go."""
    for info in doctor.graphs.values():
        info.python = None
    if any(info.ref() is not None and dangling.released_since_watched(info) for info in doctor.graphs.values()):
        gc.collect()
    for info in list(doctor.graphs.values()):
        if (graph := info.ref()) is None:
            continue
        if not _unserved(doctor, info) and getattr(graph, "captured", True):   # (a reset graph replays no more)
            dangling.check(doctor, info, before_replay=False)
        if not info.probed:
            mutation.unprobed(doctor, info)
    mutation.warmup_updates(doctor)
    unread.finish(doctor)
    doctor.warm.captures_over()
    for info in doctor.graphs.values():
        warmup.check(doctor, info)


def _not_checked(doctor) -> dict[str, str]:
    if doctor.failure is not None:
        return {k: f"the doctor stopped early ({doctor.failure})" for k in KINDS}
    if doctor.report.captures == 0:
        why = {k: "nothing was captured inside watch()" for k in KINDS}
        if doctor.buffers:                          # announced capture inputs were still checked
            del why["undersized-buffer"]
        return why
    why = {"stale-padding": "needs two runs with the padded rows filled differently: use diagnose()"}
    if not doctor.buffers:
        why["persistent-mutation"] = "no runner announced its static input buffers"
        why["undersized-buffer"] = "no runner announced its static input buffers"
    if not any(info.warmup is not None for info in doctor.graphs.values()) and not doctor.compared:
        why["warmup-divergence"] = "no warmup run was announced before any capture"
    if not doctor.compared:
        why["stale-input"] = "needs differential replay of served steps with an eager form (diagnose())"
        why["host-work-frozen"] = ("values Python decides per step are compared only by differential replay of "
                                   "served steps with an eager form (diagnose(), serve(..., eager=...))")
    elif not doctor.carried.captured:
        why["stale-input"] = "no graph reads an announced static input buffer"
    if not doctor.handed_any:
        why["overwritten-output"] = "no runner handed graph outputs out"
    return why


def _unserved(doctor, info) -> bool:
    """Whether everything that fed the graph has gone: every announced static input it reads, and
    every graph whose outputs it reads (the earlier pieces of a step). The runner that served it let
    go of it, and only a stray reference (a capture helper's last graph) keeps the graph: what else
    it read going away with the runner is no hazard, since nothing can prepare a replay of it."""
    inputs = [key for key in info.externals if (buf := doctor.buffers.get(key)) is not None and buf.role == "input"]
    feeders = [owner for owner, *_ in info.foreign.values()]
    return bool(inputs or feeders) and all(doctor.buffer(key) is None for key in inputs) \
        and all(owner.ref() is None for owner in feeders)
