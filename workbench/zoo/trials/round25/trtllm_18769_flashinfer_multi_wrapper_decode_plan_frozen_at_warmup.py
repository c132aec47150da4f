"""FlashInfer decode graphs of a multi-wrapper model replay the split-KV plan the warmup batch made.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/18769 ("[None][fix] Re-plan FlashInfer decode schedule on
page-table changes under CUDA graphs"), a follow-up to https://github.com/NVIDIA/TensorRT-LLM/pull/18002
("[None][fix] Stabilize Gemma4 FA2 CUDA Graph decode on Hopper"), which added the graph plan refresh.
Symptom: with the FlashInfer attention backend and CUDA graphs, a model with more than one decode wrapper (per-layer
sliding window plus global attention) decodes wrongly at batch size > 1 (every generation slot but the first)
while batch size 1 looks right; without CUDA graphs it is correct (TensorRT-LLM main, September 2026).
Mechanism: the FlashInfer decode kernel runs the split-KV tile schedule that ``plan()`` computed (the
request / KV-tile index lists and ``kv_chunk_size``, kept in the wrapper's own plan workspace); graph replay never
re-enters ``forward_impl``, so whatever plan is in the workspace is what every replay runs.
``FlashInferAttentionMetadata.prepare()`` refreshes the page table (``paged_kv_indptr_decode``,
``_paged_kv_indices``, ``_paged_kv_last_page_len``) every step. With one decode wrapper it also plans eagerly
there; with several, ``prepare()`` defers the plan to ``forward_impl`` (``_clean_cached_plans(defer_plan=True)``
only marks the wrappers unplanned) because the wrappers share a workspace. #18002 made ``prepare()`` re-plan a
graph wrapper from ``_refresh_fa2_cuda_graph_plans()`` when the generation page counts differ from the tuple
``fa2_plan_num_blocks`` recorded when it was planned, but ``_plan_with_params`` recorded that tuple only for a
graph tensor-core wrapper (``head_dim > 128``) labelled ``'fa2'``. The sliding-window/global wrappers resolve to
``'auto'`` with a small head_dim: no tuple, no refresh. Their only plan was the lazy one ``forward_impl`` made in
the CUDA-graph warmup (``_plan_with_params`` refuses to plan while capturing), for the warmup batch: one
``max_seq_len`` dummy in generation slot 0 and one-token dummies elsewhere. Every replay runs that schedule: slot
0 has enough tiles for any length, every other slot gets one tile and attends only its first ``kv_chunk_size``
tokens. An eager step re-plans in ``forward_impl`` for its own page counts.
Doctor: warmup-divergence, at ``forward_impl`` (the lazy ``plan()`` decided the split-KV schedule during the graph
warmup; replays reuse it while each eager step plans for its batch).
Fix (upstream): ``_records_fa2_plan(is_cuda_graph, backend)`` records the page tuple for every non-trtllm-gen decode
plan under CUDA graphs, ``prepare()`` calls ``_refresh_fa2_cuda_graph_plans()`` before ``_clean_cached_plans``,
and the cleanup keeps a wrapper that carries a page tuple planned (the refresh owns it).
(Read: the #18769 description, its two CPU test files and the review thread, plus the pre-fix ``flashinfer.py``
(``prepare`` / ``_clean_cached_plans`` / ``_plan_with_params`` / ``forward_impl``); not the #18769 diff of
``flashinfer.py`` itself. Tiny model: two attention layers, one head, decode only; FlashInfer's split-KV
scheduler is reduced to ``kv_chunk_size = page_size * ceil(max_pages / 2)`` and one tile per chunk, and the
partial states are merged with a plain sum of exponentials.)
"""
from __future__ import annotations

import dataclasses
import math

import torch

from workbench.engine import graph_pool_handle, host, synchronize
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/18769"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "forward_impl"
SYMPTOM = "multi-wrapper decode graphs replay the warmup's split-KV plan: slots past 0 attend only their first chunk"

VOCAB, HIDDEN, HEAD_DIM = 16, 8, 8
PAGE_SIZE, MAX_BLOCKS_PER_SEQ = 2, 5
MAX_SEQ_LEN = PAGE_SIZE * MAX_BLOCKS_PER_SEQ
BATCH_SIZE = 4                                   # the one generation CUDA-graph batch size
MAX_TILES = 2 * BATCH_SIZE                       # graph-mode padded tile count (at most 2 tiles per request)
NUM_PAGES = BATCH_SIZE * MAX_BLOCKS_PER_SEQ + MAX_BLOCKS_PER_SEQ + BATCH_SIZE - 1
WARMUP_STEPS = 2
LAYER_WINDOWS = [5, None]                        # layer 0: sliding window (window_left 5); layer 1: global


@dataclasses.dataclass(frozen=True)
class PlanParams:
    num_heads: int
    head_dim: int
    window_left: int
    attention_mask_data: object = None


@dataclasses.dataclass
class FlashInferWrappers:
    decode_wrapper: object = None
    is_planned: bool = False
    fa2_plan_num_blocks: tuple | None = None


def _records_fa2_plan(is_cuda_graph, backend, head_dim, variant):
    """Whether a decode plan records its generation page tuple for the CUDA-graph refresh."""
    if variant == "fix":
        return is_cuda_graph and backend != "trtllm-gen"
    return is_cuda_graph and head_dim > 128 and backend == "fa2"     # the graph tensor-core wrapper only


class BatchDecodeWithPagedKVCacheWrapper:
    """The slice of FlashInfer's decode wrapper that matters: ``plan()`` is host work that writes the split-KV
    schedule into the wrapper's int workspace (through its pinned staging buffer); ``run()`` is device work that
    reads that schedule and the page-table buffers it was bound to."""

    def __init__(self, device, paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer):
        self.device = device
        self._paged_kv_indptr_buf = paged_kv_indptr_buffer
        self._paged_kv_indices_buf = paged_kv_indices_buffer
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buffer
        self._int_workspace_buffer = torch.zeros(1 + 3 * MAX_TILES, dtype=torch.int32, device=device)
        self._pin_memory_int_workspace_buffer = host(torch.zeros(1 + 3 * MAX_TILES, dtype=torch.int32), device)
        self._token_offsets = torch.arange(MAX_SEQ_LEN, device=device)
        self._slots = torch.arange(BATCH_SIZE, device=device)
        self.backend = "auto"                    # what a small-head_dim, non-Hopper-fa2 wrapper resolves to

    def plan(self, num_blocks, page_size, window_left):
        """The scheduler (host): a chunk size from the longest request, one tile per chunk, padded to the graph's
        fixed tile count; then one copy of the schedule into the device workspace."""
        self.window_left = window_left
        kv_chunk_size = page_size * max(1, math.ceil(max(num_blocks) / 2))
        tiles = [(r, t) for r, n in enumerate(num_blocks) for t in range(math.ceil(n * page_size / kv_chunk_size))]
        valid = [1] * len(tiles) + [0] * (MAX_TILES - len(tiles))
        tiles += [(0, 0)] * (MAX_TILES - len(tiles))
        schedule = [kv_chunk_size] + [r for r, _ in tiles] + [t for _, t in tiles] + valid
        self._pin_memory_int_workspace_buffer.copy_(torch.tensor(schedule, dtype=torch.int32))
        self._int_workspace_buffer.copy_(self._pin_memory_int_workspace_buffer, non_blocking=True)

    def run(self, q, k_cache, v_cache, sm_scale):
        """Split-KV decode: each tile attends its chunk of one request's KV; partial states are merged."""
        ws = self._int_workspace_buffer
        chunk = ws[0].long()
        req = ws[1:1 + MAX_TILES].long()
        tile = ws[1 + MAX_TILES:1 + 2 * MAX_TILES].long()
        valid = ws[1 + 2 * MAX_TILES:1 + 3 * MAX_TILES] > 0
        indptr = self._paged_kv_indptr_buf.long()
        kv_len = (indptr[1:] - indptr[:-1] - 1) * PAGE_SIZE + self._paged_kv_last_page_len_buf.long()
        j = self._token_offsets
        pos = tile[:, None] * chunk + j[None, :]                                  # [tiles, chunk upper bound]
        length = kv_len[req][:, None]
        mask = (j[None, :] < chunk) & (pos < length) & valid[:, None]
        if self.window_left >= 0:
            mask = mask & (pos >= length - 1 - self.window_left)
        slot = (indptr[req][:, None] + pos // PAGE_SIZE).clamp(0, self._paged_kv_indices_buf.numel() - 1)
        page = self._paged_kv_indices_buf.long()[slot]
        k, v = k_cache[page, pos % PAGE_SIZE], v_cache[page, pos % PAGE_SIZE]   # [tiles, chunk, HEAD_DIM]
        w = torch.exp((k * q[req][:, None, :]).sum(-1) * sm_scale) * mask
        o_tile, s_tile = (w[..., None] * v).sum(1), w.sum(1)
        onehot = ((req[:, None] == self._slots[None, :]) & valid[:, None]).to(q.dtype)   # [tiles, batch]
        return (onehot.t() @ o_tile) / (onehot.t() @ s_tile[:, None])


class FlashInferAttentionMetadata:
    def __init__(self, device, variant, is_cuda_graph):
        self.device, self.variant, self.is_cuda_graph = device, variant, is_cuda_graph
        self.page_size = PAGE_SIZE
        self.num_contexts = 0
        self.paged_kv_indptr_decode = torch.zeros(BATCH_SIZE + 1, dtype=torch.int32, device=device)
        self._paged_kv_indices = torch.zeros(BATCH_SIZE * MAX_BLOCKS_PER_SEQ, dtype=torch.int32, device=device)
        self._paged_kv_last_page_len = torch.zeros(BATCH_SIZE, dtype=torch.int32, device=device)
        self._plan_params_to_wrappers: dict[PlanParams, FlashInferWrappers] = {}
        self.num_blocks: list[int] = []

    def prepare(self, kv_lens, block_ids_per_seq):
        """Per step (host): the page table of the generation requests, copied into the persistent buffers."""
        self.num_blocks = [math.ceil(n / self.page_size) for n in kv_lens]
        indices = [b for blocks, n in zip(block_ids_per_seq, self.num_blocks) for b in blocks[:n]]
        indptr = [0]
        for n in self.num_blocks:
            indptr.append(indptr[-1] + n)
        last = [n - (m - 1) * self.page_size for n, m in zip(kv_lens, self.num_blocks)]
        t = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
        self._paged_kv_indices[:len(indices)].copy_(t(indices), non_blocking=True)
        self.paged_kv_indptr_decode.copy_(t(indptr), non_blocking=True)
        self._paged_kv_last_page_len.copy_(t(last), non_blocking=True)
        active_wrappers = [pp for pp in self._plan_params_to_wrappers if pp.attention_mask_data is None]
        defer_plan = len(active_wrappers) > 1   # a shared workspace: plan lazily in forward_impl
        if self.variant == "fix":
            self._refresh_fa2_cuda_graph_plans()
        self._clean_cached_plans(defer_plan=defer_plan)

    def _refresh_fa2_cuda_graph_plans(self):
        gen_blocks = tuple(self.num_blocks[self.num_contexts:])
        for plan_params, wrappers in self._plan_params_to_wrappers.items():
            if plan_params.attention_mask_data is not None or wrappers.fa2_plan_num_blocks is None:
                continue
            if wrappers.fa2_plan_num_blocks != gen_blocks:
                wrappers.is_planned = False
                self._plan_with_params(plan_params)

    def _clean_cached_plans(self, *, defer_plan):
        for plan_params, wrappers in self._plan_params_to_wrappers.items():
            if self.variant == "fix" and wrappers.fa2_plan_num_blocks is not None:
                continue                        # the refresh owns a graph-captured wrapper
            wrappers.is_planned = False
            if not defer_plan:
                self._plan_with_params(plan_params)

    def needs_plan(self, plan_params):
        wrappers = self._plan_params_to_wrappers.get(plan_params)
        return wrappers is None or not wrappers.is_planned

    def plan(self, num_heads, head_dim, attention_window_size):
        plan_params = PlanParams(num_heads=num_heads, head_dim=head_dim,
                                 window_left=-1 if attention_window_size is None else attention_window_size)
        return self._plan_with_params(plan_params)

    def _plan_with_params(self, plan_params):
        if not self.needs_plan(plan_params):
            return plan_params
        if self.is_cuda_graph and torch.cuda.is_current_stream_capturing():
            raise ValueError("Cannot plan() for flashinfer kernels while stream is capturing. "
                             "Make sure you run a few warmup runs before capturing the graph!")
        wrappers = self._plan_params_to_wrappers.get(plan_params) or FlashInferWrappers(
            decode_wrapper=BatchDecodeWithPagedKVCacheWrapper(
                self.device, self.paged_kv_indptr_decode, self._paged_kv_indices, self._paged_kv_last_page_len))
        synchronize(self.device)                # "Must sync after append_paged_kv_cache and before plan."
        decode_wrapper = wrappers.decode_wrapper
        decode_wrapper.plan(self.num_blocks[self.num_contexts:], self.page_size, plan_params.window_left)
        wrappers.is_planned = True
        if _records_fa2_plan(self.is_cuda_graph, decode_wrapper.backend, plan_params.head_dim, self.variant):
            wrappers.fa2_plan_num_blocks = tuple(self.num_blocks[self.num_contexts:])
        self._plan_params_to_wrappers[plan_params] = wrappers
        return plan_params


class FlashInferAttention:
    def __init__(self, layer_idx, window, device, gen):
        self.layer_idx, self.window = layer_idx, window
        self.wq = randn(HIDDEN, HEAD_DIM, gen=gen, device=device, scale=0.5)
        self.wk = randn(HIDDEN, HEAD_DIM, gen=gen, device=device, scale=0.5)
        self.wv = randn(HIDDEN, HEAD_DIM, gen=gen, device=device, scale=0.5)
        self.wo = randn(HEAD_DIM, HIDDEN, gen=gen, device=device, scale=0.5)

    def forward_impl(self, h, metadata, k_cache, v_cache):
        q, k, v = h @ self.wq, h @ self.wk, h @ self.wv
        # the decode token's KV goes to position kv_len - 1 (append_paged_kv_cache)
        indptr = metadata.paged_kv_indptr_decode.long()
        last = metadata._paged_kv_last_page_len.long()
        page = metadata._paged_kv_indices.long()[indptr[1:] - 1]
        k_cache[page, last - 1] = k
        v_cache[page, last - 1] = v
        plan_params = metadata.plan(1, HEAD_DIM, attention_window_size=self.window)   # lazy: a no-op once planned
        wrapper = metadata._plan_params_to_wrappers[plan_params].decode_wrapper
        return wrapper.run(q, k_cache, v_cache, 1.0 / math.sqrt(HEAD_DIM)) @ self.wo


class Gemma3LikeModel:
    def __init__(self, device):
        gen = generator(18769)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.layers = [FlashInferAttention(i, w, device, gen) for i, w in enumerate(LAYER_WINDOWS)]
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.5)

    def forward(self, input_ids, metadata, kv_caches):
        h = self.embed[input_ids]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            h = h + layer.forward_impl(h, metadata, k_cache, v_cache)
        return h @ self.lm_head


def make_kv_caches(device):
    gen = generator(7)
    return [(randn(NUM_PAGES, PAGE_SIZE, HEAD_DIM, gen=gen, device=device),
             randn(NUM_PAGES, PAGE_SIZE, HEAD_DIM, gen=gen, device=device)) for _ in LAYER_WINDOWS]


REAL_BLOCKS = [list(range(r * MAX_BLOCKS_PER_SEQ, (r + 1) * MAX_BLOCKS_PER_SEQ)) for r in range(BATCH_SIZE)]
DUMMY_FIRST = BATCH_SIZE * MAX_BLOCKS_PER_SEQ
# warmup batch: a max_seq_len dummy in generation slot 0, one-token dummies elsewhere (their own pages)
WARMUP_KV_LENS = [MAX_SEQ_LEN] + [1] * (BATCH_SIZE - 1)
WARMUP_BLOCKS = [list(range(DUMMY_FIRST, DUMMY_FIRST + MAX_BLOCKS_PER_SEQ))] + [
    [DUMMY_FIRST + MAX_BLOCKS_PER_SEQ + i] for i in range(BATCH_SIZE - 1)]
CONTEXT_LENS = [4, 7, 3, 6]                       # tokens already in the cache before the first decode step
STEP_TOKENS = [[3, 5, 7, 9], [11, 2, 4, 6], [8, 10, 12, 14]]


class CUDAGraphRunner:
    def __init__(self, model, device, variant, kv_caches):
        self.model, self.kv_caches = model, kv_caches
        self.attn_metadata = FlashInferAttentionMetadata(device, variant, is_cuda_graph=True)
        self.input_ids = torch.zeros(BATCH_SIZE, dtype=torch.long, device=device)
        self.attn_metadata.prepare(WARMUP_KV_LENS, WARMUP_BLOCKS)
        md = self.attn_metadata
        self.graph, self.output = capture(
            lambda: model.forward(self.input_ids, md, kv_caches), device=device, pool=graph_pool_handle(device),
            warmups=WARMUP_STEPS, name=f"generation bs={BATCH_SIZE}", owner="CUDAGraphRunner",
            static={"input_ids": self.input_ids, "paged_kv_indptr_decode": md.paged_kv_indptr_decode,
                    "_paged_kv_indices": md._paged_kv_indices, "_paged_kv_last_page_len": md._paged_kv_last_page_len},
            state={f"kv_cache[{i}].{kv}": c for i, pair in enumerate(kv_caches) for kv, c in zip("kv", pair)})

    def step(self, tokens, kv_lens):
        self.attn_metadata.prepare(kv_lens, REAL_BLOCKS)
        self.input_ids.copy_(torch.tensor(tokens, dtype=torch.long))
        return replay(self.graph, self.output).clone()


def run(variant: str, device: str = "cpu"):
    model = Gemma3LikeModel(device)

    def serve(graphed: bool):
        kv_caches = make_kv_caches(device)
        if graphed:
            runner = CUDAGraphRunner(model, device, variant, kv_caches)
            forward = runner.step
        else:
            metadata = FlashInferAttentionMetadata(device, variant, is_cuda_graph=False)

            def forward(tokens, kv_lens):
                metadata.prepare(kv_lens, REAL_BLOCKS)
                ids = torch.tensor(tokens, dtype=torch.long).to(device)
                return model.forward(ids, metadata, kv_caches).clone()
        outs = []
        for step, tokens in enumerate(STEP_TOKENS, start=1):
            outs.append(forward(tokens, [n + step for n in CONTEXT_LENS]))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
