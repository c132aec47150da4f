"""The graph doctor's cost on a replay-heavy run: time per served step, without and inside ``watch()``.

CPU (``python benchmarks/bench_doctor.py``), on three tiny ``transformers`` models, 3 real rows
padded to 4, plain and watched runs taking turns; writes ``benchmarks/results_doctor.md``:

* differential replay **off**: ``GraphRunner`` (``workbench.cases.graph_doctor.overhead``), the
  target being no more than +17 % per step;
* differential replay **on** (every step sampled, the worst case): a graph manager that announces
  its eager step (``serve(..., eager=...)``), the target being no more than 2.5x per sampled step;
  and the same for GPT-2 from the tiny model to its base size (``differential_scaling``);

and where the watched step's added host time goes (``breakdown``): the doctor's own Python per served
step, piece by piece (each op the dispatch mode hands it, each event), with the dispatch mode's own
cost beside it (what any pass-through ``TorchDispatchMode`` costs on the same ops). That measure is
a minimum over many short repeats, so it holds on a loaded machine where the step medians do not.

GPU: ``workbench.cases.graph_doctor.cost_record`` (run by ``scripts/gpu_session.py``) measures the
first on CUDA into ``results/gpu/graph_doctor_cost*.json``; their tables are copied in here.
``--gpu-only`` copies in the GPU tables again and keeps the CPU tables as measured.
"""
from __future__ import annotations

import contextlib
import functools
import os
import pathlib
import platform
import sys
import time

import numpy as np
import torch

from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from workbench import doctor
from workbench.cases.graph_doctor import COST_MODELS, cost_table, gpu_costs, overhead
from workbench.doctor.intake import Doctor
from workbench.doctor.probes.differential import TRACE_EVERY
from workbench.doctor.session import _Call, watching
from workbench.engine import GraphRunner, events, graph, graph_pool_handle, new_graph
from workbench.models.hf import tiny_model

RESULTS = pathlib.Path(__file__).parent / "results_doctor.md"
SIZES = (1, 2, 4, 8)


class _Manager:
    """One graph per size in one pool, warmed up, serving with ``eager`` announced (what the
    engine's graph manager announces)."""

    def __init__(self, model, ids: torch.Tensor) -> None:
        self.model, self.ids, self.graphs, self.outputs = model, ids, {}, {}
        events.static_buffers("bench", {"input_ids": ids})
        pool = graph_pool_handle("cpu")
        for size in reversed(SIZES):
            with events.warmup():
                self.forward(size)
            g = new_graph("cpu")
            with graph(g, pool=pool, name=f"size {size}"):
                self.outputs[size] = self.forward(size)
            self.graphs[size] = g

    def forward(self, size: int) -> torch.Tensor:
        return self.model(input_ids=self.ids[:size]).last_hidden_state

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        n = batch.shape[0]
        size = next(s for s in SIZES if s >= n)
        self.ids[:n].copy_(batch)
        g = self.graphs[size]
        events.serve(g, n, size, padded={"input_ids": self.ids}, outputs=self.outputs[size],
                     eager=functools.partial(self.forward, size))
        g.replay()
        out = self.outputs[size][:n]
        events.handed_out(g, out)
        return out


def differential_cost(name: str, steps: int = 100, repeats: int = 7, batch: int = 3, **size) -> dict:
    """ms per served step with every step sampled by differential replay, against plain serving
    (``size``: ``tiny_model``'s width, layers and heads, where not the tiny default)."""
    model = tiny_model(name, seed=0, **size).eval()
    ids = torch.randint(3, 100, (batch, 8), generator=torch.Generator().manual_seed(0))

    def serve(watched: bool) -> float:
        with doctor.watch(differential=1) if watched else contextlib.nullcontext(), torch.no_grad():
            manager = _Manager(model, torch.zeros(max(SIZES), 8, dtype=torch.int64))
            manager(ids)
            start = time.perf_counter()
            for _ in range(steps):
                manager(ids)
            return (time.perf_counter() - start) / steps

    times = {"plain": [], "sampled": []}
    for _ in range(repeats):
        for watched in (False, True):
            times["sampled" if watched else "plain"].append(serve(watched))
    ms = {k: float(np.median(v)) * 1e3 for k, v in times.items()}
    return {"model": name, "plain_ms_per_step": ms["plain"], "sampled_ms_per_step": ms["sampled"],
            "ratio": ms["sampled"] / ms["plain"], "spread": [round(1e3 * min(times["sampled"]), 3),
                                                              round(1e3 * max(times["sampled"]), 3)]}


def differential_table(results: list[dict]) -> str:
    lines = ["| model | plain ms/step | every step sampled ms/step | ratio | sampled range ms |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['model']} | {r['plain_ms_per_step']:.3f} | {r['sampled_ms_per_step']:.3f} | {r['ratio']:.2f}x | "
              f"{r['spread'][0]:.3f} - {r['spread'][1]:.3f} |" for r in results]
    return "\n".join(lines)


# GPT-2 from the tiny model to its base size (width, layers, heads): the doctor's work on a sampled step
# grows with the Python state and the ops the step has, the step itself faster.
SCALES = ((32, 2, 4), (128, 4, 4), (256, 6, 8), (768, 12, 12))
SCALE_REPEATS = 3       # runs of each size, plain and sampled taking turns (a base-size step takes 0.1 s)


def differential_scaling(repeats: int = SCALE_REPEATS) -> list[dict]:
    """``differential_cost`` of GPT-2 at each of ``SCALES``, fewer steps the larger it is."""
    out = []
    for hidden, layers, heads in SCALES:
        r = differential_cost("gpt2", steps=max(10, 6400 // (hidden * layers)), repeats=repeats,
                              hidden=hidden, layers=layers, heads=heads)
        out.append({**r, "model": f"gpt2, {hidden} wide, {layers} layers"})
    return out


def _best(fn, calls: int = 50, repeats: int = 400) -> float:
    """µs per call of ``fn``: the fastest of ``repeats`` runs of ``calls`` calls (what the code
    costs when nothing else takes the core)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter_ns() - start) / calls)
    return best / 1e3


class _PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


PIECES = ("slice of the input buffer", "copy_ into it", "serve", "replay_begin", "replay_end",
          "slice of the output", "handed_out")


def breakdown(name: str = "gpt2") -> dict:
    """Where a served ``GraphRunner`` step's added host time goes. A step is 3 eager ops (the
    runner's copy-in ``buffer[:n, :w].copy_(batch)``: a slice and a copy; the manager's ``out[:n]``)
    and 4 events around the replay. The doctor's own Python is timed with the ops handed to it
    directly (modes off): the whole step minus the same ops run plainly, and each piece as the
    whole step minus that piece done plainly. ``mode_us`` is what entering any pass-through
    dispatch mode costs those 3 ops, on top."""
    aten = torch.ops.aten
    slice_, copy_ = aten.slice.Tensor, aten.copy_.default
    model = tiny_model(name, seed=0).eval()
    ids = torch.randint(3, 100, (3, 8), generator=torch.Generator().manual_seed(0))
    with watching(Doctor()) as d, torch.no_grad():
        runner = GraphRunner(lambda input_ids: model(input_ids=input_ids).last_hidden_state,
                             {"input_ids": ((8,), torch.int64)}, [1, 2, 4, 8])
        runner.capture()
        kept = [runner(input_ids=ids)]
        buf, g, out = runner.buffers["input_ids"], runner.graphs[4], runner.outputs[4]
        with _disable_current_modes():
            def watched(func, args):             # as ``session._engine_op`` hands the engine's own ops over
                d.engine_serving = True
                try:
                    return d.on_op(func, args, {}, _Call(func, args, {}))
                finally:
                    d.engine_serving = False

            def plain(func, args):
                return func(*args)

            def step(skip=frozenset(PIECES)):
                view = (plain if PIECES[0] in skip else watched)(slice_, (buf, 0, 0, 3))
                (plain if PIECES[1] in skip else watched)(copy_, (view, ids))
                if PIECES[2] not in skip:
                    events.serve(g, 3, 4, padded=runner.buffers, outputs=out, eager=None)
                if PIECES[3] not in skip:
                    events.replay_begin(g)
                if PIECES[4] not in skip:
                    events.replay_end(g)
                kept[0] = (plain if PIECES[5] in skip else watched)(slice_, (out, 0, 0, 3))
                if PIECES[6] not in skip:
                    events.handed_out(g, kept[0])

            variants = {"plain": step, "full": functools.partial(step, frozenset()),
                        **{p: functools.partial(step, frozenset({p})) for p in PIECES}}
            best = dict.fromkeys([*variants, "mode"], float("inf"))
            for _ in range(10):                  # variants take turns, so that their minima compare
                for key, fn in variants.items():
                    best[key] = min(best[key], _best(fn, repeats=40))
                with _PassThrough():             # alone on the mode stack
                    best["mode"] = min(best["mode"], _best(step, repeats=40))
        assert not d.report.findings, d.report
    return {"model": name, "doctor_us": best["full"] - best["plain"], "mode_us": best["mode"] - best["plain"],
            "pieces": {p: best["full"] - best[p] for p in PIECES}}


def breakdown_table(results: list[dict]) -> str:
    lines = ["| model | doctor's Python per step | " + " | ".join(PIECES) + " | pass-through dispatch mode on the 3 ops |",
             "|---|" + "---:|" * (len(PIECES) + 2)]
    lines += [f"| {r['model']} | {r['doctor_us']:.1f} | " + " | ".join(f"{r['pieces'][p]:.1f}" for p in PIECES)
              + f" | {r['mode_us']:.1f} |" for r in results]
    return "\n".join(lines)


def cpu_tables(steps: int = 300, repeats: int = 7) -> str:
    torch.manual_seed(0)
    load = os.getloadavg()[0]
    off = [overhead("cpu", name, steps=steps, repeats=repeats) for name in COST_MODELS]
    on = [differential_cost(name, steps=steps // 3, repeats=repeats) for name in COST_MODELS]
    scaled = differential_scaling()
    parts = [breakdown(name) for name in COST_MODELS]
    machine = (f"torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} threads, {os.cpu_count()} "
               f"cores, load average {load:.1f} at the start and {os.getloadavg()[0]:.1f} at the end")
    return (f"Graph doctor overhead (`python benchmarks/bench_doctor.py`), {machine}; tiny models, sizes 1, 2, 4, "
            f"8, 3 real rows padded to 4, plain and watched runs taking turns, medians over {repeats} runs.\n\n"
            f"Differential replay off (`GraphRunner`, {steps} steps a run). *wall*: steps back to back; *host*: "
            f"each step timed alone until it returns (on the CPU backend the two coincide).\n\n{cost_table(off)}\n\n"
            f"Differential replay on, every step sampled (a graph manager announcing its eager step, {steps // 3} "
            f"steps a run): the cost of one sampled step.\n\n{differential_table(on)}\n\n"
            f"The same for GPT-2 from the tiny model to its base size (768 wide, 12 layers; vocabulary 100), medians "
            f"over {SCALE_REPEATS} runs: the sampled step runs the step's eager form beside its replay, and the "
            f"doctor's own work on it (the Python state the step reaches, kept and compared; the state copied and "
            f"put back; an eager run watched op by op every {TRACE_EVERY}th step) grows more slowly than the step."
            f"\n\n"
            f"{differential_table(scaled)}\n\n"
            f"Where the added host time of a served step goes, differential replay off (µs, fastest of 400 x 50 "
            f"steps, the variants taking turns; each piece is the whole step minus that piece, so pieces need not "
            f"add up to the total).\n\n"
            f"{breakdown_table(parts)}\n")


def main(gpu_only: bool = False) -> None:
    table = RESULTS.read_text().split("\nGPU (")[0] if gpu_only else cpu_tables()
    for gpu in gpu_costs():
        runs = gpu["results"]["overhead"]
        table += (f"\nGPU (`results/gpu/{gpu['file']}`, `scripts/gpu_session.py OUT graph_doctor_cost`): {gpu['device']}, "
                  f"torch {gpu['torch']}, {gpu['date']}. Differential replay off. Median over {runs[0]['repeats']} "
                  f"alternating runs of {runs[0]['steps']} steps each.\n\n{cost_table(runs)}\n")
    RESULTS.write_text(table)
    print(table)


if __name__ == "__main__":
    main(gpu_only="--gpu-only" in sys.argv[1:])
