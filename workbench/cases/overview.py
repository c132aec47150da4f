"""The engine in one picture: what a runner's static buffer holds across steps.

A stream of batches of varying size goes through a ``GraphRunner``. Each step copies its real
rows into the static buffer and replays the graph of the next captured size; the rows between are
padded rows that nobody refreshes. The snapshot of the buffer after each step shows it.
"""
from __future__ import annotations

import dataclasses

import matplotlib.pyplot as plt
import numpy as np
import torch

from .. import plots
from ..engine import GraphRunner


@dataclasses.dataclass
class PaddingDemo:
    batch_sizes: list[int]
    padded_sizes: list[int]
    buffer: np.ndarray          # [slot, step]: value in the static buffer after each step
    stale_slots: list[list[int]]  # per step: padded slots whose value came from an earlier step


def padding_demo(batch_sizes: list[int], capture_sizes: list[int], device: str = "cpu") -> PaddingDemo:
    """Serve requests whose value is their step number; record the static buffer after each step."""
    runner = GraphRunner(lambda x: x + 0, {"x": ((), torch.float32)}, capture_sizes, device=device)
    runner.capture()
    snapshots, padded, stale = [], [], []
    for step, n in enumerate(batch_sizes, start=1):
        runner(x=torch.full((n,), float(step), device=device))
        size = runner.history[-1][1] or n
        buf = runner.buffers["x"].detach().cpu().numpy().copy()
        snapshots.append(buf)
        padded.append(size)
        stale.append([s for s in range(n, size)])
    return PaddingDemo(list(batch_sizes), padded, np.stack(snapshots, axis=1), stale)


def plot_padding_demo(demo: PaddingDemo) -> plt.Figure:
    """Buffer slot x step, each cell labelled with the step that wrote it; stale padded rows in red."""
    slots, n_steps = demo.buffer.shape
    fig, ax = plt.subplots(figsize=(1.1 * n_steps + 3, 0.45 * slots + 1.5))
    plots.heatmap(ax, demo.buffer, xlabel="step (batch size -> graph size)", ylabel="static buffer row",
                  title="Static input buffer after each step", cmap="Blues", vmin=0,
                  vmax=max(n_steps, 1) + 2, colorbar_label="value = step that wrote it")
    for step in range(n_steps):
        n, size = demo.batch_sizes[step], demo.padded_sizes[step]
        ax.hlines(n - 0.5, step - 0.5, step + 0.5, color=plots.COLORS["real"], linewidth=2.5,
                  label="end of real rows" if step == 0 else None)
        ax.hlines(size - 0.5, step - 0.5, step + 0.5, color=plots.COLORS["padded"], linewidth=2.5,
                  linestyle="--", label="end of padded rows (graph size)" if step == 0 else None)
        for row in range(slots):
            stale = row in demo.stale_slots[step]
            ax.text(step, row, f"{demo.buffer[row, step]:g}", ha="center", va="center",
                    fontsize=8, color=plots.COLORS["bug"] if stale else "black",
                    fontweight="bold" if stale else "normal")
    ax.set_xticks(range(n_steps), [f"{s + 1}\n{n}->{p}" for s, (n, p) in
                                   enumerate(zip(demo.batch_sizes, demo.padded_sizes))])
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=2, fontsize="small")
    ax.text(1.0, -0.42, "red bold: padded row still holding an earlier step's value", transform=ax.transAxes,
            ha="right", fontsize=8, color=plots.COLORS["bug"])
    return fig


def plot_matrix(cpu: dict, gpu: dict | None, entries) -> plt.Figure:
    """One row per architecture of the matrix: did the capture succeed, and how far replay is from
    eager, on the CPU emulation and (when recorded) on a GPU. Green: captured and within 1e-5; red:
    captured but different, or failed (the error kind is written in the cell); grey: no GPU record."""
    columns = [("CPU emulation", cpu), ("GPU record (results/gpu/hf_matrix.json)", gpu or {})]
    fig, ax = plt.subplots(figsize=(2.6 * len(columns) + 3.2, 0.34 * len(entries) + 1.4))
    for col, (_, answers) in enumerate(columns):
        for row, entry in enumerate(entries):
            answer = answers.get(entry.label)
            if answer is None:
                color, text = "#dddddd", "not recorded"
            elif not answer["captured"]:
                color, text = plots.COLORS["bug"], f"failed: {answer['error_kind']}"
            else:
                ok = answer["max_abs_diff"] <= 1e-5
                color = plots.COLORS["fix"] if ok else plots.COLORS["bug"]
                text = "replay == eager, bitwise" if answer["max_abs_diff"] == 0 else f"max |diff| {answer['max_abs_diff']:.1e}"
            ax.add_patch(plt.Rectangle((col, row), 0.96, 0.9, color=color, alpha=0.35))
            ax.text(col + 0.48, row + 0.45, text, ha="center", va="center", fontsize=8)
    ax.set_xlim(0, len(columns))
    ax.set_ylim(len(entries), 0)
    ax.set_yticks([r + 0.45 for r in range(len(entries))], [f"{e.label}  ({e.kind})" for e in entries], fontsize=8)
    ax.set_xticks([c + 0.48 for c in range(len(columns))], [name for name, _ in columns])
    ax.tick_params(length=0)
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)
    ax.set_title("transformers models captured, replayed on 3 fresh inputs, compared with eager", fontsize=10)
    return fig
