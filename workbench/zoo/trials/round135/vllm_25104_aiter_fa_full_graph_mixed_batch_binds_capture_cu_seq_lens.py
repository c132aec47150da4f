"""vLLM V1 on ROCm with the AITER flash-attention backend (``VLLM_ROCM_USE_AITER_MHA=1``) and ``cudagraph_mode=FULL``:
``AiterFlashAttentionMetadataBuilder`` declared ``AttentionCGSupport.ALWAYS``, so the runner captured FULL graphs for
mixed prefill-decode batches too. Such a graph, captured on a dummy batch with ``max_query_len = num_tokens``, contains
the prefill path (``vllm_layout_trans`` and ``flash_attn_varlen_func``) bound to the ``cu_seq_lens`` tensor that
``build`` allocated for the capture's dummy metadata, plus the capture's host ``num_actual_kv_tokens``. ``build``
allocates a fresh ``cu_seq_lens`` at every step; the capture's one is released when the dummy run returns, and every
replay of a mixed-batch graph gathers and attends over the key ranges of whatever that memory holds, not the step's.
Decode rows are recomputed by ``paged_attention_v1`` from the persistent buffers and come out right; prefill rows do
not. Eagerly each step builds its own ``cu_seq_lens`` and uses it at once. The fix declares
``UNIFORM_SINGLE_TOKEN_DECODE``: the runner switches to ``FULL_AND_PIECEWISE``, FULL graphs are captured only for
uniform single-token decode batches (no prefill path in them), and mixed batches run attention eagerly.

Upstream: https://github.com/vllm-project/vllm/pull/25104 ("[ROCm][AITER][Bugfix] Switch AITER to use
PIECEWISE_AND_FULL compilation", vllm-project/vllm, by Rohan Potdar (Rohan138), opened 2025-09-17, merged 2025-09-18;
read as commit bbdc0f2366997536207abc212fcdae7a1b688159 in a stored mirror of vLLM's history, local-inference-lab/vllm).
Read: the full diff (one line of ``vllm/v1/attention/backends/rocm_aiter_fa.py``: ``cudagraph_support =
AttentionCGSupport.ALWAYS`` becomes ``AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE``); the PR description and the
review bot's comment in the stored thread. At the fix's parent: ``rocm_aiter_fa.py`` whole
(``_vllm_layout_trans_kernel``, ``vllm_layout_trans``, ``flash_attn_varlen_func_impl``, ``AiterFlashAttentionMetadata``,
``AiterFlashAttentionMetadataBuilder.build_for_cudagraph_capture`` / ``build``, ``AiterFlashAttentionImpl.forward``);
``vllm/v1/worker/gpu_model_runner.py`` (``_prepare_inputs``: query_start_loc padded non-decreasing, ``seq_lens`` padded
with 0, ``slot_mapping`` tail filled with -1, metadata built every step; ``_get_num_input_tokens``; the dispatch in
``execute_model``; ``capture_model``, ``_capture_cudagraphs``, ``_dummy_run``: ``max_query_len = num_tokens`` for a
non-uniform capture, ``seq_lens = max_model_len``, ``query_start_loc`` not written; ``initialize_cudagraph_capture``);
``vllm/v1/cudagraph_dispatcher.py`` (whole); ``vllm/compilation/cuda_graph.py`` (``CUDAGraphWrapper.__call__``);
``CUDAGraphMode`` in ``vllm/config/compilation.py``; ``AttentionCGSupport`` in ``vllm/v1/attention/backends/utils.py``.
In ROCm/aiter at a8a3f86 (2025-09-18 02:26 UTC, before the merge, in a stored mirror; which aiter commit vLLM
pinned then was not checked):
``csrc/cpp_itfs/pa/pa_v1.cuh`` (the paged-attention kernel and its reduce return for a sequence whose
``cu_query_lens`` length is > 1) and ``csrc/cpp_itfs/pa/pa_v1.py`` (``max_num_partitions`` from ``max_context_len``).
Not read: the rest of the PR's conversation and its lm-eval results beyond the description; any issue; aiter's
``flash_attn_varlen_func`` kernel (modelled as causal varlen attention with flash-attn's bottom-right alignment);
``vllm/attention/layer.py`` at that revision (the output allocation is modelled as ``torch.empty``); the PIECEWISE
compile path. Not established: which of the graph's frozen inputs produced the accuracy issues the PR reports (the PR
names no mechanism: "does not work correctly with cudagraph_mode = FULL, since it calls two AITER kernels for prefill
(aiter.flash_attn_varlen_func) and decode (aiter.paged_attention_v1)"). The dangling ``cu_seq_lens`` modelled here is
my reading of the code at the fix's parent; the capture's ``num_actual_kv_tokens`` (``max_model_len`` per dummy
request, the size of the gathered K/V) is an upper bound and plausibly the OOM the PR mentions; the other frozen
host values (``max_seqlen_q``, ``max_seqlen_k = max_model_len``) are upper bounds as well. The review bot's claim that
``paged_attention_v1`` overwrites prefill rows is not what the aiter kernel read does (it returns for query_len > 1).
Symptom: "AiterFlashAttentionBackend (enabled through VLLM_ROCM_USE_AITER_MHA=1) does not work correctly with
cudagraph_mode = FULL"; with Llama 3.3 70B FP8 TP1 at concurrency 256 on MI355, the change "fixes both OOMs as well as
some accuracy issues we've been seeing" (the PR description).
Mechanism: with ``cudagraph_mode=FULL`` and a builder at ``ALWAYS``, ``initialize_cudagraph_capture`` keeps FULL for
mixed batches and the dispatcher sends every batch up to the largest capture size to a FULL graph. ``_dummy_run``
captures size N with ``min(N, max_num_seqs)`` dummy requests, ``max_query_len = N`` and ``seq_lens = max_model_len``;
``build`` allocates ``cu_seq_lens`` (a new tensor, not a persistent buffer) and reads ``num_actual_kv_tokens`` with
``.item()``; the forward's Python ``if max_seqlen_q > 1`` puts ``vllm_layout_trans`` and ``flash_attn_varlen_func`` in
the graph, reading that ``cu_seq_lens``. The metadata is dropped when the dummy run returns. At a replay, the runner's
persistent ``query_start_loc``, ``seq_lens``, block table and slot mapping hold the step; ``cu_seq_lens`` does not: the
layout kernel copies each prefill sequence's K/V over the stale range (with the capture's values, ``max_model_len``
positions, reaching block-table entries past the request's blocks: whatever the row holds there, zeros at first, i.e.
the null block) and the varlen kernel attends over it, so prefill rows read keys that are not the sequence's.
``paged_attention_v1`` then rewrites decode rows (query_len 1) from the persistent buffers, so a decode-only batch
is right.
Doctor: dangling-reference, at build. The captured prefill path reads ``cu_seq_lens``, memory the graph does not own
and whose owner (the capture's attention metadata) releases it when the dummy run returns; ``build`` is where that
per-step tensor is made, and the builder whose declared support the fix changes is the one that hands it to a FULL
graph (the fix changes a class attribute of that builder, not a function).
Fix (upstream): ``AiterFlashAttentionMetadataBuilder.cudagraph_support =
AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE``; ``initialize_cudagraph_capture`` then warns and sets
``cudagraph_mode = FULL_AND_PIECEWISE`` (attention is a splitting op), FULL graphs are captured for uniform decode
sizes only (``max_query_len = 1``: no prefill path, ``cu_seq_lens`` None), and mixed batches dispatch to PIECEWISE,
where attention and its metadata run eagerly every step.
Modelled: ``CUDAGraphMode`` (``decode_mode``, ``mixed_mode``, ``separate_routine``, ``has_full_cudagraphs``),
``AttentionCGSupport``, ``BatchDescriptor``, ``CommonAttentionMetadata``, ``set_forward_context``,
``AiterFlashAttentionMetadata``, ``AiterFlashAttentionMetadataBuilder`` (``cudagraph_support``,
``build_for_cudagraph_capture``, ``build``), ``vllm_layout_trans``, ``flash_attn_varlen_func_impl``,
``paged_attention_v1``, ``reshape_and_cache_flash``, ``AiterFlashAttentionImpl.forward``, ``Attention``,
``CudagraphDispatcher`` (``initialize_cudagraph_keys``, ``dispatch``), ``CUDAGraphWrapper.__call__``, ``GPUModelRunner``
(``initialize_cudagraph_capture``, ``capture_model``, ``_capture_cudagraphs``, ``_dummy_run``, ``_prepare_inputs``,
``_get_num_input_tokens``, ``execute_model``).
Stand-ins: a two-layer float64 decoder (token and position embeddings, fused qkv, attention, SiLU MLP, lm_head) with
linear layers as a broadcast multiply-sum (row results independent of the batch's row count); the Triton layout kernel,
aiter's varlen flash attention and paged attention as torch ops with static shapes over ``MAX_MODEL_LEN`` key
positions (one 256-token partition), masked stores landing in a trash row (``-1`` slots in a trash block of the KV
cache, masked K/V gathers in one extra row of ``k_values``); no GQA, no fp8, no sliding window, no cascade; one KV cache
group; requests keep their batch rows (no condense/reorder); greedy sampling; PIECEWISE is not modelled as graphs: a
PIECEWISE step (and the PIECEWISE "capture" dummy runs) run the model eagerly at the padded size, which is what the
attention between the pieces does upstream; the CPU graph is made with ``on_freed="reuse"``, so a replay reads the
released ``cu_seq_lens`` as the capture left it (on CUDA the caching allocator decides what a later allocation put
there); no DP, DBO, LoRA, spec decode or profile run.
Workload: capture sizes [1, 2, 4, 8], max_num_seqs 4, max_model_len 32, block size 16 (block 0 the null block). Step 0
prefills A (5 tokens, padded to 8), step 1 decodes A and prefills B (1 + 3 tokens, size 4), steps 2-4 decode A and B
(size 2). Outputs per step: the sampled rows' logits and the sampled token ids.
Measured: bug: misbehaves (max |graph - eager| = 22.9): step 0 (A's 5-token prefill replayed in the size-8 FULL
graph, whose ``cu_seq_lens`` still reads the capture's [0, 32, 64, 96, 128]) samples token 11 where eager samples 4,
and every later step follows from it. Fix: equals eager (max |graph - eager| = 0). A check run outside the program
(``build`` patched to copy ``cu_seq_lens`` into one persistent buffer, bug configuration kept) also equals eager: in
this model the released ``cu_seq_lens`` is the whole defect, the other frozen host values are harmless upper bounds.
On CUDA the bug variant's outcome depends on what the caching allocator has placed at the released address by the
replay (it may even be the step's own ``cu_seq_lens``); it was not run on a GPU.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
from typing import NamedTuple

import numpy as np
import torch

from workbench.engine import events, graph, graph_pool_handle, new_graph
from workbench.zoo.kit import compare, generator, hooks, randn, remember_step, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/25104"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "build"
SYMPTOM = ("ROCm AITER flash attention under cudagraph_mode=FULL: a mixed prefill-decode batch replays a FULL graph "
           "whose prefill path reads the cu_seq_lens the capture's metadata built and released, so prefill rows "
           "attend over the wrong key ranges")

MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, MAX_MODEL_LEN, BLOCK_SIZE = 4, 16, 32, 16
MAX_BLOCKS_PER_REQ, NUM_BLOCKS = MAX_MODEL_LEN // BLOCK_SIZE, 8          # block 0 is the null block
TRASH_SLOT = NUM_BLOCKS * BLOCK_SIZE                                    # stand-in: where a -1 slot lands
CUDAGRAPH_CAPTURE_SIZES, CUDAGRAPH_NUM_OF_WARMUPS, MAX_NUM_PARTIAL_PREFILLS = [1, 2, 4, 8], 1, 1
_PARTITION_SIZE_ROCM = 256
VOCAB, HIDDEN, NUM_HEADS, HEAD_DIM, NUM_LAYERS = 32, 16, 2, 8, 2
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
DTYPE = torch.float64


class CUDAGraphMode(enum.Enum):
    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = (FULL, NONE)
    FULL_AND_PIECEWISE = (FULL, PIECEWISE)

    def decode_mode(self):
        return CUDAGraphMode(self.value[0]) if self.separate_routine() else self

    def mixed_mode(self):
        return CUDAGraphMode(self.value[1]) if self.separate_routine() else self

    def has_full_cudagraphs(self):
        return (CUDAGraphMode(max(self.value)) if self.separate_routine() else self) == CUDAGraphMode.FULL

    def separate_routine(self):
        return isinstance(self.value, tuple)


class AttentionCGSupport(enum.Enum):
    ALWAYS = 3
    UNIFORM_BATCH = 2
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    NEVER = 0


class BatchDescriptor(NamedTuple):
    num_tokens: int
    uniform_decode: bool = False

    @property
    def non_uniform(self):
        return BatchDescriptor(self.num_tokens, uniform_decode=False)


@dataclasses.dataclass
class ForwardContext:
    attn_metadata: dict | None
    num_tokens: int
    cudagraph_runtime_mode: CUDAGraphMode
    batch_descriptor: BatchDescriptor | None
    num_actual_tokens: int                      # stand-in: what the wrapper announces as the step's real rows


_forward_context: ForwardContext | None = None


@contextlib.contextmanager
def set_forward_context(attn_metadata, num_tokens, cudagraph_runtime_mode=CUDAGraphMode.NONE, batch_descriptor=None,
                        num_actual_tokens=None):
    global _forward_context
    prev = _forward_context
    _forward_context = ForwardContext(attn_metadata, num_tokens, cudagraph_runtime_mode, batch_descriptor,
                                      num_tokens if num_actual_tokens is None else num_actual_tokens)
    try:
        yield
    finally:
        _forward_context = prev


# --- vllm/v1/attention/backends/rocm_aiter_fa.py at the fix's parent (reduced) ----------------------------------------

@dataclasses.dataclass
class CommonAttentionMetadata:
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor


@dataclasses.dataclass
class AiterFlashAttentionMetadata:
    num_actual_tokens: int
    num_actual_kv_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor
    max_seq_len: int
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    cu_seq_lens: torch.Tensor | None
    use_cascade: bool
    common_prefix_len: int
    total_tokens: int


class AiterFlashAttentionMetadataBuilder:
    cudagraph_support = AttentionCGSupport.ALWAYS        # set per variant in run(): the line PR #25104 changes

    def __init__(self):
        self.total_tokens = 0

    def build_for_cudagraph_capture(self, common_attn_metadata):
        self.total_tokens = MAX_MODEL_LEN * MAX_NUM_PARTIAL_PREFILLS
        res = self.build(common_prefix_len=0, common_attn_metadata=common_attn_metadata)
        self.total_tokens = 0
        return res

    def build(self, common_prefix_len, common_attn_metadata):
        m = common_attn_metadata
        seq_lens = m.seq_lens
        if m.max_query_len > 1:
            # We pre-compute cumulative seq len needed for prefill attention here to avoid recomputing it for every
            # layer (a new tensor at every build: not one of the runner's persistent buffers)
            cu_seq_lens = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32, device=seq_lens.device)
            torch.cumsum(seq_lens, dim=0, dtype=cu_seq_lens.dtype, out=cu_seq_lens[1:])
            num_actual_kv_tokens = int(cu_seq_lens[-1].item())
        else:
            cu_seq_lens, num_actual_kv_tokens = None, 0
        return AiterFlashAttentionMetadata(m.num_actual_tokens, num_actual_kv_tokens, m.max_query_len,
                                           m.query_start_loc, m.max_seq_len, seq_lens, m.slot_mapping,
                                           m.block_table_tensor, cu_seq_lens, common_prefix_len > 0,
                                           common_prefix_len, self.total_tokens)


def _linear(x, w):
    """``x @ w`` as a broadcast multiply-sum: a row's result does not depend on how many rows the batch has."""
    return (x.unsqueeze(-1) * w).sum(-2)


def _attend(q, keys, values, visible, scale):
    """q [n, H, D]; keys/values [n, L, H, D]; visible [n, L]: a kernel reads no key past its bounds (a gathered
    row it does not read may hold anything). A row with no visible key gets 0."""
    keys = torch.where(visible[:, :, None, None], keys, 0.0)
    values = torch.where(visible[:, :, None, None], values, 0.0)
    scores = (q.unsqueeze(1) * keys).sum(-1) * scale                        # [n, L, H]
    scores = scores.masked_fill(~visible.unsqueeze(-1), float("-inf"))
    probs = torch.where(visible.unsqueeze(-1), torch.softmax(scores, dim=1), 0.0)
    return (probs.unsqueeze(-1) * values).sum(1)                            # [n, H, D]


def _token_to_seq(cu_seqlens_q, n):
    """For each of ``n`` token rows: its sequence, its index in it, and whether it belongs to one."""
    num_seqs = cu_seqlens_q.shape[0] - 1
    t = torch.arange(n, dtype=cu_seqlens_q.dtype, device=cu_seqlens_q.device)
    b = torch.searchsorted(cu_seqlens_q[1:], t, right=True).clamp(max=num_seqs - 1)
    q_start, q_len = cu_seqlens_q[b], cu_seqlens_q[b + 1] - cu_seqlens_q[b]
    return b, t - q_start, q_len, (t >= q_start) & (t < q_start + q_len)


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping):
    """Uses the slot_mapping's length as the number of tokens; a -1 slot is skipped (here: the trash block)."""
    n = slot_mapping.shape[0]
    slots = torch.where(slot_mapping >= 0, slot_mapping, TRASH_SLOT)
    key_cache.view(-1, NUM_HEADS, HEAD_DIM).index_copy_(0, slots, key[:n])
    value_cache.view(-1, NUM_HEADS, HEAD_DIM).index_copy_(0, slots, value[:n])


def vllm_layout_trans(b_query_lens_loc, b_seq_lens_loc, block_table, k_cache, v_cache, max_seq_len, total_tokens):
    """The Triton gather: each sequence with query_len > 1 copies its first ``seq_len`` cached tokens (per
    ``b_seq_lens_loc``) to rows ``[b_seq_lens_loc[b], +seq_len)`` of contiguous K/V; grid (num_seqs, blocks)."""
    num_seqs, n_pos = block_table.shape[0], -(-max_seq_len // BLOCK_SIZE) * BLOCK_SIZE
    k_values = torch.empty(total_tokens + 1, NUM_HEADS, HEAD_DIM, dtype=k_cache.dtype, device=k_cache.device)
    v_values = torch.empty_like(k_values)
    p = torch.arange(n_pos, device=k_cache.device)
    query_len = b_query_lens_loc[1: num_seqs + 1] - b_query_lens_loc[:num_seqs]
    token_start = b_seq_lens_loc[:num_seqs].long()
    seq_len = b_seq_lens_loc[1: num_seqs + 1] - b_seq_lens_loc[:num_seqs]
    store = (query_len[:, None] > 1) & (p[None, :] < seq_len[:, None])
    src = block_table[:, p // BLOCK_SIZE].long() * BLOCK_SIZE + p % BLOCK_SIZE
    dst = torch.where(store, token_start[:, None] + p, total_tokens).flatten()
    k_values.index_copy_(0, dst, k_cache.reshape(-1, NUM_HEADS, HEAD_DIM)[src.flatten()])
    v_values.index_copy_(0, dst, v_cache.reshape(-1, NUM_HEADS, HEAD_DIM)[src.flatten()])
    return k_values[:total_tokens], v_values[:total_tokens]


def flash_attn_varlen_func_impl(q, k_cache, v_cache, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                softmax_scale, block_table, total_tokens=0):
    if total_tokens == 0:
        total_tokens = int(cu_seqlens_k[-1].item())
    k, v = vllm_layout_trans(cu_seqlens_q, cu_seqlens_k, block_table, k_cache, v_cache, max_seqlen_k, total_tokens)
    # aiter.flash_attn_varlen_func(causal=True): query j of a sequence sees keys [0, k_len - q_len + j]
    b, j, q_len, in_seq = _token_to_seq(cu_seqlens_q, q.shape[0])
    k_start, k_len = cu_seqlens_k[b].long(), (cu_seqlens_k[b + 1] - cu_seqlens_k[b]).long()
    p = torch.arange(MAX_MODEL_LEN, device=q.device)
    visible = (p[None, :] < k_len[:, None]) & (p[None, :] <= (k_len - q_len + j)[:, None])
    idx = (k_start[:, None] + p[None, :]).clamp(0, max(total_tokens - 1, 0))
    res = _attend(q, k[idx], v[idx], visible, softmax_scale)
    out.copy_(torch.where(in_seq[:, None, None], res, out))
    return out


def paged_attention_v1(out, workspace_buffer, query, key_cache, value_cache, scale, block_tables, cu_query_lens,
                       context_lens, max_context_len):
    """aiter's pa_v1: a sequence whose cu_query_lens length is not 1 returns (prefills are another kernel's)."""
    b, _, q_len, in_seq = _token_to_seq(cu_query_lens, query.shape[0])
    ctx = context_lens[b].long()
    max_num_partitions = -(-max_context_len // _PARTITION_SIZE_ROCM)
    p = torch.arange(MAX_MODEL_LEN, device=query.device)
    visible = p[None, :] < torch.clamp(ctx, max=max_num_partitions * _PARTITION_SIZE_ROCM)[:, None]
    slots = block_tables[b][:, p // BLOCK_SIZE].long() * BLOCK_SIZE + p % BLOCK_SIZE
    res = _attend(query, key_cache.reshape(-1, NUM_HEADS, HEAD_DIM)[slots],
                  value_cache.reshape(-1, NUM_HEADS, HEAD_DIM)[slots], visible, scale)
    decode_row = in_seq & (q_len == 1) & (ctx > 0)
    out.copy_(torch.where(decode_row[:, None, None], res, out))
    return out


class AiterFlashAttentionImpl:
    def __init__(self):
        self.scale = HEAD_DIM ** -0.5

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output):
        if attn_metadata is None:        # profiling / a dummy run without attention
            return output
        num_actual_tokens = attn_metadata.num_actual_tokens
        key_cache, value_cache = kv_cache.unbind(0)
        reshape_and_cache_flash(key, value, key_cache, value_cache, attn_metadata.slot_mapping)
        cu_seqlens_q, seqused_k = attn_metadata.query_start_loc, attn_metadata.seq_lens
        max_seqlen_q, max_seqlen_k = attn_metadata.max_query_len, attn_metadata.max_seq_len
        block_table = attn_metadata.block_table
        if max_seqlen_q > 1:            # host value: a FULL graph keeps the branch its capture took
            flash_attn_varlen_func_impl(query[:num_actual_tokens], key_cache, value_cache,
                                        out=output[:num_actual_tokens], cu_seqlens_q=cu_seqlens_q,
                                        cu_seqlens_k=attn_metadata.cu_seq_lens, max_seqlen_q=max_seqlen_q,
                                        max_seqlen_k=max_seqlen_k, softmax_scale=self.scale, block_table=block_table,
                                        total_tokens=attn_metadata.num_actual_kv_tokens)
        num_seqs = seqused_k.shape[0]
        max_num_partitions = (max_seqlen_k + _PARTITION_SIZE_ROCM - 1) // _PARTITION_SIZE_ROCM
        workspace_buffer = torch.empty(num_seqs * NUM_HEADS * max_num_partitions * (HEAD_DIM + 2), dtype=query.dtype,
                                       device=output.device)
        paged_attention_v1(output[:num_actual_tokens], workspace_buffer, query[:num_actual_tokens], key_cache,
                           value_cache, self.scale, block_table, cu_seqlens_q, seqused_k, max_seqlen_k)
        return output


# --- the model (a tiny Llama-like decoder) ----------------------------------------------------------------------------

class Attention:
    def __init__(self, layer_name, kv_cache):
        self.layer_name, self.kv_cache, self.impl = layer_name, kv_cache, AiterFlashAttentionImpl()

    def forward(self, q, k, v):
        ctx = _forward_context
        attn_metadata = None if ctx.attn_metadata is None else ctx.attn_metadata[self.layer_name]
        output = torch.empty_like(q)
        return self.impl.forward(self, q, k, v, self.kv_cache, attn_metadata, output)


class LlamaModel:
    def __init__(self, r, kv_caches):
        self.embed_tokens, self.embed_positions = r(VOCAB, HIDDEN, scale=1.0), r(MAX_MODEL_LEN, HIDDEN, scale=0.5)
        self.layers = [{"qkv": r(HIDDEN, 3 * HIDDEN), "o": r(HIDDEN, HIDDEN), "up": r(HIDDEN, 2 * HIDDEN),
                        "down": r(2 * HIDDEN, HIDDEN), "attn": Attention(LAYER_NAMES[i], kv_caches[i])}
                       for i in range(NUM_LAYERS)]

    def __call__(self, input_ids, positions):
        h = self.embed_tokens[input_ids.long()] + self.embed_positions[positions]
        n = h.shape[0]
        for layer in self.layers:
            q, k, v = _linear(h, layer["qkv"]).view(n, 3, NUM_HEADS, HEAD_DIM).unbind(1)
            h = h + _linear(layer["attn"].forward(q, k, v).reshape(n, HIDDEN), layer["o"])
            h = h + _linear(torch.nn.functional.silu(_linear(h, layer["up"])), layer["down"])
        return h


class LlamaForCausalLM:
    def __init__(self, device, kv_caches):
        gen = generator(25104)
        r = lambda *s, scale=0.3: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)
        self.model = LlamaModel(r, kv_caches)
        self.lm_head = r(HIDDEN, VOCAB)

    def compute_logits(self, hidden_states):
        return _linear(hidden_states, self.lm_head)


# --- vllm/v1/cudagraph_dispatcher.py and vllm/compilation/cuda_graph.py (reduced) -------------------------------------

class CudagraphDispatcher:
    def __init__(self):
        self.cudagraph_keys = {CUDAGraphMode.PIECEWISE: set(), CUDAGraphMode.FULL: set()}
        self.keys_initialized = False

    def initialize_cudagraph_keys(self, cudagraph_mode, uniform_decode_query_len):
        if cudagraph_mode.mixed_mode() != CUDAGraphMode.NONE:
            for bs in CUDAGRAPH_CAPTURE_SIZES:
                self.cudagraph_keys[cudagraph_mode.mixed_mode()].add(BatchDescriptor(bs, uniform_decode=False))
        if cudagraph_mode.decode_mode() == CUDAGraphMode.FULL and cudagraph_mode.separate_routine():
            max_num_tokens = uniform_decode_query_len * MAX_NUM_SEQS
            for bs in [x for x in CUDAGRAPH_CAPTURE_SIZES if uniform_decode_query_len <= x <= max_num_tokens]:
                self.cudagraph_keys[CUDAGraphMode.FULL].add(BatchDescriptor(bs, uniform_decode=True))
        self.keys_initialized = True

    def dispatch(self, batch_descriptor):
        if not self.keys_initialized:
            return CUDAGraphMode.NONE, None
        if batch_descriptor in self.cudagraph_keys[CUDAGraphMode.FULL]:
            return CUDAGraphMode.FULL, batch_descriptor
        non_uniform_key = batch_descriptor.non_uniform
        if non_uniform_key in self.cudagraph_keys[CUDAGraphMode.FULL]:
            return CUDAGraphMode.FULL, non_uniform_key
        if non_uniform_key in self.cudagraph_keys[CUDAGraphMode.PIECEWISE]:
            return CUDAGraphMode.PIECEWISE, non_uniform_key
        return CUDAGraphMode.NONE, None


@dataclasses.dataclass
class CUDAGraphEntry:
    batch_descriptor: BatchDescriptor
    cudagraph: object = None
    output: torch.Tensor | None = None


class CUDAGraphWrapper:
    def __init__(self, runnable, runtime_mode, graph_pool, device, padded_inputs):
        self.runnable, self.runtime_mode, self.graph_pool, self.device = runnable, runtime_mode, graph_pool, device
        self.padded_inputs = padded_inputs          # static inputs whose padded rows a step leaves as they were
        self.concrete_cudagraph_entries: dict = {}

    def __call__(self, *args):
        ctx = _forward_context
        if ctx.cudagraph_runtime_mode in (CUDAGraphMode.NONE, ) or ctx.cudagraph_runtime_mode != self.runtime_mode:
            return self.runnable(*args)
        bd = ctx.batch_descriptor
        entry = self.concrete_cudagraph_entries.setdefault(bd, CUDAGraphEntry(bd))
        if entry.cudagraph is None:
            cudagraph = new_graph(self.device, on_freed="reuse")
            with graph(cudagraph, pool=self.graph_pool, name=f"FULL num_tokens={bd.num_tokens} "
                                                              f"uniform_decode={bd.uniform_decode}"):
                output = self.runnable(*args)
            step = lambda a=args: self.runnable(*a)
            remember_step(cudagraph, step)
            for hook in hooks:
                hook.captured(cudagraph, step)
            entry.output, entry.cudagraph = output, cudagraph
            return output
        return replay(entry.cudagraph, entry.output, real=ctx.num_actual_tokens, size=bd.num_tokens,
                      padded=self.padded_inputs)


# --- vllm/v1/worker/gpu_model_runner.py (reduced) ---------------------------------------------------------------------

@dataclasses.dataclass
class CachedRequestState:
    token_ids: list
    block_ids: list
    num_computed_tokens: int = 0


class GPUModelRunner:
    def __init__(self, device, cudagraph_mode):
        self.device, self.cudagraph_mode = device, cudagraph_mode
        self.kv_caches = [torch.zeros(2, NUM_BLOCKS + 1, BLOCK_SIZE, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
                          for _ in range(NUM_LAYERS)]
        self.model = LlamaForCausalLM(device, self.kv_caches)
        self.attn_metadata_builder = AiterFlashAttentionMetadataBuilder()
        self.input_ids = torch.zeros(MAX_NUM_BATCHED_TOKENS, dtype=torch.int32, device=device)
        self.positions = torch.zeros(MAX_NUM_BATCHED_TOKENS, dtype=torch.int64, device=device)
        self.query_start_loc = torch.zeros(MAX_NUM_SEQS + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(MAX_NUM_SEQS, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(MAX_NUM_SEQS, MAX_BLOCKS_PER_REQ, dtype=torch.int32, device=device)
        self.slot_mapping = torch.zeros(MAX_NUM_BATCHED_TOKENS, dtype=torch.int64, device=device)
        self.cudagraph_batch_sizes, self.uniform_decode_query_len = sorted(CUDAGRAPH_CAPTURE_SIZES), 1
        self.cudagraph_dispatcher = CudagraphDispatcher()
        self.forward = self.model.model
        if cudagraph_mode.has_full_cudagraphs():          # load_model: the whole model in one FULL wrapper
            self.forward = CUDAGraphWrapper(self.model.model, CUDAGraphMode.FULL, graph_pool_handle(device), device,
                                            {"input_ids": self.input_ids, "positions": self.positions})
        self.requests: dict = {}

    def initialize_cudagraph_capture(self):
        min_cg_support = self.attn_metadata_builder.cudagraph_support
        if self.cudagraph_mode.mixed_mode() == CUDAGraphMode.FULL and min_cg_support != AttentionCGSupport.ALWAYS:
            if min_cg_support == AttentionCGSupport.NEVER:
                raise ValueError("full cudagraphs are not supported by AiterFlashAttentionMetadataBuilder")
            # splitting_ops_contain_attention(): "setting cudagraph_mode=FULL_AND_PIECEWISE"
            self.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
        self.cudagraph_dispatcher.initialize_cudagraph_keys(self.cudagraph_mode, self.uniform_decode_query_len)

    def capture_model(self):
        if self.cudagraph_mode == CUDAGraphMode.NONE:
            return
        self.initialize_cudagraph_capture()
        events.static_buffers("GPUModelRunner", {
            "input_ids": self.input_ids, "positions": self.positions, "query_start_loc": self.query_start_loc,
            "seq_lens": self.seq_lens, "block_table": self.block_table, "slot_mapping": self.slot_mapping})
        events.persistent_state("GPUModelRunner", {f"kv_cache_{i}": kv for i, kv in enumerate(self.kv_caches)})
        mode = self.cudagraph_mode
        if mode.mixed_mode() != CUDAGraphMode.NONE:
            self._capture_cudagraphs(list(reversed(self.cudagraph_batch_sizes)), mode.mixed_mode(), False)
        if mode.decode_mode() == CUDAGraphMode.FULL and mode.separate_routine():
            sizes = [x for x in self.cudagraph_batch_sizes if 1 <= x <= MAX_NUM_SEQS * self.uniform_decode_query_len]
            self._capture_cudagraphs(list(reversed(sizes)), CUDAGraphMode.FULL, True)

    def _capture_cudagraphs(self, compilation_cases, cudagraph_runtime_mode, uniform_decode):
        for num_tokens in compilation_cases:
            for _ in range(CUDAGRAPH_NUM_OF_WARMUPS):
                with events.warmup():
                    self._dummy_run(num_tokens, CUDAGraphMode.NONE,
                                    force_attention=cudagraph_runtime_mode == CUDAGraphMode.FULL,
                                    uniform_decode=uniform_decode)
            if cudagraph_runtime_mode == CUDAGraphMode.PIECEWISE:
                with events.warmup():        # stand-in: the pieces are not captured, the dummy run is eager
                    self._dummy_run(num_tokens, cudagraph_runtime_mode, uniform_decode=uniform_decode)
            else:
                self._dummy_run(num_tokens, cudagraph_runtime_mode, uniform_decode=uniform_decode)

    def _dummy_run(self, num_tokens, cudagraph_runtime_mode, force_attention=False, uniform_decode=False):
        max_query_len = self.uniform_decode_query_len if uniform_decode else num_tokens
        if uniform_decode:
            num_reqs = num_tokens // max_query_len
        else:
            num_reqs = min(num_tokens, MAX_NUM_SEQS)
        attn_metadata = None
        if force_attention or cudagraph_runtime_mode == CUDAGraphMode.FULL:
            # "Make sure max_model_len is used at the graph capture time."
            self.seq_lens[:num_reqs] = MAX_MODEL_LEN
            self.seq_lens[num_reqs:] = 0
            common_attn_metadata = CommonAttentionMetadata(
                self.query_start_loc[: num_reqs + 1], self.seq_lens[:num_reqs], num_reqs, num_tokens, max_query_len,
                MAX_MODEL_LEN, self.block_table[:num_reqs], self.slot_mapping[:num_tokens])
            attn_metadata_i = self.attn_metadata_builder.build_for_cudagraph_capture(common_attn_metadata)
            attn_metadata = {name: attn_metadata_i for name in LAYER_NAMES}
        batch_descriptor = None
        if cudagraph_runtime_mode != CUDAGraphMode.NONE:
            _cg_mode, batch_descriptor = self.cudagraph_dispatcher.dispatch(BatchDescriptor(num_tokens, uniform_decode))
            assert _cg_mode == cudagraph_runtime_mode, (_cg_mode, cudagraph_runtime_mode)
        with set_forward_context(attn_metadata, num_tokens, cudagraph_runtime_mode, batch_descriptor):
            return self.forward(self.input_ids[:num_tokens], self.positions[:num_tokens])

    def _prepare_inputs(self, num_scheduled_tokens: dict):
        req_ids = [r for r in self.requests if r in num_scheduled_tokens]
        num_reqs = len(req_ids)
        num_sched = np.array([num_scheduled_tokens[r] for r in req_ids], dtype=np.int64)
        cu_num_tokens = np.cumsum(num_sched)
        total = int(cu_num_tokens[-1])
        ids, pos, slots, seq_lens = [], [], [], []
        block_rows = np.zeros((num_reqs, MAX_BLOCKS_PER_REQ), dtype=np.int32)
        for i, r in enumerate(req_ids):
            req, n = self.requests[r], int(num_sched[i])
            nc = req.num_computed_tokens
            block_rows[i, : len(req.block_ids)] = req.block_ids
            ids += req.token_ids[nc: nc + n]
            pos += list(range(nc, nc + n))
            slots += [int(block_rows[i, x // BLOCK_SIZE]) * BLOCK_SIZE + x % BLOCK_SIZE for x in range(nc, nc + n)]
            seq_lens.append(nc + n)
        dev = self.device
        self.input_ids[:total] = torch.tensor(ids, dtype=torch.int32).to(dev)     # padded rows keep what they held
        self.positions[:total] = torch.tensor(pos, dtype=torch.int64).to(dev)
        self.block_table[:num_reqs] = torch.from_numpy(block_rows).to(dev)
        self.slot_mapping[:total] = torch.tensor(slots, dtype=torch.int64).to(dev)
        self.slot_mapping[total:] = -1           # "Needed for reshape_and_cache in full cuda graph mode."
        qsl = np.full(MAX_NUM_SEQS + 1, total, dtype=np.int32)  # padded non-decreasing, as FlashAttention requires
        qsl[0], qsl[1: num_reqs + 1] = 0, cu_num_tokens
        self.query_start_loc.copy_(torch.from_numpy(qsl).to(dev))
        sl = np.zeros(MAX_NUM_SEQS, dtype=np.int32)             # "Fill unused with 0 for full cuda graph mode."
        sl[:num_reqs] = seq_lens
        self.seq_lens.copy_(torch.from_numpy(sl).to(dev))
        common_attn_metadata = CommonAttentionMetadata(
            self.query_start_loc[: num_reqs + 1], self.seq_lens[:num_reqs], num_reqs, total, int(num_sched.max()),
            max(seq_lens), self.block_table[:num_reqs], self.slot_mapping[:total])
        attn_metadata_i = self.attn_metadata_builder.build(0, common_attn_metadata)
        attn_metadata = {name: attn_metadata_i for name in LAYER_NAMES}
        logits_indices = torch.from_numpy(cu_num_tokens - 1).to(dev)
        return attn_metadata, logits_indices, int(num_sched.max()), req_ids, num_sched

    def _get_num_input_tokens(self, num_scheduled_tokens):
        if self.cudagraph_mode != CUDAGraphMode.NONE and num_scheduled_tokens <= self.cudagraph_batch_sizes[-1]:
            return min(s for s in self.cudagraph_batch_sizes if s >= num_scheduled_tokens)   # pad_for_cudagraph
        return num_scheduled_tokens

    def execute_model(self, new_reqs, num_scheduled_tokens: dict):
        for req_id, prompt, block_ids in new_reqs:
            self.requests[req_id] = CachedRequestState(list(prompt), list(block_ids))
        attn_metadata, logits_indices, max_query_len, req_ids, num_sched = self._prepare_inputs(num_scheduled_tokens)
        total = int(num_sched.sum())
        num_input_tokens = self._get_num_input_tokens(total)
        uniform_decode = max_query_len == self.uniform_decode_query_len and total == len(req_ids) * max_query_len
        cudagraph_runtime_mode, batch_descriptor = self.cudagraph_dispatcher.dispatch(
            BatchDescriptor(num_input_tokens, uniform_decode))
        with set_forward_context(attn_metadata, num_input_tokens, cudagraph_runtime_mode, batch_descriptor, total):
            hidden_states = self.forward(self.input_ids[:num_input_tokens], self.positions[:num_input_tokens])
        logits = self.model.compute_logits(hidden_states[logits_indices.long()])
        sampled = logits.argmax(dim=-1)
        for i, r in enumerate(req_ids):
            req = self.requests[r]
            req.num_computed_tokens += int(num_sched[i])
            if req.num_computed_tokens >= len(req.token_ids):
                req.token_ids.append(int(sampled[i]))
        return [logits, sampled.to(DTYPE)]


# --- the workload: A's prefill, A's decode beside B's prefill, then decodes of both -----------------------------------

def _serve(device, cudagraph_mode):
    runner = GPUModelRunner(device, cudagraph_mode)
    runner.capture_model()
    gen = generator(7)
    prompt_a = torch.randint(0, VOCAB, (5,), generator=gen).tolist()       # 5 tokens: padded to 8
    prompt_b = torch.randint(0, VOCAB, (3,), generator=gen).tolist()       # with A's decode: 4 tokens
    outs = runner.execute_model([("A", prompt_a, [1])], {"A": 5})
    outs += runner.execute_model([("B", prompt_b, [2])], {"A": 1, "B": 3})
    for _ in range(3):
        outs += runner.execute_model([], {"A": 1, "B": 1})
    return outs


def run(variant: str, device: str = "cpu"):
    AiterFlashAttentionMetadataBuilder.cudagraph_support = (
        AttentionCGSupport.ALWAYS if variant == "bug"
        # PR #25104: "The correct AttentionCGSupport ... to use here [is] UNIFORM_SINGLE_TOKEN_DECODE"
        else AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE)
    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: _serve(device, CUDAGraphMode.FULL), lambda: _serve(device, CUDAGraphMode.NONE))
