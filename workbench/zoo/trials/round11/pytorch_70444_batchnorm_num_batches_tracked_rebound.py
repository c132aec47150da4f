"""BatchNorm rebinds ``num_batches_tracked`` to a new tensor each call: a captured step reads the freed original.

Upstream: https://github.com/pytorch/pytorch/pull/70444 ("[CUDA graphs] Changes batchnorm to increment
num_batches_tracked in place for improved graph safety").
Symptom: a training step captured whole (forward with ``nn.BatchNorm*`` in training mode, backward,
optimizer step) replays with an illegal memory access, or silently stops counting
``num_batches_tracked`` (it stays at its capture-time value + 1 in the checkpoint), or corrupts it with
whatever the caching allocator later put in the freed block, depending on allocation patterns
(PyTorch 1.10, December 2021; "ask me how I know" in the PR). This program on an H200: the counter
comes back as 1067753108 (another tensor's bytes) where eager counts 5.
Mechanism: ``_BatchNorm.forward`` counted batches with
``self.num_batches_tracked = self.num_batches_tracked + 1``. Run inside a capture, the add is recorded
reading the eagerly allocated counter and writing a new tensor from the graph's pool, and the Python
assignment (run once, at capture) replaces the module's buffer with that new tensor. The module held the
only reference to the old counter, so it is freed as soon as the capture rebinds it, yet every replay's
add still reads its address. The buffer the module now exposes is only ever written as "freed block + 1".
Doctor: dangling-reference, at ``forward`` (the captured ``num_batches_tracked + 1`` reads the counter
tensor that the rebinding released).
Fix (upstream): ``self.num_batches_tracked.add_(1)``: the counter is incremented in place, so the graph
reads and writes the module's own long-lived buffer.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/pytorch/pull/70444"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "forward"
SYMPTOM = "graphed BatchNorm training reads a freed num_batches_tracked: the counter stops or is corrupted"
BATCH, D_IN, D_HID, STEPS, LR = 6, 4, 3, 5, 0.1


class _BatchNorm(torch.nn.Module):
    """``torch.nn.modules.batchnorm._BatchNorm`` (1D, affine, tracking running stats, momentum 0.1)."""

    def __init__(self, num_features, device, eps=1e-5, momentum=0.1, in_place_count=False):
        super().__init__()
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.track_running_stats = True
        self.in_place_count = in_place_count
        self.weight = torch.nn.Parameter(torch.ones(num_features, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(num_features, device=device))
        self.register_buffer("running_mean", torch.zeros(num_features, device=device))
        self.register_buffer("running_var", torch.ones(num_features, device=device))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long, device=device))

    def forward(self, input):
        if self.momentum is None:
            exponential_average_factor = 0.0
        else:
            exponential_average_factor = self.momentum

        if self.training and self.track_running_stats:
            # TODO: if statement only here to tell the jit to skip emitting this when it is None
            if self.num_batches_tracked is not None:
                if self.in_place_count:
                    self.num_batches_tracked.add_(1)
                else:
                    self.num_batches_tracked = self.num_batches_tracked + 1
                if self.momentum is None:  # use cumulative moving average
                    exponential_average_factor = 1.0 / float(self.num_batches_tracked)
                else:  # use exponential moving average
                    exponential_average_factor = self.momentum

        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        # F.batch_norm(input, running_mean, running_var, weight, bias, bn_training, factor, eps), through
        # the aten op whose schema marks the in-place running-stats update (native_batch_norm's does not)
        return torch.ops.aten._native_batch_norm_legit(input, self.weight, self.bias, self.running_mean,
                                                       self.running_var, bn_training,
                                                       exponential_average_factor, self.eps)[0]


class Model(torch.nn.Module):
    def __init__(self, device, in_place_count):
        super().__init__()
        gen = generator(70444)
        self.fc1 = torch.nn.Parameter(randn(D_IN, D_HID, gen=gen, device=device, scale=0.5))
        self.bn = _BatchNorm(D_HID, device, in_place_count=in_place_count)
        self.fc2 = torch.nn.Parameter(randn(D_HID, 1, gen=gen, device=device, scale=0.5))

    def forward(self, x):
        return torch.relu(self.bn(x @ self.fc1)) @ self.fc2


def train_step(model, x, y):
    """Forward, backward, SGD: what the whole-network capture records."""
    for p in model.parameters():
        p.grad = None                       # backward allocates .grad (in the graph's pool at capture)
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(p.grad, alpha=-LR)
    return loss.detach()


def run(variant: str, device: str = "cpu"):
    gen = generator(1)
    batches = [(randn(BATCH, D_IN, gen=gen, device=device), randn(BATCH, 1, gen=gen, device=device))
               for _ in range(STEPS)]
    in_place_count = variant == "fix"

    def state(model):
        bn = model.bn
        return [p.detach().clone() for p in model.parameters()] + [
            bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone()]

    def eager():
        model = Model(device, in_place_count)
        losses = [train_step(model, x, y) for x, y in batches]
        return losses[1:] + state(model)

    def served():
        model = Model(device, in_place_count)
        static_x, static_y = batches[0][0].clone(), batches[0][1].clone()
        # the warmup is the first real step (batch 0); then the whole step is captured. A replay that
        # reads the freed counter raises IllegalMemoryAccess on the CPU (an IMA or garbage on a GPU)
        g, static_loss = capture(lambda: train_step(model, static_x, static_y), device=device,
                                 static={"x": static_x, "y": static_y},
                                 state={"running_mean": model.bn.running_mean, "running_var": model.bn.running_var,
                                        **dict(model.named_parameters())},
                                 owner="whole-network capture (fwd+bwd+SGD)")
        losses = []
        for x, y in batches[1:]:
            static_x.copy_(x)
            static_y.copy_(y)
            losses.append(replay(g, static_loss).clone())
        return losses + state(model)

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
