"""Megatron-LM MoE with partial CUDA graphs and HybridEP: ``combine()`` clears the expert-rank budget that ``setup_metadata()`` set inside the captured router graph, so later replays dispatch without a budget while eager keeps it.

Upstream: https://github.com/NVIDIA/Megatron-LM/pull/6999 ("[MoE] Preserve HybridEP capacity across CUDA graph
replay", NVIDIA/Megatron-LM, gdengk, opened 2026-08-31, merged). Read: the PR description (background, fix, the
regression test it names); ``megatron/core/transformer/moe/token_dispatcher.py`` at d98e8a64dd (2026-08-22, the code
the PR changes: ``_HybridEPManager.__init__``/``setup_metadata``/``dispatch``/``combine``,
``MoEFlexTokenDispatcher.__init__`` (its ``cudagraph_attrs``), ``dispatch_preprocess``, ``_initialize_metadata``,
``token_dispatch``, ``dispatch_postprocess``, ``combine_preprocess``, ``token_combine``, ``combine_postprocess``);
``moe_layer.py`` at the same commit (``MoELayer.route``/``preprocess``/``dispatch``/``routed_experts_compute``/
``combine``/``postprocess`` and the ``fwd_execution_map`` stages of ``forward``); ``transformer_layer.py``
(``MoETransformerLayer``: ``transition_cudagraph_scope('partial')``, ``_forward_mlp_router``,
``_get_token_dispatcher_attrs``, ``_restore_token_dispatcher_attrs``, ``_forward_mlp_expert_compute``,
``_forward_mlp_postprocess``, ``_forward_mlp``); ``moe_utils.get_align_size_for_quantization``. The diff itself was
not available; the fixed line is reconstructed from the description ("This change only clears dynamically computed
token counts. Static budgets from either ``drop_and_pad`` or ``moe_expert_rank_capacity_factor`` remain available").
Symptom: with ``--cuda-graph-modules moe_router moe_preprocess`` (partial CUDA graphs, the training mode of
``MoETransformerLayer``), ``--moe-flex-dispatcher-backend hybridep`` and ``--moe-expert-rank-capacity-factor``, every
replayed iteration after the first falls back to HybridEP's dynamic-size dispatch: a device-to-host sync per MoE
layer (what the PR reports), and with it the budget semantics are gone: tokens over the rank budget are no longer
dropped and ``over_budget`` is no longer tracked, so a replayed iteration computes something else than the same
iteration run eagerly.
Mechanism: ``setup_metadata()`` runs inside ``MoELayer.preprocess``, i.e. inside the captured router graph, and sets
the Python attribute ``num_permuted_tokens = budget`` (padded tokens x topk x capacity factor, aligned). Only the
tensors in ``cudagraph_attrs`` (``_comm_manager.token_probs``, ``_comm_manager.routing_map``) come back from the
graph and are restored by ``_restore_token_dispatcher_attrs`` before the eager dispatch; the int budget is host work
that ran once, at capture. ``combine()`` (eager, after the experts) sets ``num_permuted_tokens = None`` for every
non-``drop_and_pad`` configuration. Eagerly the next ``setup_metadata()`` sets it again; on replay nothing does, so
``dispatch()`` passes ``num_permuted_tokens=None`` to ``hybrid_ep_dispatch``.
Doctor: host-work-frozen, at combine. The budget is an attribute assignment made inside the captured region; replays
do not redo it, and ``combine`` (the function the fix changes) throws away the only copy, so replayed iterations
read a value that only an eager ``setup_metadata`` would restore.
Fix (upstream): ``combine()`` clears ``num_permuted_tokens`` only when it was computed dynamically (neither
``drop_and_pad`` nor ``moe_expert_rank_capacity_factor``); the static budget stays for the next replay.
Modelled: ``_HybridEPManager`` (``setup_metadata``, ``dispatch``, ``combine`` as upstream writes them, less the
uneven-input padding, FP8 probs handling and shared experts), ``MoEFlexTokenDispatcher`` (EP=TP=1),
``TopKRouter`` (``gating``, ``routing`` with top-k softmax), ``MoELayer`` with its ``fwd_execution_map`` stages and
``MoETransformerLayer``'s partial path (router graph, eager expert compute with the attribute restore, postprocess).
Stand-ins: ``hybrid_ep_dispatch``/``hybrid_ep_combine`` are a single-rank permute/unpermute in expert-major order
that drop the permuted rows past ``num_permuted_tokens`` and set the overflow flag when a budget is given, and size
the output from the routed count (host sync) when it is None, as the upstream comments describe; the permutation
itself uses ``nonzero`` on both paths (the real kernel permutes on the device). ``get_align_size_for_quantization``
returns 4 (256 with TE grouped tensors upstream). ``CudaGraphManager`` is reduced to: first iteration eager, then
warm up once, capture the router stage, replay it on every later iteration (backward graphs left out: the workload
runs forward microbatches). The capacity factor is 0.75 on one rank, standing in for a rank whose experts receive more
than their budget; experts are a per-expert 2-layer MLP with the routing prob applied after fc1; float64.
Workload: one MoE layer, 4 forward microbatches of [4 x 2] tokens, hidden 6, 4 experts, top-2: 16 routed rows
against a budget of 12, so each iteration drops 4 rows eagerly. Eager runs with ``cuda_graph_impl="none"``.
Iteration 0 is eager in both runs; iteration 1 captures (the capture's ``setup_metadata`` sets the budget) and
replays with it; iterations 2 and 3 replay with ``num_permuted_tokens=None`` in the bug and process all 16 rows, so
their outputs differ from eager (max error 1.45 at iteration 2, 0.89 at iteration 3); the fix keeps the budget
and equals eager (max error 0).
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/Megatron-LM/pull/6999"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "combine"
SYMPTOM = ("partial CUDA graphs with HybridEP: combine() clears the static expert-rank budget that setup_metadata() "
           "set inside the captured router graph, so replayed iterations dispatch with num_permuted_tokens=None "
           "(dynamic size, host sync, over-budget tokens no longer dropped) while eager keeps the budget")

SEQ, BATCH, HIDDEN, FFN = 4, 2, 6, 5
NUM_EXPERTS, TOPK = 4, 2
RANK_CAPACITY_FACTOR = 0.75
ITERS = 4
DTYPE = torch.float64

_variant = "bug"


@dataclasses.dataclass
class TransformerConfig:
    num_moe_experts: int = NUM_EXPERTS
    moe_router_topk: int = TOPK
    moe_expert_rank_capacity_factor: float | None = RANK_CAPACITY_FACTOR
    moe_expert_capacity_factor: float | None = None
    moe_pad_expert_input_to_capacity: bool = False
    cuda_graph_impl: str = "none"                       # "local" with partial graphs in the served run
    cuda_graph_modules: tuple = ()
    cuda_graph_warmup_steps: int = 1


def get_align_size_for_quantization(config: TransformerConfig) -> int:
    return 4                                            # stand-in: 256 with TE grouped tensors upstream


# --- deep_ep HybridEP (stand-in: one rank, all experts local) ------------------------------------------------------

def hybrid_ep_dispatch(x, routing_map, probs, num_local_experts, num_permuted_tokens, pad_multiple):
    expert_idx, token_idx = routing_map.t().nonzero(as_tuple=True)        # expert-major permutation
    routed = token_idx.numel()
    if num_permuted_tokens is None:                      # dynamic size: resolved on the host, nothing dropped
        rows, kept = routed, routed
    else:                                                # static budget: fixed-size output, overflow dropped
        rows, kept = int(num_permuted_tokens), min(routed, int(num_permuted_tokens))
    dispatched = x.new_zeros(rows, x.shape[-1])
    dispatched[:kept] = x[token_idx[:kept]]
    dispatched_probs = probs.new_zeros(rows)
    dispatched_probs[:kept] = probs[token_idx[:kept], expert_idx[:kept]]
    tokens_per_expert = torch.bincount(expert_idx[:kept], minlength=num_local_experts)
    overflow_flag = torch.tensor(int(num_permuted_tokens is not None and routed > kept), device=x.device)
    return dispatched, dispatched_probs, None, tokens_per_expert, (token_idx[:kept], x.shape[0], overflow_flag)


def hybrid_ep_combine(x, handle, num_permuted_tokens, pad_multiple):
    token_idx, num_tokens, _ = handle
    return x.new_zeros(num_tokens, x.shape[-1]).index_add_(0, token_idx, x[:token_idx.numel()])


# --- megatron/core/transformer/moe/token_dispatcher.py -------------------------------------------------------------

class _HybridEPManager:
    def __init__(self, num_local_experts: int, num_experts: int, config: TransformerConfig, device: str):
        self.num_local_experts, self.num_experts, self.config = num_local_experts, num_experts, config
        self.capacity_factor = config.moe_expert_capacity_factor
        self.drop_and_pad = config.moe_pad_expert_input_to_capacity
        self.capacity = None
        # Actually the the up-bound for the number of tokens
        # after permute op, None means no up-bound, will cause a CPU sync
        self.num_permuted_tokens = None
        self.token_probs = None
        self.handle = None
        self.pad_multiple = None
        self.moe_expert_rank_capacity_factor = config.moe_expert_rank_capacity_factor
        self.over_budget = torch.zeros(1, dtype=torch.bool, device=device)
        self._original_num_tokens = None

    def setup_metadata(self, routing_map: torch.Tensor, probs: torch.Tensor):
        num_tokens = routing_map.shape[0]
        self._original_num_tokens = num_tokens
        padded_num_tokens = num_tokens
        self.routing_map = routing_map.reshape(num_tokens, self.num_experts)
        self.token_probs = probs.reshape(num_tokens, self.num_experts)
        if self.moe_expert_rank_capacity_factor is not None:
            pad_multiple = get_align_size_for_quantization(self.config)
            budget = int(padded_num_tokens * self.config.moe_router_topk * self.moe_expert_rank_capacity_factor)
            budget += -budget % pad_multiple
            self.num_permuted_tokens = budget
        # else: num_permuted_tokens stays None; HybridEP sizes buffers dynamically (CPU sync
        # in dispatch) and does not drop tokens or report overflow.

    def dispatch(self, hidden_states: torch.Tensor) -> torch.Tensor:
        align_size = get_align_size_for_quantization(self.config)
        if align_size > 0:
            self.pad_multiple = align_size
        dispatched_hidden, self.dispatched_probs, _, tokens_per_expert, self.handle = hybrid_ep_dispatch(
            hidden_states, self.routing_map, self.token_probs, self.num_local_experts,
            num_permuted_tokens=self.num_permuted_tokens, pad_multiple=self.pad_multiple)
        if self.moe_expert_rank_capacity_factor is not None:
            over_budget = self.handle[-1] != 0
            self.over_budget |= over_budget
        if self.num_permuted_tokens is None:
            self.tokens_per_expert = tokens_per_expert.to(torch.int64)
            # num_permuted_tokens is necessary to allocate the output tensor for combine.
            self.num_permuted_tokens = self.tokens_per_expert.sum()
        if self.moe_expert_rank_capacity_factor is not None:
            self.tokens_per_expert = tokens_per_expert.to(torch.int64)
        return dispatched_hidden

    def combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hybrid_ep_combine(hidden_states, self.handle, self.num_permuted_tokens, self.pad_multiple)
        # Release the used handle/num_permuted_tokens which could change in each iteration.
        self.handle = None
        if _variant == "bug":
            if not self.drop_and_pad:
                self.num_permuted_tokens = None
        else:                       # the fix: only a dynamically computed count is released
            if not self.drop_and_pad and self.moe_expert_rank_capacity_factor is None:
                self.num_permuted_tokens = None
        self._original_num_tokens = None
        return hidden_states


class MoEFlexTokenDispatcher:
    def __init__(self, num_local_experts: int, config: TransformerConfig, device: str):
        self.config, self.num_local_experts = config, num_local_experts
        self.tp_size = self.ep_size = 1
        self._comm_manager = _HybridEPManager(num_local_experts, config.num_moe_experts, config, device)
        self.cudagraph_attrs = ['_comm_manager.token_probs', '_comm_manager.routing_map']

    def _initialize_metadata(self, routing_map, probs):
        num_local_tokens, world_size = routing_map.shape[0], self.tp_size * self.ep_size
        routing_map = routing_map.reshape(num_local_tokens, world_size, self.num_local_experts).contiguous()
        probs = probs.reshape(num_local_tokens, world_size, self.num_local_experts).contiguous()
        return routing_map, probs

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        self.hidden_shape = hidden_states.shape
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        routing_map, probs = self._initialize_metadata(routing_map, probs)
        self._comm_manager.setup_metadata(routing_map, probs)
        return hidden_states, self._comm_manager.token_probs

    def token_dispatch(self, hidden_states, probs=None):
        dispatched_hidden_states = self._comm_manager.dispatch(hidden_states)
        return dispatched_hidden_states, self._comm_manager.dispatched_probs

    def dispatch_postprocess(self, hidden_states, probs):
        return hidden_states, self._comm_manager.tokens_per_expert, self._comm_manager.dispatched_probs

    def combine_preprocess(self, hidden_states):
        return hidden_states

    def token_combine(self, hidden_states):
        return self._comm_manager.combine(hidden_states)

    def combine_postprocess(self, hidden_states):
        return hidden_states.view(self.hidden_shape)


# --- router, experts, MoELayer (reduced) ---------------------------------------------------------------------------

class TopKRouter:
    def __init__(self, config, weight):
        self.config, self.weight = config, weight

    def gating(self, input):
        return input @ self.weight.t()

    def routing(self, logits):
        logits = logits.view(-1, self.config.num_moe_experts)
        top_logits, top_indices = torch.topk(logits, k=self.config.moe_router_topk, dim=1)
        probs = torch.zeros_like(logits).scatter(1, top_indices, torch.softmax(top_logits, dim=-1))
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_indices, True)
        return probs, routing_map

    def __call__(self, input):
        return self.routing(self.gating(input))


class GroupedMLP:
    def __init__(self, fc1, fc2):
        self.fc1, self.fc2 = fc1, fc2

    def __call__(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        output = torch.zeros_like(permuted_local_hidden_states)
        start = 0
        for expert, count in enumerate(tokens_per_expert.tolist()):
            rows = slice(start, start + count)
            intermediate = torch.tanh(permuted_local_hidden_states[rows] @ self.fc1[expert])
            output[rows] = (intermediate * permuted_probs[rows, None]) @ self.fc2[expert]
            start += count
        return output, None


class MoELayer:
    def __init__(self, config, device, gen):
        r = lambda *s, scale: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)     # noqa: E731
        self.router = TopKRouter(config, r(NUM_EXPERTS, HIDDEN, scale=0.8))
        self.experts = GroupedMLP(r(NUM_EXPERTS, HIDDEN, FFN, scale=0.5), r(NUM_EXPERTS, FFN, HIDDEN, scale=0.5))
        self.token_dispatcher = MoEFlexTokenDispatcher(NUM_EXPERTS, config, device)
        self.fwd_execution_map = ["route", "expert_compute", "postprocess"]

    def route(self, hidden_states):
        return self.router(hidden_states)

    def preprocess(self, hidden_states, probs, routing_map):
        return self.token_dispatcher.dispatch_preprocess(hidden_states, routing_map, probs)

    def dispatch(self, hidden_states, probs):
        return self.token_dispatcher.token_dispatch(hidden_states, probs)

    def routed_experts_compute(self, hidden_states, probs):
        dispatched_input, tokens_per_expert, permuted_probs = self.token_dispatcher.dispatch_postprocess(
            hidden_states, probs)
        expert_output, mlp_bias = self.experts(dispatched_input, tokens_per_expert, permuted_probs)
        return self.token_dispatcher.combine_preprocess(expert_output), mlp_bias

    def combine(self, output):
        return self.token_dispatcher.token_combine(output)

    def postprocess(self, output):
        return self.token_dispatcher.combine_postprocess(output)

    def __call__(self, hidden_states, intermediate_tensors=None):
        if "route" in self.fwd_execution_map:
            probs, routing_map = self.route(hidden_states)
            hidden_states, probs = self.preprocess(hidden_states, probs, routing_map)
            if intermediate_tensors is not None:
                return hidden_states, probs
        if "expert_compute" in self.fwd_execution_map:
            if intermediate_tensors is not None:
                hidden_states, probs = intermediate_tensors
            dispatched_input, probs = self.dispatch(hidden_states, probs)
            output, mlp_bias = self.routed_experts_compute(dispatched_input, probs)
            output = self.combine(output)
            if intermediate_tensors is not None:
                return output, mlp_bias
        if "postprocess" in self.fwd_execution_map:
            if intermediate_tensors is not None:
                output = intermediate_tensors[0]
            output = self.postprocess(output)
            if intermediate_tensors is not None:
                return output
        return output, mlp_bias


# --- megatron/core/transformer/cuda_graphs.py (reduced) and MoETransformerLayer --------------------------------------

class CudaGraphManager:
    """First iteration eager; then warm up, capture ``function_name`` once and replay it (static input buffer)."""

    def __init__(self, config, base_module, function_name, device):
        self.config, self.device = config, device
        self.func = getattr(base_module, function_name)
        self.calls, self.graph, self.static_input = 0, None, None

    def __call__(self, hidden_states):
        self.calls += 1
        if self.calls <= self.config.cuda_graph_warmup_steps:
            return self.func(hidden_states)
        if self.graph is None:
            self.static_input = hidden_states.clone()
            self.graph, self.static_outputs = capture(
                lambda: self.func(self.static_input), device=self.device, warmups=1, name="moe_router",
                owner="CudaGraphManager", static={"hidden_states": self.static_input})
        self.static_input.copy_(hidden_states)
        return replay(self.graph, self.static_outputs)


class MoETransformerLayer:
    def __init__(self, config, device):
        gen = generator(6999)
        self.config = config
        self.pre_mlp_layernorm_weight = (1.0 + 0.2 * torch.randn(HIDDEN, generator=gen)).to(DTYPE).to(device)
        self.mlp = MoELayer(config, device, gen)
        self.use_partial_cudagraphs = False
        self._local_cudagraph_attr_names = None
        if config.cuda_graph_impl == "local" and "moe_router" in config.cuda_graph_modules:
            self.use_partial_cudagraphs = True            # transition_cudagraph_scope('partial')
            self.cudagraph_manager_router = CudaGraphManager(config, self, "_forward_mlp_router", device)

    def _resolve_token_dispatcher_attr(self, attr_name):
        parent_attr_name, _, leaf_attr_name = attr_name.rpartition('.')
        obj = self.mlp.token_dispatcher
        for parent_name in parent_attr_name.split('.') if parent_attr_name else ():
            obj = getattr(obj, parent_name)
        return obj, leaf_attr_name or attr_name

    def _restore_token_dispatcher_attrs(self, attr_outputs):
        for attr_name, attr in zip(self._local_cudagraph_attr_names, attr_outputs):
            obj, name = self._resolve_token_dispatcher_attr(attr_name)
            setattr(obj, name, attr)

    def _get_token_dispatcher_attrs(self):
        attr_names, outputs = [], []
        for attr_name in self.mlp.token_dispatcher.cudagraph_attrs:
            obj, name = self._resolve_token_dispatcher_attr(attr_name)
            attr = getattr(obj, name)
            if torch.is_tensor(attr):
                attr_names.append(attr_name)
                outputs.append(attr)
        return tuple(attr_names), outputs

    def _forward_mlp_router(self, hidden_states):
        self.mlp.fwd_execution_map = "route"
        residual = hidden_states
        pre_mlp_layernorm_output = hidden_states * torch.rsqrt(
            hidden_states.pow(2).mean(-1, keepdim=True) + 1e-6) * self.pre_mlp_layernorm_weight
        hidden_states, probs = self.mlp(pre_mlp_layernorm_output, intermediate_tensors=())
        attr_names, token_dispatcher_attr_outputs = self._get_token_dispatcher_attrs()
        self._local_cudagraph_attr_names = attr_names
        return (residual, hidden_states, probs, *token_dispatcher_attr_outputs)

    def _forward_mlp_expert_compute(self, hidden_states, probs, token_dispatcher_attr_outputs):
        self._restore_token_dispatcher_attrs(token_dispatcher_attr_outputs)
        self.mlp.fwd_execution_map = "expert_compute"
        return self.mlp(None, intermediate_tensors=(hidden_states, probs))

    def _forward_mlp_postprocess(self, residual, output):
        self.mlp.fwd_execution_map = "postprocess"
        output = self.mlp(None, intermediate_tensors=(output, None))
        return residual + output

    def _forward_mlp(self, hidden_states):
        router = self.cudagraph_manager_router if self.use_partial_cudagraphs else self._forward_mlp_router
        residual, hidden_states, probs, *token_dispatcher_attr_outputs = router(hidden_states)
        expert_output, _ = self._forward_mlp_expert_compute(hidden_states, probs, token_dispatcher_attr_outputs)
        return self._forward_mlp_postprocess(residual, expert_output)


# --- the workload ----------------------------------------------------------------------------------------------------

def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(69990)
    microbatches = [randn(SEQ, BATCH, HIDDEN, gen=gen, device=device).to(DTYPE) for _ in range(ITERS)]

    def train(config):
        layer, outputs = MoETransformerLayer(config, device), []
        for hidden_states in microbatches:
            outputs.append(layer._forward_mlp(hidden_states).clone())
        return outputs

    eager = lambda: train(TransformerConfig())                                                 # noqa: E731
    served = lambda: train(TransformerConfig(cuda_graph_impl="local",                          # noqa: E731
                                             cuda_graph_modules=("moe_router", "moe_preprocess")))
    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
