"""CUDA graph trees judge an output dead by its Tensor object, miss the caller's detached alias, and replay over it.

Upstream: https://github.com/pytorch/pytorch/pull/96154 ("Use Storages for Cudagraph liveness"), in the
CUDA graph trees stack (#89146) behind ``torch.compile(mode="reduce-overhead")`` (PyTorch 2.1 dev, March 2023).
Symptom (from the PR description; no user report is linked): the tensor-based liveness "had a particularly
bad interaction with aot autograd detaching, since it would treat all outputs as dead": a result returned by
a compiled function silently changes to the result of a later call of the same function in the same
generation.
Mechanism: a ``CUDAGraphNode`` tracked whether its outputs were still in use through weak references to the
output Tensor objects it reconstructed after each replay (``outputs_weakrefs``). AOTAutograd's runtime
wrapper hands the caller ``out.detach()``: a new TensorImpl on the same storage, so the node's own output
tensors die as soon as the call returns while the caller still reads their memory. On the next invocation
in the same generation, ``CUDAGraphTreeManager._run`` finds no child for the function, calls
``try_end_curr_execution``; ``all_outputs_are_dead()`` answers yes, the current path ends, and the rerun
matches the root node again (its ``check_invariants`` sees the same dead outputs) and replays it: the graph
rewrites the output memory the caller's alias still holds. Modelled: the generation is delimited by
``torch.compiler.cudagraph_mark_step_begin()`` (a later API, used so that two calls of one compiled encoder
share a generation without a pending backward, as in a two-tower scorer); eager keeps both embeddings.
Doctor: overwritten-output, at ``all_outputs_are_dead`` (it declares the first call's output dead while the
caller's detached alias still holds its memory, so the second call replays the same graph over it).
Fix (upstream): liveness tracked on storages (``StorageWeakRef`` from ``torch.multiprocessing.reductions``,
later ``StorageWeakRefWrapper``): an output is dead only when no tensor uses its storage. The alias keeps
the first output live, so the second call is recorded as a child node (its own graph and memory) and
replayed as such on later steps; the first result stays intact.
"""
from __future__ import annotations

import weakref

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/pytorch/pull/96154"
FAMILY = "persistent-buffer mutation"
KIND = "overwritten-output"
SITE = "all_outputs_are_dead"
SYMPTOM = "the first call's embedding silently becomes the second call's: query and document scores wrong"
DIM, BATCH, STEPS = 4, 3, 4


def encoder(x, weight, bias):
    """The compiled function (one tower of a two-tower scorer; both towers share it)."""
    return torch.tanh(x @ weight + bias)


def _storage_use_count(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class StorageWeakRef:
    """Liveness of an output's storage: alive while any tensor besides the graph's own static output uses it."""

    def __init__(self, static_out: torch.Tensor, baseline: int):
        self.static_out, self.baseline = static_out, baseline

    def __call__(self):
        return self if _storage_use_count(self.static_out) > self.baseline else None


class CUDAGraphNode:
    def __init__(self, wrapped_function, inputs, device, variant, parent):
        self.variant, self.parent = variant, parent
        self.children: dict[str, list[CUDAGraphNode]] = {}
        self.static_input = inputs[0].clone()
        self.params = inputs[1:]
        self.graph, self.static_output = capture(
            lambda: wrapped_function(self.static_input, *self.params), device=device, warmups=0,
            static={"x": self.static_input}, owner="CUDAGraphTreeManager", name=f"node {id(self) % 997}")
        self.baseline = _storage_use_count(self.static_output)   # the graph's own references
        self.outputs_weakrefs: list = []

    def all_outputs_are_dead(self) -> bool:
        return all(ref() is None for ref in self.outputs_weakrefs)

    def check_invariants(self, new_inputs) -> bool:
        """The memory this replay writes must not be held: its previous outputs are expected dead."""
        return self.all_outputs_are_dead()

    def run(self, new_inputs):
        self.static_input.copy_(new_inputs[0])
        handed_out = replay(self.graph, self.static_output)
        out = handed_out.view_as(handed_out)        # _reconstruct_outputs: a fresh tensor on the pool memory
        if self.variant == "bug":
            self.outputs_weakrefs = [weakref.ref(out)]                          # the Tensor object
        else:
            self.outputs_weakrefs = [StorageWeakRef(self.static_output, self.baseline)]  # its storage
        return out


class CUDAGraphTreeManager:
    def __init__(self, device, variant):
        self.device, self.variant = device, variant
        self.roots: dict[str, list[CUDAGraphNode]] = {}
        self.current_node: CUDAGraphNode | None = None
        self.current_gen = -1
        self.mark_step_counter = 0
        self.warmed_up_functions: set[str] = set()

    def mark_step_begin(self):
        self.mark_step_counter -= 1

    def can_start_new_generation(self) -> bool:
        return self.current_gen != self.mark_step_counter

    def clear_current_path_state_and_set_to_none(self):
        """End the current path: its outputs are given up (a new generation may overwrite them)."""
        node = self.current_node
        while node is not None:
            node.outputs_weakrefs = []
            node = node.parent
        self.current_node = None

    def try_end_curr_execution(self):
        if self.current_node is None:
            return
        if self.can_start_new_generation():
            self.clear_current_path_state_and_set_to_none()
            return
        if self.current_node.all_outputs_are_dead():
            self.clear_current_path_state_and_set_to_none()

    def run(self, function_id, wrapped_function, new_inputs):
        out = self._run(function_id, wrapped_function, new_inputs)
        self.current_gen = self.mark_step_counter
        return out.detach()                        # AOTAutograd's runtime wrapper: a detached alias

    def _run(self, function_id, wrapped_function, new_inputs):
        if function_id not in self.warmed_up_functions:      # CUDAWarmupNode: the first call runs eagerly
            self.warmed_up_functions.add(function_id)
            with events.warmup(real=True):
                return wrapped_function(*new_inputs)
        children = self.roots if self.current_node is None else self.current_node.children
        for child in children.get(function_id, []):
            if child.check_invariants(new_inputs):
                self.current_node = child
                return child.run(new_inputs)
        if self.current_node is not None and function_id in self.roots:
            self.try_end_curr_execution()
            if self.current_node is None:
                return self._run(function_id, wrapped_function, new_inputs)
        node = CUDAGraphNode(wrapped_function, new_inputs, self.device, self.variant, self.current_node)
        children.setdefault(function_id, []).append(node)   # record_function: a child on the current path
        self.current_node = node
        return node.run(new_inputs)


def run(variant: str, device: str = "cpu"):
    gen = generator(96154)
    weight = randn(DIM, DIM, gen=gen, device=device, scale=0.6)
    bias = randn(DIM, gen=gen, device=device, scale=0.2)
    pairs = [(randn(BATCH, DIM, gen=gen, device=device), randn(BATCH, DIM, gen=gen, device=device))
             for _ in range(STEPS)]

    def score(encode, mark_step_begin=lambda: None):
        outs = []
        for query, doc in pairs:
            mark_step_begin()                                  # torch.compiler.cudagraph_mark_step_begin()
            q = encode(query)
            d = encode(doc)
            outs += [(q * d).sum(dim=1), q.clone(), d.clone()]
        return outs

    def served():
        manager = CUDAGraphTreeManager(device, variant)
        return score(lambda x: manager.run("encoder", encoder, (x, weight, bias)), manager.mark_step_begin)

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served,
                   lambda: score(lambda x: encoder(x, weight, bias)))
