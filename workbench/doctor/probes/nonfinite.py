"""Non-finite values that padded rows make and real rows receive.

A padded row often computes NaN or infinity: a sequence length of 0 gives an attention row with no
keys (a softmax of -inf only), a row no kernel writes keeps what the memory held. That is harmless
while it stays in its row. It reaches real rows through any op that mixes rows: a per-tensor scale
from the amax of the whole padded batch (FP8 activation quantisation), a norm over the batch, a
sum over tokens. Differential replay cannot see it (its eager step runs the same padded rows), and
a runner that neutralises padded rows with a value that is not neutral gives the two-way fill
nothing to fill.

When a padded replay's real-row outputs hold non-finite values, the eager step is run once more
from the state before the replay, and each op is asked where its non-finite values are. The first
op whose inputs hold them only in padded rows (rows ``real..size`` of a tensor whose rows are the
step's; ``[1, tokens]`` layouts along the tokens) and whose output holds them where real rows
are (its real rows, or anywhere in a smaller output that is not per row: a scale, a sum; not a
flattened or repeated copy of the rows) is where padding reached real rows: ``stale-padding`` at
that op. Padded rows also reach real rows through state: a store whose values hold them only in
padded rows writes them into memory that is not per row (a KV cache slot the padded rows are sent
to, which real rows read too). That memory carries them on; where an op then gives them to real
rows, the finding is at the store.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ...engine.opinfo import op_tensors, storage_key, tensors, written_tensors
from ...engine.source import user_frame
from .. import explain_padding
from ..report import Finding


def outputs_hit(graph_out) -> bool:
    """Whether the replay's real-row outputs hold a non-finite value (the doctor's own arithmetic:
    not ops of the watched code)."""
    with _disable_current_modes():
        return any(o is not None and o.is_floating_point() and not bool(torch.isfinite(o).all())
                   for o in graph_out or ())


def on_op(d, func, args, kwargs, out) -> None:
    """An op of the eager step run for this probe (``EagerRun.nonfinite`` is ``(real, size)``):
    note it (``EagerRun.crossed``) if it carries non-finite values from padded rows to real ones."""
    real, size = d.nonfinite
    with _disable_current_modes():
        carrier, via = 0, None                          # the largest input holding them in padded rows only
        for t in op_tensors(args, kwargs):
            if not t.is_floating_point():
                continue
            mine, theirs = _split(t, real, size)
            if theirs is None:
                if (key := storage_key(t)) in d.stored and not bool(torch.isfinite(t).all()):
                    carrier, via = max(carrier, t.numel()), d.stored[key]     # state a padded row stored into
                continue                                # not the step's rows: whose values, unknown
            if not bool(torch.isfinite(mine).all()):
                return                                  # real rows already had them
            if not bool(torch.isfinite(theirs).all()):
                carrier = max(carrier, t.numel())
        if not carrier:
            return
        if via is None:
            for w in written_tensors(func, args, kwargs):
                if w.is_floating_point() and _split(w, real, size)[1] is None and not bool(torch.isfinite(w).all()):
                    d.stored[storage_key(w)] = (str(func), user_frame())
        outs = [o for o in ((out,) if isinstance(out, torch.Tensor) else tensors(out)) if o.is_floating_point()]
        for o in outs:
            mine, theirs = _split(o, real, size)
            # An output without the step's rows counts when it is smaller than what carried them
            # (a reduction); a copy or an expansion of the rows (a flattened or repeated layout) is not.
            if (theirs is not None or o.numel() < carrier) and not bool(torch.isfinite(mine).all()):
                d.crossed = (*via, (str(func), user_frame())) if via else (str(func), user_frame(), None)
                return
        if via is not None:             # values read from that state carry them on (a slot read as padding)
            for o in outs:
                if _split(o, real, size)[1] is None and not bool(torch.isfinite(o).all()):
                    d.stored[storage_key(o)] = via


def _split(t: torch.Tensor, real: int, size: int) -> tuple:
    """``(real part, padded part or None)``: along the first dimension of the step's ``size``
    (the first, or the second of a ``[1, tokens]`` layout); a tensor with no such dimension has no
    rows to split (``on_op`` decides what it counts as)."""
    dim = 0 if t.dim() and t.shape[0] == size else 1 if t.dim() > 1 and t.shape[0] == 1 and t.shape[1] == size \
        else None
    if dim is None:
        return t, None
    return t.narrow(dim, 0, real), t.narrow(dim, real, size - real)


def report(doctor, info, pending, run) -> None:
    if run.crossed is None:
        return
    op, source, reader = run.crossed
    padded = ", ".join(pending.padded) or "the padded rows"
    how = (f"{op} is the first op that takes non-finite values held only by padded rows and gives them to real rows"
           if reader is None else
           f"{op} stores non-finite values held only by padded rows into memory that is not per row, and "
           f"{reader[0]} at {reader[1]} gives them from there to real rows")
    doctor.add(Finding(
        "stale-padding", info.name, op, padded, source,
        f"sampled replay {info.replays} of {info.name} ({pending.real} real rows of {pending.size}): real-row outputs "
        f"hold NaN or infinity; in an eager run of the step, {how}", explain_padding.nonfinite_padding(op),
        {"replay": info.replays, "real": pending.real, "size": pending.size}), ("stale-padding", op, source))
