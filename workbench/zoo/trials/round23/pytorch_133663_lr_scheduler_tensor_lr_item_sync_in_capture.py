"""LRScheduler.step() reads a device tensor learning rate back with ``.item()``: a captured training step cannot.

Upstream: https://github.com/pytorch/pytorch/pull/133663 ("Avoid Host & Device Sync In LR Scheduler", fixes
https://github.com/pytorch/pytorch/issues/133662).
Symptom: the PR (Aug 2024, PyTorch 2.4 code) removes a host/device synchronisation that every
``scheduler.step()`` made when the optimizer's ``lr`` is a CUDA tensor. In whole-iteration CUDA-graph training
(forward, backward, ``optimizer.step()`` and ``scheduler.step()`` captured once and replayed, the use a tensor
``lr`` with a capturable optimizer exists for) that sync makes the capture fail: "CUDA error: operation not
permitted when stream is capturing" at the scheduler step.
Mechanism: ``LRScheduler.step`` computes ``values = self.get_lr()``; for a tensor ``group["lr"]``,
``ExponentialLR.get_lr`` returns ``group["lr"] * self.gamma``, a 0-dim tensor on the parameters' device. The
update loop then wrote it with ``lr_val = lr.item() if isinstance(lr, Tensor) else lr`` followed by
``param_group["lr"].fill_(lr_val)``: the ``.item()`` copies the new learning rate to the host and waits for
the device, which a capturing stream refuses (the capture is invalidated and the graphed training loop
cannot start).
Doctor: sync-in-capture, at ``step`` (``LRScheduler.step``: ``lr.item()`` on the device learning rate inside
the captured iteration).
Fix (upstream): ``param_group["lr"].fill_(lr)`` (the diff first used ``copy_(lr)``; the review kept
``fill_``): a device-side fill from the 0-dim tensor, so the scheduler's multiply and the write are kernels
the graph records, and every replay decays the learning rate in place exactly as an eager step does.
"""
from __future__ import annotations

import torch
from torch import Tensor

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/pytorch/pull/133663"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "step"
SYMPTOM = "capturing the training iteration fails at scheduler.step(): lr.item() on the CUDA learning rate"
DIM, BATCH, STEPS = 4, 6, 5
LR, GAMMA = 0.05, 0.8


class Adam(torch.optim.Optimizer):
    """``torch.optim.Adam(capturable=True)`` with a tensor ``lr``, single-tensor path: the step counter, the
    bias corrections and the learning rate all stay on the device."""

    def __init__(self, params, lr: Tensor, betas=(0.9, 0.999), eps=1e-8):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))

    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps = group["lr"], group["eps"]
            for param in group["params"]:
                state = self.state[param]
                if len(state) == 0:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)
                grad, step_t = param.grad, state["step"]
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                step_t += 1
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                # capturable: bias corrections computed on the device from the step tensor
                bias_correction1 = 1 - torch.pow(beta1, step_t)
                bias_correction2 = 1 - torch.pow(beta2, step_t)
                step_size = lr / bias_correction1
                step_size_neg = step_size.neg()
                bias_correction2_sqrt = bias_correction2.sqrt()
                denom = (exp_avg_sq.sqrt() / (bias_correction2_sqrt * step_size_neg)).add_(eps / step_size_neg)
                param.addcdiv_(exp_avg, denom)


class LRScheduler:
    def __init__(self, optimizer, variant: str, last_epoch: int = -1):
        self.optimizer, self.variant = optimizer, variant
        for group in optimizer.param_groups:
            initial_lr = group["lr"]
            if isinstance(initial_lr, Tensor):
                initial_lr = initial_lr.clone()
            group.setdefault("initial_lr", initial_lr)
        self.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
        self.last_epoch = last_epoch
        self._initial_step()

    def _initial_step(self):
        self._step_count = 0
        self.step()

    def get_lr(self):
        raise NotImplementedError

    def step(self, epoch=None):
        self._step_count += 1
        self.last_epoch += 1
        values = self.get_lr()
        for param_group, lr in zip(self.optimizer.param_groups, values):
            if isinstance(param_group["lr"], Tensor):
                if self.variant == "bug":
                    lr_val = lr.item() if isinstance(lr, Tensor) else lr  # device -> host, then a host fill
                    param_group["lr"].fill_(lr_val)
                else:
                    param_group["lr"].fill_(lr)                            # stays on the device
            else:
                param_group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]


class ExponentialLR(LRScheduler):
    def __init__(self, optimizer, gamma: float, variant: str, last_epoch: int = -1):
        self.gamma = gamma
        super().__init__(optimizer, variant, last_epoch)

    def get_lr(self):
        if self.last_epoch == 0:
            return [group["lr"] for group in self.optimizer.param_groups]
        return [group["lr"] * self.gamma for group in self.optimizer.param_groups]


def train_step(weight, optimizer, scheduler, static_x, static_y):
    """Forward, backward (least squares, gradient written in place), optimizer step, scheduler step."""
    err = static_x @ weight - static_y
    loss = (err * err).mean()
    weight.grad.copy_(static_x.t() @ err * (2.0 / err.numel()))
    optimizer.step()
    scheduler.step()
    return loss


def run(variant: str, device: str = "cpu"):
    gen = generator(133663)
    w0 = randn(DIM, 1, gen=gen, device=device)
    w_true = randn(DIM, 1, gen=gen, device=device)
    xs = [randn(BATCH, DIM, gen=gen, device=device) for _ in range(STEPS)]
    ys = [x @ w_true for x in xs]

    def make():
        weight = w0.clone()
        weight.grad = torch.zeros_like(weight)
        optimizer = Adam([weight], lr=torch.tensor(LR, device=device), betas=(0.5, 0.9))
        return weight, optimizer, ExponentialLR(optimizer, gamma=GAMMA, variant=variant)

    def eager():
        weight, optimizer, scheduler = make()
        losses = [train_step(weight, optimizer, scheduler, x, y) for x, y in zip(xs, ys)]
        return losses + [weight, optimizer.param_groups[0]["lr"].clone()]

    def served():
        weight, optimizer, scheduler = make()
        static_x, static_y = xs[0].clone(), ys[0].clone()
        fn = lambda: train_step(weight, optimizer, scheduler, static_x, static_y)  # noqa: E731
        # the side-stream warmup iteration is a real training step (it also creates the Adam state)
        with events.warmup(real=True):
            losses = [fn().clone()]
        state = optimizer.state[weight]
        g, out = capture(fn, device=device, warmups=0, static={"static_x": static_x, "static_y": static_y},
                         state={"weight": weight, "grad": weight.grad, "step": state["step"],
                                "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"],
                                "lr": optimizer.param_groups[0]["lr"]},
                         owner="graphed training iteration")
        for x, y in zip(xs[1:], ys[1:]):
            static_x.copy_(x)
            static_y.copy_(y)
            losses.append(replay(g, out).clone())
        return losses + [weight, optimizer.param_groups[0]["lr"].clone()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
