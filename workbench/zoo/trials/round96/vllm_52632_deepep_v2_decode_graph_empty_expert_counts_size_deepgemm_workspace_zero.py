"""DeepEP v2's CUDA-graph (decode) dispatch returns no per-expert counts, but ``_receiver`` still wraps the empty list in an ``ExpertTokensMetadata``; DeepGEMM sizes its permute workspace from it (``M_sum == 0``) and ``ep_scatter`` writes out of bounds.

Upstream: https://github.com/vllm-project/vllm/pull/52632 ("[Bugfix] DeepEP-V2: expert_tokens_meta must be None on the
decode/cudagraph path (empty recv_expert_num_tokens)", vllm-project/vllm, merged, opened 2026-08-17). Read: the PR
description (startup crash of graph-enabled serving with ``--all2all-backend deepep_v2``: Triton illegal memory access /
``CUDA_ERROR_LAUNCH_FAILED`` on EP16, reached through ``profile_run``; ``--enforce-eager`` serves fine); the post-fix
``prepare_finalize/deepep_v2.py`` from a stored copy (class docstring with the decode mode ``use_cudagraph=True`` ->
``do_expand=False, do_cpu_sync=False``, "expert_tokens_meta carries no counts"; ``_do_dispatch``; ``_receiver`` with the
fix and its comment); ``compute_aligned_M`` / ``expert_num_tokens_round_up_and_sum`` of ``deep_gemm_utils.py`` (stored
copies); and the description of the follow-up #50511 by a maintainer ("Constructing metadata from the empty decode list
gives experts zero-length counts; for example, DeepGemm derives ``M_sum == 0`` and fails in ``ep_scatter``"). The pre-fix
line (``make_from_list`` called unconditionally) is reconstructed from the PR description; the diff itself was not stored.
Symptom: with CUDA graphs enabled (default compilation) and DeepEP v2, the engine dies deterministically at startup with an
illegal memory access in the MoE layer; eager mode works.
Mechanism: for CUDA graphs the decode-mode dispatch must not synchronise with the host, so DeepEP v2 runs with
``do_cpu_sync=False`` and ``handle.num_recv_tokens_per_expert_list`` stays ``[]``. ``_receiver`` nevertheless built
``ExpertTokensMetadata.make_from_list([])``: a metadata object that is present but holds zero-length counts. DeepGEMM's
``workspace_shapes`` trusts present host counts (``compute_aligned_M`` sums ``expert_num_tokens_cpu``), so the permuted
activation workspace gets ``M_sum = 0`` rows instead of the worst-case bound ``M*topk + E*(align-1)``, and ``ep_scatter``
reads the empty per-expert counts and writes every routed token past the end of it. The dummy/profile run of the graph
path already hits it; prefill-mode (eager) dispatch syncs and provides real counts.
Doctor: undersized-buffer, at _receiver. The decode/cudagraph receiver hands the experts a zero-sized count tensor, from
which the expert workspace is sized to zero rows, and the step writes the routed tokens into it.
Fix (upstream): ``_receiver`` builds the metadata only when counts were returned
(``if recv_expert_num_tokens: make_from_list(...) else: expert_tokens_meta = None``); consumers then derive counts on the
device from ``topk_ids`` and size their workspaces for the worst case.
Modelled: ``DeepEPV2PrepareAndFinalize`` (``_do_dispatch`` with ``do_expand/do_cpu_sync = not use_cudagraph`` and the
power-of-two ``num_max_tokens_per_rank``, ``_receiver`` with both branches of the dispatch, ``_globalize_recv_topk_idx``,
``finalize`` -> combine), ``mk.ExpertTokensMetadata.make_from_list``, ``DeepGemmExperts`` (``workspace_shapes`` with
``compute_aligned_M``, ``apply`` with ``deepgemm_moe_permute`` / ``ep_scatter`` / grouped GEMMs / ``ep_gather``) and a
``FusedMoEModularKernel`` that allocates the workspaces. Stand-ins: DeepEP's ``ElasticBuffer`` is one EP rank (dispatch is
a local copy; the expand mode groups rows by expert and syncs the counts; combine sums a token's slots); the fp8 grouped
GEMMs are float64 einsums; the alignment is 4 instead of 128; ``ep_scatter``'s out-of-bounds access is reported by a
shape check (what the GPU turns into an illegal memory access); the router is a softmax top-2 gate.
Workload: a 4-expert top-2 MoE layer, hidden 6, intermediate 4. Served with graphs: decode mode (``use_cudagraph=True``),
one graph captured at 4 tokens after a warm-up (the profile/dummy run), five decode steps of 3, 4, 2, 4 and 1 real tokens
replayed with padding. Eager: prefill mode (``use_cudagraph=False``, host-synced counts) on the real tokens. The bug
raises RuntimeError (illegal memory access in ``ep_scatter``) in the warm-up, as upstream crashed in ``profile_run``; the fix
captures and its five outputs equal eager.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/52632"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "_receiver"
SYMPTOM = ("Graph-enabled serving with DeepEP v2 dies at startup with an illegal memory access: the decode-mode dispatch "
           "returns no expert counts, _receiver wraps the empty list in ExpertTokensMetadata, DeepGEMM sizes its permute "
           "workspace to zero rows and ep_scatter writes past it")

NUM_EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 4, 2, 6, 4
CAPTURE_TOKENS = 4                       # the captured decode size (power of two: num_max_tokens_per_rank)
MAX_TOKENS_PER_RANK = 8                  # ElasticBuffer capacity
DEEPGEMM_ALIGN = 4                       # get_mk_alignment_for_contiguous_layout() stand-in (128 on Hopper)
DTYPE = torch.float64

_variant = "bug"


def round_up(x: int, y: int) -> int:
    return (x + y - 1) // y * y


# --- vllm/model_executor/layers/fused_moe/modular_kernel.py -----------------------------------------------------------

@dataclass
class ExpertTokensMetadata:
    expert_num_tokens: torch.Tensor | None
    expert_num_tokens_cpu: torch.Tensor | None

    @staticmethod
    def make_from_list(expert_num_tokens_list: list[int], device) -> "ExpertTokensMetadata":
        expert_num_tokens_cpu = torch.tensor(expert_num_tokens_list, dtype=torch.int32)
        return ExpertTokensMetadata(expert_num_tokens=expert_num_tokens_cpu.to(device),
                                    expert_num_tokens_cpu=expert_num_tokens_cpu)


# --- deep_ep.ElasticBuffer (stand-in: one EP rank, all experts local) ---------------------------------------------------

@dataclass
class EPHandle:
    num_recv_tokens_per_expert_list: list[int]
    psum_num_recv_tokens_per_scaleup_rank: torch.Tensor
    src_slot: torch.Tensor | None            # expand mode: token * topk + k of every received row


class ElasticBuffer:
    def __init__(self, device):
        # Worst-case receive buffers of the decode (non-expanded) layout: persistent, reused by every dispatch.
        self.recv_x = torch.zeros(MAX_TOKENS_PER_RANK, HIDDEN, dtype=DTYPE, device=device)
        self.recv_topk_idx = torch.zeros(MAX_TOKENS_PER_RANK, TOP_K, dtype=torch.int64, device=device)
        self.recv_topk_weights = torch.zeros(MAX_TOKENS_PER_RANK, TOP_K, dtype=DTYPE, device=device)

    def dispatch(self, x, topk_idx, topk_weights, num_experts, num_max_tokens_per_rank, do_expand, do_cpu_sync):
        n = x.shape[0]
        if not do_expand:
            # Tokens stay in their order in a worst-case slab; no host sync, so no per-expert counts.
            rows = num_max_tokens_per_rank
            self.recv_x[:n].copy_(x)
            self.recv_topk_idx[:n].copy_(topk_idx)
            self.recv_topk_weights[:n].copy_(topk_weights)
            psum = torch.full((1,), n, dtype=torch.int32, device=x.device)
            handle = EPHandle([], psum, None)
            return self.recv_x[:rows], self.recv_topk_idx[:rows], self.recv_topk_weights[:rows], handle
        # Expand mode: one row per (token, expert) slot, grouped by expert; the CPU sync returns the counts.
        flat_ids = topk_idx.reshape(-1)
        order = torch.sort(flat_ids, stable=True).indices
        counts = torch.bincount(flat_ids, minlength=num_experts)
        handle = EPHandle(counts.tolist() if do_cpu_sync else [],
                          torch.full((1,), flat_ids.numel(), dtype=torch.int32, device=x.device), order)
        return x[order // TOP_K], None, topk_weights.reshape(-1)[order], handle

    def combine(self, x, handle, num_tokens):
        if handle.src_slot is None:
            return x[:num_tokens]                                     # decode: rows already in token order
        slots = torch.zeros(num_tokens * TOP_K, HIDDEN, dtype=x.dtype, device=x.device)
        slots.index_copy_(0, handle.src_slot, x)
        return slots.view(num_tokens, TOP_K, HIDDEN).sum(1)


# --- vllm/model_executor/layers/fused_moe/prepare_finalize/deepep_v2.py -----------------------------------------------

def _globalize_recv_topk_idx(recv_topk_idx, psum_recv_per_rank, rank_expert_offset, num_experts):
    """Local expert ids of valid rows -> global; every row past the received tokens -> -1."""
    rows = torch.arange(recv_topk_idx.shape[0], device=recv_topk_idx.device)[:, None]
    valid = (rows < psum_recv_per_rank[-1]) & (recv_topk_idx >= 0) & (recv_topk_idx < num_experts)
    return torch.where(valid, recv_topk_idx + rank_expert_offset, torch.full_like(recv_topk_idx, -1))


class DeepEPV2PrepareAndFinalize:
    """Decode mode (use_cudagraph=True): do_expand=False, do_cpu_sync=False, fully cudagraph-capturable, expert kernel
    sorts internally. Prefill mode (use_cudagraph=False): do_expand=True, do_cpu_sync=True, exact per-expert layout."""

    def __init__(self, buffer, num_experts, num_topk, use_cudagraph, max_tokens_per_rank, rank_expert_offset=0):
        self.buffer, self.num_experts, self.num_topk = buffer, num_experts, num_topk
        self.use_cudagraph, self.max_tokens_per_rank = use_cudagraph, max_tokens_per_rank
        self.rank_expert_offset = rank_expert_offset
        self.handle = None

    def _do_dispatch(self, tokens, rank_topk_ids, rank_topk_weights, num_experts):
        do_expand = not self.use_cudagraph
        do_cpu_sync = not self.use_cudagraph
        num_max_tokens_per_rank = None
        if not do_expand:
            n = tokens.shape[0]                                       # dp_metadata is None: one DP rank
            num_max_tokens_per_rank = 1 << max(n - 1, 0).bit_length()
            if n > self.max_tokens_per_rank:
                raise ValueError(f"DeepEP v2 dispatch of {n} tokens per rank exceeds the ElasticBuffer capacity")
            num_max_tokens_per_rank = min(num_max_tokens_per_rank, self.max_tokens_per_rank)
        recv_x, recv_topk_idx, recv_topk_weights, handle = self.buffer.dispatch(
            tokens, rank_topk_ids, rank_topk_weights, num_experts, num_max_tokens_per_rank, do_expand, do_cpu_sync)
        self.handle = handle
        return self._receiver(recv_x, recv_topk_idx, num_experts, handle.num_recv_tokens_per_expert_list,
                              recv_topk_weights, handle.psum_num_recv_tokens_per_scaleup_rank)

    def _receiver(self, recv_x, recv_topk_idx, num_experts, recv_expert_num_tokens, recv_topk_weights,
                  psum_recv_per_rank):
        expert_x = recv_x
        if _variant == "bug":
            expert_tokens_meta = ExpertTokensMetadata.make_from_list(recv_expert_num_tokens, device=expert_x.device)
        elif recv_expert_num_tokens:
            expert_tokens_meta = ExpertTokensMetadata.make_from_list(recv_expert_num_tokens, device=expert_x.device)
        else:
            # Decode/cudagraph path (do_cpu_sync=False) leaves recv_expert_num_tokens empty: no metadata.
            expert_tokens_meta = None

        if recv_topk_idx is None:
            # do_expand=True (prefill mode): build topk_ids from the per-expert token counts.
            assert expert_tokens_meta is not None
            total_tokens = sum(recv_expert_num_tokens)
            global_ids = torch.arange(len(recv_expert_num_tokens), device=expert_x.device) + self.rank_expert_offset
            recv_topk_idx = torch.repeat_interleave(global_ids, expert_tokens_meta.expert_num_tokens,
                                                    output_size=total_tokens).unsqueeze(1)
        else:
            recv_topk_idx = _globalize_recv_topk_idx(recv_topk_idx, psum_recv_per_rank, self.rank_expert_offset,
                                                     self.num_experts)
        if recv_topk_weights is not None and recv_topk_weights.ndim == 1:
            recv_topk_weights = recv_topk_weights.unsqueeze(1)
        return expert_x, expert_tokens_meta, recv_topk_idx, recv_topk_weights

    def prepare(self, a1, topk_weights, topk_ids, num_experts):
        return self._do_dispatch(a1, topk_ids, topk_weights, num_experts)

    def finalize(self, fused_expert_output, num_tokens):
        return self.buffer.combine(fused_expert_output, self.handle, num_tokens)


# --- vllm/model_executor/layers/fused_moe/deep_gemm_utils.py -----------------------------------------------------------

def expert_num_tokens_round_up_and_sum(expert_num_tokens: torch.Tensor, alignment: int) -> int:
    ent = (expert_num_tokens.to(torch.int64) + (alignment - 1)) // alignment * alignment
    return int(torch.sum(ent))


def compute_aligned_M(M, num_topk, local_num_experts, alignment, expert_tokens_meta):
    if (expert_tokens_meta is not None) and (expert_tokens_meta.expert_num_tokens_cpu is not None):
        return expert_num_tokens_round_up_and_sum(expert_tokens_meta.expert_num_tokens_cpu, alignment=alignment)
    # expert_num_tokens information is not available on the cpu: compute the max required size.
    M_sum = (M * num_topk) + local_num_experts * (alignment - 1)
    return round_up(M_sum, alignment)


def count_expert_num_tokens(topk_ids, num_local_experts):
    valid = topk_ids >= 0
    hits = (topk_ids.clamp(min=0)[..., None] == torch.arange(num_local_experts, device=topk_ids.device)) & valid[..., None]
    return hits.reshape(-1, num_local_experts).sum(0).to(torch.int32)


def ep_scatter(recv_x, recv_topk, num_recv_tokens_per_expert, expert_start_loc, output_tensor, m_indices, output_index):
    """Stage 1 (one program per expert) lays out ``num_recv_tokens_per_expert[e]`` aligned rows per expert; stage 2
    copies every valid (token, k) slot to ``expert_start_loc[e] + i``. Both read/write raw pointers: an empty count
    tensor or a workspace with fewer rows than the routed slots is an out-of-bounds access on the GPU."""
    num_experts = expert_start_loc.shape[0]
    if num_recv_tokens_per_expert.shape[0] < num_experts or output_tensor.shape[0] < recv_topk.shape[0]:
        raise RuntimeError(
            "CUDA error: an illegal memory access was encountered (ep_scatter: "
            f"{num_recv_tokens_per_expert.shape[0]} expert counts for {num_experts} experts, a "
            f"{output_tensor.shape[0]}-row workspace for {recv_topk.shape[0]} routed tokens)")
    aligned = (num_recv_tokens_per_expert.to(torch.int64) + DEEPGEMM_ALIGN - 1) // DEEPGEMM_ALIGN * DEEPGEMM_ALIGN
    expert_start_loc.copy_(torch.cumsum(aligned, 0) - aligned)
    rows = torch.arange(output_tensor.shape[0], device=output_tensor.device)
    ends = expert_start_loc + num_recv_tokens_per_expert
    in_expert = (rows[:, None] >= expert_start_loc[None]) & (rows[:, None] < ends[None])
    m_indices.copy_(torch.where(in_expert.any(1), in_expert.to(torch.int64).argmax(1), torch.full_like(rows, -1)))
    flat = recv_topk.reshape(-1)
    valid = flat >= 0
    key = torch.where(valid, flat, torch.full_like(flat, num_experts))           # invalid slots sort last
    order = torch.sort(key, stable=True).indices
    sorted_key = key[order]
    first_of_key = torch.searchsorted(sorted_key, sorted_key, right=False)
    rank_in_expert = torch.arange(flat.numel(), device=flat.device) - first_of_key
    dst_sorted = expert_start_loc.gather(0, sorted_key.clamp(max=num_experts - 1)) + rank_in_expert
    dst = torch.empty_like(dst_sorted).scatter_(0, order, dst_sorted)
    dst = torch.where(valid, dst, torch.zeros_like(dst))
    output_index.copy_(torch.where(valid, dst, torch.full_like(dst, -1)).view_as(output_index))
    src = recv_x[:, None, :].expand(-1, recv_topk.shape[1], -1).reshape(flat.numel(), -1) * valid[:, None].to(recv_x.dtype)
    output_tensor.zero_().index_add_(0, dst, src)


def m_grouped_gemm_nt_contiguous(a, w, out, m_indices):
    """DeepGEMM grouped GEMM on the contiguous layout (stand-in): row r uses expert ``m_indices[r]``."""
    out.copy_(torch.einsum("mk,mnk->mn", a, w[m_indices.clamp(min=0)]))


def ep_gather(input_tensor, recv_topk_ids, recv_topk_weight, input_index, output_tensor):
    valid = (recv_topk_ids >= 0).to(input_tensor.dtype)
    picked = input_tensor.index_select(0, input_index.clamp(min=0).reshape(-1)).view(*input_index.shape, -1)
    output_tensor.copy_((picked * (recv_topk_weight * valid)[..., None]).sum(1))


class DeepGemmExperts:
    def workspace_shapes(self, M, N, K, topk, local_num_experts, expert_tokens_meta):
        M_sum = compute_aligned_M(M, topk, local_num_experts, DEEPGEMM_ALIGN, expert_tokens_meta)
        return (M_sum, max(K, N)), (M_sum, max(2 * N, K)), (M, K)

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, workspace13, workspace2,
              expert_tokens_meta, local_num_experts):
        M_sum = workspace13.shape[0]
        K, N = hidden_states.shape[1], w2.shape[2]
        if expert_tokens_meta is not None:
            expert_num_tokens = expert_tokens_meta.expert_num_tokens
        else:
            expert_num_tokens = count_expert_num_tokens(topk_ids, local_num_experts)
        a1q_perm = workspace13[:, :K]                                 # _resize_cache(workspace13, (M_sum, K))
        expert_start_loc = torch.empty(local_num_experts, dtype=torch.int64, device=hidden_states.device)
        m_indices = torch.empty(M_sum, dtype=torch.int64, device=hidden_states.device)
        inv_perm = torch.empty(topk_ids.shape, dtype=torch.int64, device=hidden_states.device)
        # deepgemm_moe_permute
        ep_scatter(hidden_states, topk_ids, expert_num_tokens, expert_start_loc, a1q_perm, m_indices, inv_perm)
        mm1_out = workspace2[:, :2 * N]
        m_grouped_gemm_nt_contiguous(a1q_perm, w1, mm1_out, m_indices)
        act_out = workspace13[:, :N]
        act_out.copy_(F.silu(mm1_out[:, :N]) * mm1_out[:, N:])
        mm2_out = workspace2[:, :K]
        m_grouped_gemm_nt_contiguous(act_out, w2, mm2_out, m_indices)
        # deepgemm_unpermute_and_reduce
        ep_gather(mm2_out, topk_ids, topk_weights, inv_perm, output)


class FusedMoEModularKernel:
    def __init__(self, prepare_finalize, fused_experts):
        self.prepare_finalize, self.fused_experts = prepare_finalize, fused_experts

    def forward(self, hidden_states, w1, w2, topk_weights, topk_ids):
        num_tokens = hidden_states.shape[0]
        a1q, expert_tokens_meta, topk_ids, topk_weights = self.prepare_finalize.prepare(
            hidden_states, topk_weights, topk_ids, NUM_EXPERTS)
        M = a1q.shape[0]
        ws13_shape, ws2_shape, out_shape = self.fused_experts.workspace_shapes(
            M, w2.shape[2], hidden_states.shape[1], topk_ids.shape[1], NUM_EXPERTS, expert_tokens_meta)
        workspace13 = torch.empty(ws13_shape, dtype=DTYPE, device=hidden_states.device)
        workspace2 = torch.empty(ws2_shape, dtype=DTYPE, device=hidden_states.device)
        fused_out = torch.empty(out_shape, dtype=DTYPE, device=hidden_states.device)
        self.fused_experts.apply(fused_out, a1q, w1, w2, topk_weights, topk_ids, workspace13, workspace2,
                                 expert_tokens_meta, NUM_EXPERTS)
        return self.prepare_finalize.finalize(fused_out, num_tokens)


# --- the MoE layer (router + modular kernel) ----------------------------------------------------------------------------

class FusedMoE:
    def __init__(self, device, use_cudagraph):
        gen = generator(52632)
        self.gate = randn(HIDDEN, NUM_EXPERTS, gen=gen, device=device, scale=0.8).to(DTYPE)
        self.w13_weight = randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, gen=gen, device=device, scale=0.5).to(DTYPE)
        self.w2_weight = randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, gen=gen, device=device, scale=0.5).to(DTYPE)
        pf = DeepEPV2PrepareAndFinalize(ElasticBuffer(device), NUM_EXPERTS, TOP_K, use_cudagraph, MAX_TOKENS_PER_RANK)
        self.kernel = FusedMoEModularKernel(pf, DeepGemmExperts())

    def forward(self, hidden_states):
        router_logits = hidden_states @ self.gate
        topk_weights, topk_ids = torch.topk(torch.softmax(router_logits, -1), TOP_K, dim=-1)
        topk_weights = topk_weights / topk_weights.sum(-1, keepdim=True)
        return self.kernel.forward(hidden_states, self.w13_weight, self.w2_weight, topk_weights, topk_ids)


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(526320)
    steps = [randn(n, HIDDEN, gen=gen, device=device).to(DTYPE) for n in (3, 4, 2, 4, 1)]

    def served():
        layer = FusedMoE(device, use_cudagraph=True)
        hidden_states = torch.zeros(CAPTURE_TOKENS, HIDDEN, dtype=DTYPE, device=device)
        g, out = capture(lambda: layer.forward(hidden_states), device=device, warmups=1, name="moe_decode",
                         owner="DeepEPV2 decode runner", static={"hidden_states": hidden_states})
        outputs = []
        for x in steps:
            n = x.shape[0]
            hidden_states[:n].copy_(x)
            got = replay(g, out, real=n, size=CAPTURE_TOKENS, padded={"hidden_states": hidden_states})
            outputs.append(got[:n].clone())
        return outputs

    def eager():
        layer = FusedMoE(device, use_cudagraph=False)
        return [layer.forward(x) for x in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
