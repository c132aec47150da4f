"""SYCL graph whole-graph update on the CUDA/HIP adapters: every kernel node that shares one kernel handle is re-parameterised with the LAST node's arguments.

Upstream: https://github.com/intel/llvm/pull/19479 ("[UR][CUDA][HIP] Fix command buffer update with shared kernel
handles", Bensuo, opened 2025-07-16, merged), fixing https://github.com/intel/llvm/issues/19450 ("Graph update can't
handle duplicate disconnected nodes", labels bug, cuda); regression test
``sycl/test-e2e/Graph/Update/independent_kernels_update.cpp``.
Symptom: the issue's reproducer builds, R times, a modifiable ``command_graph`` of I-1 disconnected
``parallel_for<class test>`` nodes, node i doing ``output[i]++`` (once, by the leader of its single work-group).
Round 0 finalizes it (``property::graph::updatable``), later rounds ``exec_graph.update(modifiable_graph)``; every
round submits it. Expected ``output[i] == R`` for every i; on CUDA (and HIP) after the first update every node
increments ``output[I-1]`` and the other counters stay at 1. No error is raised.
Mechanism: the SYCL runtime caches one UR kernel per kernel name, so all nodes share one ``ur_kernel_handle_t``,
whose argument store (``Kernel->setKernelArg`` / ``Kernel->getArgPointers()``) is one store per kernel handle, not per
node. At finalize the runtime sets the kernel's arguments and appends the command one node at a time
(``urCommandBufferAppendKernelLaunchExp`` -> ``cuGraphAddKernelNode``, which copies the values), so the first
executable graph is right. ``exec_graph_impl::updateURImpl`` batches every node of a partition into one
``urCommandBufferUpdateKernelLaunchExp`` call (``unified-runtime/source/adapters/cuda/command_buffer.cpp``, same in
``adapters/hip``). Pre-fix it ran two loops: the first ``updateCommand`` + ``updateKernelArguments`` for every
update (the latter writes the new argument values into ``Command->Kernel`` via ``setKernelArg``), the second,
"Propagate changes to CUDA driver API", per update ``setKernelParams`` (grid from the command's own sizes) and
``Params.kernelParams = Kernel->getArgPointers().data()`` then ``cuGraphExecKernelNodeSetParams``. By the second
loop the shared store holds only the last command's arguments, so every exec node is given the last node's ``i``.
Eager launches (``urEnqueueKernelLaunch``) set the arguments and launch one kernel at a time, so they are right.
Doctor: warmup-divergence, at ``urCommandBufferUpdateKernelLaunchExp``: every exec node's argument slots (the
static inputs of each launch) are rewritten before the replay, but the update binds each replayed node to another
node's arguments (those left in the per-kernel store), so in every replay after an update all I-1 nodes increment
``output[I-1]`` while the eager step, binding each launch's own arguments, increments each node's own counter. The inputs are
all freshly written (nothing is stale); the replay diverges from eager because of how the update bound them, and
the fix changed only this function.
Fix (upstream): one loop: each update's ``updateCommand`` + ``updateKernelArguments`` is followed at once by its
``setKernelParams`` / ``cuGraphExecKernelNodeSetParams`` (which copies the argument values), before the next
command overwrites the kernel's store ("Store changes in config struct in command handle object and propagate
changes to CUDA graph").
Modelled: the issue's reproducer (R=10, I=5, nd_range {i,i,i}/{i,i,i}: one work-group, one leader per node). The
CUDA exec graph is one engine graph captured at ``urCommandBufferFinalizeExp`` (``cuGraphInstantiate``) and replayed
by ``urCommandBufferEnqueueExp``; each exec node's copied kernel parameters are a small device tensor (``i`` and
the work-group count from ``setKernelParams``) that the kernel reads when it runs, which
``cuGraphExecKernelNodeSetParams`` overwrites. USM pointer arguments are kept as references bound at instantiate
(the reproducer passes the same ``output`` to every node, so their update never changes them). The kernel body is
``output[i] += number of work-groups`` (each group's leader increments once). Left out: memobj / local-memory
arguments, validation details, events and sync points, the HIP adapter (same code), kernel-handle update.
"""
from __future__ import annotations

import math

import torch

from workbench.zoo.kit import capture, compare, replay

UPSTREAM = "https://github.com/intel/llvm/pull/19479"
FAMILY = "persistent-buffer mutation"
KIND = "warmup-divergence"
SITE = "urCommandBufferUpdateKernelLaunchExp"
SYMPTOM = ("after exec_graph.update(), every kernel node that shares one kernel handle runs with the last node's "
           "arguments: all increments land in output[I-1], the other counters stop at 1; no error")

R, I = 10, 5                        # the rounds and output size (nodes i = 1 .. I-1)
UR_RESULT_SUCCESS = "UR_RESULT_SUCCESS"
VARIANT = {"v": "bug"}


# --- device code: parallel_for<class test>(nd_range{global, local}, [=](nd_item<3> it) {...}) ---------------------

def test(output: torch.Tensor, params: torch.Tensor):
    """``if (it.get_group().leader()) output[i]++;`` run by every work-group. ``params`` holds the launch's copied
    kernel parameters: ``[i, number of work-groups]`` (the grid goes with the launch, the value with the arguments)."""
    output.index_add_(0, params[0:1], params[1:2].to(output.dtype))


# --- the CUDA driver (the parts the adapter uses) -----------------------------------------------------------------

class CUDA_KERNEL_NODE_PARAMS:
    def __init__(self):
        self.func, self.gridDim, self.blockDim, self.kernelParams = None, (1, 1, 1), (1, 1, 1), None


class CUgraphNode:
    """A kernel node: ``cuGraphAddKernelNode`` copies the argument values out of ``kernelParams``."""

    def __init__(self, Params: CUDA_KERNEL_NODE_PARAMS):
        self.func, self.gridDim = Params.func, Params.gridDim
        self.args = list(Params.kernelParams)          # the copy, taken now


class CUgraphExecNode:
    """An instantiated node: its own copy of the launch parameters, in device memory the kernel reads."""

    def __init__(self, node: CUgraphNode, device: str):
        self.func = node.func
        self.pointer = node.args[0]                    # USM pointer argument, bound at instantiate
        self.params = torch.tensor([node.args[1], math.prod(node.gridDim)], dtype=torch.long, device=device)

    def launch(self):
        self.func(self.pointer, self.params)


def cuGraphAddKernelNode(graph: list, Params: CUDA_KERNEL_NODE_PARAMS) -> CUgraphNode:
    node = CUgraphNode(Params)
    graph.append(node)
    return node


def cuGraphExecKernelNodeSetParams(exec_nodes: dict, Node: CUgraphNode, Params: CUDA_KERNEL_NODE_PARAMS):
    """Copies the parameter values into the executable's node; the next launch uses them."""
    exec_node = exec_nodes[id(Node)]
    args = list(Params.kernelParams)                   # read through the pointers now
    assert args[0] is exec_node.pointer, "modelled: USM pointer arguments stay as bound at instantiate"
    exec_node.params.copy_(torch.tensor([args[1], math.prod(Params.gridDim)], dtype=torch.long))


def cuLaunchKernel(func, gridDim, kernelParams, device: str):
    """Eager launch: the parameter values are copied at the launch."""
    args = list(kernelParams)
    func(args[0], torch.tensor([args[1], math.prod(gridDim)], dtype=torch.long, device=device))


# --- unified-runtime/source/adapters/cuda: kernel.hpp, enqueue.cpp, command_buffer.{hpp,cpp} -------------------------

class ur_kernel_handle_t_:
    """One UR kernel; ``Args`` is its argument store, shared by every command made from this handle."""

    def __init__(self, func, num_args: int):
        self.func = func
        self.Args = [None] * num_args

    def get(self):
        return self.func

    def setKernelArg(self, index: int, value):
        self.Args[index] = value

    def getArgPointers(self):
        return self.Args                               # pointers into the store: read when they are consumed


def setKernelParams(WorkDim, GlobalWorkSize, LocalWorkSize):
    """ThreadsPerBlock from the local size, BlocksPerGrid = global / local."""
    ThreadsPerBlock = tuple(LocalWorkSize)
    BlocksPerGrid = tuple(g // l for g, l in zip(GlobalWorkSize, LocalWorkSize))
    return ThreadsPerBlock, BlocksPerGrid


def urEnqueueKernelLaunch(hQueue, hKernel: ur_kernel_handle_t_, workDim, pGlobalWorkSize, pLocalWorkSize):
    ThreadsPerBlock, BlocksPerGrid = setKernelParams(workDim, pGlobalWorkSize, pLocalWorkSize)
    cuLaunchKernel(hKernel.get(), BlocksPerGrid, hKernel.getArgPointers(), hQueue.device)
    return UR_RESULT_SUCCESS


class kernel_command_handle:
    def __init__(self, CommandBuffer, Kernel, Node, WorkDim, GlobalWorkSize, LocalWorkSize):
        self.CommandBuffer, self.Kernel, self.Node = CommandBuffer, Kernel, Node
        self.WorkDim, self.GlobalWorkSize, self.LocalWorkSize = WorkDim, tuple(GlobalWorkSize), tuple(LocalWorkSize)
        self.Params = CUDA_KERNEL_NODE_PARAMS()


class ur_exp_command_buffer_handle_t_:
    def __init__(self, device: str, IsUpdatable: bool):
        self.device, self.IsUpdatable = device, IsUpdatable
        self.CudaGraph: list[CUgraphNode] = []
        self.CudaGraphExec = None                      # (engine graph, its output) once finalized
        self.ExecNodes: dict[int, CUgraphExecNode] = {}
        self.output = None                             # (the model's name for what the graph's kernels write)

    def launchExecNodes(self):
        for exec_node in self.ExecNodes.values():      # disconnected nodes: no ordering between them
            exec_node.launch()
        return self.output


class ur_exp_command_buffer_update_kernel_launch_desc_t:
    def __init__(self, hCommand, pNewPointerArgList, pNewValueArgList, newWorkDim, pNewGlobalWorkSize,
                 pNewLocalWorkSize):
        self.hCommand = hCommand
        self.pNewPointerArgList, self.pNewValueArgList = pNewPointerArgList, pNewValueArgList  # [(argIndex, value)]
        self.newWorkDim, self.pNewGlobalWorkSize, self.pNewLocalWorkSize = (newWorkDim, pNewGlobalWorkSize,
                                                                            pNewLocalWorkSize)


def urCommandBufferAppendKernelLaunchExp(hCommandBuffer, hKernel, workDim, pGlobalWorkSize, pLocalWorkSize):
    ThreadsPerBlock, BlocksPerGrid = setKernelParams(workDim, pGlobalWorkSize, pLocalWorkSize)
    NodeParams = CUDA_KERNEL_NODE_PARAMS()
    NodeParams.func, NodeParams.gridDim, NodeParams.blockDim = hKernel.get(), BlocksPerGrid, ThreadsPerBlock
    NodeParams.kernelParams = hKernel.getArgPointers()
    GraphNode = cuGraphAddKernelNode(hCommandBuffer.CudaGraph, NodeParams)
    return kernel_command_handle(hCommandBuffer, hKernel, GraphNode, workDim, pGlobalWorkSize, pLocalWorkSize)


def urCommandBufferFinalizeExp(hCommandBuffer, output):
    """``cuGraphInstantiate``: each exec node copies its node's parameters; the launch sequence is captured once."""
    hCommandBuffer.ExecNodes = {id(n): CUgraphExecNode(n, hCommandBuffer.device) for n in hCommandBuffer.CudaGraph}
    hCommandBuffer.output = output
    static = {f"exec node {k} kernelParams": e.params for k, e in enumerate(hCommandBuffer.ExecNodes.values())}
    hCommandBuffer.CudaGraphExec = capture(
        hCommandBuffer.launchExecNodes, device=hCommandBuffer.device, warmups=0, name="command-buffer CudaGraphExec",
        owner="UR CUDA adapter command-buffer", static=static, state={"output (malloc_shared counters)": output})
    return UR_RESULT_SUCCESS


def urCommandBufferEnqueueExp(hCommandBuffer, hQueue):
    g, out = hCommandBuffer.CudaGraphExec
    return replay(g, out)                              # cuGraphLaunch(hCommandBuffer->CudaGraphExec, CuStream)


def updateKernelArguments(UpdateCommandDesc):
    Kernel = UpdateCommandDesc.hCommand.Kernel
    for ArgIndex, ArgValue in UpdateCommandDesc.pNewPointerArgList:
        Kernel.setKernelArg(ArgIndex, ArgValue)
    for ArgIndex, ArgValue in UpdateCommandDesc.pNewValueArgList:
        Kernel.setKernelArg(ArgIndex, ArgValue)
    return UR_RESULT_SUCCESS


def updateCommand(UpdateCommandDesc):
    Command = UpdateCommandDesc.hCommand
    if UpdateCommandDesc.newWorkDim:
        Command.WorkDim = UpdateCommandDesc.newWorkDim
    if UpdateCommandDesc.pNewGlobalWorkSize:
        Command.GlobalWorkSize = tuple(UpdateCommandDesc.pNewGlobalWorkSize)
    if UpdateCommandDesc.pNewLocalWorkSize:
        Command.LocalWorkSize = tuple(UpdateCommandDesc.pNewLocalWorkSize)
    return UR_RESULT_SUCCESS


def _propagate(hCommandBuffer, UpdateCommandDesc):
    """Per command: the grid from its own sizes, the arguments from its kernel's store, into the exec node."""
    KernelCommandHandle = UpdateCommandDesc.hCommand
    ThreadsPerBlock, BlocksPerGrid = setKernelParams(KernelCommandHandle.WorkDim, KernelCommandHandle.GlobalWorkSize,
                                                     KernelCommandHandle.LocalWorkSize)
    Params = KernelCommandHandle.Params
    Params.func = KernelCommandHandle.Kernel.get()
    Params.gridDim, Params.blockDim = BlocksPerGrid, ThreadsPerBlock
    Params.kernelParams = KernelCommandHandle.Kernel.getArgPointers()
    cuGraphExecKernelNodeSetParams(hCommandBuffer.ExecNodes, KernelCommandHandle.Node, Params)


def urCommandBufferUpdateKernelLaunchExp(hCommandBuffer, numKernelUpdates, pUpdateKernelLaunch):
    # First validate user inputs, as no update should be propagated if there are errors (validateCommandDesc)
    for i in range(numKernelUpdates):
        if pUpdateKernelLaunch[i].hCommand.CommandBuffer is not hCommandBuffer:
            return "UR_RESULT_ERROR_INVALID_COMMAND_BUFFER_COMMAND_HANDLE_EXP"
        if hCommandBuffer.CudaGraphExec is None or not hCommandBuffer.IsUpdatable:
            return "UR_RESULT_ERROR_INVALID_OPERATION"
    if VARIANT["v"] == "bug":
        # Store changes in config struct in command handle object
        for i in range(numKernelUpdates):
            updateCommand(pUpdateKernelLaunch[i])
            updateKernelArguments(pUpdateKernelLaunch[i])
        # Propagate changes to CUDA driver API
        for i in range(numKernelUpdates):
            _propagate(hCommandBuffer, pUpdateKernelLaunch[i])
    else:
        # #19479: store changes in config struct in command handle object and propagate changes to CUDA graph
        for i in range(numKernelUpdates):
            updateCommand(pUpdateKernelLaunch[i])
            updateKernelArguments(pUpdateKernelLaunch[i])
            _propagate(hCommandBuffer, pUpdateKernelLaunch[i])
    return UR_RESULT_SUCCESS


# --- sycl/source/detail: program cache, handler, graph_impl (reduced) ------------------------------------------------

class ProgramManager:
    """``getOrCreateKernel``: the kernel cache hands every submission of one kernel name the same UR kernel."""

    def __init__(self):
        self.cache: dict[str, ur_kernel_handle_t_] = {}

    def getOrCreateKernel(self, name: str) -> ur_kernel_handle_t_:
        if name not in self.cache:
            self.cache[name] = ur_kernel_handle_t_(test, num_args=2)
        return self.cache[name]


class node_impl:
    """A kernel command group: the kernel name, its nd_range and the lambda's captures as (argIndex, value)."""

    def __init__(self, kernel_name, global_size, local_size, pointer_args, value_args):
        self.MKernelName, self.MGlobal, self.MLocal = kernel_name, tuple(global_size), tuple(local_size)
        self.MPointerArgs, self.MValueArgs = pointer_args, value_args


def setKernelArgs(kernel: ur_kernel_handle_t_, node: node_impl):
    for index, value in node.MPointerArgs:             # urKernelSetArgPointer
        kernel.setKernelArg(index, value)
    for index, value in node.MValueArgs:               # urKernelSetArgValue
        kernel.setKernelArg(index, value)


class queue:
    def __init__(self, device: str):
        self.device, self.programs = device, ProgramManager()

    def parallel_for(self, node: node_impl):
        """Eager: ``enqueueImpKernel`` sets the cached kernel's arguments, then launches it."""
        kernel = self.programs.getOrCreateKernel(node.MKernelName)
        setKernelArgs(kernel, node)
        urEnqueueKernelLaunch(self, kernel, 3, node.MGlobal, node.MLocal)

    def ext_oneapi_graph(self, graph: "exec_graph_impl"):
        return urCommandBufferEnqueueExp(graph.MCommandBuffer, self)


class graph_impl:                                      # command_graph<graph_state::modifiable>
    def __init__(self):
        self.MNodeStorage: list[node_impl] = []

    def add(self, node: node_impl):
        self.MNodeStorage.append(node)


class exec_graph_impl:                                 # command_graph<graph_state::executable>
    def __init__(self, q: queue, graph: graph_impl, output):
        """``finalize(property::graph::updatable{})``: one command per node, arguments set just before each append."""
        self.q = q
        self.MCommandBuffer = ur_exp_command_buffer_handle_t_(q.device, IsUpdatable=True)
        self.MCommandMap: list[kernel_command_handle] = []
        for node in graph.MNodeStorage:                # enqueueImpCommandBufferKernel
            kernel = q.programs.getOrCreateKernel(node.MKernelName)
            setKernelArgs(kernel, node)
            self.MCommandMap.append(urCommandBufferAppendKernelLaunchExp(
                self.MCommandBuffer, kernel, 3, node.MGlobal, node.MLocal))
        urCommandBufferFinalizeExp(self.MCommandBuffer, output)

    def update(self, graph: graph_impl):
        """Whole-graph update: ``updateURImpl`` batches every node of the partition into one UR call."""
        descs = [ur_exp_command_buffer_update_kernel_launch_desc_t(
            command, node.MPointerArgs, node.MValueArgs, 3, node.MGlobal, node.MLocal)
            for command, node in zip(self.MCommandMap, graph.MNodeStorage)]
        result = urCommandBufferUpdateKernelLaunchExp(self.MCommandBuffer, len(descs), descs)
        assert result == UR_RESULT_SUCCESS, result


# --- the user: the reproducer ----------------------------------------------------------------------------

def build_nodes(output):
    """``for (size_t i = 1; i < I; ++i) modifiable_graph.add(... parallel_for<class test>(nd_range{{i,i,i},{i,i,i}}``
    ``, [=](nd_item<3> it) { if (it.get_group().leader()) output[i]++; }))``."""
    return [node_impl("test", (i, i, i), (i, i, i), pointer_args=[(0, output)], value_args=[(1, i)])
            for i in range(1, I)]


def run(variant: str, device: str = "cpu"):
    def serve(graphed: bool):
        VARIANT["v"] = variant
        q = queue(device)
        output = torch.zeros(I, dtype=torch.int32, device=device)     # malloc_shared<int>(I) + std::fill(0)
        graph, outs = None, []
        for r in range(R):
            nodes = build_nodes(output)
            if graphed:
                modifiable_graph = graph_impl()
                for node in nodes:
                    modifiable_graph.add(node)
                if r == 0:
                    graph = exec_graph_impl(q, modifiable_graph, output)   # "Building graph"
                else:
                    graph.update(modifiable_graph)                         # "Updating graph"
                counters = q.ext_oneapi_graph(graph)
            else:
                for node in nodes:
                    q.parallel_for(node)
                counters = output
            outs.append(counters.clone())                                  # q.wait(); read output
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
