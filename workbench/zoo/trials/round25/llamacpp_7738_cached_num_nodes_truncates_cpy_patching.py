"""After a smaller graph is captured, the cached node count truncates the list of kernels patched per token.

Upstream: https://github.com/ggml-org/llama.cpp/pull/7738 ("Allow number of nodes in CUDA graph to change",
June 2024; also in ik_llama.cpp as 3a57b9a).
Symptom: "Previously the code would have failed to cope in the case that the number of nodes changes in an
existing CUDA graph" (PR description; no separate report). Here: after a context shift, whose K-shift graph is
much smaller than the decode graph, generation continues with wrong logits.
Mechanism: ``ggml_backend_cuda_graph_compute`` keeps one CUDA graph per backend context. After each (re)capture
it extracts the graph's nodes so that later tokens can patch the one kernel argument that changes per token,
the destination of every ``GGML_OP_CPY`` (the K/V cache write), without re-capturing. The node count was
queried only ``if (cuda_ctx->cuda_graph->num_nodes == 0)``; otherwise ``cudaGraphGetNodes(graph, nodes.data(),
&num_nodes)`` is called with the old count, which returns at most that many nodes and lowers ``num_nodes`` to
the real count when the graph is smaller. The K-shift graph (one ROPE kernel per layer) is captured on the
same backend context, so ``num_nodes`` drops to ``n_layer``; the decode graph captured right after it is then
extracted with that count: only its first ``n_layer`` kernel nodes are in ``nodes``/``params``, and the
per-token loop that hands ``updated_kernel_arg`` to the copy kernels finds none. From the next token on, every
layer's K/V copy keeps writing the row of the token the graph was re-captured for.
Doctor: stale-input, at ``ggml_cuda_cpy`` (the captured copy kernel reads a destination argument that this
token's patch did not refresh).
Fix (upstream): drop the condition: ``cudaGraphGetNodes(graph, nullptr, &num_nodes)`` runs after every capture,
so ``nodes``/``params`` always cover the whole graph.
Read: the diff (``ggml-cuda.cu``, in the ik_llama.cpp mirror of the commit) and ``ggml_backend_cuda_graph_compute``
at its parent (the #7565 vector of copy-kernel pointers included). Modelled: a 2-layer toy decoder with an f16
K/V cache in one buffer, RoPE, ``llama_kv_cache_seq_rm``/``seq_add`` context shift and the K-shift graph; kernel
arguments live in a device table the captured kernels read, patched as ``cudaGraphKernelNodeSetParams`` +
``cudaGraphExecUpdate`` would; ``cudaGraphGetNodes`` returns at most the requested number of nodes.
"""
from __future__ import annotations

import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/ggml-org/llama.cpp/pull/7738"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "ggml_cuda_cpy"
SYMPTOM = "after a context shift the re-captured decode graph writes every token's K/V into one stale cache row"
NAME = "llamacpp_7738_cached_num_nodes_truncates_cpy_patching"

VOCAB, D, N_LAYER, KV_SIZE = 12, 4, 2, 8
ROPE_THETA = (1.0, 0.25)                  # one frequency per rotated pair (dims 0-1 and 2-3)
PROMPT = [3, 7, 1, 9]                     # prompt processing: batch > 1, CUDA graphs disabled
GENERATE = [5, 11, 0, 8, 2, 6, 10, 4, 1, 7]   # one token per ggml_backend_cuda_graph_compute
N_KEEP, N_DISCARD = 1, 3                  # context shift: keep the first token, discard the next three


# --------------------------------------------------------------------------------------------- kernels
def rope(x, pos, theta):
    """RoPE on pairs (0,1), (2,3): rotate by ``pos * theta``."""
    ang = pos.to(x.dtype)[:, None] * theta[None, :]                    # [rows, 2]
    cos, sin = torch.cos(ang), torch.sin(ang)
    x0, x1 = x[:, 0::2], x[:, 1::2]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).reshape(x.shape)


def cpy_f32_f16(cx, kv_buf, cdst):
    kv_buf.index_copy_(0, cdst, cx.to(torch.float16).to(torch.float32))


ggml_cuda_cpy_fn_ptrs = [cpy_f32_f16]     # the kernels whose destination argument is patched per token


# ---------------------------------------------------------------------------------------------- ggml
class ggml_tensor:
    def __init__(self, name, op, data, ne, src=()):
        self.name, self.op, self.data, self.ne, self.src = name, op, data, tuple(ne), tuple(src)


class llama_model:
    def __init__(self, device):
        gen = generator(7738)
        self.tok_embd = randn(VOCAB, D, gen=gen, device=device)
        self.wq = [randn(D, D, gen=gen, device=device, scale=0.6) for _ in range(N_LAYER)]
        self.wk = [randn(D, D, gen=gen, device=device, scale=0.6) for _ in range(N_LAYER)]
        self.wv = [randn(D, D, gen=gen, device=device, scale=0.6) for _ in range(N_LAYER)]
        self.wo = [randn(D, D, gen=gen, device=device, scale=0.6) for _ in range(N_LAYER)]
        self.output = randn(D, VOCAB, gen=gen, device=device, scale=0.6)
        self.rope_theta = torch.tensor(ROPE_THETA, device=device)


class llama_kv_cache:
    """All layers' K and V (f16) in one backend buffer; a row is one cell; cells know their position."""

    def __init__(self, device):
        self.buf = torch.zeros(N_LAYER * 2 * KV_SIZE, D, device=device)
        self.pos = [-1] * KV_SIZE              # -1: empty cell
        self.delta = [0] * KV_SIZE
        self.has_shift = False

    @staticmethod
    def k_row(il, cell):
        return il * 2 * KV_SIZE + cell

    @staticmethod
    def v_row(il, cell):
        return il * 2 * KV_SIZE + KV_SIZE + cell

    def find_slot(self):
        return self.pos.index(-1)

    def seq_rm(self, p0, p1):                  # llama_kv_cache_seq_rm
        for i, p in enumerate(self.pos):
            if p0 <= p < p1:
                self.pos[i] = -1

    def seq_add(self, p0, p1, delta):          # llama_kv_cache_seq_add: shift positions, K needs re-roping
        for i, p in enumerate(self.pos):
            if p0 <= p < p1:
                self.pos[i] += delta
                self.delta[i] += delta
                self.has_shift = True


class ggml_cuda_graph:
    def __init__(self, device):
        self.graph = None                      # the captured graph: its kernel nodes, in capture order
        self.instance = None
        self.out = None
        self.num_nodes = 0
        self.nodes: list = []                  # what cudaGraphGetNodes returned: (kernel, cgraph node index)
        self.params = torch.zeros(64, dtype=torch.int64, device=device)   # each copy node's kernelParams[1]
        self.updated_kernel_arg: list[int] = []
        self.ggml_graph_properties: list = []


class ggml_backend_cuda_context:
    def __init__(self, kv, device):
        self.kv, self.device = kv, device
        self.cuda_graph = ggml_cuda_graph(device)
        self.capturing = False
        self.captured_nodes: list = []


def cudaGraphGetNodes(graph, num_nodes=None):
    """``nodes == nullptr``: the graph's node count. Otherwise at most ``num_nodes`` nodes, the first ones."""
    if num_nodes is None:
        return len(graph)
    return graph[:num_nodes]


def launch(ctx, kernel, node_index):
    if ctx.capturing:
        ctx.captured_nodes.append((kernel, node_index))


def ggml_cuda_cpy(ctx, src1, node_index, cx):
    """GGML_OP_CPY: the kernel writes ``cx`` at its destination argument ``cdst`` (``src1->data``)."""
    launch(ctx, cpy_f32_f16, node_index)
    if ctx.capturing:
        cdst = ctx.cuda_graph.params.narrow(0, node_index, 1)         # the graph node's argument
    else:
        cdst = torch.tensor([src1.data], device=ctx.device)           # launched with the live pointer
    cpy_f32_f16(cx, ctx.kv.buf, cdst)


def llm_build_llama(model, kv, ctx, cell, inp_tokens, inp_pos, kq_mask):
    """The decode graph of one token written to KV cell ``cell``: nodes (for the reuse check) and evaluation."""
    nodes = [ggml_tensor("inp_embd", "GET_ROWS", "compute0", (1, D))]
    for il in range(N_LAYER):
        k_view = ggml_tensor(f"k_cache_view-{il}", "VIEW", kv.k_row(il, cell), (1, D))
        v_view = ggml_tensor(f"v_cache_view-{il}", "VIEW", kv.v_row(il, cell), (1, D))
        nodes += [ggml_tensor(f"{n}-{il}", op, f"compute{il}{n}", ne) for n, op, ne in (
            ("Qcur", "MUL_MAT", (1, D)), ("Kcur", "MUL_MAT", (1, D)), ("Vcur", "MUL_MAT", (1, D)),
            ("Qrope", "ROPE", (1, D)), ("Krope", "ROPE", (1, D)))]
        nodes += [ggml_tensor(f"k_cpy-{il}", "CPY", kv.k_row(il, cell), (1, D), (None, k_view)),
                  ggml_tensor(f"v_cpy-{il}", "CPY", kv.v_row(il, cell), (1, D), (None, v_view))]
        nodes += [ggml_tensor(f"{n}-{il}", op, f"compute{il}{n}", ne) for n, op, ne in (
            ("kq", "MUL_MAT", (1, KV_SIZE)), ("kq_soft_max", "SOFT_MAX", (1, KV_SIZE)),
            ("kqv", "MUL_MAT", (1, D)), ("kqv_out", "MUL_MAT", (1, D)), ("l_out", "ADD", (1, D)))]
    nodes.append(ggml_tensor("result_output", "MUL_MAT", "compute_out", (1, VOCAB)))
    index = {n.name: i for i, n in enumerate(nodes)}

    def evaluate():
        launch(ctx, "get_rows", index["inp_embd"])
        x = model.tok_embd.index_select(0, inp_tokens)
        for il in range(N_LAYER):
            for n in ("Qcur", "Kcur", "Vcur", "Qrope", "Krope"):
                launch(ctx, n, index[f"{n}-{il}"])
            q = rope(x @ model.wq[il], inp_pos, model.rope_theta)
            k = rope(x @ model.wk[il], inp_pos, model.rope_theta)
            v = x @ model.wv[il]
            k_cpy, v_cpy = nodes[index[f"k_cpy-{il}"]], nodes[index[f"v_cpy-{il}"]]
            ggml_cuda_cpy(ctx, k_cpy.src[1], index[k_cpy.name], k)
            ggml_cuda_cpy(ctx, v_cpy.src[1], index[v_cpy.name], v)
            for n in ("kq", "kq_soft_max", "kqv", "kqv_out", "l_out"):
                launch(ctx, n, index[f"{n}-{il}"])
            k_cache = kv.buf.narrow(0, kv.k_row(il, 0), KV_SIZE)
            v_cache = kv.buf.narrow(0, kv.v_row(il, 0), KV_SIZE)
            kq = torch.softmax(q @ k_cache.t() / math.sqrt(D) + kq_mask, -1)
            x = x + (kq @ v_cache) @ model.wo[il]
        launch(ctx, "result_output", index["result_output"])
        return x @ model.output

    return nodes, evaluate


def llm_build_k_shift(model, kv, ctx, k_shift):
    """``build_k_shift``: re-rope every layer's cached keys by their cell's position delta, in place."""
    nodes = [ggml_tensor(f"K_shifted-{il}", "ROPE", kv.k_row(il, 0), (KV_SIZE, D)) for il in range(N_LAYER)]

    def evaluate():
        for il in range(N_LAYER):
            launch(ctx, "rope_f16", il)
            k_l = kv.buf.narrow(0, kv.k_row(il, 0), KV_SIZE)
            k_l.copy_(rope(k_l, k_shift, model.rope_theta))
        return kv.buf.narrow(0, 0, 1)

    return nodes, evaluate


def ggml_graph_node_has_matching_properties(node, props):
    if node.data != props[0] and node.op not in ("CPY", "VIEW"):
        return False
    return node.op == props[1] and node.ne == props[2]


def ggml_backend_cuda_graph_compute(ctx, nodes, evaluate, variant, static, state):
    g = ctx.cuda_graph
    cuda_graph_update_required = g.instance is None or len(g.ggml_graph_properties) != len(nodes)
    for i, node in enumerate(nodes):
        if not cuda_graph_update_required and not ggml_graph_node_has_matching_properties(
                node, g.ggml_graph_properties[i]):
            cuda_graph_update_required = True
    g.ggml_graph_properties = [(n.data, n.op, n.ne) for n in nodes]

    # Loop over nodes in GGML graph to obtain info needed for CUDA graph
    g.updated_kernel_arg = [n.src[1].data for n in nodes if n.op == "CPY"]

    if cuda_graph_update_required:             # Start CUDA graph capture; the live arguments are recorded
        for i, node in enumerate(nodes):
            if node.op == "CPY":
                g.params[i] = node.src[1].data
        ctx.captured_nodes, ctx.capturing = [], True
        try:
            g.instance, g.out = capture(evaluate, device=ctx.device, warmups=0, name="ggml-cuda graph",
                                        static=static, state=state, owner="ggml-cuda backend (cuda_ctx->cuda_graph)")
        finally:
            ctx.capturing = False
        g.graph = ctx.captured_nodes
        # Extract nodes from graph
        if variant == "bug":
            if g.num_nodes == 0:
                # First call with null argument gets number of nodes in graph
                g.num_nodes = cudaGraphGetNodes(g.graph)
        else:
            # First call with null argument gets number of nodes in graph
            g.num_nodes = cudaGraphGetNodes(g.graph)
        # Subsequent call with non-null argument gets nodes
        g.nodes = cudaGraphGetNodes(g.graph, g.num_nodes)
        g.num_nodes = len(g.nodes)
    else:
        # One of the arguments to the copy kernel is updated for each token, hence we need to
        # replace that argument with the updated value in the CUDA graph
        k = 0
        for i in range(g.num_nodes):
            kernel, node_index = g.nodes[i]
            if kernel in ggml_cuda_cpy_fn_ptrs:
                g.params[node_index] = g.updated_kernel_arg[k]         # cudaGraphKernelNodeSetParams
                k += 1
    return replay(g.instance, g.out)                                   # cudaGraphExecUpdate + cudaGraphLaunch


# --------------------------------------------------------------------------------------------- llama.cpp
def llama_set_inputs(kv, inp_tokens, inp_pos, kq_mask, token, pos):
    inp_tokens.fill_(token)
    inp_pos.fill_(pos)
    cell_pos = torch.tensor(kv.pos, device=kq_mask.device)
    kq_mask.copy_(torch.where((cell_pos < 0) | (cell_pos > pos), float("-inf"), 0.0)[None])


def run(variant: str, device: str = "cpu"):
    model = llama_model(device)

    def serve(use_cuda_graph: bool):
        kv = llama_kv_cache(device)
        ctx = ggml_backend_cuda_context(kv, device)
        inp_tokens = torch.zeros(1, dtype=torch.int64, device=device)
        inp_pos = torch.zeros(1, dtype=torch.int64, device=device)
        kq_mask = torch.zeros(1, KV_SIZE, device=device)
        k_shift = torch.zeros(KV_SIZE, dtype=torch.int64, device=device)
        static = {"inp_tokens": inp_tokens, "inp_pos": inp_pos, "kq_mask": kq_mask, "inp_K_shift": k_shift,
                  "cpy_kernel_params": ctx.cuda_graph.params}
        state = {"kv_cache": kv.buf}

        def decode(token, pos, graphs):
            cell = kv.find_slot()
            kv.pos[cell] = pos
            llama_set_inputs(kv, inp_tokens, inp_pos, kq_mask, token, pos)
            nodes, evaluate = llm_build_llama(model, kv, ctx, cell, inp_tokens, inp_pos, kq_mask)
            if graphs:
                return ggml_backend_cuda_graph_compute(ctx, nodes, evaluate, variant, static, state)
            return evaluate()                  # GGML_CUDA_DISABLE_GRAPHS=1 (and prompt batches)

        n_past = 0
        for token in PROMPT:
            decode(token, n_past, False)
            n_past += 1
        logits = []
        for token in GENERATE:
            if n_past >= KV_SIZE:              # context shift, as in examples/main
                kv.seq_rm(N_KEEP, N_KEEP + N_DISCARD)
                kv.seq_add(N_KEEP + N_DISCARD, n_past, -N_DISCARD)
                n_past -= N_DISCARD
                k_shift.copy_(torch.tensor(kv.delta, device=device))   # llama_kv_cache_update: K-shift graph
                nodes, evaluate = llm_build_k_shift(model, kv, ctx, k_shift)
                if use_cuda_graph:
                    ggml_backend_cuda_graph_compute(ctx, nodes, evaluate, variant, static, state)
                else:
                    evaluate()
                kv.delta, kv.has_shift = [0] * KV_SIZE, False
            out = decode(token, n_past, use_cuda_graph)
            logits.append(out.clone())
            n_past += 1
        return logits

    return compare(NAME, variant, device, lambda: serve(True), lambda: serve(False))
