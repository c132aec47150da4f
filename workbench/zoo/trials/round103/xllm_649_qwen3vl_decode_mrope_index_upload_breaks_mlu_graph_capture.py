"""xLLM MLU graphs, Qwen3-VL: the decode forward captured into the MLU graph builds the M-RoPE cos/sin with index tensors made on the host and copied to the device, a host-to-device copy the capturing queue refuses.

Upstream: https://github.com/xLLM-AI/xllm/pull/649 ("bugfix: remove vlm useless code and fix qwen3_vl/qwen3_moe_vl
graph memcpy_async error.", xLLM-AI/xllm, by a120092009 / guoxueting, merged 2026-01-07 as b8c9844ec; the thread
has no description, only an approving review).
Read: the commit's diff (``xllm/models/llm/qwen3.h``, ``qwen3_moe.h``, ``llm_model_base.h``,
``layers/common/attention_metadata.cpp``, ``runtime/mlu_graph_executor_impl.{h,cpp}``, ``models/vlm/qwen3_vl.h``) and
the pre-fix files it touches, plus ``layers/common/rotary_embedding.cpp`` (``MRotaryEmbeddingImpl::forward``) and
``rotary_embedding_util.cpp`` (``compute_rotary_embedding``, ``get_concat_rotary_embedding``) at the parent commit.
Symptom: with graph mode on an MLU device (``enable_graph``), Qwen3-VL / Qwen3-VL-MoE serving fails at the first decode
step: capturing the decode MLU graph errors in a ``memcpy_async`` (the title's "graph memcpy_async error"); with graph
mode off the same model serves.
Mechanism: M-RoPE models keep 2-D positions ``[3, num_tokens]`` in decode too (``GraphPersistentParam`` allocates
``positions_`` as ``{3, max_tokens}`` when ``use_mrope_``). ``QWen3ModelImpl::forward`` calls ``apply_mrope``
whenever ``positions.dim() == 2``, prefill or decode. ``apply_mrope`` merges the temporal/height/width cos and sin
with ``index_select``/``index_copy_`` along index tensors it builds with ``torch::arange(..., torch::kLong)`` on the
CPU, ``torch::cat``s them and moves them with ``.to(x.device())``: a blocking host-to-device copy from pageable
memory. ``MluGraph::capture`` runs the model's decode forward between ``capture_begin`` and ``capture_end``, so the
copy is issued on the capturing queue, which refuses it, and the capture fails. In decode the merged cos/sin are not
even read: ``MRotaryEmbeddingImpl::forward`` applies plain RoPE with ``positions[0]`` unless the batch is a prefill.
Eager decode pays for the unused copy and gives the right answer.
Doctor: sync-in-capture, at apply_mrope: a host-to-device copy from pageable host memory (the index tensors made on
the CPU) is issued while the MLU graph capture is open; ``apply_mrope`` is where the copy is made, its caller decides
to run it.
Fix (upstream): ``forward`` builds the M-RoPE cos/sin only for prefill batches:
``only_prefill = attn_metadata.is_prefill || attn_metadata.is_chunked_prefill`` and
``positions.dim() == 2 && only_prefill && !mrope_section_.empty()``, so a captured decode never reaches
``apply_mrope``. The same commit also reads ``cos_pos.size(-1)`` instead of ``size(1)`` in ``apply_mrope``'s reshape,
counts chunked prefill in ``AttentionMetadata::build``'s ``is_chunked_prefill``, and deletes the deep-stack /
visual-mask copies of ``update_input_buffer`` and some unused members.
Modelled: ``apply_mrope`` and ``forward`` of ``QWen3ModelImpl`` as read (the index tensors are ``host(...)`` memory,
so the ``cat`` of them is pageable), ``MRotaryEmbeddingImpl::forward`` (M-RoPE cos/sin for prefill, plain RoPE at
``positions[0]`` otherwise), ``AttentionMetadata::build`` (diff of the cumulative kv lengths, block tables),
``GraphPersistentParam`` (constructor, ``init_params``, ``update_input_buffer`` with its cumulative seq-len vectors),
``MluGraph`` (``capture`` with no warm-up run, relaxed capture mode, output copy, replay after capture), and
``MluGraphExecutorImpl::run`` with ``get_bucket_num_tokens``; eager serving is ``BaseExecutorImpl`` (graph off).
Both variants use ``size(-1)`` in the reshape: with ``size(1)`` the eager decode's ``index_select`` would index past
the token dimension, which the CPU checks. Stand-ins: a 2-layer Qwen3 decoder (RMSNorm, qkv, rotate-half RoPE,
paged KV writes at ``new_cache_slots``, paged attention, gated MLP) without q/k norms; image tokens are plain token
embeddings (no vision tower, no deep stacks); float64; a fixed block assignment; tokens chosen in advance.
Workload: one prefill of A (7 tokens: text, a 2x2 image, text; M-RoPE positions t/h/w differ on the image) and B
(5 text tokens); three decode steps of [A, B] (bucket 2), then B finishes and two decode steps of [A] (bucket 1).
Bug: the first decode step captures the bucket-2 graph and raises CaptureError at ``apply_mrope``'s ``.to(device)``.
Fix: graphs of buckets 2 and 1 are captured and replayed; all 20 hidden-state rows equal eager (max error 2.44e-15).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from workbench.engine import host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/xLLM-AI/xllm/pull/649"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "apply_mrope"
SYMPTOM = ("Qwen3-VL decode on MLU graphs fails to capture: apply_mrope copies CPU-built index tensors to the "
           "device (memcpy_async) inside the graph capture, though decode never uses the M-RoPE cos/sin")

VOCAB, HIDDEN, N_HEADS, HEAD_DIM, INTER, N_LAYERS = 32, 24, 2, 12, 32, 2
MROPE_SECTION = [2, 2, 2]                     # rope_scaling.mrope_section (t, h, w), interleaved
ROPE_THETA, MAX_POSITION_EMBEDDINGS = 10000.0, 64
BLOCK_SIZE, NUM_BLOCKS, MAX_SEQS = 4, 16, 4
FLAGS_max_tokens_per_batch, FLAGS_max_seq_len_for_graph_mode = 8, 32
FLAGS_enable_graph_no_padding = False
DTYPE = torch.float64

_variant = "bug"


@dataclasses.dataclass
class BatchForwardType:
    kind: str                                   # "prefill" | "decode" | "mixed" | "chunked_prefill"

    def is_prefill(self): return self.kind == "prefill"
    def is_decode(self): return self.kind == "decode"
    def is_mixed(self): return self.kind == "mixed"
    def is_chunked_prefill(self): return self.kind == "chunked_prefill"


@dataclasses.dataclass
class ModelInputParams:
    batch_forward_type: BatchForwardType
    q_seq_lens: torch.Tensor                    # cumulative, [num_seqs + 1]
    kv_seq_lens: torch.Tensor                   # cumulative, [num_seqs + 1]
    q_seq_lens_vec: list
    kv_seq_lens_vec: list
    q_max_seq_len: int
    kv_max_seq_len: int
    new_cache_slots: torch.Tensor
    block_tables: torch.Tensor
    dp_global_token_nums: list = dataclasses.field(default_factory=lambda: [0])


@dataclasses.dataclass
class AttentionMetadata:
    q_cu_seq_lens: torch.Tensor
    kv_cu_seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    is_prefill: bool
    is_chunked_prefill: bool
    block_table: torch.Tensor = None
    kv_seq_lens: torch.Tensor = None
    mrope_cos: torch.Tensor = None
    mrope_sin: torch.Tensor = None

    @staticmethod
    def build(params: ModelInputParams) -> "AttentionMetadata":
        m = AttentionMetadata(q_cu_seq_lens=params.q_seq_lens, kv_cu_seq_lens=params.kv_seq_lens,
                              slot_mapping=params.new_cache_slots, is_prefill=params.batch_forward_type.is_prefill(),
                              is_chunked_prefill=params.batch_forward_type.is_mixed())
        if not m.is_prefill:
            m.block_table = params.block_tables
            m.kv_seq_lens = torch.diff(params.kv_seq_lens)          # kv seqlens
        return m


# --- layers/common/rotary_embedding{,_util}.cpp ----------------------------------------------------------------------

def compute_rotary_embedding(dim, seq_len, rope_theta, device):
    inv_freq = 1.0 / rope_theta ** (torch.arange(0, dim, 2, dtype=DTYPE, device=device) / dim)
    freqs = torch.outer(torch.arange(seq_len, dtype=DTYPE, device=device), inv_freq)
    emb = torch.cat([freqs, freqs], -1)                              # use_cat
    return torch.cat([emb.cos(), emb.sin()], -1)                     # [seq_len, 2 * dim]


def get_concat_rotary_embedding(dim, seq_len, rope_theta, device):
    return compute_rotary_embedding(dim, seq_len, rope_theta, device)


def apply_rotary(q, k, cos, sin):
    """Rotate-half RoPE of q and k [T, heads, D] with one cos/sin row [T, D] per token."""
    def rot(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([-x2, x1], dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


class MRotaryEmbedding:
    def __init__(self, device):
        cos_sin_cache = compute_rotary_embedding(HEAD_DIM, MAX_POSITION_EMBEDDINGS, ROPE_THETA, device)
        self.cos_, self.sin_ = cos_sin_cache.chunk(2, dim=-1)
        self.mrope_section_ = MROPE_SECTION
        self.mrope_cu_seq_lens_ = torch.zeros(2, dtype=torch.int32, device=device)

    def forward(self, q, k, positions, attn_metadata: AttentionMetadata):
        only_prefill = attn_metadata.is_prefill or attn_metadata.is_chunked_prefill
        if not only_prefill or not self.mrope_section_:
            position_ids = positions[0] if positions.dim() == 2 else positions
            return apply_rotary(q, k, self.cos_[position_ids], self.sin_[position_ids])   # discrete
        self.mrope_cu_seq_lens_[1] = positions.size(-1)
        return apply_rotary(q, k, attn_metadata.mrope_cos, attn_metadata.mrope_sin)


# --- the decoder (stand-in for the Qwen3 MLU layers) -----------------------------------------------------------------

def rms_norm(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class QWen3DecoderLayer:
    def __init__(self, gen, device):
        r = lambda *s, scale=0.3: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.qkv, self.o = r(3 * HIDDEN, HIDDEN), r(HIDDEN, HIDDEN)
        self.gate_up, self.down = r(2 * INTER, HIDDEN), r(HIDDEN, INTER)
        self.in_norm, self.post_norm = 1.0 + r(HIDDEN, scale=0.1), 1.0 + r(HIDDEN, scale=0.1)
        self.rotary_emb = MRotaryEmbedding(device)

    def forward(self, h, positions, attn_metadata: AttentionMetadata, kv_cache, params: ModelInputParams):
        x = rms_norm(h, self.in_norm)
        q, k, v = F.linear(x, self.qkv).view(-1, 3, N_HEADS, HEAD_DIM).unbind(1)
        q, k = self.rotary_emb.forward(q, k, positions, attn_metadata)
        k_cache, v_cache = kv_cache
        k_cache.view(-1, N_HEADS, HEAD_DIM).index_copy_(0, attn_metadata.slot_mapping, k)   # reshape_paged_cache
        v_cache.view(-1, N_HEADS, HEAD_DIM).index_copy_(0, attn_metadata.slot_mapping, v)
        if attn_metadata.is_prefill:
            o = prefill_attention(q, k, v, params)
        else:
            o = paged_decode_attention(q, k_cache, v_cache, attn_metadata)
        h = h + F.linear(o.reshape(-1, HIDDEN), self.o)
        gate, up = F.linear(rms_norm(h, self.post_norm), self.gate_up).chunk(2, dim=-1)
        return h + F.linear(F.silu(gate) * up, self.down)


def prefill_attention(q, k, v, params: ModelInputParams):
    """Causal attention inside each sequence of the packed prefill (no prefix cache)."""
    outs, cu = [], params.q_seq_lens_vec
    for s in range(len(cu) - 1):
        qs, ks, vs = q[cu[s]:cu[s + 1]], k[cu[s]:cu[s + 1]], v[cu[s]:cu[s + 1]]
        n = qs.size(0)
        scores = torch.einsum("thd,shd->hts", qs, ks) / HEAD_DIM ** 0.5
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        outs.append(torch.einsum("hts,shd->thd", scores.masked_fill(causal, float("-inf")).softmax(-1), vs))
    return torch.cat(outs)


def paged_decode_attention(q, k_cache, v_cache, attn_metadata: AttentionMetadata):
    """One query per sequence over its blocks in ``block_table``, limited by ``kv_seq_lens``."""
    width = attn_metadata.block_table.size(1)
    ctx = torch.arange(width * BLOCK_SIZE, device=q.device)
    slots = attn_metadata.block_table[:, ctx // BLOCK_SIZE] * BLOCK_SIZE + ctx % BLOCK_SIZE     # [T, ctx]
    k = k_cache.view(-1, N_HEADS, HEAD_DIM)[slots]
    v = v_cache.view(-1, N_HEADS, HEAD_DIM)[slots]
    scores = torch.einsum("thd,tchd->thc", q, k) / HEAD_DIM ** 0.5
    masked = ctx[None, :] >= attn_metadata.kv_seq_lens[:, None]
    return torch.einsum("thc,tchd->thd", scores.masked_fill(masked[:, None, :], float("-inf")).softmax(-1), v)


# --- xllm/models/llm/qwen3.h -----------------------------------------------------------------------------------------

class QWen3ModelImpl:
    def __init__(self, device):
        gen = generator(649)
        self.embed_tokens_ = randn(VOCAB, HIDDEN, gen=gen, device=device).to(DTYPE)
        self.layers_ = [QWen3DecoderLayer(gen, device) for _ in range(N_LAYERS)]
        self.norm_ = 1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1).to(DTYPE)
        self.mrope_section_ = MROPE_SECTION
        self.cos_sin_ = get_concat_rotary_embedding(HEAD_DIM, MAX_POSITION_EMBEDDINGS, ROPE_THETA, device)
        self.device = device

    def apply_mrope(self, positions: torch.Tensor):
        target_cos_sin = self.cos_sin_[positions]                      # cos_sin_.index({positions})
        cos_pos, sin_pos = (c.contiguous() for c in target_cos_sin.chunk(2, dim=-1))
        merged = []
        for x in (cos_pos.reshape(positions.size(0), -1, cos_pos.size(-1)),
                  sin_pos.reshape(positions.size(0), -1, sin_pos.size(-1))):
            # the lambda `apply`: interleave the h and w sections into the temporal frequencies
            freqs_t = x[0].clone()
            for dim_idx in (1, 2):
                offset, section_len = dim_idx, self.mrope_section_[dim_idx]
                length = section_len * 3
                idx_first_half = host(torch.arange(offset, length, 3, dtype=torch.long), self.device)  # kLong, CPU
                idx_second_half = host(torch.arange(offset, length, 3, dtype=torch.long), self.device)
                idx_tensor = torch.cat([idx_first_half, idx_second_half], 0).to(x.device)  # H2D, pageable
                src = x[dim_idx].index_select(-1, idx_tensor)
                freqs_t.index_copy_(-1, idx_tensor, src)
            merged.append(freqs_t)
        return merged[0], merged[1]

    def forward(self, tokens, positions, kv_caches, input_params: ModelInputParams):
        h = self.embed_tokens_[tokens]
        attn_metadata = AttentionMetadata.build(input_params)
        if _variant == "bug":
            use_mrope = positions.dim() == 2
        else:
            only_prefill = attn_metadata.is_prefill or attn_metadata.is_chunked_prefill
            use_mrope = positions.dim() == 2 and only_prefill and bool(self.mrope_section_)
        if use_mrope:
            attn_metadata.mrope_cos, attn_metadata.mrope_sin = self.apply_mrope(positions)
        for layer, kv_cache in zip(self.layers_, kv_caches):
            h = layer.forward(h, positions, attn_metadata, kv_cache, input_params)
        return rms_norm(h, self.norm_)


# --- xllm/core/runtime/mlu_graph_executor_impl.{h,cpp} (reduced) -----------------------------------------------------

def get_bucket_num_tokens(num_tokens: int) -> int:
    if FLAGS_enable_graph_no_padding:
        return num_tokens
    graph_step = 16
    for b in (1, 2, 4, 8):
        if num_tokens <= b:
            return b
    return (num_tokens + graph_step - 1) // graph_step * graph_step


class GraphPersistentParam:
    def __init__(self, device, num_decoding_tokens=1):
        max_tokens, max_seqs = FLAGS_max_tokens_per_batch, MAX_SEQS
        max_num_blocks_per_req = (FLAGS_max_seq_len_for_graph_mode + BLOCK_SIZE - 1) // BLOCK_SIZE + 1
        ints = dict(dtype=torch.int64, device=device)
        self.num_decoding_tokens_ = num_decoding_tokens
        self.output_ = torch.zeros(max_tokens, HIDDEN, dtype=DTYPE, device=device)
        self.positions_ = torch.zeros(3, max_tokens, **ints)          # use_mrope_
        self.use_mrope_ = True
        self.tokens_ = torch.zeros(max_tokens, **ints)
        self.new_cache_slots_ = torch.zeros(max_tokens, **ints)
        self.block_table_ = torch.zeros(max_tokens, max_num_blocks_per_req, **ints)
        self.q_seq_lens_ = torch.zeros(max_seqs + 1, **ints)
        self.kv_seq_lens_ = torch.zeros(max_seqs + 1, **ints)
        self.params_ = None

    def static_buffers(self):
        return {"positions_": self.positions_, "tokens_": self.tokens_, "new_cache_slots_": self.new_cache_slots_,
                "block_table_": self.block_table_, "q_seq_lens_": self.q_seq_lens_, "kv_seq_lens_": self.kv_seq_lens_}

    def init_params(self, params: ModelInputParams, padding_num_tokens, padding_needed):
        self.params_ = dataclasses.replace(
            params, q_seq_lens=self.q_seq_lens_[:params.q_seq_lens.size(0) + padding_needed],
            kv_seq_lens=self.kv_seq_lens_[:params.kv_seq_lens.size(0) + padding_needed],
            new_cache_slots=self.new_cache_slots_[:padding_num_tokens],
            block_tables=self.block_table_[:padding_num_tokens],
            dp_global_token_nums=[padding_num_tokens] * len(params.dp_global_token_nums))

    def update_input_buffer(self, tokens, positions, params: ModelInputParams, padding_needed):
        slice_dim = 1 if self.use_mrope_ else 0
        self.positions_.narrow(slice_dim, 0, positions.size(slice_dim)).copy_(positions)
        self.tokens_[:tokens.size(0)].copy_(tokens)
        self.new_cache_slots_[:params.new_cache_slots.size(0)].copy_(params.new_cache_slots)
        q_seq_lens_vec, kv_seq_lens_vec = list(params.q_seq_lens_vec), list(params.kv_seq_lens_vec)
        for _ in range(padding_needed):           # extend the last valid value
            q_seq_lens_vec.append(q_seq_lens_vec[-1] + self.num_decoding_tokens_)
            kv_seq_lens_vec.append(kv_seq_lens_vec[-1] + self.num_decoding_tokens_)
        q_seq_lens = torch.tensor(q_seq_lens_vec, dtype=self.q_seq_lens_.dtype, device=self.q_seq_lens_.device)
        kv_seq_lens = torch.tensor(kv_seq_lens_vec, dtype=self.kv_seq_lens_.dtype, device=self.kv_seq_lens_.device)
        self.q_seq_lens_[:q_seq_lens.size(0)].copy_(q_seq_lens)
        self.kv_seq_lens_[:kv_seq_lens.size(0)].copy_(kv_seq_lens)
        actual_batch, actual_n_block = params.block_tables.shape
        self.block_table_[:actual_batch, :actual_n_block].copy_(params.block_tables)


class MluGraph:
    def __init__(self, persistent_param: GraphPersistentParam, padding_num_tokens: int, device):
        self.persistent_param_, self.padding_num_tokens_, self.device = persistent_param, padding_num_tokens, device
        self.graph_ = self.outputs_ = None

    def capture(self, model: QWen3ModelImpl, kv_cache):
        p, n = self.persistent_param_, self.padding_num_tokens_
        slice_dim = 1 if p.use_mrope_ else 0

        def forward():
            forward_result = model.forward(p.tokens_[:n], p.positions_.narrow(slice_dim, 0, n), kv_cache, p.params_)
            p.output_[:forward_result.size(0)].copy_(forward_result)
            return p.output_[:n]

        state = {f"kv_caches[{i}].{name}": t for i, c in enumerate(kv_cache) for name, t in zip(("k", "v"), c)}
        # capture_begin(pool, cnrtQueueCaptureModeRelaxed): no warm-up run before it
        self.graph_, self.outputs_ = capture(forward, device=self.device, warmups=0, static=p.static_buffers(),
                                             state=state, owner="MluGraphExecutorImpl", capture_error_mode="relaxed",
                                             name=f"mlu decode graph {n} tokens")
        replay(self.graph_, self.outputs_)                               # graph_.replay() after capture

    def replay(self):
        replay(self.graph_, self.outputs_)

    def update_input_buffer(self, tokens, positions, params, is_init=False):
        padding_needed = self.padding_num_tokens_ - tokens.size(0)
        if is_init:
            self.persistent_param_.init_params(params, self.padding_num_tokens_, padding_needed)
        self.persistent_param_.update_input_buffer(tokens, positions, params, padding_needed)


class MluGraphExecutorImpl:
    def __init__(self, model: QWen3ModelImpl, device):
        self.model_, self.device_ = model, device
        self.persistent_param_ = GraphPersistentParam(device)
        self.graphs_: dict[int, MluGraph] = {}

    def run(self, tokens, positions, kv_caches, params: ModelInputParams):
        graph_mode = params.batch_forward_type.is_decode()
        actual_num_tokens = tokens.size(0)
        if not graph_mode:                                               # num_model_execution_total_eager
            return self.model_.forward(tokens, positions, kv_caches, params)
        padding_batch_size = get_bucket_num_tokens(actual_num_tokens)
        if padding_batch_size in self.graphs_:
            cur_graph = self.graphs_[padding_batch_size]
            cur_graph.update_input_buffer(tokens, positions, params)
            cur_graph.replay()
        else:
            graph = MluGraph(self.persistent_param_, padding_batch_size, self.device_)
            graph.update_input_buffer(tokens, positions, params, True)
            graph.capture(self.model_, kv_caches)
            self.graphs_[padding_batch_size] = graph
        return self.persistent_param_.output_[:tokens.size(0)]


class BaseExecutorImpl:                           # enable_graph = false
    def __init__(self, model: QWen3ModelImpl):
        self.model_ = model

    def run(self, tokens, positions, kv_caches, params):
        return self.model_.forward(tokens, positions, kv_caches, params)


# --- the serving loop (stand-in for the batch builder and the scheduler) ---------------------------------------------

def _prompt_positions(kind: str, n: int):
    """M-RoPE positions of a prompt: ``image`` = text, a 2x2 image, text (t/h/w differ on the image)."""
    if kind == "text":
        return [[i] * 3 for i in range(n)], n
    rows = [[0, 0, 0]] + [[1, 1 + r, 1 + c] for r in range(2) for c in range(2)]
    nxt = 3
    while len(rows) < n:
        rows.append([nxt] * 3)
        nxt += 1
    return rows, nxt                                                 # next text position


def _step(reqs, device, prefill: bool):
    tokens, positions, slots, q_cu, kv_cu, tables = [], [], [], [0], [0], []
    for req in reqs:
        if prefill:
            new = list(range(req["len"]))
            tokens += req["prompt"]
            positions += req["pos"]
        else:
            new = [req["len"]]
            tokens.append(req["out"][req["len"] - len(req["prompt"])])
            p = req["len"] + req["delta"]
            positions.append([p, p, p])
        slots += [req["blocks"][i // BLOCK_SIZE] * BLOCK_SIZE + i % BLOCK_SIZE for i in new]
        req["len"] += 0 if prefill else 1
        q_cu.append(q_cu[-1] + len(new))
        kv_cu.append(kv_cu[-1] + req["len"])
        tables.append(req["blocks"])
    i64 = dict(dtype=torch.int64)
    params = ModelInputParams(
        batch_forward_type=BatchForwardType("prefill" if prefill else "decode"),
        q_seq_lens=torch.tensor(q_cu, **i64).to(device), kv_seq_lens=torch.tensor(kv_cu, **i64).to(device),
        q_seq_lens_vec=q_cu, kv_seq_lens_vec=kv_cu, q_max_seq_len=max(b - a for a, b in zip(q_cu, q_cu[1:])),
        kv_max_seq_len=max(b - a for a, b in zip(kv_cu, kv_cu[1:])),
        new_cache_slots=torch.tensor(slots, **i64).to(device), block_tables=torch.tensor(tables, **i64).to(device))
    tok = torch.tensor(tokens, **i64).to(device)
    pos = torch.tensor(positions, **i64).t().contiguous().to(device)  # [3, num_tokens]
    return tok, pos, params


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant

    def serve(enable_graph: bool):
        model = QWen3ModelImpl(device)
        kv_caches = [(torch.zeros(NUM_BLOCKS, BLOCK_SIZE, N_HEADS, HEAD_DIM, dtype=DTYPE, device=device),
                      torch.zeros(NUM_BLOCKS, BLOCK_SIZE, N_HEADS, HEAD_DIM, dtype=DTYPE, device=device))
                     for _ in range(N_LAYERS)]
        executor = MluGraphExecutorImpl(model, device) if enable_graph else BaseExecutorImpl(model)
        reqs = []
        for name, kind, n, blocks, out in (("A", "image", 7, [1, 2, 3], [5, 9, 2, 30, 11]),
                                          ("B", "text", 5, [4, 5, 6], [7, 3, 14])):
            gen = generator(ord(name))
            pos, nxt = _prompt_positions(kind, n)
            reqs.append(dict(prompt=torch.randint(0, VOCAB, (n,), generator=gen).tolist(), pos=pos, len=n,
                             delta=nxt - n, blocks=blocks, out=out))
        tok, pos, params = _step(reqs, device, prefill=True)
        outs = [executor.run(tok, pos, kv_caches, params).clone()]
        for batch in ([0, 1], [0, 1], [0, 1], [0], [0]):            # decode: [A, B] x3, then [A] x2
            tok, pos, params = _step([reqs[i] for i in batch], device, prefill=False)
            outs.append(executor.run(tok, pos, kv_caches, params).clone())
        return outs

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
