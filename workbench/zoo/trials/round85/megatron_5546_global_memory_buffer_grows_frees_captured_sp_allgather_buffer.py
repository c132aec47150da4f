"""Megatron dynamic inference with sequence parallelism: an eager step larger than every captured graph grows the grow-only ``GlobalMemoryBuffer`` "mpu" all-gather buffer, freeing the block the decode CUDA graphs all-gather into.

Upstream: https://github.com/NVIDIA/Megatron-LM/pull/5546 ("Pre-size the all-gather buffer for inference to max
capacity", Keshav Santhanam, merged to main as commit 959f3f17afd4 on 2026-07-06). Read: the whole diff (the block
added to ``DynamicInferenceEngine.create_cuda_graphs`` in ``megatron/core/inference/engines/dynamic_engine.py``, with
its comment, and the regression test ``test_global_memory_buffer_stable_after_presizing`` in
``tests/unit_tests/test_utils.py``), and, at the parent commit, ``GlobalMemoryBuffer.get_tensor``
(``megatron/core/utils.py``), ``LinearWithGradAccumulationAndAsyncCommunication.forward``
(``megatron/core/tensor_parallel/layers.py``), ``_reduce_scatter_along_first_dim``
(``megatron/core/tensor_parallel/mappings.py``) and ``get_cuda_graph_token_counts`` ordering (descending) in
``megatron/core/inference/batch_dimensions_utils.py``. No PR description or issue text exists beyond the commit
message; the failure mode is the one the added comment and test describe.
Symptom: dynamic inference with ``--sequence-parallel`` and local CUDA graphs. After a step larger than the largest
captured graph runs eagerly (a long prefill), decode graph replays all-gather into memory the caching allocator has
already handed to other tensors: silent corruption on CUDA ("corrupting whatever later reuses that freed block").
Mechanism: with sequence parallelism every ``ColumnParallelLinear`` forward goes through
``LinearWithGradAccumulationAndAsyncCommunication.forward``, which all-gathers its sequence-sharded input into
``get_global_memory_buffer().get_tensor(dim_size, input.dtype, "mpu")``. ``get_tensor`` is grow-only: it returns a
view of the cached tensor, and when a request is larger than the cached one it replaces the dict entry with a new
``torch.empty``, dropping the old tensor. ``create_cuda_graphs`` captures decode graphs largest first; each
graph's first (eager) warmup sizes the "mpu" buffer to the largest graph, and every captured all-gather and GEMM
reads/writes that block by address. The block is owned by the ``GlobalMemoryBuffer`` dict, not by the graphs. A
later eager step with more tokens than any graph (a prefill that falls back to eager) calls ``get_tensor`` with a
larger shape: the dict entry is replaced, the captured block is freed, and the next decode replay writes and reads
freed memory.
Doctor: dangling-reference, at get_tensor. The graphs reference the "mpu" block by address while its only owner is
the dict entry that ``get_tensor`` overwrites when an eager step asks for more; the replay after that reads memory
whose owner has released it.
Fix (upstream): in ``create_cuda_graphs``, before any capture and only when ``sequence_parallel`` is on, call
``get_global_memory_buffer().get_tensor((context.max_tokens * hidden_size,), params_dtype, "mpu")`` so the buffer
already has its worst-case size and no later request can reallocate it.
Modelled: ``GlobalMemoryBuffer.get_tensor`` (upstream code, device passed in), the SP column-parallel forward, a
row-parallel linear whose reduce-scatter output is a fresh ``torch.empty`` (``use_global_buffer=False``), an
attention-free GPT stand-in (embedding, 2 MLP decoder layers with pre-LayerNorm, vocab-parallel output layer; every
``ColumnParallelLinear`` all-gathers into "mpu"), block-scope graphs keyed by padded token count (token ids are the
only graph input; padded ids are zeroed each step) in one shared pool, captured in the descending order upstream
uses with one eager warmup each. TP = 2 on one process: this is TP rank 0, and the collectives are stand-ins in
which the peer rank holds an identical token shard (all-gather writes the local shard twice, reduce-scatter sums
two equal partials); which memory they write is the point, not the peer's data. Hidden 8, FFN 16, vocab 32
(float64), context ``max_tokens`` 16, decode graphs for 8 and 4 tokens (4 and 2 local rows).
Workload: graphs are captured for 8 then 4 tokens, so "mpu" is 8 x 8 elements. Step 1 is a 12-token prefill (6
local rows), larger than both graphs, so it runs eagerly and grows "mpu" to 12 x 8, freeing the captured block.
Step 2 decodes 4 tokens (graph 4): its replay all-gathers into the freed block (the emulation raises
IllegalMemoryAccess). Step 3 decodes 6 tokens padded to graph 8. With the fix "mpu" holds 16 x 8 from the start
and every step equals eager.
"""
from __future__ import annotations

import operator
from functools import reduce

import torch
import torch.nn.functional as F

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/Megatron-LM/pull/5546"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "get_tensor"
SYMPTOM = ("dynamic inference with sequence parallelism and CUDA graphs: an eager prefill larger than every captured "
           "graph grows the grow-only GlobalMemoryBuffer 'mpu' all-gather buffer, freeing the block the decode graphs "
           "all-gather into; later replays write and read freed memory (silent corruption on CUDA)")

HIDDEN, FFN, VOCAB = 8, 16, 32
NUM_LAYERS = 2
TP_SIZE = 2
MAX_TOKENS = 16                          # context.max_tokens (global tokens)
CUDA_GRAPH_TOKEN_COUNTS = [8, 4]         # decode graphs, sorted descending as upstream

_variant = "bug"


# --- megatron/core/utils.py -----------------------------------------------------------------------------------

class GlobalMemoryBuffer:
    """Global buffer to avoid dynamic memory allocations. Caller should ensure that buffers of the same name are
    not used concurrently."""

    def __init__(self, device):
        self.buffer = {}
        self.device = device

    def get_tensor(self, tensor_shape, dtype, name):
        """Returns (potentially) a sub-tensor from the self.buffer for the given shape (grow-only)."""
        required_len = reduce(operator.mul, tensor_shape, 1)
        if self.buffer.get((name, dtype), None) is None or self.buffer[(name, dtype)].numel() < required_len:
            self.buffer[(name, dtype)] = torch.empty(required_len, dtype=dtype, device=self.device)
        return self.buffer[(name, dtype)][0:required_len].view(*tensor_shape)


# --- megatron/core/parallel_state.py (the pieces used) --------------------------------------------------------

_GLOBAL_MEMORY_BUFFER = None


def _set_global_memory_buffer(device):
    global _GLOBAL_MEMORY_BUFFER
    _GLOBAL_MEMORY_BUFFER = GlobalMemoryBuffer(device)


def get_global_memory_buffer():
    return _GLOBAL_MEMORY_BUFFER


class _TensorParallelGroup:
    """TP group of this rank (rank 0 of 2). Stand-in collectives: the peer holds an identical token shard."""

    def size(self):
        return TP_SIZE

    def rank(self):
        return 0


def dist_all_gather_func(output, input_, group):
    n = input_.shape[0]
    for r in range(group.size()):
        output[r * n:(r + 1) * n].copy_(input_)


def dist_reduce_scatter_func(output, input_, group):
    n, r = output.shape[0], group.rank()
    torch.mul(input_[r * n:(r + 1) * n], group.size(), out=output)


# --- megatron/core/tensor_parallel -----------------------------------------------------------------------------

def _reduce_scatter_along_first_dim(input_, group, use_global_buffer=False):
    dim_size = list(input_.size())
    dim_size[0] = dim_size[0] // group.size()
    if use_global_buffer:
        output = get_global_memory_buffer().get_tensor(dim_size, input_.dtype, "mpu")
    else:
        output = torch.empty(dim_size, dtype=input_.dtype, device=input_.device)
    dist_reduce_scatter_func(output, input_.contiguous(), group=group)
    return output


class LinearWithGradAccumulationAndAsyncCommunication:
    @staticmethod
    def forward(input, weight, bias, sequence_parallel, tp_group):
        if sequence_parallel:
            dim_size = list(input.size())
            dim_size[0] = dim_size[0] * tp_group.size()
            all_gather_buffer = get_global_memory_buffer().get_tensor(dim_size, input.dtype, "mpu")
            dist_all_gather_func(all_gather_buffer, input, group=tp_group)
            total_input = all_gather_buffer
        else:
            total_input = input
        output = torch.matmul(total_input, weight.t())
        if bias is not None:
            output = output + bias
        return output


class ColumnParallelLinear:
    def __init__(self, weight, bias, tp_group):
        self.weight, self.bias, self.tp_group = weight, bias, tp_group
        self.sequence_parallel = True

    def __call__(self, input_):
        return LinearWithGradAccumulationAndAsyncCommunication.forward(
            input_, self.weight, self.bias, self.sequence_parallel, self.tp_group)


class RowParallelLinear:
    def __init__(self, weight, bias, tp_group):
        self.weight, self.bias, self.tp_group = weight, bias, tp_group

    def __call__(self, input_):
        output_parallel = torch.matmul(input_, self.weight.t())
        output = _reduce_scatter_along_first_dim(output_parallel, self.tp_group)      # to the SP region
        return output + self.bias


# --- the model (attention-free GPT stand-in) -------------------------------------------------------------------

class TransformerLayer:
    def __init__(self, w, tp_group):
        self.w = w
        self.linear_fc1 = ColumnParallelLinear(w["fc1"], w["fc1_b"], tp_group)
        self.linear_fc2 = RowParallelLinear(w["fc2"], w["fc2_b"], tp_group)

    def __call__(self, hidden_states):                       # [s/tp, h], this rank's sequence shard
        x = F.layer_norm(hidden_states, (HIDDEN,), self.w["ln_w"], self.w["ln_b"])
        h = F.gelu(self.linear_fc1(x))                       # all-gather into "mpu": [s, ffn/tp]
        return hidden_states + self.linear_fc2(h)            # reduce-scatter back: [s/tp, h]


class GPTModel:
    def __init__(self, device):
        gen = generator(5546)
        r = lambda *s, scale=0.4: randn(*s, gen=gen, device=device, scale=scale).double()  # noqa: E731
        self.tp_group = _TensorParallelGroup()
        self.embedding = r(VOCAB, HIDDEN, scale=1.0)
        self.layers = [TransformerLayer({"ln_w": 1 + r(HIDDEN, scale=0.1), "ln_b": r(HIDDEN, scale=0.1),
                                         "fc1": r(FFN // TP_SIZE, HIDDEN), "fc1_b": r(FFN // TP_SIZE, scale=0.1),
                                         "fc2": r(HIDDEN, FFN // TP_SIZE), "fc2_b": r(HIDDEN, scale=0.1)},
                                        self.tp_group) for _ in range(NUM_LAYERS)]
        self.final_ln_w = 1 + r(HIDDEN, scale=0.1)
        self.output_layer = ColumnParallelLinear(r(VOCAB // TP_SIZE, HIDDEN), None, self.tp_group)

    def forward(self, input_ids):
        """``input_ids``: this rank's token shard [s/tp]. Returns this rank's rows of the vocab-parallel logits."""
        hidden_states = self.embedding[input_ids]
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        hidden_states = F.layer_norm(hidden_states, (HIDDEN,), self.final_ln_w)
        logits = self.output_layer(hidden_states)           # [s, vocab/tp]
        return logits[:input_ids.shape[0]]


# --- megatron/core/transformer/cuda_graphs.py + inference engine (the pieces used) -----------------------------

class _CudaGraphRunner:
    """One block-scope graph per padded local token count."""

    def __init__(self, model, num_local_tokens, device, pool):
        self.model, self.num_local_tokens = model, num_local_tokens
        self.input_ids = torch.zeros(num_local_tokens, dtype=torch.int64, device=device)
        self.fwd_graph, self.fwd_graph_outputs = capture(
            lambda: self.model.forward(self.input_ids), device=device, pool=pool, warmups=1,
            name=f"decode graph [{num_local_tokens * TP_SIZE} tokens]", owner="CudaGraphManager (block scope)",
            static={"input_ids": self.input_ids})

    def replay_graph_capture(self, input_ids):
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids)
        self.input_ids[n:].zero_()                           # padded tokens: id 0
        return replay(self.fwd_graph, self.fwd_graph_outputs, real=n, size=self.num_local_tokens)[:n]


class DynamicInferenceEngine:
    def __init__(self, model, device, use_cuda_graphs):
        self.model, self.device = model, device
        self.sequence_parallel = True
        self.max_tokens = MAX_TOKENS
        self.inference_cudagraphs_lookup_table = {}
        if use_cuda_graphs:
            self.create_cuda_graphs()

    def create_cuda_graphs(self):
        if _variant == "fix" and self.sequence_parallel:         # PR #5546: pre-size "mpu" before any capture
            max_ag_numel = self.max_tokens * HIDDEN
            get_global_memory_buffer().get_tensor((max_ag_numel,), torch.float64, "mpu")
        pool = graph_pool_handle(self.device)
        for token_count in CUDA_GRAPH_TOKEN_COUNTS:              # descending, as upstream
            local = token_count // TP_SIZE
            self.inference_cudagraphs_lookup_table[local] = _CudaGraphRunner(self.model, local, self.device, pool)

    def step(self, input_ids):
        """One forward step of this rank's token shard; graphs serve steps that fit, larger ones run eagerly."""
        n = input_ids.shape[0]
        fitting = [t for t in self.inference_cudagraphs_lookup_table if t >= n]
        if fitting:
            return self.inference_cudagraphs_lookup_table[min(fitting)].replay_graph_capture(input_ids).clone()
        return self.model.forward(input_ids).clone()


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(55460)
    # this rank's shards: 12-token prefill (eager), then decode steps of 4 and 6 tokens (graphs 4 and 8)
    steps = [torch.randint(0, VOCAB, (n // TP_SIZE,), generator=gen).to(device) for n in (12, 4, 6)]

    def serve(use_cuda_graphs):
        _set_global_memory_buffer(device)
        engine = DynamicInferenceEngine(GPTModel(device), device, use_cuda_graphs)
        return [engine.step(ids) for ids in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
