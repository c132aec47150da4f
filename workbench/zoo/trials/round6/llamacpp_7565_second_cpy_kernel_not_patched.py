"""Per-token CUDA-graph patching of KV-cache copy destinations recognises only the first copy kernel.

Upstream: https://github.com/ggml-org/llama.cpp/pull/7565 ("Allow multiple copy function pointers for CUDA
graph kernel updates"), fixing https://github.com/ggml-org/llama.cpp/issues/7492 ("CUDA graphs break
quantized K cache").
Symptom: with a quantized K cache (``-ctk q8_0``) and the default f16 V cache, batch-size-1 generation on
CUDA is broken (perplexity/garbage); ``GGML_CUDA_DISABLE_GRAPHS=1`` fixes it (llama.cpp, May 2024).
Mechanism: ``ggml_backend_cuda_graph_compute`` reuses the captured decode graph for every token and only
patches the one kernel argument that changes per token, the destination pointer of each ``GGML_OP_CPY``
(the KV-cache write): it collects every CPY node's destination in ``updated_kernel_arg`` but remembers the
kernel of the *first* CPY node only (``ggml_cuda_cpy_fn_ptr``), then walks the graph's kernel nodes and
hands the collected destinations, in order, to the nodes running that kernel. With a q8_0 K cache and an
f16 V cache the K and V writes run different kernels: the V writes are never patched and keep writing the
capture token's row, and the second layer's K write receives the first layer's V destination.
Doctor: stale-input, at ``ggml_cuda_cpy`` (the captured copy kernel reads a destination argument that this
token's patch did not refresh).
Fix (upstream): keep a vector of copy-kernel function pointers (``ggml_cuda_cpy_fn_ptrs``) and patch every
kernel node whose function is in it, so each CPY node gets its own destination every token.
"""
from __future__ import annotations

import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/ggml-org/llama.cpp/pull/7565"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "ggml_cuda_cpy"
SYMPTOM = "with a q8_0 K cache, replayed tokens write V at the capture token's row and layer-1 K into layer-0 V"
NAME = "llamacpp_7565_second_cpy_kernel_not_patched"

VOCAB, D, N_LAYER, KV_SIZE = 12, 8, 2, 8
PROMPT = [3, 7, 1]                     # prompt processing: batch > 1, CUDA graphs disabled
DECODE = [5, 11, 0, 8]                 # one token per ggml_backend_cuda_graph_compute
MAX_NODES = 64


# ------------------------------------------------------------------------------------------ kernels
def quantize_row_q8_0(x):
    d = x.abs().amax(-1, keepdim=True).clamp_min(1e-8) / 127.0
    return torch.round(x / d) * d


def cpy_f32_q8_0(cx, kv_buf, cdst):
    kv_buf.index_copy_(0, cdst, quantize_row_q8_0(cx))


def cpy_f32_f16(cx, kv_buf, cdst):
    kv_buf.index_copy_(0, cdst, cx.to(torch.float16).to(torch.float32))


def ggml_cuda_cpy_fn(src0, src1):
    return cpy_f32_q8_0 if src1.type == "q8_0" else cpy_f32_f16


# ------------------------------------------------------------------------------------------- ggml
class ggml_tensor:
    def __init__(self, name, op, data, ne, type="f32", src=()):
        self.name, self.op, self.data, self.ne, self.type, self.src = name, op, data, tuple(ne), type, tuple(src)


class llama_model:
    def __init__(self, device):
        gen = generator(7565)
        self.tok_embd = randn(VOCAB, D, gen=gen, device=device)
        self.wq = [randn(D, D, gen=gen, device=device, scale=0.5) for _ in range(N_LAYER)]
        self.wk = [randn(D, D, gen=gen, device=device, scale=0.5) for _ in range(N_LAYER)]
        self.wv = [randn(D, D, gen=gen, device=device, scale=0.5) for _ in range(N_LAYER)]
        self.wo = [randn(D, D, gen=gen, device=device, scale=0.5) for _ in range(N_LAYER)]
        self.output = randn(D, VOCAB, gen=gen, device=device, scale=0.5)


class llama_kv_cache:
    """One backend buffer holds every layer's K (q8_0) and V (f16) cache; a row is one token's entry."""

    def __init__(self, device):
        self.buf = torch.zeros(N_LAYER * 2 * KV_SIZE, D, device=device)

    @staticmethod
    def k_row(il, pos):
        return il * 2 * KV_SIZE + pos

    @staticmethod
    def v_row(il, pos):
        return il * 2 * KV_SIZE + KV_SIZE + pos


class ggml_backend_cuda_context:
    def __init__(self, kv, device):
        self.kv = kv
        self.device = device
        self.cuda_graph = ggml_cuda_graph(device)
        self.capturing = False


class ggml_cuda_graph:
    def __init__(self, device):
        self.graph = None
        self.instance = None
        self.out = None
        self.nodes: list = []                 # kernel nodes of the captured graph: (func, cgraph node index)
        self.params = torch.zeros(MAX_NODES, dtype=torch.int64, device=device)   # their kernelParams[1]
        self.updated_kernel_arg: list[int] = []
        self.ggml_graph_properties: list = []


def ggml_cuda_cpy(ctx, src0, src1, node_index, cx):
    """GGML_OP_CPY: the kernel writes ``cx`` at its destination argument ``cdst`` (src1->data)."""
    fn = ggml_cuda_cpy_fn(src0, src1)
    if ctx.capturing:
        ctx.cuda_graph.nodes.append((fn, node_index))
        cdst = ctx.cuda_graph.params.narrow(0, node_index, 1)           # the graph node's argument
    else:
        cdst = torch.tensor([src1.data], device=ctx.device)            # launched with the live pointer
    fn(cx, ctx.kv.buf, cdst)


def llm_build_llama(model, kv, ctx, pos, inp_tokens, kq_mask):
    """The decode graph of one token: nodes (for the graph-reuse check) and their evaluation."""
    nodes = [ggml_tensor("inp_embd", "GET_ROWS", "compute0", (1, D))]
    for il in range(N_LAYER):
        k_cur = ggml_tensor(f"Kcur-{il}", "MUL_MAT", f"compute{il}k", (1, D))
        v_cur = ggml_tensor(f"Vcur-{il}", "MUL_MAT", f"compute{il}v", (1, D))
        k_view = ggml_tensor(f"k_cache_view-{il}", "VIEW", kv.k_row(il, pos), (1, D), "q8_0")
        v_view = ggml_tensor(f"v_cache_view-{il}", "VIEW", kv.v_row(il, pos), (1, D), "f16")
        nodes += [k_cur, v_cur,
                  ggml_tensor(f"k_cpy-{il}", "CPY", kv.k_row(il, pos), (1, D), "q8_0", (k_cur, k_view)),
                  ggml_tensor(f"v_cpy-{il}", "CPY", kv.v_row(il, pos), (1, D), "f16", (v_cur, v_view)),
                  ggml_tensor(f"kq-{il}", "MUL_MAT", f"compute{il}kq", (1, KV_SIZE)),
                  ggml_tensor(f"kqv_out-{il}", "ADD", f"compute{il}out", (1, D))]
    nodes.append(ggml_tensor("result_output", "MUL_MAT", "compute_out", (1, VOCAB)))
    index = {n.name: i for i, n in enumerate(nodes)}

    def evaluate():
        x = model.tok_embd.index_select(0, inp_tokens)
        for il in range(N_LAYER):
            q, k, v = x @ model.wq[il], x @ model.wk[il], x @ model.wv[il]
            k_cpy, v_cpy = nodes[index[f"k_cpy-{il}"]], nodes[index[f"v_cpy-{il}"]]
            ggml_cuda_cpy(ctx, k_cpy.src[0], k_cpy.src[1], index[k_cpy.name], k)
            ggml_cuda_cpy(ctx, v_cpy.src[0], v_cpy.src[1], index[v_cpy.name], v)
            k_cache = kv.buf.narrow(0, kv.k_row(il, 0), KV_SIZE)
            v_cache = kv.buf.narrow(0, kv.v_row(il, 0), KV_SIZE)
            kq = torch.softmax(q @ k_cache.t() / math.sqrt(D) + kq_mask, -1)
            x = x + (kq @ v_cache) @ model.wo[il]
        return x @ model.output

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
    g.updated_kernel_arg = []
    ggml_cuda_cpy_fn_ptr = None                         # pointer to CUDA cpy kernel (before #7565)
    ggml_cuda_cpy_fn_ptrs = []                          # vector of pointers to CUDA cpy kernels (#7565)
    for node in nodes:
        if node.op == "CPY":
            # store the copy op parameter which changes with each token.
            g.updated_kernel_arg.append(node.src[1].data)
            if variant == "bug":
                if ggml_cuda_cpy_fn_ptr is None:
                    # store a pointer to the copy op CUDA kernel to identify it later
                    ggml_cuda_cpy_fn_ptr = ggml_cuda_cpy_fn(node.src[0], node.src[1])
            else:
                # store a pointer to each copy op CUDA kernel to identify it later
                ptr = ggml_cuda_cpy_fn(node.src[0], node.src[1])
                if ptr not in ggml_cuda_cpy_fn_ptrs:
                    ggml_cuda_cpy_fn_ptrs.append(ptr)

    if cuda_graph_update_required:                      # capture: the live arguments are recorded
        for i, node in enumerate(nodes):
            if node.op == "CPY":
                g.params[i] = node.src[1].data
        g.nodes = []
        ctx.capturing = True
        try:
            g.instance, g.out = capture(evaluate, device=ctx.device, warmups=0, name="ggml-cuda graph",
                                        static=static, state=state, owner="ggml-cuda backend")
        finally:
            ctx.capturing = False
    else:
        # One of the arguments to the copy kernel is updated for each token, hence we need to
        # replace that argument with the updated value in the CUDA graph
        k = 0
        for fn, node_index in g.nodes:
            patch = fn == ggml_cuda_cpy_fn_ptr if variant == "bug" else fn in ggml_cuda_cpy_fn_ptrs
            if patch:
                g.params[node_index] = g.updated_kernel_arg[k]      # cudaGraphKernelNodeSetParams
                k += 1
    return replay(g.instance, g.out)                    # cudaGraphLaunch


# ---------------------------------------------------------------------------------------- llama.cpp
def llama_set_inputs(inp_tokens, kq_mask, token, pos):
    inp_tokens.fill_(token)
    keys = torch.arange(KV_SIZE, device=kq_mask.device)
    kq_mask.copy_(torch.where(keys > pos, float("-inf"), 0.0)[None])


def prompt_eval(model, kv, ctx):
    """Prompt processing: a batch > 1 disables CUDA graphs, so it runs eagerly (token by token here)."""
    mask = torch.zeros(1, KV_SIZE, device=kv.buf.device)
    toks = torch.zeros(1, dtype=torch.int64, device=kv.buf.device)
    for pos, token in enumerate(PROMPT):
        llama_set_inputs(toks, mask, token, pos)
        llm_build_llama(model, kv, ctx, pos, toks, mask)[1]()


def run(variant: str, device: str = "cpu"):
    model = llama_model(device)

    def serve(use_cuda_graph: bool):
        kv = llama_kv_cache(device)
        ctx = ggml_backend_cuda_context(kv, device)
        prompt_eval(model, kv, ctx)
        inp_tokens = torch.zeros(1, dtype=torch.int64, device=device)
        kq_mask = torch.zeros(1, KV_SIZE, device=device)
        static = {"inp_tokens": inp_tokens, "kq_mask": kq_mask, "cpy_kernel_params": ctx.cuda_graph.params}
        logits = []
        for step, token in enumerate(DECODE):
            pos = len(PROMPT) + step
            llama_set_inputs(inp_tokens, kq_mask, token, pos)
            nodes, evaluate = llm_build_llama(model, kv, ctx, pos, inp_tokens, kq_mask)
            if use_cuda_graph:
                out = ggml_backend_cuda_graph_compute(ctx, nodes, evaluate, variant, static, {"kv_cache": kv.buf})
            else:                                       # GGML_CUDA_DISABLE_GRAPHS=1
                out = evaluate()
            logits.append(out.clone())
        return logits

    return compare(NAME, variant, device, lambda: serve(True), lambda: serve(False))
