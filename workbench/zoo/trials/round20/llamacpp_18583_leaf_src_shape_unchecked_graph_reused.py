"""A graph input that is a leaf, not a node, changes shape: the CUDA graph's reuse check never looks at it.

Upstream: https://github.com/ggml-org/llama.cpp/pull/18583 ("ggml-cuda: check for srcs outside the cgraph",
superseding #18561 "cuda : check src shapes for CUDA graphs"; synced to ggml as commit e48d7565).
Symptom: ``test-backend-ops`` failures on CUDA (raised in the backend-sampling PR #17004, January 2026): a run of
graphs that each hold a single ``ggml_top_k()`` node returned wrong indices for some cases. "For constant ``k``
the output tensor of this node has the same shape, but the ``src`` tensor shape is different. With the logic on
master we incorrectly determine that the node properties match and the CUDA graph is being reused."
Mechanism: ``ggml_backend_cuda_graph_compute`` re-captures only when ``is_cuda_graph_update_required`` says
so; that function saves and compares ``ggml_graph_node_properties`` (data address, op, ``ne``/``nb``, the sources'
data addresses, some op params) of the graph's *nodes* only. The input of the ``top_k`` node is a *leaf*
(``cgraph->leafs``): its ``ne`` is nowhere in the comparison, and since each case's input is allocated at the
address the previous case's buffer was freed from, its data address matches too. So a case whose input has fewer
columns is served by the executable captured for the previous case: ``ggml_cuda_op_top_k`` passed ``ncols =
src0->ne[0]`` (and the row stride it implies) to the kernels at capture, the replay sorts the old number of
columns per row, reading past the new input into what the previous case left in the buffer, and returns indices
that the new input does not even have.
Doctor: warmup-divergence, at ``is_cuda_graph_update_required`` (the capture fixed the input's shape; the reuse
decision does not look at the leaf that carries it, while an eager step sorts the input as it now is).
Fix (upstream): the properties vector grows to ``n_nodes + n_leafs``, and a second loop compares and records
every leaf's properties as well, so a leaf whose shape (or address) changed forces a re-capture. (Diff read in the
ggml sync commit; the leaf-based check was later extended again by #19165 for splits without leafs.)
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/ggml-org/llama.cpp/pull/18583"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "is_cuda_graph_update_required"
SYMPTOM = "test-backend-ops TOP_K cases with a narrower input reuse the previous case's CUDA graph: wrong indices"

GGML_OP_NONE, GGML_OP_TOP_K = "NONE", "TOP_K"
GGML_TYPE_F32, GGML_TYPE_I32 = "f32", "i32"
TYPE_SIZE = {GGML_TYPE_F32: 4, GGML_TYPE_I32: 4}
GGML_MAX_DIMS, GGML_MAX_SRC = 4, 10
ARENA = 64                                           # elements of each device allocation
# test-backend-ops cases run back to back on the same CUDA backend: TOP_K(type, ne=[ncols, nrows], k)
CASES = [((8, 2), 3), ((6, 2), 3), ((8, 2), 3), ((8, 2), 3), ((5, 2), 3)]


class cuda_device_memory:
    """cudaMalloc / cudaFree for the test buffers: a buffer freed at the end of a case is handed out again at
    the same address to the next case (one block per type here), with whatever the last case left in it."""

    def __init__(self, device):
        self.blocks = {GGML_TYPE_F32: (0x7F00_0000_0000, torch.zeros(ARENA, device=device)),
                       GGML_TYPE_I32: (0x7F00_1000_0000, torch.zeros(ARENA, dtype=torch.int32, device=device))}

    def malloc(self, type_):
        return self.blocks[type_]


class ggml_tensor:
    def __init__(self, name, op, type_, ne, src=()):
        self.name, self.op, self.type = name, op, type_
        self.ne = tuple(ne) + (1,) * (GGML_MAX_DIMS - len(ne))
        nb = [TYPE_SIZE[type_]]
        for d in self.ne[:-1]:
            nb.append(nb[-1] * d)
        self.nb = tuple(nb)
        self.src = list(src) + [None] * (GGML_MAX_SRC - len(src))
        self.op_params = (0,) * 16
        self.data: int | None = None
        self.mem: torch.Tensor | None = None

    def nelements(self):
        n = 1
        for d in self.ne:
            n *= d
        return n

    def view(self) -> torch.Tensor:
        """The device memory at ``data`` as this tensor's rows: [ne1, ne0]."""
        return self.mem[: self.nelements()].view(self.ne[1], self.ne[0])


class ggml_cgraph:
    def __init__(self, nodes, leafs):
        self.nodes, self.leafs = nodes, leafs
        self.n_nodes, self.n_leafs = len(nodes), len(leafs)


class ggml_graph_node_properties:
    def __init__(self):
        self.node_address = None
        self.node_op = None
        self.ne = (0,) * GGML_MAX_DIMS
        self.nb = (0,) * GGML_MAX_DIMS
        self.src_address = (None,) * GGML_MAX_SRC
        self.op_params = (0,) * 16


def set_ggml_graph_node_properties(node, props):
    props.node_address = node.data
    props.node_op = node.op
    props.ne, props.nb = node.ne, node.nb
    props.src_address = tuple(s.data if s is not None else None for s in node.src)
    props.op_params = node.op_params


def ggml_graph_node_has_matching_properties(node, props) -> bool:
    if node.data != props.node_address:
        return False
    if node.op != props.node_op:
        return False
    if node.ne != props.ne or node.nb != props.nb:
        return False
    for i in range(GGML_MAX_SRC):
        if node.src[i] is not None and node.src[i].data != props.src_address[i]:
            return False
    return True


class ggml_cuda_graph:
    def __init__(self):
        self.instance = None
        self.outputs = None
        self.ggml_graph_properties: list[ggml_graph_node_properties] = []
        self.number_consecutive_updates = 0
        self.disable_due_to_too_many_updates = False


def is_cuda_graph_update_required(cuda_graph: ggml_cuda_graph, cgraph: ggml_cgraph, variant: str) -> bool:
    cuda_graph_update_required = cuda_graph.instance is None
    n_props = cgraph.n_nodes + (cgraph.n_leafs if variant == "fix" else 0)
    # Check if the graph size has changed
    if len(cuda_graph.ggml_graph_properties) != n_props:
        cuda_graph_update_required = True
        cuda_graph.ggml_graph_properties = [ggml_graph_node_properties() for _ in range(n_props)]
    # Loop over nodes in GGML graph to determine if CUDA graph update is required
    # and store properties to allow this comparison for the next token
    for i, node in enumerate(cgraph.nodes):
        props = cuda_graph.ggml_graph_properties[i]
        if not cuda_graph_update_required and not ggml_graph_node_has_matching_properties(node, props):
            cuda_graph_update_required = True
        set_ggml_graph_node_properties(node, props)
    if variant == "fix":
        for i, leaf in enumerate(cgraph.leafs):
            props = cuda_graph.ggml_graph_properties[cgraph.n_nodes + i]
            if not cuda_graph_update_required and not ggml_graph_node_has_matching_properties(leaf, props):
                cuda_graph_update_required = True
            set_ggml_graph_node_properties(leaf, props)
    return cuda_graph_update_required


def ggml_cuda_op_top_k(dst: ggml_tensor):
    """Fallback path (argsort + 2D copy): the kernels get ``ncols``, ``nrows`` and ``k`` as launch arguments."""
    src0 = dst.src[0]
    ncols, nrows, k = src0.ne[0], src0.ne[1], dst.ne[0]
    rows = src0.mem[: ncols * nrows].view(nrows, ncols)
    tmp_dst = torch.argsort(rows, dim=-1, descending=True, stable=True)     # argsort_f32_i32_cuda_bitonic
    dst.mem[: k * nrows].view(nrows, k).copy_(tmp_dst[:, :k].to(torch.int32))  # cudaMemcpy2DAsync


def ggml_cuda_compute_forward(node: ggml_tensor):
    if node.op == GGML_OP_TOP_K:
        ggml_cuda_op_top_k(node)


def evaluate_cuda_graph(cgraph: ggml_cgraph):
    for node in cgraph.nodes:
        ggml_cuda_compute_forward(node)
    return cgraph.nodes[-1].view()


def ggml_backend_cuda_graph_compute(cuda_graph: ggml_cuda_graph, cgraph: ggml_cgraph, device: str, variant: str):
    use_cuda_graph = not cuda_graph.disable_due_to_too_many_updates
    update_required = is_cuda_graph_update_required(cuda_graph, cgraph, variant) if use_cuda_graph else False
    # Disable CUDA graphs (from the next token) if the use-case is demanding too many consecutive graph updates.
    cuda_graph.number_consecutive_updates = cuda_graph.number_consecutive_updates + 1 if update_required else 0
    if cuda_graph.number_consecutive_updates >= 4:
        cuda_graph.disable_due_to_too_many_updates = True
    if not use_cuda_graph:
        return evaluate_cuda_graph(cgraph)
    if update_required:          # cudaStreamBeginCapture ... cudaStreamEndCapture, instantiate / exec update
        leaf = cgraph.leafs[0]
        cuda_graph.instance, cuda_graph.outputs = capture(
            lambda: evaluate_cuda_graph(cgraph), device=device, warmups=0, name="test-backend-ops graph",
            static={"a (leaf input)": leaf.mem}, owner="ggml-cuda backend (cuda_ctx->cuda_graph)")
    return replay(cuda_graph.instance, cuda_graph.outputs)       # cudaGraphLaunch


def ggml_backend_alloc_ctx_tensors(tensors, memory: cuda_device_memory):
    for t in tensors:
        t.data, t.mem = memory.malloc(t.type)


def run(variant: str, device: str = "cpu"):
    gen = generator(18583)
    inputs = [torch.randn(ne[0] * ne[1], generator=gen) for ne, _ in CASES]

    def serve(graphed: bool):
        memory = cuda_device_memory(device)
        cuda_graph = ggml_cuda_graph()               # the CUDA backend's graph state lives across test cases
        outs = []
        for (ne, k), values in zip(CASES, inputs):
            a = ggml_tensor("a", GGML_OP_NONE, GGML_TYPE_F32, ne)
            out = ggml_tensor("out", GGML_OP_TOP_K, GGML_TYPE_I32, (k, ne[1]), src=(a,))
            ggml_backend_alloc_ctx_tensors([a, out], memory)
            a.mem[: a.nelements()].copy_(values.to(device))            # initialize_tensors: ggml_backend_tensor_set
            cgraph = ggml_cgraph(nodes=[out], leafs=[a])
            if graphed:
                res = ggml_backend_cuda_graph_compute(cuda_graph, cgraph, device, variant)
            else:                                                       # GGML_CUDA_DISABLE_GRAPHS=1
                res = evaluate_cuda_graph(cgraph)
            outs.append(res.clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
