"""Torch-TensorRT's whole-graph CUDA-graph wrapper fills only the last static input buffer, so capturing a module with two or more inputs fails.

Upstream: https://github.com/pytorch/TensorRT/pull/3357 ("docs: Updated cuda graphs doc", commit 33a9cfe267,
merged 2025-03-06). The PR is titled as a docs change, but it also fixes the code. In review the author wrote
"Fixed wrong indent." The bug came in with https://github.com/pytorch/TensorRT/pull/3270 ("Wrapper module around
TRT + pytorch subgraphs", commit 092be2a09b, 2024-12-18), which added the wrapper with the block already dedented.
Symptom: a module compiled with graph breaks (TensorRT engines mixed with PyTorch ops, e.g. through
``torch_executed_ops``) and taking two or more inputs fails on its first call inside
``with torch_tensorrt.runtime.enable_cudagraphs(module) as cudagraphs_module``. The error is raised inside the
CUDA-graph capture, at the first TensorRT submodule, when it gets ``None`` where a tensor should be
(``RuntimeError: Could not infer dtype of NoneType``). The same module without cudagraphs works. A module with a
single input hides the bug.
Mechanism: ``_CudagraphsContextManager.__enter__`` (``py/torch_tensorrt/runtime/_cudagraphs.py``) finds
``_run_on_gpu`` children, so it sets ``WHOLE_GRAPH_CUDAGRAPHS`` mode and returns a ``CudaGraphsTorchTensorRTModule``
(``py/torch_tensorrt/dynamo/runtime/_CudaGraphsTorchTensorRTModule.py``). Its ``forward`` records when the input
shape key changes. On a record pass it first sets ``self._input_buffers = [None] * len(self.inputs)``. Then it loops
``for i, _ in enumerate(self.inputs)`` to move and dtype-check the inputs. The block that fills the static buffers
(``self._input_buffers[i] = contiguous_inputs[i].clone()`` on a record pass, ``self._input_buffers[i].copy_(...)``
on a replay pass) sits one indent level too far out: it runs once, after the loop, with ``i`` left at the last
index. So only the last input gets a static buffer, and the others stay ``None``.
``torch.cuda.graph(...)`` then runs ``self.compiled_module(*self._input_buffers)``. The first submodule that takes
input 0 gets ``None``, and the capture fails. That submodule is a ``PythonTorchTensorRTModule``, or a
``TorchTensorRTModule`` with the C++ runtime. Both turn a non-tensor input into a tensor with
``torch.tensor(i).cuda()``, which raises on ``None``. On a replay pass the same block would refresh only the
last buffer. That cannot be reached, because every record pass starts from ``[None] * n`` and fails. The eager path
(whole-graph mode off) calls ``self.compiled_module(*inputs)`` directly and is correct.
Doctor: stale-input, at forward. The step does not write the static input buffers of inputs 0..n-2: the per-input
copy is done only for the last slot, so those inputs are omitted from what the graph reads (at the record pass they
are not even allocated). The bug lives in ``CudaGraphsTorchTensorRTModule.forward``, where the fix re-indented the
buffer-population block.
Fix (upstream): the ``if need_cudagraphs_record: ... clone() / else: ... copy_(...)`` block moves back inside the
``for i, _ in enumerate(self.inputs)`` loop, so every input gets its persistent clone on record and is copied in
before every replay.
Modelled: a two-input ``SampleModel`` compiled with ``torch_executed_ops={"torch.ops.aten.mul.Tensor"}``. It has
three children: ``_run_on_acc_0`` (TensorRT: ``relu(x @ W1 + 2)``), ``_run_on_gpu_1`` (PyTorch: ``* y``) and
``_run_on_acc_2`` (TensorRT: ``(h @ W2) * 0.5``). Each TensorRT child is a ``PythonTorchTensorRTModule`` whose engine
is a function of its inputs. In whole-graph mode its own (subgraph) cudagraphs are off, so it runs eagerly inside
the wrapper's capture, as upstream. ``construct_submodule_inputs`` reads the placeholders' shapes and dtypes. Left
out: the caller/engine streams (the kit captures on its own stream), the weight-streaming flag, multi-device safe
mode, profiling, and output-allocator details. The workload is four calls with new ``x`` and ``y`` of one shape.
"""
from __future__ import annotations

import logging
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

logger = logging.getLogger(__name__)
logger.addHandler(logging.NullHandler())

UPSTREAM = "https://github.com/pytorch/TensorRT/pull/3357"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "forward"
SYMPTOM = ("a graph-broken Torch-TensorRT module with two inputs fails on its first call under "
           "enable_cudagraphs: the whole-graph wrapper cloned only the last input into its static buffers, "
           "so the capture passes None for input 0")

BATCH, DIM, STEPS = 3, 4, 4
VARIANT = {"v": "fix"}


# --- py/torch_tensorrt/runtime/_cudagraphs.py -----------------------------------------------------------------

class CudaGraphsMode:
    STANDARD = 0                    # no cuda graphs
    SUBGRAPH_CUDAGRAPHS = 1         # cuda graphs applied to each TRT module
    WHOLE_GRAPH_CUDAGRAPHS = 2      # internal mode: cuda graphs for the wrapped runtime module


_PY_RT_CUDAGRAPHS = {"mode": CudaGraphsMode.STANDARD}


def set_cudagraphs_mode(mode: bool) -> None:
    _PY_RT_CUDAGRAPHS["mode"] = CudaGraphsMode.SUBGRAPH_CUDAGRAPHS if mode else CudaGraphsMode.STANDARD


def _restore_cudagraphs_mode(mode: int) -> None:
    # upstream ``__exit__`` calls ``set_cudagraphs_mode(self.old_mode)``; old_mode is STANDARD here
    _PY_RT_CUDAGRAPHS["mode"] = mode


def get_whole_cudagraphs_mode() -> bool:
    return _PY_RT_CUDAGRAPHS["mode"] == CudaGraphsMode.WHOLE_GRAPH_CUDAGRAPHS


def get_cudagraphs_mode() -> bool:
    return _PY_RT_CUDAGRAPHS["mode"] == CudaGraphsMode.SUBGRAPH_CUDAGRAPHS


class _CudagraphsContextManager:
    """Helper class used in conjunction with ``enable_cudagraphs``."""

    def __init__(self, compiled_module: torch.nn.Module) -> None:
        self.old_mode = _PY_RT_CUDAGRAPHS["mode"]
        self.compiled_module = compiled_module

    def __enter__(self) -> torch.nn.Module:
        num_torch_module = num_trt_module = 0
        for name, _ in self.compiled_module.named_children():
            if "_run_on_acc" in name:
                num_trt_module += 1
            elif "_run_on_gpu" in name:
                num_torch_module += 1
        if num_torch_module > 0:
            # Set whole cudagraphs mode and return the wrapped module
            _PY_RT_CUDAGRAPHS["mode"] = CudaGraphsMode.WHOLE_GRAPH_CUDAGRAPHS
            logger.debug("Found pytorch subgraphs in module, wrapping module in CudaGraphsTorchTensorRTModule")
            return CudaGraphsTorchTensorRTModule(self.compiled_module)
        set_cudagraphs_mode(True)
        return self.compiled_module

    def __exit__(self, *args) -> None:
        _restore_cudagraphs_mode(self.old_mode)


def enable_cudagraphs(compiled_module: torch.nn.Module) -> _CudagraphsContextManager:
    return _CudagraphsContextManager(compiled_module)


# --- py/torch_tensorrt/dynamo/partitioning (construct_submodule_inputs) ---------------------------------------

class Input(NamedTuple):
    shape: Tuple[int, ...]
    dtype: torch.dtype
    device: str

    @property
    def torch_tensor(self) -> torch.Tensor:
        """The example tensor the spec carries (used by the wrapper's warm-up)."""
        return torch.ones(self.shape, dtype=self.dtype, device=self.device)


def construct_submodule_inputs(module: torch.nn.Module) -> List[Input]:
    """One ``Input`` per placeholder of the compiled graph module, from its meta shape and dtype."""
    return [Input(tuple(shape), dtype, module.device) for shape, dtype in module.placeholders]


# --- py/torch_tensorrt/dynamo/runtime/_PythonTorchTensorRTModule.py --------------------------------------------

class PythonTorchTensorRTModule(torch.nn.Module):
    """One TensorRT engine of the partitioned graph (``_run_on_acc_N``); the engine is a function of its inputs."""

    def __init__(self, engine, input_names: Sequence[str], device: str):
        super().__init__()
        self.engine = engine
        self.input_names = list(input_names)
        self.device = device

    def forward(self, *inputs):
        # Ensure inputs are available in all scopes and cast symbolic integers to Tensors (upstream: ``.cuda()``)
        contiguous_inputs: List[torch.Tensor] = [
            (i.contiguous() if isinstance(i, torch.Tensor) else torch.tensor(i).to(self.device))
            for i in inputs
        ]
        cudagraphs_enabled = get_cudagraphs_mode()      # False in whole-graph mode: the wrapper owns the graph
        assert not cudagraphs_enabled
        assert len(contiguous_inputs) == len(self.input_names), (
            f"Wrong number of inputs, expect {len(self.input_names)} get {len(contiguous_inputs)}.")
        # set_tensor_address(...) on the user's tensors, then context.execute_async_v3(stream)
        return self.engine(*contiguous_inputs)


class _TorchSubmodule(torch.nn.Module):
    """A PyTorch-executed subgraph (``_run_on_gpu_N``): here ``aten.mul.Tensor``."""

    def forward(self, h, y):
        return torch.mul(h, y)


class SampleModelCompiled(torch.nn.Module):
    """``torch_tensorrt.compile(SampleModel(), ir="dynamo", inputs=[x, y], min_block_size=1,
    torch_executed_ops={"torch.ops.aten.mul.Tensor"})``: a graph module of three partitions."""

    def __init__(self, device: str):
        super().__init__()
        gen = generator(3357)
        w1 = randn(DIM, DIM, gen=gen, device=device, scale=0.6)
        w2 = randn(DIM, DIM, gen=gen, device=device, scale=0.6)
        self.device = device
        self.placeholders = [((BATCH, DIM), torch.float32), ((BATCH, DIM), torch.float32)]
        self._run_on_acc_0 = PythonTorchTensorRTModule(lambda x: torch.relu(x @ w1 + 2), ["x"], device)
        self._run_on_gpu_1 = _TorchSubmodule()
        self._run_on_acc_2 = PythonTorchTensorRTModule(lambda h: (h @ w2) * 0.5, ["mul"], device)

    def forward(self, x, y):
        relu = self._run_on_acc_0(x)
        mul = self._run_on_gpu_1(relu, y)
        return self._run_on_acc_2(mul)


# --- py/torch_tensorrt/dynamo/runtime/_CudaGraphsTorchTensorRTModule.py ----------------------------------------

class CudaGraphsTorchTensorRTModule(torch.nn.Module):
    """This wrapper runtime module records/replays one whole cuda graph over the submodules."""

    def __init__(self, compiled_module: torch.nn.Module):
        super().__init__()
        self.compiled_module = compiled_module
        self.device = compiled_module.device
        self.inputs = construct_submodule_inputs(compiled_module)
        self.is_weight_streaming_set = False
        self._input_buffers: List[Optional[torch.Tensor]] = []
        self._output_buffers = []
        self.cudagraph = None
        self.shape_key: Optional[str] = None
        self.warm_up()

    def warm_up(self) -> None:
        """Warm up so that memory allocations and initializations are not recorded in cuda graphs."""
        inputs_tensor = [spec.torch_tensor for spec in self.inputs]
        with events.warmup():                           # 3 eager runs on a side stream upstream
            for _ in range(3):
                self.compiled_module(*inputs_tensor)

    def validate_input_shapes(self, inputs: Sequence[torch.Tensor]) -> bool:
        new_shape_key = "".join(str(tuple(t.shape)).replace(" ", "") for t in inputs)
        if new_shape_key != self.shape_key:
            logger.debug(f"Input shape changed {self.shape_key} -> {new_shape_key}")
            self.shape_key = new_shape_key
            return True
        return False

    def forward(self, *inputs):
        cudagraphs_enabled = get_whole_cudagraphs_mode()
        if not cudagraphs_enabled:
            if self.cudagraph:
                self.cudagraph.reset()
                self.cudagraph = None
            return self.compiled_module(*inputs)

        shape_changed = self.validate_input_shapes(inputs)
        need_cudagraphs_record = shape_changed or self.is_weight_streaming_set
        if need_cudagraphs_record:
            if self.cudagraph:
                self.cudagraph.reset()
            self._input_buffers = [None] * len(self.inputs)
        self.is_weight_streaming_set = False

        contiguous_inputs: List[torch.Tensor] = [
            (i.contiguous() if isinstance(i, torch.Tensor) else torch.tensor(i).to(self.device)) for i in inputs
        ]
        assert len(contiguous_inputs) == len(self.inputs), (
            f"Wrong number of inputs, expect {len(self.inputs)} get {len(contiguous_inputs)}.")

        for i, _ in enumerate(self.inputs):
            assert contiguous_inputs[i].dtype == self.inputs[i].dtype, (
                f"Dtype mismatch for {i}th input. Expect {self.inputs[i].dtype}, got {contiguous_inputs[i].dtype}.")
            if VARIANT["v"] == "fix":
                # #3357: the block is inside the loop, every input gets its static buffer
                if need_cudagraphs_record:
                    # this memory is reserved for future cudagraph runs; clone avoids re-using the user's memory
                    self._input_buffers[i] = contiguous_inputs[i].clone()
                else:
                    self._input_buffers[i].copy_(contiguous_inputs[i])

        if VARIANT["v"] == "bug":
            # #3270: the same block one indent level out -- it runs once, after the loop, with i == last index
            if need_cudagraphs_record:
                self._input_buffers[i] = contiguous_inputs[i].clone()
            else:
                self._input_buffers[i].copy_(contiguous_inputs[i])

        if need_cudagraphs_record:
            # self.cudagraph = torch.cuda.CUDAGraph()
            # with torch.cuda.graph(self.cudagraph, stream=self._engine_stream):
            #     self._output_buffers = self.compiled_module(*self._input_buffers)
            static = {f"_input_buffers[{k}]": b for k, b in enumerate(self._input_buffers) if b is not None}
            self.cudagraph, self._output_buffers = capture(
                lambda: self.compiled_module(*self._input_buffers), device=self.device, warmups=0,
                name=f"whole graph {self.shape_key}", static=static, owner="CudaGraphsTorchTensorRTModule")
        output = replay(self.cudagraph, self._output_buffers)

        output_buffers = output if isinstance(output, (list, tuple)) else [output]
        outputs = [o.clone() for o in output_buffers]
        if len(outputs) == 1:
            return outputs[0]
        return outputs


def run(variant: str, device: str = "cpu"):
    VARIANT["v"] = variant
    gen = generator(1357)
    xs = [randn(BATCH, DIM, gen=gen, device=device) for _ in range(STEPS)]
    ys = [randn(BATCH, DIM, gen=gen, device=device) for _ in range(STEPS)]

    def served():
        trt_model = SampleModelCompiled(device)
        with enable_cudagraphs(trt_model) as cudagraphs_module:
            assert isinstance(cudagraphs_module, CudaGraphsTorchTensorRTModule)
            return [cudagraphs_module(x, y) for x, y in zip(xs, ys)]

    def eager():
        trt_model = SampleModelCompiled(device)
        with torch.no_grad():
            return [trt_model(x, y) for x, y in zip(xs, ys)]

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
