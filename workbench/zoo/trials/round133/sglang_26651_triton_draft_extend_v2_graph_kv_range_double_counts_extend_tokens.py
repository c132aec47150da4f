"""SGLang's EAGLE v2 (overlap) worker runs the draft-extend step (``ForwardMode.DRAFT_EXTEND_V2``) with ``seq_lens``
already bumped to ``prefix + num_draft_tokens``; the Triton backend's eager ``init_forward_metadata`` builds the
cached-KV range from ``extend_prefix_lens`` (the prefix only), because its extend kernel receives the new tokens' keys
and values as separate, causally masked arguments. The graph-only metadata path of the same backend
(``init_forward_metadata_capture_cuda_graph`` / ``init_forward_metadata_replay_cuda_graph``, shared by DRAFT_EXTEND and
DRAFT_EXTEND_V2) builds ``kv_indptr`` / ``kv_indices`` from ``seq_lens``, so under the
``EAGLEDraftExtendCudaGraphRunner`` every replay also attends, without the causal mask, to the draft-extend tokens this
very step has just written into the KV cache: each token sees the later draft tokens of its request, and the draft
model's hidden states and logits differ from ``--disable-cuda-graph``.

Upstream: https://github.com/sgl-project/sglang/pull/26651 ("Fix DRAFT_EXTEND_V2 CG metadata: align test fixture and
Triton with production seq_lens convention", sgl-project/sglang, by Cheng Wan (ch-wan), PR description dated 2026-05-29,
merged; squash commit ec075d8bc5ff847f43637e9f6dd0cd03f962b024 on main dated 2026-05-29, read in a stored mirror of the
history, the fork zcnrex/sglang). Read: the full diff of that commit (``triton_backend.py``: in
``init_forward_metadata_capture_cuda_graph`` and ``init_forward_metadata_replay_cuda_graph``, the draft-extend branch
builds ``kv_lens = seq_lens - spec_info.extend_seq_lens_tensor`` (clamped at 0 at replay, zeros when the tensor is
absent at capture) for DRAFT_EXTEND_V2 and passes ``kv_lens`` instead of ``seq_lens`` to the ``kv_indptr`` cumsum and to
``create_flashinfer_kv_indices_triton``; the rest is the attention unit-test fixture
``speculative_draft_extend_runner.py`` and test docs) and the PR description in the stored issue corpus ("Without this,
the cached-KV range double-counts the just-written extend tokens because Triton's extend kernel also receives those
tokens as separate ``k, v`` arguments"). At the parent (ec075d8bc^): ``layers/attention/triton_backend.py``
(``ForwardMetadata``, ``TritonAttnBackend.__init__``, ``init_forward_metadata`` (DRAFT_EXTEND_V2 is not
``is_draft_extend()`` and takes the EXTEND branch over ``extend_prefix_lens``), ``init_cuda_graph_state``,
``init_forward_metadata_capture_cuda_graph`` and ``init_forward_metadata_replay_cuda_graph``, ``forward_extend``),
``layers/attention/triton_ops/extend_attention.py`` (``_fwd_kernel``: stage 1 over the prefix through ``kv_indptr`` /
``kv_indices`` with no causal mask, stage 2 over the extend ``k``/``v`` with the causal mask),
``speculative/eagle_draft_extend_cuda_graph_runner.py`` (``__init__`` and its buffers, ``can_run``,
``capture_one_batch_size`` with ``run_once`` and the topk-1 argmax fast path, ``_capture_init``'s two warmups,
``replay`` with its padding and ``extend_seq_lens_tensor``), ``speculative/eagle_info_v2.py``
(``prepare_for_extend_to_fill_draft_kvcache``: ``forward_batch.seq_lens = forward_batch.seq_lens + num_draft_tokens``,
prefix lens from the pre-bump ``seq_lens_cpu``, ``init_forward_metadata`` only when no graph can run;
``prepare_for_v2_verify``'s ``out_cache_loc`` over ``[seq_lens, seq_lens + draft_token_num)``),
``speculative/eagle_worker_v2.py`` (``init_cuda_graphs``: the draft-extend graph is captured for ``TritonAttnBackend``;
``_draft_extend_for_decode`` with ``select_index`` and the topk-1 argmax), and ``ForwardMode.is_draft_extend`` /
``is_draft_extend_v2``. Also read: the ``eagle_info_v2.py`` hunk of #26020 (c4b6b5ea1, 2026-05-22), which only moved the
``seq_lens`` bump from the ``ScheduleBatch`` onto the ``ForwardBatch``.
Not read: any issue or user report of this bug (the PR cites two attention unit tests, not a deployment), the review
thread, the follow-up #26658 beyond its description, the Triton kernels' sources other than ``_fwd_kernel``'s masking,
``ForwardBatch.init_new``'s position computation (positions here are ``prefix + j``, as the extend positions are), the
target model's verify, ``DraftBackendFactory`` (one backend object stands for the draft runner's and the draft-extend
backend here).
Symptom: no user report was read. The PR: the Triton CUDA-graph capture/replay paths for DRAFT_EXTEND_V2 let "the
cached-KV range double-count the just-written extend tokens"; the draft-extend outputs (the draft's next-token logits,
its top-1 token and the hidden states carried into the next draft) differ from the eager path's. Speculative decoding
verifies drafts against the target, so what a user would see is a lower acceptance length, not wrong text (an inference,
not read).
Mechanism: the v2 worker hands the draft-extend forward ``seq_lens = prefix + num_draft_tokens`` (the post-write
length). Eager, the Triton backend takes DRAFT_EXTEND_V2 through its EXTEND branch: ``kv_indptr`` / ``kv_indices`` over
``extend_prefix_lens``, queries and the new keys/values in ``qo_indptr``, causal among themselves. Under the graph,
``init_forward_metadata_replay_cuda_graph`` (and its capture twin) treats DRAFT_EXTEND_V2 like v1 draft extend (the
fix's comment: "DRAFT_EXTEND_V1: seq_lens = prefix only"): ``kv_indptr[1:] = cumsum(seq_lens)`` and ``kv_indices`` from
``req_to_token[:, :seq_len]``. ``forward_extend`` writes the step's keys and values into the cache (``set_kv_buffer``)
before the kernel runs, so the "prefix" the kernel reads unmasked now holds all ``num_draft_tokens`` new tokens of the
request, which stage 2 adds again under the causal mask. Only the graph path builds the metadata this way;
``--disable-cuda-graph`` is right.
Doctor: warmup-divergence, at init_forward_metadata_replay_cuda_graph. The captured step does other work than the eager
step would: the KV range every replay attends over is planned by the graph-only metadata path (the replay builder, with
its capture twin), which derives it from the sequence length where the eager ``init_forward_metadata`` takes the prefix
length. No padding, stale buffer or frozen host value is involved: the graph reads what the replay builder wrote at this
step, and that plan is wrong. This is the function that writes the metadata every served step reads and the one the fix
changes (with its capture twin, whose values no replay reads).
Fix (upstream): in both graph metadata builders, for DRAFT_EXTEND_V2 derive the prefix ``kv_lens = seq_lens -
extend_seq_lens_tensor`` (clamped at 0 at replay: padded rows have ``seq_lens`` at the fill value 1 and
``extend_seq_lens`` at ``num_tokens_per_bs``) and build ``kv_indptr`` / ``kv_indices`` from it.
Modelled: ``ReqToTokenPool``, ``MHATokenToKVPool`` (``set_kv_buffer``, ``get_key_buffer`` / ``get_value_buffer``),
``ForwardMode``, ``ForwardBatch``, ``ForwardMetadata``, ``TritonAttnBackend`` (``__init__`` buffers,
``init_forward_metadata``'s EXTEND branch, ``init_cuda_graph_state``, ``init_forward_metadata_capture_cuda_graph`` /
``init_forward_metadata_replay_cuda_graph`` draft-extend branches as at the parent, bug/fix as in the diff,
``get_cuda_graph_seq_len_fill_value``, ``forward_extend``), ``extend_attention_fwd``,
``create_flashinfer_kv_indices_triton``, ``EagleDraftInput.prepare_for_extend_to_fill_draft_kvcache``,
``EagleDraftExtendInput``, ``EAGLEDraftExtendCudaGraphRunner`` (``__init__``: ``num_tokens_per_bs = num_steps + 1``,
buffers, ``out_cache_loc`` initialised to ones; ``can_run``; ``capture`` largest first into one pool;
``capture_one_batch_size`` with two warmups and ``run_once``; ``replay`` with its padding fills, ``extend_seq_lens`` and
``extend_seq_lens_tensor``, un-padding to ``num_tokens``), ``EagleDraftWorker._draft_extend_for_decode``,
``ModelRunner.forward``, ``LogitsProcessorOutput``.
Stand-ins: ``extend_attention_fwd`` and ``create_flashinfer_kv_indices_triton`` in torch (page size 1, no sliding
window, no custom mask; the attention reads its indptrs on the device, with no host sync, as the kernel does); a
one-layer EAGLE draft model (token embedding, ``fc`` of the concatenated target hidden state, a learned position
embedding added to queries and keys instead of RoPE, two heads of width 8, an MLP, ``lm_head``; the hidden state
returned is the layer output) in float64; index tensors are int64 (upstream int32); one ``TritonAttnBackend`` object is
both the draft runner's and the draft-extend backend; a module-level forward context stands for ``ForwardContext``;
``ScheduleBatch`` / ``GenerationBatchResult`` hold only what the step reads; DP attention, the gathered buffers, deepep,
mrope, hybrid SWA and the plan stream are left out; the draft decode graph and the verify are not modelled (each round
brings its own target hidden states, verified tokens and accept lengths); request slot 0 and KV slot 0 are reserved, as
upstream's padding relies on.
Workload: topk 1, ``speculative_num_steps`` 2, 3 draft tokens, capture sizes 1, 2, 4, a pool of 5 requests of context
16. The worker (and its graphs) is built first, then the draft KV cache is filled with random keys and values (the
requests' prefixes, prefilled after start-up). Four draft-extend rounds: 3 requests (the bs-4 graph, one padded row), 2,
4, 1; per round the selected rows' logits and hidden states and the top-1 token are compared with the same worker run
with ``--disable-cuda-graph``.
Measured: bug: misbehaves (max |graph - eager| = 16): the compared top-1 draft token differs in the first two rounds (15
against 31, 23 against 28), the selected rows' logits differ by up to 7.7 and their hidden states by up to 4.6, and
every round differs. Fix: equals eager (max |graph - eager| = 0). Check of the stand-in: ``extend_attention_fwd`` over a
prefix of 5 cached tokens and 3 extend tokens equals plain causal attention over the 8 to 1.1e-16.
"""
from __future__ import annotations

import bisect
import contextlib
import dataclasses
import enum
import math
from typing import Callable, List, Optional

import torch

from workbench.engine import graph_pool_handle, host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/26651"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "init_forward_metadata_replay_cuda_graph"
SYMPTOM = ("EAGLE v2 draft extend on the Triton backend under CUDA graphs: the graph-only metadata path builds the "
           "cached-KV range from the bumped seq_lens, so every replay attends, unmasked, to the draft tokens the step "
           "has just written, and the draft's logits and hidden states differ from --disable-cuda-graph")

CUDA_GRAPH_BS = [1, 2, 4]
SPECULATIVE_NUM_STEPS = 2
SPECULATIVE_EAGLE_TOPK = 1
SPECULATIVE_NUM_DRAFT_TOKENS = 3
POOL_SIZE = 6                     # req_to_token_pool.size: request 0 reserved (padding), 1..5 live
MAX_CONTEXT_LEN = 16
NUM_KV_SLOTS = 1 + (POOL_SIZE - 1) * MAX_CONTEXT_LEN      # slot 0 reserved
VOCAB, HIDDEN, NUM_HEADS, HEAD_DIM = 32, 16, 2, 8
DTYPE = torch.float64

_variant = "bug"


# --- sglang/srt/mem_cache/memory_pool.py, model_executor/forward_batch_info.py (reduced) ----------------------------

class ReqToTokenPool:
    def __init__(self, size, max_context_len, device):
        self.size = size
        rows = 1 + torch.arange((size - 1) * max_context_len).view(size - 1, max_context_len)
        self.req_to_token = torch.cat([torch.zeros(1, max_context_len, dtype=torch.int64), rows]).to(device)


class MHATokenToKVPool:
    def __init__(self, k_buffer, v_buffer):
        self.k_buffer, self.v_buffer = [k_buffer], [v_buffer]

    def set_kv_buffer(self, layer, loc, cache_k, cache_v):
        self.k_buffer[layer.layer_id][loc] = cache_k
        self.v_buffer[layer.layer_id][loc] = cache_v

    def get_key_buffer(self, layer_id):
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id):
        return self.v_buffer[layer_id]


class ForwardMode(enum.IntEnum):
    EXTEND = enum.auto()
    DECODE = enum.auto()
    TARGET_VERIFY = enum.auto()
    DRAFT_EXTEND = enum.auto()
    DRAFT_EXTEND_V2 = enum.auto()
    IDLE = enum.auto()

    def is_decode_or_idle(self):
        return self in (ForwardMode.DECODE, ForwardMode.IDLE)

    def is_target_verify(self):
        return self == ForwardMode.TARGET_VERIFY

    def is_draft_extend(self, include_v2: bool = False):
        return self == ForwardMode.DRAFT_EXTEND or (include_v2 and self == ForwardMode.DRAFT_EXTEND_V2)

    def is_draft_extend_v2(self):
        return self == ForwardMode.DRAFT_EXTEND_V2


@dataclasses.dataclass
class EagleDraftExtendInput:
    hidden_states: torch.Tensor
    num_correct_drafts: Optional[torch.Tensor] = None
    num_accept_tokens: Optional[torch.Tensor] = None
    extend_seq_lens_cpu: Optional[list] = None
    extend_seq_lens_tensor: Optional[torch.Tensor] = None
    positions: Optional[torch.Tensor] = None


@dataclasses.dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    out_cache_loc: torch.Tensor
    positions: torch.Tensor
    seq_lens_sum: int
    spec_info: EagleDraftExtendInput
    extend_seq_lens: Optional[torch.Tensor] = None
    extend_seq_lens_cpu: Optional[list] = None
    extend_prefix_lens: Optional[torch.Tensor] = None
    extend_prefix_lens_cpu: Optional[list] = None


@dataclasses.dataclass
class LogitsProcessorOutput:
    next_token_logits: torch.Tensor
    hidden_states: torch.Tensor


_forward_context: list = []


@contextlib.contextmanager
def forward_context(attn_backend):
    _forward_context.append(attn_backend)
    try:
        yield
    finally:
        _forward_context.pop()


def get_attn_backend():
    return _forward_context[-1]


# --- Triton kernels (torch stand-ins) -------------------------------------------------------------------------------

def create_flashinfer_kv_indices_triton(req_to_token, req_pool_indices, page_kernel_lens, kv_indptr, kv_start_idx,
                                        kv_indices_ptr, req_to_token_ptr_stride):
    """One program per request b: kv_indices[kv_indptr[b] + j] = req_to_token[req_pool_indices[b], j], j < lens[b]."""
    bs = req_pool_indices.shape[0]
    j = torch.arange(req_to_token_ptr_stride, device=req_to_token.device)
    rows = req_to_token[req_pool_indices]
    valid = j[None, :] < page_kernel_lens[:bs, None]
    dst = kv_indptr[:bs, None] + j[None, :]
    kv_indices_ptr[dst[valid]] = rows[valid]


def extend_attention_fwd(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
                         custom_mask, is_causal, mask_indptr, max_len_extend, sm_scale):
    """``_fwd_kernel``: per request, stage 1 over its prefix (``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` of the cache,
    no causal mask), stage 2 over its own extend tokens ``k_extend``/``v_extend`` (causal), one softmax over both."""
    assert custom_mask is None
    dev = q_extend.device
    bs, num_tokens = qo_indptr.shape[0] - 1, q_extend.shape[0]
    e = torch.arange(max_len_extend, device=dev)
    q_len = qo_indptr[1: bs + 1] - qo_indptr[:bs]
    q_valid = e[None, :] < q_len[:, None]                                        # [bs, E]
    q_idx = torch.where(q_valid, qo_indptr[:bs, None] + e[None, :], num_tokens)
    q_safe = q_idx.clamp(max=num_tokens - 1)
    p = torch.arange(MAX_CONTEXT_LEN, device=dev)
    pre_len = kv_indptr[1: bs + 1] - kv_indptr[:bs]
    p_valid = p[None, :] < pre_len[:, None]                                      # [bs, P]
    loc = torch.where(p_valid, kv_indices[(kv_indptr[:bs, None] + p[None, :]).clamp(max=kv_indices.numel() - 1)], 0)
    q, ke, ve = q_extend[q_safe], k_extend[q_safe], v_extend[q_safe]             # [bs, E, H, D]
    s_pre = torch.einsum("behd,bphd->bhep", q, k_buffer[loc]) * sm_scale
    s_pre = s_pre.masked_fill(~p_valid[:, None, None, :], float("-inf"))
    s_ext = torch.einsum("behd,bfhd->bhef", q, ke) * sm_scale
    ok = q_valid[:, None, :] & q_valid[:, :, None]
    if is_causal:
        ok = ok & (e[None, :] <= e[:, None])[None]
    s_ext = s_ext.masked_fill(~ok[:, None], float("-inf"))
    w = torch.softmax(torch.cat([s_pre, s_ext], dim=-1), dim=-1)
    out = (torch.einsum("bhep,bphd->behd", w[..., :MAX_CONTEXT_LEN], v_buffer[loc])
           + torch.einsum("bhef,bfhd->behd", w[..., MAX_CONTEXT_LEN:], ve))
    staged = torch.zeros((num_tokens + 1,) + o_extend.shape[1:], dtype=o_extend.dtype, device=dev)
    staged[q_idx] = out
    o_extend.copy_(staged[:num_tokens])


# --- sglang/srt/layers/attention/triton_backend.py (reduced: draft extend, page size 1) -----------------------------

@dataclasses.dataclass
class ForwardMetadata:
    attn_logits: Optional[torch.Tensor]
    attn_lse: Optional[torch.Tensor]
    max_extend_len: int
    num_kv_splits: Optional[torch.Tensor]
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    qo_indptr: torch.Tensor
    custom_mask: Optional[torch.Tensor]
    mask_indptr: Optional[torch.Tensor]


class TritonAttnBackend:
    def __init__(self, model_runner: "ModelRunner"):
        max_bs = model_runner.req_to_token_pool.size
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.num_draft_tokens = SPECULATIVE_NUM_DRAFT_TOKENS
        self.speculative_num_steps = SPECULATIVE_NUM_STEPS
        self.max_context_len = MAX_CONTEXT_LEN
        self.device = model_runner.device
        self.kv_indptr = torch.zeros((max_bs + 1,), dtype=torch.int64, device=self.device)
        self.qo_indptr = torch.zeros((max_bs + 1,), dtype=torch.int64, device=self.device)
        self.forward_metadata = None

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        """Eager. DRAFT_EXTEND_V2 is not ``is_draft_extend()``: it takes the EXTEND branch (prefix lens)."""
        bs = forward_batch.batch_size
        kv_indptr = self.kv_indptr
        assert not forward_batch.forward_mode.is_draft_extend() and not forward_batch.forward_mode.is_decode_or_idle()
        kv_indptr[1: bs + 1] = torch.cumsum(forward_batch.extend_prefix_lens, dim=0)
        kv_indptr = kv_indptr[: bs + 1]
        kv_indices = torch.empty(sum(forward_batch.extend_prefix_lens_cpu), dtype=torch.int64, device=self.device)
        create_flashinfer_kv_indices_triton(self.req_to_token, forward_batch.req_pool_indices,
                                            forward_batch.extend_prefix_lens, kv_indptr, None, kv_indices,
                                            self.req_to_token.stride(0))
        qo_indptr = self.qo_indptr
        qo_indptr[1: bs + 1] = torch.cumsum(forward_batch.extend_seq_lens, dim=0)
        qo_indptr = qo_indptr[: bs + 1]
        max_extend_len = max(forward_batch.extend_seq_lens_cpu)
        self.forward_metadata = ForwardMetadata(None, None, max_extend_len, None, kv_indptr, kv_indices, qo_indptr,
                                                None, None)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int, kv_indices_buf=None):
        if kv_indices_buf is None:
            self.cuda_graph_kv_indices = torch.zeros((max_num_tokens * self.max_context_len), dtype=torch.int64,
                                                     device=self.device)
        else:
            self.cuda_graph_kv_indices = kv_indices_buf

    def init_forward_metadata_capture_cuda_graph(self, bs, num_tokens, req_pool_indices, seq_lens, encoder_lens,
                                                 forward_mode, spec_info):
        assert encoder_lens is None and forward_mode.is_draft_extend(include_v2=True)
        num_tokens_per_bs = self.speculative_num_steps + 1
        qo_indptr = self.qo_indptr[: bs + 1]
        qo_indptr[: bs + 1] = torch.arange(0, bs * num_tokens_per_bs + 1, step=num_tokens_per_bs, dtype=torch.int64,
                                           device=self.device)
        if _variant == "fix" and forward_mode.is_draft_extend_v2():
            # DRAFT_EXTEND_V2: seq_lens = prefix + extend (bumped by eagle_info_v2).
            # Triton extend kernel receives extend K/V as separate tensors, so
            # kv_indptr/kv_indices must cover only the prefix portion.
            extend_seq_lens = (spec_info.extend_seq_lens_tensor[:bs]
                               if spec_info is not None and getattr(spec_info, "extend_seq_lens_tensor", None)
                               is not None else torch.zeros(bs, dtype=torch.int64, device=self.device))
            kv_lens = seq_lens - extend_seq_lens
        else:
            kv_lens = seq_lens
        kv_indptr = self.kv_indptr[: bs + 1]
        kv_indptr[1: bs + 1] = torch.cumsum(kv_lens, dim=0)
        kv_indices = self.cuda_graph_kv_indices
        create_flashinfer_kv_indices_triton(self.req_to_token, req_pool_indices, kv_lens, kv_indptr, None, kv_indices,
                                            self.req_to_token.stride(0))
        self.forward_metadata = ForwardMetadata(None, None, num_tokens_per_bs, None, kv_indptr, kv_indices, qo_indptr,
                                                None, None)

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_sum, encoder_lens,
                                                forward_mode, spec_info, seq_lens_cpu):
        assert forward_mode.is_draft_extend(include_v2=True)
        seq_lens = seq_lens[:bs]
        num_tokens_per_bs = self.speculative_num_steps + 1
        qo_indptr = self.qo_indptr[: bs + 1]
        qo_indptr[: bs + 1] = torch.arange(0, bs * num_tokens_per_bs + 1, step=num_tokens_per_bs, dtype=torch.int64,
                                           device=self.device)
        if _variant == "fix" and forward_mode.is_draft_extend_v2():
            # Clamp at 0 because padded rows (raw_bs..bs) leave seq_lens at
            # the fill value (1) while extend_seq_lens stays at num_tokens_per_bs.
            assert spec_info is not None and getattr(spec_info, "extend_seq_lens_tensor", None) is not None
            kv_lens = torch.clamp(seq_lens - spec_info.extend_seq_lens_tensor[:bs], min=0)
        else:
            kv_lens = seq_lens
        kv_indptr = self.kv_indptr[: bs + 1]
        kv_indptr[1: bs + 1] = torch.cumsum(kv_lens, dim=0)
        kv_indices = self.cuda_graph_kv_indices
        create_flashinfer_kv_indices_triton(self.req_to_token, req_pool_indices[:bs], kv_lens, kv_indptr, None,
                                            kv_indices, self.req_to_token.stride(0))

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    def forward_extend(self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache=True):
        o = torch.empty_like(q)
        if save_kv_cache:   # "Save KV cache first (must do this before unified kernel)"
            self.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
        md = self.forward_metadata
        extend_attention_fwd(q.view(-1, layer.tp_q_head_num, layer.head_dim), k.contiguous(), v.contiguous(),
                             o.view(-1, layer.tp_q_head_num, layer.head_dim),
                             self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                             self.token_to_kv_pool.get_value_buffer(layer.layer_id), md.qo_indptr, md.kv_indptr,
                             md.kv_indices, md.custom_mask, True, md.mask_indptr, md.max_extend_len, layer.scaling)
        return o


# --- the EAGLE draft model (one decoder layer, stand-in) ------------------------------------------------------------

class RadixAttention:
    def __init__(self, layer_id):
        self.layer_id, self.tp_q_head_num, self.head_dim = layer_id, NUM_HEADS, HEAD_DIM
        self.scaling = 1.0 / math.sqrt(HEAD_DIM)

    def __call__(self, q, k, v, forward_batch):
        return get_attn_backend().forward_extend(q, k, v, self, forward_batch)


class LlamaForCausalLMEagle:
    def __init__(self, device):
        g = generator(11)
        w = lambda *s, scale=0.3: randn(*s, gen=g, device=device, scale=scale).to(DTYPE)  # noqa: E731
        self.embed_tokens, self.fc = w(VOCAB, HIDDEN, scale=1.0), w(2 * HIDDEN, HIDDEN)
        self.pos_embed = w(MAX_CONTEXT_LEN, NUM_HEADS * HEAD_DIM)
        self.q_proj, self.k_proj, self.v_proj = (w(HIDDEN, NUM_HEADS * HEAD_DIM) for _ in range(3))
        self.o_proj, self.up, self.down = w(NUM_HEADS * HEAD_DIM, HIDDEN), w(HIDDEN, 2 * HIDDEN), w(2 * HIDDEN, HIDDEN)
        self.lm_head = w(HIDDEN, VOCAB)
        self.self_attn = RadixAttention(layer_id=0)

    def forward(self, input_ids, positions, forward_batch: ForwardBatch):
        h = torch.cat([self.embed_tokens[input_ids], forward_batch.spec_info.hidden_states], dim=-1) @ self.fc
        pe = self.pos_embed[positions]
        q = (h @ self.q_proj + pe).view(-1, NUM_HEADS, HEAD_DIM)
        k = (h @ self.k_proj + pe).view(-1, NUM_HEADS, HEAD_DIM)
        v = (h @ self.v_proj).view(-1, NUM_HEADS, HEAD_DIM)
        h = h + self.self_attn(q, k, v, forward_batch).reshape(-1, NUM_HEADS * HEAD_DIM) @ self.o_proj
        h = h + torch.tanh(h @ self.up) @ self.down
        return LogitsProcessorOutput(next_token_logits=h @ self.lm_head, hidden_states=h)


class ModelRunner:
    def __init__(self, device, req_to_token_pool, token_to_kv_pool):
        self.device = device
        self.req_to_token_pool, self.token_to_kv_pool = req_to_token_pool, token_to_kv_pool
        self.model = LlamaForCausalLMEagle(device)
        self.attn_backend = TritonAttnBackend(self)

    def forward(self, forward_batch: ForwardBatch, skip_attn_backend_init=False):
        if not skip_attn_backend_init:
            self.attn_backend.init_forward_metadata(forward_batch)
        with forward_context(self.attn_backend):
            return self.model.forward(forward_batch.input_ids, forward_batch.positions, forward_batch)


# --- sglang/srt/speculative/eagle_draft_extend_cuda_graph_runner.py (reduced) ----------------------------------------

class EAGLEDraftExtendCudaGraphRunner:
    def __init__(self, eagle_worker: "EagleDraftWorker"):
        self.eagle_worker = eagle_worker
        self.model_runner = model_runner = eagle_worker.draft_runner
        self.forward_mode = ForwardMode.DRAFT_EXTEND_V2
        self.device = model_runner.device
        self.graphs, self.output_buffers = {}, {}
        self.disable_padding = False
        self.speculative_num_steps = SPECULATIVE_NUM_STEPS
        self.topk = SPECULATIVE_EAGLE_TOPK
        self.draft_extend_attn_backend = eagle_worker.draft_extend_attn_backend
        self.capture_bs = CUDA_GRAPH_BS

        # Attention backend
        self.num_tokens_per_bs = self.speculative_num_steps + 1
        self.max_bs = max(self.capture_bs)
        self.max_num_token = self.max_bs * self.num_tokens_per_bs
        self.draft_extend_attn_backend.init_cuda_graph_state(self.max_bs, self.max_num_token)
        self.seq_len_fill_value = self.draft_extend_attn_backend.get_cuda_graph_seq_len_fill_value()
        self.extend_seq_lens_cpu = [self.num_tokens_per_bs] * self.max_bs

        # Graph inputs
        dev = dict(device=self.device)
        self.input_ids = torch.zeros((self.max_num_token,), dtype=torch.int64, **dev)
        self.req_pool_indices = torch.zeros((self.max_bs,), dtype=torch.int64, **dev)
        self.out_cache_loc = torch.ones((self.max_num_token,), dtype=torch.int64, **dev)
        self.positions = torch.zeros((self.max_num_token,), dtype=torch.int64, **dev)
        self.hidden_states = torch.zeros((self.max_num_token, HIDDEN), dtype=DTYPE, **dev)
        self.seq_lens = torch.full((self.max_bs,), self.seq_len_fill_value, dtype=torch.int64, **dev)
        self.seq_lens_cpu = host(torch.full((self.max_bs,), self.seq_len_fill_value, dtype=torch.int64), self.device)
        self.extend_seq_lens = torch.full((self.max_bs,), self.num_tokens_per_bs, dtype=torch.int64, **dev)
        self.num_correct_drafts = torch.full((self.max_bs,), self.num_tokens_per_bs, dtype=torch.int64, **dev)
        self.num_accept_tokens = torch.full((self.max_bs,), self.num_tokens_per_bs, dtype=torch.int64, **dev)

        self.capture()

    def can_run(self, forward_batch: ForwardBatch):
        cuda_graph_bs = forward_batch.seq_lens.numel()
        return cuda_graph_bs in self.graphs if self.disable_padding else cuda_graph_bs <= self.max_bs

    def capture(self):
        # CudaGraphRunner.capture: reverse the order to enable better memory sharing across cuda graphs.
        self.pool = graph_pool_handle(self.device)
        for bs in reversed(self.capture_bs):
            self.graphs[bs], self.output_buffers[bs] = self.capture_one_batch_size(bs, None)

    def capture_one_batch_size(self, bs: int, forward: Optional[Callable]):
        num_tokens = bs * self.num_tokens_per_bs
        seq_lens = self.seq_lens[:bs]
        spec_info = EagleDraftExtendInput(hidden_states=self.hidden_states[:num_tokens],
                                          num_correct_drafts=self.num_correct_drafts[:bs],
                                          num_accept_tokens=self.num_accept_tokens[:bs])
        forward_batch = ForwardBatch(
            forward_mode=self.forward_mode, batch_size=bs, input_ids=self.input_ids[:num_tokens],
            req_pool_indices=self.req_pool_indices[:bs], seq_lens=seq_lens, seq_lens_cpu=self.seq_lens_cpu[:bs],
            out_cache_loc=self.out_cache_loc[:num_tokens], positions=self.positions[:num_tokens],
            seq_lens_sum=seq_lens.sum().item(), spec_info=spec_info, extend_seq_lens=self.extend_seq_lens[:bs],
            extend_seq_lens_cpu=self.extend_seq_lens_cpu[:bs])

        def run_once():
            # Backup two fields, which will be modified in-place in `draft_forward`.
            output_cache_loc_backup = forward_batch.out_cache_loc
            hidden_states_backup = forward_batch.spec_info.hidden_states
            ret = self.model_runner.model.forward(forward_batch.input_ids, forward_batch.positions, forward_batch)
            # topk == 1 fast path (CUDA): argmax
            topk_index = torch.argmax(ret.next_token_logits, dim=-1, keepdim=True)
            forward_batch.out_cache_loc = output_cache_loc_backup
            forward_batch.spec_info.hidden_states = hidden_states_backup
            return ret.next_token_logits, ret.hidden_states, topk_index

        backend = self.draft_extend_attn_backend
        with forward_context(backend):
            backend.init_forward_metadata_capture_cuda_graph(bs=bs, num_tokens=num_tokens,
                                                             req_pool_indices=forward_batch.req_pool_indices,
                                                             seq_lens=seq_lens, encoder_lens=None,
                                                             forward_mode=self.forward_mode, spec_info=spec_info)
            kv_pool = self.model_runner.token_to_kv_pool
            return capture(run_once, device=self.device, pool=self.pool, warmups=2,
                           static={"input_ids": self.input_ids, "out_cache_loc": self.out_cache_loc,
                                   "positions": self.positions, "hidden_states": self.hidden_states,
                                   "kv_indptr": backend.kv_indptr, "qo_indptr": backend.qo_indptr,
                                   "cuda_graph_kv_indices": backend.cuda_graph_kv_indices},
                           state={"k_buffer": kv_pool.k_buffer[0], "v_buffer": kv_pool.v_buffer[0]},
                           owner="EAGLEDraftExtendCudaGraphRunner", name=f"draft extend bs={bs}")

    def replay(self, forward_batch: ForwardBatch):
        assert forward_batch.out_cache_loc is not None
        raw_bs = forward_batch.batch_size
        num_tokens = forward_batch.input_ids.shape[0]
        index = bisect.bisect_left(self.capture_bs, raw_bs)
        bs = self.capture_bs[index]
        if bs * self.num_tokens_per_bs != num_tokens:
            self.seq_lens.fill_(self.seq_len_fill_value)
            self.out_cache_loc.zero_()
            self.positions.zero_()
            # Pair with seq_lens fill: padded rows must point at reserved
            # req_pool slot 0 (req_to_token[0, :] is all zeros from init).
            self.req_pool_indices.zero_()
            self.num_correct_drafts.fill_(self.num_tokens_per_bs)
            self.num_accept_tokens.fill_(self.num_tokens_per_bs)
            self.extend_seq_lens.fill_(self.num_tokens_per_bs)

        # Common inputs
        self.input_ids[:num_tokens].copy_(forward_batch.input_ids)
        self.seq_lens[:raw_bs].copy_(forward_batch.seq_lens)
        self.extend_seq_lens[:raw_bs].copy_(forward_batch.extend_seq_lens)
        self.out_cache_loc[:num_tokens].copy_(forward_batch.out_cache_loc)
        self.positions[:num_tokens].copy_(forward_batch.positions)
        self.hidden_states[:num_tokens].copy_(forward_batch.spec_info.hidden_states)
        self.num_correct_drafts[:raw_bs].copy_(forward_batch.spec_info.num_correct_drafts)
        self.num_accept_tokens[:raw_bs].copy_(forward_batch.spec_info.num_accept_tokens)
        self.req_pool_indices[:raw_bs].copy_(forward_batch.req_pool_indices)

        if bs != raw_bs:
            self.seq_lens_cpu.fill_(self.seq_len_fill_value)
        self.seq_lens_cpu[:raw_bs].copy_(forward_batch.seq_lens_cpu)
        self.extend_seq_lens_cpu[:raw_bs] = forward_batch.extend_seq_lens_cpu
        if bs > raw_bs:
            self.extend_seq_lens_cpu[raw_bs:bs] = [self.num_tokens_per_bs] * (bs - raw_bs)
        forward_batch.spec_info.extend_seq_lens_cpu = list(self.extend_seq_lens_cpu[:bs])
        forward_batch.spec_info.extend_seq_lens_tensor = self.extend_seq_lens[:bs]

        self.draft_extend_attn_backend.init_forward_metadata_replay_cuda_graph(
            bs=bs, req_pool_indices=self.req_pool_indices, seq_lens=self.seq_lens,
            seq_lens_sum=forward_batch.seq_lens_sum + (bs - raw_bs) * self.seq_len_fill_value, encoder_lens=None,
            forward_mode=self.forward_mode, spec_info=forward_batch.spec_info, seq_lens_cpu=self.seq_lens_cpu)

        # Replay (padded token rows of input_ids / hidden_states keep what an earlier step left there)
        logits, hidden, topk_index = replay(self.graphs[bs], self.output_buffers[bs], real=num_tokens,
                                            size=bs * self.num_tokens_per_bs,
                                            padded={"input_ids": self.input_ids, "hidden_states": self.hidden_states})
        # DRAFT_EXTEND_V2: all tokens calculations whether accepted or not.
        unpadding_bs = num_tokens
        return LogitsProcessorOutput(next_token_logits=logits[:unpadding_bs], hidden_states=hidden[:unpadding_bs])


# --- sglang/srt/speculative/eagle_info_v2.py, eagle_worker_v2.py (reduced) -------------------------------------------

@dataclasses.dataclass
class ScheduleBatch:
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    out_cache_loc: torch.Tensor          # verify's slots: req_to_token[req, seq_len : seq_len + num_draft_tokens]


@dataclasses.dataclass
class GenerationBatchResult:
    target_hidden_states: torch.Tensor   # batch_result.logits_output.hidden_states
    next_token_ids: torch.Tensor
    accept_lens: torch.Tensor


@dataclasses.dataclass
class EagleDraftInput:
    hidden_states: torch.Tensor

    def prepare_for_extend_to_fill_draft_kvcache(self, batch: ScheduleBatch, predict: torch.Tensor,
                                                 num_draft_tokens: int, draft_model_runner: ModelRunner,
                                                 cuda_graph_runner):
        seq_lens_cpu_ = batch.seq_lens_cpu
        bs = len(batch.seq_lens)
        prefix = batch.seq_lens
        positions = (prefix[:, None] + torch.arange(num_draft_tokens, device=prefix.device)[None, :]).flatten()
        forward_batch = ForwardBatch(
            forward_mode=ForwardMode.DRAFT_EXTEND_V2, batch_size=bs, input_ids=predict,
            req_pool_indices=batch.req_pool_indices, seq_lens=batch.seq_lens, seq_lens_cpu=seq_lens_cpu_,
            out_cache_loc=batch.out_cache_loc, positions=positions, seq_lens_sum=int(seq_lens_cpu_.sum()),
            spec_info=EagleDraftExtendInput(hidden_states=self.hidden_states),
            extend_seq_lens=torch.full((bs,), num_draft_tokens, dtype=torch.int64, device=prefix.device),
            extend_seq_lens_cpu=[num_draft_tokens] * bs, extend_prefix_lens=prefix,
            extend_prefix_lens_cpu=seq_lens_cpu_.tolist())
        # Forward sees post-write length (draft extend writes num_draft_tokens
        # slots); mutation stays on forward_batch to preserve SB.seq_lens.
        forward_batch.seq_lens = forward_batch.seq_lens + num_draft_tokens
        forward_batch.seq_lens_cpu = forward_batch.seq_lens_cpu + num_draft_tokens
        forward_batch.seq_lens_sum = int(forward_batch.seq_lens_cpu.sum())
        can_cuda_graph = cuda_graph_runner and cuda_graph_runner.can_run(forward_batch)
        if not can_cuda_graph:
            draft_model_runner.attn_backend.init_forward_metadata(forward_batch)
        return forward_batch


class EagleDraftWorker:
    def __init__(self, device, use_cuda_graph, req_to_token_pool, token_to_kv_pool):
        self.device = device
        self.topk, self.speculative_num_steps = SPECULATIVE_EAGLE_TOPK, SPECULATIVE_NUM_STEPS
        self.speculative_num_draft_tokens = SPECULATIVE_NUM_DRAFT_TOKENS
        self.draft_runner = ModelRunner(device, req_to_token_pool, token_to_kv_pool)
        self.draft_extend_attn_backend = self.draft_runner.attn_backend
        # init_cuda_graphs: the draft-extend graph is captured for TritonAttnBackend
        self.cuda_graph_runner_for_draft_extend = EAGLEDraftExtendCudaGraphRunner(self) if use_cuda_graph else None

    def _draft_extend_for_decode(self, batch: ScheduleBatch, batch_result: GenerationBatchResult):
        draft_input = EagleDraftInput(hidden_states=batch_result.target_hidden_states)
        select_index = (torch.arange(len(batch.seq_lens), device=self.device) * self.speculative_num_draft_tokens
                        + batch_result.accept_lens - 1)
        forward_batch = draft_input.prepare_for_extend_to_fill_draft_kvcache(
            batch, batch_result.next_token_ids, self.speculative_num_draft_tokens, self.draft_runner,
            self.cuda_graph_runner_for_draft_extend)
        forward_batch.spec_info.num_correct_drafts = batch_result.accept_lens - 1
        forward_batch.spec_info.num_accept_tokens = batch_result.accept_lens

        can_cuda_graph = (self.cuda_graph_runner_for_draft_extend
                          and self.cuda_graph_runner_for_draft_extend.can_run(forward_batch))
        if can_cuda_graph:
            draft_logits_output = self.cuda_graph_runner_for_draft_extend.replay(forward_batch)
        else:
            draft_logits_output = self.draft_runner.forward(forward_batch, skip_attn_backend_init=True)

        next_token_logits = draft_logits_output.next_token_logits[select_index]
        hidden_states = draft_logits_output.hidden_states[select_index]
        ret_topk_index = torch.argmax(next_token_logits, dim=-1, keepdim=True)
        return torch.cat([next_token_logits, hidden_states, ret_topk_index.to(DTYPE)], dim=1)


# --- the workload ---------------------------------------------------------------------------------------------------

# (request pool indices, committed lengths before verify, accept lengths incl. the bonus token) per round
ROUNDS = (([1, 2, 3], [5, 7, 4], [2, 3, 1]), ([4, 5], [6, 9], [3, 1]), ([1, 2, 3, 4], [7, 10, 5, 9], [1, 2, 3, 2]),
          ([5], [12], [2]))


def _serve(device, use_cuda_graph):
    gen = generator(5)
    req_to_token_pool = ReqToTokenPool(POOL_SIZE, MAX_CONTEXT_LEN, device)
    k_buffer = torch.zeros(NUM_KV_SLOTS, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    v_buffer = torch.zeros(NUM_KV_SLOTS, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    worker = EagleDraftWorker(device, use_cuda_graph, req_to_token_pool, MHATokenToKVPool(k_buffer, v_buffer))
    # the requests' prefixes are prefilled after start-up (slot 0 stays the padding slot)
    k_buffer[1:].copy_(randn(NUM_KV_SLOTS - 1, NUM_HEADS, HEAD_DIM, gen=gen, device=device).to(DTYPE))
    v_buffer[1:].copy_(randn(NUM_KV_SLOTS - 1, NUM_HEADS, HEAD_DIM, gen=gen, device=device).to(DTYPE))
    n = SPECULATIVE_NUM_DRAFT_TOKENS
    outs: List[torch.Tensor] = []
    for reqs, seq_lens, accept_lens in ROUNDS:
        b = len(reqs)
        req_pool_indices = torch.tensor(reqs, dtype=torch.int64, device=device)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int64)
        cols = seq_lens_t[:, None] + torch.arange(n)[None, :]
        out_cache_loc = req_to_token_pool.req_to_token[req_pool_indices][
            torch.arange(b, device=device)[:, None], cols.to(device)].flatten()
        batch = ScheduleBatch(req_pool_indices=req_pool_indices, seq_lens=seq_lens_t.to(device),
                              seq_lens_cpu=host(seq_lens_t.clone(), device), out_cache_loc=out_cache_loc)
        result = GenerationBatchResult(
            target_hidden_states=randn(b * n, HIDDEN, gen=gen, device=device).to(DTYPE),
            next_token_ids=torch.randint(0, VOCAB, (b * n,), generator=gen).to(device),
            accept_lens=torch.tensor(accept_lens, dtype=torch.int64, device=device))
        outs.append(worker._draft_extend_for_decode(batch, result))
    return outs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: _serve(device, True), lambda: _serve(device, False))
