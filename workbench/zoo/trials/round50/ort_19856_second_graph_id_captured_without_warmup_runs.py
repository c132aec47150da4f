"""A second CUDA-graph id is captured on its very first run: the warm-up run counter is shared by all graph ids.

Upstream: https://github.com/microsoft/onnxruntime/pull/19856 ("bug fix to multi-cudagraph", merged 2024-03-11),
a follow-up of #19636 ("cuda graph enhancement", several graphs per session keyed by the ``gpu_graph_id`` run
option); the reviewer of #19636 pointed the bug out there.
Symptom: the PR states none beyond its description ("run_count_before_capture_ is graph_id aware"). By
mechanism: in a session serving several graph ids (e.g. one per decode shape), the first ``Run`` of every id
after the first one is captured with no regular run before it, so the per-shape first-run work that CUDA
forbids on a capturing stream runs under capture and ``Run`` fails (stream capture unsupported).
Mechanism: ``CUDAExecutionProvider::OnRunStart`` calls ``CaptureBegin(id)`` when
``PerThreadContext::IsGraphCaptureAllowed(id) && !IsGraphCaptured(id)``; ``OnRunEnd`` either ends the capture
and replays it (work issued to a capturing stream does not run) or, for a regular run, calls
``IncrementRegularRunCountBeforeGraphCapture()``. The ``min_num_runs_before_cuda_graph_capture_`` (2) regular
runs exist so that a shape's first-run work (arena growth, memory pattern, per-shape kernel state) happens
eagerly. After #19636 the graphs are per id but the counter, ``regular_run_count_before_graph_capture_``, is
one for the whole context: once id 1 has had its two regular runs, ``IsGraphCaptureAllowed(2)`` is already
true, so id 2's first run (a new shape) goes straight into ``CaptureBegin(2)``. Modelled per-shape first-run
work: the CUDA ``Conv`` kernel's algorithm search (``Conv<T>::UpdateState`` on a shape missing from
``cached_benchmark_results``: ``cudnnFindConvolutionForwardAlgorithmEx`` runs every algorithm and reads their
status on the host), which a capturing stream refuses.
Doctor: sync-in-capture, at ``IsGraphCaptureAllowed`` (it allows capturing id 2 on the strength of id 1's
regular runs; the host read itself is in ``Conv.UpdateState``, which a warmed-up id never reaches under
capture).
Fix (upstream): ``std::unordered_map<CudaGraphAnnotation_t, int> graph_id_to_run_count_``;
``IncrementRegularRunCountBeforeGraphCapture(cuda_graph_annotation_id)`` inserts the id at 0 if absent and
increments it; ``IsGraphCaptureAllowed(id)`` compares ``graph_id_to_run_count_[id]`` with the minimum.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/microsoft/onnxruntime/pull/19856"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "IsGraphCaptureAllowed"
SYMPTOM = "multi-graph CUDA EP session: the second gpu_graph_id is captured on its first run and the capture fails"

C_IN, C_OUT, LENGTH, KERNEL, HIDDEN = 3, 4, 6, 3, 5
MIN_NUM_RUNS_BEFORE_CUDA_GRAPH_CAPTURE = 2     # CUDA EP: memory pattern + stream arena need two regular runs
kCudaGraphAnnotationSkip = -1
# (gpu_graph_id run option, batch of the bound input): two decode shapes, one graph each
SCHEDULE = [(1, 2), (1, 2), (1, 2), (1, 2), (2, 4), (2, 4), (2, 4), (2, 4), (1, 2), (2, 4)]


def _implicit_gemm(x, w):
    return F.conv1d(x, w, padding=KERNEL // 2)


def _gemm(x, w):
    cols = F.pad(x, (KERNEL // 2, KERNEL // 2)).unfold(2, KERNEL, 1)         # [N, C_in, L, K]
    return torch.einsum("nclk,ock->nol", cols, w)


CONV_FWD_ALGOS = {"CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM": _implicit_gemm,
                  "CUDNN_CONVOLUTION_FWD_ALGO_GEMM": _gemm}


class Conv:
    """CUDA ``Conv<float>``: the forward algorithm is searched once per input shape and cached."""

    def __init__(self, w):
        self.w = w
        self.cached_benchmark_results: dict[tuple, str] = {}

    def UpdateState(self, x):
        key = tuple(x.shape)
        if key not in self.cached_benchmark_results:
            # cudnnFindConvolutionForwardAlgorithmEx: run every algorithm, read each one's status on the host
            for algo, impl in CONV_FWD_ALGOS.items():
                if bool(torch.isfinite(impl(x, self.w)).all()):
                    self.cached_benchmark_results[key] = algo
                    break
        return CONV_FWD_ALGOS[self.cached_benchmark_results[key]]

    def ComputeInternal(self, x):
        return self.UpdateState(x)(x, self.w)


class Model:
    """Conv -> Relu -> ReduceMean -> MatMul, as one ONNX graph."""

    def __init__(self, device):
        gen = generator(19856)
        self.conv = Conv(randn(C_OUT, C_IN, KERNEL, gen=gen, device=device, scale=0.6))
        self.w_out = randn(C_OUT, HIDDEN, gen=gen, device=device, scale=0.7)

    def execute(self, x, y):
        h = torch.relu(self.conv.ComputeInternal(x)).mean(-1)
        y.copy_(h @ self.w_out)                     # outputs are bound: kernels write into the bound buffer


class PerThreadContext:
    def __init__(self, variant):
        self.variant = variant
        self.regular_run_count_before_graph_capture_ = 0          # before the fix: one for all graph ids
        self.graph_id_to_run_count_: dict[int, int] = {}           # the fix: one per graph id
        self.cuda_graphs_: dict[int, tuple] = {}                   # CUDAGraphManager: id -> (graph, outputs)

    def IsGraphCaptureAllowedOnRun(self, cuda_graph_annotation_id):
        return cuda_graph_annotation_id != kCudaGraphAnnotationSkip

    def IsGraphCaptureAllowed(self, cuda_graph_annotation_id):
        if not self.IsGraphCaptureAllowedOnRun(cuda_graph_annotation_id):
            return False
        if self.variant == "bug":
            return self.regular_run_count_before_graph_capture_ >= MIN_NUM_RUNS_BEFORE_CUDA_GRAPH_CAPTURE
        return self.graph_id_to_run_count_.get(cuda_graph_annotation_id, 0) >= MIN_NUM_RUNS_BEFORE_CUDA_GRAPH_CAPTURE

    def IncrementRegularRunCountBeforeGraphCapture(self, cuda_graph_annotation_id):
        if self.variant == "bug":
            self.regular_run_count_before_graph_capture_ += 1
            return
        if cuda_graph_annotation_id not in self.graph_id_to_run_count_:
            self.graph_id_to_run_count_[cuda_graph_annotation_id] = 0
        self.graph_id_to_run_count_[cuda_graph_annotation_id] += 1

    def IsGraphCaptured(self, cuda_graph_annotation_id):
        return cuda_graph_annotation_id in self.cuda_graphs_


class InferenceSession:
    def __init__(self, model, device, variant, enable_cuda_graph):
        self.model, self.device, self.enable_cuda_graph = model, device, enable_cuda_graph
        self.ctx = PerThreadContext(variant)

    def Run(self, run_options, io_binding):
        graph_id = run_options["gpu_graph_id"]
        x, y = io_binding["input"], io_binding["output"]
        ctx = self.ctx
        if not self.enable_cuda_graph:
            self.model.execute(x, y)
            return y
        if ctx.IsGraphCaptured(graph_id):                      # InferenceSession::Run: replay the id's graph
            g, out = ctx.cuda_graphs_[graph_id]
            return replay(g, out)
        if ctx.IsGraphCaptureAllowed(graph_id):                # OnRunStart: CaptureBegin(id)
            def session_run():
                self.model.execute(x, y)
                return y
            g, out = capture(session_run, device=self.device, warmups=0, name=f"gpu_graph_id {graph_id}",
                             owner="CUDAExecutionProvider (IOBinding)", static={"input": x, "output": y})
            ctx.cuda_graphs_[graph_id] = (g, out)              # OnRunEnd: CaptureEnd(id), then ReplayGraph(id)
            return replay(g, out)
        with events.warmup(real=True):                         # a regular run, handed to the caller
            self.model.execute(x, y)
        ctx.IncrementRegularRunCountBeforeGraphCapture(graph_id)   # OnRunEnd
        return y


def run(variant: str, device: str = "cpu"):
    gen = generator(1985)
    inputs = [randn(n, C_IN, LENGTH, gen=gen, device=device) for _, n in SCHEDULE]

    def serve(graphed: bool):
        session = InferenceSession(Model(device), device, variant, graphed)   # a fresh session (cold kernels)
        bindings = {}                                          # one IOBinding (fixed buffers) per graph id
        outs = []
        for (graph_id, n), data in zip(SCHEDULE, inputs):
            if graph_id not in bindings:
                bindings[graph_id] = {"input": torch.zeros(n, C_IN, LENGTH, device=device),
                                      "output": torch.zeros(n, HIDDEN, device=device)}
            bindings[graph_id]["input"].copy_(data)            # update the bound input in place
            outs.append(session.Run({"gpu_graph_id": graph_id}, bindings[graph_id]).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
