"""Re-quantizing a cached NVFP4 weight swizzles its scales out of place and frees the buffer a captured GEMM reads.

Upstream: https://github.com/NVIDIA/TransformerEngine/pull/3190 ("[PyTorch] NVFP4: emit GEMM-swizzled scales in
the non-RHT 2D quantize kernel"), merged as commit 645c4af74 (in v2.18). The commit says it "Fixes a CUDA graph
hang/corruption with NVFP4 weight caching".
Symptom: with the NVFP4 recipe, the weight cache (``is_first_microbatch``) and a CUDA graph captured over the
forward of a later microbatch (``is_first_microbatch=False``, so no re-quantize inside the graph), the next
batch's first microbatch re-quantizes the cached weight eagerly, and the following graph replays hang or
return corrupted output. The new test ``test_cached_weight_swizzle_scale_cuda_graph_replay`` calls the cause
"reallocates the swizzled scale and frees the captured address, so graph replay reads stale memory".
Mechanism: PR #3093 set ``optimize_for_gemm`` on the weight quantizer of cached weights. On a cache hit with
``update_workspace``, ``quantize_weight`` calls ``workspace.quantize_(weight)``, then
``NVFP4Quantizer.update_quantized``, then ``tex.quantize(src, quantizer, dst)`` (``extensions/cast.cpp``).
There, ``NVFP4Quantizer::convert_and_update_tensor`` sets ``with_gemm_swizzled_scales`` only for the RHT cast
fusion path (``optimize_for_gemm && with_rht && ...``), so for the plain 2D weight quantize it resets the flag
to false. The kernel writes *compact* scales into the existing ``_rowwise_scale_inv`` buffer. Then the
"post-quantize swizzle" runs: ``optimize_for_gemm && !get_with_gemm_swizzled_scales()`` calls
``inplace_swizzle_scale_for_gemm(output_py)`` (``extensions/swizzle.cpp``), which despite its name calls
``swizzle_scales_for_gemm`` (a new allocation), rebinds ``tensor.attr("_rowwise_scale_inv")`` to it and sets
``_with_gemm_swizzled_scales = True``. The graph captured the GEMM against the old scale address. That buffer has
now lost its last owner: it is freed memory that holds compact (unswizzled) scales, or whatever the allocator
puts there next. Eager forwards read the workspace's new attribute and are correct.
Doctor: dangling-reference, at ``inplace_swizzle_scale_for_gemm`` (its rebind of ``_rowwise_scale_inv`` releases
the storage the captured GEMM reads).
Fix (upstream): ``NVFP4Quantizer::is_eligible_for_2d_swizzle_fusion`` (128-aligned rows and columns, sm100 to
sm110) and ``nvfp4_emits_gemm_swizzled_scales()``. The plain 2D quantize kernel now writes GEMM-swizzled scales
straight into the existing persistent scale buffer (``create_tensor`` and ``convert_and_update_tensor`` set the
flag), so the out-of-place post-quantize swizzle is skipped and the scale address stays fixed across weight
updates.
Read: the diff of quantizer.cpp, the parent's ``cast.cpp`` ``quantize()``, ``swizzle.cpp``
``inplace_swizzle_scale_for_gemm``, ``module/base.py`` ``quantize_weight``, ``module/linear.py`` (the
``_fp8_workspaces`` cache), ``nvfp4_tensor.py`` ``quantize_``/``update_quantized``, and the new tests.
Simplifications: forward only, rowwise scales only (the columnwise ones are rebound the same way); E2M1 codes
are stored as float values, not packed bytes; the block scale is a float32 per 16x16 block, with no E4M3 cast
and no global amax; the swizzle is the 128x4 tile interleave of ``to_blocked``.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TransformerEngine/pull/3190"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "inplace_swizzle_scale_for_gemm"
SYMPTOM = "graph replays after an eager cached-weight re-quantize read a freed NVFP4 scale buffer (hang/corruption)"

IN_FEATURES = OUT_FEATURES = 128      # 128-aligned: the default cached-weight case the fix covers
BATCH = 4
NVFP4_BLOCK_SIZE = 16
FP4_MAX = 6.0
SM_ARCH = 100                         # Blackwell (NVFP4 needs sm100+)
MICROBATCHES = 3


def _e2m1_grid(device):
    return torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], device=device)


def swizzle_scales_for_gemm(scales):
    """``swizzle_scales_for_gemm``: a NEW tensor holding the 128x4-tile GEMM layout of ``scales``."""
    rows, cols = scales.shape
    tiles = scales.reshape(rows // 128, 4, 32, cols // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.contiguous().reshape(rows, cols)


def unswizzle_scales(swizzled):
    """What the GEMM's scale reader undoes: the inverse of the 128x4 tile interleave."""
    rows, cols = swizzled.shape
    tiles = swizzled.reshape(rows // 128, cols // 4, 32, 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(rows, cols)


class NVFP4Tensor:
    """The cached weight workspace (``NVFP4TensorStorage``): data, rowwise scale-inv and the layout flag."""

    def __init__(self, data, scale_inv, with_gemm_swizzled_scales, quantizer):
        self._rowwise_data = data
        self._rowwise_scale_inv = scale_inv
        self._with_gemm_swizzled_scales = with_gemm_swizzled_scales
        self._quantizer = quantizer

    def quantize_(self, tensor, *, noop_flag=None):
        self._quantizer.update_quantized(tensor, self, noop_flag=noop_flag)
        return self


class NVFP4Quantizer:
    """``NVFP4Quantizer`` (quantizer.cpp + nvfp4_tensor.py) for the plain, non-RHT, 2D weight quantize."""

    def __init__(self, variant):
        self.variant = variant
        self.optimize_for_gemm = True          # PR #3093: cached weights are quantized for the GEMM
        self.with_rht = False
        self.with_2d_quantization = True
        self.row_scaled_nvfp4 = False

    @staticmethod
    def is_eligible_for_rht_cast_fusion(shape):
        return shape[0] % 64 == 0 and shape[1] % 128 == 0 and 100 <= SM_ARCH <= 110

    @staticmethod
    def is_eligible_for_2d_swizzle_fusion(shape):
        return shape[0] % 128 == 0 and shape[1] % 128 == 0 and 100 <= SM_ARCH <= 110

    def nvfp4_emits_gemm_swizzled_scales(self, shape):
        if self.variant == "bug":
            # Swizzled SF is only valid when the RHT cast-fusion path runs; other quantize paths reject it.
            return self.optimize_for_gemm and self.with_rht and self.is_eligible_for_rht_cast_fusion(shape)
        if not self.optimize_for_gemm:
            return False
        if self.with_rht:
            return self.is_eligible_for_rht_cast_fusion(shape)
        # Plain (non-RHT) 2D quantize kernel can bake the swizzled layout for aligned shapes.
        return (self.with_2d_quantization and not self.row_scaled_nvfp4
                and self.is_eligible_for_2d_swizzle_fusion(shape))

    def create_tensor(self, shape, device):
        rows, cols = shape
        data = torch.zeros(rows, cols, device=device)
        scale_inv = torch.zeros(rows, cols // NVFP4_BLOCK_SIZE, device=device)
        return NVFP4Tensor(data, scale_inv, self.nvfp4_emits_gemm_swizzled_scales(shape), self)

    def convert_and_update_tensor(self, tensor):
        tensor._with_gemm_swizzled_scales = self.nvfp4_emits_gemm_swizzled_scales(
            tuple(tensor._rowwise_data.shape))
        return tensor

    def quantize_impl(self, src, dst):
        """``quantize_transpose_nvfp4_2D_kernel``: 16x16 block amax -> scale, E2M1 codes; it writes into
        ``dst``'s existing buffers, in the swizzled layout only when ``dst`` says so."""
        rows, cols = src.shape
        blocks = src.reshape(rows // 16, 16, cols // 16, 16)
        amax = blocks.abs().amax(dim=(1, 3))                                     # [rows/16, cols/16]
        scale_inv = (amax / FP4_MAX).clamp(min=1e-12)
        compact = scale_inv.repeat_interleave(16, dim=0)                          # [rows, cols/16]
        scaled = src / compact.repeat_interleave(NVFP4_BLOCK_SIZE, dim=1)
        grid = _e2m1_grid(src.device)
        codes = grid[(scaled.abs()[..., None] - grid).abs().argmin(-1)] * scaled.sign()
        dst._rowwise_data.copy_(codes)
        if dst._with_gemm_swizzled_scales:
            dst._rowwise_scale_inv.copy_(swizzle_scales_for_gemm(compact))     # in place, GEMM layout
        else:
            dst._rowwise_scale_inv.copy_(compact)                               # in place, compact layout

    def quantize(self, tensor):
        return tex_quantize(tensor, self)

    def update_quantized(self, src, dst, noop_flag=None):
        tex_quantize(src, self, dst, noop_flag)
        return dst


def inplace_swizzle_scale_for_gemm(tensor):
    """``extensions/swizzle.cpp``: swizzle out of place and rebind the Python attribute."""
    if tensor._with_gemm_swizzled_scales:
        return
    rowwise_scales = swizzle_scales_for_gemm(tensor._rowwise_scale_inv)
    tensor._rowwise_scale_inv = rowwise_scales            # tensor.attr("_rowwise_scale_inv") = rowwise_scales
    tensor._with_gemm_swizzled_scales = True


def tex_quantize(tensor, quantizer, output=None, noop_flag=None):
    """``extensions/cast.cpp`` ``quantize()``."""
    if output is None:
        output = quantizer.create_tensor(tuple(tensor.shape), tensor.device)
    else:
        output = quantizer.convert_and_update_tensor(output)
    quantizer.quantize_impl(tensor, output)
    # Post-quantize swizzle for quantizers whose kernel does not bake the GEMM-swizzled scale layout in directly
    if quantizer.optimize_for_gemm and not output._with_gemm_swizzled_scales:
        inplace_swizzle_scale_for_gemm(output)
    return output


def quantize_weight(*, tensor, quantizer, workspace=None, update_workspace=True, cache=False):
    """``module/base.py``: reuse the cached workspace (updated in place on request) or make a new one."""
    if workspace is not None:
        if update_workspace:
            workspace.quantize_(tensor)
        return workspace, None
    out = quantizer.quantize(tensor)
    return (out, out) if cache else (out, None)


def general_gemm(weight_ws, inp, bias):
    """The NVFP4 GEMM: reads the workspace's data and its GEMM-swizzled scales, by address."""
    scales = unswizzle_scales(weight_ws._rowwise_scale_inv)
    w = weight_ws._rowwise_data * scales.repeat_interleave(NVFP4_BLOCK_SIZE, dim=1)
    return inp @ w.t() + bias


class Linear(torch.nn.Module):
    """``te.Linear`` under the NVFP4 recipe, forward only, with the ``is_first_microbatch`` weight cache."""

    def __init__(self, device, variant):
        super().__init__()
        gen = generator(3190)
        self.weight = torch.nn.Parameter(randn(OUT_FEATURES, IN_FEATURES, gen=gen, device=device, scale=0.05),
                                         requires_grad=False)
        self.bias = torch.nn.Parameter(randn(OUT_FEATURES, gen=gen, device=device, scale=0.1),
                                       requires_grad=False)
        self.weight_quantizer = NVFP4Quantizer(variant)
        self._fp8_workspaces = {}

    def forward(self, inp, is_first_microbatch=None):
        cache_name = None if is_first_microbatch is None else "weight"
        weight_workspace = self._fp8_workspaces.get(cache_name) if cache_name is not None else None
        update_workspace = is_first_microbatch is None or is_first_microbatch
        weightmat, new_weight_workspace = quantize_weight(
            tensor=self.weight, quantizer=self.weight_quantizer, workspace=weight_workspace,
            update_workspace=update_workspace, cache=cache_name is not None)
        out = general_gemm(weightmat, inp, self.bias)
        if new_weight_workspace is not None and cache_name is not None:
            self._fp8_workspaces[cache_name] = new_weight_workspace
        return out


class Trainer:
    """A pipeline-style loop: the first microbatch of each batch runs eagerly and refreshes the cached weight;
    the other microbatches replay a graph captured over ``forward(x_static, is_first_microbatch=False)``."""

    def __init__(self, device, variant, graphed):
        self.device, self.graphed = device, graphed
        self.module = Linear(device, variant)
        self.x_static = torch.zeros(BATCH, IN_FEATURES, device=device)
        self.graph = None

    def microbatch(self, x, is_first):
        with torch.no_grad():
            if is_first or not self.graphed:
                return self.module(x, is_first_microbatch=is_first).clone()
            if self.graph is None:
                self.graph, self.y_static = capture(
                    lambda: self.module(self.x_static, is_first_microbatch=False), device=self.device,
                    owner="te.Linear (graphed non-first microbatch)", static={"x_static": self.x_static},
                    warmups=3)
            self.x_static.copy_(x)
            return replay(self.graph, self.y_static).clone()

    def optimizer_step(self, delta):
        with torch.no_grad():
            self.module.weight.add_(delta)


def run(variant: str, device: str = "cpu"):
    gen = generator(31900)
    batches = [[randn(BATCH, IN_FEATURES, gen=gen, device=device) for _ in range(MICROBATCHES)] for _ in range(2)]
    deltas = [randn(OUT_FEATURES, IN_FEATURES, gen=gen, device=device, scale=0.05) for _ in range(2)]

    def serve(graphed: bool):
        trainer = Trainer(device, variant, graphed)
        outs = []
        for b, microbatches in enumerate(batches):
            if b:
                trainer.optimizer_step(deltas[b])
            for i, x in enumerate(microbatches):
                outs.append(trainer.microbatch(x, is_first=i == 0))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
