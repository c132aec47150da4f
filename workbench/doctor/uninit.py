"""Memory no op has written holds the same values at every run while the doctor watches.

``torch.empty`` returns whatever its memory last held: on the CPU, what the allocator's previous
user left there, which changes from run to run. Code that reads such memory (a kernel whose grid
does not cover its whole output, a buffer read before its first write) gives numbers that vary
between runs, and the doctor, which compares replays with eager runs of their step, would see a
difference in one run and not in the next. While it watches, eager allocations are filled as
PyTorch's deterministic mode fills them (``torch.utils.deterministic.fill_uninitialized_memory``:
NaN, the integer maximum, True), as a capture fills the memory of its graph (``CPUGraph``), so a
replay and its eager step that read unwritten memory read the same values. Captures keep the
user's own setting.

Only where CUDA is not available: deterministic mode also changes the kernels eager CUDA code runs
(``index_put_`` with repeated indices sorts them first), so an eager step would part from the replay
of a graph captured without it for that reason alone (a padding sentinel slot that several rows write
holds another row's value); and on CUDA the fill is a kernel, which a graph would record and replay.

Deterministic mode is turned on with ``warn_only=True`` unless the user turned it on already (their
setting, errors included, stands); its warnings about ops without a deterministic implementation
are the doctor's doing and are not shown.

A CPU replay fills nothing either (``pause``/``resume``, around the emulated replay): its ops write
the graph's own memory, filled at capture, or fresh outputs that a functional op writes whole before
they are copied there; filling those would only cost each replayed op a fill (about a fifth of the
doctor's cost on a served step).
"""
from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch

from ..engine import events

_NOT_DETERMINISTIC = r".*does not have a deterministic implementation.*"


class Fill:
    """The deterministic fill of eager allocations: on while watching, off inside captures (it
    listens to the engine's capture events)."""

    def __init__(self) -> None:
        self.user = (torch.are_deterministic_algorithms_enabled(),
                     torch.is_deterministic_algorithms_warn_only_enabled(),
                     torch.utils.deterministic.fill_uninitialized_memory)
        enabled, warn_only, _ = self.user
        self.ours = (True, warn_only if enabled else True, True)

    def on(self) -> None:
        _apply(self.ours)

    def off(self) -> None:
        _apply(self.user)

    def pause(self) -> None:
        """No fill during an emulated replay, unless the user's own setting fills (their deterministic
        mode on, with its fill)."""
        enabled, _, fill = self.user
        torch.utils.deterministic.fill_uninitialized_memory = enabled and fill

    def resume(self) -> None:
        torch.utils.deterministic.fill_uninitialized_memory = True

    def capture_begin(self, graph, name) -> None:
        self.off()

    def capture_end(self, graph) -> None:
        self.on()

    def capture_abort(self, graph, error) -> None:
        self.on()


def _apply(state: tuple) -> None:
    enabled, warn_only, fill = state
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    torch.utils.deterministic.fill_uninitialized_memory = fill


@contextlib.contextmanager
def filled() -> Iterator[Fill | None]:
    """Eager allocations filled deterministically inside the block (where CUDA is not available);
    the user's setting after it."""
    if torch.cuda.is_available():
        yield None
        return
    fill = Fill()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NOT_DETERMINISTIC)
        fill.on()
        events.subscribe(fill)
        try:
            yield fill
        finally:
            events.unsubscribe(fill)
            fill.off()
