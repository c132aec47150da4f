"""A Kokkos graph's kernel node launches from a global-memory functor copy that its node handle freed at definition.

Upstream: https://github.com/kokkos/kokkos/pull/7365 ("graph(global-kernel-launch): fix global launch for
node kernel"), merge commit 08290bda (HIP part f987c67d).
Symptom: the PR author: the new force-global-launch graph test "would not pass on my HIP configuration, and
would pass on my Cuda configuration ... it should also fail for Cuda, but probably we're lucky enough that
Cuda hasn't wiped out the memory of the driver pointer yet (though it has been freed by Kokkos)". A graph
whose kernel functor is too big for constant memory runs with whatever now lies in the freed functor copy.
Mechanism: ``create_graph(ex, [&](auto root){ auto node = root.then_parallel_for(...); })`` builds a
``GraphNodeImpl`` per ``then_parallel_for``; ``GraphImpl<Cuda>::add_node`` calls ``kernel.execute()``,
which for a global-memory launch reaches ``CudaParallelLaunchKernelInvoker::create_parallel_launch_graph_node``:
``allocate_driver_storage_for_kernel`` -> ``GraphNodeKernelImpl::allocate_driver_memory_buffer`` does
``m_driver_storage = CudaSpace().allocate(...)`` (an ``OwningRawPtr`` of the node), the functor ("driver")
is copied into it (``cudaMemcpyAsync``) and a kernel node whose only argument is ``driver_ptr`` is added
to ``m_graph``. ``add_node`` keeps nothing but that node. When the closure returns, the node handles
die, ``~GraphNodeKernelImpl`` deallocates ``m_driver_storage``, and every later ``submit`` launches the
kernel node on the freed address. Here two graphs are defined (a predictor and a corrector step, the same
functor type, so the same ``sizeof(base_t)``): the corrector's ``allocate_driver_memory_buffer`` gets the
block the predictor's node released, so every replay of the predictor evaluates the corrector's
coefficients. Eager ``parallel_for`` copies the functor into the instance's scratch buffer per launch.
Doctor: dangling-reference, at ``add_node`` (the graph keeps the kernel node whose argument is the driver
storage's address, but not the storage: only the node handle, dropped after definition, owns it).
Fix (upstream): ``m_driver_storage`` becomes a ``std::shared_ptr<base_t>`` with a deallocating deleter (no
destructor), ``get_driver_storage()`` exposes it, and ``GraphImpl<Cuda/HIP>::add_node`` pushes it into a
new ``std::vector<std::shared_ptr<void>> m_driver_storage``, so the functor copy lives as long as the graph.
(Miniature: a per-node captured graph stands for each kernel node of ``m_graph``; the functor's by-value
members are polynomial coefficients padded past ``CudaTraits::ConstantMemoryUsage`` as in the PR's
``ForceGlobalLaunchFunctor``.)
"""
from __future__ import annotations

import torch

from workbench.engine import events, graph, host, new_graph, reuse_freed_blocks
from workbench.zoo.kit import compare, generator, randn, replay

UPSTREAM = "https://github.com/kokkos/kokkos/pull/7365"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "add_node"
SYMPTOM = "Kokkos graph global-memory launch: kernel node reads its functor copy after the node handle freed it"

N = 8                                    # RangePolicy(0, N)
ORDER = 3                                # the functor evaluates a cubic
CONSTANT_MEMORY_USAGE = 32               # CudaTraits::ConstantMemoryUsage, in words (miniature)
FUNCTOR_WORDS = CONSTANT_MEMORY_USAGE + 1    # sizeof(base_t) > constant memory: global-memory launch
STEPS = 4


class CudaSpace:
    def __init__(self, device):
        self.device = device

    def allocate(self, label: str, words: int) -> torch.Tensor:
        return torch.empty(words, device=self.device)


class Cuda:
    """The execution space instance: eager launches copy the functor into its ``m_scratchFunctor``."""

    def __init__(self, device):
        self.device = device
        self.m_scratchFunctor = None

    def scratch_functor(self, words: int) -> torch.Tensor:
        if self.m_scratchFunctor is None or self.m_scratchFunctor.numel() < words:
            self.m_scratchFunctor = CudaSpace(self.device).allocate("scratch functor", 2 * words)
        return self.m_scratchFunctor[:words]


class PolynomialFunctor:
    """``out(i) = sum_k c_k x(i)^k``: two Views (device pointers) and the coefficients by value, padded
    with ``std::byte unused[...]`` so that the functor does not fit constant memory."""

    def __init__(self, x: torch.Tensor, out: torch.Tensor, image: torch.Tensor):
        self.x, self.out = x, out
        self.image = image               # the functor's by-value bytes, host memory

    def operator(self, driver: torch.Tensor) -> None:
        """The kernel body, reading the functor's members through its device copy ``driver``."""
        acc = torch.zeros_like(self.x)
        for k in reversed(range(ORDER + 1)):
            acc = acc * self.x + driver[k]
        self.out.copy_(acc)


class GraphNodeKernelImpl:
    def __init__(self, label: str, ex: Cuda, functor: PolynomialFunctor):
        self.label, self.ex, self.functor = label, ex, functor
        self.m_graph_ptr = None
        # OwningRawPtr<base_t>: freed in ~GraphNodeKernelImpl, i.e. when this object dies
        self.m_driver_storage = None

    def set_cuda_graph_ptr(self, graph_ptr) -> None:
        self.m_graph_ptr = graph_ptr

    def allocate_driver_memory_buffer(self, mem: CudaSpace) -> torch.Tensor:
        assert self.m_driver_storage is None
        self.m_driver_storage = mem.allocate(self.label + " - GraphNodeKernel global memory functor storage",
                                             FUNCTOR_WORDS)
        return self.m_driver_storage

    def get_driver_storage(self):
        return self.m_driver_storage

    def execute(self) -> None:
        """The launch, shimmed to add a kernel node to ``m_graph`` instead of running."""
        create_parallel_launch_graph_node(self)


def create_parallel_launch_graph_node(kernel: GraphNodeKernelImpl) -> None:
    """``CudaParallelLaunchKernelInvoker<..., CudaLaunchMechanism::GlobalMemory>``'s graph path."""
    driver_ptr = kernel.allocate_driver_memory_buffer(CudaSpace(kernel.ex.device))
    driver_ptr.copy_(kernel.functor.image, non_blocking=True)      # cudaMemcpyAsync(driver_ptr, &driver)
    node = new_graph(kernel.ex.device, on_freed="reuse")
    with graph(node, name=kernel.label):                           # cudaGraphAddKernelNode, args {&driver_ptr}
        kernel.functor.operator(driver_ptr)
    kernel.m_graph_ptr.append((node, kernel.functor.out))


class GraphNodeImpl:
    def __init__(self, kernel: GraphNodeKernelImpl):
        self.kernel = kernel

    def get_kernel(self) -> GraphNodeKernelImpl:
        return self.kernel


class GraphImpl:
    def __init__(self, ex: Cuda, variant: str):
        self.m_execution_space, self.variant = ex, variant
        self.m_graph = []                # cudaGraph_t: its kernel nodes, in dependency order
        self.m_graph_exec = None
        self.m_driver_storage = []       # (the fix) drivers of global-memory kernel nodes

    def add_node(self, node_impl: GraphNodeImpl) -> None:
        kernel = node_impl.get_kernel()
        kernel.set_cuda_graph_ptr(self.m_graph)
        kernel.execute()
        if self.variant == "fix":
            tmp = kernel.get_driver_storage()
            if tmp is not None:
                self.m_driver_storage.append(tmp)

    def instantiate(self) -> None:
        assert self.m_graph_exec is None
        self.m_graph_exec = list(self.m_graph)

    def submit(self, ex: Cuda) -> None:
        if self.m_graph_exec is None:
            self.instantiate()
        for node, out in self.m_graph_exec:
            replay(node, out)


class GraphNodeRef:
    def __init__(self, graph_impl: GraphImpl, node_impl: GraphNodeImpl | None):
        self.graph_impl, self.node_impl = graph_impl, node_impl

    def then_parallel_for(self, label: str, functor: PolynomialFunctor) -> "GraphNodeRef":
        node = GraphNodeImpl(GraphNodeKernelImpl(label, self.graph_impl.m_execution_space, functor))
        self.graph_impl.add_node(node)
        return GraphNodeRef(self.graph_impl, node)


def create_graph(ex: Cuda, variant: str, closure) -> GraphImpl:
    impl = GraphImpl(ex, variant)
    closure(GraphNodeRef(impl, None))
    return impl


def parallel_for(ex: Cuda, functor: PolynomialFunctor) -> None:
    """Eager global-memory launch: copy the functor into the instance scratch buffer, then run."""
    driver = ex.scratch_functor(FUNCTOR_WORDS)
    driver.copy_(functor.image, non_blocking=True)
    functor.operator(driver)


def functor_image(coeffs: torch.Tensor, device) -> torch.Tensor:
    return host(torch.cat([coeffs, torch.zeros(FUNCTOR_WORDS - coeffs.numel())]), device)


def run(variant: str, device: str = "cpu"):
    gen = generator(7365)
    pred = functor_image(torch.randn(ORDER + 1, generator=gen) * 0.5, device)
    corr = functor_image(torch.randn(ORDER + 1, generator=gen) * 0.5, device)
    inputs = [randn(N, gen=gen, device=device) for _ in range(STEPS)]

    def serve(graphed: bool):
        ex = Cuda(device)
        x, y, z = (torch.zeros(N, device=device) for _ in range(3))     # Views
        predictor, corrector = PolynomialFunctor(x, y, pred), PolynomialFunctor(y, z, corr)
        if graphed:
            events.static_buffers("Kokkos::View (user)", {"x": x})

            def define_predictor(root):
                node = root.then_parallel_for("predictor", predictor)   # noqa: F841 - the node handle
                # the closure returns: its node handles die

            def define_corrector(root):
                node = root.then_parallel_for("corrector", corrector)   # noqa: F841
            predictor_graph = create_graph(ex, variant, define_predictor)
            corrector_graph = create_graph(ex, variant, define_corrector)
        outs = []
        for step in range(STEPS):
            x.copy_(inputs[step])                                        # deep_copy into the View
            if graphed:
                predictor_graph.submit(ex)
                corrector_graph.submit(ex)
            else:
                parallel_for(ex, predictor)
                parallel_for(ex, corrector)
            outs += [y.clone(), z.clone()]
        return outs

    def served():
        with reuse_freed_blocks():       # the allocator hands a released block to the next allocation
            return serve(True)

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, lambda: serve(False))
