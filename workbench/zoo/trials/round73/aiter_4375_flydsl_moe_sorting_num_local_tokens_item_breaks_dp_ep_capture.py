"""FlyDSL MoE sorting reads the DP+EP receive count with ``num_local_tokens.item()`` to size and pick its kernel, so the decode graph cannot be captured.

Upstream: https://github.com/ROCm/aiter/pull/4375 ("[Bug Fix]fix flyDSL MoE sorting graph capture break with dp attn
+ ep", merged to main 2026-07-27 as af5d0ad383). The bug came in with the FlyDSL sorting kernel (#3266).
Symptom: with DP attention + expert parallelism (MoRI all-to-all dispatch) and the FlyDSL sorting backend
(``AITER_USE_FLYDSL_MOE_SORTING=1``), capturing the decode graphs fails: "operation not permitted when stream is
capturing". Graph mode breaks for these models. Eager serving is correct.
Mechanism: under EP the MoRI dispatch fills a receive buffer sized for every DP rank's padded batch
(``max_tokens_per_rank * world_size`` rows). Only the first ``dispatch_recv_token_num`` rows are real. The dispatch
kernel writes that count on the device, and ATOM's ``FusedMoEModularKernel.forward`` hands it to aiter's
``fused_moe`` as ``num_local_tokens``. ``aiter.fused_moe.moe_sorting`` -> ``_flydsl_moe_sorting`` ->
``flydsl_moe_sorting_fwd`` -> ``moe_sorting_flydsl`` (``aiter/ops/flydsl/kernels/moe_sorting_kernel.py``) then did
``M = num_local_tokens.item()``. That is a device-to-host sync. The host used the live ``M`` for three things: to
choose the kernel (oneshot if ``M <= ONESHOT_MAX_T``, else multiphase p0v2+p23), to size it (the oneshot's LDS tile
``max_tokens``, the multiphase mesh row ``mesh_stride``), and as the ``i32_tokens`` scalar argument that bounds the
kernels' loops and is written to ``num_valid_ids[1]``. Eagerly (and in the warmup before capture) this is correct.
Inside ``torch.cuda.graph`` the sync is refused, so the capture of every decode bucket fails. The regression test's
docstring adds the second half: even if the read were tolerated, the graph would bake in the capture-time count.
Doctor: sync-in-capture, at moe_sorting_flydsl. The capture attempts a host synchronisation, the ``.item()`` on the
device receive count. The bug lives in ``moe_sorting_flydsl``. That is where the fix changed the host code: it
stopped reading the count there and sized everything by the static capacity.
Fix (upstream): ``has_local_tokens = isinstance(num_local_tokens, torch.Tensor) and num_local_tokens.is_cuda``.
When it is set, ``M = topk_ids.shape[0]``, the static padded capacity. That ``M`` drives the variant choice, the LDS,
workspace and grid sizing, the compile key, and the padding sentinel (``c_sentinel | i32_tokens``). The kernels gain
a ``local_tokens_tensor`` argument and compile with ``has_local_tokens``. They ``buffer_load`` the exact count on
the device at every launch (and so at every replay), and use it for their loop bounds, for the mesh scan width
(``i32_scan_words_per_row``) and for ``num_valid_ids[1]``. When there is no device count, a cached 1-element dummy
tensor (``_dummy_local_tokens_cache``) is passed instead.
Modelled: DP attention over 2 ranks, with EP over the same 2 ranks. Rank 0 is served: it owns experts 0-3 of 8
(the binary ``expert_mask``), topk=2, hidden 8, ``unit_size`` 4. The decode graphs are captured for
``graph_bs`` (2, 4) tokens per DP rank. The other rank's tokens appear as the rows of the DP-gathered input. The
router is softmax top-k. The MoRI dispatch is a device-side compaction: the tokens that route to a local expert
come first in the receive buffer, in (source rank, token) order, and the count is their sum. Rows past the count
hold other tokens, as MoRI's persistent receive buffer holds stale rows. The oneshot kernel and the multiphase
p0v2+p23 kernel are torch ops. The oneshot kernel is a counting sort over an LDS tile of ``max_tokens`` rows. The
multiphase kernel scatters the tokens into an expert x token mesh in the workspace (int32 per token, not bytes),
counts it, prefix-sums and scatters. The 4-kernel path for M > 2048 and the grid/occupancy maths are left out. The
two stages of ``fused_moe`` are one SiLU MLP per local expert, summed into ``moe_buf``, which the sorting kernel
zeroes. The combine adds each received row back to its source token. Thread counts and LDS capacity are scaled
down, so ``ONESHOT_MAX_T`` is 4. On the CPU engine, "a device tensor" is the fix's ``is_cuda`` test, written
as ``num_local_tokens.device == topk_ids.device``.
"""
from __future__ import annotations

import functools

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/ROCm/aiter/pull/4375"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "moe_sorting_flydsl"
SYMPTOM = ("DP-attention + EP decode graph capture fails: moe_sorting_flydsl reads the MoRI receive count with "
           "num_local_tokens.item() to size and choose its sorting kernel")

WORLD = 2                     # DP attention size == EP size
EP_RANK = 0                   # the rank this program serves
NUM_EXPERTS, TOPK, HIDDEN, INTER = 8, 2, 8, 8
LOCAL_EXPERTS = NUM_EXPERTS // WORLD
UNIT_SIZE = 4                 # GEMM tile-M (block_size_M)
BLOCK_SIZE = 8                # threads per sorting block (scaled down from 256)
LDS_CAPACITY_INTS = 288       # scaled down from 64 KiB / 4
GRAPH_BS = [2, 4]             # decode buckets: tokens per DP rank

VARIANT = {"v": "bug"}


# --- aiter/ops/flydsl/kernels/moe_sorting_kernel.py --------------------------------------------------------

_dummy_mask_cache = {}              # device -> torch.Tensor(1, dtype=i32, value=1)
_dummy_local_tokens_cache = {}      # dummy placeholder when has_local_tokens=False (added by the fix)


def _compute_sub_tokens(num_experts):
    """The largest T whose oneshot tile fits in LDS (at 2 blocks per CU)."""
    smem_cols = num_experts + 1
    r = LDS_CAPACITY_INTS // 2 // smem_cols
    return max(0, ((r - 2) // 2) * 2)


def _sort_scatter(counts, entry_expert, entry_rank, entry_ids, entry_weights, expert_mask_tensor, has_mask,
                  sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, tokens, i32_tokens, unit_size):
    """The shared tail of both kernels: pad the per-expert counts to ``unit_size``, prefix-sum, write the sorted
    ids/weights (padding rows hold the sentinel ``topk << 24 | i32_tokens``), the per-block local expert ids and
    ``num_valid_ids = [total_padded, tokens]``."""
    device = counts.device
    E = counts.shape[0]
    if has_mask:
        local = expert_mask_tensor[:E].to(torch.int32)
        counts = counts * local
        local_idx = torch.cumsum(local, 0) - 1                       # expert_id - skip_expert_num
    else:
        local_idx = torch.arange(E, dtype=torch.int32, device=device)
    padded = (counts + unit_size - 1) // unit_size * unit_size
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    total_padded = ends[-1]
    # sorted_ids / sorted_weights: every row starts as padding; real entries land at start[e] + rank
    P = sorted_ids.shape[0]
    sentinel = (TOPK << 24) | i32_tokens
    ok = entry_expert < E
    e = entry_expert.clamp(max=E - 1)
    ok = ok & (counts[e] > 0)
    dest = torch.where(ok, starts[e] + entry_rank, torch.full_like(entry_rank, P)).long()
    ids_ext = torch.full((P + 1,), sentinel, dtype=torch.int32, device=device)
    w_ext = torch.zeros(P + 1, dtype=torch.float32, device=device)
    ids_ext.scatter_(0, dest, entry_ids)
    w_ext.scatter_(0, dest, entry_weights)
    sorted_ids.copy_(ids_ext[:P])
    sorted_weights.copy_(w_ext[:P])
    # sorted_expert_ids: the local expert of each unit_size block, -1 past the last one
    blocks = torch.arange(sorted_expert_ids.shape[0], device=device)
    block_end = ends // unit_size
    owner = (blocks[:, None] >= block_end[None, :]).sum(1).clamp(max=E - 1)
    sorted_expert_ids.copy_(torch.where(blocks < total_padded // unit_size, local_idx[owner],
                                        torch.full_like(local_idx[owner], -1)))
    num_valid_ids[0] = total_padded
    num_valid_ids[1] = tokens


def _compile_moe_sorting_oneshot(num_experts, topk, max_tokens=128, unit_size=UNIT_SIZE, has_mask=False,
                                 has_local_tokens=False):
    """Compile the oneshot kernel: one block, all phases in an LDS tile of ``max_tokens`` rows. ``max_tokens`` is
    a compile-time constant (the LDS size); the actual T is ``i32_tokens``, or with ``has_local_tokens`` the
    count loaded on the device from ``local_tokens_tensor``."""
    E = num_experts

    def launch_oneshot(topk_ids_tensor, topk_weights_tensor, sorted_ids, sorted_weights, sorted_expert_ids,
                       num_valid_ids_out, moe_buf, expert_mask_tensor, local_tokens_tensor, i32_tokens,
                       i32_moe_buf_elems):
        device = topk_ids_tensor.device
        tokens = i32_tokens
        if has_local_tokens:
            tokens = local_tokens_tensor[0]                          # buffer_load, on the device
        # stage topk_ids / topk_weights into the LDS tile (out-of-range buffer loads read 0, masked below)
        n = min(max_tokens, topk_ids_tensor.shape[0])
        lds_ids = torch.full((max_tokens, topk), E, dtype=torch.int32, device=device)
        lds_w = torch.zeros(max_tokens, topk, dtype=torch.float32, device=device)
        lds_ids[:n] = topk_ids_tensor[:n]
        lds_w[:n] = topk_weights_tensor[:n]
        rows = torch.arange(max_tokens, device=device)
        valid = rows < tokens
        ids = torch.where(valid[:, None], lds_ids, torch.full_like(lds_ids, E)).reshape(-1)
        # histogram, and each (token, slot)'s rank within its expert in token-major order
        onehot = (ids[:, None] == torch.arange(E, device=device)[None, :]).to(torch.int32)
        counts = onehot.sum(0)
        rank = (torch.cumsum(onehot, 0) - 1).gather(1, ids.clamp(max=E - 1).long()[:, None])[:, 0]
        t = rows[:, None].expand(max_tokens, topk).reshape(-1).to(torch.int32)
        k = torch.arange(topk, device=device, dtype=torch.int32)[None, :].expand(max_tokens, topk).reshape(-1)
        _sort_scatter(counts, ids, rank, (k << 24) | t, lds_w.reshape(-1), expert_mask_tensor, has_mask,
                      sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids_out, tokens, i32_tokens,
                      unit_size)
        if i32_moe_buf_elems:
            moe_buf.view(-1)[:i32_moe_buf_elems].zero_()             # the zero blocks of the grid

    return launch_oneshot


def _compile_moe_sorting_multiphase(num_experts, topk, unit_size=UNIT_SIZE, has_mask=False,
                                    has_local_tokens=False, k4_block=256):
    """Compile the multiphase kernels; only the fused p0v2 (clear, scatter, count) + p23 (prefix sum, scatter)
    pair is modelled. The expert x token mesh lives in ``workspace`` (``mesh_stride`` columns per expert)."""
    E = num_experts

    def launch_p0v2_p23(topk_ids, workspace, topk_weights_tensor, sorted_ids, sorted_weights, sorted_expert_ids,
                        num_valid_ids_out, moe_buf, expert_mask_tensor, local_tokens_tensor, i32_tokens,
                        i32_mesh_stride, i32_mesh_size, i32_moe_buf_elems):
        device = topk_ids.device
        tokens_ = i32_tokens
        if has_local_tokens:
            tokens_ = local_tokens_tensor[0]                         # buffer_load, on the device
        mesh = workspace[:E * i32_mesh_stride].view(E, i32_mesh_stride)
        # p0v2 phase 1: clear each expert's mesh row (the full static row)
        mesh.zero_()
        # phase 2: scatter the first tokens_ rows' choices into the mesh (mesh[e, t] = slot + 1)
        R = min(i32_mesh_stride, topk_ids.shape[0])
        cols = torch.arange(R, device=device)
        valid = cols < tokens_
        ids = topk_ids[:R]
        hit = (ids[:, :, None] == torch.arange(E, device=device)[None, None, :]) & valid[:, None, None]
        slot = torch.arange(1, topk + 1, dtype=torch.int32, device=device)[None, :, None]
        mesh[:, :R] = (hit.to(torch.int32) * slot).sum(1).t()
        # phase 3: count non-zero mesh entries of each row (fix: only the first tokens_ columns can be real)
        scan = torch.arange(i32_mesh_stride, device=device)
        scanned = mesh != 0
        if has_local_tokens:
            scanned = scanned & (scan[None, :] < tokens_)
        counts = scanned.to(torch.int32).sum(1)
        cumsum_region = workspace[i32_mesh_size:i32_mesh_size + E + 1]
        cumsum_region[:1] = 0                                    # (one element, written on the device)
        cumsum_region[1:] = torch.cumsum(counts, 0)
        # p23: prefix sum, sorted_expert_ids, then the mesh scatter (token order within each expert row)
        rank = torch.cumsum(scanned.to(torch.int32), 1) - 1
        t = scan[None, :].expand(E, i32_mesh_stride).to(torch.int32)
        entry_expert = torch.where(scanned, torch.arange(E, device=device)[:, None].expand(E, i32_mesh_stride),
                                   torch.full((E, i32_mesh_stride), E, device=device))
        k = (mesh - 1).clamp(min=0)
        tw = topk_weights_tensor[t.clamp(max=topk_weights_tensor.shape[0] - 1).long(), k.long()]
        _sort_scatter(counts, entry_expert.reshape(-1), rank.reshape(-1), ((k << 24) | t).reshape(-1),
                      tw.reshape(-1), expert_mask_tensor, has_mask, sorted_ids, sorted_weights, sorted_expert_ids,
                      num_valid_ids_out, tokens_, i32_tokens, unit_size)
        if i32_moe_buf_elems:
            moe_buf.view(-1)[:i32_moe_buf_elems].zero_()

    return launch_p0v2_p23


@functools.lru_cache(maxsize=None)
def compile_moe_sorting(num_experts, topk, max_tokens=128, unit_size=UNIT_SIZE, has_mask=False,
                        has_local_tokens=False, k4_block=256):
    launch_oneshot = _compile_moe_sorting_oneshot(num_experts, topk, max_tokens=max_tokens, unit_size=unit_size,
                                                  has_mask=has_mask, has_local_tokens=has_local_tokens)
    launch_p0v2_p23 = _compile_moe_sorting_multiphase(num_experts, topk, unit_size=unit_size, has_mask=has_mask,
                                                      has_local_tokens=has_local_tokens, k4_block=k4_block)
    return launch_oneshot, launch_p0v2_p23


def moe_sorting_get_workspace_size(M, num_experts, topk, unit_size):
    mesh_stride = ((M + unit_size - 1) // unit_size) * unit_size
    return num_experts * mesh_stride + num_experts + 1


def moe_sorting_flydsl(topk_ids, topk_weights, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids,
                       moe_buf, num_experts, unit_size=UNIT_SIZE, expert_mask=None, num_local_tokens=None,
                       workspace=None):
    """MoE sorting using the FlyDSL kernels (oneshot + multiphase). Outputs are pre-allocated by the caller."""
    topk = topk_ids.shape[1]
    device = topk_ids.device
    if VARIANT["v"] == "fix":
        # #4375: a device count is never read on the host; the static padded capacity sizes and chooses
        has_local_tokens = isinstance(num_local_tokens, torch.Tensor) and num_local_tokens.device == device
        if has_local_tokens:
            local_tokens_tensor = num_local_tokens
            M = topk_ids.shape[0]
        else:
            local_tokens_tensor = None
            if isinstance(num_local_tokens, torch.Tensor):
                M = int(num_local_tokens.item())
            else:
                M = int(num_local_tokens) if num_local_tokens is not None else topk_ids.shape[0]
        if local_tokens_tensor is None:
            local_tokens_tensor = _dummy_local_tokens_cache.get(device)
            if local_tokens_tensor is None:
                local_tokens_tensor = torch.zeros(1, dtype=torch.int32, device=device)
                _dummy_local_tokens_cache[device] = local_tokens_tensor
    else:
        # before #4375: the live token count is read on the host (a device-to-host sync)
        has_local_tokens = False
        local_tokens_tensor = None
        if num_local_tokens is not None:
            M = (num_local_tokens.item() if isinstance(num_local_tokens, torch.Tensor)
                 else int(num_local_tokens))
        else:
            M = topk_ids.shape[0]

    sub_tokens = _compute_sub_tokens(num_experts)
    moe_buf_elems = moe_buf.numel()

    has_mask = expert_mask is not None
    if not has_mask:
        mask_tensor = _dummy_mask_cache.get(device)
        if mask_tensor is None:
            mask_tensor = torch.ones(1, dtype=torch.int32, device=device)
            _dummy_mask_cache[device] = mask_tensor
    else:
        mask_tensor = expert_mask

    ONESHOT_MAX_T = min(sub_tokens, max(4, BLOCK_SIZE // max(topk, num_experts // 8)))

    if M <= min(sub_tokens, ONESHOT_MAX_T):                      # kernel-variant choice
        max_tokens = max(M, 8)
        max_tokens = ((max_tokens + 7) // 8) * 8                 # LDS tile rows: a compile key
        launch_oneshot, _ = compile_moe_sorting(num_experts=num_experts, topk=topk, max_tokens=max_tokens,
                                                unit_size=unit_size, has_mask=has_mask,
                                                has_local_tokens=has_local_tokens)
        launch_oneshot(topk_ids, topk_weights, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids,
                       moe_buf, mask_tensor, local_tokens_tensor, M, moe_buf_elems)
    else:
        mesh_stride = ((M + unit_size - 1) // unit_size) * unit_size    # workspace sizing
        ws_mesh = num_experts * mesh_stride
        ws_total = ws_mesh + (num_experts + 1)
        if workspace is None:
            workspace = torch.empty(ws_total, dtype=torch.int32, device=device)
        elif workspace.numel() < ws_total:
            raise ValueError(f"workspace too small: need {ws_total} i32 elements, got {workspace.numel()}")
        _, launch_p0v2_p23 = compile_moe_sorting(num_experts=num_experts, topk=topk, unit_size=unit_size,
                                                 has_mask=has_mask, has_local_tokens=has_local_tokens)
        launch_p0v2_p23(topk_ids, workspace, topk_weights, sorted_ids, sorted_weights, sorted_expert_ids,
                        num_valid_ids, moe_buf, mask_tensor, local_tokens_tensor, M, mesh_stride, ws_mesh,
                        moe_buf_elems)
    return sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, moe_buf


# --- aiter/ops/flydsl/moe_sorting.py ------------------------------------------------------------------------

_workspace_cache = {}


def flydsl_moe_sorting_fwd(topk_ids, topk_weights, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids,
                           moe_buf, num_experts, unit_size, expert_mask=None, num_local_tokens=None):
    M, topk = topk_ids.shape
    device = topk_ids.device
    # pre-allocated here (cached per device, the largest kept) so that graph capture sees no new allocation
    ws_size = moe_sorting_get_workspace_size(M, num_experts, topk, unit_size)
    workspace = _workspace_cache.get(device)
    if workspace is None or workspace.numel() < ws_size:
        workspace = torch.empty(ws_size, dtype=torch.int32, device=device)
        _workspace_cache[device] = workspace
    moe_sorting_flydsl(topk_ids, topk_weights, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids,
                       moe_buf, num_experts, unit_size, expert_mask, num_local_tokens, workspace)


# --- aiter/fused_moe.py -------------------------------------------------------------------------------------

def _flydsl_moe_sorting(topk_ids, topk_weights, num_experts, model_dim, moebuf_dtype, block_size, expert_mask,
                        num_local_tokens):
    device = topk_ids.device
    M, topk = topk_ids.shape
    max_num_tokens_padded = int(topk_ids.numel() + num_experts * block_size - topk)
    max_num_m_blocks = int((max_num_tokens_padded + block_size - 1) // block_size)
    sorted_ids = torch.empty(max_num_tokens_padded, dtype=torch.int32, device=device)
    sorted_weights = torch.empty(max_num_tokens_padded, dtype=torch.float32, device=device)
    sorted_expert_ids = torch.empty(max_num_m_blocks, dtype=torch.int32, device=device)
    num_valid_ids = torch.empty(2, dtype=torch.int32, device=device)
    moe_buf = torch.empty((M, model_dim), dtype=moebuf_dtype, device=device)
    flydsl_moe_sorting_fwd(topk_ids, topk_weights, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids,
                           moe_buf, num_experts, int(block_size), expert_mask, num_local_tokens)
    return sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, moe_buf


def moe_sorting(topk_ids, topk_weights, num_experts, model_dim, moebuf_dtype, block_size=UNIT_SIZE,
                expert_mask=None, num_local_tokens=None, dispatch_policy=0):
    # _USE_FLYDSL_MOE_SORTING and is_flydsl_available(), dispatch_policy == 0, not flat, not output_aux
    return _flydsl_moe_sorting(topk_ids, topk_weights, num_experts, model_dim, moebuf_dtype, block_size,
                               expert_mask, num_local_tokens)


def fused_moe(hidden_states, w1, w2, topk_weight, topk_ids, expert_mask=None, num_local_tokens=None):
    """Sort, then the two expert stages over the sorted ``block_size_M`` tiles; stage 2 accumulates into the
    ``moe_buf`` that the sorting kernel zeroed."""
    sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, moe_buf = moe_sorting(
        topk_ids, topk_weight, NUM_EXPERTS, HIDDEN, hidden_states.dtype, UNIT_SIZE, expert_mask, num_local_tokens)
    device = hidden_states.device
    pos = torch.arange(sorted_ids.shape[0], device=device)
    le = sorted_expert_ids[pos // UNIT_SIZE]
    tok = sorted_ids & 0xFFFFFF
    valid = (pos < num_valid_ids[0]) & (tok < num_valid_ids[1]) & (le >= 0)
    tok = torch.where(valid, tok, torch.zeros_like(tok)).long()
    le = torch.where(valid, le, torch.zeros_like(le)).long()
    h = torch.nn.functional.silu(torch.einsum("ph,phi->pi", hidden_states[tok], w1[le]))       # stage 1
    y = torch.einsum("pi,pih->ph", h, w2[le]) * sorted_weights[:, None]                        # stage 2
    moe_buf.index_add_(0, tok, torch.where(valid[:, None], y, torch.zeros_like(y)))
    return moe_buf


# --- ATOM: atom/model_ops/fused_moe (MoRI prepare/finalize, the modular kernel) ------------------------------

class MoriPrepareAndFinalize:
    """EP all-to-all through MoRI. Rank ``EP_RANK`` receives, from every DP rank, the tokens routed to one of its
    experts, into a receive buffer of ``max_tokens_per_rank * world_size`` rows; the count is a device tensor."""

    def prepare(self, a1, topk_weights, topk_ids, dp_num_tokens):
        device = a1.device
        rows = a1.shape[0]
        bs = rows // WORLD
        t = torch.arange(rows, device=device)
        real = (t % bs) < dp_num_tokens[:, None].expand(WORLD, bs).reshape(-1)
        lo, hi = EP_RANK * LOCAL_EXPERTS, (EP_RANK + 1) * LOCAL_EXPERTS
        sel = real & ((topk_ids >= lo) & (topk_ids < hi)).any(1)
        order = torch.argsort((~sel).to(torch.int32), stable=True)     # received rows first, in source order
        dispatch_recv_token_num = sel.sum().to(torch.int32).reshape(1)
        return a1[order], topk_weights[order], topk_ids[order], dispatch_recv_token_num, order

    def finalize(self, fused_expert_output, num_rows, dispatch_recv_token_num, recv_src):
        received = torch.arange(fused_expert_output.shape[0], device=fused_expert_output.device)
        received = received < dispatch_recv_token_num[0]
        out = torch.zeros(num_rows, fused_expert_output.shape[1], device=fused_expert_output.device)
        out.index_add_(0, recv_src, torch.where(received[:, None], fused_expert_output,
                                                      torch.zeros_like(fused_expert_output)))
        return out


class FusedMoEModularKernel:
    def __init__(self):
        self.prepare_finalize = MoriPrepareAndFinalize()

    def forward(self, hidden_states, w1, w2, topk_weights, topk_ids, expert_mask, dp_num_tokens):
        dispatch_a1, dispatch_weights, dispatch_ids, expert_num_tokens, recv_src = self.prepare_finalize.prepare(
            hidden_states, topk_weights, topk_ids, dp_num_tokens)
        fused_out = fused_moe(dispatch_a1, w1, w2, dispatch_weights, dispatch_ids, expert_mask,
                              num_local_tokens=expert_num_tokens)
        return self.prepare_finalize.finalize(fused_out, hidden_states.shape[0], expert_num_tokens, recv_src)


class FusedMoE:
    """One MoE layer on EP rank ``EP_RANK``: router, then dispatch / fused_moe on the local experts / combine."""

    def __init__(self, device):
        gen = generator(4375)
        self.gate = randn(HIDDEN, NUM_EXPERTS, gen=gen, device=device)
        self.w1 = randn(LOCAL_EXPERTS, HIDDEN, INTER, gen=gen, device=device, scale=0.5)
        self.w2 = randn(LOCAL_EXPERTS, INTER, HIDDEN, gen=gen, device=device, scale=0.5)
        mask = torch.zeros(NUM_EXPERTS, dtype=torch.int32)
        mask[EP_RANK * LOCAL_EXPERTS:(EP_RANK + 1) * LOCAL_EXPERTS] = 1
        self.expert_mask = mask.to(device)
        self.kernel = FusedMoEModularKernel()

    def forward(self, hidden_states, dp_num_tokens):
        scores = torch.softmax(hidden_states @ self.gate, dim=-1)
        topk_weights, topk_ids = torch.topk(scores, TOPK, dim=-1)
        topk_weights = topk_weights / topk_weights.sum(-1, keepdim=True)
        return self.kernel.forward(hidden_states, self.w1, self.w2, topk_weights, topk_ids.to(torch.int32),
                                   self.expert_mask, dp_num_tokens)


# --- ATOM: atom/model_engine/model_runner.py ----------------------------------------------------------------

class ModelRunner:
    def __init__(self, device, enforce_eager):
        self.device, self.enforce_eager = device, enforce_eager
        self.model = FusedMoE(device)
        self.graph_bs = GRAPH_BS
        self.hidden_states = torch.zeros(WORLD * max(GRAPH_BS), HIDDEN, device=device)
        self.dp_num_tokens = torch.zeros(WORLD, dtype=torch.int32, device=device)
        self.graphs = {}

    def capture_cudagraph(self):
        for bs in reversed(self.graph_bs):
            self.dp_num_tokens.fill_(bs)                       # dummy decode batch: every rank full
            hs = self.hidden_states[:WORLD * bs]
            self.graphs[bs] = capture(lambda hs=hs: self.model.forward(hs, self.dp_num_tokens),
                                      device=self.device, name=f"decode bs={bs}",
                                      static={"hidden_states": self.hidden_states,
                                              "dp_num_tokens": self.dp_num_tokens},
                                      owner="ModelRunner")

    def get_dp_padding(self, num_tokens_across_dp):
        max_tokens_across_dp = max(num_tokens_across_dp)
        if self.enforce_eager:
            return max_tokens_across_dp
        return next(g for g in self.graph_bs if g >= max_tokens_across_dp)

    def run_model(self, per_rank_hidden):
        counts = [x.shape[0] for x in per_rank_hidden]
        bs = self.get_dp_padding(counts)
        for r, x in enumerate(per_rank_hidden):
            self.hidden_states[r * bs:r * bs + counts[r]] = x
        self.dp_num_tokens.copy_(torch.tensor(counts, dtype=torch.int32).to(self.device))
        if self.enforce_eager:
            out = self.model.forward(self.hidden_states[:WORLD * bs], self.dp_num_tokens)
        else:
            g, static_out = self.graphs[bs]
            out = replay(g, static_out)
        return torch.cat([out[r * bs:r * bs + n] for r, n in enumerate(counts)]).clone()


def decode_steps():
    gen = generator(43750)
    schedule = [(2, 1), (3, 4), (1, 2), (4, 2), (2, 2), (1, 4)]
    return [[torch.randn(n, HIDDEN, generator=gen) for n in step] for step in schedule]


def run(variant: str, device: str = "cpu"):
    VARIANT["v"] = variant
    steps = decode_steps()

    def serve(enforce_eager):
        runner = ModelRunner(device, enforce_eager)
        if not enforce_eager:
            runner.capture_cudagraph()
        return [runner.run_model([x.to(device) for x in step]) for step in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(False), lambda: serve(True))
