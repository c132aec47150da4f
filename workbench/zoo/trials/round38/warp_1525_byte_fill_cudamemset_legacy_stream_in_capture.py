"""A one-byte ``array.fill_()`` inside a Warp capture goes through synchronous ``cudaMemset``: the capture fails.

Upstream: https://github.com/NVIDIA/warp/commit/410b62f20e37643cb1befd7a8fb113d11c886eef ("Fix byte fill
graph capture (GH-1525)", GitLab MR !2484, mirrored as PR #1526), fixing issue
https://github.com/NVIDIA/warp/issues/1525 ("Contiguous 1-byte array fill_ is not CUDA graph-capturable").
Symptom: in Warp 1.14.0, ``wp.ScopedCapture`` around ``x.fill_(value)`` on a contiguous ``wp.bool``,
``wp.int8`` or ``wp.uint8`` array fails ("the ``wp.bool`` case fails during ``capture_end()`` with CUDA error
906 from ``wp_memtile_device``", cudaErrorStreamCaptureImplicit), while fills of 2-, 4- and 8-byte and vector
types (fixed earlier, #1412) capture; eagerly every fill works.
Mechanism: ``array.fill_`` sends a contiguous array to ``device.memtile(ptr, value, srcsize, size)``, i.e.
``wp_memtile_device`` in ``warp/native/warp.cu``. Its 8/4/2-byte branches launch ``memtile_value_kernel`` on
Warp's current stream (recorded into the capture), but the ``srcsize == 1`` branch called the synchronous
runtime ``cudaMemset(dst, v, n)``, which runs on the legacy default stream. The legacy stream synchronises
with every blocking stream, here the one being captured, so the call would make it depend on a capturing
stream: the runtime refuses it (error 906) and the capture is invalidated. Any captured step that resets a
byte mask with ``fill_`` (a contact flag array below) therefore cannot be captured at all.
Doctor: sync-in-capture, at ``wp_memtile_device`` (its one-byte branch issues the legacy-stream
``cudaMemset`` inside the captured region).
Fix (upstream): the one-byte branch calls ``wp_memset_device(context, dst, v, n, WP_CURRENT_STREAM)`` (an
async memset on the current stream, which the capture records) and a regression test
``test_contiguous_byte_fill_capture`` captures ``fill_`` for bool/int8/uint8. (Diff read: one line in
``warp.cu``, the test, and the CHANGELOG entry.)
"""
from __future__ import annotations

import torch

from workbench.engine import CaptureError
from workbench.engine.source import user_frame
from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/NVIDIA/warp/commit/410b62f20e37643cb1befd7a8fb113d11c886eef"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "wp_memtile_device"
SYMPTOM = "capturing a step that fills a bool/int8/uint8 array fails with CUDA error 906 (legacy-stream memset)"

NUM_PARTICLES = 6
RADIUS, STIFFNESS, DAMPING = 0.5, 40.0, 0.9
FRAME_DT, SIM_SUBSTEPS = 0.05, 2              # even: the substeps' state swap ends on state_0
GRAVITY = -9.8
FRAMES = 6


def cudaMemset(dst: torch.Tensor, value: int, n: int):
    """The synchronous runtime memset: it runs on the legacy default stream, which synchronises with every
    blocking stream. While a blocking stream is capturing that dependency is refused
    (cudaErrorStreamCaptureImplicit, 906) and the capture invalidated; the CPU emulation has no streams, so
    the runtime's rule is stated here (on either backend)."""
    if torch.cuda.is_current_stream_capturing():
        raise CaptureError(
            "cudaMemset on the legacy stream inside graph capture: operation would make the legacy stream "
            f"depend on a capturing blocking stream (cudaErrorStreamCaptureImplicit, 906).\n  at {user_frame()}",
            op="cudaMemset", source=user_frame())
    dst[:n].fill_(value)


def wp_memset_device(context, dst: torch.Tensor, value: int, n: int, stream):
    """``cudaMemsetAsync`` on the given (current) stream: a memset node of the capture."""
    dst[:n].fill_(value)


def memtile_value_kernel(dst: torch.Tensor, value, n: int):
    dst[:n].fill_(value)


def wp_memtile_device(context, dst: torch.Tensor, value, srcsize: int, n: int, variant: str):
    """``warp.cu``: tile one ``srcsize``-byte value over ``n`` elements of ``dst``."""
    if srcsize in (8, 4, 2):
        memtile_value_kernel(dst, value, n)      # wp_launch_device(WP_CURRENT_CONTEXT, memtile_value_kernel, ...)
    elif srcsize == 1:
        if variant == "bug":
            cudaMemset(dst, int(value), n)
        else:
            wp_memset_device(context, dst, int(value), n, "WP_CURRENT_STREAM")
    else:
        raise NotImplementedError("memtile_kernel_by_value buckets are not modelled")


class Device:
    def __init__(self, name: str, variant: str):
        self.name, self.context, self.variant = name, object(), variant

    def memtile(self, ptr: torch.Tensor, value, srcsize: int, reps: int):
        wp_memtile_device(self.context, ptr, value, srcsize, reps, self.variant)


class array:
    """``wp.array`` reduced to a contiguous 1-d buffer; ``fill_`` takes the ``memtile`` fast path."""

    def __init__(self, data: torch.Tensor, device: Device):
        self.data, self.device = data, device
        self.size, self.is_contiguous = data.numel(), data.is_contiguous()

    def fill_(self, value):
        if self.size == 0:
            return
        cvalue_size = self.data.element_size()   # ctypes.sizeof(self.dtype._type_(value))
        if self.is_contiguous:
            self.device.memtile(self.data, value, cvalue_size, self.size)
        else:
            self.data.fill_(value)                 # wp_array_fill_device


class State:
    def __init__(self, q: torch.Tensor, qd: torch.Tensor, device: Device):
        self.particle_q = array(q.clone(), device)     # heights
        self.particle_qd = array(qd.clone(), device)   # vertical velocities


class Model:
    def __init__(self, device: Device, dev: str):
        self.particle_contact = array(torch.zeros(NUM_PARTICLES, dtype=torch.uint8, device=dev), device)
        self.particle_f = array(torch.zeros(NUM_PARTICLES, device=dev), device)   # float32: 4-byte branch


def collide_ground(q: torch.Tensor, contact: torch.Tensor):
    """Kernel: flag the particles that touch the ground plane."""
    contact.copy_(torch.maximum(contact, (q < RADIUS).to(torch.uint8)))


def eval_contact_forces(q: torch.Tensor, qd: torch.Tensor, contact: torch.Tensor, f: torch.Tensor):
    f.add_(contact.to(q.dtype) * (STIFFNESS * (RADIUS - q) - DAMPING * qd))


def integrate_particles(q0, qd0, f, q1, qd1, dt):
    qd1.copy_(qd0 + dt * (f + GRAVITY))
    q1.copy_(q0 + dt * qd1)


class Example:
    """A Warp-style example: ``simulate()`` runs the substeps, ``step()`` launches the captured graph."""

    def __init__(self, device: Device, dev: str, q: torch.Tensor, qd: torch.Tensor, use_cuda_graph: bool):
        self.model = Model(device, dev)
        self.state_0, self.state_1 = State(q, qd, device), State(q, qd, device)
        self.sim_dt = FRAME_DT / SIM_SUBSTEPS
        self.graph = None
        if use_cuda_graph:
            # with wp.ScopedCapture() as capture: self.simulate()   (no warm-up run)
            self.graph, self.out = capture(
                self.simulate, device=dev, warmups=0, name="simulate", owner="Example (wp.ScopedCapture)",
                state={"state_0.particle_q": self.state_0.particle_q.data,
                       "state_0.particle_qd": self.state_0.particle_qd.data,
                       "state_1.particle_q": self.state_1.particle_q.data,
                       "state_1.particle_qd": self.state_1.particle_qd.data})

    def simulate(self):
        m = self.model
        for _ in range(SIM_SUBSTEPS):
            m.particle_contact.fill_(0)            # uint8: the one-byte memtile branch
            m.particle_f.fill_(0.0)                # float32: memtile_value_kernel
            collide_ground(self.state_0.particle_q.data, m.particle_contact.data)
            eval_contact_forces(self.state_0.particle_q.data, self.state_0.particle_qd.data,
                                m.particle_contact.data, m.particle_f.data)
            integrate_particles(self.state_0.particle_q.data, self.state_0.particle_qd.data, m.particle_f.data,
                                self.state_1.particle_q.data, self.state_1.particle_qd.data, self.sim_dt)
            self.state_0, self.state_1 = self.state_1, self.state_0
        return self.state_0.particle_q.data, m.particle_contact.data

    def step(self):
        if self.graph is not None:
            return replay(self.graph, self.out)    # wp.capture_launch(self.graph)
        return self.simulate()


def run(variant: str, device: str = "cpu"):
    gen = generator(1525)
    q0 = torch.rand(NUM_PARTICLES, generator=gen) * 1.0 + 0.2
    qd0 = torch.randn(NUM_PARTICLES, generator=gen) * 0.5

    def serve(use_cuda_graph: bool):
        example = Example(Device(device, variant), device, q0.to(device), qd0.to(device), use_cuda_graph)
        outs = []
        for _ in range(FRAMES):
            q, contact = example.step()
            outs += [q.clone(), contact.clone()]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
