"""A stateful PID actuator stops advancing across graph replays: the Python swap of its two state buffers ran only at capture.

Upstream: https://github.com/newton-physics/newton/pull/4101 ("Add Actuator.State.assign() for odd-length graph
capture"), fixing issue #4098 ("Stateful actuator state does not advance across CUDA graph replays when the captured
region has an odd step count"); backported to 1.5.2 in #4185.
Symptom: "expected integral after 12 steps = 0.1200 ... captured, 1 step(s)/graph x 12 replays: integral = 0.0100
WRONG ... 3 step(s)/graph x 4 replays: integral = 0.0900 WRONG"; silent: the actuator keeps producing
plausible-looking effort, with a PID integral (or delay ring, LSTM hidden state) that loses steps.
Mechanism: the documented loop is ``actuator.step(sim_state, control, state_0, state_1, dt)`` followed by
``state_0, state_1 = state_1, state_0``. ``Actuator.step`` -> ``ControllerPID.compute`` (``_pid_effort_kernel``)
reads ``current_act_state.controller_state.integral`` and writes ``_next_integral`` and the efforts;
``ControllerPID.update_state`` copies ``_next_integral`` into ``next_act_state.controller_state.integral``. The graph
(``wp.ScopedCapture`` around ``simulate()``) records those kernels on the buffers' addresses; the swap only rebinds
Python names, so it is host work that happens once, at capture, and is no node of the graph. With an odd substep
count every replay starts again from the buffer that was ``state_0`` at capture (A) while the user's ``state_0`` now
names the other one (B): with 3 substeps each replay computes B = A+1, A = B+1, B = A+1, so one step in three is
lost (the integral reads 9 steps' worth after 4 replays of 3). Eagerly the swap runs every substep and nothing is lost.
Doctor: host-work-frozen, at simulate (the double-buffer swap inside the captured region is a Python rebinding that ran
once at capture; replays repeat the kernels with the capture-time buffer orientation).
Fix (upstream): adds ``Actuator.State.assign(other)`` (walks ``__dict__`` like ``newton.State.assign()``, copying each
array in place) and documents the captured loop ``if steps % 2 == 1 and i == steps - 1: state_0.assign(state_1)
else: swap``: the last odd step becomes a recorded device copy back into the capture-time ``state_0``.
``Actuator.step()`` itself is unchanged.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/newton-physics/newton/pull/4101"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "simulate"
SYMPTOM = "the PID integral loses one substep in three per replay: the Python state swap ran only at capture"

NUM_ACTUATORS, NUM_DOFS, SIM_SUBSTEPS, FRAMES, DT = 4, 6, 3, 4, 0.01


class ControllerPID:
    class State:
        def __init__(self, integral):
            self.integral = integral

    def __init__(self, kp, ki, kd, integral_max, device):
        self.kp, self.ki, self.kd, self.integral_max = kp, ki, kd, integral_max
        self._next_integral = torch.zeros(NUM_ACTUATORS, device=device)      # finalize()

    def state(self, device):
        return ControllerPID.State(torch.zeros(NUM_ACTUATORS, device=device))

    def compute(self, positions, velocities, target_pos, target_vel, indices, forces, state, dt):
        """``_pid_effort_kernel``: effort from the current integral; the next integral goes to scratch."""
        position_error = target_pos[indices] - positions[indices]
        velocity_error = target_vel[indices] - velocities[indices]
        integral = torch.clamp(state.integral + position_error * dt, -self.integral_max, self.integral_max)
        forces.copy_(self.kp * position_error + self.ki * integral + self.kd * velocity_error)
        self._next_integral.copy_(integral)

    def update_state(self, current_state, next_state):
        next_state.integral.copy_(self._next_integral)


class Actuator:
    class State:
        def __init__(self, controller_state):
            self.controller_state = controller_state

        def assign(self, other):
            """The fix: copy every array of ``other`` into this state, in place (a device copy a graph records)."""
            for name, value in self.__dict__.items():
                theirs = other.__dict__.get(name)
                if (value is None) != (theirs is None):
                    raise ValueError(f"Actuator.State.assign: component {name!r} present on one side only")
                if value is not None:
                    for key, arr in value.__dict__.items():
                        arr.copy_(theirs.__dict__[key])

    def __init__(self, controller, indices, device):
        self.controller, self.indices, self.device = controller, indices, device
        self._computed_forces = torch.zeros(NUM_ACTUATORS, device=device)

    def state(self):
        return Actuator.State(self.controller.state(self.device))

    def step(self, sim_state, sim_control, current_act_state, next_act_state, dt):
        self.controller.compute(sim_state.joint_q, sim_state.joint_qd, sim_control.joint_target_pos,
                                sim_control.joint_target_vel, self.indices, self._computed_forces,
                                current_act_state.controller_state, dt)
        sim_control.joint_f.index_add_(0, self.indices, self._computed_forces)     # _scatter_add_kernel
        self.controller.update_state(current_act_state.controller_state, next_act_state.controller_state)


class SimState:
    def __init__(self, joint_q, joint_qd):
        self.joint_q, self.joint_qd = joint_q, joint_qd


class Control:
    def __init__(self, device):
        self.joint_target_pos = torch.zeros(NUM_DOFS, device=device)
        self.joint_target_vel = torch.zeros(NUM_DOFS, device=device)
        self.joint_f = torch.zeros(NUM_DOFS, device=device)


class Example:
    def __init__(self, device, variant, use_graph, sim_state, actuator):
        self.device, self.variant, self.use_graph = device, variant, use_graph
        self.sim_state, self.actuator, self.control = sim_state, actuator, Control(device)
        self.state_0, self.state_1 = actuator.state(), actuator.state()
        self.graph = None

    def simulate(self):
        need_state_copy = self.variant == "fix" and self.use_graph and SIM_SUBSTEPS % 2 == 1
        for i in range(SIM_SUBSTEPS):
            self.control.joint_f.zero_()
            self.actuator.step(self.sim_state, self.control, self.state_0, self.state_1, DT)
            if need_state_copy and i == SIM_SUBSTEPS - 1:
                self.state_0.assign(self.state_1)          # recorded: replays end in the capture-time state_0
            else:
                self.state_0, self.state_1 = self.state_1, self.state_0     # Python only: runs at capture
        return self.control.joint_f

    def capture(self):
        ctrl = self.control
        self.graph, self.joint_f = capture(
            self.simulate, device=self.device, warmups=0, owner="newton Example (wp.ScopedCapture)",
            static={"joint_target_pos": ctrl.joint_target_pos, "joint_target_vel": ctrl.joint_target_vel},
            state={"state_0.integral": self.state_0.controller_state.integral,
                   "state_1.integral": self.state_1.controller_state.integral})

    def step(self, target_pos, target_vel):
        self.control.joint_target_pos.copy_(target_pos)
        self.control.joint_target_vel.copy_(target_vel)
        if self.use_graph:
            if self.graph is None:
                self.capture()
            joint_f = replay(self.graph, self.joint_f)
        else:
            joint_f = self.simulate()
        # what the user reads after the frame: the applied effort and the actuator's current integral
        return [joint_f.clone(), self.state_0.controller_state.integral.clone()]


def run(variant: str, device: str = "cpu"):
    gen = generator(4101)
    kp = randn(NUM_ACTUATORS, gen=gen, device=device).abs() + 1.0
    ki = randn(NUM_ACTUATORS, gen=gen, device=device).abs() * 10.0 + 5.0
    kd = randn(NUM_ACTUATORS, gen=gen, device=device).abs() * 0.1
    integral_max = torch.full((NUM_ACTUATORS,), 10.0).to(device)
    indices = torch.tensor([0, 2, 3, 5]).to(device)
    joint_q, joint_qd = randn(NUM_DOFS, gen=gen, device=device), randn(NUM_DOFS, gen=gen, device=device)
    targets = [(randn(NUM_DOFS, gen=gen, device=device), randn(NUM_DOFS, gen=gen, device=device))
               for _ in range(FRAMES)]

    def serve(use_graph):
        actuator = Actuator(ControllerPID(kp, ki, kd, integral_max, device), indices, device)
        example = Example(device, variant, use_graph, SimState(joint_q, joint_qd), actuator)
        outs = []
        for target_pos, target_vel in targets:
            outs += example.step(target_pos, target_vel)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
