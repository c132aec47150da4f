"""dangling-reference: a graph reads memory whose owner has let it go.

Two owners can let go: the program (a tensor the graph only references is released) and another
graph of the same pool (a graph reads an output of another graph, which was then reset or dropped:
its memory went back to the pool, to be handed to whatever is allocated next)."""
from __future__ import annotations

import gc

from .. import explain
from ...engine.errors import GraphError
from ...engine.opinfo import describe, op_tensors, storage_key
from ...engine.source import user_frame
from ..probes import held
from ..report import Finding
from ..tensors import first_line
from . import where as during
from .pool import block


class DanglingReferenceError(GraphError):
    """Raised by ``watch(guard=True)`` instead of a replay that would read released memory."""

    def __init__(self, finding: Finding) -> None:
        super().__init__(f"replay stopped by the graph doctor: {finding.evidence}\n  at {finding.source}\n  "
                         f"{finding.cause}")
        self.finding = finding


def handed_on(doctor, key: int, old, name: str, owner: str, source: str) -> None:
    """A static input of live graphs announced again under another name: the runner has given the
    buffer a second role (a reuse pool handed it back after its first graph's capture) while
    graphs still read it in its first one. Each copy-in for the new role overwrites what they read
    -- once one of them replays: a runner that re-captures and drops the old graphs (a graph
    rebuilt when its inputs changed) gave the buffer on with nobody left to read it (``check``)."""
    for info in doctor.graphs.values():
        if info.ref() is not None and key in info.externals:
            info.handed_on.append((old, name, owner, source))


def _handed_on(doctor, info) -> None:
    """Before a replay: each of its static inputs announced since in another role is a finding --
    held, where the workload runs a reference without graphs, until a replay of this graph (or the
    workload's results) differs from it: two graphs announcing one buffer under two names (one
    position buffer each piece of a model names by its argument's place) read it alike, and the
    runner's one copy-in serves both."""
    for old, name, owner, source in info.handed_on:
        t = old.ref()
        with held(doctor, info.held if doctor.reference is not None else None):
            doctor.add(Finding(
                "dangling-reference", info.name, "static_buffers",
                f"{old.name}: {describe(t) if t is not None else '-'}", old.source,
                f"{old.name} (announced by {old.owner}, read by {info.name}) is announced again as {name} by "
                f"{owner} at {source}, and {info.name} replays: one buffer, two static inputs",
                explain.handed_on_input(old.name, name, info.name), {}),
                ("dangling-reference", "static_buffers", old.name, name))
    info.handed_on.clear()


_REPORTED = 1 << 62      # an alias already reported: no later re-hand is after it


def aliased(doctor, info, key: int, t, op: str, source: str) -> None:
    """A capture's op uses a storage it did not allocate, on a block a capture did (this one, or an
    earlier one of the pool): a reference that does not own its memory (made from a pointer:
    ``weak_ref_tensors``, ``from_blob``). Noted when first seen; used again after this capture gave
    that block to a new tensor (its owner was released), every replay's use of it lands on that
    tensor: a workspace kept weakly across a capture and a later layer's activation (vllm-ascend
    #5522), a piece's output kept weakly and read by the next piece, whose capture took its block
    for a temporary (vLLM #10048)."""
    b = block(t)
    if key not in info.aliases:
        earlier = b in doctor.pool.allocated and not t.untyped_storage().resizable()   # made by another capture
        if b not in info.own_blocks and not earlier:
            return
        # Made in this capture (``set_`` onto a pointer: seen first where it is made), it points at what the
        # block holds then; made before it, at what an earlier capture left there, which this capture's
        # new tensor has replaced if it took the block already.
        info.aliases[key] = -1 if earlier and b in info.rehanded and not op.startswith("aten.set_") else len(info.ops)
    taken = info.rehanded.get(b)
    if taken is None or taken[1] <= info.aliases[key]:
        return
    info.aliases[key] = _REPORTED                   # (one finding per alias)
    doctor.add(Finding(
        "dangling-reference", info.name, op, describe(t), source,
        f"during the capture of {info.name}, {op} uses a {describe(t)} that does not own its memory, at an address "
        f"a capture of the pool allocated, freed and gave to the output of {taken[0].name} at {taken[0].source} "
        "since the reference was made", explain.aliased_in_capture(describe(t), taken[0].name), {}),
        ("dangling-reference", "aliased", source))


def pool_key(pool) -> object:
    """A pool handle as a key: CUDA's is a tuple of ids, the CPU engine's an object."""
    return pool if isinstance(pool, tuple) or pool is None else id(pool)


def refused(doctor, pool, name: str, error: BaseException) -> None:
    """A capture could not begin. Into a pool whose handle the program kept after the graphs
    captured into it were reset or dropped while memory of the pool is still held, CUDA's allocator
    refuses it (``use_count > 0``): the handle outlived its pool, and the finding names the line that
    made it (a handle cached at class scope, handed to the next engine)."""
    made = doctor.pools.get(pool_key(pool)) if pool is not None else None
    what = f"{type(error).__name__}: {first_line(error)}"
    if made is None or not made[1]:
        doctor.report.note(f"the capture of {name} could not begin: {what}")
        return
    site, graphs = made
    doctor.add(Finding(
        "dangling-reference", name, "graph_pool_handle", "graph pool", site,
        f"the capture of {name} into the pool that {', '.join(graphs)} were captured into was refused ({what})",
        explain.stale_pool(name, graphs[0]), {"graphs": len(graphs)}), ("dangling-reference", "pool", site))


def check(doctor, info, *, before_replay: bool) -> None:
    # This runs before every replay and a graph may reference every weight of a model: the
    # storages are looked at only once one has gone (``records.Liveness``), and the findings are
    # built only then. The flag is cleared before the look, so a storage released meanwhile sets
    # it again; under guard a raise sets it too: other storages may have gone with the first.
    if info.handed_on and before_replay:
        _handed_on(doctor, info)
    live = info.liveness
    if released_since_watched(info):
        live.released = False
        try:
            _released(doctor, info, before_replay)
        except DanglingReferenceError:
            live.released = True
            raise
    if info.foreign and (not _owners_captured(info) or not info.liveness.moved.isdisjoint(info.foreign)):
        _other_graph(doctor, info, before_replay)


def released_since_watched(info) -> bool:
    """Whether a storage the graph references has gone (the flag is left as it is for ``check``)."""
    live = info.liveness
    if len(live.cdatas) != len(info.externals):
        live.watch(info.externals)
    return live.any_released()


def _when(info, before_replay: bool) -> str:
    return (f"before replay {info.replays + 1}" if before_replay else
            f"at the end of watch() (after {info.replays} replays)")


def _released(doctor, info, before_replay: bool) -> None:
    for ext in info.externals.values():
        if ext.reported or ext.view_only or not (ext.weak.expired() or ext.weak.cdata in info.liveness.moved):
            continue                    # (memory it only took views of, or pointed a tensor at: no kernel reads it)
        ext.reported = True
        origin = ext.origin or "before watch() (its creation was not seen)"
        op, source = ext.touched_at       # where the capture took its address, as a faulting replay names it
        released = info.liveness.where.get(ext.weak.cdata)     # and the line that let it go, where seen
        # The decisive act is the release, so the finding stands there; the read is in the evidence.
        # Unseen (released before the watch, or by the garbage collector), the read is all there is.
        let_go = f"; it was released at {released}" if released else ""
        gone = ("was given other memory in place, which freed what the graph addresses" if ext.weak.cdata in
                info.liveness.moved else "has no owner left")
        finding = doctor.add(Finding(
            "dangling-reference", info.name, op, ext.tensor, released or source,
            f"{_when(info, before_replay)}: the {ext.tensor} storage the graph reads (through {op} at {source}) "
            f"{gone}; it was created {origin}{let_go}", explain.dangling(ext.tensor, op, origin, released),
            {"replays_before": info.replays}), ("dangling-reference", op, source))
        _stop(doctor, finding, before_replay)


def moved(doctor, storage) -> None:
    """``storage`` was given other memory in place (``resize_``: a tensor grown past its storage, a
    storage resized to 0 to free it) and its old memory is free. A graph that reads it keeps the old
    address: its replays read freed memory, as after a release (``check``, at the line that did
    it). An op that fails on a tensor of it, left without the memory its elements need, is
    ``read_after_release``."""
    if doctor.phase in ("probe", "differential"):      # (the doctor's own runs)
        return
    key, where = storage._cdata, user_frame()
    doctor.moved[key] = where
    for info in doctor.graphs.values():
        if key in info.externals or key in info.foreign:
            live = info.liveness
            live.moved.add(key)
            live.where[key] = where
            live.released = True


def read_after_release(doctor, func, args, kwargs, error: BaseException) -> bool:
    """An op of the watched code failed on a tensor whose storage was freed in place while the
    tensor lived (``moved``): a reference kept to memory its owner let go under it -- an output a
    graph tree freed at a new generation while a cache or the next layer still held it, a
    parameter's storage released after a step. The finding stands where the memory was released
    (the decisive act, as for ``check``); the failing read is the evidence."""
    for t in op_tensors(args, kwargs):
        where = doctor.moved.get(storage_key(t))
        if where is None or not t.numel() or t.untyped_storage().nbytes():
            continue
        doctor.add(Finding(
            "dangling-reference", during(doctor), str(func), describe(t), where,
            f"during {during(doctor)}, {func} at {user_frame()} failed on a {describe(t)} tensor whose storage was "
            f"freed in place at {where} while the tensor lived: {first_line(error)}",
            explain.released_in_place(describe(t), str(func), where), {}),
            ("dangling-reference", "in place", where))
        return True
    return False


def _owners_captured(info) -> bool:
    """Whether every graph whose pool output this graph reads is still captured: asked once per
    owner, not per storage read (the owners are cached while the set of storages stays put)."""
    count, owners = info.owners
    if count != len(info.foreign):                 # filled at capture, emptied as owners go
        owners = tuple({id(entry[0]): entry[0] for entry in info.foreign.values()}.values())
        info.owners = (len(info.foreign), owners)
    for owner in owners:
        graph = owner.ref()
        if graph is None or not getattr(graph, "captured", True):
            return False
    return True


def _other_graph(doctor, info, before_replay: bool) -> None:
    """A dropped or reset graph frees none of its outputs: a tensor still held keeps its block
    (CUDA's allocator returns a block to the pool only when its tensor goes). The read dangles
    once that holder has let go too (the block may have gone to a new capture's tensor already);
    until then the output is checked again before each replay. An output whose memory was freed in
    place (``moved``: a runtime unmapping the graph memory it thinks its own) dangles while it is
    held, whether its graph lives or not."""
    for key, (owner, op, source, tensor) in list(info.foreign.items()):
        graph = owner.ref()
        freed = info.liveness.where.get(key) if key in info.liveness.moved else None
        if freed is None:
            if graph is not None and getattr(graph, "captured", True):
                continue
            made = owner.made.get(key)
            if made is not None and made[0]() is not None and key not in info.collected:
                # Held, or only not yet collected (a cycle the program left): whether it is held must not
                # depend on when the collector last ran. One collection per output settles it.
                info.collected.add(key)
                gc.collect()
            if made is not None and made[0]() is not None:      # still the program's tensor
                continue
        del info.foreign[key]
        if freed is not None:       # (the output's memory itself was let go: "its owner" is whoever freed it)
            how, where, gone = "freed in place", freed, ""
            cause = explain.released_in_place(tensor, op, freed)
        else:
            how, where = owner.gone or ("dropped" if graph is None else "reset", None)
            gone, cause = ": its memory went back to the shared pool", explain.dangling_pool(tensor, op, owner.name, how)
        # (named where the owner was let go, the decisive act, as a released input is; the read is the evidence)
        finding = doctor.add(Finding(
            "dangling-reference", info.name, op, tensor, where or source,
            f"{_when(info, before_replay)}: the graph reads (through {op} at {source}) a {tensor} output of "
            f"{owner.name}, which was {how}{f' at {where}' if where else ''}{gone}", cause,
            {"replays_before": info.replays}), ("dangling-reference", op, source))
        _stop(doctor, finding, before_replay)


def _stop(doctor, finding: Finding, before_replay: bool) -> None:
    if doctor.guard and before_replay:
        raise DanglingReferenceError(finding)
