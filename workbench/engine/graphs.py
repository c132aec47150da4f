"""``GraphManager``: one graph per capture size, in one pool, captured after warmups.

Every serving stack writes this loop, and every runner in the workbench is built on this one copy
of it (vLLM's ``CUDAGraphWrapper`` and MRV2's ``CudaGraphManager`` play the same role there). The
manager owns *when* graphs are captured and replayed; the runner above it owns *what* the graphs
read: its static buffers, how a batch is copied in, what padded rows hold. That split is on
purpose: the upstream bugs live in the runners' buffer policies, and the manager must not hide them.

Contract:

* ``forward(size)`` is the step captured for ``size``: it reads static buffers through views
  ``[:size]`` that the runner keeps, and returns a tensor or a tuple of tensors (the graph's static
  outputs). Its Python runs at warmup and at capture only; replay runs none of it.
* ``capture()`` runs, per size (largest first unless ``descending=False``), ``num_warmups`` eager
  warmups then the capture, all into one pool (``shared_pool=False``: a pool per graph). Capture
  runs under ``torch.no_grad`` unless ``grad=True``.
* Modes are vLLM's ``CUDAGraphMode``: ``FULL`` captures the whole step; ``PIECEWISE`` splits the
  capture at every call of a function wrapped by ``eager(fn)`` and runs that function eagerly,
  between the pieces, at every replay (vLLM's piecewise graphs with attention outside them);
  ``NONE`` captures nothing and ``dispatch`` always answers eager.
* ``recapture()`` drops every graph and captures them again, into a fresh shared pool: after a
  weight update or a resize, as a serving stack must.
* Every moment the graph doctor needs is announced (``workbench.engine.events``): static buffers,
  warmups, captures, each served replay with its real and padded rows (in FULL mode also an
  ``eager`` callable that re-runs the step without graphs, for differential replay), and the
  outputs handed to the caller.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import numbers
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from . import events
from .api import graph, graph_pool_handle, new_graph, resolve_device
from .cpu_graph import CPUGraph
from .errors import GraphError

Outputs = torch.Tensor | tuple[torch.Tensor, ...]
Buffers = Mapping[str, torch.Tensor]


class CUDAGraphMode(enum.Enum):
    """How a step runs, spelled as vLLM's ``CUDAGraphMode``."""

    NONE = "NONE"
    PIECEWISE = "PIECEWISE"
    FULL = "FULL"

    @classmethod
    def of(cls, mode: CUDAGraphMode | str) -> CUDAGraphMode:
        if isinstance(mode, cls):
            return mode
        try:
            return cls(str(mode).upper())
        except ValueError:
            raise ValueError(f"mode must be one of {[m.value for m in cls]}, got {mode!r}") from None


def validate_capture_sizes(sizes: Any) -> list[int]:
    """Positive, unique integers (NumPy integers too), returned ascending; anything else is a clear
    ``ValueError`` that says what to pass."""
    example = "give a list of batch sizes, e.g. capture_sizes=[1, 2, 4, 8]"
    if isinstance(sizes, (str, bytes)) or sizes is None or isinstance(sizes, numbers.Number):
        raise ValueError(f"capture_sizes must be a sequence of integers, got {sizes!r} "
                         f"({type(sizes).__name__}): {example}")
    try:
        sizes = list(sizes)
    except TypeError:
        raise ValueError(f"capture_sizes must be a sequence of integers, got {type(sizes).__name__}: "
                         f"{example}") from None
    if not sizes:
        raise ValueError(f"capture_sizes is empty: {example}")
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, numbers.Integral):
            raise ValueError(f"capture sizes must be integers, got {s!r} ({type(s).__name__}): {example}")
        if s <= 0:
            raise ValueError(f"capture sizes must be positive, got {int(s)}")
    sizes = [int(s) for s in sizes]
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"capture sizes must be unique, got {sizes}")
    return sorted(sizes)


def validate_num_warmups(num_warmups: Any) -> int:
    if isinstance(num_warmups, bool) or not isinstance(num_warmups, numbers.Integral) or num_warmups < 0:
        raise ValueError(f"num_warmups must be an integer >= 0, got {num_warmups!r} "
                         "(vLLM's default is 1: one eager run before each capture)")
    return int(num_warmups)


@dataclasses.dataclass
class _EagerCall:
    """One call of an ``eager(fn)`` region recorded at capture: replayed between two pieces."""

    fn: Callable[..., Any]
    args: tuple
    kwargs: dict
    output: Any                  # static copy of fn's result that the next piece reads


class GraphManager:
    """Warmup, capture, dispatch and replay of one graph (or one set of pieces) per capture size."""

    def __init__(self, forward: Callable[[int], Outputs], capture_sizes: Sequence[int], *,
                 device: str | torch.device = "cpu", mode: CUDAGraphMode | str = CUDAGraphMode.FULL,
                 num_warmups: int = 1, static_buffers: Buffers | Callable[[int], Buffers] | None = None,
                 descending: bool = True, shared_pool: bool = True, grad: bool = False,
                 on_freed: str = "raise", name: str | None = None) -> None:
        if not callable(forward):
            raise TypeError(f"forward must be callable as forward(size), got {type(forward).__name__}")
        self.forward = forward
        self.capture_sizes = validate_capture_sizes(capture_sizes)
        self.max_size = self.capture_sizes[-1]
        self.device = resolve_device(device)
        self.mode = CUDAGraphMode.of(mode)
        self.num_warmups = validate_num_warmups(num_warmups)
        self.static_buffers = static_buffers
        self.descending, self.shared_pool, self.grad = descending, shared_pool, grad
        self.on_freed = on_freed
        self.name = name or type(self).__name__
        self.pool = None
        self.graphs: dict[int, list] = {}              # size -> [graph] (FULL) or its pieces (PIECEWISE)
        self.outputs: dict[int, Outputs] = {}          # size -> static outputs
        self.buffers: dict[int, Buffers] = {}          # size -> the static buffers announced for it
        self.capturing: int | None = None              # the size being warmed up or captured
        self.captures = 0                              # capture rounds (1 + re-captures)
        self._schedule: dict[int, list] = {}           # PIECEWISE: size -> pieces and eager calls, in order
        self._pieces: list | None = None               # open PIECEWISE capture: its schedule so far
        self._piece_ctx: contextlib.AbstractContextManager | None = None
        self._passthrough = True                       # eager regions run as plain calls

    # ------------------------------------------------------------------ capture
    def capture(self, progress: Callable[[Sequence[int]], Sequence[int]] | None = None) -> None:
        """Warm up then capture each size into the pool. ``progress`` wraps the sizes (e.g. tqdm).
        A failure leaves the sizes captured so far, and nothing half-captured."""
        if self.mode is CUDAGraphMode.NONE:
            return
        if self.graphs:
            raise GraphError("capture() was already called: use recapture() to capture again")
        if self.pool is None and self.shared_pool:
            self.pool = graph_pool_handle(self.device)
        if isinstance(self.static_buffers, Mapping):
            events.static_buffers(self.name, self.static_buffers)
        order = sorted(self.capture_sizes, reverse=self.descending)
        self.captures += 1
        for size in (progress(order) if progress else order):
            self.capturing = size
            with self._grad_mode():
                self._capture_size(size)
        self.capturing = None

    def recapture(self) -> None:
        """Drop every graph and capture them again (after a weight update or a resize). Outputs
        handed out before are stale afterwards, as on CUDA. The pool goes with its last graph (the
        caching allocator frees a private pool no graph uses, and refuses its handle afterwards),
        so the new graphs share a fresh one."""
        for pieces in self.graphs.values():
            for g in pieces:
                g.reset()
        self.pool = None
        self.graphs.clear()
        self.outputs.clear()
        self._schedule.clear()
        self.capture()

    def _capture_size(self, size: int) -> None:
        if callable(self.static_buffers):
            self.buffers[size] = dict(self.static_buffers(size))
            events.static_buffers(f"{self.name} size {size}", self.buffers[size])
        elif self.static_buffers:
            self.buffers[size] = dict(self.static_buffers)
        for _ in range(self.num_warmups):
            with events.warmup():
                self.forward(size)
        pool = self.pool if self.shared_pool else None
        if self.mode is CUDAGraphMode.FULL:
            g = self._new_graph()
            with graph(g, pool=pool, name=f"size {size}"):
                out = self.forward(size)
            self.graphs[size], self.outputs[size] = [g], out
            return
        self._pieces = []
        try:
            self._passthrough = False
            self._open_piece(size, pool)
            out = self.forward(size)
            self._close_piece(None)
        except BaseException as e:
            if self._piece_ctx is not None:
                self._close_piece(e)
            raise
        finally:
            self._passthrough = True
            schedule, self._pieces = self._pieces, None
        self._schedule[size] = schedule
        self.graphs[size] = [step for step in schedule if not isinstance(step, _EagerCall)]
        self.outputs[size] = out

    def _new_graph(self):
        return new_graph(self.device, on_freed=self.on_freed)

    def _open_piece(self, size: int, pool) -> None:
        g = self._new_graph()
        self._piece_ctx = graph(g, pool=pool, name=f"size {size} piece {sum(not isinstance(s, _EagerCall) for s in self._pieces)}")
        self._piece_ctx.__enter__()
        self._pieces.append(g)

    def _close_piece(self, error: BaseException | None) -> None:
        ctx, self._piece_ctx = self._piece_ctx, None
        if error is not None:
            ctx.__exit__(type(error), error, error.__traceback__)
            return
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ctx.__exit__(None, None, None)
        if _empty(self._pieces[-1], caught):          # nothing between two eager regions
            self._pieces.pop()

    @contextlib.contextmanager
    def _grad_mode(self):
        with contextlib.nullcontext() if self.grad else torch.no_grad():
            yield

    # ------------------------------------------------------------------ PIECEWISE
    def eager(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Wrap ``fn`` as code that stays outside the graphs in PIECEWISE mode (vLLM runs attention
        so). During a PIECEWISE capture each call ends the current piece, runs ``fn`` eagerly on its
        arguments, keeps a static copy of the result for the next piece, and opens the next piece;
        every replay runs ``fn`` again on the same arguments between the same pieces. In FULL and
        NONE modes, and in warmups, it is ``fn`` itself."""
        def region(*args: Any, **kwargs: Any) -> Any:
            if self._passthrough or self._pieces is None:
                return fn(*args, **kwargs)
            size = self.capturing
            self._close_piece(None)
            with events.dummy_run():
                out = fn(*args, **kwargs)
            static = _static_copy(out)
            self._pieces.append(_EagerCall(fn, args, kwargs, static))
            self._open_piece(size, self.pool if self.shared_pool else None)
            return static
        return region

    # ------------------------------------------------------------------ serving
    def dispatch(self, n: int) -> int | None:
        """The captured size a batch of ``n`` rows runs at; ``None``: run it eagerly (mode NONE, or
        larger than the largest captured size)."""
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            raise ValueError(f"a batch needs a positive whole number of rows, got {n!r}")
        if self.mode is CUDAGraphMode.NONE or n > self.max_size:
            return None
        return next(s for s in self.capture_sizes if s >= n)

    def replay(self, size: int, real: int, *, padded: Mapping[str, Any] | None = None,
               padded_columns: Mapping[str, tuple[Any, int]] | None = None) -> Outputs:
        """Replay the graph(s) of ``size`` serving ``real`` rows (rows ``[real, size)`` of the
        ``padded`` arrays are padded rows; columns from ``width`` on of each ``(array, width)`` in
        ``padded_columns`` are padded columns). Returns the static outputs sliced to ``[:real]``:
        views, valid until the next replay of this size."""
        if size not in self.graphs:
            if not self.graphs:
                raise GraphError("no graphs captured yet: call capture() before serving")
            raise GraphError(f"no graph of size {size}; captured sizes are {sorted(self.graphs)} "
                             "(use dispatch(n) to pick one)")
        if not 1 <= real <= size:
            raise GraphError(f"a graph of size {size} serves 1..{size} real rows, got {real}")
        pieces = self.graphs[size]
        # The step's eager form is announced with its first graph. A PIECEWISE step (eager regions
        # before and between its pieces) is announced whole before anything of it runs, and compared
        # after its last piece.
        eager = self._eager_step(size)
        unpadded = self._eager_step(real) if real < size else None
        schedule = self._schedule.get(size, pieces)
        split = bool(pieces) and len(schedule) > len(pieces)     # eager regions in the step
        with self._grad_mode():
            if split:
                events.serve(pieces[0], real, size, padded=padded, outputs=self.outputs[size], eager=eager,
                             padded_columns=padded_columns, pieces=tuple(pieces), unpadded=unpadded)
            for step in schedule:
                if isinstance(step, _EagerCall):
                    _run_call(step)
                    continue
                if not (split and step is pieces[0]):
                    events.serve(step, real, size, padded=padded, outputs=self.outputs[size],
                                 eager=None if split else eager, padded_columns=padded_columns,
                                 unpadded=None if split else unpadded)
                step.replay()
        out = _slice(self.outputs[size], real)
        if pieces:
            events.handed_out(pieces[-1], out)
        return out

    def run_eager(self, size: int) -> Outputs:
        """Run the step of ``size`` without graphs (the reference a replay must equal)."""
        with self._grad_mode():
            return self.forward(size)

    def _eager_step(self, size: int) -> Callable[[], Outputs]:
        return lambda: self.run_eager(size)

    def __repr__(self) -> str:
        return (f"GraphManager({self.name}, mode={self.mode.value}, sizes={self.capture_sizes}, "
                f"captured={sorted(self.graphs)})")


def _run_call(call: _EagerCall) -> None:
    out = call.fn(*call.args, **call.kwargs)
    for dst, src in zip(_flat(call.output), _flat(out)):
        if dst is not src:
            dst.copy_(src)


def _static_copy(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, tuple):
        return tuple(_static_copy(o) for o in out)
    return out


def _flat(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, tuple):
        return [t for o in out for t in _flat(o)]
    return []


def _slice(out: Outputs, n: int) -> Outputs:
    """``out[:n]`` of each output, as ops the engine hands to its observers."""
    if isinstance(out, tuple):
        return tuple(_slice(o, n) for o in out)
    return events.engine_op(_SLICE, out, 0, 0, n) if out.dim() else out[:n]


_SLICE = torch.ops.aten.slice.Tensor


def _empty(g, caught: list) -> bool:
    """A piece that recorded nothing (CUDA warns that such a graph is empty and cannot replay it)."""
    if isinstance(g, CPUGraph):
        return all(op.is_view for op in g.ops)
    return any("empty" in str(w.message).lower() for w in caught)
