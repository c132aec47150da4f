"""vLLM V0 (``vllm/worker/model_runner.py``) serving a Qwen2-VL-style M-RoPE model with decode CUDA graphs: for a
pure-text request ``ModelInputForGPUBuilder._compute_multi_modal_input`` returns before computing M-RoPE positions, so
the request's positions stay 1-D (``[num_tokens]``) for its whole life; the decode graphs were captured with 3-D
positions (``[3, batch]``, the T/H/W rows ``MRotaryEmbedding`` rotates with different sections of the head), and
``CUDAGraphRunner.forward`` copies the 1-D positions into ``input_buffers["positions"][:positions.shape[0]]``, which
for graph batch sizes 1 and 2 writes only the first 1 or 2 of the 3 rows. The H/W rows keep what an earlier step or
the capture left there, so every decode step replayed at those sizes rotates part of each head with a stale position;
the eager runner uses the 1-D positions directly (plain RoPE) and is right.

Upstream: https://github.com/vllm-project/vllm/pull/18526 ("[Bugfix] Fix MRoPE Errors in the Qwen-VL Model When
Processing Pure Text", vllm-project/vllm, by wulipc (燃), with Cyrus Leung; merged 2025-05-22 as commit f6037d190). It
re-lands #18407 (merged 2025-05-20 as be48360c1, reverted the next day by #18456 because it broke
``tests/models/multimodal/generation/test_qwen2_vl.py``); both PRs say they fix QwenLM/Qwen2.5-VL#1215. Read: the
descriptions and stored comments of #18526, #18407 and #18456, the full diffs of f6037d190 and be48360c1 (in the
local-inference-lab/vllm mirror), and at the parent of f6037d190: ``vllm/worker/model_runner.py``
(``ModelInputForGPUBuilder``: ``per_seq_compute_fns`` / ``per_seq_group_compute_fns`` order, ``_compute_lens`` with its
``get_next_input_positions`` branch, ``_compute_multi_modal_input``, ``add_seq_group``, ``_use_captured_graph``,
``_get_cuda_graph_pad_size``, ``build``; ``CUDAGraphRunner.capture`` / ``forward``; ``GPUModelRunnerBase.capture_model``
with ``input_positions = torch.tile(..., (3, 1))`` and ``positions = input_positions[..., :batch_size]``;
``ModelRunner.execute_model``), ``vllm/model_executor/layers/rotary_embedding.py`` (``MRotaryEmbedding.forward``,
``get_input_positions``, ``get_next_input_positions``) and ``vllm/attention/backends/utils.py``
(``CommonAttentionState.graph_capture``, ``graph_capture_get_metadata_for_batch``, ``get_graph_input_buffers``,
``prepare_graph_input_buffers``).
Not read: the issue thread QwenLM/Qwen2.5-VL#1215 itself (only the PRs' account of it),
``_vl_get_input_positions_tensor`` for image/video tokens (only its text-only result is
used: ``arange`` on all three rows, delta 0), the FlashAttention V0 metadata builder, the Qwen2-VL model file.
Symptom: (PR texts) "Users in our community reported that the VL model performs poorly on plain text input ... in
plain text mode, mm_kwargs is empty, which causes the function to return early. As a result, mrope_input_positions
remains None, ultimately leading to suboptimal results in the V0 engine under CUDA graph ... in eager mode, the
results remain correct" (#18526); "inconsistent outputs between eager mode and CUDA Graph mode" (#18407).
Mechanism: with ``uses_mrope`` the capture gives every decode graph a view ``input_positions[..., :bs]`` of one
``[3, max_bs]`` zero tensor as its positions input. A pure-text prompt has no ``mm_kwargs``, so
``_compute_multi_modal_input`` returns early: ``inter_data.mrope_input_positions`` stays ``None`` and
``seq_data.mrope_position_delta`` is never set, so ``_compute_lens`` never switches the request's decode steps to
M-RoPE positions and ``build`` hands out a 1-D ``input_positions``. ``CUDAGraphRunner.forward`` copies it with
``self.input_buffers["positions"][:positions.shape[0]].copy_(positions)``: slicing the first dimension of a
``[3, bs]`` buffer by ``bs`` selects ``min(3, bs)`` rows, and the 1-D positions broadcast into those. For ``bs >= 3``
all three rows are written (correct); for graph sizes 1 and 2 rows ``1..2`` (resp. ``2``) are not written by the step
and keep older values: all graphs' buffers are views of the same ``[3, max_bs]`` tensor, so a row holds the capture's
zero or whatever an earlier, larger replay broadcast into it. ``MRotaryEmbedding.forward`` takes the H (and W) sections
of cos/sin from those rows, so the decode token's query, and the key it stores in the cache, are rotated with a stale
position in those sections.
Doctor: stale-input, at ``_compute_multi_modal_input``. The replayed step's real rows read elements of a static input
(positions rows 1..2) that this step never wrote; they hold what the capture or an earlier replay left. The function
that omits the request's M-RoPE positions (so that only part of the buffer is refreshed) is where the fix
goes; the partial copy itself is in ``CUDAGraphRunner.forward``, which the fix leaves alone.
Fix (upstream): ``_compute_multi_modal_input`` returns early only when there is no multimodal data *and* the step is
not a prompt (``if not mm_kwargs and not inter_data.is_prompt``), and drops the assertion that M-RoPE needs
``image_grid_thw`` / ``video_grid_thw`` / ``audio_feature_lengths``: a pure-text prompt now gets
``MRotaryEmbedding.get_input_positions`` (three equal ``arange`` rows, delta 0), its delta is recorded, and its decode
steps get ``[3, n]`` positions from ``get_next_input_positions``, which fill every row of the graph's buffer.
Modelled: ``ModelInputForGPUBuilder`` (``prepare``, ``add_seq_group`` with ``_compute_lens`` then
``_compute_multi_modal_input``, ``_use_captured_graph``, ``_get_cuda_graph_pad_size``, ``build``),
``CUDAGraphRunner`` (``capture`` with two warm-up runs and the shared pool, ``forward``), ``ModelRunner``
(``capture_model``, ``execute_model``, ``prepare_model_input``), ``CommonAttentionState`` (the four graph methods
above), ``MRotaryEmbedding`` (``forward``, ``get_input_positions``, ``get_next_input_positions``),
``SequenceData.mrope_position_delta``.
Stand-ins: one decoder layer (attention + output projection) over a paged KV cache, 2 heads of size 8, rotary dim 8
with ``mrope_section`` ``[1, 1, 2]``, neox-style; prefill attention (eager) and paged decode attention written in
torch (``flash_attn_varlen_func`` / ``flash_attn_with_kvcache`` stand-ins); the multimodal placeholder map is the
request's ``multi_modal_data`` dict (empty for text); greedy sampling on the host; float64.
Workload: capture sizes ``[1, 2, 4]``; two pure-text requests A (prompt 5, 5 new tokens) and B (prompt 3, 2 new
tokens): step 0 prefills both eagerly, step 1 decodes A and B in the size-2 graph, steps 2-4 decode A alone in the
size-1 graph. The outputs compared are the logits of every step.
Measured: bug: max |graph - eager| = 7.85. The prefill (eager) equals eager (0). Step 1 (size-2 graph; buffer
``[[5, 3], [5, 3], [0, 0]]``: the W row keeps the capture's zeros) differs by 0.169; steps 2-4 (size-1 graph, which
reads column 0 of the same buffer: H row 5, left by step 1's replay, W row 0, while A is at positions 6, 7, 8) differ
by 0.374, 1.01 and 7.85 (the error grows as A's own stale-rotated keys accumulate in the cache); the greedy tokens
happen to stay equal to eager's. Fix: equals eager (max |graph - eager| = 0): the buffer holds ``[[p], [p], [p]]``.
"""
from __future__ import annotations

import dataclasses
import itertools

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/18526"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "_compute_multi_modal_input"
SYMPTOM = ("Qwen-VL (M-RoPE) with pure-text input under the V0 engine: decode steps replayed from CUDA graphs give "
           "different outputs from eager mode; the graphs' 3-row positions buffer is refreshed only partly from the "
           "request's 1-D positions")

VOCAB, HIDDEN, NUM_HEADS, HEAD_SIZE = 32, 16, 2, 8
ROTARY_DIM, MROPE_SECTION, ROPE_BASE = 8, [1, 1, 2], 10000.0
BLOCK_SIZE, NUM_BLOCKS, MAX_MODEL_LEN = 4, 12, 32
MAX_BLOCKS_PER_SEQ = MAX_MODEL_LEN // BLOCK_SIZE
CUDAGRAPH_CAPTURE_SIZES = [1, 2, 4]
_NUM_WARMUP_ITERS = 2
PAD_SLOT_ID = -1
DTYPE = torch.float64

_variant = "bug"


# --- vllm/forward_context.py (reduced) --------------------------------------------------------------------------------

_forward_context = None


class set_forward_context:
    def __init__(self, attn_metadata):
        self.attn_metadata = attn_metadata

    def __enter__(self):
        global _forward_context
        self.prev, _forward_context = _forward_context, self
        return self

    def __exit__(self, *exc):
        global _forward_context
        _forward_context = self.prev


# --- vllm/model_executor/layers/rotary_embedding.py -------------------------------------------------------------------

def _apply_rotary_emb(x, cos, sin, is_neox_style):
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    assert is_neox_style
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class MRotaryEmbedding:
    """Rotary Embedding with Multimodal Sections."""

    def __init__(self, head_size, rotary_dim, max_position_embeddings, base, device, mrope_section):
        self.head_size, self.rotary_dim, self.is_neox_style = head_size, rotary_dim, True
        self.cache_max_position_num = max_position_embeddings * 4
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=DTYPE) / rotary_dim))
        freqs = torch.arange(self.cache_max_position_num, dtype=DTYPE)[:, None] * inv_freq[None, :]
        self.cos_sin_cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)
        self.mrope_section = mrope_section
        assert sum(self.mrope_section) == rotary_dim // 2

    def forward(self, positions, query, key):
        """positions: [num_tokens,] (text only) or [3, num_tokens] (T/H/W positions with multimodal inputs)."""
        assert positions.ndim == 1 or positions.ndim == 2
        num_tokens = positions.shape[-1]
        cos_sin = self.cos_sin_cache[positions]
        cos, sin = cos_sin.chunk(2, dim=-1)
        if positions.ndim == 2:
            assert self.mrope_section
            cos = torch.cat([m[i] for i, m in enumerate(cos.split(self.mrope_section, dim=-1))], dim=-1)
            sin = torch.cat([m[i] for i, m in enumerate(sin.split(self.mrope_section, dim=-1))], dim=-1)
        query = query.view(num_tokens, -1, self.head_size)
        query = torch.cat((_apply_rotary_emb(query[..., :self.rotary_dim], cos, sin, self.is_neox_style),
                           query[..., self.rotary_dim:]), dim=-1)
        key = key.view(num_tokens, -1, self.head_size)
        key = torch.cat((_apply_rotary_emb(key[..., :self.rotary_dim], cos, sin, self.is_neox_style),
                         key[..., self.rotary_dim:]), dim=-1)
        return query, key

    @classmethod
    def get_input_positions(cls, input_tokens, hf_config=None, image_grid_thw=None, video_grid_thw=None,
                            second_per_grid_ts=None, context_len=0, seq_len=None):
        """Get mrope input positions and delta value (``_vl_get_input_positions_tensor``, text-only case: every
        token is text, so the three rows are the same ``arange`` and the delta is 0)."""
        assert not image_grid_thw and not video_grid_thw
        llm_positions = torch.arange(len(input_tokens)).view(1, -1).expand(3, -1)
        mrope_position_delta = int(llm_positions.max()) + 1 - len(input_tokens)
        llm_positions = llm_positions[:, context_len:seq_len]
        return llm_positions.tolist(), mrope_position_delta

    @staticmethod
    def get_next_input_positions(mrope_position_delta, context_len, seq_len):
        return [list(range(context_len + mrope_position_delta, seq_len + mrope_position_delta)) for _ in range(3)]


# --- vllm/attention (FlashAttention V0 backend, reduced) --------------------------------------------------------------

@dataclasses.dataclass
class FlashAttentionMetadata:
    num_prefills: int
    num_prefill_tokens: int
    num_decode_tokens: int
    slot_mapping: torch.Tensor
    seq_lens: list | None
    seq_lens_tensor: torch.Tensor
    query_start_loc: list | None
    block_tables: torch.Tensor
    use_cuda_graph: bool

    @property
    def prefill_metadata(self):
        return self if self.num_prefills > 0 else None

    @property
    def decode_metadata(self):
        return self if self.num_decode_tokens > 0 else None


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping):
    """Write each token's K/V at its slot; ``PAD_SLOT_ID`` entries are skipped."""
    kc, vc = key_cache.view(-1, NUM_HEADS, HEAD_SIZE), value_cache.view(-1, NUM_HEADS, HEAD_SIZE)
    valid = (slot_mapping >= 0)[:, None, None]
    slots = slot_mapping.clamp(min=0)
    kc[slots] = torch.where(valid, key, kc[slots])
    vc[slots] = torch.where(valid, value, vc[slots])


def flash_attn_varlen_func(q, k, v, query_start_loc, scale):
    """Causal prefill attention within each prompt (the prompts have no cached context)."""
    out = torch.empty_like(q)
    for start, end in zip(query_start_loc[:-1], query_start_loc[1:]):
        s = torch.einsum("qhd,khd->hqk", q[start:end], k[start:end]) * scale
        causal = torch.ones(end - start, end - start, dtype=torch.bool, device=q.device).tril()
        p = s.masked_fill(~causal, float("-inf")).softmax(-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", p, v[start:end])
    return out


def flash_attn_with_kvcache(q, key_cache, value_cache, block_tables, seq_lens_tensor, scale):
    """Decode attention of one query per row over the row's paged context."""
    n = q.shape[0]
    keys = key_cache[block_tables].reshape(n, MAX_BLOCKS_PER_SEQ * BLOCK_SIZE, NUM_HEADS, HEAD_SIZE)
    values = value_cache[block_tables].reshape(n, MAX_BLOCKS_PER_SEQ * BLOCK_SIZE, NUM_HEADS, HEAD_SIZE)
    s = torch.einsum("nhd,nkhd->nhk", q, keys) * scale
    idx = torch.arange(MAX_BLOCKS_PER_SEQ * BLOCK_SIZE, device=q.device)
    s = s.masked_fill((idx[None, :] >= seq_lens_tensor[:, None].long())[:, None, :], float("-inf"))
    return torch.einsum("nhk,nkhd->nhd", s.softmax(-1), values)


class FlashAttentionImpl:
    def __init__(self):
        self.scale = float(HEAD_SIZE) ** -0.5

    def forward(self, query, key, value, kv_cache, attn_metadata: FlashAttentionMetadata):
        key_cache, value_cache = kv_cache.unbind(0)
        reshape_and_cache_flash(key, value, key_cache, value_cache, attn_metadata.slot_mapping)
        if attn_metadata.prefill_metadata is not None:
            return flash_attn_varlen_func(query, key, value, attn_metadata.query_start_loc, self.scale)
        return flash_attn_with_kvcache(query, key_cache, value_cache, attn_metadata.block_tables,
                                       attn_metadata.seq_lens_tensor, self.scale)


class CommonAttentionState:
    """``vllm/attention/backends/utils.py``: the decode graphs' attention inputs."""

    def __init__(self, runner):
        self.runner = runner
        self._is_graph_capturing = False

    def graph_capture(self, max_batch_size):
        self._is_graph_capturing = True
        self._graph_slot_mapping = torch.full((max_batch_size,), PAD_SLOT_ID, dtype=torch.long,
                                              device=self.runner.device)
        self._graph_seq_lens = torch.ones(max_batch_size, dtype=torch.int32, device=self.runner.device)
        self._graph_block_tables = torch.from_numpy(self.runner.graph_block_tables).to(self.runner.device)

    def graph_capture_end(self):
        self._is_graph_capturing = False

    def graph_clone(self, batch_size):
        assert self._is_graph_capturing
        return self.__class__(self.runner)

    def graph_capture_get_metadata_for_batch(self, batch_size):
        assert self._is_graph_capturing
        return FlashAttentionMetadata(
            num_prefills=0, num_prefill_tokens=0, num_decode_tokens=batch_size,
            slot_mapping=self._graph_slot_mapping[:batch_size], seq_lens=None,
            seq_lens_tensor=self._graph_seq_lens[:batch_size], query_start_loc=None,
            block_tables=self._graph_block_tables[:batch_size], use_cuda_graph=True)

    def get_graph_input_buffers(self, attn_metadata):
        return {"slot_mapping": attn_metadata.slot_mapping,
                "seq_lens_tensor": attn_metadata.decode_metadata.seq_lens_tensor,
                "block_tables": attn_metadata.decode_metadata.block_tables}

    def prepare_graph_input_buffers(self, input_buffers, attn_metadata):
        input_buffers["seq_lens_tensor"].copy_(attn_metadata.decode_metadata.seq_lens_tensor, non_blocking=True)
        input_buffers["block_tables"].copy_(attn_metadata.decode_metadata.block_tables, non_blocking=True)


# --- the model (Qwen2-VL language model, reduced to one decoder layer) -----------------------------------------------

class Qwen2VLForConditionalGeneration:
    def __init__(self, device):
        gen = generator(18526)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.embed_tokens = r(VOCAB, HIDDEN, scale=1.0)
        self.wq, self.wk, self.wv = (r(HIDDEN, NUM_HEADS * HEAD_SIZE) for _ in range(3))
        self.wo = r(NUM_HEADS * HEAD_SIZE, HIDDEN)
        self.lm_head = r(HIDDEN, VOCAB, scale=1.0)
        self.rotary_emb = MRotaryEmbedding(HEAD_SIZE, ROTARY_DIM, MAX_MODEL_LEN, ROPE_BASE, device, MROPE_SECTION)
        self.attn = FlashAttentionImpl()
        self.kv_cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE, dtype=DTYPE, device=device)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        attn_metadata = _forward_context.attn_metadata
        h = self.embed_tokens[input_ids]
        n = h.shape[0]
        q, k = self.rotary_emb.forward(positions, h @ self.wq, h @ self.wk)
        v = (h @ self.wv).view(n, NUM_HEADS, HEAD_SIZE)
        attn = self.attn.forward(q, k, v, self.kv_cache, attn_metadata)
        return h + attn.reshape(n, -1) @ self.wo

    __call__ = forward

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head


# --- vllm/sequence.py (reduced) ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class SequenceData:
    token_ids: list
    prompt_len: int
    num_computed_tokens: int = 0
    mrope_position_delta: int | None = None

    def get_len(self):
        return len(self.token_ids)

    def get_token_ids(self):
        return self.token_ids


@dataclasses.dataclass
class SequenceGroupMetadata:
    request_id: str
    is_prompt: bool
    seq_data: dict
    block_tables: dict
    token_chunk_size: int
    multi_modal_data: dict | None = None


# --- vllm/worker/model_runner.py (V0, May 2025, reduced) --------------------------------------------------------------

@dataclasses.dataclass
class InterDataForSeqGroup:
    request_id: str
    seq_ids: list
    is_prompt: bool
    block_tables: dict
    input_tokens: list
    input_positions: list
    seq_lens: list
    context_lens: list
    query_lens: list
    mrope_input_positions: list | None = None
    multi_modal_kwargs: dict | None = None

    @property
    def n_seqs(self):
        return len(self.seq_ids)


@dataclasses.dataclass
class ModelInputForGPU:
    input_tokens: torch.Tensor
    input_positions: torch.Tensor
    attn_metadata: FlashAttentionMetadata
    selected_token_indices: torch.Tensor


class ModelInputForGPUBuilder:
    def __init__(self, runner):
        self.runner = runner
        # WARNING: The order of the functions matters!
        self.per_seq_compute_fns = [self._compute_lens]
        self.per_seq_group_compute_fns = [self._compute_multi_modal_input]

    def prepare(self):
        self.decode_only = True
        self.inter_data_list: list[InterDataForSeqGroup] = []

    def _compute_lens(self, inter_data, seq_idx, seq_group_metadata):
        seq_data = seq_group_metadata.seq_data[inter_data.seq_ids[seq_idx]]
        seq_len = seq_data.get_len()
        context_len = seq_data.num_computed_tokens
        if inter_data.is_prompt:
            seq_len = min(seq_len, context_len + seq_group_metadata.token_chunk_size)
        tokens = seq_data.get_token_ids()[context_len:seq_len]
        inter_data.seq_lens[seq_idx] = seq_len
        inter_data.context_lens[seq_idx] = context_len
        inter_data.input_tokens[seq_idx].extend(tokens)
        inter_data.input_positions[seq_idx].extend(range(context_len, seq_len))
        inter_data.query_lens[seq_idx] = seq_len - context_len

        if seq_data.mrope_position_delta is not None:
            if inter_data.mrope_input_positions is None:
                inter_data.mrope_input_positions = [None] * inter_data.n_seqs
            inter_data.mrope_input_positions[seq_idx] = MRotaryEmbedding.get_next_input_positions(
                seq_data.mrope_position_delta, context_len, seq_len)

    def _compute_multi_modal_input(self, inter_data, seq_group_metadata):
        """If multi-modal data is given, add it to the input."""
        mm_kwargs = dict(seq_group_metadata.multi_modal_data or {})   # MultiModalPlaceholderMap.from_seq_group
        if _variant == "bug":
            if not mm_kwargs:
                return
        else:
            # M-RoPE requires mrope_positions even for plain text; return early
            # when mm_kwargs is empty only if inter_data.is_prompt is False.
            if not mm_kwargs and not inter_data.is_prompt:
                return

        inter_data.multi_modal_kwargs = mm_kwargs

        # special processing for mrope position deltas.
        if self.runner.uses_mrope:
            image_grid_thw = mm_kwargs.get("image_grid_thw", None)
            video_grid_thw = mm_kwargs.get("video_grid_thw", None)
            if _variant == "bug":
                assert image_grid_thw is not None or video_grid_thw is not None, (
                    "mrope embedding type requires multi-modal input mapper returns 'image_grid_thw' or "
                    "'video_grid_thw' or 'audio_feature_lengths'.")
            inter_data.mrope_input_positions = [None] * inter_data.n_seqs
            for seq_idx in range(inter_data.n_seqs):
                seq_data = seq_group_metadata.seq_data[inter_data.seq_ids[seq_idx]]
                mrope_input_positions, mrope_position_delta = MRotaryEmbedding.get_input_positions(
                    seq_data.get_token_ids(), image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
                    context_len=inter_data.context_lens[seq_idx], seq_len=inter_data.seq_lens[seq_idx])
                seq_data.mrope_position_delta = mrope_position_delta
                inter_data.mrope_input_positions[seq_idx] = mrope_input_positions

    def add_seq_group(self, seq_group_metadata):
        seq_ids = list(seq_group_metadata.seq_data.keys())
        n_seqs = len(seq_ids)
        if seq_group_metadata.is_prompt:
            self.decode_only = False
        inter_data = InterDataForSeqGroup(
            request_id=seq_group_metadata.request_id, seq_ids=seq_ids, is_prompt=seq_group_metadata.is_prompt,
            block_tables=seq_group_metadata.block_tables, input_tokens=[[] for _ in range(n_seqs)],
            input_positions=[[] for _ in range(n_seqs)], seq_lens=[0] * n_seqs, context_lens=[0] * n_seqs,
            query_lens=[0] * n_seqs)
        self.inter_data_list.append(inter_data)
        for seq_idx in range(n_seqs):
            for per_seq_fn in self.per_seq_compute_fns:
                per_seq_fn(inter_data, seq_idx, seq_group_metadata)
        for per_seq_group_fn in self.per_seq_group_compute_fns:
            per_seq_group_fn(inter_data, seq_group_metadata)

    def _use_captured_graph(self, batch_size, decode_only, max_decode_seq_len):
        return (decode_only and not self.runner.enforce_eager
                and max_decode_seq_len <= self.runner.max_seq_len_to_capture
                and batch_size <= self.runner.max_batchsize_to_capture)

    def _get_cuda_graph_pad_size(self, num_seqs, max_decode_seq_len):
        if not self.decode_only:
            return -1
        batch_size = num_seqs
        if not self._use_captured_graph(batch_size, self.decode_only, max_decode_seq_len):
            return -1
        graph_batch_size = self.runner.pad_for_cudagraph(batch_size)
        return graph_batch_size - batch_size

    def build(self) -> ModelInputForGPU:
        input_tokens = []
        for inter_data in self.inter_data_list:
            for cur_input_tokens in inter_data.input_tokens:
                input_tokens.extend(cur_input_tokens)

        mrope_input_positions = None
        if any(inter_data.mrope_input_positions is not None for inter_data in self.inter_data_list):
            mrope_input_positions = [[] for _ in range(3)]
            for idx in range(3):
                for inter_data in self.inter_data_list:
                    msections = inter_data.mrope_input_positions
                    if msections is None:
                        for _seq_input_positions in inter_data.input_positions:
                            mrope_input_positions[idx].extend(_seq_input_positions)
                    else:
                        for _seq_mrope_input_positions in msections:
                            mrope_input_positions[idx].extend(_seq_mrope_input_positions[idx])
            input_positions = None
        else:
            input_positions = []
            for inter_data in self.inter_data_list:
                for cur_input_positions in inter_data.input_positions:
                    input_positions.extend(cur_input_positions)

        seq_lens, query_lens, max_decode_seq_len = [], [], 0
        for inter_data in self.inter_data_list:
            seq_lens.extend(inter_data.seq_lens)
            query_lens.extend(inter_data.query_lens)
            if not inter_data.is_prompt:
                max_decode_seq_len = max(max_decode_seq_len, max(inter_data.seq_lens))

        cuda_graph_pad_size = self._get_cuda_graph_pad_size(len(seq_lens), max_decode_seq_len)
        pad = max(cuda_graph_pad_size, 0)
        device = self.runner.device

        input_tokens.extend(itertools.repeat(0, pad))
        input_tokens_tensor = torch.tensor(input_tokens, dtype=torch.long).to(device)
        if mrope_input_positions is not None:
            for idx in range(3):
                mrope_input_positions[idx].extend(itertools.repeat(0, pad))
            input_positions_tensor = torch.tensor(mrope_input_positions, dtype=torch.long).to(device)
        else:
            input_positions.extend(itertools.repeat(0, pad))
            input_positions_tensor = torch.tensor(input_positions, dtype=torch.long).to(device)

        # Attention metadata (FlashAttentionMetadataBuilder.build, reduced).
        slot_mapping, block_tables = [], []
        for inter_data in self.inter_data_list:
            for seq_idx, seq_id in enumerate(inter_data.seq_ids):
                blocks = inter_data.block_tables[seq_id]
                for p in range(inter_data.context_lens[seq_idx], inter_data.seq_lens[seq_idx]):
                    slot_mapping.append(blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
                block_tables.append(blocks + [0] * (MAX_BLOCKS_PER_SEQ - len(blocks)))
        slot_mapping.extend(itertools.repeat(PAD_SLOT_ID, pad))
        block_tables.extend([[0] * MAX_BLOCKS_PER_SEQ for _ in range(pad)])
        num_prefills = sum(1 for d in self.inter_data_list if d.is_prompt)
        query_start_loc = list(itertools.accumulate([0] + query_lens))
        attn_metadata = FlashAttentionMetadata(
            num_prefills=num_prefills,
            num_prefill_tokens=sum(q for d in self.inter_data_list if d.is_prompt for q in d.query_lens),
            num_decode_tokens=0 if num_prefills else len(seq_lens) + pad,
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long).to(device),
            seq_lens=seq_lens,
            seq_lens_tensor=torch.tensor(seq_lens + [1] * pad, dtype=torch.int32).to(device),
            query_start_loc=query_start_loc,
            block_tables=torch.tensor(block_tables, dtype=torch.int32).to(device),
            use_cuda_graph=cuda_graph_pad_size != -1)
        # The last token of each sequence is sampled.
        selected_token_indices = torch.tensor(query_start_loc[1:], dtype=torch.long).to(device) - 1
        return ModelInputForGPU(input_tokens_tensor, input_positions_tensor, attn_metadata, selected_token_indices)


class CUDAGraphRunner:
    def __init__(self, model, backend_name, attn_state):
        self.model, self.backend_name, self.attn_state = model, backend_name, attn_state
        self.input_buffers: dict = {}
        self.output_buffers: dict = {}
        self._graph = None

    def capture(self, input_ids, positions, kv_caches, attn_metadata, memory_pool, device, batch_size):
        assert self._graph is None
        # Run the model a few times without capturing the graph (folded into kit.capture's warmups), then
        # capture it into the runner's shared pool.
        static = {"input_ids": input_ids, "positions": positions,
                  **self.attn_state.get_graph_input_buffers(attn_metadata)}
        self._graph, hidden = capture(
            lambda: self.model(input_ids=input_ids, positions=positions), device=device, pool=memory_pool,
            warmups=_NUM_WARMUP_ITERS, static=static, state={"kv_caches": kv_caches}, owner="CUDAGraphRunner",
            name=f"decode bs={batch_size}")
        self.input_buffers = {**static, "kv_caches": kv_caches}
        self.output_buffers = {"hidden_states": hidden}

    def forward(self, input_ids, positions, num_real):
        attn_metadata = _forward_context.attn_metadata
        # Copy the input tensors to the input buffers.
        self.input_buffers["input_ids"].copy_(input_ids, non_blocking=True)
        if positions is not None:
            # in some case like MLA, it will reuse positions in metadata
            # but truncate them to the original size
            # so the shape is not padded, we need to copy partial only
            self.input_buffers["positions"][:positions.shape[0]].copy_(positions, non_blocking=True)
        if self.backend_name != "NO_ATTENTION":
            self.input_buffers["slot_mapping"].copy_(attn_metadata.slot_mapping, non_blocking=True)
        self.attn_state.prepare_graph_input_buffers(self.input_buffers, attn_metadata)
        # Run the graph.
        hidden = self.output_buffers["hidden_states"]
        return replay(self._graph, hidden, real=num_real, size=hidden.shape[0])


class ModelRunner:
    def __init__(self, device, model, enforce_eager):
        self.device, self.model, self.enforce_eager = device, model, enforce_eager
        self.uses_mrope = True                                     # model_config.uses_mrope (Qwen2-VL)
        self.max_seq_len_to_capture = MAX_MODEL_LEN
        self.max_batchsize_to_capture = CUDAGRAPH_CAPTURE_SIZES[-1]
        self.graph_block_tables = torch.zeros(self.max_batchsize_to_capture, MAX_BLOCKS_PER_SEQ,
                                              dtype=torch.int32).numpy()
        self.attn_backend_name = "FLASH_ATTN"
        self.attn_state = CommonAttentionState(self)
        self.graph_runners: dict = {}
        self.graph_memory_pool = None
        self.builder = ModelInputForGPUBuilder(self)

    def pad_for_cudagraph(self, batch_size):
        return next(s for s in CUDAGRAPH_CAPTURE_SIZES if s >= batch_size)

    def capture_model(self):
        assert not self.enforce_eager
        # Prepare dummy inputs. These will be reused for all batch sizes.
        max_batch_size = self.max_batchsize_to_capture
        input_tokens = torch.zeros(max_batch_size, dtype=torch.long, device=self.device)
        input_positions = torch.zeros(max_batch_size, dtype=torch.long, device=self.device)
        if self.uses_mrope:
            input_positions = torch.tile(input_positions, (3, 1))
        self.graph_memory_pool = graph_pool_handle(self.device)
        self.attn_state.graph_capture(max_batch_size)
        # NOTE: Capturing the largest batch size first may help reduce the memory usage of CUDA graph.
        for batch_size in reversed(CUDAGRAPH_CAPTURE_SIZES):
            attn_metadata = self.attn_state.graph_capture_get_metadata_for_batch(batch_size)
            graph_runner = CUDAGraphRunner(self.model, self.attn_backend_name,
                                           self.attn_state.graph_clone(batch_size))
            with set_forward_context(attn_metadata):
                graph_runner.capture(input_ids=input_tokens[:batch_size],
                                     positions=input_positions[..., :batch_size],
                                     kv_caches=self.model.kv_cache, attn_metadata=attn_metadata,
                                     memory_pool=self.graph_memory_pool, device=self.device, batch_size=batch_size)
            self.graph_runners[batch_size] = graph_runner
        self.attn_state.graph_capture_end()

    def prepare_model_input(self, seq_group_metadata_list):
        self.builder.prepare()
        for seq_group_metadata in seq_group_metadata_list:
            self.builder.add_seq_group(seq_group_metadata)
        return self.builder.build()

    def execute_model(self, model_input: ModelInputForGPU):
        prefill_meta = model_input.attn_metadata.prefill_metadata
        decode_meta = model_input.attn_metadata.decode_metadata
        num_real = model_input.selected_token_indices.shape[0]
        with set_forward_context(model_input.attn_metadata):
            if prefill_meta is None and decode_meta.use_cuda_graph:
                graph_batch_size = model_input.input_tokens.shape[0]
                hidden_states = self.graph_runners[graph_batch_size].forward(
                    model_input.input_tokens, model_input.input_positions, num_real)
            else:
                hidden_states = self.model(input_ids=model_input.input_tokens,
                                           positions=model_input.input_positions)
        return self.model.compute_logits(hidden_states.index_select(0, model_input.selected_token_indices))


# --- a reduced LLMEngine loop: V0 scheduling (prefills together, then decodes), greedy sampling ----------------------

def _serve(device, enforce_eager):
    model = Qwen2VLForConditionalGeneration(device)
    runner = ModelRunner(device, model, enforce_eager)
    if not enforce_eager:
        runner.capture_model()
    gen = generator(1215)
    requests = {
        "A": (SequenceData(torch.randint(1, VOCAB, (5,), generator=gen).tolist(), prompt_len=5), [1, 2, 3], 5),
        "B": (SequenceData(torch.randint(1, VOCAB, (3,), generator=gen).tolist(), prompt_len=3), [4, 5], 2),
    }
    generated = {rid: 0 for rid in requests}
    outs, is_prompt = [], True
    while True:
        running = [rid for rid in requests if generated[rid] < requests[rid][2]]
        if not running:
            break
        metas = [SequenceGroupMetadata(request_id=rid, is_prompt=is_prompt, seq_data={0: requests[rid][0]},
                                       block_tables={0: requests[rid][1]},
                                       token_chunk_size=requests[rid][0].get_len()
                                       - requests[rid][0].num_computed_tokens,
                                       multi_modal_data=None)
                 for rid in running]
        model_input = runner.prepare_model_input(metas)
        logits = runner.execute_model(model_input)
        outs.append(logits.clone())
        for rid, tok in zip(running, torch.argmax(logits, -1).tolist()):
            seq_data = requests[rid][0]
            seq_data.num_computed_tokens = seq_data.get_len()
            seq_data.token_ids.append(tok)
            generated[rid] += 1
        is_prompt = False
    return outs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: _serve(device, False), lambda: _serve(device, True))
