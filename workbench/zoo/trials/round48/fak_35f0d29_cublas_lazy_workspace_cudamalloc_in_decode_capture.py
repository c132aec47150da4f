"""cuBLAS lazily ``cudaMalloc``s its workspace the first time it sees a GEMM problem: the decode GEMM's first time is inside capture.

Upstream: https://github.com/anthony-chaudhary/fak/commit/35f0d29634b486372816c2bed175ffe1c4c68221 ("fix(compute):
prevent CUDA-graph capture crashes by preallocating cuBLAS workspace + decode scratch (#969)"), issue
https://github.com/anthony-chaudhary/fak/issues/969.
Symptom: on an A100 (sm_80) the CUDA-graph decode path crashed with "cudaMalloc(256 bytes) ... operation not
permitted when stream is capturing" (``TestCUDAGraphDecodeParity`` red, the throughput benchmarks panic); the eager
decode path works.
Mechanism: ``fcuda_init`` creates ``g_blas`` (``cublasCreate``, ``cublasSetStream(g_blas, g_stream)``) and gives it no
workspace. Every token, fak captures the decode forward on ``g_stream`` (``fcuda_graph_begin``:
``cudaStreamBeginCapture(g_stream, cudaStreamCaptureModeGlobal)``; ``fcuda_graph_end_launch``: end capture,
instantiate or ``cudaGraphExecUpdate``, launch). The F32 GEMMs go through ``fcuda_matmul_f32`` -> ``cublasSgemm``;
with no user workspace cuBLAS allocates its internal workspace with its own ``cudaMalloc`` the first time it sees
a GEMM problem. Prefill (``BatchedMatMul``, P = prompt length) runs eagerly, so its problems are fine; the decode
GEMV (``MatMul``, P = 1) is first seen inside the first token's capture, where ``cudaMalloc`` is refused
(cudaErrorStreamCaptureUnsupported) and the capture fails. The earlier fix (#932) pre-warmed fak's own pooled
allocator (``fcuda_malloc``), which cannot reach cuBLAS's internal allocation. Here cuBLAS's workspace holds the
split-K partial products of the GEMM; ``cudaMalloc`` states the runtime's rule (on either backend: torch's own
allocator would give a capture a graph-pool block instead).
Doctor: sync-in-capture, at ``cublasSgemm`` (its lazy workspace ``cudaMalloc`` runs inside the captured decode
step; eager steps allocate it harmlessly).
Fix (upstream): ``fcuda_init`` allocates a 32 MiB ``g_blas_workspace`` and calls ``cublasSetWorkspace(g_blas,
g_blas_workspace, ws)``, so cuBLAS never allocates during capture. The same commit makes the Q8 activation scratch
(``g_q8_qX``/``g_q8_xScale``) and the argmax index (``g_argmax_idx``) grow-once statics instead of per-call
``fcuda_malloc``/``fcuda_free`` (hardening of fak's own allocator; not modelled: #932 already pre-warms it).
(Diff read: ``internal/compute/cuda_kernels.cu``, ``cuda.go``.)
"""
from __future__ import annotations

import torch

from workbench.engine import CaptureError
from workbench.engine.source import user_frame
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/anthony-chaudhary/fak/commit/35f0d29634b486372816c2bed175ffe1c4c68221"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "cublasSgemm"
SYMPTOM = "CUDA-graph decode crashes: cudaMalloc(256 bytes) ... operation not permitted when stream is capturing"

VOCAB, HIDDEN, SPLIT_K = 16, 8, 2
WORKSPACE_ELEMS = SPLIT_K * 8 * VOCAB         # the 32 MiB workspace, in miniature (fits every problem here)
PROMPT, NEW_TOKENS = [3, 11, 6], 4


def cudaMalloc(nbytes: int, device: str) -> torch.Tensor:
    """The runtime allocation: a stream capture in global mode refuses it."""
    if torch.cuda.is_current_stream_capturing():
        raise CaptureError(f"fak-cuda: cudaMalloc({nbytes} bytes) failed: operation not permitted when stream is "
                           f"capturing (cudaErrorStreamCaptureUnsupported)\n  at {user_frame()}",
                           op="cudaMalloc", source=user_frame())
    return torch.empty(nbytes // 4, device=device)


class cublasHandle_t:
    def __init__(self, device: str):
        self.device = device
        self.workspace = None                  # the user workspace (cublasSetWorkspace)
        self.internal = {}                     # cuBLAS's own workspaces, per GEMM problem


def cublasSetWorkspace(handle: cublasHandle_t, workspace: torch.Tensor, size: int):
    handle.workspace = workspace[:size // 4]


def cublasSgemm(handle: cublasHandle_t, dW: torch.Tensor, dX: torch.Tensor, dY: torch.Tensor, out: int, inn: int,
                P: int):
    """Y[P,out] = X[P,in] @ W[out,in]^T, split-K: partial products in the workspace, then reduced."""
    if handle.workspace is not None:
        ws = handle.workspace
    else:
        problem = (out, inn, P)
        if problem not in handle.internal:     # first time cuBLAS sees this problem: lazy workspace
            handle.internal[problem] = cudaMalloc(4 * SPLIT_K * P * out, handle.device)
        ws = handle.internal[problem]
    partials = ws[:SPLIT_K * P * out].view(SPLIT_K, P, out)
    chunk = inn // SPLIT_K
    for s in range(SPLIT_K):
        torch.matmul(dX[:, s * chunk:(s + 1) * chunk], dW[:, s * chunk:(s + 1) * chunk].t(), out=partials[s])
    torch.sum(partials, 0, out=dY)


class FakCuda:
    """``cuda_kernels.cu``'s globals: ``g_blas``, ``g_stream``, ``g_blas_workspace``."""

    def __init__(self, device: str, variant: str):
        self.device = device
        self.g_blas = self.g_blas_workspace = None
        self.fcuda_init(variant)

    def fcuda_init(self, variant: str):
        self.g_blas = cublasHandle_t(self.device)          # cublasCreate + cublasSetStream(g_blas, g_stream)
        if variant == "fix" and self.g_blas_workspace is None:   # #969
            ws = 4 * WORKSPACE_ELEMS
            self.g_blas_workspace = cudaMalloc(ws, self.device)
            cublasSetWorkspace(self.g_blas, self.g_blas_workspace, ws)

    def fcuda_matmul_f32(self, dW, dX, dY, out: int, inn: int, P: int):
        cublasSgemm(self.g_blas, dW, dX, dY, out, inn, P)


class cudaBackend:
    def __init__(self, cuda: FakCuda, device: str):
        self.c, self.device = cuda, device
        gen = generator(969)
        self.emb = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.w1 = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.w_out = randn(VOCAB, HIDDEN, gen=gen, device=device)
        # decode buffers (devTr): fixed addresses the captured forward reads and writes
        self.x = torch.zeros(1, HIDDEN, device=device)
        self.h = torch.zeros(1, HIDDEN, device=device)
        self.logits = torch.zeros(1, VOCAB, device=device)

    def MatMul(self, w, x, y):
        out, inn = w.shape
        self.c.fcuda_matmul_f32(w, x, y, out, inn, 1)      # decode GEMV: P = 1
        return y

    def BatchedMatMul(self, w, X, P: int):
        out, inn = w.shape
        y = torch.empty(P, out, device=self.device)
        self.c.fcuda_matmul_f32(w, X, y, out, inn, P)
        return y

    def prefill(self, tokens):
        X = self.emb[torch.tensor(tokens, device=self.device)]
        H = torch.tanh(self.BatchedMatMul(self.w1, X, len(tokens)))
        return self.BatchedMatMul(self.w_out, H, len(tokens))[-1:]

    def decode_forward(self):
        self.MatMul(self.w1, self.x, self.h)
        self.h.tanh_()
        return self.MatMul(self.w_out, self.h, self.logits)

    def decode_graphed(self, token: int):
        """One token: fcuda_graph_begin, the forward on g_stream, fcuda_graph_end_launch."""
        self.x.copy_(self.emb[token:token + 1])
        g, out = capture(self.decode_forward, device=self.device, warmups=0, name="decode token",
                         owner="fak cudaBackend (per-token graph)", static={"x": self.x})
        return replay(g, out)


def run(variant: str, device: str = "cpu"):
    def serve(graphed: bool):
        backend = cudaBackend(FakCuda(device, variant), device)
        logits = backend.prefill(PROMPT)
        outs = [logits.clone()]
        token = int(logits.argmax())
        for _ in range(NEW_TOKENS):
            if graphed:
                logits = backend.decode_graphed(token)
            else:
                backend.x.copy_(backend.emb[token:token + 1])
                logits = backend.decode_forward()
            outs.append(logits.clone())
            token = int(logits.argmax())                   # fcuda_argmax_f32, after the launch
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
