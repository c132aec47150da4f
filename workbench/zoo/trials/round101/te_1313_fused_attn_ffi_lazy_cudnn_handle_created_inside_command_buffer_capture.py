"""TE/JAX's ``te_fused_attn_forward_ffi`` custom call creates its thread-local cuDNN handle lazily on its first call; with XLA command buffers that first call is traced inside the CUDA-graph capture, and ``cudnnCreate``'s device allocation there breaks the capture.

Upstream: https://github.com/NVIDIA/TransformerEngine/pull/1313 ("[JAX] Added prepare phase for the
FusedAttnForwardFFI", NVIDIA/TransformerEngine, merged 2024-11-06 as e5ffaa769). Read: the PR description ("the
FusedAttnForwardFFI is registered with 2 phases, prepare and execute. ... helps to avoid memory allocation for the
handle in the cudaGraph capturing area, thus resolving the issue we have in the distributed run with cudaGraph") and
its whole diff: ``common/cudnn_utils.cpp`` (new ``nvte_cudnn_handle_init``), ``include/transformer_engine/cudnn.h``
(its comment: "TE/JAX cudaGraph requires the cuDNN initialization to happen outside of the capturing region"),
``jax/csrc/extensions/cudnn.cpp`` (``CudnnHandleInitFFI`` bound with ``FFI_Prepare``), ``ffi.h``, ``pybind.cpp``
(``Registrations``), ``cpp_extensions/attention.py`` (FFI lowering on by default). At the fix: ``fused_attn/utils.h``
(``cudnnExecutionPlanManager``: ``static thread_local`` instance, ``GetCudnnHandle`` with a ``thread_local``
``std::call_once`` around ``cudnnCreate``), ``fused_attn/fused_attn.cpp`` (``nvte_fused_attn_fwd`` takes the handle),
``jax/csrc/extensions/attention.cpp`` (``FusedAttnForwardFFI`` -> ``FusedAttnForwardImpl``, bound with
``FFI_CudaGraph_Traits``). XLA of that time: ``service/gpu/runtime/command_buffer_thunk.cc`` (``Prepare`` also
prepares the fallback thunks; ``Initialize`` records the command sequence when the command buffer is in ``kCreate``)
and ``custom_call_thunk.cc`` (``Prepare`` runs the bundle's ``prepare`` stage with no stream; ``ExecuteOnStream``
its ``execute`` stage).
Symptom: a JAX training step using TE fused attention through the FFI custom call (then opt-in,
``NVTE_JAX_FUSED_ATTN_WITH_FFI``), compiled with command buffers (CUDA graphs) that take custom calls, fails on its
first execution while XLA records the command buffer (the PR reports it from distributed runs with cudaGraph).
Without command buffers the same step runs.
Mechanism: ``FusedAttnForwardHandler`` carries ``kCmdBufferCompatible``, so XLA puts the custom call into the command
buffer. ``CommandBufferThunk::Initialize`` records the command sequence on the executable's first run, and the
custom call is recorded by tracing its handler under stream capture: the handler's first call ever happens inside
the capture. It reaches ``nvte_fused_attn_fwd``, which asks ``cudnnExecutionPlanManager::Instance().GetCudnnHandle()``
for the handle; on this thread it was never created, so ``std::call_once`` runs ``cudnnCreate``, which allocates device
memory for the handle. The capturing thread may not make that allocation, and the capture fails. On the plain thunk
path the first call runs outside any capture and creates the handle there.
Doctor: sync-in-capture, at GetCudnnHandle. The lazily-created handle's allocation (a call the capture refuses) is
made in ``GetCudnnHandle`` while the command buffer is being captured; the fix moves that first call into the FFI
prepare stage, which XLA runs before recording.
Fix (upstream): ``Registrations()`` registers ``te_fused_attn_forward_ffi`` as a dict of stages: ``prepare`` =
``CudnnHandleInitHandler`` (``nvte_cudnn_handle_init()``: ``GetCudnnHandle()`` outside any capture), ``execute`` =
``FusedAttnForwardHandler``. XLA runs ``Prepare`` (and ``CommandBufferThunk::Prepare`` prepares its fallback thunks)
before ``Initialize``, so the handle exists before recording.
Modelled: ``cudnnExecutionPlanManager`` (thread-local instance, call_once, handle), ``nvte_cudnn_handle_init``,
``CudnnHandleInitFFI``, ``nvte_fused_attn_fwd`` (F16 arbitrary-seqlen backend, BSHD, causal, no bias, no dropout,
inference of output and softmax stats), ``FusedAttnForwardFFI``, ``Registrations``, XLA's FFI handler bundle,
``CustomCallThunk`` (Prepare/Initialize/ExecuteOnStream by stage), ``CommandBufferThunk`` (Prepare, Initialize
recording on ``kCreate``, ExecuteOnStream submitting) and ``GpuExecutable::ExecuteThunks`` (Prepare, Initialize,
Execute over the thunk sequence), for a step: qkv GEMM -> fused attention custom call -> output projection + residual
fusion. Stand-ins: a PjRt client's execute thread is a ``HostThread`` whose ``thread_local`` dict holds what C++
``thread_local`` would (each run below has its own process, hence its own thread); ``cudnnCreate``'s device
allocation (``cudaMalloc``, which may synchronise the device and is refused on a capturing thread) is a wait for the
device (``synchronize``), refused by the engine in a capture as CUDA refuses the real call; the cuDNN graph is dense
causal attention; XLA's separate ``CustomCallCmd`` is the thunk itself, traced under capture. Allocations keep their
addresses, so the command buffer is never updated. The eager reference is the executable with command buffers off.
Workload: 4 executions of the step (batch 2, seq 4, 2 heads, head dim 3, hidden 6), each with a new input. Bug: the
first execution raises the emulation's CaptureError while the command buffer is recorded, as upstream. Fix: all 4
steps equal eager (max error 0).
"""
from __future__ import annotations

import enum

import torch

from workbench.engine import synchronize
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TransformerEngine/pull/1313"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "GetCudnnHandle"
SYMPTOM = ("JAX + TE fused attention via FFI with XLA command buffers: the first execution fails while recording "
           "the command buffer, because the custom call's lazy cudnnCreate (a device allocation) runs inside the "
           "stream capture")

BATCH, SEQ, HEADS, HEAD_DIM = 2, 4, 2, 3
HIDDEN = HEADS * HEAD_DIM
STEPS = 4

_variant = "bug"


# --- host threads: C++ ``thread_local`` storage ----------------------------------------------------------------

class HostThread:
    """A PjRt client's execute thread: what ``thread_local`` variables hold on it."""

    def __init__(self):
        self.thread_local: dict = {}


_current_thread: HostThread | None = None       # the thread running host code now


# --- transformer_engine/common/fused_attn/utils.h ---------------------------------------------------------------

class cudnnHandle:
    """A cuDNN handle: host state plus the device memory ``cudnnCreate`` allocates for it."""

    def __init__(self, device: str):
        self.device = device
        self.stream = None
        self.scratch = torch.zeros(16, device=device)


class _OnceFlag:
    def __init__(self):
        self.done = False


class cudnnExecutionPlanManager:
    @staticmethod
    def Instance() -> "cudnnExecutionPlanManager":
        tls = _current_thread.thread_local             # static thread_local cudnnExecutionPlanManager instance;
        if "cudnnExecutionPlanManager" not in tls:
            tls["cudnnExecutionPlanManager"] = cudnnExecutionPlanManager()
        return tls["cudnnExecutionPlanManager"]

    def __init__(self):
        self.handle_: cudnnHandle | None = None
        self.device = "cpu"

    def GetCudnnHandle(self) -> cudnnHandle:
        tls = _current_thread.thread_local             # static thread_local std::once_flag flag;
        flag = tls.setdefault("GetCudnnHandle.flag", _OnceFlag())
        if not flag.done:                              # std::call_once(flag, [&] { cudnnCreate(&handle_); });
            self.handle_ = cudnnHandle(self.device)    # cudnnCreate: allocates the handle's device memory,
            synchronize(self.device)                   # a cudaMalloc, which may synchronise the device
            flag.done = True
        return self.handle_


# --- transformer_engine/common/cudnn_utils.cpp -------------------------------------------------------------------

def nvte_cudnn_handle_init(device: str) -> None:
    manager = cudnnExecutionPlanManager.Instance()
    manager.device = device
    manager.GetCudnnHandle()


# --- transformer_engine/common/fused_attn/fused_attn.cpp (F16 arbitrary seqlen, reduced) -------------------------

def fused_attn_arbitrary_seqlen_fwd(q, k, v, O, softmax_aux, attn_scale, handle: cudnnHandle, stream) -> None:
    """The cuDNN SDPA graph (stand-in: dense causal attention), executed with ``handle`` on ``stream``."""
    handle.stream = stream                             # cudnnSetStream(handle, stream)
    s = torch.einsum("bshd,bthd->bhst", q, k) * attn_scale
    causal = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).tril()
    s = s.masked_fill(~causal, float("-inf"))
    softmax_aux.copy_(torch.logsumexp(s, dim=-1, keepdim=True))
    O.copy_(torch.einsum("bhst,bthd->bshd", torch.exp(s - softmax_aux), v))


def nvte_fused_attn_fwd(q, k, v, O, softmax_aux, attn_scale, stream, device: str) -> None:
    manager = cudnnExecutionPlanManager.Instance()
    manager.device = device
    handle = manager.GetCudnnHandle()
    fused_attn_arbitrary_seqlen_fwd(q, k, v, O, softmax_aux, attn_scale, handle, stream)


# --- transformer_engine/jax/csrc/extensions: attention.cpp, cudnn.cpp, pybind.cpp --------------------------------

def FusedAttnForwardImpl(stream, q, k, v, output, softmax_aux, scaling_factor, device) -> None:
    nvte_fused_attn_fwd(q, k, v, output, softmax_aux, scaling_factor, stream, device)


def FusedAttnForwardFFI(call_frame: "CallFrame") -> None:
    """The execute stage: buffers from the call frame, attributes from the lowering."""
    q, k, v = call_frame.args
    output, softmax_aux = call_frame.rets
    FusedAttnForwardImpl(call_frame.stream, q, k, v, output, softmax_aux, call_frame.attrs["scaling_factor"],
                         call_frame.device)


def CudnnHandleInitFFI(call_frame: "CallFrame") -> None:
    """Bound with ``FFI_Prepare``: no stream, no buffers."""
    nvte_cudnn_handle_init(call_frame.device)


FusedAttnForwardHandler = FusedAttnForwardFFI      # XLA_FFI_DEFINE_HANDLER_SYMBOL(..., FFI_CudaGraph_Traits)
CudnnHandleInitHandler = CudnnHandleInitFFI        # XLA_FFI_DEFINE_HANDLER_SYMBOL(..., FFI::Bind<FFI_Prepare>())


def Registrations() -> dict:
    registrations = {}
    if _variant == "bug":
        registrations["te_fused_attn_forward_ffi"] = FusedAttnForwardHandler
    else:
        fused_attn_forward_ffi = {"prepare": CudnnHandleInitHandler, "execute": FusedAttnForwardHandler}
        registrations["te_fused_attn_forward_ffi"] = fused_attn_forward_ffi
    return registrations


# --- xla: FFI bundles and the custom-call registry ---------------------------------------------------------------

class XLA_FFI_Handler_Bundle:
    def __init__(self, instantiate=None, prepare=None, initialize=None, execute=None):
        self.instantiate, self.prepare, self.initialize, self.execute = instantiate, prepare, initialize, execute


def register_custom_call_target(name: str, fn, registry: dict) -> None:
    """jaxlib, api_version=1: a dict of stages becomes a bundle; a bare handler is the execute stage."""
    stages = fn if isinstance(fn, dict) else {"execute": fn}
    registry[name] = XLA_FFI_Handler_Bundle(**stages)


class CallFrame:
    def __init__(self, args=(), rets=(), attrs=None, stream=None, device="cpu"):
        self.args, self.rets, self.attrs, self.stream, self.device = args, rets, attrs or {}, stream, device


# --- xla/service/gpu/runtime: thunks -----------------------------------------------------------------------------

class ExecuteParams:
    def __init__(self, buffer_allocations: dict, stream: str, device: str):
        self.buffer_allocations, self.stream, self.device = buffer_allocations, stream, device


class KernelThunk:
    def __init__(self, name, fn, operands, result):
        self.name, self.fn, self.operands, self.result = name, fn, operands, result

    def Prepare(self, params: ExecuteParams) -> None:
        pass

    def Initialize(self, params: ExecuteParams) -> None:
        pass

    def ExecuteOnStream(self, params: ExecuteParams) -> None:
        allocs = params.buffer_allocations
        allocs[self.result].copy_(self.fn(*(allocs[o] for o in self.operands)))


class CustomCallThunk:
    def __init__(self, bundle: XLA_FFI_Handler_Bundle, operands, results, attributes):
        self.bundle_, self.operands_, self.results_, self.attributes_ = bundle, operands, results, attributes

    def ExecuteFfiHandler(self, handler, stage: str, params: ExecuteParams) -> None:
        if stage == "prepare":                           # no stream, no buffer allocations
            frame = CallFrame(attrs=self.attributes_, device=params.device)
        else:
            allocs = params.buffer_allocations
            frame = CallFrame(tuple(allocs[o] for o in self.operands_), tuple(allocs[r] for r in self.results_),
                              self.attributes_, params.stream, params.device)
        handler(frame)

    def Prepare(self, params: ExecuteParams) -> None:
        if self.bundle_.prepare is None:
            return
        self.ExecuteFfiHandler(self.bundle_.prepare, "prepare", params)

    def Initialize(self, params: ExecuteParams) -> None:
        if self.bundle_.initialize is None:
            return
        self.ExecuteFfiHandler(self.bundle_.initialize, "initialize", params)

    def ExecuteOnStream(self, params: ExecuteParams) -> None:
        self.ExecuteFfiHandler(self.bundle_.execute, "execute", params)


class CommandBufferCmdSequence:
    """The commands (here: the thunks themselves; a custom call is recorded by tracing its handler)."""

    def __init__(self, commands):
        self.commands = list(commands)

    def Prepare(self, params: ExecuteParams) -> None:
        pass                                             # kernel and traced custom-call commands prepare nothing

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

    def Prepare(self, params: ExecuteParams) -> None:
        self.commands_.Prepare(params)
        # Always prepare thunks if they are present so we are ready to fall back on them.
        for thunk in self.thunks_ or ():
            thunk.Prepare(params)

    def Initialize(self, params: ExecuteParams) -> None:
        for thunk in self.thunks_ or ():
            thunk.Initialize(params)
        # kCreate: the command sequence was never recorded into it; record before execution.
        if self.command_buffer.state is CommandBuffer.State.kCreate:
            self.commands_.Record(params, self.command_buffer, self.static_names)

    def ExecuteOnStream(self, params: ExecuteParams) -> None:
        replay(self.command_buffer.graph, self.command_buffer.outputs)     # executor->Submit(stream, cmd_buffer)


# --- xla/service/gpu/gpu_executable.cc: the compiled training-step attention block -------------------------------

class GpuExecutable:
    """qkv GEMM -> te_fused_attn_forward_ffi -> output projection + residual fusion."""

    def __init__(self, device: str, enable_command_buffer: bool):
        gen = generator(1313)
        self.device = device
        self.host_thread = HostThread()                  # this client's execute thread
        self.allocs = {
            "x": torch.zeros(BATCH, SEQ, HIDDEN, device=device),          # parameter 0
            "w_qkv": randn(HIDDEN, 3 * HIDDEN, gen=gen, device=device, scale=HIDDEN ** -0.5),
            "w_proj": randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=HIDDEN ** -0.5),
            "qkv": torch.zeros(BATCH, SEQ, 3, HEADS, HEAD_DIM, device=device),
            "attn_out": torch.zeros(BATCH, SEQ, HEADS, HEAD_DIM, device=device),
            "softmax_aux": torch.zeros(BATCH, HEADS, SEQ, 1, device=device),
            "out": torch.zeros(BATCH, SEQ, HIDDEN, device=device),
        }
        self.allocs["q"], self.allocs["k"], self.allocs["v"] = self.allocs["qkv"].unbind(2)
        registry: dict = {}
        for name, fn in Registrations().items():         # jax: xla_client.register_custom_call_target
            register_custom_call_target(name, fn, registry)
        thunks = [
            KernelThunk("qkv_gemm", lambda x, w: (x @ w).view(BATCH, SEQ, 3, HEADS, HEAD_DIM), ("x", "w_qkv"),
                        "qkv"),
            CustomCallThunk(registry["te_fused_attn_forward_ffi"], ("q", "k", "v"), ("attn_out", "softmax_aux"),
                            {"scaling_factor": HEAD_DIM ** -0.5}),
            KernelThunk("proj_residual_fusion", lambda a, w, x: a.reshape(BATCH, SEQ, HIDDEN) @ w + x,
                        ("attn_out", "w_proj", "x"), "out"),
        ]
        if enable_command_buffer:        # --xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUSTOM_CALL
            self.thunk_sequence = [CommandBufferThunk(CommandBufferCmdSequence(thunks), thunks, "out", ("x",))]
        else:
            self.thunk_sequence = thunks

    def ExecuteThunks(self, x: torch.Tensor) -> torch.Tensor:
        global _current_thread
        _current_thread = self.host_thread
        try:
            self.allocs["x"].copy_(x)
            params = ExecuteParams(self.allocs, stream="compute", device=self.device)
            for thunk in self.thunk_sequence:
                thunk.Prepare(params)
            for thunk in self.thunk_sequence:
                thunk.Initialize(params)
            for thunk in self.thunk_sequence:
                thunk.ExecuteOnStream(params)
            return self.allocs["out"].clone()
        finally:
            _current_thread = None


def steps(device: str):
    gen = generator(11)
    return [randn(BATCH, SEQ, HIDDEN, gen=gen, device=device) for _ in range(STEPS)]


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    batches = steps(device)

    def serve(enable_command_buffer: bool):
        executable = GpuExecutable(device, enable_command_buffer)
        return [executable.ExecuteThunks(x) for x in batches]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
