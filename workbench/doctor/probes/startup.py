"""What the runs made before capturing (warmups, dummy batches) left in memory that outlives them.

Warmups are dummy steps: a runner makes them so that lazy work and allocations happen before
capture, on made-up inputs. Whatever they write into memory that existed before them -- a KV
cache, a recurrent state, a null block that masked reads rely on -- stays there. If a later step
reads it, its answer depends on the dummy batches (vLLM #57156: NaN in the null KV block;
onnxruntime #32243: a recurrent state advanced by the runs before capture).

The doctor keeps, on the first write of each warmup, a copy of every storage that existed before
it, and a second copy after the warmup, and notes which elements eager code or a replay writes
after it. At a graph's first sampled differential replay, the elements the warmups changed and
nothing has rewritten since are put back as they were before the warmups, and the step is run eagerly from there: an answer that differs from the replay's is a
real step depending on what dummy batches wrote. Lazy initialisation the eager step redoes gives
the same answer, and so do writes into memory no real step reads (a scratch slot). What is
found on a replay that gives what the workload's announced run without graphs gives at the same
step (``probes/reference.py``) is held until a replay of that graph does not (``differential``): a
warmup that was a real step (a training loop's first) wrote what that run writes too.
"""
from __future__ import annotations

import dataclasses

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import _disable_current_modes

from ...engine.opinfo import describe, op_tensors, storage_key, tensors, written_tensors
from ...engine.source import user_frame
from ..tensors import changed, region, whole

_MAX_BYTES = 256 << 20       # larger storages (a whole KV cache on a GPU) are not copied: see ``skipped``


@dataclasses.dataclass
class Kept:
    """A storage as it was before the first warmup wrote it (``before``), and after the last
    warmup (``after``); the warmup op that first wrote it, and where."""

    weak: StorageWeakRef
    dtype: torch.dtype                   # compared element by element in the dtype it was written in
    before: torch.Tensor
    after: torch.Tensor | None
    op: str
    source: str
    tensor: str
    start: torch.Tensor | None = None    # as the current warmup found it (kept by an earlier warmup)


class Startup:
    """The doctor's record of warmup writes (``Doctor.startup``)."""

    def __init__(self) -> None:
        self.kept: dict[int, Kept] = {}
        self.created: set[int] = set()       # storages the warmups created: nothing to put back there
        self.constant: set[int] = set()      # of those, the ones computed from no data (constants)
        self.skipped: int = 0                # storages too large to copy
        self.rewritten: dict[int, torch.Tensor] = {}   # elements written since, outside warmups

    def before_write(self, func, args, kwargs) -> None:
        """In a warmup, before a mutable op: keep each pre-existing storage it writes, once."""
        for t in written_tensors(func, args, kwargs):
            key = storage_key(t)
            if key in self.kept:
                kept = self.kept[key]
                if kept.start is None and (now := whole(kept.weak, kept.dtype)) is not None:
                    with _disable_current_modes():
                        kept.start = now.clone()
                continue
            if key in self.created:
                continue
            storage = t.untyped_storage()
            if storage.nbytes() > _MAX_BYTES:
                self.skipped += 1
                self.created.add(key)
                continue
            weak = StorageWeakRef(storage)
            dtype = t.dtype if storage.nbytes() % t.element_size() == 0 else torch.uint8
            with _disable_current_modes():
                self.kept[key] = Kept(weak, dtype, whole(weak, dtype).clone(), None, str(func), user_frame(),
                                      describe(t))

    def trained(self) -> None:
        """The warmup just ended was a training step (it ran a backward pass): what it wrote is the
        training's state -- weights the optimizer moved, running statistics -- not dummy data, as
        a real step's writes are. Storages first kept in it are dropped; in those kept before,
        what it changed counts as rewritten."""
        with _disable_current_modes():
            for key, kept in list(self.kept.items()):
                if kept.after is None:
                    del self.kept[key]
                elif kept.start is not None and (now := whole(kept.weak, kept.dtype)) is not None:
                    mask = changed(kept.start, now)
                    self.rewritten[key] = self.rewritten[key] | mask if key in self.rewritten else mask
                    kept.start = None

    def created_by(self, args, kwargs, out) -> None:
        """Outputs of a warmup op that are new storages (not views of its inputs); constants when
        every input is one (an allocation, ``torch.arange(3) * 2``)."""
        inputs = {storage_key(t) for t in op_tensors(args, kwargs)}
        new = {k for o in tensors(out) if (k := storage_key(o)) not in inputs}
        self.created |= new
        if inputs <= self.constant:
            self.constant |= new

    def wrote(self, func, args, kwargs) -> None:
        """Eager code (not a warmup) wrote: those elements hold real data now, whatever the value."""
        for t in written_tensors(func, args, kwargs):
            kept = self.kept.get(key := storage_key(t))
            if kept is not None:
                with _disable_current_modes():
                    flat = whole(kept.weak, kept.dtype)
                    mask = region(t, flat) if flat is not None else None
                if mask is not None:
                    self.rewritten[key] = self.rewritten[key] | mask if key in self.rewritten else mask

    def replayed(self, info) -> None:
        """A replay wrote what its graph writes (all of it, as far as the doctor can tell)."""
        if not self.kept:               # the common case: no warmup wrote older memory
            return
        for key in info.writes.keys() & self.kept.keys():
            with _disable_current_modes():
                self.rewritten[key] = torch.ones_like(self.kept[key].before, dtype=torch.bool)

    def warmup_end(self) -> None:
        with _disable_current_modes():
            for key, kept in list(self.kept.items()):
                now = whole(kept.weak, kept.dtype)
                if now is None:
                    del self.kept[key]
                else:
                    # What this warmup wrote is dummy data again; what real steps wrote since the
                    # earlier warmups and this one left alone is still theirs.
                    if kept.start is not None and key in self.rewritten and now.shape == kept.start.shape:
                        self.rewritten[key] &= ~changed(kept.start, now)
                    else:
                        self.rewritten.pop(key, None)
                    kept.after, kept.start = now.clone(), None

    def dirty(self, keys, before_replay: dict) -> dict[int, tuple]:
        """For the storages among ``keys`` that warmups changed: ``key -> (whole storage, mask of
        the elements the warmups changed and nothing rewrote before this replay, their values
        before the warmups, the Kept record)``. ``before_replay`` holds the storages the replay
        wrote, as they were before it (the others are as they were)."""
        out = {}
        with _disable_current_modes():
            for key in [key for key in self.kept if key in keys]:     # in the order the warmups wrote them
                kept = self.kept[key]
                now = whole(kept.weak, kept.dtype)
                if now is None or kept.after is None or now.shape != kept.after.shape:
                    continue
                was = before_replay[key].reshape(-1).view(torch.uint8).view(kept.dtype) if key in before_replay else now
                mask = changed(kept.before, kept.after) & ~changed(was, kept.after)
                if key in self.rewritten:
                    mask &= ~self.rewritten[key]
                if bool(mask.any()):
                    out[key] = (now, mask, kept.before, kept)
        return out


def label(doctor, key: int, kept: Kept) -> str:
    """A kept storage's announced name (how other rules on that buffer key their findings), else its shape."""
    buf = doctor.buffer(key)
    return buf.name if buf is not None else kept.tensor
