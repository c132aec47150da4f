"""The main job: execute every notebook in notebooks/ headless with papermill.

Executed copies go to build/notebooks/ (git-ignored). The notebooks write their figures to
figures/ only on a full-size run with default parameters, and to build/figures/ otherwise (see
``workbench.plots.figure_policy``). Parameters: ``-p NAME VALUE`` (repeatable, values parsed as
Python literals, else passed as text, which each notebook's ``check_parameters`` converts or
refuses), e.g. ``python scripts/run_notebooks.py -p FAST True -p SEED 1 --only 01``.
"""
from __future__ import annotations

import argparse
import ast
import pathlib
import sys
import time

import papermill

ROOT = pathlib.Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"))
    ap.add_argument("--only", action="append", default=[], help="run notebooks whose name starts with this")
    ap.add_argument("--timeout", type=int, default=1800, help="per-cell timeout in seconds")
    args = ap.parse_args(argv)
    params = {"INTERACTIVE": False}
    for name, value in args.parameter:
        try:
            params[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            params[name] = value
    notebooks = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    if args.only:
        notebooks = [nb for nb in notebooks if any(nb.name.startswith(o) for o in args.only)]
    if not notebooks:
        print("no notebooks matched", file=sys.stderr)
        return 2
    out_dir = ROOT / "build" / "notebooks"
    out_dir.mkdir(parents=True, exist_ok=True)
    failed = []
    for nb in notebooks:
        start = time.perf_counter()
        print(f"==> {nb.name} {params}", flush=True)
        try:
            papermill.execute_notebook(nb, out_dir / nb.name, parameters=params, kernel_name="python3",
                                       cwd=str(nb.parent), execution_timeout=args.timeout,
                                       progress_bar=False)
        except papermill.PapermillExecutionError as e:
            failed.append(nb.name)
            print(f"FAILED {nb.name}: {e.ename}: {e.evalue}", file=sys.stderr)
        print(f"    {time.perf_counter() - start:.1f} s", flush=True)
    print(f"{len(notebooks) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
