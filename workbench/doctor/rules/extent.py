"""undersized-buffer: a write through a view that reaches past the tensor it was made from.

A buffer's contract is its extent: the elements its shape and strides cover in its storage. Code
that treats a tensor as a raw pointer -- ``torch.as_strided(t, ...)`` over more elements than ``t``
covers, as a kernel writes its scratch "right after" a result pointer -- can reach the memory next
to it: in an allocation carved from one arena (a device heap, a compute buffer, a workspace), that
is another buffer's data. No shape check fails: ``as_strided`` only checks the storage's bounds. So
each ``as_strided`` view that reaches past its base is followed, with the views taken of it, and
a write through one of them, in any phase, into bytes outside the base is ``undersized-buffer`` at
the write: the data did not fit the buffer it was meant for. The neighbours' own writes are theirs;
a view that is only read is left alone (a reader may take a window on purpose); so is one within
its base. A view past the end of the storage itself torch refuses, where C++ code laying a tensor
over a raw buffer does not: over memory a graph reads, that refusal is the overflow (``failed_view``).
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ...engine.opinfo import describe, mutable, storage_key, written_tensors
from ...engine.source import location, user_frame, user_frames
from .. import explain, explain_padding
from ..report import Finding
from ..tensors import first_line, span
from .sync import handed_in

AS_STRIDED = torch.ops.aten.as_strided.default


def viewed(doctor, func, args, out) -> None:
    """A view was made: an ``as_strided`` view is followed where it covers more than its base; a
    view of a followed view is followed too (the same memory, another window of it)."""
    base = args[0] if args else None
    if not isinstance(out, torch.Tensor) or not isinstance(base, torch.Tensor) or doctor.phase == "differential":
        return                                    # (an eager form re-runs the step: its writes are the step's)
    through = doctor.through
    if func is AS_STRIDED:
        b, v = span(base), span(out)
        if b is None or v is None or (v[0] >= b[0] and v[1] <= b[1]):
            return
        buf = doctor.buffers.get(storage_key(base))
        name = buf.name if buf is not None and buf.ref() is base else None
        entry = (b, v, user_frame(), name, describe(base), weakref.ref(base))
    elif (held := through.get(id(base))) is not None and held[0]() is base:
        entry = held[1]
        if doctor.padded_step is not None and doctor.pattern is None and doctor.phase == "eager":
            _padded_window(doctor, entry, out)
    else:
        return
    if len(through) & 63 == 63:                   # released views are swept now and then, not by callbacks
        for ident in [i for i, (ref, _) in through.items() if ref() is None]:
            del through[ident]
    through[id(out)] = (weakref.ref(out), entry)


def wrote(doctor, func, args, kwargs) -> None:
    """A write through a followed view into bytes of its view outside the base it was made from."""
    if not mutable(func):
        return
    for t in written_tensors(func, args, kwargs):
        held = doctor.through.get(id(t))
        if held is None or held[0]() is not t or (w := span(t)) is None:
            continue
        b, v, made_at, name, what, _ = held[1]
        if (written := _indexed(func, args, t)) is not None:      # only the elements it indexes
            starts = written.reshape(-1) * t.element_size()
            inside_view = (starts >= v[0]) & (starts < v[1])
            outside = int((inside_view & ((starts < b[0]) | (starts >= b[1]))).sum()) * t.element_size()
        else:
            lo, hi = max(w[0], v[0]), min(w[1], v[1])
            outside = max(0, hi - lo) - max(0, min(hi, b[1]) - max(lo, b[0]))
        if outside <= 0:
            continue
        base = f"{name}: {what}" if name else what
        doctor.add(Finding(
            "undersized-buffer", doctor.capturing.name if doctor.capturing else "-", str(func), base, user_frame(),
            f"{func} writes {outside} byte(s) past the {b[1] - b[0]} of {base}, through a view that as_strided "
            f"made at {made_at} over {v[1] - v[0]} bytes from there (during {doctor.phase})",
            explain.past_extent(base, b[1] - b[0], v[1] - v[0]),
            {"buffer_bytes": b[1] - b[0], "written_past": outside}), ("undersized-buffer", "past extent", made_at))
        return


def graph_memory(doctor, key: int):
    """The graph whose memory ``key`` is: the one that made it (its pool's), else one whose capture
    read it; None for memory no graph uses (a step's temporary)."""
    return doctor.owner_of(key) or next((info for info in doctor.graphs.values() if key in info.externals), None)


def failed_view(doctor, func, args, error: BaseException) -> None:
    """A view asked over more bytes than its storage holds (torch's bounds check of ``as_strided``,
    ``set_``), of memory a graph reads: an announced buffer, or memory a capture read or made. The
    code lays data of a step's size over a static buffer sized for less -- a buffer sized by the
    first request and handed on to the next -- which CUDA code laying a tensor over the raw pointer
    writes past the end of, unchecked. Named where the shape came from: the first frame, walking
    out, that was not handed it as an argument (``sync.handed_in``), else the line of the view."""
    base = args[0] if args else None
    if not isinstance(base, torch.Tensor) or "out of bounds for storage" not in first_line(error):
        return
    key = storage_key(base)
    buf = doctor.buffer(key)
    graph = graph_memory(doctor, key)
    if buf is None and graph is None:
        return
    shape = tuple(args[1]) if len(args) > 1 and isinstance(args[1], (list, tuple, torch.Size)) else ()
    at = user_frame()
    frames = [(f, f.f_lineno) for f in user_frames()]
    source = (shape and handed_in(frames, lambda v: isinstance(v, (list, tuple)) and tuple(v) == shape)) or at
    name = buf.name if buf is not None else f"memory {graph.name} reads"
    have = base.untyped_storage().nbytes()
    doctor.add(Finding(
        "undersized-buffer", buf.owner if buf is not None else graph.name, str(func), f"{name}: {describe(base)}",
        source, f"{func} at {at} asked for a view of shape {list(shape)} over {name}, whose storage holds {have} "
        f"bytes (during {doctor.phase}): {first_line(error)}",
        explain.overflow_view(name, shape, have), {"storage_bytes": have}),
        ("undersized-buffer", "past storage", source))


def _padded_window(doctor, entry: tuple, window: torch.Tensor) -> None:
    """A window taken through a raw-pointer view from where its base starts, over the base's elements
    stretched from the real rows to the padded size of the step just replayed (``padded_step``): the
    code treats a tensor sized for the real rows as holding the padded ones -- a kernel handed the
    pointer of per-request metadata and a count taken from the padded outputs reads past its end,
    which no shape check stops, and the padded rows get whatever lies there (``padded-shape-mismatch``).
    Named where the base was handed in, when the function taking the window was given it as an
    argument (a kernel's: real code reads below the user's frames), else where the window is taken."""
    b, _, made_at, name, what, ref = entry
    step, w = doctor.padded_step, span(window)
    if step.real >= step.size or w is None or w[0] != b[0] or w[1] <= b[1] \
            or (w[1] - w[0]) * step.real != (b[1] - b[0]) * step.size:
        return
    base, frames = ref(), user_frames()
    if base is None or not frames:
        return
    code, source = frames[0].f_code, location(frames[0])
    if any(frames[0].f_locals.get(n) is base for n in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]) \
            and len(frames) > 1:
        source = location(frames[1])
    base_name = f"{name}: {what}" if name else what
    count = (w[1] - w[0]) // window.element_size()
    doctor.add(Finding(
        "padded-shape-mismatch", step.graph, "as_strided", base_name, source,
        f"{location(frames[0])} reads {count} element(s) from where {base_name} starts, through a view that "
        f"as_strided made at {made_at}: {base_name} holds {(b[1] - b[0]) // window.element_size()}, for the "
        f"{step.real} real rows; {count} is their count at the padded size {step.size} of replay {step.replay} "
        f"of {step.graph}",
        explain_padding.padded_shape_mismatch(step.graph, step.real, step.size),
        {"real": step.real, "size": step.size, "elements_read": count}), ("padded-shape-mismatch", "window", source))


aten = torch.ops.aten
_PUTS = (aten.index_put_, aten._index_put_impl_)
_SCATTERS = (aten.scatter_, aten.scatter_add_, aten.scatter_reduce_)
_INDEX_DIM = (aten.index_copy_, aten.index_fill_, aten.index_add_)
_MASKED = (aten.masked_fill_, aten.masked_scatter_)


def _indexed(func, args, t: torch.Tensor) -> torch.Tensor | None:
    """The storage elements of ``t`` an op that writes through an index (``t[addr] = v``, a scatter,
    a mask) writes: a raw-pointer view over a whole arena is written where its addresses point, not
    all over. None for an op that writes all of ``t``; none where the index itself fails (the op's
    error is the workload's)."""
    packet = func.overloadpacket
    if packet not in _PUTS + _SCATTERS + _INDEX_DIM + _MASKED:
        return None
    with _disable_current_modes():
        pos = torch.arange(t.untyped_storage().nbytes() // t.element_size(), device=t.device).as_strided(
            t.shape, t.stride(), t.storage_offset())
        try:
            if packet in _PUTS:
                return pos[tuple(slice(None) if i is None else i for i in args[1])]
            if packet in _SCATTERS:
                return pos.gather(args[1], args[2])
            if packet in _INDEX_DIM:
                return pos.index_select(args[1], args[2])
            return pos[args[1].expand(pos.shape)]
        except (IndexError, RuntimeError):
            return pos.new_empty(0)
