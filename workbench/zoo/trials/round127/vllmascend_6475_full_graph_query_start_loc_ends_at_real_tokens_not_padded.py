"""vLLM-Ascend FULL ACL graphs: the runner pads ``query_start_loc`` in ``_prepare_inputs``, before the graph's padded sizes are known, as if every padded request were a uniform decode; with FULL graph keys (whose request count is not padded) ``actual_seq_lengths_q`` then ends at the real token count while the replayed FIA task holds a query of the padded token count, and the TND-layout contract of the fused infer attention operator fails on the first padded step.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/6475 ("[ModelRunner][Fix] Pads query_start_loc to satisfy
FIA/TND constraint", vllm-project/vllm-ascend, by Yizhou Liu (yiz-liu), merged 2026-02-04 as commit 2ee4f23f28; the
re-land of #6357 (56f5d3bd49, 2026-01-30) after its revert #6459, without #6357's assertion in
``_build_attention_metadata``). Read: the commit messages of #6357 and #6475 and both diffs of
``vllm_ascend/worker/model_runner_v1.py`` (query_start_loc buffer widened to ``max_num_reqs + 2``; new
``_pad_query_start_loc_for_fia`` with a uniform-batch branch and a mixed-batch branch that appends a dummy request ending
at ``num_tokens_padded``; the uniform padding removed from ``_prepare_inputs``; the helper called in ``execute_model``
when ``cudagraph_mode == CUDAGraphMode.FULL`` and in ``_dummy_run``) and #6357's new e2e FULL-mode accuracy case
(``CASE_QWEN_FULL``, ``test_full_res_consistency``). At the parent commit 2ee4f23f28^:
``NPUModelRunner._prepare_inputs`` (query_start_loc / seq_lens), ``execute_model`` (``num_tokens_padded =
batch_desc.num_tokens``, ``num_reqs_padded = batch_desc.num_reqs`` or ``num_reqs``), ``_build_attention_metadata``
(``query_start_loc_cpu[:num_reqs_padded + 1]``, slot mapping ``[num_tokens:num_tokens_padded] = -1``, block-table rows
``[num_reqs:num_reqs_padded] = 0``), ``_model_forward`` (``update_full_graph_params`` for FULL replays), ``_dummy_run``;
``compilation/acl_graph.py`` (``ACLGraphWrapper.__call__``, ``GraphParams``, ``update_full_graph_params``);
``attention/attention_v1.py`` (``AscendAttentionMetadataBuilder.build``: ``actual_seq_lengths_q =
query_start_loc_cpu[1:].tolist()``, ``seq_lens_list``; ``forward_fused_infer_attention``, ``full_graph_fia``,
``update_graph_params``: ``npu_fused_infer_attention_score.out`` with ``input_layout="TND"`` between
``graph_task_update_begin/end``). The CANN error text is quoted in vllm-ascend #6535 ("When layout is TND, queryT(72)
must be equal to the last element of actualSequenceLengthQ(65)"); vLLM's ``BatchDescriptor.relax_for_mixed_batch_cudagraphs``
(``num_reqs=None`` for mixed FULL keys) read in stored copies of vLLM's ``forward_context.py``, and vllm-ascend #14394's
note that vLLM #34043 later deleted it. Not read: vLLM's ``cudagraph_dispatcher.py`` at dc917cce (that FULL keys are
the relaxed ones is inferred from the above) and no issue thread (none is linked from either PR).
Symptom: the PRs say the change "prevents kernel mismatches or failures ... for FIA/TND execution in full graph
modes". As the mechanism implies (and as modelled): serving with ``cudagraph_mode: FULL`` fails on the first step whose
token count is padded up to a capture size: the FIA graph-task update raises the TND-layout error; eager serving and
steps that hit a capture size exactly are fine.
Mechanism: ``_prepare_inputs`` writes ``query_start_loc[num_reqs + 1:]`` as ``cu_num_tokens[-1] + k *
uniform_decode_query_len``, which only lands on the padded token count when the descriptor pads the request count too
(FULL_DECODE_ONLY's uniform keys). A FULL key is relaxed (``num_reqs=None``), so ``num_reqs_padded = num_reqs`` and the
metadata's ``actual_seq_lengths_q = query_start_loc[1:num_reqs + 1]`` ends at the real token count. The model runs at
the padded size (query of ``num_tokens_padded`` rows, captured that way), and ``update_graph_params`` hands FIA that
query with the real-row lengths; TND requires ``query.shape[0] == actual_seq_lengths_q[-1]``. Eager runs unpadded and
slices the query to ``actual_seq_lengths_q[-1]``.
Doctor: padded-shape-mismatch, at _prepare_inputs. At the graph's padded size the FIA launch combines the query sized
for the padded token rows with ``actual_seq_lengths_q`` sized for the real rows, because ``_prepare_inputs`` pads the
cumulative lengths without the step's padded sizes.
Fix (upstream): drop the padding from ``_prepare_inputs``; after the padded sizes are known, ``execute_model`` (FULL)
and ``_dummy_run`` call ``_pad_query_start_loc_for_fia``, which for a non-uniform key appends a dummy request
``[num_tokens, num_tokens_padded)`` (``num_reqs_padded + 1``), so the last element equals the padded token count.
Modelled: ``NPUModelRunner`` (``_prepare_inputs`` with the CpuGpuBuffers ``query_start_loc`` / ``seq_lens``,
``_build_attention_metadata``, ``_determine_batch_execution_and_padding``, ``execute_model``, ``_model_forward``,
``_dummy_run``, ``capture_model`` with an eager warmup dummy run then the FULL capture per size,
``_pad_query_start_loc_for_fia``),
``ACLGraphWrapper`` (capture on first FULL call per key, replay after), ``GraphParams`` / ``update_full_graph_params``,
``AscendAttentionMetadataBuilder.build`` and ``AscendAttentionBackendImpl`` (``reshape_and_cache``,
``forward_fused_infer_attention``, ``full_graph_fia``, ``update_graph_params``), a forward context. Stand-ins: FIA is a
torch paged attention whose tiling (request and KV length of each query row) is built on the host from
``actual_seq_lengths`` / ``actual_seq_lengths_kv``, after the TND checks; a captured launch keeps that tiling in pinned
host memory that it copies in at every replay, and ``graph_task_update_begin/end`` + ``.out`` re-tile it (the host-side
task update); the ExternalEvent wait that orders the replayed FIA after the update is modelled by running
``update_full_graph_params`` just before the replay; the vLLM dispatcher is reduced to FULL keys per capture size,
relaxed (``num_reqs=None``); a 2-layer decoder with learned positions (no RoPE, no sampler: later tokens fixed in
advance); ``PAD_SLOT_ID`` writes go to a scratch slot; block 0 is the null block; float64.
Workload: FULL mode, capture sizes 4 and 8, max_num_seqs 8. Step 1 prefills A (5) and B (3): 8 tokens, graph 8 exactly.
Step 2 decodes A, B and prefills C (2): 4 tokens, graph 4 exactly. Step 3 decodes A, B, C and prefills D (3): 6 tokens
in 4 requests, padded to graph 8. Step 4 decodes A, B, C, D (graph 4). Step 5 decodes A, B, D: 3 tokens, padded to 4.
Measured: bug: step 3 raises RuntimeError from the FIA task update ("When layout is TND, queryT(8) must be equal to the
last element of actualSequenceLengthQ(6)"), after steps 1-2 were replayed. Fix: steps 3 and 5 get a dummy request
([6, 8), [3, 4)) and the 25 real rows of the five steps equal eager (max |graph - eager| = 2.2e-15 over steps 3-5,
float64 rounding of the matmuls at padded sizes, carried on through the KV cache; 0 in steps 1-2).
"""
from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import torch
import torch.nn.functional as F

from workbench.engine import graph_pool_handle, host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/6475"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "_prepare_inputs"
SYMPTOM = ("FULL ACL graph mode on Ascend: on a padded step actual_seq_lengths_q ends at the real token count while the "
           "replayed FIA task holds the padded query, and the TND-layout check of the fused infer attention fails")

VOCAB, HIDDEN, N_HEADS, HEAD_DIM, INTER, N_LAYERS, MAX_MODEL_LEN = 32, 16, 2, 8, 24, 2, 16
BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS_PER_REQ = 4, 16, 4
MAX_NUM_REQS, MAX_NUM_TOKENS = 8, 16
CUDAGRAPH_CAPTURE_SIZES = [4, 8]
PAD_SLOT_ID = -1
SCRATCH_SLOT = NUM_BLOCKS * BLOCK_SIZE          # where reshape_and_cache sends PAD_SLOT_ID writes (stand-in)
DTYPE = torch.float64

_variant = "bug"


# --- vllm/config CUDAGraphMode, vllm/forward_context.py BatchDescriptor, vllm/v1/cudagraph_dispatcher.py (reduced) ---

NONE, FULL = "NONE", "FULL"


@dataclasses.dataclass(frozen=True)
class BatchDescriptor:
    num_tokens: int
    num_reqs: int | None = None
    uniform: bool = False

    def relax_for_mixed_batch_cudagraphs(self) -> "BatchDescriptor":
        return BatchDescriptor(self.num_tokens, num_reqs=None, uniform=False)


class CudagraphDispatcher:
    """cudagraph_mode FULL: one FULL key per capture size, relaxed for mixed prefill-decode batches."""

    def __init__(self, capture_sizes):
        self.capture_sizes = sorted(capture_sizes)
        self.keys = {BatchDescriptor(s).relax_for_mixed_batch_cudagraphs() for s in self.capture_sizes}

    def dispatch(self, num_tokens: int, force_eager: bool = False):
        if force_eager or num_tokens > self.capture_sizes[-1]:
            return NONE, BatchDescriptor(num_tokens)
        padded = next(s for s in self.capture_sizes if s >= num_tokens)
        desc = BatchDescriptor(padded, num_reqs=min(padded, MAX_NUM_REQS)).relax_for_mixed_batch_cudagraphs()
        return (FULL, desc) if desc in self.keys else (NONE, BatchDescriptor(num_tokens))


# --- vllm/forward_context.py + vllm_ascend/ascend_forward_context.py (reduced) -------------------------------------

@dataclasses.dataclass
class ForwardContext:
    attn_metadata: dict | None
    cudagraph_runtime_mode: str
    batch_descriptor: BatchDescriptor | None
    num_actual_tokens: int
    capturing: bool = False


_forward_context: ForwardContext | None = None


@contextlib.contextmanager
def set_ascend_forward_context(attn_metadata, num_tokens, aclgraph_runtime_mode, batch_descriptor, num_actual_tokens):
    global _forward_context
    prev = _forward_context
    _forward_context = ForwardContext(attn_metadata, aclgraph_runtime_mode, batch_descriptor, num_actual_tokens)
    try:
        yield
    finally:
        _forward_context = prev


def get_forward_context() -> ForwardContext:
    return _forward_context


# --- torch_npu.npu_fused_infer_attention_score (stand-in) -------------------------------------------------------------

_task_update = None     # set between graph_task_update_begin / graph_task_update_end


@contextlib.contextmanager
def graph_task_update(handle):
    """torch.npu.graph_task_update_begin(update_stream, handle) ... graph_task_update_end(update_stream)."""
    global _task_update
    _task_update = handle
    try:
        yield
    finally:
        _task_update = None


class FIATask:
    """One FIA launch's tiling: the request and the KV length of each query row, built on the host."""

    def __init__(self, device):
        self.device = device
        self.token_req_host = host(torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64), device)
        self.token_kv_len_host = host(torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64), device)
        self.token_req = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)
        self.token_kv_len = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)

    def tile(self, num_query_rows, actual_seq_lengths, actual_seq_lengths_kv):
        if len(actual_seq_lengths) != len(actual_seq_lengths_kv):
            raise RuntimeError(f"batch of actualSequenceLengthQ({len(actual_seq_lengths)}) must be equal to batch of "
                               f"actualSequenceLengthKV({len(actual_seq_lengths_kv)})")
        if num_query_rows != actual_seq_lengths[-1]:                         # input_layout TND
            raise RuntimeError(f"When layout is TND, queryT({num_query_rows}) must be equal to the last element of "
                               f"actualSequenceLengthQ({actual_seq_lengths[-1]})")
        req, kv_len, start = [], [], 0
        for r, (end, kv) in enumerate(zip(actual_seq_lengths, actual_seq_lengths_kv)):
            for t in range(start, end):
                req.append(r)
                kv_len.append(kv - (end - 1 - t))                   # causal: row t sees its own position and before
            start = end
        self.token_req_host.numpy()[:num_query_rows] = req
        self.token_kv_len_host.numpy()[:num_query_rows] = kv_len

    def launch(self, query, key_cache, value_cache, block_table, scale):
        n = query.size(0)
        self.token_req.copy_(self.token_req_host, non_blocking=True)
        self.token_kv_len.copy_(self.token_kv_len_host, non_blocking=True)
        tables = block_table[self.token_req[:n]].long()                               # [n, MAX_BLOCKS_PER_REQ]
        ctx = torch.arange(MAX_BLOCKS_PER_REQ * BLOCK_SIZE, device=query.device)
        slots = tables[:, ctx // BLOCK_SIZE] * BLOCK_SIZE + ctx % BLOCK_SIZE
        k, v = key_cache[slots], value_cache[slots]                                   # [n, ctx, H, D]
        scores = torch.einsum("thd,tchd->thc", query, k) * scale
        masked = ctx[None, :] >= self.token_kv_len[:n, None]
        return torch.einsum("thc,tchd->thd", scores.masked_fill(masked[:, None, :], -1e30).softmax(-1), v)


def npu_fused_infer_attention_score(query, key, value, block_table, actual_seq_lengths, actual_seq_lengths_kv,
                                    scale, input_layout="TND"):
    task = FIATask(query.device)
    task.tile(query.size(0), actual_seq_lengths, actual_seq_lengths_kv)
    return task.launch(query, key, value, block_table, scale)


def npu_fused_infer_attention_score_out(query, key, value, block_table, actual_seq_lengths, actual_seq_lengths_kv,
                                        scale, task: FIATask, out, input_layout="TND"):
    """``.out`` variant: a launch (captured into the graph) or, inside a task update, a re-tiling of the launch."""
    task.tile(query.size(0), actual_seq_lengths, actual_seq_lengths_kv)
    if _task_update is None:
        out.copy_(task.launch(query, key, value, block_table, scale))


# --- vllm_ascend/compilation/acl_graph.py (reduced) ----------------------------------------------------------------

@dataclasses.dataclass
class GraphParams:
    handles: dict
    attn_params: dict


_graph_params: GraphParams | None = None


def set_graph_params(aclgraph_capture_sizes):
    global _graph_params
    _graph_params = GraphParams({s: [] for s in aclgraph_capture_sizes}, {s: [] for s in aclgraph_capture_sizes})


def get_graph_params() -> GraphParams:
    return _graph_params


def update_full_graph_params(attn_backend, update_stream, forward_context, num_tokens):
    attn_backend.get_impl_cls().update_graph_params(update_stream, forward_context, num_tokens)


@dataclasses.dataclass
class ACLGraphEntry:
    batch_descriptor: BatchDescriptor
    aclgraph: object = None
    output: object = None


class ACLGraphWrapper:
    def __init__(self, runnable, device, runtime_mode, graph_pool, static, state):
        self.runnable, self.device, self.runtime_mode = runnable, device, runtime_mode
        self.graph_pool, self.static, self.state = graph_pool, static, state
        self.concrete_aclgraph_entries: dict[BatchDescriptor, ACLGraphEntry] = {}

    def __call__(self, *args):
        forward_context = get_forward_context()
        batch_descriptor = forward_context.batch_descriptor
        if forward_context.cudagraph_runtime_mode != self.runtime_mode:
            return self.runnable(*args)
        entry = self.concrete_aclgraph_entries.setdefault(batch_descriptor, ACLGraphEntry(batch_descriptor))
        if entry.aclgraph is None:
            forward_context.capturing = True
            entry.aclgraph, entry.output = capture(lambda: self.runnable(*args), device=self.device, pool=self.graph_pool,
                                                   warmups=0, static=self.static, state=self.state,
                                                   owner="ACLGraphWrapper",
                                                   name=f"FULL aclgraph {batch_descriptor.num_tokens}")
            return entry.output
        return replay(entry.aclgraph, entry.output, real=forward_context.num_actual_tokens,
                      size=batch_descriptor.num_tokens)


# --- vllm_ascend/attention/attention_v1.py (reduced) -----------------------------------------------------------------

@dataclasses.dataclass
class AscendMetadata:
    num_actual_tokens: int
    block_tables: torch.Tensor
    seq_lens_list: list
    actual_seq_lengths_q: list
    slot_mapping: torch.Tensor


class AscendAttentionMetadataBuilder:
    def build(self, common_attn_metadata: dict) -> AscendMetadata:
        num_reqs = common_attn_metadata["num_reqs"]
        query_start_loc_cpu = common_attn_metadata["query_start_loc_cpu"][:num_reqs + 1]
        seq_lens = common_attn_metadata["seq_lens_cpu"][:num_reqs]
        return AscendMetadata(
            num_actual_tokens=common_attn_metadata["num_actual_tokens"],
            block_tables=common_attn_metadata["block_table_tensor"],
            seq_lens_list=seq_lens.tolist(),
            actual_seq_lengths_q=query_start_loc_cpu[1:].tolist(),
            slot_mapping=common_attn_metadata["slot_mapping"][:common_attn_metadata["num_actual_tokens"]])


class AscendAttentionBackendImpl:
    def __init__(self):
        self.num_heads, self.head_size, self.scale = N_HEADS, HEAD_DIM, HEAD_DIM ** -0.5

    def reshape_and_cache(self, key, value, kv_cache, attn_metadata):
        n = attn_metadata.num_actual_tokens
        slots = attn_metadata.slot_mapping[:n]
        slots = torch.where(slots >= 0, slots, SCRATCH_SLOT)             # PAD_SLOT_ID: no write (stand-in)
        kv_cache[0].index_copy_(0, slots, key[:n])
        kv_cache[1].index_copy_(0, slots, value[:n])

    def full_graph_fia(self, query, kv_cache, attn_metadata, output):
        num_tokens = attn_metadata.actual_seq_lengths_q[-1]
        graph_params = get_graph_params()
        actual_seq_lengths_q = attn_metadata.actual_seq_lengths_q
        task = FIATask(query.device)
        graph_params.attn_params[num_tokens].append(
            (query, kv_cache[0], kv_cache[1], attn_metadata.block_tables, attn_metadata.seq_lens_list,
             actual_seq_lengths_q, self.scale, output, task))
        npu_fused_infer_attention_score_out(query, kv_cache[0], kv_cache[1], attn_metadata.block_tables,
                                            actual_seq_lengths_q, attn_metadata.seq_lens_list, self.scale,
                                            task=task, out=output, input_layout="TND")
        graph_params.handles[num_tokens].append(task)
        return output, num_tokens

    def forward_fused_infer_attention(self, query, kv_cache, attn_metadata, output):
        if getattr(get_forward_context(), "capturing", False):
            attn_output, num_tokens = self.full_graph_fia(query, kv_cache, attn_metadata, output)
            output[:num_tokens] = attn_output[:num_tokens]
            return output
        num_tokens = attn_metadata.actual_seq_lengths_q[-1]
        query = query[:num_tokens]
        attn_output = npu_fused_infer_attention_score(query, kv_cache[0], kv_cache[1], attn_metadata.block_tables,
                                                      attn_metadata.actual_seq_lengths_q,
                                                      attn_metadata.seq_lens_list, self.scale, input_layout="TND")
        output[:num_tokens] = attn_output[:num_tokens]
        return output

    def forward(self, query, key, value, kv_cache, attn_metadata, output):
        self.reshape_and_cache(key, value, kv_cache, attn_metadata)
        return self.forward_fused_infer_attention(query, kv_cache, attn_metadata, output)

    @staticmethod
    def update_graph_params(update_stream, forward_context, num_tokens):
        graph_params = get_graph_params()
        attn_metadata = forward_context.attn_metadata
        attn_keys = list(attn_metadata.keys())
        for key, param, handle in zip(attn_keys, graph_params.attn_params[num_tokens],
                                      graph_params.handles[num_tokens]):
            (query, key_cache, value_cache, block_tables, _, _, scale, attn_output, task) = param
            seq_lens = attn_metadata[key].seq_lens_list
            actual_seq_lengths_q = attn_metadata[key].actual_seq_lengths_q
            with graph_task_update(handle):
                npu_fused_infer_attention_score_out(query, key_cache, value_cache, block_tables,
                                                    actual_seq_lengths_q, seq_lens, scale, task=task,
                                                    out=attn_output, input_layout="TND")


class AscendAttentionBackend:
    @staticmethod
    def get_impl_cls():
        return AscendAttentionBackendImpl


# --- the model (stand-in 2-layer decoder) ------------------------------------------------------------------------------

def rms_norm(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class DecoderLayer:
    def __init__(self, prefix, gen, device):
        r = lambda *s, scale=0.3: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.layer_name = prefix
        self.qkv, self.o = r(3 * HIDDEN, HIDDEN), r(HIDDEN, HIDDEN)
        self.gate_up, self.down = r(2 * INTER, HIDDEN), r(HIDDEN, INTER)
        self.in_norm, self.post_norm = 1.0 + r(HIDDEN, scale=0.1), 1.0 + r(HIDDEN, scale=0.1)
        self.impl = AscendAttentionBackendImpl()

    def forward(self, h, kv_cache):
        attn_metadata = get_forward_context().attn_metadata[self.layer_name]
        q, k, v = F.linear(rms_norm(h, self.in_norm), self.qkv).view(-1, 3, N_HEADS, HEAD_DIM).unbind(1)
        output = torch.empty_like(q)
        attn = self.impl.forward(q, k, v, kv_cache, attn_metadata, output)
        h = h + F.linear(attn.reshape(-1, HIDDEN), self.o)
        gate, up = F.linear(rms_norm(h, self.post_norm), self.gate_up).chunk(2, dim=-1)
        return h + F.linear(F.silu(gate) * up, self.down)


class Model:
    def __init__(self, device, kv_caches):
        gen = generator(6475)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device).to(DTYPE)
        self.embed_positions = randn(MAX_MODEL_LEN, HIDDEN, gen=gen, device=device, scale=0.5).to(DTYPE)
        self.layers = [DecoderLayer(f"model.layers.{i}.self_attn.attn", gen, device) for i in range(N_LAYERS)]
        self.norm = 1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1).to(DTYPE)
        self.kv_caches = kv_caches

    def __call__(self, input_ids, positions):
        h = self.embed_tokens[input_ids] + self.embed_positions[positions]
        for layer, kv_cache in zip(self.layers, self.kv_caches):
            h = layer.forward(h, kv_cache)
        return rms_norm(h, self.norm)


# --- vllm CpuGpuBuffer / InputBatch block table (reduced) --------------------------------------------------------------

class CpuGpuBuffer:
    def __init__(self, n, dtype, device):
        self.cpu = host(torch.zeros(n, dtype=dtype), device)
        self.np = self.cpu.numpy()
        self.gpu = torch.zeros(n, dtype=dtype, device=device)

    def copy_to_gpu(self, n=None):
        n = self.np.shape[0] if n is None else n
        self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)
        return self.gpu[:n]


class BlockTable:
    def __init__(self, device):
        self.block_table = CpuGpuBuffer(MAX_NUM_REQS * MAX_BLOCKS_PER_REQ, torch.int32, device)
        self.slot_mapping = CpuGpuBuffer(MAX_NUM_TOKENS, torch.int64, device)
        self.slot_mapping.gpu.fill_(PAD_SLOT_ID)

    def commit_block_table(self, num_reqs):
        self.block_table.copy_to_gpu(num_reqs * MAX_BLOCKS_PER_REQ)

    def get_device_tensor(self):
        return self.block_table.gpu.view(MAX_NUM_REQS, MAX_BLOCKS_PER_REQ)


# --- vllm_ascend/worker/model_runner_v1.py (reduced) -----------------------------------------------------------------

class NPUModelRunner:
    def __init__(self, device, enforce_eager: bool):
        self.device, self.enforce_eager = device, enforce_eager
        self.max_num_reqs, self.uniform_decode_query_len = MAX_NUM_REQS, 1
        self.arange_np = np.arange(MAX_NUM_TOKENS + 2, dtype=np.int32)
        self.input_ids = CpuGpuBuffer(MAX_NUM_TOKENS, torch.int64, device)
        self.positions = CpuGpuBuffer(MAX_NUM_TOKENS, torch.int64, device)
        # NOTE: For FULL mode we change +1 to +2 to reserve extra space for padding.
        self.query_start_loc = CpuGpuBuffer(self.max_num_reqs + (2 if _variant == "fix" else 1), torch.int32, device)
        self.seq_lens = CpuGpuBuffer(self.max_num_reqs, torch.int32, device)
        self.block_table = BlockTable(device)
        self.kv_caches = [tuple(torch.zeros(SCRATCH_SLOT + 1, N_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
                                for _ in range(2)) for _ in range(N_LAYERS)]
        self.attn_backend = AscendAttentionBackend
        self.attn_metadata_builder = AscendAttentionMetadataBuilder()
        self.layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(N_LAYERS)]
        self.cudagraph_dispatcher = CudagraphDispatcher(CUDAGRAPH_CAPTURE_SIZES)
        self.update_stream = None
        self.model = Model(device, self.kv_caches)
        if not enforce_eager:
            static = {"input_ids": self.input_ids.gpu, "positions": self.positions.gpu,
                      "block_table": self.block_table.block_table.gpu,
                      "slot_mapping": self.block_table.slot_mapping.gpu}
            state = {f"kv_caches[{i}].{n}": t for i, c in enumerate(self.kv_caches) for n, t in zip("kv", c)}
            self.model = ACLGraphWrapper(self.model, device, FULL, graph_pool_handle(device), static, state)
            self.capture_model()

    def _pad_query_start_loc_for_fia(self, num_tokens_padded: int, num_reqs_padded: int, num_reqs: int) -> int:
        """This function is only designed to satisfied the constraint that when the layout is TND,
        the first dimension of `hidden_states` must equal the last element of `actual_seq_lengths_q`."""
        if num_tokens_padded == num_reqs_padded * self.uniform_decode_query_len:
            # Uniform-batch case: num_reqs must be no greater than num_reqs_padded
            assert num_reqs <= num_reqs_padded
            last_loc = self.query_start_loc.np[num_reqs]
            self.query_start_loc.np[num_reqs + 1: num_reqs_padded + 1] = (
                self.arange_np[1: num_reqs_padded + 1 - num_reqs] * self.uniform_decode_query_len + last_loc)
        else:
            # Mixed-batch case: num_reqs must equal num_reqs_padded
            assert num_reqs == num_reqs_padded
            # Insert a dummy request instead of setting query_start_loc[num_reqs] = num_tokens_padded directly
            self.query_start_loc.np[num_reqs_padded + 1] = num_tokens_padded
            num_reqs_padded = num_reqs_padded + 1
        self.query_start_loc.copy_to_gpu()
        return num_reqs_padded

    def _prepare_inputs(self, scheduler_output):
        """scheduler_output: list of (token_ids, num_computed_tokens, block_ids) per request."""
        num_reqs = len(scheduler_output)
        num_scheduled_tokens = np.array([len(t) for t, _, _ in scheduler_output], dtype=np.int32)
        total_num_scheduled_tokens = int(num_scheduled_tokens.sum())
        cu_num_tokens = np.cumsum(num_scheduled_tokens)
        ids, positions, slots = [], [], []
        for r, (tokens, computed, blocks) in enumerate(scheduler_output):
            ids += tokens
            positions += list(range(computed, computed + len(tokens)))
            slots += [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions[-len(tokens):]]
            row = self.block_table.block_table.np[r * MAX_BLOCKS_PER_REQ:(r + 1) * MAX_BLOCKS_PER_REQ]
            row[:] = 0
            row[:len(blocks)] = blocks
        # OPTIMIZATION: Start copying the block table first.
        self.block_table.commit_block_table(num_reqs)

        self.query_start_loc.np[0] = 0
        self.query_start_loc.np[1:num_reqs + 1] = cu_num_tokens
        if _variant == "bug":
            # NOTE: Due to the FIA operator limitation, here we pad so that hidden_states.shape[0]
            # and self.query_start_loc[num_reqs_padded] are equal
            self.query_start_loc.np[num_reqs + 1:] = (
                self.arange_np[1:self.max_num_reqs + 1 - num_reqs] * self.uniform_decode_query_len
                + cu_num_tokens[-1])
        self.query_start_loc.copy_to_gpu()

        self.seq_lens.np[:num_reqs] = [c + len(t) for t, c, _ in scheduler_output]
        self.seq_lens.copy_to_gpu()
        self.seq_lens.gpu[num_reqs:].fill_(0)

        self.input_ids.np[:total_num_scheduled_tokens] = ids
        self.input_ids.copy_to_gpu(total_num_scheduled_tokens)
        self.positions.np[:total_num_scheduled_tokens] = positions
        self.positions.copy_to_gpu(total_num_scheduled_tokens)
        self.block_table.slot_mapping.np[:total_num_scheduled_tokens] = slots
        self.block_table.slot_mapping.copy_to_gpu(total_num_scheduled_tokens)
        return num_reqs, total_num_scheduled_tokens

    def _determine_batch_execution_and_padding(self, num_tokens, force_eager=False):
        return self.cudagraph_dispatcher.dispatch(num_tokens, force_eager=force_eager or self.enforce_eager)

    def _build_attention_metadata(self, num_tokens, num_reqs, num_tokens_padded=None, num_reqs_padded=None):
        num_tokens_padded = num_tokens_padded or num_tokens
        num_reqs_padded = num_reqs_padded or num_reqs
        slot_mapping = self.block_table.slot_mapping.gpu[:num_tokens_padded]
        blk_table_tensor = self.block_table.get_device_tensor()[:num_reqs_padded]
        # Fill unused with -1. Needed for reshape_and_cache in full cuda graph mode.
        slot_mapping[num_tokens:num_tokens_padded].fill_(PAD_SLOT_ID)
        blk_table_tensor[num_reqs:num_reqs_padded].fill_(0)
        cm_base = dict(query_start_loc_cpu=self.query_start_loc.cpu[:num_reqs_padded + 1],
                       seq_lens_cpu=self.seq_lens.cpu[:num_reqs_padded], num_reqs=num_reqs_padded,
                       num_actual_tokens=num_tokens, block_table_tensor=blk_table_tensor, slot_mapping=slot_mapping)
        metadata = self.attn_metadata_builder.build(cm_base)
        return {name: metadata for name in self.layer_names}

    def _model_forward(self, num_tokens_padded, input_ids, positions):
        forward_context = get_forward_context()
        if (forward_context.cudagraph_runtime_mode == FULL
                and forward_context.batch_descriptor in self.model.concrete_aclgraph_entries):
            update_full_graph_params(self.attn_backend, self.update_stream, forward_context, num_tokens_padded)
        return self.model(input_ids, positions)

    def execute_model(self, scheduler_output):
        num_reqs, num_tokens_unpadded = self._prepare_inputs(scheduler_output)
        cudagraph_mode, batch_desc = self._determine_batch_execution_and_padding(num_tokens_unpadded)
        num_tokens_padded = batch_desc.num_tokens
        num_reqs_padded = batch_desc.num_reqs if batch_desc.num_reqs is not None else num_reqs
        if _variant == "fix" and cudagraph_mode == FULL:
            num_reqs_padded = self._pad_query_start_loc_for_fia(num_tokens_padded, num_reqs_padded, num_reqs)
        attn_metadata = self._build_attention_metadata(num_tokens_unpadded, num_reqs, num_tokens_padded,
                                                       num_reqs_padded)
        with set_ascend_forward_context(attn_metadata, num_tokens_padded, cudagraph_mode, batch_desc,
                                        num_actual_tokens=num_tokens_unpadded):
            hidden_states = self._model_forward(num_tokens_padded, self.input_ids.gpu[:num_tokens_padded],
                                                self.positions.gpu[:num_tokens_padded])
        return hidden_states[:num_tokens_unpadded]

    def _dummy_run(self, num_tokens, cudagraph_runtime_mode):
        num_reqs = min(num_tokens, self.max_num_reqs)
        num_scheduled_tokens = [num_tokens // num_reqs] * num_reqs
        num_scheduled_tokens[-1] += num_tokens % num_reqs
        _cudagraph_mode, batch_desc = self._determine_batch_execution_and_padding(
            num_tokens, force_eager=cudagraph_runtime_mode == NONE)
        num_tokens_padded = batch_desc.num_tokens
        num_reqs_padded = batch_desc.num_reqs if batch_desc.num_reqs is not None else num_reqs
        self.seq_lens.np[:num_reqs_padded] = num_tokens                  # max_query_len of a mixed dummy batch
        self.seq_lens.np[num_reqs_padded:] = 0
        self.seq_lens.copy_to_gpu()
        self.query_start_loc.np[1:num_reqs_padded + 1] = np.cumsum(num_scheduled_tokens)
        self.query_start_loc.copy_to_gpu()
        if _variant == "fix":
            num_reqs_padded = self._pad_query_start_loc_for_fia(num_tokens_padded, num_reqs_padded, num_reqs)
        attn_metadata = self._build_attention_metadata(num_tokens, num_reqs_padded, num_tokens_padded)
        with set_ascend_forward_context(attn_metadata, num_tokens_padded, cudagraph_runtime_mode, batch_desc,
                                        num_actual_tokens=num_tokens_padded):
            return self._model_forward(num_tokens_padded, self.input_ids.gpu[:num_tokens_padded],
                                       self.positions.gpu[:num_tokens_padded])

    def capture_model(self):
        set_graph_params(CUDAGRAPH_CAPTURE_SIZES)
        for num_tokens in reversed(CUDAGRAPH_CAPTURE_SIZES):
            self._dummy_run(num_tokens, cudagraph_runtime_mode=NONE)           # cudagraph_num_of_warmups
            self._dummy_run(num_tokens, cudagraph_runtime_mode=FULL)


# --- the serving loop (stand-in scheduler; later tokens fixed in advance) --------------------------------------------

def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(6475)
    prompts = {r: torch.randint(1, VOCAB, (n,), generator=gen).tolist() for r, n in (("A", 5), ("B", 3), ("C", 2),
                                                                                      ("D", 3))}
    decodes = {r: torch.randint(1, VOCAB, (4,), generator=gen).tolist() for r in "ABCD"}
    blocks = {"A": [1, 2, 3], "B": [4, 5], "C": [6, 7], "D": [8, 9]}
    steps = [[("A", "prefill"), ("B", "prefill")],                       # 8 tokens: graph 8
             [("A", 0), ("B", 0), ("C", "prefill")],                     # 4 tokens: graph 4
             [("A", 1), ("B", 1), ("C", 0), ("D", "prefill")],           # 6 tokens, 4 requests: graph 8
             [("A", 2), ("B", 2), ("C", 1), ("D", 0)],                   # 4 tokens: graph 4
             [("A", 3), ("B", 3), ("D", 1)]]                             # 3 tokens: graph 4

    def serve(enforce_eager: bool):
        runner = NPUModelRunner(device, enforce_eager)
        computed = {r: 0 for r in "ABCD"}
        outs = []
        for step in steps:
            scheduler_output = []
            for r, what in step:
                tokens = prompts[r] if what == "prefill" else [decodes[r][what]]
                scheduler_output.append((tokens, computed[r], blocks[r]))
            outs.append(runner.execute_model(scheduler_output).clone())
            for (r, _), (tokens, _, _) in zip(step, scheduler_output):
                computed[r] += len(tokens)
        return outs

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(False), lambda: serve(True))
