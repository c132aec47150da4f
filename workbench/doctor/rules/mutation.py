"""persistent-mutation: persistent memory changed where nobody expects it.

* A graph writes one of its static input buffers (the mutation probe measures whether a replay
  keeps changing it: ``probes/mutation.py``); a graph never replayed is reported unprobed.
* Eager code around the graphs updates a static input in place, reading what is there (``+=``):
  harmless on rows the runner rewrites every step, drift on rows nobody rewrites (padded rows).
  Beside a run without graphs it is held until a replay or the workload's results part from that
  run: a counter kept in the buffer on purpose (a KV length advanced each step) builds on itself too.
  In warmups too: each warmup should run on the dummy batch as prepared, and one that builds on
  what the previous warmup left drifts (lengths past what was allocated).
* A warmup overwrites rows of persistent state (announced KV/SSM caches) that hold live data.
* A graph updates a static input in place that the runner refills, before every replay, from the
  same tensor, which never receives the update: the state lives in that tensor, and the graph
  updates a copy (a cache handed to a graph wrapper that copies every input it does not own).

Buffers announced as persistent state, shared outputs or metadata are written on purpose: only the
last rule concerns them.
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ...engine.opinfo import describe, mutable, overwrites, storage_key
from ...engine.source import user_frame
from .. import explain
from ..probes import held, release
from ..report import Finding
from ..tensors import at, changed, onto, region
from . import undersized


def eager_write(doctor, func, args, kwargs, run, targets: list):
    """An in-place op on announced buffers outside any graph. Evidence of drift: elements the op
    changes that its previous call wrote and no other write outside warmups and captures has
    touched since (a warmup runs the model's own code, so its writes are not a runner's refresh)."""
    inputs = [(key, t, buf) for key, t, buf in targets if buf.role == "input"]
    accumulate = bool(inputs) and not overwrites(func, args, kwargs)
    with _disable_current_modes():
        before = [buf.ref().clone() for _, _, buf in inputs] if accumulate else None
    out = undersized.write(doctor, func, targets, run)
    if not (doctor.tracking_fresh or doctor.updates or accumulate):
        return out
    source = user_frame() if accumulate else None
    with _disable_current_modes():
        regions = {key: region(t, buf.ref()) for key, t, buf in targets}
        if doctor.tracking_fresh:
            for key, mask in regions.items():
                doctor.fresh[key] = doctor.fresh[key] | mask if key in doctor.fresh else mask
        if not accumulate:
            for key, _, _ in inputs:
                _rewritten(doctor, key, regions[key])
            return out
        for (key, _, buf), was in zip(inputs, before, strict=True):
            _accumulated(doctor, func, key, buf, was, regions[key], source)
    return out


_RELAYOUT = (torch.ops.aten.set_, torch.ops.aten.resize_, torch.ops.aten.resize_as_)


@functools.cache
def _relayouts(func) -> bool:
    """Whether ``func`` gives its destination another geometry in place (asked once per op: a
    served step writes its static inputs on every step)."""
    return func.overloadpacket in _RELAYOUT or torch.Tag.inplace_view in func.tags


def write(doctor, func, args, kwargs, run, targets: list, update: bool):
    """An op that writes announced buffers outside any graph: ``eager_write`` when it may be an
    update to track (``update``), else the shape contract alone. An op that gives a buffer another
    geometry in place (``set_``, ``resize_``, an in-place view such as ``squeeze_``: a copy that
    re-allocates its destination to the source's size) voids what the rules knew of its elements
    -- which were written since the last replay, which an update or a copy last changed: they were
    elements of another layout. They start again from this op, which wrote the whole buffer."""
    if not _relayouts(func):
        if update:
            return eager_write(doctor, func, args, kwargs, run, targets)
        return undersized.write(doctor, func, targets, run)
    out = undersized.write(doctor, func, targets, run)
    for key, _, buf in targets:
        for records in (doctor.updates, doctor.copied, doctor.copied_lines, doctor.replay_wrote, doctor.copy_sources):
            records.pop(key, None)
        if doctor.tracking_fresh:
            with _disable_current_modes():
                doctor.fresh[key] = torch.ones(buf.ref().shape, dtype=torch.bool, device=buf.ref().device)
    return out


def _accumulated(doctor, func, key: int, buf, was: torch.Tensor, mask: torch.Tensor, source: str) -> None:
    whole = buf.ref()
    slot = (str(func), source, buf.name)
    _rewritten(doctor, key, mask, but=slot)
    entry = doctor.updates.setdefault(key, {}).setdefault(slot, [None, 0])
    last, entry[0] = entry[0], mask
    entry[1] += 1
    again = None if last is None else last & changed(was, whole)
    if again is None or not again.any():
        return
    rows = whole.shape[0] if whole.dim() else 1
    again_rows = again.reshape(rows, -1).any(1)
    first = int(again.reshape(-1).nonzero()[0])
    numbers = {"pattern": "accumulating", "call": entry[1], "rows": rows, "rows_changed": int(again_rows.sum()),
               "first_row": int(again_rows.nonzero()[0]), "was": was.reshape(-1)[first].item(),
               "now": whole.reshape(-1)[first].item()}
    warm = doctor.phase == "warmup"
    where = f"warmups (dummy steps of {buf.owner})" if warm else f"outside the graphs (eager code of {buf.owner})"
    finding = Finding("persistent-mutation", where, str(func), f"{buf.name}: {describe(whole)}", source,
                      explain.eager_update_evidence(buf.name, numbers),
                      (explain.warmup_update if warm else explain.eager_update)(str(func), buf.name, buf.owner), numbers)
    if warm:        # decided at the end: a graph that writes the buffer is the mutation probe's to judge
        doctor.warm_updates.setdefault(key, finding)
        return
    # Beside a run without graphs, the drift must show: a counter the runner keeps in the buffer on purpose
    # (a sequence's KV length, advanced each step) builds on what it wrote at every step, and is harmless
    # while every row the graphs read is rewritten or advanced alike. Held by a graph that reads the buffer.
    reader = next((info for info in doctor.graphs.values() if key in info.externals), None) \
        if doctor.reference is not None else None
    with held(doctor, reader.held) if reader is not None else contextlib.nullcontext():
        doctor.add(finding, ("persistent-mutation", str(func), source, buf.name))


def warmup_updates(doctor) -> None:
    """At the end: warmups that built on what an earlier warmup left in a static input that no
    captured graph writes (its update ran only in warmups, or the capture never happened)."""
    for key, f in doctor.warm_updates.items():
        if key not in doctor.graph_writes:
            doctor.add(f, ("persistent-mutation", f.op, f.source, f.tensor.split(":")[0]))


def _rewritten(doctor, key: int, mask: torch.Tensor, but: tuple | None = None) -> None:
    """Elements ``mask`` of a static buffer were written: no tracked update (other than ``but``)
    can build on what it wrote there any more."""
    for slot, entry in doctor.updates.get(key, {}).items():
        if slot != but and entry[0] is not None:
            entry[0] &= ~mask


def inputs_before(doctor, info) -> None:
    """Before a replay: the static inputs the graph writes, as they are (``copied_over``)."""
    with _disable_current_modes():
        doctor.before_replay = {key: buf.ref().clone() for key in info.writes
                                if (buf := doctor.buffer(key)) is not None and buf.role == "input"}


def inputs_after(doctor, info) -> None:
    """After a replay: the elements of its static inputs it changed."""
    with _disable_current_modes():
        for key, before in doctor.before_replay.items():
            if (buf := doctor.buffer(key)) is not None and buf.ref().shape == before.shape:
                doctor.replay_wrote[key] = (info, changed(before, buf.ref()))
    doctor.before_replay = {}


def copied_over(doctor, dst: torch.Tensor, src) -> None:
    """A copy into a static input: when it takes the same tensor, unchanged, as the copy before it,
    the elements the last replay changed there and the copy overwrites were an update that never
    reached that tensor."""
    if not isinstance(src, torch.Tensor) or src.shape != dst.shape or src.device != dst.device:
        return
    key = storage_key(dst)
    with _disable_current_modes():
        taken = (storage_key(src), _geometry(src), _geometry(dst), src.detach().clone())
        previous, doctor.copy_sources[key] = doctor.copy_sources.get(key), taken
        entry = doctor.replay_wrote.pop(key, None)
        if entry is None or previous is None or previous[:3] != taken[:3] or not torch.equal(previous[3], taken[3]):
            return
        info, wrote = entry
        buf = doctor.buffer(key).ref()
        n = int((wrote & onto(dst != src, dst, buf)).sum())
    if not n:
        return
    name, op = doctor.buffer(key).name, info.writes[key]
    doctor.add(Finding(
        "persistent-mutation", info.name, op.name, f"{name}: {describe(buf)}", op.source,
        f"replay {info.replays} of {info.name} changed {n} element(s) of {name} in place; the runner then refilled "
        f"{name} from the same {describe(src)} as before that replay, unchanged since: the update never reached it "
        "and is discarded", explain.update_in_a_copy(op.name, name), {"elements_discarded": n}),
        ("persistent-mutation", op.name, op.source, name))


def _geometry(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.storage_offset(), t.dtype


def replayed(doctor, info) -> None:
    """A replay about to run rewrites the tracked buffers the graph writes: all of them."""
    for key in info.writes.keys() & doctor.updates.keys():
        if (buf := doctor.buffer(key)) is not None:
            with _disable_current_modes():
                whole = buf.ref()
                _rewritten(doctor, key, torch.ones(whole.shape, dtype=torch.bool, device=whole.device))


def probed(doctor, info, key: int, buf, pattern: str, numbers: dict, shape_of) -> None:
    op = info.writes[key]
    doctor.add(Finding(
        "persistent-mutation", info.name, op.name, f"{buf.name}: {describe(shape_of)}", op.source,
        explain.mutation_evidence(buf.name, pattern, numbers),
        explain.mutation(op.name, buf.name, buf.owner, pattern), {"pattern": pattern, **numbers}),
        ("persistent-mutation", op.name, op.source, buf.name))


def unprobed(doctor, info) -> None:
    """A graph that writes a static input buffer but was never replayed while watched (a graph
    probed only on replays before which the runner rewrote everything it writes is not one).
    Where a graph captured from the same code (another capture size) writes that buffer at the same
    line and was probed, its replays are the evidence: the finding is theirs to make."""
    if info.attempts:
        return
    probed_lines = {(key, op.source) for other in doctor.graphs.values() if other.attempts
                    for key, op in other.writes.items()}
    for key, op in info.writes.items():
        if (buf := doctor.buffer(key)) is None or buf.role != "input":
            continue
        dedupe = ("persistent-mutation", op.name, op.source, buf.name)
        if (key, op.source) in probed_lines and dedupe not in doctor.found:
            continue                # (where the probed graph has the finding, this graph's name joins it)
        doctor.add(Finding(
            "persistent-mutation", info.name, op.name, f"{buf.name}: {describe(buf.ref())}", op.source,
            f"{op.name} writes {buf.name} inside the graph; not replayed inside watch(), so whether writes "
            "accumulate was not probed", explain.mutation(op.name, buf.name, buf.owner, "not probed"),
            {"pattern": "not probed"}), dedupe)


def dummy_write(doctor, func, args, kwargs, targets: list) -> None:
    """An op of a dummy batch (a warmup, a capture's eager region): keep the persistent state and
    the older memory it writes as they were, to tell its writes from live data afterwards."""
    before_warmup_write(doctor, targets, str(func))
    if mutable(func):
        doctor.startup.before_write(func, args, kwargs)


def before_warmup_write(doctor, targets: list, op: str) -> None:
    """Keep persistent state as it was before the current warmup first writes it."""
    for key, _, buf in targets:
        if buf.role == "state" and key not in doctor.warm_saved and key in doctor.initial:
            with _disable_current_modes():
                doctor.warm_saved[key] = (buf, buf.ref().clone(), op, user_frame())


def state_announced(doctor, buffers: dict) -> None:
    """Persistent state as announced (``Doctor.announced``), and as warmups have left it since
    (``Doctor.initial``). Announced again (a runner announces its state with every capture), the
    elements the earlier captures' warmups wrote hold dummy data, and the state as announced is
    what it was before them: a runner puts that back once it has captured."""
    for t in buffers.values():
        key, now = storage_key(t), t.detach().clone()
        was, warm = doctor.announced.get(key), doctor.initial.get(key)
        doctor.initial[key], doctor.announced[key] = now, now.clone()
        if was is not None and was.shape == now.shape and was.dtype == now.dtype:
            with _disable_current_modes():
                dummy = changed(was, warm)
                doctor.announced[key][dummy] = was[dummy]


def held_live(doctor, key: int, values: torch.Tensor, view=None, buffer=None) -> torch.Tensor:
    """Which of ``values`` (the whole of persistent state; or, given them, of its ``view``, with
    ``buffer`` the announced tensor) hold live data: changed since the announcement by anything but
    a warmup. An element back at its announced value does not: runners put back what their warmups'
    dummy batches wrote (TensorRT-LLM restores its context lengths after capture), and that restore
    is no request's data."""
    initial, announced = doctor.initial[key], doctor.announced[key]
    if view is not None:
        initial, announced = at(initial, view, buffer), at(announced, view, buffer)
    return changed(initial, values) & changed(announced, values)


def dummy_written(doctor, key: int, view: torch.Tensor) -> None:
    """Eager code wrote into persistent state a value computed from a capture's dummy batch (its
    uncomputed outputs flowing on: the eager pieces of a capture done in pieces): what ``view`` now
    holds is dummy data, as a warmup's writes are, not a request's."""
    buf = doctor.buffer(key)
    buffer = buf.ref() if buf is not None else None
    if buffer is None or key not in doctor.initial:
        return
    with _disable_current_modes():
        covered = region(view, buffer)
        doctor.initial[key][covered] = buffer.detach()[covered]


def warmup_wrote_state(doctor) -> None:
    """At the end of a warmup: rows of persistent state that held live data (changed since the
    announcement by anything but a warmup) and that the warmup changed."""
    saved, doctor.warm_saved = doctor.warm_saved, {}
    for key, (buf, was, op, source) in saved.items():
        now = buf.ref()
        if now is None:
            continue
        with _disable_current_modes():
            rows = was.shape[0] if was.dim() else 1
            live = held_live(doctor, key, was).reshape(rows, -1).any(1)
            written = changed(was, now).reshape(rows, -1).any(1)
            hit = (written & live).nonzero().reshape(-1)
            set_up = _set_up_rows(doctor, key, was, rows) & written & ~live
            # What a warmup wrote is dummy data, not live data: a later warmup may overwrite it.
            doctor.initial[key].reshape(rows, -1)[written] = now.reshape(rows, -1)[written]
        before = not len(hit) and bool(set_up.any())
        if before:
            hit, live = set_up.nonzero().reshape(-1), set_up
        elif not len(hit):
            continue
        how = (f"that held what the workload wrote before announcing {buf.name} (its non-zero rows)" if before
               else "that held live data")
        # Held where the workload has a run without graphs: a warmup run on the step's own batch (a
        # graph captured lazily, the warmup's result served) writes the rows the step writes anyway.
        with held(doctor, doctor.reference.warm_writes if doctor.reference is not None else None):
            doctor.add(Finding(
                "persistent-mutation", "warmup", op, f"{buf.name}: {describe(now)}", source,
                f"a warmup changed {len(hit)} row(s) of {buf.name} {how} (first row {int(hit[0])}; "
                f"{int(live.sum())} live rows of {rows})", explain.live_state(buf.name, buf.owner, before),
                {"rows_overwritten": len(hit), "live_rows": int(live.sum()), "rows": rows,
                 **({"before_announcement": True} if before else {})}),
                ("persistent-mutation", op, source, buf.name))


def _set_up_rows(doctor, key: int, was: torch.Tensor, rows: int) -> torch.Tensor:
    """Rows of state announced after set-up code wrote the workload's data into it that still hold
    that data: non-zero, and as announced (no warmup has written them). Only where the workload has
    a run without graphs, whose results decide whether such a write mattered (a profile run's data
    is no request's, and zeros are what an allocation leaves)."""
    if key not in doctor.set_up_data or doctor.reference is None:
        return torch.zeros(rows, dtype=torch.bool, device=was.device)
    same = ~changed(doctor.initial[key], was) & ~changed(doctor.announced[key], was)
    return (same & (was != 0)).reshape(rows, -1).any(1)


def warm_writes_concluded(doctor, held_writes: list, agreed: bool) -> None:
    """The warmups' writes into live state held by ``warmup_wrote_state``: reported unless the
    workload's results agree with its run without graphs (then the warmup ran the step itself).
    Writes over data set before the state was announced stay held (``unexplained_warm_writes``)."""
    if agreed and held_writes:
        first = held_writes[0][0]
        doctor.report.note(
            f"{first.evidence} ({first.location}), but the workload's results agree with its run without graphs: "
            "the warmup ran the step itself, its writes the step's own: not reported")
        held_writes.clear()
    release(doctor, [w for w in held_writes if not w[0].numbers.get("before_announcement")])
    held_writes[:] = [w for w in held_writes if w[0].numbers.get("before_announcement")]


def unexplained_warm_writes(doctor, held_writes: list) -> bool:
    """Last, where the workload's results differ from its run without graphs and nothing else explains
    them: a warmup's writes over data the workload set before announcing the state (weaker evidence
    than live rows: such data may be a profile run's, which nobody reads). Whether any was reported."""
    release(doctor, held_writes)
    return bool(doctor.report.findings)
