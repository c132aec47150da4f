"""Lookups past a table's end in a dummy batch or a padded replay: which buffer holds the index?

A warmup or a capture runs the capture size's own dummy batch, and a padded replay runs rows no
request gave data. A lookup there that runs past the end of its table (on a GPU an illegal memory
access, or a silent read of other memory) is named by what made the index:

* a lookup into a static input past its end: the buffer is smaller than what a batch of that size
  needs (``undersized-buffer``);
* a lookup into any other table (a rotary cache, a KV pool) whose out-of-range index an announced
  integer buffer holds: a static input of the dummy batch is dummy data that does not fit
  (``undersized-buffer``); state (a request-to-token table read through a dummy request's row) is
  entries no request wrote (``stale-padding``);
* a padded replay's lookup whose index only the padded rows of a static input, or state, hold:
  metadata no real request gave the padded rows (``stale-padding``, at the recorded op);
* a padded replay's lookup whose own index tensor holds the value in a *real* row: the table is
  smaller than the indices requests bring (``undersized-buffer``, where the table was allocated);
* an indexed op of a warmup or capture handed a negative sentinel (-1: fixed-shape padding's "no
  item") in its index: the padding reached a kernel as an index (``stale-padding``, at the op).
"""
from __future__ import annotations

import re

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ...engine import memory
from ...engine.opinfo import describe, storage_key, tensors
from ...engine.source import user_frame
from .. import explain, explain_padding
from ..report import Finding
from ..tensors import first_line
from . import where


_LOOKUPS = frozenset({torch.ops.aten.index, torch.ops.aten.index_select, torch.ops.aten.gather,
                      torch.ops.aten.embedding, torch.ops.aten.take})


def failed_lookup(doctor, func, args, error: BaseException) -> None:
    """A warmup or a capture runs the capture size's own dummy batch: a lookup into a static buffer
    that runs past its end there means the buffer is smaller than what a batch of that size needs."""
    if func.overloadpacket not in _LOOKUPS or not isinstance(error, IndexError) or not args:
        return
    t = args[0] if isinstance(args[0], torch.Tensor) else None
    buf = doctor.buffer(storage_key(t)) if t is not None else None
    if buf is None or buf.role != "input":
        _index_from(doctor, func, args, error)
        return
    source = user_frame()
    doctor.add(Finding(
        "undersized-buffer", where(doctor), str(func), f"{buf.name}: {describe(buf.ref())}", source,
        f"during {where(doctor)} (the capture size's dummy batch), {func} looked {buf.name} up out of its range: "
        f"{first_line(error)}", explain.lookup_past_end(buf.name), {"buffer_shape": list(buf.ref().shape)}),
        ("undersized-buffer", buf.owner, buf.name, source))


_OUT_OF_BOUNDS = re.compile(r"index (-?\d+) is out of bounds for dimension (\d+) with size (\d+)")


def _index_from(doctor, func, args, error: BaseException) -> None:
    """A dummy batch's lookup into a table that is not a static input ran past its end: which
    announced buffer holds the index that did? The lookup's own index tensor first, else any
    announced integer buffer holding that value. The runner's static inputs (the dummy batch's
    data: positions, token counts) holding it means the dummy data does not fit the table:
    ``undersized-buffer``. State holding it (a request-to-token table the dummy rows index
    by their dummy request) means the dummy rows read entries no request wrote:
    ``stale-padding``; on a GPU, an illegal memory access at startup either way."""
    found = _OUT_OF_BOUNDS.search(str(error))
    if found is None:
        return
    value, dim, size = (int(g) for g in found.groups())
    own = {storage_key(a) for a in tensors(args[1:])}
    holders = _holders(doctor, value)
    holder = next((b for b in holders if storage_key(b.ref()) in own), holders[0] if holders else None)
    if holder is None or storage_key(holder.ref()) in doctor.startup.kept:
        return                  # (a warmup wrote it: the step advanced its own input, persistent-mutation's)
    source, table = user_frame(), describe(args[0]) if isinstance(args[0], torch.Tensor) else "its table"
    kind = "stale-padding" if holder.role == "state" else "undersized-buffer"
    evidence = (f"during {where(doctor)} (the capture size's dummy batch), {func} looked {table} up with index "
                f"{value}, past the end of its dimension {dim} (size {size}); {holder.name} ({holder.role}, "
                f"{describe(holder.ref())}) holds that index")
    doctor.add(Finding(kind, where(doctor), str(func), f"{holder.name}: {describe(holder.ref())}", source, evidence,
                       explain_padding.dummy_index(holder.name, holder.role == "state"),
                       {"index": value, "dimension": dim, "size": size}),
               (kind, holder.owner, holder.name, source))


_INDEXED = frozenset({torch.ops.aten.index_add, torch.ops.aten.index_select, torch.ops.aten.index_copy,
                      torch.ops.aten.index_fill, torch.ops.aten.scatter, torch.ops.aten.scatter_add,
                      torch.ops.aten.scatter_reduce, torch.ops.aten.gather, torch.ops.aten.embedding,
                      torch.ops.aten.index, torch.ops.aten.index_put, torch.ops.aten.take})


def failed_sentinel(doctor, func, args, error: BaseException) -> bool:
    """A warmup or a capture runs the step at fixed shapes: entries no real item fills carry a
    sentinel (a neighbour list, a slot mapping or a page table padded with -1). An indexed op that
    fails with such negative indices in its own index argument (``index_add`` and ``index_select``
    reject them; on a GPU a device-side assert, or a write before the table's start) was handed the
    padding's sentinel as if it were an index: ``stale-padding`` at that op (True when reported)."""
    if func.overloadpacket not in _INDEXED or not isinstance(error, (IndexError, RuntimeError)):
        return False
    text = str(error)
    found = _OUT_OF_BOUNDS.search(text)
    if "out of range" not in text and (found is None or int(found.group(1)) >= 0):
        return False                # (an index past the end, not below the start: ``failed_lookup``'s)
    with _disable_current_modes():          # (the doctor's own arithmetic: no op of the watched code)
        index = next((t for t in tensors(args[1:]) if t.dim() and _integer(t) and bool((t < 0).any())), None)
        if index is None:
            return False
        negative = index[index < 0]
        value, count = int(negative[0]), int(negative.numel())
    source = user_frame()
    doctor.add(Finding(
        "stale-padding", where(doctor), str(func), describe(index), source,
        f"during {where(doctor)}, {func} failed ({first_line(error)}): {count} of the {index.numel()} entries of its "
        f"index {describe(index)} hold {value}, a padding sentinel, not an index",
        explain_padding.sentinel_index(str(func), value), {"sentinel": value, "entries": count, "of": index.numel()}),
        ("stale-padding", str(func), source))
    return True


def _holders(doctor, value: int) -> list:
    """The announced integer buffers that hold ``value`` somewhere."""
    return [b for b in doctor.buffers.values() if (t := b.ref()) is not None and isinstance(t, torch.Tensor)
            and _integer(t) and bool((t == value).any())]


def _integer(t: torch.Tensor) -> bool:
    """Whether ``t`` can hold indices (an integer dtype, not bool)."""
    return not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool


def failed_replay_lookup(doctor, info, pending, error: BaseException, op, args=()) -> None:
    """A padded replay's lookup ran past a table's end (on a GPU an illegal memory access, which
    the CPU engine raises at the recorded op; ``op``, ``args``: ``failures.failed_call``). Where
    the lookup's own index shows which rows hold the index, a real row's index past the end means
    the table is smaller than the indices real requests carry (``_real_row_past_end``). Else an
    index held by padded rows of a static input only (rows ``real``..``size``), or by state, means
    padded rows carry metadata no real request gave them (a dummy request's unwritten token row):
    ``stale-padding`` at the recorded op; so does an index no buffer holds that the lookup's own
    index tensor has in padded rows only (the graph computed it from their metadata: a length of
    zero under a query of one token gives position -1)."""
    found = _OUT_OF_BOUNDS.search(str(error))
    if found is None or op is None or pending is None or pending.real >= pending.size \
            or pending.differential and pending.unpadded is not None:
        return                  # (a step with an unpadded form is tried on its real rows: unpadded.crashed)
    value, dim, size = (int(g) for g in found.groups())
    rows = _rows_holding(args, value, pending.size)
    if rows and min(rows) < pending.real:
        _real_row_past_end(doctor, info, pending, op, args[0], (value, dim, size), sorted(rows))
        return
    for holder in _holders(doctor, value):
        t = holder.ref()
        held = (t == value).nonzero()[:, 0] if t.dim() else None
        padded = held is not None and bool(((held >= pending.real) & (held < pending.size)).any()) \
            and not bool((held < pending.real).any())
        if holder.role == "state" or padded:
            where = f"padded row(s) of {holder.name}" if padded else f"{holder.name} (state)"
            doctor.add(Finding(
                "stale-padding", info.name, str(op.func), f"{holder.name}: {describe(t)}", op.source,
                f"replay {info.replays + 1} of {info.name} ({pending.real} real rows of {pending.size}) failed: "
                f"{op.func} looked a table up with index {value}, past the end of its dimension {dim} (size {size}); "
                f"{where} hold that index", explain_padding.dummy_index(holder.name, True),
                {"index": value, "real": pending.real, "size": pending.size}),
                ("stale-padding", holder.owner, holder.name, op.source))
            return
    if rows:                    # no buffer holds it: the graph computed it, for padded rows only
        doctor.add(Finding(
            "stale-padding", info.name, str(op.func), f"its index: padded row(s) {', '.join(map(str, sorted(rows)))}",
            op.source, f"replay {info.replays + 1} of {info.name} ({pending.real} real rows of {pending.size}) failed: "
            f"{op.func} looked a table up with index {value}, past the end of its dimension {dim} (size {size}); only "
            f"padded rows of the lookup's index hold it, computed inside the graph from what those rows hold",
            explain_padding.padded_index(),
            {"index": value, "real": pending.real, "size": pending.size, "rows": sorted(rows)}),
            ("stale-padding", info.name, op.source))


def _rows_holding(args, value: int, size: int) -> set:
    """The batch rows (of ``size``) whose entries of the lookup's own index tensors hold ``value``:
    an index tensor whose first dimension is a multiple of the graph's size, each row's entries
    next to each other (tokens of a request). Empty where no index tensor shows it that way."""
    rows = set()
    with _disable_current_modes():          # (the doctor's own arithmetic: no op of the watched code)
        for t in tensors(args[1:]):
            if not _integer(t) or t.dim() == 0 or t.shape[0] % size:
                continue
            per = t.shape[0] // size
            rows.update(int(i) // per for i in (t == value).reshape(t.shape[0], -1).any(1).nonzero()[:, 0])
    return rows


def _real_row_past_end(doctor, info, pending, op, table, bounds: tuple, rows: list) -> None:
    """A replay's lookup ran past a table's end with an index a *real* row carries (the lookup's
    own index tensor says which row): no padded row is to blame, the table is smaller than the
    indices real requests bring (a stash sized by the batch, indexed by request slot).
    ``undersized-buffer``, named where the table was allocated when the doctor saw it made, else
    at the lookup."""
    value, dim, size = bounds
    buf = doctor.buffer(storage_key(table)) if isinstance(table, torch.Tensor) else None
    name = buf.name if buf is not None else describe(table) if isinstance(table, torch.Tensor) else "its table"
    made = memory.created_by(table) if isinstance(table, torch.Tensor) else None
    source = made[1] if made is not None else op.source
    real = [r for r in rows if r < pending.real]
    evidence = (f"replay {info.replays + 1} of {info.name} ({pending.real} real rows of {pending.size}) failed: "
                f"{op.func} at {op.source} looked {name} up with index {value}, past the end of its dimension {dim} "
                f"(size {size}); real row(s) {', '.join(map(str, real))} of the lookup's index hold it"
                + (f"; the table was allocated by {made[0]} at {made[1]}" if made is not None else ""))
    doctor.add(Finding(
        "undersized-buffer", info.name, str(op.func), f"{name}: {describe(table)}" if buf is not None else name,
        source, evidence, explain.index_past_table(name, size),
        {"index": value, "dimension": dim, "size": size, "real": pending.real, "rows": real}),
        ("undersized-buffer", info.name, name, source))
