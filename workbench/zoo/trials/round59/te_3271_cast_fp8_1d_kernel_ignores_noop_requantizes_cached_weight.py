"""On a "skip" replay the aligned FP8 cast kernel ignores the noop flag and re-quantizes the cached FP8 weight.

Upstream: https://github.com/NVIDIA/TransformerEngine/pull/3271 ("[Common] Ensure quantization kernels handle
noop properly"), merged as commit 172bd9377.
Symptom: "quantization treats the noop flag wrong ... the results would be wrong": with
``make_graphed_callables(cache_quantized_params=True)`` the graphed replays of non-first microbatches, which
must reuse the FP8 weight cached at the step's first microbatch, re-quantize it instead (the PR's new test
``test_skip_quantization_with_noop_flag``: after a replay with ``noop=1`` the quantized buffers have changed).
Mechanism: under CUDA graphs the cached-weight decision is a device flag, ``skip_fp8_weight_update``, that
``Graphed.forward`` fills in place before each replay (``not is_first_microbatch``); ``Linear.forward`` passes it
as ``noop_flag`` to ``workspace.quantize_``, so the captured graph always launches the weight cast and each
kernel must return early when ``noop[0] == 1``. In ``fp8::quantize`` (``quantize_fp8.cuh``) the Blackwell path
for aligned, full-tile FP8 outputs called ``quantize_1D(input, output, stream)``, and ``cast_fp8_1D_kernel``
took no noop pointer at all (the unaligned ``CastVectorizedUnaryKernelLauncher`` path did honour it). So every
replay re-quantizes the weight: with delayed scaling it casts with the scale that ``reduce_and_update`` has
changed after the first microbatch, rewrites the workspace's ``_data`` and ``_scale_inv``, and folds the weight
amax into ``amax_history[0]``; eager, with ``is_first_microbatch=False``, reuses the cached FP8 weight.
(The same PR stops the MXFP8 / blockwise IS_DBIAS kernels from honouring noop, because their unconditional
dbias reduction would sum a workspace they never wrote; PyTorch passes no noop to those dbias quantizes.)
Doctor: persistent-mutation, at ``cast_fp8_1D_kernel`` (on skip replays the captured cast writes the cached
FP8 weight and the amax history that the step must leave alone).
Fix (upstream): ``quantize_1D(input, noop, output, stream)`` passes ``noop->data.dptr`` to
``cast_fp8_1D_kernel``, which starts with ``if (noop != nullptr && noop[0] == 1.0f) return;``.
"""
from __future__ import annotations

import torch

from workbench.engine import events, graph, new_graph
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/NVIDIA/TransformerEngine/pull/3271"
FAMILY = "persistent-buffer mutation"
KIND = "persistent-mutation"
SITE = "cast_fp8_1D_kernel"
SYMPTOM = "skip replays re-quantize the cached FP8 weight with the updated delayed scale instead of reusing it"
IN, OUT, TOKENS = 4, 4, 3
ELEMS_PER_BLOCK = 16                        # the 1D kernel's tile: OUT * IN is a full tile, so it is taken
FP8_MAX, AMAX_HISTORY_LEN = 8.0, 4          # a coarse grid stands in for E4M3
STEPS, MICROBATCHES, NUM_WARMUP_ITERS, LR = 3, 3, 3, 0.5


class FP8GlobalStateManager:
    def __init__(self, device):
        self.device, self.graph_capturing, self.skip_fp8_weight_update_tensor = device, False, None

    def fp8_graph_capturing(self) -> bool:
        return self.graph_capturing

    def set_skip_fp8_weight_update_tensor(self, skip: bool) -> None:
        if self.skip_fp8_weight_update_tensor is None:
            self.skip_fp8_weight_update_tensor = torch.empty(1, device=self.device)
        self.skip_fp8_weight_update_tensor.fill_(float(skip))


def _cast(x, scale):
    return torch.clamp(torch.round(x * scale), -FP8_MAX, FP8_MAX)


def cast_fp8_1D_kernel(inp, out, amax, scale_inv, scale, noop=None):
    """The aligned Blackwell FP8 cast: data, atomic-max amax, and ``scale_inv`` (block 0)."""
    data, new_scale_inv = _cast(inp, scale), scale.reciprocal()
    new_amax = torch.maximum(amax, inp.abs().amax().reshape(1))
    if noop is None:                        # before the fix: never a noop pointer, the kernel always writes
        out.copy_(data)
        amax.copy_(new_amax)
        scale_inv.copy_(new_scale_inv)
        return
    keep = noop == 1.0                      # if (noop != nullptr && noop[0] == 1.0f) return;
    out.copy_(torch.where(keep, out, data))
    amax.copy_(torch.where(keep, amax, new_amax))
    scale_inv.copy_(torch.where(keep, scale_inv, new_scale_inv))


def CastVectorizedUnaryKernelLauncher(inp, noop, out, amax, scale_inv, scale):
    """The unaligned path: ``unary_kernel`` starts with the noop check (it did before the fix too)."""
    cast_fp8_1D_kernel(inp, out, amax, scale_inv, scale, noop)


def quantize_1D(inp, noop, out, amax, scale_inv, scale, variant):
    cast_fp8_1D_kernel(inp, out, amax, scale_inv, scale, noop if variant == "fix" else None)


def quantize(inp, noop, output, variant):
    """``fp8::quantize`` (IS_DBIAS = IS_DACT = false) on sm100."""
    q = output._quantizer
    args = (output._data, q.amax_history[0:1], output._scale_inv, q.scale)
    if inp.numel() % ELEMS_PER_BLOCK == 0:      # full_tile_1D_tensor && aligned && FP8: "Aligned AND FP8"
        quantize_1D(inp, noop, *args, variant)
    else:
        CastVectorizedUnaryKernelLauncher(inp, noop, *args)


class Float8Quantizer:
    """Delayed scaling: the cast uses ``scale``; the amax goes to ``amax_history[0]``."""

    def __init__(self, device, variant):
        self.scale, self.amax_history = torch.ones(1, device=device), torch.zeros(AMAX_HISTORY_LEN, device=device)
        self.variant = variant

    def quantize(self, tensor):
        out = Float8Tensor(torch.zeros_like(tensor), torch.ones(1, device=tensor.device), self)
        quantize(tensor, None, out, self.variant)
        return out

    def update_quantized(self, src, dst, noop_flag=None):
        quantize(src, noop_flag, dst, self.variant)          # tex.quantize(src, self, dst, noop_flag)


class Float8Tensor:
    def __init__(self, data, scale_inv, quantizer):
        self._data, self._scale_inv, self._quantizer = data, scale_inv, quantizer

    def quantize_(self, tensor, *, noop_flag=None):
        self._quantizer.update_quantized(tensor, self, noop_flag=noop_flag)

    def dequantize(self):
        return self._data * self._scale_inv


def quantize_weight(*, tensor, quantizer, workspace=None, update_workspace=True, skip_update_flag=None):
    """``module/base.py``: reuse the cached workspace, updated in place (gated by the flag under graphs)."""
    if workspace is not None:
        if skip_update_flag is not None:
            update_workspace = True
        if update_workspace:
            workspace.quantize_(tensor, noop_flag=skip_update_flag)
        return workspace, None
    out = quantizer.quantize(tensor)
    return out, out


class Linear:
    """``te.Linear`` forward with FP8 weight caching (no bias)."""

    def __init__(self, device, fp8_state, variant):
        self.weight = randn(OUT, IN, gen=generator(3271), device=device, scale=0.5)
        self.weight_quantizer = Float8Quantizer(device, variant)
        self._fp8_workspaces = {}
        self.fp8_state = fp8_state

    def __call__(self, inp, is_first_microbatch=None):
        skip_fp8_weight_update = None
        if self.fp8_state.fp8_graph_capturing():
            skip_fp8_weight_update = self.fp8_state.skip_fp8_weight_update_tensor
        if skip_fp8_weight_update is not None:
            is_first_microbatch = False
        update_workspace = is_first_microbatch is None or is_first_microbatch
        weight_fp8, new_ws = quantize_weight(tensor=self.weight, quantizer=self.weight_quantizer,
                                             workspace=self._fp8_workspaces.get("weight"),
                                             update_workspace=update_workspace,
                                             skip_update_flag=skip_fp8_weight_update)
        if new_ws is not None:
            self._fp8_workspaces["weight"] = new_ws
        return inp @ weight_fp8.dequantize().t()


def reduce_and_update_fp8_tensors(module):
    q = module.weight_quantizer
    amax = q.amax_history.amax()
    q.scale.copy_(torch.where(amax > 0, FP8_MAX / amax, q.scale))
    q.amax_history.copy_(torch.roll(q.amax_history, -1))
    q.amax_history[0] = 0.0


def make_graphed_callables(module, sample_input, fp8_state):
    """``te.make_graphed_callables(module, ..., cache_quantized_params=True)``, forward graph only."""
    q = module.weight_quantizer
    saved = (q.scale.clone(), q.amax_history.clone())
    fp8_state.set_skip_fp8_weight_update_tensor(False)
    static_input = sample_input
    events.static_buffers("te.make_graphed_callables", {
        "static_input": static_input, "skip_fp8_weight_update": fp8_state.skip_fp8_weight_update_tensor})
    events.persistent_state("fp8_meta", {"weight.scale": q.scale, "weight.amax_history": q.amax_history})
    fp8_state.graph_capturing = True
    for _ in range(NUM_WARMUP_ITERS):
        with events.warmup():
            module(static_input)
    fwd_graph = new_graph(static_input.device)
    with graph(fwd_graph, name="fwd"):
        static_output = module(static_input)
    fp8_state.graph_capturing = False
    q.scale.copy_(saved[0])
    q.amax_history.copy_(saved[1])

    def functionalized(inp, is_first_microbatch):
        fp8_state.set_skip_fp8_weight_update_tensor(not is_first_microbatch)   # Graphed.forward
        static_input.copy_(inp)
        events.serve(fwd_graph, inp.shape[0], inp.shape[0], outputs=static_output,
                     eager=lambda: module(static_input, is_first_microbatch=is_first_microbatch))
        fwd_graph.replay()
        events.handed_out(fwd_graph, static_output)
        return static_output

    return functionalized


def run(variant: str, device: str = "cpu"):
    gen = generator(32710)
    inputs = [[randn(TOKENS, IN, gen=gen, device=device) for _ in range(MICROBATCHES)] for _ in range(STEPS)]
    grads = [randn(OUT, IN, gen=gen, device=device) for _ in range(STEPS)]

    def train(graphed: bool):
        fp8_state = FP8GlobalStateManager(device)
        module = Linear(device, fp8_state, variant)
        call = lambda x, first: module(x, is_first_microbatch=first)   # noqa: E731
        if graphed:
            call = make_graphed_callables(module, torch.zeros_like(inputs[0][0]), fp8_state)
        outs = []
        for step in range(STEPS):
            for mb in range(MICROBATCHES):
                outs.append(call(inputs[step][mb], mb == 0).clone())
                reduce_and_update_fp8_tensors(module)
            module.weight.sub_(LR * grads[step])                      # optimizer.step()
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: train(True), lambda: train(False))
