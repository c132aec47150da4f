"""The NCCL "post-sync" flag is still on while Qwen3.5 captures its decode graphs: cudaStreamSynchronize in capture.

Upstream: https://github.com/ztxz16/fastllm/commit/263e808161733fb6a7e924144792fec9f13850ad ("修复 CUDA graph 错误熔断",
i.e. "fix the CUDA graph error circuit-breaker"; a direct commit, no PR or issue). Read: ``git show 263e8081``
(``src/devices/multicuda/fastllm-multicuda.cu``, ``src/devices/cuda/fastllm-cuda.cu``, ``src/models/qwen3_5.cpp``)
and, at its parent, ``basellm::AutoWarmup`` (``src/models/basellm.cpp``), ``Qwen3_5Model::OnAutoWarmupFinished``
and the default of ``fastllmCudaNcclForceSync`` (``std::atomic<bool> fastllmCudaNcclForceSync(true)``).
Symptom: no public report. Tensor-parallel (TP>1) Qwen3.5 with ``cudaGraph`` on: the capture of every decode graph
fails, "operation not permitted when stream is capturing" (cudaErrorStreamCaptureUnsupported from the
``cudaStreamSynchronize`` after the captured ``ncclAllReduce``), which invalidates the capture; upstream the ignored
error then surfaced at ``cudaStreamEndCapture`` and the runner dropped CUDA graphs for that GPU.
Mechanism: ``FastllmNcclAllReduce`` (and ``FastllmNcclBroadcast``) issue the collective on ``cudaStreamPerThread``
and then ``if (FastllmNcclPostSyncEnabled()) cudaStreamSynchronize(stream);``. ``FastllmNcclPostSyncEnabled()``
returned the global ``FastllmCudaGetNcclForceSync()``, ``true`` by default (a synchronous collective avoids a
cudaMalloc / NCCL-proxy driver-lock deadlock while loading and warming up). ``basellm::AutoWarmup`` clears it in
the destructor of ``AutoWarmupFinishGuard`` with ``FastllmCudaSetNcclForceSync(false)``, but only AFTER
``model->OnAutoWarmupFinished()``, which for Qwen3.5 runs ``PreCaptureCudaGraphAfterWarmup``: each batch is warmed
(``runWithoutGraph``, where the sync is harmless) and then captured (``FastllmCudaGraphBeginCapture`` ->
``runGraphBody`` -> ``FastllmCudaGraphEndCapture``) with the flag still set, so every captured all-reduce is
followed by a host synchronisation of the capturing stream. The model stops at that failed capture, as
``torch.cuda.graph`` does (row-parallel MLP, TP-2 played by one process; ``ncclAllReduce`` is a sum of the ranks'
partials).
Doctor: sync-in-capture, at ``FastllmNcclAllReduce`` (its post-collective ``cudaStreamSynchronize`` runs while the
stream is capturing, because the force-sync flag is cleared only after the pre-capture).
Fix (upstream): ``FastllmNcclPostSyncEnabled(cudaStream_t stream)`` returns false when the flag is off OR
``cudaStreamIsCapturing(stream, &captureStatus)`` reports a capture ("cudaStreamSynchronize is forbidden during
capture and directly invalidates the ongoing CUDA graph capture"; a captured collective is only recorded, so there
is no driver-lock race to guard); the sync's result is now checked. As a circuit breaker, a thread-local error
flag (``FastllmCudaClearThreadError`` / ``FastllmCudaSetThreadError`` / ``FastllmCudaGetThreadError``, set by
``showError`` and the NCCL error paths) and ``FastllmCudaGraphCaptureInvalidated()`` are checked after the warmup
run and after the capture body; on error ``Qwen35AbortCudaGraphCapture()``, ``state.disabled = true`` and
``runWithoutGraph()``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.engine import events, is_capturing, synchronize
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/ztxz16/fastllm/commit/263e808161733fb6a7e924144792fec9f13850ad"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "FastllmNcclAllReduce"
SYMPTOM = "TP-2 Qwen3.5 decode-graph capture fails: cudaStreamSynchronize after ncclAllReduce while capturing"

TP, HIDDEN, INTER, VOCAB = 2, 8, 6, 10
PRECAPTURE_BATCHES = (1, 2, 4)        # Qwen35PreCaptureBatches(4)
SCHEDULE = (2, 1, 4, 4, 1, 2)         # decode batch of each served step

fastllmCudaNcclForceSync = True       # std::atomic<bool> fastllmCudaNcclForceSync(true)
fastllmCudaThreadErrorFlag = False    # the fix's thread-local error flag (one thread here)


def FastllmCudaSetNcclForceSync(value):
    global fastllmCudaNcclForceSync
    fastllmCudaNcclForceSync = value


def FastllmCudaGetNcclForceSync():
    return fastllmCudaNcclForceSync


def FastllmCudaClearThreadError():
    global fastllmCudaThreadErrorFlag
    fastllmCudaThreadErrorFlag = False


def FastllmCudaGetThreadError():
    return fastllmCudaThreadErrorFlag


def FastllmNcclPostSyncEnabled(variant):
    if variant == "bug":
        return FastllmCudaGetNcclForceSync()
    if not FastllmCudaGetNcclForceSync():
        return False
    # cudaStreamIsCapturing(stream, &captureStatus): a capturing stream must not be synchronised
    return not is_capturing()


def ncclAllReduce(partials, dest):
    """``ncclAllReduce(data, dest, count, ncclType, ncclSum, comm, stream)`` for all ranks at once."""
    dest.copy_(partials.sum(0))


def FastllmNcclAllReduce(partials, dest, device, variant):
    ncclAllReduce(partials, dest)
    # Sync right after launch so no collective is left in flight (driver-lock deadlock guard).
    if FastllmNcclPostSyncEnabled(variant):
        synchronize(device)                                 # cudaStreamSynchronize(stream)


class Qwen35CudaGraphDecodeState:
    def __init__(self, batch, device):
        self.warmed = self.captured = self.disabled = False
        self.graph = self.logits = None
        self.inputIds = torch.zeros(batch, HIDDEN, device=device)   # static decode input (embedded here)


class Qwen3_5Model:
    """One decoder MLP split over TP ranks (column slices of gate/up, row slices of down), then the LM head."""

    def __init__(self, device, variant):
        gen = generator(2638)
        self.device, self.variant = device, variant
        self.gate = [randn(HIDDEN, INTER, gen=gen, device=device, scale=0.5) for _ in range(TP)]
        self.up = [randn(HIDDEN, INTER, gen=gen, device=device, scale=0.5) for _ in range(TP)]
        self.down = [randn(INTER, HIDDEN, gen=gen, device=device, scale=0.5) for _ in range(TP)]
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.5)
        self.states: dict = {}

    def runGraphBody(self, hidden):
        partials = torch.stack([(F.silu(hidden @ self.gate[r]) * (hidden @ self.up[r])) @ self.down[r]
                                for r in range(TP)])
        mlp = torch.empty_like(hidden)
        FastllmNcclAllReduce(partials, mlp, self.device, self.variant)
        return (hidden + mlp) @ self.lm_head

    def ForwardDecode(self, hidden):
        batch = hidden.shape[0]
        state = self.states.setdefault(batch, Qwen35CudaGraphDecodeState(batch, self.device))
        if state.disabled:
            return self.runGraphBody(hidden)
        state.inputIds.copy_(hidden)
        if state.captured:
            return replay(state.graph, state.logits).clone()
        if not state.warmed:
            FastllmCudaClearThreadError()
            with events.warmup():
                logits = self.runGraphBody(state.inputIds)             # runWithoutGraph()
            if self.variant == "fix" and FastllmCudaGetThreadError():
                state.disabled = True
                return logits.clone()
            state.warmed = True
            return logits.clone()
        FastllmCudaClearThreadError()
        graph, logits = capture(                                       # FastllmCudaGraphBeginCapture ..
            lambda: self.runGraphBody(state.inputIds), device=self.device, warmups=0,
            name=f"qwen3.5 decode batch {batch}", static={"inputIds": state.inputIds},
            owner="Qwen3.5 CUDA graph decode (fastllm, TP-2)")           # .. runGraphBody() .. EndCapture
        if self.variant == "fix" and FastllmCudaGetThreadError():     # the circuit breaker
            state.disabled = True                                      # Qwen35AbortCudaGraphCapture()
            return self.runGraphBody(state.inputIds).clone()           # runWithoutGraph()
        state.graph, state.logits, state.captured = graph, logits, True
        return replay(state.graph, state.logits).clone()               # first launch

    def OnAutoWarmupFinished(self):
        self.PreCaptureCudaGraphAfterWarmup()

    def PreCaptureCudaGraphAfterWarmup(self):
        gen = generator(5)
        for batch in PRECAPTURE_BATCHES:
            dummy = randn(batch, HIDDEN, gen=gen, device=self.device)
            self.ForwardDecode(dummy)                                  # warmup
            self.ForwardDecode(dummy)                                  # capture + first launch

    def AutoWarmup(self):
        """``basellm::AutoWarmup``: the warmup forward, then ``~AutoWarmupFinishGuard``, which runs
        ``OnAutoWarmupFinished()`` first and only then ``FastllmCudaSetNcclForceSync(false)``."""
        try:
            with events.warmup():
                self.runGraphBody(randn(1, HIDDEN, gen=generator(6), device=self.device))
        finally:
            try:
                self.OnAutoWarmupFinished()
            finally:
                FastllmCudaSetNcclForceSync(False)


def run(variant: str, device: str = "cpu"):
    gen = generator(263808)
    steps = [randn(b, HIDDEN, gen=gen, device=device) for b in SCHEDULE]

    def eager():
        FastllmCudaSetNcclForceSync(True)
        model = Qwen3_5Model(device, variant)
        return [model.runGraphBody(x).clone() for x in steps]

    def served():
        FastllmCudaSetNcclForceSync(True)                              # the process default
        model = Qwen3_5Model(device, variant)
        model.AutoWarmup()
        return [model.ForwardDecode(x) for x in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
