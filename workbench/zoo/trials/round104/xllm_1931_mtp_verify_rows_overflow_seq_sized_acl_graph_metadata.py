"""xLLM ACL graphs with MTP speculative decoding (non-hybrid models): the graph's per-row attention metadata buffers are sized by the sequence capacity, but target verify gives every proposal token its own decode row, so a verify batch of two sequences no longer fits.

Upstream: https://github.com/xLLM-AI/xllm/pull/1931 ("bugfix: preserve MTP correctness during asynchronous execution.",
xLLM-AI/xllm, by DongheJin, opened 2026-07-13, merged 2026-07-14 as commit 37d0594ae; cherry-picked as #1932).
Read: the PR description (three bullets: "replace per-forward stream synchronization with retained input and
ready-event dependencies", "size non-hybrid speculative graph metadata by decode token capacity", "cover expanded graph
metadata rows with an NPU regression test") and the commit's diff of ``runtime/acl_graph_persistent_param.cpp``
(the constructor sizes ``q_seq_lens_``, ``kv_seq_lens_`` and their defaults, ``persistent_block_tables_`` and its
default, ``q_cu_seq_lens_``, ``persistent_linear_state_indices_`` and ``persistent_num_accepted_tokens_`` by
``metadata_capacity = is_hybrid_linear_attention ? get_decode_graph_capacity(options) : max_graph_tokens`` instead of
``get_decode_graph_capacity(options)``; ``update`` bounds the block-table default copy by the padded batch), of
``forward_params.h`` and of the new test ``AclGraphPersistentParamTest.SpecVerifyMetadataUsesTokenCapacity``
(deepseek_v4, max_seqs_per_batch 10, num_decoding_tokens 3: 12 spec-verify decode rows must update without throwing;
the buffers must hold 30 rows). At the parent commit: ``get_decode_graph_capacity`` (= max_seqs_per_batch since #1887)
and ``get_decode_graph_token_capacity`` (max_seqs * num_decoding_tokens for a non-draft speculative engine), the
constructor, and ``GraphPersistentParam::update`` (decode: ``padded_batch_size = padded_num_tokens`` and
``actual_seq_len_rows = actual_num_tokens``; each buffer reset to its default, then ``slice(0, q_copy_len).copy_`` of
the step's rows, padded rows filled with 1 / zeroed); ``AclGraph::capture`` / ``replay`` as read for #1636.
The stream-synchronization part of the commit (MTP worker, retained inputs) is not modelled.
Symptom: serving a non-hybrid model (DeepSeek-V4) with MTP on Ascend with ACL graphs fails as soon as a target verify
batch has more rows than ``max_seqs_per_batch`` (two or more sequences with two drafts each here): the persistent
parameter update throws while copying the step's metadata into the graph's buffers; eager mode serves.
Mechanism: target verify is flattened into decode rows, one per proposal token (q_len 1, an expanded KV length and the
sequence's block table per row), so ``update`` copies ``actual_num_tokens`` metadata rows. The graph's token buffers
hold ``max_seqs * num_decoding_tokens`` tokens, but since #1887 the per-row metadata buffers hold only
``max_seqs_per_batch`` rows; ``q_seq_lens_.slice(0, 0, q_copy_len)`` clamps to the buffer, and copying the step's rows
into it fails.
Doctor: undersized-buffer, at __init__. The constructor of ``GraphPersistentParam`` sizes the per-row metadata buffers
for sequences while the graph serves up to ``max_seqs * num_decoding_tokens`` rows; a verify step's rows do not fit.
Fix (upstream): size the per-row metadata buffers by the decode token capacity for non-hybrid models.
Modelled: ``get_decode_graph_capacity`` / ``get_decode_graph_token_capacity`` and ``GraphPersistentParam.__init__`` /
``update`` as read (default-buffer resets, row copies, padded-row fills, ``zero_tensor_tail``), ``AclGraph.capture`` /
``replay`` (no warm-up run, thread-local capture mode, one replay after capture), ``AclGraphExecutorImpl.run`` (token
buckets 1, 2, 4, 8, 12; prefill eager) and eager ``BaseExecutorImpl``. Stand-ins: a 2-layer decoder (RMSNorm, qkv,
paged KV writes at ``new_cache_slots``, expanded paged decode attention over each row's block table limited by its KV
length, gated MLP), no RoPE; the draft tokens (the MTP module's proposals) and the accepted counts are fixed in advance,
and the sampler is left out; block 0 is the dummy block; float64.
Workload: max_seqs_per_batch 4, num_decoding_tokens 3 (1 + 2 drafts). Prefill A (5 tokens) and B (7) eagerly; verify
[A] (3 rows, bucket 4: captured); verify [A, B] (6 rows, bucket 8); verify [A, B] again; verify [B] (bucket 4
replayed). Bug: the second verify step raises RuntimeError in ``update`` while filling the bucket-8 graph's 4-row
``q_seq_lens_`` with 6 rows ("The size of tensor a (4) must match the size of tensor b (6)"). Fix: the 18 verify rows
of the four steps equal eager (max error 2.8e-15: the graph's block tables are wider than eager's, so the masked
attention sums over more zero terms).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/xLLM-AI/xllm/pull/1931"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "__init__"
SYMPTOM = ("MTP speculative decoding on ACL graphs fails once a verify batch has more rows than max_seqs_per_batch: "
           "the graph's per-row metadata buffers are sized by sequences, verify rows are per proposal token")

VOCAB, HIDDEN, N_HEADS, HEAD_DIM, INTER, N_LAYERS = 32, 16, 2, 8, 24, 2
BLOCK_SIZE, NUM_BLOCKS, MAX_SEQ_LEN = 4, 16, 24
MAX_SEQS_PER_BATCH, NUM_DECODING_TOKENS, MAX_TOKENS_PER_BATCH = 4, 3, 32
DTYPE = torch.float64

_variant = "bug"


@dataclasses.dataclass
class Options:
    max_seqs_per_batch: int = MAX_SEQS_PER_BATCH
    num_decoding_tokens: int = NUM_DECODING_TOKENS
    max_tokens_per_batch: int = MAX_TOKENS_PER_BATCH
    enable_speculative_decode: bool = True
    is_draft_engine: bool = False


@dataclasses.dataclass
class ModelInputParams:
    is_decode: bool
    is_spec_verify: bool
    q_seq_lens: torch.Tensor          # one row per decode token (verify: per proposal token)
    kv_seq_lens: torch.Tensor
    block_tables: torch.Tensor
    new_cache_slots: torch.Tensor
    q_cu_seq_lens: torch.Tensor = None


# --- xllm/core/runtime/acl_graph_persistent_param.cpp -------------------------------------------------------------

def get_decode_graph_capacity(options: Options) -> int:
    assert options.num_decoding_tokens > 0, "num_decoding_tokens must be > 0 for graph capacity"
    return options.max_seqs_per_batch


def get_decode_graph_token_capacity(options: Options) -> int:
    assert options.num_decoding_tokens > 0, "num_decoding_tokens must be > 0 for graph token capacity"
    if options.enable_speculative_decode and not options.is_draft_engine:
        return options.max_seqs_per_batch * options.num_decoding_tokens
    return options.max_seqs_per_batch


def zero_tensor_tail(t, start, end):
    t[start:end].zero_()


class GraphPersistentParam:
    def __init__(self, options: Options, device, is_hybrid_linear_attention: bool = False):
        self.options_ = options
        max_tokens_per_batch = options.max_tokens_per_batch
        max_graph_tokens = get_decode_graph_token_capacity(options)
        if _variant == "bug":
            metadata_capacity = get_decode_graph_capacity(options)            # max_seqs_per_batch
        else:
            # Hybrid spec verify keeps sequence-scoped metadata, while non-hybrid MTP expands every proposal token
            # into its own decode metadata row.
            metadata_capacity = (get_decode_graph_capacity(options) if is_hybrid_linear_attention
                                 else max_graph_tokens)
        i32 = dict(dtype=torch.int32, device=device)
        max_block_table_len = (MAX_SEQ_LEN + BLOCK_SIZE - 1) // BLOCK_SIZE + 1
        self.persistent_tokens_ = torch.zeros(max_tokens_per_batch, dtype=torch.int64, device=device)
        self.persistent_new_cache_slots_ = torch.zeros(max_tokens_per_batch, **i32)
        self.persistent_new_cache_slots_default_ = torch.zeros(max_tokens_per_batch, **i32)
        self.q_seq_lens_ = torch.zeros(metadata_capacity, **i32)
        self.kv_seq_lens_ = torch.zeros(metadata_capacity, **i32)
        self.q_seq_lens_default_ = torch.ones(metadata_capacity, **i32)
        self.kv_seq_lens_default_ = torch.ones(metadata_capacity, **i32)
        self.persistent_block_tables_ = torch.zeros(metadata_capacity, max_block_table_len, **i32)
        self.persistent_block_tables_default_ = torch.zeros(metadata_capacity, max_block_table_len, **i32)
        self.q_cu_seq_lens_ = torch.zeros(metadata_capacity + 1, **i32)

    def static_buffers(self):
        return {"persistent_tokens_": self.persistent_tokens_, "persistent_new_cache_slots_":
                self.persistent_new_cache_slots_, "q_seq_lens_": self.q_seq_lens_, "kv_seq_lens_": self.kv_seq_lens_,
                "persistent_block_tables_": self.persistent_block_tables_, "q_cu_seq_lens_": self.q_cu_seq_lens_}

    def update(self, tokens, params: ModelInputParams, padded_num_tokens, return_capture_params):
        actual_num_tokens = tokens.size(0)
        padded_batch_size = padded_num_tokens                 # decode: one metadata row per token
        actual_seq_len_rows = actual_num_tokens
        self.persistent_tokens_[:actual_num_tokens].copy_(tokens)
        zero_tensor_tail(self.persistent_tokens_, actual_num_tokens, padded_num_tokens)
        self.persistent_new_cache_slots_.copy_(self.persistent_new_cache_slots_default_)
        self.persistent_new_cache_slots_[:actual_num_tokens].copy_(params.new_cache_slots)

        self.q_seq_lens_.copy_(self.q_seq_lens_default_)
        q_copy_len = min(actual_seq_len_rows, params.q_seq_lens.size(0))
        self.q_seq_lens_[:q_copy_len].copy_(params.q_seq_lens[:q_copy_len])
        self.kv_seq_lens_.copy_(self.kv_seq_lens_default_)
        kv_copy_len = min(actual_seq_len_rows, params.kv_seq_lens.size(0))
        self.kv_seq_lens_[:kv_copy_len].copy_(params.kv_seq_lens[:kv_copy_len])
        if padded_batch_size > actual_seq_len_rows:
            self.q_seq_lens_[actual_seq_len_rows:padded_batch_size].fill_(1)
            self.kv_seq_lens_[actual_seq_len_rows:padded_batch_size].fill_(1)

        self.persistent_block_tables_.copy_(self.persistent_block_tables_default_)
        rows, width = params.block_tables.shape
        self.persistent_block_tables_[:rows, :width].copy_(params.block_tables)
        zero_tensor_tail(self.persistent_block_tables_, actual_seq_len_rows, padded_batch_size)
        self.q_cu_seq_lens_[0] = 0
        self.q_cu_seq_lens_[1:padded_batch_size + 1].copy_(self.q_seq_lens_[:padded_batch_size].cumsum(0))
        if not return_capture_params:
            return None
        return dataclasses.replace(
            params, q_seq_lens=self.q_seq_lens_[:padded_batch_size], kv_seq_lens=self.kv_seq_lens_[:padded_batch_size],
            block_tables=self.persistent_block_tables_[:padded_batch_size],
            new_cache_slots=self.persistent_new_cache_slots_[:padded_num_tokens],
            q_cu_seq_lens=self.q_cu_seq_lens_[:padded_batch_size + 1])


# --- the model (stand-in for the DeepSeek-V4 decoder on NPU) ----------------------------------------------------------

def rms_norm(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def paged_decode_attention(q, k_cache, v_cache, params: ModelInputParams):
    """Expanded spec-verify decode: one query row per proposal token over its sequence's blocks, up to its KV length."""
    width = params.block_tables.size(1)
    ctx = torch.arange(width * BLOCK_SIZE, device=q.device)
    slots = params.block_tables[:, ctx // BLOCK_SIZE].long() * BLOCK_SIZE + ctx % BLOCK_SIZE
    k, v = k_cache.view(-1, N_HEADS, HEAD_DIM)[slots], v_cache.view(-1, N_HEADS, HEAD_DIM)[slots]
    scores = torch.einsum("thd,tchd->thc", q, k) / HEAD_DIM ** 0.5
    masked = ctx[None, :] >= params.kv_seq_lens[:, None]
    return torch.einsum("thc,tchd->thd", scores.masked_fill(masked[:, None, :], float("-inf")).softmax(-1), v)


class DecoderLayer:
    def __init__(self, gen, device):
        r = lambda *s, scale=0.3: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.qkv, self.o = r(3 * HIDDEN, HIDDEN), r(HIDDEN, HIDDEN)
        self.gate_up, self.down = r(2 * INTER, HIDDEN), r(HIDDEN, INTER)
        self.in_norm, self.post_norm = 1.0 + r(HIDDEN, scale=0.1), 1.0 + r(HIDDEN, scale=0.1)

    def forward(self, h, kv_cache, params: ModelInputParams):
        q, k, v = F.linear(rms_norm(h, self.in_norm), self.qkv).view(-1, 3, N_HEADS, HEAD_DIM).unbind(1)
        k_cache, v_cache = kv_cache
        slots = params.new_cache_slots.long()
        k_cache.view(-1, N_HEADS, HEAD_DIM).index_copy_(0, slots, k)     # reshape_and_cache
        v_cache.view(-1, N_HEADS, HEAD_DIM).index_copy_(0, slots, v)
        h = h + F.linear(paged_decode_attention(q, k_cache, v_cache, params).reshape(-1, HIDDEN), self.o)
        gate, up = F.linear(rms_norm(h, self.post_norm), self.gate_up).chunk(2, dim=-1)
        return h + F.linear(F.silu(gate) * up, self.down)


class DeepseekV4Model:
    def __init__(self, device):
        gen = generator(1931)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device).to(DTYPE)
        self.layers = [DecoderLayer(gen, device) for _ in range(N_LAYERS)]
        self.norm = 1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1).to(DTYPE)

    def forward(self, tokens, kv_caches, params: ModelInputParams):
        h = self.embed_tokens[tokens]
        for layer, kv_cache in zip(self.layers, kv_caches):
            h = layer.forward(h, kv_cache, params)
        return rms_norm(h, self.norm)


# --- xllm/core/runtime/acl_graph_executor_impl.cpp (reduced) ----------------------------------------------------------

def get_bucket_num_tokens(num_tokens: int) -> int:
    return next(b for b in (1, 2, 4, 8, 12) if num_tokens <= b)


class AclGraph:
    def __init__(self, persistent_param: GraphPersistentParam, device):
        self.persistent_param_, self.device = persistent_param, device
        self.graph_ = self.hidden_states_ = None
        self.num_tokens_ = 0

    def capture(self, model, tokens, params, kv_cache, bucket_num_tokens):
        self.num_tokens_ = n = bucket_num_tokens
        p = self.persistent_param_
        graph_params = p.update(tokens, params, n, return_capture_params=True)

        def forward():
            return model.forward(p.persistent_tokens_[:n], kv_cache, graph_params)

        state = {f"kv_cache[{i}].{name}": t for i, c in enumerate(kv_cache) for name, t in zip(("k", "v"), c)}
        # capture_begin(..., ACL_MODEL_RI_CAPTURE_MODE_THREAD_LOCAL): no warm-up run before it
        self.graph_, self.hidden_states_ = capture(forward, device=self.device, warmups=0, static=p.static_buffers(),
                                                   state=state, owner="AclGraphExecutorImpl",
                                                   capture_error_mode="thread_local", name=f"acl decode graph {n}")
        return replay(self.graph_, self.hidden_states_, real=tokens.size(0), size=n)     # graph_.replay()

    def replay(self, tokens, params):
        self.persistent_param_.update(tokens, params, self.num_tokens_, return_capture_params=False)
        return replay(self.graph_, self.hidden_states_, real=tokens.size(0), size=self.num_tokens_)


class AclGraphExecutorImpl:
    def __init__(self, model, options: Options, device):
        self.model_, self.device_ = model, device
        self.persistent_param_ = GraphPersistentParam(options, device, is_hybrid_linear_attention=False)
        self.graphs_: dict[int, AclGraph] = {}

    def run(self, tokens, kv_caches, params: ModelInputParams):
        if not params.is_decode:                                          # prefill runs eagerly
            return self.model_.forward(tokens, kv_caches, params)
        bucket = get_bucket_num_tokens(tokens.size(0))
        if bucket in self.graphs_:
            out = self.graphs_[bucket].replay(tokens, params)
        else:
            graph = AclGraph(self.persistent_param_, self.device_)
            out = graph.capture(self.model_, tokens, params, kv_caches, bucket)
            self.graphs_[bucket] = graph
        return out[:tokens.size(0)]


class BaseExecutorImpl:                                                   # enable_graph = false
    def __init__(self, model):
        self.model_ = model

    def run(self, tokens, kv_caches, params):
        return self.model_.forward(tokens, kv_caches, params)


# --- the serving loop (stand-in for the scheduler, the MTP worker's verify input and its acceptance) ----------------

def _prefill_params(reqs):
    tokens, kv_lens, slots, tables = [], [], [], []
    for req in reqs:
        n = len(req["prompt"])
        tokens += req["prompt"]
        slots += [req["blocks"][i // BLOCK_SIZE] * BLOCK_SIZE + i % BLOCK_SIZE for i in range(n)]
        kv_lens += [i + 1 for i in range(n)]               # causal prefill as one row per token
        tables += [req["blocks"]] * n
        req["len"] = n
    return tokens, kv_lens, slots, tables


def _verify_params(reqs):
    """Target verify flattened into decode rows: the last token plus the drafts of each sequence."""
    tokens, kv_lens, slots, tables = [], [], [], []
    for req in reqs:
        step = req["steps"].pop(0)
        for j, tok in enumerate(step["proposal"]):
            pos = req["len"] + j
            tokens.append(tok)
            slots.append(req["blocks"][pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            kv_lens.append(pos + 1)
            tables.append(req["blocks"])
        req["len"] += step["accepted"] + 1                   # accepted drafts and the bonus token's predecessor
    return tokens, kv_lens, slots, tables


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant

    def serve(enable_graph: bool):
        model = DeepseekV4Model(device)
        kv_caches = [tuple(torch.zeros(NUM_BLOCKS, BLOCK_SIZE, N_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
                           for _ in range(2)) for _ in range(N_LAYERS)]
        executor = AclGraphExecutorImpl(model, Options(), device) if enable_graph else BaseExecutorImpl(model)
        reqs = {}
        for name, n, blocks, accepted in (("A", 5, [1, 2, 3, 4, 5], [2, 1, 0]), ("B", 7, [6, 7, 8, 9, 10], [1, 2, 2])):
            gen = generator(ord(name))
            steps = [dict(proposal=torch.randint(0, VOCAB, (NUM_DECODING_TOKENS,), generator=gen).tolist(),
                          accepted=a) for a in accepted]
            reqs[name] = dict(prompt=torch.randint(0, VOCAB, (n,), generator=gen).tolist(), blocks=blocks,
                              steps=steps, len=0)
        outs = []
        for batch, prefill in ((["A", "B"], True), (["A"], False), (["A", "B"], False), (["A", "B"], False),
                               (["B"], False)):
            build = _prefill_params if prefill else _verify_params
            tokens, kv_lens, slots, tables = build([reqs[r] for r in batch])
            i32 = dict(dtype=torch.int32)
            params = ModelInputParams(
                is_decode=not prefill, is_spec_verify=not prefill,
                q_seq_lens=torch.ones(len(tokens), **i32).to(device), kv_seq_lens=torch.tensor(kv_lens, **i32).to(device),
                block_tables=torch.tensor(tables, **i32).to(device), new_cache_slots=torch.tensor(slots, **i32).to(device))
            out = executor.run(torch.tensor(tokens, dtype=torch.int64).to(device), kv_caches, params)
            if not prefill:
                outs.append(out.clone())
        return outs

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
