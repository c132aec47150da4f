"""An NVFP4 weight update rebinds the processed scales to new Parameters: the decode graph reads the released ones.

Upstream: https://github.com/sgl-project/sglang/pull/18085 ("Fix nvfp4 weight update").
Symptom: "The existing nvfp4 ``/update_weights_from_disk`` endpoint does not work" (tested on
nvidia/Qwen3-30B-A3B-NVFP4; a prerequisite for NVFP4 RL in miles), with CUDA graphs on, as by default
(sglang main, February 2026).
Mechanism: ``update_weights_from_disk`` reloads the checkpoint into the live model without recapturing the CUDA
graphs: each weight loader copies the raw tensors (``weight``, ``weight_scale``, ``input_scale``,
``weight_scale_2``) into the existing parameters, then ``process_weights_after_loading`` runs again. For NVFP4
linears it derives the tensors the FP4 GEMM actually reads (``alpha = input_scale * weight_scale_2``,
``input_scale_inv``, the swizzled ``weight_scale_interleaved``) and binds them with
``layer.alpha = Parameter(...)``: a new tensor each time. Rebinding drops the module's reference to the
parameter that the decode graphs captured at startup; its storage is released while the graphs still address
it, so every later replay reads memory nobody owns (old scales, or whatever reuses the block), while eager code
reads the new parameters.
Doctor: dangling-reference, at ``process_weights_after_loading`` (it replaces, and so releases, the scale
parameters whose addresses the captured decode graph holds).
Fix (upstream): ``copy_or_rebind_param(module, name, new_value)`` ("Keep parameter identities stable for CUDA
graph reuse and hot reload"): when a parameter of the same shape and dtype exists, ``param.data.copy_(new_value)``
writes the new values into the captured storage; it rebinds only on a shape/dtype change or a first load.
(Read: the PR description, the resulting ``copy_or_rebind_param`` and its call sites, and the pre-fix
``ModelOptFp4LinearMethod.process_weights_after_loading`` of an earlier revision; not the diff itself. Tiny model:
one NVFP4 linear; FP4 is modelled as integer codes in [-6, 6] with one block scale per 4 inputs, and the
128x4 scale interleave as a transpose.)
"""
from __future__ import annotations

import torch
from torch.nn import Parameter

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/18085"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "process_weights_after_loading"
SYMPTOM = "after update_weights_from_disk the NVFP4 decode graph reads released scale parameters"

VOCAB, HIDDEN, MAX_POS, GROUP_SIZE, FP4_MAX = 16, 8, 16, 4, 6.0
MAX_BS = 2


def copy_or_rebind_param(module: torch.nn.Module, name: str, new_value: torch.Tensor) -> None:
    """Keep parameter identities stable for CUDA graph reuse and hot reload."""
    new_value = new_value.detach()
    param = getattr(module, name, None)
    if isinstance(param, Parameter):
        if param.data.shape == new_value.shape and param.data.dtype == new_value.dtype:
            param.data.copy_(new_value)
        else:
            param.data = new_value
        param.requires_grad_(False)
    else:
        setattr(module, name, Parameter(new_value, requires_grad=False))


def default_weight_loader(param: Parameter, loaded_weight: torch.Tensor) -> None:
    param.data.copy_(loaded_weight)


def swizzle_blockscale(scale: torch.Tensor) -> torch.Tensor:
    """Stand-in for the 128x4 block-scale interleave: a layout change the GEMM undoes."""
    return scale.t().contiguous()


def scaled_fp4_quant(x: torch.Tensor, input_scale_inv: torch.Tensor) -> torch.Tensor:
    return torch.round(x * input_scale_inv).clamp(-FP4_MAX, FP4_MAX)


def cutlass_scaled_fp4_mm(x_fp4, weight, weight_scale_interleaved, alpha):
    block_scale = weight_scale_interleaved.t().repeat_interleave(GROUP_SIZE, dim=1)
    return (x_fp4 @ (weight * block_scale).t()) * alpha


class ModelOptFp4LinearMethod:
    def __init__(self, variant):
        self.variant = variant

    def create_weights(self, layer, input_size, output_size, device):
        def register(name, shape):
            param = Parameter(torch.empty(shape, device=device), requires_grad=False)
            param.weight_loader = default_weight_loader
            layer.register_parameter(name, param)
        register("weight", (output_size, input_size))                   # FP4 codes (packed upstream)
        register("weight_scale", (output_size, input_size // GROUP_SIZE))
        register("input_scale", (1,))
        register("weight_scale_2", (1,))

    @torch.no_grad()
    def process_weights_after_loading(self, layer) -> None:
        input_scale_2 = layer.input_scale.max().to(torch.float32)
        weight_scale_2 = layer.weight_scale_2.max().to(torch.float32)
        derived = {"alpha": input_scale_2 * weight_scale_2,
                   "input_scale_inv": (1 / input_scale_2).to(torch.float32),
                   "weight_scale_interleaved": swizzle_blockscale(layer.weight_scale)}
        for name, value in derived.items():
            if self.variant == "fix":
                copy_or_rebind_param(layer, name, value)
            else:
                setattr(layer, name, Parameter(value, requires_grad=False))   # layer.alpha = Parameter(...)

    def apply(self, layer, x):
        x_fp4 = scaled_fp4_quant(x, layer.input_scale_inv)
        return cutlass_scaled_fp4_mm(x_fp4, layer.weight, layer.weight_scale_interleaved, layer.alpha)


class LinearBase(torch.nn.Module):
    def __init__(self, input_size, output_size, quant_method, device):
        super().__init__()
        self.quant_method = quant_method
        quant_method.create_weights(self, input_size, output_size, device)

    def forward(self, x):
        return self.quant_method.apply(self, x)


class Qwen3ForCausalLM(torch.nn.Module):
    def __init__(self, device, variant):
        super().__init__()
        gen = generator(18085)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.pos_embed = randn(MAX_POS, HIDDEN, gen=gen, device=device, scale=0.5)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.5)
        self.mlp = LinearBase(HIDDEN, HIDDEN, ModelOptFp4LinearMethod(variant), device)

    def forward(self, input_ids, positions):
        h = self.embed[input_ids] + self.pos_embed[positions]
        h = h + torch.nn.functional.silu(self.mlp(h))
        return h @ self.lm_head

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, loaded in weights:
            param = params[name]
            param.weight_loader(param, loaded)


def nvfp4_checkpoint(seed, device):
    """A ModelOpt NVFP4 checkpoint of the MLP: codes, block scales, global scales."""
    gen = generator(seed)
    codes = torch.randint(-6, 7, (HIDDEN, HIDDEN), generator=gen).float()
    weight_scale = (torch.rand(HIDDEN, HIDDEN // GROUP_SIZE, generator=gen) * 0.5 + 0.25)
    return [("mlp.weight", codes.to(device)), ("mlp.weight_scale", weight_scale.to(device)),
            ("mlp.input_scale", torch.tensor([0.4 + 0.1 * (seed % 3)], device=device)),
            ("mlp.weight_scale_2", torch.tensor([0.08 + 0.02 * (seed % 5)], device=device))]


class ModelRunner:
    def __init__(self, device, variant):
        self.model = Qwen3ForCausalLM(device, variant)
        self.load_weights_and_postprocess(nvfp4_checkpoint(1, device))

    def load_weights_and_postprocess(self, weights):
        self.model.load_weights(weights)
        for module in self.model.modules():
            quant_method = getattr(module, "quant_method", None)
            if quant_method is not None:
                quant_method.process_weights_after_loading(module)

    def update_weights_from_disk(self, weights):
        """In-place update, the captured CUDA graphs are kept (no recapture)."""
        self.load_weights_and_postprocess(weights)


class CudaGraphRunner:
    def __init__(self, model_runner, device):
        self.model_runner = model_runner
        self.input_ids = torch.zeros(MAX_BS, dtype=torch.long, device=device)
        self.positions = torch.zeros(MAX_BS, dtype=torch.long, device=device)
        model = model_runner.model
        self.graph, self.output = capture(lambda: model(self.input_ids, self.positions), device=device,
                                          name=f"decode bs {MAX_BS}", owner="CudaGraphRunner",
                                          static={"input_ids": self.input_ids, "positions": self.positions})

    def replay(self, input_ids, positions):
        self.input_ids.copy_(input_ids)
        self.positions.copy_(positions)
        return replay(self.graph, self.output).clone()


def run(variant: str, device: str = "cpu"):
    t = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    decode_steps = [([3, 7], [4, 5]), ([1, 12], [5, 6])]
    after_update = [([9, 2], [6, 7]), ([14, 5], [7, 8])]

    def serve(graphed: bool):
        runner = ModelRunner(device, variant)
        graphs = CudaGraphRunner(runner, device) if graphed else None
        forward = (lambda ids, pos: graphs.replay(t(ids), t(pos))) if graphed else \
            (lambda ids, pos: runner.model(t(ids), t(pos)).clone())
        outs = [forward(ids, pos) for ids, pos in decode_steps]
        runner.update_weights_from_disk(nvfp4_checkpoint(2, device))     # e.g. an RL step's new weights
        outs += [forward(ids, pos) for ids, pos in after_update]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
