"""``python -m workbench.zoo.trials``: the doctor on every trial program, written to its table.

``python -m workbench.zoo.trials amend RECORD.json "why"``: merge a GPU record of some programs
(``scripts/gpu_session.py OUT doctor_trials@NAMES.txt``) into ``results/gpu/doctor_trials.json``.
"""
import json
import sys

from . import amend, write_table

if sys.argv[1:2] == ["amend"]:
    if len(sys.argv) != 4:
        sys.exit('usage: python -m workbench.zoo.trials amend RECORD.json "why"')
    with open(sys.argv[2]) as f:
        print(f"{amend(json.load(f), sys.argv[3])} program(s) merged")
else:
    print(write_table())
