"""What every notebook's setup cell needs: checked parameters, environment overrides and seeding.

Parameters reach a notebook three ways: typed into its ``parameters`` cell in JupyterLab, or
injected by papermill as a new cell of plain assignments after it (``-p FAST false`` arrives as the
*string* ``"false"``, and ``bool("false")`` is True). ``check_parameters`` therefore takes the types
from the annotations that the parameters cell leaves in the kernel's namespace (``__annotations__``,
the same under Jupyter, papermill and nbval), converts what it safely can, and refuses the rest with
a message that names the parameter, the value and what to pass instead, before anything slow runs.
"""
from __future__ import annotations

import ast
import json
import math
import os
import pathlib
import random
import re
from collections.abc import MutableMapping

import numpy as np
import torch

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
TRUE, FALSE = ("True", "true", "1"), ("False", "false", "0")
# Ranges every notebook shares; a notebook declares the ranges of its own numbers in the call.
COMMON_RANGES = {"SEED": (0, 2**32 - 1)}       # NumPy's seed range
DISPLAY_ONLY = ("INTERACTIVE", "SAVE_FIGURES")  # change how results are shown, never what they are
_INT = re.compile(r"[+-]?\d+")


class ParameterError(ValueError):
    """A notebook parameter with a value the notebook cannot run with."""


def check_parameters(namespace: MutableMapping, notebook: str | None = None,
                     **ranges: tuple[float, float]) -> list[str]:
    """Check and normalise the parameters in ``namespace`` (pass ``globals()``); return the names
    of those that can change results (all but ``DISPLAY_ONLY``) whose values differ from the
    defaults in ``notebooks/<notebook>.ipynb`` (all of them when that file cannot be read), so that
    callers can tell a default run from any other.

    ``ranges`` gives each int/float parameter its inclusive ``(low, high)``, e.g.
    ``MAX_TOKENS=(1, 64)``. Booleans accept True/False/true/false/1/0; ``DEVICE`` is ``cpu``,
    ``cuda`` or ``cuda:N`` and the device must exist. Converted values are written back.
    """
    annotations = {k: v for k, v in namespace.get("__annotations__", {}).items() if k.isupper()}
    if not annotations:
        raise RuntimeError("check_parameters found no annotated parameters (NAME: type = value): "
                           "run the notebook's parameters cell first")
    ranges = {**COMMON_RANGES, **ranges}
    unknown = sorted(set(ranges) - set(annotations) - set(COMMON_RANGES))
    if unknown:
        raise TypeError(f"check_parameters: ranges given for {unknown}, which the parameters cell does not "
                        f"declare; its parameters are {sorted(annotations)}")
    for name, kind in annotations.items():
        kind = getattr(kind, "__name__", kind)
        if name not in namespace:
            raise RuntimeError(f"parameter {name} is annotated but has no value: run the parameters cell")
        namespace[name] = _check(name, kind, namespace[name], ranges.get(name))
    defaults = notebook_defaults(notebook) if notebook else {}
    return [n for n in annotations
            if n not in DISPLAY_ONLY and (n not in defaults or namespace[n] != defaults[n])]


def _check(name: str, kind: str, value, bounds: tuple[float, float] | None):
    if kind == "bool":
        return _to_bool(name, value)
    if kind in ("int", "float"):
        if bounds is None:
            raise TypeError(f"check_parameters: no range declared for the {kind} parameter {name}; "
                            f"pass {name}=(low, high)")
        return _in_range(name, _to_number(name, kind, value), bounds, kind)
    if kind == "str":
        if not isinstance(value, str):
            raise ParameterError(f"{name}={value!r} is a {type(value).__name__}, not text: pass a string, "
                                 f"e.g. -p {name} {value}")
        return _check_device(value) if name == "DEVICE" else value
    raise TypeError(f"check_parameters: parameter {name} has type {kind}; parameters are bool, int, float or str")


def _to_bool(name: str, value) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, str)) and str(value) in TRUE + FALSE:
        return str(value) in TRUE
    raise ParameterError(f"{name}={value!r} is not a boolean: pass True or False "
                         f"(papermill: -p {name} True; also accepted: true, false, 1, 0)")


def _to_number(name: str, kind: str, value) -> int | float:
    if isinstance(value, (bool, np.bool_)):
        raise ParameterError(f"{name}={value!r} is a boolean, not a number: pass a {kind}, e.g. -p {name} 1")
    if isinstance(value, (int, np.integer)):
        return int(value) if kind == "int" else float(value)
    if kind == "float" and isinstance(value, (float, np.floating)) and math.isfinite(value):
        return float(value)
    if isinstance(value, str):
        text = value.strip()
        if _INT.fullmatch(text):
            return int(text) if kind == "int" else float(text)
        if kind == "float":
            try:
                number = float(text)
            except ValueError:
                number = math.nan
            if math.isfinite(number):
                return number
    what = "a whole number" if kind == "int" else "a finite number"
    raise ParameterError(f"{name}={value!r} is not {what}: pass a {kind}, e.g. -p {name} 1")


def _in_range(name: str, number, bounds: tuple[float, float], kind: str):
    low, high = bounds
    if not low <= number <= high:
        raise ParameterError(f"{name}={number!r} is out of range: pass a {kind} from {low} to {high}")
    return number


def _check_device(device: str) -> str:
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise ParameterError(f"DEVICE={device!r} is not a device here: pass cpu or cuda (or cuda:N)")
    if device.startswith("cuda"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= count:
            why = ("this torch is not built with CUDA" if torch.version.cuda is None
                   else f"this machine has {count} CUDA device(s)")
            raise ParameterError(f"DEVICE={device!r} cannot run: {why} (torch {torch.__version__}); "
                                 "pass DEVICE cpu for the CPU emulation")
    return device


def notebook_defaults(notebook: str) -> dict:
    """The literal values of the ``parameters`` cell of ``notebooks/<notebook>.ipynb`` as committed
    (not as typed into a running kernel): the reference for "a default run". Empty if unreadable."""
    path = NOTEBOOKS / f"{notebook}.ipynb"
    try:
        cells = json.loads(path.read_text())["cells"]
    except (OSError, ValueError, KeyError):
        return {}
    for cell in cells:
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            tree = ast.parse("".join(cell["source"]))
            return {node.target.id: ast.literal_eval(node.value) for node in tree.body
                    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value}
    return {}


def settings(fast: bool, interactive: bool) -> tuple[bool, bool]:
    """Apply ``WORKBENCH_FAST=1`` (CI's small sizes) and ``WORKBENCH_HEADLESS=1`` (no widgets)."""
    fast = bool(fast) or os.environ.get("WORKBENCH_FAST") == "1"
    interactive = bool(interactive) and os.environ.get("WORKBENCH_HEADLESS") != "1"
    return fast, interactive


def seed_everything(seed: int) -> None:
    """Same numbers every run: Python, NumPy and torch (all devices) seeded together."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
