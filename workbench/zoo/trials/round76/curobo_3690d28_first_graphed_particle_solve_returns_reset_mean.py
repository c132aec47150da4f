"""cuRobo's particle optimiser returns its live ``mean_action`` buffer; the first call with CUDA graphs on builds the graph after the solve, and graph setup (warm-up solves, ``reset()``) overwrites that buffer before the caller reads it.

Upstream: https://github.com/NVlabs/curobo/commit/3690d28c54ee4ba23e2d7cc03a89a5845e4f9546 ("Isaac Sim 4.0 support,
Kinematics API doc, Windows support", the v0.7.4 release commit, 2024-07-20; no separate PR or issue; CHANGELOG:
"Change order of operations in cuda graph capture of particle opt to get correct results during graph capture phase"
and "Cuda graph capture of optimization iterations resets solver before recording").
Symptom: the first MPPI solve after the solver is built with ``use_cuda_graph=True`` (the first MPC step, the
particle seed of IK / trajopt) returns the optimiser's initial mean instead of the optimised action sequence; the
MPC then commands it and seeds the next step from it. Without graphs the same solve is right.
Mechanism: ``ParticleOptBase._optimize`` (src/curobo/opt/particle/particle_opt_base.py) ran, while ``cu_opt_init``
was False, the solve eagerly (``curr_action_seq = self._run_opt_iters(init_act, ...)``) and only then
``self._initialize_cuda_graph(init_act, ...)``. ``_run_opt_iters`` ends with
``self._get_action_seq(mode=self.sample_mode)``, and ``ParallelMPPI._get_action_seq`` (parallel_mppi.py) returns
``self.mean_action`` itself for ``SampleMode.MEAN`` (``act_seq = self.mean_action  # .clone()``; ``BEST`` returns
``self.best_traj``, likewise). ``_initialize_cuda_graph`` then runs three warm-up ``_run_opt_iters`` (each
``update_seed`` -> ``update_init_mean`` -> ``copy_tensor(init_mean, self.mean_action)`` and
``_update_distribution`` -> ``self.mean_action.copy_(new_mean)``), then ``self.reset()`` (``reset_distribution`` ->
``reset_mean`` copies ``init_mean`` into ``mean_action`` and ``reset_covariance`` the initial covariance into
``cov_action``/``scale_tril``), then records ``_run_opt_iters(self._cu_act_in)``, which executes nothing. ``_optimize``
returns ``curr_action_seq``: the storage of ``mean_action``, which now holds the reset initial mean. The reset also
discards the covariance the first solve adapted, so the first replay (second call) starts from the initial
covariance where the eager optimiser carries the adapted one. Later replays return
``self._cu_act_seq.detach().clone()``.
Doctor: overwritten-output, at _optimize (the action sequence the first graphed call hands back is a view of the
optimiser's persistent ``mean_action``; graph setup, the warm-up solves and the ``reset()`` that ``_optimize``
runs after taking that result, overwrite its memory before the caller reads it; the fix reorders ``_optimize`` so that
the graph is built first and the result is the clone taken after the first replay).
Fix (upstream): ``_optimize`` builds the graph first when ``use_cuda_graph`` and not ``cu_opt_init``
(``self._initialize_cuda_graph(init_act.clone(), shift_steps=shift_steps)``) and then always takes the result from
``self._call_cuda_opt_iters(init_act)``; ``_initialize_cuda_graph`` calls ``self.reset()`` before its warm-ups too
(and waits on the capture stream after recording). The same commit makes the same reset-before-capture change in
``NewtonOptBase._create_opt_iters_graph``.
Modelled: ``ParallelMPPI`` with the DIAG_A covariance, ``update_cov``, fixed samples (the last sample zero: the mean
itself is a particle), no null/negative particles, ``random_mean=False`` and ``sample_mode=MEAN`` (the mode of
particle_ik.yml / particle_trajopt.yml; particle_mpc.yml uses BEST, whose ``best_traj`` is aliased and reset alike);
``jit_mean_cov_diag_a`` and the blend functions as upstream. The rollout is a toy reacher: position actions, a
goal-reaching and a smoothness cost from the current state (``ArmReacher``); its goal buffers are written in place by
``update_params``. The driver is ``WrapMpc.solve`` (seed from the shifted previous solution, ``shift_steps=1``; the
particle ``_shift`` is a no-op upstream too) over four MPC steps; ``get_robot_command`` is left out and the step's
``act_seq`` is read as the command. Side streams, ``calculate_value``, debug storage and the profiler are left out.
Sizes: 2 problems, 16 particles, horizon 6, 3 joints, 4 iterations.
"""
from __future__ import annotations

import dataclasses
import enum

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/NVlabs/curobo/commit/3690d28c54ee4ba23e2d7cc03a89a5845e4f9546"
FAMILY = "persistent-buffer mutation"
KIND = "overwritten-output"
SITE = "_optimize"
SYMPTOM = ("first MPPI solve with cuda graphs returns the reset initial mean: the returned mean_action buffer is "
           "overwritten by the graph's warm-up solves and reset() before the caller reads it")

N_PROBLEMS, NUM_PARTICLES, HORIZON, D_ACTION = 2, 16, 6, 3
N_ITERS = 4
MPC_STEPS = 4
_variant = {"v": "bug"}


# --- curobo/rollout --------------------------------------------------------------------------------

@dataclasses.dataclass
class Trajectory:
    actions: torch.Tensor
    costs: torch.Tensor


@dataclasses.dataclass
class Goal:
    goal_state: torch.Tensor        # [n_problems, d_action] joint-space target
    current_state: torch.Tensor     # [n_problems, d_action]


class ArmReacher:
    """A toy reacher rollout: the action is the joint position at each step of the horizon."""

    def __init__(self, retract_config: torch.Tensor, device):
        self.retract_config = retract_config
        self.action_lows = torch.full((D_ACTION,), -1.5, device=device)
        self.action_highs = torch.full((D_ACTION,), 1.5, device=device)
        self._goal_state = torch.zeros(N_PROBLEMS, D_ACTION, device=device)
        self._current_state = torch.zeros(N_PROBLEMS, D_ACTION, device=device)

    def update_params(self, goal: Goal):
        self._goal_state.copy_(goal.goal_state)
        self._current_state.copy_(goal.current_state)

    def get_init_action_seq(self) -> torch.Tensor:
        return self.retract_config.view(1, 1, D_ACTION).repeat(N_PROBLEMS, HORIZON, 1)

    def rollout_fn(self, act: torch.Tensor) -> Trajectory:
        a = act.view(N_PROBLEMS, -1, HORIZON, D_ACTION)
        goal_cost = ((a - self._goal_state[:, None, None, :]) ** 2).sum(-1)
        prev = torch.cat((self._current_state[:, None, None, :].expand(-1, a.shape[1], 1, -1), a[:, :, :-1]), dim=2)
        smooth_cost = 0.5 * ((a - prev) ** 2).sum(-1)
        return Trajectory(actions=act, costs=(goal_cost + smooth_cost).view(act.shape[0], HORIZON))

    def __call__(self, act: torch.Tensor) -> Trajectory:
        return self.rollout_fn(act)

    def reset(self):
        pass


def scale_ctrl(ctrl, action_lows, action_highs, squash_fn="CLAMP"):
    return torch.max(torch.min(ctrl, action_highs), action_lows)


def copy_tensor(new_tensor, mem_tensor) -> bool:
    if mem_tensor is not None and new_tensor.shape == mem_tensor.shape:
        mem_tensor.copy_(new_tensor)
        return True
    return False


# --- curobo/opt/opt_base.py ----------------------------------------------------------------------

class Optimizer:
    def __init__(self, rollout_fn: ArmReacher, use_cuda_graph: bool, device):
        self.rollout_fn, self.use_cuda_graph, self.device = rollout_fn, use_cuda_graph, device

    def optimize(self, opt_tensor: torch.Tensor, shift_steps=0, n_iters=None) -> torch.Tensor:
        return self._optimize(opt_tensor, shift_steps, n_iters)

    def update_params(self, goal: Goal):
        self.rollout_fn.update_params(goal)

    def reset(self):
        self.rollout_fn.reset()


# --- curobo/opt/particle/particle_opt_base.py ----------------------------------------------------

class SampleMode(enum.Enum):
    MEAN = 0
    BEST = 1


class ParticleOptBase(Optimizer):
    def __init__(self, rollout_fn, use_cuda_graph, device):
        super().__init__(rollout_fn, use_cuda_graph, device)
        self.n_iters = N_ITERS
        self.n_problems, self.particles_per_problem = N_PROBLEMS, NUM_PARTICLES
        self.total_num_particles = N_PROBLEMS * NUM_PARTICLES
        self.action_horizon, self.d_action = HORIZON, D_ACTION
        self.gamma_seq = torch.ones(1, HORIZON, device=device)        # gamma = 1.0
        self.num_steps = 0
        self.cu_opt_init = False

    def generate_rollouts(self, init_act=None):
        act_seq = self.sample_actions(init_act)
        return self.rollout_fn(act_seq)

    def _optimize(self, init_act: torch.Tensor, shift_steps=0, n_iters=None):
        n_iters = n_iters if n_iters is not None else self.n_iters
        if _variant["v"] == "fix":                                          # 3690d28
            if self.use_cuda_graph:
                if not self.cu_opt_init:
                    self._initialize_cuda_graph(init_act.clone(), shift_steps=shift_steps)
                curr_action_seq = self._call_cuda_opt_iters(init_act)
            else:
                curr_action_seq = self._run_opt_iters(init_act, n_iters=n_iters, shift_steps=shift_steps)
        else:
            # create cuda graph:
            if self.use_cuda_graph and self.cu_opt_init:
                curr_action_seq = self._call_cuda_opt_iters(init_act)
            elif self.use_cuda_graph:
                with events.warmup(real=True):         # the lazily capturing runner's real first step
                    curr_action_seq = self._run_opt_iters(init_act, n_iters=n_iters, shift_steps=shift_steps)
            else:
                curr_action_seq = self._run_opt_iters(init_act, n_iters=n_iters, shift_steps=shift_steps)
            if self.use_cuda_graph:
                if not self.cu_opt_init:
                    self._initialize_cuda_graph(init_act, shift_steps=shift_steps)
        self.num_steps += 1
        return curr_action_seq

    def _initialize_cuda_graph(self, init_act: torch.Tensor, shift_steps=0):
        if _variant["v"] == "fix":
            self.reset()                                                    # 3690d28
        self._cu_act_in = init_act.detach().clone()
        # (upstream: on a side stream s that waits on the current stream)
        for _ in range(3):
            with events.warmup():
                self._cu_act_seq = self._run_opt_iters(self._cu_act_in, shift_steps=shift_steps)
        self.reset()
        self.cu_opt_graph, self._cu_act_seq = capture(
            lambda: self._run_opt_iters(self._cu_act_in, shift_steps=shift_steps), device=self.device, warmups=0,
            name="ParticleOptBase opt iters", owner="ParticleOptBase",
            static={"_cu_act_in": self._cu_act_in, "goal_state": self.rollout_fn._goal_state,
                    "current_state": self.rollout_fn._current_state},
            state={"mean_action": self.mean_action, "best_traj": self.best_traj, "cov_action": self.cov_action,
                   "scale_tril": self.scale_tril})
        self.cu_opt_init = True

    def _call_cuda_opt_iters(self, init_act: torch.Tensor):
        self._cu_act_in.copy_(init_act.detach())
        out = replay(self.cu_opt_graph, self._cu_act_seq)
        return out.detach().clone()

    def _shift(self, shift_steps=0):
        return

    def _run_opt_iters(self, init_act: torch.Tensor, shift_steps=0, n_iters=None):
        n_iters = n_iters if n_iters is not None else self.n_iters
        self._shift(shift_steps)
        self.update_seed(init_act)
        for _ in range(n_iters):
            trajectory = self.generate_rollouts()
            trajectory.actions = trajectory.actions.view(
                self.n_problems, self.particles_per_problem, self.action_horizon, self.d_action)
            trajectory.costs = trajectory.costs.view(self.n_problems, self.particles_per_problem, HORIZON)
            self._update_distribution(trajectory)
        curr_action_seq = self._get_action_seq(mode=self.sample_mode)
        return curr_action_seq

    def reset(self):
        self.num_steps = 0
        super().reset()


# --- curobo/opt/particle/parallel_mppi.py --------------------------------------------------------

def jit_calculate_exp_util_from_costs(costs, gamma_seq, beta: float):
    cost_seq = gamma_seq * costs
    cost_seq = torch.sum(cost_seq, dim=-1, keepdim=False) / gamma_seq[..., 0]
    return torch.softmax((-1.0 / beta) * cost_seq, dim=-1)


def jit_diag_a_cov_update(w, actions, mean_action):
    delta_actions = actions - mean_action.unsqueeze(-3)
    weighted_delta = w * (delta_actions ** 2)
    return torch.mean(torch.sum(weighted_delta, dim=-2), dim=-2).unsqueeze(-2)


def jit_blend_cov(cov_action, cov_update, step_size_cov: float, kappa: float):
    return (1.0 - step_size_cov) * cov_action + step_size_cov * cov_update + kappa


def jit_blend_mean(mean_action, new_mean, step_size_mean: float):
    return (1.0 - step_size_mean) * mean_action + step_size_mean * new_mean


def jit_mean_cov_diag_a(costs, actions, gamma_seq, mean_action, cov_action, step_size_mean: float,
                        step_size_cov: float, kappa: float, beta: float):
    w = jit_calculate_exp_util_from_costs(costs, gamma_seq, beta)
    w = w.unsqueeze(-1).unsqueeze(-1)
    new_mean = torch.sum(w * actions, dim=-3)
    new_mean = jit_blend_mean(mean_action, new_mean, step_size_mean)
    cov_update = jit_diag_a_cov_update(w, actions, mean_action)
    new_cov = jit_blend_cov(cov_action, cov_update, step_size_cov, kappa)
    new_tril = torch.sqrt(new_cov)
    return new_mean, new_cov, new_tril


class ParallelMPPI(ParticleOptBase):
    def __init__(self, rollout_fn, sample_set, use_cuda_graph, device):
        super().__init__(rollout_fn, use_cuda_graph, device)
        self.init_mean = rollout_fn.get_init_action_seq().clone()
        self.init_cov = torch.tensor([0.5], device=device)
        self.step_size_mean, self.step_size_cov, self.kappa, self.beta = 0.9, 0.1, 0.01, 1.0
        self.sample_mode = SampleMode.MEAN
        self.action_lows, self.action_highs = rollout_fn.action_lows, rollout_fn.action_highs
        self.problem_col = torch.arange(N_PROBLEMS, device=device)
        self._given_samples = sample_set
        self._sample_set = None
        self.mean_action = None
        self.best_traj = None
        self.cov_action = None
        self.scale_tril = None
        self.reset_distribution()
        self.update_samples()

    def reset_distribution(self):
        self.reset_mean()
        self.reset_covariance()

    def update_samples(self):
        """Fixed samples: one set, the last particle of each problem zero (the mean itself)."""
        s_set = self._given_samples.clone()
        s_set[:, :, -1, :, :] = 0.0
        if not copy_tensor(s_set, self._sample_set):
            self._sample_set = s_set

    def _update_distribution(self, trajectories: Trajectory):
        costs, actions = trajectories.costs, trajectories.actions
        if self.sample_mode == SampleMode.BEST:
            w = jit_calculate_exp_util_from_costs(costs, self.gamma_seq, self.beta)
            best_idx = torch.argmax(w, dim=-1)
            self.best_traj.copy_(actions[self.problem_col, best_idx])
        new_mean, new_cov, new_scale_tril = jit_mean_cov_diag_a(
            costs, actions, self.gamma_seq, self.mean_action, self.cov_action, self.step_size_mean,
            self.step_size_cov, self.kappa, self.beta)
        self.scale_tril.copy_(new_scale_tril)
        self.cov_action.copy_(new_cov)
        self.mean_action.copy_(new_mean)

    def sample_actions(self, init_act):
        delta = self._sample_set[0]                                # fixed samples
        scaled_delta = delta * self.full_scale_tril
        act_seq = self.mean_action.unsqueeze(-3) + scaled_delta
        act_seq = act_seq.reshape(self.total_num_particles, self.action_horizon, self.d_action)
        return scale_ctrl(act_seq, self.action_lows, self.action_highs, squash_fn="CLAMP")

    def update_seed(self, init_act):
        self.update_init_mean(init_act)

    def update_init_mean(self, init_mean):
        if init_mean.shape[0] != self.n_problems:
            init_mean = init_mean.expand(self.n_problems, -1, -1)
        if not copy_tensor(init_mean, self.mean_action):
            self.mean_action = init_mean.clone()
        if not copy_tensor(init_mean, self.best_traj):
            self.best_traj = init_mean.clone()

    def reset_mean(self):
        self.update_init_mean(self.init_mean)

    def reset_covariance(self):
        init_cov = self.init_cov.clone()
        init_cov = init_cov.unsqueeze(-1).expand(-1, self.d_action).unsqueeze(1)
        if init_cov.shape[0] != self.n_problems:
            init_cov = init_cov.expand(self.n_problems, -1, -1)
        if not copy_tensor(init_cov.clone(), self.cov_action):
            self.cov_action = init_cov.clone()
        a = torch.sqrt(self.cov_action)
        if not copy_tensor(a, self.scale_tril):
            self.scale_tril = a

    def _get_action_seq(self, mode: SampleMode):
        if mode == SampleMode.MEAN:
            act_seq = self.mean_action  # .clone()
        elif mode == SampleMode.BEST:
            act_seq = self.best_traj
        else:
            raise ValueError("Unidentified sampling mode in get_next_action")
        return act_seq

    @property
    def full_scale_tril(self):
        return self.scale_tril.unsqueeze(-2).expand(-1, -1, self.action_horizon, -1)

    def reset(self):
        self.reset_distribution()
        self.update_samples()
        super().reset()


# --- curobo/wrap/wrap_mpc.py ---------------------------------------------------------------------

class WrapMpc:
    def __init__(self, optimizers, safety_rollout):
        self.optimizers, self.safety_rollout = optimizers, safety_rollout
        self._init_act_seq = None

    def get_init_act(self):
        return self.safety_rollout.get_init_action_seq()

    def update_params(self, goal: Goal):
        for opt in self.optimizers:
            opt.update_params(goal)

    def optimize(self, act_seq: torch.Tensor, shift_steps: int = 0) -> torch.Tensor:
        for opt in self.optimizers:
            act_seq = opt.optimize(act_seq, shift_steps)
        return act_seq

    def _shift(self, act_seq, shift_steps=1):
        act_seq = act_seq.roll(-shift_steps, 1)
        act_seq[:, -shift_steps:, :] = act_seq[:, -shift_steps - 1: -shift_steps, :].clone()
        return act_seq

    def solve(self, goal: Goal, seed=None, shift_steps=1):
        if seed is None and self._init_act_seq is None:
            seed = self.get_init_act()
        elif self._init_act_seq is not None:
            seed = self._init_act_seq
        else:
            seed = seed.detach().clone()
        self.update_params(goal)
        act_seq = self.optimize(seed, shift_steps=shift_steps)
        self._init_act_seq = self._shift(act_seq, shift_steps=shift_steps)
        return act_seq


def run(variant: str, device: str = "cpu"):
    _variant["v"] = variant
    gen = generator(3690)
    retract_config = (torch.randn(D_ACTION, generator=gen) * 0.2).to(device)
    # smooth samples (upstream: filtered Halton / knot samples): an offset per particle plus a little per-step noise
    sample_set = (torch.randn(1, N_PROBLEMS, NUM_PARTICLES, 1, D_ACTION, generator=gen)
                  + 0.3 * torch.randn(1, N_PROBLEMS, NUM_PARTICLES, HORIZON, D_ACTION, generator=gen)).to(device)
    goals = [Goal(goal_state=(torch.rand(N_PROBLEMS, D_ACTION, generator=gen) * 2.0 - 1.0).to(device),
                  current_state=(torch.randn(N_PROBLEMS, D_ACTION, generator=gen) * 0.3).to(device))
             for _ in range(MPC_STEPS)]

    def serve(use_cuda_graph: bool):
        rollout = ArmReacher(retract_config, device)
        mpc = WrapMpc([ParallelMPPI(rollout, sample_set, use_cuda_graph, device)], rollout)
        commands = []
        for goal in goals:
            act_seq = mpc.solve(goal)
            commands.append(act_seq.clone())        # the command sent to the robot this step
        return commands

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
