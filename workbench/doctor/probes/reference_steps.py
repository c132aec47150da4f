"""What the reference run recorded of each op, and the copies of small tensors it keeps.

``reference.py`` aligns each replay with the same step of the run without graphs; this module holds
what that alignment reads: each op of the reference as a ``Step`` (its calls, the values of its small
inputs, what it writes), and ``Values``, the copies of small tensors as the reference had them, within
two budgets (values and returns; what calls that return no tensor left in the memory they wrote).
"""
from __future__ import annotations

import dataclasses
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import _disable_current_modes

from ...engine.opinfo import mutable, overwrites, storage_key, written_tensors
from ...engine.source import location
from ..records import Op
from ..tensors import signature

SMALL = 1 << 16           # elements of an op's input kept as a value (metadata, ids, lengths; not activations)
_BUDGET = 1 << 24         # elements kept in all (values and returns): past it, the reference keeps no more
_LEFT_BUDGET = 1 << 22    # elements kept of what calls that return nothing left in the memory they wrote


@dataclasses.dataclass(frozen=True)
class Step:
    """One op of the reference: its trace entry, the calls it ran in (``(code, call number,
    line)``, outermost first), the values of its small tensor inputs (None for the others) and which
    of them it overwrites."""

    op: Op
    path: tuple
    values: tuple
    overwritten: tuple = ()       # positions of the inputs it writes without reading (a copy's destination)
    target: tuple | None = None   # what it writes, small: (the tensor or its base, weakly; offset, shape, stride)


def step(func, args, kwargs, path: tuple, inputs: list, values: "Values") -> Step:
    """The reference's record of one op run in the calls ``path``, reading ``inputs``."""
    writes = written_tensors(func, args, kwargs) if mutable(func) else []
    written = {id(w) for w in writes} if overwrites(func, args, kwargs) else ()
    target = None
    if writes and writes[0].numel() <= SMALL and writes[0].layout == torch.strided:
        t = writes[0]
        target = (weakref.ref(t if t._base is None else t._base), t.storage_offset(), tuple(t.shape), t.stride())
    return Step(Op(str(func), location(path[-1][0], path[-1][2]) if path else "<unknown>",
                   sig=signature(func, args, kwargs)),
                path, tuple(values.keep(t) for t in inputs),
                tuple(j for j, t in enumerate(inputs) if id(t) in written), target)


class Values:
    """Copies of tensors as the reference run had them: one per storage, geometry and version."""

    def __init__(self) -> None:
        self.kept: dict[tuple, tuple] = {}        # (storage, geometry, version) -> (its storage, weakly; value)
        self.budget = {"values": _BUDGET, "left": _LEFT_BUDGET}

    def keep(self, t: torch.Tensor, always: bool = False, budget: str = "values") -> torch.Tensor | None:
        """A copy of ``t`` as it is now, counted against ``budget``; a large tensor only ``always``
        (a call's return)."""
        if not isinstance(t, torch.Tensor) or (not always and t.numel() > SMALL) or t.numel() > self.budget[budget]:
            return None
        try:
            key = (storage_key(t), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t._version)
        except (RuntimeError, NotImplementedError):     # no strided storage
            return None
        held = self.kept.get(key)
        if held is None or held[0].expired():    # (a freed storage's identity is reused)
            with _disable_current_modes():
                held = self.kept[key] = (StorageWeakRef(t.untyped_storage()), t.detach().clone())
            self.budget[budget] -= t.numel()
        return held[1]

    def left(self, steps: list[Step]) -> dict:
        """What each of a call's writes (``steps``) left where it wrote when the call returned: a call
        that returned no tensor gave its result in memory it wrote (a kernel launcher, a solver step
        advancing its state in place), to be paired with a replay's outputs where those are what the
        graph's same write wrote. ``id(step) -> (value, offset, stride)``."""
        left = {}
        with _disable_current_modes():
            for s in steps:
                if s.target is None or self.budget["left"] <= 0 or (base := s.target[0]()) is None:
                    continue
                offset, shape, stride = s.target[1:]
                try:
                    value = base.as_strided(shape, stride, offset)
                except RuntimeError:                  # its storage was resized since
                    continue
                if (kept := self.keep(value, budget="left")) is not None:
                    left[id(s)] = (kept, offset, stride)
        return left


def root(paths: list, calls: dict) -> tuple | None:
    """(root code, the positions in ``paths`` of the ops under it) of a graph whose captured ops ran
    in the functions ``paths`` lists: the function of the captured code that the reference called
    (``calls``) and that runs the most of its ops (outermost on a tie)."""
    best = None
    for depth in range(max((len(p) for _, p, *_ in paths), default=0)):
        for code in dict.fromkeys(p[depth] for _, p, *_ in paths if len(p) > depth):
            if code not in calls:
                continue
            under = tuple(i for i, (_, p, *_) in enumerate(paths) if code in p)
            if best is None or len(under) > len(best[1]):
                best = (code, under)
    return best
