"""GROMACS keeps replaying its even/odd MD-step CUDA graphs after a pressure-coupling (virial) step has rescaled the box: the replays use the capture-time box and reciprocal box.

Upstream: https://github.com/gromacs/gromacs/commit/1fc9039bd5f6fbd139795c9f7c4cf6c3ebdfe45f ("Update CUDA graphs on
virial steps", Alan Gray, 2023-08-16; GitLab MR https://gitlab.com/gromacs/gromacs/-/merge_requests/3755, refs issue
https://gitlab.com/gromacs/gromacs/-/issues/4813; release-2023, shipped in 2023.3).
Symptom: with the experimental GPU-resident MD-step graphs (``GMX_CUDA_GRAPH``, GPU update, PME and bonded on the GPU)
and pressure coupling, runs whose virial steps (every ``nstpcouple``) do not coincide with neighbour-search steps
(every ``nstlist``) go wrong after the first coupling step: the release note says "the code would crash" (#4813, seen
with ``-bonded gpu``). What happens underneath is that every graph step between a coupling step and the next search
step computes PME and bonded forces (and PBC shifts) for the box the graph was captured with, not the rescaled one.
An eager run, or a run whose search steps coincide with its virial steps, is correct.
Mechanism: ``gmx::LegacySimulator::do_md()`` (src/gromacs/mdrun/md.cpp) captures a whole GPU step (``do_force`` +
``update_coords`` on the GPU) into ``fr->mdGraph[step % 2]`` on the first eligible even and odd step after a
``MdGpuGraph::reset()``, and replays it (``launchGraphMdStep``) on every later eligible step of that parity. Virial
steps are never graph steps (``canUseMdGpuGraphThisStep = !bCalcVir && ...``); they run eagerly, and with Berendsen /
C-rescale coupling ``update_pcouple_after_coordinates`` rescales ``state->box`` at their end (and
``integrator->scaleCoordinates`` the GPU coordinates). The box reaches the GPU kernels *by value*:
``pme_gpu_prepare_computation`` -> ``pme_gpu_update_input_box`` memcpys the new ``recipBox`` / ``boxVolume`` into the
host ``PmeGpuKernelParams`` struct that each launch copies into its kernel arguments, and
``ListedForcesGpu::setPbcAndlaunchKernel`` -> ``setPbc(box)`` writes ``kernelParams_.pbcAiuc`` the same way. Eager
steps re-run that host code every step; a captured graph keeps the argument values of its capture step. Before the fix
``do_md`` reset the two graphs only ``if (bNS)``, so the graphs captured after the last search step (with the old box)
were replayed after each coupling step.
Doctor: host-work-frozen, at do_md (the box-dependent kernel parameters are host values computed in the captured
``do_force`` - ``pme_gpu_update_input_box``, ``setPbc`` - and passed by value, so each graph holds its capture step's
box; ``do_md``'s reset condition is what decides whether a changed box is recaptured, and it ignored virial steps).
Fix (upstream): in ``do_md`` reset both graphs ``if (bNS || bCalcVir)`` ("due to changing shifts and box"), so the
first eligible step after every coupling step recaptures with the current box (and ``!bNS`` joins
``canUseMdGpuGraphThisStep``).
Modelled: one PP rank, GPU update, PME and bonded on the GPU, no DD / separate PME rank. 8 atoms in 4 diatomic
molecules (+1/-1 charges) in an orthorhombic box. PME is the reciprocal part only, at 7 explicit wave vectors
("spread" = structure factor, "solve" = Ewald weights from ``recipBox``/``boxVolume``, "gather" = forces); the GPU
bonded kernel is the harmonic bonds with ``pbcAiuc`` minimum image; no nonbonded short range (no pair list: a search
step only puts atoms in the box), no constraints. Leap-frog with unit masses; Berendsen isotropic coupling every
``nstpcouple`` = 5 steps with the pressure from the averaged half-step kinetic energies and the bonded virial (the
PME virial is left out); nstlist = 20, nstglobalcomm = nstpcouple, 16 steps, so steps 1-3, 6-8 and 11-13 are graph
steps (4, 9, 14 need the half-step kinetic energy; 5, 10, 15 are virial steps). Graphs are captured with no warm-up
and launched on the capture step, as ``do_md`` does; ``cudaGraphExecUpdate`` of the kept instance is modelled as
taking the newly captured graph. Outputs: the coordinates after every step, final velocities and box.
"""
from __future__ import annotations

import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/gromacs/gromacs/commit/1fc9039bd5f6fbd139795c9f7c4cf6c3ebdfe45f"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "do_md"
SYMPTOM = ("GPU MD-step graphs replay PME/bonded kernels with the box captured before a pressure-coupling step "
           "rescaled it (virial steps not coinciding with search steps)")

NMOLECULES, NATOMS = 4, 8
BOX0 = 3.0
BOND_K, BOND_B0 = 10.0, 0.5
EWALD_COEFF = 1.0
WAVE_VECTORS = [(1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 1, 0), (1, 0, 1), (0, 1, 1), (1, -1, 0)]


def do_per_step(step, nstep):
    return nstep != 0 and step % nstep == 0


def _columns(t, factors):
    """Scale the x/y/z columns of ``t`` by three host scalars (kernel arguments passed by value)."""
    return torch.stack([t[..., d] * factors[d] for d in range(3)], dim=-1)


class t_inputrec:
    nsteps, delta_t = 15, 0.02
    nstlist = 20
    nstcalcenergy, nstenergy, nstlog = 100, 100, 100
    epc, nstpcouple, tau_p, compress, ref_p = "Berendsen", 5, 0.5, 0.5, 1.0
    nstglobalcomm = 5                 # computeGlobalCommunicationPeriod: min(10, nstcalcenergy, nstpcouple)
    etc = "No"


class StepWorkload:
    def __init__(self, doNeighborSearch, computeVirial, haveDynamicBox):
        self.doNeighborSearch, self.computeVirial, self.haveDynamicBox = doNeighborSearch, computeVirial, haveDynamicBox


class t_state:
    def __init__(self, device):
        gen = generator(4813)
        centers = torch.rand(NMOLECULES, 3, generator=gen) * (BOX0 - 1.0) + 0.5
        direction = torch.nn.functional.normalize(torch.randn(NMOLECULES, 3, generator=gen), dim=-1)
        x = torch.stack([centers - 0.5 * BOND_B0 * direction, centers + 0.5 * BOND_B0 * direction], 1)
        self.box = [BOX0, BOX0, BOX0]                       # host matrix (orthorhombic: its diagonal)
        self.x = x.reshape(NATOMS, 3).to(device)            # StatePropagatorDataGpu d_x
        self.v = randn(NATOMS, 3, gen=gen, device=device, scale=0.5)   # d_v
        self.f = torch.zeros(NATOMS, 3, device=device)      # d_f


# --- src/gromacs/ewald/pme_gpu_*.cpp ---------------------------------------------------------------------------

class PmeGpuKernelParams:
    """The host struct every PME launch copies into its kernel arguments (``prepareGpuKernelArguments``)."""

    def __init__(self):
        self.recipBox = [0.0, 0.0, 0.0]
        self.boxVolume = 0.0


class PmeGpu:
    def __init__(self, device):
        self.kernelParams = PmeGpuKernelParams()
        self.previousBox = [0.0, 0.0, 0.0]
        self.coefficients = torch.tensor([1.0, -1.0] * NMOLECULES, device=device)
        self.waveVectors = torch.tensor(WAVE_VECTORS, dtype=torch.float32, device=device)
        self.ewaldFactor = math.pi ** 2 / EWALD_COEFF ** 2


def pme_gpu_update_input_box(pmeGpu, box):
    pmeGpu.kernelParams.boxVolume = box[0] * box[1] * box[2]
    pmeGpu.kernelParams.recipBox = [1.0 / box[0], 1.0 / box[1], 1.0 / box[2]]      # memcpy(kernelParams.recipBox)


def pme_gpu_prepare_computation(pmeGpu, box, stepWork):
    shouldUpdateBox = pmeGpu.previousBox != list(box)
    pmeGpu.previousBox = list(box)
    if stepWork.haveDynamicBox or shouldUpdateBox:
        pme_gpu_update_input_box(pmeGpu, box)


def pme_gpu_launch_spread(pmeGpu, x):
    kp = pmeGpu.kernelParams
    k = _columns(pmeGpu.waveVectors, kp.recipBox)                     # [M, 3] reciprocal vectors
    theta = 2.0 * math.pi * (x @ k.t())                                # [N, M]
    q = pmeGpu.coefficients[:, None]
    return k, torch.cos(theta), torch.sin(theta), (q * torch.cos(theta)).sum(0), (q * torch.sin(theta)).sum(0)


def pme_gpu_solve(pmeGpu, k):
    k2 = (k * k).sum(-1)
    return torch.exp(-pmeGpu.ewaldFactor * k2) / k2 / (math.pi * pmeGpu.kernelParams.boxVolume)


def pme_gpu_launch_gather(pmeGpu, k, cos, sin, c, s, weight, f):
    w = 2.0 * weight[None, :] * pmeGpu.coefficients[:, None] * (s[None, :] * cos - c[None, :] * sin)
    f.add_(-2.0 * math.pi * (w @ k))


# --- src/gromacs/listed_forces/listed_forces_gpu_impl.cpp ------------------------------------------------------

class ListedForcesGpu:
    def __init__(self, device):
        self.kernelParams_ = {"pbcAiuc": None}
        self.d_vir = torch.zeros(1, device=device)

    def setPbc(self, box):
        self.kernelParams_["pbcAiuc"] = (list(box), [1.0 / b for b in box])

    def setPbcAndlaunchKernel(self, box, stepWork, x, f):
        self.setPbc(box)
        self.launchKernel(stepWork, x, f)

    def launchKernel(self, stepWork, x, f):
        box, invBox = self.kernelParams_["pbcAiuc"]
        pairs = x.view(NMOLECULES, 2, 3)
        dx = pairs[:, 1] - pairs[:, 0]
        dx = dx - _columns(torch.round(_columns(dx, invBox)), box)         # pbcDxAiuc
        r = dx.norm(dim=-1, keepdim=True)
        fj = -BOND_K * (r - BOND_B0) * dx / r
        f.add_(torch.stack([-fj, fj], 1).view(NATOMS, 3))
        if stepWork.computeVirial:
            self.d_vir.copy_(-0.5 * (dx * fj).sum().view(1))


# --- src/gromacs/mdlib/update_constrain_gpu_impl.cpp -----------------------------------------------------------

class UpdateConstrainGpu:
    def __init__(self, delta_t):
        self.dt = delta_t

    def integrate(self, x, v, f):                      # leap-frog, unit masses
        v.add_(f * self.dt)
        x.add_(v * self.dt)

    def scaleCoordinates(self, x, mu):
        x.mul_(mu)

    def setPbc(self, box):
        self.pbcAiuc = list(box)


# --- src/gromacs/mdlib/mdgraph_gpu_impl.cu ---------------------------------------------------------------------

class MdGpuGraph:
    def __init__(self, evenOrOddStep, device):
        self.evenOrOddStep, self.device = evenOrOddStep, device
        self.graphCreated_ = self.useGraphThisStep_ = self.graphIsCapturingThisStep_ = False
        self.usedGraphLastStep_ = False
        self.graph_ = self.instance_ = self.outputs_ = None

    def reset(self):
        self.graphCreated_ = self.useGraphThisStep_ = self.graphIsCapturingThisStep_ = False

    def setUsedGraphLastStep(self, usedGraphLastStep):
        self.usedGraphLastStep_ = usedGraphLastStep

    def captureThisStep(self, canUseGraphThisStep):
        self.useGraphThisStep_ = canUseGraphThisStep
        self.graphIsCapturingThisStep_ = self.useGraphThisStep_ and not self.graphCreated_
        return self.graphIsCapturingThisStep_

    def useGraphThisStep(self):
        return self.useGraphThisStep_

    def graphIsCapturingThisStep(self):
        return self.graphIsCapturingThisStep_

    def record(self, step, md_step, state):
        """startRecord ... endRecord: the step's GPU work, captured on the NonBondedLocal stream (not executed)."""
        self.graphCreated_ = True
        self.graph_, self.outputs_ = capture(md_step, device=self.device, warmups=0,
                                             name=f"MD step graph ({self.evenOrOddStep}), captured at step {step}",
                                             owner="MdGpuGraph", state={"d_x": state.x, "d_v": state.v})

    def createExecutableGraph(self, forceGraphReinstantiation):
        self.instance_ = self.graph_             # cudaGraphExecUpdate(instance_, graph_) or re-instantiation

    def launchGraphMdStep(self):
        return replay(self.instance_, self.outputs_)


# --- src/gromacs/mdlib/coupling.cpp, sim_util.cpp, md.cpp ------------------------------------------------------

def update_pcouple_after_coordinates(step, ir, pres, state):
    """Berendsen: the box-scaling factor ``mu`` and the scaled box, on coupling steps; 1.0 otherwise."""
    if ir.epc != "Berendsen" or not do_per_step(step, ir.nstpcouple):
        return 1.0
    mu = 1.0 - ir.nstpcouple * ir.delta_t / ir.tau_p * ir.compress * (ir.ref_p - pres) / 3.0
    state.box = [b * mu for b in state.box]
    return mu


def put_atoms_in_box(box, x):
    x.sub_(_columns(torch.floor(_columns(x, [1.0 / b for b in box])), box))


class ForceRec:
    def __init__(self, device, useMdGpuGraph):
        self.pmedata = PmeGpu(device)
        self.listedForcesGpu = ListedForcesGpu(device)
        self.mdGraph = [MdGpuGraph("EvenStep", device), MdGpuGraph("OddStep", device)] if useMdGpuGraph else None


def do_force(fr, box, stepWork, state):
    if stepWork.doNeighborSearch:
        put_atoms_in_box(box, state.x)           # (coordinates on the host at search steps, then re-uploaded)
    state.f.zero_()                              # clearForcesOnGpu
    pme_gpu_prepare_computation(fr.pmedata, box, stepWork)
    k, cos, sin, c, s = pme_gpu_launch_spread(fr.pmedata, state.x)
    weight = pme_gpu_solve(fr.pmedata, k)
    fr.listedForcesGpu.setPbcAndlaunchKernel(box, stepWork, state.x, state.f)
    pme_gpu_launch_gather(fr.pmedata, k, cos, sin, c, s, weight, state.f)


class LegacySimulator:
    def __init__(self, variant, device, useMdGpuGraph):
        self.variant, self.device = variant, device
        self.ir = t_inputrec()
        self.state = t_state(device)
        self.fr = ForceRec(device, useMdGpuGraph)
        self.integrator = UpdateConstrainGpu(self.ir.delta_t)
        self.integrator.setPbc(self.state.box)
        self.useMdGpuGraph = useMdGpuGraph

    def do_md(self):
        ir, state, fr, integrator = self.ir, self.state, self.fr, self.integrator
        trajectory, ekinh_old, usedMdGpuGraphLastStep = [], 0.0, False
        for step in range(ir.nsteps + 1):
            bFirstStep, bLastStep = step == 0, step == ir.nsteps
            bNS = bFirstStep or do_per_step(step, ir.nstlist)
            bCalcEnerStep = do_per_step(step, ir.nstcalcenergy)
            bCalcVir = bCalcEnerStep or (ir.epc != "No" and do_per_step(step, ir.nstpcouple))
            bCalcEner = bCalcEnerStep
            do_ene = do_per_step(step, ir.nstenergy) or bLastStep
            do_log = do_per_step(step, ir.nstlog) or bFirstStep or bLastStep
            if do_ene or do_log:
                bCalcVir = bCalcEner = True
            bGStat = bCalcVir or bCalcEner or do_per_step(step, ir.nstglobalcomm)
            doTemperatureScaling = ir.etc != "No"
            doParrinelloRahman = ir.epc == "ParrinelloRahman"
            needHalfStepKineticEnergy = do_per_step(step + 1, ir.nstglobalcomm) or step + 1 == ir.nsteps
            stepWork = StepWorkload(bNS, bCalcVir, haveDynamicBox=ir.epc != "No")

            mdGraph = fr.mdGraph[step % 2] if self.useMdGpuGraph else None
            if self.useMdGpuGraph:
                if self.variant == "bug":
                    resetGraphs = bNS
                else:
                    # Reset graph on search step (due to changing neighbour list etc)
                    # or virial step (due to changing shifts and box).
                    resetGraphs = bNS or bCalcVir
                if resetGraphs:
                    fr.mdGraph[0].reset()
                    fr.mdGraph[1].reset()
                else:
                    mdGraph.setUsedGraphLastStep(usedMdGpuGraphLastStep)
                    canUseMdGpuGraphThisStep = (not bCalcVir and not doTemperatureScaling and not doParrinelloRahman
                                                and not bGStat and not needHalfStepKineticEnergy)
                    if self.variant == "fix":
                        canUseMdGpuGraphThisStep = canUseMdGpuGraphThisStep and not bNS
                    mdGraph.captureThisStep(canUseMdGpuGraphThisStep)

            box = list(state.box)

            def md_step():
                do_force(fr, box, stepWork, state)
                integrator.integrate(state.x, state.v, state.f)        # update_coords + finish_update
                return state.x, state.v

            if not self.useMdGpuGraph or mdGraph.graphIsCapturingThisStep() or not mdGraph.useGraphThisStep():
                if self.useMdGpuGraph and mdGraph.graphIsCapturingThisStep():
                    mdGraph.record(step, md_step, state)
                else:
                    md_step()
            if self.useMdGpuGraph:
                if mdGraph.graphIsCapturingThisStep():
                    mdGraph.createExecutableGraph(forceGraphReinstantiation=False)
                if mdGraph.useGraphThisStep():
                    mdGraph.launchGraphMdStep()
                usedMdGpuGraphLastStep = mdGraph.useGraphThisStep()

            pres = 0.0
            if bGStat or needHalfStepKineticEnergy:                         # compute_globals
                ekinh = 0.5 * float((state.v * state.v).sum().item())
                if bCalcVir:
                    ekin = 0.5 * (ekinh_old + ekinh)                        # leap-frog: average of half steps
                    volume = state.box[0] * state.box[1] * state.box[2]
                    pres = 2.0 / (3.0 * volume) * (ekin - fr.listedForcesGpu.d_vir.item())
                ekinh_old = ekinh
            mu = update_pcouple_after_coordinates(step, ir, pres, state)
            if mu != 1.0:
                integrator.scaleCoordinates(state.x, mu)
                integrator.setPbc(state.box)
            trajectory.append(state.x.clone())
        return [torch.stack(trajectory), state.v.clone(), torch.tensor(state.box)]


def run(variant: str, device: str = "cpu"):
    return compare(__name__.rsplit(".", 1)[-1], variant, device,
                   lambda: LegacySimulator(variant, device, useMdGpuGraph=True).do_md(),
                   lambda: LegacySimulator(variant, device, useMdGpuGraph=False).do_md())
