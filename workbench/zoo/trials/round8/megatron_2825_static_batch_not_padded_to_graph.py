"""Static-batch generation hands the decode graph batches of whatever size arrived: the graph has one shape.

Upstream: https://github.com/NVIDIA/Megatron-LM/commit/0a24837314a52477b0bcf8d134e9e6fe38c1b690
("ADLR/megatron-lm!2825 - CUDA graph fixes (padding and text generation server warmup)").
Symptom: with ``enable_cuda_graph`` and the static-batching text generation controller, the first
``generate`` call works, a later call with more requests fails in the decode step with
``AssertionError: Tried replaying a cudagraph with different arguments than what if was created
with!`` (Megatron-Core text generation server, March 2025).
Mechanism: ``CudaGraphManager`` records each layer's decode graph during the first decode step and
``create_cudagraphs()`` captures it at that step's input shape ``[batch_size, ...]``; afterwards
every call replays that one graph, whose static inputs have exactly that shape. The controller
padded the prompts only along the sequence, so each ``generate`` call fed the graph a batch of its own
number of requests. A later batch with more requests than the recorded one does not fit the graph's
input buffers: the replay refuses it (on CUDA the input copy cannot fit either).
Doctor: undersized-buffer, at ``generate_all_output_tokens_static_batch`` (builds the batch at the
number of live requests, not at the graph's size).
Fix (upstream): with CUDA graphs on, pad every batch to ``inference_max_requests`` rows (extra rows
of EOD tokens) and the sequence to ``inference_max_seq_length``, so the graph is recorded at the
maximum shape and every call fits it; slice the logits back to ``[:batch_size]``.
"""
from __future__ import annotations

import torch

from workbench.engine import CUDAGraphMode, GraphManager
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/NVIDIA/Megatron-LM/commit/0a24837314a52477b0bcf8d134e9e6fe38c1b690"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "generate_all_output_tokens_static_batch"
SYMPTOM = "a second generate call with more requests than the first cannot replay the decode graph"
VOCAB, DIM, EOD = 11, 4, 0
INFERENCE_MAX_REQUESTS, INFERENCE_MAX_SEQ_LEN, TOKENS_TO_GENERATE = 4, 8, 3


class GPTModel:
    def __init__(self, device):
        gen = generator(2825)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos = randn(INFERENCE_MAX_SEQ_LEN, DIM, gen=gen, device=device, scale=0.5)
        self.out = randn(DIM, VOCAB, gen=gen, device=device)

    def decode(self, tokens, positions):
        """One decode step of the static batch: the last token of every row -> logits."""
        return torch.tanh(self.emb[tokens] + self.pos[positions]) @ self.out


class CudaGraphManager:
    """Megatron's per-module manager: record the first decode step, then replay one graph."""

    def __init__(self, model, device):
        self.model, self.device = model, device
        self.manager = None
        self.inputs = None

    def __call__(self, tokens, positions):
        if self.manager is None:                         # record_graph_capture: eager, remember the args
            self.inputs = {"tokens": tokens.clone(), "positions": positions.clone()}
            return self.model.decode(tokens, positions)
        return self.replay_graph_capture(tokens, positions)

    def create_cudagraphs(self):
        rows = self.inputs["tokens"].shape[0]
        bufs = self.inputs
        self.manager = GraphManager(lambda n: self.model.decode(bufs["tokens"][:n], bufs["positions"][:n]),
                                    [rows], device=self.device, mode=CUDAGraphMode.FULL, num_warmups=1,
                                    static_buffers=bufs, name="megatron CudaGraphManager")
        self.manager.capture()

    def matches_graph_inputs(self, tokens, positions):
        return tokens.shape == self.inputs["tokens"].shape and positions.shape == self.inputs["positions"].shape

    def replay_graph_capture(self, tokens, positions):
        assert self.matches_graph_inputs(tokens, positions), \
            "Tried replaying a cudagraph with different arguments than what if was created with!"
        self.inputs["tokens"].copy_(tokens)
        self.inputs["positions"].copy_(positions)
        rows = tokens.shape[0]
        return self.manager.replay(rows, rows)


def pad_input_prompt_tokens(batch_prompt_tokens_list, padded_batch_size, padded_sequence_length):
    for prompt_tokens in batch_prompt_tokens_list:
        prompt_tokens.extend([EOD] * (padded_sequence_length - len(prompt_tokens)))
    num_padded_requests = padded_batch_size - len(batch_prompt_tokens_list)
    batch_prompt_tokens_list += [[EOD] * padded_sequence_length for _ in range(num_padded_requests)]
    return batch_prompt_tokens_list


def generate_all_output_tokens_static_batch(step_fn, prompts, device, enable_cuda_graph, padded: bool):
    """Greedy static-batch generation (prompts of equal length; prefill folded into the context)."""
    batch_size = len(prompts)
    prompt_len = len(prompts[0])
    max_sequence_length = prompt_len + TOKENS_TO_GENERATE
    if enable_cuda_graph and padded:
        padded_batch_size, padded_sequence_length = INFERENCE_MAX_REQUESTS, INFERENCE_MAX_SEQ_LEN
    else:
        padded_batch_size, padded_sequence_length = batch_size, max_sequence_length
    tokens = torch.tensor(pad_input_prompt_tokens([list(p) for p in prompts], padded_batch_size,
                                                  padded_sequence_length), device=device)
    all_logits = []
    for context_end in range(prompt_len, max_sequence_length):
        positions = torch.full((padded_batch_size,), context_end - 1, device=device, dtype=torch.long)
        logits = step_fn(tokens[:, context_end - 1], positions)
        if enable_cuda_graph:
            logits = logits[:batch_size]                 # undo padding up to the maximum batch size
            if isinstance(step_fn, CudaGraphManager) and step_fn.manager is None:
                step_fn.create_cudagraphs()
        all_logits.append(logits.clone())
        tokens[:batch_size, context_end] = logits.argmax(-1)
    return all_logits + [tokens[:batch_size, :max_sequence_length].clone()]


def run(variant: str, device: str = "cpu"):
    model = GPTModel(device)
    calls = [[[3, 5], [7, 2]], [[4, 4], [9, 1], [6, 8]]]     # second call: more requests than the first

    def eager():
        outs = []
        for prompts in calls:
            outs += generate_all_output_tokens_static_batch(model.decode, prompts, device, False, False)
        return outs

    def served():
        manager = CudaGraphManager(model, device)
        outs = []
        for prompts in calls:
            outs += generate_all_output_tokens_static_batch(manager, prompts, device, True, variant == "fix")
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
