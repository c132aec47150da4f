"""Piecewise replay pads ``num_reqs`` to ``min(num_tokens, max_num_reqs)``; the DSA indexer scales it by ``next_n``.

Upstream: https://github.com/vllm-project/vllm/pull/49302 ("[Bugfix] Fix DSA crash under breakable piecewise
cudagraphs").
Symptom: DeepSeek-V4-Flash (MTP speculative decoding) on the V2 model runner crashed in its first padded
decode step after #48822 (``batch_size * next_n == weights rows`` assertion in DeepGEMM's paged MQA
logits); the same would hit MiniMax-M3 Sparse (vLLM main, July 2026).
Mechanism: #48822 made (breakable) piecewise replay pad the batch metadata to the captured shape:
``num_reqs`` is padded to ``min(num_tokens, max_num_reqs)`` with zero-length trailing requests. In a
PIECEWISE step attention runs eagerly between the graph pieces and reads the batch from the forward
context. The DSA indexer's decode path expands the request count by ``next_n`` (``1 +
num_speculative_tokens``) and DeepGEMM asserts that this equals the rows of the indexer weights, which
are the step's real tokens. Padding ``num_reqs`` as if each request had one token breaks that contract.
The capture's dummy batch is exactly the captured size, so capture itself is fine.
Doctor: padded-shape-mismatch, at ``sparse_attn_indexer`` (the padded request count meets the token
rows of the real batch).
Fix (upstream): piecewise batch descriptors carry ``num_reqs=None`` again and the model state builds the
replay metadata with the real (unpadded) sizes for piecewise graphs; only FULL graphs pad requests.
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.engine import CUDAGraphMode, GraphManager
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/vllm-project/vllm/pull/49302"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "sparse_attn_indexer"
SYMPTOM = "DeepSeek-V4-Flash + MTP crashes on padded piecewise steps (batch_size * next_n != weights rows)"
HIDDEN, IDX_DIM, CACHE_LEN, TOPK, NEXT_N, MAX_NUM_REQS, SIZE = 6, 4, 8, 3, 2, 8, 8


@dataclasses.dataclass
class BatchDescriptor:
    num_tokens: int
    num_reqs: int | None = None


@dataclasses.dataclass
class IndexerMetadata:
    num_decodes: int
    num_decode_tokens: int
    seq_lens: torch.Tensor


class ForwardContext:
    attn_metadata: IndexerMetadata | None = None


class Model:
    def __init__(self, device):
        gen = generator(49302)
        self.wq = randn(HIDDEN, IDX_DIM, gen=gen, device=device, scale=0.5)
        self.w_weights = randn(HIDDEN, 1, gen=gen, device=device, scale=0.5)
        self.k_cache = randn(CACHE_LEN, IDX_DIM, gen=gen, device=device)
        self.v_cache = randn(CACHE_LEN, HIDDEN, gen=gen, device=device)
        self.wo = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.topk_indices_buffer = torch.zeros(SIZE, TOPK, dtype=torch.long, device=device)


def fp8_paged_mqa_logits(q, k_cache, weights, seq_lens, batch_size, next_n):
    assert batch_size * next_n == weights.shape[0], (
        f"batch_size * next_n ({batch_size} * {next_n}) must equal weights rows ({weights.shape[0]})")
    lens = seq_lens[:batch_size].repeat_interleave(next_n)                   # per token of each request
    logits = (q[:weights.shape[0]] @ k_cache.t()) * weights
    pos = torch.arange(k_cache.shape[0], device=q.device)
    return logits.masked_fill(pos[None, :] >= lens[:, None], float("-inf"))


def sparse_attn_indexer(q, weights, model, forward_context):
    """The eager (splitting) op between the pieces: reads the batch from the forward context."""
    attn_metadata = forward_context.attn_metadata
    num_decode_tokens = attn_metadata.num_decode_tokens
    batch_size = attn_metadata.num_decodes
    logits = fp8_paged_mqa_logits(q, model.k_cache, weights[:num_decode_tokens], attn_metadata.seq_lens,
                                  batch_size, NEXT_N)
    model.topk_indices_buffer[:num_decode_tokens] = logits.topk(TOPK, dim=-1).indices
    return model.topk_indices_buffer


def run(variant: str, device: str = "cpu"):
    gen = generator(3)
    # MTP decode steps: each request verifies next_n tokens (real requests, their seq_lens).
    steps = [(randn(3 * NEXT_N, HIDDEN, gen=gen, device=device), [6, 4, 7]),
             (randn(2 * NEXT_N, HIDDEN, gen=gen, device=device), [8, 5])]

    def build(model, manager, ctx, hidden_states):
        indexer = manager.eager(sparse_attn_indexer) if manager is not None else sparse_attn_indexer

        def forward(size):
            h = hidden_states[:size]
            q, weights = h @ model.wq, h @ model.w_weights                  # piece 0
            topk = indexer(q, weights, model, ctx)                          # eager, between the pieces
            return model.v_cache[topk[:size]].mean(1) @ model.wo + h         # piece 1
        return forward

    def metadata(desc: BatchDescriptor, num_tokens: int, seq_lens: list[int], device):
        num_reqs = len(seq_lens) if desc.num_reqs is None else desc.num_reqs
        lens = torch.zeros(MAX_NUM_REQS, dtype=torch.long, device=device)   # padded requests: zero length
        lens[:len(seq_lens)] = torch.tensor(seq_lens, device=device)
        return IndexerMetadata(num_decodes=num_reqs, num_decode_tokens=num_tokens, seq_lens=lens)

    def eager():
        model, ctx = Model(device), ForwardContext()
        outs = []
        for h, lens in steps:
            ctx.attn_metadata = metadata(BatchDescriptor(h.shape[0]), h.shape[0], lens, device)
            outs.append(build(model, None, ctx, h)(h.shape[0]).clone())
        return outs

    def served():
        model, ctx = Model(device), ForwardContext()
        hidden_states = torch.zeros(SIZE, HIDDEN, device=device)
        manager = GraphManager(lambda size: forward(size), [SIZE], device=device, mode=CUDAGraphMode.PIECEWISE,
                               static_buffers={"hidden_states": hidden_states}, name="GPUModelRunner V2 (PIECEWISE)")
        forward = build(model, manager, ctx, hidden_states)
        # Capture: the dummy batch is exactly the captured size (SIZE tokens = SIZE // next_n requests).
        ctx.attn_metadata = metadata(BatchDescriptor(SIZE, SIZE // NEXT_N), SIZE, [1] * (SIZE // NEXT_N), device)
        manager.capture()
        outs = []
        for h, lens in steps:
            n = h.shape[0]
            size = manager.dispatch(n)
            # CudagraphDispatcher: the descriptor of a piecewise replay
            if variant == "bug":
                desc = BatchDescriptor(size, num_reqs=min(size, MAX_NUM_REQS))    # padded as if 1 token/request
            else:
                desc = BatchDescriptor(size, num_reqs=None)                        # real batch metadata
            ctx.attn_metadata = metadata(desc, n, lens, device)    # zero-length trailing requests add no tokens
            hidden_states[:n].copy_(h)
            outs.append(manager.replay(size, n, padded={"hidden_states": hidden_states}).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
