"""A FULL decode graph's padded tokens write their keys through slot-mapping entries an earlier step left.

Upstream: https://github.com/vllm-project/vllm/pull/21196 ("[BugFix] Fix potential cuda-graph IMA"), a
follow-up to https://github.com/vllm-project/vllm/pull/20466.
Symptom: with FULL CUDA graphs (``compilation_config.full_cuda_graph``), padded decode batches could write
the KV of padded tokens into cache slots owned by live requests (silent KV corruption) or out of range
(illegal memory access); reported as preventative by the author after #20466 changed how the persistent
``slot_mapping`` buffer is filled (vLLM V1, July 2025).
Mechanism: ``_prepare_inputs`` writes this step's slots into ``slot_mapping[:total_num_scheduled_tokens]``
of the block table's persistent buffer; CUDA-graph padding is decided afterwards. A FULL graph captured
for ``N`` tokens bakes a view ``slot_mapping[:N]`` into ``reshape_and_cache_flash``, so a batch of ``n < N``
tokens also writes the keys of its ``N - n`` padded tokens, at the slots that the tail of the buffer still
holds from an earlier, larger step. When such a slot now belongs to another request (its block was freed
and reallocated), that request's cached key is overwritten by a padded token's key.
Doctor: stale-padding, at ``reshape_and_cache_flash`` (the cache write through padded rows' stale slots).
Fix (upstream): fill the unused tail of ``slot_mapping`` with ``-1`` (``PAD_SLOT_ID``) after computing the
step's slots, so the cache kernel skips every padded token.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/21196"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "reshape_and_cache_flash"
SYMPTOM = "padded decode tokens overwrite a reallocated block's cached key (KV corruption / IMA upstream)"

VOCAB, DIM, BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS = 16, 4, 2, 8, 2
SIZE = 4                                   # the one FULL decode capture size (tokens = requests)
MAX_NUM_TOKENS = SIZE
NULL_BLOCK, PAD_SLOT_ID = 0, -1


class Model:
    def __init__(self, device):
        gen = generator(21196)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.wk = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.wo = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.ctx_pos = torch.arange(MAX_BLOCKS * BLOCK_SIZE, device=device)


def reshape_and_cache_flash(key, kv_cache, slot_mapping):
    """One cache write per slot-mapping entry (the kernel's token count is the mapping's length);
    ``PAD_SLOT_ID`` entries are skipped (they rewrite the null slot 0 with what it holds)."""
    valid = slot_mapping >= 0
    slots = slot_mapping.clamp(min=0)
    kv_cache[slots] = torch.where(valid[:, None], key, kv_cache[slots])


def unified_attention(model, query, kv_cache, block_table, seq_lens):
    """Each row attends over its request's cached keys (values = keys) up to ``seq_lens``."""
    pos = model.ctx_pos
    slots = block_table[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    k = kv_cache[slots]                                              # [rows, ctx, DIM]
    scores = (k @ query[:, :, None]).squeeze(-1)
    scores = scores.masked_fill(pos[None, :] >= seq_lens[:, None], -1e9)
    return (torch.softmax(scores, -1)[:, :, None] * k).sum(1)


def forward(model, kv_cache, input_ids, slot_mapping, block_table, seq_lens):
    h = model.emb[input_ids]
    reshape_and_cache_flash(h @ model.wk, kv_cache, slot_mapping)
    return unified_attention(model, h @ model.wq, kv_cache, block_table, seq_lens) @ model.wo


class GPUModelRunner:
    def __init__(self, model, device, variant, graphed):
        self.model, self.device, self.variant, self.graphed = model, device, variant, graphed
        self.kv_cache = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, DIM, device=device)
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((MAX_NUM_TOKENS,), PAD_SLOT_ID, dtype=torch.long, device=device)
        self.block_table = torch.zeros(MAX_NUM_TOKENS, MAX_BLOCKS, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        if graphed:
            self.graph, self.out = capture(
                lambda: forward(model, self.kv_cache, self.input_ids[:SIZE], self.slot_mapping[:SIZE],
                                self.block_table[:SIZE], self.seq_lens[:SIZE]),
                device=device, owner="GPUModelRunner (FULL decode graph)",
                static={"input_ids": self.input_ids, "slot_mapping": self.slot_mapping,
                        "block_table": self.block_table, "seq_lens": self.seq_lens},
                state={"kv_cache": self.kv_cache})

    def _prepare_inputs(self, tokens):
        """``tokens``: (token id, position, the request's block ids), one per scheduled token."""
        n = len(tokens)
        t = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        self.input_ids[:n].copy_(t([tok for tok, _, _ in tokens]))
        blocks = [b + [NULL_BLOCK] * (MAX_BLOCKS - len(b)) for _, _, b in tokens]
        self.block_table[:n].copy_(t(blocks))
        self.seq_lens[:n].copy_(t([pos + 1 for _, pos, _ in tokens]))
        self.slot_mapping[:n].copy_(t([b[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
                                       for _, pos, b in tokens]))
        if self.variant == "fix":
            # Fill unused with -1. Needed for reshape_and_cache in full cuda graph mode.
            self.slot_mapping[n:].fill_(PAD_SLOT_ID)
        self.block_table[n:].fill_(NULL_BLOCK)          # padded requests: no context
        self.seq_lens[n:].fill_(0)
        return n

    def execute_model(self, tokens, uniform_decode):
        n = self._prepare_inputs(tokens)
        if not (self.graphed and uniform_decode):       # FULL_DECODE_ONLY: prefills run eagerly
            return forward(self.model, self.kv_cache, self.input_ids[:n], self.slot_mapping[:n],
                           self.block_table[:n], self.seq_lens[:n]).clone()
        padded = {"input_ids": self.input_ids}
        if self.variant == "bug":
            padded["slot_mapping"] = self.slot_mapping  # its padded rows were left as they were
        return replay(self.graph, self.out, real=n, size=SIZE, padded=padded)[:n].clone()


def run(variant: str, device: str = "cpu"):
    model = Model(device)

    def serve(graphed: bool):
        runner = GPUModelRunner(model, device, variant, graphed)
        A, B, C, D, E = [1, 6], [2, 7], [3], [4], [4, 5]   # block ids; E reuses D's freed block 4
        outs = []
        # Prefill A..D (one prompt token each), then one uniform decode step of the four.
        outs.append(runner.execute_model([(3, 0, A), (5, 0, B), (7, 0, C), (9, 0, D)], uniform_decode=False))
        outs.append(runner.execute_model([(11, 1, A), (12, 1, B), (13, 1, C), (14, 1, D)], uniform_decode=True))
        # C and D finish; their blocks are freed. E (two prompt tokens) gets block 4 (D's) and 5.
        outs.append(runner.execute_model([(2, 0, E), (8, 1, E)], uniform_decode=False))
        # A, B, E decode: 3 requests padded to the size-4 graph.
        outs.append(runner.execute_model([(6, 2, A), (10, 2, B), (15, 2, E)], uniform_decode=True))
        outs.append(runner.execute_model([(1, 3, A), (4, 3, B), (0, 3, E)], uniform_decode=True))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
