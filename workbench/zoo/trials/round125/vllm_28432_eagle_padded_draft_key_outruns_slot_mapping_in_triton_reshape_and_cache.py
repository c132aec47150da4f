"""vLLM V1, EAGLE speculative decoding on the Triton attention backend with piecewise CUDA graphs: the drafter pads
its batch to a capture size, so the attention op (run eagerly between the graph pieces) gets a key of the padded
token count, while the drafter's ``slot_mapping`` holds only the real tokens; ``triton_reshape_and_cache_flash``
launches one program per key row and reads ``slot_mapping`` past its end.

Upstream: https://github.com/vllm-project/vllm/pull/28432 ("[Bugfix][CI/Test][Spec Decode] Fix illegal memory access
in offline_inference/spec_decode.py (Issue 27619)", vllm-project/vllm, by rasmith, opened 2025-11-11, merged as
commit 15ae8e0784d3889c6aa2c487ca00df4e3fde6f44 on 2025-11-14). Issue: https://github.com/vllm-project/vllm/issues/
27619 ("EAGLE Spec Decode failing with Triton Attention Backend": ``HSA_STATUS_ERROR_MEMORY_APERTURE_VIOLATION``
"immediately when processing prompts starts, after successful CUDA graph capturing"; also PR #27888, which skipped
those tests).
Read: the PR description and its first review comments, the issue's description; the merge commit's diff of
``vllm/attention/ops/triton_reshape_and_cache_flash.py`` (the launch grid's first axis changes from ``int(num_tokens)``,
``num_tokens = key.shape[0]``, to ``slot_mapping.shape[0]``), fetched from the local-inference-lab/vllm mirror of
vLLM's history; at the parent commit: that file whole (``reshape_and_cache_kernel_flash``: ``slot_idx =
tl.load(slot_mapping_ptr + token_idx)``, ``if slot_idx < 0: return``), ``vllm/v1/attention/backends/triton_attn.py``
(``TritonAttentionMetadataBuilder.build``, ``TritonAttentionImpl.forward``: the cache write over the whole ``key``,
``unified_attention`` over ``query[:num_actual_tokens]``), ``vllm/v1/spec_decode/eagle.py`` (``EagleProposer.__init__``,
``propose``, ``prepare_next_token_ids_padded``, ``prepare_inputs_padded``, ``dummy_run``),
``vllm/v1/worker/gpu_model_runner.py`` (``propose_draft_token_ids``, the slot mapping of ``_prepare_inputs``:
``blk_table.slot_mapping.gpu[:total_num_scheduled_tokens]`` with ``slot_mapping.gpu[total_num_scheduled_tokens:]
.fill_(-1)``, ``_dummy_run`` calling ``drafter.dummy_run``, ``_capture_cudagraphs``), ``vllm/compilation/
cuda_graph.py`` (``CUDAGraphWrapper.__call__``) and ``vllm/model_executor/models/llama_eagle.py``.
Symptom: with ``--method eagle``, chunked prefill and the Triton attention backend (the default on AMD), the engine
dies with an illegal memory access (a memory-aperture violation on MI325X) as soon as serving starts, after CUDA graph
capture; ``ROCM_AITER_FA`` and ``ROCM_AITER_UNIFIED_ATTN`` serve the same prompts. As the mechanism implies (and as
modelled), eager serving pads nothing and is fine.
Mechanism: ``EagleProposer.propose`` runs the draft model at ``num_input_tokens =
vllm_config.pad_for_cudagraph(num_tokens)`` whenever its piecewise CUDA graphs are on and the step fits the largest
capture size (eagerly, ``num_input_tokens = num_tokens``), so the draft graph's ``submod_0`` hands the attention op a
key of the padded size. The drafter's attention metadata is real-sized: ``prepare_inputs_padded`` builds
``slot_mapping=common_attn_metadata.slot_mapping[token_indices]`` (a new tensor of the real tokens), and each further
draft step computes ``slot_mapping = block_ids * block_size + clamped_positions % block_size`` for ``batch_size``
requests. ``triton_reshape_and_cache_flash`` sizes its launch grid from ``key.shape[0]``, and its kernel reads
``slot_mapping_ptr + token_idx`` for every program: the padded programs read past the end of the tensor. The target
model's own padded step is spared because its ``slot_mapping`` is a view of the runner's persistent buffer, filled
with -1 past the real tokens, so the padded programs read -1 and return.
Doctor: padded-shape-mismatch, at triton_reshape_and_cache_flash. Run on the piecewise graph's padded key, it launches
one program per padded key row and has each index the slot mapping sized for the real tokens, and the upstream fix
changes exactly this launch grid.
Fix (upstream): ``grid = lambda meta: (slot_mapping.shape[0], triton.cdiv(n, meta["TILE_SIZE"]))`` (the PR text says
"taking the min between the two"; the merged diff launches over ``slot_mapping``'s rows).
Modelled: ``triton_reshape_and_cache_flash`` and ``reshape_and_cache_kernel_flash`` (the kernel's unmasked
``tl.load(slot_mapping_ptr + token_idx)`` as a strided read from the tensor's data pointer: past the storage it
raises, where the GPU faults), ``TritonAttentionMetadataBuilder`` (``build``, ``build_for_drafting``),
``TritonAttentionImpl.forward``, ``unified_attention_with_output`` and the forward context, ``EagleProposer``
(``propose`` with its padded first pass and one further draft step, ``prepare_next_token_ids_padded``,
``prepare_inputs_padded``, ``dummy_run``), ``GPUModelRunner`` (``_prepare_inputs`` with the -1-filled slot mapping
buffer, ``_calc_spec_decode_metadata``, ``execute_model``, ``propose_draft_token_ids``, ``_dummy_run``,
``capture_model`` with one NONE warmup before each PIECEWISE capture, largest size first), a greedy rejection sampler,
and a ``PiecewiseCompiledModel`` standing in for the compiled model's ``CUDAGraphWrapper`` pieces (``submod_0`` |
attention, the splitting op run eagerly | ``submod_2``; captured per ``num_tokens`` in the dummy run with no
attention metadata, where attention fills its output with 0). Stand-ins: a one-layer target model and a one-layer
EAGLE head (``fc`` over ``cat(embed, target hidden)``, embedding and ``lm_head`` shared with the target) with a learned
position table instead of rope, no norms or MLP, float64; the unified attention kernel as a per-request loop over the
paged cache; each graph captured into its own pool; no chunked prefill, discarded requests, multimodal inputs, DP or
the ``FULL`` decode graphs; the target runs without aux hidden states (method ``eagle``).
Workload: ``num_speculative_tokens`` 2, capture sizes 1, 2, 4, 8, 16, block size 4. Requests A and B (prompts of 4)
prefill together (8 tokens: no padding for the target or the drafter; the second draft step runs 2 requests), then 4
decode steps verify 2 draft tokens each (6 tokens, padded to 8 for the target and the drafter's first pass; the second
draft step runs 2 requests, unpadded).
Measured: the bug raises RuntimeError at the first decode step, in the drafter's first pass ("setStorage: sizes [8],
strides [1], storage offset 0, and itemsize 8 requiring a storage size of 64 are out of bounds for storage of size
48": the 8 programs of the padded key read a slot mapping of 6; the target's own padded step, 8 programs over a
6-row view of the -1-filled buffer, passed); the fix equals eager (max |graph - eager| = 0 over the target logits and
draft tokens of the 5 steps; drafts were partly accepted, so requests advance by 1 to 3 tokens a step).
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum

import numpy as np
import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/28432"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "triton_reshape_and_cache_flash"
SYMPTOM = ("EAGLE speculative decoding on the Triton attention backend with piecewise CUDA graphs: the drafter's "
           "padded key makes reshape_and_cache read the real-sized slot mapping past its end (illegal memory access)")

VOCAB, NUM_HEADS, HEAD_SIZE = 16, 2, 4
HIDDEN = NUM_HEADS * HEAD_SIZE
BLOCK_SIZE, MAX_MODEL_LEN, MAX_NUM_REQS, MAX_NUM_TOKENS = 4, 24, 4, 32
BLOCKS_PER_REQ = MAX_MODEL_LEN // BLOCK_SIZE
NUM_BLOCKS = 1 + MAX_NUM_REQS * BLOCKS_PER_REQ
CUDAGRAPH_CAPTURE_SIZES = [1, 2, 4, 8, 16]
NUM_SPECULATIVE_TOKENS = 2
PADDING_SLOT_ID = -1
PLACEHOLDER_TOKEN_ID = -1
DTYPE = torch.float64

_variant = "bug"


def cdiv(a, b):
    return -(-a // b)


def next_power_of_2(n):
    return 1 << (n - 1).bit_length()


# --- vllm/attention/ops/triton_reshape_and_cache_flash.py -----------------------------------------------------------

def reshape_and_cache_kernel_flash(grid, key, value, key_cache, value_cache, slot_mapping, block_size):
    """One program per ``token_idx`` (grid axis 0); a program whose slot is negative returns."""
    token_idx = torch.arange(grid[0], device=key.device)
    # slot_idx = tl.load(slot_mapping_ptr + token_idx)
    slot_idx = torch.as_strided(slot_mapping, (grid[0],), (1,), slot_mapping.storage_offset()).to(torch.int64)
    keep = slot_idx >= 0                                    # padding token that should be ignored
    token_idx, slot_idx = token_idx[keep], slot_idx[keep]
    block_idx = slot_idx // block_size
    block_offset = slot_idx % block_size
    key_cache[block_idx, block_offset] = key[token_idx]
    value_cache[block_idx, block_offset] = value[token_idx]


def triton_reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
    num_tokens = key.shape[0]
    num_heads = key.shape[1]
    head_size = key.shape[2]
    block_size = key_cache.shape[1]
    n = num_heads * head_size
    assert kv_cache_dtype == "auto"
    TILE_SIZE = min(2048, next_power_of_2(n))  # noqa: N806

    # TODO(ngl): maybe replace with static launch grid to avoid overhead if
    #   using cudagraphs
    if _variant == "bug":
        grid = lambda meta: (int(num_tokens), cdiv(n, meta["TILE_SIZE"]))  # noqa: E731
    else:
        grid = lambda meta: (slot_mapping.shape[0], cdiv(n, meta["TILE_SIZE"]))  # noqa: E731
    reshape_and_cache_kernel_flash(grid({"TILE_SIZE": TILE_SIZE}), key, value, key_cache, value_cache,
                                   slot_mapping, block_size)


# --- vllm/v1/attention/backends (utils.py, triton_attn.py; reduced) ------------------------------------------------

@dataclasses.dataclass
class CommonAttentionMetadata:
    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    num_computed_tokens_cpu: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool = True


@dataclasses.dataclass
class TritonAttentionMetadata:
    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor
    max_seq_len: int
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    use_cascade: bool = False


class TritonAttentionMetadataBuilder:
    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        m = common_attn_metadata
        return TritonAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens, max_query_len=m.max_query_len,
            query_start_loc=m.query_start_loc, max_seq_len=m.max_seq_len, seq_lens=m.seq_lens,
            block_table=m.block_table_tensor, slot_mapping=m.slot_mapping, use_cascade=common_prefix_len > 0)

    def build_for_drafting(self, common_attn_metadata, draft_index):
        return self.build(common_prefix_len=0, common_attn_metadata=common_attn_metadata, fast_build=True)


def unified_attention(q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, softmax_scale, causal,
                      block_table):
    """Paged varlen attention: query ``j`` of a request sees the keys up to ``seq_len - query_len + j``."""
    qsl = cu_seqlens_q.tolist()
    seq_lens = seqused_k.tolist()
    for i in range(len(qsl) - 1):
        start, end = qsl[i], qsl[i + 1]
        if end == start:
            continue
        seq_len = seq_lens[i]
        blocks = block_table[i, :cdiv(seq_len, BLOCK_SIZE)]
        keys = k[blocks].reshape(-1, NUM_HEADS, HEAD_SIZE)[:seq_len]
        vals = v[blocks].reshape(-1, NUM_HEADS, HEAD_SIZE)[:seq_len]
        scores = torch.einsum("qhd,khd->hqk", q[start:end], keys) * softmax_scale
        context_len = seq_len - (end - start)
        query_pos = context_len + torch.arange(end - start, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] > query_pos[:, None]
        probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, vals)


class TritonAttentionImpl:
    def __init__(self):
        self.scale = HEAD_SIZE ** -0.5
        self.kv_cache_dtype = "auto"
        self.kv_sharing_target_layer_name = None

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output):
        assert output is not None, "Output tensor must be provided."
        if attn_metadata is None:
            # Profiling run.
            return output.fill_(0)
        assert attn_metadata.use_cascade is False
        # NOTE(woosuk): With piece-wise CUDA graphs, this method is executed in eager-mode PyTorch.
        num_actual_tokens = attn_metadata.num_actual_tokens
        key_cache, value_cache = kv_cache.unbind(1)
        if self.kv_sharing_target_layer_name is None:
            # Reshape the input keys and values and store them in the cache.
            triton_reshape_and_cache_flash(key, value, key_cache, value_cache, attn_metadata.slot_mapping,
                                           self.kv_cache_dtype, layer._k_scale, layer._v_scale)
        unified_attention(
            q=query[:num_actual_tokens], k=key_cache, v=value_cache, out=output[:num_actual_tokens],
            cu_seqlens_q=attn_metadata.query_start_loc, max_seqlen_q=attn_metadata.max_query_len,
            seqused_k=attn_metadata.seq_lens, max_seqlen_k=attn_metadata.max_seq_len, softmax_scale=self.scale,
            causal=True, block_table=attn_metadata.block_table)
        return output


# --- vllm/forward_context.py, vllm/attention/layer.py (reduced) ----------------------------------------------------

class CUDAGraphMode(enum.Enum):
    NONE = 0
    PIECEWISE = 1


class ForwardContext:
    attn_metadata: dict | None = None
    num_tokens: int = 0
    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE
    no_compile_layers: dict = {}


_forward_context = ForwardContext()


@contextlib.contextmanager
def set_forward_context(attn_metadata, num_tokens, cudagraph_runtime_mode=CUDAGraphMode.NONE):
    saved = (_forward_context.attn_metadata, _forward_context.num_tokens, _forward_context.cudagraph_runtime_mode)
    _forward_context.attn_metadata = attn_metadata
    _forward_context.num_tokens = num_tokens
    _forward_context.cudagraph_runtime_mode = cudagraph_runtime_mode
    try:
        yield
    finally:
        (_forward_context.attn_metadata, _forward_context.num_tokens,
         _forward_context.cudagraph_runtime_mode) = saved


class Attention:
    def __init__(self, prefix, device):
        self.layer_name = prefix
        self.impl = TritonAttentionImpl()
        self._k_scale = torch.ones((), dtype=torch.float32, device=device)
        self._v_scale = torch.ones((), dtype=torch.float32, device=device)
        # [num_blocks, 2, block_size, num_kv_heads, head_size]
        self.kv_cache = torch.zeros(NUM_BLOCKS, 2, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE, dtype=DTYPE, device=device)
        _forward_context.no_compile_layers[prefix] = self


def unified_attention_with_output(query, key, value, output, layer_name):
    """The splitting op of piecewise compilation: runs eagerly, between the graph pieces."""
    self = _forward_context.no_compile_layers[layer_name]
    attn_metadata = _forward_context.attn_metadata
    if isinstance(attn_metadata, dict):
        attn_metadata = attn_metadata[layer_name]
    self.impl.forward(self, query, key, value, self.kv_cache, attn_metadata, output)


# --- the models (vllm/model_executor/models/llama.py, llama_eagle.py; reduced to one layer) -----------------------

class LlamaForCausalLM:
    def __init__(self, device, prefix="model.layers.0.self_attn.attn"):
        gen = generator(28432)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device).to(DTYPE)
        self.embed_positions = randn(MAX_MODEL_LEN, HIDDEN, gen=gen, device=device, scale=0.5).to(DTYPE)
        self.qkv_proj = randn(HIDDEN, 3 * HIDDEN, gen=gen, device=device, scale=0.6).to(DTYPE)
        self.o_proj = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6).to(DTYPE)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device).to(DTYPE)
        self.attn = Attention(prefix, device)

    def _qkv(self, h):
        q, k, v = (h @ self.qkv_proj).split(HIDDEN, dim=-1)
        output = torch.empty(h.shape[0], NUM_HEADS, HEAD_SIZE, dtype=h.dtype, device=h.device)
        return (q.reshape(-1, NUM_HEADS, HEAD_SIZE), k.reshape(-1, NUM_HEADS, HEAD_SIZE),
                v.reshape(-1, NUM_HEADS, HEAD_SIZE), output)

    def submod_0(self, input_ids, positions):
        h = self.embed_tokens[input_ids] + self.embed_positions[positions]
        return (h,) + self._qkv(h)

    def submod_2(self, h, attn_output):
        return h + torch.tanh(attn_output.reshape(-1, HIDDEN) @ self.o_proj)

    def forward(self, input_ids, positions):
        h, q, k, v, out = self.submod_0(input_ids, positions)
        unified_attention_with_output(q, k, v, out, self.attn.layer_name)
        return self.submod_2(h, out)

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head


class EagleLlamaForCausalLM(LlamaForCausalLM):
    """The EAGLE head: ``fc(cat(embed_tokens(input_ids), hidden_states))``, one decoder layer; the embedding and
    ``lm_head`` are the target's ("Assuming the EAGLE head shares the same lm_head with the target model")."""

    def __init__(self, device, target):
        super().__init__(device, prefix="model.layers.1.self_attn.attn")
        gen = generator(284320)
        self.qkv_proj = randn(HIDDEN, 3 * HIDDEN, gen=gen, device=device, scale=0.6).to(DTYPE)
        self.o_proj = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6).to(DTYPE)
        self.fc = randn(2 * HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5).to(DTYPE)
        self.embed_tokens, self.lm_head = target.embed_tokens, target.lm_head

    def submod_0(self, input_ids, positions, hidden_states):
        input_embeds = self.embed_tokens[input_ids]
        h = torch.cat((input_embeds, hidden_states), dim=-1) @ self.fc + self.embed_positions[positions]
        return (h,) + self._qkv(h)

    def submod_2(self, h, attn_output):
        hidden_states = super().submod_2(h, attn_output)
        return hidden_states, hidden_states

    def forward(self, input_ids, positions, hidden_states):
        h, q, k, v, out = self.submod_0(input_ids, positions, hidden_states)
        unified_attention_with_output(q, k, v, out, self.attn.layer_name)
        return self.submod_2(h, out)


# --- vllm/compilation (the piecewise-compiled model: CUDAGraphWrapper per piece; reduced) --------------------------

class PiecewiseCompiledModel:
    """The model as ``@support_torch_compile`` serves it in PIECEWISE mode: ``submod_0`` | attention (splitting op,
    eager) | ``submod_2``; each piece is captured the first time a ``num_tokens`` comes with PIECEWISE runtime mode
    (the dummy run of ``capture_model``) and replayed afterwards on the addresses it was captured with."""

    def __init__(self, model, device, input_names):
        self.model, self.device, self.input_names = model, device, input_names
        self.concrete_cudagraph_entries: dict[int, tuple] = {}

    def __call__(self, *inputs):
        if _forward_context.cudagraph_runtime_mode == CUDAGraphMode.NONE:
            return self.model.forward(*inputs)
        num_tokens = _forward_context.num_tokens
        layer_name = self.model.attn.layer_name
        entry = self.concrete_cudagraph_entries.get(num_tokens)
        if entry is None:
            static = dict(zip(self.input_names, inputs))
            g0, out0 = capture(lambda: self.model.submod_0(*inputs), device=self.device, warmups=0,
                               name=f"{layer_name} submod_0 num_tokens={num_tokens}",
                               owner="CUDAGraphWrapper (PIECEWISE)", static=static)
            h, q, k, v, out = out0
            unified_attention_with_output(q, k, v, out, layer_name)
            g2, out2 = capture(lambda: self.model.submod_2(h, out), device=self.device, warmups=0,
                               name=f"{layer_name} submod_2 num_tokens={num_tokens}",
                               owner="CUDAGraphWrapper (PIECEWISE)")
            self.concrete_cudagraph_entries[num_tokens] = ((g0, out0), (g2, out2))
            return out2
        (g0, out0), (g2, out2) = entry
        attn_metadata = _forward_context.attn_metadata
        real = attn_metadata[layer_name].num_actual_tokens if attn_metadata else num_tokens
        h, q, k, v, out = replay(g0, out0, real=real, size=num_tokens, padded=dict(zip(self.input_names, inputs)))
        unified_attention_with_output(q, k, v, out, layer_name)
        return replay(g2, out2, real=real, size=num_tokens, padded={"attn_output": out})


def pad_for_cudagraph(num_tokens):
    return next(size for size in CUDAGRAPH_CAPTURE_SIZES if size >= num_tokens)


# --- vllm/v1/spec_decode/eagle.py (reduced) ------------------------------------------------------------------------

class EagleProposer:
    def __init__(self, target_model, device, use_cuda_graph):
        self.device = device
        self.block_size = BLOCK_SIZE
        self.max_model_len = MAX_MODEL_LEN
        self.num_speculative_tokens = NUM_SPECULATIVE_TOKENS
        self.use_cuda_graph = use_cuda_graph
        self.cudagraph_batch_sizes = sorted(CUDAGRAPH_CAPTURE_SIZES) if self.use_cuda_graph else []
        self.use_cuda_graph = self.use_cuda_graph and bool(self.cudagraph_batch_sizes)
        # persistent buffers for cuda graph
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)
        self.positions = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)
        self.hidden_states = torch.zeros(MAX_NUM_TOKENS, HIDDEN, dtype=DTYPE, device=device)
        self.arange = torch.arange(MAX_NUM_TOKENS + 1, device=device, dtype=torch.int32)
        self.token_arange_np = np.arange(MAX_NUM_TOKENS + 1)
        self.model = EagleLlamaForCausalLM(device, target_model)
        self.compiled_model = PiecewiseCompiledModel(self.model, device, ("input_ids", "positions", "hidden_states"))
        self.attn_metadata_builder = TritonAttentionMetadataBuilder()
        self.attn_layer_names = [self.model.attn.layer_name]

    def _get_positions(self, num_tokens):
        return self.positions[:num_tokens]

    def _set_positions(self, num_tokens, positions):
        self.positions[:num_tokens] = positions

    def propose(self, target_token_ids, target_positions, target_hidden_states, next_token_ids, last_token_indices,
                common_attn_metadata):
        num_tokens = target_token_ids.shape[0]
        batch_size = next_token_ids.shape[0]
        if last_token_indices is None:
            last_token_indices = common_attn_metadata.query_start_loc[1:] - 1

        # Shift the input ids by one token.
        self.input_ids[: num_tokens - 1] = target_token_ids[1:]
        # Replace the last token with the next token.
        self.input_ids[last_token_indices] = next_token_ids

        attn_metadata = self.attn_metadata_builder.build_for_drafting(
            common_attn_metadata=common_attn_metadata, draft_index=0)
        per_layer_attn_metadata = {layer_name: attn_metadata for layer_name in self.attn_layer_names}

        cudagraph_runtime_mode = CUDAGraphMode.NONE
        if self.use_cuda_graph and num_tokens <= self.cudagraph_batch_sizes[-1]:
            num_input_tokens = pad_for_cudagraph(num_tokens)
            cudagraph_runtime_mode = CUDAGraphMode.PIECEWISE
        else:
            num_input_tokens = num_tokens
        # copy inputs to buffer for cudagraph
        self._set_positions(num_tokens, target_positions)
        self.hidden_states[:num_tokens] = target_hidden_states
        input_ids = self.input_ids[:num_input_tokens]

        with set_forward_context(per_layer_attn_metadata, num_tokens=num_input_tokens,
                                 cudagraph_runtime_mode=cudagraph_runtime_mode):
            last_hidden_states, hidden_states = self.compiled_model(
                input_ids, self._get_positions(num_input_tokens), self.hidden_states[:num_input_tokens])
        sample_hidden_states = last_hidden_states[last_token_indices]
        logits = self.model.compute_logits(sample_hidden_states)

        positions = target_positions[last_token_indices]
        hidden_states = hidden_states[last_token_indices]
        draft_token_ids = logits.argmax(dim=-1)

        # Generate the remaining draft tokens.
        draft_token_ids_list = [draft_token_ids]

        if self.use_cuda_graph and batch_size <= self.cudagraph_batch_sizes[-1]:
            input_batch_size = pad_for_cudagraph(batch_size)
            cudagraph_runtime_mode = CUDAGraphMode.PIECEWISE
        else:
            input_batch_size = batch_size
            cudagraph_runtime_mode = CUDAGraphMode.NONE

        common_attn_metadata.num_actual_tokens = batch_size
        common_attn_metadata.max_query_len = 1
        common_attn_metadata.query_start_loc = self.arange[: batch_size + 1]
        common_attn_metadata.query_start_loc_cpu = torch.from_numpy(self.token_arange_np[: batch_size + 1]).clone()
        for token_index in range(self.num_speculative_tokens - 1):
            # Update the inputs.
            input_ids = draft_token_ids_list[-1]
            positions += 1
            exceeds_max_model_len = positions >= self.max_model_len
            clamped_positions = torch.where(exceeds_max_model_len, 0, positions)

            # Increment the sequence lengths.
            common_attn_metadata.seq_lens += 1
            common_attn_metadata.seq_lens_cpu += 1
            common_attn_metadata.seq_lens.masked_fill_(exceeds_max_model_len, 1)
            common_attn_metadata.num_computed_tokens_cpu = common_attn_metadata.seq_lens_cpu - 1
            common_attn_metadata.max_seq_len = min(common_attn_metadata.max_seq_len + 1, self.max_model_len)

            # Compute the slot mapping.
            block_numbers = clamped_positions // self.block_size
            block_ids = common_attn_metadata.block_table_tensor.gather(dim=1, index=block_numbers.view(-1, 1))
            block_ids = block_ids.view(-1)
            common_attn_metadata.slot_mapping = block_ids * self.block_size + clamped_positions % self.block_size
            # Mask out the slot mappings that exceed the max model length.
            common_attn_metadata.slot_mapping.masked_fill_(exceeds_max_model_len, PADDING_SLOT_ID)

            # Rebuild attention metadata
            attn_metadata = self.attn_metadata_builder.build_for_drafting(
                common_attn_metadata=common_attn_metadata, draft_index=token_index + 1)
            for layer_name in self.attn_layer_names:
                per_layer_attn_metadata[layer_name] = attn_metadata

            # copy inputs to buffer for cudagraph
            self.input_ids[:batch_size] = input_ids
            self._set_positions(batch_size, clamped_positions)
            self.hidden_states[:batch_size] = hidden_states
            input_ids = self.input_ids[:input_batch_size]

            # Run the model.
            with set_forward_context(per_layer_attn_metadata, num_tokens=input_batch_size,
                                     cudagraph_runtime_mode=cudagraph_runtime_mode):
                last_hidden_states, hidden_states = self.compiled_model(
                    input_ids, self._get_positions(input_batch_size), self.hidden_states[:input_batch_size])
            hidden_states = hidden_states[:batch_size]
            logits = self.model.compute_logits(last_hidden_states[:batch_size])
            draft_token_ids = logits.argmax(dim=-1)
            draft_token_ids_list.append(draft_token_ids)

        # [batch_size, num_speculative_tokens]
        return torch.stack(draft_token_ids_list, dim=1)

    def prepare_next_token_ids_padded(self, common_attn_metadata, sampled_token_ids):
        """Next token and number of valid sampled tokens per request (rejected tokens are -1); no discarded
        requests here (no chunked prefill)."""
        valid_sampled_token_ids_gpu = sampled_token_ids.clone()
        valid_mask = (valid_sampled_token_ids_gpu != -1) & (valid_sampled_token_ids_gpu < VOCAB)
        valid_sampled_tokens_count = valid_mask.sum(dim=1)
        last_valid_indices = valid_sampled_tokens_count - 1
        last_valid_indices_safe = torch.clamp(last_valid_indices, min=0)
        selected_tokens = torch.gather(valid_sampled_token_ids_gpu, 1,
                                       last_valid_indices_safe.unsqueeze(1)).squeeze(1)
        return selected_tokens, valid_sampled_tokens_count

    def prepare_inputs_padded(self, common_attn_metadata, spec_decode_metadata, valid_sampled_tokens_count):
        """All tokens of the step go to the speculator; the rejected ones are padding, filtered out by
        ``token_indices_to_sample``."""
        num_draft_tokens_gpu = torch.cat([
            spec_decode_metadata.cu_num_draft_tokens[0:1],
            spec_decode_metadata.cu_num_draft_tokens[1:] - spec_decode_metadata.cu_num_draft_tokens[:-1]])
        num_rejected_tokens_gpu = torch.where(num_draft_tokens_gpu > 0,
                                              num_draft_tokens_gpu + 1 - valid_sampled_tokens_count,
                                              torch.zeros_like(num_draft_tokens_gpu))
        query_start_loc_cpu = common_attn_metadata.query_start_loc_cpu
        new_query_len_per_req = query_start_loc_cpu[1:] - query_start_loc_cpu[:-1]
        total_num_tokens = query_start_loc_cpu[-1].item()
        token_indices = self.arange[:total_num_tokens]
        spec_common_attn_metadata = CommonAttentionMetadata(
            query_start_loc=common_attn_metadata.query_start_loc,
            seq_lens=common_attn_metadata.seq_lens,
            query_start_loc_cpu=query_start_loc_cpu,
            seq_lens_cpu=common_attn_metadata.seq_lens_cpu,
            num_computed_tokens_cpu=common_attn_metadata.num_computed_tokens_cpu,
            num_reqs=common_attn_metadata.num_reqs,
            num_actual_tokens=total_num_tokens,
            max_query_len=new_query_len_per_req.max().item(),
            max_seq_len=common_attn_metadata.seq_lens_cpu.max().item(),
            block_table_tensor=common_attn_metadata.block_table_tensor,
            slot_mapping=common_attn_metadata.slot_mapping[token_indices],
            causal=True)
        token_indices_to_sample = common_attn_metadata.query_start_loc[1:] - 1 - num_rejected_tokens_gpu
        return spec_common_attn_metadata, token_indices, token_indices_to_sample

    def dummy_run(self, num_tokens, use_cudagraphs=True):
        cudagraphs_enabled = use_cudagraphs and self.use_cuda_graph
        if cudagraphs_enabled and num_tokens <= self.cudagraph_batch_sizes[-1]:
            num_tokens = pad_for_cudagraph(num_tokens)
        with set_forward_context(None, num_tokens=num_tokens, cudagraph_runtime_mode=(
                CUDAGraphMode.PIECEWISE if cudagraphs_enabled else CUDAGraphMode.NONE)):
            self.compiled_model(self.input_ids[:num_tokens], self._get_positions(num_tokens),
                                self.hidden_states[:num_tokens])


# --- vllm/v1/worker/gpu_model_runner.py (reduced) ------------------------------------------------------------------

@dataclasses.dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list
    block_ids: list
    output_token_ids: list = dataclasses.field(default_factory=list)
    spec_token_ids: list = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0

    @property
    def all_token_ids(self):
        return self.prompt_token_ids + self.output_token_ids


@dataclasses.dataclass
class SpecDecodeMetadata:
    draft_token_ids: torch.Tensor
    num_draft_tokens: list
    cu_num_draft_tokens: torch.Tensor
    target_logits_indices: torch.Tensor
    bonus_logits_indices: torch.Tensor
    logits_indices: torch.Tensor


def rejection_sample_greedy(spec_decode_metadata, logits, num_reqs):
    """The greedy path of ``RejectionSampler``: accept drafts while they match the target's argmax; the bonus
    token follows when all are accepted; rejected positions hold ``PLACEHOLDER_TOKEN_ID``."""
    target_argmax = logits[spec_decode_metadata.target_logits_indices].argmax(-1).tolist()
    bonus = logits[spec_decode_metadata.bonus_logits_indices].argmax(-1).tolist()
    draft = spec_decode_metadata.draft_token_ids.tolist()
    output = torch.full((num_reqs, NUM_SPECULATIVE_TOKENS + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64,
                        device=logits.device)
    start = 0
    for req, n in enumerate(spec_decode_metadata.num_draft_tokens):
        rejected = False
        for pos in range(n):
            output[req, pos] = target_argmax[start + pos]
            if draft[start + pos] != target_argmax[start + pos]:
                rejected = True
                break
        if not rejected:
            output[req, n] = bonus[req]
        start += n
    return output


class GPUModelRunner:
    def __init__(self, device, use_cuda_graph):
        self.device, self.use_cuda_graph = device, use_cuda_graph
        self.model = LlamaForCausalLM(device)
        self.compiled_model = PiecewiseCompiledModel(self.model, device, ("input_ids", "positions"))
        self.drafter = EagleProposer(self.model, device, use_cuda_graph)
        self.requests: dict[str, CachedRequestState] = {}
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)
        self.positions = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)
        self.query_start_loc = torch.zeros(MAX_NUM_REQS + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(MAX_NUM_REQS, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(MAX_NUM_REQS, BLOCKS_PER_REQ, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)   # BlockTable.slot_mapping
        self.attn_metadata_builder = TritonAttentionMetadataBuilder()

    # CUDA graph capture: one NONE warmup, then the PIECEWISE dummy run, largest size first
    def capture_model(self):
        for num_tokens in reversed(CUDAGRAPH_CAPTURE_SIZES):
            self._dummy_run(num_tokens, cudagraph_runtime_mode=CUDAGraphMode.NONE)
            self._dummy_run(num_tokens, cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE)

    def _dummy_run(self, num_tokens, cudagraph_runtime_mode):
        with set_forward_context(None, num_tokens=num_tokens, cudagraph_runtime_mode=cudagraph_runtime_mode):
            self.compiled_model(self.input_ids[:num_tokens], self.positions[:num_tokens])
        use_cudagraphs = cudagraph_runtime_mode == CUDAGraphMode.PIECEWISE
        self.drafter.dummy_run(num_tokens, use_cudagraphs=use_cudagraphs)

    def _calc_spec_decode_metadata(self, num_draft_tokens, cu_num_scheduled_tokens):
        num_sampled_tokens = np.array(num_draft_tokens) + 1
        cu_num_sampled_tokens = np.cumsum(num_sampled_tokens)
        logits_indices = np.concatenate([np.arange(end - n, end) for end, n
                                         in zip(cu_num_scheduled_tokens, num_sampled_tokens)])
        bonus_logits_indices = cu_num_sampled_tokens - 1
        target_logits_indices = np.concatenate([np.arange(start, start + n) for start, n
                                                in zip(cu_num_sampled_tokens - num_sampled_tokens, num_draft_tokens)])
        # Compute the draft token ids.
        draft_token_ids = self.input_ids[torch.from_numpy(logits_indices).to(self.device)]
        draft_token_ids = draft_token_ids[torch.from_numpy(target_logits_indices + 1).to(self.device)]
        return SpecDecodeMetadata(
            draft_token_ids=draft_token_ids, num_draft_tokens=list(num_draft_tokens),
            cu_num_draft_tokens=torch.from_numpy(np.cumsum(num_draft_tokens)).to(self.device),
            target_logits_indices=torch.from_numpy(target_logits_indices).to(self.device),
            bonus_logits_indices=torch.from_numpy(bonus_logits_indices).to(self.device),
            logits_indices=torch.from_numpy(logits_indices).to(self.device))

    def _prepare_inputs(self, reqs):
        num_reqs = len(reqs)
        ids, pos, slots, num_scheduled, num_draft_tokens = [], [], [], [], []
        for i, r in enumerate(reqs):
            if r.num_computed_tokens == 0:
                tokens = r.prompt_token_ids
            else:
                tokens = [r.all_token_ids[-1]] + r.spec_token_ids
            num_draft_tokens.append(len(r.spec_token_ids) if r.num_computed_tokens else 0)
            p = list(range(r.num_computed_tokens, r.num_computed_tokens + len(tokens)))
            ids += tokens
            pos += p
            slots += [r.block_ids[x // BLOCK_SIZE] * BLOCK_SIZE + x % BLOCK_SIZE for x in p]
            num_scheduled.append(len(tokens))
            self.block_table[i] = torch.tensor(r.block_ids)
        total_num_scheduled_tokens = sum(num_scheduled)
        cu_num_tokens = np.cumsum(num_scheduled)
        seq_lens = [r.num_computed_tokens + n for r, n in zip(reqs, num_scheduled)]
        self.input_ids[:total_num_scheduled_tokens] = torch.tensor(ids)
        self.positions[:total_num_scheduled_tokens] = torch.tensor(pos)
        self.slot_mapping[:total_num_scheduled_tokens] = torch.tensor(slots)
        # Fill unused with -1. Needed for reshape_and_cache in full cuda graph mode.
        self.slot_mapping[total_num_scheduled_tokens:].fill_(-1)
        query_start_loc_cpu = torch.from_numpy(np.concatenate([[0], cu_num_tokens])).to(torch.int32)
        seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int32)
        self.query_start_loc[: num_reqs + 1] = query_start_loc_cpu
        self.seq_lens[:num_reqs] = seq_lens_cpu
        common_attn_metadata = CommonAttentionMetadata(
            query_start_loc=self.query_start_loc[: num_reqs + 1], query_start_loc_cpu=query_start_loc_cpu,
            seq_lens=self.seq_lens[:num_reqs], seq_lens_cpu=seq_lens_cpu,
            num_computed_tokens_cpu=torch.tensor([r.num_computed_tokens for r in reqs], dtype=torch.int32),
            num_reqs=num_reqs, num_actual_tokens=total_num_scheduled_tokens, max_query_len=max(num_scheduled),
            max_seq_len=max(seq_lens), block_table_tensor=self.block_table[:num_reqs],
            slot_mapping=self.slot_mapping[:total_num_scheduled_tokens])
        if sum(num_draft_tokens) == 0:
            spec_decode_metadata = None
            logits_indices = torch.from_numpy(cu_num_tokens - 1).to(self.device)
        else:
            spec_decode_metadata = self._calc_spec_decode_metadata(num_draft_tokens, cu_num_tokens)
            logits_indices = spec_decode_metadata.logits_indices
        return common_attn_metadata, total_num_scheduled_tokens, logits_indices, spec_decode_metadata

    def execute_model(self, reqs):
        common_attn_metadata, num_scheduled_tokens, logits_indices, spec_decode_metadata = self._prepare_inputs(reqs)
        if self.use_cuda_graph and num_scheduled_tokens <= CUDAGRAPH_CAPTURE_SIZES[-1]:
            num_input_tokens = pad_for_cudagraph(num_scheduled_tokens)
            cudagraph_runtime_mode = CUDAGraphMode.PIECEWISE
        else:
            num_input_tokens = num_scheduled_tokens
            cudagraph_runtime_mode = CUDAGraphMode.NONE
        attn_metadata = {self.model.attn.layer_name: self.attn_metadata_builder.build(0, common_attn_metadata)}
        with set_forward_context(attn_metadata, num_tokens=num_input_tokens,
                                 cudagraph_runtime_mode=cudagraph_runtime_mode):
            hidden_states = self.compiled_model(self.input_ids[:num_input_tokens], self.positions[:num_input_tokens])
        logits = self.model.compute_logits(hidden_states[logits_indices])
        if spec_decode_metadata is None:
            sampled_token_ids = logits.argmax(dim=-1).view(-1, 1)
        else:
            sampled_token_ids = rejection_sample_greedy(spec_decode_metadata, logits, len(reqs))
        draft_token_ids = self.propose_draft_token_ids(num_scheduled_tokens, sampled_token_ids, hidden_states,
                                                       spec_decode_metadata, common_attn_metadata)
        for i, r in enumerate(reqs):           # update the request states
            valid = [t for t in sampled_token_ids[i].tolist() if t != PLACEHOLDER_TOKEN_ID]
            num_rejected = len(r.spec_token_ids) + 1 - len(valid) if r.num_computed_tokens else 0
            num_scheduled = len(r.prompt_token_ids) if r.num_computed_tokens == 0 else 1 + len(r.spec_token_ids)
            r.num_computed_tokens += num_scheduled - num_rejected
            r.output_token_ids += valid
            r.spec_token_ids = draft_token_ids[i].tolist()
        return logits.clone(), draft_token_ids.to(DTYPE)

    def propose_draft_token_ids(self, num_scheduled_tokens, sampled_token_ids, hidden_states, spec_decode_metadata,
                                common_attn_metadata):
        next_token_ids, valid_sampled_tokens_count = self.drafter.prepare_next_token_ids_padded(
            common_attn_metadata, sampled_token_ids)
        if spec_decode_metadata is None:
            token_indices_to_sample = None
            target_token_ids = self.input_ids[:num_scheduled_tokens]
            target_positions = self.positions[:num_scheduled_tokens]
            target_hidden_states = hidden_states[:num_scheduled_tokens]
        else:
            common_attn_metadata, token_indices, token_indices_to_sample = self.drafter.prepare_inputs_padded(
                common_attn_metadata, spec_decode_metadata, valid_sampled_tokens_count)
            target_token_ids = self.input_ids[token_indices]
            target_positions = self.positions[token_indices]
            target_hidden_states = hidden_states[token_indices]
        return self.drafter.propose(
            target_token_ids=target_token_ids, target_positions=target_positions,
            target_hidden_states=target_hidden_states, next_token_ids=next_token_ids,
            last_token_indices=token_indices_to_sample, common_attn_metadata=common_attn_metadata)


# --- the workload --------------------------------------------------------------------------------------------------

def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(284)
    prompts = {k: torch.randint(0, VOCAB, (4,), generator=gen).tolist() for k in ("A", "B")}
    num_steps = 5                                       # 1 prefill (8 tokens) + 4 decode steps (6 tokens each)

    def serve(use_cuda_graph):
        runner = GPUModelRunner(device, use_cuda_graph)
        if use_cuda_graph:
            runner.capture_model()
        reqs = [CachedRequestState(k, list(prompts[k]), [1 + i * BLOCKS_PER_REQ + b for b in range(BLOCKS_PER_REQ)])
                for i, k in enumerate(("A", "B"))]
        outs = []
        for _ in range(num_steps):
            outs.extend(runner.execute_model(reqs))
        return outs

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
