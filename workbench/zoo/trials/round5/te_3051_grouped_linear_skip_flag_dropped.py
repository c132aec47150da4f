"""GroupedLinear drops the FP8 graph-capture skip flag: the graphed experts re-quantize their weights every microbatch.

Upstream: https://github.com/NVIDIA/TransformerEngine/issues/3051 ("[PyTorch] GroupedLinear does not propagate
skip_fp8_weight_update during FP8 CUDA graph capture"), fixed by
https://github.com/NVIDIA/TransformerEngine/pull/3052 (commit 1ea48eb75) and #3065 (which added the regression
test ``test_make_graphed_callables_grouped_linear_with_fp8_weight_caching``).
Symptom: MoE training (Nemotron-3-Nano 30B-A3B) with FP8 weight caching and TE CUDA graphs: the graphed expert
layers do not behave as eager ones (expert and router gradients much smaller than without graph replay);
graphed and eager runs of ``GroupedLinear`` with ``cache_quantized_params=True`` differ (TE main/v2.15, May 2026).
Mechanism: with weight caching, whether a microbatch re-quantizes its FP8 weights (``is_first_microbatch``) is
a Python decision, which under a CUDA graph must become a device flag: the graphed callable fills
``skip_fp8_weight_update`` before every replay and the quantize kernel reads it as its noop flag. ``Linear``
fetches that flag while the graph is captured and forces the cached-weight path, but ``GroupedLinear.forward``
passed ``None`` and kept the capture-time ``is_first_microbatch`` (``None``: the sample kwargs do not carry it),
so its graph recorded the uncached branch, a fresh quantization of every expert weight on every replay. From a
step's second microbatch on, the graph thus quantizes with the scale the delayed-scaling recipe has updated
since, while eager reuses the weights quantized at the step's first microbatch.
Doctor: warmup-divergence, at ``forward`` (``GroupedLinear.forward``: the capture-time choice of the uncached,
always-quantize branch).
Fix (upstream): when ``FP8GlobalStateManager.fp8_graph_capturing()``, read
``quantization_state.skip_fp8_weight_update_tensor``, force ``is_first_microbatch = False`` and pass the flag to
``_GroupedLinear.forward``, as ``Linear`` does: the graph updates the cached FP8 weights in place, gated by the flag.
"""
from __future__ import annotations

import torch

from workbench.engine import events, graph, new_graph
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/NVIDIA/TransformerEngine/issues/3051"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "forward"
SYMPTOM = "graphed experts re-quantize weights each microbatch with the updated scale instead of reusing the cache"
NUM_GEMMS, IN, OUT, TOKENS_PER_GEMM = 2, 4, 3, 2
M_SPLITS = [TOKENS_PER_GEMM] * NUM_GEMMS
FP8_MAX, AMAX_HISTORY_LEN = 8.0, 4          # a coarse grid stands in for E4M3
STEPS, MICROBATCHES, NUM_WARMUP_ITERS, LR = 3, 2, 3, 0.5


class FP8GlobalStateManager:
    """The pieces of TE's global FP8 state this program needs (one instance per run)."""

    def __init__(self, device):
        self.device = device
        self.graph_capturing = False
        self.skip_fp8_weight_update_tensor = None       # quantization_state.skip_fp8_weight_update_tensor

    def fp8_graph_capturing(self) -> bool:
        return self.graph_capturing

    def set_skip_fp8_weight_update_tensor(self, skip: bool) -> None:
        if self.skip_fp8_weight_update_tensor is None:
            self.skip_fp8_weight_update_tensor = torch.empty(1, device=self.device)
        self.skip_fp8_weight_update_tensor.fill_(float(skip))


def _cast(tensor, scale):
    return torch.clamp(torch.round(tensor * scale), -FP8_MAX, FP8_MAX)


class Float8Quantizer:
    """Delayed scaling: quantize with ``scale``; record the tensor's amax in ``amax_history[0]``."""

    def __init__(self, device):
        self.scale = torch.ones(1, device=device)
        self.amax_history = torch.zeros(AMAX_HISTORY_LEN, device=device)

    def quantize(self, tensor):
        self.amax_history[0:1].copy_(tensor.abs().amax().reshape(1))
        return Float8TensorStorage(_cast(tensor, self.scale), self.scale.reciprocal(), self)


class Float8TensorStorage:
    def __init__(self, data, scale_inv, quantizer):
        self._data, self._scale_inv, self._quantizer = data, scale_inv, quantizer

    def quantize_(self, tensor, noop_flag=None):
        """Re-quantize in place; a set ``noop_flag`` (read on the device) leaves data, scale and amax as they are."""
        q = self._quantizer
        data, scale_inv, amax = _cast(tensor, q.scale), q.scale.reciprocal(), tensor.abs().amax().reshape(1)
        if noop_flag is None:
            self._data.copy_(data)
            self._scale_inv.copy_(scale_inv)
            q.amax_history[0:1].copy_(amax)
            return
        keep = noop_flag > 0
        self._data.copy_(torch.where(keep, self._data, data))
        self._scale_inv.copy_(torch.where(keep, self._scale_inv, scale_inv))
        q.amax_history[0:1].copy_(torch.where(keep, q.amax_history[0:1], amax))

    def dequantize(self):
        return self._data * self._scale_inv


def quantize_weight(*, tensor, quantizer, workspace=None, update_workspace=True, skip_update_flag=None,
                    cache=False):
    """Quantize a weight tensor, optionally reusing a cached workspace."""
    if workspace is not None:                          # cache hit: update in place
        if skip_update_flag is not None:
            update_workspace = True
        if update_workspace:
            workspace.quantize_(tensor, noop_flag=skip_update_flag)
        return workspace, None
    out = quantizer.quantize(tensor)                   # cache miss: a new workspace
    return (out, out) if cache else (out, None)


class _GroupedLinear:
    @staticmethod
    def forward(inp, m_splits, weights, weight_quantizers, is_first_microbatch, weight_workspaces, cache_weight,
                skip_fp8_weight_update):
        update_ws = is_first_microbatch is None or is_first_microbatch
        weights_fp8, new_workspaces = [], []
        for idx, weight in enumerate(weights):
            weight_fp8, new_ws = quantize_weight(tensor=weight, quantizer=weight_quantizers[idx],
                                                 workspace=weight_workspaces[idx], update_workspace=update_ws,
                                                 skip_update_flag=skip_fp8_weight_update, cache=cache_weight)
            weights_fp8.append(weight_fp8)
            new_workspaces.append(new_ws)
        outs = [x @ w.dequantize().t() for x, w in zip(torch.split(inp, m_splits), weights_fp8)]
        return torch.cat(outs), new_workspaces


class GroupedLinear:
    def __init__(self, device, fp8_state, variant):
        gen = generator(3051)
        self.weights = [randn(OUT, IN, gen=gen, device=device, scale=0.5) for _ in range(NUM_GEMMS)]
        self.weight_quantizers = [Float8Quantizer(device) for _ in range(NUM_GEMMS)]
        self._fp8_workspaces = {}
        self.fp8_state, self.variant = fp8_state, variant

    def __call__(self, inp, m_splits, is_first_microbatch=None):
        return self.forward(inp, m_splits, is_first_microbatch)

    def forward(self, inp, m_splits, is_first_microbatch=None):
        skip_fp8_weight_update = None
        if self.variant == "fix":                      # #3052 / #3065, as Linear does
            if self.fp8_state.fp8_graph_capturing():
                skip_fp8_weight_update = self.fp8_state.skip_fp8_weight_update_tensor
            if skip_fp8_weight_update is not None:
                is_first_microbatch = False
        cache_weight = is_first_microbatch is not None
        weight_workspaces = ([self._fp8_workspaces.get(f"weight{i}") for i in range(NUM_GEMMS)] if cache_weight
                             else [None] * NUM_GEMMS)
        out, new_workspaces = _GroupedLinear.forward(inp, m_splits, self.weights, self.weight_quantizers,
                                                     is_first_microbatch, weight_workspaces, cache_weight,
                                                     skip_fp8_weight_update)   # bug: a hardcoded None
        if cache_weight:
            for i, ws in enumerate(new_workspaces):
                if ws is not None:
                    self._fp8_workspaces[f"weight{i}"] = ws
        return out


def reduce_and_update_fp8_tensors(module):
    """The delayed-scaling recipe step after each microbatch: scale from the amax history, then roll it."""
    for q in module.weight_quantizers:
        amax = q.amax_history.amax()
        q.scale.copy_(torch.where(amax > 0, FP8_MAX / amax, q.scale))
        q.amax_history.copy_(torch.roll(q.amax_history, -1))
        q.amax_history[0] = 0.0


def make_graphed_callables(module, sample_args, fp8_state, *, num_warmup_iters, cache_quantized_params):
    """``te.make_graphed_callables`` for one module (forward graph only)."""
    saved_fp8_tensors = [(q.scale.clone(), q.amax_history.clone()) for q in module.weight_quantizers]
    if cache_quantized_params:
        fp8_state.set_skip_fp8_weight_update_tensor(False)   # flag that controls FP8 weight updates
    static_input = sample_args[0]
    events.static_buffers("te.make_graphed_callables", {
        "static_input": static_input, "skip_fp8_weight_update": fp8_state.skip_fp8_weight_update_tensor})
    events.persistent_state("fp8_meta", {
        **{f"weight{i}.scale": q.scale for i, q in enumerate(module.weight_quantizers)},
        **{f"weight{i}.amax_history": q.amax_history for i, q in enumerate(module.weight_quantizers)}})
    fp8_state.graph_capturing = True
    for _ in range(num_warmup_iters):
        with events.warmup():
            module(static_input, M_SPLITS)              # sample kwargs: none
    fwd_graph = new_graph(static_input.device)
    with graph(fwd_graph, name="fwd"):
        static_output = module(static_input, M_SPLITS)
    fp8_state.graph_capturing = False
    for q, (scale, amax_history) in zip(module.weight_quantizers, saved_fp8_tensors):   # restore FP8 state
        q.scale.copy_(scale)
        q.amax_history.copy_(amax_history)

    def functionalized(inp, is_first_microbatch):
        if cache_quantized_params:                      # decide whether to update FP8 weights
            fp8_state.set_skip_fp8_weight_update_tensor(not is_first_microbatch)
        static_input.copy_(inp)
        events.serve(fwd_graph, inp.shape[0], inp.shape[0], outputs=static_output,
                     eager=lambda: module(static_input, M_SPLITS, is_first_microbatch=is_first_microbatch))
        fwd_graph.replay()
        events.handed_out(fwd_graph, static_output)
        return static_output

    return functionalized


def run(variant: str, device: str = "cpu"):
    gen = generator(30510)
    inputs = [[randn(NUM_GEMMS * TOKENS_PER_GEMM, IN, gen=gen, device=device) for _ in range(MICROBATCHES)]
              for _ in range(STEPS)]
    grads = [[randn(OUT, IN, gen=gen, device=device) for _ in range(NUM_GEMMS)] for _ in range(STEPS)]

    def train(graphed: bool):
        fp8_state = FP8GlobalStateManager(device)
        module = GroupedLinear(device, fp8_state, variant)
        call = lambda x, first: module(x, M_SPLITS, is_first_microbatch=first)   # noqa: E731
        if graphed:
            call = make_graphed_callables(module, (torch.zeros_like(inputs[0][0]),), fp8_state,
                                          num_warmup_iters=NUM_WARMUP_ITERS, cache_quantized_params=True)
        outs = []
        for step in range(STEPS):
            for mb in range(MICROBATCHES):
                outs.append(call(inputs[step][mb], mb == 0).clone())
                reduce_and_update_fp8_tensors(module)
            for w, g in zip(module.weights, grads[step]):   # optimizer.step()
                w.sub_(LR * g)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: train(True), lambda: train(False))
