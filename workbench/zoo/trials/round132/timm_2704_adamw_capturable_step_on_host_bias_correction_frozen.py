"""timm's ``AdamWLegacy`` (and ``NAdamW``) accepted ``capturable=True`` but still created ``state['step']`` as
``torch.tensor(0.)``, a CPU tensor: its capturable single-tensor path then computes the step increment and the
bias corrections (``1 - torch.pow(beta, step)``, ``lr / bias_correction1``, ...) on the host, and hands the device
kernels 0-dim CPU tensors, which CUDA passes by value. Captured in a whole-network CUDA graph, that host work runs
once: every replay applies the capture step's bias correction and ``state['step']`` never advances, so graphed
training drifts from the same loop run eagerly. The fix creates the step on the parameter's device when
``capturable`` is set, so the increment and the bias corrections become captured kernels.

Upstream: https://github.com/huggingface/pytorch-image-models/pull/2704 ("Support better torch.compile use by using
torch.tensor for step count", huggingface/pytorch-image-models, by rwightman, opened and merged 2026-05-26; its
description: "enhancing some shared helpers, tweaking some capturable use cases for optimizers that support it").
Landed on ``main`` as commit 29993ffcca12b19a02ba44cd2849e82c0a9f841f (same title, 2026-05-26), read in a mirror of
the repository. Read: that commit's whole diff of ``timm/optim/adamw.py`` (``AdamWLegacy.__setstate__`` and
``step``: ``state['step'] = _init_scalar(device=p.device if group['capturable'] else 'cpu')``; ``adamw``'s foreach
choice; ``_single_tensor_adamw``: ``_check_capturable_devices`` and ``_get_value``; ``_multi_tensor_adamw``),
``timm/optim/nadamw.py`` (the same change in ``NAdamW``), ``timm/optim/_helpers.py`` (new: ``_init_scalar``,
``_get_scalar_dtype``, ``_get_capturable_supported_devices``, ``_check_capturable_devices``, ``_get_value``) and
``timm/optim/lamb.py``; the capturable hunks of ``laprop.py`` and ``muon.py``. At its parent (``29993ffc^``):
``timm/optim/adamw.py`` whole (``AdamWLegacy.__init__`` / ``__setstate__`` / ``step`` with ``state['step'] =
torch.tensor(0.)``, ``adamw``, ``_single_tensor_adamw``, ``_multi_tensor_adamw``'s ``assert all(p.is_cuda and
step.is_cuda ...)``) and ``timm/optim/nadamw.py`` whole. Also read: torch 2.13's
``Optimizer._accelerator_graph_capture_health_check`` (a capture raises only when ``capturable`` is False), and the
older timm commit 2d597b12 ("Missed extra nadam algo step for capturable path", 2023), which shows the capturable
path was in use.
Not read: the PR's review conversation (the stored record has only its one-line description), any issue (none is
linked), timm's tests (the commit adds none for this), the other optimizers the commit touches (``adafactor_bv``,
``kron``, ``lion``, ``rmsprop_tf``) beyond the commit's file list; the ``torch.cuda.graph`` documentation's
whole-network capture recipe, which the workload follows as recalled, not re-read.
Symptom: no user report was found; as read from the code (a guess at what a user saw, stated as such): with
``AdamWLegacy(..., capturable=True, foreach=False)`` (or a ``caution`` run on a torch without the foreach Scalar
overload) a whole-network capture of forward, backward and ``optimizer.step()`` raises nothing, but from the second
replay's update on, the weights differ from the same loop run eagerly, and ``optimizer.state[p]['step']`` stays at
the capture's value. With the default ``foreach`` the same constructor fails earlier, eagerly, on
``_multi_tensor_adamw``'s "If capturable=True, params and state_steps must be CUDA tensors." (not modelled).
Mechanism: ``AdamWLegacy.step`` initialises ``state['step'] = torch.tensor(0.)`` whatever ``capturable`` says, so
the step is host memory. ``_single_tensor_adamw``'s ``capturable`` branch does ``step_t += 1``, ``bias_correction1
= 1 - torch.pow(beta1, step)``, ``step_size_neg = (lr / bias_correction1).neg()``, ``bias_correction2.sqrt()`` and
``eps / step_size_neg`` on that CPU tensor (host ops), then ``denom_base.sqrt() / (bias_correction2_sqrt *
step_size_neg)`` and ``.add_(eps / step_size_neg)`` on the device, with the 0-dim CPU results as scalar kernel
arguments. During capture the host ops run once (the step goes from 3 to 4 after three warmups) and the recorded
``div`` / ``add_`` kernels keep step 4's values. Replays re-run only the kernels: step 5, 6, ... are corrected as
step 4, and the host step stays 4. Eager runs redo the host work every call, so they are right; only graphs differ.
Doctor: host-work-frozen, at step. Host work inside the captured region (the step increment and the bias
corrections on a CPU step) ran once, at capture, and its values are baked into the replayed kernels; ``step``
(``AdamWLegacy.step``) is where the step is created on the host although ``capturable`` is set, and the line the
fix changes (``_single_tensor_adamw`` runs the frozen arithmetic, unchanged by the fix for this branch).
Fix (upstream): ``state['step'] = _init_scalar(device=p.device if group['capturable'] else 'cpu')`` in ``step``
(and the same placement in ``__setstate__``); ``_single_tensor_adamw`` / ``_multi_tensor_adamw`` call
``_check_capturable_devices(params, state_steps)`` when ``capturable`` (params and steps on one supported device).
Modelled: ``AdamWLegacy`` (``__init__`` defaults, ``step`` with the health check, lazy state initialisation and the
``adamw`` call), ``adamw`` (the foreach choice; the workload passes ``foreach=False``), ``_single_tensor_adamw``
(weight decay, moments, the ``capturable`` branch and the host-scalar branch; no amsgrad, no caution),
``_init_scalar`` / ``_get_scalar_dtype`` / ``_get_capturable_supported_devices`` / ``_check_capturable_devices`` /
``_get_value`` from ``_helpers.py``; the whole-network capture recipe of the ``torch.cuda.graph`` documentation
(three warmup steps, ``zero_grad(set_to_none=True)``, capture of forward + backward + ``step()``, copy-in and replay).
Stand-ins: ``torch.tensor(0.)`` (a CPU tensor on a GPU machine) is ``host(torch.tensor(0.), device)``, the engine's
host memory (pinned on CUDA, which changes nothing here: it only meets device ops as a 0-dim scalar);
``_cuda_graph_capture_health_check`` is a short stand-in for torch's check (``capturable`` is True, so it passes);
``_get_capturable_supported_devices`` also lists ``cpu`` because the CPU engine's memory stands for the GPU's; the
multi-tensor path, amsgrad, caution, maximize and ``torch.compile`` handling are not modelled; the model is a
two-layer MLP (4 -> 8 -> 1, tanh) in float64 with MSE loss.
Workload: six batches of 8 rows; the capture's static batch is batch 0; three warmup steps on it (real optimizer
steps, as the recipe's side-stream warmup), then capture, then one replay per batch 1..5 (lr 0.05, betas 0.9/0.999,
weight decay 0.01, ``capturable=True``, ``foreach=False``). The reference run makes the same eight steps without
graphs. Outputs: the five replayed losses, the final parameters, ``exp_avg``, ``exp_avg_sq`` and ``step``.
Measured: bug: misbehaves (max |graph - eager| = 4: the step counter, 4 against eager's 8). The first two
replayed losses equal eager's (replay 1 applies step 4's correction, which is right for step 4); from the third
on they drift (0.840771 against 0.840174, then 2.142576 against 2.084111), and the final weights are up to 0.0585
apart. Fix: equals eager (max |graph - eager| = 0). Each variant runs in about 1.5 s on the CPU.
"""
from __future__ import annotations

import math

import torch

from workbench.engine import events, host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/huggingface/pytorch-image-models/pull/2704"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "step"
SYMPTOM = ("timm AdamWLegacy with capturable=True keeps its step count on the host: a captured optimizer step "
           "replays the capture step's bias correction and the step never advances, so graphed training drifts")

ROWS, DIM, HIDDEN, BATCHES, WARMUPS = 8, 4, 8, 6, 3
LR, BETAS, EPS, WEIGHT_DECAY = 0.05, (0.9, 0.999), 1e-8, 0.01
DTYPE = torch.float64

_variant = "bug"
_device = "cpu"


# --- timm/optim/_helpers.py (after the fix) ------------------------------------------------------------------------

def _get_scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _init_scalar(value: float = 0.0, device=None) -> torch.Tensor:
    return torch.tensor(value, dtype=_get_scalar_dtype(), device=device)


def _get_value(x):
    return x.item() if isinstance(x, torch.Tensor) else x


def _get_capturable_supported_devices() -> list:
    # upstream: ["cuda", "xpu", "hpu"] + the privateuse1 backend + "xla"; "cpu" here because the CPU engine's
    # memory stands for the GPU's (stand-in)
    return ["cuda", "xpu", "hpu", "xla", "cpu"]


def _check_capturable_devices(params, state_steps) -> None:
    supported = _get_capturable_supported_devices()
    assert all(
        p.device.type == step.device.type and p.device.type in supported
        for p, step in zip(params, state_steps)
    ), f"If capturable=True, params and state_steps must be on supported devices: {supported}."


def _host_scalar() -> torch.Tensor:
    """``torch.tensor(0.)`` on a GPU machine: a CPU tensor, i.e. host memory."""
    return host(torch.tensor(0.), _device)


# --- timm/optim/adamw.py ----------------------------------------------------------------------------------------------

class AdamWLegacy:
    """timm's ``AdamWLegacy`` (a ``torch.optim.Optimizer`` upstream; its bookkeeping reduced to what ``step`` uses)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 caution=False, corrected_weight_decay=False, maximize=False, foreach=None, capturable=False):
        self.defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                             caution=caution, corrected_weight_decay=corrected_weight_decay, foreach=foreach,
                             maximize=maximize, capturable=capturable)
        self.param_groups = [dict(self.defaults, params=list(params))]
        self.state: dict = {}

    def _cuda_graph_capture_health_check(self):
        """torch's check (stand-in): capturing ``step()`` of an instance with ``capturable=False`` raises."""
        if torch.cuda.is_current_stream_capturing() and not all(g["capturable"] for g in self.param_groups):
            raise RuntimeError("Attempting CUDA graph capture of step() for an instance of AdamWLegacy but "
                               "param_groups' capturable is False.")

    def zero_grad(self, set_to_none=True):
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    @torch.no_grad()
    def step(self, closure=None):
        self._cuda_graph_capture_health_check()
        loss = None
        for group in self.param_groups:
            params_with_grad, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps = [], [], [], [], [], []
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                params_with_grad.append(p)
                grads.append(p.grad)
                state = self.state.setdefault(p, {})
                # State initialization
                if len(state) == 0:
                    if _variant == "fix":
                        state["step"] = (_init_scalar(device=p.device) if group["capturable"]
                                         else _host_scalar())               # 'cpu' upstream: host memory
                    else:
                        state["step"] = _host_scalar()                      # torch.tensor(0.): on the host
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                state_steps.append(state["step"])
            adamw(params_with_grad, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps,
                  foreach=group["foreach"], amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=group["lr"],
                  weight_decay=group["weight_decay"], eps=group["eps"], caution=group["caution"],
                  maximize=group["maximize"], capturable=group["capturable"],
                  max_lr=self.defaults["lr"] if group["corrected_weight_decay"] else None)
        return loss


def adamw(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, foreach=None, capturable=False, *,
          amsgrad, beta1, beta2, lr, weight_decay, eps, caution, maximize, max_lr):
    if not all(isinstance(t, torch.Tensor) for t in state_steps):
        raise RuntimeError("API has changed, `state_steps` argument must contain a list of singleton tensors")
    if foreach is None:
        foreach = not caution        # upstream also probes the _foreach_maximum_ Scalar overload
    if foreach:
        raise NotImplementedError("_multi_tensor_adamw is not modelled; the workload passes foreach=False")
    _single_tensor_adamw(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, amsgrad=amsgrad,
                         beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps, caution=caution,
                         maximize=maximize, capturable=capturable, max_lr=max_lr)


def _single_tensor_adamw(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, amsgrad, beta1,
                         beta2, lr, weight_decay, eps, caution, maximize, capturable, max_lr):
    if _variant == "fix" and capturable:
        _check_capturable_devices(params, state_steps)

    for i, param in enumerate(params):
        grad = grads[i] if not maximize else -grads[i]
        exp_avg = exp_avgs[i]
        exp_avg_sq = exp_avg_sqs[i]
        step_t = state_steps[i]

        # Update step.
        step_t += 1

        # Perform stepweight decay.
        wd_scale = lr if max_lr is None else lr ** 2 / max_lr
        param.mul_(1. - wd_scale * weight_decay)

        # Decay the first and second moment running average coefficient.
        exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom_base = exp_avg_sq                                   # (amsgrad not modelled)

        if capturable:
            step = step_t
            # 1 - beta1 ** step can't be captured in a CUDA graph, even if step is a CUDA tensor
            bias_correction1 = 1 - torch.pow(beta1, step)
            bias_correction2 = 1 - torch.pow(beta2, step)
            step_size = lr / bias_correction1
            step_size_neg = step_size.neg()
            bias_correction2_sqrt = bias_correction2.sqrt()
            denom = (denom_base.sqrt() / (bias_correction2_sqrt * step_size_neg)).add_(eps / step_size_neg)
            param.addcdiv_(exp_avg, denom)
        else:
            step = _get_value(step_t)
            bias_correction1 = 1 - beta1 ** step
            bias_correction2 = 1 - beta2 ** step
            step_size = lr / bias_correction1
            bias_correction2_sqrt = math.sqrt(bias_correction2)
            denom = (denom_base.sqrt() / bias_correction2_sqrt).add_(eps)
            param.addcdiv_(exp_avg, denom, value=-step_size)


# --- the training loop (the whole-network capture recipe of the torch.cuda.graph docs) ------------------------------

class MLP(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        gen = generator(2704)
        self.w1 = torch.nn.Parameter(randn(DIM, HIDDEN, gen=gen, device=device, scale=0.5).to(DTYPE))
        self.b1 = torch.nn.Parameter(randn(HIDDEN, gen=gen, device=device, scale=0.1).to(DTYPE))
        self.w2 = torch.nn.Parameter(randn(HIDDEN, 1, gen=gen, device=device, scale=0.5).to(DTYPE))

    def forward(self, x):
        return torch.tanh(x @ self.w1 + self.b1) @ self.w2


def train_step(model, optimizer, x, y):
    optimizer.zero_grad(set_to_none=True)
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    optimizer.step()
    return loss.detach()


def _make(device):
    model = MLP(device)
    optimizer = AdamWLegacy(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                            foreach=False, capturable=True)
    return model, optimizer


def _final_state(model, optimizer):
    out = []
    for p in model.parameters():
        st = optimizer.state[p]
        out += [p.detach().clone(), st["exp_avg"].clone(), st["exp_avg_sq"].clone(),
                torch.tensor([float(st["step"])], dtype=DTYPE)]
    return out


def run(variant: str, device: str = "cpu"):
    global _variant, _device
    _variant, _device = variant, device
    gen = generator(3)
    batches = [(randn(ROWS, DIM, gen=gen, device=device).to(DTYPE), randn(ROWS, 1, gen=gen, device=device).to(DTYPE))
               for _ in range(BATCHES)]

    def eager():
        model, optimizer = _make(device)
        for _ in range(WARMUPS):
            train_step(model, optimizer, *batches[0])
        losses = [train_step(model, optimizer, x, y) for x, y in batches[1:]]
        return losses + _final_state(model, optimizer)

    def served():
        model, optimizer = _make(device)
        static_x, static_y = batches[0][0].clone(), batches[0][1].clone()
        owner = "whole-network capture (forward, backward, AdamWLegacy.step)"
        params = {f"param{i}": p for i, p in enumerate(model.parameters())}
        # warmup: real optimizer steps on the static batch (they create the optimizer state), then the capture
        g, static_loss = capture(lambda: train_step(model, optimizer, static_x, static_y), device=device,
                                 warmups=WARMUPS, static={"x": static_x, "y": static_y}, state=params, owner=owner)
        opt_state = {f"{name}.{key}": optimizer.state[p][key]
                     for name, p in params.items() for key in ("step", "exp_avg", "exp_avg_sq")}
        events.persistent_state(owner, {**params, **opt_state})
        losses = []
        for x, y in batches[1:]:
            static_x.copy_(x)
            static_y.copy_(y)
            losses.append(replay(g, static_loss).clone())
        return losses + _final_state(model, optimizer)

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
