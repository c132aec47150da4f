"""SGLang EAGLE spec-v2 with the Triton backend: the draft-extend CUDA graph is captured over a fixed-stride token layout (``speculative_num_steps + 1`` query tokens per request), but ``TritonAttnBackend.init_forward_metadata_replay_cuda_graph`` rebuilds ``qo_indptr`` at every replay as the packed prefix sum of ``spec_info.accept_length``, so request ``b > 0`` attends with another request's query rows and some output rows are never written.

Upstream: https://github.com/sgl-project/sglang/pull/19807 ("Fix issue 19717 by making `qo_indptr` uniform strided
instead of packed", sgl-project/sglang, by kpham-sgl, description dated 2026-03-04, merged; merge commit not read).
Read: the PR description (change the ``qo_indptr`` layout in ``init_forward_metadata_replay_cuda_graph`` to match
``init_forward_metadata_capture_cuda_graph``; ``EAGLEDraftExtendCudaGraphRunner.replay()`` expects a fixed-stride
layout; tested with ``test_eagle_infer_beta.py::TestEagleServerBase::test_radix_attention``) and the description of
#21987 (trtllm_mla), which names #19807 as the same root cause and fix: ``cu_seqlens_q`` built with a uniform stride
via ``torch.arange`` at capture but with a variable stride via ``torch.cumsum(accept_length + 1)`` at replay. The diff
itself was not readable here; instead, stored versions of ``python/sglang/srt/layers/attention/triton_backend.py``
from both sides: one whose ``init_forward_metadata_capture_cuda_graph`` draft-extend branch
(``forward_mode.is_draft_extend(include_v2=True)``) builds ``qo_indptr`` with ``torch.arange(0, bs *
num_tokens_per_bs + 1, step=num_tokens_per_bs)`` (``num_tokens_per_bs = self.speculative_num_steps + 1``,
``max_extend_len = num_tokens_per_bs``) while the replay branch writes ``qo_indptr[1 : bs + 1] =
torch.cumsum(accept_lens, dim=0)`` with ``accept_lens = spec_info.accept_length[:bs]``, and a later one whose replay
branch uses the same ``torch.arange`` as capture; in the first version also ``init_forward_metadata`` (eager: a
``DRAFT_EXTEND_V2`` batch fails ``is_draft_extend()``, whose ``include_v2`` defaults to False, and takes the generic
extend branch, ``qo_indptr`` from ``extend_seq_lens``, ``kv_indptr`` from ``extend_prefix_lens``), and
``ForwardMode.is_draft_extend`` in ``forward_batch_info.py``; a stored
``speculative/eagle_draft_extend_cuda_graph_runner.py`` of that time (``EAGLEDraftExtendCudaGraphRunner``: V2 mode
``DRAFT_EXTEND_V2`` for ``EagleDraftWorker``, ``num_tokens_per_bs = speculative_num_steps + 1``, static buffers,
``capture_one_batch_size`` with two warmup runs, ``replay`` padding to a captured bs with ``accept_length.fill_(1)``
for the padded rows, copying ``spec_info.accept_length`` into its buffer, calling
``init_forward_metadata_replay_cuda_graph``, and for V2 returning all ``num_tokens`` rows, "all tokens calculations
whether accepted or not"); and the CI test file (``attention_backend = "triton"``, EAGLE3, topk 1, 5 steps, 6 draft
tokens), which places the fix in the Triton backend; and, in a stored copy of a spec-v2 eagle worker (repository not
named by the index), the draft-extend selection ``select_index = torch.arange(bs) * stride + accept_lens - 1``.
Symptom: issue #19717 is not quoted in what was read; the PR reports that ``test_radix_attention`` of the spec-v2
EAGLE3 Triton suite fails without the fix and passes with it. As the mechanism implies (and as modelled): with
draft-extend CUDA graphs on, any batch of two or more requests in which a request other than the last accepted fewer
than ``num_steps + 1`` tokens gets wrong draft hidden states / draft probabilities for the later requests (wrong
drafts, lower acceptance, no error); eager draft extend is fine.
Mechanism: in spec v2 the draft extend runs every request's ``num_steps + 1`` tokens (accepted or not) in a fixed
stride, and the worker then reads, per request, row ``b * (num_steps + 1) + accept_length[b] - 1``. The captured
``extend_attention_fwd`` launches its programs over ``bs`` requests and ``max_extend_len = num_steps + 1`` query rows
each and reads each request's rows from the static ``qo_indptr``. Capture fills it with the fixed stride; every replay
overwrites it with the packed ``cumsum(accept_length)``, so request ``b`` reads (and writes) the query rows at offset
``sum(accept_length[:b])``: rows belonging to the previous request, attended against request ``b``'s prefix, and the
rows past ``sum(accept_length)`` are not written at all. Eager mode never enters this branch.
Doctor: padded-shape-mismatch, at init_forward_metadata_replay_cuda_graph. The replay metadata is built from the
per-request real (accepted) row counts while the graph runs every request padded to the fixed ``num_steps + 1`` rows
the runner's token buffers hold; the fix (in that function) describes the padded layout instead.
Fix (upstream): ``init_forward_metadata_replay_cuda_graph`` builds the draft-extend ``qo_indptr`` with the same
``torch.arange(0, bs * num_tokens_per_bs + 1, step=num_tokens_per_bs)`` as the capture path.
Modelled: ``ForwardMode`` (``is_draft_extend(include_v2=False)``), ``EagleDraftInput`` (``hidden_states``,
``accept_length``), ``ForwardBatch``, ``TritonAttnBackend`` (``init_forward_metadata`` eager branches for
draft-extend v1 and generic extend, ``init_cuda_graph_state``, ``init_forward_metadata_capture_cuda_graph`` and
``init_forward_metadata_replay_cuda_graph`` draft-extend branches, ``forward_extend`` saving KV first), a torch
stand-in for ``create_flashinfer_kv_indices_triton`` and for the Triton ``extend_attention_fwd`` kernel (programs
over ``bs`` x ``max_len_extend`` query rows read through ``qo_indptr``; prefix through ``kv_indptr``/``kv_indices``,
causal extend part), ``EAGLEDraftExtendCudaGraphRunner`` (``capture`` over ``capture_bs`` in reverse,
``capture_one_batch_size`` with two warmups, ``replay`` with padding), and the v2 worker's per-request selection of
the last accepted row. Stand-ins: a one-layer EAGLE draft model (token embedding plus position embedding, ``fc`` over
``[embeds, target hidden]``, one attention layer, ``lm_head``, ``fast_topk`` with topk 1) in float64; ``seq_lens``
are the prefix lengths already in the KV pool (the prefix/extend split of the v2 ``seq_lens`` is not modelled);
attention outputs start from zeros (upstream ``torch.empty_like``) so unwritten rows are deterministic; int64 index
tensors; ``EagleDraftWorker.draft_extend`` is a stand-in name for the v2 worker's draft-extend step; KV slots 0 and 1
reserved (the runner's ``out_cache_loc`` starts at ones, padded rows are zeroed).
Workload: topk 1, 3 speculative steps (4 tokens per request), graphs for bs 1, 2, 4. Three draft-extend steps over a
KV pool with random prefixes: (1) 2 requests, accept lengths [4, 4]; (2) 3 requests (padded to 4), [2, 4, 1];
(3) 2 requests, [1, 3]. Output per step: the selected rows' draft hidden states and top-1 probabilities.
Measured: bug: misbehaves, max |graph - eager| = 2.24. Step 1 equals eager (accept lengths [4, 4] give the same
layout). Step 2 (packed ``qo_indptr`` [0, 2, 6, 7, 8]): request 0 equals eager; request 1's selected row 7 is computed
by the padded request's program (hidden-state error 2.24); request 2's row 8 is never written (1.38; top-1 probability
off by 0.21). Step 3: request 1 differs (hidden 0.995, top-1 probability 0.091). Fix: equals eager (max error 0).
"""
from __future__ import annotations

import dataclasses
import enum
import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/19807"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "init_forward_metadata_replay_cuda_graph"
SYMPTOM = ("spec-v2 EAGLE with the Triton backend: draft-extend graph replays index each request's fixed-stride query "
           "rows through a qo_indptr packed by accept_length, so later requests get wrong draft hidden states")

SPECULATIVE_NUM_STEPS, SPECULATIVE_EAGLE_TOPK = 3, 1
CUDA_GRAPH_BS = [1, 2, 4]
MAX_REQS, MAX_CONTEXT_LEN = 8, 16
POOL_SIZE = 16 + MAX_REQS * MAX_CONTEXT_LEN              # slots 0..15 reserved (padding / capture dummies)
VOCAB, HIDDEN = 16, 8
DTYPE = torch.float64

_variant = "bug"


# --- sglang/srt/model_executor/forward_batch_info.py (reduced) ---------------------------------------------------------

class ForwardMode(enum.IntEnum):
    EXTEND = enum.auto()
    DRAFT_EXTEND = enum.auto()
    DRAFT_EXTEND_V2 = enum.auto()

    def is_draft_extend(self, include_v2: bool = False):
        return self == ForwardMode.DRAFT_EXTEND or (include_v2 and self == ForwardMode.DRAFT_EXTEND_V2)

    def is_draft_extend_v2(self):
        return self == ForwardMode.DRAFT_EXTEND_V2


@dataclasses.dataclass
class EagleDraftInput:
    hidden_states: torch.Tensor
    accept_length: torch.Tensor
    positions: torch.Tensor | None = None


@dataclasses.dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    out_cache_loc: torch.Tensor
    seq_lens_sum: int
    positions: torch.Tensor
    extend_seq_lens: torch.Tensor
    extend_seq_lens_cpu: list
    extend_prefix_lens: torch.Tensor
    spec_info: EagleDraftInput
    attn_backend: object = None


@dataclasses.dataclass
class LogitsProcessorOutput:
    next_token_logits: torch.Tensor
    hidden_states: torch.Tensor
    topk_p: torch.Tensor | None = None
    topk_index: torch.Tensor | None = None


def fast_topk(values, topk, dim):
    return torch.topk(values, topk, dim=dim)


# --- KV pool and Triton kernels (torch stand-ins) ----------------------------------------------------------------------

class MHATokenToKVPool:
    def __init__(self, k_buffer, v_buffer):
        self.k_buffer, self.v_buffer = k_buffer, v_buffer

    def set_kv_buffer(self, layer, loc, cache_k, cache_v):
        self.k_buffer.index_copy_(0, loc, cache_k)
        self.v_buffer.index_copy_(0, loc, cache_v)


def create_flashinfer_kv_indices_triton(req_to_token, req_pool_indices, page_kernel_lens, kv_indptr, kv_start_idx,
                                        kv_indices_ptr, req_to_token_ptr_stride):
    """One program per request: kv_indices[kv_indptr[b] + j] = req_to_token[req_pool_indices[b], j], j < lens[b]."""
    j = torch.arange(req_to_token_ptr_stride, device=req_to_token.device)
    rows = req_to_token[req_pool_indices]                                     # [bs, MAX_CONTEXT_LEN]
    valid = j[None, :] < page_kernel_lens[:, None]
    dst = torch.where(valid, kv_indptr[: rows.shape[0], None] + j[None, :], kv_indices_ptr.shape[0] - 1)
    kv_indices_ptr.index_put_((dst.reshape(-1),), torch.where(valid, rows, 0).reshape(-1))


def extend_attention_fwd(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr,
                         kv_indices, max_len_extend, sm_scale):
    """Program (b, m) handles query row ``qo_indptr[b] + m`` if ``m < qo_indptr[b+1] - qo_indptr[b]``: it attends the
    request's prefix (``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``) and, causally, the request's own extend rows, and
    writes ``o_extend`` at the same row. ``o_extend`` has one extra row that takes the masked-off lanes."""
    n, bs = q_extend.shape[0], qo_indptr.shape[0] - 1
    m = torch.arange(max_len_extend, device=q_extend.device)
    start, ext_len = qo_indptr[:-1], qo_indptr[1:] - qo_indptr[:-1]
    rows = start[:, None] + m[None, :]                                        # [bs, M]
    mask_m = m[None, :] < ext_len[:, None]
    rows_c = torch.where(mask_m, rows, 0).clamp(max=n - 1)
    q = q_extend[rows_c]                                                      # [bs, M, D]
    p = torch.arange(MAX_CONTEXT_LEN, device=q_extend.device)
    prefix_len = kv_indptr[1:] - kv_indptr[:-1]
    loc = kv_indices[(kv_indptr[:-1, None] + p[None, :]).clamp(max=kv_indices.shape[0] - 1)]
    qk_pre = torch.einsum("bmd,bpd->bmp", q, k_buffer[loc]) * sm_scale
    qk_pre = qk_pre.masked_fill(~(p[None, None, :] < prefix_len[:, None, None]), float("-inf"))
    qk_ext = torch.einsum("bmd,bnd->bmn", q, k_extend[rows_c]) * sm_scale
    causal = (m[None, :, None] >= m[None, None, :]) & mask_m[:, None, :]
    qk_ext = qk_ext.masked_fill(~causal, float("-inf"))
    probs = torch.softmax(torch.cat([qk_pre, qk_ext], dim=-1), dim=-1)
    out = (torch.einsum("bmp,bpd->bmd", probs[..., :MAX_CONTEXT_LEN], v_buffer[loc])
           + torch.einsum("bmn,bnd->bmd", probs[..., MAX_CONTEXT_LEN:], v_extend[rows_c]))
    o_extend.index_put_((torch.where(mask_m, rows, n).reshape(-1),), out.reshape(-1, out.shape[-1]))


# --- sglang/srt/layers/attention/triton_backend.py (reduced) -----------------------------------------------------------

class TritonAttnBackend:
    def __init__(self, req_to_token, token_to_kv_pool, device):
        self.req_to_token, self.token_to_kv_pool, self.device = req_to_token, token_to_kv_pool, device
        self.speculative_num_steps = SPECULATIVE_NUM_STEPS
        self.qo_indptr = torch.zeros(MAX_REQS + 1, dtype=torch.int64, device=device)
        self.kv_indptr = torch.zeros(MAX_REQS + 1, dtype=torch.int64, device=device)
        self.forward_metadata = None

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        bs = forward_batch.batch_size
        spec_info = forward_batch.spec_info
        if forward_batch.forward_mode.is_draft_extend():
            # EAGLE v1 draft extend: one row per accepted token
            qo_indptr = torch.zeros(bs + 1, dtype=torch.int64, device=self.device)
            qo_indptr[1:] = torch.cumsum(spec_info.accept_length, dim=0)
            kv_lens = forward_batch.seq_lens
            max_extend_len = int(torch.max(spec_info.accept_length))
        else:
            # generic extend (also DRAFT_EXTEND_V2, which is_draft_extend() does not include by default)
            qo_indptr = torch.zeros(bs + 1, dtype=torch.int64, device=self.device)
            qo_indptr[1:] = torch.cumsum(forward_batch.extend_seq_lens, dim=0)
            kv_lens = forward_batch.extend_prefix_lens
            max_extend_len = max(forward_batch.extend_seq_lens_cpu)
        kv_indptr = torch.zeros(bs + 1, dtype=torch.int64, device=self.device)
        kv_indptr[1:] = torch.cumsum(kv_lens, dim=0)
        kv_indices = torch.zeros(int(kv_indptr[-1]) + 1, dtype=torch.int64, device=self.device)
        create_flashinfer_kv_indices_triton(self.req_to_token, forward_batch.req_pool_indices, kv_lens, kv_indptr,
                                            None, kv_indices, self.req_to_token.shape[1])
        self.forward_metadata = (max_extend_len, kv_indptr, kv_indices, qo_indptr)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        self.cuda_graph_kv_indices = torch.zeros(max_bs * self.req_to_token.shape[1] + 1, dtype=torch.int64,
                                                 device=self.device)

    def init_forward_metadata_capture_cuda_graph(self, bs, num_tokens, req_pool_indices, seq_lens, encoder_lens,
                                                 forward_mode, spec_info):
        assert forward_mode.is_draft_extend(include_v2=True)
        num_tokens_per_bs = self.speculative_num_steps + 1
        qo_indptr = self.qo_indptr[: bs + 1]
        qo_indptr[: bs + 1] = torch.arange(0, bs * num_tokens_per_bs + 1, step=num_tokens_per_bs,
                                           dtype=torch.int64, device=self.device)
        kv_indptr = self.kv_indptr[: bs + 1]
        kv_indptr[1: bs + 1] = torch.cumsum(seq_lens, dim=0)
        kv_indices = self.cuda_graph_kv_indices
        create_flashinfer_kv_indices_triton(self.req_to_token, req_pool_indices, seq_lens, kv_indptr, None,
                                            kv_indices, self.req_to_token.shape[1])
        max_extend_len = num_tokens_per_bs
        self.forward_metadata = (max_extend_len, kv_indptr, kv_indices, qo_indptr)

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_sum, encoder_lens,
                                                forward_mode, spec_info, seq_lens_cpu):
        assert forward_mode.is_draft_extend(include_v2=True)
        seq_lens = seq_lens[:bs]
        qo_indptr = self.qo_indptr[: bs + 1]
        if _variant == "bug":
            accept_lens = spec_info.accept_length[:bs]
            qo_indptr[1: bs + 1] = torch.cumsum(accept_lens, dim=0)
        else:
            num_tokens_per_bs = self.speculative_num_steps + 1
            qo_indptr[: bs + 1] = torch.arange(0, bs * num_tokens_per_bs + 1, step=num_tokens_per_bs,
                                               dtype=torch.int64, device=self.device)
        kv_indptr = self.kv_indptr[: bs + 1]
        kv_indptr[1: bs + 1] = torch.cumsum(seq_lens, dim=0)
        kv_indices = self.cuda_graph_kv_indices
        create_flashinfer_kv_indices_triton(self.req_to_token, req_pool_indices[:bs], seq_lens, kv_indptr, None,
                                            kv_indices, self.req_to_token.shape[1])

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        o = q.new_zeros(q.shape[0] + 1, q.shape[1])
        if save_kv_cache:                                  # save KV cache first
            self.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
        max_extend_len, kv_indptr, kv_indices, qo_indptr = self.forward_metadata
        extend_attention_fwd(q, k, v, o, self.token_to_kv_pool.k_buffer, self.token_to_kv_pool.v_buffer, qo_indptr,
                             kv_indptr, kv_indices, max_extend_len, 1.0 / math.sqrt(q.shape[-1]))
        return o[: q.shape[0]]


# --- sglang/srt/models/llama_eagle.py (reduced to one layer) -----------------------------------------------------------

class LlamaForCausalLMEagle:
    def __init__(self, device):
        gen = generator(19807)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.embed_tokens, self.pos_embed = r(VOCAB, HIDDEN, scale=1.0), r(MAX_CONTEXT_LEN, HIDDEN)
        self.fc = r(2 * HIDDEN, HIDDEN)
        self.wq, self.wk = r(HIDDEN, HIDDEN, scale=0.2), r(HIDDEN, HIDDEN, scale=0.2)
        self.wv, self.wo = r(HIDDEN, HIDDEN), r(HIDDEN, HIDDEN)
        self.lm_head = r(HIDDEN, VOCAB, scale=1.0)

    def forward(self, input_ids, positions, forward_batch: ForwardBatch):
        embeds = self.embed_tokens[input_ids] + self.pos_embed[positions]
        hidden_states = torch.cat([embeds, forward_batch.spec_info.hidden_states], dim=-1) @ self.fc
        q, k, v = hidden_states @ self.wq, hidden_states @ self.wk, hidden_states @ self.wv
        attn_output = forward_batch.attn_backend.forward_extend(q, k, v, 0, forward_batch)
        hidden_states = hidden_states + attn_output @ self.wo
        # DRAFT_EXTEND_V2: logits for every token, accepted or not
        return LogitsProcessorOutput(next_token_logits=hidden_states @ self.lm_head, hidden_states=hidden_states)


# --- sglang/srt/speculative/eagle_draft_extend_cuda_graph_runner.py (reduced) ------------------------------------------

class EAGLEDraftExtendCudaGraphRunner:
    def __init__(self, eagle_worker, device):
        self.eagle_worker = eagle_worker
        self.model_runner = eagle_worker.draft_runner
        self.forward_mode = ForwardMode.DRAFT_EXTEND_V2
        self.device = device
        self.graphs, self.output_buffers = {}, {}
        self.speculative_num_steps = SPECULATIVE_NUM_STEPS
        self.topk = SPECULATIVE_EAGLE_TOPK
        self.capture_bs = CUDA_GRAPH_BS
        self.num_tokens_per_bs = self.speculative_num_steps + 1
        self.max_bs = max(self.capture_bs)
        self.max_num_token = self.max_bs * self.num_tokens_per_bs
        self.eagle_worker.draft_extend_attn_backend.init_cuda_graph_state(self.max_bs, self.max_num_token)
        self.seq_len_fill_value = self.eagle_worker.draft_extend_attn_backend.get_cuda_graph_seq_len_fill_value()
        self.seq_lens_cpu = torch.full((self.max_bs,), self.seq_len_fill_value, dtype=torch.int64)
        self.extend_seq_lens_cpu = [self.num_tokens_per_bs] * self.max_bs
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(self.max_num_token, **i64)
        self.req_pool_indices = torch.zeros(self.max_bs, **i64)
        self.out_cache_loc = torch.ones(self.max_num_token, **i64)
        self.positions = torch.zeros(self.max_num_token, **i64)
        self.hidden_states = torch.zeros(self.max_num_token, HIDDEN, dtype=DTYPE, device=device)
        self.seq_lens = torch.full((self.max_bs,), self.seq_len_fill_value, **i64)
        self.extend_seq_lens = torch.ones(self.max_bs, **i64)
        self.accept_length = torch.full((self.max_bs,), self.num_tokens_per_bs, **i64)
        self.capture()

    def capture(self):
        for bs in reversed(self.capture_bs):
            self.graphs[bs], self.output_buffers[bs] = self.capture_one_batch_size(bs)

    def capture_one_batch_size(self, bs: int):
        num_tokens = bs * self.num_tokens_per_bs
        backend = self.eagle_worker.draft_extend_attn_backend
        spec_info = EagleDraftInput(hidden_states=self.hidden_states[:num_tokens],
                                    accept_length=self.accept_length[:bs])
        forward_batch = ForwardBatch(
            forward_mode=self.forward_mode, batch_size=bs, input_ids=self.input_ids[:num_tokens],
            req_pool_indices=self.req_pool_indices[:bs], seq_lens=self.seq_lens[:bs],
            seq_lens_cpu=self.seq_lens_cpu[:bs], out_cache_loc=self.out_cache_loc[:num_tokens],
            seq_lens_sum=int(self.seq_lens[:bs].sum()), positions=self.positions[:num_tokens],
            extend_seq_lens=self.extend_seq_lens[:bs], extend_seq_lens_cpu=self.extend_seq_lens_cpu[:bs],
            extend_prefix_lens=self.seq_lens[:bs], spec_info=spec_info, attn_backend=backend)
        backend.init_forward_metadata_capture_cuda_graph(bs=bs, num_tokens=num_tokens,
                                                         req_pool_indices=forward_batch.req_pool_indices,
                                                         seq_lens=forward_batch.seq_lens, encoder_lens=None,
                                                         forward_mode=self.forward_mode, spec_info=spec_info)

        def run_once():
            ret = self.model_runner.model.forward(forward_batch.input_ids, forward_batch.positions, forward_batch)
            probs = torch.softmax(ret.next_token_logits, dim=-1)
            topk_p, topk_index = fast_topk(probs, self.topk, dim=-1)
            return ret.next_token_logits, ret.hidden_states, topk_p, topk_index

        max_extend_len, kv_indptr, kv_indices, qo_indptr = backend.forward_metadata
        pool = self.eagle_worker.draft_runner.token_to_kv_pool
        return capture(run_once, device=self.device, warmups=2,
                       static={"input_ids": self.input_ids, "positions": self.positions,
                               "hidden_states": self.hidden_states, "out_cache_loc": self.out_cache_loc,
                               "req_pool_indices": self.req_pool_indices, "seq_lens": self.seq_lens,
                               "accept_length": self.accept_length, "qo_indptr": qo_indptr,
                               "kv_indptr": kv_indptr, "kv_indices": kv_indices},
                       state={"k_buffer": pool.k_buffer, "v_buffer": pool.v_buffer},
                       owner="EAGLEDraftExtendCudaGraphRunner", name=f"draft extend v2 bs={bs}")

    def can_run(self, forward_batch: ForwardBatch):
        return forward_batch.seq_lens.numel() <= self.max_bs

    def replay(self, forward_batch: ForwardBatch):
        raw_bs = forward_batch.batch_size
        num_tokens = forward_batch.input_ids.shape[0]
        bs = next(b for b in self.capture_bs if b >= raw_bs)
        if bs * self.num_tokens_per_bs != num_tokens:
            self.seq_lens.fill_(self.seq_len_fill_value)
            self.out_cache_loc.zero_()
            self.positions.zero_()
            self.accept_length.fill_(1)
            self.extend_seq_lens.fill_(1)

        self.input_ids[:num_tokens].copy_(forward_batch.input_ids)
        self.seq_lens[:raw_bs].copy_(forward_batch.seq_lens)
        self.extend_seq_lens[:raw_bs].copy_(forward_batch.extend_seq_lens)
        self.out_cache_loc[:num_tokens].copy_(forward_batch.out_cache_loc)
        self.positions[:num_tokens].copy_(forward_batch.positions)
        self.hidden_states[:num_tokens].copy_(forward_batch.spec_info.hidden_states)
        self.accept_length[:raw_bs].copy_(forward_batch.spec_info.accept_length)
        self.req_pool_indices[:raw_bs].copy_(forward_batch.req_pool_indices)
        if bs != raw_bs:
            self.seq_lens_cpu.fill_(self.seq_len_fill_value)
        self.seq_lens_cpu[:raw_bs].copy_(forward_batch.seq_lens_cpu)
        if bs != raw_bs:
            forward_batch.spec_info.positions = self.positions[:num_tokens]
            forward_batch.spec_info.accept_length = self.accept_length[:bs]

        self.eagle_worker.draft_extend_attn_backend.init_forward_metadata_replay_cuda_graph(
            bs=bs, req_pool_indices=self.req_pool_indices, seq_lens=self.seq_lens,
            seq_lens_sum=forward_batch.seq_lens_sum + (bs - raw_bs) * self.seq_len_fill_value, encoder_lens=None,
            forward_mode=self.forward_mode, spec_info=forward_batch.spec_info, seq_lens_cpu=self.seq_lens_cpu)

        self.raw_bs, self.bs = raw_bs, bs
        logits, hidden, topk_p, topk_index = replay(self.graphs[bs], self.output_buffers[bs], real=num_tokens,
                                                    size=bs * self.num_tokens_per_bs)
        # DRAFT_EXTEND_V2: all tokens calculations whether accepted or not
        unpadding_bs = num_tokens
        out = LogitsProcessorOutput(next_token_logits=logits[:unpadding_bs], hidden_states=hidden[:unpadding_bs])
        out.topk_p, out.topk_index = topk_p[:unpadding_bs], topk_index[:unpadding_bs]
        return out


# --- the spec-v2 draft worker (reduced): draft extend after verify ----------------------------------------------------

class DraftModelRunner:
    def __init__(self, model, token_to_kv_pool):
        self.model, self.token_to_kv_pool = model, token_to_kv_pool


class EagleDraftWorker:
    def __init__(self, device, use_cuda_graph, k_buffer, v_buffer, req_to_token):
        pool = MHATokenToKVPool(k_buffer, v_buffer)
        self.draft_runner = DraftModelRunner(LlamaForCausalLMEagle(device), pool)
        self.draft_extend_attn_backend = TritonAttnBackend(req_to_token, pool, device)
        self.cuda_graph_runner_for_draft_extend = (EAGLEDraftExtendCudaGraphRunner(self, device)
                                                   if use_cuda_graph else None)

    def draft_extend(self, forward_batch: ForwardBatch):
        forward_batch.attn_backend = self.draft_extend_attn_backend
        runner = self.cuda_graph_runner_for_draft_extend
        if runner is not None and runner.can_run(forward_batch):
            out = runner.replay(forward_batch)
        else:
            self.draft_extend_attn_backend.init_forward_metadata(forward_batch)
            out = self.draft_runner.model.forward(forward_batch.input_ids, forward_batch.positions, forward_batch)
            out.topk_p, out.topk_index = fast_topk(torch.softmax(out.next_token_logits, dim=-1), SPECULATIVE_EAGLE_TOPK,
                                                   dim=-1)
        # the last accepted token of each request carries the next draft round
        accept_length = forward_batch.spec_info.accept_length[: forward_batch.batch_size]
        select_index = (torch.arange(forward_batch.batch_size, device=accept_length.device)
                        * (SPECULATIVE_NUM_STEPS + 1) + accept_length - 1)
        return out.hidden_states[select_index].clone(), out.topk_p[select_index].clone()


def _serve(device, use_cuda_graph):
    gen = generator(7)
    n_per = SPECULATIVE_NUM_STEPS + 1
    req_to_token = (16 + torch.arange(MAX_REQS * MAX_CONTEXT_LEN)).view(MAX_REQS, MAX_CONTEXT_LEN).to(device)
    k_buffer = randn(POOL_SIZE, HIDDEN, gen=gen, device=device).to(DTYPE)
    v_buffer = randn(POOL_SIZE, HIDDEN, gen=gen, device=device).to(DTYPE)
    worker = EagleDraftWorker(device, use_cuda_graph, k_buffer, v_buffer, req_to_token)
    outs = []
    for reqs, prefix_lens, accept in (([0, 1], [5, 7], [4, 4]), ([2, 3, 4], [6, 4, 9], [2, 4, 1]),
                                      ([5, 6], [3, 8], [1, 3])):
        bs = len(reqs)
        req_pool_indices = torch.tensor(reqs, device=device)
        seq_lens = torch.tensor(prefix_lens, device=device)
        j = torch.arange(n_per, device=device)
        positions = (seq_lens[:, None] + j[None, :]).reshape(-1)
        out_cache_loc = req_to_token[req_pool_indices[:, None], seq_lens[:, None] + j[None, :]].reshape(-1)
        spec_info = EagleDraftInput(hidden_states=randn(bs * n_per, HIDDEN, gen=gen, device=device).to(DTYPE),
                                    accept_length=torch.tensor(accept, device=device))
        forward_batch = ForwardBatch(
            forward_mode=ForwardMode.DRAFT_EXTEND_V2, batch_size=bs,
            input_ids=torch.randint(0, VOCAB, (bs * n_per,), generator=gen).to(device),
            req_pool_indices=req_pool_indices, seq_lens=seq_lens, seq_lens_cpu=seq_lens.cpu(),
            out_cache_loc=out_cache_loc, seq_lens_sum=int(sum(prefix_lens)), positions=positions,
            extend_seq_lens=torch.full((bs,), n_per, device=device), extend_seq_lens_cpu=[n_per] * bs,
            extend_prefix_lens=seq_lens, spec_info=spec_info)
        outs.extend(worker.draft_extend(forward_batch))
    return outs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: _serve(device, True), lambda: _serve(device, False))
