"""Warp's CPU graph capture runs ``wp.Bvh.refit()`` once, as host code, and never records it: every replay of a broad phase queries the tree refitted to the capture-time shape bounds.

Upstream: https://github.com/NVIDIA/warp/commit/0956d106b75ebab1c6e238e194d4f72a150daed4 ("Replay BVH updates in CPU
graph capture [GH-1665]", NVIDIA/warp, Nicolas Capens, 2026-07-22, on main through GitLab MR !2669), fixing issue
#1665 ("[BUG] CPU graph replay uses a stale BVH after refit", 2026-07-17, closed). Read: the issue (its reproducer: a
bound at the origin moved to (10, 10, 10) by a captured ``wp.copy``, ``bvh.refit()``, an AABB query of the origin;
eager reports no hit, replay still hits), the commit message and diff: ``warp/native/bvh.cpp`` (``wp_bvh_refit_host``
gains ``apic_capture_bvh_refit_host``: record the refit, skip the eager one; ``bvh_refit_recursive`` at the parent),
``warp/_src/types.py`` (``Bvh.refit`` docstring; ``Bvh.__init__`` and ``refit`` at the parent), the CHANGELOG entry;
the ``apic.cpp`` replay and the new ``test_apic.py`` cases only by their description in the message.
Symptom: with CPU graph capture (APIC, used by Newton since newton#3387), a captured step that moves shapes and calls
``bvh.refit()`` replays with the tree of the capture-time bounds: queries report overlaps where nothing is any more and
miss the shapes that moved in. Capture succeeds and reports nothing.
Mechanism: on the CPU, ``ScopedCapture`` records launches and memcpys into an operation stream that
``capture_launch`` replays. ``Bvh.refit`` calls ``wp_bvh_refit_host``, native host code and no launch: it refits the
node bounds right away, while capturing, and records nothing. Each replay re-runs the bounds and contact kernels,
whose BVH queries read nodes refitted once, to the bounds the capture saw.
Doctor: host-work-frozen, at ``wp_bvh_refit_host``: the refit is host work inside the captured region, so it ran once
at capture and replays keep its result while eager steps refit to the current bounds.
Fix (upstream): ``wp_bvh_refit_host`` first calls ``apic_capture_bvh_refit_host(id)``: while a capture records
(``wp_apic_get_recording_state()``) it records an ``APIC_OP_BVH_REFIT`` op and returns, and CPU replay re-invokes the
refit against the current ``lowers``/``uppers`` (the same for ``rebuild``).
Modelled: ``Bvh`` (``__init__``, ``refit``) and the native ``BVH`` with host node arrays (``node_lowers``,
``node_uppers``, leaf flags and child/primitive indices), a median-split build standing in for SAH,
``bvh_refit_recursive`` / ``bvh_refit_host`` (host code, here numpy on the arrays' memory), ``wp_bvh_refit_host``
with the fix's ``apic_capture_bvh_refit_host`` branch under ``"fix"``.
Stand-ins: Warp CPU arrays are host memory (``host()``) that CPU kernels read in place; the engine's kernels run on
device tensors, so ``launch`` copies a kernel's host arrays in and its outputs back (recorded copies, re-read by
address at each replay, as APIC replays memcpys), and an eager launch returns when done (Warp CPU launches are
synchronous). ``bvh_query_aabb`` tests every node on each leaf's root path at once (what the stack traversal visits);
the recorded refit (APIC's replay of the op) is the same bottom-up refit as recorded kernels, level by level, written
back into the tree's host arrays. Newton side: shapes as spheres with AABB half-extent = radius, a broad phase over
the BVH (each shape queries its own AABB), a sphere narrow phase with penalty contacts, gravity and a ground plane,
semi-implicit integration; ``simulate()`` computes bounds, refits, collides and integrates, as one captured frame.
Workload: 16 shapes (radius 0.3) thrown in a 2-unit box, 12 frames of 4 substeps; the frame is captured once (no
warmup: a capture must not advance the state) and replayed per frame, against the same frames run eagerly. The
capture-time refit fits the initial bounds, so the first replay equals eager; the bug variant then queries those
bounds on every frame, its broad phase misses contacts from the second frame on (max error 0.0047 at frame 2, 1.26 by
frame 12); the fix records the refit and equals eager exactly (max error 0). Same numbers with real CUDA graphs on an
H200 (``device="cuda"``, torch 2.11).
"""
from __future__ import annotations

import numpy as np
import torch

from workbench.engine import host, is_capturing, is_host, synchronize
from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/NVIDIA/warp/commit/0956d106b75ebab1c6e238e194d4f72a150daed4"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "wp_bvh_refit_host"
SYMPTOM = ("Bvh.refit() inside a CPU graph capture runs once as host code and is not recorded; replays query the "
           "capture-time node bounds, so the broad phase misses shapes that moved")

NUM_SHAPES = 16
SHAPE_RADIUS = 0.3
FRAMES = 12
FRAME_DT = 0.05
SIM_SUBSTEPS = 4
K_CONTACT, K_DAMP = 800.0, 4.0
GRAVITY = (0.0, 0.0, -9.81)
DTYPE = torch.float64

_variant = "bug"
_device = "cpu"


# --- warp/native/bvh.h, bvh.cpp (the CPU tree: a host struct with host node arrays) ---------------------------------

class BVH:
    """The native tree: node bounds, leaf flags, children / primitives, and the item bound arrays it refits from."""

    def __init__(self, item_lowers: torch.Tensor, item_uppers: torch.Tensor, num_nodes: int):
        self.item_lowers, self.item_uppers = item_lowers, item_uppers           # the user's arrays, by pointer
        self.node_lowers = host(torch.zeros(num_nodes, 3, dtype=DTYPE), _device)
        self.node_uppers = host(torch.zeros(num_nodes, 3, dtype=DTYPE), _device)
        self.is_leaf = np.zeros(num_nodes, dtype=bool)
        self.left = np.full(num_nodes, -1)            # child / primitive index (lower.i, upper.i in upstream)
        self.right = np.full(num_nodes, -1)
        self.depth = np.zeros(num_nodes, dtype=np.int64)
        self.root = 0


_bvhs: dict[int, BVH] = {}


def bvh_build_median(bvh: BVH, items: np.ndarray, centers: np.ndarray, node: int, depth: int, next_free: list) -> None:
    """Top-down build (stand-in for SAH): split the items at the median centroid of the widest axis."""
    bvh.depth[node] = depth
    if len(items) == 1:
        bvh.is_leaf[node], bvh.left[node] = True, items[0]
        return
    c = centers[items]
    axis = int(np.argmax(c.max(0) - c.min(0)))
    items = items[np.argsort(c[:, axis], kind="stable")]
    half = len(items) // 2
    bvh.left[node], bvh.right[node] = next_free[0], next_free[0] + 1
    next_free[0] += 2
    bvh_build_median(bvh, items[:half], centers, bvh.left[node], depth + 1, next_free)
    bvh_build_median(bvh, items[half:], centers, bvh.right[node], depth + 1, next_free)


def wp_bvh_create_host(lowers: torch.Tensor, uppers: torch.Tensor, num_items: int) -> int:
    bvh = BVH(lowers, uppers, 2 * num_items - 1)
    centers = 0.5 * (lowers.numpy() + uppers.numpy())
    bvh_build_median(bvh, np.arange(num_items), centers, 0, 0, [1])
    bvh_refit_host(bvh)
    _bvhs[id(bvh)] = bvh
    return id(bvh)


def bvh_refit_recursive(bvh: BVH, index: int) -> None:
    lowers, uppers = bvh.node_lowers.numpy(), bvh.node_uppers.numpy()
    if bvh.is_leaf[index]:                                   # update leaf from items
        item = bvh.left[index]
        lowers[index] = bvh.item_lowers.numpy()[item]
        uppers[index] = bvh.item_uppers.numpy()[item]
    else:
        left_index, right_index = bvh.left[index], bvh.right[index]
        bvh_refit_recursive(bvh, left_index)
        bvh_refit_recursive(bvh, right_index)
        lowers[index] = np.minimum(lowers[left_index], lowers[right_index])      # union of child bounds
        uppers[index] = np.maximum(uppers[left_index], uppers[right_index])


def bvh_refit_host(bvh: BVH) -> None:
    bvh_refit_recursive(bvh, bvh.root)


# --- warp/native/apic.cpp (the CPU capture's operation stream) -------------------------------------------------------

class APICState:
    def __init__(self):
        self.ops: list[tuple] = []


_apic_state = APICState()


def wp_apic_get_recording_state() -> APICState | None:
    return _apic_state if is_capturing() else None


def apic_replay_bvh_refit(bvh: BVH) -> None:
    """(The fix) The recorded op, as replay runs it: refit against the current item bounds, leaves first."""
    lo, hi = _stage(bvh.item_lowers), _stage(bvh.item_uppers)
    node_lo, node_hi = _stage(bvh.node_lowers), _stage(bvh.node_uppers)
    leaves, items = bvh.refit_leaves
    node_lo[leaves], node_hi[leaves] = lo[items], hi[items]
    for nodes, left, right in bvh.refit_levels:                               # deepest internal level first
        node_lo[nodes] = torch.minimum(node_lo[left], node_lo[right])
        node_hi[nodes] = torch.maximum(node_hi[left], node_hi[right])
    bvh.node_lowers.copy_(node_lo, non_blocking=True)
    bvh.node_uppers.copy_(node_hi, non_blocking=True)


def apic_record_bvh_refit(state: APICState, id: int) -> None:
    state.ops.append(("bvh_refit", id))
    apic_replay_bvh_refit(_bvhs[id])


def apic_capture_bvh_refit_host(id: int) -> bool:
    """(The fix) Record a host BVH refit into the active capture; True means: do not run it eagerly."""
    state = wp_apic_get_recording_state()
    if not state:
        return False
    apic_record_bvh_refit(state, id)
    return True


def wp_bvh_refit_host(id: int) -> None:
    if _variant == "fix":
        if apic_capture_bvh_refit_host(id):
            return
    bvh = _bvhs[id]
    bvh_refit_host(bvh)                         # runs now; a capture records nothing of it


# --- warp/_src/types.py ----------------------------------------------------------------------------------------------

class Bvh:
    def __init__(self, lowers: torch.Tensor, uppers: torch.Tensor):
        if len(lowers) != len(uppers):
            raise RuntimeError("The same number of lower and upper bounds must be provided")
        self.lowers, self.uppers = lowers, uppers
        self.id = wp_bvh_create_host(lowers, uppers, len(lowers))
        _precompute_kernel_tables(_bvhs[self.id])

    def refit(self) -> None:
        """Refit the BVH. This should be called after users modify the ``lowers`` or ``uppers`` arrays."""
        wp_bvh_refit_host(self.id)


def _index_table(a: np.ndarray) -> torch.Tensor:
    return torch.as_tensor(np.asarray(a), dtype=torch.int64).to(_device)


def _precompute_kernel_tables(bvh: BVH) -> None:
    """Device index tables for the stand-in kernels (what the native traversal walks through pointers)."""
    n_nodes = len(bvh.is_leaf)
    leaves = np.flatnonzero(bvh.is_leaf)
    bvh.refit_leaves = (_index_table(leaves), _index_table(bvh.left[leaves]))
    internal = np.flatnonzero(~bvh.is_leaf)
    bvh.refit_levels = []
    for depth in sorted(set(bvh.depth[internal]), reverse=True):
        nodes = internal[bvh.depth[internal] == depth]
        bvh.refit_levels.append((_index_table(nodes), _index_table(bvh.left[nodes]), _index_table(bvh.right[nodes])))
    parent = np.full(n_nodes, -1)
    parent[bvh.left[internal]], parent[bvh.right[internal]] = internal, internal
    path = np.zeros((len(leaves), n_nodes))                   # path[i, node]: node lies on item i's root path
    for leaf in leaves:
        node = leaf
        while node != -1:
            path[bvh.left[leaf], node] = 1.0
            node = parent[node]
    bvh.item_paths = torch.as_tensor(path, dtype=DTYPE).to(_device)


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


def bvh_query_aabb(bvh_id: int, lower: torch.Tensor, upper: torch.Tensor) -> torch.Tensor:
    """``wp.bvh_query_aabb`` for a batch of boxes: item i is hit when every node on its root path overlaps."""
    bvh = _bvhs[bvh_id]
    node_lo, node_hi = _stage(bvh.node_lowers), _stage(bvh.node_uppers)
    overlap = ((lower[:, None, :] <= node_hi[None]) & (upper[:, None, :] >= node_lo[None])).all(-1)   # [Q, nodes]
    return (overlap.to(DTYPE) @ bvh.item_paths.T) == bvh.item_paths.sum(1)[None]                       # [Q, items]


# --- newton (stand-ins: shape bounds, broad + narrow phase, semi-implicit integration) -------------------------------

def compute_shape_aabbs(dim, body_q, radius, lowers, uppers):
    lowers.copy_(body_q - radius)
    uppers.copy_(body_q + radius)


def broad_phase_contacts(dim, bvh_id, body_q, body_qd, lowers, uppers, body_f):
    q, qd = body_q, body_qd
    candidate = bvh_query_aabb(bvh_id, lowers, uppers)                                # [N, N]
    d = q[:, None, :] - q[None]
    dist = d.norm(dim=-1)
    eye = torch.eye(q.shape[0], dtype=torch.bool, device=q.device)
    touching = candidate & ~eye & (dist < 2.0 * SHAPE_RADIUS)
    n = d / dist.clamp(min=1e-9)[..., None]
    vrel = ((qd[:, None, :] - qd[None]) * n).sum(-1)
    mag = torch.where(touching, K_CONTACT * (2.0 * SHAPE_RADIUS - dist) - K_DAMP * vrel, torch.zeros_like(dist))
    f = (mag[..., None] * n).sum(1)
    ground = (SHAPE_RADIUS - q[:, 2]).clamp(min=0.0)
    f[:, 2] += K_CONTACT * ground - K_DAMP * qd[:, 2] * (ground > 0)
    body_f.copy_(f)


def integrate_bodies(dim, body_q, body_qd, body_f, gravity, dt, q_out, qd_out):
    v = body_qd + (body_f + gravity) * dt
    qd_out.copy_(v)
    q_out.copy_(body_q + v * dt)


class Example:
    def __init__(self, device: str, positions: torch.Tensor, velocities: torch.Tensor):
        self.device = device
        self.body_q = host(positions.clone(), device)
        self.body_qd = host(velocities.clone(), device)
        self.body_f = host(torch.zeros_like(positions), device)
        self.shape_lowers = host(positions - SHAPE_RADIUS, device)
        self.shape_uppers = host(positions + SHAPE_RADIUS, device)
        self.gravity = torch.tensor(GRAVITY, dtype=DTYPE, device=device)
        self.bvh = Bvh(self.shape_lowers, self.shape_uppers)
        self.sim_dt = FRAME_DT / SIM_SUBSTEPS
        self.graph = None

    def simulate(self) -> torch.Tensor:
        launch(compute_shape_aabbs, NUM_SHAPES, inputs=[self.body_q, SHAPE_RADIUS],
               outputs=[self.shape_lowers, self.shape_uppers])
        self.bvh.refit()                                                               # once per frame
        for _ in range(SIM_SUBSTEPS):
            launch(broad_phase_contacts, NUM_SHAPES,
                   inputs=[self.bvh.id, self.body_q, self.body_qd, self.shape_lowers, self.shape_uppers],
                   outputs=[self.body_f])
            q_out, _ = launch(integrate_bodies, NUM_SHAPES,
                              inputs=[self.body_q, self.body_qd, self.body_f, self.gravity, self.sim_dt],
                              outputs=[self.body_q, self.body_qd])
        return q_out

    def capture(self):
        self.graph, self.graph_out = capture(self.simulate, device=self.device, warmups=0, name="simulate",
                                             owner="Example", state={"body_q": self.body_q, "body_qd": self.body_qd})

    def step(self) -> torch.Tensor:
        if self.graph is not None:
            return replay(self.graph, self.graph_out).clone()
        return self.simulate().clone()


# --- the workload -----------------------------------------------------------------------------------------------------

def run(variant: str, device: str = "cpu"):
    global _variant, _device
    _variant, _device = variant, device
    gen = generator(1665)
    positions = (torch.rand(NUM_SHAPES, 3, generator=gen, dtype=DTYPE) * 2.0
                 + torch.tensor([0.0, 0.0, 0.4], dtype=DTYPE))
    velocities = (torch.rand(NUM_SHAPES, 3, generator=gen, dtype=DTYPE) - 0.5) * 4.0

    def serve(use_cuda_graph: bool):
        _bvhs.clear()
        example = Example(device, positions, velocities)
        if use_cuda_graph:
            example.capture()
        return [example.step() for _ in range(FRAMES)]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
