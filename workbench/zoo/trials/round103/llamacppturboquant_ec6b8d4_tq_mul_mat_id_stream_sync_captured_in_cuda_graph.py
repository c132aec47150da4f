"""llama-cpp-turboquant, MoE model with TQ4_1S experts: the CUDA-graph compatibility check lets a decode graph with a TQ4_1S MUL_MAT_ID be captured, but that MUL_MAT_ID takes the generic path that copies the expert ids to the host and synchronizes the stream, so the capture fails.

Upstream: https://github.com/TheTom/llama-cpp-turboquant/commit/ec6b8d420b470d9392a978e9caacd016deb4de83
("fix: TQ4_1S on MoE models -- disable CUDA graphs for TQ MUL_MAT_ID", TheTom/llama-cpp-turboquant, Gabe Ortiz,
2026-04-01, a fixing commit on the fork's main line, no PR). The MUL_MAT_ID exclusion of TQ weights from MMVQ
(``is_tq_weight_id``) came with 2ebd51963 ("feat: CUDA port of TQ4_1S/TQ3_1S weight dequant").
Read: the commit message and diff (``ggml/src/ggml-cuda/ggml-cuda.cu``: ``ggml_cuda_graph_check_compability``;
``ggml/src/ggml-cuda/mmvq-tq.cu``: the pre-rotation scratch), and at the parent commit ``ggml_cuda_mul_mat_id``,
``ggml_backend_cuda_graph_compute`` (warmup and capture), ``ggml_cuda_should_use_mmq`` (no TQ types),
``ggml_cuda_should_use_mmf`` (no quantized types), ``get_mmvq_mmid_max_batch`` (default ``MMVQ_MAX_BATCH_SIZE`` = 8),
``block_tq4_1s`` (``ggml-common.h``), ``dequantize_tq4_1s`` and ``TQ4_CENTROIDS_WEIGHT`` (``turbo-quant.cuh``).
Symptom: the commit message: "MoE models use MUL_MAT_ID which calls cudaStreamSynchronize in the expert routing
dispatch. This is incompatible with CUDA graph capture." With CUDA graphs on, decoding a MoE model whose expert
tensors are TQ4_1S (the commit tested Qwen3.5-35B TQ4_1S) fails at the first capture of the decode graph, where
ggml's ``CUDA_CHECK`` aborts on the ids copy / synchronize (my reading of the code: no log is given); with
``GGML_CUDA_DISABLE_GRAPHS=1``, or with a dense TQ4_1S model, it runs.
Mechanism: ``ggml_cuda_mul_mat_id`` serves a quantized expert tensor with the fused MMVQ kernel (ids read on the
device) when ``ne2 <= get_mmvq_mmid_max_batch``, except TQ weights (``is_tq_weight_id``: no MMVQ/MMQ/MMF kernels for
them), which fall through to the generic path: it ``cudaMemcpyAsync``s the ids to a host vector,
``cudaStreamSynchronize``s, sorts the rows by expert on the CPU, copies the sorted index lists back and runs one
matmul per used expert. The code says "this path should not be reached when recording CUDA graphs", and
``ggml_cuda_graph_check_compability`` is what keeps it out ([TAG_MUL_MAT_ID_CUDA_GRAPHS]): it disables graphs for a
MUL_MAT_ID whose weights are not quantized or whose batch exceeds the MMVQ limit. TQ4_1S is quantized
(``ggml_is_quantized``) and a decode batch is small, so graphs stay on. ``ggml_backend_cuda_graph_compute`` runs the
first call of a graph eagerly (the host round trip is fine there), sees the same properties on the second call,
ends the warmup and opens the capture (relaxed mode); the generic path's device-to-host copy and stream
synchronize inside it break the capture.
Doctor: sync-in-capture, at ggml_cuda_graph_check_compability: a host synchronisation (the ids read on the host in
``ggml_cuda_mul_mat_id``) runs while the graph capture is open; the wrong decision is the compatibility check's,
which lets a graph whose MUL_MAT_ID must synchronize be captured, and it is the function the fix changes.
Fix (upstream): ``is_tq_w`` joins the condition: ``!ggml_is_quantized(type) || is_tq_w || ne[2] > mmvq_mmid_max``
disables CUDA graphs for a graph with a TQ MUL_MAT_ID, so it is evaluated node by node every call. The commit also
replaces the grow-on-demand ``cudaFree``/``cudaMalloc`` of the TQ activation pre-rotation scratch in
``ggml_cuda_mul_mat_vec_tq`` (dense TQ matmuls) by a static buffer sized outside capture and asserted inside it;
not modelled: the warm eager call already sizes that buffer for the shapes a later capture sees.
Modelled: ``ggml_backend_cuda_graph_compute`` (per-graph enable, compatibility check, property match, two-call
warmup, capture then launch), ``ggml_cuda_graph_check_compability`` as read, ``ggml_cuda_mul_mat_id`` (MMVQ branch
with the TQ exclusion; the generic path: ids to host (``tolist()`` stands for the copy and the synchronize), host
sort by expert, sorted index lists to the device,
get_rows, one dequantize-then-matmul per expert with tokens, get_rows back), and the node dispatch. Stand-ins: a
2-layer MoE decoder without attention (RMS norm, F32 router, soft-max, top-k, gate/up/down expert MUL_MAT_IDs in
TQ4_1S, weighted sum of the expert views, residual), F32 token embedding and output head; TQ4_1S is kept as 4-bit
indices into ``TQ4_CENTROIDS_WEIGHT`` with the two half-block scales, without the inverse Walsh-Hadamard rotation
(a fixed orthogonal transform: it changes no control flow); node buffers are preallocated (ggml-alloc) and every
node writes into its own; ``ggml_cuda_graph_update_required`` compares the node names and shapes; one context, no
split buffers; ``cc`` is Turing or newer; float64.
Workload: 3 sequences decode together (n_tokens = 3) for 5 steps with greedy sampling, from fixed first tokens; the
logits of every step are compared. Bug: step 1 runs eagerly (first call), step 2 ends the warmup and opens the
capture, and ``ggml_cuda_mul_mat_id``'s ``tolist()`` of the ids raises CaptureError. Fix: the check disables graphs
for this graph, all 5 steps run node by node, and the 15 logit rows equal eager (max error 0).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/TheTom/llama-cpp-turboquant/commit/ec6b8d420b470d9392a978e9caacd016deb4de83"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "ggml_cuda_graph_check_compability"
SYMPTOM = ("MoE decode with TQ4_1S experts aborts at the first CUDA graph capture: the compatibility check keeps "
           "graphs on, and the TQ MUL_MAT_ID's generic path copies the ids to the host and synchronizes the stream")

GGML_TYPE_F32, GGML_TYPE_TQ4_1S, GGML_TYPE_TQ3_1S = "f32", "tq4_1s", "tq3_1s"
QK_TQ4_1S = 32
MMVQ_MAX_BATCH_SIZE = 8
GGML_CUDA_CC_TURING = 750
TQ4_CENTROIDS_WEIGHT = (-2.732590, -2.069017, -1.618046, -1.256231, -0.942340, -0.656759, -0.388048, -0.128395,
                        0.128395, 0.388048, 0.656759, 0.942340, 1.256231, 1.618046, 2.069017, 2.732590)
N_VOCAB, N_EMBD, N_FF, N_EXPERT, N_EXPERT_USED, N_LAYER = 24, 32, 32, 4, 2, 2
N_SEQ, N_STEPS = 3, 5
DTYPE = torch.float64

_variant = "bug"


def ggml_is_quantized(t: str) -> bool:
    return t not in (GGML_TYPE_F32,)


def get_mmvq_mmid_max_batch(t: str, cc: int) -> int:
    return MMVQ_MAX_BATCH_SIZE                     # get_mmvq_mmid_max_batch_turing_plus: default for these types


class ggml_tensor:
    def __init__(self, op, name, src=(), type=GGML_TYPE_F32, data=None):
        self.op, self.name, self.src, self.type, self.data = op, name, list(src), type, data

    @property
    def ne(self):                                  # ggml order: ne[0] is the innermost dimension
        t = self.data[0] if isinstance(self.data, tuple) else self.data
        return tuple(reversed(t.shape)) + (1,) * (4 - t.dim())


def dequantize_tq4_1s(w: ggml_tensor) -> torch.Tensor:
    """``TQ4_CENTROIDS_WEIGHT[idx] * d`` with d0 for elements 0..15 and d1 for 16..31 of every 32-block."""
    qs, d = w.data                                  # 4-bit indices, one scale per half block
    centroids = torch.tensor(TQ4_CENTROIDS_WEIGHT, dtype=DTYPE, device=qs.device)
    return centroids[qs] * d.repeat_interleave(QK_TQ4_1S // 2, dim=-1)


def ggml_get_to_fp(w: ggml_tensor) -> torch.Tensor:
    return dequantize_tq4_1s(w) if w.type == GGML_TYPE_TQ4_1S else w.data


def quantize_tq4_1s(w: torch.Tensor):
    """The weights' TQ4_1S form: nearest centroid of w / d, d = absmax / 2.73 per half block."""
    blocks = w.unflatten(-1, (-1, QK_TQ4_1S // 2))
    d = blocks.abs().amax(-1) / TQ4_CENTROIDS_WEIGHT[-1]
    centroids = torch.tensor(TQ4_CENTROIDS_WEIGHT, dtype=DTYPE, device=w.device)
    qs = ((blocks / d[..., None])[..., None] - centroids).abs().argmin(-1).flatten(-2)
    return qs, d


# --- ggml/src/ggml-cuda/ggml-cuda.cu: ops ----------------------------------------------------------------------------

def ggml_cuda_mul_mat(src0_data: torch.Tensor, src1: torch.Tensor) -> torch.Tensor:
    return src1 @ src0_data.transpose(-1, -2)       # dequantized weight x activations (cuBLAS)


def ggml_cuda_mul_mat_vec_q(ctx, src0, src1, ids, dst):
    """MMVQ with ids: each row reads its expert's weights on the device."""
    w = ggml_get_to_fp(src0)[ids.data]                                           # [tokens, used, ne01, ne00]
    b = src1.data.expand(-1, ids.data.size(1), -1)
    dst.data.copy_(torch.einsum("tufe,tue->tuf", w, b))


def ggml_cuda_mul_mat_id(ctx, dst: ggml_tensor):
    src0, src1, ids = dst.src
    ne02 = src0.ne[2]
    ne10, ne11, ne12 = src1.ne[:3]
    ne0, ne2 = dst.ne[0], dst.ne[2]
    cc = ctx.cc

    # [TAG_MUL_MAT_ID_CUDA_GRAPHS]
    # TQ weight types use dequant-to-f16 cuBLAS path only (no mmvq/mmq kernels)
    is_tq_weight_id = src0.type in (GGML_TYPE_TQ4_1S, GGML_TYPE_TQ3_1S)
    if ne2 <= MMVQ_MAX_BATCH_SIZE and ggml_is_quantized(src0.type) and not is_tq_weight_id:
        if ne2 <= get_mmvq_mmid_max_batch(src0.type, cc):
            return ggml_cuda_mul_mat_vec_q(ctx, src0, src1, ids, dst)
    # ggml_cuda_should_use_mmq / _mmf: no kernels for TQ types

    # note: this path should not be reached when recording CUDA graphs, because it requires stream synchronization
    n_expert_used = ids.ne[0]
    ne_get_rows = ne12 * n_expert_used
    ids_host = ids.data.tolist()             # cudaMemcpyAsync(ids_host, ids->data, D2H); cudaStreamSynchronize
    ids_to_sorted_host, ids_from_sorted_host = [], [0] * ne_get_rows
    tokens_per_expert = [0] * ne02
    for i02 in range(ne02):                                  # expert matrices
        for i12 in range(ne12):                              # tokens
            for iex in range(n_expert_used):
                if ids_host[i12][iex] == i02:
                    ids_from_sorted_host[i12 * n_expert_used + iex] = len(ids_to_sorted_host)
                    ids_to_sorted_host.append(i12 * ne11 + iex % ne11)
                    tokens_per_expert[i02] += 1
                    break
    assert len(ids_to_sorted_host) == ne_get_rows
    ids_buf_dev = torch.tensor(ids_to_sorted_host + ids_from_sorted_host, device=dst.data.device)  # H2D + sync
    ids_to_sorted, ids_from_sorted = ids_buf_dev[:ne_get_rows], ids_buf_dev[ne_get_rows:]

    src1_sorted = src1.data.reshape(-1, ne10)[ids_to_sorted]                    # get_rows_cuda
    dst_sorted = torch.empty(ne_get_rows, ne0, dtype=DTYPE, device=dst.data.device)
    w = ggml_get_to_fp(src0)                       # TQ: dequant-to-f16, then cuBLAS per expert
    cur = 0
    for i02 in range(ne02):
        n = tokens_per_expert[i02]
        if n == 0:
            continue
        dst_sorted[cur:cur + n] = ggml_cuda_mul_mat(w[i02], src1_sorted[cur:cur + n])
        cur += n
    dst.data.view(-1, ne0).copy_(dst_sorted[ids_from_sorted])                    # get_rows_cuda back


def ggml_cuda_compute_forward(ctx, node: ggml_tensor):
    s = [x.data for x in node.src]
    if node.op == "GET_ROWS" and s[1].dim() == 1:
        node.data.copy_(s[0][s[1]])
    elif node.op == "GET_ROWS":                            # the probs [n_tokens, n_expert, 1] at the selected ids
        node.data.copy_(s[0].gather(1, s[1].unsqueeze(-1)))
    elif node.op == "RMS_NORM":
        node.data.copy_(s[0] * torch.rsqrt(s[0].pow(2).mean(-1, keepdim=True) + 1e-6))
    elif node.op == "MUL":
        node.data.copy_(s[0] * s[1])
    elif node.op == "ADD":
        node.data.copy_(s[0] + s[1])
    elif node.op == "MUL_MAT":
        node.data.copy_(ggml_cuda_mul_mat(s[0], s[1]))
    elif node.op == "SOFT_MAX":
        node.data.copy_(s[0].softmax(-1))
    elif node.op == "TOP_K":
        node.data.copy_(s[0].topk(N_EXPERT_USED, dim=-1).indices)
    elif node.op == "SWIGLU":
        node.data.copy_(F.silu(s[0]) * s[1])
    elif node.op == "MUL_MAT_ID":
        ggml_cuda_mul_mat_id(ctx, node)
    # VIEW / RESHAPE: data is a view of the source, set when the graph is built


# --- graph build (stand-in for llm_build_* / build_moe_ffn) ----------------------------------------------------------

class llama_model:
    def __init__(self, device):
        gen = generator(4201)
        r = lambda *s, scale=0.4: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.tok_embd = ggml_tensor("NONE", "token_embd.weight", data=r(N_VOCAB, N_EMBD, scale=1.0))
        self.layers = []
        for il in range(N_LAYER):
            tq = lambda name, *s: ggml_tensor("NONE", f"blk.{il}.{name}", type=GGML_TYPE_TQ4_1S,  # noqa: E731
                                              data=quantize_tq4_1s(r(*s, scale=0.25)))
            self.layers.append(dict(
                attn_norm=ggml_tensor("NONE", f"blk.{il}.attn_norm", data=1.0 + r(N_EMBD, scale=0.1)),
                gate_inp=ggml_tensor("NONE", f"blk.{il}.ffn_gate_inp", data=r(N_EXPERT, N_EMBD, scale=1.0)),
                gate_exps=tq("ffn_gate_exps", N_EXPERT, N_FF, N_EMBD),
                up_exps=tq("ffn_up_exps", N_EXPERT, N_FF, N_EMBD),
                down_exps=tq("ffn_down_exps", N_EXPERT, N_EMBD, N_FF)))
        self.output_norm = ggml_tensor("NONE", "output_norm", data=1.0 + r(N_EMBD, scale=0.1))
        self.output = ggml_tensor("NONE", "output.weight", data=r(N_VOCAB, N_EMBD, scale=0.5))


def build_graph(model: llama_model, n_tokens: int, device):
    """The cgraph of one decode batch; ggml-alloc gives every node its buffer once, so a reused graph keeps them."""
    nodes = []

    def node(op, name, src, shape, dtype=DTYPE, data=None):
        t = ggml_tensor(op, name, src, data=torch.zeros(*shape, dtype=dtype, device=device) if data is None else data)
        nodes.append(t)
        return t

    inp_tokens = ggml_tensor("NONE", "inp_tokens", data=torch.zeros(n_tokens, dtype=torch.int64, device=device))
    cur = node("GET_ROWS", "inp_embd", [model.tok_embd, inp_tokens], (n_tokens, N_EMBD))
    for il, L in enumerate(model.layers):
        norm = node("RMS_NORM", f"norm-{il}", [cur], (n_tokens, N_EMBD))
        x = node("MUL", f"attn_norm-{il}", [norm, L["attn_norm"]], (n_tokens, N_EMBD))
        logits = node("MUL_MAT", f"ffn_moe_logits-{il}", [L["gate_inp"], x], (n_tokens, N_EXPERT))
        probs = node("SOFT_MAX", f"ffn_moe_probs-{il}", [logits], (n_tokens, N_EXPERT))
        selected = node("TOP_K", f"ffn_moe_topk-{il}", [probs], (n_tokens, N_EXPERT_USED), dtype=torch.int64)
        probs3 = node("RESHAPE", f"ffn_moe_probs-{il} (reshaped)", [probs], (), data=probs.data.unsqueeze(-1))
        weights = node("GET_ROWS", f"ffn_moe_weights-{il}", [probs3, selected], (n_tokens, N_EXPERT_USED, 1))
        x3 = node("RESHAPE", f"ffn_inp-{il} (reshaped)", [x], (), data=x.data.view(n_tokens, 1, N_EMBD))
        gate = node("MUL_MAT_ID", f"ffn_moe_gate-{il}", [L["gate_exps"], x3, selected], (n_tokens, N_EXPERT_USED, N_FF))
        up = node("MUL_MAT_ID", f"ffn_moe_up-{il}", [L["up_exps"], x3, selected], (n_tokens, N_EXPERT_USED, N_FF))
        par = node("SWIGLU", f"ffn_moe_swiglu-{il}", [gate, up], (n_tokens, N_EXPERT_USED, N_FF))
        down = node("MUL_MAT_ID", f"ffn_moe_down-{il}", [L["down_exps"], par, selected],
                    (n_tokens, N_EXPERT_USED, N_EMBD))
        experts = node("MUL", f"ffn_moe_weighted-{il}", [down, weights], (n_tokens, N_EXPERT_USED, N_EMBD))
        moe_out = node("VIEW", f"ffn_moe_view_0-{il}", [experts], (), data=experts.data[:, 0])
        for i in range(1, N_EXPERT_USED):
            view = node("VIEW", f"ffn_moe_view_{i}-{il}", [experts], (), data=experts.data[:, i])
            moe_out = node("ADD", f"ffn_moe_out-{il}-{i}", [moe_out, view], (n_tokens, N_EMBD))
        cur = node("ADD", f"l_out-{il}", [cur, moe_out], (n_tokens, N_EMBD))
    norm = node("RMS_NORM", "norm", [cur], (n_tokens, N_EMBD))
    x = node("MUL", "result_norm", [norm, model.output_norm], (n_tokens, N_EMBD))
    result = node("MUL_MAT", "result_output", [model.output, x], (n_tokens, N_VOCAB))
    return dict(nodes=nodes, inp_tokens=inp_tokens, result_output=result)


# --- ggml/src/ggml-cuda/ggml-cuda.cu: CUDA graphs ---------------------------------------------------------------------

class ggml_cuda_graph:
    def __init__(self):
        self.instance = self.outputs = None        # cudaGraphExec_t and the nodes it writes
        self.node_props = None
        self.warmup_complete = False
        self.disable_due_to_gpu_arch = False

    def is_enabled(self, ctx) -> bool:
        return not ctx.disable_cuda_graphs and not self.disable_due_to_gpu_arch


class ggml_backend_cuda_context:
    def __init__(self, device, disable_cuda_graphs: bool):
        self.device, self.cc = device, GGML_CUDA_CC_TURING
        self.disable_cuda_graphs = disable_cuda_graphs        # GGML_CUDA_DISABLE_GRAPHS
        self.cuda_graphs: dict[int, ggml_cuda_graph] = {}

    def cuda_graph(self, key) -> ggml_cuda_graph:
        return self.cuda_graphs.setdefault(key, ggml_cuda_graph())


def ggml_cuda_graph_get_key(cgraph):
    return id(cgraph["nodes"][0])


def ggml_cuda_graph_check_compability(cgraph) -> bool:
    use_cuda_graph = True
    for node in cgraph["nodes"]:
        if node.op in ("RESHAPE", "TRANSPOSE", "VIEW", "PERMUTE", "NONE"):
            continue
        # [TAG_MUL_MAT_ID_CUDA_GRAPHS]
        if node.op == "MUL_MAT_ID":
            mmvq_mmid_max = get_mmvq_mmid_max_batch(node.src[0].type, GGML_CUDA_CC_TURING)
            if _variant == "bug":
                needs_sync = not ggml_is_quantized(node.src[0].type) or node.ne[2] > mmvq_mmid_max
            else:
                is_tq_w = node.src[0].type in (GGML_TYPE_TQ4_1S, GGML_TYPE_TQ3_1S)
                needs_sync = not ggml_is_quantized(node.src[0].type) or is_tq_w or node.ne[2] > mmvq_mmid_max
            if needs_sync:
                # under these conditions, the mul_mat_id operation will need to synchronize the stream,
                # so we cannot use CUDA graphs
                use_cuda_graph = False
        if not use_cuda_graph:
            break
    return use_cuda_graph


def ggml_cuda_graph_update_required(ctx, cgraph) -> bool:
    graph = ctx.cuda_graph(ggml_cuda_graph_get_key(cgraph))
    props = [(n.name, n.op, n.ne) for n in cgraph["nodes"]]
    res = props != graph.node_props
    graph.node_props = props
    return res


def ggml_cuda_graph_evaluate_and_capture(ctx, cgraph, use_cuda_graph, cuda_graph_update_required, graph_key):
    graph = ctx.cuda_graph(graph_key)

    def evaluate():
        for node in cgraph["nodes"]:
            ggml_cuda_compute_forward(ctx, node)
        return cgraph["result_output"].data

    if not use_cuda_graph:
        evaluate()
        return
    if cuda_graph_update_required:                # cudaStreamBeginCapture(..., Relaxed) .. cudaStreamEndCapture
        graph.instance, graph.outputs = capture(
            evaluate, device=ctx.device, warmups=0, static={"inp_tokens": cgraph["inp_tokens"].data},
            owner="ggml_backend_cuda_context", capture_error_mode="relaxed",
            name=f"ggml cuda graph ({cgraph['inp_tokens'].data.numel()} tokens)")
    replay(graph.instance, graph.outputs)         # cudaGraphLaunch


def ggml_backend_cuda_graph_compute(ctx, cgraph):
    use_cuda_graph = cuda_graph_update_required = False
    graph_key = ggml_cuda_graph_get_key(cgraph)
    graph = ctx.cuda_graph(graph_key)
    if graph.is_enabled(ctx):
        if ggml_cuda_graph_check_compability(cgraph):
            properties_changed = ggml_cuda_graph_update_required(ctx, cgraph)
            if not graph.warmup_complete:
                # Warmup: need at least 2 calls with no property change on the 2nd call
                if not properties_changed:
                    graph.warmup_complete = True
                    use_cuda_graph = cuda_graph_update_required = True
            elif properties_changed:
                graph.warmup_complete = False
            else:
                use_cuda_graph = True
                cuda_graph_update_required = graph.instance is None
    ggml_cuda_graph_evaluate_and_capture(ctx, cgraph, use_cuda_graph, cuda_graph_update_required, graph_key)


# --- the decode loop (stand-in for llama_decode + a greedy sampler) --------------------------------------------------

def _decode(device: str, disable_cuda_graphs: bool):
    model = llama_model(device)
    ctx = ggml_backend_cuda_context(device, disable_cuda_graphs)
    cgraph = build_graph(model, N_SEQ, device)        # graph reuse: same nodes, same buffers each step
    tokens = [3, 11, 17]
    logits_per_step = []
    for _ in range(N_STEPS):
        cgraph["inp_tokens"].data.copy_(torch.tensor(tokens, device=device))    # ggml_backend_tensor_set
        ggml_backend_cuda_graph_compute(ctx, cgraph)
        logits = cgraph["result_output"].data.clone()                             # ggml_backend_tensor_get
        logits_per_step.append(logits)
        tokens = logits.argmax(-1).tolist()
    return logits_per_step


def run(variant: str, device: str):
    global _variant
    _variant = variant
    name = __name__.rsplit(".", 1)[-1]
    return compare(name, variant, device,
                   served=lambda: _decode(device, disable_cuda_graphs=False),
                   eager=lambda: _decode(device, disable_cuda_graphs=True))
