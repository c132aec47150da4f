"""A cuBLAS library task allocates its ``withWorkspace`` workspace in ``dispatch``: a CUDA-graph plan's first execution is its capture.

Upstream: https://github.com/beehive-lab/TornadoVM/pull/1015 ("[bugfix] Library tasks can allocate device memory
inside a CUDA-graph capture region", merged; description dated 2026-08-02). The lazy workspace came with the cuBLAS
hybrid-API provider (#879/#887); the PR also covers cuSPARSE (#919), not modelled (see below).
Symptom: a task graph whose cuBLAS library task asks for a workspace (``CuBlas.cublasSgemv(...).withTuning(new
CuBlasOptions().withWorkspace(bytes))``) runs eagerly, but with ``executionPlan.withCUDAGraph()`` its first
``execute()`` fails: the workspace ``cudaMalloc`` runs inside the capture region, where the runtime refuses it
("cudaMalloc inside a stream capture region is not legal and aborts the capture"), and the provider reports that it
cannot allocate its workspace.
Mechanism: ``TornadoLibraryProvider#prepare`` exists so that plans and workspaces are allocated before capture: on
``CUDA_GRAPH_BEGIN_CAPTURE`` the interpreter (``TornadoVMInterpreter``) runs ``preCompileLaunchesInCaptureRegion``,
whose ``compileTaskFromBytecodeToBinary`` creates each library task's context (``LibraryRegistry.getOrCreateContext``:
``cublasCreate``, ``cublasSetStream``) and calls ``provider.prepare``; then ``cuStreamBeginCapture`` (global mode),
the region's launches (``executeLibraryLaunch`` -> ``provider.dispatch``), ``CUDA_GRAPH_END_CAPTURE``, and
``CUDA_GRAPH_LAUNCH``; later executions skip the region and only launch the graph. ``CuBlasLibraryProvider``
(tornado-cublas/.../provider/CuBlasLibraryProvider.java) has no ``prepare()``: its ``applyOptions``, run by
``dispatch`` before every call, allocates the workspace the options ask for lazily (``CuBlasNativeLib.
allocateDeviceMemory`` -> ``cudaMalloc``, then ``cublasSetWorkspace``) the first time it sees it. With CUDA graphs that
first dispatch is inside the capture. Eager plans allocate it on their first dispatch, harmlessly.
Doctor: sync-in-capture, at applyOptions (the workspace ``cudaMalloc``, a call a global-mode capture refuses, runs in
the captured dispatch because nothing allocated it before the capture; the fix changes code here, moving the
allocation into ``ensureWorkspace``, which ``prepare`` runs before capture).
Fix (upstream): ``CuBlasLibraryProvider.prepare(descriptor, context)`` calls ``ensureWorkspace`` with the descriptor's
``CuBlasOptions`` workspace size; ``applyOptions`` calls the same grow-only ``ensureWorkspace``, a no-op once
``prepare`` ran, so dispatch allocates nothing. The PR also adds ``LibraryInvocation.isCapturing()`` (the
interpreter's ``insideCaptureRegion``) and makes ``CusparseContext.growWorkspace`` throw while capturing instead of
calling ``cudaFree``/``cudaMalloc``; for cuSPARSE operands needing more than the 8 MiB ``prepare`` default, the fixed
capture still fails (with a clear message), so only the cuBLAS path is modelled. (Post-fix CuBlasLibraryProvider and
CusparseLibraryProvider read; pre-fix code read at 06616ddd.)
Modelled: one task graph -- ``transferToDevice(EVERY_EXECUTION, matrix, vector)``, the library task
``cublasSgemv`` (OP_T over a row-major matrix, i.e. ``y = A x``) with ``withWorkspace``, a JIT task ``post`` adding one
to the output, ``transferToHost(EVERY_EXECUTION, output)`` -- executed four times with new host data. The
interpreter's bytecodes are reduced to the capture-region handling; the host-to-device and device-to-host transfers
run outside the captured region (upstream captures them too). ``cudaMalloc`` refuses a capturing stream as the CUDA
runtime does (on either backend: torch's allocator would give a capture a pool block instead); upstream's JNI
returns 0 on the error and the provider throws "Unable to allocate cuBLAS workspace", the capture being invalidated
either way. cuBLAS's use of the user workspace is modelled as split-K partial products reduced into ``y``.
"""
from __future__ import annotations

import itertools

import torch

from workbench.engine import CaptureError
from workbench.engine.source import user_frame
from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/beehive-lab/TornadoVM/pull/1015"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "applyOptions"
SYMPTOM = ("withCUDAGraph plan with a cuBLAS workspace option fails on its first execution: the lazy workspace "
           "cudaMalloc runs inside the capture region, which refuses it")

SIZE, SPLIT_K, ITERATIONS = 8, 2, 4
WORKSPACE_BYTES = 4 * 64                 # withWorkspace(32 MiB) in miniature: fits SPLIT_K * SIZE partials
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1


class TornadoRuntimeException(RuntimeError):
    pass


# --- CUDA runtime (what cublas-jni calls) ------------------------------------------------------------

def cudaMalloc(nbytes: int, device: str) -> torch.Tensor:
    """The runtime allocation: a stream capture in global mode refuses it."""
    if torch.cuda.is_current_stream_capturing():
        raise CaptureError(f"cudaMalloc({nbytes} bytes) failed: operation not permitted when stream is capturing "
                           f"(cudaErrorStreamCaptureUnsupported)\n  at {user_frame()}", op="cudaMalloc",
                           source=user_frame())
    return torch.empty(nbytes // 4, device=device)


def cudaFree(ptr) -> None:
    """Implicitly synchronises the device: refused while capturing, too."""
    if torch.cuda.is_current_stream_capturing():
        raise CaptureError(f"cudaFree failed: operation not permitted when stream is capturing "
                           f"(cudaErrorStreamCaptureUnsupported)\n  at {user_frame()}", op="cudaFree",
                           source=user_frame())


# --- tornado-cublas: CuBlasNativeLib (JNI) -----------------------------------------------------------

class cublasHandle:
    def __init__(self, device: str):
        self.device, self.stream = device, None
        self.workspace = None                    # cublasSetWorkspace


class CuBlasNativeLib:
    @staticmethod
    def cublasCreate(device: str) -> cublasHandle:
        return cublasHandle(device)

    @staticmethod
    def cublasSetStream(handle: cublasHandle, stream) -> int:
        handle.stream = stream
        return 0

    @staticmethod
    def allocateDeviceMemory(nbytes: int, device: str) -> torch.Tensor:
        return cudaMalloc(nbytes, device)

    @staticmethod
    def freeDeviceMemory(ptr) -> None:
        cudaFree(ptr)

    @staticmethod
    def cublasSetWorkspace(handle: cublasHandle, ptr: torch.Tensor, nbytes: int) -> int:
        handle.workspace = ptr[:nbytes // 4]
        return 0

    @staticmethod
    def cublasSgemv(handle, trans, m, n, alpha, d_a, lda, d_x, incx, beta, d_y, incy) -> int:
        """y = alpha op(A) x + beta y, A column-major (lda x n); split-K partials in the user workspace."""
        a_cm = d_a.view(n, lda)[:, :m].t()                       # A[i, j] = a[j * lda + i]
        op_a = a_cm if trans == CUBLAS_OP_N else a_cm.t()
        rows, k = op_a.shape
        partials = handle.workspace[:SPLIT_K * rows].view(SPLIT_K, rows)
        chunk = k // SPLIT_K
        for s in range(SPLIT_K):
            torch.mv(op_a[:, s * chunk:(s + 1) * chunk], d_x[s * chunk:(s + 1) * chunk], out=partials[s])
        d_y.mul_(beta).add_(partials.sum(0), alpha=alpha)
        return 0

    @staticmethod
    def checkStatus(status: int, what: str) -> None:
        if status != 0:
            raise TornadoRuntimeException(f"[ERROR] {what} failed with status {status}")


# --- tornado-api / tornado-cublas: descriptors and options -------------------------------------------

class CuBlasOptions:
    def __init__(self):
        self.workspaceBytes = 0

    def withWorkspace(self, workspaceBytes: int) -> "CuBlasOptions":
        self.workspaceBytes = workspaceBytes
        return self

    def getWorkspaceBytes(self) -> int:
        return self.workspaceBytes


class LibraryTaskDescriptor:
    def __init__(self, libraryName: str, functionName: str, args: tuple):
        self.libraryName, self.functionName, self.args, self.tuning = libraryName, functionName, args, None

    def withTuning(self, tuning) -> "LibraryTaskDescriptor":
        self.tuning = tuning
        return self

    def getTuning(self):
        return self.tuning


class CuBlas:
    LIBRARY_NAME = "nvidia/cublas"

    @staticmethod
    def cublasSgemv(trans, m, n, alpha, a, lda, x, incx, beta, y, incy) -> LibraryTaskDescriptor:
        return LibraryTaskDescriptor(CuBlas.LIBRARY_NAME, "cublasSgemv",
                                     (trans, m, n, alpha, a, lda, x, incx, beta, y, incy))


# --- tornado-runtime: library SPI ---------------------------------------------------------------------

class LibraryInvocation:
    def __init__(self, callArgs, devicePointers, isReference, context, tuning):
        self.callArgs, self.devicePointers, self.isReference = callArgs, devicePointers, isReference
        self.context, self.tuning = context, tuning

    def getArg(self, i):
        return self.callArgs[i]

    def getDevicePointer(self, i) -> torch.Tensor:
        return self.devicePointers[i]

    def getContext(self):
        return self.context

    def getTuning(self):
        return self.tuning


class TornadoLibraryProvider:
    def createContext(self, device: str, executionPlanId: int):
        raise NotImplementedError

    def prepare(self, descriptor: LibraryTaskDescriptor, context) -> None:
        """Allocate plans and workspaces before any CUDA-graph capture starts (default: nothing)."""

    def dispatch(self, functionName: str, invocation: LibraryInvocation) -> None:
        raise NotImplementedError

    def destroyContext(self, context) -> None:
        pass


class CuBlasContext:
    def __init__(self, handle: cublasHandle):
        self.handle = handle
        self.workspacePtr = None
        self.workspaceBytes = 0


class CuBlasLibraryProvider(TornadoLibraryProvider):
    def __init__(self, variant: str):
        self.variant = variant
        self.FUNCTIONS = {"cublasSgemv": CuBlasLibraryProvider.sgemv}

    def createContext(self, device: str, executionPlanId: int) -> CuBlasContext:
        handle = CuBlasNativeLib.cublasCreate(device)
        CuBlasNativeLib.checkStatus(CuBlasNativeLib.cublasSetStream(handle, ("plan stream", executionPlanId)),
                                    "cublasSetStream")
        return CuBlasContext(handle)

    def prepare(self, descriptor: LibraryTaskDescriptor, context: CuBlasContext) -> None:
        if self.variant == "fix":
            # #1015: cudaMalloc is not legal inside a CUDA-graph capture region, so the workspace is
            # allocated here rather than on the first dispatch.
            options = descriptor.getTuning()
            if isinstance(options, CuBlasOptions) and options.getWorkspaceBytes() > 0:
                self.ensureWorkspace(context, options.getWorkspaceBytes())
        # bug: CuBlasLibraryProvider had no prepare(): the SPI default does nothing

    def dispatch(self, functionName: str, invocation: LibraryInvocation) -> None:
        call = self.FUNCTIONS.get(functionName)
        if call is None:
            raise TornadoRuntimeException(f"[ERROR] cuBLAS function not supported: {functionName}")
        context = invocation.getContext()
        options = invocation.getTuning() if isinstance(invocation.getTuning(), CuBlasOptions) else None
        self.applyOptions(context, options)
        CuBlasNativeLib.checkStatus(call(context.handle, invocation), functionName)

    def applyOptions(self, context: CuBlasContext, options: CuBlasOptions | None) -> None:
        """Per-call handle configuration. The workspace is a context property: grow-only, freed with the context."""
        if options is None:
            return
        if self.variant == "fix":
            self.ensureWorkspace(context, options.getWorkspaceBytes())     # a no-op once prepare() ran
            return
        # bug: allocated lazily, on the first dispatch that asks for it -- the capturing one with CUDA graphs
        if options.getWorkspaceBytes() > context.workspaceBytes:
            if context.workspacePtr is not None:
                CuBlasNativeLib.freeDeviceMemory(context.workspacePtr)
                context.workspacePtr, context.workspaceBytes = None, 0
            ptr = CuBlasNativeLib.allocateDeviceMemory(options.getWorkspaceBytes(), context.handle.device)
            if ptr is None:
                raise TornadoRuntimeException(f"[ERROR] Unable to allocate cuBLAS workspace of "
                                              f"{options.getWorkspaceBytes()} bytes")
            context.workspacePtr, context.workspaceBytes = ptr, options.getWorkspaceBytes()
            CuBlasNativeLib.checkStatus(CuBlasNativeLib.cublasSetWorkspace(context.handle, context.workspacePtr,
                                                                           context.workspaceBytes),
                                        "cublasSetWorkspace")

    def ensureWorkspace(self, context: CuBlasContext, nbytes: int) -> None:
        """Grow-only device workspace bound to the handle (fix)."""
        if nbytes <= context.workspaceBytes:
            return
        if context.workspacePtr is not None:
            CuBlasNativeLib.freeDeviceMemory(context.workspacePtr)
            context.workspacePtr, context.workspaceBytes = None, 0
        ptr = CuBlasNativeLib.allocateDeviceMemory(nbytes, context.handle.device)
        if ptr is None:
            raise TornadoRuntimeException(f"[ERROR] Unable to allocate cuBLAS workspace of {nbytes} bytes")
        context.workspacePtr, context.workspaceBytes = ptr, nbytes
        CuBlasNativeLib.checkStatus(CuBlasNativeLib.cublasSetWorkspace(context.handle, context.workspacePtr,
                                                                       context.workspaceBytes), "cublasSetWorkspace")

    def destroyContext(self, context: CuBlasContext) -> None:
        if context.workspacePtr is not None:
            CuBlasNativeLib.freeDeviceMemory(context.workspacePtr)
            context.workspacePtr = None

    # (trans, m, n, alpha, A, lda, x, incx, beta, y, incy)
    @staticmethod
    def sgemv(handle: cublasHandle, invocation: LibraryInvocation) -> int:
        g, p = invocation.getArg, invocation.getDevicePointer
        return CuBlasNativeLib.cublasSgemv(handle, g(0), g(1), g(2), g(3), p(4), g(5), p(6), g(7), g(8), p(9), g(10))


class LibraryRegistry:
    contexts: dict = {}                  # (provider, device, executionPlanId) -> context

    @classmethod
    def getOrCreateContext(cls, provider, device, executionPlanId):
        key = (id(provider), device, executionPlanId)
        if key not in cls.contexts:
            cls.contexts[key] = provider.createContext(device, executionPlanId)
        return cls.contexts[key]

    @classmethod
    def destroyContexts(cls, provider, executionPlanId):
        for key in [k for k in cls.contexts if k[0] == id(provider) and k[2] == executionPlanId]:
            provider.destroyContext(cls.contexts.pop(key))


# --- tornado-api: TaskGraph, TornadoExecutionPlan -----------------------------------------------------

class TaskGraph:
    def __init__(self, name: str):
        self.name, self.tasks, self.inputs, self.outputs = name, [], [], []

    def transferToDevice(self, *arrays) -> "TaskGraph":
        self.inputs += arrays
        return self

    def task(self, name: str, fn, *args) -> "TaskGraph":
        self.tasks.append(("task", name, fn, args))
        return self

    def libraryTask(self, name: str, descriptor: LibraryTaskDescriptor) -> "TaskGraph":
        self.tasks.append(("library", name, descriptor, descriptor.args))
        return self

    def transferToHost(self, *arrays) -> "TaskGraph":
        self.outputs += arrays
        return self


def addOne(array: torch.Tensor) -> None:
    """A JIT task: ``array[i] += 1``."""
    array.add_(1.0)


class TornadoVMInterpreter:
    """The bytecodes of one task graph on one device, reduced to the CUDA-graph capture region."""

    def __init__(self, taskGraph: TaskGraph, provider, device: str, executionPlanId: int, cudaGraph: bool):
        self.graph, self.provider, self.device = taskGraph, provider, device
        self.executionPlanId, self.cudaGraph = executionPlanId, cudaGraph
        self.insideCaptureRegion = False
        self.executionGraphHandles = {}
        self.compiled = set()
        # ALLOC: one device buffer (XPUBuffer) per host array
        self.buffers = {id(a): torch.zeros(a.shape, device=device) for a in taskGraph.inputs + taskGraph.outputs}

    def _device(self, obj):
        return self.buffers[id(obj)] if isinstance(obj, torch.Tensor) else obj

    def compileTaskFromBytecodeToBinary(self, index: int) -> None:
        kind, _name, what, _args = self.graph.tasks[index]
        if index in self.compiled:
            return
        self.compiled.add(index)
        if kind == "library":
            # The native context is created eagerly here: this also runs in the pre-compile pass before
            # capture starts, and native handle creation allocates device memory.
            context = LibraryRegistry.getOrCreateContext(self.provider, self.device, self.executionPlanId)
            self.provider.prepare(what, context)

    def preCompileLaunchesInCaptureRegion(self) -> None:
        for index in range(len(self.graph.tasks)):
            self.compileTaskFromBytecodeToBinary(index)

    def executeLibraryLaunch(self, descriptor: LibraryTaskDescriptor) -> None:
        args = descriptor.args
        callArgs = [None if isinstance(a, torch.Tensor) else a for a in args]
        devicePointers = [self._device(a) if isinstance(a, torch.Tensor) else None for a in args]
        isReference = [isinstance(a, torch.Tensor) for a in args]
        context = LibraryRegistry.getOrCreateContext(self.provider, self.device, self.executionPlanId)
        self.provider.dispatch(descriptor.functionName,
                               LibraryInvocation(callArgs, devicePointers, isReference, context, descriptor.getTuning()))

    def launches(self):
        """The LAUNCH bytecodes of the region: JIT tasks and library tasks, in order."""
        for index, (kind, _name, what, args) in enumerate(self.graph.tasks):
            self.compileTaskFromBytecodeToBinary(index)
            if kind == "library":
                self.executeLibraryLaunch(what)
            else:
                what(*[self._device(a) for a in args])
        return self.buffers[id(self.graph.outputs[0])]

    def execute(self) -> None:
        for a in self.graph.inputs:                                  # TRANSFER_HOST_TO_DEVICE_ALWAYS
            self.buffers[id(a)].copy_(a)
        if not self.cudaGraph:
            out = self.launches()
        else:
            graphId = 0
            if graphId not in self.executionGraphHandles:           # CUDA_GRAPH_BEGIN_CAPTURE: first execution
                self.preCompileLaunchesInCaptureRegion()             # force lazy allocations, then capture
                self.insideCaptureRegion = True
                try:
                    self.executionGraphHandles[graphId] = capture(
                        self.launches, device=self.device, warmups=0, name=f"graphId={graphId}",
                        owner="TornadoVMInterpreter",
                        static={f"XPUBuffer {i}": self.buffers[id(a)] for i, a in enumerate(self.graph.inputs)})
                finally:
                    self.insideCaptureRegion = False                 # CUDA_GRAPH_END_CAPTURE
            g, captured_out = self.executionGraphHandles[graphId]
            out = replay(g, captured_out)                            # CUDA_GRAPH_LAUNCH
        for a in self.graph.outputs:                                 # TRANSFER_DEVICE_TO_HOST_ALWAYS
            a.copy_(out)


class TornadoExecutionPlan:
    _ids = itertools.count()

    def __init__(self, taskGraph: TaskGraph, provider, device: str):
        self.taskGraph, self.provider, self.device = taskGraph, provider, device
        self.executionPlanId = next(TornadoExecutionPlan._ids)
        self.cudaGraph = False
        self.interpreter = None

    def withCUDAGraph(self) -> "TornadoExecutionPlan":
        self.cudaGraph = True
        return self

    def execute(self) -> None:
        if self.interpreter is None:
            self.interpreter = TornadoVMInterpreter(self.taskGraph, self.provider, self.device,
                                                    self.executionPlanId, self.cudaGraph)
        self.interpreter.execute()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        LibraryRegistry.destroyContexts(self.provider, self.executionPlanId)
        return False


def run(variant: str, device: str = "cpu"):
    gen = generator(1015)
    matrices = [torch.randn(SIZE * SIZE, generator=gen) for _ in range(ITERATIONS)]
    vectors = [torch.randn(SIZE, generator=gen) for _ in range(ITERATIONS)]

    def serve(cuda_graph: bool):
        provider = CuBlasLibraryProvider(variant)
        matrix, vector, output = torch.zeros(SIZE * SIZE), torch.zeros(SIZE), torch.zeros(SIZE)   # host arrays
        options = CuBlasOptions().withWorkspace(WORKSPACE_BYTES)
        taskGraph = (TaskGraph("g")
                     .transferToDevice(matrix, vector)
                     .libraryTask("sgemv", CuBlas.cublasSgemv(CUBLAS_OP_T, SIZE, SIZE, 1.0, matrix, SIZE, vector, 1,
                                                              0.0, output, 1).withTuning(options))
                     .task("post", addOne, output)
                     .transferToHost(output))
        outs = []
        with TornadoExecutionPlan(taskGraph, provider, device) as plan:
            if cuda_graph:
                plan.withCUDAGraph()
            for it in range(ITERATIONS):                     # iteration 0 captures, the rest replay
                matrix.copy_(matrices[it])
                vector.copy_(vectors[it])
                plan.execute()
                outs.append(output.clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
