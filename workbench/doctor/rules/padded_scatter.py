"""stale-padding through state: a padded row's index names the slot of a real row.

A captured op that writes persistent state through an index (``index_add_``, ``index_copy_``,
``index_put_``, ``scatter_`` ...) runs over every row of the padded batch. Where a padded row's
index names the slot a real row of the same step names, that slot is written twice: with the real
row's data and with the padded row's (TensorRT-LLM gave its padding dummy a real request's state
index, and that request's state got two updates per step). No fill of the padded rows shows this
when the runner writes them itself, so it is a contract, checked before every padded replay on
both backends from the capture's record and the index values: padded rows may share a null slot
among themselves, never a slot a real row names -- in this step, or in an earlier one (the state of
a request parked for this step, which the padded row would update behind its back). The finding
is made once a later step's real rows name that slot again: a request lives on in it, with an
update it never asked for. A slot no later request names held nothing anyone reads (an idle rank's
dummy batch, whose one row counts as real, writes the null slot its padded rows write). Only
indices the graph reads from memory it does not own have values before the replay; an index
computed inside the graph is not checked. The finding is named where this step's eager code wrote
the padded row's index (the runner aimed it at that slot: ``aimed``), else at the scatter, which
used what an earlier step left there.
"""
from __future__ import annotations

import dataclasses

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import _disable_current_modes

from ...engine.opinfo import describe, storage_key
from ...engine.source import user_frame
from .. import explain_padding
from ..report import Finding
from ..tensors import onto, whole

aten = torch.ops.aten

# How each op's index reaches the state it writes: along one dimension (``dim``, a 1-D index),
# element by element (``scatter``, an index shaped like the source), or by advanced indexing
# (``put``, a list of index tensors broadcast together).
SCATTERS = {aten.index_add_: "dim", aten.index_copy_: "dim", aten.index_fill_: "dim", aten.index_reduce_: "dim",
            aten.scatter_: "scatter", aten.scatter_add_: "scatter", aten.scatter_reduce_: "scatter",
            aten.index_put_: "put", aten._index_put_impl_: "put"}


@dataclasses.dataclass(frozen=True)
class Index:
    """A view kept by its storage's weak reference and its geometry, so that recording it keeps
    nothing alive: an index a graph reads, a host mirror of a buffer (``probes/padding.py``)."""

    key: int
    weak: StorageWeakRef
    dtype: torch.dtype
    shape: tuple
    stride: tuple
    offset: int

    def read(self) -> torch.Tensor | None:
        flat = whole(self.weak, self.dtype)
        return None if flat is None else flat.as_strided(self.shape, self.stride, self.offset)


@dataclasses.dataclass(frozen=True)
class Scatter:
    """A captured write into state through indices: ``dims`` are the sizes of the state's
    dimensions the indices address (``dim``: the one indexed, for ``scatter`` all of them)."""

    op: str
    source: str
    state: str
    form: str
    dim: int
    dims: tuple
    indices: tuple


def captured(doctor, info, func, args, kwargs, source: str) -> None:
    """Record a captured scatter into memory the graph does not own, with indices it reads from
    memory it does not own either."""
    form = SCATTERS.get(func.overloadpacket)
    if form is None or len(args) < (2 if form == "put" else 3) or storage_key(args[0]) in info.created:
        return
    state = args[0]
    if form == "put":
        indices, dim = [i for i in args[1] if i is not None], 0
        dims = tuple(state.shape[p] for p, i in enumerate(args[1]) if i is not None)
    else:
        dim = args[1] % max(state.dim(), 1)
        indices, dims = [args[2]], (tuple(state.shape) if form == "scatter" else (state.shape[dim],))
    if not indices or 0 in dims or any(i.dtype in (torch.bool, torch.uint8) or storage_key(i) in info.created
                                       or storage_key(i) in info.writes for i in indices):
        return                      # a mask, or an index the graph computes itself: no value before the replay
    for i in indices:
        doctor.aimed.setdefault(storage_key(i), [])
    buf = doctor.buffer(storage_key(state))
    info.scatters.append(Scatter(
        str(func), source, f"`{buf.name}`" if buf is not None else f"the state {describe(state)}", form, dim, dims,
        tuple(Index(storage_key(i), StorageWeakRef(i.untyped_storage()), i.dtype, tuple(i.shape), i.stride(),
                    i.storage_offset()) for i in indices)))


def aimed(doctor, targets: list) -> None:
    """An eager write into a captured scatter's index buffer: its line and the elements it writes (a
    flat mask of the storage), kept until the next replay (of any graph) ends the step, so that a
    padded row's slot is named where the runner aimed it."""
    step = doctor.report.replays
    for key, dst, _ in targets:
        if (writes := doctor.aimed.get(key)) is not None:
            if writes and writes[0][0] != step:
                writes.clear()                  # (an earlier step's)
            with _disable_current_modes():
                writes.append((step, user_frame(), onto(torch.ones((), dtype=torch.bool, device=dst.device), dst)))


def _aimed_at(doctor, scatter: Scatter, row: int) -> str | None:
    """The line of this step's last eager write into a padded row's index elements, if any."""
    for i in scatter.indices:
        writes = [(source, mask) for step, source, mask in doctor.aimed.get(i.key, ()) if step == doctor.report.replays]
        if not writes or (flat := whole(i.weak, i.dtype)) is None or not i.shape or row >= i.shape[0]:
            continue
        elements = torch.arange(flat.numel()).as_strided(i.shape, i.stride, i.offset)[row].reshape(-1)
        for source, mask in reversed(writes):
            if mask.numel() == flat.numel() and bool(mask.cpu()[elements].any()):
                return source
    return None


def check(doctor, info) -> None:
    """Before every replay (not in ``diagnose``'s padded-row runs, whose fills are the doctor's):
    note the slots real rows write; on a padded replay, check the padded rows' slots."""
    pending = info.pending
    if not info.scatters or doctor.pattern is not None or pending is None:
        return
    with _disable_current_modes():
        for n, scatter in enumerate(info.scatters):
            _check(doctor, info, n, scatter, pending.real, pending.size)


def _check(doctor, info, n: int, scatter: Scatter, real: int, size: int) -> None:
    padded_by = next((buf for i in scatter.indices if (buf := doctor.buffer(i.key)) is not None
                      and buf.role not in ("state", "output")), None)
    values = [i.read() for i in scatter.indices]
    if padded_by is None or any(v is None for v in values):
        return
    slots = _slots(scatter, [v.cpu() for v in values])
    if slots is None or slots.shape[0] != size:
        return
    slots = slots.reshape(size, -1)
    real_slots = slots[:real].reshape(-1)
    earlier = info.live_slots.get(n, real_slots[:0])
    info.live_slots[n] = torch.unique(torch.cat([earlier, real_slots]))
    suspects = info.shared_slots.get(n, {})
    if lives := next((suspects[s] for s in real_slots.tolist() if s in suspects), None):
        doctor.add(*lives)                        # a request lives on in the slot a padded row wrote
        suspects.clear()
    if real >= size:
        return
    now, before = torch.isin(slots[real:], real_slots), torch.isin(slots[real:], earlier)
    shared = now | before
    if not shared.any():
        return
    row = real + int(shared.any(1).nonzero()[0])
    slot = int(slots[row][shared[row - real]][0])
    coords = tuple(int(c) for c in torch.unravel_index(torch.tensor(slot), scatter.dims))
    where = coords[0] if len(coords) == 1 else coords
    numbers = {"replay": info.replays + 1, "real": real, "size": size, "padded_row": row, "slot": where}
    if bool((slots[:real] == slot).any()):
        numbers["real_row"] = int((slots[:real] == slot).any(1).nonzero()[0])
        whose = f"as real row {numbers['real_row']} does"
    else:
        whose = "which real rows of an earlier replay wrote (a request not in this batch holds it)"
    site = _aimed_at(doctor, scatter, row)
    finding = Finding(
        "stale-padding", info.name, scatter.op, f"{padded_by.name}: {describe(padded_by.ref())}",
        site or scatter.source,
        f"before replay {numbers['replay']} of {info.name} ({real} real rows of {size}): padded row {row} of the "
        f"index names slot {where} of {scatter.state}, {whose}, so {scatter.op} at {scatter.source} writes that "
        "slot for a padded row" + (": this step's eager code aimed the padded row there" if site else ""),
        explain_padding.padded_scatter(scatter.op, padded_by.name, scatter.state), numbers)
    suspects = info.shared_slots.setdefault(n, {})     # reported once a later step's real rows name one again
    for s in slots[real:][shared].unique().tolist():
        suspects.setdefault(s, (finding, ("stale-padding", scatter.op, scatter.source, padded_by.name)))


def _slots(scatter: Scatter, values: list[torch.Tensor]) -> torch.Tensor | None:
    """The state element (a flat number over ``scatter.dims``) each index element writes, shaped
    like the index (its first dimension: the batch rows); None for shapes the op would refuse."""
    if scatter.form == "dim":
        return values[0].long() % scatter.dims[0] if values[0].dim() == 1 else None
    if scatter.form == "put":
        try:
            values = torch.broadcast_tensors(*values)
        except RuntimeError:
            return None
        flat = torch.zeros(values[0].shape, dtype=torch.long)
        for v, n in zip(values, scatter.dims):
            flat = flat * n + v.long() % n
        return flat if flat.dim() else None
    index = values[0]
    if index.dim() != len(scatter.dims) or any(a > b for a, b in zip(index.shape, scatter.dims)):
        return None
    coords = torch.meshgrid(*(torch.arange(n) for n in index.shape), indexing="ij")
    flat = torch.zeros(index.shape, dtype=torch.long)
    for d, (c, n) in enumerate(zip(coords, scatter.dims)):
        flat = flat * n + (index.long() % n if d == scatter.dim else c)
    return flat
