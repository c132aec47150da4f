"""Errors as they are raised in the watched code, caught later or not (``sys.settrace``, under ``diagnose``).

A workload may catch its own failure and carry on: a test harness that compares outcomes, a serving
loop that logs and drops the batch. An op that fails at dispatch is seen by the dispatch mode
(``failures.op_failed``), but many errors are raised before any op reaches it: a composite op's
argument check (``repeat_interleave`` with mismatched sizes), a tensor's ``__index__``, an
``assert`` of the workload. Unseen, such a run reads "0 findings". The tracer sees each error in the
first user frame it passes through and keeps, once graphs exist (or a runner has announced the
buffers it captures with), those that came from a call into a library (torch's checks) or from an
``assert`` and then left that frame, not those the same function caught (a probe such as
``try: torch.xpu.is_current_stream_capturing() except Exception: return False``). An error of a ``raise``
statement is raised on purpose, for the workload's own code to catch: it is kept only if code that
is not the workload's caught it (a harness around the step, such as the zoo's ``compare``): it left
two or more of the workload's frames, then a library's, and never reached the workload's frame
above. Any other error (a lookup's ``KeyError``, a library's own error class; not the end of an
iteration) is followed so too: it may be a protocol, or the step's failure. Before any graph exists,
errors of the served run that follows an announced reference run are followed the same way (its
set-up failed before it could capture, and a harness caught that). The program's own checks are also
handed to the rules that read them (``undersized.failed_fit_check``, ``clobbered.failed_check``,
``shapes.failed_size_check``, ``decisions.failed_flag_check``), and a value a reset bound to None to
``torn_down.failed``. After a padded replay it also hands each frame to ``rules/shapes.py``, which
may tie the error to the padded rows; an item assignment that failed (into a NumPy staging array,
which dispatches no op) goes to ``rules/undersized.py``'s write contract. A refusal raised while a
capture is open goes to ``rules/sync.py`` as it is raised: code may catch it and go on with the
capture still open.

The tracer also keeps the last user function that returned (``returned``), without holding its
frame: memory released as a function's locals go is released in that function (``released_at``).

Line events are off outside captures: the cost is one Python call per user function call, only
under ``diagnose`` (``watch()`` alone does not trace). Inside a capture, the functions it calls
report each line they run (``GraphInfo.lines_run``): which code the capture passed over is then
known exactly (``skipped.py``). Another tracer (a debugger, coverage) is left alone.
"""
from __future__ import annotations

import ast
import dataclasses
import dis
import gc
import inspect
import os
import sys
import sysconfig
import textwrap

from ..engine.errors import GraphError, IllegalMemoryAccess
from ..engine.source import SKIP_DIRS, function_name, location, mine, raises_at, short_path
from . import failures, threads
from .rules import (checks, clobbered, decisions, dummy_batch, graph_keys, input_match, shapes, size_table, sync,
                    torn_down, undersized)
from .tensors import first_line, placement

_RETURNS = {dis.opmap[name] for name in ("RETURN_VALUE", "RETURN_CONST", "YIELD_VALUE", "RETURN_GENERATOR")
            if name in dis.opmap}        # RETURN_CONST: Python 3.12's ``return`` of a constant (``return``, ``return None``)
# The standard library is never the workload's code, and it raises and catches errors of its own
# (``re``'s parser, at the end of every pattern): its frames are not traced. Packages installed under
# it (site-packages, dist-packages) are libraries like any other.
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep
_PACKAGES = ("site-packages", "dist-packages")
# An item assignment: ``a[i] = v``, and on Python 3.12 on, ``a[i:j] = v`` has an instruction of its own.
_STORES = {dis.opmap[name] for name in ("STORE_SUBSCR", "STORE_SLICE") if name in dis.opmap}
_CACHE = dis.opmap.get("CACHE", -1)
_CALLS = {dis.opmap[name] for name in ("CALL", "PRECALL", "CALL_FUNCTION_EX", "CALL_KW") if name in dis.opmap}


class _Tracer:
    def __init__(self) -> None:
        self.doctor = None
        # id(frame) -> (error key, (text, functions it was raised under) of a check or None, the same of
        # a ``raise`` with the frames it has left, or None) of an error raised there or on its way through
        self.pending: dict[int, tuple] = {}
        # (key, id of the frame) of the last error seen leaving a frame: the same error arriving in a caller
        # is on its way up, not new (an error caught since may have freed its id for a new one: ``_came_from``)
        self.leaving: tuple | None = None
        # id(frame) -> (error key, description, frames it left, through a library) of a ``raise`` on its
        # way up: expected in that frame; one that went through a library and never comes is kept
        self.followed: dict[int, tuple] = {}
        self.explained: set[tuple] = set()    # errors tied to a padded replay's rows
        # (code, its last line, id of its caller's frame, the caller's line) of the last user function that
        # returned, until the next call: frames are not held (a frame keeps its locals alive)
        self.returned: tuple | None = None
        # id(frame) -> (its code, where the last function it called that answered True or False, or a key,
        # returned), with a reference run: a check whose answer may have chosen a graph (``decider``); the code
        # tells the frame from a later one given the same id
        self.decided: dict[int, tuple] = {}

    def start(self, doctor) -> None:
        if self.doctor is None and sys.gettrace() is not None:
            return                                   # someone else's tracer: leave it alone
        self.doctor = doctor
        sys.settrace(self.call)
        frame = sys._getframe(1)
        while frame is not None:                     # frames already running
            if not frame.f_code.co_filename.startswith(SKIP_DIRS) and not _stdlib(frame.f_code.co_filename):
                frame.f_trace_lines, frame.f_trace = False, self.local
            frame = frame.f_back

    def stop(self) -> None:
        if self.doctor is not None:
            self.doctor, self.leaving = None, None
            self.pending.clear()
            self.followed.clear()
            self.explained.clear()
            self.decided.clear()
            self.returned = None
            sys.settrace(None)

    def call(self, frame, event, arg):
        if self.doctor is None:
            return None
        if frame.f_code.co_filename.startswith(SKIP_DIRS) or _stdlib(frame.f_code.co_filename):
            if frame.f_code in threads.HAND_OFFS and self.doctor.capturing is not None:
                try:
                    threads.handed_off(self.doctor.capturing, frame)
                except Exception as e:  # noqa: BLE001 - the doctor's own error, reported in the Report
                    self.doctor.fail(e, "following work handed to another thread")
            return None
        self.returned = None
        frame.f_trace_lines = self.doctor.capturing is not None     # the lines a capture runs: doctor/skipped.py
        if (reference := self.doctor.reference) is not None:        # calls numbered: probes/reference.py
            reference.called(self.doctor, frame)
            frame.f_trace_lines |= reference.coverage.wanted(self.doctor, frame.f_code, reference.recording)
        return self.local

    def local(self, frame, event, arg):
        doctor = self.doctor
        if doctor is None:
            return None
        if doctor.failure is not None:
            return self.local
        try:
            if event == "return":
                caller = frame.f_back
                self.returned = (frame.f_code, frame.f_lineno, id(caller), caller.f_lineno if caller else None)
                if self.decided:
                    self.decided.pop(id(frame), None)
                if doctor.reference is not None and caller is not None and mine(caller) \
                        and (type(arg) is bool or _key(arg)):
                    # (code made at run time without source, a dataclass's ``__eq__``: the caller's line compared;
                    # keyed by the caller's id, which a later frame may reuse: its code is kept to tell them apart)
                    self.decided[id(caller)] = (caller.f_code, location(frame if mine(frame) else caller))
                if doctor.padded_step is not None and arg is not None:
                    shapes.handed_on(doctor, frame, arg)
                if (info := doctor.capturing) is not None:
                    if isinstance(arg, (dict, list)) and arg or dataclasses.is_dataclass(arg):
                        info.returned_paths[frame.f_code] = placement(arg)    # (reference.py pairs by it)
                    elif type(arg) in (int, float) and arg not in (0, 1, -1):
                        # where a number the capture may bake in was computed (kept as launch signatures keep it)
                        info.returned_numbers.setdefault(repr(arg) if type(arg) is float else arg, location(frame))
            if event == "line":
                if (info := doctor.capturing) is not None:
                    info.lines_run.add((frame.f_code, frame.f_lineno))
                elif (reference := doctor.reference) is not None:     # probes/coverage.py
                    reference.coverage.line(doctor, frame.f_code, frame.f_lineno, reference.number,
                                            reference.recording)
            elif event == "exception":
                if (reference := doctor.reference) is not None and reference.recording:
                    reference.coverage.raised.add((frame.f_code, frame.f_lineno))
                self._raised(doctor, frame, arg[1], arg[2])
            elif event == "return" and (reference := doctor.reference) is not None and reference.recording:
                reference.returned(frame, arg)
            elif event == "return" and (self.pending or self.followed):
                if (lost := self.followed.pop(id(frame), None)) is not None and lost[3]:    # a library caught it
                    failures.keep(doctor, lost[0][0], lambda: lost[1][0], lost[1][1])
                entry = self.pending.pop(id(frame), None)
                if entry is not None and arg is None and _op(frame) not in _RETURNS:    # it left the frame
                    key, description, deliberate = entry
                    self.leaving = (key, id(frame))
                    if description is not None:   # kept like an op failure: a run that caught it is not clean
                        failures.keep(doctor, entry[0][0], lambda: description[0], description[1])
                    elif deliberate is not None:
                        self._follow(frame.f_back, entry[0], *deliberate)
        except Exception as e:  # noqa: BLE001 - the doctor's own error, reported in the Report
            doctor.fail(e, "watching an error raised in the workload")
        return self.local

    def _raised(self, doctor, frame, error: BaseException, tb) -> None:
        key = (id(error), type(error))
        if doctor.padded_step is not None and doctor.pattern is None and key not in self.explained \
                and doctor.phase != "differential":        # (the doctor's own eager run of the step failed)
            if shapes.raised(doctor, error, frame):
                self.explained.add(key)
        if self.leaving is not None and key == self.leaving[0] and _came_from(tb, self.leaving[1]):
            # on its way out of the frame that raised it
            if (came := self.followed.pop(id(frame), None)) is not None and came[0] == key:
                self.pending[id(frame)] = (key, None, came[1:3])      # it reached this frame: followed on
            return
        watched = doctor.phase in ("eager", "warmup", "capture")
        if doctor.phase == "capture":
            sync.raised_in_capture(doctor, error, tb)
        if watched and _op(frame) in _STORES:
            undersized.failed_host_write(doctor, error, frame)
        description = deliberate = None              # not kept, but followed: its callers must not take it for new
        if watched:
            doctor.empty_batch.raised(doctor, error)
            size_table.explained(doctor, error, frame)
            if not failures.pending(doctor, error):
                graph_keys.raised(doctor, error, frame)
            torn_down.failed(doctor, error, frame)
            if raises_at(frame.f_code, frame.f_lasti):                # the program's own check (``assert``, ``raise``), not a library's
                at = checks.helper_caller(frame) or frame     # (a check helper's: its caller compared)
                undersized.failed_fit_check(doctor, error, at)
                clobbered.failed_check(doctor, error, at)
                shapes.failed_size_check(doctor, error, at)
                shapes.failed_count_check(doctor, error, at)
                decisions.failed_flag_check(doctor, error, at)
                input_match.failed_check(doctor, error, at)
                dummy_batch.failed_check(doctor, error, at)
        graphs = doctor.graphs or doctor.pools or doctor.buffers or doctor.phase != "eager"
        # (before any graph, in the served run that follows an announced reference run: its set-up
        # failed, and a harness that caught it must not leave "nothing was captured" alone)
        serving = doctor.reference is not None and not doctor.reference.recording
        if watched and (graphs or serving) \
                and (shapes.explainable(error) or isinstance(error, checks.MISUSE) or failures.pending(doctor, error)
                     or _modelled_fault(error, frame) or _other(error)):
            where = f"{short_path(frame.f_code.co_filename)}:{frame.f_lineno} in {function_name(frame.f_code)}"
            text = (f"{type(error).__name__}: {first_line(error)} (raised at {where}, during {doctor.phase})",
                    failures.stack_codes(frame))
            checked = graphs and _from_a_check(error, frame)
            description, deliberate = (text, None) if checked else (None, (text, 0))
            if serving:
                doctor.reference.failed_calls.raised(doctor, frame, error)
        self.pending[id(frame)] = (key, description, deliberate)

    def _follow(self, caller, key, text: tuple, left: int) -> None:
        """A ``raise`` has left ``left + 1`` frames of the workload's: it is expected in the caller, or,
        where the caller is a library's, in the workload's frame above it. The library may never let
        it get there (it caught it): kept then, if it had left two frames of the workload's at least;
        one frame is a protocol (``__getitem__``'s ``IndexError`` ends an iteration), unless the error
        is a misuse no protocol raises (``checks.MISUSE``): followed, from a single frame too, into a
        harness that catches it (a callback a library calls, ``tree_map``'s, raising one is a failure)."""
        through = False
        while caller is not None and not (mine(caller) and not _stdlib(caller.f_code.co_filename)):
            caller, through = caller.f_back, True
        if caller is not None and (left >= 1 or not through or issubclass(key[1], checks.MISUSE)):
            self.followed[id(caller)] = (key, text, left + 1, through)


def _stdlib(filename: str) -> bool:
    """The standard library's code: its files, and the modules Python runs frozen (``posixpath``)."""
    return filename.startswith(_STDLIB) and not any(p in filename for p in _PACKAGES) or filename.startswith("<frozen")


def _op(frame) -> int | None:
    code = frame.f_code.co_code
    return code[frame.f_lasti] if 0 <= frame.f_lasti < len(code) else None


def _instruction(frame) -> int | None:
    """The instruction a frame is running: ``_op``'s, before the inline caches that follow it
    (where a frame waiting on a call points on 3.11)."""
    code, at = frame.f_code.co_code, frame.f_lasti
    while 0 < at < len(code) and code[at] == _CACHE:
        at -= 2
    return code[at] if 0 <= at < len(code) else None


def _came_from(tb, frame_id: int) -> bool:
    """Whether an error whose traceback so far is ``tb`` (the trace event's: the error's own is set
    later) arrives from the frame ``frame_id``, below the one it is in now: the same error on its
    way up, not a new one that was given a freed id."""
    tb = tb.tb_next if tb is not None else None
    while tb is not None:
        if id(tb.tb_frame) == frame_id:
            return True
        tb = tb.tb_next
    return False


def _modelled_fault(error: BaseException, frame) -> bool:
    """The workload's own ``raise`` of one of the engine's errors (``IllegalMemoryAccess``,
    ``GraphError``): its model of a kernel that faults (a bound a CUDA kernel does not check) or of a
    launch CUDA refuses (an empty grid), not a replay's read of released memory, which the engine
    raises from its own code. Kept like any failure, so that a run that caught it does not read
    "0 findings"."""
    return isinstance(error, (IllegalMemoryAccess, GraphError)) and raises_at(frame.f_code, frame.f_lasti)


def _other(error: BaseException) -> bool:
    """Any other error of the workload's (a ``KeyError`` of a lookup, a library's own error class),
    but the ends of an iteration: followed as a ``raise`` is, so kept only where it leaves two of the
    workload's frames and a library's code catches it (a harness), never where it is a protocol."""
    return isinstance(error, Exception) and not isinstance(error, (StopIteration, StopAsyncIteration))


def _from_a_check(error: BaseException, frame) -> bool:
    """A broken contract that a library checked (or the workload asserted), not a deliberate raise."""
    if not shapes.explainable(error):
        return False
    return isinstance(error, AssertionError) or not raises_at(frame.f_code, frame.f_lasti)


_tracer = _Tracer()
start, stop = _tracer.start, _tracer.stop
_collecting = False


def _collector(phase: str, _info: dict) -> None:
    global _collecting
    _collecting = phase == "start"


gc.callbacks.append(_collector)


def released_at(running) -> str | None:
    """Where the workload let go of memory, asked by a callback as it goes (``running``: the frame
    that was running then): the line of the innermost frame of the workload's own code (a
    library's frames, ``nn.Module.__setattr__``'s say, are how that line did it). Where the running
    frame waits on a call of a function that has just returned (seen by the tracer, under
    ``diagnose``), the memory went with that function's locals: its return line. None while the
    garbage collector runs: whatever started it did not let go. Inside a finalizer (``__del__``),
    the line that dropped the object's last reference let go: Python runs the finalizer there (the
    outermost one, where one finalizer's object held the next)."""
    if _collecting:
        return None
    outer = running
    while outer is not None:
        if outer.f_code.co_name == "__del__" and outer.f_back is not None:
            running = outer.f_back
        outer = outer.f_back
    frame = running
    while frame is not None and not (mine(frame) and not _stdlib(frame.f_code.co_filename)):
        frame = frame.f_back
    if frame is None:
        return None
    last = _tracer.returned
    if last is not None and last[2] == id(running) and last[3] == running.f_lineno \
            and _instruction(running) in _CALLS:
        return location(last[0], last[1])
    if _rebinds_as_told(frame):
        caller = frame.f_back
        while caller is not None and not mine(caller):
            caller = caller.f_back
        if caller is not None:
            return location(caller)
    return location(frame)


_TOLD: dict = {}     # (code, instruction) -> whether it is a ``setattr`` as ``_rebinds_as_told`` reads it


def _rebinds_as_told(frame) -> bool:
    """Whether the frame is rebinding an attribute as it was told to: ``setattr(obj, name, value)``
    on an object it was given, by a name it does not spell (a helper copying or assigning the fields
    its caller lists). What was let go of was the caller's choice: the release is named there."""
    key = (frame.f_code, frame.f_lasti)
    if key not in _TOLD:
        _TOLD[key] = _setattr_given(frame)
    return _TOLD[key]


def _setattr_given(frame) -> bool:
    code = frame.f_code
    node = checks.expression(frame)
    given = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
        and len(node.args) == 3 and isinstance(node.args[0], ast.Name) and node.args[0].id in given \
        and isinstance(node.args[1], ast.Name) and _from_arguments(code, node.args[1].id, given)


def _from_arguments(code, name: str, given) -> bool:
    """Whether ``name`` is one of the function's arguments, or the target of a ``for`` over one
    (``for name in fields``, ``for name, value in fields.items()``)."""
    if name in given:
        return True
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(code)))
    except (OSError, TypeError, SyntaxError):
        return False
    for loop in ast.walk(tree):
        if isinstance(loop, ast.For) and name in {n.id for n in ast.walk(loop.target) if isinstance(n, ast.Name)}:
            root = loop.iter
            while isinstance(root, (ast.Call, ast.Attribute, ast.Subscript)):
                root = root.func if isinstance(root, ast.Call) else root.value
            if isinstance(root, ast.Name) and root.id in given:
                return True
    return False


def decider(frames) -> str | None:
    """Among ``frames`` (the user's, innermost first: those a replay was asked from), where the last
    check one of them called answered: a function returning True or False (``can_reuse_graph``, a
    graph-update check), or a key (``_key``: a graph cache's key function, a dispatcher), whose
    answer chose to replay the graph it had. None if none did."""
    for frame in frames:
        if (entry := _tracer.decided.get(id(frame))) is not None and entry[0] is frame.f_code:
            return entry[1]
    return None


def _key(value) -> bool:
    """Whether a returned value is a key: a non-empty tuple or dataclass of plain values
    (``graph_keys.keylike``: what a runner keys its graphs on)."""
    return graph_keys.structured(value) and graph_keys.keylike(value) and value != ()


def tracing() -> bool:
    """Whether the tracer is on (the workload's calls are seen)."""
    return _tracer.doctor is not None
