"""Parameters cannot lie: check_parameters converts what is safe and refuses the rest by name."""
import json
import pathlib
import re

import papermill
import pytest
import torch

from workbench.notebook import ParameterError, check_parameters, notebook_defaults

ROOT = pathlib.Path(__file__).resolve().parent.parent


def namespace(**values):
    """What a parameters cell leaves in the kernel: values plus their annotations."""
    kinds = {"DEVICE": str, "SEED": int, "FAST": bool, "INTERACTIVE": bool, "SAVE_FIGURES": bool,
             "MAX_TOKENS": int, "SCALE": float}
    ns = {"DEVICE": "cpu", "SEED": 0, "FAST": False, "INTERACTIVE": True, "SAVE_FIGURES": True,
          "MAX_TOKENS": 12, **values}
    ns["__annotations__"] = {k: kinds[k] for k in ns}
    return ns


@pytest.mark.parametrize("value, expected", [(True, True), (False, False), ("True", True), ("False", False),
                                             ("true", True), ("false", False), ("1", True), ("0", False),
                                             (1, True), (0, False)])
def test_booleans_accept_the_six_spellings(value, expected):
    ns = namespace(FAST=value)
    check_parameters(ns, MAX_TOKENS=(8, 64))
    assert ns["FAST"] is expected


@pytest.mark.parametrize("value", ["notabool", "yes", "", "TRUE", 2, None, 0.5])
def test_booleans_refuse_anything_else_by_name(value):
    with pytest.raises(ParameterError) as e:
        check_parameters(namespace(FAST=value), MAX_TOKENS=(8, 64))
    assert str(e.value) == (f"FAST={value!r} is not a boolean: pass True or False "
                            "(papermill: -p FAST True; also accepted: true, false, 1, 0)")


def test_numbers_are_converted_and_kept_in_range():
    ns = namespace(MAX_TOKENS="16", SEED="3")
    check_parameters(ns, MAX_TOKENS=(8, 64))
    assert (ns["MAX_TOKENS"], ns["SEED"]) == (16, 3)
    for bad, message in [("abc", "MAX_TOKENS='abc' is not a whole number: pass a int, e.g. -p MAX_TOKENS 1"),
                         (7, "MAX_TOKENS=7 is out of range: pass a int from 8 to 64"),
                         (12.5, "MAX_TOKENS=12.5 is not a whole number"),
                         (True, "MAX_TOKENS=True is a boolean, not a number")]:
        with pytest.raises(ParameterError, match=message.replace("(", r"\(").replace(")", r"\)")):
            check_parameters(namespace(MAX_TOKENS=bad), MAX_TOKENS=(8, 64))
    with pytest.raises(ParameterError, match=r"SEED=-1 is out of range: pass a int from 0 to 4294967295"):
        check_parameters(namespace(SEED=-1), MAX_TOKENS=(8, 64))


def test_floats_accept_numbers_and_refuse_nan():
    ns = namespace(SCALE="0.25")
    check_parameters(ns, MAX_TOKENS=(8, 64), SCALE=(0, 1))
    assert ns["SCALE"] == 0.25
    with pytest.raises(ParameterError, match="SCALE='nan' is not a finite number"):
        check_parameters(namespace(SCALE="nan"), MAX_TOKENS=(8, 64), SCALE=(0, 1))


def test_device_is_cpu_or_an_existing_cuda_device(monkeypatch):
    with pytest.raises(ParameterError, match=r"DEVICE='tpu' is not a device here: pass cpu or cuda"):
        check_parameters(namespace(DEVICE="tpu"), MAX_TOKENS=(8, 64))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ParameterError, match=r"DEVICE='cuda' cannot run: .*pass DEVICE cpu"):
        check_parameters(namespace(DEVICE="cuda"), MAX_TOKENS=(8, 64))


def test_author_mistakes_are_type_errors():
    with pytest.raises(TypeError, match=r"no range declared for the int parameter MAX_TOKENS; pass MAX_TOKENS="):
        check_parameters(namespace())
    with pytest.raises(TypeError, match=r"ranges given for \['MAX_TOKEN'\]"):
        check_parameters(namespace(), MAX_TOKENS=(8, 64), MAX_TOKEN=(1, 2))
    with pytest.raises(RuntimeError, match="run the notebook's parameters cell first"):
        check_parameters({"FAST": True})


def test_changed_names_only_result_parameters_that_differ_from_the_committed_cell():
    stem = "04_mamba_stale_is_prefilling"
    defaults = notebook_defaults(stem)
    assert defaults["MAX_TOKENS"] == 12 and defaults["DEVICE"] == "cpu"
    ns = namespace(**defaults)
    assert check_parameters(ns, stem, MAX_TOKENS=(8, 64)) == []
    assert check_parameters(namespace(**{**defaults, "INTERACTIVE": False}), stem, MAX_TOKENS=(8, 64)) == []
    assert check_parameters(namespace(**{**defaults, "MAX_TOKENS": "13"}), stem, MAX_TOKENS=(8, 64)) == ["MAX_TOKENS"]
    assert check_parameters(namespace(**{**defaults, "FAST": "true"}), stem, MAX_TOKENS=(8, 64)) == ["FAST"]
    assert "SEED" in check_parameters(namespace(**defaults), "no_such_notebook", MAX_TOKENS=(8, 64))


def test_every_notebook_checks_its_parameters_in_its_setup_cell():
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        code = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
        setup = "".join(code[1]["source"])
        assert "check_parameters(globals()" in setup and "figure_policy(" in setup, path.name
        assert notebook_defaults(path.stem), f"{path.name}: parameters cell not readable"


def _params_notebook(tmp_path: pathlib.Path) -> pathlib.Path:
    """Notebook 04's real parameters cell, then the check its setup cell makes (without the case's
    slow imports), then a cell that prints FAST."""
    stem = "04_mamba_stale_is_prefilling"
    nb = json.loads((ROOT / "notebooks" / f"{stem}.ipynb").read_text())
    params = next(c for c in nb["cells"] if "parameters" in c["metadata"].get("tags", []))
    setup = next(c for c in nb["cells"] if "check_parameters(globals()" in "".join(c["source"]))
    check = re.search(r"check_parameters\(globals\(\), case.CASE(.*?)\)\s", "".join(setup["source"])).group(1)
    code = ["from workbench.notebook import check_parameters\n",
            f"CHANGED = check_parameters(globals(), {stem!r}{check})"]
    nb["cells"] = [params, {**params, "id": "check", "metadata": {}, "source": code},
                   {**params, "id": "probe", "metadata": {}, "source": ["print(f'FAST={FAST!r}')"]}]
    path = tmp_path / "params.ipynb"
    path.write_text(json.dumps(nb))
    return path


@pytest.mark.slow
def test_papermill_string_parameters_are_read_as_booleans_or_refused(tmp_path, monkeypatch):
    """``papermill -p FAST false`` injects the string "false"; it must mean False, and a word that is
    not a boolean must stop the run in the setup cell with the helper's message."""
    monkeypatch.delenv("WORKBENCH_FAST", raising=False)   # it would force FAST on
    path = _params_notebook(tmp_path)
    out = tmp_path / "out.ipynb"
    papermill.execute_notebook(path, out, parameters={"FAST": "false"}, kernel_name="python3",
                               cwd=str(ROOT / "notebooks"), progress_bar=False)
    outputs = json.loads(out.read_text())["cells"][-1]["outputs"]
    assert "".join(outputs[0]["text"]).strip() == "FAST=False"
    with pytest.raises(papermill.PapermillExecutionError) as e:
        papermill.execute_notebook(path, out, parameters={"FAST": "notabool"}, kernel_name="python3",
                                   cwd=str(ROOT / "notebooks"), progress_bar=False)
    assert e.value.ename == "ParameterError"
    assert e.value.evalue.startswith("FAST='notabool' is not a boolean: pass True or False")
