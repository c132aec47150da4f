"""Llama 4's chunked local attention is missing from the decode graph's metadata: captured layers attend globally.

Upstream: https://github.com/sgl-project/sglang/pull/6162 ("[Bugfix] Fix Llama4 gibberish output with long
context and CUDA graph").
Symptom: Llama 4 (iRoPE: chunked local attention in three of four layers, ``attention_chunk_size`` 8192)
served with the FlashAttention-3 backend generated gibberish once a context grew past 8192 tokens, but only
with CUDA graphs on; ``--disable-cuda-graph`` was coherent (sglang main, May 2025).
Mechanism: ``FlashAttentionBackend.forward_decode`` picks, in Python, between the local (chunked) kernel
arguments and the global ones: ``use_local_attn`` is true only when ``metadata.local_attn_metadata`` is set.
Eager decode builds it in ``init_forward_metadata`` (``_init_local_attn_metadata``: every query attends only
to the keys of its own ``attention_chunk_size`` chunk). For the decode graph, ``init_cuda_graph_state``
preallocated no local-attention buffers and ``init_forward_metadata_capture_cuda_graph`` left
``local_attn_metadata`` as ``None``, so the capture recorded the global branch for the iRoPE layers, with
the global ``page_table``/``cache_seqlens``. Every replay re-runs that branch: as soon as a sequence is
longer than one chunk, the local layers attend over the whole context while eager attends over the last
chunk only.
Doctor: warmup-divergence, at ``init_forward_metadata_capture_cuda_graph`` (the capture-time metadata
decided the global-attention branch that replays reuse while an eager step decides local attention).
Fix (upstream): preallocate ``decode_cuda_graph_local_attn_metadata`` buffers in ``init_cuda_graph_state``,
build the capture metadata's ``local_attn_metadata`` from views of them, and refill them in place before
each replay (``_update_local_attn_metadata_for_replay``).
(Tiny model: page size 1, chunk of 4 tokens, one iRoPE layer and one global layer; the prompt KV is
written directly as a prefill would leave it.)
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np
import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/6162"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "init_forward_metadata_capture_cuda_graph"
SYMPTOM = "iRoPE layers attend over the whole context under the decode graph once a sequence passes one chunk"
VOCAB, DIM, ATTENTION_CHUNK_SIZE, CONTEXT_LEN, NUM_SLOTS, MAX_REQS = 12, 4, 4, 16, 48, 3
PROMPT_LENS = (5, 3)                      # request 1 and 2 (req_pool slots 1, 2; slot 0 is the dummy)
DECODE_IDS = ((3, 7), (1, 4), (9, 2), (5, 5))


@dataclasses.dataclass
class FlashAttentionMetadata:
    cu_seqlens_q: torch.Tensor = None
    max_seq_len_k: int = 0
    page_table: torch.Tensor = None
    cache_seqlens_int32: torch.Tensor = None

    @dataclasses.dataclass
    class LocalAttentionMetadata:
        local_query_start_loc: torch.Tensor = None
        local_seqused_k: torch.Tensor = None
        local_block_table: torch.Tensor = None
        local_max_query_len: int = 0
        local_max_seq_len: int = 0

    local_attn_metadata: Optional[LocalAttentionMetadata] = None


@dataclasses.dataclass
class ForwardBatch:
    batch_size: int
    input_ids: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    out_cache_loc: torch.Tensor


def make_local_attention_virtual_batches(attn_chunk_size, seq_lens_np, page_table_np):
    """Decode form (one query per request): each query sees the tail of its sequence inside its own chunk."""
    tokens_in_last_block = attn_chunk_size + (seq_lens_np % -attn_chunk_size)
    k_start = seq_lens_np - tokens_in_last_block
    cols = np.minimum(k_start[:, None] + np.arange(attn_chunk_size)[None, :], page_table_np.shape[1] - 1)
    block_table_local = np.take_along_axis(page_table_np, cols, axis=1)
    cu_seqlens_q_local = np.arange(len(seq_lens_np) + 1, dtype=np.int32)
    return cu_seqlens_q_local, tokens_in_last_block.astype(np.int32), block_table_local


def flash_attn_with_kvcache(q, k_cache, v_cache, page_table, cache_seqlens):
    k, v = k_cache[page_table], v_cache[page_table]                       # [bs, width, dim]
    scores = (k @ q.unsqueeze(-1)).squeeze(-1) / math.sqrt(q.shape[-1])
    valid = torch.arange(page_table.shape[1], device=q.device)[None, :] < cache_seqlens[:, None]
    p = torch.softmax(scores.masked_fill(~valid, float("-inf")), dim=-1)
    return (p.unsqueeze(-1) * v).sum(1)


class RadixAttention:
    def __init__(self, layer_id, use_irope):
        self.layer_id, self.use_irope = layer_id, use_irope


class FlashAttentionBackend:
    def __init__(self, req_to_token, k_buffer, v_buffer, variant):
        self.req_to_token, self.k_buffer, self.v_buffer = req_to_token, k_buffer, v_buffer
        self.attention_chunk_size = ATTENTION_CHUNK_SIZE
        self.variant = variant
        self.forward_metadata: FlashAttentionMetadata = None
        self.decode_cuda_graph_metadata = {}

    # ---- eager -------------------------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch: ForwardBatch):
        metadata = FlashAttentionMetadata()
        device = forward_batch.seq_lens.device
        metadata.cache_seqlens_int32 = forward_batch.seq_lens.to(torch.int32)
        metadata.max_seq_len_k = int(forward_batch.seq_lens_cpu.max())
        metadata.cu_seqlens_q = torch.arange(forward_batch.batch_size + 1, dtype=torch.int32, device=device)
        metadata.page_table = self.req_to_token[forward_batch.req_pool_indices, :]
        self._init_local_attn_metadata(metadata, device)
        self.forward_metadata = metadata

    def _init_local_attn_metadata(self, metadata, device):
        if self.attention_chunk_size is None:
            metadata.local_attn_metadata = None
            return
        seq_lens_np = metadata.cache_seqlens_int32.cpu().numpy()
        cu_q, seqused_k, block_table = make_local_attention_virtual_batches(
            self.attention_chunk_size, seq_lens_np, metadata.page_table.cpu().numpy())
        metadata.local_attn_metadata = FlashAttentionMetadata.LocalAttentionMetadata(
            local_query_start_loc=torch.from_numpy(cu_q).to(device),
            local_seqused_k=torch.from_numpy(seqused_k).to(device),
            local_block_table=torch.from_numpy(block_table).to(device),
            local_max_query_len=1, local_max_seq_len=int(seqused_k.max()))

    # ---- CUDA graph --------------------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs, device):
        self.decode_cuda_graph_metadata = {
            "cache_seqlens": torch.zeros(max_bs, dtype=torch.int32, device=device),
            "cu_seqlens_q": torch.arange(max_bs + 1, dtype=torch.int32, device=device),
            "page_table": torch.zeros(max_bs, CONTEXT_LEN, dtype=torch.long, device=device),
        }
        if self.variant == "fix" and self.attention_chunk_size is not None:
            self.decode_cuda_graph_local_attn_metadata = {
                "local_query_start_loc": torch.zeros(max_bs + 1, dtype=torch.int32, device=device),
                "local_seqused_k": torch.zeros(max_bs, dtype=torch.int32, device=device),
                "local_block_table": torch.zeros(max_bs, self.attention_chunk_size, dtype=torch.long,
                                                 device=device),
            }

    def init_forward_metadata_capture_cuda_graph(self, bs, req_pool_indices, seq_lens):
        buffers = self.decode_cuda_graph_metadata
        metadata = FlashAttentionMetadata()
        metadata.cache_seqlens_int32 = buffers["cache_seqlens"][:bs]
        metadata.cache_seqlens_int32.copy_(seq_lens)
        metadata.cu_seqlens_q = buffers["cu_seqlens_q"][: bs + 1]
        metadata.max_seq_len_k = CONTEXT_LEN
        metadata.page_table = buffers["page_table"][:bs]
        metadata.page_table.copy_(self.req_to_token[req_pool_indices, :])
        if self.variant == "fix":
            self._init_local_attn_metadata_for_cuda_graph(metadata, bs)
        # (bug) local_attn_metadata stays None: the capture records the global branch
        self.decode_cuda_graph_metadata[bs] = metadata
        self.forward_metadata = metadata

    def _init_local_attn_metadata_for_cuda_graph(self, metadata, bs):
        local = self.decode_cuda_graph_local_attn_metadata
        metadata.local_attn_metadata = FlashAttentionMetadata.LocalAttentionMetadata(
            local_query_start_loc=local["local_query_start_loc"][: bs + 1],
            local_seqused_k=local["local_seqused_k"][:bs],
            local_block_table=local["local_block_table"][:bs],
            local_max_query_len=1, local_max_seq_len=self.attention_chunk_size)
        self._update_local_attn_metadata_for_replay(metadata, bs)

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_cpu):
        metadata = self.decode_cuda_graph_metadata[bs]
        metadata.cache_seqlens_int32.copy_(seq_lens)
        metadata.page_table.copy_(self.req_to_token[req_pool_indices, :])
        if self.variant == "fix":
            self._update_local_attn_metadata_for_replay(metadata, bs)
        self.forward_metadata = metadata

    def _update_local_attn_metadata_for_replay(self, metadata, bs):
        """Refill the preallocated local-attention buffers in place (host arithmetic, device copies)."""
        local = metadata.local_attn_metadata
        cu_q, seqused_k, block_table = make_local_attention_virtual_batches(
            self.attention_chunk_size, metadata.cache_seqlens_int32.cpu().numpy(),
            metadata.page_table.cpu().numpy())
        local.local_query_start_loc.copy_(torch.from_numpy(cu_q))
        local.local_seqused_k.copy_(torch.from_numpy(seqused_k))
        local.local_block_table.copy_(torch.from_numpy(block_table))

    # ---- the attention op ------------------------------------------------------------------------
    def forward_decode(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch):
        self.k_buffer[layer.layer_id][forward_batch.out_cache_loc] = k      # set_kv_buffer
        self.v_buffer[layer.layer_id][forward_batch.out_cache_loc] = v
        metadata = self.forward_metadata
        use_local_attn = (self.attention_chunk_size is not None
                          and metadata.local_attn_metadata is not None and layer.use_irope)
        if use_local_attn:
            page_table = metadata.local_attn_metadata.local_block_table
            cache_seqlens = metadata.local_attn_metadata.local_seqused_k
        else:
            page_table = metadata.page_table
            cache_seqlens = metadata.cache_seqlens_int32
        return flash_attn_with_kvcache(q, self.k_buffer[layer.layer_id], self.v_buffer[layer.layer_id],
                                       page_table, cache_seqlens)


class Llama4ForCausalLM:
    def __init__(self, device):
        gen = generator(6162)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.layers = [RadixAttention(0, use_irope=True), RadixAttention(1, use_irope=False)]
        self.w = [[randn(DIM, DIM, gen=gen, device=device, scale=0.6) for _ in range(4)] for _ in self.layers]
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device)

    def forward(self, forward_batch: ForwardBatch, attn_backend: FlashAttentionBackend):
        h = self.embed[forward_batch.input_ids]
        for layer, (wq, wk, wv, wo) in zip(self.layers, self.w):
            o = attn_backend.forward_decode(h @ wq, h @ wk, h @ wv, layer, forward_batch)
            h = h + o @ wo
        return h @ self.lm_head


class CudaGraphRunner:
    def __init__(self, model, attn_backend, device, bs):
        self.model, self.attn_backend, self.bs = model, attn_backend, bs
        self.input_ids = torch.zeros(bs, dtype=torch.long, device=device)
        self.req_pool_indices = torch.zeros(bs, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(bs, dtype=torch.long, device=device)       # seq_len_fill_value
        self.out_cache_loc = torch.zeros(bs, dtype=torch.long, device=device)
        attn_backend.init_cuda_graph_state(bs, device)
        attn_backend.init_forward_metadata_capture_cuda_graph(bs, self.req_pool_indices, self.seq_lens)
        forward_batch = ForwardBatch(bs, self.input_ids, self.req_pool_indices, self.seq_lens, None,
                                     self.out_cache_loc)
        static = {"input_ids": self.input_ids, "req_pool_indices": self.req_pool_indices,
                  "seq_lens": self.seq_lens, "out_cache_loc": self.out_cache_loc,
                  "cache_seqlens": attn_backend.decode_cuda_graph_metadata["cache_seqlens"],
                  "page_table": attn_backend.decode_cuda_graph_metadata["page_table"]}
        static.update(getattr(attn_backend, "decode_cuda_graph_local_attn_metadata", {}))
        self.graph, self.output = capture(
            lambda: model.forward(forward_batch, attn_backend), device=device, name=f"bs {bs}", static=static,
            state={"k_buffer_0": attn_backend.k_buffer[0], "k_buffer_1": attn_backend.k_buffer[1],
                   "v_buffer_0": attn_backend.v_buffer[0], "v_buffer_1": attn_backend.v_buffer[1],
                   "req_to_token": attn_backend.req_to_token},
            owner="CudaGraphRunner (decode)")

    def replay(self, forward_batch: ForwardBatch):
        self.input_ids.copy_(forward_batch.input_ids)
        self.req_pool_indices.copy_(forward_batch.req_pool_indices)
        self.seq_lens.copy_(forward_batch.seq_lens)
        self.out_cache_loc.copy_(forward_batch.out_cache_loc)
        self.attn_backend.init_forward_metadata_replay_cuda_graph(
            self.bs, self.req_pool_indices, self.seq_lens, forward_batch.seq_lens_cpu)
        return replay(self.graph, self.output).clone()


def run(variant: str, device: str = "cpu"):
    model = Llama4ForCausalLM(device)

    def serve(graphed: bool):
        gen = generator(61620)
        k_buffer = [torch.zeros(NUM_SLOTS, DIM, device=device) for _ in model.layers]
        v_buffer = [torch.zeros(NUM_SLOTS, DIM, device=device) for _ in model.layers]
        req_to_token = torch.zeros(MAX_REQS, CONTEXT_LEN, dtype=torch.long, device=device)
        backend = FlashAttentionBackend(req_to_token, k_buffer, v_buffer, variant)
        runner = CudaGraphRunner(model, backend, device, bs=2) if graphed else None
        # Prefill left the prompts' KV in slots 1.. (request 1) and 9.. (request 2).
        first_slot = {1: 1, 2: 9}
        seq_lens = dict(zip((1, 2), PROMPT_LENS))
        for rid, n in seq_lens.items():
            req_to_token[rid, :CONTEXT_LEN] = torch.arange(first_slot[rid], first_slot[rid] + CONTEXT_LEN)
            for layer in range(len(model.layers)):
                k_buffer[layer][first_slot[rid]:first_slot[rid] + n] = randn(n, DIM, gen=gen, device=device)
                v_buffer[layer][first_slot[rid]:first_slot[rid] + n] = randn(n, DIM, gen=gen, device=device)
        outs = []
        for ids in DECODE_IDS:
            for rid in seq_lens:
                seq_lens[rid] += 1                                   # the decoded token's KV slot
            lens = [seq_lens[1], seq_lens[2]]
            forward_batch = ForwardBatch(
                2, torch.tensor(ids, device=device), torch.tensor([1, 2], device=device),
                torch.tensor(lens, device=device), torch.tensor(lens),
                req_to_token[torch.tensor([1, 2], device=device), torch.tensor(lens, device=device) - 1])
            if graphed:
                outs.append(runner.replay(forward_batch))
            else:
                backend.init_forward_metadata(forward_batch)
                outs.append(model.forward(forward_batch, backend))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
