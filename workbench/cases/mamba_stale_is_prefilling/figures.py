"""Figures of case 04: ``is_prefilling`` per batch row and step, the state slot each FULL replay
read, and token agreement with eager decoding.

The colour maps are built per figure (nothing is registered with matplotlib), and no text is
smaller than ``MIN_FONT`` points: the cell labels are read, not decoration.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap

from ... import plots
from .mamba import NULL_BLOCK_ID
from .runner import MAX_NUM_SEQS
from .scenario import ServedRun, agreement

MIN_FONT = 8                       # points: the smallest text in any figure of the workbench
_PREFILL_LABELS = ["real, decode", "real, prefilling", "padded, False", "padded, stale True"]


def _prefill_colors() -> ListedColormap:
    return ListedColormap(["#c6dbef", plots.COLORS["real"], "#fdd0a2", plots.COLORS["bug"]])


def _slot_colors() -> ListedColormap:
    return ListedColormap(["#c6dbef", plots.COLORS["bug"], "#fdd0a2"])


def prefill_matrix(result: ServedRun, max_rows: int = MAX_NUM_SEQS) -> np.ndarray:
    """``codes[row, step]``: 0/1 real row is_prefilling False/True, 2/3 padded row False/True, NaN unused."""
    codes = np.full((max_rows, len(result.records)), np.nan)
    for j, rec in enumerate(result.records):
        n = len(rec.req_ids)
        for row, flag in enumerate(rec.is_prefilling):
            codes[row, j] = (0 if row < n else 2) + int(flag)
    return codes


def plot_is_prefilling(runs: dict[str, ServedRun], variants=("bug", "fix")) -> plt.Figure:
    """Rows x steps of ``is_prefilling`` as the metadata saw it; FULL steps whose refresh was skipped marked."""
    fig, axes = plt.subplots(1, len(variants), figsize=(7.6 * len(variants), 3.8), squeeze=False)
    for ax, v in zip(axes[0], variants):
        res = runs[v]
        im = plots.heatmap(ax, prefill_matrix(res), xlabel="step", ylabel="batch row", vmin=-0.5, vmax=3.5,
                           cmap=_prefill_colors(), title=f"{v}: is_prefilling per row (grey: row not in the batch)")
        im.colorbar.set_ticks(range(4), labels=_PREFILL_LABELS)
        ax.set_xticks(range(len(res.records)), [r.step for r in res.records], fontsize=MIN_FONT)
        ax.set_yticks(range(MAX_NUM_SEQS))
        for j, rec in enumerate(res.records):
            for row in range(len(rec.req_ids), rec.num_reqs_padded):
                computed, prompt = rec.counters[row]
                ax.text(j, row, f"{computed}\n{'<' if computed < prompt else '>='}{prompt}", ha="center",
                        va="center", fontsize=MIN_FONT, color="white" if rec.is_prefilling[row] else "black")
            if rec.mode == "full":
                ax.annotate("F", (j, MAX_NUM_SEQS - 0.45), ha="center", va="bottom", fontsize=MIN_FONT,
                            color=plots.COLORS["bug"] if not rec.refreshed else "black", annotation_clip=False)
        ax.set_ylim(-0.5, MAX_NUM_SEQS + 0.1)
    fig.suptitle("F = FULL graph replay (red F: state-index refresh skipped, the graph reads last time's slots)",
                 fontsize="small", y=1.02)
    fig.tight_layout()
    return fig


def plot_state_slots(runs: dict[str, ServedRun], variants=("bug", "fix")) -> plt.Figure:
    """Per FULL replay and row: the slot the graph read from the state-index buffer, whose state
    that slot holds, and (where wrong) the slot the row's request owns."""
    fig, axes = plt.subplots(len(variants), 1, figsize=(12, 3.0 * len(variants)), squeeze=False)
    for ax, v in zip(axes[:, 0], variants):
        res = runs[v]
        full = [r for r in res.records if r.mode == "full"]
        owner = {s: rid for rid, s in res.slots.items()}
        rows = max(r.num_reqs_padded for r in full)
        codes = np.full((rows, len(full)), np.nan)
        for j, rec in enumerate(full):
            for row, (got, want) in enumerate(zip(rec.slots_read, rec.slots_expected)):
                real = row < len(rec.req_ids)
                codes[row, j] = (1 if got != want else 0) if real else 2
                whose = "null" if got == NULL_BLOCK_ID else f"{owner.get(got, '?')}'s"
                text = f"{rec.req_ids[row] if real else 'pad'}: {got} ({whose})"
                if got != want:
                    text += f"\nshould be {want}"
                ax.text(j, row, text, ha="center", va="center", fontsize=MIN_FONT,
                        color="white" if got != want else "black")
        im = plots.heatmap(ax, codes, xlabel="step (FULL graph replays only)", ylabel="batch row", cmap=_slot_colors(),
                           vmin=-0.5, vmax=2.5, title=f"{v}: slot each row's state was read from and written to")
        im.colorbar.set_ticks(range(3), labels=["own slot", "another's slot", "padded row"])
        ax.set_xticks(range(len(full)), [r.step for r in full], fontsize=MIN_FONT)
        ax.set_yticks(range(rows))
    fig.tight_layout()
    return fig


def plot_token_agreement(runs: dict[str, ServedRun], variants=("bug", "fix")) -> plt.Figure:
    """Token by token against eager (green: equal, red: differs), and the per-request agreement."""
    eager = runs["eager"]
    rids = sorted(eager.generations)
    fig, axes = plt.subplots(1, len(variants) + 1, figsize=(4.8 * (len(variants) + 1), 3.2),
                             gridspec_kw={"width_ratios": [2] * len(variants) + [1.6]})
    cmap = ListedColormap([plots.COLORS["bug"], plots.COLORS["fix"]])
    width = max(len(t) for t in eager.generations.values())
    for ax, v in zip(axes, variants):
        same = np.full((len(rids), width), np.nan)
        for i, rid in enumerate(rids):
            for k, (a, b) in enumerate(zip(runs[v].generations[rid], eager.generations[rid])):
                same[i, k] = float(a == b)
        ax.imshow(np.ma.masked_invalid(same), cmap=cmap, vmin=0, vmax=1, aspect="auto", interpolation="nearest")
        for i, rid in enumerate(rids):
            for k, token in enumerate(runs[v].generations[rid]):
                ax.text(k, i, str(token), ha="center", va="center", fontsize=MIN_FONT, color="white")
        ax.set_yticks(range(len(rids)), rids)
        ax.set_xlabel("generated token #")
        ax.set_title(f"{v}: tokens (green = eager's, red = not)")
    ax = axes[-1]
    xs = np.arange(len(rids))
    w = 0.8 / len(variants)
    for k, v in enumerate(variants):
        agree = agreement(runs[v], eager)
        ax.bar(xs + (k - (len(variants) - 1) / 2) * w, [agree[r] for r in rids], w, label=v,
               color=plots.COLORS.get(v, plots.COLORS["predicted"]))
    ax.set_xticks(xs, rids)
    ax.set_ylim(0, 1.25)
    ax.set_yticks([0, 0.25, 0.5, 0.75, 1.0])
    ax.set_ylabel("fraction of tokens = eager")
    ax.set_title("per-request agreement")
    ax.legend(fontsize="small", loc="upper center", ncols=len(variants))
    fig.tight_layout()
    return fig
