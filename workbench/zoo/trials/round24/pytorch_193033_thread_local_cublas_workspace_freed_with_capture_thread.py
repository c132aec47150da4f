"""Thread-local cuBLAS workspaces die with the short-lived thread that captured the GEMM; the graph keeps their address.

Upstream: https://github.com/pytorch/pytorch/pull/193033 ("Revert \"[cuBLAS][cuBLASLt] Thread-local
cuBLAS(Lt) workspace maps (#180283)\""), the fix of https://github.com/pytorch/pytorch/issues/192061
("[vllm] [torch nightly 2.14 regression][H100] CUDA WARP_ILLEGAL_ADDRESS in cuBLAS `nvjet_sm90` split-K
GEMM kills worker -- DBO+DP+EP GSM8K accuracy 0.000").
Symptom: vLLM with dual-batch overlap (DBO) on the torch 2.14 nightly: replays of the decode CUDA graphs
fault inside a cuBLAS split-K GEMM (``WARP_ILLEGAL_ADDRESS``) or return garbage (GSM8K accuracy 0.000);
torch 2.13 and eager are fine.
Mechanism: #180283 made ``cublas_handle_stream_to_workspace()`` (and the cuBLASLt map) ``thread_local``:
``getCUDABlasLtWorkspace`` hands each (handle, stream) a workspace ``DataPtr`` from the caching allocator,
owned by the calling thread's map. vLLM's DBO runner captures each micro-batch's graph on a short-lived
worker thread; the warmup there allocates the workspace, the capture bakes its address into the split-K
GEMM (partial products are written to it and reduced from it), and when the worker exits its
``thread_local`` map is destroyed and the workspace freed. Every later replay writes and reads memory the
allocator has taken back (and hands to others).
Doctor: dangling-reference, at ``cublas_handle_stream_to_workspace`` (its map lives only as long as the
capturing thread, so the workspace the captured GEMM uses is released when that thread exits).
Fix (upstream): revert to one process-wide ``cublas_handle_stream_to_workspace()`` map, whose workspaces
live until they are explicitly cleared, as they did before #180283 ("needs additional handling for
multithreaded graph-capture").
(Read: the descriptions and discussion of #193033, #180283 and #192061 (whose thread-exit analysis this
follows) and the proposed follow-ups #192871 and #193046; the C++ diff itself was not available. The
thread_local destructor that C++ runs at thread exit is run explicitly at the end of the worker.)
"""
from __future__ import annotations

import threading

import torch

from workbench.zoo.kit import (capture, compare, generator, own_segment_elems, randn, release_to_driver,
                               replay)

UPSTREAM = "https://github.com/pytorch/pytorch/pull/193033"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "cublas_handle_stream_to_workspace"
SYMPTOM = "DBO decode graphs captured on worker threads replay a split-K GEMM into a freed cuBLAS workspace"
TOKENS, HIDDEN, FFN, SPLIT_K, NUM_UBATCHES, STEPS = 3, 4, 6, 2, 2, 3


class CublasHandlePool:
    """``aten/src/ATen/cuda/CublasHandlePool.cpp``: the (handle, stream) -> workspace maps."""

    def __init__(self, variant, device):
        self.variant, self.device = variant, device
        self._workspaces = {}                  # the process-wide map (before #180283, and the revert)
        self._thread_local = threading.local()  # #180283: one map per thread

    def cublas_handle_stream_to_workspace(self):
        if self.variant == "bug":
            if not hasattr(self._thread_local, "workspaces"):
                self._thread_local.workspaces = {}
            return self._thread_local.workspaces
        return self._workspaces

    def getCUDABlasLtWorkspace(self, stream):
        workspaces = self.cublas_handle_stream_to_workspace()
        key = ("cublasLt handle", stream)
        if key not in workspaces:                       # getNewCUDABlasLtWorkspace(): a caching-allocator block
            size = max(own_segment_elems(self.device), SPLIT_K * TOKENS * FFN)
            workspaces[key] = torch.empty(size, device=self.device)
        return workspaces[key]

    def thread_exit(self):
        """What C++ does when a thread ends: its ``thread_local`` map is destroyed, freeing its workspaces."""
        if hasattr(self._thread_local, "workspaces"):
            del self._thread_local.workspaces


def cublaslt_matmul_split_k(handles, stream, a, b):
    """``cublasLtMatmul`` with a split-K algorithm (``nvjet ... splitK``): partial products go to the
    handle's workspace, then a reduction kernel sums them."""
    m, k = a.shape
    n = b.shape[1]
    chunk = k // SPLIT_K
    partial = handles.getCUDABlasLtWorkspace(stream)[: SPLIT_K * m * n].view(SPLIT_K, m, n)
    for s in range(SPLIT_K):
        torch.mm(a[:, s * chunk:(s + 1) * chunk], b[s * chunk:(s + 1) * chunk], out=partial[s])
    return partial.sum(0)


class MLP:
    def __init__(self, device, handles):
        gen = generator(192061)
        self.w_up = randn(HIDDEN, FFN, gen=gen, device=device, scale=0.6)
        self.w_down = randn(FFN, HIDDEN, gen=gen, device=device, scale=0.6)
        self.handles = handles

    def forward(self, stream, hidden):
        up = torch.relu(cublaslt_matmul_split_k(self.handles, stream, hidden, self.w_up))
        return hidden + cublaslt_matmul_split_k(self.handles, stream, up, self.w_down)


class UBatchWrapper:
    """vLLM's DBO runner: each micro-batch's graph is warmed up and captured on its own worker thread."""

    def __init__(self, model, device):
        self.model, self.device = model, device
        self.inputs = [torch.zeros(TOKENS, HIDDEN, device=device) for _ in range(NUM_UBATCHES)]
        self.graphs = [None] * NUM_UBATCHES

    def _capture_ubatch_thread(self, i):
        stream = f"ubatch {i} compute stream"
        try:
            self.graphs[i] = capture(lambda: self.model.forward(stream, self.inputs[i]), device=self.device,
                                     name=f"ubatch {i}", owner="UBatchWrapper",
                                     static={f"ubatch {i} hidden": self.inputs[i]})
        finally:
            self.model.handles.thread_exit()

    def capture_graphs(self):
        for i in range(NUM_UBATCHES):
            worker = threading.Thread(target=self._capture_ubatch_thread, args=(i,))
            worker.start()
            worker.join()
        # vLLM releases cached memory after capturing (gc.collect(); torch.cuda.empty_cache())
        release_to_driver(self.device)

    def execute(self, ubatch_hidden):
        outs = []
        for i, h in enumerate(ubatch_hidden):
            self.inputs[i].copy_(h)
            graph, out = self.graphs[i]
            outs.append(replay(graph, out).clone())
        return outs


def run(variant: str, device: str = "cpu"):
    gen = generator(180283)
    steps = [[randn(TOKENS, HIDDEN, gen=gen, device=device) for _ in range(NUM_UBATCHES)]
             for _ in range(STEPS)]

    def served():
        runner = UBatchWrapper(MLP(device, CublasHandlePool(variant, device)), device)
        runner.capture_graphs()
        return [out for step in steps for out in runner.execute(step)]

    def eager():
        model = MLP(device, CublasHandlePool(variant, device))
        return [model.forward(f"ubatch {i} compute stream", h).clone()
                for step in steps for i, h in enumerate(step)]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
