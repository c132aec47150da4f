"""The Triton draft-extend graph metadata strides queries by ``num_steps + 1``; the runner lays out ``num_draft_tokens``.

Upstream: https://github.com/sgl-project/sglang/pull/27545 ("Fix NaN in triton EAGLE spec-v2 draft-extend CUDA
graph at topk>1 (wrong qo_indptr stride)").
Symptom: EAGLE spec-v2 with ``--attention-backend triton``, ``--speculative-eagle-topk > 1`` and draft-extend CUDA
graphs gives NaN / garbage draft hidden states (acceptance collapses) as soon as a batch has more than one request;
``bs == 1``, ``topk == 1`` and eager draft-extend are fine (sglang main, June 2026).
Mechanism: ``EAGLEDraftExtendCudaGraphRunner`` lays out a fixed ``num_draft_tokens`` query tokens per request in
its static buffers (the graph's token layout). The Triton backend fills the graph's static ``qo_indptr`` (at
capture and at every replay) in ``_update_draft_extend_buffers`` with a per-request stride of
``speculative_num_steps + 1``, which equals ``num_draft_tokens`` only when ``topk == 1``. With ``topk > 1`` the
captured ``extend_attention_fwd`` covers ``bs * (num_steps + 1)`` query rows of a ``bs * num_draft_tokens`` layout:
request ``b > 0`` reads its queries (and writes its outputs) at another request's offset, and the tail rows are
never written. The eager draft-extend path builds ``qo_indptr`` from the real ``extend_seq_lens``.
Doctor: undersized-buffer, at ``_update_draft_extend_buffers`` (the graph's query metadata serves fewer rows per
request than the static token layout the runner fills).
Fix (upstream): use ``num_tokens_per_bs = self.num_draft_tokens`` for the v2 draft-extend path in
``_update_draft_extend_buffers`` (capture and replay), matching the runner's layout.
"""
from __future__ import annotations

import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/27545"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "_update_draft_extend_buffers"
SYMPTOM = "topk>1 draft-extend graph replays read request b's queries at the wrong offset (NaN/garbage upstream)"
VOCAB, DIM, POOL, MAX_CTX = 16, 4, 64, 8
SPECULATIVE_NUM_STEPS, TOPK, NUM_DRAFT_TOKENS = 2, 2, 4      # num_draft_tokens != num_steps + 1 when topk > 1
BS = 2


class ForwardMode:
    DRAFT_EXTEND_V2 = "draft_extend_v2"

    def __init__(self, mode):
        self.mode = mode

    def is_draft_extend_v2(self):
        return self.mode == self.DRAFT_EXTEND_V2


class ForwardBatch:
    def __init__(self, batch_size, input_ids, hidden_states, req_pool_indices, seq_lens, out_cache_loc,
                 extend_seq_lens, accept_length):
        self.forward_mode = ForwardMode(ForwardMode.DRAFT_EXTEND_V2)
        self.batch_size, self.input_ids, self.hidden_states = batch_size, input_ids, hidden_states
        self.req_pool_indices, self.seq_lens, self.out_cache_loc = req_pool_indices, seq_lens, out_cache_loc
        self.extend_seq_lens, self.accept_length = extend_seq_lens, accept_length


def create_flashinfer_kv_indices_triton(req_to_token, req_pool_indices, paged_kernel_lens, kv_indptr, kv_indices):
    """One program per request: copy its first ``paged_kernel_lens[b]`` token slots to ``kv_indices``."""
    pos = torch.arange(MAX_CTX, device=req_to_token.device)
    rows = req_to_token[req_pool_indices]                                    # [bs, MAX_CTX]
    valid = pos[None, :] < paged_kernel_lens[:, None]
    dst = torch.where(valid, kv_indptr[:-1, None] + pos[None, :], kv_indices.shape[0] - 1)
    kv_indices.index_put_((dst.reshape(-1),), torch.where(valid, rows, 0).reshape(-1))


def extend_attention_fwd(q, k, v, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, max_len_extend):
    """Triton extend attention: program (b, m) reads query rows ``qo_indptr[b] + m`` (m < max_len_extend and
    below the request's extend length), attends the request's prefix (``kv_indices``) and, causally, its own
    extend tokens, and writes the output rows at the same offsets."""
    n, bs = q.shape[0], qo_indptr.shape[0] - 1
    m = torch.arange(max_len_extend, device=q.device)
    q_start, q_len = qo_indptr[:-1], qo_indptr[1:] - qo_indptr[:-1]
    rows = q_start[:, None] + m[None, :]                                     # [bs, M] query rows
    row_ok = (m[None, :] < q_len[:, None]) & (rows < n)
    rows_c = rows.clamp(max=n - 1)
    qb = q[rows_c]                                                           # [bs, M, D]
    # prefix keys through kv_indices
    p = torch.arange(MAX_CTX, device=q.device)
    pre_len = kv_indptr[1:] - kv_indptr[:-1]
    pre_idx = kv_indices[(kv_indptr[:-1, None] + p[None, :]).clamp(max=kv_indices.shape[0] - 1)]
    kp, vp = k_buffer[pre_idx], v_buffer[pre_idx]                            # [bs, P, D]
    s_pre = (qb @ kp.transpose(1, 2)).masked_fill(~(p[None, None, :] < pre_len[:, None, None]), float("-inf"))
    # extend keys: the same rows, causal
    ke, ve = k[rows_c], v[rows_c]
    causal = (m[None, :, None] >= m[None, None, :]) & row_ok[:, None, :]
    s_ext = (qb @ ke.transpose(1, 2)).masked_fill(~causal, float("-inf"))
    probs = torch.softmax(torch.cat([s_pre, s_ext], -1) / math.sqrt(q.shape[-1]), -1)
    out = probs[..., :MAX_CTX] @ vp + probs[..., MAX_CTX:] @ ve
    o = torch.zeros(n + 1, q.shape[1], device=q.device, dtype=q.dtype)      # row n: the masked-off lanes
    o.index_copy_(0, torch.where(row_ok, rows, n).reshape(-1), out.reshape(-1, q.shape[1]))
    return o[:n]


class TritonAttnBackend:
    def __init__(self, req_to_token, variant, device):
        self.req_to_token, self.variant, self.device = req_to_token, variant, device
        self.speculative_num_steps = SPECULATIVE_NUM_STEPS
        self.num_draft_tokens = NUM_DRAFT_TOKENS
        self.forward_metadata = None

    # ---- eager ----
    def init_forward_metadata(self, forward_batch: ForwardBatch):
        bs = forward_batch.batch_size
        qo_indptr = torch.zeros(bs + 1, dtype=torch.int64, device=self.device)
        qo_indptr[1:] = torch.cumsum(forward_batch.extend_seq_lens, 0)
        kv_indptr = torch.zeros(bs + 1, dtype=torch.int64, device=self.device)
        kv_indptr[1:] = torch.cumsum(forward_batch.seq_lens, 0)
        kv_indices = torch.zeros(bs * MAX_CTX + 1, dtype=torch.int64, device=self.device)
        create_flashinfer_kv_indices_triton(self.req_to_token, forward_batch.req_pool_indices,
                                            forward_batch.seq_lens, kv_indptr, kv_indices)
        self.forward_metadata = (qo_indptr, kv_indptr, kv_indices, self.num_draft_tokens)

    # ---- CUDA graph ----
    def init_cuda_graph_state(self, max_bs):
        self.cuda_graph_qo_indptr = torch.zeros(max_bs + 1, dtype=torch.int64, device=self.device)
        self.cuda_graph_kv_indptr = torch.zeros(max_bs + 1, dtype=torch.int64, device=self.device)
        self.cuda_graph_kv_indices = torch.zeros(max_bs * MAX_CTX + 1, dtype=torch.int64, device=self.device)

    def _update_draft_extend_buffers(self, bs, req_pool_indices, seq_lens, forward_mode):
        """Returns ``(qo_indptr, kv_indptr, num_tokens_per_bs)``."""
        seq_lens = seq_lens[:bs]
        if self.variant == "fix" and forward_mode.is_draft_extend_v2():
            # V2 draft-extend fills num_draft_tokens per req (the cuda-graph runner's token layout)
            num_tokens_per_bs = self.num_draft_tokens
        else:
            num_tokens_per_bs = self.speculative_num_steps + 1
        qo_indptr = self.cuda_graph_qo_indptr[: bs + 1]
        qo_indptr.copy_(torch.arange(0, bs * num_tokens_per_bs + 1, step=num_tokens_per_bs, device=self.device))
        kv_indptr = self.cuda_graph_kv_indptr[: bs + 1]
        kv_indptr[1:].copy_(torch.cumsum(seq_lens, 0))
        create_flashinfer_kv_indices_triton(self.req_to_token, req_pool_indices[:bs], seq_lens, kv_indptr,
                                            self.cuda_graph_kv_indices)
        return qo_indptr, kv_indptr, num_tokens_per_bs

    def init_forward_metadata_capture_cuda_graph(self, bs, req_pool_indices, seq_lens, forward_mode):
        qo_indptr, kv_indptr, num_tokens_per_bs = self._update_draft_extend_buffers(
            bs, req_pool_indices, seq_lens, forward_mode)
        self.forward_metadata = (qo_indptr, kv_indptr, self.cuda_graph_kv_indices, num_tokens_per_bs)

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, forward_mode):
        self._update_draft_extend_buffers(bs, req_pool_indices, seq_lens, forward_mode)

    def forward_extend(self, q, k, v, k_buffer, v_buffer):
        qo_indptr, kv_indptr, kv_indices, max_extend_len = self.forward_metadata
        return extend_attention_fwd(q, k, v, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, max_extend_len)


class EagleDraftModel:
    def __init__(self, device):
        gen = generator(27545)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.fc = randn(2 * DIM, DIM, gen=gen, device=device, scale=0.5)
        self.wq, self.wk, self.wv, self.wo = (randn(DIM, DIM, gen=gen, device=device, scale=0.5) for _ in range(4))

    def forward(self, forward_batch, attn_backend, k_buffer, v_buffer):
        h = torch.cat([self.embed[forward_batch.input_ids], forward_batch.hidden_states], -1) @ self.fc
        q, k, v = h @ self.wq, h @ self.wk, h @ self.wv
        k_buffer.index_copy_(0, forward_batch.out_cache_loc, k)              # set_kv_buffer
        v_buffer.index_copy_(0, forward_batch.out_cache_loc, v)
        return h + attn_backend.forward_extend(q, k, v, k_buffer, v_buffer) @ self.wo


class EAGLEDraftExtendCudaGraphRunner:
    def __init__(self, model, attn_backend, k_buffer, v_buffer, device):
        self.model, self.attn_backend, self.device = model, attn_backend, device
        self.num_tokens_per_bs = NUM_DRAFT_TOKENS
        self.max_bs = BS
        max_num_token = self.max_bs * self.num_tokens_per_bs
        self.input_ids = torch.zeros(max_num_token, dtype=torch.int64, device=device)
        self.hidden_states = torch.zeros(max_num_token, DIM, device=device)
        self.out_cache_loc = torch.zeros(max_num_token, dtype=torch.int64, device=device)
        self.req_pool_indices = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(self.max_bs, dtype=torch.int64, device=device)
        self.accept_length = torch.full((self.max_bs,), self.num_tokens_per_bs, dtype=torch.int64, device=device)
        self.extend_seq_lens = torch.full((self.max_bs,), self.num_tokens_per_bs, dtype=torch.int64, device=device)
        attn_backend.init_cuda_graph_state(self.max_bs)
        bs = BS
        num_tokens = bs * self.num_tokens_per_bs
        forward_batch = ForwardBatch(bs, self.input_ids[:num_tokens], self.hidden_states[:num_tokens],
                                     self.req_pool_indices[:bs], self.seq_lens[:bs], self.out_cache_loc[:num_tokens],
                                     self.extend_seq_lens[:bs], self.accept_length[:bs])
        attn_backend.init_forward_metadata_capture_cuda_graph(bs, forward_batch.req_pool_indices,
                                                              forward_batch.seq_lens, forward_batch.forward_mode)
        md = attn_backend.forward_metadata
        self.graph, self.output = capture(
            lambda: model.forward(forward_batch, attn_backend, k_buffer, v_buffer), device=device, warmups=2,
            static={"input_ids": self.input_ids, "hidden_states": self.hidden_states,
                    "out_cache_loc": self.out_cache_loc, "req_pool_indices": self.req_pool_indices,
                    "seq_lens": self.seq_lens, "qo_indptr": md[0], "kv_indptr": md[1], "kv_indices": md[2]},
            state={"k_buffer": k_buffer, "v_buffer": v_buffer}, owner="EAGLEDraftExtendCudaGraphRunner")

    def replay(self, forward_batch: ForwardBatch):
        bs = forward_batch.batch_size
        num_tokens = forward_batch.input_ids.shape[0]
        self.input_ids[:num_tokens].copy_(forward_batch.input_ids)
        self.hidden_states[:num_tokens].copy_(forward_batch.hidden_states)
        self.out_cache_loc[:num_tokens].copy_(forward_batch.out_cache_loc)
        self.req_pool_indices[:bs].copy_(forward_batch.req_pool_indices)
        self.seq_lens[:bs].copy_(forward_batch.seq_lens)
        self.attn_backend.init_forward_metadata_replay_cuda_graph(bs, self.req_pool_indices, self.seq_lens,
                                                                  forward_batch.forward_mode)
        return replay(self.graph, self.output)


def run(variant: str, device: str = "cpu"):
    model = EagleDraftModel(device)
    gen = generator(1)
    req_to_token = torch.arange(2 * MAX_CTX, device=device).view(2, MAX_CTX) * 2        # two requests' slots
    k_init, v_init = randn(POOL, DIM, gen=gen, device=device), randn(POOL, DIM, gen=gen, device=device)
    # two draft-extend steps of a 2-request batch; each request carries num_draft_tokens tokens
    steps = []
    for seq_lens, accept in (([3, 5], [2, 3]), ([5, 7], [4, 1])):
        n = BS * NUM_DRAFT_TOKENS
        steps.append(dict(input_ids=torch.randint(0, VOCAB, (n,), generator=gen).to(device),
                          hidden_states=randn(n, DIM, gen=gen, device=device),
                          seq_lens=torch.tensor(seq_lens, device=device),
                          out_cache_loc=torch.arange(40, 40 + n, device=device) + 8 * len(steps),
                          accept_length=torch.tensor(accept, device=device)))

    def make_batch(s):
        return ForwardBatch(BS, s["input_ids"], s["hidden_states"], torch.tensor([0, 1], device=device),
                            s["seq_lens"], s["out_cache_loc"],
                            torch.full((BS,), NUM_DRAFT_TOKENS, dtype=torch.int64, device=device), s["accept_length"])

    def select(hidden, s):
        # EagleDraftWorker: the last accepted token's draft hidden state per request
        select_index = torch.arange(BS, device=device) * NUM_DRAFT_TOKENS + s["accept_length"] - 1
        return hidden[select_index].clone()

    def eager():
        k_buffer, v_buffer = k_init.clone(), v_init.clone()
        attn_backend = TritonAttnBackend(req_to_token, variant, device)
        outs = []
        for s in steps:
            fb = make_batch(s)
            attn_backend.init_forward_metadata(fb)
            outs.append(select(model.forward(fb, attn_backend, k_buffer, v_buffer), s))
        return outs

    def served():
        k_buffer, v_buffer = k_init.clone(), v_init.clone()
        attn_backend = TritonAttnBackend(req_to_token, variant, device)
        runner = EAGLEDraftExtendCudaGraphRunner(model, attn_backend, k_buffer, v_buffer, device)
        k_buffer.copy_(k_init)                       # capture-time writes (dummy batch, slot 0) are discarded
        v_buffer.copy_(v_init)
        return [select(runner.replay(make_batch(s)), s) for s in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
