"""MRV2 piecewise capture runs attention on a dummy batch whose last request holds the whole token remainder: more KV pages than a block-table row has, read past the table's end.

Upstream: https://github.com/vllm-project/vllm/pull/49751 ("[BugFix][MRV2] Don't create dummy requests longer than
`max_model_len`", vllm-project/vllm, opened 2026-07-24 by njhill, merged). Read: the PR description (``InputBatch.make_dummy`` and
``GPUModelRunner._dummy_run`` gave every dummy request ``num_tokens // num_reqs`` tokens and put the whole remainder on the
last one; with #49364, which made piecewise capture build attention metadata and run attention eagerly on the dummy
batch, capture size 496 with ``max_num_seqs=256`` and ``max_model_len=16`` gave the last request 241 tokens, 16 KV pages
against an 8-slot block-table row, and FA3's paged main loop read ``block_table[255][8..15]`` past the tensor: an illegal
memory access on the 16 GB MIG CI runner, so #49364 was reverted in #49451) and the fixed ``InputBatch.make_dummy`` in
``vllm/v1/worker/gpu/input_batch.py`` (remainder spread over the last ``num_tokens % num_reqs`` requests, seq_len =
query_len, ``seq_lens`` / ``query_start_loc`` padded for FULL graphs). The pre-fix lines are reconstructed from the
description; the diff, ``_dummy_run`` and #49364's capture changes were not read.
Symptom: engine start-up with the V2 model runner and piecewise CUDA graphs (with #49364's attention-on-dummy-batch
capture) dies with ``CUDA error: an illegal memory access`` while capturing a size whose dummy split leaves a large
remainder (silent garbage page ids on larger GPUs, where the read lands on mapped memory).
Mechanism: a capture size larger than ``max_model_len`` is legal (it holds several requests), but ``make_dummy`` packs
``num_tokens - (num_reqs - 1) * (num_tokens // num_reqs)`` tokens into the last dummy request, so its ``seq_len`` can
exceed ``max_model_len``. The block table is a persistent ``[max_num_reqs, cdiv(max_model_len, block_size)]`` buffer;
the paged attention kernel reads ``cdiv(seq_len, block_size)`` entries of the request's row through a raw pointer, so
the last dummy request walks off its row, and off the buffer when it is the table's last row.
Doctor: undersized-buffer, at make_dummy. The dummy batch built for a capture size asks one request for more KV pages
than a row of the persistent block table (sized by ``max_model_len``) can hold.
Fix (upstream): spread the remainder: ``base = num_tokens // num_reqs``, the last ``num_tokens % num_reqs`` requests get
one extra token, so no dummy request exceeds ``ceil(num_tokens / num_reqs) <= max_model_len``.
Modelled: ``InputBuffers``, ``InputBatch.make_dummy`` (both splits), the runner's ``_dummy_run`` / ``capture_model``
(piecewise sizes 1..24, one shared graph pool, attention as the eager splitting op between two captured pieces, as with
#49364) and ``execute_model`` (real steps padded to the next capture size), ``BlockTables`` with a null block 0, and a
FlashAttention-style ``flash_attn_varlen_func`` that reads the block table through a pointer into its allocation (an
address past it is the CUDA fault). Stand-ins: one decoder layer (embedding + learned positions, qkv projection, paged
causal attention with ``reshape_and_cache_flash`` skipping slot -1, output projection and residual); no sampler.
Sizes: hidden 8, 2 heads of 4, block size 2, ``max_model_len`` 6 (3-slot rows), ``max_num_reqs`` 5, float64.
Workload: capture sizes [1, 2, 4, 8, 16, 24]; then four steps: prefill A (3) + B (2); decode A, B; prefill C (4) with
decodes; decode A, B, C (5, 2, 6, 3 tokens, padded to 8, 2, 8, 4). The bug raises RuntimeError (illegal memory access)
while capturing size 24 (split 4, 4, 4, 4, 8: the last request needs 4 pages, its row has 3 and is the table's last);
the fix captures every size and its four steps equal eager (max error 0).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/49751"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "make_dummy"
SYMPTOM = ("MRV2 piecewise capture (attention run on the dummy batch) crashes with an illegal memory access: the last "
           "dummy request gets the whole token remainder, more KV pages than its block-table row, and FA3 reads past it")

VOCAB, HIDDEN, NUM_HEADS, HEAD_DIM = 16, 8, 2, 4
BLOCK_SIZE, MAX_MODEL_LEN, MAX_NUM_REQS = 2, 6, 5
BLOCKS_PER_ROW = math.ceil(MAX_MODEL_LEN / BLOCK_SIZE)
NUM_BLOCKS = 1 + MAX_NUM_REQS * BLOCKS_PER_ROW              # block 0: the null block
CUDAGRAPH_CAPTURE_SIZES = [1, 2, 4, 8, 16, 24]
MAX_NUM_TOKENS = max(CUDAGRAPH_CAPTURE_SIZES)
PAD_SLOT_ID = -1
DTYPE = torch.float64

_variant = "bug"


def _pointer(t: torch.Tensor):
    """A device pointer to ``t``: its whole allocation (flat) and the element offset where ``t`` starts."""
    numel = t.untyped_storage().nbytes() // t.element_size()
    return torch.as_strided(t, (numel,), (1,), 0), t.storage_offset()


# --- vllm/v1/worker/gpu/input_batch.py -----------------------------------------------------------------------------------

class InputBuffers:
    def __init__(self, max_num_reqs, max_num_tokens, device):
        self.device = device
        self.input_ids = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        self.query_start_loc = torch.zeros(max_num_reqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)


class InputBatch:
    def __init__(self, num_reqs, num_tokens, num_scheduled_tokens, query_start_loc, seq_lens, seq_lens_cpu):
        self.num_reqs, self.num_tokens = num_reqs, num_tokens
        self.num_scheduled_tokens = num_scheduled_tokens
        self.query_start_loc, self.seq_lens, self.seq_lens_cpu = query_start_loc, seq_lens, seq_lens_cpu

    @classmethod
    def make_dummy(cls, num_reqs: int, num_tokens: int, input_buffers: InputBuffers) -> "InputBatch":
        assert 0 < num_reqs <= num_tokens
        if _variant == "bug":
            num_scheduled_tokens = np.full(num_reqs, num_tokens // num_reqs, dtype=np.int32)
            num_scheduled_tokens[-1] += num_tokens % num_reqs
        else:
            # Distribute the remainder evenly so that no dummy request exceeds
            # ceil(num_tokens / num_reqs) <= max_model_len tokens.
            base_tokens = num_tokens // num_reqs
            num_extra = num_tokens % num_reqs
            num_scheduled_tokens = np.full(num_reqs, base_tokens, dtype=np.int32)
            if num_extra > 0:
                num_scheduled_tokens[-num_extra:] += 1
        assert int(num_scheduled_tokens.sum()) == num_tokens
        # seq_len equals to query_len
        seq_lens_cpu = torch.from_numpy(num_scheduled_tokens.copy())
        input_buffers.seq_lens[:num_reqs].copy_(seq_lens_cpu.to(input_buffers.device))
        input_buffers.seq_lens[num_reqs:] = 0                       # pad for full CUDA graph mode
        qsl = np.concatenate([[0], np.cumsum(num_scheduled_tokens)]).astype(np.int32)
        input_buffers.query_start_loc[: num_reqs + 1].copy_(torch.from_numpy(qsl).to(input_buffers.device))
        input_buffers.query_start_loc[num_reqs + 1:] = num_tokens
        input_buffers.input_ids[:num_tokens].zero_()
        input_buffers.positions[:num_tokens].zero_()
        return cls(num_reqs, num_tokens, num_scheduled_tokens, input_buffers.query_start_loc[: num_reqs + 1],
                   input_buffers.seq_lens[:num_reqs], seq_lens_cpu)


# --- vllm/v1/worker/gpu/block_table.py (one KV cache group) ---------------------------------------------------------------

class BlockTables:
    def __init__(self, device):
        self.block_size = BLOCK_SIZE
        self.input_block_table = torch.zeros(MAX_NUM_REQS, BLOCKS_PER_ROW, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((MAX_NUM_TOKENS,), PAD_SLOT_ID, dtype=torch.int64, device=device)


# --- attention: FlashAttentionImpl.forward as the eager splitting op -------------------------------------------------------

def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping):
    """One thread block per row of ``slot_mapping``; slot -1 is skipped."""
    slots = slot_mapping.tolist()
    for i, slot in enumerate(slots):
        if slot >= 0:
            key_cache[slot // BLOCK_SIZE, slot % BLOCK_SIZE] = key[i]
            value_cache[slot // BLOCK_SIZE, slot % BLOCK_SIZE] = value[i]


def flash_attn_varlen_func(q, k_cache, v_cache, out, cu_seqlens_q_cpu, seqused_k_cpu, block_table, softmax_scale):
    """Paged causal attention. The kernel gets ``block_table`` as a pointer plus a row stride and reads
    ``cdiv(seqused_k, block_size)`` page ids of each request's row, with no bound on the row."""
    mem, base = _pointer(block_table)
    stride = block_table.stride(0)
    for r in range(len(seqused_k_cpu)):
        q_start, q_end, seq_len = int(cu_seqlens_q_cpu[r]), int(cu_seqlens_q_cpu[r + 1]), int(seqused_k_cpu[r])
        if q_end == q_start:
            continue
        num_pages = -(-seq_len // BLOCK_SIZE)
        first = base + r * stride
        if first + num_pages > mem.numel():
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        pages = mem[first:first + num_pages].long()
        keys = k_cache[pages].reshape(-1, NUM_HEADS, HEAD_DIM)[:seq_len]
        vals = v_cache[pages].reshape(-1, NUM_HEADS, HEAD_DIM)[:seq_len]
        qr = q[q_start:q_end]
        scores = torch.einsum("qhd,khd->hqk", qr, keys) * softmax_scale
        q_pos = seq_len - (q_end - q_start) + torch.arange(q_end - q_start, device=q.device)
        causal = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        p = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", p, vals).reshape(q_end - q_start, -1)


# --- the model: one decoder layer split where vLLM splits it ----------------------------------------------------------------

class DecoderLayer:
    def __init__(self, device):
        gen = generator(49751)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)  # noqa: E731
        self.embed_tokens, self.embed_positions = r(VOCAB, HIDDEN, scale=1.0), r(MAX_MODEL_LEN, HIDDEN, scale=0.3)
        self.qkv_proj, self.o_proj = r(HIDDEN, 3 * NUM_HEADS * HEAD_DIM), r(NUM_HEADS * HEAD_DIM, HIDDEN)
        self.k_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
        self.v_cache = torch.zeros_like(self.k_cache)

    def piece_0(self, input_ids, positions):
        h = self.embed_tokens[input_ids] + self.embed_positions[positions]
        qkv = h @ self.qkv_proj
        return h, qkv

    def attention(self, qkv, attn_output, md):
        """``unified_attention_with_output``: runs eagerly between the pieces, on the real rows only."""
        n = md["num_actual_tokens"]
        q, k, v = qkv[:n].view(n, 3, NUM_HEADS, HEAD_DIM).unbind(1)
        reshape_and_cache_flash(k, v, self.k_cache, self.v_cache, md["slot_mapping"][:n])
        flash_attn_varlen_func(q, self.k_cache, self.v_cache, attn_output, md["query_start_loc_cpu"],
                               md["seq_lens_cpu"], md["block_table"], HEAD_DIM ** -0.5)

    def piece_1(self, h, attn_output):
        return (h + attn_output @ self.o_proj,)


# --- vllm/v1/worker/gpu/model_runner.py (reduced) -------------------------------------------------------------------------

class GPUModelRunner:
    def __init__(self, device, use_cuda_graph):
        self.device, self.use_cuda_graph = device, use_cuda_graph
        self.model = DecoderLayer(device)
        self.input_buffers = InputBuffers(MAX_NUM_REQS, MAX_NUM_TOKENS, device)
        self.block_tables = BlockTables(device)
        self.attn_output = torch.zeros(MAX_NUM_TOKENS, NUM_HEADS * HEAD_DIM, dtype=DTYPE, device=device)
        self.graphs = {}
        self.pool = graph_pool_handle(device) if use_cuda_graph else None
        self.req_state = {}                                  # req index -> (row, computed tokens)

    def _attn_metadata(self, num_reqs, num_tokens, qsl_np, seq_lens_cpu):
        return {"num_actual_tokens": num_tokens, "query_start_loc_cpu": qsl_np, "seq_lens_cpu": seq_lens_cpu,
                "slot_mapping": self.block_tables.slot_mapping,
                "block_table": self.block_tables.input_block_table[:num_reqs]}

    def _dummy_run(self, num_tokens):
        """Capture one size: dummy batch, attention metadata for it (#49364), two captured pieces."""
        num_reqs = min(num_tokens, MAX_NUM_REQS)
        batch = InputBatch.make_dummy(num_reqs, num_tokens, self.input_buffers)
        self.block_tables.slot_mapping.fill_(PAD_SLOT_ID)
        qsl_np = np.concatenate([[0], np.cumsum(batch.num_scheduled_tokens)])
        md = self._attn_metadata(num_reqs, num_tokens, qsl_np, batch.seq_lens_cpu.tolist())
        ids, pos = self.input_buffers.input_ids[:num_tokens], self.input_buffers.positions[:num_tokens]
        g0, out0 = capture(lambda: self.model.piece_0(ids, pos), device=self.device, pool=self.pool,
                           name=f"piece 0, size {num_tokens}", owner="GPUModelRunner",
                           static={"input_ids": self.input_buffers.input_ids,
                                   "positions": self.input_buffers.positions})
        attn_out = self.attn_output[:num_tokens]
        self.model.attention(out0[1], attn_out, md)
        g1, out1 = capture(lambda: self.model.piece_1(out0[0], attn_out), device=self.device, pool=self.pool,
                           name=f"piece 1, size {num_tokens}", owner="GPUModelRunner",
                           static={"attn_output": self.attn_output})
        self.graphs[num_tokens] = (g0, out0, g1, out1)

    def capture_model(self):
        for size in sorted(CUDAGRAPH_CAPTURE_SIZES, reverse=True):
            self._dummy_run(size)

    def execute_model(self, scheduled, token_ids):
        """``scheduled``: list of (request, num new tokens); requests get rows and blocks on first sight."""
        num_reqs, num_tokens = len(scheduled), sum(n for _, n in scheduled)
        qsl_np, seq_lens, pos, slots = [0], [], [], []
        bt = self.block_tables.input_block_table
        for i, (req, n) in enumerate(scheduled):
            start = self.req_state.get(req, 0)
            bt[i] = torch.arange(1 + req * BLOCKS_PER_ROW, 1 + (req + 1) * BLOCKS_PER_ROW, dtype=torch.int32)
            pos += list(range(start, start + n))
            slots += [(1 + req * BLOCKS_PER_ROW + p // BLOCK_SIZE) * BLOCK_SIZE + p % BLOCK_SIZE
                      for p in range(start, start + n)]
            self.req_state[req] = start + n
            seq_lens.append(start + n)
            qsl_np.append(qsl_np[-1] + n)
        self.input_buffers.input_ids[:num_tokens].copy_(torch.tensor(token_ids, dtype=torch.int64))
        self.input_buffers.positions[:num_tokens].copy_(torch.tensor(pos, dtype=torch.int64))
        self.block_tables.slot_mapping.fill_(PAD_SLOT_ID)
        self.block_tables.slot_mapping[:num_tokens].copy_(torch.tensor(slots, dtype=torch.int64))
        md = self._attn_metadata(num_reqs, num_tokens, qsl_np, seq_lens)
        if not self.use_cuda_graph:
            h, qkv = self.model.piece_0(self.input_buffers.input_ids[:num_tokens],
                                        self.input_buffers.positions[:num_tokens])
            attn_out = self.attn_output[:num_tokens]
            self.model.attention(qkv, attn_out, md)
            return self.model.piece_1(h, attn_out)[0]
        size = next(s for s in sorted(CUDAGRAPH_CAPTURE_SIZES) if s >= num_tokens)
        g0, out0, g1, out1 = self.graphs[size]
        padded = {"input_ids": self.input_buffers.input_ids[:size], "positions": self.input_buffers.positions[:size]}
        replay(g0, out0, real=num_tokens, size=size, padded=padded)
        self.model.attention(out0[1], self.attn_output[:size], md)
        (hidden,) = replay(g1, out1, real=num_tokens, size=size,
                           padded={"attn_output": self.attn_output[:size]})
        return hidden[:num_tokens]


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant

    def serve(use_cuda_graph):
        runner = GPUModelRunner(device, use_cuda_graph)
        if use_cuda_graph:
            runner.capture_model()
        gen = generator(497510)
        steps = [[(0, 3), (1, 2)], [(0, 1), (1, 1)], [(2, 4), (0, 1), (1, 1)], [(0, 1), (1, 1), (2, 1)]]
        outs = []
        for scheduled in steps:
            n = sum(k for _, k in scheduled)
            ids = torch.randint(0, VOCAB, (n,), generator=gen).tolist()
            outs.append(runner.execute_model(scheduled, ids).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
