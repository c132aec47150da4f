"""vLLM's Model Runner V2 serving a vision-language model with CUDA graphs: a step whose token count is padded up to a
captured graph size builds its input embeddings from the *padded* ``input_batch.input_ids`` while the encoder runner's
placeholder mask ``is_mm_embed`` covers only the step's real tokens. Text-only steps pass (no image embedding is
merged), but the first prefill that carries image tokens and is not already a capture size ends in the merge's
``masked_scatter_`` between a ``[num_tokens_after_padding, hidden]`` embedding and a ``[num_tokens, 1]`` mask, which
vLLM turns into ``ValueError: Error during masked scatter operation``. Eagerly the step is not padded and the same
request is served.

Upstream: https://github.com/vllm-project/vllm/pull/36588 ("[Model Runner V2] Fix mm input embeddings lookup",
vllm-project/vllm, by Nick Hill (njhill), merged 2026-03-10; read as commit ddbb0d230a3592106ac9f5f7f4e9a861863fcbee
in a stored mirror of vLLM's history, local-inference-lab/vllm). Read: the full diff (three lines in
``vllm/v1/worker/gpu/model_states/default.py``, ``DefaultModelState.get_mm_embeddings``: ``input_ids_unpadded =
input_batch.input_ids[: input_batch.num_tokens]`` is passed to ``get_inputs_embeds`` instead of
``input_batch.input_ids``, with the comment "Use unpadded input_ids to match is_mm_embed size (num_tokens).
input_batch.input_ids may be padded for CUDA graphs."). At the fix's parent: ``model_states/default.py`` (whole
file), ``mm/encoder_runner.py`` (whole file: ``EncoderRunner.__init__`` / ``execute_mm_encoder`` /
``gather_mm_embeddings`` / ``get_inputs_embeds``), ``input_batch.py`` (``InputBuffers``, ``InputBatch`` and
``make_dummy``, the ``_prepare_pos_seq_lens_kernel`` comment that pads unused ``seq_lens`` with 0),
``cudagraph_utils.py`` (``BatchExecutionDescriptor``, ``_is_compatible``, ``get_uniform_token_count``,
``CudaGraphManager._init_candidates`` / ``capture`` / ``dispatch`` / ``run_fullgraph``, ``ModelCudaGraphManager``,
``prepare_inputs_to_capture``), ``model_runner.py`` (``capture_model``, ``prepare_inputs``, ``prepare_attn``,
``execute_model``, ``sample``), ``vllm/model_executor/models/interfaces.py`` (``SupportsMultiModal.embed_input_ids``,
``_embed_text_input_ids``) and ``models/utils.py`` (``_merge_multimodal_embeddings``: ``masked_scatter_`` in a
``try``, a ``RuntimeError`` re-raised as ``ValueError``). Also read: the review thread of #32546 ("[Model Runner V2]
Support VLM", 2026-01-18), where a review bot flagged this mismatch ("When padding is applied (for CUDA graphs or data
parallelism), input_batch.input_ids has shape [num_tokens_after_padding] but is_mm_embed is created with size
input_batch.num_tokens ... will cause a runtime error in masked_scatter_").
Not read: #36588's description and any issue or user report (none was in the stored threads); the Triton kernels of
``input_batch.py`` and ``block_table.py`` beyond their comments and call sites; the attention backends; the PIECEWISE
(torch.compile) path; DP padding; LoRA; spec decoding; any real model's vision tower. Not established: from which
commit a padded multimodal prefill first reached this line (MRV2 gained piecewise and mixed graphs in #32771,
2026-02-19; the history in between was not bisected).
Symptom: no user report was read. From the code and the review comment: with ``VLLM_USE_V2_MODEL_RUNNER=1``, CUDA
graphs on and a multimodal model, a step that carries image placeholder tokens and whose token count is padded to a
capture size fails in ``_merge_multimodal_embeddings`` ("ValueError: Error during masked scatter operation", from
torch's "The expanded size of the tensor (16) must match the existing size (11) ..."); ``--enforce-eager`` serves it.
Inferred, not quoted.
Mechanism: ``execute_model`` dispatches the step to a graph descriptor whose ``num_tokens`` is the smallest capture
size that holds it; ``prepare_inputs`` then hands out ``input_ids = input_buffers.input_ids[:num_tokens_after_padding]``
(the padded rows hold whatever earlier steps or dummy runs left). ``gather_mm_embeddings`` builds ``is_mm_embed`` for
the real ``num_tokens`` only. ``get_mm_embeddings`` passes both to the model's ``embed_input_ids``, whose text
embedding has the padded length and whose ``masked_scatter_`` cannot broadcast the shorter mask. Without graphs
``num_tokens_after_padding == num_tokens`` and nothing differs; with graphs a text-only step is spared only because no
multimodal embedding is merged.
Doctor: padded-shape-mismatch, at get_mm_embeddings. Code run at the graph's padded size combines a padded-row tensor
(``input_ids``, sized to the capture size) with a real-row tensor (``is_mm_embed``, sized to the step's tokens);
``get_mm_embeddings`` is where the two are paired, and the only function the fix changes.
Fix (upstream): ``get_mm_embeddings`` slices ``input_batch.input_ids[: input_batch.num_tokens]`` before
``get_inputs_embeds``; the embeddings are written to the first ``num_tokens`` rows of the static ``inputs_embeds``
buffer and the padded view ``[: num_tokens_after_padding]`` is still handed to the graph.
Modelled: ``SupportsMultiModal.embed_input_ids`` / ``_embed_text_input_ids``, ``_merge_multimodal_embeddings``,
``embed_multimodal``, ``compute_logits``; ``InputBuffers``, ``InputBatch.make_dummy``, ``BlockTables``
(``append_block_ids``, ``gather_block_tables``, ``compute_slot_mappings``, ``get_dummy_block_tables``,
``get_dummy_slot_mappings``), ``EncoderRunner`` (``execute_mm_encoder``, ``gather_mm_embeddings``,
``get_inputs_embeds``), ``DefaultModelState`` (``add_request``, ``get_mm_embeddings``, ``prepare_dummy_inputs``,
``prepare_attn``), ``BatchExecutionDescriptor``, ``_is_compatible``, ``get_uniform_token_count``,
``CudaGraphManager`` (``_init_candidates``, ``capture``, ``dispatch``), ``ModelCudaGraphManager`` (``capture`` with
``create_forward_fn`` / ``forward_fn``, ``run_fullgraph``), ``prepare_inputs_to_capture``, ``set_forward_context``,
``GPUModelRunner`` (``capture_model``, ``add_requests``, ``prepare_inputs``, ``prepare_attn``, ``execute_model``,
``sample``, ``postprocess``).
Stand-ins: a two-layer LLaVA-like model in float64 (token embedding, q/k/v with 1-D RoPE, attention over a per-layer KV
cache, SiLU MLP, lm_head); the vision tower is one linear map of per-token patches; the image token is in the
vocabulary (``_has_oov_mm_tokens`` False, the common case); a torch attention with static shapes (a write at
``PAD_SLOT_ID`` lands in a trash row); the decoder's linear layers as a broadcast multiply-sum (a float64 GEMM on
the CPU rounds a row differently for 11 and 16 rows, about 1e-15, which is no part of the bug); one KV block of
``MAX_MODEL_LEN`` slots per request; request bookkeeping on the host in numpy instead of the Triton kernels; greedy
sampling; cudagraph mode ``FULL`` for every batch (upstream pads the same way for PIECEWISE and mixed FULL graphs; the
piecewise split around attention is not modelled); ``forward_fn`` returns the hidden-states view it filled so that
``kit.capture`` hands it out.
Workload: capture sizes [1, 2, 4, 8, 16], at most 4 requests. Step 0 prefills text request B (5 tokens, padded to 8),
step 1 prefills request A (3 text tokens, a 6-patch image, 2 text tokens: 11 tokens, padded to 16), steps 2-4 decode A
and B together (2 tokens, the size-2 graph). Outputs per step: the sampled rows' logits and the sampled token ids.
Measured: bug: misbehaves (raised ValueError: Error during masked scatter operation), at step 1 (A's image prefill,
11 tokens padded to 16; its cause: "The expanded size of the tensor (16) must match the existing size (11) at
non-singleton dimension 0"); step 0 (text only, 5 padded to 8) passed. Fix: equals eager (max |graph - eager| = 0).
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

UPSTREAM = "https://github.com/vllm-project/vllm/pull/36588"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "get_mm_embeddings"
SYMPTOM = ("Model Runner V2 with CUDA graphs: a multimodal prefill padded to a capture size merges image embeddings "
           "with the padded input_ids against a placeholder mask of the real tokens, and the masked scatter fails")

MAX_NUM_REQS, MAX_NUM_TOKENS, MAX_MODEL_LEN = 4, 32, 24
CUDAGRAPH_CAPTURE_SIZES = [1, 2, 4, 8, 16]
VOCAB, HIDDEN, NUM_HEADS, HEAD_DIM, PATCH_DIM, NUM_LAYERS = 32, 16, 2, 8, 12, 2
IMAGE_TOKEN_ID = VOCAB - 1
PAD_SLOT_ID = -1
TRASH_SLOT = MAX_NUM_REQS * MAX_MODEL_LEN          # stand-in: where a PAD_SLOT_ID write lands
DTYPE = torch.float64

_variant = "bug"


class CUDAGraphMode(enum.Enum):
    NONE = 0
    PIECEWISE = 1
    FULL = 2

    def __bool__(self) -> bool:
        return self != CUDAGraphMode.NONE


_forward_context = None


@contextlib.contextmanager
def set_forward_context(attn_metadata, num_tokens, cudagraph_runtime_mode, slot_mapping):
    global _forward_context
    prev, _forward_context = _forward_context, (attn_metadata, slot_mapping)
    try:
        yield
    finally:
        _forward_context = prev


# --- the model: vllm/model_executor/models/interfaces.py, utils.py and a tiny LLaVA-like VLM (reduced) ---------------

@dataclasses.dataclass
class MultiModalFeatureSpec:
    data: torch.Tensor            # stand-in: per-token patches [length, PATCH_DIM]
    offset: int                   # mm_position.offset
    length: int                   # mm_position.length
    identifier: str               # mm_hash


def _merge_multimodal_embeddings(inputs_embeds, multimodal_embeddings, is_multimodal):
    """Overwrite the placeholder rows of ``inputs_embeds`` (in place) with the multimodal embeddings."""
    if len(multimodal_embeddings) == 0:
        return inputs_embeds
    mm_embeds_flat = torch.cat(list(multimodal_embeddings))
    try:
        # NOTE (upstream): avoids a D2H sync, but fails to raise if is_multimodal.sum() < len(mm_embeds_flat)
        inputs_embeds.masked_scatter_(is_multimodal.unsqueeze(-1), mm_embeds_flat.to(dtype=inputs_embeds.dtype))
    except RuntimeError as e:
        num_actual_tokens, num_expected_tokens = len(mm_embeds_flat), int(is_multimodal.sum().item())
        if num_actual_tokens != num_expected_tokens:
            raise ValueError(f"Attempted to assign {num_actual_tokens} multimodal tokens to "
                             f"{num_expected_tokens} placeholders") from e
        raise ValueError("Error during masked scatter operation") from e
    return inputs_embeds


class SupportsMultiModal:
    _has_oov_mm_tokens = False

    def _embed_text_input_ids(self, input_ids, embed_input_ids, *, is_multimodal):
        if is_multimodal is not None and self._has_oov_mm_tokens:
            return embed_input_ids(input_ids.masked_fill(is_multimodal, 0))
        return embed_input_ids(input_ids)

    def embed_input_ids(self, input_ids, multimodal_embeddings=None, *, is_multimodal=None):
        inputs_embeds = self._embed_text_input_ids(input_ids, self.get_language_model().embed_input_ids,
                                                   is_multimodal=is_multimodal)
        if multimodal_embeddings is None or len(multimodal_embeddings) == 0:
            return inputs_embeds
        return _merge_multimodal_embeddings(inputs_embeds, multimodal_embeddings, is_multimodal)


class Attention:
    """Writes this step's K/V at ``slot_mapping`` and attends over the request's block up to its own position."""

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


def _linear(x, w):
    """``x @ w`` as a broadcast multiply-sum: a row's result does not depend on how many rows the batch has."""
    return (x.unsqueeze(-1) * w).sum(-2)


class LlamaModel:
    def __init__(self, r, device, kv_caches):
        self.embed_tokens = r(VOCAB, HIDDEN, scale=1.0)
        self.layers = [{"qkv": r(HIDDEN, 3 * HIDDEN), "o": r(HIDDEN, HIDDEN), "up": r(HIDDEN, 2 * HIDDEN),
                        "down": r(2 * HIDDEN, HIDDEN), "attn": Attention(f"layers.{i}.attn", kv_caches[i])}
                       for i in range(NUM_LAYERS)]
        inv_freq = 1.0 / 100.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=DTYPE) / HEAD_DIM)
        freqs = torch.outer(torch.arange(MAX_MODEL_LEN, dtype=DTYPE), inv_freq)
        self.cos_sin_cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)

    def embed_input_ids(self, input_ids):
        return self.embed_tokens[input_ids.long()]

    def rotary_emb(self, positions, x):
        cos, sin = (c.unsqueeze(-2) for c in self.cos_sin_cache[positions].chunk(2, dim=-1))
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def __call__(self, positions, inputs_embeds):
        h, n = inputs_embeds, inputs_embeds.shape[0]
        for layer in self.layers:
            q, k, v = _linear(h, layer["qkv"]).view(n, 3, NUM_HEADS, HEAD_DIM).unbind(1)
            q, k = self.rotary_emb(positions, q), self.rotary_emb(positions, k)
            h = h + _linear(layer["attn"].forward(q, k, v).reshape(n, HIDDEN), layer["o"])
            h = h + _linear(torch.nn.functional.silu(_linear(h, layer["up"])), layer["down"])
        return h


class LlavaForConditionalGeneration(SupportsMultiModal):
    def __init__(self, device, kv_caches):
        gen = generator(36588)
        r = lambda *s, scale=0.25: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)
        self.language_model = LlamaModel(r, device, kv_caches)
        self.vision_tower, self.lm_head = r(PATCH_DIM, HIDDEN), r(HIDDEN, VOCAB)

    def get_language_model(self):
        return self.language_model

    def embed_multimodal(self, pixel_values):
        return [pixel_values @ self.vision_tower]

    def __call__(self, input_ids, positions, inputs_embeds=None):
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        return self.language_model(positions, inputs_embeds)

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head


# --- vllm/v1/worker/gpu: input_batch.py, block_table.py, mm/encoder_runner.py, model_states/default.py (reduced) -----

class InputBuffers:
    def __init__(self, device):
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int32, device=device)
        self.positions = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)
        self.query_start_loc = torch.zeros(MAX_NUM_REQS + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(MAX_NUM_REQS, dtype=torch.int32, device=device)


@dataclasses.dataclass
class InputBatch:
    req_ids: list
    num_reqs: int
    num_reqs_after_padding: int
    idx_mapping_np: np.ndarray
    num_scheduled_tokens: np.ndarray
    num_tokens: int
    num_tokens_after_padding: int
    query_start_loc: torch.Tensor
    query_start_loc_np: np.ndarray
    seq_lens: torch.Tensor
    input_ids: torch.Tensor          # [num_tokens_after_padding]
    positions: torch.Tensor          # [num_tokens_after_padding]
    logits_indices: torch.Tensor

    @classmethod
    def make_dummy(cls, num_reqs, num_tokens, input_buffers):
        num_scheduled_tokens = np.full(num_reqs, num_tokens // num_reqs, dtype=np.int32)
        num_scheduled_tokens[-1] += num_tokens % num_reqs
        input_buffers.seq_lens[:num_reqs] = torch.from_numpy(num_scheduled_tokens)    # seq_len equals query_len
        input_buffers.seq_lens[num_reqs:] = 0                                         # pad for full CUDA graphs
        query_start_loc_np = np.concatenate([[0], np.cumsum(num_scheduled_tokens)]).astype(np.int32)
        input_buffers.query_start_loc[: num_reqs + 1] = torch.from_numpy(query_start_loc_np)
        input_buffers.query_start_loc[num_reqs + 1:] = num_tokens
        query_start_loc = input_buffers.query_start_loc[: num_reqs + 1]
        return cls([f"_dummy_{i}" for i in range(num_reqs)], num_reqs, num_reqs, np.arange(num_reqs, dtype=np.int32),
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

    def gather_block_tables(self, idx_mapping, num_reqs_padded):
        self.input_block_tables[0][: idx_mapping.shape[0]] = self.block_table[idx_mapping.long()]
        return tuple(x[:num_reqs_padded] for x in self.input_block_tables)

    def compute_slot_mappings(self, idx_mapping, query_start_loc, positions, num_tokens_padded):
        """Kernel stand-in: each token's slot from its request's block and position; PAD_SLOT_ID beyond."""
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


class EncoderRunner:
    def __init__(self, model, device):
        self.model, self.device = model, device
        self.encoder_outputs: dict = {}                  # EncoderCache.encoder_outputs, by mm_hash
        self.inputs_embeds = torch.zeros(MAX_NUM_TOKENS, HIDDEN, dtype=DTYPE, device=device)

    def execute_mm_encoder(self, mm_features):
        for f in mm_features:
            (self.encoder_outputs[f.identifier],) = self.model.embed_multimodal(f.data)

    def gather_mm_embeddings(self, req_mm_features, total_num_scheduled_tokens, num_scheduled_tokens,
                             query_start_loc, prefill_lens, computed_prefill_lens):
        if not (computed_prefill_lens < prefill_lens).any():
            # All decode requests, so no need to gather any embeddings.
            return [], torch.zeros(total_num_scheduled_tokens, dtype=torch.bool, device=self.device)
        mm_embeds, is_mm_embed = [], torch.zeros(total_num_scheduled_tokens, dtype=torch.bool)
        for i, features in enumerate(req_mm_features):
            query_start = int(computed_prefill_lens[i])
            query_end = query_start + int(num_scheduled_tokens[i])
            for f in features:
                if f.offset >= query_end or f.offset + f.length <= query_start:
                    continue
                start_idx, end_idx = max(query_start - f.offset, 0), min(query_end - f.offset, f.length)
                req_start_pos = int(query_start_loc[i]) + f.offset - query_start
                is_mm_embed[req_start_pos + start_idx: req_start_pos + end_idx] = True
                mm_embeds.append(self.encoder_outputs[f.identifier][start_idx:end_idx])
        return mm_embeds, is_mm_embed.to(self.device)

    def get_inputs_embeds(self, input_ids, mm_embeds, is_mm_embed):
        x = self.model.embed_input_ids(input_ids, multimodal_embeddings=mm_embeds, is_multimodal=is_mm_embed)
        self.inputs_embeds[: x.shape[0]] = x           # copy to the pre-allocated buffer for CUDA graphs
        return self.inputs_embeds


class DefaultModelState:
    def __init__(self, model, device):
        self.model = model
        self.encoder_runner = EncoderRunner(model, device)
        self.mm_features: dict[int, list] = {}

    def add_request(self, req_index, mm_features):
        self.mm_features[req_index] = mm_features

    def get_mm_embeddings(self, scheduled_encoder_inputs, input_batch, req_states):
        if scheduled_encoder_inputs:
            self.encoder_runner.execute_mm_encoder(scheduled_encoder_inputs)
        idx = input_batch.idx_mapping_np
        mm_embeds, is_mm_embed = self.encoder_runner.gather_mm_embeddings(
            [self.mm_features[r] for r in idx], input_batch.num_tokens, input_batch.num_scheduled_tokens,
            input_batch.query_start_loc_np, req_states.prefill_len[idx], req_states.num_computed_tokens[idx])
        if _variant == "bug":
            input_ids = input_batch.input_ids                 # padded for CUDA graphs: num_tokens_after_padding
        else:
            # PR #36588: use unpadded input_ids to match is_mm_embed size (num_tokens)
            input_ids = input_batch.input_ids[: input_batch.num_tokens]
        inputs_embeds = self.encoder_runner.get_inputs_embeds(input_ids, mm_embeds, is_mm_embed)
        return inputs_embeds[: input_batch.num_tokens_after_padding]

    def prepare_dummy_inputs(self, num_reqs, num_tokens):
        return {"inputs_embeds": self.encoder_runner.inputs_embeds[:num_tokens]}

    def prepare_attn(self, input_batch, block_tables, slot_mappings):
        meta = {"query_start_loc": input_batch.query_start_loc, "seq_lens": input_batch.seq_lens,
                "block_table": block_tables[0], "slot_mapping": slot_mappings[0]}
        return {f"layers.{i}.attn": meta for i in range(NUM_LAYERS)}


# --- vllm/v1/worker/gpu/cudagraph_utils.py (reduced: FULL graphs for every batch) -------------------------------------

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
    def __init__(self, device, cudagraph_mode):
        self.device, self.cudagraph_mode, self.max_num_reqs = device, cudagraph_mode, MAX_NUM_REQS
        self.graphs: dict = {}
        self.pool = graph_pool_handle(device) if cudagraph_mode else None
        self._graphs_captured = False
        self._candidates: list = []
        self._capture_descs: dict = {}
        self._init_candidates()

    def _init_candidates(self):
        if not self.cudagraph_mode:
            return
        descs_by_token_count, descs_by_mode = defaultdict(list), defaultdict(list)
        for num_tokens in sorted(CUDAGRAPH_CAPTURE_SIZES):       # mixed mode FULL: requests padded too
            desc = BatchExecutionDescriptor(CUDAGraphMode.FULL, num_tokens, min(num_tokens, self.max_num_reqs))
            descs_by_mode[CUDAGraphMode.FULL].append(desc)
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
        for desc in self._capture_descs.get(CUDAGraphMode.FULL, []):
            forward_fn = create_forward_fn(desc)            # prepares inputs (outside the graph)
            # warm up with forward_fn(NONE), then capture forward_fn(NONE) into the shared pool
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
                                    "positions": input_buffers.positions[:num_tokens],
                                    **model_state.prepare_dummy_inputs(num_reqs, num_tokens)}
                    hidden_states = model(**model_inputs)
                    if self.hidden_states is None:
                        self.hidden_states = torch.empty(MAX_NUM_TOKENS, HIDDEN, dtype=DTYPE, device=self.device)
                    self.hidden_states[:num_tokens] = hidden_states
                    return self.hidden_states[:num_tokens]
            return forward_fn

        self._static = {"input_ids": input_buffers.input_ids, "positions": input_buffers.positions,
                        "query_start_loc": input_buffers.query_start_loc, "seq_lens": input_buffers.seq_lens,
                        "input_block_tables": block_tables.input_block_tables[0],
                        "slot_mappings": block_tables.slot_mappings,
                        "inputs_embeds": model_state.encoder_runner.inputs_embeds}
        super().capture(create_forward_fn, self._static, {f"kv_cache_{i}": kv for i, kv in enumerate(kv_caches)})

    def run_fullgraph(self, desc, num_tokens):
        """Replay a captured FULL cudagraph and return hidden states (rows past ``num_tokens`` are padding)."""
        assert desc.cg_mode == CUDAGraphMode.FULL and desc in self.graphs
        s = self._static                                      # padded rows this step left as they were
        padded = {k: s[k] for k in ("input_ids", "positions", "inputs_embeds")}
        return replay(self.graphs[desc], self.hidden_states[: desc.num_tokens], real=num_tokens,
                      size=desc.num_tokens, padded=padded)


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
        self.model = LlavaForConditionalGeneration(device, self.kv_caches)
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
            self.model_state.add_request(req_index, mm_features)
            self.block_tables.append_block_ids(req_index, block_ids)

    def prepare_inputs(self, num_scheduled_tokens: dict, batch_desc):
        rs, ib = self.req_states, self.input_buffers
        req_ids = sorted(num_scheduled_tokens, key=num_scheduled_tokens.get)      # decode first, then prefill
        num_reqs = len(req_ids)
        num_sched = np.array([num_scheduled_tokens[r] for r in req_ids], dtype=np.int32)
        idx_mapping_np = np.array([rs.req_id_to_index[r] for r in req_ids], dtype=np.int32)
        num_tokens = int(num_sched.sum())
        num_reqs_padded = batch_desc.num_reqs or num_reqs
        query_start_loc_np = np.full(MAX_NUM_REQS + 1, num_tokens, dtype=np.int32)   # padded for full graphs
        query_start_loc_np[: num_reqs + 1] = np.concatenate([[0], np.cumsum(num_sched)])
        ib.query_start_loc.copy_(torch.from_numpy(query_start_loc_np))
        ids, pos, seq = [], [], []
        for r, n in zip(idx_mapping_np, num_sched):      # prepare_prefill_inputs / prepare_pos_seq_lens /
            nc = int(rs.num_computed_tokens[r])          # combine_sampled_and_draft_tokens: real tokens only
            ids += list(rs.all_token_ids[r, nc: nc + n]) if nc < rs.prefill_len[r] else [rs.last_sampled_tokens[r]]
            pos += list(range(nc, nc + n))
            seq.append(nc + n)
        ib.input_ids[:num_tokens] = torch.tensor(ids, dtype=torch.int32)
        ib.positions[:num_tokens] = torch.tensor(pos)
        ib.seq_lens[:num_reqs] = torch.tensor(seq, dtype=torch.int32)
        ib.seq_lens[num_reqs:] = 0                        # pad unused seq_lens as 0 for full CUDA graphs
        query_start_loc = ib.query_start_loc[: num_reqs_padded + 1]
        return InputBatch(req_ids, num_reqs, num_reqs_padded, idx_mapping_np, num_sched, num_tokens,
                          batch_desc.num_tokens, query_start_loc, query_start_loc_np[: num_reqs_padded + 1],
                          ib.seq_lens[:num_reqs_padded], ib.input_ids[: batch_desc.num_tokens],
                          ib.positions[: batch_desc.num_tokens], query_start_loc[1: num_reqs + 1] - 1)

    def prepare_attn(self, input_batch):
        idx_mapping = torch.from_numpy(input_batch.idx_mapping_np).to(self.device)
        block_tables = self.block_tables.gather_block_tables(idx_mapping, input_batch.num_reqs_after_padding)
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
        attn_metadata = self.model_state.prepare_attn(input_batch, block_tables, slot_mappings)
        # Run the MM encoder (if needed) and get the multimodal embeddings.
        scheduled_encoder_inputs = [f for _, _, features, _ in new_reqs for f in features]
        inputs_embeds = self.model_state.get_mm_embeddings(scheduled_encoder_inputs, input_batch, self.req_states)
        model_inputs = {"input_ids": input_batch.input_ids, "positions": input_batch.positions,
                        "inputs_embeds": inputs_embeds}
        if batch_desc.cg_mode == CUDAGraphMode.FULL:
            # the inputs are already in the CUDA graph's input buffers
            hidden_states = self.cudagraph_manager.run_fullgraph(batch_desc, input_batch.num_tokens)
        else:
            with set_forward_context(attn_metadata, input_batch.num_tokens_after_padding, batch_desc.cg_mode,
                                     build_slot_mappings_by_layer(slot_mappings)):
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


# --- a reduced engine: a text request, then an image request, then decode steps of both ------------------------------

def _serve(device, use_cuda_graph):
    runner = GPUModelRunner(device, CUDAGraphMode.FULL if use_cuda_graph else CUDAGraphMode.NONE)
    runner.capture_model()
    gen = generator(7)
    text = lambda n: torch.randint(0, VOCAB - 1, (n,), generator=gen).tolist()
    image = MultiModalFeatureSpec(torch.randn(6, PATCH_DIM, generator=gen).to(DTYPE).to(device), 3, 6, "img0")
    prompt_a = text(3) + [IMAGE_TOKEN_ID] * image.length + text(2)           # 11 tokens: padded to 16
    prompt_b = text(5)                                                     # 5 tokens: padded to 8
    outs = runner.execute_model([("B", prompt_b, [], [1])], {"B": len(prompt_b)})
    outs += runner.execute_model([("A", prompt_a, [image], [0])], {"A": len(prompt_a)})
    for _ in range(3):
        outs += runner.execute_model([], {"A": 1, "B": 1})
    return outs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: _serve(device, True), lambda: _serve(device, False))
