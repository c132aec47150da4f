"""Warp (debug build): the context check after a built-in kernel on a non-capturing stream calls cudaDeviceSynchronize while a relaxed capture is open in the same context.

Upstream: https://github.com/NVIDIA/warp/commit/94db155df257ebd46e4085ead7348cb78d8a7586 ("Fix debug capture sync",
NVIDIA/warp, 2026-06-26, merge request omniverse/warp!2559). Read: the commit message and its full diff
(``warp/native/warp.cu``: ``CaptureInfo.context``, ``is_context_capturing``, ``wp_cuda_context_check``,
``wp_cuda_graph_begin_capture``; the new test ``test_relaxed_capture_allows_side_stream_fill``), and, at that commit,
``warp/native/cuda_util.h`` (``wp_launch_device`` under ``_DEBUG``) and ``wp_memtile_device`` in ``warp.cu``. No
issue is linked; no discussion read.
Symptom: with Warp's native library built in debug mode, a relaxed-mode capture (``wp.ScopedCapture(capture_mode=
wp.CaptureMode.RELAXED)``, the mode used where other streams keep working during the capture, e.g. a renderer)
fails: "operation not permitted when stream is capturing" on the other stream's built-in launch, and the capture
ends with "operation failed due to a previous error during capture". Release builds, and runs without graphs, work.
Mechanism: in a ``_DEBUG`` build ``wp_launch_device`` (every built-in kernel: ``array.fill_`` -> ``wp_memtile_device``,
memsets, sparse helpers) launches on ``wp_cuda_stream_get_current()`` and then calls
``check_cuda(wp_cuda_context_check(WP_CURRENT_CONTEXT))``. ``wp_cuda_context_check`` reads the last error and, "if the
stream is not capturing" -- ``cudaStreamIsCapturing(get_current_stream())``, the launching stream only -- calls
``cudaDeviceSynchronize()``. A device-wide synchronize waits for every stream of the context, the capturing one too,
which CUDA refuses while any capture is open in it (relaxed mode allows other streams' work, not a wait for the
capturing stream): the call fails and the open capture is invalidated.
Doctor: sync-in-capture, at wp_cuda_context_check (its cudaDeviceSynchronize is issued while a Warp capture is open
in the same context, because it only asks whether the launching stream is capturing).
Fix (upstream): ``CaptureInfo`` records the ``context`` a capture began in; ``wp_cuda_context_check`` first asks
``is_context_capturing(current_context)`` (any entry of ``g_captures`` in this context) and skips the device-wide
synchronization then; otherwise it keeps the previous per-stream check and sync.
Modelled: ``g_captures``/``CaptureInfo``, ``wp_cuda_graph_begin_capture``/``end_capture``, ``wp_cuda_context_check``,
``wp_launch_device`` (``_DEBUG``) and ``wp_memtile_device`` as upstream has them, one context; a stream is a name and
``cudaStreamIsCapturing`` answers from the streams captures began on. The workload is the situation the relaxed mode
exists for: a physics step (semi-implicit Euler of NWORLD bodies) captured once in relaxed mode and replayed, while a
renderer thread fills its frame buffer with ``array.fill_`` on its own stream every frame; its fill of the capture
frame lands inside the capture window. The renderer's stream work runs on a real thread of its own (CUDA's other
streams), which the capture does not record; ``cudaDeviceSynchronize`` is the engine's ``synchronize``, which refuses a
wait for the device while another thread's capture is open, as CUDA does.
Workload: 5 frames; frame 0 warms up, frame 1 is captured (the renderer fills its buffer midway through the capture),
frames 2-4 replay. Bug: the renderer's debug check synchronizes the device during frame 1's capture -> CaptureError,
the capture is lost. Fix: the check sees the open capture in its context and skips the synchronize; physics states and
render buffers of all frames equal eager.
"""
from __future__ import annotations

import threading

import torch

from workbench.engine import synchronize
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/warp/commit/94db155df257ebd46e4085ead7348cb78d8a7586"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "wp_cuda_context_check"
SYMPTOM = ("debug-build Warp: a renderer's array.fill_ on its own stream runs wp_cuda_context_check, which calls "
           "cudaDeviceSynchronize during the physics thread's relaxed capture and invalidates it")

NWORLD, DT, GRAVITY, FRAMES, WARMUP = 4, 0.05, -9.8, 5, 1
RENDER_W = 6

_variant = "bug"


# --- warp/native/warp.cu -------------------------------------------------------------------------------------------

class CaptureInfo:
    def __init__(self, stream, context, capture_id, external, mode):
        self.stream = stream            # the main stream where capture begins and ends
        self.context = context          # context where capture was started (added by the fix)
        self.id = capture_id
        self.external = external
        self.mode = mode


g_captures: dict[int, CaptureInfo] = {}


def cudaStreamIsCapturing(stream) -> bool:
    return any(c.stream == stream for c in g_captures.values())


def cudaDeviceSynchronize(context) -> None:
    synchronize(context.device)          # waits for every stream of the device, a capturing one too


def is_context_capturing(context) -> bool:
    if not g_captures:
        return False
    return any(c.context is context for c in g_captures.values())


def wp_cuda_context_check(context, current_stream) -> int:
    e = 0                                # cudaGetLastError()
    if _variant == "fix":
        # Device-wide synchronization is illegal while a Warp-known stream capture is active in this context,
        # even if the current stream itself is not capturing.
        if is_context_capturing(context):
            return e
    # synchronize if the stream is not capturing
    if not cudaStreamIsCapturing(current_stream):
        cudaDeviceSynchronize(context)
    return e


def wp_launch_device(context, stream, kernel, *args) -> None:
    """``_DEBUG`` build: launch, then synchronize + error checking after each kernel."""
    kernel(*args)
    wp_cuda_context_check(context, stream)


def _memtile_kernel(dst, value):
    dst.fill_(value)


def wp_memtile_device(context, stream, dst, value) -> None:
    wp_launch_device(context, stream, _memtile_kernel, dst, value)


def wp_cuda_graph_begin_capture(context, stream, mode) -> int:
    capture_id = len(g_captures) + 1
    g_captures[capture_id] = CaptureInfo(stream, context, capture_id, False, mode)
    return capture_id


def wp_cuda_graph_end_capture(capture_id) -> None:
    g_captures.pop(capture_id, None)


class Context:
    def __init__(self, device):
        self.device = device


# --- the process: a physics thread that captures, a renderer thread on its own stream ----------------------------

OTHER_THREADS: list = []                 # work the renderer thread issues meanwhile


def yield_to_other_threads():
    """The renderer thread runs now, on its own stream: a real thread, which the capture does not record."""
    while OTHER_THREADS:
        work = OTHER_THREADS.pop(0)
        errors = []

        def body(work=work):
            try:
                work()
            except Exception as e:  # noqa: BLE001 - surfaces on the physics thread, as the process sees it
                errors.append(e)
        t = threading.Thread(target=body)
        t.start()
        t.join()
        if errors:
            raise errors[0]


class Renderer:
    """Fills its frame buffer every frame with ``array.fill_`` on stream "render"."""

    def __init__(self, context):
        self.context, self.stream = context, "render"
        self.frame_buf = torch.zeros(RENDER_W, device=context.device)
        self.frames: list[torch.Tensor] = []

    def draw(self, frame: int) -> None:
        wp_memtile_device(self.context, self.stream, self.frame_buf, float(frame + 1))   # array.fill_
        self.frames.append(self.frame_buf.clone())


class PhysicsSim:
    def __init__(self, context, q0, qd0, force, mass):
        self.context, self.stream = context, "physics"
        self.q, self.qd = q0.clone(), qd0.clone()
        self.force, self.inv_mass = force.clone(), 1.0 / mass
        self.graph = None

    def simulate(self):
        self.qd.add_(DT * (self.force * self.inv_mass + GRAVITY))       # integrate_bodies
        yield_to_other_threads()                                           # the renderer runs meanwhile
        self.q.add_(DT * self.qd)
        return self.q

    def step(self, frame: int, use_graph: bool):
        if not use_graph or frame < WARMUP:
            return self.simulate()
        if self.graph is None:           # wp.ScopedCapture(stream=physics, capture_mode=RELAXED)
            capture_id = wp_cuda_graph_begin_capture(self.context, self.stream, "relaxed")
            try:
                self.graph = capture(self.simulate, device=self.context.device, warmups=0, name="physics step",
                                     owner="PhysicsSim", static={"force": self.force},
                                     state={"q": self.q, "qd": self.qd}, capture_error_mode="relaxed")
            finally:
                wp_cuda_graph_end_capture(capture_id)
        g, out = self.graph
        out = replay(g, out)                                               # wp.capture_launch
        yield_to_other_threads()
        return out


def run_frames(device: str, use_graph: bool, q0, qd0, force, mass) -> list[torch.Tensor]:
    g_captures.clear()
    OTHER_THREADS.clear()
    context = Context(device)
    sim, renderer = PhysicsSim(context, q0, qd0, force, mass), Renderer(context)
    out = []
    for frame in range(FRAMES):
        OTHER_THREADS.append(lambda frame=frame: renderer.draw(frame))
        out.append(sim.step(frame, use_graph).clone())
        yield_to_other_threads()
    return out + renderer.frames


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(2559)
    q0 = randn(NWORLD, 3, gen=gen, device=device)
    qd0 = randn(NWORLD, 3, gen=gen, device=device)
    force = randn(NWORLD, 3, gen=gen, device=device)
    mass = randn(NWORLD, 1, gen=gen, device=device).abs() + 1.0
    return compare(__name__.rsplit(".", 1)[-1], variant, device,
                   lambda: run_frames(device, True, q0, qd0, force, mass),
                   lambda: run_frames(device, False, q0, qd0, force, mass))
