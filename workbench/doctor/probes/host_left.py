"""Python containers an eager step changes and its replay leaves alone, where nothing else explains results that differ.

A replay runs kernels only. Differential replay reports the tensor bindings an eager step moves
(``pystate.changes``) and the plain values it sets (``pystate.settings``) outright. A container
it grows or empties -- a transfer queued for a layer, a request's count added to a dict, work
taken off a list -- may as well be a cache the eager path fills for itself, so on its own it is
no evidence. Where the workload's results differ from its run without graphs and no other finding
explains them, it is: the step's Python did host work that no replay repeats, and the code after
the step found what the replays left. ``keep`` holds the first such change of each graph, with the
line that made it (found by running the eager step once more, traced: only for a container the step
added to); ``report`` names it as ``host-work-frozen`` at that line.
"""
from __future__ import annotations

import dataclasses

from .. import explain
from ..report import Finding


def grown(run):
    """``run`` with only the containers its eager step added to (``run.host``): one it took work
    from ran that work, and running the step again to find the line would run it once more."""
    return dataclasses.replace(run, host=[entry for entry in run.host if entry[4]])


def keep(info, found: tuple | None) -> None:
    """Keep ``found`` -- ``(container, what changed, line, whether a number moved)``, or None where no
    line changed it -- as ``info``'s host work left undone, with the replay that showed it."""
    info.host_left = (*found, info.replays) if found is not None else ()


def report(doctor, verdict: tuple) -> None:
    """Name the first graph's kept change (``keep``) as the host work behind results that differ."""
    for info in doctor.graphs.values():
        if info.host_left:
            label, change, line, _, replay = info.host_left
            i, diff = verdict
            evidence = (f"the workload's result {i} differs from its run without graphs' (max |diff| = {diff:.3g}); at "
                        f"replay {replay} of {info.name} the outputs and state agreed with an eager run of the same "
                        f"step, but that eager step {change} at {line}, which the replay leaves as it found it")
            doctor.add(Finding("host-work-frozen", info.name, "-", label, line, evidence,
                               explain.host_left(label, info.name), {"replay": replay}),
                       ("host-work-frozen", "host left", line))
            return
