"""The case registry: one id per case, and everything a case has derives from it."""
from __future__ import annotations

import ast
import inspect
import pathlib

import pytest

from workbench import cases

ROOT = pathlib.Path(__file__).resolve().parent.parent
PARTS = ("upstream", "scenario", "figures")


@pytest.mark.parametrize("case", cases.CASES, ids=lambda c: c.id)
def test_every_case_has_its_notebook_package_figures_test_and_record(case):
    assert case.notebook.exists(), case.notebook
    assert case.figures.is_dir() and any(case.figures.glob("*.png")), case.figures
    assert case.test_file.exists(), case.test_file
    assert case.record.exists(), case.record
    for part in PARTS:
        case.module(part)
    scenario = case.module("scenario")
    assert callable(scenario.gpu_record) and callable(scenario.doctor_workload)


def test_ids_numbers_and_stems_are_unique_and_match_the_notebooks():
    for attr in ("id", "number", "stem"):
        values = [getattr(c, attr) for c in cases.CASES]
        assert len(set(values)) == len(values), attr
    numbered = {p.stem for p in (ROOT / "notebooks").glob("0[1-5]_*.ipynb")}
    assert numbered == {c.stem for c in cases.CASES}
    assert cases.get(1) is cases.get("roberta_position_accumulation") is cases.get("01_roberta_position_accumulation")
    with pytest.raises(KeyError, match="no case"):
        cases.get("nope")


def test_variants_are_defined_once():
    hits = []
    for path in (ROOT / "workbench").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "VARIANTS" for t in node.targets):
                hits.append(str(path.relative_to(ROOT)))
    assert hits == ["workbench/cases/__init__.py"], hits


def test_check_variant_names_the_allowed_ones():
    assert cases.check_variant("fix") == "fix"
    with pytest.raises(ValueError, match=r"one of \('bug', 'fix'\), got 'fixed'"):
        cases.check_variant("fixed")


def test_no_capture_loop_outside_the_engine():
    """The loop over capture sizes lives in the graph manager: case code never opens a capture."""
    offenders = []
    for path in (ROOT / "workbench" / "cases").rglob("*.py"):
        source = path.read_text()
        if "graph_pool_handle(" in source or "with graph(" in source:
            offenders.append(str(path.relative_to(ROOT)))
    assert offenders == [], offenders


def test_doctor_workloads_take_a_variant_and_a_device():
    for case in cases.CASES:
        params = list(inspect.signature(case.module("scenario").doctor_workload).parameters)
        assert params[:2] == ["variant", "device"], (case.id, params)
