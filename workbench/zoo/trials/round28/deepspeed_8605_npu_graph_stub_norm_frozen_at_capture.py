"""With ``graph_harvesting`` on, ``graph_process`` runs the gradient-norm kernels once, at "capture", through an accelerator whose graph ops are stubs; every later "replay" does nothing and the norm stays at step 1's value.

Upstream: https://github.com/deepspeedai/DeepSpeed/pull/8605 ("Implement graph operations for NPU
accelerator", fixes #8604; merged September 2026), follow-up to #4318 ("Capture short kernel sequences to
graph", which added ``graph_process`` and left the NPU graph ops as stubs).
Symptom: "graph_process cached an empty graph and every subsequent 'replay' did nothing: with
graph_harvesting enabled, gradient norms silently went stale, clipping silently stopped, and the hp->lp
gradient write-back silently stopped" (reproduced on Ascend hardware in the PR).
Mechanism: ``deepspeed.runtime.utils.graph_process(replay_first_step, func, *args)`` keys
``graph_cache`` by ``func.__name__``; on the first call it runs ``func`` on a side stream (warmup), then
``create_graph()`` and ``with capture_to_graph(graph): func(*args)``, and on every later call only
``replay_graph(graph)``. ``get_global_norm_of_tensors(..., use_graph=True)`` puts its per-tensor norms
into the persistent ``graph_cache['norm_tensors_compute_buffer']`` through ``_norm_tensors`` this way.
``NPU_Accelerator`` returned ``None`` from ``create_graph``, a no-op context from ``capture_to_graph``
and did nothing in ``replay_graph``: the "captured" ``_norm_tensors`` was plain host-dispatched work that
ran once, at capture, and no kernel was recorded, so later steps read the capture step's norm.
Doctor: host-work-frozen, at ``_norm_tensors`` (its work ran once, at capture; replays repeat nothing).
Fix (upstream): ``NPU_Accelerator.create_graph`` / ``capture_to_graph`` / ``replay_graph`` wrap
``torch.npu.NPUGraph()``, ``torch.npu.graph(graph, pool, stream)`` and ``graph.replay()``, as the CUDA,
HPU and MLU accelerators wrap theirs; here the fixed accelerator uses the workbench graph API.
(Read: the PR description and the #4318 diff of ``graph_process`` / the accelerator graph interface;
the NPU stub is modelled from the description. Clipping and the hp->lp write-back, the other two
victims, are left out: the norm is the simplest of the three.)
"""
from __future__ import annotations

import contextlib

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/deepspeedai/DeepSpeed/pull/8605"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "_norm_tensors"
SYMPTOM = "global gradient norm stays at its first-step value with graph_harvesting on the NPU accelerator"

SHAPES, STEPS, NORM_TYPE = ((3, 4), (5,), (2, 2)), 4, 2.0


class NPU_Accelerator:
    """``accelerator/npu_accelerator.py``; ``variant`` picks the stubs (bug) or the #8605 graph ops."""

    def __init__(self, device, variant):
        self.device, self.variant = device, variant
        self._outputs = {}

    # Graph operations
    def create_graph(self):
        return None if self.variant == "bug" else "NPUGraph"   # the fix: torch.npu.NPUGraph()

    def capture_to_graph(self, graph, func, args, name):
        if self.variant == "bug":
            with contextlib.nullcontext():                      # noop_context(): func runs, eagerly
                func(*args)
            return None
        g, out = capture(lambda: func(*args), device=self.device, warmups=0, owner="graph_process",
                         name=name, static={f"input_tensors[{i}]": t for i, t in enumerate(args[0])})
        self._outputs[id(g)] = args[1][0]
        return g

    def replay_graph(self, graph):
        if self.variant == "bug" or graph is None:
            return                                              # the stub: nothing
        replay(graph, self._outputs[id(graph)].view(1))


graph_cache: dict = {}


def graph_process(accelerator, replay_first_step, func, *args):
    # `func` should only contain operations on the GPU
    # Please ensure that the memory address of the data required by 'func' remains constant
    if func.__name__ not in graph_cache:
        func(*args)                                            # warmup on a side stream
        graph = accelerator.create_graph()
        graph_cache[func.__name__] = accelerator.capture_to_graph(graph, func, args, func.__name__)
        if replay_first_step:
            accelerator.replay_graph(graph_cache[func.__name__])
    else:
        accelerator.replay_graph(graph_cache[func.__name__])


def _norm_tensors(tensor_list, _compute_buffer):
    for i, t in enumerate(tensor_list):
        _compute_buffer[i].copy_(t.float().norm(NORM_TYPE) ** NORM_TYPE)
        if i != 0:
            _compute_buffer[0].add_(_compute_buffer[i])


def get_global_norm_of_tensors(accelerator, input_tensors, use_graph=False):
    if use_graph:
        if "norm_tensors_compute_buffer" not in graph_cache:
            graph_cache["norm_tensors_compute_buffer"] = [t.float().norm(NORM_TYPE).reshape(1).clone()
                                                          for t in input_tensors]
        compute_buffer = graph_cache["norm_tensors_compute_buffer"]
        graph_process(accelerator, False, _norm_tensors, input_tensors, compute_buffer)
        total_norm = compute_buffer[0].clone()
    else:
        total_norm = sum(t.float().norm(NORM_TYPE) ** NORM_TYPE for t in input_tensors).reshape(1)
    return total_norm.pow(1.0 / NORM_TYPE)


class BF16_Optimizer:
    """Only the part that matters: fp32 hp grads in persistent buffers, their global norm each step."""

    def __init__(self, accelerator, device, graph_harvesting):
        self.accelerator, self.graph_harvesting = accelerator, graph_harvesting
        self.fp32_groups_gradients_flat = [torch.zeros(*s, device=device) for s in SHAPES]

    def get_grads_for_norm(self):
        return self.fp32_groups_gradients_flat

    def step(self, grads):
        for buf, g in zip(self.fp32_groups_gradients_flat, grads):
            buf.copy_(g)                                         # update_hp_grads: written in place
        return get_global_norm_of_tensors(self.accelerator, self.get_grads_for_norm(),
                                          use_graph=self.graph_harvesting)


def run(variant: str, device: str = "cpu"):
    gen = generator(8605)
    steps = [[randn(*s, gen=gen, device=device, scale=1.0 + k) for s in SHAPES] for k in range(STEPS)]

    def train(graph_harvesting: bool):
        graph_cache.clear()
        opt = BF16_Optimizer(NPU_Accelerator(device, variant), device, graph_harvesting)
        return [opt.step(grads) for grads in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: train(True), lambda: train(False))
