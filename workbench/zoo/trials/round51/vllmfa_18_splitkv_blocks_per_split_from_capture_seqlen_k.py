"""Varlen split-KV attention sizes its splits from the host max_seqlen_k frozen at capture; replays drop later KV blocks.

Upstream: https://github.com/vllm-project/flash-attention/pull/18 ("Fix params.seqlen_k reference in the splitkv kernel
to binfo.actual_seqlen_k", commit 582eb8fc); report: https://github.com/Dao-AILab/flash-attention/issues/1164
("Correctness of `flash_attn_varlen_func` kernel with cuda graph"), found in https://github.com/vllm-project/vllm/pull/6052.
Symptom: ``flash_attn_varlen_func`` (paged, split-KV) under CUDA graphs gives wrong results once the replayed contexts
are longer than the ones used at capture; no crash, eager is correct.
Mechanism: ``mha_varlen_fwd`` takes ``max_seqlen_k`` as a host int, stores it in ``params.seqlen_k`` and calls
``set_params_splitkv``, which picks ``params.num_splits`` and sizes ``softmax_lse_accum`` / ``out_accum``; all are
kernel arguments, so the graph bakes in the capture-time values. The real per-request lengths come from device
tensors (``seqused_k`` / ``block_table``), read in the kernel as ``binfo.actual_seqlen_k`` and live at replay. But
``compute_attn_1rowblock_splitkv`` computed ``n_blocks_per_split`` from ``params.seqlen_k`` (the capture's dummy
maximum): split ``s`` covers blocks ``[s*nbps, min(ceil(actual/kBlockN), (s+1)*nbps))``, so the splits together visit
only ``num_splits * nbps`` blocks, and KV blocks past the capture length silently drop out of the softmax. An eager
call passes the true ``max_seqlen_k`` each step. Miniature: one decode layer, paged KV (page = kBlockN = 2, block 0
the null block), capture at dummy length 4 (2 blocks, 2 splits), decode contexts grow from 5 to 8.
Doctor: host-work-frozen, at compute_attn_1rowblock_splitkv (the split size is derived from the host scalar
params.seqlen_k, evaluated once at capture; replays reuse it while the device lengths grow).
Fix (upstream): one line in ``compute_attn_1rowblock_splitkv``: ``n_blocks_per_split`` from
``binfo.actual_seqlen_k`` (the device length of each request) instead of ``params.seqlen_k``.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/flash-attention/pull/18"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "compute_attn_1rowblock_splitkv"
SYMPTOM = "graph-replayed varlen split-KV attention ignores KV blocks past the capture-time max_seqlen_k (wrong output)"

VOCAB, DIM = 12, 4
kBlockN = PAGE = 2
MAX_BLOCKS, NUM_BLOCKS, NUM_REQS = 4, 9, 2
MAX_SPLITS = 4
CAPTURE_SEQLEN = 4                               # the dummy batch's max_seqlen_k at capture


class Params:
    """The kernel arguments set on the host by mha_varlen_fwd (captured by value)."""


def num_splits_heuristic(num_n_blocks: int) -> int:
    return max(1, min(MAX_SPLITS, num_n_blocks))


def set_params_splitkv(params, max_seqlen_k: int):
    num_n_blocks = (max_seqlen_k + kBlockN - 1) // kBlockN
    params.num_splits = num_splits_heuristic(num_n_blocks)


def compute_attn_1rowblock_splitkv(params, q, kv, actual_seqlen_k, n_split_idx, variant):
    """One split of every request: partial output and log-sum-exp over its KV blocks."""
    num_n_splits = params.num_splits
    if variant == "fix":                         # binfo.actual_seqlen_k: the device length, live at replay
        n_blocks_per_split = ((actual_seqlen_k + kBlockN - 1) // kBlockN + num_n_splits - 1) // num_n_splits
    else:                                        # params.seqlen_k: the host int, frozen at capture
        n_blocks_per_split = ((params.seqlen_k + kBlockN - 1) // kBlockN + num_n_splits - 1) // num_n_splits
        n_blocks_per_split = torch.full_like(actual_seqlen_k, n_blocks_per_split)
    n_block_min = n_split_idx * n_blocks_per_split
    n_block_max = torch.minimum((actual_seqlen_k + kBlockN - 1) // kBlockN, (n_split_idx + 1) * n_blocks_per_split)
    cols = torch.arange(kv.shape[1], device=q.device)
    blk = cols // kBlockN
    visible = (blk[None] >= n_block_min[:, None]) & (blk[None] < n_block_max[:, None]) & \
        (cols[None] < actual_seqlen_k[:, None])
    scores = torch.einsum("rd,rtd->rt", q, kv).masked_fill(~visible, float("-inf"))
    m = scores.amax(-1)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(scores - m_safe[:, None])
    lse_sum = p.sum(-1)
    o = torch.einsum("rt,rtd->rd", p, kv) / lse_sum.clamp_min(1e-30)[:, None]
    return o, m_safe + torch.log(lse_sum)


def combine_attn_seqk_parallel(out_accum, lse_accum):
    lse = torch.logsumexp(lse_accum, 0)
    return (torch.exp(lse_accum - lse[None])[..., None] * out_accum).sum(0)


def mha_varlen_fwd(q, kv_cache, seqused_k, block_table, max_seqlen_k: int, variant):
    params = Params()
    params.seqlen_k = max_seqlen_k
    set_params_splitkv(params, max_seqlen_k)
    kv = kv_cache[block_table].reshape(q.shape[0], MAX_BLOCKS * PAGE, DIM)
    parts = [compute_attn_1rowblock_splitkv(params, q, kv, seqused_k, s, variant) for s in range(params.num_splits)]
    out_accum = torch.stack([o for o, _ in parts])          # [num_splits, b, d]
    softmax_lse_accum = torch.stack([lse for _, lse in parts])
    return combine_attn_seqk_parallel(out_accum, softmax_lse_accum)


class DecodeModel:
    def __init__(self, device, variant):
        gen = generator(18)
        self.variant = variant
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq, self.wkv, self.wo = (randn(DIM, DIM, gen=gen, device=device, scale=0.8) for _ in range(3))
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.1)

    def forward(self, input_ids, seq_lens, block_table, slot_mapping, kv_cache, max_seqlen_k: int):
        x = self.emb[input_ids]
        kv_cache.view(-1, DIM).index_copy_(0, slot_mapping, x @ self.wkv)
        attn = mha_varlen_fwd(x @ self.wq, kv_cache, seq_lens, block_table, max_seqlen_k, self.variant)
        return (x + attn @ self.wo) @ self.lm_head


PROMPTS = ([3, 7, 1, 9, 4], [5, 2, 8, 6, 11, 1])
BLOCK_TABLE = [[1, 2, 3, 4], [5, 6, 7, 8]]
DECODE_STEPS = 3


def run(variant: str, device: str = "cpu"):
    model = DecodeModel(device, variant)
    block_table = torch.tensor(BLOCK_TABLE, device=device)

    def slot(req, pos):
        return BLOCK_TABLE[req][pos // PAGE] * PAGE + pos % PAGE

    def prefill(kv_cache):
        for r, p in enumerate(PROMPTS):
            ids = torch.tensor(p[:-1], device=device)
            slots = torch.tensor([slot(r, i) for i in range(len(p) - 1)], device=device)
            kv_cache.view(-1, DIM).index_copy_(0, slots, model.emb[ids] @ model.wkv)

    def serve(graphed: bool):
        kv_cache = torch.zeros(NUM_BLOCKS, PAGE, DIM, device=device)
        input_ids = torch.zeros(NUM_REQS, dtype=torch.long, device=device)
        seq_lens = torch.zeros(NUM_REQS, dtype=torch.long, device=device)
        block_tables = torch.zeros(NUM_REQS, MAX_BLOCKS, dtype=torch.long, device=device)
        slot_mapping = torch.zeros(NUM_REQS, dtype=torch.long, device=device)
        if graphed:                              # dummy decode batch: length CAPTURE_SEQLEN, null-block tables
            seq_lens.fill_(CAPTURE_SEQLEN)
            g, out = capture(lambda: model.forward(input_ids, seq_lens, block_tables, slot_mapping, kv_cache,
                                                   CAPTURE_SEQLEN),
                             device=device, name="decode graph",
                             static={"input_ids": input_ids, "seq_lens": seq_lens, "block_tables": block_tables,
                                     "slot_mapping": slot_mapping},
                             state={"kv_cache": kv_cache})
            kv_cache.zero_()
        prefill(kv_cache)
        tokens, lens, outs = [p[-1] for p in PROMPTS], [len(p) for p in PROMPTS], []
        for _ in range(DECODE_STEPS):
            input_ids.copy_(torch.tensor(tokens, device=device))
            seq_lens.copy_(torch.tensor(lens, device=device))
            block_tables.copy_(block_table)
            slot_mapping.copy_(torch.tensor([slot(r, n - 1) for r, n in enumerate(lens)], device=device))
            if graphed:
                logits = replay(g, out).clone()
            else:                                # eager: the true max_seqlen_k of this step
                logits = model.forward(input_ids, seq_lens, block_tables, slot_mapping, kv_cache, max(lens))
            outs.append(logits)
            tokens, lens = logits.argmax(-1).tolist(), [n + 1 for n in lens]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
