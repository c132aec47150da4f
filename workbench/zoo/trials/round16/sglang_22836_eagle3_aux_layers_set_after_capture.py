"""EAGLE3 target graphs are captured before the configured aux-hidden-state layers are set: replays capture the wrong layers.

Upstream: https://github.com/sgl-project/sglang/pull/22836 ("[Speculative] Fix Eagle3/DFLASH aux hidden state
capture during CUDA graph init").
Symptom: EAGLE3 speculative decoding with CUDA graphs gets a very low (or zero) acceptance length for draft
models trained on custom ``eagle_aux_hidden_state_layer_ids`` (e.g. hybrid models whose draft reads the
full-attention layers); the same server with ``--disable-cuda-graph`` accepts normally (sglang main, April 2026).
Mechanism: the target model concatenates the hidden states of ``layers_to_capture`` and hands them to the
draft model. ``LlamaModel.forward`` decides which layers to keep with a Python membership test
(``if i in self.layers_to_capture``), so a CUDA graph freezes the list it saw at capture. ``ModelRunner.initialize``
captured the decode/verify graphs (``init_device_graphs``) *before* it called
``set_eagle3_layers_to_capture(self.eagle_aux_hidden_state_layer_ids)``; as a workaround the graph runner called
``set_eagle3_layers_to_capture()`` without arguments just before capturing, which installs the default layers
``[2, n // 2, n - 3]``. After initialisation the model holds the configured layers, and every eager forward
(prefill/extend, batches above the largest graph) uses them, but every replayed decode step still concatenates
the default layers: the draft is fed features from layers it was not trained on.
Doctor: warmup-divergence, at ``initialize`` (the capture ran before the aux-layer configuration that eager steps
use; the replays keep the capture-time branch).
Fix (upstream): a new ``init_aux_hidden_state_capture()`` sets the configured layers and is called in
``initialize`` *before* ``init_device_graphs()``; the argument-less calls in the graph runner and ``_dummy_run`` are
removed.
"""
from __future__ import annotations

import bisect

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/22836"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "initialize"
SYMPTOM = "replayed decode steps hand the EAGLE3 draft the default layers' hidden states, not the configured ones"
VOCAB, HIDDEN, NUM_LAYERS = 13, 4, 8
CUDA_GRAPH_BS = [1, 2, 4]
EAGLE_AUX_HIDDEN_STATE_LAYER_IDS = [0, 3, 5]      # from the draft's config (HF "after layer k" ids)


class LlamaModel:
    def __init__(self, device):
        gen = generator(22836)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.pos_emb = randn(32, HIDDEN, gen=gen, device=device, scale=0.3)
        self.layers = [randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6) for _ in range(NUM_LAYERS)]
        self.layers_to_capture: list[int] = []

    def forward(self, input_ids, positions):
        hidden_states = self.embed_tokens[input_ids] + self.pos_emb[positions]
        aux_hidden_states = []
        for i in range(NUM_LAYERS):
            if i in self.layers_to_capture:                      # a Python branch: frozen by a capture
                aux_hidden_states.append(hidden_states)
            hidden_states = hidden_states + torch.tanh(hidden_states @ self.layers[i])
        if len(aux_hidden_states) == 0:
            return hidden_states
        return hidden_states, aux_hidden_states


class LlamaForCausalLM:
    def __init__(self, device):
        self.model = LlamaModel(device)
        self.lm_head = randn(HIDDEN, VOCAB, gen=generator(1), device=device, scale=0.5)
        self.capture_aux_hidden_states = False

    def set_eagle3_layers_to_capture(self, layer_ids=None):
        self.capture_aux_hidden_states = True
        if layer_ids is None:
            num_layers = NUM_LAYERS
            self.model.layers_to_capture = [2, num_layers // 2, num_layers - 3]   # Specific layers for EAGLE3
        else:
            self.model.layers_to_capture = [val + 1 for val in layer_ids]

    def forward(self, input_ids, positions):
        aux_hidden_states = None
        hidden_states = self.model.forward(input_ids, positions)
        if self.capture_aux_hidden_states:
            hidden_states, aux_hidden_states = hidden_states
        # LogitsProcessor: CaptureHiddenMode.FULL hands the draft the concatenated aux hidden states
        next_token_logits = hidden_states @ self.lm_head
        draft_hidden = torch.cat(aux_hidden_states, dim=-1) if aux_hidden_states else hidden_states
        return next_token_logits, draft_hidden


class CudaGraphRunner:
    def __init__(self, model_runner):
        self.model_runner = model_runner
        self.device = model_runner.device
        self.max_bs = CUDA_GRAPH_BS[-1]
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(self.max_bs, dtype=torch.long, device=self.device)
        self.graphs, self.output_buffers = {}, {}
        self.pool = graph_pool_handle(self.device)
        # Speculative_inference
        if model_runner.eagle_use_aux_hidden_state and model_runner.variant == "bug":
            self.model_runner.model.set_eagle3_layers_to_capture()        # the workaround the fix removes
        self.capture()

    def capture(self):
        for bs in reversed(CUDA_GRAPH_BS):
            def run_once(bs=bs):
                return self.model_runner.model.forward(self.input_ids[:bs], self.positions[:bs])
            self.graphs[bs], self.output_buffers[bs] = capture(
                run_once, device=self.device, pool=self.pool, name=f"decode bs={bs}",
                static={"input_ids": self.input_ids, "positions": self.positions}, owner="CudaGraphRunner")

    def can_run(self, raw_bs):
        return raw_bs <= self.max_bs

    def replay(self, input_ids, positions):
        raw_bs = input_ids.shape[0]
        bs = CUDA_GRAPH_BS[bisect.bisect_left(CUDA_GRAPH_BS, raw_bs)]
        self.input_ids.zero_()
        self.positions.zero_()
        self.input_ids[:raw_bs].copy_(input_ids)
        self.positions[:raw_bs].copy_(positions)
        logits, hidden = replay(self.graphs[bs], self.output_buffers[bs], real=raw_bs, size=bs)
        return logits[:raw_bs], hidden[:raw_bs]


class ModelRunner:
    def __init__(self, device, variant, disable_cuda_graph):
        self.device, self.variant = device, variant
        self.disable_cuda_graph = disable_cuda_graph
        self.model = LlamaForCausalLM(device)
        self.eagle_use_aux_hidden_state = True
        self.eagle_aux_hidden_state_layer_ids = EAGLE_AUX_HIDDEN_STATE_LAYER_IDS
        self.graph_runner = None

    def init_aux_hidden_state_capture(self):
        if self.eagle_use_aux_hidden_state:
            self.model.set_eagle3_layers_to_capture(self.eagle_aux_hidden_state_layer_ids)

    def init_device_graphs(self):
        self.graph_runner = None
        if self.disable_cuda_graph:
            return
        self.graph_runner = CudaGraphRunner(self)

    def initialize(self):
        if self.variant == "fix":
            self.init_aux_hidden_state_capture()        # before the graphs are captured
        self.init_device_graphs()
        if self.variant == "bug" and self.eagle_use_aux_hidden_state:
            self.model.set_eagle3_layers_to_capture(self.eagle_aux_hidden_state_layer_ids)

    def forward_extend(self, input_ids, positions):
        return self.model.forward(input_ids, positions)           # prefill runs eagerly

    def forward_decode(self, input_ids, positions):
        if self.graph_runner is not None and self.graph_runner.can_run(input_ids.shape[0]):
            return self.graph_runner.replay(input_ids, positions)
        return self.model.forward(input_ids, positions)


def run(variant: str, device: str = "cpu"):
    prompt = torch.tensor([3, 7, 1, 9, 4, 2], device=device)
    prompt_positions = torch.arange(6, device=device)

    def serve(disable_cuda_graph: bool):
        model_runner = ModelRunner(device, variant, disable_cuda_graph)
        model_runner.initialize()
        outs = []
        logits, draft_hidden = model_runner.forward_extend(prompt, prompt_positions)
        outs += [logits.clone(), draft_hidden.clone()]
        # three requests decode together (padded to the bs=4 graph), target-verify style
        input_ids = torch.tensor([5, 8, 11], device=device)
        positions = torch.tensor([6, 3, 9], device=device)
        for _ in range(3):
            logits, draft_hidden = model_runner.forward_decode(input_ids, positions)
            outs += [logits.clone(), draft_hidden.clone()]     # the draft model consumes draft_hidden
            input_ids = logits.argmax(-1)
            positions = positions + 1
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(False), lambda: serve(True))
