"""An RL weight reload re-runs the MXFP8 relayout with ``.contiguous()``: the ACL graph keeps the old weights' addresses.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/13902 ("[BugFix] [w8a8_mxfp8] Reuse weight address in
graph and RL scenario"; backported to v0.23.0 as #13905).
Symptom: in RL rollouts (verl) with a W8A8-MXFP8 model and ACL graph mode on, generations after the first weight
sync are garbled; with eager mode, or before any reload, they are correct (vllm-ascend, Aug 2026).
Mechanism: ``AscendW8A8MXFP8DynamicLinearMethod.process_weights_after_loading`` turns the loaded weight (transpose)
and its MX block scales (reshape + transpose) into the layout the NPU matmul consumes, each with ``.contiguous()``,
and rebinds ``layer.weight.data`` / ``layer.weight_scale.data`` to the new tensors. The ACL graphs are captured once,
reading the weights by address. The RL loop reloads the rollout weights and calls the method again after every
sync: each call allocates new transformed tensors and drops the ones the graphs read. Replays keep reading the
released blocks: the previous weights, or whatever the caching allocator has since put there.
Doctor: dangling-reference, at ``process_weights_after_loading`` (it releases the weight tensors the captured
graphs read and rebinds the layer to new ones).
Fix (upstream): allocate the transformed buffers once (``_mxfp8_weight_buf`` / ``_mxfp8_scale_buf``, cached on
the layer) and on later calls ``copy_()`` the reloaded data into them in place, pointing ``layer.weight.data`` /
``layer.weight_scale.data`` back at the cached buffers, so the addresses never change.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/13902"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "process_weights_after_loading"
SYMPTOM = "garbled rollouts after an RL weight sync: the ACL graph still reads the pre-reload MXFP8 weights"
IN, OUT, BLOCK, TOKENS = 8, 4, 4, 3          # MX block scales: one per BLOCK input channels


class LinearLayer(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(OUT, IN, device=device), requires_grad=False)
        self.weight_scale = torch.nn.Parameter(torch.empty(OUT, IN // BLOCK, device=device), requires_grad=False)


def load_weights(layer, weight, weight_scale):
    """The weight sync: the loader materialises the checkpoint layout ([out, in]) and copies the tensors in."""
    layer.weight.data = torch.empty(OUT, IN, device=weight.device)
    layer.weight_scale.data = torch.empty(OUT, IN // BLOCK, device=weight.device)
    layer.weight.data.copy_(weight)
    layer.weight_scale.data.copy_(weight_scale)


class AscendW8A8MXFP8DynamicLinearMethod:
    def __init__(self, variant: str):
        self.variant = variant

    def process_weights_after_loading(self, layer):
        weight = layer.weight.data.transpose(0, 1)                        # [in, out] for the matmul
        weight_scale = layer.weight_scale.data.reshape(OUT, -1).transpose(0, 1)
        if self.variant == "bug":
            layer.weight.data = weight.contiguous()
            layer.weight_scale.data = weight_scale.contiguous()
            return
        # The fix: the transformed buffers are allocated once and refilled in place on every reload.
        if getattr(layer, "_mxfp8_weight_buf", None) is None:
            layer._mxfp8_weight_buf = weight.contiguous()
            layer._mxfp8_scale_buf = weight_scale.contiguous()
        else:
            layer._mxfp8_weight_buf.copy_(weight)
            layer._mxfp8_scale_buf.copy_(weight_scale)
        layer.weight.data = layer._mxfp8_weight_buf
        layer.weight_scale.data = layer._mxfp8_scale_buf

    def apply(self, layer, x):
        """Dynamic per-token quantisation of x, then the MX-scaled matmul (``npu_quant_matmul``)."""
        pertoken_scale = x.abs().amax(-1, keepdim=True) / 127.0
        x_q = torch.round(x / pertoken_scale)
        w = layer.weight * layer.weight_scale.repeat_interleave(BLOCK, dim=0)
        return (x_q @ w) * pertoken_scale


def run(variant: str, device: str = "cpu"):
    gen = generator(13902)
    rollouts = []                                   # (weights of this sync, prompts' hidden states)
    for _ in range(3):
        w = torch.round(randn(OUT, IN, gen=gen, device=device, scale=40.0))
        s = randn(OUT, IN // BLOCK, gen=gen, device=device, scale=0.01).abs()
        rollouts.append((w, s, randn(TOKENS, IN, gen=gen, device=device)))

    def serve(graphed: bool):
        layer = LinearLayer(device)
        quant_method = AscendW8A8MXFP8DynamicLinearMethod(variant)
        x = torch.zeros(TOKENS, IN, device=device)
        outs = []
        for i, (w, s, hidden) in enumerate(rollouts):
            load_weights(layer, w, s)               # initial load, then one reload per RL step
            quant_method.process_weights_after_loading(layer)
            x.copy_(hidden)
            if not graphed:
                outs.append(quant_method.apply(layer, x))
                continue
            if i == 0:                              # ACL graphs are captured once, after the first load
                g, out = capture(lambda: quant_method.apply(layer, x), device=device, static={"x": x},
                                 owner="NPUModelRunner (ACL graph)", on_freed="reuse")
            outs.append(replay(g, out).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
