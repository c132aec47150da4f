"""Qwen3-VL's deepstack visual features are dropped by a decoder graph captured on a text-only dummy run.

Upstream: https://github.com/vllm-project/vllm/pull/43617 ("Fix Qwen3-VL and Qwen3-omni-thinker accuracy
degradation from deepstack inputs under torch.compile").
Symptom: large accuracy drop (Geo3K) for Qwen3-VL under the default compiled / CUDA-graph serving path,
while eager / no-compile execution gave the expected results; text-only Qwen3 models were unaffected.
Mechanism: ``Qwen3VLForConditionalGeneration`` keeps persistent ``deepstack_input_embeds`` buffers (one per
deepstack level) that ``embed_input_ids`` fills through ``_set_deepstack_input_embeds`` (recording
``deepstack_input_embeds_num_tokens``) and that ``forward`` hands to the decoder via
``_get_deepstack_input_embeds``, which returned ``None`` whenever ``deepstack_input_embeds_num_tokens == 0``.
Warmup/profiling and graph capture run dummy batches without images, so the decoder graph is built on the
no-deepstack path: the per-layer ``hidden_states + deepstack_input_embeds_{i}`` additions are not in it.
Later image requests replay that graph; ``_get_deepstack_input_embeds`` now returns the filled buffers, but
the replay runs only the captured kernels, so the visual features are never added. Eager adds them.
Doctor: warmup-divergence, at ``_get_deepstack_input_embeds`` (its capture-time ``None`` decided the
decoder graph's branch; replays reuse it while an eager step now takes the deepstack branch).
Fix (upstream): ``_get_deepstack_input_embeds`` always returns ``IntermediateTensors`` views of the
persistent buffers when they exist (zero-backed for text-only / dummy runs), so the captured decoder always
contains the additions and reads the buffers the next multimodal step fills; resizing was factored into
``_resize_deepstack_input_embeds``.
Source read: the PR description and the post-fix ``_get/_set/_clear_deepstack_input_embeds`` and
``forward`` (Qwen3-Omni thinker, same helpers); the pre-fix ``None`` return is taken from the description.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/43617"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "_get_deepstack_input_embeds"
SYMPTOM = "Qwen3-VL accuracy drops under CUDA graphs: deepstack visual features never added on replay"

VOCAB, HIDDEN, NUM_LAYERS, DEEPSTACK_NUM_LEVEL = 16, 4, 3, 2
MAX_NUM_BATCHED_TOKENS = 8
CAPTURE_SIZE = 4                         # one piecewise capture size (num_tokens)
IMAGE_TOKEN_ID = 15


class IntermediateTensors(dict):
    """``vllm.sequence.IntermediateTensors``: named tensors handed between model parts."""


class Qwen3LLMModel:
    """The decoder (``language_model.model``), the part ``@support_torch_compile`` compiles and graphs."""

    def __init__(self, device):
        gen = generator(43617)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.layers = [randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6) for _ in range(NUM_LAYERS)]
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.6)

    def __call__(self, inputs_embeds, deepstack_input_embeds):
        hidden_states = inputs_embeds
        for layer_idx, w in enumerate(self.layers):
            hidden_states = torch.tanh(hidden_states @ w)
            if deepstack_input_embeds is not None and layer_idx < DEEPSTACK_NUM_LEVEL:
                hidden_states = hidden_states + deepstack_input_embeds[f"deepstack_input_embeds_{layer_idx}"]
        return hidden_states


class CUDAGraphWrapper:
    """``vllm/compilation/cuda_graph.py``: one captured graph per ``num_tokens``; a replay does not copy or
    check its inputs (the runner guarantees persistent addresses), it re-runs the captured kernels."""

    def __init__(self, runnable, device, static):
        self.runnable, self.device, self.static = runnable, device, static
        self.entries = {}

    def __call__(self, inputs_embeds, deepstack_input_embeds, capturing=False):
        num_tokens = inputs_embeds.shape[0]
        entry = self.entries.get(num_tokens)
        if entry is None:
            if not capturing:
                return self.runnable(inputs_embeds, deepstack_input_embeds)
            static = {"inputs_embeds": self.static["inputs_embeds"]}
            if deepstack_input_embeds is not None:       # the decoder graph reads the deepstack buffers
                static.update({f"deepstack_input_embeds_{i}": b for i, b in enumerate(self.static["deepstack"])})
            entry = capture(lambda: self.runnable(inputs_embeds, deepstack_input_embeds), device=self.device,
                            static=static, owner="CUDAGraphWrapper (Qwen3 decoder)")
            self.entries[num_tokens] = entry
            return entry[1]
        graph, out = entry
        return replay(graph, out)


class Qwen3VLForConditionalGeneration:
    def __init__(self, device, variant):
        self.variant = variant
        self.language_model_model = Qwen3LLMModel(device)
        # register buffer for deepstack
        self.deepstack_input_embeds = [torch.zeros(MAX_NUM_BATCHED_TOKENS, HIDDEN, device=device)
                                       for _ in range(DEEPSTACK_NUM_LEVEL)]
        self.deepstack_input_embeds_num_tokens = 0

    def _get_deepstack_input_embeds(self, num_tokens):
        if self.variant == "bug" and self.deepstack_input_embeds_num_tokens == 0:
            return None                                  # dummy / text-only step: no deepstack path
        if num_tokens > self.deepstack_input_embeds[0].size(0):
            self._resize_deepstack_input_embeds(num_tokens)
        return IntermediateTensors({f"deepstack_input_embeds_{idx}": self.deepstack_input_embeds[idx][:num_tokens]
                                    for idx in range(DEEPSTACK_NUM_LEVEL)})

    def _resize_deepstack_input_embeds(self, num_tokens):
        self.deepstack_input_embeds = [torch.zeros(num_tokens, HIDDEN, device=b.device, dtype=b.dtype)
                                       for b in self.deepstack_input_embeds]

    def _set_deepstack_input_embeds(self, deepstack_input_embeds):
        num_tokens = deepstack_input_embeds.size(1)
        if num_tokens > self.deepstack_input_embeds[0].size(0):
            self._resize_deepstack_input_embeds(num_tokens)
        for idx in range(DEEPSTACK_NUM_LEVEL):
            self.deepstack_input_embeds[idx][:num_tokens].copy_(deepstack_input_embeds[idx])
        self.deepstack_input_embeds_num_tokens = num_tokens

    def _clear_deepstack_input_embeds(self, num_tokens):
        if self.deepstack_input_embeds_num_tokens == 0:
            return
        if num_tokens > 0:
            for idx in range(DEEPSTACK_NUM_LEVEL):
                self.deepstack_input_embeds[idx][:num_tokens].zero_()
        self.deepstack_input_embeds_num_tokens = 0

    def embed_input_ids(self, input_ids, multimodal_embeddings=None, is_multimodal=None):
        """Text embeddings; vision rows take the main-scale feature, the multi-scale rest goes to deepstack."""
        inputs_embeds = self.language_model_model.embed_tokens[input_ids]
        if multimodal_embeddings is None:
            return inputs_embeds
        main, multiscale = torch.split(multimodal_embeddings, [HIDDEN, DEEPSTACK_NUM_LEVEL * HIDDEN], dim=-1)
        inputs_embeds = inputs_embeds.clone()
        inputs_embeds[is_multimodal] = main
        deepstack = inputs_embeds.new_zeros(inputs_embeds.size(0), DEEPSTACK_NUM_LEVEL * HIDDEN)
        deepstack[is_multimodal] = multiscale
        deepstack = deepstack.view(-1, DEEPSTACK_NUM_LEVEL, HIDDEN).permute(1, 0, 2).contiguous()
        self._set_deepstack_input_embeds(deepstack)
        return inputs_embeds

    def forward(self, inputs_embeds, capturing=False):
        deepstack_input_embeds = self._get_deepstack_input_embeds(inputs_embeds.size(0))
        if isinstance(self.language_model_model_runnable, CUDAGraphWrapper):
            hidden_states = self.language_model_model_runnable(inputs_embeds, deepstack_input_embeds, capturing)
        else:
            hidden_states = self.language_model_model_runnable(inputs_embeds, deepstack_input_embeds)
        self._clear_deepstack_input_embeds(inputs_embeds.size(0))
        return hidden_states

    def compute_logits(self, hidden_states):
        return hidden_states @ self.language_model_model.lm_head


class GPUModelRunner:
    def __init__(self, device, variant, graphed):
        self.device = device
        self.model = Qwen3VLForConditionalGeneration(device, variant)
        self.inputs_embeds = torch.zeros(MAX_NUM_BATCHED_TOKENS, HIDDEN, device=device)
        if graphed:
            self.model.language_model_model_runnable = CUDAGraphWrapper(
                self.model.language_model_model, device,
                static={"inputs_embeds": self.inputs_embeds, "deepstack": self.model.deepstack_input_embeds})
            self.capture_model()
        else:
            self.model.language_model_model_runnable = self.model.language_model_model

    def _dummy_run(self, num_tokens, capturing):
        """Profiling / capture dummy batch: text only, so no deepstack payload is set."""
        self.inputs_embeds[:num_tokens].zero_()
        return self.model.forward(self.inputs_embeds[:num_tokens], capturing=capturing)

    def capture_model(self):
        self._dummy_run(CAPTURE_SIZE, capturing=True)

    def execute_model(self, input_ids, mm_embeds=None, is_mm=None):
        n = len(input_ids)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        if mm_embeds is not None:
            is_mm = torch.tensor(is_mm, device=self.device)
        inputs_embeds = self.model.embed_input_ids(ids, mm_embeds, is_mm)
        self.inputs_embeds[:n].copy_(inputs_embeds)
        hidden_states = self.model.forward(self.inputs_embeds[:n])
        return self.model.compute_logits(hidden_states).clone()


def run(variant: str, device: str = "cpu"):
    gen = generator(436170)
    image = randn(2, (1 + DEEPSTACK_NUM_LEVEL) * HIDDEN, gen=gen, device=device)   # vision tower output

    def serve(graphed: bool):
        runner = GPUModelRunner(device, variant, graphed)
        outs = [runner.execute_model([3, IMAGE_TOKEN_ID, IMAGE_TOKEN_ID, 7], image, [False, True, True, False])]
        outs.append(runner.execute_model([5, 9, 2, 11]))                    # text-only chunk
        outs.append(runner.execute_model([IMAGE_TOKEN_ID, IMAGE_TOKEN_ID, 1, 4], image * 0.5,
                                         [True, True, False, False]))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
