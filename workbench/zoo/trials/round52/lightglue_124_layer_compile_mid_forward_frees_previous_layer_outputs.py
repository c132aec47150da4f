"""Compiling LightGlue's next layer mid-forward starts a new cudagraph generation that frees the previous layer's outputs.

Upstream: https://github.com/cvg/LightGlue/pull/124 ("fix compilation for torch v2.2.1", commit edb2b83), for
https://github.com/cvg/LightGlue/issues/123 ("LightGlue-full-compile won't work with torch '2.2.1+cu121'").
Symptom: ``benchmark.py --compile`` crashes at ``_ = matcher(data)`` on the first forward with a cudagraph-trees
error: the descriptors layer i returned, which the host passes on to layer i+1, were freed (poisoned) by the tree.
Mechanism: ``LightGlue.compile(mode="reduce-overhead")`` wraps every ``self.transformers[i].masked_forward`` in its
own ``torch.compile``: n independent cudagraph-tree functions chained inside one ``_forward``
(``desc0, desc1 = self.transformers[i](desc0, desc1, ...)``). In torch 2.2 ``CUDAGraphTreeManager.get_curr_generation``
returns ``GenerationTracker.generation`` (bumped by every dynamo frame compile) unless mark-step was ever called. On
the first forward layer i+1 is compiled after layer i ran, so the generation changes mid-forward; the manager's
``run`` sees ``can_start_new_generation`` and calls ``dealloc_current_path_weakrefs``, freeing layer i's outputs, which
are exactly layer i+1's inputs. The generation is decided by when compilation happens, not by the step boundary.
Doctor: dangling-reference, at ``compile`` (it leaves the tree's generation tied to compile events, so a mid-forward
compile releases the previous layer's outputs while the host still feeds them to the next layer).
Fix (upstream): one line in ``LightGlue.compile()`` before the per-layer ``torch.compile`` loop:
``torch._inductor.cudagraph_mark_step_begin()``; from then on the generation is the mark-step counter, so per-layer
compiles no longer end the path and chained outputs stay valid within one forward.
"""
from __future__ import annotations

import weakref

import torch

from workbench.engine import events, graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/cvg/LightGlue/pull/124"
FAMILY = "warmup/capture vs replay state"
KIND = "dangling-reference"
SITE = "compile"
SYMPTOM = "first forward crashes: layer i's outputs, layer i+1's inputs, are freed when layer i+1 is compiled"
N_LAYERS, KPTS, DIM, FORWARDS = 3, 4, 6, 3


class GenerationTracker:
    generation = 0                       # bumped by every dynamo frame compile


class MarkStepBox:
    mark_step_counter = 0


class CUDAGraphTreeManager:
    """One tree (one shared pool) for every compiled layer of the process."""

    def __init__(self, device):
        self.device = device
        self.cuda_graphs_thread_pool = graph_pool_handle(device)
        self.current_gen = -1
        self.path_outputs: list[weakref.ref] = []        # outputs of the current path (warmup outputs here)
        self.nodes: dict[str, tuple] = {}
        self.warmed_up: set[str] = set()

    def get_curr_generation(self):
        if MarkStepBox.mark_step_counter != 0:
            return MarkStepBox.mark_step_counter
        return GenerationTracker.generation

    def dealloc_current_path_weakrefs(self):
        """New generation: the path's outputs are dead; their memory is freed (and poisoned)."""
        for ref in self.path_outputs:
            t = ref()
            if t is not None:
                t.untyped_storage().resize_(0)
        self.path_outputs = []

    def run(self, function_id, fn, inputs):
        if self.get_curr_generation() != self.current_gen:   # can_start_new_generation()
            self.dealloc_current_path_weakrefs()
            self.current_gen = self.get_curr_generation()
        if function_id not in self.warmed_up:                 # CUDAWarmupNode: eager, outputs owned by the pool
            self.warmed_up.add(function_id)
            with events.warmup(real=True):
                out = fn(*inputs)
            self.path_outputs += [weakref.ref(t) for t in out]
            return out
        if function_id not in self.nodes:                    # record the node
            static = [t.clone() for t in inputs]
            g, outs = capture(lambda: fn(*static), device=self.device, pool=self.cuda_graphs_thread_pool,
                              warmups=0, name=function_id, static={"desc0": static[0], "desc1": static[1]},
                              owner="CUDAGraphTreeManager")
            self.nodes[function_id] = (g, static, outs)
        g, static, outs = self.nodes[function_id]
        for s, t in zip(static, inputs):
            s.copy_(t)
        return replay(g, outs)


class TransformerLayer:
    def __init__(self, gen, device):
        self.w_self = randn(DIM, DIM, gen=gen, device=device, scale=0.4)
        self.w_cross = randn(DIM, DIM, gen=gen, device=device, scale=0.4)

    def masked_forward(self, desc0, desc1):
        d0 = desc0 + torch.tanh(desc0 @ self.w_self) + torch.softmax(desc0 @ desc1.T, -1) @ desc1 @ self.w_cross
        d1 = desc1 + torch.tanh(desc1 @ self.w_self) + torch.softmax(desc1 @ desc0.T, -1) @ desc0 @ self.w_cross
        return d0, d1

    def __call__(self, desc0, desc1):
        return self.masked_forward(desc0, desc1)


class LightGlue:
    def __init__(self, gen, device):
        self.transformers = [TransformerLayer(gen, device) for _ in range(N_LAYERS)]
        self.w_assign = randn(DIM, DIM, gen=gen, device=device, scale=0.5)

    def compile(self, manager, mark_step_begin):
        if mark_step_begin:
            MarkStepBox.mark_step_counter += 1                # torch._inductor.cudagraph_mark_step_begin()
        for i in range(N_LAYERS):
            eager_fn, compiled = self.transformers[i].masked_forward, {"done": False}

            def masked_forward(desc0, desc1, _i=i, _fn=eager_fn, _c=compiled):
                if not _c["done"]:                             # dynamo compiles the frame on its first call
                    _c["done"] = True
                    GenerationTracker.generation += 1
                return manager.run(f"transformers.{_i}.masked_forward", _fn, (desc0, desc1))
            self.transformers[i].masked_forward = masked_forward

    def _forward(self, desc0, desc1):
        for i in range(N_LAYERS):
            desc0, desc1 = self.transformers[i](desc0, desc1)
        return (desc0 @ self.w_assign) @ desc1.T                # the assignment scores, computed eagerly


def run(variant: str, device: str = "cpu"):
    gen = generator(124)
    model = LightGlue(gen, device)
    data = [(randn(KPTS, DIM, gen=gen, device=device), randn(KPTS, DIM, gen=gen, device=device))
            for _ in range(FORWARDS)]

    def eager():
        return [model._forward(d0, d1) for d0, d1 in data]

    def served():
        GenerationTracker.generation, MarkStepBox.mark_step_counter = 0, 0
        manager = CUDAGraphTreeManager(device)
        saved = [t.masked_forward for t in model.transformers]
        try:
            model.compile(manager, mark_step_begin=(variant == "fix"))
            out = []
            for _ in range(2):                                   # warmup, then recording and replays
                out = [model._forward(d0, d1).clone() for d0, d1 in data]
            return out
        finally:
            for t, f in zip(model.transformers, saved):
                t.masked_forward = f

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
