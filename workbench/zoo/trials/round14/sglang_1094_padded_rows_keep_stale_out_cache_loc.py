"""Padded decode rows keep the previous batch's ``out_cache_loc`` / ``seq_lens``: the graph writes their KV into a live slot.

Upstream: https://github.com/sgl-project/sglang/pull/1094 ("Fix a bug in cuda graph runner").
Symptom: with CUDA graphs on (the default since v0.2.x), a decode batch whose size is not a captured
batch size is padded up to one; the server "sometimes reports illegal memory access" (sglang v0.2.12,
August 2024). Runs with ``--disable-cuda-graph`` are clean.
Mechanism: ``CudaGraphRunner.replay`` picks the smallest captured ``bs >= raw_bs`` and copies only the
first ``raw_bs`` rows of the batch into its static buffers (``input_ids``, ``req_pool_indices``,
``seq_lens``, ``position_ids_offsets``, ``out_cache_loc``). Rows ``[raw_bs, bs)`` keep whatever an
earlier, larger batch left there. The captured forward still runs them: the attention backend reads
``req_to_token[req_pool_indices, :seq_lens]`` for the stale lengths (out of bounds once the request
that owned them is gone: the IMA), and ``store_kv_cache`` writes the padded rows' K/V to the stale
``out_cache_loc`` -- a KV slot that was freed when its request finished and that the allocator has
since handed to another request. That request's cached K/V is overwritten with the padded row's, so
its attention (and every later step) reads the wrong key/value: silently wrong tokens when the slot
is reused, an illegal memory access when the stale lengths run off the table.
Doctor: stale-padding, at ``store_kv_cache`` (the padded rows' KV write goes to a slot taken from what
the previous batch left in ``out_cache_loc``).
Fix (upstream): when ``bs != raw_bs``, reset the padding before copying the real rows:
``seq_lens.zero_()``, ``position_ids_offsets.fill_(1)``, ``out_cache_loc.zero_()`` (slot 0 is the
reserved dummy slot), so padded rows attend over nothing and write only to the dummy slot.
"""
from __future__ import annotations

import bisect
import math

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/1094"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "store_kv_cache"
SYMPTOM = "padded decode rows write K/V into a reused slot of a live request (IMA or silently wrong tokens)"
VOCAB, DIM, POOL_SIZE, MAX_CONTEXT_LEN, KV_SLOTS, MAX_POS = 12, 4, 6, 8, 32, 16
BATCH_SIZE_LIST = [1, 2, 4]


class ReqToTokenPool:
    def __init__(self, device):
        self.req_to_token = torch.zeros((POOL_SIZE, MAX_CONTEXT_LEN), dtype=torch.int32, device=device)
        self.free_slots = list(range(POOL_SIZE))

    def alloc(self) -> int:
        return self.free_slots.pop(0)

    def free(self, idx: int) -> None:
        self.free_slots.append(idx)                  # the row itself is not cleared


class TokenToKVPool:
    """KV slots; slot 0 is reserved as the dummy slot (never handed out)."""

    def __init__(self, device):
        self.k_buffer = torch.zeros(KV_SLOTS, DIM, device=device)
        self.v_buffer = torch.zeros(KV_SLOTS, DIM, device=device)
        self.free_slots = list(range(1, KV_SLOTS))

    def alloc(self, n: int) -> list[int]:
        out, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return out

    def free(self, slots: list[int]) -> None:
        self.free_slots = list(slots) + self.free_slots   # freed slots are reused first


def store_kv_cache(k_buffer, v_buffer, out_cache_loc, cache_k, cache_v):
    """RadixAttention.store_kv_cache: this step's K/V of every row go to its ``out_cache_loc`` slot."""
    k_buffer[out_cache_loc.long()] = cache_k
    v_buffer[out_cache_loc.long()] = cache_v


def decode_attention(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens):
    """Row i attends over ``req_to_token[req_pool_indices[i], :seq_lens[i]]`` (zero rows: no keys)."""
    pos = torch.arange(MAX_CONTEXT_LEN, device=q.device)
    valid = pos[None, :] < seq_lens[:, None].long()
    kv_loc = torch.where(valid, req_to_token[req_pool_indices.long()].long(), torch.zeros_like(pos))
    k, v = k_buffer[kv_loc], v_buffer[kv_loc]
    scores = (k @ q.unsqueeze(-1)).squeeze(-1) / math.sqrt(DIM)
    p = torch.softmax(scores.masked_fill(~valid, float("-inf")), -1).nan_to_num(0.0)
    return (p.unsqueeze(-1) * v).sum(1)


class LlamaForCausalLM:
    def __init__(self, device):
        gen = generator(1094)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos_embed = randn(MAX_POS, DIM, gen=gen, device=device, scale=0.5)
        self.wq, self.wk, self.wv = (randn(DIM, DIM, gen=gen, device=device, scale=0.5) for _ in range(3))
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)

    def forward(self, input_ids, req_pool_indices, seq_lens, position_ids_offsets, out_cache_loc, pools):
        req_to_token, k_buffer, v_buffer = pools
        positions = (seq_lens - 1 + position_ids_offsets).long().clamp(min=0)
        x = self.embed[input_ids.long()] + self.pos_embed[positions]
        store_kv_cache(k_buffer, v_buffer, out_cache_loc, x @ self.wk, x @ self.wv)
        o = decode_attention(x @ self.wq, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens)
        return (x + o) @ self.lm_head


class CudaGraphRunner:
    def __init__(self, model, pools, device, variant):
        self.model, self.pools, self.device, self.variant = model, pools, device, variant
        self.batch_size_list = BATCH_SIZE_LIST
        self.max_bs = max(self.batch_size_list)
        self.input_ids = torch.zeros((self.max_bs,), dtype=torch.int32, device=device)
        self.req_pool_indices = torch.zeros((self.max_bs,), dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros((self.max_bs,), dtype=torch.int32, device=device)
        self.position_ids_offsets = torch.ones((self.max_bs,), dtype=torch.int32, device=device)
        self.out_cache_loc = torch.zeros((self.max_bs,), dtype=torch.int32, device=device)
        self.graphs, self.output_buffers = {}, {}
        self.capture()

    def capture(self):
        pool = graph_pool_handle(self.device)
        req_to_token, k_buffer, v_buffer = self.pools
        for bs in reversed(self.batch_size_list):
            def run_once(bs=bs):
                return self.model.forward(self.input_ids[:bs], self.req_pool_indices[:bs], self.seq_lens[:bs],
                                          self.position_ids_offsets[:bs], self.out_cache_loc[:bs], self.pools)
            self.graphs[bs], self.output_buffers[bs] = capture(
                run_once, device=self.device, pool=pool, name=f"bs {bs}",
                static={"input_ids": self.input_ids, "req_pool_indices": self.req_pool_indices,
                        "seq_lens": self.seq_lens, "position_ids_offsets": self.position_ids_offsets,
                        "out_cache_loc": self.out_cache_loc},
                state={"req_to_token": req_to_token, "k_buffer": k_buffer, "v_buffer": v_buffer},
                owner="CudaGraphRunner (decode)")

    def replay(self, batch):
        raw_bs = batch["input_ids"].shape[0]

        # Pad
        index = bisect.bisect_left(self.batch_size_list, raw_bs)
        bs = self.batch_size_list[index]
        if bs != raw_bs and self.variant == "fix":
            self.seq_lens.zero_()
            self.position_ids_offsets.fill_(1)
            self.out_cache_loc.zero_()

        # Common inputs
        self.input_ids[:raw_bs] = batch["input_ids"]
        self.req_pool_indices[:raw_bs] = batch["req_pool_indices"]
        self.seq_lens[:raw_bs] = batch["seq_lens"]
        self.position_ids_offsets[:raw_bs] = batch["position_ids_offsets"]
        self.out_cache_loc[:raw_bs] = batch["out_cache_loc"]

        padded = {} if self.variant == "fix" else {
            "input_ids": self.input_ids, "req_pool_indices": self.req_pool_indices, "seq_lens": self.seq_lens,
            "position_ids_offsets": self.position_ids_offsets, "out_cache_loc": self.out_cache_loc}
        out = replay(self.graphs[bs], self.output_buffers[bs], real=raw_bs, size=bs, padded=padded)
        return out[:raw_bs].clone()


def run(variant: str, device: str = "cpu"):
    model = LlamaForCausalLM(device)

    def serve(graphed: bool):
        req_pool = ReqToTokenPool(device)
        kv_pool = TokenToKVPool(device)
        pools = (req_pool.req_to_token, kv_pool.k_buffer, kv_pool.v_buffer)
        runner = CudaGraphRunner(model, pools, device, variant) if graphed else None
        reqs = {}                                             # name -> [pool idx, slots, last token]

        def prefill(name, prompt):
            r = req_pool.alloc()
            slots = kv_pool.alloc(len(prompt))
            req_pool.req_to_token[r, :len(prompt)] = torch.tensor(slots, dtype=torch.int32, device=device)
            pos = torch.arange(len(prompt), device=device)
            x = model.embed[torch.tensor(prompt, device=device)] + model.pos_embed[pos]
            kv_pool.k_buffer[slots], kv_pool.v_buffer[slots] = x @ model.wk, x @ model.wv
            reqs[name] = [r, slots, prompt[-1] + 1]

        def finish(name):
            r, slots, _ = reqs.pop(name)
            req_pool.free(r)
            kv_pool.free(slots)

        def decode(names):
            for n in names:                                   # allocate this step's slot
                r, slots, _ = reqs[n]
                slot = kv_pool.alloc(1)[0]
                req_pool.req_to_token[r, len(slots)] = slot
                slots.append(slot)
            batch = {
                "input_ids": torch.tensor([reqs[n][2] % VOCAB for n in names], dtype=torch.int32, device=device),
                "req_pool_indices": torch.tensor([reqs[n][0] for n in names], dtype=torch.int32, device=device),
                "seq_lens": torch.tensor([len(reqs[n][1]) for n in names], dtype=torch.int32, device=device),
                "position_ids_offsets": torch.zeros(len(names), dtype=torch.int32, device=device),
                "out_cache_loc": torch.tensor([reqs[n][1][-1] for n in names], dtype=torch.int32, device=device),
            }
            if graphed:
                logits = runner.replay(batch)
            else:
                logits = model.forward(*batch.values(), pools).clone()
            for n, t in zip(names, logits.argmax(-1).tolist()):
                reqs[n][2] = t
            return logits

        outs = []
        for name, prompt in zip("ABCD", ([3, 5], [7, 1, 2], [4], [9, 6])):
            prefill(name, prompt)
        outs.append(decode(list("ABCD")))                     # bs 4, no padding
        finish("C")
        finish("D")                                           # D's slots (incl. its last decode slot) freed
        prefill("E", [2, 8, 10])                              # E's prompt reuses D's freed slots
        outs.append(decode(list("ABE")))                      # raw_bs 3 -> graph bs 4, one padded row
        outs.append(decode(list("ABE")))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
