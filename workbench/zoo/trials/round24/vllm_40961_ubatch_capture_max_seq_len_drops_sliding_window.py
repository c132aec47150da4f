"""A dual-batch-overlap FULL decode graph is captured with ``max_seq_len`` 1, so its SWA layers run full attention.

Upstream: https://github.com/vllm-project/vllm/pull/40961 ("[BugFix] Preserve max_seq_len in ubatch metadata
during CUDA graph capture").
Symptom: with micro-batching (DBO) and FULL CUDA graphs, sliding-window-attention models ran their SWA layers
with the full-attention kernel: "for SWA models the current code would incorrectly select full attention
kernels for SWA layers since the seqlen seen at cudagraph capture was 1" (vLLM V1, April 2026); decode tokens
attend past the window and the served outputs drift from eager ones.
Mechanism: for a capture, ``GPUModelRunner._dummy_run`` builds the ``CommonAttentionMetadata`` of a dummy
uniform-decode batch whose ``seq_lens`` are the query length (1) and overrides ``max_seq_len`` with
``max_model_len`` so that the captured kernels serve any context. With ubatching, ``split_attn_metadata``
rebuilds each micro-batch's metadata in ``_make_metadata_with_slice``, which recomputed
``max_seq_len = int(seq_lens_cpu_upper_bound.max())`` from the sliced dummy ``seq_lens``: 1, dropping the
override. The FlashAttention launcher ``flash_attn_varlen_func`` takes ``max_seqlen_k`` as a host int and
drops a window that is at least that long (``window_size_left >= max_seqlen_k -> -1``, as ``mha_varlen_fwd``
does), launching the plain causal kernel instead of the local one. That host decision is made once, while the
ubatched FULL graph is captured; every replay repeats the full-attention kernel, whereas an eager step (whose
``max_seq_len`` is the real, longer context) keeps the window.
Doctor: warmup-divergence, at ``flash_attn_varlen_func`` (the kernel choice made at capture from the ubatch's
capture-time ``max_seq_len``; an eager step chooses the sliding-window kernel).
Fix (upstream): ``_make_metadata_with_slice`` keeps the capture override:
``max_seq_len = max(int(seq_lens_cpu_upper_bound.max()), attn_metadata.max_seq_len)``.
Read: the PR description and the fixed ``_make_metadata_with_slice`` (vllm/v1/worker/ubatch_utils.py, with the
comment "Preserve the max_seq_len override set during CUDA-graph capture so the attention backend selects the
correct kernel for SWA layers"), the pre-fix line ``max_seq_len = int(seq_lens_cpu.max())`` in an older
version of the same function, and ``_dummy_run``'s "Make sure max_model_len is used at the graph capture
time". The window drop inside the FlashAttention launcher is modelled from flash-attn's ``flash_api.cpp``, not
from the vLLM diff.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/40961"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "flash_attn_varlen_func"
SYMPTOM = "ubatched FULL decode graphs run SWA layers with full attention (window dropped at capture)"

VOCAB, DIM = 16, 4
BLOCK_SIZE, MAX_MODEL_LEN = 2, 8
MAX_BLOCKS = MAX_MODEL_LEN // BLOCK_SIZE
NUM_BLOCKS = 1 + 4 * MAX_BLOCKS           # block 0 is the null block
NULL_BLOCK, PAD_SLOT_ID = 0, -1
SLIDING_WINDOW = 3                        # the layer attends to its last 3 tokens
SIZE = 4                                  # the FULL uniform-decode graph: 4 requests, 1 token each
NUM_UBATCHES = 2
MAX_NUM_REQS, MAX_NUM_TOKENS = 4, 32


@dataclasses.dataclass
class UBatchSlice:
    request_slice: slice
    token_slice: slice


@dataclasses.dataclass
class CommonAttentionMetadata:
    query_start_loc: torch.Tensor          # device, [num_reqs + 1]
    query_start_loc_cpu: np.ndarray
    seq_lens: torch.Tensor                 # device, [num_reqs]
    seq_lens_cpu_upper_bound: np.ndarray
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor       # device, [num_reqs, MAX_BLOCKS]
    slot_mapping: torch.Tensor             # device, [num_tokens]


def _make_metadata_with_slice(ubatch_slice: UBatchSlice, attn_metadata: CommonAttentionMetadata,
                              variant: str) -> CommonAttentionMetadata:
    """The metadata of one micro-batch (requests are never split across ubatches here)."""
    rs, ts = ubatch_slice.request_slice, ubatch_slice.token_slice
    query_start_loc_cpu = attn_metadata.query_start_loc_cpu[rs.start:rs.stop + 1] - \
        attn_metadata.query_start_loc_cpu[rs.start]
    query_start_loc = attn_metadata.query_start_loc[rs.start:rs.stop + 1] - attn_metadata.query_start_loc[rs.start]
    seq_lens_cpu_upper_bound = attn_metadata.seq_lens_cpu_upper_bound[rs]
    if variant == "fix":
        # Preserve the max_seq_len override set during CUDA-graph capture so
        # the attention backend selects the correct kernel for SWA layers.
        max_seq_len = max(int(seq_lens_cpu_upper_bound.max()), attn_metadata.max_seq_len)
    else:
        max_seq_len = int(seq_lens_cpu_upper_bound.max())
    return CommonAttentionMetadata(
        query_start_loc=query_start_loc, query_start_loc_cpu=query_start_loc_cpu,
        seq_lens=attn_metadata.seq_lens[rs], seq_lens_cpu_upper_bound=seq_lens_cpu_upper_bound,
        num_reqs=rs.stop - rs.start, num_actual_tokens=ts.stop - ts.start,
        max_query_len=int(np.diff(query_start_loc_cpu).max()), max_seq_len=max_seq_len,
        block_table_tensor=attn_metadata.block_table_tensor[rs], slot_mapping=attn_metadata.slot_mapping[ts])


def split_attn_metadata(ubatch_slices, common_attn_metadata, variant):
    return [_make_metadata_with_slice(s, common_attn_metadata, variant) for s in ubatch_slices]


class Model:
    def __init__(self, device):
        gen = generator(40961)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq = randn(DIM, DIM, gen=gen, device=device, scale=0.8)
        self.wk = randn(DIM, DIM, gen=gen, device=device, scale=0.8)
        self.wv = randn(DIM, DIM, gen=gen, device=device, scale=0.8)
        self.wo = randn(DIM, DIM, gen=gen, device=device, scale=0.8)
        self.ctx_pos = torch.arange(MAX_MODEL_LEN, device=device)
        self.tok_idx = torch.arange(MAX_NUM_TOKENS, device=device)


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping):
    """One cache write per slot-mapping entry; ``PAD_SLOT_ID`` entries are skipped."""
    valid = (slot_mapping >= 0)[:, None]
    slots = slot_mapping.clamp(min=0)
    key_cache[slots] = torch.where(valid, key, key_cache[slots])
    value_cache[slots] = torch.where(valid, value, value_cache[slots])


def flash_attn_varlen_func(model, q, k_cache, v_cache, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k,
                           window_size, block_table):
    """Varlen paged attention. The launcher works on host ints: a window at least as long as the longest
    key sequence cannot mask anything, so it is dropped and the non-local (plain causal) kernel runs."""
    window_left, _ = window_size
    if window_left >= max_seqlen_k:
        window_left = -1                                             # -> causal kernel, no window
    n = q.shape[0]
    tok = model.tok_idx[:n]
    req = torch.searchsorted(cu_seqlens_q[1:], tok, right=True)     # request of each query token
    qpos = seqused_k[req] - (cu_seqlens_q[1:][req] - tok)          # absolute position of each query
    pos = model.ctx_pos
    slots = block_table[req][:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    k, v = k_cache[slots], v_cache[slots]                           # [n, ctx, DIM]
    masked = pos[None, :] > qpos[:, None]
    if window_left >= 0:
        masked = masked | (pos[None, :] < qpos[:, None] - window_left)
    scores = (k @ q[:, :, None]).squeeze(-1).masked_fill(masked, -1e9)
    return (torch.softmax(scores, -1)[:, :, None] * v).sum(1)


def attention_layer(model, kv, input_ids, meta: CommonAttentionMetadata):
    """One sliding-window attention layer (the SWA layer of an interleaved SWA model)."""
    h = model.emb[input_ids]
    q, k, v = h @ model.wq, h @ model.wk, h @ model.wv
    reshape_and_cache_flash(k, v, kv[0], kv[1], meta.slot_mapping)
    o = flash_attn_varlen_func(model, q, kv[0], kv[1], meta.query_start_loc, meta.max_query_len, meta.seq_lens,
                               meta.max_seq_len, (SLIDING_WINDOW - 1, 0), meta.block_table_tensor)
    return h + o @ model.wo


def ubatched_forward(model, kv, input_ids, ubatch_slices, ubatch_metadata):
    """DBO: the micro-batches run one after the other (overlapping their communication upstream)."""
    return torch.cat([attention_layer(model, kv, input_ids[s.token_slice], m)
                      for s, m in zip(ubatch_slices, ubatch_metadata)])


class GPUModelRunner:
    def __init__(self, model, device, variant, graphed):
        self.model, self.device, self.variant = model, device, variant
        self.kv = torch.zeros(2, NUM_BLOCKS * BLOCK_SIZE, DIM, device=device)
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.query_start_loc = torch.zeros(MAX_NUM_REQS + 1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(MAX_NUM_REQS, dtype=torch.long, device=device)
        self.block_table = torch.zeros(MAX_NUM_REQS, MAX_BLOCKS, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((MAX_NUM_TOKENS,), PAD_SLOT_ID, dtype=torch.long, device=device)
        half = SIZE // NUM_UBATCHES
        self.ubatch_slices = [UBatchSlice(slice(i * half, (i + 1) * half), slice(i * half, (i + 1) * half))
                              for i in range(NUM_UBATCHES)]
        self.graph = None
        if graphed:
            self.capture_model()

    def _common_metadata(self, num_reqs, num_tokens, query_lens, seq_lens, max_seq_len):
        qsl = np.zeros(num_reqs + 1, dtype=np.int64)
        qsl[1:] = np.cumsum(query_lens)
        self.query_start_loc[:num_reqs + 1].copy_(torch.from_numpy(qsl).to(self.device))
        return CommonAttentionMetadata(
            query_start_loc=self.query_start_loc[:num_reqs + 1], query_start_loc_cpu=qsl,
            seq_lens=self.seq_lens[:num_reqs], seq_lens_cpu_upper_bound=np.asarray(seq_lens, dtype=np.int64),
            num_reqs=num_reqs, num_actual_tokens=num_tokens, max_query_len=int(max(query_lens)),
            max_seq_len=max_seq_len, block_table_tensor=self.block_table[:num_reqs],
            slot_mapping=self.slot_mapping[:num_tokens])

    def capture_model(self):
        """``_dummy_run`` for the FULL uniform-decode graph with ubatching."""
        self.seq_lens[:SIZE].fill_(1)              # dummy requests: seq_len = max_query_len = 1
        self.block_table[:SIZE].fill_(NULL_BLOCK)
        self.slot_mapping[:SIZE].fill_(PAD_SLOT_ID)
        # Make sure max_model_len is used at the graph capture time.
        common = self._common_metadata(SIZE, SIZE, [1] * SIZE, [1] * SIZE, max_seq_len=MAX_MODEL_LEN)
        self.capture_metadata = split_attn_metadata(self.ubatch_slices, common, self.variant)
        self.graph, self.out = capture(
            lambda: ubatched_forward(self.model, self.kv, self.input_ids[:SIZE], self.ubatch_slices,
                                     self.capture_metadata),
            device=self.device, owner="UBatchWrapper (FULL decode graph, 2 ubatches)",
            static={"input_ids": self.input_ids, "seq_lens": self.seq_lens, "block_table": self.block_table,
                    "slot_mapping": self.slot_mapping},
            state={"kv_cache": self.kv})

    def _prepare_inputs(self, reqs):
        """``reqs``: (new token ids, number of computed tokens, block ids) per request."""
        t = lambda xs: torch.tensor(xs, dtype=torch.long).to(self.device)  # noqa: E731
        ids, slots, query_lens, seq_lens = [], [], [], []
        for tokens, computed, blocks in reqs:
            ids += tokens
            for p in range(computed, computed + len(tokens)):
                slots.append(blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
            query_lens.append(len(tokens))
            seq_lens.append(computed + len(tokens))
        n, r = len(ids), len(reqs)
        self.input_ids[:n].copy_(t(ids))
        self.slot_mapping[:n].copy_(t(slots))
        self.seq_lens[:r].copy_(t(seq_lens))
        self.block_table[:r].copy_(t([b + [NULL_BLOCK] * (MAX_BLOCKS - len(b)) for _, _, b in reqs]))
        return self._common_metadata(r, n, query_lens, seq_lens, max_seq_len=max(seq_lens))

    def execute_model(self, reqs):
        common = self._prepare_inputs(reqs)
        uniform_decode = common.num_reqs == SIZE and common.max_query_len == 1
        if not uniform_decode:                              # prefills run eagerly, without ubatching
            return attention_layer(self.model, self.kv, self.input_ids[:common.num_actual_tokens], common).clone()
        if self.graph is None:
            ubatch_metadata = split_attn_metadata(self.ubatch_slices, common, self.variant)
            return ubatched_forward(self.model, self.kv, self.input_ids[:SIZE], self.ubatch_slices,
                                    ubatch_metadata).clone()
        return replay(self.graph, self.out).clone()


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    gen = generator(4096)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (4, 5, 3, 5)]
    decodes = [torch.randint(1, VOCAB, (SIZE,), generator=gen).tolist() for _ in range(2)]
    blocks = [[1 + MAX_BLOCKS * r + b for b in range(MAX_BLOCKS)] for r in range(SIZE)]

    def serve(graphed: bool):
        runner = GPUModelRunner(model, device, variant, graphed)
        outs = [runner.execute_model([(p, 0, b) for p, b in zip(prompts, blocks)])]
        lens = [len(p) for p in prompts]
        for step in decodes:                                   # uniform decode: the ubatched FULL graph
            outs.append(runner.execute_model([([tok], n, b) for tok, n, b in zip(step, lens, blocks)]))
            lens = [n + 1 for n in lens]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
