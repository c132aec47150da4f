"""What an aten op reads and writes, decided in one place.

The emulated graph (which storages to snapshot at capture), the memory tracker (which storages an
op created), the graph doctor (which static buffers a graph writes) and op loggers all need the same
answer. Each deciding it for itself is how they come to disagree: an ``out=`` argument or a list of
tensors counted by one and not the other. The answer comes from the op's schema: an argument
annotated ``Tensor(a!)`` is written; every tensor argument is read (an in-place op reads its
destination; ``copy_`` and ``fill_`` do not need to, see ``overwrites``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef

aten = torch.ops.aten

# In-place ops that write their destination without reading it: a runner refreshing its buffers.
_OVERWRITES = frozenset({aten.copy_, aten.fill_, aten.zero_, aten.index_put_, aten.index_fill_, aten.index_copy_,
                         aten.scatter_, aten.masked_fill_, aten.set_, aten.resize_, aten.random_, aten.uniform_,
                         aten.normal_, aten._foreach_copy_, aten._foreach_zero_})
# ... unless told to combine with what is there: ``index_put_(..., accumulate=True)``, ``scatter_(..., reduce=)``
# (the flag's name, and its position where it may be passed positionally)
_COMBINES = {aten.index_put_: ("accumulate", 3), aten.scatter_: ("reduce", None)}


# Storages keyed inside ``unique_storage_keys()``, each held by a weak reference: its memory is
# freed with its last tensor, but its handle stays allocated, so its key is never given to a new
# storage. Otherwise records keyed by storage take a new tensor for a released one, and what is
# found depends on when the garbage collector ran.
_keyed: dict[int, StorageWeakRef] | None = None


def span(t: torch.Tensor) -> tuple[int, int] | None:
    """``[first, end)`` bytes of its storage that a view covers (None when it covers none)."""
    if t.numel() == 0:
        return None
    lo = hi = t.storage_offset()
    for size, stride in zip(t.shape, t.stride()):
        if stride >= 0:
            hi += (size - 1) * stride
        else:
            lo += (size - 1) * stride
    size = t.element_size()
    return lo * size, (hi + 1) * size


def storage_key(t: torch.Tensor) -> int:
    """Identity of a tensor's memory: views of one storage share it."""
    storage = t.untyped_storage()
    key = storage._cdata
    if _keyed is not None and key not in _keyed:
        _keyed[key] = StorageWeakRef(storage)
    return key


@contextlib.contextmanager
def unique_storage_keys() -> Iterator[None]:
    """Inside the block (and blocks nested in it), no two storages ever get the same key."""
    global _keyed
    outermost = _keyed is None
    if outermost:
        _keyed = {}
    try:
        yield
    finally:
        if outermost:
            _keyed = None


def describe(t: torch.Tensor) -> str:
    """``float32[4, 8]``: what a person needs to recognise a tensor, without reading its values."""
    dtype = str(t.dtype).replace("torch.", "")
    return f"{dtype}[{', '.join(str(s) for s in t.shape)}]"


def tensors(obj) -> Iterator[torch.Tensor]:
    """Every tensor in nested tuples, lists and dicts (an op's arguments or outputs)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            yield from tensors(x)
    elif isinstance(obj, dict):
        for x in dict.values(obj):          # (a subclass's own ``values`` is the user's code: not run)
            yield from tensors(x)


def op_tensors(args, kwargs) -> list[torch.Tensor]:
    """The tensors among an op's arguments, as a list. Observers walk them on every op they see,
    and an aten argument is a ``Tensor`` or a flat ``Tensor[]``, so the common case needs no
    generator (``tensors`` walks whatever nests deeper)."""
    found = []
    for x in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, (list, tuple)):
            found.extend(tensors(x))
    return found


@functools.cache
def _written_arguments(func) -> tuple[tuple[int, str, bool], ...]:
    """``(position, name, keyword-only)`` of the arguments ``func``'s schema marks as written. Read
    once per op: walking a schema costs microseconds, and observers ask on every op they see."""
    return tuple((i, arg.name, arg.kwarg_only) for i, arg in enumerate(func._schema.arguments)
                 if arg.alias_info is not None and arg.alias_info.is_write)


# Ops that write arguments their schema does not mark (``Tensor?`` without ``(a!)``): batch norm's
# running statistics, updated in place when ``training`` (argument 5) is true. ``F.batch_norm``
# reaches them (``native_batch_norm`` on the CPU, ``cudnn_batch_norm`` on CUDA); trusting the schema,
# a capture would keep their update and the doctor would not see the write.
_UNMARKED_WRITES = {getattr(aten, name).default: (3, 4)
                    for name in ("native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm")
                    if hasattr(aten, name)}


@functools.cache
def mutable(func) -> bool:
    """Whether the op may write any argument: its schema says so, or it is one that writes unmarked."""
    return bool(func._schema.is_mutable) or func in _UNMARKED_WRITES


def written_tensors(func, args, kwargs) -> list[torch.Tensor]:
    """Tensors the op writes: those its schema marks (``Tensor(a!)``: in-place self, ``out=`` args),
    and a batch norm's running statistics in training."""
    if (unmarked := _UNMARKED_WRITES.get(func)) is not None:
        training = args[5] if len(args) > 5 else kwargs.get("training")
        return [args[i] for i in unmarked if training and i < len(args) and isinstance(args[i], torch.Tensor)]
    written = []
    for i, name, kwarg_only in _written_arguments(func):
        value = args[i] if i < len(args) and not kwarg_only else kwargs.get(name)
        if isinstance(value, torch.Tensor):
            written.append(value)
        elif isinstance(value, (list, tuple)):
            written.extend(v for v in value if isinstance(v, torch.Tensor))
    return written


@functools.cache
def pure_view(func) -> bool:
    """A view that changes no tensor's metadata in place (``slice``, ``view``; not ``t_``): it
    writes nothing, creates no storage and reads no data. Decided once per op."""
    return bool(func.is_view and not mutable(func))


# In-place ops that change where a tensor's memory is or how much there is: not metadata alone.
_STORAGE_CHANGES = frozenset({aten.set_, aten.resize_, aten.resize_as_})


@functools.cache
def metadata_only(func) -> bool:
    """An in-place change of a tensor's shape or strides alone (``squeeze_``, ``t_``, ``as_strided_``,
    which ``vector @ matrix`` applies to its ``mm`` result): no kernel, so a CUDA capture records
    nothing for it. Decided once per op."""
    return torch.Tag.inplace_view in func.tags and func.overloadpacket not in _STORAGE_CHANGES


# Ops that read only a tensor's shape, dtype and device, never its values.
_SHAPE_ONLY = frozenset({aten.empty_like, aten.zeros_like, aten.ones_like, aten.full_like, aten.rand_like,
                         aten.randn_like, aten.randint_like, aten.new_empty, aten.new_zeros, aten.new_ones,
                         aten.new_full, aten.new_empty_strided})


def shape_only(func) -> bool:
    """Whether the op reads only its tensors' shapes, dtypes and devices (``zeros_like``), not their values."""
    return func.overloadpacket in _SHAPE_ONLY


def overwrites(func, args=(), kwargs=None) -> bool:
    """Whether the op writes its destination without reading it: a copy or a fill (not ``+=``); and,
    given its arguments, an ``out=`` form whose destination shares no memory with what it reads
    (``torch.exp(x, out=y)`` writes ``y`` as a copy would; ``torch.add(y, 1, out=y)`` reads it)."""
    packet = func.overloadpacket
    if packet in _OVERWRITES:
        name, position = _COMBINES.get(packet, (None, 0))
        if name is None:
            return True
        kwargs = kwargs or {}
        return not (kwargs.get(name) or position is not None and len(args) > position and args[position])
    if not (args or kwargs) or not _out_form(func):
        return False
    kwargs = kwargs or {}
    keys = {storage_key(t) for t in written_tensors(func, args, kwargs)}
    outs = {name for _, name, _ in _written_arguments(func)}
    read = op_tensors(args, {k: v for k, v in kwargs.items() if k not in outs})    # (``out=`` is keyword-only)
    return all(storage_key(t) not in keys for t in read)


@functools.cache
def _out_form(func) -> bool:
    """An op whose only written arguments are keyword-only (``out=``): it writes no input in place."""
    written = _written_arguments(func)
    return bool(written) and all(kwarg_only for _, _, kwarg_only in written)


@dataclasses.dataclass(frozen=True)
class Effects:
    """The storages an op reads and writes, by ``storage_key``."""

    reads: frozenset[int]
    writes: frozenset[int]


def effects(func, args, kwargs) -> Effects:
    """The one answer to "what does this op read and write" (see the module docstring)."""
    reads = frozenset(storage_key(t) for t in op_tensors(args, kwargs))
    writes = frozenset(storage_key(t) for t in written_tensors(func, args, kwargs))
    return Effects(reads, writes)
