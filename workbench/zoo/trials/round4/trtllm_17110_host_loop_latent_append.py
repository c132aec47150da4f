"""Speculative verify under a CUDA graph falls back to the host-side MLA cache append: its positions are the capture's.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/17110 ("[TRTLLM-14706][fix] Fix SA specdec + CUDA
graphs").
Symptom: SA speculative decoding with CUDA graphs silently corrupts decoded tokens (Kimi K3 GSM8K 88.2 with
graphs vs 96.2 eager; acceptance length unchanged), TensorRT-LLM PyTorch backend, July 2026.
Mechanism: ``append_mla_latent_cache_generation_cuda_graph_safe`` had a graph-safe device path only for
``q_len == 1`` and otherwise fell back to ``append_mla_latent_cache``, a host loop that computes every
write position from host metadata (request ids -> blocks, ``seq_lens.tolist()``,
``num_cached_tokens_per_seq``). A speculative verify batch has ``q_len = 1 + max_draft_len``, so under
capture that loop ran once on the dummy requests and the graph recorded copies into the dummy requests'
blocks. Every replay writes the new tokens' latents there, the real requests' cache slots are never
written, and attention reads whatever they held.
Doctor: host-work-frozen, at ``append_mla_latent_cache`` (the copy whose block and offset Python computed
at capture).
Fix (upstream): the graph-safe path handles any uniform ``q_len``: positions ``kv_len - q_len ..
kv_len - 1`` from ``kv_lens_cuda_runtime`` and blocks from ``kv_cache_block_offsets``, device buffers that
``metadata.prepare()`` refreshes before every replay.
"""
from __future__ import annotations

import torch

from workbench.engine import events, host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/17110"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "append_mla_latent_cache"
SYMPTOM = "verify tokens' latents go to the capture's dummy blocks; real requests attend over stale cache slots"
VOCAB, HID, LAT = 16, 4, 4                      # latent = [compressed_kv | k_pe], one head
TOKENS_PER_BLOCK, NUM_BLOCKS, MAX_BLOCKS_PER_SEQ = 4, 8, 3
MAX_DRAFT_LEN = 2
Q_LEN = 1 + MAX_DRAFT_LEN
BATCH = 2                                       # the captured generation batch size
LAYER = 0
CUDA_GRAPH_DUMMY_REQUEST_ID = 1000


class KVCacheManager:
    """Paged MLA latent cache: one latent per token, ``tokens_per_block`` tokens per block."""

    def __init__(self, device):
        self.tokens_per_block = TOKENS_PER_BLOCK
        self.kv_cache = torch.zeros(NUM_BLOCKS, TOKENS_PER_BLOCK, LAT, device=device)
        self.free_blocks = list(range(NUM_BLOCKS))
        self.blocks: dict[int, list[int]] = {}

    def add_sequence(self, request_id: int, num_blocks: int) -> None:
        self.blocks[request_id] = [self.free_blocks.pop(0) for _ in range(num_blocks)]

    def get_buffers(self, layer_idx: int) -> torch.Tensor:
        return self.kv_cache

    def get_batch_cache_indices(self, request_ids, layer_idx: int = LAYER):
        return [self.blocks[r] + [-1] * (MAX_BLOCKS_PER_SEQ - len(self.blocks[r])) for r in request_ids]


class TrtllmAttentionMetadata:
    """The generation-only subset: host fields the scheduler fills, device buffers ``prepare()`` refreshes."""

    def __init__(self, kv_cache_manager, device, is_cuda_graph):
        self.kv_cache_manager = kv_cache_manager
        self.is_cuda_graph = is_cuda_graph
        self.device = device
        self.num_contexts = 0
        self.request_ids: list[int] = []
        self.seq_lens = host(torch.zeros(0, dtype=torch.int32), device)
        self.num_cached_tokens_per_seq: list[int] = []
        self.kv_lens_cuda_runtime = torch.zeros(BATCH, dtype=torch.int32, device=device)
        self.kv_cache_block_offsets = torch.zeros(BATCH, MAX_BLOCKS_PER_SEQ, dtype=torch.int32, device=device)

    @property
    def num_generations(self) -> int:
        return len(self.request_ids) - self.num_contexts

    def prepare(self) -> None:
        n = len(self.request_ids)
        kv_lens = [c + s for c, s in zip(self.num_cached_tokens_per_seq, self.seq_lens.tolist())]
        self.kv_lens_cuda_runtime[:n].copy_(host(torch.tensor(kv_lens, dtype=torch.int32), self.device))
        table = self.kv_cache_manager.get_batch_cache_indices(self.request_ids)
        self.kv_cache_block_offsets[:n].copy_(host(torch.tensor(table, dtype=torch.int32), self.device))


def append_mla_latent_cache(kv_cache_manager, layer_idx, request_ids, seq_lens, num_cached_tokens, latent_cache,
                            seq_start=0):
    """Append packed MLA latent tokens into the paged cache; every position is computed on the host."""
    kv_cache = kv_cache_manager.get_buffers(layer_idx)
    tokens_per_block = kv_cache.shape[1]
    blocks_per_seq = kv_cache_manager.get_batch_cache_indices(list(request_ids), layer_idx)
    offset = 0
    for i in range(seq_start, len(seq_lens)):
        q_len = int(seq_lens[i])
        new = latent_cache[offset:offset + q_len]
        start = int(num_cached_tokens[i])
        blocks = [b for b in blocks_per_seq[i] if b != -1]
        written = 0
        while written < q_len:
            pos = start + written
            block = blocks[pos // tokens_per_block]
            block_offset = pos % tokens_per_block
            n = min(tokens_per_block - block_offset, q_len - written)
            kv_cache[block, block_offset:block_offset + n].copy_(new[written:written + n])
            written += n
        offset += q_len
    return kv_cache


def append_mla_latent_cache_generation_cuda_graph_safe(metadata, layer_idx, latent_cache, any_uniform_q_len):
    """Append generation-phase MLA latent tokens, safe under CUDA graphs (only on its device path)."""
    kv_cache_manager = metadata.kv_cache_manager
    num_ctx, n_gen = metadata.num_contexts, metadata.num_generations
    if any_uniform_q_len:                        # #17110: decode and padded speculative verification
        graph_safe = n_gen > 0 and latent_cache.shape[0] % n_gen == 0
    else:                                        # before: only the q_len == 1 decode shape
        graph_safe = latent_cache.shape[0] == n_gen
    if not metadata.is_cuda_graph or not graph_safe:
        append_mla_latent_cache(kv_cache_manager, layer_idx, metadata.request_ids, metadata.seq_lens.tolist(),
                                metadata.num_cached_tokens_per_seq, latent_cache, seq_start=num_ctx)
        return
    kv_cache = kv_cache_manager.get_buffers(layer_idx)
    tokens_per_block = kv_cache_manager.tokens_per_block
    q_len = latent_cache.shape[0] // n_gen
    kv_lens = metadata.kv_lens_cuda_runtime[num_ctx:num_ctx + n_gen]
    pos = ((kv_lens.to(torch.int64) - q_len).clamp_(min=0).unsqueeze(1)
           + torch.arange(q_len, dtype=torch.int64, device=kv_lens.device))
    block_table = metadata.kv_cache_block_offsets[num_ctx:num_ctx + n_gen]
    dest_block = block_table.to(torch.int64).gather(1, pos // tokens_per_block).clamp_(min=0)
    kv_cache[dest_block, pos % tokens_per_block] = latent_cache.reshape(n_gen, q_len, latent_cache.shape[-1])


class Model:
    def __init__(self, device):
        gen = generator(17110)
        self.emb = randn(VOCAB, HID, gen=gen, device=device)
        self.pos = randn(MAX_BLOCKS_PER_SEQ * TOKENS_PER_BLOCK, HID, gen=gen, device=device, scale=0.5)
        self.w_kv = randn(HID, LAT, gen=gen, device=device, scale=0.5)
        self.w_q = randn(HID, LAT, gen=gen, device=device, scale=0.5)
        self.w_o = randn(LAT, VOCAB, gen=gen, device=device, scale=0.5)

    def latents(self, input_ids, position_ids):
        h = self.emb[input_ids] + self.pos[position_ids]
        return h, h @ self.w_kv


def mla_generation_attention(q, metadata):
    """The MLA generation kernel: reads the paged cache through the device metadata only."""
    kv_cache = metadata.kv_cache_manager.get_buffers(LAYER)
    n_gen = metadata.num_generations
    q_len = q.shape[0] // n_gen
    kv_lens = metadata.kv_lens_cuda_runtime[:n_gen].to(torch.int64)
    ctx = torch.arange(MAX_BLOCKS_PER_SEQ * TOKENS_PER_BLOCK, device=q.device)
    table = metadata.kv_cache_block_offsets[:n_gen].to(torch.int64).clamp(min=0)
    slots = table[:, ctx // TOKENS_PER_BLOCK] * TOKENS_PER_BLOCK + ctx % TOKENS_PER_BLOCK
    kv = kv_cache.reshape(-1, LAT)[slots]                                          # [n_gen, ctx, LAT]
    token_pos = kv_lens[:, None] - q_len + torch.arange(q_len, device=q.device)    # [n_gen, q_len]
    scores = torch.einsum("gql,gkl->gqk", q.view(n_gen, q_len, LAT), kv) / LAT ** 0.5
    scores = scores.masked_fill(ctx[None, None, :] > token_pos[..., None], float("-inf"))
    return torch.einsum("gqk,gkl->gql", torch.softmax(scores, -1), kv).reshape(-1, LAT)


def forward(model, input_ids, position_ids, metadata, any_uniform_q_len):
    h, latent_cache = model.latents(input_ids, position_ids)
    append_mla_latent_cache_generation_cuda_graph_safe(metadata, LAYER, latent_cache, any_uniform_q_len)
    return mla_generation_attention(h @ model.w_q, metadata) @ model.w_o


def prefill(model, kv_cache_manager, request_id, prompt):
    """Context phase (eager): the prompt's latents into the request's blocks."""
    device = kv_cache_manager.kv_cache.device
    _, latents = model.latents(torch.tensor(prompt, device=device), torch.arange(len(prompt), device=device))
    append_mla_latent_cache(kv_cache_manager, LAYER, [request_id], [len(prompt)], [0], latents)


REQUESTS = {1: [3, 7, 12], 2: [5, 1, 9, 14, 2]}        # request id -> prompt


def schedule():
    """Three verify steps of both requests: per request, its last token and two draft tokens, then how
    many drafts were accepted (the next step starts after the accepted ones and the bonus token)."""
    return [({1: [4, 11, 6], 2: [8, 0, 13]}, {1: 2, 2: 1}),
            ({1: [10, 2, 15], 2: [7, 3, 9]}, {1: 0, 2: 0}),
            ({1: [1, 5, 12], 2: [6, 14, 4]}, {1: 1, 2: 0})]


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    uniform = variant == "fix"

    def new_kv_cache_manager():
        kv = KVCacheManager(device)
        for rid in REQUESTS:
            kv.add_sequence(rid, MAX_BLOCKS_PER_SEQ)
        return kv

    def step_inputs(tokens, cached):
        ids = [t for rid in REQUESTS for t in tokens[rid]]
        pos = [cached[rid] + j for rid in REQUESTS for j in range(Q_LEN)]
        return torch.tensor(ids, device=device), torch.tensor(pos, device=device)

    def fill_metadata(metadata, request_ids, num_cached):
        metadata.request_ids = list(request_ids)
        metadata.seq_lens = host(torch.full((len(request_ids),), Q_LEN, dtype=torch.int32), device)
        metadata.num_cached_tokens_per_seq = list(num_cached)
        metadata.prepare()

    def eager():
        kv = new_kv_cache_manager()
        metadata = TrtllmAttentionMetadata(kv, device, is_cuda_graph=False)
        cached = {rid: len(p) for rid, p in REQUESTS.items()}
        for rid, prompt in REQUESTS.items():
            prefill(model, kv, rid, prompt)
        outs = []
        for tokens, accepted in schedule():
            input_ids, position_ids = step_inputs(tokens, cached)
            fill_metadata(metadata, REQUESTS, [cached[rid] for rid in REQUESTS])
            outs.append(forward(model, input_ids, position_ids, metadata, uniform))
            for rid in REQUESTS:
                cached[rid] += accepted[rid] + 1
        return outs

    def served():
        kv = new_kv_cache_manager()
        # CUDAGraphRunner: static input buffers, a graph metadata, and dummy generation requests (blocks of
        # their own, one cached token each) for the warmup and capture of the batch-2 verify graph.
        input_ids_buf = torch.zeros(BATCH * Q_LEN, dtype=torch.long, device=device)
        position_ids_buf = torch.zeros(BATCH * Q_LEN, dtype=torch.long, device=device)
        metadata = TrtllmAttentionMetadata(kv, device, is_cuda_graph=True)
        dummies = [CUDA_GRAPH_DUMMY_REQUEST_ID + i for i in range(BATCH)]
        for rid in dummies:
            kv.add_sequence(rid, 1)
        fill_metadata(metadata, dummies, [1] * BATCH)
        events.persistent_state("KVCacheManager", {"kv_cache": kv.kv_cache})
        g, out = capture(lambda: forward(model, input_ids_buf, position_ids_buf, metadata, uniform), device=device,
                         warmups=2, name=f"generation bs={BATCH} draft_len={MAX_DRAFT_LEN}",
                         static={"input_ids": input_ids_buf, "position_ids": position_ids_buf,
                                 "kv_lens_cuda_runtime": metadata.kv_lens_cuda_runtime,
                                 "kv_cache_block_offsets": metadata.kv_cache_block_offsets},
                         owner="CUDAGraphRunner")

        cached = {rid: len(p) for rid, p in REQUESTS.items()}
        for rid, prompt in REQUESTS.items():
            prefill(model, kv, rid, prompt)
        outs = []
        for tokens, accepted in schedule():
            input_ids, position_ids = step_inputs(tokens, cached)
            fill_metadata(metadata, REQUESTS, [cached[rid] for rid in REQUESTS])     # the same metadata object
            input_ids_buf.copy_(input_ids)
            position_ids_buf.copy_(position_ids)
            outs.append(replay(g, out).clone())
            for rid in REQUESTS:
                cached[rid] += accepted[rid] + 1
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
