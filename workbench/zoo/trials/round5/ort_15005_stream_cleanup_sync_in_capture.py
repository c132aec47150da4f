"""The per-run stream clean-up synchronises the stream while the CUDA EP is still capturing the run.

Upstream: https://github.com/microsoft/onnxruntime/pull/15005 ("Fix cuda graph capture", issue 2 of the PR;
issue https://github.com/microsoft/onnxruntime/issues/15002 "CUDA Graph Error - CUDA failure 900: operation
not permitted when stream is capturing").
Symptom: with the CUDA EP's ``enable_cuda_graph``, the run that should capture the graph fails with "CUDA
failure 900: operation not permitted when stream is capturing", raised from ``CudaStream::CleanUpOnRunEnd``
(ONNX Runtime 1.14, March 2023); without graphs the model runs.
Mechanism: multi-stream support (#13495) made ``utils::ExecuteGraph`` end every run with
``DeviceStreamCollection::CleanUp``, which calls ``CudaStream::CleanUpOnRunEnd``: when the run deferred
pinned CPU buffers (the staging buffers of kernels' host-to-device parameter copies), it synchronises the
stream and then returns them to the CPU allocator (a host-function node would be captured and replayed).
The CUDA EP begins the capture in ``OnRunStart`` and ends it in ``OnRunEnd``, after ``ExecuteGraph``
returns, so on the capturing run that ``cudaStreamSynchronize`` is issued on a capturing stream and the
capture is invalidated.
Doctor: sync-in-capture, at ``CleanUpOnRunEnd`` (the stream synchronisation inside the capture window).
Fix (upstream): "move stream cleanup after cuda graph capture": the streams are cleaned up once the EP's
``OnRunEnd`` has ended the capture. (The PR's other part, two regular runs before capture instead of one
because memory-pattern planning allocates on the second run, is not modelled.)
"""
from __future__ import annotations

import contextlib

import torch

from workbench.engine import events, graph, host, is_capturing, new_graph
from workbench.engine.cpu_graph import host_sync_error
from workbench.engine.source import user_frame
from workbench.zoo.kit import compare, generator, randn, replay

UPSTREAM = "https://github.com/microsoft/onnxruntime/pull/15005"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "CleanUpOnRunEnd"
SYMPTOM = "CUDA failure 900 (operation not permitted when stream is capturing) on the capturing run"

BATCH, DIM = 3, 4
MIN_NUM_RUNS_BEFORE_CUDA_GRAPH_CAPTURE = 1     # "one regular run is needed before graph capture"


def cudaStreamSynchronize(stream):
    """The CUDA runtime call: the host waits for the stream. A capturing stream refuses it
    (cudaErrorStreamCaptureUnsupported, "operation not permitted when stream is capturing"); the CPU
    emulation has no stream object, so the rule is stated here."""
    if torch.device(stream.device).type == "cuda":
        torch.cuda.current_stream().synchronize()
    elif is_capturing():
        raise host_sync_error("cudaStreamSynchronize", user_frame())


class BFCArena:
    """The pinned CPU allocator: freed buffers go back to the arena (they stay mapped)."""

    def __init__(self, device):
        self.device, self.free_list = device, []

    def Alloc(self, n):
        return self.free_list.pop() if self.free_list else host(torch.zeros(n, dtype=torch.int64), self.device)

    def Free(self, buffer):
        self.free_list.append(buffer)


class CudaStream:
    def __init__(self, device, cpu_allocator):
        self.device, self.cpu_allocator = device, cpu_allocator
        self.deferred_cpu_buffers = []

    def EnqueDeferredCPUBuffer(self, cpu_buffer):
        self.deferred_cpu_buffers.append(cpu_buffer)

    def CleanUpOnRunEnd(self):
        if not self.deferred_cpu_buffers:
            return
        # wait until the host-to-device copies have read the staging buffers, then give them back
        cudaStreamSynchronize(self)
        for buffer in self.deferred_cpu_buffers:
            self.cpu_allocator.Free(buffer)
        self.deferred_cpu_buffers.clear()


class DeviceStreamCollection:
    def __init__(self, streams):
        self.streams = streams

    def CleanUp(self):
        for stream in self.streams:
            stream.CleanUpOnRunEnd()


class Model:
    """Gemm -> Relu -> Transpose-like column gather (perm staged through pinned memory) -> Gemm."""

    def __init__(self, device):
        gen = generator(15005)
        self.w1 = randn(DIM, DIM, gen=gen, device=device)
        self.w2 = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
        self.perm = [2, 0, 3, 1]


def Transpose(x, perm, stream):
    """A kernel whose parameters go host -> device through a pinned staging buffer (CudaAsyncBuffer)
    that the stream releases at the end of the run."""
    staging = stream.cpu_allocator.Alloc(len(perm))
    staging.copy_(torch.tensor(perm))
    perm_gpu = torch.empty(len(perm), dtype=torch.int64, device=x.device)
    perm_gpu.copy_(staging, non_blocking=True)               # CopyToGpu (async H2D)
    stream.EnqueDeferredCPUBuffer(staging)
    return x.index_select(1, perm_gpu)


def ExecuteGraph(model, feeds, fetches, device_stream_collection, clean_up_streams):
    stream = device_stream_collection.streams[0]
    h = torch.relu(feeds["X"] @ model.w1)
    h = Transpose(h, model.perm, stream)
    fetches["Y"].copy_(h @ model.w2)
    if clean_up_streams:
        device_stream_collection.CleanUp()


class CUDAExecutionProvider:
    def __init__(self, device, enable_cuda_graph):
        self.device, self.enable_cuda_graph = device, enable_cuda_graph
        self.regular_run_count_before_graph_capture = 0
        self.graph, self.is_graph_captured, self._capture = None, False, None

    def IsGraphCaptureAllowed(self):
        return self.regular_run_count_before_graph_capture >= MIN_NUM_RUNS_BEFORE_CUDA_GRAPH_CAPTURE

    def OnRunStart(self):
        if self.enable_cuda_graph and not self.is_graph_captured and self.IsGraphCaptureAllowed():
            self.graph = new_graph(self.device)
            self._capture = contextlib.ExitStack()
            self._capture.enter_context(graph(self.graph, name="CUDA EP graph"))     # CaptureBegin

    def OnRunEnd(self, fetches):
        if self._capture is not None:
            self._capture.close()                                                    # CaptureEnd
            self._capture, self.is_graph_captured = None, True
            self.ReplayGraph(fetches)
        elif self.enable_cuda_graph:
            self.regular_run_count_before_graph_capture += 1

    def AbortCapture(self, exc):
        if self._capture is not None:
            capture, self._capture = self._capture, None
            capture.__exit__(type(exc), exc, exc.__traceback__)

    def ReplayGraph(self, fetches):
        replay(self.graph, fetches["Y"])


class InferenceSession:
    def __init__(self, model, device, enable_cuda_graph, variant):
        self.model, self.variant = model, variant
        self.ep = CUDAExecutionProvider(device, enable_cuda_graph)
        self.streams = DeviceStreamCollection([CudaStream(device, BFCArena(device))])

    def Run(self, feeds, fetches):
        """run_with_iobinding: feeds and fetches are the bound (fixed-address) buffers."""
        if self.ep.is_graph_captured:
            self.ep.ReplayGraph(fetches)
            return
        capturing = self.ep.enable_cuda_graph and self.ep.IsGraphCaptureAllowed()
        run = contextlib.nullcontext() if capturing or not self.ep.enable_cuda_graph else events.warmup(real=True)
        with run:
            self.ep.OnRunStart()
            try:
                ExecuteGraph(self.model, feeds, fetches, self.streams, clean_up_streams=self.variant == "bug")
            except BaseException as e:
                self.ep.AbortCapture(e)
                raise
            self.ep.OnRunEnd(fetches)
            if self.variant == "fix":
                self.streams.CleanUp()          # after the EP has ended the capture


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    gen = generator(1)
    inputs = [randn(BATCH, DIM, gen=gen, device=device) for _ in range(4)]

    def serve(enable_cuda_graph: bool):
        session = InferenceSession(model, device, enable_cuda_graph, variant)
        x_buf, y_buf = torch.zeros(BATCH, DIM, device=device), torch.zeros(BATCH, DIM, device=device)
        if enable_cuda_graph:
            events.static_buffers("ORT IOBinding", {"X": x_buf})
        outs = []
        for x in inputs:
            x_buf.copy_(x)                      # same bound address every run, as CUDA graphs require
            session.Run({"X": x_buf}, {"Y": y_buf})
            outs.append(y_buf.clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
