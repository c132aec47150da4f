"""Changing the weight-streaming budget recreates the TensorRT execution context, but the recorded CUDA graph is kept.

Upstream: https://github.com/pytorch/TensorRT/pull/3309 ("fix: Record cudagraphs when weight streaming budget has
changed"), fixing https://github.com/pytorch/TensorRT/issues/3308 ("Error when weigh streaming and cuda graphs is
used").
Symptom: a Torch-TensorRT module compiled with ``enable_weight_streaming=True`` and run with
``torch_tensorrt.runtime.set_cudagraphs_mode(True)`` fails with ``RuntimeError: CUDA error: invalid argument`` on
the first forward after ``weight_streaming_ctx.device_budget = ...`` changes the budget (Torch-TensorRT 2.6 dev,
December 2024; Python runtime ``PythonTorchTensorRTModule`` and the C++ ``TRTEngine`` alike).
Mechanism: ``PythonTorchTensorRTModule.set_device_memory_budget`` must ``del self.context`` (TensorRT refuses a
budget change while a context is alive), sets ``engine.weight_streaming_budget_v2`` and creates a new execution
context. The context owns device memory -- the weights kept resident under the budget and its activation scratch
-- and the CUDA graph recorded by the first ``forward`` (``torch.cuda.graph`` around
``self.context.execute_async_v3``) baked in the addresses of the old context's memory. ``forward`` decides whether
to re-record in ``TorchTRTRuntimeStates.set_runtime_states``, from the cudagraphs mode and an input-shape change
only: nothing tells it the context changed, so the next ``forward`` (same shapes) replays the old graph, whose
kernels read and write memory its released context no longer owns.
Doctor: dangling-reference, at ``set_device_memory_budget`` (it releases the execution context whose memory the
recorded graph addresses, and leaves the graph in place).
Fix (upstream): ``set_device_memory_budget`` sets ``runtime_states.context_changed = True``;
``set_runtime_states`` treats a changed context like a shape change (record again, and a new
``need_cudagraphs_reset`` output resets the old graph) and clears the flag. The C++ ``TRTEngine`` and
``CudaGraphsTorchTensorRTModule`` (``is_weight_streaming_set``) got the same rule.
(Tiny engine: one dense layer ``relu((x @ W + 2) * 0.5)``, weights partly resident in context memory and partly
streamed from the engine's copy; only the Python runtime module is modelled.)
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, own_segment_elems, randn, release_to_driver, replay

UPSTREAM = "https://github.com/pytorch/TensorRT/pull/3309"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "set_device_memory_budget"
SYMPTOM = "after a weight-streaming budget change the old CUDA graph replays through a released execution context"
DIM, BATCH = 4, 3

_cudagraphs_mode = {"enabled": False}


def set_cudagraphs_mode(enabled: bool) -> None:
    """``torch_tensorrt.runtime.set_cudagraphs_mode``"""
    _cudagraphs_mode["enabled"] = enabled


def get_cudagraphs_mode() -> bool:
    return _cudagraphs_mode["enabled"]


class ICudaEngine:
    """A deserialized TensorRT engine built with weight streaming: its weights live in the engine's own copy and
    ``weight_streaming_budget_v2`` bytes of them are made resident in each execution context's device memory."""

    def __init__(self, weight, device):
        self.device = device
        self.streamable_weights = weight.flatten().clone()
        self.streamable_weights_size = self.streamable_weights.numel()
        self.weight_streaming_budget_v2 = self.streamable_weights_size

    def get_weight_streaming_automatic_budget(self) -> int:
        return self.streamable_weights_size

    def create_execution_context(self) -> "IExecutionContext":
        return IExecutionContext(self)


class IExecutionContext:
    """Owns its device memory: the resident weights (as many as the budget allows) and activation scratch."""

    def __init__(self, engine):
        self.engine = engine
        self.budget = engine.weight_streaming_budget_v2
        self.resident_weights = torch.zeros(max(own_segment_elems(engine.device), self.budget), device=engine.device)
        self.resident_weights[:self.budget].copy_(engine.streamable_weights[:self.budget])
        self.device_memory = torch.zeros(max(own_segment_elems(engine.device), BATCH * DIM), device=engine.device)
        self.tensor_addresses: dict[str, torch.Tensor] = {}

    def set_tensor_address(self, name: str, tensor: torch.Tensor) -> None:
        self.tensor_addresses[name] = tensor

    def execute_async_v3(self, stream=None) -> None:
        x, out = self.tensor_addresses["x"], self.tensor_addresses["output"]
        streamed = self.engine.streamable_weights[self.budget:]              # streamed in for this run
        w = torch.cat([self.resident_weights[:self.budget], streamed]).view(DIM, DIM)
        scratch = self.device_memory[:x.numel()].view_as(x)
        torch.matmul(x, w, out=scratch)
        out.copy_(torch.relu((scratch + 2) * 0.5))


class TorchTRTRuntimeStates:
    def __init__(self, new_cudagraphs: bool):
        self.old_cudagraphs = new_cudagraphs
        self.old_pre_allocated_outputs = False
        self.context_changed = False

    def set_runtime_states(self, new_cudagraphs: bool, new_pre_allocated_output: bool, shape_changed: bool):
        need_cudagraphs_record = False
        can_use_pre_allocated_outputs = False
        need_cudagraphs_reset = False
        # CUDA Graph recording is needed if CUDA graphs is enabled and: CUDA graphs were previously disabled,
        # or the shape has changed, or the execution context has changed (e.g., weight streaming)
        if new_cudagraphs and (not self.old_cudagraphs or shape_changed or self.context_changed):
            need_cudagraphs_record = True
        if self.old_pre_allocated_outputs and new_pre_allocated_output and not shape_changed:
            can_use_pre_allocated_outputs = True
        if not new_cudagraphs or shape_changed or self.context_changed:
            need_cudagraphs_reset = True
        self.old_cudagraphs = new_cudagraphs
        self.old_pre_allocated_outputs = new_pre_allocated_output
        self.context_changed = False
        return need_cudagraphs_record, can_use_pre_allocated_outputs, need_cudagraphs_reset


class PythonTorchTensorRTModule:
    def __init__(self, engine, variant, device):
        self.variant, self.device = variant, device
        self.input_names, self.output_names = ["x"], ["output"]
        self.engine = engine
        self.context = None
        self.cudagraph = None
        self.shape_key = None
        self._input_buffers: list = []
        self._output_buffers: list = []
        self.use_pre_allocated_outputs = False
        self.runtime_states = TorchTRTRuntimeStates(get_cudagraphs_mode())
        self.setup_engine()

    def setup_engine(self) -> None:
        self.set_default_device_memory_budget()        # settings.enable_weight_streaming
        self.context = self.engine.create_execution_context()

    def get_streamable_device_memory_budget(self) -> int:
        return self.engine.streamable_weights_size

    def set_device_memory_budget(self, budget_bytes: int) -> int:
        # Recreating the context because weight streaming budget cannot be modified while there are active context.
        if self.context is not None:
            del self.context
        budget_bytes = self._set_device_memory_budget(budget_bytes)
        self.context = self.engine.create_execution_context()
        if self.variant == "fix":
            self.runtime_states.context_changed = True
        return budget_bytes

    def _set_device_memory_budget(self, budget_bytes: int) -> int:
        if budget_bytes < 0:                           # disable weight streaming for an invalid budget size
            budget_bytes = self.get_streamable_device_memory_budget()
        self.engine.weight_streaming_budget_v2 = budget_bytes
        return budget_bytes

    def set_default_device_memory_budget(self) -> int:
        return self._set_device_memory_budget(self.engine.get_weight_streaming_automatic_budget())

    def validate_input_shapes(self, inputs) -> bool:
        new_shape_key = "".join(str(tuple(t.shape)) for t in inputs)
        if new_shape_key != self.shape_key:
            self.shape_key = new_shape_key
            return True
        return False

    def setup_input_tensors(self, contiguous_inputs, cudagraphs_enabled, need_cudagraphs_record) -> None:
        for i, input_name in enumerate(self.input_names):
            if cudagraphs_enabled:
                if need_cudagraphs_record:
                    # this memory is reserved for future cudagraph runs
                    self._input_buffers[i] = contiguous_inputs[i].clone()
                else:
                    self._input_buffers[i].copy_(contiguous_inputs[i])
                self.context.set_tensor_address(input_name, self._input_buffers[i])
            else:
                self.context.set_tensor_address(input_name, contiguous_inputs[i])

    def create_output_tensors(self, like):
        return [torch.empty_like(like) for _ in self.output_names]

    def _execute(self):
        self.context.execute_async_v3()
        return self._output_buffers[0]

    def forward(self, *inputs):
        contiguous_inputs = [i.contiguous() for i in inputs]
        cudagraphs_enabled = get_cudagraphs_mode()
        shape_changed = self.validate_input_shapes(inputs)
        need_cudagraphs_record, _, need_cudagraphs_reset = self.runtime_states.set_runtime_states(
            cudagraphs_enabled, self.use_pre_allocated_outputs, shape_changed)
        if need_cudagraphs_reset and self.cudagraph:
            self.cudagraph.reset()
            self.cudagraph = None
        if need_cudagraphs_record:
            self._input_buffers = [None] * len(self.input_names)
            self._output_buffers = [None] * len(self.output_names)

        self.setup_input_tensors(contiguous_inputs, cudagraphs_enabled, need_cudagraphs_record)
        outputs = self.create_output_tensors(contiguous_inputs[0])
        for o, output_name in enumerate(self.output_names):
            if need_cudagraphs_record:
                self._output_buffers[o] = outputs[o].clone()
            if cudagraphs_enabled:
                self.context.set_tensor_address(output_name, self._output_buffers[o])
            else:
                self.context.set_tensor_address(output_name, outputs[o])

        if cudagraphs_enabled:
            if need_cudagraphs_record:
                self.cudagraph, _ = capture(self._execute, device=self.device, warmups=0,
                                            name=f"engine {self.shape_key}", owner="PythonTorchTensorRTModule",
                                            static={"input_buffer": self._input_buffers[0]})
            replay(self.cudagraph, self._output_buffers[0])
        else:
            self.context.execute_async_v3()

        if cudagraphs_enabled:
            for idx, o in enumerate(outputs):
                o.copy_(self._output_buffers[idx])
        return outputs[0]

    __call__ = forward


def run(variant: str, device: str = "cpu"):
    gen = generator(3309)
    weight = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
    xs = [randn(BATCH, DIM, gen=gen, device=device) for _ in range(5)]
    total = DIM * DIM

    def workload(cudagraphs: bool):
        set_cudagraphs_mode(cudagraphs)
        try:
            module = PythonTorchTensorRTModule(ICudaEngine(weight, device), variant, device)
            outs = [module(xs[0]).clone(), module(xs[1]).clone()]
            # with torch_tensorrt.runtime.weight_streaming(module) as weight_streaming_ctx:
            for fraction, x in ((0.2, xs[2]), (0.4, xs[3])):
                module.set_device_memory_budget(int(total * fraction))   # weight_streaming_ctx.device_budget = ...
                release_to_driver(device)
                outs.append(module(x).clone())
            outs.append(module(xs[4]).clone())
            return outs
        finally:
            set_cudagraphs_mode(False)

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: workload(True), lambda: workload(False))
