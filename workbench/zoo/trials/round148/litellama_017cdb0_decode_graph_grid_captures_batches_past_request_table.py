"""lite_llama (harleyszhang/lite_llama, an educational Triton LLM engine) captures its decode step once per
``(batch_size, seq_len_bucket)`` pair when ``ModelExecutor.enable_cuda_graph`` runs: ``CUDAGraphManager.capture_all``
makes a ``CUDAGraphRunner`` per pair, whose ``capture`` seeds ``b_seq_len`` and runs the model three times (warmup)
and once under capture on a dummy batch of that size. The decode kernel (``flash_decoding``) reads a row of the
request-to-KV-slot table ``b_req_tokens_table`` per batch row. That table has ``max_request_num`` rows
(``max_gpu_num_blocks // max_seq_len``), but the capture grid was the fixed ``DEFAULT_BATCH_SIZES`` (1 ... 128): with a
small KV pool every batch size above ``max_request_num`` made the capture's dummy batch read past the end of the
table. A real batch can never be that large (its rows are the table's rows), so only the graphs' dummy batches hit
it. The fix drops the batch sizes above ``max_request_num`` from the grid before capturing.

Upstream: https://github.com/harleyszhang/lite_llama/commit/017cdb04dfdb540c667e3e29a57deb0a07b4dcbb ("fix: batch
prefill KV misalignment + CUDA graph OOM; remove dead code", repository harleyszhang/lite_llama, author harleyszhang,
committed to ``main`` 2026-08-20; a direct commit, no pull request that I found). Read, in a mirror of the
repository: the whole commit message and the diffs of ``lite_llama/executor/model_executor.py`` and
``lite_llama/executor/cuda_graph.py`` and the test it added (``tests/test_cuda_graph.py``,
``test_capture_clamps_batch_sizes_to_request_table``); before the fix (``017cdb0^``): ``cuda_graph.py`` whole
(``CUDAGraphRunner.__init__/capture/replay``, ``CUDAGraphManager.capture_all/_pick_bucket/try_replay``),
``model_executor.py`` (``__init__``, ``_init_req_tokens_table``, ``prefill_alloc_kv_cache``, ``decode_alloc_kv_cache``,
``enable_cuda_graph``, ``forward``), ``models/base.py`` (``PagedAttention``, ``Attention``, ``FusedMLP``,
``DecoderLayer``, ``CausalLM.forward``), ``kernels/flashdecoding.py`` (both stages and ``flash_decoding``),
``kernels/update_kv_index.py``, the end of ``kernels/update_kv_buffer.py``, ``KVCacheMemoryManager`` in
``executor/mem_manager.py``, and ``LLMEngine.__init__/generate`` in ``engine/llm_engine.py``.
Not read: the Triton kernels' launch internals beyond the table and ``b_seq_len`` loads, ``rope_emb_forward``,
``skip_rmsnorm`` and ``swiglu_forward`` kernels (written here from their names and call sites), ``MemoryProfiler``, the
sampler beyond greedy ``argmax``, ``_step_positions`` past its docstring, and the commit's other fixes (prefill table
layout, capture workspace reserve, OOM fallback), which are not modelled.
Symptom: the added test's docstring: "Batch sizes above ``max_request_num`` index past ``b_req_tokens_table``.
Capturing them read out-of-bounds memory and killed the CUDA context with delayed CUBLAS errors"; the commit message
calls it "the post-construction enable crash" (``LLMEngine`` calls ``enable_cuda_graph`` in its constructor).
Mechanism: ``ModelExecutor.__init__`` sizes ``b_req_tokens_table`` ``[max_request_num, max_seq_len]``.
``enable_cuda_graph`` filtered the seq-len buckets by ``max_seq_len`` but passed every batch size on. For ``bs >
max_request_num`` the runner's warmup runs ``flash_decoding`` on ``bs`` rows, and its stage-1 kernel loads
``b_req_tokens_table + stride * batch_pid`` for every ``batch_pid < bs``: rows the table does not have. Here the table
rows are taken with ``narrow``, which refuses (on both devices) where the kernel read out of bounds.
Doctor: undersized-buffer, at ``enable_cuda_graph``: the captured step's size (the grid's batch size) does not fit
the static request table the step reads; ``enable_cuda_graph`` chooses that grid without the table's bound, and it is
the function the fix changes (the clamp ``b <= self.max_request_num``).
Fix (upstream): ``batch_sizes = tuple(b for b in batch_sizes if b <= self.max_request_num)`` before building the
manager (with a warning and no capture if none is left).
Modelled: ``ModelExecutor`` (``max_request_num``, ``prefill_alloc_kv_cache``, ``_init_req_tokens_table``,
``decode_alloc_kv_cache``, ``enable_cuda_graph``, ``forward``), ``ReqTokensManager.b_req_tokens_table``,
``KVCacheMemoryManager`` (``gpu_kv_buffer``, ``alloc_kvcache_index``), ``AttentionInfo``, ``_GraphKey``,
``CUDAGraphRunner`` (``capture`` seeding ``b_seq_len`` with ``min(bucket, 32)``, three warmups, ``replay`` copying
``input_ids``/``position_ids``/``cur_select_index``/``b_seq_len``/``b_req_idx``), ``CUDAGraphManager`` (``capture_all``,
``_pick_bucket``, ``try_replay``), ``update_kv_index``, ``update_kv_buffer``, ``flash_decoding`` with
``flash_decode_stage1``/``flash_decode_stage2`` (partitions of the context, table rows by batch position, combine
loop bounded per row by ``b_seq_len``), ``PagedAttention`` (``context_forward``, ``token_forward``), ``Attention``,
``FusedMLP``, ``DecoderLayer``, ``CausalLM``, ``LLMEngine`` (``__init__`` enabling graphs, ``generate``).
Stand-ins: float64, 2 layers of width 16 (2 query heads, 1 KV head, head 8), vocabulary 32, partitions of 8 tokens
(upstream 128) without the inner online softmax; ``DEFAULT_BATCH_SIZES`` (1, 2, 4) and buckets (16, 32) for (1 ... 128)
and (256 ... 4096); ``max_seq_len`` 32 and a pool of 64 tokens (so ``max_request_num`` is 2, as in the added test's
1024 // 512); the pool allocates the lowest free slots (no contiguity search) and is not freed between calls (not
checked upstream); prompts of equal length (the commit's other fix, the prefill table layout, then changes nothing);
prefill is plain causal attention. The Triton kernel's unchecked read becomes a ``narrow`` that raises.
Workload: an engine built with ``use_cuda_graph`` (graphs captured in its constructor), then ``generate`` of two
prompts of 6 tokens for 14 steps (prefill, then decode through the batch-2 graphs of buckets 16 and 32) and of one
prompt for 8 steps (the batch-1 graph). Outputs: every step's logits, the tokens and the KV pool. Without graphs:
the same engine with ``use_cuda_graph`` off.
Measured: the check printed
  litellama_017cdb0_decode_graph_grid_captures_batches_past_request_table [bug] on cpu: misbehaves (raised
  RuntimeError: start (0) + length (4) exceeds dimension size (2).)
  litellama_017cdb0_decode_graph_grid_captures_batches_past_request_table [fix] on cpu: equals eager (max |graph -
  eager| = 0)
With the fix the grid is batch sizes 1 and 2 (4 graphs) and all 20 decode steps are replays (batch 2: 10 of
bucket 16, 3 of bucket 32; batch 1: 7 of bucket 16), each equal to the run without graphs. As a check that the
graphs read their inputs, a replay that skips copying ``b_seq_len`` gives logits off by 27 (not kept).
"""
from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/harleyszhang/lite_llama/commit/017cdb04dfdb540c667e3e29a57deb0a07b4dcbb"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "enable_cuda_graph"
SYMPTOM = ("enable_cuda_graph captured the fixed batch-size grid, and every batch size above max_request_num made the "
           "capture's dummy decode read past the rows of b_req_tokens_table (out-of-bounds reads that killed the CUDA "
           "context at engine construction)")

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 32, 16, 2, 1, 8, 32, 2
MAX_SEQ_LEN, MAX_GPU_NUM_BLOCKS, PARTITION_SIZE = 32, 64, 8
DEFAULT_BATCH_SIZES, DEFAULT_SEQ_LEN_BUCKETS = (1, 2, 4), (16, 32)
DTYPE, EPS = torch.float64, 1e-6
_variant = "bug"


# --- kernels (torch stand-ins for the Triton ones) --------------------------------------------------------------

def skip_rmsnorm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    if residual is not None:
        x = x + residual
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight, x


def rope_emb_forward(xq: Tensor, xk: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    def rot(x):
        x1, x2 = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2:]
        c, s = cos[:, None, :], sin[:, None, :]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)
    return rot(xq), rot(xk)


def update_kv_buffer(kv_values: Tensor, select_index: Tensor, kv_buffer: Tensor) -> None:
    kv_buffer.index_copy_(0, select_index, kv_values)                  # KV_Buffer[Select_Index[i]] = KV_Values[i]


def update_kv_index(req_to_token_indexs: Tensor, b_req_idx: Tensor, b_seq_len: Tensor, select_index: Tensor) -> None:
    """req_to_token_indexs[b_req_idx[i], b_seq_len[i] - 1] = select_index[i]"""
    req_to_token_indexs.index_put_((b_req_idx, b_seq_len - 1), select_index.to(req_to_token_indexs.dtype))


def flash_decode_stage1(q, k_cache, v_cache, qk_scale, b_req_tokens_table, b_seq_len, max_num_partitions):
    """One program per (batch row, head, partition): the row's KV slots are ``b_req_tokens_table[batch_pid]``."""
    batchs = q.shape[0]
    width = max_num_partitions * PARTITION_SIZE
    # tl.load(b_req_tokens_table + stride_req_to_tokens_b * batch_pid + offs_n): the table row of each batch row.
    rows = b_req_tokens_table.narrow(0, 0, batchs)[:, :width]
    offs = torch.arange(width, device=q.device)
    valid = offs[None, :] < b_seq_len[:, None]                                             # [B, W]
    k_loc = torch.where(valid, rows.long(), torch.zeros_like(rows, dtype=torch.long))
    group = HEADS // KV_HEADS
    k = k_cache[k_loc].repeat_interleave(group, dim=2)                                    # [B, W, H, D]
    v = torch.where(valid[:, :, None, None], v_cache[k_loc], 0.0).repeat_interleave(group, dim=2)
    k = k.view(batchs, max_num_partitions, PARTITION_SIZE, HEADS, HEAD_DIM).permute(0, 3, 1, 2, 4)
    v = v.view(batchs, max_num_partitions, PARTITION_SIZE, HEADS, HEAD_DIM).permute(0, 3, 1, 2, 4)
    mask = valid.view(batchs, 1, max_num_partitions, PARTITION_SIZE)
    qk = (q[:, :, None, None, :] * k).sum(-1) * qk_scale                                  # [B, H, NP, P]
    qk = qk.masked_fill(~mask, float("-inf"))
    stored = mask.any(-1)                                                                 # need_store
    m = torch.where(stored, qk.amax(-1), torch.zeros((), dtype=qk.dtype, device=qk.device))
    p = torch.exp(qk - m[..., None])
    d = p.sum(-1)
    d_safe = torch.where(stored, d, torch.ones_like(d))
    mid_o = torch.where(stored[..., None], (p[..., None] * v).sum(-2) / d_safe[..., None], 0.0)
    mid_o_logexpsum = torch.where(stored, m + torch.log(d_safe), 0.0)
    return mid_o, mid_o_logexpsum


def flash_decode_stage2(mid_o: Tensor, mid_o_logexpsum: Tensor, b_seq_len: Tensor) -> Tensor:
    """Reduction over the partitions: ``num_partitions = cdiv(cur_batch_seq_len, BLOCK_SEQ)`` per row."""
    num_partitions = ((b_seq_len + PARTITION_SIZE - 1) // PARTITION_SIZE)[:, None]        # [B, 1]
    acc = torch.zeros_like(mid_o[:, :, 0])
    d_i = torch.zeros_like(mid_o_logexpsum[:, :, 0])
    m_i = torch.full_like(d_i, float("-inf"))
    for block_seq_n in range(mid_o.shape[2]):
        take = block_seq_n < num_partitions
        part_v, part_max = mid_o[:, :, block_seq_n], mid_o_logexpsum[:, :, block_seq_n]
        m_ij = torch.maximum(part_max, m_i)
        alpha, p = torch.exp(m_i - m_ij), torch.exp(part_max - m_ij)
        acc = torch.where(take[..., None], alpha[..., None] * acc + p[..., None] * part_v, acc)
        d_i = torch.where(take, alpha * d_i + p, d_i)
        m_i = torch.where(take, m_ij, m_i)
    return acc / d_i[..., None]


def flash_decoding(q, k_cache, v_cache, qk_scale, b_req_tokens_table, b_seq_len, max_actual_seq_len):
    max_num_partitions = (max_actual_seq_len + PARTITION_SIZE - 1) // PARTITION_SIZE
    mid_o, mid_o_logexpsum = flash_decode_stage1(q, k_cache, v_cache, qk_scale, b_req_tokens_table, b_seq_len,
                                                 max_num_partitions)
    return flash_decode_stage2(mid_o, mid_o_logexpsum, b_seq_len)


# --- model --------------------------------------------------------------------------------------------------------

class AttentionInfo:
    kv_buffer: list
    b_req_tokens_table: Tensor
    b_req_idx: Tensor
    b_seq_len: Tensor
    cur_select_index: Tensor
    max_actual_seq_len: int


class PagedAttention:
    def __init__(self):
        self.scale = 1.0 / math.sqrt(HEAD_DIM)

    def _write_cache(self, xk, xv, atten_info, layer_index):
        update_kv_buffer(torch.cat([xk, xv], dim=-2), atten_info.cur_select_index, atten_info.kv_buffer[layer_index])

    def context_forward(self, xq, xk, xv, atten_info, layer_index, batch_size, seq_len):
        self._write_cache(xk, xv, atten_info, layer_index)
        q, k, v = (t.view(batch_size, seq_len, -1, HEAD_DIM).transpose(1, 2) for t in (xq, xk, xv))
        k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
        pos = torch.arange(seq_len, device=xq.device)
        allowed = (pos[None, :] <= pos[:, None])[None] & (pos[None, None, :] < atten_info.b_seq_len[:, None, None])
        scores = (q @ k.transpose(-1, -2) * self.scale).masked_fill(~allowed[:, None], float("-inf"))
        return (torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(-1, HEADS, HEAD_DIM)

    def token_forward(self, xq, xk, xv, atten_info, layer_index):
        self._write_cache(xk, xv, atten_info, layer_index)
        kv_buffer = atten_info.kv_buffer[layer_index]
        return flash_decoding(xq, kv_buffer[:, :KV_HEADS, :], kv_buffer[:, KV_HEADS:, :], self.scale,
                              atten_info.b_req_tokens_table, atten_info.b_seq_len, atten_info.max_actual_seq_len)


class Attention:
    def __init__(self, w):
        self.q_proj_weight, self.kv_proj_weight = w(HEADS * HEAD_DIM, HIDDEN), w(2 * KV_HEADS * HEAD_DIM, HIDDEN)
        self.o_proj_weight = w(HIDDEN, HEADS * HEAD_DIM)
        self.attn = PagedAttention()

    def forward(self, x, atten_info, layer_index, position_embeddings):
        batch_size, seq_len, _ = x.shape
        x = x.view(-1, HIDDEN)
        xq = (x @ self.q_proj_weight.T).view(-1, HEADS, HEAD_DIM)
        xk, xv = (x @ self.kv_proj_weight.T).split(KV_HEADS * HEAD_DIM, dim=-1)
        xk, xv = xk.reshape(-1, KV_HEADS, HEAD_DIM), xv.reshape(-1, KV_HEADS, HEAD_DIM)
        xq, xk = rope_emb_forward(xq, xk, *position_embeddings)
        if seq_len > 1:
            out = self.attn.context_forward(xq, xk, xv, atten_info, layer_index, batch_size, seq_len)
        else:
            out = self.attn.token_forward(xq, xk, xv, atten_info, layer_index)
        return out.reshape(batch_size, seq_len, HEADS * HEAD_DIM) @ self.o_proj_weight.T


class FusedMLP:
    def __init__(self, w):
        self.gate, self.up, self.down = w(FFN, HIDDEN), w(FFN, HIDDEN), w(HIDDEN, FFN)

    def forward(self, x):
        g = x @ self.gate.T
        return (g * torch.sigmoid(g) * (x @ self.up.T)) @ self.down.T


class DecoderLayer:
    def __init__(self, w, ones):
        self.input_layernorm_weight, self.post_attention_layernorm_weight = ones(), ones()
        self.self_attn, self.mlp = Attention(w), FusedMLP(w)

    def forward(self, hidden_states, atten_info, layer_index, position_embeddings, residual):
        hidden_states, residual = skip_rmsnorm(hidden_states, residual, self.input_layernorm_weight, EPS)
        hidden_states = self.self_attn.forward(hidden_states, atten_info, layer_index, position_embeddings)
        hidden_states, residual = skip_rmsnorm(hidden_states, residual, self.post_attention_layernorm_weight, EPS)
        return self.mlp.forward(hidden_states), residual


class CausalLM:
    def __init__(self, device):
        gen = generator(17)

        def w(rows, cols):
            return (torch.randn(rows, cols, generator=gen, dtype=DTYPE) / math.sqrt(cols)).to(device)

        def ones():
            return (1.0 + 0.1 * torch.randn(HIDDEN, generator=gen, dtype=DTYPE)).to(device)

        self.embed_tokens = torch.randn(VOCAB, HIDDEN, generator=gen, dtype=DTYPE).to(device)
        self.layers = [DecoderLayer(w, ones) for _ in range(LAYERS)]
        self.norm_weight, self.lm_head_weight = ones(), (w(VOCAB, HIDDEN) * 3.0)
        inv = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=DTYPE) / HEAD_DIM))
        freqs = torch.arange(MAX_SEQ_LEN, dtype=DTYPE)[:, None] * inv[None, :]
        self.cos_cached, self.sin_cached = freqs.cos().to(device), freqs.sin().to(device)

    def __call__(self, input_ids: Tensor, position_ids: Tensor, atten_info: AttentionInfo) -> Tensor:
        hidden_states = self.embed_tokens[input_ids]
        flat = position_ids.reshape(-1)
        position_embeddings = (self.cos_cached[flat], self.sin_cached[flat])
        residual = None
        for layer_index, layer in enumerate(self.layers):
            hidden_states, residual = layer.forward(hidden_states, atten_info, layer_index, position_embeddings,
                                                    residual)
        hidden_states, _ = skip_rmsnorm(hidden_states, residual, self.norm_weight, EPS)
        return hidden_states @ self.lm_head_weight.T


# --- executor -----------------------------------------------------------------------------------------------------

class KVCacheMemoryManager:
    def __init__(self, gpu_num_blocks: int, device):
        self.device, self.max_num_tokens = device, gpu_num_blocks
        self.gpu_kv_buffer = [torch.zeros(gpu_num_blocks, 2 * KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
                              for _ in range(LAYERS)]
        self.next_free = 0

    def alloc_kvcache_index(self, need_size: int) -> Tensor:
        if self.next_free + need_size > self.max_num_tokens:
            raise RuntimeError(f"no enough cache need_size {need_size}")
        select_index = torch.arange(self.next_free, self.next_free + need_size, device=self.device)
        self.next_free += need_size
        return select_index


class ReqTokensManager:
    def __init__(self, max_request_num: int, max_seq_len: int, device):
        self.b_req_tokens_table = torch.zeros(max_request_num, max_seq_len, dtype=torch.int32, device=device)


@dataclasses.dataclass(frozen=True)
class _GraphKey:
    batch_size: int
    seq_len_bucket: int


class CUDAGraphRunner:
    def __init__(self, model, *, batch_size, seq_len_bucket, kv_buffer, b_req_tokens_table, device):
        self.model, self.batch_size, self.seq_len_bucket, self.device = model, batch_size, seq_len_bucket, device
        self.input_ids = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
        self.position_ids = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
        self.atten_info = AttentionInfo()
        self.atten_info.kv_buffer = kv_buffer
        self.atten_info.b_req_tokens_table = b_req_tokens_table
        self.atten_info.cur_select_index = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.atten_info.b_seq_len = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.atten_info.b_req_idx = torch.arange(batch_size, dtype=torch.long, device=device)
        self.atten_info.max_actual_seq_len = seq_len_bucket       # Python int baked into the launch: mid_o's shape
        self._graph, self._output = None, None

    def capture(self) -> None:
        self.atten_info.b_seq_len.fill_(min(self.seq_len_bucket, 32))
        info = self.atten_info
        self._graph, self._output = capture(
            lambda: self.model(self.input_ids, self.position_ids, info), device=self.device, warmups=3,
            name=f"decode bs={self.batch_size} bucket={self.seq_len_bucket}", owner="lite_llama CUDAGraphRunner",
            static={"input_ids": self.input_ids, "position_ids": self.position_ids,
                    "cur_select_index": info.cur_select_index, "b_seq_len": info.b_seq_len,
                    "b_req_idx": info.b_req_idx},
            state={**{f"kv_buffer[{i}]": t for i, t in enumerate(info.kv_buffer)},
                   "b_req_tokens_table": info.b_req_tokens_table})

    def replay(self, input_ids, position_ids, cur_select_index, b_seq_len, b_req_idx) -> Tensor:
        self.input_ids.copy_(input_ids.view(self.batch_size, 1))
        self.position_ids.copy_(position_ids.view(self.batch_size, 1))
        self.atten_info.cur_select_index.copy_(cur_select_index)
        self.atten_info.b_seq_len.copy_(b_seq_len)
        self.atten_info.b_req_idx.copy_(b_req_idx.to(self.atten_info.b_req_idx.dtype))
        return replay(self._graph, self._output)


class CUDAGraphManager:
    def __init__(self, model, *, kv_buffer, b_req_tokens_table, batch_sizes, seq_len_buckets, device):
        self.model, self.kv_buffer, self.b_req_tokens_table, self.device = model, kv_buffer, b_req_tokens_table, device
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.seq_len_buckets = tuple(sorted(set(seq_len_buckets)))
        self._runners: dict = {}

    def capture_all(self) -> None:
        for bs in self.batch_sizes:
            for bucket in self.seq_len_buckets:
                runner = CUDAGraphRunner(self.model, batch_size=bs, seq_len_bucket=bucket, kv_buffer=self.kv_buffer,
                                         b_req_tokens_table=self.b_req_tokens_table, device=self.device)
                runner.capture()
                self._runners[_GraphKey(bs, bucket)] = runner

    def _pick_bucket(self, current_max_seq_len: int) -> int | None:
        return next((b for b in self.seq_len_buckets if b >= current_max_seq_len), None)

    def try_replay(self, input_ids, position_ids, atten_info) -> Tensor | None:
        batch_size, seq_len = input_ids.shape
        if seq_len != 1:
            return None
        bucket = self._pick_bucket(atten_info.max_actual_seq_len)
        runner = None if bucket is None else self._runners.get(_GraphKey(batch_size, bucket))
        if runner is None:
            return None
        return runner.replay(input_ids, position_ids, atten_info.cur_select_index, atten_info.b_seq_len,
                             atten_info.b_req_idx)


class ModelExecutor:
    def __init__(self, model: CausalLM, max_gpu_num_blocks: int, device):
        self.model, self.device, self.max_seq_len = model, device, MAX_SEQ_LEN
        self.kv_mem_manager = KVCacheMemoryManager(max_gpu_num_blocks, device)
        self.max_request_num = max(1, max_gpu_num_blocks // self.max_seq_len)
        self.req_tokens_manager = ReqTokensManager(self.max_request_num, self.max_seq_len, device)
        self.atten_info = AttentionInfo()
        self.atten_info.kv_buffer = self.kv_mem_manager.gpu_kv_buffer
        self.atten_info.b_req_tokens_table = self.req_tokens_manager.b_req_tokens_table
        self._graph_manager: CUDAGraphManager | None = None

    def _init_req_tokens_table(self, b_req_idx, b_seq_len, alloc_index, max_prompt_len) -> Tensor:
        b_start_loc = torch.zeros(len(b_seq_len), dtype=torch.int32, device=self.device)
        for i, (req, seq_len) in enumerate(zip(b_req_idx.tolist(), b_seq_len.tolist())):
            start = i * max_prompt_len
            b_start_loc[i] = start
            self.atten_info.b_req_tokens_table[req, :seq_len] = alloc_index[start:start + seq_len].to(torch.int32)
        return b_start_loc

    def prefill_alloc_kv_cache(self, max_prompt_len, actual_prompt_lens, b_req_idx) -> Tensor:
        batch_size = len(actual_prompt_lens)
        self.atten_info.b_req_idx = b_req_idx
        self.atten_info.cur_select_index = self.kv_mem_manager.alloc_kvcache_index(max_prompt_len * batch_size)
        self.atten_info.b_seq_len = actual_prompt_lens
        self.atten_info.max_actual_seq_len = max_prompt_len
        self.atten_info.b_start_loc = self._init_req_tokens_table(
            b_req_idx, actual_prompt_lens, self.atten_info.cur_select_index, max_prompt_len)
        return self.atten_info.cur_select_index

    def decode_alloc_kv_cache(self, batch_size) -> Tensor:
        self.atten_info.cur_select_index = self.kv_mem_manager.alloc_kvcache_index(batch_size)
        self.atten_info.b_seq_len += 1
        self.atten_info.max_actual_seq_len += 1
        update_kv_index(self.atten_info.b_req_tokens_table, self.atten_info.b_req_idx, self.atten_info.b_seq_len,
                        self.atten_info.cur_select_index)
        return self.atten_info.cur_select_index

    def enable_cuda_graph(self, batch_sizes=DEFAULT_BATCH_SIZES, seq_len_buckets=DEFAULT_SEQ_LEN_BUCKETS) -> None:
        if self._graph_manager is not None:
            return
        seq_len_buckets = tuple(b for b in seq_len_buckets if b <= self.max_seq_len)
        if not seq_len_buckets:
            return
        if _variant == "fix":
            # b_req_tokens_table only has max_request_num rows; capturing a larger batch would index past the table.
            batch_sizes = tuple(b for b in batch_sizes if b <= self.max_request_num)
            if not batch_sizes:
                return
        manager = CUDAGraphManager(self.model, kv_buffer=self.kv_mem_manager.gpu_kv_buffer,
                                   b_req_tokens_table=self.req_tokens_manager.b_req_tokens_table,
                                   batch_sizes=batch_sizes, seq_len_buckets=seq_len_buckets, device=self.device)
        manager.capture_all()
        self._graph_manager = manager

    def forward(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        if self._graph_manager is not None:
            replayed = self._graph_manager.try_replay(input_ids, position_ids, self.atten_info)
            if replayed is not None:
                return replayed
        return self.model(input_ids, position_ids, self.atten_info)


class LLMEngine:
    def __init__(self, device, use_cuda_graph: bool):
        self.device = device
        self.executor = ModelExecutor(CausalLM(device), MAX_GPU_NUM_BLOCKS, device)
        if use_cuda_graph:
            self.executor.enable_cuda_graph()
        self.outputs: list = []

    def generate(self, prompt_token_ids: list, max_gen_len: int) -> Tensor:
        batch_size = len(prompt_token_ids)
        prompt_lens = [len(ids) for ids in prompt_token_ids]
        max_prompt_len = max(prompt_lens)
        total_len = min(self.executor.max_seq_len, max_prompt_len + max_gen_len)
        tokens = torch.zeros(batch_size, total_len, dtype=torch.long, device=self.device)
        for i, ids in enumerate(prompt_token_ids):
            tokens[i, :len(ids)] = torch.tensor(ids, dtype=torch.long).to(self.device)
        b_req_idx = torch.arange(batch_size, device=self.device)
        prompt_len_tensor = torch.tensor(prompt_lens, dtype=torch.long).to(self.device)
        self.executor.prefill_alloc_kv_cache(max_prompt_len, prompt_len_tensor, b_req_idx)
        prev_pos = 0
        for cur_pos in range(max_prompt_len, total_len):
            input_ids = tokens[:, prev_pos:cur_pos]
            positions = torch.arange(prev_pos, cur_pos, device=self.device)[None, :].expand(batch_size, -1)
            logits = self.executor.forward(input_ids, positions)
            self.executor.decode_alloc_kv_cache(batch_size)
            self.outputs.append(logits[:, -1].clone())
            tokens[:, cur_pos] = torch.argmax(logits[:, -1], dim=-1)           # greedy (temperature 0)
            prev_pos = cur_pos
        return tokens


def serve(device, use_cuda_graph: bool) -> list:
    engine = LLMEngine(device, use_cuda_graph)
    first = engine.generate([[3, 17, 5, 9, 1, 12], [8, 2, 20, 11, 4, 7]], max_gen_len=14)
    second = engine.generate([[5, 9, 14, 2, 6, 1]], max_gen_len=8)
    return engine.outputs + [first, second] + [t.clone() for t in engine.executor.kv_mem_manager.gpu_kv_buffer]


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    return compare(__name__.rsplit(".", 1)[-1], variant, device,
                   lambda: serve(device, use_cuda_graph=True), lambda: serve(device, use_cuda_graph=False))
