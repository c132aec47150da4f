"""Warp's CPU graph capture runs ``wp.HashGrid.build()`` once, as host code, and never records it: every replay of a particle step queries the buckets of the capture-time positions.

Upstream: https://github.com/NVIDIA/warp/pull/1677 ("Support CPU HashGrid graph replay", NVIDIA/warp, opened
2026-07-20 by shi-eric; closed on GitHub, landed through GitLab MR !2679 as commit 17e26ef1e on main, 2026-07-22),
closing issue #1664 ("[BUG] CPU graph replay uses a stale HashGrid", 2026-07-17). Read: the issue (its reproducer:
two points moved by a captured ``wp.copy`` to another cell, ``grid.build`` and a counting kernel inside
``wp.ScopedCapture(device="cpu")``; eager finds both points, replay none), the PR description, and the commit's diff:
``warp/_src/types.py`` (``HashGrid.build`` / ``reserve``), ``warp/native/hashgrid.cpp`` (``wp_hash_grid_update_host``
gains the ``hash_grid_record_update_host`` branch; ``hash_grid_update_host_impl`` and ``hash_grid_reserve_host_impl``
at the parent), ``warp/native/hashgrid.h`` (``hash_grid_index``, ``hash_grid_query``), the CHANGELOG and runtime docs,
and the new tests in ``warp/tests/geometry/test_hash_grid.py`` (``test_hashgrid_graph_rebuilds_current_points``).
Symptom: with CPU graph capture (Warp 1.13+ APIC, enabled for Newton in newton#3387), a captured simulation step that
rebuilds a ``wp.HashGrid`` replays silently wrong: neighbour queries see the grid as built at capture, so particles
that have moved into each other's cells are not found (or old neighbours are), and contacts are missed.
Mechanism: on the CPU there is no driver graph; ``ScopedCapture`` records launches and memcpys into an operation
stream that ``capture_launch`` replays. ``HashGrid.build`` calls ``wp_hash_grid_update_host``, a native host function
and no launch: it bins and sorts the points right away, while capturing, and records nothing. Each replay re-runs the
force and integration kernels against the grid left by that one capture-time build.
Doctor: host-work-frozen, at ``wp_hash_grid_update_host``: the grid rebuild is host work inside the captured region,
so it ran once at capture and replays reuse its result while eager steps rebuild from the current positions.
Fix (upstream): ``wp_hash_grid_update_host`` asks ``wp_apic_get_recording_state()``; while recording it calls
``hash_grid_record_update_host``, which records the update (grid, cell width, the point and group arrays) in
operation order and skips the eager rebuild; every replay rebuilds the caller-owned grid from the current points.
Modelled: ``HashGrid`` (``build``) as upstream; the native ``HashGrid_t`` with its host buffers (``point_ids``,
``point_cells``, ``cell_starts``, ``cell_ends``: ``wp_alloc_host`` memory), ``hash_grid_index``,
``hash_grid_reserve_host_impl``, ``hash_grid_update_host_impl`` (host code, here numpy on the buffers' memory; the
radix sort of point cells as a stable argsort), ``wp_hash_grid_update_host`` with the fix's
``hash_grid_record_update_host`` branch under ``"fix"``. Stand-ins: Warp CPU arrays are host memory (``host()``) that
CPU kernels read in place; the engine's kernels run on device tensors, so ``launch`` copies a kernel's host arrays in
and its outputs back (recorded copies, which replays re-read by address, as APIC replays memcpys), and an eager launch
returns when done (Warp CPU launches are synchronous). The recorded update (APIC's replay of the op) is the same
binning as recorded kernels, written back into the grid's host buffers. ``hash_grid_query_candidates`` (the
``wp.hash_grid_query`` loop) tests, for every particle at once, the sorted slots of the 27 cells around it. Newton
side: ``Example`` with a particle state, a particle grid built once before capture (as the issue's reproducer does), a
semi-implicit step (``eval_particle_contacts`` over the grid's candidates with penalty contacts, a ground plane,
gravity, ``integrate_particles``) and ``simulate()``, which rebuilds the grid once per frame before the substeps, as
Newton's collide does.
Workload: 16 particles (radius 0.25; contact distance and cell width 0.5) thrown in a 1.5-unit box, 10 frames of 5
substeps; the frame is captured once (no warmup: a capture must not advance the state) and replayed per frame,
against the same frames run eagerly. The capture-time build bins the initial positions, so the first replay equals
eager; from the third frame on the bug variant misses contacts that the moved particles make (max error 0.0074 at
frame 3, 0.174 by frame 10); the fix records the build and equals eager exactly (max error 0). Same numbers with
real CUDA graphs on an H200 (``device="cuda"``, torch 2.11).
"""
from __future__ import annotations

import numpy as np
import torch

from workbench.engine import host, is_capturing, is_host, synchronize
from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/NVIDIA/warp/pull/1677"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "wp_hash_grid_update_host"
SYMPTOM = ("HashGrid.build() inside a CPU graph capture runs once as host code and is not recorded; replays query "
           "the capture-time buckets, so moved particles miss their contacts")

NUM_PARTICLES = 16
PARTICLE_RADIUS = 0.25
GRID_DIM = 16
FRAMES = 10
FRAME_DT = 0.05
SIM_SUBSTEPS = 5
K_CONTACT, K_DAMP = 1000.0, 5.0
GRAVITY = (0.0, 0.0, -9.81)
DTYPE = torch.float64

_variant = "bug"
_device = "cpu"


# --- warp/native/hashgrid.h, hashgrid.cpp (the CPU grid: a host struct with host buffers) --------------------------

HASH_GRID_TYPE_FLOAT64 = 2


class HashGrid_t:
    """The native grid: dimensions, cell width and the sorted point table, all in host memory."""

    def __init__(self, dim_x: int, dim_y: int, dim_z: int):
        self.dim_x, self.dim_y, self.dim_z = dim_x, dim_y, dim_z
        num_cells = dim_x * dim_y * dim_z
        self.cell_starts = host(torch.zeros(num_cells, dtype=torch.int64), _device)     # wp_alloc_host
        self.cell_ends = host(torch.zeros(num_cells, dtype=torch.int64), _device)
        self.point_ids = self.point_cells = None
        self.max_points = self.num_points = 0
        self.cell_width = self.cell_width_inv = 0.0


_hash_grids: dict[int, HashGrid_t] = {}


def wp_hash_grid_create_host(dim_x: int, dim_y: int, dim_z: int) -> int:
    grid = HashGrid_t(dim_x, dim_y, dim_z)
    _hash_grids[id(grid)] = grid
    return id(grid)


def hash_grid_index(grid: HashGrid_t, cell):
    """Integer cell coordinates ``[..., 3]`` -> physical cell (``origin`` offset, modulo the grid dims)."""
    origin = 1 << 20
    c = cell + origin
    c = c * (c > 0)                                             # x = max(0, x)
    cx, cy, cz = c[..., 0] % grid.dim_x, c[..., 1] % grid.dim_y, c[..., 2] % grid.dim_z
    return cz * (grid.dim_x * grid.dim_y) + cy * grid.dim_x + cx


def hash_grid_reserve_host_impl(grid: HashGrid_t, num_points: int) -> None:
    if num_points > grid.max_points:
        num_to_alloc = num_points * 3 // 2
        grid.point_cells = host(torch.zeros(num_to_alloc, dtype=torch.int64), _device)
        grid.point_ids = host(torch.zeros(num_to_alloc, dtype=torch.int64), _device)
        grid.max_points = num_to_alloc
    grid.num_points = num_points


def hash_grid_update_host_impl(grid: HashGrid_t, cell_width: float, points: torch.Tensor) -> None:
    """The CPU rebuild: native host code over the host arrays (their memory, by pointer), run when called."""
    n = points.shape[0]
    hash_grid_reserve_host_impl(grid, n)
    grid.cell_width, grid.cell_width_inv = cell_width, 1.0 / cell_width
    p = points.numpy()
    point_cells, point_ids = grid.point_cells.numpy(), grid.point_ids.numpy()
    cell_starts, cell_ends = grid.cell_starts.numpy(), grid.cell_ends.numpy()
    point_cells[:n] = hash_grid_index(grid, np.floor(p * grid.cell_width_inv).astype(np.int64))
    point_ids[:n] = np.arange(n)
    order = np.argsort(point_cells[:n], kind="stable")          # radix_sort_pairs_host(point_cells, point_ids)
    point_cells[:n], point_ids[:n] = point_cells[:n][order], point_ids[:n][order]
    cell_starts[:] = 0
    cell_ends[:] = 0
    for i in range(n):                                          # compute cell start / end
        c = point_cells[i]
        if i == 0 or c != point_cells[i - 1]:
            cell_starts[c] = i
        if i == n - 1 or c != point_cells[i + 1]:
            cell_ends[c] = i + 1


# --- warp/native/apic.cpp (the CPU capture's operation stream) -------------------------------------------------------

class APICState:
    def __init__(self):
        self.ops: list[tuple] = []


_apic_state = APICState()


def wp_apic_get_recording_state() -> APICState | None:
    return _apic_state if is_capturing() else None


def apic_replay_hash_grid_update(grid: HashGrid_t, cell_width: float, points: torch.Tensor) -> None:
    """(The fix) The recorded op, as replay runs it: rebuild the grid from the current points, in operation order."""
    grid.cell_width, grid.cell_width_inv = cell_width, 1.0 / cell_width
    p = _stage(points)
    n = p.shape[0]
    cells = hash_grid_index(grid, torch.floor(p * grid.cell_width_inv).to(torch.int64))
    order = torch.argsort(cells, stable=True)
    sorted_cells = cells[order]
    slot = torch.ones_like(order).cumsum(0) - 1
    starts = torch.zeros(grid.cell_starts.shape, dtype=torch.int64, device=_device)
    ends = torch.zeros(grid.cell_ends.shape, dtype=torch.int64, device=_device)
    starts.scatter_reduce_(0, sorted_cells, slot, reduce="amin", include_self=False)
    ends.scatter_reduce_(0, sorted_cells, slot + 1, reduce="amax")
    grid.point_cells[:n].copy_(sorted_cells, non_blocking=True)
    grid.point_ids[:n].copy_(order, non_blocking=True)
    grid.cell_starts.copy_(starts, non_blocking=True)
    grid.cell_ends.copy_(ends, non_blocking=True)


def apic_record_hash_grid_update(state: APICState, id: int, grid_type: int, cell_width: float,
                                 points: torch.Tensor) -> None:
    state.ops.append(("hash_grid_update", id, grid_type, cell_width))
    apic_replay_hash_grid_update(_hash_grids[id], cell_width, points)


def hash_grid_record_update_host(state: APICState | None, id: int, grid_type: int, cell_width: float,
                                 points: torch.Tensor) -> bool:
    """(The fix) CPU capture is record-only: True tells the caller to skip the eager rebuild."""
    if not state:
        return False
    apic_record_hash_grid_update(state, id, grid_type, cell_width, points)
    return True


def wp_hash_grid_update_host(id: int, type: int, cell_width: float, points: torch.Tensor) -> None:
    grid = _hash_grids[id]
    if _variant == "fix":
        if hash_grid_record_update_host(wp_apic_get_recording_state(), id, type, cell_width, points):
            return
    hash_grid_update_host_impl(grid, cell_width, points)       # runs now; a capture records nothing of it


# --- warp/_src/types.py ----------------------------------------------------------------------------------------------

class HashGrid:
    def __init__(self, dim_x: int, dim_y: int, dim_z: int, device: str):
        self.device = device
        self._type_id = HASH_GRID_TYPE_FLOAT64
        self.id = wp_hash_grid_create_host(dim_x, dim_y, dim_z)
        self.reserved = False

    def build(self, points: torch.Tensor, radius: float) -> None:
        if radius <= 0.0:
            raise ValueError(f"Hash grid cell width must be positive, got {radius}")
        wp_hash_grid_update_host(self.id, self._type_id, radius, points)
        self.reserved = True


# --- warp launches on the CPU (stand-in: host arrays staged through device tensors) ---------------------------------

def _is_host_array(a) -> bool:
    return isinstance(a, torch.Tensor) and (is_host(a) or (a.device.type == "cpu" and _device.startswith("cuda")))


def _stage(a):
    """A kernel's view of a host array: copied in (a recorded memcpy, re-read by address at each replay)."""
    if not _is_host_array(a):
        return a
    d = torch.empty(a.shape, dtype=a.dtype, device=_device)
    d.copy_(a, non_blocking=True)
    return d


def launch(kernel, dim: int, inputs=(), outputs=()):
    """``wp.launch`` on the CPU: the kernel writes its outputs in place, and an eager launch returns when done."""
    args = [_stage(a) for a in inputs]
    outs = [_stage(a) for a in outputs]
    kernel(dim, *args, *outs)
    for dst, src in zip(outputs, outs):
        dst.copy_(src, non_blocking=True)
    if not is_capturing():
        synchronize(_device)
    return outs


def hash_grid_query_candidates(grid_id: int, points: torch.Tensor, offsets: torch.Tensor):
    """``wp.hash_grid_query`` for every point at once: which sorted slots lie in the 27 cells around it."""
    grid = _hash_grids[grid_id]
    starts, ends, ids = _stage(grid.cell_starts), _stage(grid.cell_ends), _stage(grid.point_ids)
    base = torch.floor(points * grid.cell_width_inv).to(torch.int64)
    cells = hash_grid_index(grid, base[:, None, :] + offsets[None])              # [N, 27]
    slot = torch.ones_like(ids).cumsum(0) - 1                                     # [S]
    s, e = starts[cells][..., None], ends[cells][..., None]
    return ((slot >= s) & (slot < e)).any(1), ids                                # [N, S], [S]


# --- newton (stand-ins: particle contacts and the semi-implicit integrator) -----------------------------------------

def eval_particle_contacts(dim, grid_id, offsets, particle_q, particle_qd, particle_f):
    q, qd = particle_q, particle_qd
    found, ids = hash_grid_query_candidates(grid_id, q, offsets)
    d = q[:, None, :] - q[ids][None]                                              # [N, S, 3]
    dist = d.norm(dim=-1)
    me = (torch.ones_like(q[:, 0]).cumsum(0) - 1).to(torch.int64)
    touching = found & (ids[None] != me[:, None]) & (dist < 2.0 * PARTICLE_RADIUS)
    n = d / dist.clamp(min=1e-9)[..., None]
    vrel = ((qd[:, None, :] - qd[ids][None]) * n).sum(-1)
    mag = torch.where(touching, K_CONTACT * (2.0 * PARTICLE_RADIUS - dist) - K_DAMP * vrel, torch.zeros_like(dist))
    f = (mag[..., None] * n).sum(1)
    ground = (PARTICLE_RADIUS - q[:, 2]).clamp(min=0.0)
    f[:, 2] += K_CONTACT * ground - K_DAMP * qd[:, 2] * (ground > 0)
    particle_f.copy_(f)


def integrate_particles(dim, particle_q, particle_qd, particle_f, gravity, dt, q_out, qd_out):
    v = particle_qd + (particle_f + gravity) * dt
    qd_out.copy_(v)
    q_out.copy_(particle_q + v * dt)


class Example:
    def __init__(self, device: str, positions: torch.Tensor, velocities: torch.Tensor):
        self.device = device
        self.particle_q = host(positions.clone(), device)
        self.particle_qd = host(velocities.clone(), device)
        self.particle_f = host(torch.zeros_like(positions), device)
        self.gravity = torch.tensor(GRAVITY, dtype=DTYPE, device=device)
        offsets = torch.cartesian_prod(*[torch.tensor([-1, 0, 1])] * 3)
        self.offsets = offsets.to(device)
        self.particle_grid = HashGrid(GRID_DIM, GRID_DIM, GRID_DIM, device)
        self.particle_grid.build(self.particle_q, 2.0 * PARTICLE_RADIUS)      # built (and sized) before capture
        self.sim_dt = FRAME_DT / SIM_SUBSTEPS
        self.graph = None

    def simulate(self) -> torch.Tensor:
        self.particle_grid.build(self.particle_q, 2.0 * PARTICLE_RADIUS)      # once per frame, as collide() does
        for _ in range(SIM_SUBSTEPS):
            launch(eval_particle_contacts, NUM_PARTICLES,
                   inputs=[self.particle_grid.id, self.offsets, self.particle_q, self.particle_qd],
                   outputs=[self.particle_f])
            q_out, _ = launch(integrate_particles, NUM_PARTICLES,
                              inputs=[self.particle_q, self.particle_qd, self.particle_f, self.gravity, self.sim_dt],
                              outputs=[self.particle_q, self.particle_qd])
        return q_out

    def capture(self):
        self.graph, self.graph_out = capture(self.simulate, device=self.device, warmups=0, name="simulate",
                                             owner="Example", state={"particle_q": self.particle_q,
                                                                     "particle_qd": self.particle_qd})

    def step(self) -> torch.Tensor:
        if self.graph is not None:
            return replay(self.graph, self.graph_out).clone()
        return self.simulate().clone()


# --- the workload -----------------------------------------------------------------------------------------------------

def run(variant: str, device: str = "cpu"):
    global _variant, _device
    _variant, _device = variant, device
    gen = generator(1664)
    positions = (torch.rand(NUM_PARTICLES, 3, generator=gen, dtype=DTYPE) * 1.5
                 + torch.tensor([0.25, 0.25, 0.5], dtype=DTYPE))
    velocities = (torch.rand(NUM_PARTICLES, 3, generator=gen, dtype=DTYPE) - 0.5) * 4.0

    def serve(use_cuda_graph: bool):
        _hash_grids.clear()
        example = Example(device, positions, velocities)
        if use_cuda_graph:
            example.capture()
        return [example.step() for _ in range(FRAMES)]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
