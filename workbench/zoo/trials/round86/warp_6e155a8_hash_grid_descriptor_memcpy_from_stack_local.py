"""A captured HashGrid build copies the grid descriptor to the device from a stack local: replays upload garbage.

Upstream: https://github.com/NVIDIA/warp/commit/6e155a87c3b77ec65780f239d8631f8bb6631a2e ("Fixing hash grid CUDA
graph interactions", NVIDIA/warp, Miles Macklin, 2022-03-08). Read: the whole commit diff (warp/native/hashgrid.cpp,
warp/native/warp.cu, warp/native/sort.cu, warp/context.py, tests/test_misc.py) and hashgrid.h / hashgrid.cu at that
commit. No issue or PR thread exists for it (a direct commit); the symptom below is inferred from the diff and the
test it rewrote (a Lennard-Jones step with ``grid.build`` + ``wp.launch`` inside ``wp.capture_begin/end``, replayed).
Symptom: a simulation step that rebuilds a ``wp.HashGrid`` and queries it, captured into a CUDA graph and replayed with
``wp.capture_launch``, gives wrong neighbour sets (wrong forces, diverging trajectories) although the same step run
eagerly is correct.
Mechanism: ``HashGrid.build`` calls ``hash_grid_update_device`` (warp/native/hashgrid.cpp). It copies the host-side
descriptor into a local ``HashGrid grid;`` (``hash_grid_get_descriptor``), grows the point buffers if needed, sets
``num_points`` / ``cell_width`` / ``cell_width_inv``, launches the rebuild kernels (``hash_grid_rebuild_device``:
``compute_cell_indices``, ``radix_sort_pairs_device``, two memsets, ``compute_cell_offsets``, which take the grid by
value), then ``memcpy_h2d((HashGrid*)id, &grid, sizeof(HashGrid))`` uploads the descriptor that device-side queries
(``hash_grid_query`` in the user kernel: ``query.grid = *(const HashGrid*)(id)``) read. Under stream capture that
memcpy becomes a memcpy node holding the host address ``&grid``: a stack slot of a frame that is popped when the
function returns. Every ``wp.capture_launch`` re-reads that address, where later native calls from the same Python
depth (``cuda_launch_kernel`` at capture, ``cuda_graph_launch`` at every replay) have put their own locals, so the
replayed upload writes garbage ``cell_width_inv`` / ``dim_x`` into the device descriptor. The rebuild kernels got the
right values by value at capture, so cells are built with one hashing and queried with another.
Doctor: dangling-reference, at hash_grid_update_device. The graph's memcpy node reads host memory (the local's stack
slot) whose owner, the function's frame, released it when the function returned; the fix gives the memory a lifetime
as long as the graph's.
Fix (upstream): ``static HashGrid grid;`` in ``hash_grid_update_device`` ("host grid must be static so that we can
perform host->device memcpy from this var and have it safely recorded inside CUDA graphs"), so the recorded host
address stays valid and keeps the capture-time descriptor. (The same commit also sizes the device descriptor
allocation in ``hash_grid_create_device`` as ``sizeof(HashGrid)``, passes the capture stream to CUB's temp-size query,
and makes ``capture_end`` raise on a failed capture; none of these is the replay bug and none is modelled.)
Modelled: ``hash_grid_create_device`` / ``hash_grid_get_descriptor`` / ``hash_grid_add_descriptor`` /
``hash_grid_update_device`` / ``hash_grid_rebuild_device`` with its kernels, ``hash_grid_index``, a vectorised
``hash_grid_query`` loop, and the test's step kernel (``lennard_jones``; its force law is a soft repulsion stand-in,
float64). The C stack of the thread calling into warp.so is one host buffer (``host()``, pinned on CUDA); each native
entry point's frame starts at the same address (Python calls them from one depth); the frames of
``cuda_launch_kernel`` and ``cuda_graph_launch`` hold their real locals (dim, block_dim, grid_dim; the graph exec
handle). A ``HashGrid`` descriptor is its scalar fields (cell_width, cell_width_inv, dim_x, dim_y, dim_z, num_points,
max_points) as float64 words; its device pointers are kept by the Python object and passed to kernels directly.
``memcpy_h2d`` is a blocking copy eagerly (cudaMemcpyAsync from pageable memory stages the source at the call) and a
non-blocking copy from the pinned stack when capturing (a memcpy node that reads the host address at replay).
``wp.ScopedCapture`` + ``wp.capture_launch`` are ``kit.capture`` (no warm-up) + ``kit.replay``.
Workload: 64 points in a periodic 8^3 box, cell width 2 (a 4x4x4 grid), query radius 1.5, dt 0.01. The grid is built
once eagerly (allocating point buffers), then one step (build + ``lennard_jones``) is captured and replayed 4 times;
positions and velocities after each step are the outputs. Bug: at replay the stack slot holds
[graph handle, 256 (block_dim), 1 (grid_dim), 4, 4, 64, 96], so queries hash with cell_width_inv 256 and dim_x 1
instead of 0.5 and 4, visit the wrong cells and miss neighbours: every step's forces differ from eager. Fix: the
static descriptor keeps [2, 0.5, 4, 4, 4, 64, 96] and replays equal eager.
"""
from __future__ import annotations

import torch

from workbench.engine import host
from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/NVIDIA/warp/commit/6e155a87c3b77ec65780f239d8631f8bb6631a2e"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "hash_grid_update_device"
SYMPTOM = ("HashGrid.build + a hash-grid query captured with wp.capture_begin/end: every wp.capture_launch uploads "
           "the grid descriptor from the popped stack slot of hash_grid_update_device's local HashGrid, so queries "
           "hash with garbage cell_width_inv / dim_x and return wrong neighbours (wrong forces)")

NUM_POINTS = 64
BOX = 8.0
CELL_RADIUS = 2.0
QUERY_RADIUS = 1.5
DIM_X = DIM_Y = DIM_Z = 4
DT = 0.01
STIFFNESS = 40.0
STEPS = 4
ORIGIN = 1 << 20                       # hash_grid_index: offset to ensure positive coordinates
STACK_WORDS = 16
# struct HashGrid (its scalar fields; the device pointers are not modelled as words)
FIELDS = ("cell_width", "cell_width_inv", "dim_x", "dim_y", "dim_z", "num_points", "max_points")

_variant = "bug"


class WarpNative:
    """warp.so as loaded in one process: the calling thread's C stack and the function statics."""

    def __init__(self, device):
        self.device = device
        self.stack = host(torch.zeros(STACK_WORDS, dtype=torch.float64), device)
        # (fix) static HashGrid grid; in hash_grid_update_device: its own host memory for the process
        self.static_hash_grid = host(torch.zeros(len(FIELDS), dtype=torch.float64), device)
        self.g_hash_grid_descriptors = {}       # id -> host-side HashGrid
        self.next_graph_handle = 1

    def frame(self, words):
        """The locals of a native entry point: they start at the same stack address every call."""
        return self.stack[:words]


def _write_locals(native, dst, values):
    """Host code writing its locals (a host-to-host store; not device work)."""
    dst.copy_(host(torch.tensor([float(v) for v in values], dtype=torch.float64), native.device))


def _store(native, dst, grid):
    _write_locals(native, dst, [grid[name] for name in FIELDS])


def memcpy_h2d(dst, src):
    # cudaMemcpyAsync(dst, src, ..., stream): staged from pageable memory at the call when eager; under stream
    # capture a memcpy node that reads the host address when the graph runs
    dst.copy_(src, non_blocking=torch.cuda.is_current_stream_capturing())


class HashGridDevice:
    """The device allocations behind one grid id (grid_device and the arrays its pointers name)."""

    def __init__(self, device):
        num_cells = DIM_X * DIM_Y * DIM_Z
        self.grid_device = torch.zeros(len(FIELDS), dtype=torch.float64, device=device)
        self.cell_starts = torch.zeros(num_cells, dtype=torch.int64, device=device)
        self.cell_ends = torch.zeros(num_cells, dtype=torch.int64, device=device)
        self.point_cells = None
        self.point_ids = None


def hash_grid_create_device(native, dim_x, dim_y, dim_z):
    grid = dict.fromkeys(FIELDS, 0.0)
    grid.update(dim_x=dim_x, dim_y=dim_y, dim_z=dim_z)
    mem = HashGridDevice(native.device)
    local = native.frame(len(FIELDS))               # HashGrid grid; (a local, outside any capture here)
    _store(native, local, grid)
    memcpy_h2d(mem.grid_device, local)
    grid_id = id(mem)
    native.g_hash_grid_descriptors[grid_id] = (grid, mem)
    return grid_id


def hash_grid_get_descriptor(native, grid_id):
    grid, mem = native.g_hash_grid_descriptors[grid_id]
    return dict(grid), mem


def hash_grid_add_descriptor(native, grid_id, grid, mem):
    native.g_hash_grid_descriptors[grid_id] = (dict(grid), mem)


def hash_grid_index(cell_x, cell_y, cell_z, dim_x, dim_y, dim_z):
    cx = (cell_x + ORIGIN) % dim_x
    cy = (cell_y + ORIGIN) % dim_y
    cz = (cell_z + ORIGIN) % dim_z
    return cz * (dim_x * dim_y) + cy * dim_x + cx


def hash_grid_rebuild_device(grid, mem, points, num_points):
    # compute_cell_indices(grid, points, num_points): the grid is a kernel argument, by value
    c = torch.trunc(points * grid["cell_width_inv"]).to(torch.int64)
    cells = hash_grid_index(c[:, 0], c[:, 1], c[:, 2], int(grid["dim_x"]), int(grid["dim_y"]), int(grid["dim_z"]))
    mem.point_cells[:num_points].copy_(cells)
    mem.point_ids[:num_points].copy_(torch.arange(num_points, device=points.device))
    # radix_sort_pairs_device(point_cells, point_ids, num_points)
    keys, order = torch.sort(mem.point_cells[:num_points], stable=True)
    values = mem.point_ids[:num_points][order]
    mem.point_cells[:num_points].copy_(keys)
    mem.point_ids[:num_points].copy_(values)
    mem.cell_starts.zero_()
    mem.cell_ends.zero_()
    # compute_cell_offsets(cell_starts, cell_ends, point_cells, num_points)
    k = torch.arange(num_points, device=points.device)
    mem.cell_ends.scatter_reduce_(0, keys, k + 1, reduce="amax")
    starts = torch.full_like(mem.cell_starts, num_points).scatter_reduce_(0, keys, k, reduce="amin")
    mem.cell_starts.copy_(torch.where(mem.cell_ends > 0, starts, torch.zeros_like(starts)))


def hash_grid_update_device(native, grid_id, cell_width, points, num_points):
    grid_mem = hash_grid_get_descriptor(native, grid_id)
    grid, mem = grid_mem
    if _variant == "fix":
        host_grid = native.static_hash_grid          # static HashGrid grid;
    else:
        host_grid = native.frame(len(FIELDS))        # HashGrid grid; (a stack local)
    if num_points > grid["max_points"]:
        num_to_alloc = num_points * 3 // 2
        mem.point_cells = torch.zeros(2 * num_to_alloc, dtype=torch.int64, device=points.device)
        mem.point_ids = torch.zeros(2 * num_to_alloc, dtype=torch.int64, device=points.device)
        grid["max_points"] = num_to_alloc
    grid["num_points"] = num_points
    grid["cell_width"] = cell_width
    grid["cell_width_inv"] = 1.0 / cell_width
    _store(native, host_grid, grid)
    hash_grid_rebuild_device(grid, mem, points, num_points)
    # update device side grid descriptor
    memcpy_h2d(mem.grid_device, host_grid)
    # update host side grid descriptor
    hash_grid_add_descriptor(native, grid_id, grid, mem)


def cuda_launch_kernel(native, kernel, dim, args):
    block_dim = 256
    grid_dim = (dim + block_dim - 1) // block_dim
    _write_locals(native, native.frame(3), [dim, block_dim, grid_dim])
    kernel(*args)


def cuda_graph_launch(native, graph_exec):
    _write_locals(native, native.frame(1), [graph_exec.handle])
    return replay(graph_exec.graph, graph_exec.outputs)


class HashGrid:
    """wp.HashGrid (device)."""

    def __init__(self, native, dim_x, dim_y, dim_z):
        self.native = native
        self.id = hash_grid_create_device(native, dim_x, dim_y, dim_z)

    def build(self, points, radius):
        hash_grid_update_device(self.native, self.id, radius, points, len(points))


def lennard_jones(grid_id, native, points, velocities, radius, dt):
    """The step kernel: for each point, hash_grid_query / hash_grid_query_next over the grid, then integrate."""
    _, mem = native.g_hash_grid_descriptors[grid_id]
    desc = mem.grid_device                                   # query.grid = *(const HashGrid*)(id)
    inv = desc[1]
    dims = desc[2:5].to(torch.int64)
    q = max(DIM_X, DIM_Y, DIM_Z)                             # cells visited per axis: at most dim
    start = torch.trunc((points - radius) * inv).to(torch.int64)                        # [N, 3]
    end = torch.minimum(torch.trunc((points + radius) * inv).to(torch.int64), start + dims - 1)
    o = torch.arange(q, device=points.device)
    ox, oy, oz = (o.view(q, 1, 1), o.view(1, q, 1), o.view(1, 1, q))
    n = points.shape[0]
    span = (end - start).view(n, 3, 1, 1, 1)
    valid = (ox <= span[:, 0]) & (oy <= span[:, 1]) & (oz <= span[:, 2])                # [N, q, q, q]
    cells = hash_grid_index(start[:, 0].view(n, 1, 1, 1) + ox, start[:, 1].view(n, 1, 1, 1) + oy,
                            start[:, 2].view(n, 1, 1, 1) + oz, dims[0], dims[1], dims[2])
    cells = cells.expand(n, q, q, q).reshape(n, -1)
    lo, hi = mem.cell_starts[cells], mem.cell_ends[cells]                               # [N, q^3]
    k = torch.arange(n, device=points.device).view(1, 1, n)
    visits = ((k >= lo.unsqueeze(-1)) & (k < hi.unsqueeze(-1)) & valid.reshape(n, -1, 1)).sum(1)   # [N, N(sorted)]
    j = mem.point_ids[:n]
    xij = points.unsqueeze(1) - points[j].unsqueeze(0)                                   # [N, N(sorted), 3]
    xij = xij - torch.round(xij / BOX) * BOX
    dij = xij.norm(dim=-1)
    w = visits.to(points.dtype) * (dij <= radius).to(points.dtype) * (radius - dij) / dij.clamp_min(1e-9)
    force = STIFFNESS * (w.unsqueeze(-1) * xij).sum(1)
    vel = velocities + dt * force
    velocities.copy_(vel)
    points.copy_(torch.remainder(points + dt * vel, BOX))


class GraphExec:
    def __init__(self, handle, graph, outputs):
        self.handle, self.graph, self.outputs = handle, graph, outputs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(6155)
    p0 = torch.rand(NUM_POINTS, 3, generator=gen, dtype=torch.float64) * BOX
    v0 = torch.randn(NUM_POINTS, 3, generator=gen, dtype=torch.float64) * 0.5

    def simulate(use_graph):
        native = WarpNative(device)
        points, velocities = p0.clone().to(device), v0.clone().to(device)
        grid = HashGrid(native, DIM_X, DIM_Y, DIM_Z)
        grid.build(points, CELL_RADIUS)                      # begin: allocate the point buffers

        def step():
            grid.build(points, CELL_RADIUS)
            cuda_launch_kernel(native, lennard_jones, NUM_POINTS,
                               (grid.id, native, points, velocities, QUERY_RADIUS, DT))
            return points, velocities

        outs = []
        if not use_graph:
            for _ in range(STEPS):
                step()
                outs += [points.clone(), velocities.clone()]
            return outs
        _, mem = native.g_hash_grid_descriptors[grid.id]
        g, out = capture(step, device=device, warmups=0, name="wp.ScopedCapture", owner="wp.ScopedCapture",
                         state={"points": points, "velocities": velocities, "grid_device": mem.grid_device,
                                "point_cells": mem.point_cells, "point_ids": mem.point_ids,
                                "cell_starts": mem.cell_starts, "cell_ends": mem.cell_ends})
        graph_exec = GraphExec(native.next_graph_handle, g, out)
        for _ in range(STEPS):
            p, v = cuda_graph_launch(native, graph_exec)       # wp.capture_launch(graph)
            outs += [p.clone(), v.clone()]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: simulate(True), lambda: simulate(False))
