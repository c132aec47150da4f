"""A CUDA split of a partially offloaded graph has no leafs: the reuse check never sees its inputs' shapes, so a replay attends over the capture's KV length.

Upstream: https://github.com/ggml-org/llama.cpp/pull/19165 ("cuda : fix nkvo, offload and cuda graph node properties
matching", merged 2026-01-29; synced to ggml as commit a1bbd3e2). Fixes #19158 and #19169; continues #19105 and #18934.
Symptom: with CUDA graphs on and a graph split between the CPU and CUDA backends (``-nkvo`` with flash attention,
``--n-cpu-moe`` / individual op offload: per-split CUDA graphs exist since #18934), generation goes wrong:
the CUDA graph of a split is reused although one of the split's inputs changed. Correct with
``GGML_CUDA_DISABLE_GRAPHS=1``. PR text: "The assumption that all graph input nodes will be available as leafs
(#18583 review) is not always correct. When individual ops are offloaded, the created splits do not have leafs so
the leaf checks introduced in #18583 are not enough to validate that the CUDA graph does not need update."
Mechanism: ``ggml_backend_sched`` computes each split through ``split->graph = ggml_graph_view(graph, i_start,
i_end)``, a view with ``n_leafs = 0``. The split's inputs from the other backend are copies (``tensor_id_copy``,
same ``ne`` as the source) that the scheduler fills before it calls ``ggml_backend_graph_compute_async``; they are
``src`` of the split's nodes but neither nodes nor leafs of the split. With ``-nkvo`` the KV cache lives in host
memory, so the K and V views (``ne[1] = n_kv``, which grows with the context in steps of the KV padding) and the
KQ mask reach the CUDA ``FLASH_ATTN_EXT`` node as such copies. ``gallocr`` placed them at offsets fixed by the
worst-case reserve, so their ``data`` never moves. ``ggml_cuda_graph_update_required`` (ggml-cuda.cu) compares,
per node, the node's own ``data``/``op``/``ne``/``nb``/op params and its sources' ``data`` only, then the leafs'
full properties: the FA node's output shape does not depend on ``n_kv``, the copies' addresses match, and there
are no leafs, so it answers "no update" when ``n_kv`` grows. ``cudaGraphLaunch`` replays the FA kernel with the
``n_kv`` (``K->ne[1]``, the mask width) fixed at capture: the new token's K/V rows, written by the scheduler's
copy into the same buffer, are never attended to. Eager launches read ``K->ne[1]`` as it now is.
Doctor: warmup-divergence, at ggml_cuda_graph_update_required (the capture fixed the split inputs' shapes in the
FA launch; the reuse decision compares only nodes and the (absent) leafs, so it does not see that the inputs that
are neither changed shape, while an eager step attends over the current KV length).
Fix (upstream): ``ggml_cuda_graph_update_required`` collects every ``src`` of a node that is not itself a node of
the cgraph (``srcs_extra``) and records and compares its full properties in a new ``ggml_cuda_graph::extra``
vector (and drops the ``n_leafs`` part of ``props``); ``ggml_cuda_graph_node_set_properties`` memsets the props
and ``ggml_cuda_graph_node_properties_match`` also fails when a source went missing. (The ``fattn.cu`` part of the
PR, which lets the MLA kernel run when V is no view of K - as with ``-nkvo`` copies - is not modelled.)
Modelled: one decoder attention layer, single head, one token per ``llama_decode``; the CPU split stores K/V into
the host KV cache (``SET_ROWS``) and the CUDA split is ``Qcur = MUL_MAT(wq, x)``, ``FLASH_ATTN_EXT(Qcur, K, V,
mask)``, ``MUL_MAT(wo, kqv)`` with its four inputs as scheduler copies. Addresses are integers, device buffers
torch tensors (one fixed slot per tensor, as the worst-case reserve gives); the graph context hands out the same
tensor objects on a rebuild (same ``ctx_compute`` memory, same build order), so the CUDA graph key
(``cgraph->nodes[0]``) is the same. ``cudaStreamBeginCapture``/``cudaGraphLaunch`` are the kit's ``capture``/
``replay``; the sched's input copies run before the launch, outside the graph. No fusion, compatibility checks,
multiple streams, op params other than those kept.
"""
from __future__ import annotations

import math

import torch

from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/ggml-org/llama.cpp/pull/19165"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "ggml_cuda_graph_update_required"
SYMPTOM = ("with -nkvo (KV cache in host memory) the CUDA split's graph is reused after n_kv grew: "
           "flash attention ignores the newest KV rows")

GGML_OP_NONE, GGML_OP_MUL_MAT, GGML_OP_FLASH_ATTN_EXT, GGML_OP_VIEW = "NONE", "MUL_MAT", "FLASH_ATTN_EXT", "VIEW"
GGML_MAX_DIMS, GGML_MAX_SRC, GGML_MAX_OP_PARAMS = 4, 10, 16
N_EMBD, N_CTX, KV_PAD = 8, 16, 4            # head size = n_embd (one head); n_kv = GGML_PAD(n_past + 1, KV_PAD)
N_DECODE = 11


class ggml_tensor:
    def __init__(self):
        self.reset("", GGML_OP_NONE, (1,))

    def reset(self, name, op, ne, src=(), op_params=()):
        self.name, self.op, self.flags = name, op, 0
        self.ne = tuple(ne) + (1,) * (GGML_MAX_DIMS - len(ne))
        nb = [4]                                                       # f32
        for d in self.ne[:-1]:
            nb.append(nb[-1] * d)
        self.nb = tuple(nb)
        self.src = list(src) + [None] * (GGML_MAX_SRC - len(src))
        self.op_params = tuple(op_params) + (0,) * (GGML_MAX_OP_PARAMS - len(op_params))
        self.data, self.mem = None, None
        return self

    def nelements(self):
        return math.prod(self.ne)

    def view(self, *shape):
        """The device memory at ``data`` with this tensor's ``ne`` (rows: ne[1], columns: ne[0])."""
        return self.mem[: self.nelements()].view(*shape) if shape else self.mem[: self.nelements()]


class ggml_context:
    """``ctx_compute``: rebuilt for each graph from the same memory, so the n-th tensor created is the same
    object (the same ``ggml_tensor *``) in every build."""

    def __init__(self):
        self.slots, self.n = [], 0

    def reset(self):
        self.n = 0

    def new_tensor(self, name, op, ne, src=(), op_params=()):
        if self.n == len(self.slots):
            self.slots.append(ggml_tensor())
        t = self.slots[self.n].reset(name, op, ne, src, op_params)
        self.n += 1
        return t


class ggml_cgraph:
    def __init__(self, nodes, leafs):
        self.nodes, self.leafs = list(nodes), list(leafs)
        self.n_nodes, self.n_leafs = len(self.nodes), len(self.leafs)


def ggml_graph_view(cgraph: ggml_cgraph, i0: int, i1: int) -> ggml_cgraph:
    return ggml_cgraph(cgraph.nodes[i0:i1], leafs=())                  # n_leafs = 0


class ggml_gallocr:
    """The CUDA compute buffer: reserved once for the worst case (n_kv = n_ctx), after which every tensor of the
    split gets the same offset in every graph (no re-reserve is needed while the graph fits)."""

    def __init__(self, device, base):
        self.device, self.base, self.slots = device, base, {}

    def alloc(self, t: ggml_tensor, worst_case_elems: int):
        if t.name not in self.slots:
            self.slots[t.name] = (self.base + 0x1000 * len(self.slots), torch.zeros(worst_case_elems, device=self.device))
        t.data, t.mem = self.slots[t.name]


# --- ggml-cuda: graph properties -------------------------------------------------------------------

class ggml_cuda_graph_node_properties:
    def __init__(self):
        self.node_data, self.node_op, self.flags = None, None, 0
        self.ne, self.nb = (0,) * GGML_MAX_DIMS, (0,) * GGML_MAX_DIMS
        self.src_data = (None,) * GGML_MAX_SRC
        self.op_params = (0,) * GGML_MAX_OP_PARAMS


class ggml_cuda_graph:
    def __init__(self):
        self.instance, self.outputs = None, None
        self.number_consecutive_updates = 0
        self.disable_due_to_too_many_updates = False
        self.props: list[ggml_cuda_graph_node_properties] = []
        # these are extra tensors (inputs) that participate in the ggml graph but are not nodes (#19165)
        self.extra: list[ggml_cuda_graph_node_properties] = []

    def record_update(self, use_graph, update_required):
        if use_graph and update_required:
            self.number_consecutive_updates += 1
        else:
            self.number_consecutive_updates = 0
        if self.number_consecutive_updates >= 4:
            self.disable_due_to_too_many_updates = True

    def is_enabled(self):
        return not self.disable_due_to_too_many_updates


def ggml_cuda_graph_node_set_properties(props, node, variant):
    if variant == "fix":
        props.__init__()                                               # memset(props, 0, sizeof(...))
    props.node_data, props.node_op, props.flags = node.data, node.op, node.flags
    props.ne, props.nb = node.ne, node.nb
    props.src_data = tuple(s.data if s is not None else None for s in node.src)
    props.op_params = node.op_params


def ggml_cuda_graph_node_properties_match(node, props, variant) -> bool:
    if node.data != props.node_data and node.op != GGML_OP_VIEW:
        return False
    if node.op != props.node_op:
        return False
    if node.ne != props.ne or node.nb != props.nb:
        return False
    if node.op != GGML_OP_VIEW:
        for i in range(GGML_MAX_SRC):
            if node.src[i] is None:
                if variant == "fix" and props.src_data[i] is not None:
                    return False
                continue
            if node.src[i].data != props.src_data[i]:
                return False
    if node.op_params != props.op_params:
        return False
    return True


def ggml_cuda_graph_get_key(cgraph):
    return id(cgraph.nodes[0])


def ggml_cuda_graph_update_required(cuda_ctx, cgraph: ggml_cgraph, variant: str) -> bool:
    res = False
    graph = cuda_ctx.cuda_graph(ggml_cuda_graph_get_key(cgraph))
    if graph.instance is None:
        res = True

    if variant == "bug":
        # Check if the graph size has changed
        if len(graph.props) != cgraph.n_nodes + cgraph.n_leafs:
            res = True
            graph.props = [ggml_cuda_graph_node_properties() for _ in range(cgraph.n_nodes + cgraph.n_leafs)]
        for i, node in enumerate(cgraph.nodes):
            if not res and not ggml_cuda_graph_node_properties_match(node, graph.props[i], variant):
                res = True
            ggml_cuda_graph_node_set_properties(graph.props[i], node, variant)
        for i, leaf in enumerate(cgraph.leafs):                       # a split (ggml_graph_view) has none
            props = graph.props[cgraph.n_nodes + i]
            if not res and not ggml_cuda_graph_node_properties_match(leaf, props, variant):
                res = True
            ggml_cuda_graph_node_set_properties(props, leaf, variant)
        return res

    if len(graph.props) != cgraph.n_nodes:
        res = True
        graph.props = [ggml_cuda_graph_node_properties() for _ in range(cgraph.n_nodes)]
    seen_node, srcs_extra = set(), []
    for i, node in enumerate(cgraph.nodes):
        seen_node.add(id(node))
        if not res and not ggml_cuda_graph_node_properties_match(node, graph.props[i], variant):
            res = True
        ggml_cuda_graph_node_set_properties(graph.props[i], node, variant)
        for src in node.src:
            if src is not None and id(src) not in seen_node:
                srcs_extra.append(src)
    if len(graph.extra) != len(srcs_extra):
        res = True
        graph.extra = [ggml_cuda_graph_node_properties() for _ in srcs_extra]
    for i, src in enumerate(srcs_extra):
        if not res and not ggml_cuda_graph_node_properties_match(src, graph.extra[i], variant):
            res = True
        ggml_cuda_graph_node_set_properties(graph.extra[i], src, variant)
    return res


# --- ggml-cuda: kernels --------------------------------------------------------------------------------

def ggml_cuda_mul_mat(dst):
    w, x = dst.src[0], dst.src[1]
    dst.view().copy_(w.view(w.ne[1], w.ne[0]) @ x.view())


def ggml_cuda_flash_attn_ext(dst):
    Q, K, V, mask = dst.src[:4]
    D, n_kv = K.ne[0], K.ne[1]                                         # kernel launch parameters
    scale = dst.op_params[0] / 1e6
    kq = K.view(n_kv, D) @ Q.view() * scale + mask.view()
    p = torch.softmax(kq, dim=0)
    dst.view().copy_(V.view(n_kv, D).t() @ p)


def ggml_cuda_compute_forward(node):
    if node.op == GGML_OP_MUL_MAT:
        ggml_cuda_mul_mat(node)
    elif node.op == GGML_OP_FLASH_ATTN_EXT:
        ggml_cuda_flash_attn_ext(node)


def ggml_cuda_graph_evaluate_and_capture(cgraph):
    for node in cgraph.nodes:
        ggml_cuda_compute_forward(node)
    return cgraph.nodes[-1].view()


class ggml_backend_cuda_context:
    def __init__(self, device, variant, use_cuda_graphs):
        self.device, self.variant = device, variant
        self.use_cuda_graphs = use_cuda_graphs                        # not GGML_CUDA_DISABLE_GRAPHS
        self.cuda_graphs: dict = {}

    def cuda_graph(self, key) -> ggml_cuda_graph:
        return self.cuda_graphs.setdefault(key, ggml_cuda_graph())

    def graph_compute(self, cgraph: ggml_cgraph, static_inputs):
        """``ggml_backend_cuda_graph_compute``."""
        if not self.use_cuda_graphs:
            return ggml_cuda_graph_evaluate_and_capture(cgraph)
        graph = self.cuda_graph(ggml_cuda_graph_get_key(cgraph))
        use_cuda_graph = graph.is_enabled()
        update_required = False
        if use_cuda_graph:
            update_required = ggml_cuda_graph_update_required(self, cgraph, self.variant)
            graph.record_update(use_cuda_graph, update_required)
        if not use_cuda_graph:
            return ggml_cuda_graph_evaluate_and_capture(cgraph)
        if update_required:                # cudaStreamBeginCapture ... EndCapture, instantiate / exec update
            graph.instance, graph.outputs = capture(
                lambda: ggml_cuda_graph_evaluate_and_capture(cgraph), device=self.device, warmups=0,
                name="ggml-cuda split graph", static=static_inputs, owner="ggml-cuda backend (per-split cuda_graph)")
        return replay(graph.instance, graph.outputs)                  # cudaGraphLaunch


# --- llama: the layer graph and ggml_backend_sched ---------------------------------------------------

class ggml_backend_sched:
    """Two splits: CPU (KV store into the host KV cache, -nkvo) and CUDA (attention layer). The CUDA split's
    inputs from the CPU backend are copies in the CUDA compute buffer, filled before the split runs."""

    def __init__(self, device, variant, use_cuda_graphs, weights):
        self.device = device
        self.cuda = ggml_backend_cuda_context(device, variant, use_cuda_graphs)
        self.galloc = ggml_gallocr(device, base=0x7F00_0000_0000)
        self.ctx_compute = ggml_context()
        self.wq, self.wk, self.wv, self.wo = weights                  # CUDA weights buffer (wk/wv: CPU split)
        self.wq_t = ggml_tensor().reset("blk.0.attn_q.weight", GGML_OP_NONE, (N_EMBD, N_EMBD))
        self.wo_t = ggml_tensor().reset("blk.0.attn_output.weight", GGML_OP_NONE, (N_EMBD, N_EMBD))
        for t, w, addr in ((self.wq_t, self.wq, 0x7E00_0000_0000), (self.wo_t, self.wo, 0x7E00_0001_0000)):
            t.data, t.mem = addr, w.reshape(-1).to(device)
        # -nkvo: the KV cache is in host memory
        self.k_cache = torch.zeros(N_CTX, N_EMBD)
        self.v_cache = torch.zeros(N_CTX, N_EMBD)

    def decode(self, x: torch.Tensor, n_past: int):
        # CPU split: Kcur/Vcur and ggml_set_rows into the host KV cache
        self.k_cache[n_past] = self.wk @ x
        self.v_cache[n_past] = self.wv @ x
        n_kv = min(N_CTX, -(-(n_past + 1) // KV_PAD) * KV_PAD)
        mask = torch.full((n_kv,), -math.inf)
        mask[: n_past + 1] = 0.0                                       # llm_graph_input_attn_kv::set_input

        # graph build (llm_build_*): same ctx memory, same order -> same tensor objects
        ctx = self.ctx_compute
        ctx.reset()
        x_cpy = ctx.new_tensor("inp_embd#CUDA0", GGML_OP_NONE, (N_EMBD,))
        k_cpy = ctx.new_tensor("k_view#CUDA0", GGML_OP_NONE, (N_EMBD, n_kv))
        v_cpy = ctx.new_tensor("v_view#CUDA0", GGML_OP_NONE, (N_EMBD, n_kv))
        m_cpy = ctx.new_tensor("kq_mask#CUDA0", GGML_OP_NONE, (n_kv,))
        qcur = ctx.new_tensor("Qcur-0", GGML_OP_MUL_MAT, (N_EMBD,), src=(self.wq_t, x_cpy))
        kqv = ctx.new_tensor("__fattn__-0", GGML_OP_FLASH_ATTN_EXT, (N_EMBD,), src=(qcur, k_cpy, v_cpy, m_cpy),
                             op_params=(int(1e6 / math.sqrt(N_EMBD)),))
        out = ctx.new_tensor("attn_out-0", GGML_OP_MUL_MAT, (N_EMBD,), src=(self.wo_t, kqv))
        graph = ggml_cgraph([qcur, kqv, out], leafs=[x_cpy, k_cpy, v_cpy, m_cpy])

        # ggml_backend_sched_alloc_splits: worst-case reserve -> fixed offsets
        worst = {x_cpy: N_EMBD, k_cpy: N_CTX * N_EMBD, v_cpy: N_CTX * N_EMBD, m_cpy: N_CTX,
                 qcur: N_EMBD, kqv: N_EMBD, out: N_EMBD}
        for t, n in worst.items():
            self.galloc.alloc(t, n)

        # ggml_backend_sched_compute_splits: copy the split inputs, then compute the CUDA split
        x_cpy.view().copy_(x.to(self.device))
        k_cpy.view().copy_(self.k_cache[:n_kv].reshape(-1).to(self.device))
        v_cpy.view().copy_(self.v_cache[:n_kv].reshape(-1).to(self.device))
        m_cpy.view().copy_(mask.to(self.device))
        split = ggml_graph_view(graph, 0, graph.n_nodes)
        static_inputs = {"inp_embd (split input copy)": x_cpy.mem, "k_view (split input copy)": k_cpy.mem,
                         "v_view (split input copy)": v_cpy.mem, "kq_mask (split input copy)": m_cpy.mem}
        return self.cuda.graph_compute(split, static_inputs)


def run(variant: str, device: str = "cpu"):
    gen = generator(19165)
    weights = [torch.randn(N_EMBD, N_EMBD, generator=gen) / math.sqrt(N_EMBD) for _ in range(4)]
    tokens = [torch.randn(N_EMBD, generator=gen) for _ in range(N_DECODE)]

    def serve(graphed: bool):
        sched = ggml_backend_sched(device, variant, graphed, weights)
        outs = []
        for n_past, x in enumerate(tokens):                           # llama_decode, one token each
            outs.append(sched.decode(x, n_past).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
