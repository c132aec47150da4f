"""At NCCL_CTRAN_GRAPH_MIXING_SUPPORT=0, CTRAN's OrderedWorkStreamGuard records its one sync event on the capturing stream, so the first eager ctwin all-gather after a capture host-synchronizes on a capture-bound event, fails, and latches the error.

Upstream: https://github.com/meta-pytorch/torchcomms/pull/3436 ("Fix eager-after-capture failure under
NCCL_CTRAN_GRAPH_MIXING_SUPPORT=0", meta-pytorch/torchcomms, commit 3b4219ce7, D114664357, landed on main
2026-08-04; no public issue).
Symptom: with ``NCCL_CTRAN_GRAPH_MIXING_SUPPORT=0`` (a perf cvar) and the ctwin AllGatherP path, which dispatches
eagerly as well as under capture, the first eager CTRAN GPE submission after a CUDA graph capture fails with
"OrderedWorkStreamGuard.cc:131 CTRAN ERROR Cuda failure 1 'invalid argument'" / "CtranGpeImpl.cc:215 ->
commUnhandledCudaError". Every later GPE submission on the communicator returns the same error. No replay is
needed: the capture alone causes it. Without graphs the same sequence works.
Mechanism: ``CtranGpe::Impl::submit`` (``comms/ctran/gpe/CtranGpeImpl.cc``) wraps each non-concurrent kernel launch
in an ``OrderedWorkStreamGuard::Scope`` (``maybeAcquireWorkStreamScope``). ``ws_.init(...,
synchronizeEagerAfterCapturedWork=true)``. The guard (``comms/ctran/algos/common/OrderedWorkStreamGuard.{cc,h}``)
has a single ``execModeSyncEvent_``, and that event has two consumers. (1) ``doRelease()`` at mixing=0 took the
branch ``if (!isCapturing || !graphMixingSupport_) cudaEventRecord(execModeSyncEvent_, userStream)``. Under
capture this plain record is not executed. Capture absorbs it as a graph-construction directive: the next
in-capture ``doAcquire`` wait becomes a dependency edge, but the event is left capture-bound. (2) The eager branch
of ``doAcquire()`` runs ``cudaEventSynchronize(execModeSyncEvent_)`` once ``everCaptured_`` is set (the GPE host
barrier, deliberately not gated on the mixing mode). On a capture-bound event that call returns
``cudaErrorInvalidValue``. ``FB_CUDACHECK`` turns it into ``commUnhandledCudaError``, the ``Scope`` constructor
latches it into ``error_``, and from then on ``doAcquire`` returns ``error_`` first thing, for every submission.
Without a capture each record executes, so the host barrier waits on real work and succeeds.
Doctor: warmup-divergence, at doRelease. The capture decided what ``execModeSyncEvent_`` is: by recording it on the
capturing stream, it made the event the graph's captured fence (bound into the graph). The eager path still
treats the same event as its live host barrier, so the first eager step after the capture finds the state the
capture left and fails. ``doRelease`` is the function that made the wrong choice: it recorded the eager path's
event under capture. It is also the line the fix changes first: the capture branch records a separate
``captureFenceEvent_``. ``doAcquire``'s in-capture wait follows the same choice.
Fix (upstream): split the event. ``init`` also creates ``captureFenceEvent_`` (destroyed in the destructor).
``doRelease`` becomes ``if (!isCapturing) record(execModeSyncEvent_) else if (!graphMixingSupport_)
record(captureFenceEvent_) else <side-stream EVENT_RECORD node>``. ``doAcquire``'s ``doWait`` waits on
``inCaptureWithoutMixing ? captureFenceEvent_ : execModeSyncEvent_``. ``execModeSyncEvent_`` then keeps its last
eager record, and the eager acquire succeeds. The commit documents the remaining caveat: at mixing=0 a replay is
not ordered ahead of a following eager submission, so callers must host-synchronize between them. The model's
serving loop does that (``synchronize`` before each eager prefill), as the upstream test does.
(Read: the pre-fix and post-fix ``OrderedWorkStreamGuard.{cc,h}``; ``CtranGpe::Impl::submit``; ``ctranAllGatherCtwin``,
``allGatherPExec`` and ``AlgoImpl::execPipeline``; the new tests ``AppliesCapturedToEagerPolicy`` and
``EagerAfterCaptureGraphMixingSupportOffIsUnordered``; the cvar text in ``nccl_cvars.yaml``.)
Modelled: the CUDA runtime's streams, events, capture ids and error codes are Python objects on both backends, since
the engine has none. The rule the commit reports is stated in the model: a plain ``cudaEventRecord`` on a
capturing stream is absorbed, and leaves the event bound to that capture. An in-capture ``cudaStreamWaitEvent`` on
an event of the same capture is a dependency edge. Host or eager use of an event whose last record was absorbed
(``cudaEventSynchronize``, an eager ``cudaStreamWaitEvent``) returns ``cudaErrorInvalidValue``. CUDA also lists
``cudaErrorCapturedEvent`` for this case; the commit saw ``invalid argument``, so the model uses that. The mixing=1
side-stream EVENT_RECORD node is modelled only as an external record that leaves the event usable; this program
runs at mixing=0. The workload is one rank of a single node with 2 local ranks, and FSDP-style sharded weights.
Each ``ShardedLinear`` all-gathers its weight through ``all_gather_single`` into a symmetric window buffer, using
``NCCL_ALLGATHER_ALGO=ctwin_pipeline`` (``ctranAllGatherCtwin`` -> ``allGatherPExec`` -> ``execPipeline``). Single
node: ``copyToSelf``, ``nvlCeBcast``, then one GPE submit of ``ncclKernelAllGatherPPipeEnd``. The peer's
``nvlCeBcast`` into this rank's window is done by this rank's stand-in (the peer's shard is a fixed tensor). The
GPE thread, host nodes, colltrace and the persistent-request cache are left out. Decode (bs=2) is captured at
start-up after one eager warmup. Each round serves one eager prefill of 2 requests x 3 tokens, then 3 replayed
decode steps that feed their output back.
"""
from __future__ import annotations

import contextlib
import itertools

import torch

from workbench.engine import events, synchronize
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/meta-pytorch/torchcomms/pull/3436"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "doRelease"
SYMPTOM = ("at NCCL_CTRAN_GRAPH_MIXING_SUPPORT=0 the first eager ctwin all-gather after a CUDA graph capture fails "
           "with \"CTRAN ERROR Cuda failure 1 'invalid argument'\" -> commUnhandledCudaError, and every later GPE "
           "submission returns the latched error")

NCCL_CTRAN_GRAPH_MIXING_SUPPORT = 0          # the non-default perf cvar (default 1)
NCCL_ALLGATHER_ALGO = "ctwin_pipeline"
HIDDEN, NLOCALRANKS, NUM_LAYERS = 8, 2, 2
BS, PROMPT_LEN, DECODE_STEPS, ROUNDS = 2, 3, 3, 2


# --- the modelled CUDA runtime: streams, events, stream capture, error codes ----------------------------------------

cudaSuccess, cudaErrorInvalidValue = 0, 1
_CUDA_ERROR_STRINGS = {cudaErrorInvalidValue: "invalid argument"}
cudaStreamCaptureStatusNone, cudaStreamCaptureStatusActive = "none", "active"
cudaEventWaitDefault, cudaEventWaitExternal = 0, 1
cudaEventDisableTiming = 2
commSuccess, commUnhandledCudaError = "commSuccess", "commUnhandledCudaError"


class _Capture:
    """One stream capture (cudaStreamBeginCapture ... cudaStreamEndCapture)."""
    _ids = itertools.count(1)

    def __init__(self):
        self.id = next(self._ids)


class cudaStream_t:
    def __init__(self, name: str, device: str):
        self.name, self.device = name, device
        self.capture: _Capture | None = None       # the capture this stream is in, if any


class cudaEvent_t:
    def __init__(self, name: str, device: str):
        self.name, self.device = name, device
        # the capture that absorbed this event's last record (None: last recorded by executed work, or never)
        self.capture: _Capture | None = None


def cudaEventCreateWithFlags(name: str, device: str, flags: int) -> cudaEvent_t:
    return cudaEvent_t(name, device)


def cudaEventRecord(event: cudaEvent_t, stream: cudaStream_t) -> int:
    """A plain record. On a capturing stream it is not executed: capture absorbs it as a graph-construction
    directive (a later in-capture wait on it becomes a dependency edge) and the event is left capture-bound."""
    event.capture = stream.capture
    return cudaSuccess


def addEventRecordNodeToCapture(stream: cudaStream_t, event: cudaEvent_t) -> int:
    """``ctran::utils::cudagraph::addEventRecordNodeToCapture`` (mixing=1): an explicit EVENT_RECORD node of an
    external event; each replay records it, so the event stays usable outside the graph."""
    event.capture = None
    return cudaSuccess


def cudaStreamWaitEvent(stream: cudaStream_t, event: cudaEvent_t, flags: int) -> int:
    if stream.capture is not None:
        return cudaSuccess                     # same capture: a dependency edge (external: a wait node)
    if event.capture is not None:
        return cudaErrorInvalidValue           # eager use of a capture-bound event
    return cudaSuccess


def cudaEventSynchronize(event: cudaEvent_t) -> int:
    """Host waits for the work the event's last record captured. A capture-bound event has none the host can see."""
    if event.capture is not None:
        return cudaErrorInvalidValue
    synchronize(event.device)                  # the host barrier itself (a no-op on the CPU: all work already ran)
    return cudaSuccess


class StreamCaptureInfo:
    def __init__(self, status: str, id: int = 0):
        self.status, self.id = status, id


def getStreamCaptureInfo(stream: cudaStream_t) -> StreamCaptureInfo:
    """``ctran::utils::cudagraph::getStreamCaptureInfo`` (cudaStreamGetCaptureInfo)."""
    if stream.capture is None:
        return StreamCaptureInfo(cudaStreamCaptureStatusNone)
    return StreamCaptureInfo(cudaStreamCaptureStatusActive, stream.capture.id)


@contextlib.contextmanager
def stream_capture(stream: cudaStream_t):
    """The user stream's side of ``torch.cuda.graph(g)``: the stream torchcomms launches on is captured."""
    stream.capture = _Capture()
    try:
        yield
    finally:
        stream.capture = None


ctran_log: list[str] = []


def FB_CUDACHECK(err: int, where: str) -> str:
    """``FB_CUDACHECK``: log a CUDA failure and turn it into ``commUnhandledCudaError``."""
    if err == cudaSuccess:
        return commSuccess
    ctran_log.append(f"{where} CTRAN ERROR Cuda failure {err} '{_CUDA_ERROR_STRINGS[err]}'")
    return commUnhandledCudaError


# --- comms/ctran/algos/common/OrderedWorkStreamGuard.{h,cc} ---------------------------------------------------------

class OrderedWorkStreamGuard:
    def __init__(self, variant: str):
        self.variant = variant
        self.execModeSyncEvent_: cudaEvent_t | None = None
        self.captureFenceEvent_: cudaEvent_t | None = None      # #3436: fence recorded during capture
        self.lastCaptureId_ = 0
        self.everCaptured_ = False
        self.graphMixingSupport_ = True
        self.synchronizeEagerAfterCapturedWork_ = False
        self.initialized_ = False
        self.error_ = commSuccess
        self.lastUserStream_: cudaStream_t | None = None

    def init(self, device: str, synchronizeEagerAfterCapturedWork: bool) -> None:
        assert not self.initialized_, "OrderedWorkStreamGuard initialized twice"
        execModeSyncEvent = cudaEventCreateWithFlags("execModeSyncEvent", device, cudaEventDisableTiming)
        captureFenceEvent = None
        if self.variant == "fix":
            captureFenceEvent = cudaEventCreateWithFlags("captureFenceEvent", device, cudaEventDisableTiming)
        self.graphMixingSupport_ = NCCL_CTRAN_GRAPH_MIXING_SUPPORT != 0
        self.synchronizeEagerAfterCapturedWork_ = synchronizeEagerAfterCapturedWork
        self.execModeSyncEvent_ = execModeSyncEvent
        self.captureFenceEvent_ = captureFenceEvent
        self.initialized_ = True

    class Scope:
        def __init__(self, guard: "OrderedWorkStreamGuard", userStream: cudaStream_t, captureInfo: StreamCaptureInfo):
            self.guard_, self.userStream_, self.captureInfo_ = guard, userStream, captureInfo
            self.status_ = guard.doAcquire(userStream, captureInfo)
            if self.status_ != commSuccess:
                guard.error_ = self.status_                      # latched: every later doAcquire returns it

        def status(self) -> str:
            return self.status_

        def stream(self) -> cudaStream_t:
            return self.userStream_

        def release(self) -> str:
            if self.guard_ is None:
                return self.status_
            guard, self.guard_ = self.guard_, None
            if self.status_ == commSuccess:
                self.status_ = guard.doRelease(self.userStream_, self.captureInfo_)
                if self.status_ != commSuccess:
                    guard.error_ = self.status_
            return self.status_

    def acquire(self, userStream: cudaStream_t, captureInfo: StreamCaptureInfo) -> "OrderedWorkStreamGuard.Scope":
        assert self.initialized_, "OrderedWorkStreamGuard used before init()"
        return OrderedWorkStreamGuard.Scope(self, userStream, captureInfo)

    def doAcquire(self, userStream: cudaStream_t, captureInfo: StreamCaptureInfo) -> str:
        if self.error_ != commSuccess:
            return self.error_
        isCapturing = captureInfo.status == cudaStreamCaptureStatusActive
        isNewCapture = isCapturing and captureInfo.id != self.lastCaptureId_
        if isNewCapture:
            self.lastCaptureId_ = captureInfo.id
            self.everCaptured_ = True

        def doWait() -> str:
            event = self.execModeSyncEvent_
            if self.variant == "fix":
                inCaptureWithoutMixing = isCapturing and not self.graphMixingSupport_
                event = self.captureFenceEvent_ if inCaptureWithoutMixing else self.execModeSyncEvent_
            flags = cudaEventWaitExternal if (isCapturing and self.graphMixingSupport_) else cudaEventWaitDefault
            return FB_CUDACHECK(cudaStreamWaitEvent(userStream, event, flags), "OrderedWorkStreamGuard.cc doWait")

        if self.lastUserStream_ is None:
            if isCapturing and self.graphMixingSupport_:
                return doWait()
            return commSuccess

        if not isCapturing:
            # GPE requires a host sync after graph work so its host-node command reaches the single-threaded
            # queue before a following eager command.
            if self.everCaptured_ and self.synchronizeEagerAfterCapturedWork_:
                return FB_CUDACHECK(cudaEventSynchronize(self.execModeSyncEvent_), "OrderedWorkStreamGuard.cc:131")
            if self.everCaptured_ or userStream is not self.lastUserStream_:
                return doWait()
            return commSuccess

        if not isNewCapture:
            if not self.graphMixingSupport_:
                return doWait()
            # (mixing=1: cudaStreamUpdateCaptureDependencies on lastRecordNode_, then doWait below)

        if not self.graphMixingSupport_:
            return commSuccess
        return doWait()

    def doRelease(self, userStream: cudaStream_t, captureInfo: StreamCaptureInfo) -> str:
        _RELEASE = "OrderedWorkStreamGuard.cc doRelease"
        isCapturing = captureInfo.status == cudaStreamCaptureStatusActive
        if self.variant == "bug":
            if not isCapturing or not self.graphMixingSupport_:
                err = FB_CUDACHECK(cudaEventRecord(self.execModeSyncEvent_, userStream), _RELEASE)
            else:
                err = FB_CUDACHECK(addEventRecordNodeToCapture(userStream, self.execModeSyncEvent_), _RELEASE)
        elif not isCapturing:
            err = FB_CUDACHECK(cudaEventRecord(self.execModeSyncEvent_, userStream), _RELEASE)
        elif not self.graphMixingSupport_:
            # Use a dedicated event so that capture-bound state never lands on execModeSyncEvent_, which the
            # eager path consumes live.
            err = FB_CUDACHECK(cudaEventRecord(self.captureFenceEvent_, userStream), _RELEASE)
        else:
            err = FB_CUDACHECK(addEventRecordNodeToCapture(userStream, self.execModeSyncEvent_), _RELEASE)
        if err != commSuccess:
            return err
        self.lastUserStream_ = userStream
        return commSuccess


# --- comms/ctran/gpe/CtranGpeImpl.cc --------------------------------------------------------------------------------

class KernelConfig:
    def __init__(self, type: str, stream: cudaStream_t, algoName: str, canConcurrent: bool = False):
        self.type, self.stream, self.algoName, self.canConcurrent = type, stream, algoName, canConcurrent


class CtranGpe:
    def __init__(self, variant: str, device: str):
        self.ws_ = OrderedWorkStreamGuard(variant)
        self.ws_.init(device, True)                  # synchronizeEagerAfterCapturedWork

    def submit(self, opGroup: list, kernelConfig: KernelConfig, ncclKernel, kernelArgs) -> str:
        streamCaptureInfo = getStreamCaptureInfo(kernelConfig.stream)
        launchStream = kernelConfig.stream
        wsScope = None
        # maybeAcquireWorkStreamScope(): acquire the work-stream baton before launching
        if not kernelConfig.canConcurrent:
            wsScope = self.ws_.acquire(kernelConfig.stream, streamCaptureInfo)
            if wsScope.status() != commSuccess:                  # FB_COMMCHECK(wsScope->status())
                ctran_log.append(f"CtranGpeImpl.cc:215 -> {wsScope.status()}")
                return wsScope.status()
            launchStream = wsScope.stream()
        ncclKernel(launchStream, *kernelArgs)                    # cudaLaunchKernel(ncclKernel, ..., launchStream)
        if wsScope is not None:
            return wsScope.release()                             # early release
        return commSuccess


def ncclKernelAllGatherPPipeEnd(stream: cudaStream_t, pipeSync) -> None:
    """The single-node pipeline's end kernel: waits for the intra-node copies (no data of its own)."""


# --- comms/ctran/window + comms/ctran/algos/AllGather{,P} -----------------------------------------------------------

class CtranWin:
    """A symmetric window: this rank's registered recv buffer, the peer's registered buffer, and what the peer
    broadcasts into ours (its shard)."""

    def __init__(self, recvbuff: torch.Tensor, peer_recvbuff: torch.Tensor, peer_sendbuff: torch.Tensor):
        self.winDataPtr, self.remoteRecvBuff, self.peerSendbuff = recvbuff, peer_recvbuff, peer_sendbuff


class CtranComm:
    def __init__(self, variant: str, device: str):
        self.rank, self.nRanks = 0, NLOCALRANKS
        self.stream = cudaStream_t("user stream", device)       # torchcomms launches on the current stream
        self.gpe = CtranGpe(variant, device)
        self.windows: dict[int, CtranWin] = {}

    def findWindowForBuffer(self, recvbuff: torch.Tensor) -> CtranWin | None:
        return self.windows.get(recvbuff.data_ptr())


def copyToSelf(comm: CtranComm, sendbuff: torch.Tensor, recvbuff: torch.Tensor) -> None:
    n = sendbuff.numel()
    recvbuff[comm.rank * n:(comm.rank + 1) * n].copy_(sendbuff)           # cudaMemcpyAsync on the stream


def nvlCeBcast(comm: CtranComm, sendbuff: torch.Tensor, win: CtranWin) -> None:
    """Copy-engine broadcast of the local chunk into the peer's window (and, standing in for the peer's own
    nvlCeBcast at the same time, the peer's chunk into ours)."""
    n = sendbuff.numel()
    peer = 1 - comm.rank
    win.remoteRecvBuff[comm.rank * n:(comm.rank + 1) * n].copy_(sendbuff)
    win.winDataPtr[peer * n:(peer + 1) * n].copy_(win.peerSendbuff)


def execPipeline(comm: CtranComm, win: CtranWin, sendbuff: torch.Tensor) -> str:
    """``AlgoImpl::execPipeline`` for nNodes == 1, nLocalRanks > 1."""
    config = KernelConfig("ALLGATHERP", comm.stream, "ctpipeline")
    copyToSelf(comm, sendbuff, win.winDataPtr)
    nvlCeBcast(comm, sendbuff, win)
    return comm.gpe.submit([], config, ncclKernelAllGatherPPipeEnd, (None,))


def ctranAllGatherCtwin(sendbuff: torch.Tensor, recvbuff: torch.Tensor, comm: CtranComm) -> str:
    win = comm.findWindowForBuffer(recvbuff)
    if win is None:
        return "commInvalidUsage"
    return execPipeline(comm, win, sendbuff)                 # allGatherPExec -> ctpipeline (ctwin_pipeline)


# --- torchcomms: the Python communicator --------------------------------------------------------------------------

class TorchCommNCCLX:
    def __init__(self, variant: str, device: str):
        self.device = device
        self._comm = CtranComm(variant, device)

    def register_window(self, recvbuff: torch.Tensor, peer_sendbuff: torch.Tensor) -> None:
        """Symmetric window registration (collective): the peer registers its own buffer of the same size."""
        self._comm.windows[recvbuff.data_ptr()] = CtranWin(recvbuff, torch.zeros_like(recvbuff), peer_sendbuff)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor) -> None:
        assert NCCL_ALLGATHER_ALGO == "ctwin_pipeline"
        res = ctranAllGatherCtwin(input, output, self._comm)
        if res != commSuccess:
            raise RuntimeError(f"NCCLX all_gather_single failed: {res} ({'; '.join(ctran_log[-2:])})")


# --- the user's model: FSDP-style sharded linears, weights all-gathered at each forward -----------------------------

class ShardedLinear:
    def __init__(self, comm: TorchCommNCCLX, w_shard, peer_w_shard, bias, device):
        self.comm, self.w_shard, self.bias = comm, w_shard, bias
        self.full_weight = torch.zeros(NLOCALRANKS * w_shard.numel(), device=device)   # in the window
        comm.register_window(self.full_weight, peer_w_shard)

    def forward(self, x):
        self.comm.all_gather_single(self.full_weight, self.w_shard)
        return torch.tanh(x @ self.full_weight.view(HIDDEN, HIDDEN).T + self.bias)


class ShardedMLP:
    def __init__(self, comm: TorchCommNCCLX, params, device):
        self.layers = [ShardedLinear(comm, *p, device=device) for p in params]

    def __call__(self, x):
        for layer in self.layers:
            x = layer.forward(x)
        return x

    def windows(self):
        return {f"layers[{i}].full_weight": layer.full_weight for i, layer in enumerate(self.layers)}


class DecodeGraphRunner:
    """Captures decode (bs=BS) at start-up after one eager warmup; each decode step copies in and replays."""

    def __init__(self, model: ShardedMLP, comm: TorchCommNCCLX, device: str):
        self.model, self.comm, self.device = model, comm, device
        self.hidden_states = torch.zeros(BS, HIDDEN, device=device)
        events.static_buffers("DecodeGraphRunner", {"hidden_states": self.hidden_states})
        events.persistent_state("DecodeGraphRunner", model.windows())
        with events.warmup():
            self.model(self.hidden_states)

        def body():
            with stream_capture(comm._comm.stream):                 # torch.cuda.graph(g) on the current stream
                return self.model(self.hidden_states)
        self.graph, self.output = capture(body, device=device, warmups=0, name=f"decode bs={BS}",
                                          owner="DecodeGraphRunner")

    def decode(self, h):
        self.hidden_states.copy_(h)
        return replay(self.graph, self.output)


def _params(device):
    gen = generator(3436)
    params = []
    for _ in range(NUM_LAYERS):
        weight = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=HIDDEN ** -0.5)
        half = HIDDEN // NLOCALRANKS
        params.append((weight[:half].reshape(-1).clone(), weight[half:].reshape(-1).clone(),
                       randn(HIDDEN, gen=gen, device=device, scale=0.1)))
    prompts = [randn(BS * PROMPT_LEN, HIDDEN, gen=gen, device=device) for _ in range(ROUNDS)]
    return params, prompts


def run(variant: str, device: str = "cpu"):
    params, prompts = _params(device)

    def serve(use_graphs: bool):
        comm = TorchCommNCCLX(variant, device)
        model = ShardedMLP(comm, params, device)
        runner = DecodeGraphRunner(model, comm, device) if use_graphs else None
        outs = []
        for prompt in prompts:
            # mixing=0: callers must host-synchronize between a replay and an eager CTRAN submission
            synchronize(device)
            out = model(prompt)                                     # prefill: eager
            outs.append(out)
            h = out.view(BS, PROMPT_LEN, HIDDEN)[:, -1]
            for _ in range(DECODE_STEPS):
                h = (runner.decode(h) if use_graphs else model(h)).clone()
                outs.append(h)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
