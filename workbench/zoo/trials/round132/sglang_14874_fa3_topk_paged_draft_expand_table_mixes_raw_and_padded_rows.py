"""SGLang EAGLE drafting on the FA3 backend with ``--speculative-eagle-topk`` > 1 and ``--page-size`` > 1 under CUDA graphs: when the running batch is not a captured size, ``EAGLEDraftCudaGraphRunner.replay`` pads the device inputs to the graph's ``bs`` but leaves ``forward_batch.out_cache_loc`` at the live batch's ``raw_bs * topk * num_steps`` slots, and ``update_draft_decode_set_expand_metadata_with_page_size`` (the replay-side builder of the second, "expand" half of the cascade attention metadata) subtracts ``bs * topk`` padded last-page lengths from ``raw_bs * topk`` rows of cache locations: the draft step dies with a tensor size mismatch before the graph is replayed.

Upstream: https://github.com/sgl-project/sglang/pull/14874 ("Fix tensor mismatch error in sepc + topk > 1 +
page_size > 1", sgl-project/sglang, by Ziming Huang, commit 997ea57eaf2876e0f32ba39863bb4e34189f9b9e dated
2025-12-15 on main, read in a stored mirror of the history, the fork zcnrex/sglang). Read: the full diff of 997ea57ea
(``flashattention_backend.py``: in ``update_draft_decode_set_expand_metadata_with_page_size``, ``num_seqs =
expand_page_table.shape[0]``, ``expand_page_table -= last_page_lens_broadcast[:num_seqs]`` and
``page_table[:num_seqs, :max_seq_pages_expand].copy_(...)``; ``test_eagle_infer_a.py`` adds the config
``{"cuda_graph_bs": [5], "page_size": 4}`` to ``TestEAGLERadixCache``, whose base config was not read). At the parent
(997ea57ea^): ``python/sglang/srt/layers/attention/flashattention_backend.py`` (``FlashAttentionMetadata``,
``FlashAttentionBackend.__init__``, ``init_forward_metadata`` draft-decode topk > 1 branch and its page_size > 1
conversion, ``forward_decode`` cascade path with ``merge_state_v2``, ``init_cuda_graph_state``,
``init_forward_metadata_capture_cuda_graph`` and ``init_forward_metadata_replay_cuda_graph`` draft-decode topk > 1
branches, ``get_cuda_graph_seq_len_fill_value``, ``FlashAttentionMultiStepBackend``,
``update_draft_decode_set_expand_metadata_with_page_size``); ``speculative/eagle_draft_cuda_graph_runner.py`` whole
(``__init__``, ``can_run``, ``capture_one_batch_size`` with two warmups and ``run_once``,
``_postprocess_output_to_raw_bs``, ``replay``); ``speculative/eagle_worker.py`` (``_draft_preprocess_decode``,
``draft``, ``draft_forward``, ``get_last_loc_large_page_size_large_top_k``); ``speculative/spec_utils.py``
(``assign_draft_cache_locs``, ``select_top_k_tokens``), ``eagle_utils.organize_draft_results``, ``utils.fast_topk``,
``ForwardBatch.init_new``'s positions. Also read: the FA3 hunks of #7725 (18fb51583, 2025-11-25, "Support
FlashAttention3 page_size > 1 and topk > 1 case with paged attn and spec decode"), which added this function and its
call, replacing the page_size 1 line ``metadata_expand.page_table[: cache_loc.shape[0]].copy_(...)``, which already
sliced to the live rows; and #15469 (762846531, eight days later), which rewrote the function
(``draft_decode_set_expand_metadata``) for the case where a branch's KV crosses a page (an illegal memory access, not
modelled: the workload keeps every branch inside one page).
Not read: the PR's description and review thread (not found in the stored corpus), any issue, the
``TestEAGLERadixCache`` base config, FA3's ``flash_attn_with_kvcache`` and sgl_kernel's ``merge_state_v2`` sources,
the allocator (``alloc_paged_token_slots_extend``), the target model's runner and verify.
Symptom: the PR title, "tensor mismatch error in spec + topk > 1 + page_size > 1", and its regression config (a single
capture size, 5, so that every smaller batch is padded). The exact message users saw was not read; the mechanism gives
(and this program raises) ``RuntimeError: The size of tensor a (6) must match the size of tensor b (8) at
non-singleton dimension 0`` for 3 requests on the bs=4 graph with topk 2 (upstream runs the function under
``torch.compile(dynamic=True)``, whose wrapping of the error was not seen). Batches of a captured size, page size 1,
topk 1 and ``--disable-cuda-graph`` are unaffected.
Mechanism: with topk > 1 the FA3 draft decode is a cascade: one attention over each request's prefix up to its last
full page, one "expand" attention per top-k branch over the branch's copy of the last partial page plus its draft
tokens (``_draft_preprocess_decode`` duplicates the last partial page into every branch), merged by LSE. At replay the
backend rebuilds the expand metadata from ``last_page_lens = seq_lens % page_size`` of the graph's ``bs`` rows (the
runner swapped in its padded static ``seq_lens``) and from ``cache_loc = out_cache_loc.view(-1, num_steps)``, where
``out_cache_loc`` is still the live batch's (the runner copies it into its static buffer but hands the backend the
batch's own; ``FlashAttentionMultiStepBackend`` passes ``forward_batch.out_cache_loc``). ``expand_page_table -=
last_page_lens_broadcast`` then combines ``raw_bs * topk`` rows with ``bs * topk`` rows and raises whenever ``bs !=
raw_bs``. The eager path builds both from the live batch, and the capture path only binds buffers, so only a padded
replay meets it.
Doctor: padded-shape-mismatch, at update_draft_decode_set_expand_metadata_with_page_size. Code run at the padded size
(the graph's ``bs``, from the padded ``seq_lens``) combines a padded-row tensor (``last_page_lens``) with a real-row
one (``cache_loc``); the function is where the two meet and the only thing the fix changes.
Fix (upstream): slice the padded side to the live rows: ``last_page_lens_broadcast[:num_seqs]`` and write only
``page_table[:num_seqs, ...]``, leaving the padded rows of the expand page table as they were (their outputs are
dropped by ``_postprocess_output_to_raw_bs``).
Modelled: ``FlashAttentionBackend`` (``__init__``, ``init_forward_metadata`` / ``init_cuda_graph_state`` /
``init_forward_metadata_capture_cuda_graph`` / ``init_forward_metadata_replay_cuda_graph`` for draft decode with topk
> 1, ``get_cuda_graph_seq_len_fill_value``, ``forward_decode``'s cascade path), ``FlashAttentionMetadata``,
``FlashAttentionMultiStepBackend``, ``update_draft_decode_set_expand_metadata_with_page_size`` (as at the parent;
bug/fix as in the diff), ``EAGLEDraftCudaGraphRunner`` (``__init__`` with its static buffers and ``seq_lens_cpu``,
``can_run``, ``capture`` largest first into one pool, ``capture_one_batch_size`` with two warmups and ``run_once``
restoring ``out_cache_loc`` / ``hidden_states``, ``_postprocess_output_to_raw_bs``, ``replay``), ``EAGLEWorker``
(``_draft_preprocess_decode``'s page_size > 1, topk > 1 path, ``draft``, ``draft_forward``),
``get_last_loc_large_page_size_large_top_k``, ``assign_draft_cache_locs`` (parts 2 and 3), ``select_top_k_tokens``,
``organize_draft_results``, ``fast_topk``, ``ForwardBatch.init_new`` (positions from ``spec_info.positions``),
``MHATokenToKVPool.set_kv_buffer`` / ``move_kv_cache``.
Stand-ins: ``flash_attn_with_kvcache`` in torch (paged KV, uniform query lengths per sequence, non-causal as the
cascade calls it, LSE returned as ``[heads, total_q]``; empty sequences give 0 and -inf) and ``merge_state_v2``; a
one-layer EAGLE draft model (token embedding plus ``fc`` of the carried hidden state plus a position embedding, one
head of width 8, output projection, ``lm_head``) in float64; every request owns the pages of its whole context
(scattered through the pool) in ``req_to_token``, so the allocator and part 1 of ``assign_draft_cache_locs`` are the
identity and left out (``last_loc`` is not computed), and the kernel's parts 2 and 3 run per request on the host;
page 0 is the padding page the zeroed ``out_cache_loc`` of padded rows writes; ``torch.compile`` on the function is
dropped; ``ScheduleBatch`` holds only what drafting reads; the draft tree (``build_tree_kernel_efficient``) and the
verify step are not modelled, the three draft outputs are compared instead.
Workload: page size 4, topk 2, ``speculative_num_steps`` 3 (two draft forwards), 4 draft tokens, capture sizes 2 and
4. Four draft rounds over requests whose prefix KV is in the pool (random keys and values): 2 requests (exact), 3
(padded to 4), 4 (exact), 1 (padded to 2); every last partial page holds at most 2 tokens so no branch crosses a page.
Compared per round: ``parent_list``, ``top_scores_index`` and ``draft_tokens``, graphs against
``--disable-cuda-graph``.
Measured: bug: misbehaves (raised RuntimeError: The size of tensor a (6) must match the size of tensor b (8) at
non-singleton dimension 0), in the second round, the first padded replay (the first round alone, on the bs=2 graph,
equals eager exactly, and so do the two exact-size rounds together). Fix: equals eager (max |graph - eager| = 0) over
the four rounds. Checks of the stand-ins: the eager cascade attention equals plain attention over each branch's prefix
and draft slots to 2e-15; had the fix's expand ``cache_seqlens`` forgotten the last partial page, or pointed request
0's branches at request 1's pages, the draft trees would differ from eager by 8 and 10.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from enum import IntEnum, auto
from typing import List, Optional

import torch

from workbench.engine import graph_pool_handle, host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/14874"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "update_draft_decode_set_expand_metadata_with_page_size"
SYMPTOM = ("EAGLE with the FA3 backend, --speculative-eagle-topk > 1 and --page-size > 1: a draft step whose batch is "
           "not a captured size raises a tensor size mismatch in "
           "update_draft_decode_set_expand_metadata_with_page_size while the draft graph's metadata is prepared; "
           "captured sizes and --disable-cuda-graph run")

DTYPE = torch.float64
VOCAB, HIDDEN = 16, 8
PAGE_SIZE = 4                                   # --page-size 4
SPECULATIVE_EAGLE_TOPK, SPECULATIVE_NUM_STEPS, SPECULATIVE_NUM_DRAFT_TOKENS = 2, 3, 4
CUDA_GRAPH_BS = [2, 4]                          # --cuda-graph-bs 2 4
MAX_REQS, CONTEXT_LEN = 6, 32                   # req_to_token_pool size and model context_len
PAGES_PER_REQ = CONTEXT_LEN // PAGE_SIZE
NUM_PAGES = 1 + MAX_REQS * PAGES_PER_REQ        # page 0 is the padding page (padded rows write slot 0)
MAX_POSITION = 64

_variant = "bug"


# --- sglang/srt/server_args.py, configs, mem_cache/memory_pool.py (reduced) -------------------------------------------

@dataclass
class ServerArgs:
    speculative_eagle_topk: int = SPECULATIVE_EAGLE_TOPK
    speculative_num_steps: int = SPECULATIVE_NUM_STEPS
    speculative_num_draft_tokens: int = SPECULATIVE_NUM_DRAFT_TOKENS
    page_size: int = PAGE_SIZE
    disable_cuda_graph_padding: bool = False


@dataclass
class ModelConfig:
    context_len: int = CONTEXT_LEN


class ReqToTokenPool:
    def __init__(self, req_to_token):
        self.req_to_token = req_to_token
        self.size = req_to_token.shape[0]


class MHATokenToKVPool:
    def __init__(self, k_buffer, v_buffer):
        self.k_buffer, self.v_buffer = k_buffer, v_buffer       # [slots, heads, head_dim], one layer

    def get_kv_buffer(self, layer_id):
        return self.k_buffer, self.v_buffer

    def set_kv_buffer(self, layer, loc, cache_k, cache_v):
        self.k_buffer[loc] = cache_k
        self.v_buffer[loc] = cache_v

    def move_kv_cache(self, tgt_loc, src_loc):
        self.k_buffer[tgt_loc] = self.k_buffer[src_loc]
        self.v_buffer[tgt_loc] = self.v_buffer[src_loc]


# --- sglang/srt/model_executor/forward_batch_info.py, speculative/eagle_info.py (reduced) -----------------------------

class ForwardMode(IntEnum):
    DECODE = auto()

    def is_decode_or_idle(self):
        return self == ForwardMode.DECODE


class CaptureHiddenMode(IntEnum):
    NULL = auto()
    LAST = auto()


@dataclass
class EagleDraftInput:
    topk_p: torch.Tensor = None
    topk_index: torch.Tensor = None
    hidden_states: torch.Tensor = None
    positions: torch.Tensor = None
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.LAST


@dataclass
class ScheduleBatch:
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: MHATokenToKVPool
    spec_info: EagleDraftInput
    out_cache_loc: Optional[torch.Tensor] = None
    seq_lens_sum: int = 0

    def batch_size(self):
        return self.req_pool_indices.shape[0]


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: Optional[torch.Tensor]
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: Optional[torch.Tensor]
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: MHATokenToKVPool
    out_cache_loc: torch.Tensor
    seq_lens_sum: int
    positions: torch.Tensor
    spec_info: EagleDraftInput
    encoder_lens: Optional[torch.Tensor] = None
    attn_backend: object = None

    @classmethod
    def init_new(cls, batch: ScheduleBatch, model_runner):
        return cls(forward_mode=ForwardMode.DECODE, batch_size=batch.batch_size(), input_ids=None,
                   req_pool_indices=batch.req_pool_indices, seq_lens=batch.seq_lens, seq_lens_cpu=batch.seq_lens_cpu,
                   req_to_token_pool=batch.req_to_token_pool, token_to_kv_pool=batch.token_to_kv_pool,
                   out_cache_loc=batch.out_cache_loc, seq_lens_sum=batch.seq_lens_sum,
                   positions=batch.spec_info.positions, spec_info=batch.spec_info)


@dataclass
class LogitsProcessorOutput:
    next_token_logits: torch.Tensor
    hidden_states: torch.Tensor


# --- sgl_kernel stand-ins: flash_attn_with_kvcache (FA3, paged KV) and merge_state_v2 ---------------------------------

def flash_attn_with_kvcache(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q=None, cu_seqlens_k_new=None,
                           max_seqlen_q=1, softmax_scale=None, causal=False, return_softmax_lse=False):
    """Sequence b attends over its first ``cache_seqlens[b]`` KV positions, position p in page
    ``page_table[b, p // page_size]``; its ``max_seqlen_q`` queries are rows ``b * max_seqlen_q ...`` of ``q``
    (uniform query lengths, as every call here has). Returns the LSE as ``[heads, total_q]``; an empty sequence gives
    0 and -inf, as FA3 does."""
    num_seqs = cache_seqlens.shape[0]
    page_size, num_heads, head_dim = k_cache.shape[1:]
    pos = torch.arange(page_table.shape[1] * page_size, device=q.device)
    valid = pos[None, :] < cache_seqlens[:, None]
    slots = page_table[:num_seqs, pos // page_size].long() * page_size + pos % page_size
    slots = torch.where(valid, slots, torch.zeros_like(slots))
    k = k_cache.reshape(-1, num_heads, head_dim)[slots]                     # [b, W, h, d]
    v = v_cache.reshape(-1, num_heads, head_dim)[slots]
    qv = q.view(num_seqs, max_seqlen_q, num_heads, head_dim)
    s = torch.einsum("bqhd,bwhd->bhqw", qv, k) * softmax_scale
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)                                      # [b, h, q, 1]
    denom_safe = torch.where(denom > 0, denom, torch.ones_like(denom)).permute(0, 2, 1, 3)
    o = torch.einsum("bhqw,bwhd->bqhd", p, v) / denom_safe
    o = o.reshape(-1, num_heads, head_dim)
    if not return_softmax_lse:
        return o
    lse = (torch.log(denom) + m).squeeze(-1)                                 # [b, h, q]
    return o, lse.permute(1, 0, 2).reshape(num_heads, -1)


def merge_state_v2(v_a, s_a, v_b, s_b):
    """Merge two partial attentions by their LSEs (``s_*``: ``[tokens, heads]``)."""
    m = torch.maximum(s_a, s_b)
    w_a, w_b = torch.exp(s_a - m), torch.exp(s_b - m)
    v = (v_a * w_a.unsqueeze(-1) + v_b * w_b.unsqueeze(-1)) / (w_a + w_b).unsqueeze(-1)
    return v, m + torch.log(w_a + w_b)


# --- sglang/srt/layers/attention/flashattention_backend.py (draft decode with topk > 1, reduced) ----------------------

@dataclass
class FlashAttentionMetadata:
    cache_seqlens_int32: torch.Tensor = None
    max_seq_len_q: int = 1
    max_seq_len_k: int = 0
    cu_seqlens_q: torch.Tensor = None
    cu_seqlens_k: torch.Tensor = None
    page_table: torch.Tensor = None


class FlashAttentionBackend:
    def __init__(self, model_runner, skip_prefill=False, speculative_step_id=0, topk=0, speculative_num_steps=0):
        self.forward_metadata: FlashAttentionMetadata = None
        # extra metadata for handling speculative decoding topk > 1, extended draft decode and verify
        self.forward_metadata_spec_decode_expand: FlashAttentionMetadata = None
        self.max_context_len = model_runner.model_config.context_len
        self.device = model_runner.device
        self.decode_cuda_graph_metadata = {}
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.page_size = model_runner.page_size
        self.topk = model_runner.server_args.speculative_eagle_topk or 0
        self.speculative_num_steps = speculative_num_steps
        self.speculative_num_draft_tokens = model_runner.server_args.speculative_num_draft_tokens
        self.speculative_step_id = speculative_step_id

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        """Eager draft decode, topk > 1 (the only branch modelled)."""
        metadata = FlashAttentionMetadata()
        seqlens_in_batch = forward_batch.seq_lens
        batch_size = forward_batch.batch_size
        device = seqlens_in_batch.device
        assert forward_batch.forward_mode.is_decode_or_idle() and forward_batch.spec_info is not None
        assert self.topk > 1
        metadata.cache_seqlens_int32 = (seqlens_in_batch).to(torch.int32)
        metadata.max_seq_len_q = self.topk
        metadata.max_seq_len_k = forward_batch.seq_lens_cpu.max().item()
        metadata.cu_seqlens_q = torch.arange(0, batch_size * self.topk + 1, step=self.topk, dtype=torch.int32,
                                             device=device)
        metadata.cu_seqlens_k = torch.nn.functional.pad(
            torch.cumsum(metadata.cache_seqlens_int32, dim=0, dtype=torch.int32), (1, 0))
        metadata.page_table = forward_batch.req_to_token_pool.req_to_token[
            forward_batch.req_pool_indices, : metadata.max_seq_len_k]
        metadata_expand = FlashAttentionMetadata()
        decode_length = self.speculative_step_id + 1
        metadata_expand.cache_seqlens_int32 = torch.full((seqlens_in_batch.numel() * self.topk,), decode_length,
                                                         device=device, dtype=torch.int32)
        metadata_expand.max_seq_len_q = 1
        metadata_expand.cu_seqlens_q = torch.arange(0, metadata_expand.cache_seqlens_int32.numel() + 1,
                                                    dtype=torch.int32, device=device)
        metadata_expand.cu_seqlens_k = torch.arange(0, metadata_expand.cache_seqlens_int32.numel() * decode_length + 1,
                                                    step=decode_length, dtype=torch.int32, device=device)
        # shape: [bs, num_steps, topk] -> [bs x topk, num_steps]
        cache_loc = forward_batch.out_cache_loc.view(-1, self.speculative_num_steps)
        metadata_expand.page_table = cache_loc[:, :decode_length].contiguous().to(torch.int32)
        self.forward_metadata_spec_decode_expand = metadata_expand

        # Convert the page table to a strided format which is needed by FA3 API
        if self.page_size > 1:
            self.strided_indices = torch.arange(0, metadata.page_table.shape[1], self.page_size, device=self.device)
            metadata.page_table = metadata.page_table[:, self.strided_indices] // self.page_size
            # Modifies cache_seqlens_int32 and page_table(B, speculative_num_steps).
            last_page_lens = forward_batch.seq_lens % self.page_size
            # First attention handles prefix - last_page_len part.
            metadata.cache_seqlens_int32 -= last_page_lens
            # Second attention handles last_page_len + decode part.
            expanded_last_page_lens = last_page_lens.repeat_interleave(self.topk)
            self.forward_metadata_spec_decode_expand.cache_seqlens_int32 += expanded_last_page_lens
            expand_page_table = cache_loc[:, :decode_length].clone()
            strided_indices_expand = torch.arange(0, decode_length, self.page_size, device=self.device)
            last_page_lens_broadcast = expanded_last_page_lens.unsqueeze(-1).expand(-1, expand_page_table.shape[1])
            expand_page_table -= last_page_lens_broadcast
            expand_page_table = expand_page_table[:, strided_indices_expand] // self.page_size
            self.forward_metadata_spec_decode_expand.page_table = expand_page_table.to(torch.int32)

        self.forward_metadata = metadata

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        # (normal decode's cache_seqlens / cu_seqlens / page_table buffers left out: topk > 1 does not read them)
        self.decode_cuda_graph_metadata = {
            "strided_indices": torch.arange(0, self.max_context_len, self.page_size, device=self.device)}
        # This is used by draft decode's first half of metadata when topk > 1
        if self.topk > 1:
            self.draft_decode_metadata_topk_normal = {
                "cache_seqlens": torch.zeros(max_bs, dtype=torch.int32, device=self.device),
                "cu_seqlens_q": torch.arange(0, max_bs * self.topk + 1, step=self.topk, dtype=torch.int32,
                                             device=self.device),
                "cu_seqlens_k": torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device),
                "page_table": torch.zeros(max_bs, self.max_context_len, dtype=torch.int32, device=self.device),
            }
            # This is used by draft decode's second half of metadata when topk > 1
            decode_length = self.speculative_step_id + 1
            self.draft_decode_metadata_topk_expand = {
                "cache_seqlens": torch.full((max_bs * self.topk,), decode_length, device=self.device,
                                            dtype=torch.int32),
                "cu_seqlens_q": torch.arange(0, max_bs * self.topk + 1, dtype=torch.int32, device=self.device),
                "cu_seqlens_k": torch.arange(0, max_bs * self.topk * decode_length + 1, step=decode_length,
                                             dtype=torch.int32, device=self.device),
                "page_table": torch.zeros(max_bs * self.topk, decode_length, dtype=torch.int32, device=self.device),
            }
            if self.page_size > 1:
                # Used for indicing expand page_table
                self.draft_decode_metadata_topk_expand["strided_indices_expand"] = torch.arange(
                    0, self.speculative_num_steps, self.page_size, device=self.device)

    def init_forward_metadata_capture_cuda_graph(self, bs, num_tokens, req_pool_indices, seq_lens, encoder_lens,
                                                 forward_mode, spec_info):
        metadata = FlashAttentionMetadata()
        metadata_expand = FlashAttentionMetadata()
        assert forward_mode.is_decode_or_idle() and spec_info is not None and self.topk > 1
        # 1. The first half of metadata for prefix tokens
        metadata.cache_seqlens_int32 = self.draft_decode_metadata_topk_normal["cache_seqlens"][:bs]
        metadata.max_seq_len_q = self.topk
        metadata.max_seq_len_k = seq_lens.max().item()
        metadata.cu_seqlens_q = self.draft_decode_metadata_topk_normal["cu_seqlens_q"][: bs + 1]
        metadata.cu_seqlens_k = self.draft_decode_metadata_topk_normal["cu_seqlens_k"][: bs + 1]
        metadata.page_table = self.draft_decode_metadata_topk_normal["page_table"][:bs, :]
        # 2. The second half of metadata for draft tokens (per_batch_num_tokens = topk)
        metadata_expand.cache_seqlens_int32 = self.draft_decode_metadata_topk_expand["cache_seqlens"][: bs * self.topk]
        metadata_expand.max_seq_len_q = 1
        metadata_expand.cu_seqlens_q = self.draft_decode_metadata_topk_expand["cu_seqlens_q"][: bs * self.topk + 1]
        metadata_expand.cu_seqlens_k = self.draft_decode_metadata_topk_expand["cu_seqlens_k"][: bs * self.topk + 1]
        metadata_expand.page_table = self.draft_decode_metadata_topk_expand["page_table"][: bs * self.topk]
        self.draft_decode_metadata_topk_normal[bs] = metadata
        self.draft_decode_metadata_topk_expand[bs] = metadata_expand
        self.forward_metadata = metadata
        self.forward_metadata_spec_decode_expand = metadata_expand

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_sum, encoder_lens,
                                                forward_mode, spec_info, seq_lens_cpu, out_cache_loc=None):
        seq_lens = seq_lens[:bs]
        seq_lens_cpu = seq_lens_cpu[:bs]
        req_pool_indices = req_pool_indices[:bs]
        assert forward_mode.is_decode_or_idle() and spec_info is not None and self.topk > 1
        # When top k > 1, we need two specific draft decode metadata, and then merge states
        # 1. The first half of metadata for prefix tokens
        metadata = self.draft_decode_metadata_topk_normal[bs]
        if self.page_size > 1:
            # First attention handles seq_lens - last_page_lens if page size > 1.
            last_page_lens = seq_lens % self.page_size
            seq_lens = seq_lens - last_page_lens
        metadata.cache_seqlens_int32.copy_(seq_lens)
        metadata.max_seq_len_k = seq_lens_cpu.max().item()
        max_seq_pages = (metadata.max_seq_len_k + self.page_size - 1) // self.page_size
        strided_indices = self.decode_cuda_graph_metadata["strided_indices"]
        strided_indices = strided_indices[:max_seq_pages]
        page_table = self.req_to_token[req_pool_indices[:, None], strided_indices[None, :]] // self.page_size
        metadata.page_table[:, :max_seq_pages].copy_(page_table)
        # 2. The second half of metadata for draft tokens (per_batch_num_tokens = topk)
        metadata_expand = self.draft_decode_metadata_topk_expand[bs]
        decode_length = self.speculative_step_id + 1
        # shape: [bs, num_steps, topk] -> [bs x topk, num_steps]
        cache_loc = out_cache_loc.view(-1, self.speculative_num_steps)
        if self.page_size > 1:
            # Second attention handles last_page_len + decode part.
            strided_indices_expand = self.draft_decode_metadata_topk_expand.get("strided_indices_expand")
            update_draft_decode_set_expand_metadata_with_page_size(
                metadata_expand.cache_seqlens_int32,  # Modifies
                metadata_expand.page_table,  # Modifies
                cache_loc, last_page_lens, strided_indices_expand, decode_length, bs, self.topk, self.page_size)
        else:
            metadata_expand.page_table[: cache_loc.shape[0]].copy_(cache_loc[:, :decode_length])
        self.forward_metadata = metadata
        self.forward_metadata_spec_decode_expand = metadata_expand

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    def forward_decode(self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache=True):
        if k is not None and save_kv_cache:
            forward_batch.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
        metadata = self.forward_metadata
        # When Spec Decode enabled, forward_decode would be called with two mode:
        # 1. DRAFT_DECODE: we enable cascade attention when top_k > 1
        use_cascade_attn = forward_batch.spec_info is not None and self.topk > 1
        key_cache, value_cache = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        key_cache = key_cache.view(-1, self.page_size, layer.tp_k_head_num, layer.head_dim)
        value_cache = value_cache.view(-1, self.page_size, layer.tp_v_head_num, layer.head_dim)
        q_reshaped = q.contiguous().view(-1, layer.tp_q_head_num, layer.head_dim)
        result = flash_attn_with_kvcache(
            q=q_reshaped, k_cache=key_cache, v_cache=value_cache, page_table=metadata.page_table,
            cache_seqlens=metadata.cache_seqlens_int32, cu_seqlens_q=metadata.cu_seqlens_q,
            max_seqlen_q=metadata.max_seq_len_q, softmax_scale=layer.scaling, causal=not use_cascade_attn,
            return_softmax_lse=use_cascade_attn)
        if use_cascade_attn:
            o, softmax_lse = result
            expand = self.forward_metadata_spec_decode_expand
            o_expand, softmax_lse_expand = flash_attn_with_kvcache(
                q=q_reshaped, k_cache=key_cache, v_cache=value_cache, page_table=expand.page_table,
                cache_seqlens=expand.cache_seqlens_int32, cu_seqlens_q=expand.cu_seqlens_q,
                cu_seqlens_k_new=expand.cu_seqlens_k, max_seqlen_q=expand.max_seq_len_q,
                softmax_scale=layer.scaling, causal=False, return_softmax_lse=True)
            o, _ = merge_state_v2(o, softmax_lse.T.contiguous(), o_expand, softmax_lse_expand.T.contiguous())
        else:
            o = result
        return o.view(-1, layer.tp_q_head_num * layer.head_dim)


class FlashAttentionMultiStepBackend:
    def __init__(self, model_runner, topk: int, speculative_num_steps: int):
        self.model_runner = model_runner
        self.topk = topk
        self.speculative_num_steps = speculative_num_steps
        self.attn_backends = [FlashAttentionBackend(model_runner, speculative_step_id=i, topk=self.topk,
                                                    speculative_num_steps=self.speculative_num_steps)
                              for i in range(self.speculative_num_steps - 1)]

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        for i in range(self.speculative_num_steps - 1):
            self.attn_backends[i].init_forward_metadata(forward_batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        for i in range(self.speculative_num_steps - 1):
            self.attn_backends[i].init_cuda_graph_state(max_bs, max_num_tokens)

    def init_forward_metadata_capture_cuda_graph(self, forward_batch: ForwardBatch):
        for i in range(self.speculative_num_steps - 1):
            self.attn_backends[i].init_forward_metadata_capture_cuda_graph(
                forward_batch.batch_size, forward_batch.batch_size * self.topk, forward_batch.req_pool_indices,
                forward_batch.seq_lens, encoder_lens=forward_batch.encoder_lens, forward_mode=ForwardMode.DECODE,
                spec_info=forward_batch.spec_info)

    def init_forward_metadata_replay_cuda_graph(self, forward_batch: ForwardBatch, bs: int):
        for i in range(self.speculative_num_steps - 1):
            self.attn_backends[i].init_forward_metadata_replay_cuda_graph(
                bs, forward_batch.req_pool_indices, forward_batch.seq_lens, forward_batch.seq_lens_sum,
                encoder_lens=forward_batch.encoder_lens, forward_mode=ForwardMode.DECODE,
                spec_info=forward_batch.spec_info, seq_lens_cpu=forward_batch.seq_lens_cpu,
                out_cache_loc=forward_batch.out_cache_loc)


def update_draft_decode_set_expand_metadata_with_page_size(
    cache_seqlens_int32: torch.Tensor,  # Modifies
    page_table: torch.Tensor,  # Modifies
    cache_loc: torch.Tensor,
    last_page_lens: torch.Tensor,
    strided_indices_expand: torch.Tensor,
    decode_length: int,
    bs: int,
    topk: int,
    page_size: int,
):
    # last_page_lens: the graph's bs rows (padded); cache_loc: the live batch's raw_bs * topk rows
    expanded_last_page_lens = last_page_lens.repeat_interleave(topk)
    cache_seqlens_int32.copy_(decode_length + expanded_last_page_lens)
    expand_page_table = cache_loc[:, :decode_length].clone()
    last_page_lens_broadcast = expanded_last_page_lens.unsqueeze(-1).expand(-1, expand_page_table.shape[1])
    if _variant == "fix":
        num_seqs = expand_page_table.shape[0]
        expand_page_table -= last_page_lens_broadcast[:num_seqs]
    else:
        expand_page_table -= last_page_lens_broadcast
    expand_page_table = (expand_page_table[:, strided_indices_expand[: (decode_length + page_size - 1) // page_size]]
                         // page_size)
    max_seq_pages_expand = (decode_length + page_size - 1) // page_size
    if _variant == "fix":
        page_table[:num_seqs, :max_seq_pages_expand].copy_(expand_page_table)
    else:
        page_table[:, :max_seq_pages_expand].copy_(expand_page_table)


# --- a one-layer EAGLE draft model and its ModelRunner ----------------------------------------------------------------

class RadixAttention:
    def __init__(self, num_heads, head_dim, scaling, layer_id):
        self.tp_q_head_num = self.tp_k_head_num = self.tp_v_head_num = num_heads
        self.head_dim, self.scaling, self.layer_id = head_dim, scaling, layer_id

    def forward(self, q, k, v, forward_batch: ForwardBatch):
        return forward_batch.attn_backend.forward_decode(q, k, v, self, forward_batch)


class LlamaForCausalLMEagle:
    def __init__(self, device):
        gen = generator(14874)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.embed_tokens, self.pos_embed = r(VOCAB, HIDDEN, scale=1.0), r(MAX_POSITION, HIDDEN)
        self.fc, self.wq, self.wk, self.wv, self.wo = (r(HIDDEN, HIDDEN) for _ in range(5))
        self.lm_head = r(HIDDEN, VOCAB, scale=1.5)
        self.attn = RadixAttention(1, HIDDEN, HIDDEN ** -0.5, layer_id=0)

    def forward(self, input_ids, positions, forward_batch: ForwardBatch):
        hidden_states = (self.embed_tokens[input_ids] + forward_batch.spec_info.hidden_states @ self.fc
                         + self.pos_embed[positions])
        q, k, v = hidden_states @ self.wq, hidden_states @ self.wk, hidden_states @ self.wv
        attn_output = self.attn.forward(q, k.view(-1, 1, HIDDEN), v.view(-1, 1, HIDDEN), forward_batch)
        hidden_states = hidden_states + attn_output @ self.wo
        return LogitsProcessorOutput(next_token_logits=hidden_states @ self.lm_head, hidden_states=hidden_states)


class ModelRunner:
    def __init__(self, device, req_to_token_pool, token_to_kv_pool):
        self.device = device
        self.server_args, self.model_config = ServerArgs(), ModelConfig()
        self.page_size = self.server_args.page_size
        self.req_to_token_pool, self.token_to_kv_pool = req_to_token_pool, token_to_kv_pool
        self.model = LlamaForCausalLMEagle(device)

    def forward(self, forward_batch: ForwardBatch, skip_attn_backend_init: bool = False):
        assert skip_attn_backend_init
        return self.model.forward(forward_batch.input_ids, forward_batch.positions, forward_batch), False


# --- sglang/srt/speculative/eagle_draft_cuda_graph_runner.py (reduced) -----------------------------------------------

class EAGLEDraftCudaGraphRunner:
    def __init__(self, eagle_worker):
        self.eagle_worker = eagle_worker
        self.model_runner = model_runner = eagle_worker.model_runner
        self.device = model_runner.device
        self.graphs, self.output_buffers = {}, {}
        self.disable_padding = model_runner.server_args.disable_cuda_graph_padding
        self.speculative_num_steps = model_runner.server_args.speculative_num_steps
        self.topk = model_runner.server_args.speculative_eagle_topk

        # Batch sizes to capture
        self.capture_bs = CUDA_GRAPH_BS

        # Attention backend
        self.num_tokens_per_bs = self.topk
        self.max_bs = max(self.capture_bs)
        self.max_num_token = self.max_bs * self.num_tokens_per_bs
        self.model_runner.draft_attn_backend.init_cuda_graph_state(self.max_bs, self.max_num_token)
        self.seq_len_fill_value = self.model_runner.draft_attn_backend.attn_backends[
            0].get_cuda_graph_seq_len_fill_value()
        self.seq_lens_cpu = host(torch.full((self.max_bs,), self.seq_len_fill_value, dtype=torch.int32), self.device)

        # Graph inputs
        dev = dict(device=self.device)
        self.input_ids = torch.zeros((self.max_num_token,), dtype=torch.int64, **dev)
        self.req_pool_indices = torch.zeros((self.max_bs,), dtype=torch.int32, **dev)
        self.out_cache_loc = torch.zeros((self.max_num_token * self.speculative_num_steps,), dtype=torch.int64, **dev)
        self.positions = torch.zeros((self.max_num_token,), dtype=torch.int64, **dev)
        self.seq_lens = torch.full((self.max_bs,), self.seq_len_fill_value, dtype=torch.int32, **dev)
        self.topk_p = torch.zeros((self.max_bs, self.topk), dtype=DTYPE, **dev)
        self.topk_index = torch.zeros((self.max_bs, self.topk), dtype=torch.int64, **dev)
        self.hidden_states = torch.zeros((self.max_bs, HIDDEN), dtype=DTYPE, **dev)

        self.capture()

    def can_run(self, forward_batch: ForwardBatch):
        cuda_graph_bs = forward_batch.batch_size
        return cuda_graph_bs in self.graphs if self.disable_padding else cuda_graph_bs <= self.max_bs

    def capture(self):
        # CudaGraphRunner.capture: largest first, one memory pool
        self.pool = graph_pool_handle(self.device)
        for bs in reversed(self.capture_bs):
            self.graphs[bs], self.output_buffers[bs] = self.capture_one_batch_size(bs)

    def capture_one_batch_size(self, num_seqs: int):
        num_tokens = num_seqs * self.num_tokens_per_bs

        # Graph inputs
        req_pool_indices = self.req_pool_indices[:num_seqs]
        seq_lens = self.seq_lens[:num_seqs]
        seq_lens_cpu = self.seq_lens_cpu[:num_seqs]
        out_cache_loc = self.out_cache_loc[: num_tokens * self.speculative_num_steps]
        positions = self.positions[:num_tokens]
        hidden_states = self.hidden_states[:num_seqs]
        topk_p = self.topk_p[:num_seqs]
        topk_index = self.topk_index[:num_seqs]

        spec_info = EagleDraftInput(topk_p=topk_p, topk_index=topk_index, hidden_states=hidden_states,
                                    capture_hidden_mode=CaptureHiddenMode.LAST)

        # Forward batch
        forward_batch = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=num_seqs, input_ids=None, req_pool_indices=req_pool_indices,
            seq_lens=seq_lens, seq_lens_cpu=seq_lens_cpu, req_to_token_pool=self.model_runner.req_to_token_pool,
            token_to_kv_pool=self.model_runner.token_to_kv_pool, out_cache_loc=out_cache_loc,
            seq_lens_sum=int(seq_lens.sum()), positions=positions, spec_info=spec_info)

        # Attention backend
        self.model_runner.draft_attn_backend.init_forward_metadata_capture_cuda_graph(forward_batch)

        # Run and capture
        def run_once():
            # Backup two fields, which will be modified in-place in `draft_forward`.
            output_cache_loc_backup = forward_batch.out_cache_loc
            hidden_states_backup = forward_batch.spec_info.hidden_states
            ret = self.eagle_worker.draft_forward(forward_batch)
            forward_batch.out_cache_loc = output_cache_loc_backup
            forward_batch.spec_info.hidden_states = hidden_states_backup
            return ret

        static = {"out_cache_loc": self.out_cache_loc, "positions": self.positions, "topk_p": self.topk_p,
                  "topk_index": self.topk_index, "hidden_states": self.hidden_states}
        for i, backend in enumerate(self.model_runner.draft_attn_backend.attn_backends):
            normal, expand = backend.draft_decode_metadata_topk_normal, backend.draft_decode_metadata_topk_expand
            static.update({f"step{i}.cache_seqlens": normal["cache_seqlens"],
                           f"step{i}.page_table": normal["page_table"],
                           f"step{i}.expand.cache_seqlens": expand["cache_seqlens"],
                           f"step{i}.expand.page_table": expand["page_table"]})
        kv = self.model_runner.token_to_kv_pool
        return capture(run_once, device=self.device, pool=self.pool, warmups=2, static=static,
                       state={"k_buffer": kv.k_buffer, "v_buffer": kv.v_buffer},
                       owner="EAGLEDraftCudaGraphRunner", name=f"draft decode bs={num_seqs}")

    def _postprocess_output_to_raw_bs(self, out, raw_bs):
        # Keep the variables name for readability
        parent_list, top_scores_index, draft_tokens = (t[:raw_bs] for t in out)
        return parent_list, top_scores_index, draft_tokens

    def replay(self, forward_batch: ForwardBatch):
        assert forward_batch.out_cache_loc is not None
        raw_bs = forward_batch.batch_size
        raw_num_token = raw_bs * self.num_tokens_per_bs

        # Pad
        index = bisect.bisect_left(self.capture_bs, raw_bs)
        bs = self.capture_bs[index]
        if bs != raw_bs:
            self.seq_lens.fill_(self.seq_len_fill_value)
            self.out_cache_loc.zero_()
            self.positions.zero_()

        num_tokens = bs * self.num_tokens_per_bs

        # Common inputs
        self.seq_lens[:raw_bs].copy_(forward_batch.seq_lens)
        self.out_cache_loc[: raw_num_token * self.speculative_num_steps].copy_(forward_batch.out_cache_loc)
        self.positions[:raw_num_token].copy_(forward_batch.positions)
        self.topk_p[:raw_bs].copy_(forward_batch.spec_info.topk_p)
        self.topk_index[:raw_bs].copy_(forward_batch.spec_info.topk_index)
        self.hidden_states[:raw_bs].copy_(forward_batch.spec_info.hidden_states)
        self.req_pool_indices[:raw_bs].copy_(forward_batch.req_pool_indices)

        # Attention backend
        if bs != raw_bs:
            forward_batch.batch_size = bs
            forward_batch.seq_lens = self.seq_lens[:bs]
            forward_batch.req_pool_indices = self.req_pool_indices[:bs]
            forward_batch.positions = self.positions[:num_tokens]

        if forward_batch.seq_lens_cpu is not None:
            if bs != raw_bs:
                self.seq_lens_cpu.fill_(self.seq_len_fill_value)
            self.seq_lens_cpu[:raw_bs].copy_(forward_batch.seq_lens_cpu)
            forward_batch.seq_lens_cpu = self.seq_lens_cpu[:bs]

        # (forward_batch.out_cache_loc is still the live batch's: raw_bs * topk * num_steps slots)
        self.model_runner.draft_attn_backend.init_forward_metadata_replay_cuda_graph(forward_batch, bs)
        self.raw_bs = raw_bs
        self.bs = bs

        # Replay
        out = replay(self.graphs[bs], self.output_buffers[bs], real=raw_bs, size=bs,
                     padded={"topk_p": self.topk_p, "topk_index": self.topk_index,
                             "hidden_states": self.hidden_states})

        if bs != raw_bs:
            out = self._postprocess_output_to_raw_bs(out, raw_bs)
            forward_batch.batch_size = raw_bs
            forward_batch.positions = self.positions[:raw_num_token]
            forward_batch.seq_lens = self.seq_lens[:raw_bs]
            forward_batch.req_pool_indices = self.req_pool_indices[:raw_bs]
            if forward_batch.seq_lens_cpu is not None:
                forward_batch.seq_lens_cpu = self.seq_lens_cpu[:raw_bs]

        return out


# --- sglang/srt/speculative/spec_utils.py, eagle_utils.py, utils (reduced) --------------------------------------------

def fast_topk(values, topk, dim):
    if topk == 1:
        return torch.max(values, dim=dim, keepdim=True)
    return torch.topk(values, topk, dim=dim)


def select_top_k_tokens(i: int, topk_p, topk_index, hidden_states, scores, topk: int):
    if i == 0:
        # The first step after extend
        input_ids = topk_index.flatten()
        hidden_states = hidden_states.repeat_interleave(topk, dim=0)
        scores = topk_p  # shape: (b, topk)
        tree_info = (
            topk_p.unsqueeze(1),  # shape: (b, 1, topk)
            topk_index,  # shape: (b, topk)
            torch.arange(-1, topk, dtype=torch.long, device=hidden_states.device).unsqueeze(0).repeat(
                topk_p.shape[0], 1),  # shape: (b, topk + 1)
        )
    else:
        # The later decode steps
        expand_scores = torch.mul(scores.unsqueeze(2), topk_p.reshape(-1, topk, topk))
        topk_cs_p, topk_cs_index = fast_topk(expand_scores.flatten(start_dim=1), topk, dim=-1)  # (b, topk)
        scores = topk_cs_p  # shape: (b, topk)
        topk_index = topk_index.reshape(-1, topk**2)
        input_ids = torch.gather(topk_index, index=topk_cs_index, dim=1).flatten()
        if hidden_states.shape[0] > 0:
            selected_input_index = topk_cs_index.flatten() // topk + torch.arange(
                0, hidden_states.shape[0], step=topk, device=topk_index.device).repeat_interleave(topk)
            hidden_states = hidden_states[selected_input_index, :]
        tree_info = (
            expand_scores,  # shape: (b, topk, topk)
            topk_index,  # shape: (b, topk * topk)
            topk_cs_index + (topk**2 * (i - 1) + topk),  # shape: (b, topk)
        )
    return input_ids, hidden_states, scores, tree_info


def organize_draft_results(score_list: List[torch.Tensor], token_list: List[torch.Tensor],
                           parents_list: List[torch.Tensor], num_draft_token: int):
    score_list = torch.cat(score_list, dim=1).flatten(1)
    ss_token_list = torch.cat(token_list, dim=1)
    top_scores = torch.topk(score_list, num_draft_token - 1, dim=-1)
    top_scores_index = top_scores.indices
    top_scores_index = torch.sort(top_scores_index).values
    draft_tokens = torch.gather(ss_token_list, index=top_scores_index, dim=1)
    parent_list = torch.cat(parents_list[:-1], dim=1)
    return parent_list, top_scores_index, draft_tokens


def get_last_loc_large_page_size_large_top_k(req_to_token, req_pool_indices, seq_lens, speculative_num_steps: int,
                                             topk: int, page_size: int):
    prefix_lens = seq_lens
    last_page_lens = prefix_lens % page_size
    num_new_pages_per_topk = (last_page_lens + speculative_num_steps + page_size - 1) // page_size
    seq_lens = prefix_lens // page_size * page_size + num_new_pages_per_topk * (page_size * topk)
    extend_lens = seq_lens - prefix_lens
    return prefix_lens, seq_lens, num_new_pages_per_topk, extend_lens, last_page_lens


def assign_draft_cache_locs(req_pool_indices, req_to_token, seq_lens, num_new_pages_per_topk, out_cache_loc,
                            source_cache_loc, target_cache_loc, last_page_lens_cumsum, topk: int,
                            speculative_num_steps: int, page_size: int):
    """The Triton kernel's page_size > 1, topk > 1 path (parts 2 and 3), one request at a time on the host."""
    rows = req_to_token[req_pool_indices.long()].tolist()
    for pid, (prefix_len, n_pages, cum) in enumerate(zip(seq_lens.tolist(), num_new_pages_per_topk.tolist(),
                                                         last_page_lens_cumsum.tolist())):
        token_pool = rows[pid]
        last_page_len = prefix_len % page_size
        prefix_base = prefix_len - last_page_len
        # Part 2: the last partial page is duplicated into the first page of each other top-k branch
        src_indices = token_pool[prefix_base: prefix_base + last_page_len]
        for topk_id in range(1, topk):
            off = (topk - 1) * (cum - last_page_len) + (topk_id - 1) * last_page_len
            tgt = prefix_base + topk_id * n_pages * page_size
            source_cache_loc[off: off + last_page_len] = torch.tensor(src_indices, dtype=torch.int32)
            target_cache_loc[off: off + last_page_len] = torch.tensor(token_pool[tgt: tgt + last_page_len],
                                                                      dtype=torch.int32)
        # Part 3: each branch's draft slots follow its copy of the last partial page
        for topk_id in range(topk):
            start = prefix_base + topk_id * n_pages * page_size + last_page_len
            off = pid * speculative_num_steps * topk + topk_id * speculative_num_steps
            out_cache_loc[off: off + speculative_num_steps] = torch.tensor(
                token_pool[start: start + speculative_num_steps], dtype=torch.int64)


# --- sglang/srt/speculative/eagle_worker.py (draft decode, reduced) ---------------------------------------------------

class EAGLEWorker:
    def __init__(self, device, use_cuda_graph, req_to_token_pool, token_to_kv_pool):
        self.device = device
        self.topk, self.speculative_num_steps = SPECULATIVE_EAGLE_TOPK, SPECULATIVE_NUM_STEPS
        self.speculative_num_draft_tokens = SPECULATIVE_NUM_DRAFT_TOKENS
        self.page_size = PAGE_SIZE
        self.hot_token_id = None
        self.model_runner = self.draft_model_runner = ModelRunner(device, req_to_token_pool, token_to_kv_pool)
        # init_attention_backend: FA3 multi-step draft backend
        self.draft_attn_backend = FlashAttentionMultiStepBackend(self.draft_model_runner, self.topk,
                                                                 self.speculative_num_steps)
        self.draft_model_runner.draft_attn_backend = self.draft_attn_backend
        # init_cuda_graphs
        self.cuda_graph_runner = EAGLEDraftCudaGraphRunner(self) if use_cuda_graph else None

    def _draft_preprocess_decode(self, batch: ScheduleBatch):
        num_seqs = batch.batch_size()
        spec_info = batch.spec_info
        req_to_token = batch.req_to_token_pool.req_to_token
        # In this case, the last partial page needs to be duplicated.
        # | -------- | -- xxxx .. | -- xxxx .. |   prefix, top-k = 0, top-k = 1
        _, _, num_new_pages_per_topk, extend_lens, last_page_lens = get_last_loc_large_page_size_large_top_k(
            req_to_token, batch.req_pool_indices, batch.seq_lens, self.speculative_num_steps, self.topk, self.page_size)
        # alloc_paged_token_slots_extend + part 1 of the kernel (write the new slots into req_to_token): every request
        # owns the pages of its whole context in this stand-in, so both are the identity
        out_cache_loc = torch.zeros(int(extend_lens.sum()), dtype=torch.int64)
        last_page_lens_cumsum = torch.cumsum(last_page_lens, dim=0)
        duplicate_cache_len = int(last_page_lens.sum()) * (self.topk - 1)
        target_cache_loc = torch.zeros(duplicate_cache_len, dtype=torch.int32)
        source_cache_loc = torch.zeros(duplicate_cache_len, dtype=torch.int32)
        assign_draft_cache_locs(batch.req_pool_indices, req_to_token, batch.seq_lens, num_new_pages_per_topk,
                                out_cache_loc, source_cache_loc, target_cache_loc, last_page_lens_cumsum,
                                self.topk, self.speculative_num_steps, self.page_size)
        if duplicate_cache_len > 0:
            self.draft_model_runner.token_to_kv_pool.move_kv_cache(target_cache_loc.long().to(self.device),
                                                                   source_cache_loc.long().to(self.device))
        # Remove padded slots
        out_cache_loc = out_cache_loc[: num_seqs * self.topk * self.speculative_num_steps]

        batch.out_cache_loc = out_cache_loc.to(self.device)
        batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
        spec_info.positions = batch.seq_lens.repeat_interleave(self.topk, dim=0)

    def draft(self, batch: ScheduleBatch):
        self._draft_preprocess_decode(batch)
        spec_info = batch.spec_info
        spec_info.capture_hidden_mode = CaptureHiddenMode.LAST

        # Get forward batch
        forward_batch = ForwardBatch.init_new(batch, self.draft_model_runner)
        can_cuda_graph = self.cuda_graph_runner and self.cuda_graph_runner.can_run(forward_batch)
        if can_cuda_graph:
            parent_list, top_scores_index, draft_tokens = self.cuda_graph_runner.replay(forward_batch)
        else:
            if self.speculative_num_steps > 1:
                self.draft_attn_backend.init_forward_metadata(forward_batch)
            parent_list, top_scores_index, draft_tokens = self.draft_forward(forward_batch)
        # (build_tree_kernel_efficient consumes the three here; the draft tree itself is compared)
        return torch.cat([parent_list, top_scores_index, draft_tokens], dim=1).to(DTYPE)

    def draft_forward(self, forward_batch: ForwardBatch):
        # Parse args
        spec_info = forward_batch.spec_info
        out_cache_loc = forward_batch.out_cache_loc
        topk_p, topk_index, hidden_states = spec_info.topk_p, spec_info.topk_index, spec_info.hidden_states
        out_cache_loc = out_cache_loc.reshape(forward_batch.batch_size, self.topk, self.speculative_num_steps)
        out_cache_loc = out_cache_loc.permute((2, 0, 1)).reshape(self.speculative_num_steps, -1)

        # Return values
        score_list: List[torch.Tensor] = []
        token_list: List[torch.Tensor] = []
        parents_list: List[torch.Tensor] = []

        # Forward multiple steps
        scores = None
        for i in range(self.speculative_num_steps):
            input_ids, hidden_states, scores, tree_info = select_top_k_tokens(
                i, topk_p, topk_index, hidden_states, scores, self.topk)
            score_list.append(tree_info[0])
            token_list.append(tree_info[1])
            parents_list.append(tree_info[2])

            # We don't need to run the last forward.
            if i == self.speculative_num_steps - 1:
                break

            # Set inputs
            forward_batch.input_ids = input_ids
            forward_batch.out_cache_loc = out_cache_loc[i]
            forward_batch.positions.add_(1)
            forward_batch.attn_backend = self.draft_attn_backend.attn_backends[i]
            spec_info.hidden_states = hidden_states

            # Run forward
            logits_output, _ = self.draft_model_runner.forward(forward_batch, skip_attn_backend_init=True)
            probs = torch.softmax(logits_output.next_token_logits, dim=-1)
            topk_p, topk_index = fast_topk(probs, self.topk, dim=-1)
            hidden_states = logits_output.hidden_states

        parent_list, top_scores_index, draft_tokens = organize_draft_results(
            score_list, token_list, parents_list, self.speculative_num_draft_tokens)
        return parent_list, top_scores_index, draft_tokens


# --- the workload -----------------------------------------------------------------------------------------------------

# (request pool indices, committed lengths) per draft round: 2 (exact), 3 (padded to 4), 4 (exact), 1 (padded to 2).
# Every last partial page holds at most page_size - (num_steps - 1) tokens, so no branch's KV crosses a page
# (the crossing case is another bug, fixed by #15469).
ROUNDS = (([0, 3], [9, 12]), ([1, 2, 4], [6, 13, 10]), ([0, 1, 2, 5], [10, 8, 14, 5]), ([3], [16]))


def _serve(device, use_cuda_graph):
    gen = generator(7)
    # each request owns PAGES_PER_REQ pages of the pool, scattered; page 0 stays the padding page
    pages = (1 + torch.randperm(MAX_REQS * PAGES_PER_REQ, generator=gen)).view(MAX_REQS, PAGES_PER_REQ)
    req_to_token = (pages[:, :, None] * PAGE_SIZE + torch.arange(PAGE_SIZE)).view(MAX_REQS, CONTEXT_LEN)
    k_buffer = randn(NUM_PAGES * PAGE_SIZE, 1, HIDDEN, gen=gen, device=device).to(DTYPE)
    v_buffer = randn(NUM_PAGES * PAGE_SIZE, 1, HIDDEN, gen=gen, device=device).to(DTYPE)
    req_to_token_pool = ReqToTokenPool(req_to_token.to(torch.int32).to(device))
    token_to_kv_pool = MHATokenToKVPool(k_buffer, v_buffer)
    worker = EAGLEWorker(device, use_cuda_graph, req_to_token_pool, token_to_kv_pool)
    outs = []
    for reqs, seq_lens in ROUNDS:
        b = len(reqs)
        probs = torch.softmax(randn(b, VOCAB, gen=gen, device=device, scale=2.0).to(DTYPE), dim=-1)
        topk_p, topk_index = fast_topk(probs, SPECULATIVE_EAGLE_TOPK, dim=-1)
        spec_info = EagleDraftInput(topk_p=topk_p, topk_index=topk_index,
                                    hidden_states=randn(b, HIDDEN, gen=gen, device=device).to(DTYPE))
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int64)
        batch = ScheduleBatch(req_pool_indices=torch.tensor(reqs, dtype=torch.int64, device=device),
                              seq_lens=seq_lens_t.to(device), seq_lens_cpu=host(seq_lens_t, device),
                              req_to_token_pool=req_to_token_pool, token_to_kv_pool=token_to_kv_pool,
                              spec_info=spec_info)
        outs.append(worker.draft(batch))
    return outs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: _serve(device, True), lambda: _serve(device, False))
