"""A decode graph captured lazily on a real batch keeps that batch's token count.

Upstream: https://github.com/InternLM/lmdeploy/pull/4005 ("fix cudagraph without warmup", commit
7b93be626).
Symptom: with the PyTorch engine running decode graphs without a graph warmup (lmdeploy main, Sept
2025), a graph is captured on the first real batch of its bucket. The PR has no description beyond its
title; the program models its diff's consequence: a 4-row bucket first captured for 3 sequences.
Mechanism: ``CUDAGraphRunner`` captures a graph the first time a batch falls into its bucket, with that
batch's inputs. ``fill_buffers_cudagraph`` fills the static buffers and hands the model views of them;
for decoding it hands ``input_ids[:, :num_tokens]`` and ``position_ids[:, :num_tokens]``, sliced to the
batch in hand. With the warmup's dummy batches that is the whole bucket. Captured on a real batch of 3
tokens in a 4-token bucket, the graph computes 3 tokens forever. A later batch of 4 replays it and
reads ``logits[:, :4]`` from an output of 3 tokens: the fourth sequence gets no logits.
Doctor: undersized-buffer, at ``fill_buffers_cudagraph`` (the capture input sliced to the first batch,
smaller than the rows later replays serve).
Fix (upstream): hand the model the whole buffers (``input_ids``, ``position_ids``, metadata), so the
captured graph always computes the bucket's full size.
"""
from __future__ import annotations

import torch

from ...engine import graph_pool_handle
from ..kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/InternLM/lmdeploy/pull/4005"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "fill_buffers_cudagraph"
SYMPTOM = "a batch that fills its bucket gets logits for fewer tokens than it has sequences"
VOCAB, DIM, BLOCK, NUM_BLOCKS, MAX_BLOCKS = 16, 4, 2, 12, 3
CAPTURE_SIZES = (1, 2, 4)


class Model:
    def __init__(self, device):
        gen = generator(4005)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos = randn(BLOCK * MAX_BLOCKS, DIM, gen=gen, device=device, scale=0.5)
        self.wq = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)

    def forward(self, input_ids, position_ids, k_cache, v_cache, block_offsets, kv_seqlens):
        """Decoding: one token per sequence (``input_ids`` is ``[1, num_tokens]``), paged attention over
        each sequence's cached keys."""
        h = self.emb[input_ids[0]] + self.pos[position_ids[0]]
        n = h.shape[0]
        pos = torch.arange(BLOCK * MAX_BLOCKS, device=h.device)
        slots = block_offsets[:n, pos // BLOCK] * BLOCK + pos % BLOCK
        scores = ((h @ self.wq)[:, None, :] * k_cache[slots]).sum(-1) / DIM ** 0.5
        valid = pos[None, :] < kv_seqlens[:n, None]
        probs = torch.softmax(scores.masked_fill(~valid, float("-inf")), -1).nan_to_num(0.0)
        out = h + (probs[..., None] * v_cache[slots]).sum(1)
        return (out @ self.lm_head)[None]


class CudaGraphMixin:
    """The model side of lmdeploy's graph runner: make, fill and hand out the static buffers."""

    def __init__(self, model, kv_cache, whole_buffers: bool):
        self.model, (self.k_cache, self.v_cache) = model, kv_cache
        self.whole_buffers = whole_buffers

    def make_buffers_cudagraph(self, max_batches, device):
        return {"input_ids": torch.zeros(1, max_batches, dtype=torch.int64, device=device),
                "position_ids": torch.zeros(1, max_batches, dtype=torch.int64, device=device),
                "block_offsets": torch.zeros(max_batches, MAX_BLOCKS, dtype=torch.int64, device=device),
                "kv_seqlens": torch.zeros(max_batches, dtype=torch.int64, device=device)}

    def fill_buffers_cudagraph(self, bufs, input_ids, position_ids, block_offsets, kv_seqlens):
        batch_size, num_blocks = block_offsets.size()
        num_tokens = input_ids.size(-1)
        bufs["input_ids"].random_(0, VOCAB)
        bufs["input_ids"][:, :num_tokens] = input_ids
        bufs["position_ids"][:, :num_tokens] = position_ids
        bufs["block_offsets"][:batch_size, :num_blocks] = block_offsets
        bufs["kv_seqlens"].zero_()
        bufs["kv_seqlens"][:batch_size] = kv_seqlens
        if self.whole_buffers:
            return dict(bufs)
        return dict(bufs, input_ids=bufs["input_ids"][:, :num_tokens], position_ids=bufs["position_ids"][:, :num_tokens])

    def forward(self, inputs):
        return self.model.forward(inputs["input_ids"], inputs["position_ids"], self.k_cache, self.v_cache,
                                  inputs["block_offsets"], inputs["kv_seqlens"])


class CUDAGraphRunner:
    def __init__(self, mixin: CudaGraphMixin, device):
        self.mixin, self.device = mixin, device
        self.pool = graph_pool_handle(device)
        self.runners = {}

    def __call__(self, **step):
        batch_size = step["kv_seqlens"].size(0)
        key = next(s for s in CAPTURE_SIZES if s >= batch_size)
        if key not in self.runners:                 # no warmup: the first batch of this bucket captures it
            bufs = self.mixin.make_buffers_cudagraph(key, self.device)
            inputs = self.mixin.fill_buffers_cudagraph(bufs, **step)
            g, logits = capture(lambda: self.mixin.forward(inputs), device=self.device, pool=self.pool,
                                name=f"decode bs {key}", static=bufs, owner="lmdeploy CUDAGraphRunner")
            self.runners[key] = (g, logits, bufs)
        g, logits, bufs = self.runners[key]
        self.mixin.fill_buffers_cudagraph(bufs, **step)
        num_tokens = step["input_ids"].size(-1)
        return replay(g, logits)[:, :num_tokens]


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    gen = generator(7)
    k_cache = randn(NUM_BLOCKS * BLOCK, DIM, gen=gen, device=device)     # filled by the (eager) prefills
    v_cache = randn(NUM_BLOCKS * BLOCK, DIM, gen=gen, device=device)
    seqs = {0: [0, 1, 2], 1: [3, 4, 5], 2: [6, 7, 8], 3: [9, 10, 11]}    # sequence -> its blocks
    lengths = {0: 2, 1: 1, 2: 2, 3: 1}                  # prompt lengths

    def batch(ids, step):
        """A decode step for sequences ``ids``: each one's next token, position, blocks, KV length."""
        return {"input_ids": torch.tensor([[(5 * i + step) % VOCAB for i in ids]], device=device),
                "position_ids": torch.tensor([[lengths[i] + step - 1 for i in ids]], device=device),
                "block_offsets": torch.tensor([seqs[i] for i in ids], device=device),
                "kv_seqlens": torch.tensor([lengths[i] + step for i in ids], device=device)}

    schedule = [batch([0, 1, 2], 1), batch([0, 1, 2, 3], 2), batch([0, 2, 3], 3), batch([1, 3], 4)]

    def eager():
        return [model.forward(s["input_ids"], s["position_ids"], k_cache, v_cache, s["block_offsets"],
                              s["kv_seqlens"]) for s in schedule]

    def served():
        runner = CUDAGraphRunner(CudaGraphMixin(model, (k_cache, v_cache), whole_buffers=(variant == "fix")), device)
        return [runner(**s).clone() for s in schedule]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
