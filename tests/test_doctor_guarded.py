"""A capture the workload's own check refuses (``rules/guarded.py``): host work that a replay would
not repeat, such as a generator's host seed read inside the captured region, is refused by a guard
that asks whether a capture is running. The capture fails; the finding names the guarded work."""
from __future__ import annotations

import pytest
import torch

from workbench import doctor
from workbench.engine import events, graph, new_graph
from workbench.engine.source import function_of


class _Generator:
    def __init__(self, guarded: bool):
        self.guarded, self.seed = guarded, 7

    def _assert_not_capturing(self, what: str) -> None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"Cannot call {what} during CUDA graph capture")

    def current_seed(self) -> int:
        if self.guarded:
            self._assert_not_capturing("current_seed")
        return self.seed


def _step_with(gen, x):
    return x * gen.current_seed()


def _run(guarded: bool) -> None:
    x, gen = torch.ones(3), _Generator(guarded)
    events.static_buffers("runner", {"x": x})
    with events.warmup():
        _step_with(gen, x)
    g = new_graph("cpu")
    with graph(g, name="step"):
        out = _step_with(gen, x)
    g.replay()
    assert out.tolist() == [7.0] * 3


def test_a_guard_that_refuses_the_capture_names_the_work_it_guards():
    report = doctor.diagnose(lambda: _run(guarded=True))
    assert report.errors, "the workload failed: the headline says so"
    found = report.of("host-work-frozen")
    assert len(found) == 1
    assert function_of(found[0].location) == "current_seed"
    assert "refused by the workload's own check" in found[0].evidence


def test_no_finding_when_nothing_is_refused():
    assert not doctor.diagnose(lambda: _run(guarded=False)).findings


def _checked_step(x):
    if torch.cuda.is_current_stream_capturing():
        raise ValueError("this step cannot run here")
    return x + 1


@pytest.mark.parametrize("asks", [True, False])
def test_a_function_that_asks_and_raises_is_itself_the_site(asks):
    """A function that raises after asking whether a capture runs is the work refused; an error with
    no sign of a capture (it neither asks nor says so) is only the workload's failure."""
    def run():
        x = torch.ones(2)
        g = new_graph("cpu")
        with graph(g, name="step"):
            _checked_step(x) if asks else _unrelated(x)

    report = doctor.diagnose(run)
    assert report.errors
    found = report.of("host-work-frozen")
    if asks:
        assert [function_of(f.location) for f in found] == ["_checked_step"]
    else:
        assert not found


def _unrelated(x):
    raise ValueError("the batch is malformed")


REGISTRY = None          # a module's registry, torn down by a reset and never rebuilt


def _records_events(x):
    """Asks whether a capture runs, then misuses a value: an attribute of ``None`` is no refusal."""
    if torch.cuda.is_current_stream_capturing():
        REGISTRY.events.append(x.shape[0])
    return x + 1


def test_a_misused_value_in_a_function_that_asks_is_no_refusal():
    def run():
        x = torch.ones(2)
        g = new_graph("cpu")
        with graph(g, name="step"):
            _records_events(x)

    report = doctor.diagnose(run)
    assert report.errors and "AttributeError" in report.headline(), report
    assert not report.of("host-work-frozen"), report


def _load_plan(x, inner):
    """A library's lazy set-up that runs a throwaway capture of its own (a cuDNN plan's warmup), or
    replays a graph of its own, while the runner's capture is open."""
    if inner is None:
        with graph(new_graph("cpu"), name="plan warmup"):
            x.mul(2)
    else:
        inner.replay()
    return x + 1


@pytest.mark.parametrize("nested", ["capture", "replay"])
def test_a_graph_call_the_engine_refuses_in_a_capture_is_no_guard_of_the_workloads(nested):
    """Beginning a capture, or replaying a graph, while a capture is open is refused by the engine
    (CUDA refuses both): a call a capture cannot hold, named at the line that made it, not host work
    refused by the workload's own check. Loaded before the capture, nothing is refused."""
    def run(early: bool):
        x = torch.ones(2)
        inner = None
        if nested == "replay":
            inner = new_graph("cpu")
            with graph(inner, name="plan"):
                x.mul(2)
        if early:
            _load_plan(x, inner)
        g = new_graph("cpu")
        with graph(g, name="step"):
            out = _load_plan(x, inner) if not early else x + 1
        g.replay()
        assert out.tolist() == [2.0, 2.0]

    report = doctor.diagnose(lambda: run(early=False))
    assert report.errors and not report.of("host-work-frozen"), report
    found = report.of("sync-in-capture")
    assert [function_of(f.location) for f in found] == ["_load_plan"], report
    assert ("capture begun inside" if nested == "capture" else "replay while") in found[0].op
    assert not doctor.diagnose(lambda: run(early=True)).findings
