"""Padded-row and padded-column fills, and the per-replay records ``diagnose`` compares.

``diagnose`` runs a workload twice more with the padded rows and columns filled two different
ways. Only elements nothing rewrote since the previous replay are filled (``Doctor.fresh``): what
the runner neutralises before a replay is its fix, and the fill must not undo it, wherever the
runner calls ``serve``. NumPy arrays (host metadata) cannot be watched for writes and are filled."""
from __future__ import annotations

import numpy as np
import torch
from torch.utils._python_dispatch import _disable_current_modes

from ...engine.opinfo import storage_key
from ..tensors import digest, whole


def fill(doctor, padded: dict, columns: dict, real: int, size: int) -> None:
    """Rows ``[real, size)`` of each padded array and columns ``[width, end)`` of rows ``[0, size)``
    of each padded-columns tensor get a small value: ``2i`` for the i-th array under pattern 0,
    ``2(n - i) - 1`` under pattern 1, so every array changes (even against odd, booleans too) and
    any two swap their order (a comparison between two padded fields flips). Small values stay
    valid as indices."""
    arrays = [(arr, slice(real, size), slice(None)) for arr in padded.values()]
    arrays += [(t, slice(0, size), slice(width, None)) for t, width in columns.values()]
    n = len(arrays)
    for i, (arr, rows, cols) in enumerate(arrays):
        value = 2 * i if doctor.pattern == 0 else 2 * (n - i) - 1
        if isinstance(arr, torch.Tensor):
            with _disable_current_modes():
                target = arr[rows] if cols == slice(None) else arr[rows, cols]
                fill_value = torch.full_like(target, bool(value % 2) if arr.dtype == torch.bool else value)
                kept = doctor.fresh.get(storage_key(arr))
                if kept is not None and kept.shape == arr.shape:
                    keep = kept[rows] if cols == slice(None) else kept[rows, cols]
                    fill_value = torch.where(keep, target, fill_value)
                target.copy_(fill_value)
        elif isinstance(arr, np.ndarray):
            index = rows if cols == slice(None) else (rows, cols)
            arr[index] = bool(value % 2) if arr.dtype == np.bool_ else value
        else:
            raise TypeError(f"padded rows must be tensors or NumPy arrays, got {type(arr).__name__}")


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
                t = t if real is None else t[:real]
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


def _name_of(doctor, keys) -> str:
    for key in keys:
        if (buf := doctor.buffer(key)) is not None:
            return buf.name
    return "-"


def record_outputs(doctor, info, pending) -> None:
    if not doctor.trace or doctor.trace[-1]["graph"] != info.name:
        return
    record = doctor.trace[-1]
    real, outputs = (pending.real, pending.outputs) if pending else (None, None)
    with _disable_current_modes():
        if outputs is not None:
            parts = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
            record["outputs"] = torch.cat([p[:real].detach().double().reshape(-1).cpu() for p in parts])
        for key in info.writes:
            if doctor.buffer(key) is None and (w := whole(info.externals[key].weak)) is not None:
                record["state"][info.externals[key].tensor] = digest(w)
