"""Python's cyclic collector runs inside ``Simulation.create_graph``'s ``wp.ScopedCapture`` and finalizes a dropped environment's Warp graphs; their ``cudaGraphDestroy`` is refused on the capturing thread and the new capture fails with CUDA error 901.

Upstream: https://github.com/mujocolab/mjlab/pull/821 ("Disable GC during CUDA graph capture", repo
mujocolab/mjlab, merged 2026-03-19; no separate issue). The PR says the fix matches Newton's approach. The same
mechanism with torch graphs: https://github.com/NVIDIA/TransformerEngine/pull/2092 ("[PyTorch] Avoid garbage
collection when capturing a CUDA Graph", merged 2025-08-20). Its background is pytorch/pytorch#161037 (closed), whose
reproducer finalizes a ``torch.cuda.CUDAGraph`` held in a reference cycle with ``gc.collect()`` inside a capture and
gets "CUDA warning: operation not permitted when stream is capturing (function reset)". Warp's own report of the
destroy-in-capture failure is NVIDIA/warp#992 ("Deleting a CUDA graph breaks capture": ``del capture1`` inside
``wp.ScopedCapture() as capture2``).
Symptom: the PR's words: "Python's GC can finalize stale Warp ``Graph`` objects during ``wp.ScopedCapture()``,
recording ``wp_cuda_graph_destroy`` calls into the new graph. On replay those destructors corrupt the graph (CUDA
error 901)". It is intermittent: it depends on where the collector happens to run. Here a second environment is
built in the same process after a first one was dropped (as a test session or an evaluation after training does).
Building the second environment fails in its step-graph capture with ``RuntimeError: CUDA graph capture failed. Warp
CUDA error 901: operation failed due to a previous error during capture``. The same two rollouts without CUDA graphs
run.
Mechanism: ``Simulation.create_graph`` (``src/mjlab/sim/sim.py``) sets ``step_graph``, ``forward_graph``,
``reset_graph`` and ``sense_graph`` to None, then captures ``mjwarp.step``, ``mjwarp.forward`` and
``mjwarp.reset_data`` each in its own ``wp.ScopedCapture()``. It runs from ``Simulation.__init__`` and again after
``expand_model_fields`` / ``set_sensor_context``. A ``wp.Graph``'s ``__del__`` (``warp/_src/context.py``) calls
``runtime.core.wp_cuda_graph_destroy(self.device.context, self.graph)``, and ``wp_cuda_graph_exec_destroy`` for its
executable. A Graph that is reachable only from a reference cycle is freed only when CPython's cyclic collector
runs. Here that is the whole dropped environment: ``ManagerBase`` keeps ``self._env`` and the env keeps its managers
and its ``Simulation``. The collector runs automatically whenever the container objects allocated since its last run
pass the generation-0 threshold. Inside a capture of ``mjwarp.step``, every one of its many ``wp.launch`` calls
allocates argument objects, so a collection there is likely. The stale graph's destroy then runs on the thread whose
stream is capturing. CUDA does not permit ``cudaGraphDestroy`` there ("operation not permitted when stream is
capturing", error 900) and invalidates the capture. ``wp_cuda_graph_end_capture``'s ``cudaStreamEndCapture`` then
returns ``cudaErrorStreamCaptureInvalidated`` (901), and ``wp.capture_end`` raises. Eagerly nothing is captured, and
the same finalizer runs at whatever point the collector runs. This is not the covered mjlab #415 (round69), where
a graph kept reading model arrays that ``expand_model_fields`` had replaced (a dangling reference, fixed by
recapturing). Here the recapture itself fails, because a finalizer runs inside it.
Doctor: sync-in-capture, at create_graph. A driver call that an open capture forbids (``cudaGraphDestroy``, refused
with cudaErrorStreamCaptureUnsupported as a synchronisation is) runs on the capturing thread. ``create_graph`` opens
every capture window with automatic collection still on, so any finalizer may run there. It is the function the fix
changed.
Fix (upstream): a ``_suspend_gc()`` context manager (``enabled = gc.isenabled(); gc.disable()``; in ``finally``,
``gc.enable()`` if it was enabled) wraps all the captures: ``with _suspend_gc(), wp.ScopedDevice(self.wp_device):``.
Stale graphs are then destroyed at the first collection after ``create_graph``, outside any capture.
Modelled: Warp is a stand-in. ``_Core`` is ``warp.cu`` over the driver's rule: ``wp_cuda_graph_destroy`` calls
``cudaGraphDestroy``, which is refused (error 900, recorded in the error string, not printed), invalidates the open
capture and leaves the graph allocated while this thread is capturing. ``cudaGraph_t`` and its executable are one
engine graph. ``wp.ScopedCapture`` opens an engine capture in thread-local mode (Warp's default). A capture that
ends invalidated is aborted with the refused call as its error, and ``wp.capture_end`` raises Warp's
``RuntimeError``. Caveat: Warp 1.10 (commit 76c0152e5, GH-992, Nov 2025) already defers graph destroys while a Warp
capture is open. The PR names neither its Warp version nor the exact call that failed. The stand-in follows the PR's
account, which is Warp's behaviour before GH-992. CPython's collector is a stand-in ``gc`` (the names mjlab calls):
automatic collection runs when launch-side allocations pass the generation-0 threshold (700). Each ``wp.launch``
counts ``LAUNCH_OBJECTS`` and each ``wp.capture_launch`` counts ``CAPTURE_LAUNCH_OBJECTS``. A collection is a full
``gc.collect()``; generations are not modelled. While ``run`` runs, the interpreter's own automatic collection is
switched off, so the stand-in decides where collections happen (deterministically). ``run`` collects, with no capture
open, before and after, and freezes (``gc.freeze``) what existed before it, so that its collections stay cheap.
Because one captured step makes more than the threshold of launch-side allocations, a collection always falls inside
the second environment's step capture: nothing launches between the first environment's drop and that capture.
Which cycle held mjlab's stale graphs is not stated upstream; here it is the env-manager cycle of a dropped
environment. mujoco_warp is cut to a 2-dof linear system per world: passive and
actuator forces, ``SOLVER_ITERATIONS`` Jacobi solver iterations on the fixed mass matrix, and semi-implicit Euler. A
masked ``reset_data`` is included. mjlab is cut to ``Simulation`` (no sense graph, nan guard, driver-version check
or sensor context) and an env with an action manager (``ctrl = scale * action``), a time-out reset and an
event-manager stub. Outputs: ``qpos`` after every env step of both rollouts. Checked on the CPU emulation only; on
CUDA the same code runs the engine's torch graphs, and the stand-in refuses the destroy there too.
"""
from __future__ import annotations

import contextlib
import gc as _cpython_gc
from contextlib import contextmanager

import torch

from workbench.engine import events, graph, is_capturing, new_graph
from workbench.engine.errors import CaptureError
from workbench.engine.source import user_frame
from workbench.zoo.kit import compare, generator, randn, replay

UPSTREAM = "https://github.com/mujocolab/mjlab/pull/821"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "create_graph"
SYMPTOM = ("building a second mjlab env after dropping the first: the cyclic GC runs inside create_graph's "
           "wp.ScopedCapture, the old env's wp.Graph.__del__ calls cudaGraphDestroy on the capturing thread, and "
           "the capture fails (Warp CUDA error 901: operation failed due to a previous error during capture)")

NUM_ENVS, NV = 4, 2
TIMESTEP, DECIMATION, EPISODE_STEPS, ROLLOUT_STEPS = 0.01, 2, 4, 6
SOLVER_ITERATIONS = 20
LAUNCH_OBJECTS = 40             # argument objects one wp.launch allocates (ctypes params, wrappers)
CAPTURE_LAUNCH_OBJECTS = 2
VARIANT = {"v": "bug"}


# --- CPython's cyclic garbage collector: where automatic collections run ---------------------------------------

class _CycleCollector:
    """Automatic collection: when the container objects allocated since the last collection pass the
    generation-0 threshold, the interpreter collects (running ``__del__`` of unreachable cycles), unless
    ``gc.disable()`` switched automatic collection off. Allocations still count while it is off."""

    THRESHOLD0 = 700

    def __init__(self):
        self.enabled, self.count = True, 0

    def allocated(self, n: int) -> None:
        self.count += n
        if self.enabled and self.count > self.THRESHOLD0:
            self.count = 0
            _cpython_gc.collect()


_collector = _CycleCollector()


class gc:  # noqa: N801 - the module mjlab imports
    @staticmethod
    def isenabled() -> bool:
        return _collector.enabled

    @staticmethod
    def disable() -> None:
        _collector.enabled = False

    @staticmethod
    def enable() -> None:
        _collector.enabled = True


# --- warp/native/warp.cu over the CUDA driver ------------------------------------------------------------------

class _CaptureInfo:
    def __init__(self, stream, engine_graph, scope):
        self.stream, self.graph, self.scope = stream, engine_graph, scope
        self.invalidated_by: CaptureError | None = None    # the first call CUDA refused while it was open


class _Core:
    """The native runtime. ``cudaStreamBeginCapture``/``EndCapture`` are the engine's capture; the driver refuses
    ``cudaGraphDestroy`` on a thread whose stream is capturing and invalidates that capture."""

    def __init__(self):
        self.g_captures: dict[int, _CaptureInfo] = {}
        self._next_capture_id = 1
        self.error_string = ""
        self.undestroyed: list = []        # graphs whose cudaGraphDestroy was refused: still allocated

    def _check_cuda(self, code: int, text: str, function: str) -> bool:
        self.error_string = f"Warp CUDA error {code}: {text} (in function {function})"
        return False

    def wp_cuda_graph_begin_capture(self, context, stream, name: str) -> int:
        g = new_graph(context.alias)
        scope = graph(g, name=name, capture_error_mode="thread_local")   # Warp captures in thread-local mode
        scope.__enter__()
        capture_id = self._next_capture_id
        self._next_capture_id += 1
        self.g_captures[capture_id] = _CaptureInfo(stream, g, scope)
        return capture_id

    def wp_cuda_graph_end_capture(self, context, stream, capture_id: int):
        info = self.g_captures.pop(capture_id)
        if info.invalidated_by is None:
            info.scope.__exit__(None, None, None)                          # cudaStreamEndCapture
            return info.graph
        # cudaStreamEndCapture -> cudaErrorStreamCaptureInvalidated: no graph
        err = info.invalidated_by
        info.scope.__exit__(type(err), err, None)
        self._check_cuda(901, "operation failed due to a previous error during capture",
                         "wp_cuda_graph_end_capture")
        return None

    def wp_cuda_graph_abort_capture(self, capture_id: int, exc_type, exc, tb) -> None:
        info = self.g_captures.pop(capture_id)
        info.scope.__exit__(exc_type, exc, tb)

    def wp_cuda_graph_destroy(self, context, cuda_graph) -> bool:
        if is_capturing():
            # cudaGraphDestroy while this thread's stream is capturing: not permitted, and the capture is invalidated
            where = user_frame()
            for info in self.g_captures.values():
                if info.invalidated_by is None:
                    info.invalidated_by = CaptureError(
                        "cudaGraphDestroy while the stream is capturing: operation not permitted when stream is "
                        f"capturing (cudaErrorStreamCaptureUnsupported); CUDA invalidated the capture.\n  at {where}",
                        op="cudaGraphDestroy", source=where)
            self.undestroyed.append(cuda_graph)
            return self._check_cuda(900, "operation not permitted when stream is capturing", "wp_cuda_graph_destroy")
        cuda_graph.reset()                                                 # cudaGraphDestroy
        return True


# --- warp (Python API) -------------------------------------------------------------------------------------------

class Device:
    def __init__(self, alias: str):
        self.alias = alias
        self.is_cuda = True            # the engine's graphs stand in for CUDA graphs on either backend
        self.context = self
        self.stream = object()
        self.captures: dict = {}       # stream -> Graph being captured


class Runtime:
    def __init__(self, alias: str, mempool: bool):
        self.core = _Core()
        self.device = Device(alias)
        self.mempool_enabled = mempool


runtime: Runtime | None = None


class Graph:
    def __init__(self, device: Device, capture_id: int = 0):
        self.device = device
        self.capture_id = capture_id
        self.graph = None              # the cudaGraph_t (and, here, its executable)
        self.outputs: list = []        # arrays the captured launches write: what a replay hands out

    def __del__(self):
        if getattr(self, "graph", None) is None or runtime is None:
            return
        runtime.core.wp_cuda_graph_destroy(self.device.context, self.graph)


class wp:  # noqa: N801 - the module name mjlab uses
    @staticmethod
    def init(alias: str, mempool: bool = True) -> None:
        global runtime
        runtime = Runtime(alias, mempool)
        _collector.__init__()

    @staticmethod
    def get_device(alias=None) -> Device:
        return runtime.device

    @staticmethod
    def is_mempool_enabled(device: Device) -> bool:
        return runtime.mempool_enabled

    @staticmethod
    @contextmanager
    def ScopedDevice(device):  # noqa: N802
        yield device

    @staticmethod
    def zeros(shape, dtype=torch.float32, device: Device | None = None) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=runtime.device.alias)

    @staticmethod
    def array(t: torch.Tensor) -> torch.Tensor:
        return t.clone().to(runtime.device.alias)

    @staticmethod
    def launch(kernel, dim, inputs=(), outputs=()) -> None:
        _collector.allocated(LAUNCH_OBJECTS)            # packing the launch's arguments
        dev = runtime.device
        capturing = dev.captures.get(dev.stream)
        if capturing is not None:
            for o in outputs:
                if not any(o is x for x in capturing.outputs):
                    capturing.outputs.append(o)
        kernel(*inputs, *outputs)

    @staticmethod
    def capture_begin(device=None) -> None:
        dev = runtime.device
        name = f"wp.ScopedCapture {runtime.core._next_capture_id}"
        capture_id = runtime.core.wp_cuda_graph_begin_capture(dev.context, dev.stream, name)
        dev.captures[dev.stream] = Graph(dev, capture_id)

    @staticmethod
    def capture_end(device=None) -> Graph:
        dev = runtime.device
        g = dev.captures.pop(dev.stream)
        result = runtime.core.wp_cuda_graph_end_capture(dev.context, dev.stream, g.capture_id)
        if result is None:
            raise RuntimeError(f"CUDA graph capture failed. {runtime.core.error_string}")
        g.graph = result
        return g

    @staticmethod
    def capture_launch(g: Graph) -> None:
        _collector.allocated(CAPTURE_LAUNCH_OBJECTS)
        replay(g.graph, tuple(g.outputs))

    class ScopedCapture:
        def __init__(self, device=None):
            self.device, self.active, self.graph = device, False, None

        def __enter__(self):
            wp.capture_begin(self.device)
            self.active = True
            return self

        def __exit__(self, exc_type, exc_value, traceback):
            if not self.active:
                return False
            self.active = False
            if exc_type is not None:
                dev = runtime.device
                g = dev.captures.pop(dev.stream)
                runtime.core.wp_cuda_graph_abort_capture(g.capture_id, exc_type, exc_value, traceback)
                return False
            self.graph = wp.capture_end(self.device)
            return False


# --- mujoco (the compiled model) and mujoco_warp (cut down) ------------------------------------------------------

class MjModel:
    def __init__(self, stiffness: float):
        self.stiffness, self.nv = stiffness, NV
        self.qpos0 = torch.tensor([0.3, -0.2])
        self.dof_damping = torch.tensor([0.8, 0.5])
        self.actuator_gear = torch.tensor([1.0, 2.0])
        self.qM = torch.tensor([[2.0, 0.5], [0.5, 1.0]])
        self.timestep, self.iterations = TIMESTEP, SOLVER_ITERATIONS


class MjData:
    def __init__(self, model: MjModel):
        self.qpos = model.qpos0.clone()
        self.qvel = torch.zeros(model.nv)


def _passive(dof_damping, jnt_stiffness, qpos0, qpos, qvel, qfrc_passive):
    qfrc_passive.copy_(-dof_damping * qvel - jnt_stiffness * (qpos - qpos0))


def _actuation(actuator_gear, ctrl, qfrc_actuator):
    qfrc_actuator.copy_(actuator_gear * ctrl)


def _smooth(qfrc_passive, qfrc_actuator, qfrc_smooth):
    qfrc_smooth.copy_(qfrc_passive + qfrc_actuator)


def _solver_iteration(qM, qM_diag, qfrc_smooth, qacc):
    qacc.add_((qfrc_smooth - qacc @ qM) / qM_diag)          # Jacobi on M qacc = f (qacc warm-starts)


def _euler(qacc, qvel, qpos, time):
    qvel.add_(TIMESTEP * qacc)
    qpos.add_(TIMESTEP * qvel)
    time.add_(TIMESTEP)


def _reset_data(qpos0, reset, qpos, qvel, qacc, time):
    r = reset[:, None]
    qpos.copy_(torch.where(r, qpos0.expand_as(qpos), qpos))
    qvel.copy_(torch.where(r, torch.zeros_like(qvel), qvel))
    qacc.copy_(torch.where(r, torch.zeros_like(qacc), qacc))
    time.copy_(torch.where(reset, torch.zeros_like(time), time))


class mjwarp:  # noqa: N801 - mujoco_warp
    class Model:
        pass

    class Data:
        pass

    @staticmethod
    def put_model(mjm: MjModel) -> "mjwarp.Model":
        m = mjwarp.Model()
        m.nv, m.iterations = mjm.nv, mjm.iterations
        m.qpos0 = wp.array(mjm.qpos0)
        m.dof_damping = wp.array(mjm.dof_damping)
        m.jnt_stiffness = wp.array(torch.full((mjm.nv,), mjm.stiffness))
        m.actuator_gear = wp.array(mjm.actuator_gear)
        m.qM = wp.array(mjm.qM)
        m.qM_diag = wp.array(torch.diagonal(mjm.qM))
        return m

    @staticmethod
    def put_data(mjm: MjModel, mjd: MjData, nworld: int) -> "mjwarp.Data":
        d = mjwarp.Data()
        d.qpos = wp.array(mjd.qpos.expand(nworld, mjm.nv))
        d.qvel = wp.array(mjd.qvel.expand(nworld, mjm.nv))
        d.qacc = wp.zeros((nworld, mjm.nv))
        d.ctrl = wp.zeros((nworld, mjm.nv))
        d.qfrc_passive = wp.zeros((nworld, mjm.nv))
        d.qfrc_actuator = wp.zeros((nworld, mjm.nv))
        d.qfrc_smooth = wp.zeros((nworld, mjm.nv))
        d.time = wp.zeros(nworld)
        return d

    @staticmethod
    def forward(m, d) -> None:
        nworld = d.qpos.shape[0]
        wp.launch(_passive, nworld, inputs=[m.dof_damping, m.jnt_stiffness, m.qpos0, d.qpos, d.qvel],
                  outputs=[d.qfrc_passive])
        wp.launch(_actuation, nworld, inputs=[m.actuator_gear, d.ctrl], outputs=[d.qfrc_actuator])
        wp.launch(_smooth, nworld, inputs=[d.qfrc_passive, d.qfrc_actuator], outputs=[d.qfrc_smooth])
        for _ in range(m.iterations):
            wp.launch(_solver_iteration, nworld, inputs=[m.qM, m.qM_diag, d.qfrc_smooth], outputs=[d.qacc])

    @staticmethod
    def step(m, d) -> None:
        mjwarp.forward(m, d)
        wp.launch(_euler, d.qpos.shape[0], inputs=[d.qacc], outputs=[d.qvel, d.qpos, d.time])

    @staticmethod
    def reset_data(m, d, reset) -> None:
        wp.launch(_reset_data, d.qpos.shape[0], inputs=[m.qpos0, reset], outputs=[d.qpos, d.qvel, d.qacc, d.time])


# --- src/mjlab/sim/sim.py ------------------------------------------------------------------------------------------

@contextmanager
def _suspend_gc():
    """Temporarily disable the garbage collector.

    Prevents GC from finalizing stale Warp Graph objects during wp.ScopedCapture, which
    would record their destructor calls into the new graph and corrupt it on replay.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class SimulationCfg:
    nconmax = None


class Simulation:
    def __init__(self, num_envs: int, cfg: SimulationCfg, model: MjModel, device: str):
        self.cfg = cfg
        self.device = device
        self.wp_device = wp.get_device(self.device)
        self.num_envs = num_envs

        self._mj_model = model
        self._mj_data = MjData(model)

        with wp.ScopedDevice(self.wp_device):
            self._wp_model = mjwarp.put_model(self._mj_model)
            self._wp_data = mjwarp.put_data(self._mj_model, self._mj_data, nworld=self.num_envs)
            self._reset_mask_wp = wp.zeros(num_envs, dtype=torch.bool)
            self._reset_mask = self._reset_mask_wp          # TorchArray(self._reset_mask_wp)

        self.use_cuda_graph = self._should_use_cuda_graph()
        if self.use_cuda_graph:      # what the graphs read: announced for the workbench
            d = self._wp_data
            events.static_buffers("mjlab Simulation", {"ctrl": d.ctrl, "_reset_mask": self._reset_mask})
            events.persistent_state("mujoco_warp Data", {"qpos": d.qpos, "qvel": d.qvel, "qacc": d.qacc,
                                                         "time": d.time})
            events.written_metadata("mujoco_warp Data", {"qfrc_passive": d.qfrc_passive,
                                                         "qfrc_actuator": d.qfrc_actuator,
                                                         "qfrc_smooth": d.qfrc_smooth})
        self.create_graph()

    def create_graph(self) -> None:
        """Capture CUDA graphs for step, forward, and reset operations."""
        self.step_graph = None
        self.forward_graph = None
        self.reset_graph = None
        self.sense_graph = None
        if self.use_cuda_graph:
            # #821: no collection (and no finalizer of a stale graph) inside the captures below
            suspend = _suspend_gc() if VARIANT["v"] == "fix" else contextlib.nullcontext()
            with suspend, wp.ScopedDevice(self.wp_device):
                with wp.ScopedCapture() as capture:
                    mjwarp.step(self.wp_model, self.wp_data)
                self.step_graph = capture.graph
                with wp.ScopedCapture() as capture:
                    mjwarp.forward(self.wp_model, self.wp_data)
                self.forward_graph = capture.graph
                with wp.ScopedCapture() as capture:
                    mjwarp.reset_data(self.wp_model, self.wp_data, reset=self._reset_mask_wp)
                self.reset_graph = capture.graph

    @property
    def wp_model(self):
        return self._wp_model

    @property
    def wp_data(self):
        return self._wp_data

    @property
    def data(self):
        return self._wp_data

    def forward(self) -> None:
        with wp.ScopedDevice(self.wp_device):
            if self.use_cuda_graph and self.forward_graph is not None:
                wp.capture_launch(self.forward_graph)
            else:
                mjwarp.forward(self.wp_model, self.wp_data)

    def step(self) -> None:
        with wp.ScopedDevice(self.wp_device):
            if self.use_cuda_graph and self.step_graph is not None:
                wp.capture_launch(self.step_graph)
            else:
                mjwarp.step(self.wp_model, self.wp_data)

    def reset(self, env_ids: torch.Tensor | None = None) -> None:
        with wp.ScopedDevice(self.wp_device):
            if env_ids is None:
                self._reset_mask.fill_(True)
            else:
                self._reset_mask.fill_(False)
                self._reset_mask[env_ids] = True
            if self.use_cuda_graph and self.reset_graph is not None:
                wp.capture_launch(self.reset_graph)
            else:
                mjwarp.reset_data(self.wp_model, self.wp_data, reset=self._reset_mask_wp)

    def _should_use_cuda_graph(self) -> bool:
        # (the driver-version check for conditional graphs is left out)
        return self.wp_device.is_cuda and wp.is_mempool_enabled(self.wp_device)


# --- src/mjlab/managers, src/mjlab/envs (cut down) -----------------------------------------------------------------

class ActionCfg:
    scale = 2.0


class ManagerBasedRlEnvCfg:
    def __init__(self, stiffness: float):
        self.stiffness = stiffness
        self.num_envs, self.decimation, self.episode_steps = NUM_ENVS, DECIMATION, EPISODE_STEPS
        self.sim, self.actions = SimulationCfg(), ActionCfg()


class ManagerBase:
    def __init__(self, cfg, env: "ManagerBasedRlEnv"):
        self.cfg = cfg
        self._env = env                 # every manager keeps its env: env <-> managers is a reference cycle


class EventManager(ManagerBase):
    def apply(self, mode: str, env_ids=None) -> None:
        if mode == "reset":
            self._env.sim.reset(env_ids)     # reset_scene_to_default


class ActionManager(ManagerBase):
    def process_action(self, action: torch.Tensor) -> None:
        self._processed_actions = action * self.cfg.scale

    def apply_action(self) -> None:
        self._env.sim.data.ctrl.copy_(self._processed_actions)


class ManagerBasedRlEnv:
    def __init__(self, cfg: ManagerBasedRlEnvCfg, device: str):
        self.cfg = cfg
        self.sim = Simulation(num_envs=cfg.num_envs, cfg=cfg.sim, model=MjModel(cfg.stiffness), device=device)
        self.episode_length_buf = (torch.arange(cfg.num_envs) % cfg.episode_steps).to(device)
        self.load_managers()

    def load_managers(self) -> None:
        self.event_manager = EventManager(None, self)
        self.action_manager = ActionManager(self.cfg.actions, self)

    def reset(self) -> None:
        self._reset_idx(None)
        self.sim.forward()

    def _reset_idx(self, env_ids) -> None:
        self.event_manager.apply(mode="reset", env_ids=env_ids)
        if env_ids is None:
            self.episode_length_buf.zero_()
        else:
            self.episode_length_buf[env_ids] = 0

    def step(self, action: torch.Tensor) -> torch.Tensor:
        self.action_manager.process_action(action)
        for _ in range(self.cfg.decimation):
            self.action_manager.apply_action()
            self.sim.step()
        self.episode_length_buf += 1
        self.sim.forward()
        obs = self.sim.data.qpos.clone()
        reset_env_ids = (self.episode_length_buf >= self.cfg.episode_steps).nonzero().flatten()
        if len(reset_env_ids) > 0:
            self._reset_idx(reset_env_ids)
            self.sim.forward()
        return obs


# --- the workload: two environments built one after the other in one process --------------------------------------

def rollout(cfg: ManagerBasedRlEnvCfg, device: str, seed: int) -> list[torch.Tensor]:
    env = ManagerBasedRlEnv(cfg, device)
    gen = generator(seed)
    env.reset()
    return [env.step(randn(cfg.num_envs, NV, gen=gen, device=device)) for _ in range(ROLLOUT_STEPS)]
    # on return the env (a cycle with its managers, holding its Simulation and graphs) is garbage that only the
    # cyclic collector frees


def run(variant: str, device: str = "cpu"):
    VARIANT["v"] = variant
    was_enabled = _cpython_gc.isenabled()

    def serve(mempool: bool):
        _cpython_gc.collect()                      # no garbage left from earlier work
        wp.init(device, mempool=mempool)           # mempool off: mjlab runs without CUDA graphs
        return (rollout(ManagerBasedRlEnvCfg(stiffness=4.0), device, seed=821)
                + rollout(ManagerBasedRlEnvCfg(stiffness=9.0), device, seed=822))

    _cpython_gc.collect()
    _cpython_gc.freeze()         # what exists already is never collected: the stand-in's collections stay cheap
    _cpython_gc.disable()        # collections run where the stand-in collector runs them
    try:
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
    finally:
        _cpython_gc.collect()    # no capture open: graphs still waiting are destroyed here
        _cpython_gc.unfreeze()
        if was_enabled:
            _cpython_gc.enable()
