"""The graph doctor's general mechanisms, each on small bug and fix workloads of its own.

Every workload here is a tiny serving loop written for this file, on the engine's public API: a
graph manager of a few lines (one graph per size in one pool, warmups, ``serve`` with an eager
step), buffers, and a model with one deliberate flaw -- or its fix, which must give no finding.
"""
from __future__ import annotations

import functools

import pytest
import torch

from workbench import doctor
from workbench.engine import GraphRunner, events, graph, graph_pool_handle, new_graph


class Manager:
    """One graph per size, captured largest first into one pool after a warmup; ``replay(n)``
    announces ``serve`` (with the eager step) and hands the real rows of the outputs out."""

    def __init__(self, forward, sizes, buffers, *, state=None, shared=None, metadata=None, name="Tiny"):
        self.forward, self.sizes, self.buffers = forward, sorted(sizes), buffers
        self.graphs, self.outputs = {}, {}
        self.pool = graph_pool_handle("cpu")
        events.static_buffers(name, buffers)
        if state:
            events.persistent_state(name, state)
        if shared:
            events.shared_outputs(name, shared)
        if metadata:
            events.written_metadata(name, metadata)

    def capture(self, sizes=None):
        with torch.no_grad():
            for size in sorted(sizes or self.sizes, reverse=True):
                with events.warmup():
                    self.forward(size)
                g = new_graph("cpu")
                with graph(g, pool=self.pool, name=f"size {size}"):
                    self.outputs[size] = self.forward(size)
                self.graphs[size] = g

    def replay(self, n, *, padded=None, columns=None, eager=True):
        size = next(s for s in self.sizes if s >= n)
        g = self.graphs[size]
        events.serve(g, n, size, padded=self.buffers if padded is None else padded, outputs=self.outputs[size],
                     eager=functools.partial(self.forward, size) if eager else None, padded_columns=columns)
        g.replay()
        out = self.outputs[size][:n]
        events.handed_out(g, out)
        return out


def rows(n, width=4, seed=0, dtype=torch.float32):
    return torch.randint(0, 5, (n, width), generator=torch.Generator().manual_seed(seed)).to(dtype)


# ------------------------------------------------------------------------------ differential replay
class Sampler:
    """Logits divided by a temperature the user changes between requests."""

    def __init__(self, variant):
        self.variant = variant
        self.x = torch.zeros(4, 4)
        self.temperature = 1.0
        self.temp_buf = torch.ones(())          # fix: the temperature lives in a static buffer

    def forward(self, size):
        if self.variant == "bug":
            return torch.softmax(self.x[:size] / self.temperature, -1)
        return torch.softmax(self.x[:size] / self.temp_buf, -1)

    def set_temperature(self, t):
        self.temperature = t
        self.temp_buf.fill_(t)


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_python_scalar_changed_after_capture(variant):
    def workload():
        s = Sampler(variant)
        m = Manager(s.forward, [2, 4], {"x": s.x})
        m.capture()
        for step, t in enumerate((1.0, 0.5)):
            s.set_temperature(t)
            s.x[:3].copy_(rows(3, seed=step))
            m.replay(3)
    report = doctor.diagnose(workload)
    if variant == "fix":
        assert report.findings == [] and report.errors == []
        assert "differential replay: 2 replay(s) compared" in " ".join(report.notes)
        return
    (finding,) = report.findings
    assert finding.kind == "warmup-divergence"
    assert finding.op == "aten.div.Tensor" and finding.location.endswith("in forward")
    assert "self.x[:size] / self.temperature" in finding.source
    assert finding.numbers["how"] == "arguments" and finding.numbers["replay"] == 2
    assert "eager run" in finding.evidence


class Biased:
    """A bias switched on after capture (a feature flag read by Python)."""

    def __init__(self):
        self.x = torch.zeros(4, 3)
        self.bias = torch.full((3,), 0.5)
        self.use_bias = False

    def forward(self, size):
        y = self.x[:size] * 2
        if self.use_bias:
            y = y + self.bias
        return y


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_feature_switched_on_after_capture(variant):
    def workload():
        model = Biased()
        m = Manager(model.forward, [4], {"x": model.x})
        m.capture()
        model.x.copy_(rows(4, 3))
        m.replay(4)
        model.use_bias = True
        if variant == "fix":
            m.capture()                         # re-capture when Python's decisions change
        m.replay(4)
    report = doctor.diagnose(workload)
    if variant == "fix":
        assert report.findings == []
        return
    (finding,) = report.findings
    assert finding.kind == "warmup-divergence" and finding.numbers["how"] == "length"
    assert "y = y + self.bias" in finding.source          # the op the eager step launches and the graph lacks


class Rescaled:
    """A weight replaced by a new tensor after capture (an update that rebinds, not copies)."""

    def __init__(self):
        self.x = torch.zeros(2, 3)
        self.scale = torch.ones(3)
        self.old = []

    def forward(self, size):
        return self.x[:size] * self.scale

    def update(self, how):
        new = torch.full((3,), 3.0)
        if how == "copy":
            self.scale.copy_(new)
        else:
            self.old.append(self.scale)           # still alive: the graph reads it without error
            self.scale = new


@pytest.mark.parametrize("variant", ["bug", "copy in place", "re-capture"])
def test_a_weight_rebound_after_capture(variant):
    def workload():
        model = Rescaled()
        m = Manager(model.forward, [2], {"x": model.x})
        m.capture()
        model.x.copy_(rows(2, 3))
        model.update("copy" if variant == "copy in place" else "rebind")
        if variant == "re-capture":
            m.capture()
        m.replay(2)
    report = doctor.diagnose(workload)
    if variant != "bug":
        assert report.findings == []
        return
    (finding,) = report.findings
    assert finding.kind == "warmup-divergence" and finding.numbers["how"] == "reference"
    assert finding.tensor == "float32[3]" and "self.x[:size] * self.scale" in finding.source
    assert "a reference frozen at capture" in finding.cause


class Planned:
    """Planning deferred into the captured forward: a host-side plan turned into a tensor there."""

    def __init__(self):
        self.x = torch.zeros(4, 4)
        self.lengths = [4, 4, 4, 4]

    def forward(self, size):
        mask = torch.tensor([[c < n for c in range(4)] for n in self.lengths[:size]])
        return (self.x[:size] * mask).sum(-1)


def test_planning_deferred_into_the_captured_forward():
    def workload():
        model = Planned()
        m = Manager(model.forward, [4], {"x": model.x})
        m.capture()
        model.x.copy_(rows(4))
        model.lengths = [1, 2, 3, 4]
        m.replay(4)
    (finding,) = doctor.diagnose(workload).findings
    assert finding.kind == "warmup-divergence" and finding.numbers["how"] == "arguments"
    assert "torch.tensor(" in finding.source


class Keyed:
    """Graphs keyed on the batch size only, though the step also depends on a causal flag."""

    def __init__(self):
        self.x = torch.zeros(4, 4)
        self.causal = True

    def forward(self, size):
        scores = self.x[:size] @ self.x[:size].T
        if self.causal:
            scores = scores.tril()
        return scores.sum(-1)


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_graph_keyed_on_the_wrong_property(variant):
    def workload():
        model = Keyed()
        managers = {flag: Manager(model.forward, [4], {"x": model.x}) for flag in (True, False)}
        for flag, m in managers.items():
            model.causal = flag
            m.capture()
        model.x.copy_(rows(4))
        model.causal = False
        (managers[True] if variant == "bug" else managers[model.causal]).replay(4)
    report = doctor.diagnose(workload)
    assert [f.kind for f in report.findings] == (["warmup-divergence"] if variant == "bug" else [])


def test_without_an_eager_step_differential_replay_says_not_checked():
    def workload():
        s = Sampler("bug")
        m = Manager(s.forward, [4], {"x": s.x})
        m.capture()
        s.set_temperature(0.5)
        m.replay(4, eager=False)
    report = doctor.diagnose(workload)
    assert report.findings == []
    assert report.skipped == {"differential replay": "no eager step announced (serve(..., eager=...))"}
    assert "not checked: differential replay (no eager step announced" in str(report)


def test_launch_traces_that_differ_with_equal_values_are_a_note_not_a_finding():
    """A branch on capture (another but equivalent kernel) is no hazard."""
    from workbench.engine import is_capturing

    x = torch.zeros(2, 3)

    def forward(size):
        return x[:size] * 2 if is_capturing() else x[:size] + x[:size]

    def workload():
        m = Manager(forward, [2], {"x": x})
        m.capture()
        x.copy_(rows(2, 3))
        m.replay(2)
    report = doctor.diagnose(workload)
    assert report.findings == []
    assert any("launch traces differ" in n and "outputs and state agree" in n for n in report.notes)


def test_differential_replay_leaves_the_program_as_the_replay_left_it():
    """The eager step writes the state too; afterwards state and outputs are the replay's."""
    cache = torch.zeros(4, 3)
    x = torch.zeros(4, 3)

    def forward(size):
        cache[:size] += x[:size]
        return cache[:size] * 1

    def serve(watched):
        cache.zero_()
        x.zero_()
        m = Manager(forward, [4], {"x": x}, state={"cache": cache})
        m.capture()
        cache.zero_()
        outs = []
        for step in range(3):
            x.copy_(rows(4, 3, seed=step))
            outs.append(m.replay(4).clone())
        return outs, cache.clone()

    plain = serve(False)
    with doctor.watch(differential=1) as report:
        watched = serve(True)
    assert all(torch.equal(a, b) for a, b in zip(plain[0], watched[0], strict=True))
    assert torch.equal(plain[1], watched[1])
    assert report.findings == [] and "differential replay: 3 replay(s) compared" in " ".join(report.notes)


def test_differential_replay_is_refused_with_a_clear_error_for_a_bad_rate():
    with pytest.raises(ValueError, match="differential must be a whole number >= 0"):
        with doctor.watch(differential=-1):
            pass
