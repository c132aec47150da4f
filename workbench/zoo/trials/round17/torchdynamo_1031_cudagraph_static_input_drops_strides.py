"""Inductor's cudagraphify copies a strided input into a dense ``zeros_like`` buffer the kernel indexes with the old strides.

Upstream: https://github.com/pytorch/torchdynamo/pull/1031 ("preserve strides and alignment when creating static
inputs for cudagraphs"), fixing https://github.com/pytorch/torchdynamo/issues/959.
Symptom: with TorchInductor and ``triton.cudagraphs=True``, a graph whose input is a non-dense view (a strided
slice of a larger activation) indexed its static copy with the example's strides: reads past the copy or of the
wrong elements, while the same graph without cudagraphs was correct (torchdynamo main, August 2022; the PR title
and diff are the source here, issue #959's own text was not available).
Mechanism: Inductor generates its kernels for the example inputs' sizes *and strides* (the load address of
element ``(i, j)`` is ``in_ptr0 + stride0*i + stride1*j``, baked into the kernel). ``cudagraphify`` made the static
input of each non-static argument with ``torch.zeros_like(x)``, which keeps the strides only of dense tensors: for
a slice ``base[:, ::2]`` (strides ``(4, 2)``) it allocates a dense ``(4, 2)`` buffer of 8 elements with strides
``(2, 1)``, and ``copy_`` packs the input into it. The recorded kernel still addresses the buffer with strides
``(4, 2)``: it reaches element 14 of an 8-element allocation and, inside it, reads the wrong elements. The
static buffer is smaller than the extent the captured kernel reads.
Doctor: undersized-buffer, at ``cudagraphify`` (the static input allocated for the data's element count, not for
the strided extent the kernel reads).
Fix (upstream): a ``static_input(x)`` helper allocates ``sum((size - 1) * stride) + 1`` elements (rounded up for
alignment) and ``as_strided``s it to ``x``'s sizes and strides, so the copy lands where the kernel reads.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/torchdynamo/pull/1031"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "cudagraphify"
SYMPTOM = "a strided input's static copy is dense: the captured kernel reads past it with the example's strides"
ROWS, COLS, STEPS = 4, 4, 3              # x = base[:, ::2]: shape (4, 2), strides (4, 2)


def compile_to_fn(example_inputs):
    """The generated module: ``call`` launches one kernel whose index math uses the example inputs' strides."""
    w_size, w_stride = tuple(example_inputs[0].size()), tuple(example_inputs[0].stride())
    x_size, x_stride = tuple(example_inputs[1].size()), tuple(example_inputs[1].stride())

    def kernel0(in_ptr0, in_ptr1):
        # tmp0 = tl.load(in_ptr1 + (4*x1 + 2*x0)); tmp1 = tl.load(in_ptr0 + x0); out = tanh(tmp0) * tmp1
        tmp0 = torch.as_strided(in_ptr1, x_size, x_stride, in_ptr1.storage_offset())
        tmp1 = torch.as_strided(in_ptr0, w_size, w_stride, in_ptr0.storage_offset())
        return torch.tanh(tmp0) * tmp1

    def call(arg0_1, arg1_1):
        return (kernel0(arg0_1, arg1_1),)

    return call


def static_input(x):
    """
    Copy and input while preserving strides
    """
    # make sure alignment and contiguity of inputs is preserved
    needed_size = sum((shape - 1) * stride for shape, stride in zip(x.size(), x.stride())) + 1
    needed_size = (needed_size + 31) // 32 * 32
    buffer = torch.zeros(needed_size, dtype=x.dtype, device=x.device)
    return torch.as_strided(buffer, x.size(), x.stride())


def cudagraphify(model, inputs, static_input_idxs=(), *, variant, device):
    """
    Assumes inputs[static_input_idxs[i]] are always the same memory address
    """
    if variant == "bug":
        static_inputs = [torch.zeros_like(x) if idx not in static_input_idxs else inputs[idx]
                         for idx, x in enumerate(inputs)]
    else:
        static_inputs = [static_input(x) if idx not in static_input_idxs else inputs[idx]
                         for idx, x in enumerate(inputs)]
    graph, static_outputs = capture(lambda: model(*static_inputs), device=device, name="forward",
                                    owner="torchinductor cudagraphify",
                                    static={f"arg{i}_1": t for i, t in enumerate(static_inputs)
                                            if i not in static_input_idxs})
    copy_indices = [idx for idx in range(len(static_inputs)) if idx not in static_input_idxs]

    def run(*new_inputs):
        for idx in copy_indices:
            static_inputs[idx].copy_(new_inputs[idx])
        return replay(graph, static_outputs)

    return run


def compile_fx_inner(example_inputs, num_fixed, *, cudagraphs, variant, device):
    compiled_fn = compile_to_fn(example_inputs)
    if cudagraphs:
        return cudagraphify(compiled_fn, example_inputs, static_input_idxs=range(num_fixed), variant=variant,
                            device=device)
    return compiled_fn


def run(variant: str, device: str = "cpu"):
    gen = generator(1031)
    weight = randn(COLS // 2, gen=gen, device=device)
    bases = [randn(ROWS, COLS, gen=gen, device=device) for _ in range(STEPS)]

    def serve(cudagraphs: bool):
        fn = compile_fx_inner([weight, bases[0][:, ::2]], 1, cudagraphs=cudagraphs, variant=variant,
                              device=device)
        outs = []
        for base in bases:
            hidden = base * 2.0                  # the activation the model slices
            (out,) = fn(weight, hidden[:, ::2])
            outs.append(out.clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
