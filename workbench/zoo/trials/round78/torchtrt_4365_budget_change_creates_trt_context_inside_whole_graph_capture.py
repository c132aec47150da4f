"""After a weight-streaming budget change, Torch-TensorRT's whole-graph CUDA-graph wrapper re-captures with every TRT execution context dropped; the lazily created context allocates its device memory inside the capture, and the allocation is refused.

Upstream: https://github.com/pytorch/TensorRT/pull/4365 ("Solve the weight streaming failure", commit 62e598ff38,
merged 2026-06-29). The lazy context came from #4330 ("TRT-RTX runtime controls via context managers",
2026-06-16). #4330 made ``TRTEngine.context`` a lazily materialised property and reduced ``invalidate_context()`` to
``self._context = None``. The upstream test this breaks is ``test_004_weight_streaming.py::
test_weight_streaming_cudagraphs``: a model with a PyTorch-executed convolution between two TRT engines, run under
``enable_cudagraphs`` and ``weight_streaming``, with two budget changes and four forwards after each.
Symptom: in whole-graph cudagraphs mode, the first forward after ``weight_streaming_ctx.device_budget = ...`` fails
inside the CUDA-graph capture, because a TRT execution context cannot be created there (the PR's words:
"Whole-graph CUDA capture cannot create a new TRT context inside capture"; the exact error text is not quoted). The
same workload without cudagraphs runs and gives the right numbers.
Mechanism: ``_WeightStreamingContextManager._set_streamable_weight_bytes``
(``py/torch_tensorrt/runtime/_weight_streaming.py``) sets ``CudaGraphsTorchTensorRTModule.is_weight_streaming_set``,
resets the wrapper's graph and calls ``TorchTensorRTModule.set_device_memory_budget`` on every engine. The
``TRTEngine.device_memory_budget`` setter (``py/torch_tensorrt/dynamo/runtime/_TRTEngine.py``) changes
``cuda_engine.weight_streaming_budget_v2`` and calls ``invalidate_context()``, which drops the
``IExecutionContext`` and builds no new one. The contexts are now empty until something reads ``self.context``. The
next ``CudaGraphsTorchTensorRTModule.forward`` sees ``need_cudagraphs_record`` and opens
``torch.cuda.graph(self.cudagraph, stream=self._engine_stream)`` around ``self.compiled_module(*args, **kwargs)``.
In whole-graph mode the engines run their standard (non-graph) path, so the first ``self.context`` read happens in
``TRTEngine.setup_input_tensors`` (``set_input_shape``), inside the capture. It calls
``_create_execution_context()`` with ``ExecutionContextAllocationStrategy.STATIC``. TensorRT then allocates the
context's device memory itself (a ``cudaMalloc``, outside torch's allocator and its graph pool) while the stream is
capturing in the default global mode. CUDA refuses such a "potentially unsafe" call
during capture (cudaErrorStreamCaptureUnsupported), so no context is created and the capture fails. Eagerly the
same lazy creation runs outside any capture and is harmless. The wrapper's construction-time ``warm_up()`` hides
the bug for the first capture; only a budget change empties the contexts between that warm-up and a capture. This is
not the covered #3309 (round21 ``torchtrt_3309``). There, the OLD graph was replayed after the context it addressed
had been replaced (a dangling reference; fixed by re-recording on ``is_weight_streaming_set`` /
``context_changed``, which this code already does). Here the re-recording is what fails: the NEW context is
materialised inside the re-capture.
Doctor: sync-in-capture, at _set_streamable_weight_bytes. A host-side driver call that an open capture forbids
(``cudaMalloc``, refused with the same cudaErrorStreamCaptureUnsupported as a synchronisation) is attempted on the
capturing thread in global mode. The bug lives in ``_set_streamable_weight_bytes``. That is where the fix changed
code: it left the contexts empty for the next capture, and the fix makes it rebuild them eagerly before any
capture.
Fix (upstream): ``_set_streamable_weight_bytes`` ends with ``if self.cuda_graphs_module:
self.cuda_graphs_module.warm_up()``. That runs the wrapped module eagerly three times on a side stream, so every
engine's context is created before the next capture. The PR also reorders the ``TRTEngine.device_memory_budget``
setter (``reset_captured_graph()`` and ``invalidate_context()`` before the budget write, since TensorRT wants no
live context during the change; profiling re-attached afterwards). That half is modelled as written, but the
stand-in TensorRT does not enforce the no-live-context rule: that rule concerns eager runs just as much.
Modelled: the two TRT engines are one dense layer each (``relu((x @ W + b) * 0.5)`` and ``x @ W + b``). Their
weights are streamable: the context keeps ``budget`` bytes of them resident in its own device memory, and the rest
is read from the engine's copy at run time. The budget changes only where the weights live, never the numbers. The
PyTorch-executed op between the engines is a ``conv1d``. TensorRT is a Python stand-in: ``create_execution_context``
allocates the context memory through a ``cudaMalloc`` stand-in that refuses the call while this thread's stream is
capturing (the wrapper captures in torch's default global mode; relaxed mode, which would allow it, is not
modelled). It logs the CUDA error and returns no context
(which TensorRT call fails, and with what words, is not stated upstream), and ``_create_execution_context`` asserts.
The workload is the upstream test's, with two forwards before the first budget change (they capture and replay
fine: the construction-time warm-up made the contexts). Left out: streams (caller, engine and pool streams, and ``stream_changed``), pytree kwargs, TRT-RTX
(``_check_monolithic_capturability``), per-engine subgraph cudagraphs (off in whole-graph mode), runtime states,
output allocators, profiling and the C++ runtime.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, List, Optional

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

logger = logging.getLogger(__name__)
logger.addHandler(logging.NullHandler())

UPSTREAM = "https://github.com/pytorch/TensorRT/pull/4365"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "_set_streamable_weight_bytes"
SYMPTOM = ("first whole-graph cudagraphs forward after a weight-streaming budget change fails in capture: the "
           "dropped TRT execution context is re-created lazily inside torch.cuda.graph and its cudaMalloc is "
           "refused (operation not permitted when stream is capturing)")

BATCH, IN_FEATURES, HIDDEN, OUT_FEATURES, CONV_KERNEL = 4, 6, 8, 5, 3
FLOAT_BYTES = 4
VARIANT = {"v": "bug"}


# --- CUDA runtime stand-in: the one call TensorRT makes here that a capture forbids --------------------------------

class CudaRuntimeError(RuntimeError):
    pass


def cudaMalloc(numel: int, device) -> torch.Tensor:
    """A driver allocation (not the caching allocator's graph pool). CUDA classes it as potentially unsafe during
    stream capture: refused while this thread's stream is capturing in global or thread-local mode (torch's
    ``torch.cuda.graph`` captures in global mode by default; only relaxed mode would let it through)."""
    if torch.cuda.is_current_stream_capturing():
        raise CudaRuntimeError("cudaMalloc: operation not permitted when stream is capturing "
                               "(cudaErrorStreamCaptureUnsupported)")
    return torch.zeros(numel, device=device)


# --- TensorRT stand-in (tensorrt.ICudaEngine / IExecutionContext) ----------------------------------------------------

class ExecutionContextAllocationStrategy:
    STATIC = 0
    USER_MANAGED = 2


class IExecutionContext:
    """Owns its device memory (STATIC strategy): the resident share of the streamable weights, and scratch."""

    def __init__(self, engine: "ICudaEngine"):
        self.engine = engine
        self.resident_elems = engine.weight_streaming_budget_v2 // FLOAT_BYTES
        self.device_memory = cudaMalloc(engine.weights.numel() + engine.device_memory_size_v2, engine.device)
        self.device_memory[:self.resident_elems].copy_(engine.weights[:self.resident_elems])
        self.input_shapes: dict[str, tuple] = {}
        self.tensor_addresses: dict[str, torch.Tensor] = {}

    def set_input_shape(self, name: str, shape) -> bool:
        self.input_shapes[name] = tuple(shape)
        return True

    def get_tensor_shape(self, name: str) -> tuple:
        return (self.input_shapes["x"][0], self.engine.out_features)

    def set_tensor_address(self, name: str, tensor: torch.Tensor) -> bool:
        self.tensor_addresses[name] = tensor
        return True

    def execute_async_v3(self, stream_handle=None) -> bool:
        e = self.engine
        x, out = self.tensor_addresses["x"], self.tensor_addresses["output"]
        resident = self.device_memory[:self.resident_elems]
        streamed = e.weights[self.resident_elems:]                      # streamed in from the engine's copy
        w = torch.cat([resident, streamed]).view(e.in_features, e.out_features)
        scratch = self.device_memory[e.weights.numel():e.weights.numel() + x.shape[0] * e.out_features]
        scratch = scratch.view(x.shape[0], e.out_features)
        torch.matmul(x, w, out=scratch)
        y = scratch + e.bias
        out.copy_(torch.relu(y * 0.5) if e.activation else y)
        return True


class ICudaEngine:
    """A deserialized engine built with ``enable_weight_streaming=True`` (one dense layer)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, activation: bool, device):
        self.device = device
        self.in_features, self.out_features = weight.shape
        self.weights = weight.flatten().clone()            # the engine's copy of the streamable weights
        self.bias = bias.clone()
        self.activation = activation
        self.streamable_weights_size = self.weights.numel() * FLOAT_BYTES
        self.weight_streaming_budget_v2 = self.streamable_weights_size
        self.device_memory_size_v2 = 16 * self.out_features

    def get_weight_streaming_automatic_budget(self) -> int:
        return self.streamable_weights_size

    def create_execution_context(self, strategy: int) -> Optional[IExecutionContext]:
        try:
            return IExecutionContext(self)
        except CudaRuntimeError as e:                      # TensorRT logs the CUDA error and returns no context
            logger.error("[TRT] [E] IExecutionContext creation failed: %s", e)
            return None


# --- torch_tensorrt.runtime._cudagraphs --------------------------------------------------------------------------

class CudaGraphsMode:
    STANDARD = 0
    SUBGRAPH_CUDAGRAPHS = 1
    WHOLE_GRAPH_CUDAGRAPHS = 2


_PY_RT_CUDAGRAPHS = {"mode": CudaGraphsMode.STANDARD}


def get_whole_cudagraphs_mode() -> bool:
    return _PY_RT_CUDAGRAPHS["mode"] == CudaGraphsMode.WHOLE_GRAPH_CUDAGRAPHS


def get_cudagraphs_mode() -> bool:
    return _PY_RT_CUDAGRAPHS["mode"] == CudaGraphsMode.SUBGRAPH_CUDAGRAPHS


# --- py/torch_tensorrt/dynamo/runtime/_TRTEngine.py ----------------------------------------------------------------

class TRTEngine:
    def __init__(self, name: str, cuda_engine: ICudaEngine):
        self.name = name
        self.cuda_engine = cuda_engine
        self.in_binding_names, self.out_binding_names = ["x"], ["output"]
        self.resource_allocation_strategy = 0
        self.cudagraph = None                              # per-engine (subgraph) graph: unused in whole-graph mode
        self._profile_execution = False
        self._num_execution_contexts_created = 0
        self._context: Optional[IExecutionContext] = None
        self._setup_engine()

    def _setup_engine(self) -> None:
        if self.cuda_engine.streamable_weights_size > 0:
            self.cuda_engine.weight_streaming_budget_v2 = self.cuda_engine.get_weight_streaming_automatic_budget()
        # IExecutionContext is created lazily on first ``self.context`` read.

    @property
    def context(self) -> IExecutionContext:
        """Lazily-materialized ``IExecutionContext``: reads create it; ``invalidate_context()`` drops it."""
        if self._context is None:
            self._context = self._create_execution_context()
        return self._context

    def invalidate_context(self) -> None:
        self._context = None

    def _create_execution_context(self) -> IExecutionContext:
        alloc_strategy = (ExecutionContextAllocationStrategy.USER_MANAGED if self.resource_allocation_strategy
                          else ExecutionContextAllocationStrategy.STATIC)
        context = self.cuda_engine.create_execution_context(alloc_strategy)
        assert context is not None, "Failed to create execution context"
        self._num_execution_contexts_created += 1
        return context

    @property
    def streamable_device_memory_budget(self) -> int:
        return self.cuda_engine.streamable_weights_size

    @property
    def automatic_device_memory_budget(self) -> int:
        return self.cuda_engine.get_weight_streaming_automatic_budget()

    @property
    def device_memory_budget(self) -> int:
        return self.cuda_engine.weight_streaming_budget_v2

    @device_memory_budget.setter
    def device_memory_budget(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            budget_bytes = self.streamable_device_memory_budget
        if VARIANT["v"] == "fix":
            # #4365: no live IExecutionContext while the budget changes; drop graph and context first
            self.reset_captured_graph()
            self.invalidate_context()
        self.cuda_engine.weight_streaming_budget_v2 = budget_bytes
        if self.cuda_engine.weight_streaming_budget_v2 != budget_bytes:
            logger.error(f"Failed to set weight streaming budget to {budget_bytes}")
        if VARIANT["v"] != "fix":
            self.invalidate_context()                      # before #4365: dropped after the budget write
        # (the fix re-enables profiling here when it was on; profiling is off)

    def reset_captured_graph(self) -> None:
        if self.cudagraph:
            self.cudagraph.reset()
            self.cudagraph = None

    def setup_input_tensors(self, contiguous_inputs: List[torch.Tensor]) -> None:
        for i, input_name in enumerate(self.in_binding_names):
            self.context.set_input_shape(input_name, tuple(contiguous_inputs[i].shape))
            self.context.set_tensor_address(input_name, contiguous_inputs[i])

    def create_output_tensors(self) -> List[torch.Tensor]:
        return [torch.empty(shape, device=self.cuda_engine.device) for shape in self.output_shapes]

    def _execute_standard(self, contiguous_inputs: List[torch.Tensor]):
        """The engine's path with subgraph cudagraphs off (as in whole-graph mode, where the wrapper captures)."""
        self.setup_input_tensors(contiguous_inputs)
        self.output_shapes = [tuple(self.context.get_tensor_shape(n)) for n in self.out_binding_names]
        outputs = self.create_output_tensors()
        for o, output_name in enumerate(self.out_binding_names):
            self.context.set_tensor_address(output_name, outputs[o])
        self.context.execute_async_v3()
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def execute(self, inputs):
        assert not get_cudagraphs_mode(), "per-engine subgraph cudagraphs are not modelled"
        return self._execute_standard([t.contiguous() for t in inputs])


# --- py/torch_tensorrt/dynamo/runtime/_TorchTensorRTModule.py -----------------------------------------------------

class TorchTensorRTModule(torch.nn.Module):
    def __init__(self, engine: TRTEngine):
        super().__init__()
        self.engine = engine

    def get_streamable_device_memory_budget(self) -> int:
        return self.engine.streamable_device_memory_budget

    def get_automatic_device_memory_budget(self) -> int:
        return self.engine.automatic_device_memory_budget

    def get_device_memory_budget(self) -> int:
        return self.engine.device_memory_budget

    def set_device_memory_budget(self, budget_bytes: int) -> int:
        engine = self.engine
        if budget_bytes < 0:
            budget_bytes = self.get_streamable_device_memory_budget()
        engine.device_memory_budget = budget_bytes
        if engine.device_memory_budget != budget_bytes:
            logger.error(f"Failed to set weight streaming budget to {budget_bytes}")
            budget_bytes = engine.device_memory_budget
        if self.get_streamable_device_memory_budget() == budget_bytes:
            logger.warning("Weight streaming is disabled")
        return budget_bytes

    def _reset_captured_graph(self) -> None:
        self.engine.reset_captured_graph()

    def forward(self, *inputs):
        return self.engine.execute(list(inputs))


class _TorchConv(torch.nn.Module):
    """The PyTorch-executed subgraph (``torch_executed_ops={"torch.ops.aten.convolution.default"}``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor):
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, x):
        y = torch.nn.functional.conv1d(x[:, None, :], self.weight, self.bias, padding=CONV_KERNEL // 2)
        return y[:, 0, :]


class Input:
    """``torch_tensorrt.Input`` with its example tensor (what ``construct_submodule_inputs`` recovers)."""

    def __init__(self, torch_tensor: torch.Tensor):
        self.shape, self.torch_tensor = tuple(torch_tensor.shape), torch_tensor


class CompiledGraphModule(torch.nn.Module):
    """What ``torch_tensorrt.dynamo.compile`` returns: TRT engines around a PyTorch-executed op."""

    def __init__(self, device):
        super().__init__()
        gen = generator(4365)
        w1 = randn(IN_FEATURES, HIDDEN, gen=gen, device=device, scale=0.6)
        b1 = randn(HIDDEN, gen=gen, device=device, scale=0.3)
        wc = randn(1, 1, CONV_KERNEL, gen=gen, device=device, scale=0.7)
        bc = randn(1, gen=gen, device=device, scale=0.2)
        w2 = randn(HIDDEN, OUT_FEATURES, gen=gen, device=device, scale=0.6)
        b2 = randn(OUT_FEATURES, gen=gen, device=device, scale=0.3)
        self._run_on_acc_0 = TorchTensorRTModule(TRTEngine("_run_on_acc_0", ICudaEngine(w1, b1, True, device)))
        self._run_on_gpu_1 = _TorchConv(wc, bc)
        self._run_on_acc_2 = TorchTensorRTModule(TRTEngine("_run_on_acc_2", ICudaEngine(w2, b2, False, device)))
        self.sample_input = torch.zeros(BATCH, IN_FEATURES, device=device)

    def forward(self, x):
        return self._run_on_acc_2(self._run_on_gpu_1(self._run_on_acc_0(x)))


def construct_submodule_inputs(compiled_module: CompiledGraphModule) -> List[Input]:
    return [Input(compiled_module.sample_input)]


# --- py/torch_tensorrt/dynamo/runtime/_CudaGraphsTorchTensorRTModule.py -------------------------------------------

class CudaGraphsTorchTensorRTModule(torch.nn.Module):
    """Wrapper runtime module that records/replays one whole CUDA graph over TRT and PyTorch submodules."""

    def __init__(self, compiled_module: CompiledGraphModule, device):
        super().__init__()
        self.compiled_module = compiled_module
        self.inputs = construct_submodule_inputs(compiled_module)
        self.is_weight_streaming_set = False
        self._input_buffers: List[Optional[torch.Tensor]] = []
        self._output_buffers: Any = []
        self.cudagraph = None
        self.shape_key: Optional[str] = None
        self._device = device
        self.warm_up()

    def warm_up(self) -> None:
        """Warm up is necessary to ensure that memory allocations and initializations are not recorded in cuda
        graphs (upstream: three eager runs on a side stream)."""
        args = [i.torch_tensor for i in self.inputs]
        for _ in range(3):
            with events.warmup():
                self.compiled_module(*args)

    def validate_input_shapes(self, inputs) -> bool:
        new_shape_key = "".join(str(tuple(t.shape)).replace(" ", "") for t in inputs)
        if new_shape_key != self.shape_key:
            self.shape_key = new_shape_key
            return True
        return False

    def _reset_captured_graph(self) -> None:
        if self.cudagraph:
            self.cudagraph.reset()
            self.cudagraph = None

    def forward(self, *inputs):
        if get_whole_cudagraphs_mode():
            shape_changed = self.validate_input_shapes(inputs)
            need_cudagraphs_record = shape_changed or self.is_weight_streaming_set
            if need_cudagraphs_record:
                self._reset_captured_graph()
                self._input_buffers = [None] * len(inputs)
            self.is_weight_streaming_set = False
            contiguous_inputs = [i.contiguous() for i in inputs]
            for i, _ in enumerate(inputs):
                if need_cudagraphs_record:
                    # this memory is reserved for future cudagraph runs
                    self._input_buffers[i] = contiguous_inputs[i].clone()
                else:
                    self._input_buffers[i].copy_(contiguous_inputs[i])
            if need_cudagraphs_record:
                args = list(self._input_buffers)
                # with torch.cuda.graph(self.cudagraph, stream=self._engine_stream):
                #     self._output_buffers = self.compiled_module(*args, **kwargs)
                self.cudagraph, self._output_buffers = capture(
                    lambda: self.compiled_module(*args), device=self._device, warmups=0,
                    name=f"whole graph {self.shape_key}", owner="CudaGraphsTorchTensorRTModule",
                    static={f"_input_buffers[{i}]": b for i, b in enumerate(self._input_buffers)})
            output_buffers = (self._output_buffers if isinstance(self._output_buffers, (list, tuple))
                              else [self._output_buffers])
            views = replay(self.cudagraph, tuple(output_buffers))          # self.cudagraph.replay()
            outputs = [output.clone() for output in views]
            return outputs[0] if len(outputs) == 1 else outputs
        self._reset_captured_graph()
        return self.compiled_module(*inputs)


@contextlib.contextmanager
def enable_cudagraphs(compiled_module: CompiledGraphModule, device):
    """``torch_tensorrt.runtime.enable_cudagraphs``: a PyTorch subgraph is present, so whole-graph mode."""
    old_mode = _PY_RT_CUDAGRAPHS["mode"]
    _PY_RT_CUDAGRAPHS["mode"] = CudaGraphsMode.WHOLE_GRAPH_CUDAGRAPHS
    cudagraphs_module = CudaGraphsTorchTensorRTModule(compiled_module, device)
    try:
        yield cudagraphs_module
    finally:
        _PY_RT_CUDAGRAPHS["mode"] = old_mode
        cudagraphs_module._reset_captured_graph()


# --- py/torch_tensorrt/runtime/_weight_streaming.py ---------------------------------------------------------------

class _WeightStreamingContextManager:
    """Helper class used to set up the weight streaming budget."""

    def __init__(self, module) -> None:
        rt_mods = []
        self.current_device_budget = 0
        self.cuda_graphs_module = None
        if isinstance(module, CudaGraphsTorchTensorRTModule):
            self.cuda_graphs_module = module
            module = module.compiled_module
        for name, rt_mod in module.named_children():
            if "_run_on_acc" in name and isinstance(rt_mod, TorchTensorRTModule):
                rt_mods.append((name, rt_mod))
                self.current_device_budget += rt_mod.get_device_memory_budget()
        self.streamable_budget = [mod.get_streamable_device_memory_budget() for _, mod in rt_mods]
        self.rt_mods = rt_mods
        super().__setattr__("device_budget", self.current_device_budget)
        super().__setattr__("total_device_budget", sum(self.streamable_budget))

    def __enter__(self) -> "_WeightStreamingContextManager":
        return self

    def __exit__(self, *args) -> None:
        if self.total_device_budget > 0:
            self.device_budget = self.current_device_budget          # revert to the initial budget

    def _set_streamable_weight_bytes(self, requested_budget: int) -> int:
        ws_budget_bytes = 0
        total_bytes = self.total_device_budget
        if total_bytes == 0:
            raise RuntimeError("Streamable bytes are zero. Was module complied with enable_weight_streaming=True option?")
        elif total_bytes < requested_budget:
            logger.error(f"Requested budget is greater than streamable bytes: {total_bytes}. "
                         f"requested budget: {requested_budget}")
            requested_budget = total_bytes
        elif requested_budget < 0:
            raise RuntimeError("Requested budget cannot be negative")
        normalized_size = [int(streamable_bytes / total_bytes * requested_budget)
                           for streamable_bytes in self.streamable_budget]
        if self.cuda_graphs_module:
            self.cuda_graphs_module.is_weight_streaming_set = True
            self.cuda_graphs_module._reset_captured_graph()

        for i, (name, rt_mod) in enumerate(self.rt_mods):
            rt_mod._reset_captured_graph()
            ws_budget_bytes += rt_mod.set_device_memory_budget(normalized_size[i])
            logger.debug(f"Set weight streaming size {normalized_size[i]} for {name}")

        if VARIANT["v"] == "fix" and self.cuda_graphs_module:
            # #4365: changing the budget invalidates the TRT execution contexts; whole-graph capture cannot create
            # a new context inside capture, so warm the wrapped graph once before the next capture attempt
            self.cuda_graphs_module.warm_up()
        return ws_budget_bytes

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "device_budget":
            value = self._set_streamable_weight_bytes(value)
        super().__setattr__(name, value)


def weight_streaming(module) -> _WeightStreamingContextManager:
    return _WeightStreamingContextManager(module)


# --- the workload: tests/py/dynamo/runtime/test_004_weight_streaming.py::test_weight_streaming_cudagraphs ---------

def run(variant: str, device: str = "cpu"):
    VARIANT["v"] = variant
    gen = generator(43650)
    xs = [randn(BATCH, IN_FEATURES, gen=gen, device=device) for _ in range(10)]

    def forwards_with_budgets(module, ctx, outs):
        streamable_budget = ctx.total_device_budget
        for fraction, batch in ((0.7, xs[2:6]), (0.5, xs[6:10])):
            ctx.device_budget = int(streamable_budget * fraction)
            for x in batch:
                outs.append(module(x))

    def served():
        optimized_model = CompiledGraphModule(device)
        outs = []
        with enable_cudagraphs(optimized_model, device) as cudagraphs_module:
            outs += [cudagraphs_module(xs[0]), cudagraphs_module(xs[1])]
            with weight_streaming(cudagraphs_module) as weight_streaming_ctx:
                forwards_with_budgets(cudagraphs_module, weight_streaming_ctx, outs)
        return outs

    def eager():
        optimized_model = CompiledGraphModule(device)
        outs = [optimized_model(xs[0]).clone(), optimized_model(xs[1]).clone()]
        with weight_streaming(optimized_model) as weight_streaming_ctx:
            forwards_with_budgets(lambda x: optimized_model(x).clone(), weight_streaming_ctx, outs)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
