"""Graph warmup runs target-verify with a stale ``seq_lens_buf`` of 1 < q_len: empty causal spans put NaN in the KV pool.

Upstream: https://github.com/lightseekorg/tokenspeed/commit/8f23a5d1e8f9421681ebf036cd3e53d9ded90205 (PR #446,
"fix(cudagraph): seed warmup seq_lens to q_len to avoid NAN"; first version on the branch: 14dbb97c, "... to avoid
empty-span overflow").
Symptom: NaN / non-finite KV after CUDA-graph capture with multi-token-per-request (MTP/EAGLE) decode; the graphed
steps then produce NaN (here: NaN draft logits for every real request) where eager serving is finite.
Mechanism: ``CudaGraphWrapper._capture_one(bs)`` warms each bucket up 4 times (``prepare_capture`` ->
``_init_capture_metadata(bs)`` -> ``run_once()``) and then captures. The attention metadata
(``TRTLLMMHAAttnBackend.init_forward_metadata_capture_cuda_graph``: ``cache_seqlens`` aliases
``input_buffers.seq_lens_buf``, ``max_seq_len_q = spec_num_tokens``) is built from ``seq_lens_buf[:bs]``, which nobody
wrote for the dummy batch: it still holds its ``torch.ones`` init. With seq_len 1 and q_len N = 3, verify rows 0..N-2
get an empty causal span (``seq_len - (N-1-i) <= 0``): their softmax is over zero keys and yields NaN. The drafter's
first step gathers one target hidden row per request (``padded_gather_ids_offsets_buf + accept_lengths``, 0 in the
dummy batch: a NaN row) and its K/V land, through the dummy ``out_cache_loc`` (``dummy_kv_slot = 0``), in page 0 of
the draft KV pool. Page 0 is the padding page: ``_gather_page_table_with_padding_kernel`` fills a real request's
page-table columns past its valid pages with it, and the attention reads those columns masked ("slots must be finite
to keep softmax well-defined", ``MHATokenToKVPool._create_buffers``). A masked NaN key still gives a NaN score, so
every later replay's real draft rows come out NaN. Eager serving never runs the dummy warmup: page 0 stays zero.
(A capture does not execute; the 4 warmups do.) Real batches here fill the captured bucket exactly, so no padded
rows run at replay. Modelled with one target and one draft attention layer, 8-wide, page size 4.
Doctor: stale-padding, at _capture_one (real rows read the padding page 0 of the KV pool, which holds what the
warmup's dummy rows wrote with a stale seq_lens_buf of 1: non-finite values).
Fix (upstream): ``_capture_one`` calls ``self.input_buffers.seq_lens_buf[:bs].fill_(self.max_tokens_per_req)`` right
before ``_init_capture_metadata(bs)`` ("Keep warmup seq_lens >= q_len_per_req so no query row gets an empty causal
span; a stale seq_len of 1 overflows to non-finite KV").
"""
from __future__ import annotations

import math

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/lightseekorg/tokenspeed/commit/8f23a5d1e8f9421681ebf036cd3e53d9ded90205"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "_capture_one"
SYMPTOM = "NaN draft logits after graph capture: warmup with seq_len 1 < q_len wrote non-finite KV into padding page 0"

HIDDEN, VOCAB, PAGE, MAX_PAGES, NUM_PAGES = 8, 16, 4, 3, 7
SPEC_NUM_TOKENS = 3                   # max_tokens_per_req: verify rows per request
CAPTURE_BS, MAX_BS, DUMMY_KV_SLOT = (2, 3), 3, 0


class Weights:
    def __init__(self, device):
        gen = generator(446)
        self.emb = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.pos = randn(PAGE * MAX_PAGES, HIDDEN, gen=gen, device=device, scale=0.5)
        self.wq, self.wk, self.wv, self.wo, self.dq, self.dk, self.dv = (
            randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6) for _ in range(7))
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device)
        self.prefix_k, self.prefix_v, self.draft_k, self.draft_v = (
            randn((NUM_PAGES + 1) * PAGE, HIDDEN, gen=gen, device=device) for _ in range(4))


class ModelState:
    """The KV pools (page 0 is the padding page, zero-initialised), req_to_page (row 0: padding) and InputBuffers."""

    def __init__(self, w, device):
        self.k_buffer, self.v_buffer = w.prefix_k.clone(), w.prefix_v.clone()
        self.draft_k_buffer, self.draft_v_buffer = w.draft_k.clone(), w.draft_v.clone()
        for buf in (self.k_buffer, self.v_buffer, self.draft_k_buffer, self.draft_v_buffer):
            buf[:PAGE].zero_()
        self.req_to_page = torch.zeros(MAX_BS + 1, MAX_PAGES, dtype=torch.long, device=device)
        for r in range(1, MAX_BS + 1):                                   # two real pages per request
            self.req_to_page[r, :2] = torch.arange(2 * r - 1, 2 * r + 1, device=device)
        n = MAX_BS * SPEC_NUM_TOKENS
        self.input_ids_buf = torch.ones(n, dtype=torch.long, device=device)
        self.positions_buf = torch.zeros(n, dtype=torch.long, device=device)
        self.out_cache_loc_buf = torch.full((n,), DUMMY_KV_SLOT, dtype=torch.long, device=device)
        self.seq_lens_buf = torch.ones(MAX_BS, dtype=torch.long, device=device)
        self.req_pool_indices_buf = torch.zeros(MAX_BS, dtype=torch.long, device=device)
        self.accept_lengths_buf = torch.zeros(MAX_BS, dtype=torch.long, device=device)
        self.draft_out_cache_loc_buf = torch.full((MAX_BS,), DUMMY_KV_SLOT, dtype=torch.long, device=device)
        self.padded_gather_ids_offsets_buf = torch.arange(MAX_BS, device=device) * SPEC_NUM_TOKENS
        self.cuda_graph_page_table = torch.zeros(MAX_BS, MAX_PAGES, dtype=torch.long, device=device)

    def slot(self, r, pos):
        return int(self.req_to_page[r, pos // PAGE]) * PAGE + pos % PAGE


class TRTLLMMHAAttnBackend:
    """``cache_seqlens`` aliases ``seq_lens_buf``; the kernel reads every page-table column, masked past the span."""

    def __init__(self, st):
        self.st, self.forward_metadata = st, None

    def init_forward_metadata_capture_cuda_graph(self, bs):
        self.forward_metadata = (self.st.seq_lens_buf[:bs], self.st.cuda_graph_page_table[:bs])

    def init_forward_metadata_replay_cuda_graph(self, bs):
        """_replay_gather_page_table: valid pages from req_to_page, padding columns -> page 0 (dummy)."""
        st = self.st
        rows = st.req_to_page[st.req_pool_indices_buf[:bs]]
        n_pages = (st.seq_lens_buf[:bs] + 1 + PAGE - 1) // PAGE       # + 1: the draft step's slot
        valid = torch.arange(MAX_PAGES, device=rows.device)[None, :] < n_pages[:, None]
        st.cuda_graph_page_table[:bs].copy_(torch.where(valid, rows, torch.zeros_like(rows)))

    def init_forward_metadata(self, bs):
        """Eager: the same tables, built fresh."""
        self.init_forward_metadata_replay_cuda_graph(bs)
        self.forward_metadata = (self.st.seq_lens_buf[:bs].clone(), self.st.cuda_graph_page_table[:bs].clone())

    def attend(self, q, k_buffer, v_buffer, cache_seqlens, page_table, q_per_req):
        """q [bs*q_per_req, H]; row i of a request sees keys j < cache_seqlens - (q_per_req - 1 - i)."""
        slots = (page_table[:, :, None] * PAGE + torch.arange(PAGE, device=q.device)).flatten(1)
        slots = slots.repeat_interleave(q_per_req, 0)                   # [rows, MAX_PAGES*PAGE]
        offs = torch.arange(q_per_req - 1, -1, -1, device=q.device).repeat(page_table.shape[0])
        span = cache_seqlens.repeat_interleave(q_per_req) - offs
        keys = torch.arange(slots.shape[1], device=q.device)
        bias = torch.zeros(span.shape[0], slots.shape[1], device=q.device)
        bias = bias.masked_fill(keys[None, :] >= span[:, None], -math.inf)
        scores = (k_buffer[slots] @ q[:, :, None]).squeeze(-1) / math.sqrt(HIDDEN) + bias
        return (torch.softmax(scores, -1)[:, None, :] @ v_buffer[slots]).squeeze(1)


def forward_step(w, st, backend, bs):
    """Target verify (SPEC_NUM_TOKENS rows per request), then the EAGLE drafter's first step (one row per request)."""
    n = bs * SPEC_NUM_TOKENS
    seqlens, page_table = backend.forward_metadata
    x = w.emb[st.input_ids_buf[:n]] + w.pos[st.positions_buf[:n]]
    st.k_buffer.index_copy_(0, st.out_cache_loc_buf[:n], x @ w.wk)
    st.v_buffer.index_copy_(0, st.out_cache_loc_buf[:n], x @ w.wv)
    hidden = x + backend.attend(x @ w.wq, st.k_buffer, st.v_buffer, seqlens, page_table, SPEC_NUM_TOKENS) @ w.wo
    target_logits = hidden @ w.lm_head
    h = hidden[st.padded_gather_ids_offsets_buf[:bs] + st.accept_lengths_buf[:bs]]
    st.draft_k_buffer.index_copy_(0, st.draft_out_cache_loc_buf[:bs], h @ w.dk)
    st.draft_v_buffer.index_copy_(0, st.draft_out_cache_loc_buf[:bs], h @ w.dv)
    d = h + backend.attend(h @ w.dq, st.draft_k_buffer, st.draft_v_buffer, seqlens + 1, page_table, 1)
    return target_logits, d @ w.lm_head


class CudaGraphWrapper:
    def __init__(self, w, st, device, variant):
        self.w, self.st, self.device, self.variant = w, st, device, variant
        self.attn_backend = TRTLLMMHAAttnBackend(st)
        self.max_tokens_per_req = SPEC_NUM_TOKENS
        self.graphs, self.output_buffers = {}, {}
        events.static_buffers("CudaGraphWrapper.input_buffers", {
            "input_ids_buf": st.input_ids_buf, "positions_buf": st.positions_buf,
            "out_cache_loc_buf": st.out_cache_loc_buf, "seq_lens_buf": st.seq_lens_buf,
            "req_pool_indices_buf": st.req_pool_indices_buf, "accept_lengths_buf": st.accept_lengths_buf,
            "draft_out_cache_loc_buf": st.draft_out_cache_loc_buf})
        events.persistent_state("token_to_kv_pool", {
            "k_buffer": st.k_buffer, "v_buffer": st.v_buffer,
            "draft_k_buffer": st.draft_k_buffer, "draft_v_buffer": st.draft_v_buffer})
        for bs in CAPTURE_BS:
            self.graphs[bs], self.output_buffers[bs] = self._capture_one(bs)

    def _init_capture_metadata(self, bs):
        self.attn_backend.init_forward_metadata_capture_cuda_graph(bs)

    def _capture_one(self, bs):
        def run_once():
            return forward_step(self.w, self.st, self.attn_backend, bs)

        for _ in range(4):                                   # warm up before capture
            if self.variant == "fix":
                # Keep warmup seq_lens >= q_len_per_req so no query row gets an empty causal span.
                self.st.seq_lens_buf[:bs].fill_(self.max_tokens_per_req)
            self._init_capture_metadata(bs)
            with events.warmup():
                run_once()
        # warmup forwards can mutate aliased metadata buffers: refresh right before capture
        self._init_capture_metadata(bs)
        return capture(run_once, device=self.device, warmups=0, name=f"decode bs={bs}",
                       owner="CudaGraphWrapper")

    def __call__(self, bs):
        self.attn_backend.init_forward_metadata_replay_cuda_graph(bs)
        return replay(self.graphs[bs], self.output_buffers[bs])


def fill_input_buffers(st, batch, gen_tokens):
    """batch: (req_pool_idx, cached_len, accept_len); writes the step's rows of every static input."""
    rows = [(r, c + i) for r, c, _ in batch for i in range(SPEC_NUM_TOKENS)]
    dev = st.input_ids_buf.device
    n, bs = len(rows), len(batch)
    st.input_ids_buf[:n].copy_(gen_tokens.to(dev))
    st.positions_buf[:n].copy_(torch.tensor([p for _, p in rows], device=dev))
    st.out_cache_loc_buf[:n].copy_(torch.tensor([st.slot(r, p) for r, p in rows], device=dev))
    st.seq_lens_buf[:bs].copy_(torch.tensor([c + SPEC_NUM_TOKENS for _, c, _ in batch], device=dev))
    st.req_pool_indices_buf[:bs].copy_(torch.tensor([r for r, _, _ in batch], device=dev))
    st.accept_lengths_buf[:bs].copy_(torch.tensor([a for _, _, a in batch], device=dev))
    st.draft_out_cache_loc_buf[:bs].copy_(torch.tensor([st.slot(r, c + SPEC_NUM_TOKENS) for r, c, _ in batch],
                                                       device=dev))


STEPS = [[(1, 1, 1), (2, 2, 0), (3, 0, 2)], [(2, 3, 1), (3, 3, 0)], [(1, 4, 2), (2, 4, 0), (3, 4, 1)]]


def run(variant: str, device: str = "cpu"):
    w = Weights(device)

    def serve(graphed: bool):
        st = ModelState(w, device)
        gen = generator(8)
        wrapper = CudaGraphWrapper(w, st, device, variant) if graphed else None
        backend = TRTLLMMHAAttnBackend(st)
        outs = []
        for batch in STEPS:
            fill_input_buffers(st, batch, torch.randint(2, VOCAB, (len(batch) * SPEC_NUM_TOKENS,), generator=gen))
            if graphed:
                target_logits, draft_logits = wrapper(len(batch))
            else:
                backend.init_forward_metadata(len(batch))
                target_logits, draft_logits = forward_step(w, st, backend, len(batch))
            outs += [target_logits.clone(), draft_logits.clone()]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
