"""Breakable prefill CUDA graph under DP attention: an idle rank's fabricated extend row carries mamba slot -1, and the chunked GDN kernel addresses state slot -1.

Upstream: https://github.com/sgl-project/sglang/pull/33810 ("fix(gdn): skip the -1 padding sentinel in the chunked
extend kernel", commit db8f3cdd1, Yuwei An, merged 2026-08-06); regression test added by
https://github.com/sgl-project/sglang/pull/33431 ("[Fix] Skip padded state slots in the chunked GDN kernel",
2026-08-18: "Padded rows (idle DP ranks under breakable CUDA graph prefill) ... 'all padded' is the idle-DP-rank case
that faulted").
Symptom: Qwen3.5 (GDN hybrid) with ``--dp=8 --enable-dp-attention`` faults with an illegal memory access once a prefill
step leaves some DP rank without requests (the nightly test had to run with ``--disable-prefill-cuda-graph``; the fix
removes that flag). With the prefill CUDA graph off the same workload runs.
Mechanism: the breakable prefill CUDA graph needs every DP rank to run the same captured shape, so
``ForwardBatch.prepare_mlp_sync_batch`` (forward_batch_info.py) forces ``DpPaddingMode.MAX_LEN`` whenever the group
voted ``can_run_dp_breakable_cuda_graph`` and the step fits a captured bucket (graph off: Qwen3.5 has no
``hybrid_override_pattern``, so ``get_dp_padding_mode`` keeps ``SUM_LEN`` and an idle rank stays IDLE). Under MAX_LEN a
hybrid-SSM rank with no requests is converted into a fabricated one-request EXTEND batch of ``num_tokens`` dummy tokens
(``_original_batch_size`` = 0). ``MambaAttnBackendBase._forward_metadata`` (hybrid_linear_attn_backend.py) then poisons
the rows past ``_original_batch_size``: ``mamba_cache_indices[_real_bs:] = -1``. The rank replays the prefill graph;
the linear-attention core runs at the graph's eager break (``bcg_unified_linear_attention_with_output``,
``eager_on_graph``) in ``GDNAttnBackend.forward_extend`` -> ``chunk_gated_delta_rule`` ->
``chunk_gated_delta_rule_fwd_h``. ``chunk_gated_delta_rule_fwd_kernel_h_blockdim64`` (fla/chunk_delta_h.py) loads
``index = initial_state_indices[i_n]`` and forms ``h0 = ht = initial_state + index * stride_init_state`` with no check:
it loads the initial state from slot -1 and, in its epilogue, stores the row's final state there. The state pool is
``temporal[num_mamba_layers, size + 1, HV, V, K]`` and ``initial_state`` is one layer's view, so slot -1 of the first
GDN layer lies before the allocation (the fault), and slot -1 of layer L > 0 is layer L-1's last slot (a live slot;
slot 0 is the reserved one). The causal-conv kernels skip ``PAD_SLOT_ID``; the chunked kernel did not. Eager steps
never fabricate the row.
Doctor: stale-padding, at chunk_gated_delta_rule_fwd_kernel_h_blockdim64 (the padded (fabricated) request row of the
graph step holds the -1 pad sentinel as its state index, and whether the rank's step survives, and what the state
pool holds afterwards, depends on what that padded row holds; the fix changes only this kernel, which now treats the
sentinel as "no state").
Fix (upstream): ``valid_state = index >= 0``; the initial-state load runs only ``if USE_INITIAL_STATE and
valid_state`` and the epilogue store only ``if INPLACE_UPDATE and valid_state`` (the row starts from a zero state and
writes nothing back).
Modelled: two DP ranks (each its own device context, model runner, request pool and mamba pool) in one process; a
Qwen3.5-like model with two GDN layers only (no full-attention or MoE layers, no conv1d, no DP gather/scatter
collectives: the ranks share only the MLP-sync all-gather, i.e. the token counts and the graph vote); H = 2 heads,
K = V = 4; one breakable prefill bucket (8 tokens). The breakable capture is spelled as the model's explicit stage
list (captured segments separated by the eager linear-attention core, where upstream ``eager_on_graph`` splits the
capture); the logits tail runs eagerly (``_uses_eager_prefill_tail``). The chunked kernels keep their split
(``chunk_local_cumsum`` -> ``kernel_h`` storing the chunk-start states ``h`` and ``v_new`` -> ``chunk_fwd_o``) with
chunk size 4; the WY intra-chunk solve is folded into the kernel's token loop (same result). Device addresses are
explicit: ``initial_state`` is a pointer (its storage plus storage offset) and global memory is bounds-checked as the
GPU's MMU does: an address outside the allocation is neither read (0) nor written and raises the context's sticky
illegal-address flag, which that rank's next host synchronisation (the next MLP-sync D2H copy) turns into
``RuntimeError: CUDA error: an illegal memory access was encountered``. Same behaviour on the CPU and on a GPU.
The eager reference is ``--disable-prefill-cuda-graph``: no ``PrefillCudaGraphRunner``, so the extend ranks vote
``can_run_prefill_cuda_graph`` False, the group keeps SUM_LEN and the idle rank runs an empty IDLE step.
Workload: step 1 both ranks prefill (rank 0: chunk 1 of request A, rank 1: request B); step 2 rank 0 prefills C
and rank 1 is idle; step 3 rank 0 prefills A's second chunk (from its saved state), rank 1 prefills E.
"""
from __future__ import annotations

import enum

import torch
import torch.nn.functional as F

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/33810"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "chunk_gated_delta_rule_fwd_kernel_h_blockdim64"
SYMPTOM = ("Qwen3.5 + DP attention with the breakable prefill CUDA graph: an idle DP rank's fabricated extend row "
           "carries mamba slot -1 and the chunked GDN kernel loads/stores recurrent state slot -1 (illegal address)")

PAD_SLOT_ID = -1
VOCAB, HIDDEN = 16, 8
NUM_HEADS, K_DIM, V_DIM = 2, 4, 4             # num_k_heads == num_v_heads (Hg == H)
NUM_GDN_LAYERS = 2
MAMBA_POOL_SIZE = 3                            # slots 1..3 live, slot 0 reserved (dummy writes)
REQ_POOL_SIZE = 4
CAPTURE_NUM_TOKENS = [8]                       # cuda_graph_config.prefill.bs (breakable)
CHUNK_SIZE = 4                                 # fla CHUNK_SIZE (64 upstream)
DP_SIZE = 2

_kernel_variant = "bug"


class CudaContext:
    """A rank's device error state: a faulting kernel sets it, the next host synchronisation raises it."""

    def __init__(self, device):
        self.illegal_address = torch.zeros((), dtype=torch.bool, device=device)

    def synchronize(self):
        if bool(self.illegal_address):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")


_current_ctx: list[CudaContext] = []


# --- sglang/kernels/ops/attention/fla (index.py, cumsum.py, l2norm.py, chunk_delta_h.py, chunk_o.py, chunk.py) -------

def _pointer(t: torch.Tensor):
    """A device pointer to ``t``: its whole allocation (flat) and the element offset where ``t`` starts."""
    numel = t.untyped_storage().nbytes() // t.element_size()
    return torch.as_strided(t, (numel,), (1,), 0), t.storage_offset()


def _global_load(mem, addr, ctx):
    legal = (addr >= 0) & (addr < mem.numel())
    ctx.illegal_address |= (~legal).any()
    return torch.where(legal, mem[addr.clamp(0, mem.numel() - 1)], torch.zeros((), dtype=mem.dtype, device=mem.device))


def _global_store(mem, addr, value, mask, ctx):
    legal = (addr >= 0) & (addr < mem.numel())
    ctx.illegal_address |= (mask & ~legal).any()
    write = mask & legal
    mem[addr[write]] = value[write]


def prepare_chunk_offsets(cu_seqlens, chunk_size):
    n_chunks = torch.div(cu_seqlens[1:] - cu_seqlens[:-1] + chunk_size - 1, chunk_size, rounding_mode="floor")
    return torch.cat([cu_seqlens.new_zeros(1), n_chunks.cumsum(0)])


def l2norm_fwd(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def chunk_local_cumsum(g, chunk_size, cu_seqlens):
    """Cumulative sum of ``g`` [1, T, H] within each chunk of each sequence."""
    t_total = g.shape[1]
    pos = torch.arange(t_total, device=g.device)
    seq = torch.searchsorted(cu_seqlens[1:].contiguous(), pos, right=True).clamp(max=cu_seqlens.numel() - 2)
    chunk_start = cu_seqlens[seq] + torch.div(pos - cu_seqlens[seq], chunk_size, rounding_mode="floor") * chunk_size
    out = torch.zeros_like(g)
    for j in range(chunk_size):
        src = chunk_start + j
        take = (src <= pos)
        out[0] += torch.where(take[:, None], g[0, src.clamp(max=t_total - 1)], torch.zeros((), device=g.device))
    return out


def chunk_gated_delta_rule_fwd_kernel_h_blockdim64(k, v, g, beta, h, v_new, initial_state, initial_state_indices,
                                                   stride_init_state, cu_seqlens, chunk_offsets, T, H, K, V, BT,
                                                   USE_INITIAL_STATE, INPLACE_UPDATE, ctx):
    """All programs ``(i_v, i_nh)`` at once (rows are vectorised). ``initial_state``: a pointer (allocation, offset)
    to this layer's state view; the state of a slot is [H, V, K] at ``index * stride_init_state``."""
    mem, base = initial_state
    dev = k.device
    n_seq = initial_state_indices.shape[0]
    bos, eos = cu_seqlens[:-1].to(torch.int64), cu_seqlens[1:].to(torch.int64)
    boh = chunk_offsets[:-1].to(torch.int64)
    inner = (torch.arange(H, device=dev)[:, None, None] * V * K + torch.arange(V, device=dev)[None, :, None] * K
             + torch.arange(K, device=dev)[None, None, :])[None]                                   # [1, H, V, K]
    b_h = torch.zeros(n_seq, H, V, K, device=dev)

    index = initial_state_indices.to(torch.int64)
    if _kernel_variant == "fix":
        # Padded rows carry the -1 sentinel; the decode kernel guards on it (fused_recurrent.py)
        valid_state = index >= 0
    else:
        valid_state = torch.ones_like(index, dtype=torch.bool)
    h0 = base + index[:, None, None, None] * stride_init_state + inner
    ht = h0
    if USE_INITIAL_STATE:                          # load initial state
        live = valid_state[:, None, None, None]
        b_h = torch.where(live, _global_load(mem, torch.where(live, h0, base), ctx), b_h)

    g_prev = torch.zeros(n_seq, H, device=dev)
    for i in range(T):
        pos = bos + i
        active = pos < eos
        p = pos.clamp(max=k.shape[1] - 1)
        if i % BT == 0:                            # the state at this chunk's start, for chunk_fwd_o
            c = (boh + i // BT).clamp(max=h.shape[0] - 1)
            h[c[active]] = b_h[active]
            g_prev = torch.zeros_like(g_prev)
        b_g = g[0, p]                              # chunk-local cumsum
        b_h_dec = b_h * torch.exp(b_g - g_prev)[:, :, None, None]
        b_k, b_v = k[0, p], v[0, p]                # [N, H, K], [N, H, V]
        b_u = beta[0, p][..., None] * (b_v - (b_h_dec * b_k[:, :, None, :]).sum(-1))
        v_new[0, p[active]] = b_u[active]
        b_h = torch.where(active[:, None, None, None], b_h_dec + b_u[..., None] * b_k[:, :, None, :], b_h)
        g_prev = torch.where(active[:, None], b_g, g_prev)

    # epilogue
    if INPLACE_UPDATE:
        _global_store(mem, ht, b_h, valid_state[:, None, None, None].expand_as(b_h), ctx)


def chunk_gated_delta_rule_fwd_h(k, v, g, beta, initial_state, initial_state_indices, cu_seqlens):
    _, t_total, H, K = k.shape
    V = v.shape[-1]
    BT = CHUNK_SIZE
    n_seq = cu_seqlens.numel() - 1
    chunk_offsets = prepare_chunk_offsets(cu_seqlens, BT)
    h = k.new_zeros(n_seq * (-(-t_total // BT)), H, V, K)
    v_new = torch.zeros_like(v)
    chunk_gated_delta_rule_fwd_kernel_h_blockdim64(
        k, v, g, beta, h, v_new, _pointer(initial_state), initial_state_indices,
        stride_init_state=initial_state.stride(0), cu_seqlens=cu_seqlens, chunk_offsets=chunk_offsets, T=t_total,
        H=H, K=K, V=V, BT=BT, USE_INITIAL_STATE=initial_state is not None, INPLACE_UPDATE=True, ctx=_current_ctx[-1])
    return h, v_new, chunk_offsets


def chunk_fwd_o(q, k, v_new, h, g, scale, cu_seqlens, chunk_offsets):
    """o_t = scale * (exp(G_t) h_chunk q_t + sum_{s <= t in chunk} exp(G_t - G_s) (q_t . k_s) v_new_s)."""
    t_total = q.shape[1]
    BT = CHUNK_SIZE
    bos, eos = cu_seqlens[:-1].to(torch.int64), cu_seqlens[1:].to(torch.int64)
    boh = chunk_offsets[:-1].to(torch.int64)
    o = torch.zeros_like(v_new)
    for i in range(t_total):
        pos = bos + i
        active = pos < eos
        p = pos.clamp(max=t_total - 1)
        c = (boh + i // BT).clamp(max=h.shape[0] - 1)
        b_q, b_g = q[0, p], g[0, p]                                                      # [N, H, K], [N, H]
        b_o = torch.exp(b_g)[..., None] * (h[c] * b_q[:, :, None, :]).sum(-1)           # [N, H, V]
        for j in range(i - i % BT, i + 1):
            s = (bos + j).clamp(max=t_total - 1)
            b_o = b_o + (torch.exp(b_g - g[0, s]) * (b_q * k[0, s]).sum(-1))[..., None] * v_new[0, s]
        o[0, p[active]] = (b_o * scale)[active]
    return o


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, initial_state_indices=None,
                           cu_seqlens=None, head_first=False, use_qk_l2norm_in_kernel=False):
    if use_qk_l2norm_in_kernel:
        q, k = l2norm_fwd(q), l2norm_fwd(k)
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    g = chunk_local_cumsum(g, CHUNK_SIZE, cu_seqlens)
    h, v_new, chunk_offsets = chunk_gated_delta_rule_fwd_h(k, v, g, beta, initial_state, initial_state_indices,
                                                           cu_seqlens)
    o = chunk_fwd_o(q, k, v_new, h, g, scale, cu_seqlens, chunk_offsets)
    return o, None, h


def fused_gdn_gating(A_log, a, b, dt_bias):
    g = -torch.exp(A_log) * F.softplus(a + dt_bias)
    return g[None], torch.sigmoid(b)[None]


# --- sglang/srt/mem_cache (allocator/mamba.py, memory_pool.py) ---------------------------------------------------------

class MambaSlotAllocator:
    def __init__(self, size, device):
        self.size, self.device = size, device
        self.clear()

    def alloc(self, need_size):
        if need_size > len(self.free_slots):
            return None
        select_index, self.free_slots = self.free_slots[:need_size], self.free_slots[need_size:]
        return select_index

    def clear(self):
        # Slot 0 is reserved as a dummy write target for padded tokens.
        self.free_slots = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)


class MambaPool:
    class State:
        def __init__(self, temporal):
            self.temporal = temporal

        def at_layer_idx(self, layer):
            return MambaPool.State(self.temporal[layer])

    def __init__(self, size, num_mamba_layers, device):
        self.size = size
        temporal_state = torch.zeros(num_mamba_layers, size + 1, NUM_HEADS, V_DIM, K_DIM, device=device)
        self.mamba_cache = MambaPool.State(temporal_state)

    def mamba2_layer_cache(self, layer_id):
        return self.mamba_cache.at_layer_idx(layer_id)

    def clear_slots(self, indices):
        self.mamba_cache.temporal[:, indices] = 0


class HybridReqToTokenPool:
    def __init__(self, size, mamba_size, num_mamba_layers, device):
        self.free_slots = list(range(1, size + 1))         # +1 padding row at index 0
        self.mamba_pool = MambaPool(mamba_size, num_mamba_layers, device)
        self.mamba_allocator = MambaSlotAllocator(mamba_size, device)
        self.req_index_to_mamba_index_mapping = torch.zeros(size + 1, dtype=torch.int32, device=device)

    def alloc(self, req):
        req.req_pool_idx = self.free_slots.pop(0)
        mid = self.mamba_allocator.alloc(1)
        self.mamba_pool.clear_slots(mid)
        self.req_index_to_mamba_index_mapping[req.req_pool_idx] = mid.to(torch.int32)[0]

    def get_mamba_indices(self, req_pool_indices):
        return self.req_index_to_mamba_index_mapping[req_pool_indices]

    def mamba2_layer_cache(self, layer_id):
        return self.mamba_pool.mamba2_layer_cache(layer_id)


# --- sglang/srt/model_executor/forward_batch_info.py, sglang/srt/layers/dp_attention.py -------------------------------

class ForwardMode(enum.Enum):
    EXTEND = 1
    IDLE = 4

    def is_extend(self):
        return self is ForwardMode.EXTEND

    def is_idle(self):
        return self is ForwardMode.IDLE


class DpPaddingMode(enum.Enum):
    MAX_LEN = 1
    SUM_LEN = 2

    def is_max_len(self):
        return self is DpPaddingMode.MAX_LEN

    @classmethod
    def get_dp_padding_mode(cls, is_extend_in_batch, global_num_tokens):
        # max_len_with_idle: only models with a hybrid_override_pattern (not Qwen3.5)
        max_len_with_idle = False
        if is_extend_in_batch and DP_SIZE > 1:
            if max_len_with_idle and min(global_num_tokens) == 0:
                return cls.MAX_LEN
            return cls.SUM_LEN
        return cls.MAX_LEN


class ForwardBatch:
    def __init__(self, forward_mode, input_ids, req_pool_indices, extend_seq_lens, extend_prefix_lens, device):
        self.forward_mode = forward_mode
        self.batch_size = int(req_pool_indices.shape[0])
        self.input_ids, self.req_pool_indices = input_ids, req_pool_indices
        self.extend_seq_lens, self.extend_prefix_lens = extend_seq_lens, extend_prefix_lens
        self.extend_start_loc = torch.cat([extend_seq_lens.new_zeros(1), extend_seq_lens.cumsum(0)[:-1]])
        self.num_token_non_padded_cpu = int(input_ids.shape[0])
        self.device = device
        self._original_batch_size = None
        self._original_forward_mode = None
        self.global_num_tokens_cpu = None
        self.can_run_dp_breakable_cuda_graph = False
        self.is_extend_in_batch = False
        self.dp_padding_mode = None

    def prepare_mlp_sync_batch(self, model_runner):
        self._original_batch_size = self.batch_size
        global_num_tokens = list(self.global_num_tokens_cpu)
        dp_padding_mode = DpPaddingMode.get_dp_padding_mode(self.is_extend_in_batch, global_num_tokens)
        # Prefill breakable CUDA graph requires every DP rank to run the SAME captured shape: force MAX_LEN
        prefill_cg_bs = model_runner.server_args_prefill_cg_bs
        if (self.can_run_dp_breakable_cuda_graph and self.is_extend_in_batch and prefill_cg_bs
                and max(global_num_tokens) <= max(prefill_cg_bs)):
            dp_padding_mode = DpPaddingMode.MAX_LEN
        self.dp_padding_mode = dp_padding_mode
        if dp_padding_mode.is_max_len():
            global_num_tokens = [max(global_num_tokens)] * len(global_num_tokens)
        num_tokens = global_num_tokens[model_runner.attn_dp_rank]

        bs = self.batch_size
        if self.forward_mode.is_idle():
            hybrid_ssm = True                                     # mambaish_config(Qwen3.5) is the GDN config
            if self.is_extend_in_batch and dp_padding_mode.is_max_len():
                self._original_forward_mode = self.forward_mode
                self.forward_mode = ForwardMode.EXTEND
                # Fabricate a single dummy request covering num_tokens for an empty (idle) rank.
                if hybrid_ssm or bs == 0:
                    dev = self.device
                    self.extend_seq_lens = torch.tensor([num_tokens], dtype=torch.int64, device=dev)
                    self.extend_prefix_lens = torch.zeros(1, dtype=torch.int64, device=dev)
                    self.extend_start_loc = torch.zeros(1, dtype=torch.int64, device=dev)
                    bs = self.batch_size = 1
                    # Count the dummy tokens as real, else MoE treats this rank as empty.
                    self.num_token_non_padded_cpu = num_tokens
            else:
                bs = self.batch_size = num_tokens
        self._pad_inputs_to_size(num_tokens, bs)

    def _pad_inputs_to_size(self, num_tokens, bs):
        pad_t = num_tokens - self.input_ids.shape[0]
        self.input_ids = torch.cat([self.input_ids, self.input_ids.new_zeros(pad_t)])
        pad_b = bs - self.req_pool_indices.shape[0]
        self.req_pool_indices = torch.cat([self.req_pool_indices, self.req_pool_indices.new_zeros(pad_b)])

    def post_forward_mlp_sync_batch(self, logits):
        if self._original_forward_mode is not None:
            self.forward_mode = self._original_forward_mode
        if self._original_batch_size is not None:
            self.batch_size = self._original_batch_size
        return logits[:self.batch_size]


# --- sglang/srt/layers/attention/hybrid_linear_attn_backend.py, linear/gdn_backend.py, linear/kernels/gdn_triton.py ---

class ForwardMetadata:
    def __init__(self, query_start_loc, mamba_cache_indices):
        self.query_start_loc, self.mamba_cache_indices = query_start_loc, mamba_cache_indices


class GDNKernelDispatcher:
    def extend(self, q, k, v, g, beta, *, ssm_states, cache_indices, query_start_loc):
        return chunk_gated_delta_rule(q=q, k=k, v=v, g=g, beta=beta, initial_state=ssm_states,
                                      cu_seqlens=query_start_loc, head_first=False, use_qk_l2norm_in_kernel=True,
                                      initial_state_indices=cache_indices)


class GDNAttnBackend:
    """MambaAttnBackendBase + GDNAttnBackend (extend path)."""

    def __init__(self, req_to_token_pool):
        self.pad_slot_id = PAD_SLOT_ID
        self.req_to_token_pool = req_to_token_pool
        self.kernel_dispatcher = GDNKernelDispatcher()
        self.forward_metadata = None

    def _forward_metadata(self, forward_batch):
        bs = forward_batch.batch_size
        mamba_cache_indices = self.req_to_token_pool.get_mamba_indices(forward_batch.req_pool_indices)
        _real_bs = forward_batch._original_batch_size
        if _real_bs is not None and _real_bs < mamba_cache_indices.shape[0]:
            mamba_cache_indices = mamba_cache_indices.clone()
            mamba_cache_indices[_real_bs:] = -1
        query_start_loc = torch.empty((bs + 1,), dtype=torch.int64, device=mamba_cache_indices.device)
        query_start_loc[:bs] = forward_batch.extend_start_loc
        query_start_loc[bs] = forward_batch.extend_start_loc[-1] + forward_batch.extend_seq_lens[-1]
        return ForwardMetadata(query_start_loc, mamba_cache_indices)

    def init_forward_metadata(self, forward_batch):
        self.forward_metadata = self._forward_metadata(forward_batch)

    def forward_extend(self, layer, forward_batch, mixed_qkv, a, b):
        seq_len = mixed_qkv.shape[0]
        query_start_loc = self.forward_metadata.query_start_loc
        cache_indices = self.forward_metadata.mamba_cache_indices
        ssm_states = self.req_to_token_pool.mamba2_layer_cache(layer.layer_id).temporal
        state_cache_indices = cache_indices                 # contiguous pool: no gather/scatter round trip
        query, key, value = torch.split(mixed_qkv, [layer.q_dim, layer.k_dim, layer.v_dim], dim=-1)
        query = query.view(1, seq_len, layer.num_q_heads, layer.head_q_dim)
        key = key.view(1, seq_len, layer.num_k_heads, layer.head_k_dim)
        value = value.view(1, seq_len, layer.num_v_heads, layer.head_v_dim)
        g, beta = fused_gdn_gating(layer.A_log, a, b, layer.dt_bias)
        core_attn_out, _, _ = self.kernel_dispatcher.extend(
            q=query, k=key, v=value, g=g, beta=beta, ssm_states=ssm_states, cache_indices=state_cache_indices,
            query_start_loc=query_start_loc)
        return core_attn_out


# --- sglang/srt/layers/radix_linear_attention.py ------------------------------------------------------------------------

class RadixLinearAttention:
    def __init__(self, layer_id, attn_backend_ref, A_log, dt_bias):
        self.layer_id = layer_id
        self.num_q_heads = self.num_k_heads = self.num_v_heads = NUM_HEADS
        self.head_q_dim = self.head_k_dim = K_DIM
        self.head_v_dim = V_DIM
        self.q_dim = self.k_dim = NUM_HEADS * K_DIM
        self.v_dim = NUM_HEADS * V_DIM
        self.A_log, self.dt_bias = A_log, dt_bias
        self.get_attn_backend = attn_backend_ref

    def alloc_output(self, seq_len, device):
        # Output shape from linear attention: (1, seq_len, num_v_heads, head_v_dim)
        return torch.empty((1, seq_len, self.num_v_heads, self.head_v_dim), device=device)

    def bcg_unified_linear_attention_with_output(self, forward_batch, mixed_qkv, a, b, output):
        """``eager_on_graph(True)``: runs eagerly at the breakable graph's break point."""
        real_num_tokens = forward_batch.num_token_non_padded_cpu
        ret = self.get_attn_backend().forward_extend(self, forward_batch, mixed_qkv[:real_num_tokens],
                                                     a[:real_num_tokens], b[:real_num_tokens])
        output[:, :real_num_tokens].copy_(ret)


# --- sglang/srt/models/qwen3_5.py -------------------------------------------------------------------------------------

class Qwen3_5GatedDeltaNet:
    def __init__(self, layer_id, gen, device, attn_backend_ref):
        qkvz = 2 * NUM_HEADS * K_DIM + 2 * NUM_HEADS * V_DIM
        self.in_proj_qkvz = randn(HIDDEN, qkvz, gen=gen, device=device, scale=0.5)
        self.in_proj_ba = randn(HIDDEN, 2 * NUM_HEADS, gen=gen, device=device, scale=0.5)
        self.norm_weight = 1.0 + randn(V_DIM, gen=gen, device=device, scale=0.1)
        self.out_proj = randn(NUM_HEADS * V_DIM, HIDDEN, gen=gen, device=device, scale=0.5)
        self.attn = RadixLinearAttention(layer_id, attn_backend_ref,
                                         A_log=randn(NUM_HEADS, gen=gen, device=device, scale=0.3),
                                         dt_bias=randn(NUM_HEADS, gen=gen, device=device, scale=0.3))

    def forward_input_proj(self, hidden_states):
        qkvz = hidden_states @ self.in_proj_qkvz
        ba = hidden_states @ self.in_proj_ba
        qkv_dim = self.attn.q_dim + self.attn.k_dim + self.attn.v_dim
        mixed_qkv, z = qkvz[:, :qkv_dim], qkvz[:, qkv_dim:]
        b, a = ba[:, :NUM_HEADS], ba[:, NUM_HEADS:]
        return mixed_qkv, z, b, a

    def forward_output_proj(self, core_attn_out, z):
        core = core_attn_out.reshape(-1, NUM_HEADS, V_DIM)
        z = z.reshape(-1, NUM_HEADS, V_DIM)
        core = core * torch.rsqrt((core * core).mean(-1, keepdim=True) + 1e-6) * self.norm_weight * F.silu(z)
        return core.reshape(-1, NUM_HEADS * V_DIM) @ self.out_proj


class Qwen3_5ForCausalLM:
    def __init__(self, device, attn_backend_ref):
        gen = generator(33810)
        self.device = device
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.layers = [Qwen3_5GatedDeltaNet(i, gen, device, attn_backend_ref) for i in range(NUM_GDN_LAYERS)]
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.6)

    def stages(self):
        """The body's forward, split where ``eager_on_graph`` splits a breakable capture: ``("graph", fn, names)``
        segments return tensors named ``names``; ``("eager", fn, ())`` runs the linear-attention core."""
        n = len(self.layers)

        def segment(i):
            def fn(env):
                if i == 0:
                    hidden = self.embed_tokens[env["input_ids"]]
                else:
                    layer = self.layers[i - 1]
                    hidden = env[f"hidden{i - 1}"] + layer.forward_output_proj(env[f"attn_out{i - 1}"], env[f"z{i - 1}"])
                if i == n:
                    return (hidden,)
                mixed_qkv, z, b, a = self.layers[i].forward_input_proj(hidden)
                return hidden, mixed_qkv, z, b, a, self.layers[i].attn.alloc_output(hidden.shape[0], hidden.device)
            names = ((f"hidden{i}", f"mixed_qkv{i}", f"z{i}", f"b{i}", f"a{i}", f"attn_out{i}") if i < n
                     else (f"hidden{n}",))
            return ("graph", fn, names)

        def core(i):
            def fn(env):
                self.layers[i].attn.bcg_unified_linear_attention_with_output(
                    env["forward_batch"], env[f"mixed_qkv{i}"], env[f"a{i}"], env[f"b{i}"], env[f"attn_out{i}"])
            return ("eager", fn, ())

        out = [segment(0)]
        for i in range(n):
            out += [core(i), segment(i + 1)]
        return out

    def compute_logits(self, hidden, forward_batch):
        """LogitsProcessor (eager prefill tail): the last token of each request."""
        last_index = forward_batch.extend_start_loc + forward_batch.extend_seq_lens - 1
        return hidden[last_index] @ self.lm_head


# --- sglang/srt/model_executor/runner/prefill_cuda_graph_runner.py (BreakableCudaGraphBackend) ------------------------

class PrefillCudaGraphRunner:
    def __init__(self, model_runner):
        self.model_runner = model_runner
        self.device = model_runner.device
        self.capture_num_tokens = CAPTURE_NUM_TOKENS
        self.max_num_tokens = max(CAPTURE_NUM_TOKENS)
        # buffer registry slot "input_ids" (PaddingPolicy.ZERO)
        self.input_ids = torch.zeros(self.max_num_tokens, dtype=torch.int64, device=self.device)
        self.graphs = {}
        self.capture()

    def can_replay_locally(self, num_tokens):
        return num_tokens <= self.max_num_tokens

    def can_run_graph(self, forward_batch):
        if forward_batch.global_num_tokens_cpu is not None and not forward_batch.can_run_dp_breakable_cuda_graph:
            return False
        return len(forward_batch.input_ids) <= self.max_num_tokens

    def capture_prepare(self, num_tokens):
        dev = self.device
        return ForwardBatch(ForwardMode.EXTEND, self.input_ids[:num_tokens],
                            req_pool_indices=torch.arange(1, device=dev),          # request slot 0: dummy
                            extend_seq_lens=torch.tensor([num_tokens], device=dev),
                            extend_prefix_lens=torch.zeros(1, dtype=torch.int64, device=dev), device=dev)

    def capture(self):
        for num_tokens in reversed(self.capture_num_tokens):
            forward_batch = self.capture_prepare(num_tokens)
            self.model_runner.attn_backend.init_forward_metadata(forward_batch)
            env = {"input_ids": self.input_ids[:num_tokens], "forward_batch": forward_batch}
            segments = []
            for k, (kind, fn, names) in enumerate(self.model_runner.model.stages()):
                if kind == "eager":
                    fn(env)
                    segments.append((kind, fn, names, None, None))
                    continue
                g, out = capture(lambda fn=fn, env=env: fn(env), device=self.device,
                                 name=f"prefill bcg {num_tokens} segment {k}",
                                 owner="PrefillCudaGraphRunner (breakable)",
                                 static={"input_ids": self.input_ids} if k == 0 else None)
                env.update(zip(names, out))
                segments.append((kind, fn, names, g, out))
            self.graphs[num_tokens] = (segments, env)

    def load_batch(self, forward_batch):
        num_tokens = len(forward_batch.input_ids)
        static_num_tokens = next(s for s in self.capture_num_tokens if s >= num_tokens)
        self.raw_num_tokens = num_tokens
        self.input_ids[num_tokens:static_num_tokens].zero_()                 # PaddingPolicy.ZERO
        self.input_ids[:num_tokens].copy_(forward_batch.input_ids)
        self.model_runner.attn_backend.init_forward_metadata(forward_batch)   # _prepare_forward_metadata_for_replay
        return static_num_tokens

    def execute(self, forward_batch):
        static_num_tokens = self.load_batch(forward_batch)
        segments, env = self.graphs[static_num_tokens]
        env["forward_batch"] = forward_batch
        for kind, fn, names, g, out in segments:
            if kind == "eager":
                fn(env)
            else:
                views = replay(g, out, real=self.raw_num_tokens, size=static_num_tokens)
                env.update(zip(names, views))
        hidden = env[f"hidden{NUM_GDN_LAYERS}"]
        return self.model_runner.model.compute_logits(hidden, forward_batch)


# --- sglang/srt/model_executor/model_runner.py --------------------------------------------------------------------------

class ModelRunner:
    def __init__(self, attn_dp_rank, device, prefill_cuda_graph):
        self.attn_dp_rank, self.device = attn_dp_rank, device
        self.ctx = CudaContext(device)
        self.req_to_token_pool = HybridReqToTokenPool(REQ_POOL_SIZE, MAMBA_POOL_SIZE, NUM_GDN_LAYERS, device)
        self.attn_backend = GDNAttnBackend(self.req_to_token_pool)
        self.model = Qwen3_5ForCausalLM(device, lambda: self.attn_backend)
        self.server_args_prefill_cg_bs = CAPTURE_NUM_TOKENS if prefill_cuda_graph else None
        self.prefill_cuda_graph_runner = None
        if prefill_cuda_graph:
            _current_ctx.append(self.ctx)
            try:
                self.prefill_cuda_graph_runner = PrefillCudaGraphRunner(self)
            finally:
                _current_ctx.pop()

    def forward(self, forward_batch):
        if forward_batch.forward_mode.is_idle():
            return torch.zeros(0, VOCAB, device=self.device)
        _current_ctx.append(self.ctx)
        try:
            runner = self.prefill_cuda_graph_runner
            if runner is not None and runner.can_run_graph(forward_batch):
                return runner.execute(forward_batch)
            return self.forward_extend(forward_batch)
        finally:
            _current_ctx.pop()

    def forward_extend(self, forward_batch):
        self.attn_backend.init_forward_metadata(forward_batch)
        env = {"input_ids": forward_batch.input_ids, "forward_batch": forward_batch}
        for kind, fn, names in self.model.stages():
            if kind == "eager":
                fn(env)
            else:
                env.update(zip(names, fn(env)))
        return self.model.compute_logits(env[f"hidden{NUM_GDN_LAYERS}"], forward_batch)


# --- the DP-attention scheduler (scheduler_components/dp_attn.py) -----------------------------------------------------

class Req:
    def __init__(self, rid, tokens):
        self.rid, self.tokens = rid, tokens
        self.req_pool_idx = None
        self.prefix_len = 0


class DataParallelGroup:
    def __init__(self, device, prefill_cuda_graph):
        self.device = device
        self.ranks = [ModelRunner(r, device, prefill_cuda_graph) for r in range(DP_SIZE)]

    def _build_batch(self, runner, scheduled):
        dev = self.device
        if not scheduled:
            return ForwardBatch(ForwardMode.IDLE, torch.zeros(0, dtype=torch.int64, device=dev),
                                torch.zeros(0, dtype=torch.int64, device=dev),
                                torch.zeros(0, dtype=torch.int64, device=dev),
                                torch.zeros(0, dtype=torch.int64, device=dev), dev)
        ids, pool_idx, ext, pre = [], [], [], []
        for req, n in scheduled:
            if req.req_pool_idx is None:
                runner.req_to_token_pool.alloc(req)
            ids += req.tokens[req.prefix_len:req.prefix_len + n]
            pool_idx.append(req.req_pool_idx)
            ext.append(n)
            pre.append(req.prefix_len)
            req.prefix_len += n
        t = lambda xs: torch.tensor(xs, dtype=torch.int64).to(dev)  # noqa: E731
        return ForwardBatch(ForwardMode.EXTEND, t(ids), t(pool_idx), t(ext), t(pre), dev)

    def prepare_mlp_sync_batch_raw(self, batches):
        """all_gather of (num_tokens, can_run_prefill_cuda_graph, is_extend); one D2H copy per rank."""
        for runner in self.ranks:
            runner.ctx.synchronize()
        global_num_tokens, votes = [], []
        for runner, batch in zip(self.ranks, batches):
            idle = batch.forward_mode.is_idle()
            num_tokens = 0 if idle else len(batch.input_ids)
            global_num_tokens.append(num_tokens)
            runner_g = runner.prefill_cuda_graph_runner
            votes.append(idle or (runner_g is not None and runner_g.can_replay_locally(num_tokens)))
        is_extend_in_batch = any(b.forward_mode.is_extend() for b in batches)
        for batch in batches:
            batch.global_num_tokens_cpu = global_num_tokens
            batch.is_extend_in_batch = is_extend_in_batch
            batch.can_run_dp_breakable_cuda_graph = min(votes)

    def step(self, scheduled_per_rank):
        batches = [self._build_batch(r, s) for r, s in zip(self.ranks, scheduled_per_rank)]
        self.prepare_mlp_sync_batch_raw(batches)
        outs = []
        for runner, batch in zip(self.ranks, batches):
            batch.prepare_mlp_sync_batch(runner)
            logits = batch.post_forward_mlp_sync_batch(runner.forward(batch)).clone()
            if logits.shape[0]:
                runner.ctx.synchronize()                        # sampled tokens to the host
                logits.argmax(-1).tolist()
            outs.append(logits)
        return outs


def run(variant: str, device: str = "cpu"):
    global _kernel_variant
    _kernel_variant = variant
    gen = generator(3381)

    def toks(n):
        return torch.randint(0, VOCAB, (n,), generator=gen).tolist()

    prompts = {"A": toks(8), "B": toks(7), "C": toks(6), "E": toks(4)}
    schedule = [([("A", 5)], [("B", 7)]),            # both ranks prefill
                ([("C", 6)], []),                    # rank 1 has nothing to run
                ([("A", 3)], [("E", 4)])]            # A's second chunk continues from its saved state

    def serve(prefill_cuda_graph: bool):
        group = DataParallelGroup(device, prefill_cuda_graph)
        reqs = {rid: Req(rid, tokens) for rid, tokens in prompts.items()}
        outs = []
        for per_rank in schedule:
            outs += group.step([[(reqs[rid], n) for rid, n in sched] for sched in per_rank])
        group.prepare_mlp_sync_batch_raw([group._build_batch(r, []) for r in group.ranks])   # the next (idle) step
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
