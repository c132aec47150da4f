"""Padded decode rows keep the paged-attention slot sentinel -1; the indexed cache store wraps it to the last slot.

Upstream: https://github.com/huggingface/text-generation-inference/pull/2490 ("Prefix test - Different kind
of load test to trigger prefix test bugs.", commit a4e3e8c6): in ``FlashCausalLM.forward`` the graph path
goes from ``cuda_graph["slots"].fill_(-1)`` to ``cuda_graph["slots"].fill_(0)`` with the comment "This is
working only because block 0 is reserved for the healthcheck so it doesn't matter if we override it with
bogus values" (the PR's commit list: "Add comment for why slot 0 is OK."). The PR has no description beyond
its title; the program models the consequence of that diff.
Symptom: with flashinfer / flashdecoding attention, prefix caching and CUDA graphs, requests served in a
batch padded up to a captured size get wrong tokens; the prefix-caching load test of the PR was written to
trigger such bugs (text-generation-inference main, Sept 2024).
Mechanism: the decode graph runs at the captured batch size and the runner fills the padded rows' slots with
``-1``, the "skip" value of vLLM's ``reshape_and_cache`` kernel. With flashinfer / flashdecoding TGI stores
the cache with ``key_cache.view(-1, heads, dim)[slots] = key``, where ``-1`` is a Python index: every padded
row writes its key and value into the last slot of the cache. The block allocator hands out the highest
blocks first, so that slot belongs to a live request (here a prompt prefix kept in the prefix cache, which
every request of the batch reads) and the padded row's garbage replaces it.
Doctor: stale-padding, at ``reshape_and_cache`` (the cache store through the padded rows' slots).
Fix (upstream): pad slots with ``0``: block 0 is reserved for the health check and no request reads it.
"""
from __future__ import annotations

import torch

from workbench.engine import CUDAGraphMode, GraphManager, events
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/huggingface/text-generation-inference/pull/2490"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "reshape_and_cache"
SYMPTOM = "padded rows write their key/value into the cache's last slot, a prompt prefix the real rows attend to"
VOCAB, DIM, BLOCK, NUM_BLOCKS, MAX_BT = 12, 4, 2, 8, 3
MAX_S = BLOCK * MAX_BT
CUDA_GRAPHS = [1, 2, 4]


def reshape_and_cache(key, value, key_cache, value_cache, slots):
    """ATTENTION in {"flashdecoding", "flashinfer"}: an indexed store, no skip of negative slots."""
    key_cache.view(-1, DIM)[slots] = key
    value_cache.view(-1, DIM)[slots] = value


class Model:
    def __init__(self, device):
        gen = generator(2490)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos = randn(MAX_S, DIM, gen=gen, device=device, scale=0.5)
        self.wq, self.wk, self.wv = (randn(DIM, DIM, gen=gen, device=device, scale=0.5) for _ in range(3))
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)

    def kv(self, input_ids, position_ids):
        h = self.emb[input_ids] + self.pos[position_ids]
        return h, h @ self.wk, h @ self.wv

    def forward(self, input_ids, position_ids, kv_cache, block_tables, slots, input_lengths, max_s):
        """One decode token per sequence: store its key/value, then paged attention over ``max_s``
        positions found through ``block_tables`` (masked past each ``input_lengths``)."""
        k_cache, v_cache = kv_cache
        h, k, v = self.kv(input_ids, position_ids)
        reshape_and_cache(k, v, k_cache, v_cache, slots)
        pos = torch.arange(max_s, device=h.device)
        kv_slots = block_tables[:, pos // BLOCK] * BLOCK + pos % BLOCK
        kc, vc = k_cache.view(-1, DIM)[kv_slots], v_cache.view(-1, DIM)[kv_slots]
        scores = ((h @ self.wq)[:, None, :] * kc).sum(-1) / DIM ** 0.5
        scores = scores.masked_fill(pos[None, :] >= input_lengths[:, None], float("-inf"))
        return (torch.softmax(scores, -1)[..., None] * vc).sum(1) @ self.lm_head


def prefill(model, kv_cache, tokens, start, blocks):
    """Eager prefill of ``tokens`` at positions ``start...`` of a sequence owning ``blocks``."""
    k_cache, v_cache = kv_cache
    pos = torch.arange(start, start + len(tokens), device=k_cache.device)
    slots = torch.tensor(blocks, device=k_cache.device)[pos // BLOCK] * BLOCK + pos % BLOCK
    _, k, v = model.kv(torch.tensor(tokens, device=k_cache.device), pos)
    reshape_and_cache(k, v, k_cache, v_cache, slots)


PREFIX, PREFIX_BLOCK = [3, 7], NUM_BLOCKS - 1      # a shared prompt prefix, in the highest block


def requests():
    """(own prompt token, block table): every table starts with the prefix block (prefix caching);
    the allocator hands out blocks from the top, block 0 stays reserved."""
    return [([5], [PREFIX_BLOCK, 6, 3]), ([9], [PREFIX_BLOCK, 5, 2]), ([1], [PREFIX_BLOCK, 4, 1])]


def steps(device):
    """Three decode steps: all three requests twice, then the first two (the third one finished)."""
    out = []
    for step, n in enumerate((3, 3, 2)):
        ids, positions, tables, slots, lengths = [], [], [], [], []
        for i, (_, table) in enumerate(requests()[:n]):
            p = len(PREFIX) + 1 + step
            ids.append((4 + 3 * i + 5 * step) % VOCAB)
            positions.append(p)
            tables.append(table)
            slots.append(table[p // BLOCK] * BLOCK + p % BLOCK)
            lengths.append(p + 1)
        out.append(tuple(torch.tensor(v, device=device) for v in (ids, positions, tables, slots))
                   + (torch.tensor(lengths, dtype=torch.int32, device=device),))
    return out


def run(variant: str, device: str = "cpu"):
    model = Model(device)

    def empty_cache():
        return (torch.zeros(NUM_BLOCKS, BLOCK, DIM, device=device),
                torch.zeros(NUM_BLOCKS, BLOCK, DIM, device=device))

    def admit(kv_cache):
        for own, table in requests():
            prefill(model, kv_cache, PREFIX + own, 0, table)

    def eager():
        kv_cache, logits = empty_cache(), []
        admit(kv_cache)
        for input_ids, position_ids, block_tables, slots, input_lengths in steps(device):
            logits.append(model.forward(input_ids, position_ids, kv_cache, block_tables, slots,
                                        input_lengths, int(input_lengths.max())))
        return logits

    def served():
        kv_cache = empty_cache()
        events.persistent_state("FlashCausalLM", {"k_cache": kv_cache[0], "v_cache": kv_cache[1]})
        cuda_graphs = {}
        for bs in CUDA_GRAPHS:                              # cuda_graph_warmup(bs, max_s, max_bt)
            cuda_graphs[bs] = {
                "input_ids": torch.zeros(bs, dtype=torch.int64, device=device),
                "position_ids": torch.zeros(bs, dtype=torch.int64, device=device),
                "block_tables": torch.arange(MAX_BT, device=device).repeat(bs).reshape(bs, MAX_BT),
                "slots": torch.arange(bs, dtype=torch.int64, device=device),
                "input_lengths": torch.ones(bs, dtype=torch.int32, device=device) * MAX_S,
            }

        def forward(bs):
            v = cuda_graphs[bs]
            return model.forward(v["input_ids"], v["position_ids"], kv_cache, v["block_tables"], v["slots"],
                                 v["input_lengths"], MAX_S)

        graphs = GraphManager(forward, CUDA_GRAPHS, device=device, mode=CUDAGraphMode.FULL, num_warmups=1,
                              static_buffers=lambda bs: cuda_graphs[bs], name="FlashCausalLM cuda graphs")
        graphs.capture()                                    # sorted descending, one MEM_POOL
        admit(kv_cache)                                     # then the requests arrive (eager prefill)
        logits = []
        for input_ids, position_ids, block_tables, slots, input_lengths in steps(device):
            n = input_ids.shape[0]
            bs = graphs.dispatch(n)
            v = cuda_graphs[bs]
            v["input_ids"][:n] = input_ids
            v["position_ids"][:n] = position_ids
            v["block_tables"][:n, :block_tables.shape[1]] = block_tables
            v["slots"].fill_(-1 if variant == "bug" else 0)
            v["slots"][:n] = slots
            v["input_lengths"].zero_()
            v["input_lengths"][:n] = input_lengths
            out = graphs.replay(bs, n, padded={"input_ids": v["input_ids"], "position_ids": v["position_ids"],
                                               "block_tables": v["block_tables"]})
            logits.append(out.clone())
        return logits

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
