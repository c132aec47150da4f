"""The graph doctor's cost on a replay-heavy run: time per served step, without and inside ``watch()``.

CPU (``python benchmarks/bench_doctor.py``): ``GraphRunner`` over three tiny ``transformers`` models,
3 real rows padded to 4, alternating plain and watched runs; writes ``benchmarks/results_doctor.md``.
GPU: ``workbench.cases.graph_doctor.cost_record`` (run by ``scripts/gpu_session.py``) measures the same
function on CUDA into ``results/gpu/graph_doctor_cost.json``; its table is copied in here.
"""
from __future__ import annotations

import pathlib
import platform

import torch

from workbench.cases.graph_doctor import COST_MODELS, cost_table, gpu_cost, overhead


def main() -> None:
    torch.manual_seed(0)
    rows = [overhead("cpu", name, steps=300, repeats=9) for name in COST_MODELS]
    header = (f"Graph doctor overhead (`python benchmarks/bench_doctor.py`): `GraphRunner` (sizes 1, 2, 4, 8), 3 real "
              f"rows padded to 4, tiny models; torch {torch.__version__}, {platform.machine()}, "
              f"{torch.get_num_threads()} threads. Median over 9 alternating runs of 300 steps each. *wall*: steps "
              "back to back; *host*: each step timed alone until it returns (on the CPU backend the two coincide).")
    gpu = gpu_cost()
    runs = gpu["results"]["overhead"]
    gpu_header = (f"GPU (`results/gpu/graph_doctor_cost.json`, `scripts/gpu_session.py OUT graph_doctor_cost`): "
                  f"{gpu['device']}, torch {gpu['torch']}, {gpu['date']}. Median over {runs[0]['repeats']} alternating "
                  f"runs of {runs[0]['steps']} steps each.")
    table = f"{header}\n\n{cost_table(rows)}\n\n{gpu_header}\n\n{cost_table(runs)}\n"
    (pathlib.Path(__file__).parent / "results_doctor.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
