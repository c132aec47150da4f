"""CUDA-graph capture advances the prefill node's step signal: the cache messager sends the wrong step's KV.

Upstream: https://github.com/PaddlePaddle/FastDeploy/pull/4235 ("[BugFix] fix the bug for prefilled_step_idx
signal of cache_messager in cudagraph and PD"; cherry-picked as #4252).
Symptom: prefill/decode disaggregation with CUDA graphs: some queries generate over-long, wrong output
(and QPS drops from the cache swapping that follows); without CUDA graphs the same load is fine
(FastDeploy 2.2, Sept 2025).
Mechanism: the prefill node's cache messager sends each prefill step's KV cache to the decode node when
the shared signal ``prefilled_step_idx`` names that step; the attention backend advances the signal in
``init_attention_metadata``. Capturing the CUDA graphs at startup initialises the attention backend for
every warmup and capture run, so the signal starts several steps ahead of the engine's steps (without
graphs it starts at -1). The messager then sends the blocks of a step that has not run yet, and never the
blocks of the step that has: the decode node decodes from KV that is not the prompt's.
Doctor: persistent-mutation, at ``init_attention_metadata`` (the signal update run by the warmup and
capture runs).
Fix (upstream): reset the signal (``step_shm_value.value[0] = -1``) once the graphs are captured, so graph
and eager modes start the messager from the same step.
"""
from __future__ import annotations

import numpy as np
import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/PaddlePaddle/FastDeploy/pull/4235"
FAMILY = "persistent-buffer mutation"
KIND = "persistent-mutation"
SITE = "init_attention_metadata"
SYMPTOM = "the decode node receives another step's (unwritten) KV blocks: wrong, over-long generations"
VOCAB, DIM, BLOCK = 10, 4, 2
CAPTURE_SIZES = (2, 1)
SLOTS = 8 * BLOCK                      # blocks 0..6 for requests, block 7 for the dummy runs


class Model:
    def __init__(self, device):
        gen = generator(4235)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq, self.wk, self.wv = (randn(DIM, DIM, gen=gen, device=device, scale=0.5) for _ in range(3))
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)


class AppendAttentionBackend:
    def __init__(self, prefilled_step_signal: np.ndarray):
        self.prefilled_step_signal = prefilled_step_signal     # IPCSignal shared with the cache messager

    def init_attention_metadata(self, forward_meta):
        forward_meta["attn_ready"] = True
        # PD per-query mode: this forward is the next prefill step the cache messager may send
        self.prefilled_step_signal[0] += 1


class CacheMessager:
    """Sends a prefill task's KV blocks to the decode node once ``prefilled_step_idx`` names its step."""

    def __init__(self, signal, src, dst):
        self.signal, self.src, self.dst, self.tasks = signal, src, dst, {}

    def add_cache_task(self, step, src_blocks, dst_blocks):
        self.tasks[step] = (src_blocks, dst_blocks)

    def poll(self):
        task = self.tasks.pop(int(self.signal[0]), None)
        if task is None:
            return
        for s, d in zip(*task):
            for src, dst in zip(self.src, self.dst):
                dst[d * BLOCK:(d + 1) * BLOCK] = src[s * BLOCK:(s + 1) * BLOCK]


def prefill_forward(model, k_cache, v_cache, prompt, blocks, device):
    pos = torch.arange(len(prompt), device=device)
    slots = torch.tensor(blocks, device=device)[pos // BLOCK] * BLOCK + pos % BLOCK
    h = model.emb[torch.tensor(prompt, device=device)]
    k_cache[slots] = h @ model.wk
    v_cache[slots] = h @ model.wv


def decode_forward(model, k_cache, v_cache, ids, slots, ctx_slots, ctx_len):
    h = model.emb[ids]
    k_cache[slots] = h @ model.wk
    v_cache[slots] = h @ model.wv
    scores = ((h @ model.wq)[:, None, :] * k_cache[ctx_slots]).sum(-1) / DIM ** 0.5
    pos = torch.arange(ctx_slots.shape[1], device=ids.device)
    scores = scores.masked_fill(pos[None, :] >= ctx_len[:, None], float("-inf"))
    return (torch.softmax(scores, -1)[..., None] * v_cache[ctx_slots]).sum(1) @ model.lm_head


def requests():
    """Three prompts prefilled one per step on the prefill node, decoded on the decode node (same
    block ids on both nodes)."""
    return [([3, 1, 4], [0, 1]), ([1, 5], [2, 3]), ([9, 2, 6], [4, 5])]


def run(variant: str, device: str = "cpu"):
    model = Model(device)

    def serve(use_cudagraph: bool):
        signal = np.full(1, -1, dtype=np.int32)                 # splitwise_complete_prefilled_step
        p_cache = (torch.zeros(SLOTS, DIM, device=device), torch.zeros(SLOTS, DIM, device=device))
        d_cache = (torch.zeros(SLOTS, DIM, device=device), torch.zeros(SLOTS, DIM, device=device))
        backend = AppendAttentionBackend(signal)
        messager = CacheMessager(signal, p_cache, d_cache)

        # prefill node: capture_model() at startup, as every worker with use_cudagraph does
        if use_cudagraph:
            for size in CAPTURE_SIZES:
                bufs = {"ids": torch.zeros(size, dtype=torch.long, device=device),
                        "slots": torch.full((size,), SLOTS - 1, device=device),
                        "ctx_slots": torch.full((size, 3), SLOTS - 1, device=device),
                        "ctx_len": torch.ones(size, dtype=torch.long, device=device)}

                def dummy_run(bufs=bufs):
                    backend.init_attention_metadata({})
                    return decode_forward(model, *p_cache, bufs["ids"], bufs["slots"], bufs["ctx_slots"],
                                          bufs["ctx_len"])

                capture(dummy_run, device=device, static=bufs, state={"k_cache": p_cache[0], "v_cache": p_cache[1]},
                        owner="GPUModelRunner (prefill node)", name=f"size {size}")
            if variant == "fix":
                signal[0] = -1                                   # worker_process: reset after capture

        # prefill node: one prompt per step; the messager sends the finished step's blocks
        for step, (prompt, blocks) in enumerate(requests()):
            messager.add_cache_task(step, blocks, blocks)
            backend.init_attention_metadata({})
            prefill_forward(model, *p_cache, prompt, blocks, device)
            messager.poll()

        # decode node: one decode step of the three requests, from the KV it received
        ids = torch.tensor([p[-1] for p, _ in requests()], device=device)
        slots = torch.tensor([b[len(p) // BLOCK] * BLOCK + len(p) % BLOCK for p, b in requests()], device=device)
        ctx = torch.tensor([[b[i // BLOCK] * BLOCK + i % BLOCK for i in range(4)] for _, b in requests()],
                           device=device)
        ctx_len = torch.tensor([len(p) + 1 for p, _ in requests()], device=device)
        if not use_cudagraph:
            return [decode_forward(model, *d_cache, ids, slots, ctx, ctx_len)]
        bufs = {"ids": torch.zeros(3, dtype=torch.long, device=device),
                "slots": torch.full((3,), SLOTS - 1, device=device),
                "ctx_slots": torch.full((3, 4), SLOTS - 1, device=device),
                "ctx_len": torch.ones(3, dtype=torch.long, device=device)}
        g, out = capture(lambda: decode_forward(model, *d_cache, bufs["ids"], bufs["slots"], bufs["ctx_slots"],
                                                bufs["ctx_len"]),
                         device=device, static=bufs, state={"k_cache": d_cache[0], "v_cache": d_cache[1]},
                         owner="GPUModelRunner (decode node)", name="size 3")
        for name, value in (("ids", ids), ("slots", slots), ("ctx_slots", ctx), ("ctx_len", ctx_len)):
            bufs[name].copy_(value)
        return [replay(g, out).clone()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
