"""A warmup or capture on an empty batch that fails (``doctor/rules/empty_batch.py``).

The workload: a runner captures one graph per size of a list it derives from the largest batch it
serves. ``bug`` derives ``[max_bs - 1, max_bs]`` and keeps sizes up to ``max_bs``: at a largest
batch of 1 the list holds 0, and the warmup for it cuts every static input to no rows. Its sampler
stand-in refuses an empty launch grid, as CUDA refuses one ("invalid configuration argument"), so
the run ends there; the kit's ``compare`` catches the error, as a test harness would. ``fix``
drops sizes below 1. Two controls: a capture of an empty batch that fails nothing (an expert no
token was routed to) is no finding of this rule; nor is a failed warmup that cut some input to rows.
"""
from __future__ import annotations

import pytest
import torch

from workbench import doctor
from workbench.engine import GraphError, graph_pool_handle
from workbench.zoo.kit import capture, compare, replay

HIDDEN = 3


def capture_sizes(variant: str, max_bs: int) -> list[int]:
    sizes = sorted({max_bs - 1, max_bs})
    return [s for s in sizes if s > 0] if variant == "fix" else sizes


def argmax_kernel(logits: torch.Tensor) -> torch.Tensor:
    """One program per row: an empty grid is refused."""
    if logits.shape[0] == 0:
        raise GraphError("CUDA error: invalid configuration argument (argmax launched with grid (0,))")
    return logits.argmax(-1)


class Runner:
    def __init__(self, sizes: list[int], weight: torch.Tensor, *, refuse_empty: bool = True) -> None:
        self.sizes, self.weight, self.refuse_empty = sizes, weight, refuse_empty
        self.ids = torch.zeros(max(sizes), dtype=torch.int64)
        self.scale = torch.ones(max(sizes), 1)
        self.graphs = {}
        pool = graph_pool_handle("cpu")
        for size in sizes:
            self.graphs[size] = capture(lambda size=size: self.forward(size), device="cpu", pool=pool,
                                        name=f"decode bs={size}", owner="Runner",
                                        static={"ids": self.ids, "scale": self.scale})

    def forward(self, size: int):
        logits = self.weight[self.ids[:size]] * self.scale[:size]
        return logits, (argmax_kernel(logits) if self.refuse_empty else logits.sum(-1))

    def __call__(self, ids: torch.Tensor):
        n = ids.shape[0]
        size = next(s for s in self.sizes if s >= n)
        self.ids[:n].copy_(ids)
        return replay(*self.graphs[size], real=n, size=size)[0][:n].clone()


def _workload(variant: str, *, refuse_empty: bool = True):
    weight = torch.arange(5 * HIDDEN, dtype=torch.float64).reshape(5, HIDDEN).sin()
    steps = [torch.tensor([i % 5]) for i in range(3)]

    def served():
        runner = Runner(capture_sizes(variant, max_bs=1), weight, refuse_empty=refuse_empty)
        return [runner(ids) for ids in steps]

    return lambda: compare("empty_batch", variant, "cpu", served, lambda: [weight[ids] for ids in steps])


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_warmup_that_fails_on_an_empty_capture_batch_is_an_undersized_buffer(variant):
    report = doctor.diagnose(_workload(variant))
    if variant == "fix":
        assert report.findings == [] and report.caught == [], report
        return
    assert len(report.caught) == 1 and report.caught[0].startswith("GraphError: CUDA error: invalid configuration")
    (finding,) = report.findings
    assert finding.kind == "undersized-buffer" and finding.tensor == "ids: [0]", finding
    assert "in forward: logits = self.weight[self.ids[:size]]" in finding.source, finding
    assert "(`ids`, `scale`) was cut to no rows" in finding.evidence, finding


def test_an_empty_capture_batch_that_fails_nothing_is_not_this_finding():
    """Captured for no data on purpose and never served rows: the run ends well."""
    report = doctor.diagnose(_workload("bug", refuse_empty=False))
    assert report.caught == [] and all(f.kind != "undersized-buffer" for f in report.findings), report


def test_a_failed_warmup_that_cut_rows_of_some_input_is_not_an_empty_batch():
    """The same refusal, of a batch that is not empty: the captured code cut rows of its input and
    then emptied what it computed itself. The error has another cause than the capture's batch."""
    weight, ids = torch.zeros(5, HIDDEN), torch.zeros(2, dtype=torch.int64)

    def served():
        capture(lambda: argmax_kernel(weight[ids[:2]][:0]), device="cpu", name="decode bs=2", owner="Runner",
                static={"ids": ids})
        return []

    report = doctor.diagnose(lambda: compare("not_empty", "bug", "cpu", served, lambda: []))
    assert len(report.caught) == 1 and report.findings == [], report
