"""make_graphed_callables restores the FP8 scaling state of TE modules after warmup, but not of te.ops operations.

Upstream: https://github.com/NVIDIA/TransformerEngine/pull/1117 ("[PyTorch] Debug CUDA graph support with
operation-based API").
Symptom: a model built from the operation-based API (``te.ops.Sequential`` of ``BasicLinear`` ...), graphed
with ``te.make_graphed_callables(..., fp8_enabled=True)`` (delayed scaling), gives different outputs from the
same model run eagerly for the first steps after capture: its FP8 scales start from amaxes of the warmup
passes on the sample arguments (TE 1.11/1.12, autumn 2024; the PR also adds ops models to the CUDA graph tests).
Mechanism: ``make_graphed_callables`` runs ``num_warmup_iters`` eager warmup passes and the capture on the
sample args. Those passes record amaxes into each FP8 meta's ``amax_history`` and recompute its ``scale``,
state that lives across steps. ``save_fp8_tensors`` copies that state before the warmup and
``restore_fp8_tensors`` loads it back after the capture, but both walk only ``TransformerEngineBaseModule``
instances: a ``BasicOperation`` keeps the history the warmup wrote. The graph, replaying the in-graph
amax/scale update on those same tensors, then quantizes the first real inputs with scales derived from the
sample data, which eager never saw.
Doctor: warmup-divergence, at ``save_fp8_tensors`` (the warmup's writes to the ops' FP8 state are never undone).
Fix (upstream): ``save_fp8_tensors`` / ``restore_fp8_tensors`` also handle ``BasicOperation``
(``pre_forward`` to create the metas, ``_save_fp8_metas`` / ``_load_fp8_metas``), so every FP8 meta is back to
its pre-warmup value when replays start.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TransformerEngine/pull/1117"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "save_fp8_tensors"
SYMPTOM = "after capture the ops' FP8 scales come from the warmup's sample data, so outputs differ from eager"
DIM, BATCH, STEPS, AMAX_HISTORY_LEN, NUM_WARMUP_ITERS = 4, 3, 3, 4, 3
FP8_MAX = 8.0                        # a coarse "FP8" grid, so that a different scale changes the values


class TransformerEngineBaseModule(torch.nn.Module):
    """The module API (te.Linear, ...): its FP8 metas are saved/restored by make_graphed_callables."""


class BasicOperation(torch.nn.Module):
    """A te.ops operation with delayed-scaling FP8 metadata for its input."""

    def __init__(self):
        super().__init__()
        self._fp8_metas = None

    def pre_forward(self, device):
        if self._fp8_metas is None:
            self._fp8_metas = {"input": SimpleNamespace(
                scale=torch.ones((), device=device),
                amax_history=torch.zeros(AMAX_HISTORY_LEN, device=device))}

    @torch.no_grad()
    def _save_fp8_metas(self):
        return {mode: (m.scale.clone(), m.amax_history.clone()) for mode, m in self._fp8_metas.items()}

    @torch.no_grad()
    def _load_fp8_metas(self, fp8_metas):
        for mode, (scale, amax_history) in fp8_metas.items():
            self._fp8_metas[mode].scale.copy_(scale)
            self._fp8_metas[mode].amax_history.copy_(amax_history)


class BasicLinear(BasicOperation):
    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def op_forward(self, x):
        self.pre_forward(x.device)
        meta = self._fp8_metas["input"]
        x_fp8 = torch.round(x * meta.scale).clamp(-FP8_MAX, FP8_MAX) / meta.scale    # cast with the current scale
        y = x_fp8 @ self.weight
        # delayed scaling, in-graph: record this amax, then update the scale from the history and roll it
        meta.amax_history[0].copy_(x.abs().amax())
        meta.scale.copy_(FP8_MAX / meta.amax_history.amax().clamp(min=1e-6))
        meta.amax_history.copy_(torch.roll(meta.amax_history, -1))
        return y


class Sequential(torch.nn.Module):
    """te.ops.Sequential"""

    def __init__(self, *ops):
        super().__init__()
        self.ops = torch.nn.ModuleList(ops)

    def forward(self, x):
        for op in self.ops:
            x = op.op_forward(x)
        return x


def save_fp8_tensors(modules, variant, device):
    fp8_tensors = []
    for module in modules:
        for m in module.modules():
            module_tensors = None
            if isinstance(m, TransformerEngineBaseModule):
                module_tensors = None                        # (no module-API layer in this model)
            elif isinstance(m, BasicOperation) and variant == "fix":
                m.pre_forward(device)
                module_tensors = m._save_fp8_metas()
            fp8_tensors.append(module_tensors)
    return fp8_tensors


def restore_fp8_tensors(modules, fp8_tensors):
    for module in modules:
        for m in module.modules():
            module_tensors = fp8_tensors.pop(0)
            if isinstance(m, BasicOperation) and module_tensors is not None:
                m._load_fp8_metas(module_tensors)


def make_graphed_callables(module, sample_args, variant, device):
    saved_fp8_tensors = save_fp8_tensors((module,), variant, device)
    static_input = sample_args[0]
    graph, static_output = capture(lambda: module(static_input), device=device, warmups=NUM_WARMUP_ITERS,
                                   static={"input": static_input}, owner="te.make_graphed_callables",
                                   name="te.ops.Sequential fwd")
    restore_fp8_tensors((module,), saved_fp8_tensors)

    def graphed(x):
        static_input.copy_(x)
        return replay(graph, static_output)

    return graphed


def run(variant: str, device: str = "cpu"):
    gen = generator(1117)
    weight = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
    sample = randn(BATCH, DIM, gen=gen, device=device, scale=6.0)     # the sample args given for capture
    xs = [randn(BATCH, DIM, gen=gen, device=device) for _ in range(STEPS)]

    def served():
        model = Sequential(BasicLinear(weight))
        graphed = make_graphed_callables(model, (sample.clone(),), variant, device)
        return [graphed(x).clone() for x in xs]

    def eager():
        model = Sequential(BasicLinear(weight))
        return [model(x) for x in xs]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
