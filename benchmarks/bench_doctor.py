"""The graph doctor's cost on a replay-heavy run: time per served step, without and inside ``watch()``.

CPU (``python benchmarks/bench_doctor.py``): ``GraphRunner`` over three tiny ``transformers`` models,
3 real rows padded to 4, alternating plain and watched runs; writes ``benchmarks/results_doctor.md``.
GPU: ``workbench.cases.graph_doctor.gpu_record`` (run by ``scripts/gpu_session.py``) measures the same
function on CUDA into ``results/gpu/graph_doctor.json``.
"""
from __future__ import annotations

import pathlib
import platform

import torch

from workbench.cases.graph_doctor import overhead

MODELS = ("roberta", "bert", "gpt2")


def main() -> None:
    torch.manual_seed(0)
    rows = [overhead("cpu", name, steps=300, repeats=9) for name in MODELS]
    header = (f"Graph doctor overhead (`python benchmarks/bench_doctor.py`): `GraphRunner` (sizes 1, 2, 4, 8), 3 real "
              f"rows padded to 4, tiny models; torch {torch.__version__}, {platform.machine()}, "
              f"{torch.get_num_threads()} threads. Median over 9 alternating runs of 300 steps each.")
    lines = [
        header,
        "",
        "| model | plain ms/step | watched ms/step | overhead |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {r['model']} | {r['plain_ms_per_step']:.3f} | {r['watched_ms_per_step']:.3f} | "
              f"{100 * r['overhead']:+.1f} % |" for r in rows]
    table = "\n".join(lines) + "\n"
    (pathlib.Path(__file__).parent / "results_doctor.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
