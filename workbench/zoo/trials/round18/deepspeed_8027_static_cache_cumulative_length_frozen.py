"""Hybrid-engine rollout graphs HF ``StaticCache``: its host-side write counter is frozen at capture.

Upstream: https://github.com/deepspeedai/DeepSpeed/pull/8027 ("Add Hybrid Engine rollout in DeepSpeed to
support On-Policy Distillation (OPSD) Trainer"), fix commit 918b69043b68 ("fix(rollout): fix CUDA graph
capture producing incorrect logits").
Symptom: OPSD rollouts generated with ``use_graph_capture`` (greedy decode replayed from one CUDA graph)
give silently wrong logits: the distillation loss is ~62% higher with graph capture on than off
(DeepSpeed master, June 2026); nothing raises.
Mechanism: ``HybridEngineRollout`` captured the decode step with a transformers ``StaticCache``. Its
``StaticLayer.update()`` picks the KV write position from its own ``cumulative_length`` counter, which
it advances in Python on every call. Capture runs that Python once: the graph records the write at the
position the counter held then, and the counter's later advances never reach the graph. Every replay
writes the new token's key/value into the same captured slot (overwriting a prompt token there), while
the attention mask the runner refreshes each step opens the positions that were never written.
Doctor: host-work-frozen, at ``update`` (``StaticLayer.update``'s host counter: its value at capture is
baked into the recorded KV write).
Fix (upstream): ``DeepSpeedStaticCache``/``DeepSpeedStaticLayer`` take the write position from a shared
device tensor (``set_write_position(static_cache_position)``) that the runner fills in place before each
replay, so the captured ``index_copy_`` reads the current position at every replay.
"""
from __future__ import annotations

import math

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/deepspeedai/DeepSpeed/pull/8027"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "update"
SYMPTOM = "graph-captured greedy rollouts give wrong logits: every decode step writes KV to the capture-time slot"
VOCAB, DIM, BATCH, PROMPT_LEN, NEW_TOKENS = 12, 8, 2, 3, 4
MAX_CACHE_LEN = PROMPT_LEN + NEW_TOKENS


class StaticLayer:
    """transformers' ``StaticLayer``: a preallocated KV cache whose write position is its own counter."""

    def __init__(self, max_cache_len):
        self.max_cache_len = max_cache_len
        self.keys = self.values = None
        self.cumulative_length = 0

    def lazy_initialization(self, key_states, value_states):
        self.keys = torch.zeros(key_states.shape[0], self.max_cache_len, key_states.shape[-1],
                                dtype=key_states.dtype, device=key_states.device)
        self.values = torch.zeros_like(self.keys)

    def update(self, key_states, value_states):
        if self.keys is None:
            self.lazy_initialization(key_states, value_states)
        kv_length = key_states.shape[-2]
        cache_position = torch.arange(kv_length, device=key_states.device) + self.cumulative_length
        self.cumulative_length += kv_length                # advances on the host: a capture sees it once
        self.keys.index_copy_(1, cache_position, key_states)
        self.values.index_copy_(1, cache_position, value_states)
        return self.keys, self.values


class DeepSpeedStaticLayer(StaticLayer):
    """The fix: the write position is a shared device tensor the caller updates before each replay."""

    def __init__(self, max_cache_len):
        super().__init__(max_cache_len)
        self._write_position = None

    def set_write_position(self, pos):
        self._write_position = pos

    def update(self, key_states, value_states):
        if self.keys is None:
            self.lazy_initialization(key_states, value_states)
        kv_length = key_states.shape[-2]
        cache_position = torch.arange(kv_length, device=key_states.device) + self._write_position
        self.keys.index_copy_(1, cache_position, key_states)
        self.values.index_copy_(1, cache_position, value_states)
        return self.keys, self.values


class StudentModel:
    """A one-layer decoder standing in for the student: embeddings, one attention block, tied LM head."""

    def __init__(self, device):
        gen = generator(8027)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos = randn(MAX_CACHE_LEN, DIM, gen=gen, device=device, scale=0.5)
        self.wq, self.wk, self.wv, self.wo = (randn(DIM, DIM, gen=gen, device=device, scale=0.5) for _ in range(4))

    def forward(self, input_ids, position_ids, attention_mask, cache):
        h = self.embed[input_ids] + self.pos[position_ids]                       # [B, T, D]
        keys, values = cache.update(h @ self.wk, h @ self.wv)                    # [B, L, D]
        scores = (h @ self.wq) @ keys.transpose(1, 2) / math.sqrt(DIM)           # [B, T, L]
        scores = scores.masked_fill(attention_mask[:, None, :] == 0, float("-inf"))
        out = torch.softmax(scores, -1) @ values
        return (h + out @ self.wo) @ self.embed.t()                              # logits [B, T, V]


def make_cache(variant):
    return StaticLayer(MAX_CACHE_LEN) if variant == "bug" else DeepSpeedStaticLayer(MAX_CACHE_LEN)


def run(variant: str, device: str = "cpu"):
    model = StudentModel(device)
    prompt_ids = torch.randint(1, VOCAB, (BATCH, PROMPT_LEN), generator=generator(1)).to(device)
    prompt_pos = torch.arange(PROMPT_LEN, device=device).expand(BATCH, PROMPT_LEN)

    def prefill(cache, write_position=None):
        if write_position is not None:
            cache.set_write_position(write_position)          # prefill writes from position 0
        mask = torch.zeros(BATCH, MAX_CACHE_LEN, dtype=torch.long, device=device)
        mask[:, :PROMPT_LEN] = 1
        logits = model.forward(prompt_ids, prompt_pos, mask, cache)
        return logits[:, -1].argmax(-1, keepdim=True)

    def eager():
        """Graph capture off: the same greedy decode, run step by step."""
        cache = make_cache(variant)
        pos = torch.zeros(1, dtype=torch.long, device=device)
        next_tok = prefill(cache, pos if variant == "fix" else None)
        attn_mask = torch.zeros(BATCH, MAX_CACHE_LEN, dtype=torch.long, device=device)
        attn_mask[:, :PROMPT_LEN] = 1
        outs = []
        for t in range(NEW_TOKENS):
            p = PROMPT_LEN + t
            pos.fill_(p)
            attn_mask[:, p] = 1
            logits = model.forward(next_tok, pos.expand(BATCH, 1), attn_mask, cache)[:, -1]
            outs.append(logits)
            next_tok = logits.argmax(-1, keepdim=True)
        return outs

    def served():
        """``HybridEngineRollout._generate_graph``: capture one decode step, replay it per token."""
        cache = make_cache(variant)
        static_input_ids = torch.zeros(BATCH, 1, dtype=torch.long, device=device)
        static_cache_position = torch.zeros(1, dtype=torch.long, device=device)
        static_attn_mask = torch.zeros(BATCH, MAX_CACHE_LEN, dtype=torch.long, device=device)
        if variant == "fix":
            cache.set_write_position(static_cache_position)
        # Initialize the static cache with a dummy forward (the warmup), then capture the decode step.
        g, logits = capture(lambda: model.forward(static_input_ids, static_cache_position.expand(BATCH, 1),
                                                  static_attn_mask, cache)[:, -1],
                            device=device, static={"input_ids": static_input_ids,
                                                   "cache_position": static_cache_position,
                                                   "attention_mask": static_attn_mask},
                            owner="HybridEngineRollout (decode graph)")
        events.persistent_state("HybridEngineRollout (decode graph)", {"keys": cache.keys, "values": cache.values})
        # Restore the cache with the prompt's KV (a separate prefill forward, copied in place).
        prefill_cache = make_cache(variant)
        next_tok = prefill(prefill_cache, torch.zeros(1, dtype=torch.long, device=device) if variant == "fix" else None)
        cache.keys.zero_().copy_(prefill_cache.keys)
        cache.values.zero_().copy_(prefill_cache.values)
        static_attn_mask[:, :PROMPT_LEN] = 1
        outs = []
        for t in range(NEW_TOKENS):
            p = PROMPT_LEN + t
            static_input_ids.copy_(next_tok)
            static_cache_position.fill_(p)
            static_attn_mask[:, p] = 1
            step_logits = replay(g, logits).clone()
            outs.append(step_logits)
            next_tok = step_logits.argmax(-1, keepdim=True)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
