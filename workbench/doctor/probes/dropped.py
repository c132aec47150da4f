"""Work the run without graphs does at every step, which the served run stopped doing: a result
computed once, around a capture, and read by every replay after.

A capture records the kernels its step launches; what the runner runs outside it -- eagerly, once,
while it prepares the graph -- is not replayed. Where the runner decides at capture that some work
does not depend on the step (it prunes kernels whose inputs it thinks constant, it hoists a plan
out of the step), the graph reads that work's result as the capture left it. Differential replay
cannot see it: the step's eager form is the graph's own code, without the work either. The run
without graphs (``events.reference()``) can: it launches that op at every step.

Under ``diagnose``, with a reference announced, every op is counted by its op and line: in the
reference; in the served run, eagerly (warmups and captures' own eager work included) and once per
replay of each graph whose launch trace holds it. An op the reference launches more often than
the served run, and whose inputs the reference gave other values at different steps (so its
result depends on the step: a weight-only kernel run once is a standard optimisation, not a bug),
was dropped from the steps, if a graph reads what it wrote, or hands it out as an output that no op
of the graph writes (a replay then hands out what that launch left). Only where the workload's
results differ from the reference's and no other finding explains them, it is reported as
``warmup-divergence``. A fill whose inputs never vary was dropped too where a graph reads what it
wrote before writing it itself (a gradient buffer zeroed before every step, which the graph adds
into): each replay starts from what the replay before it left, ``stale-input`` (a refresh skipped).
Where a graph replays the same op at the same line (a kernel recorded from
one launch site and left out from another), the site is the innermost function of the last launch
that no capture ran: the launch site that recorded nothing. Otherwise it is the innermost function
of that launch that the reference never called (the runner's code that ran the work once and left
it out of the graph), else the op's line.
"""
from __future__ import annotations

import collections

import torch

from ...engine.opinfo import mutable, storage_key, written_tensors
from ...engine.source import function_name, location, user_frames
from .. import explain
from ..report import Finding
from ..rules.pool import block
from ..tensors import leaves


class Dropped:
    """The served run's eager launches, by op and line; for the last of each, the stack it ran
    under and the storages and blocks it wrote; the launches made once graphs were being replayed;
    and the blocks of outputs graphs handed out without writing them."""

    def __init__(self) -> None:
        self.eager: collections.Counter = collections.Counter()
        self.replaying: collections.Counter = collections.Counter()
        self.last: dict[tuple, tuple] = {}     # (op, line) -> ((code, line number) outermost first, written storages,
        #                                        written blocks)
        self.unwritten_outputs: dict[tuple, str] = {}     # block -> the graph that handed it out unwritten

    def launched(self, doctor, func, args, kwargs) -> None:
        frames = user_frames()
        if not frames:
            return
        key = (str(func), location(frames[0].f_code, frames[0].f_lineno))
        self.eager[key] += 1
        if doctor.report.replays:
            self.replaying[key] += 1
        written = written_tensors(func, args, kwargs) if mutable(func) else ()
        self.last[key] = (tuple((f.f_code, f.f_lineno) for f in reversed(frames)),
                          frozenset(map(storage_key, written)), frozenset(map(block, written)))

    def served(self, info, pending) -> None:
        """A replay's outputs that none of its step's graphs wrote."""
        for o in leaves(pending.outputs):
            if not any((b := block(o)) in p.blocks for p in pending.span or (info,)):
                self.unwritten_outputs[b] = info.name

    def report(self, doctor, reference) -> None:
        launched = collections.Counter((s.op.name, s.op.source) for s in reference.steps)
        served = collections.Counter(self.eager)
        for info in doctor.graphs.values():
            for op in info.ops:
                served[(op.name, op.source)] += info.replays + 1         # (its capture ran it too)
        short = [(n - served[key], key) for key, n in launched.items()
                 if n > served[key] and key in self.last and not self.replaying[key]]
        called = set(reference.calls)
        for _, key in sorted(short, key=lambda e: -e[0]):
            handing = {name: "an output it never writes" for b, name in self.unwritten_outputs.items()
                       if b in self.last[key][2]}
            readers = _readers(doctor, key, self.last[key][1]) | handing
            carried = _carried(doctor, self.last[key][1])
            if not readers or not carried and not _varies(
                    [tuple(v for j, v in enumerate(s.values) if j not in s.overwritten)
                     for s in reference.steps if (s.op.name, s.op.source) == key]):
                continue
            stack = self.last[key][0]
            site = _site(doctor, key, stack, called)
            name, source = key
            function = function_name(_code(stack, site))
            how = ("hand(s) it out as an output no op of theirs writes" if readers.keys() <= handing.keys()
                   else "read(s) what it wrote")
            kind = "stale-input" if carried else "warmup-divergence"
            evidence = (f"the workload's results differ from its run without graphs'; that run launched {name} at "
                        f"{source} {launched[key]} time(s), "
                        + (f"and {', '.join(carried)} read(s) and write(s) what it wrote" if carried else
                           "with other inputs at different steps") +
                        f", and the served run {served[key]} time(s), none once replays began, the last under "
                        f"{function} at {site}; {', '.join(readers)} {how}: every replay reads what "
                        + ("the replay before it left" if carried else "that run left"))
            tensor = next(iter(readers.values()))
            doctor.add(Finding(kind, ", ".join(readers), name, tensor, site, evidence,
                               explain.dropped_work(name, function, bool(carried)),
                               {"reference_launches": launched[key], "served_launches": served[key]}),
                       (kind, "dropped", site))
            return


def _site(doctor, key: tuple, stack: tuple, called: set) -> str:
    """The innermost function of the dropped launch's stack outside ``skip``: what the captures ran,
    where a graph replays the same op at the same line (the launch site that recorded nothing), else
    what the run without graphs called (the runner's code that ran the work once); else the op's line."""
    recorded = any((op.name, op.source) == key for info in doctor.graphs.values() for op in info.ops)
    skip = set().union(*(info.called for info in doctor.graphs.values())) if recorded else called
    return next((location(code, line) for code, line in reversed(stack) if code not in skip), key[1])


def _readers(doctor, key: tuple, written: frozenset) -> dict[str, str]:
    """The graphs that read what the op wrote (its destination) or a tensor it made (by origin),
    each with that tensor."""
    made, out = f"at {key[1]}", {}
    for info in doctor.graphs.values():
        if (ext := next((e for k, e in info.externals.items() if k in written or e.origin == made), None)):
            out[info.name] = ext.tensor
    return out


def _carried(doctor, written: frozenset) -> list[str]:
    """The graphs that read what the op wrote before they write it themselves (a sum they add into,
    a counter they advance): its result is the start of every step, not a value computed once."""
    return [info.name for info in doctor.graphs.values() if any(k in info.writes for k in written & info.read_first)]


def _varies(values: list) -> bool:
    """Whether the kept inputs of an op's launches are not all the same (a launch whose inputs were
    too large to keep tells nothing)."""
    kept = [v for v in values if v and all(t is not None for t in v)]
    return any(len(v) != len(kept[0]) or any(a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b)
                                             for a, b in zip(v, kept[0])) for v in kept[1:])


def _code(stack: tuple, site: str):
    return next((code for code, line in reversed(stack) if location(code, line) == site), stack[-1][0])
