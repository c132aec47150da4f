"""Event intake: what the doctor knows about graphs and buffers, and where each event or op goes.

How the evidence is gathered (the same on both backends, so a report means the same on a GPU):

* **One dispatch mode for the whole block.** During a capture it records each op's reads, writes,
  source line and Python-decided arguments (the capture's launch trace), which storages the capture
  created (its pool) and which it only references (``capture.py``). During a warmup it records the ops run. Outside
  both, it watches eager writes into announced buffers and reads of handed-out outputs. During a
  replay it steps aside, so replays cost almost nothing extra.
* **Events** from the engine and the runners (``workbench.engine.events``) say what a tensor means
  (static buffer, persistent state, shared output, metadata written on purpose), which rows and
  columns are padded, and how to run the step eagerly (the runners' handlers: ``runner_events.py``).
* The **rules** (``rules/``, one module per kind) decide; the **probes** (``probes/``) gather
  evidence that needs extra work: mutation replays, padded-row fills, differential replay.
"""
from __future__ import annotations

import sys

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch._C import _pop_torch_dispatch_stack, _push_on_torch_dispatch_stack
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from ..engine import memory
from ..engine.opinfo import mutable, overwrites, pure_view, storage_key, written_tensors
from ..engine.source import user_frame
from .probes import captured_state, differential, eager_trace, hold, mutation as mutation_probe, padding as padding_probe
from .probes.reference import Reference
from .probes.carried import CarriedInputs
from .probes.startup import Startup
from .records import Buffer, GraphInfo
from . import capture, failures, summary
from .failures import contained
from .report import Finding, Report
from .runner_events import RunnerEvents
from .threads import Threads, filled_off
from .rules import (bounds, clamped, clobbered, dangling, decisions, derived, empty_batch, graph_keys, host_copies, mutation,
                    overwritten, padded_scatter, reused, shapes, staging, sync, uncomputed, undersized, unread, unwritten, warmup)
from .rules.pool import PoolReads
from .tensors import first_line

aten = torch.ops.aten
_SLICE, _COPY = aten.slice.Tensor, aten.copy_.default    # looked up once: ``aten.x.y`` costs ~0.4 µs
_ASIDE = ("replay", "probe", "done")  # phases in which the dispatch mode is off the hot path ("done": after
# the watch, on a worker thread whose warmup or capture never ended: ``threads.py``)
_QUIET = ("probe", "differential")    # phases whose events are the doctor's own doing


class Doctor(RunnerEvents):
    """The observer behind ``watch()``; subscribed to ``workbench.engine.events``."""

    def __init__(self, *, guard: bool = False, pattern: int | None = None, differential: int = 0) -> None:
        if isinstance(differential, bool) or not isinstance(differential, int) or differential < 0:
            raise ValueError(f"differential must be a whole number >= 0 (0: off, N: every Nth replay), "
                             f"got {differential!r}")
        self.report = Report()
        self.guard = guard
        self.pattern = pattern                      # diagnose's padded-row fill (0 or 1), else None
        self.every = differential
        # Every capture's record, in capture order: a released graph's stays (what it held is reported),
        # and a new graph given a released one's id does not take its place.
        self.graphs: dict[int, GraphInfo] = {}      # capture number -> its record
        self.current: dict[int, int] = {}           # id(graph) -> the number of its latest capture
        self.buffers: dict[int, Buffer] = {}
        self.owned: dict[int, tuple[StorageWeakRef, GraphInfo]] = {}
        self.capturing: GraphInfo | None = None
        self.phase = "eager"                        # eager | warmup | capture | replay | probe | differential
        self.real_warmup = False                    # the current warmup is a real step (events.warmup(real=True))
        self.dummy_run = False                      # eager code on a capture's dummy batch (events.dummy_run)
        self.trained = False                        # the current warmup ran a backward pass: a training step
        self.warm = warmup.Warmups()                # warmups, and the captures they prepare
        self.updates: dict[int, dict[tuple, list]] = {}    # rules.mutation: eager in-place updates
        self.fresh: dict[int, torch.Tensor] = {}    # elements rewritten outside graphs since the last replay
        self.unprobed = 0                           # graphs writing a static input, not yet probed
        self.initial: dict[int, torch.Tensor] = {}  # persistent state as announced, with what warmups wrote since
        self.announced: dict[int, torch.Tensor] = {}    # ... as announced (what a runner restores after warmups)
        self.warm_saved: dict[int, tuple] = {}      # persistent state before the current warmup wrote it
        self.warm_updates: dict[int, Finding] = {}  # static input -> a warmup building on an earlier one's update
        self.computed_from: dict[int, tuple] = {}   # rules/derived.py: what set-up code computed each storage from
        self.copied, self.copied_lines = {}, {}    # rules/unread.py: copied into static inputs since a replay; per line
        self.aimed: dict[int, list] = {}            # rules/padded_scatter.py: scatter indices -> the step's writes
        self.before_replay: dict[int, torch.Tensor] = {}    # rules/mutation.py: static inputs a graph writes, before it
        self.replay_wrote: dict[int, tuple] = {}    # ... -> (graph, elements its last replay changed)
        self.copy_sources: dict[int, tuple] = {}    # ... -> the tensor the last copy into it took, as it was
        self.unread: dict[int, tuple] = {}          # ... copied, not read by the graph replayed since: held
        self.staged: dict[int, object] = {}         # rules/staging.py: pinned storage -> what lines staged, unread
        self.unread_noted: dict[tuple, list] = {}   # (graph, input) -> [its note's index, replays, elements]
        self.unread_dropped: list = []              # dropped copies waiting for the workload's results (unread.py)
        self.startup = Startup()                    # what warmups wrote into memory older than them
        self.carried = CarriedInputs()              # what steps wrote into static inputs (differential)
        self.pool = PoolReads()                     # pool memory read across graphs
        self.graph_writes: set[int] = set()         # external storages some graph writes
        self.graph_reads: set[int] = set()          # ... or reads (of graphs captured while watched)
        self.host_reads: set[int] = set()           # host memory captured copies re-read by address
        self.touched: dict[int, str] = {}           # of those two, written outside graphs since: -> source line
        self.empty_inputs: list = []                # (finding, key) of empty capture inputs, until data is served
        self.empty_batch = empty_batch.EmptyBatch() # warmups and captures that cut no rows
        self.clamped = clamped.Clamped()            # slices past their tensor's end
        self.handed: dict[int, tuple] = {}          # rules.overwritten
        self.moved: dict[int, str] = {}             # storages given other memory in place -> where (rules.dangling)
        self.through: dict[int, tuple] = {}         # rules.extent: views past their base, followed
        self.generation: dict[tuple, int] = {}      # memory block -> replays that wrote it (handed-out ones)
        self.writers: dict[tuple, tuple] = {}       # memory block -> (graph, its replay) that wrote it last
        self.handed_any, self.padded_steps, self.unknown_replays = False, 0, 0
        self.served = self.no_eager = self.compared = 0     # steps served, of them without an eager form, compared
        self.real_writes: dict[int, tuple] = {}   # probes/unpadded.py: state -> (dtype, elements real rows wrote)
        self.replay_changed: dict[int, torch.Tensor] = {}   # probes/row_writes.py: state elements replays changed
        self.replay_left: dict[int, torch.Tensor] = {}      # ... and the state as the last compared replay left it
        self.padded_left: dict[int, tuple] = {}     # ... and live data padded rows overwrote, not yet read back
        self.state_moved = False     # eager code wrote persistent state since a padded step's rows were last watched
        self.trace: list[dict] = []                 # per replay, under diagnose's padded-row probes
        self.diff = None                            # the eager run of a differential replay
        self.spanning = None                        # (first piece, Pending) of a PIECEWISE step being compared
        self.replay_error: tuple | None = None      # (error, where) of a replay that raised
        self.plan = None                            # diagnose's record of the steps served (probes/padding.py)
        self.padded_step = None                     # the last padded replay, its outputs (rules/shapes.py)
        self.mode = None                            # set by watching()
        self.threads = Threads()                    # other threads the mode is entered on (threads.py)
        self.stepped_aside = self.engine_serving = False   # our mode is off for this replay; an engine op runs
        self.fill = None                            # eager allocations' deterministic fill (uninit.py)
        self.failure: str | None = None             # the doctor's own error, once it has stopped
        self.failed_ops, self.failed_codes = {}, set()  # id(error) -> what an op raised; the functions raising
        self.op_error: int | None = None            # id of the last error an op raised (composite.py: seen once)
        self.derivations: dict[int, list] = {}      # tensors eager code computed from graph memory (reused.py)
        self.reused: Finding | None = None         # ... one read again after a replay rewrote its source
        self.input_writes: dict[int, tuple] = {}    # static input -> (code that wrote data, last reset, step: clobbered.py)
        self.setup_writes, self.set_up_data = {}, set()   # set-up's writers per storage; its data in state not yet announced
        self.upload_guard = None                    # entered around a CUDA capture (rules/sync.py)
        self.explanation: tuple | None = None       # (id(error), finding, key) until it proves a failure (failures.py)
        self.pools: dict = {}                       # pool key -> (line that made the handle, graphs captured into it)
        self.found: dict[tuple, tuple] = {}          # each hazard once (``add``), by its key: (it, its graphs)
        self.reference: Reference | None = None     # the workload's run without graphs (probes/reference.py)
        self.views: dict[tuple, str] = {}           # set-up views: (storage, offset, shape, stride) -> the line
        self.replay_paths: dict = {}                # code of a function that asked for a replay -> the graph
        self.holding: list | None = None            # where ``add`` puts findings while they are held
        self.uncomputed: dict[tuple, GraphInfo] = {}    # pool blocks a capture allocated, no replay wrote yet
        self.followed: dict = {}                    # ... and those eager code computed from them (rules/uncomputed.py)

    # ------------------------------------------------------------------ shared lookups
    def add(self, finding: Finding, key: tuple) -> Finding:
        """Record a finding once; the same hazard in another graph adds that graph's name."""
        if self.holding is not None:           # a probe's finding held until a replay disagrees (differential)
            hold(self, finding, key)
            return finding
        if key not in self.found:
            self.found[key] = (finding, {finding.graph})
            self.report.findings.append(finding)
            return finding
        known, graphs = self.found[key]
        if finding.graph not in graphs:              # (a set: a graph's name may hold ", " itself)
            graphs.add(finding.graph)
            known.graph = f"{known.graph}, {finding.graph}"
        return known

    def info(self, graph) -> GraphInfo | None:
        info = self.graphs.get(self.current.get(id(graph), -1))
        return info if info is not None and info.ref() is graph else None

    def owner_of(self, key: int) -> GraphInfo | None:
        entry = self.owned.get(key)
        return entry[1] if entry is not None and not entry[0].expired() else None

    def buffer(self, key: int) -> Buffer | None:
        return buf if (buf := self.buffers.get(key)) is not None and buf.ref() is not None else None

    @property
    def tracking_fresh(self) -> bool:
        return self.unprobed > 0 or self.pattern is not None or self.every > 0

    def fail(self, error: Exception, where: str) -> None:
        """The doctor's own code raised: stop watching, keep the findings made so far, and report
        where it broke (so the failure can be reported upstream) and what went unchecked."""
        self.failure = self.report.failure = failures.own_error(error, where)

    # ------------------------------------------------------------------ engine events
    @contained
    def capture_begin(self, graph, name: str | None) -> None:
        self.threads.enter(self.mode, sum(isinstance(m, TorchDispatchMode) for m in getattr(graph, "_modes", ())))
        if self.info(graph) is not None:            # the same graph captured again: the new capture replaces it
            del self.graphs[self.current[id(graph)]]
        info = GraphInfo(graph, name or f"graph #{len(self.graphs) + 1}")
        graph_keys.capture_begin(info)
        self.warm.capture_begin(info)
        self.current[id(graph)] = self.report.captures
        self.graphs[self.report.captures] = info
        self.capturing, self.phase = info, "capture"
        self.report.captures += 1
        self.upload_guard = sync.guard_uploads(info)

    def capture_end(self, graph) -> None:
        sync.leave_guard(self)                      # (even after the doctor's own failure)
        self._capture_end(graph)

    @contained
    def _capture_end(self, graph) -> None:
        self.threads.leave(self.mode)
        info = self.capturing
        self.capturing, self.phase = None, "eager"
        self.fresh.clear()
        if info is None:
            return
        filled_off(info)
        if info.refused is not None:               # caught in the capture, which CUDA would not end
            sync.refused_earlier(self, info)
        if info.warmup is not None and not info.ops:
            self.warm.hand_on(info)
            return
        self.pool.settle(info)
        undersized.captured(self, info)
        info.liveness.watch(info.externals)        # from now: a release is seen where it happens
        self.graph_writes.update(info.writes)
        self.graph_reads.update(info.externals)
        host_copies.capture_end(self, info)
        for key in info.writes:
            self.touched.pop(key, None)
        if any(self.buffer(k) is not None and self.buffer(k).role == "input" for k in info.writes):
            self.unprobed += 1
            info.writes_inputs = True
        self.warm.capture_end(info)
        if self.every:
            self.carried.capture_end(self, info)
            captured_state.captured(info)
            uncomputed.captured(self, info)
        derived.captured(self, info)
        if self.reference is not None:
            self.reference.coverage.captured(info)
            self.reference.capture_ended(info)
        unread.capture_end(self, info)
        self.copied.clear()
        self.copied_lines.clear()

    def capture_abort(self, graph, error: BaseException) -> None:
        sync.leave_guard(self)
        self._capture_abort(graph, error)

    @contained
    def _capture_abort(self, graph, error: BaseException) -> None:
        self.threads.leave(self.mode)
        info = self.capturing
        self.capturing, self.phase = None, "eager"
        self.warm.capture_abort(info)
        name = info.name if info is not None else "a graph"
        self.report.note(f"capture of {name} failed: {type(error).__name__}: {first_line(error)}")
        sync.capture_failed(self, name, error, info)

    @contained
    def replay_begin(self, graph) -> None:
        if self.phase in _QUIET or self.capturing is not None:
            return              # (a replay asked inside a capture is refused, by CUDA and the CPU engine: no step)
        self.warm.captures_over()
        info = self.info(graph)
        if info is None:
            self.unknown_replays += 1
        else:
            if self.updates:
                mutation.replayed(self, info)
            dangling.check(self, info, before_replay=True)
            if info.expects:
                self.pool.check(self, info)
            if not info.replays:
                decisions.replayed(self, info)
            if not info.probed:
                mutation_probe.probe(self, info, graph)
            if self.pattern is not None:
                padding_probe.record_inputs(self, info)
            padded_scatter.check(self, info)
            if info.derived:
                derived.check(self, info)
            if self.copied or self.unread:
                unread.check(self, info)
            staging.replayed(self, info)
            if self.every:
                self.carried.replay_begins(self, info)
            if info.pending is not None and info.pending.differential and not info.pending.span:
                differential.begin(self, info)
            if info.writes_inputs:
                mutation.inputs_before(self, info)
            if self.reference is not None and not self.reference.recording:
                self.reference.replay_begin(self, info)
        self.phase = "replay"
        # Step aside: a CPU replay runs many ops (a CUDA graph's replay dispatches none).
        if (info is None or not info.cuda) and _get_current_dispatch_mode() is self.mode:
            _pop_torch_dispatch_stack(None)     # what ``_pop_mode`` does for a mode without a key
            self.stepped_aside = True
            if self.fill is not None:
                self.fill.pause()

    @contained
    def replay_end(self, graph) -> None:
        if self.phase in _QUIET or self.capturing is not None:
            return
        if self.stepped_aside:
            _push_on_torch_dispatch_stack(self.mode)
            self.stepped_aside = False
            if self.fill is not None:
                self.fill.resume()
        self.phase = "eager"
        self.report.replays += 1
        self.fresh.clear()
        self.copied.clear()
        self.copied_lines.clear()
        info = self.info(graph)
        error = sys.exc_info()[1]
        if info is None:
            return
        if error is not None:
            self.replay_error = (error, failures.recorded_op(error, info.name))
            failures.replay_failed(self, info, error, self.replay_error[1])
        info.replays, info.replayed_at = info.replays + 1, self.report.replays
        if self.uncomputed:
            uncomputed.replayed(self, info)
        if self.before_replay:
            mutation.inputs_after(self, info)
        overwritten.replayed(self, info)
        self.pool.replayed(info)
        pending, info.pending = info.pending, None
        if self.reference is not None and error is None:
            self.reference.replay_end(self, info, pending)
        if self.pattern is not None:
            padding_probe.record_outputs(self, info, pending)
        shapes.replayed(self, info, pending)
        if pending is not None and pending.differential and error is not None and not pending.span:
            differential.failed(self, info, pending, error)
        if pending is not None and pending.differential and error is None:
            if pending.span and pending.span[-1] is not info:
                self.spanning = (info, pending)           # compared after the step's last piece
            else:
                differential.finish(self, info, pending)
        elif self.spanning is not None and self.spanning[1].span[-1] is info:
            first, self.spanning = self.spanning, None
            if error is None:
                differential.finish(self, *first)
        self.startup.replayed(info)

    # ------------------------------------------------------------------ the dispatch mode's work
    def targets(self, func, args, kwargs) -> list:
        """The announced buffers an op writes: ``[(key, written view, Buffer)]``."""
        if not self.buffers or not mutable(func):
            return []
        buffers = self.buffers
        return [(key, t, buf) for t in written_tensors(func, args, kwargs)
                if (buf := buffers.get(key := storage_key(t))) is not None and buf.ref() is not None]

    def on_op(self, func, args, kwargs, run):
        phase = self.phase
        if phase == "differential":
            return eager_trace.on_op(self, func, args, kwargs, run)
        if self.staged and not func.is_view:
            staging.read(self, func, args, kwargs)
        if func is _SLICE:
            undersized.check_slice(self, args)
        if phase == "eager" and pure_view(func):       # the hot path: eager code taking a view
            out = run()
            if self.handed:
                overwritten.tag_view(self, func, args[0], out)
            if self.every and not self.report.replays and isinstance(out, torch.Tensor):
                unread.view_taken(self, out)            # set-up: where the views a capture reads were taken
            return out
        if phase == "capture":
            return capture.recorded(self, func, args, kwargs, run)
        if self.reference is not None:
            self.reference.eager_op(self, func, args, kwargs)
        targets = self.targets(func, args, kwargs)
        if targets and phase == "eager" and (self.every or not self.report.replays):   # (set-up, or sampling)
            clobbered.wrote(self, func, targets)
        if targets and self.every and phase == "eager":
            self.carried.wrote(self, func, args, targets)
        if targets and self.aimed and phase == "eager":
            padded_scatter.aimed(self, targets)
        if targets and func is _COPY:
            undersized.check_fit(self, args[0], args[1])
            padding_probe.copied(self, args[0], args[1])
            if self.graph_writes and phase == "eager" and storage_key(args[0]) in self.graph_writes:
                mutation.copied_over(self, args[0], args[1])
            if self.every and phase == "eager":
                unread.copied(self, targets, args[1])
        if phase == "warmup":
            bounds.check(func, args, kwargs, run)       # (on CUDA: the CPU's IndexError, not a device assert)
            self.trained = self.trained or torch._C._current_graph_task_id() != -1 or mutable(func) and any(
                t.is_leaf and t.grad is not None for t in written_tensors(func, args, kwargs))   # see warmup_end
            if not self.real_warmup:                   # a dummy batch's writes into live memory are suspect
                mutation.dummy_write(self, func, args, kwargs, targets)
            # (an update: does the next warmup build on it?)
            out = mutation.write(self, func, args, kwargs, run, targets, not overwrites(func, args, kwargs))
            if not func.is_view:
                self.warm.warmup_op(func, args, kwargs, self.startup.constant, out)
                self.startup.created_by(args, kwargs, out)
                if self.unread or self.copied:      # an eager run of a step (ggml's warmup) uses its inputs
                    unread.touched(self, func, args, kwargs)
            memory.record_new_storages(func, args, kwargs, out)
            return out
        view = func.is_view
        if self.handed and not view:
            overwritten.check_read(self, func, args, kwargs)
        if self.pattern is not None and self.fresh and not view:
            padding_probe.consumed(self, func, args, kwargs)
        if not view:
            self.warm.eager_op()
            if not self.report.replays and phase == "eager" and mutable(func):
                unwritten.wrote(self, func, args, kwargs)
        if self.dummy_run:                         # dummy data, as a warmup's
            mutation.dummy_write(self, func, args, kwargs, targets)
        elif mutable(func) and (self.graph_writes or self.startup.kept or self.host_reads):
            self.startup.wrote(func, args, kwargs)
            for t in written_tensors(func, args, kwargs):
                if (key := storage_key(t)) in self.graph_writes or key in self.host_reads:
                    self.touched[key] = user_frame()
        staged = staging.before_write(func, args, kwargs) if phase == "eager" and mutable(func) else None
        if not targets:
            out = run()
        else:
            if self.every and not self.state_moved:     # (only differential replay asks)
                self.state_moved = any(buf.role == "state" for _, _, buf in targets)
            # (else a refresh, copy or fill, that no fresh-element tracking or in-place update follows)
            out = mutation.write(self, func, args, kwargs, run, targets,
                                 self.tracking_fresh or self.updates or not overwrites(func, args, kwargs))
        staging.wrote(self, func, staged)
        if (self.uncomputed or self.followed) and not view and phase == "eager" and not self.dummy_run:
            uncomputed.eager_op(self, func, args, kwargs, out)
        if self.reference is not None and self.every and not view and phase == "eager" and self.pool.producer:
            for x in args:
                if id(x) in self.derivations:
                    reused.read(self, func, x)
            reused.derived(self, func, args, kwargs, out)
        if self.padded_step is not None and not view:
            shapes.derived(self, func, args, kwargs, out)
        if self.pattern is not None and not view:
            padding_probe.state_read(self, func, args, kwargs, out)
        if (self.unread or self.copied) and not view:
            unread.touched(self, func, args, kwargs)
        if view:
            if self.handed:
                overwritten.tag_view(self, func, args[0], out)
        else:                                       # a view creates no storage
            memory.record_new_storages(func, args, kwargs, out)
            if not self.report.replays:             # set-up: what is computed from what
                derived.record(self, func, args, kwargs, out)
        return out

    # ------------------------------------------------------------------ the end
    def finish(self) -> Report:
        if self.failure is None:
            uncomputed.finish(self)
            if self.reference is not None:
                self.reference.conclude(self)
        report = summary.finish(self)
        self.phase = "done"
        return report
