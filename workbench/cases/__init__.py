"""The five failures, one package each, and the registry everything else loops over.

A case has one id. Its notebook, package, doctor key, GPU record, figures folder and test file all
derive from it, so nothing keeps a hand-written table of cases:

    notebooks/01_roberta_position_accumulation.ipynb   workbench/cases/roberta_position_accumulation/
    figures/01_roberta_position_accumulation/          results/gpu/roberta_position_accumulation.json
    tests/test_roberta_position_accumulation.py        doctor key "roberta_position_accumulation"

Every case package has the same three parts:

* ``upstream``: the mirrored upstream code, with its ``bug`` and ``fix`` variants (and ``guard``
  where upstream added one) side by side;
* ``scenario``: the experiment, the prediction from the mechanism, and ``gpu_record(device)``;
* ``figures``: the plots and the interactive explorer.

The package itself re-exports what its notebook uses.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import pathlib
from types import ModuleType

ROOT = pathlib.Path(__file__).resolve().parents[2]
VARIANTS = ("bug", "fix")


def check_variant(variant: str, allowed: tuple[str, ...] = VARIANTS) -> str:
    """The variant, or a ``ValueError`` that lists the ones this code has."""
    if variant not in allowed:
        raise ValueError(f"variant must be one of {allowed}, got {variant!r}")
    return variant


@dataclasses.dataclass(frozen=True)
class Case:
    """One failure: its number in the series, its id, and the upstream reports it reproduces."""

    number: int
    id: str
    title: str
    upstream: tuple[str, ...]
    gpus: int = 1                 # GPUs its GPU record needs

    @property
    def stem(self) -> str:
        return f"{self.number:02d}_{self.id}"

    @property
    def notebook(self) -> pathlib.Path:
        return ROOT / "notebooks" / f"{self.stem}.ipynb"

    @property
    def figures(self) -> pathlib.Path:
        return ROOT / "figures" / self.stem

    @property
    def record(self) -> pathlib.Path:
        return ROOT / "results" / "gpu" / f"{self.id}.json"

    @property
    def test_file(self) -> pathlib.Path:
        return ROOT / "tests" / f"test_{self.id}.py"

    def gpu_results(self) -> dict | None:
        """What ``gpu_record`` returned on a GPU (``results/gpu/<id>.json``), or None while it is not
        recorded; a record of a failed GPU run is an error, never a silent pass."""
        if not self.record.exists():
            return None
        stored = json.loads(self.record.read_text())
        if "error" in stored:
            raise RuntimeError(f"the GPU run of {self.id} failed: {stored['error']}")
        return stored["results"]

    @property
    def package(self) -> str:
        return f"{__name__}.{self.id}"

    def module(self, part: str | None = None) -> ModuleType:
        """The case package, or one of its parts (``"upstream"``, ``"scenario"``, ``"figures"``)."""
        return importlib.import_module(self.package + (f".{part}" if part else ""))


CASES = (
    Case(1, "roberta_position_accumulation", "RoBERTa position ids accumulate in padded slots",
         ("vllm-project/vllm#37884", "vllm-project/vllm#37873")),
    Case(2, "vit_zero_per_image_output", "ViT encoder graphs with zero tokens per image",
         ("vllm-project/vllm#38040",)),
    Case(3, "tp_lm_head_illegal_memory_access", "Illegal memory access under tensor parallelism",
         ("vllm-project/vllm#43909",), gpus=2),
    Case(4, "mamba_stale_is_prefilling", "Stale is_prefilling in padded rows (Mamba)",
         ("vllm-project/vllm#41873", "vllm-project/vllm#42947")),
    Case(5, "lazy_attention_state_capture", "Lazy attention-state init skipped by capture",
         ("vllm-project/vllm#42444",)),
)


def get(key: str | int) -> Case:
    """A case by id, by number, or by notebook stem (``"01_roberta_position_accumulation"``)."""
    for case in CASES:
        if key in (case.id, case.number, case.stem):
            return case
    raise KeyError(f"no case {key!r}; cases are {[c.id for c in CASES]}")
