"""Adam keeps ``step`` and its bias correction on the host: a captured ``optimizer.step()`` replays capture-time constants.

Upstream: https://github.com/pytorch/pytorch/pull/77862 ("[CUDA graphs] Allows Adam and AdamW to be
capture-safe"; issue pytorch/pytorch#76368, "Inconsistent behavior when using Adam optimizer with
PyTorch's CUDA Graphs API").
Symptom: a whole-network capture (``static_loss.backward(); optimizer.step()`` inside
``torch.cuda.graph(g)``, then ``g.replay()`` once per step) trains differently from the same loop run
eagerly: ``torch.allclose(model_cg[0].weight, model[0].weight)`` fails, by an amount that grows with the
learning rate (torch 1.11). No error, no warning.
Mechanism: in torch 1.11 ``Adam.step()`` keeps ``state['step']`` as a Python int and does
``state['step'] += 1`` on the host; the functional ``adam`` then computes ``bias_correction1 = 1 - beta1 **
step``, ``bias_correction2 = 1 - beta2 ** step``, ``step_size = lr / bias_correction1`` and
``math.sqrt(bias_correction2)`` as Python floats and passes them to the kernels as scalar arguments
(``denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)``, ``param.addcdiv_(exp_avg, denom,
value=-step_size)``). During capture that host work runs once; only the kernels are recorded, with the
capture step's floats baked in. Every replay applies the bias correction of step ``t_capture`` and
``state['step']`` stays where the capture left it.
Doctor: host-work-frozen, at ``_single_tensor_adam`` (the host ``beta ** step`` arithmetic whose floats the
captured ``div``/``addcdiv_`` kernels keep).
Fix (upstream): a ``capturable`` flag: ``state['step']`` becomes ``torch.zeros((1,), dtype=torch.float,
device=p.device)``, incremented on the device; ``bias_correction1 = 1 - torch.pow(beta1, step)``,
``step_size_neg = (lr / bias_correction1).neg()``, ``denom = (exp_avg_sq.sqrt() / (bias_correction2_sqrt *
step_size_neg)).add_(eps / step_size_neg)``, ``param.addcdiv_(exp_avg, denom)`` (no host scalar); and
``step()`` runs ``_cuda_graph_capture_health_check`` (capture with ``capturable=False`` raises).
"""
from __future__ import annotations

import math

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/pytorch/pull/77862"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "_single_tensor_adam"
SYMPTOM = "graphed Adam training replays the capture step's bias correction; weights drift from eager"
ROWS, DIM, ITERS = 8, 4, 6
LR, BETA1, BETA2, EPS = 0.05, 0.9, 0.999, 1e-8


class Adam:
    """``torch.optim.Adam`` (single-tensor path, no weight decay, no amsgrad). ``after_77862``: the version
    with the ``capturable`` flag and the capture health check."""

    def __init__(self, params, lr=LR, betas=(BETA1, BETA2), eps=EPS, capturable=False, after_77862=False):
        self.defaults = {"lr": lr, "betas": betas, "eps": eps, "capturable": capturable}
        self.param_groups = [dict(self.defaults, params=list(params))]
        self.state = {}
        self.after_77862 = after_77862

    def _cuda_graph_capture_health_check(self):
        if torch.cuda.is_current_stream_capturing() and not self.defaults["capturable"]:
            raise RuntimeError("Attempting CUDA graph capture of step() for an instance of Adam but this "
                               "instance was constructed with capturable=False.")

    @torch.no_grad()
    def step(self):
        if self.after_77862:
            self._cuda_graph_capture_health_check()
        for group in self.param_groups:
            params_with_grad, grads, exp_avgs, exp_avg_sqs, state_steps = [], [], [], [], []
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                params_with_grad.append(p)
                grads.append(p.grad)
                state = self.state.setdefault(id(p), {})
                if len(state) == 0:                                   # lazy state initialization
                    if self.after_77862:
                        state["step"] = (torch.zeros((1,), dtype=torch.float, device=p.device)
                                         if self.defaults["capturable"] else torch.tensor(0.0))
                    else:
                        state["step"] = 0                             # torch 1.11: a Python int
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                if not self.after_77862:
                    state["step"] += 1                                # host increment (1.11 Adam.step)
                state_steps.append(state["step"])
            _single_tensor_adam(params_with_grad, grads, exp_avgs, exp_avg_sqs, state_steps, beta1=beta1,
                                beta2=beta2, lr=group["lr"], eps=group["eps"], capturable=group["capturable"],
                                step_is_tensor=self.after_77862)


def _single_tensor_adam(params, grads, exp_avgs, exp_avg_sqs, state_steps, *, beta1, beta2, lr, eps, capturable,
                        step_is_tensor):
    for i, param in enumerate(params):
        grad = grads[i]
        exp_avg = exp_avgs[i]
        exp_avg_sq = exp_avg_sqs[i]
        step_t = state_steps[i]

        if step_is_tensor:
            step_t += 1                                               # update step

        # Decay the first and second moment running average coefficient
        exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)

        if capturable:
            step = step_t
            # 1 - beta1 ** step can't be captured in a CUDA graph, even if step is a CUDA tensor
            bias_correction1 = 1 - torch.pow(beta1, step)
            bias_correction2 = 1 - torch.pow(beta2, step)
            step_size = lr / bias_correction1
            step_size_neg = step_size.neg()
            bias_correction2_sqrt = bias_correction2.sqrt()
            denom = (exp_avg_sq.sqrt() / (bias_correction2_sqrt * step_size_neg)).add_(eps / step_size_neg)
            param.addcdiv_(exp_avg, denom)
        else:
            step = step_t.item() if isinstance(step_t, torch.Tensor) else step_t   # host value
            bias_correction1 = 1 - beta1 ** step
            bias_correction2 = 1 - beta2 ** step
            step_size = lr / bias_correction1
            bias_correction2_sqrt = math.sqrt(bias_correction2)
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
            param.addcdiv_(exp_avg, denom, value=-step_size)


class Model(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        gen = generator(77862)
        self.weight = torch.nn.Parameter(randn(DIM, 1, gen=gen, device=device))

    def forward(self, x):
        return x @ self.weight


def train_step(model, x, y, opt):
    """Forward, backward and ``optimizer.step()``: what the whole-network capture of #76368 records."""
    model.weight.grad = None
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    return loss.detach()


def run(variant: str, device: str = "cpu"):
    gen = generator(2)
    batches = [(randn(ROWS, DIM, gen=gen, device=device), randn(ROWS, 1, gen=gen, device=device))
               for _ in range(ITERS)]
    fixed = variant == "fix"              # Adam after #77862, constructed with capturable=True

    def state(model, opt):
        st = opt.state[id(model.weight)]
        return [model.weight.detach().clone(), st["exp_avg"].clone(), st["exp_avg_sq"].clone(),
                torch.as_tensor(float(st["step"]))]

    def eager():
        model = Model(device)
        opt = Adam(model.parameters(), capturable=fixed, after_77862=fixed)
        losses = [train_step(model, x, y, opt) for x, y in batches]
        return losses[1:] + state(model, opt)

    def served():
        model = Model(device)
        opt = Adam(model.parameters(), capturable=fixed, after_77862=fixed)
        static_x, static_y = batches[0][0].clone(), batches[0][1].clone()
        owner = "whole-network capture (fwd+bwd+Adam.step)"
        # warmup: the first real step (batch 0) runs eagerly and initialises Adam's state; then capture
        g, static_loss = capture(lambda: train_step(model, static_x, static_y, opt), device=device,
                                 static={"x": static_x, "y": static_y}, owner=owner)
        st = opt.state[id(model.weight)]
        persistent = {"weight": model.weight, "exp_avg": st["exp_avg"], "exp_avg_sq": st["exp_avg_sq"]}
        if isinstance(st["step"], torch.Tensor):
            persistent["step"] = st["step"]
        events.persistent_state(owner, persistent)
        losses = []
        for x, y in batches[1:]:
            static_x.copy_(x)
            static_y.copy_(y)
            losses.append(replay(g, static_loss).clone())
        return losses + state(model, opt)

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
