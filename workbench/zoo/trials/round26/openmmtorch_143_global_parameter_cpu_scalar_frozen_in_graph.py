"""OpenMM-Torch passes each global parameter as a new CPU scalar tensor: a captured graph keeps its capture value.

Upstream: https://github.com/openmm/openmm-torch/pull/143 ("Can compute parameter derivatives"), merged May 2024;
its commit 1d83b86 ("Handle CUDA graphs correctly") changed how ``CudaCalcTorchForceKernel`` passes global
parameters to a graphed model, and the PR added ``testGlobal(useGraphs=true)``, which changes ``k`` from 2 to 3
after the first evaluation and checks the forces.
Symptom: with ``TorchForce.setProperty("useCUDAGraphs", "true")`` on the CUDA platform, changing a global parameter
after the first force evaluation (``context.setParameter("k", 3.0)``: an alchemical lambda, a restraint strength, a
replica-exchange scaling) has no effect: energies and forces keep the value the parameter had when the graph was
captured, while the same simulation without graphs follows it (graph support of #103 until #143). (No issue
reports it; this is what the PR's ``testGlobal(true)`` checks, which fails on the pre-fix code path.)
Mechanism: ``CudaCalcTorchForceKernel::prepareTorchInputs`` runs before every evaluation and builds the model's
inputs as ``{posTensor, [boxTensor], torch::tensor(context.getParameter(name)), ...}``: each global parameter is a
brand-new 0-dim double tensor with default options, i.e. a CPU tensor. ``execute`` warms up and captures
``executeGraph`` (``module.forward(inputs)``) on the first evaluation and from then on only copies the positions
into ``posTensor`` and replays. A 0-dim CPU tensor given to a CUDA op is a host scalar passed to the kernel by value,
so the captured ``k * pos.pow(2).sum()`` (and ``-2 * k * pos``) holds the capture step's ``k`` as a constant; the
tensors ``prepareTorchInputs`` builds at later evaluations are read by nothing the replay runs.
Doctor: host-work-frozen, at ``forward`` (the model turns the global parameter, a host scalar, into kernel
arguments inside the captured region; replays keep the capture-time value).
Fix (upstream): ``initialize`` allocates one persistent tensor per global parameter on the model's device
(``globalTensors[name] = torch::tensor({0}, options)``), ``prepareTorchInputs`` writes the current value into it in
place (``globalTensors[name][0] = context.getParameter(name)``) and passes that tensor, so the replayed kernels read
the parameter from device memory at every evaluation.
(Read: the diff of 1d83b86, the pre-PR ``CudaTorchKernels.cpp``, ``tests/generate.py`` and ``TestCudaTorchForce.cpp``.
The model is the tests' ``Global`` module (E = k |r|^2) returning its forces as well, i.e. the
``setOutputsForces(true)`` path, which needs no backward pass; the OpenMM side is a few lines of velocity Verlet.)
"""
from __future__ import annotations

import torch

from workbench.engine import host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/openmm/openmm-torch/pull/143"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "forward"
SYMPTOM = "with useCUDAGraphs, context.setParameter() no longer changes TorchForce energies and forces"
NUM_PARTICLES, STEPS, DT, WARMUP_STEPS = 5, 6, 0.05, 1
K_SCHEDULE = {0: 2.0, 2: 3.0, 4: 1.5}        # step -> value given to context.setParameter("k", ...)


class Global:
    """``tests/generate.py``'s ``Global`` module, E(r) = k |r|^2, also returning F = -dE/dr."""

    def forward(self, pos, k):
        return k * pos.pow(2).sum(), -2 * k * pos


class Context:
    """The OpenMM context: particle state and the global parameters the simulation changes."""

    def __init__(self, positions, parameters):
        self.positions = positions.clone()
        self.velocities = torch.zeros_like(positions)
        self.forces = torch.zeros_like(positions)
        self.parameters = dict(parameters)

    def getParameter(self, name):
        return self.parameters[name]

    def setParameter(self, name, value):
        self.parameters[name] = value


class CudaCalcTorchForceKernel:
    def __init__(self, module, global_names, device, use_graphs, variant):
        self.module, self.device, self.variant = module, device, variant
        self.globalNames = list(global_names)
        self.useGraphs, self.warmupSteps = use_graphs, WARMUP_STEPS
        self.posTensor = torch.empty(NUM_PARTICLES, 3, device=device)
        self.graphs = {}                                   # includeForces -> (graph, its outputs)
        if variant == "fix":
            # globalTensors[name] = torch::tensor({0}, options): persistent, on the model's device
            self.globalTensors = {name: torch.zeros(1, device=device) for name in self.globalNames}

    def prepareTorchInputs(self, context):
        self.posTensor.copy_(context.positions)            # the copyInputs kernel (OpenMM posq -> posTensor)
        inputs = [self.posTensor]
        for name in self.globalNames:
            if self.variant == "bug":
                # torch::tensor(context.getParameter(name)): a new 0-dim double tensor, on the CPU
                inputs.append(host(torch.tensor(context.getParameter(name), dtype=torch.float64), self.device))
            else:
                self.globalTensors[name][0] = context.getParameter(name)
                inputs.append(self.globalTensors[name])
        return inputs

    def executeGraph(self, inputs):
        """The workload that is captured: the model's forward (outputsForces: no backward pass)."""
        self.energyTensor, self.forceTensor = self.module.forward(*inputs)
        return self.energyTensor, self.forceTensor

    def execute(self, context, includeForces=True):
        inputs = self.prepareTorchInputs(context)
        if not self.useGraphs:
            energy, forces = self.executeGraph(inputs)
        else:
            if includeForces not in self.graphs:            # record the graph on the first evaluation
                static = {"posTensor": self.posTensor}
                if self.variant == "fix":
                    static.update({f"globalTensors[{n}]": t for n, t in self.globalTensors.items()})
                self.graphs[includeForces] = capture(
                    lambda: self.executeGraph(inputs), device=self.device, warmups=self.warmupSteps,
                    name="TorchForce", owner="CudaCalcTorchForceKernel (useCUDAGraphs)", static=static)
            graph, outputs = self.graphs[includeForces]
            energy, forces = replay(graph, outputs)
        if includeForces:
            context.forces.copy_(forces)                    # addForces (outputsForces: sign +1)
        return energy.detach().clone()


def run(variant: str, device: str = "cpu"):
    gen = generator(143)
    start = randn(NUM_PARTICLES, 3, gen=gen, device=device)

    def simulate(use_graphs: bool):
        context = Context(start, {"k": K_SCHEDULE[0]})
        kernel = CudaCalcTorchForceKernel(Global(), ["k"], device, use_graphs, variant)
        outs = []
        for step in range(STEPS):
            if step in K_SCHEDULE:
                context.setParameter("k", K_SCHEDULE[step])
            energy = kernel.execute(context)
            outs += [energy, context.forces.clone()]
            context.velocities += DT * context.forces       # unit masses
            context.positions += DT * context.velocities
        return outs + [context.positions.clone()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: simulate(True), lambda: simulate(False))
