"""XLA records a command buffer that holds only non-collective commands on the first execution, with no eager warm-up, so a cuBLASMp collective GEMM custom call does its one-time setup inside the stream capture and the capture fails.

Upstream: https://github.com/openxla/xla/pull/42996 ("[XLA:GPU] Run command buffer warmup without requiring
collectives", Shawn Wang, merged 2026-05-26, copybara cec6c5ff26, PiperOrigin-RevId 921314332). Follow-up:
https://github.com/openxla/xla/pull/43729 (merged 2026-06-08) splits ``requires_warmup()`` from
``requires_initialization()`` and makes ``CustomCallThunk`` and ``CollectiveThunk`` return true for it.
Symptom: a jitted TE/JAX step whose ``CollectiveGemm`` runs on the cuBLASMp backend fails on its first execution with
command buffers on: ``CUDA_ERROR_STREAM_CAPTURE_INVALIDATED``. The PR says the capture was "invalidated by an
``ncclPutSignal`` call inside cuBLASMp". With command buffers off, the same step works.
Mechanism: ``CommandBufferThunk`` (``xla/backends/gpu/runtime/command_buffer_thunk.cc``) keeps a fallback
``SequentialThunk`` (``thunks_``) with the same thunks as its ``CommandSequence``. ``ExecuteOnStream`` runs that
fallback once, eagerly, as a "warm up iteration" while ``cmd_buffer->warmup_done`` is false. Only after that does
``Initialize`` record the sequence into the command buffer. Before the fix, ``CommandBufferThunk::Initialize`` set
``warmup_done = true`` right away when ``!thunks_ || !commands_.requires_initialization()``. Only
``CollectiveThunk`` returns true for ``requires_initialization()``. So a command buffer without NCCL collectives
got no warm-up. The same ``Initialize`` call, on the executable's first run, found the command buffer in ``kCreate``
and recorded it at once (``commands_.Record``). ``CustomCallThunk`` is a ``TracedCommand``.
``TracedCommand::Record`` -> ``TracedCommandBuffer::GetOrTraceCommandBuffer`` -> ``TraceCommandBufferFactory::Create``
traces its ``ExecuteOnStream`` on the trace stream under stream capture. The FFI handler therefore made its
*first call ever* inside the capture. TE's ``cublasmp_gemm`` grows its symmetric workspace on the first call
(``ctx->workspace_size < wrksp_size_device``): it allocates the window, and cuBLASMp's NCCL symmetric-memory path
signals the peers (``ncclPutSignal``). A capturing stream refuses that, so the capture fails. On the thunk path the
first call runs outside any capture and succeeds. Later calls find the workspace in place and do no setup.
Doctor: sync-in-capture, at Initialize. During the open capture, the custom call's lazy setup attempts a call that
the capturing stream refuses: in the model, a wait for the device, which stands for the peer handshake. The bug
lives in ``CommandBufferThunk::Initialize``. That is where the fix changed code: the warm-up gating. The first
recording should have come after an eager execution of the fallback thunks had done the setup, but for
non-collective command buffers it was done on the first call.
Fix (upstream): ``Initialize`` sets ``warmup_done = true`` only ``if (!thunks_)``: "If there are no thunks, there is no
fallback path to use for warmup". Every command buffer with fallback thunks now runs execution 1 through the
``SequentialThunk`` and records on execution 2. (#43729 later narrows this to ``!commands_.requires_warmup()``. The
FFI ``CustomCallThunk`` is in that set.)
Modelled: one rank (rank 0 of TP=2) of a step made of a norm fusion, a TE ``CollectiveGemm`` all-gather GEMM custom
call (``GemmFFI`` -> ``nvte_all_gather_gemm`` -> ``cublasmp_gemm``) and a bias+GELU fusion, all in one command
buffer. The peer rank is not run. The shard that its step puts into our symmetric window is a per-step input that
the driver writes (``peer_shard``). XLA records kernel commands as graph nodes and traces only the custom call into a
child graph. Here the whole sequence is one stream capture, which fails at the same point (the custom call's trace).
Buffer allocations keep their addresses across runs, so the command buffer is never updated. Temporaries and the
result are made by their thunks, so in a capture they are blocks of the graph's pool. ``Prepare``, profiling
fallbacks, VA remapping and the trace cache are left out. The refused peer handshake (``ncclPutSignal`` in the
failing trace) is modelled as a wait for the device (``synchronize``), which the engine refuses inside a capture on
both backends, as CUDA refuses the real call. The eager reference is the same executable with command buffers off
(the plain thunk sequence, with its own communicator context).
"""
from __future__ import annotations

import enum

import torch

from workbench.engine import events, synchronize
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/openxla/xla/pull/42996"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "Initialize"
SYMPTOM = ("the first execution with command buffers fails with CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: the command "
           "buffer is recorded without a warm-up, so the cuBLASMp collective GEMM custom call's one-time symmetric "
           "workspace setup (peer signalling) runs inside the stream capture")

TP, RANK = 2, 0
ROWS, HIDDEN, FFN_LOCAL = 4, 8, 6          # per-rank sequence shard [ROWS, HIDDEN]; column-parallel weight [HIDDEN, FFN_LOCAL]
STEPS = 4


# --- transformer_engine/common/comm_gemm/comm_gemm.cpp (cuBLASMp backend) ------------------------------------

class NVTECommGemmCtx:
    """``nvte_comm_gemm_ctx_create``: communicator and descriptors made at bootstrap; the symmetric workspace is
    grown lazily on the first GEMM that needs it."""

    def __init__(self, nranks: int, rank: int, device: str):
        self.nranks, self.rank, self.device = nranks, rank, device
        self.workspace: torch.Tensor | None = None
        self.workspace_size = 0
        self.signals_put = [0] * nranks            # ncclPutSignal counts, per peer (host bookkeeping)


def _symmetric_workspace_alloc(ctx: NVTECommGemmCtx, size: int) -> torch.Tensor:
    """ncclMemAlloc + ncclCommWindowRegister, then cuBLASMp's first-use handshake on the new window: signal every
    peer (``ncclPutSignal``) and wait until theirs have landed before using it. Upstream, a capturing stream refuses
    ``ncclPutSignal`` (CUDA_ERROR_STREAM_CAPTURE_INVALIDATED); the model's handshake waits for the device, which the
    engine refuses in a capture in the same place."""
    window = torch.zeros(size, device=ctx.device)
    for peer in range(ctx.nranks):
        if peer != ctx.rank:
            ctx.signals_put[peer] += 1               # ncclPutSignal(window, peer)
    synchronize(ctx.device)                          # until the peers' signals arrived: the window is live
    return window


def cublasmp_gemm(ctx: NVTECommGemmCtx, m: int, n: int, k: int, a: torch.Tensor, peer_a: torch.Tensor,
                  b: torch.Tensor) -> torch.Tensor:
    """All-gather GEMM: the ranks' row shards of ``a`` are gathered into the symmetric workspace, then multiplied."""
    wrksp_size_device = m * k                        # cublasMpMatmul_bufferSize
    if ctx.workspace_size < wrksp_size_device:       # first call: grow (allocate) the symmetric workspace
        ctx.workspace = _symmetric_workspace_alloc(ctx, wrksp_size_device)
        ctx.workspace_size = wrksp_size_device
    gathered = ctx.workspace[:wrksp_size_device].view(m, k)
    rows = a.shape[0]
    gathered[ctx.rank * rows:(ctx.rank + 1) * rows].copy_(a)
    peer = 1 - ctx.rank
    gathered[peer * rows:(peer + 1) * rows].copy_(peer_a)       # the peer's put into our window
    return gathered @ b


def nvte_all_gather_gemm(ctx: NVTECommGemmCtx, m: int, n: int, k: int, a, peer_a, b) -> torch.Tensor:
    return cublasmp_gemm(ctx, m, n, k, a, peer_a, b)


# --- transformer_engine/jax/csrc/extensions/gemm.cpp: the FFI handler (kCmdBufferCompatible) -----------------

def GemmFFI(ctx: NVTECommGemmCtx, lhs: torch.Tensor, peer_lhs: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """``CollectiveGemm`` with collective_op=ALL_GATHER on the cuBLASMp backend: the gathered dimension is global."""
    m = lhs.shape[0] * ctx.nranks
    k, n = rhs.shape
    return nvte_all_gather_gemm(ctx, m, n, k, lhs, peer_lhs, rhs)


# --- xla/backends/gpu/runtime: thunks ------------------------------------------------------------------------

class ExecuteParams:
    def __init__(self, buffer_allocations: dict, stream: str):
        self.buffer_allocations = buffer_allocations
        self.stream = stream


class KernelThunk:
    """A fusion kernel: reads its operand allocations, writes its result allocation."""

    def __init__(self, name, fn, operands, result):
        self.name, self.fn, self.operands, self.result = name, fn, operands, result

    def requires_initialization(self) -> bool:
        return False

    def ExecuteOnStream(self, params: ExecuteParams) -> None:
        allocs = params.buffer_allocations
        allocs[self.result] = self.fn(*(allocs[o] for o in self.operands))


class CustomCallThunk:
    """An XLA FFI custom call; also a ``TracedCommand``: in a command buffer it is recorded by tracing this
    ``ExecuteOnStream`` under stream capture. Not a collective: ``requires_initialization()`` is false."""

    def __init__(self, target_name, handler, execution_state, operands, result):
        self.target_name, self.handler = target_name, handler
        self.execution_state = execution_state           # the handler's state (TE's comm-gemm context)
        self.operands, self.result = operands, result

    def requires_initialization(self) -> bool:
        return False

    def ExecuteOnStream(self, params: ExecuteParams) -> None:
        allocs = params.buffer_allocations
        allocs[self.result] = self.handler(self.execution_state, *(allocs[o] for o in self.operands))


class SequentialThunk:
    def __init__(self, thunks):
        self.thunks = list(thunks)

    def ExecuteOnStream(self, params: ExecuteParams) -> None:
        for thunk in self.thunks:
            thunk.ExecuteOnStream(params)


class CommandSequence:
    """The commands of a command buffer (borrowed from the thunks the fallback ``SequentialThunk`` owns)."""

    def __init__(self, commands):
        self.commands = list(commands)

    def requires_initialization(self) -> bool:
        return any(cmd.requires_initialization() for cmd in self.commands)

    def Record(self, execute_params: ExecuteParams, command_buffer: "CommandBuffer", *, static) -> None:
        def trace():
            for cmd in self.commands:
                cmd.ExecuteOnStream(execute_params)
            return execute_params.buffer_allocations[command_buffer.result]
        command_buffer.Trace(trace, static=static)


class CommandBuffer:
    class State(enum.Enum):
        kCreate = "create"
        kFinalized = "finalized"

    def __init__(self, device: str, result: str):
        self.device, self.result = device, result
        self.state = CommandBuffer.State.kCreate
        self.graph, self.outputs = None, None

    def Trace(self, fn, *, static) -> None:
        """Record by stream capture (``TraceCommandBufferFactory::Create``); XLA itself runs no warm-up here."""
        self.graph, self.outputs = capture(fn, device=self.device, warmups=0, name="command buffer",
                                           static=static, owner="CommandBufferThunk")
        self.state = CommandBuffer.State.kFinalized

    def Submit(self, stream: str) -> None:
        replay(self.graph, self.outputs)


class ExecutorCommandBuffer:
    def __init__(self, command_buffer: CommandBuffer):
        self.command_buffer = command_buffer
        self.warmup_done = False


class CommandBufferThunk:
    def __init__(self, commands: CommandSequence, thunks: SequentialThunk | None, device: str, result: str,
                 static_names, variant: str):
        self.commands_, self.thunks_ = commands, thunks
        self._cmd_buffer = ExecutorCommandBuffer(CommandBuffer(device, result))
        self._static_names = tuple(static_names)
        self._variant = variant

    def Initialize(self, params: ExecuteParams) -> None:
        cmd_buffer = self._cmd_buffer
        if self._variant == "fix":
            # #42996: if there are no thunks, there is no fallback path to use for warmup.
            if not self.thunks_:
                cmd_buffer.warmup_done = True
        else:
            # bug: "If there are no thunks, or command buffer does not require initialization, we can mark warm up
            # as done immediately" -- only collectives require initialization, so a custom call gets no warm-up.
            if not self.thunks_ or not self.commands_.requires_initialization():
                cmd_buffer.warmup_done = True
        if not cmd_buffer.warmup_done:
            return
        # kCreate: the command sequence was never recorded into it; record before execution.
        if cmd_buffer.command_buffer.state is CommandBuffer.State.kCreate:
            allocs = params.buffer_allocations
            self.commands_.Record(params, cmd_buffer.command_buffer,
                                  static={name: allocs[name] for name in self._static_names})

    def ExecuteOnStream(self, params: ExecuteParams) -> None:
        cmd_buffer = self._cmd_buffer
        if not cmd_buffer.warmup_done and self.thunks_:
            with events.warmup(real=True):                     # "warm up iteration", through the fallback thunks
                self.thunks_.ExecuteOnStream(params)
            cmd_buffer.warmup_done = True
            return
        cmd_buffer.command_buffer.Submit(params.stream)


# --- xla/service/gpu/gpu_executable.cc ----------------------------------------------------------------------

def _rms_norm(x, gamma):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * gamma


def _bias_gelu(d, bias):
    return torch.nn.functional.gelu(d + bias)


class GpuExecutable:
    """The compiled step, on rank 0: norm fusion -> CollectiveGemm (AG) custom call -> bias+GELU fusion."""

    def __init__(self, device: str, enable_command_buffer: bool, variant: str):
        gen = generator(42996)
        self.device = device
        self.allocs = {
            "x": torch.zeros(ROWS, HIDDEN, device=device),             # parameter 0: this rank's shard
            "peer_shard": torch.zeros(ROWS, HIDDEN, device=device),    # the peer's normed shard, in our window
            "gamma": 1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1),
            "w": randn(HIDDEN, FFN_LOCAL, gen=gen, device=device, scale=HIDDEN ** -0.5),
            "bias": randn(FFN_LOCAL, gen=gen, device=device, scale=0.1),
        }
        ctx = NVTECommGemmCtx(TP, RANK, device)                       # collective_gemm_bootstrap
        thunks = [
            KernelThunk("rms_norm_fusion", _rms_norm, ("x", "gamma"), "ln_out"),
            CustomCallThunk("te_gemm_ffi", GemmFFI, ctx, ("ln_out", "peer_shard", "w"), "gemm_out"),
            KernelThunk("bias_gelu_fusion", _bias_gelu, ("gemm_out", "bias"), "out"),
        ]
        if enable_command_buffer:       # --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL
            self.thunk_sequence = [CommandBufferThunk(CommandSequence(thunks), SequentialThunk(thunks), device,
                                                      "out", ("x", "peer_shard"), variant)]
        else:
            self.thunk_sequence = thunks

    def ExecuteThunks(self, x: torch.Tensor, peer_shard: torch.Tensor) -> torch.Tensor:
        self.allocs["x"].copy_(x)
        self.allocs["peer_shard"].copy_(peer_shard)
        params = ExecuteParams(self.allocs, stream="compute")
        for thunk in self.thunk_sequence:
            if isinstance(thunk, CommandBufferThunk):
                thunk.Initialize(params)
        for thunk in self.thunk_sequence:
            thunk.ExecuteOnStream(params)
        return self.allocs["out"].clone()


def steps(device: str):
    gen = generator(7)
    return [(randn(ROWS, HIDDEN, gen=gen, device=device), randn(ROWS, HIDDEN, gen=gen, device=device))
            for _ in range(STEPS)]


def run(variant: str, device: str = "cpu"):
    batches = steps(device)

    def serve(enable_command_buffer: bool):
        executable = GpuExecutable(device, enable_command_buffer, variant)
        return [executable.ExecuteThunks(x, peer) for x, peer in batches]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
