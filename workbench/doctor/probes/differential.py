"""Differential replay: does a replay give what an eager run of the same step gives?

At sampled replays (every Nth served step with an ``eager`` callable) the doctor keeps the state
the step may write -- every storage the graph writes, every announced buffer -- before the replay.
After it, it keeps the replay's outputs and state, puts the state back as it was before, runs
``eager()`` (the same forward on the same static buffers, recording its launch trace), keeps what
that gives, and puts the replay's state back: the watched program goes on as if only the replay
had run. Outputs (real rows) and state are compared; where they differ, the launch traces say
where the replay's frozen Python parted from what Python decides now (``launch``), and the
finding names that op, its tensor and its source line. On CUDA the traces are the doctor's own
records of the capture and of the eager run, so the same localisation holds.
"""
from __future__ import annotations

import dataclasses

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ...engine import memory
from ...engine.opinfo import describe, storage_key, tensors, written_tensors
from ...engine.source import user_frame
from .. import explain
from ..records import Op
from ..report import Finding
from ..tensors import differs, first_line, max_abs_diff, rng_state, set_rng_state, signature, whole
from . import launch

aten = torch.ops.aten


@dataclasses.dataclass
class EagerRun:
    """The eager step's launch trace and the storages it created or wrote."""

    known: set                                   # storages kept before the replay
    graph_ops: list                              # the capture's trace, to align with as it runs
    ops: list = dataclasses.field(default_factory=list)
    new: set = dataclasses.field(default_factory=set)
    extra: dict = dataclasses.field(default_factory=dict)    # other storages it wrote: key -> (whole, before)
    described: dict = dataclasses.field(default_factory=dict)


def _state(doctor, info) -> dict:
    """key -> (typed whole storage, label) of everything the step may write."""
    state = {}
    for key, ext in info.externals.items():
        if key in info.writes and (w := whole(ext.weak, ext.dtype)) is not None:
            state[key] = (w, ext.tensor)
    for key, buf in doctor.buffers.items():
        t = buf.ref()
        if t is not None and key not in state and isinstance(t, torch.Tensor):
            state[key] = (torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage()), buf.name)
    return state


def begin(doctor, info) -> None:
    with _disable_current_modes():
        pending = info.pending
        pending.pre = {key: (w, label, w.clone()) for key, (w, label) in _state(doctor, info).items()}
        pending.rng = rng_state(info.cuda)


def on_op(doctor, func, args, kwargs, run):
    """An op of the eager step: keep what it is about to overwrite, record it in the trace."""
    d = doctor.diff
    if func._schema.is_mutable:
        for t in written_tensors(func, args, kwargs):
            key = storage_key(t)
            if key not in d.known and key not in d.new and key not in d.extra:
                with _disable_current_modes():
                    w = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
                    d.extra[key] = (w, w.clone())
    inputs = list(tensors((args, kwargs)))
    keys = {storage_key(t) for t in inputs}
    lifted = func.overloadpacket in (aten.lift_fresh, aten.lift_fresh_copy)
    if lifted:                                   # a constant made from Python data in this run
        d.new.update(keys)
    out = run()
    if not func.is_view or lifted:
        for t in inputs:
            if storage_key(t) not in d.new:      # pre-existing, so alive anyway: described if reported
                d.described.setdefault(storage_key(t), t)
        name, sig, i = str(func), signature(func, args, kwargs), len(d.ops)
        same = i < len(d.graph_ops) and d.graph_ops[i].name == name and d.graph_ops[i].sig == sig
        # The source line costs a walk up the stack: where the op matches the capture's op at the
        # same position, it is taken to be the same line (a divergence is looked up in full).
        d.ops.append(Op(name, d.graph_ops[i].source if same else user_frame(), frozenset(keys), frozenset(),
                        frozenset(keys - d.new), sig))
    for o in tensors(out):
        if storage_key(o) not in keys:
            d.new.add(storage_key(o))
    return out


def finish(doctor, info, pending) -> None:
    pre = pending.pre
    with _disable_current_modes():
        replayed = {key: w.clone() for key, (w, _, _) in pre.items()}
        graph_out = _rows(pending.outputs, pending.real)
        for w, _, before in pre.values():
            w.copy_(before)
        rng_after = rng_state(info.cuda)
        set_rng_state(pending.rng)
    doctor.diff, doctor.phase = EagerRun(set(pre), info.ops), "differential"
    error = None
    try:
        with torch.no_grad():
            out = pending.eager()
        with _disable_current_modes():
            eager_out = _rows(out, pending.real)
            eager_state = {key: w.clone() for key, (w, _, _) in pre.items()}
            extra = {key: (before, w.clone()) for key, (w, before) in doctor.diff.extra.items()}
    except Exception as e:  # noqa: BLE001 - the eager step's failure is evidence, reported below
        error = e
    finally:
        run, doctor.diff, doctor.phase = doctor.diff, None, "eager"
        with _disable_current_modes():
            for key, (w, _, _) in pre.items():
                w.copy_(replayed[key])
            for w, before in run.extra.values():
                w.copy_(before)
            set_rng_state(rng_after)
    doctor.compared += 1
    if error is not None:
        doctor.report.notes.append(f"differential replay of {info.name}: the eager step raised "
                                   f"{type(error).__name__}: {first_line(error)}")
        return
    what = _compare(graph_out, eager_out, replayed, eager_state, extra, pre)
    divergence = launch.compare(info.ops, run.ops)
    if what is None:
        if divergence is not None:
            doctor.report.notes.append(f"differential replay of {info.name}: launch traces differ ("
                                       f"{divergence.text()}) but outputs and state agree on the sampled steps")
        return
    _finding(doctor, info, pending, what, divergence, run)


def _rows(out, real: int) -> list | None:
    if out is None:
        return None
    return [(o[:real] if o.dim() else o).detach().clone() for o in tensors(out)]


def _compare(graph_out, eager_out, replayed, eager_state, extra, pre) -> tuple | None:
    """(what differs, numbers) -- outputs first, then state -- or None when all agree."""
    if graph_out is not None and eager_out is not None:
        if len(graph_out) != len(eager_out):
            return f"the replay has {len(graph_out)} outputs, the eager step {len(eager_out)}", {}, None
        for i, (g, e) in enumerate(zip(graph_out, eager_out)):
            if g.shape != e.shape or bool(differs(g, e).any()):
                return (f"output {i} (real rows) differs by max |diff| = {max_abs_diff(g, e):.3g}",
                        {"output": i, "max_abs_diff": max_abs_diff(g, e)}, None)
    for key, g in replayed.items():
        mask = differs(g, eager_state[key])
        if bool(mask.any()):
            label = pre[key][1]
            return (f"state `{label}` differs in {int(mask.sum())} element(s)",
                    {"state": label, "elements": int(mask.sum())}, key)
    for key, (before, after) in extra.items():
        if bool((before != after).any()):
            return ("the eager step writes memory the graph never writes", {"elements": int((before != after).sum())},
                    key)
    return None


def _finding(doctor, info, pending, what: tuple, divergence, run: EagerRun) -> None:
    text, numbers, key = what
    kind, tensor = "warmup-divergence", "-"
    if divergence is not None:
        op = divergence.graph_op or divergence.eager_op
        tensor = _read_by(doctor, info, op)
        site = f"First divergence in the launch traces: {divergence.text()}."
        if divergence.how == "reference":
            gkey = next(iter(divergence.graph_keys))
            ext = info.externals.get(gkey)
            tensor = ext.tensor if ext else "-"
            if ext is not None and ext.weak.expired():
                kind = "dangling-reference"
            ekey = next(iter(divergence.eager_keys))
            read = run.described.get(ekey)
            now, origin = (describe(read), memory.origin_of(read)) if read is not None else ("a tensor", None)
            site += (f" The graph reads the {tensor} created {ext.origin or 'before watch()' if ext else '-'}; the "
                     f"eager step reads a {now} created {origin or 'before watch()'}: a reference frozen at capture.")
        numbers = {**numbers, "launch": divergence.index + 1, "how": divergence.how}
    else:
        writer = info.writes.get(key) if key is not None else None
        op = writer or (info.ops[-1] if info.ops else None)
        tensor = pre_label(pending, key)
        site = ("The launch traces agree: the difference first shows at "
                f"{'the state it writes' if key is not None else 'the outputs'}.")
    name, source = (op.name, op.source) if op is not None else ("-", "-")
    evidence = (f"sampled replay {info.replays} of {info.name} ({pending.real} real rows of {pending.size}): {text} "
                "from an eager run of the same step")
    doctor.add(Finding(kind, info.name, name, tensor, source, evidence, explain.differential(info.name, text, site),
                       {"replay": info.replays, **numbers}), (kind, name, source))


def _read_by(doctor, info, op) -> str:
    """The announced buffer (else the referenced tensor) an op of the trace reads, for the report."""
    for key in sorted(op.reads):
        if (buf := doctor.buffer(key)) is not None:
            return f"{buf.name}: {describe(buf.ref())}"
    return next((info.externals[key].tensor for key in sorted(op.reads) if key in info.externals), "-")


def pre_label(pending, key) -> str:
    return pending.pre[key][1] if key is not None and key in pending.pre else "-"
