"""vllm-gaudi: in torch.compile mode the multimodal warm-up runs inside PT_COMPILE_ONLY_MODE, where Gemma-4's vision pooler strips padding with a data-dependent gather (``pooled_states[valid_mask]``) whose row count only executing the op can give, so the graph warm-up fails.

Upstream: https://github.com/vllm-project/vllm-gaudi/pull/1744 ("[Bugfix][HPU] Add opt-in env to run MM warmup outside
PT_COMPILE_ONLY_MODE", vllm-project/vllm-gaudi, merged as commit 43f5f1fd of 2026-08-21). Read: the commit message (the
PR description), its whole diff (``vllm_gaudi/envs.py``: new ``VLLM_MM_WARMUP_OUTSIDE_COMPILE_ONLY``;
``vllm_gaudi/v1/worker/hpu_model_runner.py``: the two conditions around ``warmup_multimodal_graphs`` in
``warmup_model``; the docs), ``HPUModelRunner.warmup_model`` and the head of ``warmup_multimodal_graphs`` at the fix
commit, and vLLM's ``gemma4_mm.py`` image path (``_process_image_input``: per-image pooling, ``valid_states =
pooled_states[valid_mask]``, standardisation, one batched ``embed_vision`` call, the split back per image).
Symptom: Gemma-4 served on Gaudi with torch.compile (``PT_HPU_LAZY_MODE=0``, not eager): engine start-up intermittently
dies in the multimodal graph warm-up ("offset_ 0is not matching with the offset of new tensor 18446744069...").
Lazy mode and eager mode start; skipping the warm-up avoids it.
Mechanism: PT_COMPILE_ONLY_MODE traces and compiles the warm-up graphs (recipes) without executing them, as a graph
capture records kernels without running them. The vision pooler's ``pooled_states[valid_mask]`` has an output row
count that exists only once the mask has been computed and read back; inside compile-only nothing is computed, the
gather's output shape is never materialised and the recorded graph holds an uninitialised tensor offset. The language
model's warm-up graphs have no such op and are fine there; lazy mode already ran the multimodal warm-up outside.
Doctor: sync-in-capture, at _process_image_input (the boolean-mask gather needs the selected count on the host while
the warm-up is being captured; the upstream fix moves the multimodal warm-up out of the capturing context).
Fix (upstream): ``VLLM_MM_WARMUP_OUTSIDE_COMPILE_ONLY=1`` makes ``warmup_model`` run ``warmup_multimodal_graphs``
before, and outside, the compile-only context in torch.compile mode too (executing the vision path for real), and skips
it inside; default off. The fix variant is a deployment that sets it.
Modelled: ``HPUModelRunner.warmup_model`` (``use_torch_compile``, ``mm_warmup_outside``, the two conditions, the
compile-only context around the multimodal and decode-graph warm-ups), ``warmup_multimodal_graphs`` (one dummy image per
configured resolution, padded patch grid), ``warmup_graphs`` for decode buckets, ``_execute_mm_encoder``, and
``_process_image_input`` as in vLLM's ``gemma4_mm.py`` from the pooling loop on (the grouping of images by resolution
and the chunked encoder passes are reduced to one batched encoder call). Stand-ins: PT_COMPILE_ONLY_MODE is a graph
capture with no eager warm-up (it compiles without executing), the rest of warm-up runs eagerly; compiled recipes
executed outside a capture are eager ops; the Gemma-4 vision tower (a patch embedding and one MLP; padding patches have
position ids -1), its pooler (masked mean over groups of ``pooling_k2`` consecutive patches, valid where a group holds a
real patch); the language model is a recurrent stand-in (one state vector per request slot updated per token, no
attention or KV cache) so that image embeddings reach the decoded logits; float64.
Workload: requests A (image of 12 real patches in a 16-patch grid: 3 image tokens) and B (8 real patches: 2 image
tokens) with short text; step 0 prefills both eagerly (vision encoder, then the recurrence), steps 1-3 decode both with
the decode graph of 2; greedy tokens. Eager reference: ``enforce_eager``. Bug: start-up fails in the multimodal warm-up
(CaptureError at ``pooled_states[valid_mask]`` in ``_process_image_input``). Fix: the warm-up runs the vision path
eagerly, decode graphs are captured in compile-only mode, all 4 steps' logits equal eager (max 0).
"""
from __future__ import annotations

import contextlib

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-gaudi/pull/1744"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "_process_image_input"
SYMPTOM = ("Gemma-4 on Gaudi in torch.compile mode: the multimodal warm-up inside PT_COMPILE_ONLY_MODE hits the vision "
           "pooler's data-dependent gather pooled_states[valid_mask] and start-up crashes")

PATCH_DIM, VIT_HIDDEN, HIDDEN, VOCAB = 6, 8, 8, 16
IMAGE_TOKEN_ID = VOCAB - 1
POOLING_K2 = 4
MAX_PATCHES = 16
MAX_NUM_REQS = 2
DECODE_BUCKETS = [1, 2]
MULTIMODAL_RESOLUTIONS = [(4, 4), (4, 2)]            # patch grids warmed up (width x height, in patches)
VLLM_MM_WARMUP_OUTSIDE_COMPILE_ONLY = True           # what the fixed deployment sets
DTYPE = torch.float64

_variant = "bug"
_PT_COMPILE_ONLY_MODE = False


@contextlib.contextmanager
def env_setting(name, value):
    """``bc.env_setting("PT_COMPILE_ONLY_MODE", True)``: graphs built in it are compiled, not executed."""
    global _PT_COMPILE_ONLY_MODE
    assert name == "PT_COMPILE_ONLY_MODE"
    prev, _PT_COMPILE_ONLY_MODE = _PT_COMPILE_ONLY_MODE, value
    try:
        yield
    finally:
        _PT_COMPILE_ONLY_MODE = prev


# --- vllm/model_executor/models/gemma4_mm.py (reduced) ----------------------------------------------------------------

class Gemma4VisionConfig:
    standardize = True


class Gemma4VisionPooler:
    def __call__(self, hidden_states, pixel_position_ids, padding_positions, output_length):
        keep = (~padding_positions).to(hidden_states.dtype)                           # [1, N]
        groups = (hidden_states * keep[..., None]).view(1, output_length, -1, hidden_states.shape[-1]).sum(2)
        counts = keep.view(1, output_length, -1).sum(-1)
        pooled_states = groups / counts.clamp(min=1.0)[..., None]
        valid_mask = counts > 0
        return pooled_states, valid_mask


class Gemma4VisionModel:
    def __init__(self, gen, device):
        r = lambda *s: randn(*s, gen=gen, device=device, scale=0.5).to(DTYPE)  # noqa: E731
        self.patch_embed, self.mlp = r(PATCH_DIM, VIT_HIDDEN), r(VIT_HIDDEN, VIT_HIDDEN)
        self.pooler, self.config = Gemma4VisionPooler(), Gemma4VisionConfig()
        self.std_bias, self.std_scale = r(VIT_HIDDEN), 1.0 + r(VIT_HIDDEN).abs()

    def __call__(self, pixel_values):
        h = pixel_values @ self.patch_embed
        return h + torch.tanh(h @ self.mlp)


class Gemma4ForConditionalGeneration:
    def __init__(self, device):
        gen = generator(1744)
        r = lambda *s: randn(*s, gen=gen, device=device, scale=0.5).to(DTYPE)  # noqa: E731
        self.vision_tower = Gemma4VisionModel(gen, device)
        self.embed_vision_proj = r(VIT_HIDDEN, HIDDEN)
        self.embed_tokens, self.w_h, self.w_x, self.lm_head = r(VOCAB, HIDDEN), r(HIDDEN, HIDDEN), r(HIDDEN, HIDDEN), \
            r(HIDDEN, VOCAB)
        self.model_dtype = DTYPE
        self.state_cache = torch.zeros(MAX_NUM_REQS, HIDDEN, dtype=DTYPE, device=device)

    def embed_vision(self, inputs_embeds):
        return inputs_embeds @ self.embed_vision_proj

    def _process_image_input(self, pixel_values, pixel_position_ids):
        vt = self.vision_tower
        total_images = pixel_values.shape[0]
        last_hidden_states_map = vt(pixel_values)
        pooling_k2 = POOLING_K2
        all_valid_states: list[torch.Tensor] = [None] * total_images  # type: ignore[list-item]
        valid_lens = [0] * total_images
        for orig_idx in range(total_images):
            chunk_hidden = last_hidden_states_map[orig_idx]
            output_length = chunk_hidden.shape[0] // pooling_k2
            single_hidden = chunk_hidden.unsqueeze(0)
            single_pos_ids = pixel_position_ids[orig_idx].unsqueeze(0)
            padding_positions = (single_pos_ids == -1).all(dim=-1)
            pooled_states, valid_mask = vt.pooler(hidden_states=single_hidden, pixel_position_ids=single_pos_ids,
                                                  padding_positions=padding_positions, output_length=output_length)
            valid_states = pooled_states[valid_mask]
            if getattr(vt.config, "standardize", False):
                valid_states = (valid_states - vt.std_bias) * vt.std_scale
            all_valid_states[orig_idx] = valid_states
            valid_lens[orig_idx] = valid_states.shape[0]
        flat_valid_states = torch.cat(all_valid_states, dim=0).to(self.model_dtype)
        flat_proj_embs = self.embed_vision(inputs_embeds=flat_valid_states.unsqueeze(0)).squeeze(0)
        per_image_embeddings: list[torch.Tensor] = []
        offset = 0
        for length in valid_lens:
            per_image_embeddings.append(flat_proj_embs[offset:offset + length])
            offset += length
        return per_image_embeddings

    def embed_multimodal(self, pixel_values, pixel_position_ids):
        return self._process_image_input(pixel_values, pixel_position_ids)

    def _step(self, h, token_embeds):
        return torch.tanh(h @ self.w_h + token_embeds @ self.w_x)

    def prefill_forward(self, slot, input_ids, image_embeds):
        """Stand-in for the prompt forward: image embeddings replace the placeholder tokens, then the recurrence."""
        embeds = self.embed_tokens[input_ids]
        if image_embeds is not None:
            embeds = embeds.masked_scatter((input_ids == IMAGE_TOKEN_ID)[:, None], image_embeds)
        h = torch.zeros(1, HIDDEN, dtype=DTYPE, device=embeds.device)
        for t in range(embeds.shape[0]):
            h = self._step(h, embeds[t:t + 1])
        self.state_cache[slot:slot + 1].copy_(h)
        return h @ self.lm_head

    def decode_forward(self, input_ids):
        bs = input_ids.shape[0]
        h = self._step(self.state_cache[:bs], self.embed_tokens[input_ids])
        self.state_cache[:bs].copy_(h)
        return h @ self.lm_head


def dummy_image(width, height, num_real, device):
    """A patch grid of ``width x height`` real positions padded to MAX_PATCHES (position ids -1 on padding)."""
    gen = generator(width * 100 + height * 10 + num_real)
    pixel_values = torch.zeros(1, MAX_PATCHES, PATCH_DIM, dtype=DTYPE)
    pixel_values[0, :num_real] = torch.randn(num_real, PATCH_DIM, generator=gen, dtype=DTYPE)
    pos = torch.full((1, MAX_PATCHES, 2), -1, dtype=torch.int64)
    ys, xs = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    pos[0, :width * height] = torch.stack([xs.flatten(), ys.flatten()], dim=-1)
    pos[0, num_real:] = -1
    return pixel_values.to(device), pos.to(device)


# --- vllm_gaudi/v1/worker/hpu_model_runner.py (reduced) ---------------------------------------------------------------

class HPUModelRunner:
    def __init__(self, device, enforce_eager):
        self.device, self.enforce_eager = device, enforce_eager
        self.model = Gemma4ForConditionalGeneration(device)
        self.supports_mm_inputs, self.is_lazy = True, False        # PT_HPU_LAZY_MODE=0: torch.compile mode
        self.input_ids = torch.zeros(MAX_NUM_REQS, dtype=torch.int64, device=device)
        self.graphed_buckets, self.requests = {}, {}
        self.pool = graph_pool_handle(device)
        self.warmup_model()

    def _run_graph(self, fn, name, static):
        """Run ``fn`` as the warm-up does: compiled without execution inside PT_COMPILE_ONLY_MODE, else executed."""
        if _PT_COMPILE_ONLY_MODE:
            return capture(fn, device=self.device, pool=self.pool, warmups=0, name=name, owner="HPUModelRunner",
                           static=static, state={"state_cache": self.model.state_cache})
        fn()
        return None

    def warmup_multimodal_graphs(self, resolutions):
        for width, height in resolutions:
            pixel_values, pos = dummy_image(width, height, width * height, self.device)
            self._run_graph(lambda pv=pixel_values, p=pos: self.model.embed_multimodal(pv, p),
                            name=f"Graph/Multimodal(image) {width}x{height}", static={"pixel_values": pixel_values})

    def warmup_graphs(self, buckets):
        for bs in buckets:
            self.input_ids[:bs].fill_(0)
            self.graphed_buckets[bs] = self._run_graph(
                lambda bs=bs: self.model.decode_forward(self.input_ids[:bs]), name=f"Graph/Decode bs={bs}",
                static={"input_ids": self.input_ids})

    def warmup_model(self):
        use_torch_compile = (not self.is_lazy and not self.enforce_eager)
        mm_warmup_outside = VLLM_MM_WARMUP_OUTSIDE_COMPILE_ONLY if _variant == "fix" else False
        if self.supports_mm_inputs and (not use_torch_compile or mm_warmup_outside):
            self.warmup_multimodal_graphs(MULTIMODAL_RESOLUTIONS)

        compile_only_mode_context = lambda: env_setting("PT_COMPILE_ONLY_MODE", True)  # noqa: E731
        with compile_only_mode_context():
            if self.supports_mm_inputs and use_torch_compile and not mm_warmup_outside:
                self.warmup_multimodal_graphs(MULTIMODAL_RESOLUTIONS)
            if not self.enforce_eager:
                self.warmup_graphs(DECODE_BUCKETS)
        self.model.state_cache.zero_()

    def add_request(self, req_id, slot, prompt, image):
        self.requests[req_id] = {"slot": slot, "prompt": prompt, "image": image, "last": None}

    def _execute_mm_encoder(self, req_ids):
        images = [self.requests[r]["image"] for r in req_ids]
        pixel_values = torch.cat([pv for pv, _ in images])
        pixel_position_ids = torch.cat([pos for _, pos in images])
        return dict(zip(req_ids, self.model.embed_multimodal(pixel_values, pixel_position_ids)))

    def execute_model(self, req_ids, is_prompt):
        if is_prompt:
            mm_embeds = self._execute_mm_encoder(req_ids)
            rows = [self.model.prefill_forward(self.requests[r]["slot"],
                                               torch.tensor(self.requests[r]["prompt"], device=self.device),
                                               mm_embeds[r]) for r in req_ids]
            logits = torch.cat(rows)
        else:
            bs = len(req_ids)
            self.input_ids[:bs].copy_(torch.tensor([self.requests[r]["last"] for r in req_ids], dtype=torch.int64))
            if bs in self.graphed_buckets and self.graphed_buckets[bs] is not None:
                g, out = self.graphed_buckets[bs]
                logits = replay(g, out, real=bs, size=bs)
            else:
                logits = self.model.decode_forward(self.input_ids[:bs])
        logits = logits.clone()
        for row, r in enumerate(req_ids):
            self.requests[r]["last"] = int(logits[row, :IMAGE_TOKEN_ID].argmax())
        return logits


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    I = IMAGE_TOKEN_ID  # noqa: E741

    def serve(enforce_eager):
        runner = HPUModelRunner(device, enforce_eager)
        runner.add_request("A", 0, [2, I, I, I, 7], dummy_image(4, 4, 12, device))
        runner.add_request("B", 1, [5, I, I, 3], dummy_image(4, 2, 8, device))
        outs = [runner.execute_model(["A", "B"], is_prompt=True)]
        outs += [runner.execute_model(["A", "B"], is_prompt=False) for _ in range(3)]
        return outs

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(False), lambda: serve(True))
