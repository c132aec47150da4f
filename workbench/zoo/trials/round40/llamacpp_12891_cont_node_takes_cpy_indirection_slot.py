"""A CONT node's copy kernel takes a slot of the CUDA graph's KV-copy pointer table meant for a CPY node.

Upstream: https://github.com/ggml-org/llama.cpp/pull/12891 ("ggml: disable CUDA graphs for unsupported DUP
and CONT node types", fixes https://github.com/ggml-org/llama.cpp/issues/12798); the indirection it guards
came with https://github.com/ggml-org/llama.cpp/pull/9017 ("Simplify and improve CUDA graphs through use of
indirect copy pointers"); https://github.com/ggml-org/llama.cpp/pull/12970 later re-enabled graphs for these
nodes by letting ``ggml_cuda_dup`` opt out of the indirection (``disable_indirection_for_this_node``).
Symptom: after #9017, models whose decode graph contains CONT/DUP nodes gave wrong output with CUDA graphs
on (a regression reported in #12798); disabling CUDA graphs gave correct output.
Mechanism: with CUDA graphs, the KV-cache writes (``GGML_OP_CPY``) do not bake their destination: each
token, ``ggml_backend_cuda_graph_compute`` collects ``node->src[1]->data`` of every ``GGML_OP_CPY`` node
into ``cpy_dest_ptrs`` and ``ggml_cuda_cpy_dest_ptrs_copy`` copies them to the device table
``dest_ptrs_d`` (resetting ``graph_cpynode_index``); every copy kernel launched by ``ggml_cuda_cpy`` while
``use_cpy_indirection`` is on writes to ``cdst_indirect[graph_cpynode_index]`` and takes the next index,
an index baked into the captured kernel. ``ggml_cuda_dup`` (CONT and DUP nodes) also goes through
``ggml_cuda_cpy``, so it too takes an index, but the host never puts its destination into the table. A
CONT node before the KV writes therefore writes its result (the permuted Q) into the K-cache slot of this
token, the K write lands in the V slot, the V write reads the table past the pointers the host filled
(upstream: garbage/null, here the zero-initialised slack of the allocation, i.e. a scratch page), and the
CONT node's own destination is never written: attention reads the Q left there at capture.
Doctor: undersized-buffer, at ``ggml_cuda_dup`` (the graph holds three indirect copies, the pointer table
the host fills each step holds two: the CONT node's copy does not fit the table's contract).
Fix (upstream): in ``ggml_backend_cuda_graph_compute``, a graph containing ``GGML_OP_CONT`` or
``GGML_OP_DUP`` nodes disables CUDA graphs (``use_cuda_graph = false``), so it runs eagerly with direct
destinations. I read the PR's title and description and the post-#12970 ``cpy.cu`` (the
``disable_indirection`` path), not the #12891 diff itself; the modelled fix follows its title.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/ggml-org/llama.cpp/pull/12891"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "ggml_cuda_dup"
SYMPTOM = "decode output wrong with CUDA graphs when the graph has CONT/DUP nodes (correct with graphs off)"

N_EMBD, N_HEAD, MAX_POS = 4, 2, 6
HEAD_DIM = N_EMBD // N_HEAD
GGML_OP_MUL_MAT, GGML_OP_CONT, GGML_OP_CPY, GGML_OP_ATTN = "MUL_MAT", "CONT", "CPY", "ATTN"

# One device buffer (ggml's backend buffer), addressed by element offset ("pointers").
NULL_PAGE = 0                            # offset 0: what a zero pointer in the table reaches
Q_OUT = N_EMBD                           # the CONT node's destination
K_CACHE = 2 * N_EMBD                     # K cache: MAX_POS rows of N_EMBD
V_CACHE = K_CACHE + MAX_POS * N_EMBD     # V cache
BUF_ELEMS = V_CACHE + MAX_POS * N_EMBD
DEST_PTRS_ALLOC = 4                      # cudaMalloc granularity: the table has slack past its entries


class ggml_cuda_graph:
    def __init__(self, device):
        self.graph = None
        self.out = None
        self.use_cpy_indirection = False
        self.cpy_dest_ptrs: list[int] = []
        self.dest_ptrs_d = torch.zeros(DEST_PTRS_ALLOC, dtype=torch.long, device=device)
        self.dest_ptrs_size = 0
        self.graph_cpynode_index = -1


class ggml_backend_cuda_context:
    def __init__(self, device, variant, use_graphs):
        gen = generator(12891)
        self.device, self.variant, self.use_graphs = device, variant, use_graphs
        self.wq = randn(N_EMBD, N_EMBD, gen=gen, device=device, scale=0.8)
        self.wk = randn(N_EMBD, N_EMBD, gen=gen, device=device, scale=0.8)
        self.wv = randn(N_EMBD, N_EMBD, gen=gen, device=device, scale=0.8)
        self.buf = torch.zeros(BUF_ELEMS, device=device)               # compute + KV buffer
        self.inp_embd = torch.zeros(N_EMBD, device=device)              # graph input
        self.kq_mask = torch.full((MAX_POS,), float("-inf"), device=device)  # graph input
        self.ar = torch.arange(N_EMBD, device=device)
        self.cuda_graph = ggml_cuda_graph(device)
        self.tmp = {}


def cpy_flt(src, buf, cdst_direct, cdst_indirect, graph_cpynode_index, ar):
    """The copy kernel: ``cdst = cdst_indirect ? cdst_indirect[graph_cpynode_index] : cdst_direct``."""
    flat = src.reshape(-1)
    if cdst_indirect is not None:
        cdst = cdst_indirect[graph_cpynode_index]                      # read on the device, at replay
        buf.index_copy_(0, cdst + ar[: flat.numel()], flat)
    else:
        buf.narrow(0, cdst_direct, flat.numel()).copy_(flat)


def ggml_cuda_cpy(ctx, src0, dst_ptr):
    dest_ptrs_d, graph_cpynode_index = None, -1
    if ctx.cuda_graph.use_cpy_indirection:
        dest_ptrs_d, graph_cpynode_index = ctx.cuda_graph.dest_ptrs_d, ctx.cuda_graph.graph_cpynode_index
    cpy_flt(src0, ctx.buf, dst_ptr, dest_ptrs_d, graph_cpynode_index, ctx.ar)
    if ctx.cuda_graph.use_cpy_indirection:
        ctx.cuda_graph.graph_cpynode_index = graph_cpynode_index + 1


def ggml_cuda_dup(ctx, src0, dst_ptr):
    """CONT / DUP: the same copy kernel; before #12970 it took an indirection slot like a CPY node."""
    ggml_cuda_cpy(ctx, src0, dst_ptr)


def ggml_cuda_compute_forward(ctx, node):
    op = node["op"]
    if op == GGML_OP_MUL_MAT:
        ctx.tmp[node["name"]] = ctx.inp_embd @ getattr(ctx, node["w"])
    elif op == GGML_OP_CONT:          # permuted Q (heads-major view) made contiguous into Q_OUT
        ggml_cuda_dup(ctx, ctx.tmp["Qcur"].view(N_HEAD, HEAD_DIM).t(), node["dst"])
    elif op == GGML_OP_CPY:
        ggml_cuda_cpy(ctx, ctx.tmp[node["src"]], node["dst"])
    elif op == GGML_OP_ATTN:
        q = ctx.buf[Q_OUT:Q_OUT + N_EMBD].view(HEAD_DIM, N_HEAD).t()        # [head, head_dim]
        k = ctx.buf[K_CACHE:V_CACHE].view(MAX_POS, N_HEAD, HEAD_DIM)
        v = ctx.buf[V_CACHE:BUF_ELEMS].view(MAX_POS, N_HEAD, HEAD_DIM)
        kq = torch.einsum("hd,phd->hp", q, k) + ctx.kq_mask
        return torch.einsum("hp,phd->hd", torch.softmax(kq, -1), v).reshape(N_EMBD)
    return None


def build_graph(pos):
    """The decode cgraph of one token (llm_build_kv): Q/K/V, CONT of the permuted Q, the two KV writes."""
    return [
        {"op": GGML_OP_MUL_MAT, "name": "Qcur", "w": "wq"},
        {"op": GGML_OP_MUL_MAT, "name": "Kcur", "w": "wk"},
        {"op": GGML_OP_MUL_MAT, "name": "Vcur", "w": "wv"},
        {"op": GGML_OP_CONT, "dst": Q_OUT},
        {"op": GGML_OP_CPY, "src": "Kcur", "dst": K_CACHE + pos * N_EMBD},
        {"op": GGML_OP_CPY, "src": "Vcur", "dst": V_CACHE + pos * N_EMBD},
        {"op": GGML_OP_ATTN},
    ]


def evaluate(ctx, cgraph):
    out = None
    for node in cgraph:
        r = ggml_cuda_compute_forward(ctx, node)
        out = r if r is not None else out
    return out


def ggml_cuda_cpy_dest_ptrs_copy(cuda_graph, host_dest_ptrs, device):
    n = len(host_dest_ptrs)
    cuda_graph.dest_ptrs_d[:n].copy_(torch.tensor(host_dest_ptrs, dtype=torch.long, device=device))
    cuda_graph.dest_ptrs_size = max(cuda_graph.dest_ptrs_size, n)
    cuda_graph.graph_cpynode_index = 0                                   # reset index


def ggml_backend_cuda_graph_compute(ctx, cgraph):
    use_cuda_graph = ctx.use_graphs
    for node in cgraph:
        if ctx.variant == "fix" and node["op"] in (GGML_OP_CONT, "DUP"):
            use_cuda_graph = False                # unsupported node types: run this graph without CUDA graphs
    cg = ctx.cuda_graph
    if not use_cuda_graph:
        cg.use_cpy_indirection = False
        return evaluate(ctx, cgraph).clone()
    cg.use_cpy_indirection = True
    # Store the pointers which are updated for each token, such that these can be sent to the device
    # and accessed using indirection from the CUDA graph (only GGML_OP_CPY nodes).
    cg.cpy_dest_ptrs = [node["dst"] for node in cgraph if node["op"] == GGML_OP_CPY]
    ggml_cuda_cpy_dest_ptrs_copy(cg, cg.cpy_dest_ptrs, ctx.device)
    if cg.graph is None:                      # CPY destinations changing per token need no recapture
        cg.graph, cg.out = capture(lambda: evaluate(ctx, cgraph), device=ctx.device,
                                   owner="ggml_backend_cuda (decode graph)",
                                   static={"inp_embd": ctx.inp_embd, "kq_mask": ctx.kq_mask,
                                           "dest_ptrs_d": cg.dest_ptrs_d},
                                   state={"buf (KV cache)": ctx.buf}, warmups=0)
        cg.graph_cpynode_index = 0
    return replay(cg.graph, cg.out).clone()


def run(variant: str, device: str = "cpu"):
    gen = generator(1)
    tokens = [randn(N_EMBD, gen=gen, device=device) for _ in range(MAX_POS)]

    def serve(use_graphs: bool):
        ctx = ggml_backend_cuda_context(device, variant, use_graphs)
        outs = []
        for pos, x in enumerate(tokens):       # one decode token per step (llama_decode, n_tokens = 1)
            ctx.inp_embd.copy_(x)
            ctx.kq_mask[: pos + 1] = 0.0
            outs.append(ggml_backend_cuda_graph_compute(ctx, build_graph(pos)))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
