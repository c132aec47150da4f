"""DeePMD-kit DPA-2 under a CUDA graph: the scripted repformer block resets padded neighbour indices with ``index_put_`` whose value is ``torch.tensor(0, device=...)``, a Python number uploaded to the device inside the capture.

Upstream: https://github.com/deepmodeling/deepmd-kit/pull/5433 ("fix(pt): replace in-place nlist masking to enable CUDA
graph capture", deepmodeling/deepmd-kit, merged 2026-05-07 as commit 5bd0889ac; closes issue #5432 "`torch.tensor()`
inside `repformers.forward()` prevents CUDA graph capture for DPA-2 models"). Read: the PR description and its diff
(``deepmd/pt/model/descriptor/repformers.py``: ``nlist[nlist == -1] = 0`` -> ``nlist = torch.where(nlist == -1, 0,
nlist)`` in ``DescrptBlockRepformers.forward``; the same in ``DescrptBlockRepflows.forward`` for ``nlist`` and
``a_nlist``), the issue's description (error and TorchScript traceback: ``_13 = torch.tensor(0, dtype=ops.prim.dtype(nlist0),
device=ops.prim.device(nlist0))`` then ``torch.index_put_(nlist0, [_12], _13)``, raised while capturing ``forward_lower``
on a non-default stream from ``DeepPotPT.cc``), and the post-fix files ``repformers.py`` (``forward``),
``env_mat.py`` (``_make_env_mat``, ``prod_env_mat``), ``repformer_layer.py`` (``_update_g1_conv``, ``_cal_hg``) and
``deepmd/pt/utils/preprocess.py`` (``compute_smooth_weight``). Reconstructed: the capture harness in the LAMMPS plugin
(the issue reporter's patch, not in the repository) is a stand-in built from the issue's description (static input
buffers, warm-up, capture of ``forward_lower``, copy-in and replay per MD step).
Symptom: capturing ``forward_lower`` of a DPA-2 (or DPA-3) model loaded from its TorchScript ``.pth`` by the LAMMPS C++
plugin fails with "CUDA error: operation not permitted when stream is capturing" (cudaErrorStreamCaptureUnsupported),
so the ~8-12x CUDA-graph speed-up of the inference is out of reach; eager inference is fine.
Mechanism: TorchScript lowers ``nlist[nlist == -1] = 0`` to ``aten::index_put_`` whose value is a tensor built from the
Python literal on ``nlist``'s device, at every call: ``torch.tensor(0, device=cuda)`` copies the number from pageable host
memory to the device. Eagerly that is a small synchronous upload; inside a stream capture CUDA refuses it. ``torch.where``
with a Python scalar passes the literal to the kernel by value and allocates nothing.
Doctor: sync-in-capture, at forward (``DescrptBlockRepformers.forward``). A host-to-device upload of Python data (a
synchronising copy from pageable memory) is attempted while the graph is being captured.
Fix (upstream): ``nlist = torch.where(nlist == -1, 0, nlist)`` (``nlist`` was already a local copy, rebound by the
exclusion-mask ``torch.where`` above, so dropping the in-place write changes nothing for callers).
Modelled: ``DescrptBlockRepformers.forward`` as upstream writes it (exclusion mask, ``prod_env_mat`` with
``_make_env_mat`` and ``compute_smooth_weight``, ``g1 = act(atype_embd)``, ``g2 = act(g2_embd(s(r)))``, the padding reset
of ``nlist``, ``g1_ext`` gathered through ``mapping``, the layers, ``_cal_hg`` and the rotation matrix); the bug variant
runs the statement as the scripted module does (the ``torch.tensor`` value and ``torch.index_put_`` of the traceback).
``RepformerLayer`` keeps ``_update_g1_conv`` (smooth path) and ``_cal_hg``, with a residual g1/g2 update as a stand-in for
the other update channels; ``PairExcludeMask`` excludes no types; the type embedding and the fitting net (per-atom energy
from g1 and the rotation-invariant ``rot_mat^T rot_mat``) are stand-ins; forces (autograd) are left out. Sizes: 2 types,
6 local atoms plus 3 periodic images along x (nall 9), nnei 6, g1 8, g2 4, 2 layers, rcut 3.0, rcut_smth 0.5, float64.
``DeepPotGraphRunner`` stands in for the plugin's graph path: static ``extended_coord``/``extended_atype``/``nlist``/
``mapping`` buffers, one warm-up, capture of ``forward_lower``, then copy-in and replay.
Workload: 4 MD steps (atoms drift by a fixed displacement per step; the neighbour list, padded with -1 to nnei, is rebuilt
on the host each step). Eager inference gives the energies; the bug's capture raises the engine's CaptureError
(``torch.tensor(..., device=...)`` inside graph capture), as CUDA does; the fix captures and its 4 energies equal eager.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/deepmodeling/deepmd-kit/pull/5433"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "forward"
SYMPTOM = ("Capturing forward_lower of a scripted DPA-2 model into a CUDA graph fails: the repformer block's "
           "nlist[nlist == -1] = 0 lowers to index_put_ with torch.tensor(0, device=...), an upload of a Python number "
           "that a capturing stream refuses (cudaErrorStreamCaptureUnsupported)")

NTYPES = 2
NLOC, NGHOST = 6, 3
NALL = NLOC + NGHOST
NNEI = 6
G1_DIM, G2_DIM = 8, 4
NLAYERS = 2
RCUT, RCUT_SMTH = 3.0, 0.5
BOX_X = 4.0

_variant = "bug"


# --- deepmd/pt/utils/preprocess.py, deepmd/pt/model/descriptor/env_mat.py --------------------------------------------

def compute_smooth_weight(distance, rmin: float, rmax: float):
    distance = torch.clamp(distance, min=rmin, max=rmax)
    uu = (distance - rmin) / (rmax - rmin)
    uu2 = uu * uu
    return uu2 * uu * (-6 * uu2 + 15 * uu - 10) + 1


def _make_env_mat(nlist, coord, rcut: float, ruct_smth: float, protection: float = 0.0):
    bsz, natoms, nnei = nlist.shape
    coord = coord.view(bsz, -1, 3)
    nall = coord.shape[1]
    mask = nlist >= 0
    nlist = torch.where(mask, nlist, nall)
    coord_l = coord[:, :natoms].view(bsz, -1, 1, 3)
    index = nlist.view(bsz, -1).unsqueeze(-1).expand(-1, -1, 3)
    coord_pad = torch.concat([coord, coord[:, -1:, :] + rcut], dim=1)
    coord_r = torch.gather(coord_pad, 1, index).view(bsz, natoms, nnei, 3)
    diff = coord_r - coord_l
    length = torch.linalg.norm(diff, dim=-1, keepdim=True)
    length = length + ~mask.unsqueeze(-1)
    t0 = 1 / (length + protection)
    t1 = diff / (length + protection) ** 2
    weight = compute_smooth_weight(length, ruct_smth, rcut) * mask.unsqueeze(-1)
    env_mat = torch.cat([t0, t1], dim=-1) * weight
    return env_mat, diff * mask.unsqueeze(-1), weight


def prod_env_mat(extended_coord, nlist, atype, mean, stddev, rcut: float, rcut_smth: float, protection: float = 0.0):
    _env_mat_se_a, diff, switch = _make_env_mat(nlist, extended_coord, rcut, rcut_smth, protection=protection)
    t_avg = mean[atype]
    t_std = stddev[atype]
    return (_env_mat_se_a - t_avg) / t_std, diff, switch


# --- deepmd/pt/model/descriptor/repformer_layer.py ---------------------------------------------------------------------

def _apply_nlist_mask(gg, nlist_mask):
    return gg.masked_fill(~nlist_mask.unsqueeze(-1), 0.0)


def _apply_switch(gg, sw):
    return gg * sw.unsqueeze(-1)


class RepformerLayer:
    def __init__(self, gen, device):
        r = lambda *s, scale=0.4: randn(*s, gen=gen, device=device, scale=scale).double()  # noqa: E731
        self.proj_g1g2 = r(G1_DIM, G2_DIM)
        self.w_g1 = r(G1_DIM + G2_DIM, G1_DIM)
        self.w_g2 = r(G2_DIM, G2_DIM)

    def _update_g1_conv(self, gg1, g2, nlist_mask, sw):
        nb, nloc, nnei, _ = g2.shape
        gg1 = (gg1 @ self.proj_g1g2).view(nb, nloc, nnei, G2_DIM)
        gg1 = _apply_nlist_mask(gg1, nlist_mask)
        gg1 = _apply_switch(gg1, sw)                                   # smooth path
        invnnei = (1.0 / float(nnei)) * torch.ones((nb, nloc, 1), dtype=gg1.dtype, device=gg1.device)
        return torch.sum(g2 * gg1, dim=2) * invnnei                   # nb x nloc x ng2

    @staticmethod
    def _cal_hg(g2, h2, nlist_mask, sw, smooth: bool = True, epsilon: float = 1e-4, use_sqrt_nnei: bool = True):
        nb, nloc, nnei, _ = g2.shape
        g2 = _apply_nlist_mask(g2, nlist_mask)
        g2 = _apply_switch(g2, sw)                                     # smooth path
        invnnei = (1.0 / (nnei ** 0.5 if use_sqrt_nnei else float(nnei))) * torch.ones(
            (nb, nloc, 1, 1), dtype=g2.dtype, device=g2.device)
        h2g2 = torch.matmul(torch.transpose(h2, -1, -2), g2) * invnnei  # nb x nloc x 3 x ng2
        return h2g2

    def forward(self, g1_ext, g2, h2, nlist, nlist_mask, sw):
        nb, nloc, nnei = nlist.shape
        g1 = g1_ext[:, :nloc]
        index = nlist.reshape(nb, nloc * nnei).unsqueeze(-1).expand(-1, -1, G1_DIM)
        gg1 = torch.gather(g1_ext, 1, index).view(nb, nloc, nnei, G1_DIM)   # neighbours' g1 (padding: atom 0)
        conv = self._update_g1_conv(gg1, g2, nlist_mask, sw)
        g1 = g1 + torch.tanh(torch.cat([g1, conv], dim=-1) @ self.w_g1)
        g2 = g2 + torch.tanh(g2 @ self.w_g2)
        return g1, g2, h2


# --- deepmd/pt/model/descriptor/repformers.py --------------------------------------------------------------------------

class PairExcludeMask:
    def __init__(self, ntypes, exclude_types=()):
        self.ntypes, self.exclude_types = ntypes, set(exclude_types)

    def __call__(self, nlist, atype_ext):
        return torch.ones_like(nlist, dtype=torch.int32)            # no excluded type pairs


class DescrptBlockRepformers:
    def __init__(self, gen, device):
        self.rcut, self.rcut_smth = RCUT, RCUT_SMTH
        self.g1_dim = G1_DIM
        self.env_protection = 0.0
        self.emask = PairExcludeMask(NTYPES)
        self.mean = torch.zeros(NTYPES, NNEI, 4, dtype=torch.float64, device=device)
        self.stddev = torch.ones(NTYPES, NNEI, 4, dtype=torch.float64, device=device)
        self.g2_embd = randn(1, G2_DIM, gen=gen, device=device, scale=0.8).double()
        self.layers = [RepformerLayer(gen, device) for _ in range(NLAYERS)]
        self.act = torch.tanh
        self.dim_emb = G2_DIM

    def forward(self, nlist, extended_coord, extended_atype, extended_atype_embd, mapping):
        nframes, nloc, nnei = nlist.shape
        nall = extended_coord.view(nframes, -1).shape[1] // 3
        atype = extended_atype[:, :nloc]
        exclude_mask = self.emask(nlist, extended_atype)
        nlist = torch.where(exclude_mask != 0, nlist, -1)
        dmatrix, diff, sw = prod_env_mat(extended_coord, nlist, atype, self.mean, self.stddev, self.rcut,
                                         self.rcut_smth, protection=self.env_protection)
        nlist_mask = nlist != -1
        sw = torch.squeeze(sw, -1)
        sw = sw.masked_fill(~nlist_mask, 0.0)
        atype_embd = extended_atype_embd[:, :nloc, :]
        g1 = self.act(atype_embd)
        g2, h2 = torch.split(dmatrix, [1, 3], dim=-1)
        g2 = self.act(g2 @ self.g2_embd)

        # set all padding positions to index of 0
        # if the a neighbor is real or not is indicated by nlist_mask
        if _variant == "bug":
            # ``nlist[nlist == -1] = 0`` as the scripted module (the .pth the plugin loads) runs it
            _12 = nlist == -1
            _13 = torch.tensor(0, dtype=nlist.dtype, device=nlist.device)
            nlist = torch.index_put_(nlist, [_12], _13)
        else:
            nlist = torch.where(nlist == -1, 0, nlist)
        mapping = mapping.view(nframes, nall).unsqueeze(-1).expand(-1, -1, self.g1_dim)
        for ll in self.layers:
            g1_ext = torch.gather(g1, 1, mapping)
            g1, g2, h2 = ll.forward(g1_ext, g2, h2, nlist, nlist_mask, sw)
        h2g2 = RepformerLayer._cal_hg(g2, h2, nlist_mask, sw)
        rot_mat = torch.permute(h2g2, (0, 1, 3, 2))
        return g1, g2, h2, rot_mat.view(nframes, nloc, self.dim_emb, 3), sw


class DPA2EnergyModel:
    """Type embedding + repformer block + fitting net (stand-ins around the block)."""

    def __init__(self, device):
        gen = generator(5433)
        self.type_embedding = randn(NTYPES, G1_DIM, gen=gen, device=device).double()
        self.repformers = DescrptBlockRepformers(gen, device)
        self.w_fit = randn(G1_DIM + G2_DIM * G2_DIM, 8, gen=gen, device=device, scale=0.3).double()
        self.w_out = randn(8, 1, gen=gen, device=device, scale=0.5).double()
        self.bias_atom_e = randn(NTYPES, gen=gen, device=device).double()

    def forward_lower(self, extended_coord, extended_atype, nlist, mapping):
        nframes, nloc, _ = nlist.shape
        extended_atype_embd = self.type_embedding[extended_atype]
        g1, g2, h2, rot_mat, sw = self.repformers.forward(nlist, extended_coord, extended_atype,
                                                          extended_atype_embd, mapping)
        grrg = torch.matmul(rot_mat, rot_mat.transpose(-1, -2)).reshape(nframes, nloc, G2_DIM * G2_DIM)
        descriptor = torch.cat([g1, grrg], dim=-1)
        atom_energy = torch.tanh(descriptor @ self.w_fit) @ self.w_out + self.bias_atom_e[extended_atype[:, :nloc]][..., None]
        return atom_energy.sum(dim=1), atom_energy


# --- the plugin's graph path (stand-in) ---------------------------------------------------------------------------------

class DeepPotGraphRunner:
    """Static input buffers, warm-up, capture of ``forward_lower``; then copy-in and replay per call."""

    def __init__(self, model, device):
        self.model = model
        self.extended_coord = torch.zeros(1, NALL * 3, dtype=torch.float64, device=device)
        self.extended_atype = torch.zeros(1, NALL, dtype=torch.int64, device=device)
        self.nlist = torch.full((1, NLOC, NNEI), -1, dtype=torch.int64, device=device)
        self.mapping = torch.zeros(1, NALL, dtype=torch.int64, device=device)
        self.device, self.graph, self.out = device, None, None

    def _copy_in(self, extended_coord, extended_atype, nlist, mapping):
        self.extended_coord.copy_(extended_coord)
        self.extended_atype.copy_(extended_atype)
        self.nlist.copy_(nlist)
        self.mapping.copy_(mapping)

    def compute(self, extended_coord, extended_atype, nlist, mapping):
        self._copy_in(extended_coord, extended_atype, nlist, mapping)
        if self.graph is None:
            self.graph, self.out = capture(
                lambda: self.model.forward_lower(self.extended_coord, self.extended_atype, self.nlist, self.mapping),
                device=self.device, warmups=1, name="forward_lower", owner="DeepPotGraphRunner",
                static={"extended_coord": self.extended_coord, "extended_atype": self.extended_atype,
                        "nlist": self.nlist, "mapping": self.mapping})
        energy, atom_energy = replay(self.graph, self.out)
        return energy


# --- the MD driver (stand-in): extended system and neighbour list built on the host -------------------------------------

def build_inputs(coord, atype, device):
    """Local atoms plus periodic images of the first NGHOST atoms along x; neighbour list padded with -1."""
    ghosts = coord[:NGHOST] + torch.tensor([BOX_X, 0.0, 0.0], dtype=torch.float64)
    ext = torch.cat([coord, ghosts], dim=0)                                   # [nall, 3]
    mapping = torch.cat([torch.arange(NLOC), torch.arange(NGHOST)])
    ext_atype = atype[mapping]
    nlist = torch.full((NLOC, NNEI), -1, dtype=torch.int64)
    for i in range(NLOC):
        d = (ext - ext[i]).norm(dim=-1)
        d[i] = float("inf")
        order = [int(j) for j in torch.argsort(d) if d[j] < RCUT][:NNEI]
        nlist[i, :len(order)] = torch.tensor(order, dtype=torch.int64)
    return (ext.reshape(1, NALL * 3).to(device), ext_atype.view(1, NALL).to(device), nlist.view(1, NLOC, NNEI).to(device),
            mapping.view(1, NALL).to(device))


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    num_steps = 4

    def serve(use_cuda_graph):
        model = DPA2EnergyModel(device)
        runner = DeepPotGraphRunner(model, device) if use_cuda_graph else None
        gen = generator(54330)
        coord = torch.rand(NLOC, 3, generator=gen, dtype=torch.float64) * torch.tensor([BOX_X, 2.0, 2.0],
                                                                                     dtype=torch.float64)
        velocity = (torch.rand(NLOC, 3, generator=gen, dtype=torch.float64) - 0.5) * 0.2
        atype = torch.tensor([0, 1, 0, 1, 1, 0])
        energies = []
        for _ in range(num_steps):
            inputs = build_inputs(coord, atype, device)
            if runner is not None:
                energy = runner.compute(*inputs)
            else:
                energy, _ = model.forward_lower(*inputs)
            energies.append(energy.clone())
            coord = coord + velocity
        return energies

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
