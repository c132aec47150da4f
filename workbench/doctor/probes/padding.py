"""Padded-row and padded-column fills, and the per-replay records ``diagnose`` compares.

``diagnose`` runs a workload twice more with the padded rows and columns filled two different
ways. Two fills, so that whatever a runner does not derive from the step's real data shows:

* **at serve**, elements nothing rewrote since the previous replay (``Doctor.fresh``): what the
  runner neutralises before a replay is its fix, and the fill must not undo it, wherever the
  runner calls ``serve``. A write that eager code has read since (``consumed``: an eager step
  between two replays ran on it, a batch too large for any graph, say) was an earlier step's data,
  not this step's neutralisation, and is filled. NumPy arrays (host metadata) cannot be watched for
  writes and are filled;
* **after each step** (``handed_out``), the rows and columns the *next* step will serve as padded,
  in the tensors the graphs read: the first run's record of its steps (``Plan``) says which. A
  runner that rewrites padded rows with what they held before -- a round trip through a host
  mirror of the buffer, the previous step's real values carried along -- carries the fill into
  the next replay, as TensorRT-LLM's poison-fill tests do on purpose. A tensor of other memory
  that the runner copies whole into such a buffer (a persistent host mirror) is filled the same
  way, and put back at the next ``serve``. Real rows of the next step are never touched, so a
  runner that keeps them (or updates them in place) is left as it is; host arrays are not filled
  then (they hold requests' bookkeeping that the runner moves around), nor before a warmup or
  capture (those run on the buffers as the runner left them).

Fill values are 0 and 1 (``False``/``True``), valid as indices: the i-th padded array gets
``(i + pattern) % 2``, so every array changes between the runs and neighbours swap their order
(a comparison between two padded fields flips). A floating-point array gets 0 or 256 instead:
garbage left in padded rows is of any size, and a reduction over the rows (a per-tensor amax for
a quantization scale) only shows what is larger than the real rows.
"""
from __future__ import annotations

import weakref

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import _disable_current_modes

from ...engine.opinfo import mutable, op_tensors, storage_key, written_tensors
from ...engine.source import user_frame
from ..rules.padded_scatter import Index
from ..tensors import digest, real_rows, region, whole

_LARGE = 256.0             # a floating-point fill: above what real rows hold, within fp8's range


class Plan:
    """What ``diagnose`` records of the steps a run serves: ``(real, size, regions, phases, again)``
    per ``serve``, where ``regions`` maps each padded array's name to ``None`` (padded rows) or its
    real width (padded columns), ``phases`` counts warmups and captures so far, and ``again`` names
    the arrays whose tensor the previous ``serve`` gave under that name too. A padded-row run is
    given the first run's steps (``ahead``), the tensors of its current step, the mirrors copied
    whole into announced buffers, and the mirrors' regions it filled (to put back)."""

    def __init__(self, ahead: list | None = None) -> None:
        self.steps: list[tuple] = []
        self.ahead = ahead
        self.current: dict[str, weakref.ref] = {}
        self.mirrors: dict[int, Index] = {}
        self.borrowed: list[tuple] = []
        self.in_step = False                      # between a ``serve`` and its ``handed_out``
        self.keys: dict[str, int] = {}            # each padded array's storage at the latest serve
        self.writes: dict[int, tuple] = {}        # storage -> (op, source) of eager code of a step that wrote it
        # A run that fills the padded rows of static inputs too (``fill_inputs``): the names to fill ("all": every
        # one), the last eager write of each storage before a serve, the inputs whose padded rows a step had
        # written when they were filled -> (graph, op, source of that write, line that made the values written),
        # and the line that made each eager tensor's values (a padded batch copied in was made elsewhere: that
        # line chose what padded rows hold)
        self.inputs: frozenset | str | None = None
        self.before: dict[int, tuple] = {}
        self.written: dict[str, tuple] = {}
        self.made: dict[int, str] = {}
        self.agrees: bool | None = None           # a padded-row run: whether the workload's results agreed


def served(doctor, real: int, size: int, padded: dict, columns: dict) -> None:
    plan = doctor.plan
    if plan is None:
        return
    plan.in_step = True
    regions = {name: None for name in padded} | {name: width for name, (_, width) in columns.items()}
    arrays = {**padded, **{name: t for name, (t, _) in columns.items()}}
    keys = {name: storage_key(t) for name, t in arrays.items() if isinstance(t, torch.Tensor)}
    # (the names whose tensor the previous step served too: two runners may use one name for two buffers)
    again = frozenset(name for name, key in keys.items() if plan.keys.get(name) == key)
    plan.keys = keys
    plan.steps.append((real, size, regions, doctor.report.warmups + doctor.report.captures, again))
    with _disable_current_modes():
        for mirror, index, saved in plan.borrowed:
            if (m := mirror.read()) is not None:
                m[index].copy_(saved)
    plan.borrowed = []
    if plan.ahead is not None:
        plan.current = {name: weakref.ref(t) for name, t in arrays.items() if isinstance(t, torch.Tensor)}


def carry(doctor) -> None:
    """After a step of a padded-row run: fill the next step's padded rows and columns now, in the
    tensors of this step that a graph reads, if nothing is captured before that step."""
    plan = doctor.plan
    if plan is not None:
        plan.in_step = False
    if plan is None or plan.ahead is None or not plan.current:
        return
    k = len(plan.steps)
    if not 0 < k < len(plan.ahead) or plan.ahead[k][3] != plan.ahead[k - 1][3] or plan.steps[-1] != plan.ahead[k - 1]:
        return
    real, size, regions, _, again = plan.ahead[k]
    read = {key for info in doctor.graphs.values() if info.ref() is not None for key in info.externals}
    with _disable_current_modes():
        for i, (name, width) in enumerate(regions.items()):
            t = plan.current[name]() if name in plan.current and name in again else None
            if t is None or storage_key(t) not in read or (width is not None and t.dim() < 2):
                continue
            index = (slice(real, size),) if width is None else (slice(0, size), slice(width, None))
            value = _value(i, doctor.pattern, t.dtype)
            t[index].fill_(value)
            mirror = plan.mirrors.get(storage_key(t))
            if mirror is not None and (m := mirror.read()) is not None:
                plan.borrowed.append((mirror, index, m[index].clone()))
                m[index].fill_(value)
    plan.current = {}


def copied(doctor, dst: torch.Tensor, src) -> None:
    """A copy into an announced buffer, in a padded-row run: a tensor of other memory copied over
    the whole buffer is its mirror, filled with it after each step -- unless a graph owns it (an
    output fed back), whose rows the caller may still read."""
    plan = doctor.plan
    if plan is None or plan.ahead is None or doctor.phase != "eager" or not isinstance(src, torch.Tensor):
        return
    buf = doctor.buffer(storage_key(dst)).ref()
    if (storage_key(src) == storage_key(dst) or doctor.owner_of(storage_key(src)) is not None
            or src.shape != buf.shape or dst.shape != buf.shape or dst.stride() != buf.stride()
            or dst.storage_offset() != buf.storage_offset()):
        return
    plan.mirrors[storage_key(dst)] = Index(storage_key(src), StorageWeakRef(src.untyped_storage()), src.dtype,
                                           tuple(src.shape), src.stride(), src.storage_offset())


def consumed(doctor, func, args, kwargs) -> None:
    """An eager op of a padded-row run reads announced buffers: the elements it reads, written since
    the previous replay, were that eager step's input, so they are no longer fresh."""
    written = {id(t) for t in written_tensors(func, args, kwargs)} if mutable(func) else ()
    for t in op_tensors(args, kwargs):
        key = storage_key(t)
        if key in doctor.fresh and id(t) not in written and (buf := doctor.buffer(key)) is not None:
            with _disable_current_modes():
                mask = doctor.fresh[key]
                if mask.shape == buf.ref().shape:
                    doctor.fresh[key] = mask & ~region(t, buf.ref())


def _value(i: int, pattern: int, dtype):
    """0 or 1 (``False``/``True``) for integers and flags, valid as indices; 0 or ``_LARGE`` for
    floating point, so that a reduction over rows (an amax, a norm, a mean) sees the fill too."""
    value = (i + pattern) % 2
    if dtype in (torch.bool, np.bool_):
        return bool(value)
    floating = dtype.is_floating_point if isinstance(dtype, torch.dtype) else np.issubdtype(dtype, np.floating)
    return value * _LARGE if floating else value


def fill(doctor, padded: dict, columns: dict, real: int, size: int) -> None:
    """Rows ``[real, size)`` of each padded array and columns ``[width, end)`` of rows ``[0, size)``
    of each padded-columns tensor get the run's value for that array (see the module docstring),
    except elements rewritten since the previous replay."""
    arrays = [(arr, slice(real, size), slice(None)) for arr in padded.values()]
    arrays += [(t, slice(0, size), slice(width, None)) for t, width in columns.values()]
    for i, (arr, rows, cols) in enumerate(arrays):
        if isinstance(arr, torch.Tensor):
            with _disable_current_modes():
                target = arr[rows] if cols == slice(None) else arr[rows, cols]
                fill_value = torch.full_like(target, _value(i, doctor.pattern, arr.dtype))
                kept = doctor.fresh.get(storage_key(arr))
                if kept is not None and kept.shape == arr.shape:
                    keep = kept[rows] if cols == slice(None) else kept[rows, cols]
                    fill_value = torch.where(keep, target, fill_value)
                target.copy_(fill_value)
        elif isinstance(arr, np.ndarray):
            index = rows if cols == slice(None) else (rows, cols)
            arr[index] = _value(i, doctor.pattern, arr.dtype)
        else:
            raise TypeError(f"padded rows must be tensors or NumPy arrays, got {type(arr).__name__}")


def fill_inputs(doctor, info, real: int, size: int) -> None:
    """Rows ``[real, size)`` of the static inputs the graph reads, those the step wrote too, get the
    run's value (0 in pattern 0; asked for when what the runner left in padded rows cannot explain a
    failure or a difference from the run without graphs: whether what the runner *writes* there
    does). Which of them the step had written, and where, is kept (``Plan.written``)."""
    plan = doctor.plan
    with _disable_current_modes():
        for key in info.externals:
            buf = doctor.buffer(key)
            t = buf.ref() if buf is not None and buf.role == "input" else None
            if t is None or t.dim() == 0 or t.shape[0] < size or plan.inputs != "all" and buf.name not in plan.inputs:
                continue
            fresh = doctor.fresh.get(key)
            if fresh is not None and fresh.shape == t.shape and bool(fresh[real:size].any()) and key in plan.before:
                plan.written.setdefault(buf.name, (info.name, *plan.before[key]))
            t[real:size].fill_(_value(0, doctor.pattern or 0, t.dtype))


def record_inputs(doctor, info) -> None:
    """Digests of what the graph reads from announced buffers (real rows) and from state it writes."""
    pending = info.pending
    real = pending.real if pending else None
    inputs, readers = {}, {}
    with _disable_current_modes():
        for key in info.externals:
            buf = doctor.buffer(key)
            if buf is not None:
                label, t = buf.name, buf.ref()
                t = t if real is None or t is None or t.dim() == 0 else t[:real]
            elif key in info.writes:
                label, t = f"{info.externals[key].tensor} (state)", whole(info.externals[key].weak)
            else:
                continue                           # never written by a graph: constant here
            if t is None:
                continue
            inputs[label] = digest(t)
            reader = next((op for op in info.ops if key in op.reads), None)
            readers[label] = (reader.name, reader.source) if reader else ("-", "-")
    padded_keys = {storage_key(t) for t in (pending.padded.values() if pending else ()) if isinstance(t, torch.Tensor)}
    first = next((op for op in info.ops if op.reads & padded_keys), None)
    doctor.trace.append({"graph": info.name, "real": real, "size": pending.size if pending else None,
                         "inputs": inputs, "readers": readers, "outputs": None, "state": {},
                         "padded_reader": (first.name, first.source, _name_of(doctor, first.reads & padded_keys))
                         if first else None})


# Ops that move memory rather than compute on it: a runner copying a whole state buffer (a swap, a
# snapshot) moves what padded rows wrote into rows nobody reads, which is no evidence by itself.
_MOVES = frozenset(("aten::copy_", "aten::clone", "aten::_to_copy", "aten::detach", "aten::alias", "aten::lift_fresh"))


def state_read(doctor, func, args, kwargs, out) -> None:
    """In a padded-row run, an eager op on memory the served steps write (what graphs write, and
    what a PIECEWISE step's eager regions write: a cache, a recurrent state): what it computed, and
    which op wrote that memory, to compare between the two fills. Padded rows may write slots no
    one reads; a value eager code computes from that memory differs only if it read what they wrote."""
    plan = doctor.plan
    if plan.in_step or plan.inputs is not None:
        if mutable(func):
            for t in written_tensors(func, args, kwargs):
                if plan.in_step:
                    plan.writes[storage_key(t)] = (str(func), user_frame())
                else:
                    plan.before[storage_key(t)] = (str(func), *_origin(plan, func, args))
        elif not plan.in_step and isinstance(out, torch.Tensor):
            _made(plan, func, args, kwargs, out)
        if plan.in_step:
            return
    if not doctor.trace or func._schema.name in _MOVES or not isinstance(out, torch.Tensor):
        return
    # (memory an op writes in place is its destination, not what it computes from: an eager write
    # into a cache whose other slots hold what padded rows wrote carries those slots along unread)
    written = {id(t) for t in written_tensors(func, args, kwargs)} if mutable(func) else ()
    writer = next((w for t in op_tensors(args, kwargs)
                   if id(t) not in written and (w := _writer(doctor, storage_key(t))) is not None), None)
    if writer is not None:
        with _disable_current_modes():
            doctor.trace[-1].setdefault("reads", []).append((str(func), user_frame(), digest(out), writer))


def _origin(plan, func, args) -> tuple[str, str]:
    """(where an eager write runs, where the values it writes were made): a copy's source tensor was
    made where ``Plan.made`` says, any other write makes its values itself."""
    here = user_frame()
    src = args[1] if func._schema.name == "aten::copy_" and len(args) > 1 else None
    return here, plan.made.get(storage_key(src), here) if isinstance(src, torch.Tensor) else here


def _made(plan, func, args, kwargs, out: torch.Tensor) -> None:
    """Where the values of a new tensor were made: a move or copy keeps its source's line; a view
    is the same storage, already known."""
    inputs = list(op_tensors(args, kwargs))
    key = storage_key(out)
    if any(storage_key(t) == key for t in inputs):
        return
    moved = plan.made.get(storage_key(inputs[0])) if func._schema.name in _MOVES and inputs else None
    plan.made[key] = moved or user_frame()


def _writer(doctor, key: int) -> tuple | None:
    """(op, source) of what a served step writes into storage ``key``: the step's eager code, else
    a graph's first write of it."""
    if key in doctor.plan.writes:
        return doctor.plan.writes[key]
    if key in doctor.graph_writes:
        for info in doctor.graphs.values():
            if (op := info.writes.get(key)) is not None:
                return (op.name, op.source)
    return None


def _name_of(doctor, keys) -> str:
    for key in keys:
        if (buf := doctor.buffer(key)) is not None:
            return buf.name
    return "-"


def record_outputs(doctor, info, pending) -> None:
    if not doctor.trace or doctor.trace[-1]["graph"] != info.name:
        return
    record = doctor.trace[-1]
    real, size, outputs = (pending.real, pending.size, pending.outputs) if pending else (None, None, None)
    with _disable_current_modes():
        if outputs is not None:
            # (an announced output of memory the graph neither made nor writes holds no result of it)
            parts = [p for p in (outputs if isinstance(outputs, (tuple, list)) else (outputs,))
                     if (key := storage_key(p)) in info.writes or key in info.created]
            rows = [real_rows(p, real, size).detach().double().reshape(-1).cpu() for p in parts]
            record["outputs"] = torch.cat(rows) if rows else None
        for key in info.writes:
            if doctor.buffer(key) is None and (w := whole(info.externals[key].weak)) is not None:
                record["state"][info.externals[key].tensor] = digest(w)
