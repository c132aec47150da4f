"""Replay speed: eager vs graph replay vs capture, for three ``transformers`` models nobody here wrote.

CPU (``python benchmarks/bench_replay.py``): eager forward, ``CPUGraph`` replay and capture time,
medians over repeats, measured side by side in one run; writes ``benchmarks/results_cpu.md``.
GPU (``gpu_record("cuda")``, run by ``scripts/gpu_session.py``): eager vs bare
``torch.cuda.CUDAGraph.replay()`` vs ``GraphRunner`` (copy-in, replay, slice) for the same models,
in wall time and in host time (each call alone until it returns: what the runner's Python costs).
The three take turns within each repeat.
"""
from __future__ import annotations

import pathlib
import platform
import statistics
import sys
import time

import torch

from workbench.engine import GraphRunner, graph, new_graph, synchronize
from workbench.models.hf import tiny_model

MODELS = ("roberta", "bert", "gpt2")
BATCH, SEQ = 4, 32


def _wall_ms(fn, inner: int, device: str) -> float:
    """Milliseconds per call, ``inner`` calls back to back and one synchronize at the end."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / inner * 1e3


def _host_ms(fn, inner: int, device: str) -> float:
    """Milliseconds per call until it returns, each call alone on an idle device: the host's share."""
    total = 0.0
    for _ in range(inner):
        synchronize(device)
        start = time.perf_counter()
        fn()
        total += time.perf_counter() - start
    synchronize(device)
    return total / inner * 1e3


def _medians_ms(fns: dict, repeats: int, inner: int, device: str, measure=_wall_ms) -> dict[str, float]:
    """Median per function, the functions taking turns within each repeat so drift hits all alike."""
    samples = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            samples[name].append(measure(fn, inner, device))
    return {name: statistics.median(v) for name, v in samples.items()}


def measure(name: str, device: str, repeats: int = 15, inner: int = 20) -> dict:
    model = tiny_model(name, hidden=64, layers=2).to(device)
    x = torch.randint(3, 100, (BATCH, SEQ), generator=torch.Generator().manual_seed(0)).to(device)
    static = x.clone()
    with torch.no_grad():
        for _ in range(3):
            model(static)
        captures = []
        for _ in range(5 if device == "cpu" else 3):
            g = new_graph(device)
            synchronize(device)
            start = time.perf_counter()
            with graph(g):
                out = model(static).last_hidden_state
            synchronize(device)
            captures.append((time.perf_counter() - start) * 1e3)
        g.replay()
        # Bitwise on the CPU; on CUDA capture may pick other kernels, so within float tolerance.
        expected = model(static).last_hidden_state
        same = torch.equal(out, expected) if device == "cpu" else torch.allclose(out, expected, atol=1e-5)
        assert same, f"{name}: replay differs from eager"

        def bare():
            static.copy_(x)
            g.replay()
        runner = GraphRunner(lambda input_ids: model(input_ids).last_hidden_state,
                             {"input_ids": ((SEQ,), torch.long)}, [BATCH], device=device)
        runner.capture()
        fns = {"eager": lambda: model(static), "replay": bare, "runner": lambda: runner(input_ids=x)}
        wall = _medians_ms(fns, repeats, inner, device)
        host = _medians_ms(fns, repeats, inner, device, measure=_host_ms) if device != "cpu" else wall
    return {"model": name, "kernels": sum(not op.is_view for op in g.ops) if device == "cpu" else None,
            "eager_ms": wall["eager"], "replay_ms": wall["replay"], "runner_ms": wall["runner"],
            "replay_host_ms": host["replay"], "runner_host_ms": host["runner"],
            "capture_ms": statistics.median(captures)}


def gpu_record(device: str = "cuda") -> dict:
    rows = [measure(m, device, repeats=21, inner=100) for m in MODELS]
    for r in rows:
        r["runner_overhead_pct"] = 100 * (r["runner_ms"] - r["replay_ms"]) / r["replay_ms"]
        r["runner_host_added_us"] = 1e3 * (r["runner_host_ms"] - r["replay_host_ms"])
        r["speedup_over_eager"] = r["eager_ms"] / r["replay_ms"]
    return {"batch": BATCH, "seq": SEQ, "rows": rows}


def main() -> None:
    rows = [measure(m, "cpu") for m in MODELS]
    lines = [
        f"CPU replay benchmark (`python benchmarks/bench_replay.py`), batch {BATCH} x {SEQ} tokens, "
        f"hidden 64, 2 layers; torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads. Medians of 15 x 20 calls.",
        "",
        "| model | kernels | eager ms | replay ms | replay / eager | runner ms | capture ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['model']} | {r['kernels']} | {r['eager_ms']:.3f} | {r['replay_ms']:.3f} | "
                     f"{r['replay_ms'] / r['eager_ms']:.2f} | {r['runner_ms']:.3f} | {r['capture_ms']:.1f} |")
    table = "\n".join(lines) + "\n"
    print(table)
    (pathlib.Path(__file__).parent / "results_cpu.md").write_text(table)


if __name__ == "__main__":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
    main()
