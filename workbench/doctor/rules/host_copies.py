"""dangling-reference: host memory a captured copy reads, handed on before the capture ended.

A captured host-to-device copy (``cudaMemcpyAsync`` from pinned memory, a kernel's arguments
copied from where the launcher keeps them) records the source's address, not its bytes: every
replay copies what is there then. A launcher that builds the arguments in memory it lets go at
once -- a stack frame the next call reuses, a pinned block the host allocator hands to the next
call, one staging buffer refilled for the next launch -- has a capture whose later launches
rewrite that memory before the capture ends. The capture's own copy read the first data; every
replay reads the last. (On a GPU the same holds: the host writes are not captured, only the copy.)

The check needs no sight of the writes (a NumPy store into pinned memory dispatches no op): the
values each captured copy read are kept and compared with what the source holds when the capture
ends. Memory the graph writes itself is left out (its replays write it again, in order). The
finding names the line that handed the memory to the copy (``sync.handed_in``: a launcher given
the argument buffer by its caller is not where it was chosen), else the copy.
"""
from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import _disable_current_modes

from ...engine.opinfo import describe, storage_key
from ...engine.source import user_frames
from ..report import Finding
from ..tensors import alias, differs, host_memory, host_only
from .sync import handed_in, same_memory

_COPY, _TO_COPY = torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default


def host_source(func, args, kwargs, cuda: bool) -> torch.Tensor | None:
    """The host memory a captured op copies onto the device: ``copy_``'s source into device memory,
    or the input of a ``_to_copy`` onto a CUDA device (``pinned.to("cuda", non_blocking=True)``,
    which the CPU engine's host tensors run as a ``copy_``); else None."""
    if func is _COPY:
        return args[1] if host_memory(args[1], cuda) and not host_memory(args[0], cuda) else None
    if func is _TO_COPY and onto_device(kwargs) and host_memory(args[0], cuda):
        return args[0]
    return None


def onto_device(kwargs) -> bool:
    """Whether an op names a CUDA device for what it makes (``_to_copy``'s ``device``)."""
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == "cuda"


def unrecorded(inputs, kwargs, cuda: bool, made: set = frozenset()) -> bool:
    """Whether an op is host work, which a capture does not record (``host_only``: beside a CUDA
    graph, work on any CPU tensor; ``made``: storages earlier host work made), and not a copy of
    host memory onto the CUDA device, which a CUDA capture records as a copy node
    (``pinned.to("cuda")``). The capture and the eager step's launch trace both ask this, so that
    their traces hold the same kind of work."""
    return host_only(inputs, cuda, made) and not (cuda and onto_device(kwargs))


def copied(doctor, info, src: torch.Tensor | None, source: str) -> None:
    """A captured op that copies host memory ``src`` into device memory keeps what it read."""
    if src is None:
        return
    with _disable_current_modes(), torch._C.DisableTorchFunctionSubclass():
        read = src.detach().clone()
    frames = [(f, f.f_lineno) for f in user_frames()]
    site = handed_in(frames, same_memory(src)) or source
    info.host_copied.append((storage_key(src), StorageWeakRef(src.untyped_storage()), src.dtype, src.storage_offset(),
                             tuple(src.shape), src.stride(), read, source, site, describe(src)))


def capture_end(doctor, info) -> None:
    """The captured copies whose source now holds other values than the copy read; and the host memory
    the graph's copies re-read by address at every replay (``doctor.host_reads``, for the eager writes
    the intake watches)."""
    doctor.host_reads.update(key for key, ext in info.externals.items() if ext.host_copy)
    copies, info.host_copied = info.host_copied, []
    for key, weak, dtype, offset, shape, stride, read, source, site, tensor in copies:
        if key in info.writes:
            continue                          # the graph writes it itself: replays write it again, in order
        if weak.expired():
            continue                          # released: the dangling rules see it at the replay
        storage = torch.UntypedStorage._new_with_weak_ptr(weak.cdata)
        with _disable_current_modes(), torch._C.DisableTorchFunctionSubclass():
            now = alias(storage, dtype, shape, stride, offset)
            changed = int(differs(now, read).sum())
        if not changed:
            continue
        doctor.add(Finding(
            "dangling-reference", info.name, "aten.copy_.default", tensor, site,
            f"during the capture of {info.name}, the copy at {source} read {tensor} from host memory; before the "
            f"capture ended, {changed} of those element(s) held other values: the host handed the memory on "
            "(a launcher's argument buffer reused by a later launch) while the graph still copies from it",
            "A captured copy from host memory keeps the address, not the data: every replay copies what the host "
            "left there last. Keep the memory the copy reads alive and unchanged for as long as the graph lives "
            "(a buffer the graph owns, retained with it), or build the data on the device inside the graph.",
            {"elements_changed": changed}), ("dangling-reference", "host copy", site))
