"""The set-up files agree with each other, and the notebooks follow the house conventions."""
import json
import pathlib
import re
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_environment_yml_installs_the_pyproject_extras():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    env = (ROOT / "environment.yml").read_text()
    m = re.search(r"-e \.\[([a-z,]+)\]", env)
    assert m, "environment.yml must install the package with its extras (-e .[...])"
    assert set(m.group(1).split(",")) == set(extras)
    assert "torch==2.13.0" in env and "python=3.11" in env


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme and "make run" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_notebooks_are_stripped_and_parameterised():
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    assert notebooks, "no notebooks"
    for path in notebooks:
        nb = json.loads(path.read_text())
        assert nb["metadata"]["kernelspec"]["name"] == "python3", path.name
        code = [c for c in nb["cells"] if c["cell_type"] == "code"]
        assert not any(c.get("outputs") or c.get("execution_count") for c in code), f"{path.name} has outputs"
        params = [c for c in code if "parameters" in c.get("metadata", {}).get("tags", [])]
        assert len(params) == 1, f"{path.name}: exactly one cell tagged 'parameters'"
        for line in "".join(params[0]["source"]).splitlines():
            line = line.split("#")[0].strip()
            if line:
                assert re.fullmatch(r"[A-Z_][A-Z0-9_]*: \w+ = .+", line), f"{path.name}: not a plain literal: {line}"
