"""Single-tensor RAdam with ``capturable=True`` reads ``step`` back to the host and branches on it in the capture.

Upstream: https://github.com/pytorch/pytorch/pull/121260 ("Add RAdam capturable API for forloop"),
for issue https://github.com/pytorch/pytorch/issues/118230 ("Add capturable single-tensor RAdam").
Symptom: ``torch.optim.RAdam(..., capturable=True, foreach=False)`` could not be captured: a whole training
step with ``optimizer.step()`` inside ``torch.cuda.graph`` fails (PyTorch 2.2, early 2024; the foreach
implementation had become capturable in #117912, the for-loop one had not, and the optimizer tests had to
skip the combination until this PR, March 2024).
Mechanism: ``_single_tensor_radam`` computed every step-dependent quantity on the host:
``step = _get_value(step_t)`` (``step_t.item()`` for a device step tensor, a host synchronisation that a
stream capture refuses), then the bias corrections, ``rho_t`` and the Python branch ``if rho_t > 5.0``
that picks the rectified or the plain update. Even if the read were allowed, the capture would bake the
capture-time step and branch into every replay.
Doctor: sync-in-capture, at ``_single_tensor_radam`` (the ``.item()`` of the device step tensor).
Fix (upstream): a ``capturable`` branch that keeps everything on the device: ``bias_correction1/2`` and
``rho_t`` from ``step_t`` tensors, and ``update = torch.where(rho_t > 5.0, rect * adaptive_lr, 1.0)`` in
place of the Python branch.
"""
from __future__ import annotations

import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/pytorch/pull/121260"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "_single_tensor_radam"
SYMPTOM = "capturing a training step with single-tensor RAdam(capturable=True) fails at step_t.item()"
DIM, OUT, BATCH, STEPS = 4, 2, 6, 8          # rho_t passes 5 at step 6: both update rules are exercised


def _get_value(x):
    # item is significantly faster than a cpu tensor in eager mode
    return x.item() if isinstance(x, torch.Tensor) else x


def _single_tensor_radam(params, grads, exp_avgs, exp_avg_sqs, state_steps, *, beta1, beta2, lr,
                         weight_decay, eps, capturable, has_capturable_branch):
    for i, param in enumerate(params):
        grad = grads[i]
        exp_avg = exp_avgs[i]
        exp_avg_sq = exp_avg_sqs[i]
        step_t = state_steps[i]

        # update step
        step_t += 1

        if weight_decay != 0:
            grad = grad.add(param, alpha=weight_decay)

        # Decay the first and second moment running average coefficient
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)

        # maximum length of the approximated SMA
        rho_inf = 2 / (1 - beta2) - 1

        if capturable and has_capturable_branch:
            bias_correction1 = 1 - beta1 ** step_t
            bias_correction2 = 1 - beta2 ** step_t
            # correcting bias for the first moving moment
            bias_corrected_exp_avg = exp_avg / bias_correction1
            # compute the length of the approximated SMA
            rho_t = rho_inf - 2 * step_t * (beta2 ** step_t) / bias_correction2

            def _compute_rect():
                return ((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) ** 0.5

            def _compute_adaptive_lr():
                exp_avg_sq_sqrt = exp_avg_sq.sqrt().add_(eps)
                return (bias_correction2 ** 0.5) / exp_avg_sq_sqrt

            # Compute the variance rectification term and update parameters accordingly
            update = torch.where(rho_t > 5.0, _compute_rect() * _compute_adaptive_lr(), 1.0)
            param.add_(bias_corrected_exp_avg * lr * update, alpha=-1.0)
        else:
            step = _get_value(step_t)
            bias_correction1 = 1 - beta1 ** step
            bias_correction2 = 1 - beta2 ** step
            # correcting bias for the first moving moment
            bias_corrected_exp_avg = exp_avg / bias_correction1
            # compute the length of the approximated SMA
            rho_t = rho_inf - 2 * step * (beta2 ** step) / bias_correction2
            if rho_t > 5.0:
                # Compute the variance rectification term and update parameters accordingly
                rect = math.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t))
                exp_avg_sq_sqrt = exp_avg_sq.sqrt().add_(eps)
                adaptive_lr = math.sqrt(bias_correction2) / exp_avg_sq_sqrt
                param.add_(bias_corrected_exp_avg * lr * adaptive_lr * rect, alpha=-1.0)
            else:
                param.add_(bias_corrected_exp_avg * lr, alpha=-1.0)


class RAdam:
    """``torch.optim.RAdam`` with ``foreach=False`` (the for-loop implementation)."""

    def __init__(self, params, lr=5e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, capturable=False,
                 variant="fix"):
        self.params = params
        self.defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, capturable=capturable)
        self.has_capturable_branch = variant == "fix"
        # capturable: the step counters live on the params' device
        self.state = [{"step": torch.zeros((), device=p.device) if capturable else torch.zeros(()),
                       "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)} for p in params]

    def step(self):
        d = self.defaults
        _single_tensor_radam(self.params, [p.grad for p in self.params], [s["exp_avg"] for s in self.state],
                             [s["exp_avg_sq"] for s in self.state], [s["step"] for s in self.state],
                             beta1=d["betas"][0], beta2=d["betas"][1], lr=d["lr"], weight_decay=d["weight_decay"],
                             eps=d["eps"], capturable=d["capturable"],
                             has_capturable_branch=self.has_capturable_branch)


def make_model(device):
    gen = generator(121260)
    w = randn(DIM, OUT, gen=gen, device=device, scale=0.5)
    w.grad = torch.zeros_like(w)                    # static .grad: zero_grad(set_to_none=False)
    return w


def train_step(w, opt, static_input, static_target):
    """Whole-network capture as in the CUDA-graphs docs: forward, backward (written out), optimizer step."""
    err = static_input @ w - static_target
    loss = (err * err).mean()
    w.grad.copy_(static_input.t() @ err * (2.0 / err.numel()))
    opt.step()
    return loss


def run(variant: str, device: str = "cpu"):
    gen = generator(11)
    batches = [(randn(BATCH, DIM, gen=gen, device=device), randn(BATCH, OUT, gen=gen, device=device))
               for _ in range(STEPS + 1)]

    def eager():
        w = make_model(device)
        opt = RAdam([w], capturable=True, variant=variant)
        losses = [train_step(w, opt, x, y).clone() for x, y in batches]
        return losses + [w.detach().clone()]

    def served():
        w = make_model(device)
        opt = RAdam([w], capturable=True, variant=variant)
        static_input, static_target = batches[0][0].clone(), batches[0][1].clone()
        state = {"w": w, "w.grad": w.grad}
        for i, s in enumerate(opt.state):
            state.update({f"exp_avg.{i}": s["exp_avg"], f"exp_avg_sq.{i}": s["exp_avg_sq"], f"step.{i}": s["step"]})
        # the warmup iteration trains on the first batch, as the docs' side-stream warmup does
        g, loss = capture(lambda: train_step(w, opt, static_input, static_target), device=device,
                          static={"static_input": static_input, "static_target": static_target}, state=state,
                          owner="whole-network capture (model + RAdam)")
        # the warmup already ran step 1 on batch 0 (its loss is that of the initial weights)
        err = batches[0][0] @ make_model(device) - batches[0][1]
        losses = [(err * err).mean()]
        for x, y in batches[1:]:
            static_input.copy_(x)
            static_target.copy_(y)
            losses.append(replay(g, loss).clone())
        return losses + [w.detach().clone()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
