"""A DP dummy run replays the FULL graph with the last real step's ``slot_mapping``: its dummy K/V land in live KV slots.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/11774 ("[BugFix][Worker] Reset slot_mapping to pad id
for dummy graph capture", commit b9acec8bc4).
Symptom: with data parallelism and FULL / FULL_DECODE_ONLY ACL graphs, a rank that has no requests while
other ranks decode runs ``_dummy_run`` steps; afterwards requests that were decoding on that rank continue with
corrupted context (garbled continuations), with no error. Eager mode is unaffected (vllm-ascend main, July 2026).
Mechanism: dummy runs do not go through ``_prepare_inputs()``, so the persistent per-KV-group
``block_table.slot_mapping`` buffer, which the captured attention's ``reshape_and_cache`` reads, keeps the slots
of the last real step. ``_dummy_run`` builds dummy attention metadata (only for FULL graphs: eager and
piecewise dummy runs build none, and their attention writes nothing) and replays the FULL graph; the replayed
``reshape_and_cache`` writes the dummy batch's K/V into those stale slots, i.e. over the cached K/V of the real
requests' latest tokens. The next real decode attends over the overwritten entries.
Doctor: stale-input, at ``_dummy_run`` (the dummy step does not refresh ``slot_mapping``; the replay reads what
the previous real step left there).
Fix (upstream): after building the dummy attention metadata (outside graph capture) fill every KV group's
``slot_mapping`` with -1 (the pad slot id, which ``reshape_and_cache`` skips).
"""
from __future__ import annotations

import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/11774"
FAMILY = "stale padded metadata"
KIND = "stale-input"
SITE = "_dummy_run"
SYMPTOM = "a DP dummy run overwrites the cached K/V of live requests' last tokens; later decodes attend to garbage"
VOCAB, DIM, NUM_SLOTS, MAX_REQS, MAX_LEN = 8, 4, 12, 2, 6
PAD_SLOT_ID = -1
SCRATCH = NUM_SLOTS                     # reshape_and_cache skips pad slots: they land in a row nobody reads


class Model:
    def __init__(self, device):
        gen = generator(11774)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq, self.wk, self.wv, self.wo = (randn(DIM, DIM, gen=gen, device=device, scale=0.6) for _ in range(4))


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
    slots = torch.where(slot_mapping < 0, torch.full_like(slot_mapping, SCRATCH), slot_mapping)
    key_cache[slots] = key
    value_cache[slots] = value


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens):
    k = key_cache[block_tables]                                 # [reqs, MAX_LEN, DIM]
    v = value_cache[block_tables]
    scores = (k @ query[:, :, None]).squeeze(-1) / math.sqrt(DIM)
    valid = torch.arange(MAX_LEN, device=query.device)[None, :] < seq_lens[:, None]
    probs = torch.softmax(scores.masked_fill(~valid, float("-inf")), -1)
    return (probs[:, :, None] * v).sum(1)


def decode_forward(model, input_ids, slot_mapping, block_tables, seq_lens, key_cache, value_cache):
    h = model.emb[input_ids]
    reshape_and_cache(h @ model.wk, h @ model.wv, key_cache, value_cache, slot_mapping)
    return paged_attention(h @ model.wq, key_cache, value_cache, block_tables, seq_lens) @ model.wo


class NPUModelRunner:
    def __init__(self, model, device, variant):
        self.model, self.device, self.variant = model, device, variant
        self.input_ids = torch.zeros(MAX_REQS, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((MAX_REQS,), PAD_SLOT_ID, dtype=torch.long, device=device)  # block_table.slot_mapping.gpu
        self.block_tables = torch.full((MAX_REQS, MAX_LEN), SCRATCH, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(MAX_REQS, dtype=torch.long, device=device)
        self.key_cache = torch.zeros(NUM_SLOTS + 1, DIM, device=device)
        self.value_cache = torch.zeros(NUM_SLOTS + 1, DIM, device=device)
        self.graph = None

    def forward(self):
        return decode_forward(self.model, self.input_ids, self.slot_mapping, self.block_tables, self.seq_lens,
                              self.key_cache, self.value_cache)

    def capture_model(self):
        self.graph = capture(self.forward, device=self.device,
                             static={"input_ids": self.input_ids, "slot_mapping": self.slot_mapping,
                                     "block_tables": self.block_tables, "seq_lens": self.seq_lens},
                             state={"key_cache": self.key_cache, "value_cache": self.value_cache},
                             owner="NPUModelRunner (FULL_DECODE_ONLY ACL graph)")
        self.key_cache.zero_()                                      # capture/profiling contents discarded
        self.value_cache.zero_()

    def _prepare_inputs(self, requests):
        """A real decode step: every request's new token, its slot and its context."""
        for i, (tok, slots) in enumerate(requests):
            self.input_ids[i] = tok
            self.slot_mapping[i] = slots[-1]
            self.block_tables[i, :len(slots)] = torch.tensor(slots, device=self.device)
            self.seq_lens[i] = len(slots)

    def execute_model(self, requests, use_graph):
        self._prepare_inputs(requests)
        if use_graph:
            g, out = self.graph
            return replay(g, out).clone()
        return self.forward().clone()

    def _dummy_run(self, num_tokens, use_graph):
        """DP padding step of an idle rank: dummy attention metadata is built only for FULL graphs."""
        if not use_graph:
            return                                                  # eager: no attn metadata, no KV writes
        self.input_ids[:num_tokens].zero_()
        self.seq_lens[:num_tokens].fill_(1)                         # seq_lens = max_query_len
        refreshed = False
        if self.variant == "fix":
            # the fix: slot_mapping is not populated by _prepare_inputs() here; reset it to the pad id
            self.slot_mapping.fill_(PAD_SLOT_ID)
            refreshed = True
        g, out = self.graph
        replay(g, out, real=0, size=num_tokens, padded={} if refreshed else {"slot_mapping": self.slot_mapping})


def run(variant: str, device: str = "cpu"):
    model = Model(device)

    def serve(use_graph: bool):
        runner = NPUModelRunner(model, device, variant)
        if use_graph:
            runner.capture_model()
        # two requests decode on this DP rank; their prompts' K/V are already cached
        a_slots, b_slots = [0, 1, 2], [6, 7]
        for slot, tok in zip(a_slots[:-1] + b_slots[:-1], [3, 5, 2]):
            h = model.emb[tok]
            runner.key_cache[slot], runner.value_cache[slot] = h @ model.wk, h @ model.wv
        outs = [runner.execute_model([(4, a_slots), (1, b_slots)], use_graph)]
        # the rank's queue drains for two steps while other DP ranks still decode: dummy runs
        runner._dummy_run(MAX_REQS, use_graph)
        runner._dummy_run(MAX_REQS, use_graph)
        a_slots, b_slots = a_slots + [3], b_slots + [8]
        outs.append(runner.execute_model([(6, a_slots), (7, b_slots)], use_graph))
        a_slots, b_slots = a_slots + [4], b_slots + [9]
        outs.append(runner.execute_model([(2, a_slots), (5, b_slots)], use_graph))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
