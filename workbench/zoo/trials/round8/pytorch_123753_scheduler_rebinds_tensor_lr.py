"""The LR scheduler rebinds ``param_group["lr"]``: a captured capturable optimizer step keeps the old LR tensor.

Upstream: https://github.com/pytorch/pytorch/pull/123753 ("Update LRScheduler to handle tensor LR";
motivation in pytorch/pytorch#106802, "Optimizers should use learning rates passed as tensors
directly ... then you could adjust learning rate every step while using CUDA graphs").
Symptom: a training step captured whole (forward, backward, ``optimizer.step()`` with
``capturable=True`` and ``lr=torch.tensor(...)``) ignores the LR schedule: every replay trains at the
learning rate of capture time, while the same loop run eagerly decays it (PyTorch 2.3).
Mechanism: the capturable Adam reads the learning rate as a device tensor, so the captured step
records kernels that read that tensor's memory. ``LRScheduler.step`` wrote each new rate with
``param_group["lr"] = lr``: it rebinds the dict entry to a new Python float and never touches the
tensor the graph reads. Eager steps read the new value from the dict; replays keep reading the old
tensor, so the decayed rates never reach the graphed optimizer.
Doctor: warmup-divergence, at ``step`` (the scheduler's rebinding of ``param_group["lr"]``).
Fix (upstream): when ``param_group["lr"]`` is a Tensor, update it in place
(``param_group["lr"].fill_(lr)``), so the tensor the graph captured carries every new rate.
"""
from __future__ import annotations

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/pytorch/pull/123753"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "step"
SYMPTOM = "graphed training ignores the LR schedule: replays keep the capture-time learning rate"
ROWS, DIM, ITERS = 8, 4, 6
BETA1, BETA2, EPS = 0.9, 0.999, 1e-8


class CapturableAdam:
    """``torch.optim.Adam(capturable=True)``: step counts and the LR math stay on the device."""

    def __init__(self, params, lr):
        self.param_groups = [{"params": params, "lr": lr}]
        self.state = {}

    def step(self, grads):
        group = self.param_groups[0]
        for p, g in zip(group["params"], grads):
            if id(p) not in self.state:                       # _init_group (lazy, at the first step)
                self.state[id(p)] = {"step": torch.zeros((), device=p.device),
                                     "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
            st = self.state[id(p)]
            _single_tensor_adam(p, g, st["exp_avg"], st["exp_avg_sq"], st["step"], group["lr"])


def _single_tensor_adam(param, grad, exp_avg, exp_avg_sq, step_t, lr):
    step_t += 1
    exp_avg.lerp_(grad, 1 - BETA1)
    exp_avg_sq.mul_(BETA2).addcmul_(grad, grad, value=1 - BETA2)
    bias_correction1 = 1 - torch.pow(BETA1, step_t)
    bias_correction2 = 1 - torch.pow(BETA2, step_t)
    step_size = lr / bias_correction1                         # lr: a tensor (read by address) or a float
    step_size_neg = step_size.neg()
    denom = (exp_avg_sq.sqrt() / (bias_correction2.sqrt() * step_size_neg)).add_(EPS / step_size_neg)
    param.addcdiv_(exp_avg, denom)


class StepLR:
    """``torch.optim.lr_scheduler.StepLR``: decays the rate by ``gamma`` every ``step_size`` epochs."""

    def __init__(self, optimizer, step_size, gamma, fixed: bool):
        self.optimizer, self.step_size, self.gamma, self.fixed = optimizer, step_size, gamma, fixed
        self.base_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        self.last_epoch = 0

    def get_lr(self):
        return [base * self.gamma ** (self.last_epoch // self.step_size) for base in self.base_lrs]

    def step(self):
        self.last_epoch += 1
        for param_group, lr in zip(self.optimizer.param_groups, self.get_lr()):
            if self.fixed and isinstance(param_group["lr"], torch.Tensor):
                param_group["lr"].fill_(lr)
            else:
                param_group["lr"] = lr                        # rebinds: a captured step never sees it


def train_step(w, x, y, opt):
    """Forward, backward (a linear regression's gradient, written out) and the optimizer step."""
    err = x @ w - y
    loss = (err * err).mean()
    grad = x.t() @ err * (2.0 / err.numel())
    opt.step([grad])
    return loss


def run(variant: str, device: str = "cpu"):
    gen = generator(123753)
    w0 = randn(DIM, 1, gen=gen, device=device)
    batches = [(randn(ROWS, DIM, gen=gen, device=device), randn(ROWS, 1, gen=gen, device=device))
               for _ in range(ITERS)]

    def setup():
        w = w0.clone()
        lr = torch.tensor(0.1, device=device)            # the script keeps its LR tensor (logging, checkpoints)
        opt = CapturableAdam([w], lr=lr)
        return w, opt, StepLR(opt, step_size=2, gamma=0.3, fixed=(variant == "fix")), lr

    def eager():
        w, opt, sched, lr = setup()
        losses = []
        for x, y in batches:
            losses.append(train_step(w, x, y, opt))
            sched.step()
        return losses[1:] + [w.clone()]

    def served():
        w, opt, sched, lr = setup()
        x_buf, y_buf = batches[0][0].clone(), batches[0][1].clone()
        # whole-network capture: the warmup iteration is the first real step (batch 0), then capture
        g, loss = capture(lambda: train_step(w, x_buf, y_buf, opt), device=device,
                          static={"x": x_buf, "y": y_buf}, owner="training loop")
        st = opt.state[id(w)]
        events.persistent_state("training loop", {"param": w, "exp_avg": st["exp_avg"],
                                                  "exp_avg_sq": st["exp_avg_sq"], "step": st["step"]})
        sched.step()
        losses = []
        for x, y in batches[1:]:
            x_buf.copy_(x)
            y_buf.copy_(y)
            losses.append(replay(g, loss).clone())
            sched.step()
        return losses + [w.clone()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
