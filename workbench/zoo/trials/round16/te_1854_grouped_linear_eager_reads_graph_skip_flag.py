"""An eager ``GroupedLinear`` reads the CUDA graphs' FP8 weight-update skip flag and keeps stale FP8 weights.

Upstream: https://github.com/NVIDIA/TransformerEngine/pull/1854 ("[PyTorch] Get `skip_fp8_weight_update`
only in CUDA Graph Capturing").
Symptom: FP8 training with TE CUDA graphs and ``fp8_weight_caching=True`` for the graphed layers while MoE
experts (``GroupedLinear``) run eagerly: once the graphs exist, the eager experts stop re-casting their
weights whenever the graphs' last replay was a non-first micro-batch, so an eager pass after the optimizer
step (evaluation, with ``is_first_microbatch=None``) multiplies by the FP8 copies of the *previous* weights
(TE 2.4, June 2025; ``Linear`` already had the guard, ``GroupedLinear`` did not).
Mechanism: ``make_graphed_callables(..., fp8_weight_caching=True)`` creates one global device flag,
``FP8GlobalStateManager.skip_fp8_weight_update_tensor``, that every graphed call fills with
``not is_first_microbatch`` before its replay; inside the graphs the FP8 cast of each weight takes it as
``noop_flag`` (the flag, not Python, decides whether the cached FP8 weight is refreshed). ``GroupedLinear.forward``
fetched that tensor unconditionally, also outside any capture: after the first graph capture it is never
None, so every eager call forces ``is_first_microbatch = False`` and casts its weights with
``noop_flag=skip_fp8_weight_update``, a static input of the graphs that this eager step did not write. It
holds what the last graphed call left there (1: skip), so the weight cache is not refreshed.
Doctor: stale-input, at ``forward`` (``GroupedLinear.forward`` reading the graphs' flag outside capture).
Fix (upstream): read the flag only while ``FP8GlobalStateManager.fp8_graph_capturing()``; eager calls keep
``skip_fp8_weight_update = None`` and their own ``is_first_microbatch``.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TransformerEngine/pull/1854"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "forward"
SYMPTOM = "eager GroupedLinear after the optimizer step computes with the FP8 copies of the old weights"
HIDDEN, TOKENS, NUM_GEMMS, MICROBATCHES, STEPS, LR = 4, 4, 2, 2, 2, 0.3
FP8_SCALE = 8.0                       # the per-tensor scale of the emulated FP8 cast (a coarse grid)


def _cast_to_fp8(tensor):
    """``tex.quantize`` to FP8 and back: values on a grid of 1/FP8_SCALE."""
    return torch.round(tensor * FP8_SCALE) / FP8_SCALE


class Float8Tensor:
    """The cached FP8 weight workspace: its data is overwritten in place by ``quantize_``."""

    def __init__(self, tensor):
        self._data = _cast_to_fp8(tensor)

    def quantize_(self, tensor, noop_flag=None):
        # the cast kernel exits early when *noop_flag == 1 (a device flag, so graphs can reuse the launch)
        new = _cast_to_fp8(tensor)
        if noop_flag is not None:
            new = torch.where(noop_flag.bool(), self._data, new)
        self._data.copy_(new)

    def dequantize(self):
        return self._data


class FP8GlobalStateManager:
    FP8_GRAPH_CAPTURING = False
    skip_fp8_weight_update_tensor = None

    @classmethod
    def fp8_graph_capturing(cls) -> bool:
        return cls.FP8_GRAPH_CAPTURING

    @classmethod
    def set_skip_fp8_weight_update_tensor(cls, skip: bool, device) -> None:
        if cls.skip_fp8_weight_update_tensor is None:
            cls.skip_fp8_weight_update_tensor = torch.empty(1, dtype=torch.float32, device=device)
        cls.skip_fp8_weight_update_tensor.fill_(skip)

    @classmethod
    def get_skip_fp8_weight_update_tensor(cls):
        return cls.skip_fp8_weight_update_tensor

    @classmethod
    def reset(cls):
        cls.FP8_GRAPH_CAPTURING = False
        cls.skip_fp8_weight_update_tensor = None


class TransformerEngineBaseModule:
    def __init__(self):
        self._fp8_workspaces = {}

    def get_weight_workspace(self, *, tensor, cache_name=None, update_workspace=True, skip_update_flag=None):
        """Get FP8 workspace buffer and maybe update its values (``base.py``)."""
        out = self._fp8_workspaces.get(cache_name) if cache_name is not None else None
        if out is None:
            out = Float8Tensor(tensor)
            if cache_name is not None:
                self._fp8_workspaces[cache_name] = out
            return out
        # Update workspace if needed
        if skip_update_flag is not None:
            update_workspace = True
        if update_workspace:
            out.quantize_(tensor, noop_flag=skip_update_flag)
        return out


class Linear(TransformerEngineBaseModule):
    """The graphed layer's projection (TE ``Linear``: it already reads the flag only during capture)."""

    def __init__(self, weight):
        super().__init__()
        self.weight = weight


def linear_forward(module, inp, is_first_microbatch=None):
    """``Linear.forward``."""
    if FP8GlobalStateManager.fp8_graph_capturing():
        skip_fp8_weight_update = FP8GlobalStateManager.get_skip_fp8_weight_update_tensor()
    else:
        skip_fp8_weight_update = None
    if skip_fp8_weight_update is not None:
        is_first_microbatch = False
    update_workspace = is_first_microbatch is None or is_first_microbatch
    weight_fp8 = module.get_weight_workspace(tensor=module.weight,
                                             cache_name=(None if is_first_microbatch is None else "weight"),
                                             update_workspace=update_workspace,
                                             skip_update_flag=skip_fp8_weight_update)
    return inp @ weight_fp8.dequantize().t()


class GroupedLinear(TransformerEngineBaseModule):
    """The MoE experts' grouped GEMM, run eagerly (token counts per expert vary)."""

    def __init__(self, weights, variant):
        super().__init__()
        self.weights = weights
        self.variant = variant

    def forward(self, inp, m_splits, is_first_microbatch=None):
        if self.variant == "bug":
            skip_fp8_weight_update = FP8GlobalStateManager.get_skip_fp8_weight_update_tensor()
        elif FP8GlobalStateManager.fp8_graph_capturing():
            skip_fp8_weight_update = FP8GlobalStateManager.get_skip_fp8_weight_update_tensor()
        else:
            skip_fp8_weight_update = None
        if skip_fp8_weight_update is not None:
            is_first_microbatch = False

        update_workspace = is_first_microbatch is None or is_first_microbatch
        outs = []
        for i, x in enumerate(torch.split(inp, m_splits)):
            weight_fp8 = self.get_weight_workspace(tensor=self.weights[i],
                                                   cache_name=(None if is_first_microbatch is None else f"weight{i}"),
                                                   update_workspace=update_workspace,
                                                   skip_update_flag=skip_fp8_weight_update)
            outs.append(x @ weight_fp8.dequantize().t())
        return torch.cat(outs)


def make_graphed_callables(fn, sample_input, *, device, fp8_weight_caching=True):
    """TE ``make_graphed_callables`` for one callable: warm up and capture inside the FP8 graph-capturing
    state; every call sets the skip flag from ``is_first_microbatch`` and replays."""
    if fp8_weight_caching:
        # Initialize flag that controls FP8 weight updates
        FP8GlobalStateManager.set_skip_fp8_weight_update_tensor(False, device)
    static_input = sample_input.clone()
    FP8GlobalStateManager.FP8_GRAPH_CAPTURING = True
    try:
        g, static_output = capture(lambda: fn(static_input, is_first_microbatch=False), device=device,
                                   static={"static_input": static_input,
                                           "skip_fp8_weight_update": FP8GlobalStateManager.skip_fp8_weight_update_tensor},
                                   owner="TE make_graphed_callables (fp8_weight_caching)")
    finally:
        FP8GlobalStateManager.FP8_GRAPH_CAPTURING = False

    def functionalized(inp, is_first_microbatch):
        # Decide whether to update FP8 weights
        FP8GlobalStateManager.set_skip_fp8_weight_update_tensor(not is_first_microbatch, device)
        static_input.copy_(inp)
        return replay(g, static_output).clone()

    return functionalized


def run(variant: str, device: str = "cpu"):
    gen = generator(1854)
    w_attn = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
    w_experts = [randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5) for _ in range(NUM_GEMMS)]
    data = [[randn(TOKENS, HIDDEN, gen=gen, device=device) for _ in range(MICROBATCHES)] for _ in range(STEPS)]
    updates = [[randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5) for _ in range(1 + NUM_GEMMS)]
               for _ in range(STEPS)]
    eval_input = randn(TOKENS, HIDDEN, gen=gen, device=device)
    m_splits = [TOKENS // 2, TOKENS - TOKENS // 2]

    def serve(graphed: bool):
        FP8GlobalStateManager.reset()
        proj = Linear(w_attn.clone())
        experts = GroupedLinear([w.clone() for w in w_experts], variant)

        def attention(hidden, is_first_microbatch):
            return torch.tanh(linear_forward(proj, hidden, is_first_microbatch=is_first_microbatch))

        if graphed:
            graphed_attention = make_graphed_callables(attention, data[0][0], device=device)
        else:
            graphed_attention = attention
        outs = []
        try:
            for step in range(STEPS):
                for mb in range(MICROBATCHES):
                    is_first = mb == 0
                    h = graphed_attention(data[step][mb], is_first_microbatch=is_first)
                    outs.append(experts.forward(h, m_splits, is_first_microbatch=is_first))
                # optimizer step: the weights change in place (their FP8 copies must be re-cast)
                proj.weight.sub_(LR * updates[step][0])
                for i, w in enumerate(experts.weights):
                    w.sub_(LR * updates[step][1 + i])
            # evaluation: eager forward (graphs are for training), no weight caching
            h = attention(eval_input, is_first_microbatch=None)
            outs.append(experts.forward(h, m_splits, is_first_microbatch=None))
        finally:
            FP8GlobalStateManager.reset()
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
