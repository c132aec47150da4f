"""A split input moves to a new address, the node copies still compare equal: the old CUDA graph keeps reading the old one.

Upstream: https://github.com/ggml-org/llama.cpp/pull/21635 ("CUDA: also store `node->src->data` ptrs for
equality check", fixes issue #21622).
Symptom: right after #21472 ("CUDA: make cuda graphs props check faster", April 2026) hybrid CPU+CUDA runs
went wrong in long generations: garbage / endless ``<unused>`` tokens (Gemma4 26B, CPU+CUDA, long context,
issue #21640 bisected to the same commit); ``GGML_CUDA_DISABLE_GRAPHS=1`` or reverting the commit fixed it.
Mechanism: before replaying a split's CUDA graph, ``ggml_cuda_graph_update_required`` decides whether the
captured executable still matches the ggml graph. #21472 replaced the per-field property check by a
``memcmp`` of a saved copy of every node's ``ggml_tensor``: op, shape, ``data``, ``op_params`` and the
``src`` *pointers* (addresses of the source tensor structs), but not the sources' ``data``. A source that is
not itself a node of the split (here the split's input copy, the CPU-computed attention output the
scheduler copies into the CUDA compute buffer) can be given a new address by ggml-alloc when the graph is
re-planned (the KV length crossed its padding, the compute buffer layout changed), while the struct, and
so every node copy, stays byte-identical. The check answers "no update", the executable replays with the
address baked in at capture, and every layer from then on reads a location nobody writes any more (the
previous plan's input: a stale activation).
Doctor: warmup-divergence, at ``ggml_cuda_graph_update_required`` (capture baked the input's address; the
reuse decision does not look at where the source's data now is, while an eager step reads the new one).
Fix (upstream): store ``node->src[j]->data`` next to each node copy (``node_properties.node_src_data_ptrs``)
and include it in the comparison, so a moved source forces a re-capture.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay
from workbench.engine import events

UPSTREAM = "https://github.com/ggml-org/llama.cpp/pull/21635"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "ggml_cuda_graph_update_required"
SYMPTOM = "garbage tokens once the split input moves: the reused CUDA graph reads its capture-time address"

GGML_OP_NONE, GGML_OP_MUL_MAT, GGML_OP_UNARY, GGML_OP_ADD = "NONE", "MUL_MAT", "UNARY", "ADD"
GGML_UNARY_OP_SILU = 10
N_EMBD, N_FF, VOCAB = 4, 6, 8
KV_PAD = 4                     # n_kv is padded (256 upstream): the graph is re-planned when it crosses a multiple
TOKENS = [1, 5, 2, 7, 3, 6, 4]


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
        return self.mem[off:off + n].view(*ne)


class ggml_tensor:
    def __init__(self, name, op, ne, src=(), op_params=()):
        self.name, self.op, self.ne, self.src, self.op_params = name, op, tuple(ne), list(src), tuple(op_params)
        self.buffer: ggml_backend_buffer | None = None
        self.data: int | None = None             # the device address ggml-alloc gave it

    def view(self) -> torch.Tensor:
        return self.buffer.at(self.data, self.ne)


class ggml_cgraph:
    def __init__(self, nodes):
        self.nodes = nodes


class node_properties:
    """What ``ggml_cuda_graph_update_required`` saves per node: a copy of the ``ggml_tensor`` struct (the
    ``src`` member holds the source structs' addresses) and, with the fix, the sources' data pointers."""

    def __init__(self, node: ggml_tensor, with_src_data: bool):
        self.node = (node.op, node.ne, node.data, node.op_params, tuple(id(s) for s in node.src))
        self.node_src_data_ptrs = tuple(s.data for s in node.src) if with_src_data else ()

    def __eq__(self, other):                       # the memcmp
        return (self.node, self.node_src_data_ptrs) == (other.node, other.node_src_data_ptrs)


class ggml_cuda_graph:
    def __init__(self):
        self.instance = None
        self.outputs = None
        self.node_props: list[node_properties | None] = []
        self.warmup_complete = False


def ggml_cuda_graph_update_required(graph: ggml_cuda_graph, cgraph: ggml_cgraph, variant: str) -> bool:
    res = graph.instance is None
    # Check if the graph size has changed
    if len(graph.node_props) != len(cgraph.nodes):
        res = True
        graph.node_props = [None] * len(cgraph.nodes)
    for i, node in enumerate(cgraph.nodes):
        prop = node_properties(node, with_src_data=(variant == "fix"))
        if res or graph.node_props[i] != prop:
            graph.node_props[i] = prop
            res = True
    return res


def ggml_cuda_mul_mat(dst: ggml_tensor):
    a, b = dst.src                                    # ggml: dst = a x b (a: weights [n_out, n_in])
    dst.view().copy_(a.view() @ b.view())


def ggml_cuda_compute_forward(dst: ggml_tensor):
    if dst.op == GGML_OP_MUL_MAT:
        ggml_cuda_mul_mat(dst)
    elif dst.op == GGML_OP_UNARY:
        dst.view().copy_(torch.nn.functional.silu(dst.src[0].view()))
    elif dst.op == GGML_OP_ADD:
        dst.view().copy_(dst.src[0].view() + dst.src[1].view())


def ggml_cuda_graph_evaluate(cgraph: ggml_cgraph) -> torch.Tensor:
    for node in cgraph.nodes:
        ggml_cuda_compute_forward(node)
    return cgraph.nodes[-1].view()


def ggml_backend_cuda_graph_compute(cuda_graph: ggml_cuda_graph, cgraph: ggml_cgraph, device: str, variant: str):
    """The split's compute: the first sighting runs eagerly (warmup); then capture when an update is
    required, else replay the executable as it was captured."""
    update_required = ggml_cuda_graph_update_required(cuda_graph, cgraph, variant)
    if not cuda_graph.warmup_complete:
        with events.warmup():
            out = ggml_cuda_graph_evaluate(cgraph)
        cuda_graph.warmup_complete = True
        cuda_graph.instance = None
        return out
    if update_required:
        inp = cgraph.nodes[0].src[1]
        cuda_graph.instance, cuda_graph.outputs = capture(
            lambda: ggml_cuda_graph_evaluate(cgraph), device=device, warmups=0, name="ffn split",
            static={"attn_out (split input copy)": inp.view()}, owner="ggml-cuda graph (split 1)")
    return replay(cuda_graph.instance, cuda_graph.outputs)


class Model:
    def __init__(self, device):
        gen = generator(21635)
        self.tok_embd = randn(VOCAB, N_EMBD, gen=gen, device=device)          # CPU split (get_rows, attention)
        self.wk = randn(N_EMBD, N_EMBD, gen=gen, device=device, scale=0.5)
        self.weights = ggml_backend_buffer(N_FF * N_EMBD * 2, device)           # CUDA0 model buffer
        self.ffn_up = ggml_tensor("blk.0.ffn_up", GGML_OP_NONE, (N_FF, N_EMBD))
        self.ffn_down = ggml_tensor("blk.0.ffn_down", GGML_OP_NONE, (N_EMBD, N_FF))
        for t, w in ((self.ffn_up, randn(N_FF, N_EMBD, gen=gen, device=device, scale=0.5)),
                     (self.ffn_down, randn(N_EMBD, N_FF, gen=gen, device=device, scale=0.5))):
            t.buffer = self.weights
            t.data = self.weights.base + (0 if t is self.ffn_up else N_FF * N_EMBD)
            t.view().copy_(w)


def cpu_attention(model, token, history):
    """The CPU split (KV cache on the host): attention of the new token over the cached ones."""
    x = model.tok_embd[token]
    history.append(x @ model.wk)
    keys = torch.stack(history)
    p = torch.softmax(keys @ x / N_EMBD ** 0.5, 0)
    return x + p @ keys


def ggml_gallocr_alloc_graph(compute: ggml_backend_buffer, inputs: ggml_tensor, nodes, n_kv: int):
    """Plan the compute buffer: node outputs keep their offsets; the input area is laid out after the
    graph's other inputs, whose size follows the padded n_kv (the KQ mask), so the input copy moves."""
    input_area = 2 * N_EMBD
    inputs.buffer = compute
    inputs.data = compute.base + (0 if n_kv <= KV_PAD else N_EMBD)
    off = input_area
    for node in nodes:
        node.buffer = compute
        node.data = compute.base + off
        n = 1
        for d in node.ne:
            n *= d
        off += n


def run(variant: str, device: str = "cpu"):
    model = Model(device)

    def serve(graphed: bool):
        # The CUDA split (FFN block): one input copy from the CPU split, four nodes, one compute buffer.
        attn_out = ggml_tensor("attn_out (copy)", GGML_OP_NONE, (N_EMBD,))
        up = ggml_tensor("ffn_up-0", GGML_OP_MUL_MAT, (N_FF,), src=(model.ffn_up, attn_out))
        act = ggml_tensor("ffn_silu-0", GGML_OP_UNARY, (N_FF,), src=(up,), op_params=(GGML_UNARY_OP_SILU,))
        down = ggml_tensor("ffn_out-0", GGML_OP_MUL_MAT, (N_EMBD,), src=(model.ffn_down, act))
        l_out = ggml_tensor("l_out-0", GGML_OP_ADD, (N_EMBD,), src=(down, attn_out))
        cgraph = ggml_cgraph([up, act, down, l_out])
        compute = ggml_backend_buffer(2 * N_EMBD + 2 * N_FF + 2 * N_EMBD, device)   # CUDA0 compute buffer
        cuda_graph = ggml_cuda_graph()
        history, outs, planned_n_kv = [], [], None
        for n_past, token in enumerate(TOKENS):
            n_kv = -(-(n_past + 1) // KV_PAD) * KV_PAD
            attn = cpu_attention(model, token, history)
            if n_kv != planned_n_kv:                   # the graph changed shape: ggml-alloc re-plans it
                ggml_gallocr_alloc_graph(compute, attn_out, cgraph.nodes, n_kv)
                planned_n_kv = n_kv
            attn_out.view().copy_(attn)                # ggml_backend_tensor_copy into the split input
            if graphed:
                out = ggml_backend_cuda_graph_compute(cuda_graph, cgraph, device, variant)
            else:
                out = ggml_cuda_graph_evaluate(cgraph)
            outs.append(out.clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
