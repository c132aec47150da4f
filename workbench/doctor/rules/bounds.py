"""On CUDA, an index past a tensor's end in a warmup raises as it does on the CPU, at the op.

A CUDA kernel that indexes out of range fires a device-side assert: it is reported at some later
synchronisation, not at the op, and it ends the CUDA context, so nothing after it runs. The CPU
raises at the op (an ``IndexError``; a ``RuntimeError`` for ``gather``), which the doctor's rules explain (which static input held the
index, which buffer was too small). A warmup runs eagerly, where synchronising is allowed: the
doctor checks the indices of the ops that take them there and raises the CPU's own error (the op
run on CPU copies) instead of launching the kernel, so that a run on a GPU fails where the run on
the CPU fails and is explained alike. (A capture cannot synchronise; it runs the warmup's ops.)
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_map


def _per_dimension(a):        # (self, [index or None per leading dimension], ...)
    return a[0], list(enumerate(a[1]))


def _along(a):                # (self, dim, index)
    return a[0], [(a[1], a[2])]


aten = torch.ops.aten
_INDEXED = {aten.index: _per_dimension, aten.index_put_: _per_dimension, aten.index_put: _per_dimension,
            aten.index_select: _along, aten.gather: _along,
            aten.embedding: lambda a: (a[0], [(0, a[1])])}      # (weight, indices)


def indexes(op_name: str) -> bool:
    """Whether a recorded op (``aten.index_select.default``) is one whose indices ``check`` checks."""
    return op_name.rsplit(".", 1)[0] in _NAMES


_NAMES = frozenset(str(packet) for packet in _INDEXED)


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
                    func(*tree_map(_on_cpu, args), **tree_map(_on_cpu, kwargs))
                except (IndexError, RuntimeError) as e:
                    run.error = e           # the op's own failure, as the CPU gives it
                    raise
                return


def _on_cpu(x):
    return x.detach().cpu() if isinstance(x, torch.Tensor) else x
