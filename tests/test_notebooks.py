"""Every notebook runs once per `make test`: under papermill, with parameters injected as strings the
way `papermill -p` passes them, so one execution checks both that the notebook runs without error
(what nbval --nbval-lax checked in a second execution) and that it takes its parameters. The run
itself is conftest's ``notebook_run``, which unit tests share where they check what a notebook
computes (``NOTEBOOK_KEEPS``)."""
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_under_papermill_with_parameters(path, notebook_run):
    out, _ = notebook_run(path.stem)
    cells = json.loads(out.read_text())["cells"]
    injected = [c for c in cells if "injected-parameters" in c["metadata"].get("tags", [])]
    assert len(injected) == 1 and 'FAST = "true"' in "".join(injected[0]["source"])
    assert not [o for c in cells if c["cell_type"] == "code" for o in c.get("outputs", [])
                if o["output_type"] == "error"]
