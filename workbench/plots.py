"""Shared figure helpers. One colour means one state in every figure of every notebook.

Case modules compose these into their figures; notebooks only call the case's ``plot_*``.
"""
from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping, Sequence

import matplotlib
import matplotlib.pyplot as plt
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
FIGURES = pathlib.Path(__file__).resolve().parent.parent / "figures"


def save(fig: plt.Figure, case: str, name: str, enabled: bool = True) -> pathlib.Path | None:
    """Write ``figures/<case>/<name>.png`` (fixed dpi, tight box) and return the path.

    Not under ``WORKBENCH_FAST=1`` (the test runs): the committed figures are the full-size ones.
    """
    if not enabled or os.environ.get("WORKBENCH_FAST") == "1":
        return None
    path = FIGURES / case / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    return path


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
