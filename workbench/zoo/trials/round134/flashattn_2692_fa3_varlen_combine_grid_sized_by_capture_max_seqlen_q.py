"""FlashAttention-3 (hopper) varlen forward with split-KV under a FULL CUDA graph that serves mixed prefill+decode
batches (torchtitan's RL generator on vLLM): ``mha_fwd`` takes the caller's ``max_seqlen_q`` (a Python int) as
``params.seqlen_q``, and ``run_flash_fwd_combine`` sizes the combine kernel's grid from it, ``ceil_div(seqlen_q * h,
kBlockM)`` blocks per request. A graph captured on a decode-shaped dummy batch (``max_query_len`` 1) keeps that grid
for ever; when a replayed step holds a prefill chunk whose ``query_len * h`` exceeds the blocks baked in, the combine
kernel never visits the chunk's later rows, and the attention output keeps whatever its pool block held (uninitialised
memory, another temporary's or an earlier replay's values): wrong logits (NaN, upstream) and a poisoned KV cache.
Eagerly the int is each step's own maximum, so every row is combined. The fix gives the varlen combine kernel a tile
scheduler whose ``LINEARIZE_M_AND_BATCH`` grid is bounded by ``total_q`` (a shape) and maps tiles to requests from
``cu_seqlens_q`` on the device.

Upstream: https://github.com/Dao-AILab/flash-attention/pull/2692 ("add linearize scheduling to combine kernel for full
cudagraph", Dao-AILab/flash-attention, by liangel-02 (Angel Li), opened 2026-07-01, squash-merged 2026-07-27 as commit
14c377950125c70b7a9dabf9c561fca53715ac7d), read in a mirror of the repository. Read: the squash commit's whole diff
(``hopper/flash_fwd_combine_launch_template.h``: ``run_flash_fwd_combine`` now builds ``SchedulerArguments`` and takes
its grid from ``CombineKernel::TileScheduler::get_grid_shape``; ``hopper/flash_fwd_combine_kernel.h``: ``BlockCoord``,
``SchedulerArguments``, ``StaticTileScheduler``, ``StaticVarlenTileScheduler`` with ``choose_scheduling_algo`` (the
50% density heuristic), ``get_grid_shape``, ``get_block_coord_linearized_m_and_batch``, and the kernel's new early
exits; ``hopper/utils.h`` warp helpers; the new ``test_flash_attn_varlen_combine_linearize``); the PR branch's first
commit 565aa200 ("fix combine kernel bug for full cudagraph": ``num_blocks_m = ceil_div((Varlen ? total_q :
seqlen_q) * h, kBlockM)``, and its test ``test_varlen_combine_cudagraph_stale_seqlen``, which captures with
``max_seqlen_q=1``, repacks ``cu_seqlens_q`` so one request holds every query, replays, and asserts "combine left
output rows uninitialized" is false; that test is not in the squash); at the parent (``14c37795^``):
``flash_fwd_combine_launch_template.h`` whole (``run_flash_fwd_combine``, ``run_mha_fwd_combine_``'s ``kBlockM``
choice), ``flash_fwd_combine_kernel.h``'s ``FlashAttnFwdCombine`` (arguments, ``operator()`` steps 1-6: the per-block
row range, ``seqlen_divmod_dynamic`` row-to-(token, head) split, the LSE combine) and ``hopper/flash_api.cpp``
(``mha_fwd``: ``seqlen_q = max_seqlen_q``, ``total_q = q.size(0)``, ``batch_size = cu_seqlens_q.size(0) - 1``, the
``out`` / ``out_accum`` / ``softmax_lse_accum`` allocations, the ``run_mha_fwd`` then ``run_mha_fwd_combine`` calls;
``run_mha_fwd_combine``'s ``dv <= 64`` dispatch; ``get_num_splits``). The PR's description (as stored): "adopt the
improved vllm linearized combine kernel so that we can set max_seqlen_q = num_tokens for full cudagraph capture to
prevent the case where max_seqlen_q at runtime > max_seqlen_q at capture but preserve performance". Also read, in
pytorch/torchtitan: the diff of #3893 ("enable varlen full cudagraph", commit a6948f508, 2026-08-07: makes FULL the
default mode and reports ``AttentionCGSupport.ALWAYS`` again, now that FA3 is fixed) and, at its parent,
``torchtitan/experiments/rl/models/attention.py`` (``PyTorchVarlenAttentionImpl.forward``: ``cu_seqlens_q =
attn_metadata.query_start_loc``, ``seqused_k = attn_metadata.seq_lens``, ``max_seqlen_q =
attn_metadata.max_query_len``, ``varlen_attn_out(output[:num_actual_tokens], query[:num_actual_tokens], key_cache,
value_cache, ...)``); excerpts of the stored threads of torchtitan #3668, #3709, #3685 and #3776 (the symptom).
Not read: the PR's review beyond the excerpts above; the hopper forward kernel (``run_mha_fwd``'s split-KV mainloop,
its varlen tile scheduler and ``prepare_varlen_num_blocks``) beyond their call sites; PyTorch's
``torch.nn.attention.varlen`` binding; vLLM's ``FlashAttentionMetadataBuilder`` and ``_dummy_run`` (what
``max_query_len`` a FULL capture records is recalled, not read: a dummy batch of ``min(num_tokens, max_num_seqs)``
requests of one token, i.e. 1, as in the PR branch's test); vLLM's fork's combine kernel the PR ports.
Symptom: torchtitan #3668: with ``cudagraph_mode="full"`` "the model emits random/degenerate tokens (e.g. repeated
"locklock...")" and "the generator returns NaN logprobs"; #3709: "FULL -> NaN logprobs + degenerate / random
generation ... The varlen layout (cu_seqlens / offsets) differs per step, so replaying the captured graph reads stale
metadata". Eager or FULL_DECODE_ONLY was correct.
Mechanism: the combine kernel's grid is ``(ceil_div(params.seqlen_q * params.h, kBlockM), ceil_div(dv, kBlockK),
params.b)``; block (m, ., z) combines rows ``idx`` in ``[m * kBlockM, (m + 1) * kBlockM)`` of request z, ``idx = head *
seqlen_z + token`` with ``seqlen_z`` read from ``cu_seqlens_q`` on the device. ``params.seqlen_q`` is the caller's
``max_seqlen_q``: host data, computed into the launch once, at capture. A replay whose request z has ``seqlen_z * h >
num_blocks_m * kBlockM`` leaves rows past the baked blocks (later tokens of the later heads) uncombined: the split
partials are right, the output rows are never written.
Doctor: host-work-frozen, at run_flash_fwd_combine. The defect is host work inside the captured region (the grid
size computed from the Python int ``max_seqlen_q``) that ran once at capture and is replayed with its capture-time
value; ``run_flash_fwd_combine`` is where that grid is computed and is the function the fix changes (the grid comes
from the tile scheduler, bounded by ``total_q`` and ``b``, shapes of the graph). No input is stale: ``cu_seqlens_q``,
``seq_lens`` and the caches are refreshed every step.
Fix (upstream): ``run_flash_fwd_combine`` builds ``SchedulerArguments`` and launches ``TileScheduler::get_grid_shape``;
for varlen, ``StaticVarlenTileScheduler.choose_scheduling_algo`` picks ``STANDARD`` (the old grid) when
``2 * ceil_div(total_q, kBlockM) >= b * ceil_div(seqlen_q, kBlockM)``, else ``LINEARIZE_M_AND_BATCH``: a 1-D grid of
``ceil_div(total_q * h, kBlockM) + b`` tiles, each mapped to ``(block_m, bidb)`` by a prefix sum of the requests'
``ceil_div(seqlen * h, kBlockM)`` read on the device; the kernel returns for ``bidb >= b`` and for ``m_block`` past the
request's rows. A capture with ``max_seqlen_q`` 1 over many one-token dummy requests is sparse, so it chooses
LINEARIZE, whose grid covers any layout of ``total_q`` tokens.
Modelled: ``PyTorchVarlenAttentionImpl.forward`` (torchtitan; argument plumbing only), ``varlen_attn_out`` (torch's
entry, a pass-through here), ``mha_fwd`` (``batch_size``, ``seqlen_q``, ``total_q``, allocations, the two launches),
``Flash_fwd_params`` (the fields used), ``run_mha_fwd`` (the split-KV mainloop, a stand-in), ``run_mha_fwd_combine``
(the ``dv <= 64`` dispatch to ``kBlockK`` 64 and ``run_mha_fwd_combine_``'s ``kBlockM``), ``run_flash_fwd_combine``,
``FlashAttnFwdCombine`` (``__call__``: which rows a grid's blocks cover, the LSE-weighted combine, the writes of O and
LSE), ``SchedulerArguments``, ``StaticVarlenTileScheduler`` (``choose_scheduling_algo``, ``get_grid_shape``, and
``get_block_coord`` as the inverse row-to-tile map), ``FlashAttentionMetadata``'s fields; a vLLM-like runner
(``GPUModelRunner``: ``_dummy_run``/``capture_model``, ``execute_model``, ``_prepare_inputs``; not read, see above).
Stand-ins: float64 everywhere (bf16 in, fp32 partials upstream); ``num_splits`` fixed at 2 (upstream FA3 picks it with
``num_splits_heuristic`` and a per-request dynamic count, not modelled; the regression tests force 4); the split-KV
mainloop computes every token row vectorised (upstream tiles rows per request; padded tokens' partials are never
combined either way); the combine kernel is vectorised: a row is written iff some block of the launched grid covers it,
else the output keeps its bytes, which is what the uncovered CUDA rows do; the KV cache is one block of
``MAX_MODEL_LEN`` slots per request (``page_size`` = ``MAX_MODEL_LEN``), padded tokens' K/V land in a trash slot
(vLLM's ``PAD_SLOT_ID`` skip); ``mha_fwd``'s ``seqlen_q == 1`` window/causal shortcuts are not modelled (with head dim
128 and a paged cache, the generator's Qwen3 setting, ``is_causal`` is kept; what torch's binding passes was not read);
a two-layer decoder (width 16, 2 heads of 8, learned positions, SiLU MLP) with greedy sampling, whose projections are
computed one row at a time (``linear``) so that a token's numbers do not depend on how many padded rows a graph carries
(a CPU GEMM's summation order depends on the row count); GQA, softcap, PDL and the semaphore reset are left out.
Workload: FULL graphs for 4 and 16 tokens (b = 4 and 16 one-token dummy requests, ``max_query_len`` 1), captured in one
pool. Step 0: prefill A (5 tokens) and B (4 tokens), the 16-token graph; step 1: decode A and B (4-token graph); step 2:
decode A and B and prefill C (10 tokens): 12 tokens, the 16-token graph, where C's 10 x 2 = 20 rows exceed the one
baked block of 16; steps 3-4: decode A, B, C. Outputs per step: the sampled rows' logits and the sampled token ids.
Measured: bug: misbehaves (max |graph - eager| = 28): steps 0 and 1 equal eager; at step 2 head 1 of C's tokens 6-9
is never combined (20 rows against one baked block of 16) and keeps what its pool block held (on the CPU emulation
finite values, not NaN: the block had been written since capture; not traced further), so C's logits differ by up to
16.0; the layer-1 keys and values of C's tokens 6-9 are wrong in the cache (the only cache slots that differ), C's
logits differ by 1.2e-4 at step 3 and 4.17 at step 4, where its sampled token is 28 against eager's 0 (the 28); A's and
B's rows equal eager's throughout. Fix: equals eager (max |graph - eager| = 0). About 3 s per variant on the CPU.
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/Dao-AILab/flash-attention/pull/2692"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "run_flash_fwd_combine"
SYMPTOM = ("FA3 varlen split-KV under a FULL CUDA graph: the combine kernel's grid is sized at capture from the "
           "decode-shaped max_seqlen_q, so a replayed step with a long prefill chunk leaves its later rows uncombined "
           "and generation returns NaN logprobs and degenerate tokens")

VOCAB, HIDDEN, NUM_HEADS, HEAD_DIM, NUM_LAYERS = 32, 16, 2, 8, 2
MAX_NUM_SEQS, MAX_MODEL_LEN, CUDAGRAPH_CAPTURE_SIZES = 16, 24, [4, 16]
NUM_SPLITS, K_BLOCK_N = 2, 4               # stand-ins: a fixed split count; the mainloop's key-block width
PAD_SLOT_ID = -1
TRASH_SLOT = MAX_NUM_SEQS * MAX_MODEL_LEN
DTYPE = torch.float64

_variant = "bug"


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# --- hopper/flash_api.cpp and the combine kernel (reduced) ------------------------------------------------------------

@dataclasses.dataclass
class Flash_fwd_params:
    b: int                      # batch_size = cu_seqlens_q.size(0) - 1
    seqlen_q: int               # max_seqlen_q: a host int
    total_q: int                # q.size(0)
    h: int
    h_k: int
    dv: int
    num_splits: int
    softmax_scale: float
    q: torch.Tensor
    k: torch.Tensor             # key cache [slots, h_k, d]
    v: torch.Tensor
    o: torch.Tensor             # out [total_q, h, dv]
    softmax_lse: torch.Tensor   # [h, total_q]
    cu_seqlens_q: torch.Tensor
    seqused_k: torch.Tensor
    page_table: torch.Tensor    # [b, 1] here: one page of MAX_MODEL_LEN slots per request
    oaccum: torch.Tensor | None = None          # [num_splits, h, total_q, dv]
    softmax_lseaccum: torch.Tensor | None = None  # [num_splits, h, total_q]


def _row_layout(params: Flash_fwd_params):
    """For each token row: its request (from ``cu_seqlens_q`` on the device), its index in the request, and the
    request's query length (``SeqlenInfo``). Tokens past ``cu_seqlens_q[-1]`` (padding) belong to no request."""
    cu = params.cu_seqlens_q.long()
    t = torch.arange(params.total_q, device=cu.device)
    bidb = torch.searchsorted(cu[1:], t, right=True)
    real = bidb < params.b
    bidb = bidb.clamp(max=params.b - 1)
    return bidb, t - cu[bidb], cu[bidb + 1] - cu[bidb], real


def run_mha_fwd(params: Flash_fwd_params) -> None:
    """The split-KV mainloop (stand-in): each split's partial O and LSE for every row, causal bottom-right within
    its request's keys; keys are split per request from ``seqused_k`` on the device."""
    bidb, m_idx, seqlen_q_b, _ = _row_layout(params)
    seqlen_k_b = params.seqused_k.long()[bidb]
    q_pos = seqlen_k_b - seqlen_q_b + m_idx
    j = torch.arange(MAX_MODEL_LEN, device=q_pos.device)
    slots = params.page_table.long()[bidb, 0][:, None] * MAX_MODEL_LEN + j[None, :]
    scores = torch.einsum("thd,tlhd->thl", params.q, params.k[slots]) * params.softmax_scale
    valid = (j[None, :] <= q_pos[:, None]) & (j[None, :] < seqlen_k_b[:, None])
    n_blocks_per_split = (ceil_div_t(seqlen_k_b, K_BLOCK_N) + params.num_splits - 1) // params.num_splits
    split_of_key = (j[None, :] // K_BLOCK_N) // n_blocks_per_split.clamp(min=1)[:, None]
    for s in range(params.num_splits):
        mask = (valid & (split_of_key == s))[:, None, :]
        sc = scores.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(sc, dim=-1)
        p = torch.where(mask, torch.exp(sc - lse[..., None]), torch.zeros_like(sc))
        params.oaccum[s].copy_(torch.einsum("thl,tlhd->htd", p, params.v[slots]))
        params.softmax_lseaccum[s].copy_(lse.transpose(0, 1))


def ceil_div_t(a: torch.Tensor, b: int) -> torch.Tensor:
    return (a + b - 1) // b


@dataclasses.dataclass
class SchedulerArguments:
    b: int
    seqlen_q: int
    total_q: int
    num_heads: int
    num_heads_kv: int
    dv: int
    cu_seqlens_q: torch.Tensor


class StaticVarlenTileScheduler:
    """flash_fwd_combine_kernel.h after the fix (varlen): STANDARD or LINEARIZE_M_AND_BATCH."""
    STANDARD, LINEARIZE_M_AND_BATCH = "STANDARD", "LINEARIZE_M_AND_BATCH"

    def __init__(self, kBlockM: int, kBlockK: int):
        self.kBlockM, self.kBlockK = kBlockM, kBlockK

    def choose_scheduling_algo(self, args: SchedulerArguments) -> str:
        lower_bound_on_non_empty_tiles = ceil_div(args.total_q, self.kBlockM)
        grid_size = args.b * ceil_div(args.seqlen_q, self.kBlockM)
        return self.STANDARD if 2 * lower_bound_on_non_empty_tiles >= grid_size else self.LINEARIZE_M_AND_BATCH

    def to_underlying_arguments(self, args: SchedulerArguments) -> dict:
        return {"b": args.b, "num_heads": args.num_heads, "cu_seqlens_q": args.cu_seqlens_q,
                "algo": self.choose_scheduling_algo(args)}

    def get_grid_shape(self, args: SchedulerArguments) -> tuple:
        num_blocks_k = ceil_div(args.dv, self.kBlockK)
        if self.choose_scheduling_algo(args) == self.STANDARD:
            return ceil_div(args.seqlen_q * args.num_heads, self.kBlockM), num_blocks_k, args.b
        # rough worst case upper bound on the number of blocks required
        return ceil_div(args.total_q * args.num_heads, self.kBlockM) + args.b, num_blocks_k, 1

    def get_block_coord(self, sched: dict, grid, bidb, block_m):
        """Whether the launched grid has a block at (block_m, bidb): the inverse of the upstream tile -> coord map
        (LINEARIZE: tile id = the prefix sum of earlier requests' ``ceil_div(seqlen * h, kBlockM)`` + block_m)."""
        if sched["algo"] == self.STANDARD:
            return (block_m < grid[0]) & (bidb < grid[2])
        cu = sched["cu_seqlens_q"].long()
        num_m_blocks = ceil_div_t((cu[1:] - cu[:-1]) * sched["num_heads"], self.kBlockM)
        first_tile = torch.cumsum(num_m_blocks, 0) - num_m_blocks
        return first_tile[bidb] + block_m < grid[0]


class FlashAttnFwdCombine:
    def __init__(self, kBlockM: int, kBlockK: int):
        self.kBlockM, self.kBlockK = kBlockM, kBlockK

    def __call__(self, params: Flash_fwd_params, grid, covered_by) -> None:
        """Every block of ``grid`` combines its ``kBlockM`` rows ``idx = head * seqlen + token`` of its request; a row
        no block covers is not written (``out`` keeps its bytes)."""
        bidb, m_idx, seqlen, real = _row_layout(params)
        head = torch.arange(params.h, device=bidb.device)
        idx = head[None, :] * seqlen[:, None] + m_idx[:, None]                    # [total_q, h]
        covered = real[:, None] & covered_by(grid, bidb[:, None], idx // self.kBlockM)
        lse_p = params.softmax_lseaccum                                           # [splits, h, total_q]
        lse_max = lse_p.max(dim=0).values
        lse_max_cur = torch.where(lse_max == float("-inf"), torch.zeros_like(lse_max), lse_max)
        scale = torch.exp(lse_p - lse_max_cur)
        lse_sum = scale.sum(dim=0)
        lse = torch.log(lse_sum) + lse_max
        inv_sum = torch.where((lse_sum == 0) | lse_sum.isnan(), torch.zeros_like(lse_sum), 1.0 / lse_sum)
        o = (scale * inv_sum)[..., None].mul(params.oaccum).sum(dim=0)          # [h, total_q, dv]
        params.o.copy_(torch.where(covered[..., None], o.transpose(0, 1), params.o))
        params.softmax_lse.copy_(torch.where(covered.transpose(0, 1), lse, params.softmax_lse))


def run_flash_fwd_combine(params: Flash_fwd_params, kBlockM: int, kBlockK: int) -> None:
    kernel = FlashAttnFwdCombine(kBlockM, kBlockK)
    if _variant == "bug":
        num_blocks_k = ceil_div(params.dv, kBlockK)
        num_blocks_m = ceil_div(params.seqlen_q * params.h, kBlockM)     # seqlen_q: the caller's max_seqlen_q
        grid_m = (num_blocks_m, num_blocks_k, params.b)
        kernel(params, grid_m, lambda grid, bidb, block_m: (block_m < grid[0]) & (bidb < grid[2]))
        return
    scheduler = StaticVarlenTileScheduler(kBlockM, kBlockK)
    scheduler_args = SchedulerArguments(params.b, params.seqlen_q, params.total_q, params.h, params.h_k, params.dv,
                                        params.cu_seqlens_q)
    sched = scheduler.to_underlying_arguments(scheduler_args)
    grid_m = scheduler.get_grid_shape(scheduler_args)
    kernel(params, grid_m, lambda grid, bidb, block_m: scheduler.get_block_coord(sched, grid, bidb, block_m))


def run_mha_fwd_combine(params: Flash_fwd_params) -> None:
    kBlockK = 64 if params.dv <= 64 else 128
    kBlockM = 8 if kBlockK % 128 == 0 else (16 if kBlockK % 64 == 0 else 32)   # run_mha_fwd_combine_
    run_flash_fwd_combine(params, kBlockM, kBlockK)


def mha_fwd(q, k, v, out, cu_seqlens_q, max_seqlen_q: int, max_seqlen_k: int, page_table, seqused_k,
            softmax_scale: float, num_splits: int):
    batch_size = cu_seqlens_q.size(0) - 1
    seqlen_q = max_seqlen_q
    total_q, num_heads, head_size_v = q.size(0), q.size(-2), v.size(-1)
    softmax_lse = torch.empty(num_heads, total_q, dtype=DTYPE, device=q.device)
    params = Flash_fwd_params(batch_size, seqlen_q, total_q, num_heads, k.size(-2), head_size_v, num_splits,
                              softmax_scale, q, k, v, out, softmax_lse, cu_seqlens_q, seqused_k, page_table)
    if params.num_splits > 1:
        params.oaccum = torch.empty(num_splits, num_heads, total_q, head_size_v, dtype=DTYPE, device=q.device)
        params.softmax_lseaccum = torch.empty(num_splits, num_heads, total_q, dtype=DTYPE, device=q.device)
    run_mha_fwd(params)
    if params.num_splits > 1:
        run_mha_fwd_combine(params)
    return out, softmax_lse


def varlen_attn_out(out, query, key_cache, value_cache, cu_seqlens_q, cu_seqlens_k, max_q, max_k, *, scale,
                    block_table, seqused_k):
    """torch.nn.attention.varlen.varlen_attn_out with FA3 activated (stand-in: straight to ``mha_fwd``)."""
    return mha_fwd(query, key_cache, value_cache, out, cu_seqlens_q, max_q, max_k, block_table, seqused_k, scale,
                   NUM_SPLITS)[0]


# --- torchtitan/experiments/rl/models/attention.py and a small decoder ------------------------------------------------

@dataclasses.dataclass
class FlashAttentionMetadata:
    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor
    max_seq_len: int
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool = True


class PyTorchVarlenAttentionImpl:
    def __init__(self):
        self.scale = HEAD_DIM ** -0.5

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output):
        num_actual_tokens = attn_metadata.num_actual_tokens
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        cu_seqlens_q = attn_metadata.query_start_loc
        seqused_k = attn_metadata.seq_lens
        max_seqlen_q = attn_metadata.max_query_len
        max_seqlen_k = attn_metadata.max_seq_len
        return varlen_attn_out(output[:num_actual_tokens], query[:num_actual_tokens], key_cache, value_cache,
                               cu_seqlens_q, None, max_seqlen_q, max_seqlen_k, scale=self.scale,
                               block_table=attn_metadata.block_table, seqused_k=seqused_k)


def linear(x, w):
    """x @ w, one row at a time (stand-in): a token's numbers do not depend on how many rows the step carries."""
    return (x[:, :, None] * w).sum(dim=1)


class Decoder:
    def __init__(self, device, kv_caches):
        gen = generator(2692)
        r = lambda *s, scale=0.3: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)
        self.embed, self.pos_embed = r(VOCAB, HIDDEN, scale=1.0), r(MAX_MODEL_LEN, HIDDEN)
        self.lm_head = r(HIDDEN, VOCAB)
        self.layers = [{"qkv": r(HIDDEN, 3 * HIDDEN), "o": r(HIDDEN, HIDDEN), "up": r(HIDDEN, 2 * HIDDEN),
                        "down": r(2 * HIDDEN, HIDDEN), "kv_cache": kv_caches[i]} for i in range(NUM_LAYERS)]
        self.impl = PyTorchVarlenAttentionImpl()

    def forward(self, input_ids, positions, attn_metadata):
        n = input_ids.shape[0]
        h = self.embed[input_ids.long()] + self.pos_embed[positions.long()]
        slots = attn_metadata.slot_mapping.long()
        slots = torch.where(slots >= 0, slots, TRASH_SLOT)                     # PAD_SLOT_ID writes are skipped
        for layer in self.layers:
            q, k, v = linear(h, layer["qkv"]).view(n, 3, NUM_HEADS, HEAD_DIM).unbind(1)
            layer["kv_cache"][0].index_copy_(0, slots, k)                      # reshape_and_cache_flash
            layer["kv_cache"][1].index_copy_(0, slots, v)
            # vLLM's Attention layer allocates its output: a block of the graph's pool under capture
            output = torch.empty(n, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=h.device)
            attn = self.impl.forward(layer, q, k, v, layer["kv_cache"], attn_metadata, output)
            h = h + linear(attn.reshape(n, HIDDEN), layer["o"])
            h = h + linear(torch.nn.functional.silu(linear(h, layer["up"])), layer["down"])
        return h


# --- a reduced vLLM-like runner: FULL graphs over mixed batches -------------------------------------------------------

class GPUModelRunner:
    def __init__(self, device, use_cuda_graph):
        self.device, self.use_cuda_graph = device, use_cuda_graph
        self.kv_caches = [torch.zeros(2, TRASH_SLOT + 1, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
                          for _ in range(NUM_LAYERS)]
        self.model = Decoder(device, self.kv_caches)
        z = lambda n: torch.zeros(n, dtype=torch.int32, device=device)
        num_tokens = max(CUDAGRAPH_CAPTURE_SIZES)
        self.input_ids, self.positions, self.slot_mapping = z(num_tokens), z(num_tokens), z(num_tokens)
        self.query_start_loc, self.seq_lens = z(MAX_NUM_SEQS + 1), z(MAX_NUM_SEQS)
        self.block_table = torch.zeros(MAX_NUM_SEQS, 1, dtype=torch.int32, device=device)
        self.graphs, self.hidden_states, self.reqs = {}, {}, {}

    def _dummy_run(self, num_tokens):
        """The capture's dummy batch: ``min(num_tokens, max_num_seqs)`` requests of one token (max_query_len 1)."""
        num_reqs = min(num_tokens, MAX_NUM_SEQS)
        self.query_start_loc[: num_reqs + 1] = torch.arange(num_reqs + 1, dtype=torch.int32, device=self.device)
        self.seq_lens[:num_reqs] = 1
        self.slot_mapping[:num_tokens] = PAD_SLOT_ID
        meta = FlashAttentionMetadata(num_tokens, 1, self.query_start_loc[: num_reqs + 1], MAX_MODEL_LEN,
                                      self.seq_lens[:num_reqs], self.block_table[:num_reqs],
                                      self.slot_mapping[:num_tokens])
        return lambda: self.model.forward(self.input_ids[:num_tokens], self.positions[:num_tokens], meta)

    def capture_model(self):
        pool = graph_pool_handle(self.device)
        static = {"input_ids": self.input_ids, "positions": self.positions, "query_start_loc": self.query_start_loc,
                  "seq_lens": self.seq_lens, "block_table": self.block_table, "slot_mapping": self.slot_mapping}
        state = {f"kv_cache_{i}": kv for i, kv in enumerate(self.kv_caches)}
        for num_tokens in sorted(CUDAGRAPH_CAPTURE_SIZES, reverse=True):
            self.graphs[num_tokens], self.hidden_states[num_tokens] = capture(
                self._dummy_run(num_tokens), device=self.device, pool=pool, static=static, state=state,
                owner="GPUModelRunner")

    def _prepare_inputs(self, scheduled, num_tokens_padded):
        ids, pos, slots, qsl, seq = [], [], [], [], []
        for req_id, n in scheduled.items():
            r = self.reqs[req_id]
            start = r["computed"]
            ids += r["tokens"][start: start + n]
            pos += list(range(start, start + n))
            slots += [r["index"] * MAX_MODEL_LEN + p for p in range(start, start + n)]
            qsl.append(qsl[-1] + n if qsl else n)
            seq.append(start + n)
        n_tok, num_reqs = len(ids), len(scheduled)
        num_reqs_padded = min(num_tokens_padded, MAX_NUM_SEQS) if self.use_cuda_graph else num_reqs
        t = lambda x: torch.tensor(x, dtype=torch.int32).to(self.device)
        self.input_ids[:n_tok], self.positions[:n_tok], self.slot_mapping[:n_tok] = t(ids), t(pos), t(slots)
        self.slot_mapping[n_tok:num_tokens_padded] = PAD_SLOT_ID
        self.query_start_loc[: num_reqs + 1] = t([0] + qsl)
        self.query_start_loc[num_reqs + 1: num_reqs_padded + 1] = n_tok        # padded requests: no tokens
        self.seq_lens[:num_reqs] = t(seq)
        self.seq_lens[num_reqs:num_reqs_padded] = 0
        self.block_table[:num_reqs, 0] = t([self.reqs[r]["index"] for r in scheduled])
        meta = FlashAttentionMetadata(n_tok, max(scheduled.values()), self.query_start_loc[: num_reqs + 1],
                                      max(seq), self.seq_lens[:num_reqs], self.block_table[:num_reqs],
                                      self.slot_mapping[:n_tok])
        return n_tok, [q - 1 for q in qsl], meta

    def execute_model(self, new_reqs, scheduled):
        for req_id, prompt in new_reqs.items():
            self.reqs[req_id] = {"index": len(self.reqs), "tokens": list(prompt), "computed": 0}
        n = sum(scheduled.values())
        size = min(s for s in CUDAGRAPH_CAPTURE_SIZES if s >= n) if self.use_cuda_graph else n
        n, logits_indices, meta = self._prepare_inputs(scheduled, size)
        if self.use_cuda_graph:
            hidden = replay(self.graphs[size], self.hidden_states[size], real=n, size=size,
                            padded={"input_ids": self.input_ids[:size], "positions": self.positions[:size]})
        else:
            hidden = self.model.forward(self.input_ids[:n], self.positions[:n], meta)
        logits = linear(hidden[torch.tensor(logits_indices, device=self.device)], self.model.lm_head)
        sampled = logits.argmax(dim=-1)
        for b, (req_id, k) in enumerate(scheduled.items()):
            r = self.reqs[req_id]
            r["computed"] += k
            if r["computed"] >= len(r["tokens"]):
                r["tokens"].append(int(sampled[b]))
        return [logits, sampled.to(DTYPE)]


def _serve(device, use_cuda_graph):
    runner = GPUModelRunner(device, use_cuda_graph)
    if use_cuda_graph:
        runner.capture_model()
    gen = generator(134)
    prompt = lambda n: torch.randint(0, VOCAB, (n,), generator=gen).tolist()
    outs = runner.execute_model({"A": prompt(5), "B": prompt(4)}, {"A": 5, "B": 4})
    outs += runner.execute_model({}, {"A": 1, "B": 1})
    outs += runner.execute_model({"C": prompt(10)}, {"A": 1, "B": 1, "C": 10})
    for _ in range(2):
        outs += runner.execute_model({}, {"A": 1, "B": 1, "C": 1})
    return outs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: _serve(device, True), lambda: _serve(device, False))
