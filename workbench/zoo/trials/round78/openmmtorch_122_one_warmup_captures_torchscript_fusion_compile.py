"""OpenMM-Torch warms a TorchScript model up only once before capture: the capture lands on the executor's optimising call, whose fusion compile is refused.

Upstream: https://github.com/openmm/openmm-torch/pull/122 ("Use the same stream as the OpenMM context when replaying
a CUDA graph."), merged 2023-09-27 as a8f467b; its second commit, "Increase default warmup steps to 10", raises the
default of ``CUDAGraphWarmupSteps`` in ``TorchForce::TorchForce`` from 1 to 10. Reported as
https://github.com/torchmd/torchmd-net/issues/220 ("TensorNET with CUDA Graphs and LangevinMiddleIntegrator fails").
Symptom: a TorchScripted TensorNet in a ``TorchForce`` with ``useCUDAGraphs=true`` fails at the first force evaluation:
the graph capture fails ("TorchForce Failed to capture the model into a CUDA graph"), and nvfuser prints
"FALLBACK path has been taken inside: runCudaFusionGroup. This is an indication that codegen Failed". The same
simulation with ``useCUDAGraphs=false`` runs. The PR's author found that the stream change alone "was not enough and the
error popped out again", and that the error and the warning go away with ``CUDAGraphWarmupSteps`` of at least 5.
Mechanism: ``CudaCalcTorchForceKernel::execute`` (``platforms/cuda/src/CudaTorchKernels.cpp``) records the graph on the
first evaluation: it runs ``executeGraph`` (``module.forward`` plus ``energyTensor.backward(..., posTensor)``)
``warmupSteps`` times, then once more between ``capture_begin`` and ``capture_end``. With the old default of 1, the
captured call is the module's second call. TorchScript's profiling graph executor runs the first call(s) on a
profiling plan. On a later call it builds the optimised plan, and the first run of that plan's
``CudaFusionGroup`` compiles its kernel (nvfuser codegen: NVRTC compile, module load, buffer set-up). That work is
done lazily, inside whatever call reaches it, so here it runs inside the capture. Its CUDA driver work is refused by the
capturing stream, nvfuser falls back to the unfused graph (the warning above), and the capture fails, which ``execute``
rethrows as an ``OpenMMException``. (Which driver call is refused is not in the thread.) Eager evaluation (``useGraphs`` false) pays the same compile once, outside any capture, and works.
(Compiling TorchScript code while a graph is being captured is a known failure: pytorch/pytorch#99397.)
Doctor: sync-in-capture, at execute. The graph is captured while the model still does lazy one-time work that waits on the
device (the executor's fusion compile), and a capturing stream refuses that wait. The bug lives in ``execute``: it opens the
capture after only ``warmupSteps`` (1 by default) eager calls, before the module's plan is final. The fix changed the
warmup that ``execute`` runs before ``capture_begin``, and the streams ``execute`` uses.
Fix (upstream): the default ``CUDAGraphWarmupSteps`` becomes 10 (``TorchForce::TorchForce``'s ``defaultProperties``), so
the executor has compiled its final plan during warmup and the capture records only kernels. The same PR also captures
on a pool stream taken only inside the capture branch, and replays on OpenMM's own stream
(``c10::cuda::getStreamFromExternal(cu.getCurrentStream(), ...)``) instead of the non-blocking pool stream.
Modelled: the TorchScript module is a stand-in for TensorNet (expnorm radial basis of the pair distances with a cosine
cutoff, an MLP with SiLU, a summed energy); forces come from ``backward`` w.r.t. ``posTensor``, as ``executeGraph`` does when
the model does not output forces. ``ProfilingGraphExecutorImpl`` profiles ``num_profiled_runs`` = 1 call (TorchScript's
default), then builds the optimised plan. The first run of its fusion group compiles the kernel, and the codegen's waits on
the device are one ``synchronize``. The profiled plan and the fused plan compute the same numbers. In the reproducer, the
executor of the real TensorNet graph needed more calls to settle (at least 5 warmups; the thread does not say why). The
model keeps only the first, documented, optimising call. nvfuser's catch-and-fall-back is folded into the error:
the refused wait ends the capture, and ``execute`` rethrows it as ``OpenMMException`` (upstream, CUDA raises it at
``capture_end``). The integrator is LangevinMiddle with its noise drawn up front from a seeded generator, unit masses.
Not modelled: the stream half of the fix. Before it, the replay ran on a non-blocking pool stream, and the
energy's ``.item()`` read on the default stream could race it. The emulation runs in order, and the thread says that
change alone did not cure the failure.
"""
from __future__ import annotations

import torch

from workbench.engine import synchronize
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/openmm/openmm-torch/pull/122"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "execute"
SYMPTOM = ("TorchForce with useCUDAGraphs fails to capture a TorchScripted TensorNet (nvfuser codegen FALLBACK): with one "
           "warmup step the capture is the executor's optimising call, whose fusion-kernel compile waits on the device")

N_ATOMS, NUM_RBF, HIDDEN, CUTOFF = 5, 8, 16, 5.0
STEPS, DT, FRICTION, KT = 6, 0.01, 1.0, 0.5


class OpenMMException(RuntimeError):
    pass


# --- torch/csrc/jit/runtime/profiling_graph_executor_impl.cpp (the TorchScript executor of the loaded model) ---

class ProfilingGraphExecutorImpl:
    """Runs a scripted graph: a profiling plan for the first ``num_profiled_runs`` calls, then the optimised plan,
    whose ``CudaFusionGroup`` compiles its kernel the first time it runs (lazily, inside that call)."""

    num_profiled_runs = 1                       # torch._C._jit_set_num_profiled_runs default

    def __init__(self, graph, fused_graph, device):
        self.graph, self.fused_graph, self.device = graph, fused_graph, device
        self.remaining_profiled_runs = self.num_profiled_runs
        self.optimized_plan = None
        self.fusion_kernel_compiled = False

    def getPlanFor(self):
        if self.remaining_profiled_runs > 0:
            self.remaining_profiled_runs -= 1
            return self.graph                   # profiling plan: the unfused ops, with profile nodes
        if self.optimized_plan is None:
            self.optimized_plan = self.runCudaFusionGroup   # profile-guided specialisation, fusion groups
        return self.optimized_plan

    def compileFusion(self):
        """nvfuser codegen of the fusion group: lower, NVRTC-compile, load the module, size its buffers. Its CUDA
        driver work waits on the device (modelled as one wait), which a capturing stream refuses."""
        synchronize(self.device)
        self.fusion_kernel_compiled = True

    def runCudaFusionGroup(self, *inputs):
        if not self.fusion_kernel_compiled:
            self.compileFusion()
        return self.fused_graph(*inputs)

    def run(self, *inputs):
        return self.getPlanFor()(*inputs)


# --- torchmdnet TensorNet, scripted (torch.jit.script) and loaded by TorchForce ---------------------------

class ScriptModule:
    """Stand-in for the issue's ``NNPForce(TensorNet)``: E = sum over pairs of an MLP of expnorm RBFs times a cutoff."""

    def __init__(self, device):
        gen = generator(122)
        self.means = torch.linspace(torch.exp(torch.tensor(-CUTOFF)).item(), 1.0, NUM_RBF).to(device)
        self.betas = torch.full((NUM_RBF,), (2.0 / NUM_RBF * (1 - torch.exp(torch.tensor(-CUTOFF)).item())) ** -2
                                ).to(device)
        self.w1 = randn(NUM_RBF, HIDDEN, gen=gen, device=device, scale=0.4)
        self.b1 = randn(HIDDEN, gen=gen, device=device, scale=0.1)
        self.w2 = randn(HIDDEN, 1, gen=gen, device=device, scale=0.4)
        i, j = torch.triu_indices(N_ATOMS, N_ATOMS, offset=1)
        self.pair_i, self.pair_j = i.to(device), j.to(device)
        self._executor = ProfilingGraphExecutorImpl(self._graph, self._fused_graph, device)

    def _graph(self, pos):
        d = (pos[self.pair_i] - pos[self.pair_j]).pow(2).sum(-1).add(1e-9).sqrt()
        cut = 0.5 * (torch.cos(d * torch.pi / CUTOFF) + 1.0) * (d < CUTOFF)
        rbf = cut[:, None] * torch.exp(-self.betas * (torch.exp(-d[:, None]) - self.means).pow(2))
        h = torch.nn.functional.silu(rbf @ self.w1 + self.b1)
        return (h @ self.w2).sum()

    def _fused_graph(self, pos):
        # the fused plan computes the same graph (the elementwise RBF/cutoff chain is one fusion group)
        return self._graph(pos)

    def forward(self, pos):
        return self._executor.run(pos)


# --- openmmapi/src/TorchForce.cpp -------------------------------------------------------------------------

class TorchForce:
    def __init__(self, module, properties, variant):
        # bug: {"CUDAGraphWarmupSteps", "1"}; the fix (#122, "Increase default warmup steps to 10") makes it "10"
        defaultProperties = {"useCUDAGraphs": "false", "CUDAGraphWarmupSteps": "10" if variant == "fix" else "1"}
        self.module = module
        self.outputsForces = False
        self.properties = dict(defaultProperties)
        for name, value in properties.items():
            if name not in defaultProperties:
                raise OpenMMException(f"TorchForce: Unknown property '{name}'")
            self.properties[name] = value

    def getOutputsForces(self):
        return self.outputsForces

    def getProperties(self):
        return dict(self.properties)


# --- OpenMM: the context's state ----------------------------------------------------------------------------

class Context:
    def __init__(self, positions):
        self.positions = positions.clone()
        self.velocities = torch.zeros_like(positions)
        self.forces = torch.zeros_like(positions)


# --- platforms/cuda/src/CudaTorchKernels.cpp --------------------------------------------------------------

class CudaCalcTorchForceKernel:
    def initialize(self, force, device):
        self.module = force.module
        self.outputsForces = force.getOutputsForces()
        self.device = device
        self.posTensor = torch.zeros(N_ATOMS, 3, device=device, requires_grad=not self.outputsForces)
        properties = force.getProperties()
        self.useGraphs = properties["useCUDAGraphs"] == "true"
        if self.useGraphs:
            self.warmupSteps = int(properties["CUDAGraphWarmupSteps"])
            if self.warmupSteps <= 0:
                raise OpenMMException('TorchForce: "CUDAGraphWarmupSteps" must be a positive integer')
        self.graphs = {}                                     # includeForces -> (graph, its outputs)

    def prepareTorchInputs(self, context):
        with torch.no_grad():
            self.posTensor.copy_(context.positions)          # copyInputsKernel: OpenMM posq -> posTensor
        return [self.posTensor]

    def executeGraph(self, includeForces, inputs):
        energyTensor = self.module.forward(*inputs)
        forceTensor = torch.zeros_like(self.posTensor)
        if includeForces:
            torch.autograd.backward(energyTensor, inputs=[self.posTensor])   # backward(none, false, false, posTensor)
            forceTensor = self.posTensor.grad.clone()        # minus the forces; the sign is changed in addForces
            self.posTensor.grad.zero_()
        return energyTensor.detach(), forceTensor

    def addForces(self, context, forceTensor):
        forceSign = 1.0 if self.outputsForces else -1.0
        context.forces.copy_(forceSign * forceTensor)        # addForcesKernel into the (zeroed) OpenMM force buffer

    def execute(self, context, includeForces=True, includeEnergy=True):
        inputs = self.prepareTorchInputs(context)
        if not self.useGraphs:
            energyTensor, forceTensor = self.executeGraph(includeForces, inputs)
        else:
            if includeForces not in self.graphs:
                # Record graph if not already done: warmupSteps eager runs of executeGraph, then capture_begin,
                # executeGraph, capture_end (on a pool stream). With the old default of one warmup, the captured call
                # is the model's second: the one on which TorchScript builds and compiles its optimised plan.
                try:
                    self.graphs[includeForces] = capture(
                        lambda: self.executeGraph(includeForces, inputs), device=self.device,
                        warmups=self.warmupSteps, name=f"TorchForce includeForces={includeForces}",
                        owner="CudaCalcTorchForceKernel (useCUDAGraphs)", static={"posTensor": self.posTensor})
                except Exception as e:
                    raise OpenMMException("TorchForce Failed to capture the model into a CUDA graph. Torch reported "
                                          f"the following error:\n{e}") from e
            # (fix: replay on OpenMM's stream, getStreamFromExternal(cu.getCurrentStream()); not modelled)
            graph, outputs = self.graphs[includeForces]
            energyTensor, forceTensor = replay(graph, outputs)
        if includeForces:
            self.addForces(context, forceTensor)
        return energyTensor.clone()                          # energyTensor.item<double>()


# --- OpenMM LangevinMiddleIntegrator (unit masses) ----------------------------------------------------------

class LangevinMiddleIntegrator:
    def __init__(self, noise):
        self.noise = noise
        self.vscale = torch.exp(torch.tensor(-FRICTION * DT)).item()
        self.noisescale = (KT * (1 - self.vscale ** 2)) ** 0.5

    def step(self, context, kernel, n):
        energy = kernel.execute(context)                      # forces at the current positions
        context.velocities += DT * context.forces
        context.positions += 0.5 * DT * context.velocities
        context.velocities.mul_(self.vscale).add_(self.noisescale * self.noise[n])
        context.positions += 0.5 * DT * context.velocities
        return energy


def run(variant: str, device: str = "cpu"):
    gen = generator(220)
    start = randn(N_ATOMS, 3, gen=gen, device=device, scale=1.2)
    noise = randn(STEPS, N_ATOMS, 3, gen=gen, device=device)

    def simulate(use_graphs: bool):
        module = ScriptModule(device)                        # torch.jit.script(NNPForce(model)): a fresh executor
        force = TorchForce(module, {"useCUDAGraphs": "true" if use_graphs else "false"}, variant)
        kernel = CudaCalcTorchForceKernel()
        kernel.initialize(force, device)
        context = Context(start)
        integrator = LangevinMiddleIntegrator(noise)
        outs = []
        for n in range(STEPS):
            outs += [integrator.step(context, kernel, n), context.forces.clone()]
        return outs + [context.positions.clone()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: simulate(True), lambda: simulate(False))
