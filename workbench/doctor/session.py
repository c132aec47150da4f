"""``watch()``: one dispatch mode and one subscription to the engine's events for a block of code."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..engine import events
from .intake import DELIBERATE, Doctor
from .report import Report
from .rules import undersized

_SETITEM = torch.Tensor.__setitem__


class _Watch(TorchDispatchMode):
    def __init__(self, doctor: Doctor) -> None:
        super().__init__()
        self.doctor = doctor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        doctor, kwargs = self.doctor, kwargs or {}
        if doctor.phase in ("replay", "probe") or doctor.failure is not None:
            return func(*args, **kwargs)
        run = _Call(func, args, kwargs)
        try:
            return doctor.on_op(func, args, kwargs, run)
        except DELIBERATE:
            raise
        except Exception as e:
            if e is run.error:                   # the op itself failed: the watched code's error
                raise
            doctor.fail(e, f"watching {func}")
            return run.result()


class _ItemAssignment(TorchFunctionMode):
    """Sees ``tensor[index] = value`` before it becomes a view: the only write path whose slicing
    dispatches no op (the shape contract needs the index)."""

    def __init__(self, doctor: Doctor) -> None:
        super().__init__()
        self.doctor = doctor

    def __torch_function__(self, func, types, args=(), kwargs=None):
        doctor = self.doctor
        if func is _SETITEM and doctor.buffers and doctor.failure is None and doctor.phase != "differential":
            try:
                undersized.check_index(doctor, args[0], args[1])
            except Exception as e:  # noqa: BLE001 - the doctor's own error, reported in the Report
                doctor.fail(e, "watching Tensor.__setitem__")
        return func(*args, **(kwargs or {}))


class _Call:
    """The watched op, run at most once whatever the doctor does around it (an in-place op run
    twice after a failure of the doctor would corrupt the user's data)."""

    __slots__ = ("func", "args", "kwargs", "done", "out", "error")

    def __init__(self, func, args, kwargs) -> None:
        self.func, self.args, self.kwargs = func, args, kwargs
        self.done, self.out, self.error = False, None, None

    def __call__(self):
        try:
            self.out = self.func(*self.args, **self.kwargs)
        except BaseException as e:
            self.error = e
            raise
        self.done = True
        return self.out

    def result(self):
        return self.out if self.done else self()


@contextlib.contextmanager
def watch(*, guard: bool = False, differential: int = 0) -> Iterator[Report]:
    """Observe every capture, warmup and replay inside the block; yields the ``Report``, complete
    when the block ends. ``guard=True`` raises ``DanglingReferenceError`` instead of replaying a
    graph whose referenced memory is gone (on CUDA that replay is an illegal memory access, which
    ends the process's CUDA context). ``differential=N`` compares every Nth served replay that
    announces an eager step with an eager run of that step (0: off; it costs about one eager
    step per sampled replay)."""
    with watching(Doctor(guard=guard, differential=differential)) as doctor:
        yield doctor.report


@contextlib.contextmanager
def watching(doctor: Doctor) -> Iterator[Doctor]:
    """``watch()`` with a given observer (``diagnose`` keeps its probe records)."""
    mode = doctor.mode = _Watch(doctor)
    items = _ItemAssignment(doctor)
    events.subscribe(doctor)
    items.__enter__()
    mode.__enter__()
    start = time.perf_counter()
    try:
        yield doctor
    except BaseException as e:
        doctor.report.errors.append(doctor.describe_error(e))
        raise
    finally:
        mode.__exit__(None, None, None)
        items.__exit__(None, None, None)
        events.unsubscribe(doctor)
        doctor.finish()
        doctor.report.seconds = time.perf_counter() - start
