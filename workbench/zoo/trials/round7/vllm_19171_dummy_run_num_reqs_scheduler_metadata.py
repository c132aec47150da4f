"""The capture's dummy batch claims one request per token: its FA3 scheduler metadata overflows the buffer.

Upstream: https://github.com/vllm-project/vllm/pull/19171 ("[BugFix][Minor] Fix full cuda graph bug when
max_num_seqs < 512").
Symptom: with ``full_cuda_graph`` on (FA3) and ``max_num_seqs`` below the largest capture size, engine
start-up fails while capturing: ``self.scheduler_metadata[:n].copy_(scheduler_metadata, ...)``
``RuntimeError: The size of tensor a (6) must match the size of tensor b (513) at non-singleton dimension
0`` (vLLM V1, June 2025).
Mechanism: the FA3 metadata builder keeps the AOT scheduler metadata in a persistent buffer that the
full graph reads, sized for ``max_num_reqs + 1`` entries (one per request plus a semaphore). For each
capture size, ``_dummy_run`` spreads the dummy tokens over ``min(num_tokens, max_num_reqs)`` requests but
built the attention metadata with ``num_reqs=num_tokens``. For a capture size above ``max_num_seqs`` the
scheduler metadata of that dummy batch has more entries than the buffer holds, and the copy fails.
Doctor: undersized-buffer, at ``build`` (the copy of the dummy batch's scheduler metadata into the
persistent buffer).
Fix (upstream): ``_dummy_run`` builds the metadata with ``num_reqs=num_reqs``, which is at most
``max_num_seqs``, so the dummy batch is one the scheduler could have produced.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/19171"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "build"
SYMPTOM = "start-up fails capturing the largest graph: scheduler metadata does not fit its persistent buffer"
VOCAB, HIDDEN = 12, 4
BLOCK_SIZE, MAX_BLOCKS = 2, 4
MAX_MODEL_LEN = BLOCK_SIZE * MAX_BLOCKS
NUM_BLOCKS = 9                                    # blocks 1..8 are handed out; block 0 never is
MAX_NUM_SEQS = 3                                  # max_num_reqs (5 upstream)
CUDAGRAPH_BATCH_SIZES = [1, 2, 4]                 # capture sizes in tokens (up to 512 upstream)
MAX_NUM_TOKENS = max(CUDAGRAPH_BATCH_SIZES)
KV_SPLIT_BLOCK, MAX_SPLITS = 3, 3                 # the AOT scheduler's split granularity here


def get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, cache_seqlens):
    """FA3's AOT scheduler: a tile-count semaphore, then the number of KV splits of each of the
    ``batch_size`` requests (the kernel reads ``batch_size`` entries of ``cache_seqlens``)."""
    seqlens = F.pad(cache_seqlens, (0, batch_size - cache_seqlens.shape[0]))
    num_splits = ((seqlens + KV_SPLIT_BLOCK - 1) // KV_SPLIT_BLOCK).clamp(1, MAX_SPLITS).to(torch.int32)
    return torch.cat([torch.zeros(1, dtype=torch.int32, device=cache_seqlens.device), num_splits])


class CommonAttentionMetadata:
    def __init__(self, query_start_loc, seq_lens):
        self.query_start_loc = query_start_loc
        self.seq_lens = seq_lens


class FlashAttentionMetadata:
    def __init__(self, num_actual_tokens, query_start_loc, seq_lens, block_table, slot_mapping,
                 scheduler_metadata):
        self.num_actual_tokens = num_actual_tokens
        self.query_start_loc, self.seq_lens = query_start_loc, seq_lens
        self.block_table, self.slot_mapping = block_table, slot_mapping
        self.scheduler_metadata = scheduler_metadata


class FlashAttentionMetadataBuilder:
    def __init__(self, runner, full_cuda_graph: bool):
        self.runner = runner
        self.use_full_cuda_graph = full_cuda_graph
        if self.use_full_cuda_graph:
            self.scheduler_metadata = torch.zeros(runner.max_num_reqs + 1, dtype=torch.int32, device=runner.device)

    def build(self, num_reqs, num_actual_tokens, max_query_len, common_prefix_len, common_attn_metadata):
        seq_lens = common_attn_metadata.seq_lens
        block_table_tensor = self.runner.block_table[:num_reqs]
        self.runner.slot_mapping[num_actual_tokens:].fill_(-1)
        slot_mapping = self.runner.slot_mapping[:num_actual_tokens]
        scheduler_metadata = get_scheduler_metadata(batch_size=num_reqs, max_seqlen_q=max_query_len,
                                                    max_seqlen_k=MAX_MODEL_LEN, cache_seqlens=seq_lens)
        if self.use_full_cuda_graph:
            n = scheduler_metadata.shape[0]
            self.scheduler_metadata[:n].copy_(scheduler_metadata)
            scheduler_metadata = self.scheduler_metadata[:n]
        return FlashAttentionMetadata(num_actual_tokens, common_attn_metadata.query_start_loc, seq_lens,
                                      block_table_tensor, slot_mapping, scheduler_metadata)


def flash_attn_varlen_func(q, k_cache, v_cache, md: FlashAttentionMetadata):
    """Varlen attention over the paged cache, split along KV as the scheduler metadata says, the
    splits merged by their log-sum-exp."""
    num_tokens, num_reqs = q.shape[0], md.seq_lens.shape[0]
    t = torch.arange(num_tokens, device=q.device)
    req = torch.bucketize(t, md.query_start_loc[1:], right=True).clamp(max=num_reqs - 1)
    q_len = md.query_start_loc[req + 1] - md.query_start_loc[req]
    seqlen = md.seq_lens[req]
    qpos = seqlen - q_len + (t - md.query_start_loc[req])
    p = torch.arange(MAX_MODEL_LEN, device=q.device)
    slots = md.block_table[req][:, p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE          # [T, ctx]
    mask = (p[None] <= qpos[:, None]) & (p[None] < seqlen[:, None])
    scores = (q[:, None, :] * k_cache[slots]).sum(-1) / HIDDEN ** 0.5
    num_splits = md.scheduler_metadata[1 + req]
    chunk = ((seqlen + num_splits - 1) // num_splits).clamp(min=1)
    split = (p[None] // chunk[:, None]).clamp(max=MAX_SPLITS - 1)
    in_split = mask[..., None] & (split[..., None] == torch.arange(MAX_SPLITS, device=q.device))   # [T, ctx, S]
    s = scores[..., None].masked_fill(~in_split, float("-inf"))
    smax = s.amax(1).clamp(min=-1e30)
    e = torch.exp(s - smax[:, None]) * in_split
    denom = e.sum(1)                                                                      # [T, S]
    o_split = torch.einsum("tcs,tcd->tsd", e, v_cache[slots]) / denom.clamp(min=1e-30)[..., None]
    lse = torch.where(denom > 0, torch.log(denom.clamp(min=1e-30)) + smax, float("-inf"))
    w = torch.exp(lse - lse.amax(1, keepdim=True).clamp(min=-1e30))
    return (w[..., None] * o_split).sum(1) / w.sum(1, keepdim=True).clamp(min=1e-30)


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping):
    dest = torch.where(slot_mapping >= 0, slot_mapping, key_cache.shape[0] - 1)           # -1: skipped
    key_cache.index_put_((dest,), key)
    value_cache.index_put_((dest,), value)


class Model:
    def __init__(self, device):
        gen = generator(19171)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.pos = randn(MAX_MODEL_LEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.wq, self.wk, self.wv, self.wo = (randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
                                              for _ in range(4))
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.5)

    def qkv(self, input_ids, positions):
        h = self.embed[input_ids] + self.pos[positions]
        return h, h @ self.wq, h @ self.wk, h @ self.wv

    def forward(self, input_ids, positions, kv_cache, md):
        h, q, k, v = self.qkv(input_ids, positions)
        reshape_and_cache_flash(k, v, kv_cache[0], kv_cache[1], md.slot_mapping)
        return (h + flash_attn_varlen_func(q, kv_cache[0], kv_cache[1], md) @ self.wo) @ self.lm_head


class GPUModelRunner:
    def __init__(self, model, device, full_cuda_graph: bool, fixed: bool):
        self.model, self.device, self.fixed = model, device, fixed
        self.max_num_reqs = MAX_NUM_SEQS
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.positions = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.query_start_loc = torch.zeros(self.max_num_reqs + 1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(self.max_num_reqs, dtype=torch.long, device=device)
        self.block_table = torch.zeros(self.max_num_reqs, MAX_BLOCKS, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((MAX_NUM_TOKENS,), -1, dtype=torch.long, device=device)
        # one spare row at the end of each cache: where slot -1 (padding) lands
        self.kv_cache = (torch.zeros(NUM_BLOCKS * BLOCK_SIZE + 1, HIDDEN, device=device),
                         torch.zeros(NUM_BLOCKS * BLOCK_SIZE + 1, HIDDEN, device=device))
        self.attn_metadata_builder = FlashAttentionMetadataBuilder(self, full_cuda_graph)
        self.graphs = {}

    def static_buffers(self):
        return {"input_ids": self.input_ids, "positions": self.positions, "query_start_loc": self.query_start_loc,
                "seq_lens": self.seq_lens, "block_table": self.block_table, "slot_mapping": self.slot_mapping,
                "scheduler_metadata": self.attn_metadata_builder.scheduler_metadata}

    def _dummy_run(self, num_tokens):
        """Attention metadata of the capture's dummy batch of ``num_tokens`` tokens."""
        num_reqs = min(num_tokens, self.max_num_reqs)
        query_start_loc = self.query_start_loc[:num_reqs + 1]
        self.seq_lens[:num_reqs] = MAX_MODEL_LEN          # max_model_len at graph capture time
        self.seq_lens[num_reqs:] = 0
        seq_lens = self.seq_lens[:num_reqs]
        common_attn_metadata = CommonAttentionMetadata(query_start_loc=query_start_loc, seq_lens=seq_lens)
        return self.attn_metadata_builder.build(
            num_reqs=num_reqs if self.fixed else num_tokens,
            num_actual_tokens=num_tokens, max_query_len=num_tokens, common_prefix_len=0,
            common_attn_metadata=common_attn_metadata)

    def capture_model(self):
        pool = graph_pool_handle(self.device)
        for num_tokens in reversed(CUDAGRAPH_BATCH_SIZES):
            md = self._dummy_run(num_tokens)
            fn = (lambda n=num_tokens, md=md: self.model.forward(self.input_ids[:n], self.positions[:n],
                                                                  self.kv_cache, md))
            self.graphs[num_tokens] = capture(fn, device=self.device, pool=pool, name=f"FULL {num_tokens} tokens",
                                              static=self.static_buffers(),
                                              state={"key_cache": self.kv_cache[0], "value_cache": self.kv_cache[1]},
                                              owner="GPUModelRunner")

    def execute_model(self, reqs, graphed: bool):
        """One decode step: ``reqs`` = (token, position, block ids) per request."""
        num_reqs = num_tokens = len(reqs)
        self.input_ids[:num_tokens] = torch.tensor([r[0] for r in reqs], device=self.device)
        self.positions[:num_tokens] = torch.tensor([r[1] for r in reqs], device=self.device)
        self.query_start_loc[:num_reqs + 1] = torch.arange(num_reqs + 1, device=self.device)
        self.seq_lens[:num_reqs] = self.positions[:num_tokens] + 1
        self.seq_lens[num_reqs:] = 0
        for i, (_, pos, blocks) in enumerate(reqs):
            self.block_table[i, :len(blocks)] = torch.tensor(blocks, device=self.device)
            self.slot_mapping[i] = blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        md = self.attn_metadata_builder.build(
            num_reqs=num_reqs, num_actual_tokens=num_tokens, max_query_len=1, common_prefix_len=0,
            common_attn_metadata=CommonAttentionMetadata(self.query_start_loc[:num_reqs + 1],
                                                         self.seq_lens[:num_reqs]))
        if not graphed:
            return self.model.forward(self.input_ids[:num_tokens], self.positions[:num_tokens], self.kv_cache, md)
        size = next(s for s in CUDAGRAPH_BATCH_SIZES if s >= num_tokens)
        g, out = self.graphs[size]
        return replay(g, out, real=num_tokens, size=size,
                      padded={"input_ids": self.input_ids[:size], "positions": self.positions[:size]})[:num_tokens]


def prefill(model, kv_cache, prompt, blocks):
    pos = torch.arange(len(prompt), device=kv_cache[0].device)
    _, _, k, v = model.qkv(torch.tensor(prompt, device=kv_cache[0].device), pos)
    slots = torch.tensor(blocks, device=pos.device)[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    kv_cache[0][slots] = k
    kv_cache[1][slots] = v


def requests():
    """Prompts and their blocks: A (3 tokens), B (2), C (4)."""
    return {"A": ([3, 7, 1], [1, 2, 3]), "B": ([5, 2], [4, 5]), "C": ([9, 4, 8, 6], [6, 7, 8])}


def schedule():
    """Decode steps (request, token): A, B, C; then A, C (B finished); then A alone."""
    return [[("A", 2), ("B", 11), ("C", 0)], [("A", 10), ("C", 5)], [("A", 6)]]


def run(variant: str, device: str = "cpu"):
    model = Model(device)

    def serve(graphed: bool):
        runner = GPUModelRunner(model, device, full_cuda_graph=graphed, fixed=(variant == "fix"))
        if graphed:
            runner.capture_model()                     # at start-up, before any request
        lengths = {}
        for name, (prompt, blocks) in requests().items():
            prefill(model, runner.kv_cache, prompt, blocks)
            lengths[name] = len(prompt)
        outs = []
        for step in schedule():
            reqs = [(tok, lengths[name], requests()[name][1]) for name, tok in step]
            outs.append(runner.execute_model(reqs, graphed).clone())
            for name, _ in step:
                lengths[name] += 1
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
