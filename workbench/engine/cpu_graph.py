"""``CPUGraph``: an emulation of ``torch.cuda.CUDAGraph`` with the same semantics, on the CPU.

What a CUDA graph is, reduced to the rules that cause bugs in serving stacks:

* **Capture records kernels, replay re-runs them on the same memory.** Here a ``TorchDispatchMode``
  records every aten op run inside the capture block, with its arguments keyed on *storage*.
  ``replay()`` re-runs exactly those ops; results of ops that allocated during capture are written
  back into the tensors captured then (the graph's static outputs), so every address stays fixed.
* **Python is frozen at capture.** Replay runs no Python of the captured function: a branch or a
  lazy ``if state is None`` check keeps the outcome it had during capture.
* **Capture launches nothing that lasts.** A CUDA capture does not execute kernels. The emulation
  has to execute ops (later Python needs their outputs), so it snapshots every pre-existing storage
  before the first write to it and restores it when capture ends; memory the graph allocated is
  filled with poison (NaN or an integer sentinel) until the first replay.
* **The graph owns only what it allocated.** Storages created during capture belong to the graph's
  pool (shared by every graph captured into it). Everything else is merely *referenced*, by
  address. If its owner releases it, the next replay reads freed memory: this raises
  ``IllegalMemoryAccess`` (CUDA after ``empty_cache``), or, with ``on_freed="reuse"``, silently reads
  whatever a later allocation put there (CUDA's caching allocator handing the block on).
* **No host synchronisation inside capture.** ``.item()``, ``.cpu()``, ``nonzero``, printing values
  and boolean-mask indexing raise ``CaptureError`` naming the op and the user's source line.
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from . import events, memory, queries
from .errors import CaptureError, GraphError, IllegalMemoryAccess
from .queries import is_capturing
from .source import user_frame

aten = torch.ops.aten

# Ops whose result the host must wait for (the data decides a shape or a Python value).
HOST_SYNC_OPS = frozenset({
    aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten.equal, aten.is_nonzero,
    aten._unique, aten._unique2, aten.unique_dim, aten.unique_consecutive,
})
# Tensor methods that read values on the host before any aten op would show it.
HOST_SYNC_METHODS = frozenset({
    "item", "tolist", "numpy", "cpu", "__repr__", "__str__", "__format__",
    "__bool__", "__int__", "__float__",
})
_INDEX_OPS = frozenset({aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_})

queries.install()


def storage_key(t: torch.Tensor) -> int:
    """Identity of a tensor's memory: views of one storage share it."""
    return t.untyped_storage()._cdata


def describe(t: torch.Tensor) -> str:
    """``float32[4, 8]``: what a person needs to recognise a tensor, without reading its values."""
    dtype = str(t.dtype).replace("torch.", "")
    return f"{dtype}[{', '.join(str(s) for s in t.shape)}]"


class Pool:
    """Memory owned by graphs (a CUDA graph's private mempool). Several graphs may share one.

    Graphs are held weakly: a graph holds its pool, so a strong back-reference would keep dropped
    graphs (and, in reuse mode, their retained blocks) alive until the garbage collector runs.
    """

    def __init__(self) -> None:
        self._owned: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

    def owns(self, key: int) -> bool:
        return key in self._owned

    def _adopt(self, graph_ref: weakref.ref, t: torch.Tensor) -> None:
        self._owned.setdefault(storage_key(t), (graph_ref, t))

    def _forget(self, graph_ref: weakref.ref) -> None:
        """Give back the memory of a graph that was reset or dropped."""
        self._owned = {k: v for k, v in self._owned.items() if v[0] is not graph_ref}

    def __len__(self) -> int:
        return len(self._owned)

    def __repr__(self) -> str:
        return f"Pool({len(self)} storages)"


@dataclasses.dataclass(eq=False)
class ExternalRef:
    """A tensor the graph reads or writes but does not own: a weak reference plus its view geometry."""

    index: int
    weak: StorageWeakRef
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    nbytes: int
    first_use: str
    origin: str | None
    retained: torch.UntypedStorage | None = None   # on_freed="reuse": the block's bytes

    def describe(self) -> str:
        return f"{str(self.dtype).replace('torch.', '')}[{', '.join(map(str, self.size))}]"

    def materialize(self) -> torch.Tensor:
        """The tensor for this replay; the caller has checked that it is alive or retained."""
        if self.weak.expired():
            storage = self.retained
        else:
            storage = torch.UntypedStorage._new_with_weak_ptr(self.weak.cdata)
        return torch.empty(0, dtype=self.dtype).set_(storage, self.offset, self.size, self.stride)


@dataclasses.dataclass(eq=False)
class RecordedOp:
    """One captured kernel: the op, its arguments, what it reads and writes, and where it came from.

    ``args``/``kwargs`` hold the non-tensor arguments with ``None`` where a tensor goes; ``slots``
    says which tensor goes where: ``(where, key, list_index, tensor_or_ref)``, ``where`` being
    ``"a"`` (positional) or ``"k"`` (keyword). Owned tensors are held directly; memory the graph
    does not own is an ``ExternalRef``, resolved at each replay.
    """

    func: Any
    args: list
    kwargs: dict
    slots: list
    outputs: list              # captured owned outputs (None where an output aliases an input)
    reads: frozenset           # storage keys
    writes: frozenset
    is_view: bool
    source: str
    bound: tuple | None = None  # (args, kwargs) ready to call, when no argument is external

    def __post_init__(self) -> None:
        self.has_outputs = any(o is not None for o in self.outputs)

    @property
    def name(self) -> str:
        return str(self.func)

    def external_refs(self) -> list[ExternalRef]:
        return [slot[3] for slot in self.slots if isinstance(slot[3], ExternalRef)]

    def bind(self, live: list[torch.Tensor]) -> tuple[list, dict]:
        """The call's arguments for this replay, with external tensors taken from ``live``."""
        if self.bound is not None:
            return self.bound
        args, kwargs, copied = list(self.args), dict(self.kwargs), set()
        for where, key, sub, slot in self.slots:
            value = live[slot.index] if type(slot) is ExternalRef else slot
            container = args if where == "a" else kwargs
            if sub is None:
                container[key] = value
            else:
                if (where, key) not in copied:
                    container[key] = list(container[key])
                    copied.add((where, key))
                container[key][sub] = value
        return args, kwargs

    def __repr__(self) -> str:
        kind = "view" if self.is_view else ("writes" if self.writes else "new")
        return f"<{self.name} ({kind}) at {self.source}>"


def _as_tuple(out) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _written_tensors(func, args, kwargs) -> list[torch.Tensor]:
    """Tensors the op's schema marks as written (``Tensor(a!)``): in-place self, ``out=`` args."""
    written = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        if isinstance(value, torch.Tensor):
            written.append(value)
        elif isinstance(value, (list, tuple)):
            written.extend(v for v in value if isinstance(v, torch.Tensor))
    return written


def _poison(t: torch.Tensor) -> None:
    """Fill a whole storage with a value no correct computation produces."""
    whole = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage())
    if whole.dtype.is_floating_point or whole.dtype.is_complex:
        whole.fill_(float("nan"))
    elif whole.dtype == torch.bool:
        whole.fill_(True)
    else:
        whole.fill_(torch.iinfo(whole.dtype).min if whole.dtype.is_signed else torch.iinfo(whole.dtype).max)


def is_host_sync(func, args) -> bool:
    """Whether an aten op needs the device's data on the host (its output shape or value depends
    on it): a CUDA graph cannot record it."""
    packet = func.overloadpacket
    return packet in HOST_SYNC_OPS or (packet in _INDEX_OPS and _has_mask_index(args))


def host_sync_error(op: str, source: str) -> CaptureError:
    return CaptureError(
        f"{op} inside graph capture needs the device's values on the host (a host synchronisation), "
        f"which a CUDA graph cannot wait for (cudaErrorStreamCaptureUnsupported).\n  at {source}\n"
        "Move it before or after the captured region, or keep it on the device (e.g. torch.where).",
        op=op, source=source)


class _HostSyncGuard(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_SYNC_METHODS:
            raise host_sync_error(f"Tensor.{name}()", user_frame())
        return func(*args, **(kwargs or {}))


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
        self._owned: list[torch.Tensor] = []
        self._constants: list[torch.Tensor] = []
        self._snapshots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._modes: tuple = ()
        self.replays = 0

    # ----------------------------------------------------------------- capture
    def capture_begin(self, pool: Pool | None = None) -> None:
        if is_capturing():
            raise GraphError("A graph capture is already open on this thread; captures do not nest. "
                             "Finish the outer `with graph(...)` block first.")
        if self._state != "new":
            raise GraphError("This graph already holds a capture. Call g.reset() first, or create "
                             "a new graph with new_graph().")
        if pool is not None and not isinstance(pool, Pool):
            raise TypeError(f"pool must be a workbench Pool (graph_pool_handle() or g.pool()), got "
                            f"{type(pool).__name__}")
        self._pool = pool if pool is not None else Pool()
        self._ref = weakref.ref(self, self._pool._forget)   # the pool forgets a dropped graph
        self._state = "capturing"
        queries.set_capturing(self)
        self._modes = (_HostSyncGuard(), _Recorder(self))
        for mode in self._modes:
            mode.__enter__()

    def capture_end(self) -> None:
        self._close_capture()
        with _disable_current_modes():     # the emulation's own work, not the user's ops
            for view, saved in self._snapshots.values():
                view.copy_(saved)
            for t in self._owned:
                _poison(t)
            if self.on_freed == "reuse":
                for ref in self._externals:
                    ref.retained = torch.UntypedStorage._new_with_weak_ptr(ref.weak.cdata).clone()
                    memory.register_retained(ref)
        self._snapshots.clear()
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

    def _record(self, func, args, kwargs):
        packet = func.overloadpacket
        if is_host_sync(func, args):
            raise host_sync_error(str(func), user_frame())
        pool = self._pool
        if packet in (aten.lift_fresh, aten.lift_fresh_copy):
            # A constant created in the captured code (torch.tensor(...)): the graph keeps it.
            for t in args:
                if isinstance(t, torch.Tensor):
                    self._adopt(t, constant=True)
        writes = []
        for t in _written_tensors(func, args, kwargs):
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
        outputs = []
        for o in _as_tuple(out):
            if isinstance(o, torch.Tensor) and storage_key(o) not in reads:
                self._adopt(o)
                outputs.append(o)
            else:
                outputs.append(None)
        is_view = not writes and all(o is None for o in outputs)
        op = RecordedOp(func, args_t, kwargs_t, slots, outputs, frozenset(reads), frozenset(writes),
                        is_view, source)
        if not op.external_refs():
            op.bound = op.bind([])
        self._ops.append(op)
        return out

    def _slot(self, t: torch.Tensor, func, source: str, reads: set):
        """What the recorded op holds for argument ``t``: the tensor if owned, else a weak ref."""
        key = storage_key(t)
        reads.add(key)
        return t if self._pool.owns(key) else self._external(t, func, source)

    def _adopt(self, t: torch.Tensor, constant: bool = False) -> None:
        """Make ``t``'s storage the graph's; constants keep their value, the rest is poisoned at
        capture end (a CUDA capture computes nothing)."""
        if not self._pool.owns(storage_key(t)):
            self._pool._adopt(self._ref, t)
            (self._constants if constant else self._owned).append(t)

    def _external(self, t: torch.Tensor, func, source: str) -> ExternalRef:
        key = (storage_key(t), t.dtype, tuple(t.shape), t.stride(), t.storage_offset())
        ref = self._external_index.get(key)
        if ref is None:
            ref = ExternalRef(len(self._externals), StorageWeakRef(t.untyped_storage()), t.dtype,
                              tuple(t.shape), t.stride(), t.storage_offset(),
                              t.untyped_storage().nbytes(), f"{func} at {source}",
                              memory.origin_of(t))
            self._externals.append(ref)
            self._external_index[key] = ref
        return ref

    # ------------------------------------------------------------------ replay
    def replay(self) -> None:
        if self._state != "captured":
            what = {"new": "before capture (or after reset)", "capturing": "inside its own capture"}
            raise GraphError(f"replay() called {what[self._state]}: capture the graph first with "
                             "`with graph(g): ...`.")
        events.replay_begin(self)
        try:
            live = [self._materialize(ref) for ref in self._externals]
            for op in self._ops:
                if op.is_view:
                    continue
                args, kwargs = op.bind(live)
                out = op.func(*args, **kwargs)
                if op.has_outputs:
                    for dst, src in zip(op.outputs, _as_tuple(out)):
                        if dst is not None:
                            dst.copy_(src)
            self.replays += 1
        finally:
            events.replay_end(self)

    def _materialize(self, ref: ExternalRef) -> torch.Tensor:
        if ref.weak.expired() and ref.retained is None:
            reader = next(op for op in self._ops if any(r is ref for r in op.external_refs()))
            origin = ref.origin or "before capture (run the setup under workbench.engine.track_origins() to see where)"
            raise IllegalMemoryAccess(
                f"graph replay read freed memory: {reader.name} at {reader.source}\n"
                f"  reads a {ref.describe()} tensor ({ref.nbytes} bytes) that the graph does not own;\n"
                f"  it was created {origin},\n"
                "  and its owner released it after capture. A graph keeps only the address of memory "
                "it did not allocate.\n  Fix: keep a reference to the tensor for as long as the graph "
                "lives, or create it inside the capture so the graph's pool owns it.")
        return ref.materialize()

    # ------------------------------------------------------------------- admin
    def reset(self) -> None:
        """Drop the capture and give its memory back to the pool (``CUDAGraph.reset``)."""
        if self._state == "capturing":
            raise GraphError("reset() inside the graph's own capture block.")
        self._clear()

    def _clear(self) -> None:
        if self._pool is not None:
            self._pool._forget(self._ref)
        self._ops, self._externals, self._owned, self._constants = [], [], [], []
        self._external_index.clear()
        self._snapshots.clear()
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


def _has_mask_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())
