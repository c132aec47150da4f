"""Setting ``Mesh.points`` in capture records an H2D descriptor copy from a C++ stack struct that replays re-read.

Upstream: https://github.com/NVIDIA/warp/commit/9ff0fcc3a769278b312903542dcc2cad55afd67c ("Fix the Graph Capture
Bug of VBDIntegrator (GH-441)"); issues https://github.com/NVIDIA/warp/issues/441 and #587.
Symptom: ``VBDIntegrator.simulate`` with ``handle_self_contact=True`` captured in ``wp.ScopedCapture`` and launched
with ``wp.capture_launch`` fails the CUDA error check / hits illegal memory accesses (cloth self-contact example).
Mechanism: ``collision_detection_penetration_free`` calls ``TriMeshCollisionDetector.refit(particle_q)``, which does
``self.mesh_tris.points = new_pos``. The ``wp.Mesh.points`` setter calls the native ``mesh_set_points_device(id,
points)``: it copies the host descriptor into a local ``wp::Mesh m`` (on the C++ stack), sets ``m.points``,
``memcpy_h2d(mesh_device, &m, sizeof(wp::Mesh))`` (a ``cudaMemcpyAsync`` from the *host address* of ``m``), updates
the host copy (``mesh_set_descriptor``) and calls ``mesh_refit_device``. Under capture the copy becomes a memcpy node
that keeps ``&m``; the frame is gone when the call returns. Native calls from Python enter at the same stack depth,
so the slot is reused by the next native call of that shape -- here the eager ``points`` update of a kinematic
collider mesh between frames. Each ``capture_launch`` then copies the collider's descriptor into the cloth mesh's
device descriptor, and the captured refit and ``vertex_triangle_collision_detection_kernel`` (``mesh_query_aabb``
through ``mesh_id``) run on the collider's points and bounds: wrong contacts (on the GPU, often garbage: a fault).
The host-side parts (``mesh_set_descriptor``, ``self._points = points_new``) ran once, at capture. Modelled with a
device "heap" (device pointers are row offsets into it) and the C++ stack as one host frame slot.
Doctor: dangling-reference, at mesh_set_points_device (the captured H2D copy reads the released stack frame of
``m``, which the collider's later call reuses).
Fix (upstream): ``TriMeshCollisionDetector`` drops the ``wp.Mesh``: persistent ``lower_bounds_tris`` /
``upper_bounds_tris`` filled by the ``compute_tri_aabbs`` kernel, a ``wp.Bvh`` over them refitted in
``refit_triangles()``, and the kernels query ``bvh_query_aabb(bvh_id, ...)``: no descriptor copy in the graph (the
diff also fixes the swapped ``upper, lower = compute_tri_aabb(...)`` in ``compute_tri_aabbs``).
"""
from __future__ import annotations

import torch

from workbench.engine import host
from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/NVIDIA/warp/commit/9ff0fcc3a769278b312903542dcc2cad55afd67c"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "mesh_set_points_device"
SYMPTOM = "captured VBD self-contact queries the collider mesh whose descriptor reused the stack slot of m"

NX = 3                               # a 3x3-vertex sheet: 8 triangles
NUM_POINTS, NUM_TRIS = NX * NX, 2 * (NX - 1) ** 2
QUERY_RADIUS, CONTACT_K, DT, FRAMES = 0.35, 0.2, 0.05, 4
DESC = 5                             # wp::Mesh fields: points, num_points, lowers, uppers, num_tris


class DeviceHeap:
    """Device memory for vec3 arrays; a ``wp.array`` pointer is its row offset here."""

    def __init__(self, device, rows=64):
        self.mem, self.top = torch.zeros(rows, 3, device=device), 0

    def alloc(self, n):
        ptr, self.top = self.top, self.top + n
        return ptr, self.mem[ptr:ptr + n]


class NativeStack:
    """The C++ stack of the native library: ctypes calls from Python enter at the same depth, so the local
    ``wp::Mesh m`` of ``mesh_set_points_device`` has the same address in every call (host memory)."""

    def __init__(self, device):
        self.device = device
        self.slot = host(torch.zeros(DESC, dtype=torch.int64), device)


def grid_tri_indices(device):
    tris = []
    for i in range(NX - 1):
        for j in range(NX - 1):
            a, b, c, d = i * NX + j, i * NX + j + 1, (i + 1) * NX + j, (i + 1) * NX + j + 1
            tris += [[a, b, d], [a, d, c]]
    return torch.tensor(tris, dtype=torch.int64).to(device)


def compute_tri_aabb_rows(pos, tri_indices):
    v = pos[tri_indices]                                   # [tris, 3 vertices, 3]
    return v.min(1).values, v.max(1).values                # lower, upper


class Mesh:
    """``wp.Mesh``: a device descriptor (``mesh_device``, addressed by ``id``) and its host copy."""

    def __init__(self, heap, stack, points_ptr, tri_indices, device):
        self.heap, self.stack, self.tri_indices = heap, stack, tri_indices
        lowers_ptr, _ = heap.alloc(NUM_TRIS)
        uppers_ptr, _ = heap.alloc(NUM_TRIS)
        self.descriptor = [points_ptr, NUM_POINTS, lowers_ptr, uppers_ptr, NUM_TRIS]   # host copy (mesh_get_descriptor)
        self.mesh_device = torch.tensor(self.descriptor, dtype=torch.int64).to(device)
        self._points = points_ptr
        self.mesh_refit_device()

    def rows(self, field, n):
        return self.mesh_device[field] + torch.arange(n, device=self.mesh_device.device)

    def mesh_refit_device(self):
        """Refit the mesh's BVH bounds from the points the *device descriptor* points at."""
        pos = self.heap.mem.index_select(0, self.rows(0, NUM_POINTS))
        lower, upper = compute_tri_aabb_rows(pos, self.tri_indices)
        self.heap.mem.index_copy_(0, self.rows(2, NUM_TRIS), lower)
        self.heap.mem.index_copy_(0, self.rows(3, NUM_TRIS), upper)

    def mesh_set_points_device(self, points_ptr):
        m = self.stack.slot                                # wp::Mesh m; (a local on the C++ stack)
        fields = [points_ptr] + self.descriptor[1:]        # mesh_get_descriptor(id, m); m.points = points
        m.copy_(host(torch.tensor(fields, dtype=torch.int64), self.stack.device))     # host work
        self.mesh_device.copy_(m, non_blocking=True)       # memcpy_h2d(mesh_device, &m, sizeof(wp::Mesh))
        self.descriptor[0] = points_ptr                    # mesh_set_descriptor(id, m): host only
        self.mesh_refit_device()
        # the frame of m is popped here: the next native call at this depth reuses it

    @property
    def points(self):
        return self._points

    @points.setter
    def points(self, points_new):
        self._points = points_new
        self.mesh_set_points_device(points_new)


class Bvh:
    """``wp.Bvh`` over persistent bounds arrays (the fix)."""

    def __init__(self, lower, upper):
        self.lower, self.upper = lower, upper

    def refit(self):
        pass                                               # the tree is rebuilt over the same bounds arrays


class TriMeshCollisionDetector:
    def __init__(self, heap, stack, q_ptr, q, tri_indices, variant, device):
        self.heap, self.variant, self.tri_indices = heap, variant, tri_indices
        self.vertex_positions = q
        if variant == "bug":
            self.mesh_tris = Mesh(heap, stack, q_ptr, tri_indices, device)
        else:
            self.lower_bounds_tris = torch.empty(NUM_TRIS, 3, device=device)
            self.upper_bounds_tris = torch.empty(NUM_TRIS, 3, device=device)
            self.compute_tri_aabbs()
            self.bvh_tris = Bvh(self.lower_bounds_tris, self.upper_bounds_tris)

    def compute_tri_aabbs(self):
        lower, upper = compute_tri_aabb_rows(self.vertex_positions, self.tri_indices)   # (fixed: not swapped)
        self.lower_bounds_tris.copy_(lower)
        self.upper_bounds_tris.copy_(upper)

    def refit(self, new_pos_ptr, new_pos):
        self.vertex_positions = new_pos
        if self.variant == "bug":
            self.mesh_tris.points = new_pos_ptr            # this will automatically apply refit
        else:
            self.compute_tri_aabbs()                       # refit_triangles()
            self.bvh_tris.refit()

    def query_bounds(self):
        if self.variant == "bug":                          # wp.mesh_query_aabb(mesh_id, ...)
            mesh = self.mesh_tris
            return (self.heap.mem.index_select(0, mesh.rows(2, NUM_TRIS)),
                    self.heap.mem.index_select(0, mesh.rows(3, NUM_TRIS)))
        return self.bvh_tris.lower, self.bvh_tris.upper    # wp.bvh_query_aabb(bvh_id, ...)

    def vertex_triangle_collision_detection(self):
        """Per vertex: the triangles (not its own) whose AABB overlaps the vertex's query box, and the push
        away from their centroids."""
        pos = self.vertex_positions
        lower, upper = self.query_bounds()
        overlap = ((pos[:, None, :] + QUERY_RADIUS >= lower[None]) &
                   (pos[:, None, :] - QUERY_RADIUS <= upper[None])).all(-1)
        own = (self.tri_indices[None, :, :] == torch.arange(NUM_POINTS, device=pos.device)[:, None, None]).any(-1)
        colliding = (overlap & ~own).to(pos.dtype)
        centroid = (lower + upper) * 0.5
        return (colliding[:, :, None] * (pos[:, None, :] - centroid[None])).sum(1)


class VBDIntegrator:
    def __init__(self, detector, q, qd):
        self.detector, self.q, self.qd = detector, q, qd
        self.gravity = torch.tensor([0.0, -0.98, 0.0]).to(q.device)

    def simulate(self, q_ptr):
        self.detector.refit(q_ptr, self.q)                 # collision_detection_penetration_free
        push = self.detector.vertex_triangle_collision_detection()
        self.qd.add_(CONTACT_K * push / DT + self.gravity * DT)
        self.q.add_(self.qd * DT)
        return self.q


def run(variant: str, device: str = "cpu"):
    gen = generator(441)
    tri_indices = grid_tri_indices(device)
    ij = torch.stack(torch.meshgrid(torch.arange(NX), torch.arange(NX), indexing="ij"), -1).reshape(-1, 2).float()
    cloth0 = torch.cat([ij * 0.5, torch.zeros(NUM_POINTS, 1)], 1) + torch.randn(NUM_POINTS, 3, generator=gen) * 0.1
    collider0 = cloth0 + torch.tensor([0.25, 0.25, 0.6])
    collider_moves = [torch.randn(NUM_POINTS, 3, generator=gen) * 0.3 for _ in range(FRAMES)]

    def serve(use_cuda_graph):
        heap, stack = DeviceHeap(device), NativeStack(device)
        q_ptr, q = heap.alloc(NUM_POINTS)
        q.copy_(cloth0.to(device))
        col_ptr, col = heap.alloc(NUM_POINTS)
        col.copy_(collider0.to(device))
        qd = torch.zeros(NUM_POINTS, 3, device=device)
        collider_mesh = Mesh(heap, stack, col_ptr, tri_indices, device)          # a kinematic collider
        integrator = VBDIntegrator(TriMeshCollisionDetector(heap, stack, q_ptr, q, tri_indices, variant, device),
                                   q, qd)
        if use_cuda_graph:
            g, out = capture(lambda: integrator.simulate(q_ptr), device=device, warmups=0, name="wp.ScopedCapture",
                             state={"particle_q": q, "particle_qd": qd},
                             owner="warp.ScopedCapture (VBD cloth self-contact)")
        outs = []
        for move in collider_moves:
            col.add_(move.to(device))                      # animate the collider, eagerly between frames
            collider_mesh.points = col_ptr                 # its mesh_set_points_device reuses the stack slot
            outs.append((replay(g, out) if use_cuda_graph else integrator.simulate(q_ptr)).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
