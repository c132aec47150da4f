"""persistent-mutation outside the graph: a step's static input, filled with the step's data, then
reset in place by other code before a reader of the same step failed on it.

A runner writes a step's inputs into its static buffers (a copy of the step's data), then hands
views of them to everything that prepares the step: each metadata builder in turn, the capture's
dummy run. Code that resets such a buffer in place (``zero_()``, ``fill_()``) -- a capture path
covering up a kernel's out-of-range access, a reset meant for a copy of its own -- blanks the input
for every reader after it: the buffer is the runner's, shared, and not that code's to write.

Without a reference run this shows only as a failure: the program's own check (an ``assert``, a
``raise``) fails in a frame that holds a view of the buffer, and the elements it views were last
written by such a reset, in a function other than the one that wrote the step's data there. The
finding names the reset, and is reported once the error proves a failure (``failures.explained``).
Only a reset of data written for the same step counts: one between a replay and the next step's data
is the runner clearing the buffer before it refills it (the standard fix for stale rows).
Writes are followed during set-up (before the first replay: where captures are prepared) and, with
differential replay on, throughout; a served step with it off pays nothing for them.
"""
from __future__ import annotations

import torch

from ...engine.opinfo import describe, storage_key
from ...engine.source import location, user_code_frame
from .. import explain
from ..report import Finding
from ..tensors import first_line, overlap, span
from . import where

_RESETS = (torch.ops.aten.zero_, torch.ops.aten.fill_)


def wrote(doctor, func, targets: list) -> None:
    """An eager write into announced buffers: a static input's data write, or a reset of it."""
    frame = None
    for key, t, buf in targets:
        if buf.role != "input":
            continue
        frame = frame or user_code_frame()
        if frame is None:
            return
        step = doctor.report.replays
        if func.overloadpacket in _RESETS:
            filled = doctor.input_writes.get(key)
            if filled is not None and filled[0] is not frame.f_code and filled[2] == step:
                doctor.input_writes[key] = (filled[0], (frame.f_code, location(frame), span(t), str(func)), step)
        else:       # (a reset after a replay, before the next step's data, is the runner's refresh: no clobber)
            doctor.input_writes[key] = (frame.f_code, None, step)


def failed_check(doctor, error: BaseException, frame) -> None:
    """The program's own check failed in ``frame``: where a view it holds was last reset by code
    other than the step's data write, that reset is kept as the failure's explanation."""
    if not doctor.input_writes or doctor.explanation is not None and doctor.explanation[0] == id(error):
        return
    for name, t in list(frame.f_locals.items()):
        if not isinstance(t, torch.Tensor):
            continue
        entry = doctor.input_writes.get(key := storage_key(t))
        if entry is None or entry[1] is None or not overlap(entry[1][2], span(t)):
            continue
        _, source, _, op = entry[1]
        buf = doctor.buffer(key)
        what = f"{buf.name}: {describe(t)}"
        finding = Finding(
            "persistent-mutation", where(doctor) if doctor.graphs else "the first capture", op, what, source,
            f"the program's check failed ({type(error).__name__}: {first_line(error) or 'assert'}, at "
            f"{location(frame)}) on {name}, a view of the static input {buf.name} (announced by {buf.owner}); the "
            f"step's data written there was reset in place at {source}", explain.reset_input(buf.name),
            {"elements": t.numel()})
        doctor.explanation = (id(error), finding, ("persistent-mutation", "reset", source))
        return
