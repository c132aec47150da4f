"""Recording a graph for an empty row-strided input sizes its static input buffer from strides: negative size.

Upstream: https://github.com/pytorch/pytorch/pull/130777 ("Directly use empty strided in cudagraph copy").
Symptom: as reported, only "We had an issue with the `-1` somehow ending up in negative num elements required. not
sure why the original didn't work" (CUDA graph trees, ``torch.compile(mode="reduce-overhead")``, July 2024): the
static-input allocation of a recording failed (``RuntimeError: Trying to create tensor with negative dimension``)
where eager runs. The workload here (an expert that once gets zero tokens, as a row-strided view) is a
reconstruction of an input that makes the old formula negative, not the one upstream hit.
Mechanism: CUDA graph trees copy every non-static input into a buffer of the graph's pool before recording
(``CUDAGraphNode._allocate_and_copy_recording_inputs``). ``static_input`` allocated that buffer itself, to keep
the input's strides: ``needed_size = sum((shape - 1) * stride) + 1`` elements, then ``as_strided`` over it
(a ``TODO(jansel)`` says ``empty_strided`` "doesn't work"). For an input with a zero-sized dimension whose stride
is larger than the span of the other dimensions -- ``hidden[:0, :IN]`` of a wider ``hidden``, stride ``(W, 1)`` --
the formula gives ``-W + IN``: the static buffer for the graph's input is sized negative and the allocation
raises, so that shape can never be recorded.
Doctor: undersized-buffer, at ``static_input`` (the static buffer a graph's input is copied into is sized for less
than the input: here fewer than zero elements).
Fix (upstream): ``static_input`` allocates with ``torch.empty_strided(x.size(), x.stride(), ...)``, which sizes the
storage correctly for every shape, including empty ones. (Read from the code before and after the PR: the
formula version in ``compile_fx.py`` and the ``empty_strided`` one that replaced it.)
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/pytorch/pull/130777"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "static_input"
SYMPTOM = "recording the graph for an empty row-strided input raises 'Trying to create tensor with negative dimension'"
IN, OUT, WIDTH, HIDDEN = 4, 3, 16, 8           # x = hidden[:n, :IN] of a [*, WIDTH] buffer: stride (WIDTH, 1)
ROWS = [3, 3, 0, 0, 0, 2, 3]                   # an empty step recurs: warmup, then record, then replay
STATIC_INPUT_IDXS = (1, 2)                     # the expert's weights: parameters, static inputs


def static_input(x, variant):
    """Copy an input while preserving strides (``torch/_inductor/compile_fx.py``)."""
    if variant == "fix":
        return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=x.device)
    # TODO(jansel): figure out why this version doesn't work:
    # return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=x.device)
    needed_size = sum((shape - 1) * stride for shape, stride in zip(x.size(), x.stride())) + 1
    buffer = torch.empty(needed_size, dtype=x.dtype, device=x.device)
    return torch.as_strided(buffer, x.size(), x.stride())


def expert_forward(x, w_in, w_out):
    """The compiled function: one expert's MLP on the tokens routed to it."""
    return torch.nn.functional.silu(x @ w_in) @ w_out


class CUDAGraphNode:
    def __init__(self, wrapped_function, inputs, device, variant):
        self.recording_inputs = self._allocate_and_copy_recording_inputs(inputs, variant)
        self.graph, self.outputs = capture(lambda: wrapped_function(*self.recording_inputs), device=device,
                                           warmups=0, static={"x": self.recording_inputs[0]},
                                           owner="CUDAGraphTreeManager", name=f"rows {inputs[0].shape[0]}")

    def _allocate_and_copy_recording_inputs(self, inputs, variant):
        recording_inputs = []
        for i, inp in enumerate(inputs):
            if i in STATIC_INPUT_IDXS:
                recording_inputs.append(inp)
            else:
                recording_inputs.append(static_input(inp, variant))   # static_input does an allocation!
        self._copy_inputs(recording_inputs, inputs)
        return recording_inputs

    @staticmethod
    def _copy_inputs(dsts, srcs):
        for i, (dst, src) in enumerate(zip(dsts, srcs)):
            if i not in STATIC_INPUT_IDXS:
                dst.copy_(src)

    def run(self, new_inputs):
        self._copy_inputs(self.recording_inputs, new_inputs)
        return replay(self.graph, self.outputs)


class CUDAGraphTreeManager:
    """One tree per compiled function and symint key: warm up on the first call, record on the second."""

    def __init__(self, device, variant):
        self.device, self.variant = device, variant
        self.warmed_up: set = set()
        self.nodes: dict = {}

    def run(self, function_id, wrapped_function, new_inputs):
        key = (function_id, tuple(new_inputs[0].shape))
        node = self.nodes.get(key)
        if node is not None:
            return node.run(new_inputs)
        if key not in self.warmed_up:                  # CUDAWarmupNode: run eagerly
            self.warmed_up.add(key)
            return wrapped_function(*new_inputs)
        node = self.nodes[key] = CUDAGraphNode(wrapped_function, new_inputs, self.device, self.variant)
        return node.run(new_inputs)


def run(variant: str, device: str = "cpu"):
    gen = generator(130777)
    w_in = randn(IN, HIDDEN, gen=gen, device=device, scale=0.6)
    w_out = randn(HIDDEN, OUT, gen=gen, device=device, scale=0.6)
    hiddens = [randn(max(ROWS), WIDTH, gen=gen, device=device) for _ in ROWS]

    def steps(call):
        # the tokens routed to this expert: the first IN features of the first n rows of the step's hidden states
        return [call(hidden[:n, :IN]).clone() for hidden, n in zip(hiddens, ROWS)]

    def served():
        manager = CUDAGraphTreeManager(device, variant)
        return steps(lambda x: manager.run("expert_forward", expert_forward, (x, w_in, w_out)))

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served,
                   lambda: steps(lambda x: expert_forward(x, w_in, w_out)))
