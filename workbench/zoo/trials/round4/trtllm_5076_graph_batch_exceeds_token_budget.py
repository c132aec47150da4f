"""CUDA-graph batch sizes bounded by max_num_tokens alone: a speculative graph's dummy batch overflows the token buffers.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/5076 ("fix: fix cuda graph max batch size for spec
decoding cases.").
Symptom: with speculative decoding (MTP/Eagle, ``max_draft_len`` > 0), CUDA graphs and a small
``max_num_tokens``, the engine fails during CUDA-graph warmup at start-up (TensorRT-LLM PyTorch backend,
June 2025; it blocked ``trtllm-bench`` perf runs).
Mechanism: ``_filter_cuda_graph_batch_sizes`` capped the graph batch sizes at ``min(max_batch_size,
max_num_tokens)``, as if each generation request brought one token. With speculative decoding each brings
``1 + max_draft_len``, so the warmup batch of the largest kept size carries ``(1 + max_draft_len) * bs``
tokens. ``_prepare_tp_inputs`` copies them into the static ``input_ids_cuda`` / ``position_ids_cuda``
buffers, which hold only ``max_num_tokens``.
Doctor: undersized-buffer, at ``_prepare_tp_inputs`` (the copy of the batch's tokens into a static buffer
too small for them).
Fix (upstream): cap at ``min(max_batch_size, int(max_num_tokens / (1 + max_draft_len)))`` (and assert
``total_num_tokens <= max_num_tokens`` in ``_prepare_tp_inputs``); larger batches run eagerly.
"""
from __future__ import annotations

import torch

from workbench.engine import events, host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/5076"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "_prepare_tp_inputs"
SYMPTOM = "start-up fails: a graph's warmup batch has more tokens than the max_num_tokens input buffers hold"
VOCAB, DIM, CTX = 16, 4, 10
MAX_BATCH_SIZE, MAX_NUM_TOKENS, MAX_DRAFT_LEN = 4, 6, 2
CUDA_GRAPH_BATCH_SIZES, CUDA_GRAPH_PADDING_ENABLED = [1, 2, 4], True
PROMPTS = [[3, 7, 12], [5, 1], [9, 14, 2, 6]]           # three requests, seq slots 0..2


def _filter_cuda_graph_batch_sizes(cuda_graph_batch_sizes, max_batch_size, max_num_tokens, max_draft_len,
                                   enable_padding, tokens_per_request_counted):
    # This is the largest possible batch size for a pure decoding batch.
    if tokens_per_request_counted:                        # #5076
        max_cuda_graph_bs = min(max_batch_size, int(max_num_tokens / (1 + max_draft_len)))
    else:
        max_cuda_graph_bs = min(max_batch_size, max_num_tokens)
    result = []
    for i, bs in enumerate(cuda_graph_batch_sizes):       # sorted
        if bs <= max_cuda_graph_bs:
            result.append(bs)
        else:
            # padding to a size the user allowed implies padding to a smaller one is fine
            if enable_padding and (i == 0 or result[i - 1] != max_cuda_graph_bs):
                result.append(max_cuda_graph_bs)
            break
    return result


class Model:
    def __init__(self, device):
        gen = generator(5076)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos = randn(CTX, DIM, gen=gen, device=device, scale=0.5)
        self.wq, self.wk, self.wv = (randn(DIM, DIM, gen=gen, device=device, scale=0.5) for _ in range(3))
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)

    def forward(self, input_ids, position_ids, seq_slots, kv_cache):
        """Target-model verify pass: every request brings 1 + max_draft_len tokens; K/V appended, then
        causal attention over the request's cache row."""
        bs = seq_slots.shape[0]
        h = self.emb[input_ids] + self.pos[position_ids]
        rows = seq_slots.repeat_interleave(1 + MAX_DRAFT_LEN)
        kv_cache[0, rows, position_ids] = h @ self.wk
        kv_cache[1, rows, position_ids] = h @ self.wv
        keys, values = kv_cache[0, rows], kv_cache[1, rows]                     # [tokens, CTX, D]
        scores = ((h @ self.wq)[:, None, :] * keys).sum(-1) / DIM ** 0.5
        ctx = torch.arange(CTX, device=h.device)
        scores = scores.masked_fill(ctx[None, :] > position_ids[:, None], float("-inf"))
        out = (torch.softmax(scores, -1)[..., None] * values).sum(1)
        return (out @ self.lm_head).view(bs, 1 + MAX_DRAFT_LEN, VOCAB)


class PyTorchModelEngine:
    def __init__(self, model, device, tokens_per_request_counted):
        self.model, self.device = model, device
        self.max_num_tokens = MAX_NUM_TOKENS
        self._cuda_graph_batch_sizes = _filter_cuda_graph_batch_sizes(
            CUDA_GRAPH_BATCH_SIZES, MAX_BATCH_SIZE, MAX_NUM_TOKENS, MAX_DRAFT_LEN, CUDA_GRAPH_PADDING_ENABLED,
            tokens_per_request_counted)
        self.input_ids_cuda = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.position_ids_cuda = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.seq_slots_cuda = torch.zeros(MAX_BATCH_SIZE, dtype=torch.long, device=device)
        # slots [MAX_BATCH_SIZE, 2 * MAX_BATCH_SIZE) belong to warmup dummy requests
        self.kv_cache = torch.zeros(2, 2 * MAX_BATCH_SIZE, CTX, DIM, device=device)
        self._cuda_graphs: dict[int, tuple] = {}

    def _prepare_tp_inputs(self, requests):
        """``requests``: (seq slot, past_seen_token_num, [last token] + draft tokens) per generation request."""
        input_ids, position_ids, seq_slots = [], [], []
        for slot, past_seen_token_num, tokens in requests:
            input_ids.extend(tokens)
            position_ids.extend(range(past_seen_token_num, past_seen_token_num + 1 + MAX_DRAFT_LEN))
            seq_slots.append(slot)
        num_tokens = len(input_ids)
        total_num_tokens = len(position_ids)
        input_ids = host(torch.tensor(input_ids, dtype=torch.long), self.device)
        self.input_ids_cuda[:num_tokens].copy_(input_ids)
        position_ids = host(torch.tensor(position_ids, dtype=torch.long), self.device)
        self.position_ids_cuda[:total_num_tokens].copy_(position_ids)
        self.seq_slots_cuda[:len(seq_slots)].copy_(host(torch.tensor(seq_slots, dtype=torch.long), self.device))
        return total_num_tokens, len(seq_slots)

    def _forward_step(self, num_tokens, bs):
        return self.model.forward(self.input_ids_cuda[:num_tokens], self.position_ids_cuda[:num_tokens],
                                  self.seq_slots_cuda[:bs], self.kv_cache)

    def warmup(self):
        """Capture a graph per batch size, largest first, on a batch of dummy generation requests (each
        with max_draft_len draft tokens): prepare the inputs, run the forward twice, capture it."""
        events.static_buffers("PyTorchModelEngine", {"input_ids_cuda": self.input_ids_cuda,
                                                     "position_ids_cuda": self.position_ids_cuda,
                                                     "seq_slots_cuda": self.seq_slots_cuda})
        events.persistent_state("KVCacheManager", {"kv_cache": self.kv_cache})
        for bs in sorted(self._cuda_graph_batch_sizes, reverse=True):
            dummies = [(MAX_BATCH_SIZE + i, 1, [0] * (1 + MAX_DRAFT_LEN)) for i in range(bs)]
            num_tokens, _ = self._prepare_tp_inputs(dummies)
            self._cuda_graphs[bs] = capture(lambda n=num_tokens, b=bs: self._forward_step(n, b), device=self.device,
                                            warmups=2, name=f"bs={bs}", owner="DecodingCUDAGraphRunner")

    def forward(self, requests, use_graphs=True):
        num_tokens, bs = self._prepare_tp_inputs(requests)
        if use_graphs and bs in self._cuda_graphs:
            g, out = self._cuda_graphs[bs]
            return replay(g, out).clone()
        return self._forward_step(num_tokens, bs)


def schedule():
    """Verify steps the scheduler fits in max_num_tokens (two requests of three tokens at most):
    (seq slots, per slot the last token and two draft tokens, per slot how many drafts were accepted)."""
    return [([0, 1], [[4, 8, 11], [2, 15, 6]], [2, 0]), ([2], [[10, 3, 7]], [1]),
            ([0, 1], [[13, 5, 1], [9, 4, 12]], [0, 1]), ([2], [[6, 6, 0]], [2])]


def run(variant: str, device: str = "cpu"):
    model = Model(device)

    def serve(graphed: bool):
        engine = PyTorchModelEngine(model, device, tokens_per_request_counted=(variant == "fix"))
        if graphed:
            engine.warmup()
        past = [len(p) for p in PROMPTS]
        for slot, prompt in enumerate(PROMPTS):           # context phase: the prompts' K/V
            pos = torch.arange(len(prompt), device=device)
            h = model.emb[torch.tensor(prompt, device=device)] + model.pos[pos]
            engine.kv_cache[0, slot, pos] = h @ model.wk
            engine.kv_cache[1, slot, pos] = h @ model.wv
        outs = []
        for slots, tokens, accepted in schedule():
            requests = [(s, past[s], t) for s, t in zip(slots, tokens)]
            outs.append(engine.forward(requests, use_graphs=graphed))
            for s, a in zip(slots, accepted):
                past[s] += a + 1
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
