"""Decode CUDA-graph padding leaves ``req_pool_indices`` rows of an earlier, larger batch: padded rows write a live request's state.

Upstream: https://github.com/sgl-project/sglang/pull/26292 ("Zero `req_pool_indices` padding in cuda-graph
populate", merged 2026-05); the contract it completes is https://github.com/sgl-project/sglang/pull/24243
("Reserve slot 0 as padding in all req pools").
Symptom: no issue linked. PR text: "Padded rows then resolve to the reserved `req_pool` slot 0 whose
`req_to_token[0, :]` row stays all-zero from init, so captured attention's dummy reads land on slot 0 instead
of stale `req_to_token` left by an earlier replay." #24243 states why that matters: paths that translate
``req_to_token[req_pool_indices, ...]`` into a per-token state location (the DeepSeek-V4 compressor /
state-pool path) make *dummy writes* for padded rows, and "the only way to keep their dummy writes from
corrupting real state is to make req_pool_idx = 0 permanently unowned" -- which assumed padded
``req_pool_indices`` are 0. They were not: real requests' compressed state was silently overwritten.
Mechanism: ``CudaGraphRunner.replay_prepare`` pads ``raw_bs`` up to the captured ``bs`` and calls
``DecodeInputBuffers.populate_from_forward_batch`` (python/sglang/srt/model_executor/cuda_graph_runner.py).
In its ``if bs != raw_bs:`` branch it neutralised ``seq_lens`` (``fill_(seq_len_fill_value)``) and
``out_cache_loc`` (``zero_()``) but not ``req_pool_indices``, then copied only ``[:raw_bs]``. Rows
``[raw_bs, bs)`` kept the request-pool indices of the previous replay that used those rows. The captured
forward runs every one of the ``bs`` rows: attention gathers ``req_to_token[req_pool_indices[row],
:seq_len]`` (a harmless read) and the compressor writes this token's compressed state at
``req_to_token[req_pool_indices[row], seq_len - 1]``. For a padded row (``seq_len`` = fill value 1) that is
position 0 of whichever request last sat in that row -- a live request, whose attention reads its own
compressed state from then on. Eager runs only the real rows, so nothing writes there.
Doctor: stale-padding, at populate_from_forward_batch (the padded rows of ``req_pool_indices`` keep an
earlier batch's values, and what they hold decides which live request's state the captured step overwrites).
Fix (upstream): add ``req_pool_indices.zero_()`` next to ``seq_lens.fill_`` / ``out_cache_loc.zero_()`` in the
padding branch of ``cuda_graph_runner``, ``cpu_graph_runner``, ``eagle_draft_extend_cuda_graph_runner`` and
``frozen_kv_mtp_cuda_graph_runner`` (``eagle_draft_cuda_graph_runner`` already did it): padded rows resolve
to reserved row 0 of ``req_to_token`` (all zeros) and so to reserved KV/state slot 0.
Modelled: one decode layer; KV pool and compressed-state pool indexed by token slot (slot 0 reserved);
the compressor's ``full_to_swa -> state_loc`` translation is the identity; capture sizes 1, 2, 4; requests
A-D decode, C finishes, the 3-request batch is padded to 4 and its padded row still holds D's pool index.
"""
from __future__ import annotations

import bisect

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/26292"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "populate_from_forward_batch"
SYMPTOM = "padded decode rows keep an earlier batch's req_pool_indices and overwrite a live request's compressed state"

VOCAB, HIDDEN, MAX_CTX = 16, 8, 8
MAX_REQS = 5                                  # ReqToTokenPool.size (row 0 is the reserved padding row)
NUM_SLOTS = 64                                # token slots of the KV / state pools (slot 0 reserved)
CAPTURE_BS = [1, 2, 4]
SEQ_LEN_FILL_VALUE = 1                        # attn_backend.get_cuda_graph_seq_len_fill_value()
PROMPT_LENS = {"A": 3, "B": 2, "C": 4, "D": 3}
STEPS = (("A", "B", "C", "D"), ("A", "B", "D"), ("A", "D"), ("D",), ("A", "B", "D"))


class Weights:
    def __init__(self, device):
        gen = generator(26292)
        self.emb = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.wq, self.wk, self.wv, self.wc = (randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6)
                                              for _ in range(4))
        self.wo = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.5)


class Pools:
    """``ReqToTokenPool.req_to_token`` (row 0 all zeros, #24243), the KV pool and the compressed-state pool."""

    def __init__(self, device, req_to_token, k_cache, v_cache, c_cache):
        self.req_to_token = req_to_token.clone()
        self.k_cache, self.v_cache, self.c_cache = k_cache.clone(), v_cache.clone(), c_cache.clone()


def forward_decode(w, pools, input_ids, req_pool_indices, seq_lens, out_cache_loc):
    """The captured decode step, row by row over whatever rows it is given."""
    h = w.emb[input_ids]
    pools.k_cache[out_cache_loc] = h @ w.wk
    pools.v_cache[out_cache_loc] = h @ w.wv
    rows = pools.req_to_token[req_pool_indices.long()]                 # [bs, MAX_CTX] token slots
    # compressor: this token's state location through req_to_token (DSV4 state_loc path)
    state_loc = rows.gather(1, (seq_lens.long() - 1)[:, None]).squeeze(1)
    pools.c_cache[state_loc] = torch.tanh(h @ w.wc)
    ctx = torch.arange(MAX_CTX, device=h.device)
    mask = ctx[None, :] < seq_lens.long()[:, None]
    q = h @ w.wq
    scores = (pools.k_cache[rows] * q[:, None, :]).sum(-1).masked_fill(~mask, -1e9)
    attn = (torch.softmax(scores, -1)[..., None] * pools.v_cache[rows]).sum(1)
    comp = (pools.c_cache[rows] * mask[..., None]).sum(1) / seq_lens[:, None].to(h.dtype)
    return (h + attn + comp) @ w.wo


class ForwardBatch:
    def __init__(self, input_ids, req_pool_indices, seq_lens, out_cache_loc):
        self.input_ids, self.req_pool_indices = input_ids, req_pool_indices
        self.seq_lens, self.out_cache_loc = seq_lens, out_cache_loc
        self.batch_size = input_ids.shape[0]


class DecodeInputBuffers:
    def __init__(self, max_bs, device):
        self.input_ids = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.req_pool_indices = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.seq_lens = torch.full((max_bs,), SEQ_LEN_FILL_VALUE, dtype=torch.int32, device=device)
        self.out_cache_loc = torch.zeros(max_bs, dtype=torch.long, device=device)

    def populate_from_forward_batch(self, *, forward_batch, raw_bs, bs, seq_len_fill_value, variant):
        if bs != raw_bs:
            self.seq_lens.fill_(seq_len_fill_value)
            self.out_cache_loc.zero_()
            if variant == "fix":
                # Pair with seq_lens fill: padded rows must point at reserved
                # req_pool slot 0 (req_to_token[0, :] is all zeros from init).
                self.req_pool_indices.zero_()
        self.input_ids[:raw_bs].copy_(forward_batch.input_ids)
        self.req_pool_indices[:raw_bs].copy_(forward_batch.req_pool_indices)
        self.seq_lens[:raw_bs].copy_(forward_batch.seq_lens)
        self.out_cache_loc[:raw_bs].copy_(forward_batch.out_cache_loc)


class CudaGraphRunner:
    def __init__(self, w, pools, device, variant):
        self.w, self.pools, self.device, self.variant = w, pools, device, variant
        self.capture_bs, self.max_bs = CAPTURE_BS, max(CAPTURE_BS)
        self.buffers = DecodeInputBuffers(self.max_bs, device)
        self.graphs, self.output_buffers = {}, {}
        self.capture()

    def capture(self):
        pool = graph_pool_handle(self.device)
        b, p = self.buffers, self.pools
        for bs in reversed(self.capture_bs):
            def run_once(bs=bs):
                return forward_decode(self.w, p, b.input_ids[:bs], b.req_pool_indices[:bs], b.seq_lens[:bs],
                                      b.out_cache_loc[:bs])
            g, out = capture(run_once, device=self.device, pool=pool, name=f"decode bs {bs}", owner="CudaGraphRunner",
                             static={"input_ids": b.input_ids, "req_pool_indices": b.req_pool_indices,
                                     "seq_lens": b.seq_lens, "out_cache_loc": b.out_cache_loc},
                             state={"req_to_token": p.req_to_token, "k_cache": p.k_cache, "v_cache": p.v_cache,
                                    "c_cache": p.c_cache})
            self.graphs[bs], self.output_buffers[bs] = g, out

    def replay_prepare(self, forward_batch):
        raw_bs = forward_batch.batch_size
        bs = self.capture_bs[bisect.bisect_left(self.capture_bs, raw_bs)]
        self.buffers.populate_from_forward_batch(forward_batch=forward_batch, raw_bs=raw_bs, bs=bs,
                                                 seq_len_fill_value=SEQ_LEN_FILL_VALUE, variant=self.variant)
        return raw_bs, bs

    def replay(self, forward_batch):
        raw_bs, bs = self.replay_prepare(forward_batch)
        b = self.buffers
        left = {"input_ids": b.input_ids}             # padded rows the branch leaves as they were
        if self.variant == "bug":
            left["req_pool_indices"] = b.req_pool_indices
        logits = replay(self.graphs[bs], self.output_buffers[bs], real=raw_bs, size=bs, padded=left)
        return logits[:raw_bs].clone()


def run(variant: str, device: str = "cpu"):
    w = Weights(device)
    gen = generator(2629)
    # prefilled prompts: request r gets pool row idx[r] and consecutive token slots from 1
    idx, lens, table, nxt = {}, {}, torch.zeros(MAX_REQS + 1, MAX_CTX, dtype=torch.long), 1
    for i, (r, n) in enumerate(PROMPT_LENS.items()):
        idx[r], lens[r] = i + 1, n
        table[i + 1, :n] = torch.arange(nxt, nxt + n)
        nxt += n
    kv = [randn(NUM_SLOTS, HIDDEN, gen=gen, device=device) for _ in range(3)]
    for t in kv:
        t[0] = 0.0                                          # reserved slot 0
    tokens = torch.randint(0, VOCAB, (len(STEPS), len(PROMPT_LENS)), generator=gen)

    def serve(graphed: bool):
        pools = Pools(device, table.to(device), *kv)
        runner = CudaGraphRunner(w, pools, device, variant) if graphed else None
        seq, slot, outs = dict(lens), nxt, []
        for step, reqs in enumerate(STEPS):
            locs = []
            for r in reqs:                                   # scheduler: allocate this token's slot
                pools.req_to_token[idx[r], seq[r]] = slot
                locs.append(slot)
                seq[r], slot = seq[r] + 1, slot + 1
            ids = tokens[step, [list(PROMPT_LENS).index(r) for r in reqs]]
            fb = ForwardBatch(ids.to(device), torch.tensor([idx[r] for r in reqs], dtype=torch.int32).to(device),
                              torch.tensor([seq[r] for r in reqs], dtype=torch.int32).to(device),
                              torch.tensor(locs, dtype=torch.long).to(device))
            if graphed:
                outs.append(runner.replay(fb))
            else:
                outs.append(forward_decode(w, pools, fb.input_ids, fb.req_pool_indices, fb.seq_lens,
                                           fb.out_cache_loc))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
