"""warmup-divergence from the warmup: source lines the warmup ran and the capture never executed.

Decided at the end of the watch, when every piece of a PIECEWISE step has been captured and
differential replay has compared what it could: skipped work that every compared replay shows to
change nothing is a note, not a finding.

(The other source of this kind, a replay that an eager run of the same step contradicts, is decided
by differential replay: ``probes/differential.py``.)"""
from __future__ import annotations

from collections import Counter

import torch

from ...engine import queries
from ...engine.cpu_graph import ALLOCATIONS
from ...engine.memory import HOST_TYPES
from ...engine.opinfo import op_tensors, storage_key, tensors
from ...engine.source import codes_within, frames_within, location, user_frame, user_frames
from ..records import Op

from .. import explain, skipped
from ..report import Finding


aten = torch.ops.aten
# Ops that take a tensor for its shape, dtype and device only: they read none of its data.
_SHAPE_ONLY = ALLOCATIONS | {aten.zeros_like, aten.ones_like, aten.full_like, aten.new_zeros, aten.new_ones,
                             aten.new_full}


class Warmups:
    """What the doctor keeps of warmups between them and the capture they prepare (``Doctor.warm``):
    the ops each warmup ran, the lines eager code ran since, the step whose pieces are being captured
    (PIECEWISE: one warmup, then a capture per piece with the step's eager code between them), and
    the user's frame that entered the warmup or capture running (what it calls is the step's)."""

    def __init__(self) -> None:
        self.runs: list[list[Op]] = []
        self.eager_lines: set[str] = set()
        self.head = None                 # the graph last captured after warmups, until a warmup or a replay
        self.opened = None
        self.host_made: set = set()      # storages host work made in the warmups: host memory too

    def capture_begin(self, info) -> None:
        queries.asked(clear=True)
        info.warmup = self.runs[0] if self.runs else None
        info.eager_lines, self.eager_lines = self.eager_lines, set()
        if info.warmup is None and self.head is not None:      # the next piece of a step being captured
            self.head.pieces.append(info)
        self.runs = []
        self.opened = next(iter(user_frames()), None)
        if self.opened is not None:      # a piece opened inside the step's own code (PIECEWISE)
            info.called.add(self.opened.f_code)
            info.opener = self.opened.f_code

    def capture_end(self, info) -> None:
        """After a capture that recorded ops (an empty piece hands its warmup on: ``hand_on``)."""
        self.opened, info.asked = None, queries.asked(clear=True)
        if info.warmup is not None:
            self.head = info

    def hand_on(self, info) -> None:
        """Nothing captured: a PIECEWISE piece closed before its first op (the step begins with eager
        code). The warmup, and what runs eagerly next, belong to the step's next piece."""
        self.runs, self.eager_lines, info.warmup, self.opened = [info.warmup], info.eager_lines, None, None

    def capture_abort(self, info) -> None:
        self.opened = None
        if info is not None:
            info.warmup = None           # nothing was captured to compare its warmup with

    def captures_over(self) -> None:
        """Captures are over, for now (a replay, a new step's warmups, the end of the watch). Eager code
        run since the step's last piece was captured is the rest of that step, kept outside its graphs
        (a drafter run eagerly after the target's capture, as the warmup ran it after the target's
        warmup): its lines are the step's, not work the capture skipped."""
        if self.head is not None:
            self.head.eager_lines |= self.eager_lines
            self.head, self.eager_lines = None, set()

    def warmup_begin(self) -> None:
        self.captures_over()             # a new step's warmups: eager code since the last capture is not its
        self.opened = next(iter(user_frames()), None)
        self.runs.append([])

    def warmup_end(self) -> None:
        self.opened = None

    def warmup_op(self, func, args, kwargs, constant: set, out) -> None:
        """A warmup op; what host work makes is host memory, as a capture takes it (``cpu_graph``): the
        next op of a composite host op (``lr / host_step``: a reciprocal, then a multiply) is host work too."""
        self.runs[-1].append(op(func, args, kwargs, constant, self.opened, self.host_made))
        if _host(self.runs[-1][-1], cuda=False):
            self.host_made.update(storage_key(t) for t in tensors(out))

    def eager_op(self) -> None:
        """An eager op outside warmups: between a warmup and its capture, or between pieces."""
        if self.runs or self.head is not None:
            self.eager_lines.add(user_frame())

    def captured_op(self, info) -> None:
        info.called |= codes_within(self.opened)


def op(func, args, kwargs, constant: set, opened, host_made: set = frozenset()) -> Op:
    """A warmup op as the rule needs it: the data it reads (not constants the warmups computed from
    no data, nor a tensor an allocation is shaped like: a placeholder a warmup returns in place of
    work it does only under capture), where its tensors live, and the frames it ran in inside the
    warmup block."""
    ts = op_tensors(args, kwargs)
    reads = () if func.overloadpacket in _SHAPE_ONLY else ts
    frames = frames_within(opened) or ()
    return Op(str(func), location(frames[0]) if frames else user_frame(),
              frozenset(k for t in reads if (k := storage_key(t)) not in constant),
              memory=frozenset("host" if type(t) in HOST_TYPES or storage_key(t) in host_made else t.device.type
                               for t in ts),
              stack=tuple((f.f_code, f.f_lineno) for f in reversed(frames)))


def check(doctor, info) -> None:
    """At the end of the watch: ops of source lines the fresh warmup ran and the capture never
    executed: Python skipped them at capture (lazy work already done). The capture of a step split
    into pieces (PIECEWISE) is all its pieces and the eager code run between them: the warmup ran
    the whole step. A line that ran in both but dispatched other kernels (a backend choosing another
    algorithm under capture) is not a skipped step, nor is one the runner ran eagerly before the
    capture (code it keeps outside the graph, as PIECEWISE graphs do: whether that code is safe is
    the mutation rule's question). Not counted either: host work (a capture never records it, so it
    cannot have skipped it) and work that reads no data, only constants (a buffer or a table made
    once, outside the graph's pool, is the same for every step: replays that reuse it are right).
    Only work inside what the capture called counts: a warmup block's own set-up (inputs made for
    the dummy batch, a backward captured as another graph) is the runner's, not the step's.

    The finding names the first skipped op; where the capture left the warmup's path in a function
    that asked whether a capture is open (``_branch``, known under ``diagnose``), that branch.

    The skipped work is a finding, unless differential replay compared this graph's replays with
    eager steps and every one agreed, or gave what the workload's run without graphs gives at the same
    step (``probes/reference.py``: the eager form is then not the step), or the workload says its
    results agree with that run's (``events.results``): then the capture skipped work that changes no
    result (a check a library makes only outside a capture, a loop that reads back its convergence
    only when not capturing), and it is a note."""
    if info.warmup is None:
        return
    step = (info, *info.pieces)
    ran_since = {op.source for piece in step for op in piece.ops} | set().union(*(p.eager_lines for p in step))
    called = set().union(*(p.called for p in step))
    missing = [op for op in info.warmup if op.source not in ran_since and op.reads and not _host(op, info.cuda)
               and {code for code, _ in op.stack} & called]
    if not missing:
        return
    first = missing[0]
    lines = Counter(op.source.split(": ", 1)[0] for op in missing)
    captured = sum(len(piece.ops) for piece in step)
    branch = _branch(first, step)
    left = f"; the capture left the warmup's path at {branch}, which asked whether a capture is open" if branch else ""
    finding = Finding(
        "warmup-divergence", info.name, first.name, "-", branch or first.source,
        f"the warmup ran {len(info.warmup)} ops, the capture recorded {captured}; {len(missing)} warmup ops "
        f"come from {len(lines)} source line(s) the capture never executed: "
        + ", ".join(f"{k} (x{v})" for k, v in lines.items()) + left,
        explain.warmup(len(missing), first.name),
        {"warmup_ops": len(info.warmup), "captured_ops": captured, "missing": len(missing), "lines": len(lines)})
    if info.compared and not info.disagreed:
        doctor.report.note(f"{info.name}: the warmup ran work the capture skipped ({finding.source}); "
                           f"{info.compared} replay(s) compared with eager steps agreed, so it changes no result")
        return
    if doctor.results_agree():
        doctor.report.note(f"{info.name}: the warmup ran work the capture skipped ({finding.source}); the "
                           "workload's results agree with its run without graphs, so it changed none of them "
                           "(a decision made on the host outside a capture, a path taken only when not capturing)")
        return
    fs = doctor.report.findings                 # the cause before what differential replay saw of it
    if doctor.add(finding, ("warmup-divergence", first.name, first.source)) is finding and fs[-1] is finding:
        fs.insert(next(i for i, f in enumerate(fs) if f.kind == finding.kind), fs.pop())


def _branch(first: Op, step: tuple) -> str | None:
    """Where the capture left the warmup's path (``skipped.parted`` over the first skipped op's frames
    and the lines the capture ran), if the function there asked whether a capture is open: work it
    skips because it is captured (a kernel that cannot be captured, a plan only made eagerly) is
    decided there. Work skipped because it was done already (a lazy plan, built at warmup) is named
    itself: that work is what a step needs done every time."""
    branch = skipped.parted(first.stack, set().union(*(p.lines_run for p in step)))
    asked = set().union(*(p.asked for p in step))
    if branch is None or branch == first.source:
        return None
    return branch if any(location(code, line) == branch and code in asked for code, line in first.stack) else None


def _host(op: Op, cuda: bool) -> bool:
    """All its tensors in host memory: host tensors, or the CPU's beside a CUDA graph."""
    return bool(op.memory) and op.memory <= ({"host", "cpu"} if cuda else {"host"})
