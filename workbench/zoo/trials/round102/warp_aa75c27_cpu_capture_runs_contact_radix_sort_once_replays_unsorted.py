"""Warp's CPU graph capture runs ``wp.utils.radix_sort_pairs`` once, as host code, and records nothing: every replay of Newton's deterministic contact sort hands out the contacts in narrow-phase slot order.

Upstream: https://github.com/NVIDIA/warp/commit/aa75c277a7230663818cdc8871a919588bc5dc50 ("Record and replay CPU API
Capture ops (GH-1431)", NVIDIA/warp, by Nicolas Capens, 2026-06-25; landed on main through GitLab MR !2425, the
GitHub mirror's commit), under the tracking issue #1431 ("Graph Capture and APIC: Full Newton Coverage", open).
Read: the commit message ("APIC graphs on CPU recorded kernel launches but not the host helpers backing many Warp
builtins, so a captured CPU graph replayed stale results: array_scan, radix and segmented sorts, runlength_encode, BSR
topology builds, and contiguous fills each ran once at capture time and were invisible to the byte stream ... which
degraded or broke solvers (e.g. mujoco_warp, Newton)"), its CHANGELOG entries, and the diff of
``warp/_src/utils.py`` (``radix_sort_pairs``: tracks ``keys``/``values`` under a CPU capture, then
``wp_radix_sort_pairs_int64_host``; ``array_scan``'s old ``NotImplementedError`` guard replaced by recording) and of
``warp/native/sort.cpp`` (new ``apic_capture_radix_sort``, called first by every ``wp_radix_sort_pairs_*_host``;
``radix_sort_pairs_host``); the issue's description (excerpt). Newton at f8e5723 (2026-06-24, the day before):
``newton/_src/geometry/contact_sort.py`` (``ContactSorter``, ``_prepare_sort``, ``_backup_simple_kernel``,
``_gather_simple_kernel``, ``_sort_and_permute``, ``sort_simple``, ``SORT_KEY_SENTINEL``), ``contact_data.py``
(``make_contact_sort_key``), ``broad_phase_sap.py`` (the sweep direction), ``narrow_phase.py`` (its ``deterministic``
option, by grep). Seen, not modelled: the commit's recording of segmented sorts, scans, run-length encoding, BSR builds
and fills; Newton's SAP broad phase sorts with ``segmented_sort_pairs`` but then calls ``array_scan``, which raised
``NotImplementedError`` under a CPU capture before this commit, so the contact sort is the workload here.
Symptom: with CPU graph capture (APIC, ``wp.ScopedCapture(device="cpu")``), a captured collision step in Newton's
deterministic mode replays with its contacts unsorted: ``rigid_contact_*`` come out in the order the narrow phase's
atomics gave them, which differs from the eager order and from step to step (no error is reported).
Mechanism: on the CPU there is no driver graph; ``ScopedCapture`` records launches and memcpys into an operation
stream that ``capture_launch`` replays. ``ContactSorter._sort_and_permute`` launches ``_prepare_sort`` (recorded: it
copies the keys and resets ``_sort_indices`` to the identity) and then calls ``radix_sort_pairs``, which on the CPU is
``wp_radix_sort_pairs_int64_host``: native host code that sorts the keys and indices right away, while capturing, and
records nothing. Each replay re-runs ``_prepare_sort`` and the gather, so the gather permutes by the identity.
Doctor: host-work-frozen, at ``wp_radix_sort_pairs_int64_host``: the sort is host work inside the captured region, so
it ran once at capture and replays keep the permutation that ``_prepare_sort`` leaves, while eager steps sort.
Fix (upstream): ``wp_radix_sort_pairs_int64_host`` first asks ``apic_capture_radix_sort``; while a CPU capture is
recording (``wp_apic_get_recording_state()``) it records an ``APIC_OP_RADIX_SORT`` op on the keys and values regions
(``apic_record_radix_sort``) and returns true, so the eager sort is skipped and every replay sorts in operation order.
Modelled: Warp's ``radix_sort_pairs`` (argument checks and the int64 dispatch), ``wp_radix_sort_pairs_int64_host``
with the fix's ``apic_capture_radix_sort`` branch under ``"fix"``, ``radix_sort_pairs_host`` (host code, here a stable
numpy argsort of the first ``n`` keys on the buffers' memory; the second half is the sort's scratch, as upstream),
``APICState``/``wp_apic_get_recording_state``/``apic_record_radix_sort`` (the recorded op runs, at capture and at each
replay, as recorded tensor ops on the same memory). Newton's ``make_contact_sort_key``, ``SORT_KEY_SENTINEL``,
``_prepare_sort``, ``_backup_simple_kernel``, ``_gather_simple_kernel`` and ``ContactSorter`` (simple layout, without
tangents and match indices) as upstream. Stand-ins: Warp CPU arrays are host memory (``host()``) that CPU kernels read
in place; the engine's kernels run on device tensors, so ``launch`` copies a kernel's host arrays in and its outputs
back (recorded copies that replays re-read by address, as APIC replays memcpys), and an eager launch returns when done.
``narrow_phase_spheres`` stands for ``NarrowPhase.launch`` on spheres and a ground plane: it writes one contact per
touching pair, in slot order; the slot a contact gets from the writer's ``atomic_add`` (the thread schedule) is here
the rank of its position along the SAP sweep direction, so it changes as bodies move.
Workload: 8 kinematic spheres (radius 0.3) drifting over a ground plane, 36 candidate pairs (the contact capacity),
6 frames; each frame the host writes the body positions into ``body_q`` (a static input) and runs ``collide`` (narrow
phase, then the deterministic sort). Frame 0 runs eagerly; before frame 1 the step is warmed up once and captured on
frame 1's positions; frames 1-5 are replayed, against the same frames run eagerly. Outputs per frame: the contact
count, pairs, positions, normals and penetrations. Bug: the counts agree (10, 12, 15, 15, 15, 13 contacts), but every
replay hands the contacts out in slot order (max error 7, a shape id; positions off by up to 1.24); fix: the sort is
recorded once and replayed each frame, equals eager (max error 0).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from workbench.engine import host, is_capturing, is_host, synchronize
from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/NVIDIA/warp/commit/aa75c277a7230663818cdc8871a919588bc5dc50"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "wp_radix_sort_pairs_int64_host"
SYMPTOM = ("radix_sort_pairs() inside a CPU graph capture runs once as host code and is not recorded; replays of "
           "the deterministic contact sort hand out contacts in narrow-phase slot order")

NUM_SPHERES = 8
SPHERE_RADIUS = 0.3
FRAMES = 6
FRAME_DT = 1.0 / 30.0
GROUND_SHAPE = 0                    # shapes: the ground plane first, then one sphere per body
DTYPE = torch.float64

_variant = "bug"
_device = "cpu"


# --- warp/native/apic.cpp (the CPU capture's operation stream) -------------------------------------------------------

class APICState:
    def __init__(self):
        self.ops: list[tuple] = []


_apic_state = APICState()


def wp_apic_get_recording_state() -> APICState | None:
    return _apic_state if is_capturing() else None


def apic_record_radix_sort(state: APICState, keys: torch.Tensor, values: torch.Tensor, n: int, begin_bit: int,
                           end_bit: int, value_size: int, dtype: str) -> None:
    """(The fix) APIC_OP_RADIX_SORT on the keys and values regions; replay sorts them in operation order."""
    state.ops.append(("radix_sort", n, begin_bit, end_bit, value_size, dtype))
    k, v = _stage(keys[:n]), _stage(values[:n])
    order = torch.argsort(k, stable=True)
    keys[:n].copy_(k[order], non_blocking=True)
    values[:n].copy_(v[order], non_blocking=True)


# --- warp/native/sort.cpp ------------------------------------------------------------------------------------------

def apic_capture_radix_sort(keys: torch.Tensor, values: torch.Tensor, n: int, begin_bit: int, end_bit: int,
                            value_size: int, dtype: str, key_size: int) -> bool:
    """(The fix) Record a host radix sort into the active APIC byte stream; True: recorded, do NOT execute now."""
    state = wp_apic_get_recording_state()
    if not state:
        return False
    if n <= 0:
        return True
    apic_record_radix_sort(state, keys, values, n, begin_bit, end_bit, value_size, dtype)
    return True


def radix_sort_pairs_host(keys: torch.Tensor, values: torch.Tensor, n: int, begin_bit: int, end_bit: int) -> None:
    """The CPU sort: native host code on the arrays' memory (stable; [n, 2n) is scratch), run when called."""
    k, v = keys.numpy(), values.numpy()
    order = np.argsort(k[:n], kind="stable")
    k[:n], v[:n] = k[:n][order], v[:n][order]


def wp_radix_sort_pairs_int64_host(keys: torch.Tensor, values: torch.Tensor, n: int, begin_bit: int, end_bit: int,
                                   value_size: int) -> None:
    if _variant == "fix":
        if apic_capture_radix_sort(keys, values, n, begin_bit, end_bit, value_size, "APIC_TYPE_INT64", 8):
            return
    radix_sort_pairs_host(keys, values, n, begin_bit, end_bit)     # runs now; a capture records nothing of it


# --- warp/_src/utils.py ----------------------------------------------------------------------------------------------

def radix_sort_pairs(keys: torch.Tensor, values: torch.Tensor, count: int, begin_bit: int = 0,
                     end_bit: int | None = None) -> None:
    """Sort key-value pairs (stable). ``keys`` and ``values`` must hold 2*``count`` elements."""
    if count == 0:
        return
    if keys.numel() < 2 * count or values.numel() < 2 * count:
        raise RuntimeError("Keys and values array storage must be large enough to contain 2*count elements")
    value_size = values.element_size()
    if value_size not in (4, 8):
        raise RuntimeError(f"Unsupported keys and values data types: {keys.dtype}, {values.dtype}")
    if keys.dtype != torch.int64:
        raise RuntimeError(f"only int64 keys are modelled here, got {keys.dtype}")
    end_bit = 64 if end_bit is None else end_bit
    if not 0 <= begin_bit <= end_bit <= 64:
        raise RuntimeError(f"Invalid radix sort bit range [{begin_bit}, {end_bit}) for 64-bit keys")
    wp_radix_sort_pairs_int64_host(keys, values, count, begin_bit, end_bit, value_size)


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


def warp_array(t: torch.Tensor) -> torch.Tensor:
    """``wp.array(..., device="cpu")``: host memory."""
    return host(t.clone(), _device)


# --- newton/_src/geometry/contact_data.py, contact_sort.py -----------------------------------------------------------

SORT_KEY_SENTINEL = 0x7FFFFFFFFFFFFFFF


def _tid(like: torch.Tensor, dim: int) -> torch.Tensor:
    """``wp.tid()`` for every thread of a 1-D launch at once."""
    return torch.ones(dim, dtype=torch.int64, device=like.device).cumsum(0) - 1


def make_contact_sort_key(shape_a, shape_b, sort_sub_key):
    """[62:43] shape_a, [42:23] shape_b, [22:0] sort_sub_key (bit 63 kept zero)."""
    return ((shape_a & 0xFFFFF) << 43) | ((shape_b & 0xFFFFF) << 23) | (sort_sub_key & 0x7FFFFF)


def _prepare_sort(dim, contact_count, sort_keys_src, sort_keys_dst, sort_indices):
    """Copy active keys and init identity indices; fill unused slots with sentinel."""
    tid = _tid(contact_count, dim)
    active = tid < contact_count[0]
    sort_keys_dst[:dim] = torch.where(active, sort_keys_src[:dim], torch.full_like(tid, SORT_KEY_SENTINEL))
    sort_indices[:dim] = tid


def _backup_simple_kernel(dim, count, pair, position, normal, penetration,
                          pair_buf, position_buf, normal_buf, penetration_buf):
    """Copy active contacts into scratch buffers."""
    active = _tid(count, dim) < count[0]
    pair_buf.copy_(torch.where(active[:, None], pair, pair_buf))
    position_buf.copy_(torch.where(active[:, None], position, position_buf))
    normal_buf.copy_(torch.where(active[:, None], normal, normal_buf))
    penetration_buf.copy_(torch.where(active, penetration, penetration_buf))


def _gather_simple_kernel(dim, perm, count, pair_buf, position_buf, normal_buf, penetration_buf,
                          pair, position, normal, penetration):
    """Permuted write-back from scratch into live arrays."""
    p = perm[:dim]
    active = _tid(count, dim) < count[0]
    p = torch.where(active, p, torch.zeros_like(p))
    pair.copy_(torch.where(active[:, None], pair_buf[p], pair))
    position.copy_(torch.where(active[:, None], position_buf[p], position))
    normal.copy_(torch.where(active[:, None], normal_buf[p], normal))
    penetration.copy_(torch.where(active, penetration_buf[p], penetration))


class ContactSorter:
    """Sort contact arrays into a deterministic canonical order (allocation-free, graph-capturable)."""

    def __init__(self, capacity: int):
        self._capacity = capacity
        # radix_sort_pairs uses the second half as scratch, so allocate 2x.
        self._sort_indices = warp_array(torch.zeros(2 * capacity, dtype=torch.int64))   # (int32 upstream)
        self._sort_keys_copy = warp_array(torch.zeros(2 * capacity, dtype=torch.int64))
        self._simple_pair_buf = warp_array(torch.zeros(capacity, 2, dtype=torch.int64))
        self._simple_position_buf = warp_array(torch.zeros(capacity, 3, dtype=DTYPE))
        self._simple_normal_buf = warp_array(torch.zeros(capacity, 3, dtype=DTYPE))
        self._simple_penetration_buf = warp_array(torch.zeros(capacity, dtype=DTYPE))

    def sort_simple(self, sort_keys, contact_count, *, contact_pair, contact_position, contact_normal,
                    contact_penetration):
        n = self._capacity
        self._sort_and_permute(sort_keys, contact_count)
        live = [contact_pair, contact_position, contact_normal, contact_penetration]
        bufs = [self._simple_pair_buf, self._simple_position_buf, self._simple_normal_buf,
                self._simple_penetration_buf]
        launch(_backup_simple_kernel, n, inputs=[contact_count, *live], outputs=bufs)
        return launch(_gather_simple_kernel, n, inputs=[self._sort_indices, contact_count, *bufs], outputs=live)

    def _sort_and_permute(self, sort_keys, contact_count) -> None:
        """Prepare keys (sentinel-fill unused slots), then radix-sort over the full buffer."""
        n = self._capacity
        launch(_prepare_sort, n, inputs=[contact_count, sort_keys], outputs=[self._sort_keys_copy, self._sort_indices])
        radix_sort_pairs(self._sort_keys_copy, self._sort_indices, n)


# --- newton narrow phase (stand-in: spheres and a ground plane, one contact per touching pair) ----------------------

SAP_DIRECTION = (0.5935, 0.7790, 0.1235)                      # BroadPhaseSAP's fixed sweep axis


def narrow_phase_spheres(dim, pair_shape, body_q, direction, contact_count, contact_pair, contact_position,
                         contact_normal, contact_penetration, sort_keys):
    """Contacts of the candidate pairs; a touching pair takes the next slot of the writer's ``atomic_add``."""
    a, b = pair_shape[:, 0], pair_shape[:, 1]
    pa = body_q[(a - 1).clamp(min=0)]
    pb = body_q[b - 1]
    ground = a == GROUND_SHAPE
    d = pb - pa
    dist = d.norm(dim=-1).clamp(min=1e-12)
    up = torch.zeros_like(d)
    up[:, 2] = 1.0
    normal = torch.where(ground[:, None], up, d / dist[:, None])                         # from a to b
    pen = torch.where(ground, SPHERE_RADIUS - pb[:, 2], 2.0 * SPHERE_RADIUS - dist)
    point = torch.where(ground[:, None], pb - SPHERE_RADIUS * up, 0.5 * (pa + pb))
    touching = pen > 0.0
    sweep = (point * direction).sum(-1)
    slot_order = torch.argsort(torch.where(touching, sweep, torch.full_like(sweep, math.inf)), stable=True)
    contact_count.copy_(touching.sum().reshape(1))
    contact_pair.copy_(pair_shape[slot_order])
    contact_position.copy_(point[slot_order])
    contact_normal.copy_(normal[slot_order])
    contact_penetration.copy_(pen[slot_order])
    sort_keys.copy_(make_contact_sort_key(a, b, torch.zeros_like(a))[slot_order])


class Example:
    def __init__(self, device: str):
        self.device = device
        pairs = [(GROUND_SHAPE, i + 1) for i in range(NUM_SPHERES)]
        pairs += [(i + 1, j + 1) for i in range(NUM_SPHERES) for j in range(i + 1, NUM_SPHERES)]
        self.contact_max = len(pairs)
        self.pair_shape = warp_array(torch.tensor(pairs, dtype=torch.int64))
        direction = torch.tensor(SAP_DIRECTION, dtype=DTYPE)
        self.direction = (direction / direction.norm()).to(device)
        self.body_q = warp_array(torch.zeros(NUM_SPHERES, 3, dtype=DTYPE))          # state.body_q (positions)
        self.rigid_contact_count = warp_array(torch.zeros(1, dtype=torch.int64))
        self.rigid_contact_pair = warp_array(torch.zeros(self.contact_max, 2, dtype=torch.int64))
        self.rigid_contact_position = warp_array(torch.zeros(self.contact_max, 3, dtype=DTYPE))
        self.rigid_contact_normal = warp_array(torch.zeros(self.contact_max, 3, dtype=DTYPE))
        self.rigid_contact_penetration = warp_array(torch.zeros(self.contact_max, dtype=DTYPE))
        self.sort_keys = warp_array(torch.zeros(self.contact_max, dtype=torch.int64))
        self.contact_sorter = ContactSorter(self.contact_max)                       # deterministic=True
        self.graph = None

    def collide(self):
        launch(narrow_phase_spheres, self.contact_max, inputs=[self.pair_shape, self.body_q, self.direction],
               outputs=[self.rigid_contact_count, self.rigid_contact_pair, self.rigid_contact_position,
                        self.rigid_contact_normal, self.rigid_contact_penetration, self.sort_keys])
        pair, position, normal, penetration = self.contact_sorter.sort_simple(
            self.sort_keys, self.rigid_contact_count, contact_pair=self.rigid_contact_pair,
            contact_position=self.rigid_contact_position, contact_normal=self.rigid_contact_normal,
            contact_penetration=self.rigid_contact_penetration)
        count = _stage(self.rigid_contact_count)
        return count.to(DTYPE), pair.to(DTYPE), position, normal, penetration

    def capture(self):
        self.graph, self.graph_out = capture(self.collide, device=self.device, warmups=1, name="collide",
                                             owner="Example", static={"body_q": self.body_q})

    def step(self, body_q: torch.Tensor):
        self.body_q.copy_(body_q)
        if self.graph is not None:
            out = replay(self.graph, self.graph_out)
        else:
            out = self.collide()
        return [t.clone() for t in out]


def trajectories(gen: torch.Generator) -> list[torch.Tensor]:
    """Kinematic bodies: drifting across a 1.8-unit patch while settling onto the ground."""
    start = torch.rand(NUM_SPHERES, 3, generator=gen, dtype=DTYPE) * torch.tensor([1.8, 1.8, 0.3], dtype=DTYPE)
    start[:, 2] += 0.2
    velocity = (torch.rand(NUM_SPHERES, 3, generator=gen, dtype=DTYPE) - 0.5) * torch.tensor([3.0, 3.0, 0.0],
                                                                                            dtype=DTYPE)
    frames = []
    for f in range(FRAMES):
        t = f * FRAME_DT * 2.0
        q = start + velocity * t
        q[:, 2] = torch.clamp(start[:, 2] - 4.9 * t * t, min=0.8 * SPHERE_RADIUS)
        frames.append(q)
    return frames


# --- the workload -----------------------------------------------------------------------------------------------------

def run(variant: str, device: str = "cpu"):
    global _variant, _device
    _variant, _device = variant, device
    frames = trajectories(generator(1431))

    def serve(use_cuda_graph: bool):
        _apic_state.ops.clear()
        example = Example(device)
        outputs = []
        for f, body_q in enumerate(frames):
            if use_cuda_graph and f == 1:              # frame 0 ran eagerly; capture on frame 1's positions
                example.body_q.copy_(body_q)
                example.capture()
            outputs += example.step(body_q)
        return outputs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
