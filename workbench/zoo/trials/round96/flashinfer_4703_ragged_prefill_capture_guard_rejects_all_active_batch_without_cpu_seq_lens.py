"""FlashInfer's ``trtllm_ragged_attention_deepseek`` refuses every CUDA graph capture made without CPU sequence-length mirrors: the empty-KV-row compaction added in #3779 needs ``.item()`` on device lengths, and its capture guard raises even for all-active batches.

Upstream: https://github.com/flashinfer-ai/flashinfer/pull/4703 ("[Bugfix] Skip .item() readback for
trtllm_ragged_attention_deepseek during CUDA graph capture (#4609)", flashinfer-ai/flashinfer, merged 2026-08-24;
fixes issue #4609 "[B300][GB300] BatchPrefillWithRaggedKVCacheWrapper rejects CUDA graph capture without CPU sequence
lengths", filed 2026-08-19 from the B300/GB300 benchmark CI). Read: the PR description and the issue (reproduction
``flashinfer_benchmark.py --routine BatchPrefillWithRaggedKVCacheWrapper --backends ... trtllm-native --batch_size 1
--s_qo 1024 --s_kv 1024 --num_qo_heads 128 --num_kv_heads 128 --head_dim_qk 192 --head_dim_vo 128
--random_actual_seq_len --causal``, bisected: fine at d69ab74, broken from d898ed0); the review thread of PR #3779
(commit d898ed046, which added ``q_seq_lens_cpu``/``kv_seq_lens_cpu``, the compaction and the guard); at the last
stored commit before the fix, ``flashinfer/prefill.py`` (``trtllm_ragged_attention_deepseek`` in full),
``benchmarks/routines/attention.py`` (``testBatchPrefillWithRaggedKVCacheWrapper``: sequence-length sampling, indptrs,
the ``trtllm-native`` branch of ``run_backend_wrapper``, ``bench_gpu_time(..., use_cuda_graph=True,
cold_l2_cache=True)``) and ``flashinfer/testing/utils.py`` (``bench_gpu_time_with_cudagraph``). The fix's diff is
not stored; its lines are reconstructed from the PR description (and #4816's, which names the follow-up).
Symptom: the benchmark reaches CUDA graph capture of the trtllm-native ragged prefill and raises ``ValueError:
q_seq_lens_cpu and kv_seq_lens_cpu must be provided during CUDA graph capture``; eager calls work.
Mechanism: #3779 made the trtllm-gen branch compact rows that have queries but no KV (out = 0, lse = -inf, the
kernel launched on the active rows only). Without CPU mirrors it decides that on the device lengths:
``q_lens = cum_seq_lens_q[1:] - cum_seq_lens_q[:-1]``, ``active_rows = (q_lens > 0) & (kv_lens > 0)``,
``has_inactive_rows = bool((~active_rows).any().item())``: a device-to-host read that a capturing stream cannot
make. So the same commit raised ``ValueError`` whenever ``torch.cuda.is_current_stream_capturing()`` and no mirrors
were given: every captured direct caller, including all-active batches that never needed the compaction (the
benchmark's warmup calls run eagerly and pass; the capture is refused).
Doctor: sync-in-capture, at trtllm_ragged_attention_deepseek. Inside a capture the function must decide the
compaction from device sequence lengths with ``.item()`` (a host synchronisation), which it refuses by raising.
Fix (upstream): inside capture, if the caller did not pass the CPU mirrors, set ``has_inactive_rows = False`` /
``has_active_rows = True`` and skip the compaction instead of raising (the pre-#3779 behaviour: right for
all-active batches, undefined for captured batches that contain empty-KV rows, which must pass both mirrors); the
``q_seq_lens_cpu`` docstring says so.
Modelled: ``trtllm_ragged_attention_deepseek`` (head-dimension check, output/lse allocation, the trtllm-gen branch:
mirror validation and decision, the device-length decision with its guard, the device compaction path and the
scatter back, the launch); ``get_trtllm_gen_fmha_module().trtllm_ragged_attention`` is a torch stand-in (causal
bottom-right-aligned attention over ragged tokens, rows found from ``cum_seq_lens_*`` on the device with
``searchsorted``, natural-log lse); ``device_support_pdl`` / ``get_device_sm_count`` are constants;
``is_current_stream_capturing`` is the engine's capture state (``torch.cuda.is_current_stream_capturing``; the
``query.is_cuda`` test is folded in: the emulated device is the GPU). The cute-dsl branch, FP8/sage/sink options and
the mirror-path compaction (host-built indices) are left out. The benchmark: ``sample_actual_seq_lens`` (random
lengths, ``actual_seq_lens_kv = actual_seq_lens_q`` for ``s_qo == s_kv``), ``qo_indptr``/``kv_indptr``,
``run_backend_wrapper`` for ``trtllm-native``, and ``bench_gpu_time_with_cudagraph`` (rotated input copies for cold
L2, three eager warmup calls, one graph of ``num_iters_within_graph`` calls over the rotations, replays).
float64 instead of bfloat16.
Workload: DeepSeek-R1 shapes cut down: batch 3, s_qo = s_kv = 6 with random actual lengths (all rows active), 2
heads, head_dim_qk 192, head_dim_vo 128, causal. Two rotated buffer sets, a graph of two calls; the benchmark's
replays are served three times, each after writing fresh q/k/v into both rotations (a stand-in for the timed
replays, so that each replay has new data); eager runs the same calls. The bug raises ValueError ("q_seq_lens_cpu
and kv_seq_lens_cpu must be provided during CUDA graph capture") at the capture; the fix captures and equals eager
(max error 0).
"""
from __future__ import annotations

import math
from typing import Optional, Union

import torch

from workbench.engine import events, is_capturing
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/flashinfer-ai/flashinfer/pull/4703"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "trtllm_ragged_attention_deepseek"
SYMPTOM = ("CUDA graph capture of the trtllm-native ragged prefill (trtllm_ragged_attention_deepseek) raises "
           "'q_seq_lens_cpu and kv_seq_lens_cpu must be provided during CUDA graph capture': the empty-KV-row "
           "compaction reads device lengths with .item(), and its guard rejects every capture without CPU mirrors")

BATCH_SIZE, S_QO, S_KV, NUM_QO_HEADS, NUM_KV_HEADS = 3, 6, 6, 2, 2
HEAD_DIM_QK, HEAD_DIM_VO = 192, 128                       # DeepSeek-R1
NUM_ROTATIONS, NUM_ITERS_WITHIN_GRAPH, WARMUP_CALLS, REPLAYS = 2, 2, 3, 3
DTYPE = torch.float64
log2e = 1.4426950408889634

_variant = "bug"


# --- flashinfer utils / jit stand-ins ------------------------------------------------------------------------------

def device_support_pdl(device) -> bool:
    return False


def get_device_sm_count(device) -> int:
    return 148


def check_trtllm_gen_sm107_only_feature(flag, name, device) -> None:
    return None


def is_current_stream_capturing() -> bool:
    """``torch.cuda.is_current_stream_capturing()`` (the engine's capture state, on either backend)."""
    return is_capturing()


class _TrtllmGenFmhaModule:
    @staticmethod
    def trtllm_ragged_attention(out, query, key, value, workspace_buffer, seq_lens, max_q_len, max_kv_len,
                                bmm1_scale, bmm2_scale, o_sf_scale, batch_size, window_left, cum_seq_lens_q,
                                cum_seq_lens_kv, sm_count, enable_pdl, is_causal, workspace_size, attention_sinks,
                                skip_softmax_threshold_scale_factor, lse, *sage_and_variant_args):
        """Stand-in for the trtllm-gen ragged FMHA kernel: each query token attends to the KV tokens of its own
        row (bottom-right causal alignment); rows are found on the device, no host read."""
        tq, tk = query.shape[0], key.shape[0]
        cum_q, cum_kv = cum_seq_lens_q.long(), cum_seq_lens_kv.long()
        iq = torch.arange(tq, device=query.device)
        ik = torch.arange(tk, device=query.device)
        bq = torch.searchsorted(cum_q[1:batch_size + 1], iq, right=True)
        bk = torch.searchsorted(cum_kv[1:batch_size + 1], ik, right=True)
        q_pos, k_pos = iq - cum_q[bq], ik - cum_kv[bk]
        q_len, kv_len = cum_q[bq + 1] - cum_q[bq], seq_lens.long()[bq]
        mask = bq[:, None] == bk[None, :]
        if is_causal:
            mask = mask & (k_pos[None, :] <= (q_pos + kv_len - q_len)[:, None])
        scores = torch.einsum("qhd,khd->hqk", query, key) * bmm1_scale
        scores = scores.masked_fill(~mask[None], -math.inf)
        row_lse = torch.logsumexp(scores, dim=-1)                       # [heads, tq]
        p = torch.exp(scores - row_lse[..., None])
        out.copy_(torch.einsum("hqk,khd->qhd", p, value) * bmm2_scale)
        if lse is not None:
            lse.copy_(row_lse.transpose(0, 1))


def get_trtllm_gen_fmha_module():
    return _TrtllmGenFmhaModule


# --- flashinfer/prefill.py -------------------------------------------------------------------------------------------

def trtllm_ragged_attention_deepseek(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, workspace_buffer: torch.Tensor,
    seq_lens: torch.Tensor, max_q_len: int, max_kv_len: int, bmm1_scale: Union[float, torch.Tensor],
    bmm2_scale: Union[float, torch.Tensor], o_sf_scale: float, batch_size: int, window_left: int,
    cum_seq_lens_q: torch.Tensor, cum_seq_lens_kv: torch.Tensor, enable_pdl: bool | None, is_causal: bool,
    return_lse: bool, attention_sinks: Optional[torch.Tensor] = None,
    skip_softmax_threshold_scale_factor: Optional[float] = None, out: Optional[torch.Tensor] = None,
    lse: Optional[torch.Tensor] = None, backend: str = "trtllm-gen",
    q_seq_lens_cpu: Optional[torch.Tensor] = None, kv_seq_lens_cpu: Optional[torch.Tensor] = None,
    use_fp16_softmax: Optional[bool] = None, uses_spcompress: Optional[bool] = None,
):
    """q_seq_lens_cpu: optional trusted CPU mirror of the per-row query lengths; with ``kv_seq_lens_cpu`` the
    all-active fast path stays asynchronous while empty-KV rows are still compacted. If omitted, lengths are
    derived from the device indptrs (which may synchronize); during CUDA graph capture, if omitted, the wrapper
    assumes all rows are active -- callers whose captured batches may include empty-KV rows must pass both."""
    check_trtllm_gen_sm107_only_feature(use_fp16_softmax, "use_fp16_softmax", query.device)
    check_trtllm_gen_sm107_only_feature(uses_spcompress, "uses_spcompress", query.device)
    is_dsr1 = query.shape[2] == 192 and key.shape[2] == 192 and value.shape[2] == 128
    is_smaller_dimensions = query.shape[2] == 128 and key.shape[2] == 128 and value.shape[2] == 128
    is_glm5 = query.shape[2] == 256 and key.shape[2] == 256 and value.shape[2] == 256
    assert is_dsr1 or is_smaller_dimensions or is_glm5, "Unsupported head dimensions"

    if enable_pdl is None:
        enable_pdl = device_support_pdl(query.device)

    # --- Output allocation (shared by all backends) ---
    if out is None:
        out = torch.empty(query.shape[0], query.shape[1], value.shape[2], device=query.device, dtype=query.dtype)
    elif tuple(out.shape) != (query.shape[0], query.shape[1], value.shape[2]):
        raise ValueError(f"out must have shape {(query.shape[0], query.shape[1], value.shape[2])}")
    # --- LSE allocation (shared by all backends) ---
    if return_lse and lse is None:
        lse = torch.empty(query.shape[0], query.shape[1], device=query.device, dtype=DTYPE)   # float32 upstream

    # --- trtllm-gen backend ---
    run_func = get_trtllm_gen_fmha_module().trtllm_ragged_attention
    sm_count = get_device_sm_count(query.device)
    if isinstance(bmm1_scale, torch.Tensor):
        bmm1_scale = bmm1_scale * log2e

    def _validate_cpu_seq_lens(lengths: torch.Tensor, name: str, total_tokens: int, max_len: int) -> int:
        if lengths.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor")
        if lengths.shape != (batch_size,):
            raise ValueError(f"{name} must have shape ({batch_size},)")
        actual_total = int(lengths.sum().item())
        if actual_total != total_tokens:
            raise ValueError(f"{name} sums to {actual_total}, but expected {total_tokens}")
        if batch_size > 0 and int(lengths.max().item()) > max_len:
            raise ValueError(f"{name} contains a length larger than max_len")
        return actual_total

    run_out, run_lse, run_query, run_key, run_value = out, lse, query, key, value
    run_seq_lens, run_max_q_len, run_max_kv_len, run_batch_size = seq_lens, max_q_len, max_kv_len, batch_size
    run_cum_seq_lens_q, run_cum_seq_lens_kv = cum_seq_lens_q, cum_seq_lens_kv
    q_active_indices = None
    should_launch = True
    q_lens = kv_lens = active_rows = None
    has_inactive_rows = False
    has_active_rows = True

    if q_seq_lens_cpu is not None or kv_seq_lens_cpu is not None:
        if q_seq_lens_cpu is None or kv_seq_lens_cpu is None:
            raise ValueError("q_seq_lens_cpu and kv_seq_lens_cpu must be provided together")
        _validate_cpu_seq_lens(q_seq_lens_cpu, "q_seq_lens_cpu", query.shape[0], max_q_len)
        _validate_cpu_seq_lens(kv_seq_lens_cpu, "kv_seq_lens_cpu", key.shape[0], max_kv_len)
        active_rows_cpu = (q_seq_lens_cpu > 0) & (kv_seq_lens_cpu > 0)
        if not bool(active_rows_cpu.all().item()):
            has_inactive_rows = True
            has_active_rows = bool(active_rows_cpu.any().item())
            active_rows = active_rows_cpu.to(query.device)   # upstream builds the indices on the host from here
    elif is_current_stream_capturing() and _variant == "bug":
        raise ValueError("q_seq_lens_cpu and kv_seq_lens_cpu must be provided during CUDA graph capture")
    elif is_current_stream_capturing():
        # Capture cannot read the device lengths back: assume every row is active (no compaction).
        has_inactive_rows = False
        has_active_rows = True
    else:
        q_lens = cum_seq_lens_q[1:] - cum_seq_lens_q[:-1]
        kv_lens = cum_seq_lens_kv[1:] - cum_seq_lens_kv[:-1]
        active_rows = (q_lens > 0) & (kv_lens > 0)
        has_inactive_rows = bool((~active_rows).any().item())
        if has_inactive_rows:
            has_active_rows = bool(active_rows.any().item())

    if has_inactive_rows:
        if not has_active_rows:
            out.zero_()
            if lse is not None:
                lse.fill_(-float("inf"))
            should_launch = False
        else:
            if q_lens is None:
                q_lens = cum_seq_lens_q[1:] - cum_seq_lens_q[:-1]
            if kv_lens is None:
                kv_lens = cum_seq_lens_kv[1:] - cum_seq_lens_kv[:-1]
            q_active_mask = torch.repeat_interleave(active_rows, q_lens)
            q_inactive_indices = torch.nonzero(~q_active_mask, as_tuple=False).flatten()
            if q_inactive_indices.numel() > 0:
                out.index_fill_(0, q_inactive_indices, 0)
                if lse is not None:
                    lse.index_fill_(0, q_inactive_indices, -float("inf"))
            active_indices = torch.nonzero(active_rows, as_tuple=False).flatten()
            kv_active_indices = torch.nonzero(torch.repeat_interleave(active_rows, kv_lens), as_tuple=False).flatten()
            q_active_indices = torch.nonzero(q_active_mask, as_tuple=False).flatten()
            run_query = query.index_select(0, q_active_indices).contiguous()
            run_key = key.index_select(0, kv_active_indices).contiguous()
            run_value = value.index_select(0, kv_active_indices).contiguous()
            run_seq_lens = kv_lens.index_select(0, active_indices).contiguous()
            run_q_lens = q_lens.index_select(0, active_indices).contiguous()
            zero = torch.zeros(1, device=query.device, dtype=cum_seq_lens_q.dtype)
            run_cum_seq_lens_q = torch.cat([zero, torch.cumsum(run_q_lens, 0, dtype=cum_seq_lens_q.dtype)])
            run_cum_seq_lens_kv = torch.cat([zero, torch.cumsum(run_seq_lens, 0, dtype=cum_seq_lens_kv.dtype)])
            run_max_q_len = int(run_q_lens.max().item())
            run_max_kv_len = int(run_seq_lens.max().item())
            run_batch_size = int(active_indices.numel())
            run_out = torch.empty(run_query.shape[0], query.shape[1], value.shape[2], device=query.device,
                                  dtype=out.dtype)
            run_lse = (torch.empty(run_query.shape[0], query.shape[1], device=query.device, dtype=DTYPE)
                       if lse is not None else None)

    workspace_size = workspace_buffer.numel() * workspace_buffer.element_size()
    if should_launch:
        run_func(run_out, run_query, run_key, run_value, workspace_buffer, run_seq_lens, run_max_q_len,
                 run_max_kv_len, bmm1_scale, bmm2_scale, o_sf_scale, run_batch_size, window_left,
                 run_cum_seq_lens_q, run_cum_seq_lens_kv, sm_count, enable_pdl, is_causal, workspace_size,
                 attention_sinks, skip_softmax_threshold_scale_factor, run_lse, use_fp16_softmax, uses_spcompress)
        if q_active_indices is not None:
            out.index_copy_(0, q_active_indices, run_out)
            if lse is not None:
                lse.index_copy_(0, q_active_indices, run_lse)
    if return_lse:
        return out, lse
    return out


# --- benchmarks/routines/attention.py: testBatchPrefillWithRaggedKVCacheWrapper (trtllm-native) ---------------------

def sample_actual_seq_lens(max_seqlen, batch_size, gen):
    return torch.randint(1, max_seqlen + 1, (batch_size,), generator=gen, dtype=torch.int32)


class RaggedPrefillBench:
    def __init__(self, device):
        gen = generator(4703)
        actual_seq_lens_q = sample_actual_seq_lens(S_QO, BATCH_SIZE, gen)
        actual_seq_lens_kv = actual_seq_lens_q.clone()            # s_qo == s_kv
        self.cumsum_s_qo, self.cumsum_s_kv = int(actual_seq_lens_q.sum()), int(actual_seq_lens_kv.sum())
        self.actual_seq_lens_kv_device = actual_seq_lens_kv.to(device)
        zero = torch.zeros(1, dtype=torch.int32)
        self.qo_indptr = torch.cat([zero, torch.cumsum(actual_seq_lens_q, 0)]).int().to(device)
        self.kv_indptr = torch.cat([zero, torch.cumsum(actual_seq_lens_kv, 0)]).int().to(device)
        self.scale = float(1.0 / (HEAD_DIM_QK ** 0.5))
        self.workspace_buffer = torch.empty(4096, dtype=torch.int8, device=device)
        self.device = device

    def fresh_qkv(self, gen):
        return (randn(self.cumsum_s_qo, NUM_QO_HEADS, HEAD_DIM_QK, gen=gen, device=self.device).to(DTYPE),
                randn(self.cumsum_s_kv, NUM_KV_HEADS, HEAD_DIM_QK, gen=gen, device=self.device).to(DTYPE),
                randn(self.cumsum_s_kv, NUM_KV_HEADS, HEAD_DIM_VO, gen=gen, device=self.device).to(DTYPE))

    def run_backend_wrapper(self, q, k, v, out):                  # backend == "trtllm-native"
        _q_scale = _k_scale = _v_scale = 1.0
        return trtllm_ragged_attention_deepseek(
            query=q, key=k, value=v, workspace_buffer=self.workspace_buffer,
            seq_lens=self.actual_seq_lens_kv_device, max_q_len=S_QO, max_kv_len=S_KV,
            bmm1_scale=_q_scale * _k_scale * self.scale, bmm2_scale=_v_scale, o_sf_scale=-1,
            batch_size=BATCH_SIZE, window_left=-1, cum_seq_lens_q=self.qo_indptr, cum_seq_lens_kv=self.kv_indptr,
            enable_pdl=False, is_causal=True, return_lse=True, out=out)[0]


def bench_gpu_time_with_cudagraph(fn, input_args, device):
    """flashinfer/testing/utils.py: rotated copies for cold L2, eager warmups, one graph of
    ``num_iters_within_graph`` calls over the rotations. Returns the graph, its outputs and the rotated copies."""
    rotated_copies = [tuple(t.clone() for t in input_args) for _ in range(NUM_ROTATIONS)]
    events.static_buffers("bench_gpu_time_with_cudagraph", {
        f"rotation[{i}].{name}": t for i, copy in enumerate(rotated_copies) for name, t in zip("qkv", copy[:3])})
    with events.warmup():
        for _ in range(WARMUP_CALLS):                             # call_fn() on the original args
            fn(*input_args)

    def call_fn_with_rotation_loop():
        for iter_idx in range(NUM_ITERS_WITHIN_GRAPH):
            fn(*rotated_copies[iter_idx % NUM_ROTATIONS])
        return tuple(copy[3] for copy in rotated_copies)

    g, outputs = capture(call_fn_with_rotation_loop, device=device, warmups=0, name="trtllm-native ragged prefill",
                         owner="bench_gpu_time_with_cudagraph")
    return g, outputs, rotated_copies


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant

    def serve(use_cuda_graph: bool):
        bench = RaggedPrefillBench(device)
        gen = generator(46090)
        q, k, v = bench.fresh_qkv(gen)
        out = torch.empty(q.shape[0], NUM_QO_HEADS, HEAD_DIM_VO, device=device, dtype=DTYPE)
        if use_cuda_graph:
            g, outputs, rotated = bench_gpu_time_with_cudagraph(bench.run_backend_wrapper, (q, k, v, out), device)
        else:
            rotated = [(q.clone(), k.clone(), v.clone(), out.clone()) for _ in range(NUM_ROTATIONS)]
        results = []
        for _ in range(REPLAYS):
            for copy in rotated:                                  # fresh activations in every rotation
                for dst, src in zip(copy[:3], bench.fresh_qkv(gen)):
                    dst.copy_(src)
            if use_cuda_graph:
                views = replay(g, outputs)
            else:
                for iter_idx in range(NUM_ITERS_WITHIN_GRAPH):
                    bench.run_backend_wrapper(*rotated[iter_idx % NUM_ROTATIONS])
                views = tuple(copy[3] for copy in rotated)
            results += [o.clone() for o in views]
        return results

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
