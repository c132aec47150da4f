"""overwritten-output: an output is read after a replay wrote new values into its memory.

Tracked per memory block, not per graph: a replay of *any* graph that writes the memory of a
handed-out view (its own static outputs, an output buffer several graphs share, or a pool block a
later capture was given because the view did not own it) makes the view stale. Blocks are keyed by
device and address (``pool.block``), as the allocator hands them on: a runner that keeps only a
weak reference (or a raw pointer) to a graph's output lets the next capture of the pool place its
own tensors there, and on CUDA that tensor has another storage at the same address."""
from __future__ import annotations

import weakref

import torch

from ...engine.opinfo import describe, tensors
from ...engine.source import location, user_frame, user_frames
from .. import explain
from ..report import Finding
from .pool import block

_aten = torch.ops.aten
# Views that take a part of a tensor; ``alias`` is what indexing gives where this step's part is the
# whole (``t[:n, ...]`` with ``n`` rows: the same line takes a part of a smaller batch).
_PARTS = {_aten.slice, _aten.select, _aten.narrow, _aten.split, _aten.split_with_sizes, _aten.unbind,
          _aten.chunk, _aten.diagonal, _aten.unfold, _aten.alias}


def tag(doctor, t, info) -> None:
    """``t`` holds outputs of ``info``'s latest replay. The tensor it views (the graph's static output,
    which a runner may also hand on as it is: a dict of the graph's outputs, returned at every
    replay) is the runner's: reading it reads the latest replay, but a view eager code takes of it
    holds that replay's output, as ``t`` does (``tag_view``)."""
    key = block(t)
    _remember(doctor, t, key, doctor.generation.setdefault(key, 0), info, info.replays, None)
    base = t._base
    if base is not None and ((kept := doctor.handed.get(id(base))) is None or kept[0]() is not base
                             or kept[1:4] != (key, None, info)):   # (a runner hands out a view of it every step)
        _remember(doctor, base, key, None, info, None, None)


def tag_view(doctor, func, base, out) -> None:
    """A view of a handed-out output is one too, and so is each of the views a split returns. The
    first line that took a part of one (a slice, a row: ``_PARTS``) is kept with it: the code there
    chose to keep a piece of the graph's memory rather than a copy of it (views of that view keep
    the same line). A view of the whole (``detach``, a reshape) only hands the same output on in
    another form. The engine's own output slice is the view it hands out (``tag`` keeps it with no
    line), so no line is looked up for it: a walk up the stack on every served step."""
    entry = doctor.handed.get(id(base))
    if entry is not None and entry[0]() is base:
        made = entry[5] or (user_frame() if func.overloadpacket in _PARTS and not doctor.engine_serving else None)
        key, generation, info, replays = entry[1:5]
        if generation is None:                    # the graph's own output: a view holds the latest replay
            generation, replays = doctor.generation.setdefault(key, 0), info.replays
        for view in tensors(out):
            _remember(doctor, view, key, generation, info, replays, made)


def _remember(doctor, t, key: tuple, generation: int, info, replays: int, made: str | None) -> None:
    """Keyed by the view's ``id`` with a weak reference to it (a lookup checks that the view is the
    same object). Entries of released views are swept every 64 additions, not by callbacks: a
    runner hands out a view per step, and a callback per view costs host time on every step. The
    last item is where the view was kept across a replay that wrote it (``_keepers``)."""
    handed = doctor.handed
    if len(handed) & 63 == 63:
        for ident in [i for i, entry in handed.items() if entry[0]() is None]:
            del handed[ident]
    handed[id(t)] = (weakref.ref(t), key, generation, info, replays, made, None)


def replayed(doctor, info) -> None:
    """Every handed-out block this replay wrote moves to a new generation."""
    if not doctor.generation:
        return
    written = info.blocks.intersection(doctor.generation)       # the few handed-out blocks
    for key in written:
        doctor.generation[key] += 1
        doctor.writers[key] = (info, info.replays)
    if written and doctor.reference is not None:
        _keepers(doctor, written)


def _keepers(doctor, written: set) -> None:
    """Where each live output of an earlier replay that this replay overwrote is held: the innermost
    user frame with it among its locals (or in a list, tuple or dict there), kept as ``(its line,
    its code, the frame's id)``. That code kept a piece of the graph's memory past the next replay,
    where a copy would have kept its values. Only where a run without graphs is compared
    (``diagnose``): a walk up the stack at a replay is no cost for every step."""
    live = {ident: entry for ident, entry in doctor.handed.items() if entry[1] in written
            and entry[2] is not None and entry[5] is None and entry[6] is None and entry[0]() is not None}
    if not live:
        return
    for frame in user_frames():
        for value in frame.f_locals.values():
            items = (value,) if isinstance(value, torch.Tensor) else value.values() if isinstance(value, dict) \
                else value if isinstance(value, (list, tuple)) else ()
            if len(items) > 4096:                 # (a large container: not a step's outputs kept)
                continue
            for x in items:
                if id(x) in live and live[id(x)][0]() is x:
                    doctor.handed[id(x)] = (*live.pop(id(x))[:6], (location(frame), frame.f_code, id(frame)))
        if not live:
            return


def check_read(doctor, func, args, kwargs) -> None:
    """An eager op's tensor arguments, looked up among the handed-out views. It runs on every eager
    op while outputs are handed out, so plain tensor arguments are looked up directly and only
    containers (``cat``'s list) are walked."""
    handed = doctor.handed
    for x in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(x, torch.Tensor):
            if id(x) in handed:
                _read(doctor, func, x)
        elif isinstance(x, (list, tuple)):
            for t in tensors(x):
                if id(t) in handed:
                    _read(doctor, func, t)


def _read(doctor, func, t) -> None:
    """A handed-out view is stale once a replay wrote its block since, and while it is still on that
    block: one re-pointed to memory of its own (``t.set_(t.clone())``, ``t.data = ...``: a runner
    cloning live outputs out of the pool) holds its values whatever the pool does."""
    entry = doctor.handed[id(t)]
    if entry[2] is None:                          # the graph's own output, read as it is now
        return
    if entry[0]() is t and doctor.generation.get(entry[1], 0) > entry[2] and block(t) == entry[1]:
        _stale(doctor, func, t, *entry[1:])
        # (read once stale, reported once: later reads of the view, and views taken of it, are the same hazard)
        doctor.handed[id(t)] = (entry[0], entry[1], doctor.generation[entry[1]], *entry[3:])


def _stale(doctor, func, t, key: tuple, generation: int, info, handed_after: int, made: str | None,
           keeper: tuple | None) -> None:
    """Named where the program took the view it read late (where a copy would have kept the values);
    else, where the function that held it across the replay that wrote it has returned since
    (handing up what it kept: a list of a decode loop's logits, stacked by its caller), there; else
    at the read (a function that keeps an output and reads it, itself or through a callee, is the
    read's own flow)."""
    writer, writer_replay = doctor.writers[key]
    read = user_frame()
    kept = None
    if keeper is not None and not any(f.f_code is keeper[1] and id(f) == keeper[2] for f in user_frames()):
        kept = keeper[0]
    source = made or kept or read
    if writer is info:
        evidence = (f"an output handed out after replay {handed_after} of {info.name} is read after replay "
                    f"{writer_replay}")
        numbers = {"handed_out_after": handed_after, "read_after": writer_replay}
    else:
        evidence = (f"an output handed out after replay {handed_after} of {info.name} is read after replay "
                    f"{writer_replay} of {writer.name}, which writes the same memory")
        numbers = {"handed_out_after": handed_after, "read_after": writer_replay, "overwritten_by": writer.name}
    if made is not None:
        evidence += f"; the view read was taken at {made} and read at {read}"
    elif kept is not None and kept != read:
        evidence += f"; it was held at {kept} when a replay wrote it, and read at {read}"
    doctor.add(Finding(
        "overwritten-output", info.name, str(func), describe(t), source, evidence,
        explain.overwritten(str(func), info.name, handed_after, writer_replay, writer.name), numbers),
        ("overwritten-output", str(func), source))
