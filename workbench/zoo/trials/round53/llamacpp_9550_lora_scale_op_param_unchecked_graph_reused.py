"""A new LoRA scale changes only the ``GGML_OP_SCALE`` node's ``op_params``: the CUDA graph's reuse check ignores them and replays the old scale.

Upstream: https://github.com/ggml-org/llama.cpp/pull/9550 ("Update CUDA graph on scale change plus clear
nodes/params", llama.cpp 41f4778, ggml-org/ggml@78fcac23); issue https://github.com/ggml-org/llama.cpp/issues/9451
("server crash when changing LoRA scale while using CUDA").
Symptom: after ``POST /lora-adapters`` changes an adapter's scale (e.g. to 0.0), generation with layers offloaded
to CUDA keeps the old adapter strength (or crashes); with ``GGML_CUDA_DISABLE_GRAPHS`` the new scale takes effect.
Mechanism: ``llm_build_lora_mm`` adds ``ggml_scale(ab_cur, scale)`` with ``scale = it.second * alpha / rank``, a
float stored in the node's ``op_params``. ``ggml_backend_cuda_graph_compute`` decides per ubatch whether the
instantiated graph can be relaunched: it compares each node with ``ggml_graph_node_has_matching_properties``
(data address, op, ``ne``/``nb``, the sources' addresses) against what ``set_ggml_graph_node_properties`` stored.
``ggml_cuda_op_scale`` ``memcpy``s the float out of ``op_params`` on the host and passes it by value to
``scale_f32``, so the captured kernel node holds the scale of the capture. A scale change leaves every address
and shape as it was: the check reports a match and every later single-token ubatch (the re-sent prompt's last
token, which ``cache_prompt`` re-evaluates, and the decode tokens) relaunches the graph with the old scale, while
an eager evaluation reads the new one. (A multi-token ubatch runs eagerly: the ``GGML_OP_ADD`` with
``src[1]->ne[1] > 1`` check turns graphs off for it.)
Doctor: host-work-frozen, at ``ggml_graph_node_has_matching_properties`` (the scale read on the host at capture is
baked into the kernel; the reuse check does not look at the op params that carry it, so replays keep it).
Fix (upstream): ``ggml_graph_node_properties`` gains ``op_params``; ``set_ggml_graph_node_properties`` copies
them, and ``ggml_graph_node_has_matching_properties`` returns false for a ``GGML_OP_SCALE`` node whose
``op_params`` differ, forcing a re-capture. (The same PR also ``clear()``s ``cuda_graph->nodes``/``params`` before
``resize()``; the KV-cache copy-kernel patching that uses them is not modelled here.)
"""
from __future__ import annotations

import struct

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/ggml-org/llama.cpp/pull/9550"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "ggml_graph_node_has_matching_properties"
SYMPTOM = "after the LoRA scale is changed, graphed decode keeps the old scale (GGML_CUDA_DISABLE_GRAPHS gets the new)"

N_VOCAB, N_EMBD, LORA_RANK, N_CTX, N_UBATCH = 16, 8, 2, 32, 4
GGML_MAX_OP_PARAMS = 64
(GGML_OP_NONE, GGML_OP_GET_ROWS, GGML_OP_ADD, GGML_OP_MUL_MAT,
 GGML_OP_SCALE) = ("NONE", "GET_ROWS", "ADD", "MUL_MAT", "SCALE")


class ggml_tensor:
    def __init__(self, name, op, ne, src=(), op_params=b""):
        self.name, self.op, self.ne, self.src = name, op, tuple(ne), list(src)
        self.nb = (4, 4 * self.ne[0])
        self.op_params = op_params.ljust(GGML_MAX_OP_PARAMS, b"\0")
        self.data, self.mem = None, None

    def view(self):
        return self.mem[: self.ne[1]]


class ggml_gallocr:
    """The compute buffer: each tensor of the (rebuilt every ubatch) graph gets the same offset each time."""

    def __init__(self, device):
        self.device, self.buffers = device, {}

    def alloc_graph(self, tensors):
        for t in tensors:
            if t.mem is None:
                if t.name not in self.buffers:
                    dtype = torch.long if t.name in ("inp_tokens", "inp_pos") else torch.float32
                    self.buffers[t.name] = torch.zeros(N_UBATCH, t.ne[0], dtype=dtype, device=self.device)
                t.mem = self.buffers[t.name]
            t.data = t.mem.data_ptr()


class llama_model:
    def __init__(self, device):
        gen = generator(9550)
        w = {"tok_embd": (N_VOCAB, N_EMBD), "pos_embd": (N_CTX, N_EMBD), "wo": (N_EMBD, N_EMBD),
             "output": (N_EMBD, N_VOCAB), "lora_a": (N_EMBD, LORA_RANK), "lora_b": (LORA_RANK, N_EMBD)}
        self.tensors = {}
        for name, shape in w.items():
            t = ggml_tensor(name, GGML_OP_NONE, shape[::-1])
            t.mem = randn(*shape, gen=gen, device=device, scale=0.5)
            t.data = t.mem.data_ptr()
            self.tensors[name] = t
        self.lora_alpha = 4.0


def llm_build_lora_mm(model, lora_adapters, w, cur, n_tokens):
    res = ggml_tensor("wo_cur", GGML_OP_MUL_MAT, (N_EMBD, n_tokens), (w, cur))
    for adapter_scale in lora_adapters:                # lctx.lora_adapters: (adapter, scale)
        rank = float(LORA_RANK)
        scale = adapter_scale * model.lora_alpha / rank if model.lora_alpha else adapter_scale
        a_cur = ggml_tensor("lora_a_cur", GGML_OP_MUL_MAT, (LORA_RANK, n_tokens), (model.tensors["lora_a"], cur))
        ab_cur = ggml_tensor("lora_ab_cur", GGML_OP_MUL_MAT, (N_EMBD, n_tokens), (model.tensors["lora_b"], a_cur))
        ab_cur = ggml_tensor("lora_ab_scaled", GGML_OP_SCALE, (N_EMBD, n_tokens), (ab_cur,), struct.pack("f", scale))
        res = ggml_tensor("ffn_out", GGML_OP_ADD, (N_EMBD, n_tokens), (res, ab_cur))
    return res


def llama_build_graph(model, lora_adapters, n_tokens, leafs):
    inp_tokens, inp_pos = leafs
    tok = ggml_tensor("inp_embd", GGML_OP_GET_ROWS, (N_EMBD, n_tokens), (model.tensors["tok_embd"], inp_tokens))
    pos = ggml_tensor("pos_embd_rows", GGML_OP_GET_ROWS, (N_EMBD, n_tokens), (model.tensors["pos_embd"], inp_pos))
    cur = ggml_tensor("inpL", GGML_OP_ADD, (N_EMBD, n_tokens), (tok, pos))
    ffn = llm_build_lora_mm(model, lora_adapters, model.tensors["wo"], cur, n_tokens)
    inpL = ggml_tensor("l_out", GGML_OP_ADD, (N_EMBD, n_tokens), (cur, ffn))
    out = ggml_tensor("result_output", GGML_OP_MUL_MAT, (N_VOCAB, n_tokens), (model.tensors["output"], inpL))
    nodes, stack = [], [out]
    while stack:                                       # ggml_build_forward_expand: sources before users
        t = stack.pop()
        if t.op != GGML_OP_NONE and t not in nodes:
            nodes.insert(0, t)
            stack.extend(t.src)
    return sorted(nodes, key=_depth)


def _depth(t):
    return 0 if t.op == GGML_OP_NONE else 1 + max(_depth(s) for s in t.src)


def ggml_cuda_op_scale(dst):
    scale = struct.unpack("f", dst.op_params[:4])[0]   # memcpy(&scale, dst->op_params, sizeof(float)) on the host
    torch.mul(dst.src[0].view(), scale, out=dst.view())  # scale_f32<<<...>>>(x, dst, scale, k): by value


def ggml_cuda_compute_forward(node):
    a, b = node.src[0], node.src[1] if len(node.src) > 1 else None
    if node.op == GGML_OP_GET_ROWS:
        torch.index_select(a.mem, 0, b.view()[:, 0], out=node.view())
    elif node.op == GGML_OP_ADD:
        torch.add(a.view(), b.view(), out=node.view())
    elif node.op == GGML_OP_MUL_MAT:
        torch.matmul(b.view(), a.mem, out=node.view())
    elif node.op == GGML_OP_SCALE:
        ggml_cuda_op_scale(node)


class ggml_graph_node_properties:
    def __init__(self, node):
        self.node_address, self.node_op, self.ne, self.nb = node.data, node.op, node.ne, node.nb
        self.src_address = [s.data for s in node.src]
        self.op_params = node.op_params


def set_ggml_graph_node_properties(node, variant):
    props = ggml_graph_node_properties(node)
    if variant == "bug":
        props.op_params = None                         # only data, op, ne, nb and src addresses were stored
    return props


def ggml_graph_node_has_matching_properties(node, props, variant) -> bool:
    if node.data != props.node_address or node.op != props.node_op:
        return False
    if node.ne != props.ne or node.nb != props.nb:
        return False
    if [s.data for s in node.src] != props.src_address:
        return False
    if variant == "fix" and node.op == GGML_OP_SCALE and props.op_params != node.op_params:
        return False                                   # memcmp(op_params) != 0: the LoRA scale changed
    return True


class ggml_cuda_graph:
    def __init__(self):
        self.instance = self.output = None
        self.ggml_graph_properties = []
        self.number_consecutive_updates, self.disable_due_to_too_many_updates = 0, False


def ggml_backend_cuda_graph_compute(cuda_graph, nodes, leafs, device, variant, disable_graphs):
    use_cuda_graph = not (disable_graphs or cuda_graph.disable_due_to_too_many_updates)
    update_required = False
    if use_cuda_graph:
        update_required = cuda_graph.instance is None or len(cuda_graph.ggml_graph_properties) != len(nodes)
        for i, node in enumerate(nodes):
            if not update_required and not ggml_graph_node_has_matching_properties(
                    node, cuda_graph.ggml_graph_properties[i], variant):
                update_required = True
        cuda_graph.ggml_graph_properties = [set_ggml_graph_node_properties(n, variant) for n in nodes]
        for node in nodes:                             # disable CUDA graphs for batch size > 1 for now
            if node.op == GGML_OP_ADD and node.src[1].ne[1] > 1:
                use_cuda_graph = False
        if use_cuda_graph and update_required:
            cuda_graph.number_consecutive_updates += 1
        else:
            cuda_graph.number_consecutive_updates = 0
        if cuda_graph.number_consecutive_updates >= 4:
            cuda_graph.disable_due_to_too_many_updates = True

    def evaluate():
        for node in nodes:
            ggml_cuda_compute_forward(node)
        return nodes[-1].mem

    if not use_cuda_graph:
        return evaluate()[: nodes[-1].ne[1]]
    if update_required:                                # cudaStreamBeginCapture .. EndCapture, instantiate/update
        cuda_graph.instance, cuda_graph.output = capture(
            evaluate, device=device, warmups=0, name="llama decode graph", owner="ggml-cuda (cuda_ctx->cuda_graph)",
            static={leaf.name: leaf.mem for leaf in leafs})
    return replay(cuda_graph.instance, cuda_graph.output)[:1]   # cudaGraphLaunch


class llama_context:
    def __init__(self, model, device, variant, disable_graphs):
        self.model, self.device, self.variant, self.disable_graphs = model, device, variant, disable_graphs
        self.galloc, self.cuda_graph = ggml_gallocr(device), ggml_cuda_graph()
        self.lora_adapters = [1.0]                     # llama_lora_adapter_set(ctx, adapter, scale)
        self.n_past = 0

    def llama_decode(self, tokens, pos0):
        n = len(tokens)
        leafs = (ggml_tensor("inp_tokens", GGML_OP_NONE, (1, n)), ggml_tensor("inp_pos", GGML_OP_NONE, (1, n)))
        nodes = llama_build_graph(self.model, self.lora_adapters, n, leafs)
        self.galloc.alloc_graph(list(leafs) + nodes)
        leafs[0].view().copy_(torch.tensor(tokens).view(n, 1))          # llama_set_inputs
        leafs[1].view().copy_(torch.arange(pos0, pos0 + n).view(n, 1))
        logits = ggml_backend_cuda_graph_compute(self.cuda_graph, nodes, leafs, self.device, self.variant,
                                                 self.disable_graphs)
        return logits[-1].clone()


def run(variant: str, device: str = "cpu"):
    model = llama_model(device)
    prompt = [3, 7, 1, 12]

    def serve(graphed: bool):
        ctx = llama_context(model, device, variant, disable_graphs=not graphed)   # GGML_CUDA_DISABLE_GRAPHS
        outs = []
        for scale in (1.0, 0.0, 0.5):                  # POST /lora-adapters between the requests
            ctx.lora_adapters = [scale]
            # cache_prompt: the cached prefix is kept, at least the last prompt token is evaluated again
            start = 0 if not outs else len(prompt) - 1
            for i in range(start, len(prompt), N_UBATCH):
                logits = ctx.llama_decode(prompt[i:i + N_UBATCH], i)
            outs.append(logits)
            pos, token = len(prompt), int(logits.argmax())
            for _ in range(4):                         # decode: one token per ubatch
                logits = ctx.llama_decode([token], pos)
                outs.append(logits)
                pos, token = pos + 1, int(logits.argmax())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
