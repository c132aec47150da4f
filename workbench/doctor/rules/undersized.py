"""undersized-buffer: shape contracts of static buffers, on every write path and every replay.

* an announced buffer with a zero-sized dimension (a capture for no data), and a warmup or capture
  that failed having cut every announced input it took rows of to no rows (``empty_batch.py``);
* a write into an announced buffer, in eager code, a warmup or a capture, by any op (``copy_``,
  slice assignment, ``index_put_``, ``fill_``...): data that does not fit its destination, an op
  that fails on it, or a slice that asks for more rows or columns than the buffer has (Python
  clamps it silently, so data is dropped without an error);
* a replay announced for more real rows than the graph's size, or more real columns than the
  padded-columns buffer holds;
* a lookup past a table's end in a dummy batch or a padded replay (``lookups``);
* a write that fails because its data does not fit its destination, announced or not (a runner
  fills a buffer before it announces it, and a buffer a capture sized is reused by later steps):
  data larger than the destination, or an index past its end;
* an op of a warmup or a capture that fails on the shape of a static input it reads: the captured
  code runs on the runner's buffers, and those do not have the shape it computes with.
"""
from __future__ import annotations

import re

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ...engine import memory
from ...engine.opinfo import describe, op_tensors, storage_key, written_tensors
from ...engine.source import location, mine, user_frame
from .. import explain
from ..report import Finding
from ..tensors import first_line
from . import checks, shapes, unwritten, where
from .extent import graph_memory

_OPEN_END = 2 ** 62          # ``x[a:]`` slices up to sys.maxsize


def announced(doctor, owner: str, buffers: dict) -> None:
    """One finding per announcement: the inputs of one capture are sized by one computation, so
    several empty ones share one cause. It points at the first; the evidence lists them all. It is
    kept until a graph captured on them (the next capture: they are its inputs) or reading one is
    served a step with real rows (``served_data``): a graph captured for no data and replayed for
    no data (an expert no token was routed to) is consistent."""
    empty = {name: t for name, t in buffers.items() if 0 in t.shape}
    if not empty:
        return
    name, t = next(iter(empty.items()))
    op, source = memory.created_by(t) or ("-", "<created before watch()>")
    evidence = "; ".join(f"{n} has shape {tuple(x.shape)}: dimension {list(x.shape).index(0)} is 0"
                         for n, x in empty.items())
    if len(empty) > 1:
        evidence = f"{len(empty)} of {len(buffers)} capture inputs are empty: {evidence}"
    doctor.empty_inputs.append(({storage_key(x) for x in empty.values()}, set(), Finding(
        "undersized-buffer", f"capture inputs of {owner}", op, f"{name}: {describe(t)}", source, evidence,
        explain.zero_sized(name, tuple(t.shape)), {"shape": list(t.shape), "empty_inputs": list(empty)}),
        ("undersized-buffer", owner, name)))


def captured(doctor, info) -> None:
    """A capture ended: empty inputs announced since the last one are its inputs (the captured code
    may take another path for them and read none)."""
    for _, graphs, *_ in doctor.empty_inputs:
        if not graphs:
            graphs.add(id(info))


def served_data(doctor, info, real: int) -> None:
    """A step with real rows is served by a graph captured on empty inputs, or reading one: a finding."""
    if real > 0 and doctor.empty_inputs and info is not None:
        for entry in [e for e in doctor.empty_inputs if id(info) in e[1] or e[0] & info.externals.keys()]:
            doctor.add(*entry[2:])
            doctor.empty_inputs.remove(entry)


def check_fit(doctor, dst: torch.Tensor, src) -> None:
    """``copy_`` of data that does not broadcast to its destination in an announced buffer."""
    if not isinstance(src, torch.Tensor) or src.shape == dst.shape:     # the common case, decided first
        return
    _check_shape(doctor, dst, tuple(src.shape))


def failed_item_write(doctor, t: torch.Tensor, index, value) -> None:
    """``tensor[...] = data`` failed: if the data is larger than the elements it names in some
    dimension (after dropping its leading dimensions of size one, as item assignment does), the
    write did not fit. The assignment fails inside ``expand``, before any copy is dispatched, so
    ``check_fit`` and ``failed_write`` never see it. Into an announced buffer, the buffer is named."""
    if not isinstance(value, torch.Tensor):
        return
    with _disable_current_modes():
        try:
            target = t[index]
        except (IndexError, RuntimeError, TypeError, ValueError):
            return                                   # the index itself fails: not this contract
    shape = list(value.shape)
    while len(shape) > target.dim() and shape[0] == 1:
        shape.pop(0)
    if len(shape) > target.dim() or not any(s > d for s, d in zip(reversed(shape), reversed(target.shape))):
        return
    if doctor.buffer(storage_key(t)) is not None:
        _check_shape(doctor, target, tuple(shape))
        return
    source = user_frame()
    made = memory.created_by(t)
    origin = f" (the tensor was created by {made[0]} at {made[1]})" if made else ""
    doctor.add(Finding(
        "undersized-buffer", where(doctor), "item assignment", describe(t), source,
        f"during {where(doctor)}, an item assignment of data of shape {tuple(value.shape)} into elements of shape "
        f"{tuple(target.shape)} of a tensor of shape {tuple(t.shape)} failed{origin}",
        explain.unfit_write(f"data of shape {tuple(value.shape)} into {tuple(target.shape)}"),
        {"destination_shape": list(target.shape)}), ("undersized-buffer", "write", source))


def _check_shape(doctor, dst: torch.Tensor, src: tuple) -> None:
    buf = doctor.buffer(storage_key(dst))
    if buf is None:
        return
    try:
        fits = torch.broadcast_shapes(src, dst.shape) == dst.shape
    except RuntimeError:
        fits = False
    if fits:
        return
    whole = buf.ref()
    source = user_frame()
    doctor.add(Finding(
        "undersized-buffer", buf.owner, str(torch.ops.aten.copy_.default), f"{buf.name}: {describe(whole)}", source,
        f"data of shape {src} copied into {buf.name} rows of shape {tuple(dst.shape)} "
        f"(the whole buffer is {tuple(whole.shape)}; during {where(doctor)})",
        explain.overflow(buf.name, src, tuple(whole.shape)),
        {"data_shape": list(src), "buffer_shape": list(whole.shape)}),
        ("undersized-buffer", buf.owner, buf.name, source))


def check_slice(doctor, args) -> None:
    """``buffer[a:b]`` (``aten.slice``) with ``b`` past the end of an announced buffer's dimension;
    of any other tensor, noted (``clamped``: an op may fail on the short view)."""
    t, end = args[0], args[3] if len(args) > 3 else None
    buf = doctor.buffers.get(storage_key(t)) if doctor.buffers else None
    if buf is None or buf.ref() is None:
        if type(end) is int and end < _OPEN_END and (len(args) < 5 or args[4] == 1) \
                and end > t.shape[dim := args[1] if len(args) > 1 else 0]:
            doctor.clamped.sliced(doctor, t, dim, args[2] if len(args) > 2 else 0, end)
        return
    doctor.empty_batch.sliced(doctor, buf, t, args)
    if isinstance(end, int) and end < _OPEN_END:
        _past_end(doctor, buf, args[1] if len(args) > 1 else 0, end, t.shape)


def check_index(doctor, t: torch.Tensor, index) -> None:
    """``buffer[a:b, c:d] = ...``: Python's item assignment slices without dispatching an op, so
    the slices of the index are checked against the buffer's dimensions here."""
    buf = doctor.buffer(storage_key(t))
    if buf is None:
        return
    dim = 0
    for item in index if isinstance(index, tuple) else (index,):
        if isinstance(item, slice):
            if isinstance(item.stop, int) and (item.step or 1) > 0 and dim < t.dim():
                _past_end(doctor, buf, dim, item.stop, t.shape)
        elif item is Ellipsis or item is None or isinstance(item, torch.Tensor):
            return                               # dimensions no longer line up with the index
        dim += 1


def check_range(doctor, t: torch.Tensor, dim: int, end: int, op: str) -> None:
    """A range ``[.., end)`` of dimension ``dim`` asked of ``t`` by ``op`` (``narrow``, which raises
    where a slice clamps): past the end of an announced buffer, the contract of a slice assignment."""
    buf = doctor.buffer(storage_key(t))
    if buf is not None and -t.dim() <= dim < t.dim():
        _past_end(doctor, buf, dim % t.dim(), end, t.shape, op)


def _past_end(doctor, buf, dim: int, end: int, shape, op: str = "a slice") -> None:
    """``op`` asked for ``[.., end)`` of a dimension of ``length``: a slice clamps (the rest is
    dropped), ``narrow`` raises."""
    length = shape[dim]
    if end <= length:
        return
    source, clamped = user_frame(), op == "a slice"
    doctor.add(Finding(
        "undersized-buffer", buf.owner, str(torch.ops.aten.slice.Tensor) if clamped else op,
        f"{buf.name}: {describe(buf.ref())}",
        source, f"{op} asks for [.., {end}) of dimension {dim} of {buf.name}, which has {length} (during "
        f"{where(doctor)}): " + (f"{end - length} silently dropped" if clamped else "it failed"),
        explain.overflow_slice(buf.name, dim, end, length),
        {"dim": dim, "end": end, "length": length}), ("undersized-buffer", buf.owner, buf.name, source))


def write(doctor, func, targets: list, run):
    """Run a write into announced buffers; if the op itself fails on them, that failure is the
    finding (the error is still the watched code's, and is raised)."""
    if not targets:
        return run()
    try:
        return run()
    except (RuntimeError, IndexError) as e:          # an index past the end is an IndexError
        if unwritten.failed(doctor, func, run.args, run.kwargs, e) or shapes.unindexed(e, run.args):
            raise                                # the index, or the values against it: not the buffer
        _, t, buf = targets[0]
        source = user_frame()
        doctor.add(Finding(
            "undersized-buffer", buf.owner, str(func), f"{buf.name}: {describe(buf.ref())}", source,
            f"{func} into {buf.name} (view {describe(t)}, during {where(doctor)}) failed: {first_line(e)}",
            explain.failed_write(buf.name, first_line(e)), {"view_shape": list(t.shape)}),
            ("undersized-buffer", buf.owner, buf.name, source))
        raise


def failed_write(doctor, func, args, kwargs, error: BaseException) -> None:
    """A write by the watched code (eager, warmup or capture) failed because its data does not fit
    its destination: larger than it in some dimension (one it lacks counts as one row: three rows of
    positions per token into a buffer of one), or indexed past its end; or, in a warmup or
    a capture (which write the buffers replays will use), as many rows as the destination but
    another width (logits of a reduced vocabulary into a buffer sized for the full one). Writes
    into announced buffers are ``write``'s; smaller data in the rows (a real-row count against a
    padded one) is not this kind, nor is an in-place pointwise op (``loc -= lens``) on memory no graph
    reads or made: two operands that do not broadcast, left to ``shapes.failed_op``."""
    written = written_tensors(func, args, kwargs)
    if not written or doctor.buffer(storage_key(written[0])) is not None:
        return
    dst, src = written[0], next((a for a in args[1:] if isinstance(a, torch.Tensor)), None)
    if torch.Tag.pointwise in func.tags and graph_memory(doctor, storage_key(dst)) is None:
        return
    if isinstance(error, IndexError) and "out of bounds" in str(error):
        what = "an index past its end"
    elif isinstance(src, torch.Tensor) and any(     # (a dimension the destination lacks holds one row)
            s > d for s, d in zip(reversed(src.shape), [*reversed(dst.shape), *[1] * src.dim()])):
        what = f"data of shape {tuple(src.shape)}"
    elif isinstance(src, torch.Tensor) and doctor.phase in ("warmup", "capture") and src.dim() == dst.dim() > 1 \
            and src.shape[0] == dst.shape[0] and src.shape[1:] != dst.shape[1:]:
        what = f"data of shape {tuple(src.shape)} (the rows the destination has, another width)"
    else:
        return
    source = user_frame()
    made = memory.created_by(dst)
    origin = f", created by {made[0]} at {made[1]}" if made else ""
    doctor.add(Finding(
        "undersized-buffer", where(doctor), str(func), describe(dst), source,
        f"during {where(doctor)}, {func} wrote {what} into a destination of shape {tuple(dst.shape)} "
        f"(its storage holds {dst.untyped_storage().nbytes() // dst.element_size()} elements{origin}) and failed: "
        f"{first_line(error)}", explain.unfit_write(first_line(error)), {"destination_shape": list(dst.shape)}),
        ("undersized-buffer", "write", source))


def failed_allocation(doctor, func, args, kwargs, error: BaseException) -> None:
    """An op that makes a tensor failed on the size it was given: a negative dimension. The size of
    a buffer was computed wrongly (a storage span of an empty view, a count that went below zero);
    the buffer a graph reads, or a step writes, is sized where this line asks for it."""
    if "negative dimension" not in first_line(error) or written_tensors(func, args, kwargs):
        return
    source = user_frame()
    doctor.add(Finding(
        "undersized-buffer", where(doctor), str(func), "-", source,
        f"during {where(doctor)}, {func} was asked for a tensor of a negative size and failed: {first_line(error)}",
        explain.negative_size(first_line(error)), {}), ("undersized-buffer", "allocation", source))


_SHAPE_ERROR = re.compile(r"shape|size|dimension", re.IGNORECASE)


def failed_read(doctor, func, args, kwargs, error: BaseException) -> None:
    """An op of a warmup or a capture failed on the shape of a static input it reads (a matmul whose
    inner dimensions differ, a concatenation of mismatched rows): the model runs eagerly on its
    own tensors, and here it runs on the runner's buffers, which were made another shape. The
    finding is where the buffer was made, which decided its shape; the failing op is the evidence.
    (Writes into buffers, and lookups past their end, are the rules above.)"""
    if doctor.phase not in ("warmup", "capture") or type(error) is not RuntimeError \
            or not _SHAPE_ERROR.search(first_line(error)) or written_tensors(func, args, kwargs):
        return
    read = next(((t, b) for t in op_tensors(args, kwargs) if (b := doctor.buffer(storage_key(t))) is not None
                 and b.role == "input" and b.ref() is not None), None)
    if read is None:
        return
    t, buf = read
    whole, at = buf.ref(), user_frame()
    made = memory.created_by(whole)
    op, source = made if made else ("-", buf.source or at)
    doctor.add(Finding(
        "undersized-buffer", where(doctor), op, f"{buf.name}: {describe(whole)}", source,
        f"during {where(doctor)}, {func} failed on {buf.name} (view {describe(t)}) at {at}: {first_line(error)}; "
        f"the buffer was made at {source}", explain.misshaped_input(buf.name, tuple(whole.shape), first_line(error)),
        {"buffer_shape": list(whole.shape)}), ("undersized-buffer", buf.owner, buf.name, "read"))


_BROADCAST = re.compile(r"could not broadcast input array from shape \(([\d, ]*)\) into shape \(([\d, ]*)\)")


def failed_host_write(doctor, error: BaseException, frame) -> None:
    """An item assignment into a host array (``staging[i, :n] = row``, NumPy: no op is dispatched)
    failed because its data does not fit: the same contract as ``failed_write``, on the write path
    runners use for host staging buffers. Only NumPy's own messages are read: a larger source in
    some dimension, or an index past the end of an axis."""
    text = first_line(error)
    found = _BROADCAST.search(text) if isinstance(error, ValueError) else None
    if found is not None:
        src, dst = ([int(n) for n in g.replace(" ", "").split(",") if n] for g in found.groups())
        if not any(a > b for a, b in zip(reversed(src), reversed(dst))):
            shapes.failed_host_write(doctor, tuple(src), tuple(dst), error, location(frame))   # (fewer rows)
            return
        what, shape = f"data of shape {tuple(src)}", tuple(dst)
    elif isinstance(error, IndexError) and "out of bounds for axis" in text:
        what, shape = "an index past its end", None
    else:
        return
    source = location(frame)
    doctor.add(Finding(
        "undersized-buffer", where(doctor), "item assignment", "a host array" + (f" of shape {shape}" if shape else ""),
        source, f"during {where(doctor)}, an item assignment wrote {what} into a host array and failed: {text}",
        explain.unfit_write(text), {"destination_shape": list(shape) if shape else None}),
        ("undersized-buffer", "write", source))


_NUMBER = re.compile(r"(?<![\w.])\d+(?!\w|\.\d)")      # (a sentence may end after one: ``size is 20.``)


def failed_fit_check(doctor, error: BaseException, frame) -> None:
    """A check of the program's own that data fits a buffer (``assert len(data) <= buf.numel(),
    f"too large for {name}: {len(data)} > {buf.numel()}"``) failed: the message, or the compared
    operands (``checks.condition``), state the size of a tensor the raising frame holds, and a
    larger number (in elements or bytes). That is this rule's contract, checked by
    the program: where the buffer is a static input or memory a graph reads (a buffer the check
    measures, kept on an object: ``assert n <= self.buf.size(0)``, or kept on the object whose method
    checks), or while captures are being prepared (a pool made and nothing captured yet, a warmup, a
    capture: a capture size's dummy batch), the buffer is smaller than what the step must put in it.
    Where the buffer is the checking object's own and that object was given a count, not the data
    (an arena locked at capture), the finding names the caller that asked (``_asker``). Reported
    once the error proves a failure."""
    if not isinstance(error, (AssertionError, ValueError, RuntimeError)):
        return
    preparing = doctor.phase in ("warmup", "capture") or not doctor.graphs and bool(doctor.pools)
    compared = checks.condition(frame)
    if compared is not None and compared[0] == "equal":
        return                                # two counts that must agree: no data past a buffer
    numbers = [int(n) for n in _NUMBER.findall(first_line(error))]
    held = [t for t in frame.f_locals.values() if isinstance(t, torch.Tensor) and t.dim()]
    sizes = {n for t in held for n in (t.shape[0], t.numel())}
    # (two tensors' sizes a message states may be sizes that must match -- ``bitmask 6 rows, logits 2
    # rows`` -- no data past a buffer; an ordering the check's source compares says which must hold which)
    numbers = [n for n in numbers if not any(n > m for m in numbers) or n not in sizes] + (
        compared[1] if compared else [])
    owner = frame.f_locals.get("self")
    kept = [(f"self.{k}", v) for k, v in vars(owner).items()] if hasattr(owner, "__dict__") else []
    for name, t in checks.measured(frame) + list(frame.f_locals.items()) + kept:
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or not numbers:
            continue
        buf = doctor.buffer(key := storage_key(t))
        if not preparing and (buf is None or buf.role != "input") and key not in doctor.graph_reads:
            continue
        # (a row or a column short, or the whole of it, in elements or in bytes)
        size = next((n for n in (*t.shape, t.numel(), t.numel() * t.element_size()) if n in numbers), None)
        if size is None or not any(n > size for n in numbers):
            continue
        owned = any(v is t or _holds(v, t) for _, v in kept)
        at = _asker(frame, owner) if owned and not _data_here(frame, t, max(numbers)) else frame
        source, graph, when = location(at), where(doctor), where(doctor)
        if preparing and graph == "eager":
            graph, when = "the first capture", "the set-up of the captures (a graph pool made, nothing captured yet)"
        what = f"{buf.name if buf is not None else name}: {describe(t)}"
        said = first_line(error) or (f"a bare {type(error).__name__}; the check compared {compared[1][0]} with "
                                     f"{compared[1][1]}" if compared else f"a bare {type(error).__name__}")
        finding = Finding(
            "undersized-buffer", graph, "check", what, source,
            f"during {when}, the program's check that data fits {what} failed: {said}",
            explain.unfit_write(said), {"size": size, "asked": max(numbers)})
        doctor.explanation = (id(error), finding, ("undersized-buffer", "check", source))
        return


def _holds(container, t: torch.Tensor) -> bool:
    """Whether a list, tuple or dict an object keeps holds ``t`` (a pool of arenas, one per stream)."""
    if isinstance(container, dict):
        container = list(container.values())
    return isinstance(container, (list, tuple)) and any(v is t for v in container)


def _data_here(frame, buf: torch.Tensor, asked: int) -> bool:
    """Whether the frame holds the data that does not fit (a sequence or tensor of ``asked`` items,
    other than the buffer): a store helper given the data, not an allocator given a count."""
    return any(v is not buf and (isinstance(v, (list, tuple)) or isinstance(v, torch.Tensor) and v.dim())
               and len(v) == asked for v in frame.f_locals.values())


def _asker(frame, owner):
    """The frame that asked a buffer's owner for more than its buffer holds: the first caller that is
    not a method of that same object. An owner that hands out its memory by count and refuses to grow
    (an arena locked at capture, a bump allocator) checks requests for every caller; the request that
    did not fit was made where it was computed, by the code that uses the memory."""
    caller = frame.f_back
    while caller is not None and caller.f_locals.get("self") is owner:
        caller = caller.f_back
    return caller if caller is not None and mine(caller) else frame


def serve_contract(doctor, graph: str, real: int, size: int, padded: dict, columns: dict) -> None:
    """Every replay: no more real rows than the graph's size, no wider real columns than captured."""
    if real > size:
        source = user_frame()
        name = next(iter(padded), "-")
        doctor.add(Finding(
            "undersized-buffer", graph, "serve", name, source,
            f"serve announced {real} real rows for {graph} (size {size})", explain.over_served("rows", real, size),
            {"real": real, "size": size}), ("undersized-buffer", graph, "rows", source))
    for name, (t, width) in columns.items():
        if width > t.shape[1]:
            source = user_frame()
            doctor.add(Finding(
                "undersized-buffer", graph, "serve", f"{name}: {describe(t)}", source,
                f"serve announced {width} real columns of {name}, which has {t.shape[1]}",
                explain.over_served(f"columns of `{name}`", width, t.shape[1]), {"real_columns": width,
                                                                                 "columns": t.shape[1]}),
                ("undersized-buffer", graph, name, source))
