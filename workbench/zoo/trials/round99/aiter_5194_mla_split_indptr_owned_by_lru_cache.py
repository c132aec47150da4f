"""AITER's MLA decode takes its split table ``num_kv_splits_indptr`` from ``get_meta_param``, an ``lru_cache``'d function whose cache entry is the tensor's only owner: decode graphs captured on a cache hit keep its address, and once later eager calls with new ``total_kv`` evict the entry, the replay reads freed memory.

Upstream: https://github.com/ROCm/aiter/pull/5194 ("Cache the MLA split count, not the split indptr tensor", ROCm/aiter,
opened 2026-09-02 by peizhang56, open, not merged), fixing issue #5193 ("[Bug]: MLA get_meta_param returns an
lru_cache'd device tensor, corrupting the split indptr under CUDA graph replay", open); an earlier fix of the same
defect is #4587 ("[fix][mla] keep get_meta_param's split-offset table alive for captured CUDA graphs", open). Read: the
descriptions of #5194, #5193 and #4587 (the defect, its history through #322/#1233/#1390/#1445, the symptom, the
"capture one single-call decode graph per bucket ... replay the largest bucket (inserted first, evicted first)"
regression test), and ``aiter/mla.py`` at main e404860 (2026-08-22): ``get_meta_param`` (``@functools.lru_cache``,
default maxsize 128), the non-persistent branch of ``mla_decode_fwd`` and ``_fwd_kernel_stage2_asm``. The PR's diff was
not available: the fix below follows its "Technical Details" (``_get_num_kv_splits()`` keeps the ``lru_cache``; the
indptr is built per call).
Symptom: ROCm serving stacks (vLLM's AITER MLA backend, FULL HIP/CUDA graphs for decode) replaying a decode graph after
enough other decode shapes went through ``mla_decode_fwd`` eagerly: MLA decode returns non-finite logits / attn_lse from
finite inputs, or garbage, because the split table it reads was recycled.
Mechanism: ``get_meta_param(num_kv_splits, bs, total_kv, nhead, max_seqlen_q, dtype)`` picks the split count and returns
``torch.arange(0, (bs + 1) * num_kv_splits, num_kv_splits)``, a device tensor owned only by the ``lru_cache`` entry. The
runner's warmup fills the entry, the capture hits it, so the graph records the tensor's address with no kernel that
produces it. Replays run no host code and never touch the entry again, while every eager call with a new ``total_kv``
(it changes almost every step) adds an entry: after 128 of them the captured entry, the least recently used, is evicted
and its tensor freed; the graph's stage-1 and stage-2 kernels still read it.
Doctor: dangling-reference, at ``get_meta_param``: the decode graph reads memory it does not own, whose only owner, the
cache of ``get_meta_param``, releases it (the eviction happens in the ``lru_cache`` call ``get_meta_param`` makes).
Fix (upstream): cache only the host-side split count (``_get_num_kv_splits``, still ``lru_cache``'d) and build the indptr
on every call; inside a capture it is then allocated, and produced by a kernel, in the graph's own pool.
Modelled: ``get_meta_param`` with its split-count search as upstream (non-fp8 path: the fp8 block cap is left out); under
``_variant == "bug"`` it returns the upstream function's result through its ``lru_cache`` (default maxsize 128), kept in
``_get_meta_param_cached``, under ``"fix"`` the cached ``_get_num_kv_splits`` plus a per-call ``torch.arange``; the
non-persistent branch of ``mla_decode_fwd`` (``bs``, ``total_kv``, ``mgc``, ``MAYBE_FINAL_OUT``,
``logits``/``attn_lse``, stage 1, stage 2). Stand-ins: ``get_cu_num()`` is 16 (an MI300X has 304 CUs; the batches here
are small); ``mla_decode_stage1_asm_fwd`` is dense torch attention over the gathered pages, split per request into the
count its indptr entry gives (``mgc``-rounded chunks), writing each split's output and LSE; ``_fwd_kernel_stage2_asm``
merges the first ``min(splits, cdiv(kv_len, mgc))`` splits by LSE, as the Triton kernel does; float64 stands in for
bf16/fp32; page size 1. vLLM side: one MLA decode layer (q/kv-latent projections, ``concat_and_cache_mla`` into the
paged cache, ``mla_decode_fwd``, output projection, residual) and a FULL-graph decode runner for batch sizes 8 and 4
(descending, shared pool) over static ``hidden_states``/``slot_mapping``/``qo_indptr``/``paged_kv_indptr``/
``paged_kv_indices`` (fixed ``bs * MAX_BLOCKS`` pages) buffers, the KV cache announced as state; a long request's
decode in mixed batches runs eagerly (as attention does between PIECEWISE pieces), its ``total_kv`` growing each step.
Workload: decode 4 requests (graph bs=4), 128 mixed steps that decode the long request eagerly (kv 100..227), decode 8
requests (graph bs=8), decode 4 requests again; against the same steps without graphs. The 128 eager calls add 128
cache entries; the 127th evicts bs=8's entry (captured first), the 128th bs=4's: in the bug variant the replay at the
mixed steps' end reads the freed split table and the CPU emulation raises IllegalMemoryAccess (on a GPU: garbage or
non-finite output once the block is reused); with 126 mixed steps nothing is evicted and the bug variant equals eager.
The fix equals eager (max error 1.8e-15: the graphs' split counts come from their fixed ``total_kv``).
"""
from __future__ import annotations

import functools
import math

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/ROCm/aiter/pull/5194"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "get_meta_param"
SYMPTOM = ("decode graphs captured on a get_meta_param cache hit keep the address of an lru_cache-owned split indptr; "
           "128 eager calls with new total_kv evict it and the replay reads freed memory")

HIDDEN, NHEAD, KV_LORA_RANK, ROPE_DIM = 32, 8, 16, 8
QK_HEAD_DIM, V_HEAD_DIM = KV_LORA_RANK + ROPE_DIM, KV_LORA_RANK
MAX_BLOCKS, NUM_REQUESTS = 30, 8            # pages per decode request in the graphs' paged_kv_indices
LONG_REQUEST_PAGES = 256
NUM_PAGES = 1 + NUM_REQUESTS * MAX_BLOCKS + LONG_REQUEST_PAGES
CAPTURE_SIZES = (8, 4)
MIXED_STEPS = 128
DTYPE = torch.float64

_variant = "bug"
_device = "cpu"


# --- aiter (stand-ins for the runtime queries and the asm stage-1 kernel) ----------------------------------------------

def get_cu_num() -> int:
    return 16


def get_gfx() -> str:
    return "gfx942"


def mla_decode_stage1_asm_fwd(q, kv_buffer, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, num_kv_splits_indptr,
                              max_seqlen_q, page_size, nhead_kv, sm_scale, logits, attn_lse, mgc):
    """Each request's KV in ``splits = indptr[b+1] - indptr[b]`` chunks of a multiple of ``mgc`` tokens; per split
    the attention output and its log-sum-exp (decode: one query token per request)."""
    kv = kv_buffer.view(-1, kv_buffer.shape[-1])[kv_indices.long()]                  # [total_kv, QK_HEAD_DIM]
    start, kv_len = kv_indptr[:-1], kv_indptr[1:] - kv_indptr[:-1]
    splits = num_kv_splits_indptr[1:] - num_kv_splits_indptr[:-1]
    chunk = (((kv_len + splits - 1) // splits + mgc - 1) // mgc * mgc).clamp(min=1)
    rel = torch.arange(kv.shape[0], device=kv.device)[None, :] - start[:, None]     # [bs, total_kv]
    in_seq = (rel >= 0) & (rel < kv_len[:, None])
    split_of = rel // chunk[:, None]
    split_id = torch.arange(logits.shape[1], device=kv.device)[None, :, None]               # [1, S, 1]
    mask = in_seq[:, None, :] & (split_of[:, None, :] == split_id) & (splits[:, None, None] > split_id)   # [bs, S, T]
    scores = torch.einsum("bhd,td->bht", q, kv) * sm_scale
    sc = scores[:, None].masked_fill(~mask[:, :, None, :], -math.inf)                       # [bs, S, H, T]
    m = sc.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(sc - m)
    denom = p.sum(-1, keepdim=True)
    logits.copy_((p @ kv[:, :V_HEAD_DIM]) / denom.clamp(min=1e-300))
    attn_lse.copy_(torch.where(denom > 0, m + torch.log(denom.clamp(min=1e-300)), torch.full_like(m, -math.inf)))


def _fwd_kernel_stage2_asm(Mid_O, Mid_lse, O, qo_indptr, kv_indptr, kv_last_page_lens, num_kv_splits_indptr,
                           page_size, MAYBE_FINAL_OUT, BATCH_NUM, Lv, mgc):
    """Merge each request's valid splits by their LSE (the Triton kernel's loop over ``num_valid_kv_splits``)."""
    cur_split_start, cur_split_end = num_kv_splits_indptr[:BATCH_NUM], num_kv_splits_indptr[1:BATCH_NUM + 1]
    cur_kv_seq_len = kv_indptr[1:BATCH_NUM + 1] - kv_indptr[:BATCH_NUM]
    num_valid_kv_splits = torch.minimum(cur_split_end - cur_split_start, (cur_kv_seq_len + mgc - 1) // mgc)
    valid = torch.arange(Mid_O.shape[1], device=Mid_O.device)[None, :] < num_valid_kv_splits[:, None]   # [bs, S]
    tlogic = Mid_lse[..., 0].masked_fill(~valid[..., None], -math.inf)                                  # [bs, S, H]
    e_max = tlogic.amax(1, keepdim=True)
    exp_logic = torch.exp(tlogic - e_max)
    tv = torch.where(valid[..., None, None], Mid_O, torch.zeros_like(Mid_O))
    O.copy_((exp_logic[..., None] * tv).sum(1) / exp_logic.sum(1)[..., None])


# --- aiter/mla.py -----------------------------------------------------------------------------------------------------

@functools.lru_cache
def _get_num_kv_splits(num_kv_splits, bs, total_kv, nhead, max_seqlen_q, dtype, tg_factor=1, ignore_total_kv=0):
    """(The fix's cached part) V3's split-count search: pure host arithmetic."""
    if num_kv_splits is None:
        cu_num = get_cu_num()
        avg_kv = total_kv / bs
        overhead = 84.1
        is_gfx1250 = get_gfx() == "gfx1250"
        wg_per_split = 2 if nhead == 128 and is_gfx1250 else 1
        bs_occ = bs * max(tg_factor, wg_per_split)
        if ignore_total_kv:
            tmp = [(bs_occ * i / ((bs_occ * i + cu_num - 1) // cu_num * cu_num), i) for i in range(1, 17)]
        else:
            tmp = [(bs_occ * i / ((bs_occ * i + cu_num - 1) // cu_num * cu_num) * avg_kv / (avg_kv + overhead * i), i)
                   for i in range(1, 17)]
        num_kv_splits = max(tmp, key=lambda x: x[0])[1]
    return num_kv_splits                                    # (dtype is never fp8 here: no fp8 min-block cap)


@functools.lru_cache
def _get_meta_param_cached(num_kv_splits, bs, total_kv, nhead, max_seqlen_q, dtype, tg_factor=1, ignore_total_kv=0):
    """``get_meta_param`` as upstream has it: the whole function, device tensor included, under ``lru_cache``."""
    num_kv_splits = _get_num_kv_splits.__wrapped__(num_kv_splits, bs, total_kv, nhead, max_seqlen_q, dtype,
                                                   tg_factor, ignore_total_kv)
    num_kv_splits_indptr = torch.arange(0, (bs + 1) * num_kv_splits, num_kv_splits, dtype=torch.int, device=_device)
    return num_kv_splits, num_kv_splits_indptr


def get_meta_param(num_kv_splits, bs, total_kv, nhead, max_seqlen_q, dtype, tg_factor=1, ignore_total_kv=0):
    if _variant == "bug":
        # the cache entry is the indptr's only owner; evicting it frees the tensor a graph may have captured
        return _get_meta_param_cached(num_kv_splits, bs, total_kv, nhead, max_seqlen_q, dtype, tg_factor,
                                      ignore_total_kv)
    num_kv_splits = _get_num_kv_splits(num_kv_splits, bs, total_kv, nhead, max_seqlen_q, dtype, tg_factor,
                                       ignore_total_kv)
    num_kv_splits_indptr = torch.arange(0, (bs + 1) * num_kv_splits, num_kv_splits, dtype=torch.int, device=_device)
    return num_kv_splits, num_kv_splits_indptr


def mla_decode_fwd(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q, page_size=1,
                   nhead_kv=1, sm_scale=None, num_kv_splits=None, num_kv_splits_indptr=None, work_meta_data=None):
    _, _, _, qk_head_dim = kv_buffer.shape
    if sm_scale is None:
        sm_scale = 1.0 / (qk_head_dim ** 0.5)

    total_s, nhead, v_head_dim = o.shape
    bs = qo_indptr.shape[0] - 1
    total_kv = kv_indices.shape[0]

    persistent_mode = work_meta_data is not None
    if not persistent_mode:
        if num_kv_splits is None or num_kv_splits_indptr is None:
            num_kv_splits, num_kv_splits_indptr = get_meta_param(num_kv_splits, bs, total_kv, nhead, max_seqlen_q,
                                                                 q.dtype)
        mgc = 64 if nhead in [8, 16] and max_seqlen_q == 1 else 16
        MAYBE_FINAL_OUT = not (nhead in [8, 16] and max_seqlen_q == 1)

        logits = torch.empty((total_s, num_kv_splits, nhead, v_head_dim), dtype=q.dtype, device=q.device)
        attn_lse = torch.empty((total_s, num_kv_splits, nhead, 1), dtype=q.dtype, device=q.device)
        mla_decode_stage1_asm_fwd(q, kv_buffer, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens,
                                  num_kv_splits_indptr, max_seqlen_q, page_size, nhead_kv, sm_scale, logits, attn_lse,
                                  mgc)
        _fwd_kernel_stage2_asm(logits, attn_lse, o, qo_indptr, kv_indptr, kv_last_page_lens, num_kv_splits_indptr,
                               page_size, MAYBE_FINAL_OUT, BATCH_NUM=bs, Lv=v_head_dim, mgc=mgc)
    return o


# --- vllm (stand-ins: one MLA decode layer, its metadata, a FULL-graph decode runner) ----------------------------------

class AiterMLADecodeMetadata:
    def __init__(self, slot_mapping, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len):
        self.slot_mapping, self.qo_indptr = slot_mapping, qo_indptr
        self.paged_kv_indptr, self.paged_kv_indices = paged_kv_indptr, paged_kv_indices
        self.paged_kv_last_page_len = paged_kv_last_page_len


class DeepseekMLADecodeLayer:
    def __init__(self, device):
        gen = generator(5194)
        self.q_proj = randn(HIDDEN, NHEAD * QK_HEAD_DIM, gen=gen, device=device, scale=0.3).to(DTYPE)
        self.kv_a_proj = randn(HIDDEN, QK_HEAD_DIM, gen=gen, device=device, scale=0.3).to(DTYPE)
        self.o_proj = randn(NHEAD * V_HEAD_DIM, HIDDEN, gen=gen, device=device, scale=0.1).to(DTYPE)

    def forward(self, hidden_states, attn_metadata: AiterMLADecodeMetadata, kv_cache):
        n = hidden_states.shape[0]
        q = (hidden_states @ self.q_proj).view(n, NHEAD, QK_HEAD_DIM)
        kv_c_and_pe = hidden_states @ self.kv_a_proj
        kv_cache.view(-1, QK_HEAD_DIM).index_copy_(0, attn_metadata.slot_mapping, kv_c_and_pe)   # concat_and_cache_mla
        o = torch.empty(n, NHEAD, V_HEAD_DIM, dtype=DTYPE, device=hidden_states.device)
        mla_decode_fwd(q, kv_cache, o, attn_metadata.qo_indptr, attn_metadata.paged_kv_indptr,
                       attn_metadata.paged_kv_indices, attn_metadata.paged_kv_last_page_len, max_seqlen_q=1)
        return hidden_states + o.view(n, -1) @ self.o_proj


def eager_metadata(reqs, device) -> AiterMLADecodeMetadata:
    """Per request (first page, tokens already cached): slot of the new token and its pages, the new one included."""
    lens = [length + 1 for _, length in reqs]
    indptr = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32)
    indices = torch.cat([torch.arange(first, first + length, dtype=torch.int32) for (first, _), length in zip(reqs, lens)])
    return AiterMLADecodeMetadata(torch.tensor([first + length for first, length in reqs]).to(device),
                                  torch.arange(len(reqs) + 1, dtype=torch.int32).to(device), indptr.to(device),
                                  indices.to(device), torch.ones(len(reqs), dtype=torch.int32).to(device))


class ModelRunner:
    def __init__(self, device, use_cuda_graph):
        _get_meta_param_cached.cache_clear()                # a fresh process
        _get_num_kv_splits.cache_clear()
        self.device, self.use_cuda_graph = device, use_cuda_graph
        self.layer = DeepseekMLADecodeLayer(device)
        self.kv_cache = randn(NUM_PAGES, 1, 1, QK_HEAD_DIM, gen=generator(51940), device=device).to(DTYPE)
        self.kv_cache[0].zero_()                            # page 0: the null page the dummy batches point at
        self.graphs = {}
        if use_cuda_graph:
            self.capture_model()

    def capture_model(self):
        max_bs = max(CAPTURE_SIZES)
        self.hidden_states = torch.zeros(max_bs, HIDDEN, dtype=DTYPE, device=self.device)
        self.slot_mapping = torch.zeros(max_bs, dtype=torch.long, device=self.device)
        self.qo_indptr = torch.arange(max_bs + 1, dtype=torch.int32, device=self.device)
        self.paged_kv_indptr = torch.arange(max_bs + 1, dtype=torch.int32, device=self.device)
        self.paged_kv_indices = torch.zeros(max_bs * MAX_BLOCKS, dtype=torch.int32, device=self.device)
        self.paged_kv_last_page_len = torch.ones(max_bs, dtype=torch.int32, device=self.device)
        pool = graph_pool_handle(self.device)
        for bs in sorted(CAPTURE_SIZES, reverse=True):
            meta = AiterMLADecodeMetadata(self.slot_mapping[:bs], self.qo_indptr[:bs + 1],
                                          self.paged_kv_indptr[:bs + 1], self.paged_kv_indices[:bs * MAX_BLOCKS],
                                          self.paged_kv_last_page_len[:bs])
            self.graphs[bs] = capture(lambda bs=bs, meta=meta: self.layer.forward(self.hidden_states[:bs], meta,
                                                                                  self.kv_cache),
                                      device=self.device, pool=pool, warmups=1, name=f"FULL decode bs={bs}",
                                      owner="ModelRunner", state={"kv_cache": self.kv_cache},
                                      static={"hidden_states": self.hidden_states, "slot_mapping": self.slot_mapping,
                                              "qo_indptr": self.qo_indptr, "paged_kv_indptr": self.paged_kv_indptr,
                                              "paged_kv_indices": self.paged_kv_indices,
                                              "paged_kv_last_page_len": self.paged_kv_last_page_len})

    def execute_model(self, hidden_states, reqs, full_graph: bool):
        bs = len(reqs)
        if not (self.use_cuda_graph and full_graph and bs in self.graphs):
            return self.layer.forward(hidden_states, eager_metadata(reqs, self.device), self.kv_cache)
        meta = eager_metadata(reqs, self.device)           # the same metadata, copied into the static buffers
        total = meta.paged_kv_indices.shape[0]
        self.hidden_states[:bs].copy_(hidden_states)
        self.slot_mapping[:bs].copy_(meta.slot_mapping)
        self.qo_indptr[:bs + 1].copy_(meta.qo_indptr)
        self.paged_kv_indptr[:bs + 1].copy_(meta.paged_kv_indptr)
        self.paged_kv_indices[:total].copy_(meta.paged_kv_indices)
        self.paged_kv_indices[total:bs * MAX_BLOCKS].zero_()   # the unused tail: the null page
        self.paged_kv_last_page_len[:bs].copy_(meta.paged_kv_last_page_len)
        g, out = self.graphs[bs]
        return replay(g, out).clone()


# --- the workload -----------------------------------------------------------------------------------------------------

INITIAL_LENS = [5, 12, 20, 24, 3, 16, 9, 25]
LONG_REQUEST_LEN = 100


def run(variant: str, device: str = "cpu"):
    global _variant, _device
    _variant, _device = variant, device
    gen = generator(51941)
    steps = ([("decode", 4)] + [("mixed", 1)] * MIXED_STEPS + [("decode", 8), ("decode", 4)])
    inputs = [randn(n, HIDDEN, gen=gen, device=device).to(DTYPE) for _, n in steps]

    def serve(use_cuda_graph):
        runner = ModelRunner(device, use_cuda_graph)
        lens = list(INITIAL_LENS) + [LONG_REQUEST_LEN]
        first_page = [1 + i * MAX_BLOCKS for i in range(NUM_REQUESTS + 1)]
        outs = []
        for (kind, n), x in zip(steps, inputs):
            ids = list(range(n)) if kind == "decode" else [NUM_REQUESTS]        # the long request
            reqs = [(first_page[i], lens[i]) for i in ids]
            outs.append(runner.execute_model(x, reqs, full_graph=kind == "decode"))
            for i in ids:
                lens[i] += 1
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
