"""CudaGraphModule treats a Python-scalar argument, a constant baked into the graph, as a static input buffer.

Upstream: https://github.com/pytorch/tensordict/pull/1039 ("[BugFix] Compatibility with non-tensor inputs in
CudaGraphModule", commit 7e45bccff).
Symptom: a function wrapped by ``CudaGraphModule`` and called as ``func(x, 1.0)`` works through the warmup calls
and the capturing call, then fails at the first replay (``AttributeError: 'float' object has no attribute
'copy_'``); the new test ``test_td_input_non_tdmodule_nontensor`` calls ``func(torch.zeros(()), 1.0)`` ten times
and expects ``1.0`` each time (and a ``ValueError`` once the scalar changes to ``2.0``).
Mechanism: ``tensordict/nn/cudagraphs.py::CudaGraphModule`` (non-TensorDict path, the ``_call`` closure). Calls
``counter < warmup - 1`` run the module eagerly on ``tree_map(self._clone, ...)`` copies; the call at
``warmup - 1`` does ``self._args, self._kwargs = tree_map(self._check_device_and_clone, (args, kwargs))`` (which
passes non-tensor leaves through unchanged), runs the module once eagerly for its result and captures
``self.module(*self._args, **self._kwargs)`` into ``self.graph``. A Python float argument is no buffer: the
captured kernels hold its capture-time value as a constant. Every later call (``counter >= warmup``) refreshes the
"static inputs" with ``tree_map(lambda x, y: x.copy_(y, non_blocking=True), (self._args, self._kwargs), (args,
kwargs))`` over every pytree leaf, the float included, then ``self.graph.replay()``: the float leaf has no
``copy_``. Even a replay that got past it could only recompute with the capture-time scalar (the frozen host value).
Modelled with a softmax policy head ``policy(obs, temperature)`` called with a constant ``temperature``.
Doctor: host-work-frozen, at _call (the Python scalar became a constant of the captured kernels at capture; the
replay path assumes every input leaf is a device buffer it can refresh).
Fix (upstream): the capturing call stores ``self._flat_tree, self._tree_spec = tree_flatten((args, kwargs))``
(tensors cloned, other leaves kept) and rebuilds ``self._args, self._kwargs`` with ``tree_unflatten``; replay walks
``zip(tree_leaves((args, kwargs)), self._flat_tree)`` with ``_maybe_copy_onto_``: tensors are batched into
``torch._foreach_copy_(dests, srcs)``, tensor collections use ``dest.copy_(src)``, any other leaf is compared with
``src != dest`` and ``raise ValueError("Varying inputs must be torch.Tensor subclasses.")`` if it changed.
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

from workbench.engine import events, synchronize
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/tensordict/pull/1039"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "_call"
SYMPTOM = "first replay of a CudaGraphModule called with a Python float fails: 'float' object has no attribute 'copy_'"

OBS, ACTIONS, STEPS, WARMUP = 5, 4, 7, 2
TEMPERATURE = 0.5


class CudaGraphModule:
    """The non-TensorDict path of tensordict's ``CudaGraphModule`` (warmup, capture on call ``warmup``, replay)."""

    def __init__(self, module, variant, device, warmup=WARMUP):
        self.module, self.variant, self.device = module, variant, device
        self.counter = 0
        self._warmup = warmup

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def _call(self, *args, **kwargs):
        if self.counter >= self._warmup:
            if self.variant == "bug":
                tree_map(lambda x, y: x.copy_(y, non_blocking=True), (self._args, self._kwargs), (args, kwargs))
            else:
                srcs, dests = [], []
                for arg_src, arg_dest in zip(tree_leaves((args, kwargs)), self._flat_tree):
                    self._maybe_copy_onto_(arg_src, arg_dest, srcs, dests)
                if dests:
                    torch._foreach_copy_(dests, srcs)
            synchronize(self.device)
            result = replay(self.graph, self._out)
            return result.clone()                                  # self._return_unchanged == "clone"

        if self.counter < self._warmup - 1:
            args, kwargs = tree_map(self._clone, (args, kwargs))
            with events.warmup(real=True):
                out = self.module(*args, **kwargs)
            self.counter += 1
            return out

        if self.variant == "bug":
            args, kwargs = self._args, self._kwargs = tree_map(self._check_device_and_clone, (args, kwargs))
        else:
            self._flat_tree, self._tree_spec = tree_flatten((args, kwargs))
            self._flat_tree = tuple(self._check_device_and_clone(arg) for arg in self._flat_tree)
            args, kwargs = self._args, self._kwargs = tree_unflatten(self._flat_tree, self._tree_spec)
        synchronize(self.device)
        with events.warmup(real=True):
            this_out = self.module(*args, **kwargs)
        synchronize(self.device)
        static = {f"leaf{i}": t for i, t in enumerate(tree_leaves((self._args, self._kwargs)))
                  if isinstance(t, torch.Tensor)}
        self.graph, self._out = capture(lambda: self.module(*self._args, **self._kwargs), device=self.device,
                                        warmups=0, static=static, owner="CudaGraphModule")
        self.counter += 1
        return this_out

    @staticmethod
    def _maybe_copy_onto_(src, dest, srcs, dests):
        if isinstance(src, torch.Tensor):
            srcs.append(src)
            dests.append(dest)
            return
        isdiff = False
        try:
            isdiff = src != dest
        except Exception as err:
            raise RuntimeError("Couldn't assess input value. Make sure your function only takes tensor inputs or "
                               "that the input value can be easily checked and is constant.") from err
        if isdiff:
            raise ValueError("Varying inputs must be torch.Tensor subclasses.")

    @classmethod
    def _check_device_and_clone(cls, x):
        if isinstance(x, torch.Tensor):
            if x.requires_grad:
                raise RuntimeError("tensors requiring grad are not supported")
            return x.clone()
        return x

    @classmethod
    def _clone(cls, x):
        return x.clone() if isinstance(x, torch.Tensor) else x


class Policy:
    """A softmax policy head: ``policy(obs, temperature)`` with ``temperature`` a Python float."""

    def __init__(self, device):
        gen = generator(1039)
        self.weight = randn(OBS, ACTIONS, gen=gen, device=device, scale=0.7)
        self.bias = randn(ACTIONS, gen=gen, device=device, scale=0.1)

    def __call__(self, obs, temperature):
        logits = obs @ self.weight + self.bias
        return torch.softmax(logits / temperature, dim=-1)


def run(variant: str, device: str = "cpu"):
    policy = Policy(device)
    gen = generator(7)
    observations = [randn(3, OBS, gen=gen, device=device) for _ in range(STEPS)]

    def served():
        func = CudaGraphModule(policy, variant, device)
        return [func(obs, TEMPERATURE) for obs in observations]

    def eager():
        return [policy(obs, TEMPERATURE) for obs in observations]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
