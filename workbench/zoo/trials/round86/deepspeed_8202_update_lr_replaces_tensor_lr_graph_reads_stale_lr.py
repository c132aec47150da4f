"""DeepSpeed LR schedulers replace a tensor learning rate instead of filling it: a captured optimizer step keeps reading the dropped LR tensor.

Upstream: https://github.com/deepspeedai/DeepSpeed/pull/8202 ("Preserve tensor learning rates across scheduler
updates", merged 2026-08-02 as commit 3b6414870; a follow-up to the tensor-LR support of #7633). Read: the PR
description ("DeepSpeed's tensor learning-rate support currently replaces an optimizer's LR tensor on every scheduler
update ... This also leaves any caller-held reference to the supplied LR tensor pointing at the stale value. The root
cause is `update_lr()` constructing `tensor([lr])` instead of updating the tensor supplied through the optimizer"),
the diff of ``deepspeed/runtime/lr_schedules.py`` (``update_lr`` and ``WarmupCosineLR.org_lrs``) and ``WarmupLR`` as it
was at the parent commit; #7633's description (tensor LR lets a torch.compiled optimizer step keep one program while
the LR changes). Not read: the PR's tests. The PR names no CUDA graph; the holder of the stale reference here is a
captured optimizer step, the use tensor LRs exist for. The capturable Adam below is written from memory of
``torch.optim.adam._single_tensor_adam``'s capturable branch (not re-read).
Symptom: with an optimizer whose ``param_groups[i]['lr']`` is a tensor, a DeepSpeed LR schedule (``WarmupLR`` here)
breaks a CUDA-graph-captured ``optimizer.step()``: replays step with an LR tensor the schedule has already thrown
away, while the same loop run eagerly follows the warmup. No error on CUDA.
Mechanism: ``update_lr(param_groups, lrs)`` (called by ``WarmupLR.__init__`` and every ``WarmupLR.step``) did
``if is_tensor(param_group['lr']): lr = tensor([lr], device=...)`` and then ``param_group['lr'] = lr``: a NEW tensor
each update. A capturable optimizer reads ``group['lr']`` as a device tensor inside its kernels, so a graph captured
around ``optimizer.step()`` bakes in the address of the LR tensor present at capture. The next scheduler step puts
its value into a fresh tensor and drops the captured one, which nothing else holds: its memory goes back to the
allocator while every replay still reads it. On CUDA the caching allocator hands that block to a later
``tensor([lr])``, so replays read whichever LR happens to sit there (the capture-time value or a newer one); eager
steps look up ``group['lr']`` anew and see the schedule. The CPU emulation reports the read of released memory.
Doctor: dangling-reference, at update_lr. The captured step reads the LR tensor it was captured with; ``update_lr``
replaces that tensor in the param group, releasing the memory the graph keeps reading.
Fix (upstream): ``update_lr`` fills the optimizer's existing tensor in place (``param_group['lr'].fill_(lr)``,
squeezing a one-element tensor LR first) and assigns only scalar LRs; ``WarmupCosineLR`` clones tensor base LRs.
Modelled: ``update_lr`` and ``WarmupLR`` (linear warmup, ``_get_gamma``/``get_lr``/``step``) as upstream wrote them;
the optimizer is a minimal ``torch.optim.Adam(capturable=True)`` with a tensor LR (device-side step counter and bias
corrections); the user's training loop computes a least-squares gradient eagerly into the static ``.grad`` buffer,
warms up one eager optimizer step and captures ``optimizer.step()`` into a graph that later steps replay (the
optimizer-only capture of Megatron's ``OptimizerCudaGraphWrapper`` / a user's ``torch.cuda.graph``). The model is one
4x3 weight.
Workload: 6 training steps, ``WarmupLR(warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=5, linear)``, the
scheduler stepped after each optimizer step; step 0 is the eager warm-up, then ``optimizer.step()`` is captured and
steps 1-5 replay it. Eager steps use LRs 0.01, 0.01, 0.028, 0.046, 0.064, 0.082. In the bug, ``WarmupLR.step`` after
step 0 replaces (and releases) the LR tensor the graph captured, so the replay of step 1 already reads released
memory (the CPU emulation raises ``IllegalMemoryAccess`` there). The fix fills the captured tensor and equals eager.
"""
from __future__ import annotations

import math

import torch
from torch import is_tensor, tensor

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/deepspeedai/DeepSpeed/pull/8202"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "update_lr"
SYMPTOM = ("a CUDA-graph-captured optimizer step with a tensor LR does not follow a DeepSpeed LR schedule: "
           "update_lr puts each new LR into a fresh tensor and drops the captured one, which replays keep reading")

IN, OUT, BATCH, STEPS = 4, 3, 8, 6
WARMUP_LINEAR_RATE = "linear"

_variant = "bug"


# --- deepspeed/runtime/lr_schedules.py ------------------------------------------------------------------------------

def update_lr(param_groups, lrs):
    for param_group, lr in zip(param_groups, lrs):
        if _variant == "fix":
            if is_tensor(param_group['lr']):
                lr = lr.squeeze() if is_tensor(lr) else lr
                param_group['lr'].fill_(lr)
            else:
                param_group['lr'] = lr
            continue
        # new LR should match the type of current LR for scalar and Tensor LR support
        if is_tensor(param_group['lr']):
            lr = tensor([lr], device=param_group['lr'].device)
        param_group['lr'] = lr
    return [group['lr'] for group in param_groups]


class WarmupLR(object):
    """Increase the learning rate of each parameter group from min lr to max lr over warmup_num_steps steps."""

    def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps=1000,
                 warmup_type=WARMUP_LINEAR_RATE, last_batch_iteration=-1):
        self.optimizer = optimizer                                   # get_torch_optimizer(optimizer)
        self.min_lrs = self._format_param(self.optimizer, warmup_min_lr)
        self.max_lrs = self._format_param(self.optimizer, warmup_max_lr)
        self.delta_lrs = [big - small for big, small in zip(self.max_lrs, self.min_lrs)]
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:                               # Initialize lr in optimizer
            self._last_lr = update_lr(self.optimizer.param_groups, self.get_lr())

    def get_lr(self):
        if self.last_batch_iteration < 0:
            return self.min_lrs
        gamma = self._get_gamma()
        return [min_lr + (delta_lr * gamma) for min_lr, delta_lr in zip(self.min_lrs, self.delta_lrs)]

    def step(self, last_batch_iteration=None):
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = update_lr(self.optimizer.param_groups, self.get_lr())

    def _get_gamma(self):
        if self.last_batch_iteration < self.warmup_num_steps:
            if self.warmup_type == WARMUP_LINEAR_RATE:
                return self.last_batch_iteration / self.warmup_num_steps
            return self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
        return 1.0

    def _format_param(self, optimizer, param_value):
        if isinstance(param_value, (list, tuple)):
            return list(param_value)
        return [param_value] * len(optimizer.param_groups)


# --- torch.optim.Adam(capturable=True), single-tensor path with a tensor lr (reduced) ----------------------------------

class Adam:
    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-8, capturable=True):
        self.param_groups = [dict(params=list(params), lr=lr, betas=betas, eps=eps, capturable=capturable)]
        self.state = {}

    def _init_group(self, group):
        for p in group['params']:
            state = self.state.setdefault(id(p), {})
            if not state:                                            # capturable: step lives on the device
                state['step'] = torch.zeros((), dtype=torch.float32, device=p.device)
                state['exp_avg'] = torch.zeros_like(p)
                state['exp_avg_sq'] = torch.zeros_like(p)

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            self._init_group(group)
            beta1, beta2 = group['betas']
            lr, eps = group['lr'], group['eps']                      # lr: a device tensor, read by the kernels
            for p in group['params']:
                state = self.state[id(p)]
                step_t, exp_avg, exp_avg_sq = state['step'], state['exp_avg'], state['exp_avg_sq']
                grad = p.grad
                step_t += 1
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                bias_correction1 = 1 - torch.pow(beta1, step_t)
                bias_correction2 = 1 - torch.pow(beta2, step_t)
                step_size = lr / bias_correction1
                step_size_neg = step_size.neg()
                bias_correction2_sqrt = bias_correction2.sqrt()
                denom = (exp_avg_sq.sqrt() / (bias_correction2_sqrt * step_size_neg)).add_(eps / step_size_neg)
                p.addcdiv_(exp_avg, denom)


# --- the user's training loop ---------------------------------------------------------------------------------------------

def make_data(device):
    gen = generator(8202)
    w0 = randn(IN, OUT, gen=gen, device=device, scale=0.5)
    target = randn(IN, OUT, gen=gen, device=device)
    xs = [randn(BATCH, IN, gen=gen, device=device) for _ in range(STEPS)]
    return w0, [(x, x @ target) for x in xs]


def least_squares_grad(w, x, y):
    return 2.0 * x.T @ (x @ w - y) / x.shape[0]


def train(device, graphed):
    w0, batches = make_data(device)
    weight = w0.clone()
    weight.grad = torch.zeros_like(weight)                           # static .grad (zero_grad(set_to_none=False))
    optimizer = Adam([weight], lr=torch.tensor(0.0, device=device), capturable=True)
    scheduler = WarmupLR(optimizer, warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=5,
                         warmup_type=WARMUP_LINEAR_RATE)
    g = outputs = None
    history = []
    for i, (x, y) in enumerate(batches):
        weight.grad.copy_(least_squares_grad(weight, x, y))
        if not graphed:
            optimizer.step()
        elif g is None:                                              # warm up one real step, then capture step()
            optimizer._init_group(optimizer.param_groups[0])
            state = optimizer.state[id(weight)]

            def opt_step():
                optimizer.step()
                return weight

            g, outputs = capture(opt_step, device=device, warmups=1, name="optimizer.step",
                                 owner="captured optimizer.step()",
                                 static={"weight.grad": weight.grad, "param_groups[0]['lr']":
                                         optimizer.param_groups[0]['lr']},
                                 state={"weight": weight, **{k: v for k, v in state.items()}})
        else:
            replay(g, outputs)
        scheduler.step()
        history.append(weight.detach().clone())
    return history


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    return compare(__name__.rsplit(".", 1)[-1], variant, device,
                   lambda: train(device, graphed=True), lambda: train(device, graphed=False))
