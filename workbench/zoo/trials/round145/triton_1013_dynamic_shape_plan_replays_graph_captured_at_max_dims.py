"""TensorRT Inference Server (Triton) builds CUDA graphs for a TensorRT plan model when its config says
``optimization { cuda { graphs: true } }``: ``PlanBackend::CreateExecutionContext`` calls
``Context::BuildCudaGraph`` for a set of batch sizes, which captures one ``IExecutionContext::enqueue`` on the
instance's stream and files the graph under its batch size; ``Context::Run`` launches the graph found under the
request batch's ``total_batch_size`` instead of enqueueing. For a model with dynamic shapes (an explicit-batch engine
with optimization profiles), the execution context's binding dimensions at capture are the ones
``InitializeInputBinding`` set at load time, the profile's maximum dims, so the graph holds TensorRT's kernels for that
shape. ``Run`` sets the request's dims on the context (to get the output dims) and then, keyed on the batch size alone,
launches a graph that computes at the maximum dims over the input buffer, into which only the request's elements were
copied; the response is the first elements of an output laid out at the maximum dims. Without graphs ``Run`` calls
``enqueueV2`` at the request's dims. The fix captures graphs only for fixed-shape models ("it only captures activities
for the shapes used, so it may misbehave for other shapes").

Upstream: https://github.com/triton-inference-server/server/pull/1013 ("Limit CUDA graph to fixed shape model. Fix
CUDA graph for dynamic sequence batcher", triton-inference-server/server, then "TensorRT Inference Server", author
GuanLuo, squash-merged to master 2020-01-10 as 8fe9b315cd94b72a8b5982e553195344fb9efbce; its sub-commits: "Add
L0_cuda_graph test", "Set input dimension with proper batch size for capturing CUDA graphs", "Fix bug. Fix test",
"Revert changes and make sure no CUDA graphs are used for dynamic shape", "Improve batch sizes selected for building
CUDA graphs", "Clean up"). Read, in a mirror of the repository: the whole diff (``src/backends/tensorrt/
plan_backend.cc``: ``CreateExecutionContext``'s graph block, ``BuildCudaGraph``; the new ``qa/L0_cuda_graph/test.sh``
and ``trt_cuda_graph_test.py``); at its parent 1772800327b119315f02635931ed6206728d92a9: ``plan_backend.h``
(``Context``, ``TensorRTContext`` with ``cuda_graph_execs_`` keyed by batch size, ``buffers_``, ``buffer_bindings_``,
``byte_sizes_``, ``is_dynamic_``), and in ``plan_backend.cc``: ``CreateExecutionContext``, ``InitializeInputBinding``
(dynamic path: profile min/opt/max dims, ``MaximumDims``, ``setBindingDimensions`` to the maximum, one ``cudaMalloc``
of the maximum byte size), ``InitializeConfigInputBindings``, ``InitializeConfigOutputBindings`` (output size from
``context->getBindingDimensions``), ``BuildCudaGraph``, ``PlanBackend::Run``, ``Context::Run`` (input copy,
``ValidateDimension``, ``setBindingDimensions``, ``cuda_graph_execs_.find(total_batch_size)``, ``enqueueV2`` /
``enqueue``, output dims and ``SetFixedSizeOutputBuffer``); ``plan_utils.cc``: ``MaximumDims``, ``ValidateDimension``.
Not read: ``GetMostOptimizedProfile``'s body (one profile here), ``SetInputBuffer`` / ``SetFixedSizeOutputBuffer``
bodies (taken as contiguous copies from the buffer's start, as their arguments say), ``ProcessResponse``, the event
sets, the sequence batcher, the PR's review thread (not in the stored text). TensorRT is closed source: that
``getMaxBatchSize()`` is 1 for an explicit-batch engine and that ``enqueue(1, ...)`` on such an engine runs at the
context's current binding dims is my reading of TensorRT's documentation, not code I read; with ``batchSize > 1`` the
parameter check fails (``enqueue`` returns false, ``BuildCudaGraph`` logs "unable to record CUDA graph" and the loop
stops), which does not matter here: every dynamic-shape request of the workload has batch 1.
Symptom: no user report found. The fix's comment: "CUDA graph will only be captured for fixed shape model as it only
captures activities for the shapes used, so it may misbehave for other shapes"; its test expects, for the dynamic
``plan_float32_float32_float32`` model, "no CUDA graphs are captured" and both requests (shape [20], batch 1 and 5)
executed without a graph. That test model is elementwise ("outputs are sum and difference of inputs", ``qa/common/
infer_util.py``'s ``infer_exact``), which on contiguous buffers gives the right first elements even at the wrong shape;
wrong numbers, as here, need a model whose kernels mix elements along the dynamic axis (my workload: attention).
Mechanism: ``InitializeInputBinding`` sets each dynamic input to its maximum dims [max_batch_size, 12, 8]; the graph
loop captures ``enqueue(1)`` there and files it under batch size 1. A request [1, L, 8] is copied contiguously to the
start of the input buffer, ``setBindingDimensions([1, L, 8])`` is called, and ``find(1)`` launches the graph, which
runs attention over 12 positions per row: the request's L tokens and 12 - L positions holding what earlier, longer
requests left. The response is the first L * 8 elements of the output buffer: row 0 of a [4, 12, 8] output.
Doctor: warmup-divergence, at CreateExecutionContext. The captured step does other work than the eager step would:
the execution shape is the one the context had at capture (the profile maximum), while the eager step for the same
request runs ``enqueueV2`` at the request's dims; ``CreateExecutionContext`` decides to build graphs for a dynamic
model (the fix adds ``if (!context->is_dynamic_)`` there); ``Run``'s lookup by batch size is where the wrong graph is
then chosen.
Fix (upstream): graphs are built only ``if (!context->is_dynamic_)``; the batch sizes become {1, preferred batch
sizes of the dynamic or (new) sequence-oldest batcher, max_batch_size}, else the default {1, 2, 3, 4, 6, 8, 12, 16} plus
max_batch_size (the sequence-batcher half only adds graphs, a speed fix; modelled without the sequence-batcher
branch, which no model here has).
Modelled: ``PlanBackend`` (``CreateExecutionContext``, ``Run``), ``Context`` (``InitializeInputBinding``,
``InitializeConfigInputBindings``, ``InitializeConfigOutputBindings``, ``BuildCudaGraph``,
``GetMostOptimizedProfile``, ``Run``, ``buffers_``, ``buffer_bindings_``, ``byte_sizes_``, ``is_dynamic_``),
``TensorRTContext`` (``cuda_graph_execs_``, min/opt/max dims), ``MaximumDims``, ``ValidateDimension``,
``GetByteSize``, ``SetInputBuffer``, ``SetFixedSizeOutputBuffer``, and TensorRT's ``ICudaEngine`` /
``IExecutionContext`` as far as used (``setBindingDimensions``, ``getBindingDimensions``, ``getProfileDimensions``,
``getMaxBatchSize``, ``allInputDimensionsSpecified``, ``enqueue``, ``enqueueV2``).
Stand-ins: a TensorRT engine is a torch function over flat binding buffers viewed at the context's dims when it is
enqueued; ``cudaMalloc``'d buffers are zero-filled flat float64 tensors (real ones start with whatever the allocator
left); one instance, one profile, one stream (the input-copy stream and event sets are not modelled); a request
payload is one tensor; the reference run is the same server with ``graphs: false``.
Workload (mine; the fix's test starts the server once with a fixed-shape plan, once with a dynamic one): two models
on one server. ``seq_attention``: dynamic [-1, 8] input, profile
min/opt/max [1,1,8] / [1,8,8] / [4,12,8], max_batch_size 4, one self-attention layer (width 8) with residual and
LayerNorm; six batch-1 requests of lengths 12, 7, 10, 5, 12, 3. ``pooler``: fixed [8] -> [3] softmax classifier,
implicit batch, max_batch_size 4, requests of batch 1, 3, 2 (served from its graphs in both variants). Outputs: the
nine responses.
Measured: bug: misbehaves (max |graph - eager| = 2.38); the length-12 responses and the pooler's are exact, the
shorter ones are not (per response: 0, 0, 1.04, 0.23, 0, 0.54, 0, 0, 2.38); fix: equals eager (max |graph - eager| =
0), the pooler still replays its graphs (sizes 1-4), ``seq_attention`` runs ``enqueueV2``. Both variants together in
under 5 s on the CPU, imports included.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/triton-inference-server/server/pull/1013"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "CreateExecutionContext"
SYMPTOM = ("with cuda graphs on, a dynamic-shape TensorRT model's request replays the graph captured for its batch "
           "size at the profile's maximum dims, computing over stale buffer elements and returning misaligned output")

DTYPE = torch.float64
ELEM = 8                      # bytes per element (TYPE_FP64 here)
D = 8                         # hidden width
NO_BATCHING = 0
WILDCARD_DIM = -1
kMIN, kOPT, kMAX = "kMIN", "kOPT", "kMAX"
_variant = "bug"


def GetByteSize(dims) -> int:
    return ELEM * math.prod(dims)


def MaximumDims(max_profile_dims, dims, support_batching: bool, max_batch_size: int) -> list:
    max_dims = [max_batch_size] if support_batching else []
    start = 1 if support_batching else 0
    for i, d in enumerate(dims):
        max_dims.append(max_profile_dims[i + start] if d == WILDCARD_DIM else d)
    return max_dims


def ValidateDimension(this_dims, min_dims, max_dims) -> None:
    if any(t < lo or t > hi for t, lo, hi in zip(this_dims, min_dims, max_dims)):
        raise ValueError(f"request shape {list(this_dims)} outside profile [{list(min_dims)}, {list(max_dims)}]")


# --- TensorRT (as far as Triton uses it) ------------------------------------------------------------------------------

class ICudaEngine:
    def __init__(self, bindings: list, network, explicit_batch: bool, max_batch: int = 1, profile: dict | None = None):
        self.bindings = bindings                    # [(name, is_input, dims)]; explicit: dims include the batch
        self.network, self.explicit_batch, self.max_batch, self.profile = network, explicit_batch, max_batch, profile

    def getBindingIndex(self, name: str) -> int:
        return [b[0] for b in self.bindings].index(name)

    def bindingIsInput(self, i: int) -> bool:
        return self.bindings[i][1]

    def getBindingDimensions(self, i: int) -> tuple:
        return self.bindings[i][2]

    def getProfileDimensions(self, i: int, profile_index: int, selector: str) -> tuple:
        return self.profile[self.bindings[i][0]][selector]

    def getMaxBatchSize(self) -> int:
        return 1 if self.explicit_batch else self.max_batch   # "always 1" without an implicit batch dimension

    def createExecutionContext(self) -> "IExecutionContext":
        return IExecutionContext(self)


class IExecutionContext:
    def __init__(self, engine: ICudaEngine):
        self.engine = engine
        self.dims = {i: b[2] for i, b in enumerate(engine.bindings) if b[1]}

    def setBindingDimensions(self, i: int, dims) -> bool:
        self.dims[i] = tuple(dims)
        return True

    def allInputDimensionsSpecified(self) -> bool:
        return all(WILDCARD_DIM not in d for d in self.dims.values())

    def getBindingDimensions(self, i: int) -> tuple:
        if self.engine.bindingIsInput(i):
            return self.dims[i]
        return self.engine.network.output_dims(self.dims[0])   # outputs follow the (single) input

    def _execute(self, bindings: list, shapes: dict) -> None:
        ins = {i: bindings[i][:math.prod(s)].view(s) for i, s in shapes.items()}
        outs = self.engine.network(ins[0])
        for j, out in outs.items():
            bindings[j][:out.numel()].view(out.shape).copy_(out)

    def enqueue(self, batchSize: int, bindings: list, stream, inputConsumed) -> bool:
        if not (0 < batchSize <= self.engine.getMaxBatchSize()):
            return False                                          # "Parameter check failed at: engine.cpp::enqueue"
        if self.engine.explicit_batch:
            self._execute(bindings, dict(self.dims))              # batchSize ignored: the bindings' own dims
        else:
            self._execute(bindings, {i: (batchSize, *d) for i, d in self.dims.items()})
        return True

    def enqueueV2(self, bindings: list, stream, inputConsumed) -> bool:
        self._execute(bindings, dict(self.dims))
        return True


class SeqAttentionNetwork:
    """One self-attention layer over the sequence axis, residual, LayerNorm: INPUT0 [B, L, D] -> OUTPUT0 [B, L, D]."""

    def __init__(self, device: str):
        gen = generator(1013)
        self.w = {k: (torch.randn(D, D, generator=gen, dtype=DTYPE) * 0.5).to(device) for k in ("q", "k", "v", "o")}
        self.gamma = (1 + 0.1 * torch.randn(D, generator=gen, dtype=DTYPE)).to(device)

    def output_dims(self, in_dims) -> dict:
        return tuple(in_dims)

    def __call__(self, x: Tensor) -> dict:
        q, k, v = x @ self.w["q"], x @ self.w["k"], x @ self.w["v"]
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D), dim=-1)
        h = x + (a @ v) @ self.w["o"]
        return {1: torch.nn.functional.layer_norm(h, (D,), self.gamma, None, 1e-5)}


class PoolerNetwork:
    """Fixed-shape classifier: INPUT0 [B, 8] -> OUTPUT0 [B, 3]."""

    def __init__(self, device: str):
        gen = generator(2020)
        self.w = (torch.randn(D, 3, generator=gen, dtype=DTYPE) * 0.5).to(device)
        self.b = (torch.randn(3, generator=gen, dtype=DTYPE) * 0.1).to(device)

    def __call__(self, x: Tensor) -> dict:
        return {1: torch.softmax(x @ self.w + self.b, dim=-1)}


# --- Triton's TensorRT backend (src/backends/tensorrt/plan_backend.cc) -----------------------------------------------

class ModelConfig:
    def __init__(self, name, max_batch_size, inputs, outputs, graphs, profile_names=("0",), preferred=()):
        self.name, self.max_batch_size, self.input, self.output = name, max_batch_size, inputs, outputs
        self.graphs, self.profile_names, self.preferred_batch_size = graphs, profile_names, preferred


class TensorRTContext:
    def __init__(self, profile_name: str, binding_cnts: int):
        self.profile_name_, self.context_ = profile_name, None
        self.cuda_graph_execs_: dict = {}          # batch size -> (graph, outputs)
        self.min_dims_ = [None] * binding_cnts
        self.max_dims_ = [None] * binding_cnts
        self.opt_dims_ = [None] * binding_cnts


class Context:
    def __init__(self, name: str, device: str, max_batch_size: int):
        self.name_, self.device, self.max_batch_size_ = name, device, max_batch_size
        self.stream_ = device
        self.is_dynamic_ = False
        self.trt_contexts_: dict = {}
        self.executions_without_graph = 0

    def InitializeInputBinding(self, input_name, model_config_dims, support_batching: bool) -> None:
        max_byte_size = 0
        io_index = self.engine_.getBindingIndex(input_name)
        for profile_index, context in self.trt_contexts_.items():
            engine_dims = self.engine_.getBindingDimensions(io_index)
            if WILDCARD_DIM in engine_dims:
                self.is_dynamic_ = True
            if not self.is_dynamic_:
                byte_size = GetByteSize([self.max_batch_size_, *model_config_dims])
            else:
                for sel, store in ((kMAX, context.max_dims_), (kMIN, context.min_dims_), (kOPT, context.opt_dims_)):
                    store[io_index] = self.engine_.getProfileDimensions(io_index, profile_index, sel)
                maximum_dims = MaximumDims(context.max_dims_[io_index], model_config_dims, support_batching,
                                           self.max_batch_size_)
                byte_size = GetByteSize(maximum_dims)
                context.max_dims_[io_index] = tuple(maximum_dims)
                context.context_.setBindingDimensions(io_index, context.max_dims_[io_index])
            max_byte_size = max(max_byte_size, byte_size)
        self.byte_sizes_[io_index] = max_byte_size
        self.buffers_[io_index] = torch.zeros(max_byte_size // ELEM, dtype=DTYPE, device=self.device)   # cudaMalloc
        self.buffer_bindings_[io_index] = self.buffers_[io_index]

    def InitializeConfigInputBindings(self, ios, support_batching: bool) -> None:
        for name, dims in ios:
            self.InitializeInputBinding(name, dims, support_batching)

    def InitializeConfigOutputBindings(self, ios, support_batching: bool) -> None:
        for name, dims in ios:
            io_index = self.engine_.getBindingIndex(name)
            max_byte_size = 0
            for context in self.trt_contexts_.values():
                if not self.is_dynamic_:
                    byte_size = GetByteSize([self.max_batch_size_, *dims])
                else:
                    byte_size = GetByteSize(context.context_.getBindingDimensions(io_index))
                max_byte_size = max(max_byte_size, byte_size)
            self.byte_sizes_[io_index] = max_byte_size
            self.buffers_[io_index] = torch.zeros(max_byte_size // ELEM, dtype=DTYPE, device=self.device)
            self.buffer_bindings_[io_index] = self.buffers_[io_index]

    def BuildCudaGraph(self, trt_context: TensorRTContext, batch_size: int) -> bool:
        outputs = tuple(self.buffers_[i] for i in range(self.num_expected_bindings_)
                        if not self.engine_.bindingIsInput(i))
        ok = []

        def enqueue():
            ok.append(trt_context.context_.enqueue(batch_size, self.buffer_bindings_, self.stream_, None))
            return outputs
        # cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal); enqueue; cudaStreamEndCapture
        graph, outs = capture(enqueue, device=self.device, warmups=0, name=f"{self.name_} batch size {batch_size}",
                              owner="TRTIS PlanBackend")
        if not ok[0]:
            return False                            # "unable to record CUDA graph"
        trt_context.cuda_graph_execs_[batch_size] = (graph, outs)      # cudaGraphInstantiate
        return True

    def GetMostOptimizedProfile(self, total_batch_size, payload):
        return next(iter(self.trt_contexts_.items()))

    def Run(self, payloads: list) -> list:
        total_batch_size = sum(p.shape[0] for p in payloads)
        if total_batch_size != 1 and total_batch_size > self.max_batch_size_:
            raise ValueError(f"dynamic batch size {total_batch_size} for '{self.name_}'")
        profile, tctx = self.GetMostOptimizedProfile(total_batch_size, payloads[0])
        for bindex in range(self.num_expected_bindings_):
            if not self.engine_.bindingIsInput(bindex):
                continue
            if self.is_dynamic_:
                shape = (total_batch_size, *payloads[0].shape[1:])
                ValidateDimension(shape, tctx.min_dims_[bindex], tctx.max_dims_[bindex])
                tctx.context_.setBindingDimensions(bindex, shape)     # so that output dimensions can be obtained
            SetInputBuffer(payloads, self.buffers_[bindex])
        found = tctx.cuda_graph_execs_.get(total_batch_size)          # cuda_graph_execs_.find(total_batch_size)
        if found is not None:
            replay(*found)                                            # cudaGraphLaunch(itr->second, stream_)
        else:
            self.executions_without_graph += 1
            if self.is_dynamic_:
                assert tctx.context_.allInputDimensionsSpecified()
                tctx.context_.enqueueV2(self.buffer_bindings_, self.stream_, None)
            else:
                tctx.context_.enqueue(total_batch_size, self.buffer_bindings_, self.stream_, None)
        responses = []
        for bindex in range(self.num_expected_bindings_):
            if self.engine_.bindingIsInput(bindex):
                continue
            if self.is_dynamic_:
                shape = tctx.context_.getBindingDimensions(bindex)
            else:
                shape = (total_batch_size, *self.engine_.getBindingDimensions(bindex))
            responses += SetFixedSizeOutputBuffer(self.buffers_[bindex], shape, payloads)
        return responses


def SetInputBuffer(payloads: list, buffer: Tensor) -> None:
    offset = 0
    for p in payloads:                                  # contiguous, in payload order, from the buffer's start
        buffer[offset:offset + p.numel()].copy_(p.reshape(-1))
        offset += p.numel()


def SetFixedSizeOutputBuffer(buffer: Tensor, shape, payloads: list) -> list:
    batch1 = math.prod(shape[1:])
    out, offset = [], 0
    for p in payloads:
        n = p.shape[0] * batch1
        out.append(buffer[offset:offset + n].view(p.shape[0], *shape[1:]).clone())
        offset += n
    return out


class PlanBackend:
    def __init__(self, config: ModelConfig, engine: ICudaEngine):
        self.config, self.engine = config, engine
        self.contexts_: list = []

    def CreateExecutionContext(self, instance_name: str, device: str) -> Context:
        config = self.config
        mbs = NO_BATCHING if config.max_batch_size <= 0 else config.max_batch_size
        context = Context(instance_name, device, mbs)
        self.contexts_.append(context)
        context.engine_ = self.engine
        context.num_expected_bindings_ = len(self.engine.bindings)
        for profile_name in config.profile_names:                     # InitOptimizationProfiles
            tctx = TensorRTContext(profile_name, context.num_expected_bindings_)
            tctx.context_ = self.engine.createExecutionContext()
            context.trt_contexts_[int(profile_name)] = tctx
        n = context.num_expected_bindings_
        context.byte_sizes_, context.buffers_, context.buffer_bindings_ = [0] * n, [None] * n, [None] * n
        support_batching = mbs != NO_BATCHING
        context.InitializeConfigInputBindings(config.input, support_batching)
        context.InitializeConfigOutputBindings(config.output, support_batching)
        if config.graphs:
            events.static_buffers("TRTIS PlanBackend::Context", {
                f"{config.name}.{self.engine.bindings[i][0]}": context.buffers_[i]
                for i in range(n) if self.engine.bindingIsInput(i)})
            if _variant == "bug":
                cuda_graph_batch_sizes = {1, 2, 3, 4, 6, 8, 12, 16} | set(config.preferred_batch_size)
                build = True
            else:
                cuda_graph_batch_sizes = {1} | set(config.preferred_batch_size) if config.preferred_batch_size \
                    else {1, 2, 3, 4, 6, 8, 12, 16}
                if config.max_batch_size > 0:
                    cuda_graph_batch_sizes.add(config.max_batch_size)
                # CUDA graph will only be captured for fixed shape model as it only captures activities for the
                # shapes used, so it may misbehave for other shapes.
                build = not context.is_dynamic_
            if build:
                for tctx in context.trt_contexts_.values():
                    for bs in sorted(cuda_graph_batch_sizes):
                        if bs <= config.max_batch_size or bs == 1:  # 1: non-batching models have max_batch_size 0
                            if not context.BuildCudaGraph(tctx, bs):
                                break
        return context

    def Run(self, payloads: list) -> list:
        return self.contexts_[0].Run(payloads)


def _server(device: str, graphs: bool) -> dict:
    seq = ICudaEngine([("INPUT0", True, (-1, -1, D)), ("OUTPUT0", False, (-1, -1, D))], SeqAttentionNetwork(device),
                      explicit_batch=True,
                      profile={"INPUT0": {kMIN: (1, 1, D), kOPT: (1, 8, D), kMAX: (4, 12, D)}})
    pooler = ICudaEngine([("INPUT0", True, (D,)), ("OUTPUT0", False, (3,))], PoolerNetwork(device),
                         explicit_batch=False, max_batch=4)
    backends = {
        "seq_attention": PlanBackend(ModelConfig("seq_attention", 4, [("INPUT0", (-1, D))], [("OUTPUT0", (-1, D))],
                                                 graphs), seq),
        "pooler": PlanBackend(ModelConfig("pooler", 4, [("INPUT0", (D,))], [("OUTPUT0", (3,))], graphs), pooler),
    }
    for b in backends.values():
        b.CreateExecutionContext(f"{b.config.name}_0_gpu0", device)
    return backends


def _requests(device: str) -> list:
    gen = generator(145)
    reqs = []
    for model, shape in (("seq_attention", (1, 12, D)), ("pooler", (1, D)), ("seq_attention", (1, 7, D)),
                         ("seq_attention", (1, 10, D)), ("pooler", (3, D)), ("seq_attention", (1, 5, D)),
                         ("seq_attention", (1, 12, D)), ("pooler", (2, D)), ("seq_attention", (1, 3, D))):
        reqs.append((model, torch.randn(*shape, generator=gen, dtype=DTYPE).to(device)))
    return reqs


def infer(device: str, graphs: bool) -> list:
    server = _server(device, graphs)
    responses = []
    for model, x in _requests(device):
        responses += server[model].Run([x])
    return responses


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    try:
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: infer(device, graphs=True),
                       lambda: infer(device, graphs=False))
    finally:
        _variant = "bug"
