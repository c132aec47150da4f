"""The FusedPCG graph is captured on a non-blocking stream: the MAS preconditioner's default-stream launches escape it and run once.

Upstream: https://github.com/spiriMirror/libuipc/pull/472 ("fix(cuda_tool): use a blocking stream for graph capture"),
a follow-up to https://github.com/spiriMirror/libuipc/pull/470 (FusedPCG CUDA-graph block replay).
Symptom: "replayed PCG used a frozen preconditioner output: r^Tz collapsed within 5 iterations while ||Ax-b||/||b||
stayed ~3 -- visibly wrong physics at E=1e4" (MAS scenes); no error is printed.
Mechanism: ``LinearFusedPCG::fused_pcg`` replays ``check_interval`` PCG iterations as one graph (captured once per
buffer set and N): spmv_dot, fused_update_xr, apply_preconditioner (z = M^-1 r), fused_dot (rz_new = r^T z),
fused_update_p, fused_swap_rz, then a host convergence check on ``d_rz_new``. ``cuda_tool::GraphCapture::capture``
created ``m_capture_stream`` with ``cudaStreamCreateWithFlags(&m_capture_stream, cudaStreamNonBlocking)``, began a
ThreadLocal capture and ran ``body(m_capture_stream)``. Its contract says a legacy-default-stream launch in the body
invalidates the capture (``Result::CaptureInvalidated`` -> eager fallback); but a non-blocking stream has no implicit
ordering with the legacy stream, so such launches neither invalidate the capture nor join the graph: they execute
once, at capture. The ``MASPreconditionerEngine::apply`` kernels (build_multi_level_R, schwarz_local_solve,
collect_final_Z), not yet plumbed to take the capture stream, launch on the default stream: ``z`` is computed once,
from the capture-time ``r``, and every ``launch_sync()`` replays the loop with that frozen ``z``. Here a launch on
the legacy default stream is a launch from another thread (whose current stream is the default one; the CPU engine
records only the capturing thread, as CUDA captures only the capturing stream), and the runtime's rule for a
*blocking* capturing stream is stated in ``legacy_stream_launch`` (on either backend). The MAS engine is two
additive Schwarz levels of inverted cluster blocks.
Doctor: host-work-frozen, at ``apply`` (the MAS engine's kernels ran once, outside the graph, during capture; replays
repeat only the captured PCG kernels, so ``z`` keeps its capture-time value).
Fix (upstream): the capture stream is created with ``cudaStreamDefault`` (blocking), so a legacy-stream launch in the
body invalidates the capture, ``cudaStreamEndCapture`` fails, ``fail(Result::CaptureInvalidated)`` disables the
instance and ``LinearFusedPCG`` falls back to plain launches. (Read: PR description, pre-fix ``graph.h`` at 17b6eae
and ``linear_fused_pcg.cu``; the one-flag diff itself was not in the stored snapshot.)
"""
from __future__ import annotations

import threading

import torch

from workbench.engine import CaptureError
from workbench.zoo.kit import capture as kit_capture, compare, generator, replay

UPSTREAM = "https://github.com/spiriMirror/libuipc/pull/472"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "apply"
SYMPTOM = "replayed PCG uses a frozen MAS preconditioner output: r^Tz collapses while ||Ax-b||/||b|| stays large"

N, LEVELS, CHECK_INTERVAL, MAX_BLOCKS, TOL_RATE = 8, (2, 4), 2, 4, 1e-12
cudaStreamDefault, cudaStreamNonBlocking = 0, 1
_capturing: list = []                    # the runtime's streams now capturing


class cudaStream_t:
    def __init__(self, flags: int):
        self.flags, self.invalidated = flags, False


def legacy_stream_launch(kernel, *args):
    """A launch on the legacy default stream. It synchronises with every blocking stream: while one is capturing it
    fails (cudaErrorStreamCaptureImplicit) and invalidates that capture; non-blocking streams are not affected."""
    blocking = [s for s in _capturing if s.flags == cudaStreamDefault]
    if blocking:
        for s in blocking:
            s.invalidated = True
        return
    worker = threading.Thread(target=kernel, args=args)     # another thread: the default stream
    worker.start()
    worker.join()


class MASPreconditionerEngine:
    def __init__(self, A: torch.Tensor):
        dev = A.device
        self.inv = [torch.linalg.inv(torch.stack([A[i:i + bs, i:i + bs] for i in range(0, N, bs)])).to(dev)
                    for bs in LEVELS]                                       # invert_cluster_matrices
        self.R = [torch.zeros(N // bs, bs, bs, dtype=A.dtype, device=dev) for bs in LEVELS]
        self.Z = [torch.zeros(N // bs, bs, dtype=A.dtype, device=dev) for bs in LEVELS]

    def _kernels(self, r, z):
        for lv, bs in enumerate(LEVELS):
            torch.mul(self.inv[lv], r.view(N // bs, 1, bs), out=self.R[lv])     # build_multi_level_R
            torch.sum(self.R[lv], -1, out=self.Z[lv])                           # schwarz_local_solve
        torch.add(self.Z[0].view(N), self.Z[1].view(N), out=z)                  # collect_final_Z

    def apply(self, r, z):
        """Launches its kernels without a stream argument: on the legacy default stream."""
        legacy_stream_launch(self._kernels, r, z)


class GraphCapture:
    def __init__(self, variant: str):
        self.variant, self.m_capture_stream, self.m_graph = variant, None, None
        self.m_disabled, self.m_failure, self.outputs = False, "Ok", None

    def capture(self, body, state):
        if self.m_disabled:
            return self.m_failure
        if self.m_capture_stream is None:
            flags = cudaStreamDefault if self.variant == "fix" else cudaStreamNonBlocking   # the #472 change
            self.m_capture_stream = cudaStream_t(flags)
        stream = self.m_capture_stream

        def begin_body_end():
            _capturing.append(stream)                    # cudaStreamBeginCapture(..., ThreadLocal)
            try:
                out = body(stream)
            finally:
                _capturing.remove(stream)
            if stream.invalidated:                       # cudaStreamEndCapture fails
                raise CaptureError("cudaStreamEndCapture: cudaErrorStreamCaptureInvalidated", op="cudaStreamEndCapture")
            return out
        try:
            self.m_graph, self.outputs = kit_capture(begin_body_end, device=state["x"].device.type, warmups=0,
                                                     name="FusedPCG block", owner="cuda_tool::GraphCapture",
                                                     state=state)
        except CaptureError:
            self.m_disabled, self.m_failure = True, "CaptureInvalidated"
            return self.m_failure
        return "Ok"

    def ready(self):
        return self.m_graph is not None

    def launch_sync(self):
        replay(self.m_graph, self.outputs)


class LinearFusedPCG:
    def __init__(self, A, variant: str, use_cuda_graph: bool):
        self.A, self.use_cuda_graph = A, use_cuda_graph
        self.mas = MASPreconditionerEngine(A)
        z = lambda *s: torch.zeros(*s, dtype=A.dtype, device=A.device)  # noqa: E731
        self.x, self.r, self.z, self.p, self.Ap, self.AP = z(N), z(N), z(N), z(N), z(N), z(N, N)
        self.d_rz, self.d_pAp, self.d_rz_new, self.d_rz_tol = z(1), z(1), z(1), z(1)
        self.graph = GraphCapture(variant)

    def apply_preconditioner(self, z, r):
        self.mas.apply(r, z)

    def spmv_dot(self, p, Ap, d_pAp, stream=None):
        torch.mul(self.A, p, out=self.AP)
        torch.sum(self.AP, -1, out=Ap)
        torch.dot(p, Ap, out=d_pAp[0])

    def fused_block(self, stream=None):
        for _ in range(CHECK_INTERVAL):
            self.spmv_dot(self.p, self.Ap, self.d_pAp, stream)
            alpha = self.d_rz / self.d_pAp                                  # fused_update_xr
            self.x.add_(alpha * self.p)
            self.r.sub_(alpha * self.Ap)
            self.apply_preconditioner(self.z, self.r)
            torch.dot(self.r, self.z, out=self.d_rz_new[0])                 # fused_dot
            go = self.d_rz_new.abs() > self.d_rz_tol
            self.p.copy_(torch.where(go, self.z + self.d_rz_new / self.d_rz * self.p, self.p))   # fused_update_p
            self.d_rz.copy_(torch.where(go, self.d_rz_new, self.d_rz))                           # fused_swap_rz
        return self.x, self.d_rz_new

    def fused_pcg(self, b):
        self.x.fill_(0)
        self.r.copy_(b)
        self.apply_preconditioner(self.z, self.r)
        self.p.copy_(self.z)
        torch.dot(self.r, self.z, out=self.d_rz[0])
        self.d_rz_tol.copy_(TOL_RATE * self.d_rz.abs())
        k = 0
        for _ in range(MAX_BLOCKS):
            if self.use_cuda_graph and not self.graph.ready():
                self.graph.capture(self.fused_block, {n: getattr(self, n) for n in ("x", "r", "z", "p", "d_rz")})
            if self.use_cuda_graph and self.graph.ready():
                self.graph.launch_sync()
            else:
                self.fused_block()                                          # plain launches (fallback)
            k += CHECK_INTERVAL
            if abs(float(self.d_rz_new)) <= float(self.d_rz_tol):          # host check every check_interval
                break
        return self.x.clone(), torch.tensor([float(k)])


def run(variant: str, device: str = "cpu"):
    gen = generator(470)
    M = torch.randn(N, N, generator=gen, dtype=torch.float64)
    A = (M @ M.t() + N * torch.eye(N, dtype=torch.float64)).to(device)     # SPD system matrix
    bs = [torch.randn(N, generator=gen, dtype=torch.float64).to(device) for _ in range(3)]

    def serve(use_cuda_graph: bool):
        solver, outs = LinearFusedPCG(A, variant, use_cuda_graph), []
        for b in bs:                                                        # one solve per Newton iteration
            outs += list(solver.fused_pcg(b))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
