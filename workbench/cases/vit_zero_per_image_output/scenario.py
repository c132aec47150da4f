"""Case 02: ViT encoder CUDA graphs: zero per-image output and under-sized capture buffers (vLLM #38040).

vLLM captures the vision encoder once per *token budget* (powers of two from the model's minimum
to ``min(max_num_batched_tokens, max_model_len)``, plus that maximum). Each budget's graph is
captured with ``max_batch_size`` synthetic images of ``budget // max_batch_size`` output tokens
each, and serves any greedy-packed batch of at most ``max_batch_size`` images and ``budget`` tokens.
Three defects, fixed together upstream:

1. ``max_batch_size = max_budget // min_budget`` is not capped by the smallest budget. At the
   defaults (64, 16384) it is 256, so the first capture (budget 64) gets 0 tokens per image, an
   empty pixel tensor, and the patch embed's ``view(0, -1, ...)`` raises. Fix: the invariant
   ``max_batch_size <= min(token_budgets)`` on all four config paths.
2. ``budget // max_batch_size`` floors: when the budget is not a multiple, the buffers hold fewer
   patches than a full batch has, and replay's ``input_buffer[:n].copy_(src)`` raises. Fix: ceiling.
3. With EVS pruning on, eager image embeddings carry 5 extra mrope channels; the graph path skips
   that post-process. Fix: no encoder graphs when pruning is on.

The mirrored upstream code (model hooks and ``EncoderCudaGraphManager``) is in ``upstream``, the
encoder in ``model``; this module holds the experiments, the predictions and ``gpu_record``.

None of these failures poisons a CUDA context (the reshape and the copy size check fail on the host
before any kernel runs), so every reproduction runs in-process on both devices.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from types import SimpleNamespace

import numpy as np
import torch
from tqdm.auto import tqdm

from .. import VARIANTS, check_variant, get
from ...engine import synchronize
from .model import build_encoder, output_tokens
from .upstream import EncoderCudaGraphManager, EncoderGraphConfig, EncoderModel, encode_images, pack_greedy

CASE = get("vit_zero_per_image_output").stem
TOLERANCE = 1e-4          # graph vs eager, float32: same math, different reduction sizes

DEFAULTS = EncoderGraphConfig()
SCALED_MIN_BUDGET = 8     # the scenarios' model minimum: the failures appear at CPU-sized budgets


def scaled_config(fast: bool) -> EncoderGraphConfig:
    """Same structure as the defaults (auto paths, ``max // min > min``) at a CPU-sized maximum."""
    top = 128 if fast else 1024
    return EncoderGraphConfig(max_num_batched_tokens=top, max_model_len=top)


UNDERSIZED = EncoderGraphConfig(max_num_batched_tokens=50, max_model_len=50)     # budgets 8, 16, 32, 50; B = 6
PRUNING = EncoderGraphConfig(max_num_batched_tokens=64, max_model_len=64)        # B = 8 divides every budget


def budget_range_model(min_budget: int, max_budget: int, variant: str) -> SimpleNamespace:
    """A stand-in model that only answers ``get_encoder_cudagraph_budget_range`` (like upstream's
    ``_MockModel``): for planning and config tests, where no encoder is needed."""
    return SimpleNamespace(variant=check_variant(variant),
                           get_encoder_cudagraph_budget_range=lambda config: (min_budget, max_budget))


# --------------------------------------------------------------- building
def build_manager(variant: str, config: EncoderGraphConfig, *, min_budget: int = 64, pruning: bool = False,
                  seed: int = 0, device: str = "cpu") -> EncoderCudaGraphManager:
    """A seeded encoder (same weights for both variants), its model hooks, and the manager."""
    visual = build_encoder(seed=seed, device=device)
    model = EncoderModel(visual, variant=variant, min_budget=min_budget, pruning=pruning)
    return EncoderCudaGraphManager(model, config, device=device)


def make_pixels(grid_thw: list[list[int]], patch_dim: int, seed: int, device: str) -> torch.Tensor:
    """Seeded pixel patches, drawn on the CPU so every device sees the same values."""
    gen = torch.Generator().manual_seed(seed)
    patches = sum(t * h * w for t, h, w in grid_thw)
    return torch.randn(patches, patch_dim, generator=gen).to(device)


def image_grid(tokens: int, merge: int = 2) -> list[int]:
    """A one-frame image of exactly ``tokens`` output tokens: ``merge`` rows of patches."""
    if tokens < 1:
        raise ValueError(f"an image has at least 1 output token, got {tokens}")
    return [1, merge, tokens * merge]


def mixed_stream(n_requests: int, seed: int = 0, max_side: int = 16) -> list[list[list[int]]]:
    """Requests of 1-4 images with random even patch grids (4..max_side per side), seeded."""
    if n_requests < 1:
        raise ValueError(f"n_requests must be >= 1, got {n_requests}")
    if max_side < 4 or max_side % 2:
        raise ValueError(f"max_side must be an even number >= 4, got {max_side}")
    rng = np.random.default_rng(seed)
    sides = np.arange(4, max_side + 1, 2)
    return [[[1, int(rng.choice(sides)), int(rng.choice(sides))] for _ in range(int(rng.integers(1, 5)))]
            for _ in range(n_requests)]


# --------------------------------------------------------------- scenarios
def try_capture(manager: EncoderCudaGraphManager, progress: bool = False) -> dict:
    """Capture and report: budgets captured, or the budget, per-item output and error it failed with."""
    plan = {row["budget"]: row["per_item_output"] for row in manager.capture_plan()}
    result = {"variant": manager.variant, "path": manager.path, "token_budgets": manager.token_budgets,
              "max_batch_size": manager.max_batch_size, "failed_budget": None, "per_item_output": None,
              "error_type": None, "error": None}
    try:
        manager.capture(progress)
    except RuntimeError as e:
        result.update(failed_budget=manager.capture_failed_at, error_type=type(e).__name__, error=str(e),
                      per_item_output=plan[manager.capture_failed_at])
    result["captured"] = sorted(manager.budget_graphs)
    return result


def plan(min_budget: int, max_budget: int, variant: str, *, token_budgets: Sequence[int] = (),
         max_items: int = 0) -> dict:
    """The manager's plan for a model range and user config, without an encoder (``error`` when
    the fix refuses the config)."""
    config = EncoderGraphConfig(token_budgets=tuple(token_budgets), max_items_per_batch=max_items,
                                max_num_batched_tokens=max_budget, max_model_len=max_budget)
    try:
        m = EncoderCudaGraphManager(budget_range_model(min_budget, max_budget, variant), config)
    except (ValueError, ZeroDivisionError) as e:
        return {"variant": variant, "error": f"{type(e).__name__}: {e}"}
    return {"variant": variant, "path": m.path, "token_budgets": m.token_budgets,
            "max_batch_size": m.max_batch_size, "rows": m.capture_plan(), "error": None}


def per_item_heatmap(exponents: Sequence[int] = tuple(range(11))) -> dict:
    """Per-item output at the smallest budget, auto config, for min budget ``2**i`` and a derived
    batch size ``max_budget // min_budget = 2**j`` (so ``max_budget = 2**(i+j)``)."""
    sizes = [2 ** e for e in exponents]
    out = {v: np.zeros((len(sizes), len(sizes)), dtype=int) for v in VARIANTS}
    for v in VARIANTS:
        for r, batch in enumerate(sizes):
            for c, lo in enumerate(sizes):
                out[v][r, c] = plan(lo, lo * batch, v)["rows"][0]["per_item_output"]
    return {"sizes": sizes, "bug": out["bug"].tolist(), "fix": out["fix"].tolist()}


def underallocation(variant: str, device: str = "cpu", *, sweep: Sequence[int] = range(1, 51), seed: int = 0) -> dict:
    """``UNDERSIZED`` (budgets 8, 16, 32, 50; B = 6): a full 50-token batch of six images, and
    single images of every token count in ``sweep``. Outcome per case: replayed (with its max
    abs diff against eager) or the replay error."""
    manager = build_manager(variant, UNDERSIZED, min_budget=SCALED_MIN_BUDGET, seed=seed, device=device)
    manager.capture()
    visual = manager.model.visual
    allocated = {row["budget"]: row["allocated_tokens"] for row in manager.capture_plan()}

    def run(grid: list[list[int]], pixel_seed: int) -> tuple[float | None, str | None]:
        pixels = make_pixels(grid, visual.config.patch_dim, pixel_seed, device)
        try:
            outs = manager.execute(pixels, grid)
        except RuntimeError as e:
            return None, str(e)
        with torch.no_grad():
            ref = visual(pixels, grid).split(output_tokens(grid, visual.spatial_merge_size))
        return max((o - r).abs().max().item() for o, r in zip(outs, ref)), None

    full_grid = [image_grid(8)] * 5 + [image_grid(10)]
    full_diff, full_error = run(full_grid, seed)
    diffs, errors = [], []
    for tokens in sweep:
        d, e = run([image_grid(tokens)], seed + tokens)
        diffs.append(d)
        errors.append(e)
    return {"variant": variant, "token_budgets": manager.token_budgets, "max_batch_size": manager.max_batch_size,
            "allocated_tokens": [allocated[b] for b in manager.token_budgets],
            "full_batch_tokens": sum(output_tokens(full_grid, 2)), "full_batch_error": full_error,
            "full_batch_max_abs_diff": full_diff, "sweep_tokens": list(sweep), "sweep_max_abs_diff": diffs,
            "sweep_crashed": [e is not None for e in errors],
            "predicted_crash": [t > allocated[manager.budget_for(t)] for t in sweep]}


def pruning_widths(device: str = "cpu", seed: int = 0) -> dict:
    """Embedding width per image with pruning on: eager, ``bug`` (graphs) and ``fix`` (eager fallback)."""
    grid = [[1, 8, 8], [1, 12, 8]]
    result = {}
    for variant in VARIANTS:
        manager = build_manager(variant, PRUNING, min_budget=SCALED_MIN_BUDGET, pruning=True, seed=seed, device=device)
        manager.capture()
        pixels = make_pixels(grid, manager.model.visual.config.patch_dim, seed, device)
        result[variant] = encode_images(manager.model, manager, pixels, grid)[0].shape[1]
        result[f"{variant}_graphs"] = len(manager.budget_graphs)
        result[f"{variant}_graph_hits"] = manager.graph_hits
    with torch.no_grad():                             # same weights for both variants: one eager reference
        result["eager"] = manager.model.embed_images(pixels, grid)[0].shape[1]
    result["raw_encoder"] = manager.model.visual.config.output_width
    return result


def run_stream(manager: EncoderCudaGraphManager, requests: list[list[list[int]]], *, seed: int = 0,
               repeats: int = 3, progress: bool = False) -> dict:
    """Serve ``requests`` through the captured graphs and eagerly.

    Correctness: per image, max abs diff between the graph output and eager (whole request at
    once, as vLLM's eager path). Latency: per packed batch, the graph path (metadata, buffer
    copies, replay) and the eager encoder on the same batch, each timed ``repeats`` times after a
    warm-up, device synchronised.
    """
    visual = manager.model.visual
    merge = visual.spatial_merge_size
    tokens, diffs, batches, graph_ms, eager_ms = [], [], [], [], []
    for r, grid in enumerate(tqdm(requests, desc="stream", disable=not progress)):
        pixels = make_pixels(grid, visual.config.patch_dim, seed + r, manager.device)
        outs = manager.execute(pixels, grid)
        with torch.no_grad():
            ref = visual(pixels, grid).split(output_tokens(grid, merge))
        tokens += output_tokens(grid, merge)
        diffs += [(o - e).abs().max().item() for o, e in zip(outs, ref)]
        offsets = [0, *np.cumsum([t * h * w for t, h, w in grid]).tolist()]
        for batch in pack_greedy(output_tokens(grid, merge), manager.token_budgets[-1], manager.max_batch_size):
            batch_grid = [grid[i] for i in batch]
            batch_pixels = torch.cat([pixels[offsets[i]:offsets[i + 1]] for i in batch])
            n = sum(output_tokens(batch_grid, merge))
            batches.append({"items": len(batch), "tokens": n, "budget": manager.budget_for(n)})
            graph_ms += _time_ms(lambda: manager.run_batch(batch_pixels, batch_grid), manager.device, repeats)
            eager_ms += _time_ms(lambda: visual(batch_pixels, batch_grid), manager.device, repeats)
    pct = lambda xs, q: float(np.percentile(xs, q))   # noqa: E731
    return {"tokens": tokens, "max_abs_diff": diffs, "batches": batches, "graph_ms": graph_ms, "eager_ms": eager_ms,
            "graph_p50_ms": pct(graph_ms, 50), "graph_p99_ms": pct(graph_ms, 99),
            "eager_p50_ms": pct(eager_ms, 50), "eager_p99_ms": pct(eager_ms, 99)}


def _time_ms(fn, device: str, repeats: int) -> list[float]:
    with torch.no_grad():
        fn()
        synchronize(device)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            synchronize(device)
            times.append(1e3 * (time.perf_counter() - start))
    return times


def gpu_record(device: str = "cuda") -> dict:
    """The case's key numbers on ``device`` at the FAST sizes (JSON-serialisable).

    On CUDA, TF32 is turned off for the duration, so graph and eager run in exact float32 as on
    the CPU and their difference measures the graph path alone.
    """
    with _exact_float32():
        defaults_bug = try_capture(build_manager("bug", DEFAULTS, device=device))
        managers = {v: build_manager(v, scaled_config(True), min_budget=SCALED_MIN_BUDGET, device=device)
                    for v in VARIANTS}
        scaled = {v: try_capture(m) for v, m in managers.items()}
        stream = run_stream(managers["fix"], mixed_stream(6, seed=0), repeats=5)
        return {"defaults_bug": defaults_bug, "defaults_fix_plan": plan(64, 16384, "fix"),
                "scaled_bug": scaled["bug"], "scaled_fix": scaled["fix"],
                "underallocation": {v: underallocation(v, device) for v in VARIANTS},
                "pruning": pruning_widths(device), "stream": stream}


@contextlib.contextmanager
def _exact_float32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


# --------------------------------------------------------------- graph doctor
# What the graph doctor should find in the bug variant: the kind, the op, and the file (in this
# package) and function of the source line the finding names. The fix variant: no finding.
DOCTOR_EXPECTED = ("undersized-buffer", "aten.randn", "upstream.py", "prepare_encoder_cudagraph_capture_inputs")


def doctor_workload(variant: str, device: str = "cpu") -> Callable[[], None]:
    """The scenario made small for the graph doctor: the FAST-sized manager captured, then a short
    mixed stream served (the bug's capture fails at its first budget, inside the workload)."""
    def workload() -> None:
        manager = build_manager(variant, scaled_config(fast=True), min_budget=SCALED_MIN_BUDGET, device=device)
        manager.capture()
        run_stream(manager, mixed_stream(3, seed=0, max_side=8), seed=0, repeats=1)
    return workload
