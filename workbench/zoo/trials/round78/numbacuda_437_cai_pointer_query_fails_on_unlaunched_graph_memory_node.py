"""Numba's ``cuda.from_cuda_array_interface`` asks the driver about every CAI pointer; a CUDASTF graph context's data lives in graph memory nodes, unmapped until the graph is launched, so the query fails and no Numba kernel can be put in the graph.

Upstream: https://github.com/NVIDIA/numba-cuda/pull/437 ("Ensure NUMBA can manipulate memory from CUDA graphs
before the graph is launched", caugonnet; opened 2025-08-28, merged 2025-10-08 as ad9e4b10).
Symptom: a Python CUDASTF program that launches ``@cuda.jit`` kernels from its tasks works with ``stf.context()``
and fails with ``stf.context(use_graph=True)``: ``CudaAPIError: [1] Call to cuPointerGetAttribute results in
CUDA_ERROR_INVALID_VALUE``, raised while the task body wraps its argument
(``cuda.from_cuda_array_interface(t.get_arg_cai(0), owner=None, sync=False)``). The graph is never built, so
nothing is computed. No wrong numbers.
Mechanism: in a graph context CUDASTF allocates each logical data's device instance inside the graph it builds
(a graph memory node: stream-ordered allocation on the capturing stream). CUDA reserves the node's virtual
address when the node is added, but maps physical memory only when the graph is launched (here at
``ctx.finalize()``). The task body runs while the graph is being built. It gets the instance as a CUDA Array
Interface object (``stf_cai``: ``data = (ptr, False)``) and hands it to Numba. Pre-fix,
``numba_cuda/numba/cuda/api.py`` ``from_cuda_array_interface`` did not trust that pointer. It called
``driver.get_devptr_for_active_ctx(desc["data"][0])``, which is
``cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_POINTER, ptr)``. The driver knows no mapped allocation at that
address yet and answers ``CUDA_ERROR_INVALID_VALUE``. Numba raises ``CudaAPIError``, the task body never launches its
kernel, and the build of the graph is abandoned. In a stream context the same allocation is mapped when the
task runs, so the query succeeds. ``cudadrv/devicearray.py`` ``DeviceNDArrayBase.__init__`` had a second query
for foreign memory: ``alloc_size = _driver.device_memory_size(gpu_data)``, which calls ``cuMemGetAddressRange``
unless the memory object caches its size. The ``MemoryPointer`` that ``from_cuda_array_interface`` builds caches
it (``_cuda_memsize_``), so on this path only the pointer-attribute query fails.
Doctor: sync-in-capture, at from_cuda_array_interface. No listed kind names this exactly, and this one is the
nearest. The fault is host-side driver work done inside the region being captured (the graph being built)
that works eagerly and fails there, which is the same shape as the cudaMalloc / handle-creation programs of this
kind. It is not a synchronisation, though, and not a capture-mode refusal: it would fail in relaxed mode too,
because the address is not mapped until launch. ``from_cuda_array_interface`` is where the fix changed the
failing call.
Fix (upstream): ``from_cuda_array_interface`` builds the device pointer straight from the CAI value
(``devptr = cudevptr_class(desc["data"][0])``: ``binding.CUdeviceptr`` or ``drvapi.cu_device_ptr``). The commit
message relies on the unified virtual address space (64-bit, CC >= 2.0). ``DeviceNDArrayBase.__init__`` now computes
``alloc_size = memory_size_from_info(shape, strides, itemsize)`` for all memory, not only for its own
allocations, so it no longer calls ``device_memory_size(gpu_data)``. (The merge diff was read in the numba-cuda
mirror. The CUDASTF usage is the cccl python STF test ``test_numba``: ``context(use_graph=True)``,
``cuda.external_stream(t.stream_ptr())``, ``from_cuda_array_interface(t.get_arg_cai(0), owner=None, sync=False)``,
``scale[32, 64, nb_stream](2.0, dX)``, then ``axpy`` on ``read(lX), rw(lY)``.)
Modelled: the CUDA driver is a small table of allocations in the unified address space. It knows which ones
are graph memory nodes of a graph not launched yet, and it answers ``cuPointerGetAttribute`` and
``cuMemGetAddressRange`` as CUDA does: ``CUDA_ERROR_INVALID_VALUE`` for an address with nothing mapped. The
emulation has no graph memory nodes of its own, and on a GPU torch's capture allocations come from a mapped
private pool, so this rule is the program's, on both backends. A kernel reaches memory through its address, and
the table turns the address back into a tensor. CUDASTF is cut down to logical data over pinned host arrays, one
device instance per logical data (allocated at its first use, copied in from the host, written back at
finalize), tasks that run their bodies at once, and the two contexts. The graph context builds its graph with one
capture of the function that submits the tasks (upstream adds an alloc node per instance and captures each task
body into a child graph), and ``finalize`` launches it once. The workload is the upstream test's ``scale`` then
``axpy``, run for three rounds, with one context per round. Numba is cut down to ``MemoryPointer``,
``DeviceNDArray``, ``from_cuda_array_interface``, external streams and a ``@cuda.jit`` stand-in whose kernels are
torch ops on the resolved memory.
"""
from __future__ import annotations

import contextlib
import functools
import operator

import torch

from workbench.engine import host, synchronize
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/numba-cuda/pull/437"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "from_cuda_array_interface"
SYMPTOM = ("stf.context(use_graph=True) with a Numba kernel fails to build: CudaAPIError [1] Call to "
           "cuPointerGetAttribute results in CUDA_ERROR_INVALID_VALUE (the task's data is a graph memory node, "
           "unmapped until launch)")

N, ROUNDS = 16, 3
ITEMSIZE = 4                                   # float32 ('<f4')


# --- the CUDA driver: the unified address space --------------------------------------------------------------

CUDA_ERROR_INVALID_VALUE = 1
CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 2


class CudaAPIError(Exception):
    def __init__(self, code, msg):
        self.code, self.msg = code, msg
        super().__init__(f"[{code}] {msg}")


class _Driver:
    """The allocations this program made, by base address. A graph memory node's address is reserved while
    the graph is built, but physical memory is mapped only when the graph is launched."""

    def __init__(self):
        self.allocations: dict[int, torch.Tensor] = {}
        self.unlaunched: dict[int, object] = {}       # base address -> the graph whose alloc node reserved it

    def _find(self, ptr: int):
        for base, buf in self.allocations.items():
            if base <= ptr < base + buf.numel() * ITEMSIZE:
                return base, buf
        return None, None

    def mem_alloc_async(self, nbytes: int, device: str, graph=None) -> int:
        buf = torch.empty(nbytes // ITEMSIZE, device=device)
        base = buf.data_ptr()
        self.allocations[base] = buf
        if graph is not None:
            self.unlaunched[base] = graph
        return base

    def mem_free_async(self, ptr: int) -> None:
        self.allocations.pop(ptr, None)
        self.unlaunched.pop(ptr, None)

    def graph_launched(self, graph) -> None:
        """cuGraphLaunch: the graph's memory nodes get physical memory."""
        for base in [b for b, g in self.unlaunched.items() if g is graph]:
            del self.unlaunched[base]

    def _mapped(self, ptr: int, call: str):
        base, buf = self._find(ptr)
        if buf is None or base in self.unlaunched:
            raise CudaAPIError(CUDA_ERROR_INVALID_VALUE, f"Call to {call} results in CUDA_ERROR_INVALID_VALUE")
        return base, buf

    def cuPointerGetAttribute(self, attr: int, ptr: int) -> int:
        assert attr == CU_POINTER_ATTRIBUTE_DEVICE_POINTER
        self._mapped(ptr, "cuPointerGetAttribute")
        return ptr                                    # UVA: the device pointer is the address itself

    def cuMemGetAddressRange(self, ptr: int):
        base, buf = self._mapped(ptr, "cuMemGetAddressRange")
        return base, buf.numel() * ITEMSIZE

    def view(self, ptr: int, shape, dtype) -> torch.Tensor:
        """What a kernel given ``ptr`` reaches (on the GPU: the address; here the allocation that holds it)."""
        base, buf = self._find(ptr)
        start = (ptr - base) // ITEMSIZE
        return buf[start:start + functools.reduce(operator.mul, shape, 1)].view(shape)


driver = _Driver()


# --- numba_cuda/numba/cuda/cudadrv/driver.py ------------------------------------------------------------------

def memory_size_from_info(shape, strides, itemsize):
    return functools.reduce(operator.mul, shape, 1) * itemsize


class MemoryPointer:
    def __init__(self, context, pointer, size, owner=None, finalizer=None):
        self.context = context
        self.device_pointer = pointer
        self.size = size
        self._cuda_memsize_ = size
        self._owner = owner


def get_devptr_for_active_ctx(ptr):
    """Query the device pointer usable in the current context from an arbitrary pointer."""
    if ptr != 0:
        return driver.cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_POINTER, ptr)
    return 0


def device_extents(devmem):
    s, n = driver.cuMemGetAddressRange(devmem.device_pointer)
    return s, s + n


def device_memory_size(devmem):
    """Check the memory size of the device memory (cached in the device memory object)."""
    sz = getattr(devmem, "_cuda_memsize_", None)
    if sz is None:
        s, e = device_extents(devmem)
        sz = e - s
        devmem._cuda_memsize_ = sz
    return sz


class ExternalStream:
    def __init__(self, handle, device):
        self.handle, self.device = handle, device

    def synchronize(self):
        synchronize(self.device)


# --- numba_cuda/numba/cuda/cudadrv/devicearray.py -------------------------------------------------------------

class DeviceNDArray:
    def __init__(self, shape, strides, dtype, stream=0, gpu_data=None, *, variant: str):
        self.shape, self.strides, self.dtype, self.stream = tuple(shape), strides, dtype, stream
        self.size = int(functools.reduce(operator.mul, self.shape, 1))
        if self.size > 0:
            if variant == "fix":
                self.alloc_size = memory_size_from_info(self.shape, self.strides, ITEMSIZE)
            if gpu_data is None:
                raise NotImplementedError("only foreign memory here")
            elif variant == "bug":
                self.alloc_size = device_memory_size(gpu_data)      # cuMemGetAddressRange unless cached
        self.gpu_data = gpu_data

    @property
    def device_ctypes_pointer(self):
        return self.gpu_data.device_pointer


# --- numba_cuda/numba/cuda/api.py -----------------------------------------------------------------------------

class NumbaCuda:
    """The ``numba.cuda`` names the tasks use."""

    CUDA_ARRAY_INTERFACE_SYNC = True

    def __init__(self, variant: str, device: str):
        self.variant, self.device = variant, device

    def external_stream(self, ptr):
        return ExternalStream(ptr, self.device)

    def from_cuda_array_interface(self, desc, owner=None, sync=True):
        """Create a DeviceNDArray from a cuda-array-interface description."""
        shape = tuple(desc["shape"])
        strides = desc.get("strides")
        assert desc["typestr"] == "<f4"
        size = memory_size_from_info(shape, strides, ITEMSIZE)
        if self.variant == "bug":
            devptr = get_devptr_for_active_ctx(desc["data"][0])      # cuPointerGetAttribute(DEVICE_POINTER)
        else:
            devptr = int(desc["data"][0])                             # cudevptr_class(desc["data"][0]): UVA
        data = MemoryPointer(None, devptr, size=size, owner=owner)
        stream_ptr = desc.get("stream", None)
        if stream_ptr is not None:
            stream = self.external_stream(stream_ptr)
            if sync and self.CUDA_ARRAY_INTERFACE_SYNC:
                stream.synchronize()
        else:
            stream = 0
        return DeviceNDArray(shape, strides, "float32", stream=stream, gpu_data=data, variant=self.variant)


class jit:
    """``@cuda.jit`` stand-in: ``kernel[grid, block, stream](args)`` runs the body on the memory the device
    arrays point to (a kernel launch captured into the graph while it is built)."""

    def __init__(self, body):
        self.body = body

    def __getitem__(self, config):
        def launch(*args):
            resolved = [driver.view(a.device_ctypes_pointer, a.shape, a.dtype) if isinstance(a, DeviceNDArray)
                        else a for a in args]
            self.body(*resolved)
        return launch


@jit
def scale(a, x):
    x.mul_(a)                                          # x[i] = a * x[i]


@jit
def axpy(a, x, y):
    y.add_(x, alpha=a)                                 # y[i] = a * x[i] + y[i]


# --- cuda.stf python bindings (cut down) -----------------------------------------------------------------------

READ, RW = "read", "rw"


class stf_cai:
    """CUDA Array Interface v3 of a task argument (dict-style access, as the bindings give it)."""

    def __init__(self, ptr, shape, stream=0):
        self.__cuda_array_interface__ = {"version": 3, "shape": shape, "typestr": "<f4", "data": (ptr, False),
                                         "strides": None, "stream": stream if stream != 0 else None}

    def __getitem__(self, key):
        return self.__cuda_array_interface__[key]

    def get(self, key, default=None):
        return self.__cuda_array_interface__.get(key, default)


class logical_data:
    def __init__(self, ctx, host_array: torch.Tensor):
        self.ctx, self.host_array, self.shape = ctx, host_array, tuple(host_array.shape)
        self.instance = 0                              # device instance address (allocated at first use)

    def read(self):
        return (self, READ)

    def rw(self):
        return (self, RW)


class task:
    def __init__(self, ctx, deps):
        self.ctx, self.deps = ctx, deps

    def stream_ptr(self):
        return self.ctx.stream_handle

    def get_arg_cai(self, index):
        ld, _ = self.deps[index]
        return stf_cai(ld.instance, ld.shape, stream=self.stream_ptr())


class context:
    def __init__(self, device: str, use_graph: bool = False):
        self.device, self.use_graph = device, use_graph
        self.stream_handle = 0x5F1                     # the context's CUstream
        self.data: list[logical_data] = []
        self.graph = None                              # graph context: the graph being built, then launched

    def logical_data(self, host_array):
        ld = logical_data(self, host_array)
        self.data.append(ld)
        return ld

    def _instance(self, ld: logical_data):
        """First use on the device: allocate the instance (in a graph context: an alloc node of the graph being
        built) and copy the host array in."""
        if ld.instance == 0:
            nbytes = memory_size_from_info(ld.shape, None, ITEMSIZE)
            ld.instance = driver.mem_alloc_async(nbytes, self.device, graph=self if self.use_graph else None)
            driver.view(ld.instance, ld.shape, "float32").copy_(ld.host_array, non_blocking=True)

    @contextlib.contextmanager
    def task(self, *deps):
        for ld, _ in deps:
            self._instance(ld)
        yield task(self, deps)

    def _write_back(self):
        for ld in self.data:
            if ld.instance:
                ld.host_array.copy_(driver.view(ld.instance, ld.shape, "float32"), non_blocking=True)

    def build(self, submit):
        """Graph context: the graph is built while the tasks are submitted (alloc nodes, each task body's kernels,
        the write-back copies)."""
        def body():
            submit()
            self._write_back()
            return tuple(ld.host_array for ld in self.data)
        self.graph, self.outputs = capture(body, device=self.device, warmups=0, name="stf graph_ctx",
                                           owner="cuda.stf context(use_graph=True)")

    def finalize(self):
        if self.use_graph:
            driver.graph_launched(self)
            replay(self.graph, self.outputs)           # cuGraphLaunch
        else:
            self._write_back()
        synchronize(self.device)
        for ld in self.data:                           # free nodes / cudaFreeAsync
            driver.mem_free_async(ld.instance)
            ld.instance = 0


# --- the user program (cccl python STF test_numba) --------------------------------------------------------------

def submit_tasks(ctx, lX, lY, cuda: NumbaCuda):
    with ctx.task(lX.rw()) as t:
        nb_stream = cuda.external_stream(t.stream_ptr())
        dX = cuda.from_cuda_array_interface(t.get_arg_cai(0), owner=None, sync=False)
        scale[32, 64, nb_stream](2.0, dX)

    with ctx.task(lX.read(), lY.rw()) as t:
        nb_stream = cuda.external_stream(t.stream_ptr())
        dX = cuda.from_cuda_array_interface(t.get_arg_cai(0), owner=None, sync=False)
        dY = cuda.from_cuda_array_interface(t.get_arg_cai(1), owner=None, sync=False)
        axpy[32, 64, nb_stream](0.5, dX, dY)


def run(variant: str, device: str = "cpu"):
    gen = generator(437)
    X0, Y0 = randn(N, gen=gen, device="cpu"), randn(N, gen=gen, device="cpu")

    def serve(use_graph: bool):
        global driver
        driver = _Driver()
        cuda = NumbaCuda(variant, device)
        X, Y = host(X0.clone(), device), host(Y0.clone(), device)     # pinned host arrays (numpy upstream)
        outs = []
        for _ in range(ROUNDS):
            ctx = context(device, use_graph=use_graph)
            lX, lY = ctx.logical_data(X), ctx.logical_data(Y)
            if use_graph:
                ctx.build(lambda: submit_tasks(ctx, lX, lY, cuda))
            else:
                submit_tasks(ctx, lX, lY, cuda)
            ctx.finalize()
            outs += [X.clone(), Y.clone()]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
