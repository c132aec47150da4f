"""undersized-buffer, from a runner's own check that a step's inputs match what its graph was captured with.

A runner that captures once and replays for later steps often checks, before each replay, that the
step brings tensors of the captured shapes (Megatron's ``_CudaGraphRunner`` asserts
``matches_graph_inputs``): the graph's static inputs were sized by the step it was captured on.
When that check fails, the check is right and the step is what changed: a tensor of the step holds
more than the static input it would be copied into -- data that does not fit the graph. The
finding stands at the check, which names it; where the tensor was made (a collate function that
pads to another length) is in the evidence when the doctor saw it made (a factory from Python
data dispatches no op on the CPU, and a copy to the GPU does: the site must not depend on that).

The step's tensor and the static input are paired by where the check's frame holds them: the same
last two names on their paths from its locals (``kwargs["packed_seq_params"].cu_seqlens_q`` and
``self.fwd_graph_input_kwargs["packed_seq_params"].cu_seqlens_q``).
"""
from __future__ import annotations


import torch

from ...engine import memory
from ...engine.opinfo import describe, storage_key
from ...engine.source import location
from .. import explain
from ..report import Finding
from ..tensors import first_line
from . import where

_DEPTH, _VISITS = 4, 2000


def _held(frame):
    """``(path, tensor)`` for each tensor reachable from ``frame``'s locals through dicts and
    attributes, within the walk's bounds."""
    out, seen, level = [], set(), [((name,), v) for name, v in frame.f_locals.items()]
    for _ in range(_DEPTH):
        following = []
        for path, obj in level:
            if isinstance(obj, torch.Tensor):
                out.append((path, obj))
                continue
            if id(obj) in seen or len(seen) > _VISITS:
                continue
            seen.add(id(obj))
            items = obj if isinstance(obj, dict) else getattr(obj, "__dict__", None)
            if isinstance(items, dict) and not isinstance(obj, type):
                following += [(path + (str(k),), v) for k, v in dict.items(items)]
        level = following
    return out


def failed_check(doctor, error: BaseException, frame) -> None:
    """The program's own check failed in ``frame`` (``raised``): where it holds a static input and,
    at the same place of another path, a step's tensor larger than it, the step does not fit."""
    if not isinstance(error, (AssertionError, ValueError, RuntimeError)) or not doctor.graphs:
        return
    held = _held(frame)
    static = {path[-2:]: (t, buf) for path, t in held
              if (buf := doctor.buffer(storage_key(t))) is not None and buf.role == "input"}
    for path, t in held:
        pair = static.get(path[-2:])
        if pair is None or pair[0] is t or doctor.buffer(storage_key(t)) is not None:
            continue
        buf_t, buf = pair
        if t.dim() != buf_t.dim() or not any(a > b for a, b in zip(t.shape, buf_t.shape)):
            continue
        made, source = memory.created_by(t), location(frame)
        what = f"{'.'.join(path[-2:])}: {describe(t)}"
        said = first_line(error) or f"a bare {type(error).__name__}"
        finding = Finding(
            "undersized-buffer", where(doctor), "check", what, source,
            f"the runner's check that a step's inputs match its graph's failed at {location(frame)} ({said}): the "
            f"step's {'.'.join(path[-2:])} is {tuple(t.shape)}, the static input {buf.name} it was captured with "
            f"is {tuple(buf_t.shape)}" + (f"; the step's tensor was made by {made[0]} at {made[1]}" if made else ""),
            explain.unfit_write(f"{tuple(t.shape)} into {buf.name} {tuple(buf_t.shape)}"),
            {"shape": list(t.shape), "captured": list(buf_t.shape)})
        doctor.explanation = (id(error), finding, ("undersized-buffer", "input-match", source))
        return
