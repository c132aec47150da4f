"""MiniMax-M3 decides in the captured segment whether to allocate the FP8 query from per-step metadata; the eager attention break re-decides at replay and gets ``query_fp8=None``.

Upstream: https://github.com/vllm-project/vllm/pull/51203 ("[Bugfix][MiniMax-M3] Keep FP8 query allocation stable
across CUDA graph replay", kyleliang-nv, description dated 2026-08-05, merged; no separate issue).
Symptom: MiniMax-M3 on Blackwell with the CUTLASS MSA sparse decode and breakable (PIECEWISE) CUDA graphs dies on the
first replayed decode batch that gets a CUTLASS plan: ``assert query_fp8 is not None`` in
``MiniMaxM3SparseMSAImpl.forward`` (seen downstream as the first fatal error of a c1024 warmup); ``--enforce-eager``
serves.
Mechanism: ``MiniMaxM3SparseAttention.forward`` (vllm/models/minimax_m3/nvidia/model.py) ran, inside the captured
graph segment before the ``@eager_break_during_capture`` ``_run_attention``,
``use_msa_decode = self.impl.should_use_msa_decode(self.layer_name)`` and allocated the FP8 query
(``torch.empty(..., dtype=float8_e4m3fn)``, filled by ``fused_minimax_m3_qknorm_rope_kv_insert(q_fp8_out=...)``) only
when it was true. ``should_use_msa_decode`` reads the step's attention metadata: true only when
``MiniMaxM3SparseMSAMetadataBuilder.build`` prepared a CUTLASS plan (``decode.msa_cutlass is not None``,
``should_prepare_decode_metadata``: enough decode requests, a supported query length). The capture's dummy run has no
plan, so the segment's Python took the "no FP8 query" branch once: the graph holds no FP8 buffer and no quantize, and
``BreakableCUDAGraphCapture`` recorded the eager break with its capture-time arguments, ``query_fp8=None``. At replay
the break re-runs ``MiniMaxM3SparseMSAImpl.forward`` against the live forward context; a real decode batch with a
CUTLASS plan takes ``if self.use_cutlass_decode and msa_metadata is not None: assert query_fp8 is not None``. In eager
mode both decisions read the same metadata every step and always agree.
Doctor: warmup-divergence, at _allocate_query_fp8 (the allocate-or-not branch on per-step metadata was decided by the
capture's dummy batch and every replay reuses its result, None; an eager step with a CUTLASS plan decides otherwise
and produces the FP8 query that the eager attention segment needs).
Fix (upstream): ``MiniMaxM3SparseAttention._allocate_query_fp8(qkv)`` allocates the FP8 query whenever
``getattr(self.impl, "use_cutlass_decode", False)``, a static config that is the same at capture and replay; the
per-request CUTLASS-or-Triton choice stays in the eager segment (Triton-fallback steps produce an unused FP8 query).
The regression test ``test_query_fp8_stays_valid_when_cutlass_plan_appears_on_replay`` captures with
``decode.msa_cutlass=None``, sets a plan, replays three times, and checks one non-None ``query_fp8.data_ptr()``.
Modelled: one sparse-attention layer (embedding -> fused qkv+index projection -> per-head RMS q/k norm + RoPE, KV and
index-key insert, FP8 query -> eager break: indexer top-k blocks then sparse decode -> o_proj -> logits), float32,
2 query heads over 1 KV head (head_dim 8), one index head (dim 8), page = sparse block of 4 tokens, top-2 blocks with
the first and the local block forced. Pre-fix the decision was inline in ``forward``; here both variants go through
``_allocate_query_fp8`` (the function the fix introduced). ``BreakableCUDAGraphCapture`` is written as two graph
segments around the one eager break (the split the decorator makes at ``_run_attention``); the eager break keeps its
capture-time arguments and reads the live forward context, as upstream. The capture's dummy run carries no
per-layer attention metadata (as in vLLM's ``_dummy_run``, which builds it only with ``force_attention`` or for FULL
captures; the PR's own test captures with ``msa_cutlass=None``), only the slot mapping the in-graph KV insert needs.
CUTLASS's minimum decode batch is 8 (16 upstream); the CUTLASS and Triton decode kernels are one dense torch routine, fed the
dequantized FP8 query or the float query. Prompts are already in the caches; decode steps of 4 (Triton), 8, 8
(CUTLASS) and 4 requests at capture sizes 4 and 8, no padding.
"""
from __future__ import annotations

import contextlib
import functools

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/51203"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "_allocate_query_fp8"
SYMPTOM = ("MiniMax-M3 breakable CUDA graph: eager CUTLASS decode gets the capture-time query_fp8=None "
           "(assert query_fp8 is not None) once a replayed batch has a CUTLASS plan")

VOCAB, HIDDEN = 32, 16
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 2, 1, 8
INDEX_HEAD_DIM = 8
SPARSE_BLOCK_SIZE = 4                      # = the KV page size
TOPK_BLOCKS = 2
MAX_BLOCKS_PER_REQ = 4
MAX_NUM_REQS = 8
NUM_BLOCKS = 1 + MAX_NUM_REQS * MAX_BLOCKS_PER_REQ      # block 0: vLLM's null block
MAX_POSITION = SPARSE_BLOCK_SIZE * MAX_BLOCKS_PER_REQ
CAPTURE_SIZES = [4, 8]
MSA_CUTLASS_MIN_BATCH = 8
PAD_SLOT_ID = -1
VARIANT = {"v": "bug"}


# --- vllm.forward_context ---------------------------------------------------------------------------

class ForwardContext:
    def __init__(self, attn_metadata, slot_mapping):
        self.attn_metadata, self.slot_mapping = attn_metadata, slot_mapping


_forward_context: list[ForwardContext | None] = [None]


def get_forward_context() -> ForwardContext:
    return _forward_context[0]


@contextlib.contextmanager
def set_forward_context(attn_metadata, slot_mapping):
    prev, _forward_context[0] = _forward_context[0], ForwardContext(attn_metadata, slot_mapping)
    try:
        yield
    finally:
        _forward_context[0] = prev


# --- vllm/compilation/breakable_cudagraph.py ---------------------------------------------------------

class BreakableCUDAGraphCapture:
    """Captures a forward as CUDA-graph segments split at each ``@eager_break_during_capture`` call; the break runs
    eagerly at capture, is recorded with its (capture-time) arguments, and runs again between the segments at every
    replay."""

    _current: list = [None]

    def __init__(self, device, pool, name, static, state):
        self.device, self.pool, self.name, self.static, self.state = device, pool, name, static, state
        self.segments: list[tuple] = []

    @classmethod
    def current(cls):
        return cls._current[0]

    def __enter__(self):
        self._current[0] = self
        return self

    def __exit__(self, *exc):
        self._current[0] = None
        return False

    def graph_segment(self, fn):
        g, out = capture(fn, device=self.device, pool=self.pool, warmups=1,
                         name=f"{self.name} segment {self.num_graphs}", static=self.static, state=self.state,
                         owner="BreakableCUDAGraphCapture")
        self.segments.append(("graph", g, out))
        return out

    def eager_break(self, fn, args):
        out = fn(*args)
        self.segments.append(("eager", fn, args))
        return out

    def replay(self):
        result = None
        for kind, a, b in self.segments:
            if kind == "eager":
                a(*b)
            else:
                result = replay(a, tuple(t for t in b if t is not None) if isinstance(b, tuple) else b)
        return result

    @property
    def num_graphs(self):
        return sum(kind == "graph" for kind, _, _ in self.segments)

    @property
    def num_eager_breaks(self):
        return sum(kind == "eager" for kind, _, _ in self.segments)


def eager_break_during_capture(fn):
    @functools.wraps(fn)
    def wrapper(*args):
        capture_ = BreakableCUDAGraphCapture.current()
        if capture_ is None:
            return fn(*args)
        return capture_.eager_break(fn, args)
    return wrapper


def graph_segment(fn):
    """The code between two eager breaks: one captured graph inside a breakable capture, plain code otherwise."""
    capture_ = BreakableCUDAGraphCapture.current()
    return fn() if capture_ is None else capture_.graph_segment(fn)


# --- vllm/models/minimax_m3/nvidia/msa_cutlass_sparse_decode.py -------------------------------------

class MSACutlassDecodeMetadata:
    def __init__(self, block_table, seq_lens):
        self.block_table, self.seq_lens = block_table, seq_lens


def should_prepare_decode_metadata(batch_size, decode_query_len, *, decode_backend, kv_cache_dtype):
    return (decode_backend == "cutlass" and kv_cache_dtype in ("fp8", "fp8_e4m3")
            and batch_size >= MSA_CUTLASS_MIN_BATCH and 1 <= decode_query_len <= 32)


def prepare_decode_metadata(block_table, seq_lens, decode_query_len):
    return MSACutlassDecodeMetadata(block_table=block_table, seq_lens=seq_lens)


def _sparse_decode(query, kv_cache, topk, block_table, seq_lens, scale, out):
    """Block-sparse decode over the selected blocks (one query token per request, one KV head)."""
    nd = query.shape[0]
    offs = torch.arange(SPARSE_BLOCK_SIZE, device=query.device)
    logical = topk[:, 0, :]                                                          # [nd, K]
    phys = torch.gather(block_table[:nd].long(), 1, logical.clamp_min(0).long())
    pos = logical[:, :, None].long() * SPARSE_BLOCK_SIZE + offs                      # [nd, K, B]
    valid = (logical[:, :, None] >= 0) & (pos < seq_lens[:nd, None, None].long())
    kv = kv_cache[phys, 0]                                                           # [nd, K, B, 2D]
    k = kv[..., :HEAD_DIM].reshape(nd, -1, HEAD_DIM)
    v = kv[..., HEAD_DIM:].reshape(nd, -1, HEAD_DIM)
    scores = torch.einsum("nhd,ntd->nht", query, k) * scale
    scores = scores.masked_fill(~valid.reshape(nd, 1, -1), float("-inf"))
    out.copy_(torch.einsum("nht,ntd->nhd", torch.softmax(scores, -1), v))


def msa_cutlass_sparse_decode(query_fp8, kv_cache, topk, out, msa_metadata, *, scale, q_scale_float):
    query = query_fp8.to(torch.float32) * q_scale_float
    _sparse_decode(query, kv_cache, topk, msa_metadata.block_table, msa_metadata.seq_lens, scale, out)


def minimax_m3_sparse_attn_decode(query, kv_cache, topk, block_table, seq_lens, scale, out):
    """The Triton split-K decode."""
    _sparse_decode(query, kv_cache, topk, block_table, seq_lens, scale, out)


# --- vllm/models/minimax_m3/common/sparse_attention.py + nvidia/sparse_attention_msa.py ---------------

class MiniMaxM3SparseMSADecodeMetadata:
    def __init__(self, seq_lens, block_table, decode_query_len, msa_cutlass=None):
        self.seq_lens, self.block_table, self.decode_query_len = seq_lens, block_table, decode_query_len
        self.msa_cutlass = msa_cutlass


class MiniMaxM3SparseMetadata:
    def __init__(self, num_actual_tokens, num_decodes, num_decode_tokens, decode):
        self.num_actual_tokens, self.num_decodes, self.num_decode_tokens = num_actual_tokens, num_decodes, num_decode_tokens
        self.decode = decode


class MiniMaxM3SparseMSAMetadataBuilder:
    def __init__(self, kv_cache_dtype, decode_backend):
        self.kv_cache_dtype, self.decode_backend = kv_cache_dtype, decode_backend

    def build(self, num_reqs, seq_lens, block_table):
        decode = MiniMaxM3SparseMSADecodeMetadata(seq_lens=seq_lens, block_table=block_table, decode_query_len=1)
        if should_prepare_decode_metadata(num_reqs, decode.decode_query_len, decode_backend=self.decode_backend,
                                          kv_cache_dtype=self.kv_cache_dtype):
            decode.msa_cutlass = prepare_decode_metadata(block_table, seq_lens, decode.decode_query_len)
        return MiniMaxM3SparseMetadata(num_reqs, num_reqs, num_reqs, decode)


class MiniMaxM3SparseMSAImpl:
    def __init__(self, kv_cache_dtype, msa_decode_backend):
        self.num_heads, self.head_size, self.scale = NUM_HEADS, HEAD_DIM, HEAD_DIM ** -0.5
        self.use_cutlass_decode = msa_decode_backend == "cutlass" and kv_cache_dtype in ("fp8", "fp8_e4m3")

    def should_use_msa_decode(self, layer_name):
        if not self.use_cutlass_decode:
            return False
        attn_metadata = get_forward_context().attn_metadata
        if not isinstance(attn_metadata, dict):
            return False
        decode = attn_metadata[layer_name].decode
        return isinstance(decode, MiniMaxM3SparseMSADecodeMetadata) and decode.msa_cutlass is not None

    def forward(self, layer, query, kv_cache, output, *, query_fp8=None):
        attn_metadata = get_forward_context().attn_metadata
        if not isinstance(attn_metadata, dict):
            return output                                  # profiling / capture dummy run
        main_md = attn_metadata[layer.layer_name]
        nd, hd = main_md.num_decode_tokens, self.head_size
        topk = layer.topk_indices_buffer
        q = query[:main_md.num_actual_tokens].view(-1, self.num_heads, hd)
        out = output[:main_md.num_actual_tokens].view(-1, self.num_heads, hd)
        if main_md.num_decodes > 0:
            d = main_md.decode
            msa_metadata = d.msa_cutlass if isinstance(d, MiniMaxM3SparseMSADecodeMetadata) else None
            if self.use_cutlass_decode and msa_metadata is not None:
                assert query_fp8 is not None
                msa_cutlass_sparse_decode(query_fp8[:nd].view(-1, self.num_heads, hd), kv_cache, topk[:nd],
                                          out[:nd], msa_metadata, scale=self.scale,
                                          q_scale_float=getattr(layer, "_q_scale_float", 1.0))
            else:
                minimax_m3_sparse_attn_decode(q[:nd], kv_cache, topk[:nd], d.block_table, d.seq_lens,
                                              self.scale, out[:nd])
        return output


class MiniMaxM3Indexer:
    """Lightning indexer: scores every block with the index query, keeps the top-k (first and local forced)."""

    def __init__(self, layer_name, device, topk_indices_buffer):
        self.layer_name = layer_name
        self.index_cache = torch.zeros(NUM_BLOCKS, SPARSE_BLOCK_SIZE, INDEX_HEAD_DIM, device=device)
        self.topk_indices_buffer = topk_indices_buffer

    def __call__(self, index_query):
        attn_metadata = get_forward_context().attn_metadata
        if not isinstance(attn_metadata, dict):
            return
        md = attn_metadata[self.layer_name]
        d, nd = md.decode, md.num_decode_tokens
        offs = torch.arange(SPARSE_BLOCK_SIZE, device=index_query.device)
        logical = torch.arange(MAX_BLOCKS_PER_REQ, device=index_query.device)
        pos = logical[:, None] * SPARSE_BLOCK_SIZE + offs                                 # [L, B]
        seq = d.seq_lens[:nd].long()
        keys = self.index_cache[d.block_table[:nd].long()]                               # [nd, L, B, I]
        s = torch.einsum("ni,nlbi->nlb", index_query[:nd], keys)
        s = s.masked_fill(pos[None] >= seq[:, None, None], float("-inf")).amax(-1)       # [nd, L]
        last = (seq - 1) // SPARSE_BLOCK_SIZE
        forced = (logical[None] == 0) | (logical[None] == last[:, None])
        s = torch.where(forced & (s > float("-inf")), torch.full_like(s, float("inf")), s)
        vals, idx = torch.topk(s, TOPK_BLOCKS, dim=-1)
        self.topk_indices_buffer[:nd, 0].copy_(torch.where(vals > float("-inf"), idx, -1).to(torch.int32))


# --- vllm/_custom_ops.py: fused_minimax_m3_qknorm_rope_kv_insert -------------------------------------

def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w)


def _rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)


def fused_minimax_m3_qknorm_rope_kv_insert(qkv, q_norm_weight, k_norm_weight, cos_sin_cache, positions,
                                           index_q_norm_weight, index_k_norm_weight, slot_mapping, kv_cache,
                                           index_cache, q_out, index_q_out, *, q_fp8_out=None, q_fp8_scale=1.0):
    n = qkv.shape[0]
    q, k, v, iq, ik = qkv.split([NUM_HEADS * HEAD_DIM, HEAD_DIM, HEAD_DIM, INDEX_HEAD_DIM, INDEX_HEAD_DIM], -1)
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    q = _rope(_rms(q.reshape(n, NUM_HEADS, HEAD_DIM), q_norm_weight), cos, sin).reshape(n, -1)
    k = _rope(_rms(k.reshape(n, 1, HEAD_DIM), k_norm_weight), cos, sin).reshape(n, -1)
    iq = _rope(_rms(iq.reshape(n, 1, INDEX_HEAD_DIM), index_q_norm_weight), cos, sin).reshape(n, -1)
    ik = _rope(_rms(ik.reshape(n, 1, INDEX_HEAD_DIM), index_k_norm_weight), cos, sin).reshape(n, -1)
    slots = slot_mapping.clamp_min(0)            # PAD_SLOT_ID rows: the kernel skips them (here: the null block)
    blk, off = slots // SPARSE_BLOCK_SIZE, slots % SPARSE_BLOCK_SIZE
    kv_cache[blk, 0, off] = torch.cat((k, v), -1)
    index_cache[blk, off] = ik
    q_out.copy_(q)
    index_q_out.copy_(iq)
    if q_fp8_out is not None:
        q_fp8_out.copy_((q / q_fp8_scale).to(torch.float8_e4m3fn))


# --- vllm/models/minimax_m3/nvidia/model.py ----------------------------------------------------------

class MiniMaxM3SparseAttention:
    def __init__(self, gen, device, topk_indices_buffer):
        self.layer_name = "model.layers.0.self_attn.attn"
        self.q_size, self.index_q_size = NUM_HEADS * HEAD_DIM, INDEX_HEAD_DIM
        qkv_out = self.q_size + 2 * HEAD_DIM + 2 * INDEX_HEAD_DIM
        self.qkv_proj = randn(HIDDEN, qkv_out, gen=gen, device=device, scale=HIDDEN ** -0.5)
        self.o_proj = randn(self.q_size, HIDDEN, gen=gen, device=device, scale=self.q_size ** -0.5)
        self.q_norm, self.k_norm = (randn(HEAD_DIM, gen=gen, device=device, scale=0.1) for _ in range(2))
        self.index_q_norm, self.index_k_norm = (randn(INDEX_HEAD_DIM, gen=gen, device=device, scale=0.1)
                                                for _ in range(2))
        inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
        freqs = torch.arange(MAX_POSITION + 1, dtype=torch.float32)[:, None] * inv_freq[None]
        self.cos_sin_cache = torch.cat((freqs.cos(), freqs.sin()), -1).to(device)
        self.kv_cache_dtype = "fp8_e4m3"
        self.impl = MiniMaxM3SparseMSAImpl(self.kv_cache_dtype, msa_decode_backend="cutlass")
        self.kv_cache = torch.zeros(NUM_BLOCKS, NUM_KV_HEADS, SPARSE_BLOCK_SIZE, 2 * HEAD_DIM, device=device)
        self.topk_indices_buffer = topk_indices_buffer
        self.indexer = MiniMaxM3Indexer(self.layer_name, device, topk_indices_buffer)
        self._q_scale_float = 1.0

    def _allocate_query_fp8(self, qkv):
        if VARIANT["v"] == "fix":
            if not getattr(self.impl, "use_cutlass_decode", False):
                return None
            return torch.empty((qkv.shape[0], self.q_size), dtype=torch.float8_e4m3fn, device=qkv.device)
        # before the fix: decided from the step's attention metadata (is there a CUTLASS plan?)
        use_msa_decode = self.impl.should_use_msa_decode(self.layer_name)
        return (torch.empty((qkv.shape[0], self.q_size), dtype=torch.float8_e4m3fn, device=qkv.device)
                if use_msa_decode else None)

    def _project(self, positions, hidden_states):
        """``forward`` up to the eager break (upstream: fused qkv projection, the FP8 query, the fused kernel)."""
        qkv = hidden_states @ self.qkv_proj
        num_tokens = qkv.shape[0]
        main_slot_mapping = get_forward_context().slot_mapping[self.layer_name]
        q = qkv.new_empty((num_tokens, self.q_size))
        query_fp8 = self._allocate_query_fp8(qkv)
        index_q = qkv.new_empty((num_tokens, self.index_q_size))
        fused_minimax_m3_qknorm_rope_kv_insert(
            qkv, self.q_norm, self.k_norm, self.cos_sin_cache, positions, self.index_q_norm, self.index_k_norm,
            main_slot_mapping, self.kv_cache, self.indexer.index_cache, q, index_q,
            q_fp8_out=query_fp8, q_fp8_scale=self._q_scale_float)
        output = torch.empty_like(q)
        return q, query_fp8, index_q, output

    @eager_break_during_capture
    def _run_attention(self, query, query_fp8, index_query, output):
        self.indexer(index_query)
        return self.impl.forward(self, query, self.kv_cache, output, query_fp8=query_fp8)


class MiniMaxM3ForCausalLM:
    def __init__(self, device):
        gen = generator(51203)
        self.topk_indices_buffer = torch.full((max(CAPTURE_SIZES), NUM_KV_HEADS, TOPK_BLOCKS), -1,
                                              dtype=torch.int32, device=device)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.self_attn = MiniMaxM3SparseAttention(gen, device, self.topk_indices_buffer)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=HIDDEN ** -0.5)

    def forward(self, input_ids, positions):
        """One decoder layer, written as the breakable capture splits it: a graph segment up to the attention's
        eager break (embedding + ``MiniMaxM3SparseAttention.forward`` before ``_run_attention``), the break, and a
        graph segment after it (``o_proj``, residual, logits)."""
        attn = self.self_attn

        def before_break():
            hidden = self.embed_tokens[input_ids]
            return (hidden,) + attn._project(positions, hidden)

        hidden, q, query_fp8, index_q, output = graph_segment(before_break)
        attn_output = attn._run_attention(q, query_fp8, index_q, output)
        return graph_segment(lambda: (hidden + attn_output @ attn.o_proj) @ self.lm_head)


# --- vllm/v1/worker/gpu_model_runner.py --------------------------------------------------------------

class GPUModelRunner:
    def __init__(self, device, enforce_eager):
        self.device, self.enforce_eager = device, enforce_eager
        self.model = MiniMaxM3ForCausalLM(device)
        attn = self.model.self_attn
        self.layer_name = attn.layer_name
        self.builder = MiniMaxM3SparseMSAMetadataBuilder(attn.kv_cache_dtype, "cutlass")
        n = max(CAPTURE_SIZES)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), PAD_SLOT_ID, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(MAX_NUM_REQS, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(MAX_NUM_REQS, MAX_BLOCKS_PER_REQ, dtype=torch.int32, device=device)
        self.cudagraphs: dict[int, BreakableCUDAGraphCapture] = {}

    def _slot_mappings(self, n):
        return {self.layer_name: self.slot_mapping[:n]}

    def _dummy_run(self, num_tokens):
        """A PIECEWISE (breakable) capture's dummy batch: inputs and slot mapping, no attention metadata."""
        self.input_ids[:num_tokens] = 0
        self.positions[:num_tokens] = 0
        self.slot_mapping[:num_tokens] = PAD_SLOT_ID

    def capture_model(self):
        attn = self.model.self_attn
        pool = graph_pool_handle(self.device)
        for n in reversed(CAPTURE_SIZES):
            self._dummy_run(n)
            cap = BreakableCUDAGraphCapture(
                self.device, pool, f"breakable num_tokens={n}",
                static={"input_ids": self.input_ids, "positions": self.positions, "slot_mapping": self.slot_mapping},
                state={"kv_cache": attn.kv_cache, "index_cache": attn.indexer.index_cache})
            with set_forward_context(None, self._slot_mappings(n)), cap:
                self.model.forward(self.input_ids[:n], self.positions[:n])
            assert cap.num_graphs == 2 and cap.num_eager_breaks == 1
            self.cudagraphs[n] = cap

    def load_prompts(self, requests):
        """The prompts' keys/values and index keys, as the prefill left them in the caches."""
        attn = self.model.self_attn
        for r, (prompt, blocks) in enumerate(requests):
            pos = torch.arange(len(prompt), device=self.device)
            slots = torch.tensor(blocks, device=self.device)[pos // SPARSE_BLOCK_SIZE] * SPARSE_BLOCK_SIZE \
                + pos % SPARSE_BLOCK_SIZE
            hidden = self.model.embed_tokens[torch.tensor(prompt, device=self.device)]
            qkv = hidden @ attn.qkv_proj
            fused_minimax_m3_qknorm_rope_kv_insert(
                qkv, attn.q_norm, attn.k_norm, attn.cos_sin_cache, pos, attn.index_q_norm, attn.index_k_norm,
                slots, attn.kv_cache, attn.indexer.index_cache, torch.empty(len(prompt), attn.q_size, device=self.device),
                torch.empty(len(prompt), attn.index_q_size, device=self.device))
            self.block_table[r] = torch.tensor(blocks, dtype=torch.int32, device=self.device)

    def execute_model(self, rows, token_ids, positions):
        n = len(rows)
        self.input_ids[:n] = torch.tensor(token_ids, device=self.device)
        self.positions[:n] = torch.tensor(positions, device=self.device)
        self.seq_lens[:n] = torch.tensor(positions, dtype=torch.int32, device=self.device) + 1
        table = self.block_table[torch.tensor(rows, device=self.device)]
        pos = self.positions[:n]
        self.slot_mapping[:n] = table[torch.arange(n, device=self.device), pos // SPARSE_BLOCK_SIZE].long() \
            * SPARSE_BLOCK_SIZE + pos % SPARSE_BLOCK_SIZE
        md = self.builder.build(n, self.seq_lens[:n], table)
        with set_forward_context({self.layer_name: md}, self._slot_mappings(n)):
            if self.enforce_eager or n not in self.cudagraphs:
                return self.model.forward(self.input_ids[:n], self.positions[:n]).clone()
            return self.cudagraphs[n].replay().clone()


def requests():
    gen = generator(5120)
    lens = [5, 9, 6, 11, 7, 10, 8, 6]
    return [(torch.randint(0, VOCAB, (L,), generator=gen).tolist(),
             [1 + r * MAX_BLOCKS_PER_REQ + b for b in range(MAX_BLOCKS_PER_REQ)]) for r, L in enumerate(lens)]


def run(variant: str, device: str = "cpu"):
    VARIANT["v"] = variant
    reqs = requests()
    gen = generator(3)
    schedule = [list(range(4)), list(range(8)), list(range(8)), list(range(4, 8))]
    steps, lengths = [], [len(p) for p, _ in reqs]
    for rows in schedule:                      # 4 decodes: Triton; 8 decodes: CUTLASS plan
        steps.append((rows, torch.randint(0, VOCAB, (len(rows),), generator=gen).tolist(), [lengths[r] for r in rows]))
        for r in rows:
            lengths[r] += 1

    def serve(enforce_eager):
        runner = GPUModelRunner(device, enforce_eager)
        if not enforce_eager:
            runner.capture_model()
        runner.load_prompts(reqs)
        return [runner.execute_model(rows, ids, pos) for rows, ids, pos in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(False), lambda: serve(True))
