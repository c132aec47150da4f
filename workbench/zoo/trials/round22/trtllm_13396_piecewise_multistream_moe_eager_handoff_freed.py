"""The eager multi-stream MoE partition's capture-time output, read by the next piecewise segment's graph, is freed after capture.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/13396 ("[#13321][fix] disable multi_stream on piecewise
path instead of persistent buffer"), fixing https://github.com/NVIDIA/TensorRT-LLM/issues/13321 ("Re-enable
piecewise cudagraph for Qwen3.5"); the root cause is spelled out in its closed predecessor by the same author,
https://github.com/NVIDIA/TensorRT-LLM/pull/13354.
Symptom: AutoDeploy with piecewise CUDA graphs and ``multi_stream_moe`` (shared expert on an aux stream):
Nemotron-3-Nano-30B-A3B produced gibberish tokens with ``ADPiecewiseRunner ADDRESS MISMATCH`` logged on every
layer that follows a MoE partition; Qwen3.5-35B-A3B hit an asynchronous illegal memory access in the next
layer (``flashinfer_rope``). Piecewise graphs had to be disabled for these models (TensorRT-LLM main, April 2026).
Mechanism: #12847 made ``begin_aux_stream_passthrough`` call ``caller_stream.synchronize()``, which cannot be
captured, so ``split_graph_at_dynamic_ops`` reclassifies every static partition holding aux-stream passthroughs
as dynamic: it runs eagerly between captured segments. ``PiecewiseCapturedGraph`` leaves that partition
unwrapped, so its output is a fresh caching-allocator tensor on every call, while the following static
segment's graph was captured reading the capture-time output's address. ``ADPiecewiseRunner`` copies only the
graph-level inputs into static buffers; a segment handoff is only compared (``ADDRESS MISMATCH``), never
copied. Once the capture-time output is released (nothing owns it after ``warmup_and_capture``), every replay
of the next segment reads memory its owner has let go: stale activations, or whatever the allocator placed
there, and an IMA when the block is recycled.
Doctor: dangling-reference, at ``submod_1`` (the eager multi-stream MoE partition hands out a new tensor each
call; the next segment's graph keeps reading the capture-time one, released after capture).
Fix (upstream): a ``disable_multi_stream()`` context (``multi_stream_utils.py``) wraps
``PiecewiseCapturedGraph.warmup_and_capture`` and ``forward``; inside it the passthroughs (and aux-stream impls)
are no-ops, so stream-switch partitions need no reclassification and are captured inside the enclosing static
segment. Decode keeps multi-stream through the monolithic graph. (#13354's alternative, a persistent output
buffer per multi-stream partition and bucket, was dropped for its memory cost.)
(Evidence: #13396's description and a diff hunk of ``disable_multi_stream``; #13354's and #12847's
descriptions; the replay-input comment of ``piecewise_runner.py`` in #11515 (handoffs already at the static
address are not copied). Toy: three FX partitions, one token bucket, no attention.)
"""
from __future__ import annotations

import contextlib
import logging

import torch

from workbench.engine import graph_pool_handle, synchronize
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/13396"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "submod_1"
SYMPTOM = "segment after the eager multi-stream MoE partition replays its freed capture-time input (gibberish / IMA)"

logger = logging.getLogger(__name__)

VOCAB, DIM, NUM_EXPERTS = 12, 4, 3
CAPTURE_NUM_TOKENS = 4                      # the one piecewise bucket; every step below fills it exactly

_multi_stream_enabled = True


@contextlib.contextmanager
def disable_multi_stream():
    """The fix: no-op the aux-stream passthroughs while the piecewise graph is captured and replayed."""
    global _multi_stream_enabled
    prev, _multi_stream_enabled = _multi_stream_enabled, False
    try:
        yield
    finally:
        _multi_stream_enabled = prev


def begin_aux_stream_passthrough(x):
    """Switch to the aux stream. #12847: a host-side ``caller_stream.synchronize()`` first, because the
    event wait alone let the aux stream read tensors not yet written (it cannot be captured)."""
    if _multi_stream_enabled:
        synchronize(x.device)
    return x


def end_aux_stream_passthrough(x):
    return x


class Weights:
    def __init__(self, device):
        gen = generator(13396)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.w_in = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.w_gate = randn(DIM, NUM_EXPERTS, gen=gen, device=device)
        self.w_experts = randn(NUM_EXPERTS, DIM, DIM, gen=gen, device=device, scale=0.7)
        self.w_shared = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.7)


# The FX graph after AutoDeploy's split: three partitions, in order.
def submod_0(w, input_ids):
    """Embedding and input projection (static)."""
    x = w.embed[input_ids]
    h = torch.tanh(x @ w.w_in)
    return h, x


def submod_1(w, h, x):
    """MoE layer with the shared expert on the aux stream (multi_stream_moe)."""
    h = begin_aux_stream_passthrough(h)
    shared = end_aux_stream_passthrough(torch.relu(h @ w.w_shared))        # aux stream
    probs = torch.softmax(h @ w.w_gate, dim=-1)                            # main stream: routed top-1
    top_p, top_e = probs.max(dim=-1)
    routed = torch.einsum("td,tde->te", h, w.w_experts[top_e]) * top_p[:, None]
    return routed + shared, x


def submod_2(w, moe_out, x):
    """Residual and LM head (static)."""
    return (moe_out + x) @ w.lm_head


PARTITIONS = (
    ("submod_0", submod_0, False),
    ("submod_1", submod_1, True),        # holds begin/end_aux_stream_passthrough
    ("submod_2", submod_2, False),
)


def split_graph_at_dynamic_ops(partitions, variant):
    """Group consecutive static partitions into captured segments; a partition holding aux-stream
    passthroughs is reclassified as dynamic (eager): its host synchronize cannot be captured."""
    segments = []
    for name, fn, uses_aux_stream in partitions:
        dynamic = uses_aux_stream and variant == "bug"     # the fix: no reclassification needed
        if dynamic or not segments or segments[-1][0] == "dynamic":
            segments.append(("dynamic" if dynamic else "static", [fn]))
        else:
            segments[-1][1].append(fn)
    return segments


class ADPiecewiseRunner:
    """Captures one static segment. Graph-level inputs are copied into static buffers; a handoff from the
    previous segment is assumed to stay at its capture-time address and is only checked."""

    def __init__(self, w, fns, device, pool, graph_input_idx, name):
        self.w, self.fns, self.device, self.pool, self.name = w, fns, device, pool, name
        self.graph_input_idx = set(graph_input_idx)
        self.static_inputs = {}
        self.entry = None
        self._live_args = ()
        self.address_mismatches = 0

    def _segment(self, *args):
        out = args
        for fn in self.fns:
            out = fn(self.w, *out)
            out = out if isinstance(out, tuple) else (out,)
        return out

    def _args(self, args):
        return tuple(self.static_inputs.get(i, a) for i, a in enumerate(args))

    def __call__(self, *args):
        self._live_args = args                  # the segment's current inputs (its eager form reads these)
        if self.entry is None:
            for i in self.graph_input_idx:
                self.static_inputs[i] = args[i].clone()
            static = {f"{self.name}.input{i}": t for i, t in self.static_inputs.items()}
            g, out = capture(lambda: self._segment(*self._args(self._live_args)), device=self.device,
                             pool=self.pool, static=static, name=f"{self.name} tokens {CAPTURE_NUM_TOKENS}",
                             owner="ADPiecewiseRunner")
            self.entry = (g, out, [a.data_ptr() for a in args])
            return out
        g, out, addresses = self.entry
        for i, a in enumerate(args):            # _prepare_replay_inputs
            if i in self.graph_input_idx:
                self.static_inputs[i].copy_(a)
            elif a.data_ptr() != addresses[i]:
                self.address_mismatches += 1
                logger.debug("ADPiecewiseRunner ADDRESS MISMATCH: %s input %d", self.name, i)
        return replay(g, out)


class PiecewiseCapturedGraph:
    def __init__(self, w, device, variant):
        self.variant = variant
        self.segments = []
        pool = graph_pool_handle(device)
        for k, (kind, fns) in enumerate(split_graph_at_dynamic_ops(PARTITIONS, variant)):
            if kind == "dynamic":
                self.segments.append(("dynamic", fns[0]))
            else:
                runner = ADPiecewiseRunner(w, fns, device, pool, graph_input_idx=(0,) if k == 0 else (),
                                           name=f"segment{k}")
                self.segments.append(("static", runner))
        self.w = w

    def _scope(self):
        return disable_multi_stream() if self.variant == "fix" else contextlib.nullcontext()

    def _run(self, input_ids):
        args = (input_ids,)
        for kind, seg in self.segments:
            out = seg(self.w, *args) if kind == "dynamic" else seg(*args)
            args = out if isinstance(out, tuple) else (out,)
        return args[0]

    def warmup_and_capture(self, input_ids):
        with self._scope():
            self._run(input_ids)

    def forward(self, input_ids):
        with self._scope():
            return self._run(input_ids)


def run(variant: str, device: str = "cpu"):
    w = Weights(device)
    gen = generator(1)
    steps = [torch.randint(0, VOCAB, (CAPTURE_NUM_TOKENS,), generator=gen).to(device) for _ in range(3)]

    def eager():                                # torch-simple: every partition eagerly, multi-stream on
        outs = []
        for ids in steps:
            h, x = submod_0(w, ids)
            outs.append(submod_2(w, *submod_1(w, h, x)))
        return outs

    def served():
        model = PiecewiseCapturedGraph(w, device, variant)
        model.warmup_and_capture(torch.zeros(CAPTURE_NUM_TOKENS, dtype=torch.long, device=device))
        return [model.forward(ids).clone() for ids in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
