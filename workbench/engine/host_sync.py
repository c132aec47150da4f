"""What a capture cannot record: work that needs the device's values on the host.

A CUDA graph records kernels; it cannot wait for the device. An op whose output shape or value the
data decides (``nonzero``, ``.item()``, a masked read), or a copy of Python data from pageable host
memory to the device, makes a capturing stream fail (``cudaErrorStreamCaptureUnsupported``). The
CPU engine refuses the same work (``cpu_graph``) and the doctor names it on either backend
(``doctor/rules/sync.py``). Where PyTorch takes a path that needs no sync -- a mask filled with one
host value runs as ``masked_fill_`` -- both record it. Engine probes ``host_sync`` and
``mask_assign`` hold these answers against an H200's.
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch.overrides import TorchFunctionMode

from .errors import CaptureError
from .host import HostTensor
from .source import user_frame

aten = torch.ops.aten

# Ops whose result the host must wait for (the data decides a shape or a Python value).
HOST_SYNC_OPS = frozenset({
    aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten.equal, aten.is_nonzero,
    aten._unique, aten._unique2, aten.unique_dim, aten.unique_consecutive,
})
# Tensor methods that read values on the host before any aten op would show it.
HOST_SYNC_METHODS = frozenset({
    "item", "tolist", "numpy", "cpu", "__repr__", "__str__", "__format__",
    "__bool__", "__int__", "__float__",
})
_VALUE_READS = frozenset({"item", "__int__", "__float__", "__bool__"})     # aten._local_scalar_dense
_PUTS = frozenset({aten.index_put, aten.index_put_, aten._index_put_impl_})
_INDEX_OPS = _PUTS | {aten.index}


def is_host_sync(func, args, host_value=None) -> bool:
    """Whether an aten op needs the device's data on the host (its output shape or value depends
    on it): a CUDA graph cannot record it. ``host_value(t)``: whether a tensor is host data (a
    Python number lifted in the captured code); on CUDA, a tensor on another device than the one
    it is written into is."""
    packet = func.overloadpacket
    if packet in HOST_SYNC_OPS:
        return True
    return packet in _INDEX_OPS and _has_mask_index(args) and not _masked_fill(func, args, host_value)


def copies_python_data(func, args, kwargs, made_from_python, on_host=lambda t: False) -> bool:
    """Whether a device op (one given memory not ``on_host``) needs, on CUDA, a tensor the captured
    code made from Python data (``made_from_python(t)``: pageable host memory there) copied to the
    device, which a capture refuses where eager code would copy it (an H200 with torch 2.11, engine
    probe ``python_data``):
    an index list (``t[[0, 2]]``), a value written into one element (``t[0] = 0``: ``select`` then
    ``copy_``) or indexed elements (``t[index] = 1``: ``index_put_``), ``t.copy_(torch.tensor(2.))``,
    one number chosen by ``torch.where``. One number filling a slice (``t[1:3] = 5``: ``fill_``) or a
    mask (``masked_fill_``), or an operand of an elementwise op (``t + torch.tensor(2.)``), is passed
    by value, and a graph records it. (An elementwise op given such a tensor with elements fails on
    CUDA eagerly too: another device. The CPU engine has one.)"""
    given = [t for t in flat(args, kwargs) if isinstance(t, torch.Tensor)]
    made = [t for t in given if made_from_python(t) and t.numel()]
    if not made or all(made_from_python(t) or on_host(t) for t in given):
        return False                                   # (no device memory meets it: host work)

    def is_made(t) -> bool:
        return any(t is m for m in made)
    packet = func.overloadpacket
    if packet is aten.copy_:
        return is_made(args[1])
    if packet in _INDEX_OPS:
        indices = [i for i in args[1] or () if i is not None]
        return any(map(is_made, indices)) or (packet in _PUTS and is_made(args[2]) and not _has_mask_index(args))
    return packet is aten.where and any(is_made(t) and not t.dim() for t in args[1:])


def flat(args, kwargs):
    """An op's arguments, with those given as a list or a tuple (``index``'s indices) spread out."""
    for value in (*args, *(kwargs or {}).values()):
        if isinstance(value, (list, tuple)):
            yield from value
        else:
            yield value


def host_sync_error(op: str, source: str, tensor=None) -> CaptureError:
    return CaptureError(
        f"{op} inside graph capture needs the device's values on the host (a host synchronisation), "
        f"which a CUDA graph cannot wait for (cudaErrorStreamCaptureUnsupported).\n  at {source}\n"
        "Move it before or after the captured region, or keep it on the device (e.g. torch.where).",
        op=op, source=source, tensor=tensor)


@contextlib.contextmanager
def stream_waits_refused(elsewhere=lambda name: None):
    """On CUDA, while a capture is open: ``torch.cuda.synchronize()``, ``Stream.synchronize()`` and
    ``Event.synchronize()`` refused as the CPU engine refuses ``synchronize`` in a capture, before
    CUDA invalidates the capture (which it reports later, at whatever call comes next: "operation
    failed due to a previous error during capture"). No aten op shows these waits."""
    originals = (torch.cuda.synchronize, torch.cuda.Stream.synchronize, torch.cuda.Event.synchronize)

    def refused(original, name):
        @functools.wraps(original)
        def wait(*args, **kwargs):
            if torch.cuda.is_current_stream_capturing():
                raise host_sync_error(name, user_frame())
            elsewhere(name)         # a capture open on another thread: CUDA refuses the wait (``capture_mode``)
            return original(*args, **kwargs)
        return wait
    torch.cuda.synchronize = refused(originals[0], "torch.cuda.synchronize()")
    torch.cuda.Stream.synchronize = refused(originals[1], "Stream.synchronize()")
    torch.cuda.Event.synchronize = refused(originals[2], "Event.synchronize()")
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.Stream.synchronize, torch.cuda.Event.synchronize = originals


def non_blocking(args, kwargs) -> bool:
    """Whether a ``copy_(dst, src, non_blocking)`` call asks for an asynchronous copy."""
    return bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))


def pageable_copy_error(source: str, op: str = "aten.copy_.default", python_data: bool = False) -> CaptureError:
    """``python_data``: the pageable memory is Python data the captured code made into a tensor."""
    advice = ("Make such data a device tensor before the capture; a number assigned to one element (t[0] = 0) "
              "or through an index is such a copy: fill a slice instead (t[0:1] = 0)." if python_data else
              "Copy from host() memory (pinned on CUDA), or a view of it: what an op on host memory returns (a "
              "clone, an index) is pageable.")
    return CaptureError(
        f"{op} from pageable host memory inside graph capture: CUDA graphs copy from host memory by address, "
        "so torch refuses it unless the memory is pinned (\"Cannot copy between CPU and CUDA tensors during "
        f"CUDA graph capture unless the CPU tensor is pinned\").\n  at {source}\n{advice}",
        op=op, source=source)


def blocking_copy_error(source: str) -> CaptureError:
    return CaptureError(
        "copy_ from host memory inside graph capture without non_blocking=True: torch synchronises the stream "
        "after a blocking host-to-device copy, and a capturing stream refuses that (on an H200 the capture "
        f"fails: \"operation failed due to a previous error during capture\").\n  at {source}\nCopy with "
        "non_blocking=True: the graph's copy node reads the pinned memory by address at each replay.",
        op="aten.copy_.default", source=source)


# Python data made into a tensor: on the host unless a device is named. On CUDA, naming the device
# inside a capture copies it from pageable host memory, which a capturing stream refuses (engine
# probe ``mask_assign``: a list, one number); without one it is a host constant the graph keeps.
_FROM_PYTHON = frozenset({torch.tensor, torch.as_tensor, torch.asarray})


class UploadGuard(TorchFunctionMode):
    """Refuses, inside a capture, ``torch.tensor(data, device=...)``: the copy of Python data from
    pageable memory happens inside the factory, where no aten op shows it (a dispatch mode sees only
    the tensor already on the device). The doctor enters it around CUDA captures, so that the CUDA
    run fails with the CPU engine's error rather than torch's own."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        device = (kwargs or {}).get("device")
        if device is not None and torch.device(device).type == "cuda":
            _refuse_upload(func, args, kwargs)
        return func(*args, **(kwargs or {}))


class HostSyncGuard(TorchFunctionMode):
    """Refuses, inside a capture, the host reads and copies that no aten op shows. ``made_from_python``
    tells a tensor the captured code made from Python data (on CUDA, pageable host memory): moving
    one to the device (``.to(device)``) is such a copy, which a dispatch mode does not see on the CPU
    (the tensor is already there)."""

    def __init__(self, made_from_python=lambda t: False) -> None:
        super().__init__()
        self.made_from_python = made_from_python

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_SYNC_METHODS and not (args and type(args[0]) is HostTensor):
            raise host_sync_error(f"Tensor.{name}()", user_frame(), args[0] if args and name in _VALUE_READS else None)
        _refuse_upload(func, args, kwargs)
        if func is torch.Tensor.to and _names_device(args[1:], kwargs) and self.made_from_python(args[0]):
            _upload_refused("Tensor.to(device)")
        return func(*args, **(kwargs or {}))


def _refuse_upload(func, args, kwargs) -> None:
    if func in _FROM_PYTHON and (kwargs or {}).get("device") is not None and _copies_python_data(args):
        _upload_refused(f"torch.{func.__name__}(..., device=...)")
    if func is torch.Tensor.new_tensor and type(args[0]) is not HostTensor and _copies_python_data(args[1:]):
        _upload_refused("Tensor.new_tensor(...)")         # (made on the tensor's device, from Python data)


def _upload_refused(what: str) -> None:
    raise CaptureError(
        f"{what} inside graph capture copies Python data from pageable host memory to the device, which a "
        f"capturing stream refuses (cudaErrorStreamCaptureUnsupported).\n  at {user_frame()}\nMake the tensor "
        "before the captured region, or on the host (no device) and let the graph keep it as a constant.",
        op=what, source=user_frame())


def _names_device(args, kwargs) -> bool:
    """Whether ``Tensor.to``'s arguments name a device (a string, a ``torch.device``, a tensor's)."""
    first = args[0] if args else None
    return (kwargs or {}).get("device") is not None or isinstance(first, (str, torch.device, torch.Tensor))


def _copies_python_data(args) -> bool:
    """Whether ``torch.tensor``'s data is Python's to copy: a number, or a non-empty sequence of them
    (the H200 refuses both; an empty list copies nothing, and transformers' caches start so inside
    captures). A tensor, or a list of them, is a copy on the device."""
    data = args[0] if args else None
    if isinstance(data, (bool, int, float)):
        return True
    return isinstance(data, (list, tuple)) and len(data) > 0 and not any(isinstance(d, torch.Tensor) for d in data)


def _masked_fill(func, args, host_value) -> bool:
    """``x[mask] = value`` with one mask (the other indices None) and one value element held on the
    host: PyTorch's ``index_put_`` fills through ``masked_fill_`` then (``canDispatchToMaskedFill``),
    which needs no count of the mask's elements -- no sync, and a CUDA graph records it."""
    if func.overloadpacket not in _PUTS or len(args) < 3 or (len(args) > 3 and args[3]):
        return False                               # (accumulate takes the sorting path)
    self, indices, value = args[0], args[1], args[2]
    masks = [i for i in indices or () if i is not None]
    if len(masks) != 1 or masks[0].dtype not in (torch.bool, torch.uint8) or masks[0].device != self.device:
        return False
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        return False
    return value.device != self.device or (host_value is not None and bool(host_value(value)))


def _has_mask_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())
