"""AutoDeploy overlap correction sized for the padded batch: CUDA-graph dummies make the step fail.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/12745 ("[#12633][feat] AutoDeploy: Support
torch-cudagraph for Eagle"), the ``SequenceInfo.offset_with_new_lens_`` fix in it (review thread on
``attention_interface.py``: "the combination of CUDA graph dummy requests with the overlap scheduler
correction").
Symptom: AutoDeploy with the overlap scheduler, speculative decoding (Eagle) and the torch-cudagraph backend
failed on decode/verify steps whose batch was padded to a captured batch size; exact-size batches and the
eager backend ran (TensorRT-LLM main, April 2026).
Mechanism: under the overlap scheduler step N's batch is laid out before step N-1's accepted-token counts
reach the host, so ``SequenceInfo.offset_with_new_lens_`` corrects positions (and cache lengths) on the
device afterwards: ``increment[num_prefill:] = new_lens_ungathered[gather_slot_idx] - 1``. For a CUDA graph
the batch is padded to the captured size with dummy sequences, appended after the real ones, so
``self.num_sequences`` counts them; ``_gather_slot_idx`` (truncated to its active length) lists only the
real overlap-carried sequences. The slice written is sized for the padded batch, the values for the real
one, and the assignment cannot broadcast: every padded step raises.
Doctor: padded-shape-mismatch, at ``offset_with_new_lens_`` (a tensor over the padded sequences is combined
with one over the real sequences).
Fix (upstream): write only ``increment[num_prefill : num_prefill + num_overlap]`` with ``num_overlap =
gather_slot_idx.numel()``; the trailing dummies keep a zero increment.
(Eagle verify of a one-step toy: ``1 + max_draft_len`` tokens per sequence, position embeddings only; the
pre-fix failure is the shape error the slice sizes imply.)
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/12745"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "offset_with_new_lens_"
SYMPTOM = "overlap position correction over the padded batch cannot take the real sequences' new lengths"
VOCAB, DIM, MAX_POS, MAX_DRAFT_LEN, MAX_SLOTS = 11, 4, 32, 1, 8
TOKENS = 1 + MAX_DRAFT_LEN
CUDA_GRAPH_BATCH_SIZES = (2, 4)
# Per step: (slot, host-laid-out input_pos, tokens) of each real sequence, and the previous step's new
# lengths (1 + accepted drafts) per slot, known only on the device.
STEPS = [
    ([(3, 5, [1, 4]), (5, 7, [2, 9]), (6, 4, [7, 7])], [0, 0, 0, 2, 0, 1, 2, 0]),
    ([(3, 7, [6, 3]), (5, 8, [5, 1]), (6, 6, [2, 8])], [0, 0, 0, 1, 0, 2, 2, 0]),
    ([(3, 8, [9, 9]), (5, 10, [3, 4])], [0, 0, 0, 2, 0, 2, 0, 0]),
]


class SequenceInfo:
    """AutoDeploy's batch description: device buffers sized for the largest batch, ``num_sequences`` active."""

    def __init__(self, max_num_sequences, device, variant):
        self.device, self.variant = device, variant
        self.input_ids = torch.zeros(max_num_sequences, TOKENS, dtype=torch.long, device=device)
        self.input_pos = torch.zeros(max_num_sequences, dtype=torch.int32, device=device)
        self._gather_slot_idx = torch.zeros(max_num_sequences, dtype=torch.long, device=device)
        self._active = {"_gather_slot_idx": 0}
        self.num_sequences = 0
        self.num_prefill = 0

    def get_arg(self, name, truncate=False):
        buf = getattr(self, name)
        return buf[: self._active[name]] if truncate else buf

    def nest_sequences(self, input_ids, input_pos, gather_slot_idx, num_dummies=0):
        """Lay out one step: the real (overlap-carried) sequences first, then CUDA-graph dummies."""
        n = len(input_ids)
        self.num_sequences = n + num_dummies
        self.input_ids[:n].copy_(torch.tensor(input_ids))
        self.input_pos[:n].copy_(torch.tensor(input_pos, dtype=torch.int32))
        self.input_ids[n:self.num_sequences].zero_()
        self.input_pos[n:self.num_sequences].zero_()
        self._gather_slot_idx[:n].copy_(torch.tensor(gather_slot_idx))
        self._active["_gather_slot_idx"] = n

    def offset_with_new_lens_(self, new_lens_ungathered):
        """Offset the position of non-prefill sequences by the previous step's new token lengths."""
        increment = torch.zeros(self.num_sequences, dtype=torch.int32, device=self.device)
        num_prefill = self.num_prefill
        gather_slot_idx = self.get_arg("_gather_slot_idx", truncate=True)
        if self.variant == "bug":
            increment[num_prefill:] = new_lens_ungathered[gather_slot_idx] - 1
        else:
            num_overlap = gather_slot_idx.numel()
            increment[num_prefill:num_prefill + num_overlap] = new_lens_ungathered[gather_slot_idx] - 1
        self.offset_pos_and_cache_(increment)

    def offset_pos_and_cache_(self, increment):
        self.input_pos[: self.num_sequences] += increment


class EagleTargetModel:
    def __init__(self, device):
        gen = generator(12745)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos_embed = randn(MAX_POS, DIM, gen=gen, device=device, scale=0.7)
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device)

    def forward(self, input_ids, input_pos):
        position_ids = input_pos.long()[:, None] + torch.arange(TOKENS, device=input_pos.device)[None, :]
        h = self.embed[input_ids] + self.pos_embed[position_ids]
        return torch.tanh(h) @ self.lm_head


def run(variant: str, device: str = "cpu"):
    model = EagleTargetModel(device)

    def eager():
        seq_info = SequenceInfo(max(CUDA_GRAPH_BATCH_SIZES), device, variant)
        outs = []
        for seqs, new_lens in STEPS:
            seq_info.nest_sequences([s[2] for s in seqs], [s[1] for s in seqs], [s[0] for s in seqs])
            seq_info.offset_with_new_lens_(torch.tensor(new_lens, dtype=torch.int32, device=device))
            n = seq_info.num_sequences
            outs.append(model.forward(seq_info.input_ids[:n], seq_info.input_pos[:n]))
        return outs

    def served():
        seq_info = SequenceInfo(max(CUDA_GRAPH_BATCH_SIZES), device, variant)
        graphs = {}
        for bs in reversed(CUDA_GRAPH_BATCH_SIZES):
            graphs[bs] = capture(lambda bs=bs: model.forward(seq_info.input_ids[:bs], seq_info.input_pos[:bs]),
                                 device=device, name=f"bs {bs}",
                                 static={"input_ids": seq_info.input_ids, "input_pos": seq_info.input_pos},
                                 owner="AutoDeploy torch-cudagraph (SequenceInfo)")
        outs = []
        for seqs, new_lens in STEPS:
            real = len(seqs)
            bs = min(b for b in CUDA_GRAPH_BATCH_SIZES if b >= real)
            seq_info.nest_sequences([s[2] for s in seqs], [s[1] for s in seqs], [s[0] for s in seqs],
                                    num_dummies=bs - real)
            seq_info.offset_with_new_lens_(torch.tensor(new_lens, dtype=torch.int32, device=device))
            g, out = graphs[bs]
            outs.append(replay(g, out, real=real, size=bs)[:real].clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
