"""Case 03: illegal memory access at TP>1 from a gathered weight the graph does not own (vLLM #43909).

At load time the MTP proposer gathers the full lm_head weight once, eagerly, and captures one
centroid top-k graph per size around it. The captured gather kernel keeps the weight's *address*.
At TP=1 that address is the lm_head parameter's. At TP>1 it is a fresh all-gather output held only
by a local variable: when setup returns, the memory goes back to the allocator while the graphs
still point at it. What a replay then reads depends on what happens to the block:

* **reuse**: a later allocation of the same size takes the block (CUDA's caching allocator does
  this by itself; the CPU emulation with ``on_freed="reuse"`` inside ``reuse_freed_blocks()``).
  The replay reads that tensor's values: valid token ids, silently wrong.
* **release**: ``empty_cache()`` returns the segment to the driver; the replay reads unmapped memory:
  ``CUDA error: an illegal memory access`` (``IllegalMemoryAccess`` in the CPU emulation).

The scenario, per rank: compute the eager reference tokens for every step (before any graph
exists); then per scenario load the draft head, empty the allocator cache so the gathered weight
gets a segment of its own, capture the graphs, do what the engine does after load (same-size
allocations: one tensor per graph, filled with seeded noise, a stand-in for the KV cache and
profiling activations vLLM allocates next; and/or ``empty_cache()``), and serve. TP=1 runs in this
process; TP=2 runs as two ranks (gloo on CPU, NCCL on two GPUs; see ``run_case`` for why CUDA
splits the rank work over three launches).
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import statistics
import time
from collections.abc import Callable

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.patches import Rectangle
from tqdm.auto import tqdm

from .. import plots
from ..dist import RankError, get_tensor_model_parallel_world_size, launch, local_device
from ..engine import IllegalMemoryAccess, resolve_device, reuse_freed_blocks, synchronize, track_origins
from ..models.mtp_head import (CENTROID_GRAPH_SIZES, CapturedWeight, CentroidsProposer, MTPDraftHead,
                               MTPHeadConfig, make_checkpoint)

CASE = "03_tp_lm_head_illegal_memory_access"
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
class ServeResult:
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
    tp1_bug: ServeResult
    fix: ServeResult
    gather_in_capture: ServeResult
    bug_reuse: ServeResult
    bug_release: ServeResult
    reload: dict
    step_time_ms: dict[str, float]
    ranks_agree: bool

    @property
    def served(self) -> list[ServeResult]:
        return [self.tp1_bug, self.fix, self.gather_in_capture, self.bug_reuse, self.bug_release]


# --------------------------------------------------------------------------- inputs
def batch_sizes(settings: Settings) -> list[int]:
    """Draft rows per step (seeded), each at most the largest captured size so a graph serves it."""
    g = torch.Generator().manual_seed(settings.seed)
    return torch.randint(1, max(settings.sizes) + 1, (settings.steps,), generator=g).tolist()


def hidden_states(settings: Settings, step: int, rows: int, device: str) -> torch.Tensor:
    """The draft model's output at ``step`` (seeded on the CPU, so every device and rank sees the
    same values). The same on all TP ranks, as replicated activations are."""
    g = torch.Generator().manual_seed(settings.seed * 1_000_003 + 7 * step + 1)
    return torch.randn(rows, settings.head.hidden_size, generator=g).to(device)


def load_model(variant: str, settings: Settings, device: str, seed: int | None = None) -> MTPDraftHead:
    """The draft head on ``device`` with this rank's shard of the seeded checkpoint."""
    model = MTPDraftHead(settings.head, variant).to(device)
    model.load_weights(make_checkpoint(settings.head, settings.seed if seed is None else seed).items())
    return model


def release_cached_memory(device: str) -> None:
    """``torch.cuda.empty_cache()`` on CUDA: unused cached segments go back to the driver."""
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def _mb(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def _classify(e: BaseException) -> str | None:
    """Normalise a replay failure: the emulator's error and CUDA's text name the same event."""
    if isinstance(e, IllegalMemoryAccess) or "illegal memory access" in str(e):
        return ILLEGAL_MEMORY_ACCESS
    if "CUDA error" in str(e):
        return "cuda_error"
    return None


# --------------------------------------------------------------------------- one scenario
def eager_reference(settings: Settings, device: str, steps: int | None = None) -> list[list[int]]:
    """Draft tokens without graphs, upstream's eager path (a fresh all-gather on every call)."""
    model = load_model("bug", settings, device)
    rows = batch_sizes(settings)[:steps]
    return [model.get_top_tokens(hidden_states(settings, step, n, device)).tolist() for step, n in enumerate(rows)]


def serve(scenario: Scenario, settings: Settings, device: str, eager: list[list[int]],
          steps: int | None = None) -> tuple[ServeResult, CentroidsProposer]:
    """Load, capture, do what the engine does after load, then serve ``steps`` steps (all by default)."""
    if scenario.after_setup not in AFTER_SETUP:
        raise ValueError(f"after_setup must be one of {AFTER_SETUP}, got {scenario.after_setup!r}")
    cpu = torch.device(device).type == "cpu"
    rows = batch_sizes(settings)[: settings.steps if steps is None else steps]
    model = load_model(scenario.variant, settings, device)
    proposer = CentroidsProposer(model, device, settings.sizes, gather_in_capture=scenario.gather_in_capture,
                                 on_freed=scenario.on_freed)
    release_cached_memory(device)        # the gathered weight gets a segment of its own
    reserved = 0 if cpu else torch.cuda.memory_reserved()
    with track_origins() if cpu else contextlib.nullcontext():
        proposer.load_model()
    reserved = 0 if cpu else torch.cuda.memory_reserved() - reserved
    result = ServeResult(scenario, get_tensor_model_parallel_world_size(), device, rows, eager[: len(rows)], [])
    result.timeline.update(_setup_timeline(proposer, scenario, result.tp_size, cpu, reserved))
    weight = proposer.captured_weight
    reuse = scenario.after_setup in ("reuse", "reuse+release")
    noise = _noise(settings, model.lm_head.weight.dtype)
    gc.collect()     # graphs of earlier scenarios are in reference cycles; their freed blocks go now
    with reuse_freed_blocks() if (cpu and reuse) else contextlib.nullcontext():
        later = [torch.empty(noise.shape, dtype=noise.dtype, device=device).copy_(noise)
                 for _ in range(len(settings.sizes) if reuse else 0)]
        result.timeline["reuse"], result.timeline["release"] = ("n/a", ""), ("n/a", "")
        if reuse:
            freed = weight is not None and not weight.alive()
            result.reused_blocks = _reused_blocks(proposer, weight, later) if freed else 0
            result.timeline["reuse"] = _reuse_state(weight, result.reused_blocks, len(settings.sizes), len(later))
        if scenario.after_setup in ("release", "reuse+release"):
            before = 0 if cpu else torch.cuda.memory_reserved()
            release_cached_memory(device)
            after = 0 if cpu else torch.cuda.memory_reserved()
            result.timeline["release"] = _release_state(weight, cpu, before, after)
        _serve_steps(proposer, settings, result)
    del later
    return result, proposer


def _serve_steps(proposer: CentroidsProposer, settings: Settings, result: ServeResult) -> None:
    """One ``_greedy_sample`` per step; a replay failure ends the run and is recorded."""
    for step, rows in enumerate(result.batch_sizes):
        h = hidden_states(settings, step, rows, result.device)
        try:
            tokens = proposer._greedy_sample(h)
            synchronize(result.device)
            result.graph_tokens.append(tokens.tolist())
        except Exception as e:  # noqa: BLE001 - only replay failures are recorded, see _classify
            result.failure = _classify(e)
            if result.failure is None:
                raise
            result.error_type, result.error, result.failed_step = type(e).__name__, str(e), step
            break
    if result.failure is not None:
        result.timeline["replay"] = ("failed", f"step {result.failed_step}:\n{result.failure.replace('_', ' ')}")
    else:
        result.timeline["replay"] = ("ok" if result.agreement == 1.0 else "wrong",
                                     f"{result.agreement:.0%} of draft tokens\nequal eager")


def _setup_timeline(proposer: CentroidsProposer, scenario: Scenario, tp: int, cpu: bool,
                    reserved: int) -> dict[str, tuple[str, str]]:
    """The gathered weight from the gather to the end of setup (measured: address, size, liveness)."""
    weight = proposer.captured_weight
    if weight is None:
        held = _pool_bytes(proposer) if cpu else f"reserved +{_mb(reserved)}"
        return {"gather": ("pool", f"inside each capture:\n{held}"),
                "capture": ("pool", "each graph owns\nits gathered copy"),
                "return": ("pool", "pools live with\nthe graphs")}
    owner = ("view of the lm_head\nparameter" if tp == 1 else
             "cached on the module" if scenario.variant == "fix" else "held by a local variable")
    return {"gather": ("alive", f"{_mb(weight.nbytes)} at {weight.address:#x}\n{owner}"),
            "capture": ("alive", f"{len(proposer.sizes)} graphs keep\nthis address"),
            "return": (("alive", "still referenced") if weight.alive() else
                       ("freed", "last reference dropped;\ngraphs keep the address"))}


def _noise(settings: Settings, dtype: torch.dtype) -> torch.Tensor:
    """The values of the later allocations: seeded noise of the gathered weight's shape, on the CPU.

    ``serve`` allocates one copy per graph, because the CPU emulation keeps a freed block per graph
    (on CUDA all graphs share one address and any one copy may land there); same values, so both
    backends read the same thing. Created outside ``reuse_freed_blocks`` so it is not placed itself.
    """
    head = settings.head
    g = torch.Generator().manual_seed(settings.seed + 7919)
    return torch.randn(head.padded_vocab_size, head.hidden_size, generator=g).to(dtype)


def _pool_bytes(proposer: CentroidsProposer) -> str:
    """CPU emulation: what the graphs' pools hold of gathered weights, read from the recorded ops."""
    held = [sum(o.untyped_storage().nbytes() for op in g.ops if "all_gather" in op.name
                for o in op.outputs if o is not None) for g in proposer._centroids_graphs.values()]
    return f"{len(held)} graphs own {_mb(held[0])} each" if len(set(held)) == 1 else f"{_mb(sum(held))} in all"


def _reused_blocks(proposer: CentroidsProposer, weight: CapturedWeight, later: list[torch.Tensor]) -> int:
    """How many graphs now read one of ``later`` where the weight was (measured, not assumed).

    CUDA: all graphs share the weight's address, so all or none. CPU emulation: each graph keeps the
    freed block's bytes (``ExternalRef.retained``); a later tensor placed there shares its memory.
    """
    if torch.device(proposer.device).type == "cuda":
        return len(proposer.sizes) if any(t.data_ptr() == weight.address for t in later) else 0
    placed = {t.untyped_storage().data_ptr() for t in later}
    count = 0
    for g in proposer._centroids_graphs.values():
        refs = [r for op in g.ops for r in op.external_refs() if r.nbytes == weight.nbytes and r.weak.expired()]
        count += any(r.retained is not None and r.retained.data_ptr() in placed for r in refs)
    return count


def _reuse_state(weight: CapturedWeight | None, reused: int, graphs: int, count: int) -> tuple[str, str]:
    if weight is None:
        return ("pool", f"{count} new tensors; pool\nmemory is not handed out")
    if weight.alive():
        return ("alive", f"{count} new tensors,\nplaced elsewhere")
    if reused:
        return ("reused", f"{reused} of {graphs} graphs now read\na newer tensor's values")
    return ("freed", f"{count} new tensors,\nnone in this block")


def _release_state(weight: CapturedWeight | None, cpu: bool, before: int, after: int) -> tuple[str, str]:
    measured = "" if cpu else f"\nreserved {_mb(before)} -> {_mb(after)}"
    if weight is None:
        return ("pool", "graph pools are kept" + measured)
    if weight.alive():
        return ("alive", "in use: not released" + measured)
    return ("released", ("emulated: the block is gone,\na read raises" if cpu else "segment returned\nto the driver")
            + measured)


# --------------------------------------------------------------------------- TP=2 ranks
PARTS = ("serve", "gather_in_capture", "release")


def _rank(settings: Settings, device: str, parts: tuple[str, ...]) -> dict:
    """What one TP=2 rank runs: ``serve`` (fix, reload, reuse, their step times), the
    ``gather_in_capture`` fix (its graphs hold a collective), the ``release`` scenario (last)."""
    device = local_device(device)
    eager = eager_reference(settings, device, steps=1 if parts == ("release",) else None)
    h = hidden_states(settings, settings.steps, settings.timing_batch, device)    # the timed step's input
    out: dict = {"eager": eager, "step_time_ms": {}}
    if "serve" in parts:
        out["fix"], fix = serve(FIX, settings, device, eager)
        eager_bug = load_model("bug", settings, device)
        out["step_time_ms"].update(step_times(settings, device, {
            "eager, all-gather every step": lambda: eager_bug.get_top_tokens(h),
            "eager, cached weight": lambda: fix.model.get_top_tokens(h),
            "graph, cached weight (fix)": lambda: fix._greedy_sample(h)}))
        del fix, eager_bug
        out["reload"] = reload_check(settings, device, eager)
        out["bug_reuse"] = serve(BUG_REUSE, settings, device, eager)[0]
    if "gather_in_capture" in parts:
        out["gather_in_capture"], alt = serve(GATHER_IN_CAPTURE, settings, device, eager)
        out["step_time_ms"].update(step_times(settings, device, {
            "graph, all-gather inside capture": lambda: alt._greedy_sample(h)}))
        del alt
    if "release" in parts:
        out["bug_release"] = serve(BUG_RELEASE, settings, device, eager, steps=1)[0]
    return out


def step_times(settings: Settings, device: str, ways: dict[str, Callable[[], torch.Tensor]]) -> dict[str, float]:
    """Median wall time of one call of each way, in ms (after three untimed calls)."""
    out = {}
    for name, fn in ways.items():
        for _ in range(3):
            fn()
        synchronize(device)
        times = []
        for _ in range(settings.timing_reps):
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            times.append(time.perf_counter() - t0)
        out[name] = 1e3 * statistics.median(times)
    return out


def reload_check(settings: Settings, device: str, eager: list[list[int]], steps: int = 4) -> dict:
    """The fix after a reload of ``lm_head.weight``: the cache is invalidated, graphs captured
    before the reload still read the previous gathered weight, a fresh capture reads the new one."""
    model = load_model("fix", settings, device)
    proposer = CentroidsProposer(model, device, settings.sizes, on_freed="reuse")
    proposer.load_model()
    old = proposer.captured_weight
    new_weight = make_checkpoint(settings.head, settings.seed + 1)["lm_head.weight"]
    model.load_weights([("lm_head.weight", new_weight)])
    invalidated = model._stable_full_lm_head_weight is None
    rows = batch_sizes(settings)[:steps]
    hs = [hidden_states(settings, step, n, device) for step, n in enumerate(rows)]
    stale = [proposer._greedy_sample(h).tolist() for h in hs]        # before anything new is allocated
    new_eager = [model.get_top_tokens(h).tolist() for h in hs]
    gathered = model._stable_full_lm_head_weight
    recaptured = CentroidsProposer(model, device, settings.sizes)
    recaptured.load_model()
    fresh = [recaptured._greedy_sample(h).tolist() for h in hs]

    def frac(a, b):
        return float(np.mean([x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb)]))

    return {"cache_invalidated": invalidated, "old_weight_freed": not old.alive(),
            "new_cache_matches_checkpoint": bool(torch.equal(gathered.cpu(), new_weight)),
            "stale_vs_old_eager": frac(stale, eager), "stale_vs_new_eager": frac(stale, new_eager),
            "recaptured_vs_new_eager": frac(fresh, new_eager)}


# --------------------------------------------------------------------------- the whole case
def run_tp1(settings: Settings, device: str) -> ServeResult:
    """The bug at TP=1, in this process: the graphs read the parameter, which never dies."""
    device = str(resolve_device(device))
    return serve(TP1_BUG, settings, device, eager_reference(settings, device))[0]


def run_case(settings: Settings = Settings(), device: str = "cpu", timeout: float = 240.0,
             separate_launches: bool | None = None) -> CaseResults:
    """TP=1 in this process, then ``TP_SIZE`` ranks (gloo on CPU, NCCL on CUDA).

    On CUDA (or with ``separate_launches``) the rank work is split over three launches: the
    release scenario's illegal access kills the CUDA context, and capturing an NCCL collective (the
    gather-in-capture fix) may fail or hang on some stacks; either way the other results survive,
    and a failed launch of either is recorded as that scenario's outcome.
    """
    resolve_device(device)
    if separate_launches is None:
        separate_launches = torch.device(device).type == "cuda"
    groups = [(p,) for p in PARTS] if separate_launches else [PARTS]
    ranks: list[dict] = [{"step_time_ms": {}} for _ in range(TP_SIZE)]
    agree = True
    with tqdm(total=1 + len(groups), desc="case 03", leave=False) as bar:
        bar.set_postfix_str("TP=1")
        tp1 = run_tp1(settings, device)
        release_cached_memory(device)
        bar.update()
        for parts in groups:
            bar.set_postfix_str(f"TP={TP_SIZE}: {', '.join(parts)}")
            try:
                part = launch(_rank, TP_SIZE, settings, device, parts, device=device, timeout=timeout)
            except RankError as e:
                if parts not in (("gather_in_capture",), ("release",)):
                    raise
                part = [_failed_launch(parts[0], settings, device, e) for _ in range(TP_SIZE)]
            agree = agree and all(_same_tokens(part[0], r) for r in part)
            for merged, r in zip(ranks, part):
                merged["step_time_ms"].update(r.pop("step_time_ms"))
                merged.update(r)
            bar.update()
    r0 = ranks[0]
    times = {k: r0["step_time_ms"][k] for k in STEP_WAYS if k in r0["step_time_ms"]}
    return CaseResults(settings, device, tp1, r0["fix"], r0["gather_in_capture"], r0["bug_reuse"],
                       r0["bug_release"], r0["reload"], times, agree)


def _same_tokens(a: dict, b: dict) -> bool:
    """Ranks hold replicated activations: every scenario must draft the same tokens on both."""
    return all(a[k].graph_tokens == b[k].graph_tokens and a[k].failure == b[k].failure
               for k in a if isinstance(a[k], ServeResult))


def _failed_launch(part: str, settings: Settings, device: str, error: RankError) -> dict:
    """A separate launch whose ranks raised, died or hung, recorded as that scenario's outcome
    (a rank that died right after an illegal access may not have reported it)."""
    scenario, failure = {"gather_in_capture": (GATHER_IN_CAPTURE, "capture_error"),
                         "release": (BUG_RELEASE, "rank_failed")}[part]
    if "illegal memory access" in str(error):
        failure = ILLEGAL_MEMORY_ACCESS
    result = ServeResult(scenario, TP_SIZE, device, batch_sizes(settings), [], [], failure=failure,
                         error_type="RankError", error=str(error), failed_step=0)
    result.timeline["replay"] = ("failed", "the launch failed:\nsee error")
    return {"bug_release" if part == "release" else part: result, "step_time_ms": {}}


def expected_release_error(device: str) -> str:
    """What the release failure must say: on CPU the emulator names the gather kernel and where the
    freed tensor was created (the all-gather); on CUDA the driver's words."""
    if torch.device(device).type == "cpu":
        return (r"aten\.index\.Tensor at .*mtp_head\.py:\d+ in _select_and_score(.|\n)*"
                r"created at .*dist\.py:\d+ in tensor_model_parallel_all_gather")
    return r"illegal memory access"


def record(res: CaseResults) -> dict:
    """The key numbers, JSON-ready."""
    return {
        "case": CASE, "device": res.device, "tp_size": TP_SIZE,
        "backend": "nccl" if torch.device(res.device).type == "cuda" else "gloo",
        "settings": {"steps": res.settings.steps, "sizes": list(res.settings.sizes), "seed": res.settings.seed,
                     "head": dataclasses.asdict(res.settings.head)},
        "gathered_weight_bytes": res.settings.head.gathered_nbytes(),
        "tp1_bug_agreement": res.tp1_bug.agreement,
        "tp1_bug_failure": res.tp1_bug.failure,
        "reuse_agreement": res.bug_reuse.agreement,
        "reuse_failure": res.bug_reuse.failure,
        "reuse_reused_blocks": res.bug_reuse.reused_blocks,
        "release_outcome": res.bug_release.failure or "no_error",
        "release_failed_step": res.bug_release.failed_step,
        "release_error_type": res.bug_release.error_type,
        "release_error": (res.bug_release.error or "")[:600],
        "fix_agreement": res.fix.agreement,
        "fix_failure": res.fix.failure,
        "gather_in_capture_agreement": res.gather_in_capture.agreement,
        "gather_in_capture_failure": res.gather_in_capture.failure,
        "reload": res.reload,
        "ranks_agree": res.ranks_agree,
        "eager_tokens": res.fix.eager_tokens,
        "step_time_ms": res.step_time_ms,
    }


def gpu_record(device: str = "cuda") -> dict:
    """The case's key numbers on ``device``: TP=2 as two NCCL ranks on CUDA (needs 2 GPUs),
    two gloo ranks on CPU."""
    return record(run_case(GPU_RECORD, device))


# --------------------------------------------------------------------------- figures
_STYLE = {  # scenario -> (colour, linestyle, marker)
    TP1_BUG.name: (plots.COLORS["bug"], ":", "s"),
    FIX.name: (plots.COLORS["fix"], "-", "o"),
    GATHER_IN_CAPTURE.name: (plots.COLORS["fix"], "--", "^"),
    BUG_REUSE.name: (plots.COLORS["bug"], "-", "o"),
    BUG_RELEASE.name: (plots.COLORS["bug"], "none", "X"),
}


def plot_agreement(res: CaseResults) -> plt.Figure:
    """Per step: the fraction of draft tokens from graph replays equal to eager's. Left, the bug at
    TP=1 and TP=2; right, the two fixes at TP=2."""
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2), sharey=True)
    panels = ((axes[0], (res.tp1_bug, res.bug_reuse, res.bug_release), "bug: TP=1 vs TP=2"),
              (axes[1], (res.fix, res.gather_in_capture), f"fixes at TP={TP_SIZE}"))
    for ax, runs, title in panels:
        for r in runs:
            color, ls, marker = _STYLE[r.scenario.name]
            if r.failure is not None:
                ax.plot([r.failed_step], [0.0], marker=marker, markersize=13, color=color, linestyle="none",
                        label=f"{r.scenario.name}:\n{r.failure.replace('_', ' ')} at step {r.failed_step}")
                continue
            ys = r.agreement_per_step
            hollow = ls == "--"     # drawn over a solid line of the same colour: keep that one visible
            ax.step(np.arange(len(ys)), ys, where="mid", color=color, linestyle=ls, marker=marker,
                    markersize=8 if hollow else 4, markerfacecolor="none" if hollow else color,
                    label=f"{r.scenario.name}: {r.agreement:.1%}")
        ax.set_ylim(-0.08, 1.08)
        ax.set_xlabel("serving step (one graph replay each)")
        ax.set_title(title)
        ax.legend(loc="center right", fontsize="small")
    axes[0].set_ylabel("draft tokens equal to eager")
    fig.suptitle(f"Draft tokens from centroid-graph replays vs eager ({res.device})")
    fig.tight_layout()
    return fig


def plot_token_match(res: CaseResults) -> plt.Figure:
    """Row x step: does each draft token equal eager's? Bug with the block reused vs the fix."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    rows = max(res.settings.sizes)
    for ax, r in zip(axes, (res.bug_reuse, res.fix)):
        grid = np.full((rows, len(r.graph_tokens)), np.nan)
        for step, (g, e) in enumerate(zip(r.graph_tokens, r.eager_tokens)):
            grid[: len(g), step] = np.equal(g, e)
        plots.heatmap(ax, grid, xlabel="serving step", ylabel="draft row", vmin=0, vmax=1, cmap="RdYlGn",
                      title=f"{r.scenario.name}\n{r.agreement:.1%} equal eager",
                      colorbar_label="1 = equal to eager, 0 = different")
    fig.suptitle("Draft tokens, row by row (grey: row not in that step's batch)")
    fig.tight_layout()
    return fig


_STATE_COLOURS = {"alive": plots.COLORS["fix"], "ok": plots.COLORS["fix"], "pool": plots.COLORS["fix"],
                  "freed": plots.COLORS["padded"], "reused": plots.COLORS["bug"], "wrong": plots.COLORS["bug"],
                  "failed": plots.COLORS["bug"], "released": plots.COLORS["limit"], "n/a": "#ffffff"}


def plot_memory_timeline(res: CaseResults) -> plt.Figure:
    """The block the graphs read, phase by phase, for each scenario (measured on ``res.device``)."""
    rows = res.served
    fig, ax = plt.subplots(figsize=(15, 1.25 * len(rows) + 1.2))
    for y, r in enumerate(reversed(rows)):
        for x, phase in enumerate(PHASES):
            state, detail = r.timeline.get(phase, ("n/a", ""))
            colour = _STATE_COLOURS[state]
            ax.add_patch(Rectangle((x, y), 0.96, 0.9, facecolor=colour, alpha=0.85 if state != "n/a" else 1,
                                   edgecolor="#999999"))
            text = "" if state == "n/a" else f"{state}\n{detail}"
            ax.text(x + 0.48, y + 0.45, text, ha="center", va="center", fontsize=7.5,
                    color="white" if state in ("released", "reused", "wrong", "failed") else "black")
    ax.set_xlim(0, len(PHASES))
    ax.set_ylim(0, len(rows))
    ax.set_xticks(np.arange(len(PHASES)) + 0.48, [PHASE_LABELS[p] for p in PHASES], fontsize=8.5)
    ax.xaxis.tick_top()
    ax.set_yticks(np.arange(len(rows)) + 0.45, [r.scenario.name for r in reversed(rows)], fontsize=9)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_title(f"The gathered lm_head weight the centroid graphs read, phase by phase ({res.device})\n"
                 "green: alive or owned by the graphs' pools   orange: freed, address still in the graphs   "
                 "red: read as another tensor / wrong / failed   black: released", fontsize=9.5, pad=34)
    fig.tight_layout()
    return fig


def plot_step_time(res: CaseResults) -> plt.Figure:
    """Median time of one draft step, measured on rank 0 of the TP=2 ranks."""
    fig, ax = plt.subplots(figsize=(9, 4))
    labels = {k: k.replace(", ", ",\n", 1) for k in res.step_time_ms}   # 3 ways if a capture failed
    colours = {labels[k]: plots.COLORS["eager" if k.startswith("eager") else "fix"] for k in labels}
    plots.bars(ax, {labels[k]: v for k, v in res.step_time_ms.items()}, colors=colours,
               ylabel="ms per draft step (median)",
               fmt="{:.2f} ms",
               title=f"One draft step of {res.settings.timing_batch} rows at TP={TP_SIZE} ({res.device}"
                     + (", emulated graphs: replay re-runs each op in Python" if res.device == "cpu" else "") + ")")
    fig.tight_layout()
    return fig


def plot_step_tokens(res: CaseResults, step: int) -> plt.Figure:
    """One step, row by row: eager's draft token and the graphs' (bug reuse and fix)."""
    if not 0 <= step < len(res.bug_reuse.graph_tokens):
        raise ValueError(f"step must be in [0, {len(res.bug_reuse.graph_tokens)}), got {step}")
    eager = res.fix.eager_tokens[step]
    fig, ax = plt.subplots(figsize=(9, 3.6))
    x = np.arange(len(eager))
    ax.plot(x, eager, "s", color=plots.COLORS["eager"], markersize=10, label="eager")
    ax.plot(x, res.fix.graph_tokens[step], "o", color=plots.COLORS["fix"], label=FIX.name)
    ax.plot(x, res.bug_reuse.graph_tokens[step], "x", color=plots.COLORS["bug"], markersize=9, label=BUG_REUSE.name)
    ax.set_xlabel("draft row")
    ax.set_ylabel("token id")
    ax.set_title(f"Step {step}: {len(eager)} draft rows")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def summary_lines(res: CaseResults) -> list[str]:
    """One line per scenario, for printing under the figures."""
    lines = []
    for r in res.served:
        what = (f"{r.failure} at step {r.failed_step}" if r.failure else
                f"{r.agreement:.1%} of {sum(len(g) for g in r.graph_tokens)} draft tokens equal eager")
        lines.append(f"{r.scenario.name:40s} {what}")
    return lines

