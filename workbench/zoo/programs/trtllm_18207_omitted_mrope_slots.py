"""A text-only batch omits its mRoPE slots: the graph reads the previous batch's.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/18207 ("Test CUDA graph input buffers status
before replay").
Symptom: with MRoPE models (Qwen-VL family) under CUDA graphs, a text-only decode batch that
follows a multimodal one decodes with the multimodal requests' position deltas (TensorRT-LLM
PyTorch backend, Sep 2026); eager is right.
Mechanism: the graph reads ``mrope_delta_read_seq_slots``, a static buffer of per-row indices into
the per-sequence delta table. The runner copied it only when the batch brought it. A text-only
batch omits it, meaning every row reads the dummy slot's permanently-zero delta; the buffer still
held the slots of the last multimodal batch, so each replay added their deltas to text positions.
Doctor: stale-input, at ``mrope_positions`` (the graph's read of the slots this step did not write).
Fix (upstream): when the batch omits the slots, fill the buffer with the dummy slot explicitly.
"""
from __future__ import annotations

import torch

from ..kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/18207"
FAMILY = "stale padded metadata"
KIND = "stale-input"
SITE = "mrope_positions"
SYMPTOM = "text-only batches decode with an earlier multimodal batch's position deltas"
ROWS, DIM, SEQ_SLOTS = 2, 4, 6
DUMMY = SEQ_SLOTS - 1                 # the dummy sequence slot: its delta is always zero


class Model:
    def __init__(self, device):
        gen = generator(18207)
        self.emb = randn(16, DIM, gen=gen, device=device)
        self.freq = torch.tensor([1.0, 0.25], device=device)
        # Per-sequence mRoPE deltas, written when a multimodal request is prefilled.
        self.deltas = torch.tensor([0, 7, -3, 11, 0, 0], device=device)


def mrope_positions(model, position_ids, read_slots):
    return position_ids + model.deltas[read_slots]


def forward(model, input_ids, position_ids, read_slots):
    x = model.emb[input_ids]
    angle = mrope_positions(model, position_ids, read_slots)[:, None].float() * model.freq
    a, b = x[:, :2], x[:, 2:]
    return torch.cat([a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()], -1)


def steps(device):
    """A multimodal batch (slots 1 and 2), a text-only batch (no slots), a multimodal batch."""
    t = lambda v: torch.tensor(v, device=device)  # noqa: E731
    return [{"input_ids": t([3, 4]), "position_ids": t([10, 12]), "read_slots": t([1, 2])},
            {"input_ids": t([5, 6]), "position_ids": t([4, 9])},
            {"input_ids": t([7, 8]), "position_ids": t([11, 13]), "read_slots": t([3, 1])}]


def run(variant: str, device: str = "cpu"):
    model = Model(device)

    def eager():
        dummy = torch.full((ROWS,), DUMMY, device=device)
        return [forward(model, s["input_ids"], s["position_ids"], s.get("read_slots", dummy)) for s in steps(device)]

    def served():
        bufs = {"input_ids": torch.ones(ROWS, dtype=torch.long, device=device),
                "position_ids": torch.zeros(ROWS, dtype=torch.long, device=device),
                "read_slots": torch.full((ROWS,), DUMMY, device=device)}
        g, out = capture(lambda: forward(model, bufs["input_ids"], bufs["position_ids"], bufs["read_slots"]),
                         device=device, static=bufs, owner="CUDA graph runner")
        outs = []
        for inputs in steps(device):
            bufs["input_ids"].copy_(inputs["input_ids"])
            bufs["position_ids"].copy_(inputs["position_ids"])
            if "read_slots" in inputs:
                bufs["read_slots"].copy_(inputs["read_slots"])
            elif variant == "fix":
                bufs["read_slots"].fill_(DUMMY)
            outs.append(replay(g, out).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
