"""TokenSpeed hybrid (Mamba) decode CUDA graph: padded rows get ``mamba_pool_indices = 0``, a real slot, so every padded replay overwrites the live request that owns mamba slot 0.

Upstream: https://github.com/lightseekorg/tokenspeed/pull/506 ("fix(runtime): harden MTP decode path against NaN,
overflow, and state corruption", merged 2026-06-30, commit f6e3c51c). Read: the commit's diff of
``python/tokenspeed/runtime/execution/cuda_graph_wrapper.py`` (``CudaGraphWrapper.__call__``: ``mamba_pool_indices`` padded
with ``value=-1`` instead of ``value=0``, with the comment "Mamba slot 0 is a real allocatable slot, so padding with 0
aliases a live request's mamba state and corrupts it. -1 is the kernel-skipped pad id"), the surrounding ``__call__``
code of that commit (``seq_lens`` padded with 1, ``req_pool_indices`` padded, ``ctx.bs = padded_bs``), and the names of
its other files. Not read: the PR description/issue, and the other parts of that commit (trtllm seq-len clamps, block
table capacity clamp, mamba state reset guard), which are separate fixes and are not modelled.
Symptom: with a hybrid Mamba model and decode CUDA graphs, a request's output goes wrong (silently, no crash) whenever
another step was replayed on a padded graph while it held mamba slot 0; ``--disable-cuda-graph`` or batch sizes that are
exactly a captured size are fine.
Mechanism: ``CudaGraphWrapper.__call__`` pads a ``bs``-row decode batch to the captured ``padded_bs``; the per-request
``mamba_pool_indices`` are padded with ``torch.nn.functional.pad(..., value=0)`` and handed to the graph, whose
state-update kernel reads and writes ``ssm_state[mamba_pool_indices[i]]`` for every one of the ``padded_bs`` rows. The
padded rows therefore run the recurrence on slot 0 with their dummy token and store the result there. Slot 0 belongs
to whichever request the mamba pool gave it to; here a request whose chunked prefill is half done. Its next chunk
starts from the clobbered state.
Doctor: stale-padding, at __call__. The real request's later output depends on what the graph's padded rows hold:
their mamba slot index (0) makes the padded rows write a live request's state. The fix only changes the pad value
``__call__`` writes.
Fix (upstream): pad ``mamba_pool_indices`` (and the other mamba index inputs) with ``-1`` (``PAD_SLOT_ID``), which the
kernel skips.
Modelled: ``CudaGraphWrapper`` (capture sizes 1, 2, 4; ``_padded_bs``; static ``input_ids_buf``, ``seq_lens_buf``,
``req_pool_indices_buf``, ``mamba_pool_indices_buf``; ``__call__`` pads and replays), a ``MambaPool`` (``ssm_state`` rows
handed out from slot 0), and a one-layer recurrent model (``selective_state_update`` stand-in, LM head) with an eager
chunked-prefill path. Stand-in: the kernel's skipping of ``PAD_SLOT_ID`` rows is modelled by a spare row after the pool's
slots that no request owns (Python index -1 lands there), so a skipped row writes nowhere that anyone reads.
Workload: request A (mamba slot 0) prefills its first 3-token chunk; B, C, D (slots 1-3) prefill 2 tokens each; then
2 decode steps of B, C, D (bs=3, replayed on the bs=4 graph, 1 padded row); then A's second chunk and 2 decode steps of
A alone (bs=1). Bug: each padded replay runs the recurrence on slot 0 with the padded row's token, so A's second chunk
and all its later logits differ from eager. Fix: the padded row writes the spare row; every logit equals eager.
"""
from __future__ import annotations

import bisect

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/lightseekorg/tokenspeed/pull/506"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "__call__"
SYMPTOM = ("hybrid Mamba decode graph replayed with padding: padded rows carry mamba_pool_indices 0, a real slot, so "
           "the captured state update overwrites the mamba state of the live request in slot 0 (silent wrong output)")

VOCAB, HIDDEN, NUM_SLOTS, MAX_REQS = 16, 8, 4, 4
CAPTURE_BS = [1, 2, 4]
PAD_SLOT_ID = -1

_variant = "bug"


class MambaPool:
    def __init__(self, device):
        # NUM_SLOTS allocatable rows (slot 0 included) + one spare row: the stand-in for "the kernel skips -1".
        self.ssm_state = torch.zeros(NUM_SLOTS + 1, HIDDEN, device=device)
        self.free_slots = list(range(NUM_SLOTS))

    def alloc(self):
        return self.free_slots.pop(0)


class Model:
    def __init__(self, device):
        gen = generator(506)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale)  # noqa: E731
        self.embed = r(VOCAB, HIDDEN, scale=1.0)
        self.w_in, self.w_out = r(HIDDEN, HIDDEN, scale=0.6), r(HIDDEN, VOCAB, scale=0.7)
        self.decay = torch.sigmoid(r(HIDDEN, scale=1.0))
        self.mamba_pool = MambaPool(device)

    def selective_state_update(self, x, mamba_pool_indices):
        """One recurrence step per row on ``ssm_state[mamba_pool_indices[i]]`` (read, update, write back)."""
        state = self.mamba_pool.ssm_state
        new = self.decay * state[mamba_pool_indices] + torch.tanh(x @ self.w_in)
        state[mamba_pool_indices] = new
        return new

    def forward_step(self, input_ids, mamba_pool_indices):
        """Decode: one token per row."""
        s = self.selective_state_update(self.embed[input_ids], mamba_pool_indices)
        return s @ self.w_out

    def forward_extend(self, chunk, slot, device):
        """Eager (chunked) prefill of one request: the recurrence over the chunk, logits of its last token."""
        idx = torch.tensor([slot], device=device)
        for tok in chunk:
            logits = self.forward_step(torch.tensor([tok], device=device), idx)
        return logits


class InputBuffers:
    def __init__(self, max_bs, device):
        self.input_ids_buf = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.seq_lens_buf = torch.ones(max_bs, dtype=torch.int64, device=device)
        self.req_pool_indices_buf = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.mamba_pool_indices_buf = torch.full((max_bs,), PAD_SLOT_ID, dtype=torch.int64, device=device)


class CudaGraphWrapper:
    def __init__(self, model, device):
        self.model, self.device = model, device
        self.capture_bs, self.max_bs = CAPTURE_BS, max(CAPTURE_BS)
        self.input_buffers = InputBuffers(self.max_bs, device)
        self.graphs, self.output_buffers = {}, {}
        self.pool = graph_pool_handle(device)
        for bs in reversed(self.capture_bs):         # warm-up/capture rows all use PAD_SLOT_ID
            self.graphs[bs], self.output_buffers[bs] = self._capture_one(bs)

    def _forward_func(self, bs):
        ib = self.input_buffers
        return self.model.forward_step(ib.input_ids_buf[:bs], ib.mamba_pool_indices_buf[:bs])

    def _capture_one(self, bs):
        ib = self.input_buffers
        ib.mamba_pool_indices_buf[:bs].fill_(PAD_SLOT_ID)
        return capture(lambda: self._forward_func(bs), device=self.device, pool=self.pool, name=f"decode bs={bs}",
                       owner="CudaGraphWrapper",
                       static={"input_ids_buf": ib.input_ids_buf, "seq_lens_buf": ib.seq_lens_buf,
                               "req_pool_indices_buf": ib.req_pool_indices_buf,
                               "mamba_pool_indices_buf": ib.mamba_pool_indices_buf},
                       state={"ssm_state": self.model.mamba_pool.ssm_state})

    def _padded_bs(self, bs):
        return self.capture_bs[bisect.bisect_left(self.capture_bs, bs)]

    def can_run(self, bs):
        return bs <= self.max_bs

    def __call__(self, bs, input_ids, seq_lens, req_pool_indices, mamba_pool_indices):
        ib = self.input_buffers
        ib.input_ids_buf[:bs].copy_(input_ids)
        ib.seq_lens_buf[:bs].copy_(seq_lens)
        ib.req_pool_indices_buf[:bs].copy_(req_pool_indices)
        padded_bs = self._padded_bs(bs)
        if padded_bs != bs:
            pad = padded_bs - bs
            seq_lens = torch.nn.functional.pad(ib.seq_lens_buf[:bs], (0, pad), value=1)
            req_pool_indices = torch.nn.functional.pad(ib.req_pool_indices_buf[:bs], (0, pad), value=0)
            ib.seq_lens_buf[:padded_bs].copy_(seq_lens)
            ib.req_pool_indices_buf[:padded_bs].copy_(req_pool_indices)
            pad_value = PAD_SLOT_ID if _variant == "fix" else 0
            mamba_pool_indices = torch.nn.functional.pad(mamba_pool_indices, (0, pad), value=pad_value)
        ib.mamba_pool_indices_buf[:padded_bs].copy_(mamba_pool_indices)
        logits = replay(self.graphs[padded_bs], self.output_buffers[padded_bs], real=bs, size=padded_bs,
                        padded={"input_ids_buf": ib.input_ids_buf})
        return logits[:bs].clone()


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    prompts = {"A": [3, 11, 6, 2, 9, 14], "B": [5, 1], "C": [8, 12], "D": [0, 7]}

    def serve(use_cuda_graph: bool):
        model = Model(device)
        wrapper = CudaGraphWrapper(model, device) if use_cuda_graph else None
        slot = {rid: model.mamba_pool.alloc() for rid in "ABCD"}          # A gets slot 0
        req_row = {rid: i for i, rid in enumerate("ABCD")}
        outs, last, length = [], {}, {}

        def decode(names):
            bs = len(names)
            args = (torch.tensor([last[r] for r in names], device=device),
                    torch.tensor([length[r] + 1 for r in names], device=device),
                    torch.tensor([req_row[r] for r in names], device=device),
                    torch.tensor([slot[r] for r in names], device=device))
            if wrapper is not None and wrapper.can_run(bs):
                logits = wrapper(bs, *args)
            else:
                logits = model.forward_step(args[0], args[3])
            outs.append(logits.clone())
            for r, tok in zip(names, logits.argmax(-1).tolist()):
                last[r], length[r] = tok, length[r] + 1

        def extend(rid, chunk):
            logits = model.forward_extend(chunk, slot[rid], device)
            outs.append(logits.clone())
            last[rid], length[rid] = int(logits.argmax(-1)), length.get(rid, 0) + len(chunk)

        extend("A", prompts["A"][:3])                 # chunked prefill: first chunk
        for rid in "BCD":
            extend(rid, prompts[rid])
        decode("BCD")                                 # bs=3 -> bs=4 graph, one padded row
        decode("BCD")
        extend("A", prompts["A"][3:])                 # second chunk continues from slot 0's state
        decode("A")
        decode("A")
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
