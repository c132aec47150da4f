"""Grouped FP8 GEMM passes ``m_indptr[-1]`` as a host ``int64_t``: the MoE expert GEMM cannot be captured.

Upstream: https://github.com/flashinfer-ai/flashinfer/pull/1060 ("bugfix: move ``cum_m`` calculation inside
kernels", commit e00e8ced): "We shouldn't use ``m_indptr[-1]`` which would break cudagraph compatibility."
Symptom: ``group_gemm_fp8_nt_groupwise`` (SM100 groupwise-scaled grouped GEMM, the expert GEMM of FP8 MoE
layers) works eagerly, but a decode step that runs it under CUDA graph capture fails with
``cudaErrorStreamCaptureUnsupported`` (operation not permitted when stream is capturing); FlashInfer
0.2.5, May 2025.
Mechanism: the op's schema took ``int64_t cum_m`` (the total row count, needed for the layout of the
activation scales ``a_scale`` of shape ``(k // 128, cum_m)``), and the Python wrapper passed
``m_indptr[-1]``, a 0-dim *device* tensor. Converting it to the op's integer argument reads the value on the
host (``.item()``, a device-to-host copy and a wait), which a capturing stream cannot do. The warmup run
before capture is eager and passes; the capture itself fails.
Doctor: sync-in-capture, at ``group_gemm_fp8_nt_groupwise`` (``m_indptr[-1]`` handed to an integer argument).
Fix (upstream): drop the ``cum_m`` argument; ``compute_sm100_cutlass_group_gemm_args`` reads
``m_indptr[batch_size]`` on the device to build ``layout_SFA``.
Not modelled: the wrapper's ``(m_indptr % 4 == 0).all()`` dispatch to the padding path (itself a host read);
the program keeps the 4-aligned fast path, as a MoE runner whose ``m_indptr`` is already aligned calls it.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/flashinfer-ai/flashinfer/pull/1060"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "group_gemm_fp8_nt_groupwise"
SYMPTOM = "capturing a decode step with the grouped FP8 expert GEMM fails on a host read of m_indptr[-1]"
NUM_EXPERTS, N, K, SCALE_K, CUM_M = 2, 3, 4, 2, 8          # scale_granularity_mnk = (1, N, SCALE_K)


def compute_sm100_cutlass_group_gemm_args(m_indptr, cum_m, batch_size):
    """Per-row problem index and the flat offsets of its activation scales (``layout_SFA`` over
    ``(cum_m, n, k)``: scale ``j`` of row ``r`` sits at ``j * cum_m + r``)."""
    rows = torch.arange(CUM_M, device=m_indptr.device)
    if cum_m is None:                                   # (fix) cum_m = m_indptr[batch_size], read on the device
        cum_m = m_indptr[batch_size]
    problem = torch.searchsorted(m_indptr[1:], rows, right=True).clamp(max=batch_size - 1)
    k_blocks = torch.arange(K // SCALE_K, device=m_indptr.device)
    sfa_offsets = k_blocks[None, :] * cum_m + rows[:, None]
    return problem, sfa_offsets


def cutlass_group_gemm_groupwise_scaled_sm100(A, B, SFA, SFB, C, m_indptr, *args):
    """The op ``group_gemm_fp8_nt_groupwise``: with ``cum_m`` (bug) its schema is
    ``(..., Tensor m_indptr, int cum_m, int n, int k, ...)``; after the fix ``(..., Tensor m_indptr, int n, ...)``."""
    if len(args) == 3:
        cum_m, n, k = args
        cum_m = int(cum_m)            # int64_t argument: torch reads a device tensor with .item()
    else:
        (n, k), cum_m = args, None
    batch_size = m_indptr.shape[0] - 1
    problem, sfa_offsets = compute_sm100_cutlass_group_gemm_args(m_indptr, cum_m, batch_size)
    a_scale = SFA.reshape(-1)[sfa_offsets]                                   # [rows, k_blocks]
    a = A.view(CUM_M, K // SCALE_K, SCALE_K) * a_scale[:, :, None]
    b = B[problem].view(CUM_M, n, K // SCALE_K, SCALE_K) * SFB[problem][:, None, :, 0, None]
    C.copy_(torch.einsum("rjs,rnjs->rn", a, b))


def group_gemm_fp8_nt_groupwise(a, b, a_scale, b_scale, m_indptr, variant, out=None):
    n, k = b.shape[1], b.shape[2]
    if out is None:
        out = torch.empty(a.shape[0], n, dtype=a.dtype, device=a.device)
    if variant == "bug":
        cutlass_group_gemm_groupwise_scaled_sm100(a, b, a_scale, b_scale, out, m_indptr, m_indptr[-1], n, k)
    else:
        cutlass_group_gemm_groupwise_scaled_sm100(a, b, a_scale, b_scale, out, m_indptr, n, k)
    return out


class FusedMoE:
    """An FP8 MoE layer's expert GEMM over tokens already permuted into 4-aligned expert segments."""

    def __init__(self, device):
        gen = generator(1060)
        self.w = randn(NUM_EXPERTS, N, K, gen=gen, device=device)
        self.w_scale = (torch.rand(NUM_EXPERTS, K // SCALE_K, 1, generator=gen) + 0.5).to(device)

    def forward(self, hidden_states, a_scale, m_indptr, variant):
        return group_gemm_fp8_nt_groupwise(hidden_states, self.w, a_scale, self.w_scale, m_indptr, variant)


def run(variant: str, device: str = "cpu"):
    layer = FusedMoE(device)
    gen = torch.Generator().manual_seed(7)
    steps = []
    for indptr in ([0, 4, 8], [0, 8, 8], [0, 0, 8]):          # tokens per expert change every decode step
        steps.append((torch.randn(CUM_M, K, generator=gen).to(device),
                      (torch.rand(K // SCALE_K, CUM_M, generator=gen) + 0.5).to(device),
                      torch.tensor(indptr, dtype=torch.int32, device=device)))

    def eager():
        return [layer.forward(x, s, m, variant) for x, s, m in steps]

    def served():
        x_buf, s_buf, m_buf = (t.clone() for t in steps[0])
        g, out = capture(lambda: layer.forward(x_buf, s_buf, m_buf, variant), device=device,
                         static={"hidden_states": x_buf, "a_scale": s_buf, "m_indptr": m_buf},
                         owner="MoE decode graph")
        outs = []
        for x, s, m in steps:
            x_buf.copy_(x)
            s_buf.copy_(s)
            m_buf.copy_(m)
            outs.append(replay(g, out).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
