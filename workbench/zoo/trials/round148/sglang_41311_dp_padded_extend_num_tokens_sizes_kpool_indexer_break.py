"""SGLang's breakable prefill CUDA graph (BCG) runs GLM-5.3-Flash's pooled-key DSA indexer as an eager break between
captured segments: ``bcg_kpool_indexer_prefill_with_output`` is replayed on the capture's arguments (the segment's
``x``/``q_lora``, the static ``positions`` view, a stable top-k buffer) and reads the live batch from the forward
context. Under DP attention, a prefill that fits a captured breakable graph forces ``DpPaddingMode.MAX_LEN``:
``ForwardBatch.prepare_mlp_sync_batch`` sets ``extend_num_tokens`` to the group-wide maximum and pads every
token-axis input (``input_ids``, ``positions``, ``out_cache_loc``) to it, while ``extend_seq_lens_cpu`` and the DSA
metadata keep describing this rank's real rows. ``_kpool_indexer_prefill_with_output`` sliced its inputs to
``forward_batch.extend_num_tokens``, so on a DP rank whose batch is shorter than the group's longest it handed the
indexer padded query rows, got back the metadata's (real) rows, and raised. The fix sizes the break by
``sum(extend_seq_lens_cpu)`` and leaves ``-1`` in the rest of the stable buffer. Without graphs (SUM_LEN, no
padding) and on the rank holding the maximum, nothing is padded and both variants agree.

Upstream: https://github.com/sgl-project/sglang/pull/41311 ("[DSA] Fix the pooled-indexer breakable prefill bridge
under DP attention", sgl-project/sglang, merged 2026-09-26 as commit 4bb645b8e2 touching
``python/sglang/srt/layers/attention/dsa/kpool_prefill_cuda_graph.py`` and
``test/registered/e2e/models/test_glm53_flash_b200.py``: that much I read in a stored weekly change report of the
repository, not on the PR's page, which the store does not hold). The PR text I read is that of #40629 ("[DSA] Use
the real extend rows for the pooled-indexer breakable-prefill bridge under DP attention", YAMY1234, 2026-09-21,
shown open when stored), the same change for the same file: its reproduction (GLM-5.3-Flash, ``--enable-dp-attention
--dp-size 4 --tp-size 4 --ep-size 4 --cuda-graph-backend-prefill breakable``, GSM8K), root cause and fix, quoted
below. The diff I read as two stored revisions of ``kpool_prefill_cuda_graph.py``: before (commit 5e62853b:
``n = forward_batch.extend_num_tokens``) and after (commit 4f508d42: ``n = sum(int(seq_len) for seq_len in
extend_seq_lens_cpu) if extend_seq_lens_cpu is not None else forward_batch.extend_num_tokens`` under the comment
"DP attention pads the token axis to the group-wide max before replay; extend_seq_lens_cpu and the DSA metadata still
describe only the real rows"); the rest of that file (checks, ``output[:n].copy_(result); output[n:].fill_(-1)``,
``_kpool_indexer_prefill_capture_stub``, ``eager_on_graph(True, capture_stub=...)``) is the same in both and is
copied here. Also read: ``test_glm53_flash_b200.py`` at 030f003d (its ``TestGLM53FlashB200HighThroughput`` serves
with ``--attn-dp-size 4 --cuda-graph-backend-prefill breakable``); a stored copy of ``forward_batch_info.py`` (its
revision and repository not shown by the index) for ``ForwardBatch.prepare_mlp_sync_batch`` (the block forcing
MAX_LEN "when the batch fits a captured breakable prefill graph", ``max_num_tokens = max(global_num_tokens)``,
``elif self.forward_mode.is_extend(): self.extend_num_tokens = num_tokens``), ``_pad_inputs_to_size`` and
``_pad_tensor_to_size``; secondary copies of ``breakable_cuda_graph.py``'s ``eager_on_graph`` (tutorial pages quoting
an older version: ``capture._end_current_segment()``, run the function, keep its args, append a ``replay_fn`` to
``_break_fns``, ``capture._begin_new_segment()``); and part of ``dsa_indexer_kpool.py`` at 00840301 (``IndexerKPool``,
its per-request loops over ``extend_seq_lens_cpu``/``seq_lens_cpu``, top-k width ``index_topk + index_kpool - 1``).
Not read: #41311's own description and review, its test change, the DSA attention backend and the segment that
reads the top-k buffer, ``PrefillCudaGraphRunner``/the breakable backend's capture and replay code, the setter of the
tc-piecewise forward context, ``DpPaddingMode.get_dp_padding_mode``, and the newer ``eager_on_graph`` that takes
``capture_stub`` (I assume the stub replaces the function at capture and the function runs at every replay). The
``IndexerKPool`` revision I skimmed sizes some of its results by the query rows (``out_rows=total_q``); which path
produced the short result in the report I could not tell: my indexer returns the metadata's rows, as the PR says.
Symptom: "On the DP ranks whose batch is shorter than the group-wide max the server exits: ``RuntimeError:
Pooled-indexer prefill returned an unexpected top-k shape`` (kpool_prefill_cuda_graph.py:41). GSM8K scores 0. The
same model with ``--tp-size 4`` + breakable, or DP attention with the prefill graph disabled, passes (0.98)." (The
stored source raises ``ValueError`` with that text; so does this program.)
Mechanism: capture (per token bucket 16, 8; warmup then capture, shared pool): each DSA layer's segment computes
``x``, ``q_lora`` and writes the latent KV at ``out_cache_loc``; the break runs the capture stub (top-k buffer all
-1) and keeps ``(indexer, x, q_lora, positions[:size], topk_buffer[:size], layer_id)``; the next segment reads the
top-k buffer. Serving: ``prepare_mlp_sync_batch`` pads this rank's 7 tokens to the group's 12 and sets
``extend_num_tokens = 12``; the runner copies the 12 rows into its static buffers (zeroing up to 16) and replays; the
break takes ``n = 12`` rows of ``x``/``q_lora``/``positions``, the indexer (per request, from ``extend_seq_lens_cpu``)
returns 7 rows, and the shape check raises. On step 1 this rank holds the maximum (11), ``n`` is right and the replay
equals the run without graphs.
Doctor: padded-shape-mismatch, at ``_kpool_indexer_prefill_with_output``: run at the replay's padded size, it combines
the padded-row tensors (``x``, ``q_lora``, ``positions`` sliced to the DP-padded count) with real-row metadata
(``extend_seq_lens_cpu`` and what the indexer derives from it); the function decides the row count and is the one
the fix changes. Not stale-padding (the padded rows hold the zeros ``_pad_inputs_to_size`` and the runner just wrote;
nothing stale reaches a real row) nor undersized-buffer (every write fits its buffer).
Fix (upstream): ``n = sum(extend_seq_lens_cpu)`` (``extend_num_tokens`` only when it is ``None``); ``output[n:]`` is
filled with -1 as before.
Modelled: ``kpool_prefill_cuda_graph.py`` (``_kpool_indexer_prefill_with_output``,
``_kpool_indexer_prefill_capture_stub``, ``bcg_kpool_indexer_prefill_with_output``), ``eager_on_graph``,
``BreakableCUDAGraph`` (``_segments``, ``_break_fns``), ``BreakableCUDAGraphCapture`` (``_end_current_segment``,
``_begin_new_segment``), ``get_tc_piecewise_forward_context``, ``ForwardBatch`` (``prepare_mlp_sync_batch``,
``_pad_inputs_to_size``, ``_pad_tensor_to_size``, ``extend_num_tokens``, ``extend_seq_lens_cpu``,
``can_run_dp_breakable_cuda_graph``), ``DpPaddingMode``, ``_forward_cuda_impl`` of the pooled indexer,
``PrefillCudaGraphRunner`` (``can_run``, ``capture``, ``capture_one_batch_size``, ``replay``), ``ModelRunner``.
Stand-ins: the indexer (``DSAKPoolIndexer``, for ``IndexerKPool``) keeps one index head: it stores the step's index
keys at ``out_cache_loc``, mean-pools complete groups of 2 cached keys, keeps per query the 2 best visible pools by
ReLU score and always the query's own open pool (upstream: gated softmax compression into FP8, ``always_select_tail``,
DeepGEMM logits, paged top-k transform); it returns KV slots or -1. The DSA layer is one latent KV head (K = V)
gathered at those slots, then a dense SiLU MLP; GLM-5.3-Flash's KDA layers, MoE (and the DP collectives that make
ranks pad alike), mHC, RoPE, norms' real weights and FP8 are left out. The DP group is this rank (rank 0 of 4) plus
the other ranks' token counts given by the workload (the scheduler's all-gather); ``get_dp_padding_mode`` answers
SUM_LEN for extend batches (my recollection), attention TP/CP alignment is 1. ``set_tc_piecewise_forward_context``
is my name for the setter; the break's captured arguments are held strongly (upstream: weak refs into the pool).
Without graphs the layer calls the indexer directly (a guess: the bridge exists for BCG). Linear layers sum row by
row so that a padded replay rounds real rows as the unpadded run does.
Workload: 2 DSA layers, width 16, vocab 32; three prefill steps on DP rank 0: A (first 6 of 9 tokens) + B (5) with
other ranks at 9/4/7 tokens (this rank is the max, bucket 16); C (3) + D (4) with rank 1 at 12 (padded 7 -> 12,
bucket 16); A's last 3 tokens (prefix 6) + E (3) with rank 2 at 8 (padded 6 -> 8, bucket 8). Outputs: each step's
last-token logits per request, then every live slot of the KV and index-key caches.
Measured: the check printed
  sglang_41311_dp_padded_extend_num_tokens_sizes_kpool_indexer_break [bug] on cpu: misbehaves (raised ValueError:
      Pooled-indexer prefill returned an unexpected top-k shape)
  sglang_41311_dp_padded_extend_num_tokens_sizes_kpool_indexer_break [fix] on cpu: equals eager (max |graph - eager|
      = 0)
The bug raises at step 2 (the first padded step), in the first layer's break; step 1 agrees with the run without
graphs in both variants. Both variants together take about 4 s on the CPU, imports included.
"""
from __future__ import annotations

import contextvars
import dataclasses
import enum
from typing import Any, Callable, List, Optional

import torch
from torch import Tensor

from workbench.engine import events, graph, graph_pool_handle, new_graph
from workbench.zoo.kit import compare, generator

UPSTREAM = "https://github.com/sgl-project/sglang/pull/41311"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "_kpool_indexer_prefill_with_output"
SYMPTOM = ("GLM-5.3-Flash with DP attention and the breakable prefill CUDA graph: on a DP rank whose prefill is "
           "shorter than the group-wide max, the pooled-key indexer's eager break ran on the DP-padded "
           "extend_num_tokens rows against real-row metadata and the server exited with 'Pooled-indexer prefill "
           "returned an unexpected top-k shape'")

DTYPE = torch.float64
VOCAB, HIDDEN, Q_LORA_RANK, INDEX_HEAD_DIM, HEAD_DIM, FFN, NUM_LAYERS = 32, 16, 8, 8, 8, 32, 2
POOL = 2                                   # tokens per pooled index key
INDEX_TOPK = 2                             # pooled keys each query keeps
TOPK_WIDTH = INDEX_TOPK * POOL + POOL      # selected pools' tokens, then the query's own (open) pool
MAX_CTX, MAX_REQS = 16, 8
NUM_SLOTS = 1 + MAX_REQS * MAX_CTX         # KV slot 0 is the dummy slot padded rows write into
PREFILL_CUDA_GRAPH_NUM_TOKENS = (8, 16)    # --cuda-graph-config prefill bs: token buckets of the prefill graph
ATTN_DP_SIZE, ATTN_DP_RANK = 4, 0          # this process is DP rank 0 of an attention-DP group of 4
_variant = "bug"


def linear(x: Tensor, w: Tensor) -> Tensor:
    """``x @ w`` summed row by row (a BLAS GEMM rounds a row differently with another row count)."""
    return (x.unsqueeze(-1) * w).sum(-2)


def rms_norm(x: Tensor, w: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


# --- model_executor/runner_backend_utils/tc_piecewise_cuda_graph.py (the live batch of a replay) ------------------

@dataclasses.dataclass
class TcPiecewiseForwardContext:
    forward_batch: Any = None


_forward_context = TcPiecewiseForwardContext()


def set_tc_piecewise_forward_context(forward_batch) -> None:
    _forward_context.forward_batch = forward_batch


def get_tc_piecewise_forward_context() -> TcPiecewiseForwardContext:
    return _forward_context


# --- model_executor/runner_backend_utils/breakable_cuda_graph.py (segments with eager breaks) ---------------------

_current_capture_var: contextvars.ContextVar = contextvars.ContextVar("breakable_cuda_graph_capture", default=None)


class BreakableCUDAGraph:
    """Captured segments and, between them, the eager functions a replay calls again."""

    def __init__(self, device, pool, name: str):
        self.device, self.pool, self.name = device, pool, name
        self._segments: List[Any] = []
        self._break_fns: List[Callable[[], Any]] = []


class BreakableCUDAGraphCapture:
    def __init__(self, cuda_graph: BreakableCUDAGraph):
        self.cuda_graph = cuda_graph
        self._ctx = None

    def __enter__(self):
        self._token = _current_capture_var.set(self)
        self._begin_new_segment()
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            ctx, self._ctx = self._ctx, None
            if ctx is not None:
                ctx.__exit__(exc_type, exc, tb)
        finally:
            _current_capture_var.reset(self._token)
        return False

    def _begin_new_segment(self) -> None:
        g = new_graph(self.cuda_graph.device, on_freed="raise")
        k = len(self.cuda_graph._segments)
        self._ctx = graph(g, pool=self.cuda_graph.pool, name=f"{self.cuda_graph.name} segment {k}")
        self._ctx.__enter__()
        self.cuda_graph._segments.append(g)

    def _end_current_segment(self) -> None:
        ctx, self._ctx = self._ctx, None
        ctx.__exit__(None, None, None)


def _copy_output(dst, src):
    if torch.is_tensor(dst) and torch.is_tensor(src):
        dst.copy_(src)
        return dst
    return src


def eager_on_graph(enable: bool, capture_stub: Optional[Callable] = None):
    def decorator(inner: Callable):
        if not enable:
            return inner

        def wrapper(*args, **kwargs):
            capture = _current_capture_var.get()
            if capture is None:
                return inner(*args, **kwargs)
            capture._end_current_segment()
            with events.dummy_run():
                output = (capture_stub or inner)(*args, **kwargs)
            captured_args, captured_kwargs, captured_output = args, kwargs, output   # (upstream: weak refs)

            def replay_fn():
                return _copy_output(captured_output, inner(*captured_args, **captured_kwargs))

            capture.cuda_graph._break_fns.append(replay_fn)
            capture._begin_new_segment()
            return output
        return wrapper
    return decorator


# --- model_executor/forward_batch_info.py ----------------------------------------------------------------------

class DpPaddingMode(enum.Enum):
    MAX_LEN = "max_len"
    SUM_LEN = "sum_len"

    def is_max_len(self) -> bool:
        return self is DpPaddingMode.MAX_LEN

    @classmethod
    def get_dp_padding_mode(cls, is_extend_in_batch: bool, global_num_tokens: List[int]) -> "DpPaddingMode":
        if is_extend_in_batch:
            return cls.SUM_LEN
        return cls.MAX_LEN if sum(global_num_tokens) * 2 > max(global_num_tokens) * len(global_num_tokens) \
            else cls.SUM_LEN


@dataclasses.dataclass
class ForwardBatch:
    """An EXTEND (prefill) batch of this DP rank."""
    batch_size: int
    input_ids: Tensor
    positions: Tensor
    out_cache_loc: Tensor
    req_pool_indices: Tensor
    seq_lens: Tensor
    extend_num_tokens: int
    extend_seq_lens_cpu: List[int]
    extend_prefix_lens_cpu: List[int]
    global_num_tokens_cpu: List[int]         # every DP rank's token count (the scheduler's all-gather)
    can_run_dp_breakable_cuda_graph: bool
    is_extend_in_batch: bool = True
    dp_padding_mode: Optional[DpPaddingMode] = None

    def _pad_tensor_to_size(self, tensor: Tensor, size: int, *, value: int = 0) -> Tensor:
        return torch.cat([tensor, tensor.new_full((size - tensor.shape[0], *tensor.shape[1:]), value)], dim=0)

    def prepare_mlp_sync_batch(self, model_runner) -> None:
        global_num_tokens = list(self.global_num_tokens_cpu)
        dp_padding_mode = DpPaddingMode.get_dp_padding_mode(self.is_extend_in_batch, global_num_tokens)
        # Prefill breakable CUDA graph requires every DP rank to run the SAME captured shape: force MAX_LEN
        # when the batch fits a captured breakable prefill graph.
        prefill_bs = model_runner.prefill_cuda_graph_bs
        if (self.can_run_dp_breakable_cuda_graph and self.is_extend_in_batch and prefill_bs
                and max(global_num_tokens) <= max(prefill_bs)):
            dp_padding_mode = DpPaddingMode.MAX_LEN
        self.dp_padding_mode = dp_padding_mode
        if dp_padding_mode.is_max_len():
            global_num_tokens = [max(global_num_tokens)] * len(global_num_tokens)
        num_tokens = global_num_tokens[ATTN_DP_RANK]
        self.extend_num_tokens = num_tokens      # extend: the (padded) token count of this rank
        self._pad_inputs_to_size(model_runner, num_tokens, self.batch_size)
        self.global_num_tokens_cpu = global_num_tokens

    def _pad_inputs_to_size(self, model_runner, num_tokens: int, bs: int) -> None:
        self.input_ids = self._pad_tensor_to_size(self.input_ids, num_tokens)
        self.out_cache_loc = self._pad_tensor_to_size(self.out_cache_loc, num_tokens)
        self.positions = self._pad_tensor_to_size(self.positions, num_tokens)
        # extend_seq_lens_cpu, seq_lens and req_pool_indices keep describing this rank's real requests


# --- layers/attention/dsa: the pooled-key (k-pool) indexer -----------------------------------------------------

class DSAKPoolIndexer:
    """Lightning indexer over pooled keys: stores the step's index keys, pools every POOL of them and keeps, per
    query, the INDEX_TOPK best complete pools (plus the query's own open pool), as KV slots (-1: none)."""

    def __init__(self, layer_id: int, gen, pool_owner, device):
        self.layer_id, self.pool_owner, self.device = layer_id, pool_owner, device
        self.wq = (torch.randn(Q_LORA_RANK, INDEX_HEAD_DIM, generator=gen, dtype=DTYPE) / Q_LORA_RANK ** 0.5).to(device)
        self.wk = (torch.randn(HIDDEN, INDEX_HEAD_DIM, generator=gen, dtype=DTYPE) / HIDDEN ** 0.5).to(device)
        self.pos = (0.5 * torch.randn(MAX_CTX, INDEX_HEAD_DIM, generator=gen, dtype=DTYPE)).to(device)

    def _forward_cuda_impl(self, x: Tensor, q_lora: Tensor, positions: Tensor, forward_batch: ForwardBatch,
                           layer_id: int, return_indices: bool = True) -> Optional[Tensor]:
        pool = self.pool_owner
        k_cache = pool.index_k_buffer[layer_id]
        k_cache.index_copy_(0, forward_batch.out_cache_loc[:x.shape[0]], linear(x, self.wk) + self.pos[positions])
        if not return_indices:
            return None
        q = linear(q_lora, self.wq)
        rows, start = [], 0
        req_pool_indices = forward_batch.req_pool_indices.tolist()
        for r, (extend_len, prefix_len) in enumerate(zip(forward_batch.extend_seq_lens_cpu,
                                                         forward_batch.extend_prefix_lens_cpu)):
            seq_len = prefix_len + extend_len
            slots = pool.req_to_token[req_pool_indices[r], :seq_len]
            keys = k_cache[slots]                                     # the request's index keys, cached ones too
            num_pools = seq_len // POOL                               # complete pools only
            pooled = keys[:num_pools * POOL].view(num_pools, POOL, INDEX_HEAD_DIM).mean(1)
            t = torch.arange(prefix_len, seq_len, device=self.device)  # query positions of this extend
            scores = torch.relu(q[start:start + extend_len] @ pooled.T) if num_pools else \
                q.new_zeros(extend_len, 0)
            visible = (torch.arange(num_pools, device=self.device)[None, :] + 1) * POOL <= t[:, None] + 1
            scores = scores.masked_fill(~visible, float("-inf"))
            if num_pools < INDEX_TOPK:
                scores = torch.cat([scores, scores.new_full((extend_len, INDEX_TOPK - num_pools), float("-inf"))], 1)
            top, top_pool = scores.topk(INDEX_TOPK, dim=1)
            token = top_pool[:, :, None] * POOL + torch.arange(POOL, device=self.device)
            token = torch.where(torch.isfinite(top)[:, :, None], token, -1).flatten(1)
            own = (t // POOL * POOL)[:, None] + torch.arange(POOL, device=self.device)
            own = torch.where(own <= t[:, None], own, -1)
            token = torch.cat([token, own], 1)
            row = pool.req_to_token[req_pool_indices[r]].to(self.device)[token.clamp(min=0)]
            rows.append(torch.where(token >= 0, row, -1))
            start += extend_len
        return torch.cat(rows, 0) if rows else q.new_zeros(0, TOPK_WIDTH, dtype=torch.int64)


# --- layers/attention/dsa/kpool_prefill_cuda_graph.py ----------------------------------------------------------

def _kpool_indexer_prefill_with_output(indexer, x: Tensor, q_lora: Tensor, positions: Tensor, output: Tensor,
                                       layer_id: int) -> None:
    # Metadata, write counts and cache destinations change between requests.
    # Resolve the live batch inside the eager break, never from capture args.
    forward_batch = get_tc_piecewise_forward_context().forward_batch
    if _variant == "bug":
        n = forward_batch.extend_num_tokens
    else:
        # DP attention pads the token axis to the group-wide max before replay;
        # extend_seq_lens_cpu and the DSA metadata still describe only the real rows.
        extend_seq_lens_cpu = forward_batch.extend_seq_lens_cpu
        n = (sum(int(seq_len) for seq_len in extend_seq_lens_cpu)
             if extend_seq_lens_cpu is not None else forward_batch.extend_num_tokens)
    if n is None or not 0 <= n <= x.shape[0]:
        raise ValueError(f"Invalid pooled-indexer prefill token count: {n}")
    if n > q_lora.shape[0] or n > positions.shape[0]:
        raise ValueError("Pooled-indexer prefill inputs have inconsistent rows")
    return_indices = output.shape[0] != 0
    result = indexer._forward_cuda_impl(x=x[:n], q_lora=q_lora[:n], positions=positions[:n],
                                        forward_batch=forward_batch, layer_id=layer_id, return_indices=return_indices)
    if not return_indices:
        return
    if result is None or result.shape != (n, output.shape[1]):
        raise ValueError("Pooled-indexer prefill returned an unexpected top-k shape")
    # The following captured attention segment reads this stable padded buffer.
    output[:n].copy_(result)
    output[n:].fill_(-1)


def _kpool_indexer_prefill_capture_stub(indexer, x: Tensor, q_lora: Tensor, positions: Tensor, output: Tensor,
                                        layer_id: int) -> None:
    output.fill_(-1)


bcg_kpool_indexer_prefill_with_output = eager_on_graph(
    True, capture_stub=_kpool_indexer_prefill_capture_stub)(_kpool_indexer_prefill_with_output)


# --- memory pool, model ----------------------------------------------------------------------------------------

class DSATokenToKVPool:
    def __init__(self, device):
        self.kv_buffer = [torch.zeros(NUM_SLOTS, HEAD_DIM, dtype=DTYPE, device=device) for _ in range(NUM_LAYERS)]
        self.index_k_buffer = [torch.zeros(NUM_SLOTS, INDEX_HEAD_DIM, dtype=DTYPE, device=device)
                               for _ in range(NUM_LAYERS)]
        self.req_to_token = torch.zeros(MAX_REQS + 1, MAX_CTX, dtype=torch.int64, device=device)  # row 0: dummy


class Glm5NextDSALayer:
    """One NoPE-MLA DSA decoder layer (latent KV shared by K and V), then a dense SiLU MLP."""

    def __init__(self, layer_id: int, gen, pool: DSATokenToKVPool, use_breakable_prefill_graph: bool, device):
        self.layer_id, self.pool, self.bcg = layer_id, pool, use_breakable_prefill_graph

        def w(i, o):
            return (torch.randn(i, o, generator=gen, dtype=DTYPE) / i ** 0.5).to(device)
        self.ln1 = torch.ones(HIDDEN, dtype=DTYPE, device=device)
        self.ln2 = torch.ones(HIDDEN, dtype=DTYPE, device=device)
        self.q_a_proj, self.q_a_ln = w(HIDDEN, Q_LORA_RANK), torch.ones(Q_LORA_RANK, dtype=DTYPE, device=device)
        self.q_b_proj, self.kv_proj, self.o_proj = w(Q_LORA_RANK, HEAD_DIM), w(HIDDEN, HEAD_DIM), w(HEAD_DIM, HIDDEN)
        self.up, self.down = w(HIDDEN, FFN), w(FFN, HIDDEN)
        self.indexer = DSAKPoolIndexer(layer_id, gen, pool, device)
        # stable padded top-k buffer that the attention after the eager break reads
        self.topk_indices_buffer = torch.full((max(PREFILL_CUDA_GRAPH_NUM_TOKENS), TOPK_WIDTH), -1,
                                              dtype=torch.int64, device=device)

    def sparse_attention(self, q: Tensor, topk: Tensor) -> Tensor:
        kv = self.pool.kv_buffer[self.layer_id][topk.clamp(min=0)]          # [n, W, D]
        valid = topk >= 0
        scores = (q.unsqueeze(1) * kv).sum(-1) * HEAD_DIM ** -0.5
        scores = scores.masked_fill(~valid, float("-inf"))
        m = scores.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(scores - m) * valid
        denom = p.sum(-1, keepdim=True)
        return (p.unsqueeze(-1) * kv).sum(1) / torch.where(denom > 0, denom, torch.ones_like(denom))

    def forward(self, h: Tensor, positions: Tensor, forward_batch_out_cache_loc: Tensor,
                forward_batch: Optional[ForwardBatch]) -> Tensor:
        x = rms_norm(h, self.ln1)
        q_lora = rms_norm(linear(x, self.q_a_proj), self.q_a_ln)
        self.pool.kv_buffer[self.layer_id].index_copy_(0, forward_batch_out_cache_loc, linear(x, self.kv_proj))
        topk = self.topk_indices_buffer[:x.shape[0]]
        if self.bcg:
            bcg_kpool_indexer_prefill_with_output(self.indexer, x, q_lora, positions, topk, self.layer_id)
        else:
            topk.copy_(self.indexer._forward_cuda_impl(x=x, q_lora=q_lora, positions=positions,
                                                       forward_batch=forward_batch, layer_id=self.layer_id))
        attn = self.sparse_attention(linear(q_lora, self.q_b_proj), topk)
        h = h + linear(attn, self.o_proj)
        return h + linear(torch.nn.functional.silu(linear(rms_norm(h, self.ln2), self.up)), self.down)


class Glm5NextForConditionalGeneration:
    """The DSA layers of GLM-5.3-Flash (its KDA layers, MoE and mHC left out)."""

    def __init__(self, pool: DSATokenToKVPool, use_breakable_prefill_graph: bool, device):
        gen = generator(0)
        self.embed = torch.randn(VOCAB, HIDDEN, generator=gen, dtype=DTYPE).to(device)
        self.pos_embed = (0.5 * torch.randn(MAX_CTX, HIDDEN, generator=gen, dtype=DTYPE)).to(device)
        self.layers = [Glm5NextDSALayer(i, gen, pool, use_breakable_prefill_graph, device) for i in range(NUM_LAYERS)]
        self.norm = torch.ones(HIDDEN, dtype=DTYPE, device=device)
        self.lm_head = (torch.randn(HIDDEN, VOCAB, generator=gen, dtype=DTYPE) / HIDDEN ** 0.5).to(device)

    def forward(self, input_ids: Tensor, positions: Tensor, out_cache_loc: Tensor,
                forward_batch: Optional[ForwardBatch] = None) -> Tensor:
        h = self.embed[input_ids] + self.pos_embed[positions]
        for layer in self.layers:
            h = layer.forward(h, positions, out_cache_loc, forward_batch)
        return rms_norm(h, self.norm)

    def compute_logits(self, hidden: Tensor, extend_seq_lens_cpu: List[int]) -> Tensor:
        last = torch.tensor(extend_seq_lens_cpu).cumsum(0) - 1
        return linear(hidden[last.to(hidden.device)], self.lm_head)


# --- model_executor/runner/prefill_cuda_graph_runner.py (breakable backend) ------------------------------------

class PrefillCudaGraphRunner:
    def __init__(self, model_runner):
        self.model_runner, self.model, self.device = model_runner, model_runner.model, model_runner.device
        self.capture_num_tokens = sorted(PREFILL_CUDA_GRAPH_NUM_TOKENS)
        n = max(self.capture_num_tokens)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.out_cache_loc = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.graphs: dict = {}
        self.output_buffers: dict = {}
        self.pool = graph_pool_handle(self.device)
        self.capture()

    def can_run(self, forward_batch: ForwardBatch) -> bool:
        return forward_batch.input_ids.shape[0] <= max(self.capture_num_tokens)

    def _dummy_batch(self, num_tokens: int) -> ForwardBatch:
        zeros = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        return ForwardBatch(1, zeros, torch.arange(num_tokens, device=self.device), zeros,
                            torch.zeros(1, dtype=torch.int64, device=self.device),
                            torch.full((1,), num_tokens, dtype=torch.int64, device=self.device),
                            num_tokens, [num_tokens], [0], [num_tokens] * ATTN_DP_SIZE, True)

    def capture(self) -> None:
        pool = self.model_runner.token_to_kv_pool
        events.static_buffers("PrefillCudaGraphRunner (breakable)", {
            "input_ids": self.input_ids, "positions": self.positions, "out_cache_loc": self.out_cache_loc})
        events.persistent_state("PrefillCudaGraphRunner (breakable)", {
            **{f"kv_buffer[{i}]": t for i, t in enumerate(pool.kv_buffer)},
            **{f"index_k_buffer[{i}]": t for i, t in enumerate(pool.index_k_buffer)}})
        for num_tokens in reversed(self.capture_num_tokens):
            self.capture_one_batch_size(num_tokens)

    def _run(self, num_tokens: int) -> Tensor:
        return self.model.forward(self.input_ids[:num_tokens], self.positions[:num_tokens],
                                  self.out_cache_loc[:num_tokens])

    def capture_one_batch_size(self, num_tokens: int) -> None:
        self.positions[:num_tokens].copy_(torch.arange(num_tokens, device=self.device))
        set_tc_piecewise_forward_context(self._dummy_batch(num_tokens))
        with events.warmup():
            self._run(num_tokens)
        g = BreakableCUDAGraph(self.device, self.pool, f"breakable prefill num_tokens {num_tokens}")
        with BreakableCUDAGraphCapture(g):
            out = self._run(num_tokens)
        self.graphs[num_tokens], self.output_buffers[num_tokens] = g, out
        set_tc_piecewise_forward_context(None)

    def replay(self, forward_batch: ForwardBatch) -> Tensor:
        raw_num_tokens = forward_batch.input_ids.shape[0]           # DP-padded
        num_tokens = next(s for s in self.capture_num_tokens if s >= raw_num_tokens)
        for buf, src in ((self.input_ids, forward_batch.input_ids), (self.positions, forward_batch.positions),
                         (self.out_cache_loc, forward_batch.out_cache_loc)):
            buf[:raw_num_tokens].copy_(src)
            buf[raw_num_tokens:num_tokens].zero_()
        set_tc_piecewise_forward_context(forward_batch)
        g, out = self.graphs[num_tokens], self.output_buffers[num_tokens]
        real = sum(forward_batch.extend_seq_lens_cpu)
        segments = g._segments
        events.serve(segments[0], real, num_tokens, outputs=out, eager=lambda: self._run(num_tokens),
                     pieces=tuple(segments))
        for i, seg in enumerate(segments):
            if i:
                events.serve(seg, real, num_tokens, outputs=out)
            seg.replay()
            if i < len(g._break_fns):
                g._break_fns[i]()
        view = out[:raw_num_tokens]
        events.handed_out(segments[-1], view)
        return view


# --- model runner and scheduler --------------------------------------------------------------------------------

class ModelRunner:
    def __init__(self, device, use_cuda_graph: bool):
        self.device = device
        self.token_to_kv_pool = DSATokenToKVPool(device)
        self.model = Glm5NextForConditionalGeneration(self.token_to_kv_pool, use_cuda_graph, device)
        self.prefill_cuda_graph_bs = list(PREFILL_CUDA_GRAPH_NUM_TOKENS) if use_cuda_graph else []
        self.prefill_cuda_graph_runner = PrefillCudaGraphRunner(self) if use_cuda_graph else None

    def forward_extend(self, forward_batch: ForwardBatch) -> Tensor:
        forward_batch.prepare_mlp_sync_batch(self)
        runner = self.prefill_cuda_graph_runner
        if runner is not None and runner.can_run(forward_batch):
            hidden = runner.replay(forward_batch)
        else:
            set_tc_piecewise_forward_context(forward_batch)
            hidden = self.model.forward(forward_batch.input_ids, forward_batch.positions,
                                        forward_batch.out_cache_loc, forward_batch)
        return self.model.compute_logits(hidden, forward_batch.extend_seq_lens_cpu)


# (request: slot in req_to_token, prompt tokens); a step lists (request, tokens of this chunk) and the other
# DP ranks' token counts
PROMPTS = {1: [3, 17, 5, 9, 1, 22, 8, 14, 2], 2: [8, 2, 20, 11, 4], 3: [7, 30, 12], 4: [19, 6, 25, 10],
           5: [13, 27, 4]}
STEPS = [
    ([(1, 6), (2, 5)], [9, 4, 7]),      # 11 tokens here: this rank holds the group-wide max
    ([(3, 3), (4, 4)], [12, 5, 9]),     # 7 tokens here, 12 on rank 1: padded to 12, bucket 16
    ([(1, 3), (5, 3)], [3, 8, 5]),      # A's second chunk (prefix 6) and E: 6 tokens, padded to 8, bucket 8
]


def serve(device, use_cuda_graph: bool) -> list:
    model_runner = ModelRunner(device, use_cuda_graph)
    pool = model_runner.token_to_kv_pool
    done = {r: 0 for r in PROMPTS}
    next_slot = 1
    outputs = []
    for chunks, others in STEPS:
        ids, pos, locs, reqs, seq_lens, ext, pre = [], [], [], [], [], [], []
        for r, n in chunks:
            start = done[r]
            slots = list(range(next_slot, next_slot + n))
            next_slot += n
            pool.req_to_token[r, start:start + n] = torch.tensor(slots, device=device)
            ids += PROMPTS[r][start:start + n]
            pos += list(range(start, start + n))
            locs += slots
            reqs.append(r)
            seq_lens.append(start + n)
            ext.append(n)
            pre.append(start)
            done[r] = start + n

        def t(v):
            return torch.tensor(v, dtype=torch.int64).to(device)
        fb = ForwardBatch(len(chunks), t(ids), t(pos), t(locs), t(reqs), t(seq_lens), len(ids), ext, pre,
                          [len(ids)] + others, use_cuda_graph)
        outputs.append(model_runner.forward_extend(fb).clone())
    live = torch.arange(1, next_slot, device=device)
    return outputs + [b[live].clone() for b in pool.kv_buffer + pool.index_k_buffer]


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    return compare(__name__.rsplit(".", 1)[-1], variant, device,
                   lambda: serve(device, use_cuda_graph=True), lambda: serve(device, use_cuda_graph=False))
