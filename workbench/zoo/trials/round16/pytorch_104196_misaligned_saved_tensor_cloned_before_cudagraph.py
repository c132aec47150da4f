"""Inductor re-aligns a misaligned saved tensor before the cudagraph sees it: the graph records a per-call clone as static.

Upstream: https://github.com/pytorch/pytorch/pull/104196 ("Fix bad cudagraph interaction"), for issue
https://github.com/pytorch/pytorch/issues/103126 ("Fix Bad Interaction Between Aligning Inputs and
CUDAGraphs in Backward (LayoutLMForMaskedLM)").
Symptom: ``torch.compile`` training with cudagraph trees (the HF benchmark ``LayoutLMForMaskedLM``, ``--amp
--training``) dies in the backward on the second iteration with ``assert data_ptr ==
new_inputs[idx].data_ptr()`` in ``CUDAGraphNode.run`` (PyTorch nightly, June 2023).
Mechanism: cudagraph trees treat parameters and the forward graph's saved tensors as static inputs: their
address is recorded and never copied in. Inductor also assumes 16-byte-aligned inputs, so
``compile_fx_inner`` wrapped the cudagraphified backward in ``align_inputs``, which replaces every
misaligned input by a fresh aligned clone on each call. A saved tensor that is a view at an odd offset of
the forward graph's output (here ``k``, a column slice of ``qkv``) was therefore cloned *before* the
cudagraph looked at it: ``remove_unaligned_input_idxs`` saw an aligned tensor and kept it static, and the
backward graph was recorded reading the clone of the recording call. That clone is released when the call
returns, and the next call brings a new clone at another address: the graph's static address dangles (the
trees' assert caught it; without it the replay would read the released block).
Doctor: dangling-reference, at ``compile_fx_inner`` (wrapping the cudagraph in ``align_inputs``, so a
per-call clone becomes a static input).
Fix (upstream): cudagraphs do their own aligning: ``compile_fx_inner`` no longer wraps a cudagraphified
callable in ``align_inputs``, so the cudagraph sees the misaligned saved tensor, drops it from the static
inputs (``remove_unaligned_input_idxs``) and copies it into an aligned static buffer before each replay.
"""
from __future__ import annotations

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/pytorch/pull/104196"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "compile_fx_inner"
SYMPTOM = "backward cudagraph recorded a per-call aligned clone of a saved tensor as static (assert upstream)"
ALIGNMENT = 16
TOKENS, HIDDEN, STEPS = 4, 3, 3          # k = qkv[:, H:2H] starts 12 bytes into qkv: misaligned


def clone_preserve_strides(x):
    needed_size = sum((shape - 1) * stride for shape, stride in zip(x.size(), x.stride())) + 1
    buffer = torch.as_strided(x, (needed_size,), (1,)).clone()
    return torch.as_strided(buffer, x.size(), x.stride())


def align_inputs(model, inputs, static_input_idxs=()):
    check_inputs = [i for i in range(len(inputs))
                    if i not in static_input_idxs or (inputs[i].data_ptr() % ALIGNMENT) != 0]
    if len(check_inputs) == 0:
        return model

    def run(new_inputs):
        for i in check_inputs:
            if new_inputs[i].data_ptr() % ALIGNMENT:
                new_inputs[i] = clone_preserve_strides(new_inputs[i])
        return model(new_inputs)

    return run


def remove_unaligned_input_idxs(inputs, static_input_idxs):
    """
    We require all inputs to be aligned, so introduce a copy for any
    that aren't.
    """
    aligned_static_input_idxs = [idx for idx in static_input_idxs if (inputs[idx].data_ptr() % ALIGNMENT) == 0]
    if len(aligned_static_input_idxs) != len(static_input_idxs):
        return aligned_static_input_idxs
    return static_input_idxs


def static_input(x):
    """Copy and input while preserving strides (an aligned buffer the graph owns)."""
    needed_size = sum((shape - 1) * stride for shape, stride in zip(x.size(), x.stride())) + 1
    buffer = torch.empty(needed_size, dtype=x.dtype, device=x.device)
    return torch.as_strided(buffer, x.size(), x.stride())


class CUDAGraphNode:
    """A cudagraph trees node: static inputs by address, the others copied into reconstructed inputs."""

    def __init__(self, wrapped_function, inputs, static_input_idxs, *, device, pool, name):
        self.static_input_data_ptrs = [inp.data_ptr() if i in static_input_idxs else None
                                       for i, inp in enumerate(inputs)]
        self.reconstructed_inputs = [inp if i in static_input_idxs else static_input(inp)
                                     for i, inp in enumerate(inputs)]
        for i, inp in enumerate(inputs):
            if i not in static_input_idxs:
                self.reconstructed_inputs[i].copy_(inp)
        self.graph, self.recording_outputs = capture(
            lambda: wrapped_function(list(self.reconstructed_inputs)), device=device, pool=pool, name=name,
            static={f"{name}.input{i}": t for i, t in enumerate(self.reconstructed_inputs)
                    if i not in static_input_idxs},
            owner="cudagraph trees")

    def run(self, new_inputs):
        for idx, data_ptr in enumerate(self.static_input_data_ptrs):
            if data_ptr is not None:
                # static input, e.g., parameter
                assert data_ptr == new_inputs[idx].data_ptr()
            else:
                # non-static input, need to copy it into CUDA graph
                dst = self.reconstructed_inputs[idx]
                dst.copy_(new_inputs[idx])
        new_inputs.clear()
        return replay(self.graph, self.recording_outputs)


def cudagraphify(model, inputs, static_input_idxs=(), *, device, pool, name):
    # fake tensors at compile time: defer cudagraphs until we get real inputs at runtime
    node = None

    def run(new_inputs):
        nonlocal node
        if node is None:
            idxs = remove_unaligned_input_idxs(new_inputs, list(static_input_idxs))
            node = CUDAGraphNode(model, new_inputs, idxs, device=device, pool=pool, name=name)
        return node.run(new_inputs)

    return run


def compile_fx_inner(compiled_fn, example_inputs, num_fixed, *, cudagraphs, variant, device=None, pool=None,
                     name=None):
    if cudagraphs:
        compiled_fn = cudagraphify(compiled_fn, example_inputs, static_input_idxs=range(num_fixed),
                                   device=device, pool=pool, name=name)
    if variant == "bug" or not cudagraphs:
        return align_inputs(compiled_fn, example_inputs, range(num_fixed))
    # cudagraphs does its own aligning of inputs
    return compiled_fn


def fw_graph(args):
    """The forward graph: a gated projection; ``k`` is saved for the backward."""
    w_qkv, x = args
    qkv = x @ w_qkv
    q, k = qkv[:, :HIDDEN], qkv[:, HIDDEN:2 * HIDDEN]
    return q * k, k


def bw_graph(args):
    """The backward graph: its fixed inputs come first (``count_tangents``), then the tangents."""
    k, tangent = args
    return tangent * k


def run(variant: str, device: str = "cpu"):
    gen = generator(104196)
    w_qkv = randn(HIDDEN, 3 * HIDDEN, gen=gen, device=device, scale=0.5)
    xs = [randn(TOKENS, HIDDEN, gen=gen, device=device) for _ in range(STEPS)]
    tangents = [randn(TOKENS, HIDDEN, gen=gen, device=device) for _ in range(STEPS)]

    def serve(cudagraphs: bool):
        pool = graph_pool_handle(device) if cudagraphs else None
        fw = compile_fx_inner(fw_graph, [w_qkv, xs[0]], 1, cudagraphs=cudagraphs, variant=variant,
                              device=device, pool=pool, name="forward")
        bw = None
        outs = []
        for x, tangent in zip(xs, tangents):
            out, k = fw([w_qkv, x])
            if bw is None:                     # the backward is compiled on the first backward call
                bw = compile_fx_inner(bw_graph, [k, tangent], 1, cudagraphs=cudagraphs, variant=variant,
                                      device=device, pool=pool, name="backward")
            grad_q = bw([k, tangent])
            outs += [out.clone(), grad_q.clone()]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
