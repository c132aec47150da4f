"""DeepSeek-V3.2 MTP drafter under PIECEWISE graphs: the sparse indexer caches the padded rows of ``k`` through ``slot_mapping`` entries past the real tokens.

Upstream: https://github.com/vllm-project/vllm/pull/32175 (vllm-project/vllm; merged 2026-01-12 per the scout's
record; issue https://github.com/vllm-project/vllm/issues/32172). The title and the original hunk were not read here.
The fixed lines are in the current ``vllm/model_executor/layers/sparse_attn_indexer.py``, and
https://github.com/vllm-project/vllm/pull/39225 ("[Bug] Fix rocm sparse attn indexer issue", merged April 2026)
quotes them as the CUDA path's existing logic when it ports the same truncation to the ROCm (aiter) indexer.
Symptom: DeepSeek-V3.2 with MTP speculative decoding (``deepseek_mtp``) and CUDA graphs: the indexer's cache kernel
reads ``slot_mapping`` out of bounds (the fix's own comment). That is an illegal memory access when the read leaves
the allocation; otherwise padded rows' indexer keys land in whatever slots the stale entries name, and drafts degrade.
The issue text was not read here. With ``--enforce-eager`` nothing is padded and the run is fine.
Mechanism: ``EagleProposer.propose`` (vllm/v1/spec_decode/eagle.py) builds the draft layer's attention and indexer
metadata (``draft_indexer_metadata_builder.build_for_drafting``) from the target's ``common_attn_metadata``. Its
``slot_mapping`` covers the real ``num_tokens`` and is a view of the runner's persistent
``BlockTable.slot_mapping`` buffer, which ``compute_slot_mapping`` writes only up to each step's token count. The
proposer then runs the MTP layer at ``num_input_tokens = pad_for_cudagraph(num_tokens)`` (PIECEWISE). The captured
piece before the indexer computes ``k = wk(hidden_states)`` for every padded row, from whatever the proposer's
persistent ``input_ids`` / ``positions`` / ``hidden_states`` buffers still hold there. ``sparse_attn_indexer`` is a
splitting op (``vllm::sparse_attn_indexer``) that runs eagerly between the pieces, and it passes that padded ``k``
with the real-length ``slot_mapping`` to ``ops.indexer_k_quant_and_cache``. That kernel
(csrc/cache_kernels.cu) launches ``grid(k.size(0), ...)`` and reads ``slot_mapping[token_idx]`` with no bound, so
each padded row reads an entry past the view's end. An entry past the allocation faults. An entry inside the runner's
buffer is an earlier step's slot, and the kernel quantizes the padded row's stale ``k`` into it. Here that slot holds
a live key. In the workload, request D's draft at position 4 was rejected in step 1 (its row 7 was the last row of an
8-token step). In step 2, D re-computes position 4 at row 4 with the corrected token, in a 6-token step padded to 8.
Padded row 7 still carries step 1's rejected-draft inputs, and ``slot_mapping``'s stale entry 7 still points at D's
position 4, so the corrected indexer key is overwritten. Every later indexer top-k over D's context reads the wrong
key. In eager mode ``k.shape[0] == slot_mapping.shape[0]``, so no row reads past the view.
Doctor: padded-shape-mismatch, at sparse_attn_indexer. The eager op between the graph pieces combines ``k``, which has
the graph's padded token rows, with ``slot_mapping``, which has only the real rows. The fix changes only this
function.
Fix (upstream): ``num_tokens = slot_mapping.shape[0]; k = k[:num_tokens]`` before ``indexer_k_quant_and_cache``
("During speculative decoding, k may be padded to the CUDA graph batch size while slot_mapping only covers actual
tokens. Truncate k to avoid out-of-bounds reads in the kernel.").
Modelled: the MTP proposer's first pass only (``num_speculative_tokens = 1``, no draft loop), with the padded drafter
batch (``prepare_inputs_padded``: every target token is re-run, the sample index is the last accepted token), and
``cudagraph_mode=PIECEWISE`` (so the runner's slot-mapping tail is never refilled with -1). The target model and the
rejection sampler are a workload stand-in that supplies hidden states, sampled tokens and accept/reject outcomes. The
drafts are the drafter's own argmax. The draft model is one DeepSeek MTP layer: enorm/hnorm/eh_proj, then an
MLA-with-indexer block with the MLA weights absorbed into latent projections (no q-LoRA, no MoE, one RoPE pair).
Sizes: hidden 8, indexer with 2 heads of dim 4 and top-k 2, block size 4, capture sizes [1, 2, 4, 8]. The layer's
forward is split where vLLM splits it. Piece 0 (captured) runs the projections, the indexer's q/k/weights and the
attention output allocation (zeros instead of ``torch.empty``). Then come the splitting ops ``sparse_attn_indexer``
and the sparse MLA attention (``FlashMLASparseImpl.forward``, which slices to ``num_actual_tokens``), and piece 1
(captured) does the output projection and residual. ``compute_logits`` runs after the forward. Stand-ins:
``indexer_k_quant_and_cache`` quantizes per token (ue8m0 scale, values kept in float) and reads ``slot_mapping``
through a pointer into its allocation, like the CUDA kernel. Its blocks run in row order, so a later row wins a slot
that two rows write. ``fp8_paged_mqa_logits`` + ``top_k_per_row`` serve both the decode path and the prefill path
(upstream gathers the same cache with ``cp_gather_indexer_k_quant_cache`` for prefill).
Workload: step 0 prefills A, B, C, D (3 tokens each; 12 tokens, above the largest capture size, so eager). Step 1
decodes all four (8 tokens, a captured size; D's draft is rejected). A then finishes. Steps 2 to 4 decode B, C, D
(6 tokens, padded to 8; all drafts accepted). Each padded step writes step 1's rejected-draft key over D's position 4
again. In step 4 the top-k of D's sampled row drops position 4 (eager keeps it), and D's draft logits move by about 3.8.
"""
from __future__ import annotations

import contextlib

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/32175"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "sparse_attn_indexer"
SYMPTOM = ("DeepSeek-V3.2 + MTP with CUDA graphs: the drafter's indexer passes k padded to the graph size with a "
           "slot_mapping of the real tokens; indexer_k_quant_and_cache reads slot_mapping past its end (illegal "
           "address, or stale slots that get padded-row keys written over live indexer keys)")

PAD_SLOT_ID = -1
VOCAB, HIDDEN = 16, 8
INDEX_N_HEADS, INDEX_HEAD_DIM, INDEX_TOPK = 2, 4, 2      # index_n_heads, index_head_dim, index_topk
KV_LORA_RANK = 4
BLOCK_SIZE = 4
MAX_NUM_REQS = 4
MAX_BLOCKS_PER_REQ = 3
MAX_MODEL_LEN = MAX_BLOCKS_PER_REQ * BLOCK_SIZE
NUM_BLOCKS = 1 + MAX_NUM_REQS * MAX_BLOCKS_PER_REQ       # block 0: the null block
MAX_NUM_BATCHED_TOKENS = 16
CUDAGRAPH_CAPTURE_SIZES = [1, 2, 4, 8]
NUM_SPECULATIVE_TOKENS = 1
FP8_MAX = 448.0
INDEXER_K_CACHE_PREFIX = "model.layers.61.self_attn.indexer.k_cache"
MLA_LAYER_NAME = "model.layers.61.self_attn.attn"

_variant = "bug"


def rms_norm(x, weight, eps=1e-6):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def _rope(x, positions):
    """One rotary pair (dims 0, 1) of the rope slice; ``x``: [T, ..., D]."""
    ang = positions.to(x.dtype) * 0.7
    while ang.dim() < x.dim() - 1:
        ang = ang.unsqueeze(-1)
    cos, sin = torch.cos(ang), torch.sin(ang)
    x0, x1 = x[..., 0], x[..., 1]
    return torch.cat([(x0 * cos - x1 * sin).unsqueeze(-1), (x0 * sin + x1 * cos).unsqueeze(-1), x[..., 2:]], -1)


# --- vllm/forward_context.py --------------------------------------------------------------------------------------------

class ForwardContext:
    def __init__(self, attn_metadata, num_tokens, cudagraph_runtime_mode):
        self.attn_metadata, self.num_tokens = attn_metadata, num_tokens
        self.cudagraph_runtime_mode = cudagraph_runtime_mode


_forward_context: list[ForwardContext] = []


@contextlib.contextmanager
def set_forward_context(attn_metadata, num_tokens, cudagraph_runtime_mode="NONE"):
    _forward_context.append(ForwardContext(attn_metadata, num_tokens, cudagraph_runtime_mode))
    try:
        yield
    finally:
        _forward_context.pop()


def get_forward_context() -> ForwardContext:
    return _forward_context[-1]


# --- csrc/cache_kernels.cu via vllm/_custom_ops.py (stand-ins) ----------------------------------------------------------

def _pointer(t: torch.Tensor):
    """A device pointer to ``t``: its whole allocation (flat) and the element offset where ``t`` starts."""
    numel = t.untyped_storage().nbytes() // t.element_size()
    return torch.as_strided(t, (numel,), (1,), 0), t.storage_offset()


class ops:
    @staticmethod
    def indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size, scale_fmt):
        """``indexer_k_quant_and_cache_kernel``: ``grid(num_tokens = k.size(0), ...)``; block ``token_idx`` loads
        ``slot_mapping[token_idx]`` (no bound: the kernel is handed only the pointer), skips ``slot_idx < 0`` and
        stores the quantized row and its scale at ``kv_cache[slot_idx // block_size, slot_idx % block_size]``.
        Cache row layout: ``head_dim`` quantized values, then the fp32 scale."""
        num_tokens, head_dim = k.size(0), k.size(1)
        cache_block_size = kv_cache.size(1)
        mem, base = _pointer(slot_mapping)
        if base + num_tokens > mem.numel():
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        slot_idx = mem[base:base + num_tokens].tolist()
        amax = k.abs().reshape(num_tokens, -1, quant_block_size).amax(-1).clamp_min(1e-4)      # one quant block
        scale = amax / FP8_MAX
        if scale_fmt == "ue8m0":
            scale = torch.exp2(torch.ceil(torch.log2(scale)))
        k_q = (k / scale.repeat_interleave(quant_block_size, -1)).clamp(-FP8_MAX, FP8_MAX)
        for token_idx, slot in enumerate(slot_idx):       # thread blocks; a later row wins a shared slot
            if slot < 0:
                continue
            block_idx, block_offset = slot // cache_block_size, slot % cache_block_size
            kv_cache[block_idx, block_offset, :head_dim] = k_q[token_idx]
            kv_cache[block_idx, block_offset, head_dim:] = scale[token_idx]

    @staticmethod
    def concat_and_cache_mla(kv_c, kv_cache, slot_mapping):
        """``concat_and_cache_mla_kernel``: one block per row of ``kv_c``, ``slot_mapping[token_idx]``; skips -1."""
        flat = kv_cache.view(-1, kv_cache.shape[-1])
        for token_idx, slot in enumerate(slot_mapping[:kv_c.shape[0]].tolist()):
            if slot >= 0:
                flat[slot] = kv_c[token_idx]


def fp8_paged_mqa_logits(q_fp8, kv_cache, weights, context_lens, block_table, max_model_len):
    """DeepGEMM paged MQA logits: for each query row, ``sum_h relu(q[h] . k_j) * w[h]`` over the row's paged context
    (dequantized ``values * scale``); positions at or past ``context_lens`` are ``-inf``."""
    head_dim = q_fp8.shape[-1]
    j = torch.arange(max_model_len, device=q_fp8.device)
    blocks = block_table[:, j // BLOCK_SIZE].long()                               # [T, max_model_len]
    rows = kv_cache[blocks, (j % BLOCK_SIZE).expand_as(blocks)]                   # [T, max_model_len, D + 1]
    keys = rows[..., :head_dim] * rows[..., head_dim:]
    scores = torch.relu(torch.einsum("thd,tjd->thj", q_fp8, keys))
    logits = (scores * weights.unsqueeze(-1)).sum(1)
    return logits.masked_fill(j.unsqueeze(0) >= context_lens.unsqueeze(1), float("-inf"))


def top_k_per_row(logits, topk_tokens):
    vals, idx = logits.topk(topk_tokens, dim=-1)
    return torch.where(torch.isinf(vals), torch.full_like(idx, -1), idx).to(torch.int32)


# --- vllm/v1/attention/backends/utils.py, mla/indexer.py, mla/flashmla_sparse.py ----------------------------------------

class CommonAttentionMetadata:
    def __init__(self, query_start_loc, seq_lens, num_reqs, num_actual_tokens, block_table_tensor, slot_mapping):
        self.query_start_loc, self.seq_lens = query_start_loc, seq_lens
        self.num_reqs, self.num_actual_tokens = num_reqs, num_actual_tokens
        self.block_table_tensor, self.slot_mapping = block_table_tensor, slot_mapping


class DeepseekV32IndexerMetadata:
    def __init__(self, num_actual_tokens, slot_mapping, block_table, context_lens, num_decodes, num_decode_tokens,
                 num_prefills):
        self.num_actual_tokens, self.slot_mapping = num_actual_tokens, slot_mapping
        self.block_table = block_table          # per token: its request's block-table row
        self.context_lens = context_lens        # per token: causal context length
        self.num_decodes, self.num_decode_tokens, self.num_prefills = num_decodes, num_decode_tokens, num_prefills


class FlashMLASparseMetadata:
    def __init__(self, num_actual_tokens, slot_mapping, block_table, req_id_per_token):
        self.num_actual_tokens, self.slot_mapping = num_actual_tokens, slot_mapping
        self.block_table, self.req_id_per_token = block_table, req_id_per_token


def _per_token(cm: CommonAttentionMetadata):
    qsl = cm.query_start_loc.cpu()
    query_lens = qsl[1:] - qsl[:-1]
    req_id_per_token = torch.repeat_interleave(torch.arange(cm.num_reqs), query_lens)
    offsets = torch.arange(cm.num_actual_tokens) - qsl[:-1][req_id_per_token]
    context_lens = cm.seq_lens.cpu()[req_id_per_token] - query_lens[req_id_per_token] + offsets + 1
    return query_lens, req_id_per_token, context_lens


class DeepseekV32IndexerMetadataBuilder:
    reorder_batch_threshold = 1 + NUM_SPECULATIVE_TOKENS

    def build(self, common_prefix_len, common_attn_metadata: CommonAttentionMetadata) -> DeepseekV32IndexerMetadata:
        cm = common_attn_metadata
        dev = cm.slot_mapping.device
        query_lens, req_id_per_token, context_lens = _per_token(cm)
        is_decode = query_lens <= self.reorder_batch_threshold          # the batch is reordered: decodes first
        num_decodes = int(is_decode.sum())
        return DeepseekV32IndexerMetadata(
            num_actual_tokens=cm.num_actual_tokens, slot_mapping=cm.slot_mapping,
            block_table=cm.block_table_tensor[req_id_per_token.to(dev)], context_lens=context_lens.to(dev),
            num_decodes=num_decodes, num_decode_tokens=int(query_lens[:num_decodes].sum()),
            num_prefills=cm.num_reqs - num_decodes)

    def build_for_drafting(self, common_attn_metadata, draft_index):
        return self.build(0, common_attn_metadata)


class FlashMLASparseMetadataBuilder:
    def build_for_drafting(self, common_attn_metadata, draft_index):
        cm = common_attn_metadata
        _, req_id_per_token, _ = _per_token(cm)
        return FlashMLASparseMetadata(cm.num_actual_tokens, cm.slot_mapping, cm.block_table_tensor,
                                      req_id_per_token.to(cm.slot_mapping.device))


# --- vllm/model_executor/layers/sparse_attn_indexer.py -------------------------------------------------------------------

def sparse_attn_indexer_fake(hidden_states, k_cache_prefix, kv_cache, q_fp8, k, weights, quant_block_size, scale_fmt,
                             topk_tokens, head_dim, max_model_len, total_seq_lens, topk_indices_buffer):
    return topk_indices_buffer


def sparse_attn_indexer(hidden_states, k_cache_prefix, kv_cache, q_fp8, k, weights, quant_block_size, scale_fmt,
                        topk_tokens, head_dim, max_model_len, total_seq_lens, topk_indices_buffer):
    """The ``vllm::sparse_attn_indexer`` splitting op: runs eagerly between the PIECEWISE graph pieces."""
    # careful! this will be None in dummy run
    attn_metadata = get_forward_context().attn_metadata
    if not isinstance(attn_metadata, dict):
        return sparse_attn_indexer_fake(hidden_states, k_cache_prefix, kv_cache, q_fp8, k, weights, quant_block_size,
                                        scale_fmt, topk_tokens, head_dim, max_model_len, total_seq_lens,
                                        topk_indices_buffer)
    attn_metadata = attn_metadata[k_cache_prefix]
    assert isinstance(attn_metadata, DeepseekV32IndexerMetadata)
    slot_mapping = attn_metadata.slot_mapping
    has_decode = attn_metadata.num_decodes > 0
    has_prefill = attn_metadata.num_prefills > 0
    num_decode_tokens = attn_metadata.num_decode_tokens

    if _variant == "fix":
        # During speculative decoding, k may be padded to the CUDA graph batch
        # size while slot_mapping only covers actual tokens. Truncate k to avoid
        # out-of-bounds reads in the kernel.
        num_tokens = slot_mapping.shape[0]
        k = k[:num_tokens]

    ops.indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size, scale_fmt)

    topk_indices_buffer[: hidden_states.shape[0]] = -1
    spans = []
    if has_decode:
        spans.append((0, num_decode_tokens))
    if has_prefill:
        spans.append((num_decode_tokens, attn_metadata.num_actual_tokens))
    for start, end in spans:
        logits = fp8_paged_mqa_logits(q_fp8[start:end], kv_cache, weights[start:end],
                                      attn_metadata.context_lens[start:end], attn_metadata.block_table[start:end],
                                      max_model_len)
        topk_indices_buffer[start:end, :topk_tokens] = top_k_per_row(logits, topk_tokens)
    return topk_indices_buffer


# --- vllm/v1/attention/backends/mla/flashmla_sparse.py -------------------------------------------------------------------

def triton_convert_req_index_to_global_index(req_id, block_table, token_indices, block_size):
    blocks = block_table[req_id.unsqueeze(1).long(), (token_indices.clamp(min=0) // block_size).long()]
    slots = blocks.long() * block_size + token_indices.clamp(min=0) % block_size
    return torch.where(token_indices >= 0, slots, torch.full_like(slots, -1))


class FlashMLASparseImpl:
    def __init__(self, kv_cache, topk_indices_buffer):
        self.kv_cache, self.topk_indices_buffer = kv_cache, topk_indices_buffer
        self.scale = KV_LORA_RANK ** -0.5

    def forward(self, q, kv_c_normed, output):
        """``unified_mla_attention_with_output`` (a splitting op): only the first ``num_actual_tokens`` rows."""
        attn_metadata = get_forward_context().attn_metadata
        if attn_metadata is None:
            return output.fill_(0)
        attn_metadata = attn_metadata[MLA_LAYER_NAME]
        num_actual_toks = attn_metadata.num_actual_tokens
        q, kv_c_normed = q[:num_actual_toks], kv_c_normed[:num_actual_toks]
        ops.concat_and_cache_mla(kv_c_normed, self.kv_cache, attn_metadata.slot_mapping)
        topk_indices = self.topk_indices_buffer[:num_actual_toks]
        topk_slots = triton_convert_req_index_to_global_index(attn_metadata.req_id_per_token,
                                                              attn_metadata.block_table, topk_indices, BLOCK_SIZE)
        kv = self.kv_cache.view(-1, KV_LORA_RANK)[topk_slots.clamp(min=0)]           # [T, topk, L]
        scores = (q.unsqueeze(1) * kv).sum(-1) * self.scale
        p = torch.softmax(scores.masked_fill(topk_slots < 0, float("-inf")), -1)
        output[:num_actual_toks] = (p.unsqueeze(-1) * kv).sum(1)
        return output


# --- vllm/model_executor/models/deepseek_mtp.py (one MTP layer with a DeepseekV32 MLA + indexer block) -------------------

class DeepSeekMTP:
    def __init__(self, device):
        gen = generator(32175)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale)  # noqa: E731
        self.embed_tokens = r(VOCAB, HIDDEN, scale=1.0)
        self.enorm, self.hnorm, self.input_layernorm = (1 + r(HIDDEN, scale=0.1) for _ in range(3))
        self.eh_proj = r(2 * HIDDEN, HIDDEN, scale=0.4)
        self.q_proj = r(HIDDEN, KV_LORA_RANK)            # absorbed q_b / W_UK
        self.kv_a_proj = r(HIDDEN, KV_LORA_RANK)
        self.kv_a_layernorm = 1 + r(KV_LORA_RANK, scale=0.1)
        self.o_proj = r(KV_LORA_RANK, HIDDEN)            # absorbed W_UV / o_proj
        self.wq_b = r(HIDDEN, INDEX_N_HEADS * INDEX_HEAD_DIM, scale=0.8)   # Indexer
        self.wk = r(HIDDEN, INDEX_HEAD_DIM, scale=0.8)
        self.k_norm = 1 + r(INDEX_HEAD_DIM, scale=0.1)
        self.weights_proj = r(HIDDEN, INDEX_N_HEADS, scale=0.8)
        self.shared_head_norm = 1 + r(HIDDEN, scale=0.1)
        self.lm_head = r(HIDDEN, VOCAB, scale=0.6)
        # per-layer caches (KV cache manager) and the model's shared topk buffer
        self.indexer_k_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, INDEX_HEAD_DIM + 1, device=device)
        self.mla_kv_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KV_LORA_RANK, device=device)
        self.topk_indices_buffer = torch.full((MAX_NUM_BATCHED_TOKENS, INDEX_TOPK), -1, dtype=torch.int32,
                                              device=device)
        self.mla_attn = FlashMLASparseImpl(self.mla_kv_cache, self.topk_indices_buffer)

    def forward_piece_0(self, input_ids, positions, previous_hidden_states):
        """Captured piece: MTP input fusion, MLA projections, the Indexer's q / k / weights."""
        inputs_embeds = rms_norm(self.embed_tokens[input_ids], self.enorm)
        previous_hidden_states = rms_norm(previous_hidden_states, self.hnorm)
        residual = torch.cat([inputs_embeds, previous_hidden_states], -1) @ self.eh_proj
        h = rms_norm(residual, self.input_layernorm)
        q_attn = h @ self.q_proj
        kv_c_normed = rms_norm(h @ self.kv_a_proj, self.kv_a_layernorm)
        q = _rope((h @ self.wq_b).view(-1, INDEX_N_HEADS, INDEX_HEAD_DIM), positions)
        k = _rope(rms_norm(h @ self.wk, self.k_norm), positions)
        weights = (h @ self.weights_proj) * INDEX_HEAD_DIM ** -0.5 * INDEX_N_HEADS ** -0.5
        attn_output = torch.zeros(h.shape[0], KV_LORA_RANK, device=h.device)
        return residual, q_attn, kv_c_normed, q, k, weights, attn_output

    def splitting_ops(self, outs):
        """Eager between the pieces: ``vllm::sparse_attn_indexer`` then ``vllm::unified_mla_attention_with_output``."""
        residual, q_attn, kv_c_normed, q, k, weights, attn_output = outs
        sparse_attn_indexer(residual, INDEXER_K_CACHE_PREFIX, self.indexer_k_cache, q, k, weights, INDEX_HEAD_DIM,
                            "ue8m0", INDEX_TOPK, INDEX_HEAD_DIM, MAX_MODEL_LEN, MAX_MODEL_LEN,
                            self.topk_indices_buffer)
        self.mla_attn.forward(q_attn, kv_c_normed, attn_output)

    def forward_piece_1(self, residual, attn_output):
        """Captured piece: attention output projection and residual."""
        return (residual + attn_output @ self.o_proj,)

    def compute_logits(self, hidden_states):
        return rms_norm(hidden_states, self.shared_head_norm) @ self.lm_head


# --- vllm/v1/spec_decode/eagle.py (+ the piecewise CUDAGraphWrapper of the compiled draft model) -------------------------

class EagleProposer:
    def __init__(self, device, use_cuda_graph):
        self.device = device
        self.model = DeepSeekMTP(device)
        self.use_cuda_graph = use_cuda_graph
        self.cudagraph_batch_sizes = sorted(CUDAGRAPH_CAPTURE_SIZES) if use_cuda_graph else []
        self.input_ids = torch.zeros(MAX_NUM_BATCHED_TOKENS, dtype=torch.int64, device=device)
        self.positions = torch.zeros(MAX_NUM_BATCHED_TOKENS, dtype=torch.int64, device=device)
        self.hidden_states = torch.zeros(MAX_NUM_BATCHED_TOKENS, HIDDEN, device=device)
        self.draft_indexer_metadata_builder = DeepseekV32IndexerMetadataBuilder()
        self.attn_metadata_builder = FlashMLASparseMetadataBuilder()
        self.graphs = {}

    def pad_for_cudagraph(self, num_tokens):
        return next(s for s in self.cudagraph_batch_sizes if s >= num_tokens)

    def _piece_0(self, n):
        return self.model.forward_piece_0(self.input_ids[:n], self.positions[:n], self.hidden_states[:n])

    def dummy_run(self, num_tokens):
        """Capture (``capture_model`` -> ``drafter.dummy_run``): no attention metadata, PIECEWISE pieces."""
        with set_forward_context(None, num_tokens, "PIECEWISE"):
            g0, out0 = capture(lambda: self._piece_0(num_tokens), device=self.device,
                               name=f"mtp piece 0 [{num_tokens}]", owner="EagleProposer (PIECEWISE)",
                               static={"input_ids": self.input_ids, "positions": self.positions,
                                       "hidden_states": self.hidden_states})
            self.model.splitting_ops(out0)
            g1, out1 = capture(lambda: self.model.forward_piece_1(out0[0], out0[-1]), device=self.device,
                               name=f"mtp piece 1 [{num_tokens}]", owner="EagleProposer (PIECEWISE)")
        self.graphs[num_tokens] = (g0, out0, g1, out1)

    def model_forward(self, num_input_tokens, num_tokens):
        mode = get_forward_context().cudagraph_runtime_mode
        if mode == "PIECEWISE":
            g0, out0, g1, out1 = self.graphs[num_input_tokens]
            out0 = replay(g0, out0, real=num_tokens, size=num_input_tokens,
                          padded={"input_ids": self.input_ids, "positions": self.positions,
                                  "hidden_states": self.hidden_states})
            self.model.splitting_ops(out0)
            (hidden,) = replay(g1, out1, real=num_tokens, size=num_input_tokens)
            return hidden
        out0 = self._piece_0(num_input_tokens)
        self.model.splitting_ops(out0)
        return self.model.forward_piece_1(out0[0], out0[-1])[0]

    def propose(self, target_token_ids, target_positions, target_hidden_states, next_token_ids, last_token_indices,
                common_attn_metadata):
        num_tokens = target_token_ids.shape[0]
        # Shift the input ids by one token; replace the last (accepted) token of each request with the next one.
        self.input_ids[:num_tokens - 1] = target_token_ids[1:]
        self.input_ids[last_token_indices] = next_token_ids

        attn_metadata = self.attn_metadata_builder.build_for_drafting(common_attn_metadata, draft_index=0)
        draft_indexer_metadata = self.draft_indexer_metadata_builder.build_for_drafting(common_attn_metadata,
                                                                                         draft_index=0)
        per_layer_attn_metadata = {MLA_LAYER_NAME: attn_metadata, INDEXER_K_CACHE_PREFIX: draft_indexer_metadata}

        if self.use_cuda_graph and num_tokens <= self.cudagraph_batch_sizes[-1]:
            num_input_tokens = self.pad_for_cudagraph(num_tokens)
            cudagraph_runtime_mode = "PIECEWISE"
        else:
            num_input_tokens = num_tokens
            cudagraph_runtime_mode = "NONE"

        # copy inputs to buffer for cudagraph
        self.positions[:num_tokens] = target_positions
        self.hidden_states[:num_tokens] = target_hidden_states
        with set_forward_context(per_layer_attn_metadata, num_input_tokens, cudagraph_runtime_mode):
            last_hidden_states = self.model_forward(num_input_tokens, num_tokens)
        sample_hidden_states = last_hidden_states[last_token_indices]
        return self.model.compute_logits(sample_hidden_states).clone()


# --- vllm/v1/worker/block_table.py, gpu_model_runner.py (the parts the drafter sees) -------------------------------------

class BlockTable:
    def __init__(self, device):
        self.block_table = torch.zeros(MAX_NUM_REQS, MAX_BLOCKS_PER_REQ, dtype=torch.int32, device=device)
        self.slot_mapping = torch.zeros(MAX_NUM_BATCHED_TOKENS, dtype=torch.int64, device=device)   # .gpu

    def compute_slot_mapping(self, req_indices, positions):
        n = positions.shape[0]
        block_numbers = self.block_table[req_indices, positions // BLOCK_SIZE].long()
        self.slot_mapping[:n] = block_numbers * BLOCK_SIZE + positions % BLOCK_SIZE


class Request:
    def __init__(self, rid, row, prompt):
        self.rid, self.row, self.tokens = rid, row, list(prompt)
        self.num_computed_tokens = 0
        self.draft = None


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    prompts_gen = generator(3217)
    prompts = {rid: torch.randint(0, VOCAB, (3,), generator=prompts_gen).tolist() for rid in "ABCD"}
    # (scheduled requests, {request: draft accepted?}) per step; A finishes after step 1.
    schedule = [("ABCD", {}), ("ABCD", {"A": True, "B": True, "C": True, "D": False}),
                ("BCD", {"B": True, "C": True, "D": True}), ("BCD", {"B": True, "C": True, "D": True}),
                ("BCD", {"B": True, "C": True, "D": True})]

    def serve(use_cuda_graph: bool):
        gen = generator(32177)                                  # the target model and rejection sampler
        proposer = EagleProposer(device, use_cuda_graph)
        if use_cuda_graph:
            for size in reversed(CUDAGRAPH_CAPTURE_SIZES):
                proposer.dummy_run(size)
        blk = BlockTable(device)
        reqs = {rid: Request(rid, i, prompts[rid]) for i, rid in enumerate("ABCD")}
        for r in reqs.values():
            blk.block_table[r.row] = torch.arange(1 + r.row * MAX_BLOCKS_PER_REQ,
                                                  1 + (r.row + 1) * MAX_BLOCKS_PER_REQ, dtype=torch.int32)
        outs = []
        for names, accepted in schedule:
            batch = [reqs[n] for n in names]
            token_ids, positions, rows, query_lens = [], [], [], []
            for r in batch:
                if r.num_computed_tokens == 0:                    # prefill
                    toks, start = r.tokens, 0
                else:                                             # verify: last token + the draft
                    toks, start = [r.tokens[-1], r.draft], len(r.tokens) - 1
                token_ids += toks
                positions += list(range(start, start + len(toks)))
                rows += [r.row] * len(toks)
                query_lens.append(len(toks))
            n = len(token_ids)
            target_token_ids = torch.tensor(token_ids, device=device)
            target_positions = torch.tensor(positions, device=device)
            blk.compute_slot_mapping(torch.tensor(rows, device=device), target_positions)
            qsl = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
            seq_lens = torch.tensor([positions[int(qsl[i + 1]) - 1] + 1 for i in range(len(batch))])
            cm = CommonAttentionMetadata(query_start_loc=qsl.to(device), seq_lens=seq_lens.to(device),
                                         num_reqs=len(batch), num_actual_tokens=n,
                                         block_table_tensor=blk.block_table[[r.row for r in batch]],
                                         slot_mapping=blk.slot_mapping[:n])
            # target forward + rejection sampling (stand-in)
            target_hidden_states = randn(n, HIDDEN, gen=gen, device=device)
            sampled = torch.randint(0, VOCAB, (len(batch),), generator=gen).tolist()
            last_token_indices, next_token_ids = [], []
            for i, r in enumerate(batch):
                end = int(qsl[i + 1]) - 1
                if r.num_computed_tokens == 0:
                    r.num_computed_tokens = len(r.tokens)
                    last_token_indices.append(end)
                elif accepted[r.rid]:
                    r.tokens.append(r.draft)
                    last_token_indices.append(end)
                else:                                             # draft rejected: the row before it is the last
                    last_token_indices.append(end - 1)
                r.tokens.append(sampled[i])
                next_token_ids.append(sampled[i])
            logits = proposer.propose(target_token_ids, target_positions, target_hidden_states,
                                      torch.tensor(next_token_ids, device=device),
                                      torch.tensor(last_token_indices, device=device), cm)
            for r, draft in zip(batch, logits.argmax(-1).tolist()):
                r.draft = draft
            outs.append(logits)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
