"""MuJoCo Warp advanced ``Data.time`` with a host-side Python float inside ``step``: a CUDA graph of ``step`` ran that line once, at capture, so replayed steps never advance simulation time.

Upstream: https://github.com/google-deepmind/mujoco_warp/pull/172 ("Use proper wp.array for `Data.time`",
google-deepmind/mujoco_warp, merged 2025-04-23 as commit 84d70599), closing issue
https://github.com/google-deepmind/mujoco_warp/issues/136 ("Convert `Data.time` to wp.array such that it is subject to
`nworld` batching": "Right now it's just a float that is modified host-side"). Read: the issue, and the full diff of
84d70599 (``mujoco_warp/_src/forward.py`` ``_advance``: ``d.time = d.time + m.opt.timestep`` replaced by a ``_time``
kernel launched over ``d.nworld`` doing ``d.time[worldid] += m.opt.timestep``; ``types.py``: ``Data.time`` from ``float``
to ``wp.array(dtype=wp.float32, ndim=1)`` of shape ``(nworld,)``; ``io.py``: ``make_data`` ``d.time = wp.zeros(nworld)``,
``put_data`` tiles ``mjd.time`` over the worlds, ``get_data_into`` reads ``d.time.numpy()[0]``). Also read, at the parent
commit, the graph users of ``step``: ``viewer.py`` (two eager warm-up ``mjwarp.step`` calls, then
``wp.ScopedCapture()`` around ``mjwarp.step(m, d)`` and ``wp.capture_launch(graph)`` per frame, ``get_data_into`` after
it) and ``_src/test_util.py`` ``benchmark`` (one eager ``fn(m, d)``, capture, ``capture_launch`` ``nstep`` times), and the
pre-fix ``_advance``/``euler``/``step`` bodies. The PR thread itself was not found; the CUDA-graph consequence is
reconstructed from the capture pattern those callers use.
Symptom: with the step captured into a CUDA graph (the viewer, the benchmark, any RL loop that replays ``step``),
``d.time`` (and the ``MjData.time`` ``get_data_into`` copies out) stops at its capture-time value: every replay
integrates positions and velocities but simulation time does not move, so anything keyed on time (time-varying
controls, clocks, episode timers) sees a frozen clock. Without the graph time advances normally.
Mechanism: ``_advance`` launches kernels for velocities and positions, then updates time with a Python expression on a
host float. Capture records the kernel launches; the Python statement runs once, while capturing, and is no part of the
graph. Every replay re-runs the kernels only, so the host float keeps its capture-time value.
Doctor: host-work-frozen, at _advance. The time update is host work (an attribute assignment of a Python float) inside
the captured region: it ran once at capture and the replays repeat only the kernels, so its result stays at the
capture-time value.
Fix (upstream): make ``Data.time`` a per-world device array and advance it with a kernel (``_time``) launched in
``_advance``, so the update is part of the graph.
Modelled: ``Model``/``Option``/``Data`` with upstream field names (``opt.timestep``, ``nworld``, ``time``, ``qpos``,
``qvel``, ``qacc``, ``ctrl``, ``qM``, ``qfrc_smooth``, ``qacc_integration``...), ``make_data``/``put_data``/
``get_data_into``, ``fwd_position``/``fwd_velocity``/``fwd_actuation``/``fwd_acceleration``/``forward``, ``euler`` (with
implicit joint damping, ``eulerdamp``), ``_advance`` (``advance_velocities``, ``integrate_joint_positions``, the time
update), ``step``, and the ``benchmark``-style runner (one eager step, capture, replays). Stand-ins: the physics is a
two-link planar arm per world (closed-form mass matrix, gravity, joint damping, gear-1 motors) written as torch ops in
place of Warp kernels; ``MjData`` is a small host record. The controller computes a sinusoidal ``ctrl`` on the host
from ``MjData.time`` each frame and writes it into ``d.ctrl`` before the replay, as a user loop would.
Workload: 3 worlds, timestep 0.01, float32; one eager step, capture, then 6 frames (ctrl from host time, replay,
``get_data_into``), the same frames eagerly. Bug: time stays at 0.02 (the eager step plus the capture's host update)
while eager reaches 0.07; the control computed from the frozen clock drives the arm differently from the third frame on
(qpos off by up to 3.2e-3; time off by 0.05, the max error reported; the same on an H200). The fix equals eager.
"""
from __future__ import annotations

import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/google-deepmind/mujoco_warp/pull/172"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "_advance"
SYMPTOM = ("with mjwarp.step captured into a CUDA graph, Data.time (a host Python float advanced in _advance) "
           "keeps its capture-time value on every replay, so simulation time and everything driven by it freeze")

NWORLD = 3
NQ = NV = NU = 2
DTYPE = torch.float32

_variant = "bug"


# --- mujoco_warp/_src/types.py ---------------------------------------------------------------------------------------

class Option:
    def __init__(self, timestep):
        self.timestep = timestep                  # a host float in this version (wp.array only from PR 374 on)
        self.disableflags = 0


class Model:
    """Two-link planar arm: link masses, lengths, joint damping, gear-1 motors on both joints."""

    def __init__(self, device):
        self.nq, self.nv, self.nu, self.njnt = NQ, NV, NU, 2
        self.opt = Option(0.01)
        self.body_mass = (1.0, 0.7)
        self.body_length = (0.5, 0.4)
        self.gravity = 9.81
        self.dof_damping = torch.tensor([0.3, 0.2], dtype=DTYPE).to(device)
        self.actuator_gear = torch.tensor([1.0, 1.0], dtype=DTYPE).to(device)


class Data:
    """Per-world state; ``time`` is a host float before the fix and a (nworld,) array after it."""

    def __init__(self, nworld, device):
        self.nworld = nworld
        z = lambda *s: torch.zeros(*s, dtype=DTYPE, device=device)  # noqa: E731
        self.time = 0.0 if _variant == "bug" else z(nworld)
        self.qpos, self.qvel, self.qacc = z(nworld, NQ), z(nworld, NV), z(nworld, NV)
        self.ctrl, self.act = z(nworld, NU), z(nworld, 0)
        self.qM, self.qM_integration = z(nworld, NV, NV), z(nworld, NV, NV)
        self.qfrc_bias, self.qfrc_passive, self.qfrc_actuator = z(nworld, NV), z(nworld, NV), z(nworld, NV)
        self.qfrc_smooth, self.qfrc_constraint = z(nworld, NV), z(nworld, NV)
        self.qfrc_integration, self.qacc_integration = z(nworld, NV), z(nworld, NV)


class MjData:
    """Host-side ``mujoco.MjData`` stand-in: what ``get_data_into`` fills."""

    def __init__(self, qpos0):
        self.time = 0.0
        self.qpos = list(qpos0)
        self.qvel = [0.0] * NV
        self.ctrl = [0.0] * NU


# --- mujoco_warp/_src/io.py -----------------------------------------------------------------------------------------

def put_data(mjm, mjd, nworld, qpos_worlds, device):
    d = Data(nworld, device)
    if _variant == "fix":
        d.time = torch.full((nworld,), mjd.time, dtype=DTYPE).to(device)   # mjd.time * np.ones(nworld)
    else:
        d.time = mjd.time
    d.qpos.copy_(qpos_worlds)
    d.qvel.copy_(torch.tensor([mjd.qvel] * nworld, dtype=DTYPE).to(device))
    return d


def get_data_into(result, mjm, d):
    result.time = float(d.time[0]) if _variant == "fix" else d.time        # d.time.numpy()[0] after the fix
    result.qpos = d.qpos[0].tolist()
    result.qvel = d.qvel[0].tolist()


# --- mujoco_warp/_src/forward.py ------------------------------------------------------------------------------------

def fwd_position(m, d):
    """Mass matrix and gravity bias of the arm (crb + rne stand-in)."""
    (m1, m2), (l1, l2) = m.body_mass, m.body_length
    c2 = torch.cos(d.qpos[:, 1])
    a = m1 * l1 * l1 / 3 + m2 * (l1 * l1 + l2 * l2 / 3)
    b = m2 * l1 * l2 / 2
    c = m2 * l2 * l2 / 3
    d.qM[:, 0, 0] = a + 2 * b * c2
    d.qM[:, 0, 1] = c + b * c2
    d.qM[:, 1, 0] = c + b * c2
    d.qM[:, 1, 1] = c
    s1 = torch.sin(d.qpos[:, 0])
    s12 = torch.sin(d.qpos[:, 0] + d.qpos[:, 1])
    d.qfrc_bias[:, 0] = m.gravity * ((m1 / 2 + m2) * l1 * s1 + m2 * l2 / 2 * s12)
    d.qfrc_bias[:, 1] = m.gravity * m2 * l2 / 2 * s12


def fwd_velocity(m, d):
    d.qfrc_passive.copy_(-m.dof_damping * d.qvel)


def fwd_actuation(m, d):
    d.qfrc_actuator.copy_(m.actuator_gear * d.ctrl)


def _factor_solve(M, b):
    """2x2 solve of M x = b per world (factor_solve stand-in)."""
    det = M[:, 0, 0] * M[:, 1, 1] - M[:, 0, 1] * M[:, 1, 0]
    x0 = (M[:, 1, 1] * b[:, 0] - M[:, 0, 1] * b[:, 1]) / det
    x1 = (M[:, 0, 0] * b[:, 1] - M[:, 1, 0] * b[:, 0]) / det
    return torch.stack([x0, x1], dim=1)


def fwd_acceleration(m, d):
    d.qfrc_smooth.copy_(d.qfrc_passive - d.qfrc_bias + d.qfrc_actuator)
    d.qacc.copy_(_factor_solve(d.qM, d.qfrc_smooth))


def forward(m, d):
    fwd_position(m, d)
    fwd_velocity(m, d)
    fwd_actuation(m, d)
    fwd_acceleration(m, d)


def _advance(m, d, qacc, qvel=None):
    """Advance state and time given activation derivatives and acceleration."""
    # advance_velocities
    d.qvel.add_(qacc * m.opt.timestep)
    # integrate_joint_positions (hinge joints), with qvel if given, d.qvel otherwise (semi-implicit)
    qvel_in = qvel if qvel is not None else d.qvel
    d.qpos.add_(qvel_in * m.opt.timestep)
    if _variant == "fix":
        d.time.add_(m.opt.timestep)               # wp.launch(_time, dim=(d.nworld,)): d.time[worldid] += timestep
    else:
        d.time = d.time + m.opt.timestep           # host float: runs once when the step is captured


def euler(m, d):
    """Euler integrator, semi-implicit in velocity, joint damping integrated implicitly (eulerdamp)."""
    if not m.opt.disableflags:
        d.qM_integration.copy_(d.qM + torch.diag_embed(m.opt.timestep * m.dof_damping).expand_as(d.qM))
        d.qfrc_integration.copy_(d.qfrc_smooth + d.qfrc_constraint)
        d.qacc_integration.copy_(_factor_solve(d.qM_integration, d.qfrc_integration))
        _advance(m, d, d.qacc_integration)
    else:
        _advance(m, d, d.qacc)


def step(m, d):
    """Advance simulation."""
    forward(m, d)
    euler(m, d)
    return d.qpos


# --- a runner: test_util.benchmark / viewer.py pattern ----------------------------------------------------------------

def controller(mjd):
    """User control on the host, from the simulation clock."""
    return [0.8 * math.sin(2 * math.pi * 5.0 * mjd.time), -0.5 * math.cos(2 * math.pi * 3.0 * mjd.time)]


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    nframes = 6

    def serve(use_graph):
        gen = generator(172)
        mjm = Model(device)
        qpos_worlds = randn(NWORLD, NQ, gen=gen, device=device, scale=0.4).to(DTYPE)
        mjd = MjData(qpos_worlds[0].tolist())
        d = put_data(mjm, mjd, NWORLD, qpos_worlds, device)
        step(mjm, d)                                   # compile the step (eager)
        get_data_into(mjd, mjm, d)
        graph = out = None
        if use_graph:
            state = {k: v for k, v in vars(d).items() if k in ("qpos", "qvel", "time") and isinstance(v, torch.Tensor)}
            graph, out = capture(lambda: step(mjm, d), device=device, warmups=0, name="mjwarp.step",
                                 owner="mujoco_warp step graph", static={"ctrl": d.ctrl}, state=state)
        frames = []
        for _ in range(nframes):
            d.ctrl.copy_(torch.tensor([controller(mjd)] * NWORLD, dtype=DTYPE).to(device))
            if use_graph:
                replay(graph, out)                     # wp.capture_launch(graph)
            else:
                step(mjm, d)
            get_data_into(mjd, mjm, d)
            frames.append(torch.tensor([mjd.time], dtype=torch.float64))
            frames.append(d.qpos.clone())
        return frames

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
