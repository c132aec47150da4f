"""warmup-divergence: the program's own check fails on the dummy batch of a warmup or a capture.

A runner warms up and captures on a batch it builds itself (vLLM's ``_dummy_run``): metadata made
for it by another path than a real step's (``build_for_cudagraph_capture``), fields a real step
fills left ``None``, lengths of zero. A check of what every real step carries then fails before
any graph exists, and only on the graph path: the run without graphs never builds that batch.
Where the workload's run without graphs (``probes/reference.py``) ran the same check and never
failed there, the failure is the dummy batch's: ``warmup-divergence`` at the check. Checks the
shape rules explain (a padded size against a real count) keep their explanation; this one is
reported only once the error proves a failure (``failures.explained``).
"""
from __future__ import annotations

import ast

from ...engine.source import location
from .. import explain_padding, failures
from ..report import Finding
from ..tensors import first_line
from . import checks


def failed_check(doctor, error: BaseException, frame) -> None:
    """The program's own check (``frame``'s ``assert`` or ``raise``) failed in a warmup or a capture."""
    reference = doctor.reference
    if doctor.phase not in ("warmup", "capture") or reference is None or reference.recording \
            or failures.pending(doctor, error):
        return
    line = (frame.f_code, frame.f_lineno)
    if line not in reference.coverage.first or line in reference.coverage.raised:
        return
    test = checks.test_at(frame)
    what = ast.unparse(test) if test is not None else type(error).__name__
    graph = doctor.capturing.name if doctor.capturing is not None else "-"
    source = location(frame)
    finding = Finding(
        "warmup-divergence", graph, "check", what, source,
        f"the program's check `{what}` failed during {doctor.phase} ({first_line(error) or type(error).__name__}), "
        "on the batch the runner made for it; the run without graphs ran the same check at every step and "
        "never failed it", explain_padding.dummy_batch(what, doctor.phase), {})
    doctor.explanation = (id(error), finding, ("warmup-divergence", "dummy batch", source))
