"""On CUDA, an index past a tensor's end in a warmup raises as it does on the CPU, at the op.

A CUDA kernel that indexes out of range fires a device-side assert: it is reported at some later
synchronisation, not at the op, and it ends the CUDA context, so nothing after it runs. The CPU
raises an ``IndexError`` at the op, which the doctor's rules explain (which static input held the
index, which buffer was too small). A warmup runs eagerly, where synchronising is allowed: the
doctor checks the indices of the ops that take them there and raises the CPU's own error (the op
run on CPU copies) instead of launching the kernel, so that a run on a GPU fails where the run on
the CPU fails and is explained alike. (A capture cannot synchronise; it runs the warmup's ops.)
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes

aten = torch.ops.aten
_INDEXED = {aten.index: lambda a: (a[0], list(enumerate(a[1]))),
            aten.index_put_: lambda a: (a[0], list(enumerate(a[1]))),
            aten.index_put: lambda a: (a[0], list(enumerate(a[1]))),
            aten.index_select: lambda a: (a[0], [(a[1], a[2])]),
            aten.gather: lambda a: (a[0], [(a[1], a[2])]),
            aten.embedding: lambda a: (a[0], [(0, a[1])])}


def check(func, args, kwargs, run) -> None:
    """Raise the CPU's error for an op of a CUDA warmup whose indices run past their dimension."""
    indexed = _INDEXED.get(func.overloadpacket)
    if indexed is None or not isinstance(args[0], torch.Tensor) or not args[0].is_cuda:
        return
    table, indices = indexed(args)
    with _disable_current_modes():
        for dim, index in indices:
            if not isinstance(index, torch.Tensor) or index.dtype in (torch.bool, torch.uint8) or not index.numel():
                continue
            size = table.shape[dim] if table.dim() else 1
            if bool(((index >= size) | (index < -size)).any()):
                try:
                    func(*_on_cpu(args), **_on_cpu(kwargs))
                except IndexError as e:
                    run.error = e           # the op's own failure, as the CPU gives it
                    raise
                return


def _on_cpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, (list, tuple)):
        return type(x)(_on_cpu(v) for v in x)
    if isinstance(x, dict):
        return {k: _on_cpu(v) for k, v in x.items()}
    return x
