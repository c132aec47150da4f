"""A sampled replay that raises where an eager run of the same step completes.

An emulated replay runs the captured ops on the replay's memory. When one of them raises (an index
past a dimension the capture sized, a shape the capture fixed), the same step run eagerly from the
state before the replay says whether the graph is to blame: when that run completes, and launches
other work than the graph replays, what the capture froze (a plan, a size, a branch) is not what
Python decides for this step. The launch traces say where the two part, and the parting gives the
kind, op and line as a differential replay's difference does (``rootcause.parted``). When the
eager run raises too, the step fails without graphs as well: not the graph's doing. When it
completes and launches the same work, the replay's data differ from the eager step's, not its
work: noted, not classified.

On CUDA a replay does not raise (a kernel's fault ends the context later); a sampled replay that
would index out of range is stopped before launch instead (``differential.before_launch``).
"""
from __future__ import annotations

from .. import explain
from ..failures import failed_op
from ..report import Finding
from ..tensors import first_line
from . import launch, rootcause


def compare(doctor, info, pending, error: BaseException, run_eager) -> None:
    """``run_eager(**how)``: the step's eager form, traced, from the state before the replay (the
    failed replay's state put back after it)."""
    run, got, eager_error = run_eager()
    if eager_error is not None or got is None:
        return
    op = failed_op(error)
    raised = (f"replay {info.replays} of {info.name} raised {type(error).__name__}: {first_line(error)}"
              + (f" in {op.func}, recorded at {op.source}" if op is not None else ""))
    divergence = launch.compare(*launch.traces(info, pending, run))
    if divergence is None:
        doctor.report.note(f"{raised}; an eager run of the same step, from the state before the replay, completes "
                           "and launches the same work: the replay's data differ from its, not its work")
        return
    launch.trace_number(divergence, run_eager)
    kind, at, tensor, why = rootcause.parted(doctor, info, divergence, run)
    name, source = (at.name, at.source) if at is not None else ("-", "-")
    text = f"the replay raised {type(error).__name__}, the eager step completes"
    doctor.add(Finding(kind, info.name, name, tensor, source,
                       f"{raised}; an eager run of the same step, from the state before the replay, completes",
                       explain.differential(info.name, text, why),
                       {"replay": info.replays, "crashed": type(error).__name__, "launch": divergence.index + 1,
                        "how": divergence.how}), (kind, name, source))
