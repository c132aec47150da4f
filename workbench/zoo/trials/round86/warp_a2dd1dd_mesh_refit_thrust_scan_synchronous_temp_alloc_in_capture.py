"""wp.Mesh.refit() cannot be captured: its edge-length scan is a thrust call that allocates and synchronises.

Upstream: https://github.com/NVIDIA/warp/commit/a2dd1dd3692d493e20c716aa99ecbdf98de0fd14 ("mesh_refit_device uses
scan_device", NVIDIA/warp, Eric Shi, 2023-07-17: "Previously thurst::inclusive scan was used which didn't work with
graph capture"), with its test commit 40b51440d ("Add a basic test for mesh refit in graph": ``mesh.refit()`` between
``wp.capture_begin()`` / ``wp.capture_end()``, then 10 ``wp.capture_launch``) and the CHANGELOG line of 1.0.0-beta.1
("Fix for ``wp.Mesh.refit()`` not being CUDA graph capturable due to synchronous temp. allocs"). Read: both diffs,
warp/native/mesh.cu, scan.cu and temp_buffer.h at the fix, ``mesh_create_device`` in mesh.cpp before it. No issue or
PR thread (direct commits).
Symptom: capturing a step that calls ``wp.Mesh.refit()`` on a CUDA device fails (``wp.capture_end`` gets no graph /
the capture is invalidated), so a deforming-mesh simulation cannot be graphed; eagerly refit works.
Mechanism: ``mesh_refit_device`` (warp/native/mesh.cu) recomputes the mesh's ``average_edge_length`` before refitting
the BVH: ``compute_mesh_edge_lengths`` writes per-triangle edge-length sums into the bounds memory, then
``thrust::inclusive_scan(thrust::device_ptr<float>...)`` sums them, ``compute_average_mesh_edge_length`` stores the
last partial sum / (3 n) into the device Mesh descriptor, then ``compute_triangle_bounds`` and ``bvh_refit_device``.
The thrust call uses thrust's default ``thrust::device`` policy: it cudaMallocs its temporary storage, runs on the
legacy stream and synchronises before it returns (cudaFree of the temporary included). Those are host-synchronous
calls, refused while Warp's stream is capturing, so the capture of the refit fails; eagerly they only block.
Doctor: sync-in-capture, at mesh_refit_device. The scan in the captured region makes the host wait (a synchronous
temporary allocation and a stream synchronisation): a host synchronisation attempted during capture; the fix is the
one line of this function that calls the scan.
Fix (upstream): ``scan_device(length_tmp_ptr, length_tmp_ptr, m.num_tris, true)`` (warp/native/scan.cu): CUB
``DeviceScan::InclusiveSum`` on Warp's current stream, with its temporary storage from the per-context
``g_temp_buffer_map`` ``TemporaryBuffer``, grown by ``ensure_fits`` with stream-ordered ``alloc_device_async``; nothing
waits on the host, so the scan is recorded into the graph like the kernels around it.
Modelled: ``mesh_create_device`` (bounds and average edge length computed on the host, BVH built once), the device Mesh
descriptor's ``average_edge_length``, ``mesh_refit_device`` with its four kernels, ``bvh_refit_device`` (leaf bounds
unioned bottom-up), ``thrust::inclusive_scan`` (bug) and ``scan_device`` + ``TemporaryBuffer`` (fix), and a user step
as in a cloth/deformable example: a kernel that moves the vertices (a travelling wave driven by a device time
counter), ``mesh.refit()``, and a BVH box query (``mesh_query_aabb``-style: a triangle is reported when its leaf and
every ancestor overlap the box). The BVH is a stand-in: a complete binary tree over the triangles in index order
(Warp builds a median-split tree on the host). cudaMalloc / cudaFree / the stream synchronisation of thrust are the
engine's ``synchronize`` (a host wait that a capture refuses) around a plain allocation. float64 throughout.
Workload: a 5x2-vertex sheet (4 quads, 8 triangles: a power of two, for the complete tree), 3 query boxes; the step
is captured with ``wp.capture_begin/end`` (no warm-up) and replayed 5 times; after each step the average edge length,
the BVH root bounds and the per-box hit counts are the outputs. Bug: the capture raises at the thrust scan's
synchronous temporary allocation (as the CUDA capture is invalidated). Fix: the scan is recorded and every replay
equals the eager step.
"""
from __future__ import annotations

import torch

from workbench.engine import synchronize
from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/NVIDIA/warp/commit/a2dd1dd3692d493e20c716aa99ecbdf98de0fd14"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "mesh_refit_device"
SYMPTOM = ("wp.Mesh.refit() inside wp.capture_begin/capture_end fails: mesh_refit_device's thrust::inclusive_scan "
           "cudaMallocs its temporary storage and synchronises, which a capturing stream refuses")

NUM_TRIS = 8                       # a power of two: the stand-in BVH is a complete binary tree
NUM_NODES = 2 * NUM_TRIS - 1
STEPS = 5
DT = 0.1
WAVE_AMPLITUDE, WAVE_NUMBER = 0.3, 2.0

_variant = "bug"


# --- CUDA runtime / thrust stand-ins ---------------------------------------------------------------------------

def cuda_malloc(nbytes_elems, device):
    """cudaMalloc: may synchronise the device; not permitted while a stream is capturing."""
    synchronize(device)
    return torch.empty(nbytes_elems, dtype=torch.float64, device=device)


def cuda_free(ptr, device):
    synchronize(device)


def thrust_inclusive_scan(first, n, result):
    """thrust::inclusive_scan(device_ptr(first), device_ptr(first) + n, device_ptr(result)) with the default
    (synchronous) thrust::device policy."""
    device = first.device
    temp = cuda_malloc(n, device)                      # temporary storage
    torch.cumsum(first[:n], 0, out=temp[:n])
    result[:n].copy_(temp[:n])
    synchronize(device)                                # thrust synchronises before returning
    cuda_free(temp, device)


class TemporaryBuffer:
    """temp_buffer.h: temporary buffer for cub algorithms, one per CUDA context (g_temp_buffer_map)."""

    def __init__(self):
        self.buffer = None
        self.buffer_size = 0

    def ensure_fits(self, size, device):
        if size > self.buffer_size:
            size = max(2 * size, (self.buffer_size * 3) // 2)
            self.buffer = torch.empty(size, dtype=torch.float64, device=device)   # alloc_device_async
            self.buffer_size = size


g_temp_buffer_map: dict = {}


def scan_device(values_in, values_out, n, inclusive):
    """scan.cu: cub::DeviceScan::InclusiveSum on Warp's current stream, temp storage from g_temp_buffer_map."""
    device = values_in.device
    cub_temp = g_temp_buffer_map.setdefault(str(device), TemporaryBuffer())
    scan_temp_size = n                                 # (cub's size query)
    cub_temp.ensure_fits(scan_temp_size, device)
    partial = cub_temp.buffer[:n]
    torch.cumsum(values_in[:n], 0, out=partial)
    if not inclusive:
        partial = torch.cat([partial.new_zeros(1), partial[:-1]])
    values_out[:n].copy_(partial)


# --- warp/native/mesh.cu, bvh.cu ----------------------------------------------------------------------------------

class BVH:
    """Node bounds of a complete binary tree: node i has children 2i+1, 2i+2; leaves NUM_TRIS-1.. hold triangles."""

    def __init__(self, device):
        self.node_lowers = torch.zeros(NUM_NODES, 3, dtype=torch.float64, device=device)
        self.node_uppers = torch.zeros(NUM_NODES, 3, dtype=torch.float64, device=device)
        anc = torch.zeros(NUM_TRIS, NUM_NODES, dtype=torch.float64)      # node is on the root->leaf path
        for t in range(NUM_TRIS):
            node = NUM_TRIS - 1 + t
            while True:
                anc[t, node] = 1.0
                if node == 0:
                    break
                node = (node - 1) // 2
        self.path = anc.to(device)


def bvh_refit_device(bvh, bounds):
    """bvh_refit_kernel: leaf bounds from the triangle bounds, then each parent the union of its children."""
    first_leaf = NUM_TRIS - 1
    bvh.node_lowers[first_leaf:].copy_(bounds[:, 0:3])
    bvh.node_uppers[first_leaf:].copy_(bounds[:, 3:6])
    level_start = first_leaf
    while level_start > 0:
        parent_start = (level_start - 1) // 2
        left = torch.arange(parent_start, level_start, device=bounds.device) * 2 + 1
        bvh.node_lowers[parent_start:level_start].copy_(torch.minimum(bvh.node_lowers[left], bvh.node_lowers[left + 1]))
        bvh.node_uppers[parent_start:level_start].copy_(torch.maximum(bvh.node_uppers[left], bvh.node_uppers[left + 1]))
        level_start = parent_start


class Mesh:
    """The device Mesh (its descriptor field average_edge_length lives in device memory, written by a kernel)."""

    def __init__(self, points, indices):
        self.points, self.indices = points, indices
        self.num_tris = indices.numel() // 3
        self.bounds = torch.zeros(self.num_tris, 6, dtype=torch.float64, device=points.device)
        self.average_edge_length = torch.zeros(1, dtype=torch.float64, device=points.device)
        self.bvh = BVH(points.device)


def compute_triangle_bounds(m):
    tri = m.points[m.indices.view(-1, 3)]                                  # [T, 3, 3]
    m.bounds.copy_(torch.cat([tri.amin(1), tri.amax(1)], dim=1))


def compute_mesh_edge_lengths(m, edge_lengths):
    tri = m.points[m.indices.view(-1, 3)]
    p, q, r = tri[:, 0], tri[:, 1], tri[:, 2]
    edge_lengths.copy_((p - q).norm(dim=-1) + (p - r).norm(dim=-1) + (q - r).norm(dim=-1))


def compute_average_mesh_edge_length(n, sum_edge_lengths, m):
    m.average_edge_length.copy_(sum_edge_lengths[n - 1:n] / (3 * n))


def mesh_create_device(points, indices):
    m = Mesh(points, indices)
    # BVH creation on the host: bounds and the average edge length computed there, then uploaded
    compute_triangle_bounds(m)
    lengths = torch.zeros(m.num_tris, dtype=torch.float64, device=points.device)
    compute_mesh_edge_lengths(m, lengths)
    m.average_edge_length.copy_(lengths.sum().reshape(1) / (3 * m.num_tris))
    bvh_refit_device(m.bvh, m.bounds)
    return m


def mesh_refit_device(m):
    # re-use bounds memory temporarily for computing edge lengths
    length_tmp_ptr = m.bounds.view(-1)[:m.num_tris]
    compute_mesh_edge_lengths(m, length_tmp_ptr)
    if _variant == "fix":
        scan_device(length_tmp_ptr, length_tmp_ptr, m.num_tris, True)
    else:
        thrust_inclusive_scan(length_tmp_ptr, m.num_tris, length_tmp_ptr)
    compute_average_mesh_edge_length(m.num_tris, length_tmp_ptr, m)
    compute_triangle_bounds(m)
    bvh_refit_device(m.bvh, m.bounds)


# --- the user's step --------------------------------------------------------------------------------------------

def deform(rest, points, sim_time):
    """A kernel moving the sheet: a travelling wave in z; the time counter advances on the device."""
    z = WAVE_AMPLITUDE * torch.sin(WAVE_NUMBER * rest[:, 0] + sim_time)
    points.copy_(rest + torch.stack([torch.zeros_like(z), torch.zeros_like(z), z], dim=1))
    sim_time.add_(DT)


def mesh_query_aabb(m, box_lowers, box_uppers, counts):
    """Per box, the triangles reached by a BVH traversal (the leaf and every ancestor overlap the box)."""
    lo, hi = m.bvh.node_lowers, m.bvh.node_uppers
    overlap = ((lo.unsqueeze(0) <= box_uppers.unsqueeze(1)) & (hi.unsqueeze(0) >= box_lowers.unsqueeze(1))).all(-1)
    on_path = overlap.to(torch.float64) @ m.bvh.path.t()                   # [boxes, tris]
    reached = (on_path == m.bvh.path.sum(1)).to(torch.float64)
    counts.copy_(reached.sum(1))


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    g_temp_buffer_map.clear()
    gen = generator(20230717)
    # a 5x2 grid of quads cut into triangles; keep the first NUM_TRIS triangles
    xs, ys = torch.meshgrid(torch.arange(5, dtype=torch.float64), torch.arange(2, dtype=torch.float64), indexing="ij")
    rest0 = torch.stack([xs.reshape(-1), ys.reshape(-1), torch.zeros(10, dtype=torch.float64)], dim=1)
    rest0 = rest0 + 0.05 * torch.randn(rest0.shape, generator=gen, dtype=torch.float64)
    tris = []
    for i in range(4):
        a, b, c, d = 2 * i, 2 * i + 1, 2 * i + 2, 2 * i + 3
        tris += [a, c, b, b, c, d]
    indices0 = torch.tensor(tris[:NUM_TRIS * 3], dtype=torch.int64)
    box_lo0 = torch.tensor([[0.5, -0.5, -1.0], [2.0, 0.2, 0.0], [3.5, -0.5, -0.1]], dtype=torch.float64)
    box_hi0 = box_lo0 + torch.tensor([[1.0, 2.0, 2.0], [1.0, 0.6, 1.0], [0.6, 2.0, 0.15]], dtype=torch.float64)

    def simulate(use_graph):
        rest, indices = rest0.to(device), indices0.to(device)
        points = rest.clone()
        sim_time = torch.zeros(1, dtype=torch.float64, device=device)
        box_lo, box_hi = box_lo0.to(device), box_hi0.to(device)
        counts = torch.zeros(box_lo.shape[0], dtype=torch.float64, device=device)
        mesh = mesh_create_device(points, indices)

        def step():
            deform(rest, points, sim_time)
            mesh_refit_device(mesh)                    # mesh.refit()
            mesh_query_aabb(mesh, box_lo, box_hi, counts)
            return mesh.average_edge_length, mesh.bvh.node_lowers[0], mesh.bvh.node_uppers[0], counts

        outs = []
        if not use_graph:
            for _ in range(STEPS):
                outs += [t.clone() for t in step()]
            return outs
        g, out = capture(step, device=device, warmups=0, name="wp.capture_begin", owner="wp.capture_begin",
                         state={"points": points, "sim_time": sim_time, "bounds": mesh.bounds,
                                "average_edge_length": mesh.average_edge_length,
                                "node_lowers": mesh.bvh.node_lowers, "node_uppers": mesh.bvh.node_uppers})
        for _ in range(STEPS):
            outs += [t.clone() for t in replay(g, out)]          # wp.capture_launch(graph)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: simulate(True), lambda: simulate(False))
