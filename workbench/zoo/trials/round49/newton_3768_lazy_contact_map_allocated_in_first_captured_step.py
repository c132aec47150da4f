"""The captured first solver step lazily allocates the contact map: eager code reads graph memory holding nothing.

Upstream: https://github.com/newton-physics/newton/pull/3768 ("Fix external contact cache lifetime under CUDA
graphs", commit 348deba53 "Fix MuJoCo contact cache graph lifetime"; closes issue #3767 "Lazy contact cache does
not survive CUDA graph capture").
Symptom: with ``SolverMuJoCo(use_mujoco_contacts=False)`` and the first ``simulate()`` captured in
``wp.ScopedCapture``, ``solver._contact_tid_to_cid`` "still has a pointer and the expected shape, but reading it back
immediately segfaults" (exit 139 on ``cache.numpy()``); in Isaac Lab, nondeterministic NaN states. CHANGELOG: "Fix
``SolverMuJoCo`` retaining an invalid external-contact cache when its first step is captured in a CUDA graph".
Mechanism: ``__init__`` pre-allocates ``_last_contact_generation`` and ``_last_nacon_count`` (the earlier #2678
fix) but leaves ``_contact_tid_to_cid = None``. ``_convert_contacts_to_mjwarp`` (run by ``step``) does
``needs_realloc = self._contact_tid_to_cid is None or ...`` and then ``self._contact_tid_to_cid = wp.full(
launch_dim, -1)``. When the first step is the captured one, that allocation and its -1 fill are made inside the
capture: the buffer is the graph's memory, and the capture computes nothing, so until the graph is launched it
holds no mapping at all (on CUDA unbacked/uninitialised memory; here the engine's poison). The solver keeps the
attribute as if it were an ordinary persistent, initialised cache, and eager code outside the graph (the issue's
``cache.numpy()`` right after capture) reads it. Without graphs the same first step allocates an initialised
buffer. The replayed frames themselves match eager (each launch re-runs the recorded -1 fill and a full
pass); what goes wrong is the eager read between capture and the first launch, the issue's reproduction.
Modelled with bodies falling on a ground plane (one candidate contact per body), a tid->cid compaction kernel
with the full/fast paths of ``convert_newton_contacts_to_mjwarp_kernel``, and a penalty-contact step.
Doctor: warmup-divergence, at _convert_contacts_to_mjwarp (the lazy ``is None`` allocation of the contact map
was decided inside the capture, so the map is graph-owned and uninitialised outside replays, while eager code
treats it as the solver's persistent cache).
Fix (upstream): ``__init__`` allocates ``self._contact_tid_to_cid = wp.full(self.mjw_data.naconmax, -1)`` right
after ``_convert_to_mjc`` (GPU path with Newton contacts); the lazy branch only grows it if ``naconmax`` changes.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/newton-physics/newton/pull/3768"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "_convert_contacts_to_mjwarp"
SYMPTOM = "solver._contact_tid_to_cid read after the captured first step holds garbage instead of a valid cache"

BODIES, NACONMAX, SUBSTEPS, FRAMES = 6, 6, 2, 4
DT, KE, GRAVITY, MARGIN = 0.02, 400.0, -9.81, 0.05
_GENERATION_SENTINEL = -1


class Model:
    def __init__(self, device):
        gen = generator(3768)
        self.device = device
        self.body_count = BODIES
        self.shape_body = torch.arange(BODIES, device=device)          # one shape per body
        self.body_q0 = (randn(BODIES, gen=gen, device="cpu", scale=0.03).abs() + 0.02).to(device)
        self.shape_material_ke = (KE * (1.0 + randn(BODIES, gen=gen, device="cpu", scale=0.1).abs())).to(device)


class State:
    def __init__(self, model):
        self.body_q = model.body_q0.clone()
        self.body_qd = torch.zeros(BODIES, device=model.device)


class Contacts:
    """Newton's contact buffer: ``rigid_contact_max`` candidate slots, a count, and a generation counter."""

    def __init__(self, device):
        self.rigid_contact_max = BODIES
        self.rigid_contact_count = torch.zeros(1, dtype=torch.int32, device=device)
        self.rigid_contact_shape0 = torch.full((BODIES,), -1, dtype=torch.int32, device=device)
        self.contact_generation = torch.zeros(1, dtype=torch.int32, device=device)


def collide(model, state, contacts):
    """CollisionPipeline.collide: shapes within MARGIN of the ground, compacted to the front; bumps the generation."""
    near = state.body_q < MARGIN
    order = torch.argsort((~near).to(torch.int32), stable=True).to(torch.int32)
    contacts.rigid_contact_shape0.copy_(torch.where(near[order.long()], order, torch.full_like(order, -1)))
    contacts.rigid_contact_count.copy_(near.sum().to(torch.int32).reshape(1))
    contacts.contact_generation.add_(1)


class MjwData:
    def __init__(self, device):
        self.naconmax = NACONMAX
        self.nacon = torch.zeros(1, dtype=torch.int32, device=device)
        self.contact_dist = torch.zeros(NACONMAX, device=device)
        self.contact_body = torch.zeros(NACONMAX, dtype=torch.long, device=device)
        self.contact_ke = torch.zeros(NACONMAX, device=device)    # a field only the full path writes


class SolverMuJoCo:
    def __init__(self, model, variant, use_mujoco_cpu=False, use_mujoco_contacts=False):
        self.model = model
        self._contact_tid_to_cid = None
        self._last_contact_generation = torch.full((1,), _GENERATION_SENTINEL, dtype=torch.int32, device=model.device)
        self._last_nacon_count = torch.zeros(1, dtype=torch.int32, device=model.device)
        self._last_contacts_id = self._last_rigid_contact_max = self._last_naconmax = None
        self.mjw_data = MjwData(model.device)                      # _convert_to_mjc
        if variant == "fix" and not use_mujoco_cpu and not use_mujoco_contacts:
            self._contact_tid_to_cid = torch.full((self.mjw_data.naconmax,), -1, dtype=torch.int32,
                                                  device=model.device)

    def _invalidate_contact_fast_path(self):
        self._last_contact_generation.fill_(_GENERATION_SENTINEL)
        self._last_nacon_count.zero_()

    def _convert_contacts_to_mjwarp(self, model, state_in, contacts):
        naconmax = self.mjw_data.naconmax
        launch_dim = min(contacts.rigid_contact_max, naconmax)
        contacts_id = id(contacts.contact_generation)
        needs_realloc = self._contact_tid_to_cid is None or self._contact_tid_to_cid.shape[0] < launch_dim
        contacts_changed = (self._last_contacts_id != contacts_id
                            or self._last_rigid_contact_max != contacts.rigid_contact_max
                            or self._last_naconmax != naconmax)
        if needs_realloc or contacts_changed:
            if needs_realloc:
                # the lazy allocation: inside the capture when the first step is the captured one
                self._contact_tid_to_cid = torch.full((launch_dim,), -1, dtype=torch.int32, device=model.device)
            self._invalidate_contact_fast_path()
            self._last_contacts_id = contacts_id
            self._last_rigid_contact_max = contacts.rigid_contact_max
            self._last_naconmax = naconmax
        self.mjw_data.nacon.zero_()
        convert_newton_contacts_to_mjwarp_kernel(model, state_in, contacts, self.mjw_data, launch_dim,
                                                 self._last_contact_generation, self._contact_tid_to_cid,
                                                 self._last_nacon_count)
        # _snapshot_nacon_count
        self._last_nacon_count.copy_(self.mjw_data.nacon)
        self._last_contact_generation.copy_(contacts.contact_generation)

    def _mujoco_warp_step(self, state_in, state_out, dt):
        d = self.mjw_data
        active = torch.arange(NACONMAX, device=d.nacon.device) < d.nacon
        force = torch.where(active, d.contact_ke * (-d.contact_dist).clamp(min=0), torch.zeros_like(d.contact_dist))
        frc = torch.zeros(BODIES, device=force.device).index_add_(0, d.contact_body, force)
        qd = state_in.body_qd + dt * (GRAVITY + frc - 2.0 * state_in.body_qd * active.any())
        state_out.body_qd.copy_(qd)
        state_out.body_q.copy_(state_in.body_q + dt * qd)

    def step(self, state_in, state_out, control, contacts, dt):
        self._convert_contacts_to_mjwarp(self.model, state_in, contacts)
        self._mujoco_warp_step(state_in, state_out, dt)


def convert_newton_contacts_to_mjwarp_kernel(model, state_in, contacts, d, launch_dim, last_contact_generation,
                                             tid_to_cid, last_nacon_count):
    """Full path (generation changed): compact valid contacts to cids, record tid->cid, write every field.
    Fast path: reuse the recorded tid->cid and refresh only the body-q-dependent ``dist``."""
    tid = torch.arange(launch_dim, device=model.device)
    needs_full = contacts.contact_generation != last_contact_generation                  # [1], on the device
    count = contacts.rigid_contact_count.clamp(max=d.naconmax)
    shape = contacts.rigid_contact_shape0[:launch_dim]
    valid = (tid < count) & (shape >= 0)
    cid_full = torch.where(valid, valid.to(torch.int32).cumsum(0).to(torch.int32) - 1, torch.full_like(shape, -1))
    cid = torch.where(needs_full, cid_full, tid_to_cid[:launch_dim])
    tid_to_cid[:launch_dim].copy_(cid)
    d.nacon.copy_(torch.where(needs_full, valid.sum().to(torch.int32).reshape(1), last_nacon_count))
    ok = (cid >= 0) & (cid < d.naconmax)
    slot = torch.where(ok, cid, torch.full_like(cid, d.naconmax)).long()                 # the last slot: dropped
    body = model.shape_body[shape.clamp(min=0).long()]
    dist = torch.zeros(d.naconmax + 1, device=model.device).index_copy_(0, slot, state_in.body_q[body])
    d.contact_dist.copy_(dist[:d.naconmax])
    ke = torch.zeros(d.naconmax + 1, device=model.device).index_copy_(0, slot, model.shape_material_ke[body])
    d.contact_ke.copy_(torch.where(needs_full, ke[:d.naconmax], d.contact_ke))
    bid = torch.zeros(d.naconmax + 1, dtype=torch.long, device=model.device).index_copy_(0, slot, body)
    d.contact_body.copy_(torch.where(needs_full, bid[:d.naconmax], d.contact_body))


def read_contact_cache(solver):
    """What the issue's repro does after capture: ``solver._contact_tid_to_cid.numpy()`` (no map yet means none)."""
    cache = solver._contact_tid_to_cid
    if cache is None:
        return torch.full((solver.mjw_data.naconmax,), -1, dtype=torch.int32)
    return cache.clone()


def run(variant: str, device: str = "cpu"):
    model = Model(device)

    def setup():
        state_0, state_1 = State(model), State(model)
        contacts = Contacts(device)
        solver = SolverMuJoCo(model, variant)
        states = [state_0, state_1]

        def simulate():
            collide(model, states[0], contacts)
            for _ in range(SUBSTEPS):
                solver.step(states[0], states[1], None, contacts, DT)
                states[0], states[1] = states[1], states[0]
            return states[0].body_q

        return solver, states, contacts, simulate

    def served():
        solver, states, contacts, simulate = setup()
        # Newton's examples: `with wp.ScopedCapture() as capture: self.simulate()` right after construction
        g, body_q = capture(simulate, device=device, warmups=0, owner="SolverMuJoCo example",
                            state={"body_q": states[0].body_q, "body_qd": states[0].body_qd,
                                   "contact_generation": contacts.contact_generation})
        outs = [read_contact_cache(solver)]
        for _ in range(FRAMES):
            outs.append(replay(g, body_q).clone())            # wp.capture_launch(graph)
        return outs

    def eager():
        solver, _, _, simulate = setup()
        outs = [read_contact_cache(solver)]
        for _ in range(FRAMES):
            outs.append(simulate().clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
