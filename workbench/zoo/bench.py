"""The detector benchmark: every detector on every zoo program, bug and fix, as one tidy table.

A row is one (program, variant, detector): whether it found something, the kind and site it gave,
and whether those are the program's expected kind and site. ``summary`` condenses the table per
detector (bugs found, right kind, right site, findings on fixes); the two figures show the doctor's
kinds against the expected ones, and which detector finds which bug. Every number comes from running
the detectors.
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np

from .. import plots
from ..detectors import DETECTORS, detect
from .. import cases as registry
from ..doctor import KINDS
from . import VARIANTS, engine_gap, latent, names, program

NO_FINDING = "no finding"
# The five cases' scenarios (notebooks 01-05) as the doctor's evaluation runs them; a case needing
# several tensor-parallel ranks (03) is left out here. They expose no eager reference and no captured
# callable, so only the detectors that watch a workload as it runs apply to them.
CASES = tuple(case.id for case in registry.CASES if case.gpus == 1)
CASE_DETECTORS = ("input_liveness", "doctor")


def benchmark(device: str = "cpu", programs: Sequence[str] | None = None,
              detectors: Sequence[str] = DETECTORS) -> list[dict]:
    """One row per (program, variant, detector)."""
    rows = []
    for name in (names() if programs is None else programs):
        prog = program(name)
        for variant in VARIANTS:
            for det in detectors:
                start = time.perf_counter()
                d = detect(det, prog, variant, device)
                rows.append({
                    "program": name, "family": prog.FAMILY, "expected_kind": prog.KIND, "expected_site": prog.SITE,
                    "variant": variant, "detector": det, "found": d.found, "kind": d.kind, "site": d.site,
                    "right_kind": d.found and d.kind == prog.KIND,
                    "right_site": d.found and d.site is not None and d.site.endswith(f" in {prog.SITE}"),
                    "engine_gap": engine_gap(name, variant) or (latent(name) if variant == "bug" else None),
                    "detail": d.detail,
                    "seconds": time.perf_counter() - start})
    return rows


class _Case:
    """A case scenario in the shape detectors take: ``run(variant, device)``, ``KIND``, ``SITE``."""

    def __init__(self, case: str) -> None:
        from ..cases import graph_doctor
        self.case, self.workload = case, graph_doctor.workload
        expected = graph_doctor.expected(case)
        self.KIND, self.SITE = expected.kind, expected.function
        self.errors: list[str] = []

    def run(self, variant: str, device: str = "cpu") -> None:
        try:
            self.workload(self.case, variant, device)()
        except Exception as e:  # noqa: BLE001 - a case's failure is what its bug variant does
            self.errors.append(f"{type(e).__name__}: {e}")


def case_benchmark(device: str = "cpu", cases: Sequence[str] = CASES) -> list[dict]:
    """The detectors that watch a running workload, on the five cases' scenarios (bug and fix)."""
    rows = []
    for case in cases:
        for variant in VARIANTS:
            for det in CASE_DETECTORS:
                prog = _Case(case)
                d = detect(det, prog, variant, device)
                rows.append({"case": case, "variant": variant, "detector": det, "found": d.found, "kind": d.kind,
                             "expected_kind": prog.KIND, "right_kind": d.found and d.kind == prog.KIND,
                             "right_site": d.found and d.site is not None and d.site.endswith(f" in {prog.SITE}"),
                             "detail": d.detail})
    return rows


def case_markdown(rows: list[dict]) -> str:
    lines = ["| case | variant | detector | found | kind given | expected kind | right site |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['variant']} | {r['detector']} | {'yes' if r['found'] else 'no'} | "
              f"{r['kind'] or '-'} | {r['expected_kind'] if r['variant'] == 'bug' else '(none: fix)'} | "
              f"{'yes' if r['right_site'] else 'no'} |" for r in rows]
    return "\n".join(lines)


def summary(rows: list[dict]) -> list[dict]:
    """Per detector: bugs found (of those the CPU reproduces), right kind, right site, findings on fixes."""
    out = []
    for det in dict.fromkeys(r["detector"] for r in rows):
        bugs = [r for r in rows if r["detector"] == det and r["variant"] == "bug" and r["engine_gap"] is None]
        fixes = [r for r in rows if r["detector"] == det and r["variant"] == "fix" and r["engine_gap"] is None]
        out.append({"detector": det, "bugs": len(bugs), "found": sum(r["found"] for r in bugs),
                    "right_kind": sum(r["right_kind"] for r in bugs), "right_site": sum(r["right_site"] for r in bugs),
                    "fixes": len(fixes), "findings_on_fixes": sum(r["found"] for r in fixes)})
    return out


def markdown(summary_rows: list[dict]) -> str:
    lines = ["| detector | bugs found | right kind | right site | findings on fixes |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {s['detector']} | {s['found']} / {s['bugs']} | {s['right_kind']} | {s['right_site']} | "
              f"{s['findings_on_fixes']} / {s['fixes']} |" for s in summary_rows]
    return "\n".join(lines)


def misses(rows: list[dict], detector: str = "doctor") -> list[str]:
    """One line per bug (the CPU reproduces) not found with its expected kind, and per finding on a
    fix; a single line saying so when there is none."""
    lines = [f"{r['program']:<45} expected {r['expected_kind']:<22} got {r['kind'] or 'no finding'}"
             for r in rows if r["detector"] == detector and r["variant"] == "bug" and not r["engine_gap"]
             and not r["right_kind"]]
    lines += [f"finding on a fix: {r['program']}: {r['detail']}"
              for r in rows if r["detector"] == detector and r["variant"] == "fix" and r["found"]]
    return lines or [f"none: {detector} gives every bug its expected kind and no fix a finding"]


def confusion(rows: list[dict], detector: str = "doctor") -> tuple[list[str], list[str], np.ndarray]:
    """``(expected kinds, given kinds, counts)`` over the bug variants the CPU reproduces."""
    bugs = [r for r in rows if r["detector"] == detector and r["variant"] == "bug" and r["engine_gap"] is None]
    expected = [k for k in KINDS if any(r["expected_kind"] == k for r in bugs)]
    given = [*KINDS, NO_FINDING]
    counts = Counter((r["expected_kind"], r["kind"] if r["found"] else NO_FINDING) for r in bugs)
    grid = np.array([[counts[(e, g)] for g in given] for e in expected], dtype=float)
    return expected, given, grid


def plot_confusion(rows: list[dict], detector: str = "doctor") -> plt.Figure:
    """Expected kind (rows) against the kind the detector gave (columns), counts of zoo bugs."""
    expected, given, grid = confusion(rows, detector)
    fig, ax = plt.subplots(figsize=(9.0, 0.5 * len(expected) + 2.4))
    cmap = plt.matplotlib.colors.LinearSegmentedColormap.from_list("counts", ["#f4f4f4", plots.COLORS["real"]])
    ax.imshow(grid, cmap=cmap, aspect="auto", vmin=0, vmax=max(1.0, grid.max()))
    for i, e in enumerate(expected):
        for j, g in enumerate(given):
            if grid[i, j]:
                ax.text(j, i, f"{grid[i, j]:.0f}", ha="center", va="center", fontsize=9,
                        color="white" if grid[i, j] >= grid.max() / 2 else "black")
            if e == g:
                ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, lw=2, ec=plots.COLORS["limit"]))
    ax.set_xticks(range(len(given)), given, rotation=30, ha="right")
    ax.set_yticks(range(len(expected)), expected)
    ax.set_xlabel(f"kind given by {detector}")
    ax.set_ylabel("expected kind (program header)")
    ax.set_title(f"Zoo bugs: expected kind vs the kind {detector} gave (outlined: agreement)")
    fig.tight_layout()
    return fig


def plot_matrix(rows: list[dict]) -> plt.Figure:
    """Program (bug variant) x detector: missed, found, found with the right kind; a cross marks
    a finding on the fix variant, a dot a program with a variant the CPU emulation cannot reproduce yet."""
    progs = list(dict.fromkeys(r["program"] for r in rows))
    dets = list(dict.fromkeys(r["detector"] for r in rows))
    cell = {(r["program"], r["variant"], r["detector"]): r for r in rows}
    grid = np.array([[(2 if cell[p, "bug", d]["right_kind"] else 1) if cell[p, "bug", d]["found"] else 0
                      for d in dets] for p in progs], dtype=float)
    fig, ax = plt.subplots(figsize=(8.5, 0.36 * len(progs) + 2.2))
    cmap = plt.matplotlib.colors.ListedColormap(["#f4f4f4", "#9ecae1", plots.COLORS["real"]])
    ax.imshow(grid, cmap=cmap, vmin=0, vmax=2, aspect="auto")
    for i, p in enumerate(progs):
        for j, d in enumerate(dets):
            if cell[p, "fix", d]["found"]:
                ax.text(j, i, "×", ha="center", va="center", fontsize=12, color=plots.COLORS["bug"])
            if cell[p, "bug", d]["engine_gap"] or cell[p, "fix", d]["engine_gap"]:
                ax.text(j + 0.35, i - 0.25, "•", ha="center", va="center", fontsize=9, color=plots.COLORS["limit"])
    ax.set_xticks(range(len(dets)), dets, rotation=20, ha="right")
    ax.set_yticks(range(len(progs)), [f"{p}  [{cell[p, 'bug', dets[0]]['expected_kind']}]" for p in progs], fontsize=8)
    ax.set_xticks(np.arange(len(dets) + 1) - 0.5, minor=True)
    ax.set_yticks(np.arange(len(progs) + 1) - 0.5, minor=True)
    ax.grid(which="minor", color="white", linewidth=1.2)
    ax.tick_params(which="minor", length=0)
    legend = [plt.matplotlib.patches.Patch(fc="#f4f4f4", ec="#bbbbbb", label="bug missed"),
              plt.matplotlib.patches.Patch(color="#9ecae1", label="found, kind not given or other"),
              plt.matplotlib.patches.Patch(color=plots.COLORS["real"], label="found, expected kind"),
              plt.matplotlib.lines.Line2D([], [], ls="", marker="x", color=plots.COLORS["bug"],
                                          label="finding on the fix"),
              plt.matplotlib.lines.Line2D([], [], ls="", marker="o", ms=3, color=plots.COLORS["limit"],
                                          label="not counted: latent on this torch, or a CPU engine gap")]
    ax.legend(handles=legend, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, frameon=False, fontsize=8)
    ax.set_title("Which detector finds which zoo bug", pad=40)
    fig.tight_layout()
    return fig


def explore(rows: list[dict]):
    """A drop-down over the zoo: each program's header and what every detector said (JupyterLab only)."""
    import ipywidgets as widgets
    from IPython.display import display

    progs = list(dict.fromkeys(r["program"] for r in rows))
    pick, out = widgets.Dropdown(options=progs, description="program"), widgets.Output()

    def show(change=None) -> None:
        out.clear_output()
        with out:
            print(program(pick.value).__doc__)
            for r in (r for r in rows if r["program"] == pick.value):
                print(f"{r['variant']:<4} {r['detector']:<15} {'FOUND' if r['found'] else 'nothing':<8} "
                      f"{r['kind'] or '':<20} {r['detail']}")
    pick.observe(show, names="value")
    show()
    box = widgets.VBox([pick, out])
    display(box)
    return box
