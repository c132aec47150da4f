"""ik_llama.cpp keeps the very first decode graph of a recurrent/hybrid model for reuse; that graph was built at position 0 and carries a ``state_reset`` node (``ggml_scale(state, 0)``), so every later token reuses it, the CUDA backend finds the same ggml graph and replays the captured executable, and the recurrent state is zeroed before each token.

Upstream: https://github.com/ikawrakow/ik_llama.cpp/pull/1393 ("Discard very first compute graph for recurrent
models", ikawrakow/ik_llama.cpp, by Iwan Kawrakow, merged 2026-03-10 as commit cda15bf17 on main). Read: the full diff
of cda15bf17 (``src/llama.cpp``, ``llama_decode_internal``: a ``reset_previous`` flag set when
``llama_model_has_recurrent(&lctx.model) && kv_self.head == 0`` before ``kv_self.head += n_tokens``, and
``lctx.prev.reset()`` at the end of the ubatch; the other hunks are whitespace) and the PR description; at its parent:
``src/llama.cpp`` (``llama_context::Prev``, ``reset_scheduler``, ``can_reuse_graph``, ``update_cache_copies``, the
ubatch loop of ``llama_decode_internal``: ``llama_kv_cache_find_slot``, the padded ``kv_self.n``, build or reuse,
``llama_set_inputs``, ``llama_graph_compute``, the head update, the closing ``if (!lctx.prev) reset_scheduler()``),
``src/llama-delta-net.cpp`` (``delta_net::build_layer_attn_linear``: ``reset_state = batch.pos[0] == 0``;
``build_layer_attn_linear_core``; ``build_qkv``: ``state_dst`` view of the slot row, ``ggml_scale(state, 0.0f)`` named
``state_reset`` when reset, the fused delta-net op, ``ggml_cpy(new_state_flat, state_dst)``),
``src/llama-build-context.cpp`` (``llm_build_kv_store``: ``cache_copies[2*il].cpy = ggml_cpy(k_cur, k_cache_view)``
at ``kv_head``, ``step``) and ``ggml/src/ggml-cuda.cu`` (``ggml_cuda_graph_get_key`` = ``cgraph->nodes[0]``,
``ggml_backend_cuda_graph_compute``, ``is_cuda_graph_update_required``, ``ggml_graph_node_has_matching_properties``
with its CPY/VIEW exemptions, ``check_node_graph_compatibility_and_refresh_copy_ops`` and the ``cpy_dest_ptrs``
indirection, ``evaluate_and_capture_cuda_graph``: capture at first sight, instantiate/update, launch).
Not read: the CUDA kernels (``ggml_cuda_op_delta_net``, the copy kernels beyond their indirection argument), the
scheduler's split logic, the MTP paths of ``llama_decode_internal``; no issue thread is linked from the PR.
Symptom: (PR text) "When this is the very first token (i.e., ``kv_head = 0``), the 1st compute graph contains a SCALE op
that resets the recurrent state to zero. If using CUDA graphs, the graph will get captured and reused, thus resetting
the recurrent state to zero for each new token." In practice: a Qwen3-Next/Qwen3.5-style hybrid model decoding from an
empty context with a one-token prompt (e.g. ``llama-bench`` TG from an empty cache, a BOS-only prompt) generates from
a recurrent state that only ever holds the current token; the author notes TG from a completely empty context is rare.
Mechanism: with graph reuse on (the default), ``llama_decode_internal`` stores every single-token graph it builds in
``lctx.prev``, and ``can_reuse_graph`` hands it back for the next ubatch when the shape fields match (same
``all_seq_id``, ``n_outputs``, padded ``kv_self.n``; ``kv_self.head > 0``; ``update_cache_copies`` re-points the K/V
cache copies to the new head). Nothing in that key says the graph was built at position 0, where
``build_layer_attn_linear`` decided ``reset_state`` and ``build_qkv`` put a ``state_reset`` scale-by-zero node in
front of the delta-net op. The reused cgraph is the same object, so the CUDA backend's key (``nodes[0]``) and node
properties match (the copy nodes whose destinations moved are exempt and are refreshed through the indirection
table), and the executable captured at position 0 is launched again for positions 1, 2, ...: each launch zeroes the
slot's recurrent state before the token is folded in. A step whose graph is built afresh (no reuse) decides
``reset_state = false`` and keeps the state. From the code, reusing the host graph alone would also re-run the node;
the upstream description attributes it to CUDA graphs, which is the configuration modelled.
Doctor: warmup-divergence, at llama_decode_internal (the capture at position 0 recorded a build-time branch, the state
reset; ``llama_decode_internal`` keeps that graph as ``prev`` and replays it for later tokens, while an eager step at
those positions decides not to reset; the fix is there too).
Fix (upstream): in ``llama_decode_internal``, ``reset_previous = llama_model_has_recurrent(&lctx.model) &&
kv_self.head == 0`` is taken before the head advances, and after the ubatch ``if (reset_previous) lctx.prev.reset();``:
the first graph is never reused, the next token builds (and the backend recaptures) a graph without the reset.
Modelled: ``llama_context`` (``Prev``, ``reset_scheduler``, ``can_reuse_graph``, ``update_cache_copies``,
``cache_copies``), ``llama_kv_cache_find_slot``/``llama_kv_cache_cell_max`` and the padded ``kv_self.n``,
``llama_set_inputs`` (tokens, positions, the KQ mask), ``llama_decode_internal`` (build or reuse, compute, head update,
``reset_previous`` in the fix), ``llm_build_context.build_qwen3next`` with ``delta_net.build_layer_attn_linear`` /
``build_layer_attn_linear_core`` / ``build_qkv`` and ``llm_build_kv_store``, a ggml graph of ``ggml_tensor`` nodes
(ops GET_ROWS, ADD, MUL_MAT, SCALE, VIEW, CPY, DELTA_NET, FLASH_ATTN_EXT) allocated in a compute buffer by
``ggml_gallocr_alloc_graph``, and the CUDA backend: ``ggml_backend_cuda_graph_compute``, ``ggml_cuda_graph_get_key``,
``is_cuda_graph_update_required``, ``ggml_graph_node_has_matching_properties``, ``set_ggml_graph_node_properties``,
``check_node_graph_compatibility_and_refresh_copy_ops``, ``ggml_cuda_cpy_dest_ptrs_copy`` and
``evaluate_and_capture_cuda_graph`` (capture with no eager warm-up, then launch; later calls launch only).
Stand-ins: a two-layer hybrid (one gated-delta-rule layer with a one-head E x E state and no conv state, one attention
layer with a K/V cache and no RoPE, positions entering as a learned embedding); the delta-net op is one node that
computes q/k/v/beta/gate from its input and writes outputs and the new state into one tensor; addresses are element
offsets in per-buffer arenas (tensor structs get addresses from a meta arena that restarts with every build, as
ggml's ``buf_compute_meta`` does, so ``nodes[0]`` is the same key across rebuilds); one backend, no scheduler splits;
the MTP fields of ``Prev``/``can_reuse_graph`` and the per-slot ``inp_s_seq_qnext`` input left out (one sequence, no
MTP); teacher-forced tokens instead of sampling; float64.
Workload: one sequence, prompt ``[1]`` (one token at position 0), then seven decode tokens at positions 1..7; KV cache
of 16 cells padded to 4 (``kv_self.n`` is 4 for positions 0..3 and 8 for 4..7). Served: graph reuse and CUDA graphs
on; reference: every ubatch built afresh and evaluated without graphs. Outputs compared: the logits of every step.
Measured: bug: max |graph - eager| = 2.44 (CPU, float64). Per step: position 0 equals eager (captured with 24 nodes,
then launched); positions 1, 2, 3 replay that executable and differ by 0.71, 1.26, 2.44 (the state is zeroed before
each token); position 4 rebuilds and recaptures under the same key (``kv_self.n`` went from 4 to 8; 23 nodes, no
reset) but starts from the damaged state, and positions 4..7 (replays from 5 on) differ by 0.69, 0.69, 0.63, 0.020.
Fix: equals eager (max |graph - eager| = 0): the position-0 graph is dropped, position 1 rebuilds and recaptures under
the same key (23 nodes), positions 2 and 3 replay, position 4 recaptures (``kv_self.n`` changed), 5..7 replay.
"""
from __future__ import annotations

import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/ikawrakow/ik_llama.cpp/pull/1393"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "llama_decode_internal"
SYMPTOM = ("decoding a hybrid model from an empty context: the kept position-0 graph (with its state_reset node) is "
           "replayed for every later token, zeroing the recurrent state each step")

DTYPE = torch.float64
N_VOCAB, N_EMBD, N_CTX, KV_PAD = 16, 4, 16, 4
PROMPT = [1]                                   # a one-token prompt at position 0 (the case the PR describes)
DECODE = [5, 9, 2, 14, 7, 3, 11]               # teacher-forced decode tokens, positions 1..7

GGML_OP_NONE, GGML_OP_GET_ROWS, GGML_OP_ADD, GGML_OP_MUL_MAT = "NONE", "GET_ROWS", "ADD", "MUL_MAT"
GGML_OP_SCALE, GGML_OP_VIEW, GGML_OP_CPY = "SCALE", "VIEW", "CPY"
GGML_OP_DELTA_NET, GGML_OP_FLASH_ATTN_EXT = "DELTA_NET", "FLASH_ATTN_EXT"


# --- ggml (reduced) ---------------------------------------------------------------------------------------------------

class ggml_backend_buffer:
    """One allocation; a tensor lives at ``base + offset`` (its ``data``, in elements)."""

    _next_base = 0x7F00_0000

    def __init__(self, name: str, n: int, dtype, device: str):
        self.name = name
        self.base = ggml_backend_buffer._next_base
        ggml_backend_buffer._next_base += 0x10_0000
        self.mem = torch.zeros(n, dtype=dtype, device=device)
        self.used = 0


class ggml_context:
    """The metadata arena a graph is built in: every build starts over at the same base (``buf_compute_meta``)."""

    META_BASE, TENSOR_OVERHEAD = 0x5555_0000, 0x150

    def __init__(self):
        self.n_objects = 0

    def new_object(self) -> int:
        addr = ggml_context.META_BASE + self.n_objects * ggml_context.TENSOR_OVERHEAD
        self.n_objects += 1
        return addr


class ggml_tensor:
    def __init__(self, ctx: ggml_context | None, op, ne, src=(), op_params=(), name="", view_src=None, view_offs=0,
                 buffer=None, data=None):
        self.addr = ctx.new_object() if ctx is not None else id(self)
        self.op, self.ne, self.src, self.op_params, self.name = op, tuple(ne), list(src), tuple(op_params), name
        self.view_src, self.view_offs = view_src, view_offs
        self.buffer, self.data = buffer, data
        if view_src is not None and view_src.data is not None:
            self.buffer, self.data = view_src.buffer, view_src.data + view_offs

    def nelements(self) -> int:
        return self.ne[0] * self.ne[1]

    def t(self) -> torch.Tensor:
        off = self.data - self.buffer.base
        return self.buffer.mem[off:off + self.nelements()].view(self.ne[1], self.ne[0])


class ggml_cgraph:
    def __init__(self):
        self.nodes: list[ggml_tensor] = []
        self.leafs: list[ggml_tensor] = []


def ggml_build_forward_expand(gf: ggml_cgraph, t: ggml_tensor):
    if t in gf.nodes or t in gf.leafs:
        return
    for s in t.src:
        ggml_build_forward_expand(gf, s)
    if t.view_src is not None:
        ggml_build_forward_expand(gf, t.view_src)
    (gf.leafs if t.op == GGML_OP_NONE else gf.nodes).append(t)


def ggml_view(ctx, a, ne, offs, name):
    return ggml_tensor(ctx, GGML_OP_VIEW, ne, src=(a,), name=name, view_src=a, view_offs=offs)


def ggml_cpy(ctx, a, b, name):
    """The result is a view of ``b`` (same data), as in ggml."""
    return ggml_tensor(ctx, GGML_OP_CPY, b.ne, src=(a, b), name=name, view_src=b)


def ggml_gallocr_alloc_graph(compute: ggml_backend_buffer, compute_i: ggml_backend_buffer, gf: ggml_cgraph):
    """Lay the graph's own tensors out in the compute buffers, in node order (same structure, same addresses)."""
    compute.used = compute_i.used = 0
    for t in gf.leafs + gf.nodes:
        if t.data is not None:
            continue
        if t.view_src is not None:                             # ggml_backend_view_init
            t.buffer, t.data = t.view_src.buffer, t.view_src.data + t.view_offs
            continue
        buf = compute_i if t.name in ("inp_tokens", "inp_pos") else compute
        t.buffer, t.data = buf, buf.base + buf.used
        buf.used += t.nelements()
        assert buf.used <= buf.mem.numel()


# --- the CUDA backend (ggml-cuda.cu, reduced) -------------------------------------------------------------------------

class ggml_graph_node_properties:
    def __init__(self, node: ggml_tensor):        # set_ggml_graph_node_properties
        self.node_address, self.node_op, self.ne = node.data, node.op, node.ne
        self.src_address = [s.data for s in node.src]
        self.op_params = node.op_params


class ggml_cuda_graph:
    def __init__(self):
        self.instance = None                       # the captured executable (a workbench graph)
        self.outputs = None
        self.ggml_graph_properties: list[ggml_graph_node_properties] = []
        self.number_consecutive_updates = 0
        self.disable_due_to_too_many_updates = False
        self.cpy_dest_ptrs: list[int] = []
        self.dest_ptrs_d: torch.Tensor | None = None
        self.use_cpy_indirection = False
        self.graph_cpynode_index = 0


class ggml_backend_cuda_context:
    def __init__(self, device: str, use_cuda_graph: bool):
        self.device, self.use_cuda_graph = device, use_cuda_graph
        self.cuda_graphs: dict[int, ggml_cuda_graph] = {}
        self.cur_graph: ggml_cuda_graph | None = None
        self.static: dict[str, torch.Tensor] = {}     # what the graph reads per step (announced to the kit)
        self.state: dict[str, torch.Tensor] = {}      # KV cache and recurrent state


def ggml_cuda_graph_get_key(cgraph: ggml_cgraph) -> int:
    return cgraph.nodes[0].addr


def ggml_cuda_get_graph(ctx: ggml_backend_cuda_context, key: int) -> ggml_cuda_graph:
    if key not in ctx.cuda_graphs:
        ctx.cuda_graphs[key] = ggml_cuda_graph()
    return ctx.cuda_graphs[key]


def ggml_graph_node_has_matching_properties(node: ggml_tensor, props: ggml_graph_node_properties) -> bool:
    if node.data != props.node_address and node.op not in (GGML_OP_CPY, GGML_OP_VIEW):
        return False
    if node.op != props.node_op or node.ne != props.ne or len(node.src) != len(props.src_address):
        return False
    for i, s in enumerate(node.src):
        if s.data != props.src_address[i] and node.op not in (GGML_OP_CPY, GGML_OP_VIEW):
            return False
    if node.op == GGML_OP_SCALE and node.op_params != props.op_params:
        return False
    return True


def is_cuda_graph_update_required(graph: ggml_cuda_graph, cgraph: ggml_cgraph) -> bool:
    update_required = graph.instance is None
    if len(graph.ggml_graph_properties) != len(cgraph.nodes):
        update_required = True
        graph.ggml_graph_properties = [None] * len(cgraph.nodes)
    for i, node in enumerate(cgraph.nodes):
        if not update_required and not ggml_graph_node_has_matching_properties(node, graph.ggml_graph_properties[i]):
            update_required = True
        graph.ggml_graph_properties[i] = ggml_graph_node_properties(node)
    return update_required


def ggml_cuda_cpy_dest_ptrs_copy(graph: ggml_cuda_graph, ptrs: list[int], device: str):
    if graph.dest_ptrs_d is None or graph.dest_ptrs_d.numel() < len(ptrs):
        graph.dest_ptrs_d = torch.zeros(max(len(ptrs), 1), dtype=torch.int64, device=device)
    graph.dest_ptrs_d[:len(ptrs)].copy_(torch.tensor(ptrs, dtype=torch.int64))   # cudaMemcpyAsync, before launch
    graph.graph_cpynode_index = 0


def check_node_graph_compatibility_and_refresh_copy_ops(graph, cgraph, use_cuda_graph, device) -> bool:
    graph.cpy_dest_ptrs = [node.src[1].data for node in cgraph.nodes if node.op == GGML_OP_CPY]
    if use_cuda_graph:
        graph.use_cpy_indirection = True
        ggml_cuda_cpy_dest_ptrs_copy(graph, graph.cpy_dest_ptrs, device)
    return use_cuda_graph


def ggml_cuda_cpy(ctx: ggml_backend_cuda_context, src0: ggml_tensor, src1: ggml_tensor):
    g = ctx.cur_graph
    if g is not None and g.use_cpy_indirection:           # cdst_indirect[graph_cpynode_index], read at launch
        dst_addr = g.dest_ptrs_d[g.graph_cpynode_index]
        g.graph_cpynode_index += 1
        n = src0.nelements()
        idx = dst_addr - src1.buffer.base + torch.arange(n, device=ctx.device)
        src1.buffer.mem.index_copy_(0, idx, src0.t().reshape(-1))
    else:
        src1.t().copy_(src0.t())


def ggml_cuda_op_delta_net(dst: ggml_tensor):
    """Gated delta rule over the ubatch's tokens: rows [0, n) of dst are the outputs, rows [n, n+E) the new state."""
    x, state, wq, wk, wv, w_beta, w_gate = (s.t() for s in dst.src)
    q, k, v = x @ wq.T, x @ wk.T, x @ wv.T
    k = k / k.norm(dim=-1, keepdim=True)
    beta, gate = torch.sigmoid(x @ w_beta.T), torch.sigmoid(x @ w_gate.T)
    s = state.clone()
    outs = []
    for i in range(x.shape[0]):
        s = gate[i:i + 1] * s
        delta = (v[i:i + 1] - k[i:i + 1] @ s) * beta[i:i + 1]
        s = s + k[i:i + 1].T @ delta
        outs.append(q[i:i + 1] @ s)
    out = dst.t()
    out[:x.shape[0]].copy_(torch.cat(outs))
    out[x.shape[0]:].copy_(s)


def ggml_cuda_compute_forward(ctx: ggml_backend_cuda_context, node: ggml_tensor):
    if node.op == GGML_OP_VIEW:
        return
    a = node.src[0]
    if node.op == GGML_OP_GET_ROWS:
        node.t().copy_(a.t().index_select(0, node.src[1].t().reshape(-1)))
    elif node.op == GGML_OP_ADD:
        node.t().copy_(a.t() + node.src[1].t())
    elif node.op == GGML_OP_MUL_MAT:                          # ggml_mul_mat(w, x) = x @ w^T
        node.t().copy_(node.src[1].t() @ a.t().T)
    elif node.op == GGML_OP_SCALE:
        node.t().copy_(a.t() * node.op_params[0])
    elif node.op == GGML_OP_CPY:
        ggml_cuda_cpy(ctx, a, node.src[1])
    elif node.op == GGML_OP_DELTA_NET:
        ggml_cuda_op_delta_net(node)
    elif node.op == GGML_OP_FLASH_ATTN_EXT:
        q, k, v, mask = (s.t() for s in node.src)
        node.t().copy_(torch.softmax(q @ k.T * node.op_params[0] + mask, dim=-1) @ v)
    else:
        raise NotImplementedError(node.op)


def ggml_cuda_graph_evaluate(ctx: ggml_backend_cuda_context, cgraph: ggml_cgraph) -> torch.Tensor:
    for node in cgraph.nodes:
        ggml_cuda_compute_forward(ctx, node)
    return cgraph.nodes[-1].t()


def evaluate_and_capture_cuda_graph(ctx, cgraph, use_cuda_graph: bool, update_required: bool):
    graph = ctx.cur_graph
    if not use_cuda_graph:
        return ggml_cuda_graph_evaluate(ctx, cgraph)
    if update_required:                                       # cudaStreamBeginCapture .. EndCapture, ExecUpdate
        graph.instance, graph.outputs = capture(
            lambda: ggml_cuda_graph_evaluate(ctx, cgraph), device=ctx.device, warmups=0,
            name=f"ggml-cuda graph key={ggml_cuda_graph_get_key(cgraph):#x}, {len(cgraph.nodes)} nodes",
            static=dict(ctx.static, cpy_dest_ptrs=graph.dest_ptrs_d), state=ctx.state, owner="ggml-cuda backend")
    return replay(graph.instance, graph.outputs)              # cudaGraphLaunch


def ggml_backend_cuda_graph_compute(ctx: ggml_backend_cuda_context, cgraph: ggml_cgraph) -> torch.Tensor:
    ctx.cur_graph = None
    use_cuda_graph = ctx.use_cuda_graph
    graph = None
    if use_cuda_graph:
        graph = ggml_cuda_get_graph(ctx, ggml_cuda_graph_get_key(cgraph))
    ctx.cur_graph = graph
    update_required = False
    if use_cuda_graph and graph.disable_due_to_too_many_updates:
        use_cuda_graph = False
    if use_cuda_graph:
        update_required = is_cuda_graph_update_required(graph, cgraph)
        use_cuda_graph = check_node_graph_compatibility_and_refresh_copy_ops(graph, cgraph, use_cuda_graph,
                                                                             ctx.device)
        graph.number_consecutive_updates = graph.number_consecutive_updates + 1 if update_required else 0
        if graph.number_consecutive_updates >= 4:
            graph.disable_due_to_too_many_updates = True
            use_cuda_graph = False
            ctx.cur_graph = None
    if graph is not None and not use_cuda_graph:
        graph.use_cpy_indirection = False
    return evaluate_and_capture_cuda_graph(ctx, cgraph, use_cuda_graph, update_required)


# --- llama (ik_llama.cpp, reduced) ------------------------------------------------------------------------------------

class llama_model:
    """A tiny hybrid: layer 0 is a gated-delta-rule (linear attention) layer, layer 1 full attention."""

    def __init__(self, device):
        gen = generator(1393)
        self.buf = ggml_backend_buffer("CUDA0 model buffer", 4096, DTYPE, device)

        def weight(name, rows, cols, scale):
            t = ggml_tensor(None, GGML_OP_NONE, (cols, rows), name=name, buffer=self.buf,
                            data=self.buf.base + self.buf.used)
            self.buf.used += rows * cols
            t.t().copy_(randn(rows, cols, gen=gen, device=device, scale=scale).to(DTYPE))
            return t

        self.tok_embd = weight("token_embd", N_VOCAB, N_EMBD, 1.0)
        self.pos_embd = weight("pos_embd", N_CTX, N_EMBD, 0.3)
        self.wq, self.wk, self.wv = (weight(f"blk.0.ssm_{n}", N_EMBD, N_EMBD, 0.7) for n in "qkv")
        self.w_beta = weight("blk.0.ssm_beta", 1, N_EMBD, 1.0)
        self.w_gate = weight("blk.0.ssm_gate", 1, N_EMBD, 1.0)
        self.ssm_out = weight("blk.0.ssm_out", N_EMBD, N_EMBD, 0.7)
        self.wq1, self.wk1, self.wv1, self.wo1 = (weight(f"blk.1.attn_{n}", N_EMBD, N_EMBD, 0.7) for n in "qkvo")
        self.output = weight("output", N_VOCAB, N_EMBD, 1.0)
        self.recurrent_layers = {0}


def llama_model_has_recurrent(model: llama_model) -> bool:
    return bool(model.recurrent_layers)


class llama_kv_cache:
    def __init__(self, device):
        self.size, self.head, self.used, self.n = N_CTX, 0, 0, 0
        self.cells_pos = [-1] * N_CTX
        self.buf = ggml_backend_buffer("CUDA0 KV buffer", 2 * N_CTX * N_EMBD + N_EMBD * N_EMBD, DTYPE, device)
        base = self.buf.base
        self.k_l = ggml_tensor(None, GGML_OP_NONE, (N_EMBD, N_CTX), name="cache_k_l1", buffer=self.buf, data=base)
        self.v_l = ggml_tensor(None, GGML_OP_NONE, (N_EMBD, N_CTX), name="cache_v_l1", buffer=self.buf,
                               data=base + N_CTX * N_EMBD)
        self.s_l = ggml_tensor(None, GGML_OP_NONE, (N_EMBD * N_EMBD, 1), name="cache_s_l0", buffer=self.buf,
                               data=base + 2 * N_CTX * N_EMBD)     # one state slot (qnext_state_slots = 1)


def llama_kv_cache_find_slot(kv: llama_kv_cache, batch) -> bool:
    kv.head = kv.used                                         # one sequence, no holes: the next free cell
    for i, p in enumerate(batch.pos):
        kv.cells_pos[kv.head + i] = p
    kv.used += batch.n_tokens
    return True


def llama_kv_cache_cell_max(kv: llama_kv_cache) -> int:
    return max((i + 1 for i, p in enumerate(kv.cells_pos) if p >= 0), default=0)


class llama_batch:
    def __init__(self, tokens, pos, seq_id=0):
        self.token, self.pos = list(tokens), list(pos)
        self.n_tokens, self.all_seq_id, self.embd = len(self.token), seq_id, None


class llama_cache_copy:
    def __init__(self):
        self.cpy: ggml_tensor | None = None
        self.step = 0


class Prev:                                                    # llama_context::Prev
    def __init__(self, all_seq_id, n_outputs, n_kv, graph):
        self.all_seq_id, self.n_outputs, self.n_kv, self.graph = all_seq_id, n_outputs, n_kv, graph


class llama_context:
    def __init__(self, model: llama_model, device: str, graph_reuse: bool, use_cuda_graph: bool):
        self.model, self.device = model, device
        self.kv_self = llama_kv_cache(device)
        self.graph_reuse = graph_reuse                         # cparams.graph_reuse (default on)
        self.backend = ggml_backend_cuda_context(device, use_cuda_graph)
        self.buf_compute = ggml_backend_buffer("CUDA0 compute buffer", 512, DTYPE, device)
        self.buf_compute_i = ggml_backend_buffer("CUDA0 compute buffer (I32)", 16, torch.int64, device)
        self.cache_copies = [llama_cache_copy(), llama_cache_copy()]   # [2*il + 0/1] for the attention layer
        self.prev: Prev | None = None
        self.n_outputs = 1
        self.inp_tokens = self.inp_pos = self.inp_KQ_mask = None

    def reset_scheduler(self):
        self.prev = None                                       # ggml_backend_sched_reset(sched); prev.reset()

    def can_reuse_graph(self, u_batch: llama_batch) -> bool:
        if self.prev is None or self.prev.graph is None:
            return False
        if u_batch.n_tokens > 1 or u_batch.embd is not None or not self.graph_reuse:
            return False
        return (u_batch.all_seq_id == self.prev.all_seq_id and
                self.kv_self.head > 0 and
                self.kv_self.n == self.prev.n_kv and
                self.n_outputs == self.prev.n_outputs and
                self.update_cache_copies())

    def update_cache_copies(self) -> bool:
        """Re-point the attention layer's K/V cache copies at the new head (recurrent layers have none)."""
        for c, cache in zip(self.cache_copies, (self.kv_self.k_l, self.kv_self.v_l)):
            if c.cpy is None or c.cpy.op != GGML_OP_CPY or c.cpy.src[1].view_src is not cache:
                return False
            c.cpy.src[1].view_offs = self.kv_self.head * c.step
            c.cpy.src[1].data = cache.data + c.cpy.src[1].view_offs
            c.cpy.data = c.cpy.src[1].data
        return True


class delta_net:
    def __init__(self, lctx: llama_context, batch: llama_batch):
        self.lctx, self.batch = lctx, batch

    def build_qkv(self, ctx0, gf, cur, state_seq_id_local: int, reset_state_local: bool, il: int):
        m, kv = self.lctx.model, self.lctx.kv_self
        row = N_EMBD * N_EMBD
        state_dst = ggml_view(ctx0, kv.s_l, (N_EMBD, N_EMBD), state_seq_id_local * row, f"state_dst-{il}")
        state = state_dst
        if reset_state_local:
            state = ggml_tensor(ctx0, GGML_OP_SCALE, state.ne, src=(state,), op_params=(0.0,),
                                name=f"state_reset-{il}")
        n = cur.ne[1]
        fused = ggml_tensor(ctx0, GGML_OP_DELTA_NET, (N_EMBD, n + N_EMBD),
                            src=(cur, state, m.wq, m.wk, m.wv, m.w_beta, m.w_gate), name=f"delta_net_fused-{il}")
        output = ggml_view(ctx0, fused, (N_EMBD, n), 0, f"attn_output-{il}")
        new_state = ggml_view(ctx0, fused, (N_EMBD, N_EMBD), n * N_EMBD, f"new_state-{il}")
        ggml_build_forward_expand(gf, ggml_cpy(ctx0, new_state, state_dst, f"state_cpy-{il}"))
        return output

    def build_layer_attn_linear_core(self, ctx0, gf, cur, state_seq_id_local, reset_state_local, il):
        output = self.build_qkv(ctx0, gf, cur, state_seq_id_local, reset_state_local, il)
        return ggml_tensor(ctx0, GGML_OP_MUL_MAT, (N_EMBD, cur.ne[1]), src=(self.lctx.model.ssm_out, output),
                           name=f"linear_attn_out-{il}")

    def build_layer_attn_linear(self, ctx0, gf, cur, il):
        reset_state = self.batch.pos[0] == 0                  # decided when the graph is built
        return self.build_layer_attn_linear_core(ctx0, gf, cur, self.batch.all_seq_id, reset_state, il)


def llm_build_kv_store(lctx, ctx0, gf, k_cur, v_cur, n_tokens, kv_head, il):
    kv = lctx.kv_self
    for j, (cur, cache) in enumerate(((k_cur, kv.k_l), (v_cur, kv.v_l))):
        view = ggml_view(ctx0, cache, (N_EMBD, n_tokens), N_EMBD * kv_head, f"{'kv'[j]}_cache_view-{il}")
        lctx.cache_copies[2 * (il - 1) + j].cpy = ggml_cpy(ctx0, cur, view, f"{'kv'[j]}_cache_cpy-{il}")
        lctx.cache_copies[2 * (il - 1) + j].step = N_EMBD
        ggml_build_forward_expand(gf, lctx.cache_copies[2 * (il - 1) + j].cpy)


class llm_build_context:
    @staticmethod
    def build_qwen3next(lctx: llama_context, batch: llama_batch) -> ggml_cgraph:
        m, kv = lctx.model, lctx.kv_self
        ctx0, gf, n = ggml_context(), ggml_cgraph(), batch.n_tokens
        lctx.inp_tokens = ggml_tensor(ctx0, GGML_OP_NONE, (n, 1), name="inp_tokens")
        lctx.inp_pos = ggml_tensor(ctx0, GGML_OP_NONE, (n, 1), name="inp_pos")
        lctx.inp_KQ_mask = ggml_tensor(ctx0, GGML_OP_NONE, (kv.n, n), name="KQ_mask")
        tok = ggml_tensor(ctx0, GGML_OP_GET_ROWS, (N_EMBD, n), src=(m.tok_embd, lctx.inp_tokens), name="inp_embd")
        pos = ggml_tensor(ctx0, GGML_OP_GET_ROWS, (N_EMBD, n), src=(m.pos_embd, lctx.inp_pos), name="inp_pos_embd")
        inpL = ggml_tensor(ctx0, GGML_OP_ADD, (N_EMBD, n), src=(tok, pos), name="inpL")
        # layer 0: linear attention (recurrent state)
        lin = delta_net(lctx, batch).build_layer_attn_linear(ctx0, gf, inpL, 0)
        cur = ggml_tensor(ctx0, GGML_OP_ADD, (N_EMBD, n), src=(lin, inpL), name="l_out-0")
        # layer 1: attention over the KV cache
        q = ggml_tensor(ctx0, GGML_OP_MUL_MAT, (N_EMBD, n), src=(m.wq1, cur), name="Qcur-1")
        k = ggml_tensor(ctx0, GGML_OP_MUL_MAT, (N_EMBD, n), src=(m.wk1, cur), name="Kcur-1")
        v = ggml_tensor(ctx0, GGML_OP_MUL_MAT, (N_EMBD, n), src=(m.wv1, cur), name="Vcur-1")
        llm_build_kv_store(lctx, ctx0, gf, k, v, n, kv.head, 1)
        k_view = ggml_view(ctx0, kv.k_l, (N_EMBD, kv.n), 0, "k-1")
        v_view = ggml_view(ctx0, kv.v_l, (N_EMBD, kv.n), 0, "v-1")
        fa = ggml_tensor(ctx0, GGML_OP_FLASH_ATTN_EXT, (N_EMBD, n), src=(q, k_view, v_view, lctx.inp_KQ_mask),
                         op_params=(1.0 / math.sqrt(N_EMBD),), name="fattn-1")
        attn = ggml_tensor(ctx0, GGML_OP_MUL_MAT, (N_EMBD, n), src=(m.wo1, fa), name="attn_out-1")
        cur = ggml_tensor(ctx0, GGML_OP_ADD, (N_EMBD, n), src=(attn, cur), name="l_out-1")
        res = ggml_tensor(ctx0, GGML_OP_MUL_MAT, (N_VOCAB, n), src=(m.output, cur), name="result_output")
        ggml_build_forward_expand(gf, res)
        return gf


def llama_set_inputs(lctx: llama_context, batch: llama_batch):
    lctx.inp_tokens.t().copy_(torch.tensor(batch.token).view(-1, 1))
    lctx.inp_pos.t().copy_(torch.tensor(batch.pos).view(-1, 1))
    kv = lctx.kv_self
    mask = torch.full((batch.n_tokens, kv.n), float("-inf"), dtype=DTYPE)
    for i, p in enumerate(batch.pos):
        for j in range(kv.n):
            if 0 <= kv.cells_pos[j] <= p:
                mask[i, j] = 0.0
    lctx.inp_KQ_mask.t().copy_(mask)


def llama_graph_compute(lctx: llama_context, gf: ggml_cgraph) -> torch.Tensor:
    b = lctx.backend
    b.static = {"inp_tokens": lctx.inp_tokens.t(), "inp_pos": lctx.inp_pos.t(), "KQ_mask": lctx.inp_KQ_mask.t()}
    b.state = {"cache_k_l1": lctx.kv_self.k_l.t(), "cache_v_l1": lctx.kv_self.v_l.t(),
               "cache_s_l0 (recurrent state)": lctx.kv_self.s_l.t()}
    return ggml_backend_cuda_graph_compute(b, gf)


def llama_decode_internal(lctx: llama_context, batch: llama_batch, variant: str) -> torch.Tensor:
    kv = lctx.kv_self
    u_batch, n_tokens = batch, batch.n_tokens                  # one ubatch
    llama_kv_cache_find_slot(kv, u_batch)
    kv.n = min(kv.size, max(KV_PAD, -(-llama_kv_cache_cell_max(kv) // KV_PAD) * KV_PAD))
    if not lctx.can_reuse_graph(u_batch):
        lctx.reset_scheduler()
        gf = llm_build_context.build_qwen3next(lctx, u_batch)  # llama_build_graph
        ggml_gallocr_alloc_graph(lctx.buf_compute, lctx.buf_compute_i, gf)   # ggml_backend_sched_alloc_graph
        if u_batch.n_tokens == 1 and u_batch.embd is None and lctx.graph_reuse:
            lctx.prev = Prev(u_batch.all_seq_id, lctx.n_outputs, kv.n, gf)
    else:
        gf = lctx.prev.graph                                   # reusing the previous graph
    llama_set_inputs(lctx, u_batch)
    res = llama_graph_compute(lctx, gf)
    logits = res[-1:].clone()                                  # ggml_backend_tensor_get_async(res -> logits)

    reset_previous = False
    if variant == "fix" and llama_model_has_recurrent(lctx.model) and kv.head == 0:
        reset_previous = True                                  # the graph just computed was built at kv_head 0
    kv.head += n_tokens
    if kv.head >= kv.size:
        kv.head = 0
    if reset_previous:
        lctx.prev = None                                       # lctx.prev.reset(): never reuse the 1st graph

    if lctx.prev is None:
        lctx.reset_scheduler()
    return logits


def run(variant: str, device: str = "cpu"):
    model = llama_model(device)

    def serve(graphs: bool):
        lctx = llama_context(model, device, graph_reuse=graphs, use_cuda_graph=graphs)
        logits = [llama_decode_internal(lctx, llama_batch(PROMPT, range(len(PROMPT))), variant)]
        n_past = len(PROMPT)
        for token in DECODE:
            logits.append(llama_decode_internal(lctx, llama_batch([token], [n_past]), variant))
            n_past += 1
        return logits

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
