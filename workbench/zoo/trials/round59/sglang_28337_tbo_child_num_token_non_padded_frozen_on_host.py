"""TBO decode graphs mask padded tokens with the capture-time child token counts: the count buffer lives on the host.

Upstream: https://github.com/sgl-project/sglang/pull/28337 ("[AMD][bugfix] Place TBO cuda-graph
num_token_non_padded buffer on model devices").
Symptom: the PR says the plugin's CPU buffer "becomes the child's num_token_non_padded and is compared against"
device tensors during TBO cuda-graph replay, against the ``ForwardBatch`` device contract (eager TBO children carry
a device count). By mechanism: a replayed TBO decode graph of a partly filled bucket does not mask the routes of its
padded tokens, so filler rows are counted as expert traffic (the expert-distribution counts that EPLB rebalances on
drift from eager) and dispatched as real tokens.
Mechanism: ``TboCudaGraphRunnerPlugin.__init__`` made ``self._tbo_children_num_token_non_padded =
torch.zeros((2,), dtype=torch.int32)``: no device, so a host tensor. ``capture_one_batch_size`` (run before each
bucket's capture) fills it in place with ``compute_tbo_children_num_token_non_padded(batch)`` (the capture batch is
full: split ``bs // 2`` and ``bs - bs // 2``) and ``TboForwardBatchPreparer.prepare_raw`` unpacks it into two 0-d host
views that ``filter_batch`` stores as each child's ``num_token_non_padded``. Inside the capture, ``select_experts``
-> ``_mask_topk_ids_padded_region`` compares device token indices with that 0-d host tensor: a CUDA kernel takes it
by value, so the graph holds the capture-time count as a constant. Before every replay ``replay_prepare`` writes the
step's real split counts into the same host buffer, which no kernel of the graph reads; so each replay masks from
the capture-time count (nothing, the bucket being full at capture), and the padded rows' routes stay live:
``_SelectExpertsSinglePassGatherer.on_select_experts`` counts them. Eager TBO runs the real tokens only, with device
counts from ``compute_tbo_children_num_token_non_padded_raw``.
Doctor: host-work-frozen, at ``_mask_topk_ids_padded_region`` (the captured comparison consumes a 0-d host tensor:
its value at capture is baked into the graph, so the per-replay host refresh never reaches the kernel).
Fix (upstream): allocate the buffer on the model device, ``torch.zeros((2,), dtype=torch.int32,
device=get_global_server_args().device)``: the children's counts are then device memory that the captured mask reads
at every replay, and ``replay_prepare``'s in-place write refreshes them (plus a CPU unit test of the placement).
(One MoE layer, top-2 of 4 experts, no EP; decode buckets 4 and 8, one token per sequence. The model's observable is
the real rows' MoE output and the recorder's per-expert counts; only the buffer's placement differs between variants.)
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.engine import host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/28337"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "_mask_topk_ids_padded_region"
SYMPTOM = "TBO decode graphs keep the capture-time child token counts: padded tokens' expert routes are not masked"

VOCAB, DIM, NUM_EXPERTS, TOPK = 16, 4, 4, 2
CAPTURE_BS = [4, 8]
STEPS = ([3, 9, 5, 1, 12], [7, 2, 8, 4, 11, 6, 0, 13], [10, 14, 15], [1, 4, 9, 2, 6, 3, 8])


@dataclasses.dataclass
class ForwardBatch:
    input_ids: torch.Tensor
    batch_size: int
    num_token_non_padded: torch.Tensor | None = None
    tbo_split_seq_index: int | None = None
    tbo_parent_token_range: tuple[int, int] | None = None
    tbo_children: list | None = None


class TboForwardBatchPreparer:
    @classmethod
    def prepare(cls, batch: ForwardBatch, device):
        """Eager split: the children's counts come from ``_raw``, on the device."""
        cls.prepare_raw(batch, cls.compute_tbo_children_num_token_non_padded(batch, device))

    @classmethod
    def prepare_raw(cls, batch: ForwardBatch, tbo_children_num_token_non_padded: torch.Tensor):
        split = batch.tbo_split_seq_index                     # decode: one token per sequence
        [out_num_token_non_padded_a, out_num_token_non_padded_b] = tbo_children_num_token_non_padded
        batch.tbo_children = [cls.filter_batch(batch, 0, split, out_num_token_non_padded_a),
                              cls.filter_batch(batch, split, batch.input_ids.shape[0], out_num_token_non_padded_b)]

    @classmethod
    def filter_batch(cls, batch, start_token_index, end_token_index, out_num_token_non_padded):
        return ForwardBatch(input_ids=batch.input_ids[start_token_index:end_token_index],
                            batch_size=end_token_index - start_token_index,
                            num_token_non_padded=out_num_token_non_padded,
                            tbo_parent_token_range=(start_token_index, end_token_index))

    @classmethod
    def compute_tbo_children_num_token_non_padded(cls, batch: ForwardBatch, device):
        return cls.compute_tbo_children_num_token_non_padded_raw(batch.tbo_split_seq_index, len(batch.input_ids),
                                                                 device)

    @staticmethod
    def compute_tbo_children_num_token_non_padded_raw(tbo_split_token_index, num_token_non_padded, device):
        value_a = min(tbo_split_token_index, num_token_non_padded)
        value_b = max(0, num_token_non_padded - tbo_split_token_index)
        return torch.tensor([value_a, value_b], dtype=torch.int32).to(device=device, non_blocking=True)


class TboCudaGraphRunnerPlugin:
    def __init__(self, device, variant):
        self.device = device
        if variant == "bug":       # torch.zeros((2,), dtype=torch.int32): no device, host memory
            self._tbo_children_num_token_non_padded = host(torch.zeros((2,), dtype=torch.int32), device)
        else:
            self._tbo_children_num_token_non_padded = torch.zeros((2,), dtype=torch.int32, device=device)

    def capture_one_batch_size(self, batch: ForwardBatch, num_tokens: int):
        batch.tbo_split_seq_index = num_tokens // 2           # compute_split_seq_index (decode)
        self._tbo_children_num_token_non_padded[...] = (
            TboForwardBatchPreparer.compute_tbo_children_num_token_non_padded(batch, self.device))
        TboForwardBatchPreparer.prepare_raw(batch, self._tbo_children_num_token_non_padded)

    def replay_prepare(self, bs: int, num_token_non_padded: int):
        tbo_split_token_index = bs // 2                       # compute_split_indices_for_cuda_graph_replay
        self._tbo_children_num_token_non_padded[...] = (
            TboForwardBatchPreparer.compute_tbo_children_num_token_non_padded_raw(
                tbo_split_token_index, num_token_non_padded, self.device))


class _SelectExpertsSinglePassGatherer:
    """The expert-distribution recorder (stat mode): per-layer, per-expert route counts, on the device."""

    def __init__(self, device):
        self._data = torch.zeros(1, NUM_EXPERTS, dtype=torch.int32, device=device)

    def on_select_experts(self, layer_idx: int, topk_ids: torch.Tensor):
        topk_ids = topk_ids.flatten()
        mask = topk_ids != -1
        self._data[layer_idx, :].scatter_add_(0, topk_ids.masked_fill(~mask, 0).long(), mask.int())

    def reset(self):
        self._data[...] = 0


def _mask_topk_ids_padded_region(topk_ids: torch.Tensor, num_token_non_padded: torch.Tensor | None = None):
    if num_token_non_padded is None:
        return
    indices = torch.arange(0, topk_ids.shape[0], device=topk_ids.device)
    topk_ids[indices >= num_token_non_padded, :] = -1


class DeepseekMoE:
    def __init__(self, device):
        gen = generator(28337)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.gate = randn(DIM, NUM_EXPERTS, gen=gen, device=device)
        self.experts = randn(NUM_EXPERTS, DIM, DIM, gen=gen, device=device, scale=0.5)
        self.recorder = _SelectExpertsSinglePassGatherer(device)

    def select_experts(self, h, num_token_non_padded):
        scores = torch.softmax(h @ self.gate, dim=-1)
        topk_weights, topk_ids = torch.topk(scores, TOPK, dim=-1)
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        topk_ids = topk_ids.to(torch.int32)
        _mask_topk_ids_padded_region(topk_ids, num_token_non_padded)
        self.recorder.on_select_experts(0, topk_ids)
        return topk_weights, topk_ids

    def moe(self, h, forward_batch: ForwardBatch):
        topk_weights, topk_ids = self.select_experts(h, forward_batch.num_token_non_padded)
        expert_out = torch.einsum("td,edo->teo", h, self.experts)
        picked = expert_out.gather(1, topk_ids.clamp(min=0).long()[:, :, None].expand(-1, -1, DIM))
        weights = topk_weights * (topk_ids >= 0)               # a -1 route is dispatched nowhere
        return (picked * weights[:, :, None]).sum(1)

    def forward_decode(self, forward_batch: ForwardBatch):
        h = self.embed[forward_batch.input_ids]
        parts = [self.moe(h[slice(*child.tbo_parent_token_range)], child) for child in forward_batch.tbo_children]
        return torch.cat(parts, dim=0)


def run(variant: str, device: str = "cpu"):
    model = DeepseekMoE(device)

    def eager():
        model.recorder.reset()
        outs = []
        for ids in STEPS:
            batch = ForwardBatch(input_ids=torch.tensor(ids).to(device), batch_size=len(ids),
                                 tbo_split_seq_index=len(ids) // 2)
            TboForwardBatchPreparer.prepare(batch, device)
            outs.append(model.forward_decode(batch))
        return [*outs, model.recorder._data.clone()]

    def served():
        plugin = TboCudaGraphRunnerPlugin(device, variant)
        input_ids = torch.zeros(max(CAPTURE_BS), dtype=torch.long, device=device)
        graphs = {}
        for bs in reversed(CAPTURE_BS):
            batch = ForwardBatch(input_ids=input_ids[:bs], batch_size=bs)
            plugin.capture_one_batch_size(batch, bs)
            graphs[bs] = capture(lambda batch=batch: model.forward_decode(batch), device=device,
                                 name=f"decode bs {bs} (tbo)", static={"input_ids": input_ids},
                                 state={"expert_distribution": model.recorder._data}, owner="CudaGraphRunner")
        model.recorder.reset()                                 # start_record: warmups are not traffic
        outs = []
        for ids in STEPS:
            raw_bs = len(ids)
            bs = next(b for b in CAPTURE_BS if b >= raw_bs)
            input_ids[:raw_bs].copy_(torch.tensor(ids).to(device))
            plugin.replay_prepare(bs, num_token_non_padded=raw_bs)
            g, out = graphs[bs]
            outs.append(replay(g, out, real=raw_bs, size=bs, padded={"input_ids": input_ids})[:raw_bs].clone())
        return [*outs, model.recorder._data.clone()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
