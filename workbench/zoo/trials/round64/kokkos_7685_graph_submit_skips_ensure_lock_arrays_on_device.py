"""Lock-based atomics in a Kokkos graph see a null lock array: only eager launches copy its pointer to the device.

Upstream: https://github.com/kokkos/kokkos/pull/7685 ("Make sure lock arrays on device before launching
graph"), commit 30ec1a1a; issue https://github.com/kokkos/kokkos/issues/7684 ("Lock-based atomics fail
with ``Kokkos::Graph`` in separate compilation unit").
Symptom: issue #7684: "``desul::Impl::CUDA_SPACE_ATOMIC_LOCKS_DEVICE`` is ``nullptr`` ... kernel launches on
Cuda call ``desul::ensure_cuda_lock_arrays_on_device()`` before each kernel launch, such a call is not made
before graph submit"; the PR "had meant to fix memory access faults that we had seen when using lock-based
atomics in graphs". The new ``graph_lock_based_atomic_op`` test (100 ``atomic_add(complex{1,1})``) failed
on VOLTA70 / VEGA906 without the fix.
Mechanism: ``atomic_add`` on ``Kokkos::complex<double>`` has no hardware atomic; desul takes a lock per
address from the lock array whose device pointer is the per-translation-unit ``__device__ __constant__``
symbol ``CUDA_SPACE_ATOMIC_LOCKS_DEVICE`` (``lock_address_cuda``: ``atomicExch(&LOCKS[(ptr >> 2) & MASK], 1)``).
``init_lock_arrays_cuda`` (``Kokkos::initialize``) allocates the array and sets the host global
``CUDA_SPACE_ATOMIC_LOCKS_DEVICE_h``; each TU's symbol is only filled by
``ensure_cuda_lock_arrays_on_device`` -> ``copy_cuda_lock_arrays_to_device`` (``cudaMemcpyToSymbol``, once
per TU), which the eager launcher (``CudaParallelLaunchKernelInvoker::launch_kernel``) calls before every
launch. A graph's kernel nodes are made by ``create_parallel_launch_graph_node`` and run by
``GraphImpl<Cuda>::submit`` (``instantiate`` + ``cudaGraphLaunch``): neither calls it. If no eager kernel of
that TU ran first (the test allocates its View ``WithoutInitializing``), every replayed lock acquisition
goes through the null symbol. Eager ``parallel_for`` of the same functors is right.
(Miniature: device addresses are indices into a device-memory arena whose first page, where a null
pointer points, is unmapped -- poison, never a free lock; on hardware the access faults, here the
lock-based ``atomic_add`` never acquires its lock and its contribution does not land.)
Doctor: stale-input, at ``submit`` (the graph's kernels read the TU's lock-array symbol, which the submit
path never refreshes: it still holds its initial nullptr, so the sums depend on a skipped refresh).
Fix (upstream): ``desul::ensure_cuda_lock_arrays_on_device();`` at the top of ``GraphImpl<Kokkos::Cuda>::submit``
(``ensure_hip_lock_arrays_on_device`` in the HIP one, ``ensure_sycl_lock_arrays_on_device(q)`` for SYCL);
#8299 later moved the call to node definition, where the kernel's own TU is known.
"""
from __future__ import annotations

import torch

from workbench.engine import events, graph, host, new_graph
from workbench.zoo.kit import compare, generator, randn, replay

UPSTREAM = "https://github.com/kokkos/kokkos/pull/7685"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "submit"
SYMPTOM = "Kokkos graph with lock-based complex atomic_add: lock array pointer null on device, sums lost/faults"

CUDA_SPACE_ATOMIC_MASK = 0xF             # 0x1FFFF upstream
NULL_PAGE = 16                           # arena words from address 0: unmapped
PARTICLES, BINS, STEPS = 24, 5, 4
WAVE_NUMBER = 1.7


class DeviceMemory:
    """The device's address space (int32 words); the page at address 0 is unmapped (poison)."""

    def __init__(self, device):
        self.words = torch.full((NULL_PAGE + CUDA_SPACE_ATOMIC_MASK + 1,), -1, dtype=torch.int32, device=device)


class Runtime:
    """``Kokkos::initialize``: ``desul::init_lock_arrays_cuda`` allocates the lock array (all free) and
    sets the host global ``CUDA_SPACE_ATOMIC_LOCKS_DEVICE_h`` to its address."""

    def __init__(self, device):
        self.device = device
        self.memory = DeviceMemory(device)
        self.memory.words[NULL_PAGE:].zero_()
        self.CUDA_SPACE_ATOMIC_LOCKS_DEVICE_h = host(torch.tensor([NULL_PAGE]), device)


class TranslationUnit:
    """The user's .cpp file (no relocatable device code): its own copy of the ``__device__ __constant__``
    symbol (zero-initialised: nullptr) and of the ``static bool once`` of ``copy_cuda_lock_arrays_to_device``."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self.CUDA_SPACE_ATOMIC_LOCKS_DEVICE = torch.zeros(1, dtype=torch.long, device=runtime.device)
        self.once = False

    def copy_cuda_lock_arrays_to_device(self) -> None:
        if not self.once:                # cudaMemcpyToSymbol(CUDA_SPACE_ATOMIC_LOCKS_DEVICE, &..._h)
            self.CUDA_SPACE_ATOMIC_LOCKS_DEVICE.copy_(self.runtime.CUDA_SPACE_ATOMIC_LOCKS_DEVICE_h)
            self.once = True

    def ensure_cuda_lock_arrays_on_device(self) -> None:
        self.copy_cuda_lock_arrays_to_device()

    def atomic_add(self, dest: torch.Tensor, index: torch.Tensor, value: torch.Tensor) -> None:
        """desul's lock-based ``atomic_add`` of ``complex<double>``: acquire the lock of the destination's
        address through this TU's symbol, add, release (``lock_address_cuda`` / ``unlock_address_cuda``)."""
        offset = index & CUDA_SPACE_ATOMIC_MASK                         # (ptr >> 2) & MASK
        lock_words = self.runtime.memory.words[self.CUDA_SPACE_ATOMIC_LOCKS_DEVICE + offset]
        acquired = (lock_words == 0).to(value.dtype)                    # atomicExch(&LOCKS[offset], 1) == 0
        dest.index_add_(0, index, value * acquired[:, None])


class StructureFactorFunctor:
    """``InitTag``: zero the complex bins; ``WorkTag``: ``atomic_add(&bins(cell(j)), exp(i k x(j)))``."""

    def __init__(self, tu: TranslationUnit, x: torch.Tensor, cell: torch.Tensor, bins: torch.Tensor):
        self.tu, self.x, self.cell, self.bins = tu, x, cell, bins

    def init(self) -> None:
        self.bins.zero_()

    def work(self) -> None:
        phase = WAVE_NUMBER * self.x
        self.tu.atomic_add(self.bins, self.cell, torch.stack([phase.cos(), phase.sin()], dim=1))


def parallel_for(tu: TranslationUnit, body) -> None:
    """Eager launch (``CudaParallelLaunchKernelInvoker::launch_kernel``): ensure, then invoke the kernel."""
    tu.ensure_cuda_lock_arrays_on_device()
    body()


class GraphImpl:
    def __init__(self, tu: TranslationUnit, variant: str, outputs: torch.Tensor):
        self.tu, self.variant, self.outputs = tu, variant, outputs
        self.m_nodes = []                # kernel nodes (create_parallel_launch_graph_node: no ensure)
        self.m_graph_exec = None

    def add_node(self, body) -> None:
        self.m_nodes.append(body)

    def instantiate(self) -> None:
        assert self.m_graph_exec is None
        g = new_graph(self.tu.runtime.device)
        with graph(g, name="create_graph"):
            for body in self.m_nodes:
                body()
        self.m_graph_exec = g

    def submit(self) -> torch.Tensor:
        if self.variant == "fix":
            self.tu.ensure_cuda_lock_arrays_on_device()
        if self.m_graph_exec is None:
            self.instantiate()
        return replay(self.m_graph_exec, self.outputs)


def run(variant: str, device: str = "cpu"):
    gen = generator(7685)
    positions = [randn(PARTICLES, gen=gen, device=device, scale=2.0).double() for _ in range(STEPS)]
    cells = torch.randint(0, BINS, (PARTICLES,), generator=gen).to(device)

    def serve(graphed: bool):
        tu = TranslationUnit(Runtime(device))
        x = torch.empty(PARTICLES, dtype=torch.float64, device=device)           # WithoutInitializing
        cell = cells.clone()
        bins = torch.empty(BINS, 2, dtype=torch.float64, device=device)          # View<complex<double>*>
        functor = StructureFactorFunctor(tu, x, cell, bins)
        if graphed:
            events.static_buffers("Kokkos::View (user)", {"x": x, "cell": cell})
            impl = GraphImpl(tu, variant, bins)
            # create_graph(ex, [&](auto root){ root.then_parallel_for(InitTag...).then_parallel_for(WorkTag...); })
            impl.add_node(functor.init)
            impl.add_node(functor.work)
        outs = []
        for step in range(STEPS):
            x.copy_(positions[step])                                             # deep_copy
            if graphed:
                outs.append(impl.submit().clone())
            else:
                parallel_for(tu, functor.init)
                parallel_for(tu, functor.work)
                outs.append(bins.clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
