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


def borne_out(doctor, verdict, by_input: set, outcomes: dict) -> None:
    """At the end, what each graph's probes found and held: reported where the workload's results
    differ from its run without graphs (``verdict``: ``events.results``), held state differences also
    where it did not say; the rest is a note. Not a graph's held findings where each of its replays
    compared gave the reference's answers while another graph's parted (``outcomes``: graph name ->
    whether its replays agreed, parted): the results part where that one does. Nor where a replay of
    it parted in a static input it reads (``by_input``), which says more than what its eager form
    parted on, unless what was held is an input the step left stale, whence those values may come."""
    parted = {name for name, seen in outcomes.items() if False in seen}
    for info in doctor.graphs.values():
        stale = any(h[0].kind in ("stale-input", "stale-padding") for h in info.held + info.held_state)
        if verdict and info.name in by_input and not stale:
            info.held.clear()
            info.held_state.clear()
        elsewhere = bool(parted) and outcomes.get(info.name) == {True}
        if verdict:
            i, diff = verdict
            how = ("a replay of it gave another answer than its step of the run without graphs, and" if info.name in
                   parted else f"no replay of {info.name} compared gave another answer than the run without graphs, but")
            release(doctor, info.held_state, *(() if elsewhere else (info.held,)),
                    why=f"; {how} the workload's result {i} differs from that run's (max |diff| = {diff:.3g})")
        elif verdict is None:
            release(doctor, info.held_state)
        held = info.held + info.held_state
        if held:
            first = held[0][0]
            doctor.report.note(
                f"{info.name}: {len(held)} finding(s) held until a replay bore them out ({first.kind} at "
                f"{first.location}: {first.evidence}), but every replay gave the reference run's answers"
                + (" and so did the workload's results" if verdict == () else "")
                + (f" (the results part where {', '.join(sorted(parted))} did not)" if elsewhere else "")
                + ": what was seen did not change what the step computes (an eager form that is not the step, "
                "memory that is the workload's own, a buffer two graphs read alike): not reported")
