"""Record the GPU answers the CPU tests compare against: ``results/gpu/<name>.json``.

Runs on a machine with CUDA: the engine's semantic probes and architecture matrix, the runner's
replay overhead, every case of the registry (``<case id>.json`` from its scenario's
``gpu_record``), the graph doctor, the bug zoo, and the outcome of every test marked ``cuda``
(``cuda_tests``: CI has no GPU, so those tests are only ever run here). Every record carries the device, torch and CUDA
versions and the date. Usage: ``python scripts/gpu_session.py OUT_DIR [name ...]`` (names: the keys
of ``records()``; default: every one the visible GPUs can run). ``doctor_trials@FILE`` records only
the trial programs FILE lists, one ``round/program`` a line (merge the result with ``python -m
workbench.zoo.trials amend``). A failing record is written with its error and does not stop the
others; the trials' record also keeps ``doctor_trials.partial.json``, rewritten as each program
finishes, so a call cut off by a time limit still returns what it measured.
"""
from __future__ import annotations

import datetime
import importlib
import inspect
import json
import os
import pathlib
import re
import subprocess
import sys
import time
import traceback

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from workbench import cases  # noqa: E402


def records() -> dict[str, tuple[str, str, int]]:
    """Record name -> (module, function, GPUs it needs)."""
    found = {
        "engine_probes": ("workbench.probes", "run_all", 1),
        "hf_matrix": ("workbench.hf_matrix", "gpu_record", 1),
        "runner_overhead": ("benchmarks.bench_replay", "gpu_record", 1),
        "graph_doctor": ("workbench.cases.graph_doctor", "gpu_record", 1),   # case 03 needs a second GPU
        "graph_doctor_cost": ("workbench.cases.graph_doctor", "cost_record", 1),
        "graph_doctor_piecewise": ("workbench.cases.graph_doctor", "piecewise_record", 1),
        "zoo": ("workbench.zoo.record", "gpu_record", 1),
        "doctor_padding": ("workbench.doctor.padding_record", "gpu_record", 1),
        "doctor_trials": ("workbench.zoo.trials", "gpu_record", 1),
        "cuda_tests": (__name__, "cuda_tests", 1),
    }
    for case in cases.CASES:
        found[case.id] = (f"{case.package}.scenario", "gpu_record", case.gpus)
    return found


def cuda_test_files() -> list[str]:
    """The test modules that mark a test ``cuda`` (only those are collected: the others may need
    packages a GPU machine lacks)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                  if "pytest.mark.cuda" in p.read_text())


def cuda_tests(device: str = "cuda") -> dict:
    """Every test marked ``cuda``, run by pytest on this machine: ``{node id: outcome}``."""
    if device != "cuda":
        raise ValueError(f"the CUDA tests run on cuda, not {device!r}")
    run = subprocess.run([sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-rA", "-p", "no:cacheprovider",
                          "-n", "4", "--tb=short", *cuda_test_files()], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "WORKBENCH_FAST": "1", "WORKBENCH_HEADLESS": "1"})
    tests = {node: outcome.lower() for outcome, node in re.findall(
        r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+)", run.stdout, re.M)}
    failed = [line for line in run.stdout.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    # pytest's own account of each failure (its tracebacks, up to the short summary), whole: a
    # failure seen once on a lent GPU must be readable afterwards.
    report = re.search(r"^=+ (?:FAILURES|ERRORS) =+$.*?(?=^=+ short test summary)", run.stdout, re.M | re.S)
    return {"returncode": run.returncode, "tests": tests, "summary": run.stdout.strip().splitlines()[-1:],
            "failures": failed, "failure_report": report.group(0)[:60000] if report else "",
            "stderr_tail": run.stderr[-4000:] if run.returncode else ""}


def metadata() -> dict:
    return {
        "device": torch.cuda.get_device_name(0),
        "device_count": torch.cuda.device_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
    }


def requested(names: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """The record names asked for, and for ``name@FILE`` the programs FILE lists (one a line)."""
    plain, only = [], {}
    for name in names:
        name, _, path = name.partition("@")
        plain.append(name)
        if path:
            only[name] = [line.strip() for line in pathlib.Path(path).read_text().splitlines() if line.strip()]
    return plain, only


def main(out_dir: str, names: list[str]) -> int:
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = records()
    names, only = requested(names)
    unknown = sorted(set(names) - set(table))
    if unknown:
        print(f"unknown records {unknown}; known: {sorted(table)}", file=sys.stderr)
        return 2
    names = names or [n for n, (_, _, gpus) in table.items() if gpus <= torch.cuda.device_count()]
    failures = 0
    for name in names:
        module, fn, _ = table[name]
        start = time.perf_counter()
        record = {"name": name, **metadata()}
        try:
            call = getattr(importlib.import_module(module), fn)
            # A record that can keep its progress (the trials) writes it beside the final file.
            keep = {"partial": out / f"{name}.partial.json"} if "partial" in inspect.signature(call).parameters else {}
            record["results"] = call("cuda", only[name], **keep) if name in only else call("cuda", **keep)
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
