"""What every zoo program shares: its ``Outcome``, the eager comparison, and a minimal graph runner.

A zoo program is written as its upstream authors wrote theirs: its own tiny modules, its own
buffers, graphs from the public engine API (``new_graph`` / ``graph`` / ``graph_pool_handle``).
The two helpers here, ``capture`` and ``replay``, are the few lines such a runner always has
(warm up, capture, copy in, replay). They also make the announcements that the graph manager
makes (static buffers, warmups, which rows are padded, which outputs were handed out), so that
the doctor sees a zoo program as it sees code served by the manager.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

import torch

from ..cases import VARIANTS  # noqa: F401 - the zoo speaks of the same variants as the cases
from ..engine import events, graph, new_graph

TOLERANCE = 1e-5          # a graph equals eager when every output is within this of eager's
# Observers of the runner itself (the baseline detectors): ``captured(graph, fn)`` after each capture
# with the captured callable, ``replaying(graph)`` before each replay. Engine events cover the rest.
hooks: list = []
# The attribute of a graph that holds the callable it captured: each replay announces it as the
# step's eager form, as the graph manager does, so that differential replay can re-run the step.
# Kept on the graph, not in a table keyed on it: a callable usually reaches its own graph (through
# the runner), a cycle the collector frees with the program, where a weak-keyed table's value would
# keep the graph alive for ever (and a watch would see its released memory as still read).
_STEP = "_captured_step"

MISBEHAVES, EQUALS = "misbehaves", "equals eager"


@dataclasses.dataclass
class Outcome:
    """One run of one variant: the graph's outputs, eager's, how far apart, and what was raised."""

    program: str
    variant: str
    device: str
    graph: list[torch.Tensor]
    eager: list[torch.Tensor]
    max_abs_error: float | None          # None when the graph run raised before producing outputs
    error: tuple[str, str] | None = None  # (type name, first line of the message)

    @property
    def verdict(self) -> str:
        if self.error is not None or self.max_abs_error is None or not self.max_abs_error <= TOLERANCE:
            return MISBEHAVES
        return EQUALS

    def summary(self) -> str:
        what = (f"raised {self.error[0]}: {self.error[1]}" if self.error else
                f"max |graph - eager| = {self.max_abs_error:.3g}")
        return f"{self.program} [{self.variant}] on {self.device}: {self.verdict} ({what})"


def check_variant(variant: str) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")


def compare(program: str, variant: str, device: str, served: Callable[[], Sequence[torch.Tensor]],
            eager: Callable[[], Sequence[torch.Tensor]]) -> Outcome:
    """Run ``eager()`` (the reference, which must not raise; announced as the workload's reference run)
    and then ``served()`` (graphs), and compare their outputs. An exception from ``served`` is the outcome, as a user would see it."""
    check_variant(variant)
    with events.reference():
        reference = [t.detach().to("cpu", torch.float64) for t in eager()]
    try:
        got = [t.detach().to("cpu", torch.float64) for t in served()]
    except Exception as e:  # noqa: BLE001 - what the graphs raised is the observation
        text = str(e).strip().splitlines()
        return Outcome(program, variant, device, [], reference, None, (type(e).__name__, text[0] if text else ""))
    events.results(reference, got)
    if len(got) != len(reference) or any(g.shape != r.shape for g, r in zip(got, reference)):
        shapes = ([tuple(t.shape) for t in got], [tuple(t.shape) for t in reference])
        return Outcome(program, variant, device, got, reference, math.inf,
                       ("ShapeMismatch", f"graph {shapes[0]} vs eager {shapes[1]}"))
    err = max((_max_abs(g, r) for g, r in zip(got, reference)), default=0.0)
    return Outcome(program, variant, device, got, reference, err)


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest elementwise difference; NaN where eager has a number counts as infinitely far."""
    if a.numel() == 0:
        return 0.0
    both_nan = a.isnan() & b.isnan()
    diff = (a - b).abs().masked_fill(both_nan, 0.0)
    return math.inf if diff.isnan().any() else float(diff.max())


def capture(fn: Callable[[], object], *, device: str, pool=None, warmups: int = 1, name: str | None = None,
            static: Mapping[str, torch.Tensor] | None = None, state: Mapping[str, torch.Tensor] | None = None,
            owner: str = "zoo program", on_freed: str = "raise", capture_error_mode: str = "global"):
    """Warm up ``fn`` (eagerly, ``warmups`` times), then capture it; returns ``(graph, outputs)``.
    ``static`` names the per-step input buffers the graph reads (announced as static buffers),
    ``state`` the memory it reads and writes on purpose across steps (a recurrent state, a cache);
    ``capture_error_mode`` is CUDA's (``engine.capture_mode``)."""
    if static:
        events.static_buffers(owner, static)
    if state:
        events.persistent_state(owner, state)
    for _ in range(warmups):
        with events.warmup():
            fn()
    g = new_graph(device, on_freed=on_freed)
    with graph(g, pool=pool, name=name, capture_error_mode=capture_error_mode):
        out = fn()
    remember_step(g, fn)
    for hook in hooks:
        hook.captured(g, fn)
    return g, out


def remember_step(g, fn) -> None:
    """Remember ``fn`` as what graph ``g`` captured (``replay`` announces it as the step's eager form)."""
    try:
        setattr(g, _STEP, fn)
    except AttributeError:            # a graph type without attributes: no eager form announced
        pass


def replay(g, outputs, *, real: int | None = None, size: int | None = None,
           padded: Mapping[str, torch.Tensor] | None = None,
           padded_columns: Mapping[str, tuple[torch.Tensor, int]] | None = None):
    """Replay ``g`` and hand out views of its static ``outputs`` (valid until its next replay), as a
    graph manager does. Every replay is announced as a served step whose eager form is the captured
    callable (``real``/``size`` default to the outputs' rows: no padding). With ``real`` < ``size``,
    rows ``[real, size)`` of the buffers in ``padded`` are announced as this step's padded rows: name
    there only the buffers whose padded rows the step left as they were (not those it neutralised).
    ``padded_columns`` maps names to ``(buffer, real width)``: the columns past that width (padded
    tokens of a ``[1, tokens]`` layout, blocks past the longest sequence) are padded too."""
    if size is None:
        first = outputs[0] if isinstance(outputs, (tuple, list)) else outputs
        size = first.shape[0] if first.dim() else 1
    events.serve(g, size if real is None else real, size, padded=padded, outputs=outputs, eager=getattr(g, _STEP, None),
                 padded_columns=padded_columns)
    for hook in hooks:
        hook.replaying(g)
    g.replay()
    views = tuple(o.view_as(o) for o in outputs) if isinstance(outputs, tuple) else outputs.view_as(outputs)
    events.handed_out(g, views)
    return views


def generator(seed: int = 0) -> torch.Generator:
    """A CPU generator: programs draw their data on the CPU and move it, so both devices see the
    same numbers."""
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, gen: torch.Generator, device: str, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(device)


def release_to_driver(device: str) -> None:
    """Give freed cached blocks back to the driver (``torch.cuda.empty_cache``): a graph that still
    holds the address of one then faults, as it does once a serving process reclaims memory. A
    no-op on the CPU, whose emulation raises ``IllegalMemoryAccess`` as soon as the owner lets go."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def own_segment_elems(device: str) -> int:
    """Elements of a float32 tensor big enough to own its CUDA allocator segment (so that
    ``release_to_driver`` unmaps it); small on the CPU, where size does not matter."""
    return (1 << 20) if torch.device(device).type == "cuda" else 16
