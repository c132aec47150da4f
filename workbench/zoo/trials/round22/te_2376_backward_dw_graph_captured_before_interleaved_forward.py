"""TE captures each delayed-wgrad (``backward_dw``) graph right after its dgrad graph, though it is replayed later.

Upstream: https://github.com/NVIDIA/TransformerEngine/pull/2376 ("[Pytorch] Fix backward_dw cuda graph order").
Symptom: the PR reports none beyond its title; what the capture order implies for Megatron-LM training with
``delay_wgrad_compute`` (the weight-gradient GEMM split out of the backward and run later, to overlap
expert-parallel communication) and per-layer graphs from ``te.make_graphed_callables(..., _order=...)``: wrong
weight gradients, no error, whenever another graph is replayed between a dgrad and its delayed wgrad (Nov 2025).
Mechanism: all graphs of ``_make_graphed_callables`` share one mempool, so (as its own comment says) they must be
captured in the order they are replayed. With ``delay_wgrad_compute`` the dgrad backward of a TE ``Linear``
stashes ``[inputmat, grad_output]`` (the quantized copy of the incoming gradient, a new buffer) in its
``WeightGradStore``; ``backward_dw()`` pops the stash and runs the wgrad GEMM into ``weight.main_grad``. The old
capture loop captured the ``bwd_dw_graph`` immediately after each ``bwd_graph``, so once it had popped the stash
the stashed ``grad_output`` block was free in the pool, and the next capture (the forward of the next
microbatch) placed its output in it. A schedule that replays that forward between the dgrad and the delayed
wgrad (the fix's order validation expects forwards there: "the next backward of dgrad graph must be
corresponding wgrad graph") has the forward replay write its activations into the stash, and the wgrad replay
read them as ``grad_output``.
Doctor: overwritten-output, at ``_make_graphed_callables`` (it captures the wgrad graph before graphs that
replay ahead of it, so one of them reuses the dgrad graph's stashed output).
Fix (upstream): ``_order`` carries the wgrad step as ``c_id - 0.5`` (e.g. ``[1, -1, 1, -1.5, -1, -1.5]``), and
the capture loop captures each ``bwd_dw_graph`` at that position (validated: as many wgrad entries as dgrad
entries per chunk, one layer per chunk), instead of right after the dgrad graph.
(Read: the diff of #2376 and ``graph.py``/``base.py``/``_common.py`` at its parent. One chunk of one layer, two
microbatches; the FP8 cast of ``grad_output`` is modelled by a bf16 round trip, which allocates the same way.)
"""
from __future__ import annotations

import math
import queue

import torch

from workbench.engine import events, graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TransformerEngine/pull/2376"
FAMILY = "dangling references"
KIND = "overwritten-output"
SITE = "_make_graphed_callables"
SYMPTOM = "the delayed wgrad of microbatch 0 reads the next microbatch's forward output as its grad_output"
BATCH, IN_FEATURES, OUT_FEATURES, NUM_MICROBATCHES, STEPS = 3, 5, 4, 2, 2
# Megatron's schedule for one chunk of one layer: forward, dgrad, the next forward, then the delayed wgrad.
SCHEDULE = [("fwd", 0), ("bwd", 0), ("fwd", 1), ("bwd_dw", 0), ("bwd", 1), ("bwd_dw", 1)]
ORDER_WITH_WGRAD = [1, -1, 1, -1.5, -1, -1.5]     # the fix's ``_order`` (wgrad entries at c_id - 0.5)
ORDER_WITHOUT_WGRAD = [1, -1, 1, -1]              # the same schedule as the old ``_order`` could say it


class WeightGradStore:
    """``transformer_engine.pytorch.module._common.WeightGradStore`` (``delay_wgrad_compute=True``)."""

    def __init__(self):
        self.context = queue.Queue()

    def put(self, tensor_list, func):
        self.context.put([tensor_list, func])

    def pop(self):
        tensor_list, func = self.context.get()
        return func(*tensor_list), tensor_list


class Linear:
    """``te.Linear(delay_wgrad_compute=True, fuse_wgrad_accumulation=True)``: the wgrad GEMM accumulates into
    Megatron's ``weight.main_grad`` when ``backward_dw()`` runs."""

    def __init__(self, device):
        gen = generator(2376)
        self.weight = randn(OUT_FEATURES, IN_FEATURES, gen=gen, device=device, scale=0.6)
        self.main_grad = torch.zeros(OUT_FEATURES, IN_FEATURES, device=device)
        self.wgrad_store = WeightGradStore()

    def forward(self, inp):
        return inp @ self.weight.t()

    def grad_output_preprocess(self, grad_output):
        """The cast of the incoming gradient for the backward GEMMs: a new buffer."""
        return grad_output.to(torch.bfloat16).to(torch.float32)

    def backward(self, inputmat, grad_output):
        grad_output = self.grad_output_preprocess(grad_output)
        dgrad = grad_output @ self.weight
        self.wgrad_store.put([inputmat, grad_output], self.wgrad_gemm)
        return dgrad

    def wgrad_gemm(self, inputmat, grad_output):
        self.main_grad.add_(grad_output.t() @ inputmat)          # accumulate=True into main_grad
        return None, None

    def need_backward_dw(self):
        return True

    def backward_dw(self):
        (wgrad, bgrad), _ = self.wgrad_store.pop()
        del wgrad, bgrad


def _make_graphed_callables(module, static_x, static_grad_outputs, _order, device, variant):
    """The ``_order`` branch of TE's ``_make_graphed_callables``: warm up, then capture the forward, dgrad
    backward and wgrad (``backward_dw``) graph of every microbatch into one shared mempool."""
    mempool = graph_pool_handle(device)
    for mb in range(NUM_MICROBATCHES):                        # warmup, as TE does, on each callable
        with events.warmup():
            module.forward(static_x[mb])
            module.backward(static_x[mb], static_grad_outputs[mb])
            module.backward_dw()
    need_bwd_dw_graph = [module.need_backward_dw() for _ in range(NUM_MICROBATCHES)]
    fwd_graphs, bwd_graphs, bwd_dw_graphs = {}, {}, {}
    fwd_idx = bwd_idx = 0
    for c_id in _order:
        if c_id > 0:
            mb = fwd_idx
            fwd_graphs[mb] = capture(lambda mb=mb: module.forward(static_x[mb]), device=device, pool=mempool,
                                     warmups=0, name=f"fwd mb{mb}", owner="te.make_graphed_callables",
                                     static={"sample_args": static_x[mb]})
            fwd_idx += 1
        elif math.ceil(c_id) != c_id:                         # the fix: a wgrad entry, c_id - 0.5
            mb = bwd_idx - 1
            assert need_bwd_dw_graph[mb], "No module needs wgrad computation but get float in order"
            bwd_dw_graphs[mb] = capture(module.backward_dw, device=device, pool=mempool, warmups=0,
                                        name=f"bwd_dw mb{mb}", owner="te.make_graphed_callables",
                                        static={"sample_args": static_x[mb]}, state={"main_grad": module.main_grad})
        else:
            mb = bwd_idx
            bwd_graphs[mb] = capture(lambda mb=mb: module.backward(static_x[mb], static_grad_outputs[mb]),
                                     device=device, pool=mempool, warmups=0, name=f"bwd mb{mb}",
                                     owner="te.make_graphed_callables",
                                     static={"sample_args": static_x[mb],
                                             "static_grad_outputs": static_grad_outputs[mb]})
            if variant == "bug" and need_bwd_dw_graph[mb]:
                # Before the fix: the wgrad graph is captured right after its dgrad graph.
                bwd_dw_graphs[mb] = capture(module.backward_dw, device=device, pool=mempool, warmups=0,
                                            name=f"bwd_dw mb{mb}", owner="te.make_graphed_callables",
                                            static={"sample_args": static_x[mb]},
                                            state={"main_grad": module.main_grad})
            bwd_idx += 1
    return fwd_graphs, bwd_graphs, bwd_dw_graphs


def run(variant: str, device: str = "cpu"):
    gen = generator(2018)
    steps = [[(randn(BATCH, IN_FEATURES, gen=gen, device=device), randn(BATCH, OUT_FEATURES, gen=gen, device=device))
              for _ in range(NUM_MICROBATCHES)] for _ in range(STEPS)]

    def served():
        module = Linear(device)
        static_x = [torch.zeros(BATCH, IN_FEATURES, device=device) for _ in range(NUM_MICROBATCHES)]
        static_go = [torch.zeros(BATCH, OUT_FEATURES, device=device) for _ in range(NUM_MICROBATCHES)]
        for mb, (x, go) in enumerate(steps[0]):
            static_x[mb].copy_(x)
            static_go[mb].copy_(go)
        order = ORDER_WITH_WGRAD if variant == "fix" else ORDER_WITHOUT_WGRAD
        fwd, bwd, bwd_dw = _make_graphed_callables(module, static_x, static_go, order, device, variant)
        outs = []
        for microbatches in steps:
            module.main_grad.zero_()                          # Megatron zeroes the grad buffer per step
            for what, mb in SCHEDULE:
                x, go = microbatches[mb]
                if what == "fwd":                             # Graphed.forward
                    static_x[mb].copy_(x)
                    outs.append(replay(*fwd[mb]).clone())
                elif what == "bwd":                           # Graphed.backward
                    static_go[mb].copy_(go)
                    outs.append(replay(*bwd[mb]).clone())
                else:                                         # graphed_callable.backward_dw()
                    bwd_dw[mb][0].replay()
            outs.append(module.main_grad.clone())
        return outs

    def eager():
        module = Linear(device)
        outs = []
        for microbatches in steps:
            module.main_grad.zero_()
            for what, mb in SCHEDULE:
                x, go = microbatches[mb]
                if what == "fwd":
                    outs.append(module.forward(x).clone())
                elif what == "bwd":
                    outs.append(module.backward(x, go).clone())
                else:
                    module.backward_dw()
            outs.append(module.main_grad.clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
