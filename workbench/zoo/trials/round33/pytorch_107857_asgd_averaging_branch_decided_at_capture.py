"""A graphed ASGD step keeps the averaging branch its capture took: the averaged model never starts averaging.

Upstream: https://github.com/pytorch/pytorch/pull/107857 ("Add capturable ASGD impl", Aug 2023; part of the
capturable-optimizer work tracked in pytorch#118018, follow-up fixes in pytorch#118326).
Symptom: ``torch.optim.ASGD`` could not be captured correctly in a CUDA graph (whole-iteration graphs,
``torch.compile`` with cudagraphs): its step count, ``eta`` and ``mu`` lived in CPU tensors and were read on the
host, so a captured ``step()`` replays the decisions of the captured iteration. The visible damage is in
``state['ax']``, the averaged parameters ASGD exists to produce: after ``t0`` steps eager ASGD starts averaging,
a graphed one keeps copying the current parameters. (Reported as the motivation of the PR, not as a user issue.)
Mechanism: before the fix ``ASGD._init_group`` created ``state['step'] = torch.tensor(0.0)``,
``state['eta'] = torch.tensor(lr)`` and ``state['mu'] = torch.tensor(1.0)`` (CPU tensors), and
``_single_tensor_asgd`` did ``step_t += 1; step = _get_value(step_t)`` on the host, then
``if is_compiling() or mu.item() != 1: ax.add_(param.sub(ax).mul(mu)) else: ax.copy_(param)`` and refreshed
``eta``/``mu`` with host math (``_to_tensor(1 / max(1, step - t0))``). Under capture the host work runs once:
the branch is decided by the ``mu`` of the captured iteration (1 while ``step <= t0 + 1``), so the graph records
``ax.copy_(param)``; replays never re-evaluate ``mu.item() != 1`` (and never advance the CPU step, so ``mu``
itself also stays 1), while eager switches to ``ax += mu * (param - ax)`` once ``step > t0 + 1``.
(Here ``lambd=0`` so that ``eta`` is constant and the frozen ``eta_value`` changes nothing: only the
branch differs.)
Doctor: warmup-divergence, at ``_single_tensor_asgd`` (the ``mu.item() != 1`` branch decided at capture).
Fix (upstream): ``ASGD(capturable=True)``: ``step``, ``eta`` and ``mu`` are created on the parameter's device,
the capturable path always takes ``ax.add_(param.sub(ax).mul_(mu))`` (``capturable or mu.item() != 1``) and
updates ``eta``/``mu`` with device ops
(``mu.copy_(1 / torch.maximum(step_t - t0, torch.ones_like(step_t)))``), so every replay recomputes them.
Read: the pre-fix ``asgd.py`` (torch 2.0/2.1, from the code index), the PR's review diff excerpt, and the
post-fix ``_single_tensor_asgd`` in the installed torch; not the PR's full diff.
"""
from __future__ import annotations

import torch

from workbench.engine import events, host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/pytorch/pull/107857"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "_single_tensor_asgd"
SYMPTOM = "graphed ASGD keeps copying params into ax after t0: the averaged model never averages"

DIM, BATCH, STEPS = 4, 6, 7
LR, LAMBD, ALPHA, T0 = 0.05, 0.0, 0.75, 2.0


def _get_value(x):
    return x.item() if isinstance(x, torch.Tensor) else x


def _single_tensor_asgd(params, grads, axs, mus, etas, state_steps, *, lambd, lr, t0, alpha, weight_decay,
                        capturable, device):
    def _to_tensor(x):                           # pre-fix: ``torch.tensor(x)``, a CPU tensor
        return host(torch.tensor(float(x)), device)

    for i, param in enumerate(params):
        grad, mu, ax, eta, step_t = grads[i], mus[i], axs[i], etas[i], state_steps[i]
        # update step
        step_t += 1
        if weight_decay != 0:
            grad = grad.add(param, alpha=weight_decay)
        if capturable:
            param.mul_(1 - lambd * eta)
            param.addcmul_(grad, eta, value=-1)  # update parameter
        else:
            eta_value = _get_value(eta)
            param.mul_(1 - lambd * eta_value)    # decay term
            param.add_(grad, alpha=-eta_value)   # update parameter
        # averaging
        if capturable or mu.item() != 1:
            ax.add_(param.sub(ax).mul(mu))
        else:
            ax.copy_(param)
        if capturable:
            eta.copy_(lr / ((1 + lambd * lr * step_t) ** alpha))
            mu.copy_(1 / torch.maximum(step_t - t0, torch.ones_like(step_t)))
        else:
            step = _get_value(step_t)
            eta.copy_(_to_tensor(lr / ((1 + lambd * lr * step) ** alpha)))
            mu.copy_(_to_tensor(1 / max(1, step - t0)))


class ASGD(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-2, lambd=1e-4, alpha=0.75, t0=1e6, weight_decay=0.0, capturable=False):
        defaults = dict(lr=lr, lambd=lambd, alpha=alpha, t0=t0, weight_decay=weight_decay, capturable=capturable)
        super().__init__(params, defaults)

    def _init_group(self, group, params_with_grad, grads, mus, axs, etas, state_steps):
        for p in group["params"]:
            if p.grad is None:
                continue
            params_with_grad.append(p)
            grads.append(p.grad)
            state = self.state[p]
            if len(state) == 0:
                if group["capturable"]:          # the fix: scalar state on the parameter's device
                    state["step"] = torch.zeros((), device=p.device)
                    state["eta"] = torch.full((), group["lr"], device=p.device)
                    state["mu"] = torch.ones((), device=p.device)
                else:                            # before: torch.tensor(0.0), torch.tensor(lr), torch.tensor(1.0)
                    state["step"] = host(torch.tensor(0.0), p.device.type)
                    state["eta"] = host(torch.tensor(float(group["lr"])), p.device.type)
                    state["mu"] = host(torch.tensor(1.0), p.device.type)
                state["ax"] = torch.zeros_like(p)
            mus.append(state["mu"])
            axs.append(state["ax"])
            etas.append(state["eta"])
            state_steps.append(state["step"])

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params_with_grad, grads, mus, axs, etas, state_steps = [], [], [], [], [], []
            self._init_group(group, params_with_grad, grads, mus, axs, etas, state_steps)
            _single_tensor_asgd(params_with_grad, grads, axs, mus, etas, state_steps, lambd=group["lambd"],
                                lr=group["lr"], t0=group["t0"], alpha=group["alpha"],
                                weight_decay=group["weight_decay"], capturable=group["capturable"],
                                device=params_with_grad[0].device.type)


def train_step(weight, optimizer, static_x, static_y):
    """Forward, backward (least squares, gradient written in place) and the ASGD step."""
    err = static_x @ weight - static_y
    loss = (err * err).mean()
    weight.grad.copy_(static_x.t() @ err * (2.0 / err.numel()))
    optimizer.step()
    return loss


def run(variant: str, device: str = "cpu"):
    gen = generator(107857)
    w0 = randn(DIM, 1, gen=gen, device=device)
    w_true = randn(DIM, 1, gen=gen, device=device)
    xs = [randn(BATCH, DIM, gen=gen, device=device) for _ in range(STEPS)]
    ys = [x @ w_true for x in xs]
    capturable = variant == "fix"

    def make():
        weight = w0.clone()
        weight.grad = torch.zeros_like(weight)
        return weight, ASGD([weight], lr=LR, lambd=LAMBD, alpha=ALPHA, t0=T0, capturable=capturable)

    def eager():
        weight, optimizer = make()
        losses = [train_step(weight, optimizer, x, y) for x, y in zip(xs, ys)]
        return losses + [weight, optimizer.state[weight]["ax"]]

    def served():
        weight, optimizer = make()
        static_x, static_y = xs[0].clone(), ys[0].clone()
        fn = lambda: train_step(weight, optimizer, static_x, static_y)  # noqa: E731
        # the warmup iteration is a real training step (it also creates the ASGD state)
        with events.warmup(real=True):
            losses = [fn().clone()]
        state = optimizer.state[weight]
        persistent = {"weight": weight, "grad": weight.grad, "ax": state["ax"]}
        if capturable:
            persistent.update(step=state["step"], eta=state["eta"], mu=state["mu"])
        g, out = capture(fn, device=device, warmups=0, static={"static_x": static_x, "static_y": static_y},
                         state=persistent, owner="graphed ASGD training iteration")
        for x, y in zip(xs[1:], ys[1:]):
            static_x.copy_(x)
            static_y.copy_(y)
            losses.append(replay(g, out).clone())
        return losses + [weight, state["ax"]]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
