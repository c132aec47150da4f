"""vLLM's Model Runner V2 (``vllm/v1/worker/gpu/``) runs a step either eagerly or by replaying one of its FULL CUDA
graphs: ``GPUModelRunner.get_cudagraph_and_dp_padding`` asks ``CudaGraphManager.get_cudagraph_size`` whether the
step's token count maps to a captured size, and ``execute_model`` then replays that graph (``CudaGraphManager.run``)
after ``prepare_inputs`` has written the step's inputs and attention metadata into the graph's buffers. The graphs
are captured with decode-shaped dummy batches (``prepare_inputs_to_capture``: one token per request). The default
``cudagraph_mode`` is FULL_AND_PIECEWISE: FULL graphs for uniform decode batches, piecewise graphs for batches with
prefill, which MRV2 does not support yet ("TODO(woosuk): Support piecewise CUDA graphs"), so those must run eagerly.
``get_cudagraph_size`` only refused batches with prefill tokens in FULL_DECODE_ONLY mode; under FULL_AND_PIECEWISE
a prefill or mixed batch whose token count hit a capture size replayed the decode-captured graph. With FlashInfer,
which this same PR admitted to MRV2 and whose FULL graphs are decode-only (``UNIFORM_SINGLE_TOKEN_DECODE``), that
graph holds the batch-size-``n`` decode wrapper's kernel, frozen at capture: every token is run as its own decode
request, against decode-plan buffers the step did not plan. The fix sends every mixed batch to eager unless the
mode's ``mixed_mode()`` is FULL.

Upstream: https://github.com/vllm-project/vllm/pull/32348 ("[Model Runner V2] Support FlashInfer backend & Fix CUDA
Graph bug [1/2]", vllm-project/vllm, author WoosukKwon, merged 2026-01-15 as 6218034dd). Read, in a stored mirror
(local-inference-lab/vllm, which carries upstream main's history): the whole diff (``cudagraph_utils.py``:
``get_cudagraph_size`` gets ``if not cudagraph_mode.has_full_cudagraphs(): return None`` and ``is_mixed = any(x > 1
...)`` / ``cudagraph_mode.mixed_mode() != CUDAGraphMode.FULL`` in place of the FULL_DECODE_ONLY ``all_decode``
test; ``model_runner.py``: FLASHINFER accepted beside FLASH_ATTN); the PR description from the issues corpus ("Add
FlashInfer to the supported backends and fix a bug in supporting the FULL_DECODE_ONLY mode. NOTE: We still need to
fix FlashInfer attention metadata builder has race conditions"); at the parent: the whole ``cudagraph_utils.py``
(``CudaGraphManager.__init__``/``needs_capture``/``get_cudagraph_size``/``capture_graph``/``capture``/``run``,
``get_cudagraph_sizes``, ``capture_graphs``, ``prepare_inputs_to_capture``), ``model_runner.py``
(``initialize_kv_cache``, ``prepare_inputs``, ``get_cudagraph_and_dp_padding``, ``execute_model``),
``attn_utils.build_attn_metadata``, ``block_table.py`` (``BlockTables``, ``gather_block_tables``,
``compute_slot_mappings`` and its kernel padding with PAD_SLOT_ID), ``input_batch.py`` (``InputBuffers``,
``prepare_pos_seq_lens``, ``_combine_sampled_and_draft_tokens_kernel``), ``CUDAGraphMode`` in
``config/compilation.py``, ``split_decodes_and_prefills`` in ``v1/attention/backends/utils.py``, and in
``v1/attention/backends/flashinfer.py``: ``FlashInferMetadataBuilder`` (``__init__`` buffers and
``enable_cuda_graph``, ``get_cudagraph_support``, ``_get_prefill_wrapper``, ``_get_decode_wrapper``,
``_compute_flashinfer_kv_metadata``, the non-TRTLLM/non-cascade/non-DCP path of ``build``), ``FlashInferImpl.forward``
(cache write, prefill and decode parts) and ``fast_plan_decode``. Not read: the PR's review thread; part [2/2];
FlashInfer's own wrappers and kernels (``plan``/``run`` here are rebuilt from vLLM's use of them); the compilation
config's mode resolution for FlashInfer under MRV2 (I take the default FULL_AND_PIECEWISE to reach the manager as is,
as ``CudaGraphManager.__init__`` reads ``compilation_config.cudagraph_mode`` directly).
Symptom: not recorded upstream beyond the title ("Fix CUDA Graph bug") and the description quoted above. By my
reading: with MRV2, FlashInfer and the default FULL_AND_PIECEWISE mode, every prefill or mixed step whose token count
is a key of ``cudagraph_sizes`` replays a decode graph, and its logits (so its sampled tokens) are wrong; eagerly the
same steps are right. (At the parent MRV2 refused FlashInfer outright; the bug variant is the parent's
``get_cudagraph_size`` with the PR's backend admission, which the PR shipped together.) For FULL_DECODE_ONLY itself
the old and new tests give the same answer (its ``mixed_mode()`` is NONE); the behaviour changes only for
FULL_AND_PIECEWISE (and PIECEWISE, where no sizes exist anyway), so I read the description's "FULL_DECODE_ONLY
mode" as the decode-only full graphs that FULL_AND_PIECEWISE gives MRV2.
Mechanism: capture (largest first) plans, for each size ``n``, the FlashInfer decode wrapper of batch size ``n``
(``use_cudagraph``: a pure decode batch), whose ``plan`` copies its indptr/last-page-length into the builder's
persistent buffers; the captured forward records that wrapper's decode kernel over ``n`` query rows, one request per
row. A prefill step of 4 tokens, or a mixed step of 1 decode + 3 prefill tokens, gets ``size = 4`` from the bug's
``get_cudagraph_size``; ``prepare_inputs`` builds the step's real metadata (a prefill wrapper plan, a non-graph decode
wrapper plan, ``paged_kv_indptr.gpu[:num_reqs + 1]`` and the page indices) and ``run(4)`` replays the decode kernel:
token ``i`` is "request ``i``", reading ``paged_kv_indptr[i:i+2]`` (stale past ``num_reqs``) and
``paged_kv_last_page_len[i]`` (left by the last graph-wrapper plan: this step plans none), so rows attend to the wrong
pages and lengths; an eager step takes the prefill branch with the causal plan.
Doctor: warmup-divergence, at get_cudagraph_size. Capture decided the attention branch and plan (the decode wrapper of
batch size ``n``, every row a decode request) and the replay of a mixed step reuses them while the eager step decides
otherwise (a prefill wrapper for the prompt tokens, a non-graph decode wrapper for the rest); the stale indptr and
last-page-length entries the replay reads are a consequence. The decision to replay a decode-only graph for a batch
with prefill is made in ``get_cudagraph_size``, the function the fix changes (``CudaGraphManager.get_cudagraph_size``
and ``get_cudagraph_and_dp_padding`` only pass its answer on).
Fix (upstream): ``get_cudagraph_size`` returns None when the mode has no full graphs, and for a batch with any request
of more than one token unless ``cudagraph_mode.mixed_mode() == CUDAGraphMode.FULL``: such steps run eagerly.
Modelled: ``CUDAGraphMode`` (as upstream), ``CudaGraphManager`` (``__init__``, ``needs_capture``,
``get_cudagraph_size``, ``capture_graph``, ``capture``, ``run``), ``get_cudagraph_sizes``, ``get_cudagraph_size``,
``capture_graphs``, ``prepare_inputs_to_capture``, ``InputBuffers``, ``BlockTables`` (``append_block_ids``,
``gather_block_tables``, ``compute_slot_mappings``), ``build_attn_metadata``, ``CommonAttentionMetadata``,
``split_decodes_and_prefills`` (as upstream), ``CpuGpuBuffer``, ``FlashInferMetadataBuilder`` (``__init__``,
``_get_workspace_buffer``, ``_get_prefill_wrapper``, ``_get_decode_wrapper``, ``_compute_flashinfer_kv_metadata``,
``build``), ``FIPrefill``/``FIDecode``/``FlashInferMetadata``, ``fast_plan_decode``, ``FlashInferImpl.forward``,
``set_forward_context``/``get_forward_context``, ``GPUModelRunner`` (``capture_model``, ``update_states``,
``prepare_inputs``, ``get_cudagraph_and_dp_padding`` for one DP rank, ``execute_model``, ``sample_tokens``).
Stand-ins: FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper``/``BatchPrefillWithPagedKVCacheWrapper`` are rebuilt:
``plan`` copies indptr/indices/last-page-lengths into the persistent buffers for a graph wrapper (fresh device copies
otherwise; the prefill plan expands per-row pages and causal lengths on the host), ``run`` is a fixed-shape gather of
each row's pages with a length mask (float64, one query row per decode request); ``reshape_and_cache_flash`` sends
PAD_SLOT_ID rows to a scratch block past the real ones instead of skipping them; the Triton kernels
(``_copy_page_indices_kernel``, ``_gather_block_tables_kernel``, ``_compute_slot_mappings_kernel``, the input
preparation kernels) are host loops writing the same buffers; request state lives on the host; the model is two
pre-norm attention+MLP layers of width 16 (2 heads of 8, learned positions instead of RoPE), greedy sampling; one
KV-cache group, no LoRA, spec decode, M-RoPE, DP, TRTLLM, cascade or DCP paths; warmup is the manager's one eager
forward per size; the graph pool is taken only when there is something to capture; ``capture_graphs`` without
``graph_capture``/tqdm; ``InputBatch`` keeps only the fields used here.
Workload: capture sizes [1, 2, 4], max 4 requests and 4 batched tokens, page size 4, max_model_len 8; request A
(prompt of 4, pages [1, 2]) and B (prompt of 3, pages [3, 4]); steps {A: 4} (prefill), {A: 1}, {A: 1, B: 3} (mixed),
{A: 1, B: 1}, {A: 1, B: 1}; no step is padded. Outputs: each step's logits and sampled tokens. Served: mode
FULL_AND_PIECEWISE; eager: mode NONE.
Measured: the check printed (each ``Outcome``'s ``summary()``; the check prints the whole ``Outcome``, whose
``variant``/``max_abs_error`` fields say the same)
  vllm_32348_mrv2_mixed_batch_replays_decode_captured_full_graph [bug] on cpu: misbehaves (max |graph - eager| = 15)
  vllm_32348_mrv2_mixed_batch_replays_decode_captured_full_graph [fix] on cpu: equals eager (max |graph - eager| = 0)
The bug replays a graph on every step (sizes 4, 1, 4, 2, 2): the first step's logits are already off by 2.2 and the
sampled tokens differ from then on; the fix runs steps 1 and 3 eagerly, replays sizes 1, 2, 2, and is exact. Both
variants together take about 5 s on the CPU, imports included. Ruff is not installed here; not run (imports checked
by hand: none unused).
"""
from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from workbench.engine import events, graph, graph_pool_handle, new_graph
from workbench.zoo.kit import compare, generator, remember_step, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/32348"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "get_cudagraph_size"
SYMPTOM = ("with Model Runner V2, FlashInfer and the default FULL_AND_PIECEWISE mode, prefill and mixed batches whose "
           "token count is a capture size replay the FULL graph captured for uniform decode batches: its FlashInfer "
           "decode kernel runs every token as a decode request on decode-plan buffers the step did not plan, so the "
           "logits are wrong")

DTYPE = torch.float64
VOCAB, HIDDEN, NUM_HEADS, HEAD_SIZE, FFN, NUM_LAYERS = 16, 16, 2, 8, 32, 2
BLOCK_SIZE, MAX_MODEL_LEN = 4, 8
MAX_NUM_REQS, MAX_NUM_BATCHED_TOKENS = 4, 4
MAX_NUM_BLOCKS_PER_REQ = -(-MAX_MODEL_LEN // BLOCK_SIZE)
NUM_GPU_BLOCKS = 1 + MAX_NUM_REQS * MAX_NUM_BLOCKS_PER_REQ     # block 0 is the null block
SCRATCH_BLOCK = NUM_GPU_BLOCKS                                 # (stand-in) where PAD_SLOT_ID rows are written
PAD_SLOT_ID = -1
CUDAGRAPH_CAPTURE_SIZES = [1, 2, 4]
_variant = "bug"


# --- vllm/config/compilation.py ----------------------------------------------------------------------------------

class CUDAGraphMode(enum.Enum):
    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = (FULL, NONE)
    FULL_AND_PIECEWISE = (FULL, PIECEWISE)

    def decode_mode(self) -> CUDAGraphMode:
        return CUDAGraphMode(self.value[0]) if self.separate_routine() else self

    def mixed_mode(self) -> CUDAGraphMode:
        return CUDAGraphMode(self.value[1]) if self.separate_routine() else self

    def max_cudagraph_mode(self) -> CUDAGraphMode:
        return CUDAGraphMode(max(self.value)) if self.separate_routine() else self

    def has_full_cudagraphs(self) -> bool:
        return self.max_cudagraph_mode() == CUDAGraphMode.FULL

    def separate_routine(self) -> bool:
        return isinstance(self.value, tuple)


# --- vllm/forward_context.py --------------------------------------------------------------------------------------

@dataclass
class ForwardContext:
    attn_metadata: dict
    num_tokens: int
    cudagraph_runtime_mode: CUDAGraphMode


_forward_context: ForwardContext | None = None


@contextlib.contextmanager
def set_forward_context(attn_metadata, num_tokens: int, cudagraph_runtime_mode=CUDAGraphMode.NONE):
    global _forward_context
    prev = _forward_context
    _forward_context = ForwardContext(attn_metadata, num_tokens, cudagraph_runtime_mode)
    try:
        yield
    finally:
        _forward_context = prev


def get_forward_context() -> ForwardContext:
    assert _forward_context is not None, "Forward context is not set."
    return _forward_context


# --- vllm/v1/utils.py, vllm/v1/attention/backends/utils.py --------------------------------------------------------

class CpuGpuBuffer:
    def __init__(self, *size: int, dtype: torch.dtype, device):
        self.cpu = torch.zeros(*size, dtype=dtype)
        self.np = self.cpu.numpy()
        self.gpu = torch.zeros(*size, dtype=dtype, device=device)


@dataclass
class CommonAttentionMetadata:
    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    max_seq_len: int
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool = True


def split_decodes_and_prefills(common_attn_metadata: CommonAttentionMetadata, decode_threshold: int = 1,
                               require_uniform: bool = False) -> tuple[int, int, int, int]:
    max_query_len = common_attn_metadata.max_query_len
    num_reqs = common_attn_metadata.num_reqs
    num_tokens = common_attn_metadata.num_actual_tokens
    query_start_loc = common_attn_metadata.query_start_loc_cpu

    if max_query_len <= decode_threshold and (not require_uniform or decode_threshold <= 1):
        return num_reqs, 0, num_tokens, 0

    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    if query_lens[0].item() > decode_threshold:
        # first request is not decode, so no decode requests
        return 0, num_reqs, 0, num_tokens

    if require_uniform:
        if torch.all((query_lens == query_lens[0]) | (query_lens == 0)):
            assert num_reqs * query_lens[0] == num_tokens, "tokens not padded correctly"
            return num_reqs, 0, num_tokens, 0  # all decodes
        is_prefill = query_lens != query_lens[0]
    else:
        is_prefill = query_lens > decode_threshold

    if not torch.any(is_prefill):
        return num_reqs, 0, num_tokens, 0

    first_prefill = is_prefill.int().argmax(dim=-1).item()
    assert torch.all(query_lens[:first_prefill] <= decode_threshold)
    num_decodes = first_prefill
    num_prefills = num_reqs - num_decodes
    num_decode_tokens = query_start_loc[first_prefill].item()
    num_prefill_tokens = num_tokens - num_decode_tokens
    return num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens


# --- flashinfer (stand-ins for the wrappers and their kernels) -----------------------------------------------------

def _paged_attention(q, kv_cache, page_start, num_pages, kv_len, page_indices, sm_scale):
    """Each query row attends to the first ``kv_len`` tokens of its pages ``page_indices[page_start:+num_pages]``.
    Fixed shapes and no host reads, as a kernel: the values come from whatever the buffers hold at launch."""
    n = q.shape[0]
    j = torch.arange(MAX_NUM_BLOCKS_PER_REQ, device=q.device)
    where = (page_start.long().unsqueeze(1) + j).clamp(0, page_indices.shape[0] - 1)
    pages = page_indices[where].long().clamp(0, SCRATCH_BLOCK)                  # [n, pages]
    k = kv_cache[pages, 0].reshape(n, MAX_NUM_BLOCKS_PER_REQ * BLOCK_SIZE, NUM_HEADS, HEAD_SIZE)
    v = kv_cache[pages, 1].reshape(n, MAX_NUM_BLOCKS_PER_REQ * BLOCK_SIZE, NUM_HEADS, HEAD_SIZE)
    t = torch.arange(MAX_NUM_BLOCKS_PER_REQ * BLOCK_SIZE, device=q.device)
    in_pages = (t // BLOCK_SIZE).unsqueeze(0) < num_pages.long().unsqueeze(1)
    valid = (t.unsqueeze(0) < kv_len.long().unsqueeze(1)) & in_pages               # [n, tokens]
    scores = (q.unsqueeze(1) * k).sum(-1) * sm_scale                            # [n, tokens, heads]
    scores = scores.masked_fill(~valid.unsqueeze(-1), -1e30)
    p = torch.softmax(scores, dim=1).masked_fill(~valid.unsqueeze(-1), 0.0)
    return (p.unsqueeze(-1) * v.masked_fill(~valid[..., None, None], 0.0)).sum(1)


class BatchDecodeWithPagedKVCacheWrapper:
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, paged_kv_indptr_buffer=None,
                 paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None, use_tensor_cores=False):
        self._float_workspace_buffer = float_workspace_buffer
        self._use_cuda_graph = use_cuda_graph
        self._fixed_batch_size = len(paged_kv_last_page_len_buffer) if use_cuda_graph else 0
        self._paged_kv_indptr_buf = paged_kv_indptr_buffer
        self._paged_kv_indices_buf = paged_kv_indices_buffer
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buffer
        self._batch_size = 0
        self._sm_scale = None

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             pos_encoding_mode="NONE", sm_scale=None, non_blocking=True):
        batch_size = len(last_page_len)
        if self.is_cuda_graph_enabled:
            if batch_size != self._fixed_batch_size:
                raise ValueError(f"The batch size should be fixed in cudagraph mode, the runtime batch size "
                                 f"{batch_size} mismatches the batch size set during initialization "
                                 f"{self._fixed_batch_size}")
            self._paged_kv_indptr_buf.copy_(indptr, non_blocking=non_blocking)
            self._paged_kv_indices_buf[: len(indices)].copy_(indices, non_blocking=non_blocking)
            self._paged_kv_last_page_len_buf.copy_(last_page_len, non_blocking=non_blocking)
        else:
            self._paged_kv_indptr_buf = indptr.to(indices.device, non_blocking=non_blocking)
            self._paged_kv_indices_buf = indices
            self._paged_kv_last_page_len_buf = last_page_len.to(indices.device, non_blocking=non_blocking)
        self._batch_size = batch_size
        self._sm_scale = sm_scale

    def run(self, q, paged_kv_cache, out=None):
        bs = self._batch_size                                   # one query row per request
        indptr = self._paged_kv_indptr_buf[: bs + 1]
        num_pages = indptr[1:] - indptr[:-1]
        kv_len = (num_pages - 1) * BLOCK_SIZE + self._paged_kv_last_page_len_buf[:bs]
        o = _paged_attention(q[:bs], paged_kv_cache, indptr[:-1], num_pages, kv_len, self._paged_kv_indices_buf,
                             self._sm_scale)
        out.copy_(o)
        return out


class BatchPrefillWithPagedKVCacheWrapper:
    def __init__(self, float_workspace_buffer, kv_layout="NHD"):
        self._float_workspace_buffer = float_workspace_buffer

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
             head_dim_qk, page_size, causal=True, sm_scale=None):
        assert causal
        qo, kv_indptr, last = qo_indptr.tolist(), paged_kv_indptr.tolist(), paged_kv_last_page_len.tolist()
        starts, pages, lens = [], [], []
        for r in range(len(qo) - 1):
            num_q = qo[r + 1] - qo[r]
            num_kv_pages = kv_indptr[r + 1] - kv_indptr[r]
            kv_len = (num_kv_pages - 1) * page_size + last[r]
            for i in range(num_q):                              # causal: query i sees kv up to its own token
                starts.append(kv_indptr[r])
                pages.append(num_kv_pages)
                lens.append(kv_len - (num_q - 1 - i))
        device = paged_kv_indices.device
        self._page_start, self._num_pages, self._kv_len = (torch.tensor(x, dtype=torch.int32).to(device)
                                                           for x in (starts, pages, lens))
        self._paged_kv_indices = paged_kv_indices
        self._causal, self._sm_scale = causal, sm_scale

    def run(self, q, paged_kv_cache, out=None):
        out.copy_(_paged_attention(q, paged_kv_cache, self._page_start, self._num_pages, self._kv_len,
                                   self._paged_kv_indices, self._sm_scale))
        return out


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping):
    """Writes the first ``slot_mapping.shape[0]`` tokens at their slots (PAD_SLOT_ID rows: the scratch block)."""
    n = slot_mapping.shape[0]
    slot = slot_mapping.masked_fill(slot_mapping < 0, SCRATCH_BLOCK * BLOCK_SIZE)
    block_idx, block_offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    key_cache.index_put_((block_idx, block_offset), key[:n])
    value_cache.index_put_((block_idx, block_offset), value[:n])


# --- vllm/v1/attention/backends/flashinfer.py ----------------------------------------------------------------------

@dataclass
class FIPrefill:
    wrapper: BatchPrefillWithPagedKVCacheWrapper


@dataclass
class FIDecode:
    wrapper: BatchDecodeWithPagedKVCacheWrapper


@dataclass
class FlashInferMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    prefill: FIPrefill | None = None
    decode: FIDecode | None = None


def fast_plan_decode(self, indptr_cpu, indices, last_page_len_cpu, seq_lens_cpu, num_qo_heads, num_kv_heads,
                     head_dim, page_size, pos_encoding_mode="NONE", sm_scale=None, non_blocking=True):
    """A faster version of BatchDecodeWithPagedKVCacheWrapper::plan used for cudagraph capture/replay, while the no
    cudagraph version turns back to the original plan."""
    # Warm up with the original plan if it is first call, and always run the original plan if we run for dynamic
    # shape. For fixed shape (cudagraph), this warm up is to generate the _cached_module for the decode wrapper.
    if not self.is_cuda_graph_enabled or getattr(self, "vllm_first_call", True):
        self.plan(indptr_cpu, indices, last_page_len_cpu, num_qo_heads, num_kv_heads, head_dim, page_size,
                  pos_encoding_mode, sm_scale=sm_scale, non_blocking=non_blocking)
        self.vllm_first_call = False
        return
    assert self.is_cuda_graph_enabled, "Should be cudagraph only here"
    batch_size = len(last_page_len_cpu)
    if batch_size != self._fixed_batch_size:
        raise ValueError(f"The batch size should be fixed in cudagraph mode, the runtime batch size {batch_size} "
                         f"mismatches the batch size set during initialization {self._fixed_batch_size}")
    # host-to-device copy for the indptr buffer
    self._paged_kv_indptr_buf.copy_(indptr_cpu, non_blocking=True)
    # host-to-device copy for the last_page_len buffer
    self._paged_kv_last_page_len_buf.copy_(last_page_len_cpu, non_blocking=True)
    self._batch_size = batch_size
    self._sm_scale = sm_scale


class FlashInferMetadataBuilder:
    reorder_batch_threshold: int = 1

    def __init__(self, cudagraph_mode: CUDAGraphMode, device):
        self.device = device
        self._workspace_buffer = None
        self._prefill_wrapper = None                    # Wrapper for prefill/append
        self._decode_wrapper = None                     # Wrapper for decode (general shape)
        max_num_pages = MAX_NUM_REQS * MAX_NUM_BLOCKS_PER_REQ
        self.enable_cuda_graph = cudagraph_mode.decode_mode() == CUDAGraphMode.FULL
        if self.enable_cuda_graph:
            # For full cudagraph capture, one `decode_wrapper` for each batch size is needed for FlashInfer.
            self._decode_wrappers_cudagraph: dict[int, BatchDecodeWithPagedKVCacheWrapper] = {}
            self._decode_cudagraph_max_bs = min(MAX_NUM_REQS, max(CUDAGRAPH_CAPTURE_SIZES))
        self.num_qo_heads = self.num_kv_heads = NUM_HEADS
        self.head_dim, self.page_size = HEAD_SIZE, BLOCK_SIZE
        self.sm_scale = HEAD_SIZE ** -0.5
        # Preparing persistent buffers
        self.paged_kv_indptr = CpuGpuBuffer(MAX_NUM_REQS + 1, dtype=torch.int32, device=device)
        self.paged_kv_indptr_cpu_buffer = torch.zeros_like(self.paged_kv_indptr.cpu)
        self.paged_kv_indices = CpuGpuBuffer(max_num_pages, dtype=torch.int32, device=device)
        self.paged_kv_last_page_len = CpuGpuBuffer(MAX_NUM_REQS, dtype=torch.int32, device=device)

    def _get_workspace_buffer(self):
        if self._workspace_buffer is None:
            self._workspace_buffer = torch.zeros(128, dtype=torch.uint8, device=self.device)
        return self._workspace_buffer

    def _get_prefill_wrapper(self) -> BatchPrefillWithPagedKVCacheWrapper:
        if self._prefill_wrapper is None:
            self._prefill_wrapper = BatchPrefillWithPagedKVCacheWrapper(self._get_workspace_buffer(), "NHD")
        return self._prefill_wrapper

    def _get_decode_wrapper(self, batch_size: int, use_cudagraph: bool = False):
        if use_cudagraph:
            decode_wrapper = self._decode_wrappers_cudagraph.get(batch_size, None)
        else:
            decode_wrapper = self._decode_wrapper

        if decode_wrapper is None:
            if use_cudagraph:
                paged_kv_indptr = self.paged_kv_indptr.gpu[: batch_size + 1]
                paged_kv_indices = self.paged_kv_indices.gpu
                paged_kv_last_page_len = self.paged_kv_last_page_len.gpu[:batch_size]
            else:
                paged_kv_indptr = paged_kv_indices = paged_kv_last_page_len = None
            decode_wrapper = BatchDecodeWithPagedKVCacheWrapper(
                self._get_workspace_buffer(), "NHD", use_cuda_graph=use_cudagraph,
                paged_kv_indptr_buffer=paged_kv_indptr, paged_kv_indices_buffer=paged_kv_indices,
                paged_kv_last_page_len_buffer=paged_kv_last_page_len, use_tensor_cores=True)
            # save the decode wrapper
            if use_cudagraph:
                self._decode_wrappers_cudagraph[batch_size] = decode_wrapper
            else:
                self._decode_wrapper = decode_wrapper
        return decode_wrapper

    def _compute_flashinfer_kv_metadata(self, num_blocks_np, seq_lens_np, block_table_tensor, num_reqs, page_size):
        # write self.paged_kv_indptr_cpu inplace (0-index is always 0)
        np.cumsum(num_blocks_np, dtype=np.int32, out=self.paged_kv_indptr.np[1: num_reqs + 1])
        self.paged_kv_indptr_cpu_buffer[: num_reqs + 1] = self.paged_kv_indptr.cpu[: num_reqs + 1]
        paged_kv_indptr = self.paged_kv_indptr.gpu[: num_reqs + 1]
        paged_kv_indptr.copy_(self.paged_kv_indptr_cpu_buffer[: num_reqs + 1], non_blocking=True)

        # write self.paged_kv_indices inplace (_copy_page_indices_kernel)
        num_actual_pages = int(self.paged_kv_indptr.np[num_reqs])
        paged_kv_indices = self.paged_kv_indices.gpu[:num_actual_pages]
        for r in range(num_reqs):
            start, end = int(self.paged_kv_indptr.np[r]), int(self.paged_kv_indptr.np[r + 1])
            paged_kv_indices[start:end] = block_table_tensor[r, : end - start]

        # write self.paged_kv_last_page_len_cpu inplace
        paged_kv_last_page_len_np = seq_lens_np % page_size
        self.paged_kv_last_page_len.np[:num_reqs] = np.where(
            (paged_kv_last_page_len_np == 0) & (seq_lens_np != 0), page_size, paged_kv_last_page_len_np)
        return paged_kv_indices

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata) -> FlashInferMetadata:
        num_reqs = common_attn_metadata.num_reqs
        num_actual_tokens = common_attn_metadata.num_actual_tokens
        num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = split_decodes_and_prefills(
            common_attn_metadata, decode_threshold=self.reorder_batch_threshold, require_uniform=True)
        page_size = self.page_size
        block_table_tensor = common_attn_metadata.block_table_tensor
        qo_indptr_cpu = common_attn_metadata.query_start_loc_cpu

        attn_metadata = FlashInferMetadata(
            num_actual_tokens=num_actual_tokens, slot_mapping=common_attn_metadata.slot_mapping,
            num_decodes=num_decodes, num_decode_tokens=num_decode_tokens, num_prefills=num_prefills,
            num_prefill_tokens=num_prefill_tokens)
        seq_lens_cpu = common_attn_metadata.seq_lens.cpu()
        seq_lens_np = seq_lens_cpu.numpy()
        num_blocks_np = (seq_lens_np + (page_size - 1)) // page_size
        paged_kv_indices = self._compute_flashinfer_kv_metadata(num_blocks_np, seq_lens_np, block_table_tensor,
                                                                num_reqs, page_size)
        ## PREFILL PATHWAY
        if num_prefills > 0:
            prefill_start = num_decodes
            qo_indptr_prefill_cpu = qo_indptr_cpu[prefill_start:] - qo_indptr_cpu[prefill_start]
            assert qo_indptr_prefill_cpu.shape[0] == num_prefills + 1
            prefill_wrapper = self._get_prefill_wrapper()
            paged_kv_last_page_len_prefill_cpu = self.paged_kv_last_page_len.cpu[prefill_start:num_reqs]
            paged_kv_indptr_prefill_cpu = self.paged_kv_indptr.cpu[prefill_start: num_reqs + 1]
            prefill_wrapper.plan(qo_indptr_prefill_cpu, paged_kv_indptr_prefill_cpu, paged_kv_indices,
                                 paged_kv_last_page_len_prefill_cpu, self.num_qo_heads, self.num_kv_heads,
                                 self.head_dim, self.page_size, causal=True, sm_scale=self.sm_scale)
            attn_metadata.prefill = FIPrefill(wrapper=prefill_wrapper)
        ## DECODE PATHWAY
        if num_decodes > 0:
            pure_decode = num_prefills == 0
            use_cudagraph = (self.enable_cuda_graph and pure_decode
                             and num_decode_tokens <= self._decode_cudagraph_max_bs)
            num_input_tokens = num_decode_tokens
            decode_wrapper = self._get_decode_wrapper(num_input_tokens, use_cudagraph)
            # Use the persistent buffer with padding length, instead of the same address but chunked version in
            # atten_metadata when using cudagraph.
            fast_plan_decode(decode_wrapper, self.paged_kv_indptr.cpu[: num_input_tokens + 1], paged_kv_indices,
                             self.paged_kv_last_page_len.cpu[:num_input_tokens], seq_lens_cpu[:num_input_tokens],
                             self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size,
                             pos_encoding_mode="NONE", sm_scale=self.sm_scale)
            attn_metadata.decode = FIDecode(wrapper=decode_wrapper)
        return attn_metadata


class FlashInferImpl:
    def __init__(self, num_heads: int, head_size: int, scale: float):
        self.num_heads, self.head_size, self.scale = num_heads, head_size, scale

    def forward(self, layer, query, key, value, kv_cache, attn_metadata: FlashInferMetadata, output=None):
        assert output is not None, "Output tensor must be provided."
        num_actual_tokens = attn_metadata.num_actual_tokens
        # Reshape the input keys and values and store them in the cache (slot_mapping's shape gives the tokens).
        reshape_and_cache_flash(key, value, kv_cache[:, 0], kv_cache[:, 1], attn_metadata.slot_mapping)

        # Inputs and outputs may be padded for CUDA graphs
        query = query[:num_actual_tokens]
        output_padded = output
        output = output[:num_actual_tokens]
        num_decode_tokens = attn_metadata.num_decode_tokens
        num_prefill_tokens = attn_metadata.num_prefill_tokens
        # Regular attention (common case). Decodes are at the front and prefills are at the back.
        if num_prefill_tokens > 0:
            prefill_query = query[num_decode_tokens:]
            assert prefill_query.shape[0] == num_prefill_tokens
            prefill_wrapper = attn_metadata.prefill.wrapper
            assert prefill_wrapper._causal
            prefill_wrapper.run(prefill_query, kv_cache, out=output[num_decode_tokens:])
        if num_decode_tokens > 0:
            decode_query = query[:num_decode_tokens]
            assert decode_query.shape[0] == num_decode_tokens
            decode_wrapper = attn_metadata.decode.wrapper
            assert decode_wrapper._sm_scale == self.scale
            decode_wrapper.run(decode_query, kv_cache, out=output[:num_decode_tokens])
        return output_padded


# --- the model (a stand-in for a Llama-style decoder) --------------------------------------------------------------

def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` as a product and a sum: each row's result does not depend on how many rows the batch has."""
    return (x.unsqueeze(-1) * w).sum(-2)


def rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


class Attention:
    def __init__(self, layer_name: str):
        self.layer_name = layer_name
        self.impl = FlashInferImpl(NUM_HEADS, HEAD_SIZE, HEAD_SIZE ** -0.5)
        self.kv_cache: torch.Tensor | None = None

    def forward(self, query, key, value):
        attn_metadata = get_forward_context().attn_metadata[self.layer_name]
        output = torch.zeros_like(query)
        return self.impl.forward(self, query, key, value, self.kv_cache, attn_metadata, output=output)


class ToyForCausalLM:
    def __init__(self, device):
        gen = generator(32348)

        def w(*shape, scale):
            return (torch.randn(*shape, generator=gen, dtype=DTYPE) * scale).to(device)
        self.embed_tokens, self.embed_positions = w(VOCAB, HIDDEN, scale=1.0), w(MAX_MODEL_LEN, HIDDEN, scale=0.5)
        self.layers = [{"input_layernorm": 1.0 + w(HIDDEN, scale=0.1),
                        "qkv_proj": w(HIDDEN, 3 * NUM_HEADS * HEAD_SIZE, scale=HIDDEN ** -0.5),
                        "attn": Attention(f"model.layers.{i}.self_attn.attn"),
                        "o_proj": w(NUM_HEADS * HEAD_SIZE, HIDDEN, scale=(NUM_HEADS * HEAD_SIZE) ** -0.5),
                        "post_attention_layernorm": 1.0 + w(HIDDEN, scale=0.1),
                        "up_proj": w(HIDDEN, FFN, scale=HIDDEN ** -0.5), "down_proj": w(FFN, HIDDEN, scale=FFN ** -0.5)}
                       for i in range(NUM_LAYERS)]
        self.norm = 1.0 + w(HIDDEN, scale=0.1)
        self.lm_head = w(HIDDEN, VOCAB, scale=2.0 * HIDDEN ** -0.5)

    def __call__(self, input_ids, positions):
        h = self.embed_tokens[input_ids.long()] + self.embed_positions[positions.long()]
        for layer in self.layers:
            qkv = linear(rms_norm(h, layer["input_layernorm"]), layer["qkv_proj"])
            q, k, v = (x.reshape(-1, NUM_HEADS, HEAD_SIZE) for x in qkv.chunk(3, dim=-1))
            attn_output = layer["attn"].forward(q, k, v)
            h = h + linear(attn_output.reshape(-1, NUM_HEADS * HEAD_SIZE), layer["o_proj"])
            x = rms_norm(h, layer["post_attention_layernorm"])
            h = h + linear(torch.nn.functional.silu(linear(x, layer["up_proj"])), layer["down_proj"])
        return h

    def compute_logits(self, hidden_states):
        return linear(rms_norm(hidden_states, self.norm), self.lm_head)


# --- vllm/v1/worker/gpu/input_batch.py, block_table.py, attn_utils.py ---------------------------------------------

class InputBuffers:
    def __init__(self, max_num_reqs: int, max_num_tokens: int, device):
        self.input_ids = torch.zeros(max_num_tokens, dtype=torch.int32, device=device)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        self.query_start_loc = torch.zeros(max_num_reqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)


class BlockTables:
    def __init__(self, block_sizes: list[int], max_num_reqs: int, max_num_batched_tokens: int, max_model_len: int,
                 device):
        self.block_sizes = block_sizes
        self.max_num_batched_tokens = max_num_batched_tokens
        max_num_blocks = -(-max_model_len // block_sizes[0])
        # num_kv_cache_groups x [max_num_reqs, max_num_blocks] (indexed by request state)
        self.block_tables = [torch.zeros(max_num_reqs, max_num_blocks, dtype=torch.int32, device=device)]
        self.block_tables_np = [np.zeros((max_num_reqs, max_num_blocks), dtype=np.int32)]
        self.num_blocks = np.zeros((1, max_num_reqs), dtype=np.int32)
        # Block tables used for model's forward pass (indexed by batch position).
        self.input_block_tables = [torch.zeros_like(b) for b in self.block_tables]
        self.slot_mappings = torch.zeros(1, max_num_batched_tokens, dtype=torch.int64, device=device)

    def append_block_ids(self, req_index: int, new_block_ids: tuple[list[int], ...], overwrite: bool) -> None:
        for i, block_ids in enumerate(new_block_ids):
            start = 0 if overwrite else int(self.num_blocks[i, req_index])
            self.block_tables_np[i][req_index, start: start + len(block_ids)] = block_ids
            self.block_tables[i][req_index].copy_(torch.from_numpy(self.block_tables_np[i][req_index]))
            self.num_blocks[i, req_index] = start + len(block_ids)

    def gather_block_tables(self, idx_mapping_np: np.ndarray) -> tuple[torch.Tensor, ...]:
        num_reqs = len(idx_mapping_np)
        for i, block_table in enumerate(self.block_tables):          # _gather_block_tables_kernel
            for batch_idx, req_idx in enumerate(idx_mapping_np):
                n = int(self.num_blocks[i, req_idx])
                self.input_block_tables[i][batch_idx, :n] = block_table[req_idx, :n]
        return tuple(block_table[:num_reqs] for block_table in self.input_block_tables)

    def compute_slot_mappings(self, idx_mapping_np, query_start_loc_np, positions_np) -> torch.Tensor:
        num_tokens = int(query_start_loc_np[-1])
        slots = np.full(self.max_num_batched_tokens, PAD_SLOT_ID, dtype=np.int64)   # Pad remaining slots to -1.
        for batch_idx, req_idx in enumerate(idx_mapping_np):                     # _compute_slot_mappings_kernel
            for t in range(query_start_loc_np[batch_idx], query_start_loc_np[batch_idx + 1]):
                pos = positions_np[t]
                block_number = self.block_tables_np[0][req_idx, pos // self.block_sizes[0]]
                slots[t] = block_number * self.block_sizes[0] + pos % self.block_sizes[0]
        self.slot_mappings[0].copy_(torch.from_numpy(slots))
        return self.slot_mappings[:, :num_tokens]


def build_attn_metadata(attn_metadata_builders, layer_names, num_reqs, num_tokens, query_start_loc_gpu,
                        query_start_loc_cpu, seq_lens, max_seq_len, block_tables, slot_mappings) -> dict:
    max_query_len = int(query_start_loc_cpu.max())
    seq_lens = seq_lens[:num_reqs]
    attn_metadata: dict = {}
    for i, attn_metadata_builder in enumerate(attn_metadata_builders):
        common_attn_metadata = CommonAttentionMetadata(
            query_start_loc=query_start_loc_gpu, query_start_loc_cpu=query_start_loc_cpu, seq_lens=seq_lens,
            max_seq_len=max_seq_len, num_reqs=num_reqs, num_actual_tokens=num_tokens, max_query_len=max_query_len,
            block_table_tensor=block_tables[i], slot_mapping=slot_mappings[i], causal=True)
        metadata = attn_metadata_builder.build(common_prefix_len=0, common_attn_metadata=common_attn_metadata)
        for layer_name in layer_names:
            attn_metadata[layer_name] = metadata
    return attn_metadata


# --- vllm/v1/worker/gpu/cudagraph_utils.py -----------------------------------------------------------------------

class CudaGraphManager:
    def __init__(self, cudagraph_mode: CUDAGraphMode, capture_sizes: list[int], device):
        self.device = device
        self.max_model_len = MAX_MODEL_LEN
        self.max_num_reqs = MAX_NUM_REQS
        self.max_num_tokens = MAX_NUM_BATCHED_TOKENS
        self.cudagraph_mode = cudagraph_mode
        self.cudagraph_sizes = get_cudagraph_sizes(capture_sizes, self.max_num_reqs, self.max_num_tokens,
                                                   self.cudagraph_mode)
        self.graphs: dict = {}
        self.outputs: dict = {}
        self.pool = graph_pool_handle(device) if self.cudagraph_sizes else None
        self.hidden_states: torch.Tensor | None = None

    def needs_capture(self) -> bool:
        return len(self.cudagraph_sizes) > 0

    def get_cudagraph_size(self, scheduler_output, num_tokens_after_padding: int) -> int | None:
        return get_cudagraph_size(num_tokens_after_padding, scheduler_output.num_scheduled_tokens.values(),
                                  self.cudagraph_sizes, self.cudagraph_mode)

    def capture_graph(self, num_tokens: int, model, input_buffers: InputBuffers, block_tables: BlockTables,
                      attn_metadata_builders, layer_names) -> None:
        num_reqs = min(num_tokens, self.max_num_reqs)
        input_ids = input_buffers.input_ids[:num_tokens]
        positions = input_buffers.positions[:num_tokens]
        attn_metadata = prepare_inputs_to_capture(num_reqs, num_tokens, input_buffers, block_tables,
                                                  attn_metadata_builders, layer_names, self.max_model_len)

        # Warm up.
        with events.warmup(), set_forward_context(attn_metadata, num_tokens=num_tokens,
                                                  cudagraph_runtime_mode=CUDAGraphMode.NONE):
            hidden_states = model(input_ids=input_ids, positions=positions)
            if self.hidden_states is None:
                self.hidden_states = torch.empty_like(hidden_states)

        def forward_step():
            with set_forward_context(attn_metadata, num_tokens=num_tokens, cudagraph_runtime_mode=CUDAGraphMode.NONE):
                hidden_states = model(input_ids=input_ids, positions=positions)
                self.hidden_states[:num_tokens] = hidden_states
            return self.hidden_states[:num_tokens]

        # Capture the graph.
        assert num_tokens not in self.graphs
        g = new_graph(self.device)
        with graph(g, self.pool, name=f"MRV2 FULL graph, {num_tokens} tokens"):
            self.outputs[num_tokens] = forward_step()
        remember_step(g, forward_step)
        self.graphs[num_tokens] = g

    def capture(self, model, input_buffers: InputBuffers, block_tables: BlockTables, attn_metadata_builders,
                layer_names, kv_caches) -> None:
        builder = attn_metadata_builders[0]
        events.static_buffers("CudaGraphManager", {
            "input_buffers.input_ids": input_buffers.input_ids, "input_buffers.positions": input_buffers.positions,
            "block_tables.slot_mappings": block_tables.slot_mappings,
            "paged_kv_indptr.gpu": builder.paged_kv_indptr.gpu, "paged_kv_indices.gpu": builder.paged_kv_indices.gpu,
            "paged_kv_last_page_len.gpu": builder.paged_kv_last_page_len.gpu})
        events.persistent_state("CudaGraphManager", {f"kv_caches[{i}]": t for i, t in enumerate(kv_caches)})
        capture_graphs(self.cudagraph_sizes, self.device, self.capture_graph, model=model, input_buffers=input_buffers,
                       block_tables=block_tables, attn_metadata_builders=attn_metadata_builders,
                       layer_names=layer_names)

    def run(self, num_tokens: int) -> torch.Tensor:
        assert num_tokens in self.graphs
        return replay(self.graphs[num_tokens], self.outputs[num_tokens])


def get_cudagraph_sizes(capture_sizes: list[int] | None, max_num_reqs: int, max_num_tokens: int,
                        cudagraph_mode: CUDAGraphMode) -> dict[int, int]:
    if not cudagraph_mode.has_full_cudagraphs():
        return {}
    if not capture_sizes:
        return {}
    capture_sizes = sorted(capture_sizes)
    # Limit the capture sizes to the max number of requests or tokens.
    upper_bound = max_num_reqs if cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY else max_num_tokens
    capture_sizes = [x for x in capture_sizes if x <= upper_bound]
    if not capture_sizes:
        return {}
    cudagraph_sizes: dict[int, int] = {}
    for i in range(1, capture_sizes[-1] + 1):
        for x in capture_sizes:
            if i <= x:
                cudagraph_sizes[i] = x
                break
    return cudagraph_sizes


def get_cudagraph_size(num_tokens_after_dp_padding: int, num_tokens_per_request: Iterable[int],
                       cudagraph_sizes: dict[int, int], cudagraph_mode: CUDAGraphMode) -> int | None:
    if _variant == "fix":
        if not cudagraph_mode.has_full_cudagraphs():
            # No full CUDA graph is used.
            return None

    size = cudagraph_sizes.get(num_tokens_after_dp_padding)
    if size is None:
        # No CUDA graph for this size.
        return None
    if _variant == "bug":
        if cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY:
            all_decode = all(x == 1 for x in num_tokens_per_request)
            if not all_decode:
                # Prefill is included.
                return None
        return size

    is_mixed = any(x > 1 for x in num_tokens_per_request)
    if is_mixed and cudagraph_mode.mixed_mode() != CUDAGraphMode.FULL:
        # Prefill is included, and this mode doesn't use CUDA graph for it.
        return None
    return size


def capture_graphs(cudagraph_sizes: dict[int, int], device, capture_fn, **capture_kwargs) -> None:
    # Capture larger graphs first.
    sizes_to_capture = sorted(set(cudagraph_sizes.values()), reverse=True)
    for size in sizes_to_capture:
        capture_fn(size, **capture_kwargs)


def prepare_inputs_to_capture(num_reqs: int, num_tokens: int, input_buffers: InputBuffers, block_tables: BlockTables,
                              attn_metadata_builders, layer_names, max_model_len: int) -> dict:
    num_tokens_per_req = num_tokens // num_reqs
    query_start_loc_np = np.arange(num_reqs + 1, dtype=np.int32) * num_tokens_per_req
    query_start_loc_np[-1] = num_tokens
    query_start_loc_cpu = torch.from_numpy(query_start_loc_np)
    input_buffers.query_start_loc[: num_reqs + 1] = query_start_loc_cpu
    input_buffers.query_start_loc[num_reqs + 1:] = num_tokens
    query_start_loc = input_buffers.query_start_loc[: num_reqs + 1]

    # HACK(woosuk): For faster warmup, we set seq_lens (GPU) to num_tokens rather than max_model_len.
    input_buffers.seq_lens[:num_reqs] = num_tokens
    input_buffers.seq_lens[num_reqs:] = 0

    input_block_tables = [x[:num_reqs] for x in block_tables.input_block_tables]
    slot_mappings = block_tables.slot_mappings[:, :num_tokens]
    return build_attn_metadata(attn_metadata_builders, layer_names, num_reqs=num_reqs, num_tokens=num_tokens,
                               query_start_loc_gpu=query_start_loc, query_start_loc_cpu=query_start_loc_cpu,
                               seq_lens=input_buffers.seq_lens, max_seq_len=max_model_len,
                               block_tables=input_block_tables, slot_mappings=slot_mappings)


# --- vllm/v1/worker/gpu/model_runner.py ----------------------------------------------------------------------------

@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    block_ids: tuple[list[int], ...]


@dataclass
class SchedulerOutput:
    num_scheduled_tokens: dict[str, int]
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


@dataclass
class InputBatch:
    req_ids: list[str]
    num_reqs: int
    idx_mapping_np: np.ndarray
    num_scheduled_tokens: np.ndarray
    num_tokens: int
    num_tokens_after_padding: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: dict
    logits_indices: torch.Tensor


class RequestState:
    """(stand-in) the per-request state MRV2 keeps on the GPU, here on the host."""

    def __init__(self, max_num_reqs: int):
        self.req_id_to_index: dict[str, int] = {}
        self.free_indices = list(range(max_num_reqs))
        self.prefill_token_ids = np.zeros((max_num_reqs, MAX_MODEL_LEN), dtype=np.int32)
        self.prefill_len = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.last_sampled_tokens = np.zeros(max_num_reqs, dtype=np.int32)


class GPUModelRunner:
    def __init__(self, cudagraph_mode: CUDAGraphMode, device):
        self.device = device
        self.max_num_reqs, self.max_num_tokens, self.max_model_len = MAX_NUM_REQS, MAX_NUM_BATCHED_TOKENS, MAX_MODEL_LEN
        self.model = ToyForCausalLM(device)
        self.layer_names = [layer["attn"].layer_name for layer in self.model.layers]
        self.input_buffers = InputBuffers(self.max_num_reqs, self.max_num_tokens, device)
        self.req_states = RequestState(self.max_num_reqs)
        self.cudagraph_manager = CudaGraphManager(cudagraph_mode, CUDAGRAPH_CAPTURE_SIZES, device)
        self.initialize_kv_cache(cudagraph_mode)

    def initialize_kv_cache(self, cudagraph_mode: CUDAGraphMode) -> None:
        self.block_tables = BlockTables([BLOCK_SIZE], self.max_num_reqs, self.max_num_tokens, self.max_model_len,
                                        self.device)
        self.attn_metadata_builders = [FlashInferMetadataBuilder(cudagraph_mode, self.device)]
        # FlashInfer NHD layout: [num_blocks, 2, block_size, num_kv_heads, head_size] (+ the stand-in scratch block)
        self.kv_caches = [torch.zeros(NUM_GPU_BLOCKS + 1, 2, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE, dtype=DTYPE,
                                      device=self.device) for _ in range(NUM_LAYERS)]
        for layer, kv_cache in zip(self.model.layers, self.kv_caches):
            layer["attn"].kv_cache = kv_cache

    def capture_model(self) -> None:
        if not self.cudagraph_manager.needs_capture():
            return
        self.cudagraph_manager.capture(self.model, self.input_buffers, self.block_tables,
                                       self.attn_metadata_builders, self.layer_names, self.kv_caches)

    def update_states(self, scheduler_output: SchedulerOutput) -> None:
        for new_req_data in scheduler_output.scheduled_new_reqs:
            req_index = self.req_states.free_indices.pop(0)
            self.req_states.req_id_to_index[new_req_data.req_id] = req_index
            prompt = new_req_data.prompt_token_ids
            self.req_states.prefill_token_ids[req_index, : len(prompt)] = prompt
            self.req_states.prefill_len[req_index] = len(prompt)
            self.req_states.num_computed_tokens[req_index] = 0
            self.block_tables.append_block_ids(req_index, new_req_data.block_ids, overwrite=True)

    def prepare_inputs(self, scheduler_output: SchedulerOutput, num_tokens_after_padding: int) -> InputBatch:
        num_tokens = scheduler_output.total_num_scheduled_tokens
        assert num_tokens > 0
        num_reqs = len(scheduler_output.num_scheduled_tokens)
        # Decode first, then prefill.
        req_ids = sorted(scheduler_output.num_scheduled_tokens.keys(),
                         key=lambda k: scheduler_output.num_scheduled_tokens[k])
        num_scheduled_tokens = np.array([scheduler_output.num_scheduled_tokens[i] for i in req_ids], dtype=np.int32)
        idx_mapping_np = np.array([self.req_states.req_id_to_index[r] for r in req_ids], dtype=np.int32)

        # Block tables: num_kv_cache_groups x [num_reqs, max_num_blocks]
        block_tables = self.block_tables.gather_block_tables(idx_mapping_np)

        # Get query_start_loc.
        query_start_loc_np = np.empty(self.max_num_reqs + 1, dtype=np.int32)
        query_start_loc_np[0] = 0
        np.cumsum(num_scheduled_tokens, out=query_start_loc_np[1: num_reqs + 1])
        # Pad for full CUDA graph mode.
        query_start_loc_np[num_reqs + 1:] = num_tokens
        self.input_buffers.query_start_loc.copy_(torch.from_numpy(query_start_loc_np))
        query_start_loc_np = query_start_loc_np[: num_reqs + 1]
        query_start_loc_cpu = torch.from_numpy(query_start_loc_np)
        query_start_loc = self.input_buffers.query_start_loc[: num_reqs + 1]

        # prepare_prefill_inputs, prepare_pos_seq_lens, combine_sampled_and_draft_tokens (host stand-ins)
        rs = self.req_states
        input_ids_np = np.zeros(num_tokens, dtype=np.int32)
        positions_np = np.zeros(num_tokens, dtype=np.int64)
        seq_lens_np = np.zeros(self.max_num_reqs, dtype=np.int32)        # unused seq_lens are padded with 0
        logits_indices_np = np.zeros(num_reqs, dtype=np.int64)
        for batch_idx, req_idx in enumerate(idx_mapping_np):
            start, end = query_start_loc_np[batch_idx], query_start_loc_np[batch_idx + 1]
            computed = rs.num_computed_tokens[req_idx]
            positions_np[start:end] = computed + np.arange(end - start)
            seq_lens_np[batch_idx] = computed + end - start
            if seq_lens_np[batch_idx] <= rs.prefill_len[req_idx]:
                input_ids_np[start:end] = rs.prefill_token_ids[req_idx, computed: computed + end - start]
            else:                                         # Write the last sampled token ID to input_ids.
                input_ids_np[end - 1] = rs.last_sampled_tokens[req_idx]
            logits_indices_np[batch_idx] = end - 1
        self.input_buffers.input_ids[:num_tokens].copy_(torch.from_numpy(input_ids_np))
        self.input_buffers.positions[:num_tokens].copy_(torch.from_numpy(positions_np))
        self.input_buffers.seq_lens.copy_(torch.from_numpy(seq_lens_np))
        logits_indices = torch.from_numpy(logits_indices_np).to(self.device)

        # Compute slot mappings: [num_kv_cache_groups, num_tokens]
        slot_mappings = self.block_tables.compute_slot_mappings(idx_mapping_np, query_start_loc_np, positions_np)

        # Layer name -> attention metadata.
        attn_metadata = build_attn_metadata(
            self.attn_metadata_builders, self.layer_names, num_reqs=num_reqs, num_tokens=num_tokens,
            query_start_loc_gpu=query_start_loc, query_start_loc_cpu=query_start_loc_cpu,
            seq_lens=self.input_buffers.seq_lens, max_seq_len=self.max_model_len, block_tables=block_tables,
            slot_mappings=slot_mappings)
        return InputBatch(req_ids=req_ids, num_reqs=num_reqs, idx_mapping_np=idx_mapping_np,
                          num_scheduled_tokens=num_scheduled_tokens, num_tokens=num_tokens,
                          num_tokens_after_padding=num_tokens_after_padding,
                          input_ids=self.input_buffers.input_ids[:num_tokens_after_padding],
                          positions=self.input_buffers.positions[:num_tokens_after_padding],
                          attn_metadata=attn_metadata, logits_indices=logits_indices)

    def get_cudagraph_and_dp_padding(self, scheduler_output: SchedulerOutput) -> tuple[CUDAGraphMode, int, None]:
        total_num_scheduled_tokens = scheduler_output.total_num_scheduled_tokens
        # No DP. Only consider CUDA graphs.
        if total_num_scheduled_tokens == 0:
            return CUDAGraphMode.NONE, 0, None
        cudagraph_size = self.cudagraph_manager.get_cudagraph_size(scheduler_output, total_num_scheduled_tokens)
        if cudagraph_size is not None:
            # Use full CUDA graph.
            return CUDAGraphMode.FULL, cudagraph_size, None
        # Fall back to eager mode.
        # TODO(woosuk): Support piecewise CUDA graphs.
        return CUDAGraphMode.NONE, total_num_scheduled_tokens, None

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        cudagraph_mode, num_tokens_after_padding, _ = self.get_cudagraph_and_dp_padding(scheduler_output)
        self.update_states(scheduler_output)
        input_batch = self.prepare_inputs(scheduler_output, num_tokens_after_padding)
        if cudagraph_mode == CUDAGraphMode.FULL:
            # Run CUDA graph. The inputs are already copied to the CUDA graph input buffers.
            hidden_states = self.cudagraph_manager.run(input_batch.num_tokens_after_padding)
        else:
            # Run PyTorch model in eager mode.
            with set_forward_context(input_batch.attn_metadata, num_tokens=input_batch.num_tokens_after_padding,
                                     cudagraph_runtime_mode=cudagraph_mode):
                hidden_states = self.model(input_ids=input_batch.input_ids, positions=input_batch.positions)
        self.execute_model_state = hidden_states, input_batch

    def sample_tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, input_batch = self.execute_model_state
        logits = self.model.compute_logits(hidden_states[input_batch.logits_indices])
        sampled = logits.argmax(dim=-1)                     # (stand-in) greedy sampling
        rs = self.req_states
        for req_idx, n, token in zip(input_batch.idx_mapping_np, input_batch.num_scheduled_tokens, sampled.tolist()):
            rs.num_computed_tokens[req_idx] += n
            rs.last_sampled_tokens[req_idx] = token
        return logits, sampled


# --- the workload -----------------------------------------------------------------------------------------------

def _schedule() -> list[SchedulerOutput]:
    a = NewRequestData("A", [3, 7, 1, 12], ([1, 2],))
    b = NewRequestData("B", [5, 9, 2], ([3, 4],))
    return [SchedulerOutput({"A": 4}, [a]),               # prefill: 4 tokens, a capture size
            SchedulerOutput({"A": 1}),
            SchedulerOutput({"A": 1, "B": 3}, [b]),       # mixed: 1 decode + 3 prefill tokens
            SchedulerOutput({"A": 1, "B": 1}),
            SchedulerOutput({"A": 1, "B": 1})]


def serve(device: str, cudagraph_mode: CUDAGraphMode) -> list[torch.Tensor]:
    runner = GPUModelRunner(cudagraph_mode, device)
    runner.capture_model()
    outputs = []
    for scheduler_output in _schedule():
        runner.execute_model(scheduler_output)
        logits, sampled = runner.sample_tokens()
        outputs += [logits, sampled.to(DTYPE)]
    return outputs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    return compare(__name__.rsplit(".", 1)[-1], variant, device,
                   lambda: serve(device, CUDAGraphMode.FULL_AND_PIECEWISE),
                   lambda: serve(device, CUDAGraphMode.NONE))
