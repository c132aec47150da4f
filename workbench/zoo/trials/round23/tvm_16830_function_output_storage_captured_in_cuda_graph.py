"""Relax's CUDA-graph rewrite puts a function's output in a cached static storage: every result aliases the last.

Upstream: https://github.com/apache/tvm/pull/16830 ("[Relax] Share storage allocs among functions after cuda graph
rewriting"), the part described as "updates rewriting to prevent capturing storages and bindings used as function
output" (the compiler MLC-LLM builds its models with; ``relax.backend.use_cuda_graph``).
Symptom: no user report is linked; the PR description states the defect: ``RewriteCUDAGraph`` "relies on the fact
output tensors are allocated with ``R.builtin.alloc_tensor``, however, this behavior changed after we enable storage
planning for output tensor [#16111, Jan 2024: a returned tensor gets an ``R.memory.alloc_storage`` of its upper-bound
size], which may also use ``R.memory.alloc_storage``". A tensor a Relax function returns then lives in cached static
memory that the captured graph writes, so "when the model is run the second time, the output tensor of the first run
get overwritten" (why outputs were kept out of captures in the original rewrite, mlc-ai/relax#89). The diff was
read: ``OutputStorageCollector`` and ``disabled_storage_vars_`` in ``rewrite_cuda_graph.cc``, test
``TestDisableCaptureOutput``.
Mechanism: after ``StaticPlanBlockMemory`` every tensor of ``embed`` (the output too) is an ``R.memory.alloc_tensor``
on an ``R.memory.alloc_storage`` of constant size. ``CUDAGraphRewritePlanner.IsStaticAllocStorage`` treats each such
storage as static: it is lifted into ``cuda_graph_alloc``, allocated once by ``vm.builtin.cuda_graph.get_cached_alloc``
and reused by every call, and every kernel whose arguments are all static (weights, tensors on static storages) is
lifted into ``embed_cuda_graph_capture`` and run by ``vm.builtin.cuda_graph.run_or_capture`` (first call: one eager
run, then capture; later calls: ``cudaGraphLaunch``). The output projection's destination is static too, so the
function returns a view of the cached ``storage3``; the next call's graph launch writes its own result there. A caller
that keeps one call's result while it calls the function again (here: embedding each new request before one batched
prefill) reads the last call's values for all of them.
Doctor: overwritten-output, at ``prefill_step`` (it reads request B's embedding after ``embed``'s replay for request
C wrote its own into the same cached output storage).
Fix (upstream): ``OutputStorageCollector::Collect`` walks each function backwards from its return value and collects
the storages of the ``R.memory.alloc_tensor`` bindings that end up in the output; ``IsStaticAllocStorage`` rejects
them (``disabled_storage_vars_``). The output storage is then allocated on every call, the kernel writing it is no
longer static and runs outside the captured region, and the graph keeps only the intermediate (``rms_norm``).
Simplified here: a three-kernel ``embed`` (``take`` -> ``rms_norm`` -> projection) stands for any Relax function with
a planned output; one capture key (a fixed token count); the sharing of storages across functions that #16830 also
adds is left out.
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/apache/tvm/pull/16830"
FAMILY = "persistent-buffer mutation"
KIND = "overwritten-output"
SITE = "prefill_step"
SYMPTOM = "every request embedded in one prefill step gets the last request's embedding"

VOCAB, HIDDEN, SEQ, EPS = 16, 4, 3, 1e-6


# ---------------------------------------------------------------- the Relax function, after StaticPlanBlockMemory
@dataclasses.dataclass(frozen=True)
class CallTIR:
    """A destination-passing kernel call: ``kernel(*args, out)``."""
    kernel: str
    args: tuple[str, ...]
    out: str


@dataclasses.dataclass(frozen=True)
class Function:
    inputs: tuple[str, ...]              # the first ``num_input`` params
    weights: tuple[str, ...]             # the remaining params: static by definition
    storages: dict[str, tuple[int, ...]]  # R.memory.alloc_storage, by planned size
    tensors: dict[str, str]              # R.memory.alloc_tensor: tensor -> its storage
    calls: tuple[CallTIR, ...]
    output: str


EMBED = Function(
    inputs=("input_ids",), weights=("embed_weight", "norm_weight", "proj_weight"),
    storages={"storage1": (SEQ, HIDDEN), "storage2": (SEQ, HIDDEN), "storage3": (SEQ, HIDDEN)},
    tensors={"alloc1": "storage1", "alloc2": "storage2", "alloc3": "storage3"},
    calls=(CallTIR("take", ("embed_weight", "input_ids"), "alloc1"),
           CallTIR("rms_norm", ("alloc1", "norm_weight"), "alloc2"),
           CallTIR("matmul", ("alloc2", "proj_weight"), "alloc3")),
    output="alloc3")


def take(weight, ids, out):
    out.copy_(weight[ids])


def rms_norm(x, w, out):
    out.copy_(x * torch.rsqrt((x * x).mean(-1, keepdim=True) + EPS) * w)


def matmul(x, w, out):
    out.copy_(x @ w)


KERNELS = {"take": take, "rms_norm": rms_norm, "matmul": matmul}


# ---------------------------------------------------------------- RewriteCUDAGraph
class OutputStorageCollector:
    """Collect the storage objects that are used as the function output (added by the fix)."""

    @staticmethod
    def collect(func: Function) -> set[str]:
        return {func.tensors[func.output]} if func.output in func.tensors else set()


@dataclasses.dataclass
class LiftedFunctionRewritePlan:
    static_storages: list[str]       # -> cuda_graph_alloc, allocated once (get_cached_alloc)
    captured: list[CallTIR]          # -> <func>_cuda_graph_capture (one region here)
    inputs: list[str]                # tensors the region reads
    outputs: list[str]               # tensors the region writes that are used outside it


class CUDAGraphRewritePlanner:
    def __init__(self, func: Function, variant: str):
        self.func = func
        self.disabled_storage_vars = OutputStorageCollector.collect(func) if variant == "fix" else set()

    def is_static_alloc_storage(self, storage: str) -> bool:
        if storage in self.disabled_storage_vars:
            return False
        # Check if the allocation has constant shape
        return all(isinstance(d, int) for d in self.func.storages[storage])

    def plan(self) -> LiftedFunctionRewritePlan:
        f = self.func
        storages = [s for s in f.storages if self.is_static_alloc_storage(s)]
        static = set(f.weights) | {t for t, s in f.tensors.items() if s in storages}
        captured = [c for c in f.calls if all(a in static for a in c.args) and c.out in static]
        written = {c.out for c in captured}
        used_outside = {a for c in f.calls if c not in captured for a in c.args} | {f.output}
        inputs = sorted({a for c in captured for a in c.args if a not in written})
        return LiftedFunctionRewritePlan(storages, captured, inputs, sorted(written & used_outside))


# ---------------------------------------------------------------- the VM and its CUDA graph extension
class CUDAGraphExtension:
    def __init__(self, device):
        self.device = device
        self.capture_cache: dict[int, tuple] = {}
        self.alloc_cache: dict[int, dict] = {}

    def get_cached_alloc(self, alloc_func, entry_index):
        if entry_index not in self.alloc_cache:
            self.alloc_cache[entry_index] = alloc_func()
        return self.alloc_cache[entry_index]

    def run_or_capture(self, capture_func, args, entry_index, static):
        if entry_index in self.capture_cache:
            graph, states = self.capture_cache[entry_index]
            return replay(graph, states)                          # cudaGraphLaunch
        # Run the function without CUDA graph. This is a warm up step to do necessary initialization
        # of the CUDA module such as loading module data, setting kernel attributes.
        with events.warmup(real=True):
            capture_func(*args)
        graph, states = capture(lambda: capture_func(*args), device=self.device, warmups=0,
                                static=static, owner="vm.builtin.cuda_graph.run_or_capture")
        self.capture_cache[entry_index] = (graph, states)
        return states


class VirtualMachine:
    def __init__(self, func: Function, params: dict, device: str, variant: str, use_cuda_graph: bool):
        self.func, self.params, self.device = func, params, device
        self.plan = CUDAGraphRewritePlanner(func, variant).plan() if use_cuda_graph else None
        self.cuda_graph = CUDAGraphExtension(device)

    def _alloc_storage(self, name):
        return torch.empty(self.func.storages[name], device=self.device)

    def cuda_graph_alloc(self):
        return {s: self._alloc_storage(s) for s in self.plan.static_storages}

    def embed_cuda_graph_capture(self, *tensors):
        env = dict(zip(self.plan.inputs + [c.out for c in self.plan.captured], tensors))
        for c in self.plan.captured:
            KERNELS[c.kernel](*(env[a] for a in c.args), env[c.out])
        return tuple(env[o] for o in self.plan.outputs)

    def invoke(self, input_ids):
        """``embed`` as the rewrite leaves it (or as built without ``use_cuda_graph``)."""
        f, plan = self.func, self.plan
        env = dict(self.params, input_ids=input_ids)
        cached = self.cuda_graph.get_cached_alloc(self.cuda_graph_alloc, 0) if plan else {}
        for tensor, storage in f.tensors.items():     # R.memory.alloc_tensor on a cached or a fresh storage
            env[tensor] = cached[storage] if storage in cached else self._alloc_storage(storage)
        region_done = False
        for call in f.calls:
            if plan and call in plan.captured:
                if not region_done:
                    args = [env[a] for a in plan.inputs] + [env[c.out] for c in plan.captured]
                    static = {a: env[a] for a in plan.inputs if a in f.tensors}
                    states = self.cuda_graph.run_or_capture(self.embed_cuda_graph_capture, args, 0, static)
                    env.update(zip(plan.outputs, states))
                    region_done = True
                continue
            KERNELS[call.kernel](*(env[a] for a in call.args), env[call.out])
        return env[f.output]


# ---------------------------------------------------------------- the serving loop
def prefill_step(vm, requests):
    """Embed every new request (one ``embed`` call each), then run the batched prefill on all of them."""
    embeddings = [vm.invoke(ids) for ids in requests]
    hidden = torch.cat(embeddings)                     # reads every request's embedding
    return hidden.clone()


def run(variant: str, device: str = "cpu"):
    gen = generator(16830)
    params = {"embed_weight": randn(VOCAB, HIDDEN, gen=gen, device=device),
              "norm_weight": randn(HIDDEN, gen=gen, device=device, scale=0.5) + 1.0,
              "proj_weight": randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.7)}
    reqs = [torch.randint(0, VOCAB, (SEQ,), generator=gen).to(device) for _ in range(6)]

    def serve(use_cuda_graph: bool):
        vm = VirtualMachine(EMBED, params, device, variant, use_cuda_graph)
        return [prefill_step(vm, reqs[0:1]),           # first call: warm-up run, then capture
                prefill_step(vm, reqs[1:3]),           # two new requests in one step
                prefill_step(vm, reqs[3:4]),
                prefill_step(vm, reqs[4:6])]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
