"""overwritten-output: an output is read after a replay wrote new values into its memory.

Tracked per storage, not per graph: a replay of *any* graph that writes the memory of a handed-out
view (its own static outputs, or an output buffer several graphs share) makes the view stale."""
from __future__ import annotations

import weakref

from ...engine.opinfo import describe, storage_key, tensors
from ...engine.source import user_frame
from .. import explain
from ..report import Finding


def tag(doctor, t, info) -> None:
    """``t`` holds outputs of ``info``'s latest replay."""
    key = storage_key(t)
    _remember(doctor, t, key, doctor.generation.setdefault(key, 0), info, info.replays)


def tag_view(doctor, base, view) -> None:
    """A view of a handed-out output is one too."""
    entry = doctor.handed.get(id(base))
    if entry is not None and entry[0]() is base:
        _remember(doctor, view, *entry[1:])


def _remember(doctor, t, key: int, generation: int, info, replays: int) -> None:
    ident = id(t)

    def forget(ref, ident=ident):
        if doctor.handed.get(ident, (None,))[0] is ref:
            del doctor.handed[ident]
    doctor.handed[ident] = (weakref.ref(t, forget), key, generation, info, replays)


def replayed(doctor, info) -> None:
    """Every handed-out storage this replay wrote moves to a new generation."""
    if not doctor.generation:
        return
    for key in info.out_keys & doctor.generation.keys():
        doctor.generation[key] += 1
        doctor.writers[key] = (info, info.replays)


def check_read(doctor, func, args, kwargs) -> None:
    for t in tensors((args, kwargs)):
        entry = doctor.handed.get(id(t))
        if entry is None or entry[0]() is not t or doctor.generation.get(entry[1], 0) <= entry[2]:
            continue
        _, key, _, info, handed_after = entry
        writer, writer_replay = doctor.writers[key]
        source = user_frame()
        if writer is info:
            evidence = (f"an output handed out after replay {handed_after} of {info.name} is read after replay "
                        f"{writer_replay}")
            numbers = {"handed_out_after": handed_after, "read_after": writer_replay}
        else:
            evidence = (f"an output handed out after replay {handed_after} of {info.name} is read after replay "
                        f"{writer_replay} of {writer.name}, which writes the same memory")
            numbers = {"handed_out_after": handed_after, "read_after": writer_replay, "overwritten_by": writer.name}
        doctor.add(Finding(
            "overwritten-output", info.name, str(func), describe(t), source, evidence,
            explain.overwritten(str(func), info.name, handed_after, writer_replay, writer.name), numbers),
            ("overwritten-output", str(func), source))
