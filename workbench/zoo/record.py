"""The GPU record of the zoo: every program's verdicts on real CUDA graphs.

Some bugs end in an illegal memory access or an invalidated capture, which poisons the CUDA context
of the process they happen in. Each variant of each program therefore runs in a child process of its
own, so that a bug's crash cannot change its fix's verdict, nor another program's.

Run on a GPU machine from the repository root (writes ``results/gpu/zoo.json``)::

    python -m workbench.zoo.record                  # or: python scripts/gpu_session.py OUT zoo
"""
from __future__ import annotations

import concurrent.futures
import datetime
import json
import pathlib
from collections.abc import Sequence

import torch

from ..childproc import run_in_child
from ..engine.source import function_of
from . import VARIANTS, names, program, run

RESULT = pathlib.Path(__file__).resolve().parents[2] / "results" / "gpu" / "zoo.json"


def outcome_of(name: str, variant: str, device: str) -> dict:
    """One variant of one program, as JSON-ready numbers (run inside the child process)."""
    o = run(name, variant, device)
    return {"verdict": o.verdict, "max_abs_error": _finite(o.max_abs_error),
            "error": None if o.error is None else list(o.error)}


def doctor_of(name: str, variant: str, device: str) -> dict:
    """What ``doctor.diagnose`` says of one variant."""
    from ..detectors import detect
    d = detect("doctor", program(name), variant, device)
    return {"found": d.found, "kind": d.kind, "site": function_of(d.site) if d.site else None}


def variant_of(name: str, variant: str, device: str) -> dict:
    """The verdict, then the doctor's report, in one child process -- unless the run left the CUDA
    context unusable (an illegal memory access): the doctor then gets a child of its own."""
    out = outcome_of(name, variant, device)
    error = " ".join(out["error"] or ()).lower()
    out["doctor"] = None if "cuda" in error or "illegal" in error else doctor_of(name, variant, device)
    return out


def gpu_record(device: str = "cuda", programs: Sequence[str] | None = None, jobs: int = 8) -> dict:
    """``{"device", "torch", "date", "programs": {name: {"bug": {...}, "fix": {...}}}}`` for every
    program (or those named), each variant's verdict and what the doctor said of it; a child that
    dies outright records its exit as the variant's error. ``jobs`` children run at a time (each
    is a process of its own: one's crash cannot touch another)."""
    todo = [(name, variant) for name in (names() if programs is None else programs) for variant in VARIANTS]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        done = list(pool.map(lambda job: _record(*job, device), todo))
    out: dict[str, dict] = {}
    for (name, variant), value in zip(todo, done):
        out.setdefault(name, {})[variant] = value
    on_gpu = torch.device(device).type == "cuda" and torch.cuda.is_available()
    return {"device": torch.cuda.get_device_name() if on_gpu else device,
            "torch": torch.__version__, "date": datetime.date.today().isoformat(), "programs": out}


def _record(name: str, variant: str, device: str) -> dict:
    result = run_in_child(variant_of, name, variant, device, timeout=300)
    if result.ok:
        value = result.value
    else:
        error = [result.error_type or "ChildDied", (result.error or f"exit code {result.exitcode}").splitlines()[0]]
        value = {"verdict": "misbehaves", "max_abs_error": None, "error": error, "doctor": None}
    if value["doctor"] is None:
        seen = run_in_child(doctor_of, name, variant, device, timeout=300)
        value["doctor"] = seen.value if seen.ok else {
            "found": None, "kind": None, "site": None,
            "error": (seen.error or f"exit code {seen.exitcode}").splitlines()[0][:200]}
    return value


def load() -> dict | None:
    """The committed GPU record, or None while it has not been recorded. ``scripts/gpu_session.py``
    wraps a record in ``{"name", device metadata, "results": record}``; both shapes are read."""
    if not RESULT.exists():
        return None
    data = json.loads(RESULT.read_text())
    return data.get("results", data)


def _finite(x: float | None) -> float | None:
    """JSON has no infinity: an infinite error (NaN outputs) is stored as a very large number."""
    if x is None:
        return None
    return x if x < 1e300 else 1e300


if __name__ == "__main__":
    RESULT.write_text(json.dumps(gpu_record(), indent=1) + "\n")
    print(f"wrote {RESULT}")
