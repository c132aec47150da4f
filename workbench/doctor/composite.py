"""Errors a torch function raises before it dispatches any op (under ``diagnose``).

A composite op checks its arguments in C++ before it decomposes into the ops the doctor's dispatch
mode sees: ``repeat_interleave``'s sizes, ``narrow``'s range, ``reshape``'s element count,
``split``'s sizes. Such a failure never reaches ``failures.op_failed`` and its rules; the error
tracer (``raised.py``) sees it in the workload's frame, but without the call's arguments, which are
what tell which rows or which buffer disagree. A function mode sees the call with its arguments,
so a failure no dispatched op reported goes to the same shape contracts: a tensor of a graph's
padded rows against one of the real rows (``shapes.failed_op``), and a range asked past the end of
an announced buffer (``undersized.check_range``, the contract of a slice assignment). It also
sees a tensor's memory handed to host code while a capture is open (``Tensor.numpy()``,
``__array__``, ``data_ptr()``), which no op shows (``rules/host_writes.py``).

Only under ``diagnose``, as the tracer: a function mode puts a Python call in front of every torch
call, an emulated replay's ops included (let through at once: only the workload's own phases are
watched). ``watch()`` alone, whose cost per step is measured, does not install it.
"""
from __future__ import annotations

import contextlib
import sys

from torch.overrides import TorchFunctionMode

from .failures import DELIBERATE
from .probes import held
from .rules import host_writes, shapes, undersized

_WATCHED = ("eager", "warmup", "capture")


class _Calls(TorchFunctionMode):
    def __init__(self, doctor) -> None:
        super().__init__()
        self.doctor = doctor

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.doctor.capturing is not None and args and getattr(func, "__name__", None) in host_writes.HANDED:
            try:
                host_writes.handed(self.doctor, args[0], sys._getframe(1))
            except Exception as e:  # noqa: BLE001 - the doctor's own error, reported in the Report
                self.doctor.fail(e, "following memory handed to host code")
        try:
            return func(*args, **kwargs)
        except DELIBERATE:
            raise
        except Exception as error:
            doctor = self.doctor
            if doctor.failure is None and doctor.phase in _WATCHED and id(error) != doctor.op_error:
                try:
                    failed(doctor, func, args, kwargs, error)
                except Exception as e:  # noqa: BLE001 - the doctor's own error, reported in the Report
                    doctor.fail(e, f"explaining the failure of {getattr(func, '__name__', func)}")
            raise


def failed(doctor, func, args, kwargs, error: BaseException) -> None:
    """A torch function failed and no op it dispatched did (``doctor.op_error``): its own check
    of its arguments. The rules read tensors and sizes, never the function's name, except the one
    view whose arguments are a range (``narrow``: dimension, start, length). What they find is
    held until the error proves a failure (``failures.explained``): a capability probe that calls
    the function and catches its error is no failure."""
    name = getattr(func, "__name__", None)
    if not shapes.explainable(error) or name == "__setitem__":     # (an item assignment has its own contract)
        return
    found: list = []
    with held(doctor, found):
        if name == "narrow" and len(args) >= 4 and all(type(a) is int for a in args[1:4]):
            undersized.check_range(doctor, args[0], args[1], args[2] + args[3], "narrow")
        shapes.failed_op(doctor, func, args, kwargs, error)
    if found:
        finding, key, _ = found[0]
        doctor.explanation = (id(error), finding, key)


@contextlib.contextmanager
def watching(doctor):
    """The workload's torch calls seen with their arguments while it runs."""
    with _Calls(doctor):
        yield
