"""Shared figure helpers. One colour means one state in every figure of every notebook.

Case modules compose these into their figures; notebooks only call the case's ``plot_*``.
Two house rules hold for every figure made once this module is imported: no text is smaller
than ``MIN_FONT_PT``, and a committed PNG under ``figures/`` is rewritten only by the run meant to
regenerate it (see ``figure_policy``); every other run writes under ``build/figures/``.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Iterable, Mapping, Sequence

import matplotlib
import matplotlib.pyplot as plt
import matplotlib.text
import numpy as np

# The meaning of each colour, across all figures.
COLORS = {
    "real": "#1f77b4",      # real rows / requests
    "padded": "#ff7f0e",    # padded rows
    "bug": "#d62728",       # the upstream code before the fix
    "fix": "#2ca02c",       # after the fix
    "eager": "#7f7f7f",     # eager reference (no graphs)
    "limit": "#000000",     # hard limits (table sizes, budgets)
    "predicted": "#9467bd", # predictions from the mechanism
}
DPI = 110
MIN_FONT_PT = 8.0   # the smallest text size readable in a saved PNG and in JupyterLab
ROOT = pathlib.Path(__file__).resolve().parent.parent
FIGURES = ROOT / "figures"                 # committed: what the README and the notebooks show
BUILD_FIGURES = ROOT / "build" / "figures"  # everything else (git-ignored)
# Regenerate the committed copies of measured figures too (timings, live addresses): they differ
# on every run, so a plain default run leaves them alone.
SAVE_MEASURED_ENV = "WORKBENCH_SAVE_MEASURED"


@dataclasses.dataclass(frozen=True)
class FigurePolicy:
    default_run: bool                       # full-size run with every parameter at its committed default
    measured: frozenset[str] = frozenset()  # figure names whose pixels change on every run


_POLICIES: dict[str, FigurePolicy] = {}


def figure_policy(case: str, *, default_run: bool, measured: Iterable[str] = ()) -> FigurePolicy:
    """Declare, from a notebook's setup cell, whether this run regenerates ``case``'s committed
    figures. Without a declaration a case's figures go to ``build/figures/``, so a stray or
    parameterised run can never overwrite a committed figure."""
    policy = FigurePolicy(bool(default_run), frozenset(measured))
    _POLICIES[case] = policy
    return policy


def figure_path(case: str, name: str) -> pathlib.Path:
    """Where ``save`` writes ``case``/``name``: ``figures/`` only for a declared default run that is
    not a ``WORKBENCH_FAST=1`` run, and for a measured figure only with ``WORKBENCH_SAVE_MEASURED=1``."""
    policy = _POLICIES.get(case, FigurePolicy(default_run=False))
    committed = (policy.default_run and os.environ.get("WORKBENCH_FAST") != "1"
                 and (name not in policy.measured or os.environ.get(SAVE_MEASURED_ENV) == "1"))
    return (FIGURES if committed else BUILD_FIGURES) / case / f"{name}.png"


def save(fig: plt.Figure, case: str, name: str, enabled: bool = True) -> pathlib.Path | None:
    """Write ``case``/``name``.png (fixed dpi, tight box) where ``figure_path`` says; return the path."""
    if not enabled:
        return None
    path = figure_path(case, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    return path


def _minimum_font(fig: plt.Figure) -> None:
    """Figure hook (rcParams ``figure.hooks``): before each draw, raise every text smaller than
    ``MIN_FONT_PT`` to it. Done at draw time because texts, tick labels and legends are added after
    the figure is created; new ticks copy the first tick's label size, which is raised with the rest."""
    draw = fig.draw

    def draw_with_minimum_font(renderer):
        for text in fig.findobj(matplotlib.text.Text):
            if text.get_fontsize() < MIN_FONT_PT:
                text.set_fontsize(MIN_FONT_PT)
        return draw(renderer)

    fig.draw = draw_with_minimum_font


def small_texts(fig: plt.Figure, min_pt: float = MIN_FONT_PT) -> list[tuple[str, float, float]]:
    """The visible texts of ``fig`` smaller than ``min_pt`` points, as (text, points, pixels at
    ``DPI``), sorted by size. Call it before the figure is drawn: it then reads the sizes the figure
    function asked for, which ``_minimum_font`` would raise at draw time into a layout made for
    smaller text (crowded cell labels, overlapping annotations); a figure function should ask for
    readable sizes itself."""
    if isinstance(min_pt, bool) or not isinstance(min_pt, (int, float)) or min_pt <= 0:
        raise ValueError(f"small_texts: min_pt must be a positive number of points, got {min_pt!r}")
    small = {(t.get_text(), t.get_fontsize()) for t in fig.findobj(matplotlib.text.Text)
             if t.get_visible() and t.get_text().strip() and t.get_fontsize() < min_pt}
    return sorted(((text, pt, pt * DPI / 72) for text, pt in small), key=lambda s: (s[1], s[0]))


if f"{__name__}:_minimum_font" not in matplotlib.rcParams["figure.hooks"]:
    matplotlib.rcParams["figure.hooks"] = [*matplotlib.rcParams["figure.hooks"], f"{__name__}:_minimum_font"]


# Differences below this are float32 rounding: their size depends on the CPU's kernels (vector
# width, GEMM blocking), not on the code, so figures draw them on one line and a committed figure
# stays the same on every machine where nothing but rounding differs.
ROUNDING = 3e-6


def rounded(diffs: Sequence[float]) -> np.ndarray:
    """Absolute differences for a log-scale plot: those below ``ROUNDING`` (exact zeros too) drawn at it."""
    return np.maximum(np.asarray(diffs, dtype=float), ROUNDING)


def worst(diffs: Sequence[float]) -> str:
    """The largest difference as a title reads it: its value, or that it is rounding only."""
    top = max(diffs, default=float("nan"))
    return f"< {ROUNDING:g} (rounding)" if top < ROUNDING else f"{top:.1e}"


def heatmap(ax: plt.Axes, values: np.ndarray, *, xlabel: str, ylabel: str, title: str,
            vmin: float | None = None, vmax: float | None = None, cmap: str | matplotlib.colors.Colormap = "viridis",
            colorbar_label: str | None = None) -> matplotlib.image.AxesImage:
    """``values[row, step]`` as an image; rows on y, steps on x; NaN cells shown in light grey."""
    cm = (matplotlib.colormaps[cmap] if isinstance(cmap, str) else cmap).with_extremes(bad="#dddddd")
    im = ax.imshow(np.ma.masked_invalid(np.asarray(values, dtype=float)), aspect="auto",
                   interpolation="nearest", origin="lower", cmap=cm, vmin=vmin, vmax=vmax)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    cb = ax.figure.colorbar(im, ax=ax)
    if colorbar_label:
        cb.set_label(colorbar_label)
    return im


def steps(ax: plt.Axes, series: Mapping[str, Sequence[float]], *, colors: Mapping[str, str] | None = None,
          xlabel: str = "step", ylabel: str = "", title: str = "", limit: float | None = None,
          limit_label: str = "limit") -> None:
    """Counters over steps as step plots, with an optional horizontal limit line."""
    for label, ys in series.items():
        color = (colors or {}).get(label)
        ax.step(np.arange(len(ys)), ys, where="post", label=label, color=color)
    if limit is not None:
        ax.axhline(limit, color=COLORS["limit"], linestyle="--", linewidth=1, label=limit_label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(loc="best", fontsize="small")


def bars(ax: plt.Axes, values: Mapping[str, float], *, errors: Mapping[str, float] | None = None,
         colors: Mapping[str, str] | None = None, ylabel: str = "", title: str = "",
         ylim: tuple[float, float] | None = None, fmt: str = "{:.3f}") -> None:
    """Labelled bars (e.g. accuracy eager / bug / fix), each annotated with its value."""
    labels = list(values)
    ys = [values[k] for k in labels]
    err = [errors[k] for k in labels] if errors else None
    cols = [(colors or {}).get(k, COLORS.get(k, "#333333")) for k in labels]
    rects = ax.bar(labels, ys, yerr=err, color=cols, capsize=4)
    for r, y in zip(rects, ys):
        ax.annotate(fmt.format(y), (r.get_x() + r.get_width() / 2, r.get_height()),
                    ha="center", va="bottom", fontsize="small")
    if ylim:
        ax.set_ylim(*ylim)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
