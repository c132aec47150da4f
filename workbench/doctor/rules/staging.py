"""persistent-mutation: a step's data in pinned host memory, rewritten before anything read it.

Pinned host memory is where a runner stages a step's metadata for an asynchronous copy to the
device (``static.copy_(pinned, non_blocking=True)``). That copy reads the pinned bytes when the
stream reaches it, not when the host launches it: a host that runs ahead of the device (an
overlap scheduler preparing step N+1 while step N is queued) and refills one persistent pinned
buffer for the next step hands the previous step's copy the next step's data. The upstream fixes
stage each step into fresh pinned memory (the caching host allocator keeps a block until the copy
that reads it has run) or wait on an event before the refill.

What the doctor sees is the order the program's ops reach the dispatcher. Where a program keeps its
own queue of launches (a stream in miniature, run when the host waits), the copy is dispatched when
the queue runs: after the refill. Then the staged data was rewritten before anything read it: the
same line wrote other values over elements it had written since the last read, so its earlier data
never reached a reader. As for static inputs (``unread._lost``), only the same line's second write
counts (another line patching a staged row, a reset then a fill, is an edit on purpose), only over
elements that still hold that line's data (a row cleared, refilled by another line, then cleared
again by the first, as a request table condenses, lost nothing of the first line's), and only
elements whose values change; and only in a staging buffer, pinned memory some copy takes to the
device (a flag the host writes and reads back itself is host state). A loss is reported when the
buffer's rewritten elements are next read, once such a copy has been seen: a host mirror the runner
keeps up to date and nothing reads again (the device copies are filled from elsewhere) loses no
one's data, and neither does data nothing ever reads (bytes of a temporary freed unread, whose
block a later temporary fills): a loss needs the reader that got the later data in its place.
"""
from __future__ import annotations

import functools

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ...engine.host import any_pinned, is_pinned
from ...engine.opinfo import describe, op_tensors, overwrites, storage_key, written_tensors
from ...engine.source import user_frame
from .. import explain
from ..report import Finding
from ..tensors import onto

_COPY = torch.ops.aten.copy_.default
_unwrapped = torch._C.DisableTorchFunctionSubclass     # (the doctor's arithmetic on host memory: plain tensors)


@functools.cache
def _cuda() -> bool:
    return torch.cuda.is_available()


def pinned(t: torch.Tensor) -> bool:
    """Pinned host memory: the CPU backend's ``host()`` memory (by its storage: an op's view of it is
    a plain tensor), or a pinned CPU tensor beside CUDA."""
    if not t.is_cpu:
        return False
    return is_pinned(t) or _cuda() and t.is_pinned()


def before_write(func, args, kwargs) -> list:
    """``[(key, view, its values now)]`` for the pinned host memory an eager op is about to write.
    (Every eager op that writes asks: where no pinned memory was ever made, it returns at once.)"""
    out = []
    if not (any_pinned() or _cuda()):
        return out
    for t in written_tensors(func, args, kwargs):
        if pinned(t):
            with _disable_current_modes(), _unwrapped():
                out.append((storage_key(t), t, t.clone()))
    return out


class Staged:
    """A pinned storage's staged data: per line, the elements it wrote since their last read; whether
    a copy has taken the storage to the device (a staging buffer, not host state the host reads
    itself); a loss not yet reported (the finding and the elements written over), reported when a
    read of a staging buffer takes any of those elements: the reader that got the later data."""

    __slots__ = ("lines", "uploaded", "lost")

    def __init__(self) -> None:
        self.lines, self.uploaded, self.lost = {}, False, None


def wrote(doctor, func, before: list | None) -> None:
    """After the op: the elements it wrote are data this line staged (a value written again is the
    step's data too); a line that changes elements it staged since their last read loses its
    earlier data."""
    if not before:
        return
    source = user_frame()
    for key, view, was in before:
        staged = doctor.staged.get(key) or doctor.staged.setdefault(key, Staged())
        lines = staged.lines
        with _disable_current_modes(), _unwrapped():
            written = onto(torch.ones((), dtype=torch.bool), view)
            if source in lines and lines[source].shape != written.shape:     # (another dtype's view: new data)
                del lines[source]
            lost = lines[source] & onto(view != was, view) if source in lines else None
            for other, mask in lines.items():       # (their data there is edited, on purpose: no longer theirs)
                if other != source and mask.shape == written.shape:
                    lines[other] = mask & ~written
            lines[source] = lines[source] | written if source in lines else written
        if lost is not None and bool(lost.any()):
            n = int(lost.sum())
            finding = Finding(
                "persistent-mutation", "-", str(func), f"pinned host memory: {describe(view)}", source,
                f"{n} element(s) of a pinned host buffer that this line wrote since anything last read them are "
                "written again by the same line with other values: the data it staged first never reached the "
                "copy that takes the buffer to the device", explain.restaged(), {"elements_overwritten": n})
            if staged.lost is None:
                staged.lost = (finding, lost)


def read(doctor, func, args, kwargs) -> None:
    """An op reads staged pinned memory (a copy to the device, a host read): its data reached a reader.
    A copy into memory that is not pinned makes the storage a staging buffer."""
    written = {id(t) for t in written_tensors(func, args, kwargs)} if overwrites(func, args, kwargs) else set()
    for t in op_tensors(args, kwargs):
        if id(t) not in written and (staged := doctor.staged.get(storage_key(t))) is not None:
            with _disable_current_modes(), _unwrapped():
                hit = onto(torch.ones((), dtype=torch.bool, device=t.device), t)
                for source, mask in staged.lines.items():
                    staged.lines[source] = mask & ~hit if mask.shape == hit.shape else mask & False
            if func is _COPY and not staged.uploaded and not pinned(args[0]):
                staged.uploaded = True
            if staged.uploaded and staged.lost is not None:
                finding, lost = staged.lost
                with _disable_current_modes(), _unwrapped():
                    reached = lost.shape != hit.shape or bool((lost & hit).any())
                if reached:
                    doctor.add(finding, ("persistent-mutation", finding.source, "restaged before read"))
                    staged.lost = None


def host_read(doctor, t: torch.Tensor) -> None:
    """A host read (``tolist``, ``numpy``), which dispatches no op on the CPU."""
    read(doctor, torch.ops.aten.alias.default, (t,), {})


def replayed(doctor, info) -> None:
    """A replay re-reads, by address, the pinned memory its capture copied from."""
    if not doctor.staged:
        return
    for key, ext in info.externals.items():
        if ext.host_copy and (staged := doctor.staged.get(key)) is not None:
            staged.lines.clear()
