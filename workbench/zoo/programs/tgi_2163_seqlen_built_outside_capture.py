"""Cumulative KV lengths computed once, before capture: every replay attends over the warmup's lengths.

Upstream: https://github.com/huggingface/text-generation-inference/pull/2163 ("Fixing graph capture for
flash decoding", commit 022f6515).
Symptom: with flash decoding (``FLASH_DECODING=1``) and CUDA graphs, decode steps served by a graph
attend over the key ranges of the capture (text-generation-inference main, July 2024). The PR has no
description beyond its title; the program models the consequence of its diff.
Mechanism: ``cuda_graph_warmup`` wrapped the static ``input_lengths`` buffer in a ``Seqlen`` before the
warmup run, outside ``torch.cuda.graph``, and passed that object to the capture too. ``Seqlen.__init__``
computes ``cu_seqlen_k = cumsum(input_lengths)``, so the cumulative lengths were computed once, from the
warmup's lengths (``max_s`` for every row), and the capture recorded only their reads. Each decode step
copies the batch's lengths into ``input_lengths``, but no replay recomputes ``cu_seqlen_k``: attention
keeps reading ``max_s`` keys per sequence, past the end of each real sequence.
Doctor: warmup-divergence, at ``__init__`` (of ``Seqlen``: the cumsum that ran before capture and is
not in the graph).
Fix (upstream): build the ``Seqlen`` inside the captured block, so its cumsum is recorded and reruns
on every replay.
"""
from __future__ import annotations

import torch

from ..kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/huggingface/text-generation-inference/pull/2163"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "__init__"
SYMPTOM = "decode attends over max_s keys per sequence: reads past the end of every sequence"
VOCAB, DIM, BLOCK, MAX_BT, BS = 12, 4, 2, 3, 2
MAX_S = BLOCK * MAX_BT


class Seqlen:
    """Flash-decoding sequence lengths: per-sequence lengths and their cumulative offsets."""

    def __init__(self, input_lengths):
        self.input_lengths = input_lengths
        device = self.input_lengths.device
        shape = self.input_lengths.shape
        self.cu_seqlen_q = torch.arange(shape[0] + 1, device=device, dtype=torch.int32)
        cu_seqlen_k = torch.zeros(shape[-1] + 1, device=device, dtype=torch.int32)
        torch.cumsum(self.input_lengths, -1, out=cu_seqlen_k[1:])
        self.cu_seqlen_k = cu_seqlen_k


class Model:
    def __init__(self, device):
        gen = generator(2163)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos = randn(MAX_S, DIM, gen=gen, device=device, scale=0.5)
        self.wq, self.wk, self.wv = (randn(DIM, DIM, gen=gen, device=device, scale=0.5) for _ in range(3))
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)

    def kv(self, input_ids, position_ids):
        h = self.emb[input_ids] + self.pos[position_ids]
        return h, h @ self.wk, h @ self.wv

    def forward(self, input_ids, position_ids, kv_cache, block_tables, slots, input_lengths: Seqlen, max_s):
        """One decode token per sequence: store its key/value, then paged attention (varlen over
        ``cu_seqlen_k``, keys found through ``block_tables``)."""
        k_cache, v_cache = kv_cache
        h, k, v = self.kv(input_ids, position_ids)
        k_cache[slots] = k
        v_cache[slots] = v
        seqlens_k = input_lengths.cu_seqlen_k[1:] - input_lengths.cu_seqlen_k[:-1]
        pos = torch.arange(max_s, device=h.device)
        kv_slots = block_tables[:, pos // BLOCK] * BLOCK + pos % BLOCK         # [bs, max_s]
        scores = ((h @ self.wq)[:, None, :] * k_cache[kv_slots]).sum(-1) / DIM ** 0.5
        scores = scores.masked_fill(pos[None, :] >= seqlens_k[:, None], float("-inf"))
        attn = (torch.softmax(scores, -1)[..., None] * v_cache[kv_slots]).sum(1)
        return attn @ self.lm_head


def prefill(model, kv_cache, prompt, blocks):
    """Eager prefill: store the prompt's keys/values in the sequence's blocks."""
    k_cache, v_cache = kv_cache
    pos = torch.arange(len(prompt), device=k_cache.device)
    slots = torch.tensor(blocks, device=k_cache.device)[pos // BLOCK] * BLOCK + pos % BLOCK
    _, k, v = model.kv(torch.tensor(prompt, device=k_cache.device), pos)
    k_cache[slots] = k
    v_cache[slots] = v


def requests():
    """Two sequences (prompts of 2 and 3 tokens, blocks [1, 2, 0] and [3, 4, 5]), decoded for 3 steps."""
    return [([3, 7], [1, 2, 0]), ([5, 1, 9], [3, 4, 5])]


def run(variant: str, device: str = "cpu"):
    model = Model(device)

    def empty_cache():
        return (torch.zeros((MAX_BT * 2 + 1) * BLOCK, DIM, device=device),
                torch.zeros((MAX_BT * 2 + 1) * BLOCK, DIM, device=device))

    def steps():
        """Per decode step: input_ids, position_ids, block_tables, slots, input_lengths."""
        out = []
        for step in range(3):
            ids, positions, tables, slots, lengths = [], [], [], [], []
            for i, (prompt, blocks) in enumerate(requests()):
                p = len(prompt) + step
                ids.append((prompt[-1] + 2 * step + i) % VOCAB)
                positions.append(p)
                tables.append(blocks)
                slots.append(blocks[p // BLOCK] * BLOCK + p % BLOCK)
                lengths.append(p + 1)
            out.append(tuple(torch.tensor(v, device=device) for v in (ids, positions, tables, slots))
                       + (torch.tensor(lengths, dtype=torch.int32, device=device),))
        return out

    def eager():
        kv_cache, logits = empty_cache(), []
        for prompt, blocks in requests():
            prefill(model, kv_cache, prompt, blocks)
        for input_ids, position_ids, block_tables, slots, input_lengths in steps():
            logits.append(model.forward(input_ids, position_ids, kv_cache, block_tables, slots,
                                        Seqlen(input_lengths), MAX_S))
        return logits

    def served():
        kv_cache = empty_cache()
        # at startup: cuda_graph_warmup(bs, max_s, max_bt)
        graph_vars = {
            "input_ids": torch.zeros(BS, dtype=torch.int64, device=device),
            "position_ids": torch.zeros(BS, dtype=torch.int64, device=device),
            "block_tables": torch.arange(MAX_BT, device=device).repeat(BS).reshape(BS, MAX_BT),
            "slots": torch.arange(BS, dtype=torch.int64, device=device),
            "input_lengths": torch.ones(BS, dtype=torch.int32, device=device) * MAX_S,
        }
        v = graph_vars

        if variant == "bug":
            input_lengths = Seqlen(input_lengths=v["input_lengths"])     # built once, before the warmup

            def step():
                return model.forward(v["input_ids"], v["position_ids"], kv_cache, v["block_tables"], v["slots"],
                                     input_lengths, MAX_S)
        else:
            def step():
                input_lengths = Seqlen(input_lengths=v["input_lengths"])  # built inside the captured block
                return model.forward(v["input_ids"], v["position_ids"], kv_cache, v["block_tables"], v["slots"],
                                     input_lengths, MAX_S)

        g, logits_buf = capture(step, device=device, static=graph_vars, state={"kv_cache": kv_cache[0],
                                "v_cache": kv_cache[1]}, owner="FlashCausalLM cuda graphs")
        for prompt, blocks in requests():                                # then the requests arrive
            prefill(model, kv_cache, prompt, blocks)
        logits = []
        for input_ids, position_ids, block_tables, slots, lengths in steps():
            n = input_ids.shape[0]
            v["input_ids"][:n] = input_ids
            v["position_ids"][:n] = position_ids
            v["block_tables"][:n, :block_tables.shape[1]] = block_tables
            v["slots"].fill_(-1)
            v["slots"][:n] = slots
            v["input_lengths"].zero_()
            v["input_lengths"][:n] = lengths
            logits.append(replay(g, logits_buf)[:n].clone())
        return logits

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
