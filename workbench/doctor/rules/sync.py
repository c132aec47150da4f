"""sync-in-capture: a host synchronisation attempted while a graph is captured.

The line that reads a number from a tensor (``item``, ``int()``, ``float()``, ``bool()``) is not
always the code to change. A helper that turns what it is given into a number (``_get_value(x)``,
a kernel wrapper converting its scale arguments to launch parameters) syncs because its caller
handed it a device tensor where a host value was needed: the finding names the frame that handed
the tensor in, found by walking out from the syncing frame for as long as the tensor reached each
frame as one of its arguments (or its ``*args``). Nor is a function named for the synchronisation
(a ``cuda_synchronize()`` helper, a stand-in for ``cudaStreamSynchronize``), one that only passes
a refused runtime call on (an event's ``wait()``), or one that synchronises before computing
anything of its own (a ``cudaMemcpy`` stand-in, a launch helper that takes the legacy stream when
given no stream): it is the sync itself, and the finding names the line that called it. Nor is a
function that raises CUDA's refusal of a call itself (a binding's status check,
``checkCudaErrors(...)``): the call was made by its caller.

A graph call CUDA refuses while a capture is open, a capture begun inside it (a library's throwaway
warmup capture) or a replay of another graph, fails the capture the same way: the engine raises
``CaptureError`` naming it, and it is reported here, never as the workload's own guard (``guarded``).
"""
from __future__ import annotations

import dis
import inspect

import torch

from ...engine.capture_mode import WaitedElsewhereError
from ...engine.errors import CaptureError
from ...engine.host_sync import UploadGuard, blocking_copy_error, host_sync_error, is_host_sync
from ...engine.opinfo import storage_key, tensors
from ...engine.source import forwards, frames_within, location, mine, mine_code, raises_at, user_frames
from .. import explain
from . import guarded
from ..report import Finding
from ..tensors import blocking_upload, device_to_host, host_only

_VALUE_READ = torch.ops.aten._local_scalar_dense


def check(doctor, info, func, args, kwargs, source: str) -> None:
    """A captured op that needs the device's values on the host. On CUDA the doctor stops it
    before CUDA invalidates the capture, as the CPU engine does. An op whose tensors all live in
    host memory (host tensors; beside a CUDA graph, the CPU's) reads no device: no sync."""
    if host_only(list(tensors(args)), info.cuda):
        return
    if is_host_sync(func, args, lambda t: storage_key(t) in info.constants) or device_to_host(func, args, kwargs):
        t = args[0] if func.overloadpacket is _VALUE_READ and args else None    # a number read from a tensor
        frames = [(f, f.f_lineno) for f in user_frames()]
        caller = handed_in(frames, lambda v: v is t) if t is not None else None
        finding(doctor, info.name, str(func), source, caller, _stand_in(frames))
        if info.cuda:
            raise host_sync_error(str(func), source, t)
    elif info.cuda and blocking_upload(func, args, kwargs):     # (the CPU engine refuses it itself)
        finding(doctor, info.name, str(func), source, None, _stand_in([(f, f.f_lineno) for f in user_frames()]))
        raise blocking_copy_error(source)


def guard_uploads(info) -> UploadGuard | None:
    """Around a CUDA capture: ``torch.tensor(data, device="cuda")`` copies Python data inside the
    factory, where no op shows it; the guard refuses it with the CPU engine's error."""
    if not info.cuda:
        return None
    guard = UploadGuard()
    guard.__enter__()
    return guard


def leave_guard(doctor) -> None:
    guard, doctor.upload_guard = doctor.upload_guard, None
    if guard is not None:
        guard.__exit__(None, None, None)


def capture_failed(doctor, graph: str, error: BaseException, info=None) -> None:
    """A capture that raised: the engine refused a host sync (``CaptureError`` naming its op), or
    torch or CUDA refused one that no watched op showed (``refused``: CUDA's words, which a library's
    binding relays as its own error, on a GPU and on the CPU alike); else the workload's own check
    may have refused the capture (``guarded.py``). A refusal raised earlier in the capture and caught
    (``info.refused``) is what invalidated it, whatever error ends it."""
    frames = _user_frames(error.__traceback__)
    if info is not None and info.refused is not None and info.refused[0] != (id(error), type(error)):
        refused_earlier(doctor, info)
    elif isinstance(error, WaitedElsewhereError):
        _elsewhere(doctor, graph, error)
    elif (named := _named(error, frames, error.__traceback__)) is not None:
        finding(doctor, graph, *named)
    else:
        guarded.refused(doctor, graph, frames, error)     # the workload's own guard refused it


def raised_in_capture(doctor, error: BaseException, tb) -> None:
    """A refusal raised while a capture is open, seen as it is raised (``raised.py``; ``tb``: its
    traceback so far): CUDA invalidates the capture there, whatever the workload does next. Code may
    catch it and go on with the capture still open (a capture begun and left open on an early
    return, so the steps after it run inside it); the capture then ends, if ever, with another error
    or none, and this refusal is what to name (``refused_earlier``). What the finding needs is taken
    now, with the frames it passed and those still running above them, and kept without them."""
    info = doctor.capturing
    if info is None or info.refused is not None or isinstance(error, WaitedElsewhereError):
        return
    if frames := _user_frames(tb):
        frames += [(f, f.f_lineno) for f in user_frames(frames[-1][0].f_back)]
    if (named := _named(error, frames, tb)) is None:
        return
    opened, also = doctor.warm.opened, ""
    if opened is not None and frames_within(opened) is None:     # (no longer running)
        also = (f"; the capture was begun at {info.site}, and that function returned at "
                f"{location(opened, opened.f_lineno)} with it still open, so the code after it ran inside the capture")
    info.refused = ((id(error), type(error)), named, also)      # (an id alone may be a freed error's)


def refused_earlier(doctor, info) -> None:
    """The capture ended, by an error of its own or none, after a refusal it raised was caught."""
    _, (op, source, caller, stand_in, relayed), also = info.refused
    finding(doctor, info.name, op, source, caller, stand_in, relayed=relayed, also=also)


def _elsewhere(doctor, graph: str, error) -> None:
    """A capture invalidated by another thread's wait. In 'global' mode it is named at the capture, whose
    mode forbade the wait; in another mode the wait (a device-wide synchronize) is refused whatever the
    capture does, and is named where it was made."""
    source = error.source if error.mode == "global" else error.waited_at
    doctor.add(Finding(
        "sync-in-capture", graph, error.op, "-", source,
        f"{error.op} at {error.waited_at}, on another thread, waited for the device while {graph} was being "
        f"captured in {error.mode!r} mode: CUDA refused it there and invalidated the capture",
        explain.sync_elsewhere(error.op, error.mode)), ("sync-in-capture", error.op, source))


def _named(error: BaseException, frames: list, tb) -> tuple | None:
    """(op, line, caller, stand-in, relayed) of a refusal, from the user's frames it passed (innermost
    first), or None if it is none. The engine refused a host sync during capture (the CPU backend),
    naming its op and line. Else CUDA, or torch's check before it, aborted the capture for a host
    copy or sync that no op the doctor watches showed first (a factory copying Python data,
    ``torch.tensor(1.0, device=...)``, inside a backward pass, which runs on autograd's device
    thread, where the doctor's function mode is not): the innermost user frame asked for it."""
    if isinstance(error, CaptureError) and error.op is not None:
        t = error.tensor() if error.tensor is not None else None
        caller = handed_in(frames, lambda v: v is t) if t is not None else None
        if error.source is None and frames:     # the workload's own code raised it, naming no line: as CUDA's below
            relay = _relay(tb, frames)
            return error.op, location(*frames[0]), caller, relay or _stand_in(frames, error.op, t is None), \
                relay is not None
        return error.op, error.source or "<unknown>", caller, _stand_in(frames, error.op, t is None), False
    op = next((what for words, what in _REFUSED.items() if words in str(error)), None)
    if op is None or not frames:
        return None
    relay = _relay(tb, frames) if op == _REFUSED_CALL else None
    return op, location(*frames[0]), None, relay or _stand_in(frames, call=op == _REFUSED_CALL), relay is not None


# What CUDA, or torch's own check before it, raises for a host copy or synchronisation in a capture.
_REFUSED_CALL = "a call not permitted in a capture"     # CUDA's error 900, which libraries relay as their own
_REFUSED = {"during CUDA graph capture unless the CPU tensor is pinned": "a copy from pageable host memory",
            "operation not permitted when stream is capturing": _REFUSED_CALL,
            "Cannot prepare for replay during capturing stage": "a replay while a capture is open"}


def _relay(tb, frames: list) -> str | None:
    """Where the refused call was made, when the innermost user frame raised CUDA's error 900 itself:
    that is a driver call's status, which a binding's status check (``checkCudaErrors(cudart.
    cudaStreamBeginCapture(...))``, a driver wrapper's ``check_err``) raises for a call its caller
    made, whose line is the one to change. Known by the frame's last instruction, a ``raise``; an
    error torch or CUDA raised stops at a call. (Torch's refusal of a pageable copy is raised at the
    copy: its line is the site.)"""
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None or len(frames) < 2 or tb.tb_frame is not frames[0][0]:
        return None
    return location(*frames[1]) if raises_at(tb.tb_frame.f_code, tb.tb_lasti) else None


def _user_frames(tb) -> list:
    """The user's frames of a traceback, with their lines, innermost first."""
    frames = []
    while tb is not None:
        if mine(tb.tb_frame):
            frames.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    return frames[::-1]


def same_memory(t: torch.Tensor):
    """A test for ``handed_in``: ``t``, or a tensor that starts where it starts (a function handed a
    buffer that copies its first elements, ``src[:count]``, was handed what it copies; one handed an
    arena that picks a slot in it chose the slot itself)."""
    key, start = storage_key(t), t.data_ptr()
    return lambda v: v is t or (isinstance(v, torch.Tensor) and storage_key(v) == key and v.data_ptr() == start)


def handed_in(frames: list, same) -> str | None:
    """``frames`` (innermost first, with their lines): the line of the first frame, walking out,
    that did not receive a value ``same`` accepts (the tensor, a number) as an argument, when the
    first frame did; else None (as when that frame only closes over it: the captured lambda of a
    runner). A value the code was handed was chosen by its caller: that is where to look."""
    i = 0
    while i + 1 < len(frames) and is_argument(frames[i][0], same):
        i += 1
    if not i or _closed_over(frames[i][0], same):
        return None                 # (a closure's variable: chosen where the closure was made, not here)
    return location(*frames[i])


def _stand_in(frames: list, op: str | None = None, call: bool = False) -> str | None:
    """``frames`` (innermost first): where the innermost one was called, when its function is named
    for a synchronisation or for the refused op itself (it is the sync, a runtime call's stand-in, not
    the code that decided to make it); else None. Where the refused thing is a runtime call (``call``:
    a stream or device synchronisation, not an op reading a tensor), a function that only passes
    that call on (``forwards``: an event's ``wait()`` that synchronizes) is its stand-in too, and so
    is each such wrapper around it, walking out; where the refused call is a wait, so is a function
    whose one call is the line that waits (``_bare``: an allocation's release that waits for the
    stream when it holds memory; not a benchmark that launched first, nor a lazy compile's caller)."""
    name = frames[0][0].f_code.co_name.lower() if frames else ""
    i = int(len(frames) > 1 and ("sync" in name or op is not None and name == op.lower()
                                 or call and _waits(op) and _unprepared(*frames[0])))
    while call and i + 1 < len(frames) and (forwards(frames[i][0].f_code) or _waits(op) and _bare(*frames[i])):
        i += 1
    return location(*frames[i]) if i else None


def _waits(op: str | None) -> bool:
    """A device, stream or event synchronisation (not a tensor's values read, not a copy)."""
    return op is not None and ("synchronize" in op or "wait" in op.lower())


def _unprepared(frame, line: int) -> bool:
    """Whether a function synchronised before doing anything of its own: above that line it assigns
    no local variable and names none of the workload's functions or classes, so only its arguments
    chose the path there (a ``cudaMemcpy`` stand-in that synchronises, a launch helper that takes
    the legacy stream when no stream is given). It is the runtime's call as its caller asked for it."""
    return not _own_work(frame, lambda n: n < line, calls=False)


def _bare(frame, line: int) -> bool:
    """Whether a function does nothing but the call on ``line`` (which led to a wait): on its other
    lines it does no work of its own and calls nothing; it may test and set its object's fields (a
    release that waits only when it holds memory)."""
    return not _own_work(frame, lambda n: n != line, calls=True)


def _own_work(frame, on, calls: bool) -> bool:
    """Whether, on the lines ``on`` accepts, the frame's function assigns a local variable that is not
    a parameter, names one of the workload's functions or classes, or (``calls``) calls anything."""
    code = frame.f_code
    given = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & inspect.CO_VARARGS) \
        + bool(code.co_flags & inspect.CO_VARKEYWORDS)
    parameters = set(code.co_varnames[:given])
    for i in dis.get_instructions(code):
        if i.positions.lineno is None or not on(i.positions.lineno):
            continue
        if i.opname in ("STORE_FAST", "STORE_DEREF") and i.argval not in parameters \
                or i.opname in ("LOAD_GLOBAL", "LOAD_NAME") and _workload_code(frame.f_globals.get(i.argval)) \
                or calls and i.opname.startswith("CALL"):
            return True
    return False


def _workload_code(value) -> bool:
    """A function or class defined in the workload's own code."""
    code = getattr(value, "__code__", None)
    if code is None and isinstance(value, type):
        code = getattr(getattr(value, "__init__", None), "__code__", None)
    return code is not None and mine_code(code)


def is_argument(frame, same) -> bool:
    """Whether one of the frame's parameters (or an element of its ``*args``) is the value."""
    code, values = frame.f_code, frame.f_locals
    n = code.co_argcount + code.co_kwonlyargcount
    if any(name in values and same(values[name]) for name in code.co_varnames[:n]):
        return True
    rest = values.get(code.co_varnames[n]) if code.co_flags & inspect.CO_VARARGS else None
    return isinstance(rest, tuple) and any(same(x) for x in rest)


def _closed_over(frame, same) -> bool:
    """Whether the frame holds the value only as a variable of an enclosing scope (a lambda's), or
    as an element of one (a captured ``lambda: model(*static_inputs)`` unpacking its inputs)."""
    code, values = frame.f_code, frame.f_locals
    names = [name for name, value in values.items()
             if same(value) or isinstance(value, (tuple, list)) and any(same(x) for x in value)]
    return bool(names) and all(name in code.co_freevars for name in names)


def finding(doctor, graph: str, op: str, source: str, caller: str | None = None, stand_in: str | None = None,
            relayed: bool = False, also: str = "") -> None:
    """``caller``: where the tensor the sync read was handed in; ``stand_in``: where a function named
    for the sync was called, or one that relayed the refusal of a call its caller made (``relayed``)."""
    evidence = f"{op} was called while {graph} was being captured"
    if caller is not None:
        evidence += (f", at {source}, on a tensor it was given as an argument: the device tensor was handed in at "
                     f"{caller}")
    elif stand_in is not None:
        evidence += (f", at {source}, in a function that raised the refusal of a call made at {stand_in}"
                     if relayed else f", at {source}, in a function that is the synchronisation itself, called at "
                     f"{stand_in}")
    evidence += also
    doctor.add(Finding("sync-in-capture", graph, op, "-", caller or stand_in or source, evidence,
                       explain.sync(op, host_read=op != _REFUSED_CALL)), ("sync-in-capture", op, source))


def handled(doctor) -> None:
    """The workload went on without raising, and its results equal its run without graphs': a capture
    refused for a host synchronisation was handled (falling back to eager is a fix idiom). It is a note."""
    for f in doctor.report.of("sync-in-capture"):
        doctor.report.findings.remove(f)
        doctor.report.note(f"sync-in-capture at {f.location} ({f.evidence}): the capture failed, the workload "
                           "went on without raising, and its results equal the run without graphs': handled, "
                           "not reported")
