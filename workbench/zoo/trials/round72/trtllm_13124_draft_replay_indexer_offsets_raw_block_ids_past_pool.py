"""Before each draft CUDA-graph replay, the DSA indexer block offsets get raw KV block IDs, not pool indices, and address past the indexer K-cache.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/13124 ("[https://nvbugs/6018172][fix] Fix DSA illegal memory
access with CUDA graph and host KV cache offload", description 2026-04-16, merged; it also adds the test case
``host_cache_offload_mtp3_no_adp``).
Symptom: DeepSeek-V3.2 (DSA) with one-model MTP, a separate draft KV cache (no attention DP), host KV-cache offload
and CUDA graphs: ``cudaErrorIllegalAddress`` during CUDA-graph replay once offload has swapped blocks.
Mechanism: with host offload, the C++ block manager swaps memory between blocks. A secondary block that takes over a
primary pool slot keeps its high block ID (>= ``blocks_in_primary_pool``), so block IDs are no longer pool indices.
``DSAtrtllmAttentionMetadata.prepare_for_indexer_k_cache`` (attention_backend/sparse/dsa.py), which the target model
and eager steps go through, therefore builds ``indexer_k_cache_block_offsets`` from ``_get_pool_block_indices()``:
``memPoolBlockIndex = host_kv_cache_block_offsets // num_local_layers``. These persistent offsets and the slot
mappings derived from them are buffers that the one-model graph (target layers, then the MTP draft layer) captured.
Before each replay, ``PyTorchModelEngine`` calls ``prepare_attn_metadata_for_draft_replay(attn_metadata,
draft_kv_cache_manager)`` (speculative/interface.py). It swaps in the draft manager and "re-prepares indexer slot
mappings": it copied ``draft_kv_cache_manager.get_block_ids_per_seq(m.request_ids)``, the raw block IDs, into
``host_indexer_k_cache_block_offsets`` and ``indexer_k_cache_block_offsets``, then called
``Indexer.recompute_slot_mappings(m)``. A request holding a swapped block gets a block ID >= the pool size in the
captured offsets. The replayed indexer K-cache scatter and the paged-MQA-logits read then address past the end of
the indexer K-cache. Eager steps never call this function: they run on ``prepare()``'s pool indices.
Doctor: undersized-buffer, at ``prepare_attn_metadata_for_draft_replay`` (the replay prep writes into the captured
``indexer_k_cache_block_offsets`` block numbers that do not fit the indexer K-cache the graph addresses with them:
IDs up to ``blocks_in_primary_pool`` + the secondary pool size, for a cache of ``blocks_in_primary_pool`` blocks).
Fix (upstream): ``pool_indices = m._get_pool_block_indices()`` (with ``kv_cache_manager`` already swapped to the
draft manager) replaces ``get_block_ids_per_seq``. The pool indices are copied into the host and device indexer
offsets for ``m.num_seqs`` rows, then ``m.indexer_k_cache_block_offsets.clamp_(min=0)``, as in the regular DSA
``prepare()``.
Modelled: two target DSA layers and one MTP draft layer, each reduced to its indexer. A layer scatters the new
token's indexer key into the layer's K cache at ``slot_mapping_fp8``, then reads the paged cache through
``indexer_k_cache_block_offsets`` and applies a dense causal softmax over the indexer scores (no top-k and no
sparse MLA). Everything is float32 with no FP8 scales, so slots are rows, not bytes. ``tokens_per_block`` is 2,
the primary pool holds 6 blocks, and there are 2 host blocks. The draft manager allocates and offloads in
lockstep with the target manager (same block IDs, same pool slots), so the eager draft layer, which reads the
target-prepared offsets, addresses the right draft blocks. One offload swap: finished request R0's cached block 0
goes to the host, and block ID 6 takes pool slot 0, which the next request gets. The graph is captured at
warmup for a decode batch of 2 dummy requests, with no padding. The indexer reads are bounds-checked
``index_select`` / ``index_copy_``: an index past the cache raises on the CPU and trips a device-side assert on
CUDA, where the real kernel's pointer arithmetic faults.
"""
from __future__ import annotations

import contextlib
import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/13124"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "prepare_attn_metadata_for_draft_replay"
SYMPTOM = ("DSA + MTP + host KV offload: the draft-replay prep writes raw block IDs (>= blocks_in_primary_pool) into "
           "the captured indexer block offsets; the replayed indexer addresses past the end of its K-cache")

VOCAB, HIDDEN, INDEX_HEAD_DIM = 16, 4, 4
TOKENS_PER_BLOCK, MAX_BLOCKS_PER_SEQ = 2, 3
MAX_SEQ_LEN = TOKENS_PER_BLOCK * MAX_BLOCKS_PER_SEQ
BLOCKS_IN_PRIMARY_POOL, BLOCKS_IN_SECONDARY_POOL = 6, 2     # secondary (host) blocks have IDs 6, 7
MAX_NUM_SEQUENCES, MAX_NUM_TOKENS = 2, 8
CUDA_GRAPH_BATCH_SIZE = 2


# --- tensorrt_llm/_torch/pyexecutor/resource_manager.py (KVCacheManager / DSACacheManager) ---------------------------

class DSACacheManager:
    """The C++ block manager's view: KVCacheBlock IDs, each living in a primary (GPU) pool slot or a secondary (host)
    slot; the encoded offsets ``memPoolBlockIndex * num_layers * kv_factor``; one indexer K-cache per local layer."""

    def __init__(self, num_local_layers, device):
        self.num_local_layers = num_local_layers
        self.blocks_in_primary_pool = BLOCKS_IN_PRIMARY_POOL
        self.tokens_per_block = TOKENS_PER_BLOCK
        self.index_head_dim = INDEX_HEAD_DIM
        self.kv_factor = 1                                   # SELFKONLY (MLA/DSA)
        self.max_blocks_per_seq = MAX_BLOCKS_PER_SEQ
        rows = BLOCKS_IN_PRIMARY_POOL * TOKENS_PER_BLOCK
        self.indexer_k_cache = [torch.zeros(rows, INDEX_HEAD_DIM, device=device) for _ in range(num_local_layers)]
        self.secondary_indexer_k_cache = [torch.zeros(BLOCKS_IN_SECONDARY_POOL * TOKENS_PER_BLOCK, INDEX_HEAD_DIM,
                                                      device=device) for _ in range(num_local_layers)]
        # block id -> (in primary pool?, memPoolBlockIndex)
        self.block_location = {b: (True, b) for b in range(BLOCKS_IN_PRIMARY_POOL)}
        self.block_location.update({BLOCKS_IN_PRIMARY_POOL + j: (False, j) for j in range(BLOCKS_IN_SECONDARY_POOL)})
        self.free_primary_blocks = list(range(BLOCKS_IN_PRIMARY_POOL))
        self.free_secondary_blocks = [BLOCKS_IN_PRIMARY_POOL + j for j in range(BLOCKS_IN_SECONDARY_POOL)]
        self.block_ids = {}                                  # request id -> its block IDs
        self.host_kv_cache_block_offsets = torch.zeros(1, MAX_NUM_SEQUENCES, 2, MAX_BLOCKS_PER_SEQ,
                                                       dtype=torch.int32)

    def add_sequence(self, request_id, num_blocks):
        self.block_ids[request_id] = [self.free_primary_blocks.pop(0) for _ in range(num_blocks)]

    def free_resources(self, request_id, keep_for_reuse=False):
        blocks = self.block_ids.pop(request_id)
        if not keep_for_reuse:                               # reusable blocks stay in the radix tree instead
            self.free_primary_blocks[:0] = blocks

    def offload_block(self, block_id):
        """Host offload of a cached block: copy its memory to a free secondary block, then swap the two blocks'
        memory; the secondary block inherits the primary pool slot and keeps its high ID."""
        secondary_id = self.free_secondary_blocks.pop(0)
        (_, slot), (_, host_slot) = self.block_location[block_id], self.block_location[secondary_id]
        t = self.tokens_per_block
        for cache, host_cache in zip(self.indexer_k_cache, self.secondary_indexer_k_cache):
            host_cache[host_slot * t:(host_slot + 1) * t].copy_(cache[slot * t:(slot + 1) * t])
        self.block_location[block_id] = (False, host_slot)
        self.block_location[secondary_id] = (True, slot)
        self.free_primary_blocks.insert(0, secondary_id)

    def get_block_ids_per_seq(self, request_ids):
        """Raw KVCacheBlock IDs per request (padded with 0)."""
        out = torch.zeros(len(request_ids), max(len(self.block_ids[r]) for r in request_ids), dtype=torch.int32)
        for i, r in enumerate(request_ids):
            out[i, :len(self.block_ids[r])] = torch.tensor(self.block_ids[r], dtype=torch.int32)
        return out

    def copy_batch_block_offsets(self, request_ids):
        """setOffsets(): encoded = memPoolBlockIndex * numLayers * kvFactor, for this batch's rows."""
        self.host_kv_cache_block_offsets.zero_()
        for i, r in enumerate(request_ids):
            for j, b in enumerate(self.block_ids[r]):
                in_primary, slot = self.block_location[b]
                assert in_primary, "a scheduled request's blocks are onboarded"
                self.host_kv_cache_block_offsets[0, i, :, j] = slot * self.num_local_layers * self.kv_factor

    def get_indexer_k_cache_buffers(self, layer_idx):
        return self.indexer_k_cache[layer_idx]


# --- tensorrt_llm/_torch/attention_backend/sparse/dsa.py ----------------------------------------------------------------

def _compute_slot_mappings(global_positions, block_offsets, req_indices, tokens_per_block):
    """Flat indexer K-cache positions of new tokens (rows here; bytes upstream) from the block offset table."""
    block_indices_in_seq = global_positions // tokens_per_block
    pos_in_blocks = global_positions % tokens_per_block
    assert (block_indices_in_seq < block_offsets.shape[1]).all()
    block_ids = block_offsets[req_indices, block_indices_in_seq].to(torch.int64)
    return block_ids * tokens_per_block + pos_in_blocks


class DSAtrtllmAttentionMetadata:
    def __init__(self, kv_cache_manager, device):
        self.kv_cache_manager = kv_cache_manager
        self.kv_cache_block_offsets = torch.zeros(1, MAX_NUM_SEQUENCES, 2, MAX_BLOCKS_PER_SEQ, dtype=torch.int32,
                                                  device=device)
        self.draft_kv_cache_block_offsets = torch.zeros_like(self.kv_cache_block_offsets)   # separate draft layout
        self.host_kv_cache_block_offsets = kv_cache_manager.host_kv_cache_block_offsets
        # create_buffers_for_indexer (cuda_graph_buffers: persistent, their addresses captured)
        self.indexer_k_cache_block_offsets = torch.zeros(MAX_NUM_SEQUENCES, MAX_BLOCKS_PER_SEQ, dtype=torch.int32,
                                                         device=device)
        self.host_indexer_k_cache_block_offsets = torch.zeros(MAX_NUM_SEQUENCES, MAX_BLOCKS_PER_SEQ,
                                                              dtype=torch.int32)
        self.slot_mapping_fp8 = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)
        self.host_slot_mapping_fp8 = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64)
        self.req_idx_per_token = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)
        self.request_ids, self.seq_lens, self.num_cached_tokens_per_seq = [], None, []
        self.num_seqs = self.num_tokens = 0

    def prepare(self):
        # TrtllmAttentionMetadata.prepare: this batch's block offsets (target; the draft's were copied by the engine)
        self.kv_cache_manager.copy_batch_block_offsets(self.request_ids)
        self.host_kv_cache_block_offsets = self.kv_cache_manager.host_kv_cache_block_offsets
        self.kv_cache_block_offsets.copy_(self.host_kv_cache_block_offsets.to(self.kv_cache_block_offsets.device))
        self.prepare_for_indexer_k_cache()
        Indexer.prepare(metadata=self)

    def _get_pool_block_indices(self):
        """memPoolBlockIndex = encoded // num_local_layers (SELFKONLY), clamped to the primary pool."""
        num_local_layers = self.kv_cache_manager.num_local_layers
        max_pool_idx = self.kv_cache_manager.blocks_in_primary_pool - 1
        assert self.kv_cache_manager.kv_factor == 1
        encoded = self.kv_cache_manager.host_kv_cache_block_offsets[0, :self.num_seqs, 0, :]
        pool_indices = encoded // num_local_layers
        return pool_indices.clamp(min=0, max=max_pool_idx).to(torch.int32)

    def prepare_for_indexer_k_cache(self):
        # Build indexer_k_cache_block_offsets using pool block indices derived from host_kv_cache_block_offsets:
        # required when host cache offload is enabled (block IDs != pool indices for onboarded secondary blocks).
        pool_indices = self._get_pool_block_indices()
        self.host_indexer_k_cache_block_offsets[:self.num_seqs].copy_(pool_indices)
        dev = self.indexer_k_cache_block_offsets.device
        self.indexer_k_cache_block_offsets[:self.num_seqs].copy_(
            self.host_indexer_k_cache_block_offsets[:self.num_seqs].to(dev), non_blocking=True)
        self.indexer_k_cache_block_offsets.clamp_(min=0)


class Indexer:
    """The DSA indexer of one attention layer (wq_b / wk reduced to square projections)."""

    def __init__(self, layer_idx, gen, device):
        self.layer_idx = layer_idx
        self.wq = randn(HIDDEN, INDEX_HEAD_DIM, gen=gen, device=device, scale=0.7)
        self.wk = randn(HIDDEN, INDEX_HEAD_DIM, gen=gen, device=device, scale=0.7)
        self.wo = randn(INDEX_HEAD_DIM, HIDDEN, gen=gen, device=device, scale=0.7)

    @staticmethod
    def recompute_slot_mappings(metadata):
        """The subset of prepare() that maps each new token to its flat cache position (host, then H2D)."""
        seq_lens = metadata.seq_lens
        total_tokens = int(seq_lens.sum())
        start_positions = torch.tensor(metadata.num_cached_tokens_per_seq, dtype=torch.int64)
        req_indices = torch.repeat_interleave(torch.arange(len(metadata.request_ids)), seq_lens)
        token_offsets = torch.cat([torch.arange(int(n)) for n in seq_lens])
        global_positions = start_positions[req_indices] + token_offsets
        metadata.host_slot_mapping_fp8[:total_tokens] = _compute_slot_mappings(
            global_positions, metadata.host_indexer_k_cache_block_offsets, req_indices,
            metadata.kv_cache_manager.tokens_per_block)
        dev = metadata.slot_mapping_fp8.device
        metadata.slot_mapping_fp8[:total_tokens].copy_(metadata.host_slot_mapping_fp8[:total_tokens].to(dev),
                                                       non_blocking=True)

    @staticmethod
    def prepare(metadata):
        Indexer.recompute_slot_mappings(metadata)

    def forward(self, h, position_ids, metadata, num_tokens, num_seqs):
        k_cache = metadata.kv_cache_manager.get_indexer_k_cache_buffers(self.layer_idx)
        # _update_k_cache: indexer_k_cache_scatter_op(k, k_cache, slot_mapping_fp8)
        k_cache.index_copy_(0, metadata.slot_mapping_fp8[:num_tokens], h @ self.wk)
        # fp8_paged_mqa_logits: each token reads its request's pages through indexer_k_cache_block_offsets
        pos = torch.arange(MAX_SEQ_LEN, device=h.device)
        block_table = metadata.indexer_k_cache_block_offsets[:num_seqs].to(torch.int64)
        rows = block_table[:, pos // TOKENS_PER_BLOCK] * TOKENS_PER_BLOCK + pos % TOKENS_PER_BLOCK
        req = metadata.req_idx_per_token[:num_tokens]
        keys = k_cache.index_select(0, rows[req].reshape(-1)).view(num_tokens, MAX_SEQ_LEN, INDEX_HEAD_DIM)
        scores = (keys @ (h @ self.wq)[:, :, None]).squeeze(-1) / math.sqrt(INDEX_HEAD_DIM)
        scores = scores.masked_fill(pos[None, :] > position_ids[:, None], float("-inf"))
        probs = torch.softmax(scores, -1)
        return h + (probs[:, :, None] * keys).sum(1) @ self.wo


# --- tensorrt_llm/_torch/speculative/interface.py -------------------------------------------------------------------------

class MTPWorker:
    @contextlib.contextmanager
    def draft_kv_cache_context(self, attn_metadata, draft_kv_cache_manager):
        """Temporarily switch to the draft KV cache manager and its block offsets (not the indexer offsets)."""
        target = (attn_metadata.kv_cache_manager, attn_metadata.kv_cache_block_offsets,
                  attn_metadata.host_kv_cache_block_offsets)
        attn_metadata.kv_cache_manager = draft_kv_cache_manager
        attn_metadata.kv_cache_block_offsets = attn_metadata.draft_kv_cache_block_offsets
        attn_metadata.host_kv_cache_block_offsets = draft_kv_cache_manager.host_kv_cache_block_offsets
        try:
            yield
        finally:
            (attn_metadata.kv_cache_manager, attn_metadata.kv_cache_block_offsets,
             attn_metadata.host_kv_cache_block_offsets) = target


def prepare_attn_metadata_for_draft_replay(attn_metadata, draft_kv_cache_manager, variant):
    """Prepare attention metadata for CUDA graph replay when using separate draft KV cache: swaps to the draft
    manager and (for DSA) re-prepares indexer slot mappings for the current batch."""
    if draft_kv_cache_manager is None or attn_metadata.draft_kv_cache_block_offsets is None:
        return None
    saved = {
        'target_kv_cache_manager': attn_metadata.kv_cache_manager,
        'target_kv_cache_block_offsets': attn_metadata.kv_cache_block_offsets,
        'target_host_kv_cache_block_offsets': attn_metadata.host_kv_cache_block_offsets,
    }
    attn_metadata.kv_cache_manager = draft_kv_cache_manager
    attn_metadata.kv_cache_block_offsets = attn_metadata.draft_kv_cache_block_offsets
    attn_metadata.host_kv_cache_block_offsets = draft_kv_cache_manager.host_kv_cache_block_offsets
    m = attn_metadata
    saved['saved_dsa_state'] = {
        'host_indexer_k_cache_block_offsets': m.host_indexer_k_cache_block_offsets.clone(),
        'indexer_k_cache_block_offsets': m.indexer_k_cache_block_offsets.clone(),
        'host_slot_mapping_fp8': m.host_slot_mapping_fp8.clone(),
        'slot_mapping_fp8': m.slot_mapping_fp8.clone(),
    }
    dev = m.indexer_k_cache_block_offsets.device
    if variant == "fix":
        # Derive pool indices from the draft manager's encoded block offsets instead of raw block IDs
        pool_indices = m._get_pool_block_indices()
        num_blocks = pool_indices.shape[1]
        m.host_indexer_k_cache_block_offsets[:m.num_seqs, :num_blocks].copy_(pool_indices)
        m.indexer_k_cache_block_offsets[:m.num_seqs].copy_(
            m.host_indexer_k_cache_block_offsets[:m.num_seqs].to(dev), non_blocking=True)
        m.indexer_k_cache_block_offsets.clamp_(min=0)
    else:
        block_ids_per_seq = draft_kv_cache_manager.get_block_ids_per_seq(m.request_ids)
        num_blocks = block_ids_per_seq.shape[1]
        m.host_indexer_k_cache_block_offsets[:len(block_ids_per_seq), :num_blocks].copy_(block_ids_per_seq)
        m.indexer_k_cache_block_offsets[:m.num_seqs].copy_(
            m.host_indexer_k_cache_block_offsets[:m.num_seqs].to(dev), non_blocking=True)
    Indexer.recompute_slot_mappings(m)
    return saved


def restore_attn_metadata_after_draft_replay(attn_metadata, saved_state):
    if saved_state is None:
        return
    attn_metadata.kv_cache_manager = saved_state['target_kv_cache_manager']
    attn_metadata.kv_cache_block_offsets = saved_state['target_kv_cache_block_offsets']
    attn_metadata.host_kv_cache_block_offsets = saved_state['target_host_kv_cache_block_offsets']
    m, saved_dsa = attn_metadata, saved_state['saved_dsa_state']
    m.host_indexer_k_cache_block_offsets.copy_(saved_dsa['host_indexer_k_cache_block_offsets'])
    m.indexer_k_cache_block_offsets.copy_(saved_dsa['indexer_k_cache_block_offsets'], non_blocking=True)
    m.host_slot_mapping_fp8.copy_(saved_dsa['host_slot_mapping_fp8'])
    m.slot_mapping_fp8.copy_(saved_dsa['slot_mapping_fp8'])


# --- tensorrt_llm/_torch/models/modeling_deepseekv3.py (one-model MTP) -------------------------------------------------

class DeepseekV32ForCausalLM:
    def __init__(self, device):
        gen = generator(13124)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.layers = [Indexer(0, gen, device), Indexer(1, gen, device)]      # target DSA layers
        self.mtp_layer = Indexer(0, gen, device)                              # draft layer (draft manager's layer 0)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.7)
        self.spec_worker = MTPWorker()

    def forward(self, input_ids, position_ids, attn_metadata, draft_kv_cache_manager, num_tokens, num_seqs):
        h = self.embed_tokens[input_ids]
        for layer in self.layers:
            h = layer.forward(h, position_ids, attn_metadata, num_tokens, num_seqs)
        logits = h @ self.lm_head
        with self.spec_worker.draft_kv_cache_context(attn_metadata, draft_kv_cache_manager):
            hd = self.mtp_layer.forward(h + self.embed_tokens[input_ids], position_ids, attn_metadata,
                                        num_tokens, num_seqs)
            draft_logits = hd @ self.lm_head
        return logits, draft_logits


# --- tensorrt_llm/_torch/pyexecutor/model_engine.py ---------------------------------------------------------------------

class PyTorchModelEngine:
    def __init__(self, model, device, variant, use_cuda_graph):
        self.model, self.device, self.variant, self.use_cuda_graph = model, device, variant, use_cuda_graph
        self.kv_cache_manager = DSACacheManager(num_local_layers=2, device=device)
        self.draft_kv_cache_manager = DSACacheManager(num_local_layers=1, device=device)
        self.attn_metadata = DSAtrtllmAttentionMetadata(self.kv_cache_manager, device)
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.position_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.graph = None

    def add_sequence(self, request_id, num_blocks):
        for mgr in (self.kv_cache_manager, self.draft_kv_cache_manager):     # lockstep allocation
            mgr.add_sequence(request_id, num_blocks)

    def free_resources(self, request_id, keep_for_reuse=False):
        for mgr in (self.kv_cache_manager, self.draft_kv_cache_manager):
            mgr.free_resources(request_id, keep_for_reuse)

    def offload_block(self, block_id):
        for mgr in (self.kv_cache_manager, self.draft_kv_cache_manager):
            mgr.offload_block(block_id)

    def _prepare_inputs(self, batch):
        """batch: (request id, new tokens, number of cached tokens) per request."""
        m = self.attn_metadata
        tokens = [t for _, toks, _ in batch for t in toks]
        positions = [c + i for _, toks, c in batch for i in range(len(toks))]
        req_idx = [r for r, (_, toks, _) in enumerate(batch) for _ in toks]
        n = len(tokens)
        self.input_ids[:n].copy_(torch.tensor(tokens).to(self.device))
        self.position_ids[:n].copy_(torch.tensor(positions).to(self.device))
        m.req_idx_per_token[:n].copy_(torch.tensor(req_idx).to(self.device))
        m.request_ids = [r for r, _, _ in batch]
        m.seq_lens = torch.tensor([len(toks) for _, toks, _ in batch])
        m.num_cached_tokens_per_seq = [c for _, _, c in batch]
        m.num_seqs, m.num_tokens = len(batch), n
        self.draft_kv_cache_manager.copy_batch_block_offsets(m.request_ids)
        m.draft_kv_cache_block_offsets.copy_(self.draft_kv_cache_manager.host_kv_cache_block_offsets.to(self.device))
        m.prepare()
        return n, len(batch)

    def _forward_step(self, num_tokens, num_seqs):
        return self.model.forward(self.input_ids[:num_tokens], self.position_ids[:num_tokens], self.attn_metadata,
                                  self.draft_kv_cache_manager, num_tokens, num_seqs)

    def _caches(self):
        return (self.kv_cache_manager.indexer_k_cache + self.draft_kv_cache_manager.indexer_k_cache)

    def warmup(self):
        """Capture the generation graph with dummy requests, then release them."""
        if not self.use_cuda_graph:
            return
        dummies = [-1, -2]
        for r in dummies:
            self.add_sequence(r, 1)
        n, s = self._prepare_inputs([(r, [0], 0) for r in dummies])
        m = self.attn_metadata
        self.graph = capture(
            lambda: self._forward_step(n, s), device=self.device, owner="PyTorchModelEngine (CUDA graph, MTP)",
            static={"input_ids": self.input_ids, "position_ids": self.position_ids,
                    "req_idx_per_token": m.req_idx_per_token,
                    "indexer_k_cache_block_offsets": m.indexer_k_cache_block_offsets,
                    "slot_mapping_fp8": m.slot_mapping_fp8},
            state={f"indexer_k_cache_{i}": c for i, c in enumerate(self._caches())})
        for r in reversed(dummies):
            self.free_resources(r)
        for c in self._caches():
            c.zero_()                                        # warmup writes discarded

    def forward(self, batch, is_generation):
        n, s = self._prepare_inputs(batch)
        if not (self.use_cuda_graph and is_generation and s == CUDA_GRAPH_BATCH_SIZE):
            return tuple(o[:n].clone() for o in self._forward_step(n, s))
        saved_draft = prepare_attn_metadata_for_draft_replay(self.attn_metadata, self.draft_kv_cache_manager,
                                                             self.variant)
        try:
            g, out = self.graph
            outputs = replay(g, out)
        finally:
            restore_attn_metadata_after_draft_replay(self.attn_metadata, saved_draft)
        return tuple(o[:n].clone() for o in outputs)


def run(variant: str, device: str = "cpu"):
    model = DeepseekV32ForCausalLM(device)

    def serve(use_cuda_graph: bool):
        engine = PyTorchModelEngine(model, device, variant, use_cuda_graph)
        engine.warmup()
        # R0 (prompt 5, 9: one full block, block 0) is prefilled and finishes; its block stays cached for reuse
        engine.add_sequence(0, 1)
        (r0_block,) = engine.kv_cache_manager.block_ids[0]
        engine.forward([(0, [5, 9], 0)], is_generation=False)
        engine.free_resources(0, keep_for_reuse=True)
        # host offload of the cached block 0: secondary block 6 inherits pool slot 0 (keeps ID 6)
        engine.offload_block(r0_block)
        # A gets blocks [6, 1, 2] (pool slots [0, 1, 2]), B gets [3, 4, 5]; both prefilled, then decoded
        engine.add_sequence(1, MAX_BLOCKS_PER_SEQ)
        engine.add_sequence(2, MAX_BLOCKS_PER_SEQ)
        outs = list(engine.forward([(1, [3, 7, 1], 0), (2, [12, 4, 8], 0)], is_generation=False))
        for step, (a, b) in enumerate([(2, 11), (6, 14), (10, 0)]):
            outs += engine.forward([(1, [a], 3 + step), (2, [b], 3 + step)], is_generation=True)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
