"""warmup-divergence: the graph reads a tensor computed from a static input before the capture.

A static input changes every step; whatever the graph computes from it inside the capture is
recomputed at every replay. A tensor computed from it *outside* the capture -- before the warmups,
say, when a metadata object is built once and handed to the captured forward -- is computed once:
the graph records only its read, and every replay reads the capture-time values while the input
moves on (text-generation-inference #2163: ``cu_seqlen_k = cumsum(input_lengths)`` built before the
capture).

Until the first replay (set-up: building models, metadata, the capture), the doctor notes for each
storage eager code creates or writes which storages that op read, and where. At the end of each
capture, the storages the graph only reads are traced back through those notes to the static input
buffers they were computed from. At each replay, such a storage that has kept its capture-time
values while its static input changed is reported, at the line that computed it.
"""
from __future__ import annotations

import dataclasses

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import _disable_current_modes

from ...engine.opinfo import mutable, op_tensors, shape_only, storage_key, tensors, written_tensors
from ...engine.source import user_frame
from .. import explain
from ..report import Finding
from ..tensors import changed, whole

aten = torch.ops.aten
_DEPTH = 8                      # how far back a chain of eager ops is followed
_KEPT = 50_000                  # storages noted at most (a watch that never replays notes no more)


@dataclasses.dataclass
class Derived:
    """A storage the graph reads that eager code computed from static input ``source`` before it."""

    weak: StorageWeakRef
    dtype: torch.dtype
    values: torch.Tensor                  # at capture
    source_weak: StorageWeakRef
    source_values: torch.Tensor           # the static input's, at capture
    source_name: str
    tensor: str
    op: str
    line: str


def record(doctor, func, args, kwargs, out) -> None:
    """Set-up only: what an eager op computed (a new storage, or one it wrote) from which storages."""
    if shape_only(func) or len(doctor.computed_from) >= _KEPT:
        return
    inputs = op_tensors(args, kwargs)
    if not inputs:
        return
    written = {storage_key(t) for t in written_tensors(func, args, kwargs)} if mutable(func) else set()
    # Weak references keep the storages' identities (their keys) from being reused while noted.
    read = {storage_key(t): StorageWeakRef(t.untyped_storage()) for t in inputs if storage_key(t) not in written}
    made = [o for o in tensors(out) if storage_key(o) not in read]
    if not read or not (made or written):
        return
    line = user_frame()
    for o in made if not written else [t for t in inputs if storage_key(t) in written]:
        key = storage_key(o)
        old = doctor.computed_from.get(key)
        sources = {**old[1], **read} if old is not None else read   # a second write adds to its sources
        doctor.computed_from[key] = (StorageWeakRef(o.untyped_storage()), sources, str(func), line)


def captured(doctor, info) -> None:
    """At the end of a capture: the storages it only reads that eager code computed from a static input."""
    found = []
    for key, ext in info.externals.items():
        if key in info.writes or key in doctor.buffers or key not in doctor.computed_from:
            continue
        source = _static_source(doctor, key)
        if source is None:
            continue
        weak, _, op, line = doctor.computed_from[key]
        buf = doctor.buffer(source)
        with _disable_current_modes():
            now, src = whole(weak, ext.dtype), buf.ref()
            if now is None:
                continue
            found.append(Derived(weak, ext.dtype, now.clone(), StorageWeakRef(src.untyped_storage()), src.clone(),
                                 buf.name, ext.tensor, op, line))
    info.derived = found


def check(doctor, info) -> None:
    """Before a replay: a derived storage unchanged since the capture, its static input changed."""
    for d in info.derived:
        with _disable_current_modes():
            now = whole(d.weak, d.dtype)
            src = None if d.source_weak.expired() else whole(d.source_weak, d.source_values.dtype)
            if now is None or src is None or src.numel() != d.source_values.numel():
                continue
            moved = int(changed(src.reshape(d.source_values.shape), d.source_values).sum())
            if not moved or bool(changed(now, d.values).any()):
                continue
        doctor.add(Finding(
            "warmup-divergence", info.name, d.op, d.tensor, d.line,
            f"replay {info.replays + 1} of {info.name} reads {d.tensor}, computed at this line from the static input "
            f"{d.source_name} before the capture; {moved} element(s) of {d.source_name} have changed since, "
            f"{d.tensor} has not", explain.derived_before_capture(d.tensor, d.source_name),
            {"replay": info.replays + 1, "source_elements_changed": moved}),
            ("warmup-divergence", d.op, d.line))


def feeds_a_graph(doctor, source: int) -> bool:
    """Whether a live graph reads a storage that set-up code computed from ``source`` (through up to
    ``_DEPTH`` eager ops): a static input a graph uses through what was derived from it."""
    for info in doctor.graphs.values():
        if info.ref() is None:
            continue
        for key in info.externals:
            seen, frontier = {key}, [key]
            for _ in range(_DEPTH):
                nxt = []
                for k in frontier:
                    entry = doctor.computed_from.get(k)
                    for src in (entry[1].keys() - seen if entry is not None else ()):
                        if src == source:
                            return True
                        seen.add(src)
                        nxt.append(src)
                frontier = nxt
    return False


def _static_source(doctor, key: int) -> int | None:
    """The announced static input ``key`` was computed from (through up to ``_DEPTH`` eager ops)."""
    seen, frontier = {key}, [key]
    for _ in range(_DEPTH):
        nxt = []
        for k in frontier:
            entry = doctor.computed_from.get(k)      # (an intermediate may be gone: the chain still holds)
            if entry is None:
                continue
            for src in entry[1].keys() - seen:
                buf = doctor.buffer(src)
                if buf is not None and buf.role == "input":
                    return src
                seen.add(src)
                nxt.append(src)
        frontier = nxt
    return None
