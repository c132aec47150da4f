"""MTP speculator on FlashInfer with FULL decode graphs: the draft-decode graphs (q_len 1) are captured on the dynamic decode wrapper, whose next plan reallocates the buffers the graphs read.

Upstream: https://github.com/local-inference-lab/vllm/pull/398 ("[GG] fix(flashinfer): key persistent decode wrappers
by captured shape (#396)", local-inference-lab/vllm, a vLLM fork; opened 2026-08-16, open when read; fixes #396).
Read: the PR description (provenance, symptom, the start of its root cause, "The fix" list, before/after table) and
issue #396's summary (the fault pinned to ``run_fullgraph`` -> ``self.graphs[desc].replay()`` of the speculator's
draft-decode graph); the test the PR adds, ``tests/v1/attention/test_flashinfer_decode_qlen_guard.py`` ("The dynamic
wrapper rebinds ``_paged_kv_indptr_buf`` / ``_paged_kv_last_page_len_buf`` and reallocates ``_qo_indptr_buf`` on every
plan, so a graph captured around it replays against freed memory"; the new ``persistent_decode_wrapper_eligible``
signature with ``decode_shape`` / ``planned_decode_shapes`` / ``planning_for_capture``); a stored pre-fix
``vllm/v1/attention/backends/flashinfer.py`` of the fork (commit 1109032c, with #234's gate):
``persistent_decode_wrapper_eligible``, ``FlashInferMetadataBuilder.__init__``, ``_get_decode_wrapper``, ``build``,
``_compute_flashinfer_kv_metadata``, ``fast_plan_decode``. The fix is modelled from the description and the test.
Symptom: V2 model runner + MTP-3 speculator + ``cudagraph_mode=FULL_DECODE_ONLY`` on the FlashInfer decode backend:
every graph captures, then the engine dies in ``warmup_kernels`` (3 of 3 starts) with ``cudaErrorIllegalAddress`` at
the replay of the speculator's draft-decode FULL graph. Eager, or V2 without a speculator, serves fine.
Mechanism: the builder admits a batch to a persistent (CUDA-graph) decode wrapper only if its query length equals
``1 + num_spec_tokens``, the target's verify shape. The speculator's builder has the same speculative config, but its
draft-decode graphs run one token per request; so their capture builds take the dynamic wrapper, whose ``plan()`` puts
fresh device tensors in ``_paged_kv_indptr_buf`` / ``_paged_kv_last_page_len_buf`` / ``_qo_indptr_buf`` at every call.
The graph keeps the capture's addresses; the next build (another capture size, or the replay's own) frees them.
Doctor: dangling-reference, at persistent_decode_wrapper_eligible: it sends the draft-decode capture to the dynamic
wrapper, whose plan buffers the graph reads after the next plan released them.
Fix (upstream): record the shapes capture plans (``build_for_cudagraph_capture`` marks the capture-time build, which
creates, plans and records a persistent wrapper), key ``_decode_wrappers_cudagraph`` on
``(num_decodes, q_len_per_req)``, and admit a batch to a persistent wrapper only for a recorded shape; others keep the
dynamic wrapper (shapes no graph replays).
Modelled: ``persistent_decode_wrapper_eligible``, ``FlashInferMetadataBuilder`` (``_get_decode_wrapper``,
``_compute_flashinfer_kv_metadata``, ``build``, ``build_for_cudagraph_capture``) and ``fast_plan_decode`` as in the
fork; FlashInfer's wrappers and ``fast_decode_plan`` as its Python side behaves (a CUDA-graph wrapper copies into the
buffers it was given, with a frozen ``q_len_per_req``; a dynamic one takes new device tensors per plan). Stand-ins:
the attention kernel (a PyTorch paged attention reading the plan buffers); the speculator (a one-layer draft model,
not an MTP head on target hidden states); the target (a fixed greedy next-token rule: its verify graphs are not
modelled, the fault is in the draft's); an all-or-nothing decode/prefill split. float64.
Workload: two requests (prompts of 5 and 3 tokens), 3 speculative tokens, draft-decode graphs captured for 2 and 1
requests (2 first, as the runner captures largest first). Each round: the target rule verifies the drafts, the draft's
first pass reads the accepted tokens, then two draft-decode passes (one token per request) draft the rest. Round 0
follows the prompts (prefill pass, eager); round 1's first pass has two tokens per request (a uniform decode at q_len
2, eager on the dynamic wrapper), round 2's has 1 and 2 (prefill path, eager); request 1 stops after round 2, so round
3 serves request 0 alone, first pass included, through the 1-request graph: 12 draft passes, 9 of them replays. Bug:
capturing the 1-request graph replans the dynamic wrapper and frees the plan buffers the 2-request graph captured; its
first replay (round 0's first draft-decode pass) raises IllegalMemoryAccess reading the freed ``_qo_indptr_buf`` in
the attention kernel, as the fork died in its first warmup replay. Fix: the graphs are captured on persistent wrappers
(2, 1) and (1, 1), whose buffers every build refreshes in place: max |graph - eager| = 0 over the 21 logit rows of the
12 passes and the 18 accepted tokens.
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.engine import host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/local-inference-lab/vllm/pull/398"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "persistent_decode_wrapper_eligible"
SYMPTOM = ("V2 runner + MTP speculator + FULL decode graphs on FlashInfer: the replay of the speculator's draft-decode "
           "graph dies with an illegal memory access (the dynamic wrapper replanned and freed its buffers)")

NUM_SPECULATIVE_TOKENS = 3
MAX_NUM_REQS, MAX_NUM_TOKENS = 2, 16
BLOCK_SIZE, MAX_BLOCKS_PER_REQ = 4, 6
MAX_MODEL_LEN = BLOCK_SIZE * MAX_BLOCKS_PER_REQ
NUM_BLOCKS = 1 + MAX_NUM_REQS * MAX_BLOCKS_PER_REQ           # block 0: the null block
MAX_NUM_PAGES = MAX_NUM_REQS * MAX_BLOCKS_PER_REQ
NUM_HEADS, HEAD_DIM, HIDDEN, VOCAB = 2, 4, 8, 16
DRAFT_DECODE_CAPTURE_SIZES = [1, 2]                          # requests per draft-decode graph (q_len 1)
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

def persistent_decode_wrapper_eligible(*, pure_decode, num_decode_tokens, decode_cudagraph_max_bs, decode_shape,
                                       planned_decode_q_len, planned_decode_shapes, planning_for_capture):
    """Whether a decode batch may reuse a persistent (CUDA-graph) FlashInfer decode wrapper."""
    if _variant == "bug":      # #234's scalar gate: the target's verify length 1 + K, for every builder
        return (pure_decode and num_decode_tokens <= decode_cudagraph_max_bs
                and decode_shape[1] == planned_decode_q_len)
    return (pure_decode and num_decode_tokens <= decode_cudagraph_max_bs
            and (planning_for_capture or decode_shape in planned_decode_shapes))


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
        self._planned_decode_shapes: set[tuple[int, int]] = set()
        self._planning_for_capture = False
        self.enable_cuda_graph = cudagraph_mode == "FULL_DECODE_ONLY"
        if self.enable_cuda_graph:
            self._decode_wrappers_cudagraph = {}
            self._decode_cudagraph_max_bs = (1 + num_spec_tokens) * MAX_NUM_REQS
        self.reorder_batch_threshold = 1 + num_spec_tokens          # spec-as-decode
        self.sm_scale = HEAD_DIM ** -0.5
        self.paged_kv_indptr = CpuGpuBuffer(MAX_NUM_REQS + 1, device)
        self.paged_kv_indices = CpuGpuBuffer(MAX_NUM_PAGES, device)
        self.paged_kv_last_page_len = CpuGpuBuffer(MAX_NUM_REQS, device)

    def _get_prefill_wrapper(self):
        if self._prefill_wrapper is None:
            self._prefill_wrapper = BatchPrefillWithPagedKVCacheWrapper(self._workspace_buffer, "NHD")
        return self._prefill_wrapper

    def _get_decode_wrapper(self, batch_size, use_cudagraph=False, q_len_per_req=1):
        key = batch_size if _variant == "bug" else (batch_size, q_len_per_req)
        decode_wrapper = self._decode_wrappers_cudagraph.get(key) if use_cudagraph else self._decode_wrapper
        if decode_wrapper is None:
            buffers = {}
            if use_cudagraph:
                buffers = dict(paged_kv_indptr_buffer=self.paged_kv_indptr.gpu[:batch_size + 1],
                               paged_kv_indices_buffer=self.paged_kv_indices.gpu,
                               paged_kv_last_page_len_buffer=self.paged_kv_last_page_len.gpu[:batch_size])
            decode_wrapper = BatchDecodeWithPagedKVCacheWrapper(self._workspace_buffer, "NHD",
                                                                use_cuda_graph=use_cudagraph, **buffers)
            if use_cudagraph:
                self._decode_wrappers_cudagraph[key] = decode_wrapper
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
            decode_q_len = num_decode_tokens // num_decodes
            use_cudagraph = self.enable_cuda_graph and persistent_decode_wrapper_eligible(
                pure_decode=pure_decode, num_decode_tokens=num_decode_tokens,
                decode_cudagraph_max_bs=self._decode_cudagraph_max_bs, decode_shape=(num_decodes, decode_q_len),
                planned_decode_q_len=self._planned_decode_q_len, planned_decode_shapes=self._planned_decode_shapes,
                planning_for_capture=self._planning_for_capture)
            if use_cudagraph and self._planning_for_capture:
                self._planned_decode_shapes.add((num_decodes, decode_q_len))
            decode_wrapper = self._get_decode_wrapper(num_decodes, use_cudagraph, decode_q_len)
            fast_plan_decode(decode_wrapper, indptr_cpu=self.paged_kv_indptr.cpu[:num_decodes + 1],
                             indices=paged_kv_indices, last_page_len_cpu=self.paged_kv_last_page_len.cpu[:num_decodes],
                             sm_scale=self.sm_scale, q_len_per_req=decode_q_len)
            attn_metadata.decode = FIDecode(wrapper=decode_wrapper)
        return attn_metadata

    def build_for_cudagraph_capture(self, common_attn_metadata):
        if _variant == "bug":      # AttentionMetadataBuilder's: a plain build
            return self.build(0, common_attn_metadata)
        self._planning_for_capture = True          # the capture-time build creates, plans and records the wrapper
        try:
            return self.build(0, common_attn_metadata)
        finally:
            self._planning_for_capture = False


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


# --- the speculator's draft model (one attention layer) and the V2 runner's draft loop (reduced) ----------------------

class DraftModel:
    def __init__(self, device):
        gen = generator(398)
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
        self.model, self.impl = DraftModel(device), FlashInferImpl()
        cudagraph_mode = "FULL_DECODE_ONLY" if use_cuda_graph else "NONE"
        self.builder = FlashInferMetadataBuilder(NUM_SPECULATIVE_TOKENS, cudagraph_mode, device)
        self.kv_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, 2, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.positions = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((MAX_NUM_TOKENS,), PAD_SLOT_ID, dtype=torch.long, device=device)
        self.block_table = torch.zeros(MAX_NUM_REQS, MAX_BLOCKS_PER_REQ, dtype=torch.int32, device=device)
        self.graphs = {}

    def _forward(self, n, attn_metadata):
        return self.model.forward(self.input_ids[:n], self.positions[:n], self.slot_mapping[:n], self.kv_cache,
                                  attn_metadata, self.impl)

    def capture_draft_decode(self, num_reqs):
        """The speculator's draft-decode FULL graph: one token per request, dummy metadata (seq_len 1, null block)."""
        self.block_table[:num_reqs] = 0
        self.slot_mapping[:num_reqs] = PAD_SLOT_ID
        cam = CommonAttentionMetadata(host(torch.arange(num_reqs + 1, dtype=torch.int32), self.device),
                                      host(torch.ones(num_reqs, dtype=torch.int32), self.device),
                                      self.block_table[:num_reqs], self.slot_mapping[:num_reqs], num_reqs, num_reqs, 1)
        attn_metadata = self.builder.build_for_cudagraph_capture(cam)
        self.graphs[num_reqs] = capture(
            lambda: self._forward(num_reqs, attn_metadata), device=self.device, name=f"draft decode {num_reqs}",
            static={"input_ids": self.input_ids, "positions": self.positions, "slot_mapping": self.slot_mapping},
            state={"kv_cache": self.kv_cache}, owner="CudaGraphManager")

    def capture_model(self):
        for num_reqs in sorted(DRAFT_DECODE_CAPTURE_SIZES, reverse=True):
            self.capture_draft_decode(num_reqs)

    def execute(self, scheduled):
        """One draft pass: ``scheduled`` is [(request, first position, tokens)]; the logits at each last token."""
        input_ids, positions, slots, query_start_loc, seq_lens = [], [], [], [0], []
        for i, (req, start, tokens) in enumerate(scheduled):
            blocks = [1 + req * MAX_BLOCKS_PER_REQ + b for b in range(MAX_BLOCKS_PER_REQ)]
            self.block_table[i] = torch.tensor(blocks, dtype=torch.int32)
            pos = list(range(start, start + len(tokens)))
            input_ids, positions = input_ids + tokens, positions + pos
            slots += [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in pos]
            query_start_loc.append(query_start_loc[-1] + len(tokens))
            seq_lens.append(start + len(tokens))
        n, num_reqs = len(input_ids), len(scheduled)
        self.input_ids[:n].copy_(torch.tensor(input_ids))
        self.positions[:n].copy_(torch.tensor(positions))
        self.slot_mapping[:n].copy_(torch.tensor(slots))
        cam = CommonAttentionMetadata(host(torch.tensor(query_start_loc, dtype=torch.int32), self.device),
                                      host(torch.tensor(seq_lens, dtype=torch.int32), self.device),
                                      self.block_table[:num_reqs], self.slot_mapping[:n], num_reqs, n,
                                      max(len(t) for _, _, t in scheduled))
        attn_metadata = self.builder.build(0, cam)
        if n == num_reqs and num_reqs in self.graphs:          # uniform q_len 1: the draft-decode graph
            g, out = self.graphs[num_reqs]
            logits = replay(g, out)
        else:
            logits = self._forward(n, attn_metadata)
        return logits[[q - 1 for q in query_start_loc[1:]]].clone()


def target_next(token, position):
    """Stand-in for the target model's greedy verify: the token it samples at ``position``."""
    return (token + 3 * position + 1) % VOCAB


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    prompts = {0: [3, 1, 4, 1, 5], 1: [9, 2, 6]}
    num_rounds = {0: 4, 1: 3}                       # request 1 reaches its max_tokens after round 2

    def serve(use_cuda_graph):
        runner = GPUModelRunner(device, use_cuda_graph)
        if use_cuda_graph:
            runner.capture_model()
        tokens = {r: list(p) for r, p in prompts.items()}
        drafts, fresh, all_logits = {r: [] for r in prompts}, {}, []
        for rnd in range(4):                        # round 0 drafts after the prompts, rounds 1-3 after a verify
            active = [r for r in prompts if rnd < num_rounds[r]]
            for r in active:                        # target verify: accepted drafts, then its own token
                new = []
                for d in drafts[r] + [None]:
                    t = target_next((tokens[r] + new)[-1], len(tokens[r]) + len(new))
                    new.append(t)
                    if d != t:
                        break
                fresh[r] = (prompts[r] if rnd == 0 else []) + new       # what the draft's first pass reads
                tokens[r] += new
            logits = runner.execute([(r, len(tokens[r]) - len(fresh[r]), fresh[r]) for r in active])
            all_logits.append(logits)
            drafts = {r: [int(logits[i].argmax())] for i, r in enumerate(active)}
            for _ in range(NUM_SPECULATIVE_TOKENS - 1):                 # draft-decode passes, one token each
                logits = runner.execute([(r, len(tokens[r]) + len(drafts[r]) - 1, drafts[r][-1:]) for r in active])
                all_logits.append(logits)
                for i, r in enumerate(active):
                    drafts[r].append(int(logits[i].argmax()))
        return [torch.cat(all_logits), torch.tensor(tokens[0] + tokens[1], dtype=DTYPE)]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
