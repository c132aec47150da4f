"""A served step that asks for a graph by a key no capture made (``doctor/rules/graph_keys.py``), and
a replay with no padded rows whose stale input a padded-row finding of the same graph must not hide
(``doctor/probes/reference.py``).

Each workload has a ``bug`` and a ``fix`` variant that differ only in the flawed lines.
"""
from __future__ import annotations

import dataclasses
import enum

import pytest
import torch

from workbench import doctor
from workbench.engine import events, graph, new_graph
from workbench.engine.source import function_of

SIZES = (1, 2, 4)
capturing_enabled = False


@dataclasses.dataclass(frozen=True)
class Descriptor:
    num_tokens: int
    uniform: bool


def step(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x * 2 + 1)


class LazyWrapper:
    """Graphs kept by descriptor, captured on a miss while capturing is enabled (start-up), refused after."""

    def __init__(self):
        self.graphs: dict = {}
        self.x = torch.zeros(max(SIZES), 3)

    def __call__(self, x: torch.Tensor, desc: Descriptor) -> torch.Tensor:
        n = desc.num_tokens
        self.x[:x.shape[0]].copy_(x)
        if desc not in self.graphs:
            if not capturing_enabled:
                raise RuntimeError("graph capturing detected at an inappropriate time")
            g = new_graph("cpu")
            with graph(g, name=f"step {desc}"):
                out = step(self.x[:n])
            self.graphs[desc] = (g, out)
            return out[:x.shape[0]].clone()
        g, out = self.graphs[desc]
        events.serve(g, x.shape[0], n, outputs=out, eager=lambda: step(self.x[:n]))
        g.replay()
        return out[:x.shape[0]].clone()


class Runner:
    def __init__(self, variant: str):
        self.variant, self.started = variant, 0       # requests with state: none at start-up
        self.model = LazyWrapper()

    def descriptor(self, num_tokens: int, force_uniform: bool | None = None) -> Descriptor:
        padded = next(s for s in SIZES if s >= num_tokens)
        uniform = self.started > 0 if force_uniform is None else force_uniform
        return Descriptor(padded, uniform)

    def capture_graphs(self) -> None:
        global capturing_enabled
        capturing_enabled = True
        try:
            for n in reversed(SIZES):
                desc = self.descriptor(n, **({} if self.variant == "bug" else {"force_uniform": True}))
                self.model(torch.zeros(n, 3), desc)
        finally:
            capturing_enabled = False

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        self.started = x.shape[0]
        return self.model(x, self.descriptor(x.shape[0]))


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_step_asking_for_a_key_the_capture_decided_otherwise_is_warmup_divergence(variant):
    """The capture loop computes each graph's descriptor while no request has state, so ``uniform`` is
    False; every served step computes True, finds no graph, and the lazy capture is refused: the
    capture decided the key otherwise, at the capture loop. ``fix`` forces the flag serving uses."""
    def workload():
        runner = Runner(variant)
        runner.capture_graphs()
        gen = torch.Generator().manual_seed(0)
        return [runner.decode(torch.randn(n, 3, generator=gen)) for n in (3, 4, 2)]

    if variant == "bug":
        with pytest.raises(RuntimeError, match="inappropriate time"):
            workload()
    report = doctor.diagnose(workload)
    if variant == "fix":
        assert report.findings == [] and not report.errors, report
        return
    assert report.errors and [f.kind for f in report.findings] == ["warmup-divergence"], report
    finding = report.findings[0]
    assert function_of(finding.source) == "capture_graphs", report
    assert "uniform" in finding.cause and "num_tokens=4, uniform=True" in finding.evidence, report


class BucketRunner:
    """Graphs by ``(batch, blocks)``; a step whose context needs more blocks than any graph was
    captured for must run eagerly (``fix``), not look its bucket up (``bug``)."""

    BATCHES, BLOCKS = (1, 2), (1, 2, 4)

    def __init__(self, variant: str, catch: bool = False):
        self.variant, self.catch, self.graph_runners = variant, catch, {}
        self.x = torch.zeros(max(self.BATCHES), max(self.BLOCKS))
        for b in self.BATCHES:
            for k in self.BLOCKS:
                g = new_graph("cpu")
                with graph(g, name=f"batch {b} blocks {k}"):
                    out = step(self.x[:b, :k])
                self.graph_runners[(b, k)] = (g, out)

    def execute(self, x: torch.Tensor) -> torch.Tensor:
        b, k = x.shape
        if self.variant == "fix" and k > max(self.BLOCKS):
            return step(x)
        key = (b, next((s for s in self.BLOCKS if s >= k), k))
        try:
            g, out = self.graph_runners[key]
        except KeyError:
            if not self.catch:
                raise
            return step(x)                       # the standard fallback: no graph, run eagerly
        self.x[:b, :k].copy_(x)
        events.serve(g, b, b, outputs=out, eager=lambda: step(self.x[:b, :key[1]]))
        g.replay()
        return out[:, :k].clone()


@pytest.mark.parametrize("variant", ["bug", "fix", "caught"])
def test_a_step_asking_for_a_bucket_past_every_capture_is_undersized(variant):
    """A step needing 8 blocks asks the table for ``(1, 8)``; the graphs go up to 4 blocks:
    ``undersized-buffer`` where the step holds that key. A workload that catches the ``KeyError``
    and runs the step eagerly (``caught``) is clean, as is one that checks first (``fix``)."""
    def workload():
        runner = BucketRunner("bug" if variant == "caught" else variant, catch=variant == "caught")
        gen = torch.Generator().manual_seed(1)
        return [runner.execute(torch.randn(b, k, generator=gen)) for b, k in ((2, 3), (1, 4), (1, 8))]

    report = doctor.diagnose(workload)
    if variant != "bug":
        assert report.findings == [] and not report.errors, report
        return
    assert [f.kind for f in report.findings] == ["undersized-buffer"], report
    assert function_of(report.findings[0].source) == "execute" and "(1, 8)" in report.findings[0].evidence, report


def store(cache, values, slots):
    cache.index_copy_(0, slots, values)
    return cache[slots] * 2


class SlotRunner:
    """Writes each step's values into a cache at each row's slot and reads the cache back at those
    slots. ``bug``: the runner refreshes the values but never the slots, so every replay writes and
    reads at the slots the capture left (0): the first replay, with no padded rows, already parts from
    the run without graphs; a later padded one's padded rows write into slots real rows read."""

    def __init__(self, variant: str):
        self.variant = variant
        self.cache = torch.zeros(8, 2)
        self.values, self.slots = torch.zeros(4, 2), torch.zeros(4, dtype=torch.long)
        events.static_buffers("runner", {"values": self.values, "slots": self.slots})
        events.persistent_state("runner", {"cache": self.cache})
        self.graph = new_graph("cpu")
        with graph(self.graph, name="store"):
            self.out = store(self.cache, self.values, self.slots)

    def __call__(self, values, slots):
        n = values.shape[0]
        self.values[:n].copy_(values)
        self.values[n:].zero_()
        if self.variant == "fix":
            self.slots[:n].copy_(slots)
            self.slots[n:].fill_(7)                  # padded rows: the reserved null slot
        events.serve(self.graph, n, 4, outputs=self.out, eager=lambda: store(self.cache, self.values, self.slots))
        self.graph.replay()
        return self.out[:n].clone()


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_an_unpadded_replays_stale_input_is_reported_beside_a_padded_rows_finding(variant):
    """The first replay serves 4 real rows of 4 and reads the slots the capture left: no padded row
    explains that, so its ``stale-input`` is reported beside the later padded replay's ``stale-padding``."""
    def workload():
        gen = torch.Generator().manual_seed(2)
        steps = [(torch.randn(n, 2, generator=gen), torch.tensor(s)) for n, s in ((4, [1, 2, 3, 4]), (2, [5, 6]),
                                                                                  (2, [1, 5]))]
        with events.reference():
            cache = torch.zeros(8, 2)
            expected = [store(cache, v, s) for v, s in steps]
        runner = SlotRunner(variant)
        got = [runner(v, s) for v, s in steps]
        events.results(expected, got)
        return expected, got

    expected, got = workload()
    assert all(torch.equal(e, g) for e, g in zip(expected, got)) == (variant == "fix")
    report = doctor.diagnose(workload)
    if variant == "fix":
        assert report.findings == [], report
        return
    kinds = [f.kind for f in report.findings]
    assert "stale-input" in kinds, report
    assert next(f for f in report.findings if f.kind == "stale-input").tensor.startswith("slots"), report


class Mode(enum.Enum):
    FULL = 1


def test_one_definition_of_a_key_serves_the_lookup_rule_and_the_decider():
    """What a runner keys its graphs on is one notion (``graph_keys.keylike``): a scalar, an enum, a
    dtype, a device, or a hashable tuple or dataclass of them, nested; never a tensor or another
    object. A function that returns a non-empty such tuple or dataclass answered a graph lookup
    (``raised._key``: the decider a replay is traced back to), a dispatcher's ``(mode, descriptor)``
    among them."""
    from workbench.doctor import raised
    from workbench.doctor.rules import graph_keys

    @dataclasses.dataclass
    class Unhashable:              # (eq without frozen: no hash, no key)
        n: int

    assert graph_keys.keylike(Descriptor(4, True))
    assert graph_keys.keylike((2, torch.float16, torch.device("cpu"), (3, 4), Mode.FULL))
    assert not graph_keys.keylike((2, torch.zeros(1)))
    assert not graph_keys.keylike(Unhashable(1))
    assert not graph_keys.keylike(object())
    assert raised._key((Mode.FULL, Descriptor(4, True)))
    assert raised._key(Descriptor(4, True))
    assert not raised._key(())
    assert not raised._key(4)                    # (a number alone is a value, not a key's answer)
    assert not raised._key([1, 2])


def test_a_decision_noted_for_one_frame_is_never_read_for_another_that_reuses_its_id():
    """The function whose answer chose a replayed graph is noted by its caller's frame id
    (``raised.decider``); a frame that dies untraced (a library's, which called a dataclass's
    ``__eq__``) leaves its id free for a later frame of the workload, which must not inherit it:
    the note keeps the caller's code, and is read only for a frame running that code."""
    import sys

    from workbench.doctor import raised

    frame = sys._getframe()
    try:
        raised._tracer.decided[id(frame)] = (compile("0", "<another function>", "eval"), "noted elsewhere")
        assert raised.decider([frame]) is None
        raised._tracer.decided[id(frame)] = (frame.f_code, "noted here")
        assert raised.decider([frame]) == "noted here"
    finally:
        raised._tracer.decided.pop(id(frame), None)
