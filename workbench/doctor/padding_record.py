"""The GPU record of the doctor's padded-row mechanisms: ``diagnose`` on the zoo's padded-row bugs.

The fills after each step, the scatter-index contract and the padded-shape-mismatch explanation
read and write device memory (fills of CUDA buffers, index values copied to the host before a
replay, tracebacks of errors raised on CUDA tensors). Whether they give on real CUDA graphs the
findings they give on the emulation is a GPU answer: each variant of each zoo program whose
expected kind is of the padded-rows family is diagnosed in a child process of its own (a bug may
poison its CUDA context), and its findings are recorded as kinds and the functions they name.

Run on a GPU machine (writes ``results/gpu/doctor_padding.json``)::

    python scripts/gpu_session.py OUT doctor_padding
"""
from __future__ import annotations

import pathlib
from collections.abc import Sequence

import torch

from ..childproc import run_in_child
from ..engine.source import function_of
from ..zoo import VARIANTS, names, program
from .report import PADDED_ROWS

RESULT = pathlib.Path(__file__).resolve().parents[2] / "results" / "gpu" / "doctor_padding.json"


def programs() -> list[str]:
    """The zoo programs whose expected finding is of the padded-rows family."""
    return [name for name in names() if program(name).KIND in PADDED_ROWS]


def findings_of(name: str, variant: str, device: str) -> dict:
    """``{"kinds": [...], "sites": {kind: function}, "failed": bool}`` of ``diagnose`` on one variant."""
    from . import diagnose
    report = diagnose(lambda: program(name).run(variant, device))
    sites = {}
    for f in report.findings:
        sites.setdefault(f.kind, function_of(f.location))
    return {"kinds": sorted(report.kinds), "sites": sites, "failed": report.failure is not None}


def gpu_record(device: str = "cuda", only: Sequence[str] | None = None) -> dict:
    """``{"device", "torch", "programs": {name: {variant: findings_of(...)}}}``; a child that dies
    records its error in place of the findings."""
    out = {}
    for name in (programs() if only is None else only):
        out[name] = {}
        for variant in VARIANTS:
            result = run_in_child(findings_of, name, variant, device, timeout=300)
            error = (result.error or f"exit code {result.exitcode}").splitlines()[0]
            out[name][variant] = result.value if result.ok else {"error": f"{result.error_type or 'ChildDied'}: {error}"}
    on_gpu = torch.device(device).type == "cuda" and torch.cuda.is_available()
    return {"device": torch.cuda.get_device_name() if on_gpu else device, "torch": torch.__version__,
            "programs": out}
