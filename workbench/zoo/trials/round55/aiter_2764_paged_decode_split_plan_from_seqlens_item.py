"""The Triton paged decode attention reads ``cache_seqlens.max().item()`` inside the captured call to plan its split-K.

Upstream: https://github.com/ROCm/aiter/pull/2764 ("fix graph capture", commit 9bab8388c3 on main).
Symptom: capturing a decode step that calls the AMD Triton flash-attention ``flash_attn_with_kvcache`` path with a
paged KV cache (``block_table``) fails: the ``.item()`` is a device-to-host synchronisation, which a capturing
stream refuses (HIP/CUDA "operation not permitted when stream is capturing"; the PR quotes no error text, its
code comment says "GPU-to-CPU sync is illegal during CUDA graph capture").
Mechanism: ``attention_forward_decode_triton_impl`` (flash_attn_triton_amd/fwd_decode.py), for a paged cache
(``use_block_table``), took ``seqlen_kc = int(cache_seqlens.max().item())`` and again ``max_seqlen =
int(cache_seqlens.max().item())`` for ``split_k = get_split_k(batch_size, n_group_q, heads_per_group_q,
max_seqlen)``; ``split_size = (seqlen_kc + split_k - 1) // split_k`` then sizes the split-K grid, the
``out_splitk`` / ``metadata`` intermediates and each split's KV range. Eagerly (and in the warmup before capture)
the sync is harmless; in the capture it is refused, so the graphed decode never comes up. (Had the sync been
tolerated, the plan would be host ints of the capture batch's lengths, frozen for every replay.)
Modelled with two sequences, two heads, a 4-wide head, 16-token blocks; the splitK kernel and its reduce are torch
ops; the runner captures one decode step over static ``q`` / ``cache_seqlens`` / ``block_table`` buffers and
replays it as the sequences grow.
Doctor: sync-in-capture, at ``attention_forward_decode_triton_impl`` (the ``cache_seqlens.max().item()`` that
plans the split).
Fix (upstream): derive the length from the capture-invariant block-table bound, ``assert block_table is not None;
seqlen_kc = block_table.shape[1] * block_size_k``, and ``split_k = get_split_k(..., seqlen_kc)``: no sync, and
the plan covers every length the block table can hold (it also dropped the ``cu_seqlens`` value asserts of
fwd_prefill.py, which sync too).
"""
from __future__ import annotations

import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/ROCm/aiter/pull/2764"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "attention_forward_decode_triton_impl"
SYMPTOM = "decode graph capture fails: cache_seqlens.max().item() inside the captured paged-attention call"

BATCH, NHEADS, HEAD_DIM = 2, 2, 4
BLOCK_SIZE, BLOCKS_PER_SEQ, NUM_BLOCKS = 16, 16, 40
STEPS = ([40, 100], [41, 131], [97, 200], [130, 256])      # cache_seqlens of each decode step


def get_split_k(B: int, G: int, H: int, Mk: int) -> int:
    """Heuristic for the number of splits"""
    bh = max(B * H, 1)
    split_k = max(Mk, 1024) // bh
    max_chunk_size = 64
    while split_k > 0 and Mk / split_k < max_chunk_size:
        split_k = split_k // 2
    while B * H * G * split_k >= 1024:
        split_k = split_k // 2
    split_k = min(split_k, 512)
    return max(split_k, 1)


def _fwd_kernel_splitK(q, k_cache, v_cache, cache_seqlens, block_table, sm_scale, split_k, split_size,
                       out_splitk, metadata):
    """Each split ``s`` attends over keys ``[s * split_size, (s + 1) * split_size)`` of its sequence (paged)."""
    block_size = k_cache.shape[1]
    pos = torch.arange(split_k * split_size, device=q.device).view(split_k, split_size)
    blk = (pos // block_size).clamp(max=block_table.shape[1] - 1)
    block_ids = block_table[:, blk]                                  # [B, S, L]
    k = k_cache[block_ids, pos % block_size]                         # [B, S, L, H, D]
    v = v_cache[block_ids, pos % block_size]
    valid = pos[None] < cache_seqlens[:, None, None]                 # [B, S, L]
    scores = torch.einsum("bhd,bslhd->bhsl", q[:, 0], k) * sm_scale
    scores = scores.masked_fill(~valid[:, None], float("-inf"))
    m = scores.amax(-1)                                              # [B, H, S]
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(scores - m_safe[..., None])
    l_i = p.sum(-1)
    acc = torch.einsum("bhsl,bslhd->bhsd", p, v)
    out_splitk.copy_(torch.where(l_i[..., None] > 0, acc / l_i.clamp(min=1e-30)[..., None], 0.0).flatten(0, 1))
    metadata.copy_(torch.stack([m, l_i], 2).flatten(0, 1))


def _splitK_reduce(out_splitk, metadata, out, lse):
    m, l_i = metadata[:, 0], metadata[:, 1]                          # [B*H, S]
    g_m = m.amax(-1, keepdim=True)
    alpha = torch.where(torch.isfinite(m), torch.exp(m - g_m), torch.zeros_like(m)) * l_i
    l_sum = alpha.sum(-1)
    out.copy_(((out_splitk * alpha[..., None]).sum(1) / l_sum[:, None]).view(out.shape))
    lse.copy_((g_m[:, 0] + torch.log(l_sum)).view(lse.shape))


def attention_forward_decode_triton_impl(q, k_cache, v_cache, out, softmax_lse, sm_scale, cache_seqlens,
                                         block_table, variant):
    batch_size, seqlen_q, nheads_q, dim_q = q.shape
    num_blocks_kc, block_size_k, nheads_kc, dim_kc = k_cache.shape
    n_group_q, heads_per_group_q = nheads_kc, nheads_q // nheads_kc
    if variant == "bug":
        # Get the actual sequence length from cache_seqlens
        seqlen_kc = int(cache_seqlens.max().item())
        max_seqlen = int(cache_seqlens.max().item())
        split_k = get_split_k(batch_size, n_group_q, heads_per_group_q, max_seqlen)
    else:
        # Avoid cache_seqlens.max().item(): GPU-to-CPU sync is illegal during CUDA graph capture,
        # and the block-table bound is always safe.
        assert block_table is not None
        num_blocks_per_seq = block_table.shape[1]
        seqlen_kc = num_blocks_per_seq * block_size_k
        split_k = get_split_k(batch_size, n_group_q, heads_per_group_q, seqlen_kc)
    split_size = (seqlen_kc + split_k - 1) // split_k
    out_splitk = torch.empty(batch_size * nheads_q, split_k, dim_q, dtype=torch.float32, device=q.device)
    metadata = torch.empty(batch_size * nheads_q, 2, split_k, dtype=torch.float32, device=q.device)
    _fwd_kernel_splitK(q, k_cache, v_cache, cache_seqlens, block_table, sm_scale, split_k, split_size,
                       out_splitk, metadata)
    _splitK_reduce(out_splitk, metadata, out, softmax_lse)
    return out, softmax_lse


def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, variant):
    """mha_v3-style entry point: allocates ``out`` / ``softmax_lse`` and calls the decode impl."""
    out = torch.empty_like(q)
    softmax_lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device=q.device)
    return attention_forward_decode_triton_impl(q, k_cache, v_cache, out, softmax_lse, 1.0 / math.sqrt(q.shape[-1]),
                                                cache_seqlens, block_table, variant)


def run(variant: str, device: str = "cpu"):
    gen = generator(2764)
    k_cache = randn(NUM_BLOCKS, BLOCK_SIZE, NHEADS, HEAD_DIM, gen=gen, device=device)
    v_cache = randn(NUM_BLOCKS, BLOCK_SIZE, NHEADS, HEAD_DIM, gen=gen, device=device)
    block_table = torch.randperm(NUM_BLOCKS, generator=gen)[:BATCH * BLOCKS_PER_SEQ].view(BATCH, -1).to(device)
    qs = [randn(BATCH, 1, NHEADS, HEAD_DIM, gen=gen, device=device) for _ in STEPS]
    seqlens = [torch.tensor(s, dtype=torch.int32).to(device) for s in STEPS]

    def eager():
        outs = []
        for q, cache_seqlens in zip(qs, seqlens):
            outs += [t.clone() for t in flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table,
                                                                variant)]
        return outs

    def served():
        q_buf, seqlens_buf, table_buf = qs[0].clone(), seqlens[0].clone(), block_table.clone()
        g, static_out = capture(
            lambda: flash_attn_with_kvcache(q_buf, k_cache, v_cache, seqlens_buf, table_buf, variant),
            device=device, name="decode", owner="decode graph runner",
            static={"q": q_buf, "cache_seqlens": seqlens_buf, "block_table": table_buf},
            state={"k_cache": k_cache, "v_cache": v_cache})
        outs = []
        for q, cache_seqlens in zip(qs, seqlens):
            q_buf.copy_(q)
            seqlens_buf.copy_(cache_seqlens)
            outs += [t.clone() for t in replay(g, static_out)]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
