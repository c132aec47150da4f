"""vLLM dual-batch overlap (DBO): ``UBatchWrapper`` replays its microbatched FULL decode graph for any step whose token count it has captured, even when the dispatcher chose PIECEWISE for a mixed prefill-decode batch, so prefill tokens run through the decode-only attention baked in at capture.

Upstream: https://github.com/vllm-project/vllm/pull/25625 ("[BugFix] Fix DBO hang", vllm-project/vllm, by
LucasWilkinson, opened and merged 2025-09-25). Description: "Fix DBO using full-cudagraphs for mixed-prefill-decode
batches (it should not have been doing this)".
Read: the PR page (title, description, comments); the vLLM repository was too large to fetch, so the code was read
from stored copies of ``vllm/v1/worker/gpu_ubatch_wrapper.py`` found by exact-string search (commits not named): the
pre-fix ``UBatchWrapper.__call__`` (capture if ``num_tokens not in self.cudagraphs and cudagraph_runtime_mode is
FULL``, ``elif num_tokens in self.cudagraphs:`` replay, else ``_run_ubatches``), ``_capture_ubatches``,
``_run_ubatches``, ``_make_ubatch_metadata``, ``_slice_model_inputs``; and later copies whose replay branch adds
``and cudagraph_runtime_mode is CUDAGraphMode.FULL``. The runner side (``BatchDescriptor(num_tokens, uniform_decode)``,
``CudagraphDispatcher.dispatch``, ``create_ubatch_slices``, the per-ubatch metadata builders, ``seq_lens`` tail
filled with 0) is modelled from the vLLM V1 runner of that period as recalled, not re-read at the parent commit.
Symptom: with DBO (``--enable-dbo``, DP/EP MoE serving) and FULL_AND_PIECEWISE graphs the engine hangs (the ranks
disagree on the work they run) once a mixed prefill-decode batch lands on a captured token count; on a single rank
the step's prefill tokens come out wrong.
Mechanism: ``capture_model`` captures, per capture size, one microbatched FULL graph of a uniform decode batch: each
ubatch's MLA attention took the decode-only branch (``num_decodes == num_tokens``, rows = tokens of the persistent
``seq_lens`` / block table). A later mixed batch with the same token count is dispatched PIECEWISE (no FULL key for a
non-uniform batch), but ``__call__`` only asks whether ``num_tokens`` is in ``self.cudagraphs`` and replays. The
replay treats every token of the second ubatch as a one-token decode request: a prefill token reads its request's
whole ``seq_lens`` (seeing later tokens) and the next token reads a row past ``num_reqs`` (``seq_lens`` 0, a stale
block-table row).
Doctor: warmup-divergence, at __call__. The capture decided the attention branch (decode-only, one request per token)
and ``__call__`` replays that graph for a step whose eager run now takes the prefill branch; the runtime mode the
dispatcher chose is ignored.
Fix (upstream): replay only when ``cudagraph_runtime_mode is CUDAGraphMode.FULL``; a PIECEWISE microbatched step runs
``_run_ubatches``.
Modelled: ``UBatchWrapper.__call__`` / ``_capture_ubatches`` / ``_run_ubatches`` / ``_make_ubatch_metadata`` /
``_slice_model_inputs`` as read (graph of both ubatches in one capture, outputs concatenated); ``create_ubatch_slices``
(token halves, request slices by ``searchsorted``); ``BatchDescriptor`` and ``CudagraphDispatcher`` keys (FULL for
uniform decode, PIECEWISE for mixed); the runner's persistent ``input_ids`` / ``positions`` / ``query_start_loc`` /
``seq_lens`` / block table / ``slot_mapping`` and a per-ubatch MLA metadata builder splitting decodes and prefills.
Stand-ins: the two ubatch threads and streams run one after the other; a single DP rank (no collectives, so the hang
shows as wrong numbers); PIECEWISE graphs are not captured (a PIECEWISE step runs the model eagerly, as its pieces
would); a 2-layer decoder with multi-head paged attention instead of MLA, no RoPE, no MoE; decode tokens fixed in
advance; block 0 is the null block used by the dummy run; float64.
Workload: capture size 4 (two ubatches of 2 tokens), DBO thresholds 4 tokens. Step 1 prefills A-D (3 tokens each, 12
tokens: eager ubatches); step 2 decodes A-D (uniform, FULL replay); step 3 decodes A, B and prefills E (2 tokens):
4 tokens, mixed, dispatched PIECEWISE; step 4 decodes A, B, E, C (FULL replay). Bug: step 3 replays the FULL graph,
E's two prefill tokens differ (E0 attends to E1: 2.81; E1 reads row 3 with ``seq_len`` 0: 2.15) and E's step-4
token, which reads E's damaged layer-2 cache, differs too (1.44); A-D stay equal; max |graph - eager| = 2.81. Fix:
equals eager (max 0). Deterministic over repeated runs, about 2 s each on the CPU.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum

import numpy as np
import torch
import torch.nn.functional as F

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/25625"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "__call__"
SYMPTOM = ("DBO with FULL_AND_PIECEWISE graphs: a mixed prefill-decode batch of a captured token count replays the "
           "microbatched FULL decode graph, so its prefill tokens run as one-token decode requests")

VOCAB, HIDDEN, N_HEADS, HEAD_DIM, INTER, N_LAYERS = 32, 16, 2, 8, 24, 2
BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS_PER_REQ = 4, 16, 4
MAX_NUM_REQS, MAX_NUM_TOKENS = 8, 16
CUDAGRAPH_CAPTURE_SIZES = [4]
DBO_DECODE_TOKEN_THRESHOLD = DBO_PREFILL_TOKEN_THRESHOLD = 4
DTYPE = torch.float64

_variant = "bug"

CUDAGraphMode = enum.Enum("CUDAGraphMode", "NONE PIECEWISE FULL")

@dataclasses.dataclass(frozen=True)
class BatchDescriptor:
    num_tokens: int
    uniform_decode: bool = False

@dataclasses.dataclass
class UBatchSlice:
    request_slice: slice
    token_slice: slice

    @property
    def num_tokens(self) -> int:
        return self.token_slice.stop - self.token_slice.start

def create_ubatch_slices(num_scheduled_tokens: np.ndarray, split_point: int) -> list[UBatchSlice]:
    cu_num_tokens = np.zeros(len(num_scheduled_tokens) + 1, dtype=np.int32)
    np.cumsum(num_scheduled_tokens, dtype=np.int32, out=cu_num_tokens[1:])
    first_ubatch_req_stop = int(np.searchsorted(cu_num_tokens, split_point, side="left"))
    second_ubatch_req_start = int(np.searchsorted(cu_num_tokens, split_point, side="right") - 1)
    return [UBatchSlice(slice(0, first_ubatch_req_stop), slice(0, split_point)),
            UBatchSlice(slice(second_ubatch_req_start, len(cu_num_tokens) - 1),
                        slice(split_point, int(cu_num_tokens[-1])))]

# --- vllm/forward_context.py ------------------------------------------------------------------------------------------

@dataclasses.dataclass
class ForwardContext:
    attn_metadata: object
    batch_descriptor: BatchDescriptor | None = None
    ubatch_slices: list[UBatchSlice] | None = None
    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE

_forward_context: ForwardContext | None = None

def get_forward_context() -> ForwardContext:
    assert _forward_context is not None
    return _forward_context

@contextlib.contextmanager
def override_forward_context(ctx):
    global _forward_context
    prev, _forward_context = _forward_context, ctx
    try:
        yield
    finally:
        _forward_context = prev

# --- attention metadata (CommonAttentionMetadata, split per ubatch, MLA builder) --------------------------------------

@dataclasses.dataclass
class CommonAttentionMetadata:
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor              # view of the runner's persistent buffer
    block_table_tensor: torch.Tensor    # view of the runner's persistent buffer
    slot_mapping: torch.Tensor          # view of the runner's persistent buffer
    num_reqs: int
    num_actual_tokens: int

def split_attn_metadata(ubatch_slices, m: CommonAttentionMetadata) -> list[CommonAttentionMetadata]:
    out = []
    for s in ubatch_slices:
        rs, ts = s.request_slice, s.token_slice
        qsl = m.query_start_loc_cpu[rs.start:rs.stop + 1].clone()
        qsl = (qsl - ts.start).clamp(0, s.num_tokens)
        out.append(CommonAttentionMetadata(qsl, m.seq_lens[rs], m.block_table_tensor[rs], m.slot_mapping[ts],
                                           rs.stop - rs.start, s.num_tokens))
    return out

MLADecodeMetadata = collections.namedtuple("MLADecodeMetadata", "block_table seq_lens")
MLAPrefillMetadata = collections.namedtuple("MLAPrefillMetadata", "block_table token_req_indx")

@dataclasses.dataclass
class MLACommonMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    decode: MLADecodeMetadata | None
    prefill: MLAPrefillMetadata | None

def split_decodes_and_prefills(m: CommonAttentionMetadata, decode_threshold: int = 1):
    query_lens = m.query_start_loc_cpu[1:] - m.query_start_loc_cpu[:-1]
    is_prefill = query_lens > decode_threshold
    if not bool(is_prefill.any()):
        return m.num_reqs, 0, m.num_actual_tokens, 0
    first_prefill = int(is_prefill.int().argmax())
    num_decode_tokens = int(m.query_start_loc_cpu[first_prefill])
    return first_prefill, m.num_reqs - first_prefill, num_decode_tokens, m.num_actual_tokens - num_decode_tokens

class MLACommonMetadataBuilder:
    def build(self, common_prefix_len: int, m: CommonAttentionMetadata) -> MLACommonMetadata:
        num_decodes, num_prefills, num_decode_tokens, _ = split_decodes_and_prefills(m, decode_threshold=1)
        decode = prefill = None
        if num_decodes > 0:
            decode = MLADecodeMetadata(m.block_table_tensor[:num_decodes], m.seq_lens[:num_decodes])
        if num_prefills > 0:
            query_lens = (m.query_start_loc_cpu[1:] - m.query_start_loc_cpu[:-1])[num_decodes:]
            token_req_indx = torch.repeat_interleave(torch.arange(num_prefills), query_lens)
            prefill = MLAPrefillMetadata(m.block_table_tensor[num_decodes:],
                                         token_req_indx.to(m.block_table_tensor.device))
        return MLACommonMetadata(m.num_actual_tokens, m.slot_mapping, num_decodes, num_decode_tokens, num_prefills,
                                 decode, prefill)

    def build_for_cudagraph_capture(self, m: CommonAttentionMetadata) -> MLACommonMetadata:
        assert m.num_reqs == m.num_actual_tokens, "full graphs are captured for decode-only batches"
        return self.build(0, m)

# --- the model (stand-in for DeepSeek-V2 with MLA) --------------------------------------------------------------------

def rms_norm(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

def paged_attention(q, k_cache, v_cache, block_table, kv_lens):
    """One query row per entry over its block-table row, up to its KV length (a row with length 0 yields 0)."""
    width = block_table.size(1)
    ctx = torch.arange(width * BLOCK_SIZE, device=q.device)
    slots = block_table[:, ctx // BLOCK_SIZE].long() * BLOCK_SIZE + ctx % BLOCK_SIZE
    k, v = k_cache.view(-1, N_HEADS, HEAD_DIM)[slots], v_cache.view(-1, N_HEADS, HEAD_DIM)[slots]
    scores = torch.einsum("thd,tchd->thc", q, k) / HEAD_DIM ** 0.5
    masked = ctx[None, :] >= kv_lens[:, None]
    probs = scores.masked_fill(masked[:, None, :], float("-inf")).softmax(-1).nan_to_num(0.0)
    return torch.einsum("thc,tchd->thd", probs, v)

class MLAAttention:
    def __init__(self, kv_cache):
        self.kv_cache = kv_cache

    def forward(self, q, k, v, positions):
        attn_metadata = get_forward_context().attn_metadata
        k_cache, v_cache = self.kv_cache
        slots = attn_metadata.slot_mapping.long()
        k_cache.view(-1, N_HEADS, HEAD_DIM).index_copy_(0, slots, k)
        v_cache.view(-1, N_HEADS, HEAD_DIM).index_copy_(0, slots, v)
        nd, parts = attn_metadata.num_decode_tokens, []
        if attn_metadata.decode is not None:        # _forward_decode: one request per token
            d = attn_metadata.decode
            parts.append(paged_attention(q[:nd], k_cache, v_cache, d.block_table, d.seq_lens))
        if attn_metadata.prefill is not None:       # _forward_prefill: causal over the request's cache
            p = attn_metadata.prefill
            parts.append(paged_attention(q[nd:], k_cache, v_cache, p.block_table[p.token_req_indx],
                                         positions[nd:] + 1))
        return torch.cat(parts)

class DecoderLayer:
    def __init__(self, gen, device, kv_cache):
        r = lambda *s, scale=0.3: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.qkv, self.o = r(3 * HIDDEN, HIDDEN), r(HIDDEN, HIDDEN)
        self.gate_up, self.down = r(2 * INTER, HIDDEN), r(HIDDEN, INTER)
        self.in_norm, self.post_norm = 1.0 + r(HIDDEN, scale=0.1), 1.0 + r(HIDDEN, scale=0.1)
        self.attn = MLAAttention(kv_cache)

    def forward(self, h, positions):
        q, k, v = F.linear(rms_norm(h, self.in_norm), self.qkv).view(-1, 3, N_HEADS, HEAD_DIM).unbind(1)
        h = h + F.linear(self.attn.forward(q, k, v, positions).reshape(-1, HIDDEN), self.o)
        gate, up = F.linear(rms_norm(h, self.post_norm), self.gate_up).chunk(2, dim=-1)
        return h + F.linear(F.silu(gate) * up, self.down)

class DeepseekV2Model:
    def __init__(self, device):
        gen = generator(25625)
        self.kv_caches = [tuple(torch.zeros(NUM_BLOCKS, BLOCK_SIZE, N_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
                                for _ in range(2)) for _ in range(N_LAYERS)]
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device).to(DTYPE)
        self.layers = [DecoderLayer(gen, device, c) for c in self.kv_caches]
        self.norm = 1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1).to(DTYPE)

    def __call__(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        h = self.embed_tokens[input_ids]
        for layer in self.layers:
            h = layer.forward(h, positions)
        return rms_norm(h, self.norm)

# --- vllm/v1/worker/gpu_ubatch_wrapper.py ----------------------------------------------------------------------------

UbatchMetadata = collections.namedtuple(
    "UbatchMetadata", "forward_context input_ids positions inputs_embeds intermediate_tensors num_tokens")
CUDAGraphMetaData = collections.namedtuple("CUDAGraphMetaData", "cudagraph ubatch_metadata outputs")

def _ubatch_threads(ubatch_metadata, model):
    """Stand-in for the two ubatch threads (each under its own forward context); outputs in ubatch order."""
    results = []
    for i, metadata in enumerate(ubatch_metadata):
        with override_forward_context(metadata.forward_context):
            results.append((i, model(input_ids=metadata.input_ids, positions=metadata.positions,
                                     intermediate_tensors=metadata.intermediate_tensors,
                                     inputs_embeds=metadata.inputs_embeds)))
    return torch.cat([value for _, value in sorted(results, key=lambda r: r[0])], dim=0)

class UBatchWrapper:
    def __init__(self, runnable, device, graph_inputs, graph_state):
        self.runnable, self.device = runnable, device
        self.cudagraphs: dict[int, CUDAGraphMetaData] = {}
        self.graph_pool = graph_pool_handle(device)
        self.graph_inputs, self.graph_state = graph_inputs, graph_state

    def _capture_ubatches(self, ubatch_metadata, model):
        num_tokens = ubatch_metadata[0].num_tokens + ubatch_metadata[1].num_tokens
        with override_forward_context(None):
            cudagraph, outputs = capture(lambda: _ubatch_threads(ubatch_metadata, model), device=self.device,
                                         pool=self.graph_pool, static=self.graph_inputs, state=self.graph_state,
                                         owner="UBatchWrapper", name=f"ubatched FULL graph {num_tokens}")
        self.cudagraphs[num_tokens] = CUDAGraphMetaData(cudagraph, ubatch_metadata, outputs)
        return outputs

    def _run_ubatches(self, ubatch_metadata, model):
        with override_forward_context(None):
            return _ubatch_threads(ubatch_metadata, model)

    def _make_ubatch_metadata(self, ubatch_slices, attn_metadata, input_ids, positions, inputs_embeds,
                              intermediate_tensors, batch_descriptor, cudagraph_runtime_mode):
        ubatch_metadata = []
        for i, ubatch_slice in enumerate(ubatch_slices):
            ctx = ForwardContext(attn_metadata[i] if attn_metadata is not None else None,
                                 batch_descriptor=batch_descriptor, cudagraph_runtime_mode=cudagraph_runtime_mode)
            ids, pos, embeds, inter = self._slice_model_inputs(ubatch_slice.token_slice, input_ids, positions,
                                                               inputs_embeds, intermediate_tensors)
            ubatch_metadata.append(UbatchMetadata(ctx, ids, pos, embeds, inter, ubatch_slice.num_tokens))
        return ubatch_metadata

    def _slice_model_inputs(self, tokens_slice, input_ids, positions, inputs_embeds, intermediate_tensors):
        return (input_ids[tokens_slice],
                positions[:, tokens_slice] if positions.ndim == 2 else positions[tokens_slice],   # mrope
                inputs_embeds[tokens_slice] if inputs_embeds is not None else None,
                intermediate_tensors[tokens_slice] if intermediate_tensors else None)

    def __call__(self, *args, **kwargs):
        forward_context = get_forward_context()
        batch_descriptor, ubatch_slices = forward_context.batch_descriptor, forward_context.ubatch_slices
        cudagraph_runtime_mode = forward_context.cudagraph_runtime_mode
        if ubatch_slices is None:
            return self.runnable(*args, **kwargs)

        attn_metadata = forward_context.attn_metadata
        num_tokens = (ubatch_slices[0].token_slice.stop - ubatch_slices[0].token_slice.start) * 2
        input_ids, positions = kwargs["input_ids"], kwargs["positions"]
        intermediate_tensors, inputs_embeds = kwargs["intermediate_tensors"], kwargs["inputs_embeds"]

        def make():
            return self._make_ubatch_metadata(ubatch_slices, attn_metadata, input_ids, positions, inputs_embeds,
                                              intermediate_tensors, batch_descriptor, CUDAGraphMode.NONE)

        if num_tokens not in self.cudagraphs and cudagraph_runtime_mode is CUDAGraphMode.FULL:
            return self._capture_ubatches(make(), self.runnable)
        if num_tokens in self.cudagraphs and (_variant == "bug" or cudagraph_runtime_mode is CUDAGraphMode.FULL):
            cudagraph_metadata = self.cudagraphs[num_tokens]
            return replay(cudagraph_metadata.cudagraph, cudagraph_metadata.outputs)
        return self._run_ubatches(make(), self.runnable)

# --- vllm/v1/cudagraph_dispatcher.py and vllm/v1/worker/gpu_model_runner.py (reduced) ---------------------------------

class CudagraphDispatcher:
    def __init__(self, enforce_eager: bool):
        self.cudagraph_keys = {CUDAGraphMode.FULL: set(), CUDAGraphMode.PIECEWISE: set()}
        if not enforce_eager:                       # FULL_AND_PIECEWISE
            for size in CUDAGRAPH_CAPTURE_SIZES:
                self.cudagraph_keys[CUDAGraphMode.PIECEWISE].add(BatchDescriptor(size, uniform_decode=False))
                self.cudagraph_keys[CUDAGraphMode.FULL].add(BatchDescriptor(size, uniform_decode=True))

    def dispatch(self, batch_descriptor: BatchDescriptor):
        if batch_descriptor in self.cudagraph_keys[CUDAGraphMode.FULL]:
            return CUDAGraphMode.FULL, batch_descriptor
        non_uniform = BatchDescriptor(batch_descriptor.num_tokens, uniform_decode=False)
        if non_uniform in self.cudagraph_keys[CUDAGraphMode.PIECEWISE]:
            return CUDAGraphMode.PIECEWISE, non_uniform
        return CUDAGraphMode.NONE, None

class GPUModelRunner:
    def __init__(self, device, enforce_eager: bool):
        self.device = device
        i32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)
        self.positions = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)
        self.query_start_loc = torch.zeros(MAX_NUM_REQS + 1, **i32)
        self.seq_lens = torch.zeros(MAX_NUM_REQS, **i32)
        self.block_table = torch.zeros(MAX_NUM_REQS, MAX_BLOCKS_PER_REQ, **i32)
        self.slot_mapping = torch.zeros(MAX_NUM_TOKENS, **i32)
        self.model_runnable = DeepseekV2Model(device)
        graph_inputs = {"input_ids": self.input_ids, "positions": self.positions, "seq_lens": self.seq_lens,
                        "block_table": self.block_table, "slot_mapping": self.slot_mapping}
        state = {f"kv_caches[{i}].{n}": t for i, c in enumerate(self.model_runnable.kv_caches)
                 for n, t in zip(("k", "v"), c)}
        self.model = UBatchWrapper(self.model_runnable, device, graph_inputs, state)    # --enable-dbo
        self.cudagraph_dispatcher = CudagraphDispatcher(enforce_eager)
        self.attn_metadata_builders = [MLACommonMetadataBuilder() for _ in range(2)]   # one per ubatch
        self.requests: dict[str, dict] = {}

    def _prepare_inputs(self, scheduled):
        """``scheduled``: (req_id, new tokens) in batch order (decodes first). Writes the persistent buffers."""
        ids, pos, slots, seq_lens, tables, qsl = [], [], [], [], [], [0]
        for req_id, tokens in scheduled:
            req = self.requests[req_id]
            start = req["num_computed_tokens"]
            ids += tokens
            pos += list(range(start, start + len(tokens)))
            slots += [req["block_ids"][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in pos[-len(tokens):]]
            req["num_computed_tokens"] = start + len(tokens)
            seq_lens.append(req["num_computed_tokens"])
            tables.append(req["block_ids"] + [0] * (MAX_BLOCKS_PER_REQ - len(req["block_ids"])))
            qsl.append(qsl[-1] + len(tokens))
        n, num_reqs = len(ids), len(scheduled)
        query_start_loc_cpu = torch.tensor(qsl, dtype=torch.int32)
        for buf, rows, values in ((self.input_ids, n, ids), (self.positions, n, pos), (self.slot_mapping, n, slots),
                                  (self.seq_lens, num_reqs, seq_lens), (self.block_table, num_reqs, tables)):
            buf[:rows].copy_(torch.tensor(values, dtype=buf.dtype))
        self.seq_lens[num_reqs:].fill_(0)                        # unused rows 0 for full cuda graph mode
        self.query_start_loc[:num_reqs + 1].copy_(query_start_loc_cpu)
        self.query_start_loc[num_reqs + 1:].fill_(n)
        return CommonAttentionMetadata(query_start_loc_cpu, self.seq_lens[:num_reqs], self.block_table[:num_reqs],
                                       self.slot_mapping[:n], num_reqs, n)

    def _run(self, common, num_scheduled_tokens: np.ndarray, capturing: bool = False):
        n, num_reqs = common.num_actual_tokens, common.num_reqs
        max_query_len = int(num_scheduled_tokens.max())
        uniform_decode = max_query_len == 1 and n == num_reqs * max_query_len
        threshold = DBO_DECODE_TOKEN_THRESHOLD if uniform_decode else DBO_PREFILL_TOKEN_THRESHOLD
        ubatch_slices = create_ubatch_slices(num_scheduled_tokens, n // 2) if n >= threshold and num_reqs > 1 else None
        cudagraph_runtime_mode, batch_descriptor = self.cudagraph_dispatcher.dispatch(
            BatchDescriptor(num_tokens=n, uniform_decode=uniform_decode))
        if ubatch_slices is not None:
            build = (lambda b, m: b.build_for_cudagraph_capture(m)) if capturing else (lambda b, m: b.build(0, m))
            attn_metadata = [build(b, m) for b, m in
                             zip(self.attn_metadata_builders, split_attn_metadata(ubatch_slices, common))]
        else:
            attn_metadata = self.attn_metadata_builders[0].build(0, common)
        ctx = ForwardContext(attn_metadata, batch_descriptor, ubatch_slices, cudagraph_runtime_mode)
        with override_forward_context(ctx):
            hidden_states = self.model(input_ids=self.input_ids[:n], positions=self.positions[:n],
                                       intermediate_tensors=None, inputs_embeds=None)
        return hidden_states[:n].clone()                        # consumed by the sampler this step

    def _dummy_run(self, num_tokens: int):
        """Uniform decode dummy batch for capture: one token per dummy request, all in the null block 0."""
        for buf, value in ((self.input_ids, 0), (self.positions, 0), (self.slot_mapping, 0), (self.seq_lens, 1),
                           (self.block_table, 0)):
            buf[:num_tokens].fill_(value)
        qsl = torch.arange(num_tokens + 1, dtype=torch.int32)
        self.query_start_loc[:num_tokens + 1].copy_(qsl)
        common = CommonAttentionMetadata(qsl, self.seq_lens[:num_tokens], self.block_table[:num_tokens],
                                         self.slot_mapping[:num_tokens], num_tokens, num_tokens)
        self._run(common, np.ones(num_tokens, dtype=np.int64), capturing=True)

    def capture_model(self):
        for size in sorted(CUDAGRAPH_CAPTURE_SIZES, reverse=True):
            self._dummy_run(size)

    def execute_model(self, scheduled):
        common = self._prepare_inputs(scheduled)
        return self._run(common, np.array([len(t) for _, t in scheduled]))

def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant

    def serve(enforce_eager: bool):
        runner = GPUModelRunner(device, enforce_eager)
        if not enforce_eager:
            runner.capture_model()
        gen = generator(125625)
        prompts = {r: torch.randint(0, VOCAB, (n,), generator=gen).tolist()
                   for r, n in (("A", 3), ("B", 3), ("C", 3), ("D", 3), ("E", 2))}
        decode = {r: torch.randint(0, VOCAB, (3,), generator=gen).tolist() for r in prompts}
        for i, r in enumerate(prompts):
            runner.requests[r] = dict(block_ids=[2 * i + 1, 2 * i + 2], num_computed_tokens=0)
        steps = [[(r, prompts[r]) for r in "ABCD"],                                   # prefill, 12 tokens
                 [(r, [decode[r][0]]) for r in "ABCD"],                               # uniform decode, FULL
                 [("A", [decode["A"][1]]), ("B", [decode["B"][1]]), ("E", prompts["E"])],   # mixed, 4 tokens
                 [("A", [decode["A"][2]]), ("B", [decode["B"][2]]), ("E", [decode["E"][0]]),
                  ("C", [decode["C"][1]])]]                                           # uniform decode, FULL
        return [runner.execute_model(s) for s in steps]

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(False), lambda: serve(True))
