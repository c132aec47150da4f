"""Case 01's figures: the positions buffer over requests, the index growth against the
prediction, correctness against ``transformers``, and the explorer over the buffer."""
from __future__ import annotations

import math
from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np

from ... import plots
from ...engine import CUDAGraphMode
from .scenario import MAX_POSITIONS, OFFSET, TOLERANCE, Prediction, StreamResult, can_crash


# --------------------------------------------------------------------------- figures
def _crash_label(res: StreamResult) -> str:
    return f"{res.failure} at request {res.failing_step}"


def _color(res: StreamResult) -> str:
    """Red: the bug as shipped; green: a fix (either defence); grey: eager."""
    if res.mode is CUDAGraphMode.NONE:
        return plots.COLORS["eager"]
    return plots.COLORS["bug"] if can_crash(res.variant, res.zero_padding, False) else plots.COLORS["fix"]


def _linestyle(res: StreamResult) -> str:
    if res.mode is CUDAGraphMode.NONE:
        return ":"
    return "--" if res.zero_padding or res.mode is CUDAGraphMode.FULL else "-"


def plot_positions_heatmaps(streams: Sequence[StreamResult]) -> plt.Figure:
    """The positions buffer (slot x step) for each stream, colour limits 0..514 shared."""
    fig, axes = plt.subplots(len(streams), 1, figsize=(10, 2.8 * len(streams)), squeeze=False)
    box = {"facecolor": "white", "alpha": 0.8, "edgecolor": "none", "pad": 1.5}
    for ax, res in zip(axes[:, 0], streams):
        im = plots.heatmap(ax, res.buffer(), xlabel="request (0 = after startup)", ylabel="buffer slot",
                           title=res.label, vmin=0, vmax=MAX_POSITIONS, colorbar_label="position id")
        im.colorbar.ax.axhline(MAX_POSITIONS, color=plots.COLORS["limit"], linewidth=3)
        im.colorbar.ax.set_yticks([0, 256, MAX_POSITIONS], ["0", "256", f"{MAX_POSITIONS} = table size"])
        ax.yaxis.set_major_locator(plt.MaxNLocator(integer=True))
        bands = [(0, res.prompt_len, "real tokens", plots.COLORS["real"])]
        if res.padded_size > res.prompt_len:
            bands.append((res.prompt_len, res.padded_size, "padded slots", plots.COLORS["padded"]))
            for y in (res.prompt_len - 0.5, res.padded_size - 0.5):
                ax.axhline(y, color=plots.COLORS["padded"], linewidth=1.2)
        bands.append((res.padded_size, len(res.startup_slots), "not in the model's view", "#555555"))
        for lo, hi, text, color in bands:
            if hi > lo:
                ax.text(0.01, (lo + hi) / 2 - 0.5, text, color=color, va="center", ha="left",
                        fontsize="small", fontweight="bold", transform=ax.get_yaxis_transform(), bbox=box)
        if res.failed:
            k = res.failing_step
            ax.axvspan(k - 0.5, k + 0.5, color=plots.COLORS["bug"])
            ax.set_xlim(-0.5, k + 0.5 + 0.02 * k)
            note, color = _crash_label(res), plots.COLORS["bug"]
        else:
            note, color = f"largest index looked up: {max(res.max_index)}", "#333333"
        ax.text(0.99, 0.97, note, ha="right", va="top", color=color, fontsize="small", fontweight="bold",
                transform=ax.transAxes, bbox=box)
    fig.tight_layout()
    return fig


def plot_index_growth(predictions: Sequence[Prediction], streams: Sequence[StreamResult],
                      log: bool = False) -> plt.Figure:
    """Largest position-embedding index looked up at each request, against the predictions
    (one per graph mode; a stream's crash is marked at its mode's predicted index)."""
    by_mode = {p.mode: p for p in predictions}
    fig, ax = plt.subplots(figsize=(9, 4))
    for res in streams:
        label = res.label if res.failed else f"{res.label}: at most {max(res.max_index)}"
        ax.step(np.arange(1, res.served + 1), res.max_index, where="post", color=_color(res),
                linestyle=_linestyle(res), linewidth=2, label=label)
        if res.failed and res.mode in by_mode:
            index = by_mode[res.mode].padded_value(res.failing_step)
            ax.plot([res.failing_step], [index], "x", color=_color(res), markersize=10, mew=2.5,
                    label=f"{_crash_label(res)} (index {index})")
    for p in predictions:
        k = np.arange(1, p.failing_step + 1)
        ax.plot(k, p.v_init + OFFSET * k, color=plots.COLORS["predicted"], linestyle=":", linewidth=2.5,
                label=f"predicted, {p.mode.value}: {p.v_init} + 2k, fails at k = {p.failing_step}")
    ax.axhline(MAX_POSITIONS, color=plots.COLORS["limit"], linestyle="--", linewidth=1,
               label=f"max_position_embeddings = {MAX_POSITIONS}")
    if log:
        ax.set_yscale("log", base=2)
        ax.set_ylim(2, MAX_POSITIONS * 1.5)
        ticks = [2, 8, 32, 128, MAX_POSITIONS]
        ax.set_yticks(ticks, [str(t) for t in ticks])
    else:
        ax.set_ylim(0, MAX_POSITIONS * 1.08)
    ax.set_xlabel("request")
    ax.set_ylabel("largest position index looked up" + (" (log scale)" if log else ""))
    p = predictions[0]
    ax.set_title(f"{p.prompt_len}-token requests padded to {p.padded_size}")
    ax.legend(loc="lower right" if not log else "center right", fontsize="small")
    fig.tight_layout()
    return fig


def plot_correctness(streams: Sequence[StreamResult]) -> plt.Figure:
    """Per-request max |hidden - transformers|, one panel per stream (rounding drawn at ``plots.ROUNDING``)."""
    cols = 2 if len(streams) > 1 else 1
    rows = math.ceil(len(streams) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 2.8 * rows), sharey=True, squeeze=False)
    for ax, res in zip(axes.flat, streams):
        ax.plot(np.arange(1, res.served + 1), plots.rounded(res.max_abs_diff), ".", markersize=2,
                color=_color(res))
        ax.axhline(TOLERANCE, color=plots.COLORS["limit"], linestyle="--", linewidth=1)
        ax.text(0.01, TOLERANCE, f" tolerance {TOLERANCE:g}", va="bottom", fontsize="small",
                transform=ax.get_yaxis_transform())
        if res.failed:
            ax.axvline(res.failing_step, color=plots.COLORS["bug"], linewidth=2)
            ax.text(res.failing_step, 1e-4, _crash_label(res) + " ", ha="right", fontsize="small",
                    color=plots.COLORS["bug"], fontweight="bold")
            ax.set_xlim(0, res.failing_step * 1.05)
        ax.set_yscale("log")
        ax.set_ylim(plots.ROUNDING / 2, 1e-3)
        ax.set_title(f"{res.label}: worst {plots.worst(res.max_abs_diff)}", fontsize="medium")
        ax.set_xlabel("request")
    for ax in axes[:, 0]:
        ax.set_ylabel(f"max |hidden - transformers|\n(< {plots.ROUNDING:g} drawn at it)")
    for ax in list(axes.flat)[len(streams):]:
        ax.set_visible(False)
    fig.suptitle("Each served request vs transformers.RobertaModel run eagerly on that request alone")
    fig.tight_layout()
    return fig


def plot_buffer_row(streams: Sequence[StreamResult], step: int) -> plt.Figure:
    """The positions buffer after request ``step`` for each stream, as bars per slot."""
    fig, axes = plt.subplots(1, len(streams), figsize=(3.6 * len(streams), 3.2), sharey=True, squeeze=False)
    for ax, res in zip(axes[0], streams):
        slots = np.arange(len(res.startup_slots))
        kind = np.where(slots < res.prompt_len, "real", np.where(slots < res.padded_size, "padded", "unused"))
        colors = [plots.COLORS.get(k, "#cccccc") for k in kind]
        shown = min(step, res.served)
        values = res.buffer()[:, shown]
        title = f"{res.label}\nafter request {shown}"
        if step > res.served:           # past the end of the stream: its last state, and why it ended
            title += f" ({_crash_label(res)})" if res.failed else " (its last)"
        top = int(values[res.prompt_len:res.padded_size].max()) if res.padded_size > res.prompt_len else None
        if top is not None:
            ax.annotate(str(top), (res.prompt_len - 0.5 + (res.padded_size - res.prompt_len) / 2, top),
                        ha="center", va="bottom", fontsize="small", color=plots.COLORS["padded"])
        ax.bar(slots, values, color=colors)
        ax.axhline(MAX_POSITIONS, color=plots.COLORS["limit"], linestyle="--", linewidth=1)
        ax.set_title(title, fontsize="small")
        ax.set_xlabel("buffer slot")
        ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in
               (plots.COLORS["real"], plots.COLORS["padded"], "#cccccc")]
    axes[0, -1].legend(handles + [plt.Line2D([], [], color=plots.COLORS["limit"], linestyle="--")],
                       ["real tokens", "padded slots", "not in view", f"table size {MAX_POSITIONS}"],
                       fontsize="x-small", loc="center right")
    axes[0, 0].set_ylabel("position id")
    axes[0, 0].set_ylim(0, MAX_POSITIONS * 1.12)
    fig.tight_layout()
    return fig


def explore(streams: Sequence[StreamResult]):
    """An ipywidgets step slider over ``plot_buffer_row`` (blue real, orange padded, grey unused).
    A stream that ended earlier (the bug's crash) keeps showing its last state and why it ended."""
    import ipywidgets as widgets

    def view(step: int) -> None:
        plot_buffer_row(streams, step)
        plt.show()

    last = max(r.served for r in streams)
    return widgets.interact(view, step=widgets.IntSlider(value=streams[0].served, min=0, max=last, step=1,
                                                         continuous_update=False))

