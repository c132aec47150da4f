"""The mutation probe: before a graph's first replay, replay it twice more on the current inputs,
as the runner would, and watch the static input buffers it writes; then put back every storage
the graph writes.

"As the runner would": elements the runner rewrote outside the graphs since the previous replay
(``Doctor.fresh``: a reset of rows, a copy of this step's inputs) are rewritten before the second
probe replay too, and changes there do not count -- resetting what a graph writes before each
replay is the standard fix, not a hazard. A write that leaves the buffer as it was (an idempotent
copy) is no finding either. A replay before which the runner rewrote every element the graph
writes shows nothing: the probe waits for a later one (up to four)."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..rules import mutation
from . import held
from ..tensors import changed, rng_state, set_rng_state, whole


_ATTEMPTS = 4     # replays probed while the runner rewrites every element the graph writes


def probe(doctor, info, graph) -> None:
    inputs = {key: buf for key in info.writes
              if (buf := doctor.buffer(key)) is not None and buf.role == "input"}
    if any(ext.weak.expired() for ext in info.externals.values()):
        return                                  # replaying would read freed memory
    if not inputs:
        info.probed = True
        return
    info.attempts += 1
    with _disable_current_modes():
        saved = [(w, w.clone()) for key in info.writes
                 if (w := whole(info.externals[key].weak)) is not None]
        fresh = {key: doctor.fresh.get(key) for key in inputs}
        states = [{key: buf.ref().clone() for key, buf in inputs.items()}]
    replays, doctor.phase = graph.replays, "probe"
    rng = rng_state(info.cuda)              # a replay advances the generator its RNG ops use
    written = {key: w for key in [*info.writes, *info.created]
               if (w := whole(info.externals[key].weak) if key in info.externals else _owned(doctor, key)) is not None}
    after_first: list = []
    try:
        for _ in range(2):
            with _disable_current_modes():
                for key, buf in inputs.items():        # the runner's refresh, as before this replay
                    if fresh[key] is not None:
                        buf.ref()[fresh[key]] = states[0][key][fresh[key]]
                if len(states) == 2:                   # the state the second replay starts from
                    after_first = [w.clone() for w in written.values()]
            graph.replay()
            with _disable_current_modes():
                states.append({key: buf.ref().clone() for key, buf in inputs.items()})
        independent = _independent(graph, inputs, states, written, after_first)
    finally:
        doctor.phase = "eager"
        graph.replays = replays
        set_rng_state(rng)
        with _disable_current_modes():
            for w, copy in saved:
                w.copy_(copy)
    if all(f is not None and bool(f.all()) for f in fresh.values()) and info.attempts < _ATTEMPTS:
        return                                  # the runner rewrote all of it: probe a later replay
    info.probed = True
    doctor.unprobed = max(0, doctor.unprobed - 1)
    # With a run without graphs announced, what the probe finds is held as state is, reported unless the
    # workload's results say they agree with that run's: a graph that advances its own inputs on purpose
    # (a decode loop keeping its token and position on the device) gives that run's answers.
    with held(doctor, info.held_state if doctor.reference is not None else None):
        for key, buf in inputs.items():
            b0, b1, b2 = (s[key] for s in states)
            kept = None if fresh[key] is None else ~fresh[key]
            found = _pattern(b0, b1, b2, kept)
            if found is not None and found[0] == "overwriting" and key in independent:
                doctor.report.note(f"{info.name} writes every element of the static input {buf.name} it "
                                   "changes from its other inputs (the same values whatever the buffer "
                                   "held): an output kept in an input buffer, not a mutation of one")
            elif found is not None:
                mutation.probed(doctor, info, key, buf, *found, b0)


def _owned(doctor, key: int):
    entry = doctor.owned.get(key)
    return whole(entry[0]) if entry is not None else None


def _independent(graph, inputs: dict, states: list, written: dict, after_first: list) -> set:
    """The float static inputs a replay overwrites from its other inputs alone: replayed again from
    the state after the first probe replay with every element of them moved (up by one, then
    mirrored: a maximum sees the one, a softmax only the other), it writes the same bytes into the
    elements it changed, and everything else it writes is the same too (an output the graph keeps
    in an input buffer; a write that reads the buffer -- an element copied from another, a running
    maximum, rows it leaves for later steps to read -- does not). Integer buffers are left out:
    other values there are other indices, which a replay may take out of bounds."""
    b0, b1, b2 = states
    overwritten = {key: mask for key in inputs if b0[key].dtype.is_floating_point
                   and (mask := changed(b0[key], b1[key])).any() and not changed(b1[key], b2[key]).any()}
    if not overwritten:
        return set()
    with _disable_current_modes():
        second = {key: w.clone() for key, w in written.items() if key not in overwritten}
    for move in (lambda v: v + 1, lambda v: v * -2 - 1):
        with _disable_current_modes():
            for w, kept in zip(written.values(), after_first):
                w.copy_(kept)
            for key in overwritten:
                t = inputs[key].ref()
                t.copy_(move(t))
        graph.replay()
        with _disable_current_modes():
            if not (all(torch.equal(written[key], w) for key, w in second.items()) and not any(
                    changed(inputs[key].ref()[mask], b2[key][mask]).any() for key, mask in overwritten.items())):
                return set()
    return set(overwritten)


def _pattern(b0: torch.Tensor, b1: torch.Tensor, b2: torch.Tensor, kept: torch.Tensor | None):
    """accumulating (each replay changes it again) or overwriting (changed once, then stable),
    counted on the elements the runner does not rewrite (``kept``); None when they never change."""
    first, second = changed(b0, b1), changed(b1, b2)
    if kept is not None:
        first, second = first & kept, second & kept
    if not first.any():
        return None
    rows = b0.shape[0] if b0.dim() else 1
    numbers = {"rows": rows, "rows_changed": int(first.reshape(rows, -1).any(1).sum())}
    if b0.dtype != torch.bool and not b0.dtype.is_complex:
        d1, d2 = ((b.double() - b0.double()).abs().nan_to_num(0.0) for b in (b1, b2))
        if kept is not None:
            d1, d2 = d1 * kept, d2 * kept
        numbers.update(max_change_1=float(d1.max()) if d1.numel() else 0.0,
                       max_change_2=float(d2.max()) if d2.numel() else 0.0)
    return ("accumulating" if second.any() else "overwriting"), numbers
