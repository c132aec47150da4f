"""A non-router TP rank's bsz-1 MoE graph keeps reading the capture call's (freed) broadcast routing tensors.

Upstream: https://github.com/turboderp-org/exllamav3/commit/b80d461993c0bf9c658fc31536e37a48a09e439f
("BlockSparseMLP/TP: Allocate stable broadcast buffers for bsz1 graph", a direct commit to ``master``; no PR).
Symptom: none reported beyond the fix's comment ("the BC bsz-1 graph bakes the routing tensors' addresses
into unpatched nodes"): under tensor parallelism (gpt-oss, whose experts have biases, got TP plumbing in
f1a467b), single-token decode on a rank without the router adds the expert biases of the wrong experts,
with the wrong routing weights, so the MoE output drifts from eager's.
Mechanism: on a TP rank with ``self.routing_gate is None``, ``BlockSparseMLP.forward`` allocates the
routing receive targets on every call (``torch.empty((bsz, k), dtype=long)`` / ``dtype=half``) and fills
them with ``backend.broadcast(..., src_device=self.routing_device)``. With ``bsz == 1`` it calls
``self.bc.run_bsz1(y, selected_experts, routing_weights)``: the first call runs ``run_bsz1_gr`` eagerly,
the second captures it into ``graph_bsz1`` and every call then ``Graph::launch(args)``es it. ``launch``
rewrites only the kernel parameters in ``args`` (``GP_mgemm_A`` / ``GP_mgemm_indices`` /
``GP_mgemm_weights`` of the three mgemm nodes); every other node keeps the pointer it was captured with.
Before 47c2d47 the ``moe_bias_add_gr`` / ``moe_bias_add_weighted_gr`` nodes recorded no patch sites, so
they read the capture call's ``selected_experts`` / ``routing_weights`` at every replay. Those tensors were
per-call allocations: released when the capture call returned, their block goes to a later allocation,
while each later call's routing lands in fresh storage that only the patched mgemm nodes see.
Doctor: dangling-reference, at ``forward`` (``BlockSparseMLP.forward`` hands the captured bias-add nodes
per-call routing tensors that are released after the capture call).
Fix (upstream): on the ``bsz == 1`` no-router path, ``forward`` broadcasts into persistent
``self.bcast_sel_bsz1`` / ``self.bcast_weights_bsz1`` (allocated once, dropped in ``unload()``), so every
call uses the addresses the graph baked; ``bsz > 1`` (no graph) keeps the per-call ``torch.empty``. The
diff was read, with ``Graph::capture_end`` / ``Graph::launch`` (graph.cu) and ``BC_BlockSparseMLP::run_bsz1``.
Note: three minutes earlier 47c2d47 ("Add graph patching for run_bsz1") added patch sites for the bias-add
nodes; either commit alone removes the stale read. This program models the code before both and applies
only b80d461 as the fix (the bias-add nodes stay unpatched in both variants).
Simplifications: one process stands in for the TP group: the router rank's ``routing_fn`` writes its static
bsz-1 buffers and ``broadcast`` copies them into the receiving rank's targets; one MoE layer, tiny sizes,
no shared experts, no padded hidden size; ``Graph::launch``'s pointer patching is emulated by copying the
patched arguments into the parameter slots that the recorded mgemm nodes read (the same values the patched
nodes would read); the mgemm is a dense per-expert product. On the CPU a released block keeps the capture
call's bytes (``on_freed="reuse"``); on CUDA the caching allocator decides what is there.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/turboderp-org/exllamav3/commit/b80d461993c0bf9c658fc31536e37a48a09e439f"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "forward"
SYMPTOM = "bsz-1 decode on a non-router TP rank adds the capture step's expert biases with its routing weights"

HIDDEN, INTERM, NUM_EXPERTS, TOPK, VOCAB = 8, 6, 6, 2, 16
GP_mgemm_A, GP_mgemm_indices, GP_mgemm_weights = "GP_mgemm_A", "GP_mgemm_indices", "GP_mgemm_weights"


# ----------------------------------------------------------------------------- kernels (exllamav3_ext)
def exl3_mgemm_gr(a, weights, c, indices, routing_weights=None):
    """Multi-expert GEMM: row ``j`` = (row ``j`` of ``a``, or its only row) ``@ weights[indices[0, j]]``; with
    routing weights, row 0 of ``c`` gets the weighted sum over the selected experts (the down projection)."""
    w = weights[indices[0]]                                           # [k, K, N]
    out = (a.expand(w.shape[0], -1)[:, :, None] * w).sum(1)           # [k, N]
    if routing_weights is None:
        c.copy_(out)
    else:
        c[0].copy_((out * routing_weights[0].float()[:, None]).sum(0))


def moe_bias_add_gr(interm, bias, selected_experts):
    interm.add_(bias[selected_experts[0]])


def moe_bias_add_weighted_gr(out_d, bias, selected_experts, routing_weights):
    out_d[0].add_((bias[selected_experts[0]] * routing_weights[0].float()[:, None]).sum(0))


def silu_mul_gr(g, u, a):
    a.copy_(torch.nn.functional.silu(g) * u)


# ----------------------------------------------------------------------------- graph.cu
class Graph:
    """``Graph``: records once, and at ``launch`` rewrites only the kernel parameters it is given."""

    def __init__(self, device, disabled):
        self.device, self.disabled = device, disabled
        self.ready = self.ready_to_record = False
        self.slots: dict[str, torch.Tensor] = {}
        self.g = self.outputs = None

    def param(self, param_id, value):
        """The value a recorded node reads for a patchable parameter (``record_param``)."""
        return self.slots[param_id]

    def capture(self, fn, params, extra_static):
        # Parameter slots exist before the capture: ``launch`` rewrites them, the recorded nodes read them
        self.slots = {pid: v.clone() for pid, v in params.items()}
        self.g, self.outputs = capture(fn, device=self.device, warmups=0, on_freed="reuse",
                                       name="BC_BlockSparseMLP graph_bsz1", owner="BC_BlockSparseMLP (graph_bsz1)",
                                       static={**self.slots, **extra_static})
        self.ready = True

    def launch(self, params):
        for pid, value in params.items():                  # Graph::launch: patch the listed params only
            self.slots[pid].copy_(value)
        return replay(self.g, self.outputs)


# ----------------------------------------------------------------------------- blocksparse_mlp.cpp
class BC_BlockSparseMLP:
    def __init__(self, mlp, graphed):
        self.mlp = mlp
        d = mlp.device
        self.interm_g = torch.zeros(TOPK, INTERM, device=d)
        self.interm_u = torch.zeros(TOPK, INTERM, device=d)
        self.interm_a = torch.zeros(TOPK, INTERM, device=d)
        self.out_d = torch.zeros(1, HIDDEN, device=d)
        self.graph_bsz1 = Graph(d, disabled=not graphed)

    def run_bsz1_gr(self, y, selected_experts, routing_weights, graph):
        m = self.mlp
        # Only the mgemm nodes have patch sites; the bias adds keep the pointers they are given here
        if graph is not None:
            yi = graph.param(GP_mgemm_A, y)
            sel_p = graph.param(GP_mgemm_indices, selected_experts)
            w_p = graph.param(GP_mgemm_weights, routing_weights)
        else:
            yi, sel_p, w_p = y, selected_experts, routing_weights
        exl3_mgemm_gr(yi, m.gate_w, self.interm_g, sel_p)
        moe_bias_add_gr(self.interm_g, m.gate_bias, selected_experts)
        exl3_mgemm_gr(yi, m.up_w, self.interm_u, sel_p)
        moe_bias_add_gr(self.interm_u, m.up_bias, selected_experts)
        silu_mul_gr(self.interm_g, self.interm_u, self.interm_a)
        exl3_mgemm_gr(self.interm_a, m.down_w, self.out_d, sel_p, w_p)
        moe_bias_add_weighted_gr(self.out_d, m.down_bias, selected_experts, routing_weights)
        return self.out_d

    def run_bsz1(self, y, selected_experts, routing_weights, extra_static):
        g = self.graph_bsz1
        if g.disabled or (not g.ready and not g.ready_to_record):
            out = self.run_bsz1_gr(y, selected_experts, routing_weights, None)
            g.ready_to_record = True
            return out
        args = {GP_mgemm_A: y, GP_mgemm_indices: selected_experts, GP_mgemm_weights: routing_weights}
        self.call = (y, selected_experts, routing_weights)       # this call's tensors (the C++ frame's arguments)
        try:
            if not g.ready:
                g.capture(lambda: self.run_bsz1_gr(*self.call, g), args, extra_static)
            return g.launch(args)
        finally:
            self.call = None                                     # released with the call


# ----------------------------------------------------------------------------- block_sparse_mlp.py
class Backend:
    """The TP backend: ``broadcast`` fills the receiving rank's tensor with the source rank's."""

    def __init__(self):
        self.rank_tensors = {}

    def broadcast(self, tensor, src_device):
        tensor.copy_(self.rank_tensors[src_device].pop(0))


class RouterRank:
    """Rank 0's ``BlockSparseMLP`` routing (``blocksparse_mlp_routing``, bsz 1: static cfg buffers)."""

    def __init__(self, gate_tensor, device):
        self.gate_tensor = gate_tensor
        self.router_logits_bsz1 = torch.zeros(1, NUM_EXPERTS, device=device)
        self.routing_weights_bsz1 = torch.zeros(1, TOPK, device=device)
        self.selected_experts_bsz1 = torch.zeros(1, TOPK, dtype=torch.long, device=device)

    def routing_fn(self, y, backend):
        torch.matmul(y, self.gate_tensor, out=self.router_logits_bsz1)
        torch.topk(self.router_logits_bsz1, TOPK, -1, out=(self.routing_weights_bsz1, self.selected_experts_bsz1))
        self.routing_weights_bsz1.copy_(torch.softmax(self.routing_weights_bsz1, -1))
        backend.rank_tensors[0] = [self.selected_experts_bsz1, self.routing_weights_bsz1]


class BlockSparseMLP:
    def __init__(self, device, variant, graphed):
        gen = generator(80461)
        self.device, self.variant = device, variant
        self.num_experts_per_tok = TOPK
        self.routing_gate = None                      # this rank has no router
        self.routing_device = 0
        self.gate_w = randn(NUM_EXPERTS, HIDDEN, INTERM, gen=gen, device=device, scale=0.5)
        self.up_w = randn(NUM_EXPERTS, HIDDEN, INTERM, gen=gen, device=device, scale=0.5)
        self.down_w = randn(NUM_EXPERTS, INTERM, HIDDEN, gen=gen, device=device, scale=0.5)
        self.gate_bias = randn(NUM_EXPERTS, INTERM, gen=gen, device=device)
        self.up_bias = randn(NUM_EXPERTS, INTERM, gen=gen, device=device)
        self.down_bias = randn(NUM_EXPERTS, HIDDEN, gen=gen, device=device)
        self.gate_tensor = randn(HIDDEN, NUM_EXPERTS, gen=gen, device=device, scale=2.0)
        # Persistent broadcast targets for TP ranks without the router (the fix)
        self.bcast_sel_bsz1 = None
        self.bcast_weights_bsz1 = None
        self.bc = BC_BlockSparseMLP(self, graphed)

    def forward(self, x, params):
        y = x.view(-1, HIDDEN)
        bsz = y.shape[0]
        if self.variant == "fix" and bsz == 1:
            # Stable buffers, not per-call allocations: the BC bsz-1 graph reads the routing tensors
            # through unpatched nodes (bias adds), whose addresses are baked at capture time
            if self.bcast_sel_bsz1 is None:
                self.bcast_sel_bsz1 = torch.empty((1, self.num_experts_per_tok), dtype=torch.long, device=self.device)
                self.bcast_weights_bsz1 = torch.empty((1, self.num_experts_per_tok), dtype=torch.half,
                                                      device=self.device)
            selected_experts = self.bcast_sel_bsz1
            routing_weights = self.bcast_weights_bsz1
            stable = {"bcast_sel_bsz1": selected_experts, "bcast_weights_bsz1": routing_weights}
        else:
            selected_experts = torch.empty((bsz, self.num_experts_per_tok), dtype=torch.long, device=self.device)
            routing_weights = torch.empty((bsz, self.num_experts_per_tok), dtype=torch.half, device=self.device)
            stable = {}
        # Broadcast routing indices and weights
        if self.routing_device is not None:
            params["backend"].broadcast(selected_experts, src_device=self.routing_device)
            params["backend"].broadcast(routing_weights, src_device=self.routing_device)
        return self.bc.run_bsz1(y, selected_experts, routing_weights, stable).view(x.shape)


def run(variant: str, device: str = "cpu"):
    gen = generator(461)
    emb = randn(VOCAB, HIDDEN, gen=gen, device=device)
    tokens = [3, 11, 5, 14, 0, 9, 7]

    def serve(graphed: bool):
        backend = Backend()
        mlp = BlockSparseMLP(device, variant, graphed)
        router = RouterRank(mlp.gate_tensor, device)
        outs = []
        for tok in tokens:                              # single-token decode (bsz 1)
            x = emb[tok:tok + 1].clone()
            router.routing_fn(x, backend)               # rank 0 routes, then broadcasts
            h = x + mlp.forward(x, {"backend": backend})
            outs.append(h.clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
