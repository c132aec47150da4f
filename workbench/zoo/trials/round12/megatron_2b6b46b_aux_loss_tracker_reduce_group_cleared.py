"""MoE aux-loss logging: the tracker's reduction group is set only by the captured forward, then cleared.

Upstream: https://github.com/NVIDIA/Megatron-LM/commit/2b6b46b796bb8a6c5388e5abd95aad0c97eda391
("ADLR/megatron-lm!3631 - Fixes and updates for external cudagraph"; the ``moe_utils.py`` part: stop
resetting ``reduce_group``/``avg_group`` in ``clear_aux_losses_tracker``).
Symptom: MoE training with Transformer Engine CUDA graphs over the MoE layers (``--external-cuda-graph``,
``--cuda-graph-scope full``, TP or CP > 1) logs a ``load_balancing_loss`` that differs from the same run
without graphs (issue NVIDIA/Megatron-LM#1494, "Load Balancing loss discrepancy with/without CUDA
Graphs"; Megatron-core 0.12/0.13, 2025). The training itself is unchanged; only the logged aux loss is
off (here: one TP rank's share instead of the sum over the TP x CP group). Nothing raises.
Mechanism: the router's ``apply_load_balancing_loss`` calls ``save_to_aux_losses_tracker``, which does
two kinds of work: a device op (``values[layer_number - 1] += loss.detach()``) and host work (Python
assignments ``tracker[name]["reduce_group"] = reduce_group`` / ``["avg_group"]``). TE's
``make_graphed_callables`` runs the layer's Python only at warmup and capture; replays repeat the
kernels, so the add into ``values`` keeps happening but the dict assignments never run again.
``track_moe_metrics`` ends every logging step with ``clear_aux_losses_tracker()``, which zeroed
``values`` *and* set both groups back to ``None``. From then on nothing sets them:
``reduce_aux_losses_tracker_across_ranks`` skips the all-reduce over the TP x CP group and logs the
local partial sum. Eager forwards re-assign the group every micro-batch, so eager runs are right.
Doctor: host-work-frozen, at ``save_to_aux_losses_tracker`` (the attribute assignments inside the
captured region ran once, at capture; the clear undoes them and no replay redoes them).
Fix (upstream): ``clear_aux_losses_tracker`` only zeroes ``values`` and keeps the tracker's
reduction-group metadata, so what the capture-time forward recorded stays valid across replays.
"""
from __future__ import annotations

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/Megatron-LM/commit/2b6b46b796bb8a6c5388e5abd95aad0c97eda391"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "save_to_aux_losses_tracker"
SYMPTOM = "graphed MoE layers log an unreduced (one TP rank's) load_balancing_loss after the first clear"
TOKENS, DIM, EXPERTS, TOPK, NUM_LAYERS, NUM_MICROBATCHES, ITERS, AUX_COEFF = 6, 4, 3, 1, 2, 2, 3, 1e-2

_MOE_LAYER_WISE_LOGGING_TRACKER: dict = {}
VARIANT = {"v": "bug"}


class ProcessGroup:
    """The TP x CP group of an emulated 2-rank run: this process is rank 0; ``peer_values`` holds what
    the other rank's tracker holds for the current logging step (computed eagerly from its shard)."""

    def __init__(self):
        self.peer_values: dict[str, torch.Tensor] = {}

    def size(self):
        return 2


def all_reduce(values, group, name):
    """``torch.distributed.all_reduce(values, group=group)`` (SUM) between the two ranks."""
    values.add_(group.peer_values[name])


def get_moe_layer_wise_logging_tracker():
    return _MOE_LAYER_WISE_LOGGING_TRACKER


def save_to_aux_losses_tracker(name, loss, layer_number, num_layers, reduce_group=None, avg_group=None):
    """Save the auxiliary loss for logging."""
    if layer_number is None:
        return
    tracker = get_moe_layer_wise_logging_tracker()
    if name not in tracker:
        tracker[name] = {}
        tracker[name]["values"] = torch.zeros(num_layers, device=loss.device)
    tracker[name]["values"][layer_number - 1] += loss.detach()  # Aggregate the loss for the layer.
    tracker[name]["reduce_group"] = reduce_group
    tracker[name]["avg_group"] = avg_group


def clear_aux_losses_tracker():
    """Clear the auxiliary losses."""
    tracker = get_moe_layer_wise_logging_tracker()
    for name in tracker:
        tracker[name]["values"].zero_()
        if VARIANT["v"] == "bug":                  # the fix keeps the reduction-group metadata
            tracker[name]["reduce_group"] = None
            tracker[name]["avg_group"] = None


def reduce_aux_losses_tracker_across_ranks(track_names=None):
    """Collect and reduce the auxiliary losses across ranks (PP size 1: no PP all-reduce)."""
    tracker = get_moe_layer_wise_logging_tracker()
    if track_names is None:
        track_names = tracker.keys()
    for name in track_names:
        values = tracker[name]["values"]
        if tracker[name].get("reduce_group") is not None:
            all_reduce(values, tracker[name].get("reduce_group"), name)


def track_moe_metrics(loss_scale, total_loss_dict):
    """Reduce, log (into ``total_loss_dict``) and clear the tracker at the end of an iteration."""
    tracker = get_moe_layer_wise_logging_tracker()
    reduce_aux_losses_tracker_across_ranks()
    for name, v in tracker.items():
        total_loss_dict.setdefault(name, []).append((v["values"].float() * loss_scale).clone())
    clear_aux_losses_tracker()


def switch_load_balancing_loss_func(probs, tokens_per_expert, total_num_tokens, topk, num_experts,
                                    moe_aux_loss_coeff):
    aggregated_probs_per_expert = probs.sum(dim=0)
    return torch.sum(aggregated_probs_per_expert * tokens_per_expert) * (
        num_experts * moe_aux_loss_coeff / (total_num_tokens * total_num_tokens * topk))


class TopKRouter:
    def __init__(self, layer_number, tp_cp_group, device, gen):
        self.layer_number = layer_number
        self.tp_cp_group = tp_cp_group
        self.weight = randn(DIM, EXPERTS, gen=gen, device=device)

    def apply_load_balancing_loss(self, activation, probs, routing_map, save=True):
        sequence_partition_group = self.tp_cp_group if self.tp_cp_group.size() > 1 else None
        aux_loss = switch_load_balancing_loss_func(
            probs, routing_map.sum(dim=0), TOKENS * self.tp_cp_group.size(), TOPK, EXPERTS, AUX_COEFF)
        if save:
            save_to_aux_losses_tracker("load_balancing_loss", aux_loss / AUX_COEFF, self.layer_number,
                                       NUM_LAYERS, reduce_group=sequence_partition_group)
        return activation, aux_loss / AUX_COEFF

    def forward(self, hidden_states, save=True):
        logits = hidden_states @ self.weight
        probs = torch.softmax(logits, dim=-1)
        top_indices = logits.argmax(dim=-1, keepdim=True)
        routing_map = torch.zeros_like(probs).scatter_(1, top_indices, 1.0)
        scores = probs * routing_map
        return self.apply_load_balancing_loss(scores, probs, routing_map, save)


class MoELayer:
    """A TransformerLayer's MoE part: router plus top-1 experts (the graphed callable)."""

    def __init__(self, layer_number, tp_cp_group, device, gen):
        self.router = TopKRouter(layer_number, tp_cp_group, device, gen)
        self.experts = randn(EXPERTS, DIM, DIM, gen=gen, device=device, scale=0.5)

    def __call__(self, hidden_states, save=True):
        scores, _ = self.router.forward(hidden_states, save)
        expert_out = torch.einsum("td,edf->tef", hidden_states, self.experts)
        return hidden_states + (scores.unsqueeze(-1) * expert_out).sum(1)


def run(variant: str, device: str = "cpu"):
    gen = generator(3631)
    data = [[randn(TOKENS, DIM, gen=gen, device=device) for _ in range(NUM_MICROBATCHES)] for _ in range(ITERS)]
    peer = [[randn(TOKENS, DIM, gen=gen, device=device) for _ in range(NUM_MICROBATCHES)] for _ in range(ITERS)]

    def train(graphed: bool):
        VARIANT["v"] = variant
        _MOE_LAYER_WISE_LOGGING_TRACKER.clear()
        group = ProcessGroup()
        wgen = generator(1494)
        layers = [MoELayer(i + 1, group, device, wgen) for i in range(NUM_LAYERS)]
        total_loss_dict, outs = {}, []
        if graphed:
            # cuda_graph_capture (first training iteration): make_graphed_callables warms each layer up
            # on sample args, then captures it; replays repeat only the captured kernels.
            static_x = [torch.zeros(TOKENS, DIM, device=device) for _ in layers]
            with events.warmup():
                for layer, x in zip(layers, static_x):
                    layer(x)
            values = _MOE_LAYER_WISE_LOGGING_TRACKER["load_balancing_loss"]["values"]
            graphs = [capture(lambda layer=layer, x=x: layer(x), device=device, warmups=0,
                              static={"hidden_states": x}, state={"aux_losses_tracker_values": values},
                              owner="TE make_graphed_callables (MoE layer)")
                      for layer, x in zip(layers, static_x)]
            clear_aux_losses_tracker()            # warmup/capture contributions are not logged
        for it in range(ITERS):
            for mb in range(NUM_MICROBATCHES):
                h = data[it][mb]
                for i, layer in enumerate(layers):
                    if graphed:
                        static_x[i].copy_(h)
                        h = replay(*graphs[i], size=1).clone()
                    else:
                        h = layer(h)
                outs.append(h)
            # the other TP rank's tracker for this iteration (its shard, same layers)
            peer_vals = torch.zeros(NUM_LAYERS, device=device)
            for mb in range(NUM_MICROBATCHES):
                h = peer[it][mb]
                for i, layer in enumerate(layers):
                    _, loss = layer.router.forward(h, save=False)
                    peer_vals[i] += loss
                    h = layer(h, save=False)
            group.peer_values["load_balancing_loss"] = peer_vals
            track_moe_metrics(1.0 / NUM_MICROBATCHES, total_loss_dict)
        return outs + total_loss_dict["load_balancing_loss"]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: train(True), lambda: train(False))
