"""A delayed actuator's ring-buffer cursor is a host int: a captured graph keeps writing and reading the same slots.

Upstream: https://github.com/newton-physics/newton/pull/2693 ("Fix graphability of delayed actuator",
commit 6385f15a9; diff of ``newton/_src/actuators/delay.py`` and the new ``TestDelayGraphCapture`` read).
Symptom: with a delayed PD actuator stepped inside ``wp.ScopedCapture``, replaying the graph with new joint
targets gives a different ``joint_q`` from eager stepping; the new test (N=2 actuator steps per graph,
``buf_depth=5``) "previously failed when write_idx was a host-side scalar baked into the graph".
Mechanism: ``Delay.State.write_idx`` was a Python ``int``. ``Delay.update_state`` computed
``copy_idx = current_state.write_idx`` and ``write_idx = (copy_idx + 1) % buf_depth`` on the host, passed
both as scalar arguments to ``_delay_buffer_state_kernel`` (copy the newest entry, write the new target at
``write_idx``) and then advanced the cursor with ``next_state.write_idx = write_idx`` in Python;
``get_delayed_targets`` passed ``current_state.write_idx`` as a scalar to ``_delay_read_kernel`` (read at
``(write_idx - lag) % buf_depth``). Under capture that host arithmetic and the attribute assignment run once:
every replay writes the same ring slots and reads the same lagged slots, so the delay line stops
advancing and the applied targets lag by the wrong number of steps.
Doctor: host-work-frozen, at ``update_state`` (the host cursor arithmetic and ``next_state.write_idx =``).
Fix (upstream): ``write_idx`` becomes a device ``wp.array`` of shape (1,) created with
``wp.full(1, buf_depth - 1)`` in ``state()``; both kernels read ``current_write_idx[0]`` and thread 0 of the
state kernel writes ``next_write_idx[0] = (copy_idx + 1) % buf_depth``; ``reset()`` uses ``fill_``.
The physics solver is a semi-implicit Euler stand-in for ``SolverMuJoCo`` (one revolute DOF per actuator).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from workbench.zoo.kit import capture, compare, replay

UPSTREAM = "https://github.com/newton-physics/newton/pull/2693"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "update_state"
SYMPTOM = "graph-replayed delayed actuator applies targets with the wrong lag: joint_q differs from eager"

MAX_DELAY = 5                 # buf_depth
N = 2                         # actuator steps per graph (N % buf_depth != 0, even: the ping-pong returns)
K = 2                         # physics substeps per actuator step
DT = 0.02
WARMUP_TARGET = 0.0
CYCLE_TARGETS = [(2.0, -1.0), (-3.0, 0.5), (5.0, 2.0), (-1.0, -4.0)]
DELAY_STEPS = [5, 3]          # per-DOF lag (two DOFs)
KP, KD, MAX_EFFORT, INERTIA = [20.0, 12.0], [2.0, 1.5], 50.0, [1.0, 0.6]


# --- kernels (torch stand-ins for the Warp kernels; ``i`` runs over the DOFs) -------------------------

def _delay_buffer_state_kernel(target_pos_global, target_vel_global, feedforward_global, pos_indices, vel_indices,
                               copy_idx, write_idx, buf_depth, current_buffer_pos, current_buffer_vel,
                               current_buffer_act, current_num_pushes, next_buffer_pos, next_buffer_vel,
                               next_buffer_act, next_num_pushes, next_write_idx=None):
    """Copy the previous (newest) entry into the next state, write the new entry at ``write_idx``,
    count the push; ``copy_idx``/``write_idx`` are host ints (before the fix) or device (1,) arrays."""
    next_buffer_pos[copy_idx] = current_buffer_pos[copy_idx]
    next_buffer_vel[copy_idx] = current_buffer_vel[copy_idx]
    next_buffer_act[copy_idx] = current_buffer_act[copy_idx]
    next_buffer_pos[write_idx] = target_pos_global[pos_indices]
    next_buffer_vel[write_idx] = target_vel_global[vel_indices]
    next_buffer_act[write_idx] = feedforward_global[vel_indices]
    next_num_pushes.copy_(torch.clamp(current_num_pushes + 1, max=buf_depth))
    if next_write_idx is not None:             # fix: "if i == 0: next_write_idx[0] = write_idx"
        next_write_idx.copy_(write_idx)


def _delay_read_kernel(delays, num_pushes, write_idx, buf_depth, buffer_pos, buffer_vel, buffer_act, current_pos,
                       current_vel, current_act, pos_indices, vel_indices, dofs, out_pos, out_vel, out_act):
    """Per-DOF delayed targets; the current targets when the buffer is empty or the delay is zero."""
    n = num_pushes
    lag = torch.minimum(delays - 1, n - 1)
    read_idx = (write_idx - lag + buf_depth) % buf_depth
    use_current = (n == 0) | (delays == 0)
    out_pos.copy_(torch.where(use_current, current_pos[pos_indices], buffer_pos[read_idx, dofs]))
    out_vel.copy_(torch.where(use_current, current_vel[vel_indices], buffer_vel[read_idx, dofs]))
    out_act.copy_(torch.where(use_current, current_act[vel_indices], buffer_act[read_idx, dofs]))


class Delay:
    """Per-DOF command input delay: a circular buffer of depth ``max_delay`` (ping-pong states)."""

    @dataclass
    class State:
        buffer_pos: torch.Tensor
        buffer_vel: torch.Tensor
        buffer_act: torch.Tensor
        num_pushes: torch.Tensor
        write_idx: object              # int before the fix; a device tensor of shape (1,) after it

    def __init__(self, delay_steps, max_delay, variant):
        self.buf_depth = max_delay
        self.delay_steps = delay_steps
        self.variant = variant

    def finalize(self, device, num_actuators):
        self._device, self._num_actuators = device, num_actuators
        self._dofs = torch.arange(num_actuators, device=device)
        self._out_pos = torch.zeros(num_actuators, device=device)
        self._out_vel = torch.zeros(num_actuators, device=device)
        self._out_act = torch.zeros(num_actuators, device=device)

    def state(self, num_actuators, device):
        if self.variant == "fix":
            write_idx = torch.full((1,), self.buf_depth - 1, dtype=torch.long, device=device)
        else:
            write_idx = self.buf_depth - 1
        return Delay.State(
            buffer_pos=torch.zeros(self.buf_depth, num_actuators, device=device),
            buffer_vel=torch.zeros(self.buf_depth, num_actuators, device=device),
            buffer_act=torch.zeros(self.buf_depth, num_actuators, device=device),
            num_pushes=torch.zeros(num_actuators, dtype=torch.long, device=device),
            write_idx=write_idx,
        )

    def get_delayed_targets(self, target_pos, target_vel, feedforward, pos_indices, vel_indices, current_state):
        _delay_read_kernel(self.delay_steps, current_state.num_pushes, current_state.write_idx, self.buf_depth,
                           current_state.buffer_pos, current_state.buffer_vel, current_state.buffer_act,
                           target_pos, target_vel, feedforward, pos_indices, vel_indices, self._dofs,
                           self._out_pos, self._out_vel, self._out_act)
        return self._out_pos, self._out_vel, self._out_act

    def update_state(self, target_pos, target_vel, feedforward, pos_indices, vel_indices, current_state,
                     next_state):
        """Write the current command inputs into the buffer and advance the write pointer."""
        if next_state is None:
            return
        if self.variant == "fix":
            # Device-side pointer: the kernel reads current_write_idx[0] and advances next_write_idx[0].
            copy_idx = current_state.write_idx
            write_idx = (copy_idx + 1) % self.buf_depth
            next_write_idx = next_state.write_idx
        else:
            copy_idx = current_state.write_idx                          # host ints, kernel scalars
            write_idx = (current_state.write_idx + 1) % self.buf_depth
            next_write_idx = None
        _delay_buffer_state_kernel(target_pos, target_vel, feedforward, pos_indices, vel_indices, copy_idx,
                                   write_idx, self.buf_depth, current_state.buffer_pos, current_state.buffer_vel,
                                   current_state.buffer_act, current_state.num_pushes, next_state.buffer_pos,
                                   next_state.buffer_vel, next_state.buffer_act, next_state.num_pushes,
                                   next_write_idx)
        if self.variant == "bug":
            next_state.write_idx = write_idx                            # Python bookkeeping


class ControllerPD:
    def __init__(self, kp, kd):
        self.kp, self.kd = kp, kd

    def compute(self, positions, velocities, target_pos, target_vel, feedforward, pos_indices, vel_indices,
                out):
        q, qd = positions[pos_indices], velocities[vel_indices]
        out.copy_(self.kp * (target_pos - q) + self.kd * (target_vel - qd) + feedforward)


class ClampingMaxEffort:
    def __init__(self, max_effort):
        self.max_effort = max_effort

    def modify_forces(self, src, dst):
        dst.copy_(src.clamp(-self.max_effort, self.max_effort))


@dataclass
class ActuatorState:
    delay_state: Delay.State


class Actuator:
    def __init__(self, device, variant):
        n = len(DELAY_STEPS)
        self.indices = torch.arange(n, device=device)
        self.pos_indices = torch.arange(n, device=device)
        self.delay = Delay(torch.tensor(DELAY_STEPS, device=device), MAX_DELAY, variant)
        self.delay.finalize(device, n)
        self.controller = ControllerPD(torch.tensor(KP, device=device), torch.tensor(KD, device=device))
        self.clamping = [ClampingMaxEffort(MAX_EFFORT)]
        self._computed_forces = torch.zeros(n, device=device)
        self._applied_forces = torch.zeros(n, device=device)
        self.device, self.n = device, n

    def state(self):
        return ActuatorState(self.delay.state(self.n, self.device))

    def step(self, sim_state, sim_control, current_act_state, next_act_state, dt):
        """Delay read -> PD -> clamp -> scatter-add into joint_f -> delay buffer write."""
        tp, tv, ff = sim_control.joint_target_pos, sim_control.joint_target_vel, sim_control.joint_act
        target_pos, target_vel, feedforward = self.delay.get_delayed_targets(
            tp, tv, ff, self.pos_indices, self.indices, current_act_state.delay_state)
        self.controller.compute(sim_state.joint_q, sim_state.joint_qd, target_pos, target_vel, feedforward,
                                self.pos_indices, self.indices, self._computed_forces)
        self.clamping[0].modify_forces(self._computed_forces, self._applied_forces)
        sim_control.joint_f.index_add_(0, self.indices, self._applied_forces)
        self.delay.update_state(tp, tv, ff, self.pos_indices, self.indices, current_act_state.delay_state,
                                next_act_state.delay_state)


@dataclass
class SimState:
    joint_q: torch.Tensor
    joint_qd: torch.Tensor

    def clear_forces(self):
        pass                          # body forces: none in this model


@dataclass
class Control:
    joint_target_pos: torch.Tensor
    joint_target_vel: torch.Tensor
    joint_act: torch.Tensor
    joint_f: torch.Tensor


class SolverMuJoCo:
    """Semi-implicit Euler stand-in: one revolute DOF per actuator, no coupling."""

    def __init__(self, device):
        self.inertia = torch.tensor(INERTIA, device=device)

    def step(self, state_in, state_out, control, contacts, dt):
        state_out.joint_qd.copy_(state_in.joint_qd + dt * control.joint_f / self.inertia)
        state_out.joint_q.copy_(state_in.joint_q + dt * state_out.joint_qd)


def _loop(solver, s0, s1, ctrl, act, act_a, act_b, n):
    sub_dt = DT / K
    for _ in range(n):
        ctrl.joint_f.zero_()
        act.step(s0, ctrl, act_a, act_b, dt=DT)
        act_a, act_b = act_b, act_a
        for _ in range(K):
            s0.clear_forces()
            solver.step(s0, s1, ctrl, None, sub_dt)
            s0, s1 = s1, s0
    return s0, s1, act_a, act_b


def run(variant: str, device: str = "cpu"):
    ndof = len(DELAY_STEPS)

    def setup():
        solver = SolverMuJoCo(device)
        s0 = SimState(torch.zeros(ndof, device=device), torch.zeros(ndof, device=device))
        s1 = SimState(torch.zeros(ndof, device=device), torch.zeros(ndof, device=device))
        ctrl = Control(torch.zeros(ndof, device=device), torch.zeros(ndof, device=device),
                       torch.zeros(ndof, device=device), torch.zeros(ndof, device=device))
        act = Actuator(device, variant)
        return solver, s0, s1, ctrl, act, act.state(), act.state()

    def set_target(ctrl, tgt):
        ctrl.joint_target_pos.copy_(torch.tensor(tgt, dtype=torch.float32).to(device))

    def eager():
        solver, s0, s1, ctrl, act, act_a, act_b = setup()
        set_target(ctrl, [WARMUP_TARGET] * ndof)
        s0, s1, act_a, act_b = _loop(solver, s0, s1, ctrl, act, act_a, act_b, MAX_DELAY)
        outs = []
        for tgt in CYCLE_TARGETS:
            set_target(ctrl, tgt)
            s0, s1, act_a, act_b = _loop(solver, s0, s1, ctrl, act, act_a, act_b, N)
            outs.append(s0.joint_q.clone())
        return outs

    def served():
        solver, s0, s1, ctrl, act, act_a, act_b = setup()
        set_target(ctrl, [WARMUP_TARGET] * ndof)
        s0, s1, act_a, act_b = _loop(solver, s0, s1, ctrl, act, act_a, act_b, MAX_DELAY)
        state = {"joint_q": s0.joint_q, "joint_qd": s0.joint_qd, "joint_q_next": s1.joint_q,
                 "joint_qd_next": s1.joint_qd}
        for name, st in (("a", act_a), ("b", act_b)):
            ds = st.delay_state
            state.update({f"delay_{name}.buffer_pos": ds.buffer_pos, f"delay_{name}.buffer_vel": ds.buffer_vel,
                          f"delay_{name}.buffer_act": ds.buffer_act, f"delay_{name}.num_pushes": ds.num_pushes})
            if variant == "fix":
                state[f"delay_{name}.write_idx"] = ds.write_idx
        g, out = capture(lambda: _loop(solver, s0, s1, ctrl, act, act_a, act_b, N)[0].joint_q,
                         device=device, warmups=0, owner="wp.ScopedCapture (N actuator + N*K physics steps)",
                         static={"joint_target_pos": ctrl.joint_target_pos}, state=state)
        outs = []
        for tgt in CYCLE_TARGETS:
            set_target(ctrl, tgt)
            outs.append(replay(g, out).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
