"""Static inputs a step did not write: does the replay depend on what an earlier step left there?

A static input buffer is the graph's per-step input: the runner writes it before every replay,
and a replay reads whatever is there. When a step omits an input (a text-only batch without its
multimodal metadata, a refresh skipped because "nothing changed"), the graph reads the values an
earlier step wrote, while an eager forward of that step would have computed without them
(TensorRT-LLM #18207: mRoPE delta slots left from the previous batch). Differential replay cannot
see it: the eager form of the step reads the same static buffers, so both agree on the stale
values.

The doctor therefore notes, with differential replay on, which elements of each static input the
runner writes before each graph's replay since that graph's previous one (its step: a step may
replay several graphs on inputs written once), and which it has written between some two replays
so far (``ever``: per-step inputs, as opposed to a table written once). At a sampled
replay of a step that brought inputs (a replay with no input written repeats the last step, as
a benchmark loop does), the rows of a static input the step gave nothing are omitted input: their
elements written in an earlier step, outside the padded rows and columns, that differ from what
they held when the first graph reading them was captured, are *carried over*. (Of a row the step
wrote in part, the rest is its padding -- tokens past its count, blocks past its longest
sequence -- which is ``stale-padding``'s to judge; so are rows ``real..size`` of an input whose
first ``real`` rows, and only those, the step wrote: the batch's padded rows, announced or not.)
The step is run eagerly once more with those elements put back to their capture-time values
(values the captured code ran on, so valid indices stay valid): real-row outputs or state that
change depend on what an earlier step left.
Memory the runner carries over on purpose (a block table updated in place) is persistent state:
announce it with ``events.persistent_state`` and it is not a static input. Where the workload
announces its run without graphs (``probes/reference.py``), what is found on a replay that gives
what that run gives at the same step is held (``differential``): the dependency may be the
workload's own, and is reported once a replay of that graph gives another answer.
"""
from __future__ import annotations

import dataclasses

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ...engine.opinfo import describe, storage_key
from ...engine.source import user_frame
from ..tensors import at, broadcasts, changed, onto, region

_COPY = torch.ops.aten.copy_.default

@dataclasses.dataclass
class Carried:
    """What a sampled step carries over in one static input (the ``reset`` record of
    ``differential._eager``: the buffer, the elements, their capture-time values)."""

    now: torch.Tensor
    mask: torch.Tensor
    before: torch.Tensor
    name: str
    tensor: str

    @property
    def after(self) -> torch.Tensor:          # the replay's state is put back from ``pre``
        return self.now


class CarriedInputs:
    """The doctor's record of per-step writes into static inputs (``Doctor.carried``)."""

    def __init__(self) -> None:
        self.ever: dict[int, torch.Tensor] = {}        # static input -> elements some step wrote
        self.captured: dict[int, torch.Tensor] = {}    # static input -> its values at the first capture reading it
        self.relayed: dict[int, torch.Tensor] = {}     # static input -> elements copied from an earlier step's
        self.writers: dict[int, str] = {}              # static input -> the line that last wrote it

    def capture_end(self, doctor, info) -> None:
        """Start noting what steps write into the graph's static inputs: its externals, and memory of
        another graph's pool announced as its input that no op of that graph writes (``filled``): a
        piece's output buffer that the eager code between pieces fills and the next piece reads is
        this step's input as much as a buffer of its own."""
        info.window, info.consumed = {}, set()
        with _disable_current_modes():
            for key, (owner, *_) in info.foreign.items():
                if (buf := doctor.buffer(key)) is not None and buf.role == "input" and not any(
                        key in op.writes for op in owner.ops):
                    info.filled.add(key)
            for key in (info.externals.keys() | info.filled) - self.captured.keys():
                if (buf := doctor.buffer(key)) is not None and buf.role == "input":
                    self.captured[key] = buf.ref().detach().clone()

    def refresh(self, info, pending, key: int, carried) -> str | None:
        """The line that last wrote a static input in this step, which left out the elements it
        carries over inside the graph's rows (a copy of the real requests' lengths that leaves a padded
        request's as an earlier step wrote them). None where this step wrote none of it, or where the
        carried elements all lie past the graph's rows: the step wrote its rows, and the graph read
        others (a smaller graph reading the tail a larger batch wrote): the read is at fault."""
        mask = (info.step or {}).get(key)
        with _disable_current_modes():
            wrote = mask is not None and bool(mask.any())
            rows = carried.mask.reshape(carried.mask.shape[0], -1).any(1).nonzero() if carried.mask.dim() else None
            past = rows is not None and len(rows) > 0 and int(rows.min()) >= pending.size
        return self.writers.get(key) if wrote and not past else None

    def wrote(self, doctor, func, args, targets: list) -> None:
        """An eager write into static inputs (before it runs). A copy from another static input that
        this step wrote in part relays that input's other elements, an earlier step's values: the
        elements it fills with them are not this step's input. (A copy from an input this step did
        not write at all repeats the last step's inputs for another graph of the same step, as is.)"""
        with _disable_current_modes():
            for key, dst, buf in targets:
                self.writers[key] = user_frame()
                whole = buf.ref()
                mask = self.relayed.get(key)
                if mask is not None:
                    mask &= ~region(dst, whole)
                src = args[1] if func is _COPY and len(args) > 1 else None
                source = doctor.buffer(storage_key(src)) if isinstance(src, torch.Tensor) else None
                fresh = doctor.fresh.get(storage_key(src)) if source is not None else None
                if fresh is None or fresh.shape != source.ref().shape or source.role != "input":
                    continue
                given = at(fresh, src, source.ref())       # which of the copied elements this step wrote
                if not broadcasts(given, dst) or bool(given.all()) or not bool(given.any()):
                    continue
                stale = onto(~given, dst, whole)
                self.relayed[key] = stale if mask is None else mask | stale

    def replay_begins(self, doctor, info) -> None:
        """The runner's writes since the last replay (of any graph) join every graph's window; the
        window of the graph about to replay -- what was written since its own last replay, one
        step's inputs even when a step replays several graphs -- is this step's (``info.step``).
        A buffer that another graph's replay read since has served a step: the next writes into it
        start a new one, so the window restarts there (a larger batch's rows, written for another
        graph, are not this step's)."""
        live = [g for g in doctor.graphs.values() if g.window is not None and g.ref() is not None]
        with _disable_current_modes():
            for key, mask in doctor.fresh.items():
                if key not in self.captured or mask.shape != self.captured[key].shape:
                    continue
                if (relayed := self.relayed.get(key)) is not None and relayed.shape == mask.shape:
                    mask = mask & ~relayed
                self.ever[key] = self.ever[key] | mask if key in self.ever else mask.clone()
                for other in live:
                    if key in other.window and key not in other.consumed:
                        other.window[key] = other.window[key] | mask
                    else:
                        other.window[key] = mask
                        other.consumed.discard(key)
        for other in live:
            if other is not info:
                other.consumed.update(key for key in info.externals if key in other.window)
        if info.window is not None:
            info.step, info.window = info.window, {}
            info.consumed = set()
        self.relayed = {}

    def of_step(self, doctor, info, pending) -> dict:
        """``key -> Carried`` for the static inputs of ``info`` this step carries over (called
        before the replay, after ``replay_begins``)."""
        out = {}
        written = info.step or {}
        if not any(key in info.externals and bool(mask.any()) for key, mask in written.items()):
            return out                    # a step that brings no input at all repeats the last one
        with _disable_current_modes():
            for key, ever in self.ever.items():
                buf = doctor.buffer(key)
                if buf is None or key not in info.externals or key in doctor.graph_writes:
                    continue
                now, was = buf.ref(), self.captured[key]
                if now.shape != was.shape:
                    continue
                mask = ever & changed(now, was) & ~_padded(now, key, pending)
                if key in written and bool(written[key].any()):
                    if now.dim() == 0:
                        continue
                    # Written in part: columns past what a row was given are its padding (tokens past
                    # the count, blocks past the longest row); a row given nothing is carried over.
                    rows = written[key].reshape(now.shape[0], -1).any(1)
                    if int(rows.sum()) == pending.real and bool(rows[:pending.real].all()):
                        rows[pending.real:pending.size] = True     # the batch's real rows: the rest is padding
                    mask &= ~rows.reshape(-1, *([1] * (now.dim() - 1)))
                if bool(mask.any()):
                    out[key] = Carried(now, mask, was, buf.name, describe(now))
        return out


def _padded(buf: torch.Tensor, key: int, pending) -> torch.Tensor:
    """The elements of ``buf`` that are this step's padded rows or padded columns."""
    mask = torch.zeros(buf.shape, dtype=torch.bool, device=buf.device)
    for t in pending.padded.values():
        if isinstance(t, torch.Tensor) and storage_key(t) == key and t.dim() and pending.real < t.shape[0]:
            mask |= region(t[pending.real:pending.size], buf)
    for t, width in pending.columns.values():
        if isinstance(t, torch.Tensor) and storage_key(t) == key and t.dim() > 1 and width < t.shape[1]:
            mask |= region(t[:pending.size, width:], buf)
    return mask
