"""With an odd nstlist, GROMACS's even-step MD graph is recaptured without the rolling-prune kernel its kept executable has; cudaGraphExecUpdate fails.

Upstream: https://github.com/gromacs/gromacs/commit/ecae71521e0d104b7a1605637dbe48fcfe2d64e2 ("Force graph
reinstantiation rather than update with odd nstlist", Alan Gray, 2023-09-29; GitLab MR !3828, fixes issue
https://gitlab.com/gromacs/gromacs/-/issues/4813; shipped in 2023.3). The same mechanism, triggered by a restart
from an odd ``init_step`` with an even nstlist, was fixed later by 5b44c70deb (#5162, 2026-04-15).
Symptom: "Runs with CUDA graphs and odd nstlist were crashing with graph update failing due to inconsistency with the
odd/even pruning pattern" (commit message): ``cudaGraphExecUpdate in MD graph definition finalization failed``
(``cudaErrorGraphExecUpdateFailure``) on the first graph step after the second neighbour-search step. Without
GMX_CUDA_GRAPH the run is fine.
Mechanism: ``gmx::LegacySimulator::do_md()`` (``src/gromacs/mdrun/md.cpp``) keeps two ``MdGpuGraph`` objects and
picks ``fr->mdGraph[step % 2]``: the slot is keyed by the *absolute* step parity. On search (and virial) steps both
are ``reset()``: that only marks them uncreated (``graphCreated_ = false``); the ``cudaGraphExec_t instance_`` is
kept. The next eligible step of each parity captures the whole GPU step again (``startRecord`` / ``endRecord``), and
``MdGpuGraph::Impl::createExecutableGraph(forceGraphReinstantiation)`` (``mdgraph_gpu_impl.cu``) applies the new
capture to the old executable with ``cudaGraphExecUpdate(instance_, graph_, ...)`` unless reinstantiation is forced
(before the fix only while PME tuning is active). Which kernels a step captures depends on
``nonbonded_verlet_t::isDynamicPruningStepGpu(step)``: ``launchGpuEndOfStepTasks`` (``sim_util.cpp``) launches the
rolling-prune kernel (``dispatchPruneKernelGpu`` -> ``gpu_launch_kernel_pruneonly``) only when the pair list's age
``step - outerListCreationStep_`` is even (single domain: ``age % (2 * mtsFactor) == 0``), i.e. by the parity
*relative to the last search step*. With an even nstlist the two parities agree for good, so every recapture into a
slot has the topology of the executable it updates. With nstlist = 5 they flip at each search step: the even slot was
first captured at step 2 (age 2: with the prune kernel), but after the search at step 5 the even steps have odd age,
so step 6 captures no prune kernel. The graph's topology changed and ``cudaGraphExecUpdate`` refuses; GROMACS turns
the error into a fatal ``InternalError``. An eager step decides the prune launch afresh every step.
Doctor: warmup-divergence, at do_md. The structure of the even-step executable (a prune-kernel node or not) was
decided by an earlier capture, made when even steps had even pair-list age; ``do_md`` chooses to reuse that
executable (update instead of reinstantiate) for a step that now decides otherwise. The bug lives in ``do_md``: that
is where the fix changed code, the ``forceGraphReinstantiation`` decision passed to ``createExecutableGraph``.
Fix (upstream): ``bool forceGraphReinstantiation = pme_loadbal_is_active(pme_loadbal) || ((ir->nstlist % 2) == 1);``
so with an odd nstlist the old executable is destroyed and the new capture instantiated (#5162 adds the
odd-``init_step`` first interval to the same condition).
Modelled: a GPU-resident MD step on one rank: a nonbonded kernel (soft repulsion, cutoff ``rc``) over the pruned pair
list, the force reduction, the end-of-step rolling prune (2 parts, its part counter on the device as in
``d_rollingPruningPart``), the output clear and a leap-frog update; the search step (eager) builds the outer list at
``rlistOuter`` and prunes it on the fly at ``rlistInner``. 16 atoms in a cubic box, nstlist 5, 14 steps, virial
only on step 0 (nstcalcenergy 100). The CUDA runtime's ``cudaGraphInstantiate`` / ``cudaGraphExecUpdate`` are
modelled on top of the engine: an executable records the kernel nodes its capture launched
(``launchGpuKernel``), an update whose capture has a different kernel-node list fails as CUDA's does (topology
changed) and otherwise makes the executable launch the new capture. Left out: PME, bondeds, constraints, energies,
the even/odd cross-step events, multi-rank forks and the local/non-local prune choice (single domain).
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/gromacs/gromacs/commit/ecae71521e0d104b7a1605637dbe48fcfe2d64e2"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "do_md"
SYMPTOM = ("odd nstlist with CUDA graphs: after the second search step the even-step graph is recaptured without the "
           "rolling-prune kernel and cudaGraphExecUpdate on the kept executable fails (fatal)")

N_ATOMS, BOX = 16, 2.2
RC, RLIST_INNER, RLIST_OUTER = 0.8, 0.9, 1.1
K_REP, MASS, DT = 5.0, 1.0, 0.005
NUM_ROLLING_PRUNING_PARTS = 2
NSTLIST, NSTCALCENERGY, INIT_STEP, NSTEPS = 5, 100, 0, 14


# --- the CUDA runtime's graph executables, as far as MdGpuGraph uses them ---------------------------------------

class CudaError(RuntimeError):
    pass


_recordingNodes: list[str] | None = None      # kernel nodes of the capture open on the launch stream


def launchGpuKernel(kernelName: str, kernel, *args):
    """``launchGpuKernel``: a kernel launch; inside a stream capture it becomes a kernel node of the graph."""
    if _recordingNodes is not None:
        _recordingNodes.append(kernelName)
    kernel(*args)


class cudaGraph_t:
    def __init__(self, engineGraph, outputs, nodes):
        self.engineGraph, self.outputs, self.nodes = engineGraph, outputs, tuple(nodes)


class cudaGraphExec_t:
    """An executable: launches the kernels of the graph it was instantiated (or last updated) from."""

    def __init__(self, graph: cudaGraph_t):
        self.engineGraph, self.outputs, self.nodes = graph.engineGraph, graph.outputs, graph.nodes


def cudaGraphInstantiate(graph: cudaGraph_t) -> cudaGraphExec_t:
    return cudaGraphExec_t(graph)


def cudaGraphExecUpdate(instance: cudaGraphExec_t, graph: cudaGraph_t) -> None:
    """Only node parameters may change: a graph with other nodes (topology) cannot update the executable."""
    if graph.nodes != instance.nodes:
        raise CudaError("cudaGraphExecUpdate in MD graph definition finalization failed. CUDA error #910 "
                        "(cudaErrorGraphExecUpdateFailure): the graph update was not performed because it included "
                        f"changes which violated constraints specific to instantiated graph update "
                        f"(cudaGraphExecUpdateErrorTopologyChanged: {list(instance.nodes)} -> {list(graph.nodes)})")
    instance.engineGraph, instance.outputs = graph.engineGraph, graph.outputs


# --- src/gromacs/mdlib/mdgraph_gpu_impl.cu ---------------------------------------------------------------------

class MdGpuGraph:
    def __init__(self, evenOrOddStep: str, device: str, stateGpu, havePPDomainDecomposition=False,
                 haveSeparatePmeRank=False):
        self.evenOrOddStep_, self.device_, self.stateGpu_ = evenOrOddStep, device, stateGpu
        self.havePPDomainDecomposition_, self.haveSeparatePmeRank_ = havePPDomainDecomposition, haveSeparatePmeRank
        self.graphCreated_ = self.useGraphThisStep_ = self.graphIsCapturingThisStep_ = False
        self.graph_: cudaGraph_t | None = None
        self.instance_: cudaGraphExec_t | None = None
        self.graphInstanceAllocated_ = False

    def reset(self):
        self.graphCreated_ = False
        self.useGraphThisStep_ = False
        self.graphIsCapturingThisStep_ = False

    def captureThisStep(self, canUseGraphThisStep: bool) -> bool:
        self.useGraphThisStep_ = canUseGraphThisStep
        self.graphIsCapturingThisStep_ = self.useGraphThisStep_ and not self.graphCreated_
        return self.graphIsCapturingThisStep_

    def graphIsCapturingThisStep(self) -> bool:
        return self.graphIsCapturingThisStep_

    def useGraphThisStep(self) -> bool:
        return self.useGraphThisStep_

    def recordStep(self, stepWork):
        """``startRecord`` (cudaStreamBeginCapture on the NB local stream) ... the step's launches ... ``endRecord``
        (cudaGraphDestroy of the old graph_, cudaStreamEndCapture into graph_)."""
        global _recordingNodes
        self.graphCreated_ = True
        _recordingNodes = []
        s = self.stateGpu_
        try:
            engineGraph, outputs = capture(
                stepWork, device=self.device_, warmups=0, name=f"MD step ({self.evenOrOddStep_})",
                state={"d_x": s.d_x, "d_v": s.d_v, "d_f": s.d_f, "nb.f": s.nb_f, "plist.imask": s.imask,
                       "plist.prunedMask": s.prunedMask, "plist.d_rollingPruningPart": s.d_rollingPruningPart},
                owner="MdGpuGraph")
            self.graph_ = cudaGraph_t(engineGraph, outputs, _recordingNodes)
        finally:
            _recordingNodes = None

    def createExecutableGraph(self, forceGraphReinstantiation: bool):
        # Update existing graph (which is cheaper than re-instantiation) if possible.
        if (self.graphInstanceAllocated_ and not self.havePPDomainDecomposition_ and not self.haveSeparatePmeRank_
                and not forceGraphReinstantiation):
            cudaGraphExecUpdate(self.instance_, self.graph_)
        else:
            self.instance_ = None                                  # cudaGraphExecDestroy
            self.instance_ = cudaGraphInstantiate(self.graph_)
            self.graphInstanceAllocated_ = True

    def launchGraphMdStep(self):
        return replay(self.instance_.engineGraph, self.instance_.outputs)     # cudaGraphLaunch


# --- the GPU state, nbnxm pair list and kernels ------------------------------------------------------------------

class StatePropagatorDataGpu:
    def __init__(self, x, v):
        device = x.device
        self.d_x, self.d_v = x.clone(), v.clone()
        self.d_f = torch.zeros_like(x)
        self.nb_f = torch.zeros_like(x)                                        # nbnxm's output force buffer
        self.imask = torch.zeros(N_ATOMS, N_ATOMS, dtype=torch.bool, device=device)   # outer list (rlistOuter)
        self.prunedMask = torch.zeros_like(self.imask)                         # the list the kernel uses
        self.d_rollingPruningPart = torch.zeros((), dtype=torch.long, device=device)


def _pairDistances(x):
    d = x[:, None, :] - x[None, :, :]
    d = d - BOX * torch.round(d / BOX)
    return d, torch.sqrt((d * d).sum(-1))


def nbnxn_kernel(s: StatePropagatorDataGpu, pruneOnTheFly: bool):
    d, r = _pairDistances(s.d_x)
    if pruneOnTheFly:                                  # first kernel after search: prune the outer list at rlistInner
        s.prunedMask.copy_(s.imask & (r < RLIST_INNER))
    inRange = s.prunedMask & (r < RC)
    fscal = torch.where(inRange, K_REP * (RC - r) / r.clamp_min(1e-6), torch.zeros_like(r))
    s.nb_f.add_((fscal[..., None] * d).sum(1))


def nbnxn_kernel_prune(s: StatePropagatorDataGpu, numParts: int):
    """Rolling prune: re-prune one part of the outer list; the part counter lives and advances on the device."""
    _, r = _pairDistances(s.d_x)
    rows = (torch.arange(N_ATOMS, device=r.device) % numParts) == s.d_rollingPruningPart
    s.prunedMask.copy_(torch.where(rows[:, None], s.imask & (r < RLIST_INNER), s.prunedMask))
    s.d_rollingPruningPart.copy_((s.d_rollingPruningPart + 1) % numParts)


def reduceNbForces(s):
    s.d_f.copy_(s.nb_f)


def clearOutputs(s):
    s.nb_f.zero_()


def integrateLeapFrog(s):
    s.d_v.add_(s.d_f * (DT / MASS))
    s.d_x.add_(s.d_v * DT)


class PairlistParams:
    def __init__(self, nstlist):
        self.useDynamicPruning, self.mtsFactor, self.haveMultipleDomains = True, 1, False
        self.lifetime = nstlist - self.mtsFactor
        self.numRollingPruningParts = NUM_ROLLING_PRUNING_PARTS


class nonbonded_verlet_t:
    def __init__(self, nstlist, stateGpu):
        self.params_ = PairlistParams(nstlist)
        self.outerListCreationStep_ = -1
        self.s = stateGpu

    def numStepsWithPairlist(self, step):
        return step - self.outerListCreationStep_

    def putOnGridAndSearch(self, step):
        """Search (host side upstream): the outer list at rlistOuter; the rolling-prune part restarts."""
        s = self.s
        s.d_x.copy_(s.d_x - BOX * torch.floor(s.d_x / BOX))                  # put_atoms_in_box
        _, r = _pairDistances(s.d_x)
        s.imask.copy_((r < RLIST_OUTER) & ~torch.eye(N_ATOMS, dtype=torch.bool, device=r.device))
        s.d_rollingPruningPart.zero_()
        self.outerListCreationStep_ = step

    def isDynamicPruningStepGpu(self, step):
        age = self.numStepsWithPairlist(step)
        p = self.params_
        return (p.useDynamicPruning and 0 < age < p.lifetime and step % p.mtsFactor == 0
                and (p.haveMultipleDomains or age % (2 * p.mtsFactor) == 0))

    def dispatchPruneKernelGpu(self, step):
        launchGpuKernel("nbnxn_kernel_prune_cuda", nbnxn_kernel_prune, self.s, self.params_.numRollingPruningParts)


# --- src/gromacs/mdlib/sim_util.cpp, update ----------------------------------------------------------------------

def launchGpuEndOfStepTasks(nbv: nonbonded_verlet_t, step):
    if nbv.isDynamicPruningStepGpu(step):
        nbv.dispatchPruneKernelGpu(step)
    launchGpuKernel("clear_nb_outputs", clearOutputs, nbv.s)


def do_force(nbv: nonbonded_verlet_t, step, bNS):
    if bNS:
        nbv.putOnGridAndSearch(step)
    launchGpuKernel("nbnxn_kernel_F_cuda", nbnxn_kernel, nbv.s, bNS)
    launchGpuKernel("reduce_nb_forces", reduceNbForces, nbv.s)
    launchGpuEndOfStepTasks(nbv, step)


def update_coords(s):
    launchGpuKernel("leapfrog_kernel", integrateLeapFrog, s)


# --- src/gromacs/mdrun/md.cpp ----------------------------------------------------------------------------------

def do_per_step(step, nstep):
    return nstep != 0 and step % nstep == 0


def do_md(x0, v0, device, variant, useMdGpuGraph):
    stateGpu = StatePropagatorDataGpu(x0, v0)
    nbv = nonbonded_verlet_t(NSTLIST, stateGpu)
    mdGraph_ = {0: MdGpuGraph("EvenStep", device, stateGpu), 1: MdGpuGraph("OddStep", device, stateGpu)}
    pme_loadbal_is_active = False                      # no PME tuning in this run (-notunepme)
    trajectory = []
    for step in range(INIT_STEP, INIT_STEP + NSTEPS):
        bNS = do_per_step(step, NSTLIST)
        bCalcVir = do_per_step(step, NSTCALCENERGY)
        mdGraph = mdGraph_[step % 2] if useMdGpuGraph else None
        if useMdGpuGraph:
            # Reset graph on search step (due to changing neighbour list etc)
            # or virial step (due to changing shifts and box).
            if bNS or bCalcVir:
                mdGraph_[0].reset()
                mdGraph_[1].reset()
            else:
                canUseMdGpuGraphThisStep = not bNS and not bCalcVir
                mdGraph.captureThisStep(canUseMdGpuGraphThisStep)

        def stepWork(step=step, bNS=bNS):
            do_force(nbv, step, bNS)
            update_coords(stateGpu)
            return (stateGpu.d_x,)

        if not useMdGpuGraph or not mdGraph.useGraphThisStep():
            stepWork()
        elif mdGraph.graphIsCapturingThisStep():
            mdGraph.recordStep(stepWork)

        if useMdGpuGraph:
            if mdGraph.graphIsCapturingThisStep():
                if variant == "fix":
                    # Force graph reinstantiation (instead of graph exec update): with PME tuning, since the GPU
                    # kernels chosen by the FFT library can vary with grid size; or with an odd nstlist, since the
                    # odd/even step pruning pattern will change
                    forceGraphReinstantiation = pme_loadbal_is_active or (NSTLIST % 2) == 1
                else:
                    # Force graph reinstantiation (instead of graph exec update) with PME tuning,
                    # since the GPU kernels chosen by the FFT library can vary with grid size
                    forceGraphReinstantiation = pme_loadbal_is_active
                mdGraph.createExecutableGraph(forceGraphReinstantiation)
            if mdGraph.useGraphThisStep():
                mdGraph.launchGraphMdStep()
        trajectory.append(stateGpu.d_x.clone())
    return [torch.stack(trajectory), stateGpu.d_v.clone()]


def run(variant: str, device: str = "cpu"):
    gen = generator(4813)
    x0 = (torch.rand(N_ATOMS, 3, generator=gen) * BOX).to(device)
    v0 = randn(N_ATOMS, 3, gen=gen, device=device, scale=0.5)
    return compare(__name__.rsplit(".", 1)[-1], variant, device,
                   lambda: do_md(x0, v0, device, variant, useMdGpuGraph=True),
                   lambda: do_md(x0, v0, device, variant, useMdGpuGraph=False))
