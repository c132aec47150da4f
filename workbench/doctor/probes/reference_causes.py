"""Why a replay differs from the reference run's same step (``probes/reference.py``): the graph's ops are set beside
the reference step's by op, line and occurrence, and these causes are looked for, in order -- a static input holding
other values (``static_input``), a capture window narrower than the step's data (``narrower``), a launch trace that
parts or a number baked in (``launched``), a tensor the graph only reads holding other values (``bound``), a view taken
elsewhere in its storage or of another shape (``other_view``). Each returns ``(kind, op, tensor, source, why)`` or None.
Two more are asked of the results when no finding explains them: padded rows handed out (``padded_result``) and a 0-dim
host tensor taken by value (``frozen_scalar``)."""
from __future__ import annotations

import torch

from ...engine.opinfo import describe, storage_key
from ...engine.source import function_of, location, user_frames
from .. import explain, explain_padding
from ..records import Op
from ..report import Finding
from ..rules import sync
from ..rules.pool import block
from ..tensors import TensorArg, disagrees, onto, whole
from . import launch


def aligned(ops: list, under: tuple, ref: list):
    """Each graph op (with its position in ``info.paths``) beside the reference step's op at the
    same op, line and occurrence."""
    steps: dict = {}
    for s in ref:
        steps.setdefault((s.op.name, s.op.source), []).append(s)
    seen: dict = {}
    for op, i in zip(ops, under):
        key = (op.name, op.source)
        n = seen[key] = seen.get(key, -1) + 1
        if n < len(same := steps.get(key, ())):
            yield op, i, same[n]


def compare_views(ops: list, under: tuple, ref: list, values: dict) -> list:
    """Each static-input view the graph reads beside what the reference gives the same op:
    ``(op, buffer, the view's real rows, the reference's tensor, equal, the view's geometry)``."""
    out = []
    for op, i, other in aligned(ops, under, ref):
        for j in range(len(other.values)):
            buf, now, geometry = values.get((i, j), (None, None, None))
            given = other.values[j]
            if now is None or given is None or given.dtype != now.dtype:
                continue
            if (mine := rows_like(now, given)) is not None:
                out.append((op, buf, mine, given, not bool(disagrees(mine, given).any()), geometry))
    return out


def chosen_at(func, args) -> str | None:
    """Where the values a copy into a static input writes were chosen, when the copied tensor came
    in as an argument of the copying function (a task's ``rebind(table)``): the caller that chose
    it (``sync.handed_in``); None where the copy's own line chose them."""
    if func.overloadpacket is not torch.ops.aten.copy_ or len(args) < 2:
        return None
    src = args[1]
    return sync.handed_in([(f, f.f_lineno) for f in user_frames()], sync.same_memory(src))


def static_input(writers: dict, info, compared: list, padded: int, tracked, stale: list) -> tuple | None:
    """The first static input whose real rows differ from what the reference gives the same op. Where the step
    wrote none of the elements that differ (``info.step``, the writes since the graph's previous replay that
    differential replay notes, for the buffers it notes them of: ``tracked``, a graph's own static inputs -- not
    memory another graph owns and hands on, a piece's output the next piece reads), the graph read what an
    earlier step left there: ``stale-input``, at the op that reads it (``stale`` gets its buffer, view geometry
    and the reference's tensor, for ``late_refresh``). Else the runner wrote this step's input otherwise than
    the workload computes it: ``warmup-divergence``, at the line that wrote it -- unless what it wrote is the
    reference's values moved by as many rows as the step has padded rows (``padded``): a position computed from
    the padded count where the real one was meant, or the other way round, ``padded-shape-mismatch`` there."""
    for op, buf, mine, given, same, (shape, stride, offset) in compared:
        if same:
            continue
        differ = disagrees(mine, given)
        count = f"{int(differ.sum())} element(s)"
        whole_buf = buf.ref()
        noted = info.step is not None and storage_key(whole_buf) in tracked
        written = info.step.get(storage_key(whole_buf)) if noted else None
        if noted and (written is None or written.shape == whole_buf.shape):
            view = whole_buf.as_strided(shape, stride, offset)
            mask = torch.zeros(view.shape, dtype=torch.bool, device=view.device)
            if differ.dim():                      # (the view's leading rows: ``rows_like``)
                mask[:differ.shape[0]] = differ
            else:
                mask |= differ
            at_buffer = onto(mask, view, whole_buf)
            if written is None or not bool((at_buffer & written.to(at_buffer.device)).any()):
                refresh = _refreshed_beside(writers, info, compared, op, buf)
                why = (f"{buf.name} holds other values in its real rows than the reference gives {op.name} at "
                       f"{op.source} ({count}), and this step wrote none of them: the graph reads what an earlier "
                       "step left there (an input the step omitted, a refresh skipped)"
                       + (f"; {refresh[1]} refreshed {refresh[0]}, {refresh[3]}, at {refresh[2]}" if refresh else ""))
                site = refresh[2] if refresh else op.source
                stale.append((buf, (shape, stride, offset), given))
                return "stale-input", op.name, f"{buf.name}: {describe(mine)}", site, why
        writer = writers.get(storage_key(whole_buf), (op.name, op.source, None, None, 0))
        chosen = f", with values chosen at {writer[3]}" if writer[3] else ""
        written = f"it was last written by {writer[0]} at {writer[1]}{chosen}"
        if _displaced(mine, given, padded):
            why = (f"{buf.name} holds in its real rows the values the reference gives {op.name} at {op.source}, "
                   f"moved by {padded} row(s), as many as the step's padded rows ({count} differ); {written}: the "
                   "runner placed them by a count that includes the padded rows where the real one was meant, or "
                   "the other way round")
            return "padded-shape-mismatch", writer[0], f"{buf.name}: {describe(mine)}", writer[3] or writer[1], why
        why = (f"{buf.name} holds other values in its real rows than the reference gives {op.name} at "
               f"{op.source} ({count}); {written}: the runner prepares this step's input otherwise than the "
               "workload computes it without graphs")
        return "warmup-divergence", writer[0], f"{buf.name}: {describe(mine)}", writer[3] or writer[1], why
    return None


def _displaced(mine: torch.Tensor, given: torch.Tensor, rows: int) -> bool:
    """Whether ``mine`` is ``given`` moved by ``rows`` rows, one way or the other, over more than one
    distinct value (a constant matches itself moved anywhere)."""
    n = mine.shape[0] if mine.dim() else 0
    if rows <= 0 or mine.shape != given.shape or n <= rows:
        return False
    return any(torch.equal(a, b) and a.unique().numel() > 1
               for a, b in ((mine[rows:], given[:n - rows]), (mine[:n - rows], given[rows:])))


def narrower(ops: list, under: tuple, ref: list, values: dict, views: dict) -> tuple | None:
    """The first static-input view the graph reads that is narrower, in a dimension other than its
    rows, than the tensor the reference gives the same op: the capture cut its window of the buffer
    to what its own batch needed (a block table as wide as the dummy sequences), and a step with
    more columns does not fit -- ``undersized-buffer``, at the line that took the view (``views``:
    where eager code took each view of a static input), else at the op."""
    for op, i, other in aligned(ops, under, ref):
        for j in range(len(other.values)):
            buf, now, geometry = values.get((i, j), (None, None, None))
            given = other.values[j]
            if now is None or given is None or now.dim() < 2 or now.dim() != given.dim():
                continue
            cut = next((d for d in range(1, now.dim()) if now.shape[d] < given.shape[d]), None)
            if cut is None or (whole_buf := buf.ref()) is None:
                continue
            shape, stride, offset = geometry
            made = views.get((storage_key(whole_buf), offset, tuple(shape), tuple(stride)))
            why = (f"the graph reads {buf.name} through a view {describe(now)} where the reference gives {op.name} at "
                   f"{op.source} a tensor {describe(given)}: {now.shape[cut]} against {given.shape[cut]} in dimension "
                   f"{cut}" + (f"; the view was taken at {made}" if made else "") + ": the capture's window of the "
                   "buffer is narrower than this step's data")
            return "undersized-buffer", op.name, f"{buf.name}: {describe(now)}", made or op.source, why
    return None


def _refreshed_beside(writers: dict, info, compared: list, op, stale) -> tuple | None:
    """(buffer, op, line, how it is tied to ``stale``'s reader) of the refresh that skipped
    ``stale``: its own last write while steps were served (a builder that refreshed it at earlier
    steps, or wrote other elements of it at this one, and left these out); else a write this step
    made into another static input that the same op reads, else the same function of the captured
    code (a builder copying one of two tables, a ``fill_params`` refreshing the lengths read beside
    a plan); else the last write of the function that wrote most of the graph's static inputs this
    step (the step's refresh, which left this one out). None where the step wrote no static input
    of the graph."""
    if not info.step or (whole_stale := stale.ref()) is None:
        return None
    stale_key = storage_key(whole_stale)
    if (before := writers.get(stale_key)) is not None and before[4]:    # (written with a replay served)
        how = "at this step, leaving those elements out" if stale_key in info.step else "at earlier steps, not this one"
        return stale.name, before[0], before[1], how
    function = function_of(op.source)
    for near, how in ((lambda other: other is op, "which the same op reads"),
                      (lambda other: function_of(other.source) == function, f"which {function} reads too")):
        for other, buf, *_ in compared:
            if not near(other) or buf is stale or (whole_buf := buf.ref()) is None:
                continue
            if (key := storage_key(whole_buf)) in info.step and (writer := writers.get(key)) is not None:
                return buf.name, writer[0], writer[1], how
    by_function = {}                                            # the step's refresh: by function
    for key in info.step:
        if key in writers and key != stale_key:
            by_function.setdefault(function_of(writers[key][1]), []).append(writers[key])
    if not by_function:
        return None
    name, line, buffer, *_ = max(by_function.values(), key=len)[-1]
    return buffer, name, line, "with most of the step's static inputs"


def padded_result(doctor, index: int, served: tuple, reference: tuple, padded: dict) -> None:
    """A result of the workload with more rows than the run without graphs gives, and otherwise its
    shape, where a padded replay served that many rows at that many real ones: the runner handed out
    the graph's padded rows (``padded-shape-mismatch``, at the line that replayed it)."""
    if not served or len(served) != len(reference) or served[1:] != reference[1:] or served[0] <= reference[0]:
        return
    if (found := padded.get((served[0], reference[0]))) is None:
        return
    graph, site = found
    doctor.add(Finding(
        "padded-shape-mismatch", graph, "-", f"result {index}: {list(served)}", site,
        f"the workload's result {index} has {served[0]} rows where its run without graphs has {reference[0]}, as "
        f"many as {graph} serves padded and real: the padded rows were handed out with the real ones",
        explain_padding.padded_shape_mismatch(graph, reference[0], served[0]),
        {"size": served[0], "real": reference[0]}),
        ("padded-shape-mismatch", "result", site))


def rows_like(now: torch.Tensor, given: torch.Tensor) -> torch.Tensor | None:
    """The graph's view laid out as the reference's tensor: the same shape, or its leading rows where
    the reference has fewer (a padded step's real rows come first: tokens, requests, offsets)."""
    if now.shape == given.shape:
        return now
    if now.dim() and now.dim() == given.dim() and now.shape[1:] == given.shape[1:] and given.shape[0] <= now.shape[0]:
        return now[:given.shape[0]]
    return None


def parting(info, ops: list, ref: list, padded: bool, graph: list, eager: list, d) -> tuple | None:
    """What it means where the graph's trace and the reference step's part (``d``: ``graph`` and
    ``eager``, their ops by op and line) (``padded``: the graph serves padded rows, for which code
    that loops over rows runs more times than for the real ones: no evidence, unless those runs
    write memory the graph does not own -- a padded row's write into state, which the real rows,
    differing, read: ``stale-padding`` at that write)."""
    why = f"the launch traces part: {d.text()}"
    at = launch.repeats(d, graph, eager)
    if at is not None and padded and not d.eager_runs_more:
        extra = ops[d.index:d.index + d.inserted] if d.inserted else ops[d.index:]
        write = next((o for o in extra if o.writes & info.externals.keys()), None)
        if write is None:
            return None
        tensor = info.externals[next(iter(write.writes & info.externals.keys()))].tensor
        return ("stale-padding", write.name, tensor, write.source,
                f"{why}; the graph runs that code for its padded rows too ({d.inserted or len(extra)} op(s) the "
                f"reference's real rows do not run), and there {write.name} writes {tensor}, memory the graph does "
                "not own: a padded row's write lands in state the real rows read")
    if at:                                        # the same lines run another number of times: which frame loops
        a, b = (ref[i].path for i in at)
        shared = [x for x, y in zip(a, b) if x[:2] == y[:2]]
        if shared:
            loop = location(shared[-1][0], shared[-1][2])
            return ("host-work-frozen", d.first_extra.name, "-", loop,
                    f"{why}; the reference runs the same code another number of times ({d.inserted} op(s)) at "
                    f"{loop}: a count Python decided at capture is baked into the graph")
    op = d.eager_op if d.how in ("skipped", "ops") or d.graph_op is None else d.graph_op
    source = _left_at(info, ref[d.index].path) if d.how == "skipped" else None
    return "warmup-divergence", op.name, "-", source or op.source, f"{why}: Python took another path at capture"


def launched(info, ops: list, under: tuple, ref: list, size: int, padded: bool) -> tuple | None:
    """Where the launch traces part (``parting``), else a number baked in (``frozen_number``). Where
    they part inside a line both ran (an op whose kernels follow its shapes: an ``einsum`` that
    copies, or not), Python took no other path: a number the graph runs with, if any, is the cause."""
    plain = lambda o: Op(o.name, o.source)  # noqa: E731 - shapes and tensors differ with padding
    graph, eager = [plain(o) for o in ops], [plain(s.op) for s in ref]
    d = launch.compare(graph, eager)
    split = None if d is None else parting(info, ops, ref, padded, graph, eager, d)
    if split is not None and split[0] == "warmup-divergence" and _inside_a_line(info, d, ref):
        return frozen_number(info, ops, under, ref, size) or split
    return split or frozen_number(info, ops, under, ref, size)


def _inside_a_line(info, d, ref: list) -> bool:
    """Whether the eager step's first op the graph never recorded is at a line the capture ran, or
    the graph's first op the eager step no longer launches at a line the reference step ran."""
    if d.how == "skipped":
        code, _, line = ref[d.index].path[-1]
        return (code, line) in info.lines_run
    return d.graph_op is not None and any(s.op.source == d.graph_op.source for s in ref)


def _left_at(info, extra: tuple) -> str | None:
    """Where the reference left the capture's path, for work the graph never recorded: in the
    innermost function of the first extra op's stack that the capture ran too, the line that led to
    that work (a branch's call into a lazy set-up the capture found done, not the set-up's first
    kernel). None where the capture's lines are not known (outside ``diagnose``)."""
    ran = {code for code, _ in info.lines_run}
    return next((location(code, line) for code, _, line in reversed(extra) if code in ran), None)


_COMMON = (0, 1, -1, "0.0", "1.0", "-1.0")       # numbers any code holds


def numbers(sig: tuple, common: bool = False) -> list:
    """(position, value) of the plain numbers among an op's Python-decided arguments (a keyword
    argument's too); not shapes (lists), dtypes, nor (unless ``common``) 0, 1 and -1."""
    out = []
    for n, a in enumerate(sig):
        if isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], str) and not isinstance(a, TensorArg):
            a = a[1]                              # ("scalar", value) of a 0-dim host tensor, or (keyword, value)
        if isinstance(a, str):
            try:
                float(a)
            except ValueError:
                continue
        elif type(a) is not int:
            continue
        if common or a not in _COMMON:
            out.append((n, a))
    return out


def frozen_number(info, ops: list, under: tuple, ref: list, size: int) -> tuple | None:
    """The first op (by line and occurrence) that the graph runs with another plain number than the
    reference step gives it: a value Python computed at capture. A number the padded layout explains
    (the graph's size, a dimension of the op's own tensors) is no evidence, nor a difference between
    two of the numbers any code holds (0, 1, -1); one of them against another number is (a scale
    captured at 2.0 that the step now sets to 0), unless the layout explains that one too (the
    graph's size less one: a last index)."""
    for op, i, step in aligned(ops, under, ref):
        other = step.op
        if len(other.sig) != len(op.sig):
            continue
        dims = {size} | {d for a in op.sig if isinstance(a, TensorArg) for d in a.shape}
        near = dims | {d - 1 for d in dims} | {d + 1 for d in dims}      # (a count, a last index, offsets)
        theirs = dict(numbers(other.sig, common=True))
        for position, mine in numbers(op.sig, common=True):
            if position in theirs and theirs[position] != mine and mine not in dims and \
                    not (theirs[position] in _COMMON and (mine in _COMMON or mine in near)):
                origin = info.paths[i][3].get(mine) or op.source
                return ("host-work-frozen", op.name, "-", origin,
                        f"{op.name} at {op.source} runs with {mine} in the graph where the reference step passes "
                        f"{theirs[position]}: a number Python computed at capture (held at {origin}) is baked into "
                        "the graph")
    return None


def other_view(ops: list, under: tuple, ref: list, replayed: tuple) -> tuple | None:
    """The first op (by line and occurrence) that the graph runs on a view starting elsewhere in its storage than the
    reference step's same op, at the same shape (a state row chosen at build time), else on a view of another shape (a
    length grown since: a cache view over more tokens): the graph was captured for another view than the step takes
    now, and is replayed for it -- keyed on a property of the step that does not decide which view it takes. Asked of
    unpadded replays only: padding moves and resizes views of the last rows. ``replayed``: see ``chosen``."""
    pairs = [(op, step.op) for op, _, step in aligned(ops, under, ref) if len(step.op.sig) == len(op.sig)]
    for moved in (True, False):
        for op, other in pairs:
            for mine, theirs in zip(op.sig, other.sig):
                if not (isinstance(mine, TensorArg) and isinstance(theirs, TensorArg)) or (
                        mine.shape != theirs.shape or mine.offset == theirs.offset if moved
                        else len(mine.shape) != len(theirs.shape) or mine.shape == theirs.shape):
                    continue
                view = (f"a view {mine.shape} at offset {mine.offset} of its storage in the graph where the reference "
                        f"step's same op reads offset {theirs.offset}" if moved else
                        f"a view {mine.shape} in the graph where the reference step's same op reads {theirs.shape}")
                return ("warmup-divergence", op.name, "-", chosen(replayed),
                        f"{op.name} at {op.source} reads {view}: the graph was captured for another view than this "
                        f"step takes, and is replayed for it at {_replayed(replayed)}")
    return None


def chosen(replayed: tuple) -> str:
    """``replayed``: (the line that replayed the graph, where the check that chose to replay it
    answered or None). A graph replayed for inputs it was not captured with is keyed on the wrong
    property: named at that check where one answered (``raised.decider``), else at the replay."""
    return replayed[1] or replayed[0]


def _replayed(replayed: tuple) -> str:
    return replayed[0] + (f", as the check at {replayed[1]} chose" if replayed[1] else "")


def only_read(buf) -> bool:
    """Whether a tensor the capture references may be one it only reads (``bound``): not announced,
    or announced as state -- persistent memory that a graph which never writes it only reads, like a
    table or metadata prepared eagerly (which writes it is known once the capture ends)."""
    return buf is None or buf.role == "state"


def bound(writers: dict, doctor, info, ops: list, under: tuple, ref: list, replayed: tuple) -> tuple | None:
    """The first tensor the graph only reads (no graph writes it; not announced) that holds other
    values than the reference gives the same op: the graph reads what its capture bound, this
    step's eager form reads something else."""
    for op, i, step in aligned(ops, under, ref):
        for j, key, offset, shape, stride, dtype in info.paths[i][4]:
            given = step.values[j] if j < len(step.values) else None
            ext = info.externals.get(key)
            if given is not None and given.dtype == dtype and ext is None and key in info.foreign:
                found = _made_elsewhere(doctor, info, key, op, given, (shape, stride, offset), writers.get(key))
                if found is not None:
                    return found
                continue
            if given is None or given.dtype != dtype or ext is None or key in doctor.graph_writes:
                continue
            flat = whole(ext.weak, dtype)
            if flat is None:
                continue                          # released: the dangling-reference rule's
            mine = rows_like(flat.as_strided(shape, stride, offset), given)
            if mine is None or not bool(disagrees(mine, given).any()):
                continue
            differ = f"{ext.tensor} read by {op.name} at {op.source} holds other values than the reference gives " \
                     f"that op ({int(disagrees(mine, given).sum())} element(s))"
            if (writer := writers.get(key)) is not None:
                return ("warmup-divergence", writer[0], f"{ext.tensor}", writer[1],
                        f"{differ}; it was last written by {writer[0]} at {writer[1]}: the runner prepares what the "
                        "graph reads otherwise than the workload computes it without graphs")
            return ("warmup-divergence", op.name, f"{ext.tensor}", chosen(replayed),
                    f"{differ}, and nothing wrote it since the capture bound it: the graph is replayed (at "
                    f"{_replayed(replayed)}) for a step whose eager form reads another tensor there -- inputs it was "
                    "not captured with")
    return None


def _made_elsewhere(doctor, info, key: int, op, given: torch.Tensor, geometry: tuple, writer) -> tuple | None:
    """A tensor another graph's capture made, which this graph reads, holds other values than the
    reference gives the op. Where that graph never replayed, nothing ever computed it: its capture
    decided to make it (a table rebuilt lazily inside a trace) and bound it where the program keeps
    it, and every later step reads it (``warmup-divergence`` where it was made). Where eager code
    wrote it last, since that graph's last replay (``writer``: an attention run between two pieces,
    into the buffer the first made), that code prepared it otherwise than the workload computes it
    without graphs (``warmup-divergence`` at that write). Where that graph's replays were compared
    and gave the eager steps' answers, this step reads what its latest replay wrote for another step:
    an output kept past its graph's next replay (a cache), ``overwritten-output`` where it was made."""
    owner, _, _, tensor = info.foreign[key]
    held = doctor.owned.get(key)
    if owner.replays and (not owner.compared or owner.disagreed) or key in owner.constants or held is None \
            or held[1] is not owner or (flat := whole(held[0], given.dtype)) is None \
            or block(flat) in info.blocks:          # (a block of the pool this graph writes itself: its own)
        return None
    mine = rows_like(flat.as_strided(*geometry), given)      # (None: the reference's op reads another shape)
    if mine is not None and not bool(disagrees(mine, given).any()):
        return None
    if (made := owner.made.get(key)) is None:
        return None
    _, maker, source = made
    differ = (f"{tensor} read by {op.name} at {op.source} holds other values than the reference gives that op ("
              + (f"{int(disagrees(mine, given).sum())} element(s) differ)" if mine is not None else
                 f"the reference's op reads a {describe(given)} there)"))
    if owner.replays and writer is not None and writer[4] >= owner.replayed_at and not any(
            g.replayed_at > writer[4] and any(key in o.writes for o in g.ops) for g in doctor.graphs.values()):
        return ("warmup-divergence", writer[0], tensor, writer[1],
                f"{differ}; it is an output of {owner.name} ({maker} at {source}), written since that graph's "
                f"replay {owner.replays} by {writer[0]} at {writer[1]}: eager code prepares what {info.name} reads "
                "otherwise than the workload computes it without graphs")
    if owner.replays:
        return ("overwritten-output", maker, tensor, source,
                f"{differ}; it is an output of {owner.name} ({maker} at {source}), whose {owner.compared} compared "
                f"replay(s) gave the eager steps' answers: it holds what replay {owner.replays} of {owner.name} "
                "wrote for another step, kept and read past that replay")
    return ("warmup-divergence", maker, tensor, source,
            f"{differ}; the capture of {owner.name} made it ({maker} at {source}) and that graph never replayed: "
            "no kernel ever computed it, and every step reads it")


def frozen_scalar(doctor, verdict: tuple) -> None:
    """The workload's results differ from its run without graphs and no finding explains it: a
    replayed graph whose op takes a 0-dim host tensor by value (CUDA passes it as a kernel argument)
    keeps the number it held at capture, whatever tensor the step makes now -- the one structural
    way a graph cannot see a new value, named at that op."""
    for info in doctor.graphs.values():
        if info.replays and info.by_value:
            op, value = info.by_value[0]
            i, diff = verdict
            doctor.add(Finding(
                "host-work-frozen", info.name, op.name, "0-dim host tensor", op.source,
                f"the workload's result {i} differs from its run without graphs' (max |diff| = {diff:.3g}); "
                f"{op.name} at {op.source} takes a 0-dim host tensor by value, which the graph keeps as it was at "
                f"capture ({value!r})", explain.by_value(op.name, value), {"captured_value": value}),
                ("host-work-frozen", op.name, op.source))
            return

