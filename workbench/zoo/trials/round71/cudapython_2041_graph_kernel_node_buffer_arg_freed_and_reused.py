"""A kernel node added with ``GraphDefinition.launch()`` keeps only the raw pointer of its Buffer argument: the Buffer is freed and its memory reused.

Upstream: https://github.com/NVIDIA/cuda-python/pull/2041 ("cuda.core: keep kernel-argument objects alive in graph
kernel nodes", merged 2026-05-06; closes issue #2039, labels bug, P0).
Symptom: the issue: if a kernel argument is reachable only through the ``.launch()`` call (a ``Buffer`` passed inline,
or one the caller drops after building the node) "it can be garbage-collected before the graph runs. The graph then
holds a stale device pointer, and instantiating/launching it produces undefined behavior: typically memory
corruption or a crash." No error is raised when the freed block has been handed to a new allocation: the graph
computes with that allocation's data.
Mechanism: ``GraphDefinition.launch(config, kernel, *args)`` (cuda_core/cuda/core/graph/) builds a ``ParamHolder``
from the ``args`` tuple and calls ``GN_launch(self, conf, ker, ParamHolder ker_args)``
(cuda_core/cuda/core/graph/_graph_node.pyx). ``GN_launch`` sets ``node_params.kernelParams = ker_args.ptr`` (the raw
device pointers and by-value scalars), calls ``cuGraphAddKernelNode`` and attaches only the kernel to the graph
(``_attach_user_object(h_graph, new KernelHandle(ker._h_kernel), _destroy_kernel_handle_copy)``). The driver copies
the pointer values into the node but cannot own the Python ``Buffer``; the ``ParamHolder`` held the only strong
references to the arguments and dies when ``launch()`` returns. Here an app defines a two-layer MLP as a graph: a
helper per layer allocates the layer's packed weights+bias ``Buffer`` from ``DeviceMemoryResource``, uploads them
and passes the Buffer to ``launch()``. When the helper returns the Buffer is collected and its block goes back to
the memory resource; the second layer's helper allocates a Buffer of the same size and gets that block, so every
launch of the graph runs layer 1 with layer 2's weights. An eager ``launch(stream, ...)`` runs the kernel while the
Buffer is alive (stream order), so eager is right.
Doctor: dangling-reference, at GN_launch (the kernel node it adds reads the layer-1 parameter Buffer by address,
while the Buffer's only owner, the ``ParamHolder`` built for the call, releases it when ``GN_launch`` returns; the
memory is then another Buffer's).
Fix (upstream): ``GN_launch`` also attaches the kernel-argument tuple to the graph as a CUDA user object released
through ``_py_host_destructor`` (now exported from ``graph/_utils.pxd``), as ``KernelHandle``/``EventHandle`` were
already retained, so the arguments live as long as the graph (and its clones and executables).
Modelled: cuda.core's objects are small Python classes (``Buffer``, ``DeviceMemoryResource``, ``Kernel``,
``LaunchConfig``, ``ParamHolder``, ``GraphDefinition``, ``Graph``); a ``Buffer`` owns a float32 tensor, its handle is
that tensor (the "device pointer"). Each ``launch()`` captures its kernel into a graph of its own (a kernel node),
sharing the definition's pool; ``instantiate()`` gives a ``Graph`` whose ``launch`` replays the nodes in order.
User objects are a list on the graph handle. The fix attaches ``ker_args.kernel_args`` (the exact attribute the PR
uses was not read). The memory resource hands a released block to the next allocation of its size: on the CPU
through ``reuse_freed_blocks()`` (graphs with ``on_freed="reuse"``), on CUDA by sizing the parameter Buffers at 12
MiB, above the caching allocator's 10 MiB threshold, so each is a segment of its own and the released one is the
only cached block that exact size (cuda.core's mempool reuses freed memory in stream order in the same way).
No conditional nodes, clones, dependencies other than a chain, or grid/block semantics.
"""
from __future__ import annotations

import torch

from workbench.engine import events, graph, graph_pool_handle, new_graph, reuse_freed_blocks
from workbench.zoo.kit import compare, generator, replay

UPSTREAM = "https://github.com/NVIDIA/cuda-python/pull/2041"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "GN_launch"
SYMPTOM = "GraphDefinition kernel node reads a Buffer argument that was garbage-collected and reallocated"

ROWS, HIDDEN, STEPS = 4, 8, 3
PARAM_ELEMS = HIDDEN * HIDDEN + HIDDEN          # packed [W | b] of one layer


def param_nbytes(device) -> int:
    """A layer's parameter Buffer: on CUDA 12 MiB (a caching-allocator segment of its own, see Modelled)."""
    elems = PARAM_ELEMS if torch.device(device).type != "cuda" else 3 << 20
    return 4 * elems


# --- cuda.core._memory ----------------------------------------------------------------------------

class Buffer:
    """Device memory from a memory resource; released when closed or collected."""

    def __init__(self, mr, size):
        self._mr, self._size = mr, size
        self._ptr = torch.empty(size // 4, device=mr.device)       # the allocation (float32 words)

    @property
    def handle(self) -> torch.Tensor:                             # the device pointer
        return self._ptr

    @property
    def size(self) -> int:
        return self._size

    def copy_from(self, src: torch.Tensor, *, stream=None) -> None:
        self._ptr[:src.numel()].copy_(src.reshape(-1).to(self._mr.device))

    def close(self) -> None:
        self._ptr = None


class DeviceMemoryResource:
    def __init__(self, device):
        self.device = device

    def allocate(self, size: int, stream=None) -> Buffer:
        return Buffer(self, size)


# --- cuda.core._module / _launch_config / _kernel_arg_handler -----------------------------------------

class Kernel:
    def __init__(self, name, body):
        self.name, self._body = name, body
        self._h_kernel = object()                                 # the CUkernel handle


class KernelHandle:
    def __init__(self, h_kernel):
        self.h_kernel = h_kernel


class LaunchConfig:
    def __init__(self, grid, block, shmem_size=0):
        self.grid, self.block, self.shmem_size = grid, block, shmem_size


class ParamHolder:
    """Packs ``kernel_args`` for the driver: a Buffer as its device pointer, a scalar by value. It holds the
    only strong references to the argument objects that the launch path creates."""

    def __init__(self, kernel_args: tuple):
        self.kernel_args = kernel_args
        self.ptr = tuple(a.handle if isinstance(a, Buffer) else a for a in kernel_args)


def launch(stream, config: LaunchConfig, kernel: Kernel, *kernel_args) -> None:
    """cuda.core ``launch``: an eager launch on ``stream`` (it runs in stream order, while the args live)."""
    ker_args = ParamHolder(kernel_args)
    kernel._body(*ker_args.ptr)


# --- cuda.core.graph ----------------------------------------------------------------------------------

class GraphHandle:
    """The CUgraph: its kernel nodes in order, the user objects it owns, and (here) the capture pool."""

    def __init__(self, device):
        self.device = device
        self.nodes = []
        self.user_objects = []                                    # (object, destructor) pairs
        self.pool = graph_pool_handle(device)


def _attach_user_object(h_graph: GraphHandle, obj, destroy) -> None:
    """cuUserObjectCreate + cuGraphRetainUserObject(..., CU_GRAPH_USER_OBJECT_MOVE)."""
    h_graph.user_objects.append((obj, destroy))


def _destroy_kernel_handle_copy(obj) -> None:
    pass


def _py_host_destructor(obj) -> None:                            # Py_DECREF when the graph is destroyed
    pass


class KernelNode:
    def __init__(self, h_graph, index, config, kernel):
        self._h_graph, self._index, self.config, self.kernel = h_graph, index, config, kernel


def GN_launch(self: "GraphDefinition", conf: LaunchConfig, ker: Kernel, ker_args: ParamHolder) -> KernelNode:
    h_graph = self._h_graph
    kernelParams = ker_args.ptr                                  # node_params.kernelParams = ker_args.ptr
    node = new_graph(h_graph.device, on_freed="reuse")            # cuGraphAddKernelNode: the node records the
    with graph(node, pool=h_graph.pool, name=f"kernel node {len(h_graph.nodes)} ({ker.name})"):  # pointers
        out = ker._body(*kernelParams)
    h_graph.nodes.append((node, out))
    del kernelParams, out
    _attach_user_object(h_graph, KernelHandle(ker._h_kernel), _destroy_kernel_handle_copy)
    if self._variant == "fix":                                   # PR #2041: the arguments live with the graph
        _attach_user_object(h_graph, ker_args.kernel_args, _py_host_destructor)
    return KernelNode(h_graph, len(h_graph.nodes) - 1, conf, ker)


class Graph:
    """The executable graph (cuGraphInstantiate); it shares the definition's nodes and user objects."""

    def __init__(self, h_graph: GraphHandle):
        self._h_graph = h_graph
        self._nodes = list(h_graph.nodes)

    def launch(self, stream=None) -> None:
        for node, out in self._nodes:
            replay(node, out)


class GraphDefinition:
    def __init__(self, device, variant):
        self._h_graph = GraphHandle(device)
        self._variant = variant                                   # (which cuda.core: before/after the PR)

    def launch(self, config: LaunchConfig, kernel: Kernel, *args) -> KernelNode:
        return GN_launch(self, config, kernel, ParamHolder(args))

    def instantiate(self) -> Graph:
        return Graph(self._h_graph)


# --- the application: a two-layer MLP defined as a graph ---------------------------------------------------

def _linear_body(out, inp, params, apply_relu):
    w = params[:HIDDEN * HIDDEN].view(HIDDEN, HIDDEN)
    b = params[HIDDEN * HIDDEN:PARAM_ELEMS]
    y = inp.view(ROWS, HIDDEN) @ w + b
    out.view(ROWS, HIDDEN).copy_(torch.relu(y) if apply_relu else y)
    return out


linear = Kernel("linear", _linear_body)
CONFIG = LaunchConfig(grid=ROWS, block=HIDDEN)


def upload_params(mr, packed, device) -> Buffer:
    params = mr.allocate(param_nbytes(device))
    params.copy_from(packed)
    return params


def add_linear(gdef, mr, out, inp, packed, apply_relu, device):
    """Define one layer: its parameters go into a Buffer that only the kernel node is meant to keep."""
    gdef.launch(CONFIG, linear, out, inp, upload_params(mr, packed, device), apply_relu)
    # returns: the parameter Buffer was passed inline and has no other owner


def linear_eager(stream, mr, out, inp, packed, apply_relu, device):
    launch(stream, CONFIG, linear, out, inp, upload_params(mr, packed, device), apply_relu)


def run(variant: str, device: str = "cpu"):
    gen = generator(2041)
    layers = [(torch.cat([(torch.randn(HIDDEN, HIDDEN, generator=gen) * HIDDEN ** -0.5).reshape(-1),
                          torch.randn(HIDDEN, generator=gen) * 0.5]), relu) for relu in (1, 0)]
    inputs = [torch.randn(ROWS, HIDDEN, generator=gen) for _ in range(STEPS)]

    def serve(graphed: bool):
        mr = DeviceMemoryResource(device)
        x, h, y = (mr.allocate(4 * ROWS * HIDDEN) for _ in range(3))
        for buf in (x, h, y):
            buf.handle.zero_()
        if graphed:
            events.static_buffers("cuda.core Graph (MLP)", {"x": x.handle})
            gdef = GraphDefinition(device, variant)
            add_linear(gdef, mr, h, x, *layers[0], device)
            add_linear(gdef, mr, y, h, *layers[1], device)
            exe = gdef.instantiate()
        outs = []
        for step in range(STEPS):
            x.copy_from(inputs[step])
            if graphed:
                exe.launch()
            else:
                linear_eager(None, mr, h, x, *layers[0], device)
                linear_eager(None, mr, y, h, *layers[1], device)
            outs.append(y.handle.view(ROWS, HIDDEN).clone())
        return outs

    def served():
        with reuse_freed_blocks():       # the memory resource hands a released block to the next allocation
            return serve(True)

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, lambda: serve(False))
