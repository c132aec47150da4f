"""CUDA-graph padding rows of the MoE routing map keep valid-looking top-k expert ids and activate real experts.

Upstream: https://github.com/NVIDIA/Megatron-LM/pull/4922 ("Inference: Do not route pad/dummy tokens to any
expert", merged as aaac054ce3).
Symptom: the PR: "For small decodes, these [padding / dummy tokens] can end up unnecessarily activating experts";
the new kernel's docstring: padding rows "have garbage routing indices and, if left alone, would dispatch padding
tokens to real experts". No wrong token is reported: the real rows' outputs are unchanged, but the per-expert
token counts (``tokens_per_expert``: which experts run, how many grouped-GEMM rows) count the padding tokens.
Mechanism: dynamic inference pads each EP rank's local token count up to a captured size
(``cuda_graph_token_counts``); a step copies its real tokens into the static hidden-state rows ``[0, n)`` and
rows ``[n, padded)`` keep what an earlier step (or the capture / a dummy EP step, where every row is padding)
left there. The router runs on every padded row, so those rows get valid expert ids in ``routing_map``.
``NVLSAllGatherVDispatcher.token_dispatch`` all-gathers the ``[N, topk]`` routing map into the symmetric buffer
``agv_r`` (each rank's rows at ``rank * per_rank_max``) and ``mcore_fused_moe`` -> ``permute_tokens`` /
``compute_local_tokens_per_expert`` count and permute every pair below ``valid_tokens`` (the padded count in
the graph path), skipping only ids that are not a local expert. The graph is keyed only on the padded size:
nothing in it knows a step's real count, so padding tokens are counted on real experts at every replay.
Eager serving (no graphs) all-gathers only the real rows. Modelled with EP=2 (both ranks' forward in one
captured step: rank 1 has a dummy step, 0 real tokens), 4 experts, top-2, one padded size.
Doctor: stale-padding, at token_dispatch (the expert token counts depend on the expert ids that the padded
rows' leftover hidden states select; the dispatcher sends them on unmasked).
Fix (upstream): a fixed-address int32 scalar ``gpu_view.real_token_count`` in ``ContextGPUView._buf``, staged
as ``_staging_real_token_count`` and refreshed by ``transfer_bookkeeping_to_gpu()`` each step (0 when
``_bookkeeping_no_real_work``: capture/warmup or a dummy EP step); bound once with
``NVLSAllGatherVDispatcher.set_real_token_count_tensor``; ``token_dispatch`` calls
``mask_routing_padding(self.routing_map, cls._real_token_count_tensor, self.sp_rank)``, a kernel that reads the
count from device memory and writes -1 into every top-k slot of rows ``>= real_count`` before the all-gather.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/Megatron-LM/pull/4922"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "token_dispatch"
SYMPTOM = "padding tokens' leftover top-k ids are dispatched to real experts: expert token counts include them"

HIDDEN, EXPERTS, TOPK, EP_SIZE = 4, 4, 2, 2
PADDED = 6                                        # the one captured cuda_graph_token_count (per rank)
STEPS = ((6, 6), (2, 0), (4, 3), (1, 5))          # (rank 0, rank 1) real tokens; 0 = dummy EP step


class ContextGPUView:
    """The fixed-address GPU bookkeeping buffer; after the fix it holds ``real_token_count``."""

    def __init__(self, device):
        self._buf = torch.zeros(1, dtype=torch.int32, device=device)
        self.real_token_count = self._buf[0:1]


class DynamicInferenceContext:
    def __init__(self, device, variant, tokens):
        self.variant, self.tokens = variant, tokens
        self.hidden_states = torch.zeros(PADDED, HIDDEN, device=device)   # static input rows
        self.gpu_view = ContextGPUView(device)
        self._cpu_bookkeeping_buf = torch.zeros(1, dtype=torch.int32)
        self._staging_real_token_count = self._cpu_bookkeeping_buf[0:1]
        self._bookkeeping_no_real_work = False
        self.token_count = 0

    def initialize_attention_state(self, step, real, construct_graph_dimensions=None):
        """Copy the step's real tokens into rows [0, real); rows [real, PADDED) are left as they were."""
        if real:
            self.hidden_states[:real].copy_(self.tokens[step][:real])
        self.token_count = real
        self._bookkeeping_no_real_work = construct_graph_dimensions is not None or real == 0
        self.transfer_bookkeeping_to_gpu()

    def transfer_bookkeeping_to_gpu(self):
        if self.variant == "fix":
            self._staging_real_token_count[0] = 0 if self._bookkeeping_no_real_work else self.token_count
        self.gpu_view._buf.copy_(self._cpu_bookkeeping_buf)


def router(w, hidden_states):
    """TopKRouter: softmax scores, top-k expert ids (``routing_map``) and their probs."""
    scores = torch.softmax(hidden_states @ w["router"], dim=-1)
    probs, routing_map = torch.topk(scores, TOPK, dim=-1)
    return probs, routing_map


def mask_routing_padding(routing_map, real_token_count_tensor, tp_rank=0):
    """The fix's kernel: fill -1 into rows ``>= real_token_count`` (read from device memory)."""
    total_rows = routing_map.shape[0]
    global_rows = torch.arange(total_rows, device=routing_map.device) + tp_rank * total_rows
    pad = (global_rows >= real_token_count_tensor)[:, None]
    routing_map.copy_(routing_map.masked_fill(pad, -1))


class NVLSAllGatherVDispatcher:
    _real_token_count_tensor = None      # per rank: the context's gpu_view.real_token_count

    def __init__(self, rank, real_token_count_tensor):
        self.rank, self.sp_rank = rank, 0
        self._real_token_count_tensor = real_token_count_tensor
        self.routing_map = None

    def token_dispatch(self, agv, hidden_states, probs, routing_map):
        """Write this rank's rows into the symmetric all-gather-V buffers at rank * per_rank_max."""
        self.routing_map = routing_map
        if self._real_token_count_tensor is not None:
            mask_routing_padding(self.routing_map, self._real_token_count_tensor, self.sp_rank)
        rows = slice(self.rank * PADDED, self.rank * PADDED + hidden_states.shape[0])
        agv["h"][rows].copy_(hidden_states)
        agv["r"][rows].copy_(self.routing_map)
        agv["p"][rows].copy_(probs)


def compute_local_tokens_per_expert(routing_map, valid_tokens):
    """Count (token, slot) pairs per expert below ``valid_tokens``; ids that are not an expert (-1) skip."""
    valid = (torch.arange(routing_map.shape[0], device=routing_map.device) < valid_tokens)[:, None]
    experts = torch.arange(EXPERTS, device=routing_map.device)
    hits = (routing_map[:, :, None] == experts) & valid[:, :, None]
    return hits.sum(dim=(0, 1)).to(torch.float32)


def mcore_fused_moe(w, hidden_states, probs, routing_map, valid_tokens):
    """permute -> FC -> unpermute over all experts of the EP group; padding pairs with -1 do nothing."""
    out = torch.zeros_like(hidden_states)
    for e in range(EXPERTS):
        weight = ((routing_map == e).to(probs.dtype) * probs).sum(dim=1, keepdim=True)
        out = out + weight * torch.relu(hidden_states @ w["fc"][e])
    return out, compute_local_tokens_per_expert(routing_map, valid_tokens)


def moe_forward(w, contexts, dispatchers, agv, rows):
    """One MoE layer over the EP group: route each rank's ``rows[r]`` rows, all-gather-V, experts, combine."""
    for r, (ctx, disp) in enumerate(zip(contexts, dispatchers)):
        x = ctx.hidden_states[:rows[r]]
        probs, routing_map = router(w, x)
        disp.token_dispatch(agv, x, probs, routing_map)
    out, tokens_per_expert = mcore_fused_moe(w, agv["h"], agv["p"], agv["r"], EP_SIZE * PADDED)
    return tuple(out[r * PADDED:(r + 1) * PADDED] for r in range(EP_SIZE)) + (tokens_per_expert,)


def make_agv(device):
    """Symmetric buffers; rows a rank did not write (non-graph path: beyond its real count) are -1 / 0."""
    return {"h": torch.zeros(EP_SIZE * PADDED, HIDDEN, device=device),
            "r": torch.full((EP_SIZE * PADDED, TOPK), -1, dtype=torch.long, device=device),
            "p": torch.zeros(EP_SIZE * PADDED, TOPK, device=device)}


def run(variant: str, device: str = "cpu"):
    gen = generator(4922)
    w = {"router": randn(HIDDEN, EXPERTS, gen=gen, device=device, scale=2.0),
         "fc": randn(EXPERTS, HIDDEN, HIDDEN, gen=gen, device=device)}
    tokens = [[randn(PADDED, HIDDEN, gen=gen, device=device) for _ in STEPS] for _ in range(EP_SIZE)]
    warm = [randn(PADDED, HIDDEN, gen=gen, device=device) for _ in range(EP_SIZE)]

    def build():
        contexts = [DynamicInferenceContext(device, variant, tokens[r]) for r in range(EP_SIZE)]
        dispatchers = [NVLSAllGatherVDispatcher(r, c.gpu_view.real_token_count if variant == "fix" else None)
                       for r, c in enumerate(contexts)]
        return contexts, dispatchers

    def served():
        contexts, dispatchers = build()
        agv = make_agv(device)
        for ctx, x in zip(contexts, warm):           # create_cuda_graphs: dummy warmup tokens, no real work
            ctx.hidden_states.copy_(x)
            ctx.token_count, ctx._bookkeeping_no_real_work = 0, True
            ctx.transfer_bookkeeping_to_gpu()
        g, outs = capture(lambda: moe_forward(w, contexts, dispatchers, agv, (PADDED,) * EP_SIZE),
                          device=device, name=f"moe_decode_{PADDED}", owner="DynamicInferenceEngine",
                          static={**{f"hidden_states_rank{r}": c.hidden_states for r, c in enumerate(contexts)},
                                  **{f"gpu_view_buf_rank{r}": c.gpu_view._buf for r, c in enumerate(contexts)}})
        got = []
        for step, real in enumerate(STEPS):
            for r, ctx in enumerate(contexts):
                ctx.initialize_attention_state(step, real[r])
            o = replay(g, outs, real=real[0], size=PADDED, padded={"hidden_states_rank0": contexts[0].hidden_states})
            got += [o[0][:real[0]].clone(), o[1][:real[1]].clone(), o[2].clone()]
        return got

    def eager():
        contexts, dispatchers = build()
        got = []
        for step, real in enumerate(STEPS):
            agv = make_agv(device)                   # non-graph path: only real rows are gathered
            for r, ctx in enumerate(contexts):
                ctx.initialize_attention_state(step, real[r])
            o = moe_forward(w, contexts, dispatchers, agv, real)
            got += [o[0][:real[0]].clone(), o[1][:real[1]].clone(), o[2].clone()]
        return got

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
