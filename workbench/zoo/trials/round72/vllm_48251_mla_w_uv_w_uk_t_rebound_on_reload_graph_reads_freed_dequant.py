"""Every post-load pass of standard MLA rebinds ``W_UV`` / ``W_UK_T`` to a freshly dequantized tensor; after an RL weight reload the FULL decode graph keeps reading the released old one.

Upstream: https://github.com/vllm-project/vllm/pull/48251 ("[Bugfix][Attention] Preserve post-load tensors across
weight reloads", vllm-project/vllm, merged; opened 2026-07-10, part of RFC #48312 "Weight Reload Correctness for RL").
Symptom: with CUDA graphs on, decode after an RL weight sync (``reload_weights`` / layerwise reload) of an FP8
DeepSeek-style MLA model is wrong: the graph's up-projections use the pre-reload absorbed weights, whatever the
allocator put in their released block, or (after a level-2 sleep) a remapped allocation whose contents were never
restored. ``enforce_eager`` is correct.
Mechanism: ``MLAAttention.process_weights_after_loading`` (vllm/model_executor/layers/attention/mla_attention.py)
derives the absorbed decode weights from ``kv_b_proj``: ``get_and_maybe_dequant_weights(self.kv_b_proj,
out_dtype=act_dtype).T`` is viewed as ``(L, N, P + V)`` and split into ``W_UK`` / ``W_UV``; before the fix it ended
with the plain attribute rebinds ``self.W_UV = W_UV.transpose(0, 1)`` and ``self.W_UK_T = W_UK.permute(1, 2, 0)``.
For an ``Fp8LinearMethod`` ``kv_b_proj``, ``scaled_dequantize`` returns a new tensor on every call, so both
attributes are views of a fresh allocation each time. The FULL decode graph is captured after the initial load:
its ``torch.bmm(mqa_q_nope, self.W_UK_T, ...)`` in ``forward_impl`` and ``torch.bmm(x, self.W_UV, ...)`` in
``_v_up_proj`` record that allocation's address. ``reload_weights`` runs the layerwise reload
(model_loader/reload/layerwise.py): linears are materialized, loaded and copied back into their captured storage
(``_copy_and_restore_kernel_tensors``), and ``finalize_layerwise_reload`` re-runs the deferred attention layers'
``process_weights_after_loading``. That pass dequantizes the new ``kv_b_proj`` into a new tensor and rebinds
``W_UV`` / ``W_UK_T``; being plain attributes, they are outside the layerwise copy-back, so the old dequantized
tensor loses its last references and is released while the graph still reads it. Eager reads the new attributes.
Doctor: dangling-reference, at process_weights_after_loading (MLAAttention's: on each post-load pass it rebinds
``W_UV`` / ``W_UK_T`` to views of a new dequantized tensor, dropping the last reference to the storage the captured
decode bmm's read, so every replay after the reload reads memory whose owner released it).
Fix (upstream): ``replace_parameter(self, "W_UV", w_uv, prefer_copy=True)`` and ``replace_parameter(self, "W_UK_T",
w_uk_t, prefer_copy=True)``: the first load registers them as Parameters (so the layerwise reload snapshots and
re-places them before the deferred pass), and a later pass with the same shape/dtype/device copies the new values
into the existing storage, keeping ``data_ptr()`` fixed. (The same PR's FlashInfer sinks change is not graph-only and
is not modelled.)
Modelled: a 2-layer DeepSeek-V2-style model with MLA attention only (no MLP/MoE, no RoPE on ``q_pe``/``k_pe``), TP 1,
a Triton-MLA-like ``forward_mqa`` over one cache block of ``MAX_MODEL_LEN`` slots per request, every step a FULL
decode of ``MAX_NUM_SEQS`` requests (one-token prompts, so no prefill / ``forward_mha`` path). ``kv_b_proj`` is a
block-FP8 ``Fp8LinearMethod`` linear (128x128 blocks as 4x4; its own post-load step is left out); the other linears
are unquantized. The layerwise reload is cut to what matters here: the per-layer snapshot of registered tensors,
the restore to checkpoint layout (materialized at once, not via meta), the online loader, the copy-back, and the
deferred attention pass. ``replace_parameter`` keeps only its copy-or-register logic. Released blocks are handed to
the next same-size allocation (``reuse_freed_blocks`` on the CPU; the caching allocator on CUDA), and whatever the
block then holds, it is not the new absorbed weights.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import Parameter

from workbench.engine import reuse_freed_blocks
from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/48251"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "process_weights_after_loading"
SYMPTOM = "after an RL weight reload the FULL decode graph's MLA bmm's read the released old W_UV/W_UK_T"

VOCAB, HIDDEN, NUM_LAYERS = 32, 16, 2
NUM_HEADS, QK_NOPE_HEAD_DIM, QK_ROPE_HEAD_DIM, V_HEAD_DIM, KV_LORA_RANK = 2, 4, 2, 4, 8
MAX_NUM_SEQS, MAX_MODEL_LEN = 3, 8
WEIGHT_BLOCK_SIZE = [4, 4]                  # DeepSeek FP8 checkpoints: [128, 128]
FP8 = torch.float8_e4m3fn
ACT_DTYPE = torch.float32
EPS = 1e-6


class ModelConfig:
    dtype = ACT_DTYPE


# --- vllm/model_executor/utils.py -------------------------------------------------------------------

def replace_parameter(layer: nn.Module, param_name: str, new_tensor: torch.Tensor, prefer_copy: bool = False):
    """Replace a parameter of a layer while maintaining the ability to reload the weight."""
    old_param = getattr(layer, param_name, None)
    if isinstance(new_tensor, Parameter):
        new_tensor = new_tensor.data
    if (prefer_copy and old_param is not None and old_param.shape == new_tensor.shape
            and old_param.dtype == new_tensor.dtype and old_param.device == new_tensor.device):
        old_param.copy_(new_tensor)                    # same storage: data_ptr() unchanged
        return
    setattr(layer, param_name, Parameter(new_tensor, requires_grad=False))


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    param.data.copy_(loaded_weight)


# --- vllm/model_executor/layers/quantization/utils/quant_utils.py ----------------------------------------

def group_broadcast(t, shape):
    for i, s in enumerate(shape):
        if t.shape[i] != s and t.shape[i] != 1:
            t = t.repeat_interleave(s // t.shape[i], dim=i)
    return t


def scaled_dequantize(x_q, x_s, group_shape=None, out_dtype=torch.float32):
    x_s = group_broadcast(x_s.to(torch.float32), x_q.shape)
    return (x_q.to(torch.float32) * x_s).to(out_dtype)


def get_and_maybe_dequant_weights(layer, out_dtype=torch.float32):
    """Return layer's unquantized weights in [out, in] layout"""
    weight = layer.weight
    if layer.quant_method is None:                     # UnquantizedLinearMethod: the weight itself
        return weight.to(out_dtype)
    # Simple Fp8 case (no Marlin): rescale with the block weight scales -- a new tensor every call
    dequant_weights = scaled_dequantize(weight, layer.weight_scale_inv, group_shape=layer.weight_block_size,
                                        out_dtype=out_dtype)
    if not layer.quant_method.block_quant:
        dequant_weights = dequant_weights.T
    return dequant_weights


class Fp8LinearMethod:
    def __init__(self, weight_block_size):
        self.weight_block_size = weight_block_size
        self.block_quant, self.use_marlin = True, False

    def create_weights(self, layer, input_size, output_size, device):
        bs_n, bs_k = self.weight_block_size
        layer.weight = Parameter(torch.empty(output_size, input_size, dtype=FP8, device=device), requires_grad=False)
        layer.weight_scale_inv = Parameter(torch.empty(output_size // bs_n, input_size // bs_k, device=device),
                                           requires_grad=False)
        layer.weight_block_size = self.weight_block_size


# --- layers ------------------------------------------------------------------------------------------

class ReplicatedLinear(nn.Module):
    def __init__(self, input_size, output_size, device, quant_method=None):
        super().__init__()
        self.input_size_per_partition, self.output_size = input_size, output_size
        self.quant_method = quant_method
        if quant_method is None:
            self.weight = Parameter(torch.empty(output_size, input_size, device=device), requires_grad=False)
        else:
            quant_method.create_weights(self, input_size, output_size, device)

    def forward(self, x):
        return x @ self.weight.t()                     # (only unquantized linears run in decode)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, device):
        super().__init__()
        self.weight = Parameter(torch.empty(hidden_size, device=device), requires_grad=False)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * self.weight


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings, embedding_dim, device):
        super().__init__()
        self.weight = Parameter(torch.empty(num_embeddings, embedding_dim, device=device), requires_grad=False)

    def forward(self, input_ids):
        return self.weight[input_ids]


class CommonAttentionMetadata:
    def __init__(self, slot_mapping, seq_lens):
        self.slot_mapping, self.seq_lens = slot_mapping, seq_lens


# --- vllm/model_executor/layers/attention/mla_attention.py ----------------------------------------------

class MLAAttention(nn.Module):
    def __init__(self, num_heads, scale, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank,
                 kv_b_proj, variant):
        super().__init__()
        self.num_heads, self.scale = num_heads, scale
        self.qk_nope_head_dim, self.qk_rope_head_dim = qk_nope_head_dim, qk_rope_head_dim
        self.v_head_dim, self.kv_lora_rank = v_head_dim, kv_lora_rank
        self.kv_b_proj = kv_b_proj
        self.variant = variant                          # (which vLLM: before/after #48251)

    def forward(self, q, kv_c_normed, k_pe, kv_cache, attn_metadata, output):
        self.do_kv_cache_update(kv_c_normed, k_pe, kv_cache, attn_metadata.slot_mapping)
        return self.forward_impl(q, kv_cache, attn_metadata, output)

    @staticmethod
    def do_kv_cache_update(kv_c_normed, k_pe, kv_cache, slot_mapping):
        kv_cache.index_copy_(0, slot_mapping, torch.cat([kv_c_normed, k_pe], dim=-1))

    def forward_impl(self, q, kv_cache, attn_metadata, output):
        # decode (MQA) path only: every token of a FULL decode batch is a decode token
        mqa_q_nope, mqa_q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        # Convert from (B, N, P) to (N, B, P)
        mqa_q_nope = mqa_q_nope.transpose(0, 1)
        N, B, P = mqa_q_nope.shape
        _, _, L = self.W_UK_T.shape
        mqa_ql_nope = mqa_q_nope.new_empty((N, B, L))
        # Multiply (N, B, P) x (N, P, L) -> (N, B, L)
        torch.bmm(mqa_q_nope, self.W_UK_T, out=mqa_ql_nope)
        # Convert from (N, B, L) to (B, N, L)
        mqa_ql_nope = mqa_ql_nope.transpose(0, 1)
        attn_out = self.forward_mqa((mqa_ql_nope, mqa_q_pe), kv_cache, attn_metadata)
        # v_up projection
        self._v_up_proj(attn_out, out=output)
        return output

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata):
        """The decode kernel: MQA over the latent cache (one block of MAX_MODEL_LEN slots per request)."""
        ql_nope, q_pe = q
        B = ql_nope.shape[0]
        cache = kv_c_and_k_pe_cache.view(B, MAX_MODEL_LEN, self.kv_lora_rank + self.qk_rope_head_dim)
        kv_c, k_pe = cache.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        scores = (ql_nope @ kv_c.transpose(1, 2) + q_pe @ k_pe.transpose(1, 2)) * self.scale   # (B, N, T)
        past_end = torch.arange(MAX_MODEL_LEN, device=ql_nope.device)[None, :] >= attn_metadata.seq_lens[:, None]
        probs = torch.softmax(scores.masked_fill(past_end[:, None, :], float("-inf")), dim=-1)
        return probs @ kv_c                                                                     # (B, N, L)

    def process_weights_after_loading(self, act_dtype: torch.dtype):
        # we currently do not have quantized bmm's which are needed for
        # `W_UV` and `W_UK_T`, we just store fp16/bf16 copies and perform
        # the bmm's in 16-bit, the extra memory overhead of this is fairly low
        kv_b_proj_weight = get_and_maybe_dequant_weights(self.kv_b_proj, out_dtype=act_dtype).T
        assert kv_b_proj_weight.shape == (
            self.kv_lora_rank, self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)), f"{kv_b_proj_weight.shape=}"
        kv_b_proj_weight = kv_b_proj_weight.view(
            self.kv_lora_rank, self.num_heads, self.qk_nope_head_dim + self.v_head_dim)
        W_UK, W_UV = kv_b_proj_weight.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        if self.variant == "bug":
            # Convert from (L, N, V) to (N, L, V)
            self.W_UV = W_UV.transpose(0, 1)
            # Convert from (L, N, P) to (N, P, L)
            self.W_UK_T = W_UK.permute(1, 2, 0)
        else:
            # (L, N, V) -> (N, L, V)
            w_uv = W_UV.transpose(0, 1)
            replace_parameter(self, "W_UV", w_uv, prefer_copy=True)
            # (L, N, P) -> (N, P, L)
            w_uk_t = W_UK.permute(1, 2, 0)
            replace_parameter(self, "W_UK_T", w_uk_t, prefer_copy=True)

    def _v_up_proj(self, x: torch.Tensor, out: torch.Tensor):
        # Convert from (B, N, L) to (N, B, L)
        x = x.view(-1, self.num_heads, self.kv_lora_rank).transpose(0, 1)
        out = out.view(-1, self.num_heads, self.v_head_dim)
        # Multiply + Transpose (N, B, L) x (N, L, V)->(N, B, V)->(B, N, V)
        torch.bmm(x, self.W_UV, out=out.transpose(0, 1))


# --- vllm/model_executor/models/deepseek_v2.py -----------------------------------------------------------

class DeepseekV2MLAAttention(nn.Module):
    def __init__(self, device, variant):
        super().__init__()
        N, P, R, V, L = NUM_HEADS, QK_NOPE_HEAD_DIM, QK_ROPE_HEAD_DIM, V_HEAD_DIM, KV_LORA_RANK
        self.q_proj = ReplicatedLinear(HIDDEN, N * (P + R), device)
        self.kv_a_proj_with_mqa = ReplicatedLinear(HIDDEN, L + R, device)
        self.kv_a_layernorm = RMSNorm(L, device)
        self.kv_b_proj = ReplicatedLinear(L, N * (P + V), device, quant_method=Fp8LinearMethod(WEIGHT_BLOCK_SIZE))
        self.o_proj = ReplicatedLinear(N * V, HIDDEN, device)
        self.mla_attn = MLAAttention(N, (P + R) ** -0.5, P, R, V, L, self.kv_b_proj, variant)

    def forward(self, hidden_states, kv_cache, attn_metadata):
        q = self.q_proj(hidden_states).view(-1, NUM_HEADS, QK_NOPE_HEAD_DIM + QK_ROPE_HEAD_DIM)
        kv_c, k_pe = self.kv_a_proj_with_mqa(hidden_states).split([KV_LORA_RANK, QK_ROPE_HEAD_DIM], dim=-1)
        kv_c_normed = self.kv_a_layernorm(kv_c)
        output = torch.empty(hidden_states.shape[0], NUM_HEADS * V_HEAD_DIM, device=hidden_states.device)
        self.mla_attn(q, kv_c_normed, k_pe, kv_cache, attn_metadata, output)
        return self.o_proj(output)


class DeepseekV2DecoderLayer(nn.Module):
    def __init__(self, device, variant):
        super().__init__()
        self.input_layernorm = RMSNorm(HIDDEN, device)
        self.self_attn = DeepseekV2MLAAttention(device, variant)

    def forward(self, hidden_states, kv_cache, attn_metadata):
        return hidden_states + self.self_attn(self.input_layernorm(hidden_states), kv_cache, attn_metadata)


class DeepseekV2ForCausalLM(nn.Module):
    def __init__(self, device, variant):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(VOCAB, HIDDEN, device)
        self.layers = nn.ModuleList([DeepseekV2DecoderLayer(device, variant) for _ in range(NUM_LAYERS)])
        self.norm = RMSNorm(HIDDEN, device)
        self.lm_head = ReplicatedLinear(HIDDEN, VOCAB, device)

    def forward(self, input_ids, kv_caches, attn_metadata):
        hidden_states = self.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden_states = layer(hidden_states, kv_cache, attn_metadata)
        return self.lm_head(self.norm(hidden_states))

    def load_weights(self, weights):
        params_dict = dict(self.named_parameters())
        for name, loaded_weight in weights:
            param = params_dict[name]
            weight_loader = getattr(param, "weight_loader", default_weight_loader)
            weight_loader(param, loaded_weight)


# --- vllm/model_executor/model_loader/reload/layerwise.py (cut down) -------------------------------------

class LayerReloadingInfo:
    def __init__(self, restore_metadata, restore_device):
        self.restore_metadata, self.restore_device = restore_metadata, restore_device
        self.reset()

    def reset(self):
        self.kernel_tensors = None
        self.load_numel = self.load_numel_total = 0


LAYERWISE_INFO: dict = {}


def record_metadata_for_reloading(model: nn.Module, device):
    for layer in model.modules():
        LAYERWISE_INFO[layer] = LayerReloadingInfo(
            {name: (p.shape, p.dtype) for name, p in layer.named_parameters(recurse=False)}, device)


def initialize_layerwise_reload(model: nn.Module):
    for layer in model.modules():
        info = LAYERWISE_INFO[layer]
        # Save current tensors for later copying
        info.kernel_tensors = dict(layer.named_parameters(recurse=False))
        # Restore layer parameters in checkpoint layout (upstream: on meta, materialized at processing)
        restore_layer_on_meta(layer, info)
        info.load_numel_total = sum(math.prod(shape) for shape, _ in info.restore_metadata.values())
        for name, param in layer.named_parameters(recurse=False):
            param.weight_loader = make_online_process_loader(layer)


def restore_layer_on_meta(layer: nn.Module, info: LayerReloadingInfo):
    for name in list(layer._parameters):
        delattr(layer, name)
    for name, (shape, dtype) in info.restore_metadata.items():
        layer.register_parameter(name, Parameter(torch.empty(shape, dtype=dtype, device=info.restore_device),
                                                 requires_grad=False))


def make_online_process_loader(layer: nn.Module):
    info = LAYERWISE_INFO[layer]

    def online_process_loader(param, loaded_weight):
        default_weight_loader(param, loaded_weight)
        info.load_numel += loaded_weight.numel()
        # Do not online process attention layers, must wait until finalize
        if isinstance(layer, MLAAttention):
            return
        if info.load_numel >= info.load_numel_total:
            _layerwise_process(layer, info)

    return online_process_loader


def _layerwise_process(layer: nn.Module, info: LayerReloadingInfo):
    # (quant_method.process_weights_after_loading: nothing for block FP8 without DeepGEMM, see Modelled)
    # Copy processed values into original tensor storage (preserves cudagraph refs)
    _copy_and_restore_kernel_tensors(layer, info)
    info.reset()


def _copy_and_restore_kernel_tensors(layer: nn.Module, info: LayerReloadingInfo):
    for name, param in info.kernel_tensors.items():
        loaded_param = getattr(layer, name)
        if param.data_ptr() != loaded_param.data_ptr():
            param.data.copy_(loaded_param)
    _place_kernel_tensors(layer, info)


def _place_kernel_tensors(layer: nn.Module, info: LayerReloadingInfo):
    for name in list(layer._parameters):
        delattr(layer, name)
    for name, param in info.kernel_tensors.items():
        layer.register_parameter(name, param)


def finalize_layerwise_reload(model: nn.Module, model_config: ModelConfig):
    deferred_attn = []
    for layer in model.modules():
        info = LAYERWISE_INFO[layer]
        if info.kernel_tensors is None:                # already processed layerwise
            continue
        # Attention/MLA layers are processed after all other layers
        if isinstance(layer, MLAAttention):
            deferred_attn.append((layer, info))
            continue
        _place_kernel_tensors(layer, info)             # nothing loaded (containers)
        info.reset()
    for layer, info in deferred_attn:                  # _finalize_attention_layer
        _place_kernel_tensors(layer, info)
        layer.process_weights_after_loading(model_config.dtype)
        info.reset()


# --- the engine: loader, model runner --------------------------------------------------------------------

class DefaultModelLoader:
    def load_model(self, model, weights, model_config):
        model.load_weights(weights)
        for module in model.modules():                 # process_weights_after_loading(model, ...): attention last
            if isinstance(module, MLAAttention):
                module.process_weights_after_loading(model_config.dtype)


class GPUModelRunner:
    def __init__(self, model, device):
        self.model, self.device, self.model_config = model, device, ModelConfig()
        self.input_ids = torch.zeros(MAX_NUM_SEQS, dtype=torch.long, device=device)
        self.positions = torch.zeros(MAX_NUM_SEQS, dtype=torch.long, device=device)
        self.slot_mapping = torch.arange(MAX_NUM_SEQS, device=device) * MAX_MODEL_LEN
        self.seq_lens = torch.ones(MAX_NUM_SEQS, dtype=torch.long, device=device)
        self.kv_caches = [torch.zeros(MAX_NUM_SEQS * MAX_MODEL_LEN, KV_LORA_RANK + QK_ROPE_HEAD_DIM, device=device)
                          for _ in range(NUM_LAYERS)]
        self.cudagraph = self.cudagraph_output = None

    def _model_forward(self):
        return self.model(self.input_ids, self.kv_caches, CommonAttentionMetadata(self.slot_mapping, self.seq_lens))

    def capture_model(self):
        """CUDAGraphMode.FULL: one decode graph at the (only) batch size."""
        self.cudagraph, self.cudagraph_output = capture(
            self._model_forward, device=self.device, name=f"FULL decode bs={MAX_NUM_SEQS}", owner="GPUModelRunner",
            static={"input_ids": self.input_ids, "positions": self.positions, "slot_mapping": self.slot_mapping,
                    "seq_lens": self.seq_lens},
            state={f"kv_caches[{i}]": c for i, c in enumerate(self.kv_caches)}, on_freed="reuse")

    def _prepare_inputs(self, token_ids, positions):
        pos = torch.tensor(positions, dtype=torch.long)
        self.input_ids.copy_(torch.tensor(token_ids, dtype=torch.long))
        self.positions.copy_(pos)
        self.seq_lens.copy_(pos + 1)
        self.slot_mapping.copy_(torch.arange(MAX_NUM_SEQS) * MAX_MODEL_LEN + pos)

    @torch.no_grad()
    def execute_model(self, token_ids, positions):
        self._prepare_inputs(token_ids, positions)
        if self.cudagraph is not None:
            logits = replay(self.cudagraph, self.cudagraph_output)
        else:
            logits = self._model_forward()
        return logits.clone()

    @torch.no_grad()
    def reload_weights(self, weights):
        """RL weight sync: layerwise reload, graphs kept (no recapture)."""
        initialize_layerwise_reload(self.model)
        self.model.load_weights(weights)
        finalize_layerwise_reload(self.model, self.model_config)


def make_checkpoint(names_shapes, seed, device):
    """The trainer's weights: block-FP8 ``kv_b_proj`` (codes + ``weight_scale_inv``), the rest unquantized."""
    gen = generator(seed)
    weights = []
    for name, shape, dtype in names_shapes:
        if dtype == FP8:
            w = (torch.randn(*shape, generator=gen) * 6).to(FP8)
        elif name.endswith("weight_scale_inv"):
            w = torch.rand(*shape, generator=gen) * 0.04 + 0.02
        elif "norm" in name:
            w = 1 + 0.1 * torch.randn(*shape, generator=gen)
        elif "embed" in name:
            w = torch.randn(*shape, generator=gen)
        else:
            w = torch.randn(*shape, generator=gen) * shape[-1] ** -0.5
        weights.append((name, w.to(device)))
    return weights


def run(variant: str, device: str = "cpu"):
    gen = generator(48251)
    prompts = [torch.randint(0, VOCAB, (MAX_NUM_SEQS,), generator=gen).tolist() for _ in range(2)]

    def rollout(runner, first_tokens, steps):
        tokens, outs = list(first_tokens), []
        for pos in range(steps):                       # greedy decode of MAX_NUM_SEQS requests
            logits = runner.execute_model(tokens, [pos] * MAX_NUM_SEQS)
            outs.append(logits)
            tokens = logits.argmax(-1).tolist()
        return outs

    def serve(graphed: bool):
        model = DeepseekV2ForCausalLM(device, variant)
        record_metadata_for_reloading(model, device)
        names = [(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()]
        DefaultModelLoader().load_model(model, make_checkpoint(names, 0, device), ModelConfig())
        runner = GPUModelRunner(model, device)
        if graphed:
            runner.capture_model()
        outs = rollout(runner, prompts[0], 3)
        runner.reload_weights(make_checkpoint(names, 1, device))    # the trainer's update
        outs += rollout(runner, prompts[1], 4)                      # next rollouts on the new policy
        return outs

    def served():
        with reuse_freed_blocks():       # a released block goes to the next allocation of its size
            return serve(True)

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, lambda: serve(False))
