"""The eager step of a differential replay, watched op by op: its launch trace and its writes.

While ``differential`` runs an eager step (``Doctor.diff`` is set), the doctor's dispatch mode
hands each op here. A watched run records, for every op, its name, its Python-decided arguments,
the storages it reads and the line that launched it (the launch trace ``launch`` aligns with the
capture's); any run notes the storages it creates, and keeps memory it writes outside the state
kept before the replay so that it can be put back. (A view makes no storage and is not part of a
launch trace: it only runs.)
"""
from __future__ import annotations

import dataclasses
import inspect
import struct

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ...engine.opinfo import mutable, op_tensors, overwrites, storage_key, tensors, written_tensors
from ...engine.source import frames_within, location, user_frame, user_frames
from ..records import Op
from ..skipped import parted
from ..tensors import alias, signature
from ..rules import bounds, host_copies, unread
from . import nonfinite, row_writes

aten = torch.ops.aten


@dataclasses.dataclass
class EagerRun:
    """The eager step's launch trace and the storages it created or wrote."""

    known: set                                   # storages kept before the replay
    graph_ops: list                              # the capture's trace, to align with as it runs
    traced: bool = True                          # record the launch trace (else only new and extra storages)
    seen: bool = True                            # its ops went through the doctor's mode
    rows: tuple | None = None                    # (real, size, sampled) of a padded step whose writes are attributed
    cuda: bool = False                           # beside a CUDA graph: its capture records no host work, and
    #                                              indices are checked before each op (``rules/bounds.py``)...
    out_of_range: BaseException | None = None    # ... and the CPU's error for the first past its dimension
    outputs: frozenset = frozenset()             # memory the graph owns and never reads: its previous outputs
    ops: list = dataclasses.field(default_factory=list)
    new: set = dataclasses.field(default_factory=set)
    host_made: set = dataclasses.field(default_factory=set)   # storages host work made (host memory, as a capture's)
    created_by: dict = dataclasses.field(default_factory=dict)   # storage it created -> the Op that did
    extra: dict = dataclasses.field(default_factory=dict)    # other storages it wrote: key -> (whole, before)
    described: dict = dataclasses.field(default_factory=dict)
    row_writes: list = dataclasses.field(default_factory=list)   # padded rows' writes of owned state (row_writes)
    padded_writes: list = dataclasses.field(default_factory=list)   # ... of any state: (op, line, key, state,
    #                                                                  mask, values written)
    carried: list = dataclasses.field(default_factory=list)   # an earlier step's padded_writes real rows read back
    real_reads: dict = dataclasses.field(default_factory=dict)     # state elements real rows looked up: key -> mask
    real_writes: dict = dataclasses.field(default_factory=dict)    # ... and wrote: key -> mask
    read_outputs: list = dataclasses.field(default_factory=list)  # ops that read ``outputs`` before writing them
    written: set = dataclasses.field(default_factory=set)      # storages it has written so far
    read_first: set = dataclasses.field(default_factory=set)   # ... and those it read before writing them
    unread_reads: dict = dataclasses.field(default_factory=dict)   # held unread data's buffers: key -> mask read
    stacks_at: tuple = ()                        # two positions in the trace whose user frames are compared
    held: list | None = None                     # ... the frames at the first, until the second
    loop: str | None = None                      # the deepest frame both share: the one that looped
    origin_of: tuple = ()                        # (position in the trace, numbers it is given) to trace back...
    origin: str | None = None                    # ... to the outermost frame holding one as a local
    passed: str | None = None                    # ... else to the frame that passed it down (``passed_down``)
    branch_at: tuple = ()                        # (the graph, the frame that runs the step): at its first op unlike
    branch: str | None = None                    # the capture's, the line where it left the capture's path (``branched``)
    nonfinite: tuple | None = None               # (real, size): find where padded rows' NaN reach real rows...
    crossed: tuple | None = None                 # ... (op, source, reader or None) of the op that hands them over
    stored: dict = dataclasses.field(default_factory=dict)   # storage -> (op, source) that stored them in state
    rebound: list = dataclasses.field(default_factory=list)    # tensor bindings it moved (pystate.changes)
    host: list = dataclasses.field(default_factory=list)   # (container, name, what changed): the replay left it
    settings: list = dataclasses.field(default_factory=list)   # plain values among them it set (pystate.settings)
    host_line: str | None = None                 # where it changed the container it was traced for
    host_code: object = None                     # ... and the function that did


def on_op(doctor, func, args, kwargs, run):
    """An op of the eager step: keep what it is about to overwrite, record it in the trace. (A
    view makes no storage and is not part of a launch trace: it only runs.)"""
    d = doctor.diff
    lifted = func.overloadpacket in _LIFTS
    if func.is_view and not lifted:
        return run()
    if d.outputs and not d.read_outputs:        # before its own writes make them this run's
        if any((key := storage_key(t)) in d.outputs and key not in d.extra for t in op_tensors(args, kwargs)):
            d.read_outputs.append(f"{func} at {user_frame()}")
    if mutable(func):
        for t in written_tensors(func, args, kwargs):
            key = storage_key(t)
            if key not in d.known and key not in d.new and key not in d.extra:
                with _disable_current_modes():
                    w = alias(t.untyped_storage(), torch.uint8)
                    with torch.inference_mode(False):
                        d.extra[key] = (w, w.clone())
    if not d.traced:
        return _untraced(d, func, args, kwargs, run)
    inputs = op_tensors(args, kwargs)
    keys = {storage_key(t) for t in inputs}
    if lifted:                                   # a constant made from Python data in this run
        d.new.update(keys)
    if (d.cuda or not lifted) and host_copies.unrecorded(inputs, kwargs, d.cuda, d.host_made):
        # Host work (beside a CUDA graph, host data lifted too): not in the graph's trace (``capture.py``),
        # so not in this one. What it makes is host memory, as the capture takes it (``cpu_graph``): the
        # next op of a composite host op (``lr / host_step``: a reciprocal, then a multiply) is host work too.
        out = run()
        d.host_made.update(storage_key(o) for o in tensors(out))
        return out
    _accessed(d, func, args, kwargs, inputs)
    if doctor.unread:
        unread.eager_read(doctor, d, func, args, kwargs, inputs)
    if d.cuda:
        try:
            bounds.check(func, args, kwargs, run)
        except (IndexError, RuntimeError) as e:
            d.out_of_range = e
            raise
    if d.rows:
        row_writes.indexed_read(doctor, func, args, d.rows)
    out = row_writes.indexed_write(doctor, func, args, kwargs, run, d.rows) if d.rows else run()
    if d.nonfinite and d.crossed is None:
        nonfinite.on_op(d, func, args, kwargs, out)
    for t in inputs:
        if (key := storage_key(t)) not in d.new:     # pre-existing, so alive anyway: described if reported
            d.described.setdefault(key, t)
    name, sig, i = _name(func), signature(func, args, kwargs), len(d.ops)
    if i in d.stacks_at:
        _stack(d, i)
    if d.origin_of and i == d.origin_of[0]:
        values, top = d.origin_of[1:]
        d.origin = tensor_origin(values[1], top) if values[:1] == ("tensor",) else number_origin(values, top)
        d.passed = None if d.origin is not None or values[:1] == ("tensor",) else passed_down(values, top)
    same = i < len(d.graph_ops) and d.graph_ops[i].name == name and d.graph_ops[i].sig == sig
    if not same and d.branch_at and d.branch is None:
        d.branch = branched(*d.branch_at)
    # The source line costs a walk up the stack: where the op matches the capture's op at the
    # same position, it is taken to be the same line (a divergence is looked up in full).
    op = Op(name, d.graph_ops[i].source if same else user_frame(), frozenset(keys), frozenset(),
            frozenset(keys - d.new), sig)
    d.ops.append(op)
    for o in (out,) if isinstance(out, torch.Tensor) else tensors(out):
        if (key := storage_key(o)) not in keys:
            d.new.add(key)
            d.created_by[key] = op             # (the latest: a freed storage's address is reused)
    return out


def _accessed(d: EagerRun, func, args, kwargs, inputs) -> None:
    """Which storages the run read before it wrote them (an op that overwrites its output does not
    read it): memory it only writes before reading is its own scratch."""
    written = {id(t): storage_key(t) for t in written_tensors(func, args, kwargs)} if mutable(func) else {}
    for t in inputs:
        if id(t) in written and overwrites(func):
            continue
        if (key := storage_key(t)) not in d.written and key not in d.new:
            d.read_first.add(key)
    d.written.update(written.values())


def _stack(d: EagerRun, i: int) -> None:
    """At the first of ``stacks_at``, hold the user's frames; at the second, keep the line of the
    deepest frame both share (the same call, not only the same function) and let the frames go."""
    frames = user_frames()[::-1]                 # outermost first
    if i == d.stacks_at[0]:
        d.held = frames
        return
    shared = None
    for a, b in zip(d.held or (), frames):
        if a is not b:
            break
        shared = b
    d.held, d.loop = None, location(shared) if shared is not None else None


def branched(info, top) -> str | None:
    """Where the eager step, launching an op the capture did not launch here, left the capture's
    path (``skipped.parted``, over the step's frames inside ``top`` and the lines ``info``'s capture
    ran, known under ``diagnose``)."""
    if not info.lines_run:
        return None
    return parted([(f.f_code, f.f_lineno) for f in (frames_within(top) or [])[::-1]], info.lines_run)


def number_origin(values: tuple, top) -> str | None:
    """Where the Python numbers an op is given come from (``values``: as the launch signature keeps
    them, floats by their ``repr``): the line of the outermost user frame inside the step (below
    ``top``, the frame that called it) that holds one of them in a variable of its own (not a
    parameter: it was handed that), the function of the captured code that read it from host state
    and passed it down. A number the step was given from outside (a training loop's count, passed
    in as an argument) stays at the op. Numbers reach the dispatcher as new objects, so they are
    matched by value; 0 and 1, which any frame may hold, are not traced."""
    held = _matcher(values)
    if held is None:
        return None
    for frame, own in _own_variables(top):
        if held(own):
            return location(frame)
    return None


def passed_down(values: tuple, top) -> str | None:
    """Where no frame holds the number in a variable of its own (read from a container and passed
    straight on, ``helper(group["decay"])``): the first frame inside the step, walking out from the
    op's, that was not handed it as an argument, if the op's own frame was. None if that is the
    step's own entry (what the step's callable reads is its input, as what it is handed is) or if
    every frame inside the step was handed it: it came from outside the step."""
    held = _matcher(values)
    frames = (frames_within(top) or []) if held is not None else []
    handed = 0
    while handed < len(frames) and held(_arguments(frames[handed])):
        handed += 1
    return location(frames[handed]) if 0 < handed < len(frames) - 1 else None


def _matcher(values: tuple):
    """A test of a frame's values against the numbers (None when there is nothing to trace). A float
    lifted into a float32 tensor (``torch.tensor(value)``) is held in Python unrounded."""
    values = [v[1] if isinstance(v, tuple) and len(v) == 2 and v[0] == "scalar" else v for v in values]
    floats = {v for v in values if isinstance(v, str)} - {"0.0", "1.0", "-1.0"}
    ints = {v for v in values if type(v) is int} - {0, 1, -1}
    if not floats and not ints:
        return None
    return lambda vs: any(type(v) is float and (repr(v) in floats or repr(_float32(v)) in floats)
                          or type(v) is int and v in ints for v in vs)


def _float32(v: float) -> float:
    try:
        return struct.unpack("f", struct.pack("f", v))[0]
    except OverflowError:
        return v


def _arguments(frame) -> list:
    """The values a frame was handed: its parameters and the elements of its ``*args``."""
    code, local = frame.f_code, frame.f_locals
    n = code.co_argcount + code.co_kwonlyargcount
    given = [local.get(name) for name in code.co_varnames[:n]]
    rest = local.get(code.co_varnames[n]) if code.co_flags & inspect.CO_VARARGS else None
    return given + list(rest) if isinstance(rest, tuple) else given


def _own_variables(top):
    """Each user frame inside the step (below ``top``), outermost first, with the values of its own
    variables: not its parameters (what it was handed), but what it read or computed itself."""
    for frame in (frames_within(top) or [])[::-1]:
        code, local = frame.f_code, frame.f_locals
        given = (code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & inspect.CO_VARARGS)
                 + bool(code.co_flags & inspect.CO_VARKEYWORDS))
        yield frame, [local.get(name) for name in code.co_varnames[given:] + code.co_cellvars]


def tensor_origin(key: int, top) -> str | None:
    """Where a tensor an op reads (``key``: its storage) was fetched: the line of the outermost user
    frame inside the step that holds it, or an object holding it as an attribute (a metadata record
    read from a global context), in a variable of its own (not a parameter: it was handed that). The
    function that bound the tensor the capture froze; a tensor handed down from outside stays at the
    op."""
    for frame, own in _own_variables(top):
        if any(_holds(v, key) for v in own):
            return location(frame)
    return None


def _holds(value, key: int) -> bool:
    """Whether ``value`` is the tensor, or holds it one level down: an element of a tuple or list (a
    named tuple of metadata), a value of a dict, an attribute of an object."""
    if isinstance(value, torch.Tensor):
        return storage_key(value) == key
    if isinstance(value, (tuple, list)):
        inner = value
    elif isinstance(value, dict):
        inner = value.values()
    elif isinstance(getattr(value, "__dict__", None), dict) and not isinstance(value, type):
        inner = vars(value).values()
    else:
        return False
    return any(isinstance(v, torch.Tensor) and storage_key(v) == key for v in inner)


def _untraced(d: EagerRun, func, args, kwargs, run):
    """An op of an eager run without a trace: only the storages it creates are noted (a functional
    op's outputs are all new; an in-place op's output is its input)."""
    out = run()
    outs = (out,) if isinstance(out, torch.Tensor) else tensors(out)
    if mutable(func):
        keys = {storage_key(t) for t in op_tensors(args, kwargs)}
        d.new.update(k for o in outs if (k := storage_key(o)) not in keys)
    else:
        d.new.update(storage_key(o) for o in outs)
    return out


_LIFTS = (aten.lift_fresh, aten.lift_fresh_copy)
_NAMES: dict = {}


def _name(func) -> str:
    name = _NAMES.get(func)
    if name is None:
        name = _NAMES[func] = str(func)
    return name
