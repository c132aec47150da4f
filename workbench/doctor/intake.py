"""``watch()``: observe every capture, warmup and replay, probe where evidence is needed, report.

How the evidence is gathered (the same on both backends, so a report means the same on a GPU):

* **One dispatch mode for the whole block.** During a capture it records each op's read and write
  storages and source line, which storages the capture created (the graph's pool) and which it
  only references (with where they were created: the doctor tracks origins). During a warmup it
  records the ops run. Outside both, it watches eager reads of handed-out graph outputs and copies
  into static buffers. During a replay it steps aside, so replays cost almost nothing extra.
* **Events** from the engine and the runners (``workbench.engine.events``) say what a tensor is
  (a static buffer, by name), which rows are padded, and when a replay starts.
* **Active probes.** Before a graph's first replay: liveness of every storage it references, and,
  if it writes a static buffer, two extra replays (then everything restored) to tell accumulating
  writes from self-cancelling ones. ``diagnose`` adds whole-run probes of the padded rows.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import time
import traceback
import weakref
from collections import Counter
from collections.abc import Iterator

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _disable_current_modes,
    _get_current_dispatch_mode,
    _pop_mode,
    _push_mode,
)

from ..engine import events, memory
from ..engine.cpu_graph import (
    _written_tensors,
    describe,
    host_sync_error,
    is_host_sync,
    storage_key,
)
from ..engine.errors import CaptureError, GraphError
from ..engine.source import user_frame
from . import explain
from .findings import KINDS, Finding, Report

aten = torch.ops.aten
_expired = torch.UntypedStorage._expired    # what StorageWeakRef.expired() calls, minus a Python frame
# In-place ops that write without reading their destination: a runner refreshing its buffers.
_OVERWRITES = frozenset({aten.copy_, aten.fill_, aten.zero_, aten.index_put_, aten.index_fill_,
                         aten.masked_fill_, aten.set_, aten.resize_, aten.random_, aten.uniform_, aten.normal_})


class DanglingReferenceError(GraphError):
    """Raised by ``watch(guard=True)`` instead of a replay that would read released memory."""

    def __init__(self, finding: Finding) -> None:
        super().__init__(f"replay stopped by the graph doctor: {finding.evidence}\n  read by {finding.op} at "
                         f"{finding.source}\n  {finding.cause}")
        self.finding = finding


# What the doctor raises on purpose, into the watched code: a guarded replay, a host sync refused
# during a CUDA capture (as the CPU engine refuses it). Anything else it raises is its own failure.
_DELIBERATE = (DanglingReferenceError, CaptureError)


def _contained(handler):
    """An event handler whose own failure is reported, not raised into the watched code: a
    diagnostic must never break what it diagnoses. After a failure the doctor stops watching."""
    @functools.wraps(handler)
    def run(self, *args, **kwargs):
        if self.failure is not None:
            return None
        try:
            return handler(self, *args, **kwargs)
        except _DELIBERATE:
            raise
        except Exception as e:  # noqa: BLE001 - the doctor's own error, reported in the Report
            self.fail(e, handler.__name__)
            return None
    return run


class _Call:
    """The watched op, run at most once whatever the doctor does around it (an in-place op run
    twice after a failure of the doctor would corrupt the user's data)."""

    __slots__ = ("func", "args", "kwargs", "done", "out", "error")

    def __init__(self, func, args, kwargs) -> None:
        self.func, self.args, self.kwargs = func, args, kwargs
        self.done, self.out, self.error = False, None, None

    def __call__(self):
        try:
            self.out = self.func(*self.args, **self.kwargs)
        except BaseException as e:
            self.error = e
            raise
        self.done = True
        return self.out

    def result(self):
        return self.out if self.done else self()


@dataclasses.dataclass(frozen=True)
class _Op:
    name: str
    source: str
    reads: frozenset = frozenset()
    writes: frozenset = frozenset()


@dataclasses.dataclass
class _External:
    """A storage a graph reads or writes without owning it."""

    weak: StorageWeakRef
    tensor: str
    op: str
    source: str
    origin: str | None
    view_only: bool
    reported: bool = False


@dataclasses.dataclass
class _Buffer:
    name: str
    owner: str
    ref: weakref.ref


class _GraphInfo:
    def __init__(self, graph, name: str) -> None:
        self.ref = weakref.ref(graph)
        self.name = name
        self.cuda = not hasattr(graph, "ops")       # a torch.cuda.CUDAGraph exposes no op list
        self.ops: list[_Op] = []
        self.externals: dict[int, _External] = {}
        self.cdatas: tuple[int, ...] = ()           # the externals' weak references, for a fast check
        self.writes: dict[int, _Op] = {}            # external storage -> first op writing it
        self.warmup: list[_Op] | None = None        # the first warmup run before this capture
        self.eager_lines: set[str] = set()          # lines run eagerly after that warmup, outside the capture
        self.replays = 0
        self.probed = False
        self.pending: tuple | None = None           # (real, size, outputs, padded names) of the next replay


class Doctor:
    """The observer behind ``watch()``; subscribed to ``workbench.engine.events``."""

    def __init__(self, *, guard: bool = False, pattern: int | None = None) -> None:
        self.report = Report()
        self.guard = guard
        self.pattern = pattern                      # diagnose's padded-row fill (0 or 1), else None
        self.graphs: dict[int, _GraphInfo] = {}
        self.buffers: dict[int, _Buffer] = {}
        self.owned: dict[int, StorageWeakRef] = {}
        self.capturing: _GraphInfo | None = None
        self.capture_outputs: list[torch.Tensor] = []
        self.phase = "eager"                         # eager | warmup | capture | replay | probe
        self.warmup_runs: list[list[_Op]] = []
        self.eager_lines: set[str] = set()           # source lines run eagerly between a warmup and its capture
        # In-place updates of static buffers outside the graphs: (op, line, buffer name) -> [the
        # elements its last call wrote that nobody has written since, calls]; by buffer storage.
        self.updates: dict[int, dict[tuple, list]] = {}
        self.handed: dict[int, tuple[weakref.ref, _GraphInfo, int]] = {}
        self.handed_any = False
        self.padded_steps = 0
        self.unknown_replays = 0
        self.trace: list[dict] = []                  # per replay, under diagnose's padded-row probes
        self.mode: TorchDispatchMode | None = None   # set by watching()
        self.stepped_aside = False                   # our mode is off the stack for this replay
        self.failure: str | None = None              # the doctor's own error, once it has stopped
        self._keys: dict[tuple, Finding] = {}

    # ------------------------------------------------------------------ findings
    def add(self, finding: Finding, key: tuple) -> Finding:
        """Record a finding once; the same hazard in another graph adds that graph's name."""
        known = self._keys.get(key)
        if known is None:
            self._keys[key] = finding
            self.report.findings.append(finding)
            return finding
        if finding.graph not in known.graph.split(", "):
            known.graph = f"{known.graph}, {finding.graph}"
        return known

    def _info(self, graph) -> _GraphInfo | None:
        info = self.graphs.get(id(graph))
        return info if info is not None and info.ref() is graph else None

    def _owns(self, key: int) -> bool:
        weak = self.owned.get(key)
        return weak is not None and not weak.expired()

    def _buffer(self, key: int) -> _Buffer | None:
        buf = self.buffers.get(key)
        return buf if buf is not None and buf.ref() is not None else None

    def _tensor_name(self, key: int, fallback: str) -> str:
        buf = self._buffer(key)
        return f"{buf.name}: {describe(buf.ref())}" if buf is not None else fallback

    def fail(self, error: Exception, where: str) -> None:
        """The doctor's own code raised: stop watching, keep the findings made so far, and report
        where it broke (so the failure can be reported upstream) and what went unchecked."""
        frame = traceback.extract_tb(error.__traceback__)[-1] if error.__traceback__ else None
        at = f" at {frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}" if frame else ""
        self.failure = self.report.failure = f"{type(error).__name__} in {where}{at}: {_first_line(error)}"

    # ------------------------------------------------------------------ engine events
    @_contained
    def capture_begin(self, graph, name: str | None) -> None:
        info = _GraphInfo(graph, name or f"graph #{len(self.graphs) + 1}")
        info.warmup = self.warmup_runs[0] if self.warmup_runs else None
        info.eager_lines, self.eager_lines = self.eager_lines, set()
        self.warmup_runs = []
        self.graphs[id(graph)] = info
        self.capturing = info
        self.phase = "capture"
        self.report.captures += 1

    @_contained
    def capture_end(self, graph) -> None:
        info = self.capturing
        self.capturing, self.phase, self.capture_outputs = None, "eager", []
        if info is not None and info.warmup is not None:
            self._check_warmup(info)

    @_contained
    def capture_abort(self, graph, error: BaseException) -> None:
        info = self.capturing
        self.capturing, self.phase, self.capture_outputs = None, "eager", []
        name = info.name if info is not None else "a graph"
        self.report.notes.append(f"capture of {name} failed: {type(error).__name__}: {_first_line(error)}")
        if isinstance(error, CaptureError) and error.op is not None:
            self._sync_finding(name, error.op, error.source or "<unknown>")

    @_contained
    def replay_begin(self, graph) -> None:
        if self.phase == "probe":
            return
        info = self._info(graph)
        if info is None:
            self.unknown_replays += 1
        else:
            for key in info.writes.keys() & self.updates.keys():     # the graph writes a tracked buffer
                if (buf := self._buffer(key)) is not None:
                    with _disable_current_modes():
                        whole = buf.ref()
                        self._rewritten(key, torch.ones(whole.shape, dtype=torch.bool, device=whole.device))
            self._check_liveness(info, before_replay=True)
            if not info.probed:
                self._probe_mutations(info, graph)
            if self.pattern is not None:
                self._record_inputs(info)
        self.phase = "replay"
        if _get_current_dispatch_mode() is self.mode:    # step aside: a CPU replay runs many ops
            _pop_mode()
            self.stepped_aside = True

    @_contained
    def replay_end(self, graph) -> None:
        if self.phase == "probe":
            return
        if self.stepped_aside:
            _push_mode(self.mode)
            self.stepped_aside = False
        self.phase = "eager"
        self.report.replays += 1
        info = self._info(graph)
        if info is not None:
            info.replays += 1
            if self.pattern is not None:
                self._record_outputs(info)
            info.pending = None

    # ------------------------------------------------------------------ runner events
    @_contained
    def static_buffers(self, owner: str, buffers: dict) -> None:
        for name, t in buffers.items():
            self.buffers[storage_key(t)] = _Buffer(name, owner, weakref.ref(t))
        empty = {name: t for name, t in buffers.items() if 0 in t.shape}
        if not empty:
            return
        # One finding per announcement: the inputs of one capture are sized by one computation, so
        # several empty ones share one cause. It points at the first; the evidence lists them all.
        name, t = next(iter(empty.items()))
        op, source = memory.created_by(t) or ("-", "<created before watch()>")
        evidence = "; ".join(f"{n} has shape {tuple(x.shape)}: dimension {list(x.shape).index(0)} is 0"
                             for n, x in empty.items())
        if len(empty) > 1:
            evidence = f"{len(empty)} of {len(buffers)} capture inputs are empty: {evidence}"
        self.add(Finding(
            "undersized-buffer", f"capture inputs of {owner}", op, f"{name}: {describe(t)}", source, evidence,
            explain.zero_sized(name, tuple(t.shape)), {"shape": list(t.shape), "empty_inputs": list(empty)}),
            ("undersized-buffer", owner, name))

    @_contained
    def warmup_begin(self) -> None:
        self.phase = "warmup"
        self.warmup_runs.append([])
        self.report.warmups += 1

    @_contained
    def warmup_end(self) -> None:
        self.phase = "eager"

    @_contained
    def serve(self, graph, real: int, size: int, padded: dict, outputs) -> None:
        if padded and real < size:
            self.padded_steps += 1
            if self.pattern is not None:
                _fill_padded(padded, real, size, self.pattern)
        info = self._info(graph)
        if info is not None:
            info.pending = (real, size, outputs, padded)

    @_contained
    def handed_out(self, graph, tensors) -> None:
        info = self._info(graph)
        if info is None:
            return
        self.handed_any = True
        for t in (tensors if isinstance(tensors, (tuple, list)) else (tensors,)):
            self._tag(t, info, info.replays)

    def _tag(self, t: torch.Tensor, info: _GraphInfo, generation: int) -> None:
        key = id(t)

        def forget(ref, key=key):
            if self.handed.get(key, (None,))[0] is ref:
                del self.handed[key]
        self.handed[key] = (weakref.ref(t, forget), info, generation)

    # ------------------------------------------------------------------ the dispatch mode's work
    def on_op(self, func, args, kwargs, run: _Call):
        phase = self.phase
        if phase == "capture":
            return self._captured(func, args, kwargs, run)
        if phase == "warmup":
            out = run()
            if not func.is_view:
                self.warmup_runs[-1].append(_Op(str(func), user_frame()))
            memory.record_new_storages(func, args, kwargs, out)
            return out
        if self.handed and not func.is_view:
            self._check_stale_read(func, args, kwargs)
        if func is aten.copy_.default and self.buffers:
            self._check_fit(args[0], args[1])
        if self.warmup_runs and not func.is_view:     # between a warmup and its capture
            self.eager_lines.add(user_frame())
        if self.buffers and func._schema.is_mutable and (self.updates or func.overloadpacket not in _OVERWRITES):
            return self._eager_write(func, args, kwargs, run)
        out = run()
        if self.handed and func.is_view and isinstance(out, torch.Tensor):
            entry = self.handed.get(id(args[0]))     # a view of a handed-out output is one too
            if entry is not None and entry[0]() is args[0]:
                self._tag(out, entry[1], entry[2])
        memory.record_new_storages(func, args, kwargs, out)
        return out

    def _captured(self, func, args, kwargs, run: _Call):
        info = self.capturing
        source = user_frame()
        if is_host_sync(func, args) or _device_to_host(func, args, kwargs):
            self._sync_finding(info.name, str(func), source)
            if info.cuda:       # stop before CUDA invalidates the capture, as the CPU engine does
                raise host_sync_error(str(func), source)
        inputs = list(_tensors((args, kwargs)))
        in_keys = {storage_key(t) for t in inputs}
        written = frozenset(storage_key(t) for t in _written_tensors(func, args, kwargs))
        out = run()
        if func.overloadpacket in (aten.lift_fresh, aten.lift_fresh_copy):
            for t in inputs:                          # a constant of the captured code: the graph keeps it
                self.owned[storage_key(t)] = StorageWeakRef(t.untyped_storage())
        op = _Op(str(func), source, frozenset(in_keys), written)
        for t in inputs:
            key = storage_key(t)
            if self._owns(key):
                continue
            ext = info.externals.get(key)
            if ext is None:
                info.externals[key] = _External(StorageWeakRef(t.untyped_storage()), describe(t), str(func),
                                                source, memory.origin_of(t), func.is_view)
            elif ext.view_only and not func.is_view:      # name the first op that really reads it
                ext.op, ext.source, ext.tensor, ext.view_only = str(func), source, describe(t), False
        for key in written:
            if not self._owns(key):
                info.writes.setdefault(key, op)
        for o in _tensors(out):
            key = storage_key(o)
            if key not in in_keys and not self._owns(key):
                self.owned[key] = StorageWeakRef(o.untyped_storage())
                self.capture_outputs.append(o)
        if not func.is_view:
            info.ops.append(op)
        return out

    # ------------------------------------------------------------------ rules
    def _sync_finding(self, graph: str, op: str, source: str) -> None:
        self.add(Finding("sync-in-capture", graph, op, "-", source,
                         f"{op} was called while {graph} was being captured", explain.sync(op)),
                 ("sync-in-capture", op, source))

    def _check_warmup(self, info: _GraphInfo) -> None:
        """Ops of source lines the fresh warmup ran and the capture never executed: Python skipped
        them at capture (lazy work already done). A line that ran in both but dispatched other
        kernels (a backend choosing another algorithm under capture) is not a skipped step, nor is
        one the runner ran eagerly before the capture (code it keeps outside the graph, as
        PIECEWISE graphs do: whether that code is safe is the eager-update rule's question)."""
        ran_since = {op.source for op in info.ops} | info.eager_lines
        missing = [op for op in info.warmup if op.source not in ran_since]
        if not missing:
            return
        first = missing[0]
        lines = Counter(op.source.split(": ", 1)[0] for op in missing)
        self.add(Finding(
            "warmup-divergence", info.name, first.name, "-", first.source,
            f"the warmup ran {len(info.warmup)} ops, the capture recorded {len(info.ops)}; {len(missing)} warmup ops "
            f"come from {len(lines)} source line(s) the capture never executed: "
            + ", ".join(f"{k} (x{v})" for k, v in lines.items()),
            explain.warmup(len(missing), first.name),
            {"warmup_ops": len(info.warmup), "captured_ops": len(info.ops), "missing": len(missing),
             "lines": len(lines)}),
            ("warmup-divergence", first.name, first.source))

    def _check_liveness(self, info: _GraphInfo, *, before_replay: bool) -> None:
        # This runs before every replay and a graph may reference every weight of a model: one C
        # call per storage, and the findings are built only when something has gone.
        if len(info.cdatas) != len(info.externals):      # externals are only ever added
            info.cdatas = tuple(ext.weak.cdata for ext in info.externals.values())
        if not any(map(_expired, info.cdatas)):
            return
        for ext in info.externals.values():
            if ext.reported or not ext.weak.expired():
                continue
            ext.reported = True
            when = (f"before replay {info.replays + 1}" if before_replay else
                    f"at the end of watch() (after {info.replays} replays)")
            origin = ext.origin or "before watch() (its creation was not seen)"
            finding = self.add(Finding(
                "dangling-reference", info.name, ext.op, ext.tensor, ext.source,
                f"{when}: the {ext.tensor} storage the graph reads has no owner left; it was created {origin}",
                explain.dangling(ext.tensor, ext.op, origin), {"replays_before": info.replays}),
                ("dangling-reference", ext.op, ext.source))
            if self.guard and before_replay:
                raise DanglingReferenceError(finding)

    def _probe_mutations(self, info: _GraphInfo, graph) -> None:
        """Replay twice on the current inputs, watching the static buffers the graph writes, then
        put every storage the graph writes back as it was."""
        written = {key: self._buffer(key) for key in info.writes if self._buffer(key) is not None}
        if any(ext.weak.expired() for ext in info.externals.values()):
            return                                  # replaying would read freed memory
        info.probed = True
        if not written:
            return
        with _disable_current_modes():
            saved = {key: _whole(info, key) for key in info.writes}
            saved = {key: (whole, whole.clone()) for key, whole in saved.items() if whole is not None}
            states = [{key: buf.ref().clone() for key, buf in written.items()}]
        replays, self.phase = graph.replays, "probe"
        rng = _rng_state(info.cuda)              # a replay advances the generator its RNG ops use
        try:
            for _ in range(2):
                graph.replay()
                with _disable_current_modes():
                    states.append({key: buf.ref().clone() for key, buf in written.items()})
        finally:
            self.phase = "eager"
            graph.replays = replays
            _set_rng_state(rng)
            with _disable_current_modes():
                for whole, copy in saved.values():
                    whole.copy_(copy)
        for key, buf in written.items():
            b0, b1, b2 = (s[key] for s in states)
            op = info.writes[key]
            pattern, numbers = _mutation_pattern(b0, b1, b2)
            self.add(Finding(
                "persistent-mutation", info.name, op.name, f"{buf.name}: {describe(b0)}", op.source,
                explain.mutation_evidence(buf.name, pattern, numbers),
                explain.mutation(op.name, buf.name, buf.owner, pattern), {"pattern": pattern, **numbers}),
                ("persistent-mutation", op.name, op.source, buf.name))

    def _eager_write(self, func, args, kwargs, run: _Call):
        """An in-place op on a static buffer outside any graph. One that reads what it writes
        (``+=``, not a copy) is harmless on rows the runner rewrites every step; on rows nobody
        rewrites -- padded rows -- each step builds on the last. Evidence: elements the op changes
        that its previous call wrote and no other write outside warmups and captures has touched
        since (a warmup runs the model's own code, so its writes are not a runner's refresh)."""
        targets = [(storage_key(t), t, buf) for t in _written_tensors(func, args, kwargs)
                   if (buf := self._buffer(storage_key(t))) is not None]
        if not targets:
            return run()
        if func.overloadpacket in _OVERWRITES:
            out = run()
            for key, t, _ in targets:
                self._rewritten(key, _region(t, self._buffer(key).ref()))
            return out
        with _disable_current_modes():
            before = [buf.ref().clone() for _, _, buf in targets]
        out = run()
        source = user_frame()
        for (key, t, buf), was in zip(targets, before, strict=True):
            whole = buf.ref()
            slot = (str(func), source, buf.name)
            with _disable_current_modes():
                region = _region(t, whole)
                self._rewritten(key, region, but=slot)
                entry = self.updates.setdefault(key, {}).setdefault(slot, [None, 0])
                last, entry[0] = entry[0], region
                entry[1] += 1
                again = None if last is None else last & _changed(was, whole)
                if again is None or not again.any():
                    continue
                rows = whole.shape[0] if whole.dim() else 1
                again_rows = again.reshape(rows, -1).any(1)
                first = int(again.reshape(-1).nonzero()[0])
                numbers = {"pattern": "accumulating", "call": entry[1], "rows": rows,
                           "rows_changed": int(again_rows.sum()), "first_row": int(again_rows.nonzero()[0]),
                           "was": was.reshape(-1)[first].item(), "now": whole.reshape(-1)[first].item()}
            self.add(Finding(
                "persistent-mutation", f"outside the graphs (eager code of {buf.owner})", str(func),
                f"{buf.name}: {describe(whole)}", source, explain.eager_update_evidence(buf.name, numbers),
                explain.eager_update(str(func), buf.name, buf.owner), numbers),
                ("persistent-mutation", str(func), source, buf.name))
        return out

    def _rewritten(self, key: int, region: torch.Tensor, but: tuple | None = None) -> None:
        """Elements ``region`` of a static buffer were written: no tracked update (other than
        ``but``) can build on what it wrote there any more."""
        for slot, entry in self.updates.get(key, {}).items():
            if slot != but and entry[0] is not None:
                entry[0] &= ~region

    def _check_stale_read(self, func, args, kwargs) -> None:
        for t in _tensors((args, kwargs)):
            entry = self.handed.get(id(t))
            if entry is None or entry[0]() is not t or entry[1].replays <= entry[2]:
                continue
            _, info, generation = entry
            source = user_frame()
            self.add(Finding(
                "overwritten-output", info.name, str(func), describe(t), source,
                f"an output handed out after replay {generation} of {info.name} is read after replay "
                f"{info.replays}", explain.overwritten(str(func), info.name, generation, info.replays),
                {"handed_out_after": generation, "read_after": info.replays}),
                ("overwritten-output", str(func), source))

    def _check_fit(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        buf = self._buffer(storage_key(dst))
        if buf is None or not isinstance(src, torch.Tensor) or src.shape == dst.shape:
            return
        try:
            fits = torch.broadcast_shapes(src.shape, dst.shape) == dst.shape
        except RuntimeError:
            fits = False
        if fits:
            return
        whole = buf.ref()
        source = user_frame()
        self.add(Finding(
            "undersized-buffer", buf.owner, str(aten.copy_.default), f"{buf.name}: {describe(whole)}", source,
            f"data of shape {tuple(src.shape)} copied into {buf.name} rows of shape {tuple(dst.shape)} "
            f"(the whole buffer is {tuple(whole.shape)})", explain.overflow(buf.name, tuple(src.shape), tuple(whole.shape)),
            {"data_shape": list(src.shape), "buffer_shape": list(whole.shape)}),
            ("undersized-buffer", buf.owner, buf.name, source))

    # ------------------------------------------------------------------ padded-row probe records
    def _record_inputs(self, info: _GraphInfo) -> None:
        real = info.pending[0] if info.pending else None
        inputs, readers = {}, {}
        with _disable_current_modes():
            for key in info.externals:
                buf = self._buffer(key)
                if buf is not None:
                    label, t = buf.name, buf.ref()
                    t = t if real is None else t[:real]
                elif key in info.writes:
                    label, t = f"{info.externals[key].tensor} (state)", _whole(info, key)
                else:
                    continue                           # never written by a graph: constant here
                if t is None:
                    continue
                inputs[label] = _digest(t)
                reader = next((op for op in info.ops if key in op.reads), None)
                readers[label] = (reader.name, reader.source) if reader else ("-", "-")
        self.trace.append({"graph": info.name, "real": real, "size": info.pending[1] if info.pending else None,
                           "inputs": inputs, "readers": readers, "outputs": None, "state": {}})

    def _record_outputs(self, info: _GraphInfo) -> None:
        record = self.trace[-1]
        real, outputs = (info.pending[0], info.pending[2]) if info.pending else (None, None)
        with _disable_current_modes():
            if outputs is not None:
                parts = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
                record["outputs"] = torch.cat([p[:real].detach().double().reshape(-1).cpu() for p in parts])
            for key in info.writes:
                if self._buffer(key) is None and (whole := _whole(info, key)) is not None:
                    record["state"][info.externals[key].tensor] = _digest(whole)

    # ------------------------------------------------------------------ the end
    def finish(self) -> Report:
        report = self.report
        self._final_checks()
        report.not_checked = self._not_checked()
        if self.unknown_replays:
            report.notes.append(f"{self.unknown_replays} replays of graphs captured before watch() were not checked")
        report.findings.sort(key=lambda f: KINDS.index(f.kind))
        return report

    @_contained
    def _final_checks(self) -> None:
        """Liveness once more (memory released after the last replay), and graphs that write a
        static buffer but were never replayed, so never probed."""
        for info in list(self.graphs.values()):
            graph = info.ref()
            if graph is None:
                continue
            self._check_liveness(info, before_replay=False)
            if not info.probed and any(self._buffer(k) is not None for k in info.writes):
                for key, op in info.writes.items():
                    if (buf := self._buffer(key)) is not None:
                        self.add(Finding(
                            "persistent-mutation", info.name, op.name, f"{buf.name}: {describe(buf.ref())}",
                            op.source, f"{op.name} writes {buf.name} inside the graph; not replayed inside "
                            "watch(), so whether writes accumulate was not probed",
                            explain.mutation(op.name, buf.name, buf.owner, "not probed"), {"pattern": "not probed"}),
                            ("persistent-mutation", op.name, op.source, buf.name))

    def _not_checked(self) -> dict[str, str]:
        if self.failure is not None:
            found = self.report.kinds
            return {k: f"the doctor stopped early ({self.failure})" for k in KINDS if k not in found}
        if self.report.captures == 0:
            why = {k: "nothing was captured inside watch()" for k in KINDS}
            if self.buffers:                        # announced capture inputs were still checked
                del why["undersized-buffer"]
            return why
        why = {"stale-padding": "needs two runs with the padded rows filled differently: use diagnose()"}
        if not self.buffers:
            why["persistent-mutation"] = "no runner announced its static input buffers"
            why["undersized-buffer"] = "no runner announced its static input buffers"
        if not any(info.warmup is not None for info in self.graphs.values()):
            why["warmup-divergence"] = "no warmup run was announced before any capture"
        if not self.handed_any:
            why["overwritten-output"] = "no runner handed graph outputs out"
        return why


# ---------------------------------------------------------------------------- the dispatch mode
class _Watch(TorchDispatchMode):
    def __init__(self, doctor: Doctor) -> None:
        super().__init__()
        self.doctor = doctor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        doctor, kwargs = self.doctor, kwargs or {}
        if doctor.phase in ("replay", "probe") or doctor.failure is not None:
            return func(*args, **kwargs)
        run = _Call(func, args, kwargs)
        try:
            return doctor.on_op(func, args, kwargs, run)
        except _DELIBERATE:
            raise
        except Exception as e:
            if e is run.error:                   # the op itself failed: the watched code's error
                raise
            doctor.fail(e, f"watching {func}")
            return run.result()


@contextlib.contextmanager
def watch(*, guard: bool = False) -> Iterator[Report]:
    """Observe every capture, warmup and replay inside the block; yields the ``Report``, complete
    when the block ends. ``guard=True`` raises ``DanglingReferenceError`` instead of replaying a
    graph whose referenced memory is gone (on CUDA that replay is an illegal memory access, which
    ends the process's CUDA context)."""
    with watching(Doctor(guard=guard)) as doctor:
        yield doctor.report


@contextlib.contextmanager
def watching(doctor: Doctor) -> Iterator[Doctor]:
    """``watch()`` with a given observer (``diagnose`` keeps its probe records)."""
    mode = doctor.mode = _Watch(doctor)
    events.subscribe(doctor)
    mode.__enter__()
    start = time.perf_counter()
    try:
        yield doctor
    except BaseException as e:
        doctor.report.errors.append(f"{type(e).__name__}: {_first_line(e)}")
        raise
    finally:
        mode.__exit__(None, None, None)
        events.unsubscribe(doctor)
        doctor.finish()
        doctor.report.seconds = time.perf_counter() - start


# ---------------------------------------------------------------------------- helpers
def _tensors(obj) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)


def _device_to_host(func, args, kwargs) -> bool:
    """A copy from a CUDA tensor to host memory (``.cpu()``, ``.to("cpu")``)."""
    if func is aten._to_copy.default:
        device = kwargs.get("device")
        return args[0].is_cuda and device is not None and torch.device(device).type == "cpu"
    if func is aten.copy_.default:
        return args[1].is_cuda and not args[0].is_cuda
    return False


def _whole(info: _GraphInfo, key: int) -> torch.Tensor | None:
    """All bytes of an external storage, as a uint8 tensor (None once released)."""
    ext = info.externals.get(key)
    if ext is None or ext.weak.expired():
        return None
    storage = torch.UntypedStorage._new_with_weak_ptr(ext.weak.cdata)
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _region(view: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """Which elements of the static buffer ``whole`` the in-place op's ``view`` covers (a bool mask
    shaped like ``whole``; all of it when the view reinterprets the bytes)."""
    if view.dtype != whole.dtype:
        return torch.ones(whole.shape, dtype=torch.bool, device=whole.device)
    flat = torch.zeros(whole.untyped_storage().nbytes() // whole.element_size(), dtype=torch.bool,
                       device=whole.device)
    flat.as_strided(view.shape, view.stride(), view.storage_offset()).fill_(True)
    return flat.as_strided(whole.shape, whole.stride(), whole.storage_offset()).clone()


def _digest(t: torch.Tensor) -> str:
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
    return hashlib.blake2b(data, digest_size=12).hexdigest()


def _mutation_pattern(b0: torch.Tensor, b1: torch.Tensor, b2: torch.Tensor) -> tuple[str, dict]:
    """accumulating (each replay changes it again), overwriting (changed once, then stable) or
    self-cancelling (unchanged: the writes undo each other)."""
    rows = b0.shape[0] if b0.dim() else 1
    changed_rows = int(_changed(b0, b1).reshape(rows, -1).any(1).sum()) if b0.numel() else 0
    numbers = {"rows": rows, "rows_changed": changed_rows}
    if b0.dtype != torch.bool and not b0.dtype.is_complex:
        d1, d2 = ((b.double() - b0.double()).abs().nan_to_num(0.0) for b in (b1, b2))
        numbers.update(max_change_1=float(d1.max()) if d1.numel() else 0.0,
                       max_change_2=float(d2.max()) if d2.numel() else 0.0)
    if not _changed(b0, b1).any():
        return "self-cancelling", numbers
    return ("accumulating" if _changed(b1, b2).any() else "overwriting"), numbers


def _changed(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise ``a != b`` where NaN equals NaN (poisoned padded rows hold NaN)."""
    diff = a != b
    return diff & ~(a.isnan() & b.isnan()) if a.dtype.is_floating_point else diff


def _rng_state(cuda: bool) -> tuple:
    return torch.get_rng_state(), torch.cuda.get_rng_state() if cuda else None


def _set_rng_state(state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])


def _fill_padded(padded: dict, real: int, size: int, pattern: int) -> None:
    """Fill rows ``[real, size)`` of each array with a small value: ``i`` for the i-th array under
    pattern 0, ``n - i`` under pattern 1, so every array changes and any two swap their order
    (a comparison between two padded fields flips). Small values stay valid as indices."""
    n = len(padded)
    for i, arr in enumerate(padded.values()):
        value = i if pattern == 0 else n - i
        if isinstance(arr, torch.Tensor):
            with _disable_current_modes():
                arr[real:size] = bool(value % 2) if arr.dtype == torch.bool else value
        elif isinstance(arr, np.ndarray):
            arr[real:size] = bool(value % 2) if arr.dtype == np.bool_ else value
        else:
            raise TypeError(f"padded rows must be tensors or NumPy arrays, got {type(arr).__name__}")


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""
