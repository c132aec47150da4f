"""Cutlass MLA decode graphs are captured with a one-page-wide page table: replays read other requests' pages.

Upstream: https://github.com/sgl-project/sglang/pull/6998 ("Fix cutlass MLA gets almost zero accuracy", fzyzcjy,
merged; opened 2025-06-09).
Symptom: DeepSeek-V3-0324, TP8 + DP attention, ``--attention-backend cutlass_mla --cuda-graph-bs 64 128``: GSM8K
0.060 with CUDA graphs, 0.917 with ``--disable-cuda-graph``; 0.906-0.917 with graphs after the PR ("Fix issues in
cuda graph"). No error is raised.
Mechanism: ``python/sglang/srt/layers/attention/cutlass_mla_backend.py``. ``CudaGraphRunner.capture_one_batch_size``
calls ``init_forward_metadata_capture_cuda_graph(bs, ..., seq_lens=self.seq_lens[:bs], ...)`` before it warms up and
captures; at that point ``seq_lens`` holds the runner's fill value (``get_cuda_graph_seq_len_fill_value()`` = 1).
Before the fix the capture computed ``max_seqlen_pad = triton.cdiv(seq_lens.max().item(), PAGE_SIZE)`` from these
dummy lengths (one page) and bound ``CutlassMLADecodeMetadata(workspace, self.cuda_graph_kv_indices[:bs,
:max_seqlen_pad])``: a one-column view of the ``(max_bs, (max_context_len + PAGE_SIZE) // PAGE_SIZE)`` buffer. The
captured ``cutlass_mla_decode`` (sgl-kernel ``args_from_options``) takes ``page_count_per_seq = page_table.size(1)``
and ``stride_PT = make_stride(_1{}, page_count_per_seq)``: it reads request b's page p at ``page_table.data_ptr() +
b * page_count_per_seq + p`` and walks as many pages as ``seq_lens[b]`` needs. With the one-column view that is row
0 of the buffer, columns b + p: every request but the first attends to request 0's pages (or to stale/initial
entries). ``init_forward_metadata_replay_cuda_graph`` refilled ``cuda_graph_kv_indices`` in place (right) and then
recomputed ``max_seqlen_pad`` from ``seq_lens_cpu`` and rebound ``self.forward_metadata.block_kv_indices`` (and a
freshly allocated workspace): Python attribute assignments that a replay never sees, so the graph keeps the
capture-time view and its width. Eager (``init_forward_metadata``) builds a contiguous ``(bs, max_seqlen_pad)``
table for each step from the step's own lengths, so it is right.
Doctor: warmup-divergence, at init_forward_metadata_capture_cuda_graph (capture decided the page table the decode
kernel reads -- a view as wide as the capture-time dummy lengths need, whose width becomes the kernel's row stride --
and every replay reuses it, while an eager step decides the table's width from the step's sequence lengths; the
fix changed the capture to bind the full-width buffer).
Fix (upstream): ``init_forward_metadata_capture_cuda_graph`` binds ``max_seqlen_pad =
self.cuda_graph_kv_indices.shape[1]`` (the full width, so the view's rows are contiguous at stride size(1)) and the
workspace that ``init_cuda_graph_state`` sized for ``max_bs`` and the full width; ``init_forward_metadata_replay_
cuda_graph`` only refills ``cuda_graph_kv_indices`` in place (no recomputed width, no new workspace, no rebinding).
Modelled: PAGE_SIZE is 4 (cutlass MLA needs 128), max_context_len 16, 2 heads, kv_lora_rank 8, rope dim 4. The
decode kernel is plain torch: its device-side loop over a request's pages (bounded by ``seq_lens[b]``) runs over a
fixed number of page slots with a mask; it reads the page table through the raw memory of its argument with row
stride ``page_table.size(1)``, as the cutlass kernel does. It computes in one split (split_kv = 1), so it reads no
workspace: the workspace is allocated as upstream but is inert here. ``create_flashmla_kv_indices_triton`` is
torch ops writing the same entries. The model is one MLA attention layer: per step each request brings a query
(nope + rope) and its new token's compressed KV, which ``forward_decode`` stores before attending. Batches are
served at captured sizes (no padded rows); DP attention, TP, prefill and the FlashInfer parent are left out.
Sources: the PR diff itself was not available; the pre-fix capture/replay code is a stored earlier version of
cutlass_mla_backend.py (capture ``max_seqlen_pad`` from ``seq_lens``, replay re-allocating the workspace and
rebinding ``forward_metadata``), the post-fix code a fork snapshot between #6998 and #7184 (full-width capture, fill-
only replay, no ``num_kv_splits`` yet); the page-table addressing (``stride_PT``) is from sgl-kernel's
``cutlass_mla_kernel.cu``.
"""
from __future__ import annotations

from typing import Optional

import torch

from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/6998"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "init_forward_metadata_capture_cuda_graph"
SYMPTOM = ("cutlass_mla decode graphs keep the one-page-wide page table bound at capture (from the dummy "
           "seq_lens): requests read request 0's pages, GSM8K ~0 with graphs only")

PAGE_SIZE = 4                      # upstream: 128 (cutlass MLA only supports page size 128)
MAX_CONTEXT_LEN = 16
NUM_HEADS, KV_LORA_RANK, QK_ROPE_HEAD_DIM = 2, 8, 4
KV_CACHE_DIM = KV_LORA_RANK + QK_ROPE_HEAD_DIM
MAX_PAGES = (MAX_CONTEXT_LEN + PAGE_SIZE) // PAGE_SIZE      # page slots the emulated kernel walks
NUM_REQ_SLOTS = 5                  # req_to_token rows; slot 0 is the padding request (all tokens -> page 0)
PAGES_PER_REQ = MAX_CONTEXT_LEN // PAGE_SIZE
NUM_PAGES = 1 + (NUM_REQ_SLOTS - 1) * PAGES_PER_REQ        # page 0: the reserved padding page
CAPTURE_BS = (4, 2)                # captured largest first
PROMPT_LENS = {1: 5, 2: 9, 3: 3, 4: 7}                    # request slot -> tokens already in the KV cache
WORKLOAD = ([1, 2, 3, 4], [2, 4], [1, 2, 3, 4], [3, 2], [4, 1, 2, 3])   # request slots served per decode step
SM_SCALE = KV_CACHE_DIM ** -0.5


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --- sgl_kernel ----------------------------------------------------------------------------------------------

def cutlass_mla_get_workspace_size(max_seq_len: int, num_batches: int) -> int:
    """Bytes of split-KV partials (output accumulators + LSE) for the split count chosen for this shape."""
    split_kv = max(1, min(4, cdiv(max_seq_len, 2 * PAGE_SIZE)))
    return num_batches * NUM_HEADS * split_kv * (KV_LORA_RANK + 1) * 4 if split_kv > 1 else 0


def cutlass_mla_decode(q_nope, q_pe, kv_c_and_k_pe_cache, seq_lens, page_table, workspace, sm_scale):
    """``args_from_options``: ``page_count_per_seq = page_table.size(1)``, ``stride_PT = (1, page_count_per_seq)``;
    request b's page p is read at ``page_table.data_ptr() + b * page_count_per_seq + p`` for every page that
    ``seq_lens[b]`` needs (here: one split, so the workspace holds no partials)."""
    bs, device = q_nope.shape[0], q_nope.device
    page_count_per_seq = page_table.size(1)
    avail = page_table.untyped_storage().nbytes() // page_table.element_size() - page_table.storage_offset()
    raw = page_table.as_strided((avail,), (1,))                            # the kernel's view: a pointer
    j = torch.arange(MAX_PAGES, device=device)
    b = torch.arange(bs, device=device)
    num_pages = (seq_lens + PAGE_SIZE - 1) // PAGE_SIZE
    walked = j[None, :] < num_pages[:, None]                               # the kernel's loop bound
    idx = torch.where(walked, b[:, None] * page_count_per_seq + j[None, :], torch.zeros_like(j)[None, :])
    pages = torch.where(walked, raw[idx].long(), torch.zeros_like(idx))
    kv = kv_c_and_k_pe_cache[pages].reshape(bs, MAX_PAGES * PAGE_SIZE, KV_CACHE_DIM)
    c, k_pe = kv[..., :KV_LORA_RANK], kv[..., KV_LORA_RANK:]
    t = torch.arange(MAX_PAGES * PAGE_SIZE, device=device)
    scores = (torch.einsum("bhd,btd->bht", q_nope, c) + torch.einsum("bhd,btd->bht", q_pe, k_pe)) * sm_scale
    scores = scores.masked_fill(~(t[None, :] < seq_lens[:, None])[:, None, :], float("-inf"))
    return torch.einsum("bht,btd->bhd", torch.softmax(scores, dim=-1), c)


# --- sglang/srt/layers/attention/utils.py ---------------------------------------------------------------------

def create_flashmla_kv_indices_triton(req_to_token, req_pool_indices, page_kernel_lens, kv_indices,
                                      kv_indices_stride: int):
    """One program per request row i: ``kv_indices[i * stride + j] = req_to_token[req, j * PAGE_SIZE] // PAGE_SIZE``
    for the pages ``page_kernel_lens[i]`` needs; the other entries keep what they hold."""
    bs = req_pool_indices.shape[0]
    rows = kv_indices.view(-1)[: bs * kv_indices_stride].view(bs, kv_indices_stride)
    ncols = min(kv_indices_stride, cdiv(req_to_token.shape[1], PAGE_SIZE))
    pages = (req_to_token[req_pool_indices][:, ::PAGE_SIZE][:, :ncols] // PAGE_SIZE).to(kv_indices.dtype)
    num_pages = (page_kernel_lens + PAGE_SIZE - 1) // PAGE_SIZE
    written = torch.arange(ncols, device=kv_indices.device)[None, :] < num_pages[:, None]
    rows[:, :ncols].copy_(torch.where(written, pages, rows[:, :ncols]))


# --- sglang/srt/model_executor/forward_batch_info.py ----------------------------------------------------------

class ForwardBatch:
    def __init__(self, batch_size: int, req_pool_indices, seq_lens, seq_lens_cpu, out_cache_loc):
        self.batch_size = batch_size
        self.req_pool_indices = req_pool_indices
        self.seq_lens = seq_lens
        self.seq_lens_cpu = seq_lens_cpu
        self.out_cache_loc = out_cache_loc


# --- sglang/srt/layers/attention/cutlass_mla_backend.py -------------------------------------------------------

class CutlassMLADecodeMetadata:
    def __init__(self, workspace: Optional[torch.Tensor] = None, block_kv_indices: Optional[torch.Tensor] = None):
        self.workspace = workspace
        self.block_kv_indices = block_kv_indices


class CutlassMLABackend:
    """Decode path of the Cutlass MLA backend (prefill is FlashInfer's: not modelled)."""

    def __init__(self, req_to_token, kv_buffer, device, variant):
        self.req_to_token = req_to_token
        self.kv_buffer = kv_buffer                        # token_to_kv_pool's MLA buffer: [tokens, KV_CACHE_DIM]
        self.max_context_len = MAX_CONTEXT_LEN
        self.device = device
        self.variant = variant
        self.forward_metadata: Optional[CutlassMLADecodeMetadata] = None

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        bs = forward_batch.batch_size
        max_seqlen_pad = cdiv(int(forward_batch.seq_lens_cpu.max().item()), PAGE_SIZE)
        block_kv_indices = torch.full((bs, max_seqlen_pad), -1, dtype=torch.int32, device=self.device)
        create_flashmla_kv_indices_triton(self.req_to_token, forward_batch.req_pool_indices,
                                          forward_batch.seq_lens, block_kv_indices, max_seqlen_pad)
        workspace = torch.empty(cutlass_mla_get_workspace_size(max_seqlen_pad * PAGE_SIZE, bs),
                                device=self.device, dtype=torch.uint8)
        self.forward_metadata = CutlassMLADecodeMetadata(workspace, block_kv_indices)

    def init_cuda_graph_state(self, max_bs: int):
        self.cuda_graph_kv_indices = torch.full((max_bs, (self.max_context_len + PAGE_SIZE) // PAGE_SIZE), 1,
                                                dtype=torch.int32, device=self.device)
        self.cuda_graph_mla_workspace = torch.empty(
            cutlass_mla_get_workspace_size(self.cuda_graph_kv_indices.shape[1] * PAGE_SIZE, max_bs),
            device=self.device, dtype=torch.uint8)

    def init_forward_metadata_capture_cuda_graph(self, bs: int, req_pool_indices, seq_lens):
        if self.variant == "bug":
            # the width of the capture-time dummy lengths (fill value 1: one page)
            max_seqlen_pad = cdiv(int(seq_lens.max().item()), PAGE_SIZE)
        else:                                                                   # PR #6998
            max_seqlen_pad = self.cuda_graph_kv_indices.shape[1]
        create_flashmla_kv_indices_triton(self.req_to_token, req_pool_indices, seq_lens,
                                          self.cuda_graph_kv_indices, self.cuda_graph_kv_indices.stride(0))
        if self.variant == "bug":
            self.cuda_graph_mla_workspace = torch.empty(
                cutlass_mla_get_workspace_size(max_seqlen_pad * PAGE_SIZE, bs), device=self.device,
                dtype=torch.uint8)
        self.forward_metadata = CutlassMLADecodeMetadata(self.cuda_graph_mla_workspace,
                                                         self.cuda_graph_kv_indices[:bs, :max_seqlen_pad])

    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices, seq_lens, seq_lens_cpu):
        seq_lens = seq_lens[:bs]
        create_flashmla_kv_indices_triton(self.req_to_token, req_pool_indices[:bs], seq_lens,
                                          self.cuda_graph_kv_indices, self.cuda_graph_kv_indices.stride(0))
        if self.variant == "bug":
            max_seqlen_pad = cdiv(int(seq_lens_cpu[:bs].max().item()), PAGE_SIZE)
            self.cuda_graph_mla_workspace = torch.empty(
                cutlass_mla_get_workspace_size(max_seqlen_pad * PAGE_SIZE, bs), device=self.device,
                dtype=torch.uint8)
            self.forward_metadata.workspace = self.cuda_graph_mla_workspace
            self.forward_metadata.block_kv_indices = self.cuda_graph_kv_indices[:bs, :max_seqlen_pad]

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    def forward_decode(self, q_nope, q_pe, k, forward_batch: ForwardBatch):
        self.kv_buffer.index_copy_(0, forward_batch.out_cache_loc, k)        # set_mla_kv_buffer
        return cutlass_mla_decode(
            q_nope=q_nope, q_pe=q_pe,
            kv_c_and_k_pe_cache=self.kv_buffer.view(-1, PAGE_SIZE, KV_CACHE_DIM),
            seq_lens=forward_batch.seq_lens.to(torch.int32),
            page_table=self.forward_metadata.block_kv_indices,
            workspace=self.forward_metadata.workspace,
            sm_scale=SM_SCALE)


# --- sglang/srt/model_executor/cuda_graph_runner.py -----------------------------------------------------------

class CudaGraphRunner:
    def __init__(self, attn_backend: CutlassMLABackend, device):
        self.attn_backend = attn_backend
        self.device = device
        max_bs = max(CAPTURE_BS)
        self.seq_len_fill_value = attn_backend.get_cuda_graph_seq_len_fill_value()
        self.req_pool_indices = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.seq_lens = torch.full((max_bs,), self.seq_len_fill_value, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.q_nope = torch.zeros(max_bs, NUM_HEADS, KV_LORA_RANK, device=device)
        self.q_pe = torch.zeros(max_bs, NUM_HEADS, QK_ROPE_HEAD_DIM, device=device)
        self.k = torch.zeros(max_bs, KV_CACHE_DIM, device=device)
        attn_backend.init_cuda_graph_state(max_bs)
        self.graphs, self.output_buffers = {}, {}
        for bs in CAPTURE_BS:
            self.graphs[bs], self.output_buffers[bs] = self.capture_one_batch_size(bs)

    def capture_one_batch_size(self, bs: int):
        self.attn_backend.init_forward_metadata_capture_cuda_graph(bs, self.req_pool_indices[:bs],
                                                                   self.seq_lens[:bs])
        forward_batch = ForwardBatch(bs, self.req_pool_indices[:bs], self.seq_lens[:bs], None,
                                     self.out_cache_loc[:bs])

        def run_once():
            return self.attn_backend.forward_decode(self.q_nope[:bs], self.q_pe[:bs], self.k[:bs], forward_batch)

        static = {"req_pool_indices": self.req_pool_indices, "seq_lens": self.seq_lens,
                  "out_cache_loc": self.out_cache_loc, "q_nope": self.q_nope, "q_pe": self.q_pe, "k": self.k,
                  "cuda_graph_kv_indices": self.attn_backend.cuda_graph_kv_indices}
        return capture(run_once, device=self.device, warmups=2, name=f"decode bs={bs}", owner="CudaGraphRunner",
                       static=static, state={"kv_buffer": self.attn_backend.kv_buffer})

    def replay(self, forward_batch: ForwardBatch, q_nope, q_pe, k):
        bs = forward_batch.batch_size                                         # a captured size: no padding
        self.req_pool_indices[:bs].copy_(forward_batch.req_pool_indices)
        self.seq_lens[:bs].copy_(forward_batch.seq_lens)
        self.out_cache_loc[:bs].copy_(forward_batch.out_cache_loc)
        self.q_nope[:bs].copy_(q_nope)
        self.q_pe[:bs].copy_(q_pe)
        self.k[:bs].copy_(k)
        self.attn_backend.init_forward_metadata_replay_cuda_graph(bs, self.req_pool_indices, self.seq_lens,
                                                                  forward_batch.seq_lens_cpu)
        return replay(self.graphs[bs], self.output_buffers[bs]).clone()


# --- the workload ---------------------------------------------------------------------------------------------

def _req_to_token(gen) -> torch.Tensor:
    """Each request slot owns PAGES_PER_REQ whole pages (a shuffled set); slot 0 maps every token to page 0."""
    order = torch.randperm(NUM_PAGES - 1, generator=gen) + 1
    req_to_token = torch.zeros(NUM_REQ_SLOTS, MAX_CONTEXT_LEN, dtype=torch.int64)
    pos = torch.arange(MAX_CONTEXT_LEN)
    for r in range(1, NUM_REQ_SLOTS):
        own = order[(r - 1) * PAGES_PER_REQ: r * PAGES_PER_REQ]
        req_to_token[r] = own[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
    return req_to_token


def run(variant: str, device: str = "cpu"):
    gen = generator(6998)
    req_to_token = _req_to_token(gen).to(device)
    kv_init = torch.randn(NUM_PAGES * PAGE_SIZE, KV_CACHE_DIM, generator=gen)
    kv_init[:PAGE_SIZE] = 0.0                                                # the padding page
    steps = []
    lens = dict(PROMPT_LENS)
    for slots in WORKLOAD:
        bs = len(slots)
        for r in slots:
            lens[r] += 1                                                     # the decoded token
        seq_lens = torch.tensor([lens[r] for r in slots], dtype=torch.int64)
        loc = torch.stack([req_to_token[r, lens[r] - 1].cpu() for r in slots])
        steps.append((torch.tensor(slots, dtype=torch.int64), seq_lens, loc,
                      torch.randn(bs, NUM_HEADS, KV_LORA_RANK, generator=gen),
                      torch.randn(bs, NUM_HEADS, QK_ROPE_HEAD_DIM, generator=gen),
                      torch.randn(bs, KV_CACHE_DIM, generator=gen)))

    def batches():
        for slots, seq_lens, loc, q_nope, q_pe, k in steps:
            fb = ForwardBatch(len(slots), slots.to(device), seq_lens.to(device), seq_lens, loc.to(device))
            yield fb, q_nope.to(device), q_pe.to(device), k.to(device)

    def serve(graphed: bool):
        backend = CutlassMLABackend(req_to_token, kv_init.clone().to(device), device, variant)
        outs = []
        if not graphed:                                                      # --disable-cuda-graph
            for fb, q_nope, q_pe, k in batches():
                backend.init_forward_metadata(fb)
                outs.append(backend.forward_decode(q_nope, q_pe, k, fb))
            return outs
        runner = CudaGraphRunner(backend, device)
        for fb, q_nope, q_pe, k in batches():
            outs.append(runner.replay(fb, q_nope, q_pe, k))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
