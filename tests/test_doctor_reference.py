"""The workload's reference run (``events.reference()``, ``doctor/probes/reference.py``): each replay
against the same step served without graphs, where the step's eager form (the captured callable)
agrees with the graph and differential replay cannot tell.

Each workload serves three decode steps twice: first without graphs (announced as the reference),
then through one graph per size; ``bug`` and ``fix`` differ only in the flawed lines.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import types

import pytest
import torch

from test_doctor_setup_and_warmups import finding_of, only_finding
from workbench import doctor
from workbench.zoo import trials
from workbench.engine import CaptureError, events, graph, graph_pool_handle, host, is_capturing, new_graph
from workbench.engine.source import function_of

BLOCK, CONTEXT = 2, 8
LENGTHS = ([3, 5], [4, 6], [5, 7])          # two requests' sequence lengths at each step


def _cache() -> torch.Tensor:
    return torch.randn(2, CONTEXT, 4, generator=torch.Generator().manual_seed(0))


def _queries(step: int) -> torch.Tensor:
    return torch.randn(2, 4, generator=torch.Generator().manual_seed(step + 1))


def attend(q, cache, lens, max_len: int):
    """Blocked attention over each request's first ``lens`` positions; the number of blocks is a
    host int (``max_len``), as a kernel's launch grid is."""
    out = torch.zeros_like(q)
    for b in range(math.ceil(max_len / BLOCK)):
        pos = b * BLOCK + torch.arange(BLOCK)
        valid = (pos[None, :] < lens[:, None]).to(q.dtype)
        out = out + ((cache[:, b * BLOCK:(b + 1) * BLOCK] * valid[..., None]) * q[:, None, :]).sum(1)
    return out


def attend_clamped(q, cache, lens, max_len: int):
    """Attention over the whole context, each request's length clamped to the batch's longest
    (a host int: an argument of the kernel, as a graph keeps it)."""
    valid = (torch.arange(CONTEXT)[None, :] < lens.clamp(max=max_len)[:, None]).to(q.dtype)
    return ((cache * valid[..., None]) * q[:, None, :]).sum(1)


class Runner:
    """Static ``q`` and ``lens``, one graph of size 2; ``prepare`` is the replay path's copy-in."""

    def __init__(self, cache, variant: str, *, capture_len: int = CONTEXT, lens_offset: int = 0, kernel=attend,
                 lens=(0, 0), name: str = "decode"):
        self.cache, self.variant, self.lens_offset = cache, variant, lens_offset
        self.q, self.lens = torch.zeros(2, 4), torch.tensor(lens)
        events.static_buffers("runner", {"q": self.q, "lens": self.lens})
        step = lambda: kernel(self.q, self.cache, self.lens, capture_len)  # noqa: E731
        with events.warmup():
            step()
        self.graph = new_graph("cpu")
        with graph(self.graph, pool=graph_pool_handle("cpu"), name=name):
            self.out = step()
        self.step = step

    def prepare(self, q, lens):
        self.q.copy_(q)
        self.lens.copy_(lens - self.lens_offset)

    def __call__(self, q, lens):
        self.prepare(q, lens)
        return self.replayed()

    def replayed(self) -> torch.Tensor:
        events.serve(self.graph, 2, 2, padded={}, outputs=self.out, eager=self.step)
        self.graph.replay()
        return self.out.clone()


def _workload(runner_for, announce: bool = True, kernel=attend):
    def workload():
        cache = _cache()
        steps = [(_queries(i), torch.tensor(lens)) for i, lens in enumerate(LENGTHS)]
        reference_run = lambda: [kernel(q, cache, lens, int(lens.max())) for q, lens in steps]  # noqa: E731
        if announce:
            with events.reference():
                expected = reference_run()
        else:
            expected = reference_run()
        runner = runner_for(cache)
        got = [runner(q, lens) for q, lens in steps]
        return expected, got
    return workload


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_replay_path_preparing_an_input_otherwise_is_named_where_it_wrote_it(variant):
    """``bug``: the replay path writes ``lens - 1`` (a count of accepted tokens where the kernel wants
    sequence lengths). The captured callable reads the same static buffer, so differential replay
    agrees with the graph; the reference run gives the attention the real lengths."""
    workload = _workload(lambda cache: Runner(cache, variant, lens_offset=1 if variant == "bug" else 0))
    finding = finding_of(workload, variant)
    if finding is None:
        return
    assert finding.kind == "warmup-divergence" and " in prepare: " in finding.source, finding
    assert finding.tensor.startswith("lens: ") and "reference run" in finding.evidence, finding


@dataclasses.dataclass
class Attended:
    """What a model step returns in many engines: a dataclass of its tensors (a ``ModelOutput``)."""
    hidden: torch.Tensor


def attend_into(q, cache, lens, max_len: int) -> Attended:
    return Attended(attend(q, cache, lens, max_len))


class HandsOutAField(Runner):
    """The captured step returns an ``Attended``; the runner hands out its ``hidden``."""

    def __call__(self, q, lens):
        self.prepare(q, lens)
        events.serve(self.graph, 2, 2, padded={}, outputs=self.out.hidden, eager=self.step)
        self.graph.replay()
        return self.out.hidden.clone()


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_step_that_returns_a_dataclass_is_compared_with_the_reference_on_its_fields(variant):
    """The reference's call returns an ``Attended`` too: its fields are what it returned, paired with
    what the replay hands out by field, so the bug's lengths are found as for a step returning a
    tensor."""
    def workload():
        cache = _cache()
        steps = [(_queries(i), torch.tensor(lens)) for i, lens in enumerate(LENGTHS)]
        with events.reference():
            expected = [attend_into(q, cache, lens, int(lens.max())).hidden for q, lens in steps]
        runner = HandsOutAField(cache, variant, kernel=attend_into, lens_offset=1 if variant == "bug" else 0)
        return expected, [runner(q, lens) for q, lens in steps]

    finding = finding_of(workload, variant)
    if finding is None:
        return
    assert finding.kind == "warmup-divergence" and " in prepare: " in finding.source, finding
    assert "reference run" in finding.evidence, finding


class ReplaysItsCapture(Runner):
    """Captures on a dummy batch whose lengths are the first step's (its queries are not), and
    replays the graph once right after capturing it, on that batch (LightLLM's ``capture_decode``
    returns that replay's output): a replay of no step of the reference."""

    def __init__(self, cache, variant: str):
        self.cache, self.variant, self.lens_offset = cache, variant, 1 if variant == "bug" else 0
        self.q, self.lens = torch.ones(2, 4), torch.tensor(LENGTHS[0])
        events.static_buffers("runner", {"q": self.q, "lens": self.lens})
        self.step = lambda: attend(self.q, self.cache, self.lens, CONTEXT)  # noqa: E731
        with events.warmup():
            self.step()
        self.graph = new_graph("cpu")
        with graph(self.graph, name="decode"):
            self.out = self.step()
        events.serve(self.graph, 2, 2, padded={}, outputs=self.out, eager=self.step)
        self.graph.replay()


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_replay_of_the_capture_batch_is_no_step_of_the_reference(variant):
    """That first replay, with nothing written since the capture, is not aligned with a step of the
    reference (one whose length happened to match would make a finding on the fix); the steps after
    it are, and the bug's wrongly prepared lengths are found as before."""
    finding = finding_of(_workload(lambda cache: ReplaysItsCapture(cache, variant)), variant)
    if finding is None:
        return
    assert finding.kind == "warmup-divergence" and " in prepare: " in finding.source, finding


class OmittingRunner(Runner):
    """``bug``: the replay path writes ``q`` only; ``lens`` keeps what it held at the capture (the
    dummy batch's lengths, zero), an input every replay omits."""

    def prepare(self, q, lens):
        self.q.copy_(q)
        if self.variant == "fix":
            self.lens.copy_(lens)


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_an_input_the_replay_path_never_writes_is_stale_input_at_the_refresh_that_left_it_out(variant):
    """The static input differs from the reference, as above, but no step wrote those elements: the
    graph reads what was left there (no step ever wrote it, so the carried-input probe, which puts
    back what earlier steps wrote, has nothing to put back). ``attend`` reads ``lens`` and ``q``,
    which the step did write: the refresh that left ``lens`` out is ``prepare``'s copy into ``q``."""
    finding = finding_of(_workload(lambda cache: OmittingRunner(cache, variant)), variant)
    if finding is None:
        return
    assert finding.kind == "stale-input" and "self.q.copy_(q)" in finding.source, finding
    assert finding.tensor.startswith("lens: ") and "this step wrote none of them" in finding.evidence, finding
    assert "refreshed q, which attend reads too" in finding.evidence, finding


class AdvancingRunner(Runner):
    """Keeps each request's length in the static buffer and advances it in place at every step after
    the first (a KV length counter, as a serving context keeps one): the eager update builds on what
    it wrote at the step before, by design. ``bug`` advances it at the first step too: one ahead."""

    def __init__(self, cache, variant: str):
        super().__init__(cache, variant)
        self.steps = 0

    def prepare(self, q, lens):
        self.q.copy_(q)
        if self.steps == 0:
            self.lens.copy_(lens)
        if self.steps or self.variant == "bug":
            self.lens += 1
        self.steps += 1


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_counter_advanced_in_place_is_a_finding_only_where_it_parts_from_the_run_without_graphs(variant):
    """Without a run to compare (``watch``), an update in place that builds on its own last write is
    reported at once (``test_doctor.py``); beside the reference run it is held until a replay parts
    from that run: the fix's counter agrees with it at every step and gets no finding, the bug's
    does not, and the finding names the update."""
    finding = finding_of(_workload(lambda cache: AdvancingRunner(cache, variant)), variant)
    if finding is None:
        return
    assert "self.lens += 1" in finding.source and finding.tensor.startswith("lens: "), finding


class SkippingBuilder(Runner):
    """The lengths have a builder of their own, which refreshes them at every step but skips the
    last one (``bug``: it takes that batch for a kind of step whose lengths the graph does not read).
    The graph was captured on the second step's lengths, which the third then reads: putting back
    what the capture saw changes nothing, and only the run without graphs tells."""

    def __init__(self, cache, variant: str):
        super().__init__(cache, variant, lens=LENGTHS[1])
        self.steps = 0

    def prepare(self, q, lens):
        self.q.copy_(q)
        self.steps += 1
        self.build_lens(lens)

    def build_lens(self, lens):
        if self.variant == "fix" or self.steps < len(LENGTHS):
            self.lens.copy_(lens)


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_an_input_its_own_refresh_skipped_this_step_is_named_at_that_refresh(variant):
    """A static input that steps before this one refreshed, and this one did not, found against the
    run without graphs: the refresh that skipped it is the one that wrote it before (``build_lens``),
    not the copy of the step's other input that the same op reads."""
    finding = finding_of(_workload(lambda cache: SkippingBuilder(cache, variant)), variant)
    if finding is None:
        return
    assert finding.kind == "stale-input" and function_of(finding.location) == "build_lens", finding
    assert "skipped" in finding.evidence and "self.lens.copy_(lens)" in finding.source, finding


def lengths_apart(q, cache, lens, max_len: int):
    """The lengths read by a function of their own, which reads no other input."""
    return attend(q, cache, torch.ones_like(lens), max_len) * _scale(lens)[:, None]


def _scale(lens):
    return lens.float() / 8


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_an_omitted_input_read_apart_from_the_others_is_named_at_the_steps_refresh(variant):
    """No function that reads the omitted ``lens`` reads an input the step wrote: the refresh that
    left it out is the function that wrote the step's other static inputs (``prepare``)."""
    finding = finding_of(_workload(lambda cache: OmittingRunner(cache, variant, kernel=lengths_apart),
                                 kernel=lengths_apart), variant)
    if finding is None:
        return
    assert finding.kind == "stale-input" and "self.q.copy_(q)" in finding.source, finding
    assert "refreshed q, with most of the step's static inputs" in finding.evidence, finding


def weighted(q, cache, lens, max_len: int):
    """Each query scaled by its request's length: one op reads both static inputs."""
    return q * lens[:, None]


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_an_input_skipped_beside_one_the_step_refreshed_is_named_where_that_one_was_refreshed(variant):
    """The op that reads the omitted ``lens`` also reads ``q``, which the replay path refreshed this
    step: the refresh that skipped ``lens`` is that one (``prepare``'s copy into ``q``)."""
    finding = finding_of(_workload(lambda cache: OmittingRunner(cache, variant, kernel=weighted), kernel=weighted),
                       variant)
    if finding is None:
        return
    assert finding.kind == "stale-input" and "self.q.copy_(q)" in finding.source, finding
    assert "refreshed q, which the same op reads" in finding.evidence, finding


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_loop_count_frozen_at_capture_is_named_at_the_frame_that_loops(variant):
    """``bug``: captured with the dummy batch's length (1: one block); every replay attends over the
    first block only. ``fix``: captured with the longest context, blocks past a sequence add nothing.
    The fix's graph launches more work than the reference's steps do, which is no evidence."""
    workload = _workload(lambda cache: Runner(cache, variant, capture_len=1 if variant == "bug" else CONTEXT))
    report = doctor.diagnose(workload)
    if variant == "fix":
        assert report.findings == [], report
        return
    (finding,) = report.findings
    assert finding.kind == "host-work-frozen" and " in attend: " in finding.source, finding


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_number_frozen_at_capture_is_named_at_the_op_that_keeps_it(variant):
    """``bug``: the clamp keeps the capture batch's longest length (4) where each reference step
    passes its own (5 to 7); ``fix``: captured with the whole context, the clamp changes nothing.
    The launch traces agree op for op: only the number differs."""
    kernel = attend_clamped
    workload = _workload(lambda cache: Runner(cache, variant, capture_len=4 if variant == "bug" else CONTEXT,
                                              kernel=kernel), kernel=kernel)
    report = doctor.diagnose(workload)
    if variant == "fix":
        assert report.findings == [], report
        return
    (finding,) = report.findings
    assert finding.kind == "host-work-frozen" and " in attend_clamped: " in finding.source, finding
    assert "runs with 4 in the graph where the reference step passes" in finding.evidence, finding


def test_without_a_reference_run_the_captured_callable_agrees_with_the_graph():
    """What the reference adds: the same bug, not announced, gives no finding (differential replay
    re-runs the captured callable, which reads what the replay path prepared)."""
    report = doctor.diagnose(_workload(lambda cache: Runner(cache, "bug", lens_offset=1), announce=False))
    assert report.findings == [] and report.replays == 3, report


def test_a_reference_run_is_recorded_only_before_any_capture():
    """A reference announced after graphs exist describes nothing the doctor can align: ignored."""
    def workload():
        cache = _cache()
        runner = Runner(cache, "bug", lens_offset=1)
        with events.reference():
            attend(_queries(0), cache, torch.tensor(LENGTHS[0]), CONTEXT)
        runner(_queries(0), torch.tensor(LENGTHS[0]))
    assert doctor.diagnose(workload).findings == []


def layer(x, weight):
    return torch.tanh(x @ weight)


class ShapeKeyedGraphs:
    """One graph per input shape (``bug``), or per shape and weight (``fix``): the weight is not a
    static input, the capture binds it."""

    def __init__(self, variant: str):
        self.variant, self.graphs = variant, {}

    def __call__(self, x, weight):
        key = tuple(x.shape) if self.variant == "bug" else (tuple(x.shape), id(weight))
        if key not in self.graphs:
            static = x.clone()
            events.static_buffers("graphs", {f"x{len(self.graphs)}": static})
            step = lambda: layer(static, weight)  # noqa: E731
            with events.warmup():
                step()
            g = new_graph("cpu")
            with graph(g, name=f"layer {len(self.graphs)}"):
                out = step()
            self.graphs[key] = (g, static, out, step)
        g, static, out, step = self.graphs[key]
        static.copy_(x)
        events.serve(g, x.shape[0], x.shape[0], padded={}, outputs=out, eager=step)
        g.replay()
        return out.clone()


def _layers(run_layer, between=lambda weights: None):
    """Three layers of one shape, run twice through ``run_layer()``'s graphs (``between`` the two
    passes, on the weights) and twice without graphs (announced as the reference)."""
    def workload():
        gen = torch.Generator().manual_seed(0)
        weights = [torch.randn(4, 4, generator=gen) for _ in range(3)]
        x = torch.randn(2, 4, generator=gen)

        def model(call):
            h = x
            for w in weights:
                h = call(h, w)
            return h

        with events.reference():
            expected = [model(layer) for _ in range(2)]
        runner = run_layer()
        got = [model(runner)]
        between(weights)
        return expected, got + [model(runner)]
    return workload


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_graph_replayed_for_a_tensor_it_was_not_captured_with_is_named_where_it_is_replayed(variant):
    """``bug``: layers of one shape share the first layer's graph, which reads the first layer's
    weight. Its eager form is the captured closure (the same weight): differential replay agrees
    with the graph; the reference run's same step reads the layer's own weight."""
    workload = _layers(lambda: ShapeKeyedGraphs(variant))
    finding = finding_of(workload, variant)
    if finding is None:
        return
    assert finding.kind == "warmup-divergence" and " in __call__: g.replay()" in finding.source, finding
    assert "nothing wrote it since the capture bound it" in finding.evidence, finding


class LayoutKeyedGraphs:
    """One graph and its prepared metadata per key (visual generation's per-shape cache). The
    metadata (which segment each row attends in) is announced as persistent state, which the graph
    only reads. ``bug``'s key function leaves the layout out: a pass of the other layout replays
    the graph whose metadata was prepared for the first."""

    def __init__(self, variant: str):
        self.variant, self.entries = variant, {}

    def cache_key(self, x, layout: int):
        return tuple(x.shape) if self.variant == "bug" else (layout, *x.shape)

    def __call__(self, x, layout: int):
        key = self.cache_key(x, layout)
        if key not in self.entries:
            segment = torch.arange(x.shape[0]) // layout
            static = x.clone()
            events.static_buffers("cache", {f"x{len(self.entries)}": static})
            events.persistent_state("cache", {f"segment{len(self.entries)}": segment})
            step = functools.partial(segmented, static, segment)
            g = new_graph("cpu")
            with graph(g, name=f"layout {layout}"):
                out = step()
            self.entries[key] = (g, static, out, step)
        g, static, out, step = self.entries[key]
        static.copy_(x)
        events.serve(g, x.shape[0], x.shape[0], padded={}, outputs=out, eager=step)
        g.replay()
        return out.clone()


def segmented(x, segment):
    """Each row summed with the rows of its segment."""
    same = (segment[:, None] == segment[None, :]).to(x.dtype)
    return same @ x


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_graph_cache_key_that_leaves_a_property_out_is_named_at_the_key_function(variant):
    """``bug``: the second layout's pass replays the first's graph, whose segments (state the graph
    only reads, prepared eagerly) differ from the reference step's. Nothing wrote them since the
    capture: the graph was chosen by the key, and the finding names the line the key came from."""
    def workload():
        gen = torch.Generator().manual_seed(5)
        passes = [(torch.randn(4, 2, generator=gen), layout) for _ in range(2) for layout in (2, 4)]
        with events.reference():
            expected = [segmented(x, torch.arange(4) // layout) for x, layout in passes]
        runner = LayoutKeyedGraphs(variant)
        return expected, [runner(x, layout) for x, layout in passes]
    finding = finding_of(workload, variant)
    if finding is None:
        return
    assert finding.kind == "warmup-divergence" and " in cache_key: return tuple(x.shape)" in finding.source, finding
    assert "nothing wrote it since the capture bound it" in finding.evidence, finding


class SkippingTableRunner:
    """Static ``q`` and ``table``; ``bug`` skips the table's upload when it has as many entries as the
    last one uploaded (a new request with as many blocks, on other pages, keeps the old table)."""

    def __init__(self, cache, variant: str):
        self.cache, self.variant, self.last = cache, variant, None
        self.q, self.table = torch.zeros(1, 4), torch.zeros(1, 2, dtype=torch.long)
        events.static_buffers("runner", {"q": self.q, "table": self.table})
        self.step = lambda: paged_score(self.q, self.cache, self.table)  # noqa: E731
        self.graph = new_graph("cpu")
        with graph(self.graph, name="decode"):
            self.out = self.step()

    def __call__(self, q, table):
        self.q.copy_(q)
        if self.variant == "fix" or self.last is None or len(table) != len(self.last):
            self.table[0].copy_(table)
        self.last = table
        events.serve(self.graph, 1, 1, padded={}, outputs=self.out, eager=self.step)
        self.graph.replay()
        return self.out.clone()


def paged_score(q, cache, table):
    return (cache[table[0]] * q).sum(-1, keepdim=True).sum(0)


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_replay_is_aligned_with_its_step_by_the_inputs_that_step_wrote(variant):
    """Request A decodes twice, then request B once, with the same query as A's first step (a token
    repeated by chance). ``bug`` leaves A's table for B: B's replay reads exactly the inputs of A's
    first step, and gives its answer. Aligned by every input it reads, it would be A's first step,
    which it agrees with, and nothing is found; aligned by the inputs the step wrote (the query), it
    is B's step, which it does not agree with: the table is stale input."""
    def workload():
        cache = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
        q0, q1 = (torch.randn(1, 4, generator=torch.Generator().manual_seed(s)) for s in (1, 2))
        steps = [(q0, torch.tensor([0, 1])), (q1, torch.tensor([0, 1])), (q0, torch.tensor([2, 3]))]
        with events.reference():
            expected = [paged_score(q, cache, t[None]) for q, t in steps]
        runner = SkippingTableRunner(cache, variant)
        return expected, [runner(q, t) for q, t in steps]
    finding = finding_of(workload, variant)
    if finding is None:
        return
    assert finding.kind == "stale-input" and finding.tensor.startswith("table"), finding


def test_a_graph_that_hands_out_more_than_its_root_returned_is_compared_on_what_the_root_returned():
    """A runner skips the table's upload when the table is the one it uploaded last (a request's next
    step), and its graph hands out the step's scores and, beside them, the argmax a sampler took
    inside the capture. The reference's root returns the scores only. The step depends on the table
    it carried over, as it should: every replay gives the reference's scores, so what the probes
    found about the carried table is held, and nothing is reported."""
    class Runner:
        def __init__(self, cache):
            self.cache, self.last = cache, None
            self.q, self.table = torch.zeros(1, 4), torch.zeros(1, 2, dtype=torch.long)
            events.static_buffers("runner", {"q": self.q, "table": self.table})
            self.step = lambda: self.sampled(paged_score(self.q, self.cache, self.table))  # noqa: E731
            self.graph = new_graph("cpu")
            with graph(self.graph, name="decode"):
                self.out = self.step()

        @staticmethod
        def sampled(scores):
            return scores, scores.argmax(-1)

        def __call__(self, q, table):
            self.q.copy_(q)
            if self.last is None or not torch.equal(table, self.last):
                self.table[0].copy_(table)
            self.last = table
            events.serve(self.graph, 1, 1, padded={}, outputs=self.out, eager=self.step)
            self.graph.replay()
            return self.out[0].clone()

    def workload():
        cache = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
        qs = [torch.randn(1, 4, generator=torch.Generator().manual_seed(s)) for s in (1, 2, 3)]
        steps = [(qs[0], torch.tensor([0, 1])), (qs[1], torch.tensor([0, 1])), (qs[2], torch.tensor([2, 3]))]
        with events.reference():
            expected = [paged_score(q, cache, t[None]) for q, t in steps]
        runner = Runner(cache)
        got = [runner(q, t) for q, t in steps]
        assert all(torch.equal(e, g) for e, g in zip(expected, got))
        return expected, got
    report = doctor.diagnose(workload)
    assert report.findings == [], report
    assert any("held" in note and "table" in note for note in report.notes), report


def requantize(weights):
    """Round each weight to a coarse grid in place: the served run does it, the reference does not."""
    for w in weights:
        w.copy_((w * 4).round() / 4)


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_tensor_the_graph_reads_rewritten_after_capture_is_named_where_it_was_written(variant):
    """Graphs keyed per weight (correctly). ``bug``: between its two passes the served run rounds
    the weights in place, which the run without graphs never does: the graph reads what that write
    left, and the finding names the write, not the replay."""
    workload = _layers(lambda: ShapeKeyedGraphs("fix"), requantize if variant == "bug" else lambda weights: None)
    finding = finding_of(workload, variant)
    if finding is None:
        return
    assert finding.kind == "warmup-divergence" and " in requantize: " in finding.source, finding
    assert "last written by aten.copy_" in finding.evidence, finding


def score(q, table):
    return (q * table).sum(-1)


class CarriedTable:
    """Each request's table row is written once, when it joins, and read by every later step: carried
    across steps on purpose (announced as a static input all the same, as runners do). ``bug``: the
    row of the second request is never written; ``late``: rows are written at the first step only (a
    request that replaces another later keeps the old one's row)."""

    def __init__(self, variant: str):
        self.variant, self.called = variant, False
        self.q, self.table = torch.zeros(2, 4), torch.zeros(2, 4)
        events.static_buffers("runner", {"q": self.q, "table": self.table})
        self.step = lambda: score(self.q, self.table)  # noqa: E731
        with events.warmup():
            self.step()
        self.graph = new_graph("cpu")
        with graph(self.graph, name="decode"):
            self.out = self.step()

    def __call__(self, q, joined: dict):
        for row, table_row in joined.items():
            if self.variant == "fix" or self.variant == "bug" and row == 0 or self.variant == "late" and not self.called:
                self.table[row].copy_(table_row)
        self.called = True
        self.q.copy_(q)
        events.serve(self.graph, 2, 2, padded={}, outputs=self.out, eager=self.step)
        self.graph.replay()
        return self.out.clone()


def _carried(variant: str, announce: bool = True):
    def workload():
        gen = torch.Generator().manual_seed(3)
        rows = {0: torch.randn(4, generator=gen), 1: torch.randn(4, generator=gen)}
        replaced = {1: torch.randn(4, generator=gen)}            # the second request replaced at step 2
        steps = [(torch.randn(2, 4, generator=gen), rows if i == 0 else replaced if i == 2 else {}) for i in range(4)]
        tables = [torch.stack([rows[0], rows[1] if i < 2 else replaced[1]]) for i in range(4)]
        ctx = events.reference() if announce else contextlib.nullcontext()
        with ctx:
            expected = [score(q, table) for (q, _), table in zip(steps, tables)]
        runner = CarriedTable(variant)
        return expected, [runner(q, joined) for q, joined in steps]
    return workload


@pytest.mark.parametrize("announce", [True, False])
def test_memory_carried_on_purpose_is_no_evidence_when_replays_give_the_reference_runs_answers(announce):
    """The counterfactual probes (a static input's carried elements, the state before the warmups,
    put back) show a dependency the workload means to have: with the run without graphs announced,
    replays that give its answers are not reported; without it, the carried rows are."""
    workload = _carried("fix", announce)
    expected, got = workload()
    assert all(torch.equal(e, g) for e, g in zip(expected, got))
    report = doctor.diagnose(workload)
    if announce:
        assert report.findings == [], report
        assert any("but every replay gave the reference run's answers" in n for n in report.notes), report
    else:
        assert [f.kind for f in report.findings] == ["stale-input"], report


def test_what_a_replay_that_agreed_was_found_to_depend_on_is_reported_once_a_replay_does_not():
    """``late``: the first two replays give the reference run's answers while the carried rows are
    still right (the dependency found then is held); the third reads the replaced request's old
    row, and the held finding is reported: the carried rows, from the second replay (the first that
    carried any)."""
    workload = _carried("late")
    expected, got = workload()
    assert [torch.equal(e, g) for e, g in zip(expected, got)] == [True, True, False, False]
    report = doctor.diagnose(workload)
    assert [f.kind for f in report.findings] == ["stale-input"], report
    assert report.findings[0].tensor.startswith("table"), report
    assert report.findings[0].evidence.startswith("sampled replay 2 "), report.findings[0]   # (held since then)


def test_a_carried_row_never_written_is_still_found_with_the_reference_run():
    workload = _carried("bug")
    expected, got = workload()
    assert not torch.equal(expected[0], got[0])
    report = doctor.diagnose(workload)
    assert report.findings and report.findings[0].tensor.startswith("table"), report


class StaleEagerForm:
    """A correct graph whose announced eager form is not the step: it closes over the capture's
    query (as a captured callable closes over the capture's Python data) instead of reading ``q``."""

    def __init__(self, table):
        self.q, self.table = torch.zeros(2, 4), table
        events.static_buffers("runner", {"q": self.q})
        first = torch.ones(2, 4)
        self.q.copy_(first)
        with events.warmup():
            score(self.q, self.table)
        self.graph = new_graph("cpu")
        with graph(self.graph, name="decode"):
            self.out = score(self.q, self.table)
        self.eager = lambda: score(first, self.table)  # noqa: E731

    def __call__(self, q):
        self.q.copy_(q)
        events.serve(self.graph, 2, 2, padded={}, outputs=self.out, eager=self.eager)
        self.graph.replay()
        return self.out.clone()


@pytest.mark.parametrize("announce", [True, False])
def test_an_eager_form_that_is_not_the_step_is_no_evidence_against_replays_that_give_the_reference(announce):
    def workload():
        gen = torch.Generator().manual_seed(5)
        table = torch.randn(2, 4, generator=gen)
        qs = [torch.randn(2, 4, generator=gen) for _ in range(3)]
        with events.reference() if announce else contextlib.nullcontext():
            expected = [score(q, table) for q in qs]
        runner = StaleEagerForm(table)
        return expected, [runner(q) for q in qs]
    expected, got = workload()
    assert all(torch.equal(e, g) for e, g in zip(expected, got))
    report = doctor.diagnose(workload)
    assert (report.findings == []) == announce, report


def test_a_replay_that_differs_from_the_reference_for_no_cause_found_is_in_the_headline():
    """The shape-keyed graphs again, with weights too large for the reference run to keep their
    values: the doctor sees the replays give other results than the run without graphs and cannot
    say why. The report is not clean, and says so in its first line."""
    def workload():
        gen = torch.Generator().manual_seed(0)
        weights = [torch.randn(4, 20_000, generator=gen) * 0.01 for _ in range(2)]
        x = torch.randn(2, 4, generator=gen)
        with events.reference():
            expected = [layer(x, w) for w in weights]
        runner = ShapeKeyedGraphs("bug")
        return expected, [runner(x, w) for w in weights]
    expected, got = workload()
    assert not torch.equal(expected[1], got[1])
    report = doctor.diagnose(workload)
    assert report.findings == [] and not report.clean, report
    assert len(report.unexplained) == 1 and "call 2 of layer" in report.unexplained[0], report
    assert "1 result(s) differ from the workload's run without graphs, and no finding" in report.headline()
    assert "differs from the run without graphs: replay 2 of layer 0" in str(report)


class Lazy:
    scale = None


def scaled_score(holder, q, table):
    """A scale made lazily by the first call: a capture after a warmup skips that line."""
    if holder.scale is None:
        holder.scale = table.abs().sum(0)
    return score(q, table) * holder.scale.sum()


class LazyScale(StaleEagerForm):
    """``StaleEagerForm`` with the lazy scale: the warmup makes it, the capture skips that line, and
    the replays read the scale made."""

    def __init__(self, table):
        self.q, self.table, holder = torch.zeros(2, 4), table, Lazy()
        events.static_buffers("runner", {"q": self.q})
        first = torch.ones(2, 4)
        self.q.copy_(first)
        with events.warmup():
            scaled_score(holder, self.q, self.table)
        self.graph = new_graph("cpu")
        with graph(self.graph, name="decode"):
            self.out = scaled_score(holder, self.q, self.table)
        self.eager = lambda: scaled_score(holder, first, self.table)  # noqa: E731


def test_work_a_capture_skipped_is_no_finding_when_every_replay_gives_the_reference():
    """The capture skips the warmup's lazy line, which changes no result; the announced eager form
    (closed over the capture's query) differs from each replay, which gives the reference's answer:
    the skipped work is noted, not reported, as when differential replay agrees."""
    def workload():
        gen = torch.Generator().manual_seed(6)
        table = torch.randn(2, 4, generator=gen)
        qs = [torch.randn(2, 4, generator=gen) for _ in range(3)]
        with events.reference():
            holder = Lazy()
            expected = [scaled_score(holder, q, table) for q in qs]
        runner = LazyScale(table)
        return expected, [runner(q) for q in qs]
    expected, got = workload()
    assert all(torch.equal(e, g) for e, g in zip(expected, got))
    report = doctor.diagnose(workload)
    assert report.findings == [], report
    assert any("so it changes no result" in n for n in report.notes), report


# ------------------------------------------------------------------ PIECEWISE steps
class Backend:
    """Attention-like work between two pieces: each request's tokens attend to its own cached
    tokens, through host metadata (``lens``, ``slots``) the runner sets before each step. It writes
    the step's keys into ``cache`` at ``slots``; the capture's dummy batch sets one request of all the
    tokens at slots from 0, which hold the first request's cached keys."""

    def __init__(self, cache):
        self.cache, self.lens, self.slots = cache, None, None

    def set(self, lens, slots):
        self.lens, self.slots = list(lens), slots

    def attend(self, h):
        n = sum(self.lens)
        self.cache[self.slots[:n]] = h[:n]
        out, start = torch.zeros_like(h), 0
        for length in self.lens:
            out[start:start + length] = self.cache[:start + length].mean(0)
            start += length
        return out


class Piecewise:
    """The step captured PIECEWISE: a linear piece, the backend eagerly, another piece. The captured
    callable sets the dummy batch's metadata, as a capture function does: its eager form is not the
    step. ``bug``: the replay path sets the metadata only for the first step it serves."""

    def __init__(self, backend, w, variant: str, state: bool = True):
        from workbench.engine import GraphManager
        self.backend, self.w, self.variant, self.served = backend, w, variant, 0
        self.x, self.dummy_slots = torch.zeros(4, 3), torch.arange(4)
        self.m = GraphManager(self.forward, [4], mode="PIECEWISE", static_buffers={"x": self.x}, name="pcg")
        self.attend = self.m.eager(backend.attend)
        if state:
            events.persistent_state("backend", {"cache": backend.cache})
        start = backend.cache.clone()
        self.m.capture()
        backend.cache.copy_(start)                           # what the dummy batches wrote is discarded

    def forward(self, size):
        self.backend.set([size], self.dummy_slots[:size])     # the dummy batch: one request
        return model_step(self.x[:size], self.w, self.attend)

    def __call__(self, x, lens, slots):
        if self.variant == "fix" or self.served == 0:
            self.backend.set(lens, slots)
        self.served += 1
        self.x[:x.shape[0]] = x
        return self.m.replay(4, x.shape[0]).clone()


def model_step(x, w, attend):
    h = torch.tanh(x @ w)
    return (h + attend(h)) @ w


def _piecewise_workload(variant: str, announce: bool, got: list, state: bool = True):
    def workload():
        gen = torch.Generator().manual_seed(7)
        w = torch.randn(3, 3, generator=gen)
        steps = [(torch.randn(4, 3, generator=gen), [2, 2], torch.tensor([2, 3, 6, 7])),
                 (torch.randn(3, 3, generator=gen), [2, 1], torch.tensor([4, 5, 8, 0])),
                 (torch.randn(4, 3, generator=gen), [2, 2], torch.tensor([9, 10, 11, 12]))]
        start = torch.randn(16, 3, generator=gen)
        with events.reference() if announce else contextlib.nullcontext():
            backend = Backend(start.clone())
            expected = []
            for x, lens, slots in steps:
                backend.set(lens, slots)
                expected.append(model_step(x, w, backend.attend))
        runner = Piecewise(Backend(start.clone()), w, variant, state)
        got[:] = [runner(*s) for s in steps]
        return expected, got
    return workload


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_piecewise_step_is_compared_with_the_reference_as_one_step(variant):
    """Each PIECEWISE step is aligned with the reference's same step (by what its first piece reads)
    and compared after its last piece: the fix's replays give the reference's answers, so what its
    eager form (the capture's dummy metadata) gives is held, not reported; the bug's stale metadata
    gives other answers, and the findings are reported. Without the reference run the fix's eager form
    is all the doctor has, and it is reported."""
    got: list = []
    expected, _ = _piecewise_workload(variant, True, got)()
    assert all(torch.equal(e, g) for e, g in zip(expected, got)) == (variant == "fix")
    for announce in (True, False):
        report = doctor.diagnose(_piecewise_workload(variant, announce, got))
        assert (report.findings == []) == (variant == "fix" and announce), report
        if variant == "fix" and announce:
            assert any("finding(s) held" in n and "piece 0" in n for n in report.notes), report.notes


def test_differential_replay_leaves_no_trace_of_an_eager_form_that_writes_other_memory():
    """The fix's eager form writes the backend's cache at the dummy batch's slots, where the first
    request's keys are: differential replay runs it several times a sampled step (traced or not), and
    must put that memory back each time, or the next step reads what the doctor wrote. The cache is
    not announced: what the doctor keeps of it is what it saw the eager form write."""
    got: list = []
    expected, _ = _piecewise_workload("fix", False, got, state=False)()
    doctor.diagnose(_piecewise_workload("fix", False, got, state=False), differential=1)
    assert len(got) == 3 and all(torch.equal(e, g) for e, g in zip(expected, got))


# ------------------------------------------------------------------ the workload's own verdict
def accumulate(x, acc, first: bool):
    """One micro-batch: its gradient overwrites ``acc`` (the first of an iteration) or adds to it."""
    g = x.sum(0)
    if first:
        acc.copy_(g)
    else:
        acc.add_(g)
    return (g * 2)[None]


class FirstMicrobatch:
    """Each micro-batch adds its gradient into ``acc`` (announced state); the first of an iteration
    overwrites it instead, as a flag in Python says. The runner resets the flag before capturing,
    so the graph always overwrites; the captured callable, run again later, adds (its eager form is
    not the step where ``acc`` is concerned)."""

    def __init__(self):
        self.x, self.acc, self.first = torch.zeros(2, 4), torch.zeros(4), True
        events.static_buffers("mb", {"x": self.x})
        events.persistent_state("mb", {"acc": self.acc})
        with events.warmup():
            self.step()
        self.first = True
        self.graph = new_graph("cpu")
        with graph(self.graph, name="microbatch"):
            self.out = self.step()

    def step(self):
        out = accumulate(self.x, self.acc, self.first)
        self.first = False
        return out

    def __call__(self, x):
        self.x.copy_(x)
        events.serve(self.graph, 1, 1, outputs=self.out, eager=self.step)
        self.graph.replay()
        return self.out.clone()


def _microbatches(compare_acc: bool, say: bool | None):
    """Two iterations of two micro-batches. The workload compares each step's output and, with
    ``compare_acc``, the gradient accumulated at the end of each iteration (the bug's: only the last
    micro-batch's). ``say``: whether it hands its comparison to the doctor (``events.results``)."""
    def workload():
        gen = torch.Generator().manual_seed(8)
        batches = [[torch.randn(2, 4, generator=gen) for _ in range(2)] for _ in range(2)]
        with events.reference():
            expected, acc = [], torch.zeros(4)
            for iteration in batches:
                expected += [accumulate(x, acc, n == 0) for n, x in enumerate(iteration)]
                expected += [acc.clone()] if compare_acc else []
        runner, got = FirstMicrobatch(), []
        for iteration in batches:
            for x in iteration:
                got.append(runner(x))
            got += [runner.acc.clone()] if compare_acc else []
        if say:
            events.results(expected, got)
        return expected, got
    return workload


@pytest.mark.parametrize("say", [True, False])
@pytest.mark.parametrize("compare_acc", [True, False])
def test_state_the_eager_form_writes_otherwise_is_judged_by_the_workloads_own_results(compare_acc, say):
    """Every replay gives the run without graphs' output, so the difference in ``acc`` between the
    replay and the eager form is held. The workload's own comparison decides: its results differ
    (the accumulated gradient) -- reported, with that in the evidence; they agree (it compares no
    gradient) -- a note. A workload that says nothing gets the finding, as state is not what the
    replays' outputs show."""
    expected, got = _microbatches(compare_acc, say)()
    assert all(torch.equal(e, g) for e, g in zip(expected, got)) == (not compare_acc)
    report = doctor.diagnose(_microbatches(compare_acc, say))
    if say and not compare_acc:
        assert report.findings == [] and report.clean, report
        assert any("and so did the workload's results" in n for n in report.notes), report.notes
        return
    (finding,) = report.findings
    assert finding.kind == "warmup-divergence" and "acc.copy_(g)" in finding.source, finding
    assert ("but the workload's result 2 differs" in finding.evidence) == bool(say and compare_acc), finding


def test_results_that_differ_with_no_finding_are_in_the_headline():
    """The workload says its results differ from the run without graphs, and nothing the doctor
    looks at explains it: the report is not clean, and says so."""
    def workload():
        x = torch.ones(2)
        with events.reference():
            expected = [x * 2]
        events.results(expected, [x * 3])
    report = doctor.diagnose(workload)
    assert report.findings == [] and not report.clean, report
    assert "the workload's result 0 differs from its run without graphs'" in report.unexplained[0]


# ------------------------------------------------------------------ fewer outputs handed out than returned
def decay(step: int) -> float:
    """The loss exponent of a training step, computed on the host."""
    return 2.0 - step / 4


def loss_terms(x, exponent):
    terms = x.abs() ** exponent
    return terms.sum(), terms


class DecayedLoss:
    """The captured step returns the loss and its per-element terms; the runner hands out the loss
    only. ``bug``: the exponent is the capture step's, passed straight from ``decay`` to the kernel
    (a number baked into the graph); ``fix``: it is a tensor the runner refreshes every step."""

    def __init__(self, variant: str):
        self.variant, self.x, self.exponent = variant, torch.zeros(3), torch.zeros(())
        events.static_buffers("trainer", {"x": self.x, "exponent": self.exponent})
        step = 0
        self.exponent.fill_(decay(step))
        if variant == "bug":
            self.step_fn = lambda: loss_terms(self.x, decay(step))  # noqa: E731
        else:
            self.step_fn = lambda: loss_terms(self.x, self.exponent)  # noqa: E731
        with events.warmup():
            self.step_fn()
        self.graph = new_graph("cpu")
        with graph(self.graph, name="train"):
            self.loss, self.terms = self.step_fn()

    def __call__(self, step, x):
        self.x.copy_(x)
        self.exponent.fill_(decay(step))
        events.serve(self.graph, 1, 1, outputs=self.loss, eager=self.step_fn)
        self.graph.replay()
        return self.loss.clone()


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_runner_handing_out_one_of_the_outputs_is_compared_on_that_one(variant):
    """The eager form returns two outputs where the replay announces one: each comparison takes the
    announced one from what the step returns (the first of its shape and dtype), so the fix is
    clean; the bug's exponent, computed by ``decay`` and never held in a variable, is named there."""
    def workload():
        xs = [torch.tensor([1.5, 2.0, 3.0]) * (k + 1) for k in range(3)]
        with events.reference():
            expected = [loss_terms(x, decay(k))[0] for k, x in enumerate(xs)]
        runner = DecayedLoss(variant)
        return expected, [runner(k, x) for k, x in enumerate(xs)]
    finding = finding_of(workload, variant)
    if finding is None:
        return
    assert finding.kind == "host-work-frozen" and " in decay: " in finding.source, finding


# ------------------------------------------------------------------ lines only the run without graphs ran
def logits_step(h, w, return_logprob: bool):
    """A decode step's logits, and their log-softmax when the step asks for it."""
    logits = h @ w
    if return_logprob:
        logprobs = torch.log_softmax(logits, -1)
        return logits, logprobs
    return logits, None


class LogitsRunner:
    """One graph, captured on a batch that asks for no logprobs. ``bug``: a step that asks for
    them is refused (the graph cannot give them); ``fix``: they are computed eagerly after the
    replay."""

    def __init__(self, w, variant: str):
        self.w, self.variant, self.h = w, variant, torch.zeros(2, 4)
        events.static_buffers("runner", {"h": self.h})
        step = lambda: logits_step(self.h, self.w, False)[0]  # noqa: E731
        with events.warmup():
            step()
        self.graph = new_graph("cpu")
        with graph(self.graph, name="decode"):
            self.out = step()

    def __call__(self, h, return_logprob: bool):
        if self.variant == "bug":
            assert not return_logprob, "this graph gives no logprobs"
        self.h.copy_(h)
        self.graph.replay()
        logits = self.out.clone()
        return logits, torch.log_softmax(logits, -1) if return_logprob else None


def _logprob_steps(variant: str, runner=LogitsRunner):
    """Three decode steps, the last two asking for logprobs, through the zoo's ``compare`` (which
    announces the run without graphs and catches what the served run raises)."""
    from workbench.zoo.kit import compare

    w = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))
    hs = [torch.randn(2, 4, generator=torch.Generator().manual_seed(10 + i)) for i in range(3)]
    asks = [False, True, True]

    def outputs(step):
        outs = []
        for h, ask in zip(hs, asks):
            logits, logprobs = step(h, ask)
            outs += [logits] + ([logprobs] if ask else [])
        return outs

    def served():
        return outputs(runner(w, variant))

    return lambda: compare("logprobs", variant, "cpu", served, lambda: outputs(lambda h, ask: logits_step(h, w, ask)))


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_path_only_the_run_without_graphs_took_is_named_where_the_capture_did_not_take_it(variant):
    """The served run fails at the second step; nothing else explains it. The run without graphs ran
    the logprob lines of ``logits_step`` by then, and the served run never did (its capture took the
    other path): ``warmup-divergence`` at the first of them. The fix serves them eagerly: clean."""
    report = doctor.diagnose(_logprob_steps(variant))
    if variant == "fix":
        assert report.findings == [] and report.caught == [], report
        return
    (finding,) = report.findings
    assert finding.kind == "warmup-divergence", finding
    assert finding.location.endswith("in logits_step") and "torch.log_softmax(logits, -1)" in finding.source, finding
    assert "the served run failed" in finding.evidence and "2 line(s) of logits_step" in finding.evidence, finding


def test_lines_past_where_the_served_run_stopped_are_not_compared():
    """A served run that fails at its first step, for another reason, reached no step that asks for
    logprobs: the run without graphs' later lines are not compared, and no path is named."""
    class Refusing(LogitsRunner):
        def __call__(self, h, return_logprob: bool):
            raise ValueError("no free KV blocks")

    report = doctor.diagnose(_logprob_steps("fix", Refusing))
    assert report.findings == [] and report.caught[0].startswith("ValueError: no free KV blocks"), report


# ------------------------------------------------------------------ host state judged by the workload's results
def decayed_sum(w, x):
    w.mul_(0.9).add_(x * 0.1)
    return w.sum()[None]


class CountedStep:
    """A training step that counts itself in Python (``self.steps += 1``, as an LR scheduler's
    ``last_epoch``) and keeps everything it computes on the device: the replays never move the
    count, and nothing the workload computes reads it."""

    def __init__(self):
        self.x, self.w, self.steps = torch.zeros(4), torch.ones(4), 0
        events.static_buffers("trainer", {"x": self.x})
        events.persistent_state("trainer", {"w": self.w})
        with events.warmup():
            self.step()
        self.graph = new_graph("cpu")
        with graph(self.graph, name="train"):
            self.out = self.step()
        self.w.fill_(1.0)                     # the warmup's update undone

    def step(self):
        self.steps += 1
        return decayed_sum(self.w, self.x)

    def __call__(self, x):
        self.x.copy_(x)
        events.serve(self.graph, 1, 1, outputs=self.out, eager=self.step)
        self.graph.replay()
        return self.out.clone()


@pytest.mark.parametrize("say", [True, False])
def test_a_count_in_python_the_replays_leave_is_judged_by_the_workloads_own_results(say):
    """Every replay gives the run without graphs' output and the workload's results agree: the count
    the eager step moves and the replays leave is held, then noted, not reported. A workload that
    says nothing about its results still gets the finding (what Python state holds is not in the
    replays' outputs)."""
    def workload():
        xs = [torch.full((4,), float(i)) for i in range(3)]
        with events.reference():
            w = torch.ones(4)
            ref = [decayed_sum(w, x).clone() for x in xs]
        runner = CountedStep()
        got = [runner(x) for x in xs]
        if say:
            events.results(ref, got)
    report = doctor.diagnose(workload)
    if say:
        assert report.findings == [], report
        assert any("CountedStep.steps" in n and "and so did the workload's results" in n for n in report.notes), report
    else:
        (finding,) = report.findings
        assert finding.kind == "host-work-frozen" and "CountedStep.steps" in finding.evidence, finding


# ------------------------------------------------------------------ a capture's window of a static buffer
def paged(q, pages, table):
    """Attention of each request over the pages its block table row lists (as wide as the table)."""
    keys = pages[table].flatten(1, 2)                           # [requests, columns * BLOCK, 4]
    return torch.softmax(keys @ q[:, :, None], 1).mul(keys).sum(1)


class PagedRunner:
    """A static block table as wide as the longest context. ``bug``: the capture reads the window
    of it that the dummy batch needs (one column, its sequences being one token long), and every
    replay fills only that window; ``fix``: the full width."""

    def __init__(self, pages, variant: str):
        self.pages, self.q = pages, torch.zeros(2, 4)
        self.table_buffer = torch.zeros(2, CONTEXT // BLOCK, dtype=torch.long)
        events.static_buffers("runner", {"q": self.q, "table": self.table_buffer})
        width = 1 if variant == "bug" else CONTEXT // BLOCK
        self.table = self.table_buffer[:, :width]
        step = lambda: paged(self.q, self.pages, self.table)  # noqa: E731
        with events.warmup():
            step()
        self.graph = new_graph("cpu")
        with graph(self.graph, name="decode"):
            self.out = step()

    def __call__(self, q, table):
        self.q.copy_(q)
        self.table.copy_(table[:, :self.table.shape[1]])       # what fits the window
        events.serve(self.graph, 2, 2, outputs=self.out, eager=lambda: paged(self.q, self.pages, self.table))
        self.graph.replay()
        return self.out.clone()


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_capture_window_narrower_than_the_steps_data_is_undersized_where_it_was_taken(variant):
    """The reference gives the attention a block table four columns wide; the graph reads a view of
    the static table one column wide: ``undersized-buffer`` at the line that took the view."""
    def workload():
        pages = torch.randn(8, BLOCK, 4, generator=torch.Generator().manual_seed(5))
        tables = [torch.tensor([[1, 2, 3, 0], [4, 5, 6, 0]]), torch.tensor([[1, 2, 7, 3], [4, 5, 6, 2]])]
        with events.reference():
            expected = [paged(_queries(i), pages, t) for i, t in enumerate(tables)]
        runner = PagedRunner(pages, variant)
        got = [runner(_queries(i), t) for i, t in enumerate(tables)]
        events.results(expected, got)
    report = doctor.diagnose(workload)
    if variant == "fix":
        assert report.findings == [] and report.clean, report
        return
    (finding,) = report.findings
    assert finding.kind == "undersized-buffer", finding
    assert "self.table = self.table_buffer[:, :width]" in finding.source, finding
    assert "1 against 4 in dimension 1" in finding.evidence, finding


# ------------------------------------------------------------------ padded rows handed out with the results
class Unsliced:
    """One graph of size 4 serving 3 requests. ``bug``: the runner returns the output as the graph
    wrote it, padded row included (a tuple sliced where its tensors should have been); ``fix``: the
    real rows."""

    def __init__(self, variant: str):
        self.variant, self.x = variant, torch.zeros(4, 2)
        events.static_buffers("runner", {"x": self.x})
        with events.warmup():
            logits(self.x)
        self.graph = new_graph("cpu")
        with graph(self.graph, name="decode"):
            self.out = logits(self.x)

    def __call__(self, x):
        n = x.shape[0]
        self.x[:n].copy_(x)
        self.x[n:].zero_()
        events.serve(self.graph, n, 4, padded={"x": self.x}, outputs=self.out, eager=lambda: logits(self.x))
        self.graph.replay()
        return (self.out if self.variant == "bug" else self.out[:n]).clone()


def logits(x):
    return torch.tanh(x) * 2


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_result_with_the_graphs_padded_rows_is_a_padded_shape_mismatch_where_it_was_replayed(variant):
    """The workload's result has 4 rows where the run without graphs has 3, and a replay served 3
    real rows at size 4: ``padded-shape-mismatch`` at the line that replayed it."""
    def workload():
        xs = [torch.randn(3, 2, generator=torch.Generator().manual_seed(i)) for i in range(2)]
        with events.reference():
            expected = [logits(x) for x in xs]
        runner = Unsliced(variant)
        got = [runner(x) for x in xs]
        events.results(expected, got)
    report = doctor.diagnose(workload, padding_probe=False)
    if variant == "fix":
        assert report.findings == [] and report.clean, report
        return
    (finding,) = report.findings
    assert finding.kind == "padded-shape-mismatch" and "self.graph.replay()" in finding.source, finding
    assert "has 4 rows where its run without graphs has 3" in finding.evidence, finding


class KeyedGraphs:
    """A graph per key, captured at the key's first step and replayed for every step with that key
    (its eager form announced: the captured closure)."""

    def __init__(self, variant: str):
        self.variant, self.graphs = variant, {}

    def serve(self, key, make_step):
        if key not in self.graphs:
            step = make_step()
            g = new_graph("cpu")
            with graph(g, name=f"decode {key}"):
                out = step()
            self.graphs[key] = (g, out, step)
        g, out, step = self.graphs[key]
        events.serve(g, 1, 1, padded={}, outputs=out, eager=step)
        g.replay()
        return out.clone()


class PerSequenceState(KeyedGraphs):
    """A recurrent step over one row of a per-sequence state table: graphs are cached by the batch's
    shape (bug), or by its shape and sequence (fix); the row is chosen when the graph is built."""

    def __init__(self, variant: str):
        super().__init__(variant)
        self.state, self.x = torch.zeros(2, 4), torch.zeros(1, 4)
        events.static_buffers("runner", {"x": self.x})
        events.persistent_state("runner", {"state": self.state})

    def __call__(self, x, seq):
        self.x.copy_(x)
        key = (x.shape, seq) if self.variant == "fix" else x.shape
        return self.serve(key, lambda: functools.partial(recurrent_step, self.x, self.state, seq))


def _two_sequences(make_runner):
    """Four tokens of two sequences taking turns, through ``make_runner()``'s graphs and, as the
    reference, through ``recurrent_step`` on a state table of their own."""
    def workload():
        tokens = [(torch.full((1, 4), float(i + 1)), i % 2) for i in range(4)]
        with events.reference():
            state = torch.zeros(2, 4)
            expected = [recurrent_step(x, state, seq).clone() for x, seq in tokens]
        runner = make_runner()
        return expected, [runner(x, seq) for x, seq in tokens]
    return workload


def recurrent_step(x, state, seq):
    row = state[seq]
    row.mul_(0.5).add_(x[0])
    return x * row


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_graph_replayed_on_another_view_than_the_step_takes_is_named_where_it_is_replayed(variant):
    """``bug``: the graph built for sequence 0 is replayed for sequence 1, on sequence 0's state
    row. Its eager form is the captured closure (the same row): differential replay agrees with the
    graph; the reference run's same step takes the other row of the table."""
    finding = finding_of(_two_sequences(lambda: PerSequenceState(variant)), variant)
    if finding is None:
        return
    assert finding.kind == "warmup-divergence" and " in serve: g.replay()" in finding.source, finding
    assert "at offset 0 of its storage in the graph where the reference step's same op reads offset 4" \
        in finding.evidence, finding


class GrowingContext(KeyedGraphs):
    """One query attending over a cache that grows by a token a step: graphs are cached by the query's
    shape (bug), or by its shape and the context length (fix); the cache view is taken when the graph
    is built."""

    def __init__(self, variant: str, cache: torch.Tensor):
        super().__init__(variant)
        self.cache, self.q = cache.clone(), torch.zeros(1, 4)
        events.static_buffers("runner", {"q": self.q})

    def __call__(self, q, length):
        self.q.copy_(q)
        key = (q.shape, length) if self.variant == "fix" else q.shape
        return self.serve(key, lambda: functools.partial(attend_prefix, self.q, self.cache, length))


def attend_prefix(q, cache, length):
    keys = cache[:length]
    return torch.softmax(q @ keys.T, -1) @ keys


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_graph_replayed_on_a_view_of_another_shape_than_the_step_takes_is_named_where_it_is_replayed(variant):
    """``bug``: the graph built at a context of 2 tokens is replayed as the context grows, over its
    capture's 2-token view of the cache. Its eager form is the captured closure (the same view):
    differential replay agrees with the graph; the reference run's same step reads more tokens."""
    cache = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    queries = [torch.full((1, 4), 0.5 * (i + 1)) for i in range(4)]

    def workload():
        with events.reference():
            expected = [attend_prefix(q, cache, i + 2).clone() for i, q in enumerate(queries)]
        runner = GrowingContext(variant, cache)
        return expected, [runner(q, i + 2) for i, q in enumerate(queries)]

    finding = finding_of(workload, variant)
    if finding is None:
        return
    assert finding.kind == "warmup-divergence" and " in serve: g.replay()" in finding.source, finding
    assert "reads a view (4, 2) in the graph where the reference step's same op reads (4, 3)" in finding.evidence, \
        finding


class ReusedGraph:
    """One graph, kept while a reuse check says the step matches the one it was built for (llama.cpp's
    graph reuse); ``bug``'s check compares the token count only, not the sequence's state row."""

    def __init__(self, variant):
        self.variant, self.built, self.x, self.state = variant, None, torch.zeros(1, 4), torch.zeros(2, 4)
        events.static_buffers("runner", {"x": self.x})
        events.persistent_state("runner", {"state": self.state})

    def can_reuse(self, x, seq) -> bool:
        if self.built is None:
            return False
        return x.shape == self.built[0] and (self.variant == "bug" or seq == self.built[1])

    def __call__(self, x, seq):
        self.x.copy_(x)
        if not self.can_reuse(x, seq):
            step = functools.partial(recurrent_step, self.x, self.state, seq)
            g = new_graph("cpu")
            with graph(g, name=f"decode seq {seq}"):
                out = step()
            self.built = (x.shape, seq, g, out, step)
        _, _, g, out, step = self.built
        events.serve(g, 1, 1, padded={}, outputs=out, eager=step)
        g.replay()
        return out.clone()


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_graph_a_reuse_check_let_through_is_named_at_that_check(variant):
    """``bug``: the reuse check lets sequence 0's graph serve sequence 1, on sequence 0's state row.
    The replay happens in ``__call__``, but the choice was the check's answer: the finding names the
    line where ``can_reuse`` answered (the fix checks the sequence too, and rebuilds)."""
    finding = finding_of(_two_sequences(lambda: ReusedGraph(variant)), variant)
    if finding is None:
        return
    assert finding.kind == "warmup-divergence" and " in can_reuse: return x.shape" in finding.source, finding
    assert "as the check at" in finding.evidence and "g.replay()" in finding.evidence, finding


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_host_scalar_taken_by_value_is_named_when_the_workloads_results_differ(variant):
    """``bug``: each step makes a new 0-dim host tensor for a parameter that changes; the captured
    op takes it by value, so every replay keeps the value it had at capture. The captured callable
    holds that same tensor, so differential replay agrees with the graph; the workload's own
    comparison (``events.results``) says the results differ. ``fix``: a device tensor written in place."""
    from workbench.engine import host

    def workload():
        x, k_dev = torch.ones(3), torch.zeros(1)
        events.static_buffers("runner", {"x": x, "k": k_dev})
        graphs, expected, got = {}, [], []
        with events.reference():
            expected = [torch.mul(torch.ones(3), host(torch.tensor(k))) for k in (1.0, 2.0, 3.0)]
        for k in (1.0, 2.0, 3.0):
            if variant == "bug":
                scale = host(torch.tensor(k))
            else:
                k_dev[0] = k
                scale = k_dev
            if "step" not in graphs:
                step = functools.partial(torch.mul, x, scale)
                g = new_graph("cpu")
                with graph(g, name="scaled"):
                    out = step()
                graphs["step"] = (g, out, step)
            g, out, step = graphs["step"]
            events.serve(g, 3, 3, padded={}, outputs=out, eager=step)
            g.replay()
            got.append(out.clone())
        events.results(expected, got)
        return expected, got
    finding = finding_of(workload, variant)
    if finding is None:
        return
    assert finding.kind == "host-work-frozen" and finding.numbers == {"captured_value": 1.0}, finding
    assert finding.source.endswith("out = step()"), finding.source


class CastCache:
    """A lower-precision copy of a tensor, cached by the tensor's identity (autocast's ``cached_casts``)."""

    def __init__(self, keyed: bool):
        self.keyed, self.casts = keyed, {}

    def cast(self, t):
        if self.keyed and id(t) in self.casts:
            return self.casts[id(t)]
        self.casts[id(t)] = low = t.to(torch.bfloat16)
        return low


@pytest.mark.parametrize("variant", ["bug", "fix", "previous step kept"])
def test_a_value_cached_by_a_graph_outputs_identity_is_stale_input_where_it_was_computed(variant):
    """The graph hands out the same output tensor at every replay. ``bug``: the cast of it is cached
    by the tensor's identity, so every step after the first multiplies by the first step's cast.
    ``fix``: cast each step. ``previous step kept``: the last step's cast kept on purpose and read
    once (a difference between steps) is no finding."""
    def workload():
        z, x = torch.zeros(4), torch.ones(4)
        events.static_buffers("runner", {"z": z})
        with events.reference():
            expected = [torch.tanh(torch.full((4,), float(k))).to(torch.bfloat16).float() * x for k in range(3)]
        g = new_graph("cpu")
        with graph(g, name="weights"):
            w = torch.tanh(z)
        cache, got, previous = CastCache(keyed=variant == "bug"), [], None
        for k in range(3):
            z.fill_(float(k))
            events.serve(g, 4, 4, padded={}, outputs=w, eager=lambda: torch.tanh(z))
            g.replay()
            low = cache.cast(w)
            got.append(low.float() * x)
            if variant == "previous step kept" and previous is not None:
                got[-1] = got[-1] + 0 * (low.float() - previous.float())
            previous = low
        events.results(expected, got)
        return expected, got
    finding = finding_of(workload, "fix" if variant != "bug" else "bug")
    if finding is None:
        return
    assert finding.kind == "stale-input" and finding.source.endswith("self.casts[id(t)] = low = t.to(torch.bfloat16)")
    assert finding.numbers == {"made_after": 1, "read_after": 2}, finding


def store_then_read(keys, cache, slots, skip_null: bool):
    """One write per row at its slot (a per-row cache kernel), then every row reads the shared
    first slot; ``skip_null``: a row whose slot is -1 writes back what is there."""
    for i in range(keys.shape[0]):
        slot = slots[i].view(1)
        if skip_null:
            safe, keep = slot.clamp(min=0), (slot < 0).view(1, 1)
            cache.index_put_((safe,), torch.where(keep, cache[safe], keys[i].view(1, -1)))
        else:
            cache.index_put_((slot,), keys[i].view(1, -1))
    return keys + cache[0]


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_padded_rows_write_into_state_the_real_rows_read_is_stale_padding_at_the_write(variant):
    """Three real rows served by a graph of four. ``bug``: the runner zeroes the padded row's slot,
    a live slot, and the captured per-row write stores the padded row's key over it; the real rows
    then read it. ``fix``: the padded slot is -1, and the kernel skips it. The reference's steps run
    the real rows only, so the graph's trace has one more row's ops: evidence only because they
    write state."""
    def workload():
        gen = torch.Generator().manual_seed(0)
        steps = [torch.randn(3, 2, generator=gen) for _ in range(2)]
        slots = [torch.tensor([1, 2, 3]) + 3 * t for t in range(2)]
        with events.reference():
            cache = torch.zeros(8, 2)
            cache[0] = 1.0
            expected = [store_then_read(k, cache, s, variant == "fix") for k, s in zip(steps, slots)]
        cache = torch.zeros(8, 2)
        cache[0] = 1.0
        keys, slot_buf = torch.zeros(4, 2), torch.full((4,), -1)
        events.static_buffers("runner", {"keys": keys, "slots": slot_buf})
        events.persistent_state("runner", {"cache": cache})
        step = lambda: store_then_read(keys, cache, slot_buf, variant == "fix")  # noqa: E731
        g = new_graph("cpu")
        with graph(g, name="decode 4"):
            out = step()
        got = []
        for k, s in zip(steps, slots):
            keys.zero_()
            slot_buf.fill_(0 if variant == "bug" else -1)
            keys[:3].copy_(k)
            slot_buf[:3].copy_(s)
            events.serve(g, 3, 4, padded={}, outputs=out, eager=step)
            g.replay()
            got.append(out[:3].clone())
        events.results(expected, got)
        return expected, got
    finding = finding_of(workload, variant)
    if finding is None:
        return
    assert finding.kind == "stale-padding" and "cache.index_put_((slot,), keys[i].view(1, -1))" in finding.source


def scaled_features(side, w):
    return (side @ w) * 2


def doubled(w):
    return w * 2


class HoistingRunner:
    """Static ``x``; the step is ``relu(x) @ w2 + scaled_features(side, w)``, where ``side`` is the
    step's second input, which the runner copies into a staging buffer of its own (as a JIT copies
    a host input in). ``bug`` decides at capture that the features do not depend on the step (as a
    dependence walk that misses the copy would), computes them once there and captures only the
    rest; ``fix`` captures them too. Both hoist ``doubled(w)`` (weights only: computing it once is
    right), which the run without graphs computes at every step."""

    def __init__(self, w, variant: str):
        self.x, self.side, self.w = torch.zeros(2, 3), torch.zeros(2, 3), w
        events.static_buffers("runner", {"x": self.x})
        self.w2 = doubled(w)
        self.graph = new_graph("cpu")
        if variant == "bug":
            self.feat = self.hoist()
            step = lambda: torch.relu(self.x) @ self.w2 + self.feat  # noqa: E731
        else:
            step = lambda: torch.relu(self.x) @ self.w2 + scaled_features(self.side, self.w)  # noqa: E731
        with graph(self.graph, name="step"):
            self.out = step()
        self.step = step

    def hoist(self):
        return scaled_features(self.side, self.w)

    def __call__(self, x, side):
        self.x.copy_(x)
        self.side.copy_(side)
        events.serve(self.graph, 2, 2, padded={}, outputs=self.out, eager=self.step)
        self.graph.replay()
        return self.out.clone()


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_work_the_reference_does_every_step_and_the_runner_did_once_at_capture_is_named(variant):
    """The step's eager form is the graph's own code, so differential replay agrees with the graph,
    and the features are computed from no announced buffer; the run without graphs computes them at
    every step. ``bug``'s finding is at ``hoist``, the function that computed them once, which the
    run without graphs never calls; ``doubled(w)``, hoisted by both and the same at every step, is none."""
    def workload():
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(3, 3, generator=gen)
        steps = [(torch.randn(2, 3, generator=gen), torch.randn(2, 3, generator=gen)) for _ in range(3)]
        with events.reference():
            expected = [torch.relu(x) @ doubled(w) + scaled_features(side, w) for x, side in steps]
        runner = HoistingRunner(w, variant)
        got = [runner(x, side) for x, side in steps]
        events.results(expected, got)                     # (the workload's own comparison)
        return expected, got
    finding = finding_of(workload, variant)
    if finding is None:
        return
    assert finding.kind == "warmup-divergence" and function_of(finding.location) == "hoist", finding
    assert "none once replays began" in finding.evidence, finding


def timestep_key(t, variant: str):
    key = (t.device.type, t.dtype, t.shape)
    return key + (t.item(),) if variant == "fix" else key


class KeyedDenoiser:
    """One graph per key of the step's input, as a graphed-callable cache keeps them. The timestep is
    a 0-dim host tensor, which the captured multiply takes by value; ``bug`` keys the cache on the
    tensor's device, dtype and shape only, so every timestep replays the graph captured for the
    first; ``fix`` keys on its value too."""

    def __init__(self, w, variant: str):
        self.w, self.variant, self.graphs = w, variant, {}

    def step(self, x, t):
        return torch.tanh(x @ self.w) * t

    def __call__(self, x, t):
        key = timestep_key(t, self.variant)
        if key not in self.graphs:
            sx, st = x.clone(), t.clone()
            events.static_buffers("denoiser", {"x": sx, "t": st})
            g = new_graph("cpu")
            with graph(g, name=f"denoise {len(self.graphs)}"):
                out = self.step(sx, st)
            self.graphs[key] = (g, sx, st, out)
        g, sx, st, out = self.graphs[key]
        sx.copy_(x)
        st.copy_(t)
        events.serve(g, 2, 2, padded={}, outputs=out, eager=lambda: self.step(sx, st))
        g.replay()
        return out.clone()


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_refreshed_input_taken_by_value_names_the_key_that_chose_the_graph(variant):
    """Differential replay sees the multiply run with the capture's timestep; that number is a static
    input the runner writes every step, and a key function chose the graph: ``bug``'s finding is
    ``host-work-frozen`` at ``timestep_key``, the key that cannot tell two timesteps apart."""
    def workload():
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(3, 3, generator=gen)
        steps = [(torch.randn(2, 3, generator=gen), host(torch.tensor(float(t)))) for t in (999, 666, 333, 999)]
        with events.reference():
            expected = [torch.tanh(x @ w) * t for x, t in steps]
        denoiser = KeyedDenoiser(w, variant)
        got = [denoiser(x, t) for x, t in steps]
        events.results(expected, got)
        return expected, got
    finding = finding_of(workload, variant)
    if finding is None:
        return
    assert finding.kind == "host-work-frozen" and function_of(finding.location) == "timestep_key", finding
    assert "the key that chose this graph" in finding.cause, finding


def zero_grad(grad):
    grad.zero_()


class AccumulatingTrainer:
    """A training step captured whole: the backward adds its gradient into a persistent buffer
    (gradient-accumulation fusion) and the update reads it. The run without graphs zeroes the
    buffer before every step; ``bug`` zeroes it once, eagerly, just before the capture (as a
    callback does that expects the reset to launch nothing), ``fix`` inside the capture."""

    def __init__(self, w, variant: str):
        self.w, self.x, self.grad = w.clone(), torch.zeros(2, 3), torch.zeros(3, 3)
        events.static_buffers("trainer", {"x": self.x})
        self.variant, self.graph = variant, None

    def step(self):
        if self.variant == "fix":
            zero_grad(self.grad)
        self.grad.add_(self.x.t() @ (self.x @ self.w))
        self.w.sub_(0.1 * self.grad)
        return self.w

    def optimizer_step(self, x):
        self.x.copy_(x)
        if self.graph is None:
            zero_grad(self.grad)
            self.graph = new_graph("cpu")
            with graph(self.graph, name="train"):
                self.step()
        events.serve(self.graph, 2, 2, padded={}, outputs=self.w, eager=self.step)
        self.graph.replay()
        return self.w.clone()


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_reset_the_reference_runs_every_step_and_the_runner_ran_once_before_capture_is_stale_input(variant):
    """The reset has no input that varies (a fill), so computing it once would be right if nothing
    else wrote what it wrote; but the graph reads the buffer and adds into it, so each replay starts
    from what the one before left. ``bug``'s finding is ``stale-input`` at ``optimizer_step``, the
    function that ran the reset once and which the run without graphs never calls."""
    def workload():
        gen = torch.Generator().manual_seed(0)
        w0 = torch.randn(3, 3, generator=gen) * 0.3
        xs = [torch.randn(2, 3, generator=gen) for _ in range(4)]
        with events.reference():
            w, grad, expected = w0.clone(), torch.zeros(3, 3), []
            for x in xs:
                zero_grad(grad)
                grad.add_(x.t() @ (x @ w))
                w.sub_(0.1 * grad)
                expected.append(w.clone())
        trainer = AccumulatingTrainer(w0, variant)
        got = [trainer.optimizer_step(x) for x in xs]
        events.results(expected, got)
        return expected, got
    finding = finding_of(workload, variant)
    if finding is None:
        return
    assert finding.kind == "stale-input" and function_of(finding.location) == "optimizer_step", finding
    assert "what the replay before it left" in finding.evidence, finding


def matvec(out, w, x):
    out.copy_(x @ w)


class RecordingRunner:
    """A graph built from a recorded kernel list (no stream capture): one eager pass with recording
    on, each launch site appending its kernel after launching it; the graph replays the list. Both
    projections launch the same kernel (``matvec``, one line); in ``bug`` the second launch site
    forgets to record itself, so no replay writes ``out``, which the runner hands out every step."""

    def __init__(self, w1, w2, variant: str):
        self.w1, self.w2, self.variant = w1, w2, variant
        self.x, self.h, self.out = torch.zeros(1, 3), torch.zeros(1, 3), torch.zeros(1, 3)
        self.recording, self.kernels, self.graph = False, [], None

    def first(self):
        matvec(self.h, self.w1, self.x)
        if self.recording:
            self.kernels.append((matvec, (self.h, self.w1, self.x)))

    def second(self):
        matvec(self.out, self.w2, self.h)
        if self.recording and self.variant == "fix":
            self.kernels.append((matvec, (self.out, self.w2, self.h)))

    def forward(self):
        self.first()
        self.second()

    def eager(self, x):
        self.x.copy_(x)
        self.forward()
        return self.out.clone()

    def __call__(self, x):
        self.x.copy_(x)
        if self.graph is None:
            events.static_buffers("runner", {"x": self.x})
            self.recording = True
            self.forward()
            self.recording = False
            kernels = list(self.kernels)

            def replay_list():
                for kernel, args in kernels:
                    kernel(*args)
                return self.out
            self.graph = new_graph("cpu")
            with graph(self.graph, name="decode"):
                replay_list()
            self.step = replay_list
            return self.out.clone()
        events.serve(self.graph, 1, 1, padded={}, outputs=self.out, eager=self.step)
        self.graph.replay()
        return self.out.clone()


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_kernel_one_launch_site_left_out_of_a_recorded_graph_is_named_at_that_site(variant):
    """The graph's eager form is its own kernel list, so differential replay agrees with it; the run
    without graphs launches ``matvec``'s line twice a step, the served run's replays once. The graph
    hands out ``out``, which none of its ops writes: every replay hands out what the recording pass
    left. The site is the launch site that recorded nothing (``second``), not the kernel's line,
    which the graph replays from the other site, nor the runner that recorded."""
    def workload():
        gen = torch.Generator().manual_seed(0)
        w1, w2 = torch.randn(3, 3, generator=gen), torch.randn(3, 3, generator=gen)
        steps = [torch.randn(1, 3, generator=gen) for _ in range(4)]
        eager = RecordingRunner(w1, w2, variant)
        with events.reference():
            expected = [eager.eager(x) for x in steps]
        runner = RecordingRunner(w1, w2, variant)
        got = [runner(x) for x in steps]
        events.results(expected, got)
        return expected, got
    finding = finding_of(workload, variant)
    if finding is None:
        return
    assert finding.kind == "warmup-divergence" and function_of(finding.location) == "second", finding
    assert "as an output no op of theirs writes" in finding.evidence, finding


class FallbackRunner:
    """Tries to capture a step that reads a scale on the host (``.item()``, refused in a capture);
    when the capture fails, ``fix`` runs every step eagerly (a fallback), ``bug`` keeps serving the
    output buffer the failed capture left, unwritten since."""

    def __init__(self, variant: str):
        self.x, self.variant, self.out = torch.zeros(2, 3), variant, None
        events.static_buffers("runner", {"x": self.x})
        g = new_graph("cpu")
        try:
            with graph(g, name="step"):
                self.out = self.step()
            self.graph = g
        except CaptureError:
            self.graph = None
            self.out = torch.zeros(2, 3)

    def step(self):
        return self.x * self.x.abs().max().item()

    def __call__(self, x):
        self.x.copy_(x)
        if self.graph is not None:
            self.graph.replay()
            return self.out.clone()
        return self.step() if self.variant == "fix" else self.out.clone()


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_refused_capture_the_workload_falls_back_from_is_a_note_when_its_results_agree(variant):
    """Both capture attempts are refused for the host read. ``fix`` falls back to eager steps and
    gives the run without graphs' results: the refusal is a note (falling back is a fix idiom).
    ``bug`` serves what the failed capture left: its results differ, and the refusal is the finding."""
    def workload():
        gen = torch.Generator().manual_seed(0)
        steps = [torch.randn(2, 3, generator=gen) for _ in range(3)]
        with events.reference():
            expected = [x * x.abs().max().item() for x in steps]
        runner = FallbackRunner(variant)
        got = [runner(x) for x in steps]
        events.results(expected, got)
        return expected, got
    expected, got = workload()
    assert all(torch.equal(e, g) for e, g in zip(expected, got)) == (variant == "fix")
    report = doctor.diagnose(workload)
    if variant == "fix":
        assert report.findings == [] and any("handled, not reported" in n for n in report.notes), report
    else:
        assert [f.kind for f in report.findings] == ["sync-in-capture"], report


class RotatingScratch:
    """A step that stages its input in a scratch buffer taken from a rotating free list (bounce
    pages): the graph keeps the one its capture took, its eager form takes the next one. The scratch
    is written whole before it is read, in every run: which one a step uses changes nothing."""

    def __init__(self):
        self.free = [torch.zeros(2, 3) for _ in range(2)]
        self.x = torch.zeros(2, 3)
        events.static_buffers("runner", {"x": self.x})
        with events.warmup():
            self.step()
        self.graph = new_graph("cpu")
        with graph(self.graph, name="step"):
            self.out = self.step()

    def step(self):
        scratch = self.free.pop(0)
        self.free.append(scratch)
        scratch.copy_(self.x)
        return scratch.flip(0) * 2

    def __call__(self, x):
        self.x.copy_(x)
        events.serve(self.graph, 2, 2, padded={}, outputs=self.out, eager=self.step)
        self.graph.replay()
        return self.out.clone()


def test_state_an_eager_step_stages_elsewhere_is_no_finding_when_the_results_agree():
    """Differential replay sees the graph's scratch keep other values than the eager step leaves in
    it, including at the first replay, which serves the capture's own batch again and is paired with
    no step of the run without graphs. The workload's results equal that run's: held, a note."""
    def workload():
        gen = torch.Generator().manual_seed(0)
        steps = [torch.zeros(2, 3)] + [torch.randn(2, 3, generator=gen) for _ in range(3)]
        with events.reference():
            expected = [x.flip(0) * 2 for x in steps]
        runner = RotatingScratch()
        got = [runner(x) for x in steps]
        events.results(expected, got)
        return expected, got
    finding_of(workload, "fix")


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_an_input_announced_as_a_slice_taken_for_the_announcement_is_still_watched(variant):
    """Each capture size announces its slice of one input (``delta[:bs]``, a view nobody keeps: it
    goes with the announcement) and the smaller size's slice after the larger's. The runner refreshes
    ``delta`` only after a step that had one (a flag): a text step after a shrink leaves rows an image
    step wrote, which the size-8 graph reads. The buffer is watched whole for as long as its memory
    lives: ``stale-input``; the fix refreshes every row the graph reads."""
    from workbench.zoo.kit import capture, replay

    def workload():
        ids, delta = torch.zeros(8), torch.zeros(8)
        graphs, dirty = {}, [False]
        for bs in (8, 4):
            graphs[bs] = capture(lambda bs=bs: ids[:bs] * 2 + delta[:bs], device="cpu", name=f"bs {bs}",
                                 static={"ids": ids[:bs], "delta": delta[:bs]})
        steps = [(torch.arange(8.0), torch.tensor([0, 0, 0, 0, 0, 3.0, 0, 0])),
                 (torch.arange(4.0) + 10, torch.zeros(4)), (torch.arange(8.0) + 20, torch.zeros(8))]
        with events.reference():
            expected = [x * 2 + d for x, d in steps]
        got = []
        for x, d in steps:
            bs, has = x.shape[0], bool(d.any())
            ids[:bs] = x
            if variant == "fix" or has or dirty[0]:
                delta[:bs] = d
            dirty[0] = has
            g, out = graphs[bs]
            got.append(replay(g, out).clone())
        events.results(expected, got)
        return expected, got
    finding = finding_of(workload, variant)
    if finding is not None:
        assert finding.kind == "stale-input" and finding.graph == "bs 8", finding


def shifted(x, pos, w):
    return (x + pos[:, None]) @ w


class CaptureOnCall:
    """A wrapper that captures on the first call of each shape and replays for that call too (as
    HPU's ``wrap_in_hpu_graph`` does): static ``x`` and ``pos``, cloned from the first call."""

    def __init__(self, w):
        self.w, self.graphs = w, {}

    def __call__(self, x, pos):
        if x.shape not in self.graphs:
            static = {"x": x.clone(), "pos": pos.clone()}
            events.static_buffers("wrapper", static)
            g = new_graph("cpu")
            with graph(g, name=f"rows {x.shape[0]}"):
                out = shifted(static["x"], static["pos"], self.w)
            self.graphs[x.shape] = (g, static, out)
        g, static, out = self.graphs[x.shape]
        static["x"].copy_(x)
        static["pos"].copy_(pos)
        events.serve(g, x.shape[0], x.shape[0], padded={}, outputs=out,
                     eager=lambda: shifted(static["x"], static["pos"], self.w))
        g.replay()
        return out.clone()


def test_a_capture_replayed_for_its_own_dummy_call_is_no_step_of_the_reference():
    """The served run warms the wrapper up with a dummy call (zeros, the real steps' positions),
    which captures and replays; the run without graphs makes no dummy call. Aligned by the count,
    the dummy replay would be the reference's first step, which shares its positions and not its
    data: a finding on a correct runner. Its inputs are the capture's own, so it is no step."""
    def workload():
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(3, 3, generator=gen)
        pos = torch.arange(2.0)
        xs = [torch.randn(2, 3, generator=gen) for _ in range(3)]
        with events.reference():
            expected = [shifted(x, pos, w) for x in xs]
        wrapper = CaptureOnCall(w)
        wrapper(torch.zeros(2, 3), pos)                    # warm-up: the dummy call captures
        got = [wrapper(x, pos) for x in xs]
        events.results(expected, got)
        return expected, got
    expected, got = workload()
    assert all(torch.equal(e, g) for e, g in zip(expected, got))
    report = doctor.diagnose(workload)
    assert report.findings == [] and report.clean, report


def embed_token(tok, table):
    return table[tok]


def decode_head(x, cache, w):
    return (x + cache) @ w


class BoundCacheDecoder:
    """Static ``tok``, read only by the embedding, outside ``decode_head`` (the graph's root, which
    the run without graphs calls once a step): no static input ties a replay to its step. The graph
    binds the cache of the ``generate`` that captured it; ``bug`` keeps the graph for later calls,
    each with a fresh cache, ``fix`` drops it at the end of each call."""

    def __init__(self, table, w, variant: str):
        self.table, self.w, self.variant, self.graph = table, w, variant, None
        self.tok = torch.zeros(1, dtype=torch.long)
        events.static_buffers("decoder", {"tok": self.tok})

    def forward(self):
        return decode_head(embed_token(self.tok, self.table), self.cache, self.w)

    def step(self, tok):
        if self.graph is None:
            self.graph = new_graph("cpu")
            with graph(self.graph, name="decode"):
                self.out = self.forward()
        self.tok.copy_(tok)
        events.serve(self.graph, 1, 1, padded={}, outputs=self.out, eager=self.forward)
        self.graph.replay()
        return self.out.clone()

    def generate(self, prompt, toks):
        if self.graph is None:
            self.cache = prompt.clone()               # this call's cache, which a capture binds
        outs = [self.step(t) for t in toks]
        if self.variant == "fix":
            self.graph = None
        return outs


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_replay_no_static_input_ties_to_a_step_is_aligned_by_the_count(variant):
    """Nothing under the root is a static input, so each replay is compared with the reference's
    call at the served run's count: the second ``generate``'s replays read the first call's cache,
    a tensor the graph only reads, where the run without graphs reads the new one. (Had the second
    call repeated the first one's tokens, its replays would give the first call's answers, which a
    call near the count gives too: the count is then no evidence, and nothing is claimed.)"""
    def workload():
        gen = torch.Generator().manual_seed(0)
        table, w = torch.randn(5, 3, generator=gen), torch.randn(3, 3, generator=gen)
        prompts = [torch.randn(1, 3, generator=gen) for _ in range(2)]
        toks = [[torch.tensor([1]), torch.tensor([3])], [torch.tensor([2]), torch.tensor([4])]]
        with events.reference():
            expected = [decode_head(embed_token(t, table), p, w) for p, ts in zip(prompts, toks) for t in ts]
        decoder = BoundCacheDecoder(table, w, variant)
        got = [o for p, ts in zip(prompts, toks) for o in decoder.generate(p, ts)]
        events.results(expected, got)
        return expected, got
    finding = finding_of(workload, variant)
    if finding is None:
        return
    assert finding.kind == "warmup-divergence" and "call 3 of decode_head" in finding.evidence, finding


class Rope:
    """A position table warmed up for 4 positions and grown lazily for longer sequences."""

    def __init__(self):
        self.table = torch.arange(4.0)

    def get(self, positions: int) -> torch.Tensor:
        if positions > self.table.numel():
            self.table = torch.arange(float(positions)) * 0.5       # (inside a capture: recorded, never run)
        return self.table


def decode(rope: Rope, x: torch.Tensor) -> torch.Tensor:
    return rope.get(2)[:2] * x


def _rope_steps(variant: str):
    """A graph traced once at the longest length to size memory (``bug``: it grows the table inside
    that trace) and discarded unreplayed; the decode graph then reads the module's table."""
    from workbench.zoo.kit import capture, compare, replay

    xs = [torch.randn(2, generator=torch.Generator().manual_seed(20 + i)) for i in range(3)]

    def served():
        rope, x = Rope(), torch.zeros(2)
        if variant == "bug":
            estimate, _ = capture(lambda: rope.get(8)[:2] * x, device="cpu", static={"x": x}, warmups=0,
                                  name="estimate")
            del estimate
        g, out = capture(lambda: decode(rope, x), device="cpu", static={"x": x}, warmups=0, name="decode")
        outs = []
        for step in xs:
            x.copy_(step)
            outs.append(replay(g, out).clone())
        return outs

    def eager():
        rope = Rope()
        return [decode(rope, step) for step in xs]

    return lambda: compare("rope", variant, "cpu", served, eager)


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_tensor_a_discarded_capture_made_and_no_kernel_computed_is_named_where_it_was_made(variant):
    """The decode graph reads a table another capture made and bound on the module; that graph never
    replayed, so nothing computed it, and the run without graphs reads its warmed-up table:
    ``warmup-divergence`` at the line that made it inside that capture."""
    finding = only_finding(_rope_steps(variant), variant)
    if finding is None:
        return
    assert finding.kind == "warmup-divergence" and function_of(finding.location) == "get"
    assert "self.table = torch.arange(float(positions)) * 0.5" in finding.source
    assert "the capture of estimate made it" in finding.evidence and "never replayed" in finding.evidence


def cast(w: torch.Tensor) -> torch.Tensor:
    return w * 2


def use(cached: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return cached + x


def _cached_outputs(variant: str):
    """Two models share a graph that casts their weights (a miss) and a graph that reads a cast each
    model cached (a hit). ``bug``: the cache keeps the cast graph's output itself, which its next
    replay, for the other model, overwrites; ``fix``: a copy."""
    from workbench.zoo.kit import capture, compare, replay

    weights = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])]
    xs = [torch.randn(2, generator=torch.Generator().manual_seed(30 + i)) for i in range(2)]

    def served():
        w, x, cache = weights[0].clone(), torch.zeros(2), {}
        miss, made = capture(lambda: cast(w), device="cpu", static={"w": w}, warmups=0, name="cast")
        for model, weight in enumerate(weights):
            w.copy_(weight)
            out = replay(miss, made)
            cache[model] = out if variant == "bug" else out.clone()
        hit, used = capture(lambda: use(cache[0], x), device="cpu", static={"x": x}, warmups=0, name="use")
        outs = []
        for step in xs:
            x.copy_(step)
            outs.append(replay(hit, used).clone())
        return outs

    def eager():
        cache = {model: cast(weight) for model, weight in enumerate(weights)}
        return [use(cache[0], step) for step in xs]

    return lambda: compare("cached", variant, "cpu", served, eager)


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_graph_output_cached_past_its_graphs_next_replay_is_overwritten_where_it_was_made(variant):
    """The hit graph reads the cast graph's output, which holds the other model's cast: the cast
    graph's own replays gave the eager steps' answers, so the values are another step's, kept past
    the replay that overwrote them: ``overwritten-output`` at the line that made the output."""
    finding = only_finding(_cached_outputs(variant), variant)
    if finding is None:
        return
    assert finding.kind == "overwritten-output" and function_of(finding.location) == "cast"
    assert "it is an output of cast" in finding.evidence and "gave the eager steps' answers" in finding.evidence


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_number_frozen_at_capture_against_a_zero_the_step_now_passes_is_named_at_its_op(variant):
    """A scale captured as a Python number (2.0) in a graph reused after the step set it to 0 and
    then to 1 (``bug``), or re-captured when it changes (``fix``): a captured number against one of
    the numbers any code holds is evidence too, unless the layout explains it."""
    from workbench.zoo.kit import capture, compare, replay

    def scaled(x, scale):
        return torch.mul(x, scale)

    steps = [(torch.arange(4.0) + k, scale) for k, scale in enumerate((2.0, 0.0, 1.0))]

    def run():
        def served():
            x, graphs, outs = torch.zeros(4), {}, []
            for data, scale in steps:
                x.copy_(data)
                key = 4 if variant == "bug" else (4, scale)         # the reuse check: shape alone (bug)
                if key not in graphs:
                    graphs[key] = capture(lambda s=scale: scaled(x, s), device="cpu", name="scale", static={"x": x})
                outs.append(replay(*graphs[key]).clone())
            return outs

        return compare("frozen scale", variant, "cpu", served, lambda: [scaled(d, s) for d, s in steps])

    assert run().verdict == ("misbehaves" if variant == "bug" else "equals eager")
    report = doctor.diagnose(run)
    if variant == "fix":
        assert report.findings == [], report
        return
    (finding,) = report.findings
    assert finding.kind == "host-work-frozen" and " in scaled: " in finding.source, finding
    assert "runs with 2.0 in the graph where the reference step passes 0.0" in finding.evidence, finding


def _fix_of_trial(part: str):
    """The doctor's report on the fix of the held-out trial program whose name holds ``part``."""
    name = next(n for n in trials.names() if part in n)
    return doctor.diagnose(lambda: trials.program(name).run("fix", "cpu"))


def test_work_a_warmup_runs_only_when_not_capturing_is_a_note_when_the_results_agree():
    """Newton's conjugate-gradient loop reads its convergence back on the host only when not capturing
    (its fix takes the capture-safe loop under capture): the warmup ran a line the capture never ran,
    and differential replay sees the solver's scratch state differ (the eager step stopped early),
    which no replay's outputs bear out. The workload's results agree with its run without graphs:
    the skipped host decision changed none of them, a note."""
    report = _fix_of_trial("newton_3501")
    assert report.findings == [], report
    assert any("changed none of them" in n for n in report.notes), report.notes


def test_padded_rows_seen_writing_state_are_held_while_results_agree():
    """Two-batch overlap splits a padded batch in two, and each half flattens its tokens' top-2
    expert ids into one index as long as the whole batch: the padded-row write probe, taking its
    leading entries for the batch's real rows, sees "padded rows" change expert counts that real
    tokens wrote. State a padded eager step writes is held like other state: the workload says its
    results agree with its run without graphs (the fix of the TBO count placement), so a note."""
    report = _fix_of_trial("sglang_28337")
    assert report.findings == [], report
    assert any("held until a replay bore them out (stale-padding" in n for n in report.notes), report


def test_a_batch_split_otherwise_than_the_reference_split_it_is_no_evidence_once_results_agree():
    """A dual-batch-overlap runner splits a padded batch into micro-batches (six tokens padded to
    eight: four and four, two of them padding) where its run without graphs splits the six real
    tokens three and three: a replay's real rows are not those of the reference call of the same
    count, and no reference call holds what it read. The workload says its results agree with that
    run (``events.results``, as the zoo's ``compare`` does): the pairing was wrong, a note."""
    report = _fix_of_trial("vllm_29933")
    assert report.findings == [], report
    assert any("calls paired by their count" in n for n in report.notes), report


class _HostGenerator:
    """A random generator whose offset lives on the host, as torch's CUDA generator's does: a capture
    reads it through a device tensor that the runner refills before each replay (then advancing the
    host offset: what ``CUDAGraph.replay`` does first); the bug reads it as a number at capture."""

    def __init__(self, variant):
        self.variant, self.offset, self.device_offset = variant, 0, torch.zeros(())

    def draw(self, n):
        if is_capturing() and self.variant == "fix":
            start = self.device_offset
        else:
            start, self.offset = self.offset, self.offset + n
        return torch.sin((torch.arange(n) + start) * 12.9898)

    def replay_prologue(self, n):
        self.device_offset.fill_(self.offset)
        self.offset += n


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_first_replay_of_the_captures_own_batch_is_held_as_the_paired_ones_are(variant):
    """The runner advances the generator for a replay before announcing it, so differential replay's
    eager step draws the next numbers (no evidence against the replay). The first replay serves
    the batch the capture ran on, rewritten with the same data: no step of the run without graphs
    to pair it with. Its findings are held as the paired replays' are, and go once every replay
    gave that run's answers (fix); a graph that froze the offset at capture gives other answers and
    is reported (bug)."""
    inputs = [torch.tensor([1.0, 2.0, 3.0]) * (k + 1) for k in range(3)]

    def workload():
        x = torch.zeros(3)

        def step(gen):
            return x * 2 + gen.draw(3)
        with events.reference():
            gen, expected = _HostGenerator(variant), []
            for k in range(3):
                x.copy_(inputs[k])
                expected.append(step(gen).clone())
        gen = _HostGenerator(variant)
        events.static_buffers("runner", {"x": x})
        x.copy_(inputs[0])
        with events.warmup():
            step(gen)
        g = new_graph("cpu")
        with graph(g, name="sample"):
            out = step(gen)
        gen.offset, got = 0, []
        for k in range(3):
            x.copy_(inputs[k])
            gen.replay_prologue(3)
            events.serve(g, 3, 3, outputs=out, eager=lambda: step(gen))
            g.replay()
            got.append(out.clone())
        events.results(expected, got)
    report = doctor.diagnose(workload)
    if variant == "fix":
        assert report.findings == [], report
    else:
        assert [f.kind for f in report.findings][:1] == ["host-work-frozen"], report


def block_size(lens):
    """A lazy set-up's own kernels: the block size from the batch's lengths."""
    total = lens.sum()
    return (total // 4 + 1).reshape(1)


def blocked_decode(q, lens, state):
    """The block size is set up on the step's state object the first time the step sees it."""
    if not hasattr(state, "block"):
        state.block = block_size(lens)
    return q * state.block + lens


class LazyStateRunner:
    """Static ``q``, ``lens`` and one state object. The warmup runs the lazy set-up on the state, so
    the capture finds it done and records only the multiply; ``fix`` takes the set-up's result off
    the state before capturing, so the capture records the set-up too."""

    def __init__(self, variant: str):
        self.q, self.lens, self.state = torch.zeros(2), torch.zeros(2, dtype=torch.long), types.SimpleNamespace()
        events.static_buffers("runner", {"q": self.q, "lens": self.lens})
        with events.warmup():
            blocked_decode(self.q, self.lens, self.state)
        if variant == "fix":
            del self.state.block
        self.graph = new_graph("cpu")
        with graph(self.graph, name="decode"):
            self.out = blocked_decode(self.q, self.lens, self.state)

    def __call__(self, q, lens):
        self.q.copy_(q)
        self.lens.copy_(lens)
        events.serve(self.graph, 2, 2, padded={}, outputs=self.out,
                     eager=lambda: blocked_decode(self.q, self.lens, self.state))
        self.graph.replay()
        return self.out.clone()


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_lazy_set_up_only_the_reference_runs_is_named_at_the_branch_that_called_it(variant):
    """The run without graphs makes a new state object at every step, so its lazy set-up runs
    every step; the capture found it done by the warmup. Where the two traces part, the reference
    runs the set-up's kernels: named at the line of the step that called into the set-up, where the
    two paths left each other, not at the set-up's first kernel."""
    def workload():
        steps = [(torch.tensor([1.0, 2.0]), torch.tensor([n, n + 3])) for n in (5, 9, 13)]
        with events.reference():
            expected = [blocked_decode(q, lens, types.SimpleNamespace()) for q, lens in steps]
        runner = LazyStateRunner(variant)
        got = [runner(q, lens) for q, lens in steps]
        events.results(expected, got)
        return expected, got
    finding = finding_of(workload, variant)
    if finding is None:
        return
    assert finding.kind == "warmup-divergence" and function_of(finding.location) == "blocked_decode", finding


class TensorDictLike(dict):
    """A dict subclass with methods of its own (a tensordict's ``update``, a registry's ``items``):
    the doctor, walking it and putting back what the eager step rebound in it, must call none."""

    def update(self, other, **_):
        raise AssertionError("the doctor called the program's own update()")

    def items(self):
        raise AssertionError("the doctor called the program's own items()")

    values = keys = items


def act(td):
    """A policy that writes its action into the dict it is given, beside a tensor of the same shape."""
    td["action"] = torch.tanh(td["obs"]) + td["noise"]
    return td


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_step_returning_a_dict_is_compared_with_the_reference_by_key(variant):
    """The graph hands out the action alone; the step's root returns a dict that holds the noise,
    of the action's shape, before it. Each replay is compared with the reference's ``action`` (the
    key it sat at when captured), not with the first tensor of its shape: the fix agrees with the
    run without graphs and is clean; the bug, which never refreshes the noise, does not."""
    gen = torch.Generator().manual_seed(7)
    steps = [(torch.randn(2, generator=gen), torch.randn(2, generator=gen)) for _ in range(3)]

    def workload():
        with events.reference():
            expected = [act(TensorDictLike(obs=o, noise=n))["action"].clone() for o, n in steps]
        static = TensorDictLike(obs=torch.zeros(2), noise=torch.zeros(2))
        events.static_buffers("policy", {"obs": static["obs"], "noise": static["noise"]})
        with events.warmup():
            act(TensorDictLike(static))
        g = new_graph("cpu")
        with graph(g, name="policy"):
            out = act(static)["action"]
        got = []
        for o, n in steps:
            static["obs"].copy_(o)
            if variant == "fix":
                static["noise"].copy_(n)
            events.serve(g, 2, 2, padded={}, outputs=out, eager=lambda: act(static)["action"])
            g.replay()
            got.append(out.clone())
        events.results(expected, got)
    report = doctor.diagnose(workload)
    assert report.failure is None, report
    if variant == "fix":
        assert report.findings == [] and "differ" not in report.headline(), report
    else:
        assert report.findings or "differ" in report.headline(), report


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_check_that_fails_only_on_the_dummy_batch_is_named_at_the_check(variant):
    """vLLM's fast-prefill metadata asserted that the logits indices are set: every real step sets
    them, the dummy batch a runner warms up and captures on does not, so serving with graphs fails in
    the warmup, and the run without graphs never does. ``fix`` accepts None (the forward then keeps
    every row, as a uniform decode needs)."""
    x = torch.zeros(4)

    class Metadata:
        def __init__(self, indices):
            if variant == "bug":
                assert indices is not None, "logits indices"
            self.indices = indices

    def forward(meta):
        out = x * 2 + 1
        return out if meta.indices is None else out.index_select(0, meta.indices)

    def workload():
        steps = [torch.randn(4, generator=torch.Generator().manual_seed(i)) for i in range(3)]
        with events.reference():
            expected = []
            for v in steps:
                x.copy_(v)
                expected.append(forward(Metadata(torch.arange(4))))
        with events.warmup():
            forward(Metadata(None))
        g = new_graph("cpu")
        with graph(g, name="decode"):
            out = forward(Metadata(None))
        got = []
        for v in steps:
            x.copy_(v)
            g.replay()
            got.append(out.clone())
        events.results(expected, got)
        return got

    report = doctor.diagnose(workload)
    if variant == "fix":
        assert report.findings == [] and not report.errors, report
        return
    (finding,) = report.findings
    assert finding.kind == "warmup-divergence" and "in __init__: assert indices is not None" in finding.source, finding
    assert "failed during warmup" in finding.evidence, finding


def _wrapped_for_capture(variant):
    """A graph helper wraps a module's forward in the mode the capture needs (a scale of 2, as an
    FP8 context) and leaves the wrapper bound (``bug``) or restores the forward once captured
    (``fix``); the workload then calls the module itself, outside any graph, expecting its own mode."""
    from workbench.zoo.kit import capture, compare, replay
    w = torch.tensor([1.0, -2.0, 0.5])
    xs = [torch.randn(3, generator=torch.Generator().manual_seed(40 + i)) for i in range(2)]

    class Block:
        scale = 1.0

        def forward(self, x):
            return x * w * self.scale

    def graphed(block, x):
        def wrap_for_capture(block):
            old_forward = block.forward

            def forward_in_mode(x):
                block.scale = 2.0
                try:
                    return old_forward(x)
                finally:
                    block.scale = 1.0
            block.forward = forward_in_mode
            return old_forward

        old = wrap_for_capture(block)
        g, out = capture(lambda: block.forward(x), device="cpu", static={"x": x}, warmups=1, name="block")
        if variant == "fix":
            block.forward = old
        return g, out

    def served():
        block, x = Block(), torch.zeros(3)
        g, out = graphed(block, x)
        outs = []
        for step in xs:
            x.copy_(step)
            outs.append(replay(g, out).clone())
            outs.append(block.forward(step))          # the module itself, in its own mode
        return outs

    def eager():
        block = Block()
        outs = []
        for step in xs:
            block.scale = 2.0
            outs.append(block.forward(step))
            block.scale = 1.0
            outs.append(block.forward(step))
        return outs

    return lambda: compare("wrapped", variant, "cpu", served, eager)


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_wrapper_bound_for_the_capture_and_left_on_the_module_is_named_where_it_was_made(variant):
    """The replays give the reference's answers; the module's own eager calls go through the
    wrapper the capture needed, which the run without graphs never calls: ``warmup-divergence``
    where the wrapper is defined (the function that installed it)."""
    finding = only_finding(_wrapped_for_capture(variant), variant)
    if finding is None:
        return
    assert finding.kind == "warmup-divergence" and function_of(finding.location) == "wrap_for_capture", finding
    assert "forward_in_mode" in finding.evidence and "never calls it" in finding.evidence


def _profiled_counter(variant):
    """Both runs make one dummy step first (the served run as its graph's warmup, the run without
    graphs as its profile step): a running count in persistent state builds on it in both. The graph
    hands its output out as float32 (``bug``: the workload's runs then differ, the count being off by
    the dummy step in the served run only; ``fix``: they agree), so no replay can be set beside its
    step of the run without graphs, whose ``step`` returns float64."""
    from workbench.zoo.kit import capture, compare, replay
    xs = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 1.0]), torch.tensor([2.0, 2.0])]

    def step(count, x):
        count.add_(x.sum())
        return x * count

    def served():
        count, x = torch.zeros((), dtype=torch.float64), torch.ones(2, dtype=torch.float64)
        events.persistent_state("counter", {"count": count})
        g, out = capture(lambda: step(count, x).float(), device="cpu", static={"x": x}, warmups=1, name="step")
        outs = []
        for v in xs:
            x.copy_(v)
            outs.append(replay(g, out).clone())
        return outs

    def eager():
        count = torch.zeros((), dtype=torch.float64)
        if variant == "fix":
            step(count, torch.ones(2, dtype=torch.float64))      # the profile step
        return [step(count, v.double()) for v in xs]

    return lambda: compare("counter", variant, "cpu", served, eager)


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_what_a_step_would_give_from_the_state_before_the_warmups_waits_for_the_workloads_results(variant):
    """The step's answer from the state before the warmups differs from the replay's (the count
    built on the dummy step). No replay could be set beside its step of the run without graphs, so
    that is held until the workload's results say: they agree (``fix``, the run without graphs made
    the same dummy step): no finding; they differ (``bug``): ``persistent-mutation`` at the count."""
    finding = only_finding(_profiled_counter(variant), variant)
    if finding is None:
        return
    assert finding.kind == "persistent-mutation" and "state before the warmups" in finding.evidence, finding


# ------------------------------------------------------------------ a buffer one graph makes and eager code fills
def before_attention(x, w):
    h = torch.tanh(x @ w)
    return h, torch.empty_like(h)


def before_attention_zeroed(x, w):
    h = torch.tanh(x @ w)
    return h, torch.zeros_like(h)


def attention(h, cache, lens):
    return torch.stack([cache[i, :n].mean(0) * h[i] for i, n in enumerate(lens)])


def after_attention(h, attn_output, w):
    return (h + attn_output) @ w


class SplitAtAttention:
    """A step captured as two graphs with eager attention between them, as a runner that splits at
    attention does: ``before`` makes the attention output (``torch.empty_like``: no op of it writes
    that memory), the eager attention fills it, ``after`` reads it as its static input. The host
    lengths the attention reads are set per step; ``bug``: they stay the capture's dummy lengths.
    ``zeroed``: ``before`` zeroes the attention output, and ``after`` is not told it reads it."""

    def __init__(self, w, cache, variant: str, zeroed: bool = False):
        from workbench.zoo.kit import capture
        self.w, self.cache, self.variant = w, cache, variant
        self.x, self.lens = torch.zeros(2, 3), [CONTEXT, CONTEXT]
        pool = graph_pool_handle("cpu")
        first = before_attention_zeroed if zeroed else before_attention
        self.before, self.mid = capture(lambda: first(self.x, w), device="cpu", pool=pool, name="before",
                                        static={"x": self.x})
        self.attend(*self.mid)
        self.after, self.out = capture(lambda: after_attention(*self.mid, w), device="cpu", pool=pool, name="after",
                                       static=None if zeroed else {"attn_output": self.mid[1]})

    def attend(self, h, out):
        out[...] = attention(h, self.cache, self.lens)

    def __call__(self, x, lens):
        from workbench.zoo.kit import replay
        if self.variant == "fix":
            self.lens = lens
        self.x.copy_(x)
        h, out = replay(self.before, self.mid)
        self.attend(h, out)
        return replay(self.after, self.out).clone()


@pytest.mark.parametrize("zeroed", [False, True])
@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_buffer_one_graph_makes_and_eager_code_fills_is_the_next_graphs_input_at_every_step(variant, zeroed):
    """The attention output lives in ``before``'s pool, and the eager attention writes it at every
    step: that write is this step's input to ``after``. So ``after``'s first replay is a step of the
    reference (not its capture's batch replayed: something was written), and the bug's lengths are
    found there, once the workload's results differ too, at the write that prepared the input
    otherwise -- not as an input the step never wrote. Where ``before`` zeroes the buffer and
    ``after`` reads it unannounced (its first replay, with no input written, is its capture's batch),
    the same: the eager write since ``before``'s replay, not an output of ``before`` kept past its
    next replay."""
    def workload():
        gen = torch.Generator().manual_seed(3)
        w, cache = torch.randn(3, 3, generator=gen), torch.randn(2, CONTEXT, 3, generator=gen)
        steps = [(torch.randn(2, 3, generator=gen), lens) for lens in ([3, 5], [4, 6])]
        with events.reference():
            expected = []
            for x, lens in steps:
                h, _ = before_attention(x, w)
                expected.append(after_attention(h, attention(h, cache, lens), w))
        runner = SplitAtAttention(w, cache, variant, zeroed)
        got = [runner(x, lens) for x, lens in steps]
        events.results(expected, got)
        return expected, got

    finding = finding_of(workload, variant)
    if finding is None:
        return
    assert finding.kind == "warmup-divergence" and " in attend: " in finding.source, finding
    assert "wrote none" not in finding.evidence and ("replay 1 of after" in finding.evidence or zeroed), finding
    assert ("written since that graph's replay" in finding.evidence) == zeroed, finding


def test_a_reference_call_of_another_batch_size_agrees_with_no_replay():
    """A replay aligned by the count alone gives way to a near call that gives its answer; a call the
    replay's outputs cannot be compared with (another batch size: a padded step's neighbour) gives
    none, although nothing differs between them either."""
    from workbench.doctor.probes.compare import agrees, differs_from
    nan_rows = [torch.full((3, 2), float("nan"))]
    assert differs_from(nan_rows, [torch.zeros(4, 2)]) is None and not agrees(nan_rows, [torch.zeros(4, 2)])
    assert agrees([torch.ones(3, 2)], [torch.ones(3, 2)]) and not agrees(nan_rows, [torch.zeros(3, 2)])


class Prefetching(Runner):
    """After each replay the runner writes the next step's lengths ahead (every request one token
    longer), through the update it syncs with before each replay, which rewrites what it guessed
    wrong (a request that did not grow). ``bug``: the sync is skipped: the guess is replayed."""

    def update(self, lens):
        self.lens.copy_(lens)

    def __call__(self, q, lens):
        self.q.copy_(q)
        if self.variant == "fix":
            self.update(lens)
        out = self.replayed()
        self.update(lens + 1)
        return out


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_data_a_runner_writes_ahead_and_corrects_before_the_replay_is_no_finding_where_replays_agree(variant):
    """The fix's sync overwrites the guessed length of the request that did not grow before any
    replay read it: data lost, by the same line, is what a builder run once per consumer on one
    buffer looks like too; with a run without graphs whose answers every replay gives, it is no
    finding (held, and noted). The bug replays the guess, and the lengths are found where the guess
    was written."""
    def workload():
        cache = _cache()
        steps = [(_queries(i), torch.tensor(lens)) for i, lens in enumerate(([3, 5], [4, 6], [4, 7]))]
        with events.reference():
            expected = [attend(q, cache, lens, int(lens.max())) for q, lens in steps]
        runner = Prefetching(cache, variant, lens=(3, 5))
        got = [runner(q, lens) for q, lens in steps]
        events.results(expected, got)
        return expected, got

    finding = finding_of(workload, variant)
    if finding is None:
        report = doctor.diagnose(workload)
        assert any("held until a replay bore them out" in n and "never reaches a reader" in n for n in report.notes)
        return
    assert finding.kind == "warmup-divergence" and "self.update(lens + 1)" in finding.source, finding


def test_what_a_graph_whose_replays_all_agree_was_held_for_stays_held_where_another_graphs_replays_part():
    """Two runners, serving one after the other: ``ahead`` writes lengths ahead and corrects them
    (its replays give the run without graphs' answers), ``stale`` omits its lengths (its replays part).
    The workload's results differ, but where ``stale``'s replays do: what was held for ``ahead`` is
    noted, not reported."""
    def workload():
        cache = _cache()
        lengths = ([3, 5], [4, 6], [4, 7])
        steps = [(_queries(i), torch.tensor(lens)) for i, lens in enumerate(lengths)]
        with events.reference():
            expected = [attend(q, cache, lens, int(lens.max())) for _ in range(2) for q, lens in steps]
        ahead = Prefetching(cache, "fix", lens=(3, 5), name="ahead")
        stale = OmittingRunner(cache, "bug", name="stale")
        got = [r(q, lens) for r in (ahead, stale) for q, lens in steps]
        events.results(expected, got)
        return expected, got

    report = doctor.diagnose(workload)
    assert report.findings and all(f.graph == "stale" for f in report.findings), report
    assert any(n.startswith("ahead: ") and "the results part where stale did not" in n for n in report.notes), report


def head_means(q, cache, lens, max_len: int):
    """Each row's mean over its first ``max_len // 2`` entries, times the row: a width Python decides.
    The slice is the whole row at the capture's width, so its ``reshape`` is a view there and a copy
    at a narrower one: the same line launches other kernels."""
    n = max_len // 2
    count = torch.full((1,), float(n), dtype=q.dtype)
    flat = q[:, :n].reshape(-1)
    return flat.view(q.shape[0], n).sum(1, keepdim=True) / count * q


def head_means_masked(q, cache, lens, max_len: int):
    """The fix: the width read from ``lens`` on the device."""
    n = lens.max() // 2
    width = (torch.arange(q.shape[1]) < n).to(q.dtype)
    return (q * width).sum(1, keepdim=True) / n * q


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_width_frozen_at_capture_where_the_traces_part_inside_one_line_is_the_number(variant):
    """The bug's graph keeps the capture's width (4, the whole row), the step wants 2 or 3: the
    launch traces part at the ``reshape`` (a view in the graph, a copy eagerly), inside one line,
    where Python took no other path; the number the graph runs with is the cause."""
    kernel = head_means if variant == "bug" else head_means_masked
    finding = finding_of(_workload(lambda cache: Runner(cache, variant, kernel=kernel), kernel=kernel), variant)
    if finding is None:
        return
    assert finding.kind == "host-work-frozen" and "runs with 4.0 in the graph" in finding.evidence, finding


def pair_energy(pos, species, table):
    """One system's energy and per-atom forces: each pair's coupling is the product of its species'
    entries in ``table``, times the squared distance."""
    c = table[species]
    diff = pos[:, None, :] - pos[None, :, :]
    energy = (c[:, None] * c[None, :] * diff.pow(2).sum(-1)).sum().reshape(1) / 2
    forces = -2 * ((c[:, None] * c[None, :])[..., None] * diff).sum(1)
    return energy, forces


class OneSystemStep:
    """A calculator that captures one whole step for a system of five atoms and replays it as a step
    of size 1 (one system): its forces have one row per atom, none of the step's size. ``bug``: a
    species swap reuses the graph with positions refreshed and the species left as captured."""

    def __init__(self, variant: str, species: torch.Tensor, table: torch.Tensor):
        self.variant, self.pos, self.species = variant, torch.zeros(5, 3), species.clone()
        events.static_buffers("calculator", {"pos": self.pos, "species": self.species})
        self.step = lambda: pair_energy(self.pos, self.species, table)  # noqa: E731
        with events.warmup():
            self.step()
        self.graph = new_graph("cpu")
        with graph(self.graph, name="whole step"):
            self.out = self.step()

    def __call__(self, pos, species):
        self.pos.copy_(pos)
        if self.variant == "fix":
            self.species.copy_(species)
        events.serve(self.graph, 1, 1, outputs=self.out, eager=self.step)
        self.graph.replay()
        return [o.clone() for o in self.out]


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_an_unpadded_step_is_compared_whole_where_its_outputs_have_no_dimension_of_its_size(variant):
    """Each output of a step with no padded rows is compared with the reference whole: the per-atom
    forces of a step of one system are not cut to their first row (which left them incomparable
    with the reference's, and the replays after the swap unchecked). The species the step never
    refreshed is then stale input, at the refresh that left it out."""
    def workload():
        gen = torch.Generator().manual_seed(3)
        table = torch.rand(4, generator=gen) + 0.5
        base = torch.rand(5, 3, generator=gen)
        steps = [(base + 0.01 * i, torch.tensor([0, 1, 2, 1, 0] if i < 2 else [2, 0, 1, 1, 3])) for i in range(4)]
        with events.reference():
            expected = [t for pos, species in steps for t in pair_energy(pos, species, table)]
        calc = OneSystemStep(variant, steps[0][1], table)
        return expected, [t for pos, species in steps for t in calc(pos, species)]

    finding = finding_of(workload, variant)
    if finding is None:
        return
    assert finding.kind == "stale-input" and finding.tensor.startswith("species: "), finding
    assert "self.pos.copy_(pos)" in finding.source and "this step wrote none of them" in finding.evidence, finding


class FreshInputs:
    """A runner that uploads each step's inputs into tensors of their own and keeps the graph it
    captured on the first (``bug``): every later replay reads the first step's inputs, kept alive by
    the runner, while the step's own go unread. ``fix``: they are copied into the captured tensors."""

    def __init__(self, variant: str, cache: torch.Tensor):
        self.variant, self.cache, self.graph = variant, cache, None

    def __call__(self, q, lens):
        if self.graph is None or self.variant == "bug":
            bound = torch.zeros_like(q).copy_(q), torch.zeros_like(lens).copy_(lens)
        if self.graph is None:
            self.q, self.lens = bound
            events.static_buffers("runner", {"q": self.q, "lens": self.lens})
            self.step = lambda: attend_clamped(self.q, self.cache, self.lens, CONTEXT)  # noqa: E731
            self.graph = new_graph("cpu")
            with graph(self.graph, name="decode"):
                self.out = self.step()
        elif self.variant == "fix":
            self.q.copy_(q)
            self.lens.copy_(lens)
        events.serve(self.graph, 2, 2, outputs=self.out, eager=self.step)
        self.graph.replay()
        return self.out.clone()


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_replay_after_no_write_is_compared_with_the_step_its_count_gives_not_the_earlier_one_its_inputs_match(variant):
    """A replay whose step wrote none of the static inputs the graph reads holds what an earlier step
    left there: its inputs match that earlier step of the reference, whose answer it gives. Set beside
    the step its count gives, the query it reads is not what the reference gives -- and the step wrote
    the reference's values into a tensor of its own: the graph reads the tensor it was captured on, a
    reference the capture froze (``warmup-divergence``, where the graph was replayed)."""
    workload = _workload(lambda cache: FreshInputs(variant, cache), kernel=attend_clamped)
    finding = finding_of(workload, variant)
    if finding is None:
        return
    assert finding.kind == "warmup-divergence" and "(call 2 of attend_clamped)" in finding.evidence, finding
    assert "yet another int64[2], made where the graph's was" in finding.evidence, finding
    assert finding.source.endswith(" in __call__: self.graph.replay()"), finding


class LateUpdate(Prefetching):
    """``bug``: the replay path updates ``lens`` after the replay (a graph's parameters updated after
    its launch), so every replay reads the previous step's lengths; ``fix``: before it."""

    def __call__(self, q, lens):
        self.q.copy_(q)
        if self.variant == "fix":
            self.update(lens)
        out = self.replayed()
        if self.variant == "bug":
            self.update(lens)
        return out


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_an_input_refreshed_after_the_replay_that_reads_it_is_named_where_replay_and_refresh_are_ordered(variant):
    """The replay reads lengths its step has not written yet; the step's next write into them, after
    the replay, puts there what the reference gave that step: the refresh came late, not never. The
    finding is named in the frame that replays and then refreshes, at the line that refreshes."""
    finding = finding_of(_workload(lambda cache: LateUpdate(cache, variant)), variant)
    if finding is None:
        return
    assert finding.kind == "stale-input" and finding.tensor.startswith("lens: "), finding
    assert finding.source.endswith(" in __call__: self.update(lens)"), finding
    assert "the step writes them after the replay" in finding.evidence, finding


class Group:
    """A layer group's metadata builder: each group has an index buffer of its own."""

    def __init__(self):
        self.idx = torch.zeros(2, dtype=torch.int64)


def two_groups(table, idx0, idx1):
    return table[idx0] * 2 + table[idx1]


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_an_input_left_out_is_stale_input_though_a_buffer_made_alike_holds_its_values(variant):
    """Two groups' index buffers, made by one line, both read by the graph, hold the same indices;
    the runner refreshes only the first group's (``bug``). The second's values are in a buffer made
    where its own was, but the step wrote the graph's other input: a refresh left out, not a step
    that put its inputs in another instance of the buffer."""
    def workload():
        table = torch.randn(6, 3, generator=torch.Generator().manual_seed(5))
        steps = [torch.tensor([i % 6, (i + 2) % 6]) for i in range(1, 4)]
        with events.reference():
            expected = [two_groups(table, idx, idx) for idx in steps]
        groups = Group(), Group()
        events.static_buffers("runner", {f"group{i}.idx": g.idx for i, g in enumerate(groups)})
        step = lambda: two_groups(table, groups[0].idx, groups[1].idx)  # noqa: E731
        g = new_graph("cpu")
        with graph(g, name="groups"):
            out = step()
        got = []
        for idx in steps:
            for group in groups[:1] if variant == "bug" else groups:
                group.idx.copy_(idx)
            events.serve(g, 2, 2, outputs=out, eager=step)
            g.replay()
            got.append(out.clone())
        return expected, got

    finding = finding_of(workload, variant)
    if finding is None:
        return
    assert finding.kind == "stale-input" and finding.tensor.startswith("group1.idx: "), finding


def by_path(q, positions, decode: bool):
    """A decode step reads the queries alone; a prefill step reads the positions too."""
    if decode:
        return q * 2
    return q * 2 + positions[:, None]


class DecodeGraph:
    """One graph captured on the decode path; the runner fills ``positions`` at every step, for the
    eager prefill path. ``fix``: prefill steps run eagerly; ``bug``: they replay the decode graph."""

    def __init__(self, variant: str):
        self.variant, self.q, self.positions = variant, torch.zeros(2, 4), torch.zeros(2)
        events.static_buffers("runner", {"q": self.q, "positions": self.positions})
        self.decode = True
        self.step = lambda: by_path(self.q, self.positions, self.decode)  # noqa: E731
        self.graph = new_graph("cpu")
        with graph(self.graph, name="decode"):
            self.out = self.step()

    def __call__(self, q, positions, decode: bool):
        self.q.copy_(q)
        self.positions.copy_(positions)
        if not decode and self.variant == "fix":
            return by_path(self.q, self.positions, False)
        events.serve(self.graph, 2, 2, outputs=self.out, eager=self.step)
        self.graph.replay()
        return self.out.clone()


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_an_input_only_another_path_reads_is_a_finding_only_where_the_results_part(variant):
    """The decode graph never reads the positions the runner fills at every step: the code names them
    on a line the capture did not run. Where the graph serves only decode steps (``fix``), the
    workload's results agree with its run without graphs, and that is a note; where it also serves
    a prefill step (``bug``), the results part, and it is a finding."""
    def workload():
        gen = torch.Generator().manual_seed(7)
        steps = [(torch.randn(2, 4, generator=gen), torch.tensor([float(i), i + 1.0]), i != 1) for i in range(4)]
        with events.reference():
            expected = [by_path(q, p, d) for q, p, d in steps]
        runner = DecodeGraph(variant)
        got = [runner(q, p, d) for q, p, d in steps]
        events.results(expected, got)
        return expected, got

    expected, got = workload()
    assert all(torch.equal(e, g) for e, g in zip(expected, got)) == (variant == "fix")
    report = doctor.diagnose(workload)
    passed_over = [f for f in report.findings if f.tensor.startswith("positions: ")]
    if variant == "fix":
        assert report.findings == [] and any("positions" in n and "not reported" in n for n in report.notes), report
        return
    assert passed_over and passed_over[0].kind == "warmup-divergence", report
    assert "return q * 2 + positions[:, None]" in passed_over[0].source, report
