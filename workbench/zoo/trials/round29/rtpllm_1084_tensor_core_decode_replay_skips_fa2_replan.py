"""Tensor-core FlashInfer decode graphs replay the fa2 plan made for the capture batch.

Upstream: https://github.com/alibaba/rtp-llm/pull/1084 ("fix: fix flashinfer decode cudagraph").
Symptom: with CUDA graphs on, FlashInfer decode on the tensor-core path (GQA ratio >= 4) could hang the
service: "the tensor-core decode path reuses the cached fa2 plan metadata; before replay only the page
table buffers were updated, the plan metadata was not refreshed, so replay may use stale plan info"
(PR description, June 2026).
Mechanism: ``PyFlashinferDecodeAttnOp.prepare`` runs ``fmha_params.fill_params`` and then
``BatchDecodeWithPagedKVCacheWrapper.plan``; with ``use_tensor_cores`` the wrapper routes decode through
fa2 BatchPrefill, whose ``plan`` computes on the host, from the page table, the KV chunk size and the
(request, kv tile) work list and copies them into the int workspace the captured kernel reads.
``prepare`` runs once, for the capture batch. Before each replay the graph runner calls
``prepare_cuda_graph`` -> ``prepare_for_cuda_graph_replay``, which refreshes the page-table buffers
(``decode_page_indptr_d``, ``page_indice_d``, ``paged_kv_last_page_len_d``) but, by design ("we must NOT
call plan()"), not the plan. The replayed kernel thus splits each request's KV into the tiles planned for
the capture batch (one KV token each): once a sequence outgrows the capture-time tiles, its later tokens
are never attended (upstream, a tile layout the kernel does not expect; here, wrong attention output).
Doctor: warmup-divergence, at ``plan`` (the work plan made for the capture batch, which every replay
reuses while an eager step re-plans for its own lengths).
Fix (upstream): ``prepare_for_cuda_graph_replay`` calls ``_plan_decode_wrapper`` again when
``_requires_fa2_cuda_graph_replan()`` (the tensor-core path), planning from the host page-table mirrors
with ``non_blocking=True``; the CUDA-core decode path keeps replaying without a replan.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/alibaba/rtp-llm/pull/1084"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "plan"
SYMPTOM = "tensor-core decode graph attends only over the KV tiles planned for the capture batch"

VOCAB, HEAD_NUM, KV_HEAD_NUM, HEAD_DIM = 16, 4, 1, 4   # GQA 4: tensor-core decode
PAGE = 2                                   # seq_size_per_block
MAX_BS, MAX_PAGES, NUM_PAGES = 2, 3, 6
MAX_KV = MAX_PAGES * PAGE
PADDED_TILES = 4                           # cuda-graph mode: the plan's work list is padded to this
WS = 3 * PADDED_TILES + 1                  # request_indices | kv_tile_indices | block_valid_mask | chunk


def determine_use_tensor_core_from_configs(head_num: int, kv_head_num: int) -> bool:
    return head_num // kv_head_num >= 4


class FlashInferMlaAttnParams:
    """The page-table buffers (device, fixed size) and their host mirrors."""

    def __init__(self, device):
        self.decode_page_indptr_d = torch.zeros(MAX_BS + 1, dtype=torch.int32, device=device)
        self.page_indice_d = torch.zeros(MAX_BS * MAX_PAGES, dtype=torch.int32, device=device)
        self.paged_kv_last_page_len_d = torch.zeros(MAX_BS, dtype=torch.int32, device=device)
        self.decode_page_indptr_h = self.page_indice_h = self.paged_kv_last_page_len_h = None

    def fill_params(self, sequence_lengths, block_ids, seq_size_per_block):
        """``sequence_lengths``: KV length of each request including this step's token."""
        indptr, indices, last = [0], [], []
        for kv_len, blocks in zip(sequence_lengths, block_ids):
            n_pages = (kv_len + seq_size_per_block - 1) // seq_size_per_block
            indices += blocks[:n_pages]
            indptr.append(indptr[-1] + n_pages)
            last.append(kv_len - (n_pages - 1) * seq_size_per_block)
        self.decode_page_indptr_h = torch.tensor(indptr, dtype=torch.int32)
        self.page_indice_h = torch.tensor(indices, dtype=torch.int32)
        self.paged_kv_last_page_len_h = torch.tensor(last, dtype=torch.int32)
        # forbid_realloc: the buffers the graph reads are refreshed in place.
        self.decode_page_indptr_d.copy_(self.decode_page_indptr_h)
        self.page_indice_d[: len(indices)].copy_(self.page_indice_h)
        self.paged_kv_last_page_len_d.copy_(self.paged_kv_last_page_len_h)


class BatchDecodeWithPagedKVCacheWrapper:
    """Tensor-core decode: an fa2 BatchPrefill plan (host) + a split-KV kernel with an LSE merge."""

    def __init__(self, device):
        self._int_workspace_buffer = torch.zeros(WS, dtype=torch.int32, device=device)
        self._paged_kv_indptr_buf = self._paged_kv_indices_buf = self._paged_kv_last_page_len_buf = None
        self.device = device

    def plan(self, indptr_h, indices_h, last_page_len_h, page_size):
        """Host work partition: the smallest page-aligned KV chunk whose tiles fit the padded grid."""
        n_pages = (indptr_h[1:] - indptr_h[:-1]).tolist()
        kv_lens = [(p - 1) * page_size + int(last) for p, last in zip(n_pages, last_page_len_h.tolist())]
        chunk = page_size
        while sum(-(-kv // chunk) for kv in kv_lens) > PADDED_TILES:
            chunk += page_size
        req, tile = [], []
        for r, kv in enumerate(kv_lens):
            for t in range(-(-kv // chunk)):
                req.append(r)
                tile.append(t)
        pad = PADDED_TILES - len(req)
        plan_info = req + [0] * pad + tile + [0] * pad + [1] * len(req) + [0] * pad + [chunk]
        self._int_workspace_buffer.copy_(torch.tensor(plan_info, dtype=torch.int32))

    def run(self, q, paged_kv_cache):
        """q: [bs, heads, dim]; paged_kv_cache: [2, pages * page, kv_heads, dim]. Page tables are read live;
        the (request, tile) work list and the chunk size come from the planned workspace."""
        ws = self._int_workspace_buffer.long()
        req, tile = ws[:PADDED_TILES], ws[PADDED_TILES:2 * PADDED_TILES]
        valid = ws[2 * PADDED_TILES:3 * PADDED_TILES].bool()
        chunk = ws[3 * PADDED_TILES]
        indptr = self._paged_kv_indptr_buf.long()
        indices = self._paged_kv_indices_buf.long()
        last = self._paged_kv_last_page_len_buf.long()
        kv_len = (indptr[1:] - indptr[:-1] - 1) * PAGE + last                      # live, per request
        offs = torch.arange(MAX_KV, device=q.device)
        pos = tile[:, None] * chunk + offs[None, :]                                # [tiles, MAX_KV]
        mask = valid[:, None] & (offs[None, :] < chunk) & (pos < kv_len[req][:, None])
        pos = pos.clamp(max=MAX_KV - 1)
        page_slot = (indptr[req][:, None] + pos // PAGE).clamp(max=indices.numel() - 1)
        slots = indices[page_slot] * PAGE + pos % PAGE
        k = paged_kv_cache[0][slots].repeat_interleave(HEAD_NUM // KV_HEAD_NUM, dim=2)  # [T, L, H, D]
        v = paged_kv_cache[1][slots].repeat_interleave(HEAD_NUM // KV_HEAD_NUM, dim=2)
        scores = torch.einsum("thd,tlhd->thl", q[req], k) / HEAD_DIM ** 0.5
        scores = scores.masked_fill(~mask[:, None, :], -1e30)
        m = scores.amax(-1, keepdim=True)
        p = torch.exp(scores - m) * mask[:, None, :]
        s = p.sum(-1, keepdim=True)
        o_tile = torch.einsum("thl,tlhd->thd", p, v) / s.clamp(min=1e-30)
        lse = torch.where(s > 0, m + torch.log(s.clamp(min=1e-30)), torch.full_like(s, -1e30)).squeeze(-1)
        onehot = (req[:, None] == torch.arange(q.shape[0], device=q.device)[None, :]) & valid[:, None]
        lse_b = torch.where(onehot[:, :, None], lse[:, None, :], torch.full_like(lse[:, None, :], -1e30))
        w = torch.exp(lse_b - lse_b.amax(0, keepdim=True)) * onehot[:, :, None]   # [T, bs, H]
        return torch.einsum("tbh,thd->bhd", w, o_tile) / w.sum(0)[:, :, None].clamp(min=1e-30)


class PyFlashinferDecodeAttnOp:
    def __init__(self, device, variant):
        self.variant = variant
        self.use_tensor_core = determine_use_tensor_core_from_configs(HEAD_NUM, KV_HEAD_NUM)
        self.decode_wrapper = BatchDecodeWithPagedKVCacheWrapper(device)
        self.fmha_params = FlashInferMlaAttnParams(device)
        self.seq_size_per_block = PAGE

    def _requires_fa2_cuda_graph_replan(self) -> bool:
        return self.use_tensor_core

    def _plan_decode_wrapper(self):
        p = self.fmha_params
        self.decode_wrapper.plan(p.decode_page_indptr_h, p.page_indice_h, p.paged_kv_last_page_len_h,
                                 self.seq_size_per_block)

    def prepare(self, attn_inputs):
        self.fmha_params.fill_params(attn_inputs["sequence_lengths"], attn_inputs["block_ids"],
                                     self.seq_size_per_block)
        w = self.decode_wrapper
        w._paged_kv_indptr_buf = self.fmha_params.decode_page_indptr_d
        w._paged_kv_last_page_len_buf = self.fmha_params.paged_kv_last_page_len_d
        w._paged_kv_indices_buf = self.fmha_params.page_indice_d
        self._plan_decode_wrapper()
        return self.fmha_params

    def prepare_for_cuda_graph_replay(self, attn_inputs):
        self.fmha_params.fill_params(attn_inputs["sequence_lengths"], attn_inputs["block_ids"],
                                     self.seq_size_per_block)
        if self.variant == "fix" and self._requires_fa2_cuda_graph_replan():
            self._plan_decode_wrapper()

    def forward(self, q, paged_kv_cache):
        return self.decode_wrapper.run(q.reshape(q.shape[0], HEAD_NUM, HEAD_DIM), paged_kv_cache)


class Model:
    def __init__(self, device):
        gen = generator(1084)
        self.emb = randn(VOCAB, 8, gen=gen, device=device)
        self.wq = randn(8, HEAD_NUM * HEAD_DIM, gen=gen, device=device, scale=0.6)
        self.wk = randn(8, KV_HEAD_NUM * HEAD_DIM, gen=gen, device=device, scale=0.6)
        self.wv = randn(8, KV_HEAD_NUM * HEAD_DIM, gen=gen, device=device)
        self.wo = randn(HEAD_NUM * HEAD_DIM, 8, gen=gen, device=device, scale=0.5)


class PyFlashinferDecodeImpl:
    """One decode layer: KV write at ``kv_cache_offset`` (the rope/KV-write op's params), then attention."""

    def __init__(self, model, device, variant, attn_inputs):
        self.model = model
        self.fmha_impl = PyFlashinferDecodeAttnOp(device, variant)
        self.kv_cache = torch.zeros(2, NUM_PAGES * PAGE, KV_HEAD_NUM, HEAD_DIM, device=device)
        self.kv_cache_offset = torch.zeros(MAX_BS, dtype=torch.long, device=device)
        self.fmha_impl.prepare(attn_inputs)
        self._rope_prepare(attn_inputs)

    def _rope_prepare(self, attn_inputs):
        offs = [blocks[(n - 1) // PAGE] * PAGE + (n - 1) % PAGE
                for n, blocks in zip(attn_inputs["sequence_lengths"], attn_inputs["block_ids"])]
        self.kv_cache_offset.copy_(torch.tensor(offs, dtype=torch.long))

    def prepare(self, attn_inputs):                     # the eager path: fill + plan every step
        self.fmha_impl.prepare(attn_inputs)
        self._rope_prepare(attn_inputs)

    def prepare_cuda_graph(self, attn_inputs):
        self.fmha_impl.prepare_for_cuda_graph_replay(attn_inputs)
        self._rope_prepare(attn_inputs)

    def forward(self, input_ids):
        m = self.model
        h = m.emb[input_ids]
        self.kv_cache[0, self.kv_cache_offset] = (h @ m.wk).view(-1, KV_HEAD_NUM, HEAD_DIM)
        self.kv_cache[1, self.kv_cache_offset] = (h @ m.wv).view(-1, KV_HEAD_NUM, HEAD_DIM)
        o = self.fmha_impl.forward(h @ m.wq, self.kv_cache)
        return o.reshape(o.shape[0], -1) @ m.wo


BLOCKS = [[0, 1, 2], [3, 4, 5]]


def _inputs(kv_len):
    return {"sequence_lengths": [kv_len, kv_len], "block_ids": BLOCKS}


class CudaGraphRunner:
    def __init__(self, model, device, variant):
        self.input_ids = torch.zeros(MAX_BS, dtype=torch.long, device=device)
        self.impl = PyFlashinferDecodeImpl(model, device, variant, _inputs(1))   # the capture batch
        p, w = self.impl.fmha_impl.fmha_params, self.impl.fmha_impl.decode_wrapper
        self.graph, self.out = capture(
            lambda: self.impl.forward(self.input_ids), device=device, owner="CudaGraphRunner (decode)",
            static={"input_ids": self.input_ids, "kv_cache_offset": self.impl.kv_cache_offset,
                    "decode_page_indptr_d": p.decode_page_indptr_d, "page_indice_d": p.page_indice_d,
                    "paged_kv_last_page_len_d": p.paged_kv_last_page_len_d,
                    "int_workspace": w._int_workspace_buffer},
            state={"kv_cache": self.impl.kv_cache})

    def forward(self, token_ids, attn_inputs):
        self.input_ids.copy_(token_ids)
        self.impl.prepare_cuda_graph(attn_inputs)
        return replay(self.graph, self.out).clone()


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    tokens = [[3, 9], [5, 1], [12, 7], [2, 14], [8, 4], [11, 6]]   # one decode token per request per step

    def served():
        runner = CudaGraphRunner(model, device, variant)
        return [runner.forward(torch.tensor(t, device=device), _inputs(i + 1)) for i, t in enumerate(tokens)]

    def eager():
        impl = PyFlashinferDecodeImpl(model, device, variant, _inputs(1))
        outs = []
        for i, t in enumerate(tokens):
            impl.prepare(_inputs(i + 1))
            outs.append(impl.forward(torch.tensor(t, device=device)).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
