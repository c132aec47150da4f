"""CPU replay vs eager for every model of the architecture matrix, with capture time beside it.

``python benchmarks/bench_matrix.py`` writes ``benchmarks/results_matrix.md``. Per model: the
eager forward and the ``CPUGraph`` replay take turns within each repeat (so drift hits both
alike), medians reported; the target is replay no slower than 0.8x eager, i.e.
``replay / eager <= 1.25``. Capture time is one capture after one warmup.
"""
from __future__ import annotations

import os
import pathlib
import platform
import statistics
import sys
import time
import warnings

import torch

from workbench import hf_matrix
from workbench.engine import graph, new_graph

TARGET = 1 / 0.8


def _ms(fn, inner: int) -> float:
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - start) / inner * 1e3


def measure(entry: hf_matrix.Entry, repeats: int = 11, inner: int = 10) -> dict:
    model = hf_matrix.build(entry.arch)
    static = hf_matrix.make_inputs(entry, 0)
    with torch.no_grad():
        out = hf_matrix.forward(model, entry, static)
        g = new_graph("cpu")
        start = time.perf_counter()
        with graph(g):
            out = hf_matrix.forward(model, entry, static)
        capture_ms = (time.perf_counter() - start) * 1e3
        fns = {"eager": lambda: hf_matrix.forward(model, entry, static), "replay": g.replay}
        samples = {name: [] for name in fns}
        for _ in range(repeats):
            for name, fn in fns.items():
                samples[name].append(_ms(fn, inner))
        g.replay()
        assert torch.equal(out, hf_matrix.forward(model, entry, static)), entry.label
    eager, replay = (statistics.median(samples[k]) for k in ("eager", "replay"))
    kernels = sum(not op.is_view for op in g.ops)
    return {"model": entry.label, "kernels": kernels, "eager_ms": eager, "replay_ms": replay,
            "ratio": replay / eager, "capture_ms": capture_ms}


def table(rows: list[dict]) -> str:
    lines = ["| model | kernels | eager ms | replay ms | replay / eager | capture ms |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['kernels']} | {r['eager_ms']:.3f} | {r['replay_ms']:.3f} | "
                     f"{r['ratio']:.2f} | {r['capture_ms']:.1f} |")
    met = sum(r["ratio"] <= TARGET for r in rows)
    return "\n".join(lines) + (f"\n\nTarget replay / eager <= {TARGET:.2f} (replay no slower than 0.8x eager): "
                               f"met for {met} of {len(rows)}.")


def main() -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    rows = [measure(e) for e in hf_matrix.ENTRIES]
    head = (f"CPU replay vs eager on the architecture matrix (`python benchmarks/bench_matrix.py`), batch "
            f"{hf_matrix.BATCH} x {hf_matrix.SEQ}, hidden 32, 2 layers; torch {torch.__version__}, "
            f"{platform.machine()}, {torch.get_num_threads()} thread, machine load average {os.getloadavg()[0]:.1f} at the end. Medians of 11 x 10 calls, eager and "
            "replay taking turns.")
    text = head + "\n\n" + table(rows) + "\n"
    (pathlib.Path(__file__).parent / "results_matrix.md").write_text(text)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
