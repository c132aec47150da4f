"""The Mosaic GPU custom call (``mosaic_gpu_v2``, command-buffer compatible) built its collective metadata in the FFI execute stage: once XLA records the call into a command buffer, the metadata's host-to-device copies and ``BlockHostUntilDone`` run inside the stream capture, and the capture fails.

Upstream: https://github.com/jax-ml/jax/commit/b19be1aa34969e312b7ec30abbae828ec35e1d12 ("Move collective metadata
initialization to the Initialize stage of the Mosaic GPU custom call.", jax-ml/jax, committed 2026-01-26 to main,
PiperOrigin-RevId 861057852). Read: the commit message and its whole diff (``jaxlib/mosaic/gpu/custom_call.cc``:
``ConstructKernelBuffers`` -> ``GetBuffers`` + ``MosaicGpuInitialize``, handler registration); the parent's
``custom_call.cc`` (``MosaicGpuExecute`` bound with ``kCmdBufferCompatible``, the ``TODO(b/477485739): Move this to
the initialization stage``, ``MosaicGpuPrepare``, ``MosaicGPUCustomCallImpl``); the commits that made the call
command-buffer compatible (70c7ed3235: "it must only launch the kernel itself on device, since everything it
launches will be captured in the command buffer") and that introduced the metadata (039e00d2a3: "In single-process
multi-device configurations, the Mosaic custom call can collect pointers for each parameter across all local
devices into ... 'collective metadata'"; ``launch_context.py``: ``COLLECTIVE_METADATA_SIZE = 3``, the metadata is an
extra s64 result read by the kernel for its rank and peer addresses); 0b31d9c36d ("Enable cuda-graphs with collective
metadata": ``gpu_pallas_distributed_test.py`` stops forcing ``--xla_gpu_enable_command_buffer=''`` for the
non-NVSHMEM path, whose TODO read "re-enable once command buffers supported with collectives"). XLA (stored
version): ``collective_metadata_thunk.cc`` (``ConstructAndReturnCollectiveMetadata``: ``GpuCliqueRendezvous::Join``
of the parameters, a host ``CollectiveKernelMetadata`` and pointer table, two ``stream->Memcpy`` from host memory,
``stream->BlockHostUntilDone()``; ``CollectiveMetadataThunk::Initialize`` builds it there) and
``command_buffer_cmd.cc`` (a custom call is recorded by tracing its handler under stream capture).
Symptom: a Pallas:MGPU multi-device kernel (single process, ``uses_xla_collective_metadata``) run with XLA command
buffers on (custom calls are recorded by default) fails on its first execution while the command buffer is
recorded; the distributed tests had to run with command buffers off (the commit states no symptom: this is read
from the removed execute-stage code, the TODO it resolves and the test change that followed).
Mechanism: ``MosaicGpuExecute`` calls ``ConstructKernelBuffers``, which, for a module using collective metadata,
calls ``CollectiveMetadataThunk::ConstructCollectiveMetadata`` on the execute stream: it joins the clique's
rendezvous, fills a host ``CollectiveKernelMetadata`` and a host table of peer pointers, copies both to the
metadata result buffer with ``stream->Memcpy`` from host memory and waits with ``BlockHostUntilDone``. The handler is
``kCmdBufferCompatible``, so XLA records it by tracing the execute stage under stream capture: a copy from pageable
host memory and a stream synchronisation are not capturable, and recording fails.
Doctor: sync-in-capture, at ConstructKernelBuffers. The metadata's host copies and host wait are issued from the
execute stage while the command buffer is being captured; the fix builds the metadata in the initialize stage,
which XLA runs on the stream before recording.
Fix (upstream): a new ``MosaicGpuInitialize`` (``BindInitialize`` with the stream, collective params and cliques,
``kCmdBufferCompatible``) builds the collective metadata; ``MosaicGpuExecute`` only collects the buffers
(``GetBuffers``) and launches; the handler bundle registers ``initialize=kMosaicGpuInitialize``.
Modelled: ``ConstructKernelBuffers`` / ``GetBuffers`` / ``MosaicGpuInitialize`` / ``MosaicGpuExecute`` /
``MosaicGpuPrepare`` / ``MosaicGPUCustomCallImpl`` (``CachedCompile``), XLA's ``ConstructAndReturnCollectiveMetadata``
(rendezvous, host metadata, the two copies, the host wait), ``GpuCliqueRendezvous``, the FFI bundle,
``CustomCallThunk`` (stages), ``CommandBufferCmdSequence`` (its commands' initialize stages run on the stream before
recording, then it records by tracing the thunks), ``CommandBuffer``, ``CommandBufferThunk`` and
``GpuExecutable::ExecuteThunks``, for a step: scale fusion -> Pallas:MGPU kernel that adds a peer's copy of its input (``to_remote``) -> projection +
residual fusion. Stand-ins: device memory is one flat heap tensor and a device pointer is an offset into it, so the
kernel dereferences the metadata's pointer table on the device (a gather); the mesh has one local device (clique of
one: the rendezvous returns at once, the peer is the device itself); ``stream->Memcpy`` from host memory is a
``copy_`` of a tensor made from Python data and ``BlockHostUntilDone`` is ``synchronize``, both refused by the engine
in a capture as CUDA refuses them. Allocations keep their addresses, so the command buffer is never updated. The
eager reference is the executable with command buffers off.
Workload: 4 executions of the step (batch 3, width 4), each with a new input. Bug: the first execution raises the
emulation's CaptureError while the command buffer is recorded, as upstream. Fix: all 4 steps equal eager (max
error 0).
"""
from __future__ import annotations

import enum

import torch

from workbench.engine import synchronize
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/jax-ml/jax/commit/b19be1aa34969e312b7ec30abbae828ec35e1d12"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "ConstructKernelBuffers"
SYMPTOM = ("Pallas:MGPU kernel with collective metadata under XLA command buffers: the execute stage copies the "
           "host-built metadata to the device and blocks on the stream inside the capture, so recording fails")

BATCH, WIDTH = 3, 4
NUM_DEVICES = 1                      # local devices of the single process (the clique)
COLLECTIVE_METADATA_SIZE = 3         # rank, param_to_peers, multicast_buffer_ptr
STEPS = 4

_variant = "bug"


# --- device memory: one heap, pointers are offsets into it -----------------------------------------------------

class DeviceHeap:
    def __init__(self, size: int, device: str):
        self.memory = torch.zeros(size, device=device)
        self.top = 0

    def Allocate(self, numel: int) -> "DeviceAddressBase":
        address = DeviceAddressBase(self, self.top, numel)
        self.top += numel
        return address


class DeviceAddressBase:
    def __init__(self, heap: DeviceHeap, opaque: int, numel: int):
        self.heap, self._opaque, self.numel = heap, opaque, numel

    def opaque(self) -> int:
        return self._opaque

    def view(self, *shape) -> torch.Tensor:
        return self.heap.memory[self._opaque:self._opaque + self.numel].view(*shape)


# --- xla/backends/gpu: clique rendezvous and collective metadata --------------------------------------------------

class GpuCliqueRendezvous:
    """``Join``: every rank of the clique arrives with its parameters; all get everyone's (one local device here)."""

    arrivals: dict = {}

    @classmethod
    def Join(cls, clique_key: tuple, rank: int, parameters: list) -> dict:
        cls.arrivals.setdefault(clique_key, {})[rank] = parameters
        assert len(cls.arrivals[clique_key]) == NUM_DEVICES     # all ranks arrived (a host barrier)
        return cls.arrivals.pop(clique_key)


def ConstructAndReturnCollectiveMetadata(clique_key, rank, stream, parameters, destination: torch.Tensor):
    num_parameters = len(parameters)
    device_parameters = GpuCliqueRendezvous.Join(clique_key, rank, parameters)
    param_to_peers_ptrs = [device_parameters[peer][parameter].opaque()
                           for parameter in range(num_parameters) for peer in range(NUM_DEVICES)]
    metadata = [rank, COLLECTIVE_METADATA_SIZE, 0]             # CollectiveKernelMetadata{rank, param_to_peers, mc}
    # stream->Memcpy(&destination, &metadata, ...); stream->Memcpy(&param_to_peers_ptrs_buffer, ...)
    destination[:COLLECTIVE_METADATA_SIZE].copy_(torch.tensor(metadata, dtype=torch.int64))
    destination[COLLECTIVE_METADATA_SIZE:].copy_(torch.tensor(param_to_peers_ptrs, dtype=torch.int64))
    synchronize(stream.device)                                  # stream->BlockHostUntilDone()
    return metadata


def ConstructCollectiveMetadata(clique_key, rank, stream, parameters, destination) -> None:
    ConstructAndReturnCollectiveMetadata(clique_key, rank, stream, parameters, destination)


def GetCliqueKeyForAllDevices(collective_params) -> tuple:
    return ("clique", tuple(range(collective_params.num_devices)))


# --- jaxlib/mosaic/gpu/custom_call.cc ----------------------------------------------------------------------------

class CompiledKernel:
    """The Pallas:MGPU kernel: ``out = x + to_remote(x, peer=(rank + 1) % num_peers)``, pointers from the metadata."""

    def host_launch(self, stream, buffers) -> None:
        x, out, collective_metadata = buffers                   # device addresses; the metadata is an s64 buffer
        heap = x.heap.memory
        rank = collective_metadata[0:1]                          # all read on the device
        table = collective_metadata[COLLECTIVE_METADATA_SIZE:]   # param_to_peers: P0R0 .. P0Rn P1R0 ..
        peer = (rank + 1) % NUM_DEVICES
        lanes = torch.arange(x.numel, device=heap.device)
        local_x = heap.index_select(0, table.index_select(0, rank) + lanes)       # parameter 0 on this rank
        remote_x = heap.index_select(0, table.index_select(0, peer) + lanes)      # to_remote(x, peer)
        out_ptr = table.index_select(0, NUM_DEVICES + rank)                       # parameter 1 on this rank
        heap.index_copy_(0, out_ptr + lanes, local_x + remote_x)


_kernel_cache: dict = {}


def CachedCompile(kernel_hash: str) -> CompiledKernel:
    if kernel_hash not in _kernel_cache:
        _kernel_cache[kernel_hash] = CompiledKernel()
    return _kernel_cache[kernel_hash]


def MosaicGPUCustomCallImpl(stream, buffers, kernel_hash: str) -> None:
    kernel = CachedCompile(kernel_hash)
    kernel.host_launch(stream, buffers)


def ModuleUsesCollectiveMetadata(attrs: dict) -> bool:
    return attrs.get("uses_xla_collective_metadata", False)


def ConstructKernelBuffers(collective_params, stream, uses_collective_metadata, inputs, results):
    buffers = [*inputs, *results]
    if _variant == "bug" and uses_collective_metadata:
        # When several devices handled with a single process we also need to construct the collective
        # metadata and store it to the last buffer.  TODO(b/477485739): Move this to the initialization stage.
        parameters = buffers[:-1]
        collective_metadata_ptr = results[-1]
        clique_key = GetCliqueKeyForAllDevices(collective_params)
        ConstructCollectiveMetadata(clique_key, collective_params.global_device_id, stream, parameters,
                                    collective_metadata_ptr)
    return buffers


def GetBuffers(inputs, results):
    return [*inputs, *results]


def MosaicGpuInitialize(stream, collective_params, inputs, results, attributes) -> None:
    if not ModuleUsesCollectiveMetadata(attributes):
        return
    buffers = GetBuffers(inputs, results)
    clique_key = GetCliqueKeyForAllDevices(collective_params)
    ConstructCollectiveMetadata(clique_key, collective_params.global_device_id, stream, buffers[:-1], buffers[-1])


def MosaicGpuExecute(stream, collective_params, inputs, results, attributes) -> None:
    buffers = ConstructKernelBuffers(collective_params, stream, ModuleUsesCollectiveMetadata(attributes),
                                     inputs, results)
    MosaicGPUCustomCallImpl(stream, buffers, attributes["kernel_hash"])


def MosaicGpuPrepare(collective_params, clique_requests: list, attributes) -> None:
    if ModuleUsesCollectiveMetadata(attributes):
        clique_requests.append(GetCliqueKeyForAllDevices(collective_params))


def mosaic_gpu_v2_bundle() -> dict:
    """XLA_FFI_REGISTER_HANDLER(..., "mosaic_gpu_v2", "CUDA", {instantiate, prepare, initialize, execute})."""
    if _variant == "bug":
        return {"prepare": MosaicGpuPrepare, "initialize": None, "execute": MosaicGpuExecute}
    return {"prepare": MosaicGpuPrepare, "initialize": MosaicGpuInitialize, "execute": MosaicGpuExecute}


# --- xla/backends/gpu/runtime: thunks ----------------------------------------------------------------------------

class Stream:
    def __init__(self, device: str):
        self.device = device


class CollectiveParams:
    def __init__(self, global_device_id: int, num_devices: int):
        self.global_device_id, self.num_devices = global_device_id, num_devices


class ExecuteParams:
    def __init__(self, buffer_allocations: dict, stream: Stream, collective_params: CollectiveParams):
        self.buffer_allocations, self.stream, self.collective_params = buffer_allocations, stream, collective_params


class KernelThunk:
    def __init__(self, name, fn, operands, result):
        self.name, self.fn, self.operands, self.result = name, fn, operands, result

    def Prepare(self, params: ExecuteParams, clique_requests: list) -> None:
        pass

    def Initialize(self, params: ExecuteParams) -> None:
        pass

    def ExecuteOnStream(self, params: ExecuteParams) -> None:
        allocs = params.buffer_allocations
        allocs[self.result].view(BATCH, WIDTH).copy_(self.fn(*(allocs[o].view(BATCH, WIDTH) for o in self.operands)))


class CustomCallThunk:
    """An FFI custom call: the bundle's stages, each given what its binding asks for."""

    def __init__(self, bundle: dict, operands, results, attributes: dict):
        self.bundle_, self.operands_, self.results_, self.attributes_ = bundle, operands, results, attributes

    def Prepare(self, params: ExecuteParams, clique_requests: list) -> None:
        if self.bundle_["prepare"] is not None:
            self.bundle_["prepare"](params.collective_params, clique_requests, self.attributes_)

    def _args(self, params: ExecuteParams):
        allocs = params.buffer_allocations
        return ([allocs[name] for name in self.operands_],
                [allocs[name] for name in self.results_])

    def Initialize(self, params: ExecuteParams) -> None:
        if self.bundle_["initialize"] is not None:
            inputs, results = self._args(params)
            self.bundle_["initialize"](params.stream, params.collective_params, inputs, results, self.attributes_)

    def ExecuteOnStream(self, params: ExecuteParams) -> None:
        inputs, results = self._args(params)
        self.bundle_["execute"](params.stream, params.collective_params, inputs, results, self.attributes_)


class CommandBufferCmdSequence:
    """Kernel commands and a custom-call command (its execute stage traced under stream capture)."""

    def __init__(self, commands):
        self.commands = list(commands)

    def Initialize(self, params: ExecuteParams) -> None:
        for cmd in self.commands:                     # a custom-call command runs its initialize stage here
            cmd.Initialize(params)

    def Record(self, params: ExecuteParams, command_buffer: "CommandBuffer", static) -> None:
        def trace():
            for cmd in self.commands:
                cmd.ExecuteOnStream(params)
            return command_buffer.result.view(BATCH, WIDTH)
        command_buffer.graph, command_buffer.outputs = capture(
            trace, device=params.stream.device, warmups=0, name="command buffer", owner="CommandBufferThunk",
            static=static, capture_error_mode="thread_local")
        command_buffer.state = CommandBuffer.State.kFinalized


class CommandBuffer:
    class State(enum.Enum):
        kCreate = "create"
        kFinalized = "finalized"

    def __init__(self, result: DeviceAddressBase):
        self.result = result
        self.state = CommandBuffer.State.kCreate
        self.graph, self.outputs = None, None


class CommandBufferThunk:
    def __init__(self, commands: CommandBufferCmdSequence, thunks, result: DeviceAddressBase, static: dict):
        self.commands_, self.thunks_ = commands, thunks
        self.command_buffer = CommandBuffer(result)
        self.static = static

    def Prepare(self, params: ExecuteParams, clique_requests: list) -> None:
        for thunk in self.thunks_:
            thunk.Prepare(params, clique_requests)

    def Initialize(self, params: ExecuteParams) -> None:
        self.commands_.Initialize(params)
        if self.command_buffer.state is CommandBuffer.State.kCreate:     # never recorded: record before execution
            self.commands_.Record(params, self.command_buffer, self.static)

    def ExecuteOnStream(self, params: ExecuteParams) -> None:
        replay(self.command_buffer.graph, self.command_buffer.outputs)     # executor->Submit(stream, cmd_buffer)


# --- xla/service/gpu/gpu_executable.cc: the jitted shard_map'd step ------------------------------------------------

class GpuExecutable:
    """scale fusion -> mosaic_gpu_v2 (collective metadata as its last result) -> projection + residual fusion."""

    def __init__(self, device: str, enable_command_buffer: bool):
        gen = generator(1041)
        self.device = device
        n = BATCH * WIDTH
        heap = DeviceHeap(6 * n, device)
        self.allocs = {name: heap.Allocate(n) for name in ("x", "a", "out", "y")}
        self.allocs["w"] = heap.Allocate(WIDTH * WIDTH)
        self.allocs["w"].view(WIDTH, WIDTH).copy_(randn(WIDTH, WIDTH, gen=gen, device=device, scale=WIDTH ** -0.5))
        self.allocs["collective_metadata"] = torch.zeros(COLLECTIVE_METADATA_SIZE + 2 * NUM_DEVICES,
                                                         dtype=torch.int64, device=device)
        self.stream = Stream(device)
        self.collective_params = CollectiveParams(global_device_id=0, num_devices=NUM_DEVICES)
        attributes = {"kernel_hash": "pallas_mgpu_add_remote", "module": "<serialized MLIR>",
                      "use_custom_barrier": False, "uses_xla_collective_metadata": True}
        w = self.allocs["w"].view(WIDTH, WIDTH)
        thunks = [
            KernelThunk("scale_fusion", lambda x: 0.5 * x + 1.0, ("x",), "a"),
            CustomCallThunk(mosaic_gpu_v2_bundle(), ("a",), ("out", "collective_metadata"), attributes),
            KernelThunk("projection_residual_fusion", lambda out, x: out @ w + x, ("out", "x"), "y"),
        ]
        if enable_command_buffer:        # --xla_gpu_enable_command_buffer (FUSION, CUSTOM_CALL, ...)
            static = {"x": self.allocs["x"].view(BATCH, WIDTH)}
            self.thunk_sequence = [CommandBufferThunk(CommandBufferCmdSequence(thunks), thunks, self.allocs["y"],
                                                      static)]
        else:
            self.thunk_sequence = thunks

    def ExecuteThunks(self, x: torch.Tensor) -> torch.Tensor:
        self.allocs["x"].view(BATCH, WIDTH).copy_(x)
        params = ExecuteParams(self.allocs, self.stream, self.collective_params)
        clique_requests: list = []
        for thunk in self.thunk_sequence:
            thunk.Prepare(params, clique_requests)
        for thunk in self.thunk_sequence:
            thunk.Initialize(params)
        for thunk in self.thunk_sequence:
            thunk.ExecuteOnStream(params)
        return self.allocs["y"].view(BATCH, WIDTH).clone()


def steps(device: str):
    gen = generator(13)
    return [randn(BATCH, WIDTH, gen=gen, device=device) for _ in range(STEPS)]


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    batches = steps(device)

    def serve(enable_command_buffer: bool):
        executable = GpuExecutable(device, enable_command_buffer)
        return [executable.ExecuteThunks(x) for x in batches]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
