"""Each warmup forward bumps the dummy batch's KV lengths in place; the next one reads unallocated pages.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/7373 ("[https://nvbugs/5485325][fix] Add a
postprocess to the model engine to fix the CUDA graph warmup issue when using speculative decoding";
cherry-picked as #7737; the same failure again for DSA in #15913: "on second run a OOB access will
occur and dirty sparseIdx will lead to IMA").
Symptom: with one-model speculative decoding (MTP) and CUDA graphs, engine start-up fails while
capturing the decode graphs (illegal memory access in attention), TensorRT-LLM PyTorch backend, Aug 2025.
Mechanism: the one-model MTP pre-process inside the forward advances ``attn_metadata.kv_lens_cuda``
in place by the tokens this step appends. ``CUDAGraphRunner.capture`` prepares the dummy batch once,
then runs the forward for every warmup step and for the capture on the same inputs. Each run starts
from the lengths the previous run left, so the second run advertises more KV tokens than the dummy
requests were allocated, and attention walks block-table entries past their pages.
Doctor: persistent-mutation (the forward updates a static input in place and the warmups accumulate
it), at ``_preprocess_inputs``.
Fix (upstream): a ``postprocess_fn`` run after each warmup forward and after the capture puts the
metadata back, so every run starts from the prepared single-step state.
"""
from __future__ import annotations

import torch

from ...engine import events
from ..kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/7373"
FAMILY = "persistent-buffer mutation"
KIND = "persistent-mutation"
SITE = "_preprocess_inputs"
SYMPTOM = "illegal memory access while capturing the speculative-decoding graphs"
DIM, PAGE, MAX_PAGES, NUM_PAGES, BATCH = 4, 2, 4, 12, 2
NEW_TOKENS = 2                  # the accepted token plus one draft token join the KV each step
WARMUP_STEPS = 2


class AttentionMetadata:
    def __init__(self, device):
        self.kv_lens_cuda = torch.zeros(BATCH, dtype=torch.long, device=device)
        self.block_table = torch.full((BATCH, MAX_PAGES), -1, dtype=torch.long, device=device)

    def prepare(self, kv_lens, block_table):
        self.kv_lens_cuda.copy_(kv_lens)
        self.block_table.copy_(block_table)


def _preprocess_inputs(attn_metadata):
    """One-model MTP: this step's accepted and draft tokens are part of the KV the attention sees."""
    attn_metadata.kv_lens_cuda += NEW_TOKENS


def attention(q, k_cache, attn_metadata):
    pos = torch.arange(MAX_PAGES * PAGE, device=q.device)
    valid = pos[None] < attn_metadata.kv_lens_cuda[:, None]
    page = attn_metadata.block_table[:, pos // PAGE]
    slot = torch.where(valid, page * PAGE + pos % PAGE, 0)
    k = k_cache.index_select(0, slot.flatten()).view(BATCH, MAX_PAGES * PAGE, DIM)
    scores = (q[:, None] * k).sum(-1).masked_fill(~valid, float("-inf"))
    return (torch.softmax(scores, -1)[..., None] * k).sum(1)


def forward(q, k_cache, attn_metadata):
    _preprocess_inputs(attn_metadata)
    return attention(q, k_cache, attn_metadata)


def pages_for(tokens, first):
    n = -(-tokens // PAGE)
    return [first + i for i in range(n)] + [-1] * (MAX_PAGES - n)


def dummy_batch(device):
    """Two generation dummies of one cached token, each allocated room for one step's tokens."""
    kv_lens = torch.tensor([1, 1], device=device)
    table = torch.tensor([pages_for(1 + NEW_TOKENS, 0), pages_for(1 + NEW_TOKENS, 2)], device=device)
    return kv_lens, table


def steps(device):
    """Two decode steps of two requests (cached lengths before the step; pages cover the step)."""
    gen = generator(7373)
    out = []
    for lens in ([2, 4], [4, 6]):
        table = torch.tensor([pages_for(8, 4), pages_for(8, 8)], device=device)
        out.append((randn(BATCH, DIM, gen=gen, device=device), torch.tensor(lens, device=device), table))
    return out


def run(variant: str, device: str = "cpu"):
    k_cache = randn(NUM_PAGES * PAGE, DIM, gen=generator(1), device=device)
    batches = steps(device)

    def eager():
        meta, outs = AttentionMetadata(device), []
        for q, lens, table in batches:
            meta.prepare(lens, table)
            outs.append(forward(q, k_cache, meta))
        return outs

    def served():
        meta = AttentionMetadata(device)
        q_buf = torch.zeros(BATCH, DIM, device=device)
        meta.prepare(*dummy_batch(device))
        saved = meta.kv_lens_cuda.clone() if variant == "fix" else None

        def postprocess():
            if saved is not None:
                meta.kv_lens_cuda.copy_(saved)

        events.static_buffers("CUDAGraphRunner", {"q": q_buf, "kv_lens_cuda": meta.kv_lens_cuda,
                                                  "block_table": meta.block_table})
        for _ in range(WARMUP_STEPS):
            with events.warmup():
                forward(q_buf, k_cache, meta)
            postprocess()
        g, out = capture(lambda: forward(q_buf, k_cache, meta), device=device, warmups=0,
                         owner="CUDAGraphRunner")
        postprocess()
        outs = []
        for q, lens, table in batches:
            meta.prepare(lens, table)
            q_buf.copy_(q)
            outs.append(replay(g, out).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
