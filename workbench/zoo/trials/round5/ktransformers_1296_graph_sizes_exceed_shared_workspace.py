"""Graph sizes beyond ``chunk_size`` plan into a shared FlashInfer workspace sized for ``chunk_size`` tokens.

Upstream: https://github.com/kvcache-ai/ktransformers/pull/1296 ("fix-workspace-buffer": commit e8e83308,
"fix flashinfer float_workspace_buffer small").
Symptom: balance_serve with CUDA graphs on Qwen2/Qwen3-MoE: the FlashInfer float workspace is too small
(the commit's title) for the plan of the largest captured graph, so graph warmup fails with FlashInfer's
AlignedAllocator error; without graphs the server runs (KTransformers, May 2025; the next day b40f13ab
also deduplicated and sorted the size list).
Mechanism: ``flashInferAttn`` keeps one class-level ``float_workspace_buffer``, allocated by the first
instance with ``max_batch_token`` tokens' worth of space and reused by every later instance. The engine
creates that first instance with ``Config().chunk_size``, but ``generate_cuda_graphs`` lists capture sizes
beyond ``chunk_size`` (``[1, 2, 3, max_batch_size, 64, 256, 512, chunk_size]`` with ``chunk_size=256``,
unsorted), and ``ModelRunner.warmup`` builds a wrapper per graph with that graph's token count. The plan for
the largest graph needs split-KV partial outputs for more rows than the shared workspace holds.
Doctor: undersized-buffer, at ``plan`` (the split-KV scratch carved out of the float workspace).
Fix (upstream): create the ``ModelRunner`` first and size the first wrapper (hence the shared workspace)
with ``max(self.model_runner.cuda_graphs)``.
"""
from __future__ import annotations

import math

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/kvcache-ai/ktransformers/pull/1296"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "plan"
SYMPTOM = "graph capture fails: the largest graph's split-KV scratch does not fit the shared float workspace"

# Scaled from upstream by 1/32: chunk_size 256 -> 8, graph sizes 64/256/512 -> 2/8/16, 1024 -> 32.
VOCAB, HEADS, HEAD_DIM = 16, 2, 2
HIDDEN = HEADS * HEAD_DIM
CHUNK_SIZE = 8                  # Config().chunk_size
MAX_BATCH_SIZE = 4              # Config().max_batch_size
PAGE_SIZE, NUM_PAGES = 4, 8     # the last page is the padding page of the CUDA-graph rows
MAX_KV = 12                     # longest context this toy serves
NUM_KV_SPLITS = 2               # split-KV chunks per query row under CUDA graphs
WORKSPACE_PER_TOKEN = HEADS * NUM_KV_SPLITS * (HEAD_DIM + 1)   # "max_batch_token * 1024 * 1024" bytes upstream


def deduplicate_and_sort(lst):
    return sorted(set(lst))


def generate_cuda_graphs(chunk_size: int) -> list:
    assert chunk_size <= 32 or chunk_size % 32 == 0, "chunk_size must <= 32 or a multiple of 32"
    base_list = [1, 2, 3, MAX_BATCH_SIZE, 2, 8, 16, chunk_size]
    if chunk_size <= 32:
        return base_list
    multiples = [i for i in range(32, chunk_size + 1, 32)]
    return deduplicate_and_sort(base_list + multiples)


class AlignedAllocator:
    """FlashInfer's host-side carving of a workspace buffer into the plan's scratch regions."""

    def __init__(self, buf):
        self.buf, self.offset = buf, 0

    def aligned_alloc(self, numel, name):
        if self.offset + numel > self.buf.numel():
            raise RuntimeError(f"Failed to allocate memory for {name} with size {numel * 4} and alignment 16 in "
                               f"AlignedAllocator")
        view = self.buf[self.offset:self.offset + numel]
        self.offset += numel
        return view


class BatchPrefillWithPagedKVCacheWrapper:
    """The FlashInfer wrapper in CUDA-graph mode: the plan fixes the row count and carves the split-KV
    partial outputs (``tmp_v``, ``tmp_s``) out of the float workspace; ``run`` writes and merges them."""

    def __init__(self, float_workspace_buffer, use_cuda_graph):
        self._float_workspace_buffer = float_workspace_buffer
        self._use_cuda_graph = use_cuda_graph

    def plan(self, total_num_rows):
        allocator = AlignedAllocator(self._float_workspace_buffer)
        rows = total_num_rows
        self._tmp_v = allocator.aligned_alloc(HEADS * rows * NUM_KV_SPLITS * HEAD_DIM, "batch_prefill_tmp_v").view(
            rows, HEADS, NUM_KV_SPLITS, HEAD_DIM)
        self._tmp_s = allocator.aligned_alloc(HEADS * rows * NUM_KV_SPLITS, "batch_prefill_tmp_s").view(
            rows, HEADS, NUM_KV_SPLITS)

    def run(self, q, k_cache, v_cache, kv_slots, kv_len):
        """q: [rows, HEADS, HEAD_DIM]; keys of each row at ``kv_slots[row, :kv_len[row]]`` (causal)."""
        chunk = MAX_KV // NUM_KV_SPLITS
        pos = torch.arange(MAX_KV, device=q.device)
        k, v = k_cache[kv_slots], v_cache[kv_slots]                     # [rows, MAX_KV, HEADS, HEAD_DIM]
        s = (q[:, None] * k).sum(-1) / math.sqrt(HEAD_DIM)               # [rows, MAX_KV, HEADS]
        s = s.masked_fill((pos[None, :] >= kv_len[:, None])[..., None], float("-inf"))
        s = s.view(-1, NUM_KV_SPLITS, chunk, HEADS)
        m = s.amax(2).clamp(min=-1e30)                                    # [rows, splits, HEADS]
        p = torch.exp(s - m[:, :, None])
        o = (p[..., None] * v.view(-1, NUM_KV_SPLITS, chunk, HEADS, HEAD_DIM)).sum(2) / p.sum(2).clamp(min=1e-30)[..., None]
        self._tmp_v.copy_(o.permute(0, 2, 1, 3))                          # partial outputs per split
        self._tmp_s.copy_((m + torch.log(p.sum(2).clamp(min=1e-30))).permute(0, 2, 1))
        w = torch.softmax(self._tmp_s, -1)                                # merge the splits
        return (w[..., None] * self._tmp_v).sum(2)


class flashInferAttn:
    float_workspace_buffer = None

    def __init__(self, max_batch_token, max_batch_size, max_pages, device="cpu", use_cuda_graph=False):
        self.max_batch_token = max_batch_token
        if flashInferAttn.float_workspace_buffer is None:
            flashInferAttn.float_workspace_buffer = torch.empty(max_batch_token * WORKSPACE_PER_TOKEN, device=device)
        self.warpper = BatchPrefillWithPagedKVCacheWrapper(flashInferAttn.float_workspace_buffer, use_cuda_graph)

    def plan(self, num_tokens):
        self.warpper.plan(num_tokens)

    def forward(self, q, k_cache, v_cache, kv_slots, kv_len):
        return self.warpper.run(q, k_cache, v_cache, kv_slots, kv_len)


class KQwen3MoeForCausalLM:
    def __init__(self, device):
        gen = generator(1296)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.wq, self.wk, self.wv, self.wo = (randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6)
                                              for _ in range(4))
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.5)
        self.attn = {}
        self.k_cache = torch.zeros(NUM_PAGES * PAGE_SIZE, HEADS, HEAD_DIM, device=device)
        self.v_cache = torch.zeros(NUM_PAGES * PAGE_SIZE, HEADS, HEAD_DIM, device=device)

    def init_wrapper(self, use_cuda_graph, device, max_batch_token, max_batch_size, max_pages, cuda_graph_idx=0):
        self.attn[cuda_graph_idx] = flashInferAttn(max_batch_token=max_batch_token, max_batch_size=max_batch_size,
                                                   max_pages=max_pages, device=device, use_cuda_graph=use_cuda_graph)

    def flash_infer_attn_plan(self, num_tokens, cuda_graph_idx=0):
        self.attn[cuda_graph_idx].plan(num_tokens)

    def forward(self, features, page_idx, page_offset, kv_slots, kv_len, cuda_graph_idx=0):
        x = features
        q, k, v = ((x @ w).view(-1, HEADS, HEAD_DIM) for w in (self.wq, self.wk, self.wv))
        slots = page_idx * PAGE_SIZE + page_offset                       # append_paged_kv_cache
        self.k_cache[slots] = k
        self.v_cache[slots] = v
        o = self.attn[cuda_graph_idx].forward(q, self.k_cache, self.v_cache, kv_slots, kv_len)
        return (x + o.reshape(-1, HIDDEN) @ self.wo) @ self.lm_head


class ModelRunner:
    def __init__(self, model, device, use_cuda_graph, block_num):
        self.model, self.device, self.use_cuda_graph, self.block_num = model, device, use_cuda_graph, block_num
        self.cuda_graphs = generate_cuda_graphs(CHUNK_SIZE)
        self.graph_memory_pool = graph_pool_handle(device)
        n = len(self.cuda_graphs)
        self.features_buf = [torch.zeros(s, HIDDEN, device=device) for s in self.cuda_graphs]
        self.page_idx_buf = [torch.zeros(s, dtype=torch.int64, device=device) for s in self.cuda_graphs]
        self.page_offset_buf = [torch.zeros(s, dtype=torch.int64, device=device) for s in self.cuda_graphs]
        self.kv_slots_buf = [torch.zeros(s, MAX_KV, dtype=torch.int64, device=device) for s in self.cuda_graphs]
        self.kv_len_buf = [torch.zeros(s, dtype=torch.int64, device=device) for s in self.cuda_graphs]
        self.graphs, self.outputs_buf = [None] * n, [None] * n

    def _bufs(self, i):
        return {"features": self.features_buf[i], "page_idx": self.page_idx_buf[i],
                "page_offset": self.page_offset_buf[i], "kv_slots": self.kv_slots_buf[i], "kv_len": self.kv_len_buf[i]}

    def warmup(self):
        for i, num_tokens in enumerate(self.cuda_graphs):
            self.model.init_wrapper(self.use_cuda_graph, self.device, num_tokens, MAX_BATCH_SIZE, self.block_num, i)
            self.model.flash_infer_attn_plan(num_tokens, i)
            self.page_idx_buf[i].fill_(NUM_PAGES - 1)        # dummy batch: every row on the padding page
            b = self._bufs(i)
            self.graphs[i], self.outputs_buf[i] = capture(
                lambda b=b, i=i: self.model.forward(b["features"], b["page_idx"], b["page_offset"], b["kv_slots"],
                                                    b["kv_len"], cuda_graph_idx=i),
                device=self.device, pool=self.graph_memory_pool, warmups=2, name=f"cuda_graph {num_tokens}",
                static=b, state={"k_cache": self.model.k_cache, "v_cache": self.model.v_cache},
                owner="balance_serve ModelRunner")

    def run(self, features, page_idx, page_offset, kv_slots, kv_len):
        num_tokens = features.shape[0]
        if not self.use_cuda_graph:
            self.model.flash_infer_attn_plan(num_tokens, 0)
            return self.model.forward(features, page_idx, page_offset, kv_slots, kv_len)
        i = next(i for i, token in enumerate(self.cuda_graphs) if token >= num_tokens)
        b = self._bufs(i)
        b["features"][:num_tokens].copy_(features)
        b["page_idx"][:num_tokens].copy_(page_idx)
        b["page_idx"][num_tokens:].fill_(NUM_PAGES - 1)
        b["page_offset"][:num_tokens].copy_(page_offset)
        b["kv_slots"][:num_tokens].copy_(kv_slots)
        b["kv_len"][:num_tokens].copy_(kv_len)
        b["kv_len"][num_tokens:].fill_(0)
        self.model.flash_infer_attn_plan(self.cuda_graphs[i], i)
        stale = {"features": b["features"], "page_offset": b["page_offset"], "kv_slots": b["kv_slots"]}
        return replay(self.graphs[i], self.outputs_buf[i], real=num_tokens, size=self.cuda_graphs[i],
                      padded=stale)[:num_tokens].clone()


class Engine:
    def __init__(self, variant, use_cuda_graph, device):
        flashInferAttn.float_workspace_buffer = None          # a fresh server process
        self.model = KQwen3MoeForCausalLM(device)
        self.block_num = NUM_PAGES
        if variant == "fix":
            self.model_runner = ModelRunner(self.model, device, use_cuda_graph, self.block_num)
            self.model.init_wrapper(use_cuda_graph, device, max(self.model_runner.cuda_graphs), MAX_BATCH_SIZE,
                                    self.block_num)
        else:
            self.model.init_wrapper(use_cuda_graph, device, CHUNK_SIZE, MAX_BATCH_SIZE, self.block_num)
            self.model_runner = ModelRunner(self.model, device, use_cuda_graph, self.block_num)
        if use_cuda_graph:
            self.model_runner.warmup()


def schedule(device):
    """Steps of one prefill chunk plus decodes: (token ids, request pages, positions per token)."""
    pages = {0: [0, 1, 2], 1: [3, 4, 5]}
    steps = [[(0, 3, 0), (0, 5, 1), (0, 7, 2), (1, 2, 0), (1, 9, 1)],       # (request, token, position)
             [(0, 11, 3), (1, 4, 2)],
             [(0, 6, 4), (1, 1, 3), (1, 8, 4), (1, 10, 5)]]
    out = []
    for step in steps:
        ids = torch.tensor([t for _, t, _ in step], device=device)
        pos = torch.tensor([p for _, _, p in step], device=device)
        req_pages = [pages[r] for r, _, _ in step]
        page_idx = torch.tensor([pg[p // PAGE_SIZE] for pg, (_, _, p) in zip(req_pages, step)], device=device)
        page_offset = pos % PAGE_SIZE
        kv_slots = torch.tensor([[pg[min(j // PAGE_SIZE, len(pg) - 1)] * PAGE_SIZE + j % PAGE_SIZE
                                  for j in range(MAX_KV)] for pg in req_pages], device=device)
        out.append((ids, page_idx, page_offset, kv_slots, pos + 1))
    return out


def run(variant: str, device: str = "cpu"):
    def serve(use_cuda_graph: bool):
        engine = Engine(variant, use_cuda_graph, device)
        logits = []
        for ids, page_idx, page_offset, kv_slots, kv_len in schedule(device):
            features = engine.model.embed[ids]
            logits.append(engine.model_runner.run(features, page_idx, page_offset, kv_slots, kv_len))
        return logits

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
