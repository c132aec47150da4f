"""The MoE router's z-loss makes a device tensor from a Python token count inside the captured router: capture fails.

Upstream: https://github.com/NVIDIA/Megatron-LM/pull/5401 ("[Fix] Fix MoE router z-loss compatibility with TE
CUDA Graph capture.", merged to main as 3fae48f4ad). Read: ``git show 3fae48f4ad -- megatron`` (the whole fix
is in ``megatron/core/transformer/moe/router.py``, ``TopKRouter.apply_z_loss``).
Symptom: training with ``--moe-z-loss-coeff`` and ``--cuda-graph-impl transformer_engine`` with ``moe_router``
in the CUDA-graph scope fails while the graphs are created: the router's capture is refused (a copy of
pageable CPU memory to the device inside stream capture); eager training works.
Mechanism: ``TopKRouter.routing`` flattens the logits and calls ``apply_z_loss(logits, padding_mask)``. In
training with grad enabled it computes ``z_loss_values = logsumexp(logits) ** 2``; when ``padding_mask is None``
it ran ``num_local_tokens = torch.tensor(logits.shape[0], device=logits.device)``: a new CPU scalar from a
Python int, copied host-to-device on every call, then ``z_loss_mean = z_loss_sum / clamp(num_local_tokens, 1)``.
TE's ``make_graphed_callables`` runs the router forward eagerly for its warmup iterations (fine: the copy is an
ordinary eager H2D copy) and then under ``torch.cuda.graph``: there the pageable copy is refused
(cudaErrorStreamCaptureUnsupported), so the capture, and the run, fails. The padded branch's count,
``valid_mask.sum()``, stays on the device and was fine.
Doctor: sync-in-capture, at ``apply_z_loss`` (the ``torch.tensor(..., device=...)`` upload of host data inside
the captured router forward).
Fix (upstream): the no-padding branch no longer makes a tensor: ``z_loss_sum = z_loss_values.sum()``;
``z_loss_mean = z_loss_sum / max(logits.shape[0], 1)`` (a Python scalar: the graph keeps it as a kernel
argument, which is right because a graphed callable's token count is static). The padded branch keeps
``z_loss_sum / torch.clamp(num_local_tokens, min=1)``, now computed inside that branch.
(One MoE layer's router, softmax top-k; ``MoEAuxLossAutoScaler`` is the identity in forward, and the z-loss is
observed through the metrics tracker the router records it into. Backward graphs are left out.)
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/Megatron-LM/pull/5401"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "apply_z_loss"
SYMPTOM = "TE CUDA-graph capture of the MoE router fails: z-loss uploads torch.tensor(num_tokens) inside capture"

SEQ, BSZ, HIDDEN, EXPERTS, TOPK = 3, 2, 8, 4, 2
NUM_LAYERS, LAYER_NUMBER, WARMUP_ITERS, ITERATIONS = 2, 1, 3, 4


@dataclasses.dataclass
class TransformerConfig:
    num_moe_experts: int = EXPERTS
    moe_router_topk: int = TOPK
    moe_z_loss_coeff: float | None = 1e-2
    num_layers: int = NUM_LAYERS


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Keeps the aux loss alive for backward; the identity on ``output`` in forward."""

    @staticmethod
    def forward(ctx, output, aux_loss):
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.ones_like(aux_loss)


class MoEMetricsTracker:
    """``get_moe_metrics_tracker()``: per-layer sums of the router's losses, lazily allocated."""

    def __init__(self):
        self._metrics: dict[str, torch.Tensor] = {}

    def record(self, name, value, layer_number, num_layers):
        if name not in self._metrics:
            self._metrics[name] = torch.zeros(num_layers, device=value.device)
        self._metrics[name][layer_number - 1] += value.detach()

    def clear(self):
        for values in self._metrics.values():
            values.zero_()

    def values(self, name):
        return self._metrics[name]


class TopKRouter:
    def __init__(self, config: TransformerConfig, tracker: MoEMetricsTracker, device, variant):
        self.config, self.tracker, self.variant = config, tracker, variant
        self.topk, self.layer_number, self.training = config.moe_router_topk, LAYER_NUMBER, True
        self.weight = randn(EXPERTS, HIDDEN, gen=generator(5401), device=device, scale=0.8)

    def gating(self, input):
        return torch.nn.functional.linear(input, self.weight)

    def apply_z_loss(self, logits, padding_mask=None):
        if self.config.moe_z_loss_coeff is not None and self.training and torch.is_grad_enabled():
            logsum = torch.logsumexp(logits, dim=-1)
            z_loss_values = torch.square(logsum)
            if padding_mask is not None:
                valid_mask = ~padding_mask
                z_loss_values = z_loss_values * valid_mask
                num_local_tokens = valid_mask.sum()
                z_loss_sum = z_loss_values.sum()
                z_loss_mean = z_loss_sum / torch.clamp(num_local_tokens, min=1)
            elif self.variant == "bug":
                num_local_tokens = torch.tensor(logits.shape[0], device=logits.device)
                z_loss_sum = z_loss_values.sum()
                z_loss_mean = z_loss_sum / torch.clamp(num_local_tokens, min=1)
            else:
                z_loss_sum = z_loss_values.sum()
                # Keep the token count as a Python scalar so CUDA graph capture does not
                # record a CPU-to-CUDA tensor creation.
                z_loss_mean = z_loss_sum / max(logits.shape[0], 1)
            z_loss = z_loss_mean * self.config.moe_z_loss_coeff        # tp_cp_group.size() == 1
            logits = MoEAuxLossAutoScaler.apply(logits, z_loss)
            self.tracker.record("z_loss", z_loss_mean, self.layer_number, self.config.num_layers)
        return logits

    def routing(self, logits, padding_mask=None):
        logits = logits.view(-1, self.config.num_moe_experts)
        if padding_mask is not None:
            padding_mask = padding_mask.reshape(-1)
        logits = self.apply_z_loss(logits, padding_mask=padding_mask)
        # topk_routing_with_score_function(score_function="softmax")
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_probs, top_indices = torch.topk(scores, k=self.topk, dim=1)
        probs = torch.zeros_like(scores).scatter(1, top_indices, top_probs)
        routing_map = torch.zeros_like(scores).scatter(1, top_indices, 1.0)
        return probs, routing_map

    def forward(self, input, padding_mask=None):
        return self.routing(self.gating(input), padding_mask=padding_mask)


def make_graphed_callables(router: TopKRouter, sample_args, device):
    """TE's ``make_graphed_callables`` for the ``moe_router`` scope: ``num_warmup_iters`` eager runs on the
    static sample input, then the capture of the forward (the backward graph is left out)."""
    (hidden_states,) = sample_args
    return capture(lambda: router.forward(hidden_states), device=device, warmups=WARMUP_ITERS,
                   name="moe_router fwd", owner="TE make_graphed_callables (moe_router)",
                   static={"hidden_states": hidden_states}, state={"z_loss metric": router.tracker.values("z_loss")})


def run(variant: str, device: str = "cpu"):
    gen = generator(54010)
    batches = [randn(SEQ, BSZ, HIDDEN, gen=gen, device=device) for _ in range(ITERATIONS)]

    def eager():
        tracker = MoEMetricsTracker()
        router, outs = TopKRouter(TransformerConfig(), tracker, device, variant), []
        for x in batches:
            probs, routing_map = router.forward(x)
            outs += [probs, routing_map, tracker.values("z_loss").clone()]
            tracker.clear()                          # the iteration's report resets the tracker
        return outs

    def served():
        tracker = MoEMetricsTracker()
        router, outs = TopKRouter(TransformerConfig(), tracker, device, variant), []
        tracker.record("z_loss", torch.zeros((), device=device), LAYER_NUMBER, NUM_LAYERS)  # allocate the entry
        hidden_states = torch.zeros(SEQ, BSZ, HIDDEN, device=device)
        g, out = make_graphed_callables(router, (hidden_states,), device)
        for x in batches:
            tracker.clear()
            hidden_states.copy_(x)
            probs, routing_map = replay(g, out)
            outs += [probs.clone(), routing_map.clone(), tracker.values("z_loss").clone()]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
