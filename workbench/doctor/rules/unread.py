"""undersized-buffer: a step copies data into a static input where its graph never reads.

A static input that no graph reads at all, while the runner brings it data for the steps they
serve, may have been left out of what the capture ran (a branch taken on an argument the capture
was not given: ``inputs_embeds=None``), or be a buffer the runner keeps for kernels the graphs do
not use: a note says so, not a finding. Where the captured code names it on a line the capture did
not run, it is ``warmup-divergence`` there; beside a run without graphs, only where the workload's
results part from it (a buffer filled for another path's steps, which the graph never serves).

A graph reads the views of its static inputs that the capture read: ``input_ids[:, :3]`` if it
was captured on a batch of three tokens, whatever the buffer's width. A later step that copies four
tokens into a row the graph reads is served by a graph that reads three of them: the fourth is
dropped without an error (lmdeploy #4005: a bucket's graph captured on the first batch's token
count). Only columns of rows the graph reads count: a runner may fill a whole buffer of which a
graph reads a prefix of rows (an end offset, rows for a larger size).

With differential replay on, the doctor notes the views each capture reads of each static input,
and the elements eager code copies into static inputs (``copy_``, slice assignment) between two
replays. Before a replay, elements copied since the previous replay outside the one window of a
buffer the graph reads are held: another graph's replay or eager code that reads them clears them
(a runner keeps data there for its own use); overwritten, or still unread when the watch ends, they
were data the step brought and nobody used. Fills (``zero_``, ``fill_``, a copy of one value: a
runner neutralising a whole buffer) bring no data and are not counted. Nor are columns past the
window's end, in rows the graph reads, that the eager step of a differential replay reads none of
either (a verifier given every draft's coins reads all but the last): the step's own code leaves
them, not the capture; unless set-up code cut the window, which the eager step reads through too.

Inside the window a graph reads, data is lost another way: the same line copies into it again, with
other values, before anything read the first copy (a metadata builder run for each of two draft
steps on one buffer, one replay after both). That is ``persistent-mutation`` at the copy: the step's
own code overwrote a static input's data before its consumer read it.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ...engine.opinfo import describe, op_tensors, overwrites, storage_key, written_tensors
from ...engine.source import user_frame
from .. import explain, skipped
from ..report import Finding
from ..probes import held, release
from . import derived
from ..tensors import broadcasts, onto, region

_HOST_READ = torch.ops.aten.alias.default      # a read-only op standing for a host read in ``touched``
_VIEWS = 1 << 14                               # set-up views' lines kept (``view_taken``)


def read_view(doctor, info, key: int, t: torch.Tensor, source: str) -> None:
    """During a capture: a tensor a captured op reads; a view of a static input is kept as its
    geometry (masks are made after the capture, whose stream must record none of the doctor's work),
    with the line of the first op that read it."""
    buf = doctor.buffers.get(key)
    if buf is not None and buf.role == "input":
        geometry = (tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype)
        info.read_views.setdefault(key, {}).setdefault(geometry, source)


def capture_end(doctor, info) -> None:
    """Masks of what the graph reads, for the static inputs it reads through one window (a graph
    that picks several parts of a buffer -- a column per draft step -- leaves the rest by design)."""
    with _disable_current_modes():
        for key, views in info.read_views.items():
            buf = doctor.buffer(key)
            if buf is None or len(views) != 1:
                continue
            info.windows[key], set_up = _window_made(doctor, key, *views.items())
            whole = buf.ref()
            mask = torch.zeros(whole.shape, dtype=torch.bool, device=whole.device)
            for shape, stride, offset, dtype in views:
                view = torch.empty(0, dtype=dtype, device=whole.device).set_(whole.untyped_storage(), offset, shape,
                                                                             stride)
                mask |= region(view, whole)
            info.reads[key], info.outside[key] = mask, (*outside(mask), set_up)
    # (their rows: the size the graph was captured for, which ``shapes.failed_op`` looks for)
    info.rows = frozenset(shape[0] for views in info.read_views.values() for shape, *_ in views if shape)
    info.read_views = {}


def view_taken(doctor, view: torch.Tensor) -> None:
    """Eager set-up code took a view (before the first replay, with differential replay on; not in
    the run without graphs): where, by its geometry."""
    if len(doctor.views) < _VIEWS and (doctor.reference is None or not doctor.reference.recording):
        doctor.views.setdefault((storage_key(view), view.storage_offset(), tuple(view.shape), view.stride()),
                                user_frame())


def _window_made(doctor, key: int, view: tuple) -> tuple:
    """Where the one view of a static input a graph reads was cut: the line of set-up code that took
    it (``view_taken``), else the captured op that read it (a view taken inside the captured code is
    taken where it is used); and whether set-up code took it."""
    (shape, stride, offset, _), reader = view
    set_up = doctor.views.get((key, offset, shape, stride))
    return set_up or reader, set_up is not None


def copied(doctor, targets: list, src) -> None:
    """Eager code is about to copy ``src`` into announced buffers (``[(key, written view, Buffer)]``):
    the elements whose values it changes are data this step brings (rewriting what is there brings
    none). A source holding one value everywhere is a fill, not data. Data a line copied earlier in
    this step that the same line now changes never reaches a reader (``_lost``); a step's copies end
    at a replay, or when eager code reads data copied since (an eager step ran on them)."""
    if isinstance(src, torch.Tensor) and src.numel() > 1 and _uniform(src):
        return
    for key, dst, buf in targets:
        if buf.role != "input":
            continue
        comparable = isinstance(src, torch.Tensor) and (src.dtype, src.device) == (dst.dtype, dst.device) \
            and broadcasts(src, dst)
        entry, source = doctor.copied.get(key), user_frame()
        lines = doctor.copied_lines.setdefault(key, {})
        with _disable_current_modes():
            whole = buf.ref()
            mask = last = region(dst, whole)
            if source in lines and key in doctor.graph_reads and isinstance(src, torch.Tensor) \
                    and broadcasts(src, dst):     # (a host-to-device copy too: compared as copy_ casts)
                changes = dst != src.to(dst.device, dst.dtype)
                _lost(doctor, key, buf, source, lines[source] & mask & onto(changes, dst, whole))
            lines[source] = lines[source] | mask if source in lines else mask
            # Only where no graph reads the buffer (the data would be lost whole): a host-to-device
            # copy brings data, and so does one into memory graphs read (checked by their windows).
            if key not in doctor.graph_reads and comparable:
                mask &= ~onto(dst == src, dst, whole)
        doctor.copied[key] = (entry[0] | mask, entry[1], last) if entry is not None else (mask, source, last)


def _uniform(t: torch.Tensor) -> bool:
    with _disable_current_modes():
        flat = t.reshape(-1)
        return bool((flat == flat[0]).all()) or bool(flat.isnan().all())


def _lost(doctor, key: int, buf, source: str, lost) -> None:
    """Elements of a static input a graph reads that one line copied data into since the previous
    replay, that nothing read since, and that the same line now changes: the line runs once per
    consumer (a builder called for each draft step) on one buffer, and only its last data reaches
    the graph. (Another line patching what a bulk copy wrote, a next token over a shifted id, edits
    on purpose.)"""
    if not bool(lost.any()):
        return
    n = int(lost.sum())
    reader = next((g for g in doctor.graphs.values() if g.ref() is not None and key in g.externals), None)
    # Held where the workload has a run without graphs, until the reader's replays or the results part from
    # it: data overwritten on purpose (a prefetch of the next step's lengths, corrected before the replay) is
    # no drift.
    with held(doctor, reader.held) if reader is not None and doctor.reference is not None else nullcontext():
        doctor.add(Finding(
            "persistent-mutation", reader.name if reader else "-", "aten.copy_.default",
            f"{buf.name}: {describe(buf.ref())}", source,
            f"{n} element(s) of {buf.name} that this line copied data into since the previous replay, and that "
            "nothing read since, are overwritten by the same line with other values: its earlier data never "
            "reaches a reader", explain.lost_update(buf.name), {"elements_overwritten": n}),
            ("persistent-mutation", buf.name, "overwritten before read"))


def check(doctor, info) -> None:
    """Before a replay: elements copied since the previous replay that this graph does not read are
    held until something reads them (another graph, eager code after the replay: a runner may keep
    data there for its own use); overwritten or still unread at the end, they were dropped."""
    with _disable_current_modes():
        for key, entry in list(doctor.unread.items()):       # this replay reads what it reads
            if key in info.externals:
                _read(doctor, key, entry, info.reads.get(key))
        for key, (mask, source, last) in doctor.copied.items():
            reads = info.reads.get(key)
            if not bool(mask.any()):
                continue
            if reads is None and not _reads(info, key) and not _read_by_any(doctor, key) \
                    and not derived.feeds_a_graph(doctor, key):
                if (buf := doctor.buffer(key)) is not None:     # data for an input no graph reads at all
                    doctor.unread[key] = (mask, source, info.name, info.replays + 1, 0, buf.name, describe(buf.ref()),
                                          info.site, skipped.reader(info, buf.name))
                continue
            if reads is None or reads.shape != mask.shape:
                continue
            other_rows, past_end, _ = info.outside[key]
            _short_window(doctor, info, key, mask & last & other_rows, reads)
            lost = mask & past_end
            if bool(lost.any()) and (buf := doctor.buffer(key)) is not None:
                doctor.unread[key] = (lost, source, info.name, info.replays + 1, int(reads.sum()), buf.name,
                                      describe(buf.ref()), None, None)


def outside(reads) -> tuple:
    """Elements of a static input outside the mask a graph reads, as two masks (made once, at the
    capture's end): those in rows it does not read at all, and those in rows it reads, past the end
    of its window (``_past_end``): a row given more columns than the graph reads of it. (The second
    shrinks where the eager step does not read them either: ``not_read_eagerly``.)"""
    rows = reads.flatten(1).any(1).reshape(-1, *([1] * (reads.dim() - 1))) if reads.dim() > 1 \
        else torch.zeros_like(reads)
    return ~reads & ~rows, ~reads & rows & _past_end(reads)


def _past_end(reads):
    """Elements past the end of the window a graph reads, in a dimension other than rows that the
    window starts at 0 in: where data sized for a larger batch lands. A window that starts further
    in (this rank's segment of every peer's rows in a symmetric buffer) is a part of a layout the
    graph picks: what lies before it, and around it in that dimension, is not the graph's to read."""
    if reads.dim() < 2 or not bool(reads.any()):
        return torch.zeros_like(reads)
    at = reads.nonzero()
    lo, hi = at.min(0).values.tolist(), at.max(0).values.tolist()
    past, inside = torch.zeros_like(reads), torch.ones_like(reads)
    for d in range(1, reads.dim()):
        cut = [slice(None)] * reads.dim()
        if lo[d] > 0:
            cut[d] = slice(None, lo[d])
            inside[tuple(cut)] = False
            cut[d] = slice(hi[d] + 1, None)
            inside[tuple(cut)] = False
        else:
            cut[d] = slice(hi[d] + 1, None)
            past[tuple(cut)] = True
    return past & inside


def _short_window(doctor, info, key: int, past, reads) -> None:
    """Data copied this step (by the last copy into the buffer before the replay: an earlier one may
    have been an eager step's, a prefill's lengths) into rows of a static input that the graph's
    window of it ends before, among the step's real rows: the capture read a view of fewer rows than
    the graph serves (a per-token slot mapping sliced by the request count), and every replay leaves
    those rows' data unread. The window was fixed when the graph was captured: the line that cut it
    is named (``_window_made``), else the capture's. A buffer with fewer rows than the step's real
    rows has no row for each (a request's offsets, where the real rows are its tokens): not one of them."""
    pending = info.pending
    if pending is None or reads.dim() == 0 or not reads.any():
        return
    window = int(reads.reshape(reads.shape[0], -1).any(1).nonzero().max()) + 1
    if window >= pending.real or reads.shape[0] < pending.real or not bool(past[window:pending.real].any()) \
            or (buf := doctor.buffer(key)) is None:
        return
    made = info.windows.get(key, info.site)
    # (with a run without graphs, held until the workload's results say whether those rows mattered: a
    # per-request table that a step fills past what its kernels read, in eager form too, is no loss)
    with held(doctor, info.held_state if doctor.reference is not None else None):
        doctor.add(Finding(
            "undersized-buffer", info.name, "-", f"{buf.name}: {describe(buf.ref())}", made,
            f"replay {info.replays + 1} of {info.name} serves {pending.real} real rows, and the step copied data into "
            f"rows {window}..{pending.real - 1} of {buf.name}, but the graph reads only its first {window} row(s): "
            f"the view its capture read, cut at {made}", explain.short_window(buf.name, info.name),
            {"real": pending.real, "rows_read": window}), ("undersized-buffer", info.name, buf.name, "window"))


def touched(doctor, func, args, kwargs) -> None:
    """An eager op on a buffer holding unread data: reading clears it, overwriting drops it. Data
    copied since the last replay that eager code reads before the replay was used there."""
    written = {id(t) for t in written_tensors(func, args, kwargs)} if overwrites(func) else set()
    for t in op_tensors(args, kwargs):
        if (copy := doctor.copied.get(key := storage_key(t))) is not None and id(t) not in written \
                and (buf := doctor.buffer(key)) is not None:
            with _disable_current_modes():
                read = region(t, buf.ref())
                if read.shape != copy[0].shape:     # kept through another announced view of the storage
                    continue
                if bool((copy[0] & read).any()):
                    doctor.copied_lines.clear()    # the step's data is being used: the next copies are another's
                doctor.copied[key] = (copy[0] & ~read, *copy[1:])
        entry = doctor.unread.get(key)
        if entry is None or (buf := doctor.buffer(key)) is None:
            continue
        with _disable_current_modes():
            hit = region(t, buf.ref())
            if hit.shape != entry[0].shape or not bool((entry[0] & hit).any()):
                continue
        if id(t) in written:
            _dropped(doctor, key)
        else:
            _read(doctor, key, entry, hit)


def eager_read(doctor, run, func, args, kwargs, inputs) -> None:
    """An op of a differential replay's traced eager step: the elements it reads of static inputs
    whose data is held as unread (``not_read_eagerly``)."""
    written = {id(t) for t in written_tensors(func, args, kwargs)} if overwrites(func, args, kwargs) else set()
    for t in inputs:
        if id(t) not in written and (entry := doctor.unread.get(key := storage_key(t))) is not None \
                and (buf := doctor.buffer(key)) is not None:
            with _disable_current_modes():
                hit = region(t, buf.ref())
                if hit.shape == entry[0].shape:
                    run.unread_reads[key] = run.unread_reads[key] | hit if key in run.unread_reads else hit


def not_read_eagerly(doctor, info, run) -> None:
    """After a differential replay's traced eager step: data held as copied past the end of the
    window the graph reads in rows it reads (``check``), that the eager step reads none of while it
    reads the same buffer, is no data the graph drops. The step's own code reads part of what it is
    given (a verifier reads all drafts' coins but the last), in eager form too. Let go, at this replay
    and the graph's later ones; but not where set-up code cut the window (a view taken before capture,
    which the eager step reads through too: the window is frozen in both)."""
    for key, entry in list(doctor.unread.items()):
        if entry[2] != info.name or entry[7] is not None or entry[8] is not None or key not in run.unread_reads \
                or key not in info.outside or info.outside[key][2]:
            continue
        with _disable_current_modes():
            unused = entry[0] & ~run.unread_reads[key]
            other_rows, past_end, _ = info.outside[key]
            info.outside[key] = (other_rows, past_end & ~unused, False)
            _read(doctor, key, entry, unused)


def host_read(doctor, t: torch.Tensor) -> None:
    """A host read of a tensor (``tolist``, ``numpy``): an eager read like any other."""
    touched(doctor, _HOST_READ, (t,), {})


def finish(doctor) -> None:
    for key in list(doctor.unread):
        _dropped(doctor, key)
    _decide_dropped(doctor)


def _read(doctor, key: int, entry: tuple, mask) -> None:
    left = entry[0] & ~mask if mask is not None and mask.shape == entry[0].shape else entry[0] & False
    if bool(left.any()):
        doctor.unread[key] = (left, *entry[1:])
    else:
        del doctor.unread[key]


def _reads(info, key: int) -> bool:
    """Whether a captured op reads the storage (a view of it the capture took and never used is no read)."""
    return (ext := info.externals.get(key)) is not None and not ext.view_only


def _read_by_any(doctor, key: int) -> bool:
    return any(_reads(g, key) for g in doctor.graphs.values() if g.ref() is not None)


def _dropped(doctor, key: int) -> None:
    mask, source, graph, replay, read, name, shape, captured_at, passed_over = doctor.unread.pop(key)
    n = int(mask.sum())
    if passed_over is not None:      # the captured code names the buffer on a line the capture never ran
        _passed_over(doctor, graph, Finding(
            "warmup-divergence", graph, "-", f"{name}: {shape}", passed_over,
            f"the runner fills the static input {name} for the steps {graph} serves ({n} element(s) of new data "
            f"before replay {replay}, at {source}), but no graph reads it; the captured code names it on this line, "
            "which did not run during the capture", explain.passed_over(name, graph),
            {"elements_dropped": n}), ("warmup-divergence", graph, name, "passed over"))
        return
    if captured_at is not None:      # a note: a runner may keep a buffer the captured kernels do not use
        _note_unread(doctor, graph, name, n, replay, source, captured_at)
        return
    with held(doctor, doctor.unread_dropped):      # (decided at the end: ``_decide_dropped``)
        doctor.add(Finding(
            "undersized-buffer", graph, "aten.copy_.default", f"{name}: {shape}", source,
            f"before replay {replay} of {graph}, {n} element(s) were copied into {name} where the graph never "
            f"reads (it reads {read} element(s) of it, the views its capture read), and nothing read them before "
            "they were overwritten or the watch ended", explain.unread_copy(name, graph),
            {"elements_dropped": n, "elements_read": read}), ("undersized-buffer", graph, "copied, never read"))


def _decide_dropped(doctor) -> None:
    """Data a graph never read is lost only if the steps needed it: beside a run without graphs, a
    finding only where the workload's results part from it, and a note where they agree. Decided
    at the end, on the results, not on one replay's comparison with the step it was paired with (a
    count can pair a replay with another step). A kernel that pads the rest of a buffer it fills
    (vLLM's slot mapping: every slot past the step's tokens set to the pad id) writes where no graph
    of that size reads, and brings nothing a step needs."""
    if doctor.reference is None or doctor.reference.verdict != ():
        release(doctor, doctor.unread_dropped)      # each at the place in the report it would have had
        return
    first: dict = {}
    for finding, key, _ in doctor.unread_dropped:      # one note for each graph and buffer
        first.setdefault(key, finding)
    for finding in first.values():
        doctor.report.note(f"{finding.evidence} ({finding.location}), but the workload's results agree with its run "
                           "without graphs: what the graph left unread was nothing the steps needed: not reported")
    doctor.unread_dropped.clear()


def _passed_over(doctor, graph: str, finding: Finding, key: tuple) -> None:
    """A static input the graph's path at capture never read: a runner also fills a buffer for the
    other path's steps (a prefill branch's positions) while a graph serves only steps of its own
    path. Beside a run without graphs, that is a finding only where the workload's results part from
    it: held until they are known, and a note where they agree."""
    reference = doctor.reference
    if reference is None or reference.verdict:
        doctor.add(finding, key)
    elif reference.verdict == ():
        doctor.report.note(f"{finding.evidence} ({finding.location}), but the workload's results agree with its run "
                           "without graphs: the graph's path served its steps: not reported")
    else:
        info = next((g for g in doctor.graphs.values() if g.name == graph), None)
        with held(doctor, info.held_state if info is not None else None):
            doctor.add(finding, key)


def _note_unread(doctor, graph: str, name: str, n: int, replay: int, source: str, captured_at: str) -> None:
    """One note per graph and input, however many replays it was filled for (a note per replay
    buries the report): the first replay, and how many and how much since."""
    noted = doctor.unread_noted.get((graph, name))
    if noted is None:
        noted = doctor.unread_noted[(graph, name)] = [len(doctor.report.notes), 0, 0, replay]
        doctor.report.notes.append("")
    noted[1] += 1
    noted[2] += n
    when = f"before replay {replay}" if noted[1] == 1 else f"before {noted[1]} replays from replay {noted[3]} on"
    doctor.report.notes[noted[0]] = (
        f"the runner fills the static input {name} for the steps {graph} serves ({noted[2]} element(s) of new data "
        f"{when}, at {source}), but no graph reads {name}, nor anything computed from it: if the step needs it, "
        f"the capture took a path without it ({captured_at})")
