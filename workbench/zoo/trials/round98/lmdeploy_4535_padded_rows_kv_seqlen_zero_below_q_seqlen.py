"""LMDeploy's decode graph pads a spec-decoding batch with rows whose q_seqlen is the fill value but whose kv_seqlen is 0: the attention kernel places their new tokens at kv_len - q_len < 0, a page index below the block table.

Upstream: https://github.com/InternLM/lmdeploy/pull/4535 ("Fix qwen35 dp", InternLM/lmdeploy, commit 964c878ad,
2026-04-23, merged). Read: the commit (no description beyond "fix qwen35 moe dp / fix qwen35 dp / fix comment") and its
diff: in ``lmdeploy/pytorch/models/utils/cudagraph.py`` ``CudaGraphMixin.fill_buffers_cudagraph`` changes
``input_buffers['q_seqlens'].fill_(max_tokens // max_batchs)`` into ``input_buffers['qkv_seqlens'].fill_(...)`` with the
comment "initialize q_seqlens and kv_seqlens to max_tokens // max_batchs to avoid out of bound in flash attention
kernels; padding kv should be the same as padding q so q-kv=0"; the same PR guards the gated-delta state load with
``state_id >= 0``, adds ``1e-10`` to the paged-attention softmax denominator and adds a MoE all-reduce (not modelled).
Also read: the whole pre-fix ``cudagraph.py`` (``make_buffers_cudagraph``: ``qkv_lens`` is one ``[3, max_batches]``
buffer whose rows are ``q_start_loc``, ``q_seqlens``, ``kv_seqlens``, ``qkv_seqlens`` its last two rows; the FA3
``scheduler_metadata`` path used for speculative decoding), ``gated_delta.py`` (``cache_seqlens = kv_seqlens -
q_seqlens`` in spec decoding) and ``fill_kv_cache.py`` (``history_seqlen = kv_seqlen - q_seqlen``). Which kernel faulted
and on which schedule is not stated anywhere; the FA3 kernel itself was not read.
Symptom: Qwen3.5 served with speculative decoding and decode CUDA graphs crashes with an out-of-bounds access
(illegal memory access) on a decode step whose batch is smaller than its graph bucket; eager mode is fine.
Mechanism: every decode step is replayed at its bucket size; ``fill_buffers_cudagraph`` zeroes ``qkv_lens`` and then
fills ``q_seqlens`` alone with the per-row token count ``max_tokens // max_batchs`` (1 + draft tokens), so each padded
row says "2 new tokens, 0 tokens of KV". Kernels that place a row's new tokens after its history compute that history
as ``kv_seqlen - q_seqlen`` (FA3's paged append, ``fill_kv_cache``, the gated-delta ``cache_seqlens``): -2 for a padded
row, whose first new token then lands in page ``-1`` of its block-table row, an address before the row.
Doctor: stale-padding, at fill_buffers_cudagraph. Whether a padded replay runs at all depends on what the padded rows
of the metadata hold: ``fill_buffers_cudagraph`` neutralises them inconsistently (kv 0, q 2), so the real rows' step
dies on the padded rows' values.
Fix (upstream): fill both rows of ``qkv_seqlens`` with the same value, so a padded row has ``q - kv = 0``.
Modelled: ``CudaGraphMeta``, ``CudaGraphMixin`` (``make_buffers_cudagraph``, ``fill_buffers_cudagraph`` with the
pre-fix and fixed line, ``make_output_buffers``, ``get_outputs_cudagraph``), ``CUDASingleGraphRunner`` (``capture``,
``forward``), ``CUDAGraphRunner`` (buckets, graph warmup on dummy batches that use the dummy block 0), speculative
verify steps of 1 + 1 tokens per sequence. Stand-ins: the model is one attention layer (embedding + sinusoidal
positions, q/k/v/o projections, lm_head); ``flash_attn_with_kvcache`` appends the step's K/V into the paged cache at
``cache_seqlens + i`` (``cache_seqlens = kv_seqlens - q_seqlens``) and attends causally over the row's pages, a
``gather`` on the block-table row standing for the page lookup (a page index below 0 raises, as the GPU faults); draft
tokens are all accepted; ``input_ids`` padding is drawn from a seeded generator; float64.
Workload: buckets 2 and 4 (1 + 1 tokens per sequence), blocks of 4 tokens, 3 blocks per sequence, block 0 the dummy
block; eager prefill of A (3 tokens), B (2), C (3), D (1); verify steps [A, B, C, D] (bucket 4, D then finishes),
[A, B, C] (bucket 4, 1 padded row), [A, C] (bucket 2), [A, B, C] (bucket 4, padded). The bug raises RuntimeError in the
second step's replay (the padded row's page index -1); the fix writes the padded row's tokens into page 0 of its stale
block-table row (D's freed block) and all four steps equal eager (max error 8.9e-16).
"""
from __future__ import annotations

import dataclasses
import math

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/InternLM/lmdeploy/pull/4535"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "fill_buffers_cudagraph"
SYMPTOM = ("spec-decoding decode graphs crash with an out-of-bounds access on a padded replay: padded rows get "
           "q_seqlen = 2 but kv_seqlen = 0, so the attention kernel appends their tokens at page -1")

VOCAB, HIDDEN, HEAD_DIM = 16, 8, 8
BLOCK_SIZE, MAX_BLOCKS, NUM_BLOCKS = 4, 3, 16         # block 0: the dummy block of warmup batches
NUM_SPEC_TOKENS = 1
DECODE_QUERY_LEN = 1 + NUM_SPEC_TOKENS
CAPTURE_BATCH_SIZES = (2, 4)
DTYPE = torch.float64

_variant = "bug"


# --- lmdeploy/pytorch/models/utils/cudagraph.py -----------------------------------------------------------------------

@dataclasses.dataclass
class CudaGraphMeta:
    """Meta info of cudagraph."""
    max_batchs: int
    max_tokens: int
    num_blocks: int
    is_decoding: int
    device: str
    input_buffers: dict = None
    output_buffers: dict = None
    vocab_size: int = 1
    decode_query_len: int = 1


@dataclasses.dataclass
class AttnMetadata:
    block_offsets: torch.Tensor
    q_start_loc: torch.Tensor
    q_seqlens: torch.Tensor
    kv_seqlens: torch.Tensor
    is_decoding: bool = True


class CudaGraphMixin:
    """Mixin class to support cudagraph."""

    def make_output_buffers(self, output):
        return dict(logits=output)

    def make_buffers_cudagraph(self, graph_meta: CudaGraphMeta):
        max_batches, max_tokens, device = graph_meta.max_batchs, graph_meta.max_tokens, graph_meta.device
        input_buffers = dict()
        input_buffers['input_ids'] = torch.randint(0, graph_meta.vocab_size, (1, max_tokens),
                                                   generator=self._pad_gen).to(device)
        input_buffers['position_ids'] = torch.zeros((1, max_tokens), dtype=torch.int64, device=device)
        input_buffers['block_offsets'] = torch.zeros((max_batches, graph_meta.num_blocks), dtype=torch.int64,
                                                     device=device)
        input_buffers['qkv_lens'] = torch.zeros(3, max_batches, dtype=torch.int64, device=device)
        input_buffers['q_start_loc'] = input_buffers['qkv_lens'][0]
        input_buffers['q_seqlens'] = input_buffers['qkv_lens'][1]
        input_buffers['kv_seqlens'] = input_buffers['qkv_lens'][2]
        input_buffers['qkv_seqlens'] = input_buffers['qkv_lens'][1:]
        return input_buffers

    def fill_buffers_cudagraph(self, graph_meta: CudaGraphMeta, input_ids, position_ids, past_key_values,
                               attn_metadata: AttnMetadata):
        """Fill cudagraph buffers from forward inputs."""
        block_offsets = attn_metadata.block_offsets
        input_buffers = graph_meta.input_buffers
        batch_size, num_blocks = block_offsets.size()
        num_tokens = input_ids.size(-1)

        input_buffers['input_ids'].copy_(torch.randint(0, graph_meta.vocab_size, (1, graph_meta.max_tokens),
                                                       generator=self._pad_gen))       # random padding ids
        input_buffers['input_ids'][:, :num_tokens] = input_ids
        input_buffers['position_ids'][:, :num_tokens] = position_ids
        input_buffers['block_offsets'][:batch_size, :num_blocks] = block_offsets

        qkv = torch.stack((attn_metadata.q_start_loc, attn_metadata.q_seqlens, attn_metadata.kv_seqlens))
        input_buffers['qkv_lens'].zero_()
        if _variant == "fix":
            # padding kv should be the same as padding q so q-kv=0
            input_buffers['qkv_seqlens'].fill_(graph_meta.max_tokens // graph_meta.max_batchs)
        else:
            input_buffers['q_seqlens'].fill_(graph_meta.max_tokens // graph_meta.max_batchs)
        input_buffers['qkv_lens'][:, :batch_size] = qkv

        new_metadata = AttnMetadata(block_offsets=input_buffers['block_offsets'],
                                    q_start_loc=input_buffers['q_start_loc'],
                                    q_seqlens=input_buffers['q_seqlens'],
                                    kv_seqlens=input_buffers['kv_seqlens'])
        return dict(input_ids=input_buffers['input_ids'], position_ids=input_buffers['position_ids'],
                    past_key_values=past_key_values, attn_metadata=new_metadata)

    def get_outputs_cudagraph(self, output_buffers, input_ids, attn_metadata, **kwargs):
        batch_size = attn_metadata.block_offsets.size(0)
        return output_buffers['logits'][:batch_size].reshape(input_ids.size(-1), -1)


# --- the model (stand-in) and its attention kernel -------------------------------------------------------------------

def flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, page_table):
    """FA3-style decoding with paged KV: append the step's K/V at ``cache_seqlens + i``, then attend causally."""
    bs, max_blocks = page_table.shape
    qlen = q.size(0) // bs
    pos = cache_seqlens[:, None] + torch.arange(qlen, device=q.device)[None, :]           # [bs, qlen]
    pages = page_table.gather(1, torch.div(pos, BLOCK_SIZE, rounding_mode="floor"))        # the page lookup
    slots = (pages * BLOCK_SIZE + pos % BLOCK_SIZE).reshape(-1)
    k_cache.index_copy_(0, slots, k)
    v_cache.index_copy_(0, slots, v)
    ctx = torch.arange(max_blocks * BLOCK_SIZE, device=q.device)
    kv_slots = page_table[:, ctx // BLOCK_SIZE] * BLOCK_SIZE + ctx % BLOCK_SIZE             # [bs, L]
    scores = torch.einsum("bqd,bld->bql", q.view(bs, qlen, -1), k_cache[kv_slots]) / math.sqrt(HEAD_DIM)
    causal = ctx[None, None, :] <= pos[:, :, None]
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1).nan_to_num(0.0)
    return torch.einsum("bql,bld->bqd", probs, v_cache[kv_slots]).reshape(bs * qlen, -1)


class Qwen3_5ForCausalLM(CudaGraphMixin):
    """Stand-in for the full-attention path of the model: one attention layer and the lm_head."""

    def __init__(self, device):
        gen = generator(4535)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.embed_tokens = r(VOCAB, HIDDEN, scale=1.0)
        self.wq, self.wk, self.wv, self.wo = (r(HIDDEN, HEAD_DIM) for _ in range(4))
        self.lm_head = r(HIDDEN, VOCAB)
        self.inv_freq = (1.0 / 10.0 ** (torch.arange(HIDDEN, dtype=DTYPE) / HIDDEN)).to(device)
        self._pad_gen = torch.Generator().manual_seed(45350)

    def forward(self, input_ids, position_ids, past_key_values, attn_metadata: AttnMetadata):
        k_cache, v_cache = past_key_values
        h = self.embed_tokens[input_ids[0]] + torch.sin(position_ids[0, :, None].to(DTYPE) * self.inv_freq)
        q, k, v = h @ self.wq, h @ self.wk, h @ self.wv
        cache_seqlens = attn_metadata.kv_seqlens - attn_metadata.q_seqlens              # the row's history
        o = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, attn_metadata.block_offsets)
        return (h + o @ self.wo) @ self.lm_head                                            # [num_tokens, VOCAB]


# --- lmdeploy/pytorch/backends/cuda/graph_runner.py ------------------------------------------------------------------

class CUDASingleGraphRunner:
    def __init__(self, model, max_batches, max_tokens, num_blocks, pool, device):
        self.model, self.pool, self.device = model, pool, device
        self.meta = CudaGraphMeta(max_batchs=max_batches, max_tokens=max_tokens, num_blocks=num_blocks,
                                  is_decoding=True, device=device, vocab_size=VOCAB,
                                  decode_query_len=DECODE_QUERY_LEN)
        self._graph = None

    def capture(self, **kwargs):
        self.meta.input_buffers = self.model.make_buffers_cudagraph(self.meta)
        padded_kwargs = self.model.fill_buffers_cudagraph(self.meta, **kwargs)
        k_cache, v_cache = kwargs['past_key_values']
        bs = self.meta.max_batchs
        self._graph, output = capture(lambda: self.model.forward(**padded_kwargs).view(bs, DECODE_QUERY_LEN, -1),
                                      device=self.device,
                                      pool=self.pool, warmups=1, name=f"decode bs {self.meta.max_batchs}",
                                      owner="lmdeploy CUDAGraphRunner", static=self.meta.input_buffers,
                                      state={"k_cache": k_cache, "v_cache": v_cache})
        self.meta.output_buffers = self.model.make_output_buffers(output)

    def forward(self, **kwargs):
        self.model.fill_buffers_cudagraph(self.meta, **kwargs)
        batch_size = kwargs['attn_metadata'].block_offsets.size(0)
        bufs = self.meta.input_buffers
        # rows are sequences; block_offsets and position_ids keep stale padded rows/columns (q/kv lens are rewritten)
        logits = replay(self._graph, self.meta.output_buffers['logits'], real=batch_size, size=self.meta.max_batchs,
                        padded={"block_offsets": bufs['block_offsets']},
                        padded_columns={"position_ids": (bufs['position_ids'], kwargs['input_ids'].size(-1))})
        return self.model.get_outputs_cudagraph({'logits': logits}, **kwargs)


class CUDAGraphRunner:
    def __init__(self, model, device):
        self.model, self.device = model, device
        self.graph_pool_handle = graph_pool_handle(device)
        self._runner_map = {}

    def get_graph_key(self, batch_size):
        return next(bs for bs in CAPTURE_BATCH_SIZES if bs >= batch_size)

    def warmup(self, past_key_values):
        """Graph warmup: capture every bucket on a dummy decoding batch (all rows on the dummy block 0)."""
        for bs in reversed(CAPTURE_BATCH_SIZES):
            num_tokens = bs * DECODE_QUERY_LEN
            q = torch.full((bs,), DECODE_QUERY_LEN, dtype=torch.int64, device=self.device)
            dummy = dict(input_ids=torch.zeros(1, num_tokens, dtype=torch.int64, device=self.device),
                         position_ids=torch.arange(DECODE_QUERY_LEN, device=self.device).repeat(bs)[None],
                         past_key_values=past_key_values,
                         attn_metadata=AttnMetadata(block_offsets=torch.zeros(bs, 1, dtype=torch.int64,
                                                                              device=self.device),
                                                    q_start_loc=q.cumsum(0) - q, q_seqlens=q, kv_seqlens=q.clone()))
            runner = CUDASingleGraphRunner(self.model, bs, num_tokens, MAX_BLOCKS, self.graph_pool_handle,
                                           self.device)
            runner.capture(**dummy)
            self._runner_map[bs] = runner

    def __call__(self, **kwargs):
        batch_size = kwargs['attn_metadata'].block_offsets.size(0)
        return self._runner_map[self.get_graph_key(batch_size)].forward(**kwargs)


# --- the workload ----------------------------------------------------------------------------------------------------

BLOCK_TABLE = {"A": [1, 2, 3], "B": [4, 5, 6], "C": [7, 8, 9], "D": [10, 11, 12]}
PROMPTS = {"A": 3, "B": 2, "C": 3, "D": 1}
SCHEDULE = [["A", "B", "C", "D"], ["A", "B", "C"], ["A", "C"], ["A", "B", "C"]]     # D finishes after step 1


def token(seq, pos):
    return (7 * "ABCD".index(seq) + 3 * pos + 1) % VOCAB


def step_inputs(seqs, history, caches, device):
    """One speculative verify step: the next token and one draft token per sequence."""
    q = torch.full((len(seqs),), DECODE_QUERY_LEN, dtype=torch.int64, device=device)
    pos = [history[s] + i for s in seqs for i in range(DECODE_QUERY_LEN)]
    ids = [token(s, p) for s in seqs for p in range(history[s], history[s] + DECODE_QUERY_LEN)]
    return dict(input_ids=torch.tensor([ids], device=device), position_ids=torch.tensor([pos], device=device),
                past_key_values=caches,
                attn_metadata=AttnMetadata(block_offsets=torch.tensor([BLOCK_TABLE[s] for s in seqs], device=device),
                                           q_start_loc=q.cumsum(0) - q, q_seqlens=q,
                                           kv_seqlens=torch.tensor([history[s] + DECODE_QUERY_LEN for s in seqs],
                                                                   device=device)))


def prefill(model, seq, caches, device):
    n = PROMPTS[seq]
    q = torch.tensor([n], device=device)
    model.forward(input_ids=torch.tensor([[token(seq, p) for p in range(n)]], device=device),
                  position_ids=torch.arange(n, device=device)[None], past_key_values=caches,
                  attn_metadata=AttnMetadata(block_offsets=torch.tensor([BLOCK_TABLE[seq]], device=device),
                                             q_start_loc=q - n, q_seqlens=q, kv_seqlens=q.clone(), is_decoding=False))


def serve(device, use_cuda_graph):
    model = Qwen3_5ForCausalLM(device)
    caches = (torch.zeros(NUM_BLOCKS * BLOCK_SIZE, HEAD_DIM, dtype=DTYPE, device=device),
              torch.zeros(NUM_BLOCKS * BLOCK_SIZE, HEAD_DIM, dtype=DTYPE, device=device))
    runner = None
    if use_cuda_graph:
        runner = CUDAGraphRunner(model, device)
        runner.warmup(caches)
    for seq in PROMPTS:                                  # prefills run eagerly
        prefill(model, seq, caches, device)
    history, outs = dict(PROMPTS), []
    for seqs in SCHEDULE:
        inputs = step_inputs(seqs, history, caches, device)
        logits = runner(**inputs) if runner is not None else model.forward(**inputs)
        outs.append(logits.clone())
        for s in seqs:                                   # all draft tokens accepted
            history[s] += DECODE_QUERY_LEN
    return outs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(device, True),
                   lambda: serve(device, False))
