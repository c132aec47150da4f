"""``watch()``: one dispatch mode and one subscription to the engine's events for a block of code."""
from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator

import torch
from torch._C import _pop_torch_dispatch_stack, _push_on_torch_dispatch_stack
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from ..engine import events
from ..engine.opinfo import unique_storage_keys
from . import failures
from .failures import DELIBERATE
from .intake import _ASIDE, Doctor
from .report import Report
from .rules import dangling, extent, overwritten, staging, undersized, unread
from .uninit import filled


class _Watch(TorchDispatchMode):
    def __init__(self, doctor: Doctor) -> None:
        super().__init__()
        self.doctor = doctor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _RESIZE:
            return _resize(self.doctor, func, args, kwargs or {})
        return _watched(self.doctor, func, args, kwargs or {})


_RESIZE = torch.ops.aten.resize_.default


def _resize(doctor: Doctor, func, args, kwargs):
    """``Tensor.resize_``: past its storage's size it gives the storage new memory and frees the
    old, which graphs that read the storage still address (``rules/dangling.moved``)."""
    storage = args[0].untyped_storage()
    before = storage.data_ptr()
    out = _watched(doctor, func, args, kwargs)
    _moved(doctor, storage, before)
    return out


def _moved(doctor: Doctor, storage, before: int) -> None:
    """Tell the rules when a resize moved memory a storage had (``before``: its old address)."""
    if before and storage.data_ptr() != before and doctor.failure is None:
        try:
            dangling.moved(doctor, storage)
        except Exception as e:  # noqa: BLE001 - the doctor's own error, reported in the Report
            doctor.fail(e, "watching resize_")


def _storage_resize(doctor: Doctor):
    """``UntypedStorage.resize_``, which dispatches no op: the same move as ``_resize`` (to 0 bytes,
    the idiom that frees a storage under the tensors that keep it)."""
    original, own = torch.UntypedStorage.resize_, "resize_" in vars(torch.UntypedStorage)

    @functools.wraps(original)
    def resize_(self, size):
        before = self.data_ptr()
        out = original(self, size)
        _moved(doctor, self, before)
        return out

    def restore():
        if own:
            torch.UntypedStorage.resize_ = original
        else:
            del torch.UntypedStorage.resize_        # (the method torch's base class defines)
    return restore, resize_


def _watched(doctor: Doctor, func, args, kwargs):
    """One op, run by the doctor's rules (or past them, in the phases they leave alone)."""
    if doctor.phase in _ASIDE or doctor.failure is not None:
        return func(*args, **kwargs)
    run = _Call(func, args, kwargs)
    try:
        if doctor.through:
            extent.wrote(doctor, func, args, kwargs)
        out = doctor.on_op(func, args, kwargs, run)
        if func is extent.AS_STRIDED or doctor.through and func.is_view:
            extent.viewed(doctor, func, args, out)
        return out
    except DELIBERATE:
        raise
    except Exception as e:
        if e is run.error:                   # the op itself failed: the watched code's error
            failures.op_failed(doctor, func, args, kwargs, e)
            raise
        doctor.fail(e, f"watching {func}")
        return run.result()


def _engine_op(doctor: Doctor):
    """The handler of ``events.engine_op``: the engine's own op goes to the rules directly, with
    the mode off the stack while it runs (a dispatch mode costs more than the rules on these ops)."""
    def engine_op(func, args):
        mode = doctor.mode
        if _get_current_dispatch_mode() is not mode:     # a mode above ours: through the stack as usual
            return func(*args)
        _pop_torch_dispatch_stack(None)
        doctor.engine_serving = True
        try:
            return _watched(doctor, func, args, {})
        finally:
            doctor.engine_serving = False
            _push_on_torch_dispatch_stack(mode)
    return engine_op


def _item_assignment(doctor: Doctor):
    """``Tensor.__setitem__`` that first checks the index against an announced buffer's shape:
    ``buffer[a:b, c:d] = value`` is the only write path whose slicing dispatches no op. (A
    function mode would see it too, but would put Python in front of every op of every replay.)"""
    original = torch.Tensor.__setitem__

    @functools.wraps(original)          # (``__wrapped__``: host memory knows it for the crossing it is)
    def __setitem__(self, index, value):
        if doctor.buffers and doctor.failure is None and doctor.phase in ("eager", "warmup", "capture"):
            try:
                undersized.check_index(doctor, self, index)
            except Exception as e:  # noqa: BLE001 - the doctor's own error, reported in the Report
                doctor.fail(e, "watching Tensor.__setitem__")
        try:
            return original(self, index, value)
        except Exception as e:
            # (an index past the end is not this contract; and on CUDA indexing with it again to
            # look would fire a device-side assert, ending the context)
            if doctor.failure is None and doctor.phase in ("eager", "warmup", "capture") \
                    and not isinstance(e, IndexError):
                try:
                    undersized.failed_item_write(doctor, self, index, value)
                except Exception as e:  # noqa: BLE001 - the doctor's own error, reported in the Report
                    doctor.fail(e, "explaining a failed Tensor.__setitem__")
            raise
    return original, __setitem__


def _host_reads(doctor: Doctor) -> dict:
    """``Tensor.tolist``, ``Tensor.numpy`` and ``Tensor.cpu`` that first tell the doctor's rules a
    host read the tensor: on the CPU none dispatches an op (``cpu()`` returns the tensor itself; on
    CUDA each copies to the host through one, where the read happens), so a runner's host read of a
    static buffer, or of a handed-out output, would otherwise go unseen, or be seen later."""
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "cpu")}

    def wrap(name, original):
        @functools.wraps(original)          # (its name: torch's function modes key on it, the engine's guard too)
        def read(self, *args, **kwargs):
            if (doctor.copied or doctor.unread or doctor.handed or doctor.staged) and doctor.failure is None \
                    and doctor.phase == "eager":
                try:
                    unread.host_read(doctor, self)
                    staging.host_read(doctor, self)
                    if id(self) in doctor.handed:
                        overwritten.check_read(doctor, f"Tensor.{name}", (self,), None)
                except Exception as e:  # noqa: BLE001 - the doctor's own error, reported in the Report
                    doctor.fail(e, f"watching Tensor.{name}")
            return original(self, *args, **kwargs)
        return read
    return {name: (original, wrap(name, original)) for name, original in originals.items()}


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
    """``watch()`` with a given observer (``diagnose`` keeps its probe records). Storage keys are
    unique until the observer has finished: its records are keyed by storage."""
    keys = unique_storage_keys()
    keys.__enter__()
    mode = doctor.mode = _Watch(doctor)
    original, checked = _item_assignment(doctor)
    reads = _host_reads(doctor)
    restore_resize, resized = _storage_resize(doctor)
    doctor.engine_op = _engine_op(doctor)
    events.subscribe(doctor)
    torch.Tensor.__setitem__ = checked
    torch.UntypedStorage.resize_ = resized
    for name, (_, watched) in reads.items():
        setattr(torch.Tensor, name, watched)
    mode.__enter__()
    start = time.perf_counter()
    try:
        with filled() as doctor.fill:
            yield doctor
    except BaseException as e:
        doctor.report.errors.append(failures.describe(doctor, e))
        raise
    finally:
        mode.__exit__(None, None, None)
        torch.Tensor.__setitem__ = original
        restore_resize()
        for name, (kept, _) in reads.items():
            setattr(torch.Tensor, name, kept)
        events.unsubscribe(doctor)
        try:
            doctor.finish()
        finally:
            keys.__exit__(None, None, None)
        doctor.report.seconds = time.perf_counter() - start
