"""The CUDA-graph runner captures every layer under FP8, also the first/last layers meant to stay BF16.

Upstream: https://github.com/NVIDIA/Megatron-LM/commit/c86819f66551af1864983e622ca56a0597f8a52f
(ADLR/megatron-lm!3746, "Fix cuda graph with first/last layer bf16 by calling the right fp8_context").
Symptom: with ``--fp8`` plus ``--first-last-layers-bf16`` and Megatron's local CUDA graphs
(``_CudaGraphRunner``), generated tokens and logprobs differ from the same model run without graphs;
the fix changed the golden values of ``gpt_static_inference_tp1_pp1_583m_fp8_cudagraphs`` (Megatron
core, summer 2025). Nothing raises: the edge layers silently run FP8 GEMMs.
Mechanism: eager execution enters ``get_fp8_context(config, layer_number - 1)`` per layer, which returns
a ``nullcontext`` for the first/last layers when ``first_last_layers_bf16`` is set. The graph runner
instead had its own ``get_fp8_context()`` returning ``fp8_autocast(enabled=True, ...)`` for every layer
whenever FP8 was on. The runner warms up and captures each layer inside that context, so TE's
"is FP8 enabled?" branch is decided at capture: the graph of an edge layer records the FP8 cast of its
input and weight, and every replay repeats it, while the eager step of the same layer decides BF16.
Doctor: warmup-divergence, at ``get_fp8_context`` (the runner's capture-time precision decision that
replays keep while eager decides otherwise for the edge layers).
Fix (upstream): ``_CudaGraphRunner.get_fp8_context`` returns
``megatron.core.fp8_utils.get_fp8_context(self.base_module.config, self.base_module.layer_number - 1)``,
the same per-layer context the eager path uses.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/Megatron-LM/commit/c86819f66551af1864983e622ca56a0597f8a52f"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "get_fp8_context"
SYMPTOM = "graphed first/last layers run FP8 GEMMs that eager runs in BF16: different logits, no error"
HIDDEN, TOKENS, NUM_LAYERS, STEPS = 4, 3, 3, 3


class FP8GlobalStateManager:
    """TE's global FP8 switch (``fp8_autocast`` sets it; modules read it in forward)."""

    FP8_ENABLED = False

    @classmethod
    def is_fp8_enabled(cls):
        return cls.FP8_ENABLED


@contextlib.contextmanager
def fp8_autocast(enabled=True, calibrating=False, fp8_recipe=None, _graph=False):
    previous = FP8GlobalStateManager.FP8_ENABLED
    FP8GlobalStateManager.FP8_ENABLED = enabled
    try:
        yield
    finally:
        FP8GlobalStateManager.FP8_ENABLED = previous


@dataclasses.dataclass
class TransformerConfig:
    num_layers: int = NUM_LAYERS
    fp8: str | None = "hybrid"
    first_last_layers_bf16: bool = True
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1


def get_fp8_context(config, layer_no=-1):
    """``megatron.core.fp8_utils.get_fp8_context``: BF16 (no FP8 context) for the edge layers."""
    if not config.fp8:
        return contextlib.nullcontext()
    if config.first_last_layers_bf16 and layer_no >= 0 and (
            layer_no < config.num_layers_at_start_in_bf16
            or layer_no >= config.num_layers - config.num_layers_at_end_in_bf16):
        return contextlib.nullcontext()
    return fp8_autocast(enabled=True, calibrating=False, fp8_recipe=config.fp8)


def cast_to_fp8(t):
    """Per-tensor scaled cast to a coarse grid (stands for the E4M3 quantize kernel)."""
    scale = 4.0 / t.abs().amax().clamp(min=1e-6)
    return torch.round(t * scale) / scale


class TELinear(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)

    def forward(self, x):
        w = self.weight
        if FP8GlobalStateManager.is_fp8_enabled():       # decided when the code runs: at capture, once
            x, w = cast_to_fp8(x), cast_to_fp8(w)
        return x @ w.t()


class TransformerLayer(torch.nn.Module):
    def __init__(self, config, layer_number, weight):
        super().__init__()
        self.config = config
        self.layer_number = layer_number                 # 1-based, as in Megatron
        self.linear_fc = TELinear(weight)

    def forward(self, hidden_states):
        return hidden_states + torch.tanh(self.linear_fc(hidden_states))


class _CudaGraphRunner:
    """One layer's graph (``megatron/core/transformer/cuda_graphs.py``), captured lazily."""

    def __init__(self, base_module, device, fixed):
        self.base_module = base_module
        self.fp8_enabled = base_module.config.fp8 is not None
        self.fp8_recipe = base_module.config.fp8
        self.device = device
        self.fixed = fixed
        self.static_input = torch.zeros(TOKENS, HIDDEN, device=device)
        self.graph = None
        self.static_output = None

    def get_fp8_context(self):
        """Return a new fp8 context in cudagraph mode."""
        if self.fixed:
            return get_fp8_context(self.base_module.config, self.base_module.layer_number - 1)
        if self.fp8_enabled:
            return fp8_autocast(enabled=True, calibrating=False, fp8_recipe=self.fp8_recipe, _graph=True)
        return contextlib.nullcontext()

    def create_fwd_graph(self):
        def fwd():
            with self.get_fp8_context():
                return self.base_module(self.static_input)
        self.graph, self.static_output = capture(
            fwd, device=self.device, static={"hidden_states": self.static_input},
            owner=f"_CudaGraphRunner (layer {self.base_module.layer_number})",
            name=f"layer {self.base_module.layer_number}")

    def __call__(self, hidden_states):
        self.static_input.copy_(hidden_states)
        if self.graph is None:
            self.create_fwd_graph()
        return replay(self.graph, self.static_output)


def run(variant: str, device: str = "cpu"):
    gen = generator(3746)
    weights = [randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.7) for _ in range(NUM_LAYERS)]
    batches = [randn(TOKENS, HIDDEN, gen=gen, device=device) for _ in range(STEPS)]
    config = TransformerConfig()

    def build():
        return [TransformerLayer(config, i + 1, weights[i].clone()) for i in range(NUM_LAYERS)]

    def eager():
        layers, outs = build(), []
        with torch.no_grad():
            for x in batches:
                h = x
                for layer in layers:
                    with get_fp8_context(config, layer.layer_number - 1):
                        h = layer(h)
                outs.append(h.clone())
        return outs

    def served():
        layers = build()
        runners = [_CudaGraphRunner(layer, device, fixed=(variant == "fix")) for layer in layers]
        outs = []
        with torch.no_grad():
            for x in batches:
                h = x
                for runner in runners:
                    h = runner(h).clone()
                outs.append(h)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
