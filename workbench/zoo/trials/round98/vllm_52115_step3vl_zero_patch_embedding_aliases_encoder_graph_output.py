"""Step3-VL encoder CUDA graph: an image with zero local patches is handed to the encoder cache as a view of the graph's static output, which the next image's replay overwrites.

Upstream: https://github.com/vllm-project/vllm/pull/52115 ("[Bugfix][Model] Preserve Step3-VL zero-patch CUDA
graph outputs", vllm-project/vllm, opened 2026-08-13, open when read). Read: the PR description (the single-part
fast path "returns the CUDA graph output buffer directly even when ``clone=True``", so "a later replay can
overwrite a previously cached image embedding"; validated with two images, ``num_patches=[0, 0]``); the pre-fix
encoder-graph methods of ``Step3VLForConditionalGeneration`` in a stored ``vllm/model_executor/models/step3_vl.py``
(``postprocess_encoder_output`` ends in ``merged[idx] = torch.cat(parts) if len(parts) > 1 else parts[0]`` and
never looks at ``clone``); a stored ``vllm/v1/worker/encoder_cudagraph.py`` (``EncoderCudaGraphManager``:
``_capture_budget_graph`` copies the forward into an ``output_buffer`` allocated before capture,
``_run_budget_graph`` zero-pads the inputs, replays and returns ``output_buffer``, ``_execute_local`` packs items
into batches of at most ``max_batch_size`` and calls ``postprocess_encoder_output(..., clone=True)`` per batch).
That stored manager is later than the Step3-VL file (it passes a dict of path outputs; the model's signature takes
``output`` / ``local_output``, as modelled). The diff was not read: the fix is the description's.
Symptom: with ``cudagraph_mm_encoder`` on, a Step3-VL request whose image is small enough to get no local patches
is answered about another image (the one encoded after it); eager mode is correct.
Mechanism: an image with local patches gets ``torch.cat(patch tokens, global tokens)``, a fresh tensor. An image
with none gets ``global_part[i].reshape(-1, hidden)``: a view of ``output_buffer``, the global-path graph's static
output. The runner stores it in ``encoder_cache`` and reads it when it builds the prompt's ``inputs_embeds``. Any
replay of the same budget graph before that read (the next batch of the same ``execute``, or a later step's
image) rewrites the buffer, so the cached embedding silently becomes the other image's.
Doctor: overwritten-output, at postprocess_encoder_output. It hands a graph-owned output to the encoder cache
without the copy its ``clone=True`` caller asked for, and the cache entry is read after the next replay.
Fix (upstream): honour ``clone`` on the single-part path as well (``parts[0].clone() if clone else parts[0]``).
Modelled: ``Step3VLForConditionalGeneration`` (vision stand-in with 4 leading register tokens sliced off, the two
strided convolutions and the projector of ``_process_image_features``, the encoder-graph protocol methods above,
``embed_input_ids``); ``EncoderCudaGraphManager`` (dual global/local paths, budgets, capture into a shared pool,
zero-padded replay, greedy packing, ``execute``); a runner with ``encoder_cache``, ``_execute_mm_encoder`` and
``_gather_mm_embeddings``. Stand-ins: the vision transformer is a patch embedding plus one tanh MLP; the language
model is one eager attention read-out over a per-request KV list (not graphed here); images are 16x16 (global)
and 8x8 (local patch) instead of 728 and 504, so an image is 4 global tokens and a patch 1; the scheduler is a
fixed three-step list; decode tokens are fixed ids, not sampled. float64.
Workload: ``encoder_cudagraph_max_vision_items_per_batch=1``, budgets [4, 8]. Step 1 prefills A (image a, no
patches) and B (image b, no patches): the encoder runs two batches on the same 4-token global graph, and in the
bug A's cached embedding is b's by the time A's prompt is embedded. Step 2 prefills C (image c, 3 patches: local
budget 4, one padded patch) and decodes A and B; step 3 decodes all three (the replays of step 2 rewrite the
cached a and b again, unread by then). Bug: max |graph - eager| = 1.32 (A's outputs at steps 1, 2 and 3 differ by
1.15, 1.32 and 0.42; B and C equal eager); fix: 1.1e-15 (batch-of-one against batch-of-two rounding).
"""
from __future__ import annotations

import dataclasses
import itertools
import math

import torch
import torch.nn.functional as F

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/52115"
FAMILY = "persistent-buffer mutation"
KIND = "overwritten-output"
SITE = "postprocess_encoder_output"
SYMPTOM = ("Step3-VL with encoder CUDA graphs: a zero-patch image's cached embedding is a view of the graph output, "
           "overwritten by the next image's replay; the request is answered about the other image")

IMAGE_SIZE, PATCH_IMAGE_SIZE, PATCH_SIZE = 16, 8, 2          # upstream: 728 global, 504 local patch, patch 14
UNDERSTAND_PROJECTOR_STRIDE = 2
VIT_HIDDEN, OUTPUT_HIDDEN, HIDDEN = 6, 6, 8
VOCAB, IMAGE_TOKEN_ID = 32, 31
NUM_REGISTER_TOKENS = 4                                     # ``self.vision_model(x)[:, 4:]``
ENCODER_CUDAGRAPH_TOKEN_BUDGETS = [4, 8]
ENCODER_CUDAGRAPH_MAX_VISION_ITEMS_PER_BATCH = 1
DTYPE = torch.float64

_variant = "bug"


# --- vllm/v1/worker/encoder_cudagraph_defs.py ----------------------------------------------------------------------

@dataclasses.dataclass
class EncoderCudaGraphConfig:
    enable_dual_path_graph: bool = False
    global_token_per_image: int = 0
    local_token_per_patch: int = 0


@dataclasses.dataclass
class EncoderItemSpec:
    output_tokens: int
    global_output_tokens: int
    local_output_tokens: int

    def get_path_output_tokens(self, path):
        return self.global_output_tokens if path == "global" else self.local_output_tokens


# --- vllm/model_executor/models/step3_vl.py (vision side and encoder-graph protocol) -------------------------------

_PATH_KEY = {"global": "pixel_values", "local": "patch_pixel_values"}


class Step3VLForConditionalGeneration:
    def __init__(self, device):
        gen = generator(52115)
        r = lambda *s, scale=0.4: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)  # noqa: E731
        self.patch_embed = r(3 * PATCH_SIZE * PATCH_SIZE, VIT_HIDDEN)       # vision_model stand-in
        self.pos_embed = r((IMAGE_SIZE // PATCH_SIZE) ** 2, VIT_HIDDEN, scale=0.1)
        self.registers = r(NUM_REGISTER_TOKENS, VIT_HIDDEN)
        self.vit_mlp = r(VIT_HIDDEN, VIT_HIDDEN)
        self.vit_downsampler = r(OUTPUT_HIDDEN, VIT_HIDDEN, 2, 2, scale=0.2)   # Conv2d(k=2, stride=2)
        self.vit_downsampler2 = r(OUTPUT_HIDDEN * 2, OUTPUT_HIDDEN, 3, 3, scale=0.1)  # Conv2d(k=3, s=2, pad=1)
        self.vit_large_projector = r(OUTPUT_HIDDEN * 2, HIDDEN, scale=0.3)
        self.embed_tokens = r(VOCAB, HIDDEN, scale=0.8)
        self.wq, self.wk, self.wv, self.wo = (r(HIDDEN, HIDDEN) for _ in range(4))
        self.lm_head = r(HIDDEN, VOCAB, scale=0.2)
        self.img_output_tokens = self._compute_spatial_tokens(IMAGE_SIZE, PATCH_SIZE, UNDERSTAND_PROJECTOR_STRIDE)
        self.patch_output_tokens = self._compute_spatial_tokens(PATCH_IMAGE_SIZE, PATCH_SIZE,
                                                                UNDERSTAND_PROJECTOR_STRIDE)

    @staticmethod
    def _compute_spatial_tokens(size, patch_size, stride):
        grid = size // patch_size
        spatial = int(math.sqrt(grid * grid))
        h1 = (spatial - 2) // stride + 1
        h2 = (h1 - 1) // 2 + 1
        return h2 * h2

    def vision_model(self, pixel_values):
        """Stand-in: patch embedding, position embedding, one tanh MLP, 4 leading register tokens."""
        b, grid = pixel_values.shape[0], pixel_values.shape[-1] // PATCH_SIZE
        x = pixel_values.unfold(2, PATCH_SIZE, PATCH_SIZE).unfold(3, PATCH_SIZE, PATCH_SIZE)
        x = x.permute(0, 2, 3, 1, 4, 5).reshape(b, grid * grid, -1) @ self.patch_embed + self.pos_embed[:grid * grid]
        x = x + torch.tanh(x @ self.vit_mlp)
        return torch.cat([self.registers.expand(b, -1, -1), x], dim=1)

    def _get_vision_model_output(self, input_tensor):
        return self.vision_model(input_tensor)[:, NUM_REGISTER_TOKENS:]

    def _process_image_features(self, image_features):
        B, P = image_features.shape[:2]
        HW = int(math.sqrt(P))
        image_features = image_features.permute(0, 2, 1).reshape(B, -1, HW, HW)
        image_features = F.conv2d(image_features, self.vit_downsampler, stride=UNDERSTAND_PROJECTOR_STRIDE)
        image_features = F.conv2d(image_features, self.vit_downsampler2, stride=2, padding=1)
        n_dim = image_features.size(1)
        image_features = image_features.reshape(B, n_dim, -1).permute(0, 2, 1)
        return image_features @ self.vit_large_projector

    def _batched_encoder_forward(self, pixel_values):
        image_features = self._process_image_features(self._get_vision_model_output(pixel_values))
        return image_features.reshape(-1, image_features.shape[-1])

    # eager path (encoder CUDA graphs off): embed_multimodal -> _process_image_input
    def _process_image_input(self, image_input):
        image_features = self._process_image_features(self._get_vision_model_output(image_input["pixel_values"]))
        ppv = image_input["patch_pixel_values"]
        patch_image_features = (self._process_image_features(self._get_vision_model_output(ppv))
                                if len(ppv) > 0 else None)
        merged_image_features, cur_patch_idx = [], 0
        for i, num_patch in enumerate(image_input["num_patches"].tolist()):
            cur_feature = []
            if num_patch > 0:
                patch_slice = patch_image_features[cur_patch_idx:cur_patch_idx + num_patch]
                cur_feature.append(patch_slice.reshape(-1, patch_slice.shape[-1]))
            cur_feature.append(image_features[i].reshape(-1, image_features.shape[-1]))   # a fresh tensor
            cur_patch_idx += num_patch
            merged_image_features.append(torch.cat(cur_feature) if len(cur_feature) > 1 else cur_feature[0])
        return merged_image_features

    def embed_multimodal(self, **kwargs):
        return self._process_image_input(kwargs)

    def get_encoder_cudagraph_config(self):
        return EncoderCudaGraphConfig(enable_dual_path_graph=True, global_token_per_image=self.img_output_tokens,
                                      local_token_per_patch=self.patch_output_tokens)

    def get_encoder_cudagraph_item_specs(self, mm_kwargs):
        return [EncoderItemSpec(output_tokens=self.img_output_tokens + num_patch * self.patch_output_tokens,
                                global_output_tokens=self.img_output_tokens,
                                local_output_tokens=num_patch * self.patch_output_tokens)
                for num_patch in mm_kwargs["num_patches"].tolist()]

    def select_encoder_cudagraph_items(self, mm_kwargs, indices):
        pixel_values, patch_pixel_values = mm_kwargs["pixel_values"], mm_kwargs["patch_pixel_values"]
        num_patches = mm_kwargs["num_patches"]
        cum_patches = [0, *itertools.accumulate(num_patches.tolist())]
        selected_ppv = torch.cat([patch_pixel_values[cum_patches[i]:cum_patches[i + 1]] for i in indices])
        return {"pixel_values": pixel_values[indices], "patch_pixel_values": selected_ppv,
                "num_patches": num_patches[indices]}

    def prepare_encoder_cudagraph_capture_inputs(self, token_budget, max_batch_size, device, path):
        if path == "global":
            max_batch_size = min(max_batch_size, token_budget // self.img_output_tokens)
            return {"pixel_values": torch.zeros(max_batch_size, 3, IMAGE_SIZE, IMAGE_SIZE, dtype=DTYPE, device=device)}
        max_num_patches = token_budget // self.patch_output_tokens
        return {"patch_pixel_values": torch.zeros(max_num_patches, 3, PATCH_IMAGE_SIZE, PATCH_IMAGE_SIZE,
                                                  dtype=DTYPE, device=device)}

    def prepare_encoder_cudagraph_replay_buffers(self, mm_kwargs, path):
        return {_PATH_KEY[path]: mm_kwargs[_PATH_KEY[path]]}

    def encoder_cudagraph_forward(self, values, path):
        return self._batched_encoder_forward(values[_PATH_KEY[path]])

    def postprocess_encoder_output(self, output, indices, per_item_out_tokens, dest, clone=False,
                                   batch_mm_kwargs=None, local_output=None):
        """CPU-side per-item merge after dual-path graph replay."""
        num_patches = batch_mm_kwargs["num_patches"]
        hidden = output.shape[-1]
        bsz = len(indices)
        actual_np = [int(n) for n in num_patches.tolist()]
        total_patches = sum(actual_np)
        img_tokens = bsz * self.img_output_tokens
        patch_tokens = total_patches * self.patch_output_tokens
        global_part = output[:img_tokens].reshape(bsz, self.img_output_tokens, hidden)
        patch_part = (local_output[:patch_tokens].reshape(-1, self.patch_output_tokens, hidden)
                      if total_patches > 0 else None)
        merged, cur_patch = {}, 0
        for i, idx in enumerate(indices):
            np_ = actual_np[i]
            parts = []
            if patch_part is not None and np_ > 0:
                parts.append(patch_part[cur_patch:cur_patch + np_].reshape(-1, hidden))
                cur_patch += np_
            parts.append(global_part[i].reshape(-1, hidden))
            if _variant == "bug":
                merged[idx] = torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]
            else:
                merged[idx] = torch.cat(parts, dim=0) if len(parts) > 1 else (parts[0].clone() if clone else parts[0])
        for idx in indices:
            dest[idx] = merged[idx]

    # language side: embed_input_ids and a one-layer stand-in for the language model
    def embed_input_ids(self, input_ids, multimodal_embeddings, is_multimodal):
        inputs_embeds = self.embed_tokens[input_ids]
        if multimodal_embeddings:
            inputs_embeds = inputs_embeds.masked_scatter(is_multimodal.unsqueeze(-1),
                                                         torch.cat(multimodal_embeddings))
        return inputs_embeds

    def forward(self, inputs_embeds, req_slices, kv_lists):
        """Per request, the last token attends to all of the request's tokens so far (its KV list)."""
        out = []
        for req_id, (start, end) in req_slices.items():
            ks, vs = kv_lists.setdefault(req_id, ([], []))
            ks.append(inputs_embeds[start:end] @ self.wk)
            vs.append(inputs_embeds[start:end] @ self.wv)
            q = inputs_embeds[end - 1] @ self.wq
            attn = torch.softmax(torch.cat(ks) @ q / math.sqrt(HIDDEN), 0) @ torch.cat(vs)
            out.append((inputs_embeds[end - 1] + attn @ self.wo) @ self.lm_head)
        return torch.stack(out)


# --- vllm/v1/worker/encoder_cudagraph.py -----------------------------------------------------------------------------

@dataclasses.dataclass
class BudgetGraphMetadata:
    graph: object
    input_buffers: dict
    output_buffer: torch.Tensor


class EncoderCudaGraphManager:
    def __init__(self, device, model):
        self.device, self.model = device, model
        self.config = model.get_encoder_cudagraph_config()
        self.token_budgets = sorted(ENCODER_CUDAGRAPH_TOKEN_BUDGETS)
        self.max_batch_size = ENCODER_CUDAGRAPH_MAX_VISION_ITEMS_PER_BATCH
        self.budget_graphs = {}
        self.path_token_budgets = {"global": list(self.token_budgets),
                                   "local": self._generate_budgets(self.config.local_token_per_patch,
                                                                   self.token_budgets[-1])}
        self.graph_pool = None

    @staticmethod
    def _generate_budgets(min_budget, max_budget):
        return [min_budget << i for i in range(max_budget.bit_length()) if min_budget << i <= max_budget]

    def capture(self, graph_pool):
        self.graph_pool = graph_pool
        for path, budgets in self.path_token_budgets.items():
            for token_budget in sorted(budgets, reverse=True):
                self._capture_budget_graph(token_budget, path)

    def _capture_budget_graph(self, token_budget, path):
        values = self.model.prepare_encoder_cudagraph_capture_inputs(token_budget, self.max_batch_size,
                                                                     self.device, path)
        output = self.model.encoder_cudagraph_forward({**values}, path=path)
        output_buffer = torch.empty_like(output)

        def forward_into_output_buffer():
            output_buffer.copy_(self.model.encoder_cudagraph_forward({**values}, path=path))
            return output_buffer

        graph, _ = capture(forward_into_output_buffer, device=self.device, pool=self.graph_pool, warmups=1,
                           name=f"encoder {path} budget {token_budget}", static=values,
                           owner="EncoderCudaGraphManager")
        self.budget_graphs.setdefault(path, {})[token_budget] = BudgetGraphMetadata(graph, values, output_buffer)

    @staticmethod
    def _find_smallest_fitting_budget_given_tokens(total_tokens, budgets):
        return next((b for b in budgets if b >= total_tokens), None)

    @staticmethod
    def _copy_padded_buffer(dst, src):
        dst.zero_()
        dst[:src.shape[0]].copy_(src)

    def _run_budget_graph(self, mm_kwargs, token_budget, path, real_tokens):
        graph_meta = self.budget_graphs[path][token_budget]
        replay_values = self.model.prepare_encoder_cudagraph_replay_buffers(mm_kwargs, path)
        for key, buf in graph_meta.input_buffers.items():
            src = replay_values.get(key)
            if src is not None:
                self._copy_padded_buffer(buf, src)
        return replay(graph_meta.graph, graph_meta.output_buffer, real=real_tokens,
                      size=graph_meta.output_buffer.shape[0])

    def _execute_local(self, mm_kwargs):
        item_specs = self.model.get_encoder_cudagraph_item_specs(mm_kwargs)
        num_items, paths = len(item_specs), tuple(self.path_token_budgets)
        per_item_path_tokens = {p: [s.get_path_output_tokens(p) for s in item_specs] for p in paths}
        per_item_out_tokens = [s.output_tokens for s in item_specs]
        max_path_budgets = {p: max(self.path_token_budgets[p]) for p in paths}
        batches, current_batch, current_tokens = [], [], dict.fromkeys(paths, 0)
        for orig_idx in sorted(range(num_items), key=lambda i: per_item_out_tokens[i]):
            fits = len(current_batch) < self.max_batch_size and all(
                current_tokens[p] + per_item_path_tokens[p][orig_idx] <= max_path_budgets[p] for p in paths)
            if current_batch and not fits:
                batches.append(current_batch)
                current_batch, current_tokens = [], dict.fromkeys(paths, 0)
            current_batch.append(orig_idx)
            for p in paths:
                current_tokens[p] += per_item_path_tokens[p][orig_idx]
        if current_batch:
            batches.append(current_batch)

        outputs_by_orig_idx = {}
        for batch_indices in batches:
            batch_mm_kwargs = self.model.select_encoder_cudagraph_items(mm_kwargs, batch_indices)
            graph_outputs = {}
            for path in paths:
                path_tokens = sum(per_item_path_tokens[path][i] for i in batch_indices)
                if path_tokens == 0:
                    continue
                token_budget = self._find_smallest_fitting_budget_given_tokens(path_tokens,
                                                                               self.path_token_budgets[path])
                # (an input above every budget runs encoder_eager_forward: not reached here, not modelled)
                graph_outputs[path] = self._run_budget_graph(batch_mm_kwargs, token_budget, path, path_tokens)
            self.model.postprocess_encoder_output(graph_outputs["global"], batch_indices, per_item_out_tokens,
                                                  outputs_by_orig_idx, clone=True, batch_mm_kwargs=batch_mm_kwargs,
                                                  local_output=graph_outputs.get("local"))
        return [outputs_by_orig_idx[i] for i in range(num_items)]

    def execute(self, mm_kwargs):
        return self._execute_local(mm_kwargs)


# --- vllm/v1/worker/gpu_model_runner.py (reduced) ---------------------------------------------------------------------

@dataclasses.dataclass
class MultiModalFeatureSpec:
    mm_hash: str
    offset: int                       # position of the first placeholder token in the prompt
    length: int
    pixel_values: torch.Tensor
    patch_pixel_values: torch.Tensor


class GPUModelRunner:
    def __init__(self, device, use_encoder_cudagraph):
        self.device = device
        self.model = Step3VLForConditionalGeneration(device)
        self.encoder_cache = {}
        self.kv_lists = {}
        self.requests = {}                               # req_id -> (token ids so far, [MultiModalFeatureSpec])
        self.encoder_cudagraph_manager = None
        if use_encoder_cudagraph:
            self.encoder_cudagraph_manager = EncoderCudaGraphManager(device, self.model)
            self.encoder_cudagraph_manager.capture(graph_pool_handle(device))

    def _execute_mm_encoder(self, scheduled_encoder_inputs):
        if not scheduled_encoder_inputs:
            return
        feats = scheduled_encoder_inputs
        mm_hashes = [f.mm_hash for f in feats]
        mm_kwargs = {"pixel_values": torch.cat([f.pixel_values for f in feats]),
                     "patch_pixel_values": torch.cat([f.patch_pixel_values for f in feats]),
                     "num_patches": torch.tensor([f.patch_pixel_values.shape[0] for f in feats])}
        if self.encoder_cudagraph_manager is not None:
            encoder_outputs = self.encoder_cudagraph_manager.execute(mm_kwargs)
        else:
            encoder_outputs = self.model.embed_multimodal(**mm_kwargs)
        for mm_hash, output in zip(mm_hashes, encoder_outputs):
            self.encoder_cache[mm_hash] = output

    def _gather_mm_embeddings(self, scheduled):
        mm_embeds, is_mm_embed = [], []
        for req_id, (start, num_tokens) in scheduled.items():
            mask = torch.zeros(num_tokens, dtype=torch.bool)
            for f in self.requests[req_id][1]:
                lo, hi = max(start, f.offset), min(start + num_tokens, f.offset + f.length)
                if lo < hi:
                    mm_embeds.append(self.encoder_cache[f.mm_hash][lo - f.offset:hi - f.offset])
                    mask[lo - start:hi - start] = True
            is_mm_embed.append(mask)
        return mm_embeds, torch.cat(is_mm_embed).to(self.device)

    def execute_model(self, new_requests, decode_tokens):
        scheduled, input_ids, encoder_inputs = {}, [], []
        for req_id, (prompt, features) in new_requests.items():
            self.requests[req_id] = (prompt, features)
            scheduled[req_id] = (0, len(prompt))
            input_ids += prompt
            encoder_inputs += features
        for req_id, token in decode_tokens.items():
            prompt, features = self.requests[req_id]
            self.requests[req_id] = (prompt + [token], features)
            scheduled[req_id] = (len(prompt), 1)
            input_ids.append(token)
        self._execute_mm_encoder(encoder_inputs)
        mm_embeds, is_mm_embed = self._gather_mm_embeddings(scheduled)
        inputs_embeds = self.model.embed_input_ids(torch.tensor(input_ids, device=self.device), mm_embeds,
                                                   is_mm_embed)
        req_slices, cu = {}, 0
        for req_id, (_, n) in scheduled.items():
            req_slices[req_id] = (cu, cu + n)
            cu += n
        return self.model.forward(inputs_embeds, req_slices, self.kv_lists).clone()


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(521150)
    tokens = Step3VLForConditionalGeneration._compute_spatial_tokens
    img_tokens = tokens(IMAGE_SIZE, PATCH_SIZE, UNDERSTAND_PROJECTOR_STRIDE)
    patch_tokens = tokens(PATCH_IMAGE_SIZE, PATCH_SIZE, UNDERSTAND_PROJECTOR_STRIDE)

    def image(name, num_patches, offset):
        return MultiModalFeatureSpec(
            name, offset, num_patches * patch_tokens + img_tokens,
            randn(1, 3, IMAGE_SIZE, IMAGE_SIZE, gen=gen, device=device).to(DTYPE),
            randn(num_patches, 3, PATCH_IMAGE_SIZE, PATCH_IMAGE_SIZE, gen=gen, device=device).to(DTYPE))

    a, b, c = image("img-a", 0, 2), image("img-b", 0, 1), image("img-c", 3, 1)
    prompts = {"A": ([5, 7] + [IMAGE_TOKEN_ID] * a.length + [9], [a]),
               "B": ([3] + [IMAGE_TOKEN_ID] * b.length + [11, 12], [b]),
               "C": ([4] + [IMAGE_TOKEN_ID] * c.length + [8], [c])}

    def serve(use_encoder_cudagraph):
        runner = GPUModelRunner(device, use_encoder_cudagraph)
        return [runner.execute_model({"A": prompts["A"], "B": prompts["B"]}, {}),        # step 1: A, B prefill
                runner.execute_model({"C": prompts["C"]}, {"A": 13, "B": 14}),            # step 2: C prefill
                runner.execute_model({}, {"A": 15, "B": 16, "C": 17})]                     # step 3: decode

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
