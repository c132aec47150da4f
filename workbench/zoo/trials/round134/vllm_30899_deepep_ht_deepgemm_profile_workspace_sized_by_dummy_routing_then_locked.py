"""vLLM with data-parallel attention and expert-parallel MoE over DeepEP high-throughput kernels, DeepGEMM fp8 experts
and piecewise CUDA graphs: ``GPUModelRunner.capture_model`` ends with ``lock_workspace()``, after which the shared
``WorkspaceManager`` arena may no longer grow (graphs captured before hold its address). Its size must therefore be
the worst case by then, and for DP+EP ``FusedMoEModularKernel._allocate_buffers`` reserves it during the profile run:
``workspace_shapes(VLLM_FUSED_MOE_CHUNK_SIZE, ..., expert_tokens_meta)``. But ``DeepGemmExperts.workspace_shapes``
sizes its permuted rows by ``compute_aligned_M``, which, given DeepEP's per-expert token counts, returns the tokens
that actually arrived instead of the bound for ``M`` tokens; the profile run's dummy batch (every token the same id)
sends its tokens to one expert per rank, so each rank reserves only that. The first real prefill whose routing sends
more (token, expert) pairs to a rank asks the locked arena for more and fails; with ``--enforce-eager`` (no capture,
no lock) the arena simply grows.

Upstream: https://github.com/vllm-project/vllm/pull/30899 ("[BugFix] Workspace allocation during profile run :
DeepEPHighThroughput + DeepGEMM", vllm-project/vllm, by Varun Sundar Rabindranath (varun-sundar-rabindranath), opened
and merged 2025-12-17, LGTM by LucasWilkinson), squash commit e3fc374a9a69dddb16885d810f1e28d3fdd39ebd, read in a
stored mirror of vLLM's history (local-inference-lab/vllm). Read: the whole diff (one hunk of
``vllm/model_executor/layers/fused_moe/modular_kernel.py``: in ``_allocate_buffers``' profile-run block the call to
``workspace_shapes`` passes ``expert_tokens_meta=None`` instead of ``expert_tokens_meta``) and the PR description in
the stored issue corpus. At the parent (e3fc374a9^): ``modular_kernel.py`` (``ExpertTokensMetadata.make_from_list``,
``FusedMoEModularKernel.__init__``'s ``is_dp_ep``, ``_chunk_info``, ``_allocate_buffers``,
``_slice_expert_tokens_metadata``, ``_prepare``, ``_fused_experts``, ``_finalize``), ``deep_gemm_utils.py``
(``expert_num_tokens_round_up_and_sum``, ``compute_aligned_M``, ``deepgemm_moe_permute``,
``deepgemm_unpermute_and_reduce``, the head of ``_fwd_kernel_ep_scatter_1``), ``deep_gemm_moe.py``
(``DeepGemmExperts``: ``supports_chunking``, ``workspace_shapes``, ``apply``), ``deepep_ht_prepare_finalize.py``
(``_do_dispatch``, ``_receiver``), ``vllm/v1/worker/workspace.py`` (whole file), ``gpu_model_runner.py``
(``capture_model`` with its early return for ``CUDAGraphMode.NONE`` and the final ``lock_workspace()``,
``_capture_cudagraphs``, ``profile_run``'s ``_dummy_run(self.max_num_tokens, is_profile=True)``, the parts of
``_dummy_run`` that set ``attn_metadata`` (None unless FULL or ``force_attention``) and ``input_ids``), and
``gpu_worker.py``'s call of ``capture_model`` only without ``enforce_eager``. Also read, for the configuration: the
diff of #27426 (1840c5cb1, 2025-11-21, which added the profile-run reservation), of #29558 (17eb25e32, 2025-12-06:
DeepEP HT with DP > 1 gets piecewise graphs, ``vllm::moe_forward`` added to ``splitting_ops``) and of #30910
(30bb19a76, 2025-12-18: partial revert, DeepEP HT with DP > 1 back to ``cudagraph_mode = NONE``).
Not read: DeepEP's and DeepGEMM's kernels, the Triton bodies of ``ep_scatter`` / ``ep_gather`` past their first
lines, ``_make_buffer`` (I take ``input_ids`` to start zeroed), the piecewise backend's splitting and how a piece reads
a splitting op's fresh output across replays, the cudagraph dispatcher, DP padding and ``num_tokens_across_dp``,
Qwen3-MoE's modelling code, any issue thread (the PR cites none).
Symptom: the PR: with ``VLLM_ALL2ALL_BACKEND="deepep_high_throughput" vllm serve Qwen/Qwen3-30B-A3B-FP8
--data-parallel-size 2 --enable-expert-parallel`` and a benchmark of 256 prompts of 4096 random tokens, the server
"Trips the assert" of ``workspace.py`` line 139 (``Workspace is locked but allocation from ... requires ... MB,
current size is ... MB``); "DeepGEMM + DeepEPHighThroughput, uses the ``expert_tokens_meta`` for allocating
optimal/minimal amount of workspace when ``expert_tokens_meta`` is available ... This prevents profile run from
estimating the maximum workspace size properly."
Mechanism: ``profile_run`` and every capture-time dummy run have ``attn_metadata`` None, which ``_allocate_buffers``
takes for a profile run; with ``is_dp_ep`` it reserves ``workspace_shapes(VLLM_FUSED_MOE_CHUNK_SIZE, ...)`` in the
rank's arena. DeepEP HT's receiver hands DeepGEMM ``expert_tokens_meta`` with the per-local-expert counts on the CPU,
and ``compute_aligned_M`` then returns the sum of those counts rounded up per expert, ignoring ``M``: the
"worst-case" reservation is the dummy batch's own traffic (here 32 tokens, one pair each, to rank 0). The capture
runs change nothing (their batches are smaller), ``capture_model`` locks, and a prefill of 14 tokens per rank, each
routed to two of rank 0's experts, brings rank 0 56 (token, expert) pairs, 64 aligned rows, and
``_ensure_workspace_size`` raises. Without graphs ``capture_model`` returns before locking and the same request grows
the arena. In this configuration (#29558's) the MoE op runs eagerly between the pieces, so no captured piece reads the
MoE's slices of the arena: the lock is the runner's rule once anything is captured (it protects the graphs that do
slice the arena), the failure needs graphs captured rather than replayed, and the step that fails is an eager prefill
above the largest capture size, as in the report (256 prompts of 4096 tokens).
Doctor: undersized-buffer, at _allocate_buffers. The arena is fixed (locked) when the graphs are captured, and a
served step's data does not fit it; the size it was fixed at is decided in ``_allocate_buffers``' profile-run block,
the line the fix changes, and the failing request is made in the same function. No memory is freed or moved (the lock
refuses the growth that would free it), no path differs between warmup and replay, and no graph reads a stale row.
Fix (upstream): pass ``expert_tokens_meta=None`` to the profile-run ``workspace_shapes`` call, so
``compute_aligned_M`` returns the bound ``round_up(M * topk + local_num_experts * (alignment - 1), alignment)`` for
``M = VLLM_FUSED_MOE_CHUNK_SIZE``.
Modelled: ``WorkspaceManager`` (``lock``, ``get_simultaneous``, ``_ensure_workspace_size``, its message),
``init_workspace_manager`` / ``current_workspace_manager`` / ``lock_workspace``, ``set_forward_context`` /
``get_forward_context`` / ``is_forward_context_available``, ``ExpertTokensMetadata.make_from_list``,
``expert_num_tokens_round_up_and_sum``, ``compute_aligned_M``, ``_resize_cache``, ``deepgemm_moe_permute``,
``deepgemm_unpermute_and_reduce``, ``DeepGemmExperts`` (``supports_chunking``, ``workspace_dtype``,
``moe_problem_size``, ``workspace_shapes``, ``apply``), ``DeepEPHTPrepareAndFinalize`` (``prepare_async``,
``_do_dispatch``, ``_receiver`` with its -1 remap and ``make_from_list``, ``finalize_async``),
``FusedMoEModularKernel`` (``is_dp_ep``, ``_chunk_info``, ``_allocate_buffers`` bug/fix as in the diff,
``_fused_experts`` with the ``M_full == 0`` branch, ``forward``), ``FusedMoE`` with ``expert_map``,
``CUDAGraphWrapper`` (one graph per size, one pool), ``GPUModelRunner`` (``_dummy_run``, ``profile_run``,
``capture_model`` with warmup then capture per size, largest first, the early return and the final
``lock_workspace()``, ``execute_model`` padding to a capture size or running eagerly above the largest).
Stand-ins: the two DP/EP ranks run in one process as generators that meet at DeepEP's two collectives (``lockstep``);
``DeepEPBuffer`` is an in-process all-to-all (tokens go to each rank owning one of their top-k experts; partial
outputs are summed back in rank order); DeepGEMM's fp8 grouped GEMMs and the activation quantization are float64
gathers (rows with expert id -1 skipped), ``ep_scatter`` / ``ep_gather`` are torch (stable pair order); one decoder
layer: the compiled piece before the MoE is embedding, RMSNorm and the router gate (captured), ``vllm::moe_forward``
runs eagerly as the splitting op, and the residual add, final norm and ``lm_head`` are folded into
``compute_logits`` (eager), so no captured piece reads the splitting op's output; no attention, no KV cache; sizes
scaled down (alignment 4 for 128, chunk 64 for 16K, 16 tokens per rank for ``max_num_batched_tokens``, capture sizes
1, 2, 4); ``input_ids`` int64; DBO, chunking past one chunk, shared experts and EPLB are left out.
Workload: 2 DP ranks, 8 experts (4 per rank), top-2 with renormalization, hidden 16; the dummy token (id 0) routes to
expert 6 (rank 1) and expert 1 (rank 0). Start-up: profile run (16 dummy tokens per rank), capture of sizes 4, 2, 1
(one warmup each); then three steps on both ranks: 3 decode tokens per rank (graph of size 4, one padded row), a
prefill of 14 tokens per rank whose top-2 experts both live on rank 0 (eager, above the largest capture size), 2
decode tokens per rank (graph of size 2). Compared: each rank's logits for its real tokens at each step, against the
same runners with ``cudagraph_mode = NONE`` (``--enforce-eager``).
Measured: bug: misbehaves (raised AssertionError: Workspace is locked but allocation from
'modular_kernel.py:_allocate_buffers' requires 24576 bytes, current size is 20480 bytes. Workspace growth is not
allowed after locking.), on rank 0 at the prefill; the decode steps before it fit. Fix: equals eager (max |graph -
eager| = 0); rank 0's profile reservation is 61952 bytes instead of 20480.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from itertools import accumulate
from typing import Callable, Generator, List, Optional

import torch

from workbench.engine import events, graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/30899"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "_allocate_buffers"
SYMPTOM = ("DP+EP with DeepEP high-throughput and DeepGEMM experts under piecewise CUDA graphs: the profile run "
           "reserves the MoE workspace for the tokens its dummy routing happened to send to the rank, capture locks "
           "the workspace, and a later prefill whose routing sends more tokens there fails with 'Workspace is "
           "locked but allocation ... requires ...'")

DP_SIZE = 2                       # = EP size (DeepEP HT, --data-parallel-size 2 --enable-expert-parallel)
NUM_EXPERTS, TOPK = 8, 2
LOCAL_NUM_EXPERTS = NUM_EXPERTS // DP_SIZE
VOCAB, HIDDEN, INTERMEDIATE = 32, 16, 16
MAX_NUM_TOKENS = 16               # scheduler_config.max_num_batched_tokens (per DP rank)
CUDAGRAPH_CAPTURE_SIZES = [1, 2, 4]
VLLM_FUSED_MOE_CHUNK_SIZE = 64    # envs.VLLM_FUSED_MOE_CHUNK_SIZE (16 * 1024 upstream)
BLOCK_M = 4                       # get_mk_alignment_for_contiguous_layout()[0] (128 upstream)
DTYPE = torch.float64

_variant = "bug"


def round_up(x: int, y: int) -> int:
    return (x + y - 1) // y * y


# --- vllm/forward_context.py (reduced) ------------------------------------------------------------------------------

@dataclasses.dataclass
class ForwardContext:
    attn_metadata: Optional[dict]     # None in dummy runs (profile run, capture); set for scheduled steps
    num_actual_tokens: int


_forward_context: List[ForwardContext] = []


@contextlib.contextmanager
def set_forward_context(attn_metadata, num_actual_tokens):
    _forward_context.append(ForwardContext(attn_metadata, num_actual_tokens))
    try:
        yield
    finally:
        _forward_context.pop()


def is_forward_context_available() -> bool:
    return bool(_forward_context)


def get_forward_context() -> ForwardContext:
    return _forward_context[-1]


# --- vllm/v1/worker/workspace.py (one manager per DP rank; the ranks run in one process here) -------------------------

class WorkspaceManager:
    """One growable byte arena, sliced per call; locked after ``capture_model`` so it can no longer move."""

    def __init__(self, device):
        self._device = device
        self._current_workspaces: List[Optional[torch.Tensor]] = [None]
        self._locked = False

    @staticmethod
    def _workspace_size_bytes(workspace):
        return 0 if workspace is None else workspace.numel() * workspace.element_size()

    def lock(self):
        self._locked = True

    def get_simultaneous(self, *shapes_and_dtypes):
        actual_bytes = [math.prod(s) * d.itemsize for s, d in shapes_and_dtypes]
        aligned_bytes = [round_up(actual, 256) for actual in actual_bytes]
        offsets = list(accumulate([0] + aligned_bytes[:-1]))
        current_workspace = self._ensure_workspace_size(sum(aligned_bytes))
        return [current_workspace[offsets[i]:offsets[i] + actual_bytes[i]].view(shapes_and_dtypes[i][1])
                .reshape(shapes_and_dtypes[i][0]) for i in range(len(shapes_and_dtypes))]

    def _ensure_workspace_size(self, required_bytes):
        current_workspace = self._current_workspaces[0]
        current_size = self._workspace_size_bytes(current_workspace)
        if current_size < required_bytes:
            if self._locked:
                raise AssertionError(
                    f"Workspace is locked but allocation from 'modular_kernel.py:_allocate_buffers' requires "
                    f"{required_bytes} bytes, current size is {current_size} bytes. Workspace growth is not "
                    f"allowed after locking.")
            self._current_workspaces[0] = None
            del current_workspace
            self._current_workspaces[0] = torch.empty((required_bytes,), dtype=torch.uint8, device=self._device)
        return self._current_workspaces[0]


_managers: dict = {}
_current_rank = [0]                  # which DP rank's process is running (stand-in for one process per rank)


def init_workspace_manager(rank, device):
    _managers[rank] = WorkspaceManager(device)


def current_workspace_manager() -> WorkspaceManager:
    return _managers[_current_rank[0]]


def lock_workspace():
    current_workspace_manager().lock()


# --- vllm/model_executor/layers/fused_moe: modular_kernel.py, deep_gemm_utils.py, deep_gemm_moe.py (reduced) ---------

@dataclasses.dataclass
class ExpertTokensMetadata:
    expert_num_tokens: torch.Tensor
    expert_num_tokens_cpu: Optional[torch.Tensor]

    @staticmethod
    def make_from_list(expert_num_tokens_list, device):
        expert_num_tokens_cpu = torch.tensor(expert_num_tokens_list, device="cpu", dtype=torch.int32)
        return ExpertTokensMetadata(expert_num_tokens=expert_num_tokens_cpu.to(device),
                                    expert_num_tokens_cpu=expert_num_tokens_cpu)


def expert_num_tokens_round_up_and_sum(expert_num_tokens, alignment):
    ent = (expert_num_tokens.to(torch.int64) + (alignment - 1)) // alignment * alignment
    return int(torch.sum(ent))


def compute_aligned_M(M, num_topk, local_num_experts, alignment, expert_tokens_meta):
    if expert_tokens_meta is not None and expert_tokens_meta.expert_num_tokens_cpu is not None:
        return expert_num_tokens_round_up_and_sum(expert_tokens_meta.expert_num_tokens_cpu, alignment=alignment)
    # expert_num_tokens information is not available on the cpu: compute the max required size.
    return round_up(M * num_topk + local_num_experts * (alignment - 1), alignment)


def _resize_cache(x, v):
    return x.flatten()[:math.prod(v)].view(*v)


def deepgemm_moe_permute(aq, topk_ids, local_num_experts, expert_map, expert_tokens_meta, aq_out):
    """``ep_scatter``: each local expert's (token, k) pairs go to a BLOCK_M-aligned segment of ``aq_out``; rows no
    pair fills keep expert id -1 (skipped by the grouped GEMM)."""
    M_sum = compute_aligned_M(topk_ids.size(0), topk_ids.size(1), local_num_experts, BLOCK_M, expert_tokens_meta)
    assert aq_out.shape == (M_sum, aq.size(1))
    device = aq.device
    local = expert_map[topk_ids]                                           # (M, topk): local expert or -1
    counts = expert_tokens_meta.expert_num_tokens.to(torch.int64)
    aligned = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    expert_start_loc = torch.cumsum(aligned, 0) - aligned
    flat = local.flatten()
    valid = flat >= 0
    e = flat.clamp(min=0)
    onehot = torch.nn.functional.one_hot(e, local_num_experts) * valid[:, None]
    within = (torch.cumsum(onehot, 0) - onehot).gather(1, e[:, None]).squeeze(1)   # rank of the pair in its expert
    rows = torch.where(valid, expert_start_loc[e] + within, torch.full_like(e, -1))
    expert_ids = torch.full((M_sum,), -1, dtype=torch.int64, device=device)
    expert_ids[rows[valid]] = e[valid]
    token_of_pair = torch.arange(flat.numel(), device=device) // topk_ids.size(1)
    aq_out[rows[valid]] = aq[token_of_pair[valid]]
    inv_perm = rows.view(topk_ids.shape)
    return aq_out, expert_ids, inv_perm


def m_grouped_gemm_nt_contiguous(a, w, out, expert_ids):
    """DeepGEMM's contiguous grouped GEMM (fp8 upstream): ``out[r] = w[expert_ids[r]] @ a[r]`` for rows with a valid
    expert id; rows marked -1 are skipped (left as they were)."""
    rows = torch.nonzero(expert_ids >= 0).squeeze(1)
    out[rows] = (w[expert_ids[rows]] * a[rows][:, None, :]).sum(-1)


def deepgemm_unpermute_and_reduce(a, topk_ids, topk_weights, inv_perm, expert_map, output):
    """``ep_gather``: output[t] = sum over t's local pairs of weight * row; pairs of other ranks' experts add 0."""
    acc = torch.zeros(output.shape, dtype=output.dtype, device=output.device)
    for k in range(topk_ids.size(1)):
        idx = inv_perm[:, k]
        valid = (idx >= 0)[:, None]
        acc = acc + torch.where(valid, topk_weights[:, k:k + 1] * a[idx.clamp(min=0)], torch.zeros_like(acc))
    output.copy_(acc)


class DeepGemmExperts:
    def supports_chunking(self):
        return True

    def workspace_dtype(self, out_dtype):
        return out_dtype

    def moe_problem_size(self, a1q, w1, w2, topk_ids):
        E, N, K = w1.shape
        return E, a1q.size(0), N, K, topk_ids.size(1)

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta):
        M_sum = compute_aligned_M(M, topk, local_num_experts, BLOCK_M, expert_tokens_meta)
        assert M_sum % BLOCK_M == 0
        workspace1 = (M_sum, max(N // 2, K))
        workspace2 = (M_sum, max(N, K))
        output = (M, K)
        return workspace1, workspace2, output

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, expert_map, workspace13, workspace2,
              expert_tokens_meta):
        a1q = hidden_states
        _, N, K = w1.size()
        local_num_experts = w1.size(0)
        M_sum = compute_aligned_M(topk_ids.size(0), topk_ids.size(1), local_num_experts, BLOCK_M,
                                  expert_tokens_meta)
        a1q_perm = _resize_cache(workspace13, (M_sum, K))
        a1q, expert_ids, inv_perm = deepgemm_moe_permute(a1q, topk_ids, local_num_experts, expert_map,
                                                         expert_tokens_meta, a1q_perm)
        mm1_out = _resize_cache(workspace2, (M_sum, N))
        m_grouped_gemm_nt_contiguous(a1q, w1, mm1_out, expert_ids)
        quant_out = _resize_cache(workspace13, (M_sum, N // 2))           # act + (fp8 quant upstream)
        gate, up = mm1_out[:, :N // 2], mm1_out[:, N // 2:]
        quant_out.copy_(torch.nn.functional.silu(gate) * up)
        mm2_out = _resize_cache(workspace2, (M_sum, K))
        m_grouped_gemm_nt_contiguous(quant_out, w2, mm2_out, expert_ids)
        deepgemm_unpermute_and_reduce(mm2_out, topk_ids, topk_weights, inv_perm, expert_map, output)


# --- DeepEP high-throughput all-to-all (stand-in: the EP group's ranks meet in one process) --------------------------

class DeepEPBuffer:
    """``deep_ep.Buffer`` over the EP group: ``dispatch`` sends each token to the ranks owning one of its top-k experts
    and reports, per local expert, how many tokens arrived; ``combine`` sums the ranks' partial outputs back. Each
    rank numbers its calls; call ``seq`` of every rank meets call ``seq`` of the others."""

    def __init__(self, world_size):
        self.world_size, self._rounds = world_size, {}

    def _round(self, seq):
        return self._rounds.setdefault(seq, {"sent": {}, "partials": [], "done": 0})

    def dispatch(self, seq, rank, x, topk_idx, topk_weights):
        self._round(seq)["sent"][rank] = (x, topk_idx, topk_weights)

    def receive(self, seq, rank):
        sent = self._round(seq)["sent"]
        assert len(sent) == self.world_size, "dispatch is collective: every EP rank must have sent"
        lo, hi = rank * LOCAL_NUM_EXPERTS, (rank + 1) * LOCAL_NUM_EXPERTS
        xs, ids, ws, handle = [], [], [], []
        for src in range(self.world_size):
            x, topk_idx, topk_weights = sent[src]
            mine = (topk_idx >= lo) & (topk_idx < hi)
            sel = torch.nonzero(mine.any(1)).squeeze(1)
            xs.append(x[sel])
            ids.append(torch.where(mine[sel], topk_idx[sel] - lo, torch.full_like(topk_idx[sel], -1)))
            ws.append(topk_weights[sel])
            handle.append((src, sel))
        recv_topk = torch.cat(ids)
        counts = [int((recv_topk == e).sum()) for e in range(LOCAL_NUM_EXPERTS)]
        return torch.cat(xs), recv_topk, torch.cat(ws), counts, handle

    def combine(self, seq, rank, x, handle):
        offset = 0
        for src, sel in handle:
            self._round(seq)["partials"].append((src, rank, sel, x[offset:offset + sel.numel()]))
            offset += sel.numel()

    def receive_combined(self, seq, rank, out):
        rnd = self._round(seq)
        assert len({p[1] for p in rnd["partials"]}) == self.world_size, "combine is collective"
        out.zero_()
        for _, _, sel, part in sorted((p for p in rnd["partials"] if p[0] == rank), key=lambda p: p[1]):
            out.index_add_(0, sel, part)
        rnd["done"] += 1
        if rnd["done"] == self.world_size:
            del self._rounds[seq]
        return out


class DeepEPHTPrepareAndFinalize:
    def __init__(self, buffer, rank):
        self.buffer, self.rank, self.seq = buffer, rank, 0
        self.rank_expert_offset = rank * LOCAL_NUM_EXPERTS

    def prepare_async(self, a1, topk_weights, topk_ids, num_experts):
        return self._do_dispatch(a1, topk_ids, topk_weights, num_experts)

    def _do_dispatch(self, tokens, rank_topk_ids, rank_topk_weights, num_experts):
        self.seq += 1
        self.buffer.dispatch(self.seq, self.rank, tokens, rank_topk_ids, rank_topk_weights)
        return lambda: self._receiver(num_experts)

    def _receiver(self, num_experts):
        expert_x, expert_topk_ids, expert_topk_weights, expert_num_tokens_per_expert_list, self.handle = \
            self.buffer.receive(self.seq, self.rank)
        expert_topk_ids = torch.where(expert_topk_ids == -1,
                                      num_experts - 1 if self.rank_expert_offset == 0 else 0,
                                      expert_topk_ids + self.rank_expert_offset)
        # Makes a GPU-CPU copy.
        expert_tokens_meta = ExpertTokensMetadata.make_from_list(expert_num_tokens_per_expert_list,
                                                                 device=expert_x.device)
        return expert_x, expert_tokens_meta, expert_topk_ids, expert_topk_weights

    def finalize_async(self, output, fused_expert_output):
        self.buffer.combine(self.seq, self.rank, fused_expert_output, self.handle)
        return lambda: self.buffer.receive_combined(self.seq, self.rank, output)


class FusedMoEModularKernel:
    def __init__(self, prepare_finalize, fused_experts, is_dp_ep):
        self.prepare_finalize, self.fused_experts, self.is_dp_ep = prepare_finalize, fused_experts, is_dp_ep

    def _chunk_info(self, M):
        CHUNK_SIZE = max(1, M if not self.fused_experts.supports_chunking() else min(M, VLLM_FUSED_MOE_CHUNK_SIZE))
        return -(-M // CHUNK_SIZE), CHUNK_SIZE

    def _allocate_buffers(self, out_dtype, device, M_chunk, M_full, N, K, top_k, global_num_experts,
                          local_num_experts, expert_tokens_meta):
        assert M_full > 0 and M_chunk > 0
        num_chunks, _ = self._chunk_info(M_full)
        workspace_dtype = self.fused_experts.workspace_dtype(out_dtype)

        # Force worst-case allocation in profiling run for "mk.FusedMoEModularKernel.Standard" formats where this is
        # only bounded by `VLLM_FUSED_MOE_CHUNK_SIZE` and may not be seen during profiling with DP+EP due to the
        # random token routing.
        is_profile_run = is_forward_context_available() and get_forward_context().attn_metadata is None
        if is_profile_run and self.fused_experts.supports_chunking() and self.is_dp_ep:
            max_workspace_13, max_workspace_2, max_fused_out_shape = self.fused_experts.workspace_shapes(
                VLLM_FUSED_MOE_CHUNK_SIZE, N, K, top_k, global_num_experts, local_num_experts,
                # fix: expert_tokens_meta help in allocating optimal/minimal amount of workspace. Mark it None, so
                # we allocate for the worst-case scenario.
                expert_tokens_meta if _variant == "bug" else None)
            current_workspace_manager().get_simultaneous(
                (max_workspace_13, workspace_dtype), (max_workspace_2, workspace_dtype),
                (max_fused_out_shape, out_dtype))

        workspace13_shape, workspace2_shape, _ = self.fused_experts.workspace_shapes(
            M_chunk, N, K, top_k, global_num_experts, local_num_experts, expert_tokens_meta)
        _, _, fused_out_shape = self.fused_experts.workspace_shapes(
            M_full, N, K, top_k, global_num_experts, local_num_experts, expert_tokens_meta)
        if num_chunks == 1 and math.prod(workspace13_shape) >= math.prod(fused_out_shape):
            workspace13, workspace2 = current_workspace_manager().get_simultaneous(
                (workspace13_shape, workspace_dtype), (workspace2_shape, workspace_dtype))
            fused_out = _resize_cache(workspace13, fused_out_shape)
        else:
            workspace13, workspace2, fused_out = current_workspace_manager().get_simultaneous(
                (workspace13_shape, workspace_dtype), (workspace2_shape, workspace_dtype),
                (fused_out_shape, out_dtype))
        return workspace13, workspace2, fused_out

    def _fused_experts(self, in_dtype, a1q, w1, w2, topk_weights, topk_ids, global_num_experts,
                       local_num_experts, expert_map, expert_tokens_meta):
        _, M_full, N, K, top_k = self.fused_experts.moe_problem_size(a1q, w1, w2, topk_ids)
        num_chunks, CHUNK_SIZE = self._chunk_info(M_full)
        if M_full == 0:     # none of the tokens from the all2all reach this EP rank (DeepEP HT only)
            return torch.empty_like(a1q, dtype=in_dtype)
        assert num_chunks == 1, "every step of this workload fits one chunk"
        workspace13, workspace2, fused_out = self._allocate_buffers(
            in_dtype, a1q.device, CHUNK_SIZE, M_full, N, K, top_k, global_num_experts, local_num_experts,
            expert_tokens_meta)
        self.fused_experts.apply(fused_out, a1q, w1, w2, topk_weights, topk_ids, expert_map, workspace13,
                                 workspace2, expert_tokens_meta)
        return fused_out

    def forward(self, hidden_states, w1, w2, topk_weights, topk_ids, global_num_experts, expert_map):
        """A generator: it yields where the EP ranks meet (dispatch, combine); ``lockstep`` runs the ranks."""
        output = torch.zeros_like(hidden_states)
        receiver = self.prepare_finalize.prepare_async(hidden_states, topk_weights, topk_ids, global_num_experts)
        yield
        a1q, expert_tokens_meta, topk_ids, topk_weights = receiver()
        fused_out = self._fused_experts(hidden_states.dtype, a1q, w1, w2, topk_weights, topk_ids,
                                        global_num_experts, w1.size(0), expert_map, expert_tokens_meta)
        combine_receiver = self.prepare_finalize.finalize_async(output, fused_out)
        yield
        combine_receiver()
        return output


def select_experts(router_logits, top_k):
    """``fused_topk`` with ``renormalize=True`` (Qwen3-MoE)."""
    scores = torch.softmax(router_logits, dim=-1)
    topk_weights, topk_ids = torch.topk(scores, top_k, dim=-1)
    return topk_weights / topk_weights.sum(-1, keepdim=True), topk_ids


class FusedMoE:
    """One DP/EP rank's shard of the MoE layer: its local experts, the expert map, the modular kernel."""

    def __init__(self, rank, weights, ep_buffer, device):
        lo = rank * LOCAL_NUM_EXPERTS
        self.w13_weight = weights["w13"][lo:lo + LOCAL_NUM_EXPERTS]
        self.w2_weight = weights["w2"][lo:lo + LOCAL_NUM_EXPERTS]
        expert_map = torch.full((NUM_EXPERTS,), -1, dtype=torch.int64)
        expert_map[lo:lo + LOCAL_NUM_EXPERTS] = torch.arange(LOCAL_NUM_EXPERTS)
        self.expert_map = expert_map.to(device)
        self.quant_method = FusedMoEModularKernel(DeepEPHTPrepareAndFinalize(ep_buffer, rank),
                                                  DeepGemmExperts(), is_dp_ep=True)

    def forward(self, hidden_states, router_logits):
        topk_weights, topk_ids = select_experts(router_logits, TOPK)
        return (yield from self.quant_method.forward(hidden_states, self.w13_weight, self.w2_weight, topk_weights,
                                                     topk_ids, NUM_EXPERTS, self.expert_map))


# --- the model (one MoE decoder layer; per DP rank) and the piecewise CUDA graph wrapper ------------------------------

def rms_norm(x, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class Qwen3MoeForCausalLM:
    def __init__(self, rank, weights, ep_buffer, device):
        self.weights = weights
        self.experts = FusedMoE(rank, weights, ep_buffer, device)
        self.piece0 = self.embed_norm_gate            # the compiled piece before the splitting op
        self.is_graph_capturing = False

    def embed_norm_gate(self, input_ids):
        residual = self.weights["embed"][input_ids]
        hidden_states = rms_norm(residual)
        router_logits = hidden_states @ self.weights["gate"].T
        return residual, hidden_states, router_logits

    def forward(self, input_ids):
        residual, hidden_states, router_logits = self.piece0(input_ids)
        with events.dummy_run() if self.is_graph_capturing else contextlib.nullcontext():
            # vllm::moe_forward: a splitting op under DeepEP HT, so it runs eagerly between the graph pieces
            moe_out = yield from self.experts.forward(hidden_states, router_logits)
        return residual, moe_out

    def compute_logits(self, residual, moe_out):
        return rms_norm(residual + moe_out) @ self.weights["lm_head"].T



class CUDAGraphWrapper:
    """``vllm/compilation/cuda_graph.py`` for one piece: one graph per captured size, shared pool."""

    def __init__(self, runnable, runner):
        self.runnable, self.runner = runnable, runner
        self.concrete_cudagraph_entries = {}

    def __call__(self, input_ids):
        size = input_ids.shape[0]
        if self.runner.cudagraph_runtime_mode != "PIECEWISE":
            return self.runnable(input_ids)
        if size not in self.concrete_cudagraph_entries:
            g, out = capture(lambda: self.runnable(input_ids), device=self.runner.device, pool=self.runner.pool,
                             warmups=0, static={"input_ids": self.runner.input_ids},
                             owner=f"GPUModelRunner (DP rank {self.runner.rank})",
                             name=f"rank {self.runner.rank} piece 0 size {size}")
            self.concrete_cudagraph_entries[size] = (g, out)
            return out
        g, out = self.concrete_cudagraph_entries[size]
        return replay(g, out, real=get_forward_context().num_actual_tokens, size=size,
                      padded={"input_ids": self.runner.input_ids})


class GPUModelRunner:
    def __init__(self, rank, weights, ep_buffer, device, use_cuda_graph):
        self.rank, self.device = rank, device
        self.model = Qwen3MoeForCausalLM(rank, weights, ep_buffer, device)
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)
        self.cudagraph_mode = "PIECEWISE" if use_cuda_graph else "NONE"
        self.cudagraph_batch_sizes = CUDAGRAPH_CAPTURE_SIZES
        self.cudagraph_runtime_mode = "NONE"
        init_workspace_manager(rank, device)
        if use_cuda_graph:
            self.pool = graph_pool_handle(device)
            self.model.piece0 = CUDAGraphWrapper(self.model.embed_norm_gate, self)

    def _dummy_run(self, num_tokens, cudagraph_runtime_mode="NONE", is_graph_capturing=False):
        # attn_metadata stays None (no FULL graphs): to _allocate_buffers every dummy run is a profile run
        self.cudagraph_runtime_mode, self.model.is_graph_capturing = cudagraph_runtime_mode, is_graph_capturing
        try:
            return (yield from self.model.forward(self.input_ids[:num_tokens]))
        finally:
            self.model.is_graph_capturing = False

    def profile_run(self):
        yield from self._dummy_run(MAX_NUM_TOKENS)

    def capture_model(self):
        if self.cudagraph_mode == "NONE":
            return                                     # "Skipping CUDA graph capture": the workspace stays unlocked
        for num_tokens in reversed(self.cudagraph_batch_sizes):   # largest first
            with events.warmup():
                yield from self._dummy_run(num_tokens, "NONE")
            yield from self._dummy_run(num_tokens, "PIECEWISE", is_graph_capturing=True)
        # Lock workspace to prevent resizing during execution.
        # Max workspace sizes should have been captured during warmup/profiling.
        lock_workspace()

    def execute_model(self, token_ids):
        num_tokens = len(token_ids)
        self.input_ids[:num_tokens].copy_(torch.tensor(token_ids, dtype=torch.int64))
        if self.cudagraph_mode != "NONE" and num_tokens <= self.cudagraph_batch_sizes[-1]:
            self.cudagraph_runtime_mode = "PIECEWISE"
            num_input_tokens = next(s for s in self.cudagraph_batch_sizes if s >= num_tokens)
        else:
            self.cudagraph_runtime_mode, num_input_tokens = "NONE", num_tokens
        residual, moe_out = yield from self.model.forward(self.input_ids[:num_input_tokens])
        return self.model.compute_logits(residual[:num_tokens], moe_out[:num_tokens])


def lockstep(steps: List[Generator]):
    """The DP ranks are separate processes upstream that meet in DeepEP's collectives; here they are generators run
    round-robin, each with its own rank's workspace manager current."""
    results: List[object] = [None] * len(steps)
    live = list(range(len(steps)))
    while live:
        for rank in list(live):
            _current_rank[0] = rank
            try:
                next(steps[rank])
            except StopIteration as stop:
                results[rank] = stop.value
                live.remove(rank)
        assert not live or len(live) == len(steps), "ranks out of lockstep"
    return results


def _run_steps(make_steps: Callable[[int], Generator], attn_metadata, num_actual_tokens):
    with set_forward_context(attn_metadata, num_actual_tokens):
        return lockstep([make_steps(rank) for rank in range(DP_SIZE)])


def _weights(device):
    gen = generator(30904)
    w = {"embed": torch.randn(VOCAB, HIDDEN, generator=gen, dtype=DTYPE),
         "gate": torch.randn(NUM_EXPERTS, HIDDEN, generator=gen, dtype=DTYPE),
         "w13": torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=gen, dtype=DTYPE) * 0.3,
         "w2": torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, generator=gen, dtype=DTYPE) * 0.3,
         "lm_head": torch.randn(VOCAB, HIDDEN, generator=gen, dtype=DTYPE)}
    return {k: v.to(device) for k, v in w.items()}, gen


def _routes(weights):
    logits = rms_norm(weights["embed"]) @ weights["gate"].T
    return torch.topk(torch.softmax(logits, -1), TOPK, dim=-1).indices.cpu()


def _workload(weights, gen):
    routes = _routes(weights)
    on_rank0 = routes < LOCAL_NUM_EXPERTS
    # the dummy runs' token (id 0) is routed to one expert on each rank: both ranks see traffic while profiling
    assert int(on_rank0[0].sum()) == 1, "dummy token must route to one expert per rank"
    skewed = [t for t in range(VOCAB) if bool(on_rank0[t].all())]       # both of its experts live on rank 0
    assert skewed, "need tokens the router sends to rank 0's experts only"
    decode = [torch.randint(0, VOCAB, (3,), generator=gen).tolist() for _ in range(DP_SIZE)]
    prefill = [[skewed[(7 * r + i) % len(skewed)] for i in range(14)] for r in range(DP_SIZE)]
    decode2 = [torch.randint(0, VOCAB, (2,), generator=gen).tolist() for _ in range(DP_SIZE)]
    return [decode, prefill, decode2]


def _serve(device, use_cuda_graph):
    weights, gen = _weights(device)
    ep_buffer = DeepEPBuffer(DP_SIZE)
    runners = [GPUModelRunner(r, weights, ep_buffer, device, use_cuda_graph) for r in range(DP_SIZE)]
    _run_steps(lambda r: runners[r].profile_run(), None, MAX_NUM_TOKENS)
    _run_steps(lambda r: runners[r].capture_model(), None, 0)
    outs = []
    for step in _workload(weights, gen):
        n = len(step[0])
        logits = _run_steps(lambda r: runners[r].execute_model(step[r]), {"num_actual_tokens": n}, n)
        outs.extend(logits)
    return outs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: _serve(device, True), lambda: _serve(device, False))
