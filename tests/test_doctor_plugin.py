"""``pytest --graph-doctor``: a test whose graphs have a finding fails with the report; a clean one
passes; ``graph_doctor(expect=...)`` and ``graph_doctor(skip=True)`` mark known cases; without the
option nothing is watched. One pytest subprocess runs all the cases (the plugin is loaded with
``-p`` as its ``pytest11`` entry point would load it once the package is installed)."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest

import workbench

ROOT = pathlib.Path(workbench.__file__).resolve().parent.parent

TESTS = textwrap.dedent("""
    import pytest
    import torch
    from workbench.engine import GraphRunner

    def accumulate(x):
        x += 1
        return x * 2

    def serve(model):
        runner = GraphRunner(model, {"x": ((2,), torch.float32)}, [2, 4])
        runner.capture()
        runner(x=torch.ones(3, 2))
        runner(x=torch.ones(1, 2))

    def test_bug():
        serve(accumulate)

    def test_fix():
        serve(lambda x: x * 2)

    @pytest.mark.graph_doctor(expect=["persistent-mutation"])
    def test_known_bug():
        serve(accumulate)

    @pytest.mark.graph_doctor(skip=True)
    def test_not_watched():
        serve(accumulate)
""")


def run(tmp_path, *options: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_served.py").write_text(TESTS)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    installed = any(e.value == "workbench.doctor.plugin" for e in entry_points(group="pytest11"))
    load = [] if installed else ["-p", "workbench.doctor.plugin"]    # the entry point loads it once installed
    return subprocess.run([sys.executable, "-m", "pytest", *load, "-q", "-rA",
                           "-p", "no:cacheprovider", *options, str(tmp_path / "test_served.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False)


@pytest.mark.slow
def test_the_plugin_fails_exactly_the_tests_with_unexpected_findings(tmp_path):
    done = run(tmp_path, "--graph-doctor")
    assert "1 failed, 3 passed" in done.stdout, done.stdout + done.stderr
    assert "FAILED test_served.py::test_bug - Failed: graph doctor: findings ['persistent" in done.stdout
    assert "graph doctor: findings ['persistent-mutation'], expected none" in done.stdout
    assert "x += 1" in done.stdout                      # the report, with the source line, is in the failure
    plain = run(tmp_path)
    assert "4 passed" in plain.stdout, plain.stdout + plain.stderr


def test_the_plugin_is_registered_as_a_pytest11_entry_point():
    text = (ROOT / "pyproject.toml").read_text()
    assert '[project.entry-points.pytest11]\ngraph_doctor = "workbench.doctor.plugin"' in text
