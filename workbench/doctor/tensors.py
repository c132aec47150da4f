"""Small tensor helpers the doctor's rules and probes share: whole storages, element regions, the
bytes a view covers, digests, tolerant comparison, RNG state, and a readable signature of an op's arguments."""
from __future__ import annotations

import dataclasses
import functools
import hashlib

from typing import NamedTuple

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..engine.host_sync import non_blocking
from ..engine.memory import HOST_TYPES
from ..engine.opinfo import span, storage_key, tensors  # noqa: F401 - span: the rules' and probes' too

aten = torch.ops.aten


def overlap(a: tuple[int, int] | None, b: tuple[int, int] | None) -> bool:
    """Whether two ``span``s (of one storage) share a byte."""
    return a is not None and b is not None and a[0] < b[1] and b[0] < a[1]


def whole(weak, dtype: torch.dtype = torch.uint8) -> torch.Tensor | None:
    """All of a storage (a ``StorageWeakRef``) as a flat tensor of ``dtype``; None once released."""
    if weak.expired():
        return None
    storage = torch.UntypedStorage._new_with_weak_ptr(weak.cdata)
    n = storage.nbytes() // torch.empty(0, dtype=dtype).element_size()
    return alias(storage, dtype, (n,), (1,))


def alias(storage, dtype: torch.dtype, size=None, stride=None, offset: int = 0) -> torch.Tensor:
    """A tensor over ``storage`` for the doctor's own reads and writes. Made outside inference mode,
    so that the doctor can write through it later wherever it is (code running under
    ``torch.inference_mode()`` would otherwise hand it an inference tensor, which refuses in-place
    writes outside that mode)."""
    with torch.inference_mode(False):
        t = torch.empty(0, dtype=dtype, device=storage.device)
        return t.set_(storage) if size is None else t.set_(storage, offset, size, stride)


def region(view: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """Which elements of ``buffer`` the tensor ``view`` (of the same storage) covers: a bool mask
    shaped like ``buffer``; all of it when the view reinterprets the bytes."""
    if view.dtype != buffer.dtype:
        return torch.ones(buffer.shape, dtype=torch.bool, device=buffer.device)
    return onto(torch.ones((), dtype=torch.bool, device=view.device), view, buffer)


def onto(values: torch.Tensor, view: torch.Tensor, buffer: torch.Tensor | None = None) -> torch.Tensor:
    """``values`` (shaped like ``view``, or broadcasting to it) at the elements of ``view`` in a new
    tensor shaped like ``buffer`` (a view of the same storage, and dtype), zero elsewhere; with no
    ``buffer``, a flat tensor over the whole storage. Where a view names one element several times
    (an expanded or unfolded view), one of its values is kept."""
    with _disable_current_modes():
        flat = torch.zeros(view.untyped_storage().nbytes() // view.element_size(), dtype=values.dtype,
                           device=view.device)
        if _may_overlap(view):
            index = torch.arange(flat.numel(), device=view.device).as_strided(
                view.shape, view.stride(), view.storage_offset())
            flat[index.reshape(-1)] = values.expand(view.shape).reshape(-1)
        else:
            flat.as_strided(view.shape, view.stride(), view.storage_offset()).copy_(values)
        return flat if buffer is None else flat.as_strided(buffer.shape, buffer.stride(), buffer.storage_offset())


def _may_overlap(view: torch.Tensor) -> bool:
    """Whether two indices of ``view`` may name one element (an expanded or unfolded view): False is
    sure, True may be cautious. Taken by stride, each dim must step past all the smaller ones span."""
    span = 0
    for stride, size in sorted((s, n) for n, s in zip(view.shape, view.stride()) if n > 1):
        if stride <= span:
            return True
        span += stride * (size - 1)
    return False


def at(values: torch.Tensor, view: torch.Tensor, buffer: torch.Tensor | None = None) -> torch.Tensor:
    """The elements of ``values`` (shaped like ``buffer``, a view of the same storage; with no
    ``buffer``, flat over the whole storage) that ``view`` covers, shaped like ``view``."""
    flat = values if buffer is None else onto(values, buffer)
    return flat.as_strided(view.shape, view.stride(), view.storage_offset())


def real_rows(o: torch.Tensor, real: int | None, size: int | None) -> torch.Tensor:
    """The real rows of a graph's output: along its first dimension of the step's ``size`` (a
    ``[1, tokens, vocab]`` layout has them second), else its first. A step with no padded rows
    keeps all of it: an output with no dimension of the step's size (per-atom forces of a step
    served as one system) is not cut to its first rows."""
    if real is None or not o.dim() or size is not None and real >= size:
        return o
    dim = next((d for d, n in enumerate(o.shape) if n == size), 0)
    return o.narrow(dim, 0, min(real, o.shape[dim]))


def host_only(ts, cuda: bool, made: set = frozenset()) -> bool:
    """Whether an op's tensors ``ts`` all live in host memory (host tensors, storages in ``made``;
    beside a CUDA graph, the CPU's): host work, which launches nothing on the device and which a
    capture does not record."""
    return bool(ts) and all(type(t) in HOST_TYPES or (cuda and not t.is_cuda) or (made and storage_key(t) in made)
                            for t in ts)


def digest(t: torch.Tensor) -> str:
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
    return hashlib.blake2b(data, digest_size=12).hexdigest()


def _own_comparison(compare):
    """A comparison of the doctor's own: host memory (``engine.host``) compared with device memory
    is no workload op, and must not be refused as one (a replay's staging block against the
    reference's copy of it). One-byte floats (FP8) are compared as float32: few ops take them. A
    tensor on another device than the first is compared there (what the run without graphs kept on
    the host, against the GPU tensor a replay read)."""
    @functools.wraps(compare)
    def run(*args):
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        args = tuple(a.to(device) if isinstance(a, torch.Tensor) and a.device != device else a for a in args)
        args = tuple(a.float() if isinstance(a, torch.Tensor) and a.dtype.is_floating_point and a.element_size() == 1
                     else a for a in args)
        with torch._C.DisableTorchFunctionSubclass():
            return compare(*args)
    return run


@_own_comparison
def changed(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise ``a != b`` where NaN equals NaN (poisoned padded rows hold NaN)."""
    diff = a != b
    return diff & ~(a.isnan() & b.isnan()) if a.dtype.is_floating_point else diff


@_own_comparison
def differs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elements that differ beyond what two launches of the same kernels may (a GPU may pick
    another algorithm eagerly than under capture): exact for integers, close for floats."""
    if a.shape != b.shape:
        return torch.ones(1, dtype=torch.bool, device=a.device)
    if a.dtype.is_floating_point or a.dtype.is_complex:
        return ~torch.isclose(a, b, rtol=1e-3, atol=1e-5, equal_nan=True)
    return a != b


@_own_comparison
def disagrees(replay: torch.Tensor, eager: torch.Tensor) -> torch.Tensor:
    """``differs``, where the eager step's NaN is no evidence: while the doctor watches on a machine
    without CUDA, memory no op has written holds NaN (``uninit``), so an eager NaN is most often
    unwritten memory, which in the replay holds whatever the graph's memory last held. (A NaN in the
    replay still counts. On CUDA unwritten memory holds what it held, and an eager NaN is rare.)"""
    diff = differs(replay, eager)
    return diff & ~eager.isnan() if eager.dtype.is_floating_point and diff.shape == eager.shape else diff


@_own_comparison
def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape or not a.numel():
        return float("inf") if a.shape != b.shape else 0.0
    return float((a.double() - b.double()).abs().nan_to_num(float("inf")).max())


def rng_state(cuda: bool) -> tuple:
    return torch.get_rng_state(), torch.cuda.get_rng_state() if cuda else None


def landed(cuda: bool) -> None:
    """On CUDA, wait for the work launched so far before the doctor keeps or puts back state on the host:
    a replay's non-blocking copies into pinned host memory (Warp's CPU arrays, written back by copy) land
    when the stream reaches them, and a copy kept before then holds what was there before."""
    if cuda:
        torch.cuda.synchronize()


def set_rng_state(state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])


class TensorArg(NamedTuple):
    """A tensor argument as a launch sees it: its shape and where in its storage it starts. Both are
    Python's decisions (``x[:n]``, ``cache.narrow(0, pos, len)``) that a kernel's pointer and sizes
    keep at capture, though the view that made them launches nothing."""

    shape: tuple
    offset: int

    def __str__(self) -> str:
        return f"tensor{list(self.shape)}" + (f" at element {self.offset}" if self.offset else "")

    __repr__ = __str__                      # inside a list argument too


def signature(func, args, kwargs) -> tuple:
    """The arguments of an op that Python decided and a replay keeps: scalars, shapes, dtypes, the
    geometry of tensor arguments, and the values of constants made from Python data
    (``torch.tensor([...])``)."""
    if func.overloadpacket in (aten.lift_fresh, aten.lift_fresh_copy):     # (a number lifted: by its value)
        with _disable_current_modes():
            return tuple(("scalar", repr(t.item())) if t.dim() == 0 else digest(t) for t in tensors(args))
    if func.overloadpacket is not aten.copy_:
        cuda = any(t.is_cuda for t in tensors(args))
        return tuple(_plain(a, cuda) for a in (*args, *kwargs.items()))
    return tuple(_plain(a) for a in (*args, *kwargs.items()))


def host_memory(t: torch.Tensor, cuda: bool) -> bool:
    """Host memory: the CPU engine's host tensors, or a CPU tensor beside a CUDA graph."""
    return type(t) in HOST_TYPES or (cuda and not t.is_cuda)


def by_value(t: torch.Tensor, cuda: bool) -> bool:
    """A 0-dim host tensor given to a device op (not ``copy_``): CUDA passes it by value, so a graph
    keeps the number it held at capture, not its memory (the CPU engine does the same)."""
    return t.dim() == 0 and host_memory(t, cuda)


def _plain(value, cuda: bool | None = None):
    if isinstance(value, torch.Tensor):
        if cuda is not None and by_value(value, cuda):
            with _disable_current_modes(), torch._C.DisableTorchFunctionSubclass():
                return ("scalar", repr(value.item()))
        try:
            return TensorArg(tuple(value.shape), value.storage_offset())
        except (RuntimeError, NotImplementedError):     # a tensor without strided storage
            return TensorArg((), 0)
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v, cuda) for v in value)
    if isinstance(value, float):
        return repr(value)                          # NaN equals NaN here
    if isinstance(value, (torch.UntypedStorage, torch.TypedStorage)):     # ``set_``'s source: its size, not
        return ("storage", value.nbytes())          # its contents (printing a CUDA storage reads it: a sync)
    return value if isinstance(value, (int, bool, str, type(None))) else str(value)


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


def device_to_host(func, args, kwargs) -> bool:
    """A copy from a CUDA tensor to host memory that waits for it (``.cpu()``, ``.to("cpu")``). A
    ``copy_(..., non_blocking=True)`` into pinned memory does not wait: a capture records it as a
    copy node, which each replay runs."""
    if func is aten._to_copy.default:
        device = kwargs.get("device")
        return args[0].is_cuda and device is not None and torch.device(device).type == "cpu"
    if func is aten.copy_.default:
        return args[1].is_cuda and not args[0].is_cuda and not (non_blocking(args, kwargs) and args[0].is_pinned())
    return False


def blocking_upload(func, args, kwargs) -> bool:
    """A blocking copy of CPU memory with elements into a CUDA tensor: torch synchronises the stream
    after it, which a capture refuses (engine probe ``host_copy``)."""
    if func is aten._to_copy.default:
        device = kwargs.get("device")
        src, blocking = args[0], not kwargs.get("non_blocking", False)
        into_cuda = device is not None and torch.device(device).type == "cuda"
    elif func is aten.copy_.default:
        src, blocking = args[1], not non_blocking(args, kwargs)
        into_cuda = args[0].is_cuda
    else:
        return False
    return into_cuda and blocking and src.device.type == "cpu" and src.dim() > 0


def broadcasts(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """Whether ``src`` broadcasts to ``dst``'s shape (a copy that does not fails by itself)."""
    try:
        return torch.broadcast_shapes(src.shape, dst.shape) == dst.shape
    except RuntimeError:
        return False


def announced_of(announced: list, returned: list) -> list | None:
    """The tensors among what a step returned that its announced outputs are, where a runner hands
    out fewer than the step returns (the loss, not the per-term losses beside it): in order, each
    the next of the same shape and dtype; None where they cannot all be found."""
    out, rest = [], iter(returned)
    for a in announced:
        if a is None:                     # an output not compared (``unwritten``)
            out.append(None)
            continue
        r = next((r for r in rest if r is not None and r.shape == a.shape and r.dtype == a.dtype), None)
        if r is None:
            return None
        out.append(r)
    return out


def placed(obj, at: tuple = ()):
    """``(where, tensor)`` for every tensor in nested tuples, lists, dicts and dataclass instances
    (what a model step returns: a ``ModelOutput`` dataclass of logits and hidden states), in
    ``tensors``' order for the first three: where is its path of dict keys, list positions and
    field names. A dataclass is walked to ``_DEPTH`` levels (one may hold its parent)."""
    if isinstance(obj, torch.Tensor):
        yield at, obj
    elif isinstance(obj, (tuple, list)):
        for i, x in enumerate(obj):
            yield from placed(x, (*at, i))
    elif isinstance(obj, dict):
        for k, x in dict.items(obj):
            yield from placed(x, (*at, k))
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type) and len(at) < _DEPTH:
        for field in dataclasses.fields(obj):
            yield from placed(getattr(obj, field.name, None), (*at, field.name))


_DEPTH = 4


def leaves(obj) -> list[torch.Tensor]:
    """Every tensor a step returned or a runner handed out, in ``placed``'s order (a dataclass's
    fields included, which ``tensors``, walking ops' arguments, does not enter)."""
    return [t for _, t in placed(obj)]


def placement(value) -> dict:
    """What a function returned inside a capture, as ``{an output's geometry: where it sat}``: a
    step that returns a dict (a ``ModelOutput``, a tensordict) is paired with the reference's by key,
    not by shape (``paired``)."""
    return {geometry(t): p for p, t in placed(value)}


def geometry(t: torch.Tensor) -> tuple | None:
    try:
        return t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)
    except (RuntimeError, NotImplementedError):        # no strided storage
        return None
