"""MiniMax-M3 sparse attention in ATOM's sglang plugin compacts KV slots with a boolean mask and reads ``seq_lens.max().item()`` inside the decode forward: the HIP-graph capture fails.

Upstream: https://github.com/ROCm/ATOM/pull/1480 ("Fix sglang minimax m3 cuda graph capture problem",
commit c6780e4f321708449184e1fa3d664f85fc0bdbb2, merged 2026-07-08; no public issue).
Symptom: serving MiniMax-M3 through the ATOM sglang plugin with CUDA (HIP) graphs on, sglang's
``CudaGraphRunner.capture`` fails on the first decode batch size it captures: the stream capture is invalidated
by a device-to-host synchronisation (the two warmup forwards just before it, eager, pass). With
``--disable-cuda-graph`` decode works.
Mechanism: in ``atom/plugin/sglang/attention_backend/minimax_m3_sparse.py`` the attention entry point
``minimax_m3_sparse_attention_for_sglang`` builds its metadata inside the model forward, so everything it does is
inside ``torch.cuda.graph`` when sglang captures a decode batch. First ``_insert_sparse_cache`` drops the
``out_cache_loc < 0`` slots with a boolean mask: ``slots = slot_mapping[valid]`` and
``key/value/index_key.view(...)[valid]`` -- a dynamic-shape compaction (``nonzero``) whose output size the host must
read from the device. Then ``build_minimax_m3_block_table`` sizes the block table with
``max_seq_len = int(seq_lens.max().item())`` and ``build_minimax_m3_forward_metadata`` reads the same ``.item()``
for the top-k grid. Each of these is a host synchronisation, which a capturing stream refuses
(``hipErrorStreamCaptureUnsupported``); the capture is aborted and no decode graph exists. (Even if the sync were
allowed, the table width would be the dummy capture batch's and stay frozen for longer sequences.)
Doctor: sync-in-capture, at _insert_sparse_cache (the first host synchronisation the captured decode forward
reaches is its boolean-mask compaction ``slot_mapping[valid]``; the ``seq_lens.max().item()`` in
``build_minimax_m3_block_table`` / ``build_minimax_m3_forward_metadata``, fixed by the same PR, comes right after it).
Fix (upstream): a helper ``_is_stream_capturing()`` (``torch.cuda.is_current_stream_capturing()``); while capturing
a decode/idle batch the block table takes the full ``req_to_token`` width
(``max_blocks = token_table.shape[1] // page_size``) and ``max_seq_len = block_table.shape[1] * page_size``, and
``_insert_sparse_cache`` writes every slot of the fixed-size batch without compaction (sglang's padded rows carry
``out_cache_loc`` 0, the reserved padding page). The kernels bound everything by the device ``seq_lens``, so the
wider table changes no real row's result.
Modelled: one MiniMax-M3 attention layer (embedding -> q/k/v/index projections -> sparse attention -> logits),
float32, 2 query heads over 1 KV head (head_dim 8), 1 index head (dim 8), SPARSE_BLOCK_SIZE = page size 128,
top-k 3 blocks with 1 init and 1 local block forced. The triton kernels ``_decode_index_score_kernel``, the
split-K top-k and ``_sgl_m3_sparse_decode_kernel`` are written as dense torch ops (scores of blocks past
``seq_len`` are -inf, top-k pads with -1). sglang's ``CudaGraphRunner`` (capture sizes 1, 2, 4, reversed, two
warmups, a shared pool; replay fills padded rows with ``seq_len_fill_value`` 1 and ``out_cache_loc`` 0), a
``ReqToTokenPool`` and a paged KV pool whose page 0 is the padding page. The prompts are already in the caches;
three requests decode with batch sizes 3, 3, 2, 1 while A and B cross a page boundary (eager
block-table width 3 then 4).
"""
from __future__ import annotations

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/ROCm/ATOM/pull/1480"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "_insert_sparse_cache"
SYMPTOM = ("HIP-graph capture of MiniMax-M3 decode fails: boolean-mask slot compaction and seq_lens.max().item() "
           "inside the captured attention forward")

SPARSE_BLOCK_SIZE = 128
PAGE_SIZE = SPARSE_BLOCK_SIZE
VOCAB, HIDDEN = 32, 16
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_IDX_HEADS, IDX_HEAD_DIM = 2, 1, 8, 1, 8
TOPK_BLOCKS, INIT_BLOCKS, LOCAL_BLOCKS = 3, 1, 1
MAX_CONTEXT_LEN = 4 * PAGE_SIZE
NUM_PAGES = 9                                         # page 0: padding page
MAX_REQS = 4                                          # req_to_token row 0: unused (padded rows)
REQS = {"A": (1, [1, 2, 3, 4], 381), "B": (2, [5, 6], 127), "C": (3, [7, 8], 200)}   # req index, pages, prompt
STEPS = (("A", "B", "C"), ("A", "B", "C"), ("A", "C"), ("A",))
CAPTURE_BS = [1, 2, 4]
SEQ_LEN_FILL_VALUE = 1


# --- sglang: forward batch, pools ----------------------------------------------------------------------

class ForwardMode:
    DECODE, EXTEND, IDLE = "decode", "extend", "idle"

    def __init__(self, mode):
        self.mode = mode

    def is_decode_or_idle(self):
        return self.mode in (ForwardMode.DECODE, ForwardMode.IDLE)


class ForwardBatch:
    def __init__(self, forward_mode, batch_size, input_ids, req_pool_indices, seq_lens, out_cache_loc,
                 req_to_token_pool, token_to_kv_pool):
        self.forward_mode, self.batch_size, self.input_ids = forward_mode, batch_size, input_ids
        self.req_pool_indices, self.seq_lens, self.out_cache_loc = req_pool_indices, seq_lens, out_cache_loc
        self.req_to_token_pool, self.token_to_kv_pool = req_to_token_pool, token_to_kv_pool


class ReqToTokenPool:
    def __init__(self, device):
        self.req_to_token = torch.zeros(MAX_REQS, MAX_CONTEXT_LEN, dtype=torch.int32, device=device)


class MHATokenToKVPool:
    def __init__(self, k0, v0):
        self.page_size = PAGE_SIZE
        self.k_buffer, self.v_buffer = [k0.clone()], [v0.clone()]     # one layer

    def get_kv_buffer(self, layer_id):
        return self.k_buffer[layer_id], self.v_buffer[layer_id]


# --- atom/plugin/sglang/attention_backend/minimax_m3_sparse.py -------------------------------------------

def _is_stream_capturing() -> bool:
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except Exception:
        return False


class MiniMaxM3SGLangMetadata:
    """Per-forward SGLang metadata for MiniMax-M3 sparse attention (decode fields)."""

    def __init__(self, is_decode, seq_lens, block_table, max_seq_len):
        self.is_decode, self.seq_lens, self.block_table, self.max_seq_len = is_decode, seq_lens, block_table, max_seq_len


def _get_batch_size(forward_batch) -> int:
    return int(getattr(forward_batch, "batch_size"))


def _slice_i32(tensor, batch_size):
    return tensor[:batch_size].to(dtype=torch.int32)


def _get_page_size(forward_batch) -> int:
    return int(getattr(forward_batch.token_to_kv_pool, "page_size", 1))


def build_minimax_m3_block_table(forward_batch, page_size, variant):
    """Build physical block ids from SGLang's request-token table (decode path)."""
    batch_size = _get_batch_size(forward_batch)
    req_pool_indices = forward_batch.req_pool_indices[:batch_size]
    req_to_token = forward_batch.req_to_token_pool.req_to_token
    token_table = req_to_token[req_pool_indices, :].clone()
    seq_lens = _slice_i32(forward_batch.seq_lens, batch_size)
    if variant == "fix" and _is_stream_capturing() and forward_batch.forward_mode.is_decode_or_idle():
        max_blocks = int(token_table.shape[1]) // page_size
    else:
        max_seq_len = int(seq_lens.max().item()) if batch_size else 0      # bug: a host sync in capture
        max_blocks = (max_seq_len + page_size - 1) // page_size
    block_table = token_table[:, : max_blocks * page_size : page_size] // page_size
    return block_table.to(dtype=torch.int32).contiguous()


def build_minimax_m3_forward_metadata(forward_batch, block_table, page_size, variant):
    batch_size = _get_batch_size(forward_batch)
    seq_lens = _slice_i32(forward_batch.seq_lens, batch_size)
    if variant == "fix" and _is_stream_capturing() and forward_batch.forward_mode.is_decode_or_idle():
        max_seq_len = int(block_table.shape[1]) * page_size
    else:
        max_seq_len = int(seq_lens.max().item()) if batch_size else 0
    return MiniMaxM3SGLangMetadata(is_decode=True, seq_lens=seq_lens, block_table=block_table,
                                   max_seq_len=max_seq_len)


def _ensure_side_caches(layer, forward_batch, index_key):
    page_size = _get_page_size(forward_batch)
    k_buffer, v_buffer = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
    num_blocks = int(k_buffer.shape[0]) // page_size
    key_cache = k_buffer[: num_blocks * page_size].view(num_blocks, page_size, layer.num_kv_heads, layer.head_dim)
    value_cache = v_buffer[: num_blocks * page_size].view(num_blocks, page_size, layer.num_kv_heads, layer.head_dim)
    index_shape = (num_blocks, page_size, layer.idx_head_dim)
    index_cache = getattr(layer, "_sglang_m3_index_cache", None)
    if (index_cache is None or tuple(index_cache.shape) != index_shape or index_cache.device != index_key.device
            or index_cache.dtype != index_key.dtype):
        index_cache = torch.empty(index_shape, dtype=index_key.dtype, device=index_key.device)
        layer._sglang_m3_index_cache = index_cache
    return key_cache, value_cache, index_cache


def _insert_sparse_cache(layer, forward_batch, key, value, index_key, variant):
    key_cache, value_cache, index_cache = _ensure_side_caches(layer, forward_batch, index_key)
    page_size = _get_page_size(forward_batch)
    slot_mapping = forward_batch.out_cache_loc[: key.shape[0]].to(dtype=torch.long)
    valid = slot_mapping >= 0
    if variant == "fix" and _is_stream_capturing():
        # CUDA graph capture uses fixed-size decode batches; boolean compaction
        # launches a dynamic-shape HIP op that is not graph-capture safe.
        slots = slot_mapping
        key = key.view(-1, layer.num_kv_heads, layer.head_dim)
        value = value.view(-1, layer.num_kv_heads, layer.head_dim)
        index_key = index_key.view(-1, layer.idx_head_dim)
    else:
        slots = slot_mapping[valid]                                          # bug: nonzero inside capture
        key = key.view(-1, layer.num_kv_heads, layer.head_dim)[valid]
        value = value.view(-1, layer.num_kv_heads, layer.head_dim)[valid]
        index_key = index_key.view(-1, layer.idx_head_dim)[valid]
    block_ids = torch.div(slots, page_size, rounding_mode="floor")
    block_offsets = slots % page_size
    key_cache[block_ids, block_offsets] = key.to(key_cache.dtype)
    value_cache[block_ids, block_offsets] = value.to(value_cache.dtype)
    index_cache[block_ids, block_offsets] = index_key.to(index_cache.dtype)
    return key_cache, value_cache, index_cache


# --- atom/model_ops/minimax_m3/index_topk.py (decode), the sparse decode kernel ------------------------

def minimax_m3_index_topk_decode(idx_q, index_kv_cache, block_table, seq_lens, max_seq_len, topk, init_blocks,
                                 local_blocks, num_kv_heads, sm_scale):
    """Block scores (max over a block's valid positions; init and local blocks forced), then top-k block ids
    per (index head, request), padded with -1. Returns [num_kv_heads, batch, topk]."""
    batch = idx_q.shape[0]
    max_block = (max_seq_len + SPARSE_BLOCK_SIZE - 1) // SPARSE_BLOCK_SIZE
    blk = torch.arange(max_block, device=idx_q.device)
    off_k = torch.arange(SPARSE_BLOCK_SIZE, device=idx_q.device)
    seq = seq_lens.long()
    num_blocks = (seq + SPARSE_BLOCK_SIZE - 1) // SPARSE_BLOCK_SIZE                         # [B]
    in_seq = blk[None, :] < num_blocks[:, None]                                             # [B, max_block]
    page = torch.where(in_seq, block_table[:, :max_block].long(), 0)
    k = index_kv_cache[page]                                                                # [B, nb, 128, D]
    qk = torch.einsum("bhd,bnkd->hbnk", idx_q.float(), k.float()) * sm_scale
    pos = blk[:, None] * SPARSE_BLOCK_SIZE + off_k[None, :]                                  # [nb, 128]
    pos_mask = pos[None] < seq[:, None, None]                                               # [B, nb, 128]
    score = torch.where(pos_mask[None], qk, float("-inf")).amax(dim=-1)                     # [H, B, nb]
    local_start = (num_blocks - local_blocks).clamp(min=0)
    is_init = blk[None, :] < init_blocks
    is_local = (blk[None, :] >= local_start[:, None]) & in_seq
    score = torch.where(is_local, 1e29, torch.where(is_init & in_seq, 1e30, score))
    score = torch.where(in_seq[None], score, float("-inf"))
    if max_block < topk:
        score = torch.cat([score, score.new_full((num_kv_heads, batch, topk - max_block), float("-inf"))], -1)
    vals, idx = torch.topk(score, topk, dim=-1)
    return torch.where(vals == float("-inf"), -1, idx).to(torch.int32)


def minimax_m3_sparse_attn_decode_split_kv(q, key_cache, value_cache, topk_idx, block_table, seq_lens,
                                           num_kv_heads, sm_scale, output):
    """Each query head attends to the positions < seq_len of its KV head's top-k blocks."""
    batch, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    tk = topk_idx.long().permute(1, 0, 2)                                                    # [B, Hkv, T]
    ok = tk >= 0
    blk = tk.clamp(min=0)
    page = torch.gather(block_table.long()[:, None, :].expand(-1, num_kv_heads, -1), 2, blk)  # [B, Hkv, T]
    page = torch.where(ok, page, 0)
    pos = blk[..., None] * SPARSE_BLOCK_SIZE + torch.arange(SPARSE_BLOCK_SIZE, device=q.device)
    mask = ok[..., None] & (pos < seq_lens.long()[:, None, None, None])                     # [B, Hkv, T, 128]
    hkv = torch.arange(num_kv_heads, device=q.device)[None, :, None]
    k = key_cache[page, :, hkv]                                                              # [B, Hkv, T, 128, D]
    v = value_cache[page, :, hkv]
    qg = q.view(batch, num_kv_heads, group, head_dim).float()
    s = torch.einsum("bhgd,bhtkd->bhgtk", qg, k.float()) * sm_scale
    s = torch.where(mask[:, :, None], s, float("-inf")).flatten(-2)
    p = torch.softmax(s, dim=-1)
    o = torch.einsum("bhgn,bhnd->bhgd", p, v.float().flatten(2, 3))
    output.copy_(o.reshape(batch, num_heads, head_dim).to(output.dtype))


def minimax_m3_sparse_attention_for_sglang(query, key, value, index_query, index_key, layer, forward_batch,
                                           variant, save_kv_cache=True):
    page_size = _get_page_size(forward_batch)
    if save_kv_cache:
        key_cache, value_cache, index_cache = _insert_sparse_cache(layer, forward_batch, key, value, index_key,
                                                                   variant)
    else:
        key_cache, value_cache, index_cache = _ensure_side_caches(layer, forward_batch, index_key)
    block_table = build_minimax_m3_block_table(forward_batch, page_size, variant)
    metadata = build_minimax_m3_forward_metadata(forward_batch, block_table, page_size, variant)
    q = query.view(-1, layer.num_heads, layer.head_dim)
    index_q = index_query.view(-1, layer.num_idx_heads, layer.idx_head_dim)
    output = torch.empty_like(q)
    batch_size = metadata.seq_lens.shape[0]
    topk_idx = minimax_m3_index_topk_decode(index_q[:batch_size], index_cache, metadata.block_table,
                                            metadata.seq_lens, metadata.max_seq_len, layer.topk_blocks,
                                            layer.init_blocks, layer.local_blocks, layer.num_kv_heads,
                                            layer.scaling)
    minimax_m3_sparse_attn_decode_split_kv(q[:batch_size], key_cache, value_cache, topk_idx, metadata.block_table,
                                           metadata.seq_lens, layer.num_kv_heads, layer.scaling,
                                           output[:batch_size])
    if batch_size < output.shape[0]:
        output[batch_size:].zero_()
    return output.reshape_as(query)


# --- the model: one MiniMax-M3 attention layer -----------------------------------------------------------

class MiniMaxM3Attention:
    def __init__(self, device, gen):
        self.layer_id = 0
        self.num_heads, self.num_kv_heads, self.head_dim = NUM_HEADS, NUM_KV_HEADS, HEAD_DIM
        self.num_idx_heads, self.idx_head_dim = NUM_IDX_HEADS, IDX_HEAD_DIM
        self.topk_blocks, self.init_blocks, self.local_blocks = TOPK_BLOCKS, INIT_BLOCKS, LOCAL_BLOCKS
        self.scaling = HEAD_DIM ** -0.5
        self.wq = randn(HIDDEN, NUM_HEADS * HEAD_DIM, gen=gen, device=device, scale=0.5)
        self.wk = randn(HIDDEN, NUM_KV_HEADS * HEAD_DIM, gen=gen, device=device, scale=0.5)
        self.wv = randn(HIDDEN, NUM_KV_HEADS * HEAD_DIM, gen=gen, device=device, scale=0.5)
        self.wiq = randn(HIDDEN, NUM_IDX_HEADS * IDX_HEAD_DIM, gen=gen, device=device, scale=0.5)
        self.wik = randn(HIDDEN, IDX_HEAD_DIM, gen=gen, device=device, scale=0.5)
        self._sglang_m3_index_cache = None

    def forward(self, h, forward_batch, variant):
        return minimax_m3_sparse_attention_for_sglang(h @ self.wq, h @ self.wk, h @ self.wv, h @ self.wiq,
                                                      h @ self.wik, self, forward_batch, variant)


class MiniMaxM3ForCausalLM:
    def __init__(self, device):
        gen = generator(1480)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.attn = MiniMaxM3Attention(device, gen)
        self.lm_head = randn(NUM_HEADS * HEAD_DIM, VOCAB, gen=gen, device=device, scale=0.5)

    def forward(self, input_ids, forward_batch, variant):
        return self.attn.forward(self.embed[input_ids], forward_batch, variant) @ self.lm_head


# --- sglang: CudaGraphRunner, ModelRunner ---------------------------------------------------------------

class CudaGraphRunner:
    def __init__(self, model_runner):
        self.model_runner, device = model_runner, model_runner.device
        max_bs = max(CAPTURE_BS)
        self.input_ids = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.req_pool_indices = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.seq_lens = torch.full((max_bs,), SEQ_LEN_FILL_VALUE, dtype=torch.long, device=device)
        self.out_cache_loc = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.graph_memory_pool = graph_pool_handle(device)
        self.graphs, self.output_buffers = {}, {}
        for bs in reversed(CAPTURE_BS):
            self.graphs[bs], self.output_buffers[bs] = self.capture_one_batch_size(bs)

    def capture_one_batch_size(self, bs):
        mr = self.model_runner
        forward_batch = ForwardBatch(ForwardMode(ForwardMode.DECODE), bs, self.input_ids[:bs],
                                     self.req_pool_indices[:bs], self.seq_lens[:bs], self.out_cache_loc[:bs],
                                     mr.req_to_token_pool, mr.token_to_kv_pool)

        def run_once():
            return mr.model.forward(forward_batch.input_ids, forward_batch, mr.variant)

        static = {"input_ids": self.input_ids, "req_pool_indices": self.req_pool_indices,
                  "seq_lens": self.seq_lens, "out_cache_loc": self.out_cache_loc}
        state = {"k_buffer": mr.token_to_kv_pool.k_buffer[0], "v_buffer": mr.token_to_kv_pool.v_buffer[0],
                 "index_cache": mr.model.attn._sglang_m3_index_cache,
                 "req_to_token": mr.req_to_token_pool.req_to_token}
        return capture(run_once, device=mr.device, pool=self.graph_memory_pool, warmups=2, name=f"decode bs={bs}",
                       static=static, state=state, owner="CudaGraphRunner")

    def replay(self, forward_batch):
        raw_bs = forward_batch.batch_size
        bs = next(b for b in CAPTURE_BS if b >= raw_bs)
        if bs != raw_bs:
            self.seq_lens.fill_(SEQ_LEN_FILL_VALUE)
            self.out_cache_loc.zero_()
        self.input_ids[:raw_bs].copy_(forward_batch.input_ids)
        self.req_pool_indices[:raw_bs].copy_(forward_batch.req_pool_indices)
        self.seq_lens[:raw_bs].copy_(forward_batch.seq_lens)
        self.out_cache_loc[:raw_bs].copy_(forward_batch.out_cache_loc)
        left = {"input_ids": self.input_ids, "req_pool_indices": self.req_pool_indices}
        logits = replay(self.graphs[bs], self.output_buffers[bs], real=raw_bs, size=bs, padded=left)
        return logits[:raw_bs].clone()


class ModelRunner:
    def __init__(self, device, variant, k0, v0, idx0, disable_cuda_graph):
        self.device, self.variant = device, variant
        self.model = MiniMaxM3ForCausalLM(device)
        self.model.attn._sglang_m3_index_cache = idx0.clone()          # the prompts' index keys (prefill)
        self.req_to_token_pool = ReqToTokenPool(device)
        self.token_to_kv_pool = MHATokenToKVPool(k0, v0)
        for req, pages, _ in REQS.values():
            slots = (torch.tensor(pages)[:, None] * PAGE_SIZE + torch.arange(PAGE_SIZE)[None, :]).flatten()
            self.req_to_token_pool.req_to_token[req, : slots.numel()] = slots.to(torch.int32).to(device)
        self.cuda_graph_runner = None if disable_cuda_graph else CudaGraphRunner(self)

    def forward_decode(self, forward_batch):
        if self.cuda_graph_runner is not None:
            return self.cuda_graph_runner.replay(forward_batch)
        return self.model.forward(forward_batch.input_ids, forward_batch, self.variant)


def run(variant: str, device: str = "cpu"):
    gen = generator(14800)
    slots = NUM_PAGES * PAGE_SIZE
    k0 = randn(slots, NUM_KV_HEADS, HEAD_DIM, gen=gen, device=device)
    v0 = randn(slots, NUM_KV_HEADS, HEAD_DIM, gen=gen, device=device)
    idx0 = randn(NUM_PAGES, PAGE_SIZE, IDX_HEAD_DIM, gen=gen, device=device)
    tokens = torch.randint(0, VOCAB, (len(STEPS), len(REQS)), generator=gen)

    def serve(graphed: bool):
        mr = ModelRunner(device, variant, k0, v0, idx0, disable_cuda_graph=not graphed)
        seq_len = {name: prompt for name, (_, _, prompt) in REQS.items()}
        outs = []
        for step, names in enumerate(STEPS):
            for n in names:
                seq_len[n] += 1                                        # the decoded token's slot
            req_idx = [REQS[n][0] for n in names]
            loc = [int(mr.req_to_token_pool.req_to_token[REQS[n][0], seq_len[n] - 1]) for n in names]
            fb = ForwardBatch(ForwardMode(ForwardMode.DECODE), len(names), tokens[step, : len(names)].to(device),
                              torch.tensor(req_idx, dtype=torch.long).to(device),
                              torch.tensor([seq_len[n] for n in names], dtype=torch.long).to(device),
                              torch.tensor(loc, dtype=torch.long).to(device),
                              mr.req_to_token_pool, mr.token_to_kv_pool)
            outs.append(mr.forward_decode(fb))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
