"""NAdam keeps ``step`` and ``mu_product`` on the host: a captured optimizer step replays capture-time constants.

Upstream: https://github.com/pytorch/pytorch/pull/106615 ("[NAdam] Add capturable API and tests + fix
differentiable"; the compiler-side motivation is pytorch/pytorch#106247, "Add capturable NAdam
implementation ... for cudagraphs compat").
Symptom: a training step captured whole with ``torch.optim.NAdam`` (forward, backward, ``step()``: the
whole-network pattern of the CUDA graphs docs, or ``torch.compile(mode="reduce-overhead")`` of the step)
captures without complaint but trains differently from the same loop run eagerly: every replay applies
the bias correction and momentum schedule of the capture step, and the state's ``step`` and
``mu_product`` never advance (PyTorch <= 2.0, mid 2023). NAdam had no ``capturable`` flag and no capture
health check, unlike Adam.
Mechanism: NAdam's per-parameter state was ``step = torch.tensor(0.)`` and ``mu_product = torch.tensor(1.)``
on the CPU. ``_single_tensor_nadam`` increments them with host ops and turns them into Python floats
(``_get_value`` = ``.item()``): ``bias_correction2 = 1 - beta2 ** step``, ``mu``, ``mu_next``, ``mu_product``
and the two ``addcdiv_`` step sizes. Inside a capture that host work runs once; only the device kernels
are recorded, with those floats baked in as kernel arguments. Replays repeat the kernels of step
``t_capture`` forever, and the host counters stay where the capture left them.
Doctor: host-work-frozen, at ``_single_tensor_nadam`` (the host ``step``/``mu_product`` arithmetic whose
floats the captured ``addcdiv_`` kernels keep).
Fix (upstream): ``capturable=True``: ``step`` and ``mu_product`` live on the parameter's device
(``torch.zeros((), device=p.device)``, ``torch.ones((), device=p.device)``), the schedule is computed with
device ops (``step = step_t``; ``grad * (-lr * (1 - mu) / (1 - mu_product))``, ``addcdiv_`` without a
scalar ``value``), and ``step()`` now runs ``_cuda_graph_capture_health_check``.
"""
from __future__ import annotations

import torch

from workbench.engine import events, host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/pytorch/pull/106615"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "_single_tensor_nadam"
SYMPTOM = "graphed NAdam training replays the capture step's bias correction and mu schedule forever"
ROWS, DIM, ITERS = 8, 4, 6
LR, BETA1, BETA2, EPS, MOMENTUM_DECAY = 0.05, 0.9, 0.999, 1e-8, 4e-3


def _get_value(x):
    # item is significantly faster than a cpu tensor in eager mode
    return x.item() if isinstance(x, torch.Tensor) else x


class NAdam:
    """``torch.optim.NAdam`` (single-tensor path, no weight decay). ``after_106615``: the version with the
    ``capturable`` flag and the capture health check in ``step()``."""

    def __init__(self, params, lr=LR, betas=(BETA1, BETA2), eps=EPS, momentum_decay=MOMENTUM_DECAY,
                 capturable=False, after_106615=False):
        self.param_groups = [{"params": list(params), "lr": lr, "betas": betas, "eps": eps,
                              "momentum_decay": momentum_decay, "capturable": capturable}]
        self.state = {}
        self.after_106615 = after_106615

    def _cuda_graph_capture_health_check(self):
        if torch.cuda.is_current_stream_capturing() and not all(g["capturable"] for g in self.param_groups):
            raise RuntimeError("Attempting CUDA graph capture of step() for an instance of NAdam but "
                               "param_groups' capturable is False.")

    def _init_group(self, group, params_with_grad, grads, exp_avgs, exp_avg_sqs, mu_products, state_steps):
        for p in group["params"]:
            if p.grad is None:
                continue
            params_with_grad.append(p)
            grads.append(p.grad)
            state = self.state.setdefault(id(p), {})
            if len(state) == 0:                               # lazy state initialization
                if group["capturable"]:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["mu_product"] = torch.ones((), dtype=torch.float32, device=p.device)
                else:                                         # CPU tensors: host memory
                    state["step"] = host(torch.tensor(0.0), p.device)
                    state["mu_product"] = host(torch.tensor(1.0), p.device)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            mu_products.append(state["mu_product"])
            state_steps.append(state["step"])

    @torch.no_grad()
    def step(self):
        if self.after_106615:
            self._cuda_graph_capture_health_check()
        for group in self.param_groups:
            params_with_grad, grads, exp_avgs, exp_avg_sqs, mu_products, state_steps = [], [], [], [], [], []
            beta1, beta2 = group["betas"]
            self._init_group(group, params_with_grad, grads, exp_avgs, exp_avg_sqs, mu_products, state_steps)
            _single_tensor_nadam(params_with_grad, grads, exp_avgs, exp_avg_sqs, mu_products, state_steps,
                                 beta1=beta1, beta2=beta2, lr=group["lr"], momentum_decay=group["momentum_decay"],
                                 eps=group["eps"], capturable=group["capturable"])


def _single_tensor_nadam(params, grads, exp_avgs, exp_avg_sqs, mu_products, state_steps, *, beta1, beta2, lr,
                         momentum_decay, eps, capturable):
    for i, param in enumerate(params):
        grad = grads[i]
        exp_avg = exp_avgs[i]
        exp_avg_sq = exp_avg_sqs[i]
        mu_product = mu_products[i]
        step_t = state_steps[i]

        # update step
        step_t += 1

        if capturable:
            step = step_t
        else:
            step = _get_value(step_t)

        bias_correction2 = 1 - beta2 ** step

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
            mu_product_next = _get_value(mu_product) * mu_next
            denom.add_(eps)
            param.addcdiv_(grad, denom, value=(-lr * (1. - mu) / (1. - _get_value(mu_product))))
            param.addcdiv_(exp_avg, denom, value=(-lr * mu_next) / (1. - mu_product_next))


class Model(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        gen = generator(106615)
        self.weight = torch.nn.Parameter(randn(DIM, 1, gen=gen, device=device))

    def forward(self, x):
        return x @ self.weight


def train_step(model, x, y, opt):
    """Forward, backward and ``optimizer.step()``: what the whole-network capture records."""
    model.weight.grad = None                  # backward allocates .grad (in the graph's pool at capture)
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    return loss.detach()


def run(variant: str, device: str = "cpu"):
    gen = generator(1)
    batches = [(randn(ROWS, DIM, gen=gen, device=device), randn(ROWS, 1, gen=gen, device=device))
               for _ in range(ITERS)]
    fixed = variant == "fix"              # NAdam after #106615, constructed with capturable=True

    def state(model, opt):
        st = opt.state[id(model.weight)]
        return [model.weight.detach().clone(), st["exp_avg"].clone(), torch.as_tensor(float(st["step"])),
                torch.as_tensor(float(st["mu_product"]))]

    def eager():
        model = Model(device)
        opt = NAdam(model.parameters(), capturable=fixed, after_106615=fixed)
        losses = [train_step(model, x, y, opt) for x, y in batches]
        return losses[1:] + state(model, opt)

    def served():
        model = Model(device)
        opt = NAdam(model.parameters(), capturable=fixed, after_106615=fixed)
        static_x, static_y = batches[0][0].clone(), batches[0][1].clone()
        owner = "whole-network capture (fwd+bwd+NAdam.step)"
        # warmup: the first real step (batch 0) runs eagerly and initialises NAdam's state; then capture
        g, static_loss = capture(lambda: train_step(model, static_x, static_y, opt), device=device,
                                 static={"x": static_x, "y": static_y}, owner=owner)
        st = opt.state[id(model.weight)]
        events.persistent_state(owner, {"weight": model.weight, "exp_avg": st["exp_avg"],
                                        "exp_avg_sq": st["exp_avg_sq"], "step": st["step"],
                                        "mu_product": st["mu_product"]})
        losses = []
        for x, y in batches[1:]:
            static_x.copy_(x)
            static_y.copy_(y)
            losses.append(replay(g, static_loss).clone())
        return losses + state(model, opt)

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
