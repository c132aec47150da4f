"""ACL-graph decode never re-plans the paged-attention tiling: the DeepSeek-V3.2 skip test (``q_cu_seq_lens`` defined) holds for every model.

Upstream: https://github.com/xLLM-AI/xllm/pull/784 ("bugfix: fix the condition for executing update_attention_plan
to use model_type."), commit c67e08bf, 2026-01-25. The skip came in with https://github.com/xLLM-AI/xllm/pull/759
("feat: support IntraLayerAddNorm, aclgragh, etc for DeepSeek 3.2.", commit c8a97f72, 2026-01-22).
Symptom: the PR has no description. From the code: with ``enable_graph`` on Ascend, the decode attention of ordinary
models (Qwen3, GLM4-MoE, Qwen3-MoE) runs the captured ACL-graph paged attention with a tiling that was never planned
(zeros), whatever the batch's context lengths, so decode attention is wrong (garbled tokens). Graphs off, it is right.
Mechanism: ``xllm/core/runtime/acl_graph_executor_impl.cpp``. ``GraphPersistentParam`` owns a persistent device
tensor ``tiling_data_`` (``torch::zeros`` in ``initialize_paged_attention_plan_context``); the captured decoder layers
(``enableAclGraphPagedAttention``) take it as their paged-attention tiling through
``params_for_capture->graph_buffer.tiling_data``: the device kernel reads the batch count and each sequence's
``kvSeqLen`` from it instead of planning on the host. ``GraphPersistentParam::update``, called by
``AclGraph::capture`` and before every ``AclGraph::replay``, must therefore refill it from the step's host lengths
(``plan_paged_attention_tiling``: the custom PA op's ``Setup`` on ``kv_seq_lens_vec``, then an H2D copy of the host
tiling). #759 made that re-plan conditional, to skip DeepSeek-V3.2 (whose layer does not use it), with
``if (!params.q_cu_seq_lens.defined())`` as the test for "not DeepSeek-V3.2". But every LLM step reaches the worker
through ``RemoteWorker::step_async(RawForwardInput)`` and ``proto_to_forward_input`` (``params_utils.cpp``), which
always sets ``input_params.q_cu_seq_lens = torch::tensor(partial_sum(q_seq_lens))``. So ``update`` never plans, at
capture or before any replay: every replayed decode step reads ``tiling_data_`` as its constructor left it. Eager
(graphs off) never reads ``tiling_data_``: the ATB op plans its own tiling from the host lengths on every call.
Doctor: stale-input, at ``update`` (the captured paged attention reads the static input ``tiling_data_``, whose
elements ``GraphPersistentParam::update`` should refresh each step from the step's lengths but skips on the wrong
predicate; the real rows' attention depends on elements of a static input the step did not write).
Fix (upstream): the constructor sets ``need_update_attention_plan_ = (args.model_type() != "deepseek_v32")`` and
``update`` plans the tiling when that flag is set, before capture and before every replay.
Modelled: a 2-layer Qwen3-style decoder (no rotary, no norms, no MLP) over a paged KV cache; prefill is not modelled
(the prompts' K/V are written into the cache before decode, identically in both modes); every decode step holds 4
sequences, the captured bucket, so no row is padded. The host tiling keeps the ATB layout's header (44 words:
batch, heads, head dim, block size, max blocks, ...) and per-batch records (17 words: qSeqLen, kvSeqLen, ...); the
graph kernel reads the batch count and ``kvSeqLen`` from the device tiling (a sequence past the batch count, or with
no KV, gets a zero output). The eager ATB op plans into a fresh tensor and runs the same kernel. Streams, the plan
context and the ATB variant pack are not modelled.
"""

import dataclasses
from itertools import accumulate
from typing import Optional

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/xLLM-AI/xllm/pull/784"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "update"
SYMPTOM = ("ACL-graph decode of ordinary models: update() skips the paged-attention tiling plan because "
           "q_cu_seq_lens is always defined; replays attend with a never-planned tiling, wrong decode attention")

VOCAB, NUM_HEADS, HEAD_DIM, NUM_LAYERS = 16, 2, 4, 2
HIDDEN = NUM_HEADS * HEAD_DIM
BLOCK_SIZE, MAX_BLOCKS = 4, 4
MAX_SEQ_LEN = BLOCK_SIZE * MAX_BLOCKS
MAX_SEQS_PER_BATCH = 4
NUM_BLOCKS = 1 + MAX_SEQS_PER_BATCH * MAX_BLOCKS                 # block 0 unused
TILING_HEAD_SIZE, TILING_PARA_SIZE = 44, 17
TILING_BUFFER_SIZE = TILING_HEAD_SIZE + TILING_PARA_SIZE * MAX_SEQS_PER_BATCH
FLAGS_enable_graph = {"value": False}                          # gflags --enable_graph


@dataclasses.dataclass
class ModelArgs:
    model_type: str = "qwen3"
    n_heads: int = NUM_HEADS
    head_dim: int = HEAD_DIM


@dataclasses.dataclass
class GraphBuffer:
    tiling_data: Optional[torch.Tensor] = None


@dataclasses.dataclass
class ModelInputParams:
    num_sequences: int
    is_decode: bool
    kv_seq_lens: torch.Tensor
    kv_seq_lens_vec: list
    q_seq_lens: torch.Tensor
    q_seq_lens_vec: list
    new_cache_slots: torch.Tensor
    block_tables: torch.Tensor
    q_cu_seq_lens: Optional[torch.Tensor] = None
    graph_buffer: GraphBuffer = dataclasses.field(default_factory=GraphBuffer)


# --- xllm/core/runtime/params_utils.cpp: the worker's input path (RemoteWorker -> WorkerService) -------------------

def proto_to_forward_input(seq_lens, q_seq_lens, new_token_slot_ids, block_tables_vec, device):
    """Builds the step's ``ModelInputParams``; ``q_cu_seq_lens`` is always set (``std::partial_sum``)."""
    q_cu_seq_lens = list(accumulate(q_seq_lens))

    def t(xs):
        return torch.tensor(xs, dtype=torch.int32).to(device)

    return ModelInputParams(
        num_sequences=len(block_tables_vec), is_decode=True,
        kv_seq_lens=t(seq_lens), kv_seq_lens_vec=list(seq_lens),
        q_seq_lens=t(q_seq_lens), q_seq_lens_vec=list(q_seq_lens),
        new_cache_slots=t(new_token_slot_ids), block_tables=t(block_tables_vec),
        q_cu_seq_lens=t(q_cu_seq_lens))


# --- ATB custom paged attention: host tiling (Setup) and the device kernel ------------------------------------------

def custom_paged_attention_setup(kv_seq_lens_vec, q_seq_lens_vec, num_tokens, args: ModelArgs):
    """The op's ``Setup``: the host tiling buffer (header, then one record per batch)."""
    batch = len(kv_seq_lens_vec)
    head = [0] * TILING_HEAD_SIZE
    head[0], head[1], head[2] = batch, args.n_heads, args.head_dim       # TILING_BATCH / NUMHEADS / HEADDIM
    head[3], head[4], head[5] = num_tokens, BLOCK_SIZE, MAX_BLOCKS        # NUMBLOKS / BLOCKSIZE / MAXBLOCKS
    head[22] = max(kv_seq_lens_vec, default=0)                           # TILING_MAX_KVSEQLEN
    paras = []
    for b, (q_len, kv_len) in enumerate(zip(q_seq_lens_vec, kv_seq_lens_vec)):
        para = [0] * TILING_PARA_SIZE
        para[0], para[1], para[3], para[8] = q_len, kv_len, BLOCK_SIZE, b  # qSeqLen, kvSeqLen, blockSize, seqIdx
        paras += para
    return head + paras


def custom_paged_attention(query, k_cache, v_cache, block_tables, tiling_data):
    """The device kernel: batch count and each sequence's ``kvSeqLen`` come from the tiling tensor."""
    rows = query.shape[0]
    b = torch.arange(rows, device=query.device)
    batch = tiling_data[0].long()
    kv_len = tiling_data[TILING_HEAD_SIZE + TILING_PARA_SIZE * b + 1].long()
    kv_len = torch.where(b < batch, kv_len, torch.zeros_like(kv_len))
    t = torch.arange(MAX_SEQ_LEN, device=query.device)
    slots = block_tables.long()[:, t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE            # [B, T]
    k = k_cache.view(-1, NUM_HEADS, HEAD_DIM)[slots]                                          # [B, T, H, D]
    v = v_cache.view(-1, NUM_HEADS, HEAD_DIM)[slots]
    valid = t[None, :] < kv_len[:, None]                                                      # [B, T]
    scores = torch.einsum("bhd,bthd->bht", query, k) / HEAD_DIM ** 0.5
    p = torch.softmax(scores.masked_fill(~valid[:, None, :], -1e9), -1) * valid[:, None, :]
    return torch.einsum("bht,bthd->bhd", p, v)


# --- xllm/core/layers/npu/npu_qwen3_decoder_layer_impl.cpp (reduced) --------------------------------------------------

class NpuQwen3DecoderLayerImpl:
    def __init__(self, args: ModelArgs, gen, device):
        self.args = args
        self.wq, self.wk, self.wv, self.wo = (randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6)
                                              for _ in range(4))

    def forward(self, x, kv_cache, input_params: ModelInputParams):
        k_cache, v_cache = kv_cache
        slots = input_params.new_cache_slots.long()
        k_cache.view(-1, HIDDEN)[slots] = x @ self.wk                   # reshape_and_cache
        v_cache.view(-1, HIDDEN)[slots] = x @ self.wv
        if FLAGS_enable_graph["value"] and input_params.is_decode and input_params.graph_buffer.tiling_data is not None:
            tiling = input_params.graph_buffer.tiling_data               # enableAclGraphPagedAttention
        else:                                                            # the ATB op plans its own tiling
            tiling = torch.tensor(custom_paged_attention_setup(input_params.kv_seq_lens_vec,
                                                               input_params.q_seq_lens_vec, x.shape[0], self.args),
                                  dtype=torch.int32).to(x.device)
        attn = custom_paged_attention((x @ self.wq).view(-1, NUM_HEADS, HEAD_DIM), k_cache, v_cache,
                                      input_params.block_tables, tiling)
        return x + torch.tanh(attn.reshape(-1, HIDDEN) @ self.wo)


class Qwen3ForCausalLM:
    def __init__(self, args: ModelArgs, device):
        gen = generator(784)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.pos_embed = randn(MAX_SEQ_LEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.layers = [NpuQwen3DecoderLayerImpl(args, gen, device) for _ in range(NUM_LAYERS)]

    def forward(self, tokens, positions, kv_caches, input_params: ModelInputParams):
        h = self.embed[tokens.long()] + self.pos_embed[positions.long()]
        for layer, kv_cache in zip(self.layers, kv_caches):
            h = layer.forward(h, kv_cache, input_params)
        return h


# --- xllm/core/runtime/acl_graph_executor_impl.cpp ----------------------------------------------------------------

class GraphPersistentParam:
    def __init__(self, args: ModelArgs, device, variant):
        self.args_, self.device_, self.variant = args, device, variant
        if variant == "fix":
            # Determine whether attention plan needs to be updated based on model type
            self.need_update_attention_plan_ = args.model_type != "deepseek_v32"
        n = MAX_SEQS_PER_BATCH
        self.persistent_tokens_ = torch.zeros(n, dtype=torch.int32, device=device)
        self.persistent_positions_ = torch.zeros(n, dtype=torch.int32, device=device)
        self.persistent_new_cache_slots_ = torch.zeros(n, dtype=torch.int32, device=device)
        self.q_seq_lens_ = torch.zeros(n, dtype=torch.int32, device=device)
        self.kv_seq_lens_ = torch.zeros(n, dtype=torch.int32, device=device)
        self.persistent_block_tables_ = torch.zeros(n, MAX_BLOCKS, dtype=torch.int32, device=device)
        self.q_cu_seq_lens_ = torch.zeros(0, dtype=torch.int32, device=device)
        self.initialize_paged_attention_plan_context()

    def initialize_paged_attention_plan_context(self):
        self.tiling_data_ = torch.zeros(TILING_BUFFER_SIZE, dtype=torch.int32, device=self.device_)

    def buffers(self):
        return {"persistent_tokens_": self.persistent_tokens_, "persistent_positions_": self.persistent_positions_,
                "persistent_new_cache_slots_": self.persistent_new_cache_slots_, "q_seq_lens_": self.q_seq_lens_,
                "kv_seq_lens_": self.kv_seq_lens_, "persistent_block_tables_": self.persistent_block_tables_,
                "tiling_data_": self.tiling_data_}

    def plan_paged_attention_tiling(self, tokens, params: ModelInputParams):
        """``Setup`` of the plan op on the step's host lengths, then ``aclrtMemcpyAsync`` of the host tiling."""
        host_tiling = custom_paged_attention_setup(params.kv_seq_lens_vec, params.q_seq_lens_vec,
                                                   tokens.shape[0], self.args_)
        self.tiling_data_[:len(host_tiling)].copy_(torch.tensor(host_tiling, dtype=torch.int32))

    def update(self, tokens, positions, params: ModelInputParams, padded_num_tokens: int,
               return_capture_params: bool = False):
        n, b = tokens.shape[0], params.num_sequences
        self.persistent_tokens_[:n].copy_(tokens)
        self.persistent_positions_[:n].copy_(positions)
        self.q_seq_lens_[:b].copy_(params.q_seq_lens)
        self.kv_seq_lens_[:b].copy_(params.kv_seq_lens)
        self.persistent_new_cache_slots_[:n].copy_(params.new_cache_slots)
        self.persistent_block_tables_[:b, :params.block_tables.shape[1]].copy_(params.block_tables)
        # Update q_cu_seq_lens only if params.q_cu_seq_lens is defined
        if params.q_cu_seq_lens is not None:
            if self.q_cu_seq_lens_.numel() == 0:
                self.q_cu_seq_lens_ = torch.zeros(MAX_SEQS_PER_BATCH + 1, dtype=torch.int32, device=self.device_)
            self.q_cu_seq_lens_[:b].copy_(params.q_cu_seq_lens)
        if self.tiling_data_.numel() > 0:
            if self.variant == "bug":
                # Update tiling tensor except deepseek V3.2
                if params.q_cu_seq_lens is None:
                    self.plan_paged_attention_tiling(tokens, params)
            elif self.need_update_attention_plan_:
                # Update tiling tensor based on model type
                self.plan_paged_attention_tiling(tokens, params)
        if not return_capture_params:
            return None
        p = padded_num_tokens
        return dataclasses.replace(
            params, num_sequences=p, is_decode=True,
            kv_seq_lens=self.kv_seq_lens_[:p], q_seq_lens=self.q_seq_lens_[:p],
            kv_seq_lens_vec=list(params.kv_seq_lens_vec) + [1] * (p - b),
            q_seq_lens_vec=list(params.q_seq_lens_vec) + [1] * (p - b),
            new_cache_slots=self.persistent_new_cache_slots_[:p], block_tables=self.persistent_block_tables_[:p],
            q_cu_seq_lens=None if params.q_cu_seq_lens is None else self.q_cu_seq_lens_[:b],
            graph_buffer=GraphBuffer(tiling_data=self.tiling_data_))


class AclGraph:
    def __init__(self, persistent_param: GraphPersistentParam, device):
        self.persistent_param_, self.device = persistent_param, device
        self.num_tokens_ = 0

    def capture(self, model, tokens, positions, params, kv_caches, bucket_num_tokens):
        self.num_tokens_ = bucket_num_tokens
        p = self.persistent_param_
        graph_params = p.update(tokens, positions, params, self.num_tokens_, return_capture_params=True)

        def forward():
            return model.forward(p.persistent_tokens_[:self.num_tokens_], p.persistent_positions_[:self.num_tokens_],
                                 kv_caches, graph_params)

        self.graph_, self.hidden_states_ = capture(
            forward, device=self.device, warmups=0, name=f"decode bucket {bucket_num_tokens}",
            owner="GraphPersistentParam", capture_error_mode="thread_local",   # ACL_MODEL_RI_CAPTURE_MODE_THREAD_LOCAL
            static=p.buffers(),
            state={f"kv_caches[{i}].{kv}": c for i, (k, v) in enumerate(kv_caches) for kv, c in (("k", k), ("v", v))})
        return replay(self.graph_, self.hidden_states_)      # the test replay gives this step's hidden states

    def replay(self, tokens, positions, params):
        self.persistent_param_.update(tokens, positions, params, self.num_tokens_)
        return replay(self.graph_, self.hidden_states_)


class AclGraphExecutorImpl:
    def __init__(self, model, args, kv_caches, device, variant):
        self.model_, self.kv_caches, self.device = model, kv_caches, device
        self.persistent_param_ = GraphPersistentParam(args, device, variant)
        self.graphs_ = {}

    def run(self, tokens, positions, params: ModelInputParams):
        if not (FLAGS_enable_graph["value"] and params.is_decode):
            return self.model_.forward(tokens, positions, self.kv_caches, params)
        bucket_num_tokens = tokens.shape[0]            # every step fills its bucket
        if bucket_num_tokens in self.graphs_:
            return self.graphs_[bucket_num_tokens].replay(tokens, positions, params)
        g = AclGraph(self.persistent_param_, self.device)                     # lazy capture
        out = g.capture(self.model_, tokens, positions, params, self.kv_caches, bucket_num_tokens)
        self.graphs_[bucket_num_tokens] = g
        return out


# --- the workload ---------------------------------------------------------------------------------------------------

PROMPT_LENS = (5, 3, 7, 2)
BLOCKS = tuple([1 + MAX_BLOCKS * s + j for j in range(MAX_BLOCKS)] for s in range(MAX_SEQS_PER_BATCH))
DECODE_TOKENS = ([4, 13, 6, 1], [10, 2, 15, 7], [0, 9, 3, 14], [8, 5, 11, 12])


def run(variant: str, device: str = "cpu"):
    args = ModelArgs()
    model = Qwen3ForCausalLM(args, device)
    gen = generator(7840)
    # prompts' K/V, as prefill left them (prefill not modelled)
    prefill_kv = [(randn(NUM_BLOCKS, BLOCK_SIZE, HIDDEN, gen=gen, device=device),
                   randn(NUM_BLOCKS, BLOCK_SIZE, HIDDEN, gen=gen, device=device)) for _ in range(NUM_LAYERS)]

    def serve(enable_graph: bool):
        FLAGS_enable_graph["value"] = enable_graph
        try:
            kv_caches = [(k.clone(), v.clone()) for k, v in prefill_kv]
            executor = AclGraphExecutorImpl(model, args, kv_caches, device, variant)
            outs = []
            for step, ids in enumerate(DECODE_TOKENS):
                pos = [n + step for n in PROMPT_LENS]
                slots = [BLOCKS[s][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for s, p in enumerate(pos)]
                params = proto_to_forward_input([p + 1 for p in pos], [1] * len(pos), slots, list(BLOCKS), device)
                tokens = torch.tensor(ids, dtype=torch.int32).to(device)
                positions = torch.tensor(pos, dtype=torch.int32).to(device)
                outs.append(executor.run(tokens, positions, params).clone())
            return outs
        finally:
            FLAGS_enable_graph["value"] = False

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
