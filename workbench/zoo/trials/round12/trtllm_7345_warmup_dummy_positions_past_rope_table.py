"""The CUDA-graph warmup's max-length dummy request carries positions past the rotary cos/sin table.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/7345 ("[https://nvbugs/5481385][fix] Fix max_seq_len in
cuda graph warmup and intermediate_size in fused_moe_deepgemm").
Symptom: DeepSeek-style models with MTP speculative decoding and CUDA graphs crash during the CUDA-graph
warmup at startup (illegal memory access / out-of-range rotary lookup) when ``max_seq_len`` is the model's
``max_position_embeddings``; without CUDA graphs the server starts and serves (TensorRT-LLM 1.0 / 1.1rc,
August 2025).
Mechanism: a graph captured for a batch must be valid for any KV length, so the warmup builds its dummy
generation batch with one request of the longest possible length, ``token_num = min(available_tokens,
max_seq_len - 1)`` tokens, and one-token requests elsewhere. With MTP each generation request feeds
``1 + draft_len`` tokens at positions ``token_num - 1 .. token_num - 1 + draft_len``; the ``- 1`` left room for
one new token only, so the dummy's last ``draft_len - 1`` positions are at or past ``max_position_embeddings``:
the rotary embedding's cos/sin cache has ``max_position_embeddings`` rows and the warmup (and the capture)
gathers rows that do not exist. Real requests never get there: the scheduler bounds a request's length, draft
tokens included, by ``max_seq_len``.
Doctor: undersized-buffer, at ``get_cuda_graph_warmup_request`` (the capture's dummy data does not fit the
static cos/sin table).
Fix (upstream): also bound the dummy's length by the position table: ``token_num = min(token_num,
max_position_embeddings - draft_len)``.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/7345"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "get_cuda_graph_warmup_request"
SYMPTOM = "CUDA-graph warmup crashes: the max-length MTP dummy request indexes past the rotary cos/sin cache"
VOCAB, DIM, MAX_POSITION_EMBEDDINGS, DRAFT_LEN = 12, 4, 16, 2
CUDA_GRAPH_BATCH_SIZES = [1, 2]
TOKENS_PER_REQ = 1 + DRAFT_LEN


class RotaryEmbedding:
    def __init__(self, device):
        inv_freq = 1.0 / (10000 ** (torch.arange(0, DIM, 2, dtype=torch.float32) / DIM))
        freqs = torch.arange(MAX_POSITION_EMBEDDINGS, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.cos_sin_cache = torch.cat([freqs.cos(), freqs.sin()], -1).to(device)   # [max_positions, DIM]

    def forward(self, position_ids, q):
        cos, sin = self.cos_sin_cache[position_ids].chunk(2, dim=-1)
        q1, q2 = q.chunk(2, dim=-1)
        return torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], -1)


class DeepseekV3ForCausalLM:
    def __init__(self, device):
        gen = generator(7345)
        self.embed_tokens = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)
        self.rotary_emb = RotaryEmbedding(device)

    def forward(self, input_ids, position_ids):
        h = self.embed_tokens[input_ids]
        q = self.rotary_emb.forward(position_ids, h @ self.wq)
        return (h + q) @ self.lm_head


class PyTorchModelEngine:
    def __init__(self, model, device, variant):
        self.model, self.device, self.variant = model, device, variant
        self.max_seq_len = MAX_POSITION_EMBEDDINGS          # defaults to the model's position limit
        self.available_tokens = 64                          # free KV-cache tokens at warmup
        size = max(CUDA_GRAPH_BATCH_SIZES) * TOKENS_PER_REQ
        self.input_ids = torch.zeros(size, dtype=torch.long, device=device)       # CUDA-graph static inputs
        self.position_ids = torch.zeros(size, dtype=torch.long, device=device)
        self.graphs = {}

    def get_cuda_graph_warmup_request(self, batch_size, draft_len):
        """The warmup's dummy generation requests: one of the maximum length, the others of one token."""
        # Add one dummy request with the maximum possible sequence length.
        # The sequence length is limited by both the max_seq_len and the number of available blocks.
        token_num = max(1, min(self.available_tokens, self.max_seq_len - 1))
        if self.variant == "fix":
            # Also, the sequence length is limited by the max_position_embeddings.
            token_num = min(token_num, MAX_POSITION_EMBEDDINGS - draft_len)
        return [token_num] + [1] * (batch_size - 1)

    def _prepare_inputs(self, token_nums, new_tokens):
        """Each generation request feeds its last token plus ``draft_len`` draft tokens."""
        n = len(token_nums) * TOKENS_PER_REQ
        positions = [p for t in token_nums for p in range(t - 1, t - 1 + TOKENS_PER_REQ)]
        self.input_ids[:n].copy_(torch.tensor(new_tokens))
        self.position_ids[:n].copy_(torch.tensor(positions))
        return n

    def warmup(self):
        for bs in sorted(CUDA_GRAPH_BATCH_SIZES, reverse=True):
            token_nums = self.get_cuda_graph_warmup_request(bs, DRAFT_LEN)
            n = self._prepare_inputs(token_nums, [0] * (bs * TOKENS_PER_REQ))
            self.graphs[bs] = capture(
                lambda n=n: self.model.forward(self.input_ids[:n], self.position_ids[:n]), device=self.device,
                static={"input_ids": self.input_ids, "position_ids": self.position_ids},
                owner="CUDAGraphRunner (MTP generation)")

    def forward(self, token_nums, new_tokens):
        n = self._prepare_inputs(token_nums, new_tokens)
        g, out = self.graphs[len(token_nums)]
        return replay(g, out)[:n].clone()


REQUESTS = [  # (current lengths of the generation requests, their new + draft tokens)
    ([5, 9], [1, 4, 7, 2, 2, 9]),
    ([6, 10], [3, 5, 8, 11, 6, 1]),
    ([7], [10, 0, 4]),
]


def run(variant: str, device: str = "cpu"):
    model = DeepseekV3ForCausalLM(device)

    def eager():
        outs = []
        for token_nums, new_tokens in REQUESTS:
            positions = [p for t in token_nums for p in range(t - 1, t - 1 + TOKENS_PER_REQ)]
            outs.append(model.forward(torch.tensor(new_tokens, device=device), torch.tensor(positions, device=device)))
        return outs

    def served():
        engine = PyTorchModelEngine(model, device, variant)
        engine.warmup()
        return [engine.forward(token_nums, new_tokens) for token_nums, new_tokens in REQUESTS]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
