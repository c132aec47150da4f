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
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from ...dist import RankError, get_tensor_model_parallel_world_size, launch, local_device
from ...engine import IllegalMemoryAccess, resolve_device, reuse_freed_blocks, synchronize, track_origins
from .config import (AFTER_SETUP, BUG_RELEASE, BUG_REUSE, CASE, FAST, FIX, GATHER_IN_CAPTURE, GPU_RECORD,
                     ILLEGAL_MEMORY_ACCESS, STEP_WAYS, TP1_BUG, TP_SIZE, CaseResults, Scenario, ScenarioRun,
                     Settings)
from .timeline import release_state, reuse_state, reused_blocks, seeded_noise, setup_timeline
from .upstream import CentroidsProposer, MTPDraftHead, make_checkpoint

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
          steps: int | None = None) -> tuple[ScenarioRun, CentroidsProposer]:
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
    result = ScenarioRun(scenario, get_tensor_model_parallel_world_size(), device, rows, eager[: len(rows)], [])
    result.timeline.update(setup_timeline(proposer, scenario.variant, result.tp_size, cpu, reserved))
    weight = proposer.captured_weight
    reuse = scenario.after_setup in ("reuse", "reuse+release")
    noise = seeded_noise(settings.head, settings.seed, model.lm_head.weight.dtype)
    gc.collect()     # graphs of earlier scenarios are in reference cycles; their freed blocks go now
    with reuse_freed_blocks() if (cpu and reuse) else contextlib.nullcontext():
        later = [torch.empty(noise.shape, dtype=noise.dtype, device=device).copy_(noise)
                 for _ in range(len(settings.sizes) if reuse else 0)]
        result.timeline["reuse"], result.timeline["release"] = ("n/a", ""), ("n/a", "")
        if reuse:
            freed = weight is not None and not weight.alive()
            result.reused_blocks = reused_blocks(proposer, weight, later) if freed else 0
            result.timeline["reuse"] = reuse_state(weight, result.reused_blocks, len(settings.sizes), len(later))
        if scenario.after_setup in ("release", "reuse+release"):
            before = 0 if cpu else torch.cuda.memory_reserved()
            release_cached_memory(device)
            after = 0 if cpu else torch.cuda.memory_reserved()
            result.timeline["release"] = release_state(weight, cpu, before, after)
        _serve_steps(proposer, settings, result)
    del later
    return result, proposer


def _serve_steps(proposer: CentroidsProposer, settings: Settings, result: ScenarioRun) -> None:
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
def run_tp1(settings: Settings, device: str) -> ScenarioRun:
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
               for k in a if isinstance(a[k], ScenarioRun))


def _failed_launch(part: str, settings: Settings, device: str, error: RankError) -> dict:
    """A separate launch whose ranks raised, died or hung, recorded as that scenario's outcome
    (a rank that died right after an illegal access may not have reported it)."""
    scenario, failure = {"gather_in_capture": (GATHER_IN_CAPTURE, "capture_error"),
                         "release": (BUG_RELEASE, "rank_failed")}[part]
    if "illegal memory access" in str(error):
        failure = ILLEGAL_MEMORY_ACCESS
    result = ScenarioRun(scenario, TP_SIZE, device, batch_sizes(settings), [], [], failure=failure,
                         error_type="RankError", error=str(error), failed_step=0)
    result.timeline["replay"] = ("failed", "the launch failed:\nsee error")
    return {"bug_release" if part == "release" else part: result, "step_time_ms": {}}


def expected_release_error(device: str) -> str:
    """What the release failure must say: on CPU the emulator names the gather kernel and where the
    freed tensor was created (the all-gather); on CUDA the driver's words."""
    if torch.device(device).type == "cpu":
        return (r"aten\.index\.Tensor at .*upstream\.py:\d+ in _select_and_score(.|\n)*"
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


# --------------------------------------------------------------------------- graph doctor
# What the graph doctor should find in the bug variant: the kind, the op, and the file (in this
# package) and function of the source line the finding names. The fix variant: no finding.
DOCTOR_EXPECTED = ("dangling-reference", "aten.", "upstream.py", "_setup_centroids_cuda_graphs")


def doctor_workload(variant: str, device: str = "cpu") -> Callable[[], None]:
    """One TP rank's work for the graph doctor, made small: the proposer loads (all-gather, capture)
    and drafts three steps. Call it inside each rank (``device`` is resolved to the rank's own)."""
    device = local_device(device)

    def workload() -> None:
        proposer = CentroidsProposer(load_model(variant, FAST, device), device, FAST.sizes)
        proposer.load_model()
        for step, rows in enumerate((3, 8, 1)):
            proposer._greedy_sample(hidden_states(FAST, step, rows, device))
        synchronize(device)
    return workload
