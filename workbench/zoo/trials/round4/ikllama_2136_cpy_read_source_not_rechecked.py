"""A CPY node whose read source moved is exempt from the graph-reuse check: the replay reads the old window.

Upstream: https://github.com/ikawrakow/ik_llama.cpp/pull/2136 ("CUDA: re-capture the graph when a CPY
node's read-source address changes", commit a0a10da5a).
Symptom: openPangu-2.0-Flash with a q8_0 latent cache, ``-fa off``, greedy, CUDA graphs on: past ~600
tokens the output collapses into a repetition loop; with ``GGML_CUDA_DISABLE_GRAPHS`` it stays coherent
(ik_llama.cpp, July 2026).
Mechanism: before each decode step the CUDA backend replays the captured graph unless
``ggml_graph_node_has_matching_properties`` finds a node whose address, shape or source addresses changed,
and it exempted both operands of every ``GGML_OP_CPY`` from the source check (meant for KV-cache writes,
whose destination advances every token and is redirected at replay through the ``cpy_dest_ptrs`` table).
The sliding-window read of the latent K cache is also a CPY, a q8_0 -> F32 cast of a view at ``win_off``,
and ``win_off`` steps to the next padded block while every shape stays the same. No re-capture happens,
so each replay casts the previous window's rows and attention reads stale keys.
Doctor: warmup-divergence, at ``ggml_cuda_cpy`` (the captured cast still reads the capture-time window
while an eager step reads the current one).
Fix (upstream): keep the exemption for the CPY destination (``src[1]``) only and compare a CPY's read
source like any other source, so a moved window forces a re-capture.
"""
from __future__ import annotations

import math

import torch

from workbench.engine import CUDAGraphMode, GraphManager, events
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/ikawrakow/ik_llama.cpp/pull/2136"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "ggml_cuda_cpy"
SYMPTOM = "after the window steps to the next padded block, replays attend over the previous window's keys"
NAME = "ikllama_2136_cpy_read_source_not_rechecked"

VOCAB, D, KV_SIZE, PAD, WINDOW = 12, 4, 16, 4, 3
PROMPT = [3, 7, 1, 9, 4, 4, 10, 2, 6]                   # positions 0..8, prompt processing runs eagerly
DECODE = [5, 11, 0, 8, 3, 1]                            # one token per step at positions 9..14


# ---------------------------------------------------------------------------------------------- ggml
class ggml_tensor:
    """What the CUDA backend knows of a node when it decides whether the captured graph still fits it:
    ``data`` is the device address kernels are launched with, as (buffer, element offset)."""

    def __init__(self, name, op, data, ne, src=()):
        self.name, self.op, self.data, self.ne, self.src = name, op, data, tuple(ne), tuple(src)


class ggml_graph_node_properties:
    def __init__(self, node_address, node_op, ne, src_address):
        self.node_address, self.node_op, self.ne, self.src_address = node_address, node_op, ne, src_address


class ggml_cgraph:
    def __init__(self):
        self.nodes: list[ggml_tensor] = []
        self.evaluate = None        # the kernels of the graph, in node order (ggml_cuda_compute_forward)

    def add(self, name, op, data, ne, *src):
        node = ggml_tensor(name, op, data, tuple(ne), tuple(src))
        self.nodes.append(node)
        return node


def leaf(name, t):
    return ggml_tensor(name, "NONE", (name, 0), tuple(t.shape))


def llama_openpangu_calc_swa_window_view(n_kv, n_tokens, window, pad):
    unpadded = window + pad + n_tokens
    overcovered = ((unpadded + pad - 1) // pad) * pad if pad > 1 else unpadded
    w_view = min(overcovered, n_kv)
    return w_view, n_kv - w_view, w_view < n_kv


# --------------------------------------------------------------------------------------------- model
class Model:
    def __init__(self, device):
        gen = generator(2136)
        self.tok_embd = randn(VOCAB, D, gen=gen, device=device)
        self.wk = randn(D, D, gen=gen, device=device, scale=0.7)
        self.wq = randn(D, D, gen=gen, device=device, scale=0.7)
        self.output = randn(D, VOCAB, gen=gen, device=device, scale=0.5)


class llama_context:
    """Model, latent KV cache (q8_0 in the report; float16 here) and the graph inputs set per ubatch."""

    def __init__(self, model, device):
        self.model = model
        self.k_l = torch.zeros(KV_SIZE, D, dtype=torch.float16, device=device)
        self.inp_tokens = torch.zeros(1, dtype=torch.int64, device=device)
        self.w_view = llama_openpangu_calc_swa_window_view(KV_SIZE, 1, WINDOW, PAD)[0]
        self.kq_mask = torch.zeros(1, self.w_view, device=device)
        self.cpy_dest_ptrs = torch.zeros(1, dtype=torch.int64, device=device)   # ggml_cuda_graph::dest_ptrs_d
        self.use_cpy_indirection = False
        self.pos = 0

    def n_kv(self):
        return min(KV_SIZE, max(PAD, -(-(self.pos + 1) // PAD) * PAD))


def ggml_cuda_cpy(src0):
    """GGML_OP_CPY, q8_0 -> F32: the kernel reads its source at the address it was launched with."""
    return src0.to(torch.float32)


def ggml_cuda_cpy_kv_store(lctx, k_new, dst_view):
    """GGML_OP_CPY into the KV cache: under CUDA graphs the destination comes from the indirection table."""
    if lctx.use_cpy_indirection:
        lctx.k_l.index_copy_(0, lctx.cpy_dest_ptrs, k_new.to(lctx.k_l.dtype))
    else:
        dst_view.copy_(k_new.to(lctx.k_l.dtype))


def openpangu_build_k_latent_for_read(gf, lctx, k_l_leaf, n_kv_view, win_off):
    k_view = lctx.k_l.narrow(0, win_off, n_kv_view)                       # ggml_view_2d at win_off
    view = gf.add("k_view", "VIEW", ("k_l", win_off * D), (n_kv_view, D), k_l_leaf)
    node = gf.add("k_latent_f32", "CPY", ("compute", 2), (n_kv_view, D), view)
    node.src = (view, node)                                                # ggml_cast: src[1] is the result
    return k_view, node


def llm_build_openpangu(lctx):
    """The decode graph of one token: store its latent K, read the sliding window, attend (absorbed MLA)."""
    m, p = lctx.model, lctx.pos
    n_kv = lctx.n_kv()
    w_view, win_off, engaged = llama_openpangu_calc_swa_window_view(n_kv, 1, WINDOW, PAD)
    assert engaged and w_view == lctx.w_view
    gf = ggml_cgraph()
    tok_embd, wk, wq, output = (leaf(n, getattr(m, n)) for n in ("tok_embd", "wk", "wq", "output"))
    inp_tokens, kq_mask, k_l = leaf("inp_tokens", lctx.inp_tokens), leaf("kq_mask", lctx.kq_mask), leaf("k_l", lctx.k_l)
    inp_embd = gf.add("inp_embd", "GET_ROWS", ("compute", 0), (1, D), tok_embd, inp_tokens)
    k_new = gf.add("k_new", "MUL_MAT", ("compute", 1), (1, D), wk, inp_embd)
    dst = gf.add("k_cache_view", "VIEW", ("k_l", p * D), (1, D), k_l)
    gf.add("k_store", "CPY", ("k_l", p * D), (1, D), k_new, dst)
    dst_view = lctx.k_l.narrow(0, p, 1)
    k_view, k_lat = openpangu_build_k_latent_for_read(gf, lctx, k_l, w_view, win_off)
    q = gf.add("q", "MUL_MAT", ("compute", 3), (1, D), wq, inp_embd)
    kq = gf.add("kq", "MUL_MAT", ("compute", 4), (1, w_view), k_lat, q)
    kq = gf.add("kq_soft_max", "SOFT_MAX", ("compute", 5), (1, w_view), kq, kq_mask)
    kqv = gf.add("kqv", "MUL_MAT", ("compute", 6), (1, D), k_lat, kq)
    res = gf.add("ffn_inp", "ADD", ("compute", 7), (1, D), kqv, inp_embd)
    gf.add("result_output", "MUL_MAT", ("compute", 8), (1, VOCAB), output, res)

    def evaluate():
        h = m.tok_embd.index_select(0, lctx.inp_tokens)
        ggml_cuda_cpy_kv_store(lctx, h @ m.wk, dst_view)
        k_latent = ggml_cuda_cpy(k_view)
        scores = (h @ m.wq) @ k_latent.t() / math.sqrt(D) + lctx.kq_mask
        return (torch.softmax(scores, -1) @ k_latent + h) @ m.output

    gf.evaluate = evaluate
    gf.win_off = win_off
    return gf


def llama_set_inputs(lctx, gf, token):
    lctx.inp_tokens.fill_(token)
    keys = torch.arange(lctx.w_view, device=lctx.kq_mask.device) + gf.win_off
    masked = (keys > lctx.pos) | (lctx.pos - keys >= WINDOW)
    lctx.kq_mask.copy_(torch.where(masked, float("-inf"), 0.0)[None])


def prefill(lctx):
    m = lctx.model
    toks = torch.tensor(PROMPT, device=lctx.k_l.device)
    lctx.k_l[:len(PROMPT)] = (m.tok_embd[toks] @ m.wk).to(lctx.k_l.dtype)
    lctx.pos = len(PROMPT)


# ------------------------------------------------------------------------------------- ggml-cuda graphs
def set_ggml_graph_node_properties(node):
    return ggml_graph_node_properties(node.data, node.op, node.ne, tuple(s.data for s in node.src))


def ggml_graph_node_has_matching_properties(node, props, variant):
    if node.data != props.node_address and node.op not in ("CPY", "VIEW"):
        return False
    if node.op != props.node_op or node.ne != props.ne:
        return False
    for i, src in enumerate(node.src):
        if variant == "bug":
            exempt = node.op in ("CPY", "VIEW")                  # both CPY operands exempt
        else:
            exempt = node.op == "VIEW" or (node.op == "CPY" and i == 1)   # only the destination
        if src.data != props.src_address[i] and not exempt:
            return False
    return True


class ggml_cuda_graph:
    def __init__(self, lctx, device):
        self.lctx = lctx
        self.cgraph = None
        self.props: list[ggml_graph_node_properties] = []
        self.number_consecutive_updates = 0
        self.manager = GraphManager(lambda size: self.cgraph.evaluate(), [1], device=device,
                                    mode=CUDAGraphMode.FULL, num_warmups=0, name="ggml-cuda graph",
                                    static_buffers={"inp_tokens": lctx.inp_tokens, "kq_mask": lctx.kq_mask,
                                                    "cpy_dest_ptrs": lctx.cpy_dest_ptrs})

    def is_cuda_graph_update_required(self, cgraph, variant):
        required = not self.manager.graphs or len(self.props) != len(cgraph.nodes)
        matches = [not required and ggml_graph_node_has_matching_properties(n, pr, variant)
                   for n, pr in zip(cgraph.nodes, self.props)]
        self.props = [set_ggml_graph_node_properties(n) for n in cgraph.nodes]
        return required or not all(matches)

    def check_node_graph_compatibility_and_refresh_copy_ops(self, cgraph):
        # destinations of CPY nodes, sent to the device for indirection (the cast's is the compute buffer)
        store = next(n for n in cgraph.nodes if n.name == "k_store")
        self.lctx.cpy_dest_ptrs.fill_(store.src[1].data[1] // D)
        self.lctx.use_cpy_indirection = True


def ggml_backend_cuda_graph_compute(graph: ggml_cuda_graph, cgraph, variant):
    update_required = graph.is_cuda_graph_update_required(cgraph, variant)
    graph.check_node_graph_compatibility_and_refresh_copy_ops(cgraph)
    graph.number_consecutive_updates = graph.number_consecutive_updates + 1 if update_required else 0
    assert graph.number_consecutive_updates < 4
    graph.cgraph = cgraph
    if update_required:                       # capture (nothing runs), then instantiate / update the exec
        if graph.manager.graphs:
            graph.manager.recapture()
        else:
            graph.manager.capture()
    return graph.manager.replay(1, real=1)    # cudaGraphLaunch


def run(variant: str, device: str = "cpu"):
    model = Model(device)

    def serve(graphed: bool):
        lctx = llama_context(model, device)
        prefill(lctx)
        graph = None
        if graphed:
            events.persistent_state("ggml-cuda backend", {"k_l": lctx.k_l})
            graph = ggml_cuda_graph(lctx, device)
        logits = []
        for token in DECODE:
            gf = llm_build_openpangu(lctx)
            llama_set_inputs(lctx, gf, token)
            if graph is None:
                logits.append(gf.evaluate())
            else:
                logits.append(ggml_backend_cuda_graph_compute(graph, gf, variant).clone())
            lctx.pos += 1
        return logits

    return compare(NAME, variant, device, lambda: serve(True), lambda: serve(False))
