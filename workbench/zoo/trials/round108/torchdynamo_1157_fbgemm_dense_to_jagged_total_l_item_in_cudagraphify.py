"""TorchInductor (torchdynamo repo, September 2022) wraps every all-CUDA, non-mutating compiled graph in ``cudagraphify``, including graphs that call FBGEMM's jagged-tensor fallbacks; ``fbgemm.dense_to_jagged`` reads the jagged total length from the offsets on the host, so recording the graph hits a host sync and compiling a TorchRec-style model with ``cudagraphs=True`` fails.

Upstream: https://github.com/pytorch/torchdynamo/pull/1157 ("Add util to avoid cudagraphify if the graph
has_incompatible_cudagraph_ops", pytorch/torchdynamo, by Michael Voznesensky (voznesenskym), merged 2022-09-07 as
commit fe3173f7e6c804e6330ac187ea8e4101f45ff9a2). The PR has no description and no linked issue.
Read: the commit's diff (``torchinductor/compile_fx.py``: ``compile_fx_inner`` adds
``and not has_incompatible_cudagraph_ops(gm)`` to the cudagraphs condition; ``torchinductor/utils.py``: new
``has_incompatible_cudagraph_ops(gm)`` that returns True when ``str(node.target)`` of any FX node is
``fbgemm.dense_to_jagged.default`` or ``fbgemm.jagged_to_padded_dense.default``), and at the parent commit
(``fe3173f7^``, torchdynamo mirror) ``compile_fx_inner`` (``GraphLowering`` run, ``compile_to_fn``, the condition
``cudagraphs and set(graph.device_types) == {"cuda"} and not graph.mutated_inputs``, else ``BoxedBool.disable`` and
the "skipping cudagraphs" warnings) and ``cudagraphify`` (``static_input`` buffers zero-filled and 32-byte aligned,
one warm-up of ``model(*inputs)`` on a side stream, ``torch.cuda.graph(graph, stream=stream)`` around
``model(*static_inputs)``, the ``size_asserts`` ``run`` that asserts the static inputs' ``data_ptr`` and copies
the others before ``graph.replay()``). The FBGEMM side (``dense_to_jagged(dense, x_offsets, total_L=None)``, whose
total length defaults to ``x_offsets[-1][-1].item()``) is taken from the op's documented contract and from the
Python fallbacks of it found in the code corpus (all compute ``total_L = offsets[0][-1].item()``); the FBGEMM C++
source was not read.
Symptom: compiling a recommendation model that converts padded features to jagged values (TorchRec / FBGEMM
``dense_to_jagged``) with TorchInductor and ``config.triton.cudagraphs = True`` (then the default) fails while
the graph is recorded: the capture stream refuses the host read of the total length ("operation not permitted
when stream is capturing"); the same graph without CUDA graphs runs.
Mechanism: the output of ``dense_to_jagged`` has as many rows as the jagged tensor holds values,
``total_L = offsets[-1]``, which lives on the device. Without a ``total_L`` argument the op reads it with
``.item()`` to allocate its output. ``compile_fx_inner`` only refused CUDA graphs for multi-device graphs and
input mutation, so such a graph was handed to ``cudagraphify``; its warm-up passes, but inside
``torch.cuda.graph(...)`` the ``.item()`` is a device-to-host sync on a capturing stream. (Even if it could be
recorded, the graph would keep the capture-time length.)
Doctor: sync-in-capture, at compile_fx_inner. ``compile_fx_inner`` decides to cudagraphify a graph whose FBGEMM
jagged op synchronises with the host to size its output; the ``.item()`` runs inside the recording.
Fix (upstream): ``has_incompatible_cudagraph_ops(gm)`` lists the two FBGEMM jagged ops; ``compile_fx_inner`` does
not cudagraphify a graph that calls either (it falls to the ``elif cudagraphs`` branch: ``BoxedBool.disable``),
so the compiled graph runs without CUDA graphs.
Modelled: ``compile_fx_inner`` (the parent's condition, the fix's extra clause, ``BoxedBool.disable``),
``has_incompatible_cudagraph_ops`` as added, ``cudagraphify`` as at the parent (aligned zero-filled static inputs,
one warm-up on the real inputs, recording on the static inputs, the ``size_asserts`` replay path), ``BoxedBool``.
Stand-ins: a minimal FX graph (``Node`` / ``Graph`` / ``GraphModule``: placeholders, two call_function nodes and
an output) in place of torch.fx, interpreted by ``GraphLowering.compile_to_fn`` instead of Triton code;
``fbgemm_dense_to_jagged`` implements the op in torch (rows ``offsets[b]:offsets[b+1]`` of the values come from
``dense[b, :length_b]``); the model is a jagged feature projection (``values @ weight``, then ``tanh``), the weight
being the graph's one fixed (static) input; float64; no Triton, no AOT autograd (inference).
Workload: batch of 3 sequences, padded length 4, embedding dim 4; compile on the first batch (lengths 2, 4, 1),
then serve three batches (lengths 2, 4, 1 / 3, 1, 2 / 4, 4, 0), each returning the jagged projection.
Bug: compiling raises inside the recording, from the ``.item()`` in ``fbgemm_dense_to_jagged``: CaptureError
"Tensor.item() inside graph capture needs the device's values on the host ... (cudaErrorStreamCaptureUnsupported)"
on the CPU engine (on CUDA, the stream-capture error of the same call). Fix: the graph is not cudagraphified;
the three outputs (7, 6 and 8 rows) equal eager, max |graph - eager| = 0.
"""
from __future__ import annotations

import math

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/torchdynamo/pull/1157"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "compile_fx_inner"
SYMPTOM = ("compiling a model that calls fbgemm.dense_to_jagged with inductor cudagraphs fails while recording: the "
           "op reads the jagged total length on the host")

BATCH, MAX_LEN, DIM = 3, 4, 4
ALIGNMENT = 32                    # bytes; cudagraphify keeps static inputs 32-byte aligned
DTYPE = torch.float64
SIZE_ASSERTS = True               # torchinductor.config.size_asserts (default True)

_variant = "bug"


# --- fbgemm_gpu jagged ops (stand-in, torch ops) --------------------------------------------------------------------

def fbgemm_dense_to_jagged(dense, x_offsets, total_L=None):
    """``torch.ops.fbgemm.dense_to_jagged``: values of a padded ``[B, N, D]`` tensor at the offsets' lengths."""
    offsets = x_offsets[0]
    if total_L is None:
        total_L = int(offsets[-1].item())          # the host reads the device's total length
    positions = torch.arange(total_L, device=dense.device)
    row = torch.searchsorted(offsets[1:], positions, right=True)
    col = positions - offsets[row]
    return dense[row, col], x_offsets


class _OpOverload:
    """What ``node.target`` is for an FBGEMM op in the traced graph: ``str()`` gives its qualified name."""

    def __init__(self, name, fn):
        self.name, self.fn = name, fn

    def __call__(self, *args):
        return self.fn(*args)

    def __str__(self):
        return self.name


dense_to_jagged_default = _OpOverload("fbgemm.dense_to_jagged.default", fbgemm_dense_to_jagged)
mm_tanh_default = _OpOverload("aten.mm.tanh", lambda values, weight: torch.tanh(values @ weight))


# --- torch.fx stand-in ---------------------------------------------------------------------------------------------

class Node:
    def __init__(self, op, name, target=None, args=()):
        self.op, self.name, self.target, self.args = op, name, target, args


class Graph:
    def __init__(self, nodes):
        self.nodes = nodes


class GraphModule:
    def __init__(self, graph):
        self.graph = graph

    def __call__(self, *inputs):                    # eager execution of the traced graph (the reference)
        env, placeholders = {}, iter(inputs)
        for node in self.graph.nodes:
            if node.op == "placeholder":
                env[node.name] = next(placeholders)
            elif node.op == "call_function":
                args = [env[a] if isinstance(a, str) else [env[x] for x in a] for a in node.args]
                out = node.target(*args)
                env[node.name] = out[0] if isinstance(out, tuple) else out
            else:
                return tuple(env[a] for a in node.args)


def trace_jagged_projection():
    """The graph dynamo hands inductor: primals (the weight), then the padded features and their offsets."""
    return GraphModule(Graph([
        Node("placeholder", "primals_1"),            # weight (a parameter: fixed input)
        Node("placeholder", "arg0_1"),               # dense [B, N, D]
        Node("placeholder", "arg1_1"),               # offsets [B + 1]
        Node("call_function", "dense_to_jagged", dense_to_jagged_default, ("arg0_1", ["arg1_1"])),
        Node("call_function", "tanh", mm_tanh_default, ("dense_to_jagged", "primals_1")),
        Node("output", "output", None, ("tanh",)),
    ]))


# --- torchinductor --------------------------------------------------------------------------------------------------

class BoxedBool:
    def __init__(self, value):
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
    def __init__(self, gm, num_dynamic_inputs):
        self.gm, self.num_dynamic_inputs = gm, num_dynamic_inputs
        self.device_types, self.mutated_inputs = set(), set()

    def run(self, *example_inputs):
        for t in example_inputs:                     # the emulation's CPU stands for the CUDA device
            self.device_types.add("cuda" if t.device.type == "cpu" else t.device.type)
        return self.gm(*example_inputs)

    def compile_to_fn(self):
        gm = self.gm

        def call(*args):                             # the generated wrapper's call(): kernels + fallback ops
            return gm(*args)
        return call


def has_incompatible_cudagraph_ops(gm):
    forbidden_list = set([
        "fbgemm.dense_to_jagged.default",
        "fbgemm.jagged_to_padded_dense.default",
    ])
    for node in gm.graph.nodes:
        if str(node.target) in forbidden_list:
            return True
    return False


def compile_fx_inner(gm, example_inputs, cudagraphs=None, num_fixed=0, is_backward=False, *, device="cpu"):
    if cudagraphs is None:
        cudagraphs = BoxedBool(True)                 # config.triton.cudagraphs
    graph = GraphLowering(gm, num_dynamic_inputs=len(example_inputs))
    graph.run(*example_inputs)
    compiled_fn = graph.compile_to_fn()

    if _variant == "bug":
        use_cudagraphs = cudagraphs and set(graph.device_types) == {"cuda"} and not graph.mutated_inputs
    else:
        use_cudagraphs = (
            cudagraphs
            and set(graph.device_types) == {"cuda"}
            and not graph.mutated_inputs
            and not has_incompatible_cudagraph_ops(gm)
        )
    if use_cudagraphs:
        compiled_fn = cudagraphify(compiled_fn, example_inputs, static_input_idxs=range(num_fixed), device=device)
    elif cudagraphs:
        BoxedBool.disable(cudagraphs)               # "skipping cudagraphs ..." (no warning for this case)
    return compiled_fn


def cudagraphify(model, inputs, static_input_idxs=(), *, device="cpu"):
    """Assumes inputs[static_input_idxs[i]] are always the same memory address."""

    def static_input(x):
        # make sure alignment and contiguity of inputs is preserved
        needed_size = sum((shape - 1) * stride for shape, stride in zip(x.size(), x.stride())) + 1
        needed_size = math.ceil(needed_size * x.element_size() / ALIGNMENT) * ALIGNMENT // x.element_size()
        buffer = torch.zeros(needed_size, dtype=x.dtype, device=x.device)
        return torch.as_strided(buffer, x.size(), x.stride())

    assert isinstance(inputs, (list, tuple))
    static_inputs = [static_input(x) if idx not in static_input_idxs else inputs[idx]
                     for idx, x in enumerate(inputs)]

    # warmup (on a side stream, with the real example inputs)
    with events.warmup():
        model(*inputs)

    # record
    static = {f"static_inputs[{i}]": t for i, t in enumerate(static_inputs) if i not in static_input_idxs}
    graph, static_outputs = capture(lambda: model(*static_inputs), device=device, warmups=0, static=static,
                                    owner="torchinductor cudagraphify", name="inductor graph")
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


# --- workload -------------------------------------------------------------------------------------------------------

def _batch(lengths, gen, device):
    dense = randn(BATCH, MAX_LEN, DIM, gen=gen, device="cpu").to(DTYPE)
    for b, n in enumerate(lengths):
        dense[b, n:] = 0.0                            # padding
    offsets = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int64)
    return dense.to(device), offsets.to(device)


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(1157)
    weight = randn(DIM, DIM, gen=gen, device="cpu", scale=0.5).to(DTYPE).to(device)
    batches = [_batch(lengths, gen, device) for lengths in ((2, 4, 1), (3, 1, 2), (4, 4, 0))]
    gm = trace_jagged_projection()

    def eager():
        return [gm(weight, dense, offsets)[0] for dense, offsets in batches]

    def served():
        compiled = compile_fx_inner(gm, [weight, *batches[0]], cudagraphs=BoxedBool(True), num_fixed=1,
                                    device=device)
        return [compiled(weight, dense, offsets)[0].clone() for dense, offsets in batches]

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
