"""InfiniLM's static-batching graph compiler warms up and records the draft model on ``Tensor::empty`` placeholders: garbage position ids and past lengths crash the eagle MTP engine's start.

Upstream: https://github.com/InfiniTensor/InfiniLM/pull/545 ("fix/mtp-graph", merged 2026-08-18 as 62ef33d6; its one
commit 154e097b "fix: allow graph in eagle mtp").
Symptom: MiniCPM4 + eagle MTP speculative decoding with ``enable_graph``: the draft engine (the MiniCPM eagle model
on a ``StaticKVCacheConfig``) dies while it compiles its graph after the weights are loaded. Its rank worker logs
"exception during compile" and ``InferEngine::compile`` throws "RankWorker stopped during run", so the LLM cannot
start. The same engine without graphs starts and drafts normally. The commit gives no error text; the failure below
follows from the code.
Mechanism: ``StaticBatchingCompiler::compile()`` (csrc/engine/compiler/static_batching_compiler.cpp) makes the
graph's inputs with ``infinicore::Tensor::empty``: ``input_ids`` and ``position_ids`` ``{b, 1}``,
``past_sequence_lengths`` and ``total_sequence_lengths`` ``{b}``, all I64. Only ``total_sequence_lengths`` is then
written (memcpyH2D of ones). The compiler points the forward context's ``attn_metadata`` at them and runs
``(void)model_->forward(input)`` eagerly, then ``startGraphRecording()`` / ``forward`` / ``stopGraphRecording()``
(``Graph::instantiate``: 5 runs of the recorded ops, then the device capture). All three run on whatever bytes
InfiniCore's memory pool left in those blocks. In ``MiniCPMEagleModel::forward`` (no target hidden states: zeros)
the embedding kernel skips out-of-range ids. ``Attention::forward_static_`` then gives RoPE
``position_ids`` row 0, and the RoPE kernel indexes its sin/cos tables at ``pos_id * table_dim`` without a bounds
check: with a garbage position it reads far outside them. ``StaticAttentionImpl::do_kv_cache_update`` reads
``past_sequence_lengths[0]`` to the host and ``ASSERT(result_len <= max_seq_len)`` throws on a garbage length.
Either failure ends the compile. ``PagedCompiler::compile()`` already zeroed its placeholders; eager steps never see
these tensors. In the eagle flow the draft engine's graph is never replayed: ``SpeculativeRunner`` drafts through
``forward_raw`` (``sample_all_positions=True``), which ``RankWorker`` always runs eagerly. So the graph's only
effect is this start-up compile, and "allow graph in eagle mtp" means: let the draft engine compile at all.
Doctor: stale-input, at ``compile`` (the compile-time warm-up and capture read the static inputs ``input_ids``,
``position_ids`` and ``past_sequence_lengths``, which nothing wrote: the elements the step depends on are whatever
the allocator left there).
Fix (upstream): ``set_zeros`` on ``input_ids``, ``position_ids`` and ``past_sequence_lengths`` right after they are
created (token 0, position 0, past length 0), as ``PagedCompiler`` does. ``get_compiled`` still copies the live
inputs in before a replay.
Modelled: one eagle layer (``input_norm1/2``, ``fc``, a one-head ``MiniCPM4DecoderLayer`` with a SiLU MLP) and
``lm_head``; draft batch ``max_batch_size`` 2, ``max_cache_len`` 8, 3 draft steps for 2 requests; greedy sampling.
InfiniCore's op recording is kept: an op runs at once, or is appended to the recording graph. Host-side reads
(the cache position, the total length) happen when the forward is issued, so they are baked into the recorded ops,
as upstream. ``Graph::instantiate`` is the kit's ``capture`` with 5 warm-ups. ``GeneralCompiler`` is reduced to its
static half (the paged half returns at once for a static cache), TP and barriers are left out, and the rank worker
runs commands synchronously. ``Tensor::empty`` comes from a modelled device pool that hands out freed blocks
uncleared. Which earlier allocation's bytes the placeholders really got is not knowable. In the model it is fp32
activations the target engine released before the draft engine was built, so the garbage is the same on CPU and
GPU. The unchecked RoPE table read is a tensor index: it raises on the CPU and trips a device-side assert on CUDA,
where the real kernel reads wild memory.
"""
from __future__ import annotations

import math

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/InfiniTensor/InfiniLM/pull/545"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "compile"
SYMPTOM = ("eagle MTP with enable_graph: the draft engine's static-batching compile warms up and records on "
           "Tensor::empty placeholders; a garbage RoPE position / past length ends the compile and the engine "
           "fails to start ('RankWorker stopped during run')")

VOCAB, HIDDEN, HEAD_DIM, MAX_POS = 16, 8, 8, 16
MAX_BATCH_SIZE, MAX_CACHE_LEN = 2, 8          # StaticKVCacheConfig(max_batch_size, max_cache_len)
NUM_DRAFT_TOKENS = 3
EPS = 1e-6
I32, I64, F32 = torch.int32, torch.int64, torch.float32


# --- InfiniCore: the device memory pool, Tensor::empty, op record-or-run, graph recording ---------------------

class DeviceMemoryPool:
    """The runtime's pooled device allocator: a freed block goes back to the pool and the next allocation that fits
    gets it as it is (nothing clears it)."""

    def __init__(self, device):
        self.device = device
        self.free_blocks = []

    def release(self, tensor):
        self.free_blocks.append(tensor.reshape(-1).view(torch.uint8))

    def allocate(self, nbytes):
        nbytes = -(-nbytes // 8) * 8
        for i, block in enumerate(self.free_blocks):
            if block.numel() >= nbytes:
                self.free_blocks[i] = block[nbytes:]
                return block[:nbytes]
        return torch.zeros(nbytes, dtype=torch.uint8, device=self.device)   # a fresh segment


class Graph:
    """infinicore::graph::Graph: the recorded op list; ``instantiate`` warms it 5 times, then captures it."""

    def __init__(self, device):
        self.device = device
        self.op_list_ = []
        self.device_graph = None

    def add_operator(self, op):
        self.op_list_.append(op)

    def run(self):
        for op in self.op_list_:
            op()

    def instantiate(self):
        self.device_graph, _ = capture(self.run, device=self.device, warmups=5, name="static batching decode",
                                       owner="StaticBatchingCompiler")


class Context:
    """infinicore::context for this rank's device: its memory pool and its graph manager."""

    def __init__(self, device):
        self.device = device
        self.pool = DeviceMemoryPool(device)
        self.graph_ = None                       # the graph being recorded, if any

    def empty(self, shape, dtype):
        """Tensor::empty: a pool block viewed as ``dtype`` (contents: what the block last held)."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        return self.pool.allocate(nbytes)[:nbytes].view(dtype).view(*shape)

    def startGraphRecording(self):
        self.graph_ = Graph(self.device)

    def stopGraphRecording(self):
        graph, self.graph_ = self.graph_, None
        graph.instantiate()
        return graph


context: Context | None = None


def record_or_run(op):
    """INFINICORE_GRAPH_OP_RECORD_OR_RUN: an op planned on its tensors runs now, or joins the recording graph."""
    if context.graph_ is not None:
        context.graph_.add_operator(op)
    else:
        op()


def set_zeros(tensor):
    tensor.zero_()


# --- InfiniCore ops (outputs allocated at issue time, kernels run or recorded) ---------------------------------

def embedding(ids, weight):
    out = torch.zeros(*ids.shape, weight.shape[1], device=weight.device)

    def run():  # the NVIDIA kernel copies a row only for 0 <= id < vocab_size
        valid = (ids >= 0) & (ids < weight.shape[0])
        rows = weight[torch.where(valid, ids, torch.zeros_like(ids))]
        out.copy_(torch.where(valid[..., None], rows, out))
    record_or_run(run)
    return out


def rms_norm(x, w):
    out = torch.empty_like(x)
    record_or_run(lambda: out.copy_(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w))
    return out


def linear(x, w):
    out = torch.empty(*x.shape[:-1], w.shape[1], device=x.device)
    record_or_run(lambda: out.copy_(x @ w))
    return out


def add(a, b):
    out = torch.empty_like(a)
    record_or_run(lambda: out.copy_(a + b))
    return out


def silu(x):
    out = torch.empty_like(x)
    record_or_run(lambda: out.copy_(torch.nn.functional.silu(x)))
    return out


def copy_(dst, src):
    record_or_run(lambda: dst.copy_(src))


def rope_(x, pos_ids, sin_cache, cos_cache):
    """In place on ``x`` [b, s, heads, head_dim]; the kernel reads ``sin_table[pos_id * table_dim + i]`` unchecked."""
    def run():
        sin, cos = sin_cache[pos_ids][None, :, None, :], cos_cache[pos_ids][None, :, None, :]
        x1, x2 = x[..., :HEAD_DIM // 2], x[..., HEAD_DIM // 2:]
        x.copy_(torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1))
    record_or_run(run)


def attention_core(q, k, v, scale, total_seq_len):
    """matmul, causal_softmax_, matmul over the narrowed static cache: q [b, h, s, d], k/v [b, h, total, d]."""
    b, h, s, d = q.shape
    out = torch.empty(b, s, h * d, device=q.device)
    mask = torch.arange(total_seq_len, device=q.device)[None, :] > (torch.arange(s, device=q.device)[:, None]
                                                                    + total_seq_len - s)

    def run():
        scores = (q @ k.transpose(-1, -2)) * scale
        p = torch.softmax(scores.masked_fill(mask, -math.inf), -1)
        out.copy_((p @ v).permute(0, 2, 1, 3).reshape(b, s, h * d))
    record_or_run(run)
    return out


# --- csrc/global_state: the thread-local forward context ------------------------------------------------------

class AttentionMetadata:
    def __init__(self, past_sequence_lengths, total_sequence_lengths):
        self.past_sequence_lengths, self.total_sequence_lengths = past_sequence_lengths, total_sequence_lengths


class ForwardContext:
    attn_metadata: AttentionMetadata | None = None


forward_context = ForwardContext()


def host_read_int32(tensor):
    """``reinterpret_cast<int32_t *>(t->to(cpu)->data())[0]`` as size_t (the tensors may be I64)."""
    value = int(tensor.view(I32)[0])
    return value if value >= 0 else value + (1 << 64)


# --- csrc/models: MiniCPM eagle draft model on a static KV cache ----------------------------------------------

class Input:
    """InfinilmModel::Input (the subset the static path uses)."""

    def __init__(self, input_ids=None, position_ids=None, past_sequence_lengths=None, total_sequence_lengths=None,
                 target_hidden_states=None, sample_all_positions=False):
        self.input_ids, self.position_ids = input_ids, position_ids
        self.past_sequence_lengths, self.total_sequence_lengths = past_sequence_lengths, total_sequence_lengths
        self.target_hidden_states, self.sample_all_positions = target_hidden_states, sample_all_positions


class Output:
    def __init__(self, logits, hidden_states):
        self.logits, self.hidden_states = logits, hidden_states


class StaticAttentionImpl:
    def __init__(self, kv_cache):
        self.kv_cache = kv_cache                 # [2, max_batch_size, n_kv_head, max_cache_len, head_dim]
        self.scale = 1.0 / math.sqrt(HEAD_DIM)

    def do_kv_cache_update(self, key, value, past_sequence_lengths):
        update_len = key.shape[2]
        k_cache_layer, v_cache_layer = self.kv_cache[0], self.kv_cache[1]
        assert key.shape[0] == k_cache_layer.shape[0]            # ASSERT_EQ(batch_size, max_batch_size)
        max_seq_len = k_cache_layer.shape[2]
        cache_pos = host_read_int32(past_sequence_lengths)
        result_len = cache_pos + update_len
        if not result_len <= max_seq_len:                         # ASSERT(result_len <= max_seq_len)
            raise RuntimeError("Assertion failed")
        copy_(k_cache_layer[:, :, cache_pos:cache_pos + update_len], key)
        copy_(v_cache_layer[:, :, cache_pos:cache_pos + update_len], value)
        return k_cache_layer, v_cache_layer

    def forward(self, q_rope, k_reshaped, v_reshaped, attn_metadata):
        q, k, v = (t.permute(0, 2, 1, 3) for t in (q_rope, k_reshaped, v_reshaped))   # [bs, head, seq, dim]
        k_total, v_total = self.do_kv_cache_update(k, v, attn_metadata.past_sequence_lengths)
        total_seq_len = host_read_int32(attn_metadata.total_sequence_lengths)
        k_total, v_total = k_total[:, :, :total_seq_len], v_total[:, :, :total_seq_len]
        return attention_core(q, k_total, v_total, self.scale, total_seq_len)


class MiniCPM4DecoderLayer:
    def __init__(self, gen, device, kv_cache):
        self.input_layernorm = 1 + randn(HIDDEN, gen=gen, device=device, scale=0.1)
        self.post_attention_layernorm = 1 + randn(HIDDEN, gen=gen, device=device, scale=0.1)
        self.wq, self.wk, self.wv, self.wo = (randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.4)
                                              for _ in range(4))
        self.w_up = randn(HIDDEN, 2 * HIDDEN, gen=gen, device=device, scale=0.4)
        self.w_down = randn(2 * HIDDEN, HIDDEN, gen=gen, device=device, scale=0.3)
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=F32) / HEAD_DIM))
        angles = torch.arange(MAX_POS, dtype=F32)[:, None] * inv_freq[None, :]
        self.sin_cache, self.cos_cache = angles.sin().to(device), angles.cos().to(device)
        self.attn_ = StaticAttentionImpl(kv_cache)

    def self_attn(self, position_ids, hidden_states):
        """Attention::forward_static_."""
        b, s, _ = hidden_states.shape
        q = linear(hidden_states, self.wq).view(b, s, 1, HEAD_DIM)
        k = linear(hidden_states, self.wk).view(b, s, 1, HEAD_DIM)
        v = linear(hidden_states, self.wv).view(b, s, 1, HEAD_DIM)
        pos_ids_for_rope = position_ids[0].contiguous().view(s)            # narrow row 0 -> [seq_len]
        rope_(q, pos_ids_for_rope, self.sin_cache, self.cos_cache)
        rope_(k, pos_ids_for_rope, self.sin_cache, self.cos_cache)
        attn_output = self.attn_.forward(q, k, v, forward_context.attn_metadata)
        return linear(attn_output, self.wo)

    def forward(self, positions, hidden_states):
        residual = hidden_states
        hidden_states = self.self_attn(positions, rms_norm(hidden_states, self.input_layernorm))
        hidden_states = add(residual, hidden_states)
        residual = hidden_states
        hidden_states = linear(silu(linear(rms_norm(hidden_states, self.post_attention_layernorm), self.w_up)),
                               self.w_down)
        return add(residual, hidden_states)


class MiniCPMEagleForCausalLM:
    def __init__(self, device):
        gen = generator(545)
        self.device = device
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.input_norm1 = 1 + randn(HIDDEN, gen=gen, device=device, scale=0.1)
        self.input_norm2 = 1 + randn(HIDDEN, gen=gen, device=device, scale=0.1)
        self.fc = randn(2 * HIDDEN, HIDDEN, gen=gen, device=device, scale=0.4)
        # StaticKVCache::create_layer_kv_cache: empty + set_zeros
        self.kv_cache = torch.zeros(2, MAX_BATCH_SIZE, 1, MAX_CACHE_LEN, HEAD_DIM, device=device)
        self.eagle_layers = [MiniCPM4DecoderLayer(gen, device, self.kv_cache)]
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.5)

    def forward_with_hidden(self, input_ids, position_ids, target_hidden_states):
        input_embeds = rms_norm(embedding(input_ids, self.embed_tokens), self.input_norm1)
        target_hidden = rms_norm(target_hidden_states, self.input_norm2)
        fused_input = torch.empty(*input_embeds.shape[:-1], 2 * HIDDEN, device=self.device)
        copy_(fused_input[..., :HIDDEN], input_embeds)
        copy_(fused_input[..., HIDDEN:], target_hidden)
        hidden_states = linear(fused_input, self.fc)
        for layer in self.eagle_layers:
            hidden_states = layer.forward(position_ids, hidden_states)
        return hidden_states

    def forward(self, input):
        if input.target_hidden_states is not None:
            hidden_states = self.forward_with_hidden(input.input_ids, input.position_ids, input.target_hidden_states)
        else:                                    # MiniCPMEagleModel::forward: zero target hidden states
            b, s = input.input_ids.shape
            zero_hidden_states = torch.zeros(b, s, HIDDEN, device=self.device)
            hidden_states = self.forward_with_hidden(input.input_ids, input.position_ids, zero_hidden_states)
        return Output(linear(hidden_states, self.lm_head), hidden_states)


# --- csrc/engine/compiler/static_batching_compiler.cpp -----------------------------------------------------------

class CompiledResult:
    def __init__(self, input, compiled):
        self.input, self.compiled = input, compiled


class StaticBatchingCompiler:
    def __init__(self, model, variant):
        self.model_, self.variant = model, variant
        self.compiled_map_ = {}

    def compile(self):
        b = MAX_BATCH_SIZE                        # StaticKVCacheConfig::max_batch_size()
        input = Input()
        input.input_ids = context.empty((b, 1), I64)
        input.position_ids = context.empty((b, 1), I64)
        input.past_sequence_lengths = context.empty((b,), I64)
        input.total_sequence_lengths = context.empty((b,), I64)
        if self.variant == "fix":
            set_zeros(input.input_ids)
            set_zeros(input.position_ids)
            set_zeros(input.past_sequence_lengths)
        input.total_sequence_lengths.copy_(torch.ones(b, dtype=I64))      # memcpyH2D of ones

        # Attention reads attn_metadata from thread-local forward context.
        forward_context.attn_metadata = AttentionMetadata(input.past_sequence_lengths, input.total_sequence_lengths)

        events.static_buffers("StaticBatchingCompiler", {
            "input_ids": input.input_ids, "position_ids": input.position_ids,
            "past_sequence_lengths": input.past_sequence_lengths,
            "total_sequence_lengths": input.total_sequence_lengths})
        events.persistent_state("StaticBatchingCompiler", {"kv_cache": self.model_.kv_cache})
        with events.warmup():
            self.model_.forward(input)            # (void)model_->forward(input); syncStream()

        context.startGraphRecording()
        output = self.model_.forward(input)
        graph = context.stopGraphRecording()
        self.compiled_map_[(b, 1)] = CompiledResult(input, (graph, output.logits))

    def get_compiled(self, input):
        result = self.compiled_map_.get(tuple(input.input_ids.shape))
        if result is None:
            return None, None
        graph_input = result.input
        graph_input.input_ids.copy_(input.input_ids)
        graph_input.position_ids.copy_(input.position_ids)
        graph_input.past_sequence_lengths.copy_(input.past_sequence_lengths)
        graph_input.total_sequence_lengths.copy_(input.total_sequence_lengths)
        return result.compiled


# --- csrc/engine/rank_worker.cpp, infer_engine.cpp -------------------------------------------------------------

class RankWorker:
    def __init__(self, device, variant, enable_graph_compiling):
        self.device = device
        self.model_ = MiniCPMEagleForCausalLM(device)
        self.compiler_ = StaticBatchingCompiler(self.model_, variant) if enable_graph_compiling else None
        self.should_exit_ = False

    def compile(self):                            # Command::COMPILE
        try:
            if self.compiler_ is not None:
                self.compiler_.compile()
        except Exception:                         # spdlog::error("exception during compile: ..."); break
            self.should_exit_ = True

    def wait(self):
        if self.should_exit_:
            raise RuntimeError("RankWorker stopped during run")

    def run(self, args):                          # Command::RUN
        logits = hidden_states = None
        # All-position speculative/MTP runs need eager mode because hidden states are not part of compiled
        # graph outputs.
        if not args.sample_all_positions and self.compiler_ is not None:
            graph, output = self.compiler_.get_compiled(args)
            if graph is not None and output is not None:
                logits = replay(graph.device_graph, output)
        if logits is None:                        # fall back to eager mode
            forward_context.attn_metadata = AttentionMetadata(args.past_sequence_lengths,
                                                              args.total_sequence_lengths)
            output = self.model_.forward(args)
            logits, hidden_states = output.logits, output.hidden_states
        output_ids = logits.reshape(-1, VOCAB).argmax(-1)                 # random_sample_, top_k = 1
        return output_ids, logits, hidden_states


class InferEngine:
    def __init__(self, device, variant, enable_graph_compiling):
        self.worker = RankWorker(device, variant, enable_graph_compiling)

    def process_weights_after_loading(self):      # after load_model_state_dict_by_file
        self.compile()

    def compile(self):
        self.worker.compile()
        self.worker.wait()

    def forward_raw(self, **kw):
        output_ids, logits, hidden_states = self.worker.run(Input(sample_all_positions=True, **kw))
        return {"output_ids": output_ids, "logits": logits, "hidden_states": hidden_states}


# --- python/infinilm/llm/model_runner/speculative_runner.py ----------------------------------------------------

class SpeculativeRunner:
    def __init__(self, device, variant, enable_graph):
        self.device = device
        self.draft_model_engine = InferEngine(device, variant, enable_graph_compiling=enable_graph)
        self.draft_model_engine.process_weights_after_loading()

    def _draft_eagle_tokens_batch(self, jobs):
        current_tokens = [job["source_token"] for job in jobs]
        current_hiddens = [job["target_hidden"] for job in jobs]
        draft_batch = MAX_BATCH_SIZE
        logits_per_step = []
        for step in range(NUM_DRAFT_TOKENS):
            dev = self.device
            out = self.draft_model_engine.forward_raw(
                input_ids=torch.tensor([[t] for t in current_tokens], dtype=I64, device=dev),
                position_ids=torch.tensor([[job["source_position"] + step] for job in jobs], dtype=I64, device=dev),
                past_sequence_lengths=torch.tensor([step] * draft_batch, dtype=I32, device=dev),
                total_sequence_lengths=torch.tensor([step + 1] * draft_batch, dtype=I32, device=dev),
                target_hidden_states=torch.cat(current_hiddens, 0))
            logits_per_step.append(out["logits"].clone())
            current_tokens = [int(t) for t in out["output_ids"].tolist()]
            current_hiddens = [out["hidden_states"][i:i + 1].clone() for i in range(len(jobs))]
        return logits_per_step


# --- the workload ----------------------------------------------------------------------------------------------

def run(variant: str, device: str = "cpu"):
    def serve(enable_graph: bool):
        global context
        context = Context(device)
        gen = generator(5450)
        # Before the draft engine is built, the target engine ran; its fp32 activations went back to the pool.
        context.pool.release(randn(2, 1, HIDDEN, gen=gen, device=device))
        runner = SpeculativeRunner(device, variant, enable_graph)
        target_hidden = randn(2, 1, 1, HIDDEN, gen=gen, device=device)
        jobs = [{"source_token": 3, "source_position": 5, "target_hidden": target_hidden[0]},
                {"source_token": 11, "source_position": 2, "target_hidden": target_hidden[1]}]
        return runner._draft_eagle_tokens_batch(jobs)

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
