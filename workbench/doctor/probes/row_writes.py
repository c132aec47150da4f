"""Which rows wrote what: a padded row's indexed write into state that real rows own.

A step padded from ``real`` to ``size`` rows runs its padded rows through every op, indexed writes
into state included (``index_copy_``, ``index_put_``, ``scatter_`` ... along the batch rows). A runner
gives padded rows an index that touches nothing (-1, a null slot), but code inside the step may turn
it into a live one: a clamp of -1 to 0, a modulo, a default row (a decode kernel's fast path that
sends -1 to row 0, a live request's recurrent state). Neither differential replay (its eager step is
padded too) nor a fill of the padded rows (the runner wrote them itself) sees that, and a runner
whose step has no size-parametric form cannot announce an unpadded one (``probes/unpadded``).

The write itself can: in a watched eager step of a padded sampled replay (``differential``), an
indexed write whose index and source have the step's ``size`` leading rows is run once more on a copy
of its state with only the first ``real`` rows. Elements where the two results differ are what the
padded rows did; where such an element is one that real rows write in this op, or wrote on an
earlier compared step (``Doctor.real_writes``), or that held live data (announced persistent state
changed since its announcement by eager code other than warmups: an eager prefill), the padded rows
changed a real request's state. A padded row that writes a null slot, or writes back what is there
(a guarded kernel), changes nothing real rows own and gives no finding. Static inputs are not state: their writes are
``persistent-mutation``'s. Where the workload announced its run without graphs, what this finds is
held like other state (``differential``): an index whose leading entries are not the batch's rows
(a half-batch's flattened top-k ids as long as the batch) is taken for rows it is not, and the
workload's results, agreeing, say so.

A kernel that updates the state one row at a time (its index, or its source, a slice of a tensor of
the step's rows) is attributed row by row. After eager code wrote persistent state (a prefill, a
cache compaction), the next padded step is watched too, and there only a padded row's write into
live data that real rows read in that step counts (a page a compaction moved behind the padding
dummy's stale slot): lookups of the state by the step's rows note what the real rows read.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ...engine.opinfo import describe, storage_key
from ...engine.source import user_frame
from .. import explain_padding
from ..report import Finding
from ..rules.mutation import held_live
from ..rules.padded_scatter import SCATTERS
from ..tensors import at, changed, onto
from . import unpadded

aten = torch.ops.aten


def indexed_write(doctor, func, args, kwargs, run, rows: tuple[int, int, bool]):
    """Run an op of a padded eager step; where it is an indexed write of the batch rows into kept
    state, note the elements only its padded rows changed that real rows own."""
    form = SCATTERS.get(func.overloadpacket)
    state = args[0] if args and isinstance(args[0], torch.Tensor) else None
    key = storage_key(state) if state is not None else None
    if form is None or key not in doctor.diff.known or not _is_state(doctor, key):
        return run()
    real, size, every = rows
    with _disable_current_modes():
        sliced = _real_rows(form, args, real, size)
        span = _row_span(form, args, size) if sliced is None else None
        before = state.clone() if sliced is not None or span is not None else None
    out = run()
    if before is None:
        return out
    with _disable_current_modes():
        if span is not None:                    # the write of one row (or a few) of a loop over rows
            wrote = changed(before, state)
            nothing = torch.zeros_like(wrote)
            by_padded, by_real = (wrote, nothing) if span[0] >= real else (nothing, wrote) if span[1] <= real \
                else (nothing, nothing)
        else:
            try:
                alone = before.clone()
                func(alone, *sliced, **kwargs)
            except (RuntimeError, IndexError):
                return out
            by_padded = changed(alone, state)
            by_real = changed(before, alone)
        held = _owned(doctor, key, state) | _live(doctor, key, state, before)     # real rows' or live data
        _own(doctor, key, state, by_real)
        d = doctor.diff
        d.real_writes[key] = _union(d.real_writes.get(key), onto(by_real, state))
        hit = by_padded & (by_real | held)
        if every and bool(hit.any()):
            d.row_writes.append((str(func), user_frame(), key, state, int(hit.sum()), real, size))
        elif bool((over := by_padded & held).any()):
            d.padded_writes.append((str(func), user_frame(), key, state, onto(over, state), onto(state, state)))
    return out


def _row_span(form: str, args, size: int) -> tuple[int, int] | None:
    """The batch rows ``[first, end)`` an indexed write covers when its index, or else its source,
    is a slice of a tensor of the step's ``size`` rows: a kernel that updates the state one row at
    a time (``idx = state_indices[i:i + 1]``, ``cache[slot] = key[i]``) writes for those rows only."""
    rest = args[1:]
    if form == "put":
        candidates = (rest[0][0] if rest and rest[0] else None, rest[1] if len(rest) > 1 else None)
    else:
        candidates = (rest[1] if len(rest) > 1 else None, rest[2] if len(rest) > 2 else None)
    for t in candidates:
        base = getattr(t, "_base", None)
        if isinstance(t, torch.Tensor) and base is not None and base.dim() and base.shape[0] == size \
                and base.stride(0) > 0:
            first = (t.storage_offset() - base.storage_offset()) // base.stride(0)
            if 0 <= first < size:
                return first, min(first + (t.shape[0] if t.dim() == base.dim() else 1), size)
    return None


def _union(kept, mask):
    return mask if kept is None or kept.shape != mask.shape else kept | mask


_READS = frozenset({aten.index.Tensor})


def indexed_read(doctor, func, args, rows: tuple[int, int, bool]) -> None:
    """A lookup of kept state by the step's batch rows (``state[slots]``, each index tensor with the
    step's ``size`` leading rows): note the elements its first ``real`` rows read. A padded row's
    write into one of them (``report``) changes what a real request reads."""
    if func not in _READS or len(args) < 2 or not isinstance(args[0], torch.Tensor):
        return
    state, indices = args[0], args[1]
    key = storage_key(state)
    real, size, _ = rows
    given = [i for i in indices if i is not None]
    if key not in doctor.diff.known or not _is_state(doctor, key) or not given \
            or any(i.dim() == 0 or i.shape[0] != size or i.dtype == torch.bool for i in given):
        return
    with _disable_current_modes():
        mask = torch.zeros(state.shape, dtype=torch.bool, device=state.device)
        try:
            mask[tuple(i[:real] if i is not None else slice(None) for i in indices)] = True
        except (RuntimeError, IndexError):
            return
        read = onto(mask, state)
        doctor.diff.real_reads[key] = _union(doctor.diff.real_reads.get(key), read)
        _read_back(doctor, key, state, read)


def _read_back(doctor, key: int, state: torch.Tensor, read: torch.Tensor) -> None:
    """Real rows of this step read elements that padded rows of an earlier step overwrote while they
    held live data, and that still hold what the padded rows wrote (nobody rewrote them since): the
    padded rows' write reaches a real request one step later (a stale slot that wrote into a page
    eager code had just filled, read by the request that owns it now)."""
    left = doctor.padded_left.get(key)
    if left is None or left[2].shape != read.shape:
        return
    op, source, mask, values, replay = left
    hit = read & mask & ~changed(onto(state, state), values)
    if bool(hit.any()):
        doctor.diff.carried.append((op, source, key, state, int(hit.sum()), replay))


def report(doctor, info, pending, run) -> None:
    """The padded-row writes a watched eager step noted (``indexed_write``), as findings: into
    elements real rows write or own (on a sampled step), or into live data (a prefill wrote it, or
    real rows did) that real rows only read (``indexed_read``): a live page the padded rows' stale
    slot now points at. A reserved dummy slot that masked positions of real rows gather holds no
    live data, and elements real rows both read and write are their own slots (a dummy step whose
    real rows sit on the null slot with the padded rows)."""
    if not run.row_writes:
        for op, source, key, state, mask, values in run.padded_writes:
            read, wrote = run.real_reads.get(key), run.real_writes.get(key)
            if wrote is not None and wrote.shape == mask.shape:
                mask = mask & ~wrote
            if read is not None and read.shape == mask.shape and bool((hit := read & mask).any()):
                run.row_writes.append((op, source, key, state, int(hit.sum()), pending.real, pending.size))
                break
            if bool(mask.any()):                  # live data no real row read this step: followed (``_read_back``)
                doctor.padded_left[key] = (op, source, mask, values, info.replays)
    for op, source, key, state, elements, real, size in run.row_writes[:1]:
        label = _label(doctor, key, state)
        evidence = (f"sampled replay {info.replays} of {info.name} ({real} real rows of {size}): in an eager run of "
                    f"the step, {op} changed {elements} element(s) of {label} for its padded rows alone, element(s) "
                    "that real rows write or read in this step, or wrote in an earlier one")
        doctor.add(Finding("stale-padding", info.name, op, label, source, evidence,
                           explain_padding.padding_writes_owned(label, op),
                           {"replay": info.replays, "elements": elements, "real": real, "size": size}),
                   ("stale-padding", op, source))
        return
    for op, source, key, state, elements, replay in run.carried[:1]:
        label = _label(doctor, key, state)
        evidence = (f"replay {replay} of {info.name}: in an eager run of that step, {op} wrote for its padded rows "
                    f"alone into live data of {label}; replay {info.replays} ({pending.real} real rows of "
                    f"{pending.size}) reads {elements} of those element(s) for its real rows, as the padded rows "
                    "left them")
        doctor.add(Finding("stale-padding", info.name, op, label, source, evidence,
                           explain_padding.padding_writes_owned(label, op),
                           {"replay": replay, "read_at": info.replays, "elements": elements}),
                   ("stale-padding", op, source))


def _label(doctor, key: int, state: torch.Tensor) -> str:
    buf = doctor.buffer(key)
    return f"`{buf.name}`" if buf is not None else f"the state {describe(state)}"


def _is_state(doctor, key: int) -> bool:
    buf = doctor.buffer(key)
    return buf is None or buf.role == "state"


def _real_rows(form: str, args, real: int, size: int) -> tuple | None:
    """The op's arguments after the state, keeping only the first ``real`` batch rows of its index
    and source; None where the index does not run over the step's ``size`` rows."""
    rest = list(args[1:])
    if form == "dim":                               # (dim, index, source | value, ...)
        if len(rest) < 2 or rest[0] % max(args[0].dim(), 1) != 0 or rest[1].dim() != 1 or rest[1].shape[0] != size:
            return None
        rest[1] = rest[1][:real]
        if len(rest) > 2 and isinstance(rest[2], torch.Tensor) and rest[2].dim() and rest[2].shape[0] == size:
            rest[2] = rest[2][:real]
        return tuple(rest)
    if form == "put":                               # (indices, values, accumulate)
        indices = rest[0]
        if not indices or indices[0] is None or indices[0].dim() == 0 or indices[0].shape[0] != size:
            return None
        rest[0] = [i[:real] if i is not None and i.dim() and i.shape[0] == size else i for i in indices]
        if len(rest) > 1 and isinstance(rest[1], torch.Tensor) and rest[1].dim() and rest[1].shape[0] == size:
            rest[1] = rest[1][:real]
        return tuple(rest)
    if len(rest) < 2 or not isinstance(rest[1], torch.Tensor) or rest[1].dim() == 0 or rest[1].shape[0] != size:
        return None                                 # scatter: (dim, index, src | value, ...)
    rest[1] = rest[1][:real]
    if len(rest) > 2 and isinstance(rest[2], torch.Tensor) and rest[2].dim() and rest[2].shape[0] >= real:
        rest[2] = rest[2][:real]
    return tuple(rest)


def _owned(doctor, key: int, state: torch.Tensor) -> torch.Tensor:
    """The elements of ``state`` (a view) that real rows wrote on earlier compared steps."""
    dtype, mask = doctor.real_writes.get(key, (None, None))
    if dtype != state.dtype:
        return torch.zeros(state.shape, dtype=torch.bool, device=state.device)
    return at(mask, state)


def _live(doctor, key: int, state: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """The elements of ``state`` (a view of announced persistent state) that held live data before
    the op: changed since the announcement by eager code other than warmups (a prefill), not by a
    replay (the rows a replay writes are real rows' when they are ``Doctor.real_writes``, and else a
    padded row's null slot) unless eager code wrote them again after it (a cache compaction moving a
    live page into a slot a padded row once wrote)."""
    buf = doctor.buffer(key)
    initial = doctor.initial.get(key)
    if buf is None or initial is None or initial.dtype != state.dtype:
        return torch.zeros(state.shape, dtype=torch.bool, device=state.device)
    live = held_live(doctor, key, before, state, buf.ref())
    replayed, left = doctor.replay_changed.get(key), doctor.replay_left.get(key)
    if replayed is not None and replayed.numel() == state.untyped_storage().nbytes() // state.element_size():
        still = at(replayed, state)
        if left is not None and left.shape == replayed.shape:
            still = still & ~changed(at(left, state), before)      # rewritten since by eager code: live again
        live &= ~still
    return live


def replays_wrote(doctor, pending, replayed: dict) -> None:
    """After a compared replay: the elements of announced persistent state it changed, and the
    state as it left it."""
    with _disable_current_modes():
        for key, (w, _, before) in pending.pre.items():
            if key in doctor.initial and w.dtype == doctor.initial[key].dtype:
                mask = changed(before, replayed[key])
                kept = doctor.replay_changed.get(key)
                doctor.replay_changed[key] = mask if kept is None or kept.shape != mask.shape else kept | mask
                doctor.replay_left[key] = replayed[key]


def _own(doctor, key: int, state: torch.Tensor, mine: torch.Tensor) -> None:
    """Add the elements of ``state`` (a view) that real rows wrote to ``Doctor.real_writes``."""
    if bool(mine.any()):
        unpadded.own(doctor, key, state.dtype, onto(mine, state))
