"""chipStar ``hipGraphExecKernelNodeSetParams`` never reaches the executable's node, so every later ``hipGraphLaunch`` replays the kernel arguments bound at instantiation.

Upstream: https://github.com/CHIP-SPV/chipStar/pull/1522 ("hipGraph: fixes needed by Kokkos::Graph on chipStar",
merged; opened 2026-08-29, Aurora PVC pass reported 2026-09-01). It fixes
https://github.com/CHIP-SPV/chipStar/issues/1498 ("hipGraphExec*NodeSetParams fail on any graph not made by
hipGraphClone and update the original node"), which was found while running the Kokkos::Graph unit tests on Aurora.
The reproducer is ``tests/runtime/TestFixGraphExecKernelNodeSetParams.hip``.
Symptom: a HIP program builds a graph with one kernel node, instantiates it, launches it, and then changes the node's
argument with ``hipGraphExecKernelNodeSetParams``. On chipStar the call itself fails: the repro's check prints
"FAIL: hipGraphExecKernelNodeSetParams(...)". The executable keeps the argument bound at instantiation. User code that
does not check the returned ``hipError_t`` gets no warning; the common "update the exec's kernel node, relaunch"
wrapper is one such case. That code keeps replaying the old arguments: here, the first step's ``dt`` on every step.
Eager ``hipLaunchKernel`` is correct.
Mechanism (pre-fix ``src/CHIPBindings.cc`` / ``src/CHIPGraph.{hh,cc}``, snapshot of 2026-08-05):
``hipGraphInstantiate`` builds a ``CHIPGraphExec`` holding ``OriginalGraph_`` (the caller's graph) and
``CompiledGraph_``, a copy made by the ``CHIPGraph`` copy constructor, which fills the copy's ``CloneMap_``
(original node -> copy). ``hipGraphExecKernelNodeSetParams`` has three defects:
  1. It resolves the node with ``EXEC(hGraphExec)->getOriginalGraphPtr()`` and
     ``GRAPH(Graph)->getClonedNodeFromOriginal(NODE(node))``, i.e. in the clone map of the *original* graph. That map
     is filled only for a graph that itself came from ``hipGraphClone``. For an ordinary graph (built with
     ``hipGraphAddKernelNode`` or captured) the lookup throws ``CHIPError("Failed to find the node in clone",
     hipErrorTbd)``, which ``CHIP_CATCH`` turns into the return value. Nothing is updated.
  2. Where the lookup does succeed, the node it returns is not the one the executable runs:
     ``CHIPGraphExec::launch`` / ``compile()`` schedule and execute ``OriginalGraph_->getNodes()``.
  3. ``CHIPGraphNodeKernel::setParams`` only did ``Params_ = Params``. The node's ``ExecItem_`` keeps the argument
     bytes bound at construction (``copyKernelArgs`` -> ``createExecItem`` -> ``setArgs`` -> ``setupAllArgs``), and
     ``execute()`` launches that ``ExecItem_``.
So after any call, what runs is the argument set bound when the node was built. In the "implicit graph" wrapper
modelled here, the first call builds and instantiates the graph; each later call does
``update_kernel_node(key, params)`` -> ``hipGraphExecKernelNodeSetParams(exec, node, &params)`` with the result
unchecked, then ``hipGraphLaunch``. Every step therefore replays step 0's time step ``dt``.
Doctor: stale-input, at ``hipGraphExecKernelNodeSetParams``. The kernel argument slots the executable launches with
are a static input of the replay. This step's update of them (the refresh the fix makes reach the executable's node)
is skipped, so every replayed step reads the ``dt`` that instantiation wrote there. The eager launch binds this
step's ``dt``.
Fix (upstream): the ``hipGraphExec*NodeSetParams`` bindings resolve the node through the executable's own copy, as
hipamd's ``GetClonedNode`` does, and update that copy; the original graph is untouched.
``CHIPGraphNodeKernel::setParams`` now copies the argument bytes into fresh ``ArgData_`` / ``ArgList_`` and rebuilds
``ExecItem_`` (``delete ExecItem_; createExecItem; setKernel; useIndependentKernelHandle; setArgs; setupAllArgs``).
The constructors and the copy constructor go through it. ``CHIPGraphExec::launch`` keeps the schedule built from the
original nodes but executes ``CompiledGraph_.nodeLookup(Node)``, "the node's copy in the compiled graph: it holds the
parameters set through hipGraphExec*NodeSetParams". (Read: the post-fix ``src/CHIPGraph.cc``, both ``setParams``
and ``launch``, plus the repro and the issue text. The ``CHIPBindings.cc`` hunk itself was not read; its lookup through
the executable's copy is taken from the issue and the ``launch`` comment.)
Modelled: one kernel ``relax(double *u, const double *f, float dt, float lam)`` that does
``u[i] += dt * (f[i] - lam * u[i])``. It is a relaxation step toward a forcing term that the host refreshes every step
(``hipMemcpy`` into ``f``), with an adaptive ``dt``. An exec item's scalar argument slots are a small device tensor;
the kernel reads it when it runs, and pointer arguments are kept as references. ``hipGraphInstantiate`` captures the
executable's node walk once, and ``hipGraphLaunch`` replays it. chipStar re-walks the nodes at each launch, so the
rebuilt ``ExecItem_`` of ``setParams`` is modelled as re-binding the node's own argument slots, in place.
The user is the "implicit graph" wrapper ``Task`` (``wrap`` / ``add_kernel_node`` / ``update_kernel_node`` /
``launch_graph``, the HIP port of the CUDA "graphs in a dynamic environment" pattern). Like that pattern, it ignores
the setter's return value, and it builds its node with ``hipGraphAddKernelNode`` as the repro does (stream capture
is not modelled). Left out: the other ``hipGraphExec*NodeSetParams`` bindings, memset / host / event nodes, and graph
pruning. The ``hipGraphClone`` path of defect 1 is implemented but not exercised.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/CHIP-SPV/chipStar/pull/1522"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "hipGraphExecKernelNodeSetParams"
SYMPTOM = ("after hipGraphExecKernelNodeSetParams the next hipGraphLaunch still runs the kernel with the "
           "arguments bound at instantiation (the update fails to find the node, hipErrorTbd)")

N, STEPS = 16, 6
DT0, DT_GROWTH, DT_MAX, LAM = 0.05, 1.6, 0.4, 2.0

hipSuccess, hipErrorInvalidValue, hipErrorTbd = "hipSuccess", "hipErrorInvalidValue", "hipErrorTbd"
VARIANT = {"v": "bug"}


class CHIPError(Exception):
    def __init__(self, msg: str, code: str):
        super().__init__(msg)
        self.code = code

    def toHIPError(self) -> str:
        return self.code


# --- the device code ---------------------------------------------------------------------------------------------

def relax(u: torch.Tensor, f: torch.Tensor, slots: torch.Tensor):
    """``__global__ void relax(double *u, const double *f, float dt, float lam)``: ``u[i] += dt * (f[i] - lam*u[i])``.
    ``dt`` and ``lam`` are read from the exec item's bound argument slots when the kernel runs."""
    dt, lam = slots[0], slots[1]
    u.add_(dt * (f - lam * u))


class hipKernelNodeParams:
    def __init__(self, func, kernelParams, gridDim=1, blockDim=N):
        self.func, self.kernelParams, self.gridDim, self.blockDim = func, list(kernelParams), gridDim, blockDim


def copyKernelArgs(kernelParams):
    """Copy the argument bytes out of the caller's ``void **`` (pointers by value, scalars by value)."""
    return list(kernelParams)


# --- src/CHIPBackend: exec items and the queue ---------------------------------------------------------------------

class ExecItem:
    def __init__(self, device: str):
        self.device = device
        self.Kernel_, self.Args_ = None, ()
        self.Slots_ = torch.zeros(2, device=device)       # the bound scalar argument bytes (dt, lam)

    def setKernel(self, func):
        self.Kernel_ = func

    def setArgs(self, args):
        self.Args_ = tuple(args)

    def setupAllArgs(self):
        """Bind the arguments: pointers are kept, scalars are written into the item's argument slots."""
        scalars = [a for a in self.Args_ if not isinstance(a, torch.Tensor)]
        for i, value in enumerate(scalars):
            self.Slots_[i].fill_(float(value))

    def clone(self) -> "ExecItem":
        item = ExecItem(self.device)
        item.Kernel_, item.Args_ = self.Kernel_, self.Args_
        item.Slots_.copy_(self.Slots_)
        return item


class Queue:
    def launch(self, item: ExecItem):
        pointers = [a for a in item.Args_ if isinstance(a, torch.Tensor)]
        item.Kernel_(*pointers, item.Slots_)


def createExecItem(device: str) -> ExecItem:
    return ExecItem(device)


# --- src/CHIPGraph.{hh,cc} -----------------------------------------------------------------------------------------

class CHIPGraphNodeKernel:
    def __init__(self, TheParams: hipKernelNodeParams | None, device: str):
        self.device, self.ExecItem_ = device, None
        if TheParams is None:                            # the copy constructor fills it
            return
        if VARIANT["v"] == "fix":
            self.setParams(TheParams)
            return
        # pre-fix constructor: bind the exec item inline, once
        self.ArgList_ = copyKernelArgs(TheParams.kernelParams)
        self.Params_ = hipKernelNodeParams(TheParams.func, self.ArgList_, TheParams.gridDim, TheParams.blockDim)
        self.ExecItem_ = createExecItem(device)
        self.ExecItem_.setKernel(self.Params_.func)
        self.ExecItem_.setArgs(self.Params_.kernelParams)
        self.ExecItem_.setupAllArgs()

    def getParams(self) -> hipKernelNodeParams:
        return self.Params_

    def setParams(self, Params: hipKernelNodeParams):
        if VARIANT["v"] == "bug":
            self.Params_ = Params                        # void setParams(...) { Params_ = Params; }
            return
        # #1522: fresh argument bytes and a rebuilt exec item (modelled: re-bind this node's own slots in place)
        self.ArgList_ = copyKernelArgs(Params.kernelParams)
        self.Params_ = hipKernelNodeParams(Params.func, self.ArgList_, Params.gridDim, Params.blockDim)
        if self.ExecItem_ is None:
            self.ExecItem_ = createExecItem(self.device)
        self.ExecItem_.setKernel(self.Params_.func)
        self.ExecItem_.setArgs(self.Params_.kernelParams)
        self.ExecItem_.setupAllArgs()

    def clone(self) -> "CHIPGraphNodeKernel":
        node = CHIPGraphNodeKernel(None, self.device)
        if VARIANT["v"] == "fix":
            node.setParams(self.Params_)                 # the copy gets its own argument bytes and exec item
        else:
            node.Params_ = self.Params_
            node.ExecItem_ = self.ExecItem_.clone()
        return node

    def execute(self, queue: Queue):
        queue.launch(self.ExecItem_)


class CHIPGraph:
    def __init__(self, OriginalGraph: "CHIPGraph | None" = None):
        self.Nodes_: list[CHIPGraphNodeKernel] = []
        self.CloneMap_: dict[int, CHIPGraphNodeKernel] = {}   # original node -> clone, keyed on identity
        if OriginalGraph is not None:                    # CHIPGraph(const CHIPGraph &OriginalGraph)
            for OriginalNode in OriginalGraph.Nodes_:
                CloneNode = OriginalNode.clone()
                self.Nodes_.append(CloneNode)
                self.CloneMap_[id(OriginalNode)] = CloneNode

    def addNode(self, node: CHIPGraphNodeKernel):
        self.Nodes_.append(node)

    def getNodes(self):
        return list(self.Nodes_)

    def nodeLookup(self, OriginalNode):
        return self.CloneMap_.get(id(OriginalNode))

    def getClonedNodeFromOriginal(self, OriginalNode):
        if id(OriginalNode) not in self.CloneMap_:
            raise CHIPError("Failed to find the node in clone", hipErrorTbd)
        return self.CloneMap_[id(OriginalNode)]


class CHIPGraphExec:
    def __init__(self, Graph: CHIPGraph, queue: Queue, device: str, out_buffer, static, state):
        self.OriginalGraph_ = Graph                      # copy the pointer to the original graph
        self.CompiledGraph_ = CHIPGraph(Graph)           # the copy constructor: a clone of the graph
        self.queue, self.out_buffer = queue, out_buffer
        # the walk is captured once; each hipGraphLaunch replays it on the same memory
        slots = {f"node {i} exec item argument slots": n.ExecItem_.Slots_
                 for i, n in enumerate(self._nodesToRun())}
        self.graph, self.out = capture(self.launch, device=device, warmups=0, name="hipGraphExec",
                                       owner="chipStar CHIPGraphExec", static={**static, **slots}, state=state)

    def _nodesToRun(self):
        nodes = self.OriginalGraph_.getNodes()           # compile(): the schedule is built from the original nodes
        if VARIANT["v"] == "bug":
            return nodes
        return [self.CompiledGraph_.nodeLookup(n) or n for n in nodes]

    def launch(self):
        for node in self._nodesToRun():                  # ExecQueues_: a chain here
            node.execute(self.queue)
        return self.out_buffer

    def getOriginalGraphPtr(self) -> CHIPGraph:
        return self.OriginalGraph_


# --- src/CHIPBindings.cc -------------------------------------------------------------------------------------------

def hipGraphCreate() -> CHIPGraph:
    return CHIPGraph()


def hipGraphAddKernelNode(graph: CHIPGraph, pNodeParams: hipKernelNodeParams, device: str) -> CHIPGraphNodeKernel:
    node = CHIPGraphNodeKernel(pNodeParams, device)
    graph.addNode(node)
    return node


def hipGraphInstantiate(graph: CHIPGraph, queue: Queue, device: str, out_buffer, *, static, state) -> CHIPGraphExec:
    """(``out_buffer`` / ``static`` / ``state``: the model's names for what the walk returns and reads.)"""
    return CHIPGraphExec(graph, queue, device, out_buffer, static, state)


def hipGraphLaunch(exec_: CHIPGraphExec):
    return replay(exec_.graph, exec_.out)


def hipGraphExecKernelNodeSetParams(hGraphExec: CHIPGraphExec, node, pNodeParams: hipKernelNodeParams) -> str:
    try:                                                 # CHIP_TRY
        if hGraphExec is None or node is None or pNodeParams is None or pNodeParams.func is None:
            return hipErrorInvalidValue
        if VARIANT["v"] == "bug":
            # Graph obtained from hipGraphExec_t is a clone of the original
            Graph = hGraphExec.getOriginalGraphPtr()
            # KernelNode here is a handle to the original
            ExecKernelNode = Graph.getClonedNodeFromOriginal(node)
        else:
            # #1522: the executable's own copy of the node, as hipamd's GetClonedNode
            ExecKernelNode = hGraphExec.CompiledGraph_.nodeLookup(node)
            if ExecKernelNode is None:
                raise CHIPError("Failed to find the node in hipGraphExec_t", hipErrorInvalidValue)
        ExecKernelNode.setParams(pNodeParams)
        return hipSuccess
    except CHIPError as status:                          # CHIP_CATCH: logError, RETURN(_status.toHIPError())
        return status.toHIPError()


def hipLaunchKernel(queue: Queue, func, args, device: str):
    """The eager path: a fresh exec item, its arguments bound right before the kernel is enqueued."""
    item = createExecItem(device)
    item.setKernel(func)
    item.setArgs(args)
    item.setupAllArgs()
    queue.launch(item)


# --- the user: an "implicit graph" wrapper (capture once, then update kernel nodes and relaunch) --------------------

class Task:
    def __init__(self, device: str):
        self.device, self.queue = device, Queue()
        self._node_map: dict[int, CHIPGraphNodeKernel] = {}
        self.M_graph = self.M_graph_exec = None
        self.M_qInstantiated = False
        self.state = "capture"

    def add_kernel_node(self, key: int, params: hipKernelNodeParams):
        self._node_map[key] = hipGraphAddKernelNode(self.M_graph, params, self.device)

    def update_kernel_node(self, key: int, params: hipKernelNodeParams):
        hipGraphExecKernelNodeSetParams(self.M_graph_exec, self._node_map[key], params)   # result unchecked

    def wrap(self, step, out_buffer, announce):
        if self.M_qInstantiated:
            self.state = "update"
            step(self)
        else:
            self.state = "capture"
            self.M_graph = hipGraphCreate()
            step(self)
            self.M_graph_exec = hipGraphInstantiate(self.M_graph, self.queue, self.device, out_buffer, **announce)
            self.M_qInstantiated = True
        return self.launch_graph()

    def launch_graph(self):
        if self.M_qInstantiated:
            return hipGraphLaunch(self.M_graph_exec)


def dt_at(step: int) -> float:
    """The adaptive time step the host picks for this step."""
    return min(DT0 * DT_GROWTH ** step, DT_MAX)


def run(variant: str, device: str = "cpu"):
    gen = generator(1498)
    u0 = randn(N, gen=gen, device=device)
    forcings = [randn(N, gen=gen, device=device) for _ in range(STEPS)]

    def serve(graphed: bool):
        VARIANT["v"] = variant
        u = u0.clone()                                   # hipMalloc + hipMemcpy: the solution, advanced in place
        f = torch.zeros(N, device=device)                # hipMalloc: the forcing, refreshed each step
        task, queue = Task(device), Queue()
        outs = []
        for n, forcing in enumerate(forcings):
            f.copy_(forcing)                             # hipMemcpy(f, host_f, ...)
            params = hipKernelNodeParams(relax, [u, f, dt_at(n), LAM])
            if graphed:
                def step(t: Task, params=params):
                    if t.state == "capture":
                        t.add_kernel_node(0, params)
                    else:
                        t.update_kernel_node(0, params)
                task.wrap(step, u, {"static": {"f (forcing)": f}, "state": {"u (solution)": u}})
            else:
                hipLaunchKernel(queue, relax, params.kernelParams, device)
            outs.append(u.clone())                       # hipMemcpy(host_u, u, ...)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
