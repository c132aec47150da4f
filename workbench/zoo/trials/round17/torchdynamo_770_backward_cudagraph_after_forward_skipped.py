"""Inductor skips cudagraphs for the forward but still graphs the backward, which trusts saved tensors as static.

Upstream: https://github.com/pytorch/torchdynamo/pull/770 ("[inductor] Disable cudagraphs in backwards if it
failed in forwards"), fixing https://github.com/pytorch/torchdynamo/issues/755 ("hf_Bart `assert dst.data_ptr()
== src.data_ptr()` error").
Symptom: torchbench ``hf_Bart`` training with TorchInductor and ``triton.cudagraphs=True`` logged "skipping
cudagraphs due to multple devices", then failed accuracy and died in the backward with ``assert dst.data_ptr()
== src.data_ptr()`` in ``cudagraphify``'s ``run`` (torchdynamo main, August 2022).
Mechanism: ``compile_fx_aot`` compiles the forward and the backward separately and each ``compile_fx_inner``
decides cudagraphs on its own. The backward's static inputs come from ``count_tangents``: every placeholder that
is not a tangent (the saved activations and parameters) is assumed to keep its address from call to call, which
holds only when the forward ran as a CUDA graph and its saved tensors are that graph's static outputs. Here the
forward reads a CPU tensor, so its graph has two device types and is not cudagraphed: every iteration allocates
new saved activations. The backward, all-CUDA, is cudagraphed anyway and records the first iteration's saved
activation by address; from the second iteration on it is handed a different tensor (the assert), and without
the assert it would keep reading the first iteration's activation, memory its owner has released.
Doctor: dangling-reference, at ``compile_fx_inner`` (the forward's skip is not propagated to the backward, which
keeps a per-call saved tensor as a static input).
Fix (upstream): ``compile_fx_aot`` hands one ``BoxedBool`` to the forward and backward compilers; when
``compile_fx_inner`` skips cudagraphs for the forward it calls ``BoxedBool.disable(cudagraphs)``, so the
backward is not cudagraphed either.
"""
from __future__ import annotations

import torch

from workbench.engine import host, is_host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/torchdynamo/pull/770"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "compile_fx_inner"
SYMPTOM = "backward cudagraph recorded iteration 1's saved activation as static; forward ran eagerly (assert upstream)"
TOKENS, HIDDEN, STEPS = 4, 3, 3
SIZE_ASSERTS = True                      # torchinductor.config.size_asserts (default on)


class BoxedBool:
    def __init__(self, value: bool):
        self.value = value

    def __bool__(self):
        return self.value

    @staticmethod
    def disable(obj):
        if isinstance(obj, BoxedBool):
            obj.value = False
            return obj
        return False


class GraphLowering:
    """What ``compile_fx_inner`` asks of the lowered graph: its device types and mutated inputs."""

    def __init__(self, gm, example_inputs, device):
        self.gm = gm
        self.device_types = {"cpu" if is_host(t) or t.device.type != torch.device(device).type else "cuda"
                             for t in example_inputs}
        self.mutated_inputs = set()

    def compile_to_fn(self):
        return self.gm


def cudagraphify(model, inputs, static_input_idxs=(), *, device, name):
    """
    Assumes inputs[static_input_idxs[i]] are always the same memory address
    """
    static_inputs = [torch.zeros_like(x) if idx not in static_input_idxs else inputs[idx]
                     for idx, x in enumerate(inputs)]
    graph, static_outputs = capture(lambda: model(*static_inputs), device=device,
                                    name=name, owner="torchinductor cudagraphify",
                                    static={f"{name}.arg{i}": t for i, t in enumerate(static_inputs)
                                            if i not in static_input_idxs})
    if not isinstance(static_outputs, (list, tuple)):
        static_outputs = (static_outputs,)
    static_outputs = tuple(static_outputs)

    if SIZE_ASSERTS:
        def run(*new_inputs):
            assert len(static_inputs) == len(new_inputs)
            for idx, (dst, src) in enumerate(zip(static_inputs, new_inputs)):
                if idx in static_input_idxs:
                    assert dst.data_ptr() == src.data_ptr()
                else:
                    dst.copy_(src)
            return replay(graph, static_outputs)
    else:
        copy_indices = [idx for idx in range(len(static_inputs)) if idx not in static_input_idxs]

        def run(*new_inputs):
            for idx in copy_indices:
                static_inputs[idx].copy_(new_inputs[idx])
            return replay(graph, static_outputs)

    return run


def compile_fx_inner(gm, example_inputs, cudagraphs=None, num_fixed=0, *, variant, device, name):
    if cudagraphs is None:
        cudagraphs = True                # config.triton.cudagraphs
    graph = GraphLowering(gm, example_inputs, device)
    compiled_fn = graph.compile_to_fn()
    if cudagraphs and set(graph.device_types) == {"cuda"} and not graph.mutated_inputs:
        return cudagraphify(compiled_fn, example_inputs, static_input_idxs=range(num_fixed), device=device,
                            name=name)
    if variant == "fix":
        BoxedBool.disable(cudagraphs)    # skipping cudagraphs due to multple devices: tell the backward too
    return compiled_fn


def count_tangents(placeholder_names):
    """
    Infers which inputs are static for a backwards graph
    """
    def is_not_gradout(x):
        return "tangents" not in x

    static_arg_idxs = [i for i, n in enumerate(placeholder_names) if is_not_gradout(n)]
    assert static_arg_idxs == list(range(len(static_arg_idxs)))
    return len(static_arg_idxs)


def fw_graph(primals_1, primals_2, primals_3):
    """The forward graph: ``relu((x @ w) * scale)``; ``scale`` lives on the CPU, so the graph has two devices."""
    mm = (primals_2 @ primals_1) * primals_3
    return torch.relu(mm), mm, primals_1


def bw_graph(mm, primals_1, tangents_1):
    """The backward graph: the saved activation ``mm`` and weight come first, then the tangent."""
    grad_mm = torch.where(mm > 0, tangents_1, torch.zeros_like(tangents_1))
    return grad_mm @ primals_1.t(), grad_mm


def compile_fx_aot(variant, device, cudagraphs: bool):
    cudagraphs = BoxedBool(cudagraphs) if variant == "fix" else cudagraphs
    num_example_inputs = 2               # x and scale; the weight is a lifted parameter (fixed)

    def fw_compiler(model, example_inputs):
        fixed = len(example_inputs) - num_example_inputs
        return compile_fx_inner(model, example_inputs, cudagraphs=cudagraphs, num_fixed=fixed, variant=variant,
                                device=device, name="forward")

    def bw_compiler(model, example_inputs):
        fixed = count_tangents(["mm", "primals_1", "tangents_1"])
        return compile_fx_inner(model, example_inputs, cudagraphs=cudagraphs, num_fixed=fixed, variant=variant,
                                device=device, name="backward")

    return fw_compiler, bw_compiler


def run(variant: str, device: str = "cpu"):
    gen = generator(770)
    w = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
    scale = host(torch.tensor(1.5), device)
    xs = [randn(TOKENS, HIDDEN, gen=gen, device=device) for _ in range(STEPS)]
    tangents = [randn(TOKENS, HIDDEN, gen=gen, device=device) for _ in range(STEPS)]

    def serve(cudagraphs: bool):
        fw_compiler, bw_compiler = compile_fx_aot(variant, device, cudagraphs)
        fw = fw_compiler(fw_graph, [w, xs[0], scale])
        bw = None
        outs = []
        for x, tangent in zip(xs, tangents):
            out, mm, primals_1 = fw(w, x, scale)
            if bw is None:                   # AOTAutograd compiles the backward on the first backward call
                bw = bw_compiler(bw_graph, [mm, primals_1, tangent])
            grad_x, grad_mm = bw(mm, primals_1, tangent)
            outs += [out.clone(), grad_x.clone(), grad_mm.clone()]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
