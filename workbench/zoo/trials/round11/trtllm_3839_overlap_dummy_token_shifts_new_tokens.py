"""Overlap scheduler + CUDA graph padding: the padding dummy's host token shifts every real row's input id.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/3839 ("[https://nvbugspro.nvidia.com/bug/5241495][fix]
CUDA Graph padding with overlap scheduler").
Symptom: PyTorch backend with the overlap scheduler and CUDA graph padding (``cuda_graph_padding_enabled``):
once a decode batch is padded up to a captured batch size, generations turn into garbage (each request
continues from its neighbour's token); without padding, or without the overlap scheduler, outputs are
correct (TensorRT-LLM 0.19/0.20 dev, April 2025).
Mechanism: with the overlap scheduler a generation request's next input token is still on the device
(``new_tokens_device``, sampled by the previous step), so ``PyTorchModelEngine._prepare_tp_inputs`` builds
``input_ids_cuda`` in two parts: the host tokens of requests that have no previous tensor go first
(``input_ids_cuda[:num_tokens]``), then the device tokens of the others are gathered behind them
(``input_ids_cuda[num_tokens:num_tokens + len(previous_batch_indices)]``). Positions, sequence lengths and
the graph's rows follow the request order. For CUDA graph padding the runner appends a dummy request
(``is_cuda_graph_dummy``) to fill the batch up to the captured size; it has no previous tensor, so its host
token was appended to ``input_ids`` and took row 0, pushing every real request's token one row down:
request 0 decodes the dummy's token at its own position, request 1 request 0's token, and so on.
Doctor: stale-padding, at ``_prepare_tp_inputs`` (the padded dummy row's token lands in the real rows).
Fix (upstream): skip adding ``input_ids`` of CUDA graph dummy requests ("so that new_tokens_device can be
aligned to the correct positions"); the dummy's padded row keeps whatever ``input_ids_cuda`` held.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/3839"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "_prepare_tp_inputs"
SYMPTOM = "with graph padding + overlap scheduler each real row decodes the previous row's (or the dummy's) token"
VOCAB, DIM, MAX_POS, CUDA_GRAPH_BATCH_SIZE, STEPS = 11, 4, 16, 4, 4
CUDA_GRAPH_DUMMY_REQUEST_ID = (1 << 64) - 1


class LlmRequest:
    def __init__(self, request_id, tokens, *, is_dummy=False, is_cuda_graph_dummy=False):
        self.py_request_id = request_id
        self.tokens = list(tokens)
        self.py_batch_idx = None                  # row of this request in the previous batch's outputs
        self.is_dummy = is_dummy
        self.is_cuda_graph_dummy = is_cuda_graph_dummy

    def get_last_tokens(self, beam):
        return self.tokens[-1]

    @property
    def max_beam_num_tokens(self):
        return len(self.tokens)


class Model:
    def __init__(self, device):
        gen = generator(3839)
        self.embed_tokens = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos_emb = randn(MAX_POS, DIM, gen=gen, device=device, scale=0.5)
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device)

    def forward(self, input_ids, position_ids):
        h = torch.tanh(self.embed_tokens[input_ids] + self.pos_emb[position_ids])
        logits = h @ self.lm_head
        return logits, torch.argmax(logits, dim=-1)          # the sampler's new tokens stay on the device


class PyTorchModelEngine:
    def __init__(self, model, device, variant):
        self.model, self.device, self.variant = model, device, variant
        self.input_ids_cuda = torch.zeros(CUDA_GRAPH_BATCH_SIZE, dtype=torch.long, device=device)
        self.position_ids_cuda = torch.zeros(CUDA_GRAPH_BATCH_SIZE, dtype=torch.long, device=device)

    def _prepare_tp_inputs(self, generation_requests, new_tokens_device):
        input_ids, position_ids, previous_batch_indices = [], [], []
        for batch_idx, request in enumerate(generation_requests):
            # the request has no previous tensor:
            # (1) new_tokens_device is None, which means overlap scheduler is disabled; or
            # (2) a dummy request; or
            # (3) the first step in the generation server of disaggregated serving
            if new_tokens_device is None or request.is_dummy or request.py_batch_idx is None:
                if self.variant == "bug" or not request.is_cuda_graph_dummy:
                    # (fix) skip adding input_ids of CUDA graph dummy requests so that new_tokens_device
                    # can be aligned to the correct positions.
                    input_ids.append(request.get_last_tokens(0))
                past_seen_token_num = request.max_beam_num_tokens - 1
            else:
                # the request has previous tensor
                previous_batch_indices.append(request.py_batch_idx)
                past_seen_token_num = request.max_beam_num_tokens
            position_ids.append(past_seen_token_num)
            request.py_batch_idx = batch_idx
        num_tokens = len(input_ids)
        if num_tokens:
            self.input_ids_cuda[:num_tokens].copy_(torch.tensor(input_ids, device=self.device))
        if previous_batch_indices:
            previous_slots = torch.tensor(previous_batch_indices, device=self.device)
            self.input_ids_cuda[num_tokens:num_tokens + len(previous_batch_indices)].copy_(
                new_tokens_device[previous_slots])
        self.position_ids_cuda[:len(position_ids)].copy_(torch.tensor(position_ids, device=self.device))
        return len(generation_requests)


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    prompts = [[3, 1, 4], [1, 5], [9, 2, 6, 5]]

    def serve(graphed: bool):
        engine = PyTorchModelEngine(model, device, variant)
        requests = [LlmRequest(i, p) for i, p in enumerate(prompts)]
        if graphed:
            bs = CUDA_GRAPH_BATCH_SIZE
            g, out = capture(lambda: model.forward(engine.input_ids_cuda[:bs], engine.position_ids_cuda[:bs]),
                             device=device, static={"input_ids_cuda": engine.input_ids_cuda,
                                                    "position_ids_cuda": engine.position_ids_cuda},
                             owner="PyTorchModelEngine (decode graph)")
        outs, new_tokens_device, pending = [], None, None
        for _ in range(STEPS):
            batch = list(requests)
            if graphed:                                       # CUDA graph padding: fill up with a dummy
                dummy = LlmRequest(CUDA_GRAPH_DUMMY_REQUEST_ID, [0], is_dummy=True, is_cuda_graph_dummy=True)
                batch += [dummy] * (CUDA_GRAPH_BATCH_SIZE - len(requests))
            n = engine._prepare_tp_inputs(batch, new_tokens_device)
            if graphed:
                logits, new_tokens = replay(g, out, real=len(requests), size=n,
                                            padded={"input_ids_cuda": engine.input_ids_cuda})
            else:
                logits, new_tokens = model.forward(engine.input_ids_cuda[:n], engine.position_ids_cuda[:n])
            outs.append(logits[:len(requests)].clone())
            if pending is not None:                           # overlap: the host learns step t-1's tokens now
                for request, tok in zip(requests, pending):
                    request.tokens.append(int(tok))
            pending = new_tokens[:len(requests)].tolist()
            new_tokens_device = new_tokens
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
