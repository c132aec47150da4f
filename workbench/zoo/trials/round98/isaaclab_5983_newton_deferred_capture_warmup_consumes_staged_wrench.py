"""Isaac Lab's Newton manager, when Kit/RTX defers the CUDA graph capture to the first ``step()``, runs an eager warmup simulate on the live state before capturing: the warmup consumes the staged wrench and advances the bodies, and the first replay starts from there.

Upstream: https://github.com/isaac-sim/IsaacLab/pull/5983 ("Fix Newton deferred graph warmup", isaac-sim/IsaacLab,
opened 2026-06-05 by AntoineRichard, still open; it supersedes the closed #5982 with the same title) fixing issue #5961
("[Bug Report] Kit Visualizer + Newton MJWarp Drops First-Step External Wrench", open). Read: the PR description, its
diff hunk in ``_capture_relaxed_graph`` ("Warmup also advances Newton outside the normal IsaacLab step bookkeeping, so
snapshot/restore state to keep its writes out of the first real replay") and the review thread on
``_snapshot_state_arrays`` / ``_restore_state_arrays`` (a fixed list of ``(owner, name)`` pairs recorded before the
warmup, resolved through ``getattr(owner, name)`` when restored, so an array rebound during the warmup is followed); the
issue; ``newton_manager.py`` before the fix (``step``, ``_capture_relaxed_graph``, ``_run_solver_substeps``,
``_simulate_full``, ``_simulate_physics_only``, ``start_simulation``, ``clear``); ``mjwarp_manager.py``
(``_build_solver``: ``SolverMuJoCo``, ``_use_single_state = True``). The full diff of the fix was not available to me:
the two helpers below are written from the description and the review, their bodies are mine.
Symptom: ``scripts/demos/quadcopter.py --physics newton_mjwarp`` with the Kit visualizer: the quadcopter, whose thrust
matches gravity, falls instead of hovering; after the first step its vertical velocity is -0.04905 m/s, one step of
gravity-only integration. Other visualizer/backend combinations hover; the log says "Newton CUDA graph capture deferred
until first step() (RTX active)".
Mechanism: with RTX active, ``_capture_or_defer_graph`` sets ``_graph_capture_pending`` and the first
``NewtonManager.step()`` calls ``_capture_relaxed_graph``, which first runs ``simulate()`` eagerly to pre-allocate the
solver's scratch buffers. That warmup is a real physics step on the live ``_state_0``: ``SolverMuJoCo.step`` integrates
the bodies with the wrench the demo staged in ``state.body_f`` for this step, then ``clear_forces`` zeroes it. The graph
is captured afterwards and ``step()`` replays it at once: the replay integrates again, from the warmup's state, with no
wrench. The first visible step is the warmup's step plus a gravity-only step; every later step inherits the offset.
Doctor: persistent-mutation, at ``step`` (``SolverMuJoCo.step``, the in-place update of the live state that the
deferred capture's warmup runs): the manager's states are persistent state that the graph updates on purpose at every
replay, but the warmup, a dummy run, overwrites their live contents before the first replay.
Fix (upstream): ``_snapshot_state_arrays()`` before the warmup and ``_restore_state_arrays()`` in a ``finally`` before
the capture: both states' references and contents come back (both, since a double-buffered solver may swap them), and
the first replay consumes the staged wrench from the caller-prepared state.
Modelled: ``NewtonManager`` (class-level state, ``start_simulation``, ``initialize_solver``,
``_capture_or_defer_graph``, ``step``, ``_capture_relaxed_graph``, ``_run_solver_substeps`` with the single-state and
double-buffered paths, ``_step_solver``, ``_simulate_full``, ``_simulate_physics_only``, ``clear``) and the MJWarp
manager's solver choice, with the fix's two helpers under ``_variant == "fix"``. Stand-ins: Newton ``Model``/``State``
hold only ``body_mass``, ``gravity``, ``body_q``/``body_qd``/``body_f``; ``SolverMuJoCo.step`` is a semi-implicit Euler
step of the bodies' linear motion under gravity and ``body_f`` (what a hovering quadcopter needs of mujoco_warp); the
relaxed external capture (non-blocking stream, ``cudaStreamBeginCapture``, ``wp.capture_begin(external=True)``) is
``kit.capture`` with no further warmup, ``wp.capture_launch`` is ``kit.replay``, ``wp.clone``/``wp.copy`` are torch
``clone``/``copy_``; the quadcopter is reduced to one body per environment whose whole thrust ``write_data_to_sim``
writes into ``body_f`` (Isaac Lab's wrench composer); sensors, collision, actuators, Fabric sync, ``forward()`` and
resets are left out. Before the warmup the manager announces both states' arrays as persistent state
(``_live_state_arrays``, mine), as a graph manager announces a cache.
Workload: the demo's loop for 4 quadcopters (thrust 0.95..1.01 of their weight, set every step), 6 steps of 5 ms, Kit
active (deferred capture), against the same loop with ``use_cuda_graph=False``; outputs: root positions and linear
velocities after every step. The bug diverges from step 1 (vertical velocity off by exactly -9.81 * 0.005 = -0.04905,
positions drifting after it; max error 0.049); the fix equals eager (max error 0).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/isaac-sim/IsaacLab/pull/5983"
FAMILY = "persistent-buffer mutation"
KIND = "persistent-mutation"
SITE = "step"
SYMPTOM = ("Kit visualizer + Newton MJWarp: the deferred CUDA graph capture's eager warmup steps the live state and "
           "clears the staged wrench, so the first replayed step is gravity-only and a hovering quadcopter falls")

NUM_QUADS, STEPS = 4, 6
PHYSICS_DT = 0.005
GRAVITY = 9.81
DTYPE = torch.float64

_variant = "bug"


# --- newton (stand-ins: Model, State, Control, SolverMuJoCo) ----------------------------------------------------------

class State:
    def __init__(self, model):
        self.body_count = model.body_count
        self.body_q = model.body_q.clone()                         # [N, 7]: position, quaternion (xyzw)
        self.body_qd = torch.zeros_like(model.body_qd)             # [N, 6]: linear, angular velocity
        self.body_f = torch.zeros_like(model.body_qd)              # [N, 6]: applied force, torque (world)

    ARRAYS = ("body_q", "body_qd", "body_f")

    def clear_forces(self):
        if self.body_count:
            self.body_f.zero_()

    def assign(self, other):
        for name in self.ARRAYS:
            getattr(self, name).copy_(getattr(other, name))


class Model:
    def __init__(self, device):
        gen = generator(5983)
        self.body_count = NUM_QUADS
        self.body_mass = (0.027 + 0.004 * torch.rand(NUM_QUADS, generator=gen)).to(device, DTYPE)   # Crazyflie-ish
        self.body_q = torch.zeros(NUM_QUADS, 7, dtype=DTYPE)
        self.body_q[:, 0] = torch.arange(NUM_QUADS, dtype=DTYPE)
        self.body_q[:, 2] = 0.5 + torch.rand(NUM_QUADS, generator=gen, dtype=DTYPE)
        self.body_q[:, 6] = 1.0
        self.body_q = self.body_q.to(device)
        self.body_qd = torch.zeros(NUM_QUADS, 6, dtype=DTYPE, device=device)
        self.gravity = torch.tensor([0.0, 0.0, -GRAVITY], dtype=DTYPE, device=device)

    def state(self):
        return State(self)

    def control(self):
        return None


class SolverMuJoCo:
    """Stand-in for mujoco_warp's step: semi-implicit Euler of the free bodies' linear motion."""

    def __init__(self, model):
        self.model = model

    def step(self, state_in, state_out, control, contacts, dt):
        acc = state_in.body_f[:, :3] / self.model.body_mass[:, None] + self.model.gravity
        state_out.body_qd[:, :3].copy_(state_in.body_qd[:, :3] + acc * dt)
        state_out.body_q[:, :3].copy_(state_in.body_q[:, :3] + state_out.body_qd[:, :3] * dt)


# --- isaaclab.physics (stand-ins) -------------------------------------------------------------------------------------

@dataclasses.dataclass
class NewtonCfg:
    use_cuda_graph: bool = True
    num_substeps: int = 1


class PhysicsManager:
    _cfg: NewtonCfg | None = None
    _device: str = "cpu"
    _sim_time: float = 0.0


# --- isaaclab_newton/physics/newton_manager.py ------------------------------------------------------------------------

class NewtonManager:
    _model = None
    _solver = None
    _use_single_state = None
    _state_0 = None
    _state_1 = None
    _control = None
    _contacts = None
    _needs_collision_pipeline = False
    _adapter = None
    _post_actuator_callbacks: list = []
    _post_step_callbacks: list = []
    _decimation = 1
    _num_substeps = 1
    _solver_dt = PHYSICS_DT
    _graph = None
    _graph_capture_pending = False
    _usdrt_stage = None

    @classmethod
    def clear(cls):
        NewtonManager._model = None
        NewtonManager._solver = None
        NewtonManager._use_single_state = None
        NewtonManager._state_0 = None
        NewtonManager._state_1 = None
        NewtonManager._control = None
        NewtonManager._graph = None
        NewtonManager._graph_capture_pending = False
        NewtonManager._usdrt_stage = None

    @classmethod
    def start_simulation(cls, kit_visualizer: bool):
        NewtonManager._model = Model(PhysicsManager._device)
        NewtonManager._state_0 = cls._model.state()
        NewtonManager._state_1 = cls._model.state()
        NewtonManager._control = cls._model.control()
        if kit_visualizer:                          # Setup USD/Fabric sync for Kit viewport rendering
            NewtonManager._usdrt_stage = "fabric stage"

    @classmethod
    def initialize_solver(cls):
        # NewtonMJWarpManager._build_solver
        NewtonManager._solver = SolverMuJoCo(cls._model)
        NewtonManager._use_single_state = True
        NewtonManager._needs_collision_pipeline = False        # use_mujoco_contacts=True
        NewtonManager._num_substeps = PhysicsManager._cfg.num_substeps
        NewtonManager._solver_dt = PHYSICS_DT / cls._num_substeps
        cls._capture_or_defer_graph()

    @classmethod
    def _capture_or_defer_graph(cls):
        if PhysicsManager._cfg.use_cuda_graph:
            if cls._usdrt_stage is None:
                # No RTX active — use standard Warp capture (cudaStreamCaptureModeGlobal).
                NewtonManager._graph, _ = capture(cls._simulate_full, device=PhysicsManager._device, warmups=0,
                                                  name="newton physics", owner="NewtonManager")
            else:
                # RTX is active during initialization: defer capture to the first step() call.
                NewtonManager._graph = None
                NewtonManager._graph_capture_pending = True
        else:
            NewtonManager._graph = None

    @classmethod
    def get_state_0(cls):
        return cls._state_0

    @classmethod
    def _is_all_graphable(cls) -> bool:
        return cls._adapter is None                 # (no Newton actuator adapter: nothing stepped eagerly)

    @classmethod
    def step(cls):
        # Lazy CUDA graph capture
        cfg = PhysicsManager._cfg
        device = PhysicsManager._device
        if cls._graph_capture_pending and cfg is not None and cfg.use_cuda_graph:
            NewtonManager._graph_capture_pending = False
            NewtonManager._graph = cls._capture_relaxed_graph(device)

        physics_dt = cls._solver_dt * cls._num_substeps
        use_graph = cfg is not None and cfg.use_cuda_graph and cls._graph is not None
        if cls._is_all_graphable():
            if use_graph:
                replay(cls._graph, (cls._state_0.body_q, cls._state_0.body_qd))     # wp.capture_launch
            else:
                cls._simulate_full()
            PhysicsManager._sim_time += physics_dt * cls._decimation
        else:
            if use_graph:
                replay(cls._graph, (cls._state_0.body_q, cls._state_0.body_qd))
            else:
                cls._simulate_physics_only()
            PhysicsManager._sim_time += physics_dt

    @classmethod
    def _live_state_arrays(cls) -> dict:
        return {f"{which}.{name}": getattr(state, name) for which, state in (("_state_0", cls._state_0),
                ("_state_1", cls._state_1)) if state is not None for name in State.ARRAYS}

    @classmethod
    def _snapshot_state_arrays(cls):
        """The live states' references, and a copy of every array of both (owner, name, array, copy)."""
        arrays = [(state, name, getattr(state, name), getattr(state, name).clone())
                  for state in (cls._state_0, cls._state_1) if state is not None for name in State.ARRAYS]
        return (cls._state_0, cls._state_1), arrays

    @classmethod
    def _restore_state_arrays(cls, snapshot):
        (state_0, state_1), arrays = snapshot
        NewtonManager._state_0, NewtonManager._state_1 = state_0, state_1
        for owner, name, array, saved in arrays:
            if getattr(owner, name) is not array:          # rebound during the warmup: back to the live array
                setattr(owner, name, array)
            array.copy_(saved)

    @classmethod
    def _capture_relaxed_graph(cls, device: str, capture_target: Callable[[], None] | None = None):
        """Capture Newton physics (only) as a CUDA graph, RTX-compatible (relaxed external capture on a
        non-blocking stream). Warmup run pre-allocates all solver scratch buffers so no ``cudaMalloc``
        occurs during capture. Returns the graph."""
        # Warmup: pre-allocate all solver scratch buffers so the capture window has
        # no new cudaMalloc calls (which are forbidden inside graph capture).
        if capture_target is not None:
            simulate = capture_target
        else:
            simulate = cls._simulate_full if cls._is_all_graphable() else cls._simulate_physics_only
        events.persistent_state("NewtonManager", cls._live_state_arrays())
        if _variant == "fix":
            # Warmup also advances Newton outside the normal IsaacLab step bookkeeping,
            # so snapshot/restore state to keep its writes out of the first real replay.
            snapshot = cls._snapshot_state_arrays()
            try:
                with events.warmup():
                    simulate()
            finally:
                cls._restore_state_arrays(snapshot)
        else:
            with events.warmup():
                simulate()

        # cudaStreamBeginCapture(relaxed) on a fresh non-blocking stream, wp.capture_begin(external=True),
        # simulate() inside ScopedStream(fresh_stream), wp.capture_end, cudaStreamEndCapture
        graph, _ = capture(simulate, device=device, warmups=0, name="newton physics (deferred, relaxed)",
                           owner="NewtonManager")
        return graph

    @classmethod
    def _step_solver(cls, state_in, state_out, control, contacts, dt):
        cls._solver.step(state_in, state_out, control, contacts, dt)

    @classmethod
    def _run_solver_substeps(cls, contacts) -> None:
        """Run ``num_substeps`` solver iterations, handling double-buffered state swap."""
        if cls._use_single_state:
            for _ in range(cls._num_substeps):
                cls._step_solver(cls._state_0, cls._state_0, cls._control, contacts, cls._solver_dt)
                cls._state_0.clear_forces()
        else:
            need_copy_on_last = cls._num_substeps % 2 == 1
            for i in range(cls._num_substeps):
                cls._step_solver(cls._state_0, cls._state_1, cls._control, contacts, cls._solver_dt)
                if need_copy_on_last and i == cls._num_substeps - 1:
                    cls._state_0.assign(cls._state_1)
                else:
                    NewtonManager._state_0, NewtonManager._state_1 = cls._state_1, cls._state_0
                cls._state_0.clear_forces()

    @classmethod
    def _simulate_full(cls) -> None:
        """Run ``decimation x (actuators + solver substeps)`` (no actuator adapter, no sensors here)."""
        contacts = cls._contacts if cls._needs_collision_pipeline else None
        for _ in range(cls._decimation):
            for cb in cls._post_actuator_callbacks:
                cb()
            cls._run_solver_substeps(contacts)
        for cb in cls._post_step_callbacks:
            cb()

    @classmethod
    def _simulate_physics_only(cls) -> None:
        cls._run_solver_substeps(None)
        for cb in cls._post_step_callbacks:
            cb()


# --- scripts/demos/quadcopter.py (the articulation reduced to its wrench path) ----------------------------------------

class Quadcopter:
    def __init__(self, device):
        self.num_instances = NUM_QUADS
        self._external_force = torch.zeros(NUM_QUADS, 3, dtype=DTYPE, device=device)
        self._external_torque = torch.zeros(NUM_QUADS, 3, dtype=DTYPE, device=device)

    def set_external_force_and_torque(self, forces, torques):
        self._external_force.copy_(forces)
        self._external_torque.copy_(torques)

    def write_data_to_sim(self):
        """The wrench composer writes the staged wrench into the live state's ``body_f``."""
        body_f = NewtonManager.get_state_0().body_f
        body_f[:, :3].copy_(self._external_force)
        body_f[:, 3:].copy_(self._external_torque)

    @property
    def root_pos_w(self):
        return NewtonManager.get_state_0().body_q[:, :3]

    @property
    def root_lin_vel_w(self):
        return NewtonManager.get_state_0().body_qd[:, :3]


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    thrust_ratio = (1.0 + 0.05 * torch.randn(NUM_QUADS, generator=generator(59610), dtype=DTYPE)).to(device)

    def demo(use_cuda_graph: bool):
        NewtonManager.clear()
        PhysicsManager._cfg, PhysicsManager._device = NewtonCfg(use_cuda_graph=use_cuda_graph), device
        PhysicsManager._sim_time = 0.0
        NewtonManager.start_simulation(kit_visualizer=True)        # --visualizer kit: RTX active
        NewtonManager.initialize_solver()
        robot = Quadcopter(device)
        robot_mass = NewtonManager._model.body_mass
        outs = []
        for _ in range(STEPS):
            forces = torch.zeros(NUM_QUADS, 3, dtype=DTYPE, device=device)
            forces[:, 2] = robot_mass * GRAVITY * thrust_ratio
            robot.set_external_force_and_torque(forces, torch.zeros_like(forces))
            robot.write_data_to_sim()
            NewtonManager.step()                                   # sim.step()
            outs += [robot.root_pos_w.clone(), robot.root_lin_vel_w.clone()]
        NewtonManager.clear()
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: demo(True), lambda: demo(False))
