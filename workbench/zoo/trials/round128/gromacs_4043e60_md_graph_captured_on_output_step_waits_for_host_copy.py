"""GROMACS GPU-resident MD-step CUDA graphs were allowed on steps that write trajectory output: when such a step is the one that captures the graph, the coordinate copy for the output (``copyCoordinatesFromGpu`` then ``waitCoordinatesReadyOnHost``) runs inside the capture and its host wait breaks it.

Upstream: https://github.com/gromacs/gromacs/commit/4043e6098408668d83f028f245c7124e01fe3138 ("Forbid CUDA Graphs on
output steps", gromacs/gromacs, author Alan Gray, committed 2022-11-30, on the main branch before the 2023 release;
merged). Read: the commit's whole diff (one hunk of ``src/gromacs/mdrun/md.cpp``, in ``gmx::LegacySimulator::do_md()``,
adding ``!do_per_step(step, ir->nstxout) && !do_per_step(step, ir->nstxout_compressed) && !do_per_step(step,
ir->nstvout) && !do_per_step(step, ir->nstfout) && !checkpointHandler->isCheckpointingStep()`` to
``canUseMdGpuGraphThisStep``); at its parent ``4043e60984^``: ``md.cpp`` ``do_md`` (the search-step copies from the
GPU, ``bCalcVir`` / ``bGStat`` / ``needHalfStepKineticEnergy``, the ``mdGraph[step % 2]`` reset / ``captureThisStep`` /
``startRecord`` block, the block skipped on graph-launch steps with the output copies and ``do_md_trajectory_writing``
between ``do_force`` and the GPU ``integrate``, the ``endRecord`` / ``createExecutableGraph`` / ``launchGraphMdStep``
block), ``src/gromacs/mdlib/mdgraph_gpu_impl.cu`` (``reset``, ``captureThisStep``, ``startRecord`` /
``cudaStreamBeginCapture``, ``endRecord``, ``createExecutableGraph``, ``launchGraphMdStep``) and
``state_propagator_data_gpu_impl_gpu.cpp`` (``copyCoordinatesFromGpu``, ``waitCoordinatesReadyOnHost`` =
``xReadyOnHost_[atomLocality].waitForEvent()``). Also read, for the same code a year later: commit 9aafbe8dda.
Symptom: with ``GMX_CUDA_GRAPH`` and GPU update, a run whose trajectory output step (``nstxout``) is not a search step
crashes when that step is the first graph-eligible step of its parity after a search step (the graph is captured on
it); the commit message reports "crashes on mdrun unit tests with graphs enabled". A graph step that only launches an
existing graph would skip the output instead (the whole block, ``do_md_trajectory_writing`` included, is skipped).
Eager runs write the frame.
Mechanism: ``do_md`` captures the GPU work of a step from ``startRecord`` (``cudaStreamBeginCapture``) to ``endRecord``;
the host code between them runs once, at capture. On a non-search output step that code asks for the coordinates on
the host for ``do_md_trajectory_writing``: ``copyCoordinatesFromGpu`` enqueues the device-to-host copy and
``waitCoordinatesReadyOnHost`` waits on its event, a host synchronisation that a capturing stream cannot serve.
``canUseMdGpuGraphThisStep`` excluded virial, coupling and global-communication steps but not output steps.
Doctor: sync-in-capture, at do_md. The host wait for the output copy is attempted inside the step's capture; ``do_md``
is where the upstream fix keeps output steps out of graphs.
Fix (upstream): ``canUseMdGpuGraphThisStep`` is also false on ``nstxout``, ``nstxout_compressed``, ``nstvout`` and
``nstfout`` steps and on checkpointing steps, so those steps run eagerly and write their output.
Modelled: ``LegacySimulator.do_md`` (reduced to leap-frog with GPU update, one PP rank, no PME, no constraints, no DD),
``MdGpuGraph`` (``reset``, ``setUsedGraphLastStep``, ``captureThisStep``, the ``startRecord`` ... ``endRecord``
capture of the step's GPU work with no warm-up, ``createExecutableGraph``, ``launchGraphMdStep`` on the capture step
and later eligible steps of the same parity), ``StatePropagatorDataGpu`` (device ``d_x`` / ``d_v`` / ``d_f``, the
copies to and from pinned host ``state->x`` / ``state->v`` with an event wait), ``do_md_trajectory_writing`` (frames of
``x`` every ``nstxout`` steps), ``compute_globals`` reduced to the half-step kinetic energy on the host.
Stand-ins: ``do_force`` is a GPU nonbonded kernel over a host-built Verlet pair list (soft repulsion inside ``rc``,
list buffer ``rlist``) plus a harmonic position restraint, no PBC; the search is an all-pairs distance test on the host;
``waitForEvent`` is the engine's ``synchronize``; the two graphs hold the same work (the rolling prune that makes even
and odd steps differ is left out); ``cudaGraphExecUpdate`` is modelled as taking the new graph. float64.
Workload: 8 atoms, nstlist 6, nstxout 7, nstcalcenergy / nstenergy / nstlog 100, nstglobalcomm 10, 16 steps (0..16).
Graph-eligible steps: 1-5, 7, 8, 11, 13, 14 (9 and 15 need the half-step kinetic energy, 10 is a global step, 0, 6,
12 search, 16 last). Outputs: the frames (steps 0, 7, 14), the kinetic energies of the energy steps (0, 16), final x
and v.
Measured: bug: raises CaptureError at step 7, the first step after the step-6 search, which captures the odd graph and
is an output step ("synchronize() inside graph capture needs the device's values on the host (a host
synchronisation), ..."); steps 1-5 (two captures, three replays) ran. Fix: steps 7 and 14 run eagerly, the graphs are
captured at 1, 2, 8, 11, 13 and replayed at 3, 4, 5; equals eager (max |graph - eager| = 0).
"""
from __future__ import annotations

import torch

from workbench.engine import host, synchronize
from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/gromacs/gromacs/commit/4043e6098408668d83f028f245c7124e01fe3138"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "do_md"
SYMPTOM = ("GPU MD-step graphs captured on a trajectory output step run the output's coordinate copy and host wait "
           "inside the capture, which fails")

NATOMS = 8
RC, RLIST = 0.6, 0.7
K_REP, K_POSRES = 40.0, 2.0
MAX_PAIRS = NATOMS * (NATOMS - 1) // 2
DTYPE = torch.float64

_variant = "bug"


def do_per_step(step, nstep):
    return nstep != 0 and step % nstep == 0


class t_inputrec:
    nsteps, delta_t = 16, 0.005
    nstlist = 6
    nstxout, nstxout_compressed, nstvout, nstfout = 7, 0, 0, 0
    nstcalcenergy, nstenergy, nstlog = 100, 100, 100
    nstglobalcomm = 10                       # computeGlobalCommunicationPeriod
    etc, epc = "No", "No"


class t_state:
    def __init__(self, device):
        gen = generator(4043)
        self.x = host(torch.rand(NATOMS, 3, generator=gen, dtype=DTYPE) * 1.2, device)     # host coordinates
        self.v = host(torch.randn(NATOMS, 3, generator=gen, dtype=DTYPE) * 0.5, device)    # host velocities


class CheckpointHandler:
    def __init__(self):
        self.checkpointThisStep_ = False

    def decideIfCheckpointingThisStep(self, bNS, bFirstStep, bLastStep):
        self.checkpointThisStep_ = False                   # -cpt -1: no checkpoints in this run

    def isCheckpointingStep(self):
        return self.checkpointThisStep_


# --- src/gromacs/gpu_utils/gpueventsynchronizer.h ---------------------------------------------------------------

class GpuEventSynchronizer:
    def __init__(self, device):
        self.device = device

    def markEvent(self):
        pass

    def waitForEvent(self):
        synchronize(self.device)                         # cudaEventSynchronize


# --- src/gromacs/mdtypes/state_propagator_data_gpu_impl_gpu.cpp ------------------------------------------------

class StatePropagatorDataGpu:
    def __init__(self, device):
        self.device = device
        self.d_x = torch.zeros(NATOMS, 3, dtype=DTYPE, device=device)
        self.d_v = torch.zeros(NATOMS, 3, dtype=DTYPE, device=device)
        self.d_f = torch.zeros(NATOMS, 3, dtype=DTYPE, device=device)
        self.xReadyOnHost_ = GpuEventSynchronizer(device)
        self.vReadyOnHost_ = GpuEventSynchronizer(device)

    def getCoordinates(self):
        return self.d_x

    def getVelocities(self):
        return self.d_v

    def getForces(self):
        return self.d_f

    def copyCoordinatesToGpu(self, h_x):
        self.d_x.copy_(h_x, non_blocking=True)

    def copyVelocitiesToGpu(self, h_v):
        self.d_v.copy_(h_v, non_blocking=True)

    def copyCoordinatesFromGpu(self, h_x):
        h_x.copy_(self.d_x, non_blocking=True)
        self.xReadyOnHost_.markEvent()

    def waitCoordinatesReadyOnHost(self):
        self.xReadyOnHost_.waitForEvent()

    def copyVelocitiesFromGpu(self, h_v):
        h_v.copy_(self.d_v, non_blocking=True)
        self.vReadyOnHost_.markEvent()

    def waitVelocitiesReadyOnHost(self):
        self.vReadyOnHost_.waitForEvent()


# --- src/gromacs/nbnxm (reduced): host search, GPU pair list and nonbonded kernel ------------------------------

class NbnxmGpu:
    def __init__(self, device):
        self.device = device
        self.d_pairI = torch.zeros(MAX_PAIRS, dtype=torch.int64, device=device)
        self.d_pairJ = torch.zeros(MAX_PAIRS, dtype=torch.int64, device=device)
        self.d_pairMask = torch.zeros(MAX_PAIRS, dtype=DTYPE, device=device)
        self.h_pairI = host(torch.zeros(MAX_PAIRS, dtype=torch.int64), device)
        self.h_pairJ = host(torch.zeros(MAX_PAIRS, dtype=torch.int64), device)
        self.h_pairMask = host(torch.zeros(MAX_PAIRS, dtype=DTYPE), device)

    def gridding_and_search(self, h_x):
        """Pair search on the host at search steps (buffered list, rlist > rc), uploaded to the GPU."""
        x = h_x.tolist()
        pairs = [(i, j) for i in range(NATOMS) for j in range(i + 1, NATOMS)
                 if sum((a - b) ** 2 for a, b in zip(x[i], x[j])) < RLIST * RLIST]
        self.h_pairI.zero_()
        self.h_pairJ.zero_()
        self.h_pairMask.zero_()
        for p, (i, j) in enumerate(pairs):
            self.h_pairI[p], self.h_pairJ[p], self.h_pairMask[p] = i, j, 1.0
        self.d_pairI.copy_(self.h_pairI, non_blocking=True)
        self.d_pairJ.copy_(self.h_pairJ, non_blocking=True)
        self.d_pairMask.copy_(self.h_pairMask, non_blocking=True)

    def launch_kernel(self, d_x, d_f):
        dx = d_x[self.d_pairJ] - d_x[self.d_pairI]
        r = torch.linalg.vector_norm(dx, dim=-1).clamp_min(1e-6)
        inRange = (r < RC).to(DTYPE) * self.d_pairMask
        fj = (K_REP * (RC - r) * inRange / r)[:, None] * dx           # soft repulsion, pushes j away from i
        d_f.index_add_(0, self.d_pairJ, fj)
        d_f.index_add_(0, self.d_pairI, -fj)


class ForceRec:
    def __init__(self, device, useMdGpuGraph):
        self.nbv = NbnxmGpu(device)
        self.mdGraph = [MdGpuGraph("EvenStep", device), MdGpuGraph("OddStep", device)] if useMdGpuGraph else None


def do_force(fr, stateGpu, bNS, state):
    if bNS:
        fr.nbv.gridding_and_search(state.x)
    d_x, d_f = stateGpu.getCoordinates(), stateGpu.getForces()
    d_f.zero_()                                                   # clearForcesOnGpu
    fr.nbv.launch_kernel(d_x, d_f)
    d_f.add_(-K_POSRES * d_x)                                     # position restraints to the origin


# --- src/gromacs/mdlib/update_constrain_gpu_impl.cpp -----------------------------------------------------------

class UpdateConstrainGpu:
    def __init__(self, delta_t):
        self.dt = delta_t

    def integrate(self, d_x, d_v, d_f):                    # leap-frog, unit masses
        d_v.add_(d_f * self.dt)
        d_x.add_(d_v * self.dt)


# --- src/gromacs/mdlib/mdgraph_gpu_impl.cu ---------------------------------------------------------------------

class MdGpuGraph:
    def __init__(self, evenOrOddStep, device):
        self.evenOrOddStep, self.device = evenOrOddStep, device
        self.graphCreated_ = self.useGraphThisStep_ = self.graphIsCapturingThisStep_ = False
        self.usedGraphLastStep_ = False
        self.disableGraphAcrossAllPpRanks_ = False
        self.graph_ = self.instance_ = self.outputs_ = None

    def reset(self):
        self.graphCreated_ = self.useGraphThisStep_ = self.graphIsCapturingThisStep_ = False

    def setUsedGraphLastStep(self, usedGraphLastStep):
        self.usedGraphLastStep_ = usedGraphLastStep

    def captureThisStep(self, canUseGraphThisStep):
        self.useGraphThisStep_ = canUseGraphThisStep and not self.disableGraphAcrossAllPpRanks_
        self.graphIsCapturingThisStep_ = self.useGraphThisStep_ and not self.graphCreated_
        return self.graphIsCapturingThisStep_

    def useGraphThisStep(self):
        return self.useGraphThisStep_

    def graphIsCapturingThisStep(self):
        return self.graphIsCapturingThisStep_

    def record(self, step, mdStepWork, stateGpu):
        """startRecord (cudaStreamBeginCapture on the NonBondedLocal stream) ... endRecord (cudaStreamEndCapture)."""
        self.graphCreated_ = True
        self.graph_, self.outputs_ = capture(
            mdStepWork, device=self.device, warmups=0, owner="MdGpuGraph",
            name=f"MD step graph ({self.evenOrOddStep}), captured at step {step}",
            state={"d_x": stateGpu.getCoordinates(), "d_v": stateGpu.getVelocities(), "d_f": stateGpu.getForces()})

    def createExecutableGraph(self, forceGraphReinstantiation):
        self.instance_ = self.graph_              # cudaGraphExecUpdate(instance_, graph_) or cudaGraphInstantiate

    def launchGraphMdStep(self):
        return replay(self.instance_, self.outputs_)


# --- src/gromacs/mdlib/trajectory_writing.cpp ------------------------------------------------------------------

def do_md_trajectory_writing(step, ir, state, outf):
    if do_per_step(step, ir.nstxout):
        outf["x"].append(state.x.clone())
    if do_per_step(step, ir.nstvout):
        outf["v"].append(state.v.clone())


# --- src/gromacs/mdrun/md.cpp (reduced) -------------------------------------------------------------------------

class LegacySimulator:
    def __init__(self, device, useMdGpuGraph):
        self.device = device
        self.ir = t_inputrec()
        self.state = t_state(device)
        self.stateGpu = StatePropagatorDataGpu(device)
        self.fr = ForceRec(device, useMdGpuGraph)
        self.integrator = UpdateConstrainGpu(self.ir.delta_t)
        self.checkpointHandler = CheckpointHandler()
        self.useMdGpuGraph = useMdGpuGraph

    def do_md(self):
        ir, state, stateGpu, fr, integrator = self.ir, self.state, self.stateGpu, self.fr, self.integrator
        checkpointHandler = self.checkpointHandler
        outf = {"x": [], "v": []}
        energies, ekinh_old = [], 0.0
        usedMdGpuGraphLastStep = False

        stateGpu.copyCoordinatesToGpu(state.x)
        stateGpu.copyVelocitiesToGpu(state.v)

        for step in range(ir.nsteps + 1):
            step_rel = step
            bFirstStep, bLastStep = step == 0, step_rel == ir.nsteps
            bNStList = ir.nstlist > 0 and step % ir.nstlist == 0
            bNS = bFirstStep or bNStList
            do_log = do_per_step(step, ir.nstlog) or bFirstStep or bLastStep

            # On search steps, when doing the update on the GPU, copy the coordinates and velocities to the host
            if bNS and not bFirstStep:
                stateGpu.copyVelocitiesFromGpu(state.v)
                stateGpu.copyCoordinatesFromGpu(state.x)
                stateGpu.waitVelocitiesReadyOnHost()
                stateGpu.waitCoordinatesReadyOnHost()

            checkpointHandler.decideIfCheckpointingThisStep(bNS, bFirstStep, bLastStep)
            bCalcEnerStep = do_per_step(step, ir.nstcalcenergy)
            bCalcVir = bCalcEnerStep
            bCalcEner = bCalcEnerStep
            do_ene = do_per_step(step, ir.nstenergy) or bLastStep
            if do_ene or do_log:
                bCalcVir = bCalcEner = True
            bGStat = bCalcVir or bCalcEner or do_per_step(step, ir.nstglobalcomm)
            doTemperatureScaling = ir.etc != "No"
            needHalfStepKineticEnergy = do_per_step(step + 1, ir.nstglobalcomm) or step_rel + 1 == ir.nsteps
            doParrinelloRahman = ir.epc == "ParrinelloRahman"

            mdGraph = fr.mdGraph[step % 2] if self.useMdGpuGraph else None
            if self.useMdGpuGraph:
                if bNS:
                    fr.mdGraph[0].reset()
                    fr.mdGraph[1].reset()
                else:
                    mdGraph.setUsedGraphLastStep(usedMdGpuGraphLastStep)
                    if _variant == "bug":
                        canUseMdGpuGraphThisStep = (not bCalcVir and not doTemperatureScaling
                                                    and not doParrinelloRahman and not bGStat
                                                    and not needHalfStepKineticEnergy)
                    else:
                        canUseMdGpuGraphThisStep = (
                            not bCalcVir and not doTemperatureScaling and not doParrinelloRahman and not bGStat
                            and not needHalfStepKineticEnergy and not do_per_step(step, ir.nstxout)
                            and not do_per_step(step, ir.nstxout_compressed)
                            and not do_per_step(step, ir.nstvout) and not do_per_step(step, ir.nstfout)
                            and not checkpointHandler.isCheckpointingStep())
                    mdGraph.captureThisStep(canUseMdGpuGraphThisStep)

            def mdStepWork():
                do_force(fr, stateGpu, bNS, state)
                # Copy coordinate from the GPU for the output/checkpointing if the update is offloaded
                # and coordinates have not already been copied for i) search or ii) CPU force tasks.
                if not bNS and (do_per_step(step, ir.nstxout) or do_per_step(step, ir.nstxout_compressed)
                                or checkpointHandler.isCheckpointingStep()):
                    stateGpu.copyCoordinatesFromGpu(state.x)
                    stateGpu.waitCoordinatesReadyOnHost()
                # Copy velocities if needed for the output/checkpointing.
                if not bNS and (do_per_step(step, ir.nstvout) or checkpointHandler.isCheckpointingStep()):
                    stateGpu.copyVelocitiesFromGpu(state.v)
                    stateGpu.waitVelocitiesReadyOnHost()
                do_md_trajectory_writing(step, ir, state, outf)
                # This applies Leap-Frog, LINCS and SETTLE in succession
                integrator.integrate(stateGpu.getCoordinates(), stateGpu.getVelocities(), stateGpu.getForces())
                return stateGpu.getCoordinates(), stateGpu.getVelocities()

            if not self.useMdGpuGraph or mdGraph.graphIsCapturingThisStep() or not mdGraph.useGraphThisStep():
                if self.useMdGpuGraph and mdGraph.graphIsCapturingThisStep():
                    mdGraph.record(step, mdStepWork, stateGpu)
                else:
                    mdStepWork()

            if self.useMdGpuGraph:
                if mdGraph.graphIsCapturingThisStep():
                    mdGraph.createExecutableGraph(forceGraphReinstantiation=False)
                if mdGraph.useGraphThisStep():
                    mdGraph.launchGraphMdStep()
                usedMdGpuGraphLastStep = mdGraph.useGraphThisStep()

            if bGStat or needHalfStepKineticEnergy:                   # compute_globals
                stateGpu.copyVelocitiesFromGpu(state.v)
                stateGpu.waitVelocitiesReadyOnHost()
                ekinh = 0.5 * float((state.v * state.v).sum())
                if bCalcEner:
                    energies.append(0.5 * (ekinh_old + ekinh))            # leap-frog: average of half steps
                ekinh_old = ekinh

        stateGpu.copyCoordinatesFromGpu(state.x)                          # write_sto_conf_mtop (confout)
        stateGpu.copyVelocitiesFromGpu(state.v)
        stateGpu.waitCoordinatesReadyOnHost()
        return [torch.stack(outf["x"]), torch.tensor(energies, dtype=DTYPE), state.x.clone(), state.v.clone()]


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: LegacySimulator(device, useMdGpuGraph=True).do_md(),
                       lambda: LegacySimulator(device, useMdGpuGraph=False).do_md())
