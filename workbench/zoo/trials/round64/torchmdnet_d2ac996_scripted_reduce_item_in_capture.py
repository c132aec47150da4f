"""A TorchScripted TorchMD-Net model reads ``batch.max().item()`` inside the CUDA-graph capture: capture fails.

Upstream: https://github.com/torchmd/torchmd-net/commit/d2ac996cc4009d774c34a5f42a7fc813733c9bdf ("fix cuda
graphing of torchscripted models. update tests", Dec 2025), with its follow-up 1dd9fd1 ("get rid of
setup_for_compile_cudagraphs", which turns the same guard into the ``static_shapes`` flag).
Symptom: a TorchMD-Net model saved as TorchScript (as OpenMM-Torch loads it, ``TorchForce`` with
``useCUDAGraphs``) cannot be captured into a CUDA graph: the capture of the forward pass fails with a host
synchronisation inside stream capture ("operation not permitted when stream is capturing"), although
``setup_for_compile_cudagraphs(batch)`` was called before scripting, as the new test
``test_torchscript_cuda_graph_compatible`` does.
Mechanism: ``OutputModel.reduce(x, batch)`` scatters per-atom energies into per-molecule sums with
``scatter(x, batch, dim=0, dim_size=self.dim_size, reduce=self.reduce_op)``; ``dim_size`` (the molecule count)
must be a host int. Eager Python refreshes it with ``int(batch.max().item() + 1)`` only when
``setup_for_compile`` is off and the stream is not capturing, so a capture reuses the value fixed before it.
TorchScript cannot call ``torch.cuda.is_current_stream_capturing()``, so the ``torch.jit.is_scripting()``
branch recomputed ``self.dim_size = int(batch.max().item() + 1)`` on every call, with no guard at all and
ignoring ``setup_for_compile``. Warmup calls are eager and pass; the call made between ``capture_begin`` and
``capture_end`` runs the same ``.item()``: a device-to-host copy and a wait, which a capturing stream refuses,
so no graph is ever recorded.
Doctor: sync-in-capture, at ``reduce`` (the scripted branch's ``batch.max().item()`` runs inside the capture).
Fix (upstream): the scripted branch recomputes only when the model was not prepared for graphs:
``if not self.setup_for_compile: self.dim_size = int(batch.max().item() + 1)``; with
``setup_for_compile_cudagraphs(batch)`` called beforehand, ``dim_size`` is fixed outside the capture and
the captured forward contains no host read.
(Read: ``git show d2ac996`` and the pre-fix ``torchmdnet/models/output_modules.py`` and ``models/utils.py``
``scatter`` in the torchmd-net mirror. The representation model is a one-layer stand-in for TensorNet;
``scripting`` stands for ``torch.jit.is_scripting()`` being true, i.e. the module as OpenMM-Torch runs it;
the runner is OpenMM-Torch's ``CudaCalcTorchForceKernel::execute``: copy positions into ``posTensor``,
warm up, capture once, replay every later step.)
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/torchmd/torchmd-net/commit/d2ac996cc4009d774c34a5f42a7fc813733c9bdf"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "reduce"
SYMPTOM = "capturing the TorchScripted model fails: OutputModel.reduce calls batch.max().item() inside the capture"
HIDDEN, MAX_Z, STEPS, WARMUP_STEPS = 8, 10, 4, 10
ATOMS_PER_MOLECULE = (3, 4, 2)          # create_example_batch: several molecules in one batch


def scatter(src, index, dim: int = 0, dim_size: int | None = None, reduce: str = "sum"):
    """``torchmdnet.models.utils.scatter``: torch_scatter's signature over ``scatter_reduce``."""
    if dim_size is None:
        dim_size = int(index.max().item()) + 1
    index = index.view(-1, *([1] * (src.dim() - 1))).expand_as(src)
    size = list(src.size())
    size[dim] = dim_size
    out = torch.zeros(size, dtype=src.dtype, device=src.device)
    return out.scatter_reduce(dim, index, src, {"sum": "sum", "add": "sum", "mean": "mean"}[reduce])


class OutputModel:
    def __init__(self, reduce_op: str, variant: str, scripting: bool):
        self.reduce_op = reduce_op
        self.dim_size = 0
        self.setup_for_compile = False
        self.variant, self.scripting = variant, scripting

    def setup_for_compile_cudagraphs(self, batch):
        self.dim_size = int(batch.max().item() + 1)
        self.setup_for_compile = True

    def reduce(self, x, batch):
        if self.scripting:                                     # torch.jit.is_scripting()
            # TorchScript doesn't support torch.cuda.is_current_stream_capturing()
            if self.variant == "bug" or not self.setup_for_compile:
                self.dim_size = int(batch.max().item() + 1)    # bug: a host read, also inside the capture
        elif not self.setup_for_compile:
            self.dim_size = int(batch.max().item() + 1)        # (eager Python: skipped while capturing)
        return scatter(x, batch, dim=0, dim_size=self.dim_size, reduce=self.reduce_op)


class Scalar(OutputModel):
    def __init__(self, gen, device, reduce_op: str = "sum", variant: str = "fix", scripting: bool = True):
        super().__init__(reduce_op, variant, scripting)
        self.w1 = randn(HIDDEN, HIDDEN // 2, gen=gen, device=device, scale=0.5)
        self.w2 = randn(HIDDEN // 2, 1, gen=gen, device=device, scale=0.5)

    def pre_reduce(self, x):
        return torch.nn.functional.silu(x @ self.w1) @ self.w2      # output_network (MLP)


class TorchMD_Net:
    """``create_model(...)``: a representation model, then the output model's pre_reduce/reduce."""

    def __init__(self, gen, device, variant: str, scripting: bool = True):
        self.embedding = randn(MAX_Z, HIDDEN, gen=gen, device=device)
        self.radial = randn(1, HIDDEN, gen=gen, device=device)
        self.output_model = Scalar(gen, device, variant=variant, scripting=scripting)
        self.std = 1.5

    def representation_model(self, z, pos, batch):
        n_mol = len(ATOMS_PER_MOLECULE)
        zeros = torch.zeros(n_mol, 3, dtype=pos.dtype, device=pos.device)
        centre = zeros.index_add(0, batch, pos) / zeros.index_add(0, batch, torch.ones_like(pos))
        r = (pos - centre[batch]).norm(dim=1, keepdim=True)
        return self.embedding[z] * torch.exp(-r * self.radial)

    def forward(self, z, pos, batch):
        x = self.representation_model(z, pos, batch)
        x = self.output_model.pre_reduce(x)
        x = x * self.std                                        # scale by data standard deviation
        return self.output_model.reduce(x, batch)               # y: one energy per molecule


class CudaCalcTorchForceKernel:
    """OpenMM-Torch's runner: positions copied into the persistent ``posTensor`` before each evaluation;
    the first evaluation warms up ``CUDAGraphWarmupSteps`` times and captures, later ones replay."""

    def __init__(self, module, z, batch, device):
        self.module, self.z, self.batch = module, z, batch
        self.posTensor = torch.zeros(len(z), 3, device=device)
        self.device, self.warmupSteps, self.graph = device, WARMUP_STEPS, None

    def executeGraph(self):
        return self.module.forward(self.z, self.posTensor, self.batch)

    def execute(self, positions):
        self.posTensor.copy_(positions)                          # prepareTorchInputs: copyInputsKernel
        if self.graph is None:
            self.graph = capture(self.executeGraph, device=self.device, warmups=self.warmupSteps,
                                 name="TorchForce", owner="CudaCalcTorchForceKernel (useCUDAGraphs)",
                                 static={"posTensor": self.posTensor})
        g, energy = self.graph
        return replay(g, energy).clone()


def run(variant: str, device: str = "cpu"):
    gen = generator(996)
    n_atoms = sum(ATOMS_PER_MOLECULE)
    z = torch.randint(1, MAX_Z, (n_atoms,), generator=gen).to(device)
    batch = torch.repeat_interleave(torch.arange(len(ATOMS_PER_MOLECULE)),
                                    torch.tensor(ATOMS_PER_MOLECULE)).to(device)
    trajectory = [randn(n_atoms, 3, gen=gen, device=device) for _ in range(STEPS)]
    model = TorchMD_Net(gen, device, variant)
    # as test_torchscript_cuda_graph_compatible: prepare for CUDA graphs, then script (here: scripting=True)
    model.output_model.setup_for_compile_cudagraphs(batch)

    def eager():
        return [model.forward(z, pos, batch) for pos in trajectory]

    def served():
        kernel = CudaCalcTorchForceKernel(model, z, batch, device)
        return [kernel.execute(pos) for pos in trajectory]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
