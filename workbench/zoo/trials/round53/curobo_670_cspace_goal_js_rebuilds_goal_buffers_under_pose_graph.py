"""TrajOpt c-space solve adds ``goal_js`` to the goal buffer: the goal registry the pose-planning graph reads is rebuilt.

Upstream: https://github.com/NVlabs/curobo/pull/670 ("Bala/cspace cuda graph fix", fix commit fcf2b1e "fix cspace
cuda graph issue"); issue https://github.com/NVlabs/curobo/issues/669.
Symptom: after ``warmup()`` with CUDA graphs on, ``plan_pose`` followed by ``plan_cspace`` (or the reverse) fails or
returns bad trajectories; CHANGELOG: "Keep TrajOpt c-space solves on implicit seed goals to avoid changing
goal-buffer structure when alternating with pose planning under CUDA graphs".
Mechanism: ``TrajOptSolver._solve_impl`` hands the goal to ``GoalRegistryManager.update_goal_buffer``; when a field
that was None becomes set (``self._goal_buffer.goal_js is None and goal_js is not None``) it sets
``update_reference`` and builds a new ``GoalRegistry``, and ``SolverCore.prepare_goal_buffer`` then calls
``reset_shape()`` (each ``RobotRollout.reset_shape`` sets ``_num_particles_goal = None``) and
``optimizer.update_num_problems`` (same size: no graph reset). The next ``update_params`` builds a fresh
``_num_particles_goal`` (``goal.repeat_seeds``); otherwise it is refreshed in place
(``copy_(goal, update_idx_buffers=False, allow_clone=False)``). The optimizer's ``GraphExecutor`` for ``_opt_iters``
was captured during warmup / ``plan_pose``: capture ran the Python of ``_compute_costs_and_constraints_impl`` once,
reading ``self._num_particles_goal`` (pose target, ``current_js``, ``seed_goal_js``,
``seed_enable_implicit_goal_js``) and skipping ``target_cspace_dist`` because ``goal.goal_js`` was None.
``solve_cspace`` passed ``goal_state=goal_state`` to ``_solve_impl``, so the first c-space solve changes the buffer
structure: the registry the graph reads is dropped, its new data lands in tensors the graph never reads, and
replays read the released registry (and still lack the c-space term).
Doctor: dangling-reference, at solve_cspace (its explicit ``goal_state`` rebuilds the goal registry; the pose graph,
never reset, keeps reading the released ``_num_particles_goal`` tensors).
Fix (upstream): ``solve_cspace`` no longer passes ``goal_state`` to ``_solve_impl``: the endpoint is pinned only by
the implicit seed goal (``seed_goal_js`` with ``use_implicit_goal=True``), so both solve types share one
goal-buffer structure that ``copy_`` refreshes in place (the PR also adds ``process_metrics_and_rank_seeds`` and a
``finetune_dt_scale`` knob, not modelled).
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVlabs/curobo/pull/670"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "solve_cspace"
SYMPTOM = "plan_cspace after a CUDA-graphed plan_pose replays a graph bound to the goal registry it dropped"

DOF, HORIZON, NUM_PARTICLES, ITERS, LR = 3, 4, 2, 3, 0.1


class GoalRegistry:
    FIELDS = ("link_goal_poses", "current_js", "seed_goal_js", "goal_js", "seed_enable_implicit_goal_js")

    def __init__(self, **fields):
        for name in self.FIELDS:
            setattr(self, name, fields.get(name))

    def repeat_seeds(self, num_seeds):
        rep = {n: getattr(self, n).repeat_interleave(num_seeds, 0) for n in self.FIELDS if getattr(self, n) is not None}
        return GoalRegistry(**rep)

    def copy_(self, goal, update_idx_buffers=True, allow_clone=True):
        """Copy into fields that exist; with ``allow_clone=False`` a field that is None here is never added."""
        for name in self.FIELDS:
            mine, theirs = getattr(self, name), getattr(goal, name)
            if mine is None and theirs is not None and allow_clone:
                setattr(self, name, theirs.clone())
            elif mine is not None and theirs is not None:
                mine.copy_(theirs.repeat_interleave(mine.shape[0] // theirs.shape[0], 0))


class GoalRegistryManager:
    def __init__(self):
        self._goal_buffer = None

    def update_goal_buffer(self, goal_tool_poses, current_js, seed_goal_js, goal_js=None, use_implicit_goal=False):
        gb = self._goal_buffer
        update_reference = (gb is None or (gb.goal_js is None and goal_js is not None)
                            or (gb.seed_goal_js is None and seed_goal_js is not None))
        if update_reference:
            self._goal_buffer = GoalRegistry(
                link_goal_poses=goal_tool_poses.clone(), current_js=current_js.clone(),
                seed_goal_js=seed_goal_js.clone(), goal_js=None if goal_js is None else goal_js.clone(),
                seed_enable_implicit_goal_js=torch.zeros(seed_goal_js.shape[0], 1, device=seed_goal_js.device))
        else:
            gb.current_js.copy_(current_js)
            if goal_js is not None:
                gb.goal_js.copy_(goal_js)
            gb.link_goal_poses.copy_(goal_tool_poses)
            gb.seed_goal_js.copy_(seed_goal_js)
        if use_implicit_goal:
            self._goal_buffer.seed_enable_implicit_goal_js[:] = int(use_implicit_goal)
        return self._goal_buffer, update_reference


class RobotRollout:
    def __init__(self, kin_w):
        self.kin_w = kin_w                         # linear forward kinematics: tool position = q @ kin_w
        self._num_particles_goal = None

    def update_params(self, goal, num_particles):
        if self._num_particles_goal is None:
            self._num_particles_goal = goal.repeat_seeds(num_particles)
        else:
            self._num_particles_goal.copy_(goal, update_idx_buffers=False, allow_clone=False)

    def reset_shape(self):
        self._num_particles_goal = None

    def _compute_state_from_action_impl(self, act_seq):
        g = self._num_particles_goal
        last = torch.where(g.seed_enable_implicit_goal_js > 0, g.seed_goal_js, act_seq[:, -1])   # implicit goal
        return torch.cat([act_seq[:, :-1], last[:, None]], 1)

    def _compute_costs_and_gradient(self, act_seq):
        """Costs of CostManagerRobot and their gradient wrt the action (analytic, a few quadratic terms)."""
        goal = self._num_particles_goal
        q = self._compute_state_from_action_impl(act_seq)
        grad = torch.zeros_like(q)
        vel = q[:, 1:] - q[:, :-1]
        cost = vel.pow(2).sum((1, 2)) + (q[:, 0] - goal.current_js).pow(2).sum(-1)
        grad[:, :-1] -= 2 * vel
        grad[:, 1:] += 2 * vel
        grad[:, 0] += 2 * (q[:, 0] - goal.current_js)
        pose_err = q[:, -1] @ self.kin_w - goal.link_goal_poses                       # "tool_pose"
        cost = cost + pose_err.pow(2).sum(-1)
        grad[:, -1] += 2 * pose_err @ self.kin_w.t()
        if goal.goal_js is not None:                                                  # "target_cspace_dist"
            cost = cost + (q[:, -1] - goal.goal_js).pow(2).sum(-1)
            grad[:, -1] += 2 * (q[:, -1] - goal.goal_js)
        grad[:, -1] *= 1 - goal.seed_enable_implicit_goal_js                           # pinned endpoint
        return cost, grad


class GradientOptCore:
    def __init__(self, rollout, device, use_cuda_graph):
        self.rollout, self.device, self.use_cuda_graph = rollout, device, use_cuda_graph
        self._graph, self._graph_input, self._graph_output = None, None, None     # GraphExecutor("_opt_iters")

    def update_num_problems(self, num_problems):
        self.num_problems = num_problems                                            # same size: graphs kept

    def _opt_iters(self, act_seq):
        for _ in range(ITERS):
            _, grad = self.rollout._compute_costs_and_gradient(act_seq)
            act_seq = act_seq - LR * grad
        cost, _ = self.rollout._compute_costs_and_gradient(act_seq)
        return self.rollout._compute_state_from_action_impl(act_seq), cost

    def optimize(self, seed_action):
        if not self.use_cuda_graph:
            return self._opt_iters(seed_action)
        if self._graph is None:                                                     # _initialize_cuda_graph
            self._graph_input = seed_action.clone()
            self._graph, self._graph_output = capture(
                lambda: self._opt_iters(self._graph_input), device=self.device, warmups=1,
                static={"act_seq": self._graph_input}, owner="GraphExecutor(_opt_iters)")
        self._graph_input.copy_(seed_action)
        return tuple(t.clone() for t in replay(self._graph, self._graph_output))


class TrajOptSolver:
    def __init__(self, device, use_cuda_graph, variant):
        gen = generator(670)
        self.device, self.variant = device, variant
        self.kin_w = randn(DOF, 3, gen=gen, device=device, scale=0.5)
        self.goal_registry_manager = GoalRegistryManager()
        self.rollout = RobotRollout(self.kin_w)
        self.optimizer = GradientOptCore(self.rollout, device, use_cuda_graph)
        self.noise = randn(NUM_PARTICLES, HORIZON, DOF, gen=gen, device=device, scale=0.05)

    def compute_kinematics(self, q):
        return q @ self.kin_w

    def _solve_impl(self, current_state, goal_tool_poses, seed_traj, use_implicit_goal=False, goal_state=None):
        seed_goal_state = seed_traj[:, -1, :]
        rep = lambda t: None if t is None else t.repeat(NUM_PARTICLES, 1)  # noqa: E731 - batch 1 x num_seeds
        goal_buffer, update_reference = self.goal_registry_manager.update_goal_buffer(
            rep(goal_tool_poses), rep(current_state), seed_goal_state, rep(goal_state), use_implicit_goal)
        if update_reference:                                                        # SolverCore.prepare_goal_buffer
            self.rollout.reset_shape()
            self.optimizer.update_num_problems(1)
        self.rollout.update_params(goal_buffer, num_particles=1)
        traj, cost = self.optimizer.optimize(seed_traj)
        return traj, cost

    def solve_pose(self, current_state, goal_tool_poses):
        seed_traj = current_state[None].expand(NUM_PARTICLES, HORIZON, DOF) + self.noise
        return self._solve_impl(current_state, goal_tool_poses, seed_traj, use_implicit_goal=False)

    def solve_cspace(self, current_state, goal_state):
        goal_tool_poses = self.compute_kinematics(goal_state)
        w = torch.linspace(0, 1, HORIZON, device=self.device)[None, :, None]
        seed_traj = current_state[None] + w * (goal_state - current_state)[None] + self.noise
        seed_traj[:, -1] = goal_state
        if self.variant == "fix":                       # endpoint pinned by the implicit seed goal only
            return self._solve_impl(current_state, goal_tool_poses, seed_traj, use_implicit_goal=True)
        return self._solve_impl(current_state, goal_tool_poses, seed_traj, use_implicit_goal=True,
                                goal_state=goal_state)


def run(variant: str, device: str = "cpu"):
    gen = generator(669)
    start = randn(1, DOF, gen=gen, device=device, scale=0.3)
    pose_goals = [randn(1, 3, gen=gen, device=device, scale=0.5) for _ in range(2)]
    cspace_goals = [start + randn(1, DOF, gen=gen, device=device, scale=0.3) for _ in range(2)]

    def serve(graphed: bool):
        solver = TrajOptSolver(device, graphed, variant)
        solver.solve_pose(start, pose_goals[0])                     # MotionPlanner.warmup(): captures the graph
        outs = []
        for step in range(2):                                       # plan_pose then plan_cspace, twice
            outs.extend(solver.solve_pose(start, pose_goals[step]))
            outs.extend(solver.solve_cspace(start, cspace_goals[step]))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
