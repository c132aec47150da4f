"""The per-step token count reaches the CUDA-graphed train step as a Python float: replay keeps the capture's.

Upstream: https://github.com/pytorch/torchtitan/pull/4099 ("Keep global valid token counts on
device": "This is needed for cudagraphs as the value of global valid token counts changes each
iteration and needs to be part of the graph"); the hazard came in with
https://github.com/pytorch/torchtitan/pull/2876 ("Accept float inputs in CUDAGraphWrapper": "Float
inputs are treated as static constants baked into the graph at recording time (they are not in
``_input_indices_to_copy``, so they won't be updated on replay)").
Symptom: graph_trainer (aot_fx_trace + cudagraph pass) normalises every replayed step's loss and
gradients by the number of valid (non-ignored) tokens of the step it recorded; with padding/ignored
labels that count changes every step, so loss and gradients are off by count_now / count_recorded
(torchtitan main, April-August 2026).
Mechanism: ``train_step`` computes ``global_valid_tokens = float(local_valid_tokens.item())`` on the host
and passes it to the traced forward-backward step, whose loss does ``loss / global_valid_tokens``. The
CUDAGraphWrapper copies only tensor arguments into its static inputs before each replay; a float is
accepted and used as the kernel's scalar at recording time. Every replay divides by the recorded
step's count.
Doctor: host-work-frozen, at ``__call__`` (of ``CrossEntropyLoss``: the division by the Python scalar).
Fix (upstream): keep the count a device scalar tensor (``local_valid_tokens.to(device)`` /
``dist_sum_tensor``), so it is a tensor input the wrapper copies before every replay.
"""
from __future__ import annotations

import torch

from workbench.engine import CUDAGraphMode, GraphManager, events
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/pytorch/torchtitan/pull/4099"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "__call__"
SYMPTOM = "replayed steps divide loss and grads by the recorded step's valid-token count"
VOCAB, DIM, BATCH, SEQ, IGNORE_INDEX = 6, 4, 8, 3, -100


class Decoder(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        gen = generator(4099)
        self.tok_embeddings = torch.nn.Parameter(randn(VOCAB, DIM, gen=gen, device=device))
        self.output = torch.nn.Parameter(randn(DIM, VOCAB, gen=gen, device=device, scale=0.5))

    def forward(self, tokens):
        return torch.tanh(self.tok_embeddings[tokens]) @ self.output


class CrossEntropyLoss:
    """Cross-entropy with sum reduction, normalised by the global count of valid tokens."""

    def __call__(self, pred, labels, global_valid_tokens=None):
        loss = torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1),
                                                 reduction="sum", ignore_index=IGNORE_INDEX)
        if global_valid_tokens is not None:
            loss = loss / global_valid_tokens
        return loss, {}


def make_fwd_bwd_step(model, loss_fn):
    params = list(model.parameters())

    def fwd_bwd_step(inputs, labels, global_valid_tokens):
        loss, _ = loss_fn(model(inputs), labels, global_valid_tokens)
        grads = torch.autograd.grad(loss, params)
        return (loss.detach().reshape(1), *grads)       # outputs are row-sliced by the manager

    return fwd_bwd_step


class CUDAGraphWrapper:
    """graph_trainer's wrapper: the first call warms up (a real step), the second records with its
    own arguments as the static inputs, every call copies the tensor arguments in and replays.
    Non-tensor arguments (ints, floats) are not copied: they are what recording saw."""

    def __init__(self, runnable, example_inputs, device):
        self._runnable = runnable
        self._input_indices_to_copy = [i for i, a in enumerate(example_inputs) if isinstance(a, torch.Tensor)]
        self._device = device
        self._has_warmup = False
        self._manager = None
        self._args = None
        self._call_args = None

    def _step(self, size):
        # the step on the static tensors (and this call's other arguments): what capture records and
        # what an eager run of this step computes
        args = [self._args[i] if i in self._input_indices_to_copy else a for i, a in enumerate(self._call_args)]
        return self._runnable(*args)

    def _copy_non_static_inputs(self, *args):
        for i in self._input_indices_to_copy:
            self._args[i].copy_(args[i])

    def __call__(self, *args):
        self._call_args = args
        if not self._has_warmup:
            self._has_warmup = True
            with events.warmup(real=True):           # a real training step, its grads are used
                return self._runnable(*args)
        if self._manager is None:
            self._args = args
            names = ("inputs", "labels", "global_valid_tokens")
            static = {names[i]: args[i] for i in self._input_indices_to_copy}
            self._manager = GraphManager(self._step, [BATCH], device=self._device, mode=CUDAGraphMode.FULL,
                                         num_warmups=0, static_buffers=static, grad=True,
                                         name="graph_trainer CUDAGraphWrapper")
            self._manager.capture()
        self._copy_non_static_inputs(*args)
        return self._manager.replay(BATCH, BATCH)


def accumulate_param_grads_(params, grads):
    for p, g in zip(params, grads):
        if p.grad is None:
            p.grad = g.detach().clone()
        else:
            p.grad.add_(g)


def batches(device):
    """Token ids and labels per step; ignored labels differ per step, so the valid count does too."""
    gen = generator(7)
    out = []
    for n_ignored in (0, 5, 9, 2, 13):
        inputs = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        labels.view(-1)[torch.randperm(BATCH * SEQ, generator=gen)[:n_ignored]] = IGNORE_INDEX
        out.append((inputs.to(device), labels.to(device)))
    return out


def run(variant: str, device: str = "cpu"):
    data = batches(device)

    def train(graphed: bool):
        model = Decoder(device)
        params = list(model.parameters())
        optimizer = torch.optim.SGD(params, lr=0.5, foreach=False)
        step_fn = make_fwd_bwd_step(model, CrossEntropyLoss())
        wrapper = None
        outs = []
        for inputs, labels in data:
            # train_step: count this step's valid tokens
            local_valid_tokens = (labels != IGNORE_INDEX).sum()
            if variant == "bug":
                global_valid_tokens = float(local_valid_tokens.item())
            else:
                global_valid_tokens = local_valid_tokens.to(device)
            args = (inputs.clone(), labels.clone(), global_valid_tokens)     # this step's batch
            if graphed:
                if wrapper is None:
                    wrapper = CUDAGraphWrapper(step_fn, args, device)
                outputs = wrapper(*args)
            else:
                outputs = step_fn(*args)
            loss, grads = outputs[0], outputs[1:]
            optimizer.zero_grad(set_to_none=True)
            accumulate_param_grads_(params, grads)
            outs.append(loss.clone())
            optimizer.step()
            outs += [p.detach().clone() for p in params]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: train(True), lambda: train(False))
