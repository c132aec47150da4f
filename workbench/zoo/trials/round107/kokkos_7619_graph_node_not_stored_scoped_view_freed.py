"""Kokkos::Graph on CUDA (and HIP) did not keep the nodes it was given: a node created in the ``create_graph`` closure lived only as long as the user's ``GraphNodeRef``, so a scratch ``View`` held only by the node's functor was deallocated when the closure returned, while the instantiated CUDA graph kept launching kernels on its address.

Upstream: https://github.com/kokkos/kokkos/pull/7619 ("graph(fix): nodes must be stored by the graph, whatever the
backend", kokkos/kokkos, by romintomasetti, commit 85db5dd37 of 2024-12-17, merged 2024-12-19 by dalg24 as merge
commit 8de71092a).
Read: the PR description ("the node must be stored by the graph. Otherwise, the lifetime of captured things is not
bound to the node's lifetime and undefined behavior might happen ... adding a node to a graph within a scope should be
allowed"); the diff of ``core/src/Cuda/Kokkos_Cuda_Graph_Impl.hpp``, ``HIP/Kokkos_HIP_Graph_Impl.hpp``,
``SYCL/Kokkos_SYCL_Graph_Impl.hpp`` (``m_driver_storage`` replaced by ``std::vector<std::shared_ptr<node_details_t>>
m_nodes``; ``add_node`` pushes ``arg_node_ptr``) and the new test ``graph.node_lifetime`` of
``core/unit_test/TestGraph.hpp`` (a functor holding ``data`` and an ``"internal buffer"`` view created inside the
closure; "If the node lifetime is not bound to the graph's lifetime, the internal buffer view will get out of scope
before graph submission"). At the parent 9ca729c6c: ``GraphImpl<Kokkos::Cuda>`` (``add_node`` for kernel nodes: sets
the cuda graph and node pointers on the kernel, ``kernel.execute()`` adds the kernel node, only the global-memory
driver storage is kept; ``add_predecessor``; ``instantiate``; ``submit``; ``create_root_node_ptr``),
``Cuda/Kokkos_Cuda_GraphNodeKernel.hpp`` (``get_driver_storage``: only for functors launched from global memory),
``Kokkos_GraphNode.hpp`` (``_then_kernel``: ``make_node_shared_ptr``, ``add_node``, ``add_predecessor``; the node
ref keeps a weak pointer to the graph), ``Kokkos_Graph.hpp`` (``create_graph`` runs the closure on the root ref and
returns the graph), and ``impl/Kokkos_Default_Graph_Impl.hpp`` (the host backend keeps its nodes in ``m_sinks`` and
runs them at ``submit``).
Symptom: a graph whose nodes use a View created (or a functor built) inside the ``create_graph`` closure reads and
writes freed device memory at every ``submit`` on Cuda/HIP: wrong results or memory access faults (the new test failed
on HIP, passed "by luck" on Cuda); the same program is correct on the host backends.
Mechanism: a GraphNodeImpl owns its kernel, whose functor owns its Views (reference-counted allocations). On Cuda,
``add_node`` turns the kernel into a CUDA kernel node (the functor's bytes, raw device pointers, are copied into the
node's launch parameters) and then drops the node: only the user's ``GraphNodeRef`` (and each successor's predecessor
ref) holds it. When the closure returns, the refs die, the functors die, the scratch View's last reference goes and
``CudaSpace::deallocate`` returns its memory (``cudaFree``). The executable graph still launches kernels with that
address.
Doctor: dangling-reference, at add_node. Every graph launch reads (and writes) the scratch flux View after its owner,
the node that ``add_node`` failed to keep, has deallocated it; the fix makes ``add_node`` store the node in the graph.
Fix (upstream): ``GraphImpl<Cuda/HIP/SYCL>`` keeps ``m_nodes`` and ``add_node`` pushes every node into it, so the
nodes (functors, Views) live as long as the graph.
Modelled: ``View`` (a reference-counted device allocation; Python's reference count is Kokkos' use count),
``RangePolicy``, ``GraphNodeKernelImpl`` (``execute``: with a cuda graph set, the launch becomes a kernel node, else it
runs; ``get_driver_storage`` is None: the functors are small and launched from local memory), ``GraphNodeImpl`` (kernel,
predecessor ref, backend details), ``GraphNodeRef`` (``then_parallel_for``, ``_then_kernel``), ``GraphImpl<Cuda>`` as
read (``add_node``, ``add_predecessor``, ``instantiate``, ``submit``), the default ``GraphImpl`` (``m_sinks``,
``execute_node``), ``Graph`` and ``create_graph``. Stand-ins: a CUDA kernel node is the functor's launch recorded into
its own engine graph (recorded at ``add_node``, not run: the node's parameters hold addresses, not references), the
cudaGraph_t is the ordered list of those nodes (the root an empty node) and ``cudaGraphLaunch`` replays them in
dependency order; ``cudaFree`` on the last release of a View is ``release_to_driver`` right after ``create_graph``;
the reference run is the same program on the default (host-style) graph implementation, which runs each node's
kernel on the same device memory at submit. The application is an explicit 1D heat-diffusion step in two nodes,
``compute_flux`` into a scratch View ``flux`` created in the closure, then ``apply_flux``; float64.
Workload: N = own_segment_elems + 1 points (17 on the CPU), kappa 1, dt 0.2, a graph built once and submitted 6 times,
the field read after each submit. Bug: the first submit raises IllegalMemoryAccess (the compute_flux node writes the
flux View, freed when the closure returned). Fix: the 6 fields equal eager (max error 0).
"""
from __future__ import annotations

import weakref

import torch

from workbench.engine import events, graph, graph_pool_handle, new_graph
from workbench.zoo.kit import compare, generator, own_segment_elems, randn, release_to_driver

UPSTREAM = "https://github.com/kokkos/kokkos/pull/7619"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "add_node"
SYMPTOM = ("Kokkos::Graph on Cuda/HIP does not store its nodes: a View held only by a node's functor is deallocated "
           "when the create_graph closure returns, and every graph submit launches kernels on the freed memory")

KAPPA, DT, STEPS = 1.0, 0.2, 6
DTYPE = torch.float64

_variant = "bug"


# --- Kokkos_View.hpp (reduced): a reference-counted allocation ----------------------------------------------------

class View:
    def __init__(self, label: str, n: int, device: str):
        self.label = label
        self.data = torch.zeros(n, dtype=DTYPE, device=device)     # Kokkos initializes views to zero

    def extent(self, dim: int = 0) -> int:
        return self.data.shape[dim]


class RangePolicy:
    def __init__(self, begin: int, end: int):
        self.begin, self.end = begin, end


# --- the application's functors (KOKKOS_FUNCTION operator()(i), vectorized over the range) ------------------------

class ComputeFlux:
    def __init__(self, u: View, flux: View, kappa: float):
        self.u, self.flux, self.kappa = u, flux, kappa

    def __call__(self, policy: RangePolicy):
        b, e, u = policy.begin, policy.end, self.u.data            # flux(i) = kappa (u(i+1) - u(i))
        self.flux.data[b:e].copy_(self.kappa * (u[b + 1:e + 1] - u[b:e]))


class ApplyFlux:
    def __init__(self, u: View, flux: View, dt: float):
        self.u, self.flux, self.dt = u, flux, dt

    def __call__(self, policy: RangePolicy):
        b, e, f = policy.begin, policy.end, self.flux.data        # u(i) += dt (flux(i) - flux(i-1))
        self.u.data[b:e].add_(self.dt * (f[b:e] - f[b - 1:e - 1]))


# --- Cuda/Kokkos_Cuda_GraphNodeKernel.hpp / impl/Kokkos_GraphNodeImpl.hpp ----------------------------------------

class GraphNodeKernelImpl:
    """``parallel_for`` of ``functor`` over ``policy``. With a cuda graph set, ``execute`` adds a kernel node instead
    of launching (``cudaGraphAddKernelNode``: the functor's bytes become the node's parameters)."""

    def __init__(self, label: str, policy: RangePolicy, functor):
        self.label, self.policy, self.functor = label, policy, functor
        self._graph_ptr = self._graph_node_ptr = None

    def set_cuda_graph_ptr(self, graph_ptr):
        self._graph_ptr = graph_ptr

    def set_cuda_graph_node_ptr(self, node_details):
        self._graph_node_ptr = node_details

    def get_driver_storage(self):
        return None                       # small functor: launched from local memory, no global driver storage

    def execute(self):
        if self._graph_ptr is None:
            self.functor(self.policy)
            return
        cuda_graph = self._graph_ptr
        node = new_graph(cuda_graph.device)
        with graph(node, pool=cuda_graph.pool, name=f"kernel node {self.label}"):
            self.functor(self.policy)     # recorded, not run; the node keeps the Views' addresses only
        cuda_graph.nodes.append(node)
        self._graph_node_ptr.node = node


class CudaNodeDetails:                    # GraphNodeBackendSpecificDetails<Kokkos::Cuda>
    def __init__(self):
        self.node = None


class DefaultNodeDetails:                 # GraphNodeBackendSpecificDetails<ExecutionSpace> (default backend)
    def __init__(self):
        self.kernel, self.predecessors, self.has_executed = None, [], False

    def set_kernel(self, kernel):
        self.kernel = kernel

    def set_predecessor(self, pred_ptr):
        self.predecessors.append(pred_ptr)

    def reset_has_executed(self):
        self.has_executed = False
        for pred in self.predecessors:
            pred.details.reset_has_executed()

    def execute_node(self):
        if self.has_executed:
            return
        self.has_executed = True
        for pred in self.predecessors:
            pred.details.execute_node()
        if self.kernel is not None:
            self.kernel.execute()


class GraphNodeImpl:
    def __init__(self, details, kernel: GraphNodeKernelImpl | None = None, predecessor_ref=None):
        self.details, self.kernel = details, kernel
        self.predecessor_ref = predecessor_ref          # GraphNodeImpl<..., PredecessorRef> keeps its predecessor

    def get_kernel(self) -> GraphNodeKernelImpl:
        return self.kernel


# --- Kokkos_GraphNode.hpp -----------------------------------------------------------------------------------------

class GraphNodeRef:
    def __init__(self, graph_impl, node_impl: GraphNodeImpl):
        self.m_graph_impl = weakref.ref(graph_impl)     # std::weak_ptr<graph_impl_t>
        self.m_node_impl = node_impl

    def _then_kernel(self, kernel: GraphNodeKernelImpl) -> "GraphNodeRef":
        graph_ptr = self.m_graph_impl()
        assert graph_ptr is not None
        rv = GraphNodeRef(graph_ptr, GraphNodeImpl(graph_ptr.node_details_t(), kernel, predecessor_ref=self))
        # Add the node itself to the backend's graph data structure, now that everything is set up.
        graph_ptr.add_node(rv.m_node_impl)
        graph_ptr.add_predecessor(rv.m_node_impl, self)
        return rv

    def then_parallel_for(self, name: str, policy, functor) -> "GraphNodeRef":
        if isinstance(policy, int):
            policy = RangePolicy(0, policy)
        return self._then_kernel(GraphNodeKernelImpl(name, policy, functor))


# --- Cuda/Kokkos_Cuda_Graph_Impl.hpp: GraphImpl<Kokkos::Cuda> ----------------------------------------------------

class CudaGraph:                          # cudaGraph_t: its nodes in dependency order
    def __init__(self, device: str):
        self.device, self.pool = device, graph_pool_handle(device)
        self.nodes: list = [None]         # the root: an empty node


class GraphImplCuda:
    node_details_t = CudaNodeDetails

    def __init__(self, device: str):
        self.m_graph = CudaGraph(device)
        self.m_graph_exec = None
        self.m_edges: list = []
        if _variant == "bug":
            # Store drivers for the kernel nodes that launch in global memory. This is required as lifetime of
            # drivers must be bounded to this instance's lifetime.
            self.m_driver_storage: list = []
        else:
            self.m_nodes: list = []

    def create_root_node_ptr(self) -> GraphNodeImpl:
        rv = GraphNodeImpl(CudaNodeDetails())
        rv.details.node = self.m_graph.nodes[0]           # cudaGraphAddEmptyNode
        return rv

    def add_node(self, arg_node_ptr: GraphNodeImpl):
        # The Kernel launch from the execute() method has been shimmed to insert the node into the graph
        kernel = arg_node_ptr.get_kernel()
        cuda_node = arg_node_ptr.details
        assert cuda_node.node is None
        kernel.set_cuda_graph_ptr(self.m_graph)
        kernel.set_cuda_graph_node_ptr(cuda_node)
        kernel.execute()
        assert cuda_node.node is not None
        if _variant == "bug":
            tmp = kernel.get_driver_storage()
            if tmp is not None:
                self.m_driver_storage.append(tmp)
        else:
            self.m_nodes.append(arg_node_ptr)

    def add_predecessor(self, arg_node_ptr: GraphNodeImpl, arg_pred_ref: GraphNodeRef):
        pred_cuda_node = arg_pred_ref.m_node_impl.details.node       # cudaGraphAddDependencies
        nodes = self.m_graph.nodes
        assert nodes.index(pred_cuda_node) < nodes.index(arg_node_ptr.details.node)
        self.m_edges.append((pred_cuda_node, arg_node_ptr.details.node))

    def instantiate(self):
        assert self.m_graph_exec is None
        self.m_graph_exec = [n for n in self.m_graph.nodes if n is not None]   # cudaGraphInstantiate

    def submit(self):
        if self.m_graph_exec is None:
            self.instantiate()
        for node in self.m_graph_exec:                    # cudaGraphLaunch
            node.replay()


# --- impl/Kokkos_Default_Graph_Impl.hpp: the default GraphImpl (the reference) ------------------------------------

class GraphImplDefault:
    node_details_t = DefaultNodeDetails

    def __init__(self, device: str):
        self.m_sinks: list = []
        self.m_has_been_instantiated = False

    def create_root_node_ptr(self) -> GraphNodeImpl:
        rv = GraphNodeImpl(DefaultNodeDetails())
        self.m_sinks.append(rv)
        return rv

    def add_node(self, arg_node_ptr: GraphNodeImpl):
        arg_node_ptr.details.set_kernel(arg_node_ptr.get_kernel())
        self.m_sinks.append(arg_node_ptr)

    def add_predecessor(self, arg_node_ptr: GraphNodeImpl, arg_pred_ref: GraphNodeRef):
        pred_ptr = arg_pred_ref.m_node_impl
        arg_node_ptr.details.set_predecessor(pred_ptr)
        if pred_ptr in self.m_sinks:
            self.m_sinks.remove(pred_ptr)

    def instantiate(self):
        self.m_has_been_instantiated = True

    def submit(self):
        if not self.m_has_been_instantiated:
            self.instantiate()
        for sink in self.m_sinks:
            sink.details.reset_has_executed()
        for sink in self.m_sinks:
            sink.details.execute_node()


# --- Kokkos_Graph.hpp ---------------------------------------------------------------------------------------------

class Graph:
    def __init__(self, impl):
        self.m_impl_ptr = impl

    def instantiate(self):
        self.m_impl_ptr.instantiate()

    def submit(self):
        self.m_impl_ptr.submit()


def create_graph(graph_impl, arg_closure) -> Graph:
    rv = Graph(graph_impl)
    # Invoke the user's graph construction closure
    arg_closure(GraphNodeRef(graph_impl, graph_impl.create_root_node_ptr()))
    return rv


# --- the application: an explicit heat-diffusion step as a Kokkos graph -------------------------------------------

def build_heat_step(root: GraphNodeRef, u: View, device: str) -> None:
    n = u.extent(0)
    flux = View("flux", n - 1, device)                   # scratch: only the nodes' functors hold it
    node = root.then_parallel_for("compute_flux", n - 1, ComputeFlux(u, flux, KAPPA))
    node.then_parallel_for("apply_flux", RangePolicy(1, n - 1), ApplyFlux(u, flux, DT))


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    n = own_segment_elems(device) + 1
    u0 = randn(n, gen=generator(7619), device=device).to(DTYPE)

    def simulate(graph_impl_t):
        u = View("u", n, device)
        u.data.copy_(u0)
        events.persistent_state("Kokkos::Graph heat step", {"u": u.data})
        heat = create_graph(graph_impl_t(device), lambda root: build_heat_step(root, u, device))
        release_to_driver(device)                        # CudaSpace::deallocate is cudaFree: memory goes back at once
        fields = []
        for _ in range(STEPS):
            heat.submit()
            fields.append(u.data.clone())                # deep_copy to the host after a fence
        return [torch.stack(fields)]

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: simulate(GraphImplCuda), lambda: simulate(GraphImplDefault))
