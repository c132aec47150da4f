"""Case 03's settings, the five scenarios it serves, and what serving one gives (``ScenarioRun``)."""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from .. import get
from ...engine import IllegalMemoryAccess
from .upstream import CENTROID_GRAPH_SIZES, MTPHeadConfig

CASE = get("tp_lm_head_illegal_memory_access").stem
TP_SIZE = 2
AFTER_SETUP = ("reuse", "release", "reuse+release")
ILLEGAL_MEMORY_ACCESS = "illegal_memory_access"
PHASES = ("gather", "capture", "return", "reuse", "release", "replay")
STEP_WAYS = ("eager, all-gather every step", "eager, cached weight", "graph, all-gather inside capture",
             "graph, cached weight (fix)")    # the timed ways of computing one draft step
PHASE_LABELS = {"gather": "setup: full weight\ngathered", "capture": "warmup + capture\n(one graph per size)",
                "return": "setup returns", "reuse": "same-size\nallocations",
                "release": "empty_cache()", "replay": "serving:\ngraph replays"}


@dataclasses.dataclass(frozen=True)
class Settings:
    """How much to run. ``sizes`` are the captured sizes; ``timing_batch`` rows per timed step."""

    steps: int = 24
    sizes: tuple[int, ...] = CENTROID_GRAPH_SIZES
    seed: int = 0
    timing_reps: int = 20
    timing_batch: int = 8
    head: MTPHeadConfig = MTPHeadConfig()

    def __post_init__(self) -> None:
        if not self.sizes or any(isinstance(s, bool) or not isinstance(s, int) or s <= 0 for s in self.sizes):
            raise ValueError(f"sizes must be positive integers, got {self.sizes}")
        if len(set(self.sizes)) != len(self.sizes):
            raise ValueError(f"sizes must be unique, got {self.sizes}")
        for name in ("steps", "timing_reps", "timing_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"Settings.{name} must be a positive integer, got {value!r}")
        if self.timing_batch > max(self.sizes):
            raise ValueError(f"timing_batch ({self.timing_batch}) must fit the largest graph ({max(self.sizes)})")


FAST = Settings(steps=8, sizes=(1, 2, 4, 8), timing_reps=5)
GPU_RECORD = Settings(steps=16, timing_reps=30)


def settings_for(fast: bool, seed: int, steps: int, timing_reps: int) -> Settings:
    """The notebook's settings: ``FAST`` (CI) keeps its small sizes and takes only the seed."""
    if fast:
        return dataclasses.replace(FAST, seed=seed)
    return Settings(steps=steps, seed=seed, timing_reps=timing_reps)


@dataclasses.dataclass(frozen=True)
class Scenario:
    """What is served: the model variant, where the weight is gathered, what follows setup."""

    name: str
    variant: str                 # "bug" | "fix" (MTPDraftHead)
    gather_in_capture: bool      # the alternative fix: all-gather inside each capture
    after_setup: str             # "reuse" | "release" | "reuse+release"

    @property
    def on_freed(self) -> str:
        """CPU outcome of reading freed memory: reuse only when this scenario studies reuse; otherwise
        the strict mode, where any read of freed memory raises."""
        return "reuse" if self.after_setup == "reuse" else "raise"


TP1_BUG = Scenario("bug, TP=1", "bug", False, "reuse+release")
FIX = Scenario("fix (cached weight), TP=2", "fix", False, "reuse+release")
GATHER_IN_CAPTURE = Scenario("fix (gather inside capture), TP=2", "bug", True, "reuse+release")
BUG_REUSE = Scenario("bug, TP=2, block reused", "bug", False, "reuse")
BUG_RELEASE = Scenario("bug, TP=2, block released", "bug", False, "release")


@dataclasses.dataclass
class ScenarioRun:
    """One scenario on one rank: draft tokens from graph replays vs the eager reference."""

    scenario: Scenario
    tp_size: int
    device: str
    batch_sizes: list[int]
    eager_tokens: list[list[int]]
    graph_tokens: list[list[int]]          # one list per served step (stops at a failure)
    failure: str | None = None             # "illegal_memory_access", "cuda_error", "capture_error", "rank_failed"
    error_type: str | None = None          # the exception's type in the rank
    error: str | None = None               # its message
    failed_step: int | None = None
    timeline: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)  # phase -> (state, detail)
    reused_blocks: int | None = None       # graphs whose weight block a later allocation took

    @property
    def agreement_per_step(self) -> list[float]:
        return [float(np.mean(np.equal(g, e))) for g, e in zip(self.graph_tokens, self.eager_tokens)]

    @property
    def agreement(self) -> float:
        """Fraction of all served draft tokens equal to eager (NaN when no step was served)."""
        pairs = [(a, b) for g, e in zip(self.graph_tokens, self.eager_tokens) for a, b in zip(g, e)]
        return float(np.mean([a == b for a, b in pairs])) if pairs else math.nan

    def raise_failure(self) -> None:
        """Re-raise the rank's failure here: ``IllegalMemoryAccess`` with the rank's message (on CUDA
        that message is the ``torch.AcceleratorError`` text)."""
        if self.failure is None:
            return
        if self.failure == ILLEGAL_MEMORY_ACCESS:
            raise IllegalMemoryAccess(self.error)
        raise RuntimeError(f"{self.error_type}: {self.error}")


@dataclasses.dataclass
class CaseResults:
    settings: Settings
    device: str
    tp1_bug: ScenarioRun
    fix: ScenarioRun
    gather_in_capture: ScenarioRun
    bug_reuse: ScenarioRun
    bug_release: ScenarioRun
    reload: dict
    step_time_ms: dict[str, float]
    ranks_agree: bool

    @property
    def served(self) -> list[ScenarioRun]:
        return [self.tp1_bug, self.fix, self.gather_in_capture, self.bug_reuse, self.bug_release]
