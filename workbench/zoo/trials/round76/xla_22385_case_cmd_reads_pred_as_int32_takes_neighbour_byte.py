"""XLA's command-buffer CaseCmd reads a conditional's 1-byte ``pred`` as an int32: the next byte joins the index and the wrong branch runs.

Upstream: https://github.com/openxla/xla/pull/22385 ("[XLA:GPU] Fix test
ConditionalOpTest.SwappedInputsInSequentialConditionals failed when enabling command buffer.", merged
2025-02-17), with its follow-up https://github.com/openxla/xla/pull/23165 ("[XLA:GPU] fix case command buffer
operator data corruption issue when index is bool type", merged 2025-03-03) for the branch order.
Symptom: with CONDITIONAL in ``xla_gpu_enable_command_buffer``, two sequential ``pred`` conditionals (the first
forwards (x, y) if x < y and swaps it otherwise; the second swaps if x >= y and forwards otherwise: an identity
for every input) return (y, x) instead of (x, y) when x >= y: the PR's failure is ``actual (5.55, 11.24),
expected (11.24, 5.55)``. Nothing is raised; the call with x < y is right. Without command buffers the
``ConditionalThunk`` runs and every call is right.
Mechanism: ``command_buffer_cmd_emitter.cc`` ``Convert(const ConditionalThunk&)`` lowers a conditional to a
``CaseCmd`` whatever its index type, and ``CaseCmd::Record`` (``command_buffer_cmd.cc``) hands the index slice to
``command_buffer->Case(execution_scope_id, se::DeviceMemory<int32_t>(index), ...)``. In the graph, the branch is
chosen by ``set_case_condition`` (``command_buffer_kernels.cc``, launched by
``GpuCommandBuffer::Case`` -> ``LaunchSetCaseConditionKernel`` ahead of the conditional nodes), which does
``int32_t effective_index = *index - index_offset`` and activates the last handle for an index out of range.
A ``pred[]`` is one byte, so the kernel reads the predicate together with the three bytes after it: here the
second conditional's predicate, which buffer assignment put next to the first. With x >= y the first predicate
is 0 and the second 1, so the first kernel reads 0x00000100 = 256, out of range, and runs the last branch.
(``Convert`` also kept the branch order of an int32 index, ``{true, false}``, for a pred, where
``ConditionalThunk`` maps true to branch 0: both conditionals take the opposite branch when the bytes after
their predicate are zero, and in this program the two errors cancel; the extra byte breaks the
cancellation, which is how the PR's test caught it.) The eager ``ConditionalThunk::ExecuteOnStream`` copies
``sizeof(bool)`` bytes to the host and maps ``*pred ? 0 : 1``, so it is right.
Doctor: undersized-buffer, at Record (the graph's set-condition kernel reads a 4-byte index from the 1-byte
pred slice: data that does not fit the buffer it is read from, so the read runs past the slice into the next
buffer; the int32 view of the slice is made in ``CaseCmd::Record``, which the fix changed).
Fix (upstream): #22385: ``CaseCmd`` takes ``index_is_bool`` (from ``ConditionalThunk::branch_index_is_bool()``)
and ``Record`` passes ``se::DeviceMemory<bool>(index)``; ``GpuCommandBuffer::Case`` hands the kernel a
``uint8_t*`` and ``index_is_bool``, and the kernel loads one byte for a bool. #23165: ``Convert`` emits a pred's
branches in reverse order (``branch_thunks()[1]`` then ``[0]``), so index 0 (false) runs the false branch.
Modelled: one ``GpuExecutable`` whose thunk sequence is the test's ``main`` (two compare fusions, two
``ConditionalThunk``\\ s whose branches are tuple copies); with command buffers the whole sequence is one
``CommandBufferThunk`` recorded at the first call (``kit.capture``, no eager warmup) and replayed after. Buffer
allocations are byte tensors; slices are views of them. The two 1-byte predicates sit at byte offsets 0 and 1 of
the temp allocation (upstream's exact offsets are not known; XLA aligns slices, so there the extra bytes were
the slice's padding: this packing makes them a live neighbour, the same on every device). The kernel's 4-byte
load is a little-endian sum of the 4-byte window at the slice (torch cannot view an odd byte offset as int32).
A conditional node is a nested command buffer whose commands are predicated on its handle (the body runs only
when ``set_case_condition`` set the handle). Arguments are copied into fixed parameter allocations, so the
recorded graph is never updated (``ShouldUpdateCommandBuffer``, execution scopes, branch batching past 8 and
streams are not modelled).
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, replay

UPSTREAM = "https://github.com/openxla/xla/pull/22385"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "Record"
SYMPTOM = ("in the command buffer a conditional's 1-byte pred is read as an int32 by the set-condition kernel: the "
           "next byte (the second conditional's pred) joins the index and sequential conditionals return swapped "
           "outputs")

VARIANT = {"v": "bug"}
WORKLOAD = ((3.11, 9.4), (11.24, 5.55), (0.5, 4.0), (6.5, 3.0), (7.5, 1.25), (1.5, 6.0))


# --- xla/service/buffer_assignment.h -------------------------------------------------------------------------

class BufferAllocation:
    def __init__(self, index: int, size: int):
        self.index, self.size = index, size

    class Slice:
        def __init__(self, allocation: "BufferAllocation", offset: int, size: int):
            self.allocation, self.offset, self.size = allocation, offset, size

    def slice(self, offset: int, size: int) -> "BufferAllocation.Slice":
        return BufferAllocation.Slice(self, offset, size)


# --- xla/stream_executor/device_memory.h ---------------------------------------------------------------------

class DeviceMemoryBase:
    """An address and a size: here the allocation's bytes and an offset into them."""

    def __init__(self, base: torch.Tensor, offset: int, size: int):
        self.base, self.offset, self.size = base, offset, size

    def bytes(self) -> torch.Tensor:
        return self.base[self.offset:self.offset + self.size]


class DeviceMemory(DeviceMemoryBase):
    """``se::DeviceMemory<T>``: the same address, typed; a kernel dereferencing it loads ``sizeof(T)`` bytes."""

    def __init__(self, base: DeviceMemoryBase, element_type: torch.dtype):
        super().__init__(base.base, base.offset, base.size)
        self.element_type = element_type
        width = element_type.itemsize
        self.element = base.base[base.offset:base.offset + width]   # what ``*ptr`` reads

    @staticmethod
    def MakeFromByteSize(memory: "DeviceMemory", element_type: torch.dtype) -> "DeviceMemory":
        return DeviceMemory(memory, element_type)


def f32(memory: DeviceMemoryBase) -> torch.Tensor:
    return memory.bytes().view(torch.float32)


# --- xla/service/gpu/buffer_allocations.h --------------------------------------------------------------------

class BufferAllocations:
    def __init__(self, buffers: list[torch.Tensor]):
        self.buffers = buffers

    def GetDeviceAddress(self, buffer_slice: BufferAllocation.Slice) -> DeviceMemoryBase:
        return DeviceMemoryBase(self.buffers[buffer_slice.allocation.index], buffer_slice.offset, buffer_slice.size)


class ExecuteParams:
    def __init__(self, buffer_allocations: BufferAllocations):
        self.buffer_allocations = buffer_allocations


# --- xla/stream_executor/cuda/command_buffer_kernels.cc: set_case_condition ----------------------------------

def set_case_condition(handles: torch.Tensor, index: DeviceMemory, index_is_bool: bool, index_offset: int,
                       num_handles: int, enable_default_condition: bool) -> None:
    """Sets ``handles[effective_index] = 1`` and the others to 0; the last handle for an index out of range."""
    loaded = index.element.to(torch.int32)                 # the bytes the load covers, little-endian
    if index_is_bool:
        index_int32 = loaded[0]                             # static_cast<int32_t>(*reinterpret_cast<bool*>(index))
    else:
        index_int32 = loaded[0] | (loaded[1] << 8) | (loaded[2] << 16) | (loaded[3] << 24)   # *(int32_t*)index
    effective_index = index_int32 - index_offset
    if enable_default_condition:
        out_of_range = (index_int32 < 0) | (effective_index >= num_handles)
        effective_index = torch.where(out_of_range, torch.full_like(effective_index, num_handles - 1),
                                      effective_index)
    lanes = torch.arange(num_handles, device=handles.device)
    handles.copy_((lanes == effective_index).to(torch.int32))      # cudaGraphSetConditional(handles[i], ...)


# --- xla/stream_executor/gpu/gpu_command_buffer.cc -----------------------------------------------------------

class GpuCommandBuffer:
    """A command buffer; a nested one (a conditional node's body) runs its commands only when its handle is set."""

    def __init__(self, device, conditional: torch.Tensor | None = None):
        self.device, self.conditional = device, conditional

    def Launch(self, kernel, *args) -> None:
        kernel(*args)

    def MemcpyDeviceToDevice(self, dst: DeviceMemoryBase, src: DeviceMemoryBase, size: int) -> None:
        d, s = dst.bytes()[:size], src.bytes()[:size]
        if self.conditional is None:
            d.copy_(s)
        else:
            d.copy_(torch.where(self.conditional != 0, s, d))

    def Case(self, execution_scope_id, index: DeviceMemory, branches) -> None:
        if VARIANT["v"] == "fix":                           # PR #22385: Case(DeviceMemory<bool>) / Case(<int32_t>)
            index_is_bool = index.element_type == torch.bool
            index = DeviceMemory.MakeFromByteSize(index, torch.uint8 if index_is_bool else torch.int32)
        else:
            index_is_bool = False
        conditionals = torch.zeros(len(branches), dtype=torch.int32, device=self.device)  # CreateConditionalNode
        self.LaunchSetCaseConditionKernel(execution_scope_id, conditionals, index, index_is_bool, 0, True)
        for i, builder in enumerate(branches):
            builder(GpuCommandBuffer(self.device, conditional=conditionals[i]))

    def LaunchSetCaseConditionKernel(self, execution_scope_id, conditionals, index, index_is_bool, batch_offset,
                                     enable_conditional_default) -> None:
        set_case_condition(conditionals, index, index_is_bool, batch_offset, conditionals.numel(),
                           enable_conditional_default)


# --- xla/backends/gpu/runtime/thunk.h and friends (the eager path) ------------------------------------------

class KernelThunk:
    def __init__(self, kernel, args: list[BufferAllocation.Slice]):
        self.kernel, self.args = kernel, args

    def ExecuteOnStream(self, params: ExecuteParams) -> None:
        self.kernel(*(params.buffer_allocations.GetDeviceAddress(a) for a in self.args))


class DeviceToDeviceCopyThunk:
    def __init__(self, source_buffer, destination_buffer, mem_size: int):
        self.source_buffer, self.destination_buffer, self.mem_size = source_buffer, destination_buffer, mem_size

    def ExecuteOnStream(self, params: ExecuteParams) -> None:
        alloc = params.buffer_allocations
        alloc.GetDeviceAddress(self.destination_buffer).bytes().copy_(alloc.GetDeviceAddress(self.source_buffer).bytes())


class SequentialThunk:
    def __init__(self, thunks):
        self._thunks = thunks

    def thunks(self):
        return self._thunks

    def ExecuteOnStream(self, params: ExecuteParams) -> None:
        for thunk in self._thunks:
            thunk.ExecuteOnStream(params)


class ConditionalThunkConfig:
    def __init__(self, branch_index_is_bool: bool, branch_thunks: list[SequentialThunk]):
        self.branch_index_is_bool = branch_index_is_bool
        self.branch_count = len(branch_thunks)
        self.branch_thunks = branch_thunks


class ConditionalThunk:
    """Branches in HLO order: for a pred, ``{true_computation, false_computation}``."""

    def __init__(self, config: ConditionalThunkConfig, branch_index_buffer_index: BufferAllocation.Slice):
        self.config_ = config
        self.branch_index_buffer_index_ = branch_index_buffer_index
        self.execution_stream_id = 0

    def branch_index_buffer(self):
        return self.branch_index_buffer_index_

    def branch_thunks(self):
        return self.config_.branch_thunks

    def branch_index_is_bool(self) -> bool:
        return self.config_.branch_index_is_bool

    def ExecuteOnStream(self, params: ExecuteParams) -> None:
        address = params.buffer_allocations.GetDeviceAddress(self.branch_index_buffer_index_)
        if self.config_.branch_index_is_bool:          # Memcpy sizeof(bool) to the host, then *pred ? 0 : 1
            branch_index = 0 if bool(address.bytes()[:1].item()) else 1
        else:
            branch_index = int(address.bytes()[:4].view(torch.int32).item())
        if branch_index < 0 or branch_index >= self.config_.branch_count:
            branch_index = self.config_.branch_count - 1
        self.config_.branch_thunks[branch_index].ExecuteOnStream(params)


# --- xla/backends/gpu/runtime/command_buffer_cmd.{h,cc} -----------------------------------------------------

class LaunchCmd:
    def __init__(self, kernel, args):
        self.kernel, self.args = kernel, args

    def Record(self, execute_params: ExecuteParams, command_buffer: GpuCommandBuffer) -> None:
        command_buffer.Launch(self.kernel, *(execute_params.buffer_allocations.GetDeviceAddress(a) for a in self.args))


class MemcpyDeviceToDeviceCmd:
    def __init__(self, dst, src, num_bytes: int):
        self.dst_, self.src_, self.num_bytes_ = dst, src, num_bytes

    def Record(self, execute_params: ExecuteParams, command_buffer: GpuCommandBuffer) -> None:
        alloc = execute_params.buffer_allocations
        command_buffer.MemcpyDeviceToDevice(alloc.GetDeviceAddress(self.dst_), alloc.GetDeviceAddress(self.src_),
                                            self.num_bytes_)


class CommandBufferCmdSequence(list):
    def Record(self, execute_params: ExecuteParams, command_buffer: GpuCommandBuffer) -> None:
        for cmd in self:
            cmd.Record(execute_params, command_buffer)


def CreateBuilders(branches_commands, execute_params):
    return [lambda cb, cmds=cmds: cmds.Record(execute_params, cb) for cmds in branches_commands]


class CaseCmd:
    def __init__(self, execution_stream_id, index: BufferAllocation.Slice, index_is_bool: bool,
                 branches_commands: list[CommandBufferCmdSequence]):
        self.index_ = index
        self.index_is_bool_ = index_is_bool
        self.branches_commands_ = branches_commands

    def Record(self, execute_params: ExecuteParams, command_buffer: GpuCommandBuffer) -> None:
        index = execute_params.buffer_allocations.GetDeviceAddress(self.index_)
        execution_scope_id = 0
        if VARIANT["v"] == "fix" and self.index_is_bool_:          # PR #22385
            return command_buffer.Case(execution_scope_id, DeviceMemory(index, torch.bool),
                                       CreateBuilders(self.branches_commands_, execute_params))
        return command_buffer.Case(execution_scope_id, DeviceMemory(index, torch.int32),
                                   CreateBuilders(self.branches_commands_, execute_params))


# --- xla/backends/gpu/runtime/command_buffer_cmd_emitter.cc -------------------------------------------------

def ConvertToCommands(thunks) -> CommandBufferCmdSequence:
    cmds = CommandBufferCmdSequence()
    for thunk in thunks:
        cmds.append(Convert(thunk))
    return cmds


def Convert(thunk):
    if isinstance(thunk, KernelThunk):
        return LaunchCmd(thunk.kernel, thunk.args)
    if isinstance(thunk, DeviceToDeviceCopyThunk):
        return MemcpyDeviceToDeviceCmd(thunk.destination_buffer, thunk.source_buffer, thunk.mem_size)
    assert isinstance(thunk, ConditionalThunk)
    if VARIANT["v"] == "fix" and thunk.branch_index_is_bool():     # PR #23165: {false, true} for a pred
        branch_cmds = [ConvertToCommands(thunk.branch_thunks()[1].thunks()),
                       ConvertToCommands(thunk.branch_thunks()[0].thunks())]
    else:
        branch_cmds = [ConvertToCommands(b.thunks()) for b in thunk.branch_thunks()]
    index_is_bool = thunk.branch_index_is_bool() if VARIANT["v"] == "fix" else False
    return CaseCmd(thunk.execution_stream_id, thunk.branch_index_buffer(), index_is_bool, branch_cmds)


# --- xla/backends/gpu/runtime/command_buffer_thunk.cc -------------------------------------------------------

class CommandBufferThunk:
    """Records its commands into a graph at the first execution and replays that graph afterwards."""

    def __init__(self, commands: CommandBufferCmdSequence, output: BufferAllocation.Slice,
                 static_parameters: dict):
        self.commands_, self.output_, self.static_parameters_ = commands, output, static_parameters
        self.command_buffer = None                         # ExecutorCommandBuffer (one executor here)

    def ExecuteOnStream(self, params: ExecuteParams, device) -> None:
        if self.command_buffer is None:
            out = f32(params.buffer_allocations.GetDeviceAddress(self.output_))

            def record():
                self.commands_.Record(params, GpuCommandBuffer(device))
                return out

            self.command_buffer = capture(record, device=device, warmups=0, name="command buffer (main)",
                                          owner="CommandBufferThunk", static=self.static_parameters_)
        graph, outputs = self.command_buffer
        replay(graph, outputs)


# --- the program: ConditionalOpTest.SwappedInputsInSequentialConditionals ------------------------------------

def lt_fusion(x, y, pred):                  # compare(x, y), direction=LT -> pred[]
    pred.bytes().copy_((f32(x) < f32(y)).to(torch.uint8))


def ge_fusion(x, y, pred):                  # compare(x, y), direction=GE -> pred[]
    pred.bytes().copy_((f32(x) >= f32(y)).to(torch.uint8))


class GpuExecutable:
    def __init__(self, device, enable_command_buffer: bool):
        self.device = device
        param_x, param_y, temp, result = (BufferAllocation(0, 4), BufferAllocation(1, 4), BufferAllocation(2, 16),
                                          BufferAllocation(3, 8))
        x, y = param_x.slice(0, 4), param_y.slice(0, 4)
        lt_pred, ge_pred = temp.slice(0, 1), temp.slice(1, 1)          # two pred[] packed side by side
        res = (temp.slice(8, 4), temp.slice(12, 4))                     # the first conditional's tuple
        out = (result.slice(0, 4), result.slice(4, 4))
        self.output = result.slice(0, 8)

        def forwarder(src, dst):
            return SequentialThunk([DeviceToDeviceCopyThunk(src[0], dst[0], 4),
                                    DeviceToDeviceCopyThunk(src[1], dst[1], 4)])

        def swapper(src, dst):
            return SequentialThunk([DeviceToDeviceCopyThunk(src[1], dst[0], 4),
                                    DeviceToDeviceCopyThunk(src[0], dst[1], 4)])

        thunks = [
            KernelThunk(lt_fusion, [x, y, lt_pred]),
            KernelThunk(ge_fusion, [x, y, ge_pred]),
            # Conditional(lt, (x, y), forwarder, (x, y), swapper)
            ConditionalThunk(ConditionalThunkConfig(True, [forwarder((x, y), res), swapper((x, y), res)]), lt_pred),
            # Conditional(ge, res, swapper, res, forwarder)
            ConditionalThunk(ConditionalThunkConfig(True, [swapper(res, out), forwarder(res, out)]), ge_pred),
        ]
        self.buffers = [torch.zeros(a.size, dtype=torch.uint8, device=device)
                        for a in (param_x, param_y, temp, result)]
        self.params = ExecuteParams(BufferAllocations(self.buffers))
        if enable_command_buffer:
            static = {"parameter 0 (x)": self.buffers[0], "parameter 1 (y)": self.buffers[1]}
            self.thunks = [CommandBufferThunk(ConvertToCommands(thunks), self.output, static)]
        else:
            self.thunks = thunks

    def ExecuteAsyncOnStream(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.buffers[0].view(torch.float32).copy_(x)
        self.buffers[1].view(torch.float32).copy_(y)
        for thunk in self.thunks:
            if isinstance(thunk, CommandBufferThunk):
                thunk.ExecuteOnStream(self.params, self.device)
            else:
                thunk.ExecuteOnStream(self.params)
        return f32(self.params.buffer_allocations.GetDeviceAddress(self.output)).clone()


def run(variant: str, device: str = "cpu"):
    VARIANT["v"] = variant
    args = [(torch.tensor([a], dtype=torch.float32).to(device), torch.tensor([b], dtype=torch.float32).to(device))
            for a, b in WORKLOAD]

    def serve(enable_command_buffer):
        executable = GpuExecutable(device, enable_command_buffer)
        return [executable.ExecuteAsyncOnStream(x, y) for x, y in args]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
