"""The zoo: small programs, each a faithful model of one real upstream CUDA-graph bug.

Each program (a module of ``workbench.zoo.programs``) has a ``bug`` and a ``fix`` variant, a header
naming its upstream report, what users saw, the mechanism, and the doctor's kind and site, and
``run(variant, device) -> Outcome``. The registry below finds them, so that detectors, tests and the
notebook loop over the same list::

    from workbench import zoo
    zoo.names()                       # program names, sorted
    zoo.run("xllm_1939_padded_decode_slots", "bug").verdict      # "misbehaves"
    zoo.verdicts("cpu")               # {name: {"bug": ..., "fix": ...}}
"""
from __future__ import annotations

import functools
import importlib
import pkgutil
from types import ModuleType

from ..doctor import KINDS
from . import programs as _programs
from .kit import EQUALS, MISBEHAVES, TOLERANCE, VARIANTS, Outcome

FAMILIES = (
    "persistent-buffer mutation",
    "under-sized buffers / shape contracts",
    "dangling references",
    "warmup/capture vs replay state",
    "stale padded metadata",
)
_FIELDS = ("UPSTREAM", "FAMILY", "KIND", "SITE", "SYMPTOM")

__all__ = ["EQUALS", "FAMILIES", "MISBEHAVES", "TOLERANCE", "VARIANTS", "Outcome",
           "engine_gap", "latent", "names", "program", "programs", "run", "verdicts"]


@functools.cache
def names() -> tuple[str, ...]:
    """Every program in ``workbench/zoo/programs``, sorted by name."""
    return tuple(sorted(m.name for m in pkgutil.iter_modules(_programs.__path__) if not m.name.startswith("_")))


def program(name: str) -> ModuleType:
    """The program module ``name``, its metadata checked."""
    if name not in names():
        raise ValueError(f"unknown zoo program {name!r}; programs are: {', '.join(names())}")
    module = importlib.import_module(f"{_programs.__name__}.{name}")
    _check(module)
    return module


def programs() -> list[ModuleType]:
    return [program(n) for n in names()]


def run(name: str, variant: str, device: str = "cpu") -> Outcome:
    return program(name).run(variant, device)


def engine_gap(name: str, variant: str) -> str | None:
    """Why the CPU emulation cannot give this variant's GPU behaviour yet (None: it can)."""
    return getattr(program(name), "ENGINE_GAP", {}).get(variant)


def latent(name: str) -> str | None:
    """Why this program's bug does not show on the torch the GPU record was made with (None: it
    does): the program stays a faithful model of the upstream bug, and its test asserts that the bug
    variant equals eager, on the CPU emulation as on the GPU."""
    return getattr(program(name), "LATENT", None)


def verdicts(device: str = "cpu") -> dict[str, dict[str, str]]:
    """``{program: {"bug": verdict, "fix": verdict}}``, each verdict ``"misbehaves"`` or ``"equals eager"``."""
    return {n: {v: run(n, v, device).verdict for v in VARIANTS} for n in names()}


def _check(module: ModuleType) -> None:
    missing = [f for f in _FIELDS if not isinstance(getattr(module, f, None), str)]
    if missing or not callable(getattr(module, "run", None)):
        raise TypeError(f"zoo program {module.__name__} lacks {missing or ['run()']}")
    if module.FAMILY not in FAMILIES:
        raise ValueError(f"{module.__name__}: FAMILY {module.FAMILY!r} is not one of {FAMILIES}")
    if module.KIND not in KINDS:
        raise ValueError(f"{module.__name__}: KIND {module.KIND!r} is not a doctor kind {KINDS}")
    gaps = getattr(module, "ENGINE_GAP", {})
    if set(gaps) - set(VARIANTS):
        raise ValueError(f"{module.__name__}: ENGINE_GAP keys must be variants {VARIANTS}, got {sorted(gaps)}")


def gpu_record(device: str = "cuda") -> dict:
    """Verdicts on a GPU, for ``results/gpu/zoo.json`` (see ``workbench.zoo.record``)."""
    from .record import gpu_record as record
    return record(device)
