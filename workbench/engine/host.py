"""Host memory on the CPU backend: CPU tensors that stand for a GPU machine's host memory.

**The rule.** On the CPU backend every plain CPU tensor is *device* memory (so code that uses
``device="cpu"`` tensors as the GPU's memory, like the five cases, keeps its meaning). A tensor is
*host* memory when it comes from ``host(t, device)``, or from an op whose tensor arguments are all
host memory (as on CUDA, where an op on CPU tensors gives a CPU tensor). ``host(t, "cuda")`` gives
pinned host memory, so the same code, with ``DEVICE`` either ``"cpu"`` or ``"cuda"``, stages
metadata the way serving stacks do. Two things the rule cannot see, because they never reach the
engine on a CPU-only torch: ``pin_memory=True`` (refused by torch without an accelerator; use
``host()``) and ``dev.cpu()`` (torch returns the same device tensor, not a host copy).

What follows from it, as on CUDA:

* mixing: a device op given a host tensor with elements raises ``HostDeviceMixError`` (torch's
  "Expected all tensors to be on the same device"); the crossings CUDA allows stay allowed:
  ``copy_`` either way, ``to(device)`` (a host-to-device copy), indexing, and 0-dim host tensors
  as scalars;
* inside a capture, work on host memory runs once, at capture, and is not recorded; ``.item()``
  and ``.tolist()`` of host memory are legal; a captured ``copy_`` from host memory re-reads it at
  every replay, by address; ``host()`` called inside a capture tells the graph that the memory is
  not its own (``cpu_graph`` applies these);
* a released host block goes to the next host allocation, never to device memory (``memory``).

On CUDA the pinned memory must stay alive as long as a graph copies from it; torch refuses a copy
of *pageable* CPU memory inside a capture ("Cannot copy between CPU and CUDA tensors during CUDA
graph capture unless the CPU tensor is pinned", pytorch#172156). ``host()`` memory stands for
pinned memory, and so do its views; what an op on host memory makes is pageable (on CUDA an op on
a pinned tensor returns an ordinary CPU tensor: ``pinned.clone().is_pinned()`` is False), and a
capture refuses to copy it to the device (``is_pinned``, ``cpu_graph``), as torch does; it refuses a
blocking copy from pinned memory too, after which torch synchronises the stream (on an H200 the
capture then fails: "operation failed due to a previous error during capture").

**Why a subclass.** Host memory is a ``torch.Tensor`` subclass with only ``__torch_function__``:
ops on device memory never see it, so eager device code pays nothing; only ops that touch host
memory (metadata, a few per step) take a Python call. The alternatives cost every op: a device type
of its own (PrivateUse1) needs a kernel per op, which without C++ is a Python call per op, and a
marker on storages needs an always-on mode that looks every op's arguments up.
``benchmarks/bench_host.py`` measures the three (``benchmarks/results_host.md``).
"""
from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import _disable_current_modes

from . import memory, queries
from .errors import GraphError
from .source import user_frame

_Tensor = torch.Tensor
# Ops where host and device memory may meet, as CUDA allows: explicit copies and indexing.
_CROSSINGS = frozenset({_Tensor.copy_, _Tensor.__getitem__, _Tensor.__setitem__})


class HostDeviceMixError(GraphError):
    """A device op given host memory (CUDA: "Expected all tensors to be on the same device")."""


class HostTensor(torch.Tensor):
    """Host memory on the CPU backend (see the module doc for the rule)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = _tensors(args, kwargs)
        if all(type(t) is HostTensor for t in tensors):
            if func is _Tensor.to and _target_device(args, kwargs) is not None:
                return _to_device(args, kwargs)
            with _plain():
                return _as_host(func(*args, **kwargs))                    # host in, host out
        if getattr(func, "__wrapped__", func) not in _CROSSINGS \
                and any(type(t) is HostTensor and t.dim() > 0 for t in tensors):   # (a watcher's wrapper too)
            raise _mix_error(func, tensors)
        with _plain():
            return func(*args, **kwargs)                                  # a device op


_plain = torch._C.DisableTorchFunctionSubclass


def _as_host(out):
    """An op's result on host memory, typed as host memory (what torch's default handler does,
    without its generic walk over the result)."""
    if isinstance(out, torch.Tensor):
        return out if type(out) is HostTensor else out.as_subclass(HostTensor)
    if isinstance(out, (tuple, list)) and any(isinstance(o, torch.Tensor) for o in out):
        return type(out)(_as_host(o) for o in out) if type(out) in (tuple, list) else out
    return out


memory.HOST_TYPES.add(HostTensor)
_pinned: dict[int, StorageWeakRef] = {}     # storage -> itself, weakly: the host memory ``host()`` gave


def is_pinned(t: torch.Tensor) -> bool:
    """Whether ``t`` is pinned host memory: ``host()``'s, or a view of it (see the module doc)."""
    ref = _pinned.get(t.untyped_storage()._cdata)
    return ref is not None and not ref.expired()


def any_pinned() -> bool:
    """Whether ``host()`` has given pinned memory (some may be gone since)."""
    return bool(_pinned)


def _pin(t: torch.Tensor) -> torch.Tensor:
    if len(_pinned) >= 1024 and len(_pinned) % 1024 == 0:
        for key in [k for k, ref in _pinned.items() if ref.expired()]:
            del _pinned[key]
    _pinned[t.untyped_storage()._cdata] = StorageWeakRef(t.untyped_storage())
    return t


def host(t: torch.Tensor, device: str | torch.device = "cpu") -> torch.Tensor:
    """``t`` as host memory for a program running on ``device``: pinned host memory on CUDA, a
    ``HostTensor`` sharing ``t``'s memory on the CPU backend (inside ``reuse_freed_blocks()``, a
    released host block it is copied into, as a pinned allocation). ``t`` must be a CPU tensor."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
        raise TypeError(f"host() needs a CPU tensor, got {_what(t)}; build it on the CPU, e.g. "
                        "host(torch.zeros(n, dtype=torch.int32), DEVICE)")
    kind = str(device).split(":")[0]
    if kind == "cuda":
        return t.pin_memory()
    if kind != "cpu":
        raise GraphError(f"device must be 'cpu' or 'cuda', got {str(device)!r}")
    if type(t) is HostTensor:
        return _pin(t)                  # (CUDA's ``pin_memory()`` would copy it into pinned memory)
    graph = queries.current_graph()
    if graph is not None and graph._in_reused_block(t):
        # A factory's output inside the capture, which the emulation placed in a pool block an earlier
        # temporary of the capture left (whose recorded ops a replay still runs there): on CUDA it is a
        # CPU tensor, and ``pin_memory()`` copies it into host memory of its own.
        with _disable_current_modes():
            t = t.clone()
    out = _pin(memory.allocate_host(t).as_subclass(HostTensor))
    if graph is not None:
        graph._claim_host(out)  # host work inside a capture: not the graph's memory
    return out


def is_host(t: torch.Tensor) -> bool:
    """Whether ``t`` is host memory of the CPU backend (on CUDA, host memory is any CPU tensor)."""
    return type(t) is HostTensor


def _tensors(args, kwargs) -> list[torch.Tensor]:
    """The tensor arguments of a call, including those inside list arguments (``torch.cat``)."""
    found = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


def _target_device(args, kwargs):
    return torch._C._nn._parse_to(*args[1:], **kwargs)[0]


def _to_device(args, kwargs) -> torch.Tensor:
    """``host.to(DEVICE)``: a host-to-device copy into new device memory, never an alias."""
    src = args[0]
    device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
    if device.type != "cpu":
        raise HostDeviceMixError(f"host memory on the CPU backend can move to device 'cpu' only, "
                                 f"got {device}\n  at {user_frame()}")
    with _plain():
        out = torch.empty(src.shape, dtype=dtype or src.dtype)
        out.copy_(src, non_blocking=non_blocking)
    return out


def _mix_error(func, tensors) -> HostDeviceMixError:
    name = getattr(func, "__name__", str(func))
    kinds = ", ".join(f"{'host' if type(t) is HostTensor else 'device'} {_what(t)}" for t in tensors)
    return HostDeviceMixError(
        f"{name}: expected all tensors to be on the same device, but found host and device memory "
        f"({kinds}).\n  at {user_frame()}\nCUDA refuses this too. Copy the host tensor to the device "
        "first (dev.copy_(host) or host.to(DEVICE)), or use a 0-dim host tensor as a scalar.")


def _what(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{str(t.dtype).replace('torch.', '')}[{', '.join(map(str, t.shape))}]"
