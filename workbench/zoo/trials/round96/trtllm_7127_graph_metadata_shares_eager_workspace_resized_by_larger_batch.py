"""TensorRT-LLM PyTorch backend: the CUDA-graph attention metadata is a shallow copy of the eager one and shares its
``workspace``, which the attention op grows in place once an eager step has more generation requests than any captured
graph: the graphs keep the address of the released block.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/7127 ("[https://nvbugs/5448426][fix] Fix illegal memory access in
cuda graph", NVIDIA/TensorRT-LLM, merged; description dated 2025-08-21, it points at ``release/1.0``'s
``cpp/tensorrt_llm/thop/attentionOp.cpp``). Read: the PR description ("The workspace gets resized, as the number of
requests grows. This may eventually relocate the buffer and the CUDA Graph now has an invalid access. Setting it to None
would create a torch::empty Tensor instead of using the workspace pointer") and its review summary ("corrected workspace
handling in the TensorRT-LLM attention backend when planning executions"); a stored ``attention_backend/trtllm.py`` of
that period (``TrtllmAttentionWrapper.plan``/``run`` passing ``self.workspace`` to ``attention_inplace``,
``TrtllmAttentionMetadata.__post_init__`` making ``workspace = torch.empty((0,))`` when none is given, ``prepare``,
``TrtllmAttention.forward`` calling ``self.wrapper.plan(..., workspace=metadata.workspace, ...)``), the stored
``AttentionMetadata.create_cuda_graph_metadata`` (``copy.copy(self)``, ``is_cuda_graph = True``, ``__post_init__()``)
and the ``release/1.0``-era ``CUDAGraphRunner`` (``maybe_get_cuda_graph``, ``capture`` with ``WARMUP_STEPS = 2`` into
one memory pool, ``replay`` copying ``input_ids``/``position_ids`` into ``shared_static_tensors``). Not read: the diff
and the C++ op's source; the op's resize (``if (workspace.numel() < workspace_size) workspace.resize_(...)`` else
``torch::empty``) is reconstructed from the description, and the fix line is reconstructed as passing ``None`` for a
CUDA-graph metadata (whether eager calls kept the shared workspace is not stored; the outputs are the same either way).
Symptom: with CUDA graphs on, serving crashes with ``CUDA error: an illegal memory access was encountered`` once the
load grows (more concurrent requests than the captured batch sizes); eager mode is fine.
Mechanism: ``create_cuda_graph_metadata`` copies the eager metadata shallowly, so every generation graph's metadata holds
the same ``workspace`` tensor. Warmup captures the graphs, whose attention kernels bake in that tensor's address as it
is then (sized for the largest captured batch). A later eager step with more generation requests (its batch is larger
than any graph) needs more scratch: the op grows the tensor in place, which moves its memory to a new block and returns
the old block to the caching allocator. The next replay of a captured graph writes and reads its attention scores
through the old address: memory it no longer owns.
Doctor: dangling-reference, at forward. ``TrtllmAttention.forward`` hands the CUDA-graph metadata's (shared, resizable)
workspace to the op, so the captured kernels reference a block whose owner later releases it.
Fix (upstream): plan the attention of a CUDA-graph metadata with ``workspace=None``: the op then allocates its scratch
with ``torch::empty`` inside the capture, from the graph's own pool, and no eager resize can move it.
Modelled: ``TrtllmAttentionMetadata`` (``__post_init__``, ``prepare``, the runtime slices), ``AttentionMetadata
.create_cuda_graph_metadata`` (shallow copy), ``TrtllmAttentionWrapper`` (``plan``/``run``), ``TrtllmAttention.forward``,
``CUDAGraphRunner`` (``maybe_get_cuda_graph``, ``needs_capture``, ``capture``, ``replay``), ``PyTorchModelEngine``
(``warmup`` over the graph batch sizes with dummy generation requests, ``forward``, ``_prepare_tp_inputs``). Stand-ins:
``attention_inplace`` is small torch code (append K/V to a per-sequence cache block, causal softmax attention; generation
tokens stage their scores in the workspace, ``num_generations * max_attention_window`` elements, float64 instead of
bytes); its in-place growth uses ``set_`` to a fresh storage (on the CPU ``resize_`` would keep the storage object); the
model is one attention layer (hidden 8, vocab 12, float64) with teacher-forced tokens.
Workload: graphs for batch sizes 1 and 2 (max batch size 3, max sequence length 10). Requests A and B prefill (eager)
and decode two steps (graph bs 2); C prefills alongside A and B's generation (mixed, eager); A, B and C decode one
step (bs 3: eager, the workspace grows from 20 to 30 elements); A and B decode (graph bs 2), then A alone (graph bs 1).
The bug raises IllegalMemoryAccess at the bs-2 replay after the growth; the fix equals eager on every step's logits.
"""
from __future__ import annotations

import copy
import dataclasses

import torch

from workbench.engine import graph_pool_handle, host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/7127"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "forward"
SYMPTOM = ("CUDA-graph replays use the attention workspace the eager metadata shares with them; an eager step with "
           "more requests grows (moves) it, and the next replay hits the released block: illegal memory access")

VOCAB, HIDDEN = 12, 8
MAX_BATCH_SIZE, MAX_SEQ_LEN = 3, 10              # max_seq_len = max_attention_window = tokens_per_block here
CUDA_GRAPH_BATCH_SIZES = [1, 2]
DUMMY_SLOT = MAX_BATCH_SIZE                      # KV block of the CUDA-graph warmup dummy requests
PROMPTS = {"A": [3, 7, 1], "B": [5, 2], "C": [9, 4]}
GEN_TOKENS = {"A": [4, 9, 2, 6, 10, 8], "B": [1, 11, 3, 7, 5], "C": [6, 0]}    # teacher-forced decode inputs
# (context requests, generation requests) per iteration of the executor loop
SCHEDULE = [(["A", "B"], []), ([], ["A", "B"]), ([], ["A", "B"]), (["C"], ["A", "B"]), ([], ["A", "B", "C"]),
            ([], ["A", "B"]), ([], ["A"])]


@dataclasses.dataclass
class KVCacheParams:
    num_cached_tokens_per_seq: list


@dataclasses.dataclass(kw_only=True)
class TrtllmAttentionMetadata:
    max_num_requests: int
    device: str
    workspace: torch.Tensor | None = None
    is_cuda_graph: bool = False
    # filled per step by PyTorchModelEngine._prepare_tp_inputs
    seq_lens: list = dataclasses.field(default_factory=list)
    num_contexts: int = 0
    prompt_lens: list = dataclasses.field(default_factory=list)
    block_ids: list = dataclasses.field(default_factory=list)
    kv_cache_params: KVCacheParams | None = None

    def __post_init__(self):
        n, dev = self.max_num_requests, self.device
        self.prompt_lens_cpu = host(torch.zeros(n, dtype=torch.long), dev)          # pinned host memory
        self.prompt_lens_cuda = torch.zeros(n, dtype=torch.long, device=dev)
        self.kv_lens = host(torch.zeros(n, dtype=torch.long), dev)
        self.kv_lens_cuda = torch.zeros(n, dtype=torch.long, device=dev)
        self.host_request_types = host(torch.zeros(n, dtype=torch.long), dev)
        self.host_kv_cache_block_offsets = host(torch.zeros(n, dtype=torch.long), dev)
        self.kv_cache_block_offsets = torch.zeros(n, dtype=torch.long, device=dev)
        if self.workspace is None:                       # "For debugging, can use it to call the wrapper's plan"
            self.workspace = torch.empty(0, dtype=torch.float64, device=dev)

    @property
    def num_seqs(self):
        return len(self.seq_lens)

    def create_cuda_graph_metadata(self, max_batch_size: int):
        """``AttentionMetadata.create_cuda_graph_metadata``: a shallow copy (the ``workspace`` tensor stays shared),
        then ``__post_init__`` gives it its own per-sequence buffers (it keeps the workspace it already has)."""
        if self.is_cuda_graph:
            return self
        cuda_graph_metadata = copy.copy(self)
        cuda_graph_metadata.is_cuda_graph = True
        cuda_graph_metadata.max_num_requests = max_batch_size
        cuda_graph_metadata.__post_init__()
        return cuda_graph_metadata

    def prepare(self):
        n = self.num_seqs
        self.prompt_lens_cpu[:n].copy_(torch.tensor(self.prompt_lens))
        self.prompt_lens_cuda[:n].copy_(self.prompt_lens_cpu[:n])
        kv_lens = [c + s for c, s in zip(self.kv_cache_params.num_cached_tokens_per_seq, self.seq_lens)]
        self.kv_lens[:n].copy_(torch.tensor(kv_lens))
        self.kv_lens_cuda[:n].copy_(self.kv_lens[:n])
        self.host_request_types[:self.num_contexts].fill_(0)
        self.host_request_types[self.num_contexts:n].fill_(1)
        self.host_kv_cache_block_offsets[:n].copy_(torch.tensor(self.block_ids))
        self.kv_cache_block_offsets[:n].copy_(self.host_kv_cache_block_offsets[:n])
        self.kv_lens_cuda_runtime = self.kv_lens_cuda[:n]
        self.kv_lens_runtime = self.kv_lens[:n]
        self.prompt_lens_cuda_runtime = self.prompt_lens_cuda[:n]
        self.prompt_lens_cpu_runtime = self.prompt_lens_cpu[:n]
        self.host_request_types_runtime = self.host_request_types[:n]


def _resize_(workspace: torch.Tensor, numel: int) -> None:
    """``workspace.resize_({workspace_size})``: the tensor object stays, its memory moves to a new block and the
    old block goes back to the caching allocator (``set_`` makes that move visible on the CPU too)."""
    fresh = torch.empty(numel, dtype=workspace.dtype, device=workspace.device)
    workspace.set_(fresh.untyped_storage(), 0, (numel,))


def attention_inplace(q, k, v, output, workspace, sequence_length, host_past_key_value_lengths, context_lengths,
                      host_context_lengths, host_request_types, kv_cache_block_offsets, kv_cache, num_contexts,
                      max_attention_window):
    """Stand-in for ``torch.ops.trtllm.attention_inplace``: context tokens first, then one token per generation
    request. Appends K/V to each sequence's cache block and attends causally over it; the generation kernel stages
    its scores in the workspace (``num_generations * max_attention_window`` elements)."""
    num_seqs = host_request_types.shape[0]
    num_gen = num_seqs - num_contexts
    workspace_size = num_gen * max_attention_window
    if workspace is not None:
        if workspace.numel() < workspace_size:          # "Attention workspace size is not enough, increase the size"
            _resize_(workspace, workspace_size)
    else:
        workspace = torch.empty(workspace_size, dtype=q.dtype, device=q.device)
    dev = q.device
    slots = kv_cache_block_offsets[num_contexts:num_seqs]             # generation: one token at kv_len - 1
    pos = sequence_length[num_contexts:] - 1
    ctx_lens = host_context_lengths[:num_contexts].tolist()           # host memory (context steps run eagerly)
    num_ctx_tokens = sum(ctx_lens)
    if num_contexts:                                                  # context: the whole prompt, no cached tokens
        ctx_slots = kv_cache_block_offsets[:num_contexts].repeat_interleave(context_lengths[:num_contexts],
                                                                            output_size=num_ctx_tokens)
        ctx_pos = torch.cat([torch.arange(n) for n in ctx_lens]).to(dev)
        slots, pos = torch.cat([ctx_slots, slots]), torch.cat([ctx_pos, pos])
    kv_cache[0, slots, pos] = k
    kv_cache[1, slots, pos] = v
    scores = (q[:, None, :] * kv_cache[0, slots]).sum(-1) * HIDDEN ** -0.5                  # [tokens, window]
    scores = scores.masked_fill(torch.arange(max_attention_window, device=dev)[None, :] > pos[:, None], float("-inf"))
    probs = torch.softmax(scores[:num_ctx_tokens], -1)                                      # fused context FMHA
    if num_gen:
        staged = workspace[:workspace_size].view(num_gen, max_attention_window)             # generation kernel scratch
        staged.copy_(scores[num_ctx_tokens:])
        probs = torch.cat([probs, torch.softmax(staged, -1)])
    output.copy_((probs[..., None] * kv_cache[1, slots]).sum(1))


class TrtllmAttentionWrapper:
    def plan(self, *, workspace=None, sequence_length=..., host_past_key_value_lengths=..., context_lengths=...,
             host_context_lengths=..., host_request_types=..., kv_cache_block_offsets=None, num_contexts=0,
             max_sequence_length=0):
        """Call without arguments to reset the planned states."""
        self.workspace = workspace
        self.sequence_length = sequence_length
        self.host_past_key_value_lengths = host_past_key_value_lengths
        self.context_lengths = context_lengths
        self.host_context_lengths = host_context_lengths
        self.host_request_types = host_request_types
        self.kv_cache_block_offsets = kv_cache_block_offsets
        self.num_contexts = num_contexts
        self.attention_window_size = max_sequence_length

    def run(self, q, k, v, kv_cache):
        output = q.new_empty(q.shape)
        attention_inplace(q, k, v, output, self.workspace, self.sequence_length, self.host_past_key_value_lengths,
                          self.context_lengths, self.host_context_lengths, self.host_request_types,
                          self.kv_cache_block_offsets, kv_cache, self.num_contexts, self.attention_window_size)
        self.plan()                                        # reset the planned states (especially tensors)
        return output


class TrtllmAttention:
    def __init__(self, fixed: bool):
        self.wrapper = TrtllmAttentionWrapper()
        self.fixed = fixed

    def forward(self, q, k, v, metadata: TrtllmAttentionMetadata, kv_cache):
        if self.fixed:
            # PR 7127: a CUDA-graph metadata plans with no workspace: the op's torch::empty comes from the graph's pool.
            workspace = None if metadata.is_cuda_graph else metadata.workspace
        else:
            workspace = metadata.workspace                 # the eager metadata's tensor, shared by the shallow copy
        self.wrapper.plan(workspace=workspace,
                          sequence_length=metadata.kv_lens_cuda_runtime,
                          host_past_key_value_lengths=metadata.kv_lens_runtime,
                          context_lengths=metadata.prompt_lens_cuda_runtime,
                          host_context_lengths=metadata.prompt_lens_cpu_runtime,
                          host_request_types=metadata.host_request_types_runtime,
                          kv_cache_block_offsets=metadata.kv_cache_block_offsets,
                          num_contexts=metadata.num_contexts, max_sequence_length=MAX_SEQ_LEN)
        return self.wrapper.run(q, k, v, kv_cache)


class Model:
    """One decoder layer: embeddings + positions, fused QKV, TRT-LLM attention, o_proj with residual, lm_head."""

    def __init__(self, device, fixed):
        gen = generator(7127)

        def weight(*shape, scale=0.5):
            return randn(*shape, gen=gen, device=device, scale=scale).to(torch.float64)

        self.embed = weight(VOCAB, HIDDEN, scale=1.0)
        self.pos, self.qkv = weight(MAX_SEQ_LEN, HIDDEN), weight(HIDDEN, 3 * HIDDEN)
        self.o_proj, self.lm_head = weight(HIDDEN, HIDDEN), weight(HIDDEN, VOCAB)
        self.attn = TrtllmAttention(fixed)

    def forward(self, input_ids, position_ids, attn_metadata, kv_cache):
        h = self.embed[input_ids] + self.pos[position_ids[0]]
        q, k, v = (h @ self.qkv).split(HIDDEN, -1)
        h = h + self.attn.forward(q, k, v, attn_metadata, kv_cache) @ self.o_proj
        return h @ self.lm_head


class CUDAGraphRunner:
    WARMUP_STEPS = 2

    def __init__(self, device, kv_cache):
        self.device, self.kv_cache = device, kv_cache
        self.supported_batch_sizes = CUDA_GRAPH_BATCH_SIZES
        self.graphs, self.graph_outputs, self.graph_metadata = {}, {}, {}
        self.memory_pool = graph_pool_handle(device)
        self.shared_static_tensors = {
            "input_ids": torch.zeros(max(CUDA_GRAPH_BATCH_SIZES), dtype=torch.long, device=device),
            "position_ids": torch.zeros(1, max(CUDA_GRAPH_BATCH_SIZES), dtype=torch.long, device=device)}

    def maybe_get_cuda_graph(self, batch, attn_metadata):
        if batch.num_contexts:                               # can_run_cuda_graph: generation-only batches
            return False, None
        key = batch.batch_size
        if key in self.graphs:
            return True, self.graph_metadata[key]["attn_metadata"]
        if key not in self.supported_batch_sizes:
            return False, None
        graph_attn_metadata = attn_metadata.create_cuda_graph_metadata(key)
        assert graph_attn_metadata.is_cuda_graph
        return True, graph_attn_metadata

    def needs_capture(self, batch_size):
        return batch_size not in self.graph_outputs

    def capture(self, batch_size, forward_fn, initial_inputs):
        capture_inputs = dict(initial_inputs)
        capture_inputs["input_ids"] = self.shared_static_tensors["input_ids"][:batch_size]
        capture_inputs["position_ids"] = self.shared_static_tensors["position_ids"][:, :batch_size]
        md = initial_inputs["attn_metadata"]
        self.graph_metadata[batch_size] = {"attn_metadata": md}
        static = {"input_ids": self.shared_static_tensors["input_ids"],
                  "position_ids": self.shared_static_tensors["position_ids"],
                  "kv_lens_cuda": md.kv_lens_cuda, "kv_cache_block_offsets": md.kv_cache_block_offsets}
        self.graphs[batch_size], self.graph_outputs[batch_size] = capture(
            lambda: forward_fn(capture_inputs), device=self.device, pool=self.memory_pool,
            warmups=self.WARMUP_STEPS, name=f"batch size {batch_size}", static=static,
            state={"kv_cache": self.kv_cache}, owner="CUDAGraphRunner")

    def replay(self, batch_size, current_inputs):
        assert current_inputs["attn_metadata"] is self.graph_metadata[batch_size]["attn_metadata"]
        n = current_inputs["input_ids"].shape[0]
        self.shared_static_tensors["input_ids"][:n].copy_(current_inputs["input_ids"])
        self.shared_static_tensors["position_ids"][:, :n].copy_(current_inputs["position_ids"])
        return replay(self.graphs[batch_size], self.graph_outputs[batch_size])


@dataclasses.dataclass
class Request:
    name: str
    slot: int
    prompt: list
    num_generated: int = 0                    # decode inputs already fed


@dataclasses.dataclass
class ScheduledRequests:
    context_requests: list
    generation_requests: list

    @property
    def num_contexts(self):
        return len(self.context_requests)

    @property
    def batch_size(self):
        return len(self.context_requests) + len(self.generation_requests)


class PyTorchModelEngine:
    def __init__(self, device, fixed, use_cuda_graph):
        self.device = device
        self.model = Model(device, fixed)
        self.kv_cache = torch.zeros(2, MAX_BATCH_SIZE + 1, MAX_SEQ_LEN, HIDDEN, dtype=torch.float64, device=device)
        self.attn_metadata = TrtllmAttentionMetadata(max_num_requests=MAX_BATCH_SIZE, device=device)
        self.cuda_graph_runner = CUDAGraphRunner(device, self.kv_cache) if use_cuda_graph else None

    def warmup(self):
        """``_run_cuda_graph_warmup``: largest batch first, dummy generation requests on the dummy KV block."""
        if self.cuda_graph_runner is None:
            return
        for bs in sorted(CUDA_GRAPH_BATCH_SIZES, reverse=True):
            dummies = [Request(f"dummy{i}", DUMMY_SLOT, [0], 0) for i in range(bs)]
            self.forward(ScheduledRequests([], dummies), dummy=True)

    def _prepare_tp_inputs(self, batch, attn_metadata, dummy):
        input_ids, positions, seq_lens, cached, prompt_lens, block_ids, gather_ids = [], [], [], [], [], [], []
        for r in batch.context_requests:
            input_ids += r.prompt
            positions += list(range(len(r.prompt)))
            seq_lens.append(len(r.prompt)), cached.append(0), prompt_lens.append(len(r.prompt))
            block_ids.append(r.slot), gather_ids.append(len(input_ids) - 1)
        for r in batch.generation_requests:
            past = len(r.prompt) + r.num_generated
            input_ids.append(0 if dummy else GEN_TOKENS[r.name][r.num_generated])
            positions.append(0 if dummy else past)
            seq_lens.append(1), cached.append(0 if dummy else past), prompt_lens.append(len(r.prompt))
            block_ids.append(r.slot), gather_ids.append(len(input_ids) - 1)
            if not dummy:
                r.num_generated += 1
        attn_metadata.seq_lens, attn_metadata.num_contexts = seq_lens, batch.num_contexts
        attn_metadata.prompt_lens, attn_metadata.block_ids = prompt_lens, block_ids
        attn_metadata.kv_cache_params = KVCacheParams(cached)
        attn_metadata.prepare()
        inputs = {"input_ids": torch.tensor(input_ids, device=self.device),
                  "position_ids": torch.tensor([positions], device=self.device), "attn_metadata": attn_metadata}
        return inputs, torch.tensor(gather_ids, device=self.device)

    def forward(self, batch, dummy=False):
        attn_metadata = self.attn_metadata
        maybe_graph = False
        if self.cuda_graph_runner is not None:
            maybe_graph, maybe_attn_metadata = self.cuda_graph_runner.maybe_get_cuda_graph(batch, attn_metadata)
            if maybe_graph:
                attn_metadata = maybe_attn_metadata
        inputs, gather_ids = self._prepare_tp_inputs(batch, attn_metadata, dummy)

        def forward_fn(inp):
            return self.model.forward(inp["input_ids"], inp["position_ids"], inp["attn_metadata"], self.kv_cache)

        if not maybe_graph:
            return forward_fn(inputs)[gather_ids]
        bs = batch.batch_size
        if self.cuda_graph_runner.needs_capture(bs):
            self.cuda_graph_runner.capture(bs, forward_fn, inputs)
        return self.cuda_graph_runner.replay(bs, inputs)


def run(variant: str, device: str = "cpu"):
    def serve(use_cuda_graph):
        engine = PyTorchModelEngine(device, fixed=(variant == "fix"), use_cuda_graph=use_cuda_graph)
        engine.warmup()
        requests = {name: Request(name, slot, prompt) for slot, (name, prompt) in enumerate(PROMPTS.items())}
        outputs = []
        for ctx, gen in SCHEDULE:                          # PyExecutor's loop: one forward per iteration
            batch = ScheduledRequests([requests[n] for n in ctx], [requests[n] for n in gen])
            outputs.append(engine.forward(batch).clone())
        return outputs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
