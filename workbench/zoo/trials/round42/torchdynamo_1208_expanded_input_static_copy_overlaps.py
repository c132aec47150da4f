"""Inductor's cudagraph wrapper copies every call's input into a static buffer built with the example's
expanded (stride-0) layout: the buffer overlaps itself and cannot receive the copy.

Upstream: https://github.com/pytorch/torchdynamo/pull/1208 ("Fix Cudagraphs Expanded Inputs", commit
90a0e684), a follow-up to the covered https://github.com/pytorch/torchdynamo/pull/1031 ("preserve strides
and alignment when creating static inputs for cudagraphs").
Symptom: with ``config.triton.cudagraphs = True``, a function compiled by inductor whose inputs are expanded
tensors (``rand_strided((5, 5, 5, 5), (0, 5, 0, 1))`` in the PR's test) fails on every call with
"unsupported operation: more than one element of the written-to tensor refers to a single memory
location"; eager (and inductor without cudagraphs) computes ``x + y``.
Mechanism: ``cudagraphify`` makes each non-static input's buffer with ``static_input(x)``:
``torch.as_strided(buffer, x.size(), x.stride(), offset)`` over ``needed_size`` elements computed from the
strides, so a dim of stride 0 and size > 1 keeps its stride 0 and the buffer holds only the example's
distinct elements. The graph is recorded reading those buffers. Every call, ``run(*new_inputs)`` copies the
new input into its buffer with ``dst.copy_(src)``; ``dst`` has internal overlap (many logical elements, one
memory location), so the copy is refused, before any replay: the static buffer cannot take the step's data.
Doctor: undersized-buffer, at ``run`` (the copy of the step's input into a static buffer whose layout
cannot hold it).
Fix (upstream): ``get_expanded_dims(t)`` lists the dims with ``stride == 0 and size != 1``;
``cudagraphify`` precomputes them per input and ``run`` copies ``index_expanded_dims(src)`` into
``index_expanded_dims(dst)`` (each expanded dim sliced to length 1: one write per memory location, which
every expanded element then reads). ``compile_fx_inner`` also skips cudagraphs when an input still
overlaps after that slicing (``complex_memory_overlap``). The diff was read. Modelled is the
``config.size_asserts`` path of ``run`` (the default); the fix's second ``run`` (no size asserts) swaps
source and destination in the merged hunk and is not modelled.
Simplifications: the FX graph is a Python function; the warmup runs on the static inputs (the kit's
capture) instead of on the example inputs on a side stream; one input is expanded along rows, the other
along columns.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/torchdynamo/pull/1208"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "run"
SYMPTOM = "every cudagraph call with an expanded (stride-0) input fails copying it into its overlapping static buffer"

ROWS, COLS, CALLS = 3, 4, 3


class config:  # noqa: N801 - torchinductor.config
    size_asserts = True

    class triton:  # noqa: N801
        cudagraphs = True


def ceildiv(numer: int, denom: int) -> int:
    return -(numer // -denom)


# copy_ fails when trying to write to tensors with memory overlap,
# for expanded dimensions (a dimension which used to have size 1 -> ?)
# we can select one element from that dimension and write to it
# to achieve writing to all values of that dimension of the input tensor
def get_expanded_dims(t):
    return [i for i in range(t.ndim) if t.stride(i) == 0 and t.size(i) != 1]


def index_expanded_dims(t, expanded_dims):
    for expanded_dim in expanded_dims:
        t = torch.ops.aten.slice(t, expanded_dim, 0, 1)
    return t


def complex_memory_overlap(t):
    indexed_tensor = index_expanded_dims(t, get_expanded_dims(t))
    return torch._debug_has_internal_overlap(indexed_tensor) != 0


def cudagraphify(model, inputs, static_input_idxs=(), *, variant, device):
    """Assumes inputs[static_input_idxs[i]] are always the same memory address"""

    def static_input(x):
        # make sure alignment and contiguity of inputs is preserved
        needed_size = sum((shape - 1) * stride for shape, stride in zip(x.size(), x.stride())) + 1
        needed_size = ceildiv(needed_size, 32) * 32
        buffer = torch.zeros(needed_size, dtype=x.dtype, device=x.device)
        cache_line_offset = ((x.data_ptr() - buffer.data_ptr()) % 32) // x.element_size()
        return torch.as_strided(buffer, x.size(), x.stride(), cache_line_offset)

    assert isinstance(inputs, (list, tuple))
    static_inputs = [static_input(x) if idx not in static_input_idxs else inputs[idx]
                     for idx, x in enumerate(inputs)]
    if variant == "fix":
        inps_expanded_dims = [get_expanded_dims(x) if idx not in static_input_idxs else []
                              for idx, x in enumerate(inputs)]
    else:
        inps_expanded_dims = [[] for _ in inputs]

    # warmup, then record
    graph, static_outputs = capture(
        lambda: model(*static_inputs), device=device, owner="torchinductor cudagraphify",
        static={f"static_inputs[{i}]": x for i, x in enumerate(static_inputs) if i not in static_input_idxs})
    if not isinstance(static_outputs, (list, tuple)):
        static_outputs = (static_outputs,)
    static_outputs = tuple(static_outputs)

    assert config.size_asserts

    def run(*new_inputs):
        assert len(static_inputs) == len(new_inputs)
        for idx, (dst, src, expanded_dims) in enumerate(zip(static_inputs, new_inputs, inps_expanded_dims)):
            if idx in static_input_idxs:
                assert dst.data_ptr() == src.data_ptr()
            else:
                dst = index_expanded_dims(dst, expanded_dims)
                src = index_expanded_dims(src, expanded_dims)
                dst.copy_(src)
        return replay(graph, static_outputs)

    return run


def compile_fx_inner(gm, example_inputs, *, variant, device):
    compiled_fn = gm                       # the compiled kernels compute what the FX graph computes
    complex_memory_overlap_inputs = (variant == "fix"
                                     and any(complex_memory_overlap(t) for t in example_inputs))
    if config.triton.cudagraphs and not complex_memory_overlap_inputs:
        compiled_fn = cudagraphify(compiled_fn, example_inputs, static_input_idxs=range(0),
                                   variant=variant, device=device)
    return compiled_fn


def forward(x, y):
    """The traced FX graph: ``fn(x, y)`` of the PR's test, plus a reduction."""
    s = x + y
    return (s, (s * y).sum(-1))


def run(variant: str, device: str = "cpu"):
    gen = generator(1208)
    calls = []
    for _ in range(CALLS):
        x = randn(1, COLS, gen=gen, device=device).expand(ROWS, COLS)     # strides (0, 1)
        y = randn(ROWS, 1, gen=gen, device=device).expand(ROWS, COLS)     # strides (1, 0)
        calls.append((x, y))

    def served():
        compiled = compile_fx_inner(forward, list(calls[0]), variant=variant, device=device)
        outs = []
        for x, y in calls:
            outs.extend(o.clone() for o in compiled(x, y))
        return outs

    def eager():
        outs = []
        for x, y in calls:
            outs.extend(o.clone() for o in forward(x, y))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
