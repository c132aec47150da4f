"""exllamav3 bsz-1 MoE graph without shared experts: run_bsz1's launch list puts the down mgemm's C after its indices/weights, so Graph::launch walks past the recorded sites and fails every decode step.

Upstream: https://github.com/turboderp-org/exllamav3/commit/8fc143534c5a1b79a7fa5fe9173e13e041ef6088
("BlockSparseMLP: Fix graph update when no shared experts", turboderp-org/exllamav3, a direct commit on ``dev``,
2025-10-28, in ``master`` since v0.0.12; no PR or issue). Read: the diff (``libtorch/blocksparse_mlp.cpp``), and at
8fc1435^ ``BC_BlockSparseMLP::run_bsz1`` / ``run_bsz1_gr`` and ``blocksparse_mlp.h``, ``Graph::capture_end`` /
``Graph::launch`` / ``record_param`` (``graph.cu``, ``graph.cuh``: ``enum GraphedParams``), the sites that
``exl3_mgemm_gr`` records (``quant/exl3_gemm.cu``: A at 0, C at 2, indices at 10, weights at 11, then ``GP_end``)
and ``silu_mul_gr`` (``activation.cu``: x, y, z, ``GP_end``), and ``BlockSparseMLP.forward`` / ``routing_std``
(``modules/block_sparse_mlp.py``). The bsz-1 graph came with the graph framework, merged into ``dev`` four days
earlier (7380022, "Merge branch 'refs/heads/dev_graph' into dev").
Symptom: none reported (found on ``dev``). An EXL3-quantized MoE model whose block-sparse MLP has no shared
experts (Qwen3-MoE or Mixtral style layers) dies at its first single-token forward with
``RuntimeError: Graph update failed`` from ``Graph::launch``; layers with shared experts take the other branch of
the list, which lines up. Built without ``USE_GRAPH`` the same layer runs eagerly and is correct.
Mechanism: ``run_bsz1`` captures ``run_bsz1_gr`` into ``graph_bsz1`` on its first call. Each captured kernel records
its patchable parameters with ``record_param(kernel, param_id, offset)`` and closes them with ``GP_end``;
``capture_end`` turns these into ``graph_node_sites`` in capture order: gate mgemm (A, C, indices, weights, end),
up mgemm (same), silu_mul (x, y, z, end), down mgemm (A, C, indices, weights, end). Every call then passes
``Graph::launch`` a list of ``(param_id, pointer)`` pairs, and ``launch`` walks the sites and the list together:
a site whose id equals the list's next id takes that pointer, any other site is skipped, and if the sites run out
before the list does it fails with ``TORCH_CHECK(false, "Graph update failed")``. The list was built as
``A, indices, end, A, indices, end, indices, weights`` for gate/up/down, then, only in the no-shared-experts
branch, ``GP_mgemm_C = out_d``. The down node's sites come as A, C, indices, weights, end: ``indices`` and
``weights`` match, the site after them is ``GP_end`` and the list still holds ``C``, so the walk runs off the end
(with shared experts the list continues with ``GP_end`` and the shared-expert nodes, and lines up).
Doctor: warmup-divergence, at run_bsz1. The capture recorded a plan of the graph's patchable parameters (the
node/site order) that every replay's update must follow, and the list ``run_bsz1`` builds for the replays does
not follow it; the eager layer has no such plan.
Fix (upstream): push ``indices`` and ``weights`` of the down mgemm in each branch after what precedes them in
capture order: ``..., end, C(out_d), indices, weights`` without shared experts, ``..., end, indices, weights,
end, ...`` with them.
Modelled: ``Graph`` (``record_param``, ``capture_end``'s site matching, ``launch``'s walk and its errors, as in
graph.cu), ``BC_BlockSparseMLP`` (``run_bsz1_gr``, ``run_bsz1`` with both branch lists, shared experts absent),
``exl3_mgemm_gr`` / ``silu_mul_gr`` stand-ins recording upstream's sites, ``BlockSparseMLP.forward`` with
``routing_std``'s bsz-1 path (static ``RoutingCFG`` buffers) and ``ExpertsCFG`` buffers, and a two-layer stand-in
decoder. Stand-ins: EXL3 trellis experts are dense float64 matrices (the mgemm is a per-expert product; the down
mgemm sums the experts weighted into ``out_d[0]``); the kernels are torch code. Emulation of pointer patching
(torch graphs cannot re-point a captured kernel): a node reads the hidden state ``y`` (the only parameter that
points at a different tensor every call) through a graph-owned slot, and at each launch the slot receives what
that node's patched ``A`` points to; every other parameter points at the layer's persistent buffers and is read
in place, so patching it with the same pointer is the no-op ``launch`` makes it (``*p_old_value != new_value``).
Workload: a two-layer MoE decoder (hidden 8, 6 experts, top-2, no shared experts) decodes 5 tokens with bsz 1.
The bug raises ``RuntimeError: Graph update failed`` at the first token (the capture call's launch); the fix's
graphed logits equal eager on every token.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/turboderp-org/exllamav3/commit/8fc143534c5a1b79a7fa5fe9173e13e041ef6088"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "run_bsz1"
SYMPTOM = ("MoE models without shared experts: the bsz-1 graph's launch list gives the down mgemm's C after its "
           "indices and weights, the walk over the captured parameter sites runs out and every single-token "
           "forward raises 'Graph update failed'")

HIDDEN, INTERM, NUM_EXPERTS, TOPK, VOCAB, LAYERS = 8, 6, 6, 2, 16, 2

# graph.cuh: enum GraphedParams (the entries this layer uses)
(GP_end, GP_gemm_A, GP_gemm_C, GP_mgemm, GP_mgemm_A, GP_mgemm_C, GP_mgemm_indices, GP_mgemm_weights,
 GP_silu_mul_x, GP_silu_mul_y, GP_silu_mul_z) = range(11)
GP_add_x, GP_add_z = 27, 29

_variant = "bug"


# ----------------------------------------------------------------------------- graph.cu
class Graph:
    """``Graph``: capture once; ``capture_end`` pairs the recorded sites with the graph's kernel nodes, and
    ``launch`` rewrites the listed parameters of those nodes before launching."""

    def __init__(self, device):
        self.device = device
        self.ready = False
        self.graph_sites = []              # (kernel, param_id, param_offset), as record_param gets them
        self.graph_node_sites = []         # (node_idx, param_id, param_offset)
        self.nodes = []                    # kernel of each captured node, in capture order
        self.node_params = []              # per node: {offset: tensor the parameter points at}
        self.node_needs_update = []
        self.slots = {}                    # emulation: data_ptr of y -> graph-owned slot read by the nodes
        self.slot_params = {}              # emulation: (node_idx, offset) read through a slot
        self.captured_ptrs = []
        self.g = self.outputs = None

    # -- capture -------------------------------------------------------------------------------------------------
    def kernel_node(self, kernel, params):
        """A kernel launched while capturing becomes a node; returns the tensors the node reads."""
        n = len(self.nodes)
        self.nodes.append(kernel)
        self.node_params.append(dict(params))
        self.captured_ptrs.append({off: t.data_ptr() for off, t in params.items() if t is not None})
        reads = {}
        for off, t in params.items():
            if t is not None and t.data_ptr() in self.slots:
                self.slot_params[(n, off)] = self.slots[t.data_ptr()]
            reads[off] = self.slot_params.get((n, off), t)
        return reads

    def record_param(self, kernel, param_id, param_offset):
        self.graph_sites.append((kernel, param_id, param_offset))

    def capture(self, fn, y, static):
        self.slots = {y.data_ptr(): y.unsqueeze(0).clone()}          # made before capture_begin
        self.g, self.outputs = capture(fn, device=self.device, warmups=0, name="BC_BlockSparseMLP graph_bsz1",
                                       owner="BC_BlockSparseMLP", static={"A slot (y)": self.slots[y.data_ptr()],
                                                                          **static})
        self.capture_end()

    def capture_end(self):
        num_nodes = len(self.nodes)
        self.node_needs_update = [False] * num_nodes
        n = c = 0
        while True:
            while c < len(self.graph_sites):                           # node type: kernel
                func, param_id, param_offset = self.graph_sites[c]
                if func != self.nodes[n]:
                    break
                self.graph_node_sites.append((n, param_id, param_offset))
                c += 1
                if param_id == GP_end:
                    break
            n += 1
            if c == len(self.graph_sites):
                break
            if n == num_nodes:
                raise RuntimeError("Graph recording failed")
        self.ready = True

    # -- launch --------------------------------------------------------------------------------------------------
    def launch(self, params):
        p = n = 0
        while True:
            node_idx, site_id, param_offset = self.graph_node_sites[n]
            if site_id == params[p][0]:
                if params[p][0] != GP_end:
                    new_value = params[p][1]
                    old_value = self.node_params[node_idx][param_offset]
                    if old_value.data_ptr() != new_value.data_ptr():
                        self.node_params[node_idx][param_offset] = new_value
                        self.node_needs_update[node_idx] = True
                p += 1
            n += 1
            if p == len(params):
                break
            if n == len(self.graph_node_sites):
                raise RuntimeError("Graph update failed")
        for node_idx, needs in enumerate(self.node_needs_update):     # cudaGraphExecKernelNodeSetParams
            if needs:
                for off, t in self.node_params[node_idx].items():
                    if t is not None and (node_idx, off) not in self.slot_params and \
                            t.data_ptr() != self.captured_ptrs[node_idx][off]:
                        raise NotImplementedError("the emulation re-points only the hidden-state parameter")
                self.node_needs_update[node_idx] = False
        for (node_idx, off), slot in self.slot_params.items():          # the node reads what A points at
            slot.copy_(self.node_params[node_idx][off].reshape(slot.shape))
        return replay(self.g, self.outputs)


# ----------------------------------------------------------------------------- kernels (exllamav3_ext)
def exl3_mgemm_gr(A, B, C, indices, weights, graph):
    """Multi-expert GEMM: expert ``indices[0, j]`` multiplies row ``min(j, bszm_in - 1)`` of ``A`` into ``C[j]``;
    with ``weights``, the experts' results are summed weighted into ``C[0]`` (the down projection)."""
    if graph is not None:
        r = graph.kernel_node("exl3_mgemm_kernel", {0: A, 2: C, 10: indices, 11: weights})
        A, C, indices, weights = r[0], r[2], r[10], r[11]
    w = B[indices[0]]                                                  # [k, K, N]
    rows = A[:, 0].expand(w.shape[0], -1) if A.shape[0] == 1 else A[:, 0]
    out = torch.einsum("jk,jkn->jn", rows, w)
    if weights is None:
        C[:, 0].copy_(out)
    else:
        C[0, 0].copy_((out * weights[0][:, None]).sum(0))
    if graph is not None:
        graph.record_param("exl3_mgemm_kernel", GP_mgemm_A, 0)
        graph.record_param("exl3_mgemm_kernel", GP_mgemm_C, 2)
        graph.record_param("exl3_mgemm_kernel", GP_mgemm_indices, 10)
        graph.record_param("exl3_mgemm_kernel", GP_mgemm_weights, 11)
        graph.record_param("exl3_mgemm_kernel", GP_end, 0)


def silu_mul_gr(x, y, z, graph):
    if graph is not None:
        r = graph.kernel_node("act_mul_kernel_f<ACT_SILU>", {0: x, 1: y, 2: z})
        x, y, z = r[0], r[1], r[2]
    z.copy_(torch.nn.functional.silu(x) * y)
    if graph is not None:
        graph.record_param("act_mul_kernel_f<ACT_SILU>", GP_silu_mul_x, 0)
        graph.record_param("act_mul_kernel_f<ACT_SILU>", GP_silu_mul_y, 1)
        graph.record_param("act_mul_kernel_f<ACT_SILU>", GP_silu_mul_z, 2)
        graph.record_param("act_mul_kernel_f<ACT_SILU>", GP_end, 0)


# ----------------------------------------------------------------------------- libtorch/blocksparse_mlp.cpp
class BC_BlockSparseMLP:
    def __init__(self, cfg, mlp, graphed, shared_experts=None):
        self.interm_g, self.interm_u, self.interm_a, self.out_d = cfg.interm_g, cfg.interm_u, cfg.interm_a, cfg.out_d
        self.mlp, self.graphed = mlp, graphed
        self.shared_experts = shared_experts          # None: the layers modelled here have no shared experts
        self.shared_gate = None
        self.graph_bsz1 = Graph(mlp.device)

    def run_bsz1_gr(self, y, selected_experts, routing_weights, graph):
        yi = y.unsqueeze(0)
        m = self.mlp
        exl3_mgemm_gr(yi, m.gate_w, self.interm_g, selected_experts, None, graph)
        exl3_mgemm_gr(yi, m.up_w, self.interm_u, selected_experts, None, graph)
        silu_mul_gr(self.interm_g, self.interm_u, self.interm_a, graph)
        exl3_mgemm_gr(self.interm_a, m.down_w, self.out_d, selected_experts, routing_weights, graph)

    def run_bsz1(self, y, selected_experts, routing_weights):
        if not self.graphed:                                          # built without USE_GRAPH
            self.run_bsz1_gr(y, selected_experts, routing_weights, None)
            return self.out_d
        g = self.graph_bsz1
        if not g.ready:
            def graphed_step():
                self.run_bsz1_gr(y, selected_experts, routing_weights, g)
                return self.out_d

            g.capture(graphed_step, y, {"selected_experts_bsz1": selected_experts,
                                        "routing_weights_bsz1": routing_weights})
        if _variant == "bug":
            args = [(GP_mgemm_A, y), (GP_mgemm_indices, selected_experts), (GP_end, None),
                    (GP_mgemm_A, y), (GP_mgemm_indices, selected_experts), (GP_end, None),
                    (GP_mgemm_indices, selected_experts), (GP_mgemm_weights, routing_weights)]
            if self.shared_experts is not None:
                args += [(GP_end, None), (GP_mgemm_A, y), (GP_add_x, self.out_d), (GP_add_z, self.out_d)]
            else:
                args += [(GP_mgemm_C, self.out_d)]
        else:
            args = [(GP_mgemm_A, y), (GP_mgemm_indices, selected_experts), (GP_end, None),
                    (GP_mgemm_A, y), (GP_mgemm_indices, selected_experts), (GP_end, None)]
            if self.shared_experts is not None:
                args += [(GP_mgemm_indices, selected_experts), (GP_mgemm_weights, routing_weights), (GP_end, None),
                         (GP_mgemm_A, y), (GP_add_x, self.out_d), (GP_add_z, self.out_d)]
            else:
                args += [(GP_mgemm_C, self.out_d), (GP_mgemm_indices, selected_experts),
                         (GP_mgemm_weights, routing_weights)]
        return g.launch(args)


# ----------------------------------------------------------------------------- modules/block_sparse_mlp.py
class RoutingCFG:
    def __init__(self, gate_tensor, device):
        self.gate_tensor = gate_tensor
        self.num_experts_per_tok = TOPK
        self.router_logits_bsz1 = torch.zeros(1, NUM_EXPERTS, dtype=torch.float64, device=device)
        self.routing_weights_bsz1 = torch.zeros(1, TOPK, dtype=torch.float64, device=device)
        self.selected_experts_bsz1 = torch.zeros(1, TOPK, dtype=torch.long, device=device)


class ExpertsCFG:
    def __init__(self, device):
        self.interm_g = torch.zeros(TOPK, 1, INTERM, dtype=torch.float64, device=device)
        self.interm_u = torch.zeros_like(self.interm_g)
        self.interm_a = torch.zeros_like(self.interm_g)
        self.out_d = torch.zeros(TOPK, 1, HIDDEN, dtype=torch.float64, device=device)


def routing_std(bsz, cfg, y, params):
    assert bsz == 1
    torch.matmul(y, cfg.gate_tensor, out=cfg.router_logits_bsz1)
    weights, experts = torch.topk(cfg.router_logits_bsz1, cfg.num_experts_per_tok, -1)   # ext.routing_std
    cfg.selected_experts_bsz1.copy_(experts)
    cfg.routing_weights_bsz1.copy_(torch.softmax(weights, -1))
    return cfg.selected_experts_bsz1, cfg.routing_weights_bsz1


class BlockSparseMLP:
    def __init__(self, gen, device, graphed):
        self.device = device
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).double()  # noqa: E731
        self.gate_w, self.up_w = r(NUM_EXPERTS, HIDDEN, INTERM), r(NUM_EXPERTS, HIDDEN, INTERM)
        self.down_w = r(NUM_EXPERTS, INTERM, HIDDEN)
        self.routing_cfg = RoutingCFG(r(HIDDEN, NUM_EXPERTS, scale=1.5), device)
        self.experts_cfg = ExpertsCFG(device)
        self.bc = BC_BlockSparseMLP(self.experts_cfg, self, graphed)

    def forward(self, x, params):
        y = x.view(-1, HIDDEN)
        bsz = y.shape[0]
        selected_experts, routing_weights = routing_std(bsz, self.routing_cfg, y, params)
        self.bc.run_bsz1(y, selected_experts, routing_weights)
        return self.experts_cfg.out_d[:1, ...].view(x.shape)


class Model:
    """Stand-in decoder: embedding, residual block-sparse MLP layers, output head."""

    def __init__(self, device, graphed):
        gen = generator(81435)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device).double()
        self.layers = [BlockSparseMLP(gen, device, graphed) for _ in range(LAYERS)]
        self.head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.7).double()

    def forward(self, token):
        x = self.embed[token:token + 1].clone()
        for layer in self.layers:
            x = x + layer.forward(x, {})
        return x @ self.head


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant

    def serve(graphed):
        model = Model(device, graphed)
        token, outs = 5, []
        for _ in range(5):                                             # bsz-1 decode
            logits = model.forward(token)
            outs.append(logits.clone())
            token = int(logits.argmax())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
