"""A captured ``array.fill_`` of a vector value re-reads the caller's temporary ctypes value at every replay.

Upstream: https://github.com/NVIDIA/warp/issues/1040 ("[BUG] Non-deterministic array.fill_() behavior with graph
capture"), fixed by commit ca7b83eff734de167b52f766a3fcbd17d30eeba2 ("Fix incorrect results when filling arrays
in CUDA graphs (GH-1040)", merge 7ddcbbb "lwawrzyniak/fix-fill-graphs", Warp 1.10, October 2025).
Symptom: an ``arr.fill_(wp.vec3(1.0))`` captured with ``wp.ScopedCapture`` fills the right value when the graph is
launched right away, but after an eager ``arr.fill_(wp.vec3(2.0))`` the next ``wp.capture_launch`` fills 2.0
("oh, so, this works? ... ah, no"): the captured fill follows whatever value was filled last. No error.
Mechanism: ``array.fill_`` converts the value to a ctypes object (``cvalue = self.dtype(value)``, a temporary
whose bytes live in CPython's allocator) and, for a contiguous array, calls ``wp_memtile_device(dst,
cvalue_ptr, 12, n)``. A 12-byte value is none of the sizes handled without staging (2/4/8 bytes go to
``memtile_value_kernel`` by value, 1 byte to ``cudaMemset``), so the generic branch allocates ``src_devptr``
on the device, issues ``cudaMemcpyAsync(src_devptr, src, ...)`` from the *host pointer* of ``cvalue``,
launches ``memtile_kernel`` and frees ``src_devptr``. Under capture the memcpy becomes a graph node that keeps
the host address, and every launch re-reads it. ``cvalue`` dies when ``fill_`` returns; CPython hands its memory
to the next object of the same size class, which is the next ``fill_``'s value: the graph then copies that value
into the force array. (Nothing is read from freed memory that faults: the block is simply someone else's now.)
Doctor: dangling-reference, at ``wp_memtile_device`` (the captured H2D copy keeps the address of the caller's
temporary value, which is released when ``fill_`` returns and reused by the next one).
Fix (upstream): ``capturable_tmp_alloc`` gives the graph its own copy of the value when a capture is under way:
with CUDA >= 12.4 it pauses the capture, copies the value into device memory the graph owns
(``CaptureInfo.tmp_allocs``, freed in ``on_graph_destroy``) and resumes; on older CUDA it copies the value into
a host allocation the graph owns and captures the H2D copy from there. ``wp_memtile_device`` and
``wp_array_fill_device`` both use it.
Read: the diff of ca7b83e (``warp/native/warp.cu``, the test ``test_graph_fill_vecmat``) and ``array.fill_``
at its parent. This program models the pre-12.4 branch of ``capturable_tmp_alloc`` (the graph-owned host
staging copy): the engine has no public way to pause a capture. CPython's allocator is modelled as a pool of
same-size blocks handed out most-recently-freed first.
"""
from __future__ import annotations

import torch

from workbench.engine import host
from workbench.zoo.kit import capture, compare, replay

UPSTREAM = "https://github.com/NVIDIA/warp/issues/1040"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "wp_memtile_device"
SYMPTOM = "a captured vec3 fill_ of the particle forces fills the value of the last eager fill_ (the wind)"

NUM_PARTICLES, SIM_SUBSTEPS, FRAME_DT = 6, 2, 0.05
GRAVITY = (0.0, -9.8, 0.0)
WINDS = [(0.5, 0.0, 0.25), (-1.0, 2.0, 0.0), (0.0, 0.0, 3.0)]      # eager body-force resets between frames
PYMALLOC_BLOCK = 16                  # CPython's small-object size class holding a c_float_Array_3's bytes

g_captures: dict[int, CaptureInfo] = {}       # the captures under way (warp.cu: g_captures, by capture id)


class PymallocPool:
    """CPython's small-object allocator for one size class: a freed object's block goes on a free list and the
    next object of that size is placed in the most recently freed block. Host memory, never a graph's."""

    def __init__(self, device: str, nblocks: int = 8):
        self.device = device
        self.arena = host(torch.zeros(nblocks * PYMALLOC_BLOCK, dtype=torch.uint8), device)
        self.free = [self.arena[i * PYMALLOC_BLOCK:(i + 1) * PYMALLOC_BLOCK] for i in reversed(range(nblocks))]

    def malloc(self) -> torch.Tensor:
        return self.free.pop()

    def release(self, block: torch.Tensor) -> None:
        self.free.append(block)


class vec3:
    """``wp.vec3``: a ctypes ``c_float * 3`` object (its 12 value bytes live inside the Python object)."""
    size = 12

    def __init__(self, pool: PymallocPool, value):
        self.pool, self.block = pool, pool.malloc()
        value_bytes = host(torch.tensor([float(v) for v in value], dtype=torch.float32), pool.device)
        self.block[: self.size].copy_(value_bytes.view(torch.uint8))   # the ctypes constructor, on the host

    def ptr(self) -> torch.Tensor:               # ctypes.pointer(cvalue)
        return self.block[: self.size]

    def __del__(self):
        self.pool.release(self.block)


class CaptureInfo:
    def __init__(self):
        self.tmp_allocs: list[torch.Tensor] = []   # temporary allocations owned by the graph (the fix)


class Graph:
    """``wp.Graph``: the executable graph and what it owns."""

    def __init__(self, exec_, outputs, tmp_allocs):
        self.exec, self.outputs, self.tmp_allocs = exec_, outputs, tmp_allocs


def capturable_tmp_alloc(device: str, data: torch.Tensor, size: int) -> tuple[torch.Tensor, bool]:
    """(the fix) Copy a value to device memory in a graph-friendly way. While a capture is under way the
    staging copy belongs to the graph (older-CUDA branch: host memory, freed when the graph is destroyed)."""
    capture_info = next(iter(g_captures.values()), None)
    if capture_info is not None:
        hostptr = host(torch.empty(size, dtype=torch.uint8), device)    # wp_alloc_host(size)
        hostptr.copy_(data)                                            # memcpy(hostptr, data, size): host work
        devptr = torch.empty(size, dtype=torch.uint8, device=device)   # the alloc and the H2D copy are captured
        devptr.copy_(hostptr, non_blocking=True)
        capture_info.tmp_allocs.append(hostptr)                        # graph takes ownership of the value storage
        return devptr, True
    devptr = torch.empty(size, dtype=torch.uint8, device=device)       # not capturing: copy the value now
    devptr.copy_(data, non_blocking=True)
    return devptr, True


def memtile_kernel(dst: torch.Tensor, src_devptr: torch.Tensor, srcsize: int, n: int) -> None:
    dst.view(n, srcsize).copy_(src_devptr.view(1, srcsize).expand(n, srcsize))


def wp_memtile_device(device: str, dst: torch.Tensor, src: torch.Tensor, srcsize: int, n: int, variant: str):
    """``wp_memtile_device``: 1/2/4/8-byte values go to ``memtile_value_kernel`` by value (not shown: a
    ``vec3`` is 12 bytes); the generic version stages the value in device memory."""
    if variant == "bug":
        # copy value to device memory
        src_devptr = torch.empty(srcsize, dtype=torch.uint8, device=device)   # wp_alloc_device
        src_devptr.copy_(src, non_blocking=True)       # cudaMemcpyAsync from the caller's host pointer
        memtile_kernel(dst, src_devptr, srcsize, n)
        del src_devptr                                 # wp_free_device
    else:
        value_devptr, free_devptr = capturable_tmp_alloc(device, src, srcsize)
        memtile_kernel(dst, value_devptr, srcsize, n)
        if free_devptr:
            del value_devptr


class array:
    """A contiguous ``wp.array(dtype=wp.vec3)`` on the device."""

    def __init__(self, data: torch.Tensor, pool: PymallocPool, variant: str):
        self.data, self.pool, self.variant = data, pool, variant
        self.size = data.shape[0]

    def fill_(self, value):
        cvalue = vec3(self.pool, value)               # cvalue = self.dtype(value)
        # prefer using memtile for contiguous arrays, because it should be faster than generic fill
        wp_memtile_device(str(self.data.device), self.data.view(torch.uint8), cvalue.ptr(), vec3.size,
                          self.size, self.variant)
        # cvalue goes out of scope here: CPython releases its block


class ScopedCapture:
    """``with wp.ScopedCapture() as capture:``; ``capture.graph`` is launched with ``wp.capture_launch``."""

    def __init__(self, device: str, static: dict, state: dict):
        self.device, self.static, self.state = device, static, state

    def capture(self, fn) -> Graph:
        info = CaptureInfo()
        g_captures[id(info)] = info
        try:
            g, out = capture(fn, device=self.device, warmups=0, name="wp.ScopedCapture", static=self.static,
                             state=self.state, owner="warp.ScopedCapture (particle simulation)")
        finally:
            del g_captures[id(info)]
        return Graph(g, out, info.tmp_allocs)


def capture_launch(graph: Graph):
    return replay(graph.exec, graph.outputs)


class Example:
    """A particle example in the style of ``warp/examples``: every substep resets the per-particle forces to
    gravity with ``fill_`` and integrates; a user callback resets the external body forces between frames."""

    def __init__(self, device: str, variant: str, use_cuda_graph: bool):
        self.pool = PymallocPool(device)
        start = torch.arange(NUM_PARTICLES * 3, dtype=torch.float32).view(NUM_PARTICLES, 3) * 0.1
        self.particle_q = start.to(device)
        self.particle_qd = torch.zeros(NUM_PARTICLES, 3, device=device)
        self.particle_f = array(torch.zeros(NUM_PARTICLES, 3, device=device), self.pool, variant)
        self.body_f = array(torch.zeros(NUM_PARTICLES, 3, device=device), self.pool, variant)
        self.inv_mass = (1.0 / (1.0 + torch.arange(NUM_PARTICLES, dtype=torch.float32))).to(device)[:, None]
        self.graph = None
        if use_cuda_graph:
            static = {"body_f (external forces, set between frames)": self.body_f.data}
            state = {"particle_q": self.particle_q, "particle_qd": self.particle_qd,
                     "particle_f": self.particle_f.data}
            self.graph = ScopedCapture(device, static, state).capture(self.simulate)

    def simulate(self):
        dt = FRAME_DT / SIM_SUBSTEPS
        for _ in range(SIM_SUBSTEPS):
            self.particle_f.fill_(GRAVITY)
            # integrate_particles: v += (f_gravity + f_ext * inv_mass) * dt; x += v * dt
            self.particle_qd.add_((self.particle_f.data + self.body_f.data * self.inv_mass) * dt)
            self.particle_q.add_(self.particle_qd * dt)
        return self.particle_q

    def step(self) -> torch.Tensor:
        if self.graph is not None:
            return capture_launch(self.graph)
        return self.simulate()

    def apply_wind(self, wind):
        self.body_f.fill_(wind)                        # eager, between frames


def run(variant: str, device: str = "cpu"):
    def serve(use_cuda_graph: bool):
        example = Example(device, variant, use_cuda_graph)
        outs = [example.step().clone()]
        for wind in WINDS:
            example.apply_wind(wind)
            outs.append(example.step().clone())
            outs.append(example.step().clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
