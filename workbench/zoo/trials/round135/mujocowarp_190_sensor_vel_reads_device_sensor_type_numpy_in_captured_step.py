"""MuJoCo Warp's ``sensor_vel`` and ``sensor_acc`` decide whether to run ``subtree_vel`` / ``rne_postconstraint`` by
reading the model's ``sensor_type`` array back to the host on every call: ``wp.static(np.isin(m.sensor_type.numpy(),
[...]).any())``. ``wp.static`` called from Python just returns its argument, and ``sensor_type`` is a device array (the
sensor kernels index it), so each call of ``step`` makes a synchronous device-to-host copy. Eagerly that only costs
time; inside ``wp.ScopedCapture`` (the whole ``step`` captured, as ``benchmark``/``testspeed`` and the viewer do) the
copy is refused and the capture of any model with velocity or acceleration sensors fails. The other ``.numpy()`` reads
of the step (the kinematic tree's level table ``body_treeadr``, put on ``device="cpu"`` by ``put_model``) are host
arrays and are fine. The fix computes the two decisions once, on the host, in ``put_model`` (``m.sensor_subtree_vel``,
``m.sensor_rne_postconstraint``: plain Python bools) and branches on them in the sensor functions.

Upstream: https://github.com/google-deepmind/mujoco_warp/pull/190 ("sensor_subtree_vel and sensor_rne_postconstraint",
google-deepmind/mujoco_warp, by Taylor Howell (thowell); commit 2a220881 of 2025-04-25, merged 2025-04-28 as merge
commit c14e13ea, reviewed by adenzler-nvidia), read in a mirror of the repository. Read: the whole diff of 2a220881
(``io.py``: ``put_model`` sets ``m.sensor_subtree_vel = np.isin(mjm.sensor_type, [SUBTREELINVEL, SUBTREEANGMOM]).any()``
and ``m.sensor_rne_postconstraint = np.isin(mjm.sensor_type, [ACCELEROMETER, FORCE, TORQUE, FRAMELINACC,
FRAMEANGACC]).any()``; ``sensor.py``: ``sensor_vel`` / ``sensor_acc`` test those instead of the ``wp.static(np.isin(
m.sensor_type.numpy(), ...))`` expressions; ``types.py``: two ``bool  # warp only`` fields); at its parent:
``sensor.py`` whole (``sensor_pos``, ``sensor_vel``, ``sensor_acc`` and their kernels), ``forward.py``'s ``forward``,
``step``, ``fwd_position``, ``fwd_velocity``, ``fwd_acceleration``, ``euler`` (``eulerdamp``) and ``_advance``,
``smooth.py``'s ``subtree_vel``, ``rne``, ``rne_postconstraint``, ``_rne_cacc_world``/``_rne_cacc_forward``, and
``io.py``'s model fields (``body_treeadr`` and the ``qLD``/actuator tile tables are ``wp.array(..., device="cpu")``,
``sensor_type`` is a default-device array; at the merge, every other ``.numpy()`` in ``smooth.py``, ``forward.py`` and
``sensor.py`` reads one of those host tables, and ``passive.py``, ``constraint.py``, ``collision_driver.py`` and
``solver.py`` have none); ``test_util.benchmark`` and ``viewer.py`` at the merge (one or two eager ``step`` calls, then
``with wp.ScopedCapture() as capture: fn(m, d)`` and ``wp.capture_launch(graph)`` per step); the history: the host flags
had existed before (``m.sensor_subtreevel``) and were removed on 2025-04-14/15 by commits 56d4477b and f4eb6679 (PRs
#120 "subtree_vel_sensors" and #121 "rne_postconstraint_sensors"), which introduced the ``.numpy()`` reads; Warp's
``static`` (``builtins.py`` at the time: ``def static(expr): return expr``). The PR's description (as stored): "the
current logic for calling ``subtree_vel`` or ``rne_postconstraint`` by sensor functions is not compatible with cuda
graph capture. ... this update makes the relevant sensors compatible with cuda graph capture"; adenzler-nvidia in
review: "I guess that one is on me, I should have caught this during review. Wondering if we need a test config that
uses graph capture." (issue #196 "Test CUDA graph capture" followed).
Not read: Warp's ``array.numpy()`` implementation at that revision (that it copies a CUDA array on the legacy stream and
so fails under capture is from warp#653, where a Warp maintainer writes "calling ``numpy()`` on an array allocated on
the GPU will always use the legacy default stream in CUDA and can't be used as part of a graph capture", and from
mujoco_warp#17's "Warp CUDA error 906: operation would make the legacy stream depend on a capturing blocking stream (in
function memcpy_d2h)"); the physics kernels beyond the call sites named above (``kinematics``, ``com_pos``, ``crb``,
``factor_m``, ``com_vel``, ``passive``, ``solve_m``, the collision driver and the constraint solver).
Symptom: no user report of this exact failure is stored; the PR says the sensor logic "is not compatible with cuda graph
capture". From 2025-04-15 (``sensor_vel``; ``sensor_acc`` from 04-17) to 2025-04-28, ``mjwarp-testspeed``, the viewer or
``benchmark`` on any model with a velocity- or acceleration-stage sensor would fail in the capture at the device-to-host
copy (my inference from the code read; the error text is Warp's 906 as in the issues above).
Mechanism: the host decision is recomputed every call from device data: ``np.isin(m.sensor_type.numpy(), ...)`` is host
work that needs the device's values, which a capturing stream cannot wait for. Eager steps and the eager warmup before
the capture do the copy without complaint, so nothing fails until the capture.
Doctor: sync-in-capture, at sensor_vel. The first device-to-host read inside the capture is ``sensor_vel``'s
``m.sensor_type.numpy()`` (``forward`` runs ``sensor_pos``, ``fwd_velocity``, then ``sensor_vel``; ``sensor_acc``'s read
comes later), and ``sensor_vel`` is a function the fix changes (with ``sensor_acc`` and ``put_model``).
Fix (upstream): ``put_model`` evaluates both ``np.isin`` tests on the host ``mjm.sensor_type`` once; ``sensor_vel`` and
``sensor_acc`` branch on the bools. The fix also adds ``FRAMELINACC``/``FRAMEANGACC`` to the ``rne_postconstraint`` list
(a separate correctness fix of those sensors; this workload has neither, so it changes nothing here).
Modelled: ``put_model`` (the sensor fields, ``body_treeadr`` on the host, the two flags), ``put_data``, ``Model``,
``Data``, ``static``, ``event_scope`` (a no-op here), ``step``, ``forward``, ``fwd_position``, ``fwd_velocity``,
``fwd_acceleration``, ``euler`` (with ``eulerdamp``) and ``_advance``, ``kinematics``, ``com_pos``, ``crb``/``factor_m``
(one function), ``com_vel``, ``passive``, ``rne``, ``subtree_vel``, ``rne_postconstraint``, ``sensor_pos``,
``sensor_vel``, ``sensor_acc``; the caller is ``test_util.benchmark``'s pattern (one eager ``fn(m, d)``, capture, one
``capture_launch`` per step).
Stand-ins: a planar tree of four hinged rods (world + 4 bodies, levels {1}, {2, 3}, {4}) stands for an MJCF model;
positions, velocities and accelerations are propagated level by level over the host ``body_treeadr`` as upstream, but
with planar rod kinematics instead of spatial transforms; the inertia matrix is its diagonal (sum of m r^2 over the
joint's subtree plus armature), so ``factor_m``/``solve_m`` are a division; ``rne`` gives the gravity torque only (no
Coriolis terms); subtree angular momentum is summed directly over each subtree instead of upstream's recursion; ``cfrc``
and the force/torque sensors are left out; sensors write 3 values each (scalars pad with zeros) in a ``[nworld, nsensor,
3]`` ``sensordata``; ``SensorType`` keeps MuJoCo's names, not its numbers; no contacts, constraints (``njmax`` 0, so
``forward`` copies ``qacc_smooth`` to ``qacc`` after ``sensor_acc``, as upstream at this revision, and the accelerometer
reads the previous step's ``qacc``), actuators, tendons or activations; ``wp.array.numpy()`` is ``Tensor.cpu().numpy()``
(a device tensor is copied to the host, a host one is read in place); the accelerometer is the body's linear ``cacc`` in
the world frame (upstream: the site frame, with the velocity correction); float64 throughout.
Workload: 4 worlds, 6 sensors (JOINTPOS, SUBTREECOM; JOINTVEL, SUBTREELINVEL, SUBTREEANGMOM; ACCELEROMETER), dt 0.01;
the caller writes ``qfrc_applied`` (a static input) before each step from a seeded schedule; one eager step, then the
capture, then 6 replays; outputs per step: ``sensordata``, ``qpos``, ``qvel``. The run without graphs makes the same 7
steps eagerly.
Measured (WORKBENCH_FAST=1, CPU): bug: "misbehaves (raised CaptureError: Tensor.cpu() inside graph capture needs the
device's values on the host (a host synchronisation), which a CUDA graph cannot wait for
(cudaErrorStreamCaptureUnsupported).)", raised at ``sensor_vel``'s ``m.sensor_type.cpu().numpy()`` during the capture
(the eager first step ran); fix: "equals eager (max |graph - eager| = 0)" over the 7 steps. About a second per variant.
"""
from __future__ import annotations

import dataclasses
import enum

import numpy as np
import torch

from workbench.engine import events, host
from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/google-deepmind/mujoco_warp/pull/190"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "sensor_vel"
SYMPTOM = ("MuJoCo Warp's sensor_vel/sensor_acc read the device sensor_type array to the host (.numpy()) on every "
           "step to decide on subtree_vel/rne_postconstraint, so capturing step() of a model with such sensors fails")

NWORLD, NSTEP, DT, GRAVITY, ARMATURE = 4, 6, 0.01, 9.81, 0.05
DTYPE = torch.float64
_variant = "bug"


class SensorType(enum.IntEnum):      # MuJoCo's names (mjtSensor), not its numbers
    ACCELEROMETER = 1
    FORCE = 4
    TORQUE = 5
    JOINTPOS = 9
    JOINTVEL = 10
    SUBTREECOM = 30
    SUBTREELINVEL = 31
    SUBTREEANGMOM = 32
    FRAMELINACC = 28
    FRAMEANGACC = 29


class Stage(enum.IntEnum):           # mjtStage
    POS, VEL, ACC = 1, 2, 3


class DisableBit(enum.IntFlag):
    SENSOR = 1 << 10
    EULERDAMP = 1 << 15


@dataclasses.dataclass
class MjModel:
    """The host ``mujoco.MjModel`` (numpy arrays): a planar tree of hinged rods."""
    body_parentid: np.ndarray = dataclasses.field(default_factory=lambda: np.array([0, 0, 1, 1, 2]))
    body_mass: np.ndarray = dataclasses.field(default_factory=lambda: np.array([0.0, 1.2, 0.8, 0.6, 0.5]))
    body_length: np.ndarray = dataclasses.field(default_factory=lambda: np.array([0.0, 0.5, 0.4, 0.35, 0.3]))
    dof_damping: np.ndarray = dataclasses.field(default_factory=lambda: np.array([0.05, 0.04, 0.04, 0.03]))
    sensor_type: np.ndarray = dataclasses.field(default_factory=lambda: np.array(
        [SensorType.JOINTPOS, SensorType.SUBTREECOM, SensorType.JOINTVEL, SensorType.SUBTREELINVEL,
         SensorType.SUBTREEANGMOM, SensorType.ACCELEROMETER]))
    sensor_objid: np.ndarray = dataclasses.field(default_factory=lambda: np.array([0, 1, 1, 2, 1, 4]))
    sensor_needstage: np.ndarray = dataclasses.field(default_factory=lambda: np.array(
        [Stage.POS, Stage.POS, Stage.VEL, Stage.VEL, Stage.VEL, Stage.ACC]))
    disableflags: int = 0


class Model:
    pass


class Data:
    pass


def static(expr):
    """``wp.static`` called from Python (outside a kernel): Warp's ``builtins.static`` just returns ``expr``."""
    return expr


def event_scope(fn):
    """``warp_util.event_scope``: a timing scope, a no-op here."""
    return fn


def _dev(x, device, dtype=torch.int64):
    return torch.as_tensor(np.asarray(x), dtype=dtype).to(device)


def put_model(mjm: MjModel, device: str) -> Model:
    m = Model()
    m.nbody, m.nv, m.nsensor = len(mjm.body_parentid), len(mjm.dof_damping), len(mjm.sensor_type)
    m.opt_disableflags, m.opt_timestep = mjm.disableflags, DT
    m.body_parentid = _dev(mjm.body_parentid, device)
    m.body_mass = _dev(mjm.body_mass, device, DTYPE)
    m.body_length = _dev(mjm.body_length, device, DTYPE)
    m.body_dofadr = _dev(np.arange(m.nbody) - 1, device)         # body b > 0 has hinge dof b - 1
    m.dof_bodyid = _dev(np.arange(1, m.nbody), device)
    m.dof_damping = _dev(mjm.dof_damping, device, DTYPE)
    depth = np.zeros(m.nbody, dtype=np.int64)
    for b in range(1, m.nbody):
        depth[b] = depth[mjm.body_parentid[b]] + 1
    body_tree = np.argsort(depth, kind="stable")
    m.body_tree = _dev(body_tree, device)
    # body_treeadr contains starting index of each body tree level (device="cpu" upstream: a host array)
    m.body_treeadr = host(torch.as_tensor(np.searchsorted(depth[body_tree], np.arange(depth.max() + 1))), device)
    in_subtree = np.eye(m.nbody)                                   # in_subtree[b, i]: body i is in b's subtree
    for i in range(m.nbody):
        b = i
        while b != 0:
            b = mjm.body_parentid[b]
            in_subtree[b, i] = 1.0
    m.body_subtree = _dev(in_subtree, device, DTYPE)
    m.body_subtreemass = _dev(in_subtree @ mjm.body_mass, device, DTYPE)
    m.body_parent_onehot = _dev(np.eye(m.nbody)[mjm.body_parentid], device, DTYPE)
    m.dof_subtree = _dev(in_subtree[1:], device, DTYPE)
    # sensors
    m.sensor_type = _dev(mjm.sensor_type, device)
    m.sensor_objid = _dev(mjm.sensor_objid, device)
    m.sensor_adr = _dev(np.arange(m.nsensor), device)
    m.sensor_pos_adr = _dev(np.nonzero(mjm.sensor_needstage == Stage.POS)[0], device)
    m.sensor_vel_adr = _dev(np.nonzero(mjm.sensor_needstage == Stage.VEL)[0], device)
    m.sensor_acc_adr = _dev(np.nonzero(mjm.sensor_needstage == Stage.ACC)[0], device)
    if _variant == "fix":
        m.sensor_subtree_vel = bool(np.isin(mjm.sensor_type, [SensorType.SUBTREELINVEL,
                                                              SensorType.SUBTREEANGMOM]).any())
        m.sensor_rne_postconstraint = bool(np.isin(mjm.sensor_type, [
            SensorType.ACCELEROMETER, SensorType.FORCE, SensorType.TORQUE, SensorType.FRAMELINACC,
            SensorType.FRAMEANGACC]).any())
    return m


def put_data(m: Model, device: str, qpos0: torch.Tensor) -> Data:
    d = Data()
    d.nworld = NWORLD
    z = lambda *s: torch.zeros(NWORLD, *s, dtype=DTYPE, device=device)
    d.qpos, d.qvel, d.qacc, d.qacc_smooth = qpos0.to(device), z(m.nv), z(m.nv), z(m.nv)
    d.qfrc_applied, d.qfrc_passive, d.qfrc_bias, d.qfrc_smooth, d.qM = z(m.nv), z(m.nv), z(m.nv), z(m.nv), z(m.nv)
    d.qacc_integration, d.time = z(m.nv), z()
    d.xang, d.xpos, d.subtree_com = z(m.nbody), z(m.nbody, 3), z(m.nbody, 3)
    d.cvel, d.cacc = z(m.nbody, 6), z(m.nbody, 6)
    d.subtree_linvel, d.subtree_angmom = z(m.nbody, 3), z(m.nbody, 3)
    d.sensordata = z(m.nsensor, 3)
    return d


# --- smooth.py (reduced) -------------------------------------------------------------------------------------------

def _levels(m: Model):
    """The kinematic tree's levels from the host ``body_treeadr`` (no synchronisation: it is host memory)."""
    body_treeadr = m.body_treeadr.cpu().numpy()      # wp.array.numpy(): a host array, read in place
    for i in range(len(body_treeadr)):
        beg = int(body_treeadr[i])
        end = m.nbody if i == len(body_treeadr) - 1 else int(body_treeadr[i + 1])
        yield i, m.body_tree[beg:end]


def _dirs(ang):
    return torch.stack((torch.cos(ang), torch.sin(ang), torch.zeros_like(ang)), -1)


def _perp(ang):
    return torch.stack((-torch.sin(ang), torch.cos(ang), torch.zeros_like(ang)), -1)


@event_scope
def kinematics(m: Model, d: Data):
    d.xang[:, 0] = 0.0
    d.xpos[:, 0] = 0.0
    for i, bodies in _levels(m):
        if i == 0:
            continue
        pid = m.body_parentid[bodies]
        ang = d.xang[:, pid] + d.qpos[:, m.body_dofadr[bodies]]
        d.xang[:, bodies] = ang
        d.xpos[:, bodies] = d.xpos[:, pid] + m.body_length[bodies][None, :, None] * _dirs(ang)


def _subtree_sum(m: Model, per_body: torch.Tensor) -> torch.Tensor:
    """Sum a per-body quantity up the tree, deepest level first (upstream: atomic adds per level)."""
    acc = per_body
    for i, bodies in reversed(list(_levels(m))):
        if i:
            acc = acc + torch.einsum("wlk,lp->wpk", acc[:, bodies], m.body_parent_onehot[bodies])
    return acc


@event_scope
def com_pos(m: Model, d: Data):
    mass_x = _subtree_sum(m, m.body_mass[None, :, None] * d.xpos)
    d.subtree_com.copy_(mass_x / m.body_subtreemass.clamp(min=1e-15)[None, :, None])


@event_scope
def crb(m: Model, d: Data):
    """crb + factor_m (stand-in): the diagonal of the inertia matrix, m r^2 over each joint's subtree."""
    anchor = d.xpos[:, m.body_parentid[m.dof_bodyid]]                       # [W, nv, 3]: the hinge points
    r2 = ((d.xpos[:, None, :, :] - anchor[:, :, None, :]) ** 2).sum(-1)      # [W, nv, nbody]
    d.qM.copy_((r2 * m.dof_subtree * m.body_mass).sum(-1) + ARMATURE)


@event_scope
def com_vel(m: Model, d: Data):
    d.cvel[:, 0] = 0.0
    for i, bodies in _levels(m):
        if i == 0:
            continue
        pid = m.body_parentid[bodies]
        ang = d.cvel[:, pid, 2] + d.qvel[:, m.body_dofadr[bodies]]
        lin = d.cvel[:, pid, 3:] + m.body_length[bodies][None, :, None] * ang[..., None] * _perp(d.xang[:, bodies])
        d.cvel[:, bodies] = torch.cat((torch.zeros_like(lin[..., :2]), ang[..., None], lin), -1)


@event_scope
def passive(m: Model, d: Data):
    d.qfrc_passive.copy_(-m.dof_damping * d.qvel)


@event_scope
def rne(m: Model, d: Data):
    """Bias forces (stand-in): the gravity torque of each joint's subtree, no Coriolis terms."""
    anchor = d.xpos[:, m.body_parentid[m.dof_bodyid]]
    dx = d.xpos[:, None, :, 0] - anchor[:, :, None, 0]
    d.qfrc_bias.copy_(GRAVITY * (dx * m.dof_subtree * m.body_mass).sum(-1))


def subtree_vel(m: Model, d: Data):
    """Subtree linear velocity and angular momentum."""
    lin = d.cvel[:, :, 3:]
    d.subtree_linvel.copy_(_subtree_sum(m, m.body_mass[None, :, None] * lin)
                           / m.body_subtreemass.clamp(min=1e-15)[None, :, None])
    dx = d.xpos[:, None, :, :] - d.subtree_com[:, :, None, :]                 # [W, b, i, 3]
    dv = lin[:, None, :, :] - d.subtree_linvel[:, :, None, :]
    crossz = dx[..., 0] * dv[..., 1] - dx[..., 1] * dv[..., 0]
    inertia = m.body_mass * m.body_length ** 2 / 12.0
    angz = (m.body_subtree * (m.body_mass * crossz + inertia * d.cvel[:, None, :, 2])).sum(-1)
    d.subtree_angmom.copy_(torch.stack((torch.zeros_like(angz), torch.zeros_like(angz), angz), -1))


@event_scope
def rne_postconstraint(m: Model, d: Data):
    """RNE with complete data (reduced to cacc): world cacc is -gravity, then forward over the levels with d.qacc."""
    d.cacc[:, 0] = 0.0
    d.cacc[:, 0, 4] = GRAVITY
    for i, bodies in _levels(m):
        if i == 0:
            continue
        pid = m.body_parentid[bodies]
        ang_acc = d.cacc[:, pid, 2] + d.qacc[:, m.body_dofadr[bodies]]
        xang, omega = d.xang[:, bodies], d.cvel[:, bodies, 2]
        lin = d.cacc[:, pid, 3:] + m.body_length[bodies][None, :, None] * (
            ang_acc[..., None] * _perp(xang) - (omega ** 2)[..., None] * _dirs(xang))
        d.cacc[:, bodies] = torch.cat((torch.zeros_like(lin[..., :2]), ang_acc[..., None], lin), -1)


# --- sensor.py ------------------------------------------------------------------------------------------------------

def _write(m: Model, d: Data, adr: torch.Tensor, values: dict):
    """A sensor kernel: each sensor of the stage writes the value of its own type (scalars pad with zeros)."""
    sensortype, out = m.sensor_type[adr], torch.zeros(d.nworld, adr.numel(), 3, dtype=DTYPE, device=adr.device)
    for stype, value in values.items():
        out = torch.where((sensortype == stype)[None, :, None], value, out)
    d.sensordata[:, m.sensor_adr[adr]] = out


def _scalar(v):
    return torch.cat((v[..., None], torch.zeros(*v.shape, 2, dtype=DTYPE, device=v.device)), -1)


@event_scope
def sensor_pos(m: Model, d: Data):
    """Compute position-dependent sensor values."""
    if (m.sensor_pos_adr.numel() == 0) or (m.opt_disableflags & DisableBit.SENSOR):
        return
    objid = m.sensor_objid[m.sensor_pos_adr]
    _write(m, d, m.sensor_pos_adr, {
        SensorType.JOINTPOS: _scalar(d.qpos[:, objid.clamp(max=m.nv - 1)]),
        SensorType.SUBTREECOM: d.subtree_com[:, objid]})


@event_scope
def sensor_vel(m: Model, d: Data):
    """Compute velocity-dependent sensor values."""
    if (m.sensor_vel_adr.numel() == 0) or (m.opt_disableflags & DisableBit.SENSOR):
        return

    if _variant == "bug":
        # wp.array.numpy() of a device array: a synchronous device-to-host copy, every call
        if static(np.isin(m.sensor_type.cpu().numpy(), [SensorType.SUBTREELINVEL, SensorType.SUBTREEANGMOM]).any()):
            subtree_vel(m, d)
    elif m.sensor_subtree_vel:
        subtree_vel(m, d)

    objid = m.sensor_objid[m.sensor_vel_adr]
    _write(m, d, m.sensor_vel_adr, {
        SensorType.JOINTVEL: _scalar(d.qvel[:, objid.clamp(max=m.nv - 1)]),
        SensorType.SUBTREELINVEL: d.subtree_linvel[:, objid],
        SensorType.SUBTREEANGMOM: d.subtree_angmom[:, objid]})


@event_scope
def sensor_acc(m: Model, d: Data):
    """Compute acceleration-dependent sensor values."""
    if (m.sensor_acc_adr.numel() == 0) or (m.opt_disableflags & DisableBit.SENSOR):
        return

    if _variant == "bug":
        if static(np.isin(m.sensor_type.cpu().numpy(),
                          [SensorType.ACCELEROMETER, SensorType.FORCE, SensorType.TORQUE]).any()):
            rne_postconstraint(m, d)
    elif m.sensor_rne_postconstraint:
        rne_postconstraint(m, d)

    objid = m.sensor_objid[m.sensor_acc_adr]
    _write(m, d, m.sensor_acc_adr, {SensorType.ACCELEROMETER: d.cacc[:, objid, 3:]})


# --- forward.py -----------------------------------------------------------------------------------------------------

@event_scope
def fwd_position(m: Model, d: Data):
    kinematics(m, d)
    com_pos(m, d)
    crb(m, d)


@event_scope
def fwd_velocity(m: Model, d: Data):
    com_vel(m, d)
    passive(m, d)
    rne(m, d)


@event_scope
def fwd_acceleration(m: Model, d: Data):
    d.qfrc_smooth.copy_(d.qfrc_passive - d.qfrc_bias + d.qfrc_applied)
    d.qacc_smooth.copy_(d.qfrc_smooth / d.qM)                                  # solve_m, diagonal M


@event_scope
def forward(m: Model, d: Data):
    """Forward dynamics."""
    fwd_position(m, d)
    sensor_pos(m, d)
    fwd_velocity(m, d)
    sensor_vel(m, d)
    fwd_acceleration(m, d)
    sensor_acc(m, d)
    d.qacc.copy_(d.qacc_smooth)                                                # njmax == 0: wp.copy


def _advance(m: Model, d: Data, qacc: torch.Tensor):
    d.qvel.add_(qacc * m.opt_timestep)
    d.qpos.add_(d.qvel * m.opt_timestep)
    d.time.add_(m.opt_timestep)


@event_scope
def euler(m: Model, d: Data):
    """Euler integrator, semi-implicit in velocity; damping integrated implicitly (eulerdamp, diagonal here)."""
    if not m.opt_disableflags & DisableBit.EULERDAMP:
        d.qacc_integration.copy_(d.qfrc_smooth / (d.qM + m.opt_timestep * m.dof_damping))
        _advance(m, d, d.qacc_integration)
    else:
        _advance(m, d, d.qacc)


@event_scope
def step(m: Model, d: Data):
    """Advance simulation."""
    forward(m, d)
    euler(m, d)


# --- the caller: test_util.benchmark / viewer.py's pattern ----------------------------------------------------------

def _rollout(device: str, use_graph: bool):
    gen = generator(190)
    qpos0 = torch.randn(NWORLD, 4, generator=gen, dtype=DTYPE) * 0.6
    applied = [torch.randn(NWORLD, 4, generator=gen, dtype=DTYPE) * 0.8 for _ in range(NSTEP + 1)]
    m = put_model(MjModel(), device)
    d = put_data(m, device, qpos0)
    take = lambda: [d.sensordata.clone(), d.qpos.clone(), d.qvel.clone()]
    outs = []
    d.qfrc_applied.copy_(applied[0].to(device))
    if not use_graph:
        step(m, d)
        outs += take()
        for k in range(1, NSTEP + 1):
            d.qfrc_applied.copy_(applied[k].to(device))
            step(m, d)
            outs += take()
        return outs
    with events.warmup(real=True):                 # "jit" call: a real step, its state kept
        step(m, d)
    outs += take()
    state = {"qpos": d.qpos, "qvel": d.qvel, "qacc": d.qacc, "time": d.time}
    g, _ = capture(lambda: step(m, d), device=device, warmups=0, static={"qfrc_applied": d.qfrc_applied},
                   state=state, owner="mujoco_warp benchmark")
    for k in range(1, NSTEP + 1):
        d.qfrc_applied.copy_(applied[k].to(device))
        sensordata, qpos, qvel = replay(g, (d.sensordata, d.qpos, d.qvel))
        outs += [sensordata.clone(), qpos.clone(), qvel.clone()]
    return outs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: _rollout(device, True), lambda: _rollout(device, False))
