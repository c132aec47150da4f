"""TVM's RewriteCUDAGraph lifted a host ``vm.builtin`` call into the captured region: it ran once, at capture.

Upstream: https://github.com/apache/tvm/pull/15145 ("[Unity] Fix handling of vm builtins in cuda graph",
commit cb451e27d0, June 2023).
Symptom: none stated in the PR (it adds the regression test ``test_vm_builtin``, whose expected module
keeps ``R.call_packed("vm.builtin.dummy", ...)`` in ``main``, outside ``cuda_graph_capture``). The harm
modelled here is the one the diff implies: a host-side VM builtin whose arguments are all static is moved
into the function that ``vm.builtin.cuda_graph.run_or_capture`` captures once and then only replays, so its
host work runs at warm-up and capture and never again; every later call reuses what it computed then.
Mechanism: ``CUDAGraphRewritePlanner::VisitBinding_`` (src/relax/transform/rewrite_cuda_graph.cc) lifts a
call into the current capture region when ``IsStatic(call->args)`` holds and the callee is a PrimFunc, an
``ExternFunc`` or a non-memory op. Before the fix every ``ExternFuncNode`` counted as a kernel launch,
including host-side ``vm.builtin.*`` packed functions. ``RunOrCapture`` (cuda_graph_builtin.cc) runs the
capture function once eagerly (warm-up), once under stream capture, then launches the cached graph on every
later call: Python/C++ host work inside it is not part of the graph. Here the builtin keeps host state across
calls (a counter of its invocations, as KV-cache bookkeeping builtins count appended rows) and writes
``alloc1`` shifted by that count into ``lv``, which the next kernel (``exp(alloc2, alloc3)``, outside the
graph) reads. With the builtin lifted, ``lv`` holds the capture-time shift on every replay.
The builtin's body is modelled (the upstream test uses a no-op ``vm.builtin.dummy``); the relax program is
the test's ``Before`` module, except that ``alloc2`` gets its own static storage and the builtin's first
argument is the static ``alloc1`` instead of the parameter ``x`` (so that, as the fix's title says, the
builtin itself -- not a dynamic argument -- is what decides whether it may be lifted).
Doctor: host-work-frozen, at ``vm_builtin_dummy`` (host work run once inside the captured region).
Fix (upstream): an ``ExternFunc`` whose ``global_symbol`` starts with ``vm.builtin`` is never static, so the
call ends the capture region and stays in ``main``; ``relax.reshape`` no longer opens a region, and
``IsStatic`` over an array collects every var instead of short-circuiting (so all vars a non-lifted binding
uses are marked as outputs of the region that defines them).
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/apache/tvm/pull/15145"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "vm_builtin_dummy"
SYMPTOM = "a host vm.builtin lifted into the CUDA graph runs only at capture; replays reuse its result"

SHAPE = (2, 4)
NUM_CALLS = 5

# The relax ``main`` after memory planning (the test's ``Before``): (var, op, args). Ops: memory.* and
# builtin.* are allocations, ``call_tir`` a PrimFunc launch, ``call_packed`` an ExternFunc, ``var`` a rebinding.
# The static storages come first: the rewritten ``main`` fetches them all at its top from
# ``vm.builtin.cuda_graph.get_cached_alloc``.
MAIN = [
    ("storage", "memory.alloc_storage", ()),
    ("storage1", "memory.alloc_storage", ()),
    ("storage2", "memory.alloc_storage", ()),
    ("alloc", "memory.alloc_tensor", ("storage",)),
    ("_1", "call_tir:exp", ("x", "alloc")),
    ("alloc1", "memory.alloc_tensor", ("storage1",)),
    ("_2", "call_tir:exp", ("alloc", "alloc1")),
    ("alloc2", "memory.alloc_tensor", ("storage2",)),
    ("lv", "var", ("alloc2",)),
    ("_4", "call_packed:vm.builtin.dummy", ("alloc1", "lv")),
    ("alloc3", "builtin.alloc_tensor", ()),
    ("_6", "call_tir:exp", ("alloc2", "alloc3")),
]
RETURN = "alloc3"


# ----------------------------------------------------------------------------- the kernels and builtins
def exp(src, dst):
    """The test's PrimFunc ``exp`` (destination-passing style)."""
    torch.exp(src, out=dst)


class VMBuiltins:
    """Host-side packed functions registered with the VM (``TVM_REGISTER_GLOBAL("vm.builtin...")``)."""

    def __init__(self):
        self.num_calls = 0                      # host state kept across calls

    def vm_builtin_dummy(self, src, dst):
        """Host bookkeeping each call: count the call, then write ``src`` shifted by the count into ``dst``
        (the count is a host value handed to the device copy)."""
        self.num_calls += 1
        dst.copy_(src - 0.5 * self.num_calls)


# ----------------------------------------------------------------------------- RewriteCUDAGraph (planner)
class CUDAGraphRewritePlanner:
    """The binding walk of ``CUDAGraphRewritePlanner``: static bindings, capture regions, region outputs."""

    def __init__(self, variant):
        self.variant = variant
        self.static_bindings: set[str] = set()
        self.capture_builder: list | None = None       # bindings of the region being built
        self.binding_to_region: dict[str, int] = {}
        self.captured_regions: list[list] = []
        self.region_outputs: list[set] = []

    def Plan(self, bindings):
        for binding in bindings:
            self.VisitBinding(binding)
        self.EndRegion()
        return [(region, outs) for region, outs in zip(self.captured_regions, self.region_outputs)]

    def StartRegion(self):
        self.capture_builder = []

    def EndRegion(self):
        if self.capture_builder:
            self.captured_regions.append(self.capture_builder)
            self.region_outputs.append(set())
        self.capture_builder = None

    def IsStatic(self, args, vars_collector):
        result = True
        for a in args:
            vars_collector.append(a)
            result &= a in self.static_bindings
            if not result and self.variant == "bug":   # std::all_of: stops collecting at the first miss
                return False
        return result

    def AddStaticBinding(self, binding):
        var = binding[0]
        if self.capture_builder is not None:
            self.capture_builder.append(binding)
            self.binding_to_region[var] = len(self.captured_regions)
        self.static_bindings.add(var)

    def MarkAsFuncOutput(self, vars_):
        for v in vars_:
            region = self.binding_to_region.get(v)
            if region is not None and (self.capture_builder is None or region != len(self.captured_regions)):
                self.region_outputs[region].add(v)

    def VisitBinding(self, binding):
        var, op, args = binding
        if op == "memory.alloc_storage":                # constant shape: lifted to cuda_graph_alloc
            self.static_bindings.add(var)
            return
        if op == "builtin.alloc_tensor":                # dynamic allocation: not static
            return
        vars_: list[str] = []
        if op == "var":
            is_all_static, is_kernel_launch = self.IsStatic(args, vars_), False
        else:
            is_all_static = self.IsStatic(args, vars_)
            if self.variant == "fix" and op.startswith("call_packed:vm.builtin"):
                is_all_static = False                   # a VM builtin is host code: never lifted
            is_kernel_launch = op.startswith(("call_tir:", "call_packed:"))   # PrimFunc or ExternFunc
        if is_all_static:
            if self.capture_builder is None and is_kernel_launch:
                self.StartRegion()
            self.AddStaticBinding(binding)
        else:
            self.EndRegion()
        self.MarkAsFuncOutput(vars_)


# ----------------------------------------------------------------------------- the relax VM
class VirtualMachine:
    def __init__(self, device, variant, use_cuda_graph):
        self.device = device
        self.builtins = VMBuiltins()
        self.alloc_cache: dict[int, dict] = {}          # vm.builtin.cuda_graph.get_cached_alloc
        self.capture_cache: dict[int, tuple] = {}       # vm.builtin.cuda_graph.run_or_capture
        self.plans = CUDAGraphRewritePlanner(variant).Plan(MAIN) if use_cuda_graph else []
        self.lifted = {b[0]: i for i, (region, _) in enumerate(self.plans) for b in region}
        self.launch_points = {region[0][0]: i for i, (region, _) in enumerate(self.plans)}

    def get_cached_alloc(self, entry_index):
        if entry_index not in self.alloc_cache:
            self.alloc_cache[entry_index] = {}
        return self.alloc_cache[entry_index]

    def eval_binding(self, env, binding):
        var, op, args = binding
        if op == "memory.alloc_storage":
            storages = self.get_cached_alloc(0)
            if var not in storages:
                storages[var] = torch.zeros(SHAPE[0] * SHAPE[1], device=self.device)
            env[var] = storages[var]
        elif op == "memory.alloc_tensor":
            env[var] = env[args[0]].view(SHAPE)
        elif op == "builtin.alloc_tensor":
            env[var] = torch.empty(SHAPE, device=self.device)
        elif op == "var":
            env[var] = env[args[0]]
        elif op.startswith("call_tir:"):
            {"exp": exp}[op.split(":", 1)[1]](*(env[a] for a in args))
        elif op.startswith("call_packed:"):
            name = op.split(":", 1)[1]
            {"vm.builtin.dummy": self.builtins.vm_builtin_dummy}[name](*(env[a] for a in args))

    def run_or_capture(self, env, entry_index):
        """``CUDAGraphCache::RunOrCapture``: warm up and capture ``cuda_graph_capture`` once, then launch."""
        region, outputs = self.plans[entry_index]
        names = sorted(outputs)
        if entry_index not in self.capture_cache:
            inputs = {a: env[a] for _, _, args in region for a in args if a not in self.lifted}

            def cuda_graph_capture():
                local = dict(inputs)
                for binding in region:
                    self.eval_binding(local, binding)
                return tuple(local[n] for n in names)

            graph, states = capture(cuda_graph_capture, device=self.device, warmups=1,
                                    owner="relax VM (cuda_graph_capture)", static={"alloc": env["alloc"]})
            self.capture_cache[entry_index] = (graph, states)
        else:
            graph, states = self.capture_cache[entry_index]
            states = replay(graph, states)
        env.update(zip(names, states))

    def invoke_main(self, x):
        env = {"x": x}
        for binding in MAIN:
            var = binding[0]
            if var in self.launch_points:
                self.run_or_capture(env, self.launch_points[var])
            if var in self.lifted:
                continue
            self.eval_binding(env, binding)
        return env[RETURN].clone()


def run(variant: str, device: str = "cpu"):
    gen = generator(15145)
    xs = [randn(*SHAPE, gen=gen, device=device, scale=0.3) for _ in range(NUM_CALLS)]

    def serve(use_cuda_graph: bool):
        vm = VirtualMachine(device, variant, use_cuda_graph)
        return [vm.invoke_main(x) for x in xs]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
