"""An RL weight sync rebinds an FP8 layer's ``weight_scale`` to a fresh tensor; the decode graph keeps reading the old one.

Upstream: https://github.com/ROCm/ATOM/pull/2028 ("[Lumen-RL] Improve FP8 rollout weight synchronization and
CUDA Graph stability"), merged.
Symptom: in RL rollouts on an FP8 (``float8_e4m3fnuz``, per-token) model served with CUDA graphs (no-eager),
every online weight sync rebuilt ``weight_scale`` as a new tensor, "which moves the scale's address out from
under a captured decode graph" (review reply in the PR); the same re-run conversion also doubled the scale on
every sync (3.0 -> 6.0 -> 12.0, measured by the author), so the dequantized weight grew 2**N after N syncs.
Mechanism: ``WeightUpdaterMixin.update_weights`` requantizes each trained weight into the FP8 parameter
(``_requantize_fp8_weight``: ``param.data.copy_(...)``, ``weight_scale.data.copy_(scale)``, both in place) and
then calls ``_post_process_fp8_weight``. There, ``need_normalize_e4m3fn_to_e4m3fnuz`` -- a static property of the
layer (``params_dtype == torch.float8_e4m3fnuz``) that nothing clears after the load-time conversion -- re-runs
``normalize_e4m3fn_to_e4m3fnuz`` on the already-converted parameter and assigns
``param.data, weight_scale.data, _ = ...``. The weight comes back as a view of its own storage, but the scale
is ``weight_scale * 2.0``: a new allocation. Rebinding ``weight_scale.data`` drops the last reference to the
storage the decode graph captured, so every later replay dequantizes with freed memory (the pre-sync scale
or whatever the allocator put there), while eager reads the parameter's new tensor.
Doctor: dangling-reference, at ``_post_process_fp8_weight`` (its ``weight_scale.data = ...`` rebind releases
the storage the captured GEMM reads).
Fix (upstream): ``_post_process_fp8_weight`` gates the conversion on ``param.dtype == torch.float8_e4m3fn``
(an FNUZ parameter is never re-converted) and, where it does run, keeps the weight's rebind (same storage)
but writes the scale back in place: ``weight_scale.data.copy_(normalized_scale.to(weight_scale.dtype))``.
Read: the pre-fix ``atom/rollout/weight_updater.py`` and ``atom/model_ops/utils.py`` (ATOM mirror at
ffdf3bb5d) and the post-fix ``_post_process_fp8_weight`` (a stored post-merge version of the same file, with
the fix's comment); the PR page's diff view itself was not reachable, so the before/after pair is read from
those two file versions plus the author's review reply. The fix's ``_await_readers_of(param)`` (a stream
wait) is left out. The GEMM is modelled as dequantize-then-matmul, without activation quantization.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/ROCm/ATOM/pull/2028"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "_post_process_fp8_weight"
SYMPTOM = "after an RL weight sync the decode graph dequantizes FP8 weights with a freed weight_scale"

HIDDEN, INTER, BS = 8, 16, 4
FP8 = torch.float8_e4m3fnuz                    # the rollout's params_dtype on gfx942 (MI300)
ROCM_FP8_NAN_AS_INT = -128


def normalize_e4m3fn_to_e4m3fnuz(weight, weight_scale, input_scale=None):
    """``atom.model_ops.utils``: fix the NaN byte through an int8 view of the same storage, reinterpret as
    FNUZ, and double the scale (``scale * 2.0``: a new tensor)."""
    weight_as_int8 = weight.view(torch.int8)
    weight_as_int8[weight_as_int8 == ROCM_FP8_NAN_AS_INT] = 0
    weight = weight_as_int8.view(torch.float8_e4m3fnuz)
    weight_scale = weight_scale * 2.0
    if input_scale is not None:
        input_scale = input_scale * 2.0
    return weight, weight_scale, input_scale


class LinearBase(torch.nn.Module):
    """An FP8 per-token linear layer as ATOM builds it (weight + per-row ``weight_scale``)."""

    def __init__(self, in_features, out_features, device, gen):
        super().__init__()
        params_dtype = FP8
        w = randn(out_features, in_features, gen=gen, device=device, scale=0.5)
        scale = (w.abs().amax(dim=-1, keepdim=True) / torch.finfo(params_dtype).max).clamp(min=1e-12)
        self.weight = torch.nn.Parameter((w / scale).to(params_dtype), requires_grad=False)
        self.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
        self.quant_type = "per_Token"
        # create_weights: a static property of the layer, never cleared after the load-time conversion
        self.need_normalize_e4m3fn_to_e4m3fnuz = params_dtype == torch.float8_e4m3fnuz

    def forward(self, x):
        return x @ (self.weight.to(torch.float32) * self.weight_scale).t()


class Qwen3MLP(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        gen = generator(2028)
        self.up_proj = LinearBase(HIDDEN, INTER, device, gen)
        self.down_proj = LinearBase(INTER, HIDDEN, device, gen)

    def forward(self, x):
        return self.down_proj(torch.relu(self.up_proj(x)))


class WeightUpdaterMixin:
    """``atom/rollout/weight_updater.py``: online weight sync from the trainer into the FP8 rollout model."""

    def _get_param_to_module_mapping(self):
        return {f"{mn}.{pn}": (m, pn, p) for mn, m in self.model.named_modules()
                for pn, p in m.named_parameters(recurse=False)}

    @staticmethod
    def _is_fp8_param(module, param):
        return (param.dtype.is_floating_point and param.element_size() < 2
                and getattr(module, "weight_scale", None) is not None)

    def _requantize_fp8_weight(self, module, param_name, param, tensor):
        weight_scale = module.weight_scale
        fp8_max = torch.finfo(param.dtype).max
        tensor_gpu = tensor.to(device=self.device, dtype=torch.float32)
        # quant_type == per_Token
        row_amax = tensor_gpu.abs().amax(dim=-1, keepdim=True)
        scale = (row_amax / fp8_max).clamp(min=1e-12)
        param.data.copy_((tensor_gpu / scale).to(param.dtype))
        weight_scale.data.copy_(scale.to(weight_scale.dtype))
        self._post_process_fp8_weight(module, param)

    def _post_process_fp8_weight(self, module, param):
        weight_scale = getattr(module, "weight_scale", None)
        if self.variant == "bug":
            if getattr(module, "need_normalize_e4m3fn_to_e4m3fnuz", False) and weight_scale is not None:
                # re-runs the load-time conversion; the scale comes back as a new tensor and is rebound
                param.data, weight_scale.data, _ = normalize_e4m3fn_to_e4m3fnuz(param.data, weight_scale.data)
        else:
            if (getattr(module, "need_normalize_e4m3fn_to_e4m3fnuz", False) and weight_scale is not None
                    and param.dtype == torch.float8_e4m3fn):
                normalized, normalized_scale, _ = normalize_e4m3fn_to_e4m3fnuz(param.data, weight_scale.data)
                param.data = normalized                 # same storage, reinterpreted dtype
                weight_scale.data.copy_(normalized_scale.to(weight_scale.dtype))   # back in place
        # per_Token FP8 weights are shuffled in place here upstream (same storage); not modelled

    def update_weights(self, named_tensors):
        param_to_module = self._get_param_to_module_mapping()
        updated = 0
        for name, tensor in named_tensors:
            module, param_name, param = param_to_module[name]
            if self._is_fp8_param(module, param) and tensor.dtype != param.dtype:
                self._requantize_fp8_weight(module, param_name, param, tensor)
                updated += 1
            elif tensor.shape == param.shape:
                param.data.copy_(tensor.to(device=self.device, dtype=param.dtype))
                updated += 1
        return updated


class ModelRunner(WeightUpdaterMixin):
    def __init__(self, device, variant, graphed):
        self.device, self.variant, self.graphed = device, variant, graphed
        self.model = Qwen3MLP(device)
        self.input_hidden = torch.zeros(BS, HIDDEN, device=device)
        if graphed:
            self.capture_cudagraph()

    def capture_cudagraph(self):
        self.graph, self.outputs = capture(
            lambda: self.model(self.input_hidden), device=self.device,
            owner="ModelRunner (decode graph)", static={"input_hidden": self.input_hidden})

    def run_model(self, hidden):
        if not self.graphed:
            return self.model(hidden).clone()
        self.input_hidden.copy_(hidden)
        return replay(self.graph, self.outputs).clone()


def run(variant: str, device: str = "cpu"):
    gen = generator(20281)
    steps = [randn(BS, HIDDEN, gen=gen, device=device) for _ in range(3)]
    # the trainer's bf16/fp32 weights after each training step (two syncs)
    syncs = [[("up_proj.weight", randn(INTER, HIDDEN, gen=gen, device=device, scale=0.5)),
              ("down_proj.weight", randn(HIDDEN, INTER, gen=gen, device=device, scale=0.5))] for _ in range(2)]

    def serve(graphed: bool):
        runner = ModelRunner(device, variant, graphed)
        outs = [runner.run_model(steps[0])]
        for hidden, named_tensors in zip(steps[1:], syncs):
            runner.update_weights(named_tensors)          # online weight sync between rollouts
            outs.append(runner.run_model(hidden))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
