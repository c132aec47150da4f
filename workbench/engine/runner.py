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

Warmup, capture, dispatch and replay are the ``GraphManager``'s; this class is only the buffer
policy above it.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from . import events
from .errors import GraphError
from .graphs import CUDAGraphMode, GraphManager, Outputs

class GraphRunner:
    """Serve ``model(**views)`` through graphs captured for several batch sizes.

    ``model`` takes keyword tensors whose first dimension is the batch (rows or tokens) and returns
    a tensor or a tuple of tensors with the same first dimension. ``inputs`` maps each input name
    to ``(feature_shape, dtype)``; buffers are ``(max_size, *feature_shape)``. A batch may be
    narrower than a buffer in any trailing dimension (a block table with fewer blocks): it is
    copied into the leading corner, and the rest of each row are *padded columns*, not refreshed
    either. ``mode`` is ``"FULL"`` or ``"NONE"`` (``enforce_eager=True`` is ``"NONE"``).
    """

    def __init__(self, model: Callable[..., Outputs], inputs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                 capture_sizes: Sequence[int], *, device: str = "cpu", num_warmups: int = 1,
                 enforce_eager: bool = False, poison_padding: bool = False, grad: bool = False) -> None:
        if not isinstance(inputs, Mapping) or not inputs:
            raise ValueError("inputs must map each input name to (feature_shape, dtype), "
                             "e.g. {'input_ids': ((), torch.int64)}")
        self.model = model
        self.enforce_eager = enforce_eager
        self.poison_padding = poison_padding
        mode = CUDAGraphMode.NONE if enforce_eager else CUDAGraphMode.FULL
        self.manager = GraphManager(self._forward, capture_sizes, device=device, mode=mode,
                                   num_warmups=num_warmups, grad=grad, name=type(self).__name__)
        self.device = self.manager.device
        self.capture_sizes = self.manager.capture_sizes
        self.max_size = self.manager.max_size
        self.num_warmups = self.manager.num_warmups
        self.buffers = {name: torch.zeros((self.max_size, *shape), dtype=dtype, device=self.device)
                        for name, (shape, dtype) in inputs.items()}
        self.manager.static_buffers = self.buffers
        self.steps = 0
        self.history: list[tuple[int, int | None]] = []   # (real rows, graph size or None=eager)

    @property
    def graphs(self) -> dict[int, object]:
        """Size -> captured graph."""
        return {size: pieces[0] for size, pieces in self.manager.graphs.items()}

    @property
    def outputs(self) -> dict[int, Outputs]:
        return self.manager.outputs

    @property
    def pool(self):
        return self.manager.pool

    def _forward(self, size: int) -> Outputs:
        return self.model(**self._views(size))

    # ------------------------------------------------------------------ capture
    def capture(self) -> None:
        """Warm up then capture each size, largest first, into one shared pool."""
        if self.manager.graphs:
            raise GraphError("capture() was already called: call recapture() to capture again "
                             "(after a weight update), or create a new runner.")
        self.manager.capture()

    def recapture(self) -> None:
        """Capture every size again, into the same pool (after a weight update)."""
        self.manager.recapture()

    def padded_size(self, n: int) -> int | None:
        """The graph size a batch of ``n`` rows runs at (``None``: eager)."""
        return self.manager.dispatch(n)

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
            _copy_in(self.buffers[name], x)
        if size is None:
            return self.model(**self._views(n))                 # enforce_eager: real rows only
        if not self.manager.graphs:
            raise GraphError("No graphs captured yet: call runner.capture() before serving.")
        if self.poison_padding:
            for name, buf in self.buffers.items():
                _poison_padding(buf, n, size, inputs[name].shape[1:])
        columns = {name: (buf, inputs[name].shape[1]) for name, buf in self.buffers.items()
                   if buf.dim() > 1 and inputs[name].shape[1] < buf.shape[1]}
        return self.manager.replay(size, n, padded=self.buffers, padded_columns=columns)

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
            wide = x.dim() != buf.dim() or any(a > b for a, b in zip(x.shape[1:], buf.shape[1:]))
            if wide and n <= self.max_size:
                raise GraphError(f"input {name!r} has row shape {tuple(x.shape[1:])}, its static "
                                 f"buffer {tuple(buf.shape[1:])}: a batch may be narrower, never wider")
            if x.device != buf.device:
                raise GraphError(f"input {name!r} is on {x.device}, the runner on {buf.device}")
        return n


def _copy_in(buffer: torch.Tensor, x: torch.Tensor) -> None:
    """``buffer[:n, :w, ...].copy_(x)``, as ops the engine hands to its observers."""
    view = buffer
    for dim, width in enumerate(x.shape):
        if width < view.shape[dim]:
            view = events.engine_op(_SLICE, view, dim, 0, width)
    events.engine_op(_COPY, view, x)


_SLICE, _COPY = torch.ops.aten.slice.Tensor, torch.ops.aten.copy_.default


def _poison_padding(buf: torch.Tensor, real: int, size: int, row_shape: Sequence[int]) -> None:
    """Fill padded rows ``[real, size)`` and padded columns (beyond the batch's row shape) with a
    sentinel, so that code reading them shows up."""
    value = (float("nan") if buf.dtype.is_floating_point else True if buf.dtype == torch.bool
             else torch.iinfo(buf.dtype).max)
    buf[real:size].fill_(value)
    for dim, width in enumerate(row_shape, start=1):
        if width < buf.shape[dim]:
            buf[:real].narrow(dim, width, buf.shape[dim] - width).fill_(value)
