"""undersized-buffer: a step copies data into a static input where its graph never reads.

A graph reads the views of its static inputs that the capture read: ``input_ids[:, :3]`` if it
was captured on a batch of three tokens, whatever the buffer's width. A later step that copies four
tokens into the buffer is served by a graph that reads three of them: the fourth is dropped
without an error (lmdeploy #4005: a bucket's graph captured on the first batch's token count).

With differential replay on, the doctor notes the views each capture reads of each static input,
and the elements eager code copies into static inputs (``copy_``, slice assignment) between two
replays. Before a replay, elements copied since the previous replay that the graph does not read
are data the step brought and the graph drops. Fills (``zero_``, ``fill_``: a runner neutralising
a whole buffer) bring no data and are not counted.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ...engine.opinfo import describe
from ...engine.source import user_frame
from .. import explain
from ..report import Finding
from ..tensors import region


def read_view(doctor, info, key: int, t: torch.Tensor) -> None:
    """During a capture: a tensor a captured op reads; a view of a static input is kept as its
    geometry (masks are made after the capture, whose stream must record none of the doctor's work)."""
    buf = doctor.buffers.get(key)
    if buf is not None and buf.role == "input":
        info.read_views.setdefault(key, set()).add((tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype))


def capture_end(doctor, info) -> None:
    with _disable_current_modes():
        for key, views in info.read_views.items():
            buf = doctor.buffer(key)
            if buf is None:
                continue
            whole = buf.ref()
            mask = torch.zeros(whole.shape, dtype=torch.bool, device=whole.device)
            for shape, stride, offset, dtype in views:
                view = torch.empty(0, dtype=dtype, device=whole.device).set_(whole.untyped_storage(), offset, shape,
                                                                             stride)
                mask |= region(view, whole)
            info.reads[key] = mask
    info.read_views = {}


def copied(doctor, targets: list) -> None:
    """Eager code copied data into announced buffers (``[(key, written view, Buffer)]``)."""
    for key, dst, buf in targets:
        if buf.role != "input":
            continue
        with _disable_current_modes():
            mask = region(dst, buf.ref())
        entry = doctor.copied.get(key)
        doctor.copied[key] = (entry[0] | mask, entry[1]) if entry is not None else (mask, user_frame())


def check(doctor, info) -> None:
    """Before a replay: what this step copied into the graph's static inputs and the graph does not read."""
    for key, (mask, source) in doctor.copied.items():
        reads = info.reads.get(key)
        if reads is None or reads.shape != mask.shape:
            continue
        with _disable_current_modes():
            lost = mask & ~reads
            if not bool(lost.any()):
                continue
            n, read = int(lost.sum()), int(reads.sum())
        buf = doctor.buffer(key)
        doctor.add(Finding(
            "undersized-buffer", info.name, "aten.copy_.default", f"{buf.name}: {describe(buf.ref())}", source,
            f"before replay {info.replays + 1} of {info.name}, {n} element(s) were copied into {buf.name} where the "
            f"graph never reads (it reads {read} element(s) of it, the views its capture read)",
            explain.unread_copy(buf.name, info.name), {"elements_dropped": n, "elements_read": read}),
            ("undersized-buffer", info.name, "copied, never read"))
