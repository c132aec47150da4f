"""HIP (clr) ``hipGraphExecKernelNodeSetParams`` updates the executable node's ``kernelParams_`` but not the AQL packet and kernarg slot formed at instantiate, so every later ``hipGraphLaunch`` dispatches the instantiate-time kernel arguments.

Upstream: https://github.com/ROCm/clr/commit/a99b163eba57947e77e583494537717a52bc3803 ("SWDEV-439628 -
hipGraphExecKernelNodeSetParams to update graph kernel node params with graph performance optimizations",
Anusha GodavarthySurya, authored 2024-01-08, committed 2024-01-24, announced on develop 2024-01-31). It fixes
https://github.com/ROCm/clr/issues/42 ("Enable DEBUG_CLR_GRAPH_PACKET_CAPTURE, the packet capture function can't work
with kernel node modified by hipGraphExecKernelNodeSetParams", kevin-gjm, 2023-12-21; steps: hipGraphCreate,
hipGraphAddKernelNode, hipGraphInstantiate, hipGraphExecKernelNodeSetParams, hipGraphLaunch, hipStreamSynchronize).
Symptom: with graph packet capture on (``DEBUG_CLR_GRAPH_PACKET_CAPTURE=1``), a program that re-parameterises a kernel
node of an instantiated graph with ``hipGraphExecKernelNodeSetParams`` and relaunches it gets the old arguments: the
call returns ``hipSuccess`` and the executable's node holds the new parameters, but the device runs the kernel with
the arguments the node had at ``hipGraphInstantiate``. Here a Jacobi solver that ping-pongs its two
iterate buffers by swapping the ``u_in`` / ``u_out`` pointers of the graph's sweep and residual nodes every iteration
recomputes iteration 0 on every launch: the buffer it reads back as the new iterate still holds the initial guess and
the residual never moves. Eager ``hipLaunchKernel`` is correct.
Mechanism (pre-fix ``hipamd/src/hip_graph.cpp``, ``hip_graph_internal.{hpp,cpp}``, ``rocclr/device/rocm/rocvirtual.cpp``):
with the flag set, ``hipGraphInstantiate`` calls ``GraphExec::CaptureAQLPackets()``. For a graph of one parallel list
it sizes ``kernarg_pool_graph_`` from every kernel node's ``GetKerArgSize()``, and for each kernel node of
``topoOrder_`` takes a slot with ``allocKernArg`` and calls ``GraphKernelNode::CaptureAndFormPacket(kernArgOffset)``:
the node's ``NDRangeKernelCommand`` is put in capturing state (``setCapturingState(true, GetAqlPacket(),
kernArgOffset)``) and submitted, so ``VirtualGPU::submitKernelInternal`` writes the kernel arguments into that slot
(instead of the queue's kernarg ring) and ``dispatchAqlPacket(..., capturing, aqlPacket)`` copies the formed
``hsa_kernel_dispatch_packet_t`` (kernel object, grid, ``kernarg_address``) into the node's ``gpuPacket_[64]`` instead
of the hardware queue. ``GraphExec::Run`` then, at each launch, only ``dispatchAqlPacket(topoOrder_[i]->GetAqlPacket())``
for kernel nodes. ``hipGraphExecKernelNodeSetParams`` resolved the executable's copy (``GetClonedNode``) and returned
``GraphKernelNode::SetParams(pNodeParams)``, which validates and deep-copies the new ``hipKernelNodeParams`` into
``kernelParams_`` only. Nothing re-forms ``gpuPacket_`` or rewrites its kernarg slot, so the next launch dispatches
the instantiate-time packet with the instantiate-time argument bytes (and, had ``func`` changed, the old kernel).
Doctor: stale-input, at hipGraphExecKernelNodeSetParams (the node's AQL packet and the kernarg slot it points at are
what every launch reads as the kernel's arguments: static inputs of the replay, written at instantiate. This step's
update of the arguments reached only the host-side ``kernelParams_``; the refresh of the packet and its kernarg slot,
which the fix adds in this function as ``GraphExec::UpdateAQLPacket``, is skipped, so the replay reads the pointers
that instantiation wrote there. The eager launch writes fresh kernargs for this step's pointers.)
Fix (upstream): ``hipGraphExecKernelNodeSetParams`` returns early on a ``SetParams`` error and, under
``DEBUG_CLR_GRAPH_PACKET_CAPTURE``, calls the new ``GraphExec::UpdateAQLPacket(clonedNode)``. Because the new ``func``
may need more kernarg bytes than instantiate reserved, it does not reuse the node's slot: it carves a fresh one from
``kernarg_graph_``, 128 KiB pools allocated on demand (a new pool when the last is full; all freed in
``~GraphExec``), and re-runs ``CaptureAndFormPacket(capture_stream_, result)``, which now creates the command itself
(``CreateCommand(capture_stream)``) from the updated ``kernelParams_``. ``capture_stream_`` is the null stream taken
without waiting for other streams (``getNullStream(false)``).
Modelled: one GPU whose memory is one float64 tensor addressed in bytes (``hipMalloc``, ``deviceLocalAlloc`` bump
allocators; every kernel argument is one 8-byte word, pointers are byte addresses into it). ``gpuPacket_`` is a small
pinned host array (fields: kernel object, grid size, kernarg address); ``dispatchAqlPacket`` copies it into a slot of
the device's AQL ring and the packet processor reads ``kernarg_address`` from that slot, then the argument words from
device memory, so a launch re-reads the packet and its kernargs. The GPU work one ``hipGraphLaunch`` submits (the
packet-dispatch loop of ``GraphExec::Run``) is recorded once, at ``hipGraphInstantiate`` after
``CaptureAQLPackets``, and each launch replays it; the kernel object is resolved when that loop is recorded (the
workload never changes ``func``). Kept: ``GetClonedNode``, ``SetParams``/``copyParams``, ``allocKernArg``,
``CaptureAQLPackets``, ``UpdateAQLPacket`` with its pool growth, ``CaptureAndFormPacket`` in its post-fix form and
``capture_stream_`` (both variants; pre-fix ``CaptureAQLPackets`` created the command on the node's stream and passed
it in), capturing-state ``submitKernelInternal``.
Left out: the largeBar sentinel/HDP flush, hidden kernel arguments, the ``extra`` argument path, AccumulateCommand
profiling, non-kernel nodes (created as commands at each launch), multi-stream graphs (no packet capture), and the
``NullStream(wait)`` change. The app is a 1-D Poisson Jacobi solver whose two-node graph (``jacobi`` sweep, then
``residual`` of the new iterate) is built with ``hipGraphAddKernelNode`` and instantiated once; each iteration sets
both nodes' pointers with ``hipGraphExecKernelNodeSetParams`` (return values checked: they are ``hipSuccess``),
launches on the null stream, synchronises and copies the iterate and the residual back.
"""
from __future__ import annotations

import torch

from workbench.engine import host, synchronize
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/ROCm/clr/commit/a99b163eba57947e77e583494537717a52bc3803"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "hipGraphExecKernelNodeSetParams"
SYMPTOM = ("with DEBUG_CLR_GRAPH_PACKET_CAPTURE, hipGraphExecKernelNodeSetParams returns hipSuccess but the next "
           "hipGraphLaunch dispatches the AQL packet and kernargs formed at instantiate (old pointers)")

N, ITERS = 16, 6
H = 1.0 / (N - 1)
Ki = 1024
DEVICE_MEMORY_BYTES = 256 * Ki
VDEV_KERNARG_POOL_BYTES = 4 * Ki
AQL_RING_SLOTS = 16
DEBUG_CLR_GRAPH_PACKET_CAPTURE = True          # the precondition of clr #42
VARIANT = {"v": "bug"}

hipSuccess, hipErrorInvalidValue = "hipSuccess", "hipErrorInvalidValue"
hipErrorInvalidDeviceFunction, hipErrorMemoryAllocation = "hipErrorInvalidDeviceFunction", "hipErrorMemoryAllocation"
hipGraphNodeTypeKernel = "hipGraphNodeTypeKernel"

# hsa_kernel_dispatch_packet_t, the fields the model uses (one int64 each)
HEADER, GRID_SIZE_X, KERNEL_OBJECT, KERNARG_ADDRESS, PACKET_WORDS = 0, 1, 2, 3, 8


def alignUp(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


# --- the GPU: memory, code objects, the AQL queue (rocclr/device/rocm) -------------------------------------------

class DeviceMemory:
    """Device memory as one float64 tensor addressed in bytes; allocations bump through it (never freed here)."""

    def __init__(self, nbytes: int, device: str):
        self.words = torch.zeros(nbytes // 8, dtype=torch.float64, device=device)
        self.device, self._top = device, 0

    def alloc(self, nbytes: int, alignment: int = 256) -> int:
        address = alignUp(self._top, alignment)
        if address + nbytes > 8 * self.words.numel():
            raise MemoryError("device memory exhausted")
        self._top = address + nbytes
        return address

    def view(self, address: int, nbytes: int) -> torch.Tensor:
        return self.words[address // 8: (address + nbytes) // 8]

    def write(self, address: int, values) -> None:
        """A host write through the large BAR (``nontemporalMemcpy`` of kernargs, ``hipMemcpy`` H2D)."""
        self.view(address, 8 * len(values)).copy_(torch.as_tensor(values, dtype=torch.float64).to(self.device))


class DeviceKernel:
    """A code object: its kernarg segment (every argument one 8-byte word here) and the device function."""

    def __init__(self, name: str, num_params: int, body):
        self.name, self.numParams, self.body = name, num_params, body
        self.KernargSegmentByteSize, self.KernargSegmentAlignment = 8 * num_params, 16
        self.kernel_object = len(_code_objects) + 1
        _code_objects[self.kernel_object] = self


_code_objects: dict[int, DeviceKernel] = {}


class VirtualGPU:
    """The device queue of a stream: its kernarg ring for direct dispatches, and its AQL ring."""

    def __init__(self, mem: DeviceMemory):
        self.mem = mem
        self.kernarg_pool_base_ = mem.alloc(VDEV_KERNARG_POOL_BYTES)
        self.kernarg_pool_cur_offset_ = 0
        self.aql_ring = torch.zeros(AQL_RING_SLOTS, PACKET_WORDS, dtype=torch.int64, device=mem.device)
        self.write_index = 0
        self.workitem_id = torch.arange(N, dtype=torch.int64, device=mem.device)
        self.arg_word = torch.arange(8, dtype=torch.int64, device=mem.device)

    def allocKernArg(self, size: int, alignment: int) -> int:
        offset = alignUp(self.kernarg_pool_cur_offset_, alignment)
        if offset + size > VDEV_KERNARG_POOL_BYTES:         # the ring wraps (upstream waits for the GPU first)
            offset = 0
        self.kernarg_pool_cur_offset_ = offset + size
        return self.kernarg_pool_base_ + offset

    def submitKernelInternal(self, cmd: "NDRangeKernelCommand") -> None:
        kernel = cmd.kernel
        if cmd.getCapturingState():
            argBuffer = cmd.getKernArgOffset()               # the graph's kernarg slot
        else:
            argBuffer = self.allocKernArg(kernel.KernargSegmentByteSize, kernel.KernargSegmentAlignment)
        self.mem.write(argBuffer, cmd.parameters)            # nontemporalMemcpy(argBuffer, parameters, ...)
        dispatchPacket = torch.zeros(PACKET_WORDS, dtype=torch.int64)
        dispatchPacket[GRID_SIZE_X] = cmd.globalWorkSize
        dispatchPacket[KERNEL_OBJECT] = kernel.kernel_object
        dispatchPacket[KERNARG_ADDRESS] = argBuffer
        self.dispatchKernelPacket(dispatchPacket, cmd.getCapturingState(), cmd.getAqlPacket())

    def dispatchKernelPacket(self, packet, capturing: bool, aqlPacket) -> None:
        """``dispatchAqlPacket(hsa_kernel_dispatch_packet_t*, header, rest, blocking, capturing, aqlPacket)``."""
        packet[HEADER] = 1
        if capturing:
            aqlPacket.copy_(packet)                          # fastMemcpy into the node's gpuPacket_
            return
        self.dispatchAqlPacket(host(packet, self.mem.device))

    def dispatchAqlPacket(self, aqlpacket: torch.Tensor) -> None:
        """Write a formed packet into the hardware queue; the packet processor runs it."""
        slot = self.aql_ring[self.write_index % AQL_RING_SLOTS]
        self.write_index += 1
        slot.copy_(aqlpacket, non_blocking=True)
        kernel = _code_objects[int(aqlpacket[KERNEL_OBJECT].item())]
        grid = int(aqlpacket[GRID_SIZE_X].item())
        kernarg = self.mem.words[slot[KERNARG_ADDRESS] // 8 + self.arg_word[:kernel.numParams]]
        kernel.body(self.mem.words, kernarg, self.workitem_id[:grid])


# --- the kernels -------------------------------------------------------------------------------------------------

def _ptr(arg: torch.Tensor) -> torch.Tensor:
    return (arg // 8).long()


def _jacobi(W, kernarg, i):
    """``__global__ void jacobi(const double* u_in, double* u_out, const double* f, double h2, int n)``."""
    u_in, u_out, f, h2, n = _ptr(kernarg[0]), _ptr(kernarg[1]), _ptr(kernarg[2]), kernarg[3], kernarg[4].long()
    left, right = W[u_in + (i - 1).clamp(min=0)], W[u_in + torch.minimum(i + 1, n - 1)]
    interior = (i > 0) & (i < n - 1)
    W.index_copy_(0, u_out + i, torch.where(interior, 0.5 * (left + right + h2 * W[f + i]), W[u_in + i]))


def _residual(W, kernarg, i):
    """``__global__ void residual(const double* u, const double* f, double* r, double h2, int n)``."""
    u, f, r, h2, n = _ptr(kernarg[0]), _ptr(kernarg[1]), _ptr(kernarg[2]), kernarg[3], kernarg[4].long()
    left, right = W[u + (i - 1).clamp(min=0)], W[u + torch.minimum(i + 1, n - 1)]
    interior = (i > 0) & (i < n - 1)
    res = W[f + i] - (2 * W[u + i] - left - right) / h2
    W.index_copy_(0, r + i, torch.where(interior, res, torch.zeros_like(res)))


jacobi = DeviceKernel("jacobi", 5, _jacobi)
residual = DeviceKernel("residual", 5, _residual)


# --- amd::NDRangeKernelCommand, hip::Stream, hip::Device ------------------------------------------------------------

class NDRangeKernelCommand:
    def __init__(self, stream: "Stream", kernel: DeviceKernel, globalWorkSize: int, parameters):
        self.stream, self.kernel, self.globalWorkSize = stream, kernel, globalWorkSize
        self.parameters = list(parameters)
        self.capturing_, self.gpuPacket_, self.kernArgOffset_ = False, None, None

    def setCapturingState(self, capturing: bool, packet, kernArgOffset: int) -> None:
        self.capturing_, self.gpuPacket_, self.kernArgOffset_ = capturing, packet, kernArgOffset

    def getCapturingState(self) -> bool:
        return self.capturing_

    def getAqlPacket(self):
        return self.gpuPacket_

    def getKernArgOffset(self) -> int:
        return self.kernArgOffset_

    def submit(self, vdev: VirtualGPU) -> None:
        vdev.submitKernelInternal(self)

    def enqueue(self) -> None:
        self.submit(self.stream.vdev())


class Stream:
    def __init__(self, device: "Device"):
        self.device, self._vdev = device, VirtualGPU(device.mem)

    def vdev(self) -> VirtualGPU:
        return self._vdev


class Device:
    """``hip::Device`` with its ``amd::Device`` (``deviceLocalAlloc``) and null stream."""

    def __init__(self, device: str):
        self.torch_device = device
        self.mem = DeviceMemory(DEVICE_MEMORY_BYTES, device)
        self.null_stream_ = None

    def NullStream(self, wait: bool = True) -> Stream:
        if self.null_stream_ is None:
            self.null_stream_ = Stream(self)
        return self.null_stream_

    def deviceLocalAlloc(self, size: int) -> int:
        return self.mem.alloc(size)


class hipKernelNodeParams:
    def __init__(self, func: DeviceKernel, gridDim: int, blockDim: int, kernelParams, sharedMemBytes: int = 0):
        self.func, self.gridDim, self.blockDim, self.sharedMemBytes = func, gridDim, blockDim, sharedMemBytes
        self.kernelParams = kernelParams


def ihipLaunchKernelCommand(func, globalWorkSize, stream, kernelParams) -> NDRangeKernelCommand:
    return NDRangeKernelCommand(stream, func, globalWorkSize, kernelParams)


def hipLaunchKernel(func, gridDim, blockDim, args, sharedMemBytes, stream: Stream) -> str:
    """The eager path: kernargs from the queue's ring, the packet straight into the hardware queue."""
    ihipLaunchKernelCommand(func, gridDim * blockDim, stream, args).enqueue()
    return hipSuccess


# --- hipamd/src/hip_graph_internal.{hpp,cpp} ------------------------------------------------------------------------

class GraphNode:
    nodeSet_: set[int] = set()

    def __init__(self, type_):
        self.type_, self.commands_, self.stream_ = type_, [], None
        self.gpuPacket_ = None                               # uint8_t gpuPacket_[64]: set by subclasses
        GraphNode.nodeSet_.add(id(self))

    @staticmethod
    def isNodeValid(pGraphNode) -> bool:
        return pGraphNode is not None and id(pGraphNode) in GraphNode.nodeSet_

    def GetType(self):
        return self.type_

    def GetAqlPacket(self):
        return self.gpuPacket_

    def CreateCommand(self, stream: Stream) -> str:
        self.commands_, self.stream_ = [], stream
        return hipSuccess


class GraphKernelNode(GraphNode):
    def __init__(self, pNodeParams: hipKernelNodeParams, device: str):
        super().__init__(hipGraphNodeTypeKernel)
        self.device = device
        self.gpuPacket_ = host(torch.zeros(PACKET_WORDS, dtype=torch.int64), device)
        self.kernelParams_ = pNodeParams
        self.copyParams(pNodeParams)

    def copyParams(self, pNodeParams: hipKernelNodeParams) -> str:
        func = pNodeParams.func
        if func is None:
            return hipErrorInvalidDeviceFunction
        if DEBUG_CLR_GRAPH_PACKET_CAPTURE:
            self.kernargSegmentByteSize_ = func.KernargSegmentByteSize
            self.kernargSegmentAlignment_ = func.KernargSegmentAlignment
            self.alignedKernArgSize_ = alignUp(func.KernargSegmentByteSize, func.KernargSegmentAlignment)
        self.numParams_ = func.numParams
        # malloc + memcpy of each argument: the node owns a copy of the caller's values
        self.kernelParams_ = hipKernelNodeParams(func, pNodeParams.gridDim, pNodeParams.blockDim,
                                                 list(pNodeParams.kernelParams[:self.numParams_]),
                                                 pNodeParams.sharedMemBytes)
        return hipSuccess

    def clone(self) -> "GraphKernelNode":
        return GraphKernelNode(self.kernelParams_, self.device)

    def GetKerArgSize(self) -> int:
        return self.alignedKernArgSize_

    def GetKernargSegmentByteSize(self) -> int:
        return self.kernargSegmentByteSize_

    def GetKernargSegmentAlignment(self) -> int:
        return self.kernargSegmentAlignment_

    def CreateCommand(self, stream: Stream) -> str:
        status = validateKernelParams(self.kernelParams_)
        if status != hipSuccess:
            return status
        super().CreateCommand(stream)
        p = self.kernelParams_
        self.commands_.append(ihipLaunchKernelCommand(p.func, p.gridDim * p.blockDim, stream, p.kernelParams))
        return hipSuccess

    def CaptureAndFormPacket(self, capture_stream: Stream, kernArgOffset: int) -> None:
        self.CreateCommand(capture_stream)
        for command in self.commands_:
            command.setCapturingState(True, self.GetAqlPacket(), kernArgOffset)
            # Enqueue command to capture GPU Packet. The packet is not submitted to the device.
            # The packet is stored in gpuPacket_ and submitted during graph launch.
            command.submit(command.stream.vdev())

    def SetParams(self, params: hipKernelNodeParams) -> str:
        status = validateKernelParams(params)
        if status != hipSuccess:
            return status
        self.kernelParams_ = params
        return self.copyParams(params)


def validateKernelParams(params: hipKernelNodeParams) -> str:
    if params.func is None or params.gridDim * params.blockDim == 0:
        return hipErrorInvalidValue
    return hipSuccess


class Graph:
    def __init__(self):
        self.vertices_: list[GraphNode] = []

    def AddNode(self, node: GraphNode) -> None:
        self.vertices_.append(node)

    def clone(self, clonedNodes: dict) -> "Graph":
        cloned = Graph()
        for node in self.vertices_:                          # a chain: insertion order is the topological order
            clonedNodes[id(node)] = node.clone()
            cloned.AddNode(clonedNodes[id(node)])
        return cloned


class GraphExec:
    def __init__(self, graph: Graph, device: Device):
        self.clonedNodes_: dict[int, GraphNode] = {}
        self.clonedGraph_ = graph.clone(self.clonedNodes_)
        self.topoOrder_ = list(self.clonedGraph_.vertices_)
        self.parallelLists_ = [list(self.topoOrder_)]        # one list: packet capture applies
        self.device = device
        self.kernarg_pool_graph_, self.kernarg_pool_size_graph_, self.kernarg_pool_cur_graph_offset_ = None, 0, 0
        self.kernarg_graph_: list[int] = []                  # a99b163: 128 KiB pools for updated nodes
        self.kernarg_graph_cur_offset_ = 0
        self.kernarg_graph_size_ = 128 * Ki
        self.capture_stream_ = None
        self.launch_graph_ = self.launch_outputs_ = None     # (model) the recorded dispatch of Run

    def Init(self) -> str:
        self.capture_stream_ = self.device.NullStream(False)  # CreateStreams(): "Capture stream is to capture AQL packet"
        return hipSuccess

    def GetClonedNode(self, node):
        return self.clonedNodes_.get(id(node))

    def allocKernArg(self, size: int, alignment: int):
        result = alignUp(self.kernarg_pool_graph_ + self.kernarg_pool_cur_graph_offset_, alignment)
        pool_new_usage = (result + size) - self.kernarg_pool_graph_
        if pool_new_usage <= self.kernarg_pool_size_graph_:
            self.kernarg_pool_cur_graph_offset_ = pool_new_usage
        return result

    def CaptureAQLPackets(self) -> str:
        if len(self.parallelLists_) == 1:
            kernArgSizeForGraph = sum(node.GetKerArgSize() for node in self.parallelLists_[0]
                                      if node.GetType() == hipGraphNodeTypeKernel)
            self.kernarg_pool_graph_ = self.device.deviceLocalAlloc(kernArgSizeForGraph)
            self.kernarg_pool_size_graph_ = kernArgSizeForGraph
            for node in self.topoOrder_:
                if node.GetType() == hipGraphNodeTypeKernel:
                    # From the kernel pool allocate the kern arg size required for the current kernel node.
                    kernArgOffset = self.allocKernArg(node.GetKernargSegmentByteSize(),
                                                      node.GetKernargSegmentAlignment())
                    if kernArgOffset is None:
                        return hipErrorMemoryAllocation
                    # Form GPU packet capture for the kernel node.
                    node.CaptureAndFormPacket(self.capture_stream_, kernArgOffset)
        return hipSuccess

    def UpdateAQLPacket(self, node: GraphKernelNode) -> str:
        """a99b163: a fresh kernarg slot from the 128 KiB pools, then re-form the node's packet."""
        if len(self.parallelLists_) == 1:
            pool_new_usage, result = 0, None
            if self.kernarg_graph_:
                kernArgSizeForNode = node.GetKerArgSize()
                result = alignUp(self.kernarg_graph_[-1] + self.kernarg_graph_cur_offset_,
                                 node.GetKernargSegmentAlignment())
                pool_new_usage = (result + kernArgSizeForNode) - self.kernarg_graph_[-1]
            if pool_new_usage != 0 and pool_new_usage <= self.kernarg_graph_size_:
                self.kernarg_graph_cur_offset_ = pool_new_usage
            else:
                self.kernarg_graph_.append(self.device.deviceLocalAlloc(self.kernarg_graph_size_))
                self.kernarg_graph_cur_offset_ = 0
                kernArgSizeForNode = node.GetKerArgSize()
                result = alignUp(self.kernarg_graph_[-1] + self.kernarg_graph_cur_offset_,
                                 node.GetKernargSegmentAlignment())
                pool_new_usage = (result + kernArgSizeForNode) - self.kernarg_graph_[-1]
                if pool_new_usage <= self.kernarg_graph_size_:
                    self.kernarg_graph_cur_offset_ = pool_new_usage
            # 2. copy kernel args / create new AQL packet
            node.CaptureAndFormPacket(self.capture_stream_, result)
        return hipSuccess

    def DispatchPackets(self, hip_stream: Stream) -> None:
        """The packet path of ``GraphExec::Run``: each kernel node's captured packet into the stream's queue."""
        for node in self.topoOrder_:
            if DEBUG_CLR_GRAPH_PACKET_CAPTURE and node.GetType() == hipGraphNodeTypeKernel:
                hip_stream.vdev().dispatchAqlPacket(node.GetAqlPacket())

    def Run(self, stream: Stream) -> str:
        replay(self.launch_graph_, self.launch_outputs_)
        return hipSuccess


# --- hipamd/src/hip_graph.cpp ----------------------------------------------------------------------------------------

def hipGraphCreate() -> Graph:
    return Graph()


def hipGraphAddKernelNode(graph: Graph, pNodeParams: hipKernelNodeParams, device: str) -> GraphKernelNode:
    node = GraphKernelNode(pNodeParams, device)
    graph.AddNode(node)
    return node


def hipGraphInstantiate(graph: Graph, device: Device, *, outputs, static, state) -> GraphExec:
    """(``outputs`` / ``static`` / ``state``: the model's names for what a launch writes and reads.)"""
    ge = GraphExec(graph, device)
    ge.Init()
    if DEBUG_CLR_GRAPH_PACKET_CAPTURE:
        # For graph nodes capture AQL packets to dispatch them directly during graph launch.
        ge.CaptureAQLPackets()
    hip_stream = device.NullStream()

    def launch():
        ge.DispatchPackets(hip_stream)
        return outputs

    kernarg_pool = device.mem.view(ge.kernarg_pool_graph_, ge.kernarg_pool_size_graph_)
    ge.launch_graph_, ge.launch_outputs_ = capture(
        launch, device=device.torch_device, warmups=0, name="hipGraphExec (packet capture)", owner="hip::GraphExec",
        static={**static, "kernarg_pool_graph_ (instantiate-time kernargs)": kernarg_pool}, state=state)
    return ge


def hipGraphLaunch(graphExec: GraphExec, stream: Stream) -> str:
    return graphExec.Run(stream)


def hipGraphExecKernelNodeSetParams(hGraphExec: GraphExec, node, pNodeParams: hipKernelNodeParams) -> str:
    if hGraphExec is None or not GraphNode.isNodeValid(node) or pNodeParams is None or pNodeParams.func is None:
        return hipErrorInvalidValue
    clonedNode = hGraphExec.GetClonedNode(node)
    if clonedNode is None:
        return hipErrorInvalidValue
    if VARIANT["v"] == "bug":
        return clonedNode.SetParams(pNodeParams)
    status = clonedNode.SetParams(pNodeParams)                # a99b163
    if status != hipSuccess:
        return status
    if DEBUG_CLR_GRAPH_PACKET_CAPTURE:
        status = hGraphExec.UpdateAQLPacket(clonedNode)
    return status


def hipStreamSynchronize(stream: Stream) -> str:
    synchronize(stream.device.torch_device)
    return hipSuccess


# --- the app: a Jacobi solver for -u'' = f on [0, 1], u(0) = u(1) = 0, ping-ponging two iterate buffers -------------

def run(variant: str, device: str = "cpu"):
    gen = generator(42)
    f_host = randn(N, gen=gen, device="cpu", scale=20.0)
    u0_host = randn(N, gen=gen, device="cpu")
    u0_host[0] = u0_host[-1] = 0.0

    def solve(graphed: bool):
        VARIANT["v"] = variant
        dev = Device(device)
        mem, stream = dev.mem, dev.NullStream()
        u = [mem.alloc(8 * N), mem.alloc(8 * N)]              # hipMalloc: the two iterates
        f, r = mem.alloc(8 * N), mem.alloc(8 * N)
        mem.write(f, f_host.tolist())                         # hipMemcpy H2D
        mem.write(u[0], u0_host.tolist())
        mem.write(u[1], u0_host.tolist())

        def sweep_params(k):
            return hipKernelNodeParams(jacobi, 1, N, [u[k % 2], u[(k + 1) % 2], f, H * H, N])

        def residual_params(k):
            return hipKernelNodeParams(residual, 1, N, [u[(k + 1) % 2], f, r, H * H, N])

        ge = sweep_node = residual_node = None
        if graphed:
            g = hipGraphCreate()
            sweep_node = hipGraphAddKernelNode(g, sweep_params(0), device)
            residual_node = hipGraphAddKernelNode(g, residual_params(0), device)
            views = {"u_a": mem.view(u[0], 8 * N), "u_b": mem.view(u[1], 8 * N), "r": mem.view(r, 8 * N)}
            ge = hipGraphInstantiate(g, dev, outputs=(views["r"], views["u_a"], views["u_b"]), static={},
                                     state={"u_a (iterate)": views["u_a"], "u_b (iterate)": views["u_b"]})
        outs = []
        for k in range(ITERS):
            if graphed:
                for node, params in ((sweep_node, sweep_params(k)), (residual_node, residual_params(k))):
                    status = hipGraphExecKernelNodeSetParams(ge, node, params)
                    assert status == hipSuccess, status
                hipGraphLaunch(ge, stream)
            else:
                for params in (sweep_params(k), residual_params(k)):
                    hipLaunchKernel(params.func, params.gridDim, params.blockDim, params.kernelParams, 0, stream)
            hipStreamSynchronize(stream)
            outs.append(mem.view(u[(k + 1) % 2], 8 * N).clone())   # hipMemcpy D2H: the new iterate
            outs.append(mem.view(r, 8 * N).clone())                # and its residual
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: solve(True), lambda: solve(False))
