"""FlashInfer's SM120 FP8 groupwise GEMM synchronises its stream after the launch: capturing a step that uses it fails.

Upstream: https://github.com/flashinfer-ai/flashinfer/pull/2244 ("Remove cudaStreamSynchronize from
gemm_groupwise_sm120.cuh for CUDA graph compatibility", merged December 2025).
Symptom: as reported in the PR, "``cudaStreamSynchronize`` in ``CutlassGroupwiseScaledGEMMSM120`` breaks CUDA
graph capture and will fail explicitly starting CUDA 13.0": a serving step that runs an FP8 block-scaled linear
through ``gemm_fp8_nt_groupwise`` on an SM120 GPU (RTX 50xx / RTX PRO Blackwell) cannot be captured, while the
same step runs eagerly.
Mechanism: ``gemm_fp8_nt_groupwise`` (``flashinfer/gemm``) dispatches on SM120 to the CUTLASS launcher
``CutlassGroupwiseScaledGEMMSM120`` (``include/flashinfer/gemm/gemm_groupwise_sm120.cuh``). After
``gemm.run(stream)`` the launcher ended with ``// Sync to ensure kernel completes`` and
``cudaStreamSynchronize(stream)``, returning its error. Eagerly that only costs a host wait; inside a stream
capture the host cannot wait for work that is being recorded, not executed: the call is refused
(``cudaErrorStreamCaptureUnsupported``) and the capture is invalidated, so no graph of the step exists.
Doctor: sync-in-capture, at ``CutlassGroupwiseScaledGEMMSM120`` (the stream synchronisation inside the captured
region).
Fix (upstream): the six lines with the ``cudaStreamSynchronize`` and its error check are deleted; the launcher
stays asynchronous like the SM100 one, and the tests synchronise (``torch.cuda.synchronize()``) before they
compare results. (Diff read: one hunk in ``gemm_groupwise_sm120.cuh`` plus the test changes.)
"""
from __future__ import annotations

import torch

from workbench.engine import is_capturing
from workbench.engine.cpu_graph import host_sync_error
from workbench.engine.source import user_frame
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/flashinfer-ai/flashinfer/pull/2244"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "CutlassGroupwiseScaledGEMMSM120"
SYMPTOM = "capturing a decode step with the SM120 FP8 groupwise GEMM fails: cudaStreamSynchronize while capturing"

VOCAB, HIDDEN, INTER = 16, 8, 8
GROUP = 4                                   # scale granularity (1, GROUP, GROUP): 128 upstream
FP8_MAX = 448.0                             # float8_e4m3fn
BATCH = 3                                   # the one captured decode size
STEPS = [[3, 9, 14], [1, 5, 12], [7, 2, 11], [0, 15, 6]]


def cudaStreamSynchronize(stream_device: str):
    """The CUDA runtime call: the host waits for the stream. A capturing stream refuses it
    (cudaErrorStreamCaptureUnsupported); the CPU emulation has no stream object, so the rule is stated here."""
    if torch.device(stream_device).type == "cuda":
        torch.cuda.current_stream().synchronize()
    elif is_capturing():
        raise host_sync_error("cudaStreamSynchronize", user_frame())


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """A stand-in for the FP8 cast: saturate to the e4m3 range and keep 3 mantissa bits (float32 storage)."""
    x = x.clamp(-FP8_MAX, FP8_MAX)
    exp = torch.floor(torch.log2(x.abs().clamp(min=2.0 ** -6)))
    step = torch.exp2(exp - 3)
    return torch.round(x / step) * step


def per_token_group_quant_fp8(x: torch.Tensor):
    """Activation quantization of the serving stack: one scale per token and per GROUP columns."""
    m, k = x.shape
    g = x.view(m, k // GROUP, GROUP)
    scale = g.abs().amax(-1).clamp(min=1e-6) / FP8_MAX               # [m, k / GROUP]
    return e4m3(g / scale[..., None]).view(m, k), scale


def quant_weight_blockwise(w: torch.Tensor):
    """Offline weight quantization: one scale per GROUP x GROUP block."""
    n, k = w.shape
    blocks = w.view(n // GROUP, GROUP, k // GROUP, GROUP)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-6) / FP8_MAX  # [n / GROUP, k / GROUP]
    q = e4m3(blocks / scale[:, None, :, None]).view(n, k)
    return q, scale


def CutlassGroupwiseScaledGEMMSM120(float_workspace, A, B, SFA, SFB, C, m, n, k, device, variant):
    """The CUTLASS SM120 launcher: D = (A * SFA) @ (B * SFB)^T with per-group scales, written to ``C``."""
    a = (A.view(m, k // GROUP, GROUP) * SFA[..., None]).view(m, k)
    b = (B.view(n // GROUP, GROUP, k // GROUP, GROUP) * SFB[:, None, :, None]).view(n, k)
    C.copy_(a @ b.T)                                                   # gemm.run(stream)
    if variant == "bug":
        # Sync to ensure kernel completes
        cudaStreamSynchronize(device)
    return C


def gemm_fp8_nt_groupwise(a, b, a_scale, b_scale, workspace, device, variant, out=None):
    """``flashinfer.gemm.gemm_fp8_nt_groupwise``: on SM120 the CUTLASS groupwise module."""
    m, k = a.shape
    n = b.shape[0]
    if out is None:
        out = torch.empty(m, n, device=a.device)
    return CutlassGroupwiseScaledGEMMSM120(workspace, a, b, a_scale, b_scale, out, m, n, k, device, variant)


class Fp8BlockScaledMLP:
    """An FP8 (block-scaled) gate/up + down MLP whose linears run through FlashInfer's groupwise GEMM."""

    def __init__(self, device, variant):
        gen = generator(2244)
        self.device, self.variant = device, variant
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.w_up, self.s_up = quant_weight_blockwise(randn(INTER, HIDDEN, gen=gen, device=device, scale=0.5))
        self.w_down, self.s_down = quant_weight_blockwise(randn(HIDDEN, INTER, gen=gen, device=device, scale=0.5))
        self.workspace = torch.zeros(64, device=device)               # float workspace buffer (unused here)

    def linear(self, x, w, s):
        q, sx = per_token_group_quant_fp8(x)
        return gemm_fp8_nt_groupwise(q, w, sx, s, self.workspace, self.device, self.variant)

    def forward(self, input_ids):
        h = self.embed[input_ids]
        up = torch.nn.functional.silu(self.linear(h, self.w_up, self.s_up))
        return h + self.linear(up, self.w_down, self.s_down)


class CudaGraphRunner:
    """A decode runner: one graph of the model at BATCH tokens, fed through a static ``input_ids``."""

    def __init__(self, model, device):
        self.model = model
        self.input_ids = torch.zeros(BATCH, dtype=torch.long, device=device)
        self.graph, self.output = capture(lambda: model.forward(self.input_ids), device=device,
                                          owner="CudaGraphRunner (decode)", name=f"decode bs={BATCH}",
                                          static={"input_ids": self.input_ids})

    def replay(self, tokens):
        self.input_ids.copy_(torch.tensor(tokens, device=self.input_ids.device))
        return replay(self.graph, self.output)


def run(variant: str, device: str = "cpu"):
    def served():
        model = Fp8BlockScaledMLP(device, variant)
        runner = CudaGraphRunner(model, device)
        return [runner.replay(tokens).clone() for tokens in STEPS]

    def eager():
        model = Fp8BlockScaledMLP(device, variant)
        return [model.forward(torch.tensor(tokens, device=device)).clone() for tokens in STEPS]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
