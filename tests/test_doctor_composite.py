"""Errors a composite op raises before it dispatches any op reach the shape contracts with its
arguments (``doctor/composite.py``): the op's own check is all the evidence a caught failure leaves."""
from __future__ import annotations

import pytest
import torch

from workbench import doctor
from workbench.zoo.kit import capture, replay


def _served(variant: str, fail):
    """A graph of 4 rows over a static table of 2 columns; eager code laying out a step of 3 real
    rows runs ``fail(table, x, bug)``, whose composite op fails on the bug (a harness catches it),
    then the step is served."""
    def workload():
        table, x = torch.zeros(4, 2), torch.zeros(4, 2)
        g, out = capture(lambda: x * 2 + table, device="cpu", name="bs 4", static={"table": table, "x": x})
        try:
            fail(table, x, variant == "bug")
        except RuntimeError:
            pass                                   # a harness that logs the failure and carries on
        x[:3] = 1.0
        replay(g, out, real=3, size=4)
    return doctor.diagnose(workload)


def _narrow(table, x, bug):
    width = 3 if bug else 2                        # the step's columns
    table.narrow(1, 0, width).copy_(torch.ones(4, width))


def _repeat(table, x, bug):
    repeats = torch.ones(3 if bug else 4, dtype=torch.long)     # one per real request; the fix pads them
    x[:, 0].copy_(torch.repeat_interleave(x[:, 0], repeats))


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_narrow_past_the_end_of_a_static_buffer_is_undersized_where_it_was_asked(variant):
    """``narrow`` raises where a slice would clamp: no op is dispatched, so only its arguments say
    that the step asked for more columns than the buffer was made with."""
    report = _served(variant, _narrow)
    kinds = [(f.kind, f.source.rsplit(" in ", 1)[-1].split(":")[0]) for f in report.findings]
    if variant == "bug":
        assert ("undersized-buffer", "_narrow") in kinds
        assert "narrow asks for [.., 3) of dimension 1 of table, which has 2" in str(report)
    else:
        assert kinds == []


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_composite_op_combining_padded_and_real_rows_is_a_padded_shape_mismatch(variant):
    """``repeat_interleave`` checks its two sizes before it dispatches: the graph's input of 4 padded
    rows against repeats for the 3 real ones, before the replay."""
    report = _served(variant, _repeat)
    kinds = [(f.kind, f.source.rsplit(" in ", 1)[-1].split(":")[0]) for f in report.findings]
    if variant == "bug":
        assert ("padded-shape-mismatch", "_repeat") in kinds
    else:
        assert kinds == []
