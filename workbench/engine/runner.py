"""``GraphRunner``: the part of a vLLM model runner that decides what a graph sees.

Rules, as vLLM's GPU model runner applies them (and as the five cases need them):

* **Static buffers.** One persistent buffer per input, sized for the largest capture size. Every
  graph reads views ``buffer[:size]`` of them, so their addresses never change.
* **Padding.** A batch of ``n`` rows is copied into rows ``[0, n)`` and run by the graph of the
  smallest captured size ``>= n``. Rows ``[n, size)`` are the *padded rows*: they are **not**
  refreshed (they hold whatever an earlier, larger batch or the warmup left there), unless
  ``poison_padding`` fills them with a sentinel to expose code that reads them.
* **Warmup then capture**, per size, largest first, all graphs in one shared pool.
* **Eager fallback** for batches larger than the largest captured size, and ``enforce_eager``
  (no graphs, no padding: every row the model sees is a real row).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from . import events
from .api import graph, graph_pool_handle, new_graph, resolve_device
from .errors import GraphError

Outputs = torch.Tensor | tuple[torch.Tensor, ...]


def validate_capture_sizes(sizes: Sequence[int]) -> list[int]:
    """Positive, unique integers, returned ascending; anything else is a clear ``ValueError``."""
    sizes = list(sizes)
    if not sizes:
        raise ValueError("capture_sizes is empty: give at least one batch size to capture, e.g. [1, 2, 4, 8]")
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, int):
            raise ValueError(f"capture sizes must be integers, got {s!r} ({type(s).__name__})")
        if s <= 0:
            raise ValueError(f"capture sizes must be positive, got {s}")
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"capture sizes must be unique, got {sizes}")
    return sorted(sizes)


class GraphRunner:
    """Serve ``model(**views)`` through graphs captured for several batch sizes.

    ``model`` takes keyword tensors whose first dimension is the batch (rows or tokens) and returns
    a tensor or a tuple of tensors with the same first dimension. ``inputs`` maps each input name
    to ``(feature_shape, dtype)``; buffers are ``(max_size, *feature_shape)``.
    """

    def __init__(self, model: Callable[..., Outputs], inputs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                 capture_sizes: Sequence[int], *, device: str = "cpu", num_warmups: int = 1,
                 enforce_eager: bool = False, poison_padding: bool = False) -> None:
        self.model = model
        self.device = resolve_device(device)
        self.capture_sizes = validate_capture_sizes(capture_sizes)
        self.max_size = self.capture_sizes[-1]
        self.num_warmups = num_warmups
        self.enforce_eager = enforce_eager
        self.poison_padding = poison_padding
        self.buffers = {name: torch.zeros((self.max_size, *shape), dtype=dtype, device=self.device)
                        for name, (shape, dtype) in inputs.items()}
        self.pool = None
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, Outputs] = {}
        self.steps = 0
        self.history: list[tuple[int, int | None]] = []   # (real rows, graph size or None=eager)

    # ------------------------------------------------------------------ capture
    def capture(self) -> None:
        """Warm up then capture each size, largest first, into one shared pool."""
        if self.enforce_eager:
            return
        if self.graphs:
            raise GraphError("capture() was already called; create a new runner to capture again.")
        self.pool = graph_pool_handle(self.device)
        events.static_buffers(type(self).__name__, self.buffers)
        for size in reversed(self.capture_sizes):
            views = self._views(size)
            for _ in range(self.num_warmups):
                with events.warmup():
                    self.model(**views)
            g = new_graph(self.device)
            with graph(g, pool=self.pool, name=f"size {size}"):
                self.outputs[size] = self.model(**views)
            self.graphs[size] = g

    def padded_size(self, n: int) -> int | None:
        """The graph size a batch of ``n`` rows runs at (``None``: eager)."""
        if self.enforce_eager or n > self.max_size:
            return None
        return next(s for s in self.capture_sizes if s >= n)

    # ------------------------------------------------------------------ serving
    def __call__(self, **inputs: torch.Tensor) -> Outputs:
        """Run one batch. Graph outputs are views of static buffers, valid until the next call."""
        n = self._check(inputs)
        size = self.padded_size(n)
        self.steps += 1
        self.history.append((n, size))
        if size is None and n > self.max_size:
            return self.model(**inputs)                       # eager fallback: too large to pad
        for name, x in inputs.items():
            self.buffers[name][:n].copy_(x)
        if size is None:
            return self.model(**self._views(n))                 # enforce_eager: real rows only
        if not self.graphs:
            raise GraphError("No graphs captured yet: call runner.capture() before serving.")
        if self.poison_padding and size > n:
            for buf in self.buffers.values():
                _poison_rows(buf, n, size)
        g = self.graphs[size]
        events.serve(g, n, size, padded=self.buffers, outputs=self.outputs[size])
        g.replay()
        out = _slice(self.outputs[size], n)
        events.handed_out(g, out)
        return out

    def _views(self, size: int) -> dict[str, torch.Tensor]:
        return {name: buf[:size] for name, buf in self.buffers.items()}

    def _check(self, inputs: Mapping[str, torch.Tensor]) -> int:
        if set(inputs) != set(self.buffers):
            raise GraphError(f"inputs {sorted(inputs)} do not match the runner's buffers {sorted(self.buffers)}")
        rows = {name: x.shape[0] for name, x in inputs.items()}
        if len(set(rows.values())) != 1:
            raise GraphError(f"all inputs need the same number of rows, got {rows}")
        n = next(iter(rows.values()))
        if n == 0:
            raise GraphError("empty batch: nothing to run")
        for name, x in inputs.items():
            buf = self.buffers[name]
            if x.dtype != buf.dtype:
                raise GraphError(f"input {name!r} has dtype {x.dtype}, its static buffer {buf.dtype}: "
                                 f"convert with .to({buf.dtype}) before calling")
            if tuple(x.shape[1:]) != tuple(buf.shape[1:]):
                raise GraphError(f"input {name!r} has row shape {tuple(x.shape[1:])}, its static "
                                 f"buffer {tuple(buf.shape[1:])}")
            if x.device != buf.device:
                raise GraphError(f"input {name!r} is on {x.device}, the runner on {buf.device}")
        return n


def _poison_rows(buf: torch.Tensor, start: int, stop: int) -> None:
    rows = buf[start:stop]
    if rows.dtype.is_floating_point:
        rows.fill_(float("nan"))
    elif rows.dtype == torch.bool:
        rows.fill_(True)
    else:
        rows.fill_(torch.iinfo(rows.dtype).max)


def _slice(out: Outputs, n: int) -> Outputs:
    return tuple(o[:n] for o in out) if isinstance(out, tuple) else out[:n]
