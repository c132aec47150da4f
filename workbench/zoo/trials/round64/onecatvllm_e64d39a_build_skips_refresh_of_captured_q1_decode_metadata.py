"""Flash-V100 FULL decode graph: runtime ``build()`` never refreshes the persistent q=1 metadata buffers the capture bound, so replays attend with the dummy block table and seq_lens.

Upstream: https://github.com/1CatAI/1Cat-vLLM/commit/e64d39aa7ee170a44dcdd3789e480d9aa24140ea ("[Core] Stabilize
SM70 Qwen MTP paths", June 2026; root cause in the commit's audit log, entry 401 "Qwen3.6-35B-A3B-AWQ TP4 Flash-V100
FULL graph numeric gibberish root cause fixed without disabling Flash or CUDA graph").
Symptom: Qwen3.6-35B-A3B-AWQ, TP4, FLASH_ATTN_V100, FULL decode graph: long outputs turn into numeric / date gibberish
("digit runs", ``weird_runs``) at 8K and 262K max length; enforce-eager and the Triton backend are clean, and turning
dynamic partitions, packed recurrent decode or GDN FlashQLA off does not help.
Mechanism: ``FlashAttnV100MetadataBuilder.build_for_cudagraph_capture()`` takes the Triton builder's capture metadata
(``seq_lens.fill_(1)`` to keep capture cheap) and, for q=1 decode, ``_stabilize_draft_graph_metadata()`` copies its
``block_table`` / ``seq_lens`` / ``query_start_loc`` into builder-owned persistent buffers (``_draft_block_table``,
``_draft_seq_lens``, ``_draft_query_start_loc``) and rebinds the metadata to them, so the FULL graph records those
addresses. At runtime ``build()`` returns a fresh metadata object from ``super().build()`` (the runner's refreshed
block table and seq_lens) and never copies the step into the persistent buffers (only ``build_for_drafting()`` did, for
the MTP drafter; this run has none). Replay therefore reads the capture's dummy metadata: the null block and seq_len 1
for every request, whatever the request's context. An eager step attends with the metadata it just built.
Doctor: stale-input, at ``build`` (the graph's persistent metadata inputs are never written by the runtime build, so
every replay reads what the capture's dummy batch left in them).
Fix (upstream): ``build()`` now calls ``self._stabilize_draft_graph_metadata(attn_metadata, common_attn_metadata)`` when
``max_query_len == 1`` and ``self._draft_buffer_shape is not None`` ("FULL graph capture binds q=1 decode to these
persistent buffers. Refresh them on every runtime decode step so replay sees the current request's block table and
sequence metadata."). (The commit also sizes the small-query buffers for ``smallq_max_query_len * max_num_seqs``; that
q>1 path is not modelled.)
Modelled: one decoder layer, q=1 decode of a full batch of ``max_num_seqs`` requests; the context's KV is pre-filled.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/1CatAI/1Cat-vLLM/commit/e64d39aa7ee170a44dcdd3789e480d9aa24140ea"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "build"
SYMPTOM = "Flash-V100 FULL decode graph: replays attend with the capture's dummy block table / seq_lens (gibberish)"

NUM_HEADS, HEAD_DIM = 2, 4
HIDDEN = NUM_HEADS * HEAD_DIM
BLOCK_SIZE, MAX_BLOCKS, NUM_BLOCKS = 4, 4, 16
MAX_MODEL_LEN = BLOCK_SIZE * MAX_BLOCKS
MAX_NUM_SEQS = 2


def flash_attn_decode_paged(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, *, softmax_scale, out):
    """One query token per request (row ``query_start_loc[i]``) over its paged KV, up to ``seq_lens[i]``."""
    q = q[query_start_loc[:-1].long()]
    t = torch.arange(MAX_MODEL_LEN, device=q.device)
    slots = block_table[:, t // BLOCK_SIZE].long() * BLOCK_SIZE + t % BLOCK_SIZE
    k = k_cache.view(-1, NUM_HEADS, HEAD_DIM)[slots]
    v = v_cache.view(-1, NUM_HEADS, HEAD_DIM)[slots]
    scores = torch.einsum("bhd,bthd->bht", q, k) * softmax_scale
    scores = scores.masked_fill((t[None, :] >= seq_lens[:, None].long())[:, None, :], -1e30)
    out.copy_(torch.einsum("bht,bthd->bhd", torch.softmax(scores, -1), v))
    return out


class CommonAttentionMetadata:
    def __init__(self, num_reqs, query_start_loc, seq_lens, block_table_tensor):
        self.num_reqs, self.max_query_len = num_reqs, 1
        self.query_start_loc, self.seq_lens, self.block_table_tensor = query_start_loc, seq_lens, block_table_tensor


class TritonAttentionMetadata:
    def __init__(self, max_query_len, query_start_loc, seq_lens, block_table):
        self.max_query_len, self.query_start_loc, self.seq_lens, self.block_table = (max_query_len, query_start_loc,
                                                                                     seq_lens, block_table)


class TritonAttentionMetadataBuilder:
    def __init__(self, device, max_num_seqs):
        self.device, self.max_num_seqs = device, max_num_seqs

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        n = common_attn_metadata.num_reqs
        return TritonAttentionMetadata(common_attn_metadata.max_query_len, common_attn_metadata.query_start_loc[:n + 1],
                                       common_attn_metadata.seq_lens[:n], common_attn_metadata.block_table_tensor[:n])

    def build_for_cudagraph_capture(self, common_attn_metadata):
        attn_metadata = self.build(0, common_attn_metadata)
        # seq_lens of max_model_len make full graph capture extremely slow: capture with 1
        attn_metadata.seq_lens.fill_(1)
        return attn_metadata


class FlashAttnV100MetadataBuilder(TritonAttentionMetadataBuilder):
    def __init__(self, device, max_num_seqs, variant):
        super().__init__(device, max_num_seqs)
        self.variant = variant
        self._draft_block_table = self._draft_seq_lens = self._draft_query_start_loc = None
        self._draft_buffer_shape = None

    def _ensure_draft_graph_buffers(self, required_reqs, block_table):
        req_capacity = max(self.max_num_seqs, required_reqs, 1)
        shape = (req_capacity, int(block_table.shape[1]))
        if self._draft_buffer_shape is not None:
            old_reqs, old_block_cols = self._draft_buffer_shape
            return required_reqs <= old_reqs and shape[1] == old_block_cols
        self._draft_block_table = torch.empty(shape, dtype=torch.int32, device=self.device)
        self._draft_seq_lens = torch.empty((req_capacity,), dtype=torch.int32, device=self.device)
        self._draft_query_start_loc = torch.empty((req_capacity + 1,), dtype=torch.int32, device=self.device)
        self._draft_buffer_shape = shape
        return True

    def _stabilize_draft_graph_metadata(self, attn_metadata, common_attn_metadata):
        num_reqs = int(common_attn_metadata.num_reqs)
        block_table = attn_metadata.block_table[:num_reqs]
        if not self._ensure_draft_graph_buffers(num_reqs, block_table):
            raise RuntimeError("FLASH_ATTN_V100 draft CUDA graph metadata shape exceeds the captured persistent "
                               "buffer capacity. Replay would otherwise read stale draft metadata.")
        self._draft_block_table[:num_reqs].copy_(block_table, non_blocking=True)
        self._draft_seq_lens[:num_reqs].copy_(attn_metadata.seq_lens[:num_reqs], non_blocking=True)
        self._draft_query_start_loc[:num_reqs + 1].copy_(attn_metadata.query_start_loc[:num_reqs + 1],
                                                         non_blocking=True)
        attn_metadata.block_table = self._draft_block_table[:num_reqs]
        attn_metadata.seq_lens = self._draft_seq_lens[:num_reqs]
        attn_metadata.query_start_loc = self._draft_query_start_loc[:num_reqs + 1]

    def build_for_cudagraph_capture(self, common_attn_metadata):
        attn_metadata = super().build_for_cudagraph_capture(common_attn_metadata)
        if attn_metadata.max_query_len == 1:
            # FULL/PIECEWISE replay captures the q=1 decode kernel arguments: bind them to the persistent buffers
            self._stabilize_draft_graph_metadata(attn_metadata, common_attn_metadata)
        return attn_metadata

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        attn_metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if self.variant == "fix" and attn_metadata.max_query_len == 1 and self._draft_buffer_shape is not None:
            # FULL graph capture binds q=1 decode to these persistent buffers. Refresh them on every runtime
            # decode step so replay sees the current request's block table and sequence metadata.
            self._stabilize_draft_graph_metadata(attn_metadata, common_attn_metadata)
        return attn_metadata


class GPUModelRunner:
    """One decoder layer with Flash-V100 paged decode; a FULL graph for the q=1 batch of ``MAX_NUM_SEQS``."""

    def __init__(self, device, variant):
        self.device = device
        gen = generator(401)
        self.wq = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6)
        self.wo = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6)
        self.key_cache = randn(NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_DIM, gen=gen, device=device, scale=1.5)
        self.value_cache = randn(NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_DIM, gen=gen, device=device)
        # the runner's persistent inputs (InputBatch block table, seq_lens, query_start_loc), refreshed every step
        self.hidden_states = torch.zeros(MAX_NUM_SEQS, HIDDEN, device=device)
        self.block_table = torch.zeros(MAX_NUM_SEQS, MAX_BLOCKS, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(MAX_NUM_SEQS, dtype=torch.int32, device=device)
        self.query_start_loc = torch.zeros(MAX_NUM_SEQS + 1, dtype=torch.int32, device=device)
        self.attn_out = torch.zeros(MAX_NUM_SEQS, NUM_HEADS, HEAD_DIM, device=device)
        self.builder = FlashAttnV100MetadataBuilder(device, MAX_NUM_SEQS, variant)
        self.graph = None

    def _prepare_inputs(self, seq_lens, block_ids):
        self.block_table.copy_(torch.tensor(block_ids, dtype=torch.int32))
        self.seq_lens.copy_(torch.tensor(seq_lens, dtype=torch.int32))
        self.query_start_loc.copy_(torch.arange(MAX_NUM_SEQS + 1, dtype=torch.int32))
        return CommonAttentionMetadata(len(seq_lens), self.query_start_loc, self.seq_lens, self.block_table)

    def forward(self, attn_metadata):
        q = (self.hidden_states @ self.wq).view(-1, NUM_HEADS, HEAD_DIM)
        flash_attn_decode_paged(q, self.key_cache, self.value_cache, attn_metadata.block_table,
                                attn_metadata.seq_lens, attn_metadata.query_start_loc,
                                softmax_scale=HEAD_DIM ** -0.5, out=self.attn_out)
        return self.hidden_states + self.attn_out.reshape(-1, HIDDEN) @ self.wo

    def capture_model(self):
        """``_dummy_run`` of the decode batch: dummy requests on the null block."""
        common = self._prepare_inputs([MAX_MODEL_LEN] * MAX_NUM_SEQS, [[0] * MAX_BLOCKS] * MAX_NUM_SEQS)
        attn_metadata = self.builder.build_for_cudagraph_capture(common)
        b = self.builder
        self.graph = capture(
            lambda: self.forward(attn_metadata), device=self.device, name=f"decode {MAX_NUM_SEQS}",
            owner="CUDAGraphWrapper (FULL decode, FLASH_ATTN_V100)",
            static={"hidden_states": self.hidden_states, "_draft_block_table": b._draft_block_table,
                    "_draft_seq_lens": b._draft_seq_lens, "_draft_query_start_loc": b._draft_query_start_loc},
            state={"key_cache": self.key_cache, "value_cache": self.value_cache})

    def execute_model(self, hidden, seq_lens, block_ids):
        common = self._prepare_inputs(seq_lens, block_ids)
        self.hidden_states.copy_(hidden)
        attn_metadata = self.builder.build(0, common)
        if self.graph is None:
            return self.forward(attn_metadata).clone()
        g, out = self.graph
        return replay(g, out).clone()


# Per decode step: each request's context length and block ids (block 0 is the null block).
STEPS = [
    ([6, 3], [[3, 5, 0, 0], [4, 0, 0, 0]]),
    ([7, 4], [[3, 5, 0, 0], [4, 0, 0, 0]]),
    ([9, 5], [[3, 5, 7, 0], [4, 6, 0, 0]]),
    ([14, 2], [[3, 5, 7, 8], [9, 0, 0, 0]]),
]


def run(variant: str, device: str = "cpu"):
    gen = generator(4010)
    hiddens = [randn(MAX_NUM_SEQS, HIDDEN, gen=gen, device=device) for _ in STEPS]

    def serve(graphed: bool):
        runner = GPUModelRunner(device, variant)
        if graphed:
            runner.capture_model()
        return [runner.execute_model(h, *step) for h, step in zip(hiddens, STEPS)]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
