"""A weight reload gives the Marlin kernel a fresh workspace; the captured graph keeps the freed one.

Upstream: https://github.com/vllm-project/vllm/pull/48438 ("[Bugfix] Preserve Marlin runtime tensor
storage across weight reload"), part of RFC https://github.com/vllm-project/vllm/issues/48312 ("Weight
Reload Correctness for RL").
Symptom: RL-style ``reload_weights()`` on a GPTQ/AWQ model served by Marlin with CUDA graphs: after the
first reload the engine livelocks or faults (illegal memory access) on replay; ``enforce_eager`` is fine
(vLLM main, July 2026).
Mechanism: ``reload_weights`` does not re-capture graphs; its layerwise reload copies the processed
*registered* parameters back into their original storage, so graphs keep reading valid weights. But
``MarlinLinearKernel.process_weights_after_loading`` also makes two runtime tensors that escape that
protection: ``self.workspace = marlin_make_workspace_new(device)`` (the kernel's split-K lock counters,
stored on the kernel object, not the layer) and, for act-order checkpoints, ``g_idx_sort_indices``
(a plain attribute, not a parameter). Each reload allocates both afresh and drops the old tensors,
whose addresses the captured ``gptq_marlin_gemm`` launch still holds. Replays then read and write
memory the allocator has released (reused: non-zero locks, a livelock; unmapped: a fault), while an
eager step reads the new tensors.
Doctor: dangling-reference, at ``process_weights_after_loading`` (it replaces the workspace and sort
indices a captured graph still reads, and lets the old ones go).
Fix (upstream): the Marlin kernels route both tensors through one helper that keeps an existing
tensor's storage when shape and dtype match (copying the new contents into it), applied at the primary
site and at eight sibling Marlin sites; the graph-held addresses stay valid across reloads.
Read: the PR description (the diff itself was not available here; the helper's name is ours).
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import (capture, compare, generator, own_segment_elems, randn, release_to_driver,
                               replay)

UPSTREAM = "https://github.com/vllm-project/vllm/pull/48438"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "process_weights_after_loading"
SYMPTOM = "after an RL weight reload, Marlin graph replays use a freed workspace (livelock / IMA upstream)"

VOCAB, K, N, GROUP_SIZE = 12, 8, 4, 4
SIZE = 4                                      # the one FULL decode capture size


def marlin_make_workspace_new(device) -> torch.Tensor:
    """Lock counters for the split-K reduction: ``sms * max_blocks_per_sm`` int32 zeros."""
    return torch.zeros(own_segment_elems(device), dtype=torch.int32, device=device)


def gptq_marlin_gemm(a, b_q_weight, b_scales, g_idx, perm, workspace):
    """Act-order GPTQ GEMM: the input channels are taken in ``perm`` (sorted-group) order, the weight
    is dequantized per group, and the two K halves are reduced through the lock in ``workspace``: the
    second half is added only when the lock is free (zero); the kernel leaves it at zero."""
    a = a[:, perm]
    w = b_q_weight.to(a.dtype) * b_scales[g_idx]
    half = K // 2
    partial0 = a[:, :half] @ w[:half]
    partial1 = a[:, half:] @ w[half:]
    lock = workspace[:1]
    out = partial0 + torch.where(lock == 0, partial1, torch.zeros_like(partial1))
    workspace[:1].zero_()
    return out


class MarlinLinearLayer:
    """The layer's registered parameters (checkpoint format until processed) and its plain attributes."""

    def __init__(self):
        self.params: dict[str, torch.Tensor] = {}
        self.g_idx_sort_indices: torch.Tensor | None = None

    def load_checkpoint(self, ckpt):
        self.params = {name: t.clone() for name, t in ckpt.items()}


def _preserve_storage(existing: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """Keep a graph-visible runtime tensor's storage across reloads (the fix's helper)."""
    if existing is not None and existing.shape == new.shape and existing.dtype == new.dtype:
        existing.copy_(new)
        return existing
    return new


class MarlinLinearKernel:
    def __init__(self, variant):
        self.variant = variant
        self.workspace: torch.Tensor | None = None

    def process_weights_after_loading(self, layer: MarlinLinearLayer) -> None:
        device = layer.params["qweight"].device
        g_idx = layer.params["g_idx"]
        g_idx_sort_indices = torch.argsort(g_idx)
        # repack for Marlin: channels in sorted-group order (replace_parameter)
        layer.params["g_idx"] = g_idx[g_idx_sort_indices]
        layer.params["qweight"] = layer.params["qweight"][g_idx_sort_indices].contiguous()
        workspace = marlin_make_workspace_new(device)
        if self.variant == "fix":
            layer.g_idx_sort_indices = _preserve_storage(layer.g_idx_sort_indices, g_idx_sort_indices)
            self.workspace = _preserve_storage(self.workspace, workspace)
        else:
            layer.g_idx_sort_indices = g_idx_sort_indices
            self.workspace = workspace

    def apply_weights(self, layer: MarlinLinearLayer, x):
        p = layer.params
        return gptq_marlin_gemm(x, p["qweight"], p["scales"], p["g_idx"], layer.g_idx_sort_indices,
                                self.workspace)


def make_checkpoint(seed, device):
    gen = generator(seed)
    qweight = torch.randint(-8, 8, (K, N), generator=gen, dtype=torch.int32).to(device)
    scales = (torch.rand(K // GROUP_SIZE, N, generator=gen) * 0.2 + 0.05).to(device)
    g_idx = torch.tensor([1, 0, 1, 0, 0, 1, 1, 0], dtype=torch.long).to(device)   # act-order groups
    return {"qweight": qweight, "scales": scales, "g_idx": g_idx}


class Model:
    def __init__(self, device, variant):
        gen = generator(48438)
        self.embed_tokens = randn(VOCAB, K, gen=gen, device=device)
        self.lm_head = randn(N, VOCAB, gen=gen, device=device, scale=0.5)
        self.o_proj = MarlinLinearLayer()
        self.quant_method = MarlinLinearKernel(variant)

    def forward(self, input_ids):
        h = self.embed_tokens[input_ids]
        return torch.tanh(self.quant_method.apply_weights(self.o_proj, h)) @ self.lm_head


class GPUModelRunner:
    def __init__(self, device, variant, graphed):
        self.device, self.graphed = device, graphed
        self.model = Model(device, variant)
        self.input_ids = torch.zeros(SIZE, dtype=torch.long, device=device)

    def load_model(self, ckpt):
        self.model.o_proj.load_checkpoint(ckpt)
        self.model.quant_method.process_weights_after_loading(self.model.o_proj)

    def reload_weights(self, ckpt):
        """Layerwise reload without re-capture: process the new checkpoint, then copy the processed
        registered parameters back into their original storage (the graphs' addresses)."""
        layer = self.model.o_proj
        kept = dict(layer.params)
        layer.load_checkpoint(ckpt)
        self.model.quant_method.process_weights_after_loading(layer)
        for name, original in kept.items():
            original.copy_(layer.params[name])
            layer.params[name] = original
        release_to_driver(self.device)          # memory pressure: freed blocks go back to the driver

    def capture_model(self):
        layer, kernel = self.model.o_proj, self.model.quant_method
        self.graph, self.out = capture(
            lambda: self.model.forward(self.input_ids), device=self.device, name=f"FULL size {SIZE}",
            static={"input_ids": self.input_ids},
            state={**{f"o_proj.{k}": v for k, v in layer.params.items()},
                   "o_proj.g_idx_sort_indices": layer.g_idx_sort_indices, "marlin.workspace": kernel.workspace},
            owner="GPUModelRunner (FULL graph)")

    def execute_model(self, tokens):
        n = len(tokens)
        self.input_ids[:n].copy_(torch.tensor(tokens, dtype=torch.long).to(self.device))
        if not self.graphed:
            return self.model.forward(self.input_ids[:n]).clone()
        return replay(self.graph, self.out, real=n, size=SIZE, padded={"input_ids": self.input_ids})[:n].clone()


def run(variant: str, device: str = "cpu"):
    ckpt_v1, ckpt_v2 = make_checkpoint(1, device), make_checkpoint(2, device)

    def serve(graphed: bool):
        runner = GPUModelRunner(device, variant, graphed)
        runner.load_model(ckpt_v1)
        if graphed:
            runner.capture_model()
        outs = [runner.execute_model([3, 5, 7])]
        runner.reload_weights(ckpt_v2)            # RL: the trainer pushes updated weights
        outs.append(runner.execute_model([1, 2, 4, 6]))
        outs.append(runner.execute_model([9, 10]))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
