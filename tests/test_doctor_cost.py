"""What keeps ``watch()`` cheap per served step, and that the shortcuts lose no detection.

The timing itself is ``benchmarks/bench_doctor.py``'s (it depends on the machine); here are the
mechanisms it relies on: no clone and no mode switch on a step whose rules need none, a liveness
check that is told when a storage goes instead of asking every storage before every replay, and
handed-out views tracked without a callback per view.
"""
from __future__ import annotations

import array
import gc
import itertools

import pytest
import torch
import torch.utils._python_dispatch as python_dispatch

from workbench import doctor
from workbench.doctor import records
from workbench.doctor.intake import Doctor
from workbench.doctor.session import watching
from workbench.engine import GraphRunner, events, graph, new_graph
from workbench.engine.errors import IllegalMemoryAccess


def runner() -> GraphRunner:
    r = GraphRunner(lambda x: x * 2 + 1, {"x": ((4,), torch.float32)}, [2, 4])
    r.capture()
    return r


def test_a_served_step_clones_nothing_and_switches_no_modes(monkeypatch):
    """After the first replay (the mutation probe's), a step of a runner whose graphs write no
    input needs no evidence kept: no clone, no ``_disable_current_modes``."""
    clones, switches = [], []
    clone, disable = torch.Tensor.clone, python_dispatch._disable_current_modes
    with doctor.watch() as report:
        r = runner()
        r(x=torch.ones(3, 4))
        monkeypatch.setattr(torch.Tensor, "clone", lambda t, *a, **k: clones.append(1) or clone(t, *a, **k))
        monkeypatch.setattr(python_dispatch, "_disable_current_modes", lambda: switches.append(1) or disable())
        for i in range(20):
            out = r(x=torch.full((3, 4), float(i)))
        monkeypatch.undo()
    assert torch.equal(out, torch.full((3, 4), 39.0))
    assert (clones, switches) == ([], [])
    assert report.findings == [] and report.replays == 21


def test_the_engine_hands_its_own_ops_to_the_doctor_without_the_dispatch_mode(monkeypatch):
    """A served step's copy into the static buffer and slice of the output go to the rules
    directly (``events.engine_op``), with the mode off the stack: no op of the step passes through
    the mode, and the rules still see them (the copy's shape contract, the handed-out view)."""
    from workbench.doctor import session
    through_mode, direct = [], []
    dispatch, watched = session._Watch.__torch_dispatch__, session._watched
    monkeypatch.setattr(session._Watch, "__torch_dispatch__",
                        lambda self, func, *a, **k: through_mode.append(func) or dispatch(self, func, *a, **k))
    monkeypatch.setattr(session, "_watched", lambda doctor, func, *a: direct.append(func) or watched(doctor, func, *a))
    with doctor.watch() as report:
        r, x = runner(), torch.ones(3, 4)
        r(x=x)
        through_mode.clear(), direct.clear()
        for _ in range(5):
            out = r(x=x)
        late = r(x=x)
        out.sum()                                   # a view handed out two steps ago, read now
    assert [str(f) for f in through_mode] == ["aten.sum.default"], through_mode
    assert [str(f) for f in direct[:3]] == ["aten.slice.Tensor", "aten.copy_.default", "aten.slice.Tensor"]
    assert late is not None and report.of("overwritten-output"), report


def test_storage_objects_live_as_long_as_their_storages():
    """The liveness check relies on it (else it falls back to asking each storage)."""
    assert records._PRESERVED


@pytest.mark.parametrize("guard", [False, True])
def test_every_released_storage_is_found_once_even_when_several_go_together(guard):
    x = torch.ones(2, 3)
    with doctor.watch(guard=guard) as report:
        a, b = torch.randn(3, 3), torch.randn(3, 3)
        g = new_graph("cpu")
        with graph(g, name="two weights"):
            y = x @ a
            out = y + x @ b
        g.replay()
        g.replay()                                 # nothing released: no finding
        assert report.findings == []
        del a, b
        gc.collect()
        for _ in range(2):                         # guard stops each replay, one released storage at a time
            with pytest.raises(doctor.DanglingReferenceError if guard else IllegalMemoryAccess):
                g.replay()
    assert [f.kind for f in report.findings] == ["dangling-reference"] * 2
    assert len({f.location for f in report.findings}) == 1                 # both let go by one line,
    assert len({f.evidence.split(" has no owner")[0] for f in report.findings}) == 2    # read by two ops
    assert out.shape == (2, 3)


def test_a_storage_released_after_many_replays_is_found_at_the_next_one():
    x = torch.ones(2, 3)
    with doctor.watch(guard=True) as report:
        w = torch.randn(3, 3)
        g = new_graph("cpu")
        with graph(g, name="matmul"):
            x @ w
        for _ in range(30):
            g.replay()
        del w
        gc.collect()
        with pytest.raises(doctor.DanglingReferenceError):
            g.replay()
    (finding,) = report.findings
    assert finding.numbers == {"replays_before": 30}


def test_a_served_step_looks_up_no_line_and_a_view_user_code_takes_keeps_its_own(monkeypatch):
    """The engine's slice of a graph's output is the view it hands out: no walk up the stack for
    it on a served step. A view eager code takes of the graph's own output and reads after a later
    replay is still named where it was taken."""
    from workbench.doctor.rules import overwritten
    walks, user_frame = [], overwritten.user_frame
    monkeypatch.setattr(overwritten, "user_frame", lambda: walks.append(1) or user_frame())
    with doctor.watch() as report:
        r = runner()
        r(x=torch.ones(3, 4))
        walks.clear()
        for i in range(10):
            r(x=torch.full((3, 4), float(i)))
        assert walks == []
        monkeypatch.undo()                          # (the counting wrapper would be the line found)
        graph_output = r(x=torch.ones(3, 4))._base
        kept = graph_output[:2]                     # user code's own view of the static output
        r(x=torch.zeros(3, 4))
        kept.sum()
    (finding,) = report.of("overwritten-output")
    assert "kept = graph_output[:2]" in finding.source, finding


def test_handed_out_views_are_swept_and_a_stale_read_is_still_found():
    with doctor.watch() as report:
        r = runner()
        kept = r(x=torch.zeros(3, 4))
        for i in range(200):                       # each step hands out a view that is dropped at once
            r(x=torch.full((3, 4), float(i)))
        stale = kept + 0
    assert torch.equal(stale, torch.full((3, 4), 399.0))
    (finding,) = report.findings
    assert finding.kind == "overwritten-output"
    assert finding.numbers == {"handed_out_after": 1, "read_after": 201}


def test_handed_out_entries_stay_bounded():
    with watching(Doctor()) as d:
        r = runner()
        for i in range(500):
            r(x=torch.full((3, 4), float(i)))
        assert len(d.handed) < 64 + 2
    assert d.report.findings == []


def test_event_handlers_follow_subscriptions_in_order():
    seen = []

    class First:
        def replay_begin(self, graph):
            seen.append(("first", graph))

    class Second:
        def replay_begin(self, graph):
            seen.append(("second", graph))

        def handed_out(self, graph, tensors):
            seen.append(("second handed", graph))

    first, second = First(), Second()
    events.subscribe(first)
    events.subscribe(second)
    try:
        events.replay_begin("g")
        events.handed_out("g", None)
        events.unsubscribe(first)
        events.replay_begin("h")
    finally:
        events.unsubscribe(second)
    events.replay_begin("unseen")
    assert seen == [("first", "g"), ("second", "g"), ("second handed", "g"), ("second", "h")]


# ------------------------------------------------------------------ differential replay: traced on samples
class Drifts:
    """A step whose Python keeps a scale that changes after ``drift_at`` steps (frozen at capture in
    the graph), and may count its eager calls after the capture in a tensor no graph writes."""

    def __init__(self, drift_at: int, counts: bool = False):
        self.x, self.scale, self.steps, self.drift_at = torch.zeros(4, 4), 2.0, 0, drift_at
        # (an iterator, not an int: the doctor puts back what an eager run rebinds)
        self.counter, self.counts, self.calls = torch.zeros(1), counts, itertools.count(1)

    def forward(self, size):
        if next(self.calls) > 2 and self.counts:    # after the warmup and the capture
            self.counter.add_(1)
        return self.x[:size] * self.scale


def _served(model: Drifts, steps: int) -> tuple[doctor.Report, list]:
    from test_doctor_mechanisms import Manager, rows
    seen = array.array("b")         # (not a list or deque: the doctor puts back those an eager run appends to)
    with doctor.watch(differential=1) as report:
        m = Manager(model.forward, [4], {"x": model.x})
        m.capture()
        mode = python_dispatch._get_current_dispatch_mode()
        eager = model.forward

        def forward(size):                          # whether the doctor's mode sees this eager run
            seen.append(python_dispatch._get_current_dispatch_mode() is mode)
            return eager(size)
        model.forward = forward
        m.forward = forward
        for step in range(steps):
            model.x.copy_(rows(4, seed=step))
            if step == model.drift_at:
                model.scale = 3.0
            m.replay(3)
    return report, [bool(w) for w in seen]


def test_eager_steps_are_watched_on_the_first_compared_replay_and_every_trace_every_th():
    from workbench.doctor.probes.differential import TRACE_EVERY
    report, seen = _served(Drifts(drift_at=10 ** 6), 2 * TRACE_EVERY + 1)
    assert report.findings == [], report
    assert [i for i, watched in enumerate(seen) if watched] == [0, TRACE_EVERY, 2 * TRACE_EVERY]


def test_a_difference_on_an_unwatched_sample_is_run_again_watched_and_localised():
    report, seen = _served(Drifts(drift_at=3), 5)
    (finding,) = report.findings
    assert finding.kind == "host-work-frozen", report
    assert "self.x[:size] * self.scale" in finding.source
    assert seen[:4] == [True, False, False, False]      # step 3's unwatched run differed ...
    assert seen[4] is True                              # ... and was run again, watched


def test_an_eager_step_writing_outside_the_kept_state_is_watched_every_time_and_put_back():
    model = Drifts(drift_at=10 ** 6, counts=True)
    report, seen = _served(model, 5)
    assert seen == [True] * 5, seen
    assert float(model.counter) == 0                       # no replay writes it; each eager run's add put back
    (finding,) = report.findings
    assert "writes memory the graph never writes" in finding.evidence, report
