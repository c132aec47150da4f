"""Captured non-capturable NAdam step replays the step count and ``mu_product`` read on the host at capture.

Upstream: https://github.com/pytorch/pytorch/pull/106247 ("Add capturable NAdam implementation", Jul/Aug 2023;
the capturable path was then exposed to users in #106615).
Read: the PR description and the review-thread diff of ``torch/optim/nadam.py`` (``_multi_tensor_nadam``: the
``step_size_grads`` / ``step_size_expavg`` lists built from ``_get_value(mu_product)`` are replaced, under
``capturable``, by device-tensor arithmetic); not the tests. The ``mus`` / ``bias_correction`` lines are modelled
on ``nadam.py`` of that time.
Symptom: a training step containing ``NAdam.step()`` captured in a CUDA graph (cudagraphs / reduce-overhead)
trains differently from eager: every replay applies the update size of the captured step.
Mechanism: without ``capturable`` NAdam keeps ``state['step']`` and ``state['mu_product']`` as CPU tensors and
computes ``bias_correction2``, ``mu``, ``mu_next`` and the step sizes as Python floats (``_get_value`` =
``.item()``) on the host; ``torch._foreach_add_(state_steps, 1)`` and ``mu_product *= mu`` are host ops too. In
a capture they run once: the graph records only the device kernels (``lerp``/``addcmul``/``addcdiv``) with the
capture-time scalars baked in, and replays neither advance ``step`` nor ``mu_product``.
Doctor: host-work-frozen, at ``_multi_tensor_nadam`` (host step count, ``mu_product`` and step sizes computed
once at capture).
Fix (upstream): a ``capturable`` branch keeps ``step`` and ``mu_product`` on the parameters' device and computes
``mus``, ``mu_nexts``, bias corrections and step sizes with device tensor ops, so every replay recomputes them.
"""
from __future__ import annotations

import math

import torch

from workbench.engine import host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/pytorch/pull/106247"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "_multi_tensor_nadam"
SYMPTOM = "captured NAdam step: every replay uses the capture-time step count and mu_product (wrong updates)"
DIM, STEPS = 4, 6
LR, BETA1, BETA2, EPS, MOMENTUM_DECAY = 0.05, 0.9, 0.999, 1e-8, 4e-3


def _get_value(x):
    return x.item() if isinstance(x, torch.Tensor) else x


def _multi_tensor_nadam(params, grads, exp_avgs, exp_avg_sqs, mu_products, state_steps, *, capturable):
    for step_t in state_steps:                                  # torch._foreach_add_(state_steps, 1)
        step_t.add_(1)
    for exp_avg, exp_avg_sq, grad in zip(exp_avgs, exp_avg_sqs, grads):
        exp_avg.lerp_(grad, 1 - BETA1)
        exp_avg_sq.mul_(BETA2).addcmul_(grad, grad, value=1 - BETA2)
    if capturable:
        for param, grad, exp_avg, exp_avg_sq, mu_product, step in zip(
                params, grads, exp_avgs, exp_avg_sqs, mu_products, state_steps):
            mu = BETA1 * (1.0 - 0.5 * torch.pow(0.96, step * MOMENTUM_DECAY))
            mu_next = BETA1 * (1.0 - 0.5 * torch.pow(0.96, (step + 1) * MOMENTUM_DECAY))
            mu_product.mul_(mu)
            denom = (exp_avg_sq / (1 - torch.pow(BETA2, step))).sqrt().add_(EPS)
            step_size_grads = -LR * (1.0 - mu) / (1.0 - mu_product)
            step_size_expavg = -LR * mu_next / (1.0 - mu_product * mu_next)
            param.add_(grad * step_size_grads / denom)
            param.add_(exp_avg * step_size_expavg / denom)
        return
    bias_correction_sqrt = [math.sqrt(1 - BETA2 ** _get_value(step)) for step in state_steps]
    mus = [BETA1 * (1.0 - 0.5 * (0.96 ** (_get_value(step) * MOMENTUM_DECAY))) for step in state_steps]
    mu_nexts = [BETA1 * (1.0 - 0.5 * (0.96 ** ((_get_value(step) + 1) * MOMENTUM_DECAY))) for step in state_steps]
    for mu_product, mu in zip(mu_products, mus):                # torch._foreach_mul_(mu_products, mus)
        mu_product.mul_(mu)
    step_size_grads = [(LR * (1.0 - mu) / (1.0 - _get_value(mu_product))) * -1
                       for mu_product, mu in zip(mu_products, mus)]
    step_size_expavg = [(LR * mu_next / (1.0 - _get_value(mu_product) * mu_next)) * -1
                        for mu_product, mu_next in zip(mu_products, mu_nexts)]
    for param, grad, exp_avg, exp_avg_sq, bc, sg, se in zip(
            params, grads, exp_avgs, exp_avg_sqs, bias_correction_sqrt, step_size_grads, step_size_expavg):
        denom = (exp_avg_sq.sqrt() / bc).add_(EPS)
        param.addcdiv_(grad, denom, value=sg)
        param.addcdiv_(exp_avg, denom, value=se)


class NAdam:
    def __init__(self, params, device, capturable):
        self.params, self.capturable = params, capturable
        self.state = []
        for p in params:
            # _init_group: step / mu_product on the param's device only when capturable
            if capturable:
                step, mu_product = torch.zeros((), device=device), torch.ones((), device=device)
            else:
                step, mu_product = host(torch.zeros(()), device), host(torch.ones(()), device)
            self.state.append({"step": step, "mu_product": mu_product,
                               "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)})

    def step(self):
        s = self.state
        _multi_tensor_nadam(self.params, [p.grad for p in self.params], [x["exp_avg"] for x in s],
                            [x["exp_avg_sq"] for x in s], [x["mu_product"] for x in s], [x["step"] for x in s],
                            capturable=self.capturable)


def run(variant: str, device: str = "cpu"):
    gen = generator(106247)
    w0 = [randn(DIM, DIM, gen=gen, device=device), randn(DIM, gen=gen, device=device)]
    grads = [[randn(DIM, DIM, gen=gen, device=device), randn(DIM, gen=gen, device=device)] for _ in range(STEPS)]

    def workload(graphed: bool):
        params = [w.clone() for w in w0]
        for p in params:
            p.grad = torch.zeros_like(p)              # static .grad buffers the backward writes into
        opt = NAdam(params, device, capturable=(variant == "fix"))
        outs, g = [], None
        for i, step_grads in enumerate(grads):
            for p, gr in zip(params, step_grads):
                p.grad.copy_(gr)
            if not graphed:
                opt.step()
            elif g is None:                           # step 0 is the warmup, then capture
                state = {f"param{j}": p for j, p in enumerate(params)}
                for j, x in enumerate(opt.state):
                    state.update({f"exp_avg{j}": x["exp_avg"], f"exp_avg_sq{j}": x["exp_avg_sq"]})
                    if variant == "fix":
                        state.update({f"step{j}": x["step"], f"mu_product{j}": x["mu_product"]})
                g, _ = capture(opt.step, device=device, warmups=1, owner="NAdam.step (captured train step)",
                               static={f"grad{j}": p.grad for j, p in enumerate(params)}, state=state)
            else:
                replay(g, params[0])
            outs += [p.detach().clone() for p in params]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: workload(True), lambda: workload(False))
