"""State a reset tore down that a later capture needs again (``rules/torn_down.py``): the set-up
runs once (a flag, a cached builder), the reset binds its result to None, and the re-capture meets
``None``. The finding names the line of the reset, not the failing read."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from workbench import doctor
from workbench.engine import graph, new_graph
from workbench.engine.source import function_of

_REGISTRY = None         # the captured tasks, per size: set up once, torn down by ``clear_registry``
_BUILT = False


def get_registry():
    return _REGISTRY


def clear_registry(rebuild: bool) -> None:
    global _REGISTRY, _BUILT
    _REGISTRY = None
    if rebuild:
        _BUILT = False


def build_registry(fresh: bool = False) -> None:
    global _REGISTRY, _BUILT
    if fresh or not _BUILT:
        _REGISTRY, _BUILT = SimpleNamespace(tasks=[]), True


class Runner:
    """A runner whose attention registers each captured task, and a workspace made on first use."""

    def __init__(self):
        self.workspace, self.made = None, False

    def attention(self, x):
        registry = get_registry()
        registry.tasks.append(x.shape[0])
        return x * 2

    def scratch(self, x):
        if not self.made:
            self.workspace, self.made = torch.zeros(4), True
        return x + self.workspace.sum()

    def release(self, rebuild: bool) -> None:
        self.workspace = None
        if rebuild:
            self.made = False


def _capture(step, x):
    g = new_graph("cpu")
    with graph(g, name=f"step {len(x)}"):
        step(x)
    return g


@pytest.mark.parametrize("variant", ["bug", "fix"])
@pytest.mark.parametrize("state", ["global", "attribute"])
def test_state_a_reset_bound_to_none_is_named_at_the_reset(state, variant):
    def workload():
        runner, x = Runner(), torch.ones(2)
        step = runner.attention if state == "global" else runner.scratch
        build_registry(fresh=True)
        _capture(step, x).replay()
        # a sleep and wake-up: the reset clears the set-up; the fix also lets it run again
        if state == "global":
            clear_registry(rebuild=variant == "fix")
        else:
            runner.release(rebuild=variant == "fix")
        build_registry()
        _capture(step, x).replay()
    report = doctor.diagnose(workload)
    if variant == "fix":
        assert report.findings == [] and not report.errors, report
        return
    assert report.errors and "NoneType" in report.headline(), report
    (finding,) = report.findings
    assert finding.kind == "warmup-divergence", finding
    assert function_of(finding.location) == ("clear_registry" if state == "global" else "release"), finding
    assert finding.tensor == ("_REGISTRY" if state == "global" else "workspace"), finding
