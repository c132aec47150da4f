"""Chunked local attention rebuilds its virtual-batch metadata as fresh tensors every step; the FULL graph keeps the dummy run's.

Upstream: https://github.com/vllm-project/vllm/pull/26034 ("[BugFix] ChunkedLocalAttention is currently not
CG compatible"), fixing https://github.com/vllm-project/vllm/issues/25960 (Llama 4 answers with garbage under
the default FULL_AND_PIECEWISE CUDA graphs).
Symptom: Llama-4 Scout / Maverick (chunked local attention in 3 of every 4 layers) served by vLLM V1 with
the default ``cudagraph_mode=FULL_AND_PIECEWISE`` produces incoherent text on decode; ``--enforce-eager`` or
``cudagraph_mode=PIECEWISE`` is fine (vLLM 0.11, Sept/Oct 2025).
Mechanism: ``ChunkedLocalAttentionBuilder.build`` turns the common metadata into per-chunk "virtual
batches" with ``make_local_attention_virtual_batches``. That helper computes ``cu_seqlens_q_local``,
``seqlens_k_local`` and ``block_table_local`` in numpy and returns them as *new* tensors
(``torch.from_numpy(...).to(device)`` and an advanced-indexing gather of the block table) on every build,
not as views of persistent buffers. The builder inherited the FlashAttention backend's FULL CUDA-graph
support, so the decode graph was captured reading the capture dummy run's local metadata tensors; they are
released after capture, and every replay still reads those addresses while each step's metadata lands
elsewhere. Attention runs with the dummy batch's key lengths and block ids (one key, the null block) or
whatever the caching allocator put there since.
Doctor: dangling-reference, at ``make_local_attention_virtual_batches`` (it hands the captured attention
kernel per-step tensors that are released after capture).
Fix (upstream): ``ChunkedLocalAttentionBuilder`` declares ``cudagraph_support = AttentionCGSupport.NEVER``,
so ``FULL_AND_PIECEWISE`` is downgraded to ``PIECEWISE``: attention (with its fresh metadata) runs eagerly
between the graph pieces at every step.
"""
from __future__ import annotations

import dataclasses
import enum

import numpy as np
import torch

from workbench.engine import CUDAGraphMode, GraphManager
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/vllm-project/vllm/pull/26034"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "make_local_attention_virtual_batches"
SYMPTOM = "Llama 4 decodes garbage under FULL graphs: local attention reads the dummy run's virtual batches"

VOCAB, DIM, BLOCK_SIZE, MAX_BLOCKS, NUM_BLOCKS = 12, 4, 2, 6, 16
ATTN_CHUNK_SIZE = 4                       # attention_chunk_size (8192 upstream)
MAX_NUM_SEQS = 4
CAPTURE_SIZES = [MAX_NUM_SEQS]
NULL_BLOCK = 0


class AttentionCGSupport(enum.Enum):
    NEVER = 0
    ALWAYS = 3


class FlashAttentionMetadataBuilder:
    cudagraph_support = AttentionCGSupport.ALWAYS


class ChunkedLocalAttentionBuilder(FlashAttentionMetadataBuilder):
    def __init__(self, variant: str):
        if variant == "fix":
            self.cudagraph_support = AttentionCGSupport.NEVER     # the fix: not CG compatible

    def build(self, common_attn_metadata: "CommonAttentionMetadata") -> "CommonAttentionMetadata":
        return make_local_attention_virtual_batches(ATTN_CHUNK_SIZE, common_attn_metadata, BLOCK_SIZE)


@dataclasses.dataclass
class CommonAttentionMetadata:
    query_start_loc_cpu: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens_cpu: torch.Tensor
    seq_lens: torch.Tensor
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor


def cdiv(a, b):
    return -(a // -b)


def make_local_attention_virtual_batches(attn_chunk_size: int, common_attn_metadata: CommonAttentionMetadata,
                                         block_size: int = 0) -> CommonAttentionMetadata:
    """Break each sequence into local attention blocks, each an independent ("virtual") batch item."""
    query_start_loc_np = common_attn_metadata.query_start_loc_cpu.numpy()
    seq_lens_np = common_attn_metadata.seq_lens_cpu.numpy()
    block_table = common_attn_metadata.block_table_tensor
    device = common_attn_metadata.query_start_loc.device

    q_seqlens = query_start_loc_np[1:] - query_start_loc_np[:-1]
    actual_batch_size = seq_lens_np.shape[0]
    q_tokens_in_first_block = np.minimum(
        attn_chunk_size - ((seq_lens_np - q_seqlens) % attn_chunk_size), q_seqlens).astype(np.int32)
    tokens_in_last_block = attn_chunk_size + (seq_lens_np % -attn_chunk_size)
    local_blocks = 1 + cdiv(q_seqlens - q_tokens_in_first_block, attn_chunk_size)

    cu_num_blocks = np.cumsum(local_blocks)
    virtual_batches = cu_num_blocks[-1]
    block_offsets = np.repeat(cu_num_blocks - local_blocks, local_blocks)
    arange = np.arange(virtual_batches, dtype=np.int32) - block_offsets
    rarange = np.repeat(local_blocks, local_blocks) - arange - 1
    seqlens_q_local = np.repeat(q_seqlens - q_tokens_in_first_block, local_blocks)
    seqlens_q_local[arange == 0] = q_tokens_in_first_block
    seqlens_q_local[arange > 0] = np.minimum(seqlens_q_local - attn_chunk_size * (arange - 1),
                                             attn_chunk_size)[arange > 0]
    cu_seqlens_q_local = np.empty(virtual_batches + 1, dtype=np.int32)
    np.cumsum(seqlens_q_local, out=cu_seqlens_q_local[1:])
    cu_seqlens_q_local[0] = 0

    seqlens_k_local = np.full(cu_num_blocks[-1], attn_chunk_size, dtype=np.int32)
    seqlens_k_local[cu_num_blocks - 1] = tokens_in_last_block
    k_seqstarts_absolute = np.repeat(seq_lens_np, local_blocks) - (
        rarange * attn_chunk_size + np.repeat(tokens_in_last_block, local_blocks))
    block_starts = k_seqstarts_absolute // block_size
    pages_per_local_batch = attn_chunk_size // block_size
    block_indices = (block_starts[:, None] + np.arange(pages_per_local_batch, dtype=np.int32))
    block_indices = block_indices.reshape(-1).clip(max=block_table.shape[1] - 1)
    batch_indices = np.repeat(np.arange(actual_batch_size, dtype=np.int32), local_blocks * pages_per_local_batch)
    batch_indices_torch = torch.from_numpy(batch_indices).long()
    block_indices_torch = torch.from_numpy(block_indices).long()
    # fresh tensors on every build: a gather of the block table, and host arrays moved to the device
    block_table_local = block_table[batch_indices_torch.to(block_table.device),
                                    block_indices_torch.to(block_table.device)].view(virtual_batches, -1)
    query_start_loc_cpu = torch.from_numpy(cu_seqlens_q_local)
    seq_lens_cpu = torch.from_numpy(seqlens_k_local)
    return CommonAttentionMetadata(
        query_start_loc_cpu=query_start_loc_cpu,
        query_start_loc=query_start_loc_cpu.to(device=device, non_blocking=True),
        seq_lens_cpu=seq_lens_cpu,
        seq_lens=seq_lens_cpu.to(device=device, non_blocking=True),
        num_reqs=len(seq_lens_cpu),
        max_query_len=int(seqlens_q_local.max()),
        max_seq_len=int(seq_lens_cpu.max()),
        block_table_tensor=block_table_local,
        slot_mapping=common_attn_metadata.slot_mapping)


def flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table):
    """Paged varlen attention: query row i belongs to virtual batch b (cu_seqlens_q); it attends to the
    ``seqused_k[b]`` keys found through ``block_table[b]`` (decode: the query is the newest key)."""
    t = torch.arange(q.shape[0], device=q.device)
    b = torch.searchsorted(cu_seqlens_q[1:].long(), t, right=True)
    pos = torch.arange(block_table.shape[1] * BLOCK_SIZE, device=q.device)
    slots = block_table[b][:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE      # [T, P]
    k, v = k_cache[slots], v_cache[slots]                                                # [T, P, D]
    scores = (q[:, None, :] * k).sum(-1) / DIM ** 0.5
    scores = scores.masked_fill(pos[None, :] >= seqused_k[b].long()[:, None], float("-inf"))
    return (torch.softmax(scores, -1)[..., None] * v).sum(1)


class ForwardContext:
    attn_metadata: dict | None = None


_forward_context = ForwardContext()


def get_forward_context() -> ForwardContext:
    return _forward_context


def unified_attention(query, key, value, kv_cache, layer_name: str):
    """The splitting op: writes this step's KV, then attends with the metadata of the forward context."""
    attn_metadata = get_forward_context().attn_metadata[layer_name]
    key_cache, value_cache = kv_cache
    n = query.shape[0]
    slot_mapping = attn_metadata.slot_mapping[:n]
    key_cache.index_copy_(0, slot_mapping, key)                   # reshape_and_cache_flash
    value_cache.index_copy_(0, slot_mapping, value)
    return flash_attn_varlen_func(query, key_cache, value_cache, attn_metadata.query_start_loc,
                                  attn_metadata.seq_lens, attn_metadata.block_table_tensor)


class Llama4Model:
    """One chunked-local-attention layer (``layers.0``) and the LM head."""

    def __init__(self, device):
        gen = generator(26034)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos = randn(MAX_BLOCKS * BLOCK_SIZE, DIM, gen=gen, device=device, scale=0.5)
        self.wq, self.wk, self.wv, self.wo = (randn(DIM, DIM, gen=gen, device=device, scale=0.6) for _ in range(4))
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.6)

    def kv(self, ids, positions):
        h = self.emb[ids] + self.pos[positions]
        return h @ self.wk, h @ self.wv


class GPUModelRunner:
    def __init__(self, model, device, variant: str, graphed: bool):
        self.model, self.device = model, device
        self.builder = ChunkedLocalAttentionBuilder(variant)
        self.input_ids = torch.zeros(MAX_NUM_SEQS, dtype=torch.long, device=device)
        self.positions = torch.zeros(MAX_NUM_SEQS, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(MAX_NUM_SEQS, dtype=torch.long, device=device)
        self.block_table = torch.zeros(MAX_NUM_SEQS, MAX_BLOCKS, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(MAX_NUM_SEQS, dtype=torch.int32, device=device)
        self.query_start_loc = torch.zeros(MAX_NUM_SEQS + 1, dtype=torch.int32, device=device)
        self.kv_cache = (torch.zeros(NUM_BLOCKS * BLOCK_SIZE, DIM, device=device),
                         torch.zeros(NUM_BLOCKS * BLOCK_SIZE, DIM, device=device))
        # cudagraph_mode FULL_AND_PIECEWISE, downgraded when a builder cannot be captured
        if self.builder.cudagraph_support == AttentionCGSupport.NEVER:
            mode = CUDAGraphMode.PIECEWISE
        else:
            mode = CUDAGraphMode.FULL
        self.manager = None
        if graphed:
            self.manager = GraphManager(self.forward, CAPTURE_SIZES, device=device, mode=mode,
                                        on_freed="reuse", name="GPUModelRunner (decode)",
                                        static_buffers={"input_ids": self.input_ids, "positions": self.positions,
                                                        "slot_mapping": self.slot_mapping,
                                                        "block_table": self.block_table, "seq_lens": self.seq_lens,
                                                        "query_start_loc": self.query_start_loc})
            self.unified_attention = self.manager.eager(unified_attention)
        else:
            self.unified_attention = unified_attention

    def forward(self, num_tokens: int):
        m = self.model
        h = m.emb[self.input_ids[:num_tokens]] + m.pos[self.positions[:num_tokens]]
        attn = self.unified_attention(h @ m.wq, h @ m.wk, h @ m.wv, self.kv_cache, "layers.0")
        return (h + attn @ m.wo) @ m.lm_head

    def _dummy_runs(self, capture_sizes):
        """``capture_model``: before each size is warmed up and captured, ``_dummy_run`` builds the metadata
        of a uniform decode batch of one-token requests on the null block; it is released afterwards."""
        for num_tokens in capture_sizes:
            self.seq_lens[:num_tokens].fill_(1)
            self.block_table[:num_tokens].fill_(NULL_BLOCK)
            _forward_context.attn_metadata = self._build_attention_metadata(num_tokens, [1] * num_tokens)
            yield num_tokens
            _forward_context.attn_metadata = None             # the dummy run's metadata is released

    def _build_attention_metadata(self, num_reqs: int, seq_lens_cpu: list[int]):
        query_start_loc_cpu = torch.arange(num_reqs + 1, dtype=torch.int32)
        self.query_start_loc[:num_reqs + 1].copy_(query_start_loc_cpu)
        common = CommonAttentionMetadata(
            query_start_loc_cpu=query_start_loc_cpu, query_start_loc=self.query_start_loc[:num_reqs + 1],
            seq_lens_cpu=torch.tensor(seq_lens_cpu, dtype=torch.int32), seq_lens=self.seq_lens[:num_reqs],
            num_reqs=num_reqs, max_query_len=1, max_seq_len=max(seq_lens_cpu),
            block_table_tensor=self.block_table[:num_reqs], slot_mapping=self.slot_mapping[:num_reqs])
        return {"layers.0": self.builder.build(common)}

    def capture_model(self):
        self.manager.capture(self._dummy_runs)

    def execute_model(self, ids, positions, blocks):
        n = len(ids)
        seq_lens = [p + 1 for p in positions]
        self.input_ids[:n].copy_(torch.tensor(ids))
        self.positions[:n].copy_(torch.tensor(positions))
        self.slot_mapping[:n].copy_(torch.tensor([blocks[i][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                                                  for i, p in enumerate(positions)]))
        self.block_table[:n].copy_(torch.tensor(blocks))
        self.seq_lens[:n].copy_(torch.tensor(seq_lens, dtype=torch.int32))
        _forward_context.attn_metadata = self._build_attention_metadata(n, seq_lens)
        try:
            if self.manager is None:
                return self.forward(n)[:n].clone()
            size = self.manager.dispatch(n)
            return self.manager.replay(size, n).clone()
        finally:
            _forward_context.attn_metadata = None


# four requests: prompt tokens and their KV blocks (block 0 is the null block)
REQUESTS = [([3, 7, 1], [1, 2, 3, 4, 5, 6]), ([5, 2, 9, 4, 6], [7, 8, 9, 10, 11, 12]),
            ([8], [13, 14, 15, 6, 7, 8]), ([2, 2, 11, 5], [9, 10, 11, 12, 13, 14])]


def run(variant: str, device: str = "cpu"):
    model = Llama4Model(device)

    def serve(graphed: bool):
        runner = GPUModelRunner(model, device, variant, graphed)
        if graphed:
            runner.capture_model()
        key_cache, value_cache = runner.kv_cache
        for prompt, blocks in REQUESTS:                       # prefill (eager), KV written to the paged cache
            pos = torch.arange(len(prompt))
            slots = (torch.tensor(blocks)[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE).to(device)
            k, v = model.kv(torch.tensor(prompt, device=device), pos.to(device))
            key_cache[slots], value_cache[slots] = k, v
        outs = []
        for step in range(4):                                 # decode steps; local chunks roll over
            ids = [(prompt[-1] + 2 * step + i) % VOCAB for i, (prompt, _) in enumerate(REQUESTS)]
            positions = [len(prompt) + step for prompt, _ in REQUESTS]
            outs.append(runner.execute_model(ids, positions, [blocks for _, blocks in REQUESTS]))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
