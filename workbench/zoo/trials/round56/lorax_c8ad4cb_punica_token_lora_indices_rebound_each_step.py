"""Punica LoRA under CUDA graphs: ``update_metadata`` rebinds ``_token_lora_indices`` to a new tensor every step.

Upstream: https://github.com/predibase/lorax/commit/c8ad4cb37cbf00489f3d2dac0a17e899a805cbeb ("Fixed cuda graphs",
October 2024, part of the Triton-Punica conversion squash-merged as https://github.com/predibase/lorax/pull/658).
Symptom: with CUDA graphs on, decode steps of LoRA requests silently run as if no adapter (or the wrong one) were
loaded; eager decode is right. No error is raised.
Mechanism (from the diff and the code at its parent): ``PunicaWrapper.__init__`` allocates a persistent
``self._token_lora_indices`` buffer, and the LoRA layers read the property ``token_lora_indices``
(``self._token_lora_indices[:self.indices_len[0]]``) as the per-token adapter index of the bgmv shrink/expand
kernels. But ``update_metadata(meta, prefill)``, called by ``FlashCausalLM.generate_token`` every step, did
``self._token_lora_indices = meta.adapter_indices - 1``: it rebinds the attribute to a freshly allocated tensor.
``GraphWrapper.trace`` captures the decode forward after the warmup prefill, so the captured kernels hold the
address of the tensor bound then (the warmup batch's indices: adapter 0 - 1 = -1, "no LoRA"). The next step's
``update_metadata`` rebinds the attribute, the capture-time tensor loses its last owner and is freed, and every
replay keeps reading that freed block (CUDA's caching allocator leaves the old -1s there, or hands the block to a
later allocation), never the step's indices. ``GraphWrapper.forward`` refreshes the static ``input_state`` but
nothing of the Punica metadata. An eager step reads the tensor it just made.
Doctor: dangling-reference, at ``update_metadata`` (it drops the capture-time index tensor, whose memory the
captured LoRA kernels keep reading, and gives each step a new tensor the graph never sees).
Fix (upstream): ``update_metadata`` copies in place, ``self._token_lora_indices[:n].copy_(base_indices)``, and sets
``self.indices_len[0] = n``; ``GraphWrapper.trace`` builds the ``AdapterBatchMetadata`` from the static
``max_input_state`` slices and calls ``punica_wrapper.update_metadata(meta=meta, prefill=False)`` before capture;
``GraphWrapper.forward`` calls ``punica_wrapper.update_metadata(meta=adapter_data.meta, prefill=False)`` before
``graph.replay()``; ``punica_wrapper`` and ``layer_to_lora_weights`` are threaded through ``GraphCache``.
Modelled: one LoRA-wrapped projection (``qkv_proj`` of layer 0), one decode bucket, no padding.
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/predibase/lorax/commit/c8ad4cb37cbf00489f3d2dac0a17e899a805cbeb"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "update_metadata"
SYMPTOM = "LoRA decode under CUDA graphs applies the capture-time adapter indices (no LoRA) instead of each step's"

HIDDEN, RANK, VOCAB = 8, 2, 16
NUM_LORAS = 2                     # loaded adapters 1..2 (adapter index 0 = base model)
MAX_BATCH_SIZE = 8                # get_max_graph_state
BATCH_SIZE = 4                    # the traced decode bucket
MAX_NUM_BATCHED_TOKENS = 16


class PunicaWrapper:
    def __init__(self, max_num_batched_tokens: int, device: str, variant: str):
        self.variant = variant
        self._token_lora_indices = torch.empty(max_num_batched_tokens, dtype=torch.long, device=device)
        self.indices_len: list = [None] * 5
        self.is_prefill = False

    def update_metadata(self, meta: "AdapterBatchMetadata", prefill: bool):
        # token_lora_indices is adapter_indices - 1 to account for base model offset
        if self.variant == "bug":
            self._token_lora_indices = meta.adapter_indices - 1
        else:
            base_indices = meta.adapter_indices - 1
            self._token_lora_indices[:base_indices.shape[0]].copy_(base_indices)
            self.indices_len[0] = base_indices.shape[-1]
        self.is_prefill = prefill

    @property
    def token_lora_indices(self) -> torch.Tensor:
        token_lora_len = self.indices_len[0]
        return self._token_lora_indices[:token_lora_len]

    def add_lora(self, y, x, lora_a_stacked, lora_b_stacked, scale: float):
        """bgmv shrink + expand: token ``i`` uses adapter ``token_lora_indices[i]`` (-1: no LoRA)."""
        indices = self.token_lora_indices[:x.size(0)]          # the kernel reads one index per program id
        safe = indices.clamp(min=0)
        buffer = torch.einsum("th,thr->tr", x, lora_a_stacked[safe])                # bgmv_shrink
        delta = torch.einsum("tr,trh->th", buffer, lora_b_stacked[safe]) * scale    # bgmv_expand
        y.add_(delta * (indices >= 0).to(y.dtype)[:, None])


@dataclasses.dataclass
class AdapterBatchMetadata:
    adapter_indices: torch.Tensor
    adapter_list: list
    adapter_set: set


@dataclasses.dataclass
class AdapterBatchData:
    meta: AdapterBatchMetadata
    layer_to_lora_weights: dict
    punica_wrapper: PunicaWrapper
    prefill: bool


class FlashLlamaForCausalLM:
    def __init__(self, device):
        gen = generator(658)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.qkv_proj = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.5)
        self.layer_to_lora_weights = {("qkv_proj", 0): (randn(NUM_LORAS, HIDDEN, RANK, gen=gen, device=device),
                                                        randn(NUM_LORAS, RANK, HIDDEN, gen=gen, device=device))}

    def forward(self, input_ids, adapter_data: AdapterBatchData):
        x = self.embed_tokens[input_ids]
        result = x @ self.qkv_proj
        lora_a, lora_b = adapter_data.layer_to_lora_weights[("qkv_proj", 0)]
        adapter_data.punica_wrapper.add_lora(result, x, lora_a, lora_b, 1.0)
        return torch.tanh(result) @ self.lm_head


def pad_and_fill(dest: torch.Tensor, src: torch.Tensor, pad_value: int):
    dest[:src.shape[0]].copy_(src)
    dest[src.shape[0]:].fill_(pad_value)


class GraphWrapper:
    def __init__(self, graph, input_state, output_states, punica_wrapper):
        self.graph, self.input_state, self.output_states = graph, input_state, output_states
        self.punica_wrapper = punica_wrapper

    @staticmethod
    def trace(model, device, variant, batch_size, layer_to_lora_weights, punica_wrapper):
        # get_max_graph_state
        max_input_ids = torch.zeros(MAX_BATCH_SIZE, dtype=torch.long, device=device)
        max_adapter_indices = torch.zeros(MAX_BATCH_SIZE, dtype=torch.long, device=device)
        meta = AdapterBatchMetadata(adapter_indices=max_adapter_indices[:batch_size], adapter_list=[],
                                    adapter_set=set())
        if variant == "fix":
            punica_wrapper.update_metadata(meta=meta, prefill=False)
        input_ids = max_input_ids[:batch_size]
        adapter_data = AdapterBatchData(meta=meta, layer_to_lora_weights=layer_to_lora_weights,
                                        punica_wrapper=punica_wrapper, prefill=False)
        graph, output_states = capture(
            lambda: model.forward(input_ids, adapter_data), device=device, warmups=1, on_freed="reuse",
            name=f"GraphWrapper decode bs={batch_size}", owner="lorax GraphCache",
            static={"input_ids": input_ids, "adapter_indices": meta.adapter_indices})
        return GraphWrapper(graph, {"input_ids": input_ids, "adapter_data": adapter_data}, output_states,
                            punica_wrapper)

    def forward(self, input_ids, adapter_data: AdapterBatchData, variant):
        pad_and_fill(self.input_state["input_ids"], input_ids, 0)
        pad_and_fill(self.input_state["adapter_data"].meta.adapter_indices, adapter_data.meta.adapter_indices, 0)
        if variant == "fix":
            self.input_state["adapter_data"].punica_wrapper.update_metadata(meta=adapter_data.meta, prefill=False)
        out = replay(self.graph, self.output_states)
        return out[:input_ids.shape[0]]


class FlashCausalLM:
    def __init__(self, device, variant, use_graphs):
        self.device, self.variant, self.use_graphs = device, variant, use_graphs
        self.model = FlashLlamaForCausalLM(device)
        self.layer_to_lora_weights = self.model.layer_to_lora_weights
        self.punica_wrapper = PunicaWrapper(MAX_NUM_BATCHED_TOKENS, device, variant)
        self.model_graph_wrapper = None

    def warmup(self, input_ids):
        """A prefill of the warmup batch (base model only), then the graph cache traces the decode bucket."""
        self.generate_token(input_ids, [0] * input_ids.shape[0], prefill=True)
        if self.use_graphs:
            self.model_graph_wrapper = GraphWrapper.trace(self.model, self.device, self.variant, BATCH_SIZE,
                                                          self.layer_to_lora_weights, self.punica_wrapper)

    def generate_token(self, input_ids, adapter_ids, prefill=False):
        adapter_meta = AdapterBatchMetadata(
            adapter_indices=torch.tensor(adapter_ids, dtype=torch.long).to(self.device),
            adapter_list=sorted(set(adapter_ids)), adapter_set=set(adapter_ids))
        self.punica_wrapper.update_metadata(adapter_meta, prefill)
        adapter_data = AdapterBatchData(meta=adapter_meta, layer_to_lora_weights=self.layer_to_lora_weights,
                                        punica_wrapper=self.punica_wrapper, prefill=prefill)
        if self.model_graph_wrapper is not None and not prefill:
            return self.model_graph_wrapper.forward(input_ids, adapter_data, self.variant).clone()
        return self.model.forward(input_ids, adapter_data).clone()


# decode steps: (input ids, adapter index per request: 0 = base model, k = LoRA adapter k)
STEPS = [
    ([3, 7, 1, 12], [1, 2, 0, 1]),
    ([5, 2, 9, 4], [2, 2, 1, 0]),
    ([11, 6, 8, 15], [1, 0, 2, 2]),
]


def run(variant: str, device: str = "cpu"):
    warmup_ids = torch.tensor([1, 2, 3, 4], dtype=torch.long).to(device)
    steps = [(torch.tensor(ids, dtype=torch.long).to(device), adapters) for ids, adapters in STEPS]

    def serve(graphed: bool):
        lm = FlashCausalLM(device, variant, graphed)
        lm.warmup(warmup_ids)
        return [lm.generate_token(ids, adapters) for ids, adapters in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
