"""A captured MLA decode graph reads a split-offset table that ``get_meta_param``'s LRU cache evicted.

Upstream: https://github.com/ROCm/aiter/commit/068679589fa8f777efca1ecaebb61a0b69a6344d ("[fix][mla] keep
get_meta_param's split-offset table alive for captured graphs").
Symptom: non-finite logits / attn_lse from finite inputs, only at batch sizes above 128, under CUDA/HIP
graphs (DeepSeek-R1 MXFP4 on 8x MI355X, dense ``--cuda-graph-bs $(seq 1 256)``: gsm8k strict-match 0.0318
instead of 0.9560); eager mode is right.
Mechanism: ``aiter/mla.py::get_meta_param(num_kv_splits, bs, total_kv, nhead, max_seqlen_q, dtype)`` was
decorated with ``@functools.lru_cache`` (maxsize 128). It picks the split count and returns it with a
device tensor ``num_kv_splits_indptr = torch.arange(0, (bs+1)*num_kv_splits, num_kv_splits)``; the cache is
the tensor's only owner. The non-persistent path of ``mla_decode_fwd`` hands it to
``mla_decode_stage1_asm_fwd`` and ``_fwd_kernel_stage2_asm``, so a capture bakes its address into the
graph. The key holds ``bs``: a runner that warms up and captures one decode graph per batch size (largest
first, into one pool) inserts one entry per size; past maxsize the LRU evicts the entries of the first
(largest) sizes, their tables go back to the allocator, and replaying those graphs reads freed memory as
split offsets. Eager calls just miss and rebuild the table; replays cannot. (Here maxsize is 4 and the
sizes 6..1, so bs 6 and 5 are evicted by the warmups of bs 2 and 1.)
Doctor: dangling-reference, at ``get_meta_param`` (its bounded cache is the only owner of a tensor the
captured kernels read, and lets go of it).
Fix (upstream): split the pure split-count search into ``_pick_num_kv_splits`` (still ``lru_cache``d, returns
only the int) and serve the table from ``_get_num_kv_splits_indptr``, a module-level dict
``_num_kv_splits_indptr_cache`` keyed on ``(bs, num_kv_splits, device)`` that never evicts.
"""
from __future__ import annotations

import functools

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import (capture, compare, generator, own_segment_elems, randn, release_to_driver,
                               replay)

UPSTREAM = "https://github.com/ROCm/aiter/commit/068679589fa8f777efca1ecaebb61a0b69a6344d"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "get_meta_param"
SYMPTOM = "MLA decode graphs of the largest batch sizes read an evicted split-offset table: wrong / non-finite output"

NHEAD, HEAD_DIM, MAX_LEN, MGC = 2, 4, 8, 2
CU_NUM, OVERHEAD, MAX_SPLITS = 4, 1.0, 4     # get_cu_num(), 84.1, 16 upstream, scaled to the toy
LRU_MAXSIZE = 4                              # functools.lru_cache's default 128, scaled to 6 capture sizes
CAPTURE_BS = (6, 5, 4, 3, 2, 1)              # captured largest first, as the graph runners do
MAX_BS = CAPTURE_BS[0]


def _split_offset_table(bs, num_kv_splits, device):
    """``torch.arange(0, (bs+1)*num_kv_splits, num_kv_splits, dtype=torch.int)`` (in an allocation of its
    own on CUDA, so that a freed table is unmapped by ``empty_cache`` and the replay faults)."""
    table = torch.zeros(max(own_segment_elems(device), bs + 1), dtype=torch.int, device=device)[: bs + 1]
    table.copy_(torch.arange(0, (bs + 1) * num_kv_splits, num_kv_splits, dtype=torch.int, device=device))
    return table


def _split_count(num_kv_splits, bs, total_kv, nhead, max_seqlen_q):
    """The split-count search of ``get_meta_param`` (occupancy x HBM-overhead heuristic)."""
    if num_kv_splits is None:
        avg_kv = total_kv / bs
        tmp = [(bs * i / ((bs * i + CU_NUM - 1) // CU_NUM * CU_NUM) * avg_kv / (avg_kv + OVERHEAD * i), i)
               for i in range(1, MAX_SPLITS + 1)]
        num_kv_splits = max(tmp, key=lambda x: x[0])[1]
    return num_kv_splits


@functools.lru_cache(maxsize=LRU_MAXSIZE)
def get_meta_param(num_kv_splits, bs, total_kv, nhead, max_seqlen_q, device):
    """Before the fix: the cache owns the device table it returns, and evicts it."""
    num_kv_splits = _split_count(num_kv_splits, bs, total_kv, nhead, max_seqlen_q)
    num_kv_splits_indptr = _split_offset_table(bs, num_kv_splits, device)
    return num_kv_splits, num_kv_splits_indptr


_pick_num_kv_splits = functools.lru_cache(maxsize=LRU_MAXSIZE)(_split_count)
_num_kv_splits_indptr_cache: dict = {}


def _get_num_kv_splits_indptr(bs, num_kv_splits, device):
    key = (bs, num_kv_splits, str(device))
    indptr = _num_kv_splits_indptr_cache.get(key)
    if indptr is None:
        indptr = _num_kv_splits_indptr_cache[key] = _split_offset_table(bs, num_kv_splits, device)
    return indptr


def get_meta_param_fixed(num_kv_splits, bs, total_kv, nhead, max_seqlen_q, device):
    """After the fix: the pure search stays cached; the table comes from a dict that never evicts."""
    num_kv_splits = _pick_num_kv_splits(num_kv_splits, bs, total_kv, nhead, max_seqlen_q)
    return num_kv_splits, _get_num_kv_splits_indptr(bs, num_kv_splits, device)


def reset_caches():
    get_meta_param.cache_clear()
    _pick_num_kv_splits.cache_clear()
    _num_kv_splits_indptr_cache.clear()


def mla_decode_fwd(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, max_seqlen_q, variant):
    """Non-persistent split-KV MLA decode: stage 1 per (sequence, split), stage 2 merges the splits."""
    bs, total_kv = qo_indptr.shape[0] - 1, kv_indices.shape[0]
    meta = get_meta_param if variant == "bug" else get_meta_param_fixed
    num_kv_splits, num_kv_splits_indptr = meta(None, bs, total_kv, NHEAD, max_seqlen_q, str(q.device))
    # mla_decode_stage1_asm_fwd: sequence b's splits are num_kv_splits_indptr[b] .. [b+1]
    kv_len = kv_indptr[1:] - kv_indptr[:-1]
    t = torch.arange(MAX_LEN, device=q.device)
    slots = kv_indices[(kv_indptr[:-1, None] + t).clamp(max=total_kv - 1)]
    kv = kv_buffer[slots]                                                    # [bs, L, D] (k = v, MLA)
    valid = t[None, :] < kv_len[:, None]
    scores = torch.einsum("bhd,bld->bhl", q, kv) * HEAD_DIM ** -0.5
    splits = num_kv_splits_indptr[1:] - num_kv_splits_indptr[:-1]
    num_valid = torch.minimum(splits.long(), (kv_len + MGC - 1) // MGC)      # as _fwd_kernel_stage2_asm
    chunk = (kv_len + num_valid - 1) // num_valid
    split_id = t[None, :] // chunk[:, None]
    logits = torch.zeros(bs, num_kv_splits, NHEAD, HEAD_DIM, device=q.device)
    attn_lse = torch.full((bs, num_kv_splits, NHEAD), float("-inf"), device=q.device)
    for j in range(num_kv_splits):
        mask = (valid & (split_id == j))[:, None, :]
        s = scores.masked_fill(~mask, float("-inf"))
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(s - m).masked_fill(~mask, 0.0)
        denom = p.sum(-1, keepdim=True)
        logits[:, j] = torch.einsum("bhl,bld->bhd", p, kv) / denom.clamp(min=1e-30)
        attn_lse[:, j] = torch.where(denom > 0, m + denom.log(), torch.full_like(m, float("-inf"))).squeeze(-1)
    # _fwd_kernel_stage2_asm: merge the first num_valid splits of each sequence
    use = (torch.arange(num_kv_splits, device=q.device)[None, :] < num_valid[:, None])[:, :, None]
    lse = attn_lse.masked_fill(~use, float("-inf"))
    e_max = lse.amax(1, keepdim=True)
    w = torch.exp(lse - e_max)
    o.copy_((w[..., None] * logits).sum(1) / w.sum(1)[..., None])
    return o


class CudaGraphRunner:
    """One decode graph per batch size, captured largest first into one pool (sglang/ATOM style)."""

    def __init__(self, kv_buffer, device, variant):
        self.kv_buffer, self.device, self.variant = kv_buffer, device, variant
        self.q = torch.zeros(MAX_BS, NHEAD, HEAD_DIM, device=device)
        self.qo_indptr = torch.arange(MAX_BS + 1, device=device)
        self.kv_indptr = torch.arange(MAX_BS + 1, device=device)            # capture: one token each
        self.kv_indices = torch.zeros(MAX_BS * MAX_LEN, dtype=torch.long, device=device)
        self.graphs = {}
        pool = graph_pool_handle(device)
        for bs in CAPTURE_BS:
            self.graphs[bs] = capture(
                lambda bs=bs: self.forward(bs), device=device, pool=pool, name=f"decode bs {bs}",
                static={"q": self.q, "kv_indptr": self.kv_indptr, "kv_indices": self.kv_indices},
                state={"kv_buffer": kv_buffer}, owner="CudaGraphRunner (aiter MLA decode)")

    def forward(self, bs):
        o = torch.empty(bs, NHEAD, HEAD_DIM, device=self.device)
        return mla_decode_fwd(self.q[:bs], self.kv_buffer, o, self.qo_indptr[:bs + 1], self.kv_indptr[:bs + 1],
                              self.kv_indices, 1, self.variant)

    def replay(self, q, kv_indptr, kv_indices):
        bs = q.shape[0]
        self.q[:bs].copy_(q)
        self.kv_indptr[:bs + 1].copy_(kv_indptr)
        self.kv_indices[:kv_indices.shape[0]].copy_(kv_indices)
        g, out = self.graphs[bs]
        return replay(g, out)


def run(variant: str, device: str = "cpu"):
    gen = generator(686795)
    kv_buffer = randn(MAX_BS * MAX_LEN, HEAD_DIM, gen=gen, device=device)
    steps = []
    for bs in (3, 6, 2, 5, 1):
        lens = torch.randint(1, MAX_LEN + 1, (bs,), generator=gen)
        kv_indptr = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
        kv_indices = torch.randperm(MAX_BS * MAX_LEN, generator=gen)[: int(lens.sum())]
        steps.append((randn(bs, NHEAD, HEAD_DIM, gen=gen, device=device), kv_indptr.to(device),
                      kv_indices.to(device)))

    def eager():
        reset_caches()
        outs = []
        for q, kv_indptr, kv_indices in steps:
            o = torch.empty(q.shape[0], NHEAD, HEAD_DIM, device=device)
            qo_indptr = torch.arange(q.shape[0] + 1, device=device)
            outs.append(mla_decode_fwd(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, 1, variant).clone())
        return outs

    def served():
        reset_caches()
        runner = CudaGraphRunner(kv_buffer, device, variant)
        release_to_driver(device)                  # the serving process hands cached blocks back
        return [runner.replay(*step).clone() for step in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
