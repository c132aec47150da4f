"""A capture's outputs read as results: values nothing computed.

A capture records kernels and runs none that last (on CUDA the memory of its outputs holds whatever
it held, on the CPU the emulation's poison): the tensors a captured callable returns are where a
replay will write, not results. A runner that hands them on as a step's result -- it captured on
this step's batch (a graph key that missed, a lazy capture) and returned what the capture gave
instead of replaying -- gives its caller numbers no one computed.

So eager code that reads memory a capture allocated, before any replay wrote it, is followed: what
it computes from that memory is too (one dummy batch's value flowing on). Where such values feed
another capture, they were the dummy batch of a capture done in pieces (the eager attention
between two pieces of a PIECEWISE capture, the backward captured from the forward's outputs):
nothing to report (and what they write into persistent state is dummy data, as a warmup's writes
are: ``rules/mutation.py``). Where they never do, the step took the capture's outputs for results:
``warmup-divergence`` (the step took the capture's path where an eager step computes) -- if the
workload went on with them: a value computed from them read again by eager code of another function
than the one that computed it (the caller taking a result, not the next op of one expression),
read on the host, held at the end, or returned by the workload. It is named where the capture was made, unless the first eager read
is in a function the capture ran too: then that function kept memory its captured call made and
reads it again on later calls (a table built lazily, cached on first use, when the first use was
a capture), and the finding names that read. A runner's capture loop that runs each
size once on a dummy batch and drops what the capturing call handed back took nothing for a result.
Only under differential replay (``diagnose``): eager ops are then looked at anyway.
"""
from __future__ import annotations

import dataclasses

from torch.multiprocessing.reductions import StorageWeakRef

from ...engine.opinfo import describe, op_tensors, overwrites, shape_only, storage_key, tensors, written_tensors
from ...engine.source import location, user_code_frame
from .. import explain
from ..report import Finding
from . import mutation
from .pool import block

_FOLLOWED = 10_000          # storages computed from uncomputed values followed at most


@dataclasses.dataclass
class Read:
    """The first eager read of a capture's uncomputed outputs."""

    info: object
    op: str
    line: str
    tensor: str
    cached: bool = False            # the read is in a function the capture ran: it kept the capture's memory
    captured: bool = False          # what it computed fed a capture: a capture in pieces
    read: int = 0                   # the capture's output storage it read
    used: bool = False              # what it computed was read again by eager code: the step went on with it
    made: dict = dataclasses.field(default_factory=dict)    # storage -> weak reference: what it computed
    makers: dict = dataclasses.field(default_factory=dict)  # storage -> code of the function that computed it
    joined: list = dataclasses.field(default_factory=list)  # reads whose values went into what it computed


def captured(doctor, info) -> None:
    """The pool blocks ``info``'s capture allocated hold nothing computed until a replay writes them
    (blocks, as the allocator hands them on: a later capture's output may live in this one's)."""
    for b in info.own_blocks:
        doctor.uncomputed[b] = info


def replayed(doctor, info) -> None:
    """What a replay wrote holds computed values, in its own blocks and in blocks another capture
    allocated (a pool's memory handed on, a buffer several graphs share)."""
    for b in [b for b, owner in doctor.uncomputed.items() if owner is info or b in info.blocks]:
        del doctor.uncomputed[b]
    for key in [k for k, r in doctor.followed.items() if k == r.read and r.info is info]:
        del doctor.followed[key]                    # its outputs are computed now: reading them is no use of
                                                    # what the capture left (what was computed from it still is)


def eager_op(doctor, func, args, kwargs, out) -> None:
    """An eager op (after it ran): does it compute from uncomputed memory? Then so does what it wrote,
    followed as the first such input's; the reads of its other such inputs are joined to that one
    (what feeds a capture fed it with each of them: two pieces' dummy outputs meeting in one op).
    (A graph that is gone took its blocks with it: their addresses are anyone's now.)"""
    if shape_only(func):
        return
    reads: list[Read] = []
    code = None
    for n, t in enumerate(op_tensors(args, kwargs)):
        if n == 0 and overwrites(func):
            continue
        key = storage_key(t)
        read = _followed(doctor, key)
        if read is not None and key != read.read and not read.used:     # a value computed from them, read again:
            code = code or _code()                                       # by the caller, or on the host
            read.used = read.makers.get(key) is not code or isinstance(out, (bool, int, float, complex))
        elif read is None and (info := doctor.uncomputed.get(block(t))) is not None and info.ref() is not None:
            frame = user_code_frame()
            read = doctor.followed[key] = Read(info, str(func), location(frame) if frame else "<unknown>",
                                               describe(t), _cached(info, frame),
                                               read=key)
        if read is not None and all(read is not r for r in reads):
            reads.append(read)
    if not reads or len(doctor.followed) >= _FOLLOWED:
        return
    read = reads[0]
    read.joined += [r for r in reads[1:] if all(r is not j for j in read.joined)]
    code = code or _code()
    for t in [*tensors(out), *written_tensors(func, args, kwargs)]:
        doctor.followed[key := storage_key(t)] = read    # what the memory holds now
        read.made[key] = StorageWeakRef(t.untyped_storage())
        read.makers[key] = code
    for t in written_tensors(func, args, kwargs):
        if (key := storage_key(t)) in doctor.initial:
            mutation.dummy_written(doctor, key, t)  # a dummy batch's value in persistent state: not live data


def _code():
    frame = user_code_frame()
    return frame.f_code if frame is not None else None


def _cached(info, frame) -> bool:
    """Whether the reading frame's function ran inside the capture block (not the code that opened it)."""
    return frame is not None and frame.f_code in info.called and frame.f_code is not info.opener


def _followed(doctor, key: int) -> Read | None:
    """The read a storage's values come from, while that storage lives (an address is reused: a
    tensor made later in the same memory holds other values)."""
    read = doctor.followed.get(key)
    if read is not None and (w := read.made.get(key)) is not None and w.expired():
        del doctor.followed[key]
        return None
    return read


def returned(doctor, value) -> None:
    """What the workload returned (``diagnose``): its tensors are results, used."""
    if doctor.followed:
        for t in tensors(value):
            if (read := _followed(doctor, storage_key(t))) is not None:
                read.used = True


def capture_reads(doctor, key: int) -> None:
    """A capture reads ``key``: if it holds values computed from uncomputed memory, those were a
    dummy batch for this capture, and so were those of every read joined to them."""
    todo, seen = ([r] if (r := _followed(doctor, key)) is not None else []), set()
    while todo:
        read = todo.pop()
        if id(read) not in seen:            # (a read joined after it fed one capture may feed the next)
            seen.add(id(read))
            read.captured = True
            todo += read.joined


def finish(doctor) -> None:
    """One finding per capture none of whose followed values fed a capture, and some of which the
    workload went on with: read again, still held at its end, or returned by it. A dummy run's
    output that is computed and dropped (a runner's capture loop) is nobody's result; so is one the
    workload went on with while its results equal its run without graphs' (``events.results``):
    what the capture left (poison on the CPU engine) reached none of them, a note."""
    fed = {id(r.info) for r in doctor.followed.values() if r.captured}
    reported = set()
    agreed = doctor.results_agree()
    for read in doctor.followed.values():
        if id(read.info) in fed or id(read.info) in reported:
            continue
        if not read.used and all(w.expired() for w in read.made.values()):
            continue
        reported.add(id(read.info))
        info = read.info
        site = read.line if read.cached else info.site
        evidence = (f"{read.op} at {read.line} reads a {read.tensor} that the capture of {info.name} created, before "
                    f"any replay of {info.name} wrote it, and what it computes feeds no capture")
        if agreed:
            doctor.report.note(f"{evidence}; but the workload's results equal its run without graphs': the values "
                               "went nowhere that lasts (a dummy run's, cleared after it): not reported")
            continue
        doctor.add(Finding("warmup-divergence", info.name, read.op, read.tensor, site,
                           f"{evidence}: it is taken for a result",
                           explain.uncomputed(info.name, read.op, read.cached), {"replays_before_read": 0}),
                   ("warmup-divergence", "uncomputed", site))
