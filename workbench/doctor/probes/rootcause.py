"""From a differential replay that disagrees with its eager step to a kind, an op and a source line.

The launch traces say where the replay's frozen Python parted from what Python decides now; what
kind of parting it is decides the kind:

* the same op with other Python-decided arguments (a scalar, a shape, a constant) -- a value the
  host computed once, at capture, is baked into the graph: ``host-work-frozen``;
* the eager step rebinds Python state (an attribute, an entry of a dict) that the replay leaves as
  capture left it: ``host-work-frozen``, at the op that made the new value;
* the graph uses a pre-existing tensor where the eager step now uses another or a fresh one -- a
  reference frozen at capture: ``dangling-reference`` when that memory has no owner left or code
  outside the graph has written it since the capture (it was handed to someone else), else
  ``warmup-divergence``;
* the eager step launches work the graph never recorded (a plan, a lazy step, a branch), or the
  graph replays work Python no longer does: ``warmup-divergence``, at the first such op;
* the traces agree, but during the capture host code read or wrote, through NumPy or a pointer,
  memory the graph's ops use (``rules/host_writes.py``): ``host-work-frozen``, at the line that
  handed the memory over;
* the traces agree, but an op of the graph reads memory the graph allocated and none of its ops
  writes -- the work that filled it at capture ran where the capture does not record (another
  stream, thread, the host) -- ``host-work-frozen``, at the allocation;
* the traces agree but the numbers do not: ``dangling-reference`` at a captured copy from host
  memory that code outside the graph has written since the capture (a replay re-reads it by
  address: a temporary's memory handed on; announced host memory, a static input or state, the
  runner writes on purpose); else ``warmup-divergence``, at the op that wrote what
  differs.
"""
from __future__ import annotations

import dataclasses

from ...engine import memory
from ...engine.opinfo import describe, storage_key
from ...engine.source import user_frames
from .. import explain
from ..raised import decider
from ..records import Op
from ..report import Finding
from ..rules import host_writes
from . import pystate


def classify(doctor, info, pending, what: tuple, divergence, run, host: tuple | None = None) -> None:
    """A finding for a replay whose outputs or state differ from the eager step's (``what``).
    ``host``: (name, what changed, where, whether it rebinds a number) of Python state the eager step
    changed and the replay did not: where a number baked into the graph has no known origin, a number
    the step's Python rebinds is named as that origin."""
    text, numbers, key = what
    # (host memory the runner announced -- a static input, persistent state -- is written on purpose)
    handed = next(((k, e) for k, e in info.externals.items()
                   if e.host_copy and k in doctor.touched and doctor.buffer(k) is None), None)
    if handed is not None:
        ext = handed[1]
        kind, op, tensor = "dangling-reference", Op(*ext.host_copy), f"{ext.tensor} (host memory)"
        site = (f"{ext.host_copy[0]} at {ext.host_copy[1]} copies from host memory, "
                "which a replay re-reads at the address it was captured from; code outside the graph has written "
                f"that memory since the capture ({doctor.touched[handed[0]]}): the graph does not own it, and it was "
                "handed on (a temporary released after the capture, its memory given to the next one).")
    elif divergence is None and (written := host_writes.cause(info)) is not None:
        kind, op, tensor, site = written
    elif divergence is None and (unwritten := _read_unwritten(info)) is not None:
        kind, op, tensor, site = unwritten
    elif divergence is None:
        writer = info.writes.get(key) if key is not None else None
        op = writer or (info.ops[-1] if info.ops else None)
        kind, tensor = "warmup-divergence", _label(pending, key)
        site = ("The launch traces agree: the difference first shows at "
                f"{'the state it writes' if key is not None else 'the outputs'}.")
        if op is not None and (check := decider(user_frames())) is not None:
            op = dataclasses.replace(op, source=check)
            site += (f" The graph was chosen for this step by a check that answered at {check}: it replays the work "
                     "of the step it was captured for, on that step's memory, and the check (or key) does not tell "
                     "the two apart.")
    else:
        kind, op, tensor, site = parted(doctor, info, divergence, run)
        numbers = {**numbers, "launch": divergence.index + 1, "how": divergence.how}
        if divergence.how == "arguments" and divergence.origin is None and host is not None and host[3]:
            # a number no frame of the step holds, beside a number the step's Python rebinds each step
            _, change, line, _ = host
            op = dataclasses.replace(op, source=line)
            site += (f" The eager step {change} at {line}: host bookkeeping a replay never runs, so the number "
                     "it advances stays as the capture left it.")
        elif divergence.how == "arguments" and divergence.origin is None and divergence.passed is not None:
            op = dataclasses.replace(op, source=divergence.passed)
            site += f" The number is read and handed down at {divergence.passed}."
    if kind == "warmup-divergence" and host is not None:
        tensor, change, line, _ = host
        kind, op = "host-work-frozen", Op("-", line)
        site = (f"{site} The eager step {change} at {line}; a replay runs no Python, so that host work ran once, "
                "at capture, and what it decided then is what every replay repeats.")
    _add(doctor, info, pending, kind, op, tensor, text, site, numbers)


def parted(doctor, info, d, run) -> tuple:
    """``(kind, op, tensor, why)`` of where the launch traces part (``d``), as the module's docstring says."""
    site = f"First divergence in the launch traces: {d.text()}."
    if not info.ops and d.eager_runs_more:       # the capture recorded nothing of the step
        return ("host-work-frozen", Op("capture", info.site), _read_by(doctor, info, d.first_extra),
                f"{site} The capture of {info.name} recorded no launch at all, while the eager step launches its "
                "work: the captured code ran once, at capture, where the capture does not record (a stream of "
                "another device or thread), and every replay launches nothing, so the outputs keep what that "
                "run left. The capture is where the step's work was sent elsewhere.")
    branch = run.branch if d.eager_runs_more else None       # (its first op unlike the capture's: the divergence)
    if branch is not None and branch != d.first_extra.source:
        site += f" The eager step left the capture's path at {branch}."
    if d.loop is not None:                        # the same code, run another number of times
        op = d.first_extra
        more = "more" if d.eager_runs_more else "fewer"
        return ("host-work-frozen", dataclasses.replace(op, source=d.loop), _read_by(doctor, info, op),
                f"{site} The eager step runs the same code {more} times than the graph recorded ({d.inserted} op(s), "
                f"all of lines both ran): a count Python decided at capture (a loop over a Python number, a length "
                f"read on the host) is baked into the graph; {d.loop} runs it another number of times.")
    if d.how == "arguments":
        what = ("A view Python took at capture (where it starts in its storage, its shape) is baked into the "
                "graph" if d.tensor_argument() else "A value Python computed on the host at capture is baked into "
                "the graph")
        op = d.graph_op if d.origin is None else dataclasses.replace(d.graph_op, source=d.origin)
        came = f" The number comes from {d.origin}." if d.origin is not None and d.origin != d.graph_op.source else ""
        if (d.graph_op.name, d.graph_op.source) in info.taken_by_value and (key := decider(user_frames())):
            op = dataclasses.replace(d.graph_op, source=key)
            came += (f" It is the value of a static input the runner refreshes every step, which the graph took by "
                     f"value at capture; the key that chose this graph ({key}) does not hold that value, so a step "
                     "with another one replays a graph captured for this one.")
        return ("host-work-frozen", op, _read_by(doctor, info, d.graph_op),
                f"{site} {what}; the eager step computes it again now.{came}")
    if d.how == "reference":
        op = d.graph_op if d.origin is None else dataclasses.replace(d.graph_op, source=d.origin)
        if d.origin is not None and d.origin != d.graph_op.source:
            site += f" The step fetches that tensor at {d.origin}."
        return _frozen_reference(doctor, info, op, next(iter(d.graph_keys)), next(iter(d.eager_keys)), run, site)
    if d.how == "skipped":
        gone = d.graph_op.ext - d.after.ext
        if gone and d.after.reads - d.after.ext:      # the graph's pre-existing tensor, eager's fresh one
            kind, op, tensor, why = _frozen_reference(doctor, info, d.graph_op, next(iter(gone)), None, run, site)
            if kind == "dangling-reference":
                return kind, op, tensor, why
        return "warmup-divergence", _decided(branch, d.eager_op), "-", site
    op = _decided(branch, d.graph_op or d.eager_op)
    return "warmup-divergence", op, _read_by(doctor, info, op), site


def _decided(branch: str | None, op):
    """Work the eager step launches and the graph never recorded is named where the eager step left
    the capture's path (``branch``: the frame whose branch went another way), when the capture's
    lines are known."""
    return op if branch is None or branch == op.source else dataclasses.replace(op, source=branch)


def _frozen_reference(doctor, info, op, gkey: int, ekey: int | None, run, site: str) -> tuple:
    ext = info.externals.get(gkey)
    tensor = ext.tensor if ext else "-"
    created = (ext.origin or "before watch()") if ext else "-"
    if ekey is not None and (read := run.described.get(ekey)) is not None:
        now = f"a {describe(read)} created {memory.origin_of(read) or 'before watch()'}"
    else:
        now = "a tensor it allocates now"
    site += f" The graph uses the {tensor} created {created}; the eager step uses {now}: a reference frozen at capture."
    if ext is not None and ext.weak.expired():
        return "dangling-reference", op, tensor, site + " That memory has no owner left."
    if gkey in doctor.touched:
        return ("dangling-reference", op, tensor,
                site + f" Code outside the graph has written that memory since the capture ({doctor.touched[gkey]}): "
                       "it was handed on while the graph still uses it.")
    sibling = next((g for g in doctor.graphs.values() if g is not info and g.gone is not None
                    and g.gone_at > info.born and gkey in g.externals), None)
    if sibling is not None:     # the program lets go of the graphs that bind it there: this one it kept
        op = dataclasses.replace(op, source=sibling.gone[1])
        site += (f" The program let go of {sibling.name}, which reads that tensor too, at {sibling.gone[1]}, "
                 "after this graph was captured, and kept this one: the graphs bound to it are dropped there.")
    return "warmup-divergence", op, tensor, site


def rebound(doctor, info, pending, changed: list, run, bound_at: str | None = None) -> None:
    """The eager step rebound Python state that replays leave as capture left it. Named at the line
    that binds it (``bound_at``, where the traced run found it), else where the tensor was made."""
    obj, key, old, new = changed[0]
    made = run.created_by.get(storage_key(new)) if hasattr(new, "untyped_storage") else None
    op = made or (run.ops[-1] if run.ops else None)
    if bound_at is not None:
        op = Op(op.name if op is not None else "-", bound_at)
    value = describe(new) if hasattr(new, "untyped_storage") else repr(new)[:40]
    names = ", ".join(pystate.name(o, k) for o, k, _, _ in changed[:4]) + (", ..." if len(changed) > 4 else "")
    text = f"the eager step rebinds {names}; a replay runs no Python, so it leaves them as capture bound them"
    site = (f"{pystate.name(obj, key)} becomes a {value}"
            + (f" made by {made.name} at {made.source}" if made else "")
            + (f", bound at {bound_at}." if bound_at is not None else ".")
            + " Replays keep the binding capture made; state the step produces must live in memory the graph writes.")
    _add(doctor, info, pending, "host-work-frozen", op, f"{pystate.name(obj, key)}: {value}", text, site,
         {"rebound": len(changed)})


def host_set(doctor, info, pending, settings: list, host: tuple) -> None:
    """Outputs and state agree, but the eager step set Python values that the replay leaves as they
    are: host work inside the captured region that ran once, at capture (``pystate.settings``)."""
    _, change, line, _ = host
    names = ", ".join(f"{where} ({pystate.short(old)} -> {pystate.short(new)})" for _, where, old, new in settings[:3])
    names += ", ..." if len(settings) > 3 else ""
    text = f"outputs and state agree, but the eager step sets {names}, which the replay leaves as it found them"
    site = (f"The eager step {change} at {line}; a replay runs no Python, so that host work ran once, at capture. "
            "What changed it since (code outside the graph) is never undone by a replay, and code that reads it "
            "after the step sees what the eager step would not leave there.")
    _add(doctor, info, pending, "host-work-frozen", Op("-", line), settings[0][1], text, site,
         {"settings": len(settings)})


def startup(doctor, info, pending, text: str, numbers: dict, kept, tensor: str | None = None) -> None:
    """A real step's answer depends on what the warmups (dummy batches) wrote into ``kept``
    (``tensor``: its announced name, which keys the finding as other rules on that buffer do)."""
    tensor = tensor or kept.tensor
    doctor.add(Finding(
        "persistent-mutation", info.name, kept.op, tensor, kept.source,
        f"sampled replay {info.replays} of {info.name}: {text}",
        explain.startup_write(tensor, kept.op), {"replay": info.replays, **numbers}),
        ("persistent-mutation", kept.op, kept.source, tensor))


def carried(doctor, info, pending, what: tuple, ext, carried, refresh: str | None) -> None:
    """A real step's answer depends on elements of a static input it did not write: reported at the
    step's write into it that left them out (``refresh``), else where the graph reads it."""
    text, numbers, _ = what
    rows = carried.mask.reshape(carried.mask.shape[0], -1).any(1).nonzero().reshape(-1) if carried.mask.dim() else None
    where = (f"row(s) {int(rows[0])}..{int(rows[-1])}" if rows is not None and len(rows)
             else "the scalar")
    numbers = {**numbers, "replay": info.replays, "elements_carried": int(carried.mask.sum()),
               "real": pending.real, "size": pending.size}
    evidence = (f"sampled replay {info.replays} of {info.name} ({pending.real} real rows of {pending.size}): {text} "
                f"when the {int(carried.mask.sum())} element(s) of {carried.name} that this step did not write "
                f"({where}, written by an earlier step) are put back to their values at capture"
                + (f"; this step's refresh of {carried.name} at {refresh} left them out" if refresh else ""))
    source = refresh or ext.source
    doctor.add(Finding("stale-input", info.name, ext.op, f"{carried.name}: {carried.tensor}", source, evidence,
                       explain.carried_input(carried.name, ext.op), numbers),
               ("stale-input", carried.name, ext.source))   # (one finding per read, whichever step showed it)


def _add(doctor, info, pending, kind, op, tensor, text, site, numbers) -> None:
    name, source = (op.name, op.source) if op is not None else ("-", "-")
    evidence = (f"sampled replay {info.replays} of {info.name} ({pending.real} real rows of {pending.size}): {text} "
                "from an eager run of the same step")
    doctor.add(Finding(kind, info.name, name, tensor, source, evidence, explain.differential(info.name, text, site),
                       {"replay": info.replays, **numbers}), (kind, name, source))


def _read_unwritten(info) -> tuple | None:
    """Memory the graph reads that no op of it writes, filled during the capture by work that ran
    outside the graph, once: memory the graph allocated that one of its ops reads before any op of
    it writes it (a kernel launched on a stream the capture does not record, a write by another
    thread or by the host), or memory the capture handed to work on another thread that wrote it
    (``threads.filled_off``: a workspace the legacy stream's kernel fills for a captured GEMM). A
    replay launches none of that work, so the reader gets what that run left, while the eager step
    does it again: the work stayed behind at capture. Named where that work was launched, when the
    capture handed the block to another thread (``threads.handed_off``); else at the allocation,
    the block's start."""
    if info.read_unwritten:
        key, reader = next(iter(info.read_unwritten.items()))
        ref, func, source = info.made[key]            # (every block still unwritten was made by the capture)
        shown = describe(ref()) if ref() is not None else "-"
        what = f"memory the graph allocated at {source} ({func})"
    else:
        filled = ((key, op) for op in info.ops for key in sorted(op.reads)
                  if key in info.filled_off and key in info.externals and key not in info.writes)
        if (found := next(filled, None)) is None:
            return None
        key, reader = found
        func, source, shown = reader.name, info.filled_off[key], info.externals[key].tensor
        what = f"memory it does not own ({shown})"
    launched = info.handed_off.get(key)
    return ("host-work-frozen", Op(func, launched or source), shown,
            f"The launch traces agree, but {reader.name} at {reader.source} reads {what} that no op of the graph "
            "writes: the work that filled it during the capture "
            + (f"was handed to another thread (launched at {launched}) and ran outside the graph" if launched else
               "ran outside the graph (a kernel on a stream the capture does not record, another thread, the host)")
            + ", once. A replay launches none of it, so the reader gets what that run left, while the "
            "eager step fills the block again.")


def _read_by(doctor, info, op) -> str:
    """The announced buffer (else the referenced tensor) an op of the trace reads, for the report."""
    if op is None:
        return "-"
    for key in sorted(op.reads):
        if (buf := doctor.buffer(key)) is not None:
            return f"{buf.name}: {describe(buf.ref())}"
    return next((info.externals[key].tensor for key in sorted(op.reads) if key in info.externals), "-")


def _label(pending, key) -> str:
    return pending.pre[key][1] if key is not None and key in pending.pre else "-"
