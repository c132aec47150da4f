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

``EncoderCudaGraphManager`` is ``vllm/v1/worker/encoder_cudagraph.py`` (``__init__`` config paths,
``capture``, ``_capture_budget_graph``, ``_run_budget_graph``, greedy ``_execute_local``) on top of
``workbench.engine.new_graph``/``graph`` instead of ``GraphRunner``: its graphs are keyed by token
budget, not by batch rows, and each graph has its own input and metadata buffers.

None of these failures poisons a CUDA context (the reshape and the copy size check fail on the host
before any kernel runs), so every reproduction runs in-process on both devices.
"""
from __future__ import annotations

import contextlib
import dataclasses
import textwrap
import time
from collections.abc import Sequence
from types import SimpleNamespace

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import torch
from tqdm.auto import tqdm

from workbench import plots
from workbench.engine import events, graph, new_graph, synchronize
from workbench.models import vit

SLUG = "02_vit_zero_per_image_output"
METADATA_KEYS = ("pos_embeds", "rotary_pos_emb_cos", "rotary_pos_emb_sin", "cu_seqlens")
PATHS = {"a": "budgets and max items given", "b": "only budgets given",
         "c": "only max items given", "d": "neither given (auto)"}
TOLERANCE = 1e-4          # graph vs eager, float32: same math, different reduction sizes


# ------------------------------------------------------------------ config
@dataclasses.dataclass(frozen=True)
class EncoderGraphConfig:
    """The knobs of vLLM's ``CompilationConfig`` / scheduler config the manager reads.

    ``token_budgets``: ``encoder_cudagraph_token_budgets`` (empty = auto). ``max_items_per_batch``:
    ``encoder_cudagraph_max_vision_items_per_batch`` (0 = auto).
    """

    token_budgets: tuple[int, ...] = ()
    max_items_per_batch: int = 0
    max_num_batched_tokens: int = 16384
    max_model_len: int = 16384


DEFAULTS = EncoderGraphConfig()
SCALED_MIN_BUDGET = 8     # the scenarios' model minimum: the failures appear at CPU-sized budgets


def scaled_config(fast: bool) -> EncoderGraphConfig:
    """Same structure as the defaults (auto paths, ``max // min > min``) at a CPU-sized maximum."""
    top = 128 if fast else 1024
    return EncoderGraphConfig(max_num_batched_tokens=top, max_model_len=top)


UNDERSIZED = EncoderGraphConfig(max_num_batched_tokens=50, max_model_len=50)     # budgets 8, 16, 32, 50; B = 6
PRUNING = EncoderGraphConfig(max_num_batched_tokens=64, max_model_len=64)        # B = 8 divides every budget


def check_config(config: EncoderGraphConfig) -> None:
    """Config-time validation the fix adds (upstream: ``CompilationConfig.__post_init__``)."""
    budgets = list(config.token_budgets)
    if any(isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in budgets):
        raise ValueError(f"All encoder_cudagraph_token_budgets must be positive integers, got {budgets}")
    if isinstance(config.max_items_per_batch, bool) or not isinstance(config.max_items_per_batch, int) \
            or config.max_items_per_batch < 0:
        raise ValueError("encoder_cudagraph_max_vision_items_per_batch must be a non-negative integer "
                         f"(0 = auto), got {config.max_items_per_batch!r}")


def generate_budgets(min_budget: int, max_budget: int) -> list[int]:
    """Powers of two times ``min_budget`` up to ``max_budget``, plus ``max_budget`` itself."""
    budgets, b = [], min_budget
    while b <= max_budget:
        budgets.append(b)
        b *= 2
    if not budgets or budgets[-1] < max_budget:
        budgets.append(max_budget)
    return budgets


def budget_range_model(min_budget: int, max_budget: int, variant: str) -> SimpleNamespace:
    """A stand-in model that only answers ``get_encoder_cudagraph_budget_range`` (like upstream's
    ``_MockModel``): for planning and config tests, where no encoder is needed."""
    return SimpleNamespace(variant=vit.check_variant(variant),
                           get_encoder_cudagraph_budget_range=lambda config: (min_budget, max_budget))


def pack_greedy(tokens: Sequence[int], max_budget: int, max_batch_size: int) -> list[list[int]]:
    """``_execute_local``'s packing: items ascending by tokens; a batch grows while its tokens stay
    ``<= max_budget`` and it has fewer than ``max_batch_size`` items. Returns original indices."""
    batches, current, current_tokens = [], [], 0
    for i in sorted(range(len(tokens)), key=lambda j: tokens[j]):
        if current and (current_tokens + tokens[i] > max_budget or len(current) >= max_batch_size):
            batches.append(current)
            current, current_tokens = [], 0
        current.append(i)
        current_tokens += tokens[i]
    if current:
        batches.append(current)
    return batches


# ----------------------------------------------------------------- manager
@dataclasses.dataclass
class BudgetGraph:
    """One captured budget (upstream ``BudgetGraphMetadata``): the graph and the buffers it reads
    and writes, all fixed at capture."""

    token_budget: int
    graph: object
    input_buffer: torch.Tensor
    metadata_buffers: dict[str, torch.Tensor]
    output_buffer: torch.Tensor


class EncoderCudaGraphManager:
    """Budget graphs for a vision encoder; ``model.variant`` picks the code before or after the fix."""

    def __init__(self, model, config: EncoderGraphConfig, *, device: str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        self.model = model
        self.config = config
        self.variant = vit.check_variant(model.variant)
        self.device = device
        self.dtype = dtype
        self.budget_graphs: dict[int, BudgetGraph] = {}
        self.capture_failed_at: int | None = None
        self.graph_hits = 0
        self.graph_misses = 0
        if self.variant == "fix":
            check_config(config)
        user_budgets, user_max = list(config.token_budgets), config.max_items_per_batch
        if user_budgets and user_max > 0:
            self.path = "a"
            self.token_budgets, self.max_batch_size = sorted(user_budgets), user_max
            if self.variant == "fix" and user_max > min(user_budgets):
                raise ValueError(
                    f"encoder_cudagraph_max_vision_items_per_batch ({user_max}) must be <= smallest token "
                    f"budget ({min(user_budgets)}): each budget is captured as that many items, so the "
                    f"smallest budget would get less than one token per item. Lower "
                    f"encoder_cudagraph_max_vision_items_per_batch to <= {min(user_budgets)}, or remove the "
                    f"budgets below {user_max} from encoder_cudagraph_token_budgets.")
            return
        min_budget, max_budget = model.get_encoder_cudagraph_budget_range(config)
        self.path = "c" if user_max > 0 else ("b" if user_budgets else "d")
        if self.variant == "bug":
            self.token_budgets = sorted(user_budgets) if user_budgets else generate_budgets(min_budget, max_budget)
            self.max_batch_size = user_max if user_max > 0 else max_budget // min_budget
            return
        if min_budget <= 0 or max_budget <= 0:
            raise ValueError(f"Encoder CUDA graph budget range ({min_budget}, {max_budget}) is invalid. "
                             "Both must be positive.")
        if min_budget > max_budget:
            raise ValueError(f"Encoder CUDA graph budget range is invalid: min_budget={min_budget} > "
                             f"max_budget={max_budget}. Raise max_num_batched_tokens / max_model_len.")
        if self.path == "c":                          # raise the budget floor to the user's batch size
            if user_max > max_budget:
                raise ValueError(
                    f"encoder_cudagraph_max_vision_items_per_batch ({user_max}) must be <= the largest "
                    f"token budget ({max_budget} = min(max_num_batched_tokens, max_model_len)). Lower it "
                    f"to <= {max_budget}, or raise max_num_batched_tokens and max_model_len.")
            self.max_batch_size = user_max
            self.token_budgets = generate_budgets(max(min_budget, user_max), max_budget)
        else:                                         # (b), (d): clamp the derived batch size
            self.token_budgets = sorted(user_budgets) if user_budgets else generate_budgets(min_budget, max_budget)
            self.max_batch_size = min(max_budget // min_budget, min(self.token_budgets))

    def __repr__(self) -> str:
        return (f"EncoderCudaGraphManager({self.variant}, path ({self.path}) {PATHS[self.path]}: "
                f"token_budgets={self.token_budgets}, max_batch_size={self.max_batch_size})")

    def capture_plan(self) -> list[dict]:
        """Per budget: tokens per synthetic item and the tokens its buffers hold (``B * per_item``)."""
        rows = []
        for b in self.token_budgets:
            per = vit.per_item_output(b, self.max_batch_size, self.variant)
            rows.append({"budget": b, "per_item_output": per, "allocated_tokens": per * self.max_batch_size})
        return rows

    def supports_modality(self, modality: str) -> bool:
        return modality in self.model.encoder_cudagraph_modalities()

    # ------------------------------------------------------------- capture
    def capture(self, progress: bool = False) -> None:
        """Capture every budget, smallest first (a failing budget's number is kept in
        ``capture_failed_at``). Nothing is captured when the model serves no modality by graph."""
        if not self.model.encoder_cudagraph_modalities():
            return
        for budget in tqdm(self.token_budgets, desc=f"capture ({self.variant})", disable=not progress):
            self.capture_failed_at = budget
            self._capture_budget_graph(budget)
        self.capture_failed_at = None

    def _capture_budget_graph(self, token_budget: int) -> None:
        inputs = self.model.prepare_encoder_cudagraph_capture_inputs(
            token_budget, self.max_batch_size, self.device, self.dtype)
        events.static_buffers(f"budget {token_budget}", {"pixel_values": inputs.pixel_values, **inputs.metadata})
        with torch.no_grad():
            with events.warmup():
                output = self.model.encoder_cudagraph_forward(inputs.pixel_values, inputs.metadata)
            output_buffer = torch.empty_like(output)
            g = new_graph(self.device)
            with graph(g, name=f"budget {token_budget}"):
                output = self.model.encoder_cudagraph_forward(inputs.pixel_values, inputs.metadata)
                output_buffer.copy_(output)
        self.budget_graphs[token_budget] = BudgetGraph(token_budget, g, inputs.pixel_values, inputs.metadata,
                                                       output_buffer)

    # -------------------------------------------------------------- replay
    def budget_for(self, tokens: int) -> int | None:
        """The smallest budget ``>= tokens`` (``None``: larger than every budget, run eagerly)."""
        return next((b for b in self.token_budgets if b >= tokens), None)

    def _run_budget_graph(self, pixel_values: torch.Tensor, grid_thw: list[list[int]], token_budget: int) -> torch.Tensor:
        """Zero then copy the batch into the budget's buffers, as upstream, and replay."""
        meta = self.budget_graphs[token_budget]
        replay_metadata = self.model.visual.prepare_encoder_metadata(grid_thw, max_batch_size=self.max_batch_size)
        meta.input_buffer.zero_()
        meta.input_buffer[:pixel_values.shape[0]].copy_(pixel_values)   # raises when the buffer is short
        for key in METADATA_KEYS:
            src, buf = replay_metadata[key], meta.metadata_buffers[key]
            buf.zero_()
            buf[:src.shape[0]].copy_(src)
        meta.graph.replay()
        return meta.output_buffer

    def run_batch(self, pixel_values: torch.Tensor, grid_thw: list[list[int]]) -> torch.Tensor:
        """One packed batch: its budget's graph, or eager when no budget is large enough."""
        tokens = sum(vit.output_tokens(grid_thw, self.model.visual.spatial_merge_size))
        budget = self.budget_for(tokens)
        if budget is None:
            self.graph_misses += len(grid_thw)
            with torch.no_grad():
                return self.model.visual(pixel_values, grid_thw)
        if budget not in self.budget_graphs:
            raise RuntimeError(f"budget {budget} has no captured graph: call capture() first")
        out = self._run_budget_graph(pixel_values, grid_thw, budget)
        self.graph_hits += len(grid_thw)
        return out[:tokens].clone()     # a later batch of the same budget overwrites the buffer

    def execute(self, pixel_values: torch.Tensor, grid_thw: list[list[int]]) -> list[torch.Tensor]:
        """Per-image encoder outputs, in input order, through greedy-packed budget graphs."""
        merge = self.model.visual.spatial_merge_size
        tokens = vit.output_tokens(grid_thw, merge)
        offsets = [0, *np.cumsum([t * h * w for t, h, w in grid_thw]).tolist()]
        outputs: list[torch.Tensor | None] = [None] * len(grid_thw)
        for batch in pack_greedy(tokens, self.token_budgets[-1], self.max_batch_size):
            pixels = torch.cat([pixel_values[offsets[i]:offsets[i + 1]] for i in batch])
            out = self.run_batch(pixels, [grid_thw[i] for i in batch])
            for i, piece in zip(batch, out.split([tokens[i] for i in batch])):
                outputs[i] = piece
        return outputs


def encode_images(model: vit.EncoderModel, manager: EncoderCudaGraphManager | None,
                  pixel_values: torch.Tensor, grid_thw: list[list[int]]) -> list[torch.Tensor]:
    """The model runner's choice: the graph manager when it serves images, else the eager path."""
    if manager is not None and manager.supports_modality("image"):
        return manager.execute(pixel_values, grid_thw)
    with torch.no_grad():
        return list(model.embed_images(pixel_values, grid_thw))


# --------------------------------------------------------------- building
def build_manager(variant: str, config: EncoderGraphConfig, *, min_budget: int = 64, pruning: bool = False,
                  seed: int = 0, device: str = "cpu") -> EncoderCudaGraphManager:
    """A seeded encoder (same weights for both variants), its model hooks, and the manager."""
    visual = vit.build_encoder(seed=seed, device=device)
    model = vit.EncoderModel(visual, variant=variant, min_budget=min_budget, pruning=pruning)
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
    out = {v: np.zeros((len(sizes), len(sizes)), dtype=int) for v in vit.VARIANTS}
    for v in vit.VARIANTS:
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
            ref = visual(pixels, grid).split(vit.output_tokens(grid, visual.spatial_merge_size))
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
            "full_batch_tokens": sum(vit.output_tokens(full_grid, 2)), "full_batch_error": full_error,
            "full_batch_max_abs_diff": full_diff, "sweep_tokens": list(sweep), "sweep_max_abs_diff": diffs,
            "sweep_crashed": [e is not None for e in errors],
            "predicted_crash": [t > allocated[manager.budget_for(t)] for t in sweep]}


def pruning_widths(device: str = "cpu", seed: int = 0) -> dict:
    """Embedding width per image with pruning on: eager, ``bug`` (graphs) and ``fix`` (eager fallback)."""
    grid = [[1, 8, 8], [1, 12, 8]]
    result = {}
    for variant in vit.VARIANTS:
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
            ref = visual(pixels, grid).split(vit.output_tokens(grid, merge))
        tokens += vit.output_tokens(grid, merge)
        diffs += [(o - e).abs().max().item() for o, e in zip(outs, ref)]
        offsets = [0, *np.cumsum([t * h * w for t, h, w in grid]).tolist()]
        for batch in pack_greedy(vit.output_tokens(grid, merge), manager.token_budgets[-1], manager.max_batch_size):
            batch_grid = [grid[i] for i in batch]
            batch_pixels = torch.cat([pixels[offsets[i]:offsets[i + 1]] for i in batch])
            n = sum(vit.output_tokens(batch_grid, merge))
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
                    for v in vit.VARIANTS}
        scaled = {v: try_capture(m) for v, m in managers.items()}
        stream = run_stream(managers["fix"], mixed_stream(6, seed=0), repeats=5)
        return {"defaults_bug": defaults_bug, "defaults_fix_plan": plan(64, 16384, "fix"),
                "scaled_bug": scaled["bug"], "scaled_fix": scaled["fix"],
                "underallocation": {v: underallocation(v, device) for v in vit.VARIANTS},
                "pruning": pruning_widths(device), "stream": stream}


@contextlib.contextmanager
def _exact_float32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


# ------------------------------------------------------------------- plots
def _outline(ax, region: np.ndarray, color: str, linestyle: str = "-") -> None:
    """Draw the cell edges between ``region`` (bool, [row, col]) and the cells outside it."""
    rows, cols = region.shape
    for r, c in zip(*np.nonzero(region)):
        for dr, dc, xs, ys in ((1, 0, (c - .5, c + .5), (r + .5, r + .5)), (-1, 0, (c - .5, c + .5), (r - .5, r - .5)),
                               (0, 1, (c + .5, c + .5), (r - .5, r + .5)), (0, -1, (c - .5, c - .5), (r - .5, r + .5))):
            nr, nc = r + dr, c + dc
            if 0 <= nr < rows and 0 <= nc < cols and not region[nr, nc]:
                ax.plot(xs, ys, color=color, linewidth=2.2, linestyle=linestyle)


def plot_per_item_heatmap(data: dict) -> plt.Figure:
    """Per-item output at the smallest budget over (min budget, batch size): bug vs fix."""
    sizes = data["sizes"]
    n = len(sizes)
    clamped = np.array([[batch > lo for lo in sizes] for batch in sizes])
    marks = {(64, 256): "vLLM defaults (64, 16384)"}
    for fast in (True, False):
        top = scaled_config(fast).max_num_batched_tokens
        marks[(SCALED_MIN_BUDGET, top // SCALED_MIN_BUDGET)] = f"scaled run (8, {top})"
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.6))
    vmax = np.log2(max(sizes))
    for ax, variant in zip(axes, vit.VARIANTS):
        per = np.array(data[variant], dtype=float)
        shown = np.where(per > 0, np.log2(np.maximum(per, 1)), np.nan)
        title = {"bug": "bug: min_budget // B  (B = max_budget // min_budget)",
                 "fix": "fix: B clamped to min_budget, ceiling division"}[variant]
        plots.heatmap(ax, shown, xlabel="smallest token budget (model min_budget)",
                      ylabel="batch size B = max_budget // min_budget", title=title, vmin=0, vmax=vmax,
                      colorbar_label="log2(tokens per synthetic item)")
        zero = per == 0
        if zero.any():
            for r, c in zip(*np.nonzero(zero)):
                ax.add_patch(matplotlib.patches.Rectangle((c - .5, r - .5), 1, 1, fill=False, hatch="xx",
                                                          edgecolor="#999999", linewidth=0))
            _outline(ax, zero, plots.COLORS["bug"])
            ax.text(0.03, 0.97, "0 tokens per item:\nreshape crash at the first capture", transform=ax.transAxes,
                    ha="left", va="top", color=plots.COLORS["bug"], fontsize=9,
                    bbox={"facecolor": "white", "alpha": 0.9, "edgecolor": plots.COLORS["bug"]})
        else:
            _outline(ax, clamped, plots.COLORS["fix"], linestyle="--")
            ax.text(0.03, 0.97, "above the dashed line: B clamped\nto min_budget (1 token per item)",
                    transform=ax.transAxes, ha="left", va="top", color=plots.COLORS["fix"], fontsize=9,
                    bbox={"facecolor": "white", "alpha": 0.9, "edgecolor": plots.COLORS["fix"]})
        for r in range(n):
            for c in range(n):
                if per[r, c] > 0:
                    ax.text(c, r, str(int(per[r, c])), ha="center", va="center", fontsize=6,
                            color="white" if np.log2(per[r, c]) < vmax / 2 else "black")
        ticks = [str(s) for s in sizes]
        ax.set_xticks(range(n), ticks, rotation=45)
        ax.set_yticks(range(n), ticks)
        for (lo, batch), label in marks.items():
            if lo in sizes and batch in sizes:
                x, y = sizes.index(lo), sizes.index(batch)
                ax.plot(x, y, marker="o", markersize=15, markerfacecolor="none",
                        markeredgecolor=plots.COLORS["limit"], markeredgewidth=2)
                ax.annotate(label, (x, y), xytext=(12, -4), textcoords="offset points", fontsize=7.5,
                            color=plots.COLORS["limit"], bbox={"facecolor": "white", "alpha": 0.85, "pad": 1,
                                                               "edgecolor": "none"})
    fig.suptitle("Tokens per synthetic capture item at the smallest budget, auto config (grey = 0)", fontsize=11)
    fig.tight_layout()
    return fig


def _allocation_bars(ax, budgets: list[int], batch: int, merge: int, title: str) -> None:
    """Buffer patches as a share of a full batch's patches, floor vs ceiling, per budget."""
    x = np.arange(len(budgets))
    need = np.array([b * merge ** 2 for b in budgets])
    for variant, shift in (("bug", -0.2), ("fix", 0.2)):
        alloc = np.array([vit.per_item_output(b, batch, variant) * batch * merge ** 2 for b in budgets])
        label = {"bug": "floor (bug)", "fix": "ceiling (fix)"}[variant]
        rects = ax.bar(x + shift, 100 * alloc / need, 0.4, color=plots.COLORS[variant], label=label)
        for r, a, n in zip(rects, alloc, need):
            ax.annotate(f"{a}", (r.get_x() + r.get_width() / 2, r.get_height()), ha="center", va="bottom",
                        fontsize=7, rotation=90, xytext=(0, 2), textcoords="offset points",
                        bbox={"facecolor": "white", "alpha": 0.8, "pad": 0.5, "edgecolor": "none"})
    ax.axhline(100, color=plots.COLORS["limit"], linestyle="--", linewidth=1.2,
               label="needed: a full batch (budget x merge^2 patches)")
    ax.set_xticks(x, [f"{b}\n({n} p.)" for b, n in zip(budgets, need)], fontsize=8)
    ax.set_ylim(0, 200)
    ax.set_xlabel("token budget (patches of a full batch)")
    ax.set_ylabel("buffer patches, % of a full batch (bar labels: patches)")
    ax.set_title(title)
    ax.legend(fontsize="small", loc="upper right")


def plot_allocation(result: dict) -> plt.Figure:
    """Allocated vs needed patches per budget: the run config, and vLLM scale (B = 156)."""
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    _allocation_bars(axes[0], result["token_budgets"], result["max_batch_size"], 2,
                     f"this run: budgets {result['token_budgets']}, B = {result['max_batch_size']}")
    _allocation_bars(axes[1], generate_budgets(256, 10000), 156, 2,
                     "vLLM scale: max_num_batched_tokens = 10000, B = 156 (user-given)")
    fig.tight_layout()
    return fig


def plot_correctness(stream: dict, sweep: dict[str, dict]) -> plt.Figure:
    """Left: mixed stream through the fix's graphs, per-image max |graph - eager|. Right: single
    images of 1..100 tokens on the under-sized config: predicted vs observed replay failures."""
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
    floor = 1e-9
    ax = axes[0]
    diffs = np.maximum(stream["max_abs_diff"], floor)
    ax.scatter(np.arange(len(diffs)), diffs, color=plots.COLORS["fix"], s=18, label="fix: graph vs eager")
    ax.axhline(TOLERANCE, color=plots.COLORS["limit"], linestyle="--", linewidth=1, label=f"tolerance {TOLERANCE:g}")
    ax.set_yscale("log")
    ax.set_ylim(floor / 2, 1)
    ax.set_xlabel("image in the stream")
    ax.set_ylabel("max |graph - eager| (exact 0 drawn at 1e-9)")
    ax.set_title(f"mixed stream: {len(diffs)} images, {len(stream['batches'])} packed batches")
    ax.legend(fontsize="small")
    ax = axes[1]
    tokens = np.array(sweep["bug"]["sweep_tokens"])
    predicted = np.array(sweep["bug"]["predicted_crash"])
    for t in tokens[predicted]:
        ax.axvspan(t - 0.5, t + 0.5, color=plots.COLORS["predicted"], alpha=0.25, linewidth=0)
    ax.fill_between([], [], color=plots.COLORS["predicted"], alpha=0.25, label="predicted: tokens > B * floor(budget / B)")
    for variant, marker in (("fix", "o"), ("bug", "x")):
        res = sweep[variant]
        ok = [(t, max(d, floor)) for t, d in zip(res["sweep_tokens"], res["sweep_max_abs_diff"]) if d is not None]
        if ok:
            ax.scatter(*zip(*ok), color=plots.COLORS[variant], marker=marker, s=14, label=f"{variant}: replayed, diff")
        crashed = [t for t, c in zip(res["sweep_tokens"], res["sweep_crashed"]) if c]
        if crashed:
            ax.scatter(crashed, [0.3] * len(crashed), color=plots.COLORS[variant], marker="v", s=30,
                       label=f"{variant}: replay raised ({len(crashed)})")
    for b in sweep["bug"]["token_budgets"]:
        ax.axvline(b + 0.5, color=plots.COLORS["limit"], linewidth=0.6, linestyle=":")
    ax.set_yscale("log")
    ax.set_ylim(floor / 2, 1)
    ax.set_xlabel("output tokens of a single image (budget boundaries dotted)")
    ax.set_ylabel("max |graph - eager| (exact 0 drawn at 1e-9)")
    ax.set_title(f"under-sized buffers: budgets {sweep['bug']['token_budgets']}, B = {sweep['bug']['max_batch_size']}")
    ax.legend(fontsize="small", loc="center left")
    fig.tight_layout()
    return fig


def plot_latency(stream: dict, device: str) -> plt.Figure:
    """P50/P99 latency per packed batch, graph path vs eager encoder."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.3))
    values = {"eager P50": stream["eager_p50_ms"], "graph P50": stream["graph_p50_ms"],
              "eager P99": stream["eager_p99_ms"], "graph P99": stream["graph_p99_ms"]}
    colors = {k: plots.COLORS["eager" if k.startswith("eager") else "fix"] for k in values}
    plots.bars(axes[0], values, colors=colors, ylabel="ms per packed batch", fmt="{:.2f}",
               title=f"{device}: {len(stream['graph_ms'])} timed batch runs")
    repeats = len(stream["graph_ms"]) // len(stream["batches"])
    tokens = np.repeat([b["tokens"] for b in stream["batches"]], repeats)
    axes[1].scatter(tokens, stream["eager_ms"], color=plots.COLORS["eager"], s=12, label="eager")
    axes[1].scatter(tokens, stream["graph_ms"], color=plots.COLORS["fix"], s=12, label="graph (fix)")
    axes[1].set_xlabel("output tokens in the batch")
    axes[1].set_ylabel("ms")
    axes[1].set_title("per batch")
    axes[1].legend(fontsize="small")
    if device == "cpu":
        fig.text(0.5, -0.03, "CPU: the emulated graph replays every recorded op from Python and runs the whole "
                 "padded budget; this measures the emulator, not a CUDA graph's launch savings.",
                 ha="center", fontsize=9)
    fig.tight_layout()
    return fig


def plot_pruning(widths: dict) -> plt.Figure:
    """Embedding width of an image with EVS pruning on: eager vs the graph path of each variant."""
    fig, ax = plt.subplots(figsize=(7, 3.8))
    values = {f"eager\n(encoder {widths['raw_encoder']} + 5 mrope)": widths["eager"],
              "bug\n(graph path)": widths["bug"], "fix\n(eager fallback)": widths["fix"]}
    colors = dict(zip(values, (plots.COLORS["eager"], plots.COLORS["bug"], plots.COLORS["fix"])))
    plots.bars(ax, values, colors=colors, fmt="{:.0f}", ylabel="channels per image token",
               title="pruning on: embedding width per image token", ylim=(0, widths["eager"] * 1.2))
    fig.tight_layout()
    return fig


def plot_plan(min_budget: int, max_budget: int, max_items: int = 0) -> plt.Figure:
    """Both variants' capture plans for one config: tokens per item and allocation per budget."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    for ax, variant in zip(axes, vit.VARIANTS):
        p = plan(min_budget, max_budget, variant, max_items=max_items)
        if p["error"]:
            ax.text(0.5, 0.5, textwrap.fill(p["error"], 70), ha="center", va="center", fontsize=8.5,
                    color=plots.COLORS[variant], transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_title(f"{variant}: refused when the manager is built")
            continue
        budgets = [r["budget"] for r in p["rows"]]
        x = np.arange(len(budgets))
        ax.bar(x, [r["allocated_tokens"] for r in p["rows"]], color=plots.COLORS[variant], label="allocated tokens")
        ax.scatter(x, budgets, marker="_", s=600, color=plots.COLORS["limit"], zorder=3, label="budget")
        for xi, r in zip(x, p["rows"]):
            zero = r["per_item_output"] == 0
            ax.annotate(f"{r['per_item_output']}/item", (xi, r["allocated_tokens"] or r["budget"]), ha="center",
                        va="bottom", fontsize=7, color=plots.COLORS["bug"] if zero else "black",
                        fontweight="bold" if zero else "normal")
        ax.set_xticks(x, [str(b) for b in budgets], rotation=30)
        ax.set_yscale("log")
        ax.set_xlabel("token budget")
        ax.set_ylabel("tokens in the graph's buffers")
        ax.set_title(f"{variant}: path ({p['path']}), B = {p['max_batch_size']}")
        ax.legend(fontsize="small")
    fig.tight_layout()
    return fig

