"""``python -m workbench.zoo.trials [--jobs N] [--check]``: the doctor on every trial program,
written to its table (``--jobs``: in N processes). ``--check`` writes nothing: it prints the table
rows the doctor now answers otherwise, and exits 1 if there are any.

``python -m workbench.zoo.trials amend RECORD.json "why"``: merge a GPU record of some programs
(``scripts/gpu_session.py OUT doctor_trials@NAMES.txt``) into ``results/gpu/doctor_trials.json``.
"""
import argparse
import json
import sys

from . import amend, answers, moved, write_table

if sys.argv[1:2] == ["amend"]:
    if len(sys.argv) != 4:
        sys.exit('usage: python -m workbench.zoo.trials amend RECORD.json "why"')
    with open(sys.argv[2]) as f:
        print(f"{amend(json.load(f), sys.argv[3])} program(s) merged")
else:
    parser = argparse.ArgumentParser(prog="python -m workbench.zoo.trials")
    parser.add_argument("--jobs", type=int, default=1, help="processes to run the programs in (default 1)")
    parser.add_argument("--check", action="store_true", help="print the rows that moved; write nothing")
    args = parser.parse_args()
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    found = answers(jobs=args.jobs)
    if args.check:
        rows = moved(found)
        print("\n".join(rows) or "no row moved")
        sys.exit(1 if rows else 0)
    print(write_table(found).splitlines()[-1])
