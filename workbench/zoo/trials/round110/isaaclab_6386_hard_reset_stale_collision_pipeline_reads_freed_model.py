"""Isaac Lab on Newton: a hard reset re-finalizes the Newton model but keeps the cached collision pipeline (and its contacts), so the CUDA graph re-captured by ``initialize_solver`` bakes in the old model's shape arrays; once those are freed, the first replay reads freed device memory.

Upstream: https://github.com/isaac-sim/IsaacLab/pull/6386 ("fix(newton): rebuild collision pipeline on hard reset to
fix CUDA 700", isaac-sim/IsaacLab, by pv-nvidia, opened 2026-07-07, merged; fixes issue #6483; merge commit not read).
Read: the PR description and issue #6483 (root cause: "a hard reset re-finalizes the Newton Model, which reallocates
its device arrays, but the existing CollisionPipeline is reused ... via its cached self.model"); the regression test
``test_hard_reset_then_step_runs`` (parametrised over ``use_cuda_graph``; reset -> step -> hard reset, then
``_free_model_collide_arrays_and_churn(old_model)`` sets the ``shape_*`` arrays ``collide()`` reads to ``None``,
``gc.collect()``, allocates 128 ``wp.zeros(1 << 16)`` buffers, then step and synchronize); the fixed
``NewtonManager.reset`` (a hard reset first sets ``_graph = None``, ``_graph_capture_pending = False``,
``_collision_pipeline = None``, ``_contacts = None``, then runs ``start_simulation()`` and ``initialize_solver()``);
and, in a pre-fix ``newton_manager.py``, ``reset`` (``if not soft: start_simulation(); initialize_solver()``),
``initialize_solver`` (``_build_solver``, ``_initialize_contacts``, ``_capture_or_defer_graph``),
``_initialize_contacts`` (builds the pipeline and contacts only ``if ... is None``), ``_capture_or_defer_graph``
(headless: ``wp.ScopedCapture`` of ``_simulate_physics_only``, no warm-up), ``_run_solver_substeps`` (double-buffered
swap; ``need_copy_on_last`` only for an odd substep count under graphs) and ``step`` (``wp.capture_launch`` or eager).
Symptom: with the Newton backend, the first ``step()`` after ``NewtonManager.reset(soft=False)`` can die with CUDA
error 700 (illegal memory access) in ``compute_shape_aabbs`` or ``narrow_phase_kernel_gjk_mpr``; users worked around
it by turning CUDA graphs off.
Mechanism: ``reset`` re-finalizes the model (fresh ``shape_*`` arrays) and rebuilds the solver, but
``_initialize_contacts`` keeps the existing ``CollisionPipeline``, still bound to the old model. The graph re-captured
by ``initialize_solver`` records ``collide`` launches whose arguments are the old model's arrays, by address. The
manager no longer owns that model; when its arrays are released (the test frees them and churns the allocator), every
replay reads freed memory.
Doctor: dangling-reference, at reset. The graph captured after the hard reset reads the old model's shape arrays, which
their owner releases after capture; ``reset`` is where the fix drops the stale pipeline, contacts and graph.
Fix (upstream): on a hard reset, clear ``_graph``, ``_graph_capture_pending``, ``_collision_pipeline`` and
``_contacts`` before ``start_simulation()`` / ``initialize_solver()``, so the pipeline and the graph are rebuilt
against the re-finalized model.
Modelled: ``NewtonManager`` as a class-level singleton with ``reset``, ``start_simulation``, ``initialize_solver``,
``_initialize_contacts``, ``_capture_or_defer_graph`` (headless branch), ``_simulate_physics_only``,
``_run_solver_substeps`` and ``step`` as read; the test's scene, its two resets and
``_free_model_collide_arrays_and_churn``. Stand-ins: ``ModelBuilder.finalize`` / ``Model`` / ``State`` /
``Contacts`` reduced to spheres on free bodies over a ground plane; ``CollisionPipeline.collide`` is
``compute_shape_aabbs`` plus a sphere-plane narrow phase; the solver is a semi-implicit penalty integrator; float64.
The eager reference is the same workload with ``use_cuda_graph=False`` and no allocator churn (the test's freeing
mimics memory pressure on the device; eager reads the model through the pipeline at every launch).
Workload: 4 bodies, 6 sphere shapes, 2 substeps at dt 1/120. reset (hard, first); step; hard reset; free the old
model's collide arrays and churn; 3 steps. body_q and body_qd after every step are compared. Bug: the first replay
after the hard reset raises IllegalMemoryAccess (the recaptured graph reads the old model's freed ``shape_body``).
Fix: equals eager (max |graph - eager| = 0).
"""
from __future__ import annotations

import gc

import torch

from workbench.zoo.kit import capture, compare, own_segment_elems, release_to_driver, replay

UPSTREAM = "https://github.com/isaac-sim/IsaacLab/pull/6386"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "reset"
SYMPTOM = ("Newton backend: the first step after a hard reset faults with CUDA 700; the graph re-captured after the "
           "reset reads the old model's shape arrays through the reused collision pipeline")

DTYPE = torch.float64
GRAVITY = (0.0, 0.0, -9.81)
CONTACT_KE, CONTACT_KD = 2.0e3, 20.0

_variant = "bug"


# --- newton (reduced): ModelBuilder / Model / State / Contacts / CollisionPipeline / solver -----------------------------

class Model:
    pass


class State:
    def __init__(self, body_q, body_qd):
        self.body_q, self.body_qd = body_q, body_qd
        self.body_f = torch.zeros_like(body_q)

    def clear_forces(self):
        self.body_f.zero_()

    def assign(self, other):
        self.body_q.copy_(other.body_q)
        self.body_qd.copy_(other.body_qd)


class ModelBuilder:
    def __init__(self):
        self.body_q, self.body_mass = [], []
        self.shape_body, self.shape_transform, self.shape_radius = [], [], []

    def add_body(self, pos, mass):
        self.body_q.append(pos)
        self.body_mass.append(mass)
        return len(self.body_q) - 1

    def add_shape_sphere(self, body, offset, radius):
        self.shape_body.append(body)
        self.shape_transform.append(offset)
        self.shape_radius.append(radius)

    def finalize(self, device) -> Model:
        """Each finalize allocates fresh device arrays (a hard reset gets a new set)."""
        m = Model()
        m.device = device
        m.body_count, m.shape_count = len(self.body_q), len(self.shape_body)
        m.body_q_init = torch.tensor(self.body_q, dtype=DTYPE).to(device)
        m.body_mass = torch.tensor(self.body_mass, dtype=DTYPE).to(device)
        m.shape_body = torch.tensor(self.shape_body, dtype=torch.int64).to(device)
        m.shape_transform = torch.tensor(self.shape_transform, dtype=DTYPE).to(device)
        m.shape_collision_radius = torch.tensor(self.shape_radius, dtype=DTYPE).to(device)
        m.shape_margin = torch.full((m.shape_count,), 0.01, dtype=DTYPE).to(device)
        m.shape_gap = torch.full((m.shape_count,), 0.02, dtype=DTYPE).to(device)
        return m


def model_state(model: Model) -> State:
    return State(model.body_q_init.clone(), torch.zeros_like(model.body_q_init))


class Contacts:
    def __init__(self, rigid_contact_max, device):
        self.rigid_contact_depth = torch.zeros(rigid_contact_max, dtype=DTYPE, device=device)
        self.rigid_contact_normal = torch.zeros(rigid_contact_max, 3, dtype=DTYPE, device=device)
        self.rigid_contact_shape = torch.zeros(rigid_contact_max, dtype=torch.int64, device=device)
        self.shape_collision_aabb_lower = torch.zeros(rigid_contact_max, 3, dtype=DTYPE, device=device)


class CollisionPipeline:
    """Bound to the model it was built on: ``collide`` launches with ``self.model``'s shape arrays."""

    def __init__(self, model: Model, broad_phase="explicit"):
        self.model = model
        self.broad_phase = broad_phase
        self.rigid_contact_max = model.shape_count

    def contacts(self) -> Contacts:
        return Contacts(self.rigid_contact_max, self.model.device)

    def collide(self, state: State, contacts: Contacts):
        m = self.model
        # compute_shape_aabbs
        center = state.body_q.index_select(0, m.shape_body) + m.shape_transform
        lower = center - (m.shape_collision_radius + m.shape_gap)[:, None]
        contacts.shape_collision_aabb_lower.copy_(lower)
        # narrow phase against the ground plane z = 0 (sphere vs plane)
        depth = (m.shape_collision_radius + m.shape_margin - center[:, 2]).clamp(min=0.0)
        contacts.rigid_contact_depth.copy_(depth * (lower[:, 2] <= 0.0))
        contacts.rigid_contact_normal.zero_()
        contacts.rigid_contact_normal.select(1, 2).fill_(1.0)
        contacts.rigid_contact_shape.copy_(torch.arange(m.shape_count, device=center.device))


class SolverSemiImplicit:
    def __init__(self, model: Model):
        self.model = model
        self.gravity = torch.tensor(GRAVITY, dtype=DTYPE).to(model.device)

    def step(self, state_in: State, state_out: State, control, contacts: Contacts, dt: float):
        m = self.model
        shape_body = m.shape_body.index_select(0, contacts.rigid_contact_shape)
        vn = state_in.body_qd.index_select(0, shape_body)[:, 2]
        depth = contacts.rigid_contact_depth
        fn = (CONTACT_KE * depth - CONTACT_KD * vn * (depth > 0)).clamp(min=0.0)
        f = state_in.body_f.index_add(0, shape_body, contacts.rigid_contact_normal * fn[:, None])
        qd = state_in.body_qd + dt * (f / m.body_mass[:, None] + self.gravity)
        state_out.body_qd.copy_(qd)
        state_out.body_q.copy_(state_in.body_q + dt * qd)


# --- isaaclab_newton/physics/newton_manager.py (reduced) ---------------------------------------------------------------

class NewtonCfg:
    def __init__(self, use_cuda_graph, num_substeps=2, dt=1.0 / 120.0):
        self.use_cuda_graph, self.num_substeps, self.dt = use_cuda_graph, num_substeps, dt


class NewtonManager:
    _cfg: NewtonCfg = None
    _device: str = None
    _builder: ModelBuilder = None
    _model: Model = None
    _solver = None
    _use_single_state = False
    _state_0: State = None
    _state_1: State = None
    _control = None
    _contacts: Contacts | None = None
    _needs_collision_pipeline = True
    _collision_pipeline = None
    _graph = None
    _graph_capture_pending = False
    _num_substeps = 1
    _solver_dt = 1.0 / 200.0

    @classmethod
    def clear(cls):
        NewtonManager._builder = NewtonManager._model = NewtonManager._solver = None
        NewtonManager._state_0 = NewtonManager._state_1 = None
        NewtonManager._contacts = None
        NewtonManager._collision_pipeline = None
        NewtonManager._graph = None
        NewtonManager._graph_capture_pending = False

    @classmethod
    def set_builder(cls, builder):
        NewtonManager._builder = builder

    @classmethod
    def reset(cls, soft: bool = False) -> None:
        """Reset physics simulation. A hard reset re-finalizes the model and re-initializes the solver."""
        if not soft:
            if _variant == "fix":
                # Release the cached collision pipeline, contacts and CUDA graph;
                # they point at the old model's freed buffers (CUDA 700 on next step).
                NewtonManager._graph = None
                NewtonManager._graph_capture_pending = False
                NewtonManager._collision_pipeline = None
                NewtonManager._contacts = None
            cls.start_simulation()
            cls.initialize_solver()

    @classmethod
    def start_simulation(cls) -> None:
        NewtonManager._model = cls._builder.finalize(cls._device)
        NewtonManager._state_0 = model_state(cls._model)
        NewtonManager._state_1 = model_state(cls._model)

    @classmethod
    def _build_solver(cls, model, solver_cfg=None):
        NewtonManager._solver = SolverSemiImplicit(model)
        NewtonManager._use_single_state = False
        NewtonManager._needs_collision_pipeline = True

    @classmethod
    def _initialize_contacts(cls) -> None:
        if not cls._needs_collision_pipeline:
            return
        if cls._collision_pipeline is None:
            NewtonManager._collision_pipeline = CollisionPipeline(cls._model, broad_phase="explicit")
        if cls._contacts is None:
            NewtonManager._contacts = cls._collision_pipeline.contacts()

    @classmethod
    def initialize_solver(cls) -> None:
        cfg = cls._cfg
        NewtonManager._num_substeps = cfg.num_substeps
        NewtonManager._solver_dt = cfg.dt / cfg.num_substeps
        cls._build_solver(cls._model)
        cls._initialize_contacts()
        cls._capture_or_defer_graph()

    @classmethod
    def _capture_or_defer_graph(cls) -> None:
        cfg, device = cls._cfg, cls._device
        if cfg.use_cuda_graph:
            # headless: wp.ScopedCapture() around the physics step, captured right away (no warm-up run)
            state = {"state_0.body_q": cls._state_0.body_q, "state_0.body_qd": cls._state_0.body_qd,
                     "state_1.body_q": cls._state_1.body_q, "state_1.body_qd": cls._state_1.body_qd}
            NewtonManager._graph, _ = capture(cls._simulate_physics_only, device=device, warmups=0, state=state,
                                              owner="NewtonManager", name="newton physics step")
        else:
            NewtonManager._graph = None

    @classmethod
    def _run_solver_substeps(cls, contacts) -> None:
        cfg = cls._cfg
        need_copy_on_last = cfg.use_cuda_graph and cls._num_substeps % 2 == 1
        for i in range(cls._num_substeps):
            cls._solver.step(cls._state_0, cls._state_1, cls._control, contacts, cls._solver_dt)
            if need_copy_on_last and i == cls._num_substeps - 1:
                cls._state_0.assign(cls._state_1)
            else:
                NewtonManager._state_0, NewtonManager._state_1 = cls._state_1, cls._state_0
            cls._state_0.clear_forces()

    @classmethod
    def _simulate_physics_only(cls):
        if cls._needs_collision_pipeline:
            cls._collision_pipeline.collide(cls._state_0, cls._contacts)
        cls._run_solver_substeps(cls._contacts)
        return cls._state_0.body_q, cls._state_0.body_qd

    @classmethod
    def step(cls):
        use_graph = cls._cfg.use_cuda_graph and cls._graph is not None
        if use_graph:
            replay(cls._graph, (cls._state_0.body_q, cls._state_0.body_qd))      # wp.capture_launch
        else:
            cls._simulate_physics_only()
        return cls._state_0.body_q.clone(), cls._state_0.body_qd.clone()


# --- source/isaaclab_newton/test/...: the regression test's scene and its allocator churn -------------------------------

_COLLIDE_MODEL_ARRAYS = ("shape_body", "shape_transform", "shape_collision_radius", "shape_margin", "shape_gap")


def _build_collision_scene() -> ModelBuilder:
    builder = ModelBuilder()
    for i, (x, z) in enumerate(((0.0, 0.12), (0.5, 0.30), (1.0, 0.09), (1.5, 0.55))):
        body = builder.add_body((x, 0.1 * i, z), mass=1.0 + 0.25 * i)
        builder.add_shape_sphere(body, (0.0, 0.0, 0.0), 0.1)
        if i % 2 == 1:
            builder.add_shape_sphere(body, (0.05, 0.0, -0.05), 0.06)
    return builder


def _free_model_collide_arrays_and_churn(model: Model, device):
    """Free the arrays ``collide()`` reads off ``model``, then churn the allocator (as the test does)."""
    for attr in _COLLIDE_MODEL_ARRAYS:
        setattr(model, attr, None)
    gc.collect()
    release_to_driver(device)
    return [torch.zeros(own_segment_elems(device), dtype=DTYPE, device=device) for _ in range(8)]


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant

    def workload(use_cuda_graph: bool):
        NewtonManager.clear()
        NewtonManager._cfg, NewtonManager._device = NewtonCfg(use_cuda_graph), device
        NewtonManager.set_builder(_build_collision_scene())
        outs = []
        NewtonManager.reset()                                   # sim.reset(): first (hard) reset
        outs += NewtonManager.step()
        old_model = NewtonManager._collision_pipeline.model
        NewtonManager.reset()                                   # sim.reset() again: hard reset, model re-finalized
        churn = _free_model_collide_arrays_and_churn(old_model, device) if use_cuda_graph else []
        del old_model
        for _ in range(3):
            outs += NewtonManager.step()
        del churn
        NewtonManager.clear()
        return outs

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: workload(True), lambda: workload(False))
