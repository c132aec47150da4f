"""A prefill graph bucket captured as one synthetic request longer than the context: attention reads past its page-table row.

Upstream: https://github.com/sgl-project/sglang/pull/30206 ("fix(server): capture legal multi-request
prefill CUDA graph batches"), fixing https://github.com/sgl-project/sglang/issues/21112 (first
mitigated by #22516, which clamped the prefill graph token ceiling to ``context_length``).
Symptom: with ``--context-length`` smaller than the largest prefill CUDA-graph token bucket (default
8192), start-up dies during prefill graph warmup with ``CUDA error: an illegal memory access`` (FA3,
``kvcache.cuh``, ``FusedAddRMSNorm``) or ``The expanded size of the tensor (2052) must match the
existing size (8192)`` (sglang main, 2026).
Mechanism: the capture path builds one synthetic request with ``seq_len = num_tokens`` for every
token bucket. The request's page-table row (from ``req_to_token``) holds at most ``context_length``
entries, so the copy into the static ``page_table`` silently keeps only those, while
``cache_seqlens`` tells the attention kernel that the request has ``num_tokens`` keys. The kernel
walks ``page_table`` past the end of the row, and for a bucket larger than the whole table, past the
buffer itself.
Doctor: undersized-buffer, at ``flash_attn_with_kvcache`` (the kernel's page-table read past the row
the capture batch fits in).
Fix (upstream): resolve legal buckets once (cap them at ``context_length * max_capture_requests``)
and split each bucket into the fewest synthetic requests with ``seq_len <= context_length``; unused
request slots of the ``full`` backend get zero-length sentinels.
"""
from __future__ import annotations

import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/30206"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "flash_attn_with_kvcache"
SYMPTOM = "start-up crash (illegal memory access) while warming up a prefill graph bucket longer than the context"
VOCAB, DIM, CONTEXT_LEN, KV_SLOTS, POOL_ROWS = 10, 4, 6, 40, 6
MAX_CAPTURE_REQUESTS = 2                 # fixed request axis of the full prefill graph backend
PREFILL_BUCKETS = (4, 8, 16)             # --cuda-graph prefill token buckets (default list, larger than the context)


def flash_attn_with_kvcache(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q, positions, max_seqlen_k):
    """Paged varlen attention: token t of request b attends to keys at positions p <= its own and
    p < cache_seqlens[b], found through page_table[b, p] (the kernel indexes the table by address)."""
    num_tokens = q.shape[0]
    tok = torch.arange(num_tokens, device=q.device)
    b = torch.searchsorted(cu_seqlens_q[1:], tok, right=True)
    p = torch.arange(max_seqlen_k, device=q.device)
    valid = (p[None, :] <= positions[:, None]) & (p[None, :] < cache_seqlens[b][:, None])
    idx = torch.where(valid, b[:, None] * page_table.stride(0) + p[None, :], torch.zeros_like(p)[None, :])
    slots = page_table.reshape(-1)[idx]
    scores = (q[:, None, :] * k_cache[slots]).sum(-1) / math.sqrt(DIM)
    probs = torch.softmax(scores.masked_fill(~valid, float("-inf")), dim=-1)
    return (probs[..., None] * v_cache[slots]).sum(1)


class Model:
    def __init__(self, device):
        gen = generator(30206)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos_emb = randn(16, DIM, gen=gen, device=device, scale=0.5)
        self.wq, self.wk, self.wv = (randn(DIM, DIM, gen=gen, device=device, scale=0.5) for _ in range(3))
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)

    def forward(self, input_ids, positions, out_cache_loc, kv_cache, seq_lens, cu_seqlens_q, page_table, max_seqlen_k):
        k_cache, v_cache = kv_cache
        h = self.emb[input_ids] + self.pos_emb[positions]
        k_cache[out_cache_loc] = h @ self.wk                 # set_kv_buffer
        v_cache[out_cache_loc] = h @ self.wv
        o = flash_attn_with_kvcache(h @ self.wq, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, positions,
                                    max_seqlen_k)
        return o @ self.lm_head


def schedule():
    """Prefill batches: each a list of prompts (token ids) of new requests."""
    return [[[1, 2, 3, 4, 5], [6, 7, 8]], [[9, 1, 2, 3]], [[4, 5, 6, 7, 8, 9], [1, 3, 5, 7]]]


class Scheduler:
    """Owns req_to_token (one row of CONTEXT_LEN KV slots per request) and the KV slots."""

    def __init__(self, device):
        self.req_to_token = torch.zeros(POOL_ROWS, CONTEXT_LEN, dtype=torch.int64, device=device)
        self.next_row, self.next_slot, self.device = 1, 1, device     # row 0 / slot 0: dummy requests

    def prepare_for_extend(self, prompts):
        rows, locs, lens = [], [], []
        for prompt in prompts:
            n = len(prompt)
            slots = torch.arange(self.next_slot, self.next_slot + n, device=self.device)
            self.req_to_token[self.next_row, :n] = slots
            rows.append(self.next_row)
            locs.append(slots)
            lens.append(n)
            self.next_row, self.next_slot = self.next_row + 1, self.next_slot + n
        dev = self.device
        return {"input_ids": torch.tensor([t for p in prompts for t in p], device=dev),
                "positions": torch.cat([torch.arange(n, device=dev) for n in lens]),
                "out_cache_loc": torch.cat(locs), "req_pool_indices": torch.tensor(rows, device=dev),
                "seq_lens": torch.tensor(lens, device=dev),
                "cu_seqlens_q": torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=dev)}


class PrefillCudaGraphRunner:
    def __init__(self, model, scheduler, kv_cache, buckets, variant, device):
        self.model, self.scheduler, self.kv_cache, self.variant = model, scheduler, kv_cache, variant
        self.buckets = sorted(buckets)
        t_max, r = self.buckets[-1], MAX_CAPTURE_REQUESTS
        self.buffers = {"input_ids": torch.zeros(t_max, dtype=torch.int64, device=device),
                        "positions": torch.zeros(t_max, dtype=torch.int64, device=device),
                        "out_cache_loc": torch.zeros(t_max, dtype=torch.int64, device=device),
                        "seq_lens": torch.zeros(r, dtype=torch.int64, device=device),
                        "cu_seqlens_q": torch.zeros(r + 1, dtype=torch.int64, device=device),
                        "page_table": torch.zeros(r, CONTEXT_LEN, dtype=torch.int64, device=device)}
        self.graphs, self.outputs = {}, {}

    def init_forward_metadata(self, num_tokens, batch):
        """Copy a batch into the static buffers; request slots past the batch are zero-length sentinels."""
        b, bs = self.buffers, batch["seq_lens"].shape[0]
        for name in ("input_ids", "positions", "out_cache_loc"):
            b[name][:num_tokens].copy_(batch[name])
        b["seq_lens"].zero_()
        b["seq_lens"][:bs].copy_(batch["seq_lens"])
        b["cu_seqlens_q"].fill_(num_tokens)
        b["cu_seqlens_q"][:bs + 1].copy_(batch["cu_seqlens_q"])
        max_seq_len = int(batch["seq_lens"].max())
        b["page_table"].zero_()
        rows = self.scheduler.req_to_token[batch["req_pool_indices"], :max_seq_len]   # at most CONTEXT_LEN wide
        b["page_table"][:bs, :max_seq_len].copy_(rows)

    def _forward(self, num_tokens):
        b = self.buffers
        return self.model.forward(b["input_ids"][:num_tokens], b["positions"][:num_tokens],
                                  b["out_cache_loc"][:num_tokens], self.kv_cache, b["seq_lens"], b["cu_seqlens_q"],
                                  b["page_table"], num_tokens)

    def capture_one_batch_size(self, num_tokens, device):
        if self.variant == "fix":      # fewest synthetic requests with seq_len <= context_length
            lens = [CONTEXT_LEN] * (num_tokens // CONTEXT_LEN) + ([num_tokens % CONTEXT_LEN] if num_tokens % CONTEXT_LEN else [])
        else:                          # one synthetic request carrying the whole bucket
            lens = [num_tokens]
        batch = {"input_ids": torch.zeros(num_tokens, dtype=torch.int64, device=device),
                 "positions": torch.cat([torch.arange(n, device=device) for n in lens]),
                 "out_cache_loc": torch.zeros(num_tokens, dtype=torch.int64, device=device),   # reserved slot 0
                 "req_pool_indices": torch.zeros(len(lens), dtype=torch.int64, device=device),
                 "seq_lens": torch.tensor(lens, device=device),
                 "cu_seqlens_q": torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=device)}
        self.init_forward_metadata(num_tokens, batch)
        self.graphs[num_tokens], self.outputs[num_tokens] = capture(
            lambda: self._forward(num_tokens), device=device, warmups=2, static=self.buffers,
            state={"k_cache": self.kv_cache[0], "v_cache": self.kv_cache[1]}, name=f"prefill {num_tokens} tokens",
            owner="prefill cuda graph runner")

    def capture(self, device):
        for num_tokens in reversed(self.buckets):
            self.capture_one_batch_size(num_tokens, device)

    def can_run(self, num_tokens):
        return num_tokens in self.graphs

    def replay(self, num_tokens, batch):
        self.init_forward_metadata(num_tokens, batch)
        return replay(self.graphs[num_tokens], self.outputs[num_tokens])


def init_prefill_cuda_graph(variant):
    """Resolve the prefill capture buckets (the fix caps them at what legal requests can carry)."""
    if variant == "fix":
        return [t for t in PREFILL_BUCKETS if t <= CONTEXT_LEN * MAX_CAPTURE_REQUESTS]
    return list(PREFILL_BUCKETS)


def run(variant: str, device: str = "cpu"):
    model = Model(device)

    def serve(graphed: bool):
        kv_cache = (torch.zeros(KV_SLOTS, DIM, device=device), torch.zeros(KV_SLOTS, DIM, device=device))
        scheduler = Scheduler(device)
        runner = None
        if graphed:
            runner = PrefillCudaGraphRunner(model, scheduler, kv_cache, init_prefill_cuda_graph(variant), variant, device)
            runner.capture(device)
        outs = []
        for prompts in schedule():
            batch = scheduler.prepare_for_extend(prompts)
            num_tokens = batch["input_ids"].shape[0]
            if runner is not None and runner.can_run(num_tokens):
                outs.append(runner.replay(num_tokens, batch).clone())
                continue
            rows = scheduler.req_to_token[batch["req_pool_indices"]]
            outs.append(model.forward(batch["input_ids"], batch["positions"], batch["out_cache_loc"], kv_cache,
                                      batch["seq_lens"], batch["cu_seqlens_q"], rows, int(batch["seq_lens"].max())))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
