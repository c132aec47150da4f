"""Graphed MoE layers log a per-rank load-balancing loss: the tracker's reduce group, set by host code at capture, is reset.

Upstream: https://github.com/NVIDIA/Megatron-LM/issues/1494 ("[BUG] Load Balancing loss discrepancy with/without
CUDA Graphs"); fixed by commit 2b6b46b796bb8a6c5388e5abd95aad0c97eda391 (ADLR/megatron-lm!3631 "Fixes and updates
for external cudagraph"), which a maintainer named in the issue as the fix; community PR #1507 describes the same cause.
Symptom: with ``--external-cuda-graph`` (Transformer Engine ``make_graphed_callables`` over the transformer layers)
and tensor/context parallelism, the logged ``load_balancing_loss`` differs from the same run without CUDA graphs:
after the first logging step it is no longer summed over the TP x CP group (each rank logs its own partial loss).
Mechanism: ``TopKRouter.apply_load_balancing_loss`` computes the aux loss and calls
``save_to_aux_losses_tracker("load_balancing_loss", aux_loss / coeff, layer_number, num_layers,
reduce_group=sequence_partition_group)``. That function does two things: a device op
(``tracker[name]["values"][layer_number - 1] += loss.detach()``, captured, replayed every step) and host attribute
assignments (``tracker[name]["reduce_group"] = reduce_group``, ``["avg_group"] = avg_group``) that run only while
the layer is warmed up and captured. ``track_moe_metrics`` then calls ``reduce_aux_losses_tracker_across_ranks``
(all-reduce of the values over ``tracker[name]["reduce_group"]`` when it is not None) and finally
``clear_aux_losses_tracker()``, which zeroes the values *and* sets ``reduce_group``/``avg_group`` back to None.
Eagerly the next forward sets the group again; with the layer graphed the replays never do, so from the first
cleared step on the tracker has no reduce group and the TP x CP partial losses are never summed.
Here two TP ranks (sequence parallel token shards) run in lockstep in one process; ``all_reduce`` sums the
ranks' tensors. The commit also added a ``clear_aux_losses_tracker()`` right after ``cuda_graph_capture`` in
``train_step`` (to drop what warmup and capture accumulated); both variants run that training-loop clear, so
they differ only in the two reset lines of ``clear_aux_losses_tracker``.
Doctor: host-work-frozen, at ``save_to_aux_losses_tracker`` (its host assignment of ``reduce_group`` inside the
captured layer ran only at warmup/capture; replays never restore it after ``clear_aux_losses_tracker`` resets it).
Fix (upstream): ``clear_aux_losses_tracker`` only zeroes ``tracker[name]["values"]`` and keeps the
``reduce_group``/``avg_group`` recorded at capture (diff read: ``megatron/core/transformer/moe/moe_utils.py``
and the ``train_step`` hunk of ``megatron/training/training.py``).
"""
from __future__ import annotations

import contextlib

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/Megatron-LM/issues/1494"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "save_to_aux_losses_tracker"
SYMPTOM = "with CUDA graphs the logged load_balancing_loss is one TP rank's partial loss, not the TP x CP sum"
TP, TOKENS, HIDDEN, EXPERTS, TOPK, NUM_LAYERS, ITERS = 2, 6, 4, 4, 2, 2, 4
MOE_AUX_LOSS_COEFF = 1e-2

# ----------------------------------------------------------------------------- lockstep "torch.distributed"
_TRACKERS: list[dict] = [{} for _ in range(TP)]      # one _MOE_LAYER_WISE_LOGGING_TRACKER per rank
_current_rank = 0


@contextlib.contextmanager
def on_rank(rank: int):
    """Run the enclosed code as ``rank`` (the ranks of the TP x CP group run in lockstep in this process)."""
    global _current_rank
    previous, _current_rank = _current_rank, rank
    try:
        yield
    finally:
        _current_rank = previous


class ProcessGroup:
    def __init__(self, name: str, ranks: list[int]):
        self.name, self.ranks = name, ranks

    def size(self) -> int:
        return len(self.ranks)


def all_reduce(per_rank: list[torch.Tensor], group: ProcessGroup, op: str = "sum") -> None:
    """``torch.distributed.all_reduce`` issued by every rank of ``group`` (one tensor per rank), in place."""
    total = torch.stack(per_rank).sum(0)
    if op == "avg":
        total = total / group.size()
    for t in per_rank:
        t.copy_(total)


TP_CP_GROUP = ProcessGroup("tp_cp", list(range(TP)))
PIPELINE_MODEL_PARALLEL_GROUP = ProcessGroup("pp", [0])   # one pipeline stage


# ----------------------------------------------------------------------------- megatron/core/transformer/moe/moe_utils.py
def get_moe_layer_wise_logging_tracker() -> dict:
    return _TRACKERS[_current_rank]


def switch_load_balancing_loss_func(probs, tokens_per_expert, topk, moe_aux_loss_coeff, sequence_partition_group=None):
    """Lockstep form: ``probs``/``tokens_per_expert`` hold one tensor per rank; returns one aux loss per rank."""
    num_sub_sequence = 1
    if sequence_partition_group is not None:
        num_sub_sequence = sequence_partition_group.size()
        all_reduce(tokens_per_expert, group=sequence_partition_group)
    aux_losses = []
    for p, tpe in zip(probs, tokens_per_expert):
        num_tokens = p.shape[0] * num_sub_sequence
        num_experts = p.shape[1]
        aggregated_probs_per_expert = p.sum(dim=0)
        aux_losses.append(torch.sum(aggregated_probs_per_expert * tpe) * (
            num_experts * moe_aux_loss_coeff / (num_tokens * num_tokens * topk)))
    return aux_losses


def save_to_aux_losses_tracker(name, loss, layer_number, num_layers, reduce_group=None, avg_group=None):
    """Save the auxiliary loss for logging."""
    if layer_number is None:
        return
    tracker = get_moe_layer_wise_logging_tracker()
    if name not in tracker:
        tracker[name] = {}
        tracker[name]["values"] = torch.zeros(num_layers, device=loss.device)
    tracker[name]["values"][layer_number - 1] += loss.detach()   # a kernel: replayed every step
    tracker[name]["reduce_group"] = reduce_group                 # host work: runs at warmup/capture only
    tracker[name]["avg_group"] = avg_group


def clear_aux_losses_tracker(variant: str):
    """Clear the auxiliary losses."""
    for rank in range(TP):
        with on_rank(rank):
            tracker = get_moe_layer_wise_logging_tracker()
            for name in tracker:
                tracker[name]["values"].zero_()
                if variant == "bug":                    # the two lines the fix deletes
                    tracker[name]["reduce_group"] = None
                    tracker[name]["avg_group"] = None


def reduce_aux_losses_tracker_across_ranks():
    """Collect and reduce the auxiliary losses across ranks (every rank reads its own tracker's groups)."""
    for name in list(_TRACKERS[0]):
        values = [_TRACKERS[rank][name]["values"] for rank in range(TP)]
        all_reduce(values[:1], group=PIPELINE_MODEL_PARALLEL_GROUP)    # collect across PP (one stage here)
        if _TRACKERS[0][name].get("reduce_group") is not None:
            all_reduce(values, group=_TRACKERS[0][name]["reduce_group"])
        if _TRACKERS[0][name].get("avg_group") is not None:
            all_reduce(values, group=_TRACKERS[0][name]["avg_group"], op="avg")


def track_moe_metrics(variant: str, loss_scale: float = 1.0):
    """Reduce, log (rank 0's per-layer values, as ``per_layer_logging`` writes them) and clear."""
    reduce_aux_losses_tracker_across_ranks()
    logged = _TRACKERS[0]["load_balancing_loss"]["values"].float() * loss_scale
    clear_aux_losses_tracker(variant)
    return logged


# ----------------------------------------------------------------------------- megatron/core/transformer/moe/router.py
class TopKRouter:
    def __init__(self, weight: torch.Tensor, layer_number: int):
        self.weight, self.layer_number = weight, layer_number
        self.topk, self.tp_cp_group = TOPK, TP_CP_GROUP

    def compute_routing_scores_for_aux_loss(self, logits):
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        _, top_indices = torch.topk(scores, k=self.topk, dim=1)
        topk_map = torch.zeros_like(logits).int().scatter(1, top_indices, 1).bool()
        return scores, topk_map

    def apply_load_balancing_loss(self, load_balancing_loss_func):
        sequence_partition_group = None
        if self.tp_cp_group.size() > 1:
            sequence_partition_group = self.tp_cp_group
        aux_losses = load_balancing_loss_func(moe_aux_loss_coeff=MOE_AUX_LOSS_COEFF,
                                              sequence_partition_group=sequence_partition_group)
        for rank, aux_loss in enumerate(aux_losses):
            with on_rank(rank):
                save_to_aux_losses_tracker("load_balancing_loss", aux_loss / MOE_AUX_LOSS_COEFF, self.layer_number,
                                           NUM_LAYERS, reduce_group=sequence_partition_group)

    def forward(self, inputs: list[torch.Tensor]):
        """One router over the ranks' token shards; returns each rank's routing probabilities."""
        scores, maps = [], []
        for x in inputs:
            s, m = self.compute_routing_scores_for_aux_loss(x @ self.weight)
            scores.append(s)
            maps.append(m)
        self.apply_load_balancing_loss(lambda **kw: switch_load_balancing_loss_func(
            scores, [m.sum(dim=0) for m in maps], self.topk, **kw))
        return scores


class MoELayer:
    def __init__(self, router_weight, expert_weight, layer_number):
        self.router = TopKRouter(router_weight, layer_number)
        self.expert_weight = expert_weight                   # [EXPERTS, HIDDEN]: one row per expert

    def forward(self, hidden_states: list[torch.Tensor]):
        probs = self.router.forward(hidden_states)
        return [h + torch.tanh(p @ self.expert_weight) for h, p in zip(hidden_states, probs)]


def run(variant: str, device: str = "cpu"):
    gen = generator(1494)
    layers = [MoELayer(randn(HIDDEN, EXPERTS, gen=gen, device=device),
                       randn(EXPERTS, HIDDEN, gen=gen, device=device, scale=0.5), layer_number=i + 1)
              for i in range(NUM_LAYERS)]
    batches = [[randn(TOKENS, HIDDEN, gen=gen, device=device) for _ in range(TP)] for _ in range(ITERS)]

    def forward_step(shards):
        for layer in layers:
            shards = layer.forward(shards)
        return tuple(shards)

    def reset_trackers():
        for tracker in _TRACKERS:
            tracker.clear()

    def eager():
        reset_trackers()
        out = []
        for shards in batches:
            hidden = forward_step(shards)
            out += [torch.cat(hidden), track_moe_metrics(variant).clone()]
        return out

    def served():
        reset_trackers()
        static_hidden = [shard.clone() for shard in batches[0]]
        # cuda_graph_capture: make_graphed_callables warms the layers up and captures them (the host
        # assignments in save_to_aux_losses_tracker run here, and only here)
        with events.warmup():
            forward_step(static_hidden)
        g, static_out = capture(lambda: forward_step(static_hidden), device=device, warmups=0,
                                static={f"hidden_states[rank {r}]": t for r, t in enumerate(static_hidden)},
                                state={f"aux_losses_tracker[rank {r}]": _TRACKERS[r]["load_balancing_loss"]["values"]
                                       for r in range(TP)},
                                owner="external cuda graph (TE make_graphed_callables)")
        clear_aux_losses_tracker(variant)       # train_step: clear what warmup/capture accumulated
        out = []
        for shards in batches:
            for static, shard in zip(static_hidden, shards):
                static.copy_(shard)
            hidden = replay(g, static_out)
            out += [torch.cat(hidden), track_moe_metrics(variant).clone()]
        return out

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
