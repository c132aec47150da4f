"""Dynamic-batching CUDA-graph padding tokens keep stale input ids, and their embeddings set the real tokens' FP8 scale.

Upstream: https://github.com/NVIDIA/Megatron-LM/pull/2585 ("Explicitly zero out padding token outputs when
using quantization scales").
Symptom: Megatron-Core dynamic inference with CUDA graphs and FP8 (functional test
``gpt_dynamic_inference_tp1_pp1_583m_cuda_graphs_fp8_logitsmatch``) generates tokens and log-probs that depend
on the padding of the batch; the fix changed the test's golden tokens and log-probs (Dec 2025).
Mechanism: ``DynamicInferenceContext.initialize_attention_state`` matches the step to a CUDA graph and pads
``active_token_count`` up to the graph's token count (``padded_active_token_count``). It resets the padded
tokens' block indexes and positions, but not ``token_to_input_ids``, whose padded entries keep the ids an
earlier, larger step wrote there. ``GPTModel.forward`` embeds all ``padded_active_token_count`` tokens and the
decoder layer's graph, captured at the padded size, runs Transformer Engine linears with FP8 current scaling:
the quantizer takes one amax over every row of its input, padded rows included, so the FP8 scale (and the
rounding) of the real tokens depends on the stale embeddings in the padded rows.
Doctor: stale-padding, at ``quantize`` (the per-tensor amax that reads the padded rows).
Fix (upstream): when dynamic batching runs with quantization scales (``is_using_quantization_scales``:
``config.fp8`` or ``config.fp4``), ``GPTModel.forward`` sets ``decoder_input[inference_context.padding_slice]
= 0.0`` (new ``padding_slice = slice(active_token_count, padded_active_token_count)`` in the context), and
``Attention.forward`` zeroes ``core_attn_out`` of the padded tokens likewise, so padded rows add nothing to
any amax. Modelled: the decoder-input part (one layer); the reference is the same steps without graphs,
on the real tokens only.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/Megatron-LM/pull/2585"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "quantize"
SYMPTOM = "padded decode tokens' stale embeddings inflate the FP8 amax: real tokens' logits change"

VOCAB, HIDDEN, FFN = 16, 8, 16
MAX_TOKENS = 8
GRAPH_TOKEN_COUNTS = (4,)          # the decode CUDA graph sizes (tokens)
LOUD_TOKEN = 13                    # an id whose embedding has a large norm
FP8_MAX = 448.0                    # float8_e4m3fn


def is_using_quantization_scales(config) -> bool:
    return getattr(config, "fp8", False) or getattr(config, "fp4", False)


class Float8CurrentScalingQuantizer:
    """Transformer Engine FP8 current scaling: one scale per tensor, from the tensor's own amax."""

    def quantize(self, tensor):
        amax = tensor.abs().amax()                                   # over every row, padded rows too
        scale = FP8_MAX / amax.clamp(min=1e-12)
        data = (tensor * scale).to(torch.float8_e4m3fn)
        return data, scale


def te_linear(inp, weight, quantizer):
    """``te.Linear`` under ``fp8_autocast``: both GEMM operands quantized, product of the dequantized values
    (a row-by-row product, so a row's result does not depend on how many rows the GEMM has)."""
    inp_fp8, inp_scale = quantizer.quantize(inp)
    w_fp8, w_scale = quantizer.quantize(weight)
    a, b = inp_fp8.float() / inp_scale, w_fp8.float() / w_scale
    return (a[:, None, :] * b[None, :, :]).sum(-1)


class TransformerLayer:
    def __init__(self, gen, device):
        self.fc1_weight = randn(FFN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.fc2_weight = randn(HIDDEN, FFN, gen=gen, device=device, scale=0.5)
        self.quantizer = Float8CurrentScalingQuantizer()

    def forward(self, hidden_states):
        h = torch.nn.functional.gelu(te_linear(hidden_states, self.fc1_weight, self.quantizer))
        return hidden_states + te_linear(h, self.fc2_weight, self.quantizer)


class DynamicInferenceContext:
    def __init__(self, device, use_cuda_graphs: bool):
        self.device = device
        self.token_to_input_ids = torch.zeros(MAX_TOKENS, dtype=torch.long, device=device)
        self.token_to_position_in_request = torch.zeros(MAX_TOKENS, dtype=torch.long, device=device)
        self.cuda_graph_token_counts = GRAPH_TOKEN_COUNTS if use_cuda_graphs else ()
        self.active_token_count = 0

    def is_dynamic_batching(self) -> bool:
        return True

    def add_tokens(self, token_ids, positions):
        n = len(token_ids)
        self.token_to_input_ids[:n].copy_(torch.tensor(token_ids, dtype=torch.long, device=self.device))
        self.token_to_position_in_request[:n].copy_(torch.tensor(positions, dtype=torch.long, device=self.device))
        self.active_token_count = n

    def using_cuda_graph_this_step(self) -> bool:
        return self._using_cuda_graph_this_step

    def initialize_attention_state(self):
        fits = [c for c in self.cuda_graph_token_counts if c >= self.active_token_count]
        best_graph = min(fits) if fits else None
        self._using_cuda_graph_this_step = best_graph is not None
        self.padded_active_token_count = best_graph if best_graph is not None else self.active_token_count
        self.padding_slice = slice(self.active_token_count, self.padded_active_token_count)
        # Update token position indexes (token_to_input_ids of the padded tokens is left as it was).
        self.token_to_position_in_request[self.active_token_count:self.padded_active_token_count] = 0


class CudaGraphManager:
    """The decoder layer's local CUDA graph at each graph token count, captured at engine start on dummy data."""

    def __init__(self, layer, device):
        self.static_hidden = torch.zeros(max(GRAPH_TOKEN_COUNTS), HIDDEN, device=device)
        self.graph, self.out = capture(lambda: layer.forward(self.static_hidden), device=device,
                                       static={"hidden_states": self.static_hidden},
                                       owner="CudaGraphManager (decoder layer)", name="4 tokens")

    def replay(self, hidden_states, context):
        self.static_hidden.copy_(hidden_states)
        return replay(self.graph, self.out, real=context.active_token_count,
                      size=context.padded_active_token_count,
                      padded={"token_to_input_ids": context.token_to_input_ids})


class GPTModel:
    def __init__(self, device, variant):
        gen = generator(2585)
        self.config = SimpleNamespace(fp8="hybrid", fp4=None)
        self.variant = variant
        self.embedding = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.embedding[LOUD_TOKEN] *= 16.0
        self.layer = TransformerLayer(gen, device)
        self.output_weight = randn(VOCAB, HIDDEN, gen=gen, device=device, scale=0.5)
        self.cudagraph_manager = None

    def forward(self, inference_context):
        padded = inference_context.padded_active_token_count
        decoder_input = self.embedding[inference_context.token_to_input_ids[:padded]]
        if (self.variant == "fix" and inference_context.is_dynamic_batching()
                and is_using_quantization_scales(self.config)):
            # Clear the outputs for padding tokens to avoid corrupting amax calculations
            decoder_input[inference_context.padding_slice] = 0.0
        if inference_context.using_cuda_graph_this_step():
            hidden = self.cudagraph_manager.replay(decoder_input, inference_context)
        else:
            hidden = self.layer.forward(decoder_input)
        return hidden[:inference_context.active_token_count] @ self.output_weight.t()


def run(variant: str, device: str = "cpu"):
    steps = [  # (token ids, positions): a 6-token prefill (too many tokens for a graph), then decodes
        ([3, 9, 7, LOUD_TOKEN, 5, 1], [0, 1, 2, 3, 4, 5]),
        ([2, 4, 6], [6, 1, 2]),
        ([8, 10], [7, 2]),
        ([11, 12, 14, 15], [8, 3, 3, 3]),
        ([0, 2, 4], [9, 4, 4]),
    ]

    def serve(use_cuda_graphs: bool):
        model = GPTModel(device, variant)
        if use_cuda_graphs:
            model.cudagraph_manager = CudaGraphManager(model.layer, device)
        context = DynamicInferenceContext(device, use_cuda_graphs)
        outs = []
        for token_ids, positions in steps:
            context.add_tokens(token_ids, positions)
            context.initialize_attention_state()
            outs.append(model.forward(context).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
