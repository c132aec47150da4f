"""DP + MTP on DeepSeek-V3.2: an idle rank's padded FULL-graph dummy run expands stale ``query_start_loc`` rows past the sparse indexer's ``arange_buffer``.

Upstream: https://github.com/vllm-project/vllm/pull/39277 ("[Bugfix][MLA] Size arange_buffer to
max_num_batched_tokens to prevent CUDA IMA", vllm-project/vllm, opened 2026-04-08, merged). Read: the PR description (its
five-step mechanism: ``execute_dummy_batch`` makes a 1-request batch, ``_build_attention_metadata`` uses
``num_reqs_padded`` = the CUDA-graph bucket, the padded ``query_start_loc`` entries keep values of an earlier real
batch, ``split_decodes_and_prefills`` classes every padded request as a decode because ``max_query_len <=
decode_threshold``, so the flattening path's ``actual_expanded = sum(decode_lens)`` outgrows
``arange_buffer[:actual_expanded]``, sized ``max_num_seqs * next_n`` while ``expanded_seq_lens_buffer`` and
``expanded_block_table_buffer`` use ``max_num_batched_tokens``); the pre-fix ``DeepseekV32IndexerMetadataBuilder``
(``__init__`` and the flattened decode branch of ``build``: ``expanded_base`` / ``expanded_starts`` /
``positions_within``, in a stored downstream copy of ``vllm/v1/attention/backends/mla/indexer.py`` that still has
``torch.arange(max_num_seqs * next_n)``) and the current upstream file (``arange_buffer`` of
``max(max_num_seqs * next_n, max_num_batched_tokens)``). The diff itself and the runner's dummy-run code were not read;
``_dummy_run`` / ``_prepare_inputs`` below are reconstructed from the description.
Symptom: DeepSeek-V3.2 with data parallelism and MTP (``num_speculative_tokens`` whose ``next_n`` is not natively
supported, so the indexer flattens decode) dies with ``CUDA error: an illegal memory access`` surfacing
asynchronously at a later sync, on a rank that went idle after serving a batch with many tokens.
Mechanism: real steps fill ``query_start_loc`` past the real requests with the batch's last offset. The idle rank's
dummy run writes only its one request's entries, then builds metadata for the bucket's ``num_reqs_padded`` requests,
so the padded entries are the previous batch's token total: ``decode_lens`` = diffs of the stale offsets, and their
sum is that total (up to ``max_num_batched_tokens``), not ``num_reqs_padded * next_n``. The flattening writes
``actual_expanded`` rows; ``arange_buffer`` holds only ``max_num_seqs * next_n``. Upstream the overrun is an
out-of-bounds device write; in PyTorch the short slice makes ``positions_within`` fail to broadcast.
Doctor: undersized-buffer, at __init__. ``DeepseekV32IndexerMetadataBuilder.__init__`` sizes the persistent
``arange_buffer`` for ``max_num_seqs * next_n`` rows while a step padded to a graph bucket can ask the flattened
decode metadata for up to ``max_num_batched_tokens`` rows.
Fix (upstream): allocate ``arange_buffer`` with ``max_num_batched_tokens`` entries (now
``max(max_num_seqs * next_n, max_num_batched_tokens)``), like the other flattening buffers.
Modelled: ``DeepseekV32IndexerMetadataBuilder`` (``__init__`` buffers, ``build``'s decode path with flattening,
the block-table clamp) and ``split_decodes_and_prefills`` line by line; ``CommonAttentionMetadata``,
``CpuGpuBuffer`` and a runner with ``_prepare_inputs`` (tail of ``query_start_loc`` filled with the last offset,
``seq_lens`` tail zeroed, slot mapping padded with -1), ``_dummy_run`` (capture and DP idle step) and one FULL
uniform-decode graph (4 requests x 3 tokens). Stand-ins: the model is one sparse-indexer layer
(``q``/``k``/``weights`` projections, ``k`` written to the paged indexer cache through ``slot_mapping``, paged MQA
logits masked at each flattened token's context length, top-k, a softmax-weighted read-out); prefill runs eagerly
through a per-token metadata stand-in (upstream uses the prefill chunk path); DP coordination is reduced to "the
other rank has four requests", so every step here is padded to the 12-token / 4-request graph. float64, no fp8.
Workload: step 1 prefills A (13 tokens) and B (11) eagerly, leaving offsets [0, 13, 24, 24, 24]; step 2 is an idle
DP step (dummy run, 1 request of 3 tokens, padded to 4 requests): offsets [0, 3, 24, 24, 24], ``actual_expanded`` 24
against an ``arange_buffer`` of 4 * 3 = 12; steps 3 and 4 decode A and B (3 tokens each, padded to 12). The bug
raises RuntimeError in ``build`` (size 12 vs 24) at step 2; the fix replays the dummy step and both decode steps,
equal to eager on the prefill and decode outputs (max error 0).
"""
from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/39277"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "__init__"
SYMPTOM = ("DeepSeek-V3.2 with DP + MTP: an idle rank's padded dummy run flattens stale query_start_loc rows past the "
           "indexer's arange_buffer (max_num_seqs * next_n entries): illegal memory access upstream")

MAX_NUM_SEQS, NUM_SPECULATIVE_TOKENS = 4, 2
NEXT_N = NUM_SPECULATIVE_TOKENS + 1
MAX_NUM_BATCHED_TOKENS = 48
BLOCK_SIZE, MAX_BLOCKS_PER_REQ = 4, 8
MAX_MODEL_LEN = BLOCK_SIZE * MAX_BLOCKS_PER_REQ
NUM_BLOCKS = 1 + MAX_NUM_SEQS * MAX_BLOCKS_PER_REQ          # block 0: the null block
HIDDEN, INDEX_N_HEADS, INDEX_HEAD_DIM, INDEX_TOPK = 8, 2, 4, 4
CUDAGRAPH_CAPTURE_SIZE = MAX_NUM_SEQS * NEXT_N               # FULL uniform decode: 4 requests x next_n
PADDING_SLOT_ID = -1
DTYPE = torch.float64

_variant = "bug"


# --- vllm/v1/utils.py CpuGpuBuffer ---------------------------------------------------------------------------------------

class CpuGpuBuffer:
    def __init__(self, *size, dtype, device):
        self.cpu = torch.zeros(*size, dtype=dtype)
        self.np = self.cpu.numpy()
        self.gpu = torch.zeros(*size, dtype=dtype, device=device)

    def copy_to_gpu(self, n: int | None = None) -> torch.Tensor:
        if n is None:
            return self.gpu.copy_(self.cpu.to(self.gpu.device))
        return self.gpu[:n].copy_(self.cpu[:n].to(self.gpu.device))


# --- vllm/v1/attention/backends/utils.py ---------------------------------------------------------------------------------

@dataclasses.dataclass
class CommonAttentionMetadata:
    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor


def split_decodes_and_prefills(common_attn_metadata, decode_threshold=1, require_uniform=False):
    max_query_len = common_attn_metadata.max_query_len
    num_reqs = common_attn_metadata.num_reqs
    num_tokens = common_attn_metadata.num_actual_tokens
    query_start_loc = common_attn_metadata.query_start_loc_cpu
    if max_query_len <= decode_threshold and (not require_uniform or decode_threshold <= 1):
        return num_reqs, 0, num_tokens, 0
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    if query_lens[0].item() > decode_threshold:
        return 0, num_reqs, 0, num_tokens
    is_prefill = query_lens > decode_threshold
    if not torch.any(is_prefill):
        return num_reqs, 0, num_tokens, 0
    first_prefill = int(is_prefill.int().argmax(dim=-1).item())
    num_decode_tokens = int(query_start_loc[first_prefill].item())
    return first_prefill, num_reqs - first_prefill, num_decode_tokens, num_tokens - num_decode_tokens


# --- vllm/v1/attention/backends/mla/indexer.py ---------------------------------------------------------------------------

@dataclasses.dataclass
class DeepSeekV32IndexerDecodeMetadata:
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    decode_lens: torch.Tensor


@dataclasses.dataclass
class DeepseekV32IndexerMetadata:
    slot_mapping: torch.Tensor
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    decode: DeepSeekV32IndexerDecodeMetadata | None = None


class DeepseekV32IndexerMetadataBuilder:
    reorder_batch_threshold: int = 1
    natively_supported_next_n: list[int] = [1, 2]

    def __init__(self, device):
        self.device = device
        self.num_speculative_tokens = NUM_SPECULATIVE_TOKENS
        next_n = self.num_speculative_tokens + 1
        self.reorder_batch_threshold += self.num_speculative_tokens
        self.use_flattening = next_n not in self.natively_supported_next_n
        self.decode_lens_buffer = torch.zeros(MAX_NUM_BATCHED_TOKENS, dtype=torch.int32, device=device)
        self.offsets_buffer = torch.arange(next_n, device=device, dtype=torch.int32)
        if _variant == "bug":
            self.arange_buffer = torch.arange(MAX_NUM_SEQS * next_n, dtype=torch.int32, device=device)
        else:
            self.arange_buffer = torch.arange(max(MAX_NUM_SEQS * next_n, MAX_NUM_BATCHED_TOKENS), dtype=torch.int32,
                                              device=device)
        self.expanded_seq_lens_buffer = torch.zeros(MAX_NUM_BATCHED_TOKENS, dtype=torch.int32, device=device)
        self.expanded_block_table_buffer = torch.zeros(MAX_NUM_BATCHED_TOKENS, MAX_BLOCKS_PER_REQ, dtype=torch.int32,
                                                       device=device)

    def build(self, common_prefix_len, common_attn_metadata: CommonAttentionMetadata) -> DeepseekV32IndexerMetadata:
        num_reqs = common_attn_metadata.num_reqs
        num_tokens = common_attn_metadata.num_actual_tokens
        num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = split_decodes_and_prefills(
            common_attn_metadata, decode_threshold=self.reorder_batch_threshold,
            require_uniform=not self.use_flattening)
        assert num_decodes + num_prefills == num_reqs
        assert num_decode_tokens + num_prefill_tokens == num_tokens
        assert num_prefills == 0, "prefill batches run through the eager prefill stand-in here"

        decode_metadata = None
        if num_decodes > 0:
            torch.diff(common_attn_metadata.query_start_loc[: num_decodes + 1],
                       out=self.decode_lens_buffer[:num_decodes])
            decode_lens = self.decode_lens_buffer[:num_decodes]
            decode_lens_cpu = torch.diff(common_attn_metadata.query_start_loc_cpu[: num_decodes + 1])
            seq_lens = common_attn_metadata.seq_lens[:num_decodes]
            block_table = common_attn_metadata.block_table_tensor[:num_decodes, ...]
            # Padded CUDA graph requests may hold -1 block ids; clamp to 0 (their seq_lens are 0).
            block_table.clamp_(min=0)
            max_decode_len = int(decode_lens_cpu.max().item())
            if max_decode_len > 1:
                # Flatten multi-token decode requests into single-token rows (the kernel then sees next_n=1).
                actual_expanded = int(decode_lens_cpu.sum().item())
                expanded_base = torch.repeat_interleave(seq_lens - decode_lens, decode_lens,
                                                        output_size=actual_expanded)
                expanded_starts = torch.repeat_interleave(common_attn_metadata.query_start_loc[:num_decodes],
                                                          decode_lens, output_size=actual_expanded)
                positions_within = self.arange_buffer[:actual_expanded] - expanded_starts
                self.expanded_seq_lens_buffer[:actual_expanded] = expanded_base + positions_within + 1
                self.expanded_seq_lens_buffer[actual_expanded:] = 0
                seq_lens = self.expanded_seq_lens_buffer[:num_decode_tokens]
                self.expanded_block_table_buffer[:actual_expanded] = torch.repeat_interleave(
                    block_table, decode_lens, dim=0, output_size=actual_expanded)
                if actual_expanded < num_decode_tokens:
                    self.expanded_block_table_buffer[actual_expanded:num_decode_tokens, 0] = 0
                block_table = self.expanded_block_table_buffer[:num_decode_tokens]
                self.decode_lens_buffer[:num_decode_tokens] = 1
                decode_lens = self.decode_lens_buffer[:num_decode_tokens]
            decode_metadata = DeepSeekV32IndexerDecodeMetadata(block_table=block_table, seq_lens=seq_lens,
                                                               decode_lens=decode_lens)
        return DeepseekV32IndexerMetadata(slot_mapping=common_attn_metadata.slot_mapping, num_decodes=num_decodes,
                                          num_decode_tokens=num_decode_tokens, num_prefills=num_prefills,
                                          num_prefill_tokens=num_prefill_tokens, decode=decode_metadata)


# --- the model: one sparse-indexer layer (stand-in for DeepseekV32 Indexer + sparse_attn_indexer) ------------------------

def fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table):
    """Per flattened row: ``sum_h relu(q[h] . k_j) * w[h]`` over the row's paged context; ``j >= context_len`` masked."""
    j = torch.arange(MAX_MODEL_LEN, device=q.device)
    blocks = block_table[:, j // BLOCK_SIZE].long()
    keys = kv_cache[blocks, (j % BLOCK_SIZE).expand_as(blocks)]                    # [T, MAX_MODEL_LEN, D]
    scores = torch.relu(torch.einsum("thd,tjd->thj", q, keys))
    logits = (scores * weights.unsqueeze(-1)).sum(1)
    return logits.masked_fill(j.unsqueeze(0) >= context_lens.unsqueeze(1).long(), -1e30), keys


class SparseIndexerLayer:
    def __init__(self, device):
        gen = generator(39277)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)  # noqa: E731
        self.wq_b = r(HIDDEN, INDEX_N_HEADS * INDEX_HEAD_DIM, scale=0.8)
        self.wk = r(HIDDEN, INDEX_HEAD_DIM, scale=0.8)
        self.weights_proj = r(HIDDEN, INDEX_N_HEADS, scale=0.8)
        self.o_proj = r(INDEX_HEAD_DIM, HIDDEN)
        self.k_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, INDEX_HEAD_DIM, dtype=DTYPE, device=device)

    def forward(self, hidden_states, slot_mapping, seq_lens, block_table):
        q = (hidden_states @ self.wq_b).view(-1, INDEX_N_HEADS, INDEX_HEAD_DIM)
        k = hidden_states @ self.wk
        weights = (hidden_states @ self.weights_proj) * INDEX_HEAD_DIM ** -0.5 * INDEX_N_HEADS ** -0.5
        # indexer_k_quant_and_cache: padded slots (-1) land in the null block
        self.k_cache.view(-1, INDEX_HEAD_DIM).index_copy_(0, slot_mapping.clamp(min=0).long(), k)
        logits, keys = fp8_paged_mqa_logits(q, self.k_cache, weights, seq_lens, block_table)
        top_vals, topk_indices = logits.topk(INDEX_TOPK, dim=-1)
        picked = keys.gather(1, topk_indices.unsqueeze(-1).expand(-1, -1, INDEX_HEAD_DIM))
        out = (torch.softmax(top_vals, -1).unsqueeze(-1) * picked).sum(1)
        return hidden_states + out @ self.o_proj


# --- vllm/v1/worker/gpu_model_runner.py (reduced) -------------------------------------------------------------------------

class GPUModelRunner:
    def __init__(self, device, use_cuda_graph):
        self.device, self.use_cuda_graph = device, use_cuda_graph
        self.model = SparseIndexerLayer(device)
        self.builder = DeepseekV32IndexerMetadataBuilder(device)
        self.query_start_loc = CpuGpuBuffer(MAX_NUM_SEQS + 1, dtype=torch.int32, device=device)
        self.seq_lens = CpuGpuBuffer(MAX_NUM_SEQS, dtype=torch.int32, device=device)
        self.block_table = CpuGpuBuffer(MAX_NUM_SEQS, MAX_BLOCKS_PER_REQ, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((MAX_NUM_BATCHED_TOKENS,), PADDING_SLOT_ID, dtype=torch.int64, device=device)
        self.hidden_states = torch.zeros(MAX_NUM_BATCHED_TOKENS, HIDDEN, dtype=DTYPE, device=device)
        self.graph = self.graph_out = None
        self.computed = {}                                   # req index -> tokens in the KV cache

    def _common_metadata(self, num_reqs_padded, num_tokens_padded, max_query_len):
        return CommonAttentionMetadata(
            query_start_loc=self.query_start_loc.gpu[: num_reqs_padded + 1],
            query_start_loc_cpu=self.query_start_loc.cpu[: num_reqs_padded + 1],
            seq_lens=self.seq_lens.gpu[:num_reqs_padded], num_reqs=num_reqs_padded,
            num_actual_tokens=num_tokens_padded, max_query_len=max_query_len,
            max_seq_len=int(self.seq_lens.cpu[:num_reqs_padded].max()),
            block_table_tensor=self.block_table.gpu[:num_reqs_padded], slot_mapping=self.slot_mapping[:num_tokens_padded])

    def _forward_graph(self, md):
        return self.model.forward(self.hidden_states[:CUDAGRAPH_CAPTURE_SIZE], self.slot_mapping[:CUDAGRAPH_CAPTURE_SIZE],
                                  md.decode.seq_lens, md.decode.block_table)

    def _dummy_run(self, num_tokens, num_reqs_padded=None, capture_graph=False):
        num_reqs = -(-num_tokens // NEXT_N)
        self.query_start_loc.np[0] = 0
        self.query_start_loc.np[1:num_reqs + 1] = [NEXT_N * (i + 1) for i in range(num_reqs)]
        self.query_start_loc.copy_to_gpu()
        self.seq_lens.np[:num_reqs] = NEXT_N
        self.seq_lens.np[num_reqs:] = 0
        self.seq_lens.copy_to_gpu()
        self.block_table.np[:num_reqs] = 0
        self.block_table.copy_to_gpu()
        self.slot_mapping.fill_(PADDING_SLOT_ID)
        num_reqs_padded = num_reqs if num_reqs_padded is None else num_reqs_padded
        num_tokens_padded = num_reqs_padded * NEXT_N
        md = self.builder.build(0, self._common_metadata(num_reqs_padded, num_tokens_padded, NEXT_N))
        if capture_graph:
            self.graph, self.graph_out = capture(
                lambda: self._forward_graph(md), device=self.device, warmups=1, name="FULL decode (4 reqs)",
                owner="GPUModelRunner", state={"indexer_k_cache": self.model.k_cache},
                static={"hidden_states": self.hidden_states, "slot_mapping": self.slot_mapping,
                        "decode_seq_lens": self.builder.expanded_seq_lens_buffer,
                        "decode_block_table": self.builder.expanded_block_table_buffer})
        elif self.use_cuda_graph:
            replay(self.graph, self.graph_out, real=num_tokens, size=CUDAGRAPH_CAPTURE_SIZE,
                   padded={"hidden_states": self.hidden_states[:CUDAGRAPH_CAPTURE_SIZE]})
        else:
            self.model.forward(self.hidden_states[:num_tokens], self.slot_mapping[:num_tokens], md.decode.seq_lens,
                               md.decode.block_table)

    def capture_model(self):
        self._dummy_run(CUDAGRAPH_CAPTURE_SIZE, capture_graph=True)

    def execute_dummy_batch(self):
        """An idle DP rank: one dummy request, padded to the DP group's graph bucket."""
        self._dummy_run(NEXT_N, num_reqs_padded=MAX_NUM_SEQS if self.use_cuda_graph else None)

    def _prepare_inputs(self, scheduled, hidden):
        num_reqs, cu = len(scheduled), 0
        slots = []
        self.query_start_loc.np[0] = 0
        for i, (req, n) in enumerate(scheduled):
            start = self.computed.get(req, 0)
            self.block_table.np[i] = [1 + req * MAX_BLOCKS_PER_REQ + b for b in range(MAX_BLOCKS_PER_REQ)]
            slots += [int(self.block_table.np[i][p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
                      for p in range(start, start + n)]
            cu += n
            self.query_start_loc.np[i + 1] = cu
            self.seq_lens.np[i] = start + n
            self.computed[req] = start + n
        self.query_start_loc.np[num_reqs + 1:] = cu
        self.seq_lens.np[num_reqs:] = 0
        self.query_start_loc.copy_to_gpu()
        self.seq_lens.copy_to_gpu()
        self.block_table.copy_to_gpu()
        self.slot_mapping.fill_(PADDING_SLOT_ID)
        self.slot_mapping[:cu].copy_(torch.tensor(slots, dtype=torch.int64))
        self.hidden_states[:cu].copy_(hidden)
        return num_reqs, cu

    def execute_model(self, scheduled, hidden):
        num_reqs, num_tokens = self._prepare_inputs(scheduled, hidden)
        if any(n != NEXT_N for _, n in scheduled):
            return self._prefill_forward(scheduled, num_tokens)
        if not self.use_cuda_graph:
            md = self.builder.build(0, self._common_metadata(num_reqs, num_tokens, NEXT_N))
            return self.model.forward(self.hidden_states[:num_tokens], self.slot_mapping[:num_tokens],
                                      md.decode.seq_lens, md.decode.block_table)
        self.builder.build(0, self._common_metadata(MAX_NUM_SEQS, CUDAGRAPH_CAPTURE_SIZE, NEXT_N))
        out = replay(self.graph, self.graph_out, real=num_tokens, size=CUDAGRAPH_CAPTURE_SIZE,
                     padded={"hidden_states": self.hidden_states[:CUDAGRAPH_CAPTURE_SIZE]})
        return out[:num_tokens].clone()

    def _prefill_forward(self, scheduled, num_tokens):
        """Eager prefill (stand-in for the indexer's prefill chunk path): per-token causal context lengths."""
        ctx, rows = [], []
        for i, (req, n) in enumerate(scheduled):
            start = self.computed[req] - n
            ctx += [start + t + 1 for t in range(n)]
            rows += [i] * n
        seq_lens = torch.tensor(ctx, dtype=torch.int32, device=self.device)
        block_table = self.block_table.gpu[torch.tensor(rows, device=self.device)]
        return self.model.forward(self.hidden_states[:num_tokens], self.slot_mapping[:num_tokens], seq_lens,
                                  block_table)


@contextmanager
def _variant_set(variant):
    global _variant
    old, _variant = _variant, variant
    try:
        yield
    finally:
        _variant = old


def run(variant: str, device: str = "cpu"):
    def serve(use_cuda_graph):
        runner = GPUModelRunner(device, use_cuda_graph)
        if use_cuda_graph:
            runner.capture_model()
        gen = generator(392770)
        outs = []
        prompt = [(0, 13), (1, 11)]                            # requests A and B
        outs.append(runner.execute_model(prompt, randn(24, HIDDEN, gen=gen, device=device).to(DTYPE)).clone())
        runner.execute_dummy_batch()                          # this DP rank is idle for one step
        for _ in range(2):                                    # MTP verify steps: 1 + 2 draft tokens per request
            outs.append(runner.execute_model([(0, NEXT_N), (1, NEXT_N)],
                                             randn(2 * NEXT_N, HIDDEN, gen=gen, device=device).to(DTYPE)))
        return outs

    def served():
        with _variant_set(variant):
            return serve(True)

    def eager():
        with _variant_set(variant):
            return serve(False)

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
