"""CudaGraphModule loses the input leaf its graph reads when the module rewrites that input key.

Upstream: https://github.com/pytorch/tensordict/pull/1788 ("[BugFix] Keep CudaGraphModule inputs bound when a
module rewrites its input keys").
Symptom: a ``TensorDictModule`` that writes an output under one of its input keys (a recurrent cell with
``in_keys=["x", "h"]``, ``out_keys=["y", "h"]``) wrapped in ``tensordict.nn.CudaGraphModule`` silently
ignores the ``"h"`` it is given once the graph is captured: every replay computes ``y`` (and the new
``h``) from the ``h`` of the capture call, whatever ``h`` the caller passes. Nothing raises (tensordict
main, fixed September 2026).
Mechanism: in the capture branch of ``_call``, the input's leaves are cloned and
``self._tensordict = tensordict.copy()`` becomes the static input: a new container sharing those leaves.
The eager run of the same call goes through ``TensorDictModule.__call__`` on the caller's tensordict, and
the capture on ``self._tensordict``; each ends with ``tensordict.set("h", new_h)``, host work that *rebinds*
the container's ``"h"`` entry (at capture, to the graph's output tensor). The captured kernels read the
original cloned ``"h"`` leaf, but after the two rebinds no container holds it any more: the wrapper keeps no
reference to the memory its graph reads, so the leaf goes back to the allocator. Each replay runs
``self._tensordict.update_(tensordict)``, which copies the caller's ``"h"`` into the output tensor (the
replay overwrites it at once) and never into the leaf the graph reads: replays read released memory, which
on a GPU still holds the capture call's ``h`` (upstream's "h is ignored") until the allocator hands the
block out again.
Doctor: dangling-reference, at ``_call`` (the static input leaf the graph reads is released after capture,
because the only container that held it had its entry rebound).
Fix (upstream): the replay copies new inputs into the leaves the graph reads, not into the rebound entry.
Modelled here as keeping a second shallow copy of the static input, taken before the capture
(``self._tensordict_in``), whose entries still hold the captured leaves (keeping them alive), and refreshing
that one.
"""
from __future__ import annotations

import torch

from workbench.engine import events, graph, new_graph
from workbench.zoo.kit import compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/tensordict/pull/1788"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "_call"
SYMPTOM = "every graphed call computes with the capture call's hidden state; the caller's 'h' is ignored"
BATCH, DIM, WARMUP = 4, 3, 2


class TensorDict:
    """The few ``TensorDict`` methods the wrapper uses: a container of named leaves."""

    def __init__(self, source: dict):
        self._tensordict = dict(source)

    def get(self, key):
        return self._tensordict[key]

    def set(self, key, value):
        self._tensordict[key] = value              # rebinds the entry; the old leaf is untouched
        return self

    def keys(self):
        return self._tensordict.keys()

    def copy(self):
        return TensorDict(self._tensordict)        # shallow: a new container sharing the leaves

    def apply(self, fn, out=None):
        target = self if out is None else out
        for key in list(self.keys()):
            target._tensordict[key] = fn(self._tensordict[key])
        return target

    def update_(self, other, non_blocking=False):
        """In-place update: copy ``other``'s values into the tensors this container holds."""
        for key in other.keys():
            if key in self._tensordict:
                self._tensordict[key].copy_(other.get(key), non_blocking=non_blocking)
        return self

    def update(self, other, keys_to_update=None):
        for key in (keys_to_update or other.keys()):
            self._tensordict[key] = other.get(key)
        return self


class Recurrent(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        gen = generator(1788)
        self.w = randn(DIM, DIM, gen=gen, device=device, scale=0.6)

    def forward(self, x, h):
        h = torch.tanh(h @ self.w + x)
        return h.sum(-1, keepdim=True), h


class TensorDictModule:
    def __init__(self, module, in_keys, out_keys):
        self.module, self.in_keys, self.out_keys = module, in_keys, out_keys

    def __call__(self, tensordict):
        outputs = self.module(*(tensordict.get(key) for key in self.in_keys))
        for key, value in zip(self.out_keys, outputs):
            tensordict.set(key, value)
        return tensordict


class CudaGraphModule:
    """``tensordict.nn.CudaGraphModule``'s TensorDict path: ``warmup`` eager calls, then capture, then replays."""

    def __init__(self, module, device, warmup: int = WARMUP, keep_inputs_bound: bool = False):
        self.module = module
        self.device = device
        self.in_keys, self.out_keys = module.in_keys, module.out_keys
        self._warmup = warmup
        self.counter = 0
        self._out_matches_in = None
        self.keep_inputs_bound = keep_inputs_bound

    @staticmethod
    def _clone(x):
        return x.clone()

    def __call__(self, tensordict):
        return self._call(tensordict)

    def _call(self, tensordict):
        if self.counter >= self._warmup:
            if self.keep_inputs_bound:
                self._tensordict_in.update_(tensordict, non_blocking=True)   # the leaves the graph reads
            else:
                self._tensordict.update_(tensordict, non_blocking=True)      # "h" here is the graph's output
            outputs = replay(self.graph, self._static_outputs)
            if self._out_matches_in:
                return tensordict.update(TensorDict(dict(zip(self._selected_keys, outputs))),
                                         keys_to_update=self._selected_keys)
            return self._out
        if self.counter < self._warmup - 1:
            with events.warmup(real=True):
                tensordict.apply(self._clone, out=tensordict)
                out = self.module(tensordict)
            if self._out_matches_in is None:
                self._out_matches_in = out is tensordict
            self.counter += 1
            return out
        # Registering CUDA graph...
        tensordict.apply(self._clone, out=tensordict)
        self._tensordict = tensordict.copy()
        if self.keep_inputs_bound:
            self._tensordict_in = self._tensordict.copy()   # still bound to the leaves the capture reads
        events.static_buffers("CudaGraphModule", {key: self._tensordict.get(key) for key in self.in_keys})
        with events.warmup(real=True):
            this_out = self.module(tensordict)            # the call's own result, computed eagerly
        self.graph = new_graph(self.device)
        with graph(self.graph, name="CudaGraphModule"):
            out = self.module(self._tensordict)           # set("h", ...) rebinds self._tensordict["h"]
        self._out = out
        self._selected_keys = self.out_keys
        self._static_outputs = tuple(out.get(key) for key in self._selected_keys)
        self.counter += 1
        return this_out


def run(variant: str, device: str = "cpu"):
    gen = torch.Generator().manual_seed(3)
    calls = [(torch.randn(BATCH, DIM, generator=gen), torch.randn(BATCH, DIM, generator=gen)) for _ in range(6)]
    keys = ["y", "h"]

    def make(x, h):
        return TensorDict({"x": x.to(device), "h": h.to(device)})

    def serve(graphed: bool):
        module = TensorDictModule(Recurrent(device), in_keys=["x", "h"], out_keys=["y", "h"])
        fn = CudaGraphModule(module, device, keep_inputs_bound=(variant == "fix")) if graphed else module
        outs = []
        for x, h in calls:
            td = fn(make(x, h))
            outs.extend(td.get(key).clone() for key in keys)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
