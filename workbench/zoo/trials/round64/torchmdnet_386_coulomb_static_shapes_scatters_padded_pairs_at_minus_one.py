"""Static-shape (CUDA-graph) ScalarPlusWeightedCoulomb scatters the padded (-1, -1) neighbour pairs at index -1: out of range.

Upstream: https://github.com/torchmd/torchmd-net/pull/386 ("fix static shapes in coulomb output model", merged as
bba7351, March 2026).
Symptom: with ``static_shapes=True`` (what CUDA-graph capture of a TorchMD-Net model needs) the model with the
``ScalarPlusWeightedCoulomb`` output (cutoff mode) cannot run: ``index_add`` raises "index out of range in self"
on the CPU and hits a device-side assert on CUDA, while the dynamic-shape model works; the PR adds
``tests/test_staticshapes.py`` comparing static and dynamic energies/forces on CPU and CUDA.
Mechanism: ``ScalarPlusWeightedCoulomb.__init__`` builds ``OptimizedDistance(max_num_pairs=-max_num_neighbors,
resize_to_fit=not static_shapes, loop=False, include_transpose=False)``. Under static shapes the neighbour kernel
(``torch_neighbor_bruteforce``) returns ``max_num_neighbors * n_atoms`` slots: the found pairs first, then
``(-1, -1)`` pairs with distance 0, so the captured graph keeps one shape while the number of real pairs changes
every MD step. ``pre_reduce`` already appended a zero-charge dummy atom (``charges = torch.cat([charges, zeros(1,
q)])``) and sized ``e_i`` with ``x.shape[0] + 1`` rows for static shapes, dropping the last row at the end; the
gathers ``charges[edge_index[0]]`` happen to hit the dummy through negative indexing, but the scatters
``e_i.index_add(0, edge_index[0], e_ij)`` get index -1, which ``index_add`` rejects (CPU bounds check; on CUDA the
unsigned 32-bit kernel index turns -1 into 2**32 - 1 and the kernel assert fires). Warmup, capture and every
replay of the graph-compatible model die on the padded rows; the eager dynamic model (``resize_to_fit`` drops the
(-1, -1) pairs) never sees them.
Doctor: stale-padding, at ``pre_reduce`` (the padded pair rows' -1 indices, left as the neighbour list wrote them,
are scattered into the per-atom energies, so every real row depends on what the padded rows hold).
Fix (upstream): in the static-shape branch of ``pre_reduce``, ``mask = (edge_index[0] < 0).unsqueeze(0)
.expand_as(edge_index); edge_index = edge_index.masked_fill(mask, z.shape[0]); edge_weight =
edge_weight.masked_fill(mask[0], 0)``: padded pairs point at the dummy atom, whose row is dropped.
Model: one small molecule, several MD steps served by one captured ``TorchMD_Net.forward`` (static ``pos``
buffer); the reference is the eager dynamic-shape model (``static_shapes=False``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/torchmd/torchmd-net/pull/386"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "pre_reduce"
SYMPTOM = "static-shape (CUDA-graph) Coulomb output scatters padded (-1, -1) pairs: index out of range / device assert"

N_ATOMS, HIDDEN, Q_DIM, MAX_Z, STEPS = 6, 4, 3, 10, 4
COULOMB_CUTOFF, MAX_NUM_NEIGHBORS, EPSILON_SOLVENT = 2.5, 4, 78.3
FACTOR = 14.399645                                              # Coulomb constant, eV * Angstrom


def torch_neighbor_bruteforce(positions, batch, cutoff_lower, cutoff_upper, max_num_pairs):
    """``loop=False, include_transpose=False``: pairs i > j, valid ones sorted by distance first, then (-1, -1)."""
    n_atoms = positions.size(0)
    tril = torch.tril_indices(n_atoms, n_atoms, offset=-1, device=positions.device)
    i_indices, j_indices = tril[0], tril[1]
    deltas = positions[i_indices] - positions[j_indices]
    dist_sq = (deltas * deltas).sum(dim=-1)
    distances = torch.where(dist_sq == 0, torch.zeros_like(dist_sq), torch.sqrt(dist_sq.clamp(min=1e-32)))
    valid_mask = (batch[i_indices] == batch[j_indices]) & (distances < cutoff_upper) & (distances >= cutoff_lower)
    sort_key = torch.where(valid_mask, distances, torch.full_like(distances, float("inf")))
    num_candidates = min(sort_key.size(0), max_num_pairs)
    order = torch.argsort(sort_key)[:num_candidates]
    i_out, j_out = i_indices.index_select(0, order), j_indices.index_select(0, order)
    distances_out, valid_out = distances.index_select(0, order), valid_mask.index_select(0, order)
    if num_candidates < max_num_pairs:                          # pad to max_num_pairs (fixed output shape)
        pad = max_num_pairs - num_candidates
        pad_indices = torch.full((pad,), -1, device=positions.device, dtype=torch.long)
        i_out, j_out = torch.cat([i_out, pad_indices]), torch.cat([j_out, pad_indices])
        distances_out = torch.cat([distances_out, torch.zeros(pad, device=positions.device)])
        valid_out = torch.cat([valid_out, torch.zeros(pad, device=positions.device, dtype=torch.bool)])
    neighbors = torch.stack([torch.where(valid_out, i_out, torch.full_like(i_out, -1)),
                             torch.where(valid_out, j_out, torch.full_like(j_out, -1))])
    distances_out = torch.where(valid_out, distances_out, distances_out.detach() * 0)
    return neighbors, distances_out


class OptimizedDistance:
    def __init__(self, cutoff_lower, cutoff_upper, max_num_pairs, resize_to_fit):
        self.cutoff_lower, self.cutoff_upper = cutoff_lower, cutoff_upper
        self.max_num_pairs, self.resize_to_fit = max_num_pairs, resize_to_fit

    def __call__(self, pos, batch):
        max_pairs = -self.max_num_pairs * pos.shape[0] if self.max_num_pairs < 0 else self.max_num_pairs
        edge_index, edge_weight = torch_neighbor_bruteforce(pos, batch, self.cutoff_lower, self.cutoff_upper,
                                                            max_pairs)
        if self.resize_to_fit:                                  # remove (-1, -1) pairs (dynamic shapes only)
            mask = edge_index[0] != -1
            edge_index, edge_weight = edge_index[:, mask], edge_weight[mask]
        return edge_index, edge_weight, None


def _exp_cutoff(d, rc: float):
    """Short-range damping copied from aimnetcentral."""
    return torch.exp(-1.0 / (1.0 - (d / rc).clamp(0, 1.0 - 1e-6).pow(2))) / 0.36787944117144233


class ScalarPlusWeightedCoulomb:
    def __init__(self, device, variant, static_shapes, gen):
        self.variant, self.static_shapes, self.cutoff = variant, static_shapes, COULOMB_CUTOFF
        self.output_network = [randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5),
                               randn(HIDDEN, 1, gen=gen, device=device, scale=0.5)]
        self.qweights = torch.tensor([1.0, 0.5, 0.25], device=device)
        self.distance = OptimizedDistance(0.0, self.cutoff, -MAX_NUM_NEIGHBORS, resize_to_fit=not static_shapes)
        self.epsilon_solvent = EPSILON_SOLVENT

    def pre_reduce(self, x, z, pos, batch):
        charges = x[:, HIDDEN:]                                 # the charges are appended at the end of x
        x = F.silu(x[:, :HIDDEN] @ self.output_network[0]) @ self.output_network[1]
        edge_index, edge_weight, _ = self.distance(pos, batch)
        if self.static_shapes:
            if self.variant == "fix":
                # -1 in edge index need to be mapped to an extra dummy atom
                mask = (edge_index[0] < 0).unsqueeze(0).expand_as(edge_index)
                edge_index = edge_index.masked_fill(mask, z.shape[0])
                edge_weight = edge_weight.masked_fill(mask[0], 0)
            # we need a dummy atom
            charges = torch.cat([charges, torch.zeros(1, charges.shape[1], device=charges.device,
                                                      dtype=charges.dtype)], dim=0)
        q_i, q_j = charges[edge_index[0]], charges[edge_index[1]]
        d_ij = edge_weight
        fc = 1.0 - _exp_cutoff(d_ij, 4.6)
        k_rf = (1.0 / self.cutoff ** 3) * (self.epsilon_solvent - 1.0) / (2.0 * self.epsilon_solvent + 1.0)
        c_rf = (1.0 / self.cutoff) * (3.0 * self.epsilon_solvent) / (2.0 * self.epsilon_solvent + 1.0)
        e_ij = fc.unsqueeze(-1) * q_i * q_j * (1.0 / d_ij + k_rf * d_ij ** 2 - c_rf).unsqueeze(-1)
        e_ij = FACTOR * e_ij
        e_ij = torch.sum(e_ij * self.qweights.unsqueeze(0), dim=-1) / torch.sum(self.qweights)
        # sum into nodes
        e_i = torch.zeros(x.shape[0] + 1 if self.static_shapes else x.shape[0], device=x.device, dtype=x.dtype)
        e_i = e_i.index_add(0, edge_index[0], e_ij)
        e_i = e_i.index_add(0, edge_index[1], e_ij)
        if self.static_shapes:
            e_i = e_i[:-1]
        return x + e_i.unsqueeze(-1)


class TorchMD_Net:
    """A representation model whose per-atom features carry ``Q_DIM`` charges at the end, then the output model."""

    def __init__(self, device, variant, static_shapes):
        gen = generator(386)
        self.embedding = randn(MAX_Z, HIDDEN, gen=gen, device=device)
        self.proj = randn(2 * HIDDEN, HIDDEN + Q_DIM, gen=gen, device=device, scale=1.0 / math.sqrt(2 * HIDDEN))
        self.output_model = ScalarPlusWeightedCoulomb(device, variant, static_shapes, gen)

    def forward(self, z, pos, batch):
        h = self.embedding[z]
        centroid = pos - pos.mean(0, keepdim=True)
        x = torch.cat([h, h * centroid.norm(dim=-1, keepdim=True)], dim=-1) @ self.proj
        x = self.output_model.pre_reduce(x, z, pos, batch)
        energy = torch.zeros(1, 1, device=x.device, dtype=x.dtype).index_add(0, batch, x)   # reduce_op="sum"
        return torch.cat([x, energy], dim=0)


def run(variant: str, device: str = "cpu"):
    gen = generator(3860)
    z = torch.randint(1, MAX_Z, (N_ATOMS,), generator=gen).to(device)
    pos0 = torch.randn(N_ATOMS, 3, generator=gen) * 1.2
    trajectory = [(pos0 + torch.randn(N_ATOMS, 3, generator=gen) * 0.3).to(device) for _ in range(STEPS)]
    batch = torch.zeros(N_ATOMS, dtype=torch.long, device=device)

    def serve():
        model = TorchMD_Net(device, variant, static_shapes=True)
        static_pos = trajectory[0].clone()
        g, out = capture(lambda: model.forward(z, static_pos, batch), device=device, name=f"{N_ATOMS} atoms",
                         owner="TorchMD_Net (static_shapes, CUDA graph)", static={"pos": static_pos})
        outs = []
        for pos in trajectory:
            static_pos.copy_(pos)
            outs.append(replay(g, out).clone())
        return outs

    def eager():
        model = TorchMD_Net(device, variant, static_shapes=False)
        return [model.forward(z, pos, batch) for pos in trajectory]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, serve, eager)
