"""Every RL ``update_weights`` registers a brand-new resmoothed FP8 Parameter; the decode graph keeps reading the first one, now released.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/11267 ("[TRTLLM-9771][feat] Make update_weights compatible
with CUDA Graph"), merged February 2026; it builds on #10456 ("Support partial update weight for fp8"), which
added the helper.
Symptom: with CUDA graphs on, rollouts after the first FP8 (block-scale) weight update are wrong: decode reads
the pre-update or freed weight storage, while eager/prefill reads the new weights. The PR adds quantized and
partial update-weights tests on Blackwell; before it only eager mode was correct.
Mechanism: on SM100 ``FP8BlockScalesLinearMethod.post_load_weights`` turns the checkpoint's ``weight`` /
``weight_scale`` into the DeepGEMM layout (``resmooth_to_fp8_e8m0``: power-of-two block scales and a rescaled
weight; ``transform_sf_into_required_layout``: a new scale layout and shape). The results are new tensors, which
it installs with ``replace_parameter_and_save_metadata(module, name, Parameter(new), module.rebuild_tensor_metadata)``.
As #10456 wrote it, the helper stored only ``getattr(module, name).to("meta")`` on its first call and always ran
``module.register_parameter(name, new_param)``. The decode graphs are captured after the initial load and hold
the address of that first resmoothed Parameter. ``WorkerExtension.update_weights(ipc_handles)`` then calls
``pre_reload_weights``, which re-registers a staging Parameter of the checkpoint shape
(``torch.empty_like(meta)``; it even logs "... will invalidate existing CUDA graphs"), ``ModelLoader.reload``
copies the new checkpoint into it, and ``update_weights(None)`` runs ``post_load_weights`` again, which
registers yet another new Parameter. Nothing references the captured one any more: its storage is released
while every replay still reads it (old weights, a reused block, or a fault), while eager reads the new one.
Doctor: dangling-reference, at ``replace_parameter_and_save_metadata`` (it keeps no reference to the runtime
Parameter the graph captured and re-registers a new one each refit, so ``pre_reload_weights``' swap frees it).
Fix (upstream): the helper's first call stores ``{'meta': original_meta, 'param': saved_param}`` (pinning the
runtime Parameter); later calls ``saved_param.data.copy_(new_param.data)`` and register ``saved_param`` again,
so the captured address stays valid and holds the new weights. ``pre_reload_weights`` reads ``metadata['meta']``.
Read: #11267's description and the helper's diff hunks in its review threads, #10456's helper (review thread),
the pre- and post-fix ``pre_reload_weights`` and ``FP8BlockScalesLinearMethod.post_load_weights``, and
``WorkerExtension.update_weights``; #14330's description confirms the pin. Tiny model: FP8 codes as float32,
128x128 blocks as 4x4, the scale layout transform as a transpose, DeepGEMM as dequantize-then-matmul.
"""
from __future__ import annotations

from typing import Dict

import torch
from torch import nn
from torch.nn import Parameter

from workbench.zoo.kit import capture, compare, generator, randn, release_to_driver, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/11267"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "replace_parameter_and_save_metadata"
SYMPTOM = "after an RL update_weights the FP8 decode graph reads the released first resmoothed weight"

VOCAB, HIDDEN, MAX_POS, BLOCK = 16, 8, 16, 4
MAX_BS = 2


def replace_parameter_and_save_metadata(module: nn.Module, param_name: str, new_param: Parameter,
                                        metadata_dict: Dict, variant: str) -> None:
    """Replace a parameter in a module and save the metadata of the original parameter."""
    if variant == "bug":                                               # as added by #10456
        if param_name not in metadata_dict:
            metadata_dict[param_name] = getattr(module, param_name).to("meta")
        module.register_parameter(param_name, new_param)               # a new Parameter on every call
        return
    if param_name not in metadata_dict:                                # #11267: pin the runtime Parameter
        original_meta = getattr(module, param_name).to("meta")
        saved_param = new_param if isinstance(new_param, Parameter) else Parameter(new_param, requires_grad=False)
        metadata_dict[param_name] = {'meta': original_meta, 'param': saved_param}
    else:                                                              # later calls: copy into it
        saved_param = metadata_dict[param_name]['param']
        saved_param.data.copy_(new_param.data)
    module.register_parameter(param_name, saved_param)


def resmooth_to_fp8_e8m0(weight, weight_scale):
    """Round each block scale up to a power of two (UE8M0) and rescale the block's weight to match."""
    new_scale = torch.exp2(torch.ceil(torch.log2(weight_scale)))
    ratio = (weight_scale / new_scale).repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    return weight * ratio, new_scale


def transform_sf_into_required_layout(sf):
    return sf.t().contiguous()                                         # stand-in: a new layout and shape


def fp8_swap_ab_gemm(x, weight, weight_scale):
    sf = weight_scale.t().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    return x @ (weight * sf).t()


def copy_weight(dst: Parameter, src: torch.Tensor) -> None:
    dst.data.copy_(src)


class FP8BlockScalesLinearMethod:
    def __init__(self, variant):
        self.variant = variant

    def create_weights(self, module, in_features, out_features, device):
        module.weight = Parameter(torch.empty(out_features, in_features, device=device), requires_grad=False)
        module.weight_scale = Parameter(torch.empty(out_features // BLOCK, in_features // BLOCK, device=device),
                                        requires_grad=False)
        module.rebuild_tensor_metadata = {}

    def apply(self, module, x):
        return fp8_swap_ab_gemm(x, module.weight, module.weight_scale)

    def load_weights_vanilla(self, module, weights):
        if "weight" in weights:
            copy_weight(module.weight, weights["weight"])
        if "weight_scale_inv" in weights:
            copy_weight(module.weight_scale, weights["weight_scale_inv"])

    def post_load_weights(self, module):
        weight, weight_scale = resmooth_to_fp8_e8m0(module.weight, module.weight_scale)
        transformed_scale = transform_sf_into_required_layout(weight_scale)
        replace_parameter_and_save_metadata(module, "weight", Parameter(weight, requires_grad=False),
                                            module.rebuild_tensor_metadata, self.variant)
        replace_parameter_and_save_metadata(module, "weight_scale", Parameter(transformed_scale, requires_grad=False),
                                            module.rebuild_tensor_metadata, self.variant)

    def pre_reload_weights(self, module):
        for param_name, metadata in module.rebuild_tensor_metadata.items():
            meta_tensor = metadata if self.variant == "bug" else metadata['meta']
            param = Parameter(torch.empty_like(meta_tensor, device=module.device), requires_grad=False)
            module.register_parameter(param_name, param)               # the staging buffer, checkpoint shape


class Linear(nn.Module):
    def __init__(self, in_features, out_features, quant_method, device):
        super().__init__()
        self.device = device
        self.quant_method = quant_method
        quant_method.create_weights(self, in_features, out_features, device)

    def forward(self, x):
        return self.quant_method.apply(self, x)

    def load_weights(self, weights):
        self.quant_method.load_weights_vanilla(self, weights)

    def post_load_weights(self):
        self.quant_method.post_load_weights(self)

    def pre_reload_weights(self):
        self.quant_method.pre_reload_weights(self)


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, device, variant):
        super().__init__()
        gen = generator(11267)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.pos_embed = randn(MAX_POS, HIDDEN, gen=gen, device=device, scale=0.5)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.5)
        self.mlp = Linear(HIDDEN, HIDDEN, FP8BlockScalesLinearMethod(variant), device)

    def forward(self, input_ids, position_ids):
        h = self.embed[input_ids] + self.pos_embed[position_ids]
        h = h + torch.nn.functional.silu(self.mlp(h))
        return h @ self.lm_head

    def load_weights(self, weights):
        self.mlp.load_weights({k.split(".", 1)[1]: v for k, v in weights.items() if k.startswith("mlp.")})


def fp8_block_checkpoint(seed, device):
    """The trainer's FP8 block-scale weights of the MLP: codes and per-block ``weight_scale_inv``."""
    gen = generator(seed)
    codes = torch.randn(HIDDEN, HIDDEN, generator=gen) * 2.0
    scale = torch.rand(HIDDEN // BLOCK, HIDDEN // BLOCK, generator=gen) * 0.3 + 0.1
    return {"mlp.weight": codes.to(device), "mlp.weight_scale_inv": scale.to(device)}


class ModelLoader:
    def load(self, model, weights):
        model.load_weights(weights)
        for module in model.modules():
            if hasattr(module, "post_load_weights"):
                module.post_load_weights()

    def reload(self, model, weights, allow_partial_loading=True):
        model.load_weights(weights)                        # partial loading: post-processing comes later


class WorkerExtension:
    """The RL worker extension: ``update_weights(handles)`` per bucket, then ``update_weights(None)``."""

    def __init__(self, model, model_loader, device):
        self.model, self.model_loader, self.device = model, model_loader, device

    def update_weights(self, ipc_handles=None):
        if not hasattr(self.model, "first_pre_reload_weights"):
            for module in self.model.modules():
                if hasattr(module, "pre_reload_weights"):
                    module.pre_reload_weights()
            self.model.first_pre_reload_weights = True
        if ipc_handles is not None:
            self.model_loader.reload(self.model, ipc_handles, allow_partial_loading=True)
        else:
            for module in self.model.modules():
                if hasattr(module, "post_load_weights"):
                    module.post_load_weights()
            delattr(self.model, "first_pre_reload_weights")
            release_to_driver(self.device)                 # colocated RL hands cached memory back


class CUDAGraphRunner:
    def __init__(self, model, device):
        self.input_ids = torch.zeros(MAX_BS, dtype=torch.long, device=device)
        self.position_ids = torch.zeros(MAX_BS, dtype=torch.long, device=device)
        self.graph, self.output = capture(lambda: model(self.input_ids, self.position_ids), device=device,
                                          name=f"decode bs {MAX_BS}", owner="CUDAGraphRunner",
                                          static={"input_ids": self.input_ids, "position_ids": self.position_ids})

    def replay(self, input_ids, position_ids):
        self.input_ids.copy_(input_ids)
        self.position_ids.copy_(position_ids)
        return replay(self.graph, self.output).clone()


def run(variant: str, device: str = "cpu"):
    t = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    before = [([3, 7], [4, 5]), ([1, 12], [5, 6])]
    after = [([9, 2], [6, 7]), ([14, 5], [7, 8])]

    def serve(graphed: bool):
        model, loader = Qwen3ForCausalLM(device, variant), ModelLoader()
        loader.load(model, fp8_block_checkpoint(1, device))
        worker = WorkerExtension(model, loader, device)
        graphs = CUDAGraphRunner(model, device) if graphed else None
        forward = (lambda ids, pos: graphs.replay(t(ids), t(pos))) if graphed else \
            (lambda ids, pos: model(t(ids), t(pos)).clone())
        outs = [forward(ids, pos) for ids, pos in before]
        for step in (2, 3):                                # two refits from the trainer
            worker.update_weights(fp8_block_checkpoint(step, device))
            worker.update_weights(None)
            outs += [forward(ids, pos) for ids, pos in after]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
