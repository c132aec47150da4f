"""A split input keeps its address but grows with n_kv: the graph property check misses it, replays the old shape.

Upstream: https://github.com/ggml-org/llama.cpp/pull/21736 ("CUDA: also store node->src ne/nb for graph
equality", fixes issue https://github.com/ggml-org/llama.cpp/issues/21726; synced to ggml as commit 6cc653d5).
Symptom: "Gemma4 models produce gibberish at some point with -nkvo" (April 2026, after #21472 / #21635): with
the KV cache kept on the host (``--no-kv-offload``) generation turns to garbage once the context grows past a
padding boundary; disabling CUDA graphs avoids it.
Mechanism: before replaying a split's CUDA graph, ``ggml_cuda_graph_update_required`` compares, per node, a
``memcpy`` of the node's ``ggml_tensor`` (op, own ``ne``/``nb``, ``data``, ``op_params``, the addresses of its
``src`` structs) plus, since #21635, ``node_src_data_ptrs`` (each source's ``data``). A source's *shape* is
not in it. With ``-nkvo`` the split's extra sources (the scheduler's input copies of the host-resident KV
view and the KQ mask) keep their ``data`` pointer while their ``ne``/``nb`` follow ``n_kv``, which grows by
the KV padding (256 upstream, "probably because of resizing the buffer every 256 tokens"). The node that
reads them (``FLASH_ATTN_EXT``) has an output shape independent of ``n_kv``, and the rebuilt graph's structs
sit at the same addresses, so every comparison matches and the executable captured at the old ``n_kv`` is
replayed: the attention kernel keeps its capture-time ``n_kv`` launch arguments and ignores every cached
token past it.
Doctor: warmup-divergence, at ``ggml_cuda_graph_update_required`` (capture fixed the sources' shapes; the reuse
decision does not look at them, while an eager step attends over the current ``n_kv``).
Fix (upstream): ``node_properties`` also stores ``node_src_ne[j]`` and ``node_src_nb[j]`` for every source
and includes them in the ``memcmp``, so a source whose shape changed forces a re-capture; props are now
stored only on a mismatch (``if (res || memcmp(...))``). (Diff read in the ggml sync commit: both hunks.
Which tensor changes shape under ``-nkvo`` is only described in the PR text; the input copies of the KV view
and mask are this program's reading of it.)
"""
from __future__ import annotations

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/ggml-org/llama.cpp/pull/21736"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "ggml_cuda_graph_update_required"
SYMPTOM = "gibberish with -nkvo once n_kv crosses its padding: the reused CUDA graph attends over the old n_kv"

GGML_OP_NONE, GGML_OP_MUL_MAT, GGML_OP_FLASH_ATTN_EXT, GGML_OP_ADD = "NONE", "MUL_MAT", "FLASH_ATTN_EXT", "ADD"
N_EMBD, VOCAB = 4, 8
KV_SIZE, KV_PAD = 16, 4             # n_kv is padded to KV_PAD (256 upstream)
TOKENS = [1, 5, 2, 7, 3, 6, 4, 0, 5, 2]


class ggml_backend_buffer:
    """A backend buffer: one allocation, tensors live at ``base + offset`` (their ``data`` pointer)."""

    _next_base = 0x7F3A_0000_0000

    def __init__(self, n_elements: int, device: str):
        self.base = ggml_backend_buffer._next_base
        ggml_backend_buffer._next_base += 0x1000_0000
        self.mem = torch.zeros(n_elements, device=device)

    def at(self, data: int, ne) -> torch.Tensor:
        off = data - self.base
        n = 1
        for d in ne:
            n *= d
        return self.mem[off:off + n].view(*reversed(ne))          # ggml ne[0] is the innermost dimension


class ggml_context:
    """The graph context: tensor structs are carved from one memory block, reset for every graph build,
    so a rebuilt graph's structs sit at the same addresses."""

    def __init__(self):
        self.mem_base, self.offs = 0x5555_0000, 0

    def reset(self):
        self.offs = 0

    def new_tensor(self, name, op, ne, src=(), op_params=()):
        t = ggml_tensor(name, op, ne, src, op_params, addr=self.mem_base + self.offs)
        self.offs += 0x150                                       # sizeof(ggml_tensor) + object header
        return t


class ggml_tensor:
    def __init__(self, name, op, ne, src, op_params, addr):
        self.name, self.op, self.ne, self.src, self.op_params = name, op, tuple(ne), list(src), tuple(op_params)
        self.nb = tuple(4 * n for n in _prefix_products(self.ne))
        self.addr = addr                          # where the struct itself lives (what node->src[j] holds)
        self.buffer: ggml_backend_buffer | None = None
        self.data: int | None = None

    def view(self) -> torch.Tensor:
        return self.buffer.at(self.data, self.ne)


def _prefix_products(ne):
    out, p = [], 1
    for d in ne:
        out.append(p)
        p *= d
    return out


class ggml_cgraph:
    def __init__(self, nodes):
        self.nodes = nodes
        self.n_nodes = len(nodes)


class node_properties:
    """``ggml_cuda_graph::node_properties``: a copy of the node struct, the sources' data pointers and, with
    the fix, the sources' ``ne``/``nb``."""

    def __init__(self, node: ggml_tensor, variant: str):
        self.node = (node.op, node.ne, node.nb, node.data, node.op_params, tuple(s.addr for s in node.src))
        self.node_src_data_ptrs = tuple(s.data for s in node.src)
        if variant == "fix":
            self.node_src_ne = tuple(s.ne for s in node.src)
            self.node_src_nb = tuple(s.nb for s in node.src)
        else:
            self.node_src_ne = self.node_src_nb = ()

    def key(self):
        return self.node, self.node_src_data_ptrs, self.node_src_ne, self.node_src_nb


class ggml_cuda_graph:
    def __init__(self):
        self.instance = None
        self.outputs = None
        self.node_props: list[node_properties | None] = []
        self.warmup_complete = False


class ggml_backend_cuda_context:
    def __init__(self):
        self.graphs: dict[int, ggml_cuda_graph] = {}

    def cuda_graph(self, graph_key) -> ggml_cuda_graph:
        return self.graphs.setdefault(graph_key, ggml_cuda_graph())


def ggml_cuda_graph_get_key(cgraph: ggml_cgraph):
    return cgraph.nodes[0].addr


def ggml_cuda_graph_update_required(cuda_ctx, cgraph: ggml_cgraph, variant: str) -> bool:
    res = False
    graph = cuda_ctx.cuda_graph(ggml_cuda_graph_get_key(cgraph))
    # Check if the graph size has changed
    if len(graph.node_props) != cgraph.n_nodes:
        res = True
        graph.node_props = [None] * cgraph.n_nodes
    for i, node in enumerate(cgraph.nodes):
        prop = node_properties(node, variant)
        old = graph.node_props[i]
        differs = old is None or old.key() != prop.key()          # memcmp
        if variant == "fix":
            if res or differs:
                graph.node_props[i] = prop
                res = True
        else:
            if not res and differs:
                res = True
            graph.node_props[i] = prop
    return res


def ggml_cuda_mul_mat(dst: ggml_tensor):
    a, b = dst.src                                    # dst = a x b (a: weights, ne = [n_in, n_out])
    dst.view().copy_(b.view() @ a.view().T)


def ggml_cuda_flash_attn_ext(dst: ggml_tensor):
    """The FA kernel is launched with ``K->ne[1]`` (n_kv), the strides ``nb`` and the mask's shape as
    arguments: the captured launch keeps them."""
    Q, K, V, mask = dst.src
    n_kv = K.ne[1]
    k, v = K.view()[:n_kv], V.view()[:n_kv]           # [n_kv, D]
    kq = k @ Q.view() / N_EMBD ** 0.5 + mask.view()
    dst.view().copy_(torch.softmax(kq, 0) @ v)


def ggml_cuda_compute_forward(dst: ggml_tensor):
    if dst.op == GGML_OP_MUL_MAT:
        ggml_cuda_mul_mat(dst)
    elif dst.op == GGML_OP_FLASH_ATTN_EXT:
        ggml_cuda_flash_attn_ext(dst)
    elif dst.op == GGML_OP_ADD:
        dst.view().copy_(dst.src[0].view() + dst.src[1].view())


def ggml_cuda_graph_evaluate(cgraph: ggml_cgraph) -> torch.Tensor:
    for node in cgraph.nodes:
        ggml_cuda_compute_forward(node)
    return cgraph.nodes[-1].view()


def ggml_backend_cuda_graph_compute(cuda_ctx, cgraph: ggml_cgraph, device: str, variant: str):
    """Warm-up: two calls with no property change before capturing; a change after warm-up resets it
    (the split runs eagerly until the properties are stable again)."""
    graph = cuda_ctx.cuda_graph(ggml_cuda_graph_get_key(cgraph))
    properties_changed = ggml_cuda_graph_update_required(cuda_ctx, cgraph, variant)
    use_cuda_graph, update_required = False, False
    if not graph.warmup_complete:
        if not properties_changed:
            graph.warmup_complete = True
            use_cuda_graph, update_required = True, True
    elif properties_changed:
        graph.warmup_complete = False
    else:
        use_cuda_graph, update_required = True, graph.instance is None
    if not use_cuda_graph:
        with events.warmup():
            return ggml_cuda_graph_evaluate(cgraph)
    if update_required:              # cudaStreamBeginCapture ... EndCapture, cudaGraphExecUpdate / instantiate
        k, v, mask = cgraph.nodes[1].src[1:]
        graph.instance, graph.outputs = capture(
            lambda: ggml_cuda_graph_evaluate(cgraph), device=device, warmups=0, name="attn split",
            static={"inp_embd (copy)": cgraph.nodes[0].src[1].view(), "k_cache view (copy)": k.view(),
                    "v_cache view (copy)": v.view(), "kq_mask (copy)": mask.view()},
            owner="ggml-cuda graph (split 1)")
    return replay(graph.instance, graph.outputs)                # cudaGraphLaunch


class Model:
    def __init__(self, device):
        gen = generator(21736)
        self.tok_embd = randn(VOCAB, N_EMBD, gen=gen, device=device)
        self.wk = randn(N_EMBD, N_EMBD, gen=gen, device=device, scale=0.6)
        self.wv = randn(N_EMBD, N_EMBD, gen=gen, device=device, scale=0.6)
        self.weights = ggml_backend_buffer(2 * N_EMBD * N_EMBD, device)     # CUDA0 model buffer
        self.wq_data, self.wo_data = self.weights.base, self.weights.base + N_EMBD * N_EMBD
        self.weights.mem[:N_EMBD * N_EMBD].copy_(randn(N_EMBD * N_EMBD, gen=gen, device=device, scale=0.6))
        self.weights.mem[N_EMBD * N_EMBD:].copy_(randn(N_EMBD * N_EMBD, gen=gen, device=device, scale=0.6))


def build_graph(ctx: ggml_context, model: Model, compute: ggml_backend_buffer, n_kv: int) -> ggml_cgraph:
    """``llm_build_*`` + ``ggml_gallocr_alloc_graph`` for the CUDA split. The split inputs get fixed slots of
    the compute buffer reserved for the worst case (``kv_size``), so only their ``ne`` follows ``n_kv``."""
    ctx.reset()
    wq = ctx.new_tensor("blk.0.attn_q.weight", GGML_OP_NONE, (N_EMBD, N_EMBD))
    wo = ctx.new_tensor("blk.0.attn_output.weight", GGML_OP_NONE, (N_EMBD, N_EMBD))
    for w, data in ((wq, model.wq_data), (wo, model.wo_data)):
        w.buffer, w.data = model.weights, data
    inp = ctx.new_tensor("inp_embd (copy)", GGML_OP_NONE, (N_EMBD,))
    k = ctx.new_tensor("cache_k_l0 (view) (copy)", GGML_OP_NONE, (N_EMBD, n_kv))
    v = ctx.new_tensor("cache_v_l0 (view) (copy)", GGML_OP_NONE, (N_EMBD, n_kv))
    mask = ctx.new_tensor("KQ_mask (copy)", GGML_OP_NONE, (n_kv,))
    q = ctx.new_tensor("Qcur-0", GGML_OP_MUL_MAT, (N_EMBD,), src=(wq, inp))
    fa = ctx.new_tensor("__fattn__-0", GGML_OP_FLASH_ATTN_EXT, (N_EMBD,), src=(q, k, v, mask))
    out = ctx.new_tensor("attn_out-0", GGML_OP_MUL_MAT, (N_EMBD,), src=(wo, fa))
    l_out = ctx.new_tensor("l_out-0", GGML_OP_ADD, (N_EMBD,), src=(out, inp))
    offs = 0
    for t, reserve in ((inp, N_EMBD), (k, N_EMBD * KV_SIZE), (v, N_EMBD * KV_SIZE), (mask, KV_SIZE),
                       (q, N_EMBD), (fa, N_EMBD), (out, N_EMBD), (l_out, N_EMBD)):
        t.buffer, t.data = compute, compute.base + offs
        offs += reserve
    return ggml_cgraph([q, fa, out, l_out])


def run(variant: str, device: str = "cpu"):
    model = Model(device)

    def serve(graphed: bool):
        ctx = ggml_context()
        compute = ggml_backend_buffer(5 * N_EMBD + 2 * N_EMBD * KV_SIZE + KV_SIZE, device)  # CUDA0 compute buffer
        k_cache = torch.zeros(KV_SIZE, N_EMBD, device=device)      # -nkvo: the KV cache stays in host memory
        v_cache = torch.zeros(KV_SIZE, N_EMBD, device=device)
        cuda_ctx = ggml_backend_cuda_context()
        cgraph, built_n_kv, outs = None, None, []
        for n_past, token in enumerate(TOKENS):
            n_kv = -(-(n_past + 1) // KV_PAD) * KV_PAD
            x = model.tok_embd[token]
            k_cache[n_past].copy_(x @ model.wk)                     # CPU split: cpy_k / cpy_v into the host cache
            v_cache[n_past].copy_(x @ model.wv)
            if n_kv != built_n_kv:                                  # llm_graph_result::can_reuse fails: rebuild
                cgraph, built_n_kv = build_graph(ctx, model, compute, n_kv), n_kv
            q, fa = cgraph.nodes[0], cgraph.nodes[1]
            inp, k, v, mask = q.src[1], fa.src[1], fa.src[2], fa.src[3]
            kq_mask = torch.where(torch.arange(n_kv) <= n_past, 0.0, float("-inf")).to(device)
            inp.view().copy_(x)                                     # ggml_backend_sched: copy the split inputs
            k.view().copy_(k_cache[:n_kv])
            v.view().copy_(v_cache[:n_kv])
            mask.view().copy_(kq_mask)
            if graphed:
                out = ggml_backend_cuda_graph_compute(cuda_ctx, cgraph, device, variant)
            else:                                                   # GGML_CUDA_DISABLE_GRAPHS=1
                out = ggml_cuda_graph_evaluate(cgraph)
            outs.append(out.clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
