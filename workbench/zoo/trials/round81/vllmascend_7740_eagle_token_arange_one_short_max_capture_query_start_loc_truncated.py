"""The EAGLE drafter's ``token_arange_np`` has ``max_num_tokens`` entries, one too few: at the largest capture size the padded ``query_start_loc_cpu`` of draft steps 1+ silently loses its last entry, and the FIA graph-task update rejects it.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/7740 ("[Bugfix][EAGLE] Fix FIA pad bug under max
concurrency", vllm-project/vllm-ascend, merged 2026-03-29, commit b75c0d6d050f).
Symptom: EAGLE/EAGLE3 speculative decoding with ``cudagraph_mode=FULL_DECODE_ONLY`` fails as soon as a decode step
runs at "max concurrency", i.e. when its draft batch is padded to a capture size equal to ``max_num_batched_tokens``.
The PR's e2e test reproduces it with ``num_speculative_tokens=3``, ``cudagraph_capture_sizes=[4]`` and
``max_num_batched_tokens=4`` on one prompt. Smaller capture sizes serve fine, and so does eager drafting. The PR
gives no error text ("Fixes padding problems of FIA op under max concurrency"), so the failure is inferred from the
code. The TND-layout FIA op requires the last ``actual_seq_lengths`` entry to equal the query's token count, and
aclnn rejects a call that breaks this rule: ``aclnnFusedInferAttentionScoreV3 failed, error code is 561002``. PR #6596
quotes that error for the same rule on draft step 0.
Mechanism: ``SpecDecodeBaseProposer`` (vllm_ascend/spec_decode/eagle_proposer.py) inherits
``self.token_arange_np = np.arange(self.max_num_tokens)`` from vLLM's ``EagleProposer.__init__``, where
``max_num_tokens`` is ``max_num_batched_tokens``. In FULL graph mode the merged draft graph (``_run_merged_draft``)
runs draft steps 1.. on ``input_batch_size = num_input_tokens`` rows, the padded token count of draft step 0.
``attn_update_stack_num_spec_norm`` pads their metadata to that many one-token requests: ``num_reqs =
input_batch_size`` and ``query_start_loc_cpu = torch.from_numpy(self.token_arange_np[: input_batch_size + 1])``.
That needs ``input_batch_size + 1`` entries. When the padded size equals ``max_num_tokens``, numpy slicing silently
returns only ``max_num_tokens`` entries. ``AscendAttentionMetadataBuilder.build`` (vllm_ascend/attention/
attention_v1.py) takes ``query_start_loc_cpu[: num_reqs + 1]`` and makes ``actual_seq_lengths_q =
query_start_loc_cpu[1:].tolist()``. The result is one request short and ends at ``max_num_tokens - 1``, while
``seq_lens_list`` has ``max_num_tokens`` entries and the query has ``max_num_tokens`` rows. For each replay,
``_update_full_graph_params`` -> ``AscendAttentionBackendImpl.update_graph_params`` re-issues every captured FIA
task with these host arguments (``graph_task_update_begin/end``), and the TND check fails. The capture itself is
fine. ``dummy_run`` builds every draft step's capture metadata from the runner's ``query_start_loc``, whose buffer
``NPUModelRunner`` already sizes ``max_num_reqs + 2`` "to reserve extra space for padding". Eager drafting slices
``token_arange_np[: batch_size + 1]`` with the real request count. In a spec-decode batch that is at most
``max_num_tokens / (1 + num_speculative_tokens)``, and never more than ``max_num_seqs`` (here 2, against 8). It
could reach ``max_num_tokens`` only if ``max_num_seqs == max_num_batched_tokens`` and every request scheduled a
single token.
Doctor: undersized-buffer, at __init__ (``SpecDecodeBaseProposer.__init__`` leaves the drafter with a host arange
one entry too short for the ``query_start_loc`` of the largest captured draft graph. Replaying that graph asks it
for ``max_num_tokens + 1`` entries and silently gets ``max_num_tokens``. The upstream fix sizes the buffer in this
function.)
Fix (upstream): ``SpecDecodeBaseProposer.__init__`` adds ``self.token_arange_np = np.arange(self.max_num_tokens +
1)``.
Modelled: the draft model is a one-layer EAGLE head: token embedding, an ``fc`` over [embedding, target hidden
state], a learned position embedding in place of RoPE, q/k/v/o, one paged-KV attention layer and an LM head.
Not modelled: TP > 1, PCP/DCP, MTP, multimodal inputs, LM-head TP, async scheduling and DP. Sizes follow the e2e
test's ``num_speculative_tokens=3``, with ``max_num_seqs=2`` and ``max_num_batched_tokens=8`` (2 x (1 + 3): the
max-concurrency decode batch) and FULL_DECODE_ONLY draft graphs at [4, 8] tokens. The target model is not run:
each step hands the drafter the target's verified tokens, positions and hidden states (drawn at random), and every
draft is accepted (no rejected tokens). The runner keeps only what the drafter reads: ``query_start_loc``,
``seq_lens``, the block table, the slot mapping, the capture through ``_dummy_run`` -> ``dummy_run`` and the
dispatcher. The torch_npu kernels (FIA with TND layout, ``sparse_mode=3`` and a paged KV cache;
``_npu_reshape_and_cache``) are written in torch. The FIA stand-in checks the TND rule named above and raises
aclnn's error. A captured FIA task group reads its arguments (``actual_seq_lengths``, ``actual_seq_lengths_kv``,
``block_table``) through the task, and ``graph_task_update`` rewrites them. This is modelled as pinned host
memory, reserved before the captures: the captured kernel copies it in at every replay, and the update writes it in
place, after waiting for the previous replay. At capture the task's block table starts zeroed, which is the dummy
batch's table (all null block 0), because the capture cannot read device memory. Upstream runs the update after
the asynchronous replay launch, and the updated task waits on an ExternalEvent that the update records. The
emulation applies the update just before the replay instead. vLLM's device ``self.arange``
(``max(max_num_seqs + 1, max_num_tokens)`` entries) is also one entry short with these sizes. Nothing on the FIA
path reads the device ``query_start_loc`` it gives, because the builder re-derives everything from
``query_start_loc_cpu``, and the fix leaves it alone.
"""

import contextlib
import copy
import dataclasses
import enum
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from workbench.engine import events, graph_pool_handle, host, synchronize
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/7740"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "__init__"
SYMPTOM = ("EAGLE spec decode with FULL_DECODE_ONLY graphs fails at max concurrency: when the draft batch pads to a "
           "capture size equal to max_num_batched_tokens, token_arange_np[: n + 1] returns only n entries, "
           "query_start_loc_cpu is one short and the FIA graph-task update rejects actual_seq_lengths")

VOCAB, HIDDEN, NUM_HEADS, HEAD_DIM = 16, 8, 2, 4
BLOCK_SIZE, MAX_MODEL_LEN = 4, 32
MAX_BLOCKS_PER_REQ = MAX_MODEL_LEN // BLOCK_SIZE
NUM_SPECULATIVE_TOKENS = 3                       # the e2e test's value
MAX_NUM_SEQS = 2
MAX_NUM_BATCHED_TOKENS = MAX_NUM_SEQS * (1 + NUM_SPECULATIVE_TOKENS)   # 8: the max-concurrency decode batch
CUDAGRAPH_CAPTURE_SIZES = [4, 8]
NUM_BLOCKS = 1 + MAX_NUM_SEQS * MAX_BLOCKS_PER_REQ       # block 0: the null block of dummy batches
PADDING_SLOT_ID = -1
LAYER_NAME = "model.layers.0.self_attn.attn"
FIA_MAX_BATCH = MAX_NUM_BATCHED_TOKENS + 1       # (model) task argument capacity: one request per token + a dummy
NO_REQUEST = 2 ** 31 - 1                         # (model) a task argument slot past the last request


# --- vllm/config (reduced) -------------------------------------------------------------------------------------------

class CUDAGraphMode(enum.Enum):
    NONE = 0
    PIECEWISE = 1
    FULL = 2


@dataclasses.dataclass
class VllmConfig:
    cudagraph_mode: CUDAGraphMode            # FULL_DECODE_ONLY: FULL graphs for uniform decode batches
    cudagraph_capture_sizes: list
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = MAX_NUM_SEQS
    max_model_len: int = MAX_MODEL_LEN
    num_speculative_tokens: int = NUM_SPECULATIVE_TOKENS
    enforce_eager: bool = False


class BatchDescriptor(NamedTuple):
    num_tokens: int
    uniform: bool = False


class AscendAttentionState(enum.Enum):
    ChunkedPrefill = 3
    SpecDecoding = 4


# --- vllm_ascend/ascend_forward_context.py ---------------------------------------------------------------------------

@dataclasses.dataclass
class ForwardContext:
    attn_metadata: dict | None
    num_tokens: int
    batch_descriptor: BatchDescriptor | None
    cudagraph_runtime_mode: CUDAGraphMode
    draft_attn_metadatas: list | None


class _ExtraForwardContext:
    capturing = False
    is_draft_model = False


_EXTRA_CTX = _ExtraForwardContext()
_forward_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext | None:
    return _forward_context


@contextlib.contextmanager
def set_ascend_forward_context(attn_metadata, num_tokens=0, batch_descriptor=None,
                               aclgraph_runtime_mode=CUDAGraphMode.NONE, is_draft_model=False,
                               draft_attn_metadatas=None):
    global _forward_context
    prev = _forward_context
    _forward_context = ForwardContext(attn_metadata, num_tokens, batch_descriptor, aclgraph_runtime_mode,
                                      draft_attn_metadatas)
    _EXTRA_CTX.is_draft_model = is_draft_model
    try:
        yield
    finally:
        _forward_context = prev
        _EXTRA_CTX.is_draft_model = False


# --- torch_npu (stand-ins written in torch) --------------------------------------------------------------------------

def _check_tnd(query, actual_seq_lengths, actual_seq_lengths_kv):
    """aclnnFusedInferAttentionScore parameter check, TND layout: one kv length per request, and the last
    cumulative query length equals the query's first dimension."""
    if len(actual_seq_lengths) != len(actual_seq_lengths_kv) or actual_seq_lengths[-1] != query.shape[0]:
        raise RuntimeError(
            f"aclnnFusedInferAttentionScoreV3 failed, error code is 561002 (TND: query T={query.shape[0]}, "
            f"actual_seq_lengths has {len(actual_seq_lengths)} entries ending at {actual_seq_lengths[-1]}, "
            f"actual_seq_lengths_kv has {len(actual_seq_lengths_kv)})")


def _fia_tnd_kernel(query, key, value, block_table, q_ends, kv_lens, num_heads, block_size, scale):
    """FIA, TND layout, ``sparse_mode=3`` (causal, right-aligned to each request's kv length), paged KV. Request b
    owns query rows ``[q_ends[b-1], q_ends[b])`` and its first ``kv_lens[b]`` positions, read via ``block_table[b]``.
    All on the device: ``q_ends``/``kv_lens``/``block_table`` are device tensors."""
    t_rows = query.shape[0]
    dev = query.device
    q = query.view(t_rows, num_heads, HEAD_DIM)
    t = torch.arange(t_rows, device=dev, dtype=torch.int32)
    req = torch.searchsorted(q_ends, t, right=True).clamp(max=q_ends.shape[0] - 1)       # [T]
    prev_end = torch.where(req > 0, q_ends[(req - 1).clamp(min=0)], torch.zeros_like(q_ends[req]))
    q_len = q_ends[req] - prev_end
    kv_len = kv_lens[req].long()
    q_pos = kv_len - q_len.long() + (t - prev_end).long()                              # position of row t
    p = torch.arange(block_table.shape[1] * block_size, device=dev)
    blocks = block_table[req][:, p // block_size].long().clamp(min=0)                   # [T, P]
    slots = blocks * block_size + p % block_size
    k = key.reshape(-1, num_heads, HEAD_DIM)[slots]                                     # [T, P, H, D]
    v = value.reshape(-1, num_heads, HEAD_DIM)[slots]
    scores = torch.einsum("thd,tphd->thp", q, k) * scale
    hidden = (p.unsqueeze(0) > q_pos.unsqueeze(1)) | (p.unsqueeze(0) >= kv_len.unsqueeze(1))
    probs = torch.softmax(scores.masked_fill(hidden.unsqueeze(1), -1e9), dim=-1)
    return torch.einsum("thp,tphd->thd", probs, v).reshape(t_rows, num_heads * HEAD_DIM)


class FusedInferAttentionTask:
    """(model) The arguments of one captured FIA task group, as ``graph_task_update`` rewrites them: pinned host
    memory that the captured kernel copies in at every replay."""

    def __init__(self, device):
        self.device = device
        self.actual_seq_lengths = host(torch.full((FIA_MAX_BATCH,), NO_REQUEST, dtype=torch.int32), device)
        self.actual_seq_lengths_kv = host(torch.zeros(FIA_MAX_BATCH, dtype=torch.int32), device)
        # capture: the dummy batch's table (every entry null block 0)
        self.block_table = host(torch.zeros(FIA_MAX_BATCH, MAX_BLOCKS_PER_REQ, dtype=torch.int32), device)

    def write_host_args(self, actual_seq_lengths, actual_seq_lengths_kv):
        q = self.actual_seq_lengths.numpy()
        q[:] = NO_REQUEST
        q[:len(actual_seq_lengths)] = actual_seq_lengths
        kv = self.actual_seq_lengths_kv.numpy()
        kv[:] = 0
        kv[:len(actual_seq_lengths_kv)] = actual_seq_lengths_kv


class _TaskGroups:
    open_group: FusedInferAttentionTask | None = None    # between graph_task_group_begin and _end (capture)
    updating: FusedInferAttentionTask | None = None      # between graph_task_update_begin and _end
    free: list = []                                      # (model) task argument memory made before the captures


_task_groups = _TaskGroups()


def _reserve_task_args(count, device):
    """(model) Pinned memory for the arguments of ``count`` FIA task groups, made before the captures (a pinned
    allocation inside a capture is refused)."""
    _task_groups.free = [FusedInferAttentionTask(device) for _ in range(count)]


def graph_task_group_begin(stream):
    _task_groups.open_group = "open"


def graph_task_group_end(stream):
    handle, _task_groups.open_group = _task_groups.open_group, None
    return handle


def graph_task_update_begin(update_stream, handle):
    # (model) the previous replay has read the task's arguments before they are rewritten (upstream: events)
    synchronize(handle.device)
    _task_groups.updating = handle


def graph_task_update_end(update_stream):
    _task_groups.updating = None


class _NpuFusedInferAttentionScore:
    """``torch_npu.npu_fused_infer_attention_score`` (eager) and its ``.out`` form (captured / task update)."""

    def __call__(self, query, key, value, block_table, input_layout, block_size, actual_seq_lengths,
                 actual_seq_lengths_kv, num_key_value_heads, num_heads, scale, sparse_mode):
        assert input_layout == "TND" and sparse_mode == 3
        _check_tnd(query, actual_seq_lengths, actual_seq_lengths_kv)
        dev = query.device
        q_ends = torch.tensor(actual_seq_lengths, dtype=torch.int32).to(dev)
        kv_lens = torch.tensor(actual_seq_lengths_kv, dtype=torch.int32).to(dev)
        return _fia_tnd_kernel(query, key, value, block_table, q_ends, kv_lens, num_heads, block_size, scale)

    def out(self, query, key, value, block_table, input_layout, block_size, actual_seq_lengths,
            actual_seq_lengths_kv, num_key_value_heads, num_heads, scale, sparse_mode, workspace=None, out=None):
        assert input_layout == "TND" and sparse_mode == 3
        _check_tnd(query, actual_seq_lengths, actual_seq_lengths_kv)
        if _task_groups.open_group is None:
            # graph task update: the captured task's arguments are rewritten; nothing runs now
            task = _task_groups.updating
            assert task is not None, "FIA .out outside a task group and outside a task update"
            task.write_host_args(actual_seq_lengths, actual_seq_lengths_kv)
            rows = min(block_table.shape[0], FIA_MAX_BATCH)
            task.block_table[:rows, :block_table.shape[1]].copy_(block_table[:rows])
            return
        task = _task_groups.free.pop()
        task.write_host_args(actual_seq_lengths, actual_seq_lengths_kv)
        _task_groups.open_group = task
        dev = query.device
        q_ends = torch.empty(FIA_MAX_BATCH, dtype=torch.int32, device=dev)
        q_ends.copy_(task.actual_seq_lengths, non_blocking=True)
        kv_lens = torch.empty(FIA_MAX_BATCH, dtype=torch.int32, device=dev)
        kv_lens.copy_(task.actual_seq_lengths_kv, non_blocking=True)
        table = torch.empty(FIA_MAX_BATCH, MAX_BLOCKS_PER_REQ, dtype=torch.int32, device=dev)
        table.copy_(task.block_table, non_blocking=True)
        out[0].copy_(_fia_tnd_kernel(query, key, value, table, q_ends, kv_lens, num_heads, block_size, scale))


npu_fused_infer_attention_score = _NpuFusedInferAttentionScore()


def _npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices):
    """Write token i's K/V to cache slot ``slot_indices[i]``; slot -1 (a padded token) is skipped."""
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    match = slot_indices.long().unsqueeze(1) == torch.arange(num_slots, device=key.device).unsqueeze(0)  # [T, S]
    written = match.any(0).unsqueeze(1)
    for src, cache in ((key, key_cache), (value, value_cache)):
        flat = cache.view(num_slots, -1)
        upd = match.t().to(src.dtype) @ src.reshape(src.shape[0], -1)
        flat.copy_(torch.where(written, upd, flat))


# --- vllm_ascend/compilation/acl_graph.py: graph params -------------------------------------------------------------

@dataclasses.dataclass
class GraphParams:
    handles: dict
    attn_params: dict


_draft_graph_params: GraphParams | None = None


def set_draft_graph_params(aclgraph_capture_sizes, device):
    global _draft_graph_params
    _draft_graph_params = GraphParams({s: [] for s in aclgraph_capture_sizes},
                                      {s: [] for s in aclgraph_capture_sizes})
    _reserve_task_args(len(aclgraph_capture_sizes) * NUM_SPECULATIVE_TOKENS, device)   # (model) one per layer, step


def get_draft_graph_params() -> GraphParams:
    return _draft_graph_params


# --- vllm/v1/attention/backends/utils.py, vllm_ascend/attention/attention_v1.py -------------------------------------

@dataclasses.dataclass
class AscendCommonAttentionMetadata:
    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    num_input_tokens: int
    max_query_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor
    attn_state: AscendAttentionState

    def batch_size(self):
        return self.seq_lens_cpu.shape[0]


@dataclasses.dataclass
class AscendMetadata:
    num_actual_tokens: int
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_list: list
    max_query_len: int
    actual_seq_lengths_q: list
    slot_mapping: torch.Tensor
    attn_state: AscendAttentionState


class AscendAttentionMetadataBuilder:
    def build(self, common_prefix_len, common_attn_metadata: AscendCommonAttentionMetadata) -> AscendMetadata:
        num_reqs = common_attn_metadata.num_reqs
        num_actual_tokens = common_attn_metadata.num_actual_tokens
        query_start_loc_cpu = common_attn_metadata.query_start_loc_cpu[: num_reqs + 1]
        block_table = common_attn_metadata.block_table_tensor
        seq_lens = common_attn_metadata.seq_lens_cpu[:num_reqs]
        slot_mapping = common_attn_metadata.slot_mapping[:num_actual_tokens]
        return AscendMetadata(
            num_actual_tokens=num_actual_tokens, block_tables=block_table, seq_lens=seq_lens,
            seq_lens_list=seq_lens.tolist(), max_query_len=common_attn_metadata.max_query_len,
            actual_seq_lengths_q=query_start_loc_cpu[1:].tolist(), slot_mapping=slot_mapping,
            attn_state=common_attn_metadata.attn_state)

    def build_for_graph_capture(self, common_attn_metadata, attn_state=AscendAttentionState.ChunkedPrefill):
        attn_metadata = self.build(common_prefix_len=0, common_attn_metadata=common_attn_metadata)
        attn_metadata.attn_state = attn_state
        return attn_metadata

    def build_for_drafting(self, common_attn_metadata, draft_index):
        # vllm AttentionMetadataBuilder.build_for_drafting
        return self.build(common_prefix_len=0, common_attn_metadata=common_attn_metadata)


class AttentionGroup:
    def __init__(self):
        self._builder = AscendAttentionMetadataBuilder()

    def get_metadata_builder(self):
        return self._builder


class AscendAttentionBackendImpl:
    def __init__(self, num_heads, head_size, scale):
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_heads
        self.key_cache = self.value_cache = None

    @staticmethod
    def update_graph_params(update_stream, forward_context, num_tokens, draft_attn_metadatas=None):
        # FIA update logic (draft model)
        graph_params = get_draft_graph_params()
        attn_metadata = draft_attn_metadatas
        attn_keys = list(attn_metadata[0].keys())
        num_layers = len(attn_keys)
        if num_layers == 0:
            return
        attn_keys = attn_keys * (len(graph_params.attn_params[num_tokens]) // num_layers)
        attn_count = 0
        for key, param, handle in zip(attn_keys, graph_params.attn_params[num_tokens],
                                      graph_params.handles[num_tokens]):
            (query, key_cache, value, block_tables, block_size, seq_lens, query_start_loc, num_kv_heads,
             num_heads, scale, attn_output) = param
            draft_step = attn_count // num_layers
            seq_lens = attn_metadata[draft_step][key].seq_lens_list
            actual_seq_lengths_q = attn_metadata[draft_step][key].actual_seq_lengths_q
            block_tables = attn_metadata[draft_step][key].block_tables
            attn_count = attn_count + 1

            graph_task_update_begin(update_stream, handle)
            npu_fused_infer_attention_score.out(
                query=query, key=key_cache, value=value, block_table=block_tables, input_layout="TND",
                block_size=block_size, actual_seq_lengths=actual_seq_lengths_q, actual_seq_lengths_kv=seq_lens,
                num_key_value_heads=num_kv_heads, num_heads=num_heads, scale=scale, sparse_mode=3,
                out=[attn_output])
            graph_task_update_end(update_stream)

    def _kv_views(self):
        num_block, block_size = self.key_cache.shape[:2]
        return (self.key_cache.view(num_block, block_size, -1), self.value_cache.view(num_block, block_size, -1),
                block_size)

    def full_graph_fia(self, query, attn_metadata: AscendMetadata, output):
        key, value, block_size = self._kv_views()
        num_tokens = attn_metadata.actual_seq_lengths_q[-1]
        graph_params = get_draft_graph_params()
        actual_seq_lengths_q = attn_metadata.actual_seq_lengths_q
        graph_params.attn_params[num_tokens].append(
            (query, key, value, attn_metadata.block_tables, block_size, attn_metadata.seq_lens_list,
             actual_seq_lengths_q, self.num_kv_heads, self.num_heads, self.scale, output))
        stream = None
        graph_task_group_begin(stream)
        npu_fused_infer_attention_score.out(
            query=query, key=key, value=value, block_table=attn_metadata.block_tables, input_layout="TND",
            block_size=block_size, actual_seq_lengths=actual_seq_lengths_q,
            actual_seq_lengths_kv=attn_metadata.seq_lens_list, num_key_value_heads=self.num_kv_heads,
            num_heads=self.num_heads, scale=self.scale, sparse_mode=3, out=[output])
        handle = graph_task_group_end(stream)
        graph_params.handles[num_tokens].append(handle)
        return output, num_tokens

    def forward_fia(self, query, attn_metadata: AscendMetadata):
        key, value, block_size = self._kv_views()
        return npu_fused_infer_attention_score(
            query=query, key=key, value=value, block_table=attn_metadata.block_tables, input_layout="TND",
            block_size=block_size, actual_seq_lengths=attn_metadata.actual_seq_lengths_q,
            actual_seq_lengths_kv=attn_metadata.seq_lens_list, num_key_value_heads=self.num_kv_heads,
            num_heads=self.num_heads, scale=self.scale, sparse_mode=3)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata: AscendMetadata, output):
        self.key_cache, self.value_cache = kv_cache
        slots = attn_metadata.slot_mapping
        _npu_reshape_and_cache(key[:slots.shape[0]], value[:slots.shape[0]], self.key_cache, self.value_cache, slots)
        forward_context = get_forward_context()
        if _EXTRA_CTX.capturing and forward_context.cudagraph_runtime_mode == CUDAGraphMode.FULL:
            output, _ = self.full_graph_fia(query, attn_metadata, output)
            return output
        output.copy_(self.forward_fia(query, attn_metadata))
        return output


class Attention:
    def __init__(self, layer_name, device):
        self.layer_name = layer_name
        self.impl = AscendAttentionBackendImpl(NUM_HEADS, HEAD_DIM, HEAD_DIM ** -0.5)
        self.kv_cache = (torch.zeros(NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_DIM, device=device),
                         torch.zeros(NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_DIM, device=device))

    def __call__(self, q, k, v):
        attn_metadata = get_forward_context().attn_metadata[self.layer_name]
        output = torch.empty_like(q)
        return self.impl.forward(self, q, k, v, self.kv_cache, attn_metadata, output)


# --- vllm/model_executor/models/llama_eagle.py (reduced) ------------------------------------------------------------

class EagleLlamaForCausalLM:
    def __init__(self, device):
        gen = generator(7740)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.embed_positions = randn(MAX_MODEL_LEN, HIDDEN, gen=gen, device=device, scale=0.5)   # (model) RoPE
        self.fc = randn(2 * HIDDEN, HIDDEN, gen=gen, device=device, scale=(2 * HIDDEN) ** -0.5)
        self.wq, self.wk, self.wv, self.wo = (randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6)
                                              for _ in range(4))
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.6)
        self.attn = Attention(LAYER_NAME, device)

    def __call__(self, input_ids, positions, inputs_embeds=None, hidden_states=None):
        emb = self.embed_tokens[input_ids.long()]
        h = torch.cat([emb, hidden_states], dim=-1) @ self.fc + self.embed_positions[positions.long()]
        h = h + self.attn(h @ self.wq, h @ self.wk, h @ self.wv) @ self.wo
        return h, h                                                  # (last_hidden_states, hidden_states)

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head


# --- vllm_ascend/compilation/acl_graph.py: ACLGraphWrapper ----------------------------------------------------------

class ACLGraphWrapper:
    def __init__(self, runnable, runtime_mode, device, static, state):
        self.runnable, self.runtime_mode, self.device = runnable, runtime_mode, device
        self.static, self.state = static, state
        self.graph_pool = graph_pool_handle(device)
        self.concrete_aclgraph_entries: dict = {}

    def __call__(self, *args, **kwargs):
        forward_context = get_forward_context()
        batch_descriptor = forward_context.batch_descriptor
        aclgraph_runtime_mode = forward_context.cudagraph_runtime_mode
        if aclgraph_runtime_mode == CUDAGraphMode.NONE or aclgraph_runtime_mode != self.runtime_mode:
            return self.runnable(*args, **kwargs)
        entry = self.concrete_aclgraph_entries.get(batch_descriptor)
        if entry is None:
            graph, output = capture(
                lambda: self.runnable(*args, **kwargs), device=self.device, pool=self.graph_pool, warmups=0,
                name=f"eagle draft FULL {batch_descriptor}", owner="SpecDecodeBaseProposer", static=self.static,
                state=self.state)
            tasks = get_draft_graph_params().handles[batch_descriptor.num_tokens]
            events.static_buffers("torch_npu graph task update", {
                f"{batch_descriptor.num_tokens}.fia_task{i}.{name}": getattr(task, name)
                for i, task in enumerate(tasks)
                for name in ("actual_seq_lengths", "actual_seq_lengths_kv", "block_table")})
            self.concrete_aclgraph_entries[batch_descriptor] = (graph, output)
            return output
        graph, output = entry
        return replay(graph, output, real=min(kwargs["batch_size"], output.shape[0]), size=output.shape[0])


# --- vllm/v1/spec_decode/eagle.py: EagleProposer (reduced) ----------------------------------------------------------

class EagleProposer:
    def __init__(self, vllm_config: VllmConfig, device, runner=None):
        self.vllm_config = vllm_config
        self.method = "eagle"
        self.runner = runner
        self.device = device
        self.max_model_len = vllm_config.max_model_len
        self.num_speculative_tokens = vllm_config.num_speculative_tokens
        self.max_num_tokens = vllm_config.max_num_batched_tokens
        self.token_arange_np = np.arange(self.max_num_tokens)
        self.hidden_size = HIDDEN
        # persistent buffers for cuda graph
        self.input_ids = torch.zeros(self.max_num_tokens, dtype=torch.int32, device=device)
        self.hidden_states = torch.zeros(self.max_num_tokens, self.hidden_size, device=device)
        # We need +1 here because the arange is used to set query_start_loc,
        # which has one more element than batch_size.
        max_batch_size = vllm_config.max_num_seqs
        max_num_slots_for_arange = max(max_batch_size + 1, self.max_num_tokens)
        self.arange = torch.arange(max_num_slots_for_arange, device=device, dtype=torch.int32)


# --- vllm_ascend/spec_decode/eagle_proposer.py ----------------------------------------------------------------------

class SpecDecodeBaseProposer(EagleProposer):
    def __init__(self, vllm_config: VllmConfig, device, pass_hidden_states_to_model: bool, runner=None,
                 variant="bug"):
        super().__init__(vllm_config, device, runner)
        self.pass_hidden_states_to_model = pass_hidden_states_to_model
        self.decode_threshold = 1 + self.num_speculative_tokens
        self.use_cuda_graph = self.runner._use_aclgraph() and not vllm_config.enforce_eager
        self.token_indices_to_sample = torch.zeros(vllm_config.max_num_batched_tokens, dtype=torch.int32,
                                                   device=device)
        slot_mapping_lens = self.runner.max_num_tokens + 2 * self.runner.max_num_reqs
        self.slot_mapping_group = [torch.zeros(slot_mapping_lens, dtype=torch.int32, device=device)
                                   for _ in range(self.num_speculative_tokens)]
        self._runnable = self._run_merged_draft
        # RoPE need (max_num_tokens,)
        self.positions = torch.zeros(self.max_num_tokens, dtype=torch.int32, device=device)

        if variant == "fix":
            self.token_arange_np = np.arange(self.max_num_tokens + 1)

    def load_model(self):
        self.model = EagleLlamaForCausalLM(self.device)
        self.attn_layer_names = [LAYER_NAME]
        self.draft_attn_groups = [AttentionGroup()]
        if self.use_cuda_graph and self.vllm_config.cudagraph_mode == CUDAGraphMode.FULL:
            static = {"drafter.input_ids": self.input_ids, "drafter.positions": self.positions,
                      "drafter.hidden_states": self.hidden_states,
                      "drafter.token_indices_to_sample": self.token_indices_to_sample}
            static |= {f"drafter.slot_mapping_group[{i}]": s for i, s in enumerate(self.slot_mapping_group)}
            state = {"draft.key_cache": self.model.attn.kv_cache[0], "draft.value_cache": self.model.attn.kv_cache[1]}
            self._runnable = ACLGraphWrapper(self._run_merged_draft, CUDAGraphMode.FULL, self.device, static, state)

    def shallow_copy_metadata(self, attn_metadata):
        return copy.copy(attn_metadata)

    def _get_positions(self, num_tokens):
        return self.positions[:num_tokens]

    def _set_positions(self, num_tokens, positions):
        self.positions[:num_tokens] = positions

    def dummy_run(self, num_tokens, in_graph_capturing=False, num_reqs=0,
                  aclgraph_runtime_mode=CUDAGraphMode.NONE, batch_descriptor=None):
        multi_steps_attn_metadata = []
        if not self.use_cuda_graph:
            aclgraph_runtime_mode = CUDAGraphMode.NONE
        if aclgraph_runtime_mode == CUDAGraphMode.FULL:
            # num_reqs is already the padded version
            common_attn_metadata = AscendCommonAttentionMetadata(
                query_start_loc=self.runner.query_start_loc.gpu[: num_reqs + 1],
                query_start_loc_cpu=self.runner.query_start_loc.cpu[: num_reqs + 1],
                seq_lens=self.runner.seq_lens.gpu[:num_reqs], seq_lens_cpu=self.runner.seq_lens.cpu,
                num_reqs=num_reqs, num_actual_tokens=num_tokens, num_input_tokens=num_tokens,
                max_query_len=self.num_speculative_tokens + 1,
                block_table_tensor=self.runner.block_table[:num_reqs],
                slot_mapping=self.runner.slot_mapping,          # This is used to hold a position.
                attn_state=AscendAttentionState.ChunkedPrefill)
            builder = self.draft_attn_groups[0].get_metadata_builder()
            # update the tensor's address for each step.
            for draft_step in range(self.num_speculative_tokens):
                common_attn_metadata = self.shallow_copy_metadata(common_attn_metadata)
                # Set the real slot_mapping.
                common_attn_metadata.slot_mapping = self.slot_mapping_group[draft_step]
                attn_metadata_eagle = builder.build_for_graph_capture(common_attn_metadata,
                                                                      AscendAttentionState.ChunkedPrefill)
                multi_steps_attn_metadata.append({name: attn_metadata_eagle for name in self.attn_layer_names})

        model_positions = self._get_positions(num_tokens)
        batch_size = max(num_tokens // (self.num_speculative_tokens + 1), 1)
        with set_ascend_forward_context(multi_steps_attn_metadata[0] if multi_steps_attn_metadata else None,
                                        num_tokens=num_tokens, batch_descriptor=batch_descriptor,
                                        aclgraph_runtime_mode=aclgraph_runtime_mode, is_draft_model=True,
                                        draft_attn_metadatas=multi_steps_attn_metadata):
            self._runnable(num_input_tokens=num_tokens, batch_size=batch_size,
                           token_indices_to_sample=self.token_indices_to_sample[:batch_size],
                           target_positions=model_positions, inputs_embeds=None,
                           multi_steps_attn_metadata=multi_steps_attn_metadata, num_tokens=num_tokens)

    def _propose(self, target_token_ids, target_positions, target_hidden_states, next_token_ids,
                 token_indices_to_sample, common_attn_metadata: AscendCommonAttentionMetadata,
                 target_model_batch_desc: BatchDescriptor):
        batch_size = common_attn_metadata.batch_size()
        num_tokens, token_indices_to_sample, common_attn_metadata = self.set_inputs_first_pass(
            target_token_ids, next_token_ids, target_positions, target_hidden_states, token_indices_to_sample,
            common_attn_metadata)
        if self.use_cuda_graph and num_tokens <= self.runner.cudagraph_batch_sizes[-1]:
            num_input_tokens = self.runner.cudagraph_dispatcher._bs_to_padded_graph_size[num_tokens]
        else:
            num_input_tokens = num_tokens
        if self.use_cuda_graph:
            aclgraph_runtime_mode, batch_descriptor = self.runner.cudagraph_dispatcher.dispatch(
                num_tokens=num_input_tokens, uniform_decode=target_model_batch_desc.uniform)
        else:
            aclgraph_runtime_mode, batch_descriptor = CUDAGraphMode.NONE, None

        if aclgraph_runtime_mode == CUDAGraphMode.FULL:
            num_reqs_padded = self.runner._pad_query_start_loc_for_fia(
                num_input_tokens, common_attn_metadata.num_reqs, common_attn_metadata.num_reqs)
            common_attn_metadata.num_reqs = num_reqs_padded
            common_attn_metadata.query_start_loc = self.runner.query_start_loc.gpu[: num_reqs_padded + 1]
            common_attn_metadata.query_start_loc_cpu = self.runner.query_start_loc.cpu[: num_reqs_padded + 1]
            common_attn_metadata.block_table_tensor = self._pad_tensor(common_attn_metadata.block_table_tensor,
                                                                       num_reqs_padded)
            common_attn_metadata.seq_lens = self.runner.seq_lens.gpu[:num_reqs_padded]
            common_attn_metadata.seq_lens_cpu = self.runner.seq_lens.cpu[:num_reqs_padded]

        # Update slot_mapping for different speculative.
        slot_mapping_lens = common_attn_metadata.slot_mapping.shape[0]
        self.slot_mapping_group[0][:slot_mapping_lens].copy_(common_attn_metadata.slot_mapping[:slot_mapping_lens])
        self.slot_mapping_group[0][slot_mapping_lens:].fill_(PADDING_SLOT_ID)
        common_attn_metadata.slot_mapping = self.slot_mapping_group[0]
        common_attn_metadata.num_input_tokens = num_input_tokens
        builder = self.draft_attn_groups[0].get_metadata_builder()
        attn_metadata = builder.build(0, common_attn_metadata)

        used_update_positions = self.positions[token_indices_to_sample.long()]
        per_layer_attn_metadata = {name: attn_metadata for name in self.attn_layer_names}
        multi_steps_attn_metadata = [per_layer_attn_metadata]
        # Clone the data so that when calculating the data at position 2 and position 3
        # in the merged graph, it does not affect position 1
        common_attn_metadata.block_table_tensor = common_attn_metadata.block_table_tensor.clone()
        for draft_step in range(1, self.num_speculative_tokens):
            per_layer_attn_metadata = dict()
            for attn_group in self.draft_attn_groups:
                common_attn_metadata, attn_metadata = self.attn_update_stack_num_spec_norm(
                    draft_step, attn_metadata, common_attn_metadata, batch_size, num_input_tokens,
                    used_update_positions, aclgraph_runtime_mode, attn_group=attn_group)
                for layer_name in self.attn_layer_names:
                    per_layer_attn_metadata[layer_name] = attn_metadata
            multi_steps_attn_metadata.append(per_layer_attn_metadata)

        token_indices_to_sample_len = token_indices_to_sample.shape[0]
        self.token_indices_to_sample[:token_indices_to_sample_len].copy_(token_indices_to_sample)

        with set_ascend_forward_context(multi_steps_attn_metadata[0], num_tokens=num_input_tokens,
                                        batch_descriptor=batch_descriptor,
                                        aclgraph_runtime_mode=aclgraph_runtime_mode, is_draft_model=True,
                                        draft_attn_metadatas=multi_steps_attn_metadata):
            forward_context = get_forward_context()
            if forward_context.cudagraph_runtime_mode == CUDAGraphMode.FULL:
                # upstream: right after the asynchronous replay below, which the updated FIA tasks wait for;
                # applied first here (synchronous emulation)
                self._update_full_graph_params(forward_context, num_input_tokens, multi_steps_attn_metadata)
            draft_token_ids = self._runnable(
                num_input_tokens=num_input_tokens, batch_size=batch_size,
                token_indices_to_sample=self.token_indices_to_sample[:token_indices_to_sample_len],
                target_positions=target_positions, inputs_embeds=None,
                multi_steps_attn_metadata=multi_steps_attn_metadata, num_tokens=num_tokens)
        return draft_token_ids

    def _run_merged_draft(self, num_input_tokens, batch_size, token_indices_to_sample, target_positions,
                          inputs_embeds, multi_steps_attn_metadata, num_tokens):
        model_input_ids = self.input_ids[:num_input_tokens]
        model_positions = self._get_positions(num_input_tokens)
        model_hidden_states = self.hidden_states[:num_input_tokens]
        last_hidden_states, hidden_states = self.model(input_ids=model_input_ids, positions=model_positions,
                                                       inputs_embeds=inputs_embeds,
                                                       hidden_states=model_hidden_states)
        sample_hidden_states = last_hidden_states[token_indices_to_sample.long()]
        logits = self.model.compute_logits(sample_hidden_states)
        draft_token_ids = logits.argmax(dim=-1)

        # Generate the remaining draft tokens.
        draft_token_ids_tensor = torch.zeros((self.num_speculative_tokens, *draft_token_ids.shape),
                                             dtype=draft_token_ids.dtype, device=self.device)
        draft_token_ids_tensor[0] = draft_token_ids
        positions = self.positions[token_indices_to_sample.long()]
        hidden_states = hidden_states[token_indices_to_sample.long()]
        token_indices_to_sample = self.arange[:batch_size]

        input_batch_size = num_input_tokens if (self.method == "mtp" or self.use_cuda_graph) else batch_size
        forward_context = get_forward_context()
        for draft_step in range(self.num_speculative_tokens - 1):
            input_ids = draft_token_ids_tensor[draft_step]
            positions += 1
            exceeds_max_model_len = positions >= self.max_model_len
            clamped_positions = torch.where(exceeds_max_model_len, 0, positions)
            # copy inputs to buffer for cudagraph
            self.input_ids[:batch_size] = input_ids
            self._set_positions(batch_size, clamped_positions)
            self.hidden_states[:batch_size] = hidden_states

            model_input_ids = self.input_ids[:input_batch_size]
            model_positions = self._get_positions(input_batch_size)
            model_hidden_states = self.hidden_states[:input_batch_size]
            forward_context.attn_metadata = (
                multi_steps_attn_metadata[draft_step + 1] if multi_steps_attn_metadata else None)
            last_hidden_states, hidden_states = self.model(input_ids=model_input_ids, positions=model_positions,
                                                           inputs_embeds=None, hidden_states=model_hidden_states)
            sample_hidden_states = last_hidden_states[token_indices_to_sample.long()]
            logits = self.model.compute_logits(sample_hidden_states)
            hidden_states = hidden_states[:batch_size]
            draft_token_ids = logits.argmax(dim=-1)
            draft_token_ids_tensor[draft_step + 1] = draft_token_ids

        # [batch_size, num_speculative_tokens]
        return draft_token_ids_tensor.swapaxes(0, 1)

    def set_inputs_first_pass(self, target_token_ids, next_token_ids, target_positions, target_hidden_states,
                              token_indices_to_sample, cad):
        # Default EAGLE pathway: rotate the input ids and insert the next token ids at the last slot of each request.
        if token_indices_to_sample is None:
            token_indices_to_sample = cad.query_start_loc[1:] - 1
        num_tokens = target_token_ids.shape[0]
        self.input_ids[: num_tokens - 1] = target_token_ids[1:]
        self.input_ids[token_indices_to_sample.long()] = next_token_ids
        # copy inputs to buffer for cudagraph
        self._set_positions(num_tokens, target_positions)
        self.hidden_states[:num_tokens] = target_hidden_states
        return num_tokens, token_indices_to_sample, cad

    def attn_update_stack_num_spec_norm(self, draft_step, old_attn_metadata, old_common_metadata, batch_size,
                                        input_batch_size, used_update_positions, aclgraph_runtime_mode,
                                        attn_group=None):
        assert draft_step > 0
        common_attn_metadata = self.shallow_copy_metadata(old_common_metadata)

        if draft_step == 1:
            if aclgraph_runtime_mode == CUDAGraphMode.FULL:
                common_attn_metadata.num_reqs = input_batch_size
                common_attn_metadata.block_table_tensor = self._pad_tensor(
                    common_attn_metadata.block_table_tensor, input_batch_size)
                common_attn_metadata.seq_lens = self._pad_tensor(common_attn_metadata.seq_lens, input_batch_size)
                common_attn_metadata.seq_lens_cpu = self._pad_tensor(common_attn_metadata.seq_lens_cpu,
                                                                     input_batch_size)
                common_attn_metadata.query_start_loc = self.arange[: input_batch_size + 1]
                common_attn_metadata.query_start_loc_cpu = host(torch.from_numpy(
                    self.token_arange_np[: input_batch_size + 1]).clone(), self.device)
            else:
                common_attn_metadata.query_start_loc = self.arange[: batch_size + 1]
                common_attn_metadata.query_start_loc_cpu = host(torch.from_numpy(
                    self.token_arange_np[: batch_size + 1]).clone(), self.device)

            common_attn_metadata.num_actual_tokens = batch_size
            common_attn_metadata.max_query_len = 1
            common_attn_metadata.attn_state = AscendAttentionState.ChunkedPrefill
            common_attn_metadata.num_input_tokens = input_batch_size

        # The loop part
        used_update_positions += 1
        common_attn_metadata.seq_lens = common_attn_metadata.seq_lens.clone()
        common_attn_metadata.seq_lens_cpu = common_attn_metadata.seq_lens_cpu.clone()

        exceeds_max_model_len = used_update_positions >= self.max_model_len
        clamped_positions = torch.where(exceeds_max_model_len, 0, used_update_positions)

        # Increment the sequence lengths.
        common_attn_metadata.seq_lens[:batch_size] += 1
        common_attn_metadata.seq_lens[:batch_size].masked_fill_(exceeds_max_model_len, 1)
        common_attn_metadata.seq_lens_cpu[:batch_size] = common_attn_metadata.seq_lens_cpu[:batch_size] + 1
        exceeds_mask = common_attn_metadata.seq_lens_cpu[:batch_size] >= self.max_model_len
        common_attn_metadata.seq_lens_cpu[:batch_size].masked_fill_(exceeds_mask, 1)

        # Compute the slot mapping.
        block_size = BLOCK_SIZE
        block_numbers = clamped_positions // block_size
        block_ids = old_common_metadata.block_table_tensor.gather(dim=1, index=block_numbers.view(-1, 1).long())
        block_ids = block_ids.view(-1)
        slot_mapping = block_ids * block_size + clamped_positions % block_size
        # Mask out the slot mappings that exceed the max model length.
        slot_mapping.masked_fill_(exceeds_max_model_len, PADDING_SLOT_ID)
        self.slot_mapping_group[draft_step][: slot_mapping.shape[0]].copy_(slot_mapping.to(torch.int32))
        self.slot_mapping_group[draft_step][slot_mapping.shape[0]:].fill_(PADDING_SLOT_ID)
        common_attn_metadata.slot_mapping = self.slot_mapping_group[draft_step]

        attn_metadata = attn_group.get_metadata_builder().build_for_drafting(
            common_attn_metadata=common_attn_metadata, draft_index=draft_step)
        return common_attn_metadata, attn_metadata

    # update full-graph params for one spec token
    def _update_full_graph_params(self, forward_context, num_tokens, draft_attn_metadatas=None):
        AscendAttentionBackendImpl.update_graph_params(None, forward_context, num_tokens,
                                                       draft_attn_metadatas=draft_attn_metadatas)

    # padding tensor into desired size
    def _pad_tensor(self, tensor, desired_size):
        pad_size = desired_size - tensor.shape[0]
        if pad_size > 0:
            pad = [0] * (2 * tensor.dim() - 1) + [pad_size]
            tensor = F.pad(tensor, pad, mode="constant", value=0)
        else:
            tensor = tensor[:desired_size]
        return tensor


# --- vllm/v1/cudagraph_dispatcher.py (reduced) ----------------------------------------------------------------------

class CudagraphDispatcher:
    def __init__(self, vllm_config: VllmConfig):
        sizes = sorted(vllm_config.cudagraph_capture_sizes)
        self.cudagraph_keys = ({BatchDescriptor(s, uniform=True) for s in sizes}
                               if vllm_config.cudagraph_mode == CUDAGraphMode.FULL else set())
        self._bs_to_padded_graph_size = [0] * (sizes[-1] + 1)
        for bs in range(sizes[-1] + 1):
            self._bs_to_padded_graph_size[bs] = next(s for s in sizes if s >= bs)

    def dispatch(self, num_tokens, uniform_decode=False, has_lora=False):
        batch_descriptor = BatchDescriptor(num_tokens, uniform=uniform_decode)
        if batch_descriptor in self.cudagraph_keys:
            return CUDAGraphMode.FULL, batch_descriptor
        return CUDAGraphMode.NONE, None


# --- vllm_ascend/worker/model_runner_v1.py (reduced) ----------------------------------------------------------------

class CpuGpuBuffer:
    def __init__(self, size, dtype, device):
        self.cpu = host(torch.zeros(size, dtype=dtype), device)
        self.np = self.cpu.numpy()
        self.gpu = torch.zeros(size, dtype=dtype, device=device)

    def copy_to_gpu(self):
        return self.gpu.copy_(self.cpu, non_blocking=True)


class NPUModelRunner:
    def __init__(self, vllm_config: VllmConfig, device, variant):
        self.vllm_config, self.device = vllm_config, device
        self.max_num_tokens = vllm_config.max_num_batched_tokens
        self.max_num_reqs = vllm_config.max_num_seqs
        self.uniform_decode_query_len = 1 + vllm_config.num_speculative_tokens
        self.arange_np = np.arange(max(self.max_num_reqs + 1, self.max_num_tokens))
        # NOTE: For FULL mode we change +1 to +2 to reserve extra space for padding.
        # See _pad_query_start_loc_for_fia.
        self.query_start_loc = CpuGpuBuffer(self.max_num_reqs + 2, torch.int32, device)
        self.seq_lens = CpuGpuBuffer(self.max_num_reqs, torch.int32, device)
        self.block_table = torch.zeros(self.max_num_reqs, MAX_BLOCKS_PER_REQ, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((self.max_num_tokens,), PADDING_SLOT_ID, dtype=torch.int32, device=device)
        self.cudagraph_batch_sizes = sorted(vllm_config.cudagraph_capture_sizes)
        self.cudagraph_dispatcher = CudagraphDispatcher(vllm_config)
        self.drafter = SpecDecodeBaseProposer(vllm_config, device, True, runner=self, variant=variant)
        self.drafter.load_model()
        if self._use_aclgraph():
            self.capture_model()

    def _use_aclgraph(self):
        return self.vllm_config.cudagraph_mode != CUDAGraphMode.NONE and not self.vllm_config.enforce_eager

    def _pad_query_start_loc_for_fia(self, num_tokens_padded, num_reqs_padded, num_reqs,
                                     cudagraph_runtime_mode=None, batch_desc_num_reqs=None):
        """This function is only designed to satisfied the constraint that when the layout is TND,
        the first dimension of `hidden_states` must equal the last element of `actual_seq_lengths_q`."""
        num_reqs_padded = batch_desc_num_reqs if batch_desc_num_reqs is not None else num_reqs
        if num_tokens_padded == num_reqs_padded * self.uniform_decode_query_len:
            assert num_reqs <= num_reqs_padded
            last_loc = self.query_start_loc.np[num_reqs]
            self.query_start_loc.np[num_reqs + 1: num_reqs_padded + 1] = (
                self.arange_np[1: num_reqs_padded + 1 - num_reqs] * self.uniform_decode_query_len + last_loc)
        else:
            assert num_reqs == num_reqs_padded
            # Insert a dummy request instead of setting query_start_loc[num_reqs] = num_tokens_padded directly
            self.query_start_loc.np[num_reqs_padded + 1] = num_tokens_padded
            num_reqs_padded = num_reqs_padded + 1
        self.query_start_loc.copy_to_gpu()
        return num_reqs_padded

    def _dummy_run(self, num_tokens, aclgraph_runtime_mode, is_graph_capturing):
        num_reqs = num_tokens // self.uniform_decode_query_len          # uniform decode batch
        self.seq_lens.np[:num_reqs] = self.uniform_decode_query_len      # max_query_len
        self.seq_lens.np[num_reqs:] = 0
        self.seq_lens.copy_to_gpu()
        self.query_start_loc.np[1: num_reqs + 1] = np.cumsum([self.uniform_decode_query_len] * num_reqs)
        self.query_start_loc.copy_to_gpu()
        num_reqs_padded = self._pad_query_start_loc_for_fia(num_tokens, num_reqs, num_reqs, aclgraph_runtime_mode,
                                                            num_reqs)
        # (the target model's dummy forward is not modelled)
        self.drafter.dummy_run(num_tokens=num_tokens, num_reqs=num_reqs_padded,
                               aclgraph_runtime_mode=aclgraph_runtime_mode,
                               batch_descriptor=BatchDescriptor(num_tokens, uniform=True),
                               in_graph_capturing=is_graph_capturing)

    def capture_model(self):
        set_draft_graph_params(self.cudagraph_batch_sizes, self.device)
        _EXTRA_CTX.capturing = True
        try:
            for num_tokens in reversed(self.cudagraph_batch_sizes):
                self._dummy_run(num_tokens, CUDAGraphMode.FULL, is_graph_capturing=True)
        finally:
            _EXTRA_CTX.capturing = False

    def propose_draft_token_ids(self, scheduled):
        """``scheduled``: per request, (its blocks, tokens computed before this step, the NUM_SPEC + 1 tokens the
        target verified, the token it sampled next, the target's hidden states for the verified tokens)."""
        n = len(scheduled)
        q = self.uniform_decode_query_len
        num_tokens = n * q
        dev = self.device
        self.query_start_loc.np[: n + 1] = self.arange_np[: n + 1] * q
        self.query_start_loc.copy_to_gpu()
        self.seq_lens.np[:n] = [c + q for _, c, _, _, _ in scheduled]
        self.seq_lens.np[n:] = 0
        self.seq_lens.copy_to_gpu()
        positions = [c + i for _, c, _, _, _ in scheduled for i in range(q)]
        slots = [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                 for blocks, c, _, _, _ in scheduled for p in range(c, c + q)]
        self.slot_mapping[:num_tokens].copy_(torch.tensor(slots, dtype=torch.int32).to(dev))
        self.slot_mapping[num_tokens:].fill_(PADDING_SLOT_ID)
        table = [blocks + [0] * (MAX_BLOCKS_PER_REQ - len(blocks)) for blocks, _, _, _, _ in scheduled]
        self.block_table[:n].copy_(torch.tensor(table, dtype=torch.int32).to(dev))
        cad = AscendCommonAttentionMetadata(
            query_start_loc=self.query_start_loc.gpu[: n + 1], query_start_loc_cpu=self.query_start_loc.cpu[: n + 1],
            seq_lens=self.seq_lens.gpu[:n], seq_lens_cpu=self.seq_lens.cpu[:n], num_reqs=n,
            num_actual_tokens=num_tokens, num_input_tokens=num_tokens, max_query_len=q,
            block_table_tensor=self.block_table[:n], slot_mapping=self.slot_mapping[:num_tokens],
            attn_state=AscendAttentionState.ChunkedPrefill)
        # prepare_inputs_padded: every draft accepted, so no token is rejected
        token_indices_to_sample = cad.query_start_loc[1:] - 1
        target_token_ids = torch.tensor([t for _, _, toks, _, _ in scheduled for t in toks],
                                        dtype=torch.int32).to(dev)
        next_token_ids = torch.tensor([nt for _, _, _, nt, _ in scheduled], dtype=torch.int32).to(dev)
        target_positions = torch.tensor(positions, dtype=torch.int32).to(dev)
        target_hidden_states = torch.cat([h for _, _, _, _, h in scheduled]).to(dev)
        draft = self.drafter._propose(target_token_ids, target_positions, target_hidden_states, next_token_ids,
                                      token_indices_to_sample, cad, BatchDescriptor(num_tokens, uniform=True))
        return draft[:n].clone()


# --- the workload ----------------------------------------------------------------------------------------------------

def run(variant: str, device: str = "cpu"):
    gen = generator(77401)
    q = 1 + NUM_SPECULATIVE_TOKENS
    blocks = {"A": list(range(1, 1 + MAX_BLOCKS_PER_REQ)),
              "B": list(range(1 + MAX_BLOCKS_PER_REQ, 1 + 2 * MAX_BLOCKS_PER_REQ))}
    computed = {"A": 5, "B": 2}
    # decode steps: one request (4 tokens: graph 4), then both (8 tokens = max_num_batched_tokens: graph 8)
    schedule = [["A"], ["A", "B"], ["A", "B"], ["A"]]
    steps = []
    for reqs in schedule:
        step = []
        for r in reqs:
            toks = torch.randint(0, VOCAB, (q,), generator=gen).tolist()
            next_tok = int(torch.randint(0, VOCAB, (1,), generator=gen))
            hidden = torch.randn(q, HIDDEN, generator=gen)
            step.append((blocks[r], computed[r], toks, next_tok, hidden))
            computed[r] += q
        steps.append(step)

    def serve(use_graphs: bool):
        mode = CUDAGraphMode.FULL if use_graphs else CUDAGraphMode.NONE
        runner = NPUModelRunner(VllmConfig(cudagraph_mode=mode, cudagraph_capture_sizes=CUDAGRAPH_CAPTURE_SIZES),
                                device, variant)
        return [runner.propose_draft_token_ids(step) for step in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
