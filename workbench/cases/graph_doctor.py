"""The graph doctor evaluated: the five cases (bug and fix) and three clean ``transformers`` models.

Each case's workload is its own scenario, made small: the runner or manager the case built, captured
and serving a few steps, nothing changed for the doctor. The expected finding names the op and the
user function where the upstream bug lives (or, for a missing kernel or a dead tensor, where the
graph reads it); every fix must give no finding at all.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import time
import warnings
from collections.abc import Callable

import matplotlib.pyplot as plt
import numpy as np
import torch

from .. import cases, doctor, plots
from ..dist import launch
from ..doctor.intake import Doctor
from ..doctor.session import watching
from ..engine import GraphRunner, synchronize
from ..models.hf import tiny_model

CASES = tuple(case.id for case in cases.CASES)
# Case 01 served as vLLM serves it by default: PIECEWISE graphs, the in-place shift in eager code
# between them (in CASES it is captured in FULL mode, inside the graph).
PIECEWISE = (f"{cases.get(1).id} piecewise",)
COST_MODELS = ("gpt2", "bert", "roberta")     # the tiny transformers models the cost is measured on
# ``overhead(size=...)``: the tiny models, and the size of GPT-2 small / BERT base
MODEL_SIZES = {"tiny": {}, "base": {"hidden": 768, "layers": 12, "heads": 12}}
RESULTS = cases.ROOT / "results" / "gpu"


@dataclasses.dataclass(frozen=True)
class Expected:
    """What the doctor should say about a case's bug: the kind, the op, and the user function
    (``file``, ``function``) of the source line it points at."""

    kind: str
    op: str
    file: str
    function: str

    def matches(self, finding: doctor.Finding) -> bool:
        location = finding.location
        return (finding.kind == self.kind and finding.op.startswith(self.op) and self.file in location
                and location.endswith(f"in {self.function}"))


def _case_of(key: str) -> cases.Case:
    return cases.get(key.split()[0])


def expected(key: str) -> Expected:
    """A case's ``DOCTOR_EXPECTED`` (its scenario says what the doctor should find)."""
    case = _case_of(key)
    kind, op, file, function = case.module("scenario").DOCTOR_EXPECTED
    return Expected(kind, op, f"{case.id}/{file}", function)


def workload(key: str, variant: str, device: str) -> Callable[[], None]:
    """The case's own ``doctor_workload``: its runner captured and serving a few steps."""
    options = {"mode": "PIECEWISE"} if key in PIECEWISE else {}
    return _case_of(key).module("scenario").doctor_workload(variant, device, **options)


def _rank_report(key: str, variant: str, device: str) -> doctor.Report:
    """One rank of a multi-GPU case, diagnosed in its own process."""
    return doctor.diagnose(workload(key, variant, device))


# ----------------------------------------------------------------------------- evaluation
@dataclasses.dataclass
class Row:
    """One line of the evaluation table."""

    case: str
    variant: str
    report: doctor.Report
    seconds: float

    @property
    def kinds(self) -> list[str]:
        return sorted(self.report.kinds, key=doctor.KINDS.index)

    @property
    def expected(self) -> Expected | None:
        return expected(self.case) if self.variant == "bug" else None

    @property
    def hit(self) -> doctor.Finding | None:
        """The finding that matches the expectation (bug), if any."""
        exp = self.expected
        return None if exp is None else next((f for f in self.report.findings if exp.matches(f)), None)

    @property
    def correct(self) -> bool:
        """bug: the expected finding, and no finding of another kind; fix: no finding at all."""
        if self.expected is None:
            return not self.report.findings
        return self.hit is not None and set(self.kinds) == {self.expected.kind}

    def summary(self) -> str:
        f = self.hit if self.expected else None
        where = f"{f.op} at {f.location}" if f else ("-" if self.expected is None else "expected finding missing")
        return (f"{self.case:<22}{self.variant:<5}{', '.join(self.kinds) or 'no finding':<40}{where:<95}"
                f"{'correct' if self.correct else 'WRONG'}")


def evaluate(device: str = "cpu", keys: tuple[str, ...] = CASES, variants: tuple[str, ...] = cases.VARIANTS,
             progress: bool = False) -> list[Row]:
    """Run ``diagnose`` on every case and variant (a multi-GPU case on its tensor-parallel ranks)."""
    rows = []
    for key in keys:
        ranks = _case_of(key).gpus
        for variant in variants:
            if progress:
                print(f"diagnosing {key} ({variant})", flush=True)
            start = time.perf_counter()
            if ranks > 1:
                report = launch(_rank_report, ranks, key, variant, device, device=device)[0]
            else:
                report = doctor.diagnose(workload(key, variant, device))
            rows.append(Row(key, variant, report, time.perf_counter() - start))
    return rows


def clean_models(device: str = "cpu", names: tuple[str, ...] = ("roberta", "bert", "gpt2")) -> dict[str, doctor.Report]:
    """``transformers`` RobertaModel, BertModel and GPT2Model through ``GraphRunner``: expected clean."""
    reports = {}
    for name in names:
        def make_runner(name=name) -> GraphRunner:
            model = tiny_model(name, seed=0).to(device).eval()
            return GraphRunner(lambda input_ids: model(input_ids=input_ids).last_hidden_state,
                               {"input_ids": ((8,), torch.int64)}, [1, 2, 4, 8], device=device)

        def make_batch(n: int, step: int) -> dict[str, torch.Tensor]:
            gen = torch.Generator().manual_seed(step)
            return {"input_ids": torch.randint(3, 100, (n, 8), generator=gen).to(device)}
        reports[name] = doctor.diagnose(make_runner, make_batch)
    return reports


# ----------------------------------------------------------------------------- cost
def overhead(device: str = "cpu", name: str = "gpt2", steps: int = 200, repeats: int = 5,
             batch: int = 3, chunk: int = 25, size: str = "tiny") -> dict:
    """What ``watch()`` adds to a replay-heavy run (``GraphRunner`` over a tiny ``transformers``
    model, ``batch`` real rows padded to 4), in two measures per served step:

    * *wall* time: steps back to back, one synchronize at the end -- what a serving loop sees;
    * *host* time: each step alone on an idle device, timed until the call returns -- the Python
      and launch work, which is where the doctor's cost lands (its checks run on the host).

    On the CPU backend the two coincide. On a GPU the host cost shows in wall time only where the
    step is host-bound; a step the GPU takes longer over hides it.

    ``size`` is ``"tiny"`` (hidden 32, 2 layers: a step so short that the GPU waits for the host,
    the worst case for any host-side cost) or ``"base"`` (hidden 768, 12 layers, 12 heads: the size
    of GPT-2 small and BERT base, whose step the GPU takes longer over).

    Plain and watched take turns every ``chunk`` steps (as the functions of
    ``benchmarks/bench_replay.py`` do), so a change in the machine's load hits both alike instead of
    whole runs: both runners are captured once, the watched one inside a doctor that is re-entered
    for each of its turns (it knows the graphs from their capture, as one long ``watch()`` would).
    A repeat is ``steps`` steps of each; every repeat is kept (``*_per_repeat``), medians over the
    repeats give the headline numbers, and the range of the per-repeat differences is their spread:
    when it covers 0 the difference is within noise (``spread_text``). ``watched_replays`` counts the
    replays the doctor saw (every watched step, so none of its turns ran unwatched).
    """
    for arg, value, least in (("steps", steps, 1), ("repeats", repeats, 1), ("batch", batch, 1), ("chunk", chunk, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"overhead: {arg} must be a whole number >= {least}, got {value!r}")
    if size not in MODEL_SIZES:
        raise ValueError(f"overhead: size must be one of {sorted(MODEL_SIZES)}, got {size!r}")
    model = tiny_model(name, seed=0, **MODEL_SIZES[size]).to(device).eval()
    ids = torch.randint(3, 100, (batch, 8), generator=torch.Generator().manual_seed(0)).to(device)
    watcher = Doctor()

    def watched(on: bool):
        return watching(watcher) if on else contextlib.nullcontext()

    def runner(on: bool) -> GraphRunner:
        with watched(on):
            r = GraphRunner(lambda input_ids: model(input_ids=input_ids).last_hidden_state,
                            {"input_ids": ((8,), torch.int64)}, [1, 2, 4, 8], device=device)
            r.capture()
            r(input_ids=ids)            # the first replay (the doctor probes each graph once)
        return r

    def wall(r: GraphRunner, n: int) -> float:
        synchronize(device)
        start = time.perf_counter()
        for _ in range(n):
            r(input_ids=ids)
        synchronize(device)
        return time.perf_counter() - start

    def host(r: GraphRunner, n: int) -> float:
        total = 0.0
        for _ in range(n):
            start = time.perf_counter()
            r(input_ids=ids)
            total += time.perf_counter() - start
            synchronize(device)
        return total

    with torch.no_grad():
        runners = {False: runner(False), True: runner(True)}
        per = {(on, m): [] for on in (False, True) for m in ("wall", "host")}
        for _ in range(repeats):
            for measure, timed in (("wall", wall), ("host", host)):
                seconds = {False: 0.0, True: 0.0}
                for turn, start in enumerate(range(0, steps, chunk)):
                    for on in (turn % 2 == 1, turn % 2 == 0):       # who goes first alternates too
                        with watched(on):
                            seconds[on] += timed(runners[on], min(chunk, steps - start))
                for on in (False, True):
                    per[on, measure].append(1e3 * seconds[on] / steps)
    ms = {key: float(np.median(v)) for key, v in per.items()}
    wall_ratio = [w / p - 1 for p, w in zip(per[False, "wall"], per[True, "wall"])]
    host_added = [1e3 * (w - p) for p, w in zip(per[False, "host"], per[True, "host"])]
    return {"device": str(device), "model": name if size == "tiny" else f"{name} ({size})", "size": size,
            "steps": steps, "repeats": repeats, "chunk": chunk,
            "plain_ms_per_step": ms[False, "wall"], "watched_ms_per_step": ms[True, "wall"],
            "plain_host_ms_per_step": ms[False, "host"], "watched_host_ms_per_step": ms[True, "host"],
            "overhead": ms[True, "wall"] / ms[False, "wall"] - 1,
            "host_added_us": 1e3 * (ms[True, "host"] - ms[False, "host"]),
            "plain_ms_per_repeat": per[False, "wall"], "watched_ms_per_repeat": per[True, "wall"],
            "plain_host_ms_per_repeat": per[False, "host"], "watched_host_ms_per_repeat": per[True, "host"],
            "overhead_per_repeat": wall_ratio, "host_added_us_per_repeat": host_added,
            "overhead_range": [min(wall_ratio), max(wall_ratio)],
            "host_added_us_range": [min(host_added), max(host_added)],
            "watched_replays": watcher.report.replays,
            "syncs_per_step": {"plain": _syncs(runners[False], ids, None),
                               "watched": _syncs(runners[True], ids, watcher)}}


def _syncs(runner: GraphRunner, ids: torch.Tensor, watcher: Doctor | None, steps: int = 10) -> float | None:
    """Host-device synchronisations per served step, as CUDA's sync debug mode counts them (None on
    the CPU). A watcher that synchronised would cost every step the GPU's whole queue, whatever its
    host time; this shows that it does not."""
    if ids.device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            with watching(watcher) if watcher is not None else contextlib.nullcontext():
                for _ in range(steps):
                    runner(input_ids=ids)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message).lower() for w in caught) / steps


_SPREADS = {"wall": ("overhead", "{:+.1%}"), "host": ("host_added_us", "{:+.0f} µs")}


def spread_text(result: dict, measure: str = "wall") -> str:
    """The spread of an ``overhead()`` result's per-repeat difference (``measure``: wall, the
    overhead ratio, or host, the µs added), in words: ``within noise`` when the range covers 0, so
    that a loaded machine cannot turn a cost into a saving (or the reverse) without saying so."""
    if measure not in _SPREADS:
        raise ValueError(f"spread_text: measure must be one of {sorted(_SPREADS)}, got {measure!r}")
    key, fmt = _SPREADS[measure]
    if f"{key}_range" not in result:
        return "spread not recorded"
    if result["repeats"] < 2:
        return "one repeat: no spread"
    lo, hi = result[f"{key}_range"]
    span = f"{fmt.format(lo)} to {fmt.format(hi)}"
    return f"{span}, within noise" if lo <= 0 <= hi else span


def other_kinds(device: str = "cpu") -> dict[str, list[str]]:
    """The two kinds no case exercises, on tiny runners: a host sync inside capture, and an output
    read after the next replay (expected: exactly that kind each)."""
    def runner(fn) -> GraphRunner:
        return GraphRunner(fn, {"x": ((4,), torch.float32)}, [2, 4], device=device)

    def sync() -> None:
        runner(lambda x: x * x.sum().item()).capture()

    def overwritten() -> None:
        r = runner(lambda x: x * 2)
        r.capture()
        first = r(x=torch.ones(4, 4, device=device))
        r(x=torch.zeros(4, 4, device=device))
        first.sum()

    return {name: sorted(doctor.diagnose(fn).kinds) for name, fn in
            (("sync-in-capture", sync), ("overwritten-output", overwritten))}


def record(rows: list[Row]) -> list[dict]:
    """The evaluation as plain data (for ``results/gpu`` and the CPU test that compares with it)."""
    out = []
    for r in rows:
        hit = r.hit
        out.append({"case": r.case, "variant": r.variant, "kinds": r.kinds, "correct": r.correct,
                    "op": hit.op if hit else None, "location": hit.location if hit else None,
                    "seconds": round(r.seconds, 2)})
    return out


def gpu_record(device: str = "cuda") -> dict:
    """The evaluation and the clean models on CUDA (case 03 needs two GPUs)."""
    keys = tuple(k for k in CASES if _case_of(k).gpus <= torch.cuda.device_count())
    clean = clean_models(device)
    return {"evaluation": record(evaluate(device, keys)), "other_kinds": other_kinds(device),
            "clean_models": {name: {"kinds": sorted(r.kinds), "not_checked": sorted(r.not_checked)}
                             for name, r in clean.items()}}


def piecewise_record(device: str = "cuda") -> dict:
    """Case 01 under PIECEWISE graphs on one GPU (``results/gpu/graph_doctor_piecewise.json``)."""
    return {"evaluation": record(evaluate(device, PIECEWISE))}


def cost_record(device: str = "cuda") -> dict:
    """``overhead()`` on one GPU for the three tiny models and GPT-2 at its base size
    (``results/gpu/graph_doctor_cost.json``)."""
    return {"overhead": [overhead(device, name, steps=300, repeats=9) for name in COST_MODELS]
            + [overhead(device, "gpt2", steps=300, repeats=9, size="base")]}


# ----------------------------------------------------------------------------- figures
def plot_matrix(rows: list[Row]) -> plt.Figure:
    """Case x kind: what the doctor found for each bug and fix (expected cells outlined)."""
    labels = [f"{r.case} · {r.variant}" for r in rows]
    grid = np.zeros((len(rows), len(doctor.KINDS)))
    for i, r in enumerate(rows):
        for j, kind in enumerate(doctor.KINDS):
            if kind in r.report.not_checked:
                grid[i, j] = np.nan
            elif kind in r.report.kinds:
                grid[i, j] = 1.0
    fig, ax = plt.subplots(figsize=(1.1 * len(doctor.KINDS) + 3.5, 0.5 * len(rows) + 2.2))
    clean, unchecked = "#f4f4f4", "#d9d9d9"
    cmap = plt.matplotlib.colors.ListedColormap([clean, plots.COLORS["bug"]]).with_extremes(bad=unchecked)
    ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(np.arange(len(doctor.KINDS) + 1) - 0.5, minor=True)
    ax.set_yticks(np.arange(len(rows) + 1) - 0.5, minor=True)
    ax.grid(which="minor", color="white", linewidth=1.5)
    ax.tick_params(which="minor", length=0)
    for i, r in enumerate(rows):
        exp = r.expected
        for j, kind in enumerate(doctor.KINDS):
            text = "found" if grid[i, j] == 1 else ("not\nchecked" if np.isnan(grid[i, j]) else "")
            ax.text(j, i, text, ha="center", va="center", fontsize=8,
                    color="white" if grid[i, j] == 1 else "#555555")
            if exp is not None and kind == exp.kind:
                ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, lw=2, ec=plots.COLORS["limit"],
                                           zorder=3))
        ax.text(len(doctor.KINDS) - 0.35, i, "correct" if r.correct else "WRONG", va="center", fontsize=8,
                color=plots.COLORS["fix"] if r.correct else plots.COLORS["bug"])
    ax.set_xticks(range(len(doctor.KINDS)), doctor.KINDS, rotation=30, ha="right")
    ax.set_yticks(range(len(rows)), labels)
    ax.set_xlim(-0.5, len(doctor.KINDS) + 0.6)
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)
    legend = [plt.matplotlib.patches.Patch(color=plots.COLORS["bug"], label="found"),
              plt.matplotlib.patches.Patch(fc=clean, ec="#bbbbbb", label="checked, nothing found"),
              plt.matplotlib.patches.Patch(color=unchecked, label="not checked (see the report)"),
              plt.matplotlib.patches.Patch(fill=False, ec=plots.COLORS["limit"], lw=2,
                                           label="the kind the bug should give")]
    ax.legend(handles=legend, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=4, frameon=False, fontsize=8)
    ax.set_title("Graph doctor on the five cases: findings per kind and variant", pad=28)
    fig.tight_layout()
    return fig


def table(rows: list[Row]) -> str:
    """The evaluation as a Markdown table: per case and variant, the kinds found and the op and
    source line of the finding that matches the expectation (what the README quotes)."""
    lines = ["| case | variant | kinds found | op | source | correct |", "|---|---|---|---|---|---|"]
    for r in record(rows):
        op, where = (f"`{r['op']}`", f"`{r['location']}`") if r["op"] else ("-", "-")
        lines.append(f"| {r['case']} | {r['variant']} | {', '.join(r['kinds']) or 'none'} | {op} | {where} | "
                     f"{'yes' if r['correct'] else '**no**'} |")
    return "\n".join(lines)


def cost_table(results: list[dict]) -> str:
    """``overhead()`` results as a Markdown table (the benchmark's and the notebook's), medians over
    the repeats with the range of the per-repeat differences (``spread_text``)."""
    lines = ["| model | device | plain ms/step | watched ms/step | wall overhead | over repeats | plain host ms "
             "| watched host ms | host µs added per step | over repeats |",
             "|---|---|---:|---:|---:|---|---:|---:|---:|---|"]
    lines += [f"| {r['model']} | {r['device']} | {r['plain_ms_per_step']:.3f} | {r['watched_ms_per_step']:.3f} | "
              f"{100 * r['overhead']:+.1f} % | {spread_text(r, 'wall')} | {r['plain_host_ms_per_step']:.3f} | "
              f"{r['watched_host_ms_per_step']:.3f} | {r['host_added_us']:+.0f} | {spread_text(r, 'host')} |"
              for r in results]
    return "\n".join(lines)


def gpu_costs() -> list[dict]:
    """The committed GPU cost records (``results/gpu/graph_doctor_cost*.json``, written by
    ``scripts/gpu_session.py OUT graph_doctor_cost``), each with its ``file``: the current one first
    (``graph_doctor_cost.json``), then the others kept for comparison (H100 hosts of the two days
    before, the H200 record of the doctor before its general mechanisms)."""
    return [{**json.loads(p.read_text()), "file": p.name} for p in sorted(RESULTS.glob("graph_doctor_cost*.json"))]


def plot_overhead(result: dict) -> plt.Figure:
    """Wall and host milliseconds per served step, without and inside ``watch()`` (an
    ``overhead()`` result): bars at the medians, one dot per repeat, and in each title the median
    difference with its spread over the repeats (``within noise`` when it covers 0)."""
    fig, axes = plt.subplots(1, 2, figsize=(8.4, 3.6), sharey=True)
    top = 0.0
    for ax, measure, key in ((axes[0], "wall", "ms_per_step"), (axes[1], "host", "host_ms_per_step")):
        values = {"plain": result[f"plain_{key}"], "inside watch()": result[f"watched_{key}"]}
        top = max(top, *values.values())
        plots.bars(ax, values, colors=dict.fromkeys(values, plots.COLORS["real"]), fmt="{:.3f} ms",
                   ylabel="ms per served step (median)" if measure == "wall" else "",
                   title=f"{measure} time: {values['inside watch()'] / values['plain'] - 1:+.0%}\n"
                         f"per repeat {spread_text(result, measure)}")
        ax.patches[1].set_hatch("//")
        for x, variant in enumerate(("plain", "watched")):
            per = result.get(f"{variant}_{key.replace('_per_step', '_per_repeat')}", [])
            top = max(top, *per, 0.0)
            ax.scatter(np.full(len(per), x), per, s=14, color=plots.COLORS["limit"], zorder=3,
                       label="one repeat" if x == 0 and per else None)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="lower right")
    axes[0].set_ylim(0, 1.2 * top)
    fig.suptitle(f"Cost of watching: {result['model']} on {result['device']}, "
                 f"{result['host_added_us']:+.0f} \u00b5s of host work per step")
    fig.tight_layout()
    return fig


def explore(rows: list[Row]):
    """A drop-down over the evaluation's rows showing each full report (JupyterLab only)."""
    import ipywidgets as widgets
    from IPython.display import display

    options = [(f"{r.case} · {r.variant}", i) for i, r in enumerate(rows)]
    return widgets.interactive(lambda row: display(rows[row].report),
                               row=widgets.Dropdown(options=options, description="run"))
