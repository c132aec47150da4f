"""jaxlib's Triton custom call (``triton_kernel_call``) autotunes an autotuned kernel the first time it is called with a
given opaque, inside ``GetKernelCall``: ``AutotunedKernelCall::Autotune`` benchmarks every config on the stream it is
given, recording events around the launches and waiting for them (``gpuEventSynchronize``, ``gpuEventElapsedTime``), and
ends with ``gpuStreamSynchronize``. When XLA puts the call into a command buffer (``--xla_gpu_enable_command_buffer``
with ``CUSTOM_CALL``, and ``triton_kernel_call`` among the legacy command-buffer custom-call targets), the first call is
made by ``CustomCallCmd::RecordLegacyCustomCall``, which traces the call target on XLA's trace stream under stream
capture: the autotuning waits for a capturing stream, CUDA refuses, and the whole command buffer fails to record, so the
jitted step fails on its first execution. Without command buffers the same first call runs on the compute stream and
tunes. The fix (jax ``5e009f9``) switches the thread to relaxed capture mode and runs the tuning on a new non-blocking
side stream, which is not captured and may be waited for; only the tuned kernel's launch is recorded.

Upstream: https://github.com/jax-ml/jax/commit/5e009f9ff1f2741bdb2b755af171c1339003c020 ("Make triton kernels compatible
with command buffers", jax-ml/jax, Anlun Xu, committed 2024-01-29 to main, PiperOrigin-RevId 602436960; no pull request:
a Copybara commit). Read, in a mirror of jax-ml/jax: the commit's whole diff (``jaxlib/gpu/triton_kernels.cc``:
``Autotune`` loses its stream argument, calls ``gpuThreadExchangeStreamCaptureMode`` with
``CU_STREAM_CAPTURE_MODE_RELAXED``, creates one ``CU_STREAM_NON_BLOCKING`` stream for the tuning, destroys it and
restores the mode at the end; ``GetKernelCall``'s call site; ``triton_kernels.h``; ``vendor.h``'s new macros); at its
parent ``5e009f9^``: ``triton_kernels.cc`` whole (``Benchmark``: warm-up launch, ``gpuEventRecord`` start, the timed
launches, ``gpuEventRecord`` stop, ``gpuEventSynchronize(stop)``, ``gpuEventElapsedTime``; ``GetKernelCall``: a
function-static map keyed by the opaque, ``KernelCall::FromProto`` or ``AutotunedKernelCall::Autotune`` on a miss;
``Autotune``: the aliased-input saves, one timed iteration per config, ``timed_iters = max(kBenchmarkTimeMillis / best,
1)`` capped at 100, the timed pass that swaps the best config to ``configs_[0]``, the restores and
``gpuStreamSynchronize``; ``KernelCall::Launch``, ``Kernel::Launch``; ``TritonKernelCall``, the legacy status-returning
target) and ``triton_kernels.h`` (``Kernel``, ``KernelCall``, ``AutotunedKernelCall`` and its ``Config``). The
follow-ups, whole diffs: ``16636f9`` (2024-02-02: "When graph capture is not enabled, autotuning and kernel launch
should be on the same stream to avoid race condition": the side stream only when ``gpuStreamIsCapturing``), ``d620710``
(2024-02-08: ``cuCtxGetCurrent`` instead of ``cuStreamGetCtx`` in ``Kernel::Launch`` during capture, a CUDA bug),
``3a69b80`` (2024-02-23: the side stream waits on an event of the main stream) and ``1ae2022`` (2024-03-01, Eugene
Zhulenev, "Do not capture jax-triton calls that require autotuning": the side stream is removed and ``Autotune`` returns
``FailedPrecondition`` under capture, because "Autotuning can rely on real data present in input buffers to use them in
address computation, but in graph capture mode buffers can have arbitrary data"); ``248575b`` (2026, jax PR #37094,
which later tunes in the FFI handler's initialize stage instead). XLA (stored later versions of openxla/xla, not the
revision of January 2024): ``xla/service/gpu/runtime/command_buffer_thunk.cc`` whole at 001b90f4 (``Initialize`` records
the command sequence while the command buffer is in ``kCreate`` state, before any execution; ``ExecuteOnStream``
re-records when ``ShouldUpdateCommandBuffer`` sees new allocation addresses, then ``Submit``s; no eager warm-up
iteration), and, as excerpts found by string search: ``command_buffer_cmd.cc``
(``CustomCallCmd::RecordLegacyCustomCall``: ``TraceCommandBufferFactory::Create(...,
execute_params.command_buffer_trace_stream, [&](se::Stream* stream) { call_target_(stream, buffers.data(),
opaque_.data(), ...) })``), ``gpu_command_buffer.cc`` (``GpuCommandBuffer::Trace``: ``StreamBeginCapture(gpu_stream,
StreamCaptureMode::kThreadLocal)``, then ``InternalError("Failed to capture gpu graph: ...")`` when the traced function
fails) and ``command_buffer_scheduling.cc`` (legacy custom calls enter command buffers only when their target is listed
in ``legacy_command_buffer_custom_call_targets``); the description of XLA #33073 (2025, "add a warm up iteration for
command buffer thunk").
Not read: jax-triton's Python side (``triton_call`` and how it serializes an autotuned call's configs into the opaque);
XLA's code of January 2024 itself (the versions read are later; that the January recording also ran before any eager
execution is inferred from them and from #33073's description of a warm-up added in 2025); any user report: none was
found, the commit message is the only statement of the problem ("Autotuning is not compatible with graph capture because
it requires synchronizing"); CUDA's exact error for ``cuEventSynchronize`` on an event recorded in a capturing stream
(from the CUDA documentation as I recall it, ``CUDA_ERROR_CAPTURED_EVENT``; not run here).
Symptom: no user report; with command buffers on and ``triton_kernel_call`` a command-buffer target, a jitted step that
calls an autotuned jax-triton kernel fails on its first execution: the event wait inside ``Benchmark`` is refused on the
capturing trace stream, ``TritonKernelCall`` reports the failure through its custom-call status, and XLA returns "Failed
to capture gpu graph: ..." (the message ``GpuCommandBuffer::Trace`` builds; the exact CUDA text is not quoted: not run).
Without command buffers the step runs and tunes.
Mechanism: the kernel-call cache is empty on the first execution, so the call that XLA traces into the command buffer is
the one that tunes. ``Autotune`` is handed the stream XLA traces on and benchmarks on it; ``Benchmark`` waits for the
device to read the elapsed time, and a capture cannot wait. Eagerly the first call is an ordinary launch on the compute
stream, and the wait is allowed.
Doctor: sync-in-capture, at Autotune. The failure is a host wait for the device (the benchmark's event wait and elapsed
time read) inside a stream capture; it happens in ``Benchmark``, but ``Benchmark`` waits on whatever stream it is given,
and ``Autotune`` decides that stream: it is the function the fix changes (relaxed mode and a side stream there; neither
``Benchmark`` nor ``KernelCall::Launch`` changes).
Fix (upstream): in ``Autotune``: ``gpuThreadExchangeStreamCaptureMode(&capture_mode)`` with ``RELAXED``, then
``gpuStreamCreate(&stream, CU_STREAM_NON_BLOCKING)``; every save, benchmark and restore runs on that stream; at the end
``gpuStreamSynchronize``, ``gpuStreamDestroy`` and the mode exchanged back. The tuned ``KernelCall`` is cached, and
``TritonKernelCall`` then launches it on XLA's trace stream, which records the one launch. (The follow-ups above
narrowed this to captures only, ordered the side stream after the main one, and a month later replaced it by a refusal
to tune under capture at all: on CUDA the capture-time buffers hold whatever they held, since the captured kernels that
produce them have not run; the tuning's timings here do not depend on the data, so that later concern does not arise in
this workload.)
Modelled: ``Benchmark``, ``GetKernelCall`` (the function-static cache keyed by the opaque), ``Kernel`` (``Launch``),
``KernelCall`` (``Launch``), ``AutotunedKernelCall`` (``Config``, ``configs_``, ``Autotune``), ``TritonKernelCall`` (the
legacy target with its status) and ``kBenchmarkTimeMillis``; XLA: ``ExecuteParams`` (with
``command_buffer_trace_stream``), ``KernelThunk`` (GEMMs and fusions), ``CustomCallThunk``, ``CustomCallCmd``
(``RecordLegacyCustomCall``), ``CommandBufferCmdSequence`` (``Record``), ``CommandBufferThunk`` (``Initialize`` records
in ``kCreate`` state, ``ExecuteOnStream`` submits) and ``GpuExecutable`` (``ExecuteThunks``).
Stand-ins: a stream is an object naming a device stream; launches run as torch ops on the calling thread's current
stream. ``Autotune``'s body is the function ``_autotune_on``, so that the fix can hand it the side stream; ``Autotune``
itself keeps only the choice of stream, which is what the fix changed. The fix's relaxed mode plus side stream is
modelled as running the tuning on a helper thread with a stream of its own (a new ``torch.cuda.Stream`` there on CUDA):
on CUDA either way the tuning's launches execute, uncaptured, and its waits are allowed (XLA captures in thread-local
mode, so another thread may wait; the CPU engine records only the capturing thread's ops). Event timing is modelled:
``gpuEventRecord`` stand-ins are device scalars, the stop event's timestamp is the start's plus the launches' modelled
duration (a wave count over ``NUM_SMS`` times a per-program cost from the config's rows and warps), and
``gpuEventSynchronize`` + ``gpuEventElapsedTime`` is one ``.item()`` of their difference: the host wait. So the tuned
config is deterministic, and the same on both devices. The Triton kernel is a row-wise RMSNorm (weight ``gamma``) whose
configs differ in rows per program and warps; every config computes the same numbers. No input aliases an output (the
aliased-input saves and restores are not exercised), ``CanLaunchOnDevice`` is always true, and the final
``gpuStreamSynchronize`` of the side stream is not modelled (the side stream's last wait is the last benchmark's read).
The whole thunk sequence is captured as one graph in thread-local mode (XLA records GEMMs and fusions as explicit nodes
and traces only the custom call into a nested command buffer); its parameters are copied into fixed buffers each step,
so the command buffer needs no update (XLA would update it when parameter addresses change, and a re-trace would then
hit the kernel-call cache: not modelled). The reference run and the served run stand for two processes: the kernel-call
cache is emptied before each.
Workload: a jitted step on a batch of 8 rows: ``h = x @ w1`` (cuBLAS), ``y = rms_norm(h, gamma)`` (an autotuned
jax-triton call with three configs: 1, 2 and 4 rows per program), ``out = tanh(y) @ w2`` (a fusion and a GEMM); width
32, float64; three steps with fresh ``x``; command buffers FUSION, CUBLAS, CUSTOM_CALL. Outputs: each step's ``out``.
Measured: bug: misbehaves (raised CaptureError: Tensor.item() inside graph capture needs the device's values on the host
(a host synchronisation), which a CUDA graph cannot wait for (cudaErrorStreamCaptureUnsupported).): the first
execution's recording fails at the elapsed-time read in ``Benchmark`` (``GetKernelCall`` -> ``Autotune`` ->
``_autotune_on`` -> ``Benchmark``), on the trace stream. Fix: equals eager (max |graph - eager| = 0): the tuning runs on
the side stream (``BLOCK_M=2, num_warps=2`` wins, as eagerly), the graph records 46 ops with the tuned launch, and its
three submissions equal the three eager steps. About 2 s per variant on the CPU (most of it the eager tuning's 100 timed
launches per config).
"""
from __future__ import annotations

import dataclasses
import threading

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/jax-ml/jax/commit/5e009f9ff1f2741bdb2b755af171c1339003c020"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "Autotune"
SYMPTOM = ("With XLA command buffers on, the first call of an autotuned jax-triton kernel is traced under stream "
           "capture and autotunes there: its benchmark waits for the capturing stream, so the command buffer fails "
           "to record and the jitted step fails, where without command buffers it tunes and runs")

BATCH, FEATURES, HIDDEN, STEPS = 8, 16, 32, 3
EPS = 1e-6
NUM_SMS = 4                        # stand-in device: programs run in waves of NUM_SMS
kBenchmarkTimeMillis = 10.0
DTYPE = torch.float64

_variant = "bug"


# --- the streams (stand-in) -------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Stream:
    """A ``gpuStream_t``: launches made with it run on the calling thread's current torch stream."""
    name: str
    device: str


class RelaxedSideStream(Stream):
    """``gpuThreadExchangeStreamCaptureMode(RELAXED)`` + ``gpuStreamCreate(CU_STREAM_NON_BLOCKING)`` (stand-in): the
    work given to ``run`` executes on a helper thread with a stream of its own (a new CUDA stream on CUDA), which no
    capture records and which may wait for the device; ``run`` returns when it is done."""

    def __init__(self, device: str):
        super().__init__("autotune side stream", device)

    def run(self, fn, *args):
        result: dict = {}

        def body():
            try:
                if torch.device(self.device).type == "cuda":
                    with torch.cuda.stream(torch.cuda.Stream(self.device)):
                        result["value"] = fn(*args)
                else:
                    result["value"] = fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed back to the caller's thread
                result["error"] = e
        worker = threading.Thread(target=body, name="autotune side stream")
        worker.start()
        worker.join()                                   # gpuStreamDestroy / exchange the capture mode back
        if "error" in result:
            raise result["error"]
        return result["value"]


# --- jaxlib/gpu/triton_kernels.{h,cc} (reduced) -----------------------------------------------------------------------

class Kernel:
    """A compiled Triton kernel: ``_rms_norm_kernel`` with ``BLOCK_M`` rows per program (the config's constexpr)."""

    def __init__(self, kernel_name: str, num_warps: int, block_m: int):
        self.kernel_name_, self.num_warps, self.block_m = kernel_name, num_warps, block_m

    def Launch(self, stream: Stream, grid, params) -> None:
        x, gamma, y, m, n = params
        for pid in range(grid[0]):                      # program pid: rows [pid * BLOCK_M, (pid + 1) * BLOCK_M) & < M
            r0, r1 = pid * self.block_m, min(m, (pid + 1) * self.block_m)
            if r0 >= r1:
                continue
            rows = x[r0:r1, :n]
            rstd = torch.rsqrt(rows.pow(2).mean(dim=-1, keepdim=True) + EPS)
            y[r0:r1, :n] = rows * rstd * gamma[:n]

    def ModelledTimeMs(self, grid) -> float:
        """Stand-in for what the device's clock would show: waves of programs times a per-program cost."""
        waves = -(-grid[0] // NUM_SMS)
        return waves * (0.004 + self.block_m * HIDDEN * 0.0005 / self.num_warps)


class KernelCall:
    def __init__(self, kernel: Kernel, grid, parameters):
        self.kernel_, self.grid_, self.parameters_ = kernel, grid, parameters      # parameters: "array" or a scalar

    def Launch(self, stream: Stream, buffers) -> None:
        it = iter(buffers)
        params = [next(it) if p == "array" else p for p in self.parameters_]
        self.kernel_.Launch(stream, self.grid_, params)

    def ModelledTimeMs(self) -> float:
        return self.kernel_.ModelledTimeMs(self.grid_)


def Benchmark(stream: Stream, kernel_call: KernelCall, buffers, num_iterations: int) -> float:
    kernel_call.Launch(stream, buffers)                                           # Warm-up.
    start = torch.zeros((), dtype=DTYPE, device=stream.device)                  # gpuEventRecord(start, stream)
    for _ in range(num_iterations):
        kernel_call.Launch(stream, buffers)
    stop = start + num_iterations * kernel_call.ModelledTimeMs()                 # gpuEventRecord(stop, stream)
    elapsed_ms = (stop - start).item()          # gpuEventSynchronize(stop); gpuEventElapsedTime(&ms, start, stop)
    return elapsed_ms


class AutotunedKernelCall:
    @dataclasses.dataclass
    class Config:
        kernel_call: KernelCall
        description: str

    def __init__(self, name: str, configs, input_output_aliases):
        self.name_, self.configs_, self.input_output_aliases_ = name, list(configs), list(input_output_aliases)

    @staticmethod
    def Autotune(kernel_call: AutotunedKernelCall, stream: Stream, buffers) -> KernelCall:
        if _variant == "bug":
            # Before 5e009f9: tune on the caller's stream (XLA's trace stream when it records a command buffer).
            return _autotune_on(kernel_call, stream, buffers)
        # 5e009f9: relaxed capture mode for this thread and a side stream that no capture records.
        side = RelaxedSideStream(stream.device)
        return side.run(_autotune_on, kernel_call, side, buffers)


def _autotune_on(kernel_call: AutotunedKernelCall, stream: Stream, buffers) -> KernelCall:
    """``Autotune``'s body, on ``stream`` (no input aliases an output here: nothing to save or restore)."""
    best = float("inf")
    for config in kernel_call.configs_:          # one iteration of each to choose how many to time
        best = min(best, Benchmark(stream, config.kernel_call, buffers, 1))
    timed_iters = min(max(int(kBenchmarkTimeMillis / best), 1), 100)
    best = float("inf")
    for i, config in enumerate(kernel_call.configs_):
        t = Benchmark(stream, config.kernel_call, buffers, timed_iters)
        if t < best:
            best = t
            kernel_call.configs_[0], kernel_call.configs_[i] = kernel_call.configs_[i], kernel_call.configs_[0]
    return kernel_call.configs_[0].kernel_call


_kernel_calls: dict[str, KernelCall] = {}        # GetKernelCall's function-static map, keyed by the opaque
_protos: dict[str, AutotunedKernelCall] = {}     # what each opaque deserializes to (stand-in for the zlib'd proto)


def GetKernelCall(opaque: str, stream: Stream, buffers) -> KernelCall:
    kernel_call = _kernel_calls.get(opaque)
    if kernel_call is not None:
        return kernel_call
    autotuned_call = _protos[opaque]                                  # AutotunedKernelCall::FromProto
    kernel_call = AutotunedKernelCall.Autotune(autotuned_call, stream, buffers)
    _kernel_calls[opaque] = kernel_call
    return kernel_call


def TritonKernelCall(stream: Stream, buffers, opaque: str, opaque_len: int, status: dict) -> None:
    try:
        kernel_call = GetKernelCall(opaque, stream, buffers)
        kernel_call.Launch(stream, buffers)
    except RuntimeError as e:                                         # XlaCustomCallStatusSetFailure(status, msg)
        status["failure"] = e
        return


def lower_autotuned_rms_norm(m: int, n: int) -> str:
    """What ``triton_call(..., configs=...)`` hands XLA (stand-in, not read): an opaque naming three configs."""
    configs = []
    for block_m, num_warps in ((1, 1), (4, 2), (2, 2)):
        kernel = Kernel("_rms_norm_kernel", num_warps, block_m)
        call = KernelCall(kernel, (-(-m // block_m), 1, 1), ["array", "array", "array", m, n])
        configs.append(AutotunedKernelCall.Config(call, f"BLOCK_M={block_m}, num_warps={num_warps}"))
    opaque = f"rms_norm[{m}x{n}]"
    _protos[opaque] = AutotunedKernelCall("rms_norm", configs, input_output_aliases=())
    return opaque


# --- xla/service/gpu/runtime: thunks and the command buffer (reduced) -------------------------------------------------

class ExecuteParams:
    def __init__(self, buffer_allocations: dict, stream: Stream, command_buffer_trace_stream: Stream):
        self.buffer_allocations = buffer_allocations
        self.stream, self.command_buffer_trace_stream = stream, command_buffer_trace_stream


class KernelThunk:
    """A GEMM or a fusion: ``fn`` of the operands, written into the result allocation."""

    def __init__(self, name: str, fn, operands, result: str):
        self.name, self.fn, self.operands, self.result = name, fn, operands, result

    def Initialize(self, params: ExecuteParams) -> None:
        pass

    def ExecuteOnStream(self, params: ExecuteParams) -> None:
        allocs = params.buffer_allocations
        allocs[self.result].copy_(self.fn(*(allocs[o] for o in self.operands)))

    def Record(self, params: ExecuteParams) -> None:
        self.ExecuteOnStream(params)                    # recorded as a kernel node


class CustomCallThunk:
    """A legacy (status-returning) custom call: ``call_target(stream, buffers, opaque, len, status)``."""

    def __init__(self, call_target, operands, results, opaque: str):
        self.call_target_, self.operands_, self.results_, self.opaque_ = call_target, operands, results, opaque

    def Initialize(self, params: ExecuteParams) -> None:
        pass

    def _call(self, params: ExecuteParams, stream: Stream) -> None:
        allocs = params.buffer_allocations
        buffers = [allocs[name] for name in (*self.operands_, *self.results_)]
        status: dict = {}
        self.call_target_(stream, buffers, self.opaque_, len(self.opaque_), status)
        if "failure" in status:
            raise status["failure"]

    def ExecuteOnStream(self, params: ExecuteParams) -> None:
        self._call(params, params.stream)


class CustomCallCmd(CustomCallThunk):
    def RecordLegacyCustomCall(self, params: ExecuteParams) -> None:
        # TraceCommandBufferFactory::Create(..., command_buffer_trace_stream, [&](stream) { call_target_(stream, ...) })
        self._call(params, params.command_buffer_trace_stream)

    def Record(self, params: ExecuteParams) -> None:
        self.RecordLegacyCustomCall(params)


class CommandBufferCmdSequence:
    def __init__(self, commands, result: str, static_names):
        self.commands, self.result, self.static_names = list(commands), result, tuple(static_names)

    def Record(self, params: ExecuteParams):
        def record():
            for cmd in self.commands:
                cmd.Record(params)
            return params.buffer_allocations[self.result]
        allocs = params.buffer_allocations
        # GpuCommandBuffer::Trace begins the capture in thread-local mode; XLA runs no eager warm-up first.
        return capture(record, device=params.stream.device, warmups=0, name="command buffer",
                       owner="CommandBufferThunk", static={n: allocs[n] for n in self.static_names},
                       capture_error_mode="thread_local")


class CommandBufferThunk:
    def __init__(self, commands: CommandBufferCmdSequence):
        self.commands_ = commands
        self.state = "kCreate"
        self.graph = self.outputs = None

    def Initialize(self, params: ExecuteParams) -> None:
        if self.state == "kCreate":                     # never recorded: record the command sequence now
            self.graph, self.outputs = self.commands_.Record(params)
            self.state = "kFinalized"

    def ExecuteOnStream(self, params: ExecuteParams) -> None:
        replay(self.graph, self.outputs)                # executor->Submit(stream, *command_buffer)


class GpuExecutable:
    """gemm -> triton_kernel_call (autotuned RMSNorm) -> tanh fusion -> gemm."""

    def __init__(self, device: str, enable_command_buffer: bool):
        gen = generator(135)
        r = lambda *s, scale: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        z = lambda *s: torch.zeros(*s, dtype=DTYPE, device=device)                          # noqa: E731
        self.device = device
        self.allocs = {
            "x": z(BATCH, FEATURES),                                   # parameter 0
            "w1": r(FEATURES, HIDDEN, scale=FEATURES ** -0.5), "gamma": 1.0 + r(HIDDEN, scale=0.1),
            "w2": r(HIDDEN, FEATURES, scale=HIDDEN ** -0.5),
            "h": z(BATCH, HIDDEN), "y": z(BATCH, HIDDEN), "t": z(BATCH, HIDDEN), "out": z(BATCH, FEATURES),
        }
        opaque = lower_autotuned_rms_norm(BATCH, HIDDEN)
        self.stream = Stream("compute", device)
        self.trace_stream = Stream("command buffer trace", device)
        gemm = KernelThunk("gemm", lambda x, w: x @ w, ("x", "w1"), "h")
        fusion = KernelThunk("tanh_fusion", torch.tanh, ("y",), "t")
        gemm1 = KernelThunk("gemm.1", lambda t, w: t @ w, ("t", "w2"), "out")
        if enable_command_buffer:        # --xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUSTOM_CALL
            call = CustomCallCmd(TritonKernelCall, ("h", "gamma"), ("y",), opaque)
            self.thunks = [CommandBufferThunk(CommandBufferCmdSequence([gemm, call, fusion, gemm1], "out", ("x",)))]
        else:
            self.thunks = [gemm, CustomCallThunk(TritonKernelCall, ("h", "gamma"), ("y",), opaque), fusion, gemm1]

    def ExecuteThunks(self, x: torch.Tensor) -> torch.Tensor:
        self.allocs["x"].copy_(x)
        params = ExecuteParams(self.allocs, self.stream, self.trace_stream)
        for thunk in self.thunks:
            thunk.Initialize(params)
        for thunk in self.thunks:
            thunk.ExecuteOnStream(params)
        return self.allocs["out"].clone()


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(5)
    batches = [randn(BATCH, FEATURES, gen=gen, device=device).to(DTYPE) for _ in range(STEPS)]

    def serve(enable_command_buffer: bool):
        _kernel_calls.clear()                           # a fresh process: no kernel call tuned yet
        executable = GpuExecutable(device, enable_command_buffer)
        return [executable.ExecuteThunks(x) for x in batches]

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
