"""What happens to memory a graph references but does not own.

Two pieces, both opt-in because they watch every op:

* ``track_origins()`` remembers, per storage, the user source line that created it, so an
  ``IllegalMemoryAccess`` can say *where the freed tensor came from*, not only where it was read.
* ``reuse_freed_blocks()`` emulates the CUDA caching allocator's other outcome of a use-after-free.
  When a referenced storage is released, the caching allocator keeps the block and hands it to the
  next allocation that fits; the graph, which kept the address, now reads that allocation's data:
  silently wrong values instead of a crash. Graphs created with ``on_freed="reuse"`` retain the
  block's bytes; inside this context the next new tensor of the same byte size is placed in a
  retained block whose owner is gone. On CUDA the real allocator does this by itself. Host and
  device memory have allocators of their own (CUDA's caching host allocator keeps pinned blocks):
  a released host block goes to the next host allocation (an op on host memory, or ``host()``),
  never to device memory, and the other way round.
"""
from __future__ import annotations

import contextlib
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from .source import user_frame

_origins: dict[int, tuple[StorageWeakRef, str, str]] = {}   # storage -> (weak, source line, op)
_retained: list = []      # ExternalRef objects of on_freed="reuse" graphs (weakly: see retain)
_reusing = 0              # depth of open reuse_freed_blocks() blocks


def origin_of(t: torch.Tensor) -> str | None:
    """Where ``t``'s storage was created, if it was created under ``track_origins()``."""
    created = created_by(t)
    return None if created is None else f"at {created[1]}"


def created_by(t: torch.Tensor) -> tuple[str, str] | None:
    """``(op, source line)`` that created ``t``'s storage, if it was created under ``track_origins()``."""
    entry = _origins.get(t.untyped_storage()._cdata)
    if entry is None or entry[0].expired():
        return None
    return entry[2], entry[1]


def made_alike(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The other live storages of ``t``'s size that the op and line which created ``t``'s created:
    other instances of the same buffer (a runner's input made again, another generator's)."""
    mine = t.untyped_storage()
    made = created_by(t)
    found = []
    for cdata, (weak, source, op) in list(_origins.items()):
        if (op, source) == made and cdata != mine._cdata and not weak.expired():
            other = torch.UntypedStorage._new_with_weak_ptr(weak.cdata)
            if other is not None and other.nbytes() == mine.nbytes() and other.device == mine.device:
                found.append(other)
    return found


def record_origin(t: torch.Tensor, source: str, op: str) -> None:
    """Note that ``op`` at ``source`` created ``t``'s storage (the doctor tracks origins itself)."""
    if len(_origins) >= 4096 and len(_origins) % 4096 == 0:
        _forget_released()
    _origins[t.untyped_storage()._cdata] = (StorageWeakRef(t.untyped_storage()), source, op)


def _forget_released() -> None:
    for key in [k for k, entry in _origins.items() if entry[0].expired()]:
        del _origins[key]


def record_new_storages(func, args, kwargs, out) -> None:
    """Record ``func`` and the user's line as the origin of each storage its outputs created."""
    if func.is_view or (args and out is args[0]):    # a view or an in-place op creates no storage
        return
    inputs = {a.untyped_storage()._cdata for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
    new = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.untyped_storage()._cdata not in inputs]
    if new:
        source = user_frame()
        for o in new:
            record_origin(o, source, str(func))


class _OriginTracker(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        record_new_storages(func, args, kwargs, out)
        return out


@contextlib.contextmanager
def track_origins():
    """Record where each tensor created inside the block came from (for ``IllegalMemoryAccess``)."""
    _forget_released()
    with _OriginTracker():
        yield


def retain(ref) -> None:
    """Called by ``CPUGraph`` (``on_freed="reuse"``) at capture end for each block it references.

    Graphs that reference one address share one retained block, as on CUDA, where the address is
    one block: whatever lands there is what every one of them reads. A block freed before the
    capture ended is retained with bytes no computation produces: the emulation did not keep its
    last ones."""
    key = ref.weak.cdata
    for r in _retained:
        other = r()
        if other is not None and other.retained is not None and other.weak.cdata == key \
                and not other.weak.expired():
            ref.retained = other.retained
            ref.retained.copy_(torch.UntypedStorage._new_with_weak_ptr(key))   # the bytes of now
            break
    else:
        storage = torch.UntypedStorage._new_with_weak_ptr(key)
        if storage is None:     # freed during the capture: its last bytes are not known here
            storage = torch.UntypedStorage(ref.nbytes)
            storage.fill_(0xFF)     # (NaN in floats, -1 in integers: what no computation produces)
        ref.retained = storage.clone()
    _retained.append(weakref.ref(ref))


def _free_block(nbytes: int, host: bool):
    """A retained block of exactly ``nbytes``, of host memory or of device memory, whose owner has
    released it and nobody reuses yet; every graph sharing it stops offering it."""
    for r in list(_retained):
        ref = r()
        if ref is None or ref.retained is None:
            _retained.remove(r)
        elif ref.nbytes == nbytes and ref.host == host and ref.storage() is None:
            block = ref.retained
            _retained[:] = [s for s in _retained if s() is not None and s().retained is not block]
            return block
    return None


def _place(o: torch.Tensor, host: bool) -> torch.Tensor:
    """``o`` moved into a free retained block of its kind and size, if there is one."""
    block = _free_block(o.untyped_storage().nbytes(), host)
    if block is None:
        return o
    placed = torch.empty(0, dtype=o.dtype).set_(block, o.storage_offset(), o.shape, o.stride())
    placed.copy_(o)
    return placed


# Tensor types that are host memory on the CPU backend (``host.HostTensor`` registers itself): kept
# here so that this module, below ``host`` in the engine, never imports it.
HOST_TYPES: set[type] = set()


def allocate_host(t: torch.Tensor) -> torch.Tensor:
    """``host(t)``'s memory: inside ``reuse_freed_blocks()``, a released host block of ``t``'s size
    if there is one (the caching host allocator's next allocation), else ``t``'s own."""
    return _place(t, host=True) if _reusing else t


class _Reuser(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        inputs = {a.untyped_storage()._cdata for a in tensors}
        host = bool(tensors) and all(type(a) in HOST_TYPES for a in tensors)   # an op on host memory

        def place(o):
            if not isinstance(o, torch.Tensor) or o.untyped_storage()._cdata in inputs:
                return o
            return _place(o, host)

        return tree_map(place, out)


@contextlib.contextmanager
def reuse_freed_blocks():
    """Inside this block, new tensors may land in memory a graph still references (see module doc)."""
    global _reusing
    _reusing += 1
    try:
        with _Reuser():
            yield
    finally:
        _reusing -= 1
