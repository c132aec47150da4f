"""xLLM ACL graphs: a decode batch whose longest sequence outgrows ``max_seq_len_for_graph_mode`` hits ``LOG(FATAL)`` in ``AclGraphExecutorImpl::run`` instead of the eager fallback written right after it.

Upstream: https://github.com/xLLM-AI/xllm/pull/799 ("bugfix: gracefully fallback to eager mode when seq_len exceeds
graph mode limit.", xLLM-AI/xllm, the Ascend NPU inference engine; by QwertyJack, fixes issue #798; merged
2026-01-27 as cf7188103).
Read: the PR description (root cause: ``LOG(FATAL) << "Not suitable for graph operations."`` kills the process, so
the eager fallback below it never runs; repro ``--max_seq_len_for_graph_mode=32768`` and a ~34k-token request ->
core dump), issue #798, the diff of ``xllm/core/runtime/acl_graph_executor_impl.cpp``, and the pre-fix
``acl_graph_executor_impl.cpp`` / ``.h``: the ``GraphPersistentParam`` constructor (persistent buffers sized
``max_tokens_per_batch``, ``max_seqs_per_batch``, block tables ``ceil(max_seq_len / block_size) + 1`` wide with
``max_seq_len = FLAGS_max_seq_len_for_graph_mode`` or ``max_position_embeddings``), ``GraphPersistentParam::update``
(slice copies, ``return_capture_params``), the getters and ``set_hidden_states``, ``AclGraph::capture`` (update,
``capture_begin``, forward on the persistent buffers, ``set_hidden_states``, ``capture_end``, a test replay),
``AclGraph::replay``, ``AclGraphExecutorImpl::run`` and ``get_bucket_num_tokens``.
Symptom: with ACL graphs enabled, serving dies (glog ``F... Not suitable for graph operations.``, SIGABRT, core dump)
at the first decode step in which any running sequence is longer than ``max_seq_len_for_graph_mode``; short
requests are fine, eager mode (``enable_graph=false``) serves the long one.
Mechanism: the persistent graph inputs (block tables, the attention mask of the models that use one, the paged
attention tiling) are sized once for ``max_seq_len_for_graph_mode`` tokens per sequence, and every captured graph
bakes that width in. ``run`` therefore checks ``kv_max_seq_len <= max_seq_len`` before replaying or capturing: a
batch that does not fit the captured buffers must not reach a graph. The branch for the batch that does not fit
was meant to count an eager execution and run ``model_->forward`` eagerly, but starts with ``LOG(FATAL)``, which
aborts the process: a sequence that grows past the limit during decode takes the whole engine down.
Doctor: undersized-buffer, at run (a decode step asks the graphs for more context per sequence than their persistent
buffers were sized and captured for; ``run`` decides what to do with it and aborts instead of routing it to eager).
Fix (upstream): ``LOG(FATAL)`` becomes ``LOG_FIRST_N(WARNING, 1)`` ("Falling back to eager mode because
kv_max_seq_len (..) > max_seq_len (..)"); the counter ``num_model_execution_total_eager`` is bumped and the step runs
``model_->forward`` eagerly. Later steps that fit again go back to (lazily captured) graphs.
Modelled: ``GraphPersistentParam`` (constructor sizes, ``update`` with its slice copies and capture params, the
getters, ``set_hidden_states``; no attention mask (``need_update_attn_mask`` false) and no tiling plan),
``AclGraph.capture`` / ``replay`` / ``get_hidden_states``, ``AclGraphExecutorImpl.run`` as read (eager for prefill and
one-layer models, bucket, seq-len check, replay or lazy capture with a test replay) and ``get_bucket_num_tokens``.
LOG(FATAL) is a raised ``RuntimeError`` with glog's message. Stand-ins: the ``CausalLM`` (two layers: token and
position embeddings, qkv, writes of K/V at ``new_cache_slots``, a paged attention over ``block_tables`` limited by
``kv_seq_lens`` in decode and causal over ``positions`` in prefill, o_proj, a gated MLP), int64 instead of kInt,
float64 instead of bf16, a fixed block assignment instead of the block manager, tokens drawn in advance.
Workload: block size 4, max_seq_len_for_graph_mode 16 (block tables 5 blocks wide), 4 sequences and 8 tokens per
batch at most. One prefill of A (12 tokens) and B (4); nine decode steps of [A, B] (bucket 2; A's KV grows 13..21,
B's 5..13), then A finishes and three decode steps of [B] (bucket 1; B 14..16). Steps 1-4 capture and replay the
bucket-2 graph; step 5 is the first with kv_max_seq_len 17 > 16. Bug: step 5 raises RuntimeError (the abort).
Fix: steps 5-9 run eagerly (A needs 6 blocks by step 9), steps 10-12 capture and replay the bucket-1 graph;
all 37 hidden-state rows of the 13 steps equal eager (max |graph - eager| = 0).
"""
from __future__ import annotations

import dataclasses
import logging

import torch
import torch.nn.functional as F

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/xLLM-AI/xllm/pull/799"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "run"
SYMPTOM = ("ACL-graph decode aborts the engine (LOG(FATAL) 'Not suitable for graph operations.') once a sequence "
           "outgrows max_seq_len_for_graph_mode, instead of falling back to eager")

FLAGS_max_seq_len_for_graph_mode = 16
FLAGS_max_tokens_per_batch = 8
FLAGS_enable_graph_no_padding = False
MAX_SEQS_PER_BATCH, BLOCK_SIZE, NUM_BLOCKS = 4, 4, 16
VOCAB, HIDDEN, INTER, N_HEADS, N_LAYERS, MAX_POSITION_EMBEDDINGS = 32, 16, 32, 2, 2, 64
HEAD_DIM = HIDDEN // N_HEADS
DTYPE = torch.float64

_variant = "bug"
LOG = logging.getLogger(__name__)
LOG.addHandler(logging.NullHandler())
num_model_execution_total_eager = [0]           # COUNTER_INC(num_model_execution_total_eager)
_warned = [0]                                   # LOG_FIRST_N(WARNING, 1)


@dataclasses.dataclass
class ModelInputParams:
    is_decode: bool                              # batch_forward_type.is_decode()
    num_sequences: int
    q_seq_lens: torch.Tensor
    kv_seq_lens: torch.Tensor
    q_seq_lens_vec: list
    kv_seq_lens_vec: list
    q_max_seq_len: int
    kv_max_seq_len: int
    new_cache_slots: torch.Tensor
    block_tables: torch.Tensor


class KVCache:
    def __init__(self, device: str):
        shape = (NUM_BLOCKS, BLOCK_SIZE, N_HEADS, HEAD_DIM)
        self.k_cache = torch.zeros(shape, dtype=DTYPE, device=device)
        self.v_cache = torch.zeros(shape, dtype=DTYPE, device=device)

    def get_k_cache(self):
        return self.k_cache

    def get_v_cache(self):
        return self.v_cache


# --- the model (stand-in for a CausalLM on ATB layers) ----------------------------------------------------------------

class CausalLM:
    def __init__(self, device: str):
        gen = generator(799)
        r = lambda *s, scale=0.3: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.embed_tokens, self.embed_positions = r(VOCAB, HIDDEN, scale=1.0), r(MAX_POSITION_EMBEDDINGS, HIDDEN)
        self.layers = [dict(qkv=r(3 * HIDDEN, HIDDEN), o=r(HIDDEN, HIDDEN), gate_up=r(2 * INTER, HIDDEN),
                            down=r(HIDDEN, INTER)) for _ in range(N_LAYERS)]

    def forward(self, tokens, positions, kv_caches, params: ModelInputParams) -> torch.Tensor:
        h = self.embed_tokens[tokens] + self.embed_positions[positions]
        for layer, kv_cache in zip(self.layers, kv_caches):
            q, k, v = F.linear(h, layer["qkv"]).view(-1, 3, N_HEADS, HEAD_DIM).unbind(1)
            k_cache, v_cache = kv_cache.get_k_cache(), kv_cache.get_v_cache()
            k_cache.view(-1, N_HEADS, HEAD_DIM).index_copy_(0, params.new_cache_slots, k)    # reshape_and_cache
            v_cache.view(-1, N_HEADS, HEAD_DIM).index_copy_(0, params.new_cache_slots, v)
            h = h + F.linear(paged_attention(q, k_cache, v_cache, positions, params), layer["o"])
            gate, up = F.linear(h, layer["gate_up"]).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, layer["down"])
        return h


def paged_attention(q, k_cache, v_cache, positions, params: ModelInputParams) -> torch.Tensor:
    """Each token reads its sequence's blocks through ``block_tables`` (as wide as the tensor it is given)."""
    n_tokens, width = q.size(0), params.block_tables.size(1)
    if params.is_decode:                         # one token per sequence; context = kv_seq_lens
        seq_ids = torch.arange(n_tokens, device=q.device)
    else:
        seq_ids = torch.repeat_interleave(torch.arange(params.num_sequences), torch.tensor(params.q_seq_lens_vec))
        seq_ids = seq_ids.to(q.device)
    ctx = torch.arange(width * BLOCK_SIZE, device=q.device)
    slots = params.block_tables[seq_ids][:, ctx // BLOCK_SIZE] * BLOCK_SIZE + ctx % BLOCK_SIZE   # [T, ctx]
    k = k_cache.view(-1, N_HEADS, HEAD_DIM)[slots]
    v = v_cache.view(-1, N_HEADS, HEAD_DIM)[slots]
    scores = torch.einsum("thd,tchd->thc", q, k) / HEAD_DIM ** 0.5
    if params.is_decode:
        masked = ctx[None, :] >= params.kv_seq_lens[seq_ids][:, None]
    else:
        masked = ctx[None, :] > positions[:, None]
    scores = scores.masked_fill(masked[:, None, :], float("-inf"))
    return torch.einsum("thc,tchd->thd", scores.softmax(-1), v).reshape(n_tokens, HIDDEN)


# --- xllm/core/runtime/acl_graph_executor_impl.{h,cpp} (reduced) -------------------------------------------------------

class GraphPersistentParam:
    def __init__(self, device: str):
        max_tokens_per_batch, max_seqs_per_batch = FLAGS_max_tokens_per_batch, MAX_SEQS_PER_BATCH
        max_seq_len = (FLAGS_max_seq_len_for_graph_mode if FLAGS_max_seq_len_for_graph_mode > 0
                       else MAX_POSITION_EMBEDDINGS)
        i64 = dict(dtype=torch.int64, device=device)
        self.persistent_tokens_ = torch.zeros(max_tokens_per_batch, **i64)
        self.persistent_positions_ = torch.zeros(max_tokens_per_batch, **i64)
        self.persistent_new_cache_slots_ = torch.zeros(max_tokens_per_batch, **i64)
        self.q_seq_lens_ = torch.zeros(max_seqs_per_batch, **i64)
        self.kv_seq_lens_ = torch.zeros(max_seqs_per_batch, **i64)
        max_block_table_len = (max_seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE + 1
        self.persistent_block_tables_ = torch.zeros(max_seqs_per_batch, max_block_table_len, **i64)
        self.hidden_states_ = torch.zeros(max_tokens_per_batch, HIDDEN, dtype=DTYPE, device=device)

    def static_buffers(self):
        return {"persistent_tokens_": self.persistent_tokens_, "persistent_positions_": self.persistent_positions_,
                "persistent_new_cache_slots_": self.persistent_new_cache_slots_, "q_seq_lens_": self.q_seq_lens_,
                "kv_seq_lens_": self.kv_seq_lens_, "persistent_block_tables_": self.persistent_block_tables_}

    def update(self, tokens, positions, params: ModelInputParams, padded_num_tokens: int,
               return_capture_params: bool = False):
        actual_num_tokens, actual_batch_size = tokens.size(0), params.num_sequences
        self.persistent_tokens_[:actual_num_tokens].copy_(tokens)
        self.persistent_positions_[:actual_num_tokens].copy_(positions)
        self.q_seq_lens_[:actual_batch_size].copy_(params.q_seq_lens)
        self.kv_seq_lens_[:actual_batch_size].copy_(params.kv_seq_lens)
        self.persistent_new_cache_slots_[:actual_num_tokens].copy_(params.new_cache_slots)
        actual_block_table_len = params.block_tables.size(1)
        self.persistent_block_tables_[:actual_batch_size, :actual_block_table_len].copy_(params.block_tables)
        if not return_capture_params:
            return None
        pad = padded_num_tokens - actual_batch_size
        return dataclasses.replace(
            params, is_decode=True, num_sequences=padded_num_tokens,
            kv_seq_lens=self.kv_seq_lens(padded_num_tokens), q_seq_lens=self.q_seq_lens(padded_num_tokens),
            kv_seq_lens_vec=list(params.kv_seq_lens_vec) + [1] * pad,
            q_seq_lens_vec=list(params.q_seq_lens_vec) + [1] * pad,
            new_cache_slots=self.persistent_new_cache_slots(padded_num_tokens),
            block_tables=self.persistent_block_tables(padded_num_tokens))

    def persistent_tokens(self, n):
        return self.persistent_tokens_[:n]

    def persistent_positions(self, n):
        return self.persistent_positions_[:n]

    def persistent_new_cache_slots(self, n):
        return self.persistent_new_cache_slots_[:n]

    def persistent_block_tables(self, actual_batch_size):
        return self.persistent_block_tables_[:actual_batch_size]

    def q_seq_lens(self, actual_batch_size):
        return self.q_seq_lens_[:actual_batch_size]

    def kv_seq_lens(self, actual_batch_size):
        return self.kv_seq_lens_[:actual_batch_size]

    def hidden_states(self, actual_tokens):
        return self.hidden_states_[:actual_tokens]

    def set_hidden_states(self, value):
        self.hidden_states_[:value.size(0)].copy_(value)
        return self.hidden_states_[:value.size(0)]


class AclGraph:
    def __init__(self, persistent_param: GraphPersistentParam, device: str):
        self.persistent_param_, self.device = persistent_param, device
        self.graph_, self.outputs_, self.num_tokens_ = None, None, 0

    def capture(self, model, tokens, positions, params, kv_caches, bucket_num_tokens) -> bool:
        self.num_tokens_ = bucket_num_tokens
        assert self.num_tokens_ >= tokens.size(0), "num_tokens_ >= actual_num_tokens"
        p = self.persistent_param_
        graph_params = p.update(tokens, positions, params, self.num_tokens_, return_capture_params=True)
        state = {f"kv_caches[{i}].{name}": t for i, c in enumerate(kv_caches)
                 for name, t in (("k_cache", c.k_cache), ("v_cache", c.v_cache))}

        def forward():
            forward_result = model.forward(p.persistent_tokens(self.num_tokens_),
                                           p.persistent_positions(self.num_tokens_), kv_caches, graph_params)
            return p.set_hidden_states(forward_result)

        # capture_begin({0, 0}): no mempool id, a new pool per graph; no warm-up run
        self.graph_, self.outputs_ = capture(forward, device=self.device, warmups=0, static=p.static_buffers(),
                                             state=state, owner="AclGraphExecutorImpl",
                                             name=f"acl decode graph {bucket_num_tokens} tokens")
        replay(self.graph_, self.outputs_, real=tokens.size(0), size=self.num_tokens_)   # test replay
        return True

    def replay(self, tokens, positions, kv_caches, params):
        actual_num_tokens = tokens.size(0)
        assert actual_num_tokens <= self.num_tokens_, "num_tokens mismatch"
        self.persistent_param_.update(tokens, positions, params, self.num_tokens_, return_capture_params=False)
        replay(self.graph_, self.outputs_, real=actual_num_tokens, size=self.num_tokens_)
        return self.get_hidden_states(actual_num_tokens)

    def get_hidden_states(self, actual_num_tokens):
        return self.persistent_param_.hidden_states(actual_num_tokens)


class AclGraphExecutorImpl:
    def __init__(self, model: CausalLM, device: str, num_decoding_tokens: int = 1):
        self.model_, self.device_, self.num_decoding_tokens = model, device, num_decoding_tokens
        self.persistent_param_ = GraphPersistentParam(device)
        self.graphs_: dict[int, AclGraph] = {}

    def run(self, tokens, positions, kv_caches, params: ModelInputParams) -> torch.Tensor:
        if not params.is_decode or N_LAYERS == 1:
            num_model_execution_total_eager[0] += 1
            return self.model_.forward(tokens, positions, kv_caches, params)
        n_tokens = tokens.size(0)
        bucket_num_tokens = self.get_bucket_num_tokens(n_tokens)
        max_seq_len = (FLAGS_max_seq_len_for_graph_mode if FLAGS_max_seq_len_for_graph_mode > 0
                       else MAX_POSITION_EMBEDDINGS)
        seq_len_supported = params.kv_max_seq_len <= max_seq_len
        capture_supported = seq_len_supported
        if not capture_supported:
            if _variant == "bug":
                # LOG(FATAL): glog prints the message and aborts the process (SIGABRT, core dump)
                raise RuntimeError("Not suitable for graph operations.")
            if _warned[0] < 1:
                _warned[0] += 1
                LOG.warning("Falling back to eager mode because kv_max_seq_len (%d) > max_seq_len (%d). This message "
                            "is logged only once. Monitor counter 'num_model_execution_total_eager' for frequency.",
                            params.kv_max_seq_len, max_seq_len)
            num_model_execution_total_eager[0] += 1
            return self.model_.forward(tokens, positions, kv_caches, params)
        if bucket_num_tokens in self.graphs_:
            return self.graphs_[bucket_num_tokens].replay(tokens, positions, kv_caches, params)
        graph = AclGraph(self.persistent_param_, self.device_)
        if graph.capture(self.model_, tokens, positions, params, kv_caches, bucket_num_tokens):
            self.graphs_[bucket_num_tokens] = graph
            return graph.get_hidden_states(n_tokens)
        num_model_execution_total_eager[0] += 1
        return self.model_.forward(tokens, positions, kv_caches, params)

    def get_bucket_num_tokens(self, num_tokens: int) -> int:
        if FLAGS_enable_graph_no_padding:
            return num_tokens
        for bucket in (1, 2, 4, 8):
            if num_tokens <= bucket:
                return bucket
        return (num_tokens + 15) // 16 * 16


# --- the serving workload ---------------------------------------------------------------------------------------------

BLOCKS = {"A": [3, 7, 1, 9, 12, 5], "B": [2, 10, 4, 14]}       # the block manager's (fixed) assignment


def make_batch(seqs, device: str):
    """``seqs``: (name, tokens, first position); the sequence's KV after the step ends at first + len(tokens)."""
    kv_lens = [start + len(toks) for _, toks, start in seqs]
    width = max(-(-n // BLOCK_SIZE) for n in kv_lens)
    tables = [(BLOCKS[name] + [0] * width)[:width] for name, _, _ in seqs]
    positions = [p for _, toks, start in seqs for p in range(start, start + len(toks))]
    slots = [tables[i][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
             for i, (_, toks, start) in enumerate(seqs) for p in range(start, start + len(toks))]
    q_lens = [len(toks) for _, toks, _ in seqs]
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)    # noqa: E731
    params = ModelInputParams(
        is_decode=all(q == 1 for q in q_lens), num_sequences=len(seqs), q_seq_lens=t(q_lens), kv_seq_lens=t(kv_lens),
        q_seq_lens_vec=q_lens, kv_seq_lens_vec=kv_lens, q_max_seq_len=max(q_lens), kv_max_seq_len=max(kv_lens),
        new_cache_slots=t(slots), block_tables=t(tables))
    return t([x for _, toks, _ in seqs for x in toks]), t(positions), params


def workload(device: str):
    gen = generator(7990)
    draw = lambda n: torch.randint(0, VOCAB, (n,), generator=gen).tolist()     # noqa: E731
    steps = [make_batch([("A", draw(12), 0), ("B", draw(4), 0)], device)]      # prefill
    for i in range(9):                                                          # decode [A, B]: A 13..21, B 5..13
        steps.append(make_batch([("A", draw(1), 12 + i), ("B", draw(1), 4 + i)], device))
    for i in range(3):                                                          # A finished; decode [B]: 14..16
        steps.append(make_batch([("B", draw(1), 13 + i)], device))
    return steps


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    num_model_execution_total_eager[0], _warned[0] = 0, 0
    steps = workload(device)

    def serve(enable_graph: bool):
        model, kv_caches = CausalLM(device), [KVCache(device) for _ in range(N_LAYERS)]
        executor = AclGraphExecutorImpl(model, device)
        outs = []
        for tokens, positions, params in steps:
            if enable_graph:
                outs.append(executor.run(tokens, positions, kv_caches, params).clone())
            else:
                outs.append(model.forward(tokens, positions, kv_caches, params).clone())
        return outs

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
