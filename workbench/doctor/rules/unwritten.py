"""stale-input in a dummy batch: a warmup or a capture failed on a static input nothing ever wrote.

A runner prepares a capture's dummy batch by writing its static inputs (token ids, slots,
lengths), then runs the warmups and the capture on them. An input that the preparation leaves out
holds what its allocation left (``torch.empty``'s leftovers, a placeholder fill): a kernel that
reads it as an index faults, or reads other memory. Both runs of a step without graphs go through
the runtime preparation, which writes it, so only the capture sees it.

The evidence is torch's version counter: every in-place write bumps it, through any view, and a
factory starts it at 0, so an announced buffer still at version 0 was never written since it was
made. Where the op that failed reads such an input (or, for an index past a table's end, the input
holds that index) while the same owner's other static inputs were written, the preparation that
wrote them is the refresh that left this one out: ``stale-input``, named at the function that
prepared the batch -- the frame, below the one that also runs the warmup, through which the other
inputs were written. Writes are followed for that before the first replay only (set-up), where a
served step pays nothing for them.
"""
from __future__ import annotations

import re

import torch

from ...engine.opinfo import describe, op_tensors, storage_key, written_tensors
from ...engine.source import location, user_frame, user_frames
from .. import explain
from ..report import Finding
from ..tensors import first_line
from . import where

_OUT_OF_BOUNDS = re.compile(r"index (-?\d+) is out of bounds")


def wrote(doctor, func, args, kwargs) -> None:
    """An eager in-place write during set-up: which frames wrote each storage (innermost first);
    and, outside a dummy run and the run without graphs, into a storage not yet announced as
    persistent state, that it holds the workload's own data (``mutation``: state announced after
    its contents were set)."""
    frames = None
    data = not doctor.dummy_run and (doctor.reference is None or not doctor.reference.recording)
    for t in written_tensors(func, args, kwargs):
        frames = frames or tuple((id(f), f.f_code, f.f_lineno) for f in user_frames())
        doctor.setup_writes[key := storage_key(t)] = frames
        if data and key not in doctor.announced:
            doctor.set_up_data.add(key)


def failed(doctor, func, args, kwargs, error: BaseException) -> bool:
    """A warmup's or a capture's op raised: is it a static input nothing wrote? (True: reported.)"""
    if doctor.phase not in ("warmup", "capture") or not doctor.buffers:
        return False
    read = {storage_key(t) for t in op_tensors(args, kwargs)}
    read -= {storage_key(t) for t in written_tensors(func, args, kwargs)}
    found = _OUT_OF_BOUNDS.search(first_line(error))
    value = int(found.group(1)) if found else None
    if isinstance(error, IndexError) and args and isinstance(args[0], torch.Tensor):
        read.discard(storage_key(args[0]))      # a lookup past a table's end: the index is suspect, not the table
    inputs = [b for b in doctor.buffers.values() if b.role == "input" and isinstance(b.ref(), torch.Tensor)]
    stale = next((b for b in inputs if b.ref()._version == 0 and (
        storage_key(b.ref()) in read or value is not None and _holds(b.ref(), value))), None)
    if stale is None:
        return False
    written = [b for b in inputs if b.owner == stale.owner and b.ref()._version > 0
               and storage_key(b.ref()) in doctor.setup_writes]
    if not written:
        return False
    frames = doctor.setup_writes[storage_key(written[-1].ref())]
    site = _preparer(frames)
    if site is None:
        return False
    at = user_frame()
    doctor.add(Finding(
        "stale-input", where(doctor), str(func), f"{stale.name}: {describe(stale.ref())}", site,
        f"during {where(doctor)}, {func} at {at} failed ({type(error).__name__}: "
        f"{first_line(error)}) reading {stale.name}, which nothing wrote since it was made, while "
        f"{', '.join(b.name for b in written)} were written for the dummy batch at {site}",
        explain.unwritten_input(stale.name, written[0].name),
        {"elements": stale.ref().numel()}), ("stale-input", stale.owner, stale.name, "unwritten"))
    return True


def _holds(t: torch.Tensor, value: int) -> bool:
    """Whether an integer buffer holds ``value`` (CUDA memory is not asked while a capture runs)."""
    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    return not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool and bool((t == value).any())


def _preparer(frames: tuple) -> str | None:
    """The frame of a set-up write just below the innermost frame still running now (the one that
    runs both the preparation and the warmup): the preparation's own function."""
    running = {(id(f), f.f_code) for f in user_frames()}
    for inner, outer in zip(frames, frames[1:]):
        if (outer[0], outer[1]) in running:
            return location(inner[1], inner[2])
    return None
