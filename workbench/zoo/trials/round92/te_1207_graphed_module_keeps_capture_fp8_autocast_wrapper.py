"""Transformer Engine's make_graphed_callables leaves the module's forward wrapped in the capture-time fp8_autocast, so the non-graphed module keeps running in FP8 after an fp8_autocast(enabled=False).

Upstream: https://github.com/NVIDIA/TransformerEngine/issues/1207 ("No option to change FP8 status in graphed module
after using make_graphed_callables", NVIDIA/TransformerEngine, opened 2024-09-26, closed 2026-06-30 "as fixed for the
_order/non-graphed-module case by #1234"). Fix: https://github.com/NVIDIA/TransformerEngine/pull/1234 ("Optimize CUDA
Graph memory, FP8 wrapper, and uneven PP support", merged 2025-07-11 as commit 648918996; its part "Wrap
_make_graphed_callables with fp8"). Read: the issue (the pseudocode ``te.make_graphed_callables(module, sample_args,
fp8_enabled=True, _order=[1,-1])`` then ``with te.fp8_autocast(enabled=False): module(arg)  # Still executed in FP8!``)
and the closing comment; the diff of ``transformer_engine/pytorch/graph.py`` in that commit and the file before and
after it: ``make_graphed_callables`` with its inner ``wrap_autocast`` (before: ``old_forward = block.forward`` and
``block.forward = forward_func``, kept for ever; after: ``old_call_funcs[block_cls] = block_cls.__call__`` and
``block_cls.__call__ = call_func`` for the capture only, then "Remove FP8 wrapper": ``module_cls.__call__ = old_call``
after ``_make_graphed_callables`` returns), and ``_make_graphed_callables`` (warmup, capture, ``functionalized`` copying
user args into the static input surface and replaying, ``make_graphed_forward``/``new_fwd``, ``func.forward = forward``
only when ``_order is None``). Reconstructed: the FP8 arithmetic (a per-tensor current-scaling E4M3 round trip stands in
for TE's quantizers and FP8 GEMM) and the module.
Symptom: once a module has been passed to make_graphed_callables with fp8_enabled=True, every later eager call of the
module runs in FP8 with the capture-time recipe, whatever fp8_autocast the caller is in: a high-precision pass of the
non-graphed module (Megatron's interleaved-pipeline ``_order`` path keeps the module callable eagerly) silently gets
FP8-quantized results.
Mechanism: to capture in FP8, ``wrap_autocast`` replaced ``block.forward`` with a closure that enters
``fp8_autocast(enabled=fp8_enabled, fp8_recipe=...)`` (the values given at capture) around the old forward. With
``_order`` the graphed callable is returned separately and the module keeps that wrapped forward, so the decision made
for the capture (FP8 on, this recipe) outlives the capture: an eager call under ``fp8_autocast(enabled=False)`` enters
the wrapper's ``fp8_autocast(enabled=True)`` and quantizes inputs and weights. Without graphs the module's forward
follows the caller's autocast.
Doctor: warmup-divergence, at wrap_autocast. The capture decided FP8 (and installed it on the module); the graphed
replays rightly reuse it, but the eager steps that follow keep it too while an eager step without graphs decides
otherwise (FP8 off).
Fix (upstream): wrap the module class's ``__call__`` only while ``_make_graphed_callables`` warms up and captures, and
restore it afterwards, so the module's own forward is untouched.
Modelled: ``make_graphed_callables`` with ``wrap_autocast`` (both forms), ``_make_graphed_callables`` (forward graph
only: warmup, capture, ``functionalized`` copying into the static input surface, ``make_graphed_forward``/``new_fwd``,
the ``_order`` return path), ``fp8_autocast`` and ``FP8GlobalStateManager`` (enabled flag and recipe),
``Float8CurrentScaling`` (recipe stand-in) and a ``Linear``/``LayerNormMLP`` stand-in whose forward casts input and
weight to E4M3 when FP8 is enabled (hidden 8, ffn 16, float32). The backward graph TE also captures is left out.
Workload: one LayerNormMLP is graphed with ``fp8_enabled=True, _order=[1, -1]``; then four FP8 microbatches run through
the graphed callable, and after the second and the fourth a high-precision evaluation pass calls the module itself under
``fp8_autocast(enabled=False)``. The graphed microbatches equal eager FP8 (error 0); the bug's two evaluation passes are
FP8-quantized (max error 0.52 on outputs up to 6.5). The fix equals eager.
"""
from __future__ import annotations

import contextlib

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TransformerEngine/issues/1207"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "wrap_autocast"
SYMPTOM = ("after make_graphed_callables(fp8_enabled=True) the module's forward stays wrapped in the capture-time "
           "fp8_autocast, so a later eager call under fp8_autocast(enabled=False) still runs in FP8")

HIDDEN, FFN, TOKENS = 8, 16, 4
E4M3_MAX = 448.0

_variant = "bug"


# --- transformer_engine/pytorch/fp8.py (stand-in) ---------------------------------------------------------------------

class Float8CurrentScaling:
    """Recipe stand-in: per-tensor current scaling to E4M3."""

    fp8_format = "E4M3"


class FP8GlobalStateManager:
    FP8_ENABLED = False
    FP8_CALIBRATION = False
    FP8_RECIPE = None
    FP8_DISTRIBUTED_GROUP = None
    FP8_GRAPH_CAPTURING = False

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        return cls.FP8_ENABLED

    @classmethod
    def get_fp8_recipe(cls):
        return cls.FP8_RECIPE


@contextlib.contextmanager
def fp8_autocast(enabled=True, calibrating=False, fp8_recipe=None, fp8_group=None, _graph=False):
    state = FP8GlobalStateManager
    saved = (state.FP8_ENABLED, state.FP8_CALIBRATION, state.FP8_RECIPE, state.FP8_DISTRIBUTED_GROUP,
             state.FP8_GRAPH_CAPTURING)
    state.FP8_ENABLED, state.FP8_CALIBRATION = enabled, calibrating
    state.FP8_RECIPE = Float8CurrentScaling() if fp8_recipe is None else fp8_recipe
    state.FP8_DISTRIBUTED_GROUP, state.FP8_GRAPH_CAPTURING = fp8_group, _graph
    try:
        yield
    finally:
        (state.FP8_ENABLED, state.FP8_CALIBRATION, state.FP8_RECIPE, state.FP8_DISTRIBUTED_GROUP,
         state.FP8_GRAPH_CAPTURING) = saved


def cast_to_fp8(tensor: torch.Tensor) -> torch.Tensor:
    """Current scaling: scale from this tensor's amax, round trip through E4M3 (quantize, dequantize)."""
    amax = tensor.detach().abs().amax().clamp_min(1e-12)
    scale = E4M3_MAX / amax
    return (tensor * scale).to(torch.float8_e4m3fn).to(tensor.dtype) / scale


# --- transformer_engine/pytorch/module (stand-ins) --------------------------------------------------------------------

class Linear(torch.nn.Module):
    def __init__(self, in_features, out_features, gen, device):
        super().__init__()
        self.weight = torch.nn.Parameter(randn(out_features, in_features, gen=gen, device=device, scale=0.5))
        self.bias = torch.nn.Parameter(randn(out_features, gen=gen, device=device, scale=0.1))

    def forward(self, inp, is_first_microbatch=None):
        weight = self.weight
        if FP8GlobalStateManager.is_fp8_enabled():
            inp, weight = cast_to_fp8(inp), cast_to_fp8(weight)
        return inp @ weight.t() + self.bias


class LayerNormMLP(torch.nn.Module):
    def __init__(self, gen, device):
        super().__init__()
        self.layer_norm = torch.nn.LayerNorm(HIDDEN, device=device)
        self.fc1 = Linear(HIDDEN, FFN, gen, device)
        self.fc2 = Linear(FFN, HIDDEN, gen, device)

    def forward(self, inp, is_first_microbatch=None):
        h = torch.nn.functional.gelu(self.fc1(self.layer_norm(inp)))
        return self.fc2(h)


# --- transformer_engine/pytorch/graph.py ------------------------------------------------------------------------------

def _make_graphed_callables(callables, sample_args, num_warmup_iters=3, _order=None):
    """Forward graphs only: warm up, capture, and hand back callables that copy into the static inputs and replay."""
    ret = []
    for i, func in enumerate(callables):
        static_input_surface = sample_args[i]
        device = str(static_input_surface[0].device)
        fwd_graph, static_outputs = capture(lambda func=func, args=static_input_surface: func(*args), device=device,
                                            warmups=num_warmup_iters, name=f"graphed callable {i}",
                                            owner="make_graphed_callables",
                                            static={f"static_input_surface[{i}]": static_input_surface[0]})

        def functionalized(*user_args, static_input_surface=static_input_surface, fwd_graph=fwd_graph,
                           static_outputs=static_outputs):
            for static, new in zip(static_input_surface, user_args):
                if static.data_ptr() != new.data_ptr():
                    static.copy_(new)
            return replay(fwd_graph, static_outputs).detach()

        def make_graphed_forward(func, graph_training_state, graphed, orig_fwd):
            def new_fwd(*user_args, **user_kwargs):
                # If the module's training-or-eval state matches what we graphed,
                # run the graph, otherwise run the original forward method
                if func.training == graph_training_state:
                    return graphed(*user_args, **user_kwargs)
                return orig_fwd(*user_args, **user_kwargs)
            return new_fwd

        forward = make_graphed_forward(func, func.training, functionalized, func.forward)
        if _order is None:
            func.forward = forward
            ret.append(func)
        else:
            ret.append(forward)
    return ret


def make_graphed_callables(modules, sample_args, num_warmup_iters=3, fp8_enabled=False, fp8_calibrating=False,
                           fp8_recipe=None, fp8_group=None, _order=None):
    just_one_callable = not isinstance(modules, tuple)
    if just_one_callable:
        modules, sample_args = (modules,), (sample_args,)
    fp8_recipe = Float8CurrentScaling() if fp8_recipe is None else fp8_recipe

    # FP8 wrapper.
    old_call_funcs = {}

    def wrap_autocast(block):
        if _variant == "fix":
            block_cls = type(block)
            if block_cls in old_call_funcs:
                return
            old_call_funcs[block_cls] = block_cls.__call__

            # Wrap the original call function of the module class (for the capture only).
            def call_func(*args, **kwargs):
                with fp8_autocast(enabled=fp8_enabled, calibrating=fp8_calibrating, fp8_recipe=fp8_recipe,
                                  fp8_group=fp8_group, _graph=True):
                    outputs = old_call_funcs[block_cls](*args, **kwargs)
                return outputs

            block_cls.__call__ = call_func
        else:
            old_forward = block.forward

            def forward_func(*args, **kwargs):
                with fp8_autocast(enabled=fp8_enabled, calibrating=fp8_calibrating, fp8_recipe=fp8_recipe,
                                  fp8_group=fp8_group, _graph=True):
                    outputs = old_forward(*args, **kwargs)
                return outputs

            block.forward = forward_func

    forward_funcs = []
    for module in modules:
        assert isinstance(module, torch.nn.Module), f"Graphing for {type(module)} is not supported."
        wrap_autocast(module)
        forward_funcs.append(module)

    graphed_callables = _make_graphed_callables(forward_funcs, sample_args, num_warmup_iters=num_warmup_iters,
                                                _order=_order)

    # Remove FP8 wrapper.
    for module_cls, old_call in old_call_funcs.items():
        module_cls.__call__ = old_call

    return graphed_callables[0] if just_one_callable else tuple(graphed_callables)


# --- the workload -----------------------------------------------------------------------------------------------------

def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    recipe = Float8CurrentScaling()
    num_microbatches, eval_after = 4, (1, 3)

    def serve(use_cuda_graph):
        gen = generator(1207)
        module = LayerNormMLP(gen, device)
        data = generator(12070)
        microbatches = [randn(TOKENS, HIDDEN, gen=data, device=device) for _ in range(num_microbatches)]
        eval_batch = randn(TOKENS, HIDDEN, gen=data, device=device)
        outs = []
        with torch.no_grad():
            if use_cuda_graph:
                sample = (torch.zeros(TOKENS, HIDDEN, device=device),)
                graphed = make_graphed_callables(module, sample, fp8_enabled=True, fp8_recipe=recipe, _order=[1, -1])
            else:
                graphed = module
            for step, x in enumerate(microbatches):
                with fp8_autocast(enabled=True, fp8_recipe=recipe):
                    outs.append(graphed(x).clone())
                if step in eval_after:                     # high-precision evaluation of the non-graphed module
                    with fp8_autocast(enabled=False):
                        outs.append(module(eval_batch).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
