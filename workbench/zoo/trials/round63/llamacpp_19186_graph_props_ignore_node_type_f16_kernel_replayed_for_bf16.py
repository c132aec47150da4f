"""A graph that differs only in a dtype (F16 -> BF16, same size) passes the CUDA graph reuse check, which ignores the type: the F16 kernel is relaunched.

Upstream: https://github.com/ggml-org/llama.cpp/pull/19186 ("add tensor type checking as part of cuda graph
properties", merged 2026-01-29; synced to ggml as ggml-org/ggml@00d7d43e). Motivated by
https://github.com/ggml-org/llama.cpp/pull/15805#issuecomment-3818986820 (conv/im2col tests).
Symptom: ``test-backend-ops`` on CUDA reports wrong results (NMSE far above the limit against the CPU backend) for a
case whose graph differs from the previous case's only in a type, e.g. ``CPY(type_src=f32,type_dst=bf16)`` right
after ``CPY(type_src=f32,type_dst=f16)`` of the same shape; with ``GGML_CUDA_DISABLE_GRAPHS=1`` it passes.
Mechanism: ``ggml_backend_cuda_graph_compute`` asks ``ggml_cuda_graph_update_required`` whether the instantiated
``cudaGraphExec_t`` of this graph key (``cgraph->nodes[0]``, the same address for every case, since each case's
context is laid out alike) can be relaunched. It compares each node, and each source outside the graph (``extra``),
with ``ggml_cuda_graph_node_properties_match`` against what ``ggml_cuda_graph_node_set_properties`` stored: data
address, op, ``ne``/``nb``, the sources' addresses, op params, flags, but not ``type``. F16 and BF16 have the same
element size, so ``nb`` is equal, and ggml-alloc puts the tensors at the same offsets: everything matches. At capture
the host dispatcher ``ggml_cuda_cpy`` chose the kernel from ``src0->type``/``dst->type`` (``cpy_f32_f16``); the
replay writes F16 bits into the tensor that the test then reads back (``ggml_backend_tensor_get`` + the type's
``to_float``) as BF16, while an eager run picks ``cpy_f32_bf16``.
Doctor: warmup-divergence, at ``ggml_cuda_graph_node_properties_match`` (the capture fixed the kernel by dtype; the
reuse check ignores the dtype, so a replay keeps the old kernel while an eager step picks the new one).
Fix (upstream): ``ggml_cuda_graph_node_properties`` gains ``node_type``; ``ggml_cuda_graph_node_set_properties``
stores ``node->type`` and ``ggml_cuda_graph_node_properties_match`` returns false when it differs, so the graph is
re-captured (for the nodes and, through the same function, for the ``extra`` sources).
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/ggml-org/llama.cpp/pull/19186"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "ggml_cuda_graph_node_properties_match"
SYMPTOM = "test-backend-ops: a CPY to bf16 right after the same CPY to f16 returns garbage with CUDA graphs on"

GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16 = "f32", "f16", "bf16"
TYPE_TORCH = {GGML_TYPE_F32: torch.float32, GGML_TYPE_F16: torch.float16, GGML_TYPE_BF16: torch.bfloat16}
TYPE_SIZE = {GGML_TYPE_F32: 4, GGML_TYPE_F16: 2, GGML_TYPE_BF16: 2}
GGML_OP_NONE, GGML_OP_CPY = "NONE", "CPY"
TENSOR_ALIGNMENT, BUFFER_SIZE, NE = 128, 4096, (32, 4)


class ggml_tensor:
    def __init__(self, ctx, type_, ne, op=GGML_OP_NONE, src=()):
        self.type, self.ne, self.op, self.src = type_, tuple(ne), op, list(src)
        self.nb = (TYPE_SIZE[type_], TYPE_SIZE[type_] * self.ne[0])
        self.address = ctx.new_object()            # where the struct lives in the context's memory pool
        self.data, self.flags = None, 0

    def nbytes(self):
        return self.nb[1] * self.ne[1]


class ggml_context:
    """ggml_init with the same mem_size each case: the n-th tensor struct lands at the same address."""

    def __init__(self):
        self.n_objects = 0

    def new_object(self):
        self.n_objects += 1
        return 0x1000 + 0x150 * self.n_objects


class ggml_backend_cuda_buffer:
    """The device buffer of the test's tensors; ggml-alloc places them at offsets that only depend on sizes."""

    def __init__(self, device):
        self.mem = torch.zeros(BUFFER_SIZE, dtype=torch.uint8, device=device)

    def alloc(self, tensors):
        offset = 0
        for t in tensors:
            t.data = offset
            offset += -(-t.nbytes() // TENSOR_ALIGNMENT) * TENSOR_ALIGNMENT

    def bytes_of(self, t):
        return self.mem[t.data:t.data + t.nbytes()]

    def as_typed(self, t):
        return self.bytes_of(t).view(TYPE_TORCH[t.type]).view(t.ne[1], t.ne[0])


def ggml_cuda_cpy(buf, src0, dst):
    """Host dispatch: the kernel template is chosen by the two types (it is what a capture bakes in)."""
    if src0.type == GGML_TYPE_F32 and dst.type == GGML_TYPE_F16:
        buf.bytes_of(dst).view(torch.float16).view(dst.ne[1], dst.ne[0]).copy_(buf.as_typed(src0))    # cpy_f32_f16
    elif src0.type == GGML_TYPE_F32 and dst.type == GGML_TYPE_BF16:
        buf.bytes_of(dst).view(torch.bfloat16).view(dst.ne[1], dst.ne[0]).copy_(buf.as_typed(src0))   # cpy_f32_bf16
    else:
        raise NotImplementedError(f"ggml_cuda_cpy: unsupported type combination ({src0.type} to {dst.type})")


class ggml_cuda_graph_node_properties:
    def __init__(self):
        self.node_data = self.node_op = self.node_type = None
        self.flags, self.ne, self.nb, self.src_data = 0, None, None, []


def ggml_cuda_graph_node_set_properties(props, node, variant):
    props.node_data, props.node_op, props.flags = node.data, node.op, node.flags
    if variant == "fix":
        props.node_type = node.type                    # props->node_type = node->type;
    props.ne, props.nb = node.ne, node.nb
    props.src_data = [s.data for s in node.src]


def ggml_cuda_graph_node_properties_match(node, props, variant) -> bool:
    if node.data != props.node_data or node.op != props.node_op:
        return False
    if variant == "fix" and node.type != props.node_type:
        return False                                   # if (node->type != props->node_type) return false;
    if node.ne != props.ne or node.nb != props.nb:     # f16 and bf16: same ne, same nb
        return False
    if [s.data for s in node.src] != props.src_data:
        return False
    return node.flags == props.flags


class ggml_cuda_graph:
    def __init__(self):
        self.instance, self.output = None, None
        self.props, self.extra = [], []
        self.number_consecutive_updates, self.disable_due_to_too_many_updates = 0, False

    def record_update(self, use_graph, update_required):
        self.number_consecutive_updates = self.number_consecutive_updates + 1 if use_graph and update_required else 0
        if self.number_consecutive_updates >= 4:
            self.disable_due_to_too_many_updates = True


def ggml_cuda_graph_update_required(graph, nodes, variant) -> bool:
    res = graph.instance is None
    for kind, tensors in (("props", nodes), ("extra", [s for n in nodes for s in n.src if s not in nodes])):
        stored = getattr(graph, kind)
        if len(stored) != len(tensors):
            res = True
            stored[:] = [ggml_cuda_graph_node_properties() for _ in tensors]
        for t, props in zip(tensors, stored):
            if not res and not ggml_cuda_graph_node_properties_match(t, props, variant):
                res = True
            ggml_cuda_graph_node_set_properties(props, t, variant)
    return res


class ggml_backend_cuda_context:
    def __init__(self, device, variant, disable_graphs):
        self.device, self.variant, self.disable_graphs = device, variant, disable_graphs
        self.cuda_graphs = {}

    def cuda_graph(self, key):
        return self.cuda_graphs.setdefault(key, ggml_cuda_graph())

    def ggml_backend_cuda_graph_compute(self, buf, nodes):
        graph = self.cuda_graph(nodes[0].address)      # ggml_cuda_graph_get_key: cgraph->nodes[0]
        use_cuda_graph = not (self.disable_graphs or graph.disable_due_to_too_many_updates)
        update_required = False
        if use_cuda_graph:
            update_required = ggml_cuda_graph_update_required(graph, nodes, self.variant)
            graph.record_update(use_cuda_graph, update_required)

        def evaluate():
            for node in nodes:                         # ggml_cuda_compute_forward
                ggml_cuda_cpy(buf, node.src[0], node)
            return buf.bytes_of(nodes[-1])

        if not use_cuda_graph:
            evaluate()
            return
        if update_required:                            # cudaStreamBeginCapture .. EndCapture, instantiate/update
            graph.instance, graph.output = capture(
                evaluate, device=self.device, warmups=0, name="test-backend-ops graph",
                owner="ggml-cuda (cuda_ctx->cuda_graph)", static={"src": buf.bytes_of(nodes[0].src[0])})
        replay(graph.instance, graph.output)           # cudaGraphLaunch


def test_cpy_eval(cuda_ctx, buf, type_dst, data):
    """One test-backend-ops case: build the graph in a fresh context, set the input, compute, read back."""
    ctx = ggml_context()
    src = ggml_tensor(ctx, GGML_TYPE_F32, NE)
    dst = ggml_tensor(ctx, type_dst, NE)
    out = ggml_tensor(ctx, type_dst, NE, GGML_OP_CPY, (src,))      # ggml_cpy(ctx, src, dst): a view of dst
    buf.alloc([src, dst])
    out.data = dst.data
    buf.as_typed(src).copy_(data)                      # ggml_backend_tensor_set
    cuda_ctx.ggml_backend_cuda_graph_compute(buf, [out])
    return buf.as_typed(out).to(torch.float32).clone() # ggml_backend_tensor_get + type_traits[out->type].to_float


def run(variant: str, device: str = "cpu"):
    gen = generator(19186)
    cases = [(GGML_TYPE_F16, randn(NE[1], NE[0], gen=gen, device=device)),
             (GGML_TYPE_BF16, randn(NE[1], NE[0], gen=gen, device=device)),
             (GGML_TYPE_F16, randn(NE[1], NE[0], gen=gen, device=device)),
             (GGML_TYPE_BF16, randn(NE[1], NE[0], gen=gen, device=device, scale=4.0))]

    def serve(graphed: bool):
        cuda_ctx = ggml_backend_cuda_context(device, variant, disable_graphs=not graphed)   # GGML_CUDA_DISABLE_GRAPHS
        buf = ggml_backend_cuda_buffer(device)
        return [test_cpy_eval(cuda_ctx, buf, type_dst, data) for type_dst, data in cases]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
