"""Apex FusedAdam passes its step count to the kernel from the host: a captured step freezes the bias correction.

Upstream: https://github.com/NVIDIA/apex/pull/1560 ("Capturable Adam optimizer", commit ad68a2fd).
Symptom: whole-iteration CUDA-graph training (forward, backward and ``optimizer.step()`` captured once and
replayed) with ``apex.optimizers.FusedAdam`` silently trains with a frozen Adam step: every replay applies the
bias correction (and learning rate) of the captured iteration, so the parameters drift away from an eager run
of the same schedule (apex before Jan 2023; the draft #1522 and #1560 were written for graphed MLPerf runs).
Mechanism: ``FusedAdam.step`` keeps ``group['step']`` as a Python int, does ``group['step'] += 1`` on the
host, and hands ``lr`` (a Python float) and ``step`` to ``multi_tensor_adam``, whose host code computes
``bias_correction1 = 1 - beta1 ** step`` and ``bias_correction2 = 1 - beta2 ** step`` and launches the kernel
with those values by value. Inside a capture this host work runs once: the recorded kernel keeps the step of
the captured iteration, and replays repeat only the kernels, so the step never advances on replay.
Doctor: host-work-frozen, at ``step`` (the host ``group['step'] += 1`` and the host bias corrections given to
the captured Adam kernel).
Fix (upstream): ``FusedAdam(capturable=True)``: ``lr`` becomes a device tensor, ``group['step']`` a device
int tensor advanced in place (``group['step'] += (self._dummy_overflow_buf != 1).to(torch.int)``, a captured
kernel), and ``multi_tensor_adam_capturable`` computes the bias corrections on the device from it.
"""
from __future__ import annotations

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/apex/pull/1560"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "step"
SYMPTOM = "graphed training with FusedAdam keeps the captured iteration's Adam step (bias correction) forever"
DIM, BATCH, STEPS = 4, 6, 5


def multi_tensor_adam(overflow_buf, tensor_lists, lr, beta1, beta2, eps, step, mode, bias_correction,
                      weight_decay):
    """``amp_C.multi_tensor_adam``: host scalars (lr, step) become kernel arguments by value."""
    if bias_correction == 1:
        bias_correction1 = 1 - beta1 ** step           # computed on the host from the Python step
        bias_correction2 = 1 - beta2 ** step
    else:
        bias_correction1 = bias_correction2 = 1.0
    for g, p, m, v in zip(*tensor_lists):
        if mode == 0:                                  # ADAM_MODE_0: L2 regularisation
            g = g + weight_decay * p
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        update = (m / bias_correction1) / ((v / bias_correction2).sqrt() + eps)
        if mode == 1:                                  # ADAM_MODE_1: decoupled weight decay
            update = update + weight_decay * p
        p.sub_(lr * update)


def multi_tensor_adam_capturable(overflow_buf, tensor_lists, lr, beta1, beta2, eps, step, mode,
                                 bias_correction, weight_decay, inv_scale):
    """``amp_C.multi_tensor_adam_capturable``: lr and step are read from device memory by the kernel."""
    if bias_correction == 1:
        bias_correction1 = 1 - torch.pow(beta1, step.float())
        bias_correction2 = 1 - torch.pow(beta2, step.float())
    else:
        bias_correction1 = bias_correction2 = torch.ones_like(lr)
    for g, p, m, v in zip(*tensor_lists):
        g = g * inv_scale
        if mode == 0:
            g = g + weight_decay * p
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        update = (m / bias_correction1) / ((v / bias_correction2).sqrt() + eps)
        if mode == 1:
            update = update + weight_decay * p
        p.sub_(lr * update)


class FusedAdam(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 adam_w_mode=True, weight_decay=0., capturable=False):
        # If the optimizer is capturable then LR should be a tensor (on GPU)
        lr = torch.tensor(lr, dtype=torch.float32) if capturable else lr
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.capturable = capturable
        device = self.param_groups[0]['params'][0].device
        if capturable:
            for idx, group in enumerate(self.param_groups):
                self.param_groups[idx]['lr'] = group['lr'].to(device=device)
        self._dummy_overflow_buf = torch.zeros(1, dtype=torch.int, device=device)

    def step(self, closure=None):
        for group in self.param_groups:
            device = group['params'][0].device
            bias_correction = 1 if group['bias_correction'] else 0
            beta1, beta2 = group['betas']
            # assume same step across group now to simplify things
            if 'step' in group:
                group['step'] += 1 if not self.capturable else (self._dummy_overflow_buf != 1).to(torch.int)
            else:
                group['step'] = 1 if not self.capturable else torch.tensor([1], dtype=torch.int, device=device)

            g_32, p_32, m_32, v_32 = [], [], [], []
            for p in group['params']:
                state = self.state[p]
                if len(state) == 0:
                    state['exp_avg'] = torch.zeros_like(p)
                    state['exp_avg_sq'] = torch.zeros_like(p)
                g_32.append(p.grad)
                p_32.append(p)
                m_32.append(state['exp_avg'])
                v_32.append(state['exp_avg_sq'])

            if self.capturable:
                found_inf = torch.zeros((1,), device=device)
                self._dummy_overflow_buf.copy_(found_inf)
                inv_scale = torch.ones((1,), device=device)
                multi_tensor_adam_capturable(self._dummy_overflow_buf, [g_32, p_32, m_32, v_32], group['lr'],
                                             beta1, beta2, group['eps'], group['step'], self.adam_w_mode,
                                             bias_correction, group['weight_decay'], inv_scale)
            else:
                multi_tensor_adam(self._dummy_overflow_buf, [g_32, p_32, m_32, v_32], group['lr'], beta1, beta2,
                                  group['eps'], group['step'], self.adam_w_mode, bias_correction,
                                  group['weight_decay'])


def train_step(weight, optimizer, static_x, static_y):
    """Forward, backward (a linear least-squares model, gradient written in place) and the optimizer step."""
    err = static_x @ weight - static_y
    loss = (err * err).mean()
    weight.grad.copy_(static_x.t() @ err * (2.0 / err.numel()))
    optimizer.step()
    return loss


def run(variant: str, device: str = "cpu"):
    gen = generator(1560)
    w0 = randn(DIM, 1, gen=gen, device=device)
    w_true = randn(DIM, 1, gen=gen, device=device)
    xs = [randn(BATCH, DIM, gen=gen, device=device) for _ in range(STEPS)]
    ys = [x @ w_true for x in xs]
    capturable = variant == "fix"

    def make():
        weight = w0.clone()
        weight.grad = torch.zeros_like(weight)
        return weight, FusedAdam([weight], lr=0.1, betas=(0.5, 0.9), capturable=capturable)

    def eager():
        weight, optimizer = make()
        losses = [train_step(weight, optimizer, x, y) for x, y in zip(xs, ys)]
        return losses + [weight]

    def served():
        weight, optimizer = make()
        static_x, static_y = xs[0].clone(), ys[0].clone()
        fn = lambda: train_step(weight, optimizer, static_x, static_y)  # noqa: E731
        # the side-stream warmup iteration is a real training step (it also creates the Adam state)
        with events.warmup(real=True):
            losses = [fn().clone()]
        state = optimizer.state[weight]
        g, out = capture(fn, device=device, warmups=0, static={"static_x": static_x, "static_y": static_y},
                         state={"weight": weight, "grad": weight.grad, "exp_avg": state['exp_avg'],
                                "exp_avg_sq": state['exp_avg_sq']}, owner="graphed training iteration")
        for x, y in zip(xs[1:], ys[1:]):
            static_x.copy_(x)
            static_y.copy_(y)
            losses.append(replay(g, out).clone())
        return losses + [weight]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
