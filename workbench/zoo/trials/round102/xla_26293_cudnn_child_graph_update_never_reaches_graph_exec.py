"""XLA updates a command buffer's cuDNN node (explicit CUDA-graph construction) by rewriting the child graph of the graph *template* only: ``CudaCommandBuffer::UpdateDnnGraphNode`` never calls ``cuGraphExecChildGraphNodeSetParams``, so the instantiated executable keeps running cuDNN on the buffers of the execution that recorded it.

Upstream: https://github.com/openxla/xla/pull/26293 ("[GPU] Fix cuDNN CUDA graph updates.", openxla/xla, spring 2025:
numbered between PRs of 2025-04-25 and 2025-05-19; closed, as XLA PRs land through copybara, and the fixed function
is in later stored versions of the file; the thread has no description). Read: the title and the PR page; the stored
``xla/stream_executor/cuda/cuda_command_buffer.cc`` before the fix (``UpdateDnnGraphNode``:
``cuGraphChildGraphNodeGetGraph(node, &graph_)``, ``is_owned_graph_ = false``, then
``dnn_graph.PopulateOrUpdateRawCommandBuffer(stream, operands, graph_, true)`` and nothing else) and after it (a local
``child_graph``, the same update, then ``cuGraphExecChildGraphNodeSetParams(graph_exec(), node, child_graph)``);
``gpu_command_buffer.cc`` (``CreateDnnGraphCommand``: a nested command buffer populated by ``PopulateDnnGraphNode``,
added with ``CreateChildNode``; ``UpdateDnnGraphCommand`` -> ``UpdateDnnGraphNode``); ``command_buffer_cmd.cc``
(``CuDnnCmd::Record``: ``CreateDnnGraphCommand`` on create, ``UpdateDnnGraphCommand`` on update when
``SupportsExplicitCommandBufferConstruction``); the stream-executor test that swaps a DNN command's output buffer,
calls ``UpdateDnnGraphCommand`` and expects the new buffer written; ``cuda_dnn.h`` (``CudnnGraph::
PopulateOrUpdateRawCommandBuffer(stream, operands, handle, do_update)``); and cudnn-frontend's
``samples/cpp/misc/cudagraphs.cpp``, whose update protocol is exactly ``cudaGraphChildGraphNodeGetGraph`` ->
``update_cuda_graph`` -> ``cudaGraphExecChildGraphNodeSetParams`` ("cudaGraphAddChildGraphNode ... clones").
Symptom: JAX programs with cuDNN fusions in command buffers (``--xla_gpu_enable_command_buffer`` with CUDNN, cuDNN
>= 9.7 so graphs are built explicitly) give the first execution right and later ones wrong whenever an argument or
result buffer moved: the cuDNN op keeps reading (and writing) the buffers of the first execution. No error.
Mechanism: ``cuGraphAddChildGraphNode`` clones the cuDNN child graph into the parent template, and
``cuGraphInstantiate`` copies the template into the executable. When ``CommandBufferThunk`` sees new allocation
addresses it updates every command: kernel commands go through ``cuGraphExecKernelNodeSetParams`` and reach the
executable, but the cuDNN command's ``update_cuda_graph`` rewrites only the template's child graph. The executable's
cuDNN kernels keep the pointers of the recording execution; launches compute from that execution's argument. (The
old code also points the parent's ``graph_`` at the child; nothing in this workload touches ``graph_`` afterwards.)
Doctor: warmup-divergence, at UpdateDnnGraphNode: the recording decided which tensor the cuDNN kernels read, and the
update meant to move that reference stops at the template, so replays keep the recorded reference while an eager
execution reads the current argument.
Fix (upstream): ``UpdateDnnGraphNode`` updates a local ``child_graph`` and pushes it into the executable with
``cuGraphExecChildGraphNodeSetParams(graph_exec(), node, child_graph)``.
Modelled: ``CudaCommandBuffer`` (``CreateKernelNode``/``UpdateKernelNode``, ``PopulateDnnGraphNode``/
``UpdateDnnGraphNode``, ``CreateChildNode``, ``Create/UpdateDnnGraphCommand``, ``Create/UpdateLaunch``, ``Update``,
``Finalize``, ``Submit``), ``CudnnGraph`` (``Execute``, ``PopulateOrUpdateRawCommandBuffer``), ``CuDnnCmd`` and
``LaunchCmd`` with ``Handle``, ``CommandBufferCmdSequence::Record``, ``CommandBufferThunk`` (``Initialize``,
``ExecuteOnStream``, ``ShouldUpdateCommandBuffer``), ``GpuExecutable::ExecuteThunks``. Stand-ins: the CUDA driver's
graphs are node lists (a kernel node: function, argument tensors by pointer, result tensor); an instantiated
executable holds its own copy of every node's parameters, and the engine's capture of those kernels plays the
device-side executable (re-captured after ``cuGraphExec*SetParams`` changed them, as the driver rewrites the nodes);
the cuDNN graph is one fused GEMM + bias + ReLU kernel; the loss fusion computes logits and softmax cross-entropy.
Workload: a JAX eval loop over 4 validation batches held on device (batch 4, 6 features, hidden 8, 5 classes),
``eval_step(params, x, y)`` -> per-example loss, the cuDNN fusion producing the hidden layer. Execution 1 records and
instantiates; executions 2-4 pass new ``x``/``y``/result buffers, so the command buffer is updated. Bug: executions
2-4 compute the hidden layer from batch 1 (with their own labels): errors 10.3, 2.17 and 1.89 (max |graph - eager|
= 10.3); execution 1 matches.
Fix: all 16 losses equal eager (max error 0).
"""
from __future__ import annotations

import enum

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/openxla/xla/pull/26293"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "UpdateDnnGraphNode"
SYMPTOM = ("cuDNN fusions in XLA command buffers: after a command buffer update the executable's cuDNN kernels still "
           "read the first execution's buffers (the child-graph update never reaches the graph exec); wrong results")

BATCH, D_IN, HIDDEN, CLASSES, NUM_BATCHES = 4, 6, 8, 5, 4
DTYPE = torch.float64

_variant = "bug"


# --- CUDA driver (stand-ins: graphs are node lists; an executable copies its nodes' parameters) ----------------------

class KernelParams:
    """``CUDA_KERNEL_NODE_PARAMS``: the kernel, its argument pointers, the buffer it writes."""

    def __init__(self, func, args, result):
        self.func, self.args, self.result = func, tuple(args), result


class CUgraphNode:
    def __init__(self, kernel: KernelParams | None = None, child: "CUgraph | None" = None):
        self.kernel, self.child = kernel, child


class CUgraph:
    def __init__(self):
        self.nodes: list[CUgraphNode] = []


def cuGraphAddKernelNode(graph: CUgraph, params: KernelParams) -> CUgraphNode:
    graph.nodes.append(CUgraphNode(kernel=params))
    return graph.nodes[-1]


def cuGraphAddChildGraphNode(graph: CUgraph, child: CUgraph) -> CUgraphNode:
    clone = CUgraph()                                              # "Note that this clones cudnn_cuda_graph"
    clone.nodes = [CUgraphNode(kernel=n.kernel) for n in child.nodes]
    graph.nodes.append(CUgraphNode(child=clone))
    return graph.nodes[-1]


def cuGraphChildGraphNodeGetGraph(node: CUgraphNode) -> CUgraph:
    return node.child                                              # the template's embedded child graph


def cuGraphKernelNodeSetParams(node: CUgraphNode, params: KernelParams) -> None:
    node.kernel = params                                           # the template only


class CUgraphExec:
    """``cuGraphInstantiate``: the executable keeps its own copy of every node's parameters."""

    def __init__(self, graph: CUgraph, device: str):
        self.device = device
        self.params = {id(n): [n.kernel] if n.child is None else [c.kernel for c in n.child.nodes]
                       for n in graph.nodes}                       # node -> its kernels' parameters (dicts keep order)
        self.graph = self.outputs = None                           # the device-side executable (engine capture)

    def run_kernels(self, result):
        for kernels in self.params.values():
            for k in kernels:
                k.result.copy_(k.func(*k.args))
        return result


def cuGraphExecKernelNodeSetParams(exec_: CUgraphExec, node: CUgraphNode, params: KernelParams) -> None:
    exec_.params[id(node)] = [params]
    exec_.graph = None                                             # the driver rewrites the node


def cuGraphExecChildGraphNodeSetParams(exec_: CUgraphExec, node: CUgraphNode, child: CUgraph) -> None:
    exec_.params[id(node)] = [n.kernel for n in child.nodes]
    exec_.graph = None


def cuGraphLaunch(exec_: CUgraphExec, result, static: dict):
    if exec_.graph is None:
        exec_.graph, exec_.outputs = capture(lambda: exec_.run_kernels(result), device=exec_.device, warmups=0,
                                             name="xla command buffer", owner="CommandBufferThunk", static=static)
    return replay(exec_.graph, exec_.outputs)


# --- cuDNN frontend + xla/stream_executor/cuda/cuda_dnn.cc (CudnnGraph) ---------------------------------------------

X_UID, W_UID, B_UID, H_UID = 1, 2, 3, 4


def cudnn_matmul_bias_relu_kernel(x, w, b):
    return torch.relu(x @ w + b)


class CudnnGraph:
    """A deserialized cuDNN fusion graph (``__cudnn$fusion``: dot + bias + ReLU)."""

    def SupportsExplicitCommandBufferConstruction(self) -> bool:
        return True                                                # cuDNN >= 9.7: SUPPORTS_CUDA_GRAPH_NATIVE_API

    def PackOperands(self, operands) -> dict:
        return dict(zip((X_UID, W_UID, B_UID, H_UID), operands))

    def Execute(self, stream, operands) -> None:
        vp = self.PackOperands(operands)                           # graph_.execute(handle, variant_pack, workspace)
        vp[H_UID].copy_(cudnn_matmul_bias_relu_kernel(vp[X_UID], vp[W_UID], vp[B_UID]))

    def PopulateOrUpdateRawCommandBuffer(self, stream, operands, cuda_graph: CUgraph, do_update: bool) -> None:
        vp = self.PackOperands(operands)
        params = KernelParams(cudnn_matmul_bias_relu_kernel, (vp[X_UID], vp[W_UID], vp[B_UID]), vp[H_UID])
        if do_update:                                              # graph_.update_cuda_graph(...)
            cuGraphKernelNodeSetParams(cuda_graph.nodes[0], params)
        else:                                                      # graph_.populate_cuda_graph(...)
            cuGraphAddKernelNode(cuda_graph, params)


# --- xla/stream_executor/gpu/gpu_command_buffer.cc + cuda/cuda_command_buffer.cc ------------------------------------

class CudaCommandBuffer:
    class State(enum.Enum):
        kCreate = "create"
        kUpdate = "update"
        kFinalized = "finalized"

    def __init__(self, device: str):
        self.device = device
        self.graph_, self.is_owned_graph_ = CUgraph(), True
        self.exec_: CUgraphExec | None = None
        self.state_ = CudaCommandBuffer.State.kCreate
        self.commands_: list[CUgraphNode] = []

    def graph_exec(self) -> CUgraphExec:
        return self.exec_

    def CreateKernelNode(self, params: KernelParams) -> CUgraphNode:
        return cuGraphAddKernelNode(self.graph_, params)

    def UpdateKernelNode(self, node: CUgraphNode, params: KernelParams) -> None:
        cuGraphExecKernelNodeSetParams(self.graph_exec(), node, params)

    def CreateLaunch(self, params: KernelParams) -> CUgraphNode:
        self.commands_.append(self.CreateKernelNode(params))
        return self.commands_[-1]

    def UpdateLaunch(self, command: CUgraphNode, params: KernelParams) -> None:
        self.UpdateKernelNode(command, params)

    def PopulateDnnGraphNode(self, dnn_graph: CudnnGraph, stream, operands) -> None:
        dnn_graph.PopulateOrUpdateRawCommandBuffer(stream, operands, self.graph_, False)

    def UpdateDnnGraphNode(self, dnn_graph: CudnnGraph, stream, operands, node_handle: CUgraphNode) -> None:
        if _variant == "bug":
            self.graph_ = cuGraphChildGraphNodeGetGraph(node_handle)
            self.is_owned_graph_ = False
            dnn_graph.PopulateOrUpdateRawCommandBuffer(stream, operands, self.graph_, True)
        else:
            child_graph = cuGraphChildGraphNodeGetGraph(node_handle)
            dnn_graph.PopulateOrUpdateRawCommandBuffer(stream, operands, child_graph, True)
            cuGraphExecChildGraphNodeSetParams(self.graph_exec(), node_handle, child_graph)

    def CreateChildNode(self, nested: "CudaCommandBuffer") -> CUgraphNode:
        return cuGraphAddChildGraphNode(self.graph_, nested.graph_)

    def CreateDnnGraphCommand(self, dnn_graph: CudnnGraph, stream, operands) -> CUgraphNode:
        nested = CudaCommandBuffer(self.device)                    # CreateCommandBuffer(Mode::kNested)
        nested.PopulateDnnGraphNode(dnn_graph, stream, operands)
        self.commands_.append(self.CreateChildNode(nested))
        return self.commands_[-1]

    def UpdateDnnGraphCommand(self, command: CUgraphNode, dnn_graph: CudnnGraph, stream, operands) -> None:
        self.UpdateDnnGraphNode(dnn_graph, stream, operands, command)

    def Update(self) -> None:
        assert self.state_ is CudaCommandBuffer.State.kFinalized
        self.state_ = CudaCommandBuffer.State.kUpdate

    def Finalize(self) -> None:
        if self.state_ is CudaCommandBuffer.State.kCreate:
            self.exec_ = CUgraphExec(self.graph_, self.device)     # cuGraphInstantiate
        self.state_ = CudaCommandBuffer.State.kFinalized

    def Submit(self, stream, result, static: dict):
        return cuGraphLaunch(self.graph_exec(), result, static)   # LaunchGraph(stream)


# --- xla/backends/gpu/runtime: commands and thunks ------------------------------------------------------------------

class RecordCreate:
    pass


class RecordUpdate:
    def __init__(self, command: CUgraphNode):
        self.command = command


def Handle(record_action, create, update):
    if isinstance(record_action, RecordCreate):
        return create()
    update(record_action.command)
    return record_action.command


class LaunchCmd:
    """A fusion's kernel launch: reads its operand slices, writes its result slice."""

    def __init__(self, name, fn, operands, result):
        self.name, self.fn, self.operands, self.result = name, fn, operands, result

    def buffers(self) -> tuple:
        return (*self.operands, self.result)

    def params(self, allocs) -> KernelParams:
        return KernelParams(self.fn, [allocs[o] for o in self.operands], allocs[self.result])

    def Record(self, execute_params, record_action, command_buffer: CudaCommandBuffer):
        params = self.params(execute_params.buffer_allocations)
        return Handle(record_action, lambda: command_buffer.CreateLaunch(params),
                      lambda command: command_buffer.UpdateLaunch(command, params))


class CuDnnCmd:
    def __init__(self, args, graph: CudnnGraph):
        self.args_, self.graph_ = list(args), graph

    def buffers(self) -> tuple:
        return tuple(self.args_)

    def Record(self, execute_params, record_action, command_buffer: CudaCommandBuffer):
        operands = [execute_params.buffer_allocations[a] for a in self.args_]
        assert self.graph_.SupportsExplicitCommandBufferConstruction()
        stream = execute_params.stream
        return Handle(record_action,
                      lambda: command_buffer.CreateDnnGraphCommand(self.graph_, stream, operands),
                      lambda command: command_buffer.UpdateDnnGraphCommand(command, self.graph_, stream, operands))


class KernelThunk(LaunchCmd):
    def ExecuteOnStream(self, params) -> None:
        p = self.params(params.buffer_allocations)
        p.result.copy_(p.func(*p.args))


class CuDnnThunk:
    def __init__(self, args, graph: CudnnGraph):
        self.args_, self.graph_ = list(args), graph

    def ExecuteOnStream(self, params) -> None:
        self.graph_.Execute(params.stream, [params.buffer_allocations[a] for a in self.args_])


class CommandBufferCmdSequence:
    def __init__(self, commands):
        self.commands = list(commands)
        self.recorded: list[CUgraphNode] = []

    def allocs_indices(self) -> set:
        return {index for command in self.commands for index in command.buffers()}

    def Record(self, execute_params, command_buffer: CudaCommandBuffer) -> None:
        if command_buffer.state_ is CudaCommandBuffer.State.kFinalized:
            command_buffer.Update()
        create = command_buffer.state_ is CudaCommandBuffer.State.kCreate
        self.recorded = [cmd.Record(execute_params, RecordCreate() if create else RecordUpdate(self.recorded[i]),
                                    command_buffer) for i, cmd in enumerate(self.commands)]
        command_buffer.Finalize()


class ExecuteParams:
    def __init__(self, buffer_allocations: dict, stream):
        self.buffer_allocations, self.stream = buffer_allocations, stream


class CommandBufferThunk:
    def __init__(self, commands: CommandBufferCmdSequence, result: str, parameters, device: str):
        self.commands_, self.result, self.parameters = commands, result, tuple(parameters)
        self.command_buffer = CudaCommandBuffer(device)            # ExecutorCommandBuffer
        self.recorded_allocs: dict = {}

    def ShouldUpdateCommandBuffer(self, params: ExecuteParams) -> bool:
        should_update = False
        for index in sorted(self.commands_.allocs_indices()):
            alloc = params.buffer_allocations[index]
            if self.recorded_allocs.get(index) is not alloc:       # !recorded_allocs[index].IsSameAs(alloc)
                self.recorded_allocs[index] = alloc
                should_update = True
        return should_update

    def Initialize(self, params: ExecuteParams) -> None:
        if self.command_buffer.state_ is CudaCommandBuffer.State.kCreate and self.ShouldUpdateCommandBuffer(params):
            self.commands_.Record(params, self.command_buffer)

    def ExecuteOnStream(self, params: ExecuteParams) -> None:
        if self.ShouldUpdateCommandBuffer(params):
            self.commands_.Record(params, self.command_buffer)
        allocs = params.buffer_allocations
        self.command_buffer.Submit(params.stream, allocs[self.result], {p: allocs[p] for p in self.parameters})


# --- xla/service/gpu/gpu_executable.cc: eval_step(params, x, y) -----------------------------------------------------

def softmax_xent_fusion(h, w2, y):
    logits = h @ w2
    return torch.logsumexp(logits, dim=-1) - logits.gather(-1, y[:, None]).squeeze(-1)


class GpuExecutable:
    PARAMETERS = ("x", "y", "w1", "b1", "w2")

    def __init__(self, device: str, enable_command_buffer: bool):
        self.device = device
        self.temp_h = torch.zeros(BATCH, HIDDEN, dtype=DTYPE, device=device)  # temp allocation slice, stable
        graph = CudnnGraph()
        if enable_command_buffer:        # --xla_gpu_enable_command_buffer=FUSION,CUDNN
            commands = CommandBufferCmdSequence([CuDnnCmd(("x", "w1", "b1", "h"), graph),
                                                 LaunchCmd("softmax_xent_fusion", softmax_xent_fusion,
                                                           ("h", "w2", "y"), "loss")])
            self.thunk_sequence = [CommandBufferThunk(commands, "loss", self.PARAMETERS, device)]
        else:
            self.thunk_sequence = [CuDnnThunk(("x", "w1", "b1", "h"), graph),
                                   KernelThunk("softmax_xent_fusion", softmax_xent_fusion, ("h", "w2", "y"), "loss")]

    def ExecuteThunks(self, arguments: dict) -> torch.Tensor:
        allocs = dict(arguments)                                   # parameters: the caller's device buffers
        allocs["h"] = self.temp_h
        allocs["loss"] = torch.zeros(BATCH, dtype=DTYPE, device=self.device)   # live-out: a new result buffer
        params = ExecuteParams(allocs, stream="compute stream")
        for thunk in self.thunk_sequence:
            if hasattr(thunk, "Initialize"):
                thunk.Initialize(params)
        for thunk in self.thunk_sequence:
            thunk.ExecuteOnStream(params)
        return allocs["loss"]


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(26293)
    model = {"w1": randn(D_IN, HIDDEN, gen=gen, device=device, scale=0.6).to(DTYPE),
             "b1": randn(HIDDEN, gen=gen, device=device, scale=0.1).to(DTYPE),
             "w2": randn(HIDDEN, CLASSES, gen=gen, device=device, scale=0.6).to(DTYPE)}
    val_set = [(randn(BATCH, D_IN, gen=gen, device=device).to(DTYPE),          # jax.device_put: one buffer each
                torch.randint(0, CLASSES, (BATCH,), generator=gen).to(device)) for _ in range(NUM_BATCHES)]

    def serve(enable_command_buffer: bool):
        executable = GpuExecutable(device, enable_command_buffer)
        return [executable.ExecuteThunks({**model, "x": x, "y": y}).clone() for x, y in val_set]

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
