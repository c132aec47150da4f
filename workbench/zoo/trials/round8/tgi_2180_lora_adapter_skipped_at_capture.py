"""Decode graphs captured without adapter data: every replay serves the base model to LoRA requests.

Upstream: https://github.com/huggingface/text-generation-inference/pull/2180 ("feat: simple mistral lora
integration tests", commit 5a650669: "fix: disable cuda graphs with lora and warn"). The author on the
bug: "currently the adapter is ignored because now adapter_data is passed to model.forward and is not
included in warmup".
Symptom: with ``--lora-adapters`` and CUDA graphs on (the default), decode steps of requests that name an
adapter generate the base model's tokens; the integration tests had to run with ``cuda_graphs=[0]``
(text-generation-inference main, July 2024).
Mechanism: ``FlashCausalLM.cuda_graph_warmup`` warms up and captures ``model.forward`` for each batch size
without ``adapter_data``, so in every ``LoraLinear.forward_layer_type`` the Python check
``if adapter_data is None: return result`` skips the LoRA matmuls during the capture and the graph holds
the base projection only. ``FlashCausalLM.forward`` passes ``adapter_data`` to the eager path (prefill,
batches above the largest graph) but a decode batch that fits a graph only copies ids and positions into
the static buffers and replays: the adapter is silently dropped.
Doctor: warmup-divergence, at ``forward_layer_type`` (the branch decided once, at capture).
Fix (upstream): when LoRA adapters are loaded, ``serve`` sets ``CUDA_GRAPHS = None`` (with a warning), so no
graph is captured and decode runs eagerly with the adapter data.
"""
from __future__ import annotations

import torch

from workbench.engine import CUDAGraphMode, GraphManager
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/huggingface/text-generation-inference/pull/2180"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "forward_layer_type"
SYMPTOM = "LoRA requests decoded by a graph get the base model's logits (adapter ignored)"
VOCAB, DIM, RANK, MAX_POS = 11, 4, 2, 16
BASE, ADAPTER = 0, 1                          # adapter index 0 is the base model


class AdapterBatchMetadata:
    def __init__(self, adapter_indices, adapter_set):
        self.adapter_indices = adapter_indices        # per row
        self.adapter_set = adapter_set


class AdapterBatchData:
    def __init__(self, meta, data):
        self.meta = meta
        self.data = data                              # layer_type -> {"lora": BatchLoraWeights}


class BatchLoraWeights:
    def __init__(self, lora_a: dict, lora_b: dict):
        self.lora_a, self.lora_b = lora_a, lora_b

    def has_adapter(self, adapter_index):
        return adapter_index in self.lora_a


class LoraLinear:
    def __init__(self, weight, layer_id=0):
        self.weight = weight
        self.layer_id = layer_id

    def forward_layer_type(self, result, input, adapter_data, layer_type, start_idx, end_idx):
        if adapter_data is None:
            return result
        data = adapter_data.data.get(layer_type)
        data = data.get("lora") if data is not None else None
        for adapter_index in adapter_data.meta.adapter_set:
            if data is not None and data.has_adapter(adapter_index):
                adapter_mask = (adapter_data.meta.adapter_indices == adapter_index).to(input.dtype).view(-1, 1)
                layer_result = self.forward_lora(input, data, adapter_index, adapter_mask)
                result[:, start_idx:end_idx] += layer_result
        return result

    def forward_lora(self, input, data, adapter_index, adapter_mask):
        return (input @ data.lora_a[adapter_index] @ data.lora_b[adapter_index]) * adapter_mask

    def forward(self, input, adapter_data):
        result = input @ self.weight
        return self.forward_layer_type(result, input, adapter_data, "q_proj", 0, result.shape[1])


class FlashMistral:
    def __init__(self, device):
        gen = generator(2180)
        self.embed_tokens = randn(VOCAB, DIM, gen=gen, device=device)
        self.rotary = randn(MAX_POS, DIM, gen=gen, device=device, scale=0.3)
        self.q_proj = LoraLinear(randn(DIM, DIM, gen=gen, device=device, scale=0.5))
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)

    def forward(self, input_ids, position_ids, adapter_data=None):
        h = self.embed_tokens[input_ids] + self.rotary[position_ids]
        h = torch.relu(self.q_proj.forward(h, adapter_data))
        return h @ self.lm_head


def load_adapter(device):
    gen = generator(7)
    lora = BatchLoraWeights({ADAPTER: randn(DIM, RANK, gen=gen, device=device)},
                            {ADAPTER: randn(RANK, DIM, gen=gen, device=device)})
    return {"q_proj": {"lora": lora}}


def decode_steps(device):
    """(input_ids, position_ids, adapter_indices) per decode step: three requests, two of them on the
    adapter; the third finishes after step 2."""
    return [([3, 5, 7], [4, 6, 5], [ADAPTER, BASE, ADAPTER]),
            ([2, 9, 1], [5, 7, 6], [ADAPTER, BASE, ADAPTER]),
            ([8, 4], [6, 8], [ADAPTER, BASE])]


def run(variant: str, device: str = "cpu"):
    model = FlashMistral(device)
    lora_adapter_ids = ["predibase/customer_support"]
    weights = load_adapter(device)

    def adapter_data_for(indices):
        return AdapterBatchData(AdapterBatchMetadata(torch.tensor(indices, device=device), set(indices)), weights)

    steps = [tuple(torch.tensor(v, device=device) for v in s[:2]) + (adapter_data_for(s[2]),)
             for s in decode_steps(device)]

    def eager():
        return [model.forward(ids, pos, adapter_data=ad) for ids, pos, ad in steps]

    def served():
        # cli.serve: the fix disables CUDA graphs when LoRA adapters are loaded
        CUDA_GRAPHS = [1, 2, 4]
        if variant == "fix" and len(lora_adapter_ids) > 0:
            CUDA_GRAPHS = None
        manager = None
        if CUDA_GRAPHS:
            max_bs = max(CUDA_GRAPHS)
            graph_vars = {"input_ids": torch.zeros(max_bs, dtype=torch.int64, device=device),
                          "position_ids": torch.zeros(max_bs, dtype=torch.int64, device=device)}

            def cuda_graph_forward(bs):           # cuda_graph_warmup: no adapter_data is passed
                return model.forward(input_ids=graph_vars["input_ids"][:bs],
                                     position_ids=graph_vars["position_ids"][:bs])

            manager = GraphManager(cuda_graph_forward, CUDA_GRAPHS, device=device, mode=CUDAGraphMode.FULL,
                                   num_warmups=1, static_buffers=graph_vars, descending=True,
                                   name="FlashCausalLM cuda graphs")
            manager.capture()
        outs = []
        for input_ids, position_ids, adapter_data in steps:
            bs = input_ids.shape[0]
            padded_bs = manager.dispatch(bs) if manager is not None else None
            if padded_bs is None:
                outs.append(model.forward(input_ids, position_ids, adapter_data=adapter_data))
                continue
            graph_vars["input_ids"][:bs] = input_ids
            graph_vars["position_ids"][:bs] = position_ids
            outs.append(manager.replay(padded_bs, bs, padded=graph_vars).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
