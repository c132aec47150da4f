"""XLA zero-fills a cuDNN SDPA custom call's outputs before running it (``CuDnnThunk::ExecuteOnStream``), but ``CuDnnThunk::Record`` records only the cuDNN graph into a command buffer: under CUDA graphs the padded-token rows of the attention output keep whatever their buffer slice last held.

Upstream: https://github.com/openxla/xla/pull/46500 ("[GPU] Fix three cuDNN SDPA integration defects", openxla/xla,
opened 2026-07-30; still open in the thread as read, the fixed ``Record`` is in a later stored ``cudnn_thunk.cc``). Read: the PR description (its
second defect: "whenever an fMHA op is captured into a command buffer / CUDA graph, the output zero-fill that XLA
performs on the eager path is silently dropped, so the padded tokens of ``O`` (and of ``dQ``/``dK``/``dV``) return
whatever the donated buffer happened to contain"); the description of #44867 ("zero initialize the output buffers of
cuDNN SDPA ... cuDNN skips computing output for these regions and keep the initial values for padded regions",
2026-06-26), which added ``should_memzero_`` to the eager path only; ``xla/backends/gpu/runtime/cudnn_thunk.cc`` before
the fix (openxla/xla 138cd58b0: ``ExecuteOnStream`` calls ``stream->MemZero`` on every output arg when
``should_memzero_``; ``Record`` calls ``CreateDnnGraphCommand``/``UpdateDnnGraphCommand`` or ``RecordTracedCommand``
of ``graph_->Execute`` only) and after it (``MemzeroCommands``: ``CreateMemset`` zero fills recorded ahead of the DNN
graph command and ``UpdateMemset`` on update; the traced lambda now ``MemZero``s the outputs before ``Execute``);
``command_buffer_thunk.cc`` for how a command buffer is initialised, recorded and submitted.
Symptom: a JAX model using cuDNN fused attention with padded sequences (``q_seqlen``/``kv_seqlen``), compiled with
command buffers that include cuDNN, returns garbage in the padded-token rows of the attention output (and in
everything computed from them); with command buffers off those rows are zeros.
Mechanism: the cuDNN SDPA graph writes only the rows of real tokens. XLA's buffer assignment gives ``O`` a slice of the
temp allocation that other, disjointly-live values also use, so before the op that slice holds someone else's data;
the eager thunk clears it (``MemZero``) first. When the step runs from a command buffer, the recorded commands are
the cuDNN graph launch alone: on every replay the padded rows of ``O`` keep what the slice held, here the MLP
activation that the previous step wrote into the same slice after ``O`` died.
Doctor: stale-input, at Record. Replays serve rows of ``O`` that the step never wrote, so they carry an earlier step's
data, because the refresh that the eager step does (the zero fill) was left out of the recorded commands; the fix adds
it in ``CuDnnThunk::Record``.
Fix (upstream): ``Record`` records the zero fill too: explicit construction gets ``CreateMemset(0)`` commands for each
non-empty output, as dependencies of the DNN graph command (``UpdateMemset`` on update), and the traced path
``MemZero``s the outputs inside the traced function before ``graph_->Execute``.
Modelled: ``CuDnnThunk`` (``Initialize``, ``ExecuteOnStream`` with ``should_memzero_``, ``Record`` on the traced path),
kernel thunks for XLA fusions, ``CommandBufferCmdExecutor::Record``, ``CommandBufferThunk`` (warm-up execution through
the fallback thunks, then recording on ``kCreate`` and submitting), ``GpuExecutable::ExecuteThunks``, for one encoder
block: qkv fusion -> cuDNN SDPA (padding mask from per-sequence lengths) -> output projection + residual -> MLP up +
GELU -> MLP down + residual. Stand-ins: the cuDNN SDPA graph is dense masked attention that writes only real query
rows; a command buffer is one stream capture, kernel and DNN-graph commands being recorded by running them under it
(the explicit-construction branch, fixed the same way with memset commands, is not taken); allocations keep their
addresses (the parameters are copied into fixed allocations), so the command buffer is never updated; buffer
assignment is written out: ``O`` and the MLP activation share one slice. The eager reference is the executable with
command buffers off.
Workload: 4 executions of the block (batch 2, 6 tokens, 2 heads of dim 2), sequence lengths (4, 6), (6, 3), (5, 5),
(2, 6). Execution 1 is the command buffer's warm-up through the thunks; executions 2-4 replay it. Bug: the padded rows
of executions 2-4 carry the previous execution's MLP activation through the projection and MLP (real rows are right),
max error 3.18; execution 1 matches. Fix: all equal eager (max error 0).
"""
from __future__ import annotations

import enum

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/openxla/xla/pull/46500"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "Record"
SYMPTOM = ("cuDNN SDPA with padded sequences under XLA command buffers: the output zero fill that the eager thunk "
           "does is not recorded, so padded-token rows of O keep whatever their buffer slice held (an earlier step's "
           "MLP activation)")

BATCH, SEQ, HEADS, HEAD_DIM = 2, 6, 2, 2
WIDTH = HEADS * HEAD_DIM
SEQLENS = [(4, 6), (6, 3), (5, 5), (2, 6)]      # per execution: the two sequences' real lengths

_variant = "bug"


# --- stream_executor: a stream (host-side handle) ---------------------------------------------------------------

class Stream:
    def MemZero(self, location: torch.Tensor) -> None:
        location.zero_()


# --- the compiled cuDNN SDPA graph (stand-in for the deserialized cudnn_frontend graph) ---------------------------

class CudnnSdpaGraph:
    """Forward SDPA with a padding mask: rows of padded query tokens are not computed and not written."""

    def __init__(self, scale: float):
        self.scale = scale

    def SupportsExplicitCommandBufferConstruction(self) -> bool:
        return False

    def Execute(self, stream: Stream, operands) -> None:
        qkv, q_seqlen, kv_seqlen, o = operands
        q, k, v = qkv.unbind(2)                                         # [B, S, H, D] each
        pos = torch.arange(SEQ, device=qkv.device)
        q_valid = pos[None, :] < q_seqlen[:, None]                      # [B, S]
        kv_valid = pos[None, :] < kv_seqlen[:, None]
        s = torch.einsum("bshd,bthd->bhst", q, k) * self.scale
        s = s.masked_fill(~kv_valid[:, None, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1)
        out = torch.einsum("bhst,bthd->bshd", p, v).reshape(BATCH, SEQ, WIDTH)
        o.copy_(torch.where(q_valid[..., None], out, o))                # padded rows: left as they are


# --- xla/backends/gpu/runtime ---------------------------------------------------------------------------------

class ExecuteParams:
    def __init__(self, buffer_allocations: dict, stream: Stream, device: str):
        self.buffer_allocations, self.stream, self.device = buffer_allocations, stream, device


def RecordTracedCommand(execute_params: ExecuteParams, trace) -> None:
    """``TracedCommand``: run the command's work on the trace stream under the command buffer's stream capture."""
    trace(execute_params.stream)


class KernelThunk:
    """A fusion: reads its operand slices, writes its result slice."""

    def __init__(self, name, fn, operands, result):
        self.name, self.fn, self.operands, self.result = name, fn, operands, result

    def Initialize(self, params: ExecuteParams) -> None:
        pass

    def ExecuteOnStream(self, params: ExecuteParams) -> None:
        allocs = params.buffer_allocations
        allocs[self.result].copy_(self.fn(*(allocs[o] for o in self.operands)))

    def Record(self, execute_params: ExecuteParams, command_buffer: "CommandBuffer") -> None:
        self.ExecuteOnStream(execute_params)                            # a kernel node with the same arguments


class CuDnnThunk:
    def __init__(self, fingerprint: str, args, output_args, should_memzero: bool, compiled_graphs: dict):
        self.fingerprint_ = fingerprint
        self.args_, self.output_args_ = list(args), list(output_args)
        self.should_memzero_ = should_memzero
        self.compiled_graphs = compiled_graphs
        self.graph_: CudnnSdpaGraph | None = None

    def Initialize(self, params: ExecuteParams) -> None:
        if self.graph_ is None:                                         # absl::call_once: DeserializeGraph
            self.graph_ = self.compiled_graphs[self.fingerprint_]

    def ExecuteOnStream(self, params: ExecuteParams) -> None:
        self.Initialize(params)
        buffer_args = []
        for name in self.args_:
            addr = params.buffer_allocations[name]
            if self.output_args_[len(buffer_args)]:
                if self.should_memzero_:
                    params.stream.MemZero(addr)
            buffer_args.append(addr)
        self.graph_.Execute(params.stream, buffer_args)

    def Record(self, execute_params: ExecuteParams, command_buffer: "CommandBuffer") -> None:
        assert self.graph_ is not None
        operands = [execute_params.buffer_allocations[name] for name in self.args_]
        assert not self.graph_.SupportsExplicitCommandBufferConstruction()

        def trace(stream: Stream) -> None:
            if _variant == "bug":
                pass                                                     # only the DNN graph is recorded
            else:
                if self.should_memzero_:
                    for i, operand in enumerate(operands):
                        if self.output_args_[i]:
                            stream.MemZero(operand)
            self.graph_.Execute(stream, operands)

        RecordTracedCommand(execute_params, trace)


class CommandBufferCmdExecutor:
    def __init__(self, commands):
        self.commands = list(commands)

    def Record(self, execute_params: ExecuteParams, command_buffer: "CommandBuffer", static_names) -> None:
        def record_all():
            for command in self.commands:
                command.Record(execute_params, command_buffer)
            return execute_params.buffer_allocations[command_buffer.result]
        allocs = execute_params.buffer_allocations
        command_buffer.graph, command_buffer.outputs = capture(
            record_all, device=execute_params.device, warmups=0, name="command buffer",
            owner="CommandBufferThunk", static={name: allocs[name] for name in static_names})
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
    def __init__(self, commands: CommandBufferCmdExecutor, thunks, result: str, static_names):
        self.commands_, self.thunks_ = commands, thunks
        self.command_buffer = CommandBuffer(result)
        self.warmup_done = False
        self.static_names = tuple(static_names)

    def Initialize(self, params: ExecuteParams) -> None:
        for thunk in self.thunks_:                                      # ready to fall back on them
            thunk.Initialize(params)
        if not self.thunks_:
            self.warmup_done = True
        if not self.warmup_done:
            return
        if self.command_buffer.state is CommandBuffer.State.kCreate:   # never recorded: record before execution
            self.commands_.Record(params, self.command_buffer, self.static_names)

    def ExecuteOnStream(self, params: ExecuteParams) -> None:
        if not self.warmup_done:
            with events.warmup(real=True):                              # warm-up execution through the thunks
                for thunk in self.thunks_:
                    thunk.ExecuteOnStream(params)
            self.warmup_done = True
            return
        replay(self.command_buffer.graph, self.command_buffer.outputs)  # executor->Submit(stream, command_buffer)


# --- xla/service/gpu/gpu_executable.cc: one encoder block ---------------------------------------------------------

class GpuExecutable:
    def __init__(self, device: str, enable_command_buffer: bool):
        gen = generator(46500)
        self.device = device
        w = lambda *s: randn(*s, gen=gen, device=device, scale=s[0] ** -0.5)   # noqa: E731
        o_slice = torch.zeros(BATCH, SEQ, WIDTH, device=device)        # temp allocation slice shared by two values
        self.allocs = {
            "x": torch.zeros(BATCH, SEQ, WIDTH, device=device),        # parameter 0
            "q_seqlen": torch.zeros(BATCH, dtype=torch.int64, device=device),
            "kv_seqlen": torch.zeros(BATCH, dtype=torch.int64, device=device),
            "w_qkv": w(WIDTH, 3 * WIDTH), "w_o": w(WIDTH, WIDTH), "w_up": w(WIDTH, WIDTH), "w_down": w(WIDTH, WIDTH),
            "qkv": torch.zeros(BATCH, SEQ, 3, HEADS, HEAD_DIM, device=device),
            "attn_out": o_slice,                                        # O: live from SDPA to the projection
            "h": torch.zeros(BATCH, SEQ, WIDTH, device=device),
            "mlp_act": o_slice,                                         # live after O died: same slice
            "out": torch.zeros(BATCH, SEQ, WIDTH, device=device),
        }
        compiled_graphs = {"fmha_fwd_0": CudnnSdpaGraph(HEAD_DIM ** -0.5)}
        thunks = [
            KernelThunk("qkv_fusion", lambda x, w_: (x @ w_).view(BATCH, SEQ, 3, HEADS, HEAD_DIM), ("x", "w_qkv"),
                        "qkv"),
            CuDnnThunk("fmha_fwd_0", ("qkv", "q_seqlen", "kv_seqlen", "attn_out"), (False, False, False, True),
                       should_memzero=True, compiled_graphs=compiled_graphs),
            KernelThunk("out_proj_fusion", lambda o, w_, x: o @ w_ + x, ("attn_out", "w_o", "x"), "h"),
            KernelThunk("mlp_up_fusion", lambda h, w_: torch.nn.functional.gelu(h @ w_), ("h", "w_up"), "mlp_act"),
            KernelThunk("mlp_down_fusion", lambda m, w_, h: m @ w_ + h, ("mlp_act", "w_down", "h"), "out"),
        ]
        if enable_command_buffer:        # --xla_gpu_enable_command_buffer=FUSION,CUDNN
            self.thunk_sequence = [CommandBufferThunk(CommandBufferCmdExecutor(thunks), thunks, "out",
                                                      ("x", "q_seqlen", "kv_seqlen"))]
        else:
            self.thunk_sequence = thunks

    def ExecuteThunks(self, x: torch.Tensor, q_seqlen: torch.Tensor, kv_seqlen: torch.Tensor) -> torch.Tensor:
        self.allocs["x"].copy_(x)
        self.allocs["q_seqlen"].copy_(q_seqlen)
        self.allocs["kv_seqlen"].copy_(kv_seqlen)
        params = ExecuteParams(self.allocs, Stream(), self.device)
        for thunk in self.thunk_sequence:
            thunk.Initialize(params)
        for thunk in self.thunk_sequence:
            thunk.ExecuteOnStream(params)
        return self.allocs["out"].clone()


def steps(device: str):
    gen = generator(11)
    batches = []
    for lens in SEQLENS:
        x = randn(BATCH, SEQ, WIDTH, gen=gen, device=device)          # padded positions hold the pad embedding
        seqlen = torch.tensor(lens, dtype=torch.int64, device=device)
        batches.append((x, seqlen, seqlen.clone()))
    return batches


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    batches = steps(device)

    def serve(enable_command_buffer: bool):
        executable = GpuExecutable(device, enable_command_buffer)
        return [executable.ExecuteThunks(*batch) for batch in batches]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
