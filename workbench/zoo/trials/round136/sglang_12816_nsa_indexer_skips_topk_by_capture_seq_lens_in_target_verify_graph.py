"""SGLang's DeepSeek-V3.2 NSA ``Indexer.forward_cuda`` decides on the host whether to skip the indexer's logits and
top-k: when ``max(forward_batch.seq_lens_cpu) <= index_topk`` every KV position would be selected anyway, so it only
stores the index keys and hands the sparse attention the first ``length`` positions. Before the fix the check ran for
every mode but decode, so also for TARGET_VERIFY (MTP / EAGLE verification), which runs as a CUDA graph. The
``CudaGraphRunner`` captures that graph on a dummy batch whose ``seq_lens_cpu`` holds the backend's fill value (1), so
the capture takes the shortcut and the graph records the k-only path; every replay then runs it, whatever the real
lengths: for contexts longer than ``index_topk`` the top-k kernel runs on a dummy all-zero logits buffer and the
attention reads positions the indexer never chose. Without CUDA graphs the same verify step sees the real lengths and
runs the indexer. The fix skips only for ``is_extend_without_speculative()`` (no graph involved).

Upstream: https://github.com/sgl-project/sglang/pull/12816 ("[Deepseek V3.2] Only skip Indexer logits computation
when is_extend_without_speculative", sgl-project/sglang, by Hao Lu (hlu1), PR dated 2025-11-07, merged; commit
bef37d6de86ac842541a10f0e54bd446732f19c9 on main, dated 2025-11-07, read in a stored mirror of the history, the fork
zcnrex/sglang). Read: the full diff of bef37d6de (``nsa_indexer.py``: in ``Indexer.forward_cuda`` the condition
``not forward_batch.forward_mode.is_decode_or_idle()`` becomes ``forward_batch.forward_mode.
is_extend_without_speculative()``, with the comment "We can only skip the logits computation if cuda graph is not
involved", and ``_forward_cuda_k_only`` asserts that mode; ``forward_batch_info.py``: ``ForwardMode.
is_extend_without_speculative``; ``deepseek_v2.py``: the module helper of that name replaced by the method, and the
MHA-path indexer call no longer gated by it) and the PR description in the stored issue corpus. At the parent
(bef37d6de^): ``layers/attention/nsa/nsa_indexer.py`` (``BaseIndexerMetadata``, ``Indexer.forward_cuda``,
``_forward_cuda_k_only`` with its ``dummy_logits = torch.zeros(n, index_topk)`` and ``metadata.topk_transform``,
``_get_k_bf16``, ``_get_topk_paged`` with ``get_paged_mqa_logits_metadata`` / ``fp8_paged_mqa_logits`` over
``max_seq_len = block_tables.shape[1] * page_size`` columns and the expanded seqlens for target verify,
``_get_topk_ragged``); ``layers/attention/nsa_backend.py`` (``NSAIndexerMetadata.topk_transform`` ->
``fast_topk_transform_fused``; ``init_forward_metadata``, ``init_cuda_graph_state``,
``init_forward_metadata_capture_cuda_graph`` and ``init_forward_metadata_replay_cuda_graph`` target-verify branches:
``seqlens_expanded = arange(kv_len - qo_len + 1, kv_len + 1)`` per request with ``kv_len = seq_len +
num_draft_tokens``, the page table repeated per draft token, written into the static ``page_table`` at replay;
``forward_extend`` MLA path saving the KV first; ``get_cuda_graph_seq_len_fill_value`` = 1; ``get_indexer_metadata``);
``model_executor/cuda_graph_runner.py`` (``__init__``: TARGET_VERIFY capture mode with ``num_tokens_per_bs =
speculative_num_draft_tokens``, ``seq_lens_cpu = torch.full(max_bs, fill)``, zero ``req_pool_indices`` and
``out_cache_loc``; ``capture_one_batch_size``: the ForwardBatch with ``seq_lens_cpu``, the backend's capture metadata,
two warm-up ``run_once`` calls, then the capture; ``replay_prepare``: inputs and ``seq_lens_cpu`` copied in, the
backend's replay metadata); ``models/deepseek_v2.py`` (``forward_absorb_prepare`` calls ``self.indexer`` in every mode,
``forward_absorb_core`` passes ``topk_indices`` to ``attn_mqa``); ``sgl-kernel/csrc/elementwise/topk.cu``
(``naive_topk_transform`` when ``length <= TopK``; otherwise ``fast_topk_cuda_tl(score, ..., length)`` with ``score =
input + bid * input_stride``). Also read: the diffs of f235498ec (#11892, 2025-11-05, which added ``should_skip`` and
``_forward_cuda_k_only``: ``git log -S should_skip``) and 7257525cc (#12788, 2025-11-06, the PR the description names,
which enabled the MHA prefill path on B200).
Not read: the review thread and any issue; the sparse attention kernels (flashmla_sparse, fa3) and DeepGEMM's
``fp8_paged_mqa_logits`` sources; ``act_quant``, rotary and the Hadamard rotation; the EAGLE/MTP worker's draft and
accept logic.
Symptom: the PR: "on 8xB200 20-shot gsm8k with mtp on: Before fix: Accuracy: 0.008 / After fix: Accuracy: 0.947";
"when MLA is used (on B200 for example) and mtp is on, the bug is triggered".
Mechanism: ``forward_cuda`` reads ``forward_batch.seq_lens_cpu.max().item()``, host data, and picks a path in Python.
The TARGET_VERIFY graph is captured with ``seq_lens_cpu`` = 1 everywhere, so the recorded step is
``_forward_cuda_k_only``: index keys stored, then ``topk_transform`` of a zero ``[tokens, index_topk]`` buffer. At
replay the backend refreshes the expanded lengths (all above ``index_topk``), so the fused top-k kernel takes its
``length > TopK`` branch on that dummy buffer, reading ``length`` entries from a row ``index_topk`` wide: it selects
positions by zeros instead of by the indexer's scores. Eagerly the verify step's real ``seq_lens_cpu`` exceeds
``index_topk`` and the indexer runs.
Doctor: warmup-divergence, at forward_cuda. The captured step does other work than the eager step would: a branch
taken at capture from the capture batch's host lengths (the skip) differs from the one the replayed batches need;
``forward_cuda`` holds that branch and is the function the fix changes.
Fix (upstream): skip only when ``forward_mode.is_extend_without_speculative()``; TARGET_VERIFY and DRAFT_EXTEND (the
graph modes of speculative decoding) always run the indexer, so the graph records the logits and top-k.
Modelled: ``ForwardMode`` (``is_extend``, ``is_decode_or_idle``, ``is_target_verify``, ``is_draft_extend``,
``is_extend_without_speculative``), ``ForwardBatch``, ``ReqToTokenPool``, ``NSATokenToKVPool``
(``set_mla_kv_buffer``, ``set_index_k_and_scale_buffer``), ``NSAMetadata``, ``NSAIndexerMetadata``
(``get_seqlens_expanded``, ``get_page_table_64``, ``topk_transform``), ``fast_topk_transform_fused``,
``fp8_paged_mqa_logits``, ``Indexer`` (``forward_cuda``, ``_forward_cuda_k_only``, ``_get_q_k_bf16``,
``_get_k_bf16``, ``_get_topk_paged``), ``NativeSparseAttnBackend`` (``init_forward_metadata``,
``init_cuda_graph_state``, ``init_forward_metadata_capture_cuda_graph``, ``init_forward_metadata_replay_cuda_graph``,
``get_cuda_graph_seq_len_fill_value``, ``get_indexer_metadata``, ``forward_extend``), ``DeepseekV2AttentionMLA``
(``forward_absorb_prepare``, ``forward_absorb_core``), ``CudaGraphRunner`` (``__init__``, ``capture``,
``capture_one_batch_size``, ``replay_prepare``, ``replay``), ``ModelRunner.forward``.
Stand-ins: page size 1 for both the indexer's table (upstream 64, ``get_page_table_64``) and the attention's
``page_table_1``, one table here; float64 index keys without fp8 quantisation, scales, rotary or Hadamard rotation;
the indexer score of token t at position p is ``sum_h w[t,h] * relu(q[t,h] . k[p])`` scaled as
``_get_logits_head_gate`` does; sparse MLA attention is a softmax over the latent vectors of the selected slots
(``-1`` ignored), with the latent as value (absorbed MLA, no rope part). ``fast_topk_transform_fused`` for ``length >
TopK`` reads ``length`` floats from its row start; past a row of the dummy buffer it reads the next rows (zeros) and,
for the last rows, memory past the buffer: read here as zeros (a guess: on the GPU that memory holds whatever lies
there), and the kernel's choice among equal scores is taken as the lowest positions (a guess too; any choice that is
not the indexer's top-k changes the attention). The two-layer model has an embedding with a learned position table
(for rotary), a residual MLP and an LM head; no MTP draft model: the draft tokens are given, and every draft is
accepted. The prompts' KV and index keys are written directly (their prefill is not modelled), so only the
TARGET_VERIFY branches of the backend exist here (no ``_get_topk_ragged``, no decode or draft-extend metadata). One
capture size (2), so no padded rows; no DP attention, dual stream, torch.compile or LoRA.
Workload: 2 requests with prompts of 7 and 10 tokens (KV slots from 1; slot 0 is the padding slot), ``index_topk``
4, ``speculative_num_draft_tokens`` 2; three target-verify steps, each verifying 2 draft tokens per request and
accepting both; width 16, 2 heads, latent 8, float64. Outputs: each step's verify logits.
Measured: bug: misbehaves (max |graph - eager| = 4): both layers took ``_forward_cuda_k_only`` in the two warm-ups
and the capture (expanded lengths 2 and 3), and every replay (lengths 8 to 16) attends over each request's positions
0..3; the three steps' logits differ by 3.87, 4.00 and 3.15. Fix: equals eager (max |graph - eager| = 0): the capture
records the indexer's logits and top-k, and the replays select the positions the run without graphs selects. On the
CPU: 1.6 s for the bug variant (the first run, with torch's first-call costs), 0.6 s for the fix.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from workbench.engine import graph_pool_handle, host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/12816"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "forward_cuda"
SYMPTOM = ("DeepSeek-V3.2 with MTP under CUDA graphs: the target-verify graph is captured on dummy lengths of 1, so "
           "the NSA indexer's skip-top-k shortcut is recorded and every replay attends over positions chosen from "
           "zero scores instead of the indexer's top-k (gsm8k accuracy 0.008 instead of 0.947)")

DTYPE = torch.float64
HIDDEN, NUM_HEADS, KV_LORA_RANK, Q_LORA_RANK = 16, 2, 8, 8
INDEX_N_HEADS, INDEX_HEAD_DIM, INDEX_TOPK = 2, 8, 4
NUM_LAYERS, VOCAB, MAX_CONTEXT_LEN, NUM_KV_SLOTS = 2, 12, 24, 64
NUM_DRAFT_TOKENS = 2            # --speculative-num-draft-tokens
CAPTURE_BS = [2]

_variant = "bug"


# --- sglang/srt/model_executor/forward_batch_info.py (reduced) -------------------------------------------------------

class ForwardMode(enum.IntEnum):
    EXTEND = enum.auto()
    DECODE = enum.auto()
    TARGET_VERIFY = enum.auto()
    DRAFT_EXTEND = enum.auto()
    IDLE = enum.auto()

    def is_extend(self):
        return self in (ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND)

    def is_decode_or_idle(self):
        return self in (ForwardMode.DECODE, ForwardMode.IDLE)

    def is_target_verify(self):
        return self == ForwardMode.TARGET_VERIFY

    def is_draft_extend(self):
        return self == ForwardMode.DRAFT_EXTEND

    def is_extend_without_speculative(self):
        return self.is_extend() and not self.is_target_verify() and not self.is_draft_extend()


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor | None
    out_cache_loc: torch.Tensor
    positions: torch.Tensor
    req_to_token_pool: object
    token_to_kv_pool: object
    attn_backend: object


# --- memory pools (reduced) ------------------------------------------------------------------------------------------

class ReqToTokenPool:
    def __init__(self, size, max_context_len, device):
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64, device=device)


class NSATokenToKVPool:
    """The latent KV (``kv_buffer``) and the indexer's keys (``index_k_with_scale_buffer``) per layer."""

    def __init__(self, size, device):
        self.kv_buffer = [torch.zeros(size, KV_LORA_RANK, dtype=DTYPE, device=device) for _ in range(NUM_LAYERS)]
        self.index_k_buffer = [torch.zeros(size, INDEX_HEAD_DIM, dtype=DTYPE, device=device)
                               for _ in range(NUM_LAYERS)]

    def set_mla_kv_buffer(self, layer_id, loc, cache_k):
        self.kv_buffer[layer_id][loc] = cache_k

    def set_index_k_and_scale_buffer(self, layer_id, loc, index_k):
        self.index_k_buffer[layer_id][loc] = index_k


# --- sgl-kernel / deep_gemm stand-ins ---------------------------------------------------------------------------------

def fp8_paged_mqa_logits(q, index_k_cache, weights, block_tables):
    """Score of token t at column p: sum_h w[t,h] * relu(q[t,h] . k[block_tables[t, p]]) (no cleaning of columns past
    the token's length, as ``clean_logits=False``)."""
    k = index_k_cache[block_tables]                                      # [T, W, d]
    dots = (q[:, :, None, :] * k[:, None, :, :]).sum(-1)                 # [T, H, W]
    return (torch.relu(dots) * weights[:, :, None]).sum(1)               # [T, W]


def fast_topk_transform_fused(score, lengths, page_table_size_1, topk):
    """Per row: ``length <= topk``: the first ``length`` page-table entries, then -1; otherwise the page-table entries
    of the ``topk`` best of the ``length`` floats read from the row's start (``score + row * stride``)."""
    rows, stride = score.shape
    width = page_table_size_1.shape[1]
    pos = torch.arange(width, device=score.device)
    naive = torch.where(pos[None, :topk] < lengths[:, None], page_table_size_1[:, :topk], -1)
    flat = torch.cat([score.reshape(-1), score.new_zeros(width)])        # past the buffer: read as zeros (stand-in)
    read = flat[torch.arange(rows, device=score.device)[:, None] * stride + pos[None, :]]
    read = read.masked_fill(pos[None, :] >= lengths[:, None], float("-inf"))
    best = torch.sort(read, dim=1, descending=True, stable=True).indices[:, :topk]
    fast = torch.gather(page_table_size_1, 1, best)
    return torch.where((lengths <= topk)[:, None], naive, fast)


# --- sglang/srt/layers/attention/nsa_backend.py (reduced) ------------------------------------------------------------

@dataclass
class NSAMetadata:
    cache_seqlens_int32: torch.Tensor
    page_table_1: torch.Tensor              # [tokens, width] KV slots, page size 1
    nsa_seqlens_expanded: torch.Tensor      # [tokens] each token's KV length


@dataclass(frozen=True)
class NSAIndexerMetadata:
    attn_metadata: NSAMetadata

    def get_seqlens_expanded(self):
        return self.attn_metadata.nsa_seqlens_expanded

    def get_page_table_64(self):
        return self.attn_metadata.page_table_1           # (page size 1 here, see Stand-ins)

    def topk_transform(self, logits, topk):
        return fast_topk_transform_fused(score=logits, lengths=self.get_seqlens_expanded(),
                                         page_table_size_1=self.attn_metadata.page_table_1, topk=topk)


def _seqlens_expanded(seq_lens_list, device):
    return torch.cat([torch.arange(kv_len - NUM_DRAFT_TOKENS + 1, kv_len + 1, dtype=torch.int64, device=device)
                      for kv_len in (s + NUM_DRAFT_TOKENS for s in seq_lens_list)])


class NativeSparseAttnBackend:
    def __init__(self, model_runner):
        self.device = model_runner.device
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.forward_metadata = None

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        assert forward_batch.forward_mode.is_target_verify()
        seq_lens_list = forward_batch.seq_lens_cpu.tolist()
        max_seqlen_k = max(seq_lens_list) + NUM_DRAFT_TOKENS
        page_table = self.req_to_token[forward_batch.req_pool_indices, :max_seqlen_k]
        self.forward_metadata = NSAMetadata(
            cache_seqlens_int32=forward_batch.seq_lens + NUM_DRAFT_TOKENS,
            page_table_1=torch.repeat_interleave(page_table, repeats=NUM_DRAFT_TOKENS, dim=0),
            nsa_seqlens_expanded=_seqlens_expanded(seq_lens_list, self.device))

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        self.decode_cuda_graph_metadata = {
            "cache_seqlens": torch.ones(max_num_tokens, dtype=torch.int64, device=self.device),
            "page_table": torch.zeros(max_num_tokens, MAX_CONTEXT_LEN, dtype=torch.int64, device=self.device)}
        self.graph_metadata = {}

    def init_forward_metadata_capture_cuda_graph(self, bs, num_tokens, req_pool_indices, seq_lens, forward_mode):
        assert forward_mode.is_target_verify()
        metadata = NSAMetadata(
            cache_seqlens_int32=self.decode_cuda_graph_metadata["cache_seqlens"][:bs],
            page_table_1=self.decode_cuda_graph_metadata["page_table"][:num_tokens, :],
            nsa_seqlens_expanded=_seqlens_expanded(seq_lens.tolist(), self.device))
        metadata.cache_seqlens_int32.copy_(seq_lens + NUM_DRAFT_TOKENS)
        self.graph_metadata[bs] = metadata
        self.forward_metadata = metadata

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, forward_mode, seq_lens_cpu):
        assert forward_mode.is_target_verify()
        metadata = self.graph_metadata[bs]
        seq_lens, seq_lens_cpu, req_pool_indices = seq_lens[:bs], seq_lens_cpu[:bs], req_pool_indices[:bs]
        max_seqlen_k = int(seq_lens_cpu.max().item() + NUM_DRAFT_TOKENS)
        metadata.cache_seqlens_int32.copy_(seq_lens + NUM_DRAFT_TOKENS)
        page_indices = self.req_to_token[req_pool_indices, :max_seqlen_k]
        page_indices = torch.repeat_interleave(page_indices, repeats=NUM_DRAFT_TOKENS, dim=0)
        metadata.page_table_1[:, :max_seqlen_k].copy_(page_indices)
        metadata.nsa_seqlens_expanded.copy_(_seqlens_expanded(seq_lens_cpu.tolist(), self.device))
        self.forward_metadata = metadata

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    def get_indexer_metadata(self, layer_id, forward_batch):
        return NSAIndexerMetadata(attn_metadata=self.forward_metadata)

    def forward_extend(self, q, k, layer_id, forward_batch: ForwardBatch, topk_indices):
        """MLA path: store the new latent KV, then sparse attention over the slots ``topk_indices`` names."""
        pool = forward_batch.token_to_kv_pool
        pool.set_mla_kv_buffer(layer_id, forward_batch.out_cache_loc, k)
        kv_cache = pool.kv_buffer[layer_id]
        page_table_1 = topk_indices                                       # NSA_FUSE_TOPK: already slots
        valid = page_table_1 >= 0
        kv = kv_cache[page_table_1.clamp(min=0)]                          # [T, topk, D]
        scores = torch.einsum("thd,tkd->thk", q, kv) * KV_LORA_RANK ** -0.5
        probs = torch.softmax(scores.masked_fill(~valid[:, None, :], float("-inf")), dim=-1)
        return torch.einsum("thk,tkd->thd", probs, kv)


# --- sglang/srt/layers/attention/nsa/nsa_indexer.py (reduced) --------------------------------------------------------

class Indexer:
    def __init__(self, layer_id, gen, device):
        self.layer_id, self.index_topk = layer_id, INDEX_TOPK
        self.n_heads, self.head_dim = INDEX_N_HEADS, INDEX_HEAD_DIM
        r = lambda *s: randn(*s, gen=gen, device=device, scale=s[0] ** -0.5).to(DTYPE)   # noqa: E731
        self.wq_b, self.wk, self.weights_proj = (r(Q_LORA_RANK, INDEX_N_HEADS * INDEX_HEAD_DIM),
                                                 r(HIDDEN, INDEX_HEAD_DIM), r(HIDDEN, INDEX_N_HEADS))

    def _get_k_bf16(self, x, positions):
        return x @ self.wk

    def _get_q_k_bf16(self, q_lora, x, positions):
        query = (q_lora @ self.wq_b).view(-1, self.n_heads, self.head_dim)
        return query, self._get_k_bf16(x, positions), x @ self.weights_proj

    def _get_logits_head_gate(self, weights):
        return weights * self.n_heads ** -0.5 * self.head_dim ** -0.5

    def _forward_cuda_k_only(self, x, positions, forward_batch: ForwardBatch, layer_id, metadata):
        if _variant == "fix":
            assert forward_batch.forward_mode.is_extend_without_speculative()      # added by #12816
        # Fast path: only compute and store k cache, skip all q and weights ops
        key = self._get_k_bf16(x, positions)
        forward_batch.token_to_kv_pool.set_index_k_and_scale_buffer(layer_id, forward_batch.out_cache_loc, key)
        # MLA: use dummy logits with topk kernel's fast path to generate indices
        seq_lens_expanded = metadata.get_seqlens_expanded()
        dummy_logits = torch.zeros(seq_lens_expanded.shape[0], self.index_topk, dtype=DTYPE, device=x.device)
        return metadata.topk_transform(dummy_logits, self.index_topk)

    def _get_topk_paged(self, forward_batch: ForwardBatch, layer_id, q, weights, metadata):
        block_tables = metadata.get_page_table_64()
        kv_cache = forward_batch.token_to_kv_pool.index_k_buffer[layer_id]
        logits = fp8_paged_mqa_logits(q, kv_cache, weights, block_tables)
        return metadata.topk_transform(logits, self.index_topk)

    def forward_cuda(self, x, q_lora, positions, forward_batch: ForwardBatch, layer_id):
        metadata = forward_batch.attn_backend.get_indexer_metadata(layer_id, forward_batch)
        if metadata is None:
            return None

        # Determine if should skip topk based on sequence length
        skip_logits_computation = False
        if _variant == "bug":
            take = not forward_batch.forward_mode.is_decode_or_idle()             # before #12816
        else:
            # We can only skip the logits computation if cuda graph is not involved (#12816)
            take = forward_batch.forward_mode.is_extend_without_speculative()
        if take and forward_batch.seq_lens_cpu is not None:
            max_kv_len = forward_batch.seq_lens_cpu.max().item()
            skip_logits_computation = max_kv_len <= self.index_topk

        if skip_logits_computation:
            return self._forward_cuda_k_only(x, positions, forward_batch, layer_id, metadata)

        query, key, weights = self._get_q_k_bf16(q_lora, x, positions)
        forward_batch.token_to_kv_pool.set_index_k_and_scale_buffer(layer_id, forward_batch.out_cache_loc, key)
        weights = self._get_logits_head_gate(weights)
        assert forward_batch.forward_mode.is_decode_or_idle() or forward_batch.forward_mode.is_target_verify()
        return self._get_topk_paged(forward_batch, layer_id, query, weights, metadata)

    __call__ = forward_cuda


# --- sglang/srt/models/deepseek_v2.py (reduced) ----------------------------------------------------------------------

class DeepseekV2AttentionMLA:
    def __init__(self, layer_id, gen, device):
        self.layer_id = layer_id
        r = lambda *s: randn(*s, gen=gen, device=device, scale=s[0] ** -0.5).to(DTYPE)   # noqa: E731
        self.q_a_proj, self.q_b_proj = r(HIDDEN, Q_LORA_RANK), r(Q_LORA_RANK, NUM_HEADS * KV_LORA_RANK)
        self.kv_a_proj, self.o_proj = r(HIDDEN, KV_LORA_RANK), r(NUM_HEADS * KV_LORA_RANK, HIDDEN)
        self.indexer = Indexer(layer_id, gen, device)

    def forward_absorb_prepare(self, positions, hidden_states, forward_batch):
        q_lora = hidden_states @ self.q_a_proj
        q_nope_out = (q_lora @ self.q_b_proj).view(-1, NUM_HEADS, KV_LORA_RANK)
        k_nope = hidden_states @ self.kv_a_proj
        topk_indices = self.indexer(x=hidden_states, q_lora=q_lora, positions=positions,
                                    forward_batch=forward_batch, layer_id=self.layer_id)
        return q_nope_out, k_nope, forward_batch, topk_indices

    def forward_absorb_core(self, q_nope_out, k_nope, forward_batch, topk_indices):
        attn_output = forward_batch.attn_backend.forward_extend(q_nope_out, k_nope, self.layer_id, forward_batch,
                                                                topk_indices)
        return attn_output.reshape(-1, NUM_HEADS * KV_LORA_RANK) @ self.o_proj

    def forward(self, positions, hidden_states, forward_batch):
        return self.forward_absorb_core(*self.forward_absorb_prepare(positions, hidden_states, forward_batch))


class DeepseekV32ForCausalLM:
    def __init__(self, device):
        gen = generator(12816)
        r = lambda *s, scale=1.0: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.embed_tokens = r(VOCAB, HIDDEN)
        self.pos_table = r(MAX_CONTEXT_LEN, HIDDEN, scale=0.3)          # stand-in for rotary positions
        self.layers = [DeepseekV2AttentionMLA(i, gen, device) for i in range(NUM_LAYERS)]
        self.mlp = [(r(HIDDEN, 2 * HIDDEN, scale=HIDDEN ** -0.5), r(2 * HIDDEN, HIDDEN, scale=(2 * HIDDEN) ** -0.5))
                    for _ in range(NUM_LAYERS)]
        self.lm_head = r(HIDDEN, VOCAB, scale=HIDDEN ** -0.5)

    def forward(self, input_ids, positions, forward_batch):
        h = self.embed_tokens[input_ids] + self.pos_table[positions]
        for attn, (w1, w2) in zip(self.layers, self.mlp):
            h = h + attn.forward(positions, h, forward_batch)
            h = h + torch.tanh(h @ w1) @ w2
        return h @ self.lm_head                                           # next_token_logits of every draft token


# --- sglang/srt/model_executor/cuda_graph_runner.py (reduced) --------------------------------------------------------

class CudaGraphRunner:
    def __init__(self, model_runner):
        self.model_runner, self.device = model_runner, model_runner.device
        self.graphs, self.output_buffers = {}, {}
        self.capture_bs = CAPTURE_BS
        self.capture_forward_mode = ForwardMode.TARGET_VERIFY              # spec algorithm is EAGLE (MTP)
        self.num_tokens_per_bs = NUM_DRAFT_TOKENS
        self.max_bs = max(self.capture_bs)
        self.max_num_token = self.max_bs * self.num_tokens_per_bs
        backend = self.model_runner.attn_backend
        backend.init_cuda_graph_state(self.max_bs, self.max_num_token)
        self.seq_len_fill_value = backend.get_cuda_graph_seq_len_fill_value()
        self.seq_lens_cpu = host(torch.full((self.max_bs,), self.seq_len_fill_value, dtype=torch.int64), self.device)
        i64 = dict(dtype=torch.int64, device=self.device)
        self.input_ids = torch.zeros((self.max_num_token,), **i64)
        self.req_pool_indices = torch.zeros((self.max_bs,), **i64)
        self.seq_lens = torch.full((self.max_bs,), self.seq_len_fill_value, **i64)
        self.out_cache_loc = torch.zeros((self.max_num_token,), **i64)
        self.positions = torch.zeros((self.max_num_token,), **i64)
        self.pool = graph_pool_handle(self.device)
        self.capture()

    def capture(self):
        for bs in self.capture_bs:
            self.graphs[bs], self.output_buffers[bs] = self.capture_one_batch_size(bs, self.model_runner.model.forward)

    def capture_one_batch_size(self, bs, forward):
        num_tokens = bs * self.num_tokens_per_bs
        mr = self.model_runner
        input_ids, positions = self.input_ids[:num_tokens], self.positions[:num_tokens]
        forward_batch = ForwardBatch(
            forward_mode=self.capture_forward_mode, batch_size=bs, input_ids=input_ids,
            req_pool_indices=self.req_pool_indices[:bs], seq_lens=self.seq_lens[:bs],
            seq_lens_cpu=self.seq_lens_cpu[:bs], out_cache_loc=self.out_cache_loc[:num_tokens], positions=positions,
            req_to_token_pool=mr.req_to_token_pool, token_to_kv_pool=mr.token_to_kv_pool, attn_backend=mr.attn_backend)
        mr.attn_backend.init_forward_metadata_capture_cuda_graph(
            bs, num_tokens, forward_batch.req_pool_indices, forward_batch.seq_lens, forward_batch.forward_mode)
        metadata, kv_pool = mr.attn_backend.graph_metadata[bs], mr.token_to_kv_pool

        def run_once():
            return forward(input_ids, forward_batch.positions, forward_batch)

        return capture(run_once, device=self.device, pool=self.pool, warmups=2, owner="CudaGraphRunner",
                       name=f"target_verify bs={bs}",
                       static={"input_ids": self.input_ids, "out_cache_loc": self.out_cache_loc,
                               "positions": self.positions, "page_table": metadata.page_table_1,
                               "nsa_seqlens_expanded": metadata.nsa_seqlens_expanded},
                       state={**{f"kv_buffer[{i}]": b for i, b in enumerate(kv_pool.kv_buffer)},
                              **{f"index_k_buffer[{i}]": b for i, b in enumerate(kv_pool.index_k_buffer)}})

    def replay_prepare(self, forward_batch: ForwardBatch):
        bs = forward_batch.batch_size
        assert bs in self.graphs
        num_tokens = bs * self.num_tokens_per_bs
        self.input_ids[:num_tokens].copy_(forward_batch.input_ids)
        self.req_pool_indices[:bs].copy_(forward_batch.req_pool_indices)
        self.seq_lens[:bs].copy_(forward_batch.seq_lens)
        self.out_cache_loc[:num_tokens].copy_(forward_batch.out_cache_loc)
        self.positions[:num_tokens].copy_(forward_batch.positions)
        self.seq_lens_cpu[:bs].copy_(forward_batch.seq_lens_cpu)
        self.model_runner.attn_backend.init_forward_metadata_replay_cuda_graph(
            bs, self.req_pool_indices, self.seq_lens, self.capture_forward_mode, self.seq_lens_cpu)
        return bs

    def replay(self, forward_batch: ForwardBatch):
        bs = self.replay_prepare(forward_batch)
        return replay(self.graphs[bs], self.output_buffers[bs])


class ModelRunner:
    def __init__(self, device, use_cuda_graph):
        self.device = device
        self.model = DeepseekV32ForCausalLM(device)
        self.req_to_token_pool = ReqToTokenPool(4, MAX_CONTEXT_LEN, device)
        self.token_to_kv_pool = NSATokenToKVPool(NUM_KV_SLOTS, device)
        self.attn_backend = NativeSparseAttnBackend(self)
        self.cuda_graph_runner = CudaGraphRunner(self) if use_cuda_graph else None

    def forward(self, forward_batch: ForwardBatch):
        if self.cuda_graph_runner is not None and forward_batch.batch_size in self.cuda_graph_runner.graphs:
            return self.cuda_graph_runner.replay(forward_batch)
        self.attn_backend.init_forward_metadata(forward_batch)
        return self.model.forward(forward_batch.input_ids, forward_batch.positions, forward_batch)


PROMPT_LENS = (7, 10)           # the two requests' prefilled lengths (> INDEX_TOPK)
REQS = (1, 2)                   # their rows in req_to_token (row 0: the capture's dummy request)
STEPS = 3


def _serve(device, use_cuda_graph):
    model_runner = ModelRunner(device, use_cuda_graph)
    req_to_token = model_runner.req_to_token_pool.req_to_token
    for n, r in enumerate(REQS):                                          # slot 0 stays the padding slot
        req_to_token[r] = torch.arange(1 + n * 30, 1 + n * 30 + MAX_CONTEXT_LEN, device=device)
    gen = generator(7)
    pool = model_runner.token_to_kv_pool
    for r, length in zip(REQS, PROMPT_LENS):                              # the prompts' prefill (not modelled)
        slots = req_to_token[r, :length]
        for layer in range(NUM_LAYERS):
            pool.kv_buffer[layer][slots] = randn(length, KV_LORA_RANK, gen=gen, device=device).to(DTYPE)
            pool.index_k_buffer[layer][slots] = randn(length, INDEX_HEAD_DIM, gen=gen, device=device).to(DTYPE)
    seq_lens = list(PROMPT_LENS)
    req_pool_indices = torch.tensor(REQS, device=device)
    outs = []
    for _ in range(STEPS):
        positions = torch.tensor([s + j for s in seq_lens for j in range(NUM_DRAFT_TOKENS)], device=device)
        draft_ids = torch.randint(0, VOCAB, (len(REQS) * NUM_DRAFT_TOKENS,), generator=gen).to(device)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int64)
        forward_batch = ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY, batch_size=len(REQS), input_ids=draft_ids,
            req_pool_indices=req_pool_indices, seq_lens=seq_lens_t.to(device), seq_lens_cpu=host(seq_lens_t, device),
            out_cache_loc=req_to_token[req_pool_indices.repeat_interleave(NUM_DRAFT_TOKENS), positions],
            positions=positions, req_to_token_pool=model_runner.req_to_token_pool, token_to_kv_pool=pool,
            attn_backend=model_runner.attn_backend)
        outs.append(model_runner.forward(forward_batch).clone())           # the verifier reads them before next step
        seq_lens = [s + NUM_DRAFT_TOKENS for s in seq_lens]               # every draft token accepted
    return outs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: _serve(device, True), lambda: _serve(device, False))
