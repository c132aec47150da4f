"""A checkpoint's number-valued ``step`` is restored as a CPU tensor, so a captured capturable NAdam step freezes it.

Upstream: https://github.com/pytorch/pytorch/pull/118326 ("[optim] Rectify capturable testing and fix bugs!").
Symptom: resuming training from an optimizer state dict whose ``step`` / ``mu_product`` are plain
numbers (older checkpoints), with ``capturable=True`` and the optimizer step inside a CUDA graph: the
replayed steps keep the bias correction and momentum schedule of the captured step, so the parameters
drift from an uncaptured run; no error, since the newer capturable optimizers skipped the "state_steps
must be on the device" check (PyTorch 2.1/2.2, fixed January 2024).
Mechanism: ``__setstate__`` (called by ``load_state_dict``) turns a number ``step`` into
``torch.tensor(step_val, dtype=_get_scalar_dtype())``, a CPU tensor, whatever ``capturable`` says. The
capturable NAdam path does its step arithmetic with tensors (``step_t += 1``, ``beta2 ** step``,
``mu_product *= mu``), but on a CPU tensor those are host work: during the capture they run once, and
the device kernels receive their 0-dim results as scalar arguments, by value. Every replay re-runs the
kernels with the capture-time ``bias_correction2``, ``mu`` and ``mu_product``; ``step`` never advances.
Doctor: host-work-frozen, at ``__setstate__`` (where the step counters are put in host memory for a
capturable optimizer, so the captured step arithmetic is host work).
Fix (upstream): ``__setstate__`` creates ``step`` (and NAdam's ``mu_product``) on the parameter's device
when ``capturable`` (or ``fused``) is set, and the capturable paths check that they are.
"""
from __future__ import annotations

import torch

from workbench.engine import host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/pytorch/pull/118326"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "__setstate__"
SYMPTOM = "after load_state_dict, replayed NAdam steps reuse the captured step's bias correction and mu"
DIM, OUT, BATCH, STEPS, RESUMED_STEP = 4, 2, 6, 4, 3


def _get_scalar_dtype():
    return torch.float32


def _single_tensor_nadam(params, grads, exp_avgs, exp_avg_sqs, mu_products, state_steps, *, beta1, beta2, lr,
                         weight_decay, momentum_decay, eps, capturable):
    for i, param in enumerate(params):
        grad = grads[i]
        exp_avg = exp_avgs[i]
        exp_avg_sq = exp_avg_sqs[i]
        mu_product = mu_products[i]
        step_t = state_steps[i]

        # update step
        step_t += 1
        step = step_t if capturable else step_t.item()

        bias_correction2 = 1 - beta2 ** step
        if weight_decay != 0:
            grad = grad.add(param, alpha=weight_decay)

        # calculate the momentum cache \mu^{t} and \mu^{t+1}
        mu = beta1 * (1. - 0.5 * (0.96 ** (step * momentum_decay)))
        mu_next = beta1 * (1. - 0.5 * (0.96 ** ((step + 1) * momentum_decay)))

        # update mu_product
        mu_product *= mu

        # decay the first and second moment running average coefficient
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = exp_avg_sq.div(bias_correction2).sqrt()

        if capturable:
            denom = denom.add(eps)
            # Make autograd track the operations
            # by updating the grad and exp_avg directly and not using the
            # scalar "value" argument of addcdiv.
            mu_product_next = mu_product * mu_next
            grad = grad * (-lr * (1. - mu) / (1. - mu_product))
            exp_avg = exp_avg * (-lr * mu_next / (1. - mu_product_next))
            param.addcdiv_(grad, denom)
            param.addcdiv_(exp_avg, denom)
        else:
            mu_product_next = mu_product.item() * mu_next
            denom.add_(eps)
            param.addcdiv_(grad, denom, value=(-lr * (1. - mu) / (1. - mu_product.item())))
            param.addcdiv_(exp_avg, denom, value=(-lr * mu_next) / (1. - mu_product_next))


class NAdam:
    def __init__(self, params, lr=2e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, momentum_decay=4e-3,
                 capturable=False, variant="fix"):
        self.params = params
        self.param_groups = [dict(params=params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                  momentum_decay=momentum_decay, capturable=capturable)]
        self.state = {}
        self.variant = variant

    def load_state_dict(self, state_dict):
        self.__setstate__({"state": {p: dict(s) for p, s in zip(self.params, state_dict["state"])}})

    def __setstate__(self, state):
        self.state = state["state"]
        for group in self.param_groups:
            for p in group["params"]:
                p_state = self.state.get(p, [])
                if len(p_state) != 0:
                    on_device = group["capturable"] and self.variant == "fix"
                    if not torch.is_tensor(p_state["step"]):
                        step_val = float(p_state["step"])
                        p_state["step"] = (torch.tensor(step_val, dtype=_get_scalar_dtype(), device=p.device)
                                           if on_device else
                                           host(torch.tensor(step_val, dtype=_get_scalar_dtype()), p.device))
                    if not torch.is_tensor(p_state["mu_product"]):
                        mu_prod_val = p_state["mu_product"]
                        p_state["mu_product"] = (torch.tensor(mu_prod_val, dtype=_get_scalar_dtype(),
                                                              device=p.device)
                                                 if on_device else
                                                 host(torch.tensor(mu_prod_val, dtype=_get_scalar_dtype()),
                                                      p.device))

    def step(self):
        for group in self.param_groups:
            ps = group["params"]
            st = [self.state[p] for p in ps]
            _single_tensor_nadam(ps, [p.grad for p in ps], [s["exp_avg"] for s in st],
                                 [s["exp_avg_sq"] for s in st], [s["mu_product"] for s in st],
                                 [s["step"] for s in st], beta1=group["betas"][0], beta2=group["betas"][1],
                                 lr=group["lr"], weight_decay=group["weight_decay"],
                                 momentum_decay=group["momentum_decay"], eps=group["eps"],
                                 capturable=group["capturable"])


def checkpoint(device):
    """A resumed run: weights and an optimizer state dict whose step / mu_product are plain numbers."""
    gen = generator(118326)
    w = randn(DIM, OUT, gen=gen, device=device, scale=0.5)
    w.grad = torch.zeros_like(w)                       # static .grad (zero_grad(set_to_none=False))
    mu_product = 1.0
    for t in range(1, RESUMED_STEP + 1):
        mu_product *= 0.9 * (1. - 0.5 * (0.96 ** (t * 4e-3)))
    sd = {"state": [{"step": RESUMED_STEP, "mu_product": mu_product,
                     "exp_avg": randn(DIM, OUT, gen=gen, device=device, scale=0.1),
                     "exp_avg_sq": randn(DIM, OUT, gen=gen, device=device, scale=0.1).abs()}]}
    return w, sd


def train_step(w, opt, static_input, static_target):
    err = static_input @ w - static_target
    loss = (err * err).mean()
    w.grad.copy_(static_input.t() @ err * (2.0 / err.numel()))
    opt.step()
    return loss


def run(variant: str, device: str = "cpu"):
    gen = generator(5)
    batches = [(randn(BATCH, DIM, gen=gen, device=device), randn(BATCH, OUT, gen=gen, device=device))
               for _ in range(STEPS)]

    def resume():
        w, sd = checkpoint(device)
        opt = NAdam([w], capturable=True, variant=variant)
        opt.load_state_dict(sd)
        return w, opt

    def eager():
        w, opt = resume()
        losses = [train_step(w, opt, x, y).clone() for x, y in batches]
        return losses + [w.detach().clone()]

    def served():
        w, opt = resume()
        s = opt.state[w]
        static_input, static_target = batches[0][0].clone(), batches[0][1].clone()
        # warm up and capture, then restore the resumed state: the replays are the run (the warmup is not)
        saved = {k: v.clone() for k, v in s.items()}
        saved_w = w.detach().clone()
        g, loss = capture(lambda: train_step(w, opt, static_input, static_target), device=device,
                          static={"static_input": static_input, "static_target": static_target},
                          state={"w": w, "w.grad": w.grad, "exp_avg": s["exp_avg"], "exp_avg_sq": s["exp_avg_sq"]},
                          owner="whole-network capture (model + NAdam)")
        with torch.no_grad():
            w.copy_(saved_w)
            for k in ("exp_avg", "exp_avg_sq", "step", "mu_product"):
                s[k].copy_(saved[k])
        losses = []
        for x, y in batches:
            static_input.copy_(x)
            static_target.copy_(y)
            losses.append(replay(g, loss).clone())
        return losses + [w.detach().clone()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
