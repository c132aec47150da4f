"""What a replay and the eager run of its step are compared on: the real rows of each output (not
those that hold no result, ``records.unwritten_blocks``, nor an eager output made from a pointer),
then the state each wrote, then memory only the eager run wrote (``differential``); and a replay's
outputs with what the workload's run without graphs returned at the same step, or, where that step
returned nothing, left in the memory it wrote (``reference``)."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ...engine.opinfo import storage_key
from ..records import unwritten_blocks
from ..rules.pool import block
from ..tensors import announced_of, disagrees, geometry, leaves, max_abs_diff, placed, real_rows
from .reference_causes import aligned, rows_like

_NEAR = 32          # reference calls either side of the served run's count that may have given a replay's answer


def rows_of(out, real: int, size: int, owned: bool = False) -> list | None:
    """The real rows of each output. ``owned``: of an eager run, whose output made from a pointer (a
    storage that does not own its memory: ``weak_ref_tensors``, ``from_blob``) points at memory the
    run has let go by now -- under a capture the graph's pool keeps it, eagerly nothing does: None,
    not compared."""
    if out is None:
        return None
    return [None if owned and not o.untyped_storage().resizable() else real_rows(o, real, size).detach().clone()
            for o in leaves(out)]


def placed_as_handed(rows: list | None, out, handed, where: dict | None) -> list | None:
    """The eager step's outputs (``rows``: the real rows of each tensor ``out`` holds) that sit where
    the replay's handed-out outputs (``handed``) sat in what the step returned at capture (``where``:
    ``tensors.placement``), in their order: a runner hands out a selection of what its step returns
    (the sampled ids, logprobs and hidden states of each rank's batch state, not the metadata beside
    them), in an order of its own. ``rows`` as they are where that is not known for all of them."""
    raw = leaves(handed)
    if rows is None or not where or len(rows) == len(raw):
        return rows
    found = by_place(rows, [p for p, _ in placed(out)], raw, where)
    return rows if found is None else found


def by_place(values: list, paths, raw: list, placement: dict) -> list | None:
    """``values`` (each at its path in ``paths``) picked for each of a replay's outputs (``raw``) by
    where that output sat in what the step returned at capture (``placement``); None where one of
    them cannot be placed so (an output that is None picks None)."""
    index = {p: i for i, p in enumerate(paths)}
    picks = [None if r is None else index.get(placement.get(geometry(r), ())) for r in raw]
    if any(i is None for i, r in zip(picks, raw) if r is not None):
        return None
    return [None if i is None else values[i] for i in picks]


def without_unwritten(info, pending, rows: list | None) -> list | None:
    """The replay's outputs, with None for those that hold no result (``records.unwritten_blocks``)."""
    blank = unwritten_blocks(info, pending)
    if rows is None or not blank:
        return rows
    return [None if block(o) in blank else r for o, r in zip(leaves(pending.outputs), rows)]


def compare(graph_out, eager_out, replayed, eager_state, extra, pre) -> tuple | None:
    """(what differs, numbers) -- outputs first, then state -- or None when all agree."""
    if graph_out is not None and eager_out is not None:
        if len(graph_out) != len(eager_out):
            if (handed := announced_of(graph_out, eager_out)) is None:
                return f"the replay has {len(graph_out)} outputs, the eager step {len(eager_out)}", {}, None
            eager_out = handed
        for i, (g, e) in enumerate(zip(graph_out, eager_out)):
            if g is None or e is None:
                continue
            if g.shape != e.shape or bool(disagrees(g, e).any()):
                return (f"output {i} (real rows) differs by max |diff| = {max_abs_diff(g, e):.3g}",
                        {"output": i, "max_abs_diff": max_abs_diff(g, e)}, None)
    for key, g in replayed.items():
        mask = disagrees(g, eager_state[key])
        if bool(mask.any()):
            label = pre[key][1]
            return (f"state `{label}` differs in {int(mask.sum())} element(s)",
                    {"state": label, "elements": int(mask.sum())}, key)
    for key, (before, after) in extra.items():
        if bool((before != after).any()):
            return ("the eager step writes memory the graph never writes", {"elements": int((before != after).sum())},
                    key)
    return None


def comparable(got: list, expected: list | None) -> bool:
    """Whether the replay's real rows and the reference's return can be compared: as many outputs,
    each of the same dtype and laid out alike (``rows_like``: a runner that pads a step itself
    announces its padded rows as real, and they come after the real ones)."""
    return expected is not None and len(got) == len(expected) and all(
        g is None or e is not None and g.dtype == e.dtype and rows_like(g, e) is not None
        for g, e in zip(got, expected))


def root_outputs(got: list, expected: list) -> tuple[list, list | None]:
    """A graph that hands out more than its root returned (work after the root inside the capture:
    a sampler writing the token beside the logits) is compared on what the root returned: each of
    those is the one output of its shape and dtype (None where one is not: no pairing is guessed)."""
    mine = []
    for e in expected:
        same = [g for g in got if e is not None and g is not None and g.shape == e.shape and g.dtype == e.dtype]
        if len(same) != 1:
            return got, None
        mine.append(same[0])
    return mine, expected


def differs_from(got: list, expected: list | None) -> tuple | None:
    """(output, max |diff|) of the first output that differs from the reference's, or None (also
    when they cannot be compared)."""
    if not comparable(got, expected):
        return None
    for i, (g, e) in enumerate(zip(got, expected)):
        if g is not None and bool(disagrees(g := rows_like(g, e), e).any()):
            return i, max_abs_diff(g, e)
    return None


def agrees(got: list, expected: list | None) -> bool:
    """Whether the outputs can be compared with the reference's and agree (``differs_from`` is None
    for outputs that cannot be compared too: a call of another batch size agrees with nothing)."""
    return comparable(got, expected) and differs_from(got, expected) is None


def paired(got: list, returned: tuple | None, placed: dict | None = None, raw: list | None = None) -> tuple:
    """A replay's outputs (``raw``, and ``got``: their real rows) and what a reference call
    returned (its tensors and where each sat), paired: by where each output sat in what the step's
    root returned at capture (``placed``), where that is known; else the announced ones of a call
    that returned more, the root's own of a graph that hands out more (``root_outputs``)."""
    expected, where = returned or (None, None)
    if placed and where and raw is not None and (found := by_place(expected, where, raw, placed)) is not None:
        return got, found
    if expected is not None and len(expected) > len(got):
        return got, announced_of(got, expected)
    if expected is not None and len(expected) < len(got):
        return root_outputs(got, expected)
    return got, expected


def written_by(got: list, raw: list, ops: list, under: tuple, ref: list, left: dict) -> tuple:
    """A replay's outputs beside what a reference call that returned nothing left where it wrote
    (``reference_steps.Values.left``): an output is paired with the value the reference's same
    write (op, line, occurrence: ``aligned``) left, where the graph's last write into the output's
    memory is that write and wrote exactly the output's elements; outputs no such write made are not
    compared (None on both sides). None for the reference where no output is paired."""
    expected: list = [None] * len(raw)
    for op, _, step in aligned(ops, under, ref):
        if (value := left.get(id(step))) is None:
            continue
        kept, offset, stride = value
        for j, o in enumerate(raw):
            if o is not None and storage_key(o) in op.writes and (o.storage_offset(), o.stride()) == (offset, stride) \
                    and o.shape == kept.shape and o.dtype == kept.dtype:
                expected[j] = kept
    if all(e is None for e in expected):
        return got, None
    return [g if e is not None else None for g, e in zip(got, expected)], expected


def calls_near(calls: list, k: int) -> list:
    """The reference's calls of a root around the served run's count, but the k-th itself: where no
    static input ties a replay to its step, one of them giving the replay's answer means the count
    missed (the run without graphs made other calls: a dummy step, a layer's call of the root)."""
    return [n for c, n in enumerate(calls) if c != k and abs(c - k) <= _NEAR]


def verdict(reference: list, served: list) -> tuple[tuple, tuple | None]:
    """A workload's own comparison of its results (``events.results``): its first result that
    differs from the reference run's, as (index, max |diff|), or () when all agree; and the
    (served, reference) shapes of that result where they differ."""
    if len(reference) != len(served):
        return (len(served), float("inf")), None
    with _disable_current_modes():
        for i, (e, g) in enumerate(zip(reference, served)):
            if not (isinstance(e, torch.Tensor) and isinstance(g, torch.Tensor)):
                continue
            if e.shape != g.shape:
                return (i, float("inf")), (tuple(g.shape), tuple(e.shape))
            if bool(disagrees(g.cpu(), e.cpu()).any()):
                return (i, max_abs_diff(g.cpu().double(), e.cpu().double())), None
    return (), None


def capture_batch(info) -> bool:
    """Whether this is a graph's first replay with nothing written into its static inputs since the
    capture (``info.step``): the capture's own dummy batch replayed, which is no step of the
    reference (rewritten with the values the capture read, it is too: ``captured_with``)."""
    if info.replays or info.step is None:
        return False
    with _disable_current_modes():
        return not written_inputs(info)


def written_inputs(info) -> set[int]:
    """The graph's static inputs (its externals, and memory it is ``filled`` with) this step wrote."""
    return {key for key, mask in (info.step or {}).items()
            if (key in info.externals or key in info.filled) and bool(mask.any())}
