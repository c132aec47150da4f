"""``clip_grad_norm_`` branches on the device-side norm: a whole-step CUDA graph capture hits a host sync.

Upstream: https://github.com/pytorch/pytorch/pull/61042 ("torch.nn.utils.clip_grad_norm_: remove device
syncs", fixes pytorch/pytorch#60691 "clip_grad_norm_: bad GPU utilization due to GPU-data-dependent
control-flow").
Symptom: in PyTorch 1.9 (mid 2021), ``clip_grad_norm_`` synchronised the host with the GPU on every
call, twice. The issue reported the lost GPU utilisation. The same two syncs make a training step that
clips its gradients uncapturable: capturing forward, backward, ``clip_grad_norm_`` and the optimizer
step in one graph (the whole-network pattern from the CUDA graphs docs) fails inside
``clip_grad_norm_`` with ``cudaErrorStreamCaptureUnsupported``. Eager training works.
Mechanism: the norm is a device tensor, and 1.9 branched on it in Python:
``if total_norm.isnan() or total_norm.isinf():`` (for a warning, even with
``error_if_nonfinite=False``) and ``if clip_coef < 1:``. Each ``bool()`` of a device tensor copies
the value to the host and waits for it, which a stream under capture cannot do. (Even without that
error, a graph could keep only the branch taken at capture.)
Doctor: sync-in-capture, at ``clip_grad_norm_`` (the ``bool()`` of the device norm inside the capture).
Fix (upstream): check for non-finite norms only when ``error_if_nonfinite`` is set, and replace the
``if clip_coef < 1`` branch with ``clip_coef_clamped = torch.clamp(clip_coef, max=1.0)`` and an
unconditional multiply. The clip then stays on the device and can be captured.
"""
from __future__ import annotations

import warnings

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/pytorch/pull/61042"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "clip_grad_norm_"
SYMPTOM = "capturing a training step that calls clip_grad_norm_ fails with a host sync (1.9)"
ROWS, DIM, ITERS, LR, MAX_NORM = 8, 4, 5, 0.1, 0.5


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, *, remove_syncs=False):
    """``torch.nn.utils.clip_grad_norm_`` as of 1.9 (``remove_syncs=False``) and after #61042."""
    parameters = [p for p in parameters if p.grad is not None]
    max_norm = float(max_norm)
    norm_type = float(norm_type)
    device = parameters[0].grad.device
    total_norm = torch.norm(torch.stack([torch.norm(p.grad.detach(), norm_type).to(device) for p in parameters]),
                            norm_type)
    if remove_syncs:
        if error_if_nonfinite and torch.logical_or(total_norm.isnan(), total_norm.isinf()):
            raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite")
        clip_coef = max_norm / (total_norm + 1e-6)
        # Multiplying by the clamped coef is redundant when it is clamped to 1, but it avoids an
        # `if clip_coef < 1:` conditional, which needs a CPU <=> device synchronization.
        clip_coef_clamped = torch.clamp(clip_coef, max=1.0)
        for p in parameters:
            p.grad.detach().mul_(clip_coef_clamped.to(p.grad.device))
        return total_norm
    if total_norm.isnan() or total_norm.isinf():
        if error_if_nonfinite:
            raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite")
        warnings.warn("Non-finite norm encountered in torch.nn.utils.clip_grad_norm_; continuing anyway.",
                      FutureWarning, stacklevel=2)
    clip_coef = max_norm / (total_norm + 1e-6)
    if clip_coef < 1:
        for p in parameters:
            p.grad.detach().mul_(clip_coef.to(p.grad.device))
    return total_norm


class Model(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        gen = generator(61042)
        self.weight = torch.nn.Parameter(randn(DIM, 1, gen=gen, device=device))

    def forward(self, x):
        return x @ self.weight


def train_step(model, x, y, remove_syncs):
    """Forward, backward, gradient clipping and an SGD step: what the whole-network capture records."""
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    clip_grad_norm_(model.parameters(), MAX_NORM, remove_syncs=remove_syncs)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(p.grad, alpha=-LR)
    return loss.detach()


def run(variant: str, device: str = "cpu"):
    gen = generator(1)
    batches = [(randn(ROWS, DIM, gen=gen, device=device, scale=2.0), randn(ROWS, 1, gen=gen, device=device))
               for _ in range(ITERS)]
    remove_syncs = variant == "fix"

    def eager():
        model = Model(device)
        losses = []
        for x, y in batches:
            model.weight.grad = None
            losses.append(train_step(model, x, y, remove_syncs))
        return losses[1:] + [model.weight.detach().clone()]

    def served():
        model = Model(device)
        static_x, static_y = batches[0][0].clone(), batches[0][1].clone()

        def step():
            model.weight.grad = None          # backward allocates .grad (in the graph's pool at capture)
            return train_step(model, static_x, static_y, remove_syncs)

        # warmup: the first real step (batch 0) runs eagerly; then the whole step is captured
        g, static_loss = capture(step, device=device, warmups=1, static={"x": static_x, "y": static_y},
                                 state={"weight": model.weight}, owner="whole-network capture (fwd+bwd+clip+SGD)")
        losses = []
        for x, y in batches[1:]:
            static_x.copy_(x)
            static_y.copy_(y)
            losses.append(replay(g, static_loss).clone())
        return losses + [model.weight.detach().clone()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
