"""The graph doctor's cost on a replay-heavy run: time per served step, without and inside ``watch()``.

CPU (``python benchmarks/bench_doctor.py``): ``GraphRunner`` over three tiny ``transformers`` models,
3 real rows padded to 4, alternating plain and watched runs; writes ``benchmarks/results_doctor.md``.
GPU: ``workbench.cases.graph_doctor.cost_record`` (run by ``scripts/gpu_session.py``) measures the same
function on CUDA into ``results/gpu/graph_doctor_cost*.json`` (one per GPU model); their tables are
copied in here. ``--gpu-only`` copies in the GPU tables again and keeps the CPU table as measured
(GPU records arrive from another machine, on another day).
"""
from __future__ import annotations

import pathlib
import platform
import sys

import torch

from workbench.cases.graph_doctor import COST_MODELS, cost_table, gpu_costs, overhead

RESULTS = pathlib.Path(__file__).parent / "results_doctor.md"


def main(gpu_only: bool = False) -> None:
    table = RESULTS.read_text().split("\nGPU (")[0] if gpu_only else cpu_table()
    for gpu in gpu_costs():
        runs = gpu["results"]["overhead"]
        table += (f"\nGPU (`results/gpu/{gpu['file']}`, `scripts/gpu_session.py OUT graph_doctor_cost`): {gpu['device']}, torch {gpu['torch']}, "
                  f"{gpu['date']}. Median over {runs[0]['repeats']} alternating runs of {runs[0]['steps']} steps "
                  f"each.\n\n{cost_table(runs)}\n")
    RESULTS.write_text(table)
    print(table)


def cpu_table() -> str:
    torch.manual_seed(0)
    rows = [overhead("cpu", name, steps=300, repeats=9) for name in COST_MODELS]
    header = (f"Graph doctor overhead (`python benchmarks/bench_doctor.py`): `GraphRunner` (sizes 1, 2, 4, 8), 3 real "
              f"rows padded to 4, tiny models; torch {torch.__version__}, {platform.machine()}, "
              f"{torch.get_num_threads()} threads. Median over 9 alternating runs of 300 steps each. *wall*: steps "
              "back to back; *host*: each step timed alone until it returns (on the CPU backend the two coincide).")
    return f"{header}\n\n{cost_table(rows)}\n"


if __name__ == "__main__":
    main(gpu_only="--gpu-only" in sys.argv[1:])
