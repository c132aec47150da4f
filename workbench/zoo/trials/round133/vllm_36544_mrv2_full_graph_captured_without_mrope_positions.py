"""vLLM's Model Runner V2 with an M-RoPE multimodal model (Qwen2-VL family) and FULL decode CUDA graphs: the CUDA graph
rework #35959 moved capture into a new ``ModelCudaGraphManager.capture``, whose ``forward_fn`` calls the model with only
``input_ids`` and the 1-D ``input_buffers.positions``, dropping the ``model_state.prepare_dummy_inputs`` entries
(``inputs_embeds``, and the 3-row ``mrope_positions`` that override ``positions``). Eager steps still pass
``model_state.prepare_inputs``' M-RoPE positions, but every FULL graph was recorded on the plain 1-D RoPE path, so a
replayed decode step rotates queries and keys of a request with an image at its sequence index instead of its M-RoPE
position (index + ``mrope_position_delta``), and the request's text drifts from what the model computes eagerly.

Upstream: https://github.com/vllm-project/vllm/pull/36544 ("[Model Runner V2] Add model_state inputs to CUDA graph
capture", vllm-project/vllm, by WoosukKwon, merged 2026-03-09 as commit 2a194ddd72a0cc5b6c404a694a64197d0c572f5b,
read in a stored mirror of vLLM's history, local-inference-lab/vllm). Read: the full diff (one line in
``vllm/v1/worker/gpu/cudagraph_utils.py``: ``**model_state.prepare_dummy_inputs(num_reqs, num_tokens)`` added to
``model_inputs`` in ``ModelCudaGraphManager.capture``'s ``forward_fn``); the diff of the regression, #35959 ("[MRV2]
Extensible CG dispatch rework", commit 483463f73, merged the same day), whose old ``capture_graph`` had that line and
whose new ``forward_fn`` lost it; at the fix's parent: ``vllm/v1/worker/gpu/cudagraph_utils.py`` (whole file:
``BatchExecutionDescriptor``, ``_is_compatible``, ``get_uniform_token_count``, ``CudaGraphManager`` ``__init__`` /
``_init_candidates`` / ``capture`` / ``dispatch`` / ``run_fullgraph``, ``ModelCudaGraphManager``,
``prepare_inputs_to_capture``), ``vllm/v1/worker/gpu/model_runner.py`` (``capture_model``, ``_dummy_run``,
``add_requests``, ``prepare_inputs``, ``prepare_attn``, ``execute_model``, ``sample``, ``postprocess``),
``vllm/v1/worker/gpu/model_states/default.py`` (``DefaultModelState``: ``add_request``, ``get_mm_embeddings``,
``prepare_inputs``, ``prepare_dummy_inputs``, ``prepare_attn``), ``vllm/v1/worker/gpu/mm/mrope_utils.py``
(``MRopeState``, ``_prepare_mrope_positions_kernel``), ``vllm/v1/worker/gpu/mm/encoder_runner.py``
(``gather_mm_embeddings``' tail, ``get_inputs_embeds``), ``vllm/v1/worker/gpu/input_batch.py`` (``InputBuffers``,
``InputBatch.make_dummy``), ``vllm/model_executor/layers/rotary_embedding/mrope.py``
(``MRotaryEmbedding.forward_native``: 1-D positions give plain RoPE, [3, N] positions the sectioned M-RoPE) and
``vllm/model_executor/models/qwen2_vl.py`` (``iter_mm_grid_thw``, ``get_mrope_input_positions``).
Not read: the PR's description (the stored thread shows only a bot review of the diff), any issue or user report, the
FlashAttention backend's metadata builder and kernels, ``block_table.py``'s Triton kernels beyond their call sites,
``_prepare_pos_seq_lens`` / ``combine_sampled_and_draft_tokens`` kernels, the PIECEWISE path, Qwen2-VL's vision tower.
Symptom: no user report was read. From the code: with MRV2 (``VLLM_USE_V2_MODEL_RUNNER=1``), a Qwen2-VL-type model and a
FULL decode graph mode, decode steps served by a graph compute rotary embeddings from 1-D positions; for a request
whose prompt holds an image (``mrope_position_delta`` != 0) its generated text differs from eager / ``--enforce-eager``;
text-only requests (delta 0) are unaffected. Inferred, not quoted.
Mechanism: ``execute_model`` builds ``model_inputs`` from ``input_ids``, ``positions``, ``inputs_embeds`` and
``**model_state.prepare_inputs(...)``, which for an M-RoPE model writes ``MRopeState.mrope_positions`` (prefill tokens
from the precomputed grid positions, decode tokens at ``num_computed + delta``) and overrides ``positions`` with it. A
FULL replay passes no inputs: the graph reads what capture bound. After #35959 capture bound ``input_buffers.positions``
(the 1-D sequence index, refreshed every step) and no ``inputs_embeds``, so ``MRotaryEmbedding`` took its 1-D branch at
capture and replays it; the per-step ``mrope_positions`` (and ``inputs_embeds``) the runner writes are never read by
the graph. For an image request the query and the newly cached key are rotated ``-delta`` positions too far relative
to the prefill keys cached with M-RoPE positions.
Doctor: warmup-divergence, at forward_fn. The captured step runs another path than the eager step would (1-D RoPE on
``input_buffers.positions`` instead of M-RoPE on ``mrope_positions``, ids instead of ``inputs_embeds``); that path is
chosen in ``forward_fn``, the callable ``ModelCudaGraphManager.capture`` warms up and captures, where the fix adds the
model state's inputs to ``model_inputs``. Nothing the graph reads is stale: every buffer it binds is rewritten each
step.
Fix (upstream): ``forward_fn``'s ``model_inputs`` gains ``**model_state.prepare_dummy_inputs(num_reqs, num_tokens)``
(``inputs_embeds = encoder_runner.inputs_embeds[:num_tokens]``,
``positions = mrope_state.mrope_positions[:, :num_tokens]``), so the graphs read the buffers ``execute_model`` fills.
Modelled: ``CUDAGraphMode`` (``decode_mode``, ``mixed_mode``, ``separate_routine``), ``BatchExecutionDescriptor``,
``_is_compatible``, ``get_uniform_token_count``, ``CudaGraphManager`` (``_init_candidates``, ``capture``, ``dispatch``,
``run_fullgraph``), ``ModelCudaGraphManager.capture`` with ``create_forward_fn`` / ``forward_fn``,
``prepare_inputs_to_capture``, ``InputBuffers``, ``InputBatch.make_dummy``, ``MRopeState``
(``init_prefill_mrope_positions``, ``prepare_mrope_positions``), ``EncoderRunner`` (``execute_mm_encoder``,
``gather_mm_embeddings``, ``get_inputs_embeds``), ``DefaultModelState`` (``add_request``, ``get_mm_embeddings``,
``prepare_inputs``, ``prepare_dummy_inputs``, ``prepare_attn``), ``BlockTables`` (``gather_block_tables``,
``compute_slot_mappings``, ``get_dummy_block_tables``, ``get_dummy_slot_mappings``), ``build_slot_mappings_by_layer``,
``set_forward_context``, ``MRotaryEmbedding.forward_native``, Qwen2-VL's ``iter_mm_grid_thw`` /
``get_mrope_input_positions`` / ``embed_input_ids``, ``GPUModelRunner`` (``capture_model``, ``add_requests``,
``prepare_inputs``, ``prepare_attn``, ``execute_model``, ``sample``, ``postprocess``).
Stand-ins: a two-layer Qwen2-VL-like decoder (embedding, q/k/v with M-RoPE, ``mrope_section`` [2, 1, 1], rope base 100,
paged attention over a per-layer KV cache, SiLU MLP, lm_head) in float64; the vision tower is one linear map of
per-token patches (no spatial merge: the image grid is given in LLM units); a torch attention stand-in (static shapes; a
KV write with ``PAD_SLOT_ID`` goes to a trash row, where ``reshape_and_cache`` skips it); one block of ``MAX_MODEL_LEN``
slots per request; host-side request bookkeeping (numpy) in place of the GPU request-state kernels; greedy sampling;
``forward_fn`` returns the view of the ``hidden_states`` output buffer it filled (upstream returns None) so that
``kit.capture`` hands it out; cudagraph mode ``FULL_DECODE_ONLY`` (the prefill step runs eagerly, as it would for a
mixed batch without PIECEWISE graphs); no LoRA, DP, spec decoding or offloader.
Workload: capture sizes [1, 2, 4]. Request A: 2 text tokens, a 1x2x3 image (6 placeholder tokens), 2 text tokens
(``mrope_position_delta`` -3); request B: 5 text tokens (delta 0). Step 0 prefills both eagerly (15 tokens), steps 1-3
decode A and B (the size-2 graph), steps 4-5 decode A alone (the size-1 graph). Outputs per step: the sampled rows'
logits and the sampled token ids.
Measured: bug: misbehaves (max |graph - eager| = 16): A's logits differ from the first replayed step on (by at most
1.49, 2.44, 0.62, 0.92 and 6.63 at steps 1-5) and its sampled token differs at steps 4 and 5 (the 16 is a difference of
token ids); B's rows equal eager's at every step. Fix: equals eager (max |graph - eager| = 0).
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
from collections import defaultdict

import numpy as np
import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/36544"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "forward_fn"
SYMPTOM = ("Model Runner V2 with an M-RoPE multimodal model: the FULL decode graphs are captured with the 1-D "
           "positions buffer and no model-state inputs, so replayed decode steps of a request with an image use "
           "plain RoPE at the sequence index instead of its M-RoPE positions, and its output drifts from eager")

MAX_NUM_REQS, MAX_NUM_TOKENS, MAX_MODEL_LEN = 4, 32, 24
CUDAGRAPH_CAPTURE_SIZES = [1, 2, 4]
VOCAB, HIDDEN, NUM_HEADS, HEAD_DIM, PATCH_DIM, NUM_LAYERS = 32, 16, 2, 8, 12, 2
MROPE_SECTION = [2, 1, 1]            # sums to HEAD_DIM // 2
IMAGE_TOKEN_ID = VOCAB - 1
PAD_SLOT_ID = -1
TRASH_SLOT = MAX_NUM_REQS * MAX_MODEL_LEN          # stand-in: where a PAD_SLOT_ID write lands
DTYPE = torch.float64

_variant = "bug"


class CUDAGraphMode(enum.Enum):
    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = (2, 0)

    def __bool__(self) -> bool:
        return self != CUDAGraphMode.NONE

    def separate_routine(self) -> bool:
        return isinstance(self.value, tuple)

    def decode_mode(self) -> CUDAGraphMode:
        return CUDAGraphMode(self.value[0]) if self.separate_routine() else self

    def mixed_mode(self) -> CUDAGraphMode:
        return CUDAGraphMode(self.value[1]) if self.separate_routine() else self


# --- vllm/forward_context.py (reduced) --------------------------------------------------------------------------------

_forward_context = None


@contextlib.contextmanager
def set_forward_context(attn_metadata, num_tokens, cudagraph_runtime_mode, slot_mapping):
    global _forward_context
    prev, _forward_context = _forward_context, (attn_metadata, slot_mapping)
    try:
        yield
    finally:
        _forward_context = prev


# --- the model: a tiny Qwen2-VL (vllm/model_executor/models/qwen2_vl.py, rotary_embedding/mrope.py; reduced) ---------

@dataclasses.dataclass
class MultiModalFeatureSpec:
    data: torch.Tensor            # stand-in: per-token patches [t*h*w, PATCH_DIM]
    grid_thw: tuple               # stand-in: the grid in LLM tokens (after the spatial merge)
    offset: int                   # mm_position.offset
    identifier: str               # mm_hash

    @property
    def length(self) -> int:
        return self.grid_thw[0] * self.grid_thw[1] * self.grid_thw[2]


class MRotaryEmbedding:
    def __init__(self, device, base=100.0):
        inv_freq = 1.0 / base ** (torch.arange(0, HEAD_DIM, 2, dtype=DTYPE) / HEAD_DIM)
        freqs = torch.outer(torch.arange(MAX_MODEL_LEN, dtype=DTYPE), inv_freq)
        self.cos_sin_cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)

    def forward_native(self, positions, query, key):
        """positions: [num_tokens] (text only) or [3, num_tokens] (T/H/W positions with multimodal inputs)."""
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)
        if positions.ndim == 2:
            cos = torch.cat([m[i] for i, m in enumerate(cos.split(MROPE_SECTION, dim=-1))], dim=-1)
            sin = torch.cat([m[i] for i, m in enumerate(sin.split(MROPE_SECTION, dim=-1))], dim=-1)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)

        def rotate(x):
            x1, x2 = x.chunk(2, dim=-1)
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        return rotate(query), rotate(key)


class Attention:
    """The attention layer: writes this step's K/V at ``slot_mapping`` and attends over the request's block."""

    def __init__(self, layer_name, kv_cache):
        self.layer_name, self.kv_cache = layer_name, kv_cache      # [2, TRASH_SLOT + 1, heads, head_dim]

    def forward(self, q, k, v):
        attn_metadata, slot_mapping = _forward_context
        meta, slots = attn_metadata[self.layer_name], slot_mapping[self.layer_name]
        n = q.shape[0]
        slots = torch.where(slots[:n] >= 0, slots[:n], TRASH_SLOT)
        self.kv_cache[0].index_copy_(0, slots, k)
        self.kv_cache[1].index_copy_(0, slots, v)
        qsl = meta["query_start_loc"]
        t = torch.arange(n, dtype=qsl.dtype, device=q.device)
        b = torch.searchsorted(qsl[1:], t, right=True).clamp(max=qsl.shape[0] - 2)
        context_pos = meta["seq_lens"][b] - (qsl[1:][b] - t)               # this token's index in its sequence
        j = torch.arange(MAX_MODEL_LEN, device=q.device)
        kv_slots = meta["block_table"][b, 0].long()[:, None] * MAX_MODEL_LEN + j[None, :]
        scores = torch.einsum("nhd,nlhd->nhl", q, self.kv_cache[0][kv_slots]) / HEAD_DIM ** 0.5
        scores = scores.masked_fill(~(j[None, :] <= context_pos[:, None])[:, None, :], float("-inf"))
        return torch.einsum("nhl,nlhd->nhd", torch.softmax(scores, dim=-1), self.kv_cache[1][kv_slots])


class Qwen2VLForConditionalGeneration:
    def __init__(self, device, kv_caches):
        gen = generator(36544)
        r = lambda *s, scale=0.25: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)
        self.embed_tokens, self.lm_head = r(VOCAB, HIDDEN, scale=1.0), r(HIDDEN, VOCAB)
        self.visual = r(PATCH_DIM, HIDDEN)
        self.layers = [{"qkv": r(HIDDEN, 3 * HIDDEN), "o": r(HIDDEN, HIDDEN), "up": r(HIDDEN, 2 * HIDDEN),
                        "down": r(2 * HIDDEN, HIDDEN), "attn": Attention(f"layers.{i}.attn", kv_caches[i])}
                       for i in range(NUM_LAYERS)]
        self.rotary_emb = MRotaryEmbedding(device)

    def iter_mm_grid_thw(self, mm_features):
        for f in sorted(mm_features, key=lambda f: f.offset):
            yield f.offset, f.grid_thw[0], f.grid_thw[1], f.grid_thw[2], 1.0

    def get_mrope_input_positions(self, input_tokens, mm_features):
        llm_pos_ids_list: list = []
        st = 0
        for offset, llm_grid_t, llm_grid_h, llm_grid_w, _ in self.iter_mm_grid_thw(mm_features):
            text_len = offset - st
            st_idx = llm_pos_ids_list[-1].max() + 1 if len(llm_pos_ids_list) > 0 else 0
            llm_pos_ids_list.append(np.broadcast_to(np.arange(text_len), (3, text_len)) + st_idx)
            grid_indices = np.indices((llm_grid_t, llm_grid_h, llm_grid_w))
            llm_pos_ids_list.append(grid_indices.reshape(3, -1) + text_len + st_idx)
            st = offset + llm_grid_t * llm_grid_h * llm_grid_w
        if st < len(input_tokens):
            st_idx = llm_pos_ids_list[-1].max() + 1 if len(llm_pos_ids_list) > 0 else 0
            text_len = len(input_tokens) - st
            llm_pos_ids_list.append(np.broadcast_to(np.arange(text_len), (3, text_len)) + st_idx)
        llm_positions = np.concatenate(llm_pos_ids_list, axis=1).reshape(3, -1)
        mrope_position_delta = (llm_positions.max() + 1 - len(input_tokens)).item()
        return torch.from_numpy(llm_positions), mrope_position_delta

    def embed_multimodal(self, pixel_values):
        return pixel_values @ self.visual

    def embed_input_ids(self, input_ids, multimodal_embeddings=(), is_multimodal=None):
        x = self.embed_tokens[input_ids.long()]
        if multimodal_embeddings:
            x = x.masked_scatter(is_multimodal[:, None], torch.cat(multimodal_embeddings))
        return x

    def __call__(self, input_ids, positions, inputs_embeds=None):
        h = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        n = h.shape[0]
        for layer in self.layers:
            q, k, v = (h @ layer["qkv"]).view(n, 3, NUM_HEADS, HEAD_DIM).unbind(1)
            q, k = self.rotary_emb.forward_native(positions, q, k)
            h = h + layer["attn"].forward(q, k, v).reshape(n, HIDDEN) @ layer["o"]
            h = h + torch.nn.functional.silu(h @ layer["up"]) @ layer["down"]
        return h

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head


# --- vllm/v1/worker/gpu: input_batch.py, block_table.py, mm/, model_states/default.py (reduced) ----------------------

class InputBuffers:
    def __init__(self, device):
        self.device = device
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int32, device=device)
        self.positions = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)
        self.query_start_loc = torch.zeros(MAX_NUM_REQS + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(MAX_NUM_REQS, dtype=torch.int32, device=device)


@dataclasses.dataclass
class InputBatch:
    req_ids: list
    num_reqs: int
    idx_mapping_np: np.ndarray
    num_scheduled_tokens: np.ndarray
    num_tokens: int
    num_tokens_after_padding: int
    query_start_loc: torch.Tensor
    query_start_loc_np: np.ndarray
    seq_lens: torch.Tensor
    input_ids: torch.Tensor
    positions: torch.Tensor
    logits_indices: torch.Tensor

    @classmethod
    def make_dummy(cls, num_reqs, num_tokens, input_buffers):
        num_scheduled_tokens = np.full(num_reqs, num_tokens // num_reqs, dtype=np.int32)
        num_scheduled_tokens[-1] += num_tokens % num_reqs
        input_buffers.seq_lens[:num_reqs] = torch.from_numpy(num_scheduled_tokens)   # seq_len equals query_len
        input_buffers.seq_lens[num_reqs:] = 0
        query_start_loc_np = np.concatenate([[0], np.cumsum(num_scheduled_tokens)]).astype(np.int32)
        input_buffers.query_start_loc[: num_reqs + 1] = torch.from_numpy(query_start_loc_np)
        input_buffers.query_start_loc[num_reqs + 1:] = num_tokens
        query_start_loc = input_buffers.query_start_loc[: num_reqs + 1]
        return cls([f"_dummy_{i}" for i in range(num_reqs)], num_reqs, np.arange(num_reqs, dtype=np.int32),
                   num_scheduled_tokens, num_tokens, num_tokens, query_start_loc, query_start_loc_np,
                   input_buffers.seq_lens[:num_reqs], input_buffers.input_ids[:num_tokens].zero_(),
                   input_buffers.positions[:num_tokens].zero_(), query_start_loc[1:] - 1)


class BlockTables:
    """One KV cache group; block size MAX_MODEL_LEN, so a request owns one block (its block id)."""

    def __init__(self, device):
        self.block_table = torch.zeros(MAX_NUM_REQS, 1, dtype=torch.int32, device=device)
        self.input_block_tables = [torch.zeros(MAX_NUM_REQS, 1, dtype=torch.int32, device=device)]
        self.slot_mappings = torch.full((1, MAX_NUM_TOKENS), PAD_SLOT_ID, dtype=torch.int64, device=device)

    def append_block_ids(self, req_index, block_ids):
        self.block_table[req_index, 0] = block_ids[0]

    def gather_block_tables(self, idx_mapping):
        n = idx_mapping.shape[0]
        self.input_block_tables[0][:n] = self.block_table[idx_mapping.long()]
        return tuple(x[:n] for x in self.input_block_tables)

    def compute_slot_mappings(self, idx_mapping, query_start_loc, positions, num_tokens_padded):
        """Kernel stand-in: slot of each token from its request's block and its 1-D position; PAD beyond."""
        num_tokens = int(query_start_loc[-1])
        req = torch.repeat_interleave(idx_mapping.long(), (query_start_loc[1:] - query_start_loc[:-1]).long())
        self.slot_mappings[0, :num_tokens] = self.block_table[req, 0].long() * MAX_MODEL_LEN + positions[:num_tokens]
        self.slot_mappings[0, num_tokens:] = PAD_SLOT_ID
        return self.slot_mappings[:, :num_tokens_padded]

    def get_dummy_block_tables(self, num_reqs):
        return tuple(x[:num_reqs] for x in self.input_block_tables)

    def get_dummy_slot_mappings(self, num_tokens):
        self.slot_mappings.fill_(PAD_SLOT_ID)
        return self.slot_mappings[:, :num_tokens]


def build_slot_mappings_by_layer(slot_mappings):
    return {f"layers.{i}.attn": slot_mappings[0] for i in range(NUM_LAYERS)}


class MRopeState:
    def __init__(self, device):
        self.device = device
        self.prefill_mrope_positions = torch.zeros(MAX_NUM_REQS * 3, MAX_MODEL_LEN, dtype=torch.int64, device=device)
        self.prefill_mrope_delta = np.zeros(MAX_NUM_REQS, dtype=np.int64)
        # one extra dummy column on purpose (non-contiguous slices, as upstream)
        self.mrope_positions = torch.zeros(3, MAX_NUM_TOKENS + 1, dtype=torch.int64, device=device)

    def init_prefill_mrope_positions(self, req_idx, mrope_model, prefill_token_ids, mm_features):
        pos, delta = mrope_model.get_mrope_input_positions(prefill_token_ids, mm_features)
        self.prefill_mrope_positions[3 * req_idx: 3 * req_idx + 3, : pos.shape[1]] = pos.to(self.device)
        self.prefill_mrope_delta[req_idx] = delta

    def prepare_mrope_positions(self, idx_mapping_np, query_start_loc_np, prefill_lens, num_computed_tokens):
        """``_prepare_mrope_positions_kernel``: prefill tokens read the precomputed positions, decode tokens
        get ``num_computed + i + mrope_delta`` in all three rows."""
        for b, r in enumerate(idx_mapping_np):
            qs, qe, nc = int(query_start_loc_np[b]), int(query_start_loc_np[b + 1]), int(num_computed_tokens[r])
            if nc < prefill_lens[r]:
                self.mrope_positions[:, qs:qe] = self.prefill_mrope_positions[3 * r: 3 * r + 3, nc: nc + qe - qs]
            else:
                delta = int(self.prefill_mrope_delta[r])
                self.mrope_positions[:, qs:qe] = nc + delta + torch.arange(qe - qs, device=self.device)


class EncoderRunner:
    def __init__(self, model, device):
        self.model, self.device = model, device
        self.encoder_outputs: dict = {}
        self.inputs_embeds = torch.zeros(MAX_NUM_TOKENS, HIDDEN, dtype=DTYPE, device=device)

    def execute_mm_encoder(self, mm_features):
        for f in mm_features:
            self.encoder_outputs[f.identifier] = self.model.embed_multimodal(f.data)

    def gather_mm_embeddings(self, req_mm_features, num_tokens, query_start_loc_np, num_computed):
        is_mm_embed = torch.zeros(num_tokens, dtype=torch.bool)
        mm_embeds = []
        for i, (features, start) in enumerate(zip(req_mm_features, num_computed)):
            q_start, q_end = start, start + int(query_start_loc_np[i + 1] - query_start_loc_np[i])
            for f in features:
                if f.offset >= q_end or f.offset + f.length <= q_start:
                    continue
                s, e = max(q_start - f.offset, 0), min(q_end - f.offset, f.length)
                req_start_pos = int(query_start_loc_np[i]) + f.offset - q_start
                is_mm_embed[req_start_pos + s: req_start_pos + e] = True
                mm_embeds.append(self.encoder_outputs[f.identifier][s:e])
        return mm_embeds, is_mm_embed.to(self.device)

    def get_inputs_embeds(self, input_ids, mm_embeds, is_mm_embed):
        x = self.model.embed_input_ids(input_ids, multimodal_embeddings=mm_embeds, is_multimodal=is_mm_embed)
        self.inputs_embeds[: x.shape[0]] = x          # copy to the pre-allocated buffer for CUDA graphs
        return self.inputs_embeds


class DefaultModelState:
    def __init__(self, model, device):
        self.model = model
        self.supports_mm_inputs, self.uses_mrope = True, True
        self.encoder_runner = EncoderRunner(model, device)
        self.mrope_state = MRopeState(device)
        self.mm_features: dict[int, list] = {}

    def add_request(self, req_index, prefill_token_ids, mm_features):
        self.mm_features[req_index] = mm_features
        self.mrope_state.init_prefill_mrope_positions(req_index, self.model, prefill_token_ids, mm_features)

    def get_mm_embeddings(self, new_mm_features, input_batch, req_states):
        self.encoder_runner.execute_mm_encoder(new_mm_features)
        mm_embeds, is_mm_embed = self.encoder_runner.gather_mm_embeddings(
            [self.mm_features[r] for r in input_batch.idx_mapping_np], input_batch.num_tokens,
            input_batch.query_start_loc_np, req_states.num_computed_tokens[input_batch.idx_mapping_np])
        inputs_embeds = self.encoder_runner.get_inputs_embeds(
            input_batch.input_ids[: input_batch.num_tokens], mm_embeds, is_mm_embed[: input_batch.num_tokens])
        return inputs_embeds[: input_batch.num_tokens_after_padding]

    def prepare_inputs(self, input_batch, req_states):
        self.mrope_state.prepare_mrope_positions(input_batch.idx_mapping_np, input_batch.query_start_loc_np,
                                                 req_states.prefill_len, req_states.num_computed_tokens)
        return {"positions": self.mrope_state.mrope_positions[:, : input_batch.num_tokens_after_padding]}

    def prepare_dummy_inputs(self, num_reqs, num_tokens):
        return {"inputs_embeds": self.encoder_runner.inputs_embeds[:num_tokens],
                "positions": self.mrope_state.mrope_positions[:, :num_tokens]}

    def prepare_attn(self, input_batch, block_tables, slot_mappings):
        meta = {"query_start_loc": input_batch.query_start_loc, "seq_lens": input_batch.seq_lens,
                "block_table": block_tables[0], "slot_mapping": slot_mappings[0],
                "max_query_len": int(input_batch.num_scheduled_tokens.max())}
        return {f"layers.{i}.attn": meta for i in range(NUM_LAYERS)}


# --- vllm/v1/worker/gpu/cudagraph_utils.py (reduced) ------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class BatchExecutionDescriptor:
    cg_mode: CUDAGraphMode
    num_tokens: int
    num_reqs: int | None
    uniform_token_count: int | None = None


def _is_compatible(desc, num_reqs, num_tokens, uniform_token_count):
    return ((desc.uniform_token_count is None or desc.uniform_token_count == uniform_token_count)
            and (desc.num_reqs is None or desc.num_reqs >= num_reqs) and desc.num_tokens >= num_tokens)


def get_uniform_token_count(num_reqs, num_tokens, max_query_len):
    if max_query_len == num_tokens // num_reqs and num_tokens == max_query_len * num_reqs:
        return max_query_len
    return None


def prepare_inputs_to_capture(num_reqs, num_tokens, model_state, input_buffers, block_tables):
    input_batch = InputBatch.make_dummy(num_reqs, num_tokens, input_buffers)
    input_block_tables = block_tables.get_dummy_block_tables(num_reqs)
    slot_mappings = block_tables.get_dummy_slot_mappings(num_tokens)
    attn_metadata = model_state.prepare_attn(input_batch, input_block_tables, slot_mappings)
    return attn_metadata, build_slot_mappings_by_layer(slot_mappings)


class CudaGraphManager:
    def __init__(self, device, cudagraph_mode, decode_query_len=1):
        self.device, self.cudagraph_mode, self.decode_query_len = device, cudagraph_mode, decode_query_len
        self.max_num_reqs = MAX_NUM_REQS
        self.graphs: dict = {}
        self.pool = graph_pool_handle(device) if cudagraph_mode else None
        self._graphs_captured = False
        self._candidates: list = []
        self._capture_descs: dict = {}
        self._init_candidates()

    def _init_candidates(self):
        if not self.cudagraph_mode:
            return
        max_decode_tokens = self.max_num_reqs * self.decode_query_len
        decode_mode, mixed_mode = self.cudagraph_mode.decode_mode(), self.cudagraph_mode.mixed_mode()
        descs_by_token_count, descs_by_mode = defaultdict(list), defaultdict(list)
        for num_tokens in sorted(CUDAGRAPH_CAPTURE_SIZES):
            if (self.cudagraph_mode.separate_routine() and decode_mode
                    and self.decode_query_len <= num_tokens <= max_decode_tokens):
                desc = BatchExecutionDescriptor(decode_mode, num_tokens, num_tokens // self.decode_query_len,
                                                self.decode_query_len)
                descs_by_mode[decode_mode].append(desc)
                descs_by_token_count[num_tokens].append(desc)
            if mixed_mode:
                num_reqs = min(num_tokens, self.max_num_reqs) if mixed_mode == CUDAGraphMode.FULL else None
                desc = BatchExecutionDescriptor(mixed_mode, num_tokens, num_reqs)
                descs_by_mode[mixed_mode].append(desc)
                descs_by_token_count[num_tokens].append(desc)
        sorted_padded = sorted(descs_by_token_count)
        self._candidates = [[] for _ in range(sorted_padded[-1] + 1)]
        current_range_start = 0
        for cg_size in sorted_padded:
            for i in range(current_range_start, cg_size + 1):
                self._candidates[i] = descs_by_token_count[cg_size]
            current_range_start = cg_size + 1
        for mode, descs in descs_by_mode.items():
            self._capture_descs[mode] = sorted(descs, key=lambda d: d.num_tokens, reverse=True)

    def needs_capture(self):
        return len(self._capture_descs) > 0

    def capture(self, create_forward_fn, static, state):
        for mode in [CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL]:
            for desc in self._capture_descs.get(mode, []):
                forward_fn = create_forward_fn(desc)     # prepares inputs (outside the graph)
                # warm up with forward_fn(NONE), then capture forward_fn(NONE) into the pool
                self.graphs[desc], _ = capture(lambda f=forward_fn: f(CUDAGraphMode.NONE), device=self.device,
                                               pool=self.pool, warmups=1, static=static, state=state,
                                               owner="ModelCudaGraphManager", name=f"FULL num_tokens={desc.num_tokens}")
        self._graphs_captured = True

    def dispatch(self, num_reqs, num_tokens, uniform_token_count):
        if self._graphs_captured and 0 < num_tokens < len(self._candidates):
            for desc in self._candidates[num_tokens]:
                if _is_compatible(desc, num_reqs, num_tokens, uniform_token_count):
                    return desc
        return BatchExecutionDescriptor(CUDAGraphMode.NONE, num_tokens, num_reqs)


class ModelCudaGraphManager(CudaGraphManager):
    hidden_states: torch.Tensor | None = None

    def capture(self, model, model_state, input_buffers, block_tables, kv_caches):
        def create_forward_fn(desc):
            num_tokens = desc.num_tokens
            num_reqs = desc.num_reqs or min(num_tokens, self.max_num_reqs)
            attn_metadata, slot_mappings = prepare_inputs_to_capture(num_reqs, num_tokens, model_state,
                                                                     input_buffers, block_tables)

            def forward_fn(cg_mode):
                with set_forward_context(attn_metadata, num_tokens, cg_mode, slot_mappings):
                    model_inputs = {"input_ids": input_buffers.input_ids[:num_tokens],
                                    "positions": input_buffers.positions[:num_tokens]}
                    if _variant == "fix":       # PR #36544: the model state's inputs override the defaults
                        model_inputs.update(model_state.prepare_dummy_inputs(num_reqs, num_tokens))
                    hidden_states = model(**model_inputs)
                    if self.hidden_states is None:
                        self.hidden_states = torch.empty_like(hidden_states)
                    self.hidden_states[:num_tokens] = hidden_states
                    return self.hidden_states[:num_tokens]
            return forward_fn

        ms, bt = model_state, block_tables
        static = {"input_ids": input_buffers.input_ids, "positions": input_buffers.positions,
                  "query_start_loc": input_buffers.query_start_loc, "seq_lens": input_buffers.seq_lens,
                  "input_block_tables": bt.input_block_tables[0], "slot_mappings": bt.slot_mappings,
                  "mrope_positions": ms.mrope_state.mrope_positions, "inputs_embeds": ms.encoder_runner.inputs_embeds}
        state = {f"kv_cache_{i}": kv for i, kv in enumerate(kv_caches)}
        super().capture(create_forward_fn, static, state)

    def run_fullgraph(self, desc):
        """Replay a captured FULL cudagraph and return hidden states."""
        assert desc.cg_mode == CUDAGraphMode.FULL and desc in self.graphs
        return replay(self.graphs[desc], self.hidden_states[: desc.num_tokens])


# --- vllm/v1/worker/gpu/model_runner.py (reduced) ---------------------------------------------------------------------

class RequestState:
    def __init__(self):
        self.req_id_to_index: dict = {}
        self.prefill_len = np.zeros(MAX_NUM_REQS, dtype=np.int64)
        self.num_computed_tokens = np.zeros(MAX_NUM_REQS, dtype=np.int64)
        self.all_token_ids = np.zeros((MAX_NUM_REQS, MAX_MODEL_LEN), dtype=np.int64)
        self.last_sampled_tokens = np.zeros(MAX_NUM_REQS, dtype=np.int64)


class GPUModelRunner:
    def __init__(self, device, cudagraph_mode):
        self.device = device
        self.kv_caches = [torch.zeros(2, TRASH_SLOT + 1, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
                          for _ in range(NUM_LAYERS)]
        self.model = Qwen2VLForConditionalGeneration(device, self.kv_caches)
        self.model_state = DefaultModelState(self.model, device)
        self.input_buffers = InputBuffers(device)
        self.block_tables = BlockTables(device)
        self.req_states = RequestState()
        self.cudagraph_manager = ModelCudaGraphManager(device, cudagraph_mode)

    def capture_model(self):
        if self.cudagraph_manager.needs_capture():
            self.cudagraph_manager.capture(self.model, self.model_state, self.input_buffers, self.block_tables,
                                           self.kv_caches)

    def add_requests(self, new_reqs):
        for req_id, prompt, mm_features, block_ids in new_reqs:
            req_index = len(self.req_states.req_id_to_index)
            self.req_states.req_id_to_index[req_id] = req_index
            self.req_states.prefill_len[req_index] = len(prompt)
            self.req_states.all_token_ids[req_index, : len(prompt)] = prompt
            self.model_state.add_request(req_index, prompt, mm_features)
            self.block_tables.append_block_ids(req_index, block_ids)

    def prepare_inputs(self, num_scheduled_tokens: dict, batch_desc):
        rs, ib = self.req_states, self.input_buffers
        req_ids = sorted(num_scheduled_tokens, key=num_scheduled_tokens.get)      # decode first, then prefill
        num_reqs = len(req_ids)
        num_sched = np.array([num_scheduled_tokens[r] for r in req_ids], dtype=np.int32)
        idx_mapping_np = np.array([rs.req_id_to_index[r] for r in req_ids], dtype=np.int32)
        num_tokens = int(num_sched.sum())
        num_reqs_padded = batch_desc.num_reqs or num_reqs
        query_start_loc_np = np.full(MAX_NUM_REQS + 1, num_tokens, dtype=np.int32)
        query_start_loc_np[: num_reqs + 1] = np.concatenate([[0], np.cumsum(num_sched)])
        ib.query_start_loc.copy_(torch.from_numpy(query_start_loc_np))
        ids, pos, seq = [], [], []
        for r, n in zip(idx_mapping_np, num_sched):      # prepare_prefill_inputs / prepare_pos_seq_lens /
            nc = int(rs.num_computed_tokens[r])          # combine_sampled_and_draft_tokens
            ids += (list(rs.all_token_ids[r, nc: nc + n]) if nc < rs.prefill_len[r] else [rs.last_sampled_tokens[r]])
            pos += list(range(nc, nc + n))
            seq.append(nc + n)
        ib.input_ids[:num_tokens] = torch.tensor(ids, dtype=torch.int32)
        ib.positions[:num_tokens] = torch.tensor(pos)
        ib.seq_lens[:num_reqs] = torch.tensor(seq, dtype=torch.int32)
        query_start_loc = ib.query_start_loc[: num_reqs_padded + 1]
        return InputBatch(req_ids, num_reqs, idx_mapping_np, num_sched, num_tokens, batch_desc.num_tokens,
                          query_start_loc, query_start_loc_np[: num_reqs_padded + 1], ib.seq_lens[:num_reqs_padded],
                          ib.input_ids[: batch_desc.num_tokens], ib.positions[: batch_desc.num_tokens],
                          query_start_loc[1: num_reqs + 1] - 1)

    def prepare_attn(self, input_batch):
        idx_mapping = torch.from_numpy(input_batch.idx_mapping_np).to(self.device)
        block_tables = self.block_tables.gather_block_tables(idx_mapping)
        slot_mappings = self.block_tables.compute_slot_mappings(
            idx_mapping, input_batch.query_start_loc[: input_batch.num_reqs + 1], input_batch.positions,
            num_tokens_padded=input_batch.num_tokens_after_padding)
        return block_tables, slot_mappings

    def execute_model(self, new_reqs, num_scheduled_tokens: dict):
        self.add_requests(new_reqs)
        num_reqs, num_toks = len(num_scheduled_tokens), sum(num_scheduled_tokens.values())
        uniform_tok_count = get_uniform_token_count(num_reqs, num_toks, max(num_scheduled_tokens.values()))
        batch_desc = self.cudagraph_manager.dispatch(num_reqs, num_toks, uniform_tok_count)

        input_batch = self.prepare_inputs(num_scheduled_tokens, batch_desc)
        block_tables, slot_mappings = self.prepare_attn(input_batch)
        slot_mappings_by_layer = build_slot_mappings_by_layer(slot_mappings)
        attn_metadata = self.model_state.prepare_attn(input_batch, block_tables, slot_mappings)
        inputs_embeds = self.model_state.get_mm_embeddings([f for _, _, fs, _ in new_reqs for f in fs],
                                                           input_batch, self.req_states)
        model_inputs = {"input_ids": input_batch.input_ids, "positions": input_batch.positions,
                        "inputs_embeds": inputs_embeds,
                        **self.model_state.prepare_inputs(input_batch, self.req_states)}
        if batch_desc.cg_mode == CUDAGraphMode.FULL:
            # the inputs are already in the CUDA graph's input buffers
            hidden_states = self.cudagraph_manager.run_fullgraph(batch_desc)
        else:
            with set_forward_context(attn_metadata, input_batch.num_tokens_after_padding, batch_desc.cg_mode,
                                     slot_mappings_by_layer):
                hidden_states = self.model(**model_inputs)
        logits, sampled = self.sample(hidden_states, input_batch)
        self.postprocess(input_batch, sampled)
        return [logits, sampled.to(DTYPE)]

    def sample(self, hidden_states, input_batch):
        logits = self.model.compute_logits(hidden_states[input_batch.logits_indices.long()])
        return logits, logits.argmax(dim=-1)

    def postprocess(self, input_batch, sampled):
        rs = self.req_states
        for b, r in enumerate(input_batch.idx_mapping_np):
            rs.num_computed_tokens[r] += input_batch.num_scheduled_tokens[b]
            if rs.num_computed_tokens[r] >= rs.prefill_len[r]:
                rs.last_sampled_tokens[r] = int(sampled[b])
                rs.all_token_ids[r, rs.num_computed_tokens[r]] = int(sampled[b])


# --- a reduced engine: one image request and one text request, a prefill step, then decode steps ----------------------

def _serve(device, use_cuda_graph):
    runner = GPUModelRunner(device, CUDAGraphMode.FULL_DECODE_ONLY if use_cuda_graph else CUDAGraphMode.NONE)
    runner.capture_model()
    gen = generator(95)
    text = lambda n: torch.randint(0, VOCAB - 1, (n,), generator=gen).tolist()
    image = MultiModalFeatureSpec(torch.randn(6, PATCH_DIM, generator=gen).to(DTYPE).to(device), (1, 2, 3), 2, "img0")
    prompt_a = text(2) + [IMAGE_TOKEN_ID] * image.length + text(2)      # mrope_position_delta = -3
    prompt_b = text(5)                                                 # text only: delta 0
    new_reqs = [("A", prompt_a, [image], [0]), ("B", prompt_b, [], [1])]
    outs = runner.execute_model(new_reqs, {"A": len(prompt_a), "B": len(prompt_b)})
    for step in range(5):
        outs += runner.execute_model([], {"A": 1, "B": 1} if step < 3 else {"A": 1})
    return outs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: _serve(device, True), lambda: _serve(device, False))
