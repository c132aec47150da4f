"""The FULL graph is captured with ``slot_mapping[:num_reqs]``: replays write the KV of only that many tokens.

Upstream: https://github.com/vllm-project/vllm/pull/21228 ("[BugFix] Fix full cuda graph slot_mapping"),
a follow-up of https://github.com/vllm-project/vllm/pull/20466 (slot_mapping moved into
``CommonAttentionMetadata``) and https://github.com/vllm-project/vllm/pull/21196.
Symptom: V1 with ``full_cuda_graph=True`` (FA3) and ``max_num_seqs`` below the largest CUDA-graph capture
size answers with "weird output contents that may be irrelevant to the prompts"; eager, piecewise graphs, or
``max_num_seqs >= max_capture_size`` are fine (vLLM main, July 2025).
Mechanism: ``capture_model`` runs ``_dummy_run(num_tokens)`` for each capture size with
``num_reqs = min(num_tokens, max_num_reqs)`` and builds the capture-time ``CommonAttentionMetadata`` from
views of the persistent buffers. The slot mapping, a per-token array, was sliced by the request count:
``block_table.slot_mapping[:num_reqs]``. ``reshape_and_cache_flash`` takes its token count from
``slot_mapping.size(0)``, so a graph captured for more tokens than ``max_num_seqs`` writes the KV of only its
first ``num_reqs`` tokens at every replay. The runner does fill ``slot_mapping[:num_tokens]`` each step,
but the graph never reads past the captured view: the other tokens' KV is never stored, and attention (this
step's and later steps') reads whatever the cache slots held before.
Doctor: undersized-buffer, at ``_dummy_run`` (the capture-time slot mapping is shorter than the token rows
the graph serves).
Fix (upstream): ``_dummy_run`` slices the slot mapping by tokens, ``slot_mapping[:num_tokens]``.
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/21228"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "_dummy_run"
SYMPTOM = "outputs unrelated to the prompt: tokens past max_num_seqs in a FULL-graph step never store their KV"

VOCAB, DIM, BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS = 12, 4, 2, 8, 3
MAX_NUM_SEQS = 2                      # scheduler_config.max_num_seqs
CUDAGRAPH_CAPTURE_SIZES = [2, 4]      # the largest capture size exceeds max_num_seqs
MAX_NUM_TOKENS = max(CUDAGRAPH_CAPTURE_SIZES)
MAX_CTX = MAX_BLOCKS * BLOCK_SIZE
NUM_SLOTS = NUM_BLOCKS * BLOCK_SIZE   # one more row below: where the kernel's skipped (-1) slots go
PAD_SLOT_ID = -1


@dataclasses.dataclass
class CommonAttentionMetadata:
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor


class ForwardContext:
    attn_metadata: CommonAttentionMetadata | None = None


_forward_context = ForwardContext()


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping):
    """csrc/cache_kernels.cu: ``num_tokens = slot_mapping.size(0)``; slots < 0 are skipped."""
    num_tokens = slot_mapping.size(0)
    slots = torch.where(slot_mapping >= 0, slot_mapping, NUM_SLOTS)
    key_cache.index_copy_(0, slots, key[:num_tokens])
    value_cache.index_copy_(0, slots, value[:num_tokens])


def flash_attn_varlen_func(q, key_cache, value_cache, cu_seqlens_q, seqused_k, block_table):
    """Causal varlen attention over the paged cache; a token's request comes from ``cu_seqlens_q``."""
    num_reqs = seqused_k.shape[0]
    t = torch.arange(q.shape[0], device=q.device)
    req = torch.searchsorted(cu_seqlens_q[1:], t, right=True).clamp(max=num_reqs - 1)
    pos = seqused_k[req] - (cu_seqlens_q[req + 1] - t)              # the token's position in its sequence
    ctx = torch.arange(MAX_CTX, device=q.device)
    slots = block_table[req][:, ctx // BLOCK_SIZE] * BLOCK_SIZE + ctx % BLOCK_SIZE
    k, v = key_cache[slots], value_cache[slots]
    scores = (q[:, None, :] * k).sum(-1) / DIM ** 0.5
    scores = scores.masked_fill((ctx[None, :] > pos[:, None]) | (ctx[None, :] >= seqused_k[req][:, None]), -1e9)
    return (torch.softmax(scores, -1)[..., None] * v).sum(1)


class FlashAttentionImpl:
    def __init__(self, kv_cache):
        self.key_cache, self.value_cache = kv_cache

    def forward(self, query, key, value, attn_metadata: CommonAttentionMetadata):
        num_actual_tokens = attn_metadata.num_actual_tokens
        reshape_and_cache_flash(key, value, self.key_cache, self.value_cache, attn_metadata.slot_mapping)
        return flash_attn_varlen_func(query[:num_actual_tokens], self.key_cache, self.value_cache,
                                      attn_metadata.query_start_loc, attn_metadata.seq_lens,
                                      attn_metadata.block_table_tensor)


class BlockTable:
    def __init__(self, device):
        self.block_table = torch.zeros(MAX_NUM_SEQS, MAX_BLOCKS, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)

    def get_device_tensor(self):
        return self.block_table


class GPUModelRunner:
    def __init__(self, device, variant: str):
        gen = generator(21228)
        self.device, self.variant = device, variant
        self.max_num_reqs = MAX_NUM_SEQS
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos_emb = randn(MAX_CTX, DIM, gen=gen, device=device, scale=0.5)
        self.wq, self.wk, self.wv, self.wo = (randn(DIM, DIM, gen=gen, device=device, scale=0.5) for _ in range(4))
        self.kv_cache = (torch.zeros(NUM_SLOTS + 1, DIM, device=device),
                         torch.zeros(NUM_SLOTS + 1, DIM, device=device))
        self.impl = FlashAttentionImpl(self.kv_cache)
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.positions = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.query_start_loc = torch.zeros(MAX_NUM_SEQS + 1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(MAX_NUM_SEQS, dtype=torch.long, device=device)
        self.block_table = BlockTable(device)
        self.cudagraphs: dict[int, tuple] = {}

    def model(self, num_tokens: int):
        h = self.emb[self.input_ids[:num_tokens]] + self.pos_emb[self.positions[:num_tokens]]
        attn = self.impl.forward(h @ self.wq, h @ self.wk, h @ self.wv, _forward_context.attn_metadata)
        return h[:attn.shape[0]] + attn @ self.wo

    def _dummy_run(self, num_tokens: int):
        """Capture the FULL graph of ``num_tokens`` with capture-time attention metadata."""
        num_reqs = min(num_tokens, self.max_num_reqs)
        self.seq_lens[:num_reqs] = MAX_CTX                 # max_model_len at capture time
        self.seq_lens[num_reqs:] = 0
        num_scheduled_tokens = [num_tokens // num_reqs] * num_reqs
        num_scheduled_tokens[-1] += num_tokens % num_reqs
        self.query_start_loc[0] = 0
        self.query_start_loc[1:num_reqs + 1] = torch.tensor(num_scheduled_tokens, device=self.device).cumsum(0)
        if self.variant == "bug":
            slot_mapping = self.block_table.slot_mapping[:num_reqs]
        else:
            slot_mapping = self.block_table.slot_mapping[:num_tokens]
        _forward_context.attn_metadata = CommonAttentionMetadata(
            query_start_loc=self.query_start_loc[:num_reqs + 1], seq_lens=self.seq_lens[:num_reqs],
            num_reqs=num_reqs, num_actual_tokens=num_tokens,
            block_table_tensor=self.block_table.get_device_tensor()[:num_reqs], slot_mapping=slot_mapping)
        self.block_table.slot_mapping.fill_(PAD_SLOT_ID)
        try:
            self.cudagraphs[num_tokens] = capture(
                lambda: self.model(num_tokens), device=self.device, name=f"FULL {num_tokens}",
                static={"input_ids": self.input_ids, "positions": self.positions,
                        "query_start_loc": self.query_start_loc, "seq_lens": self.seq_lens,
                        "block_table": self.block_table.block_table, "slot_mapping": self.block_table.slot_mapping},
                state={"key_cache": self.kv_cache[0], "value_cache": self.kv_cache[1]},
                owner="GPUModelRunner (full_cuda_graph)")
        finally:
            _forward_context.attn_metadata = None

    def capture_model(self):
        for num_tokens in reversed(CUDAGRAPH_CAPTURE_SIZES):
            self._dummy_run(num_tokens)

    def execute_model(self, reqs, enforce_eager: bool):
        """``reqs``: (blocks, first position, token ids) per request scheduled this step."""
        num_reqs = len(reqs)
        ids, pos, slots, qsl, seq_lens = [], [], [], [0], []
        for i, (blocks, start, toks) in enumerate(reqs):
            self.block_table.block_table[i].zero_()
            self.block_table.block_table[i, :len(blocks)] = torch.tensor(blocks, device=self.device)
            for j, tok in enumerate(toks):
                p = start + j
                ids.append(tok)
                pos.append(p)
                slots.append(blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
            qsl.append(qsl[-1] + len(toks))
            seq_lens.append(start + len(toks))
        n = len(ids)
        num_input_tokens = n if enforce_eager else next(s for s in CUDAGRAPH_CAPTURE_SIZES if s >= n)
        self.input_ids[:n] = torch.tensor(ids, device=self.device)
        self.input_ids[n:].zero_()
        self.positions[:n] = torch.tensor(pos, device=self.device)
        self.positions[n:].zero_()
        self.block_table.slot_mapping[:n] = torch.tensor(slots, device=self.device)
        self.block_table.slot_mapping[n:].fill_(PAD_SLOT_ID)          # #21196: -1 for padded tokens
        self.query_start_loc[:num_reqs + 1] = torch.tensor(qsl, device=self.device)
        self.query_start_loc[num_reqs + 1:] = num_input_tokens
        self.seq_lens[:num_reqs] = torch.tensor(seq_lens, device=self.device)
        self.seq_lens[num_reqs:] = 0
        if enforce_eager:
            _forward_context.attn_metadata = CommonAttentionMetadata(
                query_start_loc=self.query_start_loc[:num_reqs + 1], seq_lens=self.seq_lens[:num_reqs],
                num_reqs=num_reqs, num_actual_tokens=n,
                block_table_tensor=self.block_table.get_device_tensor()[:num_reqs],
                slot_mapping=self.block_table.slot_mapping[:n])
            try:
                return self.model(n).clone()
            finally:
                _forward_context.attn_metadata = None
        g, out = self.cudagraphs[num_input_tokens]
        return replay(g, out, real=n, size=num_input_tokens)[:n].clone()


def run(variant: str, device: str = "cpu"):
    def serve(enforce_eager: bool):
        runner = GPUModelRunner(device, variant)
        if not enforce_eager:
            runner.capture_model()
            for cache in runner.kv_cache:
                cache.zero_()
        blocks = {"A": [1, 2, 3], "B": [4, 5, 6]}
        steps = [[(blocks["A"], 0, [3, 7, 1])],                          # A prefills 3 tokens (graph of 4)
                 [(blocks["A"], 3, [8]), (blocks["B"], 0, [2, 9])],     # A decodes, B prefills 2
                 [(blocks["A"], 4, [5]), (blocks["B"], 2, [4])]]        # both decode (graph of 2)
        return [runner.execute_model(reqs, enforce_eager) for reqs in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(False), lambda: serve(True))
