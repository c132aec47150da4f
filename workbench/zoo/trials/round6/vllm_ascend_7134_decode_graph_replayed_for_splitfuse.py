"""A decode-only graph is dispatched to a spec-verify batch, whose attention state takes another kernel.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/7134 ("[310P][Bugfix]: fix ngram graph replay
accuracy error", commit e5343d6e).
Symptom: on Ascend 310P with ACL graphs (FULL_DECODE_ONLY) and n-gram speculative decoding, outputs lose
accuracy: plain decode steps never enter the graph while the split-fuse (chunked-prefill) verification
steps do (vllm-ascend v0.16, March 2026).
Mechanism: the graphs are captured by a dummy run that sets the attention state to ``DecodeOnly``, so the
captured ``forward_impl`` took the paged-attention decode kernel, in which every query row attends over
its request's whole context. The dispatcher keys graphs only on a uniform query length of
``1 + num_speculative_tokens`` and never looks at the attention state: an n-gram verification batch
(``ChunkedPrefill`` state on 310P, 2 tokens per request) matches that key and replays the decode kernel,
so each draft-verification query also sees the key of the token after it. Eager split-fuse attention is
causal inside the chunk.
Doctor: warmup-divergence, at ``_determine_batch_execution_and_padding`` (the dispatch that hands a
``ChunkedPrefill`` batch to a graph whose attention branch was decided as ``DecodeOnly`` at capture).
Fix (upstream): on 310P, force eager execution for ``ChunkedPrefill``/``PrefillCacheHit`` states, and
capture and dispatch decode-only graphs with a query length of 1 (``DecodeOnly`` batches only).
"""
from __future__ import annotations

import torch

from workbench.engine import CUDAGraphMode, GraphManager, events
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/7134"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "_determine_batch_execution_and_padding"
SYMPTOM = "n-gram verification tokens attend to the draft token after them (accuracy loss on 310P)"
VOCAB, DIM, BLOCK, MAX_BLOCKS, MAX_REQS = 11, 4, 2, 4, 2
NUM_SPEC = 1                                  # n-gram speculative tokens per step
SCRATCH_BLOCK = MAX_REQS * MAX_BLOCKS         # the dummy run's padding slots
NUM_SLOTS = (SCRATCH_BLOCK + 1) * BLOCK
MAX_TOKENS = MAX_REQS * (1 + NUM_SPEC)

DECODE_ONLY, CHUNKED_PREFILL, PREFILL_CACHE_HIT = "DecodeOnly", "ChunkedPrefill", "PrefillCacheHit"


class Model:
    def __init__(self, device):
        gen = generator(7134)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos = randn(MAX_BLOCKS * BLOCK, DIM, gen=gen, device=device, scale=0.5)
        self.wq, self.wk, self.wv = (randn(DIM, DIM, gen=gen, device=device, scale=0.5) for _ in range(3))
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)


class AttentionImpl310:
    """The 310P attention backend: routes on ``attn_metadata.attn_state`` (Python, decided per call)."""

    def __init__(self, key_cache, value_cache):
        self.key_cache, self.value_cache = key_cache, value_cache

    def _gather(self, block_tables, req_idx):
        pos = torch.arange(MAX_BLOCKS * BLOCK, device=self.key_cache.device)
        slots = block_tables[req_idx][:, pos // BLOCK] * BLOCK + pos % BLOCK      # [tokens, max_len]
        return pos, self.key_cache[slots], self.value_cache[slots]

    def _attend(self, query, keys, values, visible):
        scores = (query[:, None, :] * keys).sum(-1) / DIM ** 0.5
        scores = scores.masked_fill(~visible, float("-inf"))
        return (torch.softmax(scores, -1)[..., None] * values).sum(1)

    def forward_paged_attention(self, query, md):
        """``_npu_paged_attention``: one query per sequence, attending over the sequence's whole context."""
        pos, keys, values = self._gather(md["block_tables"], md["req_idx"])
        visible = pos[None, :] < md["seq_lens"][md["req_idx"]][:, None]
        return self._attend(query, keys, values, visible)

    def forward_chunked_prefill_310(self, query, md):
        """``_npu_paged_attention_splitfuse``: causal inside the chunk of each request."""
        pos, keys, values = self._gather(md["block_tables"], md["req_idx"])
        visible = pos[None, :] <= md["positions"][:, None]
        return self._attend(query, keys, values, visible)

    def forward_impl(self, query, md):
        state = md["attn_state"]
        if state == DECODE_ONLY:
            return self.forward_paged_attention(query, md)
        if state in (CHUNKED_PREFILL, PREFILL_CACHE_HIT):
            return self.forward_chunked_prefill_310(query, md)
        raise NotImplementedError(f"AscendAttentionState: {state} is not supported for 310P currently.")


class NPUModelRunner310:
    def __init__(self, device, variant, use_graphs):
        self.device, self.variant = device, variant
        self.model = Model(device)
        self.key_cache = torch.zeros(NUM_SLOTS, DIM, device=device)
        self.value_cache = torch.zeros(NUM_SLOTS, DIM, device=device)
        self.attn = AttentionImpl310(self.key_cache, self.value_cache)
        self.bufs = {
            "input_ids": torch.zeros(MAX_TOKENS, dtype=torch.long, device=device),
            "positions": torch.zeros(MAX_TOKENS, dtype=torch.long, device=device),
            "slot_mapping": torch.zeros(MAX_TOKENS, dtype=torch.long, device=device),
            "req_idx": torch.zeros(MAX_TOKENS, dtype=torch.long, device=device),
            "seq_lens": torch.zeros(MAX_REQS, dtype=torch.long, device=device),
            "block_tables": torch.zeros(MAX_REQS, MAX_BLOCKS, dtype=torch.long, device=device),
        }
        self.attn_state = DECODE_ONLY
        # the dispatcher's query length of a uniform decode batch (310P n-gram: 1 after the fix)
        self.uniform_decode_query_len = 1 + NUM_SPEC if variant == "bug" else 1
        sizes = [n * self.uniform_decode_query_len for n in range(1, MAX_REQS + 1)]
        self.graphs = GraphManager(self.forward, sizes, device=device, name="NPUModelRunner310 ACL graphs",
                                   mode=CUDAGraphMode.FULL if use_graphs else CUDAGraphMode.NONE,
                                   static_buffers=self.bufs)

    def forward(self, num_tokens):
        """The model's forward over the first ``num_tokens`` rows of the persistent input buffers."""
        b = self.bufs
        ids, positions = b["input_ids"][:num_tokens], b["positions"][:num_tokens]
        h = self.model.emb[ids] + self.model.pos[positions]
        slots = b["slot_mapping"][:num_tokens]
        self.key_cache[slots] = h @ self.model.wk                     # reshape_and_cache
        self.value_cache[slots] = h @ self.model.wv
        md = {"attn_state": self.attn_state, "positions": positions, "req_idx": b["req_idx"][:num_tokens],
              "seq_lens": b["seq_lens"], "block_tables": b["block_tables"]}
        return self.attn.forward_impl(h @ self.model.wq, md) @ self.model.lm_head

    def capture_model(self):
        """``_dummy_run`` for each capture size: uniform decode dummy batches in the ``DecodeOnly`` state,
        writing to the scratch block."""
        q = self.uniform_decode_query_len
        events.persistent_state("NPUModelRunner310", {"key_cache": self.key_cache,
                                                      "value_cache": self.value_cache})
        b = self.bufs
        b["slot_mapping"].fill_(SCRATCH_BLOCK * BLOCK)
        b["positions"].zero_()
        b["req_idx"].copy_(torch.arange(MAX_TOKENS, device=self.device) // q)
        b["seq_lens"].fill_(1)
        b["block_tables"].fill_(SCRATCH_BLOCK)
        self.attn_state = DECODE_ONLY
        self.graphs.capture()

    def prefill(self, prompt, blocks):
        """Eager prefill: the prompt's keys and values into the request's blocks."""
        pos = torch.arange(len(prompt), device=self.device)
        slots = torch.tensor(blocks, device=self.device)[pos // BLOCK] * BLOCK + pos % BLOCK
        h = self.model.emb[torch.tensor(prompt, device=self.device)] + self.model.pos[pos]
        self.key_cache[slots] = h @ self.model.wk
        self.value_cache[slots] = h @ self.model.wv

    def _build_attn_state(self, num_scheduled_tokens):
        if all(n == 1 for n in num_scheduled_tokens):
            return DECODE_ONLY
        return CHUNKED_PREFILL          # n-gram verification: SpecDecoding is mapped to ChunkedPrefill on 310P

    def _determine_batch_execution_and_padding(self, num_tokens, num_reqs, num_scheduled_tokens):
        """The graph size this batch runs at, or ``None`` for eager (FULL_DECODE_ONLY: uniform decode only)."""
        max_q = max(num_scheduled_tokens)
        q = self.uniform_decode_query_len
        if self.variant == "fix" and self.attn_state in (CHUNKED_PREFILL, PREFILL_CACHE_HIT):
            return None                                           # force_eager
        uniform_decode = max_q == q and num_tokens == max_q * num_reqs
        return self.graphs.dispatch(num_tokens) if uniform_decode else None

    def execute_model(self, requests):
        """``requests``: per request, (tokens scheduled this step, first position, block table)."""
        ids, positions, req_idx, slots = [], [], [], []
        for r, (tokens, start, blocks) in enumerate(requests):
            for j, tok in enumerate(tokens):
                p = start + j
                ids.append(tok), positions.append(p), req_idx.append(r)
                slots.append(blocks[p // BLOCK] * BLOCK + p % BLOCK)
        num_tokens, num_reqs = len(ids), len(requests)
        num_scheduled = [len(t) for t, _, _ in requests]
        self.attn_state = self._build_attn_state(num_scheduled)
        b = self.bufs
        b["input_ids"][:num_tokens] = torch.tensor(ids, device=self.device)
        b["positions"][:num_tokens] = torch.tensor(positions, device=self.device)
        b["slot_mapping"][:num_tokens] = torch.tensor(slots, device=self.device)
        b["req_idx"][:num_tokens] = torch.tensor(req_idx, device=self.device)
        b["seq_lens"][:num_reqs] = torch.tensor([s + len(t) for t, s, _ in requests], device=self.device)
        b["block_tables"][:num_reqs] = torch.tensor([bt for _, _, bt in requests], device=self.device)
        size = self._determine_batch_execution_and_padding(num_tokens, num_reqs, num_scheduled)
        if size is None:
            return self.graphs.run_eager(num_tokens).clone()
        return self.graphs.replay(size, num_tokens).clone()


def schedule():
    """Two requests: a decode step, an n-gram verification step (last token + 1 draft), a decode step."""
    blocks = ([0, 1, 2, 3], [4, 5, 6, 7])
    prompts = ([3, 7, 2], [5, 1])
    steps = [
        [([9], 3, blocks[0]), ([4], 2, blocks[1])],
        [([6, 2], 4, blocks[0]), ([8, 8], 3, blocks[1])],
        [([1], 6, blocks[0]), ([0], 5, blocks[1])],
    ]
    return prompts, blocks, steps


def run(variant: str, device: str = "cpu"):
    prompts, blocks, steps = schedule()

    def serve(use_graphs):
        runner = NPUModelRunner310(device, variant, use_graphs)
        runner.capture_model()
        for prompt, bt in zip(prompts, blocks):
            runner.prefill(prompt, bt)
        return [runner.execute_model(step) for step in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
