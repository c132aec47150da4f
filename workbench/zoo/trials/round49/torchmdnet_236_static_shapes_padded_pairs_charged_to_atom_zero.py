"""TensorNet with static shapes (CUDA graphs) turns every padded (-1, -1) neighbour pair into a self-edge of atom 0.

Upstream: https://github.com/torchmd/torchmd-net/pull/236 ("Fix Tensornet accuracy bug"; commit 1485dde "Blame
extra neighbor pairs on a ghost atom", October 2023).
Symptom: with ``static_shapes=True`` (what CUDA-graph capture of TensorNet needs) energies/features differ from the
dynamic-shape model; the PR: "By blaming all extra neighbor pairs to the first particle the overall accuracy could
be slightly affected". The error on atom 0 grows with ``max_num_pairs - actual_num_pairs``.
Mechanism: ``TensorNet.forward`` calls ``OptimizedDistance`` with ``resize_to_fit=not static_shapes``: under static
shapes ``get_neighbor_pairs_kernel`` returns ``max_num_pairs = max_num_neighbors * n_atoms`` slots, the found pairs
first and ``(-1, -1)`` pairs at the end, so the captured graph has fixed shapes while the number of real pairs
changes every MD step. To keep the shapes, ``forward`` did ``mask = (edge_index[0] >= 0)...; edge_index =
edge_index * mask; edge_weight = edge_weight * mask[0]; edge_vec = edge_vec * mask[0]...``: each padded slot became
the pair (0, 0) at distance 0. ``distance_expansion(0)`` is not zero and ``CosineCutoff(0) == 1``, so in
``TensorEmbedding`` and every ``Interaction`` each padded slot adds a full-weight self message to atom 0's I/A/S
tensors (``scatter`` over ``edge_index[0]``). Real atom 0's features depend on how many padded rows the step has;
the count changes with the geometry from replay to replay, and atom 0's neighbours inherit part of the error.
Doctor: stale-padding, at ``forward`` (TensorNet's static-shape masking points the padded pair rows at real atom 0,
so a real row's result depends on the padded rows).
Fix (upstream): a ghost atom is appended, ``z = torch.cat((z, torch.zeros(1, ...)))``; padded pairs become
ghost->ghost with ``edge_index.masked_fill(mask, z.shape[0] - 1)`` and zeroed ``edge_weight``/``edge_vec``; the
ghost row is dropped at the end (``x = x[:-1]; z = z[:-1]``).
Model: one small molecule, several MD steps served by one captured ``TensorNet.forward`` (static ``pos`` buffer);
the reference is the eager dynamic-shape model (``static_shapes=False``), as TorchMD-Net runs without graphs.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/torchmd/torchmd-net/pull/236"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "forward"
SYMPTOM = "static-shape (CUDA-graph) TensorNet charges every padded neighbour pair to atom 0: its features drift"

N_ATOMS, HIDDEN, NUM_RBF, NUM_LAYERS, MAX_Z = 6, 4, 4, 2, 10
CUTOFF_LOWER, CUTOFF_UPPER, MAX_NUM_NEIGHBORS, STEPS = 0.0, 2.0, 5, 4


def cosine_cutoff(distances):
    """``CosineCutoff(0, cutoff_upper)``: 1 at r = 0, 0 past the cutoff."""
    return 0.5 * (torch.cos(distances * math.pi / CUTOFF_UPPER) + 1.0) * (distances < CUTOFF_UPPER).to(distances.dtype)


def get_neighbor_pairs_kernel(positions, batch, rows, cols, max_num_pairs, loop=True):
    """Brute-force pairs with ``include_transpose``: the found pairs first, ``(-1, -1)`` in the remaining slots."""
    vec = positions[rows] - positions[cols]
    dist = vec.norm(dim=-1)
    found = (batch[rows] == batch[cols]) & (rows != cols) & (dist >= CUTOFF_LOWER) & (dist < CUTOFF_UPPER)
    if loop:
        found = found | (rows == cols)
    order = torch.sort((~found).to(torch.int32), stable=True).indices[:max_num_pairs]
    keep = found[order]
    edge_index = torch.stack((rows[order], cols[order])).masked_fill(~keep, -1)
    return edge_index, vec[order].masked_fill(~keep[:, None], 0.0), dist[order].masked_fill(~keep, 0.0)


def scatter(src, index, dim_size):
    return torch.zeros(dim_size, *src.shape[1:], device=src.device, dtype=src.dtype).index_add_(0, index, src)


def vector_to_skewtensor(v):
    zero = torch.zeros_like(v[:, 0])
    return torch.stack((zero, -v[:, 2], v[:, 1], v[:, 2], zero, -v[:, 0], -v[:, 1], v[:, 0], zero), -1).view(-1, 3, 3)


def vector_to_symtensor(v):
    t = v[:, :, None] * v[:, None, :]
    return 0.5 * (t + t.transpose(-2, -1)) - (t.diagonal(0, -2, -1).sum(-1) / 3)[:, None, None] * torch.eye(
        3, device=v.device, dtype=v.dtype)


def decompose_tensor(X):
    eye = torch.eye(3, device=X.device, dtype=X.dtype)
    I = (X.diagonal(0, -2, -1).mean(-1))[..., None, None] * eye
    A = 0.5 * (X - X.transpose(-2, -1))
    return I, A, 0.5 * (X + X.transpose(-2, -1)) - I


def tensor_norm(X):
    return (X ** 2).sum((-2, -1))


def channel_linear(w, T):
    return torch.einsum("nhij,hk->nkij", T, w)


def tensor_message_passing(edge_index, factor, tensor, natoms):
    msg = factor * tensor.index_select(0, edge_index[1])
    return scatter(msg, edge_index[0], natoms)


class TensorNet:
    def __init__(self, device, variant, static_shapes):
        gen = generator(236)
        self.variant, self.static_shapes = variant, static_shapes
        w = lambda *s: randn(*s, gen=gen, device=device, scale=1.0 / math.sqrt(s[0]))  # noqa: E731
        self.rbf_means = torch.linspace(math.exp(-CUTOFF_UPPER), 1.0, NUM_RBF, device=device)
        self.rbf_betas = torch.full((NUM_RBF,), (2.0 / NUM_RBF * (1 - math.exp(-CUTOFF_UPPER))) ** -2, device=device)
        self.emb, self.emb2 = w(MAX_Z, HIDDEN), w(2 * HIDDEN, HIDDEN)
        self.distance_proj = [w(NUM_RBF, HIDDEN) for _ in range(3)]
        self.emb_linears_tensor = [w(HIDDEN, HIDDEN) for _ in range(3)]
        self.emb_linears_scalar = [w(HIDDEN, 2 * HIDDEN), w(2 * HIDDEN, 3 * HIDDEN)]
        self.layers = [dict(scalar=[w(NUM_RBF, HIDDEN), w(HIDDEN, 2 * HIDDEN), w(2 * HIDDEN, 3 * HIDDEN)],
                            tensor=[w(HIDDEN, HIDDEN) for _ in range(6)]) for _ in range(NUM_LAYERS)]
        self.linear = w(3 * HIDDEN, HIDDEN)
        self.max_num_pairs = MAX_NUM_NEIGHBORS * N_ATOMS          # OptimizedDistance(max_num_pairs=-max_num_neighbors)
        self.rows = torch.arange(N_ATOMS, device=device).repeat_interleave(N_ATOMS)
        self.cols = torch.arange(N_ATOMS, device=device).repeat(N_ATOMS)

    def distance(self, pos, batch):
        """``OptimizedDistance(..., loop=True, resize_to_fit=not static_shapes)``."""
        edge_index, edge_vec, edge_weight = get_neighbor_pairs_kernel(pos, batch, self.rows, self.cols,
                                                                      self.max_num_pairs)
        if not self.static_shapes:          # resize_to_fit: remove (-1, -1) pairs (a host sync: eager only)
            mask = edge_index[0] != -1
            edge_index, edge_weight, edge_vec = edge_index[:, mask], edge_weight[mask], edge_vec[mask, :]
        return edge_index, edge_weight, edge_vec

    def distance_expansion(self, dist):
        """``ExpNormalSmearing``: not zero at r = 0."""
        d = dist.unsqueeze(-1)
        expd = torch.exp(-5.0 / CUTOFF_UPPER * d)
        return cosine_cutoff(d) * torch.exp(-self.rbf_betas * (expd - self.rbf_means) ** 2)

    def tensor_embedding(self, z, edge_index, edge_weight, edge_vec_norm, edge_attr):
        C = cosine_cutoff(edge_weight).view(-1, 1)
        W1, W2, W3 = (edge_attr @ p * C for p in self.distance_proj)
        eye = torch.eye(3, device=z.device, dtype=edge_attr.dtype)
        Iij = W1[..., None, None] * eye
        Aij = W2[..., None, None] * vector_to_skewtensor(edge_vec_norm)[:, None]
        Sij = W3[..., None, None] * vector_to_symtensor(edge_vec_norm)[:, None]
        Z = self.emb[z]
        Zij = (torch.cat((Z[edge_index[0]], Z[edge_index[1]]), -1) @ self.emb2)[..., None, None]
        I, A, S = (scatter(Zij * T, edge_index[0], z.shape[0]) for T in (Iij, Aij, Sij))
        norm = F.layer_norm(tensor_norm(I + A + S), (HIDDEN,))
        I, A, S = (channel_linear(lw, T) for lw, T in zip(self.emb_linears_tensor, (I, A, S)))
        for ls in self.emb_linears_scalar:
            norm = F.silu(norm @ ls)
        norm = norm.reshape(-1, HIDDEN, 3)
        return I * norm[..., 0, None, None] + A * norm[..., 1, None, None] + S * norm[..., 2, None, None]

    def interaction(self, layer, X, edge_index, edge_weight, edge_attr):
        C = cosine_cutoff(edge_weight)
        for ls in layer["scalar"]:
            edge_attr = F.silu(edge_attr @ ls)
        edge_attr = (edge_attr * C.view(-1, 1)).reshape(-1, HIDDEN, 3)
        X = X / (tensor_norm(X) + 1)[..., None, None]
        I, A, S = (channel_linear(lw, T) for lw, T in zip(layer["tensor"][:3], decompose_tensor(X)))
        Y = I + A + S
        msg = sum(tensor_message_passing(edge_index, edge_attr[..., k, None, None], T, X.shape[0])
                  for k, T in enumerate((I, A, S)))
        I, A, S = decompose_tensor(torch.matmul(msg, Y) + torch.matmul(Y, msg))     # O(3)
        normp1 = (tensor_norm(I + A + S) + 1)[..., None, None]
        I, A, S = (channel_linear(lw, T / normp1) for lw, T in zip(layer["tensor"][3:], (I, A, S)))
        dX = I + A + S
        return X + dX + torch.matrix_power(dX, 2)

    def forward(self, z, pos, batch):
        edge_index, edge_weight, edge_vec = self.distance(pos, batch)
        # Distance module returns -1 for non-existing edges; static shapes (CUDA graphs) keep them.
        if self.static_shapes and self.variant == "bug":
            # I trick the model into thinking that the masked edges pertain to the first atom
            mask = (edge_index[0] >= 0).unsqueeze(0).expand_as(edge_index)
            edge_index = edge_index * mask
            edge_weight = edge_weight * mask[0]
            edge_vec = edge_vec * mask[0].unsqueeze(-1).expand_as(edge_vec)
        elif self.static_shapes:
            # ... pertain to the extra (ghost) atom
            mask = (edge_index[0] < 0).unsqueeze(0).expand_as(edge_index)
            z = torch.cat((z, torch.zeros(1, device=z.device, dtype=z.dtype)), dim=0)
            edge_index = edge_index.masked_fill(mask, z.shape[0] - 1)
            edge_weight = edge_weight.masked_fill(mask[0], 0)
            edge_vec = edge_vec.masked_fill(mask[0].unsqueeze(-1).expand_as(edge_vec), 0)
        edge_attr = self.distance_expansion(edge_weight)
        mask = edge_index[0] == edge_index[1]
        edge_vec = edge_vec / edge_weight.masked_fill(mask, 1).unsqueeze(1)
        X = self.tensor_embedding(z, edge_index, edge_weight, edge_vec, edge_attr)
        for layer in self.layers:
            X = self.interaction(layer, X, edge_index, edge_weight, edge_attr)
        I, A, S = decompose_tensor(X)
        x = F.layer_norm(torch.cat((tensor_norm(I), tensor_norm(A), tensor_norm(S)), dim=-1), (3 * HIDDEN,))
        x = F.silu(x @ self.linear)
        if self.static_shapes and self.variant == "fix":
            x = x[:-1]                                            # remove the extra atom
        return x


def run(variant: str, device: str = "cpu"):
    gen = generator(2360)
    z = torch.randint(1, MAX_Z, (N_ATOMS,), generator=gen).to(device)
    pos0 = torch.randn(N_ATOMS, 3, generator=gen)
    trajectory = [(pos0 + torch.randn(N_ATOMS, 3, generator=gen) * 0.3).to(device) for _ in range(STEPS)]
    batch = torch.zeros(N_ATOMS, dtype=torch.long, device=device)

    def serve():
        model = TensorNet(device, variant, static_shapes=True)
        static_pos = trajectory[0].clone()
        g, out = capture(lambda: model.forward(z, static_pos, batch), device=device, name=f"{N_ATOMS} atoms",
                         owner="TorchMD_Net (static_shapes, CUDA graph)", static={"pos": static_pos})
        outs = []
        for pos in trajectory:
            static_pos.copy_(pos)
            outs.append(replay(g, out).clone())
        return outs

    def eager():
        model = TensorNet(device, variant, static_shapes=False)
        return [model.forward(z, pos, batch) for pos in trajectory]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, serve, eager)
