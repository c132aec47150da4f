"""An op that fails on a slice that asked for more than its tensor holds (``doctor/rules/clamped.py``).

The workload: a metadata builder keeps an ``arange`` to index with, made once for the largest
number of tokens it expects (``bug``: one per request; ``fix``: the largest graph size). The runner
captures its graph with a dummy batch padded to the graph size; the builder slices the ``arange``
for all of that batch's tokens, the slice is clamped, and the subtraction that combines it with
per-token starts fails. The kit's ``compare`` catches the error, as a test harness would. Two
controls: code that clamps on purpose and fails nothing (the top ``k`` of a shorter list), and a
failure on another tensor after a clamped slice.
"""
from __future__ import annotations

import pytest
import torch

from workbench import doctor
from workbench.zoo.kit import capture, compare, replay

MAX_REQS, GRAPH_TOKENS = 2, 4


class Builder:
    def __init__(self, variant: str) -> None:
        self.arange = torch.arange(GRAPH_TOKENS if variant == "fix" else MAX_REQS)
        self.positions = torch.zeros(GRAPH_TOKENS, dtype=torch.int64)

    def build(self, starts: torch.Tensor) -> None:
        n = starts.shape[0]
        self.positions[:n] = self.arange[:n] - starts


def served(variant: str) -> list[torch.Tensor]:
    builder, hidden = Builder(variant), torch.zeros(GRAPH_TOKENS, 3)
    builder.build(torch.zeros(GRAPH_TOKENS, dtype=torch.int64))      # the dummy batch, padded to the graph
    g, out = capture(lambda: hidden * 2 + builder.positions[:, None], device="cpu", warmups=1, name="decode",
                     static={"hidden": hidden, "positions": builder.positions})
    builder.build(torch.tensor([0, 1]))
    hidden[:2] = 1.0
    replay(g, out, real=2, size=GRAPH_TOKENS)
    return [out[:2].clone()]


def eager(variant: str) -> list[torch.Tensor]:
    return [torch.ones(2, 3) * 2 + (torch.arange(2) - torch.tensor([0, 1]))[:, None]]


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_an_op_failing_on_a_clamped_slice_is_the_buffer_s_size(variant):
    report = doctor.diagnose(lambda: compare("clamped", variant, "cpu", lambda: served(variant),
                                             lambda: eager(variant)))
    if variant == "fix":
        assert report.findings == [], report
        return
    (f,) = report.findings
    assert f.kind == "undersized-buffer" and f.op == "aten.arange.default" and "in __init__" in f.location, f
    assert "asked for [.., 4) of dimension 0 of the int64[2] tensor" in f.evidence, f.evidence
    assert f.numbers == {"dim": 0, "end": 4, "length": 2}


def test_a_slice_clamped_on_purpose_that_fails_nothing_is_no_finding():
    scores, out = torch.arange(3.0), torch.zeros(5)

    def workload():
        g, o = capture(lambda: out * 2, device="cpu", warmups=0, name="g", static={"out": out})
        top = scores[:5]                              # at most five: three there are
        out[:top.shape[0]] = top
        replay(g, o)

    assert doctor.diagnose(workload).findings == []


def test_a_failure_on_another_tensor_is_not_the_clamped_slice_s():
    table, x = torch.arange(3.0), torch.zeros(4, 3)

    def workload():
        g, o = capture(lambda: x + 1, device="cpu", warmups=0, name="g", static={"x": x})
        _ = table[:8]                                 # clamped, and never used
        try:
            torch.ones(2) + torch.ones(3)
        except RuntimeError:
            pass
        replay(g, o)

    assert [f for f in doctor.diagnose(workload).findings if f.kind == "undersized-buffer"] == []
