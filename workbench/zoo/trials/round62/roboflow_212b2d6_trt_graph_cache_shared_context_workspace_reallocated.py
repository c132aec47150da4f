"""The TRT CUDA-graph cache captures every input shape on the model's one execution context: re-shaping it for
a new batch size reallocates the context's workspace, which the graphs captured for earlier shapes still use.

Upstream: https://github.com/roboflow/inference/commit/212b2d64231b2f4f01aa883077097037fa9afaf6 ("fix failing
test", in PR https://github.com/roboflow/inference/pull/1938 "Add option to use CUDA graphs with TRT for RF-DETR
Object Detection in `inference_models`").
Symptom: the dynamic-batch yolov8 TRT test (batch sizes cycling, shape caching of CUDA graphs) failed: once a
second batch size had been captured, replays of the first one no longer matched the eager path (wrong
detections or a memory fault).
Mechanism: ``execute_trt_engine`` (``inference_models/models/common/trt.py``) keys a ``TRTCudaGraphLRUCache`` on
``(input_shape, input_dtype, device)``. On a miss ``_capture_cuda_graph(pre_processed_images, engine, context,
...)`` took the model's single ``self._execution_context``: ``context.set_input_shape(input_name, shape)``,
``set_tensor_address`` for a fresh ``input_buffer`` and the ``output_buffers``, one warmup
``execute_async_v3`` and a second one inside ``torch.cuda.graph(cuda_graph, stream=stream)``. The captured
kernels bake in the context's internal activation/workspace memory. A later miss for another batch size
re-shapes the SAME context; TensorRT reallocates its workspace for the new shape and releases the old block.
Every graph captured for an earlier shape still reads and writes that released block; a cache hit for the
first shape (``input_buffer.copy_``, ``cuda_graph.replay()``) computes through freed memory. (Miniature: the
engine is two dense layers, the workspace holds the hidden activations; the context reallocates it whenever
the input shape changes. A miss here captures and then serves its step through the hit path, leaving out
the separate capture-time-clone issue of 3e6dd5cb.)
Doctor: dangling-reference, at ``_capture_cuda_graph`` (it captures on the shared context, whose workspace
the next capture for another shape releases while the earlier graph still holds its address).
Fix (upstream): ``_capture_cuda_graph`` no longer takes ``context``; it creates ``graph_context =
engine.create_execution_context()`` per graph ("Each CUDA graph needs its own execution context. Sharing a
single context across graphs for different input shapes causes TRT to reallocate internal workspace
buffers, invalidating GPU addresses baked into earlier graphs."), uses it for every ``set_input_shape`` /
``set_tensor_address`` / ``execute_async_v3``, and keeps it alive in ``TRTCudaGraphState.execution_context``;
the callers pass ``context=None  # the graph cache has its own contexts``.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict

import torch

from workbench.zoo.kit import capture, compare, generator, own_segment_elems, randn, release_to_driver, replay

UPSTREAM = "https://github.com/roboflow/inference/commit/212b2d64231b2f4f01aa883077097037fa9afaf6"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "_capture_cuda_graph"
SYMPTOM = "after a second batch size is captured, replays of the first shape's graph use the freed TRT workspace"

IN_FEATURES, HIDDEN, OUT_FEATURES = 6, 8, 5
BATCH_SIZES = [1, 4, 1, 4, 2, 1]             # dynamic-batch requests: shapes cycle through the graph cache
INPUT_NAME, OUTPUT_NAME = "images", "output0"


class ICudaEngine:
    """The TensorRT engine in miniature: two dense layers with an activation workspace in the context."""

    def __init__(self, device: str) -> None:
        gen = generator(212)
        self.device = device
        self.w1 = randn(IN_FEATURES, HIDDEN, gen=gen, device=device, scale=0.5)
        self.w2 = randn(HIDDEN, OUT_FEATURES, gen=gen, device=device, scale=0.5)

    def create_execution_context(self) -> "IExecutionContext":
        return IExecutionContext(self)


class IExecutionContext:
    """Per-context shape, bindings and internal workspace (device memory the enqueued kernels use)."""

    def __init__(self, engine: ICudaEngine) -> None:
        self.engine = engine
        self._input_shape: tuple[int, ...] | None = None
        self._workspace: torch.Tensor | None = None
        self._addresses: dict[str, torch.Tensor] = {}

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        if shape != self._input_shape:
            # TRT sizes its activation memory for the new shape: the old block goes back to the allocator.
            self._input_shape = shape
            numel = max(shape[0] * HIDDEN, own_segment_elems(self.engine.device))
            self._workspace = torch.empty(numel, device=self.engine.device)
        return True

    def set_tensor_address(self, name: str, tensor: torch.Tensor) -> bool:
        self._addresses[name] = tensor              # data_ptr() binding
        return True

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return (self._input_shape[0], OUT_FEATURES)

    def execute_async_v3(self) -> bool:
        x, out = self._addresses[INPUT_NAME], self._addresses[OUTPUT_NAME]
        act = self._workspace[: x.shape[0] * HIDDEN].view(x.shape[0], HIDDEN)
        torch.matmul(x, self.engine.w1, out=act)
        act.relu_()
        torch.matmul(act, self.engine.w2, out=out)
        return True


@dataclasses.dataclass
class TRTCudaGraphState:
    cuda_graph: object
    input_buffer: torch.Tensor
    output_buffers: list
    execution_context: IExecutionContext | None = None      # added by the fix


class TRTCudaGraphLRUCache:
    def __init__(self, capacity: int = 64) -> None:
        self.cache: OrderedDict = OrderedDict()
        self.capacity = capacity

    def __contains__(self, key) -> bool:
        return key in self.cache

    def __getitem__(self, key) -> TRTCudaGraphState:
        self.cache.move_to_end(key)
        return self.cache[key]

    def __setitem__(self, key, value: TRTCudaGraphState) -> None:
        self.cache[key] = value
        self.cache.move_to_end(key)
        if len(self.cache) > self.capacity:
            self.cache.popitem(last=False)


def _capture_cuda_graph(pre_processed_images, engine, context, device, variant) -> TRTCudaGraphState:
    if variant == "bug":
        graph_context = context                          # the model's one self._execution_context
    else:
        # Each CUDA graph needs its own execution context (the fix).
        graph_context = engine.create_execution_context()
    input_buffer = torch.empty_like(pre_processed_images, device=device)
    input_buffer.copy_(pre_processed_images)
    graph_context.set_input_shape(INPUT_NAME, tuple(pre_processed_images.shape))
    graph_context.set_tensor_address(INPUT_NAME, input_buffer)
    output_buffer = torch.empty(graph_context.get_tensor_shape(OUTPUT_NAME), device=device)
    graph_context.set_tensor_address(OUTPUT_NAME, output_buffer)

    def enqueue():
        graph_context.execute_async_v3()
        return output_buffer

    # one warmup execute_async_v3, then the captured one
    cuda_graph, _ = capture(enqueue, device=device, name=f"trt batch {input_buffer.shape[0]}",
                            owner="TRTCudaGraphLRUCache", static={"input_buffer": input_buffer})
    return TRTCudaGraphState(cuda_graph, input_buffer, [output_buffer],
                             execution_context=graph_context if variant == "fix" else None)


def execute_trt_engine(pre_processed_images, engine, context, device, use_cuda_graph, trt_cuda_graph_cache,
                       variant="fix"):
    if use_cuda_graph:
        cache_key = (tuple(pre_processed_images.shape), pre_processed_images.dtype, device)
        if cache_key not in trt_cuda_graph_cache:
            trt_cuda_graph_cache[cache_key] = _capture_cuda_graph(pre_processed_images, engine, context,
                                                                  device, variant)
            release_to_driver(device)                   # the serving process reclaims cached memory
        state = trt_cuda_graph_cache[cache_key]
        state.input_buffer.copy_(pre_processed_images)
        return [replay(state.cuda_graph, state.output_buffers[0]).clone()]
    # eager path: the model's own context, bound to this call's tensors
    context.set_input_shape(INPUT_NAME, tuple(pre_processed_images.shape))
    context.set_tensor_address(INPUT_NAME, pre_processed_images)
    result = torch.empty(context.get_tensor_shape(OUTPUT_NAME), device=device)
    context.set_tensor_address(OUTPUT_NAME, result)
    context.execute_async_v3()
    return [result]


def run(variant: str, device: str = "cpu"):
    gen = generator(2026)
    requests = [randn(n, IN_FEATURES, gen=gen, device=device) for n in BATCH_SIZES]

    def eager():
        engine = ICudaEngine(device)
        context = engine.create_execution_context()
        return [execute_trt_engine(x, engine, context, device, False, None)[0] for x in requests]

    def served():
        engine = ICudaEngine(device)
        execution_context = engine.create_execution_context()      # YOLOv8ForObjectDetectionTRT._execution_context
        cache = TRTCudaGraphLRUCache(capacity=64)
        return [execute_trt_engine(x, engine, execution_context, device, True, cache, variant)[0]
                for x in requests]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
