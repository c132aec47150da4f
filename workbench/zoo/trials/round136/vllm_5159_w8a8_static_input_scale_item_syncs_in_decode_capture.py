"""vLLM (V0 worker, June 2024) serving a compressed-tensors W8A8 model with static per-tensor scales: each quantized
linear layer (``CompressedTensorsW8A8StaticTensor.apply_weights``) quantizes its input with the int8 quant kernel,
which took the activation scale as a C++ ``float``, so the scheme read it with ``act_scale[0].item()``. Two days earlier
#5137 had moved ``input_scale`` from the CPU to the GPU (so that the CUTLASS GEMM could read its scales on the device),
which turned that read into a device-to-host copy. ``ModelRunner.capture_model`` captures the decode forward for every
batch size with ``CUDAGraphRunner.capture``: the warm-up run reads the scale eagerly, but inside the capture the read
is a host synchronisation a CUDA graph cannot record, and the capture of the first (largest) batch size fails, so the
engine cannot start unless ``enforce_eager`` is set. The fix passes the scale as a device tensor, which the kernel
dereferences; the captured decode graphs then serve the same tokens as eager.

Upstream: https://github.com/vllm-project/vllm/pull/5159 ("[Kernel] Pass a device pointer into the quantize kernel for
the scales", vllm-project/vllm, by Tyler Michael Smith (tlrmchlsmth), opened 2024-05-31, merged 2024-06-03 as commit
cbb2f59cc853731f5607ac0130bb6cdebfdc89c7). Read, in a stored mirror carrying vLLM's history
(ROCmSoftwarePlatform/vllm): the whole diff of cbb2f59cc (``csrc/ops.h``, ``int8_quant_kernels.cu``: the kernel takes
``const scale_type* scale_ptr`` and reads ``*scale_ptr``, the op takes ``torch::Tensor const& scale`` with
``TORCH_CHECK(scale.numel() == 1)``; ``vllm/_custom_ops.py``; ``compressed_tensors_w8a8_statictensor.py``;
``tests/kernels/test_int8_quant.py``). At its parent cbb2f59cc^: ``compressed_tensors_w8a8_statictensor.py`` whole
(``scales_shard_splitter``, ``create_weights``, ``apply_weights``), ``compressed_tensors.py``
(``CompressedTensorsLinearMethod.create_weights`` / ``apply``), ``_custom_ops.static_scaled_int8_quant``,
``layers/linear.py`` (the ``quant_method.apply`` call sites of the linear layers' ``forward``), ``models/llama.py``
(``LlamaMLP``, ``LlamaAttention``, ``LlamaDecoderLayer``), ``worker/model_runner.py`` (``_BATCH_SIZES_TO_CAPTURE``,
the decode padding in ``_prepare_model_input``, ``execute_model``, ``capture_model``, ``CUDAGraphRunner.capture`` /
``forward``, ``_get_graph_batch_size``). Also: the diff of #5137 (260d119e8, 2024-06-01, "Refactor CUTLASS kernels to
always take scales that reside on the GPU") to the same scheme file, which removed ``device="cpu"`` from the scales
and the comment that they had to stay on the CPU for CUDA graphs; #5137's review excerpt and #5159's description as
stored in the search corpus.
Not read: the CUTLASS kernels of #5137 beyond its file list and the excerpt above; the attention backends and the paged
attention kernels of that revision; ``CompressedTensorsConfig.get_scheme`` and the weight loaders; the PR's review;
any user report (none was found). Not established: why the test model could not run with graphs before #5137 as well
(the PR says it needs "this PR plus #5137"; its scales were CPU tensors then, so ``.item()`` did not touch the
device); the exact text users saw (torch's error for ``.item()`` under capture on CUDA, "operation not permitted when
stream is capturing", is from my knowledge, not run here).
Symptom: the PR: "This lets us keep it on the device in order to avoid calling ``item`` on the tensor, which causes a
synchronization between the CPU and GPU and breaks CUDA graphs. With this PR plus
https://github.com/vllm-project/vllm/pull/5137, vllm can run ``nm-testing/tinyllama-one-shot-static-quant-test-
compressed`` with ``enforce_eager=False``". No user report.
Mechanism: the quant kernel's scale is a kernel argument passed by value, so the Python side needs it as a host
number; with the scale parameter on the GPU, ``act_scale[0].item()`` copies it to the host and waits for the stream.
``CUDAGraphRunner.capture`` runs the model once eagerly (allowed) and then inside ``torch.cuda.graph``: the first
quantized linear of the first layer asks for the read, and the capture fails. Eager serving (``enforce_eager``) and
prefill (never captured) are unaffected. Had the read been possible, the frozen number would even have been right
(the scale is static); what breaks is the host wait itself.
Doctor: sync-in-capture, at apply_weights. The failure is a device-to-host read (``.item()``) inside the captured
decode forward; it is written in ``CompressedTensorsW8A8StaticTensor.apply_weights``, the Python function the fix
changes (it passes ``act_scale`` instead of ``act_scale[0].item()``; the rest of the fix is the kernel signature).
Fix (upstream): ``static_scaled_int8_quant(input, scale: torch.Tensor)``; the kernel reads ``*scale_ptr`` on the
device; ``apply_weights`` passes ``act_scale``. Nothing reads device data on the host inside the forward any more.
Modelled: ``static_scaled_int8_quant`` and ``cutlass_scaled_mm_dq`` (``_custom_ops``);
``CompressedTensorsW8A8StaticTensor`` (``scales_shard_splitter``, ``create_weights``, ``apply_weights``: bug / fix as
in the diff); ``CompressedTensorsLinearMethod`` (``create_weights``, ``apply``); ``QKVParallelLinear`` /
``MergedColumnParallelLinear`` / ``RowParallelLinear`` (one ``LinearBase`` returning ``(output, None)``);
``LlamaDecoderLayer`` / ``LlamaForCausalLM`` (``compute_logits``); ``ModelRunner`` (``_prepare_model_input`` with the
decode padding to ``_get_graph_batch_size`` and ``graph_block_tables``, ``execute_model``, ``capture_model`` over the
shared dummy inputs and one memory pool); ``CUDAGraphRunner`` (``capture``: one warm-up run, then the capture;
``forward``: copy into the input buffers, replay, return the output buffer).
Stand-ins: kernels are torch ops: the int8 quant is ``round(x / scale)`` clamped to int8 (round-half-even like
``float_to_int8_rn``), the CUTLASS GEMM an int8 x int8 product in float64 (exact, as the int32 accumulator is) with
``scale_a * (scale_b * acc)``; the paged attention kernel always walks ``MAX_MODEL_LEN`` positions masked by
``seq_lens`` (so its arithmetic does not depend on the block table's width), and a ``_PAD_SLOT_ID`` write lands in a
spare cache row instead of being skipped; prefill attention is plain causal attention over each prompt. A two-layer
Llama (width 16, 2 heads, RoPE, RMSNorm, SiluAndMul) in float64 with random int8 weights, per-shard weight scales and
hand-picked static input scales (weight loading reduced to a ``load`` that uses ``scales_shard_splitter``). Capture
sizes [1, 2, 4] (upstream [1, 2, 4, 8, ..., 256]) with ``max_num_seqs`` 4; one GPU (no ``graph_capture()`` stream
context, no TP, no custom all-reduce, no LoRA); greedy sampling instead of the sampler. ``CUDAGraphRunner.forward``
takes the number of real rows only to announce the padded rows of ``block_tables`` (rows of ``graph_block_tables``
that no step clears); tokens, positions, slots and seq_lens of padded rows are rewritten every step.
Workload: three requests (prompts of 5, 7 and 3 tokens) prefilled together (eager), three decode steps of 3 sequences
(graph batch size 4, one padded row), then request C stops and two decode steps of 2 sequences (graph batch size 2).
Outputs: each step's logits and sampled tokens. Eager = the same engine with ``enforce_eager``.
Measured: bug: misbehaves (raised CaptureError: Tensor.item() inside graph capture needs the device's values on the
host (a host synchronisation), which a CUDA graph cannot wait for (cudaErrorStreamCaptureUnsupported).): the capture
of batch size 4 fails in the first layer's ``qkv_proj`` (its warm-up run passed). Fix: equals eager (max |graph -
eager| = 0): five replays (sizes 4, 4, 4, 2, 2) serve the eager tokens. Under 1 s per variant on the CPU.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from workbench.engine import events, graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/5159"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "apply_weights"
SYMPTOM = ("A compressed-tensors W8A8 static per-tensor model (nm-testing/tinyllama-one-shot-static-quant-test-"
           "compressed) could not be served with CUDA graphs: each quantized linear read its activation scale with "
           "act_scale[0].item(), a device-to-host read that fails inside the decode graph capture")

VOCAB, HIDDEN, NUM_HEADS, HEAD_DIM, INTERMEDIATE, NUM_LAYERS = 32, 16, 2, 8, 32, 2
BLOCK_SIZE, MAX_MODEL_LEN, MAX_NUM_SEQS = 4, 16, 4
MAX_BLOCKS = MAX_MODEL_LEN // BLOCK_SIZE            # graph_block_tables width (max_seq_len_to_capture // block_size)
NUM_BLOCKS = MAX_NUM_SEQS * MAX_BLOCKS
PAD_SLOT = NUM_BLOCKS * BLOCK_SIZE                  # stand-in: where a _PAD_SLOT_ID write lands (the kernel skips it)
_PAD_SLOT_ID = -1
_BATCH_SIZE_ALIGNMENT = 8
_BATCH_SIZES_TO_CAPTURE = [1, 2, 4]                 # upstream: [1, 2, 4] + [8 * i for i in range(1, 33)]
DTYPE = torch.float64

_variant = "bug"


# --- vllm/_custom_ops.py and the kernels they launch (stand-ins) ------------------------------------------------------

def static_scaled_int8_quant(input: torch.Tensor, scale) -> torch.Tensor:
    """``vllm_ops.static_scaled_int8_quant``: out = float_to_int8_rn(input / scale). Before the fix ``scale`` is a
    Python float passed by value; after it, a one-element device tensor the kernel reads (``*scale_ptr``)."""
    q = torch.empty_like(input, dtype=torch.int8)
    q.copy_(torch.round(input / scale).clamp_(-128, 127))
    return q


def cutlass_scaled_mm_dq(a, b, scale_a, scale_b, out_dtype):
    """int8 x int8 GEMM with the scales applied in the epilogue (scales on the device since #5137). The integer
    products are exact in float64 at these sizes, as the int32 accumulator is."""
    acc = a.to(torch.float64) @ b.to(torch.float64)
    return (scale_a.view(-1, 1) * (scale_b.view(1, -1) * acc)).to(out_dtype)


# --- compressed_tensors: the W8A8 static per-tensor scheme and its linear method --------------------------------------

class CompressedTensorsW8A8StaticTensor:

    def scales_shard_splitter(self, param, loaded_weight, shard_id: int, logical_widths):
        offset = sum(logical_widths[:shard_id])
        size = logical_widths[shard_id]
        return param[offset:offset + size], loaded_weight.repeat(size)      # copies for broadcast

    def create_weights(self, layer, output_partition_sizes, input_size_per_partition, device):
        is_tensor_partitioned = len(output_partition_sizes) != 1
        weight_scale_dim = sum(output_partition_sizes) if is_tensor_partitioned else 1
        p = lambda *s, dtype: torch.nn.Parameter(torch.empty(*s, dtype=dtype, device=device), requires_grad=False)
        layer.register_parameter("input_scale", p(1, dtype=torch.float32))   # on the GPU since #5137
        layer.register_parameter("weight_scale", p(weight_scale_dim, dtype=torch.float32))
        layer.register_parameter("weight", p(sum(output_partition_sizes), input_size_per_partition, dtype=torch.int8))
        layer.logical_widths = output_partition_sizes

    def apply_weights(self, layer, x: torch.Tensor):
        weight = layer.weight
        weight_scale = layer.weight_scale
        act_scale = layer.input_scale

        # Input quantize
        if _variant == "bug":
            x_q = static_scaled_int8_quant(x, act_scale[0].item())
        else:
            x_q = static_scaled_int8_quant(x, act_scale)

        return cutlass_scaled_mm_dq(x_q, weight.t(), act_scale, weight_scale, x.dtype)


class CompressedTensorsLinearMethod:
    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, device):
        scheme = CompressedTensorsW8A8StaticTensor()          # get_scheme: static per-tensor int8 for every layer
        scheme.create_weights(layer, output_partition_sizes, input_size_per_partition, device)
        layer.scheme = scheme

    def apply(self, layer, x, bias=None):
        if bias is not None:
            raise ValueError("bias is not supported for this linear method")
        return layer.scheme.apply_weights(layer, x)


class LinearBase(torch.nn.Module):
    def __init__(self, input_size, output_sizes, device):
        super().__init__()
        self.quant_method = CompressedTensorsLinearMethod()
        self.quant_method.create_weights(self, input_size, output_sizes, device)

    def load(self, gen, input_scale: float, shard_scales):
        """weight_loader stand-in: the checkpoint's int8 weight, its per-tensor input scale and one weight scale per
        logical shard (repeated over the shard's rows by ``scales_shard_splitter`` when the layer is merged)."""
        self.weight.copy_(torch.randint(-127, 128, tuple(self.weight.shape), generator=gen, dtype=torch.int8))
        self.input_scale.fill_(input_scale)
        if self.weight_scale.numel() == 1:
            self.weight_scale.fill_(shard_scales[0])
        for shard_id, s in enumerate(shard_scales if self.weight_scale.numel() > 1 else ()):
            param, loaded = self.scheme.scales_shard_splitter(self.weight_scale, torch.tensor([s]), shard_id,
                                                              self.logical_widths)
            param.copy_(loaded)

    def forward(self, x):
        return self.quant_method.apply(self, x), None


QKVParallelLinear = MergedColumnParallelLinear = RowParallelLinear = LinearBase


# --- attention (decode: PagedAttention over block tables; prefill: causal attention over the prompt) ------------------

@dataclasses.dataclass
class AttentionMetadata:
    num_prefills: int
    slot_mapping: torch.Tensor
    seq_lens: list | None                  # prefill: prompt lengths
    seq_lens_tensor: torch.Tensor | None   # decode
    max_decode_seq_len: int
    block_tables: torch.Tensor | None
    use_cuda_graph: bool


def write_to_paged_cache(key, value, key_cache, value_cache, slot_mapping):
    """reshape_and_cache: a slot of _PAD_SLOT_ID is skipped by the kernel (here: written to a spare row)."""
    idx = torch.where(slot_mapping >= 0, slot_mapping, torch.full_like(slot_mapping, PAD_SLOT))
    key_cache.index_copy_(0, idx, key)
    value_cache.index_copy_(0, idx, value)


def forward_decode(query, key_cache, value_cache, block_tables, seq_lens, scale):
    """paged_attention_v1/v2 stand-in: each sequence attends to its first seq_lens[b] cached tokens. It always walks
    MAX_MODEL_LEN positions (masked), so its arithmetic does not depend on the block table's width."""
    bt = torch.nn.functional.pad(block_tables, (0, MAX_BLOCKS - block_tables.shape[1]))
    j = torch.arange(MAX_MODEL_LEN, device=query.device)
    slots = bt[:, j // BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE             # [b, L]
    scores = torch.einsum("bhd,blhd->bhl", query, key_cache[slots]) * scale
    scores = scores.masked_fill((j[None, :] >= seq_lens[:, None])[:, None, :], float("-inf"))
    return torch.einsum("bhl,blhd->bhd", torch.softmax(scores, dim=-1), value_cache[slots])


class Attention:
    def __init__(self, scale):
        self.scale = scale

    def forward(self, q, k, v, kv_cache, attn_metadata: AttentionMetadata):
        n = q.shape[0]
        q, k, v = (t.view(n, NUM_HEADS, HEAD_DIM) for t in (q, k, v))
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        write_to_paged_cache(k, v, key_cache, value_cache, attn_metadata.slot_mapping)
        if attn_metadata.num_prefills:
            outs, start = [], 0
            for length in attn_metadata.seq_lens:
                qs, ks, vs = q[start:start + length], k[start:start + length], v[start:start + length]
                scores = torch.einsum("qhd,khd->hqk", qs, ks) * self.scale
                causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
                probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
                outs.append(torch.einsum("hqk,khd->qhd", probs, vs))
                start += length
            out = torch.cat(outs)
        else:
            out = forward_decode(q, key_cache, value_cache, attn_metadata.block_tables,
                                 attn_metadata.seq_lens_tensor, self.scale)
        return out.reshape(n, NUM_HEADS * HEAD_DIM)


# --- vllm/model_executor/models/llama.py (reduced) --------------------------------------------------------------------

def rms_norm(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class RotaryEmbedding:
    def __init__(self, device):
        inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=DTYPE) / HEAD_DIM))
        freqs = torch.outer(torch.arange(MAX_MODEL_LEN, dtype=DTYPE), inv_freq)
        self.cos_sin_cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)

    def __call__(self, positions, q, k):
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)
        cos, sin = cos[:, None, :], sin[:, None, :]

        def rot(x):                                                        # neox style
            x = x.view(x.shape[0], NUM_HEADS, HEAD_DIM)
            x1, x2 = x.chunk(2, dim=-1)
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(1)
        return rot(q), rot(k)


class LlamaDecoderLayer:
    def __init__(self, device, gen):
        self.qkv_proj = QKVParallelLinear(HIDDEN, [HIDDEN] * 3, device)     # q, k, v shards
        self.o_proj = RowParallelLinear(HIDDEN, [HIDDEN], device)
        self.gate_up_proj = MergedColumnParallelLinear(HIDDEN, [INTERMEDIATE] * 2, device)
        self.down_proj = RowParallelLinear(INTERMEDIATE, [HIDDEN], device)
        self.qkv_proj.load(gen, 1 / 32, [1 / 512, 1 / 448, 1 / 384])
        self.o_proj.load(gen, 1 / 48, [1 / 512])
        self.gate_up_proj.load(gen, 1 / 32, [1 / 640, 1 / 576])
        self.down_proj.load(gen, 1 / 192, [1 / 256])
        self.input_layernorm = 1 + randn(HIDDEN, gen=gen, device=device, scale=0.1).to(DTYPE)
        self.post_attention_layernorm = 1 + randn(HIDDEN, gen=gen, device=device, scale=0.1).to(DTYPE)
        self.rotary_emb = RotaryEmbedding(device)
        self.attn = Attention(HEAD_DIM ** -0.5)

    def forward(self, positions, hidden_states, kv_cache, attn_metadata):
        residual = hidden_states
        qkv, _ = self.qkv_proj(rms_norm(hidden_states, self.input_layernorm))
        q, k, v = qkv.split([HIDDEN, HIDDEN, HIDDEN], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        attn_output, _ = self.o_proj(self.attn.forward(q, k, v, kv_cache, attn_metadata))
        hidden_states = residual + attn_output
        gate_up, _ = self.gate_up_proj(rms_norm(hidden_states, self.post_attention_layernorm))
        gate, up = gate_up.chunk(2, dim=-1)
        down, _ = self.down_proj(torch.nn.functional.silu(gate) * up)     # SiluAndMul
        return hidden_states + down


class LlamaForCausalLM:
    def __init__(self, device):
        gen = generator(5159)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device).to(DTYPE)
        self.layers = [LlamaDecoderLayer(device, gen) for _ in range(NUM_LAYERS)]
        self.norm = torch.ones(HIDDEN, dtype=DTYPE, device=device)
        self.lm_head = randn(VOCAB, HIDDEN, gen=gen, device=device, scale=0.5).to(DTYPE)

    def __call__(self, input_ids, positions, kv_caches, attn_metadata):
        hidden_states = self.embed_tokens[input_ids]
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden_states = layer.forward(positions, hidden_states, kv_cache, attn_metadata)
        return rms_norm(hidden_states, self.norm)

    def compute_logits(self, hidden_states, selected_token_indices):
        return hidden_states[selected_token_indices] @ self.lm_head.t()


# --- vllm/worker/model_runner.py (reduced) ----------------------------------------------------------------------------

@dataclasses.dataclass
class SequenceGroupMetadata:
    request_id: str
    is_prompt: bool
    token_ids: list
    block_table: list


def _get_graph_batch_size(batch_size: int) -> int:
    if batch_size <= 2:
        return batch_size
    elif batch_size <= 4:
        return 4
    return (batch_size + _BATCH_SIZE_ALIGNMENT - 1) // _BATCH_SIZE_ALIGNMENT * _BATCH_SIZE_ALIGNMENT


class CUDAGraphRunner:
    def __init__(self, model):
        self.model = model
        self.input_buffers: dict = {}
        self.output_buffers: dict = {}
        self.graph = None

    def capture(self, input_ids, positions, kv_caches, attn_metadata, memory_pool, device):
        # Run the model once without capturing the graph, then capture it (kit.capture does both).
        step = lambda: self.model(input_ids, positions, kv_caches, attn_metadata)
        self.graph, hidden_states = capture(step, device=device, pool=memory_pool, warmups=1,
                                            name=f"decode batch_size={input_ids.shape[0]}", owner="CUDAGraphRunner")
        self.input_buffers = {"input_ids": input_ids, "positions": positions,
                              "slot_mapping": attn_metadata.slot_mapping,
                              "seq_lens_tensor": attn_metadata.seq_lens_tensor,
                              "block_tables": attn_metadata.block_tables}
        self.output_buffers = {"hidden_states": hidden_states}

    def forward(self, input_ids, positions, kv_caches, attn_metadata, num_real):
        del kv_caches                     # KV caches are fixed tensors, so we don't need to copy them.
        self.input_buffers["input_ids"].copy_(input_ids, non_blocking=True)
        self.input_buffers["positions"].copy_(positions, non_blocking=True)
        self.input_buffers["slot_mapping"].copy_(attn_metadata.slot_mapping, non_blocking=True)
        self.input_buffers["seq_lens_tensor"].copy_(attn_metadata.seq_lens_tensor, non_blocking=True)
        self.input_buffers["block_tables"].copy_(attn_metadata.block_tables, non_blocking=True)
        size = input_ids.shape[0]
        # Padded rows: tokens 0, positions 0, slot _PAD_SLOT_ID, seq_len 1 are written each step; their block-table
        # rows are whatever graph_block_tables held (never cleared).
        padded = {"block_tables": self.input_buffers["block_tables"]} if num_real < size else None
        return replay(self.graph, self.output_buffers["hidden_states"], real=num_real, size=size, padded=padded)


class ModelRunner:
    def __init__(self, device, enforce_eager: bool):
        self.device, self.enforce_eager = device, enforce_eager
        self.model = LlamaForCausalLM(device)
        self.kv_caches = [torch.zeros(2, NUM_BLOCKS * BLOCK_SIZE + 1, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
                          for _ in range(NUM_LAYERS)]
        self.graph_runners: dict = {}
        self.graph_memory_pool = None
        self.max_seq_len_to_capture = MAX_MODEL_LEN
        self.graph_block_tables = np.zeros((max(_BATCH_SIZES_TO_CAPTURE), MAX_BLOCKS), dtype=np.int64)

    def _prepare_model_input(self, seq_group_metadata_list):
        t = lambda x: torch.tensor(x, dtype=torch.long).to(self.device)
        input_tokens, input_positions, slot_mapping, seq_lens, block_tables = [], [], [], [], []
        is_prompt = seq_group_metadata_list[0].is_prompt
        for sg in seq_group_metadata_list:
            seq_len = len(sg.token_ids)
            positions = range(seq_len) if is_prompt else [seq_len - 1]
            for p in positions:
                input_tokens.append(sg.token_ids[p])
                input_positions.append(p)
                slot_mapping.append(sg.block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
            seq_lens.append(seq_len)
            block_tables.append(sg.block_table)
        if is_prompt:
            selected = t(np.cumsum(seq_lens) - 1)
            md = AttentionMetadata(len(seq_lens), t(slot_mapping), seq_lens, None, 0, None, False)
            return t(input_tokens), t(input_positions), md, selected, len(seq_lens)

        batch_size = num_real = len(input_tokens)
        max_decode_seq_len = max(seq_lens)
        use_captured_graph = (not self.enforce_eager and batch_size <= _BATCH_SIZES_TO_CAPTURE[-1]
                              and max_decode_seq_len <= self.max_seq_len_to_capture)
        if use_captured_graph:
            graph_batch_size = _get_graph_batch_size(batch_size)
            for _ in range(graph_batch_size - batch_size):
                input_tokens.append(0)
                input_positions.append(0)
                slot_mapping.append(_PAD_SLOT_ID)
                seq_lens.append(1)
                block_tables.append([])
            batch_size = graph_batch_size
            input_block_tables = self.graph_block_tables[:batch_size]
            for i, block_table in enumerate(block_tables):
                if block_table:
                    input_block_tables[i, :len(block_table)] = block_table
            block_tables_t = t(input_block_tables)
        else:
            width = max(len(b) for b in block_tables)
            block_tables_t = t([b + [0] * (width - len(b)) for b in block_tables])   # make_tensor_with_pad
        md = AttentionMetadata(0, t(slot_mapping), None, t(seq_lens), max_decode_seq_len, block_tables_t,
                               use_captured_graph)
        return t(input_tokens), t(input_positions), md, torch.arange(num_real, device=self.device), num_real

    def execute_model(self, seq_group_metadata_list):
        input_tokens, input_positions, attn_metadata, selected, num_real = \
            self._prepare_model_input(seq_group_metadata_list)
        if attn_metadata.num_prefills == 0 and attn_metadata.use_cuda_graph:
            hidden_states = self.graph_runners[input_tokens.shape[0]].forward(
                input_tokens, input_positions, self.kv_caches, attn_metadata, num_real)
        else:
            hidden_states = self.model(input_tokens, input_positions, self.kv_caches, attn_metadata)
        logits = self.model.compute_logits(hidden_states, selected)
        return logits, logits.argmax(dim=-1)                                  # greedy sampling

    def capture_model(self):
        max_batch_size = max(_BATCH_SIZES_TO_CAPTURE)
        z = lambda: torch.zeros(max_batch_size, dtype=torch.long, device=self.device)
        input_tokens, input_positions = z(), z()
        slot_mapping = torch.full((max_batch_size,), _PAD_SLOT_ID, dtype=torch.long, device=self.device)
        seq_lens = torch.ones(max_batch_size, dtype=torch.long, device=self.device)
        block_tables = torch.from_numpy(self.graph_block_tables).to(self.device)
        events.static_buffers("ModelRunner.capture_model", {
            "input_tokens": input_tokens, "input_positions": input_positions, "slot_mapping": slot_mapping,
            "seq_lens": seq_lens, "block_tables": block_tables})
        events.persistent_state("ModelRunner", {f"kv_caches[{i}]": c for i, c in enumerate(self.kv_caches)})
        self.graph_memory_pool = graph_pool_handle(self.device)
        graph_batch_size = _get_graph_batch_size(MAX_NUM_SEQS)
        for batch_size in reversed([bs for bs in _BATCH_SIZES_TO_CAPTURE if bs <= graph_batch_size]):
            attn_metadata = AttentionMetadata(0, slot_mapping[:batch_size], None, seq_lens[:batch_size],
                                              self.max_seq_len_to_capture, block_tables[:batch_size], True)
            graph_runner = CUDAGraphRunner(self.model)
            graph_runner.capture(input_tokens[:batch_size], input_positions[:batch_size], self.kv_caches,
                                 attn_metadata, self.graph_memory_pool, self.device)
            self.graph_runners[batch_size] = graph_runner


# --- the engine: three requests prefilled together, three decode steps, one finishes, two more steps ---------------

def _serve(device, enforce_eager, prompts):
    runner = ModelRunner(device, enforce_eager)
    if not enforce_eager:
        runner.capture_model()                          # at engine start (_initialize_kv_caches -> capture_model)
    seqs = [SequenceGroupMetadata(r, True, list(p), list(range(i * MAX_BLOCKS, (i + 1) * MAX_BLOCKS)))
            for i, (r, p) in enumerate(prompts.items())]
    outs = []
    for step in range(6):
        running = seqs if step < 4 else seqs[:2]       # request C stops after three decode steps
        logits, sampled = runner.execute_model(running)
        outs += [logits, sampled.to(DTYPE)]
        for sg, tok in zip(running, sampled.tolist()):
            sg.token_ids.append(tok)
            sg.is_prompt = False
    return outs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(2024)
    prompts = {r: torch.randint(0, VOCAB, (n,), generator=gen).tolist() for r, n in (("A", 5), ("B", 7), ("C", 3))}
    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: _serve(device, False, prompts), lambda: _serve(device, True, prompts))
