"""Gemma3n with ``--kv-sharing-fast-prefill`` cannot start with CUDA graphs: the metadata built for the capture dummy run has no logits indices, and the fast-prefill metadata asserts they are there.

Upstream: https://github.com/vllm-project/vllm/pull/28537 ("Fix KV sharing fast prefill with cudagraph enabled",
vllm-project/vllm, merged 2025-11-12). The feature came from #21590 ("Override attention metadata for fast prefill
in some KV sharing setups") and #22628 ("[V1] Enable prefill optimization for Gemma3n").
Symptom: ``vllm serve google/gemma-3n-E2B-it --kv-sharing-fast-prefill`` dies while capturing CUDA graphs with
``File "vllm/v1/attention/backends/utils.py", line 1005, in __init__: common_attn_metadata.logits_indices_padded
is not None  AssertionError``. The same command with ``--enforce-eager`` serves fine. Its e2e test
(``tests/v1/e2e/test_kv_sharing_fast_prefill.py``) was being skipped in CI.
Mechanism: for fast prefill (You Only Cache Once), ``GPUModelRunner.initialize_attn_backend`` gives the
cross-decoder layers (those that read a KV cache shared with an earlier layer) the backend from
``create_fast_prefill_custom_backend`` (``vllm/v1/attention/backends/utils.py``). Its
``FastPrefillAttentionBuilder.build`` first truncates the batch to the tokens that need logits
(``make_kv_sharing_fast_prefill_common_attn_metadata``, which returns the metadata unchanged when every query has
length 1). It then wraps the underlying backend's metadata in a dynamically made subclass,
``KVSharingFastPrefillAttentionMetadata``. That subclass's ``__init__`` copies the fields and then asserted
``common_attn_metadata.logits_indices_padded is not None and common_attn_metadata.num_logits_indices is not
None``. A real step always passes: ``_prepare_inputs`` fills them from ``_prepare_kv_sharing_fast_prefill``. But
``_capture_cudagraphs`` now builds attention metadata inside ``_dummy_run`` for FULL graphs. That is the
``force_attention`` warmup run and the capture run of every uniform-decode size, through
``build_for_cudagraph_capture``. The dummy batch's ``CommonAttentionMetadata`` has no logits information: both
fields are at their defaults (None). So the assertion fires on the first capture size and the engine does not
start. With ``--enforce-eager`` nothing is captured and no dummy run builds this metadata.
Doctor: warmup-divergence, at __init__ (``KVSharingFastPrefillAttentionMetadata.__init__``, defined inside
``FastPrefillAttentionBuilder.build``). The capture path builds the per-layer metadata from a dummy batch that
lacks what every serving step carries. The metadata constructor rejects that batch instead of taking the path the
model already has for it. Its assertion is the line the fix deleted.
Fix (upstream): the assertion is removed and ``__init__`` copies the two fields as they are (None in a dummy run).
The ``KVSharingFastPrefillMetadata`` protocol's fields become ``torch.Tensor | None = None`` /
``int | None = None``. ``Gemma3nTextModel.fast_prefill_forward`` already handles None
(gemma3n.py L920-925 and L953-958 at 91864b79). When ``logits_indices_padded`` is None it runs the cross-decoder on
every token (``torch.arange(batch_size)``). When ``num_logits_indices`` is None it returns the cross-decoder's
output as is. For a uniform-decode graph every token needs logits, so what the graph captures equals what an
eager decode computes.
Modelled: a 4-layer Gemma3n text model with hidden size 8, one attention head of size 8, neox RoPE, Gemma
RMSNorm and a GELU MLP per layer. Layers 0-1 are the self-decoder and own their KV caches. Layers 2-3 are the
cross-decoder and share layer 1's cache (``kv_sharing_target_layer_name``). AltUp, per-layer inputs, laurel,
sliding windows, q/k norms and the logit soft cap are left out. ``fast_prefill_forward`` keeps its static
``positions`` / ``hidden_states`` buffers and the gather and scatter of the logits rows. The attention backend is
FlashAttention, reduced to ``reshape_and_cache_flash`` (which skips ``PAD_SLOT_ID``) and a paged varlen
``flash_attn_varlen_func`` in torch (``cu_seqlens_q``, ``seqused_k``, block table; causal, bottom-right aligned).
There is no shape-dependent host work, so it can run inside a FULL graph. Graph mode is FULL_AND_PIECEWISE with
capture sizes [1, 2, 4]: FULL graphs for uniform decode; mixed and prefill batches (the PIECEWISE path) run
eagerly, since the attention and the fast-prefill glue run outside the pieces anyway. ``CUDAGraphWrapper``
captures on a FULL dummy run and replays on a matching batch descriptor. There is one warmup dummy run per size
(``cudagraph_num_of_warmups = 1``). Block size 4, 4 blocks per request, block 0 is the null block that dummy runs
write to. Three requests are served over six steps: two prefill-only or mixed steps, and four decode steps of 2 or
3 requests (3 is padded to the graph of 4). Input tokens come from the workload rather than from sampling. The
outputs are each step's logits and the KV caches.
"""

import contextlib
import enum
from dataclasses import dataclass, fields
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/28537"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "__init__"
SYMPTOM = ("Gemma3n with --kv-sharing-fast-prefill fails to start with CUDA graphs: the FULL-graph capture dummy run "
           "builds fast-prefill attention metadata without logits indices and its __init__ asserts "
           "(AssertionError); --enforce-eager serves fine")

PAD_SLOT_ID = -1
VOCAB, HIDDEN, HEAD_DIM, INTERMEDIATE = 16, 8, 8, 16
NUM_HIDDEN_LAYERS, NUM_KV_SHARED_LAYERS = 4, 2
RMS_NORM_EPS, ROPE_THETA = 1e-6, 10000.0
BLOCK_SIZE, MAX_BLOCKS_PER_REQ = 4, 4
MAX_MODEL_LEN = BLOCK_SIZE * MAX_BLOCKS_PER_REQ
MAX_NUM_REQS, MAX_NUM_BATCHED_TOKENS = 4, 16
NUM_BLOCKS = 1 + 3 * MAX_BLOCKS_PER_REQ               # block 0: the null block
CUDAGRAPH_CAPTURE_SIZES = [1, 2, 4]


# --- vllm/config/compilation.py -------------------------------------------------------------------------------------

class CUDAGraphMode(enum.Enum):
    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_AND_PIECEWISE = 3


class VllmConfig:
    def __init__(self, enforce_eager: bool):
        self.cudagraph_mode = CUDAGraphMode.NONE if enforce_eager else CUDAGraphMode.FULL_AND_PIECEWISE
        self.cudagraph_capture_sizes = sorted(CUDAGRAPH_CAPTURE_SIZES)
        self.max_capture_size = self.cudagraph_capture_sizes[-1]
        self.bs_to_padded_graph_size = [0] * (self.max_capture_size + 1)
        for bs in range(1, self.max_capture_size + 1):
            self.bs_to_padded_graph_size[bs] = next(s for s in self.cudagraph_capture_sizes if s >= bs)
        self.kv_sharing_fast_prefill = True          # cache_config.kv_sharing_fast_prefill
        self.cudagraph_num_of_warmups = 1

    def pad_for_cudagraph(self, batch_size: int) -> int:
        return self.bs_to_padded_graph_size[batch_size]


# --- vllm/forward_context.py ----------------------------------------------------------------------------------------

@dataclass
class BatchDescriptor:
    num_tokens: int
    uniform_decode: bool = False


@dataclass
class ForwardContext:
    attn_metadata: Any
    cudagraph_runtime_mode: CUDAGraphMode
    batch_descriptor: BatchDescriptor | None
    num_actual_tokens: int                           # modelling: the real tokens of a padded FULL replay


_forward_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    assert _forward_context is not None
    return _forward_context


@contextlib.contextmanager
def set_forward_context(attn_metadata, num_actual_tokens, cudagraph_runtime_mode=CUDAGraphMode.NONE,
                        batch_descriptor=None):
    global _forward_context
    prev = _forward_context
    _forward_context = ForwardContext(attn_metadata, cudagraph_runtime_mode, batch_descriptor, num_actual_tokens)
    try:
        yield
    finally:
        _forward_context = prev


# --- vllm/v1/attention/backends/utils.py ----------------------------------------------------------------------------

@dataclass
class CommonAttentionMetadata:
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool = True
    # Needed by FastPrefillAttentionBuilder
    logits_indices_padded: torch.Tensor | None = None
    num_logits_indices: int | None = None


class AttentionMetadataBuilder:
    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build=False):
        raise NotImplementedError

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata):
        """Build attention metadata for CUDA graph capture. Uses build by default."""
        return self.build(common_prefix_len=0, common_attn_metadata=common_attn_metadata)


def make_kv_sharing_fast_prefill_common_attn_metadata(
        common_attn_metadata: CommonAttentionMetadata) -> CommonAttentionMetadata:
    if common_attn_metadata.max_query_len == 1:
        # All requests are decode (assume 1 token for now)
        # Skip computing fast prefill path
        return common_attn_metadata

    assert common_attn_metadata.logits_indices_padded is not None
    assert common_attn_metadata.num_logits_indices is not None

    logits_indices_padded = common_attn_metadata.logits_indices_padded
    num_logits_indices = common_attn_metadata.num_logits_indices
    # Get rid of CUDAGraph padding, if any
    logits_indices = logits_indices_padded[:num_logits_indices]
    num_reqs = common_attn_metadata.num_reqs
    query_start_loc = common_attn_metadata.query_start_loc
    seq_lens = common_attn_metadata.seq_lens
    # Find how many decode indices belong to each request
    request_ids = torch.bucketize(logits_indices, query_start_loc[1:], right=True)
    # Figure out how many tokens are in each request
    num_decode_tokens = torch.bincount(request_ids, minlength=num_reqs)
    # Calculate new query_start_loc with tokens in generation_indices
    decode_query_start_loc = torch.empty(num_reqs + 1, device=query_start_loc.device, dtype=query_start_loc.dtype)
    decode_query_start_loc[0] = 0
    decode_query_start_loc[1:] = torch.cumsum(num_decode_tokens, dim=0)
    decode_max_query_len = int(num_decode_tokens.max().item())
    total_num_decode_tokens = int(num_decode_tokens.sum().item())

    return CommonAttentionMetadata(
        query_start_loc=decode_query_start_loc,
        seq_lens=seq_lens,
        num_reqs=num_reqs,
        num_actual_tokens=total_num_decode_tokens,
        max_query_len=decode_max_query_len,
        max_seq_len=common_attn_metadata.max_seq_len,
        block_table_tensor=common_attn_metadata.block_table_tensor,
        slot_mapping=common_attn_metadata.slot_mapping,
        causal=True,
    )


def subclass_attention_backend(name_prefix: str, attention_backend_cls, builder_cls):
    """Return a new subclass where `get_builder_cls` returns `builder_cls`."""
    name: str = name_prefix + attention_backend_cls.__name__
    return type(name, (attention_backend_cls,), {"get_builder_cls": staticmethod(lambda: builder_cls)})


@runtime_checkable
class KVSharingFastPrefillMetadata(Protocol):
    logits_indices_padded: torch.Tensor | None = None
    num_logits_indices: int | None = None


def create_fast_prefill_custom_backend(prefix: str, underlying_attn_backend, variant: str):
    underlying_builder = underlying_attn_backend.get_builder_cls()

    class FastPrefillAttentionBuilder(underlying_builder):  # type: ignore

        def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
                  fast_build: bool = False):
            new_common_attn_metadata = make_kv_sharing_fast_prefill_common_attn_metadata(common_attn_metadata)
            metadata = super().build(common_prefix_len, new_common_attn_metadata, fast_build)

            class KVSharingFastPrefillAttentionMetadata(metadata.__class__, KVSharingFastPrefillMetadata):

                def __init__(self, metadata, common_attn_metadata):
                    # Shallow copy all fields in metadata cls
                    for _field in fields(metadata.__class__):
                        setattr(self, _field.name, getattr(metadata, _field.name))

                    if variant == "bug":
                        # Set additional fields that will be used in model code
                        assert (common_attn_metadata.logits_indices_padded is not None
                                and common_attn_metadata.num_logits_indices is not None)
                    # (fix, #28537) no assertion: a capture dummy run has no logits information, and the
                    # fields stay None, which Gemma3n's fast_prefill_forward handles
                    self.logits_indices_padded = common_attn_metadata.logits_indices_padded
                    self.num_logits_indices = common_attn_metadata.num_logits_indices

            return KVSharingFastPrefillAttentionMetadata(metadata, common_attn_metadata)

    return subclass_attention_backend(name_prefix=prefix, attention_backend_cls=underlying_attn_backend,
                                      builder_cls=FastPrefillAttentionBuilder)


# --- vllm/v1/attention/backends/flash_attn.py -----------------------------------------------------------------------

@dataclass
class FlashAttentionMetadata:
    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor
    max_seq_len: int
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool = True


class FlashAttentionMetadataBuilder(AttentionMetadataBuilder):
    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> FlashAttentionMetadata:
        m = common_attn_metadata
        return FlashAttentionMetadata(num_actual_tokens=m.num_actual_tokens, max_query_len=m.max_query_len,
                                      query_start_loc=m.query_start_loc, max_seq_len=m.max_seq_len,
                                      seq_lens=m.seq_lens, block_table=m.block_table_tensor,
                                      slot_mapping=m.slot_mapping, causal=m.causal)


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping):
    """Write each token's K/V at its slot; a PAD_SLOT_ID slot is skipped (the kernel returns early)."""
    num_tokens = slot_mapping.shape[0]
    flat_k, flat_v = key_cache.view(-1, HEAD_DIM), value_cache.view(-1, HEAD_DIM)
    valid = (slot_mapping >= 0)[:, None]
    slot = slot_mapping.clamp(min=0).long()
    flat_k[slot] = torch.where(valid, key[:num_tokens], flat_k[slot])
    flat_v[slot] = torch.where(valid, value[:num_tokens], flat_v[slot])


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, seqused_k, block_table, softmax_scale, causal=True):
    """Paged varlen attention, causal and aligned bottom-right: query ``i`` of a sequence with ``q_len`` queries
    sees the keys at positions ``<= seqused_k - q_len + i``. Tokens past ``cu_seqlens_q[-1]`` (padding) produce
    rows nobody reads."""
    num_tokens, num_seqs = q.shape[0], cu_seqlens_q.shape[0] - 1
    tok = torch.arange(num_tokens, device=q.device)
    seq = torch.bucketize(tok, cu_seqlens_q[1:], right=True).clamp(max=num_seqs - 1)
    q_start = cu_seqlens_q[seq]
    q_len = cu_seqlens_q[seq + 1] - q_start
    q_pos = seqused_k[seq] - q_len + (tok - q_start)
    blocks = block_table[seq].long()                                      # [T, MAX_BLOCKS_PER_REQ]
    keys = k[blocks].reshape(num_tokens, -1, HEAD_DIM)
    vals = v[blocks].reshape(num_tokens, -1, HEAD_DIM)
    k_pos = torch.arange(keys.shape[1], device=q.device)
    scores = (keys @ q[:, :, None]).squeeze(-1) * softmax_scale
    scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], -1e9)
    return (torch.softmax(scores, dim=-1)[:, None, :] @ vals).squeeze(1)


class FlashAttentionImpl:
    def __init__(self, scale, kv_sharing_target_layer_name):
        self.scale = scale
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name

    def forward(self, layer, query, key, value, kv_cache, attn_metadata: FlashAttentionMetadata):
        key_cache, value_cache = kv_cache.unbind(0)
        # a KV-sharing layer reads the target layer's cache and writes nothing
        if self.kv_sharing_target_layer_name is None:
            reshape_and_cache_flash(key, value, key_cache, value_cache, attn_metadata.slot_mapping)
        return flash_attn_varlen_func(query, key_cache, value_cache, cu_seqlens_q=attn_metadata.query_start_loc,
                                      seqused_k=attn_metadata.seq_lens, block_table=attn_metadata.block_table,
                                      softmax_scale=self.scale, causal=attn_metadata.causal)


class FlashAttentionBackend:
    @staticmethod
    def get_builder_cls():
        return FlashAttentionMetadataBuilder


# --- vllm/attention/layer.py ----------------------------------------------------------------------------------------

class Attention:
    def __init__(self, prefix: str, kv_sharing_target_layer_name: str | None):
        self.layer_name = prefix
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.impl = FlashAttentionImpl(HEAD_DIM ** -0.5, kv_sharing_target_layer_name)
        self.kv_cache: torch.Tensor | None = None          # bound by the runner (bind_kv_cache)

    def forward(self, query, key, value):
        attn_metadata = get_forward_context().attn_metadata
        if isinstance(attn_metadata, dict):
            attn_metadata = attn_metadata[self.layer_name]
        return self.impl.forward(self, query, key, value, self.kv_cache, attn_metadata)


# --- vllm/model_executor/models/gemma3n.py --------------------------------------------------------------------------

def rms_norm(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_NORM_EPS) * (1.0 + weight)


def rotary_emb(positions, x):
    half = HEAD_DIM // 2
    inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(half, device=x.device, dtype=torch.float32) / half))
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    x1, x2 = x[:, :half], x[:, half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Gemma3nDecoderLayer:
    def __init__(self, layer_idx, kv_sharing_target_layer_name, gen, device):
        self.input_layernorm = 0.1 * randn(HIDDEN, gen=gen, device=device)
        self.qkv_proj = randn(HIDDEN, 3 * HEAD_DIM, gen=gen, device=device, scale=HIDDEN ** -0.5)
        self.o_proj = randn(HEAD_DIM, HIDDEN, gen=gen, device=device, scale=HEAD_DIM ** -0.5)
        self.pre_feedforward_layernorm = 0.1 * randn(HIDDEN, gen=gen, device=device)
        self.gate_up_proj = randn(HIDDEN, 2 * INTERMEDIATE, gen=gen, device=device, scale=HIDDEN ** -0.5)
        self.down_proj = randn(INTERMEDIATE, HIDDEN, gen=gen, device=device, scale=INTERMEDIATE ** -0.5)
        self.attn = Attention(f"model.layers.{layer_idx}.self_attn.attn", kv_sharing_target_layer_name)

    def forward(self, positions, hidden_states):
        x = rms_norm(hidden_states, self.input_layernorm)
        q, k, v = (x @ self.qkv_proj).split(HEAD_DIM, dim=-1)
        q, k = rotary_emb(positions, q), rotary_emb(positions, k)
        hidden_states = hidden_states + self.attn.forward(q, k, v) @ self.o_proj
        gate, up = (rms_norm(hidden_states, self.pre_feedforward_layernorm) @ self.gate_up_proj).chunk(2, dim=-1)
        return hidden_states + (F.gelu(gate, approximate="tanh") * up) @ self.down_proj


class Gemma3nSelfDecoder:
    def __init__(self, embed_tokens, decoder_layers):
        self.embed_tokens, self.layers = embed_tokens, decoder_layers

    def forward(self, input_ids, positions):
        hidden_states = self.embed_tokens[input_ids] * HIDDEN ** 0.5
        for layer in self.layers:
            hidden_states = layer.forward(positions, hidden_states)
        return hidden_states


class Gemma3nCrossDecoder:
    def __init__(self, decoder_layers):
        self.layers = decoder_layers

    def forward(self, positions, hidden_states):
        for layer in self.layers:
            hidden_states = layer.forward(positions, hidden_states)
        return hidden_states


class Gemma3nTextModel:
    def __init__(self, device):
        gen = generator(28537)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device, scale=0.5)
        first_kv_shared_layer_idx = NUM_HIDDEN_LAYERS - NUM_KV_SHARED_LAYERS
        target = f"model.layers.{first_kv_shared_layer_idx - 1}.self_attn.attn"
        self.layers = [Gemma3nDecoderLayer(i, None if i < first_kv_shared_layer_idx else target, gen, device)
                       for i in range(NUM_HIDDEN_LAYERS)]
        # Layer idx 0-1 are self-decoder layers in You Only Cache Once (YOCO); 2-3 are cross-decoder layers
        self.self_decoder = Gemma3nSelfDecoder(self.embed_tokens, self.layers[:first_kv_shared_layer_idx])
        self.cross_decoder = Gemma3nCrossDecoder(self.layers[first_kv_shared_layer_idx:])
        self.norm = 0.1 * randn(HIDDEN, gen=gen, device=device)
        self.fast_prefill_enabled = True
        # Allocate static buffers for CUDAGraph
        self.positions = torch.zeros(MAX_NUM_BATCHED_TOKENS, dtype=torch.int64, device=device)
        self.hidden_states = torch.zeros(MAX_NUM_BATCHED_TOKENS, HIDDEN, device=device)

    def fast_prefill_forward(self, input_ids, positions):
        logits_indices_padded, num_logits_indices = None, None
        attn_metadata = get_forward_context().attn_metadata

        # attn_metadata is None during dummy runs
        if self.fast_prefill_enabled and attn_metadata is not None:
            assert isinstance(attn_metadata, dict)
            # Last layer is a KV sharing layer
            layer_attn_metadata = attn_metadata[self.layers[-1].attn.layer_name]
            if isinstance(layer_attn_metadata, KVSharingFastPrefillMetadata):
                logits_indices_padded = layer_attn_metadata.logits_indices_padded
                num_logits_indices = layer_attn_metadata.num_logits_indices

        # Copy inputs for cudagraph
        batch_size = positions.size(0)
        self.positions[:batch_size].copy_(positions)
        self_decoder_hidden_states = self.self_decoder.forward(input_ids, self.positions[:batch_size])

        if logits_indices_padded is None:
            logits_indices_padded = torch.arange(batch_size, dtype=positions.dtype, device=positions.device)

        hidden_states = self_decoder_hidden_states.clone()

        # Copy inputs for cudagraph
        num_padded_logits_indices = logits_indices_padded.size(0)
        self.positions[:num_padded_logits_indices].copy_(positions[logits_indices_padded])
        self.hidden_states[:num_padded_logits_indices].copy_(self_decoder_hidden_states[logits_indices_padded])
        cross_decoder_hidden_states = self.cross_decoder.forward(self.positions[:num_padded_logits_indices],
                                                                 self.hidden_states[:num_padded_logits_indices])

        if num_logits_indices is not None:
            assert num_logits_indices > 0
            # Merge cross-decoder and self-decoder hidden states
            hidden_states[logits_indices_padded[:num_logits_indices]] = cross_decoder_hidden_states[
                :num_logits_indices]
        else:
            hidden_states = cross_decoder_hidden_states
        return hidden_states

    def forward(self, input_ids, positions):
        hidden_states = self.fast_prefill_forward(input_ids, positions)
        return rms_norm(hidden_states, self.norm)


class Gemma3nForCausalLM:
    def __init__(self, device):
        self.model = Gemma3nTextModel(device)

    def __call__(self, input_ids, positions):
        return self.model.forward(input_ids, positions)

    def compute_logits(self, hidden_states):
        return hidden_states @ self.model.embed_tokens.T

    def attention_layers(self) -> dict[str, Attention]:
        return {layer.attn.layer_name: layer.attn for layer in self.model.layers}


# --- vllm/compilation/cuda_graph.py ---------------------------------------------------------------------------------

class CUDAGraphWrapper:
    """FULL graphs of the whole model forward, one per batch descriptor."""

    def __init__(self, runnable, runtime_mode: CUDAGraphMode, device, padded_inputs: dict[str, torch.Tensor]):
        self.runnable, self.runtime_mode, self.device = runnable, runtime_mode, device
        self.padded_inputs = padded_inputs           # modelling: the runner's inputs whose padded rows are stale
        self.concrete_cudagraph_entries: dict[tuple, tuple] = {}

    def __getattr__(self, name):
        return getattr(self.runnable, name)

    def __call__(self, input_ids, positions):
        ctx = get_forward_context()
        if ctx.cudagraph_runtime_mode != self.runtime_mode:
            return self.runnable(input_ids, positions)
        key = (ctx.batch_descriptor.num_tokens, ctx.batch_descriptor.uniform_decode)
        if key not in self.concrete_cudagraph_entries:
            # capture (the warmups were the runner's NONE-mode dummy runs)
            g, out = capture(lambda: self.runnable(input_ids, positions), device=self.device, warmups=0,
                             name=f"FULL uniform decode {key[0]}")
            self.concrete_cudagraph_entries[key] = (g, out)
            return out
        g, out = self.concrete_cudagraph_entries[key]
        return replay(g, out, real=ctx.num_actual_tokens, size=key[0], padded=self.padded_inputs)


# --- vllm/v1/worker/gpu_model_runner.py -----------------------------------------------------------------------------

class GPUModelRunner:
    def __init__(self, model: Gemma3nForCausalLM, device, variant, enforce_eager):
        self.device, self.variant = device, variant
        self.vllm_config = VllmConfig(enforce_eager)
        self.cudagraph_mode = self.vllm_config.cudagraph_mode
        self.cudagraph_batch_sizes = self.vllm_config.cudagraph_capture_sizes
        self.uniform_decode_query_len = 1
        self.max_model_len = MAX_MODEL_LEN
        i32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(MAX_NUM_BATCHED_TOKENS, dtype=torch.long, device=device)
        self.positions = torch.zeros(MAX_NUM_BATCHED_TOKENS, dtype=torch.int64, device=device)
        self.query_start_loc = torch.zeros(MAX_NUM_REQS + 1, **i32)
        self.seq_lens = torch.zeros(MAX_NUM_REQS, **i32)
        self.block_table = torch.zeros(MAX_NUM_REQS, MAX_BLOCKS_PER_REQ, **i32)   # input_batch.block_table
        self.slot_mapping = torch.zeros(MAX_NUM_BATCHED_TOKENS, dtype=torch.int64, device=device)
        self.kv_sharing_fast_prefill_logits_indices = torch.zeros(MAX_NUM_BATCHED_TOKENS, dtype=torch.int64,
                                                                  device=device)
        self.model = model
        self.initialize_kv_cache()
        if self.cudagraph_mode != CUDAGraphMode.NONE:
            self.model = CUDAGraphWrapper(model, CUDAGraphMode.FULL, device,
                                          padded_inputs={"input_ids": self.input_ids, "positions": self.positions})
            self.capture_model()

    # ---- initialize_kv_cache / initialize_attn_backend --------------------------------------------------------------
    def initialize_kv_cache(self):
        layers = self.model.attention_layers()
        self.kv_caches: dict[str, torch.Tensor] = {}
        for name, attn in layers.items():
            if attn.kv_sharing_target_layer_name is None:
                self.kv_caches[name] = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM, device=self.device)
        for name, attn in layers.items():                      # bind_kv_cache: shared layers reuse the target's
            attn.kv_cache = self.kv_caches[attn.kv_sharing_target_layer_name or name]
        self.kv_sharing_fast_prefill_eligible_layers = {
            name for name, attn in layers.items() if attn.kv_sharing_target_layer_name is not None}
        # initialize_attn_backend: the eligible layers get the fast-prefill backend (a group of their own)
        groups: dict[type, list[str]] = {}
        for name in layers:
            attn_backend = FlashAttentionBackend
            if self.vllm_config.kv_sharing_fast_prefill and name in self.kv_sharing_fast_prefill_eligible_layers:
                attn_backend = self._fast_prefill_backend()
            groups.setdefault(attn_backend, []).append(name)
        self.attn_groups = [(backend.get_builder_cls()(), names) for backend, names in groups.items()]

    def _fast_prefill_backend(self):
        if not hasattr(self, "_fp_backend"):
            self._fp_backend = create_fast_prefill_custom_backend("FastPrefill", FlashAttentionBackend, self.variant)
        return self._fp_backend

    def _build_attention_metadata(self, common_attn_metadata, for_cudagraph_capture=False):
        attn_metadata: dict[str, Any] = {}
        for builder, layer_names in self.attn_groups:
            if for_cudagraph_capture:
                attn_metadata_i = builder.build_for_cudagraph_capture(common_attn_metadata)
            else:
                attn_metadata_i = builder.build(common_prefix_len=0, common_attn_metadata=common_attn_metadata)
            for layer_name in layer_names:
                attn_metadata[layer_name] = attn_metadata_i
        return attn_metadata

    # ---- a real step --------------------------------------------------------------------------------------------
    def _prepare_kv_sharing_fast_prefill(self, logits_indices: torch.Tensor) -> torch.Tensor:
        assert self.kv_sharing_fast_prefill_logits_indices is not None
        num_logits = logits_indices.shape[0]
        assert num_logits > 0
        self.kv_sharing_fast_prefill_logits_indices[:num_logits].copy_(logits_indices)
        # There might have leftover indices in logits_indices[num_logits:] from previous iterations, whose values
        # may be greater than the batch size in the current iteration. To ensure indices are always valid, we
        # fill the padded indices with the last index.
        self.kv_sharing_fast_prefill_logits_indices[num_logits:].fill_(logits_indices[-1].item())
        if self.cudagraph_mode != CUDAGraphMode.NONE and num_logits <= self.cudagraph_batch_sizes[-1]:
            # Use piecewise CUDA graphs. Add padding to the batch size.
            num_logits_padded = self.vllm_config.pad_for_cudagraph(num_logits)
        else:
            num_logits_padded = num_logits
        return self.kv_sharing_fast_prefill_logits_indices[:num_logits_padded]

    def _prepare_inputs(self, scheduled):
        """``scheduled``: per request, (its blocks, tokens already computed, its new token ids)."""
        dev = self.device
        num_reqs = len(scheduled)
        tokens = [t for _, _, toks in scheduled for t in toks]
        num_tokens = len(tokens)
        positions, slots, cu = [], [], [0]
        for blocks, computed, toks in scheduled:
            for p in range(computed, computed + len(toks)):
                positions.append(p)
                slots.append(blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
            cu.append(cu[-1] + len(toks))
        self.input_ids[:num_tokens].copy_(torch.tensor(tokens).to(dev))
        self.positions[:num_tokens].copy_(torch.tensor(positions).to(dev))
        self.query_start_loc[:num_reqs + 1].copy_(torch.tensor(cu, dtype=torch.int32).to(dev))
        # Note: pad query_start_loc to be non-decreasing, as kernels like FlashAttention require that
        self.query_start_loc[num_reqs + 1:].fill_(num_tokens)
        self.seq_lens[:num_reqs].copy_(torch.tensor([c + len(t) for _, c, t in scheduled], dtype=torch.int32).to(dev))
        self.seq_lens[num_reqs:].fill_(0)
        rows = [blocks + [0] * (MAX_BLOCKS_PER_REQ - len(blocks)) for blocks, _, _ in scheduled]
        self.block_table[:num_reqs].copy_(torch.tensor(rows, dtype=torch.int32).to(dev))
        self.slot_mapping[:num_tokens].copy_(torch.tensor(slots).to(dev))
        self.slot_mapping[num_tokens:].fill_(PAD_SLOT_ID)
        max_query_len = max(len(t) for _, _, t in scheduled)

        logits_indices = self.query_start_loc[1:num_reqs + 1].long() - 1
        logits_indices_padded, num_logits_indices = None, None
        if self.vllm_config.kv_sharing_fast_prefill:
            logits_indices_padded = self._prepare_kv_sharing_fast_prefill(logits_indices)
            num_logits_indices = logits_indices.size(0)

        common_attn_metadata = CommonAttentionMetadata(
            query_start_loc=self.query_start_loc[:num_reqs + 1], seq_lens=self.seq_lens[:num_reqs],
            num_reqs=num_reqs, num_actual_tokens=num_tokens, max_query_len=max_query_len,
            max_seq_len=int(max(c + len(t) for _, c, t in scheduled)), block_table_tensor=self.block_table[:num_reqs],
            slot_mapping=self.slot_mapping[:num_tokens], causal=True,
            logits_indices_padded=logits_indices_padded, num_logits_indices=num_logits_indices)
        attn_metadata = self._build_attention_metadata(common_attn_metadata)
        return attn_metadata, logits_indices, num_tokens, max_query_len

    def execute_model(self, scheduled):
        attn_metadata, logits_indices, num_tokens, max_query_len = self._prepare_inputs(scheduled)
        num_input_tokens = num_tokens
        if self.cudagraph_mode != CUDAGraphMode.NONE and num_tokens <= self.cudagraph_batch_sizes[-1]:
            num_input_tokens = self.vllm_config.pad_for_cudagraph(num_tokens)
        uniform_decode = max_query_len == self.uniform_decode_query_len
        # cudagraph_dispatcher: FULL graphs serve uniform decode batches; the rest takes the PIECEWISE path
        # (modelled eagerly)
        mode = CUDAGraphMode.FULL if (self.cudagraph_mode != CUDAGraphMode.NONE and uniform_decode) \
            else CUDAGraphMode.NONE
        with set_forward_context(attn_metadata, num_tokens, mode, BatchDescriptor(num_input_tokens, uniform_decode)):
            hidden_states = self.model(self.input_ids[:num_input_tokens], self.positions[:num_input_tokens])
        sample_hidden_states = hidden_states[logits_indices]
        return self.model.compute_logits(sample_hidden_states).clone()

    # ---- capture --------------------------------------------------------------------------------------------------
    def _dummy_run(self, num_tokens, cudagraph_runtime_mode=CUDAGraphMode.NONE, force_attention=False,
                   uniform_decode=False):
        max_query_len = self.uniform_decode_query_len if uniform_decode else num_tokens
        num_reqs = -(-num_tokens // max_query_len) if uniform_decode else 1
        attn_metadata = None
        if force_attention or cudagraph_runtime_mode == CUDAGraphMode.FULL:
            seq_lens = max_query_len
            self.seq_lens[:num_reqs].fill_(seq_lens)
            self.seq_lens[num_reqs:].fill_(0)
            self.query_start_loc[:num_reqs + 1].copy_(
                torch.arange(0, num_tokens + 1, max_query_len, dtype=torch.int32, device=self.device)[:num_reqs + 1])
            # no logits information in a dummy batch: logits_indices_padded / num_logits_indices keep their
            # defaults (None)
            common_attn_metadata = CommonAttentionMetadata(
                query_start_loc=self.query_start_loc[:num_reqs + 1], seq_lens=self.seq_lens[:num_reqs],
                num_reqs=num_reqs, num_actual_tokens=num_tokens, max_query_len=max_query_len,
                max_seq_len=self.max_model_len, block_table_tensor=self.block_table[:num_reqs],
                slot_mapping=self.slot_mapping[:num_tokens], causal=True)
            attn_metadata = self._build_attention_metadata(common_attn_metadata, for_cudagraph_capture=True)
        with set_forward_context(attn_metadata, num_tokens, cudagraph_runtime_mode,
                                 BatchDescriptor(num_tokens, uniform_decode)):
            return self.model(self.input_ids[:num_tokens], self.positions[:num_tokens])

    def capture_model(self):
        events.static_buffers("GPUModelRunner", {
            "input_ids": self.input_ids, "positions": self.positions, "query_start_loc": self.query_start_loc,
            "seq_lens": self.seq_lens, "block_table": self.block_table, "slot_mapping": self.slot_mapping})
        events.persistent_state("GPUModelRunner", dict(self.kv_caches))
        # FULL_AND_PIECEWISE: FULL graphs for uniform decode batches, largest first
        for num_tokens in sorted(self.cudagraph_batch_sizes, reverse=True):
            for _ in range(self.vllm_config.cudagraph_num_of_warmups):
                # warm up with NONE; FULL implies the attention is captured, so build its metadata
                with events.warmup():
                    self._dummy_run(num_tokens, CUDAGraphMode.NONE, force_attention=True, uniform_decode=True)
            self._dummy_run(num_tokens, CUDAGraphMode.FULL, uniform_decode=True)


def run(variant: str, device: str = "cpu"):
    gen = generator(21590)
    blocks = {"A": [1, 2, 3, 4], "B": [5, 6, 7, 8], "C": [9, 10, 11, 12]}
    # per step, per request: number of new tokens (A and B prefill, decode, C joins as a mixed step, decodes of
    # 3 requests (padded to the graph of 4) and of 2)
    schedule = [{"A": 5, "B": 3}, {"A": 1, "B": 1}, {"A": 1, "B": 1, "C": 6},
                {"A": 1, "B": 1, "C": 1}, {"A": 1, "C": 1}, {"A": 1, "B": 1, "C": 1}]
    computed = {r: 0 for r in blocks}
    steps = []
    for step in schedule:
        scheduled = []
        for r, n in step.items():
            scheduled.append((blocks[r], computed[r], torch.randint(0, VOCAB, (n,), generator=gen).tolist()))
            computed[r] += n
        steps.append(scheduled)
    model = Gemma3nForCausalLM(device)

    def serve(enforce_eager: bool):
        runner = GPUModelRunner(model, device, variant, enforce_eager)
        outs = [runner.execute_model(step) for step in steps]
        return outs + [kv[:, 1:].clone() for kv in runner.kv_caches.values()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(False), lambda: serve(True))
