"""Fused Adam takes a Tensor learning rate through a float argument: ``.item()`` inside a captured step.

Upstream: https://github.com/pytorch/pytorch/pull/106916 ("[optim] FusedAdam/W accepts lr: Tensor without
h2ds"; fixes pytorch/pytorch#106802, "Optimizers should use learning rates passed as tensors directly").
Symptom: passing ``lr=torch.tensor(...)`` to ``torch.optim.Adam(fused=True)`` "works, but internally it
does an item() on every step, which breaks graph capture" (#106802, PyTorch 2.0, August 2023): a training
step captured whole (forward, backward, ``optimizer.step()``) fails at capture, so users could not keep a
device-side LR that a schedule updates in place between replays.
Mechanism: ``_fused_adam`` hands ``lr`` to ``torch._fused_adam_``, whose schema takes ``float lr``. For a
0-dim Tensor the argument parser converts it with ``Tensor.item()``: a device-to-host copy and a stream
synchronisation, harmless eagerly and illegal while the step is being captured.
Doctor: sync-in-capture, at ``_fused_adam`` (the Tensor ``lr`` passed to the float-``lr`` kernel, i.e. an
``item()`` of device memory during capture).
Fix (upstream): add the ``_fused_adam_.tensor_lr`` / ``_fused_adamw_.tensor_lr`` overloads, which read
``lr`` on the device inside the kernel, and route a Tensor ``lr`` to them (a float ``lr`` keeps the old
overload), so no host round-trip is left in ``step()``.
"""
from __future__ import annotations

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/pytorch/pull/106916"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "_fused_adam"
SYMPTOM = "capturing a step of Adam(fused=True, lr=Tensor) fails: the float-lr kernel argument calls item()"
ROWS, DIM, ITERS = 8, 4, 6
BETA1, BETA2, EPS = 0.9, 0.999, 1e-8


def _fused_adam_kernel(params, grads, exp_avgs, exp_avg_sqs, state_steps, *, lr, beta1, beta2, eps):
    """One multi-tensor launch of the fused Adam kernel: ``lr`` is a float (launch argument) or, with the
    ``tensor_lr`` overload, a device tensor the kernel reads."""
    for param, grad, exp_avg, exp_avg_sq, step_t in zip(params, grads, exp_avgs, exp_avg_sqs, state_steps):
        step_t += 1                                         # fused: the step count lives on the device
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - torch.pow(beta1, step_t)
        bias_correction2 = 1 - torch.pow(beta2, step_t)
        step_size = lr / bias_correction1
        denom = exp_avg_sq.sqrt() / bias_correction2.sqrt() + eps
        param.sub_(step_size * exp_avg / denom)


def _fused_adam_(params, grads, exp_avgs, exp_avg_sqs, state_steps, *, lr: float, beta1, beta2, eps):
    """``torch._fused_adam_`` (schema ``float lr``): the argument parser turns a 0-dim Tensor into a
    Python number with ``Tensor.item()``."""
    lr = float(lr)
    _fused_adam_kernel(params, grads, exp_avgs, exp_avg_sqs, state_steps, lr=lr, beta1=beta1, beta2=beta2, eps=eps)


def _fused_adam_tensor_lr(params, grads, exp_avgs, exp_avg_sqs, state_steps, *, lr: torch.Tensor, beta1,
                          beta2, eps):
    """``torch._fused_adam_.tensor_lr`` (added by the fix): ``lr`` stays on the device."""
    _fused_adam_kernel(params, grads, exp_avgs, exp_avg_sqs, state_steps, lr=lr, beta1=beta1, beta2=beta2, eps=eps)


def _fused_adam(params, grads, exp_avgs, exp_avg_sqs, state_steps, *, lr, beta1, beta2, eps, variant):
    if variant == "fix" and isinstance(lr, torch.Tensor):
        _fused_adam_tensor_lr(params, grads, exp_avgs, exp_avg_sqs, state_steps, lr=lr, beta1=beta1, beta2=beta2,
                              eps=eps)
    else:
        _fused_adam_(params, grads, exp_avgs, exp_avg_sqs, state_steps, lr=lr, beta1=beta1, beta2=beta2, eps=eps)


class Adam:
    """``torch.optim.Adam(params, lr=Tensor, fused=True)``: state created lazily at the first step."""

    def __init__(self, params, lr, variant):
        self.param_groups = [{"params": params, "lr": lr}]
        self.state = {}
        self.variant = variant

    def step(self, grads):
        group = self.param_groups[0]
        for p in group["params"]:
            if id(p) not in self.state:                        # _init_group
                self.state[id(p)] = {"step": torch.zeros((), device=p.device),
                                     "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        states = [self.state[id(p)] for p in group["params"]]
        _fused_adam(group["params"], grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                    [s["step"] for s in states], lr=group["lr"], beta1=BETA1, beta2=BETA2, eps=EPS,
                    variant=self.variant)


def train_step(w, x, y, opt):
    """Forward, backward (a linear regression's gradient, written out) and the optimizer step."""
    err = x @ w - y
    loss = (err * err).mean()
    grad = x.t() @ err * (2.0 / err.numel())
    opt.step([grad])
    return loss


def lr_at(it):
    """The schedule the script applies in place to its LR tensor (a warmup then a decay)."""
    return 0.05 * min(1.0, (it + 1) / 3) * 0.8 ** max(0, it - 2)


def run(variant: str, device: str = "cpu"):
    gen = generator(106916)
    w0 = randn(DIM, 1, gen=gen, device=device)
    batches = [(randn(ROWS, DIM, gen=gen, device=device), randn(ROWS, 1, gen=gen, device=device))
               for _ in range(ITERS)]

    def setup():
        w = w0.clone()
        lr = torch.tensor(lr_at(0), device=device)              # a device LR the schedule updates in place
        return w, Adam([w], lr=lr, variant=variant), lr

    def eager():
        w, opt, lr = setup()
        losses = []
        for it, (x, y) in enumerate(batches):
            lr.fill_(lr_at(it))
            losses.append(train_step(w, x, y, opt))
        return losses[1:] + [w.clone()]

    def served():
        w, opt, lr = setup()
        x_buf, y_buf = batches[0][0].clone(), batches[0][1].clone()
        # whole-step capture: the warmup iteration is the first real step (batch 0), then capture
        g, loss = capture(lambda: train_step(w, x_buf, y_buf, opt), device=device,
                          static={"x": x_buf, "y": y_buf, "lr": lr}, owner="training loop")
        st = opt.state[id(w)]
        events.persistent_state("training loop", {"param": w, "exp_avg": st["exp_avg"],
                                                  "exp_avg_sq": st["exp_avg_sq"], "step": st["step"]})
        losses = []
        for it in range(1, ITERS):
            x_buf.copy_(batches[it][0])
            y_buf.copy_(batches[it][1])
            lr.fill_(lr_at(it))
            losses.append(replay(g, loss).clone())
        return losses + [w.clone()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
