"""CUDA graph trees judge a forward's saved activation dead while its backward is pending, abandon the path, and replay the root over it.

Upstream: https://github.com/pytorch/pytorch/pull/194124 ("[inductor][cudagraphs] Make cached-tensor liveness see
pending backwards", pytorch/pytorch, eellison, opened 2026-08-19; landed the week of 2026-08-23, listed among the
Inductor commits of "This week in torch.compile #4 - Aug 30" as "Fixes a CUDA-graphs bug that could cause silent
gradient corruption in multi-graph training ...").
Read: the PR description (root cause as quoted below) and that release note; the diff itself is not in the corpus, so
the fixed predicate is written from the description. For the code around it: torch 2.13's (pre-fix)
``torch/_inductor/cudagraph_trees.py``: ``CUDAGraphNode._initialize_cached_tensors`` and its nested ``check_refcount``,
``get_output_refcount``, ``StorageWeakRefWrapper.expired``, ``all_outputs_are_dead``, ``check_invariants``,
``reconstruct_outputs``, and ``CUDAGraphTreeManager.run`` / ``_run`` / ``can_start_new_generation`` /
``try_end_curr_recording`` / ``try_end_curr_execution`` / ``try_end_curr_warmup`` / ``record_function`` /
``execute_node`` / ``run_eager`` / ``apply_checkpoint_execution_state_in_allocator``. The refcounts the predicate
reads were measured with torch 2.13 (a tensor held by the node's list and by an autograd ``SavedVariable``:
``_use_count() == 2``, ``sys.getrefcount == 3``; without the ``SavedVariable``: 1 and 2).
Symptom: ``torch.compile(mode="reduce-overhead")`` training whose compiled region is invoked several times per step
gets silently wrong gradients (the PR: "silent gradient corruption in multi-graph training workloads", loss NaN), or
``Detected N tensor(s) in the cudagraph pool not tracked as outputs``.
Mechanism: after a node executes, its outputs are cached tensors and their liveness is ``StorageWeakRefWrapper``
with ``extra_ref_check=check_refcount``. ``check_refcount`` "deliberately discounted one C++-side reference
(``_use_count() > 1 -> return refcount == 3``). Autograd's ``SavedVariable``, a pending backward's only grip on the
forward's saved activations, is exactly one C++-side reference. So a forward's path could read all-dead
mid-generation and be abandoned while its backward was still pending." Here the shared block runs twice in a step;
the user output of the first call is consumed, its saved activation ``a`` is held only by the pending backward. The
second call finds no child of the root, asks ``try_end_curr_execution``; ``all_outputs_are_dead()`` says yes, the
path ends, the rerun matches the root node again and replays it: the graph writes the second call's activation
into the memory the first call's ``SavedVariable`` still reads. The first call's backward computes with it.
Doctor: overwritten-output, at check_refcount (it declares the pending backward's saved activation dead, so the root
graph is replayed over that output before the backward reads it).
Fix (upstream): cached-tensor liveness counts the pending backward's C++-side reference: the saved activation is
live, the path stays, the second call is recorded as a child node with its own memory (after
``apply_checkpoint_execution_state_in_allocator``), and later steps replay root then child.
Modelled: ``CUDAGraphTreeManager`` (roots and children by function id, generations: every call is a new
torch.compile invocation, ``running_forwards_with_pending_backwards``, warmup, recording, execution, the checkpoint
before a recording during execution) and ``CUDAGraphNode`` (static input buffer, parameters read in place, one
shared graph pool, cached tensor outputs built on the graph's output storages, ``check_refcount`` reading real
refcounts, ``all_outputs_are_dead``) as read; the compiled forward is a ``torch.autograd.Function`` that saves the
cached activation with ``ctx.save_for_backward`` as AOTAutograd's ``CompiledFunction`` does, so the predicate sees a
real ``SavedVariable``. Stand-ins: ``StorageWeakRefWrapper`` subtracts the engine's own references to the graph
memory, measured when the cached tensor is made, where upstream subtracts 2 (storage object and cached tensor);
cached tensors are made at the first replay after recording (upstream: first execution, recording outputs are
counted on storages, which see the SavedVariable; no liveness decision falls in a recording step here);
``check_invariants`` only compares the parameters' addresses; the backward runs eagerly;
``dealloc_current_path_weakrefs`` frees nothing (the engine's pool decides reuse by holders). Not modelled: the PR's
later consequences (the backward recorded as a root of a foreign tree, its saved activations taken for static
inputs, their memory re-handed to another recording); the program shows the same misjudged liveness ending the path.
Workload: an ALBERT-style shared block ``h = x + tanh(x @ W + b)`` applied ``depth`` times from an eager loop (with
``h * 0.5`` between applications), loss ``(h * target).sum()``, SGD; depths 1, 1, 1 then 2, 2, 2 (the second
application switched on after three steps). Step 1 warms up, step 2 records the root, step 3 replays it; from step 4
the bug replays the root for both calls (the first call's gradient reads the second call's activation); the fix
records a child at step 4. Bug: the step-4 loss still equals eager, its gradients do not (dW off by 0.50), and the
run drifts (step-6 dW off by 1.15): max |graph - eager| = 1.15; fix: every loss and gradient equals eager (0).
"""
from __future__ import annotations

import sys
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from workbench.engine import events, graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/pytorch/pull/194124"
FAMILY = "persistent-buffer mutation"
KIND = "overwritten-output"
SITE = "check_refcount"
SYMPTOM = ("reduce-overhead training with a compiled block called twice per step: the first call's saved activation "
           "is judged dead while its backward is pending, the root graph replays over it, gradients silently wrong")

DIM, BATCH, LR, RESIDUAL_SCALE = 4, 3, 0.1, 0.5
DEPTHS = (1, 1, 1, 2, 2, 2)


def block_forward(x, weight, bias):
    """The compiled region (one FX graph): the block's output and the activation saved for its backward."""
    a = torch.tanh(x @ weight + bias)
    return x + a, a


class GenerationTracker:
    generation = 0          # bumped by every torch.compile invocation (a dynamo frame)


def _storage_use_count(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class StorageWeakRefWrapper:
    """Liveness of one output's storage; ``extra_ref_check`` decides for the cached tensor held by the node."""

    def __init__(self, inp: torch.Tensor, extra_ref_check=None):
        self.ref = StorageWeakRef(inp.untyped_storage())
        # the engine's own references to graph memory (upstream expects none besides the storage object)
        self.graph_refs = _storage_use_count(inp) - 1
        self.extra_ref_check = extra_ref_check

    def remove_extra_reference(self):
        self.extra_ref_check = None

    def expired(self) -> bool:
        if self.extra_ref_check is not None and not self.extra_ref_check():
            return False
        stor_count = torch._C._storage_Use_Count(self.ref.cdata) - self.graph_refs
        if self.extra_ref_check is not None:
            stor_count -= 1             # upstream: "-= 2", the Python storage object and the cached Tensor
        return stor_count == 0


def is_live(weak_ref: StorageWeakRefWrapper | None) -> bool:
    return weak_ref is not None and not weak_ref.expired()


class CUDAWarmupNode:
    """A warmup run: the function runs eagerly (``run_eager``); the path continues below it."""

    def __init__(self, parent):
        self.parent = parent


class CUDAGraphNode:
    def __init__(self, wrapped_function, static_input_idxs, parent, inputs, pool, device, variant):
        self.wrapped_function, self.static_input_idxs = wrapped_function, static_input_idxs
        self.parent, self.variant = parent, variant
        self.children: dict[str, list[CUDAGraphNode]] = {}
        # non-static inputs are copied into buffers of the node; parameters are read where they are
        self.static_inputs = [inp if i in static_input_idxs else inp.clone() for i, inp in enumerate(inputs)]
        self.static_input_data_ptrs = [inp.data_ptr() if i in static_input_idxs else None
                                       for i, inp in enumerate(inputs)]
        static = {f"input {i}": t for i, t in enumerate(self.static_inputs) if i not in static_input_idxs}
        self.graph, self.static_outputs = capture(lambda: wrapped_function(*self.static_inputs), device=device,
                                                  pool=pool, warmups=0, static=static,
                                                  owner="CUDAGraphTreeManager", name=f"node {id(self) % 997}")
        self.cached_tensor_outputs: list[torch.Tensor] = []
        self.outputs_weakrefs: list[StorageWeakRefWrapper | None] = [None] * len(self.static_outputs)

    @property
    def _path_from_root(self):
        nodes, node = [], self
        while node is not None:
            nodes.append(node)
            node = node.parent
        return reversed(nodes)

    def add_child(self, function_id, node):
        self.children.setdefault(function_id, []).append(node)

    def check_invariants(self, inputs) -> bool:
        return all(p is None or inputs[i].data_ptr() == p for i, p in enumerate(self.static_input_data_ptrs))

    def _copy_inputs_and_remove_from_src(self, new_inputs):
        for i, (dst, src) in enumerate(zip(self.static_inputs, new_inputs)):
            if i not in self.static_input_idxs:
                dst.copy_(src)

    def get_output_refcount(self, index: int) -> int:
        return sys.getrefcount(self.cached_tensor_outputs[index])

    def _initialize_cached_tensors(self):
        for i, o in enumerate(self.static_outputs):
            out = torch.empty(0, dtype=o.dtype, device=o.device).set_(
                o.untyped_storage(), o.storage_offset(), o.size(), o.stride())
            self_ref = weakref.ref(self)

            # one reference in our array, and calling sys.getrefcount bumps the refcount by one
            def check_refcount(i: int) -> bool:
                self_loc = self_ref()
                if self_loc is None:
                    return False
                refcount = self_loc.get_output_refcount(i)
                if self_loc.cached_tensor_outputs[i]._use_count() > 1:
                    if self_loc.variant == "bug":
                        # c10::Tensor may also holds one reference count
                        assert refcount >= 3
                        return refcount == 3
                    # the fix: that C++-side reference is a pending backward's SavedVariable: live
                    return False
                assert refcount >= 2
                return refcount == 2

            self.cached_tensor_outputs.append(out)
            self.outputs_weakrefs[i] = StorageWeakRefWrapper(out, extra_ref_check=lambda i=i: check_refcount(i))

    def reconstruct_outputs(self):
        if not self.cached_tensor_outputs:
            self._initialize_cached_tensors()
        return list(self.cached_tensor_outputs)

    def run_first_inputs(self, new_inputs):
        replay(self.graph, self.static_outputs)
        return self.reconstruct_outputs()

    def run(self, new_inputs):
        self._copy_inputs_and_remove_from_src(new_inputs)
        replay(self.graph, self.static_outputs)
        return self.reconstruct_outputs()

    def all_outputs_are_dead(self) -> bool:
        """All outputs of the path from this node to its root are dead."""
        return not any(is_live(ref) for node in self._path_from_root for ref in node.outputs_weakrefs)

    def remove_path_cached_tensors(self):
        for node in self._path_from_root:
            node.cached_tensor_outputs.clear()
            for ref in node.outputs_weakrefs:
                if ref is not None:
                    ref.remove_extra_reference()


class CUDAGraphTreeManager:
    def __init__(self, device, variant):
        self.device, self.variant = device, variant
        self.roots: dict[str, list[CUDAGraphNode]] = {}
        self.ids_to_funcs: dict[str, tuple] = {}
        self.warmed_up_functions: set[str] = set()
        self.path_state = "NONE"
        self._current_node: CUDAGraphNode | CUDAWarmupNode | None = None
        self.current_gen = -1
        self.running_forwards_with_pending_backwards = False
        self.cuda_graphs_thread_pool = graph_pool_handle(device)

    def add_function(self, function_id, model, static_input_idxs):
        self.ids_to_funcs[function_id] = (model, tuple(static_input_idxs))

    @property
    def current_node(self):
        return self._current_node

    @current_node.setter
    def current_node(self, value):
        self._current_node = value
        if value is None:
            self.path_state = "NONE"

    @property
    def in_recording(self):
        return self.path_state == "RECORDING"

    @property
    def in_warmup(self):
        return self.path_state == "WARMUP"

    def run(self, new_inputs, function_id):
        out = self._run(new_inputs, function_id)
        self.running_forwards_with_pending_backwards = True     # the forwards are pending following invocation
        return out

    def set_to_running_backward(self):
        self.running_forwards_with_pending_backwards = False

    def update_generation(self):
        self.current_gen = GenerationTracker.generation

    def in_new_torch_compile_invocation(self) -> bool:
        return self.current_gen != GenerationTracker.generation

    def can_start_new_generation(self) -> bool:
        if not self.in_new_torch_compile_invocation():
            return False
        return not self.running_forwards_with_pending_backwards

    def clear_current_path_state_and_set_to_none(self):
        self.current_node = None

    def dealloc_current_path_weakrefs(self):
        pass                # upstream frees the path's live outputs: the engine's pool reuses memory by holders

    def try_end_curr_recording(self, function_id):
        if self.can_start_new_generation():
            self.dealloc_current_path_weakrefs()
            self.clear_current_path_state_and_set_to_none()
            return
        if self.current_node.all_outputs_are_dead():
            self.clear_current_path_state_and_set_to_none()

    def try_end_curr_warmup(self, function_id):
        if self.can_start_new_generation():
            self.dealloc_current_path_weakrefs()
            self.current_node = None

    def try_end_curr_execution(self):
        if self.current_node is None:
            return
        if self.can_start_new_generation():
            self.clear_current_path_state_and_set_to_none()
            return
        if self.current_node.all_outputs_are_dead():
            self.clear_current_path_state_and_set_to_none()

    def apply_checkpoint_execution_state_in_allocator(self):
        # remove cached tensors, otherwise they would prevent memory from being reclaimed in subsequent recordings
        self.current_node.remove_path_cached_tensors()

    def _run(self, new_inputs, function_id):
        if self.in_recording:
            self.try_end_curr_recording(function_id)
        if self.in_warmup:
            self.try_end_curr_warmup(function_id)
        if function_id not in self.warmed_up_functions or self.in_warmup:
            return self.run_eager(new_inputs, function_id)
        child_nodes = self.roots if self.current_node is None else self.current_node.children
        if not self.in_recording:
            for child in child_nodes.get(function_id, []):
                if child.check_invariants(new_inputs):
                    return self.execute_node(child, new_inputs)
            # the function can't be run as a child of the current node: if it is a root, try to end the
            # current execution, then run again to hit the root matching case
            if self.current_node is not None and function_id in self.roots:
                self.try_end_curr_execution()
                if self.current_node is None:
                    return self._run(new_inputs, function_id)
            self.try_end_curr_execution()
            if self.current_node is not None:
                self.apply_checkpoint_execution_state_in_allocator()
        return self.record_function(new_inputs, function_id)

    def record_function(self, new_inputs, function_id):
        model, static_input_idxs = self.ids_to_funcs[function_id]
        node = CUDAGraphNode(model, static_input_idxs, self.current_node, new_inputs,
                             self.cuda_graphs_thread_pool, self.device, self.variant)
        if self.current_node is None:
            self.roots.setdefault(function_id, []).append(node)
        else:
            self.current_node.add_child(function_id, node)
        self.current_node = node
        self.path_state = "RECORDING"
        self.update_generation()
        return node.run_first_inputs(new_inputs)

    def execute_node(self, node, new_inputs):
        self.current_node = node
        self.path_state = "EXECUTION"
        self.update_generation()
        return node.run(new_inputs)

    def run_eager(self, new_inputs, function_id):
        self.warmed_up_functions.add(function_id)
        self.current_node = CUDAWarmupNode(self.current_node)
        self.path_state = "WARMUP"
        self.update_generation()
        with events.warmup(real=True):
            return list(self.ids_to_funcs[function_id][0](*new_inputs))


class CompiledFunction(torch.autograd.Function):
    """AOTAutograd's wrapper of the compiled block: the forward runs through the CUDA graph tree (or eagerly for
    the reference) and saves the activation the forward graph returned; the backward runs eagerly here."""

    @staticmethod
    def forward(ctx, x, weight, bias, manager):
        if manager is None:
            h, a = block_forward(x, weight, bias)
        else:
            GenerationTracker.generation += 1
            h, a = manager.run([x, weight, bias], "block")
        ctx.manager = manager
        ctx.save_for_backward(x, weight, a)         # a pending backward's only grip on the activation
        return h

    @staticmethod
    def backward(ctx, grad_h):
        if ctx.manager is not None:
            ctx.manager.set_to_running_backward()
        x, weight, a = ctx.saved_tensors
        dpre = grad_h * (1 - a * a)
        return grad_h + dpre @ weight.t(), x.t() @ dpre, dpre.sum(0), None


def run(variant: str, device: str = "cpu"):
    gen = generator(194124)
    weight0 = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
    bias0 = randn(DIM, gen=gen, device=device, scale=0.2)
    data = [(randn(BATCH, DIM, gen=gen, device=device), randn(BATCH, DIM, gen=gen, device=device))
            for _ in DEPTHS]

    def train(manager):
        weight = weight0.clone().requires_grad_(True)
        bias = bias0.clone().requires_grad_(True)
        outs = []
        for (x, target), depth in zip(data, DEPTHS):
            h = x
            for i in range(depth):                      # ALBERT-style: one shared block, applied depth times
                if i:
                    h = h * RESIDUAL_SCALE              # eager code of the loop, between the compiled calls
                h = CompiledFunction.apply(h, weight, bias, manager)
            loss = (h * target).sum()
            del h
            loss.backward()
            outs += [loss.detach(), weight.grad.clone(), bias.grad.clone()]
            with torch.no_grad():
                weight -= LR * weight.grad
                bias -= LR * bias.grad
            weight.grad = bias.grad = None
        return outs

    def served():
        manager = CUDAGraphTreeManager(device, variant)
        manager.add_function("block", block_forward, static_input_idxs=(1, 2))
        return train(manager)

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, lambda: train(None))
