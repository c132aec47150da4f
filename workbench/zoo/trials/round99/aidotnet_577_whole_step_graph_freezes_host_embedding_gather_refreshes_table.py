"""AiDotNet.Tensors' whole-step CUDA graph of a token-LM training step captures the leading Embedding, a host int->float gather, and refreshes the embeddings matrix instead of the tokens before each replay, so every replayed step trains on the capture step's embeddings.

Upstream: https://github.com/ooples/AiDotNet.Tensors/pull/577 ("fix(gpu): CUDA-graph cortex training -
embedding-boundary + eligibility + input-feed (token-LM trains correctly at 100% util)", ooples/AiDotNet.Tensors,
merged 2026-06-09 as ee2e611fd); the embedding part is its commit 7282448 ("fix(gpu): run embedding eagerly outside
CUDA-graph capture (fixes frozen-input flat loss)", 2026-06-08). Read: the PR description (item 3, "Embedding-boundary
fix ... the correctness root"); the commit message and whole diff of 7282448 (``CompiledTrainingPlan.cs``:
``_graphEagerFwd``, ``Step``, ``RunEagerForwardPrefix``, ``RunGpuStepBodyForCapture``, the compiled-input choice in
``Compile``; ``OpType.cs``: ``OpType.Embedding``); ``CompiledTrainingPlan.cs`` at its parent (``Step``, ``StepEager``,
``RefreshGraphInputInPlace``, ``RunGpuStepBodyForCapture``, ``SetInput``, ``GraphWarmupSteps = 3``).
Symptom: with ``AIDOTNET_CUDA_GRAPH_STEP=1`` a token-LM cortex trains at full GPU utilisation but its loss stays flat
at ln V: the commit says "The captured training graph trained a token-LM cortex on the CAPTURE step's STALE token
indices". With graphs off the same plan trains.
Mechanism: ``CompiledTrainingPlan.Step`` runs ``GraphWarmupSteps`` eager steps, then a pre-residency pass of
``RunGpuStepBodyForCapture``, captures that body and launches it; later steps only ``RefreshGraphInputInPlace`` and
launch. The body runs every forward action, the first being the Embedding: a host gather of the table's rows by the
live token indices, whose output reaches the device through its upload. In the capture the gather runs once, with
the capture step's tokens; the graph keeps only the upload, which re-reads that host output by address, and no
replay gathers again. The one refresh before a replay targets ``_compiledInputTensor``, chosen in ``Compile`` as
``forwardSteps[0].Inputs[0]``: for a token LM that is the embeddings MATRIX, "never the integer indices". So every
replayed step computes the capture step's embeddings against this step's targets, and the weights drift from eager.
Doctor: host-work-frozen, at RunGpuStepBodyForCapture. The captured body runs the Embedding's host gather (host work)
inside the capture; replays repeat only the device kernels and the upload of its capture-time result, so the
embeddings stay those of the capture step. The fix changes that body to skip the host prefix.
Fix (upstream): ``_graphEagerFwd = 1`` when the first forward step is ``OpType.Embedding``; ``RunGpuStepBodyForCapture``
starts at ``_graphEagerFwd`` (the Embedding is not captured); ``Step`` calls ``RunEagerForwardPrefix()`` (the gather
with live indices) and ``RefreshGraphInputInPlace`` before the pre-residency pass and before every replay; ``Compile``
makes the Embedding's OUTPUT the compiled input, so the refresh uploads this step's embeddings into the graph's input.
Modelled: ``CompiledTrainingPlan`` with ``Step``, ``StepEager``, ``RunGpuStepBodyForCapture`` (forward actions,
grad zeroing, loss-grad seed, backward actions), ``RefreshGraphInputInPlace``, ``RunEagerForwardPrefix``, the eager
``_optimizerUpdate`` after each launch (plain SGD, lr 0.5), ``GraphWarmupSteps = 3`` and ``Compile``'s compiled-input
choice. The traced plan is a tiny token LM in float32: Embedding (vocab 8, dim 4) -> Linear+tanh (hidden 6) ->
Linear (vocab) -> cross-entropy on next tokens, with hand-written backward actions; the table is frozen (only the two
linears train), so the bug's refresh of the table re-uploads equal values. Stand-ins: an AiDotNet tensor is a pair of
a pinned host array and a device buffer with a version (``_Tensor``: the upload is ``copy_(non_blocking=True)`` when the
versions differ, as the engine's lazy residency does; ``UploadBufferInPlace`` is the same copy); the token indices are
host memory the trainer rewrites each step (``SetInput``-like); targets are a device buffer it refreshes. Left out:
eligibility checks, autocast, eviction suspension, fused kernels, Adam.
Workload: 7 training steps on batches of 2 sequences x 3 tokens: steps 1-3 eager, step 4 pre-residency pass +
capture + launch, steps 5-7 replays. Outputs: the loss of each step and the final weights. Bug: steps 5-7 replay
step 4's embeddings against their own targets: losses 2.108, 2.308, 1.723 against eager's 2.124, 2.537, 2.067, and the
final weights off by up to 0.29 (max error 0.344). Fix: the gather runs eagerly before each launch and its output is
the refreshed input; all seven steps equal eager (max error 0).
"""
from __future__ import annotations

import torch

from workbench.engine import host
from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/ooples/AiDotNet.Tensors/pull/577"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "RunGpuStepBodyForCapture"
SYMPTOM = ("whole-step CUDA-graph training of a token LM: the host embedding gather is captured once and the refresh "
           "targets the embeddings matrix, so replayed steps train on the capture step's embeddings (flat loss)")

VOCAB, DIM, HIDDEN, BATCH, SEQ = 8, 4, 6, 2, 3
STEPS = 7
LR = 0.5
DTYPE = torch.float32

_variant = "bug"


class OpType:
    Embedding, MatMulTanh, MatMul, CrossEntropyLoss = "Embedding", "MatMulTanh", "MatMul", "CrossEntropyLoss"


class _Tensor:
    """An AiDotNet tensor with GPU residency: host array (pinned), device buffer, and the versions of both."""

    def __init__(self, data, device):
        self._host = host(data.clone(), device)
        self._gpuBuffer = data.clone().to(device)
        self.Version, self._gpuBufferVersion = 0, 0

    def GetDataArray(self):
        return self._host

    def TryGetGpuBuffer(self):
        """The resident buffer, uploaded first if the host data changed since (lazy residency)."""
        if self._gpuBufferVersion != self.Version:
            self._gpuBuffer.copy_(self._host, non_blocking=True)
            self._gpuBufferVersion = self.Version
        return self._gpuBuffer


class _Step:
    def __init__(self, op_type, inputs, output):
        self.OpType, self.Inputs, self.OutputBuffer = op_type, inputs, output


# --- the traced token LM: forward steps and backward actions --------------------------------------------------------

class TokenLM:
    def __init__(self, device, gen):
        r = lambda *s, scale: (torch.randn(*s, generator=gen) * scale).to(DTYPE)       # noqa: E731
        self.embeddings = _Tensor(r(VOCAB, DIM, scale=1.0), device)        # frozen (pretrained) table
        self.token_indices = _Tensor(torch.zeros(BATCH * SEQ, dtype=torch.long), device)
        self.embedded = _Tensor(torch.zeros(BATCH * SEQ, DIM, dtype=DTYPE), device)
        self.w1 = r(DIM, HIDDEN, scale=0.7).to(device)
        self.w2 = r(HIDDEN, VOCAB, scale=0.7).to(device)
        self.targets = torch.zeros(BATCH * SEQ, dtype=torch.long, device=device)
        self.hidden = torch.zeros(BATCH * SEQ, HIDDEN, dtype=DTYPE, device=device)
        self.probs = torch.zeros(BATCH * SEQ, VOCAB, dtype=DTYPE, device=device)
        self.loss = torch.zeros((), dtype=DTYPE, device=device)
        self.grad_w1 = torch.zeros_like(self.w1)
        self.grad_w2 = torch.zeros_like(self.w2)
        self.loss_grad_seed = torch.full((), 1.0 / (BATCH * SEQ), dtype=DTYPE, device=device)
        self.loss_grad = torch.zeros((), dtype=DTYPE, device=device)
        self.forward_steps = [
            _Step(OpType.Embedding, [self.embeddings, self.token_indices], self.embedded),
            _Step(OpType.MatMulTanh, [self.embedded], self.hidden),
            _Step(OpType.MatMul, [self.hidden], self.probs),
            _Step(OpType.CrossEntropyLoss, [self.probs], self.loss),
        ]

    def TensorEmbeddingLookup(self, engine=None):
        """Host int->float gather of the table's rows by the live token indices; the output is uploaded lazily."""
        rows = torch.index_select(self.embeddings.GetDataArray(), 0, self.token_indices.GetDataArray())
        self.embedded.GetDataArray().copy_(rows)
        self.embedded.Version += 1

    def forward_hidden(self, engine=None):
        self.hidden.copy_(torch.tanh(self.embedded.TryGetGpuBuffer() @ self.w1))

    def forward_logits(self, engine=None):
        self.probs.copy_(torch.softmax(self.hidden @ self.w2, dim=-1))

    def forward_loss(self, engine=None):
        picked = self.probs.gather(1, self.targets[:, None]).squeeze(1)
        self.loss.copy_(-picked.log().mean())

    def backward(self, engine=None):
        onehot = torch.zeros_like(self.probs).scatter_(1, self.targets[:, None], 1.0)
        d_logits = (self.probs - onehot) * self.loss_grad
        self.grad_w2.add_(self.hidden.t() @ d_logits)
        d_pre = (d_logits @ self.w2.t()) * (1 - self.hidden * self.hidden)
        self.grad_w1.add_(self.embedded.TryGetGpuBuffer().t() @ d_pre)


# --- Engines/Compilation/CompiledTrainingPlan.cs (reduced) ------------------------------------------------------------

class CompiledTrainingPlan:
    GraphWarmupSteps = 3      # eager first so cuBLAS workspace / lazy buffers stabilize

    def __init__(self, model, forward_steps, compiled_input_tensor, device, cuda_graph_step):
        self._model, self._forwardSteps, self._device = model, forward_steps, device
        self._forwardActions = [model.TensorEmbeddingLookup, model.forward_hidden, model.forward_logits,
                                model.forward_loss]
        self._backwardActions = [model.backward]
        self._preAllocatedGrads = [model.grad_w1, model.grad_w2]
        self._compiledInputTensor = compiled_input_tensor
        if _variant == "bug":
            self._graphEagerFwd = 0
        else:
            self._graphEagerFwd = 1 if forward_steps and forward_steps[0].OpType == OpType.Embedding else 0
        self._graph_step_enabled = cuda_graph_step
        self._graphStepCalls, self._stepGraphExec = 0, None

    def _optimizerUpdate(self):
        """Run eagerly after each launch (never captured): plain SGD on the trained parameters."""
        m = self._model
        m.w1.sub_(LR * m.grad_w1)
        m.w2.sub_(LR * m.grad_w2)

    def Step(self):
        if self._graph_step_enabled:
            self._graphStepCalls += 1
            if self._graphStepCalls > self.GraphWarmupSteps:
                if self._stepGraphExec is None:
                    if _variant == "fix":
                        self.RunEagerForwardPrefix()
                        self.RefreshGraphInputInPlace()
                    # PRE-RESIDENCY PASS (the warmup), then the capture of the same body
                    static = {"compiled_input": self._compiledInputTensor._gpuBuffer, "targets": self._model.targets}
                    self._stepGraphExec, self._lossOutput = capture(
                        self.RunGpuStepBodyForCapture, device=self._device, warmups=1, name="training_step",
                        owner="CompiledTrainingPlan", static=static)
                    loss = replay(self._stepGraphExec, self._lossOutput)    # executes THIS step
                    self._optimizerUpdate()
                    return loss
                if _variant == "fix":
                    self.RunEagerForwardPrefix()   # re-run the embedding (host gather, live token indices)
                self.RefreshGraphInputInPlace()
                loss = replay(self._stepGraphExec, self._lossOutput)
                self._optimizerUpdate()
                return loss
        return self.StepEager()

    def RefreshGraphInputInPlace(self):
        """Refresh the persistent graph-input tensor's GPU buffer in place with its current host contents."""
        inT = self._compiledInputTensor
        if inT is None:
            return
        inT._gpuBuffer.copy_(inT.GetDataArray(), non_blocking=True)     # cb.UploadBufferInPlace
        inT._gpuBufferVersion = inT.Version

    def RunEagerForwardPrefix(self):
        for i in range(min(self._graphEagerFwd, len(self._forwardActions))):
            self._forwardActions[i](None)

    def RunGpuStepBodyForCapture(self):
        fwd = self._forwardActions
        if _variant == "bug":
            for i in range(len(fwd)):
                fwd[i](None)
        else:
            for i in range(self._graphEagerFwd, len(fwd)):
                fwd[i](None)
        for grad in self._preAllocatedGrads:
            grad.zero_()                                                   # cb.MemsetBuffer
        self._model.loss_grad.copy_(self._model.loss_grad_seed)          # cb.CopyBufferDtoD
        for action in self._backwardActions:
            action(None)
        return (self._model.loss,)

    def StepEager(self):
        for action in self._forwardActions:
            action(None)
        for grad in self._preAllocatedGrads:
            grad.zero_()
        self._model.loss_grad.copy_(self._model.loss_grad_seed)
        for action in self._backwardActions:
            action(None)
        self._optimizerUpdate()
        return (self._model.loss,)


def Compile(model, device, cuda_graph_step):
    """The compiled-input choice of ``CompiledTrainingPlan.Compile``."""
    forwardSteps = model.forward_steps
    if _variant == "bug":
        compiledInputTensor = forwardSteps[0].Inputs[0] if forwardSteps and forwardSteps[0].Inputs else None
    else:
        firstIsEmbedding = bool(forwardSteps) and forwardSteps[0].OpType == OpType.Embedding
        compiledInputTensor = forwardSteps[0].OutputBuffer if firstIsEmbedding else (
            forwardSteps[0].Inputs[0] if forwardSteps and forwardSteps[0].Inputs else None)
    return CompiledTrainingPlan(model, forwardSteps, compiledInputTensor, device, cuda_graph_step)


# --- the workload ----------------------------------------------------------------------------------------------------

def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(5770)
    batches = [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen) for _ in range(STEPS)]

    def train(cuda_graph_step):
        model = TokenLM(device, generator(577))
        plan = Compile(model, device, cuda_graph_step)
        losses = []
        for batch in batches:
            model.token_indices.GetDataArray().copy_(batch[:, :-1].reshape(-1))   # this step's tokens (host)
            model.token_indices.Version += 1
            model.targets.copy_(batch[:, 1:].reshape(-1).to(device))
            (loss,) = plan.Step()
            losses.append(loss.clone())
        return [torch.stack(losses), model.w1.clone(), model.w2.clone()]

    eager = lambda: train(cuda_graph_step=False)      # noqa: E731
    served = lambda: train(cuda_graph_step=True)      # noqa: E731
    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
