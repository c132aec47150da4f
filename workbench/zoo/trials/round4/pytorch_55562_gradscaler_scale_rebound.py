"""GradScaler.update() rebinds ``_scale`` to a new tensor: the captured backward keeps the freed one.

Upstream: https://github.com/pytorch/pytorch/pull/55562 ("[CUDA graphs] [BC-breaking] Makes
torch.cuda.amp.GradScaler scale updates in-place for better composability with graph capture").
Symptom: capturing forward + ``scaler.scale(loss).backward()`` in one graph and running
``scaler.step(optimizer); scaler.update()`` eagerly after each replay does not work: after the first
update the replayed backward scales the loss by a tensor the scaler no longer owns (PyTorch 1.8,
April 2021); on a GPU the gradients come out scaled by whatever the caching allocator put in that
block, while ``unscale_`` divides by the new scale.
Mechanism: ``scale()`` multiplies the loss by ``self._scale``, so the capture records a kernel that
reads that tensor's address. ``update()`` computed the next scale out of place
(``self._scale = torch._amp_update_scale(...)``), which drops the scaler's only reference to the
captured tensor and frees it. Every later replay reads the released block, while ``unscale_`` (eager)
divides the gradients by the new scale.
Doctor: dangling-reference, at ``scale`` (the captured multiply that reads the released scale tensor).
Fix (upstream): ``update()`` acts in place on a long-lived scale tensor (``torch._amp_update_scale_``,
``_scale.fill_``/``copy_`` for a user-given scale), so the captured address stays the scale.
"""
from __future__ import annotations

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/pytorch/pull/55562"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "scale"
SYMPTOM = "after the first scaler.update() the replayed backward scales the loss by a freed tensor"
D_IN, D_OUT, BATCH, STEPS, WARMUPS = 4, 3, 5, 4, 2


def _amp_update_scale(growth_tracker, current_scale, found_inf, growth_factor, backoff_factor, growth_interval):
    """PyTorch 1.8's out-of-place ``torch._amp_update_scale``: the next scale is a new tensor (the
    growth tracker is still updated in place)."""
    new_scale = current_scale.clone()
    torch._amp_update_scale_(new_scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval)
    return new_scale


class GradScaler:
    """The part of ``torch.cuda.amp.GradScaler`` that the captured pattern uses (single device)."""

    def __init__(self, init_scale=16.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=1,
                 in_place_update=False):
        self._init_scale = init_scale
        self._growth_factor = growth_factor
        self._backoff_factor = backoff_factor
        self._growth_interval = growth_interval
        self._in_place_update = in_place_update
        self._scale = None
        self._growth_tracker = None
        self._found_inf = None

    def _lazy_init_scale_growth_tracker(self, dev):
        self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=dev)
        self._growth_tracker = torch.full((), 0, dtype=torch.int32, device=dev)

    def scale(self, outputs):
        if self._scale is None:
            self._lazy_init_scale_growth_tracker(outputs.device)
        return outputs * self._scale.to(device=outputs.device, non_blocking=True)

    def unscale_(self, optimizer):
        inv_scale = self._scale.double().reciprocal().float()
        found_inf = torch.full((), 0.0, dtype=torch.float32, device=self._scale.device)
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        self._found_inf = found_inf

    def step(self, optimizer):
        self.unscale_(optimizer)
        if not self._found_inf.item():
            optimizer.step()

    def update(self):
        if self._in_place_update:
            torch._amp_update_scale_(self._scale, self._growth_tracker, self._found_inf, self._growth_factor,
                                     self._backoff_factor, self._growth_interval)
        else:
            self._scale = _amp_update_scale(self._growth_tracker, self._scale, self._found_inf, self._growth_factor,
                                            self._backoff_factor, self._growth_interval)
        self._found_inf = None


class Model(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        gen = generator(55562)
        self.weight = torch.nn.Parameter(randn(D_IN, D_OUT, gen=gen, device=device, scale=0.5))

    def forward(self, x):
        return torch.tanh(x @ self.weight)


def loss_fn(pred, target):
    return ((pred - target) ** 2).mean()


def run(variant: str, device: str = "cpu"):
    gen = generator(1)
    batches = [(randn(BATCH, D_IN, gen=gen, device=device), randn(BATCH, D_OUT, gen=gen, device=device, scale=0.5))
               for _ in range(STEPS)]

    def setup():
        model = Model(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
        return model, opt, GradScaler(in_place_update=(variant == "fix"))

    def eager():
        model, opt, scaler = setup()
        outs = []
        for x, t in batches:
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), t)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            outs += [loss.detach().clone(), model.weight.detach().clone()]
        return outs

    def served():
        model, opt, scaler = setup()
        static_input, static_target = batches[0][0].clone(), batches[0][1].clone()

        def fwd_bwd():
            loss = loss_fn(model(static_input), static_target)
            scaler.scale(loss).backward()
            return loss.detach()

        owner = "whole fwd+bwd capture with GradScaler"
        events.static_buffers(owner, {"input": static_input, "target": static_target})
        for _ in range(WARMUPS):                       # warmup iterations on the static (dummy) batch
            with events.warmup():
                opt.zero_grad(set_to_none=True)
                fwd_bwd()
        opt.zero_grad(set_to_none=True)                # backward() allocates .grad in the graph's pool
        g, static_loss = capture(fwd_bwd, device=device, warmups=0, name="fwd+bwd", owner=owner,
                                 on_freed="reuse")     # the caching allocator hands a freed block on
        outs = []
        for x, t in batches:
            static_input.copy_(x)
            static_target.copy_(t)
            outs.append(replay(g, static_loss).clone())
            scaler.step(opt)                            # eager: unscale_ by the current scale, SGD step
            scaler.update()
            outs.append(model.weight.detach().clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
