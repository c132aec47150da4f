"""CI has no GPU, so every test marked ``cuda`` is skipped there. They run on a GPU machine
(``python scripts/gpu_session.py OUT cuda_tests``), which records each one's outcome in
``results/gpu/cuda_tests.json``; this test holds the suite to that record: each test marked
``cuda`` today was run there, and passed. A new or renamed CUDA test fails here until it has."""
import importlib.util
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
RECORD = ROOT / "results" / "gpu" / "cuda_tests.json"


def _session():
    spec = importlib.util.spec_from_file_location("gpu_session", ROOT / "scripts" / "gpu_session.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_test_marked_cuda_passed_on_the_recorded_gpu():
    record = json.loads(RECORD.read_text())
    assert record["device"] and record["torch"] and record["date"], {k: record.get(k) for k in ("device", "torch", "date")}
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "cuda", "-p", "no:cacheprovider",
                          *_session().cuda_test_files()], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    marked = {line for line in run.stdout.splitlines() if "::" in line}
    assert len(marked) >= 10, run.stdout[-2000:]
    outcomes = record["results"]["tests"]
    assert sorted(marked - outcomes.keys()) == [], "marked cuda but never run on a GPU (record them)"
    assert {node: outcomes[node] for node in marked} == {node: "passed" for node in marked}, record["results"]["summary"]
    assert record["results"]["returncode"] == 0, record["results"]["summary"]
