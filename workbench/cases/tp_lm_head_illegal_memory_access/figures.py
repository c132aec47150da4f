"""Case 03's figures: agreement with eager per scenario, token matches, the gathered weight's
memory timeline, step times, and one step's tokens."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Rectangle

from ... import plots
from .config import (BUG_RELEASE, BUG_REUSE, FIX, GATHER_IN_CAPTURE, PHASE_LABELS, PHASES, TP1_BUG,
                     TP_SIZE, CaseResults)

_STYLE = {  # scenario -> (colour, linestyle, marker)
    TP1_BUG.name: (plots.COLORS["bug"], ":", "s"),
    FIX.name: (plots.COLORS["fix"], "-", "o"),
    GATHER_IN_CAPTURE.name: (plots.COLORS["fix"], "--", "^"),
    BUG_REUSE.name: (plots.COLORS["bug"], "-", "o"),
    BUG_RELEASE.name: (plots.COLORS["bug"], "none", "X"),
}


def plot_agreement(res: CaseResults) -> plt.Figure:
    """Per step: the fraction of draft tokens from graph replays equal to eager's. Left, the bug at
    TP=1 and TP=2; right, the two fixes at TP=2."""
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2), sharey=True)
    panels = ((axes[0], (res.tp1_bug, res.bug_reuse, res.bug_release), "bug: TP=1 vs TP=2"),
              (axes[1], (res.fix, res.gather_in_capture), f"fixes at TP={TP_SIZE}"))
    for ax, runs, title in panels:
        for r in runs:
            color, ls, marker = _STYLE[r.scenario.name]
            if r.failure is not None:
                ax.plot([r.failed_step], [0.0], marker=marker, markersize=13, color=color, linestyle="none",
                        label=f"{r.scenario.name}:\n{r.failure.replace('_', ' ')} at step {r.failed_step}")
                continue
            ys = r.agreement_per_step
            hollow = ls == "--"     # drawn over a solid line of the same colour: keep that one visible
            ax.step(np.arange(len(ys)), ys, where="mid", color=color, linestyle=ls, marker=marker,
                    markersize=8 if hollow else 4, markerfacecolor="none" if hollow else color,
                    label=f"{r.scenario.name}: {r.agreement:.1%}")
        ax.set_ylim(-0.08, 1.08)
        ax.set_xlabel("serving step (one graph replay each)")
        ax.set_title(title)
        ax.legend(loc="center right", fontsize="small")
    axes[0].set_ylabel("draft tokens equal to eager")
    fig.suptitle(f"Draft tokens from centroid-graph replays vs eager ({res.device})")
    fig.tight_layout()
    return fig


def plot_token_match(res: CaseResults) -> plt.Figure:
    """Row x step: does each draft token equal eager's? Bug with the block reused vs the fix."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    rows = max(res.settings.sizes)
    for ax, r in zip(axes, (res.bug_reuse, res.fix)):
        grid = np.full((rows, len(r.graph_tokens)), np.nan)
        for step, (g, e) in enumerate(zip(r.graph_tokens, r.eager_tokens)):
            grid[: len(g), step] = np.equal(g, e)
        plots.heatmap(ax, grid, xlabel="serving step", ylabel="draft row", vmin=0, vmax=1, cmap="RdYlGn",
                      title=f"{r.scenario.name}\n{r.agreement:.1%} equal eager",
                      colorbar_label="1 = equal to eager, 0 = different")
    fig.suptitle("Draft tokens, row by row (grey: row not in that step's batch)")
    fig.tight_layout()
    return fig


_STATE_COLOURS = {"alive": plots.COLORS["fix"], "ok": plots.COLORS["fix"], "pool": plots.COLORS["fix"],
                  "freed": plots.COLORS["padded"], "reused": plots.COLORS["bug"], "wrong": plots.COLORS["bug"],
                  "failed": plots.COLORS["bug"], "released": plots.COLORS["limit"], "n/a": "#ffffff"}


def plot_memory_timeline(res: CaseResults) -> plt.Figure:
    """The block the graphs read, phase by phase, for each scenario (measured on ``res.device``)."""
    rows = res.served
    fig, ax = plt.subplots(figsize=(15, 1.25 * len(rows) + 1.2))
    for y, r in enumerate(reversed(rows)):
        for x, phase in enumerate(PHASES):
            state, detail = r.timeline.get(phase, ("n/a", ""))
            colour = _STATE_COLOURS[state]
            ax.add_patch(Rectangle((x, y), 0.96, 0.9, facecolor=colour, alpha=0.85 if state != "n/a" else 1,
                                   edgecolor="#999999"))
            text = "" if state == "n/a" else f"{state}\n{detail}"
            ax.text(x + 0.48, y + 0.45, text, ha="center", va="center", fontsize=7.5,
                    color="white" if state in ("released", "reused", "wrong", "failed") else "black")
    ax.set_xlim(0, len(PHASES))
    ax.set_ylim(0, len(rows))
    ax.set_xticks(np.arange(len(PHASES)) + 0.48, [PHASE_LABELS[p] for p in PHASES], fontsize=8.5)
    ax.xaxis.tick_top()
    ax.set_yticks(np.arange(len(rows)) + 0.45, [r.scenario.name for r in reversed(rows)], fontsize=9)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_title(f"The gathered lm_head weight the centroid graphs read, phase by phase ({res.device})\n"
                 "green: alive or owned by the graphs' pools   orange: freed, address still in the graphs   "
                 "red: read as another tensor / wrong / failed   black: released", fontsize=9.5, pad=34)
    fig.tight_layout()
    return fig


def plot_step_time(res: CaseResults) -> plt.Figure:
    """Median time of one draft step, measured on rank 0 of the TP=2 ranks."""
    fig, ax = plt.subplots(figsize=(9, 4))
    labels = {k: k.replace(", ", ",\n", 1) for k in res.step_time_ms}   # 3 ways if a capture failed
    colours = {labels[k]: plots.COLORS["eager" if k.startswith("eager") else "fix"] for k in labels}
    plots.bars(ax, {labels[k]: v for k, v in res.step_time_ms.items()}, colors=colours,
               ylabel="ms per draft step (median)",
               fmt="{:.2f} ms",
               title=f"One draft step of {res.settings.timing_batch} rows at TP={TP_SIZE} ({res.device}"
                     + (", emulated graphs: replay re-runs each op in Python" if res.device == "cpu" else "") + ")")
    fig.tight_layout()
    return fig


def plot_step_tokens(res: CaseResults, step: int) -> plt.Figure:
    """One step, row by row: eager's draft token and the graphs' (bug reuse and fix)."""
    if not 0 <= step < len(res.bug_reuse.graph_tokens):
        raise ValueError(f"step must be in [0, {len(res.bug_reuse.graph_tokens)}), got {step}")
    eager = res.fix.eager_tokens[step]
    fig, ax = plt.subplots(figsize=(9, 3.6))
    x = np.arange(len(eager))
    ax.plot(x, eager, "s", color=plots.COLORS["eager"], markersize=10, label="eager")
    ax.plot(x, res.fix.graph_tokens[step], "o", color=plots.COLORS["fix"], label=FIX.name)
    ax.plot(x, res.bug_reuse.graph_tokens[step], "x", color=plots.COLORS["bug"], markersize=9, label=BUG_REUSE.name)
    ax.set_xlabel("draft row")
    ax.set_ylabel("token id")
    ax.set_title(f"Step {step}: {len(eager)} draft rows")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def summary_lines(res: CaseResults) -> list[str]:
    """One line per scenario, for printing under the figures."""
    lines = []
    for r in res.served:
        what = (f"{r.failure} at step {r.failed_step}" if r.failure else
                f"{r.agreement:.1%} of {sum(len(g) for g in r.graph_tokens)} draft tokens equal eager")
        lines.append(f"{r.scenario.name:40s} {what}")
    return lines


