"""What a capture records, op by op: the graph's launch trace (each op's reads, writes, user source
line and Python-decided arguments), the storages it created (its pool) and those it only references
(externals: the first op on each, and the first that really reads it), and what the rules check as
the op runs (host syncs, writes into static buffers, the pool, scatters into state, what warmups
ran that the capture does not)."""
from __future__ import annotations

import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import _disable_current_modes

from ..engine import memory
from ..engine.cpu_graph import ALLOCATIONS
from ..engine.opinfo import describe, op_tensors, overwrites, storage_key, tensors, written_tensors
from ..engine.source import user_frame
from .records import External, Op
from .rules import dangling, host_copies, host_writes, padded_scatter, sync, uncomputed, undersized, unread
from .rules.pool import block
from .tensors import by_value, signature

aten = torch.ops.aten
_COPY = aten.copy_.default


def recorded(doctor, func, args, kwargs, run):
    """One op inside a capture (``Doctor.capturing``): run it, record it."""
    info = doctor.capturing
    inputs = op_tensors(args, kwargs)
    if info.cuda and host_copies.unrecorded(inputs, kwargs, True):
        return run()            # host work (a pinned flag's ``.item()``): CUDA records none of it, and the
        # CPU engine runs it where the doctor does not see it (``engine/host.py``)
    source = user_frame()
    if info.handed and not func.is_view:
        host_writes.before(info, inputs, func, source)
    sync.check(doctor, info, func, args, kwargs, source)
    from_host = host_copies.host_source(func, args, kwargs, info.cuda)
    in_keys = {storage_key(t) for t in inputs}
    targets = doctor.targets(func, args, kwargs)
    if targets and func is _COPY:
        undersized.check_fit(doctor, args[0], args[1])
    written = frozenset(storage_key(t) for t in written_tensors(func, args, kwargs))
    sig = signature(func, args, kwargs)
    out = undersized.write(doctor, func, targets, run)
    doctor.pool.captured(info, func, args, kwargs, out, Op(str(func), source))
    padded_scatter.captured(doctor, info, func, args, kwargs, source)
    lifted = func.overloadpacket in (aten.lift_fresh, aten.lift_fresh_copy)
    if lifted:
        for t in inputs:                          # a constant of the captured code: the graph keeps it
            doctor.owned[storage_key(t)] = (StorageWeakRef(t.untyped_storage()), info)
            info.created.add(storage_key(t))
            info.constants.add(storage_key(t))
    constant = func is not _COPY
    repointed = func.overloadpacket is aten.set_     # a tensor pointed at memory: no allocation, and no read
    for t in inputs:
        if constant and by_value(t, info.cuda):
            if len(info.by_value) < 4:            # its value is the graph's (``signature``), not its memory
                with _disable_current_modes(), torch._C.DisableTorchFunctionSubclass():
                    info.by_value.append((Op(str(func), source), t.item()))
            if (buf := doctor.buffer(storage_key(t))) is not None and buf.role == "input":
                info.taken_by_value.add((str(func), source))
            continue
        key = storage_key(t)
        if info.aliases and key in info.aliases:
            dangling.aliased(doctor, info, key, t, str(func), source)
        if doctor.every and not func.is_view:
            unread.read_view(doctor, info, key, t, source)
        owner = doctor.owner_of(key)
        if owner is info:
            continue
        if owner is not None:
            info.foreign.setdefault(key, (owner, str(func), source, describe(t)))
            continue
        ext = info.externals.get(key)
        if ext is None:
            ext = info.externals[key] = External(StorageWeakRef(t.untyped_storage()), describe(t), t.dtype,
                                                 str(func), source, memory.origin_of(t), func.is_view or repointed,
                                                 (str(func), source))
            dangling.aliased(doctor, info, key, t, str(func), source)
        elif ext.view_only and not func.is_view and not repointed:      # name the first op that really reads it
            ext.op, ext.source, ext.tensor, ext.view_only = str(func), source, describe(t), False
        if not ext.host_copy and t is from_host:
            ext.host_copy = (str(func), source)
    host_copies.copied(doctor, info, from_host, source)
    if doctor.followed:
        for key in in_keys:
            uncomputed.capture_reads(doctor, key)
    read = in_keys - written if written and overwrites(func, args, kwargs) else in_keys
    info.read_first.update(key for key in read if key in info.externals and key not in info.writes)
    for key in written:
        if doctor.owner_of(key) is None:
            info.writes.setdefault(key, Op(str(func), source))
    if not func.is_view:                          # (a view reads no data)
        for key in (read - written) & info.unwritten.keys():
            info.read_unwritten.setdefault(key, Op(str(func), source))
    for key in written & info.unwritten.keys():
        del info.unwritten[key]
    for o in tensors(out):
        key = storage_key(o)
        if key not in in_keys and doctor.owner_of(key) is None and not repointed:
            doctor.owned[key] = (StorageWeakRef(o.untyped_storage()), info)
            info.made[key] = (weakref.ref(o), str(func), source)
            info.created.add(key)
            for gone in [k for k in info.unwritten if info.made[k][0]() is None]:
                del info.unwritten[gone]        # freed in the capture: its block may be this tensor's now
            if func.overloadpacket in ALLOCATIONS:
                info.unwritten[key] = block(o)
    if not func.is_view:
        doctor.warm.captured_op(info)
    if doctor.reference is not None and not func.is_view:
        doctor.reference.captured(doctor, info, func, args, kwargs)
    if not func.is_view or lifted:              # a constant's value is part of the trace
        info.ops.append(Op(str(func), source, frozenset(in_keys), written,
                           frozenset(in_keys - info.created), sig))
    if info.handed and not func.is_view:
        host_writes.after(info, inputs)
    return out
