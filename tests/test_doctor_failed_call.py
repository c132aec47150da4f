"""A served step that fails, against the reference run (``doctor/probes/failed_call.py``): the failing
call was handed a padded count where the run without graphs only ever handed it real ones.

The workload: a side buffer records the span it holds for a step's scheduled tokens (as a
multimodal model keeps per-token vision features beside its embeddings), and the model's eager
code asks it for as many rows as the step's input has. Without graphs those are the scheduled
tokens; with graphs the input is padded to a capture size, and ``bug``'s boundary check (the span
asked for must not exceed the span recorded) fails. ``fix`` hands out the padded rows (zeros past
the span). The served run's error is caught by the zoo kit's ``compare``, as a test harness would.
"""
from __future__ import annotations

import pytest
import torch

from workbench import doctor
from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, replay

SIZES = (2, 4)                 # capture sizes
HIDDEN = 3


class SideBuffer:
    """Features for the scheduled tokens, and the span of rows they fill."""

    def __init__(self, variant: str) -> None:
        self.variant, self.rows, self.span = variant, torch.zeros(max(SIZES), HIDDEN), 0

    def store(self, features: torch.Tensor) -> None:
        self.rows[:features.shape[0]].copy_(features)
        self.rows[features.shape[0]:].zero_()
        self.span = features.shape[0]

    def take(self, num_tokens: int) -> torch.Tensor:
        if self.variant == "bug" and num_tokens > self.span:
            raise ValueError(f"asked for {num_tokens} rows, {self.span} available")
        return self.rows[:num_tokens]


class Model:
    def __init__(self, side: SideBuffer) -> None:
        self.side, self.weight = side, torch.linspace(-1.0, 1.0, HIDDEN * HIDDEN).reshape(HIDDEN, HIDDEN)

    def layers(self, x: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        return torch.tanh((x + extra) @ self.weight)

    def forward(self, x: torch.Tensor, layers=None) -> torch.Tensor:
        extra = self.side.take(x.shape[0])
        return (layers or self.layers)(x, extra)


class GraphRunner:
    """One graph of ``Model.layers`` per capture size over static ``x`` and the side buffer's rows."""

    def __init__(self, model: Model) -> None:
        self.model, self.x, self.graphs = model, torch.zeros(max(SIZES), HIDDEN), {}
        pool = graph_pool_handle("cpu")
        for n in sorted(SIZES, reverse=True):
            fn = (lambda n=n: model.layers(self.x[:n], model.side.rows[:n]))
            self.graphs[n] = capture(fn, device="cpu", pool=pool, name=f"layers [{n}]",
                                     static={"x": self.x, "side": model.side.rows})

    def step(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        real = tokens.shape[0]
        size = next(s for s in sorted(SIZES) if s >= real)
        self.x[:real].copy_(tokens)
        self.x[real:].zero_()
        self.model.side.store(features)
        g, out = self.graphs[size]
        return self.model.forward(self.x[:size], lambda x, extra: replay(g, out, real=real, size=size))[:real]


def _steps():
    gen = torch.Generator().manual_seed(7)
    return [(torch.randn(n, HIDDEN, generator=gen), torch.randn(n, HIDDEN, generator=gen)) for n in (2, 3, 1)]


def run(variant: str):
    def eager():
        model = Model(SideBuffer(variant))
        outs = []
        for tokens, features in _steps():
            model.side.store(features)
            outs.append(model.forward(tokens))
        return outs

    def served():
        runner = GraphRunner(Model(SideBuffer(variant)))
        return [runner.step(tokens, features).clone() for tokens, features in _steps()]

    return compare("side_buffer", variant, "cpu", served, eager)


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_padded_count_the_reference_never_passed_is_named_at_the_call_that_failed_on_it(variant):
    outcome = run(variant)
    assert (outcome.error is not None) == (variant == "bug"), outcome.summary()
    report = doctor.diagnose(lambda: run(variant))
    if variant == "fix":
        assert report.findings == [], report
        return
    (finding,) = report.findings
    assert finding.kind == "padded-shape-mismatch"
    assert " in take: " in finding.source and finding.tensor == "`num_tokens` (4)"
    assert "never 4" in finding.evidence and finding.graph == "layers [4]"


def test_a_count_the_reference_passed_too_is_no_evidence(monkeypatch):
    """The same failure, where the run without graphs also asked for 4 rows (a step of 4 tokens):
    the failing call's count is one the reference passed, and nothing ties the error to padding."""
    steps = _steps()
    monkeypatch.setitem(globals(), "_steps", lambda: [(torch.ones(4, HIDDEN), torch.ones(4, HIDDEN)), *steps])
    report = doctor.diagnose(lambda: run("bug"))
    assert report.caught and "asked for 4 rows, 3 available" in report.caught[0]
    assert report.findings == [], report
