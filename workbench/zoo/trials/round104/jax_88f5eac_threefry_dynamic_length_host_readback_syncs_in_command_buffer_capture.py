"""jaxlib's ``cu_threefry2x32`` custom call, lowered with a dynamic length (descriptor ``n = -1``), copies the length operand to the host and synchronises the stream before launching; once XLA records the call into a command buffer that readback runs inside the stream capture, and the capture fails.

Upstream: https://github.com/jax-ml/jax/commit/88f5eaca3e01c1ae5f30c722d138b7ba3e0457f0 ("[xla:gpu] Make
cu_threefry2x32 custom call compatible with command buffers", jax-ml/jax, Anlun Xu, committed 2024-01-23 to main,
PiperOrigin-RevId 600937786). Read: the commit message and its whole diff (``jaxlib/gpu/prng_kernels.cu.cc``); at
the parent: ``jaxlib/gpu/prng_kernels.cu.cc`` (``ThreeFry2x32Kernel``, ``LaunchThreeFry2x32Kernel``),
``jaxlib/gpu/prng_kernels.cc`` (``ThreeFry2x32`` / ``ThreeFry2x32_``: the legacy status-returning custom call,
``UnpackDescriptor``, ``gpuGetLastError``), ``jaxlib/gpu_prng.py`` (``_threefry2x32_lowering``: a non-constant
length gives ``threefry2x32_descriptor(-1)`` and an extra ``i64[1]`` length operand), ``jax/_src/prng.py``
(``_threefry2x32_gpu_lowering``: the length is ``eval_dynamic_shape_as_tensor`` when ``out_len`` is not a constant
dimension, i.e. under shape polymorphism; ``threefry_2x32``: the iota split in two halves). XLA (a later stored
version): ``command_buffer_cmd.cc`` (``CustomCallCmd::RecordLegacyCustomCall`` traces ``call_target_(stream,
buffers, opaque, ...)`` under stream capture into a nested command buffer), ``command_buffer_scheduling.cc``
(``IsCommand(const HloCustomCallInstruction*)``: legacy targets enter command buffers when enabled).
Symptom: a JAX step using ``jax.random`` whose bit count is a symbolic dimension (a ``jax.export`` / jax2tf
shape-polymorphic module, refined to a concrete batch when compiled), run by XLA:GPU with custom calls recorded into
command buffers, fails on its first execution while the command buffer is recorded; with command buffers off it runs
(the commit states no symptom: this is what its removed readback does when the handler is traced under capture).
Mechanism: the lowering serialised ``n = -1`` into the opaque descriptor and passes the length as a device operand
(after shape refinement it is a constant buffer). ``LaunchThreeFry2x32Kernel`` reads it back with
``gpuMemcpyAsync(&n, buffers[4], ..., gpuMemcpyDeviceToHost, stream); gpuStreamSynchronize(stream);`` to size the
grid and the loop bound. Recording the custom call into the command buffer runs the whole handler on a capturing
stream: a device-to-host copy into pageable memory and a stream synchronisation are not capturable, so the capture is
invalidated and recording fails.
Doctor: sync-in-capture, at LaunchThreeFry2x32Kernel. The host readback of the device length (a copy to the host plus a
stream synchronisation) is issued by the launcher while the command buffer is being captured.
Fix (upstream): no readback. ``LaunchThreeFry2x32Kernel`` passes ``n_ptr = buffers[4]`` to the kernel and launches a
fixed grid of 32 blocks when ``n < 0``; ``ThreeFry2x32Kernel`` does ``if (n < 0) n = *n_ptr;`` on the device, and its
grid-stride loop covers ``idx < n``.
Modelled: ``ThreeFry2x32Kernel`` (the 20 rounds, key schedule and rotations, uint32 arithmetic in int64 masked to 32
bits, the ``idx < n`` bound with ``n`` a host integer or the device length), ``LaunchThreeFry2x32Kernel`` (both
versions), ``ThreeFry2x32`` / ``ThreeFry2x32_`` / ``UnpackDescriptor`` / ``threefry2x32_descriptor`` (a packed
int64), ``_threefry2x32_lowering``'s operand list, XLA's ``KernelThunk``, legacy ``CustomCallThunk``,
``CommandBufferCmdSequence`` (records by tracing the thunks under capture), ``CommandBuffer`` (kCreate/kFinalized),
``CommandBufferThunk`` and ``GpuExecutable::ExecuteThunks``, for a refined exported step: ``h = x @ w1``, dropout
(keep 0.75) with bits from ``threefry_2x32(key, iota)``, ``y = h @ w2``. Stand-ins: the device-to-host copy of the
length is ``.item()`` on the device buffer and ``gpuStreamSynchronize`` is ``synchronize``, both refused by the
engine in a capture as CUDA refuses them; the grid-stride loop is a whole-buffer computation masked to ``idx < n``;
uniform floats are ``(bits >> 9) * 2**-23`` (equal to jax's mantissa bit trick). Allocations keep their addresses,
so the command buffer is never updated. The eager reference is the executable with command buffers off.
Workload: the step refined to batch 3 (x 3x4, hidden 8: 24 random bits, so ``n = 12``), 4 executions each with a new
key and a new input. Bug: the first execution raises the emulation's CaptureError while the command buffer is recorded,
as upstream. Fix: all 4 steps equal eager (max error 0).
"""
from __future__ import annotations

import enum
import struct

import torch

from workbench.engine import synchronize
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/jax-ml/jax/commit/88f5eaca3e01c1ae5f30c722d138b7ba3e0457f0"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "LaunchThreeFry2x32Kernel"
SYMPTOM = ("shape-polymorphic jax.random with XLA command buffers: cu_threefry2x32 with a dynamic length copies the "
           "length to the host and synchronises the stream inside the command-buffer capture, so recording fails")

BATCH, FEATURES, HIDDEN = 3, 4, 8
KEEP_PROB = 0.75
STEPS = 4
UINT32_MASK = 0xFFFFFFFF

_variant = "bug"


# --- jaxlib/gpu/prng_kernels.cu.cc -------------------------------------------------------------------------------

def _u32(v: torch.Tensor) -> torch.Tensor:
    return v & UINT32_MASK


def ThreeFry2x32Kernel(key0, key1, data0, data1, out0, out1, n, n_ptr=None) -> None:
    """Every thread of the grid-stride loop at once; ``n`` is the host count or, when negative, read from ``n_ptr``."""
    if isinstance(n, int) and n < 0:
        n = n_ptr[0]                                      # n is stored in device memory: n = *n_ptr
    rotations = [13, 15, 26, 6, 17, 29, 16, 24]
    ks = [key0, key1, _u32(key0 ^ key1 ^ 0x1BD11BDA)]    # 0x1BD11BDA: the Threefry2x32 parity constant
    x = [data0, data1]

    def rotate_left(v, distance):
        return _u32((v << distance) | (v >> (32 - distance)))

    def round_(v, rotation):
        v[0] = _u32(v[0] + v[1])
        v[1] = rotate_left(v[1], rotation)
        v[1] = v[1] ^ v[0]

    x[0], x[1] = _u32(x[0] + ks[0]), _u32(x[1] + ks[1])
    for i in range(0, 4):
        round_(x, rotations[i])
    x[0], x[1] = _u32(x[0] + ks[1]), _u32(x[1] + ks[2] + 1)
    for i in range(4, 8):
        round_(x, rotations[i])
    x[0], x[1] = _u32(x[0] + ks[2]), _u32(x[1] + ks[0] + 2)
    for i in range(0, 4):
        round_(x, rotations[i])
    x[0], x[1] = _u32(x[0] + ks[0]), _u32(x[1] + ks[1] + 3)
    for i in range(4, 8):
        round_(x, rotations[i])
    x[0], x[1] = _u32(x[0] + ks[1]), _u32(x[1] + ks[2] + 4)
    for i in range(0, 4):
        round_(x, rotations[i])
    idx = torch.arange(out0.numel(), device=out0.device)
    in_range = idx < n                                    # for (idx = ...; idx < n; idx += blockDim.x * gridDim.x)
    out0.copy_(torch.where(in_range, _u32(x[0] + ks[2]), out0))
    out1.copy_(torch.where(in_range, _u32(x[1] + ks[0] + 5), out1))


class ThreeFry2x32Descriptor:
    def __init__(self, n: int):
        self.n = n


def LaunchThreeFry2x32Kernel(stream, buffers, descriptor: ThreeFry2x32Descriptor) -> None:
    keys = (buffers[0], buffers[1])
    data = (buffers[2], buffers[3])
    n = descriptor.n
    output_idx = 4
    n_ptr = None
    if n < 0:
        # n is an operand in device memory.
        if _variant == "bug":
            n = int(buffers[4][0].item())                 # gpuMemcpyAsync(&n, buffers[4], ..., DeviceToHost, stream)
            synchronize(buffers[4].device)                # gpuStreamSynchronize(stream)
        else:
            n_ptr = buffers[4]
        output_idx = 5
    out = (buffers[output_idx], buffers[output_idx + 1])
    block_dim = 128
    grid_dim = 32 if n < 0 else min(1024, (n + block_dim - 1) // block_dim)
    assert grid_dim > 0 and block_dim > 0                 # <<<grid_dim, block_dim, 0, stream>>>
    ThreeFry2x32Kernel(keys[0], keys[1], data[0], data[1], out[0], out[1], n, n_ptr)


# --- jaxlib/gpu/prng_kernels.cc, jaxlib/gpu_prng.py --------------------------------------------------------------

def threefry2x32_descriptor(n: int) -> bytes:
    return struct.pack("<q", n)                           # PackDescriptor(ThreeFry2x32Descriptor{n})


def UnpackDescriptor(opaque: bytes, opaque_len: int) -> ThreeFry2x32Descriptor:
    if opaque_len != struct.calcsize("<q"):
        raise ValueError("Invalid size for operation descriptor.")
    return ThreeFry2x32Descriptor(struct.unpack("<q", opaque)[0])


def ThreeFry2x32_(stream, buffers, opaque: bytes, opaque_len: int) -> None:
    descriptor = UnpackDescriptor(opaque, opaque_len)
    LaunchThreeFry2x32Kernel(stream, buffers, descriptor)


def ThreeFry2x32(stream, buffers, opaque: bytes, opaque_len: int, status: dict) -> None:
    try:
        ThreeFry2x32_(stream, buffers, opaque, opaque_len)
    except ValueError as e:
        status["failure"] = str(e)                        # XlaCustomCallStatusSetFailure


def _threefry2x32_lowering(length_is_dynamic: bool, n: int):
    """Operands and opaque of ``cu_threefry2x32``: with a symbolic length, ``-1`` and an extra length operand."""
    operands = ["key0", "key1", "data0", "data1"]
    if not length_is_dynamic:
        return operands, threefry2x32_descriptor(n)
    operands.append("length")                              # the i64[1] eval_dynamic_shape_as_tensor
    return operands, threefry2x32_descriptor(-1)


# --- xla/service/gpu/runtime: thunks -----------------------------------------------------------------------------

class ExecuteParams:
    def __init__(self, buffer_allocations: dict, stream: str, device: str):
        self.buffer_allocations, self.stream, self.device = buffer_allocations, stream, device


class KernelThunk:
    def __init__(self, name, fn, operands, results):
        self.name, self.fn, self.operands, self.results = name, fn, operands, results

    def Initialize(self, params: ExecuteParams) -> None:
        pass

    def ExecuteOnStream(self, params: ExecuteParams) -> None:
        allocs = params.buffer_allocations
        values = self.fn(*(allocs[o] for o in self.operands))
        for name, value in zip(self.results, values if isinstance(values, tuple) else (values,)):
            allocs[name].copy_(value)


class CustomCallThunk:
    """A legacy (``API_VERSION_STATUS_RETURNING``) custom call: ``call_target(stream, buffers, opaque, len, status)``."""

    def __init__(self, call_target, operands, results, opaque: bytes):
        self.call_target_, self.operands_, self.results_, self.opaque_ = call_target, operands, results, opaque

    def Initialize(self, params: ExecuteParams) -> None:
        pass

    def ExecuteOnStream(self, params: ExecuteParams) -> None:
        allocs = params.buffer_allocations
        buffers = [allocs[name] for name in (*self.operands_, *self.results_)]
        status: dict = {}
        self.call_target_(params.stream, buffers, self.opaque_, len(self.opaque_), status)
        if "failure" in status:
            raise RuntimeError(f"CustomCall failed: {status['failure']}")


class CommandBufferCmdSequence:
    """Kernel commands and a ``CustomCallCmd`` (``RecordLegacyCustomCall``: the call target traced under capture)."""

    def __init__(self, commands):
        self.commands = list(commands)

    def Record(self, params: ExecuteParams, command_buffer: "CommandBuffer", static_names) -> None:
        def trace():
            for cmd in self.commands:
                cmd.ExecuteOnStream(params)
            return params.buffer_allocations[command_buffer.result]
        allocs = params.buffer_allocations
        command_buffer.graph, command_buffer.outputs = capture(
            trace, device=params.device, warmups=0, name="command buffer", owner="CommandBufferThunk",
            static={name: allocs[name] for name in static_names}, capture_error_mode="thread_local")
        command_buffer.state = CommandBuffer.State.kFinalized


class CommandBuffer:
    class State(enum.Enum):
        kCreate = "create"
        kFinalized = "finalized"

    def __init__(self, result: str):
        self.result = result
        self.state = CommandBuffer.State.kCreate
        self.graph, self.outputs = None, None


class CommandBufferThunk:
    def __init__(self, commands: CommandBufferCmdSequence, thunks, result: str, static_names):
        self.commands_, self.thunks_ = commands, thunks
        self.command_buffer = CommandBuffer(result)
        self.static_names = tuple(static_names)

    def Initialize(self, params: ExecuteParams) -> None:
        for thunk in self.thunks_ or ():
            thunk.Initialize(params)
        if self.command_buffer.state is CommandBuffer.State.kCreate:     # never recorded: record before execution
            self.commands_.Record(params, self.command_buffer, self.static_names)

    def ExecuteOnStream(self, params: ExecuteParams) -> None:
        replay(self.command_buffer.graph, self.command_buffer.outputs)     # executor->Submit(stream, cmd_buffer)


# --- the exported step, refined to batch 3 and compiled by xla/service/gpu/gpu_executable.cc ---------------------

def broadcast_iota_fusion(key):
    """``_broadcast`` of the key halves and ``threefry_2x32``'s iota over the bit count, split in two halves."""
    count = BATCH * HIDDEN
    iota = torch.arange(count, dtype=torch.int64, device=key.device)
    half = count // 2
    return (key[0].expand(half), key[1].expand(half), iota[:half], iota[half:])


def dropout_fusion(bits0, bits1, h):
    bits = torch.cat([bits0, bits1]).view(BATCH, HIDDEN)                  # jnp.concatenate(threefry2x32_p.bind(...))
    uniform = (bits >> 9).to(h.dtype) * 2.0 ** -23                        # random.uniform's mantissa trick
    keep = uniform < KEEP_PROB                                            # random.bernoulli(rng, keep_prob)
    return torch.where(keep, h / KEEP_PROB, torch.zeros_like(h))


class GpuExecutable:
    """gemm -> broadcast/iota fusion -> cu_threefry2x32 -> dropout fusion -> gemm."""

    def __init__(self, device: str, enable_command_buffer: bool):
        gen = generator(104)
        self.device = device
        half = BATCH * HIDDEN // 2
        i64 = dict(dtype=torch.int64, device=device)
        self.allocs = {
            "x": torch.zeros(BATCH, FEATURES, device=device),                  # parameter 0
            "key": torch.zeros(2, **i64),                                        # parameter 1: u32[2]
            "w1": randn(FEATURES, HIDDEN, gen=gen, device=device, scale=FEATURES ** -0.5),
            "w2": randn(HIDDEN, FEATURES, gen=gen, device=device, scale=HIDDEN ** -0.5),
            "length": torch.tensor([half], **i64),     # constant after shape refinement: i64[1] {b * 8 / 2}
            "h": torch.zeros(BATCH, HIDDEN, device=device),
            "key0": torch.zeros(half, **i64), "key1": torch.zeros(half, **i64),
            "data0": torch.zeros(half, **i64), "data1": torch.zeros(half, **i64),
            "bits0": torch.zeros(half, **i64), "bits1": torch.zeros(half, **i64),
            "h_dropped": torch.zeros(BATCH, HIDDEN, device=device),
            "y": torch.zeros(BATCH, FEATURES, device=device),
        }
        # The module was exported with a symbolic batch: the lowering's length was not a constant dimension.
        operands, opaque = _threefry2x32_lowering(length_is_dynamic=True, n=half)
        thunks = [
            KernelThunk("gemm", lambda x, w: x @ w, ("x", "w1"), ("h",)),
            KernelThunk("broadcast_iota_fusion", broadcast_iota_fusion, ("key",),
                        ("key0", "key1", "data0", "data1")),
            CustomCallThunk(ThreeFry2x32, operands, ("bits0", "bits1"), opaque),     # cu_threefry2x32
            KernelThunk("dropout_fusion", dropout_fusion, ("bits0", "bits1", "h"), ("h_dropped",)),
            KernelThunk("gemm.1", lambda h, w: h @ w, ("h_dropped", "w2"), ("y",)),
        ]
        if enable_command_buffer:        # --xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUSTOM_CALL
            self.thunk_sequence = [CommandBufferThunk(CommandBufferCmdSequence(thunks), thunks, "y", ("x", "key"))]
        else:
            self.thunk_sequence = thunks

    def ExecuteThunks(self, x: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        self.allocs["x"].copy_(x)
        self.allocs["key"].copy_(key)
        params = ExecuteParams(self.allocs, stream="compute", device=self.device)
        for thunk in self.thunk_sequence:
            thunk.Initialize(params)
        for thunk in self.thunk_sequence:
            thunk.ExecuteOnStream(params)
        return self.allocs["y"].clone()


def steps(device: str):
    gen = generator(7)
    batches = []
    for _ in range(STEPS):
        key = torch.randint(0, 2 ** 32, (2,), generator=gen, dtype=torch.int64).to(device)   # a fresh split key
        batches.append((randn(BATCH, FEATURES, gen=gen, device=device), key))
    return batches


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    batches = steps(device)

    def serve(enable_command_buffer: bool):
        executable = GpuExecutable(device, enable_command_buffer)
        return [executable.ExecuteThunks(x, key) for x, key in batches]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
