"""Domain randomisation is silently ignored under CUDA graphs: the step graph keeps reading the model arrays that field expansion replaced.

Upstream: https://github.com/mujocolab/mjlab/pull/415 ("Recreate CUDA graph in expand_model_fields after replacing
arrays.", merged; opened after #413 of 2025-12-12, merge date not read). An earlier fix of the same family: #31
("Re-capture graph after domain randomization.", diff not read).
Symptom: with CUDA graphs on (CUDA device, Warp mempool), tasks whose domain randomisation runs in ``reset`` (or
``interval``) mode and has no ``startup`` event train on the nominal physics: every world steps with the nominal
friction and mass whatever the randomisation wrote. Correct with graphs off or on the CPU. The class docstring the
PR adds: "A captured graph holds pointers to the GPU arrays that existed at capture time. If those arrays are later
replaced (e.g., via ``expand_model_fields()``), the graph will still read from the old arrays, silently ignoring any
new values."
Mechanism: ``Simulation.__init__`` (src/mjlab/sim/sim.py) calls ``create_graph()``, which captures
``mjwarp.step(self.wp_model, self.wp_data)`` and ``mjwarp.forward(...)`` under ``wp.ScopedCapture``: the graphs hold
the addresses of the model arrays ``put_model`` made (leading world dimension 1, shared by all worlds). Then
``ManagerBasedRlEnv.load_managers`` calls ``Simulation.expand_model_fields(domain_randomization_fields)``, which
calls ``mjlab.sim.randomization.expand_model_fields``: for each field, ``setattr(model, field, tile(array))`` with a
new ``nworld``-row array (``repeat_array_kernel``), dropping the last reference to the old one (a Warp ``Graph``
retains only module executables, not argument arrays), and ``self._model_bridge.clear_cache()``. No recapture
there; ``load_managers`` recaptured only ``if "startup" in self.event_manager.available_modes``. ``randomize_field``
events then write per-world values through ``env.sim.model`` into the new arrays, while every
``wp.capture_launch(self.step_graph)`` reads the released pre-expansion arrays (still holding the nominal values,
or whatever the mempool put there since). Eager ``mjwarp.step`` looks the attributes up at each call and sees the
new arrays.
Doctor: dangling-reference, at expand_model_fields (it rebinds the model fields to new per-world arrays and releases
the arrays the already captured step/forward graphs read, without recapturing them; every later replay reads the
released memory).
Fix (upstream): ``Simulation.expand_model_fields`` ends with ``self.create_graph()`` ("Field expansion allocates new
arrays and replaces them via setattr. The CUDA graph captured the old memory addresses, so we must recreate it.");
``create_graph`` and the class gain docstrings saying so.
Modelled: Warp arrays are torch tensors and ``wp.ScopedCapture``/``wp.capture_launch`` the kit's ``capture``/
``replay`` (no warmup: ScopedCapture only loads modules); mjwarp is a frictional slider per world (``forward``:
damping, sliding friction ``geom_friction[:, box, 0] * body_mass * g``, control; ``step``: forward + semi-implicit
Euler), and the captured callables return the data arrays they advance so the runner can hand them out; one
``reset``-mode ``randomize_field`` term per field (``abs`` operation), ``reset_scene_to_default``, a time-out
termination; no reset/sense graphs, nan guard, command/reward/observation managers. CPU graphs use
``on_freed="reuse"``: the released arrays keep their bytes, as a Warp mempool block does until it is handed on.
"""

from dataclasses import dataclass

import torch

from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/mujocolab/mjlab/pull/415"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "expand_model_fields"
SYMPTOM = "after domain-randomisation field expansion the step graph still reads the released nominal model arrays"

NUM_ENVS, NV, NGEOM, NBODY, BOX_GEOM, BOX_BODY = 4, 2, 2, 2, 1, 1
TIMESTEP, DECIMATION, GRAVITY, VEL_EPS = 0.01, 2, 9.81, 0.05
EPISODE_STEPS, ENV_STEPS = 3, 7


# --- mujoco_warp (mjwarp): Model/Data and the kernels the graphs capture -------------------------

@dataclass
class Model:
    """``mjwarp.Model``: batched fields have a leading world dimension (1 until expanded)."""
    body_mass: torch.Tensor        # [1 | nworld, nbody]
    geom_friction: torch.Tensor    # [1 | nworld, ngeom, 3]
    dof_damping: torch.Tensor      # [1 | nworld, nv]


@dataclass
class Data:
    qpos: torch.Tensor
    qvel: torch.Tensor
    qacc: torch.Tensor
    ctrl: torch.Tensor
    qfrc_passive: torch.Tensor
    qfrc_constraint: torch.Tensor


def put_model(mjm: dict, device: str) -> Model:
    return Model(**{k: v.to(device, copy=True)[None] for k, v in mjm.items()})


def put_data(nworld: int, device: str) -> Data:
    return Data(*(torch.zeros(nworld, NV, device=device) for _ in range(6)))


def forward(m: Model, d: Data) -> None:
    """Kernels index batched fields by ``worldid % field.shape[0]`` (here: broadcasting a leading 1)."""
    mass = m.body_mass[:, BOX_BODY:BOX_BODY + 1]
    mu = m.geom_friction[:, BOX_GEOM, 0:1]
    d.qfrc_passive.copy_(-m.dof_damping * d.qvel)
    d.qfrc_constraint.copy_(-mu * mass * GRAVITY * torch.tanh(d.qvel / VEL_EPS))
    d.qacc.copy_((d.ctrl + d.qfrc_passive + d.qfrc_constraint) / mass)


def step(m: Model, d: Data) -> None:
    forward(m, d)
    d.qvel.add_(d.qacc * TIMESTEP)
    d.qpos.add_(d.qvel * TIMESTEP)


# --- mjlab.sim.randomization -------------------------------------------------------------------

def expand_model_fields(model: Model, nworld: int, fields_to_expand: list[str]) -> None:
    if nworld == 1:
        return

    def tile(x: torch.Tensor) -> torch.Tensor:
        new_shape = list(x.shape)
        new_shape[0] = nworld
        dst = torch.empty(new_shape, dtype=x.dtype, device=x.device)
        src_flat, dst_flat = x.flatten(), dst.view(-1)
        n_elems_per_world = dst_flat.shape[0] // nworld
        tid = torch.arange(dst_flat.shape[0], device=x.device)
        dst_flat.copy_(src_flat[tid % n_elems_per_world])            # repeat_array_kernel
        return dst

    for field in model.__dataclass_fields__:
        if field in fields_to_expand:
            array = getattr(model, field)
            setattr(model, field, tile(array))                         # the old array's last reference goes


# --- mjlab.sim ---------------------------------------------------------------------------------

class WarpBridge:
    """Exposes the struct's arrays as torch tensors (zero copy), caching the wrappers."""

    def __init__(self, struct):
        object.__setattr__(self, "_struct", struct)
        object.__setattr__(self, "_wrapped_cache", {})

    def __getattr__(self, name):
        if name not in self._wrapped_cache:
            self._wrapped_cache[name] = getattr(self._struct, name)      # TorchArray(wp.to_torch(val))
        return self._wrapped_cache[name]

    def clear_cache(self):
        self._wrapped_cache.clear()


class Simulation:
    def __init__(self, num_envs, mj_model, device, variant, use_cuda_graph):
        self.num_envs, self.device, self.variant = num_envs, device, variant
        self._mj_model = mj_model
        self._wp_model = put_model(mj_model, device)
        self._wp_data = put_data(num_envs, device)
        self._model_bridge, self._data_bridge = WarpBridge(self._wp_model), WarpBridge(self._wp_data)
        self.use_cuda_graph = use_cuda_graph        # wp_device.is_cuda and wp.is_mempool_enabled(...)
        self.create_graph()

    @property
    def wp_model(self):
        return self._wp_model

    @property
    def wp_data(self):
        return self._wp_data

    @property
    def model(self):
        return self._model_bridge

    @property
    def data(self):
        return self._data_bridge

    def create_graph(self) -> None:
        self.step_graph = None
        self.forward_graph = None
        if self.use_cuda_graph:
            d = self.wp_data
            announce = dict(device=self.device, warmups=0, on_freed="reuse", owner="mjlab Simulation (wp.ScopedCapture)",
                            static={"ctrl": d.ctrl}, state={"qpos": d.qpos, "qvel": d.qvel})

            def _step():
                step(self.wp_model, self.wp_data)
                return self.wp_data.qpos, self.wp_data.qvel, self.wp_data.qacc

            def _forward():
                forward(self.wp_model, self.wp_data)
                return self.wp_data.qacc

            self.step_graph, self._step_out = capture(_step, name="mjwarp.step", **announce)
            self.forward_graph, self._forward_out = capture(_forward, name="mjwarp.forward", **announce)

    def expand_model_fields(self, fields: list[str]) -> None:
        """Expand model fields to support per-environment parameters."""
        if not fields:
            return
        invalid_fields = [f for f in fields if f not in self._mj_model]
        if invalid_fields:
            raise ValueError(f"Fields not found in model: {invalid_fields}")
        expand_model_fields(self._wp_model, self.num_envs, list(fields))
        self._model_bridge.clear_cache()
        if self.variant == "fix":
            # Field expansion allocates new arrays and replaces them via setattr. The
            # CUDA graph captured the old memory addresses, so we must recreate it.
            self.create_graph()

    def forward(self) -> None:
        if self.use_cuda_graph and self.forward_graph is not None:
            replay(self.forward_graph, self._forward_out)               # wp.capture_launch
        else:
            forward(self.wp_model, self.wp_data)

    def step(self) -> None:
        if self.use_cuda_graph and self.step_graph is not None:
            replay(self.step_graph, self._step_out)                     # wp.capture_launch
        else:
            step(self.wp_model, self.wp_data)


# --- mjlab.envs.mdp.events / mjlab.managers.event_manager ---------------------------------------

def reset_scene_to_default(env, env_ids):
    env.sim.data.qpos[env_ids] = env.default_qpos
    env.sim.data.qvel[env_ids] = 0.0


def randomize_field(env, env_ids, field, ranges, operation="abs", entity_ids=(), axes=None):
    model_field = getattr(env.sim.model, field)
    entity_indices = torch.tensor(entity_ids, device=env.device)
    env_grid, entity_grid = torch.meshgrid(env_ids, entity_indices, indexing="ij")
    lo, hi = ranges
    random_values = (torch.rand(tuple(env_grid.shape), generator=env.rng) * (hi - lo) + lo).to(env.device)
    if axes is None:
        model_field[env_grid, entity_grid] = random_values
    else:
        for axis in axes:
            model_field[env_grid, entity_grid, axis] = random_values


@dataclass
class EventTermCfg:
    func: object
    mode: str
    params: dict


class EventManager:
    def __init__(self, cfg: dict, env):
        self._env, self._mode_term_cfgs, self._domain_randomization_fields = env, {}, []
        for term_cfg in cfg.values():
            self._mode_term_cfgs.setdefault(term_cfg.mode, []).append(term_cfg)
            if term_cfg.func.__name__ == "randomize_field":
                field_name = term_cfg.params["field"]
                if field_name not in self._domain_randomization_fields:
                    self._domain_randomization_fields.append(field_name)

    @property
    def available_modes(self):
        return list(self._mode_term_cfgs)

    @property
    def domain_randomization_fields(self):
        return self._domain_randomization_fields

    def apply(self, mode, env_ids=None):
        if env_ids is None:
            env_ids = torch.arange(self._env.num_envs, device=self._env.device)
        for term_cfg in self._mode_term_cfgs[mode]:
            term_cfg.func(self._env, env_ids, **term_cfg.params)


EVENTS = {                                           # a velocity-task style config: DR on reset only
    "reset_scene_to_default": EventTermCfg(reset_scene_to_default, "reset", {}),
    "foot_friction": EventTermCfg(randomize_field, "reset", dict(field="geom_friction", ranges=(0.2, 1.2),
                                                                 entity_ids=(BOX_GEOM,), axes=(0,))),
    "base_mass": EventTermCfg(randomize_field, "reset", dict(field="body_mass", ranges=(0.5, 2.0),
                                                             entity_ids=(BOX_BODY,))),
}


# --- mjlab.envs.manager_based_rl_env -------------------------------------------------------------

class ManagerBasedRlEnv:
    def __init__(self, mj_model, default_qpos, device, variant, use_cuda_graph):
        self.num_envs, self.device, self.default_qpos = NUM_ENVS, device, default_qpos
        self.rng = generator(4150)                                       # torch.rand of the DR terms
        self.sim = Simulation(NUM_ENVS, mj_model, device, variant, use_cuda_graph)
        self.episode_length_buf = torch.zeros(NUM_ENVS, dtype=torch.long, device=device)
        self.load_managers()

    def load_managers(self) -> None:
        self.event_manager = EventManager(EVENTS, self)
        self.sim.expand_model_fields(self.event_manager.domain_randomization_fields)
        # (action, observation, termination, reward, curriculum managers)
        if "startup" in self.event_manager.available_modes:
            self.event_manager.apply(mode="startup")
            self.sim.create_graph()

    def reset(self):
        self._reset_idx(torch.arange(self.num_envs, device=self.device))
        self.sim.forward()
        return self._observations()

    def step(self, action):
        self.sim.data.ctrl[:] = action                                   # action_manager.apply_action()
        for _ in range(DECIMATION):
            self.sim.step()
        self.episode_length_buf += 1
        reset_env_ids = (self.episode_length_buf >= EPISODE_STEPS).nonzero(as_tuple=False).squeeze(-1)
        if len(reset_env_ids) > 0:
            self._reset_idx(reset_env_ids)
            self.sim.forward()
        return self._observations()

    def _reset_idx(self, env_ids):
        if "reset" in self.event_manager.available_modes:
            self.event_manager.apply(mode="reset", env_ids=env_ids)
        self.episode_length_buf[env_ids] = 0

    def _observations(self):
        d = self.sim.data
        return torch.cat([d.qpos, d.qvel, d.qacc], dim=1).clone()


def run(variant: str, device: str = "cpu"):
    gen = generator(415)
    mj_model = {"body_mass": torch.tensor([0.0, 1.0]),
                "geom_friction": torch.tensor([[1.0, 0.005, 1e-4], [0.6, 0.005, 1e-4]]),
                "dof_damping": torch.full((NV,), 0.3)}
    default_qpos = torch.randn(NV, generator=gen).to(device)
    actions = [(torch.randn(NUM_ENVS, NV, generator=gen) * 8.0).to(device) for _ in range(ENV_STEPS)]

    def serve(graphed: bool):
        env = ManagerBasedRlEnv(mj_model, default_qpos, device, variant, use_cuda_graph=graphed)
        outs = [env.reset()]
        for action in actions:
            outs.append(env.step(action))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
