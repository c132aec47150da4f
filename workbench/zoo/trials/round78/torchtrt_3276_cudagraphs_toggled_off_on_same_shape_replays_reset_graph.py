"""Turning Torch-TensorRT cudagraphs off and back on with unchanged input shapes replays the graph the eager pass reset.

Upstream: https://github.com/pytorch/TensorRT/pull/3276 ("feat: Runtime output buffer optimization", commit
f261435a822ab2c1cac4a7773e816dc9fa6ed71a, merged 2024-12-18). A feature PR that also introduced
``TorchTRTRuntimeStates``, whose first rule is the fix: "Cudagraphs record is required if cudagraphs_enabled is
switched to True regardless of shape change". The bug came with https://github.com/pytorch/TensorRT/pull/3067
(2024-08-14), which made the non-cudagraphs path reset the engine's graph.
Symptom: after ``torch_tensorrt.runtime.set_cudagraphs_mode(True)`` -> some forwards ->
``set_cudagraphs_mode(False)`` -> some forwards -> ``set_cudagraphs_mode(True)``, the first forward with the same
input shapes as the recorded graph fails: C++ runtime ``RuntimeError: Called CUDAGraph::replay without a preceding
successful capture``, Python runtime ``AttributeError: 'NoneType' object has no attribute 'replay'``. Without
cudagraphs every forward works.
Mechanism: ``execute_engine`` (core/runtime/execute_engine.cpp, the default C++ runtime behind
``TorchTensorRTModule.forward``) decided to re-record with
``need_cudagraphs_record = CUDAGRAPHS_MODE && !_cudagraphs_validate_shapes(inputs, compiled_engine)``: the only
record trigger is a change of ``compiled_engine->shape_key``, which ``_cudagraphs_validate_shapes`` sets when a
graph is recorded. While cudagraphs are off, the ``&&`` short-circuits (the key is not even looked at) and
``if (!CUDAGRAPHS_MODE) compiled_engine->cudagraph.reset();`` drops the recorded graph on every eager pass. When
the mode is switched back on and the inputs have the shape of the last recording, the key still matches, so no
record happens, the inputs are copied into the persistent ``input_buffers`` and ``cudagraph.replay()`` runs on a
graph that holds no capture. The state "a graph for this key exists" was decided when the graph was recorded;
the eager pass invalidated it but left the key that stands for it. ``PythonTorchTensorRTModule.forward`` had the
same logic (``cudagraphs_enabled and not self.cudagraphs_validate_shapes(inputs)``; its eager path sets
``self.cudagraph = None``).
Doctor: warmup-divergence, at execute_engine (its record decision reuses the shape key set when the graph was
recorded; the eager passes in between reset that graph without touching the key, so the re-enabled pass trusts the
recording-time decision and replays a reset graph, where a correct pass would record again).
Fix (upstream): ``_validate_shapes`` now always runs and only reports ``shape_changed``;
``TRTEngine::runtime_states.set_runtime_states(CUDAGRAPHS_MODE, use_pre_allocated_outputs, shape_changed)``
records when ``new_cudagraphs && (!old_cudagraphs || shape_changed)`` and remembers the mode of this pass;
``execute_engine`` resets the graph when ``!CUDAGRAPHS_MODE || shape_changed``. The Python runtime got the same
``TorchTRTRuntimeStates.validate_states``.
Modelled: the C++ runtime as Python functions with its names (``TRTEngine``, ``execute_engine``,
``_cudagraphs_validate_shapes`` / ``_validate_shapes``, ``TorchTRTRuntimeStates.set_runtime_states``); a tiny
engine ``relu(x @ W1) @ W2`` behind an ``IExecutionContext`` whose ``setTensorAddress`` binds tensors; one input,
one output, float32. Each recording captures into a fresh graph object (upstream reuses the reset
``at::cuda::CUDAGraph`` member: the same thing). Engine/caller streams, multi-device safe mode, profiling, shape
tensors and pre-allocated outputs (always off here) are left out. The workload: graphs on (record, replay), off for
two forwards, on again, every input of shape (3, 8); the reference runs it with cudagraphs off throughout.
"""
from __future__ import annotations

import torch

from workbench.engine import new_graph
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/TensorRT/pull/3276"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "execute_engine"
SYMPTOM = ("set_cudagraphs_mode(False) then (True) with unchanged input shapes: execute_engine replays the graph the "
           "eager pass reset (Called CUDAGraph::replay without a preceding successful capture)")

BATCH, IN_DIM, HIDDEN, OUT_DIM = 3, 8, 16, 4

# torch_tensorrt/core/runtime/runtime.cpp: the global mode set by torch_tensorrt.runtime.set_cudagraphs_mode
_CUDAGRAPHS_MODE = {"on": False}


def set_cudagraphs_mode(enabled: bool) -> None:
    _CUDAGRAPHS_MODE["on"] = bool(enabled)


def get_cudagraphs_mode() -> bool:
    return _CUDAGRAPHS_MODE["on"]


# --- TensorRT (nvinfer1) --------------------------------------------------------------------------------------

class ICudaEngine:
    def __init__(self, w1: torch.Tensor, w2: torch.Tensor):
        self.w1, self.w2 = w1, w2

    def createExecutionContext(self) -> "IExecutionContext":
        return IExecutionContext(self)


class IExecutionContext:
    """Binds I/O by address (``setTensorAddress``); ``enqueueV3`` reads and writes whatever is bound."""

    def __init__(self, engine: ICudaEngine):
        self.engine = engine
        self.input_shapes: dict[str, tuple] = {}
        self.addresses: dict[str, torch.Tensor] = {}

    def setInputShape(self, name: str, dims: tuple) -> bool:
        self.input_shapes[name] = tuple(dims)
        return True

    def getTensorShape(self, name: str) -> tuple:
        return (self.input_shapes["x"][0], OUT_DIM)

    def setTensorAddress(self, name: str, tensor: torch.Tensor) -> bool:
        self.addresses[name] = tensor
        return True

    def enqueueV3(self, stream=None) -> bool:
        x, out = self.addresses["x"], self.addresses["output0"]
        out.copy_(torch.relu(x @ self.engine.w1) @ self.engine.w2)
        return True


# --- core/runtime/TRTEngine.h ----------------------------------------------------------------------------------

class TorchTRTRuntimeStates:
    """Added by the fix (#3276)."""

    def __init__(self, old_cudagraphs: bool):
        self.old_cudagraphs = old_cudagraphs            # CUDAGraphs enabled in the previous execute_engine
        self.old_pre_allocated_outputs = False

    def set_runtime_states(self, new_cudagraphs: bool, new_pre_allocated_output: bool, shape_changed: bool):
        need_cudagraphs_record = False
        can_use_pre_allocated_outputs = False
        # Cudagraphs record is required if cudagraphs_enabled is switched to True regardless of shape change
        if new_cudagraphs and (not self.old_cudagraphs or shape_changed):
            need_cudagraphs_record = True
        # Pre-allocated output can be used when previous and current state are true without shape change
        if self.old_pre_allocated_outputs and new_pre_allocated_output and not shape_changed:
            can_use_pre_allocated_outputs = True
        self.old_cudagraphs = new_cudagraphs
        self.old_pre_allocated_outputs = new_pre_allocated_output
        return need_cudagraphs_record, can_use_pre_allocated_outputs


class TRTEngine:
    def __init__(self, cuda_engine: ICudaEngine, device: str):
        self.device = device
        self.cuda_engine = cuda_engine
        self.exec_ctx = cuda_engine.createExecutionContext()
        self.in_binding_names, self.out_binding_names = ["x"], ["output0"]
        self.cudagraph = new_graph(device)               # at::cuda::CUDAGraph cudagraph (a value member)
        self.input_buffers: list = [None]
        self.output_buffers: list = [None]
        self.shape_key = "None"
        self.use_pre_allocated_outputs = False
        self.runtime_states = TorchTRTRuntimeStates(get_cudagraphs_mode())


# --- core/runtime/execute_engine.cpp ---------------------------------------------------------------------------

def _shape_key(inputs) -> str:
    # x: (3, 4), y: (4, 5) --> Key: (3,4)(4,5)
    return "".join("(" + ",".join(str(s) for s in t.shape) + ")" for t in inputs)


def _cudagraphs_validate_shapes(inputs, compiled_engine: TRTEngine) -> bool:
    """Before the fix: false (and the graph reset) when the shape key changed."""
    new_shape_key = _shape_key(inputs)
    if new_shape_key != compiled_engine.shape_key:
        compiled_engine.shape_key = new_shape_key     # LOG_DEBUG("Resetting Cudagraph on New Shape Key ...")
        compiled_engine.cudagraph.reset()
        return False
    return True


def _validate_shapes(inputs, compiled_engine: TRTEngine) -> bool:
    """After the fix: whether the input shapes changed."""
    new_shape_key = _shape_key(inputs)
    if new_shape_key != compiled_engine.shape_key:
        compiled_engine.shape_key = new_shape_key
        return True
    return False


def setup_input_tensors(inputs, compiled_engine: TRTEngine, need_cudagraphs_record: bool, cudagraphs_mode: bool):
    for i, name in enumerate(compiled_engine.in_binding_names):
        contig_input = inputs[i].contiguous()
        if need_cudagraphs_record:
            # Create a new persistent input buffer
            compiled_engine.input_buffers[i] = contig_input.clone()
        compiled_engine.exec_ctx.setInputShape(name, tuple(contig_input.shape))
        if cudagraphs_mode:
            # If using CUDAGraphs copy formatted input to the corresponding persistent input buffer
            compiled_engine.input_buffers[i].copy_(contig_input)
            compiled_engine.exec_ctx.setTensorAddress(name, compiled_engine.input_buffers[i])
        else:
            compiled_engine.exec_ctx.setTensorAddress(name, contig_input)


def create_output_tensors(compiled_engine: TRTEngine) -> list:
    return [torch.empty(compiled_engine.exec_ctx.getTensorShape(name), device=compiled_engine.device)
            for name in compiled_engine.out_binding_names]


def execute_engine(inputs, compiled_engine: TRTEngine, variant: str) -> list:
    cudagraphs_mode = get_cudagraphs_mode()
    if variant == "bug":
        # Whether cudagraphs needs to record the graph on this pass
        need_cudagraphs_record = cudagraphs_mode and not _cudagraphs_validate_shapes(inputs, compiled_engine)
        if not cudagraphs_mode:
            compiled_engine.cudagraph.reset()
    else:
        shape_changed = _validate_shapes(inputs, compiled_engine)
        need_cudagraphs_record, _ = compiled_engine.runtime_states.set_runtime_states(
            cudagraphs_mode, compiled_engine.use_pre_allocated_outputs, shape_changed)
        if not cudagraphs_mode or shape_changed:
            compiled_engine.cudagraph.reset()

    setup_input_tensors(inputs, compiled_engine, need_cudagraphs_record, cudagraphs_mode)

    outputs = create_output_tensors(compiled_engine)
    for o, name in enumerate(compiled_engine.out_binding_names):
        if need_cudagraphs_record:
            # If we are recording the cuda graph then we need to update the persistent output buffer
            compiled_engine.output_buffers[o] = outputs[o].clone()
        if cudagraphs_mode:
            compiled_engine.exec_ctx.setTensorAddress(name, compiled_engine.output_buffers[o])
        else:
            compiled_engine.exec_ctx.setTensorAddress(name, outputs[o])

    if not cudagraphs_mode:
        # Direct execution uses the caller buffers directly
        compiled_engine.exec_ctx.enqueueV3()
    else:
        if need_cudagraphs_record:
            # If cudagraphs needs to record a graph, capture the enqueueV3 call in a graph
            compiled_engine.cudagraph, _ = capture(
                compiled_engine.exec_ctx.enqueueV3, device=compiled_engine.device, warmups=0,
                name=f"engine {compiled_engine.shape_key}", owner="TRTEngine",
                static={"input_buffers[0]": compiled_engine.input_buffers[0]})
        # Replay the CUDAGraph
        replay(compiled_engine.cudagraph, compiled_engine.output_buffers[0])

    if cudagraphs_mode:
        # If in CUDAGraph mode, results need to be copied to the result buffers
        for o, out in enumerate(outputs):
            out.copy_(compiled_engine.output_buffers[o])
    return outputs


# --- py/torch_tensorrt/dynamo/runtime/_TorchTensorRTModule.py --------------------------------------------------

class TorchTensorRTModule:
    def __init__(self, engine: TRTEngine, variant: str):
        self.engine, self.variant = engine, variant

    def forward(self, *inputs):
        outputs = execute_engine(list(inputs), self.engine, self.variant)   # torch.ops.tensorrt.execute_engine
        return outputs[0] if len(outputs) == 1 else outputs

    __call__ = forward


def run(variant: str, device: str = "cpu"):
    gen = generator(3276)
    w1 = randn(IN_DIM, HIDDEN, gen=gen, device=device, scale=0.5)
    w2 = randn(HIDDEN, OUT_DIM, gen=gen, device=device, scale=0.5)
    xs = [randn(BATCH, IN_DIM, gen=gen, device=device) for _ in range(6)]

    def workload(cudagraphs: bool):
        set_cudagraphs_mode(cudagraphs)
        try:
            module = TorchTensorRTModule(TRTEngine(ICudaEngine(w1, w2), device), variant)
            outs = [module(xs[0]), module(xs[1])]            # record, then replay
            set_cudagraphs_mode(False)                       # e.g. a debugging or profiling pass
            outs += [module(xs[2]), module(xs[3])]
            set_cudagraphs_mode(cudagraphs)                  # back on; the inputs keep their shape
            outs += [module(xs[4]), module(xs[5])]
            return outs
        finally:
            set_cudagraphs_mode(False)

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: workload(True), lambda: workload(False))
