"""The ``cudagraphs`` dynamo backend keeps an input mutation inside the graph, so it lands on the static copy.

Upstream: https://github.com/pytorch/pytorch/pull/121018 ("Add Cudagraphs disable checking"), stack of
https://github.com/pytorch/pytorch/pull/121017 / #121019 / #121033 (March 2024, eellison).
Symptom: ``torch.compile(fn, backend="cudagraphs")`` on a function that updates one of its (non-parameter)
tensor arguments in place (a running statistic, a cache handed in by the caller) returned results as if
the update had never happened: the caller's tensor kept its old value from the recorded call on, and every
later call started again from that stale value. No error: the backend lacked the mutation check that
inductor's cudagraph trees already had.
Mechanism: the backend compiled through ``aot_autograd(..., keep_inference_input_mutations=True)``, so the
in-place ``running.mul_().add_()`` stayed inside the graph handed to ``cudagraphify_impl``. Cudagraph trees
treat every input that is not a parameter/buffer (not in ``range(fixed)``) as an eager input: it is copied
into a static placeholder before each replay, and the graph's kernels read and write only that placeholder.
The in-place update therefore writes the placeholder (a static input buffer owned by the graph manager, not
by the caller); the caller's ``running`` is never written, and the next call copies its stale value back in.
Doctor: persistent-mutation, at ``forward`` (the captured in-place update of the static input copy).
Fix (upstream): the backend got inductor's skip checks (``check_for_skip`` with
``check_for_mutation_ignore_cuda_graph_managed_tensor``: a mutated non-fixed input disables cudagraphs for
that graph) and a new ``torch._dynamo.config.cudagraph_backend_keep_input_mutation = False`` passed as
``keep_inference_input_mutations``: AOT autograd functionalizes the update, the graph returns the new value
as an extra output, and the runtime wrapper copies it into the caller's tensor outside the graph (modelled
here as the fix).
Note: the diff was read only in part (the review threads of #121018 show the new config flag and the
moved mutation check; the post-fix ``torch/_dynamo/backends/cudagraphs.py`` was read in full).
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/pytorch/pull/121018"
FAMILY = "persistent-buffer mutation"
KIND = "persistent-mutation"
SITE = "forward"
SYMPTOM = "an in-place update of a caller's tensor is applied to the graph's static copy; the caller's tensor stays stale"

DIM, ROWS, STEPS = 4, 3, 4
DECAY = 0.5


def forward(x, running, weight):
    """The user's compiled function (dynamo graph): an in-place running update, then a projection."""
    running.mul_(DECAY).add_(x)
    return running @ weight


def forward_functionalized(x, running, weight):
    """What AOT autograd hands the compiler with ``keep_inference_input_mutations=False``: the update is
    an extra output (``running_updated``), and no input is written inside the graph."""
    running_updated = running * DECAY + x
    return running_updated @ weight, running_updated


class cudagraphify_impl:  # noqa: N801 - named as upstream's function that builds the wrapper
    """Cudagraph-trees style wrapper: first call warms up eagerly on the real inputs, the second records
    over static placeholders for the non-fixed inputs, later calls copy the inputs in and replay."""

    def __init__(self, model, device, fixed_weight):
        self.model, self.device, self.weight = model, device, fixed_weight
        self.calls = 0
        self.graph = self.outputs = None
        self.static_inputs = None

    def __call__(self, x, running):
        self.calls += 1
        if self.calls == 1:                               # warmup run: eager, on the caller's tensors
            return self.model(x, running, self.weight)
        if self.graph is None:                            # record: static placeholders for eager inputs
            self.static_inputs = (torch.zeros_like(x), torch.zeros_like(running))
            sx, srun = self.static_inputs
            sx.copy_(x)
            srun.copy_(running)
            self.graph, self.outputs = capture(lambda: self.model(sx, srun, self.weight), device=self.device,
                                               warmups=0, owner="cudagraphify_impl (cudagraphs backend)",
                                               static={"x": sx, "running": srun})
        else:
            for dst, src in zip(self.static_inputs, (x, running)):
                dst.copy_(src)
        return replay(self.graph, self.outputs)


def aot_cudagraphs(variant, device, weight):
    """``cudagraphs(dynamo_model, dynamo_inputs)``: aot_autograd + ``forward_cudagraphs``."""
    keep_inference_input_mutations = variant == "bug"     # fix: cudagraph_backend_keep_input_mutation=False
    if keep_inference_input_mutations:
        compiled = cudagraphify_impl(forward, device, weight)
        return lambda x, running: compiled(x, running).clone()
    compiled = cudagraphify_impl(forward_functionalized, device, weight)

    def runtime_wrapper(x, running):
        out, running_updated = compiled(x, running)
        out = out.clone()
        running.copy_(running_updated)                    # input mutation applied outside the graph
        return out

    return runtime_wrapper


def run(variant: str, device: str = "cpu"):
    gen = generator(121018)
    weight = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
    xs = [randn(ROWS, DIM, gen=gen, device=device) for _ in range(STEPS)]

    def loop(fn):
        running = torch.zeros(ROWS, DIM, device=device)   # the caller's tensor, updated in place
        outs = []
        for x in xs:
            outs.append(fn(x, running))
            outs.append(running.clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device,
                   lambda: loop(aot_cudagraphs(variant, device, weight)),
                   lambda: loop(lambda x, running: forward(x, running, weight).clone()))
