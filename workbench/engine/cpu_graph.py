"""``CPUGraph``: an emulation of ``torch.cuda.CUDAGraph`` with the same semantics, on the CPU.

What a CUDA graph is, reduced to the rules that cause bugs in serving stacks:

* **Capture records kernels, replay re-runs them on the same memory.** Here a ``TorchDispatchMode``
  records every aten op run inside the capture block, with its arguments keyed on *storage*.
  ``replay()`` re-runs exactly those ops; results of ops that allocated during capture are written
  back into the tensors captured then (the graph's static outputs), so every address stays fixed.
  An allocation (``torch.empty``) is no kernel: replay skips it, its memory keeps what it holds;
  nor is an in-place change of a tensor's shape (``squeeze_``): it is not recorded.
  An error raised by a replayed op names the op and the user's line that recorded it.
* **Python is frozen at capture.** Replay runs no Python of the captured function: a branch or a
  lazy ``if state is None`` check keeps the outcome it had during capture. Libraries that ask
  ``torch.cuda.is_current_stream_capturing()`` get True on the capturing thread (``queries``).
* **No replay while a capture is open** (on any thread), nor a capture begun inside it: CUDA refuses
  both (``CaptureError``), so a wrapper that replays its own graph inside an outer capture fails.
* **Capture launches nothing that lasts.** A CUDA capture does not execute kernels. The emulation
  has to execute ops (later Python needs their outputs), so it snapshots every pre-existing storage
  before the first write to it and restores it when capture ends; memory the graph allocated is
  filled with poison (NaN or an integer sentinel) until the first replay.
* **The graph owns only what it allocated.** Storages created during capture are blocks of the
  graph's pool (shared by every graph captured into it); a block no user tensor holds any more is
  handed to the pool's next allocation, in the same capture or a later one (``pool``). Everything
  else is merely *referenced*, by address. If its owner releases it, or gives its storage other
  memory in place (``resize_``, which frees the old), the next replay reads freed memory: this
  raises ``IllegalMemoryAccess`` (CUDA after ``empty_cache``), or, with ``on_freed="reuse"``,
  silently reads whatever a later allocation put there (CUDA's caching allocator handing the block
  on; graphs that referenced one address share one retained block). A pool block a holder frees
  in place (``untyped_storage().resize_(0)``) raises at the next replay that reads it, either way.
* **No host synchronisation inside capture.** ``.item()``, ``.cpu()``, ``nonzero``, printing values
  and boolean-mask indexing of device memory raise ``CaptureError`` naming the op and the user's
  source line -- except a mask filled with one host value (``x[mask] = 0``), which PyTorch runs as
  ``masked_fill_`` -- and so does Python data (a number, a list) made into a tensor on the device,
  or copied there (``t[0] = 0``, an index list: a pageable copy, which a capturing stream refuses);
  ``host_sync.py`` has the rules.
* **Host memory is not the device's.** Plain CPU tensors are device memory; host memory is what
  ``host(t, device)`` returns and what ops on host memory return (``host`` says why a subclass, and
  what it costs). Inside a capture, work on host memory (with Python data, ``pinned[1] = n``) runs
  once and is not recorded, ``.item()`` and ``.tolist()`` of it are legal, a 0-dim host tensor given
  to a device op is a constant of the graph (CUDA passes it by value), and a captured ``copy_`` from
  host memory re-reads it at every replay, by address (a CUDA memcpy node keeps the host pointer),
  also when the captured code made it: it is no block of the graph, and once released it raises or,
  with ``on_freed="reuse"``, holds the next host allocation's data -- if it is pinned (``host()``'s
  memory or a view of it) and the copy is ``non_blocking``: a copy from pageable host memory, or a
  blocking one (torch then syncs the stream), raises ``CaptureError``, as CUDA refuses both. A
  device op given host memory with elements raises, as on CUDA.
"""
from __future__ import annotations

import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from . import events, memory, queries
from .errors import CaptureError, GraphError, IllegalMemoryAccess
from .host import HostTensor, is_pinned
from .host_sync import (HostSyncGuard, blocking_copy_error, copies_python_data, flat, host_sync_error,
                        is_host_sync, non_blocking, pageable_copy_error)
from .pool import Pool
from .queries import is_capturing
from .opinfo import describe, metadata_only, span, storage_key, unique_storage_keys, written_tensors
from .recorded import ExternalRef, RecordedOp, _as_tuple, _poison, check_blocks
from .source import user_frame

__all__ = ["CPUGraph", "ExternalRef", "Pool", "RecordedOp", "describe", "host_sync_error",
           "is_capturing", "is_host_sync", "storage_key"]

aten = torch.ops.aten
queries.install()

_CAPTURING: weakref.WeakSet = weakref.WeakSet()     # graphs whose capture is open, on any thread
_LIFTS = frozenset({aten.lift_fresh, aten.lift_fresh_copy})
_DETACHES = frozenset({aten.detach, aten.detach_})
# Ops that only allocate: a CUDA capture records no kernel for them, so replay runs nothing and the
# memory keeps whatever was last written there (until the first write, the capture's poison).
ALLOCATIONS = frozenset({aten.empty, aten.empty_like, aten.new_empty, aten.empty_strided,
                         aten.new_empty_strided})


class _Recorder(TorchDispatchMode):
    """Records each aten op of a capture into its graph (see ``CPUGraph._record``)."""

    def __init__(self, graph: CPUGraph) -> None:
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.graph._record(func, args, kwargs or {})


class CPUGraph:
    """A CUDA-graph emulation on the CPU. Use through ``workbench.engine.graph``; see module doc."""

    def __init__(self, *, on_freed: str = "raise") -> None:
        if on_freed not in ("raise", "reuse"):
            raise ValueError(f"on_freed must be 'raise' or 'reuse', got {on_freed!r}")
        self.on_freed = on_freed
        self._state = "new"            # new -> capturing -> captured -> (reset) new
        self._ops: list[RecordedOp] = []
        self._externals: list[ExternalRef] = []
        self._external_index: dict[tuple, ExternalRef] = {}
        self._pool: Pool | None = None
        self._aliases: dict[tuple, tuple] = {}          # this graph's references to pool blocks (, bytes they span)
        self._alias_count: dict[int, int] = {}          # storage key -> number of aliases
        self._owned: list[torch.Tensor] = []
        self._host: set[int] = set()                    # host storages made inside the capture (its keys never reused)
        self._host_kept: list[torch.Tensor] = []        # ... which live as long as the graph
        self._held: list[torch.UntypedStorage] = []     # those the graph copies from, until capture end
        self._lifted, self._constants = set(), []       # constants made in the capture: keys; tensors it holds
        self._reused: set[int] = set()                  # pool blocks a capture-time tensor was placed in again
        self._snapshots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._modes: tuple = ()
        self.replays = 0

    # ----------------------------------------------------------------- capture
    def capture_begin(self, pool: Pool | None = None) -> None:
        if is_capturing():
            raise CaptureError("A graph capture is already open on this thread; captures do not nest. Finish "
                               "the outer `with graph(...)` block first.", op="a capture begun inside a capture")
        if self._state != "new":
            raise GraphError("This graph already holds a capture. Call g.reset() first, or create "
                             "a new graph with new_graph().")
        if pool is not None and not isinstance(pool, Pool):
            raise TypeError(f"pool must be a workbench Pool (graph_pool_handle() or g.pool()), got "
                            f"{type(pool).__name__}")
        self._pool = pool if pool is not None else Pool()
        self._ref = self._pool._enter(self)      # the pool forgets a dropped graph
        self._state = "capturing"
        queries.set_capturing(self)
        _CAPTURING.add(self)
        self._modes = (unique_storage_keys(), HostSyncGuard(self._made_from_python), _Recorder(self))
        for mode in self._modes:
            mode.__enter__()

    def capture_end(self) -> None:
        self._close_capture()
        # The emulation's own work; in inference mode, to put back tensors made in it (as on CUDA).
        with _disable_current_modes(), torch.inference_mode():
            for view, saved in self._snapshots.values():
                view.copy_(saved)
            for t in self._owned:
                _poison(t)
            if self.on_freed == "reuse":
                for ref in self._externals:
                    memory.retain(ref)
        self._held.clear()              # host memory made in the capture now lives only if its owner keeps it
        self._snapshots.clear()
        self._host.clear()
        self._lifted.clear()
        self._reused.clear()
        self._state = "captured"

    def capture_abort(self) -> None:
        """Called when the captured code raised: undo its writes and leave the graph empty."""
        self._close_capture()
        with _disable_current_modes():
            for view, saved in self._snapshots.values():
                view.copy_(saved)
        self._clear()

    def _close_capture(self) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(None, None, None)
        self._modes = ()
        queries.set_capturing(None)
        _CAPTURING.discard(self)

    def _is_host(self, t: torch.Tensor) -> bool:
        return type(t) is HostTensor or (bool(self._host) and storage_key(t) in self._host)

    def _record(self, func, args, kwargs):
        tensors = [t for t in flat(args, kwargs) if isinstance(t, torch.Tensor)]
        if any(map(self._is_host, tensors)) and all(self._is_host(t) or storage_key(t) in self._lifted for t in tensors):
            return self._run_on_host(func, args, kwargs)
        if is_host_sync(func, args, lambda t: storage_key(t) in self._lifted or self._is_host(t)):
            raise host_sync_error(str(func), user_frame())
        if func.overloadpacket is aten.copy_ and self._is_host(args[1]) and not self._is_host(args[0]):
            if not is_pinned(args[1]):
                raise pageable_copy_error(user_frame())
            if not non_blocking(args, kwargs):
                raise blocking_copy_error(user_frame())
        if copies_python_data(func, args, kwargs, self._made_from_python, self._is_host):
            raise pageable_copy_error(user_frame(), str(func), python_data=True)
        if metadata_only(func):     # no kernel; replayed, it would reshape the graph's own reference
            return func(*args, **kwargs)
        pool = self._pool
        packet = func.overloadpacket
        if packet in _LIFTS or (packet in _DETACHES and storage_key(args[0]) in self._lifted):
            # A constant created in the captured code (torch.tensor(...)): the graph keeps it. The
            # lift and the detach that follows it exist only under a Python dispatch mode, so they
            # are not recorded: a CUDA trace has neither.
            self._adopt(args[0], constant=True)
            self._lifted.add(storage_key(args[0]))
            self._constants.append(args[0])
            return func(*args, **kwargs)
        writes = []
        for t in written_tensors(func, args, kwargs):
            key = storage_key(t)
            writes.append(key)
            if not pool.owns(key) and key not in self._snapshots:
                with _disable_current_modes():
                    whole = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
                    self._snapshots[key] = (whole, whole.clone())
        source = user_frame()
        reads: set[int] = set()
        slots: list = []

        def template(where, key, value):
            if isinstance(value, torch.Tensor):
                slots.append((where, key, None, self._slot(value, func, source, reads)))
                return None
            if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
                for j, v in enumerate(value):
                    if isinstance(v, torch.Tensor):
                        slots.append((where, key, j, self._slot(v, func, source, reads)))
                return [None if isinstance(v, torch.Tensor) else v for v in value]
            return value

        args_t = [template("a", i, a) for i, a in enumerate(args)]
        kwargs_t = {k: template("k", k, v) for k, v in kwargs.items()}
        out = func(*args, **kwargs)
        results, outputs = [], []
        for o in _as_tuple(out):
            if isinstance(o, torch.Tensor) and storage_key(o) not in reads:
                o = self._place(o, reads)
                outputs.append(self._adopt(o))
            else:
                outputs.append(None)
            results.append(o)
        is_view = not writes and all(o is None for o in outputs)
        op = RecordedOp(func, args_t, kwargs_t, slots, outputs, frozenset(reads), frozenset(writes),
                        is_view, source)
        if not op.external_refs():
            op.bound = op.bind([])
        self._ops.append(op)
        if not any(o is not None for o in outputs):
            return out
        return tuple(results) if isinstance(out, (tuple, list)) else results[0]

    def _made_from_python(self, t: torch.Tensor) -> bool:
        """Whether the captured code made ``t`` from Python data: host memory on CUDA (a constant)."""
        return storage_key(t) in self._lifted and not self._is_host(t)

    def _run_on_host(self, func, args, kwargs):
        """Host work inside a capture runs now, once, and is not part of the graph (as on CUDA)."""
        with _disable_current_modes():
            out = func(*args, **kwargs)
        for o in _as_tuple(out):
            if isinstance(o, torch.Tensor):
                self._host.add(storage_key(o))
        return out

    def _in_reused_block(self, t: torch.Tensor) -> bool:
        """Whether the capture placed ``t`` in a pool block an earlier tensor of it left, whose recorded
        ops a replay still runs there: ``host()`` copies such a ``t`` out before claiming it."""
        return storage_key(t) in self._reused

    def _claim_host(self, t: torch.Tensor) -> None:
        """``host(t)`` inside the capture: ``t``'s memory is host memory, made by host work that
        CUDA does not record (``torch.tensor(...).pin_memory()``). If the capture took it for a
        block of the graph's pool (a constant or a factory's output), give it back: the graph keeps
        neither the op that made it nor a device block for it, and a captured copy from it reads it
        by address (``_external``), as a CUDA memcpy node keeps the host pointer. The host block
        itself lives as long as the graph: on an H100 with torch 2.11 its values survive the next
        host allocation (``results/gpu/engine_probes.json``, probe ``host_made_in_capture``)."""
        key = storage_key(t)
        self._host.add(key)
        self._host_kept.append(t)           # torch's host allocator keeps capture-time blocks for the graph
        if not self._pool.owns(key):
            return
        self._pool._drop(key)
        for alias_key in [k for k in self._aliases if k[0] == key]:
            del self._aliases[alias_key]
        self._alias_count.pop(key, None)
        self._lifted.discard(key)
        self._constants = [c for c in self._constants if storage_key(c) != key]
        with _disable_current_modes():
            self._owned = [o for o in self._owned if storage_key(o) != key]
            self._ops = [op for op in self._ops if op.writes or not op.has_outputs
                         or any(o is not None and storage_key(o) != key for o in op.outputs)]

    def _place(self, t: torch.Tensor, busy: set) -> torch.Tensor:
        """``t``, moved in place into a free pool block of its size if there is one (as CUDA's allocator)."""
        block = self._pool._free_block(t.untyped_storage().nbytes(), busy, _alias_count)
        if block is not None:
            with _disable_current_modes():
                placed = torch.empty(0, dtype=t.dtype).set_(block, t.storage_offset(), t.shape, t.stride())
                placed.copy_(t)
                t.set_(placed.untyped_storage(), t.storage_offset(), t.shape, t.stride())
            self._reused.add(storage_key(t))
        return t                 # the same object: whoever saw it made (an observer below) sees it moved

    def _slot(self, t: torch.Tensor, func, source: str, reads: set):
        """What the recorded op holds for argument ``t``: an alias if the pool owns it, a constant
        for a 0-dim host tensor (passed by value), else a weak reference."""
        key = storage_key(t)
        reads.add(key)
        if self._pool.owns(key):
            self._pool._adopt(self._ref, t)          # this graph uses the block too
            return self._alias(t)
        if t.dim() == 0 and self._is_host(t) and func.overloadpacket is not aten.copy_:
            with _disable_current_modes(), torch._C.DisableTorchFunctionSubclass():
                return t.clone()
        return self._external(t, func, source)

    def _alias(self, t: torch.Tensor) -> torch.Tensor:
        """This graph's own reference to pool memory: never the user's tensor object, so a block
        whose user tensors are gone can be seen to be free (``pool``)."""
        key = (storage_key(t), t.dtype, tuple(t.shape), t.stride(), t.storage_offset())
        entry = self._aliases.get(key)
        if entry is None:
            with _disable_current_modes():
                alias = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), t.storage_offset(),
                                                           t.shape, t.stride())
            entry = self._aliases[key] = (alias, (span(alias) or (0, 0))[1])
            self._alias_count[key[0]] = self._alias_count.get(key[0], 0) + 1
        return entry[0]

    def _adopt(self, t: torch.Tensor, constant: bool = False) -> torch.Tensor:
        """Make ``t``'s storage a block of the pool; constants keep their value, the rest is
        poisoned at capture end (a CUDA capture computes nothing)."""
        self._pool._adopt(self._ref, t)
        alias = self._alias(t)
        if not constant:
            self._owned.append(alias)
        return alias

    def _external(self, t: torch.Tensor, func, source: str) -> ExternalRef:
        key = (storage_key(t), t.dtype, tuple(t.shape), t.stride(), t.storage_offset())
        ref = self._external_index.get(key)
        if ref is None:
            host = self._is_host(t)
            ref = ExternalRef(len(self._externals), StorageWeakRef(t.untyped_storage()), t.dtype,
                              tuple(t.shape), t.stride(), t.storage_offset(),
                              t.untyped_storage().nbytes(), f"{func} at {source}",
                              memory.origin_of(t), host=host, address=t.untyped_storage().data_ptr())
            if host and storage_key(t) in self._host:
                self._held.append(t.untyped_storage())   # its bytes are retained at capture end
            self._externals.append(ref)
            self._external_index[key] = ref
        return ref

    # ------------------------------------------------------------------ replay
    def replay(self) -> None:
        if self._state == "capturing":
            raise GraphError("replay() called inside the graph's own capture block: the capture is "
                             "still open, so there is nothing complete to replay yet. Replay after the "
                             "`with graph(g):` block ends; to run the code once more during capture, "
                             "call it directly.")
        if self._state != "captured":
            raise GraphError("replay() called before capture (or after reset): capture the graph "
                             "first with `with graph(g): ...`.")
        if _CAPTURING:
            raise CaptureError("Cannot prepare for replay during capturing stage: another graph's capture is open, "
                               "and CUDA refuses every replay while one is (on any thread: the device's random-number "
                               "state is registered with both graphs). Replay after that capture ends, or run the "
                               "step eagerly while capturing (is_capturing()).", op="a replay while a capture is open")
        events.replay_begin(self)
        try:
            self._run()
            self.replays += 1
        finally:
            events.replay_end(self)

    def _run(self) -> None:
        """The recorded kernels, outside autograd as on CUDA (a replay records no autograd history
        and may write tensors captured in inference mode)."""
        with torch.inference_mode():
            check_blocks(self._aliases.values(), self._ops)
            live = [self._materialize(ref) for ref in self._externals]
            for op in self._ops:
                if op.is_view or op.func.overloadpacket in ALLOCATIONS:
                    continue
                args, kwargs = op.bind(live)
                try:
                    out = op.func(*args, **kwargs)
                except Exception as e:
                    e.add_note(f"raised replaying {op.name}, recorded at {op.source}")
                    raise
                if op.has_outputs:
                    for dst, src in zip(op.outputs, _as_tuple(out)):
                        if dst is not None:
                            dst.copy_(src)

    def _materialize(self, ref: ExternalRef) -> torch.Tensor:
        storage = ref.storage()
        if storage is not None:
            return ref.on(storage)
        if ref.retained is not None:
            return ref.on(ref.retained)
        reader = next(op for op in self._ops if any(r is ref for r in op.external_refs()))
        origin = ref.origin or "before capture (run the setup under workbench.engine.track_origins() to see where)"
        how = ("its owner released it after capture" if ref.weak.expired() else
               "its owner's storage was given other memory after capture (a resize_), which freed this")
        raise IllegalMemoryAccess(
            f"graph replay read freed memory: {reader.name} at {reader.source}\n"
            f"  reads a {ref.describe()} tensor ({ref.nbytes} bytes) that the graph does not own;\n"
            f"  it was created {origin},\n"
            f"  and {how}. A graph keeps only the address of memory "
            "it did not allocate.\n  Fix: keep a reference to the tensor, and its memory, for as long as the "
            "graph lives, or create it inside the capture so the graph's pool owns it.")

    # ------------------------------------------------------------------- admin
    def reset(self) -> None:
        """Drop the capture and give its memory back to the pool (``CUDAGraph.reset``)."""
        if self._state == "capturing":
            raise GraphError("reset() inside the graph's own capture block.")
        self._clear()
        events.graph_reset(self)

    def _clear(self) -> None:
        if self._pool is not None:
            self._pool._forget(self._ref)
        self._ops, self._externals, self._owned, self._host_kept, self._constants = [], [], [], [], []
        for kept in (self._aliases, self._alias_count, self._external_index, self._snapshots, self._host, self._held,
                     self._lifted):
            kept.clear()
        self._state = "new"
        self.replays = 0

    def pool(self) -> Pool:
        if self._pool is None:
            raise GraphError("This graph has no pool yet: it is created by its first capture.")
        return self._pool

    @property
    def ops(self) -> tuple[RecordedOp, ...]:
        """The recorded kernels in capture order (views included, flagged ``is_view``)."""
        return tuple(self._ops)

    @property
    def captured(self) -> bool:
        return self._state == "captured"

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s memory belongs to this graph's pool (else the graph only references it)."""
        return self._pool is not None and self._pool.owns(storage_key(t))

    def __repr__(self) -> str:
        kernels = sum(not op.is_view for op in self._ops)
        return f"CPUGraph({self._state}, {kernels} kernels, {len(self._externals)} external tensors)"


def _alias_count(graph: CPUGraph | None, key: int) -> int:
    return 0 if graph is None else graph._alias_count.get(key, 0)

