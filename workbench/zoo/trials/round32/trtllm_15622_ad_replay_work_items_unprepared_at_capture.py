"""AutoDeploy captures the SSM-checkpoint replay path with ``replay_work_items`` never prepared for the capture batch.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/15622 ("[#15565][fix] AutoDeploy: Fix Super MTP IMA
introduced by checkpointing replay").
Symptom: Nemotron Super V3 with MTP under AutoDeploy crashed with an illegal memory access during CUDA-graph
capture once SSM checkpointing replay (``ssm_replay``) was enabled; the eager runtime path was fine.
Mechanism: every AutoDeploy attention/SSM metadata buffer is filled by host-prepare hooks that
``SequenceInfo.nest_sequences()`` runs, on the runtime path (``ADEngine._prepare_inputs``) and on the capture
path (``SequenceInfo.set_capture_batch``, which synthesises the dummy capture batch) alike. The new
``prepare_replay_metadata`` was instead a side call made only in ``ADEngine._prepare_inputs``. So
``set_capture_batch`` filled ``input_ids``/``slot_idx``/``seq_len`` for the capture batch but left
``replay_work_items`` as allocated (uninitialised memory, here a large garbage index); the warmup/capture
forward then indexed the SSM replay checkpoint buffer with it: an illegal memory access (the CPU's
out-of-range index error).
Doctor: stale-input, at ``set_capture_batch`` (the capture batch's forward reads ``replay_work_items``,
which that step never wrote).
Fix (upstream): register ``prepare_replay_metadata`` as a host-prepare hook (only when the replay buffers were
allocated), so it runs inside ``nest_sequences()`` on every path, capture included, exactly like the other
AutoDeploy metadata.
(Only the PR description was available, not the diff; names follow it. Tiny model: one SSM-like recurrent
layer with a checkpoint buffer of CHECKPOINTS rows per cache slot; decode steps all at the captured size.)
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/15622"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "set_capture_batch"
SYMPTOM = "CUDA-graph capture with SSM checkpointing replay hits an illegal memory access (replay_work_items unset)"
VOCAB, DIM, NUM_SLOTS, CHECKPOINTS, MAX_BS = 8, 4, 3, 2, 2
UNINITIALISED = 1 << 20          # what an uninitialised int64 buffer may hold: an index far past the buffer


def prepare_replay_metadata(seq_info: "SequenceInfo", bs: int) -> None:
    """Work item of each sequence: its row in the replay checkpoint buffer (slot, step modulo CHECKPOINTS)."""
    seq_info.replay_work_items[:bs].copy_(seq_info.slot_idx[:bs] * CHECKPOINTS
                                          + (seq_info.seq_len[:bs] - 1) % CHECKPOINTS)


class SequenceInfo:
    """AutoDeploy's static per-step input buffers and the host-prepare hooks that fill them."""

    def __init__(self, device, variant):
        z = lambda: torch.zeros(MAX_BS, dtype=torch.long, device=device)  # noqa: E731
        self.input_ids, self.slot_idx, self.seq_len = z(), z(), z()
        # allocated with the other ssm_replay buffers, written only by prepare_replay_metadata
        self.replay_work_items = torch.full((MAX_BS,), UNINITIALISED, dtype=torch.long, device=device)
        self._host_prepare_hooks = []
        if variant == "fix":
            self.register_host_prepare(prepare_replay_metadata)

    def register_host_prepare(self, hook) -> None:
        self._host_prepare_hooks.append(hook)

    def nest_sequences(self, input_ids, slot_idx, seq_len) -> None:
        bs = input_ids.shape[0]
        self.input_ids[:bs].copy_(input_ids)
        self.slot_idx[:bs].copy_(slot_idx)
        self.seq_len[:bs].copy_(seq_len)
        for hook in self._host_prepare_hooks:
            hook(self, bs)

    def set_capture_batch(self, bs: int) -> None:
        """The dummy capture batch: every sequence one token long, in cache slot 0."""
        device = self.input_ids.device
        ones = torch.ones(bs, dtype=torch.long, device=device)
        self.nest_sequences(ones, torch.zeros(bs, dtype=torch.long, device=device), ones)


class SSMModel:
    def __init__(self, device):
        gen = generator(15622)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.w_in = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
        self.decay = randn(DIM, gen=gen, device=device, scale=0.3).sigmoid()
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device)

    def forward(self, seq_info: SequenceInfo, ssm_state, replay_ckpt):
        x = self.embed[seq_info.input_ids]
        h = ssm_state[seq_info.slot_idx] * self.decay + torch.tanh(x @ self.w_in)
        ssm_state[seq_info.slot_idx] = h
        replay_ckpt[seq_info.replay_work_items] = h        # checkpoint for rolling back rejected drafts
        return h @ self.lm_head


class ADEngine:
    def __init__(self, model, seq_info, variant):
        self.model, self.seq_info, self.variant = model, seq_info, variant

    def _prepare_inputs(self, input_ids, slot_idx, seq_len) -> None:
        self.seq_info.nest_sequences(input_ids, slot_idx, seq_len)
        if self.variant == "bug":
            prepare_replay_metadata(self.seq_info, input_ids.shape[0])   # runtime-only side call


def run(variant: str, device: str = "cpu"):
    model = SSMModel(device)
    # Decode steps at the captured batch size: (token ids, cache slots, sequence lengths).
    steps = [([3, 5], [1, 2], [4, 6]), ([1, 7], [1, 2], [5, 7]), ([2, 6], [1, 2], [6, 8])]
    t = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731

    def caches():
        return (torch.zeros(NUM_SLOTS, DIM, device=device),
                torch.zeros(NUM_SLOTS * CHECKPOINTS, DIM, device=device))

    def eager():
        seq_info = SequenceInfo(device, variant)
        engine = ADEngine(model, seq_info, variant)
        ssm_state, replay_ckpt = caches()
        outs = []
        for ids, slots, lens in steps:
            engine._prepare_inputs(t(ids), t(slots), t(lens))
            outs.append(model.forward(seq_info, ssm_state, replay_ckpt))
        outs.append(replay_ckpt.clone())
        return outs

    def served():
        seq_info = SequenceInfo(device, variant)
        engine = ADEngine(model, seq_info, variant)
        ssm_state, replay_ckpt = caches()
        seq_info.set_capture_batch(MAX_BS)
        g, out = capture(lambda: model.forward(seq_info, ssm_state, replay_ckpt), device=device,
                         name=f"decode bs {MAX_BS}", owner="CapturedGraph",
                         static={"input_ids": seq_info.input_ids, "slot_idx": seq_info.slot_idx,
                                 "seq_len": seq_info.seq_len, "replay_work_items": seq_info.replay_work_items},
                         state={"ssm_state": ssm_state, "replay_ckpt": replay_ckpt})
        ssm_state.zero_()                        # the warmup wrote the dummy slot 0 only; start clean
        replay_ckpt.zero_()
        outs = []
        for ids, slots, lens in steps:
            engine._prepare_inputs(t(ids), t(slots), t(lens))
            outs.append(replay(g, out).clone())
        outs.append(replay_ckpt.clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
