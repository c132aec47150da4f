"""Single-tensor Adamax with ``capturable=True`` still reads ``step`` back to the host inside the graph capture.

Upstream: https://github.com/pytorch/pytorch/pull/121183 ("Add capturable single tensor Adamax").
Symptom: ``torch.optim.Adamax(..., capturable=True, foreach=False)`` accepted the flag, but its for-loop
implementation was not capturable: capturing a whole training step that contains ``optimizer.step()``
fails, and #118326 (January 2024) describes the single-tensor path as "silently incorrect" and makes it
raise until this PR gives it a real capturable implementation (PyTorch 2.2, landed for 2.3, March 2024).
Mechanism: only ``_multi_tensor_adamax`` had a capturable branch. ``_single_tensor_adamax`` always
computed the bias correction as ``1 - beta1 ** _get_value(step_t)``; ``_get_value`` is ``step_t.item()``,
and with ``capturable=True`` ``step_t`` lives on the device, so every optimizer step inside the captured
region asks for a device value on the host: a synchronisation that a stream capture does not allow
(and that, were it allowed, would bake the capture-time step into every replay).
Doctor: sync-in-capture, at ``_single_tensor_adamax`` (the ``.item()`` of the device step tensor).
Fix (upstream): a ``capturable`` branch that keeps the bias correction on the device
(``neg_bias_correction = beta1 ** step_t - 1; neg_bias_correction.div_(lr)``, then
``param.addcdiv_(exp_avg, exp_inf * neg_bias_correction)``), with no host read of ``step_t``.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/pytorch/pull/121183"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "_single_tensor_adamax"
SYMPTOM = "capturing a training step with single-tensor Adamax(capturable=True) fails at step_t.item()"
DIM, OUT, BATCH, STEPS = 4, 2, 6, 4


def _get_value(x):
    # item is significantly faster than a cpu tensor in eager mode
    return x.item() if isinstance(x, torch.Tensor) else x


def _single_tensor_adamax(params, grads, exp_avgs, exp_infs, state_steps, *, eps, beta1, beta2, lr,
                          weight_decay, capturable, has_capturable_branch):
    for i, param in enumerate(params):
        grad = grads[i]
        exp_avg = exp_avgs[i]
        exp_inf = exp_infs[i]
        step_t = state_steps[i]
        # update step
        step_t += 1

        if weight_decay != 0:
            grad = grad.add(param, alpha=weight_decay)

        # Update biased first moment estimate.
        exp_avg.lerp_(grad, 1 - beta1)
        # Update the exponentially weighted infinity norm.
        norm_buf = torch.cat([exp_inf.mul_(beta2).unsqueeze(0), grad.abs().add_(eps).unsqueeze(0)], 0)
        exp_inf.copy_(torch.amax(norm_buf, 0, keepdim=False))

        if capturable and has_capturable_branch:
            # why jump through extra hoops and negate bias_correction? check out #121238
            neg_bias_correction = beta1 ** step_t - 1
            neg_bias_correction.div_(lr)
            denom = exp_inf * neg_bias_correction
            param.addcdiv_(exp_avg, denom)
        else:
            bias_correction = 1 - beta1 ** _get_value(step_t)
            clr = lr / bias_correction
            param.addcdiv_(exp_avg, exp_inf, value=-clr)


class Adamax:
    """``torch.optim.Adamax`` with ``foreach=False`` (the for-loop implementation)."""

    def __init__(self, params, lr=2e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, capturable=False,
                 variant="fix"):
        self.params = params
        self.defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, capturable=capturable)
        self.has_capturable_branch = variant == "fix"
        # capturable: the step counters live on the params' device
        self.state = [{"step": torch.zeros((), device=p.device) if capturable else torch.zeros(()),
                       "exp_avg": torch.zeros_like(p), "exp_inf": torch.zeros_like(p)} for p in params]

    def step(self):
        d = self.defaults
        _single_tensor_adamax(self.params, [p.grad for p in self.params], [s["exp_avg"] for s in self.state],
                              [s["exp_inf"] for s in self.state], [s["step"] for s in self.state],
                              eps=d["eps"], beta1=d["betas"][0], beta2=d["betas"][1], lr=d["lr"],
                              weight_decay=d["weight_decay"], capturable=d["capturable"],
                              has_capturable_branch=self.has_capturable_branch)


def make_model(device):
    gen = generator(121183)
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
    gen = generator(7)
    batches = [(randn(BATCH, DIM, gen=gen, device=device), randn(BATCH, OUT, gen=gen, device=device))
               for _ in range(STEPS + 1)]

    def eager():
        w = make_model(device)
        opt = Adamax([w], capturable=True, variant=variant)
        losses = [train_step(w, opt, x, y).clone() for x, y in batches]
        return losses + [w.detach().clone()]

    def served():
        w = make_model(device)
        opt = Adamax([w], capturable=True, variant=variant)
        static_input, static_target = batches[0][0].clone(), batches[0][1].clone()
        state = {"w": w, "w.grad": w.grad}
        for i, s in enumerate(opt.state):
            state.update({f"exp_avg.{i}": s["exp_avg"], f"exp_inf.{i}": s["exp_inf"], f"step.{i}": s["step"]})
        # the warmup iteration trains on the first batch, as the docs' side-stream warmup does
        g, loss = capture(lambda: train_step(w, opt, static_input, static_target), device=device,
                          static={"static_input": static_input, "static_target": static_target}, state=state,
                          owner="whole-network capture (model + Adamax)")
        # the warmup already ran step 1 on batch 0 (its loss is that of the initial weights)
        err = batches[0][0] @ make_model(device) - batches[0][1]
        losses = [(err * err).mean()]
        for x, y in batches[1:]:
            static_input.copy_(x)
            static_target.copy_(y)
            losses.append(replay(g, loss).clone())
        return losses + [w.detach().clone()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
