"""HIP runtime (clr): an allocation made by ``hipMallocAsync`` inside a stream capture, with no free node, is not entered in ``Graph::memAllocNodePtrs_``, so graph-memory reuse takes it for a freed-in-graph temporary and unmaps it on ``hipGraphExecDestroy``; a second graph that keeps reading it faults.

Upstream: https://github.com/ROCm/rocm-systems/pull/7092 ("ROCM-25960 - [clr] Fix use-after-free of stream-captured
graph allocations on destroy", ROCm/rocm-systems, jaydeeppatel1111, opened 2026-06-11, merged). It names as the culprit
commit 803d1e2 of the same repository (graph-memory reuse for alloc nodes, whose memory is unmapped when the
executable graph is destroyed). Report: https://github.com/ROCm/rocm-libraries/issues/8105 (rocSPARSE
``csrsv.level2`` GPU memory fault in ``markers2position`` on gfx94X; jsandham traced it to a HIP-graph regression
between ROCm 7.13 and 7.14 and posted a HIP-only reproducer). Read: the PR description ("A graph allocation that
escapes its graph (an allocation node with no matching free node) must remain valid after the graph and executable
graph are destroyed. Allocations built via stream capture were not tracked in memAllocNodePtrs_, so they were
misclassified as reusable and unmapped on hipGraphExecDestroy ... has_matching_free in VirtualMemAllocNode::submit,
which is keyed entirely off the per-graph set memAllocNodePtrs_ ... Explicit path wires bookkeeping but capture path
does not"); the issue comment with the reproducer (capture an allocation, launch the graph to perform it, destroy the
graph, use the memory: memory access fault); and ``hip_graph_internal.hpp``/``.cpp`` of clr as stored (the
``memAllocNodePtrs_`` member, "mem alloc dptrs whose corresponding free node is not added to the graph", and
``Graph::clone`` copying it). The merged diff itself was not available to me: the capture-path bookkeeping is modelled
as the description states it.
Symptom: a library that runs a set-up phase under HIP-graph capture (rocSPARSE's analysis in its graph tests; here a
user who captures the analysis, launches it once and then destroys that one-shot graph) keeps a pointer the captured
``hipMallocAsync`` returned. Every later use of it, here the replays of the solve graph, faults ("Memory access
fault by GPU"). Explicitly built graphs (``hipGraphAddMemAllocNode``) and ROCm 7.13 are fine.
Mechanism: graph-memory reuse decides per alloc node, in ``VirtualMemAllocNode::submit``, whether its allocation is
freed inside the graph (``has_matching_free``): only then is it graph-private, may be reused, and is unmapped when the
executable graph is destroyed. ``has_matching_free`` is "the pointer is not in ``memAllocNodePtrs_``", the set of
allocations whose free node has not been added. ``hipGraphAddMemAllocNode`` inserts the pointer and
``hipGraphAddMemFreeNode`` erases it, but the capture path (``capturehipMallocAsync`` / ``capturehipFreeAsync``) did
neither, so under capture the set stays empty and every captured allocation looks freed in-graph. An escaping one
(its ``hipFreeAsync`` comes after the graph, from ``csrsv_clear``) is unmapped by ``hipGraphExecDestroy`` of the
set-up graph while the user, and the solve graph captured meanwhile, still hold its address.
Doctor: dangling-reference, at capturehipMallocAsync: every replay of the solve graph reads the analysis buffer by
address after the runtime that owned it has unmapped it; the escaping allocation loses its protection where the
capture path creates the alloc node without recording it in ``memAllocNodePtrs_``, which is what the fix adds.
Fix (upstream): the capture path does the explicit path's bookkeeping: ``capturehipMallocAsync`` inserts the new
pointer into the capture graph's ``memAllocNodePtrs_`` and ``capturehipFreeAsync`` erases it, so an escaping
allocation is no longer reusable and survives ``hipGraphExecDestroy`` (CUDA's behaviour, per the PR's parity test).
Modelled: clr reduced to its graph-memory bookkeeping, with upstream names: ``Graph`` (nodes, ``memAllocNodePtrs_``),
``GraphMemAllocNode`` / ``GraphMemFreeNode``, ``GraphExec`` whose ``run`` submits each alloc node
(``VirtualMemAllocNode::submit``: ``has_matching_free``) and whose destroy unmaps the reusable ones, the explicit
``hipGraphAddMemAllocNode`` / ``hipGraphAddMemFreeNode``, the capture path ``capturehipMallocAsync`` /
``capturehipFreeAsync`` behind ``hipMallocAsync`` / ``hipFreeAsync``, and ``hipStreamBeginCapture``...``EndCapture``
as one call that captures a body with the engine. A pointer is a tensor; the alloc node's virtual-memory mapping is
the storage of the tensor captured for it (a block of the graph's pool), and unmapping is ``resize_(0)`` of that
storage (a CUDA graph keeps the old address). The library is a rocSPARSE-like lower-triangular solve: ``csrsv_analysis``
allocates its info buffer with ``hipMallocAsync`` (escaping; ``csrsv_clear`` frees it) and a scratch buffer it frees
in-graph, and stores ``D^-1`` and ``D^-1 L_strict``; ``csrsv_solve`` runs ``n`` sweeps of ``x = D^-1 b - (D^-1
L_strict) x`` (exact after ``n`` sweeps, the strict part being nilpotent). Level scheduling, CSR storage and the
``markers2position`` kernel are left out. The application is an implicit time stepper whose every step solves
``L x = x_prev + dt*f``. float64.
Workload: n = 6, 5 time steps. Bug: the analysis graph is captured, launched once, the solve graph captured, the
analysis graph destroyed (its exec first); the first replay of the solve graph raises IllegalMemoryAccess (the info
buffer's storage was given other memory, which freed the captured one). The scratch buffer, freed in-graph, is
unmapped in both variants and nobody reads it. Fix: the info buffer survives the destroy and all 5 solutions equal
eager (max error 0).
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, release_to_driver, replay

UPSTREAM = "https://github.com/ROCm/rocm-systems/pull/7092"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "capturehipMallocAsync"
SYMPTOM = ("HIP: a hipMallocAsync captured into a graph without a free node is unmapped by hipGraphExecDestroy "
           "(capture path never enters it in memAllocNodePtrs_), so later users of the pointer fault")

N, STEPS, DT = 6, 5, 0.1
DTYPE = torch.float64

_variant = "bug"


# --- clr: hip_graph_internal.hpp / hip_graph.cpp (graph-memory bookkeeping only) ------------------------------------

class GraphMemAllocNode:
    def __init__(self, graph: "Graph", dptr: torch.Tensor):
        self.graph, self.dptr = graph, dptr
        self.reusable = False          # set at submit: the allocation takes part in graph-memory reuse

    def submit(self) -> None:
        """``VirtualMemAllocNode::submit``: an allocation freed inside its graph is graph-private memory that the
        reuse machinery may hand on, and that is unmapped when the executable graph is destroyed."""
        has_matching_free = id(self.dptr) not in self.graph.memAllocNodePtrs_
        self.reusable = has_matching_free

    def unmap(self) -> None:
        self.dptr.untyped_storage().resize_(0)


class GraphMemFreeNode:
    def __init__(self, graph: "Graph", dptr: torch.Tensor):
        self.graph, self.dptr = graph, dptr


class Graph:
    def __init__(self):
        self.nodes: list = []
        self.memAllocNodePtrs_: set[int] = set()   # mem alloc dptrs whose corresponding free node is not added
        self.engine_graph, self.outputs = None, None


class GraphExec:
    def __init__(self, graph: Graph):
        self.graph = graph
        self.alloc_nodes = [n for n in graph.nodes if isinstance(n, GraphMemAllocNode)]

    def run(self):
        for node in self.alloc_nodes:
            node.submit()
        return replay(self.graph.engine_graph, self.graph.outputs)

    def destroy(self, device: str) -> None:
        for node in self.alloc_nodes:
            if node.reusable:                      # graph-owned memory goes back: its mapping is released
                node.unmap()
        release_to_driver(device)


class Stream:
    def __init__(self, device: str):
        self.device = device
        self.capture_graph: Graph | None = None


def hipGraphAddMemAllocNode(graph: Graph, elems: int, device: str) -> torch.Tensor:
    """The explicit path: the new pointer is recorded as one whose free node is not (yet) in the graph."""
    dptr = torch.empty(elems, dtype=DTYPE, device=device)
    graph.nodes.append(GraphMemAllocNode(graph, dptr))
    graph.memAllocNodePtrs_.add(id(dptr))
    return dptr


def hipGraphAddMemFreeNode(graph: Graph, dptr: torch.Tensor) -> None:
    graph.nodes.append(GraphMemFreeNode(graph, dptr))
    graph.memAllocNodePtrs_.discard(id(dptr))


def capturehipMallocAsync(stream: Stream, elems: int) -> torch.Tensor:
    graph = stream.capture_graph
    dptr = torch.empty(elems, dtype=DTYPE, device=stream.device)      # the node's mapping, in the graph's pool
    graph.nodes.append(GraphMemAllocNode(graph, dptr))
    if _variant == "fix":
        graph.memAllocNodePtrs_.add(id(dptr))       # as hipGraphAddMemAllocNode: no free node yet
    return dptr


def capturehipFreeAsync(stream: Stream, dptr: torch.Tensor) -> None:
    graph = stream.capture_graph
    graph.nodes.append(GraphMemFreeNode(graph, dptr))
    if _variant == "fix":
        graph.memAllocNodePtrs_.discard(id(dptr))   # freed in-graph: reusable


def hipMallocAsync(elems: int, stream: Stream) -> torch.Tensor:
    if stream.capture_graph is not None:
        return capturehipMallocAsync(stream, elems)
    return torch.empty(elems, dtype=DTYPE, device=stream.device)


def hipFreeAsync(dptr: torch.Tensor, stream: Stream) -> None:
    if stream.capture_graph is not None:
        capturehipFreeAsync(stream, dptr)
    # eagerly the stream-ordered pool takes the block back once the caller drops the pointer


def hipStreamCapture(stream: Stream, body, name: str, static=None) -> Graph:
    """``hipStreamBeginCapture`` ... ``body`` ... ``hipStreamEndCapture``: the body's work becomes the graph."""
    hip_graph = Graph()
    stream.capture_graph = hip_graph
    try:
        hip_graph.engine_graph, hip_graph.outputs = capture(body, device=stream.device, warmups=0, name=name,
                                                            owner="HIP stream capture", static=static)
    finally:
        stream.capture_graph = None
    return hip_graph


def hipGraphInstantiate(graph: Graph) -> GraphExec:
    return GraphExec(graph)


def hipGraphLaunch(exec_: GraphExec, stream: Stream):
    return exec_.run()


def hipGraphExecDestroy(exec_: GraphExec, stream: Stream) -> None:
    exec_.destroy(stream.device)


def hipGraphDestroy(graph: Graph) -> None:
    graph.engine_graph.reset()
    graph.nodes.clear()


# --- a rocSPARSE-like triangular solve (csrsv_analysis / csrsv_solve / csrsv_clear) --------------------------------

class CsrsvInfo:
    def __init__(self):
        self.buffer: torch.Tensor | None = None    # [D^-1 (n) | D^-1 L_strict (n*n)], hipMallocAsync'd, escaping


def csrsv_analysis(L: torch.Tensor, info: CsrsvInfo, stream: Stream) -> torch.Tensor:
    n = L.shape[0]
    info.buffer = hipMallocAsync(n + n * n, stream)
    scratch = hipMallocAsync(n, stream)                     # temporary: freed before the analysis returns
    scratch.copy_(torch.diagonal(L))
    inv_diag = info.buffer[:n]
    inv_diag.copy_(scratch.reciprocal())
    info.buffer[n:].view(n, n).copy_(torch.tril(L, -1) * inv_diag[:, None])
    hipFreeAsync(scratch, stream)
    return info.buffer


def csrsv_solve(info: CsrsvInfo, b: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    inv_diag, scaled_strict = info.buffer[:n], info.buffer[n:].view(n, n)
    c = inv_diag * b
    x.copy_(c)
    for _ in range(n - 1):
        x.copy_(c - scaled_strict @ x)
    return x


def csrsv_clear(info: CsrsvInfo, stream: Stream) -> None:
    hipFreeAsync(info.buffer, stream)
    info.buffer = None


# --- the application: implicit time stepping, L x_{t+1} = x_t + dt f ------------------------------------------------

def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(7092)
    L = torch.tril(randn(N, N, gen=gen, device=device, scale=0.3)).to(DTYPE)
    L += torch.diag(2.0 + torch.rand(N, generator=gen, dtype=DTYPE)).to(device)
    x0 = randn(N, gen=gen, device=device).to(DTYPE)
    f = randn(N, gen=gen, device=device).to(DTYPE)

    def simulate(use_graphs: bool):
        stream = Stream(device)
        info = CsrsvInfo()
        b = torch.zeros(N, dtype=DTYPE, device=device)
        x = torch.zeros(N, dtype=DTYPE, device=device)
        state = x0.clone()
        out = []
        if not use_graphs:
            csrsv_analysis(L, info, stream)
            for _ in range(STEPS):
                b.copy_(state + DT * f)
                state = csrsv_solve(info, b, x).clone()
                out.append(state)
        else:
            analysis = hipStreamCapture(stream, lambda: csrsv_analysis(L, info, stream), name="csrsv analysis")
            analysis_exec = hipGraphInstantiate(analysis)
            hipGraphLaunch(analysis_exec, stream)            # performs the allocation and the analysis
            solve = hipStreamCapture(stream, lambda: csrsv_solve(info, b, x), name="csrsv solve",
                                     static={"rhs": b})
            solve_exec = hipGraphInstantiate(solve)
            hipGraphExecDestroy(analysis_exec, stream)       # the one-shot set-up graph is no longer needed
            hipGraphDestroy(analysis)
            for _ in range(STEPS):
                b.copy_(state + DT * f)
                state = hipGraphLaunch(solve_exec, stream).clone()
                out.append(state)
        csrsv_clear(info, stream)
        return [torch.stack(out)]

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: simulate(True), lambda: simulate(False))
