"""vllm-ascend dynamic EPLB: under ACL graph mode ``self.moe_load += expert_tokens`` in the MoE layer is not an in-place update, so the expert-load counters EPLB reads stop accumulating what the replayed decode steps routed.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/6182 ("BugFix: Fix moe_load accumulation error in ACL graph
mode", vllm-project/vllm-ascend, merged as commit 29fb27d3bb of 2026-01-26). Read: the commit message (the PR
description: "using += for NPU tensors in graph mode does not throw errors but leads to incorrect values, so we replace
it with the in-place add_() method"), its whole diff (``vllm_ascend/ops/fused_moe/fused_moe.py``, 2 lines in
``AscendFusedMoE.forward_impl``), the pre-fix ``fused_moe.py`` (``AscendFusedMoE.__init__`` allocating ``moe_load``
when ``dynamic_eplb``, ``clear_moe_load``, ``forward_impl``), and at the same commit ``vllm_ascend/eplb/utils.py``
(``get_all_moe_loads`` stacks every layer's ``mlp.experts.moe_load``, ``clear_all_moe_loads``),
``vllm_ascend/eplb/eplb_updator.py`` (``forward_end``, ``update_iteration``, ``wakeup_eplb_worker_flag``,
``compute_and_set_moe_load``, ``compute_moe_imbalance``) and ``eplb/adaptor/vllm_adaptor.py``
(``get_rank_expert_workload``).
Symptom: with dynamic EPLB and ACL graphs, the per-expert token counts (``moe_load``) that the EPLB worker uses to
re-place experts are wrong: no error, the load statistics (peak-to-average ratio, expert placement) are computed from
counts that miss what the graph-served decode steps routed. Eager mode counts correctly.
Mechanism: ``moe_load`` is a plain tensor attribute of the MoE layer, accumulated at the end of ``forward_impl``. The
PR's diagnosis is that in graph mode ``+=`` does not update that tensor in place; a statement that is not an in-place
update is an out-of-place add plus an attribute store. Eagerly the two agree (the attribute is rebound to the running
sum every step). In a capture, the add is recorded reading the tensor the attribute held then and writing a graph-owned
output, while the attribute store is Python that runs once: every replay recomputes ``<tensor at capture> + this
step's counts`` into the graph's output, and ``self.moe_load`` (what EPLB reads and clears) is whatever Python last
bound, which no replay touches. The counts of graph-served steps never reach it.
Doctor: host-work-frozen, at forward_impl (the attribute assignment ``self.moe_load = ...`` is host work inside the
captured region: it ran once at capture, replays repeat only the add; that the replayed add then reads the
capture-time tensor, which the store released, is a consequence of the same line).
Fix (upstream): ``local_load = <counts>``; ``self.moe_load.add_(local_load)``: the captured kernel accumulates into the
one tensor EPLB reads.
Modelled: ``AscendFusedMoE`` (``moe_load`` allocated for ``dynamic_eplb``, ``clear_moe_load``, ``forward_impl``'s
EPLB accumulation verbatim apart from the fixed lines, the ``group_list_type`` branch), ``FusedExpertsResult``,
``select_experts`` (softmax top-k, renormalised), ``get_all_moe_loads`` / ``clear_all_moe_loads``, ``EplbUpdator``
(``forward_end``, ``update_iteration`` with its window of heat collection + algorithm interval + one step per MoE
layer, ``compute_and_set_moe_load`` writing ``shared_dict["moe_load"]``, ``compute_moe_imbalance``), a model runner
with FULL decode graphs for 2 and 4 requests sharing one pool (captured largest first, one warm-up each). Stand-ins:
the bug line is written as the out-of-place add plus store that the PR says ``+=`` amounted to in graph mode (the PR
gives no deeper cause); the model (embedding, two MoE blocks with 4 experts and top-2 routing computed densely, no
attention, LM head; float64); the expert kernel (``quant_method.apply``) returns per-expert counts
(``group_list_type == 1``) made with ``scatter_add_``; the all-gather of ``compute_and_set_moe_load`` (one rank); the
EPLB worker process and weight moves (not modelled: they only consume the recorded loads); after capture the runner
clears the loads so both runs start the first heat window from zero; graphs read freed memory as a serving process
that keeps its caching allocator does (``on_freed="reuse"``: silently, as the PR saw no error).
Workload: requests A-D (2-token prompts). Step 0 prefills all four (eager); steps 1-4 decode four requests (graph of 4);
C and D finish; steps 5-8 decode A and B (graph of 2); greedy tokens. EPLB window: heat collection 3 steps, algorithm
interval 1, 2 MoE layers (the load is recorded after steps 2 and 8, the loads are cleared after step 5). Outputs: the
logits of every step, both recorded loads and the final loads. Bug: the logits equal eager, but the first recorded
load holds only the eager prefill's counts (16 per layer instead of 32: steps 1-2 missing, up to 8 in one expert) and
the second record and the final loads are all zero (steps 6-8 missing, 12 per layer in eager): max |graph - eager| = 8
(token counts). Fix: equals eager (max 0).
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/6182"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "forward_impl"
SYMPTOM = ("dynamic EPLB under ACL graphs: the MoE layer's moe_load (+= expert token counts) stops accumulating the "
           "graph-served decode steps, so EPLB computes expert loads and placements from wrong counts; no error")

HIDDEN, INTER, VOCAB = 8, 12, 16
NUM_EXPERTS, TOP_K, NUM_MOE_LAYERS = 4, 2, 2
MAX_NUM_REQS = 4
CUDAGRAPH_CAPTURE_SIZES = [2, 4]
DTYPE = torch.float64

_variant = "bug"


# --- vllm/forward_context.py (reduced) --------------------------------------------------------------------------------

@dataclasses.dataclass
class ForwardContext:
    in_profile_run: bool = False


_forward_context = ForwardContext()


def get_forward_context():
    return _forward_context


# --- vllm_ascend/ops/fused_moe (reduced) ------------------------------------------------------------------------------

@dataclasses.dataclass
class FusedExpertsResult:
    routed_out: torch.Tensor
    expert_tokens: torch.Tensor | None = None
    group_list_type: int | None = None
    before_dispatch_evt: object = None
    before_combine_evt: object = None


def select_experts(hidden_states, router_logits, top_k, renormalize):
    topk_weights, topk_ids = torch.softmax(router_logits, dim=-1).topk(top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


class AscendUnquantizedFusedMoEMethod:
    """Stand-in for the fused expert kernels: SwiGLU experts computed densely, counts per local expert."""

    def apply(self, layer, x, router_logits, top_k, renormalize, global_num_experts, expert_map=None,
              enable_force_load_balance=False, log2phy=None, **kwargs):
        topk_weights, topk_ids = select_experts(x, router_logits, top_k, renormalize)
        gate_up = torch.einsum("th,ehi->eti", x, layer.w13_weight)
        act = torch.nn.functional.silu(gate_up[..., :INTER]) * gate_up[..., INTER:]
        expert_out = torch.einsum("eti,eih->teh", act, layer.w2_weight)          # [T, E, H]
        picked = expert_out.gather(1, topk_ids.unsqueeze(-1).expand(-1, -1, HIDDEN))
        routed_out = (picked * topk_weights.unsqueeze(-1)).sum(dim=1)
        ids = topk_ids.flatten()
        expert_tokens = torch.zeros(global_num_experts, dtype=torch.int64, device=x.device).scatter_add_(
            0, ids, torch.ones_like(ids))
        return FusedExpertsResult(routed_out=routed_out, expert_tokens=expert_tokens, group_list_type=1)


class AscendFusedMoE(torch.nn.Module):
    def __init__(self, gen, device, dynamic_eplb=True):
        super().__init__()
        self.top_k, self.renormalize = TOP_K, True
        self.global_num_experts = self.local_num_experts = NUM_EXPERTS
        self._expert_map = self.log2phy = None
        self.quant_method = AscendUnquantizedFusedMoEMethod()
        self.w13_weight = randn(NUM_EXPERTS, HIDDEN, 2 * INTER, gen=gen, device=device, scale=0.4).to(DTYPE)
        self.w2_weight = randn(NUM_EXPERTS, INTER, HIDDEN, gen=gen, device=device, scale=0.4).to(DTYPE)
        self.dynamic_eplb = dynamic_eplb
        self.moe_load = None
        if self.dynamic_eplb:
            self.moe_load = torch.zeros(self.local_num_experts, dtype=torch.int64, device=device)

    def clear_moe_load(self):
        if self.moe_load is not None:
            self.moe_load.zero_()

    def forward_impl(self, hidden_states, router_logits):
        forward_context = get_forward_context()
        enable_force_load_balance = forward_context.in_profile_run

        fused_experts_results = self.quant_method.apply(
            layer=self, x=hidden_states, router_logits=router_logits, top_k=self.top_k,
            renormalize=self.renormalize, global_num_experts=self.global_num_experts, expert_map=self._expert_map,
            enable_force_load_balance=enable_force_load_balance, log2phy=self.log2phy)

        if self.dynamic_eplb:
            expert_tokens = fused_experts_results.expert_tokens
            group_list_type = fused_experts_results.group_list_type
            assert expert_tokens is not None and group_list_type is not None, \
                "expert_tokens and group_list_type should not be None when dynamic_eplb is enabled."
            local_load = expert_tokens if group_list_type == 1 else \
                torch.cat([expert_tokens[:1], expert_tokens[1:] - expert_tokens[:-1]])
            if _variant == "bug":
                # `self.moe_load += local_load`: in graph mode not an in-place update (the PR), i.e. a new tensor
                # bound to the attribute.
                self.moe_load = self.moe_load + local_load
            else:
                self.moe_load.add_(local_load)
        return fused_experts_results.routed_out


# --- the model (stand-in: Qwen3-MoE-like, no attention) ---------------------------------------------------------------

class Qwen3MoeSparseMoeBlock(torch.nn.Module):
    def __init__(self, gen, device):
        super().__init__()
        self.gate_weight = randn(HIDDEN, NUM_EXPERTS, gen=gen, device=device).to(DTYPE)
        self.experts = AscendFusedMoE(gen, device)

    def forward(self, hidden_states):
        router_logits = hidden_states @ self.gate_weight
        return self.experts.forward_impl(hidden_states, router_logits)


class Qwen3MoeDecoderLayer(torch.nn.Module):
    def __init__(self, gen, device):
        super().__init__()
        self.mlp = Qwen3MoeSparseMoeBlock(gen, device)

    def forward(self, hidden_states):
        return hidden_states + self.mlp(torch.nn.functional.rms_norm(hidden_states, (HIDDEN,)))


class Qwen3MoeForCausalLM(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        gen = generator(6182)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device).to(DTYPE)
        self.layers = torch.nn.ModuleList(Qwen3MoeDecoderLayer(gen, device) for _ in range(NUM_MOE_LAYERS))
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device).to(DTYPE)
        self.num_dense_layers, self.num_moe_layers = 0, NUM_MOE_LAYERS

    def forward(self, input_ids):
        hidden_states = self.embed_tokens[input_ids]
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return hidden_states @ self.lm_head

    # vllm_ascend/eplb/utils.py (model_register binds these to the model)
    def get_all_moe_loads(self):
        return torch.stack([self.layers[layer_id + self.num_dense_layers].mlp.experts.moe_load
                            for layer_id in range(self.num_moe_layers)], dim=0)

    def clear_all_moe_loads(self):
        for layer_id in range(self.num_moe_layers):
            self.layers[layer_id + self.num_dense_layers].mlp.experts.clear_moe_load()


# --- vllm_ascend/eplb/eplb_updator.py (reduced: one rank, no worker process) ------------------------------------------

class EplbUpdator:
    def __init__(self, model, expert_heat_collection_interval=3, algorithm_execution_interval=1):
        self.model = model
        self.expert_heat_collection_interval = expert_heat_collection_interval
        self.algorithm_execution_interval = algorithm_execution_interval
        self.num_moe_layers = model.num_moe_layers
        self.cur_iterations = 0
        self.shared_dict, self.moe_imbalance_dict, self.recorded_loads = {}, {}, []

    def update_iteration(self):
        self.cur_iterations += 1
        if self.cur_iterations == (self.expert_heat_collection_interval + self.algorithm_execution_interval
                                   + self.num_moe_layers):
            self.model.clear_all_moe_loads()
            self.cur_iterations = 0

    def wakeup_eplb_worker_flag(self):
        return self.cur_iterations == (self.expert_heat_collection_interval - 1)

    def forward_end(self):
        if self.wakeup_eplb_worker_flag():
            self.compute_and_set_moe_load()
        self.update_iteration()

    def compute_and_set_moe_load(self):
        local_load = self.model.get_all_moe_loads()          # adaptor.get_rank_expert_workload()
        moe_load = local_load.unsqueeze(1)                   # all_gather over one rank -> [layers, ranks, experts]
        self.shared_dict["moe_load"] = moe_load.cpu()
        self.recorded_loads.append(self.shared_dict["moe_load"].clone())
        self.compute_moe_imbalance(moe_load)
        return moe_load

    def compute_moe_imbalance(self, moe_load):
        layer_card_load = moe_load.sum(dim=-1).cpu().float()
        for layer_idx in range(layer_card_load.size(0)):
            layer_load = layer_card_load[layer_idx]
            self.moe_imbalance_dict[layer_idx] = layer_load.max().item() / (layer_load.mean().item() + 1e-6)


# --- vllm_ascend/worker/model_runner_v1.py (reduced) ------------------------------------------------------------------

class NPUModelRunner:
    def __init__(self, device, use_aclgraph):
        self.device = device
        self.model = Qwen3MoeForCausalLM(device)
        self.eplb_updator = EplbUpdator(self.model)
        self.input_ids = torch.zeros(MAX_NUM_REQS * 4, dtype=torch.int64, device=device)
        self.requests, self.graphs = {}, {}
        if use_aclgraph:
            self.capture_model()
        self.model.clear_all_moe_loads()          # stand-in: the first heat window starts from zero loads

    def capture_model(self):
        pool = graph_pool_handle(self.device)
        for bs in sorted(CUDAGRAPH_CAPTURE_SIZES, reverse=True):
            self.input_ids[:bs].fill_(0)
            loads = {f"layers.{i}.mlp.experts.moe_load": layer.mlp.experts.moe_load
                     for i, layer in enumerate(self.model.layers)}
            self.graphs[bs] = capture(lambda bs=bs: self.model(self.input_ids[:bs]), device=self.device, pool=pool,
                                      name=f"FULL_DECODE_ONLY [{bs}]", owner="NPUModelRunner",
                                      static={"input_ids": self.input_ids}, state=loads, on_freed="reuse")

    def add_request(self, req_id, prompt):
        self.requests[req_id] = {"prompt": prompt, "num_computed": 0, "last": None}

    def execute_model(self, req_ids):
        tokens, query_lens = [], []
        for req_id in req_ids:
            req = self.requests[req_id]
            new = req["prompt"][req["num_computed"]:] or [req["last"]]
            tokens += new
            query_lens.append(len(new))
        num_reqs, num_tokens = len(req_ids), len(tokens)
        self.input_ids[:num_tokens].copy_(torch.tensor(tokens, dtype=torch.int64))
        uniform_decode = max(query_lens) == 1 and num_tokens == num_reqs
        if self.graphs and uniform_decode and num_reqs in self.graphs:
            g, out = self.graphs[num_reqs]
            logits = replay(g, out, real=num_reqs, size=num_reqs)
        else:
            logits = self.model(self.input_ids[:num_tokens])
        last = torch.cumsum(torch.tensor(query_lens), 0) - 1
        logits = logits[last.to(self.device)].clone()
        for row, req_id in enumerate(req_ids):
            req = self.requests[req_id]
            req["num_computed"] += query_lens[row]
            req["last"] = int(logits[row].argmax())
        self.eplb_updator.forward_end()
        return logits


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    prompts = {"A": [3, 7], "B": [11, 2], "C": [5, 14], "D": [9, 1]}
    steps = [list("ABCD")] * 5 + [list("AB")] * 4       # prefill, 4 decodes of 4, 4 decodes of 2

    def serve(use_aclgraph):
        runner = NPUModelRunner(device, use_aclgraph)
        for req_id, prompt in prompts.items():
            runner.add_request(req_id, prompt)
        logits = [runner.execute_model(step) for step in steps]
        loads = [load.to(DTYPE) for load in runner.eplb_updator.recorded_loads]
        return logits + loads + [runner.model.get_all_moe_loads().to(DTYPE)]

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
