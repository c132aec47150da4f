"""vLLM V1 FlashMLA with full CUDA graphs: the metadata builder adopts the tensors of its first decode build (the capture of the largest graph) as the persistent ``num_splits`` / tile-scheduler buffers, so a later decode batch with more requests than that capture does not fit them and the build fails.

Upstream: https://github.com/vllm-project/vllm/pull/21691 ("[BugFix] Fix IMA FlashMLA full cuda-graph and DP + Update
FlashMLA", vllm-project/vllm, by Lucas Wilkinson, opened 2025-07-27, merged in August 2025; it needs
vllm-project/FlashMLA#3, "vLLM Easier cudagraph integration"). Read: the PR description and review threads (gemini's
thread on the new ``__init__`` allocation in ``vllm/v1/attention/backends/mla/flashmla.py``; yewentao256's review
of 2025-08-07: ``vllm serve deepseek-ai/DeepSeek-V2-Lite --enable-expert-parallel --data-parallel-size 2 -O
'{"full_cuda_graph": true}' --cuda-graph-sizes 16 32 64 128 256 512``, "Originally: AssertionError" raised from
``compile_or_warm_up_model`` -> ``_dummy_run`` -> ``build_for_cudagraph_capture``, fixed by the PR); the pre-fix
``FlashMLAMetadataBuilder._build_decode`` (as copied verbatim into the MetaX plugin's ``MetaxFlashMLAMetadataBuilder``:
"First time around (CUDAGraph capture), allocate the static buffer", ``assert n <= self.cg_buf_num_splits.size(0)``,
``self.cg_buf_num_splits[n:].fill_(0)``); the post-fix ``__init__`` / ``_build_decode`` in a later revision of
``flashmla.py`` (buffers of ``(num_sms, 8)`` and ``max_num_seqs + 1``, ``[:sm_parts]`` view, tail filled with
``num_splits[-1]``); the ``_dummy_run`` of that period (``capture_attn_cudagraph``, ``seq_lens = max_model_len`` for
capture, DP padding); FlashMLA#3's description; FlashMLA (deepseek-ai/FlashMLA 287061e) ``get_mla_metadata_kernel``,
``flash_fwd_splitkv_mla_kernel`` (tile loop, ``num_splits_ptr[batch] + n_split_idx``) and
``flash_fwd_mla_combine_kernel``.
Symptom: DeepSeek MLA models with FlashMLA and ``full_cuda_graph`` fail with a bare ``AssertionError`` in the FlashMLA
metadata builder as soon as a decode batch has more requests than the largest captured graph (at start-up with DP=2 +
EP in the review's reproduction); the PR also fixes an illegal memory access on an llm-d wide-EP benchmark.
Mechanism: with full CUDA graphs the decode metadata the graph reads must live in persistent buffers. The pre-fix
builder had none: the first ``_build_decode`` (the capture of the largest graph, ``capture_model`` goes from the
largest size down) kept its freshly computed ``tile_scheduler_metadata`` and ``num_splits`` (``batch + 1`` entries)
as ``cg_buf_*``; every later build copies into them. But ``_build_decode`` uses the buffers whenever
``full_cuda_graph`` is on, also for decode batches larger than any capture size (they run without a graph, up to
``max_num_seqs``), and their ``num_splits`` does not fit: ``assert n <= self.cg_buf_num_splits.size(0)`` fails.
Doctor: undersized-buffer, at _build_decode. The static ``num_splits`` buffer is sized by the first (capture) build,
not by the most requests a step can have, so a later batch's data does not fit it.
Fix (upstream): ``__init__`` allocates the buffers up front when full CUDA graphs are on, ``(num_sms, 8)`` for the
tile-scheduler metadata and ``max_num_seqs + 1`` for ``num_splits``; ``_build_decode`` copies into a ``[:sm_parts]``
view and fills the tail of ``num_splits`` with ``num_splits[-1]`` (monotone, 0 splits for padded rows, as FlashMLA#3's
combine kernel expects) instead of 0.
Modelled: ``FlashMLAMetadataBuilder.__init__`` / ``_build_decode`` (both variants as read), the MLA common builder's
``build`` / ``build_for_cudagraph_capture`` (decode-only and prefill-only batches), ``get_mla_metadata`` (the
scheduler loop of ``get_mla_metadata_kernel``, run on the host), ``flash_mla_with_kvcache`` as torch ops over its
launch grid (each KV block goes to its tile's partition and to split ``num_splits[i] + n_split_idx``, then the LSE
combine over ``num_splits[i] .. num_splits[i + 1]``), the runner's persistent inputs, padding to a capture size,
``_dummy_run`` capture (largest first) and replay. Stand-ins: a 2-layer DeepSeek-V2-like model (absorbed MLA with
latent rank 8, 2 heads, learned positions instead of RoPE, gated MLP), 4 SMs (4 SM parts), KV block size and
``block_size_n`` 4 tokens, fixed overhead 1 block, ``max_num_seqs`` 6, graphs for 1, 2 and 4 requests; padded KV
writes (``slot_mapping`` -1) land in a scratch block instead of being skipped; prefill runs eagerly in the same
latent form; decode tokens are fixed in advance (no sampler); the reference is the same runner without graphs
(``full_cuda_graph`` off, no persistent buffers); float64. The IMA of the PR title (FlashMLA's no-work tiles and the
zero-filled ``num_splits`` tail) is not modelled: here padded rows get no splits either way.
Workload: requests A-F (prompts of 13, 10, 3, 6, 4, 9 tokens). Capture builds for 4, 2, 1 requests (bug: the 4-request
build's ``num_splits``, 5 entries, becomes the buffer). Step 1 prefills A-C; steps 2-3 decode A-C (graph of 4, one
padded row; A and B are split over two SM parts, ``num_splits`` [0, 2, 4, 5]); step 4 prefills D-F; steps 5-6 decode
A-F (6 requests: no graph); step 7 decodes B, D (graph of 2). Bug: steps 1-4 equal eager, then step 5's build raises
``AssertionError`` (``num_splits`` of 7 entries, buffer of 5). Fix: equals eager (max 1.3e-14, float64 rounding).
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/21691"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "_build_decode"
SYMPTOM = ("FlashMLA with full CUDA graphs keeps its first (capture) build's num_splits as the persistent buffer: a "
           "decode batch with more requests than the largest captured graph does not fit it and the build asserts")

VOCAB, HIDDEN, NUM_HEADS, QK_NOPE, ROPE, KV_LORA_RANK, V_HEAD, INTER, N_LAYERS = 32, 16, 2, 4, 4, 8, 4, 24, 2
BLOCK_SIZE, NUM_BLOCKS, MAX_NUM_SEQS, MAX_NUM_TOKENS, MAX_MODEL_LEN = 4, 40, 6, 32, 24
MAX_BLOCKS = MAX_MODEL_LEN // BLOCK_SIZE
CUDAGRAPH_BATCH_SIZES = [1, 2, 4]
NUM_SMS, TILE_SCHEDULER_METADATA_SIZE, FIXED_OVERHEAD_NUM_BLOCKS = 4, 8, 1
SCRATCH_BLOCK = NUM_BLOCKS                     # padded slots (-1) land here; the kernel skips them upstream
DTYPE = torch.float64

_variant = "bug"
_forward_context: dict = {}


def get_forward_context():
    return _forward_context


# --- flash_mla ops (vllm/attention/ops/flashmla.py over FlashMLA's kernels), as torch ops ----------------------------

def get_mla_metadata(cache_seqlens, num_heads_per_head_k, num_heads_k):
    """``get_mla_metadata_kernel``: split the KV blocks of the batch evenly over the SM parts. Returns
    ``tile_scheduler_metadata`` [num_sm_parts, 8] (begin_idx, begin_seqlen, end_idx, end_seqlen, begin_n_split_idx)
    and the cumulative ``num_splits`` [batch + 1]. Stand-in: the one-thread scheduler loop runs on the host."""
    num_sm_parts = NUM_SMS // num_heads_k // math.ceil(num_heads_per_head_k / 64)
    seqlens = cache_seqlens.tolist()
    batch_size = len(seqlens)
    num_blocks = [math.ceil(s / BLOCK_SIZE) for s in seqlens]
    total = sum(nb + FIXED_OVERHEAD_NUM_BLOCKS for nb in num_blocks)
    payload = math.ceil(total / num_sm_parts) + FIXED_OVERHEAD_NUM_BLOCKS
    tile = [[0] * TILE_SCHEDULER_METADATA_SIZE for _ in range(num_sm_parts)]
    num_splits = [0] * (batch_size + 1)
    now_idx = now_block = now_n_split_idx = cum_num_splits = 0
    for i in range(num_sm_parts):
        tile[i][0], tile[i][1], tile[i][4] = now_idx, now_block * BLOCK_SIZE, now_n_split_idx
        remain_payload = payload
        while now_idx < batch_size:
            now_remain_blocks = num_blocks[now_idx] - now_block
            if remain_payload >= now_remain_blocks + FIXED_OVERHEAD_NUM_BLOCKS:
                cum_num_splits += now_n_split_idx + 1
                num_splits[now_idx + 1] = cum_num_splits
                remain_payload -= now_remain_blocks + FIXED_OVERHEAD_NUM_BLOCKS
                now_idx, now_block, now_n_split_idx = now_idx + 1, 0, 0
            else:
                if remain_payload - FIXED_OVERHEAD_NUM_BLOCKS > 0:
                    now_block += remain_payload - FIXED_OVERHEAD_NUM_BLOCKS
                    now_n_split_idx += 1
                break
        tile[i][2] = now_idx if now_block > 0 else now_idx - 1
        tile[i][3] = now_block * BLOCK_SIZE if now_block > 0 else seqlens[now_idx - 1]
    dev = cache_seqlens.device
    return (torch.tensor(tile, dtype=torch.int32, device=dev), torch.tensor(num_splits, dtype=torch.int32, device=dev))


def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits,
                           softmax_scale):
    """``flash_fwd_splitkv_mla_kernel`` + ``flash_fwd_mla_combine_kernel`` over the launch grid (batch = q rows):
    partition p walks the blocks from its (begin_idx, begin_seqlen); a request's blocks on p form split
    ``num_splits[i] + n_split_idx`` of ``oaccum``; the combine merges splits ``num_splits[i] .. num_splits[i+1]``."""
    b, nb, dev = q.shape[0], block_table.shape[1], q.device
    tm = tile_scheduler_metadata.long()
    num_sm_parts = tm.shape[0]
    rows = torch.arange(b, device=dev)
    key = rows[:, None] * nb + torch.arange(nb, device=dev)[None, :]
    begin_key = tm[:, 0] * nb + tm[:, 1] // BLOCK_SIZE
    part = ((begin_key[None, None, :] <= key[..., None]).sum(-1) - 1).clamp_min(0)
    n_split_idx = torch.where(tm[:, 0][part] == rows[:, None], tm[:, 4][part], 0)
    ns = num_splits[: b + 1].long()
    dump = b + num_sm_parts                                            # oaccum holds batch + num_sm_parts splits
    tok = torch.arange(nb * BLOCK_SIZE, device=dev).view(nb, BLOCK_SIZE)
    valid = tok[None] < cache_seqlens[:b].long()[:, None, None]         # [b, nb, block]
    split = torch.where(valid.any(-1), ns[:b, None] + n_split_idx, dump).clamp(0, dump).flatten()
    kv = k_cache.index_select(0, block_table[:b].flatten().long()).view(b, nb, BLOCK_SIZE, -1)
    s = torch.einsum("bhd,bntd->bnht", q, kv) * softmax_scale
    s = s.masked_fill(~valid[:, :, None, :], -math.inf)
    m = s.amax(dim=(1, 3), keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = (s - m).exp()
    slots = dump + 1
    m_acc = torch.full((slots, NUM_HEADS), -math.inf, dtype=q.dtype, device=dev).scatter_reduce_(
        0, split[:, None].expand(-1, NUM_HEADS), m.expand(-1, nb, -1, -1).reshape(-1, NUM_HEADS), "amax")
    l_acc = torch.zeros(slots, NUM_HEADS, dtype=q.dtype, device=dev).index_add_(0, split, p.sum(-1).flatten(0, 1))
    o_acc = torch.zeros(slots, NUM_HEADS, head_dim_v, dtype=q.dtype, device=dev).index_add_(
        0, split, torch.einsum("bnht,bntv->bnhv", p, kv[..., :head_dim_v]).flatten(0, 1))
    lse_accum = l_acc.log() + m_acc                                    # -inf for splits nobody wrote
    o_accum = o_acc / l_acc.clamp_min(1e-300)[..., None]
    slot_ids = torch.arange(slots, device=dev)
    member = (slot_ids[None] >= ns[:b, None]) & (slot_ids[None] < ns[1:, None])        # [b, slots]
    lse = torch.where(member[..., None], lse_accum[None], -math.inf).logsumexp(1)       # [b, H]
    lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    w = torch.where(member[..., None], (lse_accum[None] - lse[:, None]).exp(), 0.0)      # [b, slots, H]
    return torch.einsum("bsh,shv->bhv", w, o_accum)


# --- vllm/v1/attention/backends/mla/common.py + flashmla.py (reduced) ------------------------------------------------

@dataclasses.dataclass
class CommonAttentionMetadata:
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor


@dataclasses.dataclass
class FlashMLADecodeMetadata:
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    tile_scheduler_metadata: torch.Tensor
    num_splits: torch.Tensor


@dataclasses.dataclass
class FlashMLAMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor
    num_decodes: int
    decode: FlashMLADecodeMetadata | None
    prefill_query_start_loc_cpu: torch.Tensor | None


class FlashMLAMetadataBuilder:
    def __init__(self, runner, device):
        self.runner, self.device = runner, device
        self.num_q_heads = NUM_HEADS
        self.cg_buf_tile_scheduler_metadata = None
        self.cg_buf_num_splits = None
        if _variant == "fix":
            num_sms = NUM_SMS                          # torch.cuda.get_device_properties(device).multi_processor_count
            if self.runner.full_cuda_graph:
                self.cg_buf_tile_scheduler_metadata = torch.zeros(
                    (num_sms, TILE_SCHEDULER_METADATA_SIZE), device=device, dtype=torch.int32)
                self.cg_buf_num_splits = torch.empty(MAX_NUM_SEQS + 1, device=device, dtype=torch.int32)

    def _build_decode(self, block_table_tensor, seq_lens):
        tile_scheduler_metadata, num_splits = get_mla_metadata(seq_lens, self.num_q_heads, 1)   # MQA for decode
        if self.runner.full_cuda_graph:
            if _variant == "bug":
                # First time around (CUDAGraph capture), allocate the static buffer
                if self.cg_buf_tile_scheduler_metadata is None:
                    self.cg_buf_tile_scheduler_metadata = tile_scheduler_metadata
                    self.cg_buf_num_splits = num_splits
                else:
                    assert self.cg_buf_num_splits is not None
                    # Metadata per-SM, fixed size (#SMs, TileMetadataSize)
                    assert self.cg_buf_tile_scheduler_metadata.size() == tile_scheduler_metadata.size()
                    self.cg_buf_tile_scheduler_metadata.copy_(tile_scheduler_metadata)
                    tile_scheduler_metadata = self.cg_buf_tile_scheduler_metadata
                    # Num splits is per-batch, varying size (batch_size,)
                    n = num_splits.size(0)
                    # make sure static buffer is large enough
                    assert n <= self.cg_buf_num_splits.size(0)
                    num_splits_view = self.cg_buf_num_splits[:n]
                    num_splits_view.copy_(num_splits)
                    self.cg_buf_num_splits[n:].fill_(0)  # fill the rest with 0s
                    num_splits = num_splits_view
            else:
                assert self.cg_buf_tile_scheduler_metadata is not None
                assert self.cg_buf_num_splits is not None
                sm_parts = tile_scheduler_metadata.size(0)
                # Metadata per-SM, upper bound on size (<= #SMs, TileMetadataSize)
                assert sm_parts <= self.cg_buf_tile_scheduler_metadata.size(0)
                tile_scheduler_metadata_view = self.cg_buf_tile_scheduler_metadata[:sm_parts]
                tile_scheduler_metadata_view.copy_(tile_scheduler_metadata)
                tile_scheduler_metadata = tile_scheduler_metadata_view
                # Num splits is per-batch, varying size (batch_size,)
                n = num_splits.size(0)
                # make sure static buffer is large enough
                assert n <= self.cg_buf_num_splits.size(0)
                num_splits_view = self.cg_buf_num_splits[:n]
                num_splits_view.copy_(num_splits)
                # Num splits needs to monotonically increasing
                self.cg_buf_num_splits[n:].fill_(num_splits[-1])
                num_splits = num_splits_view
        return FlashMLADecodeMetadata(block_table=block_table_tensor, seq_lens=seq_lens,
                                      tile_scheduler_metadata=tile_scheduler_metadata, num_splits=num_splits)

    def build(self, common_prefix_len, m: CommonAttentionMetadata) -> FlashMLAMetadata:
        query_lens = (m.query_start_loc_cpu[1:] - m.query_start_loc_cpu[:-1]).tolist()
        num_decodes = next((i for i, q in enumerate(query_lens) if q > 1), m.num_reqs)   # decodes come first
        assert num_decodes in (0, m.num_reqs), "mixed batches are not modelled"
        decode = (self._build_decode(m.block_table_tensor[:num_decodes], m.seq_lens[:num_decodes])
                  if num_decodes else None)
        return FlashMLAMetadata(m.num_actual_tokens, m.slot_mapping, num_decodes, decode,
                                None if num_decodes else m.query_start_loc_cpu)

    def build_for_cudagraph_capture(self, m: CommonAttentionMetadata) -> FlashMLAMetadata:
        assert m.num_reqs == m.num_actual_tokens, ("MLA only supports decode-only full CUDAGraph capture. "
                                                   "Make sure all cudagraph capture sizes <= max_num_seq.")
        return self.build(0, m)


# --- the model (DeepSeek-V2 reduced: absorbed MLA) -----------------------------------------------------------------

def rms_norm(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class DeepseekV2MLAAttention:
    def __init__(self, gen, device, kv_cache):
        r = lambda *s, scale=0.4: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.q_proj = r(NUM_HEADS * (QK_NOPE + ROPE), HIDDEN)
        self.kv_a_proj_with_mqa = r(KV_LORA_RANK + ROPE, HIDDEN)
        self.kv_a_layernorm = 1.0 + r(KV_LORA_RANK, scale=0.1)
        self.W_UK, self.W_UV = r(NUM_HEADS, QK_NOPE, KV_LORA_RANK), r(NUM_HEADS, KV_LORA_RANK, V_HEAD)
        self.o_proj = r(HIDDEN, NUM_HEADS * V_HEAD)
        self.kv_cache = kv_cache                                  # [NUM_BLOCKS + 1, BLOCK_SIZE, KV_LORA_RANK + ROPE]
        self.scale = (QK_NOPE + ROPE) ** -0.5

    def forward(self, h):                                          # MLACommonImpl.forward
        md: FlashMLAMetadata = get_forward_context()["attn_metadata"]
        T = h.shape[0]
        q_nope, q_pe = F.linear(h, self.q_proj).view(T, NUM_HEADS, QK_NOPE + ROPE).split([QK_NOPE, ROPE], -1)
        kv_c, k_pe = F.linear(h, self.kv_a_proj_with_mqa).split([KV_LORA_RANK, ROPE], -1)
        kv_c = rms_norm(kv_c, self.kv_a_layernorm)
        entry = torch.cat([kv_c, k_pe], -1)
        slots = md.slot_mapping[:T]                                 # ops.concat_and_cache_mla
        slots = torch.where(slots >= 0, slots, torch.full_like(slots, SCRATCH_BLOCK * BLOCK_SIZE))
        self.kv_cache.view(-1, KV_LORA_RANK + ROPE).index_copy_(0, slots, entry)
        q = torch.cat([torch.einsum("thp,hpl->thl", q_nope, self.W_UK), q_pe], -1)
        if md.decode is not None:                                   # FlashMLAImpl._forward_decode
            o = flash_mla_with_kvcache(q, self.kv_cache, md.decode.block_table, md.decode.seq_lens, KV_LORA_RANK,
                                       md.decode.tile_scheduler_metadata, md.decode.num_splits, self.scale)
        else:                                                       # prefill: same latent attention, causal
            qsl = md.prefill_query_start_loc_cpu
            req = torch.repeat_interleave(torch.arange(len(qsl) - 1), qsl[1:] - qsl[:-1]).to(h.device)
            idx = torch.arange(T, device=h.device)
            mask = (req[:, None] == req[None, :]) & (idx[None, :] <= idx[:, None])
            s = torch.einsum("thd,ud->htu", q, entry) * self.scale
            o = torch.einsum("htu,ul->thl", s.masked_fill(~mask, -math.inf).softmax(-1), kv_c)
        return F.linear(torch.einsum("thl,hlv->thv", o, self.W_UV).reshape(T, -1), self.o_proj)


class DeepseekV2ForCausalLM:
    def __init__(self, device, kv_caches):
        gen = generator(21691)
        r = lambda *s, scale=1.0: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.embed_tokens, self.embed_positions = r(VOCAB, HIDDEN), r(MAX_MODEL_LEN, HIDDEN, scale=0.5)
        self.layers = []
        for kv_cache in kv_caches:
            attn = DeepseekV2MLAAttention(gen, device, kv_cache)
            self.layers.append((attn, 1.0 + r(HIDDEN, scale=0.1), 1.0 + r(HIDDEN, scale=0.1),
                                r(2 * INTER, HIDDEN, scale=0.4), r(HIDDEN, INTER, scale=0.4)))
        self.norm, self.lm_head = 1.0 + r(HIDDEN, scale=0.1), r(VOCAB, HIDDEN)

    def forward(self, input_ids, positions):
        h = self.embed_tokens[input_ids] + self.embed_positions[positions]
        for attn, in_norm, post_norm, gate_up, down in self.layers:
            h = h + attn.forward(rms_norm(h, in_norm))
            gate, up = F.linear(rms_norm(h, post_norm), gate_up).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, down)
        return rms_norm(h, self.norm)

    def compute_logits(self, hidden_states):
        return F.linear(hidden_states, self.lm_head)


# --- vllm/v1/worker/gpu_model_runner.py (reduced) ------------------------------------------------------------------

class GPUModelRunner:
    def __init__(self, device, full_cuda_graph):
        self.device, self.full_cuda_graph = device, full_cuda_graph
        self.kv_caches = [torch.zeros(NUM_BLOCKS + 1, BLOCK_SIZE, KV_LORA_RANK + ROPE, dtype=DTYPE, device=device)
                          for _ in range(N_LAYERS)]
        self.model = DeepseekV2ForCausalLM(device, self.kv_caches)
        self.attn_metadata_builder = FlashMLAMetadataBuilder(self, device)
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)
        self.positions = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(MAX_NUM_SEQS, dtype=torch.int32, device=device)
        self.query_start_loc_cpu = torch.zeros(MAX_NUM_SEQS + 1, dtype=torch.int32)
        self.block_table_cpu = torch.zeros(MAX_NUM_SEQS, MAX_BLOCKS, dtype=torch.int32)
        self.block_table = torch.zeros(MAX_NUM_SEQS, MAX_BLOCKS, dtype=torch.int32, device=device)
        self.cudagraph_batch_sizes = CUDAGRAPH_BATCH_SIZES if full_cuda_graph else []
        self.requests, self.graphs, self.next_free_block = {}, {}, 1           # block 0: the null block
        if full_cuda_graph:
            self.capture_model()

    def _common_metadata(self, num_reqs, num_tokens, max_query_len):
        return CommonAttentionMetadata(self.query_start_loc_cpu[: num_reqs + 1], self.seq_lens[:num_reqs], num_reqs,
                                       num_tokens, max_query_len, self.block_table[:num_reqs], self.slot_mapping)

    def _model_forward(self, num_tokens):
        return self.model.forward(self.input_ids[:num_tokens], self.positions[:num_tokens])

    def _dummy_run(self, num_tokens, capture_attn_cudagraph=False):
        num_reqs = min(num_tokens, MAX_NUM_SEQS)
        if capture_attn_cudagraph:
            self.seq_lens[:num_reqs].fill_(MAX_MODEL_LEN)     # make sure max_model_len is used at capture time
            self.seq_lens[num_reqs:].fill_(0)
            self.query_start_loc_cpu[: num_reqs + 1].copy_(torch.arange(num_reqs + 1))
            _forward_context["attn_metadata"] = self.attn_metadata_builder.build_for_cudagraph_capture(
                self._common_metadata(num_reqs, num_tokens, 1))
        return self._model_forward(num_tokens)

    def capture_model(self):
        pool = graph_pool_handle(self.device)
        b = self.attn_metadata_builder
        for num_tokens in reversed(self.cudagraph_batch_sizes):
            self._dummy_run(num_tokens, capture_attn_cudagraph=True)          # warm-up run builds the metadata
            self.graphs[num_tokens] = capture(
                lambda t=num_tokens: self._model_forward(t), device=self.device, pool=pool, warmups=1,
                name=f"FULL decode [{num_tokens}]", owner="GPUModelRunner",
                static={"input_ids": self.input_ids, "positions": self.positions, "slot_mapping": self.slot_mapping,
                        "seq_lens": self.seq_lens, "block_table": self.block_table,
                        "cg_buf_tile_scheduler_metadata": b.cg_buf_tile_scheduler_metadata,
                        "cg_buf_num_splits": b.cg_buf_num_splits},
                state={f"kv_caches[{i}]": c for i, c in enumerate(self.kv_caches)})

    def add_request(self, req_id, prompt):
        self.requests[req_id] = {"tokens": list(prompt), "num_computed": 0, "blocks": []}

    def _prepare_inputs(self, req_ids):
        ids, positions, slots, cu = [], [], [], [0]
        for row, req_id in enumerate(req_ids):
            req = self.requests[req_id]
            start, end = req["num_computed"], len(req["tokens"])
            while len(req["blocks"]) * BLOCK_SIZE < end:                # KV cache manager stand-in
                req["blocks"].append(self.next_free_block)
                self.next_free_block += 1
            ids += req["tokens"][start:end]
            positions += list(range(start, end))
            slots += [req["blocks"][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)]
            cu.append(cu[-1] + end - start)
            self.block_table_cpu[row].zero_()
            self.block_table_cpu[row, : len(req["blocks"])] = torch.tensor(req["blocks"], dtype=torch.int32)
            req["num_computed"] = end
        n, t = len(req_ids), len(ids)
        self.input_ids[:t].copy_(torch.tensor(ids))                           # padded token rows left as they were
        self.positions[:t].copy_(torch.tensor(positions))
        self.slot_mapping[:t].copy_(torch.tensor(slots))
        self.slot_mapping[t:].fill_(-1)
        self.query_start_loc_cpu[: n + 1].copy_(torch.tensor(cu))
        self.query_start_loc_cpu[n + 1:].fill_(cu[-1])
        self.seq_lens[:n].copy_(torch.tensor([len(self.requests[r]["tokens"]) for r in req_ids]))
        self.seq_lens[n:].fill_(0)
        self.block_table[:n].copy_(self.block_table_cpu[:n])                  # BlockTable.commit(num_reqs)
        return t, max(b - a for a, b in zip(cu, cu[1:]))

    def execute_model(self, req_ids):
        num_reqs = len(req_ids)
        num_tokens, max_query_len = self._prepare_inputs(req_ids)
        _forward_context["attn_metadata"] = attn_metadata = self.attn_metadata_builder.build(
            0, self._common_metadata(num_reqs, num_tokens, max_query_len))
        decode_only = attn_metadata.decode is not None
        num_input_tokens = next((s for s in self.cudagraph_batch_sizes if s >= num_tokens and decode_only), None)
        if num_input_tokens is not None:                                      # full CUDA graph of a capture size
            g, out = self.graphs[num_input_tokens]
            hidden = replay(g, out, real=num_tokens, size=num_input_tokens,
                            padded={"input_ids": self.input_ids, "positions": self.positions})
        else:
            hidden = self._model_forward(num_tokens)
        last = (self.query_start_loc_cpu[1: num_reqs + 1] - 1).tolist()
        return self.model.compute_logits(hidden[last].clone())


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(216910)
    lens = dict(zip("ABCDEF", (13, 10, 3, 6, 4, 9)))
    prompts = {r: torch.randint(1, VOCAB, (n,), generator=gen).tolist() for r, n in lens.items()}
    steps = [("prefill", "ABC"), ("decode", "ABC"), ("decode", "ABC"), ("prefill", "DEF"),
             ("decode", "ABCDEF"), ("decode", "ABCDEF"), ("decode", "BD")]
    decode_tokens = torch.randint(1, VOCAB, (len(steps), 6), generator=gen).tolist()

    def serve(full_cuda_graph):
        runner = GPUModelRunner(device, full_cuda_graph)
        outs = []
        for step, (kind, req_ids) in enumerate(steps):
            for row, req_id in enumerate(req_ids):
                if kind == "prefill":
                    runner.add_request(req_id, prompts[req_id])
                else:
                    runner.requests[req_id]["tokens"].append(decode_tokens[step][row])
            outs.append(runner.execute_model(list(req_ids)))
        return outs

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
