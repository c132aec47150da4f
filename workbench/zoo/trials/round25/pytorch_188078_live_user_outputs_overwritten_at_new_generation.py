"""A cudagraph-trees generation boundary hands a live user-visible output's memory to the next replay.

Upstream: https://github.com/pytorch/pytorch/pull/188078 ("Add opt-in CUDAGraph tree cloning for live outputs",
in the PyTorch 2.14 release notes; its re-submission https://github.com/pytorch/pytorch/pull/188117 "Add CUDAGraph
cloning for live user outputs" carries the same change), for https://github.com/pytorch/pytorch/issues/176294.
Symptom: a ``torch.compile(mode="reduce-overhead")`` decode loop that calls
``torch.compiler.cudagraph_mark_step_begin()`` before each step, feeds the returned state back in and keeps each
step's returned logits, cannot keep them: the outputs it still holds live in the cudagraph pool, and the next step's
replay reuses that memory (PyTorch poisons such storages, so the user gets "Error: accessing tensor output of
CUDAGraphs that has been overwritten by a subsequent run"; without the poison the held logits all read as the last
step's).
Mechanism: every ``mark_step_begin`` starts a new generation: ``CUDAGraphTreeManager`` calls
``dealloc_current_path_weakrefs`` and goes back to the root, treating every output of the previous path as dead. The
root ``CUDAGraphNode`` then replays into the same static output storages. A user-visible output that the caller still
holds (the logits appended to a list, the state it passes back in) is a live ``TensorImpl`` on storage that the
replay expects to be dead, so the replay overwrites it.
Doctor: overwritten-output, at ``dealloc_current_path_weakrefs`` (it gives the live user-visible outputs' memory back
to the next replay at the generation boundary).
Fix (upstream): ``torch._inductor.config.triton.cudagraph_trees_generation_cloning = "user_visible"``: when a new
generation starts, live user-visible forward/inference outputs are cloned out of the graph pool (their TensorImpls
re-pointed to the copies, alias/weakref bookkeeping updated) before the next replay. Opt-in; the default stays None
and the stale-output error names the option. Only the PR descriptions and release note were read, not the diff.
"""
from __future__ import annotations

import weakref

import torch

from workbench.engine import events, graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/pytorch/pull/188078"
FAMILY = "dangling references"
KIND = "overwritten-output"
SITE = "dealloc_current_path_weakrefs"
SYMPTOM = "logits kept from earlier decode steps are overwritten by later steps' replays of the same graph node"
DIM, VOCAB, STEPS = 4, 5, 5


def decode_step(x, state, w_in, w_state, w_out):
    """The compiled function: one recurrent decode step returning (logits, new_state), both user-visible."""
    new_state = torch.tanh(x @ w_in + state @ w_state)
    return new_state @ w_out, new_state


class CUDAGraphNode:
    """A recording of ``decode_step``: static inputs copied in, static outputs in the graph pool."""

    def __init__(self, wrapped_function, inputs, params, device, pool):
        self.static_inputs = [t.clone() for t in inputs]
        self.graph, self.outputs = capture(lambda: wrapped_function(*self.static_inputs, *params), device=device,
                                           pool=pool, warmups=0, name="decode_step",
                                           static={"x": self.static_inputs[0], "state": self.static_inputs[1]},
                                           owner="CUDAGraphTreeManager")

    def run(self, new_inputs):
        for static, t in zip(self.static_inputs, new_inputs):
            static.copy_(t)
        return replay(self.graph, self.outputs)


class CUDAGraphTreeManager:
    def __init__(self, device, cudagraph_trees_generation_cloning):
        self.device = device
        self.cloning = cudagraph_trees_generation_cloning
        self.cuda_graphs_thread_pool = graph_pool_handle(device)
        self.roots: dict[str, CUDAGraphNode] = {}
        self.warmed_up: set[str] = set()
        self.current_node: CUDAGraphNode | None = None
        self.path_user_outputs: list[weakref.ref] = []      # weakrefs to the user-visible outputs of the path
        self.mark_step_pending = False

    def mark_step_begin(self):
        """torch.compiler.cudagraph_mark_step_begin(): the next invocation starts a new generation."""
        self.mark_step_pending = True

    def dealloc_current_path_weakrefs(self):
        """Start a new generation: the current path's outputs are considered dead and their memory reusable."""
        if self.cloning == "user_visible":
            with torch.no_grad():
                for ref in self.path_user_outputs:
                    t = ref()
                    if t is not None:                      # still live: clone it out of the graph pool
                        t.set_(t.clone())
        self.path_user_outputs = []
        self.current_node = None

    def run(self, function_id, wrapped_function, inputs, params):
        if self.mark_step_pending:
            self.mark_step_pending = False
            self.dealloc_current_path_weakrefs()
        if function_id not in self.warmed_up:               # CUDAWarmupNode: the first call runs eagerly
            self.warmed_up.add(function_id)
            with events.warmup(real=True):
                return wrapped_function(*inputs, *params)
        node = self.roots.get(function_id)
        if node is None:                                    # record_function, then run the first inputs
            node = self.roots[function_id] = CUDAGraphNode(wrapped_function, inputs, params, self.device,
                                                           self.cuda_graphs_thread_pool)
        outputs = node.run(inputs)
        self.current_node = node
        self.path_user_outputs += [weakref.ref(t) for t in outputs]
        return outputs


def run(variant: str, device: str = "cpu"):
    gen = generator(176294)
    w_in = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
    w_state = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
    w_out = randn(DIM, VOCAB, gen=gen, device=device)
    state0 = randn(2, DIM, gen=gen, device=device, scale=0.3)
    tokens = [randn(2, DIM, gen=gen, device=device) for _ in range(STEPS)]
    params = (w_in, w_state, w_out)

    def generate(step, mark_step_begin=lambda: None):
        all_logits, state = [], state0
        for x in tokens:
            mark_step_begin()
            logits, state = step(x, state)
            all_logits.append(logits)
        scores = torch.stack(all_logits).log_softmax(-1)    # the caller reads every step's logits at the end
        return [scores, state.clone()]

    def eager():
        return generate(lambda x, s: decode_step(x, s, *params))

    def served():
        manager = CUDAGraphTreeManager(device, "user_visible" if variant == "fix" else None)
        return generate(lambda x, s: manager.run("decode_step", decode_step, (x, s), params), manager.mark_step_begin)

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
