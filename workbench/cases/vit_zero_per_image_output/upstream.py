"""The mirrored upstream code of vLLM #38040: Qwen3-VL's encoder-CUDA-graph hooks and vLLM's
encoder graph manager, with the ``bug`` (v0.20.2) and ``fix`` (v0.22.0) side by side.

* ``Qwen3VLForConditionalGeneration`` hooks, here ``EncoderModel`` (``qwen3_vl.py``):
  ``get_encoder_cudagraph_budget_range``, ``prepare_encoder_cudagraph_capture_inputs`` (``bug``:
  ``per_image_output = budget // max_batch_size``; ``fix``: ceiling), the modalities the graphs
  serve (``bug``: images even with pruning on; ``fix``: none when pruning is on) and the eager
  image path with the EVS post-process that appends 5 mrope-position channels.
* ``EncoderCudaGraphManager`` (``vllm/v1/worker/encoder_cudagraph.py``): the four config paths of
  ``__init__`` (``bug``: ``max_batch_size = max_budget // min_budget`` uncapped; ``fix``: at most
  the smallest budget), ``capture``, ``_run_budget_graph`` and the greedy ``_execute_local``.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from .. import check_variant
from ...engine import GraphManager
from .model import VisionEncoder, output_tokens

METADATA_KEYS = ("pos_embeds", "rotary_pos_emb_cos", "rotary_pos_emb_sin", "cu_seqlens")
PATHS = {"a": "budgets and max items given", "b": "only budgets given",
         "c": "only max items given", "d": "neither given (auto)"}
MROPE_CHANNELS = 5        # Qwen3-VL's EVS post-process: t, h, w, grid width, zero flag


# ------------------------------------------------------------------ model hooks
def per_item_output(token_budget: int, max_batch_size: int, variant: str) -> int:
    """Output tokens of each synthetic image a budget's graph is captured with.

    ``bug`` floors (v0.20.2): 0 when ``max_batch_size > token_budget``, and ``max_batch_size *
    per_item < token_budget`` when the budget is not a multiple. ``fix`` takes the ceiling (v0.22.0:
    "Ceil so the buffer fits the worst case of one item using the full budget").
    """
    if check_variant(variant) == "bug":
        return token_budget // max_batch_size
    return (token_budget + max_batch_size - 1) // max_batch_size


@dataclasses.dataclass
class CaptureInputs:
    """What ``prepare_encoder_cudagraph_capture_inputs`` returns for one token budget."""

    token_budget: int
    per_item_output: int
    grid_thw: list[list[int]]
    pixel_values: torch.Tensor                  # becomes the graph's input buffer
    metadata: dict[str, torch.Tensor]           # become its metadata buffers


def mrope_positions(t: int, h: int, w: int, merge: int) -> torch.Tensor:
    """``compute_mrope_for_media`` for one image plus Qwen3-VL's zero fifth channel: ``(tokens, 5)``
    rows of ``(t, h, w, grid width, 0)`` at merged-token resolution."""
    gh, gw = h // merge, w // merge
    tt = torch.arange(t).view(-1, 1, 1).expand(t, gh, gw)
    hh = torch.arange(gh).view(1, -1, 1).expand(t, gh, gw)
    ww = torch.arange(gw).view(1, 1, -1).expand(t, gh, gw)
    width = torch.full((t, gh, gw), gw)
    return torch.stack([tt, hh, ww, width, torch.zeros_like(width)], dim=-1).reshape(-1, MROPE_CHANNELS)


class EncoderModel(nn.Module):
    """The parts of ``Qwen3VLForConditionalGeneration`` the encoder graph path touches.

    ``min_budget`` is the smallest token budget worth a graph (Qwen3-VL: 64, the tokens of its
    smallest image); ``pruning`` is ``is_multimodal_pruning_enabled`` (EVS video pruning).
    """

    def __init__(self, visual: VisionEncoder, *, variant: str, min_budget: int = 64, pruning: bool = False) -> None:
        super().__init__()
        self.visual = visual
        self.variant = check_variant(variant)
        self.min_budget = min_budget
        self.pruning = pruning

    def get_encoder_cudagraph_budget_range(self, config) -> tuple[int, int]:
        """``(min_budget, max_budget)``; the max is ``min(max_num_batched_tokens, max_model_len)``."""
        return self.min_budget, min(config.max_num_batched_tokens, config.max_model_len)

    def encoder_cudagraph_modalities(self) -> list[str]:
        """What the graphs may serve. ``bug``: images always. ``fix``: nothing with pruning on,
        because the graph path skips the EVS post-process the eager path applies."""
        if self.variant == "fix" and self.pruning:
            return []
        return ["image"]

    def prepare_encoder_cudagraph_capture_inputs(self, token_budget: int, max_batch_size: int,
                                                 device: torch.device | str, dtype: torch.dtype) -> CaptureInputs:
        """Synthetic capture batch: ``max_batch_size`` rectangular images ``[1, m, per_item * m]``."""
        m = self.visual.spatial_merge_size
        per_item = per_item_output(token_budget, max_batch_size, self.variant)
        grid = [[1, m, per_item * m] for _ in range(max_batch_size)]
        patches = sum(t * h * w for t, h, w in grid)
        pixel_values = torch.randn(patches, self.visual.config.patch_dim, device=device, dtype=dtype)
        metadata = self.visual.prepare_encoder_metadata(grid, max_batch_size=max_batch_size)
        return CaptureInputs(token_budget, per_item, grid, pixel_values, metadata)

    def encoder_cudagraph_forward(self, pixel_values: torch.Tensor, metadata: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.visual(pixel_values, encoder_metadata=metadata)

    def embed_images(self, pixel_values: torch.Tensor, grid_thw: list[list[int]]) -> tuple[torch.Tensor, ...]:
        """The eager image path: encoder, split per image, EVS post-process when pruning is on."""
        merge = self.visual.spatial_merge_size
        embeds = self.visual(pixel_values, grid_thw).split(output_tokens(grid_thw, merge))
        if not self.pruning:
            return embeds
        return tuple(torch.cat([e, mrope_positions(*g, merge).to(e.device, e.dtype)], dim=1)
                     for e, g in zip(embeds, grid_thw))


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
class EncoderCudaGraphManager:
    """Budget graphs for a vision encoder; ``model.variant`` picks the code before or after the fix.

    Upstream's manager holds the config paths and the buffer policy; warmup, capture, dispatch and
    replay are a ``GraphManager``'s (``graph_manager``), keyed by token budget, smallest first, one
    pool per graph, as upstream captures them. Each budget's buffers are the synthetic capture batch
    ``prepare_encoder_cudagraph_capture_inputs`` makes right before that budget's warmup; that is
    where the bug lives.
    """

    def __init__(self, model, config: EncoderGraphConfig, *, device: str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        self.model = model
        self.config = config
        self.variant = check_variant(model.variant)
        self.device = device
        self.dtype = dtype
        self.capture_failed_at: int | None = None
        self.graph_hits = 0
        self.graph_misses = 0
        self._plan(model, config)
        self.graph_manager = GraphManager(
            self._forward, sorted(set(self.token_budgets)), device=device, descending=False,
            shared_pool=False, static_buffers=self._capture_inputs, name=type(self).__name__)

    def _plan(self, model, config: EncoderGraphConfig) -> None:
        """The four config paths: token budgets and ``max_batch_size``."""
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
            per = per_item_output(b, self.max_batch_size, self.variant)
            rows.append({"budget": b, "per_item_output": per, "allocated_tokens": per * self.max_batch_size})
        return rows

    def supports_modality(self, modality: str) -> bool:
        return modality in self.model.encoder_cudagraph_modalities()

    @property
    def budget_graphs(self) -> dict[int, list]:
        """Captured budget -> its graph (upstream ``budget_graphs``)."""
        return self.graph_manager.graphs

    # ------------------------------------------------------------- capture
    def capture(self, progress: bool = False) -> None:
        """Capture every budget, smallest first (a failing budget's number is kept in
        ``capture_failed_at``). Nothing is captured when the model serves no modality by graph."""
        if not self.model.encoder_cudagraph_modalities():
            return
        bar = lambda budgets: tqdm(budgets, desc=f"capture ({self.variant})", disable=not progress)  # noqa: E731
        try:
            self.graph_manager.capture(progress=bar)
        except BaseException:
            self.capture_failed_at = self.graph_manager.capturing
            raise
        self.capture_failed_at = None

    def _capture_inputs(self, token_budget: int) -> dict[str, torch.Tensor]:
        """The budget's static buffers: the synthetic batch upstream captures it with."""
        inputs = self.model.prepare_encoder_cudagraph_capture_inputs(
            token_budget, self.max_batch_size, self.device, self.dtype)
        return {"pixel_values": inputs.pixel_values, **inputs.metadata}

    def _forward(self, token_budget: int) -> torch.Tensor:
        buffers = self.graph_manager.buffers[token_budget]
        return self.model.encoder_cudagraph_forward(buffers["pixel_values"],
                                                    {key: buffers[key] for key in METADATA_KEYS})

    # -------------------------------------------------------------- replay
    def budget_for(self, tokens: int) -> int | None:
        """The budget a batch of ``tokens`` output tokens runs at (``None``: larger than every
        budget, run eagerly)."""
        return self.graph_manager.dispatch(tokens)

    def _run_budget_graph(self, pixel_values: torch.Tensor, grid_thw: list[list[int]], token_budget: int,
                          tokens: int) -> torch.Tensor:
        """Zero then copy the batch into the budget's buffers, as upstream, and replay."""
        buffers = self.graph_manager.buffers[token_budget]
        replay_metadata = self.model.visual.prepare_encoder_metadata(grid_thw, max_batch_size=self.max_batch_size)
        buffers["pixel_values"].zero_()
        buffers["pixel_values"][:pixel_values.shape[0]].copy_(pixel_values)   # raises when the buffer is short
        for key in METADATA_KEYS:
            src, buf = replay_metadata[key], buffers[key]
            buf.zero_()
            buf[:src.shape[0]].copy_(src)
        return self.graph_manager.replay(token_budget, tokens)

    def run_batch(self, pixel_values: torch.Tensor, grid_thw: list[list[int]]) -> torch.Tensor:
        """One packed batch: its budget's graph, or eager when no budget is large enough."""
        tokens = sum(output_tokens(grid_thw, self.model.visual.spatial_merge_size))
        budget = self.budget_for(tokens)
        if budget is None:
            self.graph_misses += len(grid_thw)
            with torch.no_grad():
                return self.model.visual(pixel_values, grid_thw)
        if budget not in self.budget_graphs:
            raise RuntimeError(f"budget {budget} has no captured graph: call capture() first")
        out = self._run_budget_graph(pixel_values, grid_thw, budget, tokens)
        self.graph_hits += len(grid_thw)
        return out.clone()              # a later batch of the same budget overwrites the buffer

    def execute(self, pixel_values: torch.Tensor, grid_thw: list[list[int]]) -> list[torch.Tensor]:
        """Per-image encoder outputs, in input order, through greedy-packed budget graphs."""
        merge = self.model.visual.spatial_merge_size
        tokens = output_tokens(grid_thw, merge)
        offsets = [0, *np.cumsum([t * h * w for t, h, w in grid_thw]).tolist()]
        outputs: list[torch.Tensor | None] = [None] * len(grid_thw)
        for batch in pack_greedy(tokens, self.token_budgets[-1], self.max_batch_size):
            pixels = torch.cat([pixel_values[offsets[i]:offsets[i + 1]] for i in batch])
            out = self.run_batch(pixels, [grid_thw[i] for i in batch])
            for i, piece in zip(batch, out.split([tokens[i] for i in batch])):
                outputs[i] = piece
        return outputs


def encode_images(model: EncoderModel, manager: EncoderCudaGraphManager | None,
                  pixel_values: torch.Tensor, grid_thw: list[list[int]]) -> list[torch.Tensor]:
    """The model runner's choice: the graph manager when it serves images, else the eager path."""
    if manager is not None and manager.supports_modality("image"):
        return manager.execute(pixel_values, grid_thw)
    with torch.no_grad():
        return list(model.embed_images(pixel_values, grid_thw))
