"""Padding must change nothing real rows get: the padded replay against the step on its real rows.

A graph of size ``size`` serving ``real < size`` rows runs its padded rows too. Whatever they hold,
the real rows of the outputs must be what the same step gives on the real rows alone, and the state
the padded rows change must be no one's (a null slot), never state that real rows own. Differential
replay cannot see this: its eager step runs at the padded size and reads the same padded rows. A
runner whose step can run at any size announces its unpadded form (``serve(..., unpadded=...)``;
the graph manager does); on a graph's first padded sampled replay and every 8th after it
(``differential.TRACE_EVERY``), that form is run from the state before the replay and compared:

* the real rows of each output (outputs whose first dimension is the rows: a ``[1, tokens]``
  layout is left alone);
* each element of kept state (announced persistent state, or memory outside the graph that it
  writes: not its static inputs) that the replay changed and the unpadded step did not, against
  the elements real rows have written on any compared step (``Doctor.real_writes``): a padded row
  that writes a live request's slot.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ...engine.opinfo import storage_key
from .. import explain_padding, failures
from ..report import Finding
from ..tensors import changed, disagrees, first_line, max_abs_diff


def owned_by_full_step(doctor, pending, replayed: dict) -> None:
    """A step with no padded rows: every state element its replay changed is a real row's."""
    with _disable_current_modes():
        for key, (_, _, before) in pending.pre.items():
            own(doctor, key, before.dtype, changed(before, replayed[key]))


def check(doctor, info, pending, replayed: dict, graph_out, run_eager) -> None:
    """``run_eager(step)`` runs ``step`` from the state before the replay and puts the replay's back
    (``differential._eager``); what it returns is ``(run, (outputs, state, extra), error)``."""
    _, got, error = run_eager(pending.unpadded)
    if error is not None or got is None:
        note = f"the unpadded step of {info.name} raised {type(error).__name__}: padded replays not compared with it"
        doctor.report.note(note)
        return
    out, state, _ = got
    with _disable_current_modes():
        for i, (g, e) in enumerate(zip(graph_out or (), out or ())):
            if g is not None and g.shape == e.shape and g.dim() and bool(disagrees(g, e).any()):
                _output(doctor, info, pending, i, max_abs_diff(g, e))
                return
        for key, (_, label, before) in pending.pre.items():
            if (buf := doctor.buffer(key)) is not None and buf.role != "state":
                continue                    # a static input the graph writes is persistent-mutation's
            mine = changed(before, state[key])
            padded_only = changed(before, replayed[key]) & ~mine
            dtype, owned = doctor.real_writes.get(key, (None, None))
            if dtype == before.dtype and bool((hit := padded_only & owned).any()):
                _state(doctor, info, pending, key, label, int(hit.sum()))
                return
            own(doctor, key, before.dtype, mine)


def own(doctor, key: int, dtype: torch.dtype, mask: torch.Tensor) -> None:
    """Add ``mask`` (over the whole storage, as ``dtype`` elements) to ``Doctor.real_writes``."""
    was, owned = doctor.real_writes.get(key, (dtype, None))
    if bool(mask.any()) and was == dtype:
        doctor.real_writes[key] = (dtype, mask if owned is None else owned | mask)


def crashed(doctor, info, pending, error: BaseException, run_eager) -> bool:
    """A padded replay raised: when the same step on its real rows alone completes, from the state
    before the replay, what the padded rows hold made it fail (a sentinel index the kernel does not
    honour, a stale row's offset): ``stale-padding`` at the op the replay failed in. Whether it did."""
    _, got, unpadded_error = run_eager(pending.unpadded)
    if unpadded_error is not None or got is None:
        return False
    op = failures.failed_op(error)
    name, source = (str(op.func), op.source) if op is not None else ("-", "-")
    padded = ", ".join(pending.padded) or "the padded rows"
    evidence = (f"replay {info.replays} of {info.name} ({pending.real} real rows of {pending.size}) raised "
                f"{type(error).__name__}: {first_line(error)}; the same step on its {pending.real} real rows alone, "
                "from the state before the replay, completes")
    doctor.add(Finding("stale-padding", info.name, name, padded, source, evidence,
                       explain_padding.padding_reaches(info.name, padded),
                       {"replay": info.replays, "crashed": type(error).__name__, "real": pending.real,
                        "size": pending.size, "unpadded": True}), ("stale-padding", name, source))
    return True


def _output(doctor, info, pending, i: int, diff: float) -> None:
    op = _first_padded_read(doctor, info, pending)
    name, source = (op.name, op.source) if op is not None else ("-", "-")
    padded = ", ".join(pending.padded) or "the inputs"
    evidence = (f"sampled replay {info.replays} of {info.name} ({pending.real} real rows of {pending.size}): the real "
                f"rows of output {i} differ by max |diff| = {diff:.3g} from an eager run of the step on its "
                f"{pending.real} real rows alone")
    doctor.add(Finding("stale-padding", info.name, name, padded, source, evidence,
                       explain_padding.padding_reaches(info.name, padded),
                       {"replay": info.replays, "output": i, "max_abs_diff": diff, "real": pending.real,
                        "size": pending.size, "unpadded": True}), ("stale-padding", name, source))


def _state(doctor, info, pending, key: int, label: str, elements: int) -> None:
    op = info.writes.get(key)
    name, source = (op.name, op.source) if op is not None else ("-", "-")
    evidence = (f"sampled replay {info.replays} of {info.name} ({pending.real} real rows of {pending.size}): the "
                f"replay changed {elements} element(s) of {label} that an eager run of the step on its real rows "
                "alone leaves as they were, and that real rows of an earlier step wrote")
    doctor.add(Finding("stale-padding", info.name, name, label, source, evidence,
                       explain_padding.padding_writes_owned(label, name),
                       {"replay": info.replays, "elements": elements, "real": pending.real, "size": pending.size,
                        "unpadded": True}),
               ("stale-padding", name, source))


def _first_padded_read(doctor, info, pending):
    """The first op of the capture that reads a buffer with this step's padded rows (else its first
    op reading an announced static input): where the padded rows enter."""
    padded = {storage_key(t) for t in pending.padded.values() if isinstance(t, torch.Tensor)}
    inputs = padded or {k for k, b in doctor.buffers.items() if b.role in ("input", "padded")}
    return next((op for op in info.ops if op.reads & inputs), info.ops[-1] if info.ops else None)
