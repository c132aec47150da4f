"""The probes: evidence that needs extra work beyond watching. Mutation replays (does a replay keep
changing a static input?), padded-row and padded-column fills (``diagnose``), differential replay
(does the replay give what an eager run of the same step gives?) and launch-trace comparison."""
from __future__ import annotations

import contextlib
import dataclasses
import itertools

_order = itertools.count()      # breaks ties between findings held at one place in the report: the order held


@contextlib.contextmanager
def held(doctor, into: list | None):
    """What ``doctor.add`` is given goes to ``into`` (a graph's ``held`` or ``held_state``), when
    given one: ``probes/reference.py`` reports it (``release``) once a replay of that graph, or the
    workload's results, give another answer than the run without graphs."""
    outer, doctor.holding = doctor.holding, into
    try:
        yield
    finally:
        doctor.holding = outer


def hold(doctor, finding, key: tuple) -> None:
    """``doctor.add`` while holding: the finding goes to the list held into, with the place in the
    report it would have had unheld (``release`` puts it back there)."""
    doctor.holding.append((finding, key, (len(doctor.report.findings), next(_order))))


def release(doctor, *held: list, why: str = "") -> None:
    """Report the findings in a graph's ``held`` lists (``why``: added to each one's evidence), each
    in the place in the report it would have had unheld, and empty them."""
    fs, moved = doctor.report.findings, 0
    for finding, key, (place, _) in sorted((entry for findings in held for entry in findings), key=lambda e: e[2]):
        before = len(fs)
        doctor.add(dataclasses.replace(finding, evidence=finding.evidence + why) if why else finding, key)
        if len(fs) > before:                 # a new finding: at its place, after those released there before it
            if place + moved < len(fs) - 1:
                fs.insert(place + moved, fs.pop())
            moved += 1
    for findings in held:
        findings.clear()
