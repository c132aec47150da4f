"""Triton backend + CUDA graphs: the capture's dummy rows read ``req_to_token`` row 0, which ``torch.empty`` left uninitialised.

Upstream: https://github.com/sgl-project/sglang/pull/1782 ("[Fix] Fix cuda graph padding for triton
attention backend").
Symptom: with ``--attention-backend triton`` and CUDA graphs, the server sometimes dies at startup
with an illegal memory access while capturing the decode graphs (sglang, October 2024); with
``--disable-cuda-graph`` it starts, and the flashinfer backend (seq-len fill value 0) does not hit it.
Mechanism: ``CudaGraphRunner`` captures every batch size on a dummy batch: ``req_pool_indices`` are 0
and ``seq_lens`` the backend's fill value (1 for triton: its decode kernel needs at least one key).
The same fill is used for the padded rows of a replayed batch. The triton decode kernel reads the
``seq_len`` token indices ``req_to_token[req_pool_idx, :seq_len]`` of every row, so the dummy rows read
``req_to_token[0, 0]``. ``ReqToTokenPool`` allocated ``req_to_token`` with ``torch.empty``; at capture
no request has been scheduled, so row 0 holds whatever the allocator's previous owner left there (the
profiling run), and the kernel gathers the KV cache at that garbage index: out-of-bound access.
Eager decode runs only real rows, whose ``req_to_token`` entries the scheduler wrote.
Doctor: stale-padding, at ``decode_attention_fwd`` (the dummy/padded rows' token index comes from a
``req_to_token`` row that no request wrote).
Fix (upstream): allocate ``req_to_token`` with ``torch.zeros``, so dummy and padded rows read token
slot 0, a valid (reserved) slot; then every backend can use a seq-len fill value of 1 and
``get_cuda_graph_seq_len_fill_value`` goes away.
"""
from __future__ import annotations

import bisect
import math

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/1782"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "decode_attention_fwd"
SYMPTOM = "triton backend: illegal memory access while capturing the decode CUDA graphs (startup crash)"
VOCAB, DIM, POOL_SIZE, MAX_CONTEXT_LEN, KV_SLOTS = 10, 4, 4, 6, 24
CAPTURE_BS = [1, 2, 4]
# What an uninitialised device allocation held (the profiling run's activations reinterpreted as
# int32): far past any KV slot. torch.empty on the CPU would give arbitrary bytes too; a fixed value
# keeps the program deterministic.
_LEFTOVER = 1 << 28


def empty_device(shape, dtype, device) -> torch.Tensor:
    """``torch.empty`` on the device: the block holds whatever its previous owner wrote."""
    return torch.empty(shape, dtype=dtype, device=device).fill_(_LEFTOVER)


class ReqToTokenPool:
    def __init__(self, size: int, max_context_len: int, device, variant: str):
        self.size = size
        self.max_context_len = max_context_len
        self.device = device
        if variant == "bug":
            self.req_to_token = empty_device((size, max_context_len), dtype=torch.int32, device=device)
        else:
            self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32, device=device)
        self.free_slots = list(range(size))

    def alloc(self) -> int:
        return self.free_slots.pop(0)


def decode_attention_fwd(q, k_buffer, v_buffer, req_to_token, b_req_idx, b_seq_len):
    """Triton decode attention: row i attends over ``req_to_token[b_req_idx[i], :b_seq_len[i]]``."""
    n, max_len = q.shape[0], req_to_token.shape[1]
    pos = torch.arange(max_len, device=q.device)
    valid = pos[None, :] < b_seq_len[:, None].long()
    kv_loc = req_to_token[b_req_idx.long()].long()                      # [n, max_len]
    # the kernel loads only positions < seq_len; masked lanes never touch memory
    kv_loc = torch.where(valid, kv_loc, torch.zeros_like(kv_loc))
    k, v = k_buffer[kv_loc], v_buffer[kv_loc]                            # out of bounds: IMA
    scores = (k @ q.unsqueeze(-1)).squeeze(-1) / math.sqrt(q.shape[-1])
    p = torch.softmax(scores.masked_fill(~valid, float("-inf")), -1)
    return (p.unsqueeze(-1) * v).sum(1)


class LlamaForCausalLM:
    def __init__(self, device):
        gen = generator(1782)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq, self.wk, self.wv = (randn(DIM, DIM, gen=gen, device=device, scale=0.5) for _ in range(3))
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)

    def forward(self, input_ids, req_pool_indices, seq_lens, out_cache_loc, pools):
        req_to_token, k_buffer, v_buffer = pools
        x = self.embed[input_ids.long()]
        k_buffer[out_cache_loc.long()] = x @ self.wk                       # store this token's KV
        v_buffer[out_cache_loc.long()] = x @ self.wv
        o = decode_attention_fwd(x @ self.wq, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens)
        return (x + o) @ self.lm_head


class CudaGraphRunner:
    def __init__(self, model, pools, device):
        self.model, self.pools, self.device = model, pools, device
        self.capture_bs = CAPTURE_BS
        self.max_bs = max(self.capture_bs)
        self.seq_len_fill_value = 1                                          # triton backend
        self.input_ids = torch.zeros((self.max_bs,), dtype=torch.int32, device=device)
        self.req_pool_indices = torch.zeros((self.max_bs,), dtype=torch.int32, device=device)
        self.seq_lens = torch.full((self.max_bs,), self.seq_len_fill_value, dtype=torch.int32, device=device)
        self.out_cache_loc = torch.zeros((self.max_bs,), dtype=torch.int32, device=device)
        self.graphs, self.output_buffers = {}, {}
        self.capture()

    def capture(self):
        pool = graph_pool_handle(self.device)
        req_to_token, k_buffer, v_buffer = self.pools
        for bs in reversed(self.capture_bs):
            def run_once(bs=bs):
                return self.model.forward(self.input_ids[:bs], self.req_pool_indices[:bs], self.seq_lens[:bs],
                                          self.out_cache_loc[:bs], self.pools)
            self.graphs[bs], self.output_buffers[bs] = capture(
                run_once, device=self.device, pool=pool, warmups=2, name=f"bs {bs}",
                static={"input_ids": self.input_ids, "req_pool_indices": self.req_pool_indices,
                        "seq_lens": self.seq_lens, "out_cache_loc": self.out_cache_loc},
                state={"req_to_token": req_to_token, "k_buffer": k_buffer, "v_buffer": v_buffer},
                owner="CudaGraphRunner (decode)")

    def replay(self, input_ids, req_pool_indices, seq_lens, out_cache_loc):
        raw_bs = input_ids.shape[0]
        bs = self.capture_bs[bisect.bisect_left(self.capture_bs, raw_bs)]
        if bs != raw_bs:
            self.seq_lens.fill_(self.seq_len_fill_value)
            self.out_cache_loc.zero_()
        self.input_ids[:raw_bs].copy_(input_ids)
        self.req_pool_indices[:raw_bs].copy_(req_pool_indices)
        self.seq_lens[:raw_bs].copy_(seq_lens)
        self.out_cache_loc[:raw_bs].copy_(out_cache_loc)
        return replay(self.graphs[bs], self.output_buffers[bs], real=raw_bs, size=bs, padded={})[:raw_bs].clone()


# Three requests prefilled, then three decode steps (3 rows: the size-4 graph, one padded row).
PROMPTS = [[4, 2, 7], [5, 1], [6]]
DECODE = [[3, 6, 2], [8, 2, 5], [1, 9, 4]]


def run(variant: str, device: str = "cpu"):
    model = LlamaForCausalLM(device)

    def serve(graphed: bool):
        req_to_token_pool = ReqToTokenPool(POOL_SIZE, MAX_CONTEXT_LEN, device, variant)
        k_buffer = torch.zeros(KV_SLOTS, DIM, device=device)
        v_buffer = torch.zeros(KV_SLOTS, DIM, device=device)
        pools = (req_to_token_pool.req_to_token, k_buffer, v_buffer)
        runner = CudaGraphRunner(model, pools, device) if graphed else None   # captured at startup
        next_slot = 1                                                        # slot 0: reserved dummy slot
        reqs = []
        for prompt in PROMPTS:                                               # prefill (eager in both)
            r = req_to_token_pool.alloc()
            slots = list(range(next_slot, next_slot + len(prompt)))
            next_slot += len(prompt)
            req_to_token_pool.req_to_token[r, :len(prompt)] = torch.tensor(slots, dtype=torch.int32, device=device)
            x = model.embed[torch.tensor(prompt, device=device)]
            k_buffer[slots], v_buffer[slots] = x @ model.wk, x @ model.wv
            reqs.append([r, len(prompt)])
        outs = []
        for tokens in DECODE:
            for req in reqs:                                                 # allocate this token's slot
                req_to_token_pool.req_to_token[req[0], req[1]] = next_slot
                next_slot += 1
                req[1] += 1
            input_ids = torch.tensor(tokens, dtype=torch.int32, device=device)
            req_pool_indices = torch.tensor([r for r, _ in reqs], dtype=torch.int32, device=device)
            seq_lens = torch.tensor([n for _, n in reqs], dtype=torch.int32, device=device)
            out_cache_loc = req_to_token_pool.req_to_token[req_pool_indices.long(), seq_lens.long() - 1].clone()
            if graphed:
                outs.append(runner.replay(input_ids, req_pool_indices, seq_lens, out_cache_loc))
            else:
                outs.append(model.forward(input_ids, req_pool_indices, seq_lens, out_cache_loc, pools).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
