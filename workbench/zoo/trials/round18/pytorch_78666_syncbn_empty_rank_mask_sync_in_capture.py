"""SyncBatchNorm drops empty ranks' stats with a boolean mask: a host synchronisation inside graph capture.

Upstream: https://github.com/pytorch/pytorch/pull/78666 ("Avoid CPU Sync in SyncBatchNorm When Capturing
CUDA Graphs"; fixes pytorch/pytorch#78549, "https://github.com/pytorch/pytorch/pull/74944 breaks CUDA graph
capture").
Symptom: MLPerf training scripts that capture a whole training step (forward with ``nn.SyncBatchNorm``)
into a CUDA graph fail at capture with ``RuntimeError: CUDA error: operation not permitted when stream is
capturing`` raised from ``count_all = count_all[mask]`` in ``torch/nn/modules/_functions.py``; the same
step runs eagerly. Regression in the PyTorch 1.12 release candidates (May 2022); before #74944 SyncBN was
capture-safe.
Mechanism: #74944 taught ``SyncBatchNorm.forward`` to tolerate ranks with an empty batch: after the
all-gather of every rank's (mean, invstd, count) it builds ``mask = count_all.squeeze(-1) >= 1`` and
keeps only those rows with ``count_all[mask]`` (and the same for mean/invstd). Boolean-mask indexing has
an output shape that depends on the mask's values, so the host must wait for the device
(``nonzero`` + a device-to-host copy): during stream capture that synchronisation is illegal, and the
capture is invalidated.
Doctor: sync-in-capture, at ``forward`` (``SyncBatchNorm.forward``'s ``count_all[mask]``): a host
synchronisation attempted while the graph is being captured.
Fix (upstream): run the empty-rank filtering only when ``not torch.cuda.is_current_stream_capturing()``;
a captured step keeps every rank's row (graph users never have empty batches), eager steps still drop
empty ranks.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/pytorch/pull/78666"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "forward"
SYMPTOM = "capturing a training step with SyncBatchNorm fails: count_all[mask] synchronises with the host"
ROWS, CHANNELS, STEPS, WORLD_SIZE, RANK = 6, 3, 4, 2, 0
EPS, MOMENTUM = 1e-5, 0.1


class ProcessGroup:
    """Two data-parallel ranks; this process is rank 0. ``peer_combined`` is the receive buffer NCCL
    fills with rank 1's (mean, invstd, count) row during the all-gather."""

    def __init__(self, device):
        self.peer_combined = torch.zeros(2 * CHANNELS + 1, device=device)


def all_gather(combined_list, combined, process_group):
    """``dist.all_gather`` for the two ranks: our row, and the peer's from the receive buffer."""
    combined_list[RANK].copy_(combined)
    combined_list[1 - RANK].copy_(process_group.peer_combined)


def batch_norm_stats(input, eps):
    mean = input.mean(0)
    invstd = torch.rsqrt(input.var(0, unbiased=False) + eps)
    return mean, invstd


def batch_norm_gather_stats_with_counts(input, mean_all, invstd_all, running_mean, running_var, momentum,
                                        eps, counts):
    """Global mean/invstd from the per-rank stats weighted by their counts; updates the running stats."""
    counts = counts.view(-1, 1)
    total = counts.sum()
    mean = (mean_all * counts).sum(0) / total
    var_all = invstd_all.pow(-2) - eps
    var = ((var_all + mean_all * mean_all) * counts).sum(0) / total - mean * mean
    running_mean.mul_(1 - momentum).add_(mean * momentum)
    running_var.mul_(1 - momentum).add_(var * (total / (total - 1)) * momentum)
    return mean, torch.rsqrt(var + eps)


class SyncBatchNorm:
    """``torch.nn.modules._functions.SyncBatchNorm`` (forward only: the captured step's forward)."""

    def __init__(self, variant: str):
        self.variant = variant

    def forward(self, input, weight, bias, running_mean, running_var, eps, momentum, process_group, world_size):
        num_channels = input.shape[1]
        # calculate mean/invstd for input.
        mean, invstd = batch_norm_stats(input, eps)
        count = torch.full((1,), input.numel() // input.size(1), dtype=mean.dtype, device=mean.device)

        # all gathered mean, invstd and count
        combined = torch.cat([mean, invstd, count], dim=0)
        combined_list = [torch.empty_like(combined) for _ in range(world_size)]
        all_gather(combined_list, combined, process_group)
        combined = torch.stack(combined_list, dim=0)
        mean_all, invstd_all, count_all = torch.split(combined, num_channels, dim=1)

        if self.variant == "bug" or not torch.cuda.is_current_stream_capturing():
            # The lines below force a synchronization between CUDA and CPU, because the shape of the
            # result count_all depends on the values in mask tensor. Such synchronizations break CUDA
            # Graph capturing (the fix runs them only when not capturing).
            # remove stats from empty inputs
            mask = count_all.squeeze(-1) >= 1
            count_all = count_all[mask]
            mean_all = mean_all[mask]
            invstd_all = invstd_all[mask]

        # calculate global mean & invstd
        mean, invstd = batch_norm_gather_stats_with_counts(input, mean_all, invstd_all, running_mean,
                                                           running_var, momentum, eps, count_all.view(-1))
        return (input - mean) * invstd * weight + bias


def run(variant: str, device: str = "cpu"):
    gen = generator(78666)
    weight = randn(CHANNELS, gen=gen, device=device, scale=0.5) + 1
    bias = randn(CHANNELS, gen=gen, device=device, scale=0.5)
    batches = [randn(ROWS, CHANNELS, gen=gen, device=device, scale=2.0) for _ in range(STEPS)]
    peer_batches = [randn(ROWS + 2, CHANNELS, gen=gen, device=device) + 1 for _ in range(STEPS)]

    def peer_stats(step):
        """What rank 1 contributes at ``step`` (its own batch's stats, delivered by NCCL)."""
        mean, invstd = batch_norm_stats(peer_batches[step], EPS)
        count = torch.full((1,), peer_batches[step].shape[0], dtype=mean.dtype, device=mean.device)
        return torch.cat([mean, invstd, count])

    def setup():
        bn = SyncBatchNorm(variant)
        running_mean = torch.zeros(CHANNELS, device=device)
        running_var = torch.ones(CHANNELS, device=device)
        return bn, running_mean, running_var, ProcessGroup(device)

    def eager():
        bn, running_mean, running_var, group = setup()
        outs = []
        for step, x in enumerate(batches):
            group.peer_combined.copy_(peer_stats(step))
            outs.append(bn.forward(x, weight, bias, running_mean, running_var, EPS, MOMENTUM, group, WORLD_SIZE))
        return outs[1:] + [running_mean.clone(), running_var.clone()]

    def served():
        bn, running_mean, running_var, group = setup()
        x_buf = batches[0].clone()
        group.peer_combined.copy_(peer_stats(0))
        # whole-step capture: the warmup iteration is the first real step (batch 0), then capture
        g, out = capture(lambda: bn.forward(x_buf, weight, bias, running_mean, running_var, EPS, MOMENTUM, group,
                                            WORLD_SIZE),
                         device=device, static={"input": x_buf, "peer_combined": group.peer_combined},
                         state={"running_mean": running_mean, "running_var": running_var},
                         owner="training loop (SyncBatchNorm step)")
        outs = []
        for step in range(1, STEPS):
            x_buf.copy_(batches[step])
            group.peer_combined.copy_(peer_stats(step))
            outs.append(replay(g, out).clone())
        return outs + [running_mean.clone(), running_var.clone()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
