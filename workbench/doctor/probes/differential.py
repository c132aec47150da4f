"""Differential replay: does a replay give what an eager run of the same step gives?

At sampled replays (every Nth served step with an ``eager`` callable) the doctor keeps the state the step may write
(every storage the graph writes, every announced buffer), runs ``eager()`` from that state after the replay, keeps
what it gives, and puts the replay's state back: the program goes on as if only the replay had run. Where outputs
(real rows) or state differ, the launch traces say where the replay's frozen Python parted from what Python decides
now (``launch``; on CUDA, the doctor's own records of the capture and of the eager run), and ``rootcause`` turns the
parting into a kind, an op, a tensor and a line. Python state the eager step rebinds is compared and put back
(``pystate``). Once per graph the step also runs from the state before the warmups (``startup``): a real step must not
depend on what dummy batches wrote.

Watching the eager step's ops (``eager_trace``: a dispatch mode on every op, a launch trace) costs more than the step
itself, so it is watched on a graph's first compared replay, on every ``TRACE_EVERY``-th after it, when the eager
form's closure cells hold other objects than at the compared replay before (a closure captured inside the step that
first ran it goes stale once that step rebinds its variables), and when the comparison finds a difference (run again,
watched, to localise it). The other runs take the doctor's mode off the stack, and cannot see memory they write
outside the kept state: a graph whose watched eager step wrote any is watched from then on, and the small tensors the
graph only reads (a cache the eager step may refill) are put back after each run.

No evidence against the replay: memory outside what the graph reads that the eager step writes before reading
(scratch), and what the previous replay left in memory the graph owns and never reads (a ``.grad`` the eager step
accumulates into where the graph assigns). Traces that part on a line run more or fewer times are run again to find
the looping frame (``launch.repeats``); a replay that raises is tried on its real rows, then as the whole step
(``failed``); no eager run waits forever (``waits``).

Where the workload announced its run without graphs (``probes/reference.py``) and a replay gives what that run gives
at the same step (or is the capture's own batch), two kinds of finding are held: an output that differs from the eager
form's (which is then not that step), and what the step would give from other starting memory (carried elements of
static inputs, the state before the warmups). They are reported once a replay gives another answer than that run,
noted otherwise; so are state the eager form writes otherwise and an output difference on a replay not paired with
that run's answer, unless the workload says its results agree (``events.results``).
"""
from __future__ import annotations

import sys

import torch
from torch._C import _pop_torch_dispatch_stack, _push_on_torch_dispatch_stack
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode

from ...engine.opinfo import storage_key
from ..tensors import alias, changed, disagrees, first_line, landed, max_abs_diff, rng_state, set_rng_state, whole
from ..rules import bounds, unread
from . import (captured_state, crashed, held, host_left, launch, nonfinite, pystate, reach, rootcause, row_writes,
               startup, unpadded, waits)
from .compare import compare, placed_as_handed, rows_of, without_unwritten
from .eager_trace import EagerRun

TRACE_EVERY = 8         # a graph's compared replays between two whose launch traces are recorded
_SMALL = 1 << 18        # bytes of a tensor the graph only reads that an eager run must not change (``_reads``)


def _state(doctor, info) -> dict:
    """key -> (typed whole storage, label) of everything the step may write (all its pieces')."""
    state = {}
    for piece in info.pending.span or (info,):
        for key, ext in piece.externals.items():
            if key in piece.writes and key not in state and (w := whole(ext.weak, ext.dtype)) is not None:
                state[key] = (w, ext.tensor)
    # (an announced buffer the capture itself allocated is its output, announced as the static input of
    # a graph that reads it next -- a partition's output fed to the next one -- not state it writes)
    created = set().union(*(piece.created for piece in info.pending.span or (info,)))
    for key, buf in doctor.buffers.items():
        t = buf.ref()
        if t is not None and key not in state and key not in created and isinstance(t, torch.Tensor):
            state[key] = (alias(t.untyped_storage(), t.dtype), buf.name)
    return state


def _reads(info, pending, pre: dict) -> list:
    """(whole storage, its bytes now) of the small tensors the step's graphs only read (metadata, a cache
    the eager step may refill): each eager run puts them back, so an unwatched one leaves no write behind."""
    small = {key: w for piece in pending.span or (info,) for key, ext in piece.externals.items()
             if key not in pre and (w := whole(ext.weak)) is not None and w.numel() <= _SMALL}
    return [(w, w.clone()) for w in small.values()]


def begin(doctor, info) -> None:
    """Keep the state before the step: at its replay, or for a PIECEWISE step when it is announced
    (before its eager regions), whose inputs written so far are then its window."""
    if info.pending.span:
        doctor.carried.replay_begins(doctor, info)
    if info.python is None:
        info.python = reach.watched(info.pending.eager)
    info.pending.host = pystate.keep(info.python, info.pending.eager)
    with _disable_current_modes():
        pending = info.pending
        landed(info.cuda)
        pending.pre = {key: (w, label, w.clone()) for key, (w, label) in _state(doctor, info).items()}
        pending.rng = rng_state(info.cuda)
        pending.carried = doctor.carried.of_step(doctor, info, pending)


def finish(doctor, info, pending) -> None:
    pre = pending.pre
    with _disable_current_modes():
        landed(info.cuda)
        replayed = {key: w.clone() for key, (w, _, _) in pre.items()}
        graph_out = without_unwritten(info, pending, rows_of(pending.outputs, pending.real, pending.size))
        rng_after = rng_state(info.cuda)
    _replayed_host(info, pending)
    with _disable_current_modes():                  # (after the replay: a PIECEWISE step's eager regions wrote them)
        pending.reads = _reads(info, pending, pre)
    padded = pending.real < pending.size
    info.padded_compared += padded
    # A padded step's rows are looked at (``row_writes``) on sampled steps, and after eager code wrote
    # persistent state (a prefill, pages migrated): then for what real rows read that padded rows write.
    periodic = padded and (info.padded_compared - 1) % TRACE_EVERY == 0
    sampled = periodic or padded and doctor.state_moved
    doctor.state_moved &= not sampled
    cells = pystate.cells(pending.eager)
    cells_moved, info.cells = info.cells is not None and cells != info.cells, cells
    traced = info.traced_always or info.compared % TRACE_EVERY == 0 or sampled or cells_moved
    while True:
        run, got, error = _eager(doctor, info, pending, replayed, rng_after, traced=traced,
                                 rows=(pending.real, pending.size, periodic) if sampled and traced else None)
        what = None
        if error is None:
            eager_out, eager_state, extra = got
            with _disable_current_modes():          # the doctor's own arithmetic: not ops of the watched code
                scratch = {k for k in extra if k not in run.read_first and k not in info.externals} if traced else ()
                what = compare(graph_out, eager_out, replayed, eager_state,
                                {k: v for k, v in extra.items() if k not in scratch}, pre)
        if traced or error is not None or (what is None and not run.rebound):
            break
        traced = True                               # a difference: the same step again, traced, to localise it
    info.traced_always |= bool(run.extra)
    if traced and error is None and doctor.unread:
        unread.not_read_eagerly(doctor, info, run)
    doctor.compared += 1
    if error is not None:
        doctor.report.note(f"differential replay of {info.name}: the eager step raised "
                           f"{type(error).__name__}: {first_line(error)}")
        return
    divergence = launch.compare(*launch.traces(info, pending, run)) if traced else None
    if what is not None and (at := launch.repeats(divergence, *launch.traces(info, pending, run))) is not None:
        first = divergence.first_extra
        divergence.loop = first.source
        if at:                                   # once more, to see which frame runs the loop
            again, _, _ = _eager(doctor, info, pending, replayed, rng_after, traced=True, stacks=at)
            divergence.loop = again.loop or divergence.loop
    if what is not None:
        launch.trace_number(divergence, lambda **how: _eager(doctor, info, pending, replayed, rng_after, traced=True,
                                                             **how))
    if what is not None and divergence is not None and divergence.how == "reference" and divergence.eager_keys:
        again, _, _ = _eager(doctor, info, pending, replayed, rng_after, traced=True,     # where it was fetched
                             origin_of=(divergence.index, ("tensor", next(iter(divergence.eager_keys))),
                                        sys._getframe()))
        divergence.origin = again.origin
    with held(doctor, _state_held(doctor, info, pending)):     # (padded rows' writes into state, as below)
        row_writes.report(doctor, info, pending, run)
    if padded and nonfinite.outputs_hit(graph_out):    # once more, to see where the NaN came from
        again, _, _ = _eager(doctor, info, pending, replayed, rng_after, traced=True,
                             nonfinite=(pending.real, pending.size))
        nonfinite.report(doctor, info, pending, again)
    info.compared += 1
    info.disagreed |= (what is not None or bool(run.rebound)) and not pending.span and not pending.agreed
    if what is not None and run.read_outputs:
        note = (f"differential replay of {info.name}: the eager step reads what the previous replay left in memory "
                f"the graph owns and never reads ({run.read_outputs[0]}: a binding such as a parameter's .grad, which "
                "capture found empty), so it does not start from the replay's state; its difference "
                f"({what[0]}) is not evidence")
        doctor.report.note(note)
    elif what is not None:
        # An output that differs from the eager form's while it is what the workload's run without graphs
        # gives at the same step: the eager form (the captured callable) is not that step. Held, as below.
        # Otherwise, with a run without graphs, held apart (as state the eager form writes otherwise: the
        # replay's outputs do not show what state holds): reported unless the workload says its results
        # agree (``reference.conclude``), whether or not this replay could be paired with a step of that run.
        into = info.held if "output" in what[1] and _like_reference(pending) else _state_held(doctor, info, pending)
        with held(doctor, into):
            rootcause.classify(doctor, info, pending, what, divergence, run,
                               _host_work(doctor, info, pending, replayed, rng_after, run))
    elif run.rebound:   # host state the eager step leaves otherwise: held like state, as above
        with held(doctor, info.held_state if _like_reference(pending) else None):
            host = _host_work(doctor, info, pending, replayed, rng_after, run, {id(run.rebound[0][0])})
            rootcause.rebound(doctor, info, pending, run.rebound, run, host and host[2])
    elif run.settings and (host := _host_work(doctor, info, pending, replayed, rng_after, run,
                                              {id(c) for c, *_ in run.settings})) is not None:
        # (with a run without graphs, held until the workload's own results say whether the value mattered)
        with held(doctor, _state_held(doctor, info, pending)):
            rootcause.host_set(doctor, info, pending, run.settings, host)
    else:
        if divergence is not None:
            doctor.report.note(f"differential replay of {info.name}: launch traces differ ("
                               f"{divergence.text()}) but outputs and state agree on the sampled steps")
        # What the step would give from other starting memory (the static inputs' carried elements, the
        # state before the warmups) is held while the replay gives the run without graphs' answer at its
        # step (reported once a replay does not), or, where no step could be paired, until the results say.
        with held(doctor, info.held if _like_reference(pending) else _state_held(doctor, info, pending)):
            _from_other_memory(doctor, info, pending, replayed, rng_after, graph_out)
        if run.host and info.host_left is None:     # (once per graph: no evidence unless the results differ)
            host_left.keep(info, _host_work(doctor, info, pending, replayed, rng_after, host_left.grown(run)))
        if not padded:
            unpadded.owned_by_full_step(doctor, pending, replayed)
        elif sampled and pending.unpadded is not None:
            unpadded.check(doctor, info, pending, replayed, graph_out,
                           lambda step: _eager(doctor, info, pending, replayed, rng_after, step=step))
    row_writes.replays_wrote(doctor, pending, replayed)


def _like_reference(pending) -> bool:
    """Whether the replay gave the run without graphs' answer at its step, or was the capture's own
    batch replayed first (no step of that run, nothing to pair it with): its findings are held then,
    and reported once a replay of the graph gives another answer than that run."""
    return pending.agreed or pending.capture_batch


def _state_held(doctor, info, pending) -> list | None:
    """Where a difference in state this replay's eager step shows is held (``held``): while the replay
    gave the run without graphs' answer, or until the workload says whether its results agree."""
    return info.held_state if _like_reference(pending) or doctor.reference is not None else None


def _from_other_memory(doctor, info, pending, replayed: dict, rng_after, graph_out) -> None:
    """The step from other starting memory: the static inputs' elements it did not write put back
    (``carried``), and once per graph the state before the warmups (``startup``)."""
    carried = pending.carried
    # All inputs put back at once first: one eager run for the common case where none matters.
    if len(carried) == 1 or (carried and _carried_over(doctor, info, pending, replayed, rng_after, graph_out,
                                                      carried) is not None):
        for key, one in carried.items():
            if (what := _carried_over(doctor, info, pending, replayed, rng_after, graph_out, {key: one})):
                # (state alone differing -- the outputs agree -- and not held already is held as state is:
                # until the workload's results say whether what the step left in memory mattered)
                state_only = "output" not in what[1] and doctor.holding is None
                with held(doctor, _state_held(doctor, info, pending) if state_only else doctor.holding):
                    rootcause.carried(doctor, info, pending, what, info.externals[key], one,
                                      doctor.carried.refresh(info, pending, key, one))
                break
    if not info.startup_checked:
        info.startup_checked = True
        _from_before_warmups(doctor, info, pending, replayed, rng_after, graph_out)


def before_launch(doctor, info) -> BaseException | None:
    """On CUDA, before a sampled replay launches a graph that indexes: its step's eager form, run from
    the state before it with every index checked (``rules/bounds.py``; what the graph only reads put back
    as this step left it), gives the CPU's error where an index is out of range -- the replay's own, a
    device-side assert that ends the CUDA context. None where every index is in range (the replay runs)."""
    pending = info.pending
    if pending is None or not pending.pre or pending.span or not any(bounds.indexes(o.name) for o in info.ops):
        return None
    with _disable_current_modes():
        now = {key: w.clone() for key, (w, _, _) in pending.pre.items()}
        rng, pending.reads = rng_state(info.cuda), _reads(info, pending, pending.pre)
    _replayed_host(info, pending)
    run, _, _ = _eager(doctor, info, pending, now, rng, traced=True)
    return run.out_of_range


def failed(doctor, info, pending, error: BaseException) -> None:
    """A sampled replay raised. Padded: do its real rows alone complete (``unpadded.crashed``)? Else, does
    the whole step complete eagerly (``crashed``)? (The state the failed replay left is put back after each.)"""
    if not pending.pre:
        return
    with _disable_current_modes():
        left = {key: w.clone() for key, (w, _, _) in pending.pre.items()}
        rng_after = rng_state(info.cuda)
    _replayed_host(info, pending)
    if pending.real < pending.size and pending.unpadded is not None and unpadded.crashed(
            doctor, info, pending, error, lambda step: _eager(doctor, info, pending, left, rng_after, step=step)):
        return
    crashed.compare(doctor, info, pending, error,
                    lambda **how: _eager(doctor, info, pending, left, rng_after, traced=True, **how))


def _made_as_at_capture(info, pending, run, new) -> bool:
    """Whether the tensor the eager step bound was made by a line the capture also ran: the step's
    Python binds what it computes, which a replay never does again. (A cache an eager path grows
    for itself -- scratch the graph does not use -- is made by a line the capture never ran.)"""
    made = run.created_by.get(storage_key(new)) if isinstance(new, torch.Tensor) else None
    return made is None or any(op.source == made.source for g in pending.span or (info,) for op in g.ops)


def _host_work(doctor, info, pending, replayed: dict, rng_after, run, only: set | None = None) -> tuple | None:
    """(container's name, what changed, where, whether it rebinds a number) for the first Python
    container the eager step changed and the replay left alone (a queue drained, a counter moved),
    found by running the step once more, traced (``only``: among the containers of these ids,
    changed by a function the capture also ran in -- that ran an op there, or, under ``diagnose``'s
    tracer, any line: host work a path outside the capture does for itself, such as growing a cache
    only eager code uses, is not the graph's)."""
    for container, label, change, number, _ in run.host:
        if only is not None and id(container) not in only:
            continue
        kept = next((entry for entry in pending.host if entry[0] is container), None)
        if kept is not None:
            again, _, _ = _eager(doctor, info, pending, replayed, rng_after, host=kept)
            if again.host_line is not None and (only is None or any(
                    again.host_code in p.called or any(code is again.host_code for code, _ in p.lines_run)
                    for p in pending.span or (info,))):
                return label, change, again.host_line, number
    return None


def _replayed_host(info, pending) -> None:
    """The host state the replay left, which each eager run puts back when it is done. A graph's
    replay runs no Python: without eager regions in the step it is the state before the step."""
    pending.replayed_host = pystate.keep(info.python, pending.eager) if pending.span else pending.host


def _eager(doctor, info, pending, replayed: dict, rng_after, reset: dict | None = None, traced: bool = False,
           step=None, rows: tuple | None = None, stacks: tuple = (), host: tuple | None = None,
           origin_of: tuple = (), nonfinite: tuple | None = None):
    """Run the eager step (or ``step``, another eager form: the unpadded one) from the state before the
    replay (with ``reset``'s bytes put back as they were before the warmups), keep what it gives, and
    put the replay's state back, host state included (``pystate``). ``traced`` records its launch
    trace; otherwise the doctor's mode is taken off the stack while it runs, where it is on top.
    ``rows`` (real, size, sampled): the padded step's indexed writes are attributed to its rows
    (``row_writes``). ``host``: a kept container whose first change the run is traced for, line by
    line (``pystate.tracer``). ``origin_of``: a position in the trace and its numbers, traced back to
    the frame that holds them (``eager_trace``). ``nonfinite`` (real, size): see ``nonfinite``."""
    pre = pending.pre
    with _disable_current_modes():
        for w, _, before in pre.values():
            w.copy_(before)
        for now, mask, before, _ in (reset or {}).values():
            now[mask] = before[mask]
        set_rng_state(pending.rng)
    if pending.span:                            # (else each run ends where the step began: see below)
        pystate.put_back(pending.host)
    # Untraced, the doctor's mode steps aside -- unless this eager form is known to write memory the
    # replay does not (``extra``, kept and put back only by the mode): the run must leave no trace.
    aside = not traced and not info.traced_always and _get_current_dispatch_mode() is doctor.mode
    doctor.diff, doctor.phase = (EagerRun(set(pre), launch.graph_ops(info, pending), traced, not aside, rows,
                                          cuda=info.cuda, outputs=_unread_outputs(info, pending), stacks_at=stacks,
                                          origin_of=origin_of, nonfinite=nonfinite,
                                          branch_at=(info, sys._getframe()) if traced and not pending.span else ()),
                                  "differential")
    got = error = None
    with _disable_current_modes():
        given = captured_state.restore(doctor, info)
    try:
        with torch.set_grad_enabled(pending.grad), waits.bounded():    # (code may branch on is_grad_enabled())
            if aside:
                _pop_torch_dispatch_stack(None)
            if host is not None:
                trace, found, outer = *pystate.tracer(host), sys.gettrace()
                sys.settrace(trace)
            try:
                out = (step or pending.eager)()
            finally:
                if host is not None:
                    sys.settrace(outer)
                    doctor.diff.host_line, doctor.diff.host_code = found[0] if found else (None, None)
                if aside:
                    _push_on_torch_dispatch_stack(doctor.mode)
        with _disable_current_modes():
            landed(info.cuda)
            size = pending.size if step is None else pending.real      # an unpadded step has only real rows
            rows = placed_as_handed(rows_of(out, pending.real, size, owned=True), out, pending.outputs,
                                    info.returned_paths.get(getattr(pending.eager, "__code__", None)))
            got = (rows, {key: w.clone() for key, (w, _, _) in pre.items()},
                   {key: (before, w.clone()) for key, (w, before) in doctor.diff.extra.items()})
    except Exception as e:  # noqa: BLE001 - the eager step's failure is evidence, reported by the caller
        error = e
    finally:
        run, doctor.diff, doctor.phase = doctor.diff, None, "eager"
        run.branch_at = ()                     # (a frame keeps its locals alive)
        with _disable_current_modes():
            for key, (w, _, _) in pre.items():
                w.copy_(replayed[key])
            for w, before in [*run.extra.values(), *pending.reads]:
                w.copy_(before)
            for key, (now, mask, _, kept) in (reset or {}).items():
                if key not in pre:                  # (the replay's state, put back above, covers the rest)
                    now[mask] = kept.after[mask]
            set_rng_state(rng_after)
        captured_state.give_back(given)
        changed = pystate.differ(pending.replayed_host)
        told = pystate.told(changed, pending.replayed_host)
        run.rebound = [c for c in pystate.changes(told, run.new if run.seen else None)
                       if _made_as_at_capture(info, pending, run, c[3])]
        run.host = [(entry[0], entry[1], pystate.what_changed(entry), pystate.rebinds_number(entry),
                     pystate.grew(entry)) for entry in told]
        run.settings = pystate.settings(told)
        pystate.put_back(changed)
        pystate.take_back(run.rebound)
    return run, got, error


def _from_before_warmups(doctor, info, pending, replayed: dict, rng_after, graph_out) -> None:
    """Once per graph: the same eager step from the state as it was before the warmups, where they
    changed it and nothing rewrote it since. A different answer: the step reads what dummy batches
    wrote (``probes/startup.py``)."""
    reset = doctor.startup.dirty(info.externals.keys(), {key: before for key, (_, _, before) in pending.pre.items()})
    if not reset:
        return
    _, got, error = _eager(doctor, info, pending, replayed, rng_after, reset)
    if error is not None or graph_out is None or got[0] is None:
        return
    for i, (g, e) in enumerate(zip(graph_out, got[0])):
        if g is None or g.shape == e.shape and not bool(disagrees(g, e).any()):
            continue
        key, (_, mask, _, kept) = next(iter(reset.items()))
        label = startup.label(doctor, key, kept)
        text = (f"output {i} (real rows) differs by max |diff| = {max_abs_diff(g, e):.3g} between the replay and an "
                f"eager run of the same step from the state before the warmups ({int(mask.sum())} element(s) of "
                f"{label} put back, first written by {kept.op} in a warmup)")
        rootcause.startup(doctor, info, pending, text, {"output": i, "max_abs_diff": max_abs_diff(g, e),
                                                        "elements_reset": int(mask.sum())}, kept, label)
        return
    for key, (now, mask, before, kept) in reset.items():
        if key not in pending.pre:
            continue
        with _disable_current_modes():
            flat = lambda t: t.reshape(-1).view(torch.uint8).view(kept.dtype)  # noqa: E731
            was, after, eager = flat(pending.pre[key][2]), flat(replayed[key]), flat(got[1][key])
            start = was.clone()
            start[mask] = before[mask]
            # Elements this step writes (in either run) whose value depends on what the warmups left:
            # a count, a running statistic built on the dummy batches' contribution.
            built_on = (changed(was, after) | changed(start, eager)) & changed(after, eager)
        if bool(built_on.any()):
            label = startup.label(doctor, key, kept)
            text = (f"state {label}: {int(built_on.sum())} element(s) this step writes differ between the replay "
                    f"and an eager run of the same step from the state before the warmups ({int(mask.sum())} "
                    f"element(s) put back, first written by {kept.op} in a warmup): the step builds on what the "
                    "dummy batches wrote")
            rootcause.startup(doctor, info, pending, text, {"state": label, "elements": int(built_on.sum()),
                                                            "elements_reset": int(mask.sum())}, kept, label)
            return


def _unread_outputs(info, pending) -> frozenset:
    """Storages the step's graphs created and never read: what a replay leaves there is an output
    for the caller, which no replay reads back (a ``.grad`` that backward allocated in the graph)."""
    pieces = pending.span or (info,)
    for p in pieces:
        if p.unread_outputs is None:         # a capture's trace does not change: worked out once
            p.unread_outputs = frozenset(p.created) - frozenset().union(*(op.reads for op in p.ops))
    if len(pieces) == 1:
        return pieces[0].unread_outputs
    reads = frozenset().union(*(op.reads for p in pieces for op in p.ops))
    return frozenset().union(*(p.unread_outputs for p in pieces)) - reads


def _carried_over(doctor, info, pending, replayed: dict, rng_after, graph_out, carried: dict) -> tuple | None:
    """The same eager step with the elements of static inputs that this step did not write put back
    to their capture-time values (``probes/carried.py``): what differs from the replay, if anything,
    means the replay reads what an earlier step left there."""
    _, got, error = _eager(doctor, info, pending, replayed, rng_after,
                           {key: (c.now, c.mask, c.before, c) for key, c in carried.items()})
    if error is not None or got is None:
        return None
    eager_out, eager_state, _ = got
    with _disable_current_modes():
        return compare(graph_out, eager_out, {k: v for k, v in replayed.items() if k not in carried}, eager_state,
                        {}, pending.pre)
