"""An HPU graph around mllama's language model alone reads the attention metadata of the forward context at
capture: every replay attends and writes the KV cache with the capture step's block usage and slots.

Upstream: https://github.com/HabanaAI/vllm-fork/pull/1255 ("fix llama3.2 HPUGraph mode acc problem after
rebase", commit 80c267be5, fixes vllm-fork issue #1219).
Symptom: after the rebase commit 09332dcd, Llama-3.2 Vision (mllama) gave wrong output in HPUGraph mode
(lazy mode with graphs); eager mode was right. "After this PR, the output under HPUGraph mode will become
correct."
Mechanism: ``HpuModelAdapterEncoderDecoder.__init__`` wrapped only ``self.model.language_model`` in
``htorch.hpu.wrap_in_hpu_graph(..., disable_tensor_cache=True)`` ("some Ops in vision model will fallback
to CPU"), and ``HPUEncoderDecoderModelRunner._maybe_wrap_in_hpu_graph`` returned the adapter unwrapped. The
adapter's ``forward`` pops ``attn_metadata`` and installs it with ``set_forward_context`` around
``self.model(...)``. The rebase removed ``attn_metadata`` from mllama's forward arguments, so the graphed
language model's attention now gets its metadata (``block_list``, ``block_mapping``, ``attn_bias``,
``slot_mapping``) only through ``get_forward_context()``: not an argument, so not a graph input (the wrapper
hashes and copies only the arguments). The graph captured at a bucket's first call keeps reading the
metadata tensors of that call; later decode steps of the same bucket (same shapes, so the same graph)
replay with the capture step's slots and block usage: new keys overwrite the capture step's cache slot and
attention masks out every token after it.
Doctor: warmup-divergence, at ``unified_attention`` (it reads ``get_forward_context().attn_metadata``
inside the captured language model; the capture took the tensor references that replays reuse, while an
eager step reads the step's own metadata).
Fix (upstream): remove the inner wrap and the ``partial(forward, bypass_hpu_graphs=...)`` patch;
``_maybe_wrap_in_hpu_graph`` wraps the whole ``HpuModelAdapterEncoderDecoder`` (as the decoder-only runner
does), whose ``forward`` receives ``attn_metadata`` as an argument, so its tensors are graph inputs copied
at every replay (and ``_update_metadata`` runs inside the graph). The diff was read, and the habana
``wrapped_hpugraph_forward`` source (input hash, ``copy_to``, dry-run replay after capture).
Simplifications: HPU graphs are modelled with CUDA-graph semantics: a cached graph per input hash, inputs
copied into the capture's static clones (the ``copy_to`` path), one replay right after capture (the dry
run). What the capture read outside its arguments stays alive here (the graph's tensor cache, modelled as
the forward context's tensors at capture), so replays read the capture step's values; with vLLM's
``disable_tensor_cache=True`` Habana may instead replace those tensors after the dry run (garbage instead of
stale metadata) -- not checked. Text-only decode of two requests (cross-attention skipped, as upstream when
``max(encoder_seq_lens) == 0``); one self-attention layer with flat paged attention; ``one_hot`` written
as a comparison; no prompt phase (each request starts decoding at position 0).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from collections import namedtuple
from functools import partial

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/HabanaAI/vllm-fork/pull/1255"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "unified_attention"
SYMPTOM = "mllama decode in HPUGraph mode attends/writes KV with the capture step's metadata (wrong output)"

VOCAB, HIDDEN, BLOCK_SIZE, NUM_BLOCKS = 16, 8, 2, 5        # block 0 is the pad block
BATCH, BLOCKS_PER_SEQ = 2, 2
SEQ_BLOCKS = [[1, 2], [3, 4]]
TOKENS = [[5, 9], [2, 11], [14, 3], [7, 7]]                # decode tokens per step, one per request

TrimmedAttentionMetadata = namedtuple("TrimmedAttentionMetadata", [
    "block_list", "block_groups", "block_usage", "block_mapping", "attn_bias", "slot_mapping",
    "encoder_seq_lens", "encoder_seq_lens_tensor", "is_prompt", "block_size"])


# ---------------------------------------------------------------- vllm/forward_context.py
@dataclasses.dataclass
class ForwardContext:
    no_compile_layers: dict
    attn_metadata: object
    virtual_engine: int


_forward_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    assert _forward_context is not None, "Please use `set_forward_context` to set the forward context."
    return _forward_context


@contextlib.contextmanager
def set_forward_context(attn_metadata, vllm_config, virtual_engine=0):
    global _forward_context
    prev_context = _forward_context
    _forward_context = ForwardContext(vllm_config["static_forward_context"], attn_metadata, virtual_engine)
    try:
        yield
    finally:
        _forward_context = prev_context


# ------------------------------------------ habana_frameworks/torch/hpu/graphs.py (modelled)
class CachedParams:
    def __init__(self, graph_inputs, graph_outputs, graph, tensor_cache):
        self.graph_inputs, self.graph_outputs, self.graph = graph_inputs, graph_outputs, graph
        self.tensor_cache = tensor_cache


def input_hash(obj):
    if isinstance(obj, dict):
        return input_hash(tuple(obj.items()))
    elif isinstance(obj, (list, tuple)):
        return hash(tuple(input_hash(el) for el in obj))
    elif torch.is_tensor(obj):
        return hash((obj.shape, obj.dtype))
    else:
        return hash(obj)


def copy_to(dst, src):
    assert type(dst) is type(src)
    if isinstance(dst, dict):
        for (dk, dv), (sk, sv) in zip(dst.items(), src.items()):
            assert dk == sk
            copy_to(dv, sv)
    elif isinstance(dst, (list, tuple)):
        for d, s in zip(dst, src):
            copy_to(d, s)
    elif torch.is_tensor(dst):
        dst.copy_(src, non_blocking=True)


def extract_tensors(data, path="", found=None):
    found = {} if found is None else found
    if torch.is_tensor(data):
        found[path] = data
    elif isinstance(data, dict):
        for k, v in data.items():
            extract_tensors(v, f"{path}.{k}" if path else str(k), found)
    elif isinstance(data, tuple) and hasattr(data, "_fields"):
        for k, v in zip(data._fields, data):
            extract_tensors(v, f"{path}.{k}", found)
    elif isinstance(data, (list, tuple)):
        for i, v in enumerate(data):
            extract_tensors(v, f"{path}[{i}]", found)
    return found


def _static_clone(obj):
    if torch.is_tensor(obj):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _static_clone(v) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_static_clone(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_static_clone(v) for v in obj)
    return obj


def wrap_in_hpu_graph(module, disable_tensor_cache=False, *, device, state):
    """A graph per input hash: captured at the first call, replayed (inputs copied in) at later ones."""
    cache = {}
    orig_fwd = module.forward

    def forward(*args, **kwargs):
        if kwargs.pop("bypass_hpu_graphs", False):
            return orig_fwd(*args, **kwargs)
        inputs = (args, kwargs)
        h = input_hash(inputs)
        cached = cache.get(h)
        if cached is None:
            graph_inputs = _static_clone(inputs)
            graph, outputs = capture(lambda: orig_fwd(*graph_inputs[0], **graph_inputs[1]), device=device,
                                     warmups=0, owner=f"wrap_in_hpu_graph({type(module).__name__})",
                                     static=extract_tensors(graph_inputs, "inputs"), state=state)
            # the graph's tensor cache: what the capture read outside its arguments stays alive
            tensor_cache = extract_tensors(_forward_context.attn_metadata) if _forward_context else {}
            cache[h] = CachedParams(graph_inputs, outputs, graph, tensor_cache)
            return replay(graph, outputs)                      # the dry-run replay after capture
        copy_to(cached.graph_inputs, inputs)
        return replay(cached.graph, cached.graph_outputs)

    module.forward = forward
    return module


# ------------------------------------------------------------------------------ the model
class Module:
    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)


class HPUAttentionImpl:
    scale = 1.0 / math.sqrt(HIDDEN)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata):
        key_cache, value_cache = kv_cache
        slot_mapping = attn_metadata.slot_mapping.flatten()
        key_cache.index_copy_(0, slot_mapping, key)
        value_cache.index_copy_(0, slot_mapping, value)
        # flat paged attention over the batch's blocks
        block_mapping = attn_metadata.block_mapping
        q = block_mapping @ (query * self.scale)                               # batch2block
        k = key_cache.view(NUM_BLOCKS, BLOCK_SIZE, HIDDEN)[attn_metadata.block_list]
        v = value_cache.view(NUM_BLOCKS, BLOCK_SIZE, HIDDEN)[attn_metadata.block_list]
        scores = (q[:, None, :] * k).sum(-1) + attn_metadata.attn_bias        # [blocks, block_size]
        w = torch.exp(scores - scores.max())
        num = block_mapping.t() @ (w[..., None] * v).sum(1)                   # block2batch
        den = block_mapping.t() @ w.sum(-1, keepdim=True)
        return num / den


def unified_attention(query, key, value, layer_name):
    forward_context = get_forward_context()
    attn_metadata = forward_context.attn_metadata
    self = forward_context.no_compile_layers[layer_name]
    kv_cache = self.kv_cache[forward_context.virtual_engine]
    return self.impl.forward(self, query, key, value, kv_cache, attn_metadata)


class Attention(Module):
    def __init__(self, layer_name, static_forward_context):
        self.layer_name, self.impl, self.kv_cache = layer_name, HPUAttentionImpl(), [None]
        static_forward_context[layer_name] = self

    def forward(self, query, key, value):
        return unified_attention(query, key, value, self.layer_name)


class LlamaDecoderLayer(Module):
    def __init__(self, gen, device, static_forward_context):
        self.qkv = [randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6) for _ in range(3)]
        self.o_proj = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6)
        self.pos_emb = randn(NUM_BLOCKS * BLOCK_SIZE, HIDDEN, gen=gen, device=device, scale=0.3)
        self.self_attn = Attention("language_model.model.layers.0.self_attn.attn", static_forward_context)

    def forward(self, positions, hidden_states):
        h = hidden_states + self.pos_emb[positions]
        q, k, v = (h @ w for w in self.qkv)
        return hidden_states + self.self_attn(q, k, v) @ self.o_proj


class MllamaTextModel(Module):
    def __init__(self, gen, device, static_forward_context):
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.layers = [LlamaDecoderLayer(gen, device, static_forward_context)]
        self.cross_attention_layers = []          # text-only requests: cross-attention layers are skipped

    def forward(self, input_ids, positions, cross_attention_states, cross_attention_mask, kv_range_for_decode,
                full_text_row_masked_out_mask, skip_cross_attention):
        hidden_states = self.embed_tokens[input_ids.flatten()]
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(positions=positions.flatten(), hidden_states=hidden_states)
        return hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + 1e-6)


class MllamaForCausalLM(Module):
    def __init__(self, gen, device, static_forward_context):
        self.model = MllamaTextModel(gen, device, static_forward_context)
        self.lm_head = randn(VOCAB, HIDDEN, gen=gen, device=device)

    def forward(self, input_ids, positions, cross_attention_states, cross_attention_mask, kv_range_for_decode,
                full_text_row_masked_out_mask, skip_cross_attention):
        return self.model(input_ids=input_ids, positions=positions,
                          cross_attention_states=cross_attention_states, cross_attention_mask=cross_attention_mask,
                          kv_range_for_decode=kv_range_for_decode,
                          full_text_row_masked_out_mask=full_text_row_masked_out_mask,
                          skip_cross_attention=skip_cross_attention)


class MllamaForConditionalGeneration(Module):
    def __init__(self, gen, device, static_forward_context):
        self.language_model = MllamaForCausalLM(gen, device, static_forward_context)

    def forward(self, input_ids, positions, **kwargs):
        attn_metadata = get_forward_context().attn_metadata
        # For 1) text-only prefill and decode, 2) image-present decode.
        full_text_row_masked_out_mask = (attn_metadata.encoder_seq_lens_tensor != 0).reshape(-1, 1)
        skip_cross_attention = max(attn_metadata.encoder_seq_lens) == 0
        return self.language_model(input_ids=input_ids, positions=positions, cross_attention_states=None,
                                   cross_attention_mask=None, kv_range_for_decode=None,
                                   full_text_row_masked_out_mask=full_text_row_masked_out_mask,
                                   skip_cross_attention=skip_cross_attention)

    def compute_logits(self, hidden_states):
        return hidden_states @ self.language_model.lm_head.t()


# ----------------------------------------------------- vllm/worker/hpu_enc_dec_model_runner.py
class HpuModelAdapter(Module):
    def __init__(self, model, vllm_config, layer_names, is_causal, sampler):
        self.model, self.vllm_config, self.dtype = model, vllm_config, torch.float32
        self.block_size = BLOCK_SIZE

    def _set_block_mapping(self, metadata, batch_size, device, dtype):
        mask = torch.arange(0, self.block_size, device=device, dtype=torch.int32).unsqueeze(0)
        mask = mask >= metadata.block_usage.unsqueeze(-1)
        attn_bias = torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, -math.inf)
        groups = torch.arange(batch_size, device=device, dtype=metadata.block_groups.dtype)
        block_mapping = (metadata.block_groups.unsqueeze(-1) == groups).to(dtype)    # one_hot
        return metadata._replace(block_mapping=block_mapping, attn_bias=attn_bias)

    def _update_metadata(self, attn_metadata, batch_size, seq_len, device, dtype):
        if not attn_metadata.is_prompt:
            attn_metadata = self._set_block_mapping(attn_metadata, batch_size, device, dtype)
        return attn_metadata

    def compute_logits(self, *args, **kwargs):
        return self.model.compute_logits(*args, **kwargs)


class HpuModelAdapterEncoderDecoder(HpuModelAdapter):
    def __init__(self, model, vllm_config, layer_names, is_causal, sampler, *, variant, is_lazy, device, state):
        super().__init__(model, vllm_config, layer_names, is_causal, sampler)
        self.variant = variant
        # We only wrap the language model in HPU graph because some Ops in
        # vision model will fallback to CPU and cause the graph building fail.
        if variant == "bug" and is_lazy and hasattr(self.model, "language_model"):
            self.model.language_model = wrap_in_hpu_graph(self.model.language_model, disable_tensor_cache=True,
                                                          device=device, state=state)
        self.is_lazy = is_lazy

    def _update_cross_metadata(self, attn_metadata, batch_size, seq_len, device, dtype):
        if max(attn_metadata.encoder_seq_lens) == 0:
            return attn_metadata
        raise NotImplementedError("image requests are not modelled")

    def forward(self, *args, **kwargs):
        kwargs = kwargs.copy()
        selected_token_indices = kwargs.pop("selected_token_indices")
        input_ids = kwargs["input_ids"]
        kwargs["attn_metadata"] = self._update_metadata(kwargs["attn_metadata"], input_ids.size(0),
                                                        input_ids.size(1), input_ids.device, self.dtype)
        kwargs["attn_metadata"] = self._update_cross_metadata(kwargs["attn_metadata"], input_ids.size(0),
                                                              input_ids.size(1), input_ids.device, self.dtype)
        if self.variant == "bug" and self.is_lazy and hasattr(self.model, "language_model"):
            bypass_hpu_graphs = kwargs.get("bypass_hpu_graphs", False)
            self.model.language_model.forward = partial(self.model.language_model.forward,
                                                        bypass_hpu_graphs=bypass_hpu_graphs)
        virtual_engine = 0
        if "virtual_engine" in kwargs:
            virtual_engine = kwargs.pop("virtual_engine")
        if "kv_caches" in kwargs:
            kwargs.pop("kv_caches")
        attn_metadata = kwargs.pop("attn_metadata")
        with set_forward_context(attn_metadata, self.vllm_config, virtual_engine):
            hidden_states = self.model(*args, **kwargs)
            hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
            hidden_states = hidden_states.index_select(0, selected_token_indices)
        return hidden_states


class HPUEncoderDecoderModelRunner:
    def __init__(self, device, variant, is_lazy):
        self.device, self.variant, self.is_lazy = device, variant, is_lazy
        static_forward_context = {}
        self.vllm_config = {"static_forward_context": static_forward_context}
        model = MllamaForConditionalGeneration(generator(1255), device, static_forward_context)
        self.kv_cache = (torch.zeros(NUM_BLOCKS * BLOCK_SIZE, HIDDEN, device=device),
                         torch.zeros(NUM_BLOCKS * BLOCK_SIZE, HIDDEN, device=device))
        for layer in static_forward_context.values():
            layer.kv_cache = [self.kv_cache]                      # bind_kv_cache
        state = {"key_cache": self.kv_cache[0], "value_cache": self.kv_cache[1]}
        self.model = self._maybe_wrap_in_hpu_graph(model, self.vllm_config, None, True, None, state=state)

    def _maybe_wrap_in_hpu_graph(self, *args, state, **kwargs):
        adapter = HpuModelAdapterEncoderDecoder(*args, variant=self.variant, is_lazy=self.is_lazy,
                                                device=self.device, state=state, **kwargs)
        if self.variant == "fix" and self.is_lazy:
            return wrap_in_hpu_graph(adapter, disable_tensor_cache=True, device=self.device, state=state)
        return adapter

    def prepare_model_input(self, token_ids, pos):
        """Decode metadata for position ``pos`` of both requests (fresh tensors every step)."""
        t = lambda xs, dtype=torch.long: torch.tensor(xs, dtype=dtype).to(self.device)  # noqa: E731
        block_list = [b for blocks in SEQ_BLOCKS for b in blocks]
        block_groups = [i for i, blocks in enumerate(SEQ_BLOCKS) for _ in blocks]
        block_usage = [min(max(pos + 1 - j * BLOCK_SIZE, 0), BLOCK_SIZE)
                       for _ in SEQ_BLOCKS for j in range(BLOCKS_PER_SEQ)]
        slot_mapping = [[blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE] for blocks in SEQ_BLOCKS]
        attn_metadata = TrimmedAttentionMetadata(
            block_list=t(block_list), block_groups=t(block_groups), block_usage=t(block_usage, torch.int32),
            block_mapping=None, attn_bias=None, slot_mapping=t(slot_mapping),
            encoder_seq_lens=[0] * BATCH, encoder_seq_lens_tensor=t([0] * BATCH, torch.int32),
            is_prompt=False, block_size=BLOCK_SIZE)
        model_input = dict(input_ids=t([[tok] for tok in token_ids]), positions=t([[pos]] * BATCH),
                           attn_metadata=attn_metadata, selected_token_indices=t(list(range(BATCH))),
                           kv_caches=None)
        if self.is_lazy:
            model_input["bypass_hpu_graphs"] = False          # decode buckets use their graphs
        return model_input

    def execute_model(self, token_ids, pos):
        model_input = self.prepare_model_input(token_ids, pos)
        hidden_states = self.model(**model_input)
        return self.model.compute_logits(hidden_states).clone()


def run(variant: str, device: str = "cpu"):
    def serve(is_lazy: bool):
        runner = HPUEncoderDecoderModelRunner(device, variant, is_lazy)
        return [runner.execute_model(tokens, pos) for pos, tokens in enumerate(TOKENS)]

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
