"""What a ``CPUGraph`` records: its kernels (``RecordedOp``) and the memory they reference but the
graph does not own (``ExternalRef``), plus the small helpers capture and replay share."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .errors import IllegalMemoryAccess


@dataclasses.dataclass(eq=False)
class ExternalRef:
    """A tensor the graph reads or writes but does not own: a weak reference plus its view geometry."""

    index: int
    weak: StorageWeakRef
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    nbytes: int
    first_use: str
    origin: str | None
    retained: torch.UntypedStorage | None = None   # on_freed="reuse": the block's bytes
    host: bool = False                              # host memory (a captured copy's host address)
    address: int = 0                                # the storage's data pointer at capture

    def describe(self) -> str:
        return ("host " if self.host else "") + f"{str(self.dtype).replace('torch.', '')}[{', '.join(map(str, self.size))}]"

    def storage(self) -> torch.UntypedStorage | None:
        """The owner's storage while it still holds the memory the graph captured; None once that
        memory is gone: the storage was released, or reallocated in place (``resize_``, which
        gives the storage new memory and frees the old: a CUDA graph keeps the old address)."""
        if self.weak.expired():
            return None
        storage = torch.UntypedStorage._new_with_weak_ptr(self.weak.cdata)
        return storage if storage.data_ptr() == self.address else None

    def on(self, storage: torch.UntypedStorage) -> torch.Tensor:
        """The captured view of ``storage`` (the owner's, or the retained block)."""
        return torch.empty(0, dtype=self.dtype).set_(storage, self.offset, self.size, self.stride)


@dataclasses.dataclass(eq=False)
class RecordedOp:
    """One captured kernel: the op, its arguments, what it reads and writes, and where it came from.

    ``args``/``kwargs`` hold the non-tensor arguments with ``None`` where a tensor goes; ``slots``
    says which tensor goes where: ``(where, key, list_index, tensor_or_ref)``, ``where`` being
    ``"a"`` (positional) or ``"k"`` (keyword). Owned tensors are held directly; memory the graph
    does not own is an ``ExternalRef``, resolved at each replay.
    """

    func: Any
    args: list
    kwargs: dict
    slots: list
    outputs: list              # captured owned outputs (None where an output aliases an input)
    reads: frozenset           # storage keys
    writes: frozenset
    is_view: bool
    source: str
    bound: tuple | None = None  # (args, kwargs) ready to call, when no argument is external

    def __post_init__(self) -> None:
        self.has_outputs = any(o is not None for o in self.outputs)

    @property
    def name(self) -> str:
        return str(self.func)

    def external_refs(self) -> list[ExternalRef]:
        return [slot[3] for slot in self.slots if isinstance(slot[3], ExternalRef)]

    def bind(self, live: list[torch.Tensor]) -> tuple[list, dict]:
        """The call's arguments for this replay, with external tensors taken from ``live``."""
        if self.bound is not None:
            return self.bound
        args, kwargs, copied = list(self.args), dict(self.kwargs), set()
        for where, key, sub, slot in self.slots:
            value = live[slot.index] if type(slot) is ExternalRef else slot
            container = args if where == "a" else kwargs
            if sub is None:
                container[key] = value
            else:
                if (where, key) not in copied:
                    container[key] = list(container[key])
                    copied.add((where, key))
                container[key][sub] = value
        return args, kwargs

    def __repr__(self) -> str:
        kind = "view" if self.is_view else ("writes" if self.writes else "new")
        return f"<{self.name} ({kind}) at {self.source}>"


def check_blocks(aliases, ops: list[RecordedOp]) -> None:
    """Before a replay: every pool block the graph uses still holds the bytes its views reach. A
    holder may free a block in place (``untyped_storage().resize_(0)``: a runtime unmapping graph
    memory it takes for its own); the graph keeps the address, so its replay reads freed memory.
    That raises here under either ``on_freed``: on CUDA the block may still be mapped and the read
    silently takes what the pool put there next, but a storage left without bytes holds nothing
    to read, and a CPU kernel run on it would crash the process."""
    for alias, needed in aliases:
        if alias.untyped_storage().nbytes() < needed:
            storage = alias.untyped_storage()
            reader = next((op for op in ops for slot in op.slots if isinstance(slot[3], torch.Tensor)
                           and slot[3].untyped_storage()._cdata == storage._cdata), None)
            where = f"{reader.name} at {reader.source}" if reader is not None else "a recorded op"
            raise IllegalMemoryAccess(
                f"graph replay read freed memory: {where}\n  reads a block of the graph's pool whose storage "
                "was freed in place after capture (a resize_), though a tensor still holds it. A graph keeps only "
                "the address.\n  Fix: free graph memory only with the graph that owns it (reset() or drop it).")


def _as_tuple(out) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _poison(t: torch.Tensor) -> None:
    """Fill a whole storage with a value no correct computation produces."""
    whole = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage())
    if whole.dtype.is_floating_point or whole.dtype.is_complex:
        whole.fill_(float("nan"))
    elif whole.dtype == torch.bool:
        whole.fill_(True)
    else:
        whole.fill_(torch.iinfo(whole.dtype).min if whole.dtype.is_signed else torch.iinfo(whole.dtype).max)
