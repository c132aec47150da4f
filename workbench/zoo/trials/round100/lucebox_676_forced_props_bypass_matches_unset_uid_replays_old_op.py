"""Lucebox's ggml-cuda lets a forced property-check bypass accept an unset graph uid (0 == 0): a direct graph rebuilt with a different op in the same metadata arena replays the executable captured for the old op.

Upstream: https://github.com/Luce-Org/lucebox/pull/676 ("fix(ggml-cuda): require nonzero graph ID for property
bypass", Luce-Org/lucebox, the vendored llama.cpp under ``server/deps/llama.cpp``, 2026-08-27, merged).
Read: the PR description ("Direct graphs have an unset generation ID (uid = 0). The old bypass condition accepted
that unset ID as a match. Rebuilding a different operation at the same first-node address could therefore replay
the old operation: the regression changes NEG to SQR, but the old libraries return -3 instead of 9 for input 3";
"The bypass now requires a matching, nonzero generation ID. Zero-ID graphs retain ordinary property inspection");
the fixed ``ggml_backend_cuda_graph_compute`` (bypass predicate ``same_graph_generation = cgraph->uid != 0 &&
cgraph->uid == graph->uid`` with its comment on metadata arenas rebuilt at the same address), the fixed
``ggml_cuda_graph_update_required`` (uid fast path, ``graph->uid = cgraph->uid``, per-node property memcmp) and
``ggml_cuda_graph_get_key`` (``cgraph->nodes[0]``) in ``ggml-cuda.cu``; ``ggml-cuda.h`` before and after (the
sentence "Bypass requires a known matching non-zero graph generation UID" is new); the new regression test
(``run_arm``: one 1 MiB metadata arena, generation 0 builds ``ggml_neg``, generation 1 ``ggml_sqr`` at the same
first-node address, three submissions each, the second generation with the forced skip on; expected eager /
capture / replay counts from the graph telemetry); and a July snapshot of ``ggml-cuda.cu`` (the bypass then had no
uid term at all). The pre-fix predicate line itself was not read: ``cgraph->uid == graph->uid`` is taken from the
description ("accepted that unset ID as a match").
Symptom: a direct (non-scheduler) ggml graph computed with ``ggml_backend_cuda_set_skip_props_check(true)``
returns the previous graph's result: ``-3`` instead of ``9`` for input ``3``; without CUDA graphs it is correct.
Mechanism: the CUDA backend keys its graph cache on ``cgraph->nodes[0]``, the address of the first node's struct in
the caller's metadata arena. A caller that rebuilds its graph in the same arena gets the same key, so the cache
entry (warm-up complete, an instantiated executable) is the one captured for the old graph. The forced bypass skips
``ggml_cuda_graph_update_required`` (the per-node memcmp that would see NEG became SQR) when the graph generation
matches; graphs the scheduler builds carry a fresh non-zero uid per split, but a direct graph has uid 0 and so does
the cache entry it left, so ``0 == 0`` passes as "same generation": properties count as unchanged and the NEG
executable is launched on the new inputs. An eager step runs the nodes the arena now holds (SQR).
Doctor: warmup-divergence, at ggml_backend_cuda_graph_compute: the replayed kernels were decided by the capture of
the old graph, and the reuse decision made there wrongly treats the rebuilt graph as that one, while eager
evaluation runs what the graph now says.
Fix (upstream): ``same_graph_generation`` also requires ``cgraph->uid != 0``; a zero-uid graph goes through the
property inspection, which resets warm-up, runs eagerly once, then captures the new op.
Modelled: the metadata arena (structs placed at fixed offsets, so a rebuild reuses the same objects/addresses),
``ggml_init`` / ``ggml_new_tensor_1d`` / ``ggml_neg`` / ``ggml_sqr`` / ``ggml_new_graph_custom`` /
``ggml_build_forward_expand`` (uid 0), ``ggml_backend_tensor_alloc`` into one backend buffer (input at ``base``,
output at the next aligned offset, as in the test), ``ggml_backend_tensor_set`` / ``get``,
``ggml_backend_cuda_set_skip_props_check``, ``ggml_cuda_graph`` (instance, warmup_complete, uid, node_props),
``ggml_cuda_graph_get_key``, ``ggml_cuda_graph_update_required``, ``ggml_backend_cuda_graph_compute`` (warm-up,
bypass, capture/launch) and the eager ``ggml_cuda_graph_evaluate``. Stand-ins: node properties are a tuple (op,
shape, data pointers, source struct addresses) instead of a memcpy of ``ggml_tensor``; stream capture and
``cudaGraphLaunch`` are the engine's capture and replay; no telemetry, no HIP path.
Workload: the regression's two generations of one direct graph over 16 float32 values, three submissions each
(inputs ``i + 2 + 10*s``, then ``i + 3 + 10*s``; the output pre-filled with -99999 every time). Generation 0 (NEG)
runs eagerly, captures, replays; generation 1 (SQR, same arena, forced skip on). Bug: every generation-1
submission launches the NEG executable (first value -3 instead of 9); max |graph - eager| = 1482. Fix: generation 1
runs eagerly, captures SQR, replays it; all six outputs equal eager (max error 0).
"""
from __future__ import annotations

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, replay

UPSTREAM = "https://github.com/Luce-Org/lucebox/pull/676"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "ggml_backend_cuda_graph_compute"
SYMPTOM = ("a direct graph (uid 0) rebuilt with a new op in the same metadata arena, computed with the forced "
           "property bypass, replays the old op's CUDA graph: -3 instead of 9 for input 3")

GGML_OP_NONE, GGML_OP_NEG, GGML_OP_SQR = "NONE", "NEG", "SQR"
GGML_TYPE_F32 = "f32"
N = 16
SUBMISSIONS = 3
TENSOR_ALIGNMENT = 32                       # ggml_backend_buft_get_alignment, in floats here

_variant = "bug"


# --- ggml.c: contexts over a caller-owned metadata arena ---------------------------------------------------------

class metadata_arena:
    """The caller's ``std::vector<uint8_t> arena``: ``ggml_init`` with ``no_alloc`` places the tensor and graph
    structs in it from offset 0, so a rebuild puts them at the same addresses (here: the same objects)."""

    def __init__(self, base: int):
        self.base, self.slots = base, {}

    def place(self, offset: int, cls, *args):
        obj = self.slots.get(offset)
        if type(obj) is not cls:
            obj = self.slots[offset] = cls.__new__(cls)
        obj.__init__(*args, addr=self.base + offset)                   # placement new
        return obj


class ggml_context:
    def __init__(self, mem_buffer: metadata_arena):
        self.mem_buffer, self.offs = mem_buffer, 0

    def alloc(self, cls, *args):
        obj = self.mem_buffer.place(self.offs, cls, *args)
        self.offs += 0x150                                             # GGML_OBJECT_SIZE + sizeof(ggml_tensor)
        return obj


def ggml_init(mem_buffer: metadata_arena) -> ggml_context:
    return ggml_context(mem_buffer)


class ggml_tensor:
    def __init__(self, op, ne, src, *, addr):
        self.op, self.ne, self.src, self.addr = op, ne, list(src), addr
        self.type, self.flags = GGML_TYPE_F32, set()
        self.buffer, self.data = None, None

    def view(self) -> torch.Tensor:
        off = self.data - self.buffer.base
        return self.buffer.mem[off:off + self.ne]


def ggml_new_tensor_1d(ctx, type_, n):
    return ctx.alloc(ggml_tensor, GGML_OP_NONE, n, ())


def ggml_neg(ctx, a):
    return ctx.alloc(ggml_tensor, GGML_OP_NEG, a.ne, (a,))


def ggml_sqr(ctx, a):
    return ctx.alloc(ggml_tensor, GGML_OP_SQR, a.ne, (a,))


def ggml_set_input(t):
    t.flags.add("input")


def ggml_set_output(t):
    t.flags.add("output")


class ggml_cgraph:
    def __init__(self, size, *, addr):
        self.size, self.addr, self.nodes, self.leafs = size, addr, [], []
        self.uid = 0                                                   # only the scheduler assigns a generation uid

    @property
    def n_nodes(self):
        return len(self.nodes)


def ggml_new_graph_custom(ctx, size, grads):
    return ctx.alloc(ggml_cgraph, size)


def ggml_build_forward_expand(cgraph, tensor):
    for s in tensor.src:
        ggml_build_forward_expand(cgraph, s)
    bucket = cgraph.nodes if tensor.op != GGML_OP_NONE else cgraph.leafs
    if tensor not in bucket:
        bucket.append(tensor)


# --- ggml-backend: one device buffer -----------------------------------------------------------------------------

class ggml_backend_buffer:
    def __init__(self, n_floats, device):
        self.base = 0x7F00_0000_0000
        self.mem = torch.zeros(n_floats, dtype=torch.float32, device=device)


def ggml_backend_tensor_alloc(buffer, tensor, addr):
    tensor.buffer, tensor.data = buffer, addr


def ggml_backend_tensor_set(tensor, values):
    tensor.view().copy_(values)


def ggml_backend_tensor_get(tensor):
    return tensor.view().clone()


# --- ggml-cuda.cu ------------------------------------------------------------------------------------------------

_skip_props_check = False                                              # static thread_local


def ggml_backend_cuda_set_skip_props_check(skip: bool) -> bool:
    global _skip_props_check
    previous, _skip_props_check = _skip_props_check, skip
    return previous


class ggml_cuda_graph:
    def __init__(self):
        self.instance, self.outputs = None, None                       # cudaGraphExec_t, the launch's outputs
        self.warmup_complete = False
        self.uid = 0
        self.node_props = []


class ggml_backend_cuda_context:
    def __init__(self, device):
        self.device, self.graphs = device, {}

    def cuda_graph(self, graph_key) -> ggml_cuda_graph:
        return self.graphs.setdefault(graph_key, ggml_cuda_graph())


def ggml_cuda_graph_get_key(cgraph):
    return cgraph.nodes[0].addr


def node_properties(node):
    """``memcpy(&prop.node, node, sizeof(ggml_tensor))`` plus the sources' data pointers, ne and nb."""
    return (node.op, node.ne, node.data, tuple(s.addr for s in node.src),
            tuple(s.data for s in node.src), tuple(s.ne for s in node.src))


def ggml_cuda_graph_update_required(cuda_ctx, cgraph) -> bool:
    res = False
    graph = cuda_ctx.cuda_graph(ggml_cuda_graph_get_key(cgraph))
    if cgraph.uid != 0 and cgraph.uid == graph.uid:
        return False
    graph.uid = cgraph.uid
    if len(graph.node_props) != cgraph.n_nodes:                        # Check if the graph size has changed
        res = True
        graph.node_props = [None] * cgraph.n_nodes
    for i, node in enumerate(cgraph.nodes):
        prop = node_properties(node)
        if res or graph.node_props[i] != prop:
            graph.node_props[i] = prop
            res = True
    return res


def ggml_cuda_compute_forward(dst):
    x = dst.src[0].view()
    if dst.op == GGML_OP_NEG:
        dst.view().copy_(torch.neg(x))
    elif dst.op == GGML_OP_SQR:
        dst.view().copy_(x * x)


def ggml_cuda_graph_evaluate(cgraph):
    for node in cgraph.nodes:
        ggml_cuda_compute_forward(node)
    return cgraph.nodes[-1].view()


def ggml_backend_cuda_graph_compute(cuda_ctx, cgraph):
    graph_key = ggml_cuda_graph_get_key(cgraph)
    graph = cuda_ctx.cuda_graph(graph_key)
    # A metadata arena can be rebuilt at the same address, producing the same pointer-derived graph key for a
    # different graph; the scheduler gives every split a new uid when that happens.
    if _variant == "bug":
        same_graph_generation = cgraph.uid == graph.uid                # a direct graph: 0 == 0
    else:
        same_graph_generation = cgraph.uid != 0 and cgraph.uid == graph.uid
    can_skip_props_check = (_skip_props_check and graph.warmup_complete and graph.instance is not None
                            and same_graph_generation)
    properties_changed = False if can_skip_props_check else ggml_cuda_graph_update_required(cuda_ctx, cgraph)

    use_cuda_graph = cuda_graph_update_required = False
    if not graph.warmup_complete:
        # Warmup: need at least 2 calls with no property change on the 2nd call
        if not properties_changed:
            graph.warmup_complete = True
            use_cuda_graph = cuda_graph_update_required = True
    elif properties_changed:
        graph.warmup_complete = False                                  # execute directly until stable again
    else:
        use_cuda_graph, cuda_graph_update_required = True, graph.instance is None

    if not use_cuda_graph:
        with events.warmup():
            ggml_cuda_graph_evaluate(cgraph)
        return
    if cuda_graph_update_required:         # cudaStreamBeginCapture ... EndCapture, instantiate / cudaGraphExecUpdate
        src = cgraph.nodes[0].src[0]
        graph.instance, graph.outputs = capture(
            lambda: ggml_cuda_graph_evaluate(cgraph), device=cuda_ctx.device, warmups=0,
            name=f"ggml graph {graph_key:#x}", owner="ggml-cuda graph cache",
            static={"input": src.view()})
    replay(graph.instance, graph.outputs)                              # cudaGraphLaunch


# --- the regression's direct-backend workload --------------------------------------------------------------------

def run_arm(device: str, use_graphs: bool):
    cuda_ctx = ggml_backend_cuda_context(device)
    output_offset = -(-N // TENSOR_ALIGNMENT) * TENSOR_ALIGNMENT
    buffer = ggml_backend_buffer(output_offset + N, device)
    arena = metadata_arena(0x5555_0000_0000)
    previous_skip = ggml_backend_cuda_set_skip_props_check(False)
    results = []
    for generation in range(2):
        ctx = ggml_init(arena)
        inp = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, N)
        ggml_set_input(inp)
        out = ggml_neg(ctx, inp) if generation == 0 else ggml_sqr(ctx, inp)
        ggml_set_output(out)
        ggml_backend_tensor_alloc(buffer, inp, buffer.base)
        ggml_backend_tensor_alloc(buffer, out, buffer.base + output_offset)
        cgraph = ggml_new_graph_custom(ctx, 16, False)
        ggml_build_forward_expand(cgraph, out)
        assert cgraph.uid == 0 and cgraph.n_nodes == 1
        ggml_backend_cuda_set_skip_props_check(generation == 1)       # the caller forces the bypass
        for submission in range(SUBMISSIONS):
            values = torch.arange(N, dtype=torch.float32) + (2 if generation == 0 else 3) + 10 * submission
            ggml_backend_tensor_set(out, torch.full((N,), -99999.0))
            ggml_backend_tensor_set(inp, values.to(device))
            if use_graphs:
                ggml_backend_cuda_graph_compute(cuda_ctx, cgraph)
            else:                                                      # ggml_backend_cuda_set_graphs_disabled_override
                ggml_cuda_graph_evaluate(cgraph)
            results.append(ggml_backend_tensor_get(out))
    ggml_backend_cuda_set_skip_props_check(previous_skip)
    return results


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: run_arm(device, True),
                   lambda: run_arm(device, False))
