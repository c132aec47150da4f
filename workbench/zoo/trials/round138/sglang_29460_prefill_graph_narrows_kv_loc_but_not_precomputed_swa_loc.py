"""SGLang's prefill CUDA graph (breakable / piecewise) runs the model at a captured bucket size and runs attention
as an eager break, ``unified_attention_with_output``, which cuts q/k/v and ``forward_batch.out_cache_loc`` down to
the batch's ``num_token_non_padded_cpu`` real tokens. Since #27617 the attention backend translates the full-pool
write locations to the sliding-window pool once per forward, in ``init_forward_metadata``, and keeps them as
``forward_metadata.swa_out_cache_loc``; each layer hands ``KVWriteLoc(cache_loc, swa_out_cache_loc)`` to
``set_kv_buffer``. When the batch that metadata was built from carries padded rows, the narrowed ``loc`` has the
real rows while ``swa_loc`` still has the padded length, and the SWA layer's KV store pairs ``real`` rows of k/v
with ``padded`` write locations: it raises. The eager forward never narrows, so its three tensors agree. The fix
(``KVWriteLoc.__post_init__``) cuts ``swa_loc`` to ``loc``'s length wherever the bundle is built.

Upstream: https://github.com/sgl-project/sglang/pull/29460 ("Fix SWA cache loc slicing for all attention backends",
sgl-project/sglang, by Lianmin Zheng (merrymercy), PR dated 2026-06-26, merged as commit
e6cbc8f5fe8d5bb1e024bc186536a0002521cc87 dated 2026-06-27; read in a stored mirror of the history, the fork
bytedance-iaas/sglang). Read: the whole diff (``mem_cache/memory_pool.py``: ``KVWriteLoc`` gains ``__post_init__``
slicing ``swa_loc`` to ``loc.shape[0]``, with the comment "Piecewise CUDA graphs later narrow out_cache_loc to
real_num_tokens per layer, so swa_loc can be longer than loc"); the PR description in the stored issue corpus (above,
and "This causes a shape mismatch when KVWriteLoc bundles them together for set_kv_buffer"; it names 8 backends);
the description of its sibling #29457 (closed, the same slicing in trtllm_mha only). At the parent (e6cbc8f5fe^):
``memory_pool.py`` (``KVWriteLoc``, ``unwrap_write_loc``, ``MHATokenToKVPool.set_kv_buffer`` and
``_set_kv_buffer_impl``, whose non-JIT path is ``k_cache[indices] = k``); ``swa_memory_pool.py`` (``SWAKVPool``:
``translate_loc_from_full_to_swa``, ``set_kv_buffer`` asserting a pre-translated ``swa_loc`` for SWA layers);
``layers/radix_attention.py`` (``RadixAttention.forward``, ``unified_attention_with_output`` and its breakable
wrapper); ``layers/attention/flashinfer_backend.py`` (``init_forward_metadata`` translating ``out_cache_loc``,
``forward_extend``'s paged branch storing KV through ``KVWriteLoc`` before the paged prefill, ``use_ragged`` off
inside a piecewise graph); ``model_executor/runner/prefill_cuda_graph_runner.py`` (``capture_prepare``,
``capture_one_shape``, ``load_batch``, ``_prepare_forward_metadata_for_replay`` calling
``attn_backend.init_forward_metadata(forward_batch)`` on the live batch, ``execute``, ``can_run_graph`` admitting
DP-attention batches); ``model_runner.py`` (``_forward_raw``: ``_prepare_eager_forward_batch`` runs the DP/MLP-sync
padding before the prefill graph); ``forward_batch_info.py`` (``num_token_non_padded_cpu`` set before padding,
``prepare_mlp_sync_batch`` aligning each rank's token count to ``attn_tp_size`` and padding through
``_pad_inputs_to_size``); ``layers/dp_attention.py`` (``DpPaddingMode.get_dp_padding_mode``: SUM_LEN for extend
batches with dp > 1). Also the descriptions of #27617 and #27695 (which made the per-forward translation and the
bundle).
Not read: the Meta commit the PR names (53f21e2fe) and any issue or traceback; the JIT ``store_cache`` kernel; the
breakable-graph machinery itself (``BreakableCUDAGraphCapture``); flashinfer's kernels; the model code of the hybrid
SWA models. The PR does not say where the padded rows come from. Here they are DP attention's: the live batch is
padded to a multiple of ``attn_tp_size`` by ``prepare_mlp_sync_batch`` before the prefill graph runs it, while
``num_token_non_padded_cpu`` keeps the real count (this is my reading of the parent code, a guess as to the case the
authors hit; the capture batch itself has no padded rows).
Symptom: prefill under the prefill CUDA graph of a hybrid sliding-window model with DP attention stops with a shape
mismatch in the SWA layer's KV store (the PR: "This causes a shape mismatch when KVWriteLoc bundles them together for
set_kv_buffer"; no user report was read). With the graph off the same batches serve.
Mechanism: ``_prepare_eager_forward_batch`` pads a 7-token local batch to 8 rows (``out_cache_loc`` padded with slot
0), ``num_token_non_padded_cpu`` stays 7. The runner's ``load_batch`` copies the 8 rows into its bucket buffers and
calls ``init_forward_metadata(forward_batch)``: ``swa_out_cache_loc`` is the translation of all 8 locations. In the
attention break, ``unified_attention_with_output`` cuts q/k/v and ``out_cache_loc`` to 7 rows; ``forward_extend``
builds ``KVWriteLoc(out_cache_loc[:7], swa_out_cache_loc[8])``, and ``SWAKVPool.set_kv_buffer`` stores 7 rows of k
through 8 SWA locations: ``k_buffer[swa_loc] = cache_k`` refuses. The eager forward stores all 8 rows (the padded one
into slot 0) through 8 and 8.
Doctor: padded-shape-mismatch, at __post_init__. Code run on a padded batch combines a padded-row tensor (the SWA
write locations, translated from all of the batch's rows) with real-row tensors (the narrowed k/v and full write
locations) in one KV store; ``KVWriteLoc.__post_init__`` is where the bundle is made and what the fix changes.
Fix (upstream): ``KVWriteLoc.__post_init__`` slices ``swa_loc`` to ``loc.shape[0]`` (both are in the same per-token
order), for every backend that bundles them.
Modelled: ``ForwardMode``, ``DpPaddingMode.get_dp_padding_mode``, ``ForwardBatch`` (``_pad_tensor_to_size``,
``prepare_mlp_sync_batch``, ``_pad_inputs_to_size``, ``post_forward_mlp_sync_batch``), ``KVWriteLoc``
(``__post_init__``), ``unwrap_write_loc``, ``MHATokenToKVPool.set_kv_buffer``, ``SWAKVPool``
(``translate_loc_from_full_to_swa``, ``set_kv_buffer``, ``get_kv_buffer``), ``ReqToTokenPool``,
``FlashInferAttnBackend`` (``init_forward_metadata``, ``forward``, ``forward_extend``), ``RadixAttention.forward``,
``set_tc_piecewise_forward_context`` / ``get_tc_piecewise_forward_context``, ``unified_attention_with_output`` and
``breakable_unified_attention_with_output``, ``PrefillCudaGraphRunner`` (``capture``, ``capture_prepare``,
``capture_one_shape``, ``can_run_graph``, ``load_batch``, ``_prepare_forward_metadata_for_replay``, ``execute``),
``ModelRunner`` (``_prepare_eager_forward_batch``, ``forward``).
Stand-ins: one DP-attention rank (rank 0 of 2, ``attn_tp_size`` 2); the other rank's token counts are given (the
scheduler's all-gather), no collective runs and the MLP is local. The breakable capture of the layer stack is written
out as its three captured segments around the two eager attention breaks (the break's ``output``, allocated inside
the captured segment upstream, is a static buffer here); the logits run eagerly after the replay, as in the BCG path.
The flashinfer plan is the host lists of the live batch; the paged prefill is a masked softmax per request (rows past
the plan left zero); the backend always takes the paged branch (``use_paged``); page size 1. The buffer registry's
padding of the bucket rows is a zero fill (its padding policies were not read: a guess). ``get_dp_padding_mode``
without its hybrid-SSM idle-rank branch. The projections reduce row by row (``linear``) so that a row's numbers do not
depend on how many rows run (bucket vs batch; a BLAS GEMM's may differ in the last bits). A two-layer model (layer 0
sliding window of 3, layer 1 full attention), learned position table instead of rope, no norms, float64; KV slots
from a bump allocator, the SWA slot of each full slot fixed at allocation (slot 0: the padding slot of both pools);
no eviction.
Workload: three chunked-prefill steps on DP rank 0: request A's first 6 tokens (the other rank 4); A's next 3 tokens
with request B's first 4 (7 tokens, the other rank 6: padded to 8); B's last 2 with request C's 3 (5 tokens, padded to
6). Capture buckets 4, 8, 16. Outputs: each step's last-token logits per request.
Measured: bug: misbehaves (raised RuntimeError: shape mismatch: value tensor of shape [7, 2, 4] cannot be broadcast to
indexing result of shape [8, 2, 4]) at step 2, layer 0's KV store (step 1 had no padded rows and served). Fix: equals
eager (max |graph - eager| = 0): step 2 stores 7 rows through 7 and 7 locations. On the CPU: 1.1 s for the bug variant
(the first run, with torch's first-call costs), 0.25 s for the fix.
"""
from __future__ import annotations

import bisect
import contextlib
import enum
import math
from dataclasses import dataclass
from typing import Optional

import torch

from workbench.engine import events, graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn

UPSTREAM = "https://github.com/sgl-project/sglang/pull/29460"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "__post_init__"
SYMPTOM = ("prefill CUDA graph of a hybrid sliding-window model under DP attention: the attention break narrows k/v "
           "and the full write locations to the real tokens but not the per-forward SWA write locations translated "
           "from the padded batch, and the SWA KV store fails with a shape mismatch")

DTYPE = torch.float64
HIDDEN, NUM_HEADS, HEAD_DIM, VOCAB, MAX_POS = 16, 2, 4, 24, 32
LAYER_IS_SWA, SLIDING_WINDOW = (True, False), 3
DP_SIZE, ATTN_TP_SIZE, ATTN_DP_RANK = 2, 2, 0
CAPTURE_NUM_TOKENS = [4, 8, 16]
POOL_SIZE, MAX_CONTEXT_LEN, MAX_REQS = 48, 32, 4

_variant = "bug"


def ceil_align(x, a):
    return (x + a - 1) // a * a


def linear(x, w):
    """``x @ w`` reduced row by row, so a row's result does not depend on how many rows run (bucket vs batch)."""
    return (x.unsqueeze(-1) * w).sum(-2)


# --- forward_batch_info.py / dp_attention.py (reduced) ----------------------------------------------------------------

class ForwardMode(enum.IntEnum):
    EXTEND = enum.auto()

    def is_extend(self):
        return self == ForwardMode.EXTEND


class DpPaddingMode(enum.IntEnum):
    MAX_LEN = enum.auto()
    SUM_LEN = enum.auto()

    @classmethod
    def get_dp_padding_mode(cls, is_extend_in_batch, global_num_tokens):
        if is_extend_in_batch and DP_SIZE > 1:
            return cls.SUM_LEN
        return cls.MAX_LEN if sum(global_num_tokens) * 2 >= max(global_num_tokens) * DP_SIZE else cls.SUM_LEN


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: list
    seq_lens_cpu: list
    extend_prefix_lens_cpu: list
    extend_seq_lens_cpu: list
    num_token_non_padded_cpu: int
    global_num_tokens_cpu: Optional[list] = None
    is_extend_in_batch: bool = True
    dp_padding_mode: Optional[DpPaddingMode] = None

    @staticmethod
    def _pad_tensor_to_size(tensor, size, *, value=0):
        return torch.cat([tensor, tensor.new_full((size - tensor.shape[0], *tensor.shape[1:]), value)], dim=0)

    def prepare_mlp_sync_batch(self, model_runner):
        self._original_batch_size = self.batch_size
        global_num_tokens = [ceil_align(n, ATTN_TP_SIZE) for n in self.global_num_tokens_cpu]  # reduce-scatter
        self.dp_padding_mode = DpPaddingMode.get_dp_padding_mode(self.is_extend_in_batch, global_num_tokens)
        if self.dp_padding_mode == DpPaddingMode.MAX_LEN:
            global_num_tokens = [max(global_num_tokens)] * len(global_num_tokens)
        num_tokens = global_num_tokens[ATTN_DP_RANK]
        self._pad_inputs_to_size(model_runner, num_tokens, self.batch_size)
        self.global_num_tokens_cpu = global_num_tokens

    def _pad_inputs_to_size(self, model_runner, num_tokens, bs):
        self._original_num_tokens = self.positions.shape[0]
        self.input_ids = self._pad_tensor_to_size(self.input_ids, num_tokens)
        self.out_cache_loc = self._pad_tensor_to_size(self.out_cache_loc, num_tokens)
        self.positions = self._pad_tensor_to_size(self.positions, num_tokens)

    def post_forward_mlp_sync_batch(self, logits):
        return logits[: self._original_batch_size]


# --- mem_cache/memory_pool.py, swa_memory_pool.py (reduced) -----------------------------------------------------------

@dataclass
class KVWriteLoc:
    """Write target(s) for ``set_kv_buffer``: the full-pool location and the pre-translated SWA location."""

    loc: torch.Tensor
    swa_loc: Optional[torch.Tensor] = None

    def __post_init__(self):
        if _variant == "fix":
            # swa_out_cache_loc is computed once at metadata-init time from the full (possibly padded)
            # out_cache_loc; piecewise CUDA graphs later narrow out_cache_loc to real_num_tokens per layer.
            if self.swa_loc is not None and self.swa_loc.shape[0] != self.loc.shape[0]:
                self.swa_loc = self.swa_loc[: self.loc.shape[0]]


def unwrap_write_loc(loc_info):
    if isinstance(loc_info, KVWriteLoc):
        return loc_info.loc, loc_info.swa_loc
    return loc_info, None


class MHATokenToKVPool:
    def __init__(self, size, layer_num, device):
        shape = (size + 1, NUM_HEADS, HEAD_DIM)                     # slot 0: the padding slot
        self.k_buffer = [torch.zeros(shape, dtype=DTYPE, device=device) for _ in range(layer_num)]
        self.v_buffer = [torch.zeros(shape, dtype=DTYPE, device=device) for _ in range(layer_num)]

    def set_kv_buffer(self, layer, loc_info, cache_k, cache_v, layer_id_override=None):
        loc, _ = unwrap_write_loc(loc_info)
        layer_id = layer_id_override if layer_id_override is not None else layer.layer_id
        self.k_buffer[layer_id][loc] = cache_k                        # _set_kv_buffer_impl, naive path
        self.v_buffer[layer_id][loc] = cache_v


class SWAKVPool:
    def __init__(self, device):
        swa_ids = [i for i, s in enumerate(LAYER_IS_SWA) if s]
        full_ids = [i for i, s in enumerate(LAYER_IS_SWA) if not s]
        self.layers_mapping = {**{lid: (j, True) for j, lid in enumerate(swa_ids)},
                               **{lid: (j, False) for j, lid in enumerate(full_ids)}}
        self.full_kv_pool = MHATokenToKVPool(POOL_SIZE, len(full_ids), device)
        self.swa_kv_pool = MHATokenToKVPool(POOL_SIZE, len(swa_ids), device)
        self.full_to_swa_index_mapping = torch.zeros(POOL_SIZE + 1, dtype=torch.int64, device=device)

    def translate_loc_from_full_to_swa(self, kv_indices):
        return self.full_to_swa_index_mapping[kv_indices]

    def set_kv_buffer(self, layer, loc_info, cache_k, cache_v):
        loc, swa_loc = unwrap_write_loc(loc_info)
        layer_id_pool, is_swa_layer = self.layers_mapping[layer.layer_id]
        if is_swa_layer:
            assert swa_loc is not None
            self.swa_kv_pool.set_kv_buffer(None, swa_loc, cache_k, cache_v, layer_id_override=layer_id_pool)
        else:
            self.full_kv_pool.set_kv_buffer(None, loc, cache_k, cache_v, layer_id_override=layer_id_pool)

    def get_kv_buffer(self, layer_id):
        j, is_swa = self.layers_mapping[layer_id]
        pool = self.swa_kv_pool if is_swa else self.full_kv_pool
        return pool.k_buffer[j], pool.v_buffer[j]


class ReqToTokenPool:
    def __init__(self, device):
        self.req_to_token = torch.zeros((MAX_REQS, MAX_CONTEXT_LEN), dtype=torch.int64, device=device)


# --- layers/attention/flashinfer_backend.py (reduced) -----------------------------------------------------------------

@dataclass
class PrefillMetadata:
    req_pool_indices: list          # the plan: host lists of the batch the metadata was built from
    seq_lens: list
    prefix_lens: list
    extend_lens: list
    swa_out_cache_loc: Optional[torch.Tensor] = None


class FlashInferAttnBackend:
    def __init__(self, model_runner):
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self._swa_kv_pool = model_runner.token_to_kv_pool
        self.use_sliding_window_kv_pool = True
        self.forward_metadata = None

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        swa_out_cache_loc = None
        if self.use_sliding_window_kv_pool and forward_batch.out_cache_loc is not None:
            swa_out_cache_loc = self._swa_kv_pool.translate_loc_from_full_to_swa(forward_batch.out_cache_loc)
        self.forward_metadata = PrefillMetadata(
            list(forward_batch.req_pool_indices), list(forward_batch.seq_lens_cpu),
            list(forward_batch.extend_prefix_lens_cpu), list(forward_batch.extend_seq_lens_cpu),
            swa_out_cache_loc=swa_out_cache_loc)

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        cache_loc = forward_batch.out_cache_loc
        if save_kv_cache:                                             # paged branch: store, then paged prefill
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(cache_loc, self.forward_metadata.swa_out_cache_loc), k, v)
        return self._paged_prefill(q, layer)

    def _paged_prefill(self, q, layer):
        md = self.forward_metadata
        k_buf, v_buf = self.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        out = q.new_zeros(q.shape[0], NUM_HEADS, HEAD_DIM)            # rows past the plan's tokens: untouched
        q = q.view(-1, NUM_HEADS, HEAD_DIM)
        start = 0
        for req, seq_len, prefix, ext in zip(md.req_pool_indices, md.seq_lens, md.prefix_lens, md.extend_lens):
            slots = self.req_to_token[req, :seq_len]
            if layer.is_swa:
                slots = self._swa_kv_pool.translate_loc_from_full_to_swa(slots)
            keys, values = k_buf[slots], v_buf[slots]                 # [S, H, D]
            q_pos = torch.arange(prefix, prefix + ext, device=q.device)[:, None]
            k_pos = torch.arange(seq_len, device=q.device)[None, :]
            allowed = k_pos <= q_pos
            if layer.is_swa:
                allowed &= k_pos > q_pos - SLIDING_WINDOW
            scores = torch.einsum("thd,shd->hts", q[start:start + ext], keys) / math.sqrt(HEAD_DIM)
            scores = scores.masked_fill(~allowed[None], float("-inf"))
            out[start:start + ext] = torch.einsum("hts,shd->thd", torch.softmax(scores, -1), values)
            start += ext
        return out.view(-1, NUM_HEADS * HEAD_DIM)


# --- layers/radix_attention.py, tc_piecewise context (reduced) --------------------------------------------------------

_tc_piecewise_forward_context = None


@dataclass
class TcPiecewiseForwardContext:
    forward_batch: ForwardBatch
    attention_layers: list
    num_tokens: Optional[int] = None
    raw_num_tokens: Optional[int] = None


@contextlib.contextmanager
def set_tc_piecewise_forward_context(forward_batch, attention_layers, num_tokens=None, raw_num_tokens=None):
    global _tc_piecewise_forward_context
    _tc_piecewise_forward_context = TcPiecewiseForwardContext(forward_batch, attention_layers, num_tokens,
                                                              raw_num_tokens)
    try:
        yield
    finally:
        _tc_piecewise_forward_context = None


def get_tc_piecewise_forward_context():
    return _tc_piecewise_forward_context


class RadixAttention:
    def __init__(self, layer_id, backend_ref):
        self.layer_id, self.is_swa, self._runner = layer_id, LAYER_IS_SWA[layer_id], backend_ref

    def forward(self, q, k, v, forward_batch, save_kv_cache=True):
        k, v = k.view(-1, NUM_HEADS, HEAD_DIM), v.view(-1, NUM_HEADS, HEAD_DIM)
        return self._runner.attn_backend.forward(q, k, v, self, forward_batch, save_kv_cache)


def unified_attention_with_output(query, key, value, output, save_kv_cache, layer_id, attn_backend):
    context = get_tc_piecewise_forward_context()
    forward_batch = context.forward_batch
    attention_layer = context.attention_layers[layer_id]
    real_num_tokens = forward_batch.num_token_non_padded_cpu
    query, key, value = query[:real_num_tokens], key[:real_num_tokens], value[:real_num_tokens]
    original_out_cache_loc = forward_batch.out_cache_loc
    forward_batch.out_cache_loc = original_out_cache_loc[:real_num_tokens]
    ret = attn_backend.forward(query, key, value, attention_layer, forward_batch, save_kv_cache)
    forward_batch.out_cache_loc = original_out_cache_loc
    output[:real_num_tokens].copy_(ret)


breakable_unified_attention_with_output = unified_attention_with_output   # eager_on_graph(True)(...): an eager break


# --- the model (a hybrid SWA decoder, reduced) ------------------------------------------------------------------------

class DecoderLayer:
    def __init__(self, layer_id, runner, gen, device):
        w = lambda *s, scale=0.35: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)
        self.w_qkv, self.w_o = w(HIDDEN, 3 * NUM_HEADS * HEAD_DIM), w(NUM_HEADS * HEAD_DIM, HIDDEN)
        self.w_up, self.w_down = w(HIDDEN, 2 * HIDDEN), w(2 * HIDDEN, HIDDEN)
        self.attn = RadixAttention(layer_id, runner)

    def qkv(self, hidden):
        q, k, v = linear(hidden, self.w_qkv).split(NUM_HEADS * HEAD_DIM, dim=-1)
        return q, k.reshape(-1, NUM_HEADS, HEAD_DIM), v.reshape(-1, NUM_HEADS, HEAD_DIM)

    def post(self, hidden, attn_out):
        hidden = hidden + linear(attn_out, self.w_o)
        return hidden + linear(torch.tanh(linear(hidden, self.w_up)), self.w_down)


class HybridSWAForCausalLM:
    def __init__(self, runner, device):
        gen = generator(29460)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device).to(DTYPE)
        self.pos_table = randn(MAX_POS, HIDDEN, gen=gen, device=device, scale=0.5).to(DTYPE)
        self.layers = [DecoderLayer(i, runner, gen, device) for i in range(len(LAYER_IS_SWA))]
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.5).to(DTYPE)

    def embed(self, input_ids, positions):
        return self.embed_tokens[input_ids] + self.pos_table[positions]

    def logits_processor(self, hidden, forward_batch):
        last = torch.tensor(forward_batch.extend_seq_lens_cpu).cumsum(0) - 1
        return linear(hidden[last.to(hidden.device)], self.lm_head)

    def forward(self, input_ids, positions, forward_batch):
        hidden = self.embed(input_ids, positions)
        for layer in self.layers:
            q, k, v = layer.qkv(hidden)
            hidden = layer.post(hidden, layer.attn.forward(q, k, v, forward_batch))
        return self.logits_processor(hidden, forward_batch)


# --- model_executor/runner/prefill_cuda_graph_runner.py (reduced) -----------------------------------------------------

class PrefillCudaGraphRunner:
    def __init__(self, model_runner):
        self.model_runner, self.device = model_runner, model_runner.device
        self.capture_num_tokens, self.max_num_tokens = CAPTURE_NUM_TOKENS, CAPTURE_NUM_TOKENS[-1]
        self.attention_layers = [layer.attn for layer in model_runner.model.layers]
        i64 = dict(dtype=torch.int64, device=self.device)
        self.input_ids = torch.zeros(self.max_num_tokens, **i64)
        self.positions = torch.zeros(self.max_num_tokens, **i64)
        self.out_cache_loc = torch.zeros(self.max_num_tokens, **i64)
        self.attn_output = [torch.zeros(self.max_num_tokens, NUM_HEADS * HEAD_DIM, dtype=DTYPE, device=self.device)
                            for _ in self.attention_layers]
        self.pool = graph_pool_handle(self.device)
        self.graphs = {}
        self.capture()

    def _pad_to_bucket(self, n):
        return self.capture_num_tokens[bisect.bisect_left(self.capture_num_tokens, n)]

    def can_run_graph(self, forward_batch):
        return len(forward_batch.input_ids) <= self.max_num_tokens

    def capture(self):
        for num_tokens in reversed(self.capture_num_tokens):
            self.capture_one_shape(num_tokens)

    def capture_prepare(self, num_tokens):
        return ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=1, input_ids=self.input_ids[:num_tokens],
            positions=self.positions[:num_tokens], out_cache_loc=self.out_cache_loc[:num_tokens],
            req_pool_indices=[0], seq_lens_cpu=[num_tokens], extend_prefix_lens_cpu=[0],
            extend_seq_lens_cpu=[num_tokens], num_token_non_padded_cpu=num_tokens,
            global_num_tokens_cpu=[num_tokens] * DP_SIZE)

    def _segments(self, n):
        """The captured segments of the layer stack at bucket ``n``, around the two attention breaks."""
        layers, model = self.model_runner.model.layers, self.model_runner.model
        seg0 = lambda: (lambda h: (h, *layers[0].qkv(h)))(model.embed(self.input_ids[:n], self.positions[:n]))
        seg1 = lambda h0: (lambda h: (h, *layers[1].qkv(h)))(layers[0].post(h0, self.attn_output[0][:n]))
        seg2 = lambda h1: layers[1].post(h1, self.attn_output[1][:n])
        return seg0, seg1, seg2

    def _attention_break(self, layer_id, q, k, v, n):
        breakable_unified_attention_with_output(q, k, v, self.attn_output[layer_id][:n], True, layer_id,
                                                self.model_runner.attn_backend)

    def capture_one_shape(self, num_tokens):
        n = num_tokens
        forward_batch = self.capture_prepare(n)
        self.model_runner.attn_backend.init_forward_metadata(forward_batch)
        seg0, seg1, seg2 = self._segments(n)
        kv = self.model_runner.token_to_kv_pool
        common = dict(device=self.device, pool=self.pool, owner="PrefillCudaGraphRunner (breakable)",
                      static={"input_ids": self.input_ids, "positions": self.positions,
                              "out_cache_loc": self.out_cache_loc,
                              **{f"attn_output[{i}]": b for i, b in enumerate(self.attn_output)}},
                      state={"swa_kv_pool.k_buffer[0]": kv.swa_kv_pool.k_buffer[0],
                             "swa_kv_pool.v_buffer[0]": kv.swa_kv_pool.v_buffer[0],
                             "full_kv_pool.k_buffer[0]": kv.full_kv_pool.k_buffer[0],
                             "full_kv_pool.v_buffer[0]": kv.full_kv_pool.v_buffer[0]})
        with set_tc_piecewise_forward_context(forward_batch, self.attention_layers, n, n):
            g0, (h0, q0, k0, v0) = capture(seg0, name=f"prefill {n} segment 0", **common)
            with events.dummy_run():
                self._attention_break(0, q0, k0, v0, n)
            g1, (h1, q1, k1, v1) = capture(lambda: seg1(h0), name=f"prefill {n} segment 1", **common)
            with events.dummy_run():
                self._attention_break(1, q1, k1, v1, n)
            g2, hidden = capture(lambda: seg2(h1), name=f"prefill {n} segment 2", **common)
        self.graphs[n] = (g0, g1, g2, (q0, k0, v0), (q1, k1, v1), h0, h1, hidden)

    def _prepare_forward_metadata_for_replay(self, forward_batch, static_forward_batch, num_tokens):
        self.model_runner.attn_backend.init_forward_metadata(forward_batch)   # the live batch

    def load_batch(self, forward_batch):
        num_tokens = len(forward_batch.input_ids)
        static_num_tokens = self._pad_to_bucket(num_tokens)
        self.raw_num_tokens = num_tokens
        for buf, src in ((self.input_ids, forward_batch.input_ids), (self.positions, forward_batch.positions),
                         (self.out_cache_loc, forward_batch.out_cache_loc)):
            buf[:num_tokens].copy_(src)
            buf[num_tokens:static_num_tokens].zero_()                # the registry's padding policy
        static_forward_batch = ForwardBatch(
            forward_mode=forward_batch.forward_mode, batch_size=forward_batch.batch_size,
            input_ids=self.input_ids[:static_num_tokens], positions=self.positions[:static_num_tokens],
            out_cache_loc=self.out_cache_loc[:static_num_tokens], req_pool_indices=forward_batch.req_pool_indices,
            seq_lens_cpu=forward_batch.seq_lens_cpu, extend_prefix_lens_cpu=forward_batch.extend_prefix_lens_cpu,
            extend_seq_lens_cpu=forward_batch.extend_seq_lens_cpu,
            num_token_non_padded_cpu=forward_batch.num_token_non_padded_cpu,
            global_num_tokens_cpu=forward_batch.global_num_tokens_cpu, dp_padding_mode=forward_batch.dp_padding_mode)
        self._prepare_forward_metadata_for_replay(forward_batch, static_forward_batch, static_num_tokens)
        self._static_num_tokens = static_num_tokens
        return static_forward_batch

    def execute(self, forward_batch):
        static_forward_batch = self.load_batch(forward_batch)
        n = self._static_num_tokens
        g0, g1, g2, qkv0, qkv1, h0, h1, hidden = self.graphs[n]
        seg0, seg1, seg2 = self._segments(n)
        with set_tc_piecewise_forward_context(static_forward_batch, self.attention_layers, n, self.raw_num_tokens):
            def eager():                           # this step's forward on the same static buffers
                e0, *eqkv0 = seg0()
                self._attention_break(0, *eqkv0, n)
                e1, *eqkv1 = seg1(e0)
                self._attention_break(1, *eqkv1, n)
                return seg2(e1)

            real = forward_batch.num_token_non_padded_cpu
            events.serve(g0, real, n, padded={f"attn_output[{i}]": b for i, b in enumerate(self.attn_output)},
                         outputs=hidden, pieces=(g0, g1, g2), eager=eager)
            g0.replay()
            self._attention_break(0, *qkv0, n)
            g1.replay()
            self._attention_break(1, *qkv1, n)
            g2.replay()
            out = hidden.view_as(hidden)
            events.handed_out(g2, out)
        # the outer model.forward tail (logits) runs eagerly on the live batch
        return self.model_runner.model.logits_processor(out[: self.raw_num_tokens], forward_batch)


# --- model_executor/model_runner.py (reduced) -------------------------------------------------------------------------

class ModelRunner:
    def __init__(self, device, use_cuda_graph):
        self.device = device
        self.req_to_token_pool = ReqToTokenPool(device)
        self.token_to_kv_pool = SWAKVPool(device)
        self.model = HybridSWAForCausalLM(self, device)
        self.attn_backend = FlashInferAttnBackend(self)
        self.prefill_cuda_graph_runner = PrefillCudaGraphRunner(self) if use_cuda_graph else None

    def _prepare_eager_forward_batch(self, forward_batch):
        if forward_batch.global_num_tokens_cpu is not None:
            forward_batch.prepare_mlp_sync_batch(self)

    def forward(self, forward_batch: ForwardBatch):
        self._prepare_eager_forward_batch(forward_batch)
        runner = self.prefill_cuda_graph_runner
        if forward_batch.forward_mode.is_extend() and runner is not None and runner.can_run_graph(forward_batch):
            ret = runner.execute(forward_batch)
        else:
            self.attn_backend.init_forward_metadata(forward_batch)
            ret = self.model.forward(forward_batch.input_ids, forward_batch.positions, forward_batch)
        return forward_batch.post_forward_mlp_sync_batch(ret)


# --- the workload: three chunked-prefill steps on DP rank 0 -----------------------------------------------------------

PROMPTS = {1: 9, 2: 6, 3: 3}                                   # request row -> prompt length
STEPS = [([(1, 6)], 4), ([(1, 3), (2, 4)], 6), ([(2, 2), (3, 3)], 3)]   # (req, chunk) list, other rank's tokens


def _serve(device, use_cuda_graph):
    model_runner = ModelRunner(device, use_cuda_graph)
    gen = generator(2946)
    prompts = {r: torch.randint(0, VOCAB, (n,), generator=gen).to(device) for r, n in PROMPTS.items()}
    req_to_token, swa_map = model_runner.req_to_token_pool.req_to_token, model_runner.token_to_kv_pool
    done, next_slot, next_swa, outs = {r: 0 for r in PROMPTS}, 1, 1, []
    for chunks, other_rank_tokens in STEPS:
        ids, pos, locs, prefix, ext, seq = [], [], [], [], [], []
        for r, n in chunks:
            p0 = done[r]
            slots = torch.arange(next_slot, next_slot + n, device=device)
            swa_map.full_to_swa_index_mapping[slots] = torch.arange(next_swa, next_swa + n, device=device)
            req_to_token[r, p0:p0 + n] = slots
            next_slot, next_swa = next_slot + n, next_swa + n
            ids.append(prompts[r][p0:p0 + n])
            pos.append(torch.arange(p0, p0 + n, device=device))
            locs.append(slots)
            prefix.append(p0)
            ext.append(n)
            seq.append(p0 + n)
            done[r] = p0 + n
        num_tokens = sum(ext)
        forward_batch = ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=len(chunks), input_ids=torch.cat(ids),
            positions=torch.cat(pos), out_cache_loc=torch.cat(locs), req_pool_indices=[r for r, _ in chunks],
            seq_lens_cpu=seq, extend_prefix_lens_cpu=prefix, extend_seq_lens_cpu=ext,
            num_token_non_padded_cpu=num_tokens, global_num_tokens_cpu=[num_tokens, other_rank_tokens])
        outs.append(model_runner.forward(forward_batch).clone())
    return outs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    try:
        with torch.no_grad():
            return compare(__name__.rsplit(".", 1)[-1], variant, device,
                           lambda: _serve(device, True), lambda: _serve(device, False))
    finally:
        _variant = "bug"
