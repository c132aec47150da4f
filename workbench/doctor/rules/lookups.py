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
  metadata no real request gave the padded rows (``stale-padding``, at the recorded op).
"""
from __future__ import annotations

import re

import torch

from ...engine.opinfo import describe, storage_key, tensors
from ...engine.source import user_frame
from .. import explain
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
                       explain.dummy_index(holder.name, holder.role == "state"),
                       {"index": value, "dimension": dim, "size": size}),
               (kind, holder.owner, holder.name, source))


def _holders(doctor, value: int) -> list:
    """The announced integer buffers that hold ``value`` somewhere."""
    return [b for b in doctor.buffers.values() if (t := b.ref()) is not None and isinstance(t, torch.Tensor)
            and not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool
            and bool((t == value).any())]


def failed_replay_lookup(doctor, info, pending, error: BaseException, op) -> None:
    """A padded replay's lookup ran past a table's end (on a GPU an illegal memory access, which
    the CPU engine raises at the recorded op): an index held by padded rows of a static input only
    (rows ``real``..``size``), or by state, means padded rows carry metadata no real request
    gave them (a dummy request's unwritten token row): ``stale-padding`` at the recorded op
    (``op``: ``failures.failed_op``)."""
    found = _OUT_OF_BOUNDS.search(str(error))
    if found is None or op is None or pending is None or pending.real >= pending.size \
            or pending.differential and pending.unpadded is not None:
        return                  # (a step with an unpadded form is tried on its real rows: unpadded.crashed)
    value, dim, size = (int(g) for g in found.groups())
    for holder in _holders(doctor, value):
        t = holder.ref()
        rows = (t == value).nonzero()[:, 0] if t.dim() else None
        padded = rows is not None and bool(((rows >= pending.real) & (rows < pending.size)).any()) \
            and not bool((rows < pending.real).any())
        if holder.role == "state" or padded:
            where = f"padded row(s) of {holder.name}" if padded else f"{holder.name} (state)"
            doctor.add(Finding(
                "stale-padding", info.name, str(op.func), f"{holder.name}: {describe(t)}", op.source,
                f"replay {info.replays + 1} of {info.name} ({pending.real} real rows of {pending.size}) failed: "
                f"{op.func} looked a table up with index {value}, past the end of its dimension {dim} (size {size}); "
                f"{where} hold that index", explain.dummy_index(holder.name, True),
                {"index": value, "real": pending.real, "size": pending.size}),
                ("stale-padding", holder.owner, holder.name, op.source))
            return
