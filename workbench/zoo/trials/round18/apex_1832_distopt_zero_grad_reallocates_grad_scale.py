"""``DistributedFusedAdam.zero_grad`` reallocates ``_grad_scale``: the captured step keeps the released one.

Upstream: https://github.com/NVIDIA/apex/pull/1832 ("Enhance Distributed Fused Adam": "Support CUDA graph
for distributed fused adam", commit "Make sure key pointers are valid.").
Symptom: ``DistributedFusedAdam(capturable=True)`` with its step in a CUDA graph and ``zero_grad`` run
between replays trained on wrong update sizes (garbage or compounded gradient scales) instead of matching
the eager optimizer (apex 24.04 era, Aug 2024).
Mechanism: the capturable step's kernels (``multi_tensor_fused_adam_capturable``, the ``unscale_grads``
multiply, the found-inf flag) take ``self._grad_scale`` and ``self._dummy_overflow_buf`` by address.
``zero_grad`` ("Reset other state") rebinds both to fresh tensors: ``self._grad_scale = torch.full([],
1.0, ...)`` and ``self._dummy_overflow_buf = torch.zeros([1], ...)``. Eagerly that is a reset; with the
step captured, the graph still reads and writes the tensors of the capture, which the rebinding released:
replays scale the gradients by whatever now lives there (the old scale is never reset to 1, or the block
holds another tensor's bytes), and the Adam update diverges from eager.
Doctor: dangling-reference, at ``zero_grad`` (the captured ``_grad_scale`` released by the rebinding).
Fix (upstream): reset in place, ``self._grad_scale.fill_(1.0)`` and ``self._dummy_overflow_buf.zero_()``,
so the addresses the graph holds stay the optimizer's live state.
"""
from __future__ import annotations

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/apex/pull/1832"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "zero_grad"
SYMPTOM = "graph-replayed Adam steps scale gradients by a released _grad_scale; parameters drift from eager"
BATCH, LAYER = 3, 4
LOSS_SCALE = 128.0
NUM_STEPS = 5


class DistributedFusedAdam:
    """One rank's view: one bucket of params / grads / Adam moments, capturable (device lr and step)."""

    def __init__(self, param, lr, device, variant, betas=(0.9, 0.999), eps=1e-8):
        self.variant = variant
        self.device = device
        self.param = param
        self.betas, self.eps = betas, eps
        self.lr = torch.tensor(lr, dtype=torch.float32, device=device)   # capturable: LR on device
        self.state = {"step": torch.tensor([0], dtype=torch.int, device=device)}
        self.params_bucket = param.detach().view(-1)                     # params are views into the bucket
        self.grads_bucket = torch.zeros_like(self.params_bucket)
        self.exp_avg = torch.zeros_like(self.params_bucket)
        self.exp_avg_sq = torch.zeros_like(self.params_bucket)
        self._grad_scale = torch.full([], 1.0, dtype=torch.float32, device=device)
        self._grad_norm = None
        self._dummy_overflow_buf = torch.zeros([1], dtype=torch.int32, device=device)

    def zero_grad(self):
        self.grads_bucket.zero_()
        # Reset other state
        if self.variant == "fix":
            self._grad_scale.fill_(1.0)
            self._grad_norm = None
            self._dummy_overflow_buf.zero_()
        else:
            self._grad_scale = torch.full([], 1.0, dtype=torch.float32, device=self.device)
            self._grad_norm = None
            self._dummy_overflow_buf = torch.zeros([1], dtype=torch.int32, device=self.device)

    def _grad_copy(self, grad):
        self.grads_bucket.add_(grad.view(-1))

    def unscale_grads(self, inv_scale):
        self._grad_scale *= inv_scale.view([])

    def step(self):
        # capturable: the found-inf flag and the step count stay on device
        found_inf = torch.logical_not(torch.isfinite(self.grads_bucket * self._grad_scale).all())
        self._dummy_overflow_buf.copy_(found_inf.to(torch.int32).view(1))
        self.state["step"] += (self._dummy_overflow_buf != 1).to(torch.int)
        self._local_step()

    def _local_step(self):
        """``multi_tensor_fused_adam_capturable``: grads are scaled by ``_grad_scale`` in the kernel."""
        beta1, beta2 = self.betas
        g = self.grads_bucket * self._grad_scale
        self.exp_avg.mul_(beta1).add_(g * (1 - beta1))
        self.exp_avg_sq.mul_(beta2).add_(g * g * (1 - beta2))
        step = self.state["step"].to(torch.float32)
        m_hat = self.exp_avg / (1 - beta1 ** step)
        v_hat = self.exp_avg_sq / (1 - beta2 ** step)
        self.params_bucket.sub_(self.lr * m_hat / (v_hat.sqrt() + self.eps))


def run(variant: str, device: str = "cpu"):
    gen = generator(1832)
    w0 = randn(LAYER, LAYER, gen=gen, device=device)
    data = [(randn(BATCH, LAYER, gen=gen, device=device), randn(BATCH, LAYER, gen=gen, device=device))
            for _ in range(NUM_STEPS)]
    inv_scale = torch.tensor([1.0 / LOSS_SCALE], device=device)

    def train(graphed: bool):
        weight = w0.clone()
        dist_optim = DistributedFusedAdam(weight, lr=0.05, device=device, variant=variant)
        static_x = torch.zeros(BATCH, LAYER, device=device)
        static_dy = torch.zeros(BATCH, LAYER, device=device)

        def train_step():
            y = static_x @ weight                                   # forward
            grad_w = static_x.t() @ (static_dy * LOSS_SCALE)        # backward of (y * dy).sum() * loss scale
            dist_optim._grad_copy(grad_w)
            dist_optim.unscale_grads(inv_scale)
            dist_optim.step()
            return y

        outs, g, y_out = [], None, None
        for step, (x, dy) in enumerate(data):
            static_x.copy_(x)
            static_dy.copy_(dy)
            dist_optim.zero_grad()
            if not graphed:
                y = train_step()
            elif step == 0:                                         # eager iterations before the capture
                with events.warmup(real=True):
                    y = train_step()
            else:
                if g is None:
                    g, y_out = capture(train_step, device=device, warmups=0, on_freed="reuse",
                                       static={"x": static_x, "dy": static_dy},
                                       state={"params_bucket": dist_optim.params_bucket,
                                              "grads_bucket": dist_optim.grads_bucket,
                                              "exp_avg": dist_optim.exp_avg, "exp_avg_sq": dist_optim.exp_avg_sq,
                                              "step": dist_optim.state["step"]},
                                       owner="training loop (DistributedFusedAdam step graph)")
                y = replay(g, y_out)
            outs += [y.clone(), weight.clone()]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: train(True), lambda: train(False))
