"""Qwen3-VL under PIECEWISE CUDA graphs: ``_get_deepstack_input_embeds`` is called with the graph's padded token count, but the deepstack buffer recorded only the scheduled (unpadded) count, and a strict boundary check kills the engine.

Upstream: https://github.com/vllm-project/vllm/pull/40932 ("[Bugfix] Remove invalid deepstack boundary check for
Qwen3-VL", vllm-project/vllm, merged; description dated 2026-04-26). Read: the PR description ("Fix
https://github.com/vllm-project/vllm/pull/40145#issuecomment-4322495739 - This boundary check is invalid under heavy
load"); the vllm-omni hotfix that monkey-patches the same two methods until its vLLM pin passes #40932
(vllm-project/vllm-omni PR 3342 and its patch code: the comment explaining the mechanism - "_preprocess calls
embed_input_ids on the unpadded scheduled-token length, then runs forward on the CUDA-graph padded length ... The original
strict check `num_tokens > self.deepstack_input_embeds_num_tokens` raises ValueError whenever scheduled tokens don't
already sit on a CUDA-graph bucket boundary (e.g. ... 309 scheduled tokens padded to 320) ... Tail rows are
zero-initialised and the per-position add of zero is a no-op, so dropping the guard is safe" - and its replacement
``_get_deepstack_input_embeds`` / ``_clear_deepstack_input_embeds``, "semantically equivalent to upstream PR #40932");
the error text reported in vllm issue 41485 and vllm-omni issue 3257 ("Requested more deepstack tokens than available in
buffer: num_tokens=16 > self.deepstack_input_embeds_num_tokens=9", "320 > 309"); and a later stored
``vllm/model_executor/models/qwen3_vl.py`` (buffers allocated to ``max_num_batched_tokens``, ``_set_deepstack_input_embeds``
recording ``deepstack_input_embeds_num_tokens``, ``_clear_deepstack_input_embeds``). The PR's diff was not read: the removed
check is reconstructed from the error message and the hotfix's comment; ``embed_input_ids`` /
``_compute_deepstack_embeds`` and the runner's ``_preprocess`` are reconstructed from the hotfix's description and the
stored model file.
Symptom: Qwen3-VL / Qwen3-VL-MoE (and the Qwen3-Omni thinker) served with CUDA graphs die with "ValueError: Requested
more deepstack tokens than available in buffer" (EngineDeadError) on multimodal steps whose scheduled token count is not
a capture size; with ``--enforce-eager`` the same requests are served.
Mechanism: the runner embeds the scheduled tokens (``num_scheduled_tokens`` rows) and ``embed_input_ids`` stores the
image tokens' multi-level deepstack features in persistent buffers, recording that count. The runner then pads the
step to a captured size and calls ``forward`` on ``inputs_embeds[:num_input_tokens]``, so ``_get_deepstack_input_embeds``
is asked for the padded count and its check ``num_tokens > deepstack_input_embeds_num_tokens`` raises. Eagerly the
step is not padded and the counts agree.
Doctor: padded-shape-mismatch, at _get_deepstack_input_embeds. Code run at the graph's padded token count combines the
padded rows it is asked for with a valid span recorded for the real (scheduled) rows only, and the shape check between
the two raises.
Fix (upstream): drop the check; return ``deepstack_input_embeds[idx][:num_tokens]`` for the padded count (the buffers
are allocated to ``max_num_batched_tokens`` and the rows past the scheduled ones hold zeros, cleared after every step).
Modelled: ``Qwen3VLForConditionalGeneration`` (``embed_multimodal``, ``embed_input_ids`` with
``_compute_deepstack_embeds``, ``_set_deepstack_input_embeds``, ``_get_deepstack_input_embeds``,
``_clear_deepstack_input_embeds``, ``forward``), the language model's deepstack additions after its first layers, a
``GPUModelRunner`` whose ``_preprocess`` embeds the scheduled tokens into the persistent ``inputs_embeds`` buffer and pads
to ``cudagraph_capture_sizes``, and a CUDAGraphWrapper-style PIECEWISE stand-in capturing the language model once per
token count into one global graph pool (capture at start-up, largest first). Stand-ins: the vision tower (one linear
layer + tanh over patch features, giving main + 2 deepstack levels), a language model of 3 residual MLP decoder layers
with a position embedding (hidden 8, vocab 16, float64; no attention, the bug is in host-side bookkeeping), greedy
sampling. The captured language model reads the deepstack buffers through views handed to it at capture (a text-only
step leaves them zero, which adds nothing, as passing None does eagerly); upstream's separate handling of None at warmup
is not modelled.
Workload: capture sizes [2, 4, 8, 16]; A (text, 5 tokens) prefills (padded to 8), B (7 tokens, one 4-token image)
prefills (padded to 8), A and B decode (2), C (10 tokens, two 2- and 3-token images) prefills with A and B decoding (12
padded to 16), then A, B, C decode twice (3, padded to 4). The bug raises the engine's ValueError at B's prefill
("num_tokens=8 > self.deepstack_input_embeds_num_tokens=7"); the fix equals eager on every step (logits of all scheduled
tokens compared).
"""
from __future__ import annotations

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/40932"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "_get_deepstack_input_embeds"
SYMPTOM = ("Qwen3-VL with CUDA graphs: a multimodal step whose token count is padded to a capture size asks the deepstack "
           "buffer for the padded count, the boundary check against the unpadded count raises 'Requested more deepstack "
           "tokens than available in buffer' and the engine dies; eager mode serves it")

HIDDEN = 8                      # text hidden size == vision out_hidden_size (visual_dim)
VOCAB = 16
IMAGE_TOKEN_ID = VOCAB - 1
PATCH_DIM = 6
DEEPSTACK_NUM_LEVEL = 2         # deepstack_visual_indexes
NUM_LAYERS = 3
MAX_NUM_BATCHED_TOKENS = 16
MAX_POSITION = 32
CUDAGRAPH_CAPTURE_SIZES = [2, 4, 8, 16]

_variant = "bug"


class IntermediateTensors(dict):
    """vllm.sequence.IntermediateTensors (a dict of named tensors)."""


# --- the model ---------------------------------------------------------------------------------------------------------

class Qwen3VisionTransformer:
    """Stand-in vision tower: per patch, the main embedding and one feature per deepstack level, concatenated."""

    def __init__(self, gen, device):
        self.w = randn(PATCH_DIM, HIDDEN * (1 + DEEPSTACK_NUM_LEVEL), gen=gen, device=device, scale=0.6).double()

    def __call__(self, pixel_values):
        return torch.tanh(pixel_values @ self.w)


class Qwen3LLMModel:
    """Stand-in decoder: residual MLP layers; deepstack level ``i`` is added after layer ``i``."""

    def __init__(self, gen, device):
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).double()
        self.embed_tokens = r(VOCAB, HIDDEN, scale=1.0)
        self.pos_embed = r(MAX_POSITION, HIDDEN, scale=0.3)
        self.layers = [(r(HIDDEN, HIDDEN), r(HIDDEN, HIDDEN)) for _ in range(NUM_LAYERS)]

    def embed_input_ids(self, input_ids):
        return self.embed_tokens[input_ids]

    def __call__(self, positions, inputs_embeds, deepstack_input_embeds=None):
        hidden_states = inputs_embeds + self.pos_embed[positions]
        for layer_idx, (w1, w2) in enumerate(self.layers):
            hidden_states = hidden_states + torch.tanh(hidden_states @ w1) @ w2
            if deepstack_input_embeds is not None and layer_idx < len(deepstack_input_embeds):
                hidden_states = hidden_states + deepstack_input_embeds[f"deepstack_input_embeds_{layer_idx}"]
        return hidden_states


class Qwen3VLForConditionalGeneration:
    def __init__(self, device):
        gen = generator(40932)
        self.visual = Qwen3VisionTransformer(gen, device)
        self.language_model = Qwen3LLMModel(gen, device)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.8).double()
        self.use_deepstack = True
        self.deepstack_num_level = DEEPSTACK_NUM_LEVEL
        self.visual_dim = HIDDEN
        self.multiscale_dim = self.visual_dim * self.deepstack_num_level
        self.deepstack_input_embeds = [
            torch.zeros(MAX_NUM_BATCHED_TOKENS, HIDDEN, dtype=torch.float64, device=device)
            for _ in range(self.deepstack_num_level)
        ]
        # Tracks the valid token span currently stored in the buffer.
        self.deepstack_input_embeds_num_tokens = 0

    # -- multimodal embedding --------------------------------------------------------------------------------------------
    def embed_multimodal(self, pixel_values_list):
        return [self.visual(pixel_values) for pixel_values in pixel_values_list]

    def _compute_deepstack_embeds(self, inputs_embeds, multimodal_embeddings, is_multimodal):
        visual_lens = [x.shape[0] for x in multimodal_embeddings]
        multimodal_embeddings_cat = torch.cat(multimodal_embeddings, dim=0)
        main, multiscale = torch.split(multimodal_embeddings_cat, [self.visual_dim, self.multiscale_dim], dim=-1)
        deepstack_input_embeds = inputs_embeds.new_zeros(inputs_embeds.size(0), self.multiscale_dim)
        deepstack_input_embeds[is_multimodal] = multiscale
        deepstack_input_embeds = deepstack_input_embeds.view(inputs_embeds.shape[0], self.deepstack_num_level,
                                                             self.visual_dim).permute(1, 0, 2)
        return deepstack_input_embeds, torch.split(main, visual_lens, dim=0)

    def embed_input_ids(self, input_ids, multimodal_embeddings=None, *, is_multimodal=None):
        inputs_embeds = self.language_model.embed_input_ids(input_ids)
        if not multimodal_embeddings:
            return inputs_embeds
        deepstack_input_embeds, multimodal_embeddings = self._compute_deepstack_embeds(
            inputs_embeds, multimodal_embeddings, is_multimodal)
        inputs_embeds = inputs_embeds.clone()
        inputs_embeds[is_multimodal] = torch.cat(multimodal_embeddings, dim=0)
        self._set_deepstack_input_embeds(deepstack_input_embeds)
        return inputs_embeds

    # -- the deepstack buffer ----------------------------------------------------------------------------------------------
    def _set_deepstack_input_embeds(self, deepstack_input_embeds):
        num_tokens = deepstack_input_embeds.size(1)
        for idx in range(self.deepstack_num_level):
            self.deepstack_input_embeds[idx][:num_tokens].copy_(deepstack_input_embeds[idx])
        self.deepstack_input_embeds_num_tokens = num_tokens

    def _get_deepstack_input_embeds(self, num_tokens):
        if self.deepstack_input_embeds_num_tokens == 0:
            return None
        if _variant == "bug" and num_tokens > self.deepstack_input_embeds_num_tokens:
            raise ValueError(
                "Requested more deepstack tokens than available in buffer: "
                f"num_tokens={num_tokens} > self.deepstack_input_embeds_num_tokens="
                f"{self.deepstack_input_embeds_num_tokens}")
        return IntermediateTensors({
            f"deepstack_input_embeds_{idx}": self.deepstack_input_embeds[idx][:num_tokens]
            for idx in range(self.deepstack_num_level)
        })

    def _clear_deepstack_input_embeds(self, num_tokens):
        if self.deepstack_input_embeds_num_tokens == 0:
            return
        if num_tokens > 0:
            for idx in range(self.deepstack_num_level):
                self.deepstack_input_embeds[idx][:num_tokens].zero_()
            self.deepstack_input_embeds_num_tokens = 0

    def forward(self, positions, inputs_embeds, language_model_runner=None):
        deepstack_input_embeds = self._get_deepstack_input_embeds(inputs_embeds.size(0))
        run = language_model_runner or self.language_model
        hidden_states = run(positions, inputs_embeds, deepstack_input_embeds)
        self._clear_deepstack_input_embeds(inputs_embeds.size(0))
        return hidden_states

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head


# --- the runner --------------------------------------------------------------------------------------------------------

class CUDAGraphWrapper:
    """PIECEWISE stand-in: one graph of the language model per token count, all in the global graph pool. On replay the
    arguments are views of the same persistent buffers the capture saw."""

    def __init__(self, runner):
        self.runner = runner
        self.graphs = {}
        self.num_tokens = None
        pool = graph_pool_handle(runner.device)
        model, lm = runner.model, runner.model.language_model
        for n in sorted(CUDAGRAPH_CAPTURE_SIZES, reverse=True):
            deepstack_views = IntermediateTensors({f"deepstack_input_embeds_{idx}": model.deepstack_input_embeds[idx][:n]
                                                   for idx in range(DEEPSTACK_NUM_LEVEL)})
            fn = (lambda n=n, d=deepstack_views: lm(runner.positions[:n], runner.inputs_embeds[:n], d))
            static = {"positions": runner.positions, "inputs_embeds": runner.inputs_embeds}
            static.update({f"deepstack_input_embeds_{i}": b for i, b in enumerate(model.deepstack_input_embeds)})
            self.graphs[n] = capture(fn, device=runner.device, pool=pool, name=f"language_model [{n}]",
                                     owner="GPUModelRunner", static=static)

    def __call__(self, positions, inputs_embeds, deepstack_input_embeds):
        n = inputs_embeds.size(0)
        g, out = self.graphs[n]
        padded = {"positions": self.runner.positions, "inputs_embeds": self.runner.inputs_embeds}
        padded.update({f"deepstack_input_embeds_{i}": b
                       for i, b in enumerate(self.runner.model.deepstack_input_embeds)})
        return replay(g, out, real=self.num_tokens, size=n, padded=padded)


class GPUModelRunner:
    def __init__(self, device, use_cuda_graph):
        self.device = device
        self.model = Qwen3VLForConditionalGeneration(device)
        self.input_ids = torch.zeros(MAX_NUM_BATCHED_TOKENS, dtype=torch.int64, device=device)
        self.positions = torch.zeros(MAX_NUM_BATCHED_TOKENS, dtype=torch.int64, device=device)
        self.inputs_embeds = torch.zeros(MAX_NUM_BATCHED_TOKENS, HIDDEN, dtype=torch.float64, device=device)
        self.cudagraph_wrapper = CUDAGraphWrapper(self) if use_cuda_graph else None

    def _get_num_input_tokens(self, num_scheduled_tokens):
        if self.cudagraph_wrapper is None:
            return num_scheduled_tokens
        return next(s for s in sorted(CUDAGRAPH_CAPTURE_SIZES) if s >= num_scheduled_tokens)

    def _preprocess(self, scheduled, num_scheduled_tokens, num_input_tokens):
        input_ids = torch.tensor([t for req in scheduled for t in req["token_ids"]], dtype=torch.int64)
        positions = torch.tensor([p for req in scheduled for p in req["positions"]], dtype=torch.int64)
        self.input_ids[:num_scheduled_tokens].copy_(input_ids.to(self.device))
        self.positions[:num_scheduled_tokens].copy_(positions.to(self.device))
        mm_inputs = [pv for req in scheduled for pv in req.get("pixel_values", [])]
        mm_embeds = self.model.embed_multimodal(mm_inputs) if mm_inputs else None
        is_multimodal = self.input_ids[:num_scheduled_tokens] == IMAGE_TOKEN_ID
        inputs_embeds_scheduled = self.model.embed_input_ids(self.input_ids[:num_scheduled_tokens], mm_embeds,
                                                             is_multimodal=is_multimodal)
        self.inputs_embeds[:num_scheduled_tokens].copy_(inputs_embeds_scheduled)
        return self.positions[:num_input_tokens], self.inputs_embeds[:num_input_tokens]

    def execute_model(self, scheduled):
        num_scheduled_tokens = sum(len(req["token_ids"]) for req in scheduled)
        num_input_tokens = self._get_num_input_tokens(num_scheduled_tokens)
        positions, inputs_embeds = self._preprocess(scheduled, num_scheduled_tokens, num_input_tokens)
        if self.cudagraph_wrapper is not None:
            self.cudagraph_wrapper.num_tokens = num_scheduled_tokens
        hidden_states = self.model.forward(positions, inputs_embeds, self.cudagraph_wrapper)
        return self.model.compute_logits(hidden_states[:num_scheduled_tokens])


# --- workload ----------------------------------------------------------------------------------------------------------

def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    img = lambda gen, n: torch.randn(n, PATCH_DIM, generator=gen, dtype=torch.float64)

    def serve(use_cuda_graph):
        runner = GPUModelRunner(device, use_cuda_graph)
        gen = generator(409320)
        I = IMAGE_TOKEN_ID
        prompts = {
            "A": {"token_ids": [3, 5, 7, 2, 9], "images": []},
            "B": {"token_ids": [4, I, I, I, I, 6, 1], "images": [img(gen, 4)]},
            "C": {"token_ids": [I, I, 8, I, I, I, 3, 2, 5, 11], "images": [img(gen, 2), img(gen, 3)]},
        }
        lengths, last = {}, {}

        def prefill(name):
            p = prompts[name]
            lengths[name] = len(p["token_ids"])
            return {"name": name, "token_ids": p["token_ids"], "positions": list(range(lengths[name])),
                    "pixel_values": [x.to(device) for x in p["images"]]}

        def decode(name):
            lengths[name] += 1
            return {"name": name, "token_ids": [last[name]], "positions": [lengths[name] - 1]}

        schedule = [["A"], ["B"], ["A", "B"], ["C", "A", "B"], ["A", "B", "C"], ["A", "B", "C"]]
        outs, seen = [], set()
        for step in schedule:
            batch = [decode(n) if n in seen else prefill(n) for n in step]
            seen.update(step)
            logits = runner.execute_model(batch)
            outs.append(logits.clone())
            ends = torch.tensor([len(r["token_ids"]) for r in batch]).cumsum(0) - 1
            for req, row in zip(batch, ends.tolist()):
                last[req["name"]] = int(logits[row].argmax())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
