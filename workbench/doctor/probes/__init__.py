"""The probes: evidence that needs extra work beyond watching. Mutation replays (does a replay keep
changing a static input?), padded-row and padded-column fills (``diagnose``), differential replay
(does the replay give what an eager run of the same step gives?) and launch-trace comparison."""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def held(doctor, into: list | None):
    """What ``doctor.add`` is given goes to ``into`` (a graph's ``held`` or ``held_state``), when
    given one: ``probes/reference.py`` reports it once a replay of that graph, or the workload's
    results, give another answer than the run without graphs."""
    outer, doctor.holding = doctor.holding, into
    try:
        yield
    finally:
        doctor.holding = outer
