"""Qwen3-VL on HPU: ``get_image_embeds`` keeps views of a vision graph output that the next replay overwrites.

Upstream: https://github.com/HabanaAI/vllm-fork/pull/2096 ("Fix precision issue when input multiple images
at once", squash commit ebbc9f72f, on the release branches ``aice/v1.22.0`` / ``mm-v2``).
Symptom: "When user inputs multiple image in one prompt, the result is wrong. Seems the output
hidden_states is referenced to each other." (Qwen3-VL-30B-A3B on Gaudi, lazy mode with HPU graphs, a
multi-image chat request; October 2025.)
Mechanism: ``HpuModelAdapter`` wraps ``model.visual`` in ``htorch.hpu.wrap_in_hpu_graph`` (lazy mode), so a
call of ``Qwen3_VisionTransformerStaticShape.forward`` at a graphed vision bucket is a replay of the graph
captured for that padded size, and it returns that graph's own static output tensor.
``get_image_embeds`` processes images (and video frames) one by one: ``pre_attn`` pads each to its
bucket from ``VisionBuckets.get_multimodal_bucket``, ``forward`` runs it (``bypass_hpu_graphs=not
use_graph``), and ``results += [hidden_states[:post_embed_size, :]]`` keeps a *view* of the output.
When a later image of the same prompt lands in the same bucket, the replay rewrites that buffer, so
when ``torch.concat(results)`` finally runs every earlier entry of that bucket reads the last such
image's features: the model sees the same image several times.
Doctor: overwritten-output, at ``get_image_embeds`` (it keeps a graph-owned output past the next replay
of the same bucket's graph and reads it in ``torch.concat``).
Fix (upstream): ``results += [hidden_states[:post_embed_size, :].clone()]``.
Read: the one-line diff, ``get_image_embeds`` / ``pre_attn`` / ``forward`` before it, and
``VisionBuckets`` and the ``wrap_in_hpu_graph(self.model.visual, disable_tensor_cache=True)`` call in
``vllm/worker/hpu_model_runner.py``; and a public copy of ``habana_frameworks/torch/hpu/graphs.py``, whose
``wrapped_hpugraph_forward`` keys graphs on ``input_hash`` (tensor shapes) and, on a replay, returns
``cached.graph_outputs``: the same tensors every time. HPU graphs replay as CUDA graphs do; the wrapper is
modelled as that cache, with static inputs copied in before each replay. The vision blocks, merger and
deepstack merger are tiny stand-ins.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/HabanaAI/vllm-fork/pull/2096"
FAMILY = "persistent-buffer mutation"
KIND = "overwritten-output"
SITE = "get_image_embeds"
SYMPTOM = "multi-image prompts: earlier images' embeddings become the last same-bucket image's features"

IN_DIM, DIM, OUT_DIM = 6, 8, 4
SPATIAL_MERGE_SIZE = 2
SPATIAL_MERGE_UNIT = SPATIAL_MERGE_SIZE ** 2
MULTIMODAL_BUCKETS = [16, 32]                 # VLLM_MULTIMODAL_BUCKETS (multiples of 8)
DEEPSTACK_VISUAL_INDEXES = [0]
NUM_BLOCKS = 2
MAX_GRID = 8
WARMUP_GRIDS = {16: (4, 4), 32: (4, 8)}       # a dummy image of each bucket's size


class VisionBuckets:
    def __init__(self):
        self.multimodal_buckets = sorted(MULTIMODAL_BUCKETS)
        self.graphed_buckets = set()

    def get_multimodal_bucket(self, curr_num_image_patches):
        for mm_bucket in self.multimodal_buckets:
            if curr_num_image_patches <= mm_bucket:
                return mm_bucket
        return curr_num_image_patches

    def use_graph(self, seq_len):
        return seq_len in self.graphed_buckets


class HPUGraphWrapper:
    """``htorch.hpu.wrap_in_hpu_graph(module)``: one graph per input-shape hash, captured at the first call
    of that shape; later calls copy the inputs into the graph's static inputs, replay, and return the
    graph's static outputs. ``bypass_hpu_graphs=True`` runs the module eagerly."""

    def __init__(self, module, device):
        self.module, self.device = module, device
        self.cache = {}

    def forward(self, x, attn_mask, rotary_pos_emb, bypass_hpu_graphs=False):
        if bypass_hpu_graphs:
            return self.module.forward(x, attn_mask=attn_mask, rotary_pos_emb=rotary_pos_emb)
        key = (tuple(x.shape), tuple(attn_mask.shape), tuple(rotary_pos_emb.shape))
        if key not in self.cache:
            static = {"x": x.clone(), "attn_mask": attn_mask.clone(), "rotary_pos_emb": rotary_pos_emb.clone()}
            g, out = capture(lambda: self.module.forward(static["x"], attn_mask=static["attn_mask"],
                                                         rotary_pos_emb=static["rotary_pos_emb"]),
                             device=self.device, owner=f"wrap_in_hpu_graph(visual) bucket {x.shape[0]}",
                             static=static)
            self.cache[key] = (g, out, static)
        g, out, static = self.cache[key]
        static["x"].copy_(x)
        static["attn_mask"].copy_(attn_mask)
        static["rotary_pos_emb"].copy_(rotary_pos_emb)
        return replay(g, out)


class Qwen3_VisionTransformerStaticShape:
    def __init__(self, device, variant):
        self.device, self.variant = device, variant
        gen = generator(2096)
        self.patch_embed_w = randn(IN_DIM, DIM, gen=gen, device=device, scale=0.5)
        self.pos_embed = randn(MAX_GRID * MAX_GRID, DIM, gen=gen, device=device, scale=0.3)
        self.inv_freq = (1.0 / (10.0 ** (torch.arange(0, DIM // 2) / (DIM // 2)))).to(device)
        self.blocks = [(randn(DIM, DIM, gen=gen, device=device, scale=0.4),
                        randn(DIM, DIM, gen=gen, device=device, scale=0.4),
                        randn(DIM, DIM, gen=gen, device=device, scale=0.4)) for _ in range(NUM_BLOCKS)]
        self.merger_w = randn(DIM * SPATIAL_MERGE_UNIT, OUT_DIM, gen=gen, device=device, scale=0.3)
        self.deepstack_merger_list = [randn(DIM * SPATIAL_MERGE_UNIT, OUT_DIM, gen=gen, device=device, scale=0.3)]
        self.graphed = None                       # set by the model runner (wrap_in_hpu_graph)

    # -- dynamic part (eager, every image) ---------------------------------------------------------
    def fast_pos_embed_interpolate(self, grid_thw):
        _, h, w = (int(v) for v in grid_thw[0])
        idx = (torch.arange(h)[:, None] * MAX_GRID + torch.arange(w)[None, :]).reshape(-1)
        return self.pos_embed[idx.to(self.device)]

    def rot_pos_emb(self, grid_thw):
        _, h, w = (int(v) for v in grid_thw[0])
        pos = torch.arange(h * w, device=self.device).float()
        return pos[:, None] * self.inv_freq[None, :]                 # [patches, DIM // 2]

    def pad_multimodal_data(self, pixel_values, vision_buckets, constant_value=0):
        desired_number_of_pixels = vision_buckets.get_multimodal_bucket(pixel_values.shape[0])
        padding_len = desired_number_of_pixels - pixel_values.shape[0]
        if padding_len <= 0:
            return pixel_values
        return torch.nn.functional.pad(pixel_values, (0, 0, 0, padding_len), "constant", constant_value)

    def pre_attn(self, x, grid_thw, vision_buckets):
        hidden_states = x @ self.patch_embed_w
        hidden_states = hidden_states + self.fast_pos_embed_interpolate(grid_thw)
        rotary_pos_emb = self.rot_pos_emb(grid_thw)
        attention_mask = torch.ones(hidden_states.size(0), 1, device=self.device)
        hidden_states = self.pad_multimodal_data(hidden_states, vision_buckets, 0)
        rotary_pos_emb = self.pad_multimodal_data(rotary_pos_emb, vision_buckets, -100)
        attention_mask = self.pad_multimodal_data(attention_mask, vision_buckets, 0)
        return hidden_states, rotary_pos_emb, attention_mask

    # -- static part (HPU graph per bucket) --------------------------------------------------------
    @staticmethod
    def apply_rotary(x, rotary_pos_emb):
        cos, sin = rotary_pos_emb.cos(), rotary_pos_emb.sin()
        x1, x2 = x[:, : DIM // 2], x[:, DIM // 2:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

    def blk(self, hidden_states, rotary_pos_emb, attn_mask, weights):
        wq, wk, wv = weights
        q = self.apply_rotary(hidden_states @ wq, rotary_pos_emb)
        k = self.apply_rotary(hidden_states @ wk, rotary_pos_emb)
        scores = (q @ k.T) / DIM ** 0.5
        scores = scores.masked_fill(attn_mask == 0, -1e9)
        return hidden_states + torch.softmax(scores, -1) @ (hidden_states @ wv)

    def merge(self, hidden_states, w):
        return hidden_states.reshape(-1, DIM * SPATIAL_MERGE_UNIT) @ w

    def forward(self, x, attn_mask, rotary_pos_emb):
        hidden_states = x
        deepstack_feature_lists = []
        for layer_num, weights in enumerate(self.blocks):
            hidden_states = self.blk(hidden_states, rotary_pos_emb, attn_mask, weights)
            if layer_num in DEEPSTACK_VISUAL_INDEXES:
                idx = DEEPSTACK_VISUAL_INDEXES.index(layer_num)
                deepstack_feature_lists.append(self.merge(hidden_states, self.deepstack_merger_list[idx]))
        hidden_states = self.merge(hidden_states, self.merger_w)
        return torch.cat([hidden_states] + deepstack_feature_lists, dim=1)

    def get_image_embeds(self, pixel_values, grid_thw, vision_buckets):
        offset = 0
        results = []
        for img_idx in range(grid_thw.shape[0]):         # process each image one by one
            img_shape = grid_thw[img_idx, :].unsqueeze(0).clone()
            grid_t = int(grid_thw[img_idx, 0])               # for video, frames are processed separately
            img_shape[0, 0] = 1
            curr_img_size = int(img_shape.prod())
            for _ in range(grid_t):
                pixel_values_curr_img = pixel_values[offset:offset + curr_img_size, :]
                offset += curr_img_size
                (pixel_values_curr_img_padded, rot_pos_emb,
                 attention_mask) = self.pre_attn(pixel_values_curr_img, img_shape, vision_buckets)
                fullatt_block_attn_mask = attention_mask.squeeze(1).unsqueeze(0) * attention_mask
                if self.graphed is not None:
                    use_graph = vision_buckets.use_graph(pixel_values_curr_img_padded.shape[0])
                    hidden_states = self.graphed.forward(pixel_values_curr_img_padded,
                                                         rotary_pos_emb=rot_pos_emb,
                                                         attn_mask=fullatt_block_attn_mask,
                                                         bypass_hpu_graphs=not use_graph)
                else:
                    hidden_states = self.forward(pixel_values_curr_img_padded, rotary_pos_emb=rot_pos_emb,
                                                 attn_mask=fullatt_block_attn_mask)
                post_embed_size = curr_img_size // SPATIAL_MERGE_UNIT
                if self.variant == "fix":
                    results += [hidden_states[:post_embed_size, :].clone()]
                else:
                    results += [hidden_states[:post_embed_size, :]]
        return torch.concat(results)


class HPUModelRunner:
    def __init__(self, device, variant, graphed):
        self.device = device
        self.vision_buckets = VisionBuckets()
        self.visual = Qwen3_VisionTransformerStaticShape(device, variant)
        if graphed:                                      # lazy mode: wrap the visual model
            self.visual.graphed = HPUGraphWrapper(self.visual, device)
            self.warmup_multimodal_graphs()

    def warmup_multimodal_graphs(self):
        """Run every vision bucket once with dummy pixels, so its graph is captured, and mark it graphed."""
        for bucket in self.vision_buckets.multimodal_buckets:
            h, w = WARMUP_GRIDS[bucket]
            self.vision_buckets.graphed_buckets.add(bucket)
            grid = torch.tensor([[1, h, w]])
            self.visual.get_image_embeds(torch.zeros(h * w, IN_DIM, device=self.device), grid, self.vision_buckets)

    def _process_image_input(self, pixel_values, image_grid_thw):
        return self.visual.get_image_embeds(pixel_values, image_grid_thw, self.vision_buckets).clone()


def run(variant: str, device: str = "cpu"):
    gen = torch.Generator().manual_seed(44)
    # One prompt with three images: 4x4 and 2x6 patches pad to bucket 16, 4x8 is bucket 32.
    grid_a = torch.tensor([[1, 4, 4], [1, 2, 6], [1, 4, 8], [1, 4, 4]])
    pixels_a = torch.randn(int(grid_a.prod(-1).sum()), IN_DIM, generator=gen)
    # A two-frame video: both frames in bucket 16.
    grid_b = torch.tensor([[2, 2, 4]])
    pixels_b = torch.randn(int(grid_b.prod(-1).sum()), IN_DIM, generator=gen)

    def serve(graphed: bool):
        runner = HPUModelRunner(device, variant, graphed)
        return [runner._process_image_input(pixels_a.to(device), grid_a),
                runner._process_image_input(pixels_b.to(device), grid_b)]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
