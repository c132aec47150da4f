"""Case 02's figures: the per-item output over the config space, buffer allocation per budget,
graph-vs-eager correctness, latency, pruning widths and the capture plan."""
from __future__ import annotations

import textwrap

import matplotlib
import matplotlib.pyplot as plt
import numpy as np

from .. import VARIANTS
from ... import plots
from .scenario import SCALED_MIN_BUDGET, TOLERANCE, plan, scaled_config
from .upstream import generate_budgets, per_item_output
def _outline(ax, region: np.ndarray, color: str, linestyle: str = "-") -> None:
    """Draw the cell edges between ``region`` (bool, [row, col]) and the cells outside it."""
    rows, cols = region.shape
    for r, c in zip(*np.nonzero(region)):
        for dr, dc, xs, ys in ((1, 0, (c - .5, c + .5), (r + .5, r + .5)), (-1, 0, (c - .5, c + .5), (r - .5, r - .5)),
                               (0, 1, (c + .5, c + .5), (r - .5, r + .5)), (0, -1, (c - .5, c - .5), (r - .5, r + .5))):
            nr, nc = r + dr, c + dc
            if 0 <= nr < rows and 0 <= nc < cols and not region[nr, nc]:
                ax.plot(xs, ys, color=color, linewidth=2.2, linestyle=linestyle)


def plot_per_item_heatmap(data: dict) -> plt.Figure:
    """Per-item output at the smallest budget over (min budget, batch size): bug vs fix."""
    sizes = data["sizes"]
    n = len(sizes)
    clamped = np.array([[batch > lo for lo in sizes] for batch in sizes])
    marks = {(64, 256): "vLLM defaults (64, 16384)"}
    for fast in (True, False):
        top = scaled_config(fast).max_num_batched_tokens
        marks[(SCALED_MIN_BUDGET, top // SCALED_MIN_BUDGET)] = f"scaled run (8, {top})"
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.6))
    vmax = np.log2(max(sizes))
    for ax, variant in zip(axes, VARIANTS):
        per = np.array(data[variant], dtype=float)
        shown = np.where(per > 0, np.log2(np.maximum(per, 1)), np.nan)
        title = {"bug": "bug: min_budget // B  (B = max_budget // min_budget)",
                 "fix": "fix: B clamped to min_budget, ceiling division"}[variant]
        plots.heatmap(ax, shown, xlabel="smallest token budget (model min_budget)",
                      ylabel="batch size B = max_budget // min_budget", title=title, vmin=0, vmax=vmax,
                      colorbar_label="log2(tokens per synthetic item)")
        zero = per == 0
        if zero.any():
            for r, c in zip(*np.nonzero(zero)):
                ax.add_patch(matplotlib.patches.Rectangle((c - .5, r - .5), 1, 1, fill=False, hatch="xx",
                                                          edgecolor="#999999", linewidth=0))
            _outline(ax, zero, plots.COLORS["bug"])
            ax.text(0.03, 0.97, "0 tokens per item:\nreshape crash at the first capture", transform=ax.transAxes,
                    ha="left", va="top", color=plots.COLORS["bug"], fontsize=9,
                    bbox={"facecolor": "white", "alpha": 0.9, "edgecolor": plots.COLORS["bug"]})
        else:
            _outline(ax, clamped, plots.COLORS["fix"], linestyle="--")
            ax.text(0.03, 0.97, "above the dashed line: B clamped\nto min_budget (1 token per item)",
                    transform=ax.transAxes, ha="left", va="top", color=plots.COLORS["fix"], fontsize=9,
                    bbox={"facecolor": "white", "alpha": 0.9, "edgecolor": plots.COLORS["fix"]})
        for r in range(n):
            for c in range(n):
                if per[r, c] > 0:
                    ax.text(c, r, str(int(per[r, c])), ha="center", va="center", fontsize=8,
                            color="white" if np.log2(per[r, c]) < vmax / 2 else "black")
        ticks = [str(s) for s in sizes]
        ax.set_xticks(range(n), ticks, rotation=45)
        ax.set_yticks(range(n), ticks)
        for (lo, batch), label in marks.items():
            if lo in sizes and batch in sizes:
                x, y = sizes.index(lo), sizes.index(batch)
                ax.plot(x, y, marker="o", markersize=15, markerfacecolor="none",
                        markeredgecolor=plots.COLORS["limit"], markeredgewidth=2)
                ax.annotate(label, (x, y), xytext=(12, -4), textcoords="offset points", fontsize=8,
                            color=plots.COLORS["limit"], bbox={"facecolor": "white", "alpha": 0.85, "pad": 1,
                                                               "edgecolor": "none"})
    fig.suptitle("Tokens per synthetic capture item at the smallest budget, auto config (grey = 0)", fontsize=11)
    fig.tight_layout()
    return fig


def _allocation_bars(ax, budgets: list[int], batch: int, merge: int, title: str) -> None:
    """Buffer patches as a share of a full batch's patches, floor vs ceiling, per budget."""
    x = np.arange(len(budgets))
    need = np.array([b * merge ** 2 for b in budgets])
    for variant, shift in (("bug", -0.2), ("fix", 0.2)):
        alloc = np.array([per_item_output(b, batch, variant) * batch * merge ** 2 for b in budgets])
        label = {"bug": "floor (bug)", "fix": "ceiling (fix)"}[variant]
        rects = ax.bar(x + shift, 100 * alloc / need, 0.4, color=plots.COLORS[variant], label=label)
        for r, a, n in zip(rects, alloc, need):
            ax.annotate(f"{a}", (r.get_x() + r.get_width() / 2, r.get_height()), ha="center", va="bottom",
                        fontsize=8, rotation=90, xytext=(0, 2), textcoords="offset points",
                        bbox={"facecolor": "white", "alpha": 0.8, "pad": 0.5, "edgecolor": "none"})
    ax.axhline(100, color=plots.COLORS["limit"], linestyle="--", linewidth=1.2,
               label="needed: a full batch (budget x merge^2 patches)")
    ax.set_xticks(x, [f"{b}\n({n} p.)" for b, n in zip(budgets, need)], fontsize=8)
    ax.set_ylim(0, 200)
    ax.set_xlabel("token budget (patches of a full batch)")
    ax.set_ylabel("buffer patches, % of a full batch (bar labels: patches)")
    ax.set_title(title)
    ax.legend(fontsize="small", loc="upper right")


def plot_allocation(result: dict) -> plt.Figure:
    """Allocated vs needed patches per budget: the run config, and vLLM scale (B = 156)."""
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    _allocation_bars(axes[0], result["token_budgets"], result["max_batch_size"], 2,
                     f"this run: budgets {result['token_budgets']}, B = {result['max_batch_size']}")
    _allocation_bars(axes[1], generate_budgets(256, 10000), 156, 2,
                     "vLLM scale: max_num_batched_tokens = 10000, B = 156 (user-given)")
    fig.tight_layout()
    return fig


def plot_correctness(stream: dict, sweep: dict[str, dict]) -> plt.Figure:
    """Left: mixed stream through the fix's graphs, per-image max |graph - eager|. Right: single
    images of 1..100 tokens on the under-sized config: predicted vs observed replay failures."""
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
    rounding = plots.ROUNDING
    ax = axes[0]
    diffs = plots.rounded(stream["max_abs_diff"])
    ax.scatter(np.arange(len(diffs)), diffs, color=plots.COLORS["fix"], s=18, label="fix: graph vs eager")
    ax.axhline(TOLERANCE, color=plots.COLORS["limit"], linestyle="--", linewidth=1, label=f"tolerance {TOLERANCE:g}")
    ax.set_yscale("log")
    ax.set_ylim(rounding / 2, 1)
    ax.set_xlabel("image in the stream")
    ax.set_ylabel(f"max |graph - eager| (< {rounding:g}: rounding, drawn at it)")
    ax.set_title(f"mixed stream: {len(diffs)} images, {len(stream['batches'])} packed batches")
    ax.legend(fontsize="small")
    ax = axes[1]
    tokens = np.array(sweep["bug"]["sweep_tokens"])
    predicted = np.array(sweep["bug"]["predicted_crash"])
    for t in tokens[predicted]:
        ax.axvspan(t - 0.5, t + 0.5, color=plots.COLORS["predicted"], alpha=0.25, linewidth=0)
    ax.fill_between([], [], color=plots.COLORS["predicted"], alpha=0.25, label="predicted: tokens > B * floor(budget / B)")
    for variant, marker in (("fix", "o"), ("bug", "x")):
        res = sweep[variant]
        ok = [(t, plots.rounded([d])[0]) for t, d in zip(res["sweep_tokens"], res["sweep_max_abs_diff"]) if d is not None]
        if ok:
            ax.scatter(*zip(*ok), color=plots.COLORS[variant], marker=marker, s=14, label=f"{variant}: replayed, diff")
        crashed = [t for t, c in zip(res["sweep_tokens"], res["sweep_crashed"]) if c]
        if crashed:
            ax.scatter(crashed, [0.3] * len(crashed), color=plots.COLORS[variant], marker="v", s=30,
                       label=f"{variant}: replay raised ({len(crashed)})")
    for b in sweep["bug"]["token_budgets"]:
        ax.axvline(b + 0.5, color=plots.COLORS["limit"], linewidth=0.6, linestyle=":")
    ax.set_yscale("log")
    ax.set_ylim(rounding / 2, 1)
    ax.set_xlabel("output tokens of a single image (budget boundaries dotted)")
    ax.set_ylabel(f"max |graph - eager| (< {rounding:g}: rounding, drawn at it)")
    ax.set_title(f"under-sized buffers: budgets {sweep['bug']['token_budgets']}, B = {sweep['bug']['max_batch_size']}")
    ax.legend(fontsize="small", loc="center left")
    fig.tight_layout()
    return fig


def plot_latency(stream: dict, device: str) -> plt.Figure:
    """P50/P99 latency per packed batch, graph path vs eager encoder."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.3))
    values = {"eager P50": stream["eager_p50_ms"], "graph P50": stream["graph_p50_ms"],
              "eager P99": stream["eager_p99_ms"], "graph P99": stream["graph_p99_ms"]}
    colors = {k: plots.COLORS["eager" if k.startswith("eager") else "fix"] for k in values}
    plots.bars(axes[0], values, colors=colors, ylabel="ms per packed batch", fmt="{:.2f}",
               title=f"{device}: {len(stream['graph_ms'])} timed batch runs")
    repeats = len(stream["graph_ms"]) // len(stream["batches"])
    tokens = np.repeat([b["tokens"] for b in stream["batches"]], repeats)
    axes[1].scatter(tokens, stream["eager_ms"], color=plots.COLORS["eager"], s=12, label="eager")
    axes[1].scatter(tokens, stream["graph_ms"], color=plots.COLORS["fix"], s=12, label="graph (fix)")
    axes[1].set_xlabel("output tokens in the batch")
    axes[1].set_ylabel("ms")
    axes[1].set_title("per batch")
    axes[1].legend(fontsize="small")
    if device == "cpu":
        fig.text(0.5, -0.03, "CPU: the emulated graph replays every recorded op from Python and runs the whole "
                 "padded budget; this measures the emulator, not a CUDA graph's launch savings.",
                 ha="center", fontsize=9)
    fig.tight_layout()
    return fig


def plot_pruning(widths: dict) -> plt.Figure:
    """Embedding width of an image with EVS pruning on: eager vs the graph path of each variant."""
    fig, ax = plt.subplots(figsize=(7, 3.8))
    values = {f"eager\n(encoder {widths['raw_encoder']} + 5 mrope)": widths["eager"],
              "bug\n(graph path)": widths["bug"], "fix\n(eager fallback)": widths["fix"]}
    colors = dict(zip(values, (plots.COLORS["eager"], plots.COLORS["bug"], plots.COLORS["fix"])))
    plots.bars(ax, values, colors=colors, fmt="{:.0f}", ylabel="channels per image token",
               title="pruning on: embedding width per image token", ylim=(0, widths["eager"] * 1.2))
    fig.tight_layout()
    return fig


def plot_plan(min_budget: int, max_budget: int, max_items: int = 0) -> plt.Figure:
    """Both variants' capture plans for one config: tokens per item and allocation per budget."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    for ax, variant in zip(axes, VARIANTS):
        p = plan(min_budget, max_budget, variant, max_items=max_items)
        if p["error"]:
            ax.text(0.5, 0.5, textwrap.fill(p["error"], 70), ha="center", va="center", fontsize=8.5,
                    color=plots.COLORS[variant], transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_title(f"{variant}: refused when the manager is built")
            continue
        budgets = [r["budget"] for r in p["rows"]]
        x = np.arange(len(budgets))
        ax.bar(x, [r["allocated_tokens"] for r in p["rows"]], color=plots.COLORS[variant], label="allocated tokens")
        ax.scatter(x, budgets, marker="_", s=600, color=plots.COLORS["limit"], zorder=3, label="budget")
        for xi, r in zip(x, p["rows"]):
            zero = r["per_item_output"] == 0
            ax.annotate(f"{r['per_item_output']}/item", (xi, r["allocated_tokens"] or r["budget"]), ha="center",
                        va="bottom", fontsize=8, color=plots.COLORS["bug"] if zero else "black",
                        fontweight="bold" if zero else "normal")
        ax.set_xticks(x, [str(b) for b in budgets], rotation=30)
        ax.set_yscale("log")
        ax.set_xlabel("token budget")
        ax.set_ylabel("tokens in the graph's buffers")
        ax.set_title(f"{variant}: path ({p['path']}), B = {p['max_batch_size']}")
        ax.legend(fontsize="small")
    fig.tight_layout()
    return fig

