"""AiDotNet.Tensors' whole-step CUDA-graph training binds each gradient's buffer once, at ConfigureOptimizer time, before the capture pre-pass makes the gradients GPU-resident, so the eager optimizer after every graph launch reads the gradients' stale host backing instead of what the captured backward wrote.

Upstream: https://github.com/ooples/AiDotNet.Tensors/pull/705 ("fix(#638): CUDA-graph capture training now LEARNS
(device barrier + deterministic scratch pool + LN resident-weight gate)", ooples/AiDotNet.Tensors, merged
2026-06-28 as 25132d1). Read: the PR description and both commit messages; the whole diff of
``CompiledTrainingPlan.cs`` (the "CAPTURE-FREEZE FIX (#638)" hunks in ``ConfigureOptimizerFloat`` and
``ConfigureOptimizerFloatGrouped``, the scratch-action tags in ``RunGpuStepBodyForCapture``, the
``_gpuBufferVersion`` sync) and of ``CudaBackend.Graph.cs``; ``CompiledTrainingPlan.cs`` at its parent (``Step``,
``RunGpuStepBodyForCapture``, ``StepEager``, ``ConfigureOptimizerFloat`` and its ``_optimizerUpdate`` closure,
``RefreshGraphInputInPlace``, ``GraphWarmupSteps = 3``); ``DirectGpuTensorEngine.EnsureResidentBuffer`` at the
parent. This program models the grad-buffer re-resolve only (the other root causes of the PR are not modelled).
Symptom: with ``AIDOTNET_CUDA_GRAPH_STEP=1`` the captured step replays, but "AdamUpdate ran on ~zero grads ->
weights never changed -> FLAT loss / frozen pL1 across epochs (the capture-doesn't-learn bug)"; eager training
learns.
Mechanism: ``ConfigureOptimizerFloat`` runs when the user configures the optimizer, before any step. For each
GPU-resident parameter it binds ``gpuGrad[p] = _gradients[p].TryGetGpuBuffer()``; the gradient is not resident yet
(null), so it binds the gradient's live host backing as ``gradArrays[p]`` and the ``_optimizerUpdate`` closure
uploads that array each step. Eager steps write their gradients there, so eager training is right. After
``GraphWarmupSteps`` the graph path runs a pre-residency pass of ``RunGpuStepBodyForCapture``: it calls
``EnsureResidentBuffer`` on every pre-allocated gradient, which binds a new device buffer, and the captured
backward then zeroes and accumulates into those resident buffers. Nothing writes the host backing any more, yet
the optimizer, run eagerly after each ``LaunchCapturedGraph``, still uploads it: every graph step is updated with
the gradients the last eager step left there (upstream saw all zeros).
Doctor: stale-input, at _optimizerUpdate. The optimizer's gradient input for a graph step is memory that step
never wrote (the host backing, written only by the eager steps before capture), so the update depends on what an
earlier step left there; the fix makes ``_optimizerUpdate`` read the buffer the captured backward writes.
Fix (upstream): in the ``_optimizerUpdate`` closure, ``gradBuf = (_gradients[p]?.TryGetGpuBuffer()) ??
gpuGrad[p]``: the gradient's CURRENT resident buffer is re-resolved every step (eager paths, where the gradient is
not resident, still get null and keep the host fallback).
Modelled: ``CompiledTrainingPlan`` with ``Step`` (warmup counter, pre-residency pass + capture + launch, replay,
the eager ``_optimizerUpdate`` after each launch), ``StepEager``, ``RunGpuStepBodyForCapture`` (forward actions,
``EnsureResidentBuffer`` only when not capturing, grad memset, backward actions), ``RefreshGraphInputInPlace``
and ``ConfigureOptimizerFloat`` (GPU-param path: ``gpuGrad``/``gradArrays`` binding, Adam with bias correction,
the transient upload of a non-resident gradient). Stand-ins: an AiDotNet tensor is ``_Tensor``: a host backing
(pinned host memory), an optional bound device buffer and versions; ``DirectGpuTensorEngine`` holds
``EnsureResidentBuffer`` and the backward's in-place gradient accumulate (on the device buffer when resident,
else a download-accumulate into the host backing); ``CudaBackend`` holds ``AllocateBuffer`` and ``AdamUpdate``.
The traced plan is a two-layer MLP (4 -> tanh 6 -> 3) with an MSE loss in float32, params GPU-resident, backward
written out. Left out: LR schedules other than a constant, grad clipping, autocast, eviction, scratch pooling,
the stream barrier, the embedding path.
Workload: 7 training steps of batch 5: steps 1-3 eager, step 4 pre-residency pass + capture + launch, steps 5-7
replays; the trainer writes each batch into the input's host backing (SetInput) and the targets buffer. Returned:
every step's loss and the final weights. Bug: steps 4-7 are updated with step 3's gradients: losses 0.9962,
1.8700, 1.2684 at steps 5-7 against eager's 1.0387, 1.8062, 1.2137, final weights off by up to 0.188 (w1) and
0.221 (w2) (max error 0.221). Fix: every step equals eager (max error 0).
"""
from __future__ import annotations

import torch

from workbench.engine import host, is_capturing
from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/ooples/AiDotNet.Tensors/pull/705"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "_optimizerUpdate"
SYMPTOM = ("whole-step CUDA-graph training: the eager optimizer keeps the gradient binding made at ConfigureOptimizer "
           "time and uploads the stale host backing, not the resident buffers the captured backward writes (flat loss)")

DIN, HID, DOUT, BATCH = 4, 6, 3, 5
STEPS = 7
LR, BETA1, BETA2, EPS = 0.05, 0.9, 0.999, 1e-8
DTYPE = torch.float32

_variant = "bug"


class _Tensor:
    """An AiDotNet tensor: a host backing (managed array), an optional bound device buffer and the versions of both."""

    def __init__(self, data, device, resident=False):
        self._host = host(data.clone(), device)
        self._gpuBuffer = data.clone().to(device) if resident else None
        self.Version, self._gpuBufferVersion = 0, 0
        self.Length = data.numel()

    def GetDataArray(self):
        return self._host

    def GetLiveBackingArrayAllowingPaddingOrNull(self):
        return self._host

    def TryGetGpuBuffer(self):
        """The bound device buffer (a resident param, or a tensor the engine made resident), else None."""
        return self._gpuBuffer


class CudaBackend:
    def __init__(self, device):
        self.device = device

    def IsStreamCapturing(self):
        return is_capturing()

    def AllocateBuffer(self, data):
        """A fresh device buffer holding ``data`` (host memory): ``cuMemAlloc`` + an upload."""
        buf = torch.empty(data.shape, dtype=DTYPE, device=self.device)
        buf.copy_(data)
        return buf

    def AdamUpdate(self, param, grad, m, v, lr, b1, b2, eps, wd, step):
        m.mul_(b1).add_((1 - b1) * grad)
        v.mul_(b2).add_((1 - b2) * grad * grad)
        m_hat = m / (1 - b1 ** step)
        v_hat = v / (1 - b2 ** step)
        param.sub_(lr * (m_hat / (v_hat.sqrt() + eps) + wd * param))


class DirectGpuTensorEngine:
    def __init__(self, backend):
        self._backend = backend

    def GetResidentOrPersistentInputBuffer(self, t):
        """The input's device buffer, uploaded when the host backing is newer (lazy residency)."""
        if t._gpuBuffer is None:
            t._gpuBuffer = torch.empty(t._host.shape, dtype=DTYPE, device=self._backend.device)
            t._gpuBufferVersion = -1
        if t._gpuBufferVersion != t.Version:
            t._gpuBuffer.copy_(t._host, non_blocking=True)
            t._gpuBufferVersion = t.Version
        return t._gpuBuffer

    def EnsureResidentBuffer(self, t):
        """PR #638 A1: bind a stable resident device buffer to ``t`` (allocate once); idempotent."""
        if t._gpuBuffer is not None:
            return t._gpuBuffer
        buf = torch.zeros(t._host.shape, dtype=DTYPE, device=self._backend.device)
        t._gpuBuffer = buf
        return buf

    def TensorAddInPlace(self, accumulator, value):
        """The generic backward's accumulate into ``gradMap[input]``: in place on the resident buffer, else a
        download-accumulate into the host backing (the pre-#638 home of the accumulators)."""
        buf = accumulator.TryGetGpuBuffer()
        if buf is not None:
            buf.add_(value)
        else:
            backing = accumulator.GetDataArray()
            backing.copy_(backing.to(value.device) + value)


# --- the traced plan: a two-layer MLP with an MSE loss, forward and backward actions ---------------------------------

class TracedMlp:
    def __init__(self, device, gen):
        r = lambda *s, scale: (torch.randn(*s, generator=gen) * scale).to(DTYPE)       # noqa: E731
        self.input = _Tensor(torch.zeros(BATCH, DIN, dtype=DTYPE), device)             # _compiledInputTensor
        self.targets = torch.zeros(BATCH, DOUT, dtype=DTYPE, device=device)
        self.w1 = _Tensor(r(DIN, HID, scale=0.6), device, resident=True)
        self.w2 = _Tensor(r(HID, DOUT, scale=0.6), device, resident=True)
        self.grad_w1 = _Tensor(torch.zeros(DIN, HID, dtype=DTYPE), device)              # CPU-resident accumulators
        self.grad_w2 = _Tensor(torch.zeros(HID, DOUT, dtype=DTYPE), device)
        self.hidden = torch.zeros(BATCH, HID, dtype=DTYPE, device=device)
        self.out = torch.zeros(BATCH, DOUT, dtype=DTYPE, device=device)
        self.loss = torch.zeros((), dtype=DTYPE, device=device)

    def forward_hidden(self, engine):
        x = engine.GetResidentOrPersistentInputBuffer(self.input)
        self.hidden.copy_(torch.tanh(x @ self.w1.TryGetGpuBuffer()))

    def forward_out(self, engine):
        self.out.copy_(self.hidden @ self.w2.TryGetGpuBuffer())

    def forward_loss(self, engine):
        self.loss.copy_(((self.out - self.targets) ** 2).mean())

    def backward(self, engine):
        d_out = 2.0 * (self.out - self.targets) / (BATCH * DOUT)
        engine.TensorAddInPlace(self.grad_w2, self.hidden.t() @ d_out)
        d_pre = (d_out @ self.w2.TryGetGpuBuffer().t()) * (1 - self.hidden * self.hidden)
        x = engine.GetResidentOrPersistentInputBuffer(self.input)
        engine.TensorAddInPlace(self.grad_w1, x.t() @ d_pre)


# --- Engines/Compilation/CompiledTrainingPlan.cs (reduced) ------------------------------------------------------------

class CompiledTrainingPlan:
    GraphWarmupSteps = 3      # eager first so cuBLAS workspace / lazy buffers stabilize

    def __init__(self, model, engine, cuda_graph_step):
        self._model, self._engine, self._backend = model, engine, engine._backend
        self._forwardActions = [model.forward_hidden, model.forward_out, model.forward_loss]
        self._backwardActions = [model.backward]
        self._parameters = [model.w1, model.w2]
        self._gradients = [model.grad_w1, model.grad_w2]
        self._preAllocatedGrads = [model.grad_w1, model.grad_w2]
        self._compiledInputTensor = model.input
        self._lossOutput = (model.loss,)
        self._graph_step_enabled = cuda_graph_step
        self._graphStepCalls, self._stepGraphExec = 0, None
        self._optimizerUpdate, self._optimizerStep = None, 0

    def ConfigureOptimizerFloat(self, lr, beta1, beta2, eps, weightDecay):
        paramCount = len(self._parameters)
        gradArrays, gpuParam, gpuGrad = [None] * paramCount, [None] * paramCount, [None] * paramCount
        gpuM, gpuV = [None] * paramCount, [None] * paramCount
        for p in range(paramCount):
            paramGpuBuf = self._parameters[p].TryGetGpuBuffer()
            if paramGpuBuf is not None:
                gpuParam[p] = paramGpuBuf
                gradGpuBuf = self._gradients[p].TryGetGpuBuffer()
                if gradGpuBuf is not None:
                    gpuGrad[p] = gradGpuBuf
                else:
                    # Gradient is CPU-resident: bind its live CPU backing; the per-step closure uploads it.
                    gradArrays[p] = self._gradients[p].GetLiveBackingArrayAllowingPaddingOrNull()
                gpuM[p] = torch.zeros_like(paramGpuBuf)
                gpuV[p] = torch.zeros_like(paramGpuBuf)
        self._optimizerStep = 0
        gpuBe = self._backend

        def _optimizerUpdate():
            self._optimizerStep += 1
            for p in range(paramCount):
                gpuP = gpuParam[p]
                if _variant == "bug":
                    gradBuf = gpuGrad[p]
                else:
                    # CAPTURE-FREEZE FIX (#638): re-resolve the gradient's resident buffer EACH STEP.
                    gradBuf = self._gradients[p].TryGetGpuBuffer()
                    if gradBuf is None:
                        gradBuf = gpuGrad[p]
                if gradBuf is None:
                    gradBuf = gpuBe.AllocateBuffer(gradArrays[p])        # transient upload of the host backing
                gpuBe.AdamUpdate(gpuP, gradBuf, gpuM[p], gpuV[p], lr, beta1, beta2, eps, weightDecay,
                                 self._optimizerStep)

        self._optimizerUpdate = _optimizerUpdate

    def Step(self):
        if self._graph_step_enabled:
            self._graphStepCalls += 1
            if self._graphStepCalls > self.GraphWarmupSteps:
                if self._stepGraphExec is None:
                    self.RefreshGraphInputInPlace()
                    # PRE-RESIDENCY pass (the warmup), then the capture of the same body
                    static = {"compiled_input": self._compiledInputTensor._gpuBuffer,
                              "targets": self._model.targets}
                    self._stepGraphExec, self._lossOutput = capture(
                        self.RunGpuStepBodyForCapture, device=self._backend.device, warmups=1,
                        name="training_step", owner="CompiledTrainingPlan", static=static)
                    loss = replay(self._stepGraphExec, self._lossOutput)    # executes THIS step
                    self._optimizerUpdate()
                    return loss
                self.RefreshGraphInputInPlace()
                loss = replay(self._stepGraphExec, self._lossOutput)
                self._optimizerUpdate()
                return loss
        return self.StepEager()

    def RefreshGraphInputInPlace(self):
        """Refresh the persistent graph-input buffer in place (stable pointer) with its host contents, outside capture."""
        inT = self._compiledInputTensor
        if inT._gpuBuffer is None:
            return
        inT._gpuBuffer.copy_(inT.GetDataArray(), non_blocking=True)      # cb.UploadBufferInPlace
        inT._gpuBufferVersion = inT.Version

    def RunGpuStepBodyForCapture(self):
        engine = self._engine
        for action in self._forwardActions:
            action(engine)
        # PR #638 A1: bind a STABLE resident GPU buffer to every pre-allocated gradient accumulator, only in the
        # not-capturing pre-pass; during capture/replay the buffers already exist: memset + accumulate in place.
        if not self._backend.IsStreamCapturing():
            for grad in self._preAllocatedGrads:
                engine.EnsureResidentBuffer(grad)
        for grad in self._preAllocatedGrads:
            gb = grad.TryGetGpuBuffer()
            if gb is not None:
                gb.zero_()                                                  # cb.MemsetBuffer
        for action in self._backwardActions:
            action(engine)
        # NOTE: _optimizerUpdate is intentionally NOT invoked here: it runs eagerly in Step() after the launch.
        return self._lossOutput

    def StepEager(self):
        engine = self._engine
        for action in self._forwardActions:
            action(engine)
        for grad in self._preAllocatedGrads:
            gb = grad.TryGetGpuBuffer()
            if gb is not None:
                gb.zero_()
            else:
                grad.GetDataArray().zero_()                                 # Array.Clear(gradArrays[i])
        for action in self._backwardActions:
            action(engine)
        self._optimizerUpdate()
        return self._lossOutput


# --- the workload ----------------------------------------------------------------------------------------------------

def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(7050)
    batches = [(torch.randn(BATCH, DIN, generator=gen).to(DTYPE), torch.randn(BATCH, DOUT, generator=gen).to(DTYPE))
               for _ in range(STEPS)]

    def train(cuda_graph_step):
        model = TracedMlp(device, generator(705))
        plan = CompiledTrainingPlan(model, DirectGpuTensorEngine(CudaBackend(device)), cuda_graph_step)
        plan.ConfigureOptimizerFloat(LR, BETA1, BETA2, EPS, 0.0)
        losses = []
        for x, y in batches:
            model.input.GetDataArray().copy_(x)                  # SetInput: this step's batch (host backing)
            model.input.Version += 1
            model.targets.copy_(y.to(device))
            (loss,) = plan.Step()
            losses.append(loss.clone())
        return [torch.stack(losses), model.w1.TryGetGpuBuffer().clone(), model.w2.TryGetGpuBuffer().clone()]

    eager = lambda: train(cuda_graph_step=False)      # noqa: E731
    served = lambda: train(cuda_graph_step=True)      # noqa: E731
    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
