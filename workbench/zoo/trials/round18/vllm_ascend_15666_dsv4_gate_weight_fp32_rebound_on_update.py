"""An RL weight update rebinds the MoE gate's fp32 copy; the captured ACL graph keeps routing with the old one.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/15666 ("[BugFix][Model] Fix DeepSeek V4 weight
update in graph mode"; the v0.23.0 report is issue #17197, bug 3).
Symptom: DeepSeek-V4 rollouts under ACL graph (verl/slime RL, ``update_weights`` between rollouts without
re-capturing) keep using a stale MoE gate after each weight update and produce incorrect results; eager
mode is correct (vllm-ascend main, Sept 2026).
Mechanism: with ``precast_fp32_weight`` (the DeepSeek-V4 router runs its gate GEMM in fp32),
``AscendUnquantizedLinearMethod.process_weights_after_loading`` builds ``weight_fp32 =
layer.weight.data.to(torch.float32)`` (format-cast to NZ) and assigns ``layer.weight_fp32 = new_fp32``.
The decode graph was captured once, reading the gate's fp32 copy by address. ``update_weights`` loads the
new bf16 gate in place and calls ``process_weights_after_loading`` again, which binds a *new* fp32 tensor:
eager forwards read it, the graph still reads the old storage, now released to the caching allocator
(the old gate's values, or whatever reuses the block), so replays route tokens with the old gate.
Doctor: dangling-reference, at ``process_weights_after_loading`` (the captured ``weight_fp32`` released
by the rebinding).
Fix (upstream): when a ``weight_fp32`` already exists (same shape and dtype), copy the new values into it
with ``copy_`` so the tensor the graph captured stays the live one; only the first load creates it.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/15666"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "process_weights_after_loading"
SYMPTOM = "after an RL weight update, graph replays route tokens with the previous gate (stale experts)"
VOCAB, HIDDEN, N_EXPERTS, TOP_K, BS = 12, 4, 4, 2, 2


def maybe_trans_nz(weight):
    """``torch_npu.npu_format_cast(weight, ACL_FORMAT_FRACTAL_NZ)``: a new tensor in the NZ layout."""
    return weight.clone()


class ReplicatedLinear:
    """The MoE gate: a bf16 weight loaded in place (``weight_loader`` copies into ``weight.data``)."""

    def __init__(self, device, variant):
        self.weight = torch.nn.Parameter(torch.zeros(N_EXPERTS, HIDDEN, dtype=torch.bfloat16, device=device),
                                         requires_grad=False)
        self.precast_fp32_weight = True          # DeepSeek-V4's router GEMM runs in fp32
        self.quant_method = AscendUnquantizedLinearMethod(variant)

    def weight_loader(self, loaded_weight):
        self.weight.data.copy_(loaded_weight)


class AscendUnquantizedLinearMethod:
    def __init__(self, variant: str):
        self.variant = variant

    def process_weights_after_loading(self, layer, keep_nd_weight: bool = False):
        if layer.precast_fp32_weight:
            weight_fp32 = layer.weight.data.to(torch.float32)
            new_fp32 = weight_fp32 if keep_nd_weight else maybe_trans_nz(weight_fp32)
            old_fp32 = getattr(layer, "weight_fp32", None)
            if (self.variant == "fix" and old_fp32 is not None and old_fp32.shape == new_fp32.shape
                    and old_fp32.dtype == new_fp32.dtype):
                # graph mode captured this tensor: keep its identity, refresh its values
                old_fp32.copy_(new_fp32)
            else:
                layer.weight_fp32 = new_fp32

    def apply(self, layer, x):
        return x.float() @ layer.weight_fp32.t()


class DeepseekV4ForCausalLM:
    def __init__(self, device, variant):
        gen = generator(15666)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.gate = ReplicatedLinear(device, variant)
        self.experts = randn(N_EXPERTS, HIDDEN, HIDDEN, gen=gen, device=device, scale=0.7)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device)

    def load_weights(self, gate_weight):
        self.gate.weight_loader(gate_weight)
        self.gate.quant_method.process_weights_after_loading(self.gate)

    def forward(self, input_ids):
        hidden_states = self.embed_tokens[input_ids]
        router_logits = self.gate.quant_method.apply(self.gate, hidden_states)
        topk_weights, topk_ids = torch.softmax(router_logits, -1).topk(TOP_K, -1)
        expert_out = torch.einsum("td,tkde->tke", hidden_states, self.experts[topk_ids])
        hidden_states = hidden_states + (topk_weights[..., None] * expert_out).sum(1)
        return hidden_states @ self.lm_head


def run(variant: str, device: str = "cpu"):
    gen = generator(17197)
    rollout_gates = [(torch.randn(N_EXPERTS, HIDDEN, generator=gen) * 2).to(torch.bfloat16).to(device)
                     for _ in range(2)]                    # the checkpoint, then the trained policy
    steps = [torch.randint(0, VOCAB, (BS,), generator=gen).to(device) for _ in range(6)]

    def serve(graphed: bool):
        model = DeepseekV4ForCausalLM(device, variant)
        model.load_weights(rollout_gates[0])
        input_ids = torch.zeros(BS, dtype=torch.long, device=device)
        if graphed:
            g, out = capture(lambda: model.forward(input_ids), device=device, on_freed="reuse",
                             static={"input_ids": input_ids}, owner="NPUModelRunner (FULL decode ACL graph)")
        outs = []
        for i, ids in enumerate(steps):
            if i == 3:                                     # verl: update_weights between rollouts
                model.load_weights(rollout_gates[1])
            input_ids.copy_(ids)
            outs.append((replay(g, out) if graphed else model.forward(input_ids)).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
