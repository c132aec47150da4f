"""Record the GPU answers the CPU tests compare against: ``results/gpu/<name>.json``.

Runs on a machine with CUDA: the engine's semantic probes, the runner's replay overhead, and each
case's ``gpu_record("cuda")``. Every record carries the device, torch and CUDA versions and the
date. Usage: ``python scripts/gpu_session.py OUT_DIR [name ...]`` (names: the keys of ``RECORDS``;
default: all single-GPU ones). A failing record is written with its error and does not stop the
others.
"""
from __future__ import annotations

import datetime
import importlib
import json
import pathlib
import sys
import time
import traceback

import torch

RECORDS = {
    "engine_probes": ("workbench.probes", "run_all"),
    "runner_overhead": ("benchmarks.bench_replay", "gpu_record"),
    "case01_roberta": ("workbench.cases.roberta_positions", "gpu_record"),
    "case02_vit": ("workbench.cases.vit_encoder", "gpu_record"),
    "case03_tp": ("workbench.cases.tp_lm_head", "gpu_record"),
    "case04_mamba": ("workbench.cases.mamba_padding", "gpu_record"),
    "case05_lazy_attention": ("workbench.cases.lazy_attention", "gpu_record"),
    "graph_doctor": ("workbench.cases.graph_doctor", "gpu_record"),
    "graph_doctor_cost": ("workbench.cases.graph_doctor", "cost_record"),
    "graph_doctor_piecewise": ("workbench.cases.graph_doctor", "piecewise_record"),
    "zoo": ("workbench.zoo.record", "gpu_record"),
}
MULTI_GPU = {"case03_tp", "graph_doctor"}    # graph_doctor runs case 03 when two GPUs are there


def metadata() -> dict:
    return {
        "device": torch.cuda.get_device_name(0),
        "device_count": torch.cuda.device_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
    }


def main(out_dir: str, names: list[str]) -> int:
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = names or [n for n in RECORDS if n not in MULTI_GPU]
    failures = 0
    for name in names:
        module, fn = RECORDS[name]
        start = time.perf_counter()
        record = {"name": name, **metadata()}
        try:
            record["results"] = getattr(importlib.import_module(module), fn)("cuda")
        except Exception as e:  # noqa: BLE001 - recorded, the session goes on
            failures += 1
            record["error"] = f"{type(e).__name__}: {e}"
            record["traceback"] = traceback.format_exc()
        record["seconds"] = round(time.perf_counter() - start, 2)
        (out / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
        print(f"{name}: {'ERROR ' + record['error'] if 'error' in record else 'ok'} ({record['seconds']} s)", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
