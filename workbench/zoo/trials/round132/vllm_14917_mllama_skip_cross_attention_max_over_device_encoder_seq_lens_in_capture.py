"""vLLM V0 serving Llama 3.2 Vision (``mllama``, an encoder-decoder model) with CUDA graphs: ``capture_model`` captures
decode graphs under attention metadata from ``CommonAttentionState._update_captured_metadata_for_enc_dec_model``,
which stores ``encoder_seq_lens`` as a device tensor (``torch.full((batch_size,), 1).cuda()``), while in served steps
it is a Python list. ``MllamaForConditionalGeneration.forward`` decides ``skip_cross_attention = max(
attn_metadata.encoder_seq_lens) == 0``: inside the capture Python's ``max`` compares device scalars and asks for their
truth value, a device-to-host read that a capturing stream refuses, so the server dies at start-up ("CUDA error:
operation not permitted when stream is capturing"). The fix decides from ``attn_metadata.max_encoder_seq_len``, a
Python int in both (``max_seq_len_to_capture`` at capture), so the decode graphs hold the cross-attention layers.

Upstream: https://github.com/vllm-project/vllm/pull/14917 ("Enable CUDA graph support for llama 3.2 vision",
vllm-project/vllm, by mritterfigma, description dated 2025-03-17, merged as commit a8652f4f0f10 on main, dated
2025-03-19 -0700). Read: the PR description (search corpus: "Removes block on CUDA graph capture for mllama", tested by
serving unsloth/Llama-3.2-11B-Vision-Instruct-bnb-4bit without ``--enforce-eager``) and its full diff
(``git show a8652f4f0`` in a vLLM mirror, local-inference-lab/vllm): ``vllm/model_executor/models/mllama.py`` (the one
changed line in ``MllamaForConditionalGeneration.forward``), ``vllm/config.py`` (drops ``MODEL_NOT_SUPPORT_CUDA_GRAPH =
['mllama']``, which forced ``enforce_eager``) and ``tests/.../test_mllama.py``, whose mllama tests no longer pass
``enforce_eager=True``. At its parent ``a8652f4f0^``: ``mllama.py`` (``MllamaForConditionalGeneration.forward``,
``MllamaTextModel.forward``, ``MllamaTextCrossAttention`` ``__init__``/``forward``,
``MllamaCrossAttentionDecoderLayer.forward``), ``vllm/worker/model_runner.py`` (``capture_model``,
``_update_inputs_to_capture_for_enc_dec_model``, ``CUDAGraphRunner.capture``/``forward``, ``_NUM_WARMUP_ITERS = 2``,
``_use_captured_graph``, ``_get_cuda_graph_pad_size``, the decode padding in ``ModelInputForGPUBuilder.build``),
``vllm/worker/enc_dec_model_runner.py`` (``execute_model``, ``_prepare_encoder_model_input_tensors``' decode branch with
its graph padding), ``vllm/attention/backends/utils.py`` (``CommonMetadataBuilder.build``, ``CommonAttentionState`` with
``graph_capture``, ``graph_capture_get_metadata_for_batch``, ``get_graph_input_buffers``,
``prepare_graph_input_buffers`` and the three enc-dec helpers, ``get_seq_len_block_table_args``). Also read: commit
d06e82400 (#12127, "[Bugfix] Set enforce_eager automatically for mllama", the workaround #14917 removed), the history of
the line (``git log -S``: it came with the model in 770ec6024, #8811, 2024-09-25, after the enc-dec graph support of
#7631), and issue excerpts (search corpus) of #9341, #10416 and #11587.
Not read: the xformers / flash-attn backends' ``forward`` bodies (the cross-attention decode is a paged-attention
stand-in here), the vision encoder, the image-present prefill path, ``MllamaTextSelfAttention``'s rotary set-up, the
review thread of #14917 (its description speaks of making mllama "aware of whether it is in graph capture mode",
following SGLang; the merged diff does that through ``max_encoder_seq_len`` only).
Symptom: #10416: ``vllm serve`` of Llama-3.2-11B-Vision fails in ``CUDAGraphRunner.capture`` at
``mllama.py ... skip_cross_attention = max(attn_metadata.encoder_seq_lens) == 0`` with "RuntimeError: CUDA error:
operation not permitted when stream is capturing"; #11587: "CUDA error: operation failed due to a previous
error during capture", same line; #9341 (v0.6.2, 2024-10-14) fails in the same capture (its excerpt stops before
the line). vLLM's mllama examples passed ``enforce_eager=True`` until #12127 (2025-01-17) forced eager mode instead.
Mechanism: V0 captures decode graphs only, largest batch first, each after two eager warm-ups, under a forward context
holding capture metadata. For encoder-decoder models that metadata's ``encoder_seq_lens`` is a device tensor of ones.
The warm-ups read it eagerly (allowed); in the capture ``max`` over a device tensor runs ``__gt__`` and ``__bool__``
on device scalars (for a batch of one, the ``if not skip_cross_attention`` in ``MllamaTextModel.forward`` does it),
which needs the device's values on the host. Eager serving never meets it: there ``encoder_seq_lens`` is a list.
Doctor: sync-in-capture, at forward. A host read of device data inside the captured region; ``forward`` of
``MllamaForConditionalGeneration`` is where the decision is computed from the device tensor and the function the fix
changes (three functions here are named ``forward``, as upstream; this is the one with ``skip_cross_attention``).
Fix (upstream): ``skip_cross_attention = attn_metadata.max_encoder_seq_len == 0`` (a Python int: the batch's max in
served steps, ``max_seq_len_to_capture`` at capture, so every decode graph holds the cross-attention layers, whose
contribution ``full_text_row_masked_out_mask`` zeroes for text-only rows), and mllama is no longer forced to eager.
Modelled: ``XFormersMetadata`` (the decode fields and ``decode_metadata``), ``set_forward_context`` /
``get_forward_context``, ``get_seq_len_block_table_args``, ``Attention`` (the decode part of ``XFormersImpl.forward``),
``MllamaTextSelfAttention``, ``MllamaSelfAttentionDecoderLayer``, ``MllamaTextCrossAttention``,
``MllamaCrossAttentionDecoderLayer``, ``MllamaTextModel``, ``MllamaForConditionalGeneration`` (``forward``,
``compute_logits``), ``CommonAttentionState`` (as listed above), ``CUDAGraphRunner``, ``EncoderDecoderModelRunner``
(``capture_model``, ``_update_inputs_to_capture_for_enc_dec_model``, ``prepare_model_input`` with the decoder part of
``_prepare_model_input_tensors`` and ``_prepare_encoder_model_input_tensors``, ``_use_captured_graph``,
``_get_cuda_graph_pad_size``, ``execute_model``), ``VllmConfig.pad_for_cudagraph``, ``make_tensor_with_pad``.
Stand-ins: ``PagedAttention.write_to_paged_cache`` (padded slots, ``PAD_SLOT_ID``, keep the value they hold) and
``forward_decode`` (one program per row over the row's own tokens, the kernel's ``1 / (exp_sum + 1e-6)``, so an empty
cross-attention row gives zeros; ``max_seq_len`` only bounds it); a three-layer text model (self, cross, self) of width
16, two heads, no GQA, neox rotary, float64, weights drawn from a seed, both gates nonzero, linear layers as a
broadcast multiply and sum (a CPU BLAS picks kernels by shape, so a row's ``@`` result depends on the batch's row
count, and padded graph batches would part from eager ones in the last bit); KV caches (self and cross)
filled with random values as if prefill had written them (prefill and the vision encoder are not run); no
``MODEL_NOT_SUPPORT_CUDA_GRAPH`` guard in either variant (the bug variant is the code #12127 guarded, as served
between #8811 and #12127); graph capture through the engine (warm-ups, a shared pool handle for ``graph.pool()``, no
side-stream ``graph_capture`` context, no ``torch.cuda.synchronize``); ``execute_model`` tells the graph runner how
many rows are real (the workbench's replay announcement); logits are ``lm_head`` over the real rows.
Workload: capture sizes [4, 2, 1], ``max_seq_len_to_capture`` 32, block size 4. Requests A (5-token prompt, 6 encoder
tokens), B (text only, 3 tokens, no image) and C (7 tokens, 5 encoder tokens); four decode steps: [A, B, C] (graph 4,
one padded row), [B] (text only: eager skips the cross layer), [A, C], [B, C]. Output: each step's logits.
Measured: bug: misbehaves, raised CaptureError at the capture of batch 4 ("Tensor.__bool__() inside graph capture
needs the device's values on the host (a host synchronisation), which a CUDA graph cannot wait for
(cudaErrorStreamCaptureUnsupported)."), from ``max(attn_metadata.encoder_seq_lens)``; no step is served. Fix: equals
eager (max |graph - eager| = 0).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math

import numpy as np
import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/14917"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "forward"
SYMPTOM = ("vLLM V0 serving Llama 3.2 Vision with CUDA graphs dies at start-up: the decode capture reads "
           "max(attn_metadata.encoder_seq_lens) over the capture metadata's device tensor, a host sync "
           "the capture refuses")

BLOCK_SIZE, NUM_BLOCKS = 4, 16
MAX_SEQ_LEN_TO_CAPTURE = 32
CUDAGRAPH_CAPTURE_SIZES = [4, 2, 1]          # descending: V0 captures the largest batch first
PAD_SLOT_ID = -1
VOCAB, HIDDEN, NUM_HEADS, INTER = 24, 16, 2, 32
HEAD_DIM = HIDDEN // NUM_HEADS
LAYER_TYPES = ("self", "cross", "self")
DTYPE = torch.float64
_NUM_WARMUP_ITERS = 2

_variant = "bug"


class AttentionType:
    DECODER = "decoder"
    ENCODER_DECODER = "encoder_decoder"


@dataclasses.dataclass
class XFormersMetadata:
    num_prefills: int
    num_prefill_tokens: int
    num_decode_tokens: int
    slot_mapping: torch.Tensor
    seq_lens: list | None
    seq_lens_tensor: torch.Tensor
    max_decode_seq_len: int
    block_tables: torch.Tensor
    use_cuda_graph: bool
    encoder_seq_lens: object = None              # a list when served; a device tensor in the capture metadata
    encoder_seq_lens_tensor: torch.Tensor | None = None
    max_encoder_seq_len: int | None = None
    num_encoder_tokens: int | None = None
    cross_slot_mapping: torch.Tensor | None = None
    cross_block_tables: torch.Tensor | None = None

    @property
    def prefill_metadata(self):
        return None                              # decode only (V0 graphs serve decode batches)

    @property
    def decode_metadata(self):
        return self


_forward_context = None


@contextlib.contextmanager
def set_forward_context(attn_metadata):
    global _forward_context
    prev, _forward_context = _forward_context, dataclasses.make_dataclass("ForwardContext", ["attn_metadata"])(
        attn_metadata)
    try:
        yield
    finally:
        _forward_context = prev


def get_forward_context():
    return _forward_context


def make_tensor_with_pad(rows, pad, dtype, device, max_len=None):
    width = max_len if max_len is not None else max((len(r) for r in rows), default=0)
    return torch.tensor([list(r) + [pad] * (width - len(r)) for r in rows], dtype=dtype, device=device)


def pad_for_cudagraph(batch_size):
    return min(bs for bs in CUDAGRAPH_CAPTURE_SIZES if bs >= batch_size)


# --- vllm/attention: the paged cache and the decode kernel (torch stand-ins) ---------------------------------------

def write_to_paged_cache(key, value, key_cache, value_cache, slot_mapping):
    """reshape_and_cache: one program per token; a token whose slot is PAD_SLOT_ID writes nothing."""
    valid = (slot_mapping >= 0)[:, None, None]
    slots = slot_mapping.clamp(min=0)
    key_cache.index_copy_(0, slots, torch.where(valid, key, key_cache[slots]))
    value_cache.index_copy_(0, slots, torch.where(valid, value, value_cache[slots]))


def forward_decode(query, key_cache, value_cache, block_tables, seq_lens, max_seq_len, scale):
    """paged_attention_v1: one program per row, over that row's seq_lens[b] tokens; 1 / (exp_sum + 1e-6)."""
    assert max_seq_len <= MAX_SEQ_LEN_TO_CAPTURE
    pos = torch.arange(MAX_SEQ_LEN_TO_CAPTURE, device=query.device)
    blk = (pos // BLOCK_SIZE).clamp(max=block_tables.shape[1] - 1)
    slots = block_tables.long()[:, blk] * BLOCK_SIZE + pos % BLOCK_SIZE
    k, v = key_cache[slots], value_cache[slots]                                   # [bs, P, heads, dim]
    scores = torch.einsum("bhd,bphd->bhp", query, k) * scale
    valid = (pos[None, :] < seq_lens.long()[:, None])[:, None, :]
    m = torch.where(valid, scores, -math.inf).amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.where(valid, torch.exp(scores - m), torch.zeros_like(scores))
    return torch.einsum("bhp,bphd->bhd", e, v) / (e.sum(-1, keepdim=True) + 1e-6)


def get_seq_len_block_table_args(attn_metadata, is_prompt, attn_type):
    if attn_type == AttentionType.DECODER:
        return attn_metadata.seq_lens_tensor, attn_metadata.max_decode_seq_len, attn_metadata.block_tables
    return (attn_metadata.encoder_seq_lens_tensor, attn_metadata.max_encoder_seq_len,
            attn_metadata.cross_block_tables)


class Attention:
    def __init__(self, attn_type, kv_cache):
        self.attn_type, self.kv_cache, self.scale = attn_type, kv_cache, HEAD_DIM ** -0.5

    def forward(self, query, key, value):
        """The decode part of XFormersImpl.forward."""
        attn_metadata = get_forward_context().attn_metadata
        key_cache, value_cache = self.kv_cache
        if key is not None and value is not None:
            slot_mapping = (attn_metadata.slot_mapping if self.attn_type == AttentionType.DECODER
                            else attn_metadata.cross_slot_mapping)
            write_to_paged_cache(key, value, key_cache, value_cache, slot_mapping)
        decode_meta = attn_metadata.decode_metadata
        seq_lens_arg, max_seq_len_arg, block_tables_arg = get_seq_len_block_table_args(decode_meta, False,
                                                                                        self.attn_type)
        out = forward_decode(query.view(-1, NUM_HEADS, HEAD_DIM), key_cache, value_cache, block_tables_arg,
                             seq_lens_arg, max_seq_len_arg, self.scale)
        return out.reshape(-1, HIDDEN)


# --- vllm/model_executor/models/mllama.py (reduced) ----------------------------------------------------------------

def linear(x, weight):
    """A GEMM whose row results do not depend on the batch size (a CPU BLAS picks kernels by shape)."""
    return (x[..., :, None] * weight).sum(-2)


def rms_norm(x, weight, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotary(x, positions):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, device=x.device, dtype=DTYPE) / HEAD_DIM))
    freqs = positions.to(DTYPE)[:, None] * inv_freq
    cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
    x1, x2 = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class _Weights:
    def __init__(self, gen, device):
        self.gen, self.device = gen, device

    def __call__(self, *shape, scale=0.3):
        return randn(*shape, gen=self.gen, device=self.device, scale=scale).to(DTYPE)


class MllamaTextSelfAttention:
    def __init__(self, w, kv_cache):
        self.qkv_proj, self.o_proj = w(HIDDEN, 3 * HIDDEN), w(HIDDEN, HIDDEN)
        self.attn = Attention(AttentionType.DECODER, kv_cache)

    def forward(self, positions, hidden_states):
        q, k, v = linear(hidden_states, self.qkv_proj).split(HIDDEN, dim=-1)
        q = rotary(q.view(-1, NUM_HEADS, HEAD_DIM), positions)
        k = rotary(k.view(-1, NUM_HEADS, HEAD_DIM), positions)
        return linear(self.attn.forward(q, k, v.view(-1, NUM_HEADS, HEAD_DIM)), self.o_proj)


class LlamaMLP:
    def __init__(self, w):
        self.gate_up_proj, self.down_proj = w(HIDDEN, 2 * INTER), w(INTER, HIDDEN)

    def __call__(self, x):
        gate, up = linear(x, self.gate_up_proj).split(INTER, dim=-1)
        return linear(torch.nn.functional.silu(gate) * up, self.down_proj)


class MllamaSelfAttentionDecoderLayer:
    def __init__(self, w, kv_cache):
        self.self_attn, self.mlp = MllamaTextSelfAttention(w, kv_cache), LlamaMLP(w)
        self.input_layernorm, self.post_attention_layernorm = 1 + w(HIDDEN, scale=0.1), 1 + w(HIDDEN, scale=0.1)

    def __call__(self, positions, hidden_states, residual):
        residual = hidden_states
        hidden_states = self.self_attn.forward(positions, rms_norm(hidden_states, self.input_layernorm))
        residual = hidden_states + residual
        return self.mlp(rms_norm(residual, self.post_attention_layernorm)), residual


class MllamaTextCrossAttention:
    def __init__(self, w, kv_cache):
        self.q_proj, self.o_proj = w(HIDDEN, HIDDEN), w(HIDDEN, HIDDEN)
        self.q_norm = 1 + w(HEAD_DIM, scale=0.1)
        self.attn = Attention(AttentionType.ENCODER_DECODER, kv_cache)

    def forward(self, hidden_states, attention_mask, kv_range_for_decode, cross_attention_states):
        q = rms_norm(linear(hidden_states, self.q_proj).view(-1, NUM_HEADS, HEAD_DIM), self.q_norm)
        assert attention_mask is None and cross_attention_states is None     # decode: k, v come from the cache
        return linear(self.attn.forward(q, None, None), self.o_proj)


class MllamaCrossAttentionDecoderLayer:
    def __init__(self, w, kv_cache):
        self.cross_attn, self.mlp = MllamaTextCrossAttention(w, kv_cache), LlamaMLP(w)
        self.input_layernorm, self.post_attention_layernorm = 1 + w(HIDDEN, scale=0.1), 1 + w(HIDDEN, scale=0.1)
        self.cross_attn_attn_gate = torch.tensor([0.8], dtype=DTYPE, device=w.device)
        self.cross_attn_mlp_gate = torch.tensor([-0.6], dtype=DTYPE, device=w.device)

    def __call__(self, hidden_states, cross_attention_states, cross_attention_mask, kv_range_for_decode,
                 full_text_row_masked_out_mask):
        residual = hidden_states
        hidden_states = self.cross_attn.forward(rms_norm(hidden_states, self.input_layernorm), cross_attention_mask,
                                                kv_range_for_decode, cross_attention_states)
        hidden_states = full_text_row_masked_out_mask * hidden_states
        hidden_states = residual + self.cross_attn_attn_gate.tanh() * hidden_states
        residual = hidden_states
        hidden_states = self.mlp(rms_norm(hidden_states, self.post_attention_layernorm))
        hidden_states = full_text_row_masked_out_mask * hidden_states
        return residual + self.cross_attn_mlp_gate.tanh() * hidden_states


class MllamaTextModel:
    def __init__(self, w, kv_caches):
        self.embed_tokens, self.norm = w(VOCAB, HIDDEN, scale=1.0), 1 + w(HIDDEN, scale=0.1)
        self.cross_attention_layers = [i for i, t in enumerate(LAYER_TYPES) if t == "cross"]
        self.layers = [(MllamaCrossAttentionDecoderLayer if t == "cross" else MllamaSelfAttentionDecoderLayer)(
            w, kv_caches[i]) for i, t in enumerate(LAYER_TYPES)]

    def forward(self, input_ids, positions, cross_attention_states, cross_attention_mask, kv_range_for_decode,
                full_text_row_masked_out_mask, skip_cross_attention):
        hidden_states = self.embed_tokens[input_ids]
        for idx, decoder_layer in enumerate(self.layers):
            if idx in self.cross_attention_layers:
                if not skip_cross_attention:
                    hidden_states = decoder_layer(hidden_states, cross_attention_states, cross_attention_mask,
                                                  kv_range_for_decode, full_text_row_masked_out_mask)
            else:
                hidden_states, residual = decoder_layer(positions, hidden_states, None)
                hidden_states = hidden_states + residual
        return rms_norm(hidden_states, self.norm)


class MllamaForConditionalGeneration:
    def __init__(self, device, kv_caches):
        w = _Weights(generator(14917), device)
        self.language_model = MllamaTextModel(w, kv_caches)
        self.lm_head = w(HIDDEN, VOCAB, scale=1.0)

    def _parse_and_validate_image_input(self, **kwargs):
        return None                              # decode steps carry no pixel values

    def forward(self, input_ids, positions, **kwargs):
        attn_metadata = get_forward_context().attn_metadata
        if attn_metadata.num_prefill_tokens > 0 and attn_metadata.num_decode_tokens > 0:
            raise ValueError("Chunk prefill not supported")
        image_inputs = self._parse_and_validate_image_input(**kwargs)
        cross_attention_states = cross_attention_mask = kv_range_for_decode = None
        # For 1) text-only prefill and decode, 2) image-present decode.
        if image_inputs is None:
            full_text_row_masked_out_mask = (attn_metadata.encoder_seq_lens_tensor != 0).reshape(-1, 1).to(
                input_ids.device)
            if _variant == "fix":
                skip_cross_attention = attn_metadata.max_encoder_seq_len == 0
            else:
                skip_cross_attention = max(attn_metadata.encoder_seq_lens) == 0
        else:
            raise NotImplementedError("image-present prefill is not modelled")
        return self.language_model.forward(input_ids, positions, cross_attention_states, cross_attention_mask,
                                           kv_range_for_decode, full_text_row_masked_out_mask, skip_cross_attention)

    __call__ = forward

    def compute_logits(self, hidden_states, num_real):
        return linear(hidden_states[:num_real], self.lm_head)     # sampling metadata selects the real rows


# --- vllm/attention/backends/utils.py: CommonAttentionState (reduced) ---------------------------------------------

class CommonAttentionState:
    def __init__(self, runner):
        self.runner = runner
        self._is_graph_capturing = False

    @contextlib.contextmanager
    def graph_capture(self, max_batch_size):
        self._is_graph_capturing = True
        dev = self.runner.device
        self._graph_slot_mapping = torch.full((max_batch_size,), PAD_SLOT_ID, dtype=torch.long, device=dev)
        self._graph_seq_lens = torch.ones(max_batch_size, dtype=torch.int32, device=dev)
        self._graph_block_tables = torch.from_numpy(self.runner.graph_block_tables).to(device=dev, copy=True)
        yield
        self._is_graph_capturing = False
        del self._graph_slot_mapping, self._graph_seq_lens, self._graph_block_tables

    def graph_clone(self, batch_size):
        assert self._is_graph_capturing
        return self.__class__(self.runner)

    def graph_capture_get_metadata_for_batch(self, batch_size, is_encoder_decoder_model=False):
        assert self._is_graph_capturing
        attn_metadata = XFormersMetadata(
            num_prefills=0, num_prefill_tokens=0, num_decode_tokens=batch_size,
            slot_mapping=self._graph_slot_mapping[:batch_size], seq_lens=None,
            seq_lens_tensor=self._graph_seq_lens[:batch_size], max_decode_seq_len=self.runner.max_seq_len_to_capture,
            block_tables=self._graph_block_tables[:batch_size], use_cuda_graph=True)
        if is_encoder_decoder_model:
            self._update_captured_metadata_for_enc_dec_model(batch_size=batch_size, attn_metadata=attn_metadata)
        return attn_metadata

    def _update_captured_metadata_for_enc_dec_model(self, batch_size, attn_metadata):
        dev = self.runner.device
        attn_metadata.cross_slot_mapping = torch.tensor([], dtype=torch.long, device=dev)
        attn_metadata.cross_block_tables = torch.full((batch_size, self.runner.get_max_block_per_batch()), 1,
                                                      dtype=torch.int, device=dev)
        attn_metadata.encoder_seq_lens = torch.full((batch_size,), 1, dtype=torch.int, device=dev)
        attn_metadata.encoder_seq_lens_tensor = torch.full((batch_size,), 1, dtype=torch.int, device=dev)
        attn_metadata.max_encoder_seq_len = self.runner.max_seq_len_to_capture
        attn_metadata.num_encoder_tokens = 0

    def get_graph_input_buffers(self, attn_metadata, is_encoder_decoder_model=False):
        input_buffers = {"slot_mapping": attn_metadata.slot_mapping,
                         "seq_lens_tensor": attn_metadata.decode_metadata.seq_lens_tensor,
                         "block_tables": attn_metadata.decode_metadata.block_tables}
        if is_encoder_decoder_model:
            self._add_additonal_input_buffers_for_enc_dec_model(attn_metadata, input_buffers)
        return input_buffers

    def _add_additonal_input_buffers_for_enc_dec_model(self, attn_metadata, input_buffers):
        input_buffers["encoder_seq_lens_tensor"] = attn_metadata.decode_metadata.encoder_seq_lens_tensor
        input_buffers["cross_slot_mapping"] = attn_metadata.decode_metadata.cross_slot_mapping
        input_buffers["cross_block_tables"] = attn_metadata.decode_metadata.cross_block_tables

    def prepare_graph_input_buffers(self, input_buffers, attn_metadata, is_encoder_decoder_model=False):
        input_buffers["seq_lens_tensor"].copy_(attn_metadata.decode_metadata.seq_lens_tensor, non_blocking=True)
        input_buffers["block_tables"].copy_(attn_metadata.decode_metadata.block_tables, non_blocking=True)
        if is_encoder_decoder_model:
            self._prepare_input_buffers_for_enc_dec_model(attn_metadata, input_buffers)

    def _prepare_input_buffers_for_enc_dec_model(self, attn_metadata, input_buffers):
        for name in ("encoder_seq_lens_tensor", "cross_slot_mapping", "cross_block_tables"):
            input_buffers[name].copy_(getattr(attn_metadata.decode_metadata, name), non_blocking=True)


# --- vllm/worker/model_runner.py: CUDAGraphRunner (reduced) ---------------------------------------------------------

class CUDAGraphRunner:
    def __init__(self, model, backend_name, attn_state, is_encoder_decoder_model):
        self.model, self.backend_name, self.attn_state = model, backend_name, attn_state
        self.input_buffers, self.output_buffers = {}, {}
        self._graph = None
        self._is_encoder_decoder_model = is_encoder_decoder_model
        self.num_real = None                      # workbench: rows the replay announces as real

    def capture(self, input_ids, positions, intermediate_inputs, kv_caches, attn_metadata, memory_pool, stream,
                **kwargs):
        assert self._graph is None

        def run():
            return self.model(input_ids=input_ids, positions=positions, intermediate_tensors=intermediate_inputs,
                              **kwargs)
        buffers = {"input_ids": input_ids, "positions": positions,
                   **self.attn_state.get_graph_input_buffers(attn_metadata, self._is_encoder_decoder_model),
                   **kwargs}
        state = {f"kv_caches[{i}].{kv}": t for i, pair in enumerate(kv_caches) for kv, t in zip("kv", pair)}
        # _NUM_WARMUP_ITERS eager runs, then the capture (on the capture metadata of the forward context)
        self._graph, hidden_states = capture(
            run, device=input_ids.device.type, pool=memory_pool, warmups=_NUM_WARMUP_ITERS,
            name=f"decode bs={input_ids.shape[0]}", owner="CUDAGraphRunner",
            static={k: t for k, t in buffers.items() if t.numel()}, state=state)
        self.input_buffers = {**buffers, "kv_caches": kv_caches}
        self.output_buffers = {"hidden_states": hidden_states}

    def __call__(self, input_ids, positions, intermediate_tensors, **kwargs):
        attn_metadata = get_forward_context().attn_metadata
        self.input_buffers["input_ids"].copy_(input_ids, non_blocking=True)
        self.input_buffers["positions"][: positions.shape[0]].copy_(positions, non_blocking=True)
        self.input_buffers["slot_mapping"].copy_(attn_metadata.slot_mapping, non_blocking=True)
        self.attn_state.prepare_graph_input_buffers(self.input_buffers, attn_metadata, self._is_encoder_decoder_model)
        if self._is_encoder_decoder_model:
            self.input_buffers["encoder_input_ids"].copy_(kwargs["encoder_input_ids"], non_blocking=True)
            self.input_buffers["encoder_positions"].copy_(kwargs["encoder_positions"], non_blocking=True)
        return replay(self._graph, self.output_buffers["hidden_states"], real=self.num_real, size=input_ids.shape[0])


# --- vllm/worker/enc_dec_model_runner.py (reduced: decode steps) ---------------------------------------------------

@dataclasses.dataclass
class SequenceGroupMetadata:
    request_id: str
    token: int
    seq_len: int                                  # including the token decoded now
    block_table: list
    encoder_seq_len: int
    cross_block_table: list | None


@dataclasses.dataclass
class EncoderDecoderModelInput:
    input_tokens: torch.Tensor
    input_positions: torch.Tensor
    attn_metadata: XFormersMetadata
    num_real: int
    encoder_input_tokens: torch.Tensor | None = None
    encoder_input_positions: torch.Tensor | None = None


class EncoderDecoderModelRunner:
    def __init__(self, device, enforce_eager):
        self.device, self.enforce_eager = device, enforce_eager
        self.max_seq_len_to_capture = MAX_SEQ_LEN_TO_CAPTURE
        self.max_batchsize_to_capture = max(CUDAGRAPH_CAPTURE_SIZES)
        self.graph_block_tables = np.zeros((self.max_batchsize_to_capture, self.get_max_block_per_batch()),
                                           dtype=np.int32)
        gen = generator(7)                        # KV caches as prefill (not run) left them
        self.kv_caches = [tuple(randn(NUM_BLOCKS * BLOCK_SIZE, NUM_HEADS, HEAD_DIM, gen=gen, device=device).to(DTYPE)
                                for _ in "kv") for _ in LAYER_TYPES]
        self.model = MllamaForConditionalGeneration(device, self.kv_caches)
        self.attn_state = CommonAttentionState(self)
        self.graph_runners, self.graph_memory_pool = {}, None

    def get_max_block_per_batch(self):
        return (self.max_seq_len_to_capture + BLOCK_SIZE - 1) // BLOCK_SIZE

    def capture_model(self):
        assert not self.enforce_eager
        max_batch_size = self.max_batchsize_to_capture
        input_tokens = torch.zeros(max_batch_size, dtype=torch.long, device=self.device)
        input_positions = torch.zeros(max_batch_size, dtype=torch.long, device=self.device)
        self.graph_memory_pool = graph_pool_handle(self.device)    # stand-in for the first graph's .pool()
        with self.attn_state.graph_capture(max_batch_size):
            for batch_size in CUDAGRAPH_CAPTURE_SIZES:
                attn_metadata = self.attn_state.graph_capture_get_metadata_for_batch(batch_size,
                                                                                     is_encoder_decoder_model=True)
                graph_runner = CUDAGraphRunner(self.model, "XFORMERS", self.attn_state.graph_clone(batch_size), True)
                capture_inputs = {"input_ids": input_tokens[:batch_size],
                                  "positions": input_positions[..., :batch_size], "intermediate_inputs": None,
                                  "kv_caches": self.kv_caches, "attn_metadata": attn_metadata,
                                  "memory_pool": self.graph_memory_pool, "stream": None}
                self._update_inputs_to_capture_for_enc_dec_model(capture_inputs)
                with set_forward_context(attn_metadata):
                    graph_runner.capture(**capture_inputs)
                self.graph_runners[batch_size] = graph_runner

    def _update_inputs_to_capture_for_enc_dec_model(self, capture_inputs):
        capture_inputs["encoder_input_ids"] = torch.tensor([], dtype=torch.long, device=self.device)
        capture_inputs["encoder_positions"] = torch.tensor([], dtype=torch.long, device=self.device)

    def _use_captured_graph(self, batch_size, decode_only, max_decode_seq_len, max_encoder_seq_len=0):
        return (decode_only and not self.enforce_eager and max_decode_seq_len <= self.max_seq_len_to_capture
                and max_encoder_seq_len <= self.max_seq_len_to_capture
                and batch_size <= self.max_batchsize_to_capture)

    def _get_cuda_graph_pad_size(self, num_seqs, max_decode_seq_len, max_encoder_seq_len=0):
        if not self._use_captured_graph(num_seqs, True, max_decode_seq_len, max_encoder_seq_len):
            return -1
        return pad_for_cudagraph(num_seqs) - num_seqs

    def _prepare_model_input_tensors(self, seq_group_metadata_list):
        """ModelInputForGPUBuilder.build and CommonMetadataBuilder.build, decode steps only."""
        input_tokens = [s.token for s in seq_group_metadata_list]
        input_positions = [s.seq_len - 1 for s in seq_group_metadata_list]
        seq_lens = [s.seq_len for s in seq_group_metadata_list]
        slot_mapping = [s.block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                        for s, p in zip(seq_group_metadata_list, input_positions)]
        block_tables = [s.block_table[: -(-s.seq_len // BLOCK_SIZE)] for s in seq_group_metadata_list]
        max_decode_seq_len = max(seq_lens)
        cuda_graph_pad_size = self._get_cuda_graph_pad_size(
            len(seq_lens), max_decode_seq_len, max(s.encoder_seq_len for s in seq_group_metadata_list))
        num_real = len(input_tokens)
        if cuda_graph_pad_size != -1:
            input_tokens += [0] * cuda_graph_pad_size
            input_positions += [0] * cuda_graph_pad_size
            seq_lens += [1] * cuda_graph_pad_size
            slot_mapping += [PAD_SLOT_ID] * cuda_graph_pad_size
            input_block_tables = self.graph_block_tables[: len(input_tokens)]     # reused across steps, not cleared
            for i, block_table in enumerate(block_tables):
                input_block_tables[i, : len(block_table)] = block_table
            block_tables_t = torch.from_numpy(input_block_tables).to(self.device, copy=True)
        else:
            block_tables_t = make_tensor_with_pad(block_tables, pad=0, dtype=torch.int, device=self.device)
        dev = self.device
        attn_metadata = XFormersMetadata(
            num_prefills=0, num_prefill_tokens=0, num_decode_tokens=len(input_tokens),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=dev), seq_lens=seq_lens,
            seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int, device=dev), max_decode_seq_len=max_decode_seq_len,
            block_tables=block_tables_t, use_cuda_graph=cuda_graph_pad_size != -1)
        return EncoderDecoderModelInput(torch.tensor(input_tokens, dtype=torch.long, device=dev),
                                        torch.tensor(input_positions, dtype=torch.long, device=dev),
                                        attn_metadata, num_real)

    def _prepare_encoder_model_input_tensors(self, seq_group_metadata_list, model_input):
        """The decode branch: encoder lengths and cross block tables, padded for a graph."""
        encoder_seq_lens = [s.encoder_seq_len for s in seq_group_metadata_list]
        cross_block_tables = [[] if s.cross_block_table is None else s.cross_block_table
                              for s in seq_group_metadata_list]
        if model_input.attn_metadata.use_cuda_graph:
            max_len_of_block_table = self.get_max_block_per_batch()
            batch_size = len(encoder_seq_lens)
            cuda_graph_pad_size = pad_for_cudagraph(batch_size) - batch_size
            cross_block_tables += [[] for _ in range(cuda_graph_pad_size)]
            encoder_seq_lens += [1] * cuda_graph_pad_size
        else:
            max_len_of_block_table = max(len(block_table) for block_table in cross_block_tables)
        attn_metadata = model_input.attn_metadata
        attn_metadata.num_encoder_tokens = sum(encoder_seq_lens)
        attn_metadata.encoder_seq_lens = encoder_seq_lens
        attn_metadata.encoder_seq_lens_tensor = torch.tensor(encoder_seq_lens, dtype=torch.int, device=self.device)
        attn_metadata.max_encoder_seq_len = max(encoder_seq_lens, default=0)
        attn_metadata.cross_slot_mapping = torch.tensor([], dtype=torch.long, device=self.device)
        attn_metadata.cross_block_tables = make_tensor_with_pad(cross_block_tables, pad=0, dtype=torch.int,
                                                                device=self.device, max_len=max_len_of_block_table)
        empty = torch.tensor([], dtype=torch.long, device=self.device)
        return attn_metadata, empty, empty.clone()

    def prepare_model_input(self, seq_group_metadata_list):
        model_input = self._prepare_model_input_tensors(seq_group_metadata_list)
        attn_metadata, encoder_input_tokens, encoder_input_positions = self._prepare_encoder_model_input_tensors(
            seq_group_metadata_list, model_input)
        return dataclasses.replace(model_input, attn_metadata=attn_metadata,
                                   encoder_input_tokens=encoder_input_tokens,
                                   encoder_input_positions=encoder_input_positions)

    def execute_model(self, model_input):
        attn_metadata = model_input.attn_metadata
        if attn_metadata.prefill_metadata is None and attn_metadata.decode_metadata.use_cuda_graph:
            model_executable = self.graph_runners[model_input.input_tokens.shape[0]]
            model_executable.num_real = model_input.num_real
        else:
            model_executable = self.model
        with set_forward_context(attn_metadata):
            hidden_or_intermediate_states = model_executable(
                input_ids=model_input.input_tokens, positions=model_input.input_positions,
                encoder_input_ids=model_input.encoder_input_tokens,
                encoder_positions=model_input.encoder_input_positions, intermediate_tensors=None)
        return self.model.compute_logits(hidden_or_intermediate_states, model_input.num_real)


# --- the workload ---------------------------------------------------------------------------------------------------

REQUESTS = {   # prompt length, self-attention blocks, encoder (image) tokens, cross-attention blocks
    "A": (5, [1, 2, 3, 4], 6, [1, 2]),
    "B": (3, [5, 6, 7, 8], 0, None),
    "C": (7, [9, 10, 11, 12], 5, [3, 4]),
}
STEPS = (("A", "B", "C"), ("B",), ("A", "C"), ("B", "C"))


def _serve(device, enforce_eager):
    runner = EncoderDecoderModelRunner(device, enforce_eager)
    if not enforce_eager:
        runner.capture_model()
    seq_len = {name: r[0] for name, r in REQUESTS.items()}
    gen = generator(3)
    outs = []
    for step in STEPS:
        seq_group_metadata_list = []
        for name in step:
            _, block_table, encoder_seq_len, cross_block_table = REQUESTS[name]
            seq_len[name] += 1
            token = int(torch.randint(VOCAB, (1,), generator=gen))
            seq_group_metadata_list.append(SequenceGroupMetadata(name, token, seq_len[name], block_table,
                                                                 encoder_seq_len, cross_block_table))
        outs.append(runner.execute_model(runner.prepare_model_input(seq_group_metadata_list)))
    return outs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: _serve(device, enforce_eager=False), lambda: _serve(device, enforce_eager=True))
