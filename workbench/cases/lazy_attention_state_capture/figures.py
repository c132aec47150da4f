"""Figures of case 05 and its explorer: the split plans each graph used, the error of one replay,
held-out accuracy and example generations."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from ... import plots
from .. import VARIANTS
from .scenario import CaseResult, Generation, LengthChange
from .task import parse_answer, render, render_answer

_PLAN_LABELS = {"eager": "needed: planned from the current lengths", "bug": "bug graph: the warmup's plan",
                "fix": "fix graph: plan recorded in the graph"}


def _draw_plans(ax: plt.Axes, x: float, plans: dict[str, np.ndarray], length: int, width: float = 0.26) -> None:
    """Stacked bars, one per plan, one segment per non-empty split; a dashed line at ``length``."""
    for j, (name, bounds) in enumerate(plans.items()):
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            if hi > lo:
                ax.bar(x + (j - 1) * width, hi - lo, bottom=lo, width=width * 0.9, color=plots.COLORS[name],
                       edgecolor="white", linewidth=1.5)
    ax.hlines(length, x - 1.6 * width, x + 1.6 * width, color=plots.COLORS["limit"], linestyles="--", linewidth=1.2)


def _plan_legend(fig: plt.Figure, prompt: bool = False) -> None:
    handles = [plt.Rectangle((0, 0), 1, 1, color=plots.COLORS[k]) for k in _PLAN_LABELS]
    handles.append(plt.Line2D([], [], color=plots.COLORS["limit"], linestyle="--"))
    labels = [*_PLAN_LABELS.values(), "current sequence length"]
    if prompt:
        handles.append(plt.Rectangle((0, 0), 1, 1, color=plots.COLORS["real"], alpha=0.12))
        labels.append("positions holding the prompt")
    fig.legend(handles, labels, loc="lower center", ncol=len(labels) // 2 + len(labels) % 2 if prompt else 2,
               fontsize="small", bbox_to_anchor=(0.5, 1.0))


def plot_plans(gens: dict[str, Generation], *, batch: int = 0) -> plt.Figure:
    """Per request of one decode batch and per decode step: the KV positions each split covers, as
    needed by the current length, as the bug graph read them, and as the fix graph read them."""
    lens = gens["eager"].seq_lens[batch]
    steps, n = lens.shape
    fig, axes = plt.subplots(1, n, figsize=(3.3 * n, 3.6), sharey=True, squeeze=False)
    for r, ax in enumerate(axes[0]):
        for step in range(steps):
            _draw_plans(ax, step, {"eager": gens["eager"].plan_needed[batch][step, r],
                                   "bug": gens["bug"].plan_used[batch][step, r],
                                   "fix": gens["fix"].plan_used[batch][step, r]}, lens[step, r])
        p = gens["eager"].problems[batch * gens["eager"].batch_size + r]
        ax.axhspan(0, len(p.prompt), color=plots.COLORS["real"], alpha=0.12, zorder=0)
        ax.set_title(f"request {r}: {render(p.prompt)}", fontsize="medium")
        ax.set_xticks(range(steps))
        ax.set_xlabel("decode step")
        ax.grid(axis="y", alpha=0.3)
    axes[0, 0].set_ylabel("KV-cache position")
    axes[0, 0].set_ylim(0, gens["eager"].seq_lens[batch].max() + 1)
    _plan_legend(fig, prompt=True)
    fig.tight_layout()
    return fig


def plot_length_change(lc: LengthChange) -> plt.Figure:
    """One replay after the lengths changed: the plans per request (left) and how far each
    request's logits are from eager attention's (right)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [3, 2]})
    for r, length in enumerate(lc.seq_lens):
        _draw_plans(left, r, {"eager": lc.plan_needed[r], "bug": lc.plan_used["bug"][r],
                              "fix": lc.plan_used["fix"][r]}, length)
    left.set_xticks(range(len(lc.seq_lens)), [f"request {r}\nlength {n}" for r, n in enumerate(lc.seq_lens)])
    left.set_ylabel("KV-cache position")
    left.set_title(f"split boundaries (graph captured with lengths {len(lc.seq_lens)})")
    left.grid(axis="y", alpha=0.3)
    x = np.arange(len(lc.seq_lens))
    floor = 1e-9            # an error of exactly 0 drawn at the floor of the log axis
    for j, name in enumerate(VARIANTS):
        err = np.maximum(lc.max_abs_error[name], floor)
        right.bar(x + (j - 0.5) * 0.38, err, width=0.36, color=plots.COLORS[name], label=f"{name} graph")
    right.set_yscale("log")
    right.set_ylim(floor / 2, 1e4)
    right.set_xticks(x, [f"length {n}" for n in lc.seq_lens])
    right.set_ylabel("max |logits - eager logits|")
    right.set_title("error of the replay (bars at 1e-9 are exact 0)")
    right.legend(fontsize="small", loc="upper left", ncol=2)
    _plan_legend(fig)
    fig.tight_layout()
    return fig


def plot_accuracy(result: CaseResult) -> plt.Figure:
    """Held-out exact-match accuracy, mean and std over eval-set seeds."""
    names = ["eager", "bug", "fix", "predicted"]
    labels = {"eager": "eager", "bug": "bug graph", "fix": "fix graph", "predicted": "bug, predicted"}
    fig, ax = plt.subplots(figsize=(6.5, 4))
    plots.bars(ax, {labels[k]: result.mean(k) for k in names}, errors={labels[k]: result.std(k) for k in names},
               colors={labels[k]: plots.COLORS[k] for k in names}, ylim=(0, 1.1), ylabel="exact-match accuracy",
               title=f"{result.n_problems} held-out problems x {len(result.seeds)} eval seeds (mean ± std)")
    return fig


def plot_generations(gens: dict[str, Generation], *, batch: int = 0) -> plt.Figure:
    """The generations of one batch: prompt, then eager / bug / fix output and the sum it states."""
    first = batch * gens["eager"].batch_size
    rows = range(first, min(first + gens["eager"].batch_size, len(gens["eager"].problems)))
    fig, ax = plt.subplots(figsize=(9, 0.5 + 0.45 * (len(rows) + 1)))
    ax.axis("off")
    columns = [("prompt", 0.0), ("eager", 0.24), ("bug", 0.5), ("fix", 0.76)]
    for name, x in columns:
        ax.text(x, 1.0, name, fontweight="bold", transform=ax.transAxes, va="top",
                color=plots.COLORS.get(name, "black"))
    for i, row in enumerate(rows):
        y = 1.0 - (i + 1) / (len(rows) + 1)
        p = gens["eager"].problems[row]
        ax.text(0.0, y, f"{render(p.prompt)}  ({p.a + p.b})", family="monospace", transform=ax.transAxes, va="top")
        for name, x in columns[1:]:
            toks = gens[name].tokens[row]
            value = parse_answer(toks)
            mark = "right" if value == p.a + p.b else "WRONG"
            ax.text(x, y, f"{render_answer(toks)} -> {value if value is not None else '?'}  {mark}", family="monospace",
                    transform=ax.transAxes, va="top", color=plots.COLORS[name])
    ax.set_title("Greedy generations (answer digits are least-significant first; $ = end)", loc="left")
    return fig


def explore(result: CaseResult):
    """A slider over decode batches: their plans and generations (JupyterLab only)."""
    import ipywidgets as widgets
    from IPython.display import display

    n_batches = len(result.example["eager"].seq_lens)

    def show(batch: int) -> None:
        display(plot_plans(result.example, batch=batch))
        display(plot_generations(result.example, batch=batch))
        plt.close("all")

    return widgets.interactive(show, batch=widgets.IntSlider(0, 0, n_batches - 1, description="batch"))
