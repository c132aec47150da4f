"""AlphaNet's whole-step CUDA graph for ASE inference: a captured step is reused for a same-size system whose species changed (an MC swap), but its static atomic-number buffer keeps the capture-time species.

Upstream: https://github.com/zmyybc/AlphaNet/pull/13 ("Accelerate ASE inference: real-arithmetic rewrite, CUDA graphs,
fused Triton kernels", zmyybc/AlphaNet, by yckbz, opened 2026-07-07, merged; the review thread on
``alphanet/infer/cuda_graph.py:62`` flagged "Refresh atomic numbers when reusing CUDA graphs", and the PR added
``CapturedStep.refresh_z`` and its call before the merge).
Read: the PR description and that review comment; ``alphanet/infer/cuda_graph.py`` (``CapturedStep.__init__``:
static ``pos_in`` / ``cell_in`` / ``_edge_index`` / ``_cell_offsets`` buffers, ``self._z = z.detach().clone()``,
padding edges as (0, 0) self-pairs shifted ``_PAD_SHIFT`` cells, warmup then capture of ``_run``;
``update_topology``; ``refresh_z``; ``_load_inputs``; ``run``) and ``alphanet/infer/calc.py``
(``AlphaNetCalculator._graph_step_for``: release on atom-count/stress change, ``update_topology`` when the topology
object changed, capture when none, then ``step.refresh_z(z)``) at the stored snapshot 017f94d (after the fix). The
code before the fix is that code without ``refresh_z`` and its call, as the review comment describes it.
Symptom: reusing the calculator on a same-size ``Atoms`` with different atomic numbers (composition screening, MC
species swaps) returns energies and forces of the old composition under CUDA graphs; eager is right.
Mechanism: the captured kernels read the species from ``CapturedStep._z``, a clone made at capture. A species change
rebuilds the neighbour topology, and ``_graph_step_for`` refreshes the static edge buffers through ``update_topology``
without recapturing (same atom count, edges fit), but nothing writes the new ``z`` into ``_z``: every replay embeds
the atoms with the capture-time species.
Doctor: stale-input, at _graph_step_for. The step reuses the captured graph and refreshes positions, cell and edges,
but leaves ``_z``, a static input the graph reads, as an earlier composition left it.
Fix (upstream): ``CapturedStep.refresh_z`` copies ``z`` into ``_z`` in place, called by ``_graph_step_for`` on every
step it returns.
Modelled: ``CapturedStep`` (static buffers, padded edges with ``_PAD_SHIFT``, warmups then capture, ``update_topology``,
``refresh_z``, ``run``) and ``_graph_step_for`` as read (auto timing left out: graphs forced on, forces only); the
calculator's rebuild of the topology when numbers change. Stand-ins: the AlphaNet model is a species-embedded pair
potential with a smooth cutoff, masked beyond the cutoff as in the static-shape mode, forces computed analytically
(the upstream graph captures ``torch.autograd.grad``); a brute-force neighbour list with cutoff + skin; float64.
Workload: 5 atoms in a periodic cubic cell; three MD-like steps with species [1, 6, 8, 1, 6] (graph captured on the
first), then an MC swap to [8, 1, 6, 6, 1] (same count: topology rebuilt, graph reused) and two more steps.
Bug: the swapped steps return the old composition's energy and forces (max error 0.294). Fix: all five steps equal
eager (max error 0).
"""
from __future__ import annotations

import dataclasses
import math

import torch

from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/zmyybc/AlphaNet/pull/13"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "_graph_step_for"
SYMPTOM = ("a captured AlphaNet step reused after an MC species swap keeps the capture-time atomic numbers: energies "
           "and forces of the old composition")

DTYPE = torch.float64
N_SPECIES, EMB = 10, 4
CUTOFF, SKIN, _PAD_SHIFT = 3.0, 0.5, 16
BOX = 4.5

_variant = "bug"


@dataclasses.dataclass
class NeighborTopology:
    edge_index: torch.Tensor       # [2, E] (i, j)
    cell_offsets: torch.Tensor     # [E, 3] integer cell shifts of j


def build_neighbor_topology(pos, cell, cutoff, skin):
    """Brute-force neighbour list within cutoff + skin over the 27 nearest images."""
    n = pos.shape[0]
    pairs, offs = [], []
    for i in range(n):
        for j in range(n):
            for sx in (-1, 0, 1):
                for sy in (-1, 0, 1):
                    for sz in (-1, 0, 1):
                        if i == j and sx == sy == sz == 0:
                            continue
                        s = torch.tensor([sx, sy, sz], dtype=DTYPE)
                        if torch.linalg.norm(pos[j] + s @ cell - pos[i]) < cutoff + skin:
                            pairs.append((i, j))
                            offs.append((sx, sy, sz))
    return NeighborTopology(torch.tensor(pairs, dtype=torch.long).T.contiguous(),
                            torch.tensor(offs, dtype=torch.int32))


class AlphaNetWrapper:
    """Stand-in model: species embeddings, pair energies with a smooth cutoff, masked beyond the cutoff."""

    def __init__(self, device):
        gen = generator(13)
        self.embedding = (torch.randn(N_SPECIES, EMB, generator=gen, dtype=DTYPE) * 0.5 + 1.0).to(device)
        self.w = (torch.randn(EMB, EMB, generator=gen, dtype=DTYPE) * 0.3).to(device)
        self.w = self.w + self.w.T

    def forward_graph(self, pos, z, cell, edge_index, cell_offsets):
        i, j = edge_index[0], edge_index[1]
        vec = pos[j] + cell_offsets.to(DTYPE) @ cell - pos[i]
        d = vec.norm(dim=-1)
        edge_mask = (d < CUTOFF).to(DTYPE)                              # static-shape mode: mask, don't filter
        h = self.embedding[z]
        c = ((h[i] @ self.w) * h[j]).sum(-1)                            # species coupling of the pair
        x = (d / CUTOFF).clamp(max=1.0)
        fc = 0.5 * (torch.cos(math.pi * x) + 1.0)                       # smooth cutoff
        phi = torch.exp(-d)
        e_edge = 0.5 * c * phi * fc * edge_mask
        energy = e_edge.sum().reshape(1)
        dfc = -0.5 * math.pi / CUTOFF * torch.sin(math.pi * x)
        de_dd = 0.5 * c * edge_mask * (-phi * fc + phi * dfc)
        g = (de_dd / d.clamp(min=1e-12))[:, None] * vec                 # dE/dvec
        forces = torch.zeros_like(pos).index_add_(0, i, g).index_add_(0, j, -g)
        return energy, forces


# --- alphanet/infer/cuda_graph.py -------------------------------------------------------------------------------------

class CapturedStep:
    """One CUDA graph per (topology window capacity, stress mode)."""

    def __init__(self, model, topology, z, n_atoms, device, positions, cell, capacity_factor=1.1, warmup=3):
        self.model, self.n_atoms, self.device = model, n_atoms, device
        self.topology_ref = None
        n_edges = int(topology.edge_index.shape[1])
        self.capacity = max(int(math.ceil(n_edges * capacity_factor)), n_edges + 8)
        # --- static buffers (inputs the captured kernels read) ---
        self.pos_in = torch.zeros(n_atoms, 3, dtype=DTYPE, device=device)
        self.cell_in = torch.zeros(3, 3, dtype=DTYPE, device=device)
        self._edge_index = torch.zeros(2, self.capacity, dtype=torch.long, device=device)
        self._cell_offsets = torch.zeros(self.capacity, 3, dtype=torch.int32, device=device)
        self._z = z.detach().clone()
        self.update_topology(topology)
        self._load_inputs(positions, cell)

        def _run():
            return self.model.forward_graph(self.pos_in, self._z, self.cell_in, self._edge_index, self._cell_offsets)

        static = {"pos_in": self.pos_in, "cell_in": self.cell_in, "_edge_index": self._edge_index,
                  "_cell_offsets": self._cell_offsets, "_z": self._z}
        self.graph, (self.energy, self.forces) = capture(_run, device=device, warmups=warmup, static=static,
                                                         owner="CapturedStep", name="alphanet whole step")

    def update_topology(self, topology) -> bool:
        n_edges = int(topology.edge_index.shape[1])
        if n_edges > self.capacity or (int(topology.edge_index.max()) if n_edges else 0) >= self.n_atoms:
            return False
        with torch.no_grad():
            self._edge_index[:, :n_edges] = topology.edge_index.to(self.device)
            self._edge_index[:, n_edges:] = 0
            self._cell_offsets[:n_edges] = topology.cell_offsets.to(self.device)
            self._cell_offsets[n_edges:] = 0
            self._cell_offsets[n_edges:, 0] = _PAD_SHIFT
        self.topology_ref = topology
        return True

    def refresh_z(self, z: torch.Tensor) -> None:
        """Refresh the static atomic-number buffer read by the captured kernels (added by the fix)."""
        with torch.no_grad():
            self._z.copy_(z)

    def _load_inputs(self, positions, cell):
        with torch.no_grad():
            self.pos_in.copy_(positions)
            self.cell_in.copy_(cell)

    def run(self, positions, cell):
        self._load_inputs(positions, cell)
        return replay(self.graph, (self.energy, self.forces), size=1)


# --- alphanet/infer/calc.py (reduced) ---------------------------------------------------------------------------------

class AlphaNetCalculator:
    def __init__(self, model, device, use_cuda_graph):
        self.model, self.device, self.use_cuda_graph = model, device, use_cuda_graph
        self._neighbor_topology = None
        self._reference_numbers = None
        self._captured_step = None

    def _graph_step_for(self, topology, z, n_atoms, positions, cell):
        step = self._captured_step
        if step is not None and step.n_atoms != n_atoms:
            self._captured_step = step = None
        if step is not None and step.topology_ref is not topology:
            if not step.update_topology(topology):           # edge count outgrew the captured capacity
                self._captured_step = step = None
        if step is None:
            step = CapturedStep(self.model, topology, z, n_atoms, self.device, positions, cell)
            self._captured_step = step
        if _variant == "fix":
            step.refresh_z(z)
        return step

    def calculate(self, numbers, positions_cpu, cell_cpu):
        n_atoms = len(numbers)
        # a species change (or the first call) rebuilds the neighbour topology; positions stay within the skin here
        if self._neighbor_topology is None or self._reference_numbers != numbers:
            self._neighbor_topology = build_neighbor_topology(positions_cpu, cell_cpu, CUTOFF, SKIN)
            self._reference_numbers = list(numbers)
        topology = self._neighbor_topology
        z = torch.tensor(numbers, dtype=torch.long).to(self.device)
        positions, cell = positions_cpu.to(self.device), cell_cpu.to(self.device)
        if self.use_cuda_graph:
            step = self._graph_step_for(topology, z, n_atoms, positions, cell)
            energy, forces = step.run(positions, cell)
        else:
            energy, forces = self.model.forward_graph(positions, z, cell, topology.edge_index.to(self.device),
                                                      topology.cell_offsets.to(self.device))
        return energy.clone(), forces.clone()                 # consumed before the next call, as ASE does


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    cell = torch.eye(3, dtype=DTYPE) * BOX
    gen = generator(7)
    base = torch.rand(5, 3, generator=gen, dtype=DTYPE) * BOX
    moves = [torch.randn(5, 3, generator=gen, dtype=DTYPE) * 0.05 for _ in range(5)]
    species = [[1, 6, 8, 1, 6]] * 3 + [[8, 1, 6, 6, 1]] * 2   # MC swap after three steps

    def serve(use_graph):
        calc = AlphaNetCalculator(AlphaNetWrapper(device), device, use_graph)
        outs = []
        for numbers, move in zip(species, moves):
            energy, forces = calc.calculate(numbers, base + move, cell)
            outs += [energy, forces]
        return outs

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
