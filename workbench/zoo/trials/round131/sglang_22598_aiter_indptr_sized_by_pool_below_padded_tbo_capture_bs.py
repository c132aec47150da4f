"""SGLang's AMD ``AiterAttnBackend`` sizes its ``kv_indptr`` / ``qo_indptr`` / ``mask_indptr`` buffers in ``__init__`` for ``req_to_token_pool.size`` requests, but since #20978 the decode ``CudaGraphRunner`` rounds the request cap up to a multiple of the two-batch-overlap (TBO) base and captures a graph that large; ``init_cuda_graph_state(max_bs)`` leaves the indptr buffers as they were, so the capture of the largest batch writes ``bs`` prefix sums into ``kv_indptr[1 : bs + 1]``, a slice one short, and the server dies at start-up.

Upstream: https://github.com/sgl-project/sglang/pull/22598 ("[AMD] fix tbo runtime error when initializing metadata
for cuda graph", sgl-project/sglang, by billishyahao, PR description dated 2026-04-11, merged; squash commit
b74a9dd85447b42d3b7a21f87afdc8709ae7e681 on main, dated 2026-04-20, read in a stored mirror of the history, the fork
zcnrex/sglang). Read: the full diff of that commit (``aiter_backend.py``:
``init_cuda_graph_state`` reallocates ``kv_indptr``, ``qo_indptr``, ``mask_indptr`` and, if present, ``qo_indptr_`` at
``max_bs + 1`` when ``max_bs + 1 > self.kv_indptr.shape[0]``, and types ``cuda_graph_kv_last_page_len`` as int32; the
rest is a CI test's port wait); at its parent, ``python/sglang/srt/layers/attention/aiter_backend.py``
(``AiterAttnBackend.__init__``: ``max_bs = model_runner.req_to_token_pool.size`` and the indptr buffers of
``max_bs + 1``; ``init_forward_metadata``, ``init_cuda_graph_state``, ``init_forward_metadata_capture_cuda_graph``
and ``init_forward_metadata_replay_cuda_graph``, decode branches without speculative decoding;
``get_cuda_graph_seq_len_fill_value``; ``forward_decode``'s non-MLA ``paged_attention_ragged`` call) and
``python/sglang/srt/model_executor/cuda_graph_runner.py`` (``get_batch_sizes_to_capture``, ``CudaGraphRunner.__init__``
calling ``init_cuda_graph_state(self.max_bs, self.max_num_token)``, ``capture`` over ``reversed(capture_bs)``,
``replay_prepare`` with ``bisect_left`` padding and ``populate_from_forward_batch``); and the full diff of #20978
("perf: pad max-num-requests in decode cuda graph for higher coverage", commit 343998865), which introduced the
rounding up.
Not read: the TBO plugin and ``TboAttnBackend`` (how TBO splits a captured batch between child backends), the
``create_flashinfer_kv_indices_triton`` and aiter ``paged_attention_ragged`` kernels, issue threads.
Symptom: the PR quotes the scheduler failing at start-up: "Scheduler hit an exception: Traceback ...
cuda_graph_runner.py, line 645, in __init__ self.capture() ... line 801, in capture _capture_one_stream()" (the
message itself is cut off in what was read); a regression for the aiter backend with TBO since #20978 "where capture_bs
is updated beyond pool_size for performance purpose".
Mechanism: ``get_batch_sizes_to_capture`` now pads ``num_max_requests = req_to_token_pool.size`` up to a multiple of
``mul_base`` (2 with TBO) and keeps capture sizes up to that padded value, so with an odd pool size the largest
captured batch is ``pool_size + 1``. The runner tells the backend ``init_cuda_graph_state(max_bs=pool_size + 1)``;
the aiter backend sizes its graph-only buffers (``cuda_graph_kv_indices`` ...) from that, but the indptr buffers the
capture and replay metadata paths write stay at the ``pool_size + 1`` entries ``__init__`` gave them. Capturing the
largest batch first, ``init_forward_metadata_capture_cuda_graph`` does ``kv_indptr[1 : bs + 1] =
torch.cumsum(seq_lens)``: ``pool_size`` slots for ``pool_size + 1`` sums, a shape error. Eager decode never has more
requests than the pool, so it never meets the short buffer.
Doctor: undersized-buffer, at init_cuda_graph_state. The data of the padded capture size does not fit a static
buffer the backend owns; ``init_cuda_graph_state`` is where the backend learns the graphs' largest batch and sizes its
graph buffers, and where the fix grows the indptr buffers (the error itself shows in
``init_forward_metadata_capture_cuda_graph``).
Fix (upstream): in ``init_cuda_graph_state``, if ``max_bs + 1 > self.kv_indptr.shape[0]``, reallocate ``kv_indptr``,
``qo_indptr``, ``mask_indptr`` (and ``qo_indptr_``) with ``max_bs + 1`` entries.
Modelled: ``get_batch_sizes_to_capture`` (as after #20978, TBO's ``mul_base`` of 2, no attention TP/CP),
``ReqToTokenPool``, ``MHATokenToKVPool.set_kv_buffer``, ``ForwardMode``, ``ForwardBatch``, ``ForwardMetadata``,
``AiterAttnBackend`` (``__init__`` buffers, ``init_forward_metadata`` / ``init_cuda_graph_state`` /
``init_forward_metadata_capture_cuda_graph`` / ``init_forward_metadata_replay_cuda_graph`` decode branches,
``get_cuda_graph_seq_len_fill_value``, ``forward_decode``), ``CudaGraphRunner`` (``__init__``, ``capture``,
``capture_one_batch_size`` with two warmups, ``can_run``, ``replay_prepare`` padding with ``seq_lens.fill_`` and
``out_cache_loc.zero_()``, ``replay`` returning the first ``raw_bs`` rows), ``ModelRunner.forward_decode``.
Stand-ins: torch stand-ins for ``create_flashinfer_kv_indices_triton`` and ``paged_attention_ragged`` (page size 1,
one head; ``kv_last_page_len`` is not read, which upstream's kernel would, also sized by the pool); a one-layer model
(embedding plus position embedding, q/k/v, attention, output projection, ``lm_head``) in float64; TBO itself (the
split of a batch into two micro-batches and the child backends) is not modelled, only its ``mul_base``; ``cuda_graph_bs``
of [1, 2, 4, 8]; a pool of 5 requests and 8 tokens each; KV slot 0 reserved for the padded rows' zeroed
``out_cache_loc``; int64 index tensors.
Workload: pool of 5 requests, so capture sizes [2, 4, 6] (6 = 5 rounded up to TBO's base). Three decode steps on a KV
pool prefilled with random keys and values: 3 requests (served by the bs-4 graph, one padded row), 5 requests (the
bs-6 graph, one padded row), 2 requests (bs 2). Output per step: the real rows' logits.
Measured: bug: misbehaves, raised RuntimeError at the capture of bs 6 ("The expanded size of the tensor (5) must match
the existing size (6) at non-singleton dimension 0", from ``kv_indptr[1 : bs + 1] = torch.cumsum(seq_lens, dim=0)``
in ``init_forward_metadata_capture_cuda_graph``); no step is served. Fix: equals eager (max |graph - eager| = 0).
"""
from __future__ import annotations

import bisect
import dataclasses
import enum
import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/22598"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "init_cuda_graph_state"
SYMPTOM = ("aiter attention backend with two-batch overlap: the decode CUDA graph runner captures a batch one larger "
           "than the request pool, the indptr buffers sized by the pool do not fit it, and start-up fails")

CUDA_GRAPH_BS = [1, 2, 4, 8]
POOL_SIZE = 5                     # req_to_token_pool.size (--max-running-requests)
MAX_CONTEXT_LEN = 8
NUM_KV_SLOTS = 1 + POOL_SIZE * MAX_CONTEXT_LEN      # slot 0: where padded rows write (out_cache_loc zeroed)
VOCAB, HIDDEN = 16, 8
DTYPE = torch.float64

_variant = "bug"


# --- sglang/srt/server_args.py, mem_cache/memory_pool.py (reduced) ------------------------------------------------------

@dataclasses.dataclass
class ServerArgs:
    cuda_graph_bs: list
    enable_two_batch_overlap: bool = True
    disable_cuda_graph: bool = False


class ReqToTokenPool:
    def __init__(self, size, max_context_len, device):
        self.size = size
        self.req_to_token = (1 + torch.arange(size * max_context_len, device=device)).view(size, max_context_len)


class MHATokenToKVPool:
    def __init__(self, k_buffer, v_buffer):
        self.k_buffer, self.v_buffer = k_buffer, v_buffer

    def set_kv_buffer(self, layer, loc, cache_k, cache_v):
        self.k_buffer.index_copy_(0, loc, cache_k)
        self.v_buffer.index_copy_(0, loc, cache_v)


class ForwardMode(enum.IntEnum):
    DECODE = enum.auto()
    IDLE = enum.auto()

    def is_decode_or_idle(self):
        return self in (ForwardMode.DECODE, ForwardMode.IDLE)


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
    token_to_kv_pool: MHATokenToKVPool
    spec_info: object = None


# --- Triton / aiter kernels (torch stand-ins) ---------------------------------------------------------------------------

def create_flashinfer_kv_indices_triton(req_to_token, req_pool_indices, page_kernel_lens, kv_indptr, kv_start_idx,
                                        kv_indices_ptr, req_to_token_ptr_stride):
    """One program per request b: kv_indices[kv_indptr[b] + j] = req_to_token[req_pool_indices[b], j], j < lens[b]."""
    bs = req_pool_indices.shape[0]
    j = torch.arange(req_to_token_ptr_stride, device=req_to_token.device)
    rows = req_to_token[req_pool_indices]                                      # [bs, MAX_CONTEXT_LEN]
    valid = j[None, :] < page_kernel_lens[:, None]
    dst = kv_indptr[:bs, None] + j[None, :]
    kv_indices_ptr[dst[valid]] = rows[valid]


def paged_attention_ragged(out, workspace_buffer, query, key_cache, value_cache, scale, kv_indptr, kv_page_indices,
                           kv_last_page_lens, block_size, max_num_partitions, alibi_slopes, kv_cache_dtype,
                           kv_cache_layout, logits_soft_cap, k_scale, v_scale, fp8_out_scale, partition_size):
    """One program per query row b: attends the slots kv_page_indices[kv_indptr[b] : kv_indptr[b + 1]] (page size 1)."""
    bs = kv_indptr.shape[0] - 1
    p = torch.arange(MAX_CONTEXT_LEN, device=query.device)
    lens = kv_indptr[1:] - kv_indptr[:-1]
    idx = (kv_indptr[:-1, None] + p[None, :]).clamp(max=kv_page_indices.shape[0] - 1)
    loc = torch.where(p[None, :] < lens[:, None], kv_page_indices[idx], 0)
    scores = torch.einsum("bd,bpd->bp", query[:bs], key_cache[loc]) * scale
    scores = scores.masked_fill(~(p[None, :] < lens[:, None]), float("-inf"))
    out[:bs] = torch.einsum("bp,bpd->bd", torch.softmax(scores, dim=-1), value_cache[loc])


# --- sglang/srt/layers/attention/aiter_backend.py (reduced: non-MLA decode, page size 1, no spec decoding) --------------

@dataclasses.dataclass
class ForwardMetadata:
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    qo_indptr: torch.Tensor | None
    kv_last_page_len: torch.Tensor | None
    max_q_len: int | None
    max_kv_len: int | None
    run_graph: bool = True


class AiterAttnBackend:
    def __init__(self, model_runner, kv_indptr_buf=None):
        self.device = model_runner.device
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.max_context_len = MAX_CONTEXT_LEN
        self.page_size = 1
        self.num_draft_tokens = None
        self.scale = 1.0 / math.sqrt(HIDDEN)
        self.workspace_buffer = None
        self.max_num_partitions = 1

        max_bs = model_runner.req_to_token_pool.size

        if kv_indptr_buf is None:
            self.kv_indptr = torch.zeros((max_bs + 1,), dtype=torch.int64, device=self.device)
        else:
            self.kv_indptr = kv_indptr_buf
        self.kv_last_page_len = torch.ones((max_bs,), dtype=torch.int32, device=self.device)
        self.qo_indptr = torch.zeros((max_bs + 1,), dtype=torch.int64, device=self.device)
        self.mask_indptr = torch.zeros((max_bs + 1,), dtype=torch.int64, device=self.device)
        self.forward_metadata = None

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        """Eager decode: at most ``req_to_token_pool.size`` requests."""
        bs = forward_batch.batch_size
        kv_indptr = self.kv_indptr
        max_kv_len = int(forward_batch.seq_lens_cpu.max())
        assert forward_batch.forward_mode.is_decode_or_idle()
        kv_indptr[1: bs + 1] = torch.cumsum(forward_batch.seq_lens, dim=0)
        kv_indptr = kv_indptr[: bs + 1]
        kv_indices = torch.zeros(forward_batch.seq_lens_sum, dtype=torch.int64, device=self.device)
        create_flashinfer_kv_indices_triton(self.req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens,
                                            kv_indptr, None, kv_indices, self.req_to_token.shape[1])
        self.forward_metadata = ForwardMetadata(kv_indptr, kv_indices, None, None, None, max_kv_len, run_graph=False)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int, kv_indices_buf=None):
        if _variant == "fix":
            # PR #20978 pads max_bs beyond pool_size for higher cuda-graph
            # coverage. Reallocate indptr buffers so they fit the padded max_bs.
            if max_bs + 1 > self.kv_indptr.shape[0]:
                self.kv_indptr = torch.zeros((max_bs + 1,), dtype=torch.int64, device=self.device)
                self.qo_indptr = torch.zeros((max_bs + 1,), dtype=torch.int64, device=self.device)
                self.mask_indptr = torch.zeros((max_bs + 1,), dtype=torch.int64, device=self.device)
        self.cuda_graph_kv_last_page_len = torch.ones(max_bs, dtype=torch.int32, device=self.device)
        if kv_indices_buf is None:
            max_num_blocks_per_seq = (self.max_context_len + self.page_size - 1) // self.page_size
            self.cuda_graph_kv_indices = torch.zeros((max_bs * max_num_blocks_per_seq), dtype=torch.int64,
                                                     device=self.device)
        else:
            self.cuda_graph_kv_indices = kv_indices_buf

    def init_forward_metadata_capture_cuda_graph(self, bs, num_tokens, req_pool_indices, seq_lens, encoder_lens,
                                                 forward_mode, spec_info):
        max_kv_len = int(torch.max(seq_lens))
        assert forward_mode.is_decode_or_idle() and spec_info is None
        kv_indptr = self.kv_indptr
        kv_indptr[1: bs + 1] = torch.cumsum(seq_lens, dim=0)
        kv_indptr = kv_indptr[: bs + 1]
        kv_indices = self.cuda_graph_kv_indices
        create_flashinfer_kv_indices_triton(self.req_to_token, req_pool_indices, seq_lens, kv_indptr, None,
                                            kv_indices, self.req_to_token.shape[1])
        self.forward_metadata = ForwardMetadata(kv_indptr, kv_indices, None, None, None, max_kv_len)

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_sum, encoder_lens,
                                                forward_mode, spec_info, seq_lens_cpu=None):
        max_kv_len = int(seq_lens_cpu.max())
        assert forward_mode.is_decode_or_idle() and spec_info is None
        kv_indptr = self.kv_indptr
        kv_indptr[1: bs + 1] = torch.cumsum(seq_lens, dim=0)
        kv_indptr = kv_indptr[: bs + 1]
        kv_indices = self.cuda_graph_kv_indices
        create_flashinfer_kv_indices_triton(self.req_to_token, req_pool_indices, seq_lens, kv_indptr, None,
                                            kv_indices, self.req_to_token.shape[1])
        self.forward_metadata = ForwardMetadata(kv_indptr, kv_indices, None, None, None, max_kv_len)

    def get_cuda_graph_seq_len_fill_value(self):
        return 1 if self.num_draft_tokens is None else self.num_draft_tokens

    def forward_decode(self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache=True):
        if save_kv_cache:
            forward_batch.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
        o = torch.empty_like(q)
        pool = forward_batch.token_to_kv_pool
        paged_attention_ragged(o, self.workspace_buffer, q, pool.k_buffer, pool.v_buffer, self.scale,
                               self.forward_metadata.kv_indptr, self.forward_metadata.kv_indices,
                               self.kv_last_page_len, 1, self.max_num_partitions, None, "auto", "NHD", 0.0,
                               None, None, None, 256)
        return o


# --- a one-layer model ----------------------------------------------------------------------------------------------------

class TinyForCausalLM:
    def __init__(self, device):
        gen = generator(22598)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.embed_tokens, self.pos_embed = r(VOCAB, HIDDEN, scale=1.0), r(MAX_CONTEXT_LEN, HIDDEN)
        self.wq, self.wk, self.wv, self.wo = (r(HIDDEN, HIDDEN) for _ in range(4))
        self.lm_head = r(HIDDEN, VOCAB, scale=1.0)

    def forward(self, input_ids, positions, forward_batch: ForwardBatch, attn_backend):
        hidden_states = self.embed_tokens[input_ids] + self.pos_embed[positions]
        q, k, v = hidden_states @ self.wq, hidden_states @ self.wk, hidden_states @ self.wv
        attn_output = attn_backend.forward_decode(q, k, v, 0, forward_batch)
        hidden_states = hidden_states + attn_output @ self.wo
        return hidden_states @ self.lm_head


# --- sglang/srt/model_executor/cuda_graph_runner.py (reduced) -------------------------------------------------------------

def get_attention_tp_size():
    return 1


def get_attention_cp_size():
    return 1


def require_gathered_buffer(server_args):
    return False


def get_batch_sizes_to_capture(model_runner, num_tokens_per_bs=1):
    server_args = model_runner.server_args
    capture_bs = list(server_args.cuda_graph_bs)
    num_max_requests = model_runner.req_to_token_pool.size

    mul_base = 1
    if server_args.enable_two_batch_overlap:
        mul_base *= 2
        num_tokens_per_bs = 1  # tbo not test, set num_tokens_per_bs to 1

    if require_gathered_buffer(server_args):
        mul_base *= get_attention_tp_size()

    if mul_base % get_attention_cp_size() != 0:
        mul_base *= get_attention_cp_size()

    # pad `num_max_requests` to avoid being filtered out
    num_max_requests = (num_max_requests + mul_base - 1) // mul_base * mul_base
    if max(capture_bs) > num_max_requests:
        capture_bs += [num_max_requests]

    capture_bs = [bs for bs in capture_bs if bs * num_tokens_per_bs % mul_base == 0]
    capture_bs = [bs for bs in capture_bs if bs <= num_max_requests]
    capture_bs = list(sorted(set(capture_bs)))
    assert len(capture_bs) > 0 and capture_bs[0] > 0, f"{capture_bs=}"
    return capture_bs, []


class CudaGraphRunner:
    def __init__(self, model_runner):
        self.model_runner = model_runner
        self.device = model_runner.device
        self.graphs, self.output_buffers = {}, {}
        self.num_tokens_per_bs = 1
        self.capture_forward_mode = ForwardMode.DECODE
        self.capture_bs, self.compile_bs = get_batch_sizes_to_capture(model_runner)

        # Attention backend
        self.max_bs = max(self.capture_bs)
        self.max_num_token = self.max_bs * self.num_tokens_per_bs
        self.model_runner.attn_backend.init_cuda_graph_state(self.max_bs, self.max_num_token)
        self.seq_len_fill_value = self.model_runner.attn_backend.get_cuda_graph_seq_len_fill_value()

        i64 = dict(dtype=torch.int64, device=self.device)
        self.input_ids = torch.zeros((self.max_num_token,), **i64)
        self.req_pool_indices = torch.zeros((self.max_bs,), **i64)
        self.seq_lens = torch.full((self.max_bs,), self.seq_len_fill_value, **i64)
        self.seq_lens_cpu = torch.full((self.max_bs,), self.seq_len_fill_value, dtype=torch.int64)
        self.out_cache_loc = torch.zeros((self.max_num_token,), **i64)
        self.positions = torch.zeros((self.max_num_token,), **i64)

        self.capture()

    def can_run(self, forward_batch: ForwardBatch):
        return forward_batch.batch_size <= self.max_bs

    def capture(self) -> None:
        for bs in reversed(self.capture_bs):
            self.graphs[bs], self.output_buffers[bs] = self.capture_one_batch_size(bs)

    def capture_one_batch_size(self, bs: int):
        num_tokens = bs * self.num_tokens_per_bs
        attn_backend = self.model_runner.attn_backend
        forward_batch = ForwardBatch(
            forward_mode=self.capture_forward_mode, batch_size=bs, input_ids=self.input_ids[:num_tokens],
            req_pool_indices=self.req_pool_indices[:bs], seq_lens=self.seq_lens[:bs],
            seq_lens_cpu=self.seq_lens_cpu[:bs], out_cache_loc=self.out_cache_loc[:num_tokens],
            seq_lens_sum=int(self.seq_lens[:bs].sum()), positions=self.positions[:num_tokens],
            token_to_kv_pool=self.model_runner.token_to_kv_pool)
        attn_backend.init_forward_metadata_capture_cuda_graph(bs, num_tokens, forward_batch.req_pool_indices,
                                                              forward_batch.seq_lens, None, forward_batch.forward_mode,
                                                              None)
        meta = attn_backend.forward_metadata

        def run_once():
            return self.model_runner.model.forward(forward_batch.input_ids, forward_batch.positions, forward_batch,
                                                   attn_backend)

        pool = self.model_runner.token_to_kv_pool
        return capture(run_once, device=self.device, warmups=2,
                       static={"input_ids": self.input_ids, "req_pool_indices": self.req_pool_indices,
                               "seq_lens": self.seq_lens, "out_cache_loc": self.out_cache_loc,
                               "positions": self.positions, "kv_indptr": meta.kv_indptr,
                               "kv_indices": meta.kv_indices},
                       state={"k_buffer": pool.k_buffer, "v_buffer": pool.v_buffer},
                       owner="CudaGraphRunner", name=f"decode bs={bs}")

    def replay_prepare(self, forward_batch: ForwardBatch):
        raw_bs = forward_batch.batch_size
        raw_num_token = raw_bs * self.num_tokens_per_bs
        index = bisect.bisect_left(self.capture_bs, raw_bs)
        bs = self.capture_bs[index]

        # populate_from_forward_batch
        if bs != raw_bs:
            self.seq_lens.fill_(self.seq_len_fill_value)
            self.out_cache_loc.zero_()
        self.input_ids[:raw_num_token].copy_(forward_batch.input_ids)
        self.req_pool_indices[:raw_bs].copy_(forward_batch.req_pool_indices)
        self.seq_lens[:raw_bs].copy_(forward_batch.seq_lens)
        self.out_cache_loc[:raw_num_token].copy_(forward_batch.out_cache_loc)
        self.positions[:raw_num_token].copy_(forward_batch.positions)
        if bs != raw_bs:
            self.seq_lens_cpu.fill_(self.seq_len_fill_value)
        self.seq_lens_cpu[:raw_bs].copy_(forward_batch.seq_lens_cpu)

        self.model_runner.attn_backend.init_forward_metadata_replay_cuda_graph(
            bs, self.req_pool_indices[:bs], self.seq_lens[:bs],
            forward_batch.seq_lens_sum + (bs - raw_bs) * self.seq_len_fill_value, None, self.capture_forward_mode,
            forward_batch.spec_info, seq_lens_cpu=self.seq_lens_cpu[:bs])
        self.raw_bs, self.raw_num_token, self.bs = raw_bs, raw_num_token, bs

    def replay(self, forward_batch: ForwardBatch):
        self.replay_prepare(forward_batch)
        logits = replay(self.graphs[self.bs], self.output_buffers[self.bs], real=self.raw_bs, size=self.bs)
        return logits[: self.raw_bs]


# --- sglang/srt/model_executor/model_runner.py (reduced) ------------------------------------------------------------------

class ModelRunner:
    def __init__(self, device, server_args):
        self.device, self.server_args = device, server_args
        gen = generator(7)
        self.req_to_token_pool = ReqToTokenPool(POOL_SIZE, MAX_CONTEXT_LEN, device)
        self.token_to_kv_pool = MHATokenToKVPool(randn(NUM_KV_SLOTS, HIDDEN, gen=gen, device=device).to(DTYPE),
                                                 randn(NUM_KV_SLOTS, HIDDEN, gen=gen, device=device).to(DTYPE))
        self.model = TinyForCausalLM(device)
        self.attn_backend = AiterAttnBackend(self)
        self.graph_runner = None if server_args.disable_cuda_graph else CudaGraphRunner(self)

    def forward_decode(self, forward_batch: ForwardBatch):
        if self.graph_runner is not None and self.graph_runner.can_run(forward_batch):
            return self.graph_runner.replay(forward_batch).clone()
        self.attn_backend.init_forward_metadata(forward_batch)
        return self.model.forward(forward_batch.input_ids, forward_batch.positions, forward_batch, self.attn_backend)


def _serve(device, use_cuda_graph):
    server_args = ServerArgs(cuda_graph_bs=CUDA_GRAPH_BS, disable_cuda_graph=not use_cuda_graph)
    model_runner = ModelRunner(device, server_args)
    req_to_token = model_runner.req_to_token_pool.req_to_token
    gen = generator(3)
    outs = []
    # (request slots, seq_lens including the token decoded now)
    for reqs, seq_lens in (([0, 2, 4], [3, 6, 2]), ([0, 1, 2, 3, 4], [4, 5, 7, 3, 8]), ([1, 3], [6, 4])):
        bs = len(reqs)
        req_pool_indices = torch.tensor(reqs, device=device)
        seq_lens_t = torch.tensor(seq_lens, device=device)
        positions = seq_lens_t - 1
        forward_batch = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=bs,
            input_ids=torch.randint(0, VOCAB, (bs,), generator=gen).to(device),
            req_pool_indices=req_pool_indices, seq_lens=seq_lens_t, seq_lens_cpu=seq_lens_t.cpu(),
            out_cache_loc=req_to_token[req_pool_indices, positions], seq_lens_sum=int(sum(seq_lens)),
            positions=positions, token_to_kv_pool=model_runner.token_to_kv_pool)
        outs.append(model_runner.forward_decode(forward_batch))
    return outs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: _serve(device, True), lambda: _serve(device, False))
