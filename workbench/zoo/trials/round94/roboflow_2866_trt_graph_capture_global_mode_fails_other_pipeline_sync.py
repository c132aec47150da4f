"""Roboflow inference: a TensorRT model captures its CUDA graph (on a cache miss for a new input shape) in torch's default global capture mode, so another pipeline thread that waits for the device at that moment fails.

Upstream: https://github.com/roboflow/inference/pull/2866 ("fix(trt): capture CUDA graphs in thread-local mode",
roboflow/inference, merged; description dated 2026-08-25). Read: the PR description (telemetry from a Jetson running
several pipelines in one container: "CUDA failure 906: operation would make the legacy stream depend on a capturing
blocking stream ... expr=cudaStreamSynchronize(...)" from the ORT CUDA EP and "CUDA error: operation would make the legacy
stream depend on a capturing blocking stream" from torch; "The only capture in the repo is `_capture_cuda_graph()` in
`inference_models/models/common/trt.py`, which ran `torch.cuda.graph(...)` with the default
`capture_error_mode="global"` ... while it is open, *any* thread that touches the legacy default stream is rejected ...
Captures only happen on a cache miss"; first of its two changes: `capture_error_mode="thread_local"`), and the pre-fix
``inference_models/inference_models/models/common/trt.py`` of 2026-08-21 (``TRTCudaGraphState``, ``TRTCudaGraphCache``,
``_execute_trt_engine`` with its cache-hit replay and cache-miss capture, ``_capture_cuda_graph``: a fresh execution
context per graph, ``input_buffer`` copy, output buffers bound by address, one warm-up ``execute_async_v3``, capture, one
replay for the returned results). Not read: the PR's diff and its second change (the description was cut after the
first); the fix is modelled as the description's first change, the capture mode.
Symptom: occasional pipeline errors on multi-pipeline deployments ("CUDA error: operation would make the legacy stream
depend on a capturing blocking stream", "CUDA failure 906") whenever a TRT model captured a graph for a newly seen input
shape while another pipeline was reading results or synchronising; the capture itself is invalidated too. Without CUDA
graphs (or with one pipeline) nothing fails.
Mechanism: ``torch.cuda.graph`` defaults to ``cudaStreamCaptureModeGlobal``: while any capture is open in the process,
every thread is forbidden the "unsafe" calls that wait for the device (a stream or device synchronize, a blocking
device-to-host copy such as ``.cpu()``); CUDA fails the other thread's call and marks the open capture as failed.
Eagerly no capture is ever open, so the other pipeline's reads are always legal. ``thread_local`` mode restricts only the
capturing thread.
Doctor: sync-in-capture, at _capture_cuda_graph. A host synchronisation (another pipeline thread's device-to-host read)
is attempted while the global-mode capture opened by ``_capture_cuda_graph`` is in progress.
Fix (upstream): capture with ``capture_error_mode="thread_local"``.
Modelled: ``_execute_trt_engine`` (the cache-hit path: copy into the captured ``input_buffer``, replay, clone the output
buffers; the cache-miss path: capture; the plain TRT path without a cache), ``_capture_cuda_graph`` (fresh execution
context, input buffer copy, output buffers bound before capture, one warm-up ``execute_async_v3``, capture, one replay,
``TRTCudaGraphState``), ``TRTCudaGraphCache`` (LRU keyed by (shape, dtype, device)). Streams and events are left out (the
engine has one stream). Stand-ins: the TensorRT engine and ``IExecutionContext`` (``set_input_shape``,
``set_tensor_address`` binding the tensor itself in place of its ``data_ptr()``, ``get_tensor_shape``,
``execute_async_v3`` writing the bound outputs), a small RF-DETR-like detector (2x2 patch tokens -> hidden 8 -> boxes and
3-class logits, float32) behind it, and pipeline B: a small eager classifier in another thread that reads its scores back
to the host (``.cpu()``) as the ORT CUDA EP's ``cudaStreamSynchronize`` does. The engine's enqueue calls a listener; the
workload uses it to run one of pipeline B's frames while pipeline A's capture is open, the timing the telemetry caught.
Workload: pipeline A (the TRT detector with a graph cache) serves 4 frames: two of batch 1 (the first captures) and two of
batch 2 (the first captures again); pipeline B serves one frame during each of A's captures. The bug raises the engine's
CaptureError from pipeline B's ``.cpu()`` ("operation not permitted when stream is capturing", global mode), and A's
capture fails at its end; the fix (thread_local) captures both graphs and A's 4 detections and B's 2 score vectors equal
the eager run (no graphs, pipelines one after the other).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/roboflow/inference/pull/2866"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "_capture_cuda_graph"
SYMPTOM = ("Several pipelines in one process: a TRT model capturing a CUDA graph for a new input shape in torch's default "
           "global capture mode makes another pipeline's device wait (a .cpu() read, an ORT stream synchronize) fail "
           "with 'operation not permitted when stream is capturing', and the capture fails")

IMG = 4                     # images 3 x 4 x 4
PATCH = 2
NUM_QUERIES = (IMG // PATCH) ** 2
HIDDEN, NUM_CLASSES = 8, 3
WAIT_S = 20.0

_variant = "bug"


# --- TensorRT stand-ins ---------------------------------------------------------------------------------------------------

class _StandInTRTEngine:
    """A small detector behind TensorRT's engine interface: outputs ``dets`` [B, Q, 4] and ``labels`` [B, Q, C]."""

    def __init__(self, device):
        gen = generator(2866)
        self.w_embed = randn(3 * PATCH * PATCH, HIDDEN, gen=gen, device=device, scale=0.5)
        self.w_box = randn(HIDDEN, 4, gen=gen, device=device, scale=0.5)
        self.w_cls = randn(HIDDEN, NUM_CLASSES, gen=gen, device=device, scale=0.5)
        self.enqueue_listeners = []

    def create_execution_context(self):
        return _StandInExecutionContext(self)

    def get_tensor_dtype(self, name):
        return torch.float32

    def run_layers(self, images):
        b = images.shape[0]
        patches = images.unfold(2, PATCH, PATCH).unfold(3, PATCH, PATCH)        # B, 3, 2, 2, P, P
        tokens = patches.permute(0, 2, 3, 1, 4, 5).reshape(b, NUM_QUERIES, 3 * PATCH * PATCH)
        h = torch.relu(tokens @ self.w_embed)
        return torch.sigmoid(h @ self.w_box), h @ self.w_cls


class _StandInExecutionContext:
    def __init__(self, engine):
        self.engine = engine
        self.shapes, self.bound = {}, {}

    def set_input_shape(self, name, shape):
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name, tensor):
        self.bound[name] = tensor
        return True

    def get_tensor_shape(self, name):
        b = self.shapes["images"][0]
        return (b, NUM_QUERIES, 4) if name == "dets" else (b, NUM_QUERIES, NUM_CLASSES)

    def execute_async_v3(self, stream_handle=0):
        for listener in self.engine.enqueue_listeners:
            listener()
        dets, labels = self.engine.run_layers(self.bound["images"])
        self.bound["dets"].copy_(dets)
        self.bound["labels"].copy_(labels)
        return True


# --- inference_models/inference_models/models/common/trt.py ---------------------------------------------------------------

@dataclass
class TRTCudaGraphState:
    cuda_graph: object
    input_buffer: torch.Tensor
    output_buffers: list
    execution_context: object


class TRTCudaGraphCache:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._cache = OrderedDict()

    def __contains__(self, key):
        return key in self._cache

    def __getitem__(self, key):
        self._cache.move_to_end(key)
        return self._cache[key]

    def __setitem__(self, key, value):
        self._cache[key] = value
        self._cache.move_to_end(key)
        while len(self._cache) > self.capacity:
            self._cache.popitem(last=False)


def _execute_trt_engine(pre_processed_images, engine, context, device, input_name, outputs, trt_cuda_graph_cache=None):
    if trt_cuda_graph_cache is not None:
        cache_key = (tuple(pre_processed_images.shape), pre_processed_images.dtype, device)
        if cache_key not in trt_cuda_graph_cache:
            results, trt_cuda_graph = _capture_cuda_graph(pre_processed_images, engine, device, input_name, outputs)
            trt_cuda_graph_cache[cache_key] = trt_cuda_graph
            return results
        state = trt_cuda_graph_cache[cache_key]
        state.input_buffer.copy_(pre_processed_images)
        replay(state.cuda_graph, tuple(state.output_buffers))
        return [buf.clone() for buf in state.output_buffers]
    context.set_input_shape(input_name, tuple(pre_processed_images.shape))
    context.set_tensor_address(input_name, pre_processed_images)
    results = []
    for output in outputs:
        result = torch.empty(tuple(context.get_tensor_shape(output)), dtype=engine.get_tensor_dtype(output), device=device)
        context.set_tensor_address(output, result)
        results.append(result)
    context.execute_async_v3()
    return results


def _capture_cuda_graph(pre_processed_images, engine, device, input_name, outputs):
    # Each CUDA graph needs its own execution context.
    graph_context = engine.create_execution_context()
    input_buffer = torch.empty_like(pre_processed_images, device=device)
    input_buffer.copy_(pre_processed_images)
    graph_context.set_input_shape(input_name, tuple(pre_processed_images.shape))
    graph_context.set_tensor_address(input_name, input_buffer)
    output_buffers = []
    for output in outputs:
        output_buffer = torch.empty(tuple(graph_context.get_tensor_shape(output)),
                                    dtype=engine.get_tensor_dtype(output), device=device)
        graph_context.set_tensor_address(output, output_buffer)
        output_buffers.append(output_buffer)

    def enqueue():
        graph_context.execute_async_v3()
        return tuple(output_buffers)

    # warm-up execute_async_v3, then ``with torch.cuda.graph(cuda_graph, stream=stream, ...)``
    capture_error_mode = "global" if _variant == "bug" else "thread_local"
    cuda_graph, _ = capture(enqueue, device=device, warmups=1, name=f"trt {tuple(pre_processed_images.shape)}",
                            owner="_capture_cuda_graph", static={"input_buffer": input_buffer},
                            capture_error_mode=capture_error_mode)
    # in order to avoid drift of results - it's better to replay to get the results
    replay(cuda_graph, tuple(output_buffers))
    results = [buf.clone() for buf in output_buffers]
    return results, TRTCudaGraphState(cuda_graph, input_buffer, output_buffers, graph_context)


class RFDetrForObjectDetectionTRT:
    def __init__(self, device, use_cuda_graph: bool):
        self.engine = _StandInTRTEngine(device)
        self.context = self.engine.create_execution_context()
        self.device = device
        self.trt_cuda_graph_cache = TRTCudaGraphCache(capacity=8) if use_cuda_graph else None

    def forward(self, pre_processed_images):
        dets, labels = _execute_trt_engine(pre_processed_images, self.engine, self.context, self.device, "images",
                                           ["dets", "labels"], trt_cuda_graph_cache=self.trt_cuda_graph_cache)
        return torch.cat([dets, labels.softmax(-1)], dim=-1)


# --- pipeline B (stand-in): another model in the same process, reading its results on the host ---------------------------

class OtherPipelineClassifier:
    def __init__(self, device):
        gen = generator(28660)
        self.w = randn(3 * IMG * IMG, 5, gen=gen, device=device, scale=0.3)

    def infer(self, image):
        scores = (image.reshape(1, -1) @ self.w).softmax(-1)
        return scores.cpu()                        # the host waits for the device (ORT: cudaStreamSynchronize)


class _Interleaving:
    """Runs one of pipeline B's frames each time pipeline A's engine is enqueued inside an open capture."""

    def __init__(self):
        self.go, self.done = threading.Event(), threading.Event()
        self.stopped = False

    def at_enqueue(self):
        if self.stopped or not torch.cuda.is_current_stream_capturing():
            return
        self.go.set()
        self.done.wait(WAIT_S)
        self.done.clear()

    def stop(self):
        self.stopped = True
        self.go.set()


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(28661)
    frames_a = [randn(1, 3, IMG, IMG, gen=gen, device=device), randn(1, 3, IMG, IMG, gen=gen, device=device),
                randn(2, 3, IMG, IMG, gen=gen, device=device), randn(2, 3, IMG, IMG, gen=gen, device=device)]
    frames_b = [randn(3, IMG, IMG, gen=gen, device=device) for _ in range(2)]

    def eager():
        model_a, model_b = RFDetrForObjectDetectionTRT(device, use_cuda_graph=False), OtherPipelineClassifier(device)
        return [model_a.forward(f) for f in frames_a] + [model_b.infer(f) for f in frames_b]

    def served():
        model_a, model_b = RFDetrForObjectDetectionTRT(device, use_cuda_graph=True), OtherPipelineClassifier(device)
        meet = _Interleaving()
        model_a.engine.enqueue_listeners.append(meet.at_enqueue)
        results_a, results_b, errors = [], [], []

        def pipeline_a():
            try:
                for f in frames_a:
                    results_a.append(model_a.forward(f))
            except Exception as e:  # noqa: BLE001 - reported after both pipelines stop
                errors.append(("A", e))
            finally:
                meet.stop()

        def pipeline_b():
            for f in frames_b:
                meet.go.wait(WAIT_S)
                meet.go.clear()
                if meet.stopped:
                    return
                try:
                    results_b.append(model_b.infer(f))
                except Exception as e:  # noqa: BLE001 - the pipeline's error, reported after both stop
                    errors.append(("B", e))
                    meet.stopped = True
                    return
                finally:
                    meet.done.set()

        threads = [threading.Thread(target=pipeline_b), threading.Thread(target=pipeline_a)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(2 * WAIT_S)
        if errors:
            raise errors[0][1]                       # the first failure, as the telemetry reported it
        return results_a + results_b

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
