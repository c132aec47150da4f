"""DFlash/EAGLE verify on FlashInfer with FULL decode graphs: a reduced-depth lone step, run piecewise, is handed the persistent decode wrapper that capture planned with a frozen q_len, and FlashInfer refuses the replan.

Upstream: https://github.com/local-inference-lab/vllm/pull/234 ("fix(flashinfer): only reuse persistent decode
wrappers at the planned q_len", local-inference-lab/vllm, a vLLM fork, dev/gilded-gnosis lineage; 2026-08-03, merged;
fixes issue #233). Read: the PR description (as stored: the defect, the fix list, the tests); the issue's text in its
draft form (a stored ``.md`` with the environment, both crash signatures, the root-cause chain:
``method in ("dflash", "dspark")`` forces parallel drafting, ``reorder_batch_threshold = 1 + 2K``,
``split_decodes_and_prefills(require_uniform=True)`` classifies a lone reduced-depth step as a decode, "the builder's
persistent-wrapper eligibility predicate checks only capacity:
``enable_cuda_graph and pure_decode and num_decode_tokens <= _decode_cudagraph_max_bs``", the wrappers "planned during
capture with frozen ``q_len_per_req = 1 + K``", while ``cudagraph_utils._is_compatible`` sends the step to PIECEWISE;
the fix list); and the fixed ``vllm/v1/attention/backends/flashinfer.py`` of the fork (a stored version with #234's
``persistent_decode_wrapper_eligible``, ``_planned_decode_q_len``, ``_get_decode_wrapper``,
``_compute_flashinfer_kv_metadata``, ``build`` and ``fast_plan_decode``). The pre-fix predicate is the issue's quote.
Symptom: any length-capped request whose budget is not a multiple of K+1 (spec depth truncated near ``max_tokens``),
or a prompt whose chunked-prefill tail is fused with the spec step, kills the engine:
``ValueError: q_len_per_req is part of the frozen cudagraph shape: this wrapper was planned with 6, got 5`` (or
``got 8``) in ``fast_decode_plan``, then ``EngineDeadError``.
Mechanism: persistent (CUDA-graph) decode wrappers are created and planned during capture, for uniform verify batches
of ``1 + K`` tokens per request; FlashInfer freezes that ``q_len_per_req`` into the wrapper. The decode classification
ceiling is ``1 + 2K``, so a lone step of another depth is a decode too; the runner's dispatcher sees no graph of that
shape and runs it piecewise, but the attention builder, checking only capacity, hands it the capture's wrapper and
replans it: the capture's frozen plan against this step's shape.
Doctor: warmup-divergence, at build: its predicate reuses for a piecewise step the wrapper (and plan) that graph
capture froze for another query length.
Fix (upstream): the predicate also requires ``decode_q_len == planned_decode_q_len`` (``1 + num_spec_tokens``,
factored into ``persistent_decode_wrapper_eligible``); other depths take the dynamic wrapper, which replans per call.
Modelled: ``FlashInferMetadataBuilder`` (``_get_decode_wrapper``, ``_compute_flashinfer_kv_metadata``, ``build``,
``build_for_cudagraph_capture``) and ``fast_plan_decode`` as in the fork, the predicate inline in ``build`` as before
the fix; FlashInfer's wrappers and ``fast_decode_plan`` as its Python side behaves (a CUDA-graph wrapper copies into
the buffers it was given and keeps the ``q_len_per_req`` of its first plan; a dynamic one takes new device tensors per
plan). Stand-ins: the attention kernel (a PyTorch paged attention over the plan buffers); the target model (one
attention layer); the scheduler (a fixed schedule in which every draft is accepted); the dispatcher (FULL graph for
uniform ``1 + K`` batches of a captured size, eager otherwise); an all-or-nothing decode/prefill split. float64.
Workload: K = 3 (parallel drafting: decode ceiling 7, planned verify length 4), verify graphs captured for 2 and 1
requests. Step 1 prefills A (5 tokens) and B (3), eager; steps 2 and 3 verify A and B (4 tokens each: two FULL
replays); B then reaches its max_tokens, step 4 verifies A alone (a replay of the 1-request graph); step 5 has 3
tokens left to A's max_tokens, so it schedules 1 + 2 drafts: a lone decode of depth 3, run eagerly. Bug: the builder
gives it the 1-request persistent wrapper planned with 4 and the engine raises
``ValueError: ... planned with 4, got 3`` (the four earlier steps, three of them replays, equal eager). Fix: step 5
takes the dynamic wrapper, max |graph - eager| = 0 over the logits of all 31 scheduled tokens.
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.engine import host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/local-inference-lab/vllm/pull/234"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "build"
SYMPTOM = ("DFlash/EAGLE + FlashInfer FULL decode graphs: a length-capped request's reduced-depth last step gets "
           "the persistent wrapper planned at capture; fast_decode_plan refuses (planned with 6, got 5), engine dies")

NUM_SPECULATIVE_TOKENS = 3
PARALLEL_DRAFTING = True                                     # forced for dflash / dspark
MAX_NUM_REQS, MAX_NUM_TOKENS = 2, 16
BLOCK_SIZE, MAX_BLOCKS_PER_REQ = 4, 6
MAX_MODEL_LEN = BLOCK_SIZE * MAX_BLOCKS_PER_REQ
NUM_BLOCKS = 1 + MAX_NUM_REQS * MAX_BLOCKS_PER_REQ           # block 0: the null block
MAX_NUM_PAGES = MAX_NUM_REQS * MAX_BLOCKS_PER_REQ
NUM_HEADS, HEAD_DIM, HIDDEN, VOCAB = 2, 4, 8, 16
UNIFORM_DECODE_QUERY_LEN = 1 + NUM_SPECULATIVE_TOKENS
VERIFY_CAPTURE_SIZES = [1, 2]                                # requests per FULL verify graph
PAD_SLOT_ID = -1
DTYPE = torch.float64

_variant = "bug"


@dataclasses.dataclass
class CommonAttentionMetadata:
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int


def split_decodes_and_prefills(cam, decode_threshold, require_uniform=True):
    """Reduced: the whole batch is decodes (uniform query length within the threshold) or prefills."""
    query_lens = (cam.query_start_loc_cpu[1:] - cam.query_start_loc_cpu[:-1]).tolist()
    if cam.max_query_len <= decode_threshold and (not require_uniform or len(set(query_lens)) == 1):
        return cam.num_reqs, 0, cam.num_actual_tokens, 0
    return 0, cam.num_reqs, 0, cam.num_actual_tokens


class CpuGpuBuffer:
    def __init__(self, size, device):
        self.cpu = host(torch.zeros(size, dtype=torch.int32), device)
        self.gpu = torch.zeros(size, dtype=torch.int32, device=device)


# --- flashinfer (Python side of the wrappers; the kernel is a stand-in) -----------------------------------------------

def _paged_attention(q, kv_cache, qo_indptr, kv_indptr, kv_indices, last_page_len, sm_scale):
    """Kernel stand-in: each query row attends causally to its request's pages, read through the plan buffers."""
    rows = torch.arange(q.shape[0], dtype=qo_indptr.dtype, device=q.device)
    req = torch.searchsorted(qo_indptr[1:], rows, right=True)
    first_page, num_pages = kv_indptr[req], kv_indptr[req + 1] - kv_indptr[req]
    visible = (num_pages - 1) * BLOCK_SIZE + last_page_len[req] - (qo_indptr[req + 1] - 1 - rows)
    j = torch.arange(MAX_MODEL_LEN, device=q.device)
    pages = kv_indices[(first_page.unsqueeze(1) + j // BLOCK_SIZE).clamp(max=kv_indices.shape[0] - 1)].long()
    kv = kv_cache[pages, (j % BLOCK_SIZE).expand_as(pages)]                          # [rows, L, 2, H, D]
    scores = torch.einsum("rhd,rlhd->rhl", q, kv[:, :, 0]) * sm_scale
    scores = scores.masked_fill((j.unsqueeze(0) >= visible.unsqueeze(1)).unsqueeze(1), float("-inf"))
    return torch.einsum("rhl,rlhd->rhd", torch.softmax(scores, -1), kv[:, :, 1])


class BatchDecodeWithPagedKVCacheWrapper:
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, paged_kv_indptr_buffer=None,
                 paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None, use_tensor_cores=True):
        self.device = float_workspace_buffer.device
        self._use_cuda_graph = use_cuda_graph
        if use_cuda_graph:                 # the buffers a graph will read: fixed for the wrapper's life
            self._fixed_batch_size = paged_kv_last_page_len_buffer.shape[0]
            self._paged_kv_indptr_buf = paged_kv_indptr_buffer
            self._paged_kv_indices_buf = paged_kv_indices_buffer
            self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buffer
            self._qo_indptr_buf = torch.arange(self._fixed_batch_size + 1, dtype=torch.int32, device=self.device)
            self._q_len_per_req = None

    @property
    def is_cuda_graph_enabled(self):
        return self._use_cuda_graph

    def plan(self, indptr, indices, last_page_len, sm_scale, q_len_per_req=1, non_blocking=True):
        batch_size = last_page_len.shape[0]
        qo_indptr_host = host(torch.arange(batch_size + 1, dtype=torch.int32) * q_len_per_req, self.device)
        if self.is_cuda_graph_enabled:
            if batch_size != self._fixed_batch_size:
                raise ValueError(f"The batch size should be fixed in cudagraph mode, got {batch_size}")
            self._paged_kv_indptr_buf.copy_(indptr, non_blocking=non_blocking)
            self._paged_kv_last_page_len_buf.copy_(last_page_len, non_blocking=non_blocking)
            self._qo_indptr_buf.copy_(qo_indptr_host, non_blocking=non_blocking)
            self._q_len_per_req = q_len_per_req
        else:                              # new device tensors at every plan
            self._paged_kv_indptr_buf = indptr.to(self.device, non_blocking=non_blocking)
            self._paged_kv_indices_buf = indices
            self._paged_kv_last_page_len_buf = last_page_len.to(self.device, non_blocking=non_blocking)
            self._qo_indptr_buf = qo_indptr_host.to(self.device, non_blocking=non_blocking)
        self._sm_scale = sm_scale

    def run(self, q, paged_kv_cache, out):
        out.copy_(_paged_attention(q, paged_kv_cache, self._qo_indptr_buf, self._paged_kv_indptr_buf,
                                   self._paged_kv_indices_buf, self._paged_kv_last_page_len_buf, self._sm_scale))
        return out


class BatchPrefillWithPagedKVCacheWrapper(BatchDecodeWithPagedKVCacheWrapper):
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, sm_scale, causal=True):
        self._qo_indptr_buf = qo_indptr.to(self.device)
        self._paged_kv_indptr_buf = paged_kv_indptr.to(self.device)
        self._paged_kv_indices_buf = paged_kv_indices
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len.to(self.device)
        self._sm_scale = sm_scale


def fast_decode_plan(self, indptr, indices, last_page_len, sm_scale, q_len_per_req=1, non_blocking=True):
    """flashinfer.decode.fast_decode_plan: replan a CUDA-graph wrapper in place, for its frozen shape."""
    if q_len_per_req != self._q_len_per_req:
        raise ValueError(f"q_len_per_req is part of the frozen cudagraph shape: this wrapper was planned with "
                         f"{self._q_len_per_req}, got {q_len_per_req}")
    self._paged_kv_indptr_buf.copy_(indptr, non_blocking=non_blocking)
    self._paged_kv_last_page_len_buf.copy_(last_page_len, non_blocking=non_blocking)


# --- vllm/v1/attention/backends/flashinfer.py -------------------------------------------------------------------------

@dataclasses.dataclass
class FIPrefill:
    wrapper: BatchPrefillWithPagedKVCacheWrapper


@dataclasses.dataclass
class FIDecode:
    wrapper: BatchDecodeWithPagedKVCacheWrapper


@dataclasses.dataclass
class FlashInferMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    prefill: FIPrefill | None = None
    decode: FIDecode | None = None


class FlashInferMetadataBuilder:
    def __init__(self, num_spec_tokens, cudagraph_mode, device):
        self.device = device
        self._workspace_buffer = torch.zeros(64, dtype=torch.uint8, device=device)
        self._prefill_wrapper = None
        self._decode_wrapper = None                        # Wrapper for decode (general shape)
        self._planned_decode_q_len = 1 + num_spec_tokens
        self.enable_cuda_graph = cudagraph_mode == "FULL_AND_PIECEWISE"
        if self.enable_cuda_graph:                         # one persistent decode wrapper per batch size
            self._decode_wrappers_cudagraph = {}
            self._decode_cudagraph_max_bs = (1 + num_spec_tokens) * MAX_NUM_REQS
        # AttentionMetadataBuilder._init_reorder_batch_threshold(1, supports_spec_as_decode=True)
        self.reorder_batch_threshold = 1 + (2 if PARALLEL_DRAFTING else 1) * num_spec_tokens
        self.sm_scale = HEAD_DIM ** -0.5
        self.paged_kv_indptr = CpuGpuBuffer(MAX_NUM_REQS + 1, device)
        self.paged_kv_indices = CpuGpuBuffer(MAX_NUM_PAGES, device)
        self.paged_kv_last_page_len = CpuGpuBuffer(MAX_NUM_REQS, device)

    def _get_prefill_wrapper(self):
        if self._prefill_wrapper is None:
            self._prefill_wrapper = BatchPrefillWithPagedKVCacheWrapper(self._workspace_buffer, "NHD")
        return self._prefill_wrapper

    def _get_decode_wrapper(self, batch_size, use_cudagraph=False):
        decode_wrapper = self._decode_wrappers_cudagraph.get(batch_size) if use_cudagraph else self._decode_wrapper
        if decode_wrapper is None:
            buffers = {}
            if use_cudagraph:
                buffers = dict(paged_kv_indptr_buffer=self.paged_kv_indptr.gpu[:batch_size + 1],
                               paged_kv_indices_buffer=self.paged_kv_indices.gpu,
                               paged_kv_last_page_len_buffer=self.paged_kv_last_page_len.gpu[:batch_size])
            decode_wrapper = BatchDecodeWithPagedKVCacheWrapper(self._workspace_buffer, "NHD",
                                                                use_cuda_graph=use_cudagraph, **buffers)
            if use_cudagraph:
                self._decode_wrappers_cudagraph[batch_size] = decode_wrapper
            else:
                self._decode_wrapper = decode_wrapper
        return decode_wrapper

    def _compute_flashinfer_kv_metadata(self, num_blocks, seq_lens_cpu, block_table_tensor, num_reqs):
        self.paged_kv_indptr.cpu[1:num_reqs + 1] = torch.cumsum(num_blocks, 0)
        paged_kv_indptr = self.paged_kv_indptr.gpu[:num_reqs + 1]
        paged_kv_indptr.copy_(self.paged_kv_indptr.cpu[:num_reqs + 1], non_blocking=True)
        num_actual_pages = int(self.paged_kv_indptr.cpu[num_reqs])
        paged_kv_indices = self.paged_kv_indices.gpu[:num_actual_pages]
        for r, (start, n) in enumerate(zip(self.paged_kv_indptr.cpu[:num_reqs].tolist(), num_blocks.tolist())):
            paged_kv_indices[start:start + n].copy_(block_table_tensor[r, :n])     # _copy_page_indices_kernel
        last = seq_lens_cpu % BLOCK_SIZE
        self.paged_kv_last_page_len.cpu[:num_reqs] = torch.where((last == 0) & (seq_lens_cpu != 0), BLOCK_SIZE, last)
        self.paged_kv_last_page_len.gpu[:num_reqs].copy_(self.paged_kv_last_page_len.cpu[:num_reqs], non_blocking=True)
        return paged_kv_indices

    def build(self, common_prefix_len, common_attn_metadata):
        cam = common_attn_metadata
        num_reqs = cam.num_reqs
        num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = split_decodes_and_prefills(
            cam, decode_threshold=self.reorder_batch_threshold, require_uniform=True)
        num_blocks = (cam.seq_lens_cpu + (BLOCK_SIZE - 1)) // BLOCK_SIZE
        paged_kv_indices = self._compute_flashinfer_kv_metadata(num_blocks, cam.seq_lens_cpu,
                                                                cam.block_table_tensor, num_reqs)
        attn_metadata = FlashInferMetadata(cam.num_actual_tokens, cam.slot_mapping, num_decodes, num_decode_tokens,
                                           num_prefills, num_prefill_tokens)
        if num_prefills > 0:
            prefill_wrapper = self._get_prefill_wrapper()
            prefill_wrapper.plan(cam.query_start_loc_cpu, self.paged_kv_indptr.cpu[:num_reqs + 1], paged_kv_indices,
                                 self.paged_kv_last_page_len.cpu[:num_reqs], self.sm_scale, causal=True)
            attn_metadata.prefill = FIPrefill(wrapper=prefill_wrapper)
        if num_decodes > 0:
            pure_decode = num_prefills == 0
            # Spec-as-decode verify batches carry a uniform num_decode_tokens // num_decodes tokens per request.
            decode_q_len = num_decode_tokens // num_decodes
            if _variant == "bug":          # capacity only
                use_cudagraph = (self.enable_cuda_graph and pure_decode
                                 and num_decode_tokens <= self._decode_cudagraph_max_bs)
            else:                          # persistent_decode_wrapper_eligible: also the frozen q_len
                use_cudagraph = (self.enable_cuda_graph and pure_decode
                                 and num_decode_tokens <= self._decode_cudagraph_max_bs
                                 and decode_q_len == self._planned_decode_q_len)
            decode_wrapper = self._get_decode_wrapper(num_decodes, use_cudagraph)
            fast_plan_decode(decode_wrapper, indptr_cpu=self.paged_kv_indptr.cpu[:num_decodes + 1],
                             indices=paged_kv_indices, last_page_len_cpu=self.paged_kv_last_page_len.cpu[:num_decodes],
                             sm_scale=self.sm_scale, q_len_per_req=decode_q_len)
            attn_metadata.decode = FIDecode(wrapper=decode_wrapper)
        return attn_metadata

    def build_for_cudagraph_capture(self, common_attn_metadata):
        return self.build(0, common_attn_metadata)


def fast_plan_decode(self, indptr_cpu, indices, last_page_len_cpu, sm_scale, q_len_per_req=1, non_blocking=True):
    """The original plan for a dynamic wrapper (and a graph wrapper's first call); fast_decode_plan otherwise."""
    if not self.is_cuda_graph_enabled or getattr(self, "vllm_first_call", True):
        self.plan(indptr_cpu, indices, last_page_len_cpu, sm_scale, q_len_per_req=q_len_per_req,
                  non_blocking=non_blocking)
        self.vllm_first_call = False
        return
    fast_decode_plan(self, indptr_cpu, indices, last_page_len_cpu, sm_scale, q_len_per_req, non_blocking)


class FlashInferImpl:
    def do_kv_cache_update(self, key, value, kv_cache, slot_mapping):
        """reshape_and_cache_flash stand-in; padded slots (-1) land in the null block."""
        kv_cache.view(-1, 2, NUM_HEADS, HEAD_DIM).index_copy_(0, slot_mapping.clamp(min=0),
                                                               torch.stack([key, value], 1))

    def forward(self, query, kv_cache, attn_metadata, output):
        num_decode_tokens = attn_metadata.num_decode_tokens
        if attn_metadata.num_prefill_tokens > 0:
            attn_metadata.prefill.wrapper.run(query[num_decode_tokens:], kv_cache, out=output[num_decode_tokens:])
        if num_decode_tokens > 0:
            attn_metadata.decode.wrapper.run(query[:num_decode_tokens], kv_cache, out=output[:num_decode_tokens])
        return output


# --- the target model (one attention layer) and the runner (reduced) -------------------------------------------------

class Model:
    def __init__(self, device):
        gen = generator(234)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)  # noqa: E731
        self.embed_tokens, self.embed_positions = r(VOCAB, HIDDEN, scale=1.0), r(MAX_MODEL_LEN, HIDDEN)
        self.wq, self.wk, self.wv = (r(HIDDEN, NUM_HEADS * HEAD_DIM) for _ in range(3))
        self.o_proj, self.lm_head = r(NUM_HEADS * HEAD_DIM, HIDDEN), r(HIDDEN, VOCAB)

    def forward(self, input_ids, positions, slot_mapping, kv_cache, attn_metadata, impl):
        n = input_ids.shape[0]
        x = self.embed_tokens[input_ids] + self.embed_positions[positions]
        q, k, v = ((x @ w).view(n, NUM_HEADS, HEAD_DIM) for w in (self.wq, self.wk, self.wv))
        impl.do_kv_cache_update(k, v, kv_cache, slot_mapping)
        attn = impl.forward(q, kv_cache, attn_metadata, torch.empty_like(q))
        return (x + attn.reshape(n, -1) @ self.o_proj) @ self.lm_head


class GPUModelRunner:
    def __init__(self, device, use_cuda_graph):
        self.device = device
        self.model, self.impl = Model(device), FlashInferImpl()
        self.builder = FlashInferMetadataBuilder(NUM_SPECULATIVE_TOKENS,
                                                 "FULL_AND_PIECEWISE" if use_cuda_graph else "NONE", device)
        self.kv_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, 2, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.positions = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((MAX_NUM_TOKENS,), PAD_SLOT_ID, dtype=torch.long, device=device)
        self.block_table = torch.zeros(MAX_NUM_REQS, MAX_BLOCKS_PER_REQ, dtype=torch.int32, device=device)
        self.num_computed, self.graphs = {}, {}

    def _forward(self, n, attn_metadata):
        return self.model.forward(self.input_ids[:n], self.positions[:n], self.slot_mapping[:n], self.kv_cache,
                                  attn_metadata, self.impl)

    def _dummy_run(self, num_reqs):
        """Capture the FULL graph of a uniform verify batch: 1 + K tokens per request, dummy metadata."""
        n = num_reqs * UNIFORM_DECODE_QUERY_LEN
        self.block_table[:num_reqs] = 0
        self.slot_mapping[:n] = PAD_SLOT_ID
        cam = CommonAttentionMetadata(
            host(torch.arange(num_reqs + 1, dtype=torch.int32) * UNIFORM_DECODE_QUERY_LEN, self.device),
            host(torch.full((num_reqs,), UNIFORM_DECODE_QUERY_LEN, dtype=torch.int32), self.device),
            self.block_table[:num_reqs], self.slot_mapping[:n], num_reqs, n, UNIFORM_DECODE_QUERY_LEN)
        attn_metadata = self.builder.build_for_cudagraph_capture(cam)
        self.graphs[num_reqs] = capture(
            lambda: self._forward(n, attn_metadata), device=self.device, name=f"FULL verify {num_reqs}",
            static={"input_ids": self.input_ids, "positions": self.positions, "slot_mapping": self.slot_mapping},
            state={"kv_cache": self.kv_cache}, owner="CUDAGraphWrapper")

    def capture_model(self):
        for num_reqs in sorted(VERIFY_CAPTURE_SIZES, reverse=True):
            self._dummy_run(num_reqs)

    def execute_model(self, scheduled):
        """``scheduled``: [(request, tokens)]; the logits of every scheduled token."""
        input_ids, positions, slots, query_start_loc, seq_lens = [], [], [], [0], []
        for i, (req, tokens) in enumerate(scheduled):
            start = self.num_computed.get(req, 0)
            blocks = [1 + req * MAX_BLOCKS_PER_REQ + b for b in range(MAX_BLOCKS_PER_REQ)]
            self.block_table[i] = torch.tensor(blocks, dtype=torch.int32)
            pos = list(range(start, start + len(tokens)))
            input_ids, positions = input_ids + tokens, positions + pos
            slots += [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in pos]
            query_start_loc.append(query_start_loc[-1] + len(tokens))
            seq_lens.append(start + len(tokens))
            self.num_computed[req] = start + len(tokens)           # every draft accepted
        n, num_reqs = len(input_ids), len(scheduled)
        self.input_ids[:n].copy_(torch.tensor(input_ids))
        self.positions[:n].copy_(torch.tensor(positions))
        self.slot_mapping[:n].copy_(torch.tensor(slots))
        max_query_len = max(len(t) for _, t in scheduled)
        cam = CommonAttentionMetadata(host(torch.tensor(query_start_loc, dtype=torch.int32), self.device),
                                      host(torch.tensor(seq_lens, dtype=torch.int32), self.device),
                                      self.block_table[:num_reqs], self.slot_mapping[:n], num_reqs, n, max_query_len)
        attn_metadata = self.builder.build(0, cam)
        uniform = all(len(t) == UNIFORM_DECODE_QUERY_LEN for _, t in scheduled)      # the dispatcher's key
        if uniform and num_reqs in self.graphs:
            g, out = self.graphs[num_reqs]
            return replay(g, out).clone()
        return self._forward(n, attn_metadata).clone()                            # PIECEWISE: attention eager


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    A, B = 0, 1
    steps = [[(A, [3, 1, 4, 1, 5]), (B, [9, 2, 6])],           # step 1: prefill (eager)
             [(A, [5, 3, 5, 8]), (B, [9, 7, 9, 3])],          # steps 2-3: verify, sampled + 3 drafts
             [(A, [2, 3, 8, 4]), (B, [6, 2, 6, 4])],
             [(A, [3, 3, 8, 3])],                               # step 4: B is done, A alone
             [(A, [2, 7, 9])]]                                  # step 5: 3 tokens to A's max_tokens: 1 + 2

    def serve(use_cuda_graph):
        runner = GPUModelRunner(device, use_cuda_graph)
        if use_cuda_graph:
            runner.capture_model()
        return [runner.execute_model(step) for step in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
