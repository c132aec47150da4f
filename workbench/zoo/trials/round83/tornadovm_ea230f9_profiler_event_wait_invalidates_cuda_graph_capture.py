"""With the profiler on, a ``withCUDAGraph`` plan waits on events recorded into its capturing stream: the capture is invalidated and the plan's output is never written.

Upstream: https://github.com/beehive-lab/TornadoVM/commit/ea230f9bcdd62335828f7a9850e3c319f93aed5b ("[fix] Skip
profiling operations during CUDA graph capture to prevent invalidation of the captures"), repository
beehive-lab/TornadoVM, merged with https://github.com/beehive-lab/TornadoVM/pull/800 ("[JDK21] Support for CUDA
streams ...", merge c8c3591f1, 2026-07-09); its regression test is ``TestCUDAStreams.
testMultiStreamGraphReplayWithProfiler`` (fc9258211). No separate issue.
Symptom: a task graph (``transferToDevice(EVERY_EXECUTION, x, y)``, tasks ``axpy`` and ``scale``,
``transferToHost(EVERY_EXECUTION, result)``) run by a plan with ``withCUDAGraph().withProfiler(ProfilerMode.SILENT)``
on the PTX backend prints ``[TornadoVM-PTX-JNI] ERROR : ...`` lines (CUDA_ERROR_CAPTURED_EVENT, then
CUDA_ERROR_STREAM_CAPTURE_INVALIDATED at ``cuStreamEndCapture``) and ``result`` never receives the computed values,
on the first execution and on every later one ("invalidated the capture and failed every subsequent operation", the
test's comment). The same plan without ``withCUDAGraph``, or without the profiler, is right.
Mechanism: the bytecodes of a CUDA-graph plan (``TornadoVMGraphCompiler``) put the per-execution transfers, the
launches and the copy-outs between ``CUDA_GRAPH_BEGIN_CAPTURE`` and ``CUDA_GRAPH_END_CAPTURE``. On the first
execution ``TornadoVMInterpreter`` runs that region with ``insideCaptureRegion`` set and the plan's stream capturing
(``PTXStream.beginGraphCapture`` -> ``cuStreamBeginCapture``, global mode). The native transfers know about capture
(``writeArrayHtoD``/``writeArrayDtoH`` skip their ``cuEventQuery``/``cuEventSynchronize`` when
``cuStreamIsCapturing``), but the profiler bookkeeping above them does not: with ``TornadoOptions.
isProfilerEnabled()``, ``transferHostToDeviceAlways`` resolves each transfer event and calls
``event.waitForEvents(...)`` (``PTXEvent`` -> native ``cuEventQuery``, then ``cuEventSynchronize``) to read its
elapsed time; ``PTXDeviceContext.updateProfiler`` does the same after each kernel launch, and
``transferDeviceToHost`` after each copy-out. Those events were recorded into the capturing stream: CUDA refuses the
query (CUDA_ERROR_CAPTURED_EVENT) and invalidates the capture. The PTX JNI only logs failing results
(``LOG_PTX_AND_VALIDATE``), so execution goes on: the rest of the region is refused
(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED), ``cuStreamEndCapture`` returns a NULL graph, ``cuGraphInstantiate`` fails,
``PTXStream.endGraphCaptureAndInstantiate`` stores the bad handle in ``executionGraphHandles`` anyway, and
``CUDA_GRAPH_LAUNCH`` launches nothing; later executions skip the (already "captured") region and launch nothing
again. No kernel and no copy-out ever runs, and ``result`` keeps what it held.
Doctor: sync-in-capture, at transferHostToDeviceAlways (the first host wait inside the capture region: it waits on
the transfer event just recorded into the capturing stream, which invalidates the capture; the fix adds
``!insideCaptureRegion`` to its profiler guard, and the same guard to the other waits reached later in the region).
Fix (upstream): every profiler wait is skipped while capturing: ``if (TornadoOptions.isProfilerEnabled() &&
!insideCaptureRegion && allEvents != null)`` in ``transferHostToDeviceOnce``/``transferHostToDeviceAlways``, the same
for ``readEvent`` in ``transferDeviceToHost``/``transferDeviceToHostBlocking`` and for the atomics write in
``executeLaunch``; ``PTXDeviceContext.updateProfiler``/``updateProfilerKernelContextWrite`` (and the CUDA-C
backend's ``CUDAInstalledCode``/``CUDAKernelScheduler.updateProfiler``) add ``&& !isStreamCapturing(executionPlanId)``.
Per-operation device times are then not collected for captured operations.
Modelled: the PTX backend, single stream (the regression test adds ``withIntraPlanConcurrency()``, whose fork/join
capture over three role streams reaches the same waits), the test's task graph at 16 elements, 6 executions with
new ``x``/``y`` each. The CUDA driver is a small stand-in with CUDA's names and rules: an event recorded on a
capturing stream belongs to that capture; a host query or wait on it is refused and invalidates the capture (the
engine's ``synchronize()``, which a capture refuses on both backends, stands for that host wait); once invalidated,
every later call on the stream fails and ``cuStreamEndCapture`` aborts the capture (the engine capture is left with
the refused wait's error) and hands back no graph. ``cuGraphInstantiate`` leaves its out-handle unset upstream; it is
modelled as NULL, which ``cuGraphLaunch`` rejects. JNI error lines go to ``PTX_JNI_LOG`` instead of stdout. Not
modelled: the kernel-context write (already deferred during capture before the fix), the atomics buffer, batches.
On the CUDA-C backend the same capture fails too, but ``CUDACommandQueue.endGraphCaptureAndInstantiate`` throws a
``TornadoBailoutRuntimeException`` there, and with the default ``tornado.recover.bailout=True`` the plan reruns the
tasks as sequential Java (right values, slowly); only the PTX path, modelled here, returns wrong values.
"""
from __future__ import annotations

import contextlib
import itertools

import torch

from workbench.engine import CaptureError, events, graph, host, new_graph, synchronize
from workbench.zoo.kit import compare, replay

UPSTREAM = "https://github.com/beehive-lab/TornadoVM/commit/ea230f9bcdd62335828f7a9850e3c319f93aed5b"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "transferHostToDeviceAlways"
SYMPTOM = ("withCUDAGraph + profiler on PTX: the profiler waits on events recorded into the capturing stream, the "
           "capture is invalidated, the graph launch runs nothing and the output array is never written")

GRAPH_N, GRAPH_REPLAYS, ALPHA = 16, 6, 0.5

# --- CUDA driver (what the PTX JNI calls) ---------------------------------------------------------------
CUDA_SUCCESS, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_INVALID_HANDLE, CUDA_ERROR_NOT_READY = 0, 1, 400, 600
CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, CUDA_ERROR_CAPTURED_EVENT = 901, 907
CU_STREAM_CAPTURE_STATUS_NONE, CU_STREAM_CAPTURE_STATUS_ACTIVE, CU_STREAM_CAPTURE_STATUS_INVALIDATED = 0, 1, 2

PTX_JNI_LOG: list[str] = []


def LOG_PTX_AND_VALIDATE(name: str, result: int) -> None:
    """ptx_log.h: a failing CUresult is printed, never raised."""
    if result != CUDA_SUCCESS:
        PTX_JNI_LOG.append(f"\t[TornadoVM-PTX-JNI] ERROR : {name} -> Returned: {result}")


class _StreamCapture:
    """The driver's state of one stream capture: the graph being built, and whether it was invalidated."""

    def __init__(self, device, name):
        self.device = device
        self.g = new_graph(device)
        self.ctx = contextlib.ExitStack()
        self.ctx.enter_context(graph(self.g, name=name))
        self.error: BaseException | None = None          # the call that invalidated the capture
        self.copiesToHost: list[torch.Tensor] = []       # memcpy D2H nodes: the host memory the graph writes


class CUstream:
    def __init__(self, device):
        self.device = device
        self.capture: _StreamCapture | None = None


class CUevent:
    _clock = itertools.count()                     # the device clock the event timestamps read

    def __init__(self):
        self.capture: _StreamCapture | None = None
        self.recorded, self.timestamp, self.device = False, 0, "cpu"


class CUgraphExec:
    def __init__(self, g, outputs):
        self.g, self.outputs = g, outputs


def _invalidated(stream: CUstream) -> bool:
    return stream.capture is not None and stream.capture.error is not None


def cuStreamBeginCapture(stream: CUstream, mode: int, name: str) -> int:
    stream.capture = _StreamCapture(stream.device, name)
    return CUDA_SUCCESS


def cuStreamIsCapturing(stream: CUstream) -> int:
    if stream.capture is None:
        return CU_STREAM_CAPTURE_STATUS_NONE
    return CU_STREAM_CAPTURE_STATUS_INVALIDATED if _invalidated(stream) else CU_STREAM_CAPTURE_STATUS_ACTIVE


def cuEventRecord(event: CUevent, stream: CUstream) -> int:
    if _invalidated(stream):
        return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
    event.capture, event.device = stream.capture, stream.device    # recorded into a capture: a node of it
    event.recorded = True
    event.timestamp = next(CUevent._clock)
    return CUDA_SUCCESS


def _hostWaitOnCapturedEvent(event: CUevent) -> int:
    """A host query or wait on an event last recorded in a capturing stream: CUDA refuses it and invalidates
    the capture. The engine's synchronize() is that host wait (refused in a capture on both backends)."""
    capture = event.capture
    if capture.error is not None:
        return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
    try:
        synchronize(event.device)
    except CaptureError as e:
        capture.error = e
        return CUDA_ERROR_CAPTURED_EVENT
    return CUDA_SUCCESS


def cuEventQuery(event: CUevent) -> int:
    if not event.recorded:                         # never recorded: nothing to wait for
        return CUDA_SUCCESS
    if event.capture is not None:
        return _hostWaitOnCapturedEvent(event)
    return CUDA_SUCCESS if torch.device(event.device).type == "cpu" else CUDA_ERROR_NOT_READY


def cuEventSynchronize(event: CUevent) -> int:
    if not event.recorded:
        return CUDA_SUCCESS
    if event.capture is not None:
        return _hostWaitOnCapturedEvent(event)
    synchronize(event.device)
    return CUDA_SUCCESS


def cuEventElapsedTime(before: CUevent, after: CUevent) -> tuple[int, float]:
    if not (before.recorded and after.recorded):
        return CUDA_ERROR_INVALID_HANDLE, 0.0
    if after.capture is not None:
        return CUDA_ERROR_CAPTURED_EVENT if after.capture.error is None else CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, 0.0
    return CUDA_SUCCESS, float(after.timestamp - before.timestamp)


def cuMemcpyHtoDAsync(dst: torch.Tensor, src: torch.Tensor, stream: CUstream) -> int:
    if _invalidated(stream):
        return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
    dst.copy_(src, non_blocking=True)
    return CUDA_SUCCESS


def cuMemcpyDtoHAsync(dst: torch.Tensor, src: torch.Tensor, stream: CUstream) -> int:
    if _invalidated(stream):
        return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
    dst.copy_(src, non_blocking=True)
    if stream.capture is not None:
        stream.capture.copiesToHost.append(dst)
    return CUDA_SUCCESS


def cuLaunchKernel(kernel, args, stream: CUstream) -> int:
    if _invalidated(stream):
        return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
    kernel(*args)
    return CUDA_SUCCESS


def cuStreamEndCapture(stream: CUstream):
    """Ends the capture: an invalidated one is aborted and gives a NULL graph."""
    capture, stream.capture = stream.capture, None
    if capture.error is not None:
        e = capture.error
        capture.ctx.__exit__(type(e), e, e.__traceback__)
        return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, None
    capture.ctx.close()
    return CUDA_SUCCESS, capture


def cuGraphInstantiate(g):
    if g is None:
        return CUDA_ERROR_INVALID_VALUE, None
    return CUDA_SUCCESS, CUgraphExec(g.g, tuple(g.copiesToHost))


def cuGraphLaunch(graphExec, stream: CUstream) -> int:
    if graphExec is None:
        return CUDA_ERROR_INVALID_VALUE
    replay(graphExec.g, graphExec.outputs)
    return CUDA_SUCCESS


def cuStreamSynchronize(stream: CUstream) -> int:
    synchronize(stream.device)
    return CUDA_SUCCESS


# --- tornado-drivers/ptx: PTXEvent, PTXStream (and their JNI) ---------------------------------------------

class PTXEvent:
    def __init__(self, before: CUevent, after: CUevent, name: str):
        self.eventWrapper, self.name = (before, after), name

    def waitForEvents(self, executionPlanId) -> None:
        # PTXEvent.cpp tornadoVMWaitForEvents: wait only if not completed yet
        event = self.eventWrapper[1]
        result = cuEventQuery(event)
        if result != CUDA_SUCCESS:
            LOG_PTX_AND_VALIDATE("cuEventQuery", result)
            LOG_PTX_AND_VALIDATE("cuEventSynchronize", cuEventSynchronize(event))

    def getElapsedTime(self) -> int:
        result, time = cuEventElapsedTime(*self.eventWrapper)
        LOG_PTX_AND_VALIDATE("cuEventElapsedTime", result)
        return int(time)


class PTXStream:
    def __init__(self, device):
        self.streamPool = CUstream(device)
        self.ptxEventPool: list[PTXEvent] = []
        self.capturing = False

    def registerEvent(self, eventWrapper, name: str) -> int:
        self.ptxEventPool.append(PTXEvent(*eventWrapper, name))
        return len(self.ptxEventPool) - 1

    def _recordAround(self, what, name):
        before, after = CUevent(), CUevent()
        LOG_PTX_AND_VALIDATE("cuEventRecord", cuEventRecord(before, self.streamPool))
        LOG_PTX_AND_VALIDATE(name, what())
        LOG_PTX_AND_VALIDATE("cuEventRecord", cuEventRecord(after, self.streamPool))
        return before, after

    def enqueueWrite(self, deviceBuffer, hostArray) -> int:
        """writeArrayHtoD (memory segment): the native sync is skipped while capturing."""
        before, after = self._recordAround(lambda: cuMemcpyHtoDAsync(deviceBuffer, hostArray, self.streamPool),
                                           "cuMemcpyHtoDMemSeg")
        if cuStreamIsCapturing(self.streamPool) != CU_STREAM_CAPTURE_STATUS_ACTIVE:
            if cuEventQuery(after) != CUDA_SUCCESS:
                cuEventSynchronize(after)
        return self.registerEvent((before, after), "DESC_WRITE_FLOAT")

    def enqueueRead(self, hostArray, deviceBuffer) -> int:
        """writeArrayDtoH (memory segment, blocking): the native sync is skipped while capturing."""
        before, after = self._recordAround(lambda: cuMemcpyDtoHAsync(hostArray, deviceBuffer, self.streamPool),
                                           "cuMemcpyDtoHMemSeg")
        if cuStreamIsCapturing(self.streamPool) != CU_STREAM_CAPTURE_STATUS_ACTIVE:
            if cuEventQuery(after) != CUDA_SUCCESS:
                cuEventSynchronize(after)
        return self.registerEvent((before, after), "DESC_READ_FLOAT")

    def enqueueKernelLaunch(self, module, args) -> int:
        before, after = self._recordAround(lambda: cuLaunchKernel(module, args, self.streamPool), "cuLaunchKernel")
        return self.registerEvent((before, after), "DESC_PARALLEL_KERNEL")

    def beginGraphCapture(self, name: str) -> None:
        result = cuStreamBeginCapture(self.streamPool, 0, name)
        if result != 0:
            raise RuntimeError(f"Failed to begin capture. Error: {result}")
        self.capturing = True

    def endGraphCaptureAndInstantiate(self):
        self.capturing = False
        result, graphWrapper = cuStreamEndCapture(self.streamPool)
        LOG_PTX_AND_VALIDATE("cuStreamEndCapture", result)
        result, graphExecWrapper = cuGraphInstantiate(graphWrapper)
        LOG_PTX_AND_VALIDATE("cuGraphInstantiate", result)
        self.ptxEventPool.clear()                  # ptxEventPool.reset()
        return graphExecWrapper                    # nativeHandleToLong(graphExecWrapper): no check

    def isCapturing(self) -> bool:
        return self.capturing

    def launchGraph(self, graphExecHandle) -> int:
        LOG_PTX_AND_VALIDATE("cuGraphLaunch", cuGraphLaunch(graphExecHandle, self.streamPool))
        return self.registerEvent((CUevent(), CUevent()), "DESC_SYNC_BARRIER")

    def sync(self) -> None:
        LOG_PTX_AND_VALIDATE("cuStreamSynchronize", cuStreamSynchronize(self.streamPool))


class TimeProfiler:
    def __init__(self):
        self.timers: dict[str, int] = {}

    def getTimer(self, name: str) -> int:
        return self.timers.get(name, 0)

    def setTimer(self, name: str, value: int) -> None:
        self.timers[name] = value


class TornadoOptions:
    profilerEnabled = False

    @classmethod
    def isProfilerEnabled(cls) -> bool:
        return cls.profilerEnabled


class PTXDeviceContext:
    def __init__(self, device, variant):
        self.device, self.variant = device, variant
        self.stream = PTXStream(device)

    def resolveEvent(self, executionPlanId, eventId) -> PTXEvent:
        return self.stream.ptxEventPool[eventId]

    def isStreamCapturing(self, executionPlanId) -> bool:
        return self.stream.isCapturing()

    def enqueueKernelLaunch(self, executionPlanId, module, args, meta) -> int:
        kernelLaunchEvent = self.stream.enqueueKernelLaunch(module, args)
        self.updateProfiler(executionPlanId, kernelLaunchEvent, meta)
        return kernelLaunchEvent

    def updateProfiler(self, executionPlanId, taskEvent, meta) -> None:
        if self.variant == "bug":
            profile = TornadoOptions.isProfilerEnabled()
        else:   # ea230f9: waiting on an event recorded into a capturing stream invalidates the capture
            profile = TornadoOptions.isProfilerEnabled() and not self.isStreamCapturing(executionPlanId)
        if profile:
            tornadoKernelEvent = self.resolveEvent(executionPlanId, taskEvent)
            tornadoKernelEvent.waitForEvents(executionPlanId)
            profiler = meta["profiler"]
            profiler.setTimer("TOTAL_KERNEL_TIME",
                              profiler.getTimer("TOTAL_KERNEL_TIME") + tornadoKernelEvent.getElapsedTime())
            profiler.setTimer("TASK_KERNEL_TIME-" + meta["id"], tornadoKernelEvent.getElapsedTime())

    def beginExecutionGraphCapture(self, executionPlanId, name: str) -> None:
        self.stream.beginGraphCapture(name)

    def endExecutionGraphCaptureAndInstantiate(self, executionPlanId):
        handle = self.stream.endGraphCaptureAndInstantiate()
        self.stream.ptxEventPool.clear()           # stream.reset(): captured events are discarded
        return handle

    def launchExecutionGraph(self, executionPlanId, handle) -> int:
        return self.stream.launchGraph(handle)

    def sync(self, executionPlanId) -> None:
        self.stream.sync()


# --- tornado-api: arrays, task graphs, execution plans -----------------------------------------------------

class FloatArray:
    """Off-heap (memory segment) array: host memory the driver copies from and to by address."""

    def __init__(self, size: int, device):
        self.segment = host(torch.zeros(size), device)

    def init(self, value: float) -> None:
        self.segment.fill_(value)

    def getSize(self) -> int:
        return self.segment.numel()


def axpy(x, y, result, alpha):         # result[i] = alpha * x[i] + y[i]
    torch.add(y, x, alpha=alpha, out=result)


def scale(inp, out, alpha):            # out[i] = alpha * in[i]
    torch.mul(inp, alpha, out=out)


class TaskGraph:
    EVERY_EXECUTION = "EVERY_EXECUTION"

    def __init__(self, name: str):
        self.name, self.transfersIn, self.tasks, self.transfersOut = name, [], [], []

    def transferToDevice(self, mode, *objects) -> "TaskGraph":
        self.transfersIn += [(mode, o) for o in objects]
        return self

    def task(self, taskId, method, *args) -> "TaskGraph":
        self.tasks.append((taskId, method, args))
        return self

    def transferToHost(self, mode, *objects) -> "TaskGraph":
        self.transfersOut += [(mode, o) for o in objects]
        return self

    def snapshot(self) -> "TaskGraph":
        return self


def compileToBytecodes(taskGraph: TaskGraph, useCUDAGraphs: bool, graphId: int) -> list:
    """TornadoVMGraphCompiler: with CUDA graphs, allocations outside the capture region; per-execution
    transfers, launches and copy-outs inside it; then END_CAPTURE, the graph launch and a barrier."""
    objects = [o for _, o in taskGraph.transfersIn] + [a for _, _, args in taskGraph.tasks for a in args
                                                        if isinstance(a, FloatArray)]
    code = [("ALLOC", list(dict.fromkeys(objects)))]
    region = ([("TRANSFER_HOST_TO_DEVICE_ALWAYS", o) for _, o in taskGraph.transfersIn]
              + [("LAUNCH", t) for t in taskGraph.tasks]
              + [("TRANSFER_DEVICE_TO_HOST_ALWAYS", o) for _, o in taskGraph.transfersOut])
    if useCUDAGraphs:
        code += [("CUDA_GRAPH_BEGIN_CAPTURE", graphId), *region, ("CUDA_GRAPH_END_CAPTURE", graphId),
                 ("CUDA_GRAPH_LAUNCH", graphId), ("BARRIER", None)]
    else:
        code += [*region, ("BARRIER", None)]
    return code + [("END", None)]


# --- tornado-runtime: TornadoVMInterpreter ------------------------------------------------------------------

class TornadoVMInterpreter:
    def __init__(self, bytecodes, deviceContext: PTXDeviceContext, variant, executionPlanId=0):
        self.bytecodes, self.interpreterDevice, self.variant = bytecodes, deviceContext, variant
        self.executionPlanId = executionPlanId
        self.deviceBuffers: dict[int, torch.Tensor] = {}
        self.executionGraphHandles: dict[int, object] = {}
        self.insideCaptureRegion = False
        self.timeProfiler = TimeProfiler()

    def execute(self) -> None:
        pc = 0
        while True:
            op, arg = self.bytecodes[pc]
            pc += 1
            if op == "ALLOC":
                for o in arg:
                    if id(o) not in self.deviceBuffers:
                        self.deviceBuffers[id(o)] = torch.zeros(o.getSize(), device=self.interpreterDevice.device)
            elif op == "TRANSFER_HOST_TO_DEVICE_ALWAYS":
                self.transferHostToDeviceAlways(arg)
            elif op == "LAUNCH":
                self.executeLaunch(*arg)
            elif op == "TRANSFER_DEVICE_TO_HOST_ALWAYS":
                self.transferDeviceToHost(arg)
            elif op == "CUDA_GRAPH_BEGIN_CAPTURE":
                if arg in self.executionGraphHandles:
                    # Graph already captured: skip entire capture region
                    while self.bytecodes[pc] != ("CUDA_GRAPH_END_CAPTURE", arg):
                        pc += 1
                    pc += 1
                else:
                    self.interpreterDevice.beginExecutionGraphCapture(self.executionPlanId, f"task graph {arg}")
                    self.insideCaptureRegion = True
            elif op == "CUDA_GRAPH_END_CAPTURE":
                self.insideCaptureRegion = False
                handle = self.interpreterDevice.endExecutionGraphCaptureAndInstantiate(self.executionPlanId)
                self.executionGraphHandles[arg] = handle
            elif op == "CUDA_GRAPH_LAUNCH":
                if arg in self.executionGraphHandles:
                    self.interpreterDevice.launchExecutionGraph(self.executionPlanId, self.executionGraphHandles[arg])
            elif op == "BARRIER":
                pass                                    # enqueueMarker
            elif op == "END":
                return

    def _profilerWaits(self) -> bool:
        if self.variant == "bug":
            return TornadoOptions.isProfilerEnabled()
        return TornadoOptions.isProfilerEnabled() and not self.insideCaptureRegion     # ea230f9

    def transferHostToDeviceAlways(self, obj: FloatArray) -> int:
        allEvents = [self.interpreterDevice.stream.enqueueWrite(self.deviceBuffers[id(obj)], obj.segment)]
        if self._profilerWaits() and allEvents is not None:
            for e in allEvents:
                event = self.interpreterDevice.resolveEvent(self.executionPlanId, e)
                event.waitForEvents(self.executionPlanId)
                self.timeProfiler.setTimer("COPY_IN_TIME",
                                           self.timeProfiler.getTimer("COPY_IN_TIME") + event.getElapsedTime())
        return allEvents[-1]

    def transferDeviceToHost(self, obj: FloatArray) -> int:
        readEvent = self.interpreterDevice.stream.enqueueRead(obj.segment, self.deviceBuffers[id(obj)])
        if self._profilerWaits() and readEvent != -1:
            event = self.interpreterDevice.resolveEvent(self.executionPlanId, readEvent)
            event.waitForEvents(self.executionPlanId)
            self.timeProfiler.setTimer("COPY_OUT_TIME",
                                       self.timeProfiler.getTimer("COPY_OUT_TIME") + event.getElapsedTime())
        return readEvent

    def executeLaunch(self, taskId, method, args) -> int:
        stackFrame = [self.deviceBuffers[id(a)] if isinstance(a, FloatArray) else a for a in args]
        meta = {"id": taskId, "profiler": self.timeProfiler}
        return self.interpreterDevice.enqueueKernelLaunch(self.executionPlanId, method, stackFrame, meta)


class TornadoExecutionPlan:
    _nextGraphId = itertools.count()

    def __init__(self, taskGraph: TaskGraph, device, variant):
        self.taskGraph, self.device, self.variant = taskGraph, device, variant
        self.cudaGraph, self.vm = False, None

    def withCUDAGraph(self) -> "TornadoExecutionPlan":
        self.cudaGraph = True
        return self

    def withProfiler(self, mode: str) -> "TornadoExecutionPlan":
        TornadoOptions.profilerEnabled = True
        return self

    def execute(self) -> None:
        if self.vm is None:
            code = compileToBytecodes(self.taskGraph, self.cudaGraph, next(TornadoExecutionPlan._nextGraphId))
            self.vm = TornadoVMInterpreter(code, PTXDeviceContext(self.device, self.variant), self.variant)
        self.vm.execute()
        self.vm.interpreterDevice.sync(self.vm.executionPlanId)          # TornadoTaskGraph.waitOn


def run(variant: str, device: str = "cpu"):
    def testMultiStreamGraphReplayWithProfiler(withCUDAGraph: bool):
        x, y = FloatArray(GRAPH_N, device), FloatArray(GRAPH_N, device)
        tmp, result = FloatArray(GRAPH_N, device), FloatArray(GRAPH_N, device)
        tg = (TaskGraph("graphMultiProfiler")
              .transferToDevice(TaskGraph.EVERY_EXECUTION, x, y)
              .task("t0", axpy, x, y, tmp, ALPHA)
              .task("t1", scale, tmp, result, ALPHA)
              .transferToHost(TaskGraph.EVERY_EXECUTION, result))
        plan = TornadoExecutionPlan(tg.snapshot(), device, variant)
        if withCUDAGraph:
            plan.withCUDAGraph()
            events.static_buffers("TornadoExecutionPlan", {"x": x.segment, "y": y.segment})
        plan.withProfiler("SILENT")
        outs = []
        for i in range(GRAPH_REPLAYS):
            x.init(1.0 + i)
            y.init(2.0 + i)
            plan.execute()
            outs.append(result.segment.clone())
        return outs

    def served():
        PTX_JNI_LOG.clear()
        return testMultiStreamGraphReplayWithProfiler(True)

    TornadoOptions.profilerEnabled = False
    return compare(__name__.rsplit(".", 1)[-1], variant, device, served,
                   lambda: testMultiStreamGraphReplayWithProfiler(False))
