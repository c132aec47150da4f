"""A static input the step holds elsewhere: the graph reads a tensor bound at capture.

A replay that read an input its step had not written (``stale-input``) may serve a step whose values are
there all the same -- in another instance of that buffer: one made again by the runner for each step,
another generator's or another device's, while the graph keeps reading the tensor it was captured on
(kept alive by the runner or the graph). What tells it apart from an input left out: the step wrote
none of the graph's static inputs (a refresh that leaves one out writes the others), and a live tensor
made by the op and line that made the stale buffer holds, in the stale view's place, what the reference
gave the op that reads it (a tensor made elsewhere -- the runner's own, which it was to copy into the
graph's buffer -- is a refresh left out). The capture decided which tensor the kernels read, and the
step now needs another -- ``warmup-divergence``, named where the graph was chosen for this step (the
check or key that chose it), else at the line that replayed it, as for any reference frozen at capture.
"""
from __future__ import annotations

import torch

from ...engine import memory
from ...engine.opinfo import describe
from ..tensors import disagrees
from .reference_causes import chosen, rows_like


def found(stale: tuple, replayed: tuple, by_input: tuple) -> tuple | None:
    """``by_input`` (a ``stale-input`` cause, of a step that wrote none of the graph's static inputs)
    as a frozen reference, where another instance of the stale buffer holds the reference's values in
    the stale view's place (``stale``: the buffer, the view's geometry, the reference's tensor;
    ``replayed``: the line that replayed the graph and the check that chose it)."""
    buf, (shape, stride, offset), given = stale
    _, op, _, _, why = by_input
    whole = buf.ref()
    if whole is None or (made := memory.created_by(whole)) is None:
        return None
    for storage in memory.made_alike(whole):
        other = torch.empty(0, dtype=whole.dtype, device=whole.device).set_(storage, offset, shape, stride)
        now = rows_like(other, given)
        if now is not None and not bool(disagrees(now, given).any()):
            site = chosen(replayed)
            return ("warmup-divergence", op, f"{buf.name}: {describe(given)}", site,
                    f"{why}; yet another {describe(whole)}, made where the graph's was ({made[1]}), holds this step's "
                    f"values: the graph reads the {buf.name} it was captured on, a reference the capture froze, and "
                    f"this step's inputs are in another (the graph was chosen for this step at {site})")
    return None
