"""An RL weight update re-shuffles the MoE weights into fresh Parameters; the captured decode graphs keep the old ones.

Upstream: https://github.com/vllm-project/vllm/pull/40390 ("[Bugfix][Rocm]Aiter MoE re-uses existing tensor
addresses after weight update.").
Symptom: in RL rollouts (veRL + vLLM, ``enforce_eager=False``, ``VLLM_ROCM_USE_AITER_MOE=1``) every response
after the first weight sync is gibberish; eager mode is correct (vLLM 0.19/0.20, April 2026; NeMo-RL saw the
same decode-only corruption on the unquantized MoE path and pinned ``enforce_eager`` until vLLM 0.21).
Mechanism: ``UnquantizedFusedMoEMethod.process_weights_after_loading`` converts the loaded expert weights to
the kernel's runtime layout (AITER's ``shuffle_weights``) and then ``replace_parameter`` re-registers
``w13_weight`` / ``w2_weight`` as *new* Parameters. At load time that is fine. A weight update writes the new
checkpoint into the live Parameter (the one the graphs were captured against) and re-runs
``process_weights_after_loading``: the shuffle is registered as yet another Parameter and the captured one
loses its last owner. The decode graphs still hold the old address: they read a released block (on the GPU
it still holds the *unshuffled* new weights until the allocator hands it on), never the weights the eager
path now uses.
Doctor: dangling-reference, at ``_setup_kernel`` (``replace_parameter`` rebinds the weights the graphs hold,
releasing the captured storage).
Fix (upstream): ``is_weight_update = self.moe_kernel is not None``; on an update ``replace_parameter(...,
prefer_copy=True)`` copies the shuffled data into the existing storage, and the kernel is not rebuilt.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/40390"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "_setup_kernel"
SYMPTOM = "after an RL weight sync the captured decode graphs read the released, pre-update MoE weights"
E, HIDDEN, INTER, TOKENS = 2, 4, 3, 2          # experts, hidden size, intermediate size, decode batch


class rocm_aiter_ops:                          # noqa: N801 - upstream's name
    @staticmethod
    def shuffle_weights(w13: torch.Tensor, w2: torch.Tensor):
        """Reorder to the CK kernel's layout; new tensors, same shapes (as ``shuffle_weight`` does)."""
        return w13.flip(-1).contiguous(), w2.flip(-1).contiguous()   # K reversed: a stand-in layout


def replace_parameter(layer: torch.nn.Module, name: str, new_data: torch.Tensor, prefer_copy: bool = False):
    """``vllm.model_executor.utils.replace_parameter``: copy into the existing storage when asked and the
    layout matches, otherwise register a new Parameter (the old one is dropped)."""
    old = getattr(layer, name)
    if prefer_copy and old.shape == new_data.shape and old.dtype == new_data.dtype:
        old.data.copy_(new_data)
        return
    layer.register_parameter(name, torch.nn.Parameter(new_data, requires_grad=False))


class RoutedExperts(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        self.w13_weight = torch.nn.Parameter(torch.zeros(E, 2 * INTER, HIDDEN, device=device), requires_grad=False)
        self.w2_weight = torch.nn.Parameter(torch.zeros(E, HIDDEN, INTER, device=device), requires_grad=False)

    def weight_loader(self, name: str, loaded: torch.Tensor):
        getattr(self, name).data.copy_(loaded)          # the checkpoint goes into the live Parameter


class UnquantizedFusedMoEMethod:
    def __init__(self, variant: str):
        self.variant = variant
        self.moe_kernel = None

    def _setup_kernel(self, layer: RoutedExperts, w13: torch.Tensor, w2: torch.Tensor) -> None:
        # Shuffle weights to runtime format.
        w13_new, w2_new = rocm_aiter_ops.shuffle_weights(w13, w2)
        if self.variant == "bug":
            replace_parameter(layer, "w13_weight", w13_new)
            replace_parameter(layer, "w2_weight", w2_new)
            self.moe_kernel = fused_experts
        else:
            # On a weight update CUDA graphs may have captured the parameter addresses: copy in place.
            is_weight_update = self.moe_kernel is not None
            replace_parameter(layer, "w13_weight", w13_new, prefer_copy=is_weight_update)
            replace_parameter(layer, "w2_weight", w2_new, prefer_copy=is_weight_update)
            if not is_weight_update:
                self.moe_kernel = fused_experts

    def process_weights_after_loading(self, layer: RoutedExperts) -> None:
        self._setup_kernel(layer, layer.w13_weight, layer.w2_weight)


def fused_experts(hidden_states, w13, w2, topk_weights, topk_ids):
    """The AITER MoE kernel: reads the weights in its shuffled layout (undoes the reordering on load)."""
    w13_k, w2_k = w13.flip(-1), w2.flip(-1)
    gate_up = torch.einsum("th,tnh->tn", hidden_states, w13_k[topk_ids])
    gate, up = gate_up.chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate) * up
    return torch.einsum("tk,thk->th", act, w2_k[topk_ids]) * topk_weights[:, None]


def run(variant: str, device: str = "cpu"):
    gen = generator(40390)
    checkpoints = [(randn(E, 2 * INTER, HIDDEN, gen=gen, device=device, scale=0.5),
                    randn(E, HIDDEN, INTER, gen=gen, device=device, scale=0.5)) for _ in range(2)]
    batches = [randn(TOKENS, HIDDEN, gen=gen, device=device) for _ in range(4)]
    topk_ids = torch.tensor([1, 0], device=device)
    topk_weights = torch.tensor([0.75, 1.25], device=device)

    def serve(graphed: bool):
        layer, quant_method = RoutedExperts(device), UnquantizedFusedMoEMethod(variant)
        layer.weight_loader("w13_weight", checkpoints[0][0])
        layer.weight_loader("w2_weight", checkpoints[0][1])
        quant_method.process_weights_after_loading(layer)
        hidden_states = torch.zeros(TOKENS, HIDDEN, device=device)

        def forward():
            return quant_method.moe_kernel(hidden_states, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids)

        if graphed:
            g, out = capture(forward, device=device, static={"hidden_states": hidden_states},
                             owner="GPUModelRunner (FULL decode graph)")
        outs = []

        def step(x):
            hidden_states.copy_(x)
            return (replay(g, out) if graphed else forward()).clone()

        outs += [step(batches[0]), step(batches[1])]
        # RL weight sync: the trainer's new weights are loaded, then post-processing runs again.
        layer.weight_loader("w13_weight", checkpoints[1][0])
        layer.weight_loader("w2_weight", checkpoints[1][1])
        quant_method.process_weights_after_loading(layer)
        outs += [step(batches[2]), step(batches[3])]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
