"""SolverVBD allocates its rigid contact-history buffers lazily in the first step, and when that step is the captured one the zero-fill becomes part of the graph: every replay wipes the warm-start history.

Upstream: https://github.com/newton-physics/newton/pull/3392 ("Require VBD contact history preallocation for CUDA
capture", commit ca2fe81707be4673a597454cc8c0b90bcfc0b4dc, merged 2026-07-08 on main), repo newton-physics/newton.
No separate issue.
Symptom: ``SolverVBD(rigid_contact_history=True)`` with the ``CollisionPipeline`` built *after* the solver (the old
``examples/cable/example_cable_pile.py``) and the first ``simulate()`` recorded in ``wp.ScopedCapture()``: there is
no error, but AVBD contact warm-starting is quietly off under the graph. Every ``wp.capture_launch`` starts its
contacts cold (lambda 0, no stick anchors), so the contacts sink deeper and the bodies settle on a different path
from the same example run without a graph. The CHANGELOG entry: "Raise an error when
``SolverVBD(rigid_contact_history=True)`` would allocate or grow contact-history buffers during CUDA graph
capture".
Mechanism: ``newton/_src/solvers/vbd/solver_vbd.py``. ``SolverVBD.__init__`` pre-allocates the body-body contact state
and the warm-start history only when ``model.rigid_contact_max`` is already known, and ``CollisionPipeline.__init__``
is what sets it. Built solver-first, ``_prev_contact_lambda`` (and ``_prev_contact_stick_flag``,
``_prev_contact_penalty_k``, ``_prev_contact_point0/1``, ``_prev_contact_offset0/1``, ``_prev_contact_normal``) stay
``None``. The first ``step()`` -> ``_initialize_rigid_bodies`` sees ``self._prev_contact_lambda is None`` and calls
``_init_rigid_contact_warmstart(history_required)``: eight ``wp.zeros(cap, ...)``. The only guard is
``_raise_if_capturing_resize``, which raises only when ``device.is_capturing and not wp.is_mempool_enabled(device)``.
With the mempool on (the default), the allocation comes from the graph's pool and its zero-fill is recorded as a
node. The same step then hands the buffers to ``init_body_body_contacts_avbd`` as a ``RigidContactHistory`` (to
restore lambda, penalty k and stick anchors through ``contacts.rigid_contact_match_index``), and
``_snapshot_rigid_contact_history`` writes the solved rows back at the end of the step. Eagerly, the zero-fill runs
once, on the first step. After that the history carries each step's solution to the next. Under the graph, each
replay first re-runs the recorded zero-fill and only then the init kernel. Warm-starting therefore still works
between the substeps of one frame, but every frame starts cold.
Doctor: warmup-divergence, at _initialize_rigid_bodies. The lazy ``is None`` allocation of the history was decided
during the capture, so the graph carries a one-time initialisation (the zero-fill) that replays repeat every frame,
while an eager step now skips it and reads last step's history. ``_initialize_rigid_bodies`` is the function that
made the allocation inside the capture, and it is where the fix adds its capture check.
Fix (upstream): at the top of ``_initialize_rigid_bodies``, ``if self.device.is_capturing and internal_rigid and
self.rigid_contact_history`` and the history is smaller than ``contacts.rigid_contact_max``: raise ``RuntimeError(
"SolverVBD contact history must be allocated before CUDA graph capture. ...")``, whether or not the mempool is
enabled. ``history_required = max(1, contact_launch_dim)`` becomes ``contact_launch_dim``, the restore is guarded by
``contact_launch_dim > 0``, and ``example_cable_pile.py`` now builds ``CollisionPipeline`` (and its ``Contacts``)
before ``SolverVBD``, so ``__init__`` pre-allocates the history ("Size persistent contact history before CUDA graph
capture"). The fix variant is that ordering together with the new check, which does not fire.
Modelled: five box bodies over a ground plane. Translations only: ``body_q`` is a position, with no rotation. Each
body has one contact candidate with the ground, so ``rigid_contact_max`` = bodies. ``CollisionPipeline.collide``
compacts the bodies within the contact margin to the front rows and fills ``rigid_contact_match_index`` by
``contact_matching="latest"``, finding the previous row with the same shape pair. As bodies land one after another,
rows move, so the match index is not the identity. ``SolverVBD`` keeps the upstream step structure:
``_initialize_rigid_bodies`` does the lazy allocations, ``init_body_body_contacts_avbd``,
``step_body_body_contact_C0_lambda`` and ``forward_step_rigid_bodies``. Then come ``iterations`` of
``_solve_rigid_body_iteration``, which is a per-body Newton step on the inertia and hard-contact energy followed by
``update_duals_body_body_contacts``. After that, ``_snapshot_rigid_contact_history`` and ``_finalize_rigid_bodies``
(BDF1 velocity). The default ``rigid_avbd_beta = 0`` (so the penalty is the material ``ke``), ``alpha = 0.95`` and
``gamma = 0.999`` are kept. Left out: particles, joints, Dahl friction, per-body contact lists and coloring, the
stick deadzone, and the world-reset mask. ``wp.zeros`` / ``wp.is_mempool_enabled`` / ``Device.is_capturing`` are
small stand-ins: ``torch.zeros``, mempool on, and the engine's ``is_capturing``. The example captures right after
construction, with no warm-up, and replays one graph per frame. Outputs: ``body_q`` after each frame.
"""
from __future__ import annotations

import torch

from workbench.engine import is_capturing
from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/newton-physics/newton/pull/3392"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "_initialize_rigid_bodies"
SYMPTOM = ("SolverVBD contact history lazily zero-allocated inside the first captured step; every graph replay "
           "re-zeroes it, so contact warm-starting is silently off and bodies drift from the eager run")

BODIES, FRAMES, SUBSTEPS, ITERATIONS = 5, 8, 4, 2
FRAME_DT = 1.0 / 60.0
GRAVITY = -10.0
HALF = 0.1                 # box half height
CONTACT_MARGIN = 0.02      # gap below which collide() reports a contact
_STICK_FLAG_ANCHOR, _STICK_FLAG_DEADZONE = 1, 2


# --- warp stand-ins -----------------------------------------------------------------------------------

class Device:
    def __init__(self, name):
        self.name = name

    @property
    def is_capturing(self) -> bool:          # wp.Device.is_capturing: a stream capture is open
        return is_capturing()


class wp:  # noqa: N801 - the module name the upstream code uses
    vec3, int32, float32 = "vec3", torch.int32, torch.float32

    @staticmethod
    def zeros(n, dtype, device):
        """wp.zeros: an allocation (from the graph's pool while capturing, with the mempool on) plus a memset."""
        if dtype == "vec3":
            return torch.zeros(n, 3, device=device.name)
        return torch.zeros(n, dtype=dtype, device=device.name)

    @staticmethod
    def is_mempool_enabled(device) -> bool:
        return True                          # Warp's default on CUDA devices that support it


# --- newton: Model, State, Contacts, CollisionPipeline ------------------------------------------------

class Model:
    def __init__(self, device):
        gen = generator(3392)
        self.device = device
        self.body_count = BODIES
        self.shape_count = BODIES + 1                                  # one box per body + the ground plane
        self.ground_shape = BODIES
        self.shape_body = torch.tensor(list(range(BODIES)) + [-1], dtype=torch.int32, device=device)
        self.body_mass = (1.0 + torch.rand(BODIES, generator=gen)).to(device)
        self.shape_material_ke = (2.0e4 * (1.0 + torch.rand(BODIES + 1, generator=gen))).to(device)
        self.shape_material_kd = torch.zeros(BODIES + 1, device=device)
        self.shape_material_mu = torch.full((BODIES + 1,), 0.5, device=device)
        gap = torch.tensor([0.0, 0.004, 0.012, 0.025, 0.04])           # bodies land one after another
        xy = torch.randn(BODIES, 2, generator=gen)
        self.body_q0 = torch.cat([xy, (HALF + gap).unsqueeze(1)], 1).to(device)
        self.gravity = torch.tensor([0.0, 0.0, GRAVITY], device=device)
        self.rigid_contact_max = 0                                     # set by CollisionPipeline

    def state(self):
        return State(self)

    def contacts(self, collision_pipeline):
        return collision_pipeline.contacts()

    def collide(self, state, contacts):
        contacts.pipeline.collide(state, contacts)


class State:
    def __init__(self, model):
        self.body_q = model.body_q0.clone()
        self.body_qd = torch.zeros(BODIES, 3, device=model.device)


class Contacts:
    def __init__(self, rigid_contact_max, device, matching):
        n = rigid_contact_max
        self.rigid_contact_max = n
        self.rigid_contact_count = torch.zeros(1, dtype=torch.int32, device=device)
        self.rigid_contact_shape0 = torch.full((n,), -1, dtype=torch.int32, device=device)
        self.rigid_contact_shape1 = torch.full((n,), -1, dtype=torch.int32, device=device)
        self.rigid_contact_point0 = torch.zeros(n, 3, device=device)
        self.rigid_contact_point1 = torch.zeros(n, 3, device=device)
        self.rigid_contact_offset0 = torch.zeros(n, 3, device=device)
        self.rigid_contact_offset1 = torch.zeros(n, 3, device=device)
        self.rigid_contact_normal = torch.zeros(n, 3, device=device)
        self.rigid_contact_margin0 = torch.zeros(n, device=device)
        self.rigid_contact_margin1 = torch.zeros(n, device=device)
        self.rigid_contact_match_index = (torch.full((n,), -1, dtype=torch.int32, device=device)
                                          if matching else None)
        self.pipeline = None


class CollisionPipeline:
    def __init__(self, model, rigid_contact_max=None, contact_matching="latest"):
        self.model = model
        if rigid_contact_max is None:
            rigid_contact_max = model.body_count                       # _estimate_rigid_contact_max: body-ground pairs
        self._rigid_contact_max = rigid_contact_max
        model.rigid_contact_max = rigid_contact_max                    # what SolverVBD.__init__ sizes from
        self.contact_matching = contact_matching
        # pair keys of the previous collide(), for contact_matching="latest"
        self._prev_pair_key = torch.full((rigid_contact_max,), -1, dtype=torch.long, device=model.device)
        self._up = torch.tensor([0.0, 0.0, 1.0], device=model.device)                # ground normal
        self._box_bottom = torch.tensor([0.0, 0.0, -HALF], device=model.device)      # box-local contact point
        self._plane_xy = torch.tensor([1.0, 1.0, 0.0], device=model.device)

    def contacts(self):
        c = Contacts(self._rigid_contact_max, self.model.device, self.contact_matching is not None)
        c.pipeline = self
        return c

    def collide(self, state, contacts):
        model, n = self.model, contacts.rigid_contact_max
        z_bottom = state.body_q[:, 2] - HALF
        near = z_bottom < CONTACT_MARGIN
        order = torch.argsort((~near).to(torch.int32), stable=True)[:n]            # near bodies first
        count = near.sum().to(torch.int32)
        valid = torch.arange(n, device=model.device) < count
        minus1 = torch.full((n,), -1, dtype=torch.int32, device=model.device)
        shape0 = torch.where(valid, order.to(torch.int32), minus1)                  # body b owns shape b
        shape1 = torch.where(valid, torch.full_like(minus1, model.ground_shape), minus1)
        contacts.rigid_contact_count.copy_(count.reshape(1))
        contacts.rigid_contact_shape0.copy_(shape0)
        contacts.rigid_contact_shape1.copy_(shape1)
        contacts.rigid_contact_normal.copy_(self._up.expand(n, 3))
        contacts.rigid_contact_point0.copy_(self._box_bottom.expand(n, 3))
        ground_pt = state.body_q[order] * self._plane_xy
        contacts.rigid_contact_point1.copy_(ground_pt)
        contacts.rigid_contact_offset0.zero_()
        contacts.rigid_contact_offset1.zero_()
        if contacts.rigid_contact_match_index is not None:
            key = torch.where(valid, shape0.long() * model.shape_count + shape1.long(), torch.full_like(order, -1))
            eq = (key[:, None] == self._prev_pair_key[None, :]) & (key[:, None] >= 0)
            match = torch.where(eq.any(1), eq.to(torch.float32).argmax(1), torch.full_like(order, -1))
            contacts.rigid_contact_match_index.copy_(match.to(torch.int32))
            self._prev_pair_key.copy_(key)


# --- newton/_src/solvers/vbd/rigid_vbd_kernels.py -----------------------------------------------------

class RigidContactHistory:
    lambda_ = stick_flag = penalty_k = point0 = point1 = offset0 = offset1 = normal = None


def _rows(contacts, n):
    return torch.arange(n, device=contacts.rigid_contact_count.device) < contacts.rigid_contact_count


def _contact_separation(model, body_q, contacts, n):
    """-C_n: signed distance along the normal between the two contact points (ground point is world)."""
    b0 = model.shape_body[contacts.rigid_contact_shape0[:n].clamp(min=0).long()].long()
    p0 = body_q[b0] + contacts.rigid_contact_point0[:n]
    p1 = contacts.rigid_contact_point1[:n]
    nrm = contacts.rigid_contact_normal[:n]
    sep = ((p0 - p1) * nrm).sum(1) - contacts.rigid_contact_margin0[:n] - contacts.rigid_contact_margin1[:n]
    return sep, b0


def init_body_body_contacts_avbd(model, contacts, n, hard_contacts, history, k_start, penalty_k, lam,
                                 material_kd, material_mu, material_ke):
    """Restore contact state from history through match_index; unmatched contacts cold-start."""
    rows = _rows(contacts, n)
    s0 = contacts.rigid_contact_shape0[:n].clamp(min=0).long()
    s1 = contacts.rigid_contact_shape1[:n].clamp(min=0).long()
    avg_ke = 0.5 * (model.shape_material_ke[s0] + model.shape_material_ke[s1])
    avg_kd = 0.5 * (model.shape_material_kd[s0] + model.shape_material_kd[s1])
    avg_mu = torch.sqrt(model.shape_material_mu[s0] * model.shape_material_mu[s1])
    material_ke[:n].copy_(torch.where(rows, avg_ke, material_ke[:n]))
    material_kd[:n].copy_(torch.where(rows, avg_kd, material_kd[:n]))
    material_mu[:n].copy_(torch.where(rows, avg_mu, material_mu[:n]))
    k_floor = avg_ke if k_start < 0.0 else avg_ke.clamp(max=k_start)
    slot = contacts.rigid_contact_match_index[:n].long()
    matched = rows & (slot >= 0)
    sl = slot.clamp(min=0)
    k_hist = torch.minimum(torch.maximum(history.penalty_k[sl], k_floor), avg_ke)
    penalty_k[:n].copy_(torch.where(matched, k_hist, torch.where(rows, k_floor, penalty_k[:n])))
    n_new = contacts.rigid_contact_normal[:n]
    lam_hist, n_old = history.lambda_[sl], history.normal[sl]
    lam_n = (lam_hist * n_old).sum(1, keepdim=True)
    lam_t_old = lam_hist - n_old * lam_n
    lam_t_new = lam_t_old - n_new * (lam_t_old * n_new).sum(1, keepdim=True)
    lam_restored = n_new * lam_n + lam_t_new if hard_contacts else torch.zeros_like(lam_hist)
    lam[:n].copy_(torch.where(matched[:, None], lam_restored,
                              torch.where(rows[:, None], torch.zeros_like(lam_hist), lam[:n])))
    if hard_contacts:
        flag = history.stick_flag[sl]
        sticky = (matched & ((flag == _STICK_FLAG_ANCHOR) | (flag == _STICK_FLAG_DEADZONE)))[:, None]
        for dst, src in ((contacts.rigid_contact_point0, history.point0),
                         (contacts.rigid_contact_point1, history.point1),
                         (contacts.rigid_contact_offset0, history.offset0),
                         (contacts.rigid_contact_offset1, history.offset1)):
            dst[:n].copy_(torch.where(sticky, src[sl], dst[:n]))


def init_body_body_contact_materials(model, contacts, n, k_start, penalty_k, material_kd, material_mu,
                                     material_ke):
    rows = _rows(contacts, n)
    s0 = contacts.rigid_contact_shape0[:n].clamp(min=0).long()
    s1 = contacts.rigid_contact_shape1[:n].clamp(min=0).long()
    avg_ke = 0.5 * (model.shape_material_ke[s0] + model.shape_material_ke[s1])
    material_ke[:n].copy_(torch.where(rows, avg_ke, material_ke[:n]))
    material_kd[:n].copy_(torch.where(rows, 0.5 * (model.shape_material_kd[s0] + model.shape_material_kd[s1]),
                                      material_kd[:n]))
    material_mu[:n].copy_(torch.where(rows, torch.sqrt(model.shape_material_mu[s0] * model.shape_material_mu[s1]),
                                      material_mu[:n]))
    k_floor = avg_ke if k_start < 0.0 else avg_ke.clamp(max=k_start)
    penalty_k[:n].copy_(torch.where(rows, k_floor, penalty_k[:n]))


def step_body_body_contact_C0_lambda(model, contacts, n, body_q, hard_contacts, lambda_decay, penalty_decay,
                                     material_ke, k_start, penalty_k, C0, lam):
    """Per-step k decay + lambda decay + C0 snapshot (body_q is still the collide frame)."""
    rows = _rows(contacts, n)
    ke = material_ke[:n]
    k_min = ke if k_start < 0.0 else ke.clamp(max=k_start)
    penalty_k[:n].copy_(torch.where(rows, torch.minimum(torch.maximum(penalty_decay * penalty_k[:n], k_min), ke),
                                    penalty_k[:n]))
    lam[:n].copy_(torch.where(rows[:, None], lam[:n] * lambda_decay, lam[:n]))
    if hard_contacts:
        sep, _ = _contact_separation(model, body_q, contacts, n)
        C0_n = -sep
        C0[:n].copy_(torch.where(rows[:, None], contacts.rigid_contact_normal[:n] * C0_n[:, None], C0[:n]))


def forward_step_rigid_bodies(dt, gravity, body_q, body_qd, body_q_prev, body_inertia_q):
    body_q_prev.copy_(body_q)
    body_inertia_q.copy_(body_q + dt * body_qd + dt * dt * gravity)
    body_q.copy_(body_inertia_q)                      # in place: the iterate starts at the inertial target


def solve_rigid_body_avbd(model, contacts, n, dt, body_q, body_inertia_q, alpha, penalty_k, C0, lam):
    """One primal pass: per-body Newton step on inertia + hard-contact energy (diagonal Hessian)."""
    rows = _rows(contacts, n)
    sep, b0 = _contact_separation(model, body_q, contacts, n)
    C_raw = -sep
    nrm = contacts.rigid_contact_normal[:n]
    C_stab = torch.where(C_raw < 0, C_raw, C_raw - alpha * (nrm * C0[:n]).sum(1))
    lam_n = (lam[:n] * nrm).sum(1)
    f_n = (penalty_k[:n] * C_stab + lam_n).clamp(min=0.0)
    active = rows & (f_n > 0)
    f = torch.where(active[:, None], nrm * f_n[:, None], torch.zeros_like(nrm))
    h = torch.where(active[:, None], nrm * nrm * penalty_k[:n, None], torch.zeros_like(nrm))
    body = torch.where(rows, b0, torch.full_like(b0, BODIES))                  # invalid rows -> dropped slot
    force = torch.zeros(BODIES + 1, 3, device=body_q.device).index_add_(0, body, f)[:BODIES]
    hess = torch.zeros(BODIES + 1, 3, device=body_q.device).index_add_(0, body, h)[:BODIES]
    m_dt2 = (model.body_mass / (dt * dt))[:, None]
    grad = m_dt2 * (body_q - body_inertia_q) - force
    body_q.sub_(grad / (m_dt2 + hess))


def update_duals_body_body_contacts(model, contacts, n, body_q, body_q_prev, material_mu, C0, alpha,
                                    stick_motion_eps, hard_contacts, material_ke, beta, penalty_k, lam, stick_flag):
    rows = _rows(contacts, n)
    sep, b0 = _contact_separation(model, body_q, contacts, n)
    C_n_raw = -sep
    nrm = contacts.rigid_contact_normal[:n]
    if hard_contacts:
        k = penalty_k[:n]
        C0_n = (nrm * C0[:n]).sum(1)
        C_stab_n = torch.where(C_n_raw < 0, C_n_raw, C_n_raw - alpha * C0_n)
        lam_n_old = (lam[:n] * nrm).sum(1)
        lam_n_new = (lam_n_old + k * C_stab_n).clamp(min=0.0)
        anchor = contacts.rigid_contact_point0[:n] + contacts.rigid_contact_offset0[:n]
        rel = (body_q[b0] + anchor) - (body_q_prev[b0] + anchor)                  # ground anchor does not move
        t_disp = rel - nrm * (nrm * rel).sum(1, keepdim=True)
        C0_t = C0[:n] - nrm * C0_n[:, None]
        lam_t_old = lam[:n] - nrm * lam_n_old[:, None]
        t_res = t_disp + (1.0 - alpha) * C0_t
        lam_t_new = lam_t_old + k[:, None] * t_res
        lam_t_len = lam_t_new.norm(dim=1)
        cone = material_mu[:n] * lam_n_new
        scale = torch.where((lam_t_len > cone) & (lam_t_len > 0), cone / lam_t_len.clamp(min=1e-30),
                            torch.ones_like(cone))
        lam_t_new = lam_t_new * scale[:, None]
        lam[:n].copy_(torch.where(rows[:, None], nrm * lam_n_new[:, None] + lam_t_new, lam[:n]))
        sticks = (lam_n_new > 0) & (lam_t_len <= cone) & (t_res.norm(dim=1) < stick_motion_eps)
        flag = torch.where(sticks, torch.full_like(stick_flag[:n], _STICK_FLAG_ANCHOR),
                           torch.zeros_like(stick_flag[:n]))
        stick_flag[:n].copy_(torch.where(rows, flag, stick_flag[:n]))
    ramp = torch.where(C_n_raw > 0, torch.minimum(material_ke[:n], penalty_k[:n] + beta * C_n_raw), penalty_k[:n])
    penalty_k[:n].copy_(torch.where(rows, ramp, penalty_k[:n]))


def snapshot_body_body_contact_history(contacts, n, lam, stick_flag, penalty_k, prev):
    rows = _rows(contacts, n)
    r3 = rows[:, None]
    prev.lambda_[:n].copy_(torch.where(r3, lam[:n], prev.lambda_[:n]))
    prev.stick_flag[:n].copy_(torch.where(rows, stick_flag[:n], prev.stick_flag[:n]))
    prev.penalty_k[:n].copy_(torch.where(rows, penalty_k[:n], prev.penalty_k[:n]))
    prev.point0[:n].copy_(torch.where(r3, contacts.rigid_contact_point0[:n], prev.point0[:n]))
    prev.point1[:n].copy_(torch.where(r3, contacts.rigid_contact_point1[:n], prev.point1[:n]))
    prev.offset0[:n].copy_(torch.where(r3, contacts.rigid_contact_offset0[:n], prev.offset0[:n]))
    prev.offset1[:n].copy_(torch.where(r3, contacts.rigid_contact_offset1[:n], prev.offset1[:n]))
    prev.normal[:n].copy_(torch.where(r3, contacts.rigid_contact_normal[:n], prev.normal[:n]))


def update_body_velocity(dt, body_q, body_q_prev, state_out):
    state_out.body_qd.copy_((body_q - body_q_prev) / dt)
    state_out.body_q.copy_(body_q)


# --- newton/_src/solvers/vbd/solver_vbd.py ------------------------------------------------------------

class SolverVBD:
    def __init__(self, model, variant, iterations=ITERATIONS, rigid_contact_history=False,
                 rigid_avbd_beta=0.0, rigid_avbd_gamma=0.999, rigid_avbd_alpha=0.95, rigid_contact_hard=True,
                 rigid_contact_stick_motion_eps=1.0e-4, rigid_contact_k_start=1.0e2):
        self.model, self.variant = model, variant
        self.device = Device(model.device)
        self.iterations = iterations
        self.rigid_contact_history = rigid_contact_history
        self.integrate_with_external_rigid_solver = False
        self.rigid_avbd_beta = rigid_avbd_beta
        self.rigid_avbd_gamma = rigid_avbd_gamma
        self.rigid_contact_alpha = rigid_avbd_alpha
        self.rigid_contact_hard = int(rigid_contact_hard)
        self.rigid_contact_stick_motion_eps = rigid_contact_stick_motion_eps
        self.rigid_contact_k_start_value = -1.0 if rigid_avbd_beta == 0.0 else float(rigid_contact_k_start)
        self._update_rigid_history = True
        self.body_q_prev = torch.zeros(model.body_count, 3, device=model.device)
        self.body_inertia_q = torch.zeros(model.body_count, 3, device=model.device)

        # Body-body contact state (pre-allocated in __init__ when possible, resized on first step otherwise).
        self._init_body_body_contact_state(0)
        # Rigid contact warm-start buffers.
        self._prev_contact_lambda = None
        self._prev_contact_stick_flag = None
        self._prev_contact_penalty_k = None
        self._prev_contact_point0 = None
        self._prev_contact_point1 = None
        self._prev_contact_offset0 = None
        self._prev_contact_offset1 = None
        self._prev_contact_normal = None

        # Pre-allocate body-body contact buffers when the contact capacity is
        # already known; otherwise lazy allocation handles the first step.
        rcm = getattr(model, "rigid_contact_max", 0) or 0
        if rcm > 0 and model.body_count > 0 and not self.integrate_with_external_rigid_solver:
            self._init_body_body_contact_state(rcm)
            if self.rigid_contact_history:
                self._init_rigid_contact_warmstart(rcm)

    def _init_body_body_contact_state(self, rigid_contact_max):
        d = self.device
        self.body_body_contact_penalty_k = wp.zeros(rigid_contact_max, dtype=wp.float32, device=d)
        self.body_body_contact_material_ke = wp.zeros(rigid_contact_max, dtype=wp.float32, device=d)
        self.body_body_contact_material_kd = wp.zeros(rigid_contact_max, dtype=wp.float32, device=d)
        self.body_body_contact_material_mu = wp.zeros(rigid_contact_max, dtype=wp.float32, device=d)
        self.body_body_contact_lambda = wp.zeros(rigid_contact_max, dtype=wp.vec3, device=d)
        self.body_body_contact_C0 = wp.zeros(rigid_contact_max, dtype=wp.vec3, device=d)
        self.body_body_contact_stick_flag = wp.zeros(rigid_contact_max, dtype=wp.int32, device=d)

    def _init_rigid_contact_warmstart(self, rigid_contact_max):
        """Allocate rigid contact warm-start buffers."""
        cap = max(1, rigid_contact_max)
        d = self.device
        self._prev_contact_lambda = wp.zeros(cap, dtype=wp.vec3, device=d)
        self._prev_contact_stick_flag = wp.zeros(cap, dtype=wp.int32, device=d)
        self._prev_contact_penalty_k = wp.zeros(cap, dtype=wp.float32, device=d)
        self._prev_contact_point0 = wp.zeros(cap, dtype=wp.vec3, device=d)
        self._prev_contact_point1 = wp.zeros(cap, dtype=wp.vec3, device=d)
        self._prev_contact_offset0 = wp.zeros(cap, dtype=wp.vec3, device=d)
        self._prev_contact_offset1 = wp.zeros(cap, dtype=wp.vec3, device=d)
        self._prev_contact_normal = wp.zeros(cap, dtype=wp.vec3, device=d)

    def _raise_if_capturing_resize(self, name, current, required):
        if self.device.is_capturing and not wp.is_mempool_enabled(self.device):
            raise RuntimeError(
                f"SolverVBD {name} buffer needs to grow from {current} to {required} "
                "during CUDA graph capture, but Warp mempool is disabled. "
                "Pre-size before capture by constructing CollisionPipeline before SolverVBD.")

    def _history(self):
        history = RigidContactHistory()
        history.lambda_ = self._prev_contact_lambda
        history.stick_flag = self._prev_contact_stick_flag
        history.penalty_k = self._prev_contact_penalty_k
        history.point0 = self._prev_contact_point0
        history.point1 = self._prev_contact_point1
        history.offset0 = self._prev_contact_offset0
        history.offset1 = self._prev_contact_offset1
        history.normal = self._prev_contact_normal
        return history

    def step(self, state_in, state_out, control, contacts, dt):
        update_rigid = self._update_rigid_history
        self._update_rigid_history = True
        self._initialize_rigid_bodies(state_in, control, contacts, dt, update_rigid)
        for _ in range(self.iterations):
            self._solve_rigid_body_iteration(state_in, state_out, control, contacts, dt)
        # Snapshot solved rigid contact state for next-frame warm-start.
        self._snapshot_rigid_contact_history(contacts)
        self._finalize_rigid_bodies(state_in, state_out, dt)

    def _initialize_rigid_bodies(self, state_in, control, contacts, dt, refresh):
        model = self.model
        internal_rigid = model.body_count > 0 and not self.integrate_with_external_rigid_solver
        rigid_capacity = contacts.rigid_contact_max if contacts is not None else 0

        if self.variant == "fix":
            if self.device.is_capturing and internal_rigid and self.rigid_contact_history:
                history_capacity = 0 if self._prev_contact_lambda is None else self._prev_contact_lambda.shape[0]
                if history_capacity < rigid_capacity:
                    raise RuntimeError(
                        "SolverVBD contact history must be allocated before CUDA graph capture. "
                        "Construct CollisionPipeline before SolverVBD, or run one uncaptured solver step before "
                        "capture.")

        if not internal_rigid:
            return
        if (not refresh and contacts is not None and contacts.rigid_contact_max > 0
                and self.body_body_contact_penalty_k.shape[0] < contacts.rigid_contact_max):
            refresh = True

        if refresh and contacts is not None:
            contact_launch_dim = contacts.rigid_contact_max
            if self.body_body_contact_penalty_k.shape[0] < contact_launch_dim:
                self._raise_if_capturing_resize("body-body contact state", self.body_body_contact_penalty_k.shape[0],
                                                contact_launch_dim)
                self._init_body_body_contact_state(contact_launch_dim)

            restore = self.rigid_contact_history and (self.variant == "bug" or contact_launch_dim > 0)
            if restore:
                if contacts.rigid_contact_match_index is None:
                    raise RuntimeError("SolverVBD(rigid_contact_history=True) requires Contacts with "
                                       "rigid_contact_match_index populated.")
                history_required = max(1, contact_launch_dim) if self.variant == "bug" else contact_launch_dim
                if self._prev_contact_lambda is None or self._prev_contact_lambda.shape[0] < history_required:
                    history_cap = 0 if self._prev_contact_lambda is None else self._prev_contact_lambda.shape[0]
                    self._raise_if_capturing_resize("rigid contact history", history_cap, history_required)
                    # the lazy allocation: inside the capture when the first step is the captured one
                    self._init_rigid_contact_warmstart(history_required)

                init_body_body_contacts_avbd(
                    model, contacts, contact_launch_dim, self.rigid_contact_hard, self._history(),
                    self.rigid_contact_k_start_value, self.body_body_contact_penalty_k, self.body_body_contact_lambda,
                    self.body_body_contact_material_kd, self.body_body_contact_material_mu,
                    self.body_body_contact_material_ke)
            elif self.variant == "bug" or not self.rigid_contact_history:
                init_body_body_contact_materials(
                    model, contacts, contact_launch_dim, self.rigid_contact_k_start_value,
                    self.body_body_contact_penalty_k, self.body_body_contact_material_kd,
                    self.body_body_contact_material_mu, self.body_body_contact_material_ke)
                self.body_body_contact_lambda.zero_()

        # Per-step k decay + lambda decay + C0 (body_q is still collide frame here).
        if contacts is not None and contacts.rigid_contact_max > 0:
            lambda_decay = (self.rigid_contact_alpha * self.rigid_avbd_gamma
                            if (self.rigid_contact_hard and (self.rigid_contact_history or not refresh)) else 0.0)
            step_body_body_contact_C0_lambda(
                model, contacts, contacts.rigid_contact_max, state_in.body_q, self.rigid_contact_hard, lambda_decay,
                self.rigid_avbd_gamma, self.body_body_contact_material_ke, self.rigid_contact_k_start_value,
                self.body_body_contact_penalty_k, self.body_body_contact_C0, self.body_body_contact_lambda)
            self.body_body_contact_stick_flag.zero_()

        forward_step_rigid_bodies(dt, model.gravity, state_in.body_q, state_in.body_qd, self.body_q_prev,
                                  self.body_inertia_q)

    def _solve_rigid_body_iteration(self, state_in, state_out, control, contacts, dt):
        if contacts is None or contacts.rigid_contact_max == 0:
            return
        n = contacts.rigid_contact_max
        solve_rigid_body_avbd(self.model, contacts, n, dt, state_in.body_q, self.body_inertia_q,
                              self.rigid_contact_alpha, self.body_body_contact_penalty_k, self.body_body_contact_C0,
                              self.body_body_contact_lambda)
        update_duals_body_body_contacts(
            self.model, contacts, n, state_in.body_q, self.body_q_prev, self.body_body_contact_material_mu,
            self.body_body_contact_C0, self.rigid_contact_alpha, self.rigid_contact_stick_motion_eps,
            self.rigid_contact_hard, self.body_body_contact_material_ke, self.rigid_avbd_beta,
            self.body_body_contact_penalty_k, self.body_body_contact_lambda, self.body_body_contact_stick_flag)

    def _snapshot_rigid_contact_history(self, contacts):
        """Write solved contact state for next frame's match-index warm-start."""
        if not self.rigid_contact_history or contacts is None:
            return
        if self.model.body_count == 0 or self.integrate_with_external_rigid_solver:
            return
        contact_launch_dim = contacts.rigid_contact_max
        if contact_launch_dim == 0:
            return
        if self._prev_contact_lambda is None or self._prev_contact_lambda.shape[0] < contact_launch_dim:
            history_cap = 0 if self._prev_contact_lambda is None else self._prev_contact_lambda.shape[0]
            self._raise_if_capturing_resize("rigid contact history", history_cap, contact_launch_dim)
            self._init_rigid_contact_warmstart(contact_launch_dim)
        snapshot_body_body_contact_history(contacts, contact_launch_dim, self.body_body_contact_lambda,
                                           self.body_body_contact_stick_flag, self.body_body_contact_penalty_k,
                                           self._history())

    def _finalize_rigid_bodies(self, state_in, state_out, dt):
        update_body_velocity(dt, state_in.body_q, self.body_q_prev, state_out)


# --- examples/cable/example_cable_pile.py (reduced to a box pile) --------------------------------------

class Example:
    def __init__(self, device, variant, use_graph):
        self.sim_substeps = SUBSTEPS
        self.sim_dt = FRAME_DT / SUBSTEPS
        self.model = Model(device)
        if variant == "fix":
            # Size persistent contact history before CUDA graph capture.
            pipeline = CollisionPipeline(self.model, contact_matching="latest")
            self.contacts = self.model.contacts(collision_pipeline=pipeline)
        self.solver = SolverVBD(self.model, variant, iterations=ITERATIONS, rigid_contact_history=True)
        self.state_0 = self.model.state()
        self.state_1 = self.model.state()
        self.control = None
        if variant == "bug":
            pipeline = CollisionPipeline(self.model, contact_matching="latest")
            self.contacts = self.model.contacts(collision_pipeline=pipeline)
        self.pipeline = pipeline
        self.graph = None
        if use_graph:
            self.capture()

    def capture(self):
        """with wp.ScopedCapture() as cap: self.simulate(), right after construction."""
        persistent = {"state_0.body_q": self.state_0.body_q, "state_0.body_qd": self.state_0.body_qd,
                      "state_1.body_q": self.state_1.body_q, "state_1.body_qd": self.state_1.body_qd,
                      "CollisionPipeline._prev_pair_key": self.pipeline._prev_pair_key}
        self.graph, _ = capture(self.simulate, device=self.model.device, warmups=0, name="example_cable_pile",
                                owner="example_cable_pile", state=persistent)

    def simulate(self):
        for _substep in range(self.sim_substeps):
            self.model.collide(self.state_0, self.contacts)
            self.solver.step(self.state_0, self.state_1, self.control, self.contacts, self.sim_dt)
            self.state_0, self.state_1 = self.state_1, self.state_0
        return self.state_0.body_q

    def step(self):
        if self.graph is not None:
            return replay(self.graph, self.state_0.body_q)               # wp.capture_launch(self.graph)
        return self.simulate()


def run(variant: str, device: str = "cpu"):
    def frames(use_graph):
        example = Example(device, variant, use_graph)
        return [example.step().clone() for _ in range(FRAMES)]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: frames(True), lambda: frames(False))
