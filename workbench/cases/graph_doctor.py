"""The graph doctor evaluated: the five cases (bug and fix) and three clean ``transformers`` models.

Each case's workload is its own scenario, made small: the runner or manager the case built, captured
and serving a few steps, nothing changed for the doctor. The expected finding names the op and the
user function where the upstream bug lives (or, for a missing kernel or a dead tensor, where the
graph reads it); every fix must give no finding at all.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import matplotlib.pyplot as plt
import numpy as np
import torch

from .. import doctor, plots
from ..dist import launch
from ..engine import GraphRunner, synchronize
from ..models.hf import tiny_model

CASES = ("01 roberta", "02 vit", "03 tp", "04 mamba", "05 lazy attention")
VARIANTS = ("bug", "fix")


@dataclasses.dataclass(frozen=True)
class Expected:
    """What the doctor should say about a case's bug: the kind, the op, and the user function
    (``file``, ``function``) of the source line it points at."""

    kind: str
    op: str
    file: str
    function: str

    def matches(self, finding: doctor.Finding) -> bool:
        location = finding.location
        return (finding.kind == self.kind and finding.op.startswith(self.op) and self.file in location
                and location.endswith(f"in {self.function}"))


EXPECTED = {
    "01 roberta": Expected("persistent-mutation", "aten.add_", "models/roberta.py", "replace_roberta_positions"),
    "02 vit": Expected("undersized-buffer", "aten.randn", "models/vit.py", "prepare_encoder_cudagraph_capture_inputs"),
    "03 tp": Expected("dangling-reference", "aten.", "models/mtp_head.py", "_select_and_score"),
    "04 mamba": Expected("stale-padding", "aten._to_copy", "models/mamba.py", "decode"),
    "05 lazy attention": Expected("warmup-divergence", "aten.", "models/split_kv.py", "plan_splits"),
}


# ----------------------------------------------------------------------------- the workloads
def _case01(variant: str, device: str) -> Callable[[], None]:
    from .roberta_positions import RobertaRunner
    from ..models.roberta import from_transformers

    def workload() -> None:
        hf = tiny_model("roberta", seed=0).to(device)
        runner = RobertaRunner(from_transformers(hf, variant, device), [1, 2, 4, 8], device=device,
                               cudagraph_mode="full")
        runner.capture()
        gen = torch.Generator().manual_seed(0)
        for length in (6, 3, 8, 5, 6):
            runner([torch.randint(3, hf.config.vocab_size, (length,), generator=gen).to(device)])
    return workload


def _case02(variant: str, device: str) -> Callable[[], None]:
    from . import vit_encoder as case

    def workload() -> None:
        manager = case.build_manager(variant, case.scaled_config(fast=True), min_budget=case.SCALED_MIN_BUDGET,
                                     device=device)
        manager.capture()
        case.run_stream(manager, case.mixed_stream(3, seed=0, max_side=8), seed=0, repeats=1)
    return workload


def _case03_rank(variant: str, device: str) -> doctor.Report:
    """One TP rank: the proposer loads (all-gather, capture) and drafts for a few steps."""
    from .tp_lm_head import FAST, hidden_states, load_model
    from ..dist import local_device
    from ..models.mtp_head import CentroidsProposer

    device = local_device(device)

    def workload() -> None:
        proposer = CentroidsProposer(load_model(variant, FAST, device), device, FAST.sizes)
        proposer.load_model()
        for step, rows in enumerate((3, 8, 1)):
            proposer._greedy_sample(hidden_states(FAST, step, rows, device))
        synchronize(device)
    return doctor.diagnose(workload)


def _case04(variant: str, device: str) -> Callable[[], None]:
    from . import mamba_padding as case

    def workload() -> None:
        case.serve(variant, device)
    return workload


def _case05(variant: str, device: str) -> Callable[[], None]:
    from . import lazy_attention as case

    def workload() -> None:
        manager = case.CudaGraphManager(case.load_model(device), list(case.CAPTURE_SIZES), mode="FULL",
                                        variant=variant, device=device)
        manager.capture()
        case.generate(manager, case.sample_problems(7, seed=0))
    return workload


WORKLOADS = {"01 roberta": _case01, "02 vit": _case02, "04 mamba": _case04, "05 lazy attention": _case05}


# ----------------------------------------------------------------------------- evaluation
@dataclasses.dataclass
class Row:
    """One line of the evaluation table."""

    case: str
    variant: str
    report: doctor.Report
    seconds: float

    @property
    def kinds(self) -> list[str]:
        return sorted(self.report.kinds, key=doctor.KINDS.index)

    @property
    def expected(self) -> Expected | None:
        return EXPECTED[self.case] if self.variant == "bug" else None

    @property
    def hit(self) -> doctor.Finding | None:
        """The finding that matches the expectation (bug), if any."""
        exp = self.expected
        return None if exp is None else next((f for f in self.report.findings if exp.matches(f)), None)

    @property
    def correct(self) -> bool:
        """bug: the expected finding, and no finding of another kind; fix: no finding at all."""
        if self.expected is None:
            return not self.report.findings
        return self.hit is not None and set(self.kinds) == {self.expected.kind}

    def summary(self) -> str:
        f = self.hit if self.expected else None
        where = f"{f.op} at {f.location}" if f else ("-" if self.expected is None else "expected finding missing")
        return (f"{self.case:<18}{self.variant:<5}{', '.join(self.kinds) or 'no finding':<40}{where:<95}"
                f"{'correct' if self.correct else 'WRONG'}")


def evaluate(device: str = "cpu", cases: tuple[str, ...] = CASES, variants: tuple[str, ...] = VARIANTS,
             progress: bool = False) -> list[Row]:
    """Run ``diagnose`` on every case and variant (case 03 on two tensor-parallel ranks)."""
    rows = []
    for case in cases:
        for variant in variants:
            if progress:
                print(f"diagnosing {case} ({variant})", flush=True)
            start = time.perf_counter()
            if case == "03 tp":
                report = launch(_case03_rank, 2, variant, device, device=device)[0]
            else:
                report = doctor.diagnose(WORKLOADS[case](variant, device))
            rows.append(Row(case, variant, report, time.perf_counter() - start))
    return rows


def clean_models(device: str = "cpu", names: tuple[str, ...] = ("roberta", "bert", "gpt2")) -> dict[str, doctor.Report]:
    """``transformers`` RobertaModel, BertModel and GPT2Model through ``GraphRunner``: expected clean."""
    reports = {}
    for name in names:
        def make_runner(name=name) -> GraphRunner:
            model = tiny_model(name, seed=0).to(device).eval()
            return GraphRunner(lambda input_ids: model(input_ids=input_ids).last_hidden_state,
                               {"input_ids": ((8,), torch.int64)}, [1, 2, 4, 8], device=device)

        def make_batch(n: int, step: int) -> dict[str, torch.Tensor]:
            gen = torch.Generator().manual_seed(step)
            return {"input_ids": torch.randint(3, 100, (n, 8), generator=gen).to(device)}
        reports[name] = doctor.diagnose(make_runner, make_batch)
    return reports


# ----------------------------------------------------------------------------- figures
def plot_matrix(rows: list[Row]) -> plt.Figure:
    """Case x kind: what the doctor found for each bug and fix (expected cells outlined)."""
    labels = [f"{r.case} · {r.variant}" for r in rows]
    grid = np.zeros((len(rows), len(doctor.KINDS)))
    for i, r in enumerate(rows):
        for j, kind in enumerate(doctor.KINDS):
            if kind in r.report.not_checked:
                grid[i, j] = np.nan
            elif kind in r.report.kinds:
                grid[i, j] = 1.0
    fig, ax = plt.subplots(figsize=(9.5, 0.45 * len(rows) + 1.8))
    cmap = plt.matplotlib.colors.ListedColormap(["#f4f4f4", plots.COLORS["bug"]]).with_extremes(bad="#d9d9d9")
    ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=0, vmax=1, aspect="auto")
    for i, r in enumerate(rows):
        exp = r.expected
        for j, kind in enumerate(doctor.KINDS):
            text = "found" if grid[i, j] == 1 else ("not checked" if np.isnan(grid[i, j]) else "")
            ax.text(j, i, text, ha="center", va="center", fontsize=7,
                    color="white" if grid[i, j] == 1 else "#555555")
            if exp is not None and kind == exp.kind:
                ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, lw=2, ec=plots.COLORS["limit"]))
        ax.text(len(doctor.KINDS) - 0.35, i, "correct" if r.correct else "WRONG", va="center", fontsize=8,
                color=plots.COLORS["fix"] if r.correct else plots.COLORS["bug"])
    ax.set_xticks(range(len(doctor.KINDS)), doctor.KINDS, rotation=30, ha="right")
    ax.set_yticks(range(len(rows)), labels)
    ax.set_xlim(-0.5, len(doctor.KINDS) + 0.6)
    ax.set_title("Graph doctor on the five cases: findings per kind (outlined: the kind the bug should give)")
    fig.tight_layout()
    return fig
