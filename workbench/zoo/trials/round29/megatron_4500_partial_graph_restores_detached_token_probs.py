"""Partial MoE CUDA graphs restore the HybridEP token_probs cached at capture, detached: the router gets no gradient.

Upstream: https://github.com/NVIDIA/Megatron-LM/pull/4500 ("Fix partial cudagraphs + HybridEP not properly
triggering DDP hook", commit 3b1521e29c).
Symptom: MoE training with local partial CUDA graphs (``--cuda-graph-scope moe_router moe_preprocess``) and
the flex token dispatcher on the HybridEP backend: the router weight receives no gradient through the routing
probabilities, so its DDP backward hook (gradient accumulation into ``main_grad``) is never triggered and the
router is trained differently from the same run without graphs.
Mechanism: in partial mode ``MoETransformerLayer._forward_mlp_router`` is replayed by
``cudagraph_manager_router``; replays do not rerun its Python, so the attributes that
``MoEFlexTokenDispatcher.dispatch_preprocess`` sets (``_comm_manager.token_probs``, ``_comm_manager.routing_map``)
are kept in ``token_dispatcher_attrs``, filled when the router function runs un-replayed (warmup/capture)
with ``attr.detach()`` and refreshed in value by the captured ``copy_``. Before the eager expert phase,
``_forward_mlp_expert_compute`` ``setattr``s every cached tensor back onto the dispatcher. HybridEP's
``dispatch`` sends ``self.token_probs`` with the tokens (the ``probs`` argument is unused), so the experts are
weighted by the detached capture-time tensor instead of the router graph's output ``probs`` (the output of the
replay node, which carries the autograd edge into the router's backward graph): the values match, the
gradient path to ``router.weight`` does not exist. Eagerly, ``dispatch_preprocess`` binds ``token_probs`` to
the live probabilities of the step.
Doctor: warmup-divergence, at ``_forward_mlp_expert_compute`` (it rebinds ``token_probs`` to the tensor that
the capture-time router call cached, not to this step's router output).
Fix (upstream): ``_forward_mlp_expert_compute`` first sets ``token_dispatcher_attrs['_comm_manager.token_probs']
= probs`` (the live output of the router graph replay), then restores the attributes; the router call copies
into a cached tensor only when it does not require grad.
Read: the diff of commit 3b1521e29c and the code it changes (``transformer_layer.py``, ``token_dispatcher.py``
at its parent); the PR says no more than its title and the new code comment, so the symptom above is the
mechanism's consequence, not a quoted report.
Simplified here: one rank (dispatch/combine are identities), one eager warmup iteration before the router
graph is captured, no pre-MLP layernorm weight, the postprocess phase runs eagerly, and the router's backward
graph is written out by hand (softmax backward) instead of captured through autograd.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/Megatron-LM/pull/4500"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "_forward_mlp_expert_compute"
SYMPTOM = "router weight gets no gradient from the expert path under partial MoE CUDA graphs"
TOKENS, HIDDEN, NUM_EXPERTS, TOPK, STEPS = 6, 4, 4, 2, 4
CUDA_GRAPH_WARMUP_STEPS = 1                         # eager iterations before the router graph is captured


class _HybridEPManager:
    def __init__(self):
        self.token_probs = None
        self.routing_map = None
        self.dispatched_probs = None

    def setup_metadata(self, routing_map, probs):
        self.routing_map = routing_map.reshape(routing_map.shape[0], NUM_EXPERTS)
        self.token_probs = probs.reshape(probs.shape[0], NUM_EXPERTS)

    def dispatch(self, hidden_states):
        """``hybrid_ep_dispatch(x, routing_map, probs=self.token_probs, ...)`` (one rank: no exchange)."""
        self.dispatched_probs = self.token_probs.float()
        return hidden_states

    def combine(self, hidden_states):
        return hidden_states


class MoEFlexTokenDispatcher:
    def __init__(self):
        self._comm_manager = _HybridEPManager()
        self.cudagraph_attrs = ['_comm_manager.token_probs', '_comm_manager.routing_map']

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        self._comm_manager.setup_metadata(routing_map, probs)
        return hidden_states, self._comm_manager.token_probs

    def token_dispatch(self, hidden_states, probs=None):
        """``probs`` is unused: HybridEP sends ``_comm_manager.token_probs`` with the tokens."""
        dispatched = self._comm_manager.dispatch(hidden_states)
        return dispatched, self._comm_manager.dispatched_probs


class TopKRouter:
    def __init__(self, weight):
        self.weight = weight

    def routing(self, logits):
        scores = torch.softmax(logits, dim=-1)
        top_idx = torch.topk(scores, TOPK, dim=-1).indices
        routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, top_idx, True)
        return scores * routing_map, routing_map, scores

    def forward(self, x):
        return self.routing(x @ self.weight)


class MoELayer:
    def __init__(self, router_weight, expert_weights):
        self.router = TopKRouter(router_weight)
        self.token_dispatcher = MoEFlexTokenDispatcher()
        self.expert_weights = expert_weights
        self.fwd_execution_map = None

    def route(self, x):
        probs, routing_map, _ = self.router.forward(x)
        return self.token_dispatcher.dispatch_preprocess(x, routing_map, probs)

    def expert_compute(self, hidden_states):
        dispatched, dispatched_probs = self.token_dispatcher.token_dispatch(hidden_states)
        out = sum(dispatched_probs[:, e:e + 1] * (dispatched @ w) for e, w in enumerate(self.expert_weights))
        return self.token_dispatcher._comm_manager.combine(out)


class MoETransformerLayer:
    def __init__(self, mlp: MoELayer, variant: str, device: str, use_partial_cudagraphs: bool):
        self.mlp = mlp
        self.variant = variant
        self.device = device
        self.use_partial_cudagraphs = use_partial_cudagraphs
        self.token_dispatcher_attrs: dict[str, torch.Tensor] = {}
        self.router_runner = None
        self.warmup_steps_done = 0

    def _forward_pre_mlp_layernorm(self, hidden_states):
        return hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + 1e-6)

    def _resolve(self, attr_name):
        parent, _, leaf = attr_name.rpartition('.')
        obj = self.mlp.token_dispatcher
        for name in parent.split('.') if parent else ():
            obj = getattr(obj, name)
        return obj, leaf

    def _forward_mlp_router(self, hidden_states):
        """Captured by ``cudagraph_manager_router`` in partial mode."""
        self.mlp.fwd_execution_map = "route"
        pre_mlp_layernorm_output = self._forward_pre_mlp_layernorm(hidden_states)
        residual = hidden_states
        hidden, probs = self.mlp.route(pre_mlp_layernorm_output)
        for attr_name in self.mlp.token_dispatcher.cudagraph_attrs:
            obj, name = self._resolve(attr_name)
            attr = getattr(obj, name)
            if torch.is_tensor(attr):
                cached = self.token_dispatcher_attrs.get(attr_name)
                if torch.is_tensor(cached) and (self.variant == "bug" or not cached.requires_grad):
                    cached.copy_(attr)
                else:
                    self.token_dispatcher_attrs[attr_name] = attr.detach()
        return residual, hidden, probs

    def _forward_mlp_expert_compute(self, hidden_states, probs):
        """Runs eagerly between the router and postprocess graph replays."""
        if self.variant == "fix" and '_comm_manager.token_probs' in self.token_dispatcher_attrs:
            # keep the router autograd edge: the live output of the router graph replay
            self.token_dispatcher_attrs['_comm_manager.token_probs'] = probs
        for attr_name, attr in self.token_dispatcher_attrs.items():
            obj, name = self._resolve(attr_name)
            setattr(obj, name, attr)
        self.mlp.fwd_execution_map = "expert_compute"
        return self.mlp.expert_compute(hidden_states)

    def _forward_mlp_postprocess(self, residual, output):
        self.mlp.fwd_execution_map = "postprocess"
        return output + residual

    def _forward_mlp(self, hidden_states):
        if not self.use_partial_cudagraphs:        # eager: route, expert_compute, postprocess in one go
            hidden, _ = self.mlp.route(self._forward_pre_mlp_layernorm(hidden_states))
            return self._forward_mlp_postprocess(hidden_states, self.mlp.expert_compute(hidden))
        if self.warmup_steps_done < CUDA_GRAPH_WARMUP_STEPS:   # CudaGraphManager warmup: run it eagerly
            self.warmup_steps_done += 1
            residual, hidden, probs = self._forward_mlp_router(hidden_states)
        else:
            if self.router_runner is None:                   # first call after warmup: capture
                self.router_runner = _CudaGraphRunner(self, self.device)
            residual, hidden, probs = _CudagraphReplayNode.apply(self.router_runner, hidden_states,
                                                                 self.mlp.router.weight)
        expert_output = self._forward_mlp_expert_compute(hidden, probs)
        return self._forward_mlp_postprocess(residual, expert_output)


class _CudaGraphRunner:
    """Forward and backward graph of ``_forward_mlp_router`` (local CUDA graph implementation)."""

    def __init__(self, layer: MoETransformerLayer, device: str):
        self.layer = layer
        self.static_hidden = torch.zeros(TOKENS, HIDDEN, device=device)
        self.static_grad_probs = torch.zeros(TOKENS, NUM_EXPERTS, device=device)

        def fwd():
            residual, hidden, probs = layer._forward_mlp_router(self.static_hidden)
            pre = layer._forward_pre_mlp_layernorm(self.static_hidden)
            _, routing_map, scores = layer.mlp.router.forward(pre)
            return residual, hidden, probs, pre, routing_map, scores

        with torch.no_grad():
            self.fwd_graph, self.fwd_outputs = capture(fwd, device=device, warmups=0, name="router fwd",
                                                       static={"hidden_states": self.static_hidden},
                                                       owner="CudaGraphManager")
        _, _, _, pre, routing_map, scores = self.fwd_outputs
        weight = layer.mlp.router.weight

        def bwd():
            """Backward of the router w.r.t. its weight, from the gradient of ``probs``."""
            dscores = self.static_grad_probs * routing_map
            dlogits = scores * (dscores - (dscores * scores).sum(-1, keepdim=True))
            return pre.t() @ dlogits

        with torch.no_grad():
            self.bwd_graph, self.wgrad = capture(bwd, device=device, warmups=0, name="router bwd",
                                                 static={"grad_probs": self.static_grad_probs},
                                                 owner="CudaGraphManager")
        self.weight = weight


class _CudagraphReplayNode(torch.autograd.Function):
    @staticmethod
    def forward(ctx, runner, hidden_states, weight):
        ctx.runner = runner
        runner.static_hidden.copy_(hidden_states)
        outs = replay(runner.fwd_graph, runner.fwd_outputs)
        return outs[0].detach(), outs[1].detach(), outs[2].detach()

    @staticmethod
    def backward(ctx, grad_residual, grad_hidden, grad_probs):
        runner = ctx.runner
        if grad_probs is None:
            return None, None, None
        runner.static_grad_probs.copy_(grad_probs)
        wgrad = replay(runner.bwd_graph, runner.wgrad)
        return None, None, wgrad.clone()


def run(variant: str, device: str = "cpu"):
    gen = generator(4500)
    router_weight0 = randn(HIDDEN, NUM_EXPERTS, gen=gen, device=device)
    expert_weights0 = [randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5) for _ in range(NUM_EXPERTS)]
    batches = [(randn(TOKENS, HIDDEN, gen=gen, device=device), randn(TOKENS, HIDDEN, gen=gen, device=device))
                for _ in range(STEPS)]

    def train(use_partial_cudagraphs):
        router_weight = router_weight0.clone().requires_grad_(True)
        main_grad = torch.zeros_like(router_weight0)

        def ddp_backward_post_hook(param):          # DDP: accumulate into main_grad, then drop .grad
            main_grad.add_(param.grad)
            param.grad = None

        router_weight.register_post_accumulate_grad_hook(ddp_backward_post_hook)
        experts = [w.clone().requires_grad_(True) for w in expert_weights0]
        layer = MoETransformerLayer(MoELayer(router_weight, experts), variant, device, use_partial_cudagraphs)
        outs = []
        for hidden_states, grad_target in batches:
            output = layer._forward_mlp(hidden_states)
            (output * grad_target).sum().backward()
            outs += [output.detach().clone(), main_grad.clone()]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: train(True), lambda: train(False))
