"""stale-input after the graph: a tensor eager code computed from a graph's output, reused once a
replay has rewritten that output.

A graph hands out the same output tensors at every replay: the replay rewrites their memory in
place and the tensor objects stay (CUDA graph trees' persisted outputs, a runner's static output
buffer). Code that caches what it computed from a tensor by the tensor's identity -- autocast's
lower-precision cast of a weight (``cached_casts``, keyed by the TensorImpl, cleared only when the
outermost autocast region exits), a memo keyed by ``id(t)`` -- hits its entry again at the next
step, while the output holds the new step's values: the step reads what an earlier step derived.
Without graphs each step makes new tensors, and the cache misses.

With a reference run (``probes/reference.py``), the doctor notes each tensor an eager op computes
from memory a capture wrote, with how many times that graph had replayed then. An op that reads
such a tensor after the graph has replayed again, at a line that read the same tensor object at an
earlier step, reuses it. That is reported only where the workload's results differ from its run
without graphs and no other finding explains them: keeping a value from an earlier step on purpose
(the previous step's output, kept to compare) is common, and reading it is no fault.
"""
from __future__ import annotations

import weakref

import torch

from ...engine.opinfo import describe, op_tensors, tensors
from ...engine.source import user_frame
from .. import explain
from ..report import Finding
from .pool import block

_KEPT = 4096                  # derived tensors noted at most, the oldest forgotten first


def derived(doctor, func, args, kwargs, out) -> None:
    """An eager op's result, noted where one of its tensor arguments is memory a capture wrote."""
    producer = doctor.pool.producer
    source = next((entry[0] for t in op_tensors(args, kwargs) if (entry := producer.get(block(t))) is not None),
                  None)
    if source is None:
        return
    made = doctor.derivations
    for t in tensors(out):
        if producer.get(block(t)) is not None:         # (an op writing the graph's memory in place)
            continue
        if len(made) >= _KEPT:
            del made[next(iter(made))]
        made[id(t)] = [weakref.ref(t), source, source.replays, user_frame(), set()]


def read(doctor, func, t: torch.Tensor) -> None:
    """An eager op reads a noted tensor: a reuse where its source graph has replayed since it was
    made, and this line read the same tensor before."""
    entry = doctor.derivations[id(t)]
    ref, info, replays, made_at, lines = entry
    if ref() is not t:
        return
    line = user_frame()
    if line in lines and info.replays > replays and doctor.reused is None:
        doctor.reused = Finding(
            "stale-input", info.name, str(func), describe(t), made_at,
            f"{line} reads, after replay {info.replays} of {info.name}, the {describe(t)} that {made_at} computed "
            f"from the graph's output after replay {replays}, as it did at an earlier step: a value kept from an "
            "earlier step (a cache keyed by the output tensor, which a replay rewrites and does not replace)",
            explain.reused_output_value(info.name), {"made_after": replays, "read_after": info.replays})
    lines.add(line)


def report(doctor) -> None:
    """The held reuse, where the workload's results differ and nothing else explains them."""
    if doctor.reused is not None:
        finding = doctor.reused
        doctor.add(finding, (finding.kind, finding.op, finding.source))
