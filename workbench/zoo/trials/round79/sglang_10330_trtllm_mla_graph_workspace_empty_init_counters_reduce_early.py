"""TRTLLM-MLA decode under CUDA graphs: the graph-only ``decode_cuda_graph_workspace`` is a ``torch.empty`` buffer, so the trtllm-gen kernel's multi-CTA counters start at garbage and the split-KV reduction runs early on stale partials.

Upstream: https://github.com/sgl-project/sglang/pull/10330 ("fix: trtllm-gen attention take zero-init workspace",
commit 70c0c1f92, merged 2025-09-11). PR body: "trtllm_gen_mla took empty-init decode_cuda_graph_workspace. Replaced
by zero_init self.workspace_buffer = global_zero_init_workspace_buffer."
Background: FlashInfer #1463 (2025-08-13, in flashinfer 0.2.11.post3 and later) removed the per-launch zeroing of the
trtllm-gen counter region ("After this fix, workspace buffer passed into any trtllm-gen attn interface must be
zero-initialized"; ``trtllm_batch_decode_with_kv_cache_mla``: "Must be initialized to 0 for its first use"). SGLang
#9065 (2025-08-14) moved to that FlashInfer and made the eager workspace ``torch.zeros`` (module-global
``global_zero_init_workspace_buffer``), but left the CUDA-graph workspace of ``TRTLLMMLABackend`` a ``torch.empty``.
Symptom: ``--attention-backend trtllm_mla`` with CUDA graphs: wrong decode attention (or, with other garbage, an output
the kernel never writes); ``--disable-cuda-graph`` is correct. The PR reports no before-number (only gsm8k 0.947 after).
Mechanism: ``TRTLLMMLABackend.init_cuda_graph_state`` (python/sglang/srt/layers/attention/trtllm_mla_backend.py)
allocates ``self.decode_cuda_graph_workspace = torch.empty(self.workspace_size, dtype=torch.int8)``;
``init_forward_metadata_capture_cuda_graph`` puts it into the per-``bs`` ``TRTLLMMLADecodeMetadata(workspace, ...)``
that the warmups, the capture and every replay use, and ``forward_decode`` passes ``metadata.workspace`` to
``flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla``. Eager decode (``init_forward_metadata``) passes the
zero-initialised ``self.workspace_buffer``. The kernel splits each sequence's KV over several CTAs
(``multiCtasKvMode``, chosen on the host from ``max_seq_len`` and the SM count); the first bytes of the workspace are
one int32 counter per (sequence, head CTA), the rest is scratch for the CTAs' partial O and softmax stats. Each KV CTA
writes its partials, increments the counter, and the CTA that reads ``numCtasPerSeqKv - 1`` is taken as the last one:
it merges all partials, writes the output and resets the counter to 0, so a buffer that starts at zero stays valid.
A counter that starts at garbage ``G`` in ``[1, n-1]`` makes an earlier CTA believe it is last: it merges partials of
CTAs that have not yet written this launch (scratch still holding an earlier launch's, or another layer's, partials),
resets the counter, and the CTAs after it leave it at ``G`` again, so every launch of the graph repeats the early,
wrong reduction. (Garbage ``>= n`` or negative: no CTA of the launch reduces, and the output keeps what
``torch.empty`` gave it.)
Code state modelled: sglang main between #9238 (2025-08-21) and #9675 (2025-08-29), where ``forward_decode`` passed
``max_seq_len=int(metadata.block_kv_indices.shape[1] * self.page_size)``: the captured launch was sized by the padded
block-table width (thousands of tokens upstream), so it split KV over several CTAs exactly as eager does. #9675
changed that to the capture batch's true ``seq_lens.max()`` (the fill value 1), after which the captured launch ran a
single KV CTA per sequence (``computeCtaAndClusterConfig`` disables ``multiCtasKvMode`` for one CTA) and never read the
counters: from then until #10330 the empty workspace was latent in decode graphs. #10330 removed it.
Doctor: warmup-divergence, at init_cuda_graph_state (it creates the graph-only workspace with ``torch.empty`` instead
of the zero-initialised buffer the eager step uses; the capture binds that tensor into the decode metadata, so every
replay runs the kernel on counters that never met the kernel's zero-on-first-use contract, while an eager step of the
same batch uses the zeroed ``workspace_buffer``).
Fix (upstream): drop ``decode_cuda_graph_workspace`` and the ``TRTLLMMLADecodeMetadata.workspace`` field; capture and
eager build the metadata without it, and ``forward_decode`` always passes ``workspace_buffer=self.workspace_buffer``.
Modelled: a 2-layer DeepSeek-style decoder with absorbed MLA attention only (latent ``kv_lora_rank`` K/V plus a rope
part, no RoPE rotation, no MLP/MoE, no norms), TP 1, decode only, capture sizes 2 and 4 (one pool), padded to the next
size as ``replay_prepare`` does. Sizes are scaled down: page size 4, ``TRTLLM_BLOCK_CONSTRAINT`` 16,
``TRITON_PAD_NUM_PAGE_PER_BLOCK`` 4, a KV step of 4 tokens and 16 SMs, so the padded block table is 16 tokens and every
launch (eager and graph) splits each sequence over 4 KV CTAs; sequences stay within 16 tokens (the capture-width block
table of this code state, which #9675 widened, is not exercised). ``create_flashmla_kv_indices_triton`` is written in
torch ops. ``trtllm_batch_decode_with_kv_cache_mla`` is dense MLA decode with the gmem split-KV reduction written out
(the cubin's protocol as described above; upstream it also has a cluster-shared-memory reduction for up to 16 CTAs,
not modelled); its CTAs arrive in KV order, one counter per sequence. What ``torch.empty`` returns is modelled
explicitly (``empty_device``): the recycled block's earlier int32 contents, a fixed stand-in of small values 1..3, so
the run is the same on the CPU and on a GPU.
"""
from __future__ import annotations

import bisect
import enum
import math
from typing import Optional

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/10330"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "init_cuda_graph_state"
SYMPTOM = ("trtllm_mla + CUDA graphs: the graph-only decode workspace is torch.empty; the trtllm-gen multi-CTA "
           "counters start at garbage, an early CTA merges stale split-KV partials; wrong decode attention")

VOCAB, HIDDEN, NUM_LAYERS, NUM_HEADS = 32, 8, 2, 2
KV_LORA_RANK, QK_ROPE_HEAD_DIM = 8, 4          # (512 and 64 upstream)
PAGE_SIZE = 4                                  # --page-size (32 or 64 upstream)
CONTEXT_LEN = 32                               # model_config.context_len
REQ_POOL_SIZE = 8                              # req_to_token_pool rows (row 0: the capture's dummy request)
NUM_PAGES = 32
CUDA_GRAPH_BS = [2, 4]
SM_COUNT = 16                                  # get_device_sm_count (148 on B200)
STEP_KV = 4                                    # the kernel's tile of KV tokens (128 upstream)

# --- layers/attention/utils.py and trtllm_mla_backend.py constants (scaled down) ---------------------------
TRITON_PAD_NUM_PAGE_PER_BLOCK = 4              # 64 upstream
TRTLLM_BLOCK_CONSTRAINT = 16                   # 128 upstream
WORKSPACE_SIZE = 2048                          # DEFAULT_WORKSPACE_SIZE_MB * 1024 * 1024 upstream (128 MB)

global_zero_init_workspace_buffer = None


def empty_device(nbytes: int, dtype, device) -> torch.Tensor:
    """``torch.empty`` on the device: a recycled block holds what its previous owner wrote. Modelled explicitly (the
    CPU's torch.empty and a GPU's fresh segment would differ): int32 words 1, 2, 3, 1, 2, 3, ... as an earlier int32
    buffer (indices, counts) would leave them."""
    words = torch.arange(nbytes // 4, dtype=torch.int32) % 3 + 1
    return torch.empty(nbytes, dtype=dtype, device=device).copy_(words.view(dtype).to(device))


class ForwardMode(enum.Enum):
    DECODE = enum.auto()

    def is_decode_or_idle(self):
        return self == ForwardMode.DECODE


# --- mem_cache/memory_pool.py ----------------------------------------------------------------------------

class ReqToTokenPool:
    def __init__(self, size, max_context_len, device):
        self.req_to_token = torch.zeros(size, max_context_len, dtype=torch.int32, device=device)


class MLATokenToKVPool:
    def __init__(self, size, kv_lora_rank, qk_rope_head_dim, layer_num, device):
        self.kv_lora_rank = kv_lora_rank
        self.kv_buffer = [torch.zeros(size, 1, kv_lora_rank + qk_rope_head_dim, device=device)
                          for _ in range(layer_num)]

    def get_key_buffer(self, layer_id):
        return self.kv_buffer[layer_id]

    def set_mla_kv_buffer(self, layer, loc, cache_k_nope, cache_k_rope):
        self.kv_buffer[layer.layer_id][loc] = torch.cat([cache_k_nope, cache_k_rope], dim=-1)


# --- model_executor/forward_batch_info.py ----------------------------------------------------------------------

class ForwardBatch:
    def __init__(self, forward_mode, batch_size, input_ids, req_pool_indices, seq_lens, out_cache_loc, seq_lens_sum,
                 req_to_token_pool, token_to_kv_pool, attn_backend, seq_lens_cpu=None):
        self.forward_mode, self.batch_size, self.input_ids = forward_mode, batch_size, input_ids
        self.req_pool_indices, self.seq_lens, self.out_cache_loc = req_pool_indices, seq_lens, out_cache_loc
        self.seq_lens_sum, self.seq_lens_cpu = seq_lens_sum, seq_lens_cpu
        self.req_to_token_pool, self.token_to_kv_pool = req_to_token_pool, token_to_kv_pool
        self.attn_backend = attn_backend


# --- layers/attention/utils.py: create_flashmla_kv_indices_triton (a Triton kernel; torch ops here) -------------

def create_flashmla_kv_indices_triton(req_to_token, req_pool_indices, seq_lens, kv_start_idx, kv_indices_ptr,
                                      req_to_token_ptr_stride, kv_indices_ptr_stride,
                                      NUM_PAGE_PER_BLOCK=TRITON_PAD_NUM_PAGE_PER_BLOCK, PAGED_SIZE=PAGE_SIZE):
    """Row ``b``: the page of every ``PAGED_SIZE``-th token of request ``req_pool_indices[b]``, for its first
    ``cdiv(seq_lens[b], PAGED_SIZE)`` pages; the rest of the row is left as it was."""
    j = torch.arange(kv_indices_ptr_stride, device=kv_indices_ptr.device)
    pages = req_to_token[req_pool_indices.long()][:, j * PAGED_SIZE] // PAGED_SIZE
    valid = j[None, :] < (seq_lens[:, None] + PAGED_SIZE - 1) // PAGED_SIZE
    kv_indices_ptr.copy_(torch.where(valid, pages.to(kv_indices_ptr.dtype), kv_indices_ptr))


# --- flashinfer/decode.py + the trtllm-gen FMHA runner (csrc/trtllm_fmha_kernel_launcher.cu, fmhaKernels.cuh) ----

def _round_up(x, y):
    return (x + y - 1) // y * y


def trtllm_batch_decode_with_kv_cache_mla(query, kv_cache, workspace_buffer, qk_nope_head_dim, kv_lora_rank,
                                          qk_rope_head_dim, block_tables, seq_lens, max_seq_len, out=None,
                                          bmm1_scale=1.0, bmm2_scale=1.0):
    """MLA decode, one query token per sequence; V is the first ``kv_lora_rank`` dims of the cached latent.
    workspace_buffer: counters | scratch, "Must be initialized to 0 for its first use"."""
    batch_size, _, num_heads, _ = query.shape
    if out is None:
        out = torch.empty(query.shape[:-1] + (kv_lora_rank,), dtype=query.dtype, device=query.device)
    q = query[:, 0].float()                                                        # [B, H, D]
    page_size = kv_cache.shape[-2]
    t = torch.arange(max_seq_len, device=q.device)
    pages = block_tables[:, t // page_size].long().clamp(min=0)                   # [B, T]
    k = kv_cache[pages, 0, t % page_size]                                           # [B, T, D]
    v = k[..., :kv_lora_rank]
    scores = torch.einsum("bhd,btd->bht", q, k) * bmm1_scale
    in_seq = t[None, :] < seq_lens[:, None]                                         # [B, T]

    # computeCtaAndClusterConfig (host): split the KV of each sequence over CTAs while SMs are idle
    num_ctas_y, num_ctas_z = 1, batch_size                                         # all heads in one CTA
    num_ctas_per_seq_kv = min(math.ceil(max_seq_len / STEP_KV), max(1, SM_COUNT // (num_ctas_y * num_ctas_z)))
    if num_ctas_per_seq_kv <= 1:                                                   # multiCtasKvMode disabled
        probs = torch.softmax(scores.masked_fill(~in_seq[:, None, :], -1e30), dim=-1)
        out[:, 0] = (torch.einsum("bht,btr->bhr", probs, v) * bmm2_scale).to(out.dtype)
        return out

    # GmemReduction: counters at the start of the workspace, then partial stats, then partial O
    n = num_ctas_per_seq_kv
    num_semaphores = _round_up(8 * num_heads, 8)                                   # max_batch_size * max_num_qo_heads
    counters = workspace_buffer[:num_semaphores * 4].view(torch.int32)
    scratch = workspace_buffer[num_semaphores * 4:].view(torch.float32)
    stats_size = SM_COUNT * num_heads * 2                                          # partialStatsBufferSize
    partial_stats = scratch[:batch_size * n * num_heads * 2].view(batch_size, n, num_heads, 2)
    partial_o = scratch[stats_size:stats_size + batch_size * n * num_heads * kv_lora_rank].view(
        batch_size, n, num_heads, kv_lora_rank)
    counter = counters[:batch_size]                                                # one per (sequence, head CTA)
    tokens_per_cta = math.ceil(math.ceil(max_seq_len / STEP_KV) / n) * STEP_KV
    for cta in range(n):                                                           # CTAs arrive in KV order
        mine = in_seq & (t[None, :] >= cta * tokens_per_cta) & (t[None, :] < (cta + 1) * tokens_per_cta)
        s = scores.masked_fill(~mine[:, None, :], -1e30)
        m = s.amax(dim=-1)                                                         # [B, H]
        p = torch.exp(s - m[..., None]) * mine[:, None, :]
        partial_stats[:, cta, :, 0] = m
        partial_stats[:, cta, :, 1] = p.sum(-1)
        partial_o[:, cta] = torch.einsum("bht,btr->bhr", p, v)
        old = counter.clone()                                                      # atomicAdd(counter, 1)
        counter.add_(1)
        is_last = old == n - 1                                                     # "the last CTA of this sequence"
        big_m = partial_stats[..., 0].amax(dim=1)                                  # merge every CTA's partials
        w = torch.exp(partial_stats[..., 0] - big_m[:, None])
        merged = (partial_o * w[..., None]).sum(1) / (partial_stats[..., 1] * w).sum(1)[..., None]
        out[:, 0] = torch.where(is_last[:, None, None], (merged * bmm2_scale).to(out.dtype), out[:, 0])
        counter.copy_(torch.where(is_last, torch.zeros_like(counter), counter))    # reset for the next launch
    return out


# --- layers/attention/trtllm_mla_backend.py (sglang main 2025-08-21..08-29; fix: #10330) ------------------------

class TRTLLMMLADecodeMetadata:
    """Metadata for TRTLLM MLA decode operations (a dataclass upstream)."""

    def __init__(self, workspace: Optional[torch.Tensor] = None, block_kv_indices: Optional[torch.Tensor] = None):
        self.workspace = workspace
        self.block_kv_indices = block_kv_indices


class TRTLLMMLADecodeMetadataFixed:
    """#10330: the ``workspace`` field is gone."""

    def __init__(self, block_kv_indices: Optional[torch.Tensor] = None):
        self.block_kv_indices = block_kv_indices


class TRTLLMMLABackend:
    """TRTLLM MLA attention kernel from flashinfer."""

    def __init__(self, model_runner: "ModelRunner", variant: str):
        self.device = model_runner.device
        self.max_context_len = model_runner.context_len
        self.num_q_heads = NUM_HEADS
        self.kv_lora_rank, self.qk_rope_head_dim = KV_LORA_RANK, QK_ROPE_HEAD_DIM
        self.qk_nope_head_dim = KV_LORA_RANK
        self.kv_cache_dim = self.kv_lora_rank + self.qk_rope_head_dim
        self.page_size = model_runner.page_size
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.variant = variant                     # (which sglang: before #10330, or with it)

        # Workspace allocation
        self.workspace_size = WORKSPACE_SIZE
        global global_zero_init_workspace_buffer
        if global_zero_init_workspace_buffer is None:
            global_zero_init_workspace_buffer = torch.zeros(self.workspace_size, dtype=torch.uint8,
                                                            device=model_runner.device)
        self.workspace_buffer = global_zero_init_workspace_buffer

        # CUDA graph state
        self.decode_cuda_graph_metadata = {}
        self.decode_cuda_graph_kv_indices = None
        self.forward_metadata = None

    def _metadata(self, workspace, block_kv_indices):
        if self.variant == "bug":
            return TRTLLMMLADecodeMetadata(workspace, block_kv_indices)
        return TRTLLMMLADecodeMetadataFixed(block_kv_indices)

    def _calc_padded_blocks(self, max_seq_len: int) -> int:
        """Calculate padded block count that satisfies both TRT-LLM and Triton constraints."""
        blocks = (max_seq_len + self.page_size - 1) // self.page_size
        trtllm_constraint = TRTLLM_BLOCK_CONSTRAINT // self.page_size
        constraint_lcm = math.lcm(trtllm_constraint, TRITON_PAD_NUM_PAGE_PER_BLOCK)
        if blocks % constraint_lcm != 0:
            blocks = (blocks + constraint_lcm - 1) // constraint_lcm * constraint_lcm
        return blocks

    def _create_block_kv_indices(self, batch_size, max_blocks, req_pool_indices, seq_lens, device):
        block_kv_indices = torch.full((batch_size, max_blocks), -1, dtype=torch.int32, device=device)
        create_flashmla_kv_indices_triton(self.req_to_token, req_pool_indices, seq_lens, None, block_kv_indices,
                                          self.req_to_token.stride(0), max_blocks,
                                          NUM_PAGE_PER_BLOCK=TRITON_PAD_NUM_PAGE_PER_BLOCK, PAGED_SIZE=self.page_size)
        return block_kv_indices

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int, kv_indices_buf=None):
        """Initialize CUDA graph state for TRTLLM MLA."""
        max_blocks_per_seq = self._calc_padded_blocks(self.max_context_len)
        self.decode_cuda_graph_kv_indices = torch.full((max_bs, max_blocks_per_seq), -1, dtype=torch.int32,
                                                       device=self.device)
        if self.variant == "bug":
            self.decode_cuda_graph_workspace = empty_device(self.workspace_size, torch.int8, self.device)

    def init_forward_metadata_capture_cuda_graph(self, bs, num_tokens, req_pool_indices, seq_lens, encoder_lens,
                                                 forward_mode, spec_info):
        """Initialize metadata for CUDA graph capture."""
        assert forward_mode.is_decode_or_idle()
        # Custom fast-path for decode/idle.
        max_seqlen_pad = self._calc_padded_blocks(seq_lens.max().item())
        block_kv_indices = self.decode_cuda_graph_kv_indices[:bs, :max_seqlen_pad]
        create_flashmla_kv_indices_triton(self.req_to_token, req_pool_indices, seq_lens, None, block_kv_indices,
                                          self.req_to_token.stride(0), max_seqlen_pad,
                                          NUM_PAGE_PER_BLOCK=TRITON_PAD_NUM_PAGE_PER_BLOCK, PAGED_SIZE=self.page_size)
        metadata = self._metadata(getattr(self, "decode_cuda_graph_workspace", None), block_kv_indices)
        self.decode_cuda_graph_metadata[bs] = metadata
        self.forward_metadata = metadata

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_sum, encoder_lens,
                                                forward_mode, spec_info, seq_lens_cpu):
        """Replay CUDA graph with new inputs."""
        metadata = self.decode_cuda_graph_metadata[bs]
        # Update block indices for new sequences.
        create_flashmla_kv_indices_triton(self.req_to_token, req_pool_indices[:bs], seq_lens[:bs], None,
                                          metadata.block_kv_indices, self.req_to_token.stride(0),
                                          metadata.block_kv_indices.shape[1],
                                          NUM_PAGE_PER_BLOCK=TRITON_PAD_NUM_PAGE_PER_BLOCK, PAGED_SIZE=self.page_size)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        """Initialize the metadata for a forward pass."""
        assert forward_batch.forward_mode.is_decode_or_idle()
        bs = forward_batch.batch_size
        max_seq = forward_batch.seq_lens_cpu.max().item()
        max_seqlen_pad = self._calc_padded_blocks(max_seq)
        block_kv_indices = self._create_block_kv_indices(bs, max_seqlen_pad, forward_batch.req_pool_indices,
                                                         forward_batch.seq_lens, forward_batch.seq_lens.device)
        self.forward_metadata = self._metadata(self.workspace_buffer, block_kv_indices)
        forward_batch.decode_trtllm_mla_metadata = self.forward_metadata

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, q_rope=None, k_rope=None):
        return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache, q_rope, k_rope)

    def forward_decode(self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache=True, q_rope=None,
                       k_rope=None):
        """Run forward for decode using TRTLLM MLA kernel."""
        merge_query = q_rope is not None
        # Save KV cache if requested
        if save_kv_cache:
            forward_batch.token_to_kv_pool.set_mla_kv_buffer(layer, forward_batch.out_cache_loc, k, k_rope)
        # Prepare query tensor inline
        if merge_query:
            q_nope = q.view(-1, layer.tp_q_head_num, layer.v_head_dim)
            q_rope_reshaped = q_rope.view(-1, layer.tp_q_head_num, layer.head_dim - layer.v_head_dim)
            query = torch.cat([q_nope, q_rope_reshaped], dim=-1)
        else:
            query = q.view(-1, layer.tp_q_head_num, layer.head_dim)
        if query.dim() == 3:
            query = query.unsqueeze(1)
        # Prepare KV cache inline
        k_cache = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id)
        kv_cache = k_cache.view(-1, self.page_size, self.kv_cache_dim).unsqueeze(1)
        # Get metadata
        metadata = getattr(forward_batch, "decode_trtllm_mla_metadata", None) or self.forward_metadata
        bmm1_scale = 1.0 * 1.0 * layer.scaling                     # q_scale * k_scale * softmax_scale
        raw_out = trtllm_batch_decode_with_kv_cache_mla(
            query=query, kv_cache=kv_cache,
            workspace_buffer=metadata.workspace if self.variant == "bug" else self.workspace_buffer,
            qk_nope_head_dim=self.qk_nope_head_dim, kv_lora_rank=self.kv_lora_rank,
            qk_rope_head_dim=self.qk_rope_head_dim, block_tables=metadata.block_kv_indices,
            seq_lens=forward_batch.seq_lens.to(torch.int32),
            max_seq_len=int(metadata.block_kv_indices.shape[1] * self.page_size), bmm1_scale=bmm1_scale)
        raw_out_v = raw_out[..., : layer.v_head_dim].contiguous()
        return raw_out_v.view(-1, layer.tp_q_head_num * layer.v_head_dim)


# --- layers/radix_attention.py and a tiny DeepSeek-style decoder (absorbed MLA) ------------------------------------

class RadixAttention:
    def __init__(self, num_heads, head_dim, scaling, v_head_dim, layer_id):
        self.tp_q_head_num, self.head_dim, self.v_head_dim = num_heads, head_dim, v_head_dim
        self.scaling, self.layer_id = scaling, layer_id

    def __call__(self, q, k, v, forward_batch, q_rope=None, k_rope=None):
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch, q_rope=q_rope, k_rope=k_rope)


class DeepseekV2AttentionMLA:
    def __init__(self, layer_id, gen, device):
        r, p, h = KV_LORA_RANK, QK_ROPE_HEAD_DIM, NUM_HEADS
        self.q_nope_absorbed = randn(HIDDEN, h * r, gen=gen, device=device, scale=HIDDEN ** -0.5)  # W_q_nope @ W_UK
        self.q_rope_proj = randn(HIDDEN, h * p, gen=gen, device=device, scale=HIDDEN ** -0.5)
        self.kv_a_proj = randn(HIDDEN, r + p, gen=gen, device=device, scale=HIDDEN ** -0.5)
        self.o_proj = randn(h * r, HIDDEN, gen=gen, device=device, scale=(h * r) ** -0.5)        # W_UV @ W_o
        self.attn_mqa = RadixAttention(h, r + p, (r + p) ** -0.5, r, layer_id)

    def forward(self, hidden_states, forward_batch):
        q = hidden_states @ self.q_nope_absorbed
        q_rope = hidden_states @ self.q_rope_proj
        k_nope, k_rope = (hidden_states @ self.kv_a_proj).split([KV_LORA_RANK, QK_ROPE_HEAD_DIM], dim=-1)
        attn = self.attn_mqa(q, k_nope.unsqueeze(1), None, forward_batch, q_rope=q_rope, k_rope=k_rope.unsqueeze(1))
        return hidden_states + attn @ self.o_proj


class DeepseekV2ForCausalLM:
    def __init__(self, device):
        gen = generator(10330)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.layers = [DeepseekV2AttentionMLA(i, gen, device) for i in range(NUM_LAYERS)]
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=HIDDEN ** -0.5)

    def forward(self, input_ids, forward_batch):
        hidden_states = self.embed_tokens[input_ids]
        for layer in self.layers:
            hidden_states = layer.forward(hidden_states, forward_batch)
        return hidden_states @ self.lm_head              # next_token_logits


# --- model_executor/cuda_graph_runner.py ---------------------------------------------------------------------------

class CudaGraphRunner:
    def __init__(self, model_runner: "ModelRunner"):
        self.model_runner = model_runner
        self.device = model_runner.device
        self.graphs, self.output_buffers = {}, {}
        self.capture_bs = CUDA_GRAPH_BS
        self.max_bs = max(self.capture_bs)
        self.model_runner.attn_backend.init_cuda_graph_state(self.max_bs, self.max_bs)
        self.seq_len_fill_value = self.model_runner.attn_backend.get_cuda_graph_seq_len_fill_value()
        self.seq_lens_cpu = torch.full((self.max_bs,), self.seq_len_fill_value, dtype=torch.int32)
        # Graph inputs
        self.input_ids = torch.zeros((self.max_bs,), dtype=torch.int64, device=self.device)
        self.req_pool_indices = torch.zeros((self.max_bs,), dtype=torch.int32, device=self.device)
        self.seq_lens = torch.full((self.max_bs,), self.seq_len_fill_value, dtype=torch.int32, device=self.device)
        self.out_cache_loc = torch.zeros((self.max_bs,), dtype=torch.int64, device=self.device)
        self.graph_memory_pool = graph_pool_handle(self.device)
        self.capture()

    def can_run(self, forward_batch: ForwardBatch):
        return forward_batch.batch_size <= self.max_bs

    def capture(self):
        # Reverse the order to enable better memory sharing across cuda graphs.
        for bs in reversed(self.capture_bs):
            graph, output_buffers = self.capture_one_batch_size(bs, self.model_runner.model.forward)
            self.graphs[bs] = graph
            self.output_buffers[bs] = output_buffers

    def capture_one_batch_size(self, bs: int, forward):
        input_ids = self.input_ids[:bs]
        req_pool_indices = self.req_pool_indices[:bs]
        seq_lens = self.seq_lens[:bs]
        out_cache_loc = self.out_cache_loc[:bs]
        mr = self.model_runner
        forward_batch = ForwardBatch(ForwardMode.DECODE, bs, input_ids, req_pool_indices, seq_lens, out_cache_loc,
                                     bs * self.seq_len_fill_value, mr.req_to_token_pool, mr.token_to_kv_pool,
                                     mr.attn_backend)
        # Attention backend
        mr.attn_backend.init_forward_metadata_capture_cuda_graph(bs, bs, req_pool_indices, seq_lens, None,
                                                                forward_batch.forward_mode, None)

        def run_once():
            return forward(input_ids, forward_batch)

        kv = mr.token_to_kv_pool
        return capture(
            run_once, device=self.device, pool=self.graph_memory_pool, warmups=2, name=f"decode bs={bs}",
            owner="CudaGraphRunner",
            static={"input_ids": self.input_ids, "req_pool_indices": self.req_pool_indices,
                    "seq_lens": self.seq_lens, "out_cache_loc": self.out_cache_loc},
            state={f"kv_buffer[{i}]": t for i, t in enumerate(kv.kv_buffer)})

    def replay_prepare(self, forward_batch: ForwardBatch):
        raw_bs = forward_batch.batch_size
        index = bisect.bisect_left(self.capture_bs, raw_bs)
        bs = self.capture_bs[index]
        if bs != raw_bs:
            self.seq_lens.fill_(self.seq_len_fill_value)
            self.out_cache_loc.zero_()
        # Common inputs
        self.input_ids[:raw_bs].copy_(forward_batch.input_ids)
        self.req_pool_indices[:raw_bs].copy_(forward_batch.req_pool_indices)
        self.seq_lens[:raw_bs].copy_(forward_batch.seq_lens)
        self.out_cache_loc[:raw_bs].copy_(forward_batch.out_cache_loc)
        if bs != raw_bs:
            self.seq_lens_cpu.fill_(self.seq_len_fill_value)
        self.seq_lens_cpu[:raw_bs].copy_(forward_batch.seq_lens_cpu)
        # Attention backend
        self.model_runner.attn_backend.init_forward_metadata_replay_cuda_graph(
            bs, self.req_pool_indices, self.seq_lens,
            forward_batch.seq_lens_sum + (bs - raw_bs) * self.seq_len_fill_value, None,
            forward_batch.forward_mode, None, seq_lens_cpu=self.seq_lens_cpu)
        self.raw_bs, self.bs = raw_bs, bs

    def replay(self, forward_batch: ForwardBatch):
        self.replay_prepare(forward_batch)
        bs, raw_bs = self.bs, self.raw_bs
        padded = None if bs == raw_bs else {            # padded rows left as they were (seq_lens and
            "input_ids": self.input_ids[:bs],           # out_cache_loc were reset by fill_ / zero_)
            "req_pool_indices": self.req_pool_indices[:bs]}
        next_token_logits = replay(self.graphs[bs], self.output_buffers[bs], real=raw_bs, size=bs, padded=padded)
        return next_token_logits[:raw_bs]


# --- model_executor/model_runner.py ---------------------------------------------------------------------------------

class ModelRunner:
    def __init__(self, device, variant, use_cuda_graph):
        self.device, self.page_size, self.context_len = device, PAGE_SIZE, CONTEXT_LEN
        self.model = DeepseekV2ForCausalLM(device)
        self.req_to_token_pool = ReqToTokenPool(REQ_POOL_SIZE, CONTEXT_LEN, device)
        self.token_to_kv_pool = MLATokenToKVPool(NUM_PAGES * PAGE_SIZE, KV_LORA_RANK, QK_ROPE_HEAD_DIM, NUM_LAYERS,
                                                 device)
        self.attn_backend = TRTLLMMLABackend(self, variant)
        self.cuda_graph_runner = CudaGraphRunner(self) if use_cuda_graph else None

    def forward_decode(self, forward_batch: ForwardBatch):
        if self.cuda_graph_runner is not None and self.cuda_graph_runner.can_run(forward_batch):
            return self.cuda_graph_runner.replay(forward_batch)
        self.attn_backend.init_forward_metadata(forward_batch)
        return self.model.forward(forward_batch.input_ids, forward_batch)


# --- the workload -----------------------------------------------------------------------------------------------------

# Requests: (req_pool_idx, its pages in the KV pool); prompt lengths; decode steps (batch compositions).
REQUESTS = {"A": (1, [5, 2, 9, 11]), "B": (3, [7, 3, 10, 6]), "C": (4, [8, 1, 4, 15]), "D": (6, [12, 13, 14, 16])}
PROMPT_LENS = {"A": 5, "B": 9, "C": 2, "D": 6}
STEPS = [["A", "B", "C"], ["A", "B", "C"], ["A", "C"], ["A", "C", "D"], ["A", "B", "C", "D"]]


def run(variant: str, device: str = "cpu"):
    global global_zero_init_workspace_buffer
    gen = generator(103300)
    num_slots = NUM_PAGES * PAGE_SIZE
    prefill_kv = [randn(num_slots, 1, KV_LORA_RANK + QK_ROPE_HEAD_DIM, gen=gen, device=device)
                  for _ in range(NUM_LAYERS)]
    tokens = torch.randint(0, VOCAB, (len(STEPS), 4), generator=gen).tolist()

    def serve(use_cuda_graph: bool):
        global global_zero_init_workspace_buffer
        global_zero_init_workspace_buffer = None          # a fresh server process
        runner = ModelRunner(device, variant, use_cuda_graph)
        for name, (idx, pages) in REQUESTS.items():
            # the request's token slots, page by page (the paged allocator), and its prompt's latent K/V
            row = [pages[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE for pos in range(16)]
            runner.req_to_token_pool.req_to_token[idx, :16].copy_(torch.tensor(row, dtype=torch.int32))
            slots = torch.tensor(row[:PROMPT_LENS[name]], device=device)
            for layer, kv in enumerate(prefill_kv):
                runner.token_to_kv_pool.kv_buffer[layer][slots] = kv[slots]
        lens = dict(PROMPT_LENS)
        outs = []
        for step, batch in enumerate(STEPS):
            for name in batch:
                lens[name] += 1                          # the token decoded this step
            seq_lens = torch.tensor([lens[n] for n in batch], dtype=torch.int32)
            req_pool_indices = torch.tensor([REQUESTS[n][0] for n in batch], dtype=torch.int32)
            out_cache_loc = runner.req_to_token_pool.req_to_token[req_pool_indices.to(device).long(),
                                                                  seq_lens.to(device).long() - 1].long()
            forward_batch = ForwardBatch(
                ForwardMode.DECODE, len(batch), torch.tensor(tokens[step][:len(batch)], device=device),
                req_pool_indices.to(device), seq_lens.to(device), out_cache_loc, int(seq_lens.sum()),
                runner.req_to_token_pool, runner.token_to_kv_pool, runner.attn_backend, seq_lens_cpu=seq_lens)
            outs.append(runner.forward_decode(forward_batch).clone())
        return outs

    try:
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
    finally:
        global_zero_init_workspace_buffer = None
