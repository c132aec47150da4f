"""The draft-extend graph is captured with a uniform query stride; its replay metadata packs queries by accept length.

Upstream: https://github.com/sgl-project/sglang/pull/21987 ("[Bugfix] Fix CUDA graph replay issues in
trtllm_mla draft_extend"; same root cause as #19807 for another backend).
Symptom: EAGLE/MTP speculative decoding (spec v2, DP attention) with the ``trtllm_mla`` attention backend and
draft-extend CUDA graphs: ``test_eagle_infer_beta_dp_attention_large`` failed consistently on accuracy
(sglang main, April 2026); the draft model drafted from wrong hidden states.
Mechanism: the draft-extend graph runs every request with ``num_draft_tokens`` query rows (the verified
tokens, padded to the fixed width); its inputs are copied in at that uniform stride.
``init_forward_metadata_capture_cuda_graph`` builds ``cu_seqlens_q`` with ``torch.arange(0, bs + 1) *
num_draft_tokens``, the layout the captured kernels and inputs follow. But
``init_forward_metadata_replay_cuda_graph`` refilled the same static ``cu_seqlens_q`` (and ``seq_lens_q``)
with a variable stride, ``cumsum(accept_length + 1)``, as the non-graph path of an older layout does. At
replay the attention kernel maps query rows to requests and causal offsets through these boundaries, so
every request after the first (and the tail of the first) attends with another request's context or the
wrong causal length, and the logits/hidden states the next draft step starts from are wrong.
Doctor: warmup-divergence, at ``init_forward_metadata_replay_cuda_graph`` (the capture fixed the
uniform-stride layout that the graph and its inputs keep; the replay-time metadata decides a packed one).
Fix (upstream): build ``cu_seqlens_q`` in the replay path with ``torch.arange`` and a fixed step of
``num_draft_tokens``, fill ``seq_lens_q`` with ``num_draft_tokens`` and set ``max_seq_len_q`` to it, as the
capture path does.
"""
from __future__ import annotations

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/21987"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "init_forward_metadata_replay_cuda_graph"
SYMPTOM = "draft-extend replays attend with accept-length-packed query boundaries: wrong draft hidden states"
VOCAB, HIDDEN, POOL_SIZE, MAX_CONTEXT = 16, 4, 64, 12
NUM_DRAFT_TOKENS = 3                       # speculative_num_draft_tokens
CUDA_GRAPH_BS = [1, 2, 4]
MAX_REQS = 4


class SpecInfo:
    def __init__(self, accept_length, hidden_states):
        self.accept_length, self.hidden_states = accept_length, hidden_states


class ForwardBatch:
    def __init__(self, input_ids, positions, seq_lens, req_pool_indices, out_cache_loc, spec_info):
        self.input_ids, self.positions, self.seq_lens = input_ids, positions, seq_lens
        self.req_pool_indices, self.out_cache_loc, self.spec_info = req_pool_indices, out_cache_loc, spec_info
        self.batch_size = seq_lens.numel()


def mla_extend_attention(q, k_cache, req_to_token, req_pool_indices, seq_lens, cu_seqlens_q, bs):
    """Ragged-query attention over each request's paged context (``trtllm_ragged_attention``-like)."""
    rows = torch.arange(q.size(0), device=q.device)
    b = torch.searchsorted(cu_seqlens_q[1:bs + 1], rows, right=True).clamp(max=bs - 1)
    q_len = cu_seqlens_q[b + 1] - cu_seqlens_q[b]
    kv_len = seq_lens[b] - q_len + (rows - cu_seqlens_q[b]) + 1         # causal: prefix + own position
    keys = k_cache[req_to_token[req_pool_indices[b]]]                    # [rows, MAX_CONTEXT, H]
    scores = torch.einsum("th,tkh->tk", q, keys) / HIDDEN ** 0.5
    k_pos = torch.arange(MAX_CONTEXT, device=q.device)
    scores = scores.masked_fill(k_pos[None, :] >= kv_len[:, None], float("-inf"))
    return torch.einsum("tk,tkh->th", torch.softmax(scores, -1), keys)


class TRTLLMMLABackend:
    def __init__(self, variant, req_to_token, k_cache, device):
        self.variant, self.req_to_token, self.k_cache = variant, req_to_token, k_cache
        self.num_draft_tokens = NUM_DRAFT_TOKENS
        self.cuda_graph_cu_seqlens_q = torch.zeros(MAX_REQS + 1, dtype=torch.int64, device=device)
        self.cuda_graph_seq_lens_q = torch.zeros(MAX_REQS, dtype=torch.int64, device=device)
        self.cuda_graph_seq_lens = torch.ones(MAX_REQS, dtype=torch.int64, device=device)
        self.cuda_graph_req_pool_indices = torch.zeros(MAX_REQS, dtype=torch.int64, device=device)
        self.forward_metadata = None

    def init_forward_metadata(self, forward_batch):
        """Eager draft extend: the same uniform layout, built for the batch as it is."""
        bs = forward_batch.batch_size
        cu_seqlens_q = torch.arange(0, bs + 1, device=forward_batch.seq_lens.device) * self.num_draft_tokens
        self.forward_metadata = (cu_seqlens_q, forward_batch.seq_lens, forward_batch.req_pool_indices, bs)

    def init_forward_metadata_capture_cuda_graph(self, bs, req_pool_indices, seq_lens):
        self.cuda_graph_cu_seqlens_q[: bs + 1].copy_(
            torch.arange(0, bs + 1, device=seq_lens.device) * self.num_draft_tokens)
        self.cuda_graph_seq_lens_q[:bs].fill_(self.num_draft_tokens)
        self.max_seq_len_q = self.num_draft_tokens
        self.forward_metadata = (self.cuda_graph_cu_seqlens_q, self.cuda_graph_seq_lens,
                                 self.cuda_graph_req_pool_indices, bs)

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, spec_info):
        self.cuda_graph_seq_lens[:bs].copy_(seq_lens)
        self.cuda_graph_req_pool_indices[:bs].copy_(req_pool_indices)
        if self.variant == "fix":
            self.cuda_graph_cu_seqlens_q[: bs + 1].copy_(
                torch.arange(0, bs + 1, device=seq_lens.device) * self.num_draft_tokens)
            self.cuda_graph_seq_lens_q[:bs].fill_(self.num_draft_tokens)
            self.max_seq_len_q = self.num_draft_tokens
        else:
            seq_lens_q = spec_info.accept_length[:bs] + 1
            self.cuda_graph_seq_lens_q[:bs].copy_(seq_lens_q)
            self.cuda_graph_cu_seqlens_q[1: bs + 1].copy_(torch.cumsum(seq_lens_q, dim=0))
            self.max_seq_len_q = int(seq_lens_q.max())

    def forward_extend(self, q, k, forward_batch_out_cache_loc):
        cu_seqlens_q, seq_lens, req_pool_indices, bs = self.forward_metadata
        self.k_cache[forward_batch_out_cache_loc] = k                    # save the draft tokens' KV
        return mla_extend_attention(q, self.k_cache, self.req_to_token, req_pool_indices, seq_lens,
                                    cu_seqlens_q, bs)


class DraftModel:
    """The EAGLE/MTP draft layer: token embedding + the target's hidden state, one attention block."""

    def __init__(self, attn_backend, device):
        gen = generator(21987)
        self.attn_backend = attn_backend
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.pos_embed = randn(MAX_CONTEXT, HIDDEN, gen=gen, device=device, scale=0.4)
        self.fc = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.wq, self.wk = (randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.7) for _ in range(2))
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.5)

    def forward(self, input_ids, positions, hidden_states, out_cache_loc):
        h = self.embed[input_ids] + self.pos_embed[positions] + hidden_states @ self.fc
        o = self.attn_backend.forward_extend(h @ self.wq, h @ self.wk, out_cache_loc)
        h = h + o
        return h @ self.lm_head, h


class EAGLEDraftExtendCudaGraphRunner:
    def __init__(self, model, attn_backend, device):
        self.model, self.attn_backend, self.device = model, attn_backend, device
        max_num_token = MAX_REQS * NUM_DRAFT_TOKENS
        self.input_ids = torch.zeros(max_num_token, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_num_token, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.zeros(max_num_token, dtype=torch.int64, device=device)
        self.hidden_states = torch.zeros(max_num_token, HIDDEN, device=device)
        self.seq_lens = torch.ones(MAX_REQS, dtype=torch.int64, device=device)
        self.req_pool_indices = torch.zeros(MAX_REQS, dtype=torch.int64, device=device)
        self.accept_length = torch.ones(MAX_REQS, dtype=torch.int64, device=device)
        self.pool = graph_pool_handle(device)
        self.graphs, self.output_buffers = {}, {}
        for bs in reversed(CUDA_GRAPH_BS):
            self.capture_one_batch_size(bs)

    def capture_one_batch_size(self, bs):
        num_tokens = bs * NUM_DRAFT_TOKENS
        self.attn_backend.init_forward_metadata_capture_cuda_graph(bs, self.req_pool_indices[:bs],
                                                                   self.seq_lens[:bs])

        def run_once():
            return self.model.forward(self.input_ids[:num_tokens], self.positions[:num_tokens],
                                      self.hidden_states[:num_tokens], self.out_cache_loc[:num_tokens])

        self.graphs[bs], self.output_buffers[bs] = capture(
            run_once, device=self.device, pool=self.pool, name=f"draft extend bs={bs}",
            static={"input_ids": self.input_ids, "positions": self.positions, "hidden_states": self.hidden_states,
                    "out_cache_loc": self.out_cache_loc, "seq_lens": self.attn_backend.cuda_graph_seq_lens,
                    "req_pool_indices": self.attn_backend.cuda_graph_req_pool_indices,
                    "cu_seqlens_q": self.attn_backend.cuda_graph_cu_seqlens_q},
            state={"k_cache": self.attn_backend.k_cache}, owner="EAGLEDraftExtendCudaGraphRunner")

    def replay(self, forward_batch):
        raw_bs = forward_batch.batch_size
        raw_num_token = raw_bs * NUM_DRAFT_TOKENS
        bs = next(b for b in CUDA_GRAPH_BS if b >= raw_bs)
        num_tokens = bs * NUM_DRAFT_TOKENS
        if bs != raw_bs:
            self.seq_lens.fill_(1)
            self.out_cache_loc.zero_()
            self.positions.zero_()
            self.req_pool_indices.zero_()
            self.accept_length.fill_(1)
        self.input_ids[:raw_num_token].copy_(forward_batch.input_ids)
        self.positions[:raw_num_token].copy_(forward_batch.positions)
        self.out_cache_loc[:raw_num_token].copy_(forward_batch.out_cache_loc)
        self.hidden_states[:raw_num_token].copy_(forward_batch.spec_info.hidden_states)
        self.seq_lens[:raw_bs].copy_(forward_batch.seq_lens)
        self.req_pool_indices[:raw_bs].copy_(forward_batch.req_pool_indices)
        self.accept_length[:raw_bs].copy_(forward_batch.spec_info.accept_length)
        self.attn_backend.init_forward_metadata_replay_cuda_graph(
            bs, self.req_pool_indices[:bs], self.seq_lens[:bs], SpecInfo(self.accept_length, None))
        logits, hidden = replay(self.graphs[bs], self.output_buffers[bs], real=raw_num_token, size=num_tokens)
        return logits[:raw_num_token], hidden[:raw_num_token]


def run(variant: str, device: str = "cpu"):
    # three requests, prefix lengths 4, 6, 5 in req_to_token rows 1..3; each verify accepted 1, 0, 2 drafts
    prefix = [4, 6, 5]
    accept = [1, 0, 2]
    req_to_token = torch.arange(MAX_REQS * MAX_CONTEXT, device=device).view(MAX_REQS, MAX_CONTEXT) + 4
    req_pool_indices = torch.tensor([1, 2, 3], device=device)

    def serve(graphed: bool):
        k_cache = randn(POOL_SIZE, HIDDEN, gen=generator(5), device=device)
        backend = TRTLLMMLABackend(variant, req_to_token, k_cache, device)
        model = DraftModel(backend, device)
        runner = EAGLEDraftExtendCudaGraphRunner(model, backend, device) if graphed else None
        k_cache.copy_(randn(POOL_SIZE, HIDDEN, gen=generator(5), device=device))    # capture warmups wrote slot 0
        outs = []
        g = generator(11)
        for step in range(2):
            n = len(prefix)
            seq_lens = torch.tensor([p + NUM_DRAFT_TOKENS * (step + 1) for p in prefix], device=device)
            positions = torch.cat([torch.arange(s - NUM_DRAFT_TOKENS, s, device=device) for s in seq_lens])
            out_cache_loc = torch.cat([req_to_token[r, s - NUM_DRAFT_TOKENS: s]
                                       for r, s in zip(req_pool_indices, seq_lens)])
            input_ids = torch.randint(0, VOCAB, (n * NUM_DRAFT_TOKENS,), generator=g).to(device)
            hidden = torch.randn(n * NUM_DRAFT_TOKENS, HIDDEN, generator=g).to(device)
            spec_info = SpecInfo(torch.tensor(accept, device=device), hidden)
            batch = ForwardBatch(input_ids, positions, seq_lens, req_pool_indices, out_cache_loc, spec_info)
            if graphed:
                logits, hidden_states = runner.replay(batch)
            else:
                backend.init_forward_metadata(batch)
                logits, hidden_states = model.forward(input_ids, positions, hidden, out_cache_loc)
            # the draft continues from each request's last accepted token
            select = torch.arange(n, device=device) * NUM_DRAFT_TOKENS + spec_info.accept_length
            outs += [logits[select].clone(), hidden_states[select].clone()]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
