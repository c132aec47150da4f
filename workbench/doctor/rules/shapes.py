"""padded-shape-mismatch: eager code combines a padded replay's outputs with per-request tensors.

A graph serving ``real`` rows at its captured ``size`` hands out outputs of ``size`` rows, padded
rows included. Eager code after the replay (a PIECEWISE graph's eager piece, a sampler, a kernel
called next) often combines them with tensors it built for the real rows only -- state indices,
sequence lengths, per-request parameters -- and fails: an assertion on the batch size (vLLM's
``causal_conv1d_update``), a broadcast error, an index or shape error. The error names neither the
graph nor the padding. When the watched workload raises after a padded replay, the innermost user
frames of the traceback are searched for a tensor that is (a view of, or derived eagerly from) that
replay's outputs with ``size`` rows next to a tensor with ``real`` rows; the frame's line is the
site. Eager ops that combined such tensors before the failure are the fallback evidence.
A workload may catch its own failure and carry on (a test harness, a serving loop that logs and
drops the batch): under ``diagnose`` such errors are seen as they are raised (``doctor/raised.py``).
"""
from __future__ import annotations

import dataclasses
import itertools
import linecache
import re

import torch

from ...engine.errors import GraphError, IllegalMemoryAccess
from ...engine.opinfo import describe, op_tensors, storage_key, tensors
from ...engine.source import SKIP_DIRS, function_name, location, user_frame, user_frames
from .. import explain, explain_padding
from ..report import Finding
from ..tensors import first_line
from . import bound_in_capture, checks, sync


@dataclasses.dataclass
class PaddedStep:
    """The last served replay with padded rows: ``keys`` are the storages of its outputs and of
    tensors eager code derived from them with ``size`` rows; ``seen`` the first eager op that
    combined one of them with a tensor of ``real`` rows."""

    graph: str
    replay: int
    real: int
    size: int
    keys: set
    created: set = dataclasses.field(default_factory=set)     # the graph's own storages (not copied: per step)
    seen: tuple | None = None
    handed: tuple | None = None       # (code, source, storages) of the last function that packed them in a result

    def holds(self, key: int) -> bool:
        return key in self.keys or key in self.created


def handed_on(doctor, frame, value) -> None:
    """A user function returns after a padded replay: when its result packs the replay's padded
    rows into a per-request structure (a dict, a list, an object's attribute: ``output.hidden_states
    = hidden_states``), it handed them on unsliced. A bare tensor or a tuple is a graph's outputs
    passed up as they are (a runner's ``__call__``); a result packed for its consumers must hold the
    real rows only, so a later failure on those rows is named there (``_in_frame``)."""
    if isinstance(value, (torch.Tensor, tuple, int, float, str)):
        return
    step = doctor.padded_step
    keys = {k for t in _packed(value, 2) if _rows(t) == step.size and step.holds(k := _key(t))}
    if keys:
        step.handed = (frame.f_code, location(frame), keys)


def _packed(value, depth: int):
    """The tensors a result holds: in dicts, lists and tuples (their first 64 items), and in an
    object's attributes, ``depth`` levels down (the base types' methods: not a subclass's own)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 0 or isinstance(value, (str, bytes, int, float, torch.nn.Module, type)):
        return
    items = dict.values(value) if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else \
        dict.values(attrs) if isinstance(attrs := getattr(value, "__dict__", None), dict) else ()
    for v in itertools.islice(items, 64):
        yield from _packed(v, depth - 1)


def replayed(doctor, info, pending) -> None:
    """After a served replay: remember it when it served padded rows, forget the previous one."""
    if pending is None:
        return
    if pending.real >= pending.size or pending.outputs is None:
        doctor.padded_step = None
        return
    # Its outputs, and all memory it owns: a PIECEWISE piece hands its own tensors (not the step's
    # outputs) to the eager code that runs before the next piece.
    keys = {storage_key(t) for t in tensors(pending.outputs)}
    doctor.padded_step = PaddedStep(info.name, info.replays, pending.real, pending.size, keys, info.created)


def derived(doctor, func, args, kwargs, out) -> None:
    """An eager op after a padded replay: its results with ``size`` rows computed from the outputs
    carry the padded rows too; its combining them with ``real`` rows is noted."""
    step = doctor.padded_step
    inputs = op_tensors(args, kwargs)
    padded = [t for t in inputs if _rows(t) == step.size and step.holds(storage_key(t))]
    if not padded:
        return
    if step.seen is None:
        real = next((t for t in inputs if _rows(t) == step.real and not step.holds(storage_key(t))), None)
        if real is not None:
            step.seen = (str(func), user_frame(), describe(padded[0]), describe(real))
    step.keys.update(storage_key(o) for o in tensors(out) if _rows(o) == step.size)


def failed(doctor, error: BaseException) -> None:
    """The watched code raised out of ``watch()``: explain it when it met a padded replay's rows
    and real rows, in the innermost user frames or, failing that, in an eager op before."""
    step = doctor.padded_step
    if step is None or not explainable(error) or (doctor.replay_error is not None and doctor.replay_error[0] is error):
        return
    try:
        frames = []
        tb = error.__traceback__
        while tb is not None:
            frames.append((tb.tb_frame, tb.tb_lineno))
            tb = tb.tb_next
        message = first_line(error)
        found = next(filter(None, (_in_frame(step, f, line, message) for f, line in reversed(frames))), None)
        if found is None and step.seen is not None:
            found = (step.seen[1], f"{step.seen[2]} and {step.seen[3]}", _HERE, step.seen[0])
        if found is not None:
            _report(doctor, step, error, *found)
    except Exception as e:  # noqa: BLE001 - the doctor's own error, reported in the Report
        doctor.fail(e, "explaining the workload's error")


_HERE = "met at this line"


def _report(doctor, step: PaddedStep, error: BaseException, source: str, what: str, where: str = "",
            op: str | None = None) -> None:
    laid_out = _laid_out(doctor, error)
    if laid_out is not None and laid_out.source != source:
        return      # (the failing op's own line, over a frame further out that holds the replay's rows)
    numbers = {"replay": step.replay, "real": step.real, "size": step.size}
    finding = Finding(
        "padded-shape-mismatch", step.graph, op or type(error).__name__, what, source,
        f"the workload failed after replay {step.replay} of {step.graph}, which served {step.real} real rows of "
        f"{step.size}: {what} {where or _HERE} ({type(error).__name__}: {first_line(error)})",
        explain_padding.padded_shape_mismatch(step.graph, step.real, step.size), numbers)
    if laid_out is not None:        # (the same line, and the replay's tensor named: one failure, one finding)
        findings = doctor.report.findings
        findings[findings.index(laid_out)] = finding
    else:
        doctor.add(finding, ("padded-shape-mismatch", source))


def _in_frame(step: PaddedStep, frame, line: int, message: str = "") -> tuple[str, str, str] | None:
    """``(source line, the two quantities)`` when a user frame holds a tensor with the replay's padded
    rows and one with its real rows; else when the failing line itself names the padded rows (a
    number equal to the graph's size, or the replay's tensor) and the real ones (a tensor's rows or a
    list's length): a check such as ``assert batch_size * n == weights.shape[0]`` on a padded request
    count. Such a number is named where it entered the computation: the frame that handed it in
    as an argument is the site (``sync.handed_in``, as for a number read from a tensor). Else when the
    frame holds the replay's padded tensor and the error's ``message`` states both counts (a kernel's
    check: ``q.shape[0] (8) does not match qo_indptr[-1] (5)``): where the frame was handed that
    tensor as an argument, the line that called it is the site (``_checked``). Where the padded tensor
    came to this frame packed in another function's result (``handed_on``), that function is the site."""
    filename = frame.f_code.co_filename
    if filename.startswith(SKIP_DIRS) or filename.startswith("<"):
        return None
    named = [(n, t, _key(t)) for n, t in _named_tensors(frame.f_locals)]
    padded = next(((n, t) for n, t, k in named if _padded(step, t)), None)
    real = next(((n, t) for n, t, k in named if _rows(t) == step.real and not step.holds(k)), None)
    code = linecache.getline(filename, line).strip()
    if padded is not None and real is not None:
        what = (f"`{padded[0]}` {describe(padded[1])} (the graph's {step.size} rows) and `{real[0]}` "
                f"{describe(real[1])} ({step.real} real rows)")
        return _handed(step, frame, line, padded[1], what) or (location(frame, line), what, _HERE)
    on_line = sorted(set(re.findall(r"[A-Za-z_]\w*", code)) & frame.f_locals.keys())
    values = frame.f_locals
    number = next((n for n in on_line if _padded(step, values[n])), None)
    rows = next((n for n in on_line if n != number and _size(values[n]) == step.real), None)
    if (number is None or rows is None) and padded is not None and _states(message, step):
        what = (f"`{padded[0]}` {describe(padded[1])} (the graph's {step.size} rows) against {step.real} "
                f"({step.real} real rows), as the error states them")
        checked = [n for n in on_line if isinstance(values[n], torch.Tensor) and _padded(step, values[n])]
        return _handed(step, frame, line, padded[1], what) or _checked(frame, line, checked or [padded[0]], what) \
            or (location(frame, line), what, _HERE)
    if number is None or rows is None or all(_size(values[n]) is None for n in (number, rows)):
        return None                    # (two bare numbers are no evidence: one side must hold rows)
    what = (f"`{number}` {_quantity(values[number])} (the graph's {step.size} rows) and `{rows}` "
            f"{_quantity(values[rows])} ({step.real} real rows)")
    value = values[number]
    # A number is named where it was taken for the padded size (the replay's tensor needs no tracing).
    caller = None if isinstance(value, torch.Tensor) else \
        sync.handed_in([(frame, line), *((f, f.f_lineno) for f in user_frames(frame.f_back))],
                       lambda v: _number(v) == value)
    if caller is None:
        handed = _handed(step, frame, line, value, what) if isinstance(value, torch.Tensor) else None
        return handed or (location(frame, line), what, _HERE)
    return caller, f"{what}, compared in {function_name(frame.f_code)}", _HERE


def _handed(step: PaddedStep, frame, line: int, padded: torch.Tensor, what: str) -> tuple[str, str, str] | None:
    """The function that packed the padded rows into the result this frame consumes (``handed_on``),
    when that is not this frame's own function: the rows should have been sliced there."""
    if step.handed is None or step.handed[0] is frame.f_code or _key(padded) not in step.handed[2]:
        return None
    return step.handed[1], what, (f"met in {function_name(frame.f_code)} (line {line}), after "
                                  f"{function_name(step.handed[0])} handed the padded rows on, packed in its result")


def _checked(frame, line: int, names: list, what: str) -> tuple[str, str, str] | None:
    """Where a function that refused the padded tensors it was handed (``names``, the padded ones
    its failing line checks, all parameters: a kernel's or a library's check of its arguments'
    shapes, which real code raises below the user's frames) was called: the caller chose what to
    hand it. A function that checks a tensor it derived itself chose what it checks."""
    code = frame.f_code
    if any(n not in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount] for n in names) \
            or not (callers := user_frames(frame.f_back)):
        return None
    return location(callers[0], callers[0].f_lineno), what, (f"checked in {function_name(code)} (line {line}), "
                                                              "which was handed it as an argument")


def _states(message: str, step: PaddedStep) -> bool:
    """Whether an error's message names the graph's padded size and the real count as numbers of
    their own (``(8)``, ``= 8``), the padded one first."""
    numbers = [int(n) for n in re.findall(r"(?<![\w.])(\d+)(?![\w.])", message)]
    return step.size in numbers and step.real in numbers[numbers.index(step.size) + 1:]


def _number(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _size(value) -> int | None:
    """The rows of a tensor or the length of a list or tuple: what counts a batch."""
    if isinstance(value, torch.Tensor):
        return _rows(value)
    return len(value) if isinstance(value, (list, tuple)) else None


def _padded(step: PaddedStep, value) -> bool:
    """A number equal to the graph's padded size, or the replay's (or a derived) tensor of its rows."""
    if isinstance(value, torch.Tensor):
        return _rows(value) == step.size and step.holds(_key(value))
    return _number(value) == step.size


def _quantity(value) -> str:
    if isinstance(value, torch.Tensor):
        return describe(value)
    return f"of length {len(value)}" if isinstance(value, (list, tuple)) else f"= {value}"


def raised(doctor, error: BaseException, frame) -> bool:
    """An error met as it is raised (``doctor/raised.py``) after a padded replay, caught later or
    not: reported (True) when this frame holds the replay's padded rows and real rows."""
    if doctor.replay_error is not None and doctor.replay_error[0] is error:
        return False            # (a replay's own op raised it: not eager code meeting the replay's rows)
    found = _in_frame(doctor.padded_step, frame, frame.f_lineno, first_line(error)) if explainable(error) else None
    if found is not None:
        _report(doctor, doctor.padded_step, error, *found)
    return found is not None


def failed_op(doctor, func, args, kwargs, error: BaseException) -> None:
    """An eager op fails on a shape after the captures: one side has the rows a graph was captured
    for (its static inputs' views), the other fewer (the real requests). Eager code laying out a
    padded step (per-request offsets, lengths) sized one tensor by the padded count and the other
    by the real one, and the step fails before its replay: ``padded-shape-mismatch`` at the op's
    line. (Data larger than its destination is ``undersized-buffer``'s; this is the other way.) One
    failure is one finding: an op failure another rule explained already (a write into an announced
    buffer) is left to it, and so is one on a padded replay's tensors, which ``raised`` and
    ``failed`` tie to that replay (an op on none of them is laid out for a later step)."""
    if doctor.phase != "eager" or not explainable(error) or not doctor.graphs:
        return
    step, indexed = doctor.padded_step, unindexed(error, args)     # (an indexed write states its two sides)
    if step is not None and indexed is None and any(step.holds(_key(t)) for t in op_tensors(args, kwargs)):
        return
    pair = indexed or _mismatch(func, args, kwargs)
    graph = next((i for i in doctor.graphs.values() if pair and pair[0] in i.rows), None)
    source = user_frame()
    if graph is None or any(f.op == str(func) and f.source == source for f in doctor.report.findings):
        return
    size, real = pair
    other = next((i for i in doctor.graphs.values() if real in i.rows and size not in i.rows), None)
    if other is not None and (bound := bound_in_capture.finding(func, size, real, other, error)):
        doctor.add(bound, ("host-work-frozen", bound.source))
        return
    _laid_out_for(doctor, graph, other, str(func), "a tensor", size, real, source, error)


def failed_host_write(doctor, data: tuple, into: tuple, error: BaseException, source: str) -> None:
    """An item assignment into a host array (NumPy: no op is dispatched) after the captures failed on
    data with fewer rows than the slice it was written into, where that slice has the rows a graph
    was captured for: ``failed_op``'s contract on the write path runners stage host metadata with
    (``lens_np[:padded_bs] = real_lens``)."""
    if doctor.phase != "eager" or not doctor.graphs or len(data) != len(into) or not data \
            or data[1:] != into[1:] or data[0] >= into[0]:
        return
    size, real = into[0], data[0]
    graph = next((i for i in doctor.graphs.values() if size in i.rows), None)
    if graph is not None and not any(f.source == source for f in doctor.report.findings):
        other = next((i for i in doctor.graphs.values() if real in i.rows and size not in i.rows), None)
        _laid_out_for(doctor, graph, other, "item assignment", "a host array", size, real, source, error)


def _laid_out_for(doctor, graph, other, op: str, what: str, size: int, real: int, source: str, error) -> None:
    also = f" ({other.name} was captured for {real})" if other is not None else ""
    doctor.add(Finding(
        "padded-shape-mismatch", graph.name, op, f"{what} of {size} rows and one of {real}", source,
        f"after the captures, {op} failed on {what} of {size} rows ({graph.name} was captured for {size}) "
        f"against one of {real} rows{also}: {first_line(error)}",
        explain_padding.padded_layout_mismatch(graph.name, size, real, other and other.name),
        {"size": size, "real": real}), ("padded-shape-mismatch", source))


def _laid_out(doctor, error: BaseException) -> Finding | None:
    """``failed_op``'s finding of this error (an op that failed on none of a padded replay's
    tensors), if it made one."""
    return next((f for f in doctor.report.findings if f.kind == "padded-shape-mismatch"
                 and f.evidence.startswith("after the captures, ") and f.evidence.endswith(first_line(error))), None)


_UNINDEXED = re.compile(r"value tensor of shape \[([\d, ]*)\] cannot be broadcast to indexing result of shape "
                        r"\[([\d, ]*)\]")


def unindexed(error: BaseException, args) -> tuple[int, int] | None:
    """``(larger, smaller)`` of an indexed write (``buf[loc] = values``: ``args`` are ``index_put_``'s)
    whose values and indices disagree (torch: "value tensor of shape [7, 2] cannot be broadcast to
    indexing result of shape [8, 2]") in a dimension the indices make, neither 1: the destination
    holds every index it was given, so its size is not in question. A dimension the indexing result
    takes from the destination (values wider than its columns) is data that does not fit it."""
    found = _UNINDEXED.search(first_line(error))
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else None
    if found is None or not indices or indices[0] is None or any(
            i is not None and (not isinstance(i, torch.Tensor) or i.dtype == torch.bool) for i in indices):
        return None
    made = max(i.dim() for i in indices if i is not None)       # the leading dimensions the indices make
    values, result = ([int(n) for n in g.split(",") if n.strip()] for g in found.groups())
    for back, (x, y) in enumerate(zip(reversed(values), reversed(result))):
        if x != y and 1 not in (x, y) and min(x, y) > 0:
            return (max(x, y), min(x, y)) if len(result) - 1 - back < made else None
    return None


def _mismatch(func, args, kwargs) -> tuple[int, int] | None:
    """``(larger, smaller)``: the first two sizes of one dimension (right-aligned, as broadcasting
    aligns them) that differ and neither of which is 1, among the op's tensors and an ``expand``'s
    target sizes."""
    shapes = [tuple(t.shape) for t in op_tensors(args, kwargs) if t.dim()]
    if func is torch.ops.aten.expand.default and len(args) > 1:
        shapes.append(tuple(int(n) for n in args[1]))
    for a, b in zip(shapes, shapes[1:]):
        for x, y in zip(reversed(a), reversed(b)):
            if x != y and 1 not in (x, y) and min(x, y) > 0:
                return max(x, y), min(x, y)
    return None


def failed_size_check(doctor, error: BaseException, frame) -> None:
    """The program's own check that two tensors have as many rows failed while a graph is prepared
    (a warmup, a capture): it compares for equality (``checks.condition``) the rows of a view of an
    announced buffer the frame holds (a persistent bitmask laid out for the padded token layout,
    offsets sized for the largest batch) with the step's own: another tensor's rows (logits for the
    tokens this graph runs) or a count (the batch, plus one for offsets). The buffer's layout and
    the graph's batch disagree: ``padded-shape-mismatch``, at the check. Reported once the error
    proves a failure (``failures.explained``)."""
    if doctor.phase not in ("warmup", "capture") or not explainable(error):
        return
    compared = checks.condition(frame)
    if compared is None or compared[0] != "equal":
        return
    stated = set(compared[1])
    held = [(name, t) for name, t in _named_tensors(frame.f_locals) if t.dim() and t.shape[0] in stated]
    for name, t in held:
        buf = doctor.buffer(key) if (key := _key(t)) is not None else None
        other = next(((n, u) for n, u in held if u.shape[0] != t.shape[0] and doctor.buffer(_key(u)) is None), None)
        count = next((n for n in compared[1] if n != t.shape[0]), None)
        if buf is None or other is None and count is None:
            continue
        # (the other side a tensor of the step's, or a count the step gives: its batch, plus one for offsets)
        step = (other[0], other[1].shape[0], describe(other[1])) if other is not None else ("a count", count, count)
        graph = doctor.capturing.name if doctor.phase == "capture" and doctor.capturing else "the next capture"
        what = f"{name} ({buf.name}: {describe(t)}) and {step[0]} ({step[2]})"
        finding = Finding(
            "padded-shape-mismatch", graph, "check", what, location(frame),
            f"during {doctor.phase}, the program's check that {what} agree in rows failed: {first_line(error)}",
            explain.unmatched_layout(buf.name, t.shape[0], step[1]),
            {"buffer_rows": t.shape[0], "step_rows": step[1]})
        doctor.explanation = (id(error), finding, ("padded-shape-mismatch", "check", location(frame)))
        return


def failed_count_check(doctor, error: BaseException, frame) -> None:
    """The program's own check that two counts are equal fails in eager code after the captures,
    before any padded replay: one count is the rows a graph was captured for, the other fewer and
    no graph's size. The step being prepared for that graph built one side for its padded size (a
    query of the padded token count) and the other for the real requests (lengths that stop at the
    last real one): ``padded-shape-mismatch``, at the check. (More data than a graph's size is
    ``undersized-buffer``'s.) Reported once the error proves a failure (``failures.explained``)."""
    if doctor.phase != "eager" or doctor.padded_step is not None or not doctor.graphs or not explainable(error):
        return
    compared = checks.condition(frame)
    if compared is None or compared[0] != "equal":
        return
    size, real = max(compared[1]), min(compared[1])
    sizes = {n for info in doctor.graphs.values() for n in info.rows}
    graph = next((info for info in doctor.graphs.values() if size in info.rows), None)
    if graph is None or real <= 0 or real in sizes:
        return
    finding = Finding(
        "padded-shape-mismatch", graph.name, "check", f"counts {size} and {real}", location(frame),
        f"after the captures, the program's check that two counts are equal failed on {size} ({graph.name} was "
        f"captured for {size} rows) and {real}: {first_line(error)}",
        explain_padding.padded_layout_mismatch(graph.name, size, real), {"size": size, "real": real})
    doctor.explanation = (id(error), finding, ("padded-shape-mismatch", "check", location(frame)))


def explainable(error: BaseException) -> bool:
    """What a broken shape contract raises; not the engine's own errors (a refused capture, a guarded
    replay, a replay that read released memory), which the other rules explain."""
    return (isinstance(error, (AssertionError, IndexError, RuntimeError, ValueError))
            and not isinstance(error, (GraphError, IllegalMemoryAccess)))


def _named_tensors(local_vars: dict):
    for name, value in local_vars.items():
        if isinstance(value, (tuple, list)):
            yield from ((f"{name}[{i}]", v) for i, v in enumerate(value) if isinstance(v, torch.Tensor))
        elif isinstance(value, torch.Tensor):
            yield name, value


def _key(t: torch.Tensor) -> int | None:
    """A frame may hold tensors without a storage of their own (sparse, fake, nested)."""
    try:
        return storage_key(t)
    except (RuntimeError, NotImplementedError):
        return None


def _rows(t) -> int | None:
    return t.shape[0] if t.dim() else None
