"""Graphs captured under ``autocast`` with its cast cache on read the cached low-precision weights, which the cache frees.

Upstream: https://github.com/pytorch/pytorch/pull/81558 ("[CUDA graphs] Clear autocast amp cache"), for
https://github.com/pytorch/pytorch/issues/71631 ("Wrapping make_graphed_callables with autocast issue");
followed by https://github.com/pytorch/pytorch/pull/84289 ("Disable autocast cache in
torch.cuda.make_graphed_callables").
Symptom: a model graphed with ``torch.cuda.make_graphed_callables`` inside ``torch.cuda.amp.autocast()``
trains differently from the same model without graphs: losses and weights diverge from the first
optimizer step on (PyTorch 1.10/1.11, January 2022).
Mechanism: under ``autocast(cache_enabled=True)`` the first cast of an fp32 leaf weight that requires grad
is kept in ``cached_casts`` until the outermost autocast context exits. ``make_graphed_callables`` ran its
warmup and both captures inside the user's autocast, so the warmup filled the cache, the capture recorded no
weight cast, and the captured GEMMs read the cached fp16 copies by address. When the user's block exits the
cache is cleared and those copies are freed: every replay reads released blocks (stale or reused data)
instead of a cast of the weights the optimizer keeps updating.
Doctor: dangling-reference, at ``forward`` (the captured GEMM that reads the cached, released cast of
the weight).
Fix (upstream): #81558 cleared the autocast cache before capture so the casts become kernels of the
graph; #84289 then made ``make_graphed_callables`` refuse autocast caching ("Please set
``cache_enabled=False``"): the user captures under ``autocast(cache_enabled=False)``, the graph
records the weight casts, and every replay re-casts the current fp32 weights.
"""
from __future__ import annotations

import torch

from workbench.engine import events, graph, graph_pool_handle, new_graph
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/pytorch/pull/81558"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "forward"
SYMPTOM = "graphed AMP training reads freed cached weight casts: losses and weights diverge from eager"
BATCH, DIM, STEPS, NUM_WARMUP_ITERS, LR = 4, 4, 4, 3, 0.5
LOW = torch.bfloat16            # autocast's lower precision (fp16 on CUDA upstream, bf16 works on both)


class Model(torch.nn.Module):
    """The issue's model, three stacked layers without bias (convolutions there, linear layers here)."""

    def __init__(self, device):
        super().__init__()
        gen = generator(71631)
        self.w1, self.w2, self.w3 = (torch.nn.Parameter(randn(DIM, DIM, gen=gen, device=device, scale=0.5))
                                     for _ in range(3))

    def forward(self, x):
        out = torch.tanh(x @ self.w1)
        out = torch.tanh(out @ self.w2)
        return out @ self.w3


def make_graphed_callables(module, sample_args, *, device, num_warmup_iters=NUM_WARMUP_ITERS,
                           refuse_autocast_cache=False):
    """``torch.cuda.make_graphed_callables`` for one module (warmup, forward graph, backward graph, an
    autograd function that replays them). ``refuse_autocast_cache``: the check #84289 added."""
    device_type = torch.device(device).type
    if refuse_autocast_cache and torch.is_autocast_enabled(device_type) and torch.is_autocast_cache_enabled():
        raise RuntimeError("make_graphed_callables does not support the autocast caching. "
                           "Please set `cache_enabled=False`.")
    owner = "torch.cuda.make_graphed_callables"
    params = tuple(module.parameters())
    static_input_surface = tuple(sample_args) + params
    requires_grad = tuple(i for i in static_input_surface if i.requires_grad)
    events.static_buffers(owner, {f"sample_arg{i}": a for i, a in enumerate(sample_args)})

    # Warmup: hopefully prevents lazy-initialization work from ending up in the captures.
    for _ in range(num_warmup_iters):
        with events.warmup():
            outputs = module(*sample_args)
            grad_inputs = torch.autograd.grad(outputs, requires_grad, grad_outputs=torch.zeros_like(outputs),
                                              only_inputs=True)
    del outputs, grad_inputs

    mempool = graph_pool_handle(device)
    fwd_graph, static_outputs = capture(lambda: module(*sample_args), device=device, pool=mempool, warmups=0,
                                        name="fwd", owner=owner, on_freed="reuse")
    static_grad_outputs = torch.zeros_like(static_outputs)
    events.static_buffers(owner, {"static_grad_outputs": static_grad_outputs})
    bwd_graph = new_graph(device, on_freed="reuse")
    with graph(bwd_graph, pool=mempool, name="bwd"):
        grads = torch.autograd.grad(static_outputs, requires_grad, grad_outputs=static_grad_outputs,
                                    only_inputs=True)
    grads = iter(grads)
    static_grad_inputs = tuple(next(grads) if i.requires_grad else None for i in static_input_surface)
    static_outputs = static_outputs.detach()

    class Graphed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            for i in range(len(sample_args)):
                if static_input_surface[i].data_ptr() != inputs[i].data_ptr():
                    static_input_surface[i].copy_(inputs[i])
            return replay(fwd_graph, static_outputs).detach()

        @staticmethod
        def backward(ctx, grad):
            static_grad_outputs.copy_(grad)
            replay(bwd_graph, tuple(g for g in static_grad_inputs if g is not None))
            return tuple(b.detach() if b is not None else None for b in static_grad_inputs)

    graph_training_state = module.training
    orig_fwd = module.forward

    def functionalized(*user_args):
        if module.training == graph_training_state:
            return Graphed.apply(*(user_args + params))
        return orig_fwd(*user_args)

    module.forward = functionalized
    return module


def run(variant: str, device: str = "cpu"):
    gen = generator(1)
    data = [(randn(BATCH, DIM, gen=gen, device=device), randn(BATCH, DIM, gen=gen, device=device, scale=0.5))
            for _ in range(STEPS)]
    device_type = torch.device(device).type

    def train(graphed: bool):
        model = Model(device)
        opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=False)
        if graphed:
            sample = data[0][0].clone()
            # the issue: make_graphed_callables called inside the user's autocast (cache on by default)
            with torch.autocast(device_type, dtype=LOW, cache_enabled=(variant == "bug")):
                model = make_graphed_callables(model, (sample,), device=device,
                                               refuse_autocast_cache=(variant == "fix"))
        outs = []
        for x, target in data:
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device_type, dtype=LOW):
                out = model(x)
            loss = ((out.float() - target) ** 2).mean()
            loss.backward()
            opt.step()
            outs += [loss.detach().clone(), out.float().detach().clone()]
        return outs + [p.detach().clone() for p in model.parameters()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: train(True), lambda: train(False))
