"""Held-out trials: real CUDA-graph bugs written without the doctor, to measure it on code it never saw.

Each round's programs were written from upstream fix PRs by authors who did not read the doctor
and did not run it: they chose the expected kind from the kinds' definitions and the site from the
mechanism, and checked only that the bug misbehaves and the fix equals eager. The doctor was then
run on them unchanged; what it found at that point is each round's blind result
(``benchmarks/README.md``), and mechanisms built afterwards are general (none names a program).
A new round's directory joins ``ROUNDS`` only when its blind result is taken: until then the
doctor is never run on its programs.
The programs share the zoo's format (``UPSTREAM``, ``FAMILY``, ``KIND``, ``SITE``, ``SYMPTOM``,
``run(variant, device)``), but unlike the zoo the set is not curated: misses stay in it.

    python -m workbench.zoo.trials          # the doctor on every trial program: writes the table

Their table (``benchmarks/results_trials.md``) is generated from the doctor's answers, and a test
checks it is current. ``gpu_record`` runs each variant on real CUDA graphs
(``results/gpu/doctor_trials.json``): where a program behaves there as on the emulation, the
doctor must answer there as it does here. (Not everywhere: a program may model its GPU behaviour
with a CPU stand-in, and an index out of range, an ``IndexError`` here, is a device-side assert
there, which ends the CUDA context before the doctor can look.) A record's ``amended`` entry lists
variants recorded again after the full run, on which device and why.
"""
from __future__ import annotations

import concurrent.futures
import datetime
import functools
import importlib
import json
import pathlib
import pkgutil
from collections.abc import Sequence
from types import ModuleType

import torch

from ...childproc import run_in_child
from ...engine.source import function_of
from .. import VARIANTS, _check

ROUNDS = ("round4", "round5", "round6", "round7", "round8", "round9", "round10", "round11", "round12", "round13", "round14", "round15", "round16", "round17", "round18", "round19", "round20", "round21", "round22", "round23", "round24", "round25", "round26", "round27", "round28", "round29", "round30", "round31", "round32", "round33", "round34", "round35", "round36", "round37", "round38", "round39", "round40", "round41", "round42", "round43", "round44", "round45", "round46", "round47", "round48", "round49", "round50", "round51", "round52", "round53", "round54", "round55", "round56", "round57", "round58", "round59", "round60", "round61", "round62", "round63", "round64", "round65", "round66", "round67", "round68", "round69", "round70", "round71", "round72", "round73", "round74", "round75", "round76", "round77", "round78", "round79", "round80", "round81", "round82", "round83", "round84", "round85", "round86", "round87", "round88", "round89", "round90", "round91", "round92", "round93", "round94", "round95", "round96", "round97", "round98", "round99", "round100", "round101", "round102", "round103", "round104", "round105", "round106", "round107", "round108", "round109", "round110", "round111", "round112", "round113", "round114", "round115", "round116", "round118", "round119", "round121", "round122", "round123", "round124", "round125", "round126", "round127", "round128", "round129", "round130", "round131", "round132", "round133", "round134", "round135", "round136", "round137", "round138", "round139", "round140", "round141", "round142", "round143", "round144", "round145", "round146", "round147", "round148", "round149")
ROOT = pathlib.Path(__file__).resolve().parents[3]
TABLE = ROOT / "benchmarks" / "results_trials.md"
RESULT = ROOT / "results" / "gpu" / "doctor_trials.json"


@functools.cache
def names() -> tuple[str, ...]:
    """``round/program`` for every trial program, by round then name."""
    out = []
    for r in ROUNDS:
        package = importlib.import_module(f"{__name__}.{r}")
        out += [f"{r}/{m.name}" for m in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name)]
    return tuple(out)


def program(name: str) -> ModuleType:
    if name not in names():
        raise ValueError(f"unknown trial program {name!r}; programs are: {', '.join(names())}")
    module = importlib.import_module(f"{__name__}.{name.replace('/', '.')}")
    _check(module)
    return module


def doctor_of(name: str, variant: str, device: str = "cpu") -> dict:
    """What ``doctor.diagnose`` says of one variant: the finding of the expected kind if there is one
    (else the first), its kind and function, every kind found, and whether the doctor failed."""
    from ...doctor import diagnose
    prog = program(name)
    report = diagnose(lambda: prog.run(variant, device))
    best = next((f for f in report.findings if f.kind == prog.KIND), report.findings[0] if report.findings else None)
    return {"kind": best.kind if best else None, "site": function_of(best.location) if best else None,
            "kinds": sorted(report.kinds), "failed": report.failure is not None, "failure": report.failure}


def verdict(name: str, answers: dict) -> str:
    """``right`` (the expected kind at the expected function), ``wrong`` (another kind or site),
    ``missed`` (no finding) for the bug; ``, finding on fix`` when the fix has one."""
    prog, bug, fix = program(name), answers["bug"], answers["fix"]
    if bug["kind"] is None:
        out = "missed"
    else:
        out = "right" if (bug["kind"], bug["site"]) == (prog.KIND, prog.SITE) else "wrong"
    return out + (", finding on fix" if fix["kind"] is not None else "")


def answers(device: str = "cpu", programs: Sequence[str] | None = None, jobs: int = 1) -> dict:
    """``{name: {"bug": doctor_of(...), "fix": doctor_of(...)}}``, in the order asked for: in this
    process, or in ``jobs`` forked ones (a program at a time each: all of them take about 40 minutes
    of one core), with a progress bar. Several jobs are for the CPU emulation only: a process that
    has started CUDA cannot fork (``gpu_record`` runs each program in a child of its own)."""
    todo = list(programs or names())
    if jobs <= 1:
        return {n: {v: doctor_of(n, v, device) for v in VARIANTS} for n in todo}
    if torch.device(device).type != "cpu":
        raise ValueError(f"answers(jobs={jobs}) forks, which a CUDA process cannot: use jobs=1 or gpu_record on "
                         f"{device!r}")
    import multiprocessing

    from tqdm.auto import tqdm
    found: dict = {}
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        futures = {pool.submit(answers, device, [n]): n for n in todo}
        for future in tqdm(concurrent.futures.as_completed(futures), total=len(todo), desc="trial programs"):
            found.update(future.result())
    return {n: found[n] for n in todo}


def moved(found: dict) -> list[str]:
    """The committed table's rows whose answers ``found`` changes (or adds), as ``found`` would write
    them: what a change of the doctor moved, before the table is written again."""
    committed = set(TABLE.read_text().splitlines()) if TABLE.exists() else set()
    rows = table(found).splitlines()[2:len(found) + 2]
    return [row for row in rows if row not in committed]


def table(found: dict) -> str:
    """The Markdown table of ``answers``: one row per program, then the count per round."""
    rows = ["| round | program | expected | bug: kind @ function | fix | verdict |", "|---|---|---|---|---|---|"]
    counts: dict[str, list] = {}
    for name, a in found.items():
        r, short = name.split("/")
        prog, v = program(name), verdict(name, a)
        bug = f"{a['bug']['kind']} @ `{a['bug']['site']}`" if a["bug"]["kind"] else "no finding"
        fix = f"{a['fix']['kind']} @ `{a['fix']['site']}`" if a["fix"]["kind"] else "clean"
        link = f"[{short}]({prog.UPSTREAM})"
        rows.append(f"| {r} | {link} | {prog.KIND} @ `{prog.SITE}` | {bug} | {fix} | {v} |")
        c = counts.setdefault(r, [0, 0, 0])
        c[0] += v.startswith("right")
        c[1] += 1
        c[2] += v.endswith("finding on fix")
    total = [sum(c[i] for c in counts.values()) for i in range(3)]
    summary = "; ".join(f"{r}: {c[0]} of {c[1]} right, {c[2]} finding(s) on fixes" for r, c in counts.items())
    return ("\n".join(rows) + f"\n\nRight kind at the right function: {total[0]} of {total[1]} ({summary}); "
            f"findings on fixes: {total[2]}.\n")


def write_table(found: dict | None = None) -> str:
    """The table of ``found`` (default: the doctor's answers now), written to ``TABLE``."""
    text = (f"The doctor on the held-out trial programs (`python -m workbench.zoo.trials`, CPU emulation, "
            f"torch {torch.__version__}). Generated: do not edit by hand.\n\n{table(found or answers())}")
    TABLE.write_text(text)
    return text


def verdict_of(name: str, variant: str, device: str) -> dict:
    """One variant's verdict against eager on ``device`` (``run``), and the error it raised, if any."""
    outcome = program(name).run(variant, device)
    return {"verdict": outcome.verdict, "error": list(outcome.error) if outcome.error else None}


def gpu_record(device: str = "cuda", programs: Sequence[str] | None = None, jobs: int = 8,
               partial: pathlib.Path | None = None) -> dict:
    """Each variant's verdict and the doctor's answer on real CUDA graphs, each in a child process
    of its own (a bug may end its CUDA context: a device-side assert in the plain run must not take
    the doctor's run with it), ``jobs`` at a time; a child that dies records the error instead.
    With ``partial``, the record of the programs finished so far is rewritten there as each one
    finishes: a session cut off by its time limit still keeps what it measured."""
    todo = [(part, name, variant) for name in (programs or names()) for variant in VARIANTS
            for part in (verdict_of, doctor_of)]
    on_gpu = torch.device(device).type == "cuda" and torch.cuda.is_available()
    record = {"device": torch.cuda.get_device_name() if on_gpu else device, "torch": torch.__version__,
              "date": datetime.date.today().isoformat(), "programs": {}}
    out: dict[str, dict] = {}
    left = {name: 2 * len(VARIANTS) for _, name, _ in todo}
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {pool.submit(run_in_child, *job, device, timeout=300): job for job in todo}
        for future in concurrent.futures.as_completed(futures):
            part, name, variant = futures[future]
            result = future.result()
            died = {"error": [result.error_type or "ChildDied",
                              (result.error or f"exit code {result.exitcode}").splitlines()[0][:200]]}
            entry = out.setdefault(name, {}).setdefault(variant, {})
            if part is verdict_of:
                entry.update(result.value if result.ok else {"verdict": None, **died})
            else:
                entry.update(result.value if result.ok else {"kind": None, "site": None, "kinds": [],
                                                             "failed": True, "failure": died["error"][1]})
            left[name] -= 1
            if partial is not None and not left[name]:
                done = {n: out[n] for n in left if not left[n]}
                partial.write_text(json.dumps({**record, "programs": done}, indent=1) + "\n")
    # In the order asked for, whatever order the children finished in.
    return {**record, "programs": {n: {v: out[n][v] for v in VARIANTS} for n in left}}


def amend(record: dict, why: str) -> int:
    """Merge a GPU record of some programs (``gpu_record(programs=...)``, bare or wrapped by
    ``scripts/gpu_session.py``) into the committed one, with an ``amended`` entry saying when, on
    what and why: new programs, or programs whose CPU answer a change moved. Returns the programs
    merged. The device must be the committed record's kind of machine (a CUDA GPU)."""
    part = record.get("results", record)
    if not part.get("programs") or part.get("device") in ("cpu", "cuda"):
        raise ValueError("not a GPU record of trial programs (no programs, or recorded without a GPU name)")
    unknown = sorted(set(part["programs"]) - set(names()))
    if unknown:
        raise ValueError(f"programs not in ROUNDS: {unknown[:3]}")
    data = json.loads(RESULT.read_text())
    whole = data.get("results", data)
    whole["programs"].update(part["programs"])
    whole.setdefault("amended", []).append({"date": part["date"], "device": part["device"], "torch": part["torch"],
                                            "programs": sorted(part["programs"]), "why": why})
    RESULT.write_text(json.dumps(data, indent=1) + "\n")
    return len(part["programs"])


def load() -> dict | None:
    """The committed GPU record (bare, or wrapped by ``scripts/gpu_session.py``), or None."""
    if not RESULT.exists():
        return None
    data = json.loads(RESULT.read_text())
    return data.get("results", data)
