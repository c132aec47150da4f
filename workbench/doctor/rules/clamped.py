"""undersized-buffer: an op fails on a slice that asked for more than its tensor holds.

``buf[:n]`` with ``n`` past the end of ``buf``'s dimension is clamped: the view holds fewer
elements than were asked for, and nothing says so. A buffer a runner or a metadata builder keeps
for every step (an ``arange`` to index with, a scratch table), sized when it was made, and asked
for more rows than that -- a dummy run padded to a graph size larger than the buffer was sized for
-- hands the step a short view, and an op that combines it with tensors of the size asked for
fails on sizes that do not match (upstream, a kernel reads past the buffer's end). The error names
the op, not the buffer.

Every clamped slice of the watched code (eager code, warmups, captures) is noted: the view it gave
(storage, offset, shape, strides), where it was taken, and where its tensor was made. An op that
then fails on that very view, reading it, is the finding: ``undersized-buffer`` where the tensor was made (the
size was decided there, as ``undersized.failed_read`` names a misshaped static input), else where
it was sliced. A clamped slice nothing fails on is no finding: code may clamp on purpose (at most
``k`` of a shorter list). Announced static buffers are held to the contract at once
(``undersized.check_slice``).
"""
from __future__ import annotations

from torch.multiprocessing.reductions import StorageWeakRef

from ...engine import memory
from ...engine.opinfo import describe, op_tensors, storage_key, written_tensors
from ...engine.source import user_frame
from .. import explain
from ..report import Finding
from ..tensors import first_line
from . import where

_KEEP = 64          # clamped views remembered (the latest)


class Clamped:
    """The clamped slices seen, by the view each gave."""

    def __init__(self) -> None:
        # (storage, offset, shape, strides) -> (the storage, weakly: a freed storage's address is handed
        # on), tensor, dim, end, length, where it was sliced, (op, line) that made the tensor or None)
        self.views: dict[tuple, tuple] = {}

    def sliced(self, doctor, t, dim: int, start, end: int) -> None:
        """``t[start:end]`` along ``dim`` asked past the end of the dimension (``end`` > its length)."""
        if doctor.phase not in ("eager", "warmup", "capture") or not isinstance(start, (int, type(None))):
            return
        length, start = t.shape[dim], start or 0
        if start < 0 or start >= length:
            return
        if len(self.views) >= _KEEP:
            self.views.pop(next(iter(self.views)))
        shape = (*t.shape[:dim], length - start, *t.shape[dim + 1:])
        key = (storage_key(t), t.storage_offset() + start * t.stride(dim), shape, t.stride())
        self.views[key] = (StorageWeakRef(t.untyped_storage()), describe(t), dim, end, length, user_frame(),
                           memory.created_by(t))

    def failed_op(self, doctor, func, args, kwargs, error: BaseException) -> bool:
        """An op of the watched code failed: on a clamped view, the slice's short buffer explains it."""
        if not self.views:
            return False
        written = {id(t) for t in written_tensors(func, args, kwargs)}     # (a write that does not fit: ``undersized``)
        for t in op_tensors(args, kwargs):
            if id(t) in written:
                continue
            found = self.views.get((storage_key(t), t.storage_offset(), tuple(t.shape), t.stride()))
            if found is None or found[0].expired():      # (a freed storage's address, handed to a new tensor)
                continue
            _, tensor, dim, end, length, sliced_at, made = found
            op, source = made if made else ("aten.slice", sliced_at)
            doctor.add(Finding(
                "undersized-buffer", where(doctor), op, tensor, source,
                f"during {where(doctor)}, {func} at {user_frame()} failed ({first_line(error)}) on a slice taken at "
                f"{sliced_at} that asked for [.., {end}) of dimension {dim} of the {tensor} tensor"
                f"{f' made at {made[1]}' if made else ''}: it holds fewer, and the slice silently gave only those",
                explain.clamped_slice(dim, end, length, source), {"dim": dim, "end": end, "length": length}),
                ("undersized-buffer", "clamped", source))
            return True
        return False
