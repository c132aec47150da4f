"""Qwen2.5-VL with ``mm_device_do_normalize``: the encoder CUDA graph runs the vision tower on raw uint8-scale pixels, because the normalisation lives in ``_process_image_input``, which the graph path never calls.

Upstream: https://github.com/vllm-project/vllm/pull/55370 ("[Bugfix] Make `mm_device_do_normalize` encoder-cudagraph
safe", cjackal, vllm-project/vllm, merged; opened 2026-09-04, review activity to 2026-09-11). The bug came in with
https://github.com/vllm-project/vllm/pull/50411 ("[Model] Fused mm preprocess normalisation on the Device", merged
2026-07-31). The competing fix https://github.com/vllm-project/vllm/pull/55929 was left open.
Symptom: Qwen2-VL / Qwen2.5-VL served with the encoder CUDA graph (``cudagraph_mm_encoder``) and
``mm_device_do_normalize`` (on by default for these models) answer vision questions with "complete gibberish,
mostly whitespaces". Nothing crashes. With ``cudagraph_mm_encoder=False`` the answers are right.
Mechanism: with #50411 the processor leaves rescale/normalise off and sends raw ``uint8`` patches to the GPU, where
``FusedInputNorm`` (``vllm/model_executor/models/vision.py``, held as ``self.input_norm`` of
``Qwen2_5_VLForConditionalGeneration``) computes ``(x / 255 - mean) / std``. That call sat in
``_process_image_input`` / ``_process_video_input``, before ``self.visual(...)``, so the eager chain was
``embed_multimodal`` -> ``_process_image_input`` -> ``input_norm`` -> ``Qwen2_5_VisionTransformer.forward``. The
encoder CUDA graph manager (``vllm/v1/worker/encoder_cudagraph.py``) enters the model through another door:
``EncoderCudaGraphManager.execute`` -> ``_execute_local`` -> ``_run_budget_graph``, which calls
``prepare_encoder_cudagraph_replay_buffers`` (its ``"pixel_values"`` is ``_get_pixel_values_by_modality(mm_kwargs)``,
the raw patches), copies them into the captured ``pixel_values`` buffer (``_copy_padded_buffer``: the uint8 values
become 0..255 in the visual dtype) and replays a graph captured from ``encoder_cudagraph_forward``, which calls
``self.visual(pixel_values, None, encoder_metadata=...)`` directly. No normalisation kernel was ever captured, so
every replay feeds the tower pixels 255/std times too large and centred wrong, and the embeddings are garbage.
(``encoder_eager_forward``, the manager's path for a batch no budget fits, has the same omission.)
Doctor: warmup-divergence, at _process_image_input (the normalisation that the eager step does lives in this
function, outside the tower; the graph captured from ``encoder_cudagraph_forward`` therefore holds the tower without
it, and every replay reuses that capture-time composition while an eager step normalises first; the fix removed
``self.input_norm(...)`` from this function and moved it into the tower's ``forward``).
Fix (upstream): ``FusedInputNorm.from_model_config(...)`` is passed to ``Qwen2_5_VisionTransformer(...,
input_norm=...)``, whose ``forward`` applies ``self.input_norm(x, self.dtype)`` first; ``_process_image_input`` /
``_process_video_input`` drop their ``input_norm`` call and hand the raw patches to the tower (cast to the visual
dtype on the data-parallel path). The normalisation is now inside the captured region and both entry points run
it. (Same change in ``qwen2_vl.py``; the test's HF reference now passes the processor kwargs so it is not
normalised twice.)
Modelled: images only (no video path, no data-parallel sharding, no torch.compile). The Qwen2-VL processor's CLIP
mean/std and 1/255 rescale; 3 channels, ``temporal_patch_size`` 2, ``patch_size`` 2 (24 values per patch),
``spatial_merge_size`` 2, hidden size 16, output hidden size 12. The tower is ``patch_embed`` (the Conv3d as a
linear, as ``conv3d_to_linear_weight`` makes it), one block reduced to RMSNorm + gated MLP with its residual, and
the patch merger (RMSNorm, 4 patches -> MLP); attention, rotary embeddings and the window reordering are left
out, so the encoder metadata (``cu_seqlens``, ``max_seqlen``, rotary cos/sin) is empty and only ``pixel_values`` is
a graph input. ``FusedInputNorm.forward`` is its eager fallback (the Triton kernel computes the same). The manager
has one path ("default"), token budgets [4, 8], at most 2 images per batch, a shared graph pool, no DP, and an
output buffer sized from ``out_hidden_size`` before capture (upstream: ``empty_like`` of the warmup output). Two
encoder steps: images of 16 and 8 patches (6 tokens, the budget-8 graph with 2 padded tokens), then one image of 16
patches (4 tokens, the budget-4 graph). The reference is the same model with the encoder graph off
(``embed_multimodal``).
"""

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/55370"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "_process_image_input"
SYMPTOM = ("Qwen2.5-VL with mm_device_do_normalize and the encoder CUDA graph: the normalisation runs only in "
           "_process_image_input, the captured tower is fed raw 0..255 pixels, image embeddings are gibberish")

IN_CHANNELS, TEMPORAL_PATCH_SIZE, PATCH_SIZE = 3, 2, 2
SPATIAL_MERGE_SIZE = 2
HIDDEN, INTERMEDIATE, OUT_HIDDEN = 16, 32, 12
# Qwen2VLImageProcessor defaults (CLIP statistics, rescale 1/255).
IMAGE_MEAN = [0.48145466, 0.4578275, 0.40821073]
IMAGE_STD = [0.26862954, 0.26130258, 0.27577711]
RESCALE_FACTOR = 1 / 255
ENCODER_CUDAGRAPH_TOKEN_BUDGETS = [4, 8]
ENCODER_CUDAGRAPH_MAX_VISION_ITEMS_PER_BATCH = 2


# --- vllm/config: the pieces the model reads -----------------------------------------------------------------

@dataclasses.dataclass
class MultiModalConfig:
    mm_device_do_normalize: bool = True


@dataclasses.dataclass
class ModelConfig:
    multimodal_config: MultiModalConfig
    # the processor config (preprocessor_config.json) that FusedInputNorm._load_norm_params reads
    processor_config: dict = dataclasses.field(default_factory=lambda: {
        "do_rescale": True, "do_normalize": True, "image_mean": IMAGE_MEAN, "image_std": IMAGE_STD,
        "rescale_factor": RESCALE_FACTOR})


# --- vllm/model_executor/models/vision.py --------------------------------------------------------------------

class FusedInputNorm:
    """output = (input * rescale_factor - mean) / std, per channel, computed in fp32 and written in visual_dtype."""

    def __init__(self, image_mean, image_std, rescale_factor, channel=3, dtype=torch.float32, device="cpu"):
        self.channel = channel
        self._compute_dtype = dtype
        inv_rescale = 1.0 / rescale_factor
        image_mean_cpu = torch.tensor(image_mean, dtype=dtype) * inv_rescale
        image_std_cpu = torch.tensor(image_std, dtype=dtype) * inv_rescale
        weight_cpu = 1.0 / image_std_cpu
        bias_cpu = -image_mean_cpu / image_std_cpu
        self.is_identity = bool(torch.allclose(weight_cpu, torch.ones_like(weight_cpu))
                                and torch.allclose(bias_cpu, torch.zeros_like(bias_cpu)))
        self.weight = None if self.is_identity else weight_cpu.to(device)
        self.bias = None if self.is_identity else bias_cpu.to(device)

    @classmethod
    def identity(cls, channel=3, dtype=torch.float32, device="cpu"):
        return cls([0.0] * channel, [1.0] * channel, 1.0, channel, dtype, device)

    @classmethod
    def from_model_config(cls, model_config: ModelConfig, device="cpu"):
        if not model_config.multimodal_config.mm_device_do_normalize:
            return cls.identity(device=device)
        cfg = model_config.processor_config
        rescale_factor = cfg["rescale_factor"] if cfg["do_rescale"] else 1.0
        mean, std = (cfg["image_mean"], cfg["image_std"]) if cfg["do_normalize"] else ([0.0] * 3, [1.0] * 3)
        return cls(mean, std, rescale_factor, channel=len(mean), dtype=torch.float32, device=device)

    def __call__(self, grid_thw: torch.Tensor, visual_dtype: torch.dtype) -> torch.Tensor:
        assert grid_thw.ndim == 2
        patches, size = grid_thw.shape
        out_view = torch.empty((patches, size), dtype=visual_dtype, device=grid_thw.device)
        if self.is_identity:
            out_view.copy_(grid_thw)
            return out_view
        patch_size = size // self.channel
        # ---- Fallback eager path (the Triton fast path computes the same affine map) ----
        x = grid_thw.to(self._compute_dtype).view(patches, self.channel, patch_size)
        x = x * self.weight.view(1, self.channel, 1) + self.bias.view(1, self.channel, 1)
        out_view.copy_(x.view(patches, size))
        return out_view


# --- vllm/model_executor/models/qwen2_5_vl.py: the vision tower ----------------------------------------------

def _rms_norm(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class Qwen2_5_VisionPatchEmbed:
    def __init__(self, weight):
        self.weight = weight                       # conv3d_to_linear_weight(proj.weight): [embed_dim, C*tps*ps*ps]
        self.in_channels, self.patch_size, self.temporal_patch_size = IN_CHANNELS, PATCH_SIZE, TEMPORAL_PATCH_SIZE

    def __call__(self, x):
        return F.linear(x, self.weight)


class Qwen2_5_VisionBlock:
    def __init__(self, w):
        self.w = w

    def __call__(self, x):
        w = self.w
        gate, up = (_rms_norm(x, w["norm2"]) @ w["gate_up"]).chunk(2, dim=-1)
        return x + (F.silu(gate) * up) @ w["down"]


class Qwen2_5_VisionPatchMerger:
    def __init__(self, w):
        self.w = w
        self.hidden_size = HIDDEN * SPATIAL_MERGE_SIZE ** 2

    def __call__(self, x):
        x = _rms_norm(x, self.w["ln_q"]).view(-1, self.hidden_size)
        return F.gelu(x @ self.w["mlp0"] + self.w["mlp0_b"]) @ self.w["mlp2"] + self.w["mlp2_b"]


class Qwen2_5_VisionTransformer:
    def __init__(self, weights, variant, input_norm: FusedInputNorm | None = None):
        self.variant = variant
        self.patch_embed = Qwen2_5_VisionPatchEmbed(weights["patch_embed"])
        self.blocks = [Qwen2_5_VisionBlock(weights["block0"])]
        self.merger = Qwen2_5_VisionPatchMerger(weights["merger"])
        self.spatial_merge_size = SPATIAL_MERGE_SIZE
        self.out_hidden_size = OUT_HIDDEN
        if variant == "fix":                      # PR #55370: the tower owns the device-side normalisation
            self.input_norm = input_norm

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.weight.dtype

    def prepare_encoder_metadata(self, grid_thw_list, **kwargs) -> dict[str, torch.Tensor]:
        # cu_seqlens / max_seqlen / rotary cos-sin feed the attention, which this model leaves out.
        return {}

    def forward(self, x: torch.Tensor, grid_thw=None, encoder_metadata=None) -> torch.Tensor:
        if self.variant == "fix":                 # PR #55370
            x = self.input_norm(x, self.dtype)
        hidden_states = self.patch_embed(x.to(self.dtype))
        for blk in self.blocks:
            hidden_states = blk(hidden_states)
        return self.merger(hidden_states)

    __call__ = forward


# --- vllm/model_executor/models/qwen2_5_vl.py: the multimodal model ------------------------------------------

class Qwen2_5_VLForConditionalGeneration:
    supports_mm_device_do_normalize = True

    def __init__(self, model_config: ModelConfig, weights, variant, device):
        self.variant = variant
        if variant == "fix":                      # PR #55370
            self.visual = Qwen2_5_VisionTransformer(
                weights, variant, input_norm=FusedInputNorm.from_model_config(model_config, device=device))
        else:
            self.visual = Qwen2_5_VisionTransformer(weights, variant)
            self.input_norm = FusedInputNorm.from_model_config(model_config, device=device)   # #50411

    # -- the eager multimodal path ------------------------------------------------------------------------------
    def _process_image_input(self, image_input: dict) -> tuple[torch.Tensor, ...]:
        grid_thw = image_input["image_grid_thw"]
        assert grid_thw.ndim == 2
        pixel_values = image_input["pixel_values"]
        if self.variant == "bug":
            pixel_values = self.input_norm(pixel_values, self.visual.dtype)     # outside the tower
        image_embeds = self.visual(pixel_values, grid_thw=grid_thw)
        merge_size = self.visual.spatial_merge_size
        sizes = (grid_thw.prod(-1) // merge_size // merge_size).tolist()
        return image_embeds.split(sizes)

    def embed_multimodal(self, **kwargs) -> tuple[torch.Tensor, ...]:
        image_input = {"type": "pixel_values", "pixel_values": kwargs["pixel_values"],
                       "image_grid_thw": kwargs["image_grid_thw"]}
        return tuple(self._process_image_input(image_input))

    # -- SupportsEncoderCudaGraph protocol methods --------------------------------------------------------------
    def get_input_modality(self, mm_kwargs: dict[str, Any]) -> str:
        return "image"

    def _get_pixel_values_by_modality(self, mm_kwargs: dict[str, Any]) -> torch.Tensor:
        return mm_kwargs["pixel_values"]

    def _get_grid_thw_by_modality(self, mm_kwargs: dict[str, Any]) -> list[list[int]]:
        grid_thw = mm_kwargs["image_grid_thw"]
        return grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else [list(r) for r in grid_thw]

    def get_encoder_cudagraph_item_specs(self, mm_kwargs):
        m = self.visual.spatial_merge_size
        return [EncoderItemSpec(input_size=t * h * w, output_tokens=t * (h // m) * (w // m))
                for t, h, w in self._get_grid_thw_by_modality(mm_kwargs)]

    def select_encoder_cudagraph_items(self, mm_kwargs, indices):
        grid_thw = self._get_grid_thw_by_modality(mm_kwargs)
        pixel_values = self._get_pixel_values_by_modality(mm_kwargs)
        cum_patches = [0]
        for t, h, w in grid_thw:
            cum_patches.append(cum_patches[-1] + t * h * w)
        selected_pv = torch.cat([pixel_values[cum_patches[i]:cum_patches[i + 1]] for i in indices])
        return {"pixel_values": selected_pv, "image_grid_thw": [grid_thw[i] for i in indices]}

    def prepare_encoder_cudagraph_capture_inputs(self, token_budget, max_batch_size, device, dtype, gen):
        spatial_merge_size = self.visual.spatial_merge_size
        per_mm_item_output = (token_budget + max_batch_size - 1) // max_batch_size
        grid_config = [[1, spatial_merge_size, per_mm_item_output * spatial_merge_size]
                       for _ in range(max_batch_size)]
        pe = self.visual.patch_embed
        total_patches = sum(t * h * w for t, h, w in grid_config)
        flattened_patch_size = pe.in_channels * pe.temporal_patch_size * pe.patch_size * pe.patch_size
        dummy_pixel_values = randn(total_patches, flattened_patch_size, gen=gen, device=device).to(dtype)
        metadata = self.visual.prepare_encoder_metadata(grid_config, max_batch_size=max_batch_size)
        return metadata | {"pixel_values": dummy_pixel_values}

    def prepare_encoder_cudagraph_replay_buffers(self, mm_kwargs, max_batch_size):
        grid_thw_list = self._get_grid_thw_by_modality(mm_kwargs)
        metadata = self.visual.prepare_encoder_metadata(grid_thw_list, max_batch_size=max_batch_size)
        # the raw uint8 patches: nothing on this path normalises them unless the tower does
        return metadata | {"pixel_values": self._get_pixel_values_by_modality(mm_kwargs)}

    def encoder_cudagraph_forward(self, values: dict[str, torch.Tensor]) -> torch.Tensor:
        pixel_values = values.pop("pixel_values")
        return self.visual(pixel_values, None, encoder_metadata=values)

    def encoder_eager_forward(self, mm_kwargs: dict[str, Any]) -> torch.Tensor:
        return self.visual(self._get_pixel_values_by_modality(mm_kwargs), self._get_grid_thw_by_modality(mm_kwargs))


# --- vllm/v1/worker/encoder_cudagraph.py ---------------------------------------------------------------------

@dataclasses.dataclass
class EncoderItemSpec:
    input_size: int
    output_tokens: int


@dataclasses.dataclass
class BudgetGraphMetadata:
    token_budget: int
    graph: Any
    input_buffers: dict[str, torch.Tensor]
    output_buffer: torch.Tensor


class EncoderCudaGraphManager:
    def __init__(self, model: Qwen2_5_VLForConditionalGeneration, device, dtype):
        self.model, self.device, self.dtype = model, device, dtype
        self.token_budgets = sorted(ENCODER_CUDAGRAPH_TOKEN_BUDGETS)
        self.max_batch_size = ENCODER_CUDAGRAPH_MAX_VISION_ITEMS_PER_BATCH
        self.budget_graphs: dict[int, BudgetGraphMetadata] = {}
        self.graph_pool = None

    def capture(self, graph_pool):
        self.graph_pool = graph_pool
        gen = generator(5537)
        for token_budget in sorted(self.token_budgets, reverse=True):
            self._capture_budget_graph(token_budget, gen)

    def _capture_budget_graph(self, token_budget, gen):
        values = self.model.prepare_encoder_cudagraph_capture_inputs(
            token_budget, self.max_batch_size, self.device, self.dtype, gen)
        output_buffer = torch.empty(token_budget, self.model.visual.out_hidden_size, device=self.device,
                                    dtype=self.dtype)

        def step():
            output = self.model.encoder_cudagraph_forward({**values})
            output_buffer.copy_(output)
            return output_buffer

        graph, _ = capture(step, device=self.device, pool=self.graph_pool, warmups=1,
                           name=f"encoder budget {token_budget}", owner="EncoderCudaGraphManager",
                           static={f"pixel_values (budget {token_budget})": values["pixel_values"]})
        self.budget_graphs[token_budget] = BudgetGraphMetadata(token_budget, graph, values, output_buffer)

    def _find_smallest_fitting_budget_given_tokens(self, total_tokens):
        for budget in self.token_budgets:
            if budget >= total_tokens:
                return budget
        return None

    @staticmethod
    def _copy_padded_buffer(dst, src):
        dst.zero_()
        dst[: src.shape[0]].copy_(src)

    def _run_budget_graph(self, mm_kwargs, token_budget, num_tokens):
        graph_meta = self.budget_graphs[token_budget]
        replay_values = self.model.prepare_encoder_cudagraph_replay_buffers(mm_kwargs, self.max_batch_size)
        for key, buf in graph_meta.input_buffers.items():
            src = replay_values.get(key)
            if src is None:
                continue
            self._copy_padded_buffer(buf, src)
        return replay(graph_meta.graph, graph_meta.output_buffer, real=num_tokens, size=token_budget)

    def _execute_local(self, mm_kwargs):
        item_specs = self.model.get_encoder_cudagraph_item_specs(mm_kwargs)
        per_item_out_tokens = [spec.output_tokens for spec in item_specs]
        max_budget = self.token_budgets[-1]
        batches, current_batch, current_tokens = [], [], 0
        for orig_idx in sorted(range(len(item_specs)), key=lambda i: per_item_out_tokens[i]):
            fits = (len(current_batch) < self.max_batch_size
                    and current_tokens + per_item_out_tokens[orig_idx] <= max_budget)
            if current_batch and not fits:
                batches.append((current_batch, current_tokens))
                current_batch, current_tokens = [], 0
            current_batch.append(orig_idx)
            current_tokens += per_item_out_tokens[orig_idx]
        if current_batch:
            batches.append((current_batch, current_tokens))

        outputs_by_orig_idx: dict[int, torch.Tensor] = {}
        for batch_indices, tokens in batches:
            batch_mm_kwargs = self.model.select_encoder_cudagraph_items(mm_kwargs, batch_indices)
            token_budget = self._find_smallest_fitting_budget_given_tokens(tokens)
            if token_budget is None:
                output = self.model.encoder_eager_forward(batch_mm_kwargs)
            else:
                output = self._run_budget_graph(batch_mm_kwargs, token_budget, tokens)
            offset = 0                                   # postprocess_encoder_output(..., clone=True)
            for i in batch_indices:
                n = per_item_out_tokens[i]
                outputs_by_orig_idx[i] = output[offset:offset + n].clone()
                offset += n
        return [outputs_by_orig_idx[i] for i in range(len(item_specs))]

    def execute(self, mm_kwargs):
        return self._execute_local(mm_kwargs)


# --- the workload --------------------------------------------------------------------------------------------

def _weights(device):
    gen = generator(55370)
    r = lambda *s, scale=0.3: randn(*s, gen=gen, device=device, scale=scale)  # noqa: E731
    flat = IN_CHANNELS * TEMPORAL_PATCH_SIZE * PATCH_SIZE * PATCH_SIZE
    return {
        "patch_embed": r(HIDDEN, flat),
        "block0": {"norm2": 1 + r(HIDDEN, scale=0.1), "gate_up": r(HIDDEN, 2 * INTERMEDIATE),
                   "down": r(INTERMEDIATE, HIDDEN)},
        "merger": {"ln_q": 1 + r(HIDDEN, scale=0.1), "mlp0": r(4 * HIDDEN, 4 * HIDDEN, scale=0.2),
                   "mlp0_b": r(4 * HIDDEN, scale=0.1), "mlp2": r(4 * HIDDEN, OUT_HIDDEN, scale=0.2),
                   "mlp2_b": r(OUT_HIDDEN, scale=0.1)},
    }


def _encoder_steps(device):
    """Per scheduler step, the images whose encoder outputs it needs: raw uint8 patches and their grids."""
    gen = generator(2026)
    flat = IN_CHANNELS * TEMPORAL_PATCH_SIZE * PATCH_SIZE * PATCH_SIZE
    steps = []
    for grids in ([[1, 4, 4], [1, 2, 4]], [[1, 4, 4]]):
        n = sum(t * h * w for t, h, w in grids)
        pixel_values = torch.randint(0, 256, (n, flat), generator=gen, dtype=torch.uint8).to(device)
        steps.append({"pixel_values": pixel_values,
                      "image_grid_thw": torch.tensor(grids, dtype=torch.int64, device=device)})
    return steps


def run(variant: str, device: str = "cpu"):
    model_config = ModelConfig(MultiModalConfig(mm_device_do_normalize=True))
    steps = _encoder_steps(device)

    def eager():                                      # cudagraph_mm_encoder=False
        model = Qwen2_5_VLForConditionalGeneration(model_config, _weights(device), variant, device)
        return [e for mm_kwargs in steps for e in model.embed_multimodal(**mm_kwargs)]

    def served():                                     # the encoder CUDA graph manager
        model = Qwen2_5_VLForConditionalGeneration(model_config, _weights(device), variant, device)
        cg_manager = EncoderCudaGraphManager(model, device, model.visual.dtype)
        cg_manager.capture(graph_pool_handle(device))
        return [e for mm_kwargs in steps for e in cg_manager.execute(mm_kwargs)]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
