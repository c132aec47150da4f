"""Errors: what the watched code raised (tied to the recorded op of a replay, or kept when it was
caught), and the doctor's own, which are contained.

An error that leaves ``watch()`` is the workload's failure (the report's headline says so). An op
that raised inside the workload, which then caught the error (a test harness, a serving loop that
drops the batch), is kept too: a report must not read "0 findings" over an index out of range.
"""
from __future__ import annotations

import functools
import sys
import traceback

from ..engine.errors import CaptureError
from ..engine.source import user_frame
from .rules import dangling, extent, lookups, shapes, undersized, unwritten
from .rules.dangling import DanglingReferenceError
from .tensors import first_line

_KEPT = 3          # caught op failures kept per watch

# What the doctor raises on purpose, into the watched code: a guarded replay, a host sync refused
# during a CUDA capture (as the CPU engine refuses it). Anything else it raises is its own failure.
DELIBERATE = (DanglingReferenceError, CaptureError)


def own_error(error: BaseException, where: str) -> str:
    """The doctor's own error in words: its type, the event it broke in, the innermost frame, then
    up to three of the doctor's frames that led there (an op raising inside the doctor's dispatch
    wrappers says nothing of which mechanism ran it), and its message."""
    frames = traceback.extract_tb(error.__traceback__) if error.__traceback__ else []
    mine = [f for f in frames[:-1] if "/workbench/doctor/" in f.filename.replace("\\", "/")][-3:][::-1]
    at = " at " + ", from ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in [*frames[-1:], *mine]) \
        if frames else ""
    return f"{type(error).__name__} in {where}{at}: {first_line(error)}"


def contained(handler):
    """An event handler whose own failure is reported, not raised into the watched code: a
    diagnostic must never break what it diagnoses. After a failure the doctor stops watching."""
    @functools.wraps(handler)
    def run(self, *args, **kwargs):
        if self.failure is not None or self.phase == "differential":
            return None
        try:
            return handler(self, *args, **kwargs)
        except DELIBERATE:
            raise
        except Exception as e:  # noqa: BLE001 - the doctor's own error, reported in the Report
            self.fail(e, handler.__name__)
            return None
    return run


def op_failed(doctor, func, args, kwargs, error: BaseException) -> None:
    """An op of the watched code raised (in eager code, a warmup or a capture); the doctor's own
    runs (probes, differential replay) are not the workload's."""
    if doctor.phase not in ("eager", "warmup", "capture"):
        return
    doctor.op_error = id(error)
    keep(doctor, id(error), lambda: f"{type(error).__name__}: {first_line(error)} (raised by {func} at {user_frame()}, "
                                    f"during {doctor.phase})")
    try:
        if unwritten.failed(doctor, func, args, kwargs, error) or \
                doctor.moved and dangling.read_after_release(doctor, func, args, kwargs, error):
            return
        undersized.failed_write(doctor, func, args, kwargs, error)
        undersized.failed_read(doctor, func, args, kwargs, error)
        undersized.failed_allocation(doctor, func, args, kwargs, error)
        extent.failed_view(doctor, func, args, error)
        if doctor.clamped.failed_op(doctor, func, args, kwargs, error):
            return
        shapes.failed_op(doctor, func, args, kwargs, error)
        if doctor.phase in ("warmup", "capture") and not lookups.failed_sentinel(doctor, func, args, error):
            lookups.failed_lookup(doctor, func, args, error)
    except Exception as e:  # noqa: BLE001 - the doctor's own error, reported in the Report
        doctor.fail(e, f"explaining the failure of {func}")


def replay_failed(doctor, info, error: BaseException, where: str) -> None:
    """A replay of the watched code raised (``where``: the recorded op, ``recorded_op``); kept like
    an op failure, so that a workload that catches it is not reported as clean. A lookup past a
    table's end may be padded rows' doing (``lookups.failed_replay_lookup``)."""
    keep(doctor, id(error), lambda: f"{type(error).__name__}: {first_line(error)} ({where})")
    try:
        lookups.failed_replay_lookup(doctor, info, info.pending, error, *failed_call(error))
    except Exception as e:  # noqa: BLE001 - the doctor's own error, reported in the Report
        doctor.fail(e, "explaining the failure of a replay")


def keep(doctor, error_id: int, describe_error, codes: tuple | None = None) -> None:
    """List an error the watched code raised (``describe_error()`` says what and where) among those
    the report shows if the workload catches it; the first ``_KEPT`` of a watch are kept. ``codes``:
    the functions it was raised under (else those running now), which it cut short (``coverage``)."""
    explained(doctor, error_id)
    if len(doctor.failed_ops) < _KEPT and error_id not in doctor.failed_ops:
        doctor.failed_ops[error_id] = describe_error()
        doctor.failed_codes.update(codes if codes is not None else stack_codes(sys._getframe(1)))


def explained(doctor, error_id: int) -> None:
    """The error proved a failure of the workload: the explanation a rule gave it where it was raised,
    if any, is a finding. Only the last one is held: an error the workload caught is never heard of
    again, and its id is reused."""
    if doctor.explanation is not None and doctor.explanation[0] == error_id:
        doctor.add(*doctor.explanation[1:])
        doctor.explanation = None


def pending(doctor, error: BaseException) -> bool:
    """Whether ``error`` has an explanation waiting for it to prove a failure."""
    return doctor.explanation is not None and doctor.explanation[0] == id(error)


def stack_codes(frame) -> tuple:
    """The functions of a frame and of those it was called from."""
    out = []
    while frame is not None:
        out.append(frame.f_code)
        frame = frame.f_back
    return tuple(out)


def describe(doctor, error: BaseException) -> str:
    """The workload's error for the report, tied to the recorded op when a replay raised it; no
    longer a caught one."""
    doctor.failed_ops.pop(id(error), None)
    explained(doctor, id(error))
    tb = error.__traceback__
    while tb is not None:
        doctor.failed_codes.add(tb.tb_frame.f_code)
        tb = tb.tb_next
    text = f"{type(error).__name__}: {first_line(error)}"
    if doctor.replay_error is not None and doctor.replay_error[0] is error:
        text += f" ({doctor.replay_error[1]})"
    shapes.failed(doctor, error)
    return text


def recorded_op(error: BaseException, graph: str) -> str:
    """Where in the captured code an emulated replay failed: the recorded op the replay was
    running (the CPU graph's replay loop holds it), else just the graph."""
    op = failed_op(error)
    if op is None:
        return f"raised by the replay of {graph}"
    return f"raised by the replay of {graph} in {op.func}, recorded at {op.source}"


def failed_op(error: BaseException):
    """The recorded op an emulated replay was running when it raised (``func``, ``source``), or None
    (a CUDA replay, whose failure a kernel reports later, has none)."""
    return failed_call(error)[0]


def failed_call(error: BaseException) -> tuple:
    """``(op, args)``: the recorded op an emulated replay was running when it raised, and the
    arguments the replay bound it to (the tensors it ran on), or ``(None, ())``."""
    tb, found = error.__traceback__, (None, ())
    while tb is not None:
        candidate = tb.tb_frame.f_locals.get("op")
        if hasattr(candidate, "source") and hasattr(candidate, "func"):
            found = (candidate, tb.tb_frame.f_locals.get("args") or ())
        tb = tb.tb_next
    return found
