"""The workload's reference run: each replay against the same step run without graphs.

Differential replay re-runs a step's eager form: the captured callable. That callable carries what
capture decided (a closure over the capture's batch, a launch grid sized from its lengths, the
branch its metadata chose), and it reads the static buffers the runner's replay path has just
written: where the runner itself prepares a step wrongly, or the captured closure is what is
wrong, the eager form agrees with the graph. A workload that also serves its requests without
graphs (the eager baseline a test compares with) announces that run (``events.reference()``,
the zoo kit's ``compare`` does); under ``diagnose`` the doctor records it:

* every call of the workload's functions, numbered (``called``, from ``raised``'s tracer), and
  what each call returned (``returned``), or, for one that returned no tensor, what its writes of
  small tensors left there when it returned (``reference_steps.Values.left``);
* every op with the calls it ran in and, for small tensors, the values it was given.

A graph's *root* is the outermost function of its captured code that the reference also called
(the model's forward, under the runner's lambda). The k-th step that runs the root in the served
run -- eagerly, or as a replay of a graph with that root -- is near the reference's k-th call of
it: the static inputs the replay reads pick the call among those near it (``_step``). Where the
root reads no static input, the count alone picks it, and a replay that gives the answer of a call
near the count is not said to differ (the count missed: the run without graphs made a dummy call).
A first replay whose inputs hold what the capture read is the capture's own batch, no step (what
differential replay finds there is held as for a replay that gave the run's answer).
Where a replay's real rows differ from what that call returned -- or, where it returned no tensor
(a kernel launcher, a solver step advancing its state in place), from what the call's same write
left in the memory it wrote (``compare.written_by``) -- the doctor looks for why, with the same
step on both sides (``reference_causes.py``):

1. a static input the graph reads holds other values, in its real rows, than the tensor the
   reference gives the same op (by line and occurrence): the runner prepared the step wrongly --
   ``warmup-divergence`` at the line that last wrote that buffer; or, where this step wrote none of
   the elements that differ, it omitted them -- ``stale-input`` at the refresh that skipped them (the
   step's write into another input that the op, or its function, reads; else the function that wrote
   most of the step's inputs), at the op that reads them where the step wrote no input, in the frame
   that replays first where the step writes them after the replay (``late_refresh``); where the step
   wrote none of the graph's inputs and holds them in another tensor made where the graph's was, the
   graph reads one the capture bound -- ``warmup-divergence`` where it was chosen
   (``written_elsewhere``); or the graph's view is narrower, in a dimension other than its rows, than
   the reference's tensor: the capture's window is too small for this step -- ``undersized-buffer``
   at the line that took the view;
2. else the launch traces part (by op and line; shapes differ where rows are padded): the graph
   replays what Python decided at capture -- a loop run another number of times is
   ``host-work-frozen`` at the frame that loops, another branch ``warmup-divergence``; a loop over
   rows that the graph runs for its padded rows too is no evidence, unless those runs write memory
   the graph does not own: ``stale-padding`` at that write;
3. else an op runs with another plain number than the reference step passes it (not one the
   padded layout explains): ``host-work-frozen``, at the frame of the captured code that held the
   number when the capture ran;
4. else a tensor the graph only reads, which it neither owns nor is given as a static input (a
   parameter, a table, state announced as persistent that no graph writes: prepared metadata),
   holds other values than the reference gives the same op: the capture bound that tensor, and
   this step's eager form reads another -- ``warmup-divergence``, at the line that last wrote it
   after the capture if eager code did (the runner prepared it otherwise), else where the graph
   was chosen for this step (it serves inputs it was not captured with: a graph keyed on the wrong
   property of its inputs): the check or key function whose answer chose it (``raised.decider``),
   else the line that replayed it.

A PIECEWISE step (several graphs, eager code between them) is one call of the root: its inputs are
those its first piece reads, its outputs what the runner hands out after the last, and only the
first cause (a static input) is looked for (the other pieces' ops are not beside the first's).

At the end, where no rule found anything: a result of the workload with a padded replay's rows where
the reference has the real ones is ``padded-shape-mismatch`` at the line that replayed it; a tensor
eager code computed from a graph's output, read again after a replay rewrote that output, is
``stale-input`` where it was computed (``rules/reused.py``); a served run that failed or differs is
compared with the reference line by line (``coverage.py``), and one that failed by the sizes its
failing calls were passed (``failed_call.py``); one that differs, op by op: work the reference does
at every step, which the served run did only while it prepared a graph that reads its result, is
``warmup-divergence`` where it was done (``dropped.py``); last, a closure only captures ran that the
served run's eager code calls too is set-up left on the eager path (``coverage.py``).

Only a graph no other rule has a finding for gets one (one failure, one finding). A replay that
agrees with the reference gives none, whatever its trace (a graph launching more work than eager is
a standard fix). Where the workload's results agree with the reference's (``events.results``), a
replay that differs was paired with the wrong call (a batch split otherwise): a note only.
"""
from __future__ import annotations

import itertools
import weakref

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ...engine.opinfo import describe, mutable, op_tensors, storage_key, written_tensors
from ...engine.source import frames_within, user_frame, user_frames
from .. import explain
from ..raised import decider
from ..records import unwritten_blocks
from ..report import PADDED_ROWS, Finding
from ..rules import mutation, reused, sync
from ..rules.pool import block
from ..tensors import host_only, leaves, placed, real_rows, signature
from . import borne_out, host_left, late_refresh, release, written_elsewhere
from .compare import agrees, calls_near, capture_batch, comparable, differs_from, paired, verdict, written_by, written_inputs
from .coverage import Coverage
from .dropped import Dropped
from .eager_trace import number_origin
from .failed_call import FailedCalls
from .reference_causes import (bound, chosen_at, compare_views, frozen_scalar, launched, narrower, numbers,
                               only_read, other_view, padded_result, static_input)
from .reference_steps import SMALL, Step, Values, root, step

_LIFTS = (torch.ops.aten.lift_fresh, torch.ops.aten.lift_fresh_copy)     # constants made from Python data
_CANDIDATES = 64          # reference calls, nearest the served run's count first, tried for a replay


class Reference:
    """The reference run as recorded, and each graph's replays aligned with its steps."""

    def __init__(self) -> None:
        self.recording = True
        self.numbers = itertools.count()
        self.call: dict[int, int] = {}            # id(frame) -> the number of its call (a new call renumbers)
        self.calls: dict = {}                     # code -> its call numbers in the reference, in order
        self.steps: list[Step] = []
        self.returned_values: dict[tuple, tuple] = {}   # (code, call number) -> the tensors it returned, where
        self.opened: dict[int, int] = {}          # id(frame) -> the steps recorded before its call
        self.left: dict[tuple, dict] = {}         # (code, call number), returning nothing -> id(step) -> (value,
                                                  # offset, stride): what it left where it wrote
        self.values = Values()                    # copies of small tensors as the reference had them
        self.served: dict = {}                    # code -> its eager calls in the served run
        self.replayed: dict = {}                  # code -> replays of graphs rooted there
        # GraphInfo -> (root code, indices of its ops under it); weakly: a re-captured graph's new record
        # may be given the id of one released, and must not inherit its root
        self.roots: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.at_replay: dict[int, tuple] = {}     # id(GraphInfo) -> (served steps before, static views' values)
        self.by_call: tuple | None = None         # (code, call number -> its steps), for the last root asked
        self.writers: dict[int, tuple] = {}       # static input -> its last write, served: (op, line, name, chosen at)
        self.found: dict[str, tuple] = {}         # graph name -> (info, kind, op, tensor, source, text, numbers)
        self.guessed: dict[str, tuple] = {}       # ... on a replay tied to its step by count alone: the last evidence
        self.by_input: set[str] = set()           # ... of those, found in a static input's values (``static_input``)
        self.unexplained: list[tuple] = []        # (graph name, text, padded?) of replays that differ, no cause found
        self.outcomes: dict[str, set] = {}        # graph name -> whether its compared replays agreed (True), parted
        self.verdict: tuple | None = None         # the workload's own: None (not said), () (agrees), (result, diff)
        self.misshaped: tuple | None = None       # (served, reference) shapes of the first result they differ in
        self.padded: dict[tuple, tuple] = {}      # (size, real) of a padded replay -> (graph, line that replayed it)
        self.span: tuple | None = None            # (Pending, first piece) of the PIECEWISE step being replayed
        self.number = 0                           # the last call number given
        self.captured_with: dict[int, dict] = {}  # id(GraphInfo) -> its static-input views' values at capture
        self.coverage = Coverage()                # the lines each run ran (``coverage.py``)
        self.dropped = Dropped()                  # the served run's eager launches (``dropped.py``)
        self.failed_calls = FailedCalls()         # the sizes each call was passed (``failed_call.py``)
        self.warm_writes: list = []               # warmups' writes into live state, held (``mutation.warmup_wrote_state``)
        self.late: dict = {}                      # graph name -> a stale input, checked at the next write (``late_refresh``)

    # ------------------------------------------------------------------ recording the reference
    def called(self, doctor, frame) -> None:
        """A call of the workload's code (``raised``'s tracer): numbered in the reference, counted
        in the served run when it is a real step's (not a warmup's, a capture's, nor the doctor's)."""
        code = frame.f_code
        if self.recording:
            number = self.number = next(self.numbers)
            self.call[id(frame)] = number
            self.opened[id(frame)] = len(self.steps)
            self.calls.setdefault(code, []).append(number)
            self.failed_calls.called(frame)
        elif doctor.phase == "eager" and not doctor.dummy_run and code in self.calls:
            self.served[code] = self.served.get(code, 0) + 1

    def returned(self, frame, value) -> None:
        number, start = self.call.get(id(frame)), self.opened.pop(id(frame), None)
        found = list(placed(value)) if self.values.budget["values"] > 0 else []
        if found and number is not None:
            self.returned_values[(frame.f_code, number)] = ([self.values.keep(t, always=True) for _, t in found],
                                                            tuple(w for w, _ in found))
        elif not found and number is not None and start is not None and (left := self.values.left(self.steps[start:])):
            self.left[(frame.f_code, number)] = left

    def eager_op(self, doctor, func, args, kwargs) -> None:
        """An op outside captures: recorded while the reference runs; after it, a write into a
        static input names the line that prepared it."""
        if self.recording:
            self._record(func, args, kwargs)
            return
        if not func.is_view and (func.overloadpacket in _LIFTS or not host_only(op_tensors(args, kwargs), cuda=False)):
            self.dropped.launched(doctor, func, args, kwargs)
        if (doctor.buffers or doctor.graph_reads) and mutable(func):
            for t in written_tensors(func, args, kwargs):
                buf = doctor.buffer(key := storage_key(t))
                read = buf is not None and buf.role == "input" or buf is None and key in doctor.graph_reads
                if read or buf is None and key in doctor.owned:     # (a graph's own memory: a piece's output)
                    # where the values were chosen is asked only of inputs: it reads the callers' locals, and
                    # on Python 3.11 the snapshot that takes keeps them alive (a graph the caller let go)
                    self.writers[key] = (str(func), user_frame(), buf.name if buf is not None else describe(t),
                                         chosen_at(func, args) if read else None, doctor.report.replays,
                                         late_refresh.frames())

    def _record(self, func, args, kwargs) -> None:
        inputs = op_tensors(args, kwargs)
        if func.is_view or func.overloadpacket not in _LIFTS and host_only(inputs, cuda=False):
            return                                # no launch (a view), or host work: in no graph's trace either
        path = tuple((f.f_code, self.call.get(id(f)), f.f_lineno) for f in reversed(user_frames()))
        self.steps.append(step(func, args, kwargs, path, inputs, self.values))

    # ------------------------------------------------------------------ the served run
    def captured(self, doctor, info, func, args, kwargs) -> None:
        """A captured op: the functions it ran in inside the capture, and the static-input views it
        reads (which are looked at before each replay)."""
        if func.is_view:
            return
        opened = doctor.warm.opened
        path = tuple(f.f_code for f in reversed(frames_within(opened) or [])) if opened is not None else ()
        views = []
        for j, t in enumerate(op_tensors(args, kwargs)):
            buf = doctor.buffer(key := storage_key(t))
            if buf is not None and buf.role == "input":
                views.append((j, buf, key, t.storage_offset(), tuple(t.shape), t.stride()))
                if t.numel() <= SMALL:           # what the capture's own batch gave it: kept at its end
                    self.captured_with.setdefault(id(info), {})[(len(info.paths), j)] = t
        bound = []                               # small tensors it only references: (position, storage, geometry)
        for j, t in enumerate(op_tensors(args, kwargs)):
            key = storage_key(t)
            made_by = doctor.owner_of(key)       # (a tensor another graph's capture made: one it only reads too)
            if (key in info.externals or made_by not in (None, info)) and only_read(doctor.buffer(key)) \
                    and t.numel() <= SMALL:
                bound.append((j, key, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype))
        plain = {v for _, v in numbers(signature(func, args, kwargs))}
        # Where each number came from: a variable of the captured code that held it, else the function
        # that computed it and returned it (passed on directly, never held).
        origins = {v: number_origin((v,), opened) or info.returned_numbers.get(v)
                   for v in plain} if opened is not None else {}
        info.paths.append((len(info.ops), path, tuple(views), origins, tuple(bound)))

    def capture_ended(self, info) -> None:
        """Copies of what the capture's static-input views held (a copy made during a CUDA capture
        would be a node of the graph, run only at replay)."""
        with _disable_current_modes():
            if (views := self.captured_with.get(id(info))) is not None:
                self.captured_with[id(info)] = {view: t.clone() for view, t in views.items()}

    def replay_begin(self, doctor, info) -> None:
        late_refresh.check(self.late, self.writers, self.found)
        pending = info.pending
        if self.span is not None and (pending is None or not pending.span) and info in self.span[0].span:
            return                               # a later piece of a PIECEWISE step: counted at its first
        if pending is not None and pending.real < pending.size:
            self.padded[(pending.size, pending.real)] = (info.name, user_frame())
        if info.name not in self.coverage.chosen and (check := decider(user_frames())) is not None:
            self.coverage.chosen[info.name] = check
        root = self.root(info)
        self.span = (pending, info) if pending is not None and pending.span else None
        if root is None:
            return
        code, under = root
        k = self.served.get(code, 0) + self.replayed.get(code, 0)
        self.replayed[code] = self.replayed.get(code, 0) + 1
        captured_with = self.captured_with.pop(id(info), {})
        if info.name in self.found:
            return
        if capture_batch(info):
            if pending is not None:
                pending.capture_batch = True    # (see ``Pending.capture_batch``)
            return
        first_write: dict = {}                   # a buffer the graph writes is its input only until then
        for n, op in enumerate(info.ops):
            for key in op.writes:
                first_write.setdefault(key, n)
        with _disable_current_modes():
            values = {}
            for i in under:
                at = info.paths[i][0]
                for j, buf, key, offset, shape, stride in info.paths[i][2]:
                    t = buf.ref()
                    if t is not None and storage_key(t) == key and first_write.get(key, at) >= at:
                        values[(i, j)] = (buf, t.as_strided(shape, stride, offset).clone(), (shape, stride, offset))
            if values and all(torch.equal(captured_with.get(view, now.new_empty(0)), now)
                              for view, (_, now, _) in values.items()):
                if pending is not None:          # the capture's own batch again, rewritten with the same data
                    pending.capture_batch = True
                return
        self.at_replay[id(info)] = (k, values, (user_frame(), decider(user_frames())))

    def replay_end(self, doctor, info, pending) -> None:
        if pending is not None:
            self.dropped.served(info, pending)
        if self.span is not None:                # a PIECEWISE step: compared once its last piece has run
            if info is not self.span[0].span[-1]:
                return
            pending, info = self.span
            self.span = None
        entry = self.at_replay.pop(id(info), None)
        if entry is None or pending is None:
            return
        code, under = self.roots[info]
        k, values, replayed = entry
        ops = [info.ops[info.paths[i][0]] for i in under]
        with _disable_current_modes():
            wrote = written_inputs(info)
            match = self._step(code, k, ops, under, values, wrote, info.step is not None)
            if match is None:
                return
            number, ref, compared = match
            raw, blank = leaves(pending.outputs), unwritten_blocks(info, pending)
            outputs = [None if block(o) in blank else real_rows(o, pending.real, pending.size) for o in raw]

            def against(n: int) -> tuple:        # the replay's outputs and reference call n's return, paired
                if (code, n) not in self.returned_values and (left := self.left.get((code, n))):
                    return written_by(outputs, raw, ops, under, self._ops_of(code, n), left)
                return paired(outputs, self.returned_values.get((code, n)), info.returned_paths.get(code), raw)
            got, expected = against(number)
            if (differs := differs_from(got, expected)) is None:
                pending.agreed = comparable(got, expected)
                if pending.agreed:
                    self.outcomes.setdefault(info.name, set()).add(True)
                return
            guessed = compared is None and bool(values)   # static inputs read, and no call agrees with any
            if compared is None:                 # aligned by the count alone: a guess, which a near call may beat
                if any(agrees(*against(n)) for n in calls_near(self.calls[code], k)):
                    return
                compared = compare_views(ops, under, ref, values)
            self.outcomes.setdefault(info.name, set()).add(False)
        if not guessed:                          # (what a guess finds waits for the workload's results)
            release(doctor, info.held, info.held_state)   # what earlier replays' probes found, now borne out
        with _disable_current_modes():           # a PIECEWISE step's other pieces are not in ``ops``: no trace
            by_input = static_input(self.writers, info, compared, pending.size - pending.real,
                                    doctor.carried.captured, stale := [])
            if stale and info.step is not None and not wrote \
                    and (moved := written_elsewhere.found(stale[0], replayed, by_input)):
                by_input, stale = moved, []
            found = by_input or narrower(ops, under, ref, values, doctor.views) or (
                None if pending.span else (
                launched(info, ops, under, ref, pending.size, pending.real < pending.size)
                or bound(self.writers, doctor, info, ops, under, ref, replayed)
                or (other_view(ops, under, ref, replayed) if pending.real == pending.size else None)))
        text = (f"replay {info.replays} of {info.name} ({pending.real} real rows of {pending.size}): output "
                f"{differs[0]} (real rows) differs by max |diff| = {differs[1]:.3g} from the reference run's same "
                f"step (call {self.calls[code].index(number) + 1} of {code.co_name})")
        if found is None:
            if not guessed:
                self.unexplained.append((info.name, f"{text}; neither a static input it reads, its launch trace "
                                                    "(beyond padded rows), a number nor a tensor it only reads "
                                                    "explains it", pending.real < pending.size))
            return
        entry = (info, *found, text, {"replay": info.replays, "output": differs[0], "max_abs_diff": differs[1],
                                      "reference_call": number, "real": pending.real, "size": pending.size})
        if guessed:                              # later replays are still compared: they may be tied to their step
            self.guessed.setdefault(info.name, entry)
            return
        self.found[info.name] = entry
        if by_input is not None:
            self.by_input.add(info.name)
        if stale:
            late_refresh.after_replay(self.late, info.name, stale[0], doctor.report.replays)

    def _step(self, code, k: int, ops: list, under: tuple, values: dict, wrote: set, noted: bool) -> tuple | None:
        """(call number, its ops, its comparisons) of the reference's call of ``code`` that this replay
        serves: the call whose inputs agree with most of the static inputs the graph reads (the
        served run's count of steps breaks a tie: a training loop whose warmup was a real step is one
        ahead); where no call agrees with any (a graph that reads other buffers than the step's eager
        form is given), the k-th, as for a root that reads no static input. What the replay gives is
        not asked: a graph replayed for the wrong step gives another step's answer. Where the step
        wrote static inputs the graph reads (``wrote``), only those tell its step: one left as an
        earlier step wrote it may be what is wrong (a block table left from another request whose
        token and position this step repeats), and must not tie the replay to that step. Where the
        step is known (``noted``) to have written none of them, all its inputs are what an earlier
        step left (a runner binding each step's inputs in tensors the graph does not read): the
        call they match is behind the count, and the call the count gives is the replay's step, if
        its inputs are other ones."""
        best, calls = None, self.calls[code]
        if not values and k < len(calls):         # no static input under the root: the count is all there is
            number = calls[k]
            return number, self._ops_of(code, number), None
        for c, number in sorted(enumerate(calls), key=lambda e: abs(e[0] - k))[:_CANDIDATES]:
            ref = self._ops_of(code, number)
            compared = compare_views(ops, under, ref, values)
            agree = sum(same for _, buf, _, _, same, _ in compared
                        if not wrote or (t := buf.ref()) is not None and storage_key(t) in wrote)
            if agree and (best is None or agree > best[0]):
                best = (agree, number, ref, compared, c)
        if best is None and k < len(calls):      # no call agrees with any: the count is all there is
            return calls[k], self._ops_of(code, calls[k]), None
        if best is not None and noted and not wrote and best[4] < k < len(calls):
            # nothing written since the last replay: the values are an earlier step's, left there
            ref = self._ops_of(code, calls[k])
            compared = compare_views(ops, under, ref, values)
            if compared and not all(same for *_, same, _ in compared):
                return calls[k], ref, compared
        return best[1:4] if best is not None else None

    def _ops_of(self, code, number) -> list:
        if self.by_call is None or self.by_call[0] is not code:
            grouped: dict = {}
            for s in self.steps:
                for c, n, _ in s.path:
                    if c is code:
                        grouped.setdefault(n, []).append(s)
                        break
            self.by_call = (code, grouped)
        return self.by_call[1].get(number, [])

    def results(self, reference: list, served: list) -> None:
        """The workload's verdict (``events.results``): ``compare.verdict``."""
        self.verdict, self.misshaped = verdict(reference, served)

    def conclude(self, doctor) -> None:
        """Findings for the graphs that no other rule found anything in; the replays that differ from
        the reference with no finding for their graph are the report's ``unexplained``. Held findings
        are reported where the workload's results bear them out (``probes.borne_out``)."""
        late_refresh.check(self.late, self.writers, self.found)
        if self.verdict == () and not doctor.report.errors:
            sync.handled(doctor)
        mutation.warm_writes_concluded(doctor, self.warm_writes, agreed=self.verdict == ())
        borne_out(doctor, self.verdict, self.by_input, self.outcomes)
        for name, (_, kind, op, tensor, source, why, text, numbers) in self.found.items():
            unpadded = numbers["real"] == numbers["size"]    # padded rows' findings do not explain such a replay
            if any(name in f.graph.split(", ") and not (unpadded and f.kind in PADDED_ROWS)
                   for f in doctor.report.findings):
                continue
            if self.verdict == ():      # the workload's results agree: its steps were paired otherwise
                doctor.report.note(f"{name}: {text}, but the workload's results agree with its run without "
                                   "graphs: that step is not the replay's (calls paired by their count): "
                                   "not reported")
                continue
            _report(doctor, name, kind, op, tensor, source, why, text, numbers)
        if not doctor.report.findings and self.misshaped:
            padded_result(doctor, self.verdict[0], *self.misshaped, self.padded)
        if not doctor.report.findings and self.verdict:
            reused.report(doctor)
        failed = bool(doctor.failed_ops or doctor.report.errors)
        if not doctor.report.findings and (failed or self.verdict or self.unexplained):
            self.coverage.parted(doctor, self, failed)
        self.failed_calls.report(doctor)
        if not doctor.report.findings and self.verdict:
            self.dropped.report(doctor, self)
        for frozen in (frozen_scalar, host_left.report):     # what a replay cannot see or do, named last
            if not doctor.report.findings and self.verdict:
                frozen(doctor, self.verdict)
        if not doctor.report.findings and self.verdict:     # a replay tied to its step by the count alone: last
            for name, (_, *found) in self.guessed.items():
                _report(doctor, name, *found)
        if not doctor.report.findings and self.verdict and not mutation.unexplained_warm_writes(doctor, self.warm_writes):
            self.coverage.installed(doctor)
        found = {g for f in doctor.report.findings for g in f.graph.split(", ")}
        doctor.report.unexplained += [text for name, text, _ in self.unexplained if name not in found]
        if self.verdict and not doctor.report.findings and not doctor.report.unexplained:
            doctor.report.unexplained.append(f"the workload's result {self.verdict[0]} differs from its run without "
                                             f"graphs' (max |diff| = {self.verdict[1]:.3g}), and no finding explains it")

    def root(self, info) -> tuple | None:
        """(root code, the positions in ``info.paths`` of the ops under it): ``reference_steps.root``."""
        if info not in self.roots:
            self.roots[info] = root(info.paths, self.calls)
        return self.roots[info]


def _report(doctor, name: str, kind: str, op: str, tensor: str, source: str, why: str, text: str, numbers: dict) -> None:
    """The finding for a replay of ``name`` that differs from its step of the run without graphs."""
    doctor.add(Finding(kind, name, op, tensor, source, f"{text}: {why}", explain.reference_run(name, why), numbers),
               (kind, op, source))
