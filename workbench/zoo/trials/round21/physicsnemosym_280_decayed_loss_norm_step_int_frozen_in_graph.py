"""PhysicsNeMo-Sym's CUDA-graph trainer captures the loss with ``step`` as a Python int: the decayed loss order freezes.

Upstream: https://github.com/NVIDIA/physicsnemo-sym/pull/280 ("Fix losses and aggregators when using CUDA graphs"),
fixing https://github.com/NVIDIA/physicsnemo-sym/issues/279 ("Loss Functions and Aggregators break with CUDA
graphs"). Read: the issue, the PR description, and the pre-fix ``trainer.py`` / ``loss/loss.py`` /
``loss/aggregator.py``; the PR diff itself was not available, so the fixed code below follows its description
("passes ``step`` as an int scalar tensor ... so that CUDA graphs can track it").
Symptom: training with ``cuda_graphs: True`` (e.g. the turbulent-channel example) behaves as if every step after
the capture were the capture step: step-dependent loss weights, loss norms and aggregator schedules stay at the
values of the step recorded after ``cuda_graph_warmup`` (PhysicsNeMo-Sym 2.3, February 2026).
Mechanism: ``Trainer._cuda_graph_training_step(step)`` runs ``cuda_graph_warmup`` eager steps, then records
``self.compute_gradients(self.aggregator, self.global_optimizer_model, step)`` into a ``torch.cuda.CUDAGraph`` and
afterwards only replays it (the optimizer and scheduler steps stay outside the graph). ``step`` is a Python int, so
everything the losses derive from it is host work done once, during the capture. ``DecayedPointwiseLossNorm``
computes its order ``ord(step) = start_ord - (start_ord - end_ord) * (1 - decay_rate ** (step / decay_steps))`` in
Python and hands the float to ``PointwiseLossNorm._loss`` as the exponent of ``torch.abs(pred - true).pow(ord)``;
the recorded kernels keep the capture step's exponent, so every replayed step computes the loss (and its gradient)
with ``ord(cuda_graph_warmup)`` while eager training keeps decaying it.
Doctor: host-work-frozen, at ``ord`` (the decayed loss order is computed on the host from the Python ``step`` inside
the captured region).
Fix (upstream): the trainer passes ``step`` as an int scalar tensor, updated in place each step outside the graph,
so ``ord(step)`` becomes device arithmetic the graph replays; data-dependent ``if`` statements in losses and
aggregators were rewritten with ``torch.where``.
(Tiny PINN: one linear network, one pointwise constraint, ``Sum`` aggregator, SGD with an exponential LR schedule;
the gradient is written in place by hand instead of ``loss.backward()``. The model replays the graph once right
after capturing it, so that the capture step trains on real gradients; upstream applies the optimizer after the
capture alone.)
"""
from __future__ import annotations

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/physicsnemo-sym/pull/280"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "ord"
SYMPTOM = "after capture every CUDA-graph training step uses the capture step's decayed loss norm order"
DIM_IN, DIM_OUT, POINTS, MAX_STEPS, CUDA_GRAPH_WARMUP = 3, 2, 8, 7, 2


class DecayedLossNorm:
    def __init__(self, start_ord=2, end_ord=1, decay_steps=2, decay_rate=0.5):
        self.start_ord, self.end_ord = start_ord, end_ord
        self.decay_steps, self.decay_rate = decay_steps, decay_rate

    def ord(self, step):
        return self.start_ord - (self.start_ord - self.end_ord) * (
            1.0 - self.decay_rate ** (step / self.decay_steps))


class DecayedPointwiseLossNorm(DecayedLossNorm):
    def forward(self, invar, pred_outvar, true_outvar, lambda_weighting, step):
        return PointwiseLossNorm._loss(invar, pred_outvar, true_outvar, lambda_weighting, step, self.ord(step))


class PointwiseLossNorm:
    @staticmethod
    def _loss(invar, pred_outvar, true_outvar, lambda_weighting, step, ord):
        losses, grads = {}, {}
        for key in pred_outvar:
            err = pred_outvar[key] - true_outvar[key]
            losses[key] = (lambda_weighting[key] * torch.abs(err).pow(ord)).sum()
            # d loss / d pred, what autograd's backward of the expression above computes
            grads[key] = lambda_weighting[key] * ord * torch.abs(err).pow(ord - 1) * torch.sign(err)
        return losses, grads


class Sum:
    """``physicsnemo.sym.loss.aggregator.Sum``"""

    def __call__(self, losses, step):
        loss = torch.zeros((), device=next(iter(losses.values())).device)
        for key in losses:
            loss += losses[key]
        return loss


class FullyConnected:
    def __init__(self, weight):
        self.weight = weight
        self.weight.grad = torch.zeros_like(weight)

    def __call__(self, x):
        return x @ self.weight


class PointwiseConstraint:
    def __init__(self, model, loss, batches, device):
        self.model, self._loss = model, loss
        self.batches = batches
        self._input_vars = {"x": torch.zeros(POINTS, DIM_IN, device=device)}
        self._target_vars = {"u": torch.zeros(POINTS, DIM_OUT, device=device)}
        self._lambda_weighting = {"u": torch.ones(POINTS, DIM_OUT, device=device)}

    def load_data(self, step, static=False):
        x, u = self.batches[step]
        if static:                                    # cuda graphs: copy into the static allocations
            self._input_vars["x"].copy_(x)
            self._target_vars["u"].copy_(u)
        else:
            self._input_vars, self._target_vars = {"x": x}, {"u": u}

    def forward(self):
        self._output_vars = {"u": self.model(self._input_vars["x"])}

    def loss(self, step):
        return self._loss.forward(self._input_vars, self._output_vars, self._target_vars, self._lambda_weighting, step)


class Trainer:
    def __init__(self, weight, batches, variant, device, cuda_graphs):
        self.variant, self.device, self.cuda_graphs = variant, device, cuda_graphs
        self.model = FullyConnected(weight.clone())
        self.constraint = PointwiseConstraint(self.model, DecayedPointwiseLossNorm(), batches, device)
        self.aggregator = Sum()
        self.optimizer = torch.optim.SGD([self.model.weight], lr=0.05)
        self.scheduler = torch.optim.lr_scheduler.ExponentialLR(self.optimizer, gamma=0.9)
        self.initial_step = 0
        self.step_tensor = torch.zeros((), dtype=torch.int64, device=device)   # the fix: step on the device

    def compute_gradients(self, aggregator, global_optimizer_model, step):
        self.constraint.forward()
        losses, dloss_dpred = self.constraint.loss(step)
        loss = aggregator(losses, step)
        # loss.backward(): d loss / d W = x^T @ d loss / d pred
        global_optimizer_model.weight.grad.copy_(self.constraint._input_vars["x"].t() @ dloss_dpred["u"])
        return loss, losses

    def apply_gradients(self):
        self.optimizer.step()

    def _cuda_graph_training_step(self, step):
        if self.variant == "fix":
            self.step_tensor.fill_(step)               # updated in place each step, outside the graph
            step = self.step_tensor
        if (self.step_index - self.initial_step) < CUDA_GRAPH_WARMUP:
            with events.warmup(real=True):
                self.loss_static, self.losses_static = self.compute_gradients(
                    self.aggregator, self.model, step)
            self.apply_gradients()
            self.scheduler.step()
        elif (self.step_index - self.initial_step) == CUDA_GRAPH_WARMUP:
            static = {"invar": self.constraint._input_vars["x"], "true_outvar": self.constraint._target_vars["u"]}
            if self.variant == "fix":
                static["step"] = self.step_tensor
            self.g, (self.loss_static, self.losses_static) = capture(
                lambda: self.compute_gradients(self.aggregator, self.model, step), device=self.device, warmups=0,
                static=static, state={"weight": self.model.weight, "weight.grad": self.model.weight.grad},
                owner="Trainer (cuda_graphs)", name="compute_gradients")
            replay(self.g, self.loss_static)
            self.apply_gradients()
            self.scheduler.step()
        else:
            replay(self.g, self.loss_static)
            self.apply_gradients()
            self.scheduler.step()
        return self.loss_static, self.losses_static

    def train(self):
        history = []
        for step in range(self.initial_step, MAX_STEPS + 1):
            self.step_index = step
            if self.cuda_graphs:
                self.constraint.load_data(step, static=True)
                loss, losses = self._cuda_graph_training_step(step)
            else:
                self.constraint.load_data(step)
                loss, losses = self.compute_gradients(self.aggregator, self.model, step)
                self.apply_gradients()
                self.scheduler.step()
            history.append(loss.clone())
        return history + [self.model.weight.clone()]


def run(variant: str, device: str = "cpu"):
    gen = generator(280)
    weight = randn(DIM_IN, DIM_OUT, gen=gen, device=device, scale=0.5)
    w_true = randn(DIM_IN, DIM_OUT, gen=gen, device=device)
    batches = []
    for _ in range(MAX_STEPS + 1):
        x = randn(POINTS, DIM_IN, gen=gen, device=device)
        batches.append((x, x @ w_true))

    def served():
        return Trainer(weight, batches, variant, device, cuda_graphs=True).train()

    def eager():
        return Trainer(weight, batches, variant, device, cuda_graphs=False).train()

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
